#!/bin/bash
# The quick check CI runs (about 30 s): privleak's CUDA ghost-norm, noise and secure-noise kernels,
# compiled as host C++ on an emulator of CUDA's execution model (blocks, threads, shared memory,
# __syncthreads, warp shuffles), give the CPU kernels' bits on every case of test.py. It checks the
# kernels' logic (indexing, grouping, workspace bounds: each buffer has guard bytes) on a machine
# without a GPU; it cannot check what nvcc makes of them. run.sh is the thorough run.
set -euo pipefail
EMU=$(cd "$(dirname "$0")" && pwd)
OUT=${EMU_OUT:-$EMU/../../build/cuda_emulator}
driver=$("$EMU/build.sh" plain | tail -1)
mkdir -p "$OUT/work/check"
python3 "$EMU/test.py" --driver "$driver" --workdir "$OUT/work/check" \
  --only ghost_single,ghost_extra,ghost_mixed,ghost_long,conv,embedding,noise,secure
