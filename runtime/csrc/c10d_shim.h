// The C ABI between braid-runtime (`runtime/src/dist/ffi.rs`) and PyTorch's c10d.
//
// This header is the one FFI boundary of `braid_runtime::dist`; `ffi.rs` declares the same
// functions by hand and must change with it. Rules every function follows:
//
// - No C++ exception crosses it. A function that can fail returns `NULL` on success or a
//   message allocated with `malloc` (free it with `braid_c10d_free`); output parameters are
//   written only on success.
// - Handles (`BraidStore*`, `BraidGroup*`) are owned by the caller and freed exactly once with
//   their `_free` function. A store handle may be used from several threads at once (c10d's
//   stores lock internally); a group handle must be used by one thread at a time, because c10d
//   matches collectives across processes by the order in which they are issued.
// - A `void* tensor` is a `torch::Tensor*` (tch's `C_tensor`, see torch-sys's
//   `libtch/torch_api.h`), borrowed for the duration of the call; the collective writes into the
//   tensor's storage in place, no copy is made on the way in.
// - Strings and keys are (pointer, length) pairs of UTF-8 bytes, not NUL-terminated.
// - Timeouts are milliseconds, greater than zero.

#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct BraidStore BraidStore;
typedef struct BraidGroup BraidGroup;

// Reduction operators, the values of `braid_runtime::dist::ReduceOp`.
enum {
  BRAID_REDUCE_SUM = 0,
  BRAID_REDUCE_AVG = 1,
  BRAID_REDUCE_MAX = 2,
  BRAID_REDUCE_MIN = 3,
};

void braid_c10d_free(void* ptr);

// A c10d::TCPStore. The server (`is_server != 0`) listens on `port` and waits up to `timeout_ms`
// for `world_size - 1` clients; a client retries connecting for up to `timeout_ms`.
char* braid_store_tcp(const char* host, size_t host_len, uint16_t port, int is_server,
                      uint32_t world_size, int64_t timeout_ms, BraidStore** out);
// A c10d::PrefixStore over `base` (which stays usable and must be freed separately).
char* braid_store_prefix(const BraidStore* base, const char* prefix, size_t prefix_len,
                         BraidStore** out);
// A new connection to the same store (c10d's `clone`), for use from another thread.
char* braid_store_clone(const BraidStore* store, BraidStore** out);
void braid_store_free(BraidStore* store);

char* braid_store_set(const BraidStore* store, const char* key, size_t key_len,
                      const uint8_t* value, size_t value_len);
// Waits up to `timeout_ms` for `key`, then reads it into a `malloc`ed buffer (`*value` is NULL
// when the value is empty).
char* braid_store_get(const BraidStore* store, const char* key, size_t key_len,
                      int64_t timeout_ms, uint8_t** value, size_t* value_len);
// Atomically adds `delta` to the integer at `key` (0 when absent) and returns the new value.
char* braid_store_add(const BraidStore* store, const char* key, size_t key_len, int64_t delta,
                      int64_t* out);
// Waits up to `timeout_ms` until every key exists.
char* braid_store_wait(const BraidStore* store, const char* const* keys, const size_t* key_lens,
                       size_t n, int64_t timeout_ms);

// A c10d::ProcessGroupGloo of `size` ranks rendezvousing through `store`; `timeout_ms` bounds
// the rendezvous and every operation of the group. Gloo's device is c10d's default: the
// interfaces named by GLOO_SOCKET_IFNAME, else the address this host's name resolves to.
char* braid_group_gloo(const BraidStore* store, int rank, int size, int64_t timeout_ms,
                       BraidGroup** out);
// A c10d::ProcessGroupNCCL on CUDA device `device`; returns an error when the shim was built
// without the `nccl` feature.
char* braid_group_nccl(const BraidStore* store, int rank, int size, int device,
                       int64_t timeout_ms, BraidGroup** out);
void braid_group_free(BraidGroup* group);

// Every collective below waits up to `timeout_ms` for its completion.
// One tensor: c10d `allreduce`; several: `allreduce_coalesced` (one reduction over all of
// them, each keeping its own shape).
char* braid_group_all_reduce(BraidGroup* group, void* const* tensors, size_t n, int op,
                             int64_t timeout_ms);
char* braid_group_broadcast(BraidGroup* group, void* tensor, int root, int64_t timeout_ms);
// `output` holds `size` blocks the shape of `input`, concatenated along dimension 0.
char* braid_group_all_gather(BraidGroup* group, void* output, void* input, int64_t timeout_ms);
// `input` holds `size` blocks the shape of `output`; block `rank` of the reduction lands in
// `output`.
char* braid_group_reduce_scatter(BraidGroup* group, void* output, void* input, int op,
                                 int64_t timeout_ms);
char* braid_group_send(BraidGroup* group, void* tensor, int dst, int tag, int64_t timeout_ms);
char* braid_group_recv(BraidGroup* group, void* tensor, int src, int tag, int64_t timeout_ms);
char* braid_group_barrier(BraidGroup* group, int64_t timeout_ms);

// Tensor parallelism (tp_autograd.cpp): a handle on a group's backend for the collectives of a
// tensor-parallel forward, which keeps the backend alive as long as any autograd graph needs it.
// `*out` of the three operations is a new `torch::Tensor*` the caller owns (tch's
// `Tensor::from_ptr`). Every operation waits up to `timeout_ms` (given at creation).
typedef struct BraidTp BraidTp;
char* braid_tp_new(const BraidGroup* group, int64_t timeout_ms, BraidTp** out);
void braid_tp_free(BraidTp* tp);
// Identity forward; backward sums the gradient over the group (Megatron's `f`).
char* braid_tp_copy(const BraidTp* tp, void* input, void** out);
// `op` (BRAID_REDUCE_SUM or _MAX) over the group forward; backward, for a sum, passes the
// gradient through (Megatron's `g`); a maximum refuses an input that records gradients.
char* braid_tp_reduce(const BraidTp* tp, void* input, int op, void** out);
// Every rank's `input` concatenated along dimension 0, in rank order; no gradient.
char* braid_tp_all_gather(const BraidTp* tp, void* input, void** out);

#ifdef __cplusplus
}
#endif
