// CUDA ghost norms, the CPU's arithmetic in the CPU's order (common/ghost_norm.h).
//
// Dense form: one block per pair of 64-row tile t and 64-column tile s <= t of a sample (the blocks
// of one pair loop over the samples past 65535). A call's layers share launches: they are cut into
// groups (consecutive, of one dtype, at most kGroupLayers, their scratch within the workspace),
// each group's tile pairs, rows and samples one launch each, every layer's blocks side by side, so
// that a model's layers at a small batch fill the GPU together (one layer's did not: 3 tile pairs
// of 8 samples are 24 blocks) and a step launches a few kernels, not three a layer. A block finds
// its layer in the group's table (a kernel argument). It computes the a-Gram and then the g-Gram
// tile as a classic shared-memory SGEMM (16 x 16 threads, 4 x 4 entries each, kStep coordinates per
// step), every entry one thread's fma chain in coordinate order, restarted per kGhostChunk and
// added to a double. The products w_ts go to shared memory, and thread t adds its row's in order of
// s into the tile's partial sum, stored; one thread per row then adds its tiles' partials in order,
// as the CPU does (common/ghost_norm.h's row tiles). No tensor cores (their accumulation order is
// not specified) and no atomics. Zero padding past n only adds fma(0, 0, acc) = acc + 0 to the last
// chunk, which can turn a -0 chain into +0; adding the chunk to its double (which starts at +0)
// gives the same +0 either way.
//
// Convolution form: one block per (sample, 64 x 64 tile of the pixel Gram's lower triangle) stores
// the pixel Gram in the workspace by the same tile code (the input read channels-first); then one
// block per (sample, 64 rows t) walks the column tiles up to its own in order, each thread summing
// its 4 x 4 entries a_t . a_s from the pixel Gram by conv_patch_gram, and adds each tile's partial
// sum (as in the dense form) to the row's `below`.
//
// Embedding form: one thread per (sample, position) finds whether the position leads its group
// and the next position with its id; one warp per leading position sums its group's rows, lane l
// taking coordinates j = l mod 32 as the CPU's lanes do; the lanes are added in order.
//
// Then one thread per sample adds its rows in order. All launches queue on the caller's stream.
#include "cuda/ghost_norm.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "cuda/device.h"

namespace privleak::cuda {
namespace {

constexpr int kTile = 64;  // rows t of a block, and columns s of each tile it walks
constexpr int kThreads = 256;
constexpr int kSub = 4;  // entries per thread along each side of a tile: 16 x 4 = kTile
static_assert(kTile == kGhostRowTile, "a block's column tile is the row tile of common/ghost_norm.h");
static_assert(16 * kSub == kTile && 16 * 16 == kThreads, "one thread per 4 x 4 entries of a 64 x 64 tile");

// Coordinates per shared-memory step: 16 floats or 8 doubles, so that the float64 kernel's
// shared memory fits in 48 KiB as well. Steps never straddle a chunk.
template <class Acc>
constexpr int kStep = 64 / static_cast<int>(sizeof(Acc));
static_assert(kGhostChunk % kStep<float> == 0 && kGhostChunk % kStep<double> == 0, "steps must tile chunks");

// tot[i][j] = Gram entry (t0 + ty + 16 i, s0 + tx + 16 j) of x (length rows of n coordinates;
// coordinate k of row r at x[r row_stride + k coord_stride]: row-major, or channels-first).
template <class In, class Acc>
__device__ void gram_tile(const In* x, int64_t length, int64_t n, int64_t row_stride, int64_t coord_stride,
                          int64_t t0, int64_t s0, Acc (*rows)[kTile + 1], Acc (*cols)[kTile + 1],
                          double (&tot)[kSub][kSub]) {
  constexpr int K = kStep<Acc>;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
  for (int i = 0; i < kSub; ++i)
#pragma unroll
    for (int j = 0; j < kSub; ++j) tot[i][j] = 0.0;
  for (int64_t c0 = 0; c0 < n; c0 += kGhostChunk) {
    const int64_t c1 = min(c0 + kGhostChunk, n);
    Acc acc[kSub][kSub];
#pragma unroll
    for (int i = 0; i < kSub; ++i)
#pragma unroll
      for (int j = 0; j < kSub; ++j) acc[i][j] = Acc(0);
    for (int64_t k0 = c0; k0 < c1; k0 += K) {
      for (int e = threadIdx.x; e < kTile * K; e += kThreads) {
        // Neighbouring threads read neighbouring addresses: along a row, or along the rows.
        const int r = coord_stride == 1 ? e / K : e % kTile, kk = coord_stride == 1 ? e % K : e / kTile;
        const int64_t k = k0 + kk;
        rows[kk][r] = k < c1 && t0 + r < length
                          ? static_cast<Acc>(Element<In>::load(x[(t0 + r) * row_stride + k * coord_stride]))
                          : Acc(0);
        cols[kk][r] = k < c1 && s0 + r < length
                          ? static_cast<Acc>(Element<In>::load(x[(s0 + r) * row_stride + k * coord_stride]))
                          : Acc(0);
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < K; ++kk) {
        Acc a[kSub], b[kSub];
#pragma unroll
        for (int i = 0; i < kSub; ++i) a[i] = rows[kk][ty + 16 * i];
#pragma unroll
        for (int j = 0; j < kSub; ++j) b[j] = cols[kk][tx + 16 * j];
#pragma unroll
        for (int i = 0; i < kSub; ++i)
#pragma unroll
          for (int j = 0; j < kSub; ++j) acc[i][j] = ghost_fma(a[i], b[j], acc[i][j]);
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < kSub; ++i)
#pragma unroll
      for (int j = 0; j < kSub; ++j) tot[i][j] += static_cast<double>(acc[i][j]);
  }
}

// A tile pair's products w_ts (rows t0 + r, columns s0 + c) into shared memory, and the diagonal's
// Gram entries into diag_a and diag_g. Returns, to threads r < kTile, row t0 + r's sum of the
// tile's w_ts with s < t, added in order of s from +0 (common/ghost_norm.h's row tile).
__device__ double tile_partial(const double (&aa)[kSub][kSub], const double (&gg)[kSub][kSub], int64_t t0, int64_t s0,
                               double (*products)[kTile + 1], double* diag_a, double* diag_g) {
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
  for (int i = 0; i < kSub; ++i) {
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      const int r = ty + 16 * i, c = tx + 16 * j;
      products[r][c] = aa[i][j] * gg[i][j];
      if (s0 + c == t0 + r) {
        diag_a[r] = aa[i][j];
        diag_g[r] = gg[i][j];
      }
    }
  }
  __syncthreads();
  double partial = 0.0;
  if (threadIdx.x < kTile) {
    const int64_t t = t0 + threadIdx.x;
    for (int c = 0; c < kTile && s0 + c < t; ++c) partial += products[threadIdx.x][c];
  }
  __syncthreads();
  return partial;
}

// A group of layers launched together. Layer k's tile pairs are blocks first_pair[k] ..
// first_pair[k + 1] - 1; its (sample, position) rows are items first_row[k] .. first_row[k + 1] - 1
// of the group's rows and Gram diagonals (two a row), its rows' partial sums start at
// first_partial[k], and its samples' norms go to out[k batch + b].
constexpr int kGroupLayers = 32;
struct GhostGroup {
  const void* activations[kGroupLayers];
  const void* output_grads[kGroupLayers];
  int64_t length[kGroupLayers], d[kGroupLayers], p[kGroupLayers], tiles[kGroupLayers];
  int64_t first_pair[kGroupLayers + 1], first_row[kGroupLayers + 1], first_partial[kGroupLayers + 1];
  int layers;
};
static_assert(sizeof(GhostGroup) <= 4096, "a kernel's arguments are at most 4 KiB");

// The layer k of the group whose range [first[k], first[k + 1]) holds item i < first[layers].
__device__ int layer_of(const int64_t* first, int layers, int64_t i) {
  int k = 0;
  while (k + 1 < layers && first[k + 1] <= i) ++k;
  return k;
}

// Tile pair blockIdx.x of the group's layer k (numbered from first_pair[k]) of each sample
// b = blockIdx.y, blockIdx.y + gridDim.y, ...: row tile ti and column tile sj <= ti, the lower
// triangle's pairs numbered row by row. Row t's partial sum over the pair goes to
// partials[first_partial[k] + (b length + t) tiles + sj], and on the diagonal pair its Gram
// diagonals to diagonals[2 (first_row[k] + b length + t)] (a) and [... + 1] (g). Every pair has a
// block of its own, so that a batch of short sequences fills the GPU.
template <class In, class Acc>
__global__ void __launch_bounds__(kThreads)
    ghost_tile_pairs(const GhostGroup group, int64_t batch, double* partials, double* diagonals) {
  constexpr int K = kStep<Acc>;
  __shared__ Acc tile_rows[K][kTile + 1], tile_cols[K][kTile + 1];
  __shared__ double products[kTile][kTile + 1];
  __shared__ double diag_a[kTile], diag_g[kTile];
  const int k = layer_of(group.first_pair, group.layers, blockIdx.x);
  const int64_t length = group.length[k], d = group.d[k], p = group.p[k], tiles = group.tiles[k];
  const In* a = static_cast<const In*>(group.activations[k]);
  const In* g = static_cast<const In*>(group.output_grads[k]);
  double* layer_partials = partials + group.first_partial[k];
  double* layer_diagonals = diagonals + 2 * group.first_row[k];
  const int64_t pair = blockIdx.x - group.first_pair[k];
  int64_t ti = static_cast<int64_t>((sqrt(8.0 * static_cast<double>(pair) + 1.0) - 1.0) / 2.0);
  while (ti * (ti + 1) / 2 > pair) --ti;  // the square root's rounding, either way
  while ((ti + 1) * (ti + 2) / 2 <= pair) ++ti;
  const int64_t sj = pair - ti * (ti + 1) / 2, t0 = ti * kTile, s0 = sj * kTile;
  for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
    // The last sample's diagonals are read above before this one's tile_partial writes them; with
    // d = p = 0 no gram_tile step synchronises in between.
    __syncthreads();
    double aa[kSub][kSub], gg[kSub][kSub];
    gram_tile(a + b * length * d, length, d, d, 1, t0, s0, tile_rows, tile_cols, aa);
    gram_tile(g + b * length * p, length, p, p, 1, t0, s0, tile_rows, tile_cols, gg);
    const double partial = tile_partial(aa, gg, t0, s0, products, diag_a, diag_g);
    const int64_t t = t0 + threadIdx.x;
    if (threadIdx.x < kTile && t < length) {
      layer_partials[(b * length + t) * tiles + sj] = partial;
      if (sj == ti) {
        layer_diagonals[2 * (b * length + t)] = diag_a[threadIdx.x];
        layer_diagonals[2 * (b * length + t) + 1] = diag_g[threadIdx.x];
      }
    }
  }
}

// rows[e] = ghost_row_total of the group's row e (layer k's row b length + t, e = first_row[k] +
// b length + t): its tiles' partial sums added in order from +0.
__global__ void ghost_row_totals(const GhostGroup group, const double* partials, const double* diagonals,
                                 double* rows) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t items = group.first_row[group.layers];
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < items; e += stride) {
    const int k = layer_of(group.first_row, group.layers, e);
    const int64_t row = e - group.first_row[k], length = group.length[k], tiles = group.tiles[k];
    const double* row_partials = partials + group.first_partial[k] + row * tiles;
    double below = 0.0;
    for (int64_t j = 0; j <= row % length / kTile; ++j) below += row_partials[j];
    rows[e] = ghost_row_total(below, diagonals[2 * e], diagonals[2 * e + 1]);
  }
}

// out[k batch + b] = ghost_sample_total of sample b of the group's layer k.
__global__ void ghost_sample_totals(const GhostGroup group, int64_t batch, const double* rows, double* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < group.layers * batch;
       e += stride) {
    const int k = static_cast<int>(e / batch);
    const int64_t length = group.length[k];
    out[e] = ghost_sample_total(rows + group.first_row[k] + e % batch * length, length);
  }
}

// The lower triangle of sample blockIdx.x's pixel Gram, tile (blockIdx.y, blockIdx.z) (entries
// (u, v), v <= u), into gram[b N^2 + u N + v]; x is channels-first, (channels, N) per sample.
template <class In, class Acc>
__global__ void __launch_bounds__(kThreads)
    pixel_gram(const In* x, int64_t channels, int64_t pixels, double* gram) {
  constexpr int K = kStep<Acc>;
  __shared__ Acc tile_rows[K][kTile + 1], tile_cols[K][kTile + 1];
  const int64_t b = blockIdx.x, u0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t v0 = static_cast<int64_t>(blockIdx.z) * kTile;
  if (v0 > u0) return;  // the whole block: above the diagonal
  double tot[kSub][kSub];
  gram_tile(x + b * channels * pixels, pixels, channels, 1, pixels, u0, v0, tile_rows, tile_cols, tot);
  double* sample_gram = gram + b * pixels * pixels;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
  for (int i = 0; i < kSub; ++i)
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      const int64_t u = u0 + ty + 16 * i, v = v0 + tx + 16 * j;
      if (u < pixels && v <= u) sample_gram[u * pixels + v] = tot[i][j];
    }
}

// rows[b length + t] = ghost_row_total of row t of sample b = blockIdx.x, t in block blockIdx.y, for the
// convolution form: the a side from the pixel Grams, the g side channels-first (outputs, positions)
// per sample; the block walks the column tiles in order, adding each tile's partial to `below`.
template <class In, class Acc>
__global__ void __launch_bounds__(kThreads)
    conv_ghost_rows(const double* gram, const In* g, ConvGeometry c, double* rows) {
  constexpr int K = kStep<Acc>;
  __shared__ Acc tile_rows[K][kTile + 1], tile_cols[K][kTile + 1];
  __shared__ double products[kTile][kTile + 1];
  __shared__ double diag_a[kTile], diag_g[kTile];
  const int64_t b = blockIdx.x, t0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t length = c.positions(), pixels = c.height * c.width;
  const double* sample_gram = gram + b * pixels * pixels;
  const In* sample_g = g + b * c.outputs * length;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  double below = 0.0;
  for (int64_t s0 = 0; s0 <= t0; s0 += kTile) {
    double aa[kSub][kSub], gg[kSub][kSub];
#pragma unroll
    for (int i = 0; i < kSub; ++i)
#pragma unroll
      for (int j = 0; j < kSub; ++j) {
        const int64_t t = t0 + ty + 16 * i, s = s0 + tx + 16 * j;
        aa[i][j] = s <= t && t < length ? conv_patch_gram(c, sample_gram, t, s) : 0.0;
      }
    gram_tile(sample_g, length, c.outputs, 1, length, t0, s0, tile_rows, tile_cols, gg);
    below += tile_partial(aa, gg, t0, s0, products, diag_a, diag_g);
  }
  if (threadIdx.x < kTile && t0 + threadIdx.x < length)
    rows[b * length + t0 + threadIdx.x] = ghost_row_total(below, diag_a[threadIdx.x], diag_g[threadIdx.x]);
}

__global__ void sample_totals(const double* rows, int64_t batch, int64_t length, double* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;  // blocks_for caps the grid
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < batch; b += stride)
    out[b] = ghost_sample_total(rows + b * length, length);
}

// head[e] = whether position t of sample b (e = b length + t) is its id's first; next[e] = the
// next position with its id, or -1.
__global__ void embedding_links(const int64_t* ids, int64_t batch, int64_t length, int64_t* next, int64_t* head) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < batch * length; e += stride) {
    const int64_t t = e % length;
    const int64_t* sample = ids + (e - t);
    const int64_t id = sample[t];
    int64_t s = 0;
    while (s < t && sample[s] != id) ++s;
    int64_t n = t + 1;
    while (n < length && sample[n] != id) ++n;
    head[e] = s == t;
    next[e] = n < length ? n : -1;
  }
}

// One warp per (sample, position): its group's row if it leads the group, else 0.
template <class In>
__global__ void embedding_rows(const In* g, const int64_t* next, const int64_t* head, int64_t batch, int64_t length,
                               int64_t p, double* rows) {
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kEmbeddingLanes;
  const int lane = threadIdx.x % kEmbeddingLanes;
  for (int64_t e = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kEmbeddingLanes;
       e < batch * length; e += warps) {  // e is the same for the whole warp
    if (!head[e]) {
      if (lane == 0) rows[e] = 0.0;
      continue;
    }
    const int64_t first = e - e % length;  // (b, 0)
    double acc = 0.0;
    for (int64_t j = lane; j < p; j += kEmbeddingLanes) {
      double v = static_cast<double>(Element<In>::load(g[e * p + j]));
      for (int64_t m = next[e]; m >= 0; m = next[first + m])
        v += static_cast<double>(Element<In>::load(g[(first + m) * p + j]));
      acc = ghost_fma(v, v, acc);
    }
    double lanes[kEmbeddingLanes];
#pragma unroll
    for (int l = 0; l < kEmbeddingLanes; ++l) lanes[l] = __shfl_sync(0xffffffffu, acc, l);
    if (lane == 0) rows[e] = embedding_lanes_total(lanes);
  }
}

unsigned blocks_for(int64_t threads) {
  return static_cast<unsigned>(std::min<int64_t>((threads + kThreads - 1) / kThreads, 65536));
}

void check_batch(int64_t batch) {
  if (batch > INT32_MAX) throw std::invalid_argument("ghost_norm: batch must be below 2^31 on CUDA");
}

int64_t tiles_of(int64_t length) { return (length + kTile - 1) / kTile; }

// Scratch of a dense layer in a group: its rows, their two Gram diagonals and each row's tile
// partials, as doubles.
int64_t layer_scratch_bytes(int64_t batch, int64_t length) {
  return batch * length * (3 + tiles_of(length)) * static_cast<int64_t>(sizeof(double));
}

// A call's groups share a workspace of the larger of this and its largest layer's scratch (or of
// all its layers' scratch where that is less): more layers a launch, a bounded footprint.
constexpr int64_t kGroupScratchBytes = int64_t{16} << 20;

// A group's three launches on stream s; the workspace holds its rows, then their diagonals, then
// the partials; out is the group's first layer's.
void launch_group(NoiseDType dtype, const GhostGroup& group, int64_t batch, double* out, double* workspace,
                  cudaStream_t s) {
  const int n = group.layers;
  const int64_t rows = group.first_row[n];
  double* diagonals = workspace + rows;
  double* partials = diagonals + 2 * rows;
  if (rows > 0) {  // else no tile pairs either, and a 0-block launch is an error
    dispatch_ghost_dtype(dtype, [&](auto zero) {
      using In = decltype(zero);
      using Acc = typename GhostAcc<In>::type;
      const auto samples = static_cast<unsigned>(std::min<int64_t>(batch, 65535));
      ghost_tile_pairs<In, Acc><<<dim3(static_cast<unsigned>(group.first_pair[n]), samples), kThreads, 0, s>>>(
          group, batch, partials, diagonals);
      check(cudaGetLastError(), "ghost_norm: ghost_tile_pairs launch");
    });
    ghost_row_totals<<<blocks_for(rows), kThreads, 0, s>>>(group, partials, diagonals, workspace);
    check(cudaGetLastError(), "ghost_norm: ghost_row_totals launch");
  }
  ghost_sample_totals<<<blocks_for(n * batch), kThreads, 0, s>>>(group, batch, workspace, out);
  check(cudaGetLastError(), "ghost_norm: ghost_sample_totals launch");
}

}  // namespace

int64_t ghost_norm_workspace_bytes(int64_t batch, const std::vector<int64_t>& lengths) {
  int64_t total = 0, largest = 0;
  for (const int64_t length : lengths) {
    const int64_t bytes = layer_scratch_bytes(batch, length);
    total += bytes;
    largest = std::max(largest, bytes);
  }
  return std::min(total, std::max(largest, kGroupScratchBytes));
}

void ghost_norm(const std::vector<GhostLayer>& layers, int64_t batch, double* out, void* workspace, int device,
                void* stream) {
  check_batch(batch);
  std::vector<int64_t> lengths;
  for (const GhostLayer& layer : layers) {
    check_ghost_sizes(batch, layer.length, layer.d, layer.p);
    if (tiles_of(layer.length) > 65535)
      throw std::invalid_argument("ghost_norm: length must be at most 65535 * 64 on CUDA");
    lengths.push_back(layer.length);
  }
  if (batch == 0 || layers.empty()) return;
  const int64_t scratch = ghost_norm_workspace_bytes(batch, lengths);
  const DeviceGuard guard(device);
  const auto s = static_cast<cudaStream_t>(stream);
  // Groups run one after another on the stream, so each finds the workspace free.
  for (size_t first = 0, next = 0; first < layers.size(); first = next) {
    GhostGroup group{};
    int64_t bytes = 0;
    for (next = first; next < layers.size() && group.layers < kGroupLayers && layers[next].dtype == layers[first].dtype;
         ++next) {
      const GhostLayer& layer = layers[next];
      const int n = group.layers;
      const int64_t tiles = tiles_of(layer.length), more = layer_scratch_bytes(batch, layer.length);
      if (n > 0 && (bytes + more > scratch || group.first_pair[n] + tiles * (tiles + 1) / 2 > INT32_MAX)) break;
      group.activations[n] = layer.activations;
      group.output_grads[n] = layer.output_grads;
      group.length[n] = layer.length;
      group.d[n] = layer.d;
      group.p[n] = layer.p;
      group.tiles[n] = tiles;
      group.first_pair[n + 1] = group.first_pair[n] + tiles * (tiles + 1) / 2;
      group.first_row[n + 1] = group.first_row[n] + batch * layer.length;
      group.first_partial[n + 1] = group.first_partial[n] + batch * layer.length * tiles;
      bytes += more;
      ++group.layers;
    }
    launch_group(layers[first].dtype, group, batch, out + static_cast<int64_t>(first) * batch,
                 static_cast<double*>(workspace), s);
  }
}

int64_t conv_ghost_norm_workspace_bytes(int64_t batch, int64_t pixels, int64_t length) {
  return batch * (pixels * pixels + length) * static_cast<int64_t>(sizeof(double));
}

void conv_ghost_norm(NoiseDType dtype, const void* x, const void* output_grads, const ConvGeometry& geometry,
                     double* out, void* workspace, int device, void* stream) {
  check_conv_ghost_geometry(geometry);
  check_batch(geometry.batch);
  const int64_t length = geometry.positions(), pixels = geometry.height * geometry.width;
  const int64_t tiles = (length + kTile - 1) / kTile, pixel_tiles = (pixels + kTile - 1) / kTile;
  if (tiles > 65535) throw std::invalid_argument("conv_ghost_norm: the output positions must be at most 65535 * 64 on CUDA");
  if (geometry.batch == 0) return;
  const DeviceGuard guard(device);
  const auto s = static_cast<cudaStream_t>(stream);
  auto* gram = static_cast<double*>(workspace);
  double* rows = gram + geometry.batch * pixels * pixels;
  const auto batch = static_cast<unsigned>(geometry.batch);
  dispatch_ghost_dtype(dtype, [&](auto zero) {
    using In = decltype(zero);
    using Acc = typename GhostAcc<In>::type;
    const auto pt = static_cast<unsigned>(pixel_tiles);
    pixel_gram<In, Acc><<<dim3(batch, pt, pt), kThreads, 0, s>>>(static_cast<const In*>(x), geometry.channels, pixels,
                                                                 gram);
    check(cudaGetLastError(), "conv_ghost_norm: pixel_gram launch");
    conv_ghost_rows<In, Acc><<<dim3(batch, static_cast<unsigned>(tiles)), kThreads, 0, s>>>(
        gram, static_cast<const In*>(output_grads), geometry, rows);
    check(cudaGetLastError(), "conv_ghost_norm: conv_ghost_rows launch");
  });
  sample_totals<<<blocks_for(geometry.batch), kThreads, 0, s>>>(rows, geometry.batch, length, out);
  check(cudaGetLastError(), "conv_ghost_norm: sample_totals launch");
}

int64_t embedding_ghost_norm_workspace_bytes(int64_t batch, int64_t length) {
  return batch * length * static_cast<int64_t>(sizeof(double) + 2 * sizeof(int64_t));
}

void embedding_ghost_norm(NoiseDType dtype, const int64_t* ids, const void* output_grads, int64_t batch,
                          int64_t length, int64_t p, double* out, void* workspace, int device, void* stream) {
  check_ghost_sizes(batch, length, 0, p);
  check_batch(batch);
  if (batch == 0) return;
  const DeviceGuard guard(device);
  const auto s = static_cast<cudaStream_t>(stream);
  const int64_t items = batch * length;
  auto* rows = static_cast<double*>(workspace);
  auto* next = reinterpret_cast<int64_t*>(rows + items);
  int64_t* head = next + items;
  if (items > 0) {
    embedding_links<<<blocks_for(items), kThreads, 0, s>>>(ids, batch, length, next, head);
    check(cudaGetLastError(), "embedding_ghost_norm: embedding_links launch");
    dispatch_ghost_dtype(dtype, [&](auto zero) {
      using In = decltype(zero);
      embedding_rows<In><<<blocks_for(items * kEmbeddingLanes), kThreads, 0, s>>>(
          static_cast<const In*>(output_grads), next, head, batch, length, p, rows);
      check(cudaGetLastError(), "embedding_ghost_norm: embedding_rows launch");
    });
  }
  sample_totals<<<blocks_for(batch), kThreads, 0, s>>>(rows, batch, length, out);
  check(cudaGetLastError(), "embedding_ghost_norm: sample_totals launch");
}

}  // namespace privleak::cuda
