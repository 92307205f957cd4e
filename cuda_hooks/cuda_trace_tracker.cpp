// memadvisor CUDA caching-allocator trace tracker.
//
// UNTESTED until a GPU session: the CPU-only torch wheel this was written
// against ships the c10/cuda headers but no libc10_cuda.so and no CUDA
// toolkit.  Nothing in memadvisor depends on this file yet.  See README.md.
//
// Counterpart of allocator_hook.cpp for CUDA: instead of wrapping the CUDA
// allocator it attaches an AllocatorTraceTracker to the CUDA caching allocator
// (c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker), which is
// called for every trace entry the allocator produces -- ALLOC,
// FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP,
// SEGMENT_UNMAP, SNAPSHOT, OOM -- whether or not
// torch.cuda.memory._record_memory_history() is on.  Entries are copied into
// a mutex-guarded buffer and drained through an extern "C" API (ctypes).
//
// Build (on a CUDA machine; the CUDA toolkit headers must be reachable):
//   g++ -O2 -shared -fPIC -std=c++17 -fvisibility=hidden -DMEMADVISOR_WITH_CUDA \
//       -D_GLIBCXX_USE_CXX11_ABI=<torch._C._GLIBCXX_USE_CXX11_ABI> \
//       -I<torch>/include -I<cuda>/include cuda_trace_tracker.cpp \
//       -o cuda_trace_tracker.so -L<torch>/lib -lc10 -lc10_cuda \
//       -Wl,-rpath,<torch>/lib
// Without -DMEMADVISOR_WITH_CUDA (or without the CUDA headers) the same file
// compiles to stubs: mact_available() returns 0 and mact_install() returns 1.
//
// Caveats (from c10/cuda/CUDACachingAllocator.h and the caching allocator):
// * Trackers are attached to the per-device allocators that exist *at attach
//   time*; they are created by the lazy CUDA init.  Call torch.cuda.init()
//   (or allocate something on every device to be watched) before
//   mact_install().
// * The callback runs under the allocator's per-device lock; it must not take
//   the GIL or call into PyTorch.  Ours only takes a leaf mutex.
// * There is no detach: once attached, the tracker stays for the process;
//   mact_set_recording(0) makes it a cheap no-op.
// * Only the native caching allocator backend calls trackers;
//   PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync does not.
// * For OOM entries `addr` is the free device memory in bytes, for SNAPSHOT it
//   is 0 (see TraceEntry in c10/core/CachingDeviceAllocator.h).

#include <cstdint>
#include <mutex>
#include <vector>

#define MACT_API extern "C" __attribute__((visibility("default")))

#if defined(MEMADVISOR_WITH_CUDA) && __has_include(<cuda_runtime_api.h>) && \
    __has_include(<c10/cuda/CUDACachingAllocator.h>)
#define MACT_HAVE_CUDA 1
#include <c10/cuda/CUDACachingAllocator.h>
#else
#define MACT_HAVE_CUDA 0
#endif

namespace {

struct TraceRecord {
  int64_t action;  // c10::CachingDeviceAllocator::TraceEntry::Action value
  int64_t device;
  uint64_t addr;
  int64_t size;
  uint64_t stream;  // cudaStream_t as an integer
  int64_t seq;
};

struct TrackerState {
  std::mutex mu;
  std::vector<TraceRecord> records;
  size_t head = 0;
  int64_t next_seq = 0;
  bool recording = false;
  bool installed = false;
};

TrackerState& tst() {
  static TrackerState* s = new TrackerState();  // leaked: outlives static dtors
  return *s;
}

#if MACT_HAVE_CUDA
void on_trace(const c10::cuda::CUDACachingAllocator::TraceEntry& te) {
  TrackerState& s = tst();
  std::lock_guard<std::mutex> g(s.mu);
  if (!s.recording) {
    return;
  }
  s.records.push_back(TraceRecord{
      static_cast<int64_t>(te.action_), static_cast<int64_t>(te.device_),
      static_cast<uint64_t>(te.addr_), static_cast<int64_t>(te.size_),
      reinterpret_cast<uint64_t>(te.stream_), s.next_seq++});
}
#endif

}  // namespace

// 1 if this library was compiled with the CUDA tracker, 0 for the stub build.
MACT_API int mact_available(void) {
  return MACT_HAVE_CUDA;
}

// Attaches the tracker (idempotent).  0 on success; 1 if compiled without
// CUDA; 2 if the CUDA caching allocator is not there (not initialised, or a
// different backend); 3 on exception.
MACT_API int mact_install(void) {
#if MACT_HAVE_CUDA
  try {
    TrackerState& s = tst();
    {
      std::lock_guard<std::mutex> g(s.mu);
      if (s.installed) {
        return 0;
      }
    }
    if (c10::cuda::CUDACachingAllocator::get() == nullptr) {
      return 2;
    }
    c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(&on_trace);
    std::lock_guard<std::mutex> g(s.mu);
    s.installed = true;
    return 0;
  } catch (...) {
    return 3;
  }
#else
  return 1;
#endif
}

MACT_API void mact_set_recording(int on) {
  TrackerState& s = tst();
  std::lock_guard<std::mutex> g(s.mu);
  s.recording = on != 0;
}

// Copies up to `capacity` pending records, oldest first, and removes them.
// Any output pointer may be NULL.  Returns the number copied.
MACT_API int64_t mact_drain(int64_t* actions, int64_t* devices, uint64_t* addrs,
                            int64_t* sizes, uint64_t* streams, int64_t* seqs,
                            int64_t capacity) {
  if (capacity <= 0) {
    return 0;
  }
  TrackerState& s = tst();
  std::lock_guard<std::mutex> g(s.mu);
  const size_t avail = s.records.size() - s.head;
  const size_t n = avail < static_cast<size_t>(capacity) ? avail : static_cast<size_t>(capacity);
  const TraceRecord* src = s.records.data() + s.head;
  for (size_t i = 0; i < n; ++i) {
    if (actions) actions[i] = src[i].action;
    if (devices) devices[i] = src[i].device;
    if (addrs) addrs[i] = src[i].addr;
    if (sizes) sizes[i] = src[i].size;
    if (streams) streams[i] = src[i].stream;
    if (seqs) seqs[i] = src[i].seq;
  }
  s.head += n;
  if (s.head == s.records.size()) {
    s.records.clear();
    s.head = 0;
  } else if (s.head > 65536 && s.head * 2 > s.records.size()) {
    s.records.erase(s.records.begin(), s.records.begin() + static_cast<std::ptrdiff_t>(s.head));
    s.head = 0;
  }
  return static_cast<int64_t>(n);
}

MACT_API int64_t mact_pending(void) {
  TrackerState& s = tst();
  std::lock_guard<std::mutex> g(s.mu);
  return static_cast<int64_t>(s.records.size() - s.head);
}

MACT_API void mact_clear(void) {
  TrackerState& s = tst();
  std::lock_guard<std::mutex> g(s.mu);
  s.records.clear();
  s.head = 0;
}

MACT_API int mact_api_version(void) {
  return 1;
}
