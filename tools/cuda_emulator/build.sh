#!/bin/bash
# build.sh VARIANT [prep.py --mutate args...]
# VARIANT: plain | asan (ASan+UBSan) | tsan | pattern (-ftrivial-auto-var-init=pattern)
# Sources are regenerated from csrc/cuda/*.cu into $OUT/build/VARIANT/src (mutations apply to ghost_norm.cu
# when MUTATE_FILE is unset, else to $MUTATE_FILE's basename).
set -euo pipefail
EMU=$(cd "$(dirname "$0")" && pwd)
OUT=${EMU_OUT:-$EMU/../../build/cuda_emulator}  # builds, work files and logs (ignored by git)
REPO=$EMU/../..
V=${1:-plain}; shift || true
B=$OUT/build/$V${BUILD_SUFFIX:-}
mkdir -p $B/src
MF=${MUTATE_FILE:-ghost_norm}
SOURCES="ghost_norm noise secure_noise device clip vmf conv_grads column_stats nearest"
for f in $SOURCES; do
  if [ "$f" = "$MF" ] && [ $# -gt 0 ]; then python3 $EMU/prep.py $REPO/csrc/cuda/$f.cu $B/src/$f.cpp "$@"
  else python3 $EMU/prep.py $REPO/csrc/cuda/$f.cu $B/src/$f.cpp; fi
done
FLAGS="-std=c++17 -g -ffp-contract=off -fno-math-errno -Wall -Wno-unknown-pragmas -Wno-unused-function -I$EMU/shim -I$REPO/csrc -include $EMU/shim/emu.h -pthread"
case $V in
  plain) FLAGS="$FLAGS -O2";;
  asan) FLAGS="$FLAGS -O1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined";;
  tsan) FLAGS="$FLAGS -O1 -fsanitize=thread";;
  pattern) FLAGS="$FLAGS -O2 -ftrivial-auto-var-init=pattern";;
  *) echo "unknown variant $V"; exit 2;;
esac
objs=()
for f in $(for s in $SOURCES; do echo $B/src/$s.cpp; done) $EMU/shim/emu_runtime.cpp $EMU/driver.cpp; do
  o=$B/$(basename $f .cpp).o
  ${CXX:-g++} $FLAGS -c $f -o $o &
  objs+=($o)
done
wait
${CXX:-g++} $FLAGS ${objs[@]} -o $B/driver
echo $B/driver
