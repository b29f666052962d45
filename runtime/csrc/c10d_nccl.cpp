// The NCCL backend (cargo feature `nccl`): c10d::ProcessGroupNCCL behind braid_group_nccl.
// The collectives themselves are c10d_shim.cpp's, through the c10d::Backend interface.
//
// Built against the wheel's c10d headers and the nccl.h of the wheel's nvidia-nccl package,
// whose version decides parts of ProcessGroupNCCL::Options (NCCL_HAS_CONFIG, ...): the static
// assertions compare the sizes allocated here with those libtorch_cuda.so allocates.

#include "c10d_internal.hpp"

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/headeronly/version.h>

#include <c10/cuda/CUDAFunctions.h>

#if TORCH_VERSION_MAJOR != 2 || TORCH_VERSION_MINOR != 11
#error "the NCCL shim was verified against torch 2.11: re-run scripts/check-c10d-abi and update the sizes below"
#endif

// From libtorch_cuda.so (torch 2.11.0, x86_64, NCCL 2.28 headers): ProcessGroupNCCL::merge
// allocates the group with `operator new(0x458)`, ProcessGroupNCCL::shrink its Options with
// `operator new(0xf8)`.
static_assert(sizeof(c10d::ProcessGroupNCCL) == 0x458, "ProcessGroupNCCL layout differs from libtorch_cuda.so");
static_assert(sizeof(c10d::ProcessGroupNCCL::Options) == 0xf8, "ProcessGroupNCCL::Options layout differs from libtorch_cuda.so (nccl.h version?)");

extern "C" char* braid_group_nccl(const BraidStore* store, int rank, int size, int device,
                                  int64_t timeout_ms, BraidGroup** out) {
  return braid_c10d::guarded([&] {
    TORCH_CHECK(device >= 0, "CUDA device index must be non-negative, got ", device);
    // The calling thread's current device is the one NCCL works on, as after
    // torch.cuda.set_device in a Python program. Binding the group to it and connecting eagerly
    // is what init_process_group(device_id=...) does: a missing peer then fails here rather
    // than at the first collective.
    at::Device cuda(at::kCUDA, static_cast<c10::DeviceIndex>(device));
    c10::cuda::set_device(cuda.index());
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = braid_c10d::millis(timeout_ms);
    auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store->store, rank, size, options);
    backend->setBoundDeviceId(cuda);
    backend->eagerConnectSingleDevice(cuda);
    *out = new BraidGroup{std::move(backend), rank, size, /*native_average=*/true};
  });
}
