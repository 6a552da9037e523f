#!/bin/bash
# Emulator self-test: each mutation of a generated copy of a source must make the comparison fail
# (or the emulator / sanitizer report an error). Originals are never touched.
# selftest.sh [plain|asan]
EMU=$(cd "$(dirname "$0")" && pwd)
OUT=${EMU_OUT:-$EMU/../../build/cuda_emulator}  # builds, work files and logs (ignored by git)
V=${1:-plain}
pass=0; fail=0
mut() {  # name file suites old new
  local name=$1 file=$2 suites=$3 old=$4 new=$5
  BUILD_SUFFIX=-mut MUTATE_FILE=$file $EMU/build.sh $V --mutate "$old" "$new" > $OUT/work/mut_build.log 2>&1 || { echo "SELFTEST BUILD FAILED: $name"; tail -5 $OUT/work/mut_build.log; fail=$((fail+1)); return; }
  if python3 $EMU/test.py --quick --driver $OUT/build/$V-mut/driver --only $suites --workdir $OUT/work > $OUT/work/mut_$name.log 2>&1; then
    echo "SELFTEST NOT DETECTED: $name"; fail=$((fail+1))
  else
    echo "selftest detected: $name -> $(grep -m1 -E '^FAIL|EMU ERROR|AddressSanitizer|runtime error|canary' $OUT/work/mut_$name.log | cut -c1-150)"; pass=$((pass+1))
  fi
}
mkdir -p $OUT/work
mut tile_partial_diag ghost_norm ghost_single 's0 + c < t; ++c)' 's0 + c <= t; ++c)'
mut row_tiles_off_by_one ghost_norm ghost_single 'j <= row % length / kTile' 'j < row % length / kTile'
mut missing_syncthreads ghost_norm ghost_single $'      }\n      __syncthreads();\n    }\n#pragma unroll' $'      }\n    }\n#pragma unroll'
mut divergent_syncthreads ghost_norm ghost_single $'  }\n  __syncthreads();\n  double partial = 0.0;' $'  }\n  if (threadIdx.x < 128) __syncthreads();\n  double partial = 0.0;'
mut workspace_overflow ghost_norm ghost_single 'double* partials = diagonals + 2 * rows;' 'double* partials = diagonals + 2 * rows + 1;'
mut group_ignores_dtype ghost_norm ghost_mixed '&& layers[next].dtype == layers[first].dtype;' '&& true;'
mut scratch_budget ghost_norm ghost_long 'if (n > 0 && (bytes + more > scratch ||' 'if (n > 0 && (bytes + more > 2 * scratch ||'
mut noise_block_off_by_one noise noise 'first_noise_block(list.offset[i], k) + static_cast<uint64_t>(j),' 'first_noise_block(list.offset[i], k) + static_cast<uint64_t>(j) + 1,'
mut secure_element_off_by_one secure_noise secure 'list.offset[i] + static_cast<uint64_t>(j))));' 'list.offset[i] + static_cast<uint64_t>(j) + 1)));'
mut shared_overflow ghost_norm ghost_single 'layer_diagonals[2 * (b * length + t)] = diag_a[threadIdx.x];' 'layer_diagonals[2 * (b * length + t)] = diag_a[threadIdx.x + 1];'
mut shfl_lane ghost_norm embedding 'lanes[l] = __shfl_sync(0xffffffffu, acc, l);' 'lanes[l] = __shfl_sync(0xffffffffu, acc, (l + 1) % 32);'
mut clip_last_chunk clip clip 'for (int64_t c = 0; c < chunks; ++c) sum += p[c];' 'for (int64_t c = 0; c + 1 < chunks; ++c) sum += p[c];'
mut clip_locate clip clip 'g.starts[t + 1] <= item) ++t;' 'g.starts[t + 1] < item) ++t;'
mut clip_missing_syncthreads clip clip $'lanes[threadIdx.x] = sum;\n  __syncthreads();' 'lanes[threadIdx.x] = sum;'
mut vmf_tangent_coordinate vmf vmf 'static_cast<double>(z), static_cast<double>(mu[i + 1])' 'static_cast<double>(z), static_cast<double>(mu[i])'
mut conv_grads_width conv_grads conv_grads 'inside = i >= 0 && i < c.height && j >= 0 && j < c.width;' 'inside = i >= 0 && i < c.height && j >= 0 && j <= c.width;'
mut conv_grads_tiled_width conv_grads conv_grads 'col.valid && i >= 0 && i < c.height && j >= 0 && j < c.width;' 'col.valid && i >= 0 && i < c.height && j >= 0 && j <= c.width;'
mut conv_grads_tiled_signed_zero conv_grads conv_grads 'Acc value = live ? Acc(0) : -Acc(0);' 'Acc value = Acc(0);'
mut conv_grads_tiled_missing_syncthreads conv_grads conv_grads $'        }\n        __syncthreads();\n      }\n#pragma unroll' $'        }\n      }\n#pragma unroll'
mut column_stats_fold column_stats column_stats 'for (int64_t chunk = 1; chunk < num_chunks; ++chunk)' 'for (int64_t chunk = 2; chunk < num_chunks; ++chunk)'
mut nearest_lanes nearest nearest 'for (int offset = width / 2; offset > 0; offset /= 2)' 'for (int offset = width / 4; offset > 0; offset /= 2)'
mut nearest_missing_syncthreads nearest nearest $'      __syncthreads();\n    }\n#pragma unroll\n    for (int j = 0; j < TN; ++j) {' $'    }\n#pragma unroll\n    for (int j = 0; j < TN; ++j) {'
echo "selftest: $pass detected, $fail not detected"
[ $fail -eq 0 ]
