// The C ABI between braid-runtime (`runtime/src/cuda.rs`) and libtorch's CUDA backend:
// streams and the caching allocator's statistics, for what tch does not expose.
//
// Compiled on every machine, with libtorch's headers only: it goes through c10's
// device-generic interfaces (`c10::impl::DeviceGuardImplInterface` for streams,
// `c10::DeviceAllocator` for memory statistics), whose CUDA implementations `libtorch_cuda.so`
// and `libc10_cuda.so` register when they are loaded. No CUDA header is needed, so CI compiles
// this file on machines without CUDA; there every function reports that CUDA is not available.
//
// Rules every function follows (as in `c10d_shim.h`):
// - No C++ exception crosses it. A function that can fail returns `NULL` on success or a
//   message allocated with `malloc` (free it with `braid_cuda_free`); output parameters are
//   written only on success.
// - A stream is passed as its c10 id together with its device index (`c10::Stream::pack3`):
//   plain integers, no handle to free. Streams of the pool live as long as the process.

#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

void braid_cuda_free(void* ptr);

// 1 when libtorch's CUDA backend is registered in this process (libtorch_cuda.so is loaded),
// whether or not a device is present; 0 otherwise.
int braid_cuda_backend_linked(void);

// A stream of c10's pool for CUDA device `device` (not the default stream).
char* braid_cuda_pool_stream(int device, int64_t* stream_id);

// Makes `stream_id` the current stream of this thread on device `device`; writes the stream
// that was current before into `previous`.
char* braid_cuda_exchange_stream(int device, int64_t stream_id, int64_t* previous);

// Waits until every kernel queued on the stream has finished.
char* braid_cuda_synchronize_stream(int device, int64_t stream_id);

// The caching allocator's bytes allocated on `device` now and at the peak since the last
// reset.
char* braid_cuda_memory(int device, int64_t* allocated, int64_t* peak);

// Starts a new peak for `braid_cuda_memory`.
char* braid_cuda_reset_peak(int device);

#ifdef __cplusplus
}
#endif
