// CUDA streams and allocator statistics through c10's device-generic interfaces; see
// cuda_shim.h for the rules. Nothing here names a CUDA type: the CUDA implementations are found
// at run time through c10's registries, so this file compiles without CUDA headers.

#include "cuda_shim.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

namespace {

// Returned when even the error message cannot be allocated; braid_cuda_free leaves it alone.
char kOutOfMemory[] = "out of memory while reporting a CUDA error";

char* error_string(const std::string& message) noexcept {
  char* copy = static_cast<char*>(std::malloc(message.size() + 1));
  if (copy == nullptr) {
    return kOutOfMemory;
  }
  std::memcpy(copy, message.data(), message.size());
  copy[message.size()] = '\0';
  return copy;
}

// Runs `f`, turning any exception into an error string.
template <typename F>
char* guarded(F&& f) noexcept {
  try {
    f();
    return nullptr;
  } catch (const c10::Error& e) {
    return error_string(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return error_string(e.what());
  } catch (...) {
    return error_string("unknown C++ exception");
  }
}

// The CUDA guard implementation, or an exception saying that this process has none.
const c10::impl::DeviceGuardImplInterface* cuda_guard() {
  if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) {
    throw std::runtime_error(
        "libtorch's CUDA backend is not loaded in this process (a CPU-only libtorch, or a "
        "binary linked without libtorch_cuda.so)");
  }
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
}

// Checks that `device` exists before c10 is asked about it: c10's CUDA calls assert on an
// index out of range instead of throwing a readable error.
c10::Device cuda_device(int device) {
  const auto* guard = cuda_guard();
  const int count = guard->deviceCount();
  if (device < 0 || device >= count) {
    throw std::runtime_error("no CUDA device " + std::to_string(device) + " (this machine has " +
                             std::to_string(count) + ")");
  }
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
}

c10::Stream stream_of(int device, int64_t id) {
  return c10::Stream::unpack3(id, static_cast<c10::DeviceIndex>(device), c10::DeviceType::CUDA);
}

}  // namespace

extern "C" {

void braid_cuda_free(void* ptr) {
  if (ptr != kOutOfMemory) {
    std::free(ptr);
  }
}

int braid_cuda_backend_linked(void) {
  try {
    return c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

char* braid_cuda_pool_stream(int device, int64_t* stream_id) {
  return guarded([&] {
    const auto d = cuda_device(device);
    const c10::Stream s = cuda_guard()->getStreamFromGlobalPool(d, false);
    *stream_id = s.id();
  });
}

char* braid_cuda_exchange_stream(int device, int64_t stream_id, int64_t* previous) {
  return guarded([&] {
    cuda_device(device);
    const c10::Stream before = cuda_guard()->exchangeStream(stream_of(device, stream_id));
    *previous = before.id();
  });
}

char* braid_cuda_synchronize_stream(int device, int64_t stream_id) {
  return guarded([&] {
    cuda_device(device);
    cuda_guard()->synchronizeStream(stream_of(device, stream_id));
  });
}

char* braid_cuda_memory(int device, int64_t* allocated, int64_t* peak) {
  return guarded([&] {
    const auto d = cuda_device(device);
    auto* allocator = c10::getDeviceAllocator(c10::DeviceType::CUDA);
    const auto stats = allocator->getDeviceStats(d.index());
    const auto& bytes =
        stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
    *allocated = bytes.current;
    *peak = bytes.peak;
  });
}

char* braid_cuda_reset_peak(int device) {
  return guarded([&] {
    const auto d = cuda_device(device);
    c10::getDeviceAllocator(c10::DeviceType::CUDA)->resetPeakStats(d.index());
  });
}

}  // extern "C"
