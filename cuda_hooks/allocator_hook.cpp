// memadvisor CPU allocator hook.
//
// Wraps c10's CPU allocator so that every CPU allocation and free made through
// `c10::GetAllocator(DeviceType::CPU)` -- including the ones made *inside*
// kernels (oneDNN scratchpads via ideep's raw_allocate, max_pool2d indices,
// convolution_backward temporaries, ...) -- is seen, in order.
//
// Loaded from Python with ctypes (memadvisor/profile/native.py); only c10
// headers are included so it compiles in a couple of seconds.  Link with
// -lc10, and build with torch's -D_GLIBCXX_USE_CXX11_ABI value.
//
// Design
// ------
// * The wrapper forwards allocate() to the allocator that was current at
//   install time.  It then takes ownership of the original context/deleter,
//   parks them in a side table keyed by the data pointer, and returns a DataPtr
//   whose context *is* the data pointer and whose deleter is `ma_delete`.
//   Keeping `get() == get_context()` matters: ideep/oneDNN allocate through
//   `Allocator::raw_allocate`, which asserts exactly that, and
//   `is_simple_data_ptr` (copy-on-write lazy clones) relies on it too.  The
//   deleter looks the pointer up, records the free, and calls the original
//   deleter with the original context.
// * raw_deleter() returns `ma_delete` when the wrapped allocator supports the
//   raw interface, so raw_allocate/raw_deallocate pairs keep working (a
//   raw_deallocate of a pointer we never saw falls through to the original
//   raw deleter).
// * Events (kind +1 alloc / -1 free, ptr, size, seq) are appended to an
//   in-memory buffer, guarded by a mutex, only while recording is on.  Every
//   allocation made after ma_install() is tracked (live/peak bytes) whether or
//   not recording is on, so a free that happens while recording is on is
//   recorded even if its allocation happened before recording started (but
//   after install).  Allocations made before ma_install() are invisible, and so
//   are their frees.
// * The free event is recorded *before* the memory is returned to the original
//   allocator, and the alloc event *after* it was obtained, so address reuse is
//   always ordered correctly (free of p precedes the next alloc of p) even
//   across threads.
// * Callers that bypass GetAllocator(CPU) and use c10::GetDefaultCPUAllocator()
//   directly (Python-constructed storages: torch.UntypedStorage(n), its
//   resize_(), TypedStorage, and so storage.clone(), copy.deepcopy of tensors
//   and unpickling) are not seen by the SetAllocator wrapper.  The opt-in
//   ma_cover_default_allocator() closes that gap by re-pointing the vtable
//   pointer of the default allocator object itself (c10::g_cpu_alloc, a
//   stateless object holding only a vptr) at a forwarder into the hook, after
//   checking that it is a c10::DefaultCPUAllocator sitting in writable memory.
//   This relies on DefaultCPUAllocator having no data members (true up to at
//   least torch 2.13) and is undefined behaviour by the letter of C++, hence
//   opt-in.
// * Zero-size allocations (and allocations returning nullptr / no deleter) are
//   passed through untouched and record nothing.
// * All state is heap-allocated and intentionally leaked so that frees that
//   happen during static destruction at process exit stay safe.
// * fork(): pthread_atfork handlers hold the mutex across fork() so a child
//   never inherits it locked by a thread that does not exist there.  In the
//   child, recording is switched off and pending events are dropped (nobody
//   drains a DataLoader worker's buffer); the wrapper keeps forwarding and
//   tracking live bytes there.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceType.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <typeinfo>
#include <mutex>
#include <pthread.h>
#include <sched.h>
#include <unordered_map>
#include <vector>

#define MA_API extern "C" __attribute__((visibility("default")))

namespace {

struct Event {
  int64_t kind;
  uint64_t ptr;
  int64_t size;
  int64_t seq;
};

// The lock of the per-allocation books: held for a map update and an event appended,
// almost never contended.  Taking it is one atomic exchange and releasing it one store
// (std::mutex: a library call and an atomic read-modify-write each way, twice per
// allocation and free).  A waiter spins briefly, then yields its time slice: on a busy
// machine the holder may have been descheduled.
class SpinLock {
 public:
  void lock() noexcept {
    int spins = 0;
    while (locked_.exchange(true, std::memory_order_acquire)) {
      while (locked_.load(std::memory_order_relaxed)) {
        if (++spins < 100) {
#if defined(__x86_64__) || defined(__i386__)
          __builtin_ia32_pause();
#endif
        } else {
          sched_yield();
        }
      }
    }
  }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};
using BooksGuard = std::lock_guard<SpinLock>;

// A hash map from an address to V with open addressing (linear probing, backward-shift
// deletion): an insert or erase allocates nothing, unlike std::unordered_map's nodes, and
// one happens per allocation and per free.  Key 0 marks an empty slot and is never found.
template <typename V>
class AddressMap {
 public:
  V* find(uint64_t key) {
    if (key == 0 || size_ == 0) return nullptr;
    for (size_t i = slot(key);; i = (i + 1) & mask_) {
      if (keys_[i] == key) return &values_[i];
      if (keys_[i] == 0) return nullptr;
    }
  }

  // Inserts, or overwrites the value already there.
  void put(uint64_t key, const V& value) {
    if ((size_ + 1) * 2 > keys_.size()) grow();
    size_t i = slot(key);
    for (; keys_[i] != 0; i = (i + 1) & mask_) {
      if (keys_[i] == key) {
        values_[i] = value;
        return;
      }
    }
    keys_[i] = key;
    values_[i] = value;
    ++size_;
  }

  bool erase(uint64_t key) {
    if (key == 0 || size_ == 0) return false;
    size_t hole = slot(key);
    for (; keys_[hole] != key; hole = (hole + 1) & mask_) {
      if (keys_[hole] == 0) return false;
    }
    // move back each following entry of the run whose home slot is not after the hole
    for (size_t j = (hole + 1) & mask_; keys_[j] != 0; j = (j + 1) & mask_) {
      if (((j - slot(keys_[j])) & mask_) >= ((j - hole) & mask_)) {
        keys_[hole] = keys_[j];
        values_[hole] = values_[j];
        hole = j;
      }
    }
    keys_[hole] = 0;
    --size_;
    return true;
  }

  size_t size() const { return size_; }

  void clear() {
    std::fill(keys_.begin(), keys_.end(), 0);
    size_ = 0;
  }

 private:
  size_t slot(uint64_t key) const {
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  void grow() {
    size_t capacity = keys_.empty() ? 1024 : keys_.size() * 2;
    std::vector<uint64_t> old_keys(capacity, 0);
    std::vector<V> old_values(capacity);
    old_keys.swap(keys_);
    old_values.swap(values_);
    mask_ = capacity - 1;
    shift_ = 64 - __builtin_ctzll(capacity);
    size_ = 0;
    for (size_t i = 0; i < old_keys.size(); ++i) {
      if (old_keys[i] != 0) put(old_keys[i], old_values[i]);
    }
  }

  std::vector<uint64_t> keys_;
  std::vector<V> values_;
  size_t mask_ = 0;
  int shift_ = 63;
  size_t size_ = 0;
};

inline uint64_t address_key(const void* p) {
  return reinterpret_cast<uint64_t>(p);
}

struct LiveEntry {
  void* ctx;
  c10::DeleterFnPtr deleter;
  int64_t size;
};

struct State {
  SpinLock mu;
  std::vector<Event> events;  // pending events are events[head..]
  size_t head = 0;
  AddressMap<LiveEntry> live;
  int64_t live_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t next_seq = 0;
  std::atomic<bool> recording{false};
  c10::Allocator* orig = nullptr;  // the allocator we wrap (set once)
};

State& st() {
  static State* s = new State();  // leaked on purpose (see header comment)
  return *s;
}

// Extension points for op_tracker.cpp, which compiles this file into its own
// library.  Called *outside* the state mutex (the tracker takes the GIL to read
// the Python stack, and a thread holding the GIL may be waiting for this mutex):
// the alloc listener after the block was obtained, the free listener before it
// is returned, so a free of p still precedes the next alloc of p.
using AllocListener = void (*)(void* p, int64_t size);
using FreeListener = void (*)(void* p);
AllocListener g_alloc_listener = nullptr;
FreeListener g_free_listener = nullptr;

inline void push_event_locked(State& s, int64_t kind, void* p, int64_t size) {
  s.events.push_back(Event{kind, reinterpret_cast<uint64_t>(p), size, s.next_seq++});
}

void ma_delete(void* p) {
  State& s = st();
  LiveEntry e{nullptr, nullptr, 0};
  bool found = false;
  {
    BooksGuard g(s.mu);
    if (LiveEntry* entry = s.live.find(address_key(p))) {
      e = *entry;
      found = true;
      s.live.erase(address_key(p));
      s.live_bytes -= e.size;
      if (s.recording.load(std::memory_order_relaxed)) {
        push_event_locked(s, -1, p, e.size);
      }
    }
  }
  if (found) {
    if (g_free_listener != nullptr) {
      g_free_listener(p);
    }
    if (e.deleter != nullptr) {
      e.deleter(e.ctx);
    }
    return;
  }
  // Not ours: a raw_deallocate() of memory raw_allocate()d before install.
  if (s.orig != nullptr) {
    c10::DeleterFnPtr d = s.orig->raw_deleter();
    if (d != nullptr) {
      d(p);
    }
  }
}

struct HookAllocator final : public c10::Allocator {
  explicit HookAllocator(c10::Allocator* orig) : orig_(orig) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr dp = orig_->allocate(n);
    void* data = dp.get();
    c10::DeleterFnPtr d = dp.get_deleter();
    if (n == 0 || data == nullptr || d == nullptr) {
      return dp;  // nothing to track
    }
    State& s = st();
    {
      BooksGuard g(s.mu);
      if (LiveEntry* entry = s.live.find(address_key(data))) {
        // Should not happen (a free bypassed us); keep the books straight.
        s.live_bytes -= entry->size;
      }
      s.live.put(address_key(data), LiveEntry{dp.get_context(), d, static_cast<int64_t>(n)});
      s.live_bytes += static_cast<int64_t>(n);
      if (s.live_bytes > s.peak_bytes) {
        s.peak_bytes = s.live_bytes;
      }
      if (s.recording.load(std::memory_order_relaxed)) {
        push_event_locked(s, +1, data, static_cast<int64_t>(n));
      }
    }
    c10::Device dev = dp.device();
    (void)dp.release_context();  // ownership now lives in the side table
    if (g_alloc_listener != nullptr) {
      g_alloc_listener(data, static_cast<int64_t>(n));
    }
    return c10::DataPtr(data, data, &ma_delete, dev);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return orig_->raw_deleter() != nullptr ? &ma_delete : nullptr;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    orig_->copy_data(dest, src, count);
  }

  void set_orig(c10::Allocator* orig) {
    __atomic_store_n(&orig_, orig, __ATOMIC_SEQ_CST);
  }

 private:
  c10::Allocator* orig_;
};

void atfork_prepare() {
  st().mu.lock();
}

void atfork_parent() {
  st().mu.unlock();
}

void atfork_child() {
  State& s = st();
  s.recording.store(false, std::memory_order_relaxed);
  s.events.clear();
  s.events.shrink_to_fit();
  s.head = 0;
  s.mu.unlock();
}

std::mutex g_install_mu;
HookAllocator* g_hook = nullptr;  // leaked on purpose
bool g_default_covered = false;

// Takes the place of the default CPU allocator's vtable (see header comment).
// Must have no data members: it is never constructed in the object it serves.
struct DefaultForwarder final : public c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    return g_hook->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return g_hook->raw_deleter();
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    g_hook->copy_data(dest, src, count);
  }
};
static_assert(sizeof(DefaultForwarder) == sizeof(void*), "forwarder must be a bare vptr");

// Whether [p, p+n) lies in a writable private mapping of this process.
bool is_writable(const void* p, size_t n) {
  FILE* f = std::fopen("/proc/self/maps", "r");
  if (f == nullptr) {
    return false;
  }
  const auto lo = reinterpret_cast<uintptr_t>(p);
  const auto hi = lo + n;
  bool ok = false;
  char line[512];
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned long start = 0, end = 0;
    char perms[8] = {0};
    if (std::sscanf(line, "%lx-%lx %7s", &start, &end, perms) == 3 && lo >= start &&
        hi <= end) {
      ok = perms[1] == 'w';
      break;
    }
  }
  std::fclose(f);
  return ok;
}

}  // namespace

// ---------------------------------------------------------------------------
// extern "C" API (see cuda_hooks/README.md)
// ---------------------------------------------------------------------------

// Installs the wrapper around the current CPU allocator.  Idempotent; called again,
// it puts the wrapper back on top if another allocator was registered since.
// Returns 0 on success, 1 if there is no CPU allocator, 2 if SetAllocator did
// not take effect (someone registered at a higher priority), 3 on exception
// or if pthread_atfork failed.
MA_API int ma_install(void) {
  try {
    std::lock_guard<std::mutex> g(g_install_mu);
    if (g_hook != nullptr) {
      if (c10::GetAllocator(c10::DeviceType::CPU) != g_hook) {
        // another hook went on top since (the other memadvisor library, in a process
        // that ran both engines): take the top again.  Safe: every block keeps the
        // deleter of the allocator that made it.
        c10::SetAllocator(c10::DeviceType::CPU, g_hook, /*priority=*/255);
      }
      return c10::GetAllocator(c10::DeviceType::CPU) == g_hook ? 0 : 2;
    }
    c10::Allocator* cur = c10::GetAllocator(c10::DeviceType::CPU);
    if (cur == nullptr) {
      return 1;
    }
    st().orig = cur;
    if (pthread_atfork(&atfork_prepare, &atfork_parent, &atfork_child) != 0) {
      return 3;
    }
    auto* hook = new HookAllocator(cur);
    // Only an equal or higher priority can overwrite; the default CPU
    // allocator registers at 0.  255 is the maximum (uint8_t).
    c10::SetAllocator(c10::DeviceType::CPU, hook, /*priority=*/255);
    g_hook = hook;
    return c10::GetAllocator(c10::DeviceType::CPU) == hook ? 0 : 2;
  } catch (...) {
    return 3;
  }
}

// Opt-in: also route c10::GetDefaultCPUAllocator()'s direct users through the
// hook (see header comment).  Requires ma_install() first.  Idempotent.
// Returns 0 on success; 1 if the hook is not installed; 2 if the wrapped
// allocator is not the default CPU allocator; 3 if that object is not a
// c10::DefaultCPUAllocator; 4 if it is not in writable memory; 5 on exception.
MA_API int ma_cover_default_allocator(void) {
  try {
    std::lock_guard<std::mutex> g(g_install_mu);
    if (g_default_covered) {
      return 0;
    }
    if (g_hook == nullptr) {
      return 1;
    }
    State& s = st();
    c10::Allocator* def = c10::GetDefaultCPUAllocator();
    if (def == nullptr || def != s.orig) {
      return 2;
    }
    if (std::strcmp(typeid(*def).name(), "N3c1019DefaultCPUAllocatorE") != 0) {
      return 3;
    }
    if (!is_writable(def, sizeof(void*))) {
      return 4;
    }
    // A stand-alone copy of the default allocator (same vptr; it is stateless)
    // becomes what the hook forwards to...
    auto* clone_mem = new void*[1];
    std::memcpy(clone_mem, def, sizeof(void*));
    auto* clone = reinterpret_cast<c10::Allocator*>(clone_mem);
    s.orig = clone;
    g_hook->set_orig(clone);
    // ...and the default allocator object itself starts forwarding to the hook.
    static DefaultForwarder proto;
    void* vptr = nullptr;
    std::memcpy(&vptr, static_cast<void*>(&proto), sizeof(void*));
    __atomic_store_n(reinterpret_cast<void**>(def), vptr, __ATOMIC_SEQ_CST);
    g_default_covered = true;
    return 0;
  } catch (...) {
    return 5;
  }
}

MA_API int ma_default_covered(void) {
  std::lock_guard<std::mutex> g(g_install_mu);
  return g_default_covered ? 1 : 0;
}

MA_API int ma_installed(void) {
  std::lock_guard<std::mutex> g(g_install_mu);
  return g_hook != nullptr && c10::GetAllocator(c10::DeviceType::CPU) == g_hook;
}

MA_API void ma_set_recording(int on) {
  st().recording.store(on != 0, std::memory_order_relaxed);
}

MA_API int ma_recording(void) {
  return st().recording.load(std::memory_order_relaxed) ? 1 : 0;
}

// Copies up to `capacity` pending events, oldest first, and removes them.
// `seqs` may be NULL.  Returns the number copied.
MA_API int64_t ma_drain_ex(int64_t* kinds, uint64_t* ptrs, int64_t* sizes,
                           int64_t* seqs, int64_t capacity) {
  if (capacity <= 0) {
    return 0;
  }
  State& s = st();
  BooksGuard g(s.mu);
  const size_t avail = s.events.size() - s.head;
  const size_t n = std::min(avail, static_cast<size_t>(capacity));
  const Event* src = s.events.data() + s.head;
  for (size_t i = 0; i < n; ++i) {
    kinds[i] = src[i].kind;
    ptrs[i] = src[i].ptr;
    sizes[i] = src[i].size;
    if (seqs != nullptr) {
      seqs[i] = src[i].seq;
    }
  }
  s.head += n;
  if (s.head == s.events.size()) {
    s.events.clear();  // keeps capacity
    s.head = 0;
  } else if (s.head > 65536 && s.head * 2 > s.events.size()) {
    s.events.erase(s.events.begin(), s.events.begin() + static_cast<std::ptrdiff_t>(s.head));
    s.head = 0;
  }
  return static_cast<int64_t>(n);
}

MA_API int64_t ma_drain(int64_t* kinds, uint64_t* ptrs, int64_t* sizes, int64_t capacity) {
  return ma_drain_ex(kinds, ptrs, sizes, nullptr, capacity);
}

MA_API int64_t ma_pending(void) {
  State& s = st();
  BooksGuard g(s.mu);
  return static_cast<int64_t>(s.events.size() - s.head);
}

// Discards pending events.
MA_API void ma_clear(void) {
  State& s = st();
  BooksGuard g(s.mu);
  s.events.clear();
  s.head = 0;
}

// Sequence number the next recorded event will get (== events recorded so far).
MA_API int64_t ma_next_seq(void) {
  State& s = st();
  BooksGuard g(s.mu);
  return s.next_seq;
}

// Bytes currently live among allocations made through the hook since install.
MA_API int64_t ma_live_bytes(void) {
  State& s = st();
  BooksGuard g(s.mu);
  return s.live_bytes;
}

// Number of allocations currently live among those made through the hook.
MA_API int64_t ma_live_count(void) {
  State& s = st();
  BooksGuard g(s.mu);
  return static_cast<int64_t>(s.live.size());
}

// High-water mark of ma_live_bytes() since install or the last ma_reset_peak().
MA_API int64_t ma_peak_bytes(void) {
  State& s = st();
  BooksGuard g(s.mu);
  return s.peak_bytes;
}

MA_API void ma_reset_peak(void) {
  State& s = st();
  BooksGuard g(s.mu);
  s.peak_bytes = s.live_bytes;
}

// Bumped whenever the C API changes incompatibly; native.py checks it.
MA_API int ma_api_version(void) {
  return 1;
}
