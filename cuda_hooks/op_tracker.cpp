// memadvisor native op tracker: the profiler's per-op bookkeeping in C++.
//
// The Python profiler's TorchDispatchMode costs ~15-20 us per aten op (a
// do-nothing Python dispatch mode alone costs ~3.6 us), which made a profiled
// step ~1.1x slower; torch.profiler records in C++ for a few us per op.  This
// library moves everything that happens per op or per allocation into C++ and
// leaves Python only the per-module / per-step hooks (module paths, phases,
// categories, steps), which run orders of magnitude less often.
//
// It is one library with the CPU allocator hook (allocator_hook.cpp is
// compiled into it) and adds:
//   * a global RecordFunction callback that keeps, per thread, the stack of
//     aten ops being run.  The op an allocation is charged to is the one a
//     Python TorchDispatchMode would see: the outermost op on the stack that is
//     not CompositeImplicitAutograd (aten::linear decomposes, so its addmm is
//     charged; aten::convolution does not, so its inner mkldnn_convolution is
//     not).  At that op's end its output tensors name the dtype and shape of
//     the blocks allocated for them; blocks nobody returned stay raw bytes
//     (kernel scratch), exactly like the dispatch engine's internal blocks.
//   * an allocator listener that turns every block into an event (alloc/free,
//     storage id, bytes, op, module, phase, source line, time), with the live
//     map from block address to storage id that categories are marked on.
//   * the user's source line, read from the Python stack on the thread that
//     runs the script, once per op that allocates, innermost user frame first.
//     Which code objects are "user code" is decided once each, in Python, and
//     a call site's line once per (code, instruction); after that the stack is
//     read without the GIL (the op was called with it released; the thread's
//     own frames cannot change while it runs the op), see read_source.
//   * the rules the dispatch engine applied per op: autocast's copy of a
//     parameter is an autocast weight; in forward, a storage made between
//     steps that an op reads is input data; a trainable leaf read with grad
//     enabled in a script without nn.Modules is a parameter and begins the
//     forward.
//   * per (module, phase, op) call counts, and the argument shapes of the ops
//     whose FLOPs the recompute cost model needs (Python evaluates torch's own
//     FLOP formulas on them once per distinct shape).
//
// Cost per op (benchmarks/per_op_overhead.py, at or below torch.profiler's):
// the op's name is interned once by the address of its name (a per-thread
// cache, no lock, no string); the books take a spin lock (a single atomic
// exchange), live blocks sit in open-addressing maps (nothing allocated per
// block), events in chunks that never move; most of what remains is torch's
// own: boxing the inputs and capturing the outputs for the callbacks.
//
// Threads: events from threads other than the script's (OpenMP workers, gloo)
// are charged to the op the script's thread is running.  The GIL is never
// taken on such a thread (a worker may run while the script's thread holds
// the GIL), and never while holding a tracker lock.
//
// Build: like allocator_hook.cpp, plus the ATen headers and Python's, linked
// with -ltorch_cpu (see memadvisor/profile/native.py).

#include <Python.h>
#include <frameobject.h>

#include "allocator_hook.cpp"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>

#include <ctime>
#include <map>
#include <memory>
#include <string>
#include <unordered_set>

namespace tracker {

// phases and categories: the codes memadvisor/profile/native_engine.py uses
enum Phase : int32_t { OTHER = 0, FORWARD = 1, BACKWARD = 2, OPTIMIZER = 3 };
// by priority: the most specific role first (recorder.CATEGORY_PRIORITY)
enum Category : int32_t {
  PARAMETER = 0, BUFFER = 1, OPTIMIZER_STATE = 2, GRADIENT = 3, AUTOCAST_WEIGHT = 4,
  INPUT = 5, ACTIVATION = 6, TEMPORARY = 7, OTHER_CATEGORY = 8, UNMARKED = 127
};

// op of a block the script's thread made outside any op that no op claimed (the
// CPU RNG state torch.utils.checkpoint keeps, buffers compiled code allocates): no op
constexpr int32_t OP_UNCLAIMED = -2;

struct Ev {
  int64_t seq;
  int64_t time_ns;
  int64_t sid;
  int64_t size;
  int32_t kind;    // +1 alloc, -1 free
  int32_t op;      // op id, -1 none
  int32_t module;  // module id (Python's table)
  int32_t phase;
  int32_t source;  // source id, -1 none
  int32_t dtype;   // c10::ScalarType, -1 raw bytes; external: 1000 + Python's code
  int64_t shape;   // offset into the shape pool, -1 none
};
static_assert(sizeof(Ev) == 64, "Ev layout is read by numpy");

struct Live {
  int64_t sid;
  int64_t ev;  // index of the alloc event
  int32_t phase;
  bool external;
};

struct OpInfo {
  int32_t id;
  bool composite;  // CompositeImplicitAutograd: decomposes, never charged
  bool flops;      // record argument shapes for the FLOP formulas
  bool to_copy;    // aten::_to_copy (autocast's weight cast)
};

// An op's recorded inputs: the first MAX_READ tensor arguments with a storage we know
// (RecordFunction's inputs are only valid in the start callback: read there)
constexpr int MAX_READ = 8;

struct Frame {
  int32_t op;
  bool charged;
  bool param_cast;
  int32_t source;  // -2: not read yet for this op
  std::vector<int64_t> flop_args;
  int32_t n_read = 0;
  std::array<int64_t, MAX_READ> read{};
};

// The events, in chunks of 2^16 (4 MiB) that never move: appending costs no more at
// the ten millionth event than at the first (a std::vector copies everything it holds
// each time it doubles, under the lock, and holds twice the memory meanwhile).
class EventLog {
 public:
  static constexpr size_t CHUNK_BITS = 16;
  static constexpr size_t CHUNK = size_t(1) << CHUNK_BITS;
  static constexpr size_t KEPT_CHUNKS = 4;  // kept by clear() for the next session

  size_t size() const { return size_; }
  Ev& operator[](size_t i) { return chunks_[i >> CHUNK_BITS][i & (CHUNK - 1)]; }

  void push_back(const Ev& ev) {
    if ((size_ >> CHUNK_BITS) == chunks_.size()) chunks_.emplace_back(new Ev[CHUNK]);
    (*this)[size_++] = ev;
  }

  void clear() {
    if (chunks_.size() > KEPT_CHUNKS) chunks_.resize(KEPT_CHUNKS);
    size_ = 0;
  }

  // Copies the first n events (n <= size()) to out.
  void copy_to(Ev* out, size_t n) const {
    for (size_t done = 0, chunk = 0; done < n; done += CHUNK, ++chunk) {
      std::memcpy(out + done, chunks_[chunk].get(), std::min(CHUNK, n - done) * sizeof(Ev));
    }
  }

 private:
  std::vector<std::unique_ptr<Ev[]>> chunks_;
  size_t size_ = 0;
};

struct CallSlot {
  int32_t module;
  int32_t phase;
  int64_t* calls;
};

struct PairHash {
  size_t operator()(const std::pair<PyObject*, int>& k) const noexcept {
    return std::hash<uintptr_t>()(reinterpret_cast<uintptr_t>(k.first)) * 31u +
           static_cast<size_t>(k.second);
  }
};

struct T {
  SpinLock mu;  // the books: events, live blocks, marks, calls
  EventLog events;
  std::vector<int64_t> shapes;  // [ndim, d0, d1, ...] records
  // data flow: the storage ids each allocating op read (input_pool), and per output
  // alloc event where its op's ids start and how many there are
  std::vector<int64_t> input_pool;
  std::vector<std::array<int64_t, 3>> input_refs;  // {event, start, count}
  AddressMap<Live> live;
  std::unordered_map<int64_t, int32_t> marks;   // sid -> category
  std::unordered_map<int64_t, int32_t> owners;  // sid -> module id
  int64_t next_sid = 0;
  int64_t live_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t t0_ns = 0;
  std::atomic<bool> on{false};
  std::atomic<int32_t> module{0};
  std::atomic<int32_t> phase{OTHER};
  std::atomic<int32_t> op_override{-1};
  std::atomic<bool> have_roots{false};
  std::atomic<bool> link_backward{true};
  std::atomic<int64_t> forward_begin_seq{-1};  // set when a leaf starts a forward
  // what the script's thread is running, for events of other threads
  std::atomic<int32_t> main_op{-1};
  std::atomic<int32_t> main_source{-1};
  // blocks the script's thread made outside any op (a Python number wrapped into a
  // tensor while the arguments are parsed): charged to the op that starts next
  std::vector<int64_t> unattributed;
  // autograd sequence number of a forward op -> module running it: in backward, the node
  // with that number runs that module's backward (how torch.profiler links the two)
  std::unordered_map<int64_t, int32_t> seq_module;
  // op table (by name) and per-name-pointer cache
  std::mutex op_mu;
  std::vector<std::string> op_names;
  std::unordered_map<std::string, int32_t> op_ids;
  std::unordered_map<const char*, OpInfo> op_cache;
  std::unordered_set<std::string> flop_ops;
  // (module, phase, op) -> calls
  std::map<std::tuple<int32_t, int32_t, int32_t>, int64_t> calls;
  // per op id, the counter it used last: an op mostly runs again where it ran before
  std::vector<CallSlot> call_slots;
  // FLOP records: (module, phase, op, args id); args interned
  std::vector<std::array<int32_t, 4>> flop_calls;
  std::vector<std::vector<int64_t>> flop_args;
  std::map<std::vector<int64_t>, int32_t> flop_arg_ids;
  // sources (touched with the GIL held only)
  std::vector<std::pair<PyObject*, int>> sources;
  std::map<std::pair<PyObject*, int>, int32_t> source_ids;
  // (code object, offset of the instruction running) -> source id: the line number is
  // computed (a walk of the code's line table) once per call site, not once per op
  std::unordered_map<std::pair<PyObject*, int>, int32_t, PairHash> site_ids;
  std::unordered_map<PyObject*, bool> user_code;
  PyObject* classify = nullptr;
  PyThreadState* main_ts = nullptr;
  at::CallbackHandle callback = 0;
  at::CallbackHandle backward_callback = 0;
};

T& tt() {
  static T* t = new T();  // leaked on purpose, like the allocator hook's state
  return *t;
}

thread_local std::vector<Frame> t_stack;
thread_local int t_charged = -1;  // index of the charged frame in t_stack

// Whether this thread runs the script (its Python thread state is main_ts): asked of
// Python once per thread and session, not once per op and allocation.
thread_local PyThreadState* t_script_checked_for = nullptr;
thread_local bool t_on_script_thread = false;

inline bool on_script_thread(const T& t) {
  PyThreadState* main = t.main_ts;
  if (main == nullptr) return false;
  if (t_script_checked_for != main) {
    t_on_script_thread = PyGILState_GetThisThreadState() == main;
    t_script_checked_for = main;
  }
  return t_on_script_thread;
}

int64_t now_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

int64_t next_seq_locked(T& t) {
  return static_cast<int64_t>(t.events.size());
}

void mark_sid_locked(T& t, int64_t sid, int32_t category) {
  auto it = t.marks.find(sid);
  if (it == t.marks.end()) {
    t.marks.emplace(sid, category);
  } else if (category < it->second) {
    it->second = category;
  }
}

// ---- ops --------------------------------------------------------------------

// Bumped whenever op_cache is cleared: thread-local copies of it are stale then.
std::atomic<uint64_t> g_op_generation{1};

OpInfo op_info_locked(T& t, const at::RecordFunction& fn, const char* name);

// What an op is, by its name's address (interned once per op, then no lock and no string
// per call): a small direct-mapped cache per thread in front of the shared op table.
struct CachedOp {
  const char* name = nullptr;
  uint64_t generation = 0;
  OpInfo info{};
};
constexpr size_t OP_CACHE_SLOTS = 256;
thread_local CachedOp t_op_cache[OP_CACHE_SLOTS];

inline OpInfo op_info(const at::RecordFunction& fn) {
  const char* name = fn.name();
  uint64_t generation = g_op_generation.load(std::memory_order_acquire);
  CachedOp& slot = t_op_cache[(reinterpret_cast<uintptr_t>(name) >> 4) % OP_CACHE_SLOTS];
  if (slot.name == name && slot.generation == generation) return slot.info;
  T& t = tt();
  OpInfo info;
  {
    std::lock_guard<std::mutex> g(t.op_mu);
    generation = g_op_generation.load(std::memory_order_relaxed);
    info = op_info_locked(t, fn, name);
  }
  slot = CachedOp{name, generation, info};
  return info;
}

OpInfo op_info_locked(T& t, const at::RecordFunction& fn, const char* name) {
  auto it = t.op_cache.find(name);
  if (it != t.op_cache.end()) {
    return it->second;
  }
  std::string s(name);
  int32_t id;
  auto found = t.op_ids.find(s);
  if (found != t.op_ids.end()) {
    id = found->second;
  } else {
    id = static_cast<int32_t>(t.op_names.size());
    t.op_names.push_back(s);
    t.op_ids.emplace(s, id);
  }
  // a RecordFunction that is no dispatcher op (the autograd engine's
  // "evaluate_function: ..." ranges, user record_function blocks) is transparent
  bool composite = true;
  auto opname = fn.operator_name();
  if (opname.has_value()) {
    composite = false;
    auto handle = c10::Dispatcher::singleton().findOp(*opname);
    if (handle.has_value()) {
      composite = handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
    }
  }
  OpInfo info{id, composite, t.flop_ops.count(s) > 0, s == "aten::_to_copy"};
  t.op_cache.emplace(name, info);
  return info;
}

int32_t intern_op_locked(T& t, const std::string& s) {
  auto found = t.op_ids.find(s);
  if (found != t.op_ids.end()) {
    return found->second;
  }
  int32_t id = static_cast<int32_t>(t.op_names.size());
  t.op_names.push_back(s);
  t.op_ids.emplace(s, id);
  return id;
}

// Argument encoding for the FLOP formulas: tag, then payload.
void encode(const c10::IValue& v, std::vector<int64_t>& out) {
  if (v.isTensor()) {
    const at::Tensor& x = v.toTensor();
    if (!x.defined()) {
      out.push_back(0);
      return;
    }
    out.push_back(1);
    out.push_back(x.dim());
    for (int64_t d : x.sizes()) out.push_back(d);
  } else if (v.isNone()) {
    out.push_back(0);
  } else if (v.isBool()) {
    out.push_back(4);
    out.push_back(v.toBool() ? 1 : 0);
  } else if (v.isInt()) {
    out.push_back(2);
    out.push_back(v.toInt());
  } else if (v.isDouble()) {
    out.push_back(3);
    double d = v.toDouble();
    int64_t bits;
    std::memcpy(&bits, &d, sizeof(bits));
    out.push_back(bits);
  } else if (v.isIntList()) {
    auto l = v.toIntVector();
    out.push_back(5);
    out.push_back(static_cast<int64_t>(l.size()));
    for (int64_t x : l) out.push_back(x);
  } else if (v.isBoolList()) {
    auto l = v.toBoolList();
    out.push_back(6);
    out.push_back(static_cast<int64_t>(l.size()));
    for (bool x : l) out.push_back(x ? 1 : 0);
  } else if (v.isList()) {
    auto l = v.toListRef();
    out.push_back(7);
    out.push_back(static_cast<int64_t>(l.size()));
    for (const auto& x : l) encode(x, out);
  } else {
    out.push_back(8);  // something the formulas do not read
  }
}

// Calls f(tensor) for each tensor in the values, lists included.
template <typename F>
void each_tensor(c10::ArrayRef<c10::IValue> values, F&& f) {
  for (const auto& v : values) {
    if (v.isTensor()) {
      const at::Tensor& x = v.toTensor();
      if (x.defined()) f(x);
    } else if (v.isTensorList() || v.isList()) {
      for (const auto& item : v.toListRef()) {
        if (item.isTensor() && item.toTensor().defined()) f(item.toTensor());
      }
    }
  }
}

inline uint64_t storage_ptr(const at::Tensor& x) {
  if (!x.has_storage()) return 0;
  return reinterpret_cast<uint64_t>(x.storage().data());
}

// ---- source lines (GIL held) -------------------------------------------------

bool is_user_code(T& t, PyCodeObject* code) {
  auto it = t.user_code.find(reinterpret_cast<PyObject*>(code));
  if (it != t.user_code.end()) return it->second;
  bool user = false;
  if (t.classify != nullptr) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject* r = PyObject_CallOneArg(t.classify, reinterpret_cast<PyObject*>(code));
    if (r != nullptr) {
      user = PyObject_IsTrue(r) == 1;
      Py_DECREF(r);
    }
    PyErr_Clear();
    PyErr_Restore(type, value, tb);
  }
  Py_INCREF(code);  // pinned: a freed code object's address could be reused
  t.user_code.emplace(reinterpret_cast<PyObject*>(code), user);
  return user;
}

// The id of (code, line), in order of first appearance.
int32_t source_id_locked_gil(T& t, PyCodeObject* code, int line) {
  auto key = std::make_pair(reinterpret_cast<PyObject*>(code), line);
  auto it = t.source_ids.find(key);
  if (it != t.source_ids.end()) return it->second;
  auto id = static_cast<int32_t>(t.sources.size());
  Py_INCREF(code);
  t.sources.push_back(key);
  t.source_ids.emplace(key, id);
  return id;
}

int32_t read_source_locked_gil(T& t) {
  PyFrameObject* f = PyEval_GetFrame();  // borrowed
  Py_XINCREF(f);
  int32_t id = -1;
  while (f != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(f);  // new reference
    if (is_user_code(t, code)) {
#if PY_VERSION_HEX >= 0x030B0000
      auto site = std::make_pair(reinterpret_cast<PyObject*>(code), PyFrame_GetLasti(f));
      auto known = t.site_ids.find(site);
      if (known != t.site_ids.end()) {
        id = known->second;
      } else {
        id = source_id_locked_gil(t, code, PyFrame_GetLineNumber(f));
        t.site_ids.emplace(site, id);  // the code object is pinned by is_user_code
      }
#else
      id = source_id_locked_gil(t, code, PyFrame_GetLineNumber(f));
#endif
      Py_DECREF(code);
      Py_DECREF(f);
      break;
    }
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(f);  // new reference
    Py_DECREF(f);
    f = back;
  }
  return id;
}

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
// CPython 3.11's _PyInterpreterFrame (Include/internal/pycore_frame.h), read-only
struct Frame311 {
  PyObject* f_func;
  PyObject* f_globals;
  PyObject* f_builtins;
  PyObject* f_locals;
  PyCodeObject* f_code;
  PyObject* frame_obj;
  Frame311* previous;
  _Py_CODEUNIT* prev_instr;
  int stacktop;
  bool is_entry;
  char owner;
};
constexpr char FRAME_OWNED_BY_GENERATOR = 1;

inline _Py_CODEUNIT* code_units(PyCodeObject* code) {
  return reinterpret_cast<_Py_CODEUNIT*>(code->co_code_adaptive);
}

// _PyFrame_IsIncomplete: a frame still setting up, which PyFrame_GetBack skips
inline bool incomplete(const Frame311* f) {
  return f->owner != FRAME_OWNED_BY_GENERATOR &&
         f->prev_instr < code_units(f->f_code) + f->f_code->_co_firsttraceable;
}
#define MA_FRAMES_WITHOUT_GIL 1
#endif

constexpr int32_t SOURCE_UNKNOWN = -3;

// Bumped by ma_t_reset: source ids start again from 0.
std::atomic<uint64_t> g_source_generation{1};

// The script thread's own copy of what read_source_locked_gil found: code objects'
// verdicts (never change: the code objects are pinned) and call sites' source ids (valid
// for one generation).  Only that thread reads and writes it, so it needs no lock.
struct ScriptSources {
  uint64_t generation = 0;
  // the last answer where the innermost frame was user code: it depends on that frame's
  // code and instruction only (the walk stops there), and loops repeat them op after op
  PyCodeObject* last_code = nullptr;
  _Py_CODEUNIT* last_instr = nullptr;
  int32_t last_id = -1;
  std::unordered_map<PyObject*, bool> user_code;
  std::unordered_map<std::pair<PyObject*, int>, int32_t, PairHash> site_ids;
};
thread_local ScriptSources t_sources;

#ifdef MA_FRAMES_WITHOUT_GIL
// PyFrame_GetLasti
inline int lasti_bytes(const Frame311* f) {
  auto lasti = static_cast<int>(f->prev_instr - code_units(f->f_code));
  return lasti < 0 ? -1 : lasti * static_cast<int>(sizeof(_Py_CODEUNIT));
}
#endif

// read_source_locked_gil's answer without the GIL where every frame it would walk is in
// t_sources, else SOURCE_UNKNOWN.  Called on the script's thread inside an op: that
// thread's frames cannot change or go away meanwhile (the thread is running this code),
// so reading them needs no GIL.  An op is called with the GIL released; taking it back
// once per op that allocates was the largest single cost of following an op.
int32_t read_source_without_gil(T& t) {
#ifdef MA_FRAMES_WITHOUT_GIL
  uint64_t generation = g_source_generation.load(std::memory_order_relaxed);
  if (t_sources.generation != generation) {
    t_sources.site_ids.clear();
    t_sources.last_code = nullptr;
    t_sources.generation = generation;
  }
  auto* f = reinterpret_cast<Frame311*>(t.main_ts->cframe->current_frame);
  if (f != nullptr && f->f_code == t_sources.last_code && f->prev_instr == t_sources.last_instr) {
    return t_sources.last_id;
  }
  for (bool first = true; f != nullptr; f = f->previous) {
    if (!first && incomplete(f)) continue;  // as PyFrame_GetBack
    first = false;
    auto user = t_sources.user_code.find(reinterpret_cast<PyObject*>(f->f_code));
    if (user == t_sources.user_code.end()) return SOURCE_UNKNOWN;
    if (!user->second) continue;
    auto site = t_sources.site_ids.find(
        std::make_pair(reinterpret_cast<PyObject*>(f->f_code), lasti_bytes(f)));
    if (site == t_sources.site_ids.end()) return SOURCE_UNKNOWN;
    if (f == reinterpret_cast<Frame311*>(t.main_ts->cframe->current_frame)) {
      t_sources.last_code = f->f_code;
      t_sources.last_instr = f->prev_instr;
      t_sources.last_id = site->second;
    }
    return site->second;
  }
  return -1;
#else
  (void)t;
  return SOURCE_UNKNOWN;
#endif
}

// After read_source_locked_gil (GIL held, script's thread): copies what it walked into
// t_sources, so that the same stack is read without the GIL next time.
void remember_sources_gil(T& t, int32_t id) {
#ifdef MA_FRAMES_WITHOUT_GIL
  auto* f = reinterpret_cast<Frame311*>(t.main_ts->cframe->current_frame);
  for (bool first = true; f != nullptr; f = f->previous) {
    if (!first && incomplete(f)) continue;
    first = false;
    auto key = reinterpret_cast<PyObject*>(f->f_code);
    auto user = t.user_code.find(key);
    if (user == t.user_code.end()) return;
    t_sources.user_code.emplace(key, user->second);
    if (user->second) {
      t_sources.site_ids.emplace(std::make_pair(key, lasti_bytes(f)), id);
      return;
    }
  }
#else
  (void)t;
  (void)id;
#endif
}

// The user's source line, on the script's thread only (-1 elsewhere).
int32_t read_source() {
  T& t = tt();
  if (!on_script_thread(t) || !Py_IsInitialized()) return -1;
  int32_t known = read_source_without_gil(t);
  if (known != SOURCE_UNKNOWN) {
#ifndef MA_CHECK_SOURCE_WITHOUT_GIL
    return known;
#else
    PyGILState_STATE check = PyGILState_Ensure();
    int32_t expected = read_source_locked_gil(t);
    PyGILState_Release(check);
    if (expected != known) {
      std::fprintf(stderr, "op_tracker: source %d without the GIL, %d with\n", known, expected);
      std::abort();
    }
    return known;
#endif
  }
  PyGILState_STATE g = PyGILState_Ensure();
  int32_t id = read_source_locked_gil(t);
  remember_sources_gil(t, id);
  PyGILState_Release(g);
  return id;
}

// ---- allocator listener -------------------------------------------------------

void free_locked(T& t, uint64_t key);

void on_alloc(void* p, int64_t size) {
  T& t = tt();
  if (!t.on.load(std::memory_order_relaxed)) return;
  int32_t op = -1;
  int32_t source = -1;
  bool script_thread = on_script_thread(t);
  int32_t forced = t.op_override.load(std::memory_order_relaxed);
  if (forced >= 0) {
    op = forced;
    source = read_source();
  } else if (t_charged >= 0) {
    Frame& f = t_stack[t_charged];
    op = f.op;
    if (f.source == -2) {
      f.source = script_thread ? read_source() : -1;
      if (script_thread) t.main_source.store(f.source, std::memory_order_relaxed);
    }
    source = f.source;
  } else if (script_thread && !t_stack.empty()) {
    op = t_stack.front().op;  // only composite ops on the stack (should not allocate)
    source = read_source();
  } else if (script_thread) {
    op = OP_UNCLAIMED;  // outside any op: the next op may claim it (see on_op_start)
    source = read_source();
  } else {
    op = t.main_op.load(std::memory_order_relaxed);
    source = t.main_source.load(std::memory_order_relaxed);
  }
  auto key = reinterpret_cast<uint64_t>(p);
  BooksGuard g(t.mu);
  if (t.live.find(key) != nullptr) {
    free_locked(t, key);  // an external storage at this address died unseen: close it
  }
  int64_t sid = t.next_sid++;
  int32_t phase = t.phase.load(std::memory_order_relaxed);
  int64_t index = static_cast<int64_t>(t.events.size());
  t.events.push_back(Ev{index, now_ns() - t.t0_ns, sid, size, 1, op,
                        t.module.load(std::memory_order_relaxed), phase, source, -1, -1});
  t.live.put(key, Live{sid, index, phase, false});
  t.live_bytes += size;
  if (t.live_bytes > t.peak_bytes) t.peak_bytes = t.live_bytes;
  if (op == OP_UNCLAIMED) t.unattributed.push_back(index);
}

void free_locked(T& t, uint64_t key) {
  Live* it = t.live.find(key);
  if (it == nullptr) return;
  const Ev a = t.events[it->ev];
  int64_t index = static_cast<int64_t>(t.events.size());
  t.events.push_back(Ev{index, now_ns() - t.t0_ns, a.sid, a.size, -1, a.op, a.module,
                        t.phase.load(std::memory_order_relaxed), a.source, a.dtype, a.shape});
  t.live_bytes -= a.size;
  t.live.erase(key);
}

void on_free(void* p) {
  T& t = tt();
  if (!t.on.load(std::memory_order_relaxed)) return;
  BooksGuard g(t.mu);
  free_locked(t, reinterpret_cast<uint64_t>(p));
}

// ---- RecordFunction callbacks -------------------------------------------------

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  T& t = tt();
  // always push, so that the end callback always pops its own frame
  if (!t.on.load(std::memory_order_relaxed)) {
    t_stack.push_back(Frame{-1, false, false, -1, {}, 0, {}});
    return nullptr;
  }
  OpInfo info = op_info(fn);
  bool script_thread = on_script_thread(t);
  // ops other threads run (OpenMP workers inside a kernel, gloo) are part of the op the
  // script's thread runs: never charged, so their blocks stay that op's raw bytes
  bool charged = script_thread && t_charged < 0 && !info.composite;
  t_stack.push_back(Frame{info.id, charged, false, -2, {}, 0, {}});
  if (!charged) return nullptr;
  t_charged = static_cast<int>(t_stack.size()) - 1;
  Frame& frame = t_stack.back();
  t.main_op.store(info.id, std::memory_order_relaxed);
  t.main_source.store(-1, std::memory_order_relaxed);
  int32_t phase = t.phase.load(std::memory_order_relaxed);
  auto inputs = fn.inputs();
  if (info.flops) {
    for (const auto& v : inputs) encode(v, frame.flop_args);
    frame.flop_args.push_back(-1);  // inputs | outputs
  }
  bool leaf_rule = !t.have_roots.load(std::memory_order_relaxed) &&
                   (phase == OTHER || phase == FORWARD) && c10::GradMode::is_enabled();
  BooksGuard g(t.mu);
  int32_t module = t.module.load(std::memory_order_relaxed);
  if (static_cast<size_t>(info.id) >= t.call_slots.size()) t.call_slots.resize(info.id + 1);
  CallSlot& slot = t.call_slots[info.id];
  if (slot.calls == nullptr || slot.module != module || slot.phase != phase) {
    // std::map: the counter's address stays valid until calls is cleared
    slot = CallSlot{module, phase, &t.calls[std::make_tuple(module, phase, info.id)]};
  }
  *slot.calls += 1;
  if (fn.seqNr() >= 0) {
    if (t.seq_module.size() > (1u << 22)) t.seq_module.clear();  // bounded
    t.seq_module[fn.seqNr()] = module;
  }
  if (!t.unattributed.empty()) {
    // a block the script's thread made just before, outside any op, that this op reads:
    // a Python number wrapped into a tensor for it.  It is this op's, with its dtype and
    // shape; the others stay unclaimed (OP_UNCLAIMED)
    each_tensor(inputs, [&](const at::Tensor& x) {
      auto it = t.live.find(storage_ptr(x));
      if (it == nullptr) return;
      Ev& a = t.events[it->ev];
      if (a.op == OP_UNCLAIMED && !it->external) {
        a.op = info.id;  // its free, if already copied, is fixed in Python
        a.dtype = static_cast<int32_t>(x.scalar_type());
        a.shape = static_cast<int64_t>(t.shapes.size());
        t.shapes.push_back(x.dim());
        for (int64_t d : x.sizes()) t.shapes.push_back(d);
      }
    });
    t.unattributed.clear();
  }
  each_tensor(inputs, [&](const at::Tensor& x) {
    if (frame.n_read >= MAX_READ) return;
    auto it = t.live.find(storage_ptr(x));
    if (it != nullptr) frame.read[frame.n_read++] = it->sid;
  });
  if (info.to_copy && !inputs.empty() && inputs[0].isTensor()) {
    auto it = t.live.find(storage_ptr(inputs[0].toTensor()));
    if (it != nullptr) {
      auto m = t.marks.find(it->sid);
      frame.param_cast = m != t.marks.end() && m->second == PARAMETER;
    }
  }
  if (phase == FORWARD || leaf_rule) {
    bool began = false;
    each_tensor(inputs, [&](const at::Tensor& x) {
      if (leaf_rule && x.requires_grad() && x.is_leaf()) {
        // a trainable tensor of a script without modules: a parameter
        auto it = t.live.find(storage_ptr(x));
        if (it != nullptr) mark_sid_locked(t, it->sid, PARAMETER);
        began = true;
        return;
      }
      if (phase != FORWARD) return;  // the leaf rule alone: nothing to look up
      auto it = t.live.find(storage_ptr(x));
      if (it != nullptr && it->phase == OTHER &&
          t.marks.find(it->sid) == t.marks.end()) {
        t.marks.emplace(it->sid, INPUT);  // made between steps, read by the forward
      }
    });
    if (began && phase == OTHER) {
      t.phase.store(FORWARD, std::memory_order_relaxed);
      t.forward_begin_seq.store(next_seq_locked(t), std::memory_order_relaxed);
    }
  }
  return nullptr;
}

void on_op_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (t_stack.empty()) return;
  Frame frame = std::move(t_stack.back());
  t_stack.pop_back();
  if (!frame.charged) return;
  t_charged = -1;
  T& t = tt();
  t.main_op.store(-1, std::memory_order_relaxed);  // only the script's thread charges
  if (!t.on.load(std::memory_order_relaxed)) return;
  const auto& outputs = fn.outputs();
  std::vector<int64_t> flop_args;
  if (!frame.flop_args.empty()) {
    flop_args = std::move(frame.flop_args);
    for (const auto& v : outputs) encode(v, flop_args);
  }
  BooksGuard g(t.mu);
  int64_t inputs_at = -1, inputs_count = 0;  // this op's read ids, once it made an output
  each_tensor(outputs, [&](const at::Tensor& x) {
    auto it = t.live.find(storage_ptr(x));
    if (it == nullptr) return;
    Ev& a = t.events[it->ev];
    if (a.dtype == -1 && !it->external) {
      a.dtype = static_cast<int32_t>(x.scalar_type());
      a.shape = static_cast<int64_t>(t.shapes.size());
      t.shapes.push_back(x.dim());
      for (int64_t d : x.sizes()) t.shapes.push_back(d);
      if (inputs_at < 0) {
        inputs_at = static_cast<int64_t>(t.input_pool.size());
        t.input_pool.insert(t.input_pool.end(), frame.read.begin(),
                            frame.read.begin() + frame.n_read);
        inputs_count = frame.n_read;
      }
      if (inputs_count) t.input_refs.push_back({it->ev, inputs_at, inputs_count});
    }
    if (frame.param_cast) mark_sid_locked(t, it->sid, AUTOCAST_WEIGHT);
  });
  if (!flop_args.empty()) {
    int32_t args_id;
    auto found = t.flop_arg_ids.find(flop_args);
    if (found != t.flop_arg_ids.end()) {
      args_id = found->second;
    } else {
      args_id = static_cast<int32_t>(t.flop_args.size());
      t.flop_arg_ids.emplace(flop_args, args_id);
      t.flop_args.push_back(std::move(flop_args));
    }
    t.flop_calls.push_back({t.module.load(std::memory_order_relaxed),
                            t.phase.load(std::memory_order_relaxed), frame.op, args_id});
  }
}

std::unique_ptr<at::ObserverContext> on_backward_node(const at::RecordFunction& fn) {
  T& t = tt();
  if (t.on.load(std::memory_order_relaxed)) {
    // the autograd engine runs a node: backward has begun (Python closes it), in the
    // module whose forward made the node (none known: the root, "")
    t.phase.store(BACKWARD, std::memory_order_relaxed);
    if (t.link_backward.load(std::memory_order_relaxed)) {
      int32_t module = 0;
      {
        BooksGuard g(t.mu);
        auto it = t.seq_module.find(fn.seqNr());
        if (it != t.seq_module.end()) module = it->second;
      }
      t.module.store(module, std::memory_order_relaxed);
    }
  }
  return nullptr;
}

}  // namespace tracker

// ---------------------------------------------------------------------------
// extern "C" API, called from memadvisor/profile/native_engine.py.  Functions
// taking PyObject* are called through ctypes.PyDLL (GIL held).
// ---------------------------------------------------------------------------
using tracker::tt;

MA_API int ma_t_api_version(void) {
  return 2;  // 2: data flow (ma_t_*input*)
}

// Starts tracking: installs the allocator hook (if not yet), the listeners and
// the RecordFunction callbacks.  `classify(code) -> bool` says whether a code
// object is user code.  Returns 0, or the ma_install() error code + 10, or 20
// if the callbacks could not be added.
MA_API int ma_t_start(int64_t t0_ns, PyObject* classify) {
  int rc = ma_install();
  if (rc != 0) return 10 + rc;
  auto& t = tt();
  Py_XINCREF(classify);
  Py_XDECREF(t.classify);
  t.classify = classify;
  t.main_ts = PyThreadState_Get();
  t.t0_ns = t0_ns;
  g_alloc_listener = &tracker::on_alloc;
  g_free_listener = &tracker::on_free;
  try {
    if (t.callback == 0) {
      t.callback = at::addGlobalCallback(
          at::RecordFunctionCallback(&tracker::on_op_start, &tracker::on_op_end)
              .needsInputs(true)
              .needsOutputs(true)
              .scopes({at::RecordScope::FUNCTION}));
      t.backward_callback = at::addGlobalCallback(
          at::RecordFunctionCallback(&tracker::on_backward_node)
              .scopes({at::RecordScope::BACKWARD_FUNCTION}));
    }
  } catch (...) {
    return 20;
  }
  static bool atfork_done = false;
  if (!atfork_done) {
    // a forked child (DataLoader worker) records nothing: nobody reads its events
    atfork_done = pthread_atfork(nullptr, nullptr, [] { tt().on.store(false); }) == 0;
  }
  t.on.store(true);
  return 0;
}

// Stops recording (events stay until ma_t_reset) and removes the callbacks, so
// that ops run after profiling pay nothing (no boxing of their arguments).  An op
// in flight keeps the callbacks it started with: its end still pops its frame,
// and an op that starts after removal never pushes one.
MA_API void ma_t_stop(void) {
  auto& t = tt();
  t.on.store(false);
  if (t.callback != 0) {
    at::removeCallback(t.callback);
    t.callback = 0;
  }
  if (t.backward_callback != 0) {
    at::removeCallback(t.backward_callback);
    t.backward_callback = 0;
  }
}

MA_API void ma_t_set_flop_op(const char* name) {
  auto& t = tt();
  std::lock_guard<std::mutex> g(t.op_mu);
  t.flop_ops.insert(name);
  t.op_cache.clear();
  tracker::g_op_generation.fetch_add(1, std::memory_order_acq_rel);
}

MA_API void ma_t_set_module(int32_t module) {
  tt().module.store(module, std::memory_order_relaxed);
}
MA_API void ma_t_set_phase(int32_t phase) {
  tt().phase.store(phase, std::memory_order_relaxed);
}
MA_API int32_t ma_t_phase(void) {
  return tt().phase.load(std::memory_order_relaxed);
}
// Whether backward nodes set the module (from their forward op); off when Python's
// module hooks follow backward themselves.
MA_API void ma_t_set_link_backward(int on) {
  tt().link_backward.store(on != 0);
}
MA_API void ma_t_set_have_roots(int on) {
  tt().have_roots.store(on != 0);
}
// Sequence number at which a trainable leaf began a forward since the last
// call (-1: none), for scripts without modules.
MA_API int64_t ma_t_take_forward_begin(void) {
  return tt().forward_begin_seq.exchange(-1);
}
// Charge allocations to this op name (NULL: back to the running op).
MA_API void ma_t_set_op_override(const char* name) {
  auto& t = tt();
  if (name == nullptr) {
    t.op_override.store(-1);
    return;
  }
  std::lock_guard<std::mutex> g(t.op_mu);
  t.op_override.store(tracker::intern_op_locked(t, name));
}

MA_API int64_t ma_t_next_seq(void) {
  auto& t = tt();
  BooksGuard g(t.mu);
  return static_cast<int64_t>(t.events.size());
}
MA_API int64_t ma_t_live_bytes(void) {
  auto& t = tt();
  BooksGuard g(t.mu);
  return t.live_bytes;
}
MA_API int64_t ma_t_peak_bytes(void) {
  auto& t = tt();
  BooksGuard g(t.mu);
  return t.peak_bytes;
}

// The storage id live at this address (-1: none).
MA_API int64_t ma_t_lookup(uint64_t ptr) {
  auto& t = tt();
  BooksGuard g(t.mu);
  auto it = t.live.find(ptr);
  return it == nullptr ? -1 : it->sid;
}
// Bytes of the block live at this address (-1: none).
MA_API int64_t ma_t_size_of(uint64_t ptr) {
  auto& t = tt();
  BooksGuard g(t.mu);
  auto it = t.live.find(ptr);
  return it == nullptr ? -1 : t.events[it->ev].size;
}
// Phase in which the storage at this address was allocated (-1: none).
MA_API int32_t ma_t_alloc_phase(uint64_t ptr) {
  auto& t = tt();
  BooksGuard g(t.mu);
  auto it = t.live.find(ptr);
  return it == nullptr ? -1 : it->phase;
}
// Marks the storage live at ptr; returns 0 when nothing is live there.
MA_API int32_t ma_t_mark(uint64_t ptr, int32_t category) {
  auto& t = tt();
  BooksGuard g(t.mu);
  auto it = t.live.find(ptr);
  if (it == nullptr) return 0;
  tracker::mark_sid_locked(t, it->sid, category);
  return 1;
}
MA_API void ma_t_mark_sid(int64_t sid, int32_t category) {
  auto& t = tt();
  BooksGuard g(t.mu);
  tracker::mark_sid_locked(t, sid, category);
}
// The category marked on storage `sid` (-1: unmarked).
MA_API int32_t ma_t_sid_category(int64_t sid) {
  auto& t = tt();
  BooksGuard g(t.mu);
  auto m = t.marks.find(sid);
  return m == t.marks.end() ? -1 : m->second;
}
// The category marked on the storage at this address (-1: none or unmarked).
MA_API int32_t ma_t_category(uint64_t ptr) {
  auto& t = tt();
  BooksGuard g(t.mu);
  auto it = t.live.find(ptr);
  if (it == nullptr) return -1;
  auto m = t.marks.find(it->sid);
  return m == t.marks.end() ? -1 : m->second;
}
// Marks many storages at once (owner -1: none); unknown[i] = 1 where nothing is live
// at ptrs[i] (0 included).  Returns how many were unknown.
MA_API int64_t ma_t_mark_many(const uint64_t* ptrs, const int32_t* categories,
                              const int32_t* owners, int64_t n, uint8_t* unknown) {
  auto& t = tt();
  BooksGuard g(t.mu);
  int64_t missing = 0;
  for (int64_t i = 0; i < n; ++i) {
    auto it = t.live.find(ptrs[i]);  // nothing at 0
    if (it == nullptr) {
      unknown[i] = 1;
      ++missing;
      continue;
    }
    unknown[i] = 0;
    tracker::mark_sid_locked(t, it->sid, categories[i]);
    if (owners[i] >= 0) t.owners.emplace(it->sid, owners[i]);
  }
  return missing;
}
MA_API void ma_t_set_owner(uint64_t ptr, int32_t module) {
  auto& t = tt();
  BooksGuard g(t.mu);
  auto it = t.live.find(ptr);
  if (it != nullptr) t.owners.emplace(it->sid, module);
}

// A storage the allocator hook never saw (numpy memory, shared memory from a
// DataLoader worker, a Python-made storage): logged by Python at first use,
// freed by Python's weak-reference callback.  Returns its sid.  GIL held.
MA_API int64_t ma_t_external_alloc(uint64_t ptr, int64_t size, int32_t dtype_code,
                                   int32_t ndim, const int64_t* shape, const char* op) {
  auto& t = tt();
  int32_t op_id = -1;
  if (op != nullptr && op[0] != '\0') {
    std::lock_guard<std::mutex> g(t.op_mu);
    op_id = tracker::intern_op_locked(t, op);
  }
  int32_t source = tracker::read_source_locked_gil(t);
  BooksGuard g(t.mu);
  if (tracker::Live* known = t.live.find(ptr)) return known->sid;
  int64_t sid = t.next_sid++;
  int64_t index = static_cast<int64_t>(t.events.size());
  int64_t shape_at = -1;
  if (ndim >= 0) {
    shape_at = static_cast<int64_t>(t.shapes.size());
    t.shapes.push_back(ndim);
    for (int i = 0; i < ndim; ++i) t.shapes.push_back(shape[i]);
  }
  int32_t phase = t.phase.load(std::memory_order_relaxed);
  t.events.push_back(tracker::Ev{index, tracker::now_ns() - t.t0_ns, sid, size, 1, op_id,
                        t.module.load(std::memory_order_relaxed), phase, source, dtype_code,
                        shape_at});
  t.live.put(ptr, tracker::Live{sid, index, phase, true});
  t.live_bytes += size;
  if (t.live_bytes > t.peak_bytes) t.peak_bytes = t.live_bytes;
  return sid;
}
// Frees what is live at ptr if it is the external storage `sid`.
MA_API void ma_t_external_free(uint64_t ptr, int64_t sid) {
  auto& t = tt();
  if (!t.on.load()) return;
  BooksGuard g(t.mu);
  auto it = t.live.find(ptr);
  if (it != nullptr && it->sid == sid && it->external) {
    tracker::free_locked(t, ptr);
  }
}

// ---- reading the results (after ma_t_stop) ------------------------------------
MA_API int64_t ma_t_event_count(void) {
  auto& t = tt();
  BooksGuard g(t.mu);
  return static_cast<int64_t>(t.events.size());
}
MA_API void ma_t_copy_events(void* out, int64_t n) {
  auto& t = tt();
  BooksGuard g(t.mu);
  n = std::min<int64_t>(n, static_cast<int64_t>(t.events.size()));
  if (n > 0) t.events.copy_to(static_cast<tracker::Ev*>(out), static_cast<size_t>(n));
}
// The flat int64 pools (shapes, data flow) as (count, copy) pairs: copy returns nothing,
// it copies min(n, size) elements of `width` int64s each (a std::vector member of T).
namespace tracker {
template <class V>
int64_t pool_size(V T::*pool) {
  auto& t = tt();
  BooksGuard g(t.mu);
  return static_cast<int64_t>((t.*pool).size());
}
template <class V>
void copy_pool(V T::*pool, int64_t* out, int64_t n, size_t width) {
  auto& t = tt();
  BooksGuard g(t.mu);
  n = std::min<int64_t>(n, static_cast<int64_t>((t.*pool).size()));
  if (n > 0) std::memcpy(out, (t.*pool).data(), static_cast<size_t>(n) * width * sizeof(int64_t));
}
}  // namespace tracker
MA_API int64_t ma_t_shape_count(void) { return tracker::pool_size(&tracker::T::shapes); }
MA_API void ma_t_copy_shapes(int64_t* out, int64_t n) {
  tracker::copy_pool(&tracker::T::shapes, out, n, 1);
}
MA_API int64_t ma_t_input_pool_count(void) { return tracker::pool_size(&tracker::T::input_pool); }
MA_API void ma_t_copy_input_pool(int64_t* out, int64_t n) {
  tracker::copy_pool(&tracker::T::input_pool, out, n, 1);
}
MA_API int64_t ma_t_input_ref_count(void) { return tracker::pool_size(&tracker::T::input_refs); }
// {event, start, count} triples
MA_API void ma_t_copy_input_refs(int64_t* out, int64_t n) {
  tracker::copy_pool(&tracker::T::input_refs, out, n, 3);
}
// marks and owners as (sid, value) pairs; the copies return how many were copied
namespace tracker {
using SidMap = std::unordered_map<int64_t, int32_t>;

int64_t pair_count(SidMap T::*map) {
  T& t = tt();
  BooksGuard g(t.mu);
  return static_cast<int64_t>((t.*map).size());
}

int64_t copy_pairs(SidMap T::*map, int64_t* sids, int32_t* values, int64_t cap) {
  T& t = tt();
  BooksGuard g(t.mu);
  int64_t i = 0;
  for (const auto& kv : t.*map) {
    if (i >= cap) break;
    sids[i] = kv.first;
    values[i++] = kv.second;
  }
  return i;
}
}  // namespace tracker

MA_API int64_t ma_t_mark_count(void) {
  return tracker::pair_count(&tracker::T::marks);
}
MA_API int64_t ma_t_copy_marks(int64_t* sids, int32_t* values, int64_t cap) {
  return tracker::copy_pairs(&tracker::T::marks, sids, values, cap);
}
MA_API int64_t ma_t_owner_count(void) {
  return tracker::pair_count(&tracker::T::owners);
}
MA_API int64_t ma_t_copy_owners(int64_t* sids, int32_t* values, int64_t cap) {
  return tracker::copy_pairs(&tracker::T::owners, sids, values, cap);
}
MA_API int32_t ma_t_op_count(void) {
  auto& t = tt();
  std::lock_guard<std::mutex> g(t.op_mu);
  return static_cast<int32_t>(t.op_names.size());
}
// Copies op i's name (NUL-terminated, truncated to cap); returns its length.
MA_API int32_t ma_t_op_name(int32_t i, char* out, int32_t cap) {
  auto& t = tt();
  std::lock_guard<std::mutex> g(t.op_mu);
  if (i < 0 || i >= static_cast<int32_t>(t.op_names.size()) || cap <= 0) return -1;
  const std::string& s = t.op_names[i];
  int32_t n = std::min<int32_t>(static_cast<int32_t>(s.size()), cap - 1);
  std::memcpy(out, s.data(), n);
  out[n] = '\0';
  return static_cast<int32_t>(s.size());
}
MA_API int32_t ma_t_dtype_name(int32_t code, char* out, int32_t cap) {
  if (code < 0 || code >= static_cast<int32_t>(c10::ScalarType::NumOptions) || cap <= 0) {
    return -1;
  }
  const char* s = c10::toString(static_cast<c10::ScalarType>(code));
  int32_t n = std::min<int32_t>(static_cast<int32_t>(std::strlen(s)), cap - 1);
  std::memcpy(out, s, n);
  out[n] = '\0';
  return n;
}
// Appends (code object, line) for every source id, in id order.  GIL held.
MA_API int ma_t_sources_into(PyObject* list) {
  auto& t = tt();
  for (const auto& src : t.sources) {
    PyObject* item = Py_BuildValue("(Oi)", src.first, src.second);
    if (item == nullptr || PyList_Append(list, item) != 0) {
      Py_XDECREF(item);
      return -1;
    }
    Py_DECREF(item);
  }
  return 0;
}
// (module, phase, op, calls) rows
MA_API int64_t ma_t_call_count(void) {
  auto& t = tt();
  BooksGuard g(t.mu);
  return static_cast<int64_t>(t.calls.size());
}
MA_API int64_t ma_t_copy_calls(int32_t* keys, int64_t* calls, int64_t cap) {
  auto& t = tt();
  BooksGuard g(t.mu);
  int64_t i = 0;
  for (const auto& kv : t.calls) {
    if (i >= cap) break;
    keys[3 * i] = std::get<0>(kv.first);
    keys[3 * i + 1] = std::get<1>(kv.first);
    keys[3 * i + 2] = std::get<2>(kv.first);
    calls[i++] = kv.second;
  }
  return i;
}
// (module, phase, op, args id) of each call of a FLOP-counted op
MA_API int64_t ma_t_flop_call_count(void) {
  auto& t = tt();
  BooksGuard g(t.mu);
  return static_cast<int64_t>(t.flop_calls.size());
}
MA_API void ma_t_copy_flop_calls(int32_t* out, int64_t n) {
  auto& t = tt();
  BooksGuard g(t.mu);
  n = std::min<int64_t>(n, static_cast<int64_t>(t.flop_calls.size()));
  for (int64_t i = 0; i < n; ++i) {
    for (int j = 0; j < 4; ++j) out[4 * i + j] = t.flop_calls[i][j];
  }
}
MA_API int64_t ma_t_flop_args_count(void) {
  auto& t = tt();
  BooksGuard g(t.mu);
  return static_cast<int64_t>(t.flop_args.size());
}
// Copies args record i (up to cap values); returns its full length.
MA_API int64_t ma_t_flop_args(int64_t i, int64_t* out, int64_t cap) {
  auto& t = tt();
  BooksGuard g(t.mu);
  if (i < 0 || i >= static_cast<int64_t>(t.flop_args.size())) return -1;
  const auto& rec = t.flop_args[i];
  int64_t n = std::min<int64_t>(cap, static_cast<int64_t>(rec.size()));
  std::memcpy(out, rec.data(), static_cast<size_t>(n) * sizeof(int64_t));
  return static_cast<int64_t>(rec.size());
}

// Drops everything recorded (a new session in the same process starts clean).
MA_API void ma_t_reset(void) {
  auto& t = tt();
  {
    BooksGuard g(t.mu);
    t.events.clear();
    t.unattributed.clear();
    t.shapes.clear();
    t.input_pool.clear();
    t.input_refs.clear();
    t.live.clear();
    t.marks.clear();
    t.owners.clear();
    t.next_sid = 0;
    t.live_bytes = 0;
    t.peak_bytes = 0;
    t.calls.clear();
    t.call_slots.clear();
    t.flop_calls.clear();
    t.flop_args.clear();
    t.flop_arg_ids.clear();
    t.seq_module.clear();
  }
  t.module.store(0);
  t.phase.store(tracker::OTHER);
  t.op_override.store(-1);
  t.have_roots.store(false);
  t.forward_begin_seq.store(-1);
  // sources and code-object verdicts are kept: their ids index nothing now,
  // and the pinned code objects stay valid
  t.sources.clear();
  t.source_ids.clear();
  t.site_ids.clear();
  tracker::g_source_generation.fetch_add(1, std::memory_order_relaxed);
}
