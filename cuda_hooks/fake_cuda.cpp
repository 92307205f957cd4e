// fake_cuda.cpp: a simulated CUDA runtime for fake-tensor execution on a CPU-only torch.
//
// A CPU-only torch build can make FakeTensors on device 'cuda', but
//   * autograd aborts the process on them: its engine and InputBuffer take a device
//     guard for the tensor's device, and no CUDA guard is registered;
//   * at::globalContext().hasCUDA() is false, so pin_memory, device-count queries and
//     the parts of autocast that ask ATen refuse.
// This library fixes both, and nothing else: it never computes or allocates on a GPU.
//   * c10::impl::FakeGuardImpl<CUDA> becomes the CUDA device guard (current device and
//     streams are thread-local integers; events are no-ops; always 8 devices);
//   * FakeCudaHooks is registered as "CUDAHooks" in at::detail::CUDAHooksRegistry, which
//     at::detail::getCUDAHooks() consults exactly once (a c10::call_once) on its first
//     call.  It must therefore be registered before that first call, which is why the
//     library is loaded before `import torch` (memadvisor/fake/shim.py checks it won).
//
// The device count (1..8, FakeGuardImpl's fixed maximum) comes from
// ma_fake_set_device_count() or, if that was never called, from the environment variable
// MEMADVISOR_FAKE_DEVICE_COUNT (default 1), read when first asked.
//
// Build: see memadvisor/fake/shim.py (g++ -shared against torch's headers, linked to
// libtorch_cpu and libc10).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

#include <atomic>
#include <cstdlib>
#include <string>

namespace {

constexpr int kApiVersion = 1;
constexpr int kMaxDevices = c10::impl::kFakeGuardImplMaxDevices;

std::atomic<int> g_device_count{0};  // 0: not set yet, read the environment
std::atomic<int> g_hooks_created{0};  // how many times the registry built our hooks

int clamp_devices(long n) {
  if (n < 1) return 1;
  if (n > kMaxDevices) return kMaxDevices;
  return static_cast<int>(n);
}

int device_count() {
  int n = g_device_count.load(std::memory_order_relaxed);
  if (n == 0) {
    const char* env = std::getenv("MEMADVISOR_FAKE_DEVICE_COUNT");
    n = clamp_devices(env ? std::strtol(env, nullptr, 10) : 1);
    g_device_count.store(n, std::memory_order_relaxed);
  }
  return n;
}

using Guard = c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>;

struct FakeCudaHooks final : at::CUDAHooksInterface {
  explicit FakeCudaHooks(at::CUDAHooksArgs) { g_hooks_created.fetch_add(1); }

  // There is no CUDA context to create: "initialising CUDA" succeeds at once.
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  // Claiming the CUDA runtime or cuDNN would send ATen to kernels that do not exist
  // here; fake tensors never reach a kernel anyway.
  bool hasCUDART() const override { return false; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }

  c10::DeviceIndex deviceCount() const override {
    return static_cast<c10::DeviceIndex>(device_count());
  }
  int getNumGPUs() const override { return device_count(); }
  c10::DeviceIndex current_device() const override { return Guard::getDeviceIndex(); }
  c10::DeviceIndex getCurrentDevice() const override { return Guard::getDeviceIndex(); }
  void setCurrentDevice(c10::DeviceIndex device) const override {
    Guard::setDeviceIndex(device);
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    auto old = Guard::getDeviceIndex();
    Guard::setDeviceIndex(device);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }
  void deviceSynchronize(c10::DeviceIndex) const override {}

  // DataLoader(pin_memory=True) pins batches when CUDA is available: "pinned" memory is
  // ordinary CPU memory here, so the batch is copied and stays usable.
  c10::Allocator* getPinnedMemoryAllocator() const override {
    return c10::GetCPUAllocator();
  }
  bool isPinnedPtr(const void*) const override { return false; }

  // Code that asks for the CUDA generator (torch.Generator('cuda'), seeding) gets a
  // CPU generator: fake random ops never draw from it.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Generator getNewGenerator(c10::DeviceIndex) const override {
    return at::detail::createCPUGenerator();
  }

  std::string showConfig() const override {
    return "memadvisor fake CUDA (no kernels; fake tensors only)\n";
  }
};

}  // namespace

namespace at::detail {
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCudaHooks)
}  // namespace at::detail

C10_REGISTER_GUARD_IMPL(CUDA, Guard)

extern "C" {

__attribute__((visibility("default"))) int ma_fake_api_version() { return kApiVersion; }

// Returns the count in effect (clamped to 1..8).  Safe to call at any time: the hooks
// read it on every query.
__attribute__((visibility("default"))) int ma_fake_set_device_count(int count) {
  int n = clamp_devices(count);
  g_device_count.store(n, std::memory_order_relaxed);
  return n;
}

__attribute__((visibility("default"))) int ma_fake_device_count() { return device_count(); }

// The calling thread's current CUDA device: what a tensor made with device='cuda' (no
// index) lands on.  FakeGuardImpl keeps it thread-local, as the CUDA runtime does.
__attribute__((visibility("default"))) void ma_fake_set_current_device(int index) {
  if (index >= 0 && index < kMaxDevices) Guard::setDeviceIndex(static_cast<c10::DeviceIndex>(index));
}

__attribute__((visibility("default"))) int ma_fake_current_device() {
  return Guard::getDeviceIndex();
}

// 1 once torch asked the registry and got these hooks (0 before torch's first
// getCUDAHooks() call, and forever if torch had resolved its hooks before this library
// was loaded).
__attribute__((visibility("default"))) int ma_fake_hooks_created() {
  return g_hooks_created.load() > 0 ? 1 : 0;
}

// Whether torch's own CUDA hooks object is ours: asks torch (which creates the hooks on
// first call) and checks the answer.
__attribute__((visibility("default"))) int ma_fake_hooks_active() {
  try {
    const auto& hooks = at::detail::getCUDAHooks();
    return dynamic_cast<const FakeCudaHooks*>(&hooks) != nullptr ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

// Whether the CUDA device guard is the fake one (another library may have registered a
// real guard first: then ours was not installed).
__attribute__((visibility("default"))) int ma_fake_guard_active() {
  try {
    const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    return dynamic_cast<const Guard*>(impl) != nullptr ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

}  // extern "C"
