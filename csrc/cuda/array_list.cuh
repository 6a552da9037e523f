// A list of device arrays filled by one kernel launch: what a model's tensors take from one noise
// stream. A launch per tensor costs the host a few microseconds each, which on a small model is
// a real part of a step; one launch over the list costs one.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace privleak::cuda {

// Arrays of one launch (a kernel argument; at most kListArrays). Array i is `data[i]` of `n[i]`
// elements whose element 0 is element `offset[i]` of the stream, and its work items are
// [first_item[i], first_item[i + 1]) of the launch's.
constexpr int kListArrays = 64;
struct ArrayList {
  void* data[kListArrays];
  int64_t n[kListArrays];
  uint64_t offset[kListArrays];
  int64_t first_item[kListArrays + 1];
  int count;
};
static_assert(sizeof(ArrayList) <= 4096, "a kernel's arguments are at most 4 KiB");

// Calls visit(i, j) for each work item of the list, item j of array i, grid-stride: a thread's
// items increase, so the array it is in is found by moving forward, never by a search.
template <class Visit>
__device__ void for_each_item(const ArrayList& list, Visit visit) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t items = list.first_item[list.count];
  int i = 0;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < items; item += stride) {
    while (list.first_item[i + 1] <= item) ++i;
    visit(i, item - list.first_item[i]);
  }
}

// The checks of a list's arguments, before anything is launched.
inline void check_array_list(const std::vector<void*>& outs, const std::vector<int64_t>& numels, const char* what) {
  if (outs.size() != numels.size()) throw std::invalid_argument(std::string(what) + ": one numel per output array");
  for (const int64_t n : numels)
    if (n < 0) throw std::invalid_argument(std::string(what) + ": n must be >= 0");
}

// Calls launch(list, items) for the arrays `outs` of `numels` elements laid end to end in one
// stream from `offset`, kListArrays at a time; items_of(n, offset) is an array's work items.
template <class ItemsOf, class Launch>
void launch_lists(const std::vector<void*>& outs, const std::vector<int64_t>& numels, uint64_t offset,
                  ItemsOf items_of, Launch launch) {
  ArrayList list{};
  for (size_t k = 0; k < outs.size(); ++k) {
    const int i = list.count;
    list.data[i] = outs[k];
    list.n[i] = numels[k];
    list.offset[i] = offset;
    list.first_item[i + 1] = list.first_item[i] + items_of(numels[k], offset);
    offset += static_cast<uint64_t>(numels[k]);
    if (++list.count == kListArrays || k + 1 == outs.size()) {
      if (list.first_item[list.count] > 0) launch(list, list.first_item[list.count]);  // 0 blocks cannot launch
      list = ArrayList{};
    }
  }
}

}  // namespace privleak::cuda
