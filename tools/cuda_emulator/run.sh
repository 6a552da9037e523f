#!/bin/bash
# The thorough run (about 30 minutes on 2 cores):  bash tools/cuda_emulator/run.sh [quick]
# Builds the emulated CUDA sources (from csrc/cuda/*.cu, never modified) plain, with ASan+UBSan,
# with TSan and with pattern-initialised locals, and compares them bit for bit with privleak's CPU
# ops, in other block orders, shared-memory fills and small grids, then runs the self-test.
# Logs in $OUT/logs. Exit 1 on any failure.
set -u
EMU=$(cd "$(dirname "$0")" && pwd)
OUT=${EMU_OUT:-$EMU/../../build/cuda_emulator}
mkdir -p "$OUT/logs" "$OUT/work"
OUT=$(cd "$OUT" && pwd)
cd "$EMU"
Q=${1:-full}
status=0
step() {  # name, command...
  local name=$1; shift
  local t0=$(date +%s)
  if "$@" > $OUT/logs/$name.log 2>&1; then r=ok; else r=FAILED; status=1; fi
  printf "%-34s %-7s %4ss  %s\n" "$name" "$r" $(( $(date +%s) - t0 )) "$(grep -m1 -E '^SUMMARY|^selftest:' $OUT/logs/$name.log)"
}
ALL=ghost_single,ghost_extra,ghost_mixed,ghost_long,conv,embedding,noise,secure,clip,factors,conv_grads,vmf,column_stats,nearest
export ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export TSAN_OPTIONS=halt_on_error=1
for v in plain asan tsan pattern; do step build_$v ./build.sh $v; done
if [ "$Q" = quick ]; then
  step plain_fibers python3 test.py --driver $OUT/build/plain/driver --only $ALL --workdir $OUT/work/plain
  step asan_fibers_quick python3 test.py --quick --driver $OUT/build/asan/driver --only $ALL --workdir $OUT/work/asan
else
  step plain_fibers python3 test.py --driver $OUT/build/plain/driver --only $ALL,ghost_bigbatch --workdir $OUT/work/plain
  step asan_fibers python3 test.py --driver $OUT/build/asan/driver --only $ALL,ghost_bigbatch --workdir $OUT/work/asan
fi
step tsan_threads_quick env EMU_MODE=threads python3 test.py --quick --driver $OUT/build/tsan/driver --only $ALL --workdir $OUT/work/tsan
step plain_threads_quick env EMU_MODE=threads python3 test.py --quick --driver $OUT/build/plain/driver --only ${ALL/ghost_long,/} --workdir $OUT/work/thr
step pattern_init_quick python3 test.py --quick --driver $OUT/build/pattern/driver --only $ALL --workdir $OUT/work/pattern
step reverse_poison0_quick env EMU_ORDER=reverse EMU_POISON=0 python3 test.py --quick --driver $OUT/build/plain/driver --only $ALL --workdir $OUT/work/rev
step shuffle_poison7f_quick env EMU_ORDER=shuffle EMU_SEED=7 EMU_POISON=0x7f python3 test.py --quick --driver $OUT/build/plain/driver --only $ALL --workdir $OUT/work/shuf
# Grid-stride / sample loops forced (1-3 blocks, gridDim.y = 1 or 2) in generated copies:
step build_small_grids bash -c "BUILD_SUFFIX=-g1 MUTATE_FILE=ghost_norm ./build.sh plain --mutate '(threads + kThreads - 1) / kThreads, 65536)' '(threads + kThreads - 1) / kThreads, 1)' --mutate 'std::min<int64_t>(batch, 65535)' 'std::min<int64_t>(batch, 2)' && BUILD_SUFFIX=-g2 MUTATE_FILE=noise ./build.sh plain --mutate 'kMaxGridBlocks = 65536;' 'kMaxGridBlocks = 3;' && BUILD_SUFFIX=-g3 MUTATE_FILE=secure_noise ./build.sh plain --mutate 'blocks < 65536 ? blocks : 65536' 'blocks < 3 ? blocks : 3'"
step build_small_grids_2 bash -c "BUILD_SUFFIX=-g4 MUTATE_FILE=clip ./build.sh plain --mutate 'std::min(blocks_for(g.starts[g.count]), 65536u)' 'std::min(blocks_for(g.starts[g.count]), 3u)' && BUILD_SUFFIX=-g5 MUTATE_FILE=vmf ./build.sh plain --mutate 'blocks < 65536 ? blocks : 65536' 'blocks < 3 ? blocks : 3' && BUILD_SUFFIX=-g6 MUTATE_FILE=conv_grads ./build.sh plain --mutate '(total + kThreads - 1) / kThreads, 65536)' '(total + kThreads - 1) / kThreads, 3)' --mutate 'kGridCap = 65535;' 'kGridCap = 2;'"
step small_grids_ghost python3 test.py --driver $OUT/build/plain-g1/driver --only ghost_single,ghost_extra,ghost_mixed,ghost_long,conv,embedding --workdir $OUT/work/g1
step small_grids_noise python3 test.py --driver $OUT/build/plain-g2/driver --only noise --workdir $OUT/work/g2
step small_grids_secure python3 test.py --driver $OUT/build/plain-g3/driver --only secure --workdir $OUT/work/g3
step small_grids_clip python3 test.py --driver $OUT/build/plain-g4/driver --only clip --workdir $OUT/work/g4
step small_grids_vmf python3 test.py --driver $OUT/build/plain-g5/driver --only vmf --workdir $OUT/work/g5
step small_grids_conv_grads python3 test.py --driver $OUT/build/plain-g6/driver --only conv_grads --workdir $OUT/work/g6
step selftest_plain ./selftest.sh plain
echo "overall: $([ $status -eq 0 ] && echo ALL OK || echo FAILURES, see $OUT/logs)"
exit $status
