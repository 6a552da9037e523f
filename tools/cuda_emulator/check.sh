#!/bin/bash
# The quick check CI runs (about 40 s): privleak's CUDA kernels (every csrc/cuda file but the TF32
# tensor-core path of nearest.cu, which WMMA would need), compiled as host C++ on an emulator of CUDA's execution model (blocks, threads, shared memory,
# __syncthreads, warp shuffles), give the CPU kernels' bits on every case of test.py. It checks the
# kernels' logic (indexing, grouping, workspace bounds: each buffer has guard bytes) on a machine
# without a GPU; it cannot check what nvcc makes of them. run.sh is the thorough run.
set -euo pipefail
EMU=$(cd "$(dirname "$0")" && pwd)
OUT=${EMU_OUT:-$EMU/../../build/cuda_emulator}
driver=$("$EMU/build.sh" plain | tail -1)
mkdir -p "$OUT/work/check"
python3 "$EMU/test.py" --driver "$driver" --workdir "$OUT/work/check" \
  --only ghost_single,ghost_extra,ghost_mixed,ghost_long,conv,embedding,noise,secure,clip,factors,conv_grads,vmf,\
column_stats,nearest
