// The emulator's runtime: kernel launches, __syncthreads, __shared__ memory, warp exchange.
//
// EMU_MODE=fibers (default): the threads of a block are ucontext fibers on the calling OS thread,
//   run round-robin until each reaches a barrier (fast, deterministic for a given EMU_ORDER).
// EMU_MODE=threads: a pool of OS threads, one per thread of a block (for ThreadSanitizer).
// EMU_ORDER=forward|reverse|shuffle: order in which blocks (and, in fiber mode, threads at each
//   barrier phase) are run. EMU_SEED seeds the shuffle.
// EMU_POISON=<byte>: __shared__ memory is filled with this byte at the start of each block
//   (default 0xFF: NaN for floats/doubles), so reading shared memory no thread wrote shows up.
// Violations (divergent __syncthreads, a deadlock, shuffles with missing lanes, more than 48 KiB
// of static shared memory, an invalid launch configuration) are printed with "EMU ERROR" and
// counted; emu_errors() returns the count. Deadlocks abort.
#include <ucontext.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "emu.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

thread_local uint3 threadIdx{0, 0, 0};
thread_local uint3 blockIdx{0, 0, 0};
dim3 blockDim;
dim3 gridDim;

namespace emu {
namespace {

constexpr size_t kStaticSharedLimit = 48 * 1024;

std::atomic<long> g_errors{0};
cudaError_t g_last_error = cudaSuccess;
int g_device = 0;

const char* env(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

void report(const std::string& what) {
  ++g_errors;
  std::fprintf(stderr, "EMU ERROR: %s\n", what.c_str());
  std::fflush(stderr);
}

// Per emulated thread.
struct EThread {
  uint3 tid{};
  unsigned linear = 0;
  size_t shared_index = 0;
  long syncs = 0;
  int state = 0;  // fibers: 0 runnable, 1 at __syncthreads, 2 at a warp exchange, 3 done
};

// The current block: its shared memory and warp exchange slots.
struct Block {
  std::mutex mutex;
  struct Slot {
    void* p;
    size_t bytes;
    const char* name;
  };
  std::vector<Slot> slots;
  size_t shared_bytes = 0;
  std::vector<unsigned char> warp_slots;  // warps x 32 lanes x 16 bytes
  const char* kernel = "";
  uint3 index{};
  bool shared_error_reported = false;

  void reset(unsigned threads, const char* k, uint3 idx) {
    for (auto& s : slots) std::free(s.p);
    slots.clear();
    shared_bytes = 0;
    warp_slots.assign(((threads + 31) / 32) * 32 * 16, 0);
    kernel = k;
    index = idx;
    shared_error_reported = false;
  }
};

Block g_block;
thread_local EThread* t_cur = nullptr;
unsigned char g_poison = 0xFF;

std::string where() {
  return std::string(g_block.kernel) + " block (" + std::to_string(g_block.index.x) + "," +
         std::to_string(g_block.index.y) + "," + std::to_string(g_block.index.z) + ")";
}

// ---------------------------------------------------------------- threads mode: a barrier
struct Barrier {
  std::mutex m;
  std::condition_variable cv;
  int expected = 0, arrived = 0;
  long generation = 0;
  void reset(int n) {
    std::lock_guard<std::mutex> l(m);
    expected = n;
    arrived = 0;
  }
  void arrive_and_wait(const char* what) {
    std::unique_lock<std::mutex> l(m);
    const long gen = generation;
    if (++arrived >= expected) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    const int timeout = std::atoi(env("EMU_TIMEOUT", "600"));
    if (!cv.wait_for(l, std::chrono::seconds(timeout), [&] { return generation != gen; })) {
      report(std::string("deadlock at ") + what + " in " + where());
      std::abort();
    }
  }
  void drop() {
    std::lock_guard<std::mutex> l(m);
    --expected;
    if (arrived > 0 && arrived >= expected) {
      arrived = 0;
      ++generation;
      cv.notify_all();
    }
  }
};

// ---------------------------------------------------------------- fibers
struct Fibers {
  std::vector<EThread> threads;
  std::vector<ucontext_t> contexts;
  char* stacks = nullptr;
  size_t stack_size = 0, count = 0;
  ucontext_t scheduler;
  const std::function<void()>* body = nullptr;
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
  unsigned current = 0;

  std::vector<bool> started;  // fibers persist across blocks: body() returns, the fiber loops
  void ensure(size_t n) {
    if (n <= count) return;
    started.assign(n, false);
    if (stacks) munmap(stacks, stack_size * count);
    stack_size = EMU_ASAN ? (128u << 10) : (256u << 10);
    stacks = static_cast<char*>(mmap(nullptr, stack_size * n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                                     -1, 0));
    if (stacks == MAP_FAILED) std::abort();
    count = n;
    threads.resize(n);
    contexts.resize(n);
  }
};
Fibers g_fibers;

void fiber_yield(int state, bool finished = false) {
  EThread* me = t_cur;
  me->state = state;
  ucontext_t* mine = &g_fibers.contexts[me->linear];
#if EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(finished ? nullptr : &fake, g_fibers.sched_bottom, g_fibers.sched_size);
  swapcontext(mine, &g_fibers.scheduler);
  __sanitizer_finish_switch_fiber(fake, &g_fibers.sched_bottom, &g_fibers.sched_size);
#else
  (void)finished;
  swapcontext(mine, &g_fibers.scheduler);
#endif
}

void fiber_entry() {
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g_fibers.sched_bottom, &g_fibers.sched_size);
#endif
  for (;;) {  // one iteration per block: frames return normally, so no stale stack poisoning
    (*g_fibers.body)();
    fiber_yield(3);
  }
}

std::vector<unsigned> order_of(unsigned n, std::mt19937_64& rng) {
  std::vector<unsigned> v(n);
  std::iota(v.begin(), v.end(), 0u);
  const std::string order = env("EMU_ORDER", "forward");
  if (order == "reverse") std::reverse(v.begin(), v.end());
  else if (order == "shuffle") std::shuffle(v.begin(), v.end(), rng);
  return v;
}

void run_block_fibers(unsigned n, const std::function<void()>& body, std::mt19937_64& rng) {
  Fibers& f = g_fibers;
  f.ensure(n);
  f.body = &body;
  for (unsigned t = 0; t < n; ++t) {
    EThread& e = f.threads[t];
    e = EThread{};
    e.linear = t;
    e.tid = uint3{t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
    if (f.started[t]) continue;
    f.started[t] = true;
    getcontext(&f.contexts[t]);
    f.contexts[t].uc_stack.ss_sp = f.stacks + t * f.stack_size;
    f.contexts[t].uc_stack.ss_size = f.stack_size;
    f.contexts[t].uc_link = nullptr;
    makecontext(&f.contexts[t], fiber_entry, 0);
  }
  EThread* saved = t_cur;
  const uint3 saved_tid = threadIdx;
  for (;;) {
    bool ran = false;
    for (unsigned t : order_of(n, rng)) {
      EThread& e = f.threads[t];
      if (e.state != 0) continue;
      ran = true;
      t_cur = &e;
      threadIdx = e.tid;
#if EMU_ASAN
      void* fake = nullptr;
      __sanitizer_start_switch_fiber(&fake, f.stacks + t * f.stack_size, f.stack_size);
      swapcontext(&f.scheduler, &f.contexts[t]);
      __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
      swapcontext(&f.scheduler, &f.contexts[t]);
#endif
    }
    (void)ran;
    unsigned done = 0, at_sync = 0, at_warp = 0;
    for (unsigned t = 0; t < n; ++t) {
      const int s = f.threads[t].state;
      done += s == 3;
      at_sync += s == 1;
      at_warp += s == 2;
    }
    if (done == n) break;
    // Warps whose live lanes all wait at an exchange go on.
    bool released = false;
    for (unsigned w = 0; w * 32 < n; ++w) {
      unsigned live = 0, waiting = 0, exited = 0;
      for (unsigned t = w * 32; t < std::min(n, w * 32 + 32); ++t) {
        const int s = f.threads[t].state;
        exited += s == 3;
        live += s != 3;
        waiting += s == 2;
      }
      if (waiting > 0 && waiting == live) {
        if (exited) report("__shfl_sync with exited lanes in " + where());
        for (unsigned t = w * 32; t < std::min(n, w * 32 + 32); ++t)
          if (f.threads[t].state == 2) f.threads[t].state = 0;
        released = true;
      }
    }
    if (released) continue;
    if (at_warp == 0 && at_sync == n - done) {
      if (done) report("__syncthreads reached by " + std::to_string(at_sync) + " of " + std::to_string(n) +
                       " threads (the others exited) in " + where());
      for (unsigned t = 0; t < n; ++t)
        if (f.threads[t].state == 1) f.threads[t].state = 0;
      continue;
    }
    report("deadlock (" + std::to_string(at_sync) + " threads at __syncthreads, " + std::to_string(at_warp) +
           " at a warp exchange, " + std::to_string(done) + " exited) in " + where());
    std::abort();
  }
  t_cur = saved;
  threadIdx = saved_tid;
}

// ---------------------------------------------------------------- threads mode: a pool
struct Pool {
  std::vector<std::thread> workers;
  std::vector<EThread> threads;
  std::mutex m;
  std::condition_variable cv_start, cv_done;
  long generation = 0;
  unsigned finished = 0, size = 0;
  bool stop = false;
  const std::function<void()>* body = nullptr;
  uint3 block{};
  Barrier block_barrier;
  std::vector<Barrier> warp_barriers;

  void work(unsigned t) {
    long seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> l(m);
        cv_start.wait(l, [&] { return stop || generation != seen; });
        if (stop) return;
        seen = generation;
      }
      EThread& e = threads[t];
      t_cur = &e;
      threadIdx = e.tid;
      blockIdx = block;
      (*body)();
      block_barrier.drop();
      warp_barriers[t / 32].drop();
      std::lock_guard<std::mutex> l(m);
      if (++finished == size) cv_done.notify_all();
    }
  }
  void resize(unsigned n) {
    if (n == size) return;
    shutdown();
    size = n;
    threads.assign(n, EThread{});
    warp_barriers = std::vector<Barrier>((n + 31) / 32);
    stop = false;
    for (unsigned t = 0; t < n; ++t) workers.emplace_back([this, t] { work(t); });
  }
  void shutdown() {
    {
      std::lock_guard<std::mutex> l(m);
      stop = true;
    }
    cv_start.notify_all();
    for (auto& w : workers) w.join();
    workers.clear();
    size = 0;
  }
  void run(const std::function<void()>& b) {
    const unsigned n = size;
    for (unsigned t = 0; t < n; ++t) {
      EThread& e = threads[t];
      e = EThread{};
      e.linear = t;
      e.tid = uint3{t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
    }
    block_barrier.reset(static_cast<int>(n));
    for (unsigned w = 0; w < warp_barriers.size(); ++w)
      warp_barriers[w].reset(static_cast<int>(std::min(n, 32 * w + 32) - 32 * w));
    std::unique_lock<std::mutex> l(m);
    body = &b;
    finished = 0;
    ++generation;
    cv_start.notify_all();
    cv_done.wait(l, [&] { return finished == n; });
  }
  ~Pool() { shutdown(); }
};
Pool* g_pool = nullptr;

bool fiber_mode() { return std::string(env("EMU_MODE", "fibers")) == "fibers"; }

}  // namespace

long emu_errors() { return g_errors.load(); }

void launch(dim3 grid, dim3 block, size_t dynamic_shared, const char* kernel, const std::function<void()>& body) {
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535 ||
      threads == 0 || threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64) {
    report(std::string("invalid launch configuration of ") + kernel + ": grid (" + std::to_string(grid.x) + "," +
           std::to_string(grid.y) + "," + std::to_string(grid.z) + ") block (" + std::to_string(block.x) + "," +
           std::to_string(block.y) + "," + std::to_string(block.z) + ")");
    g_last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (dynamic_shared != 0) report(std::string("dynamic shared memory is not emulated: ") + kernel);
  g_poison = static_cast<unsigned char>(std::strtoul(env("EMU_POISON", "255"), nullptr, 0));
  gridDim = grid;
  blockDim = block;
  static std::mt19937_64 rng(std::strtoull(env("EMU_SEED", "1"), nullptr, 0));
  const uint64_t blocks = uint64_t(grid.x) * grid.y * grid.z;
  std::vector<uint64_t> order;
  const std::string ord = env("EMU_ORDER", "forward");
  // Shuffling all blocks of a huge grid is costly; blocks_for caps grids at 65536 blocks x 65535.
  if (ord == "reverse") {
    for (uint64_t b = blocks; b-- > 0;) order.push_back(b);
  } else {
    for (uint64_t b = 0; b < blocks; ++b) order.push_back(b);
    if (ord == "shuffle") std::shuffle(order.begin(), order.end(), rng);
  }
  const bool fibers = fiber_mode();
  if (!fibers) {
    if (!g_pool) g_pool = new Pool;
    g_pool->resize(static_cast<unsigned>(threads));
  }
  for (const uint64_t b : order) {
    const uint3 idx{static_cast<unsigned>(b % grid.x), static_cast<unsigned>((b / grid.x) % grid.y),
                    static_cast<unsigned>(b / (uint64_t(grid.x) * grid.y))};
    g_block.reset(static_cast<unsigned>(threads), kernel, idx);
    if (fibers) {
      blockIdx = idx;
      run_block_fibers(static_cast<unsigned>(threads), body, rng);
    } else {
      g_pool->block = idx;
      g_pool->run(body);
    }
    // Every thread must have passed the same number of __syncthreads.
    const std::vector<EThread>& ts = fibers ? g_fibers.threads : g_pool->threads;
    for (unsigned t = 1; t < threads; ++t)
      if (ts[t].syncs != ts[0].syncs) {
        report("divergent __syncthreads: thread " + std::to_string(t) + " passed " + std::to_string(ts[t].syncs) +
               ", thread 0 " + std::to_string(ts[0].syncs) + " in " + where());
        break;
      }
  }
  g_block.reset(0, "", uint3{});
}

void* shared_alloc(size_t bytes, size_t align, const char* name) {
  EThread* me = t_cur;
  std::lock_guard<std::mutex> l(g_block.mutex);
  const size_t i = me->shared_index++;
  if (i < g_block.slots.size()) {
    if (g_block.slots[i].bytes != bytes) report(std::string("__shared__ ") + name + " differs between threads");
    return g_block.slots[i].p;
  }
  // One malloc per array, exact size: AddressSanitizer catches out-of-bounds shared accesses.
  void* p = std::malloc(bytes);
  if (reinterpret_cast<uintptr_t>(p) % align) report("shared alignment");
  std::memset(p, g_poison, bytes);
  g_block.slots.push_back({p, bytes, name});
  g_block.shared_bytes += bytes;
  if (g_block.shared_bytes > kStaticSharedLimit && !g_block.shared_error_reported) {
    g_block.shared_error_reported = true;
    report("more than 48 KiB of static __shared__ memory (" + std::to_string(g_block.shared_bytes) + " bytes) in " +
           where());
  }
  return p;
}

void syncthreads() {
  EThread* me = t_cur;
  ++me->syncs;
  if (fiber_mode()) {
    fiber_yield(1);
  } else {
    g_pool->block_barrier.arrive_and_wait("__syncthreads");
  }
}

void warp_exchange(const void* in, void* out, size_t bytes, int src_lane, unsigned mask) {
  EThread* me = t_cur;
  if (mask != 0xffffffffu) report("__shfl_sync with a partial mask is not emulated");
  if (bytes > 16) std::abort();
  const unsigned warp = me->linear / 32, lane = me->linear % 32;
  unsigned char* slots = g_block.warp_slots.data() + warp * 32 * 16;
  std::memcpy(slots + lane * 16, in, bytes);
  const bool fibers = fiber_mode();
  if (fibers) fiber_yield(2);
  else g_pool->warp_barriers[warp].arrive_and_wait("__shfl_sync");
  std::memcpy(out, slots + src_lane * 16, bytes);
  if (fibers) fiber_yield(2);
  else g_pool->warp_barriers[warp].arrive_and_wait("__shfl_sync");
}

unsigned lane_id() { return t_cur->linear % 32; }

void trap(const char* what) {
  report(std::string(what) + " in " + where());
  std::abort();
}

}  // namespace emu

// ---------------------------------------------------------------- runtime API stand-ins
cudaError_t cudaGetLastError() {
  const cudaError_t e = emu::g_last_error;
  emu::g_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return emu::g_last_error; }
const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
  }
  return "cudaErrorUnknown";
}
const char* cudaGetErrorString(cudaError_t e) { return cudaGetErrorName(e); }
cudaError_t cudaGetDevice(int* device) {
  *device = emu::g_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device != 0) return emu::g_last_error = cudaErrorInvalidDevice;
  emu::g_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "emulated device");
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind, cudaStream_t) {
  if (bytes) std::memmove(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return emu::g_last_error = cudaErrorInvalidDevice;
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = std::atoi(emu::env("EMU_SMS", "132")); return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; return cudaSuccess;
  }
  return emu::g_last_error = cudaErrorInvalidValue;
}
