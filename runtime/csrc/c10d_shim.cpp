// c10d's stores and process groups behind the C ABI of c10d_shim.h: the TCP store, prefix
// stores, the Gloo backend, and the collectives every backend shares.
//
// Why this is ABI-sound against the torch wheel (docs/distributed.md has the evidence):
// - Every c10d header comes from the wheel itself, compiled with the wheel's C++ standard and
//   C++11-ABI setting (build.rs), so c10d's own types have the wheel's layout; the static
//   assertions below compare the sizes this file allocates with those the wheel's code
//   allocates (read from `operator new` calls in libtorch_cpu.so).
// - ProcessGroupGloo.hpp includes gloo's headers, which the wheel does not ship; Debian's
//   libgloo-dev provides them and is older than the gloo inside libtorch. That is sound only
//   because this file uses no gloo code and no gloo layout: ProcessGroupGloo refers to gloo
//   types only through std::shared_ptr / std::unique_ptr / std::vector of pointers, whose
//   layout does not depend on the pointee, and the backend is created and destroyed by
//   libtorch's out-of-line constructor, `Options::create_default` and virtual destructor. The
//   compiled object contains no symbol in namespace `gloo` (checked by
//   scripts/check-c10d-abi). Nothing here may call an inline function that touches a gloo
//   type (for example `ProcessGroupGloo::setTimeout`).

#include "c10d_internal.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/headeronly/version.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#if TORCH_VERSION_MAJOR != 2 || TORCH_VERSION_MINOR != 11
#error "the c10d shim was verified against torch 2.11: re-run scripts/check-c10d-abi and update the sizes below"
#endif

// Sizes of the objects this file allocates with c10::make_intrusive, as the wheel's own code
// allocates them (torch 2.11.0, x86_64): ProcessGroupGloo in ProcessGroupGloo::merge (0x1e8),
// ProcessGroupGloo::Options in Options::create_default (0xb0), TCPStore in TCPStore::clone
// (0xd8), PrefixStore in PrefixStore::clone (0x40). A mismatch means these headers do not
// describe the library being linked.
static_assert(sizeof(c10d::ProcessGroupGloo) == 0x1e8, "ProcessGroupGloo layout differs from libtorch_cpu.so");
static_assert(sizeof(c10d::ProcessGroupGloo::Options) == 0xb0, "ProcessGroupGloo::Options layout differs from libtorch_cpu.so");
static_assert(sizeof(c10d::TCPStore) == 0xd8, "TCPStore layout differs from libtorch_cpu.so");
static_assert(sizeof(c10d::PrefixStore) == 0x40, "PrefixStore layout differs from libtorch_cpu.so");

namespace {

// Returned when even the error message cannot be allocated; braid_c10d_free leaves it alone.
char kOutOfMemory[] = "out of memory while reporting a c10d error";

std::string to_string(const char* data, size_t len) {
  return len == 0 ? std::string() : std::string(data, len);
}

at::Tensor& tensor(void* ptr) {
  TORCH_CHECK(ptr != nullptr, "null tensor handle");
  return *static_cast<at::Tensor*>(ptr);
}

c10d::ReduceOp reduce_op(int op, const BraidGroup& group) {
  switch (op) {
    case BRAID_REDUCE_SUM:
      return c10d::ReduceOp::SUM;
    case BRAID_REDUCE_AVG:
      return group.native_average ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
    case BRAID_REDUCE_MAX:
      return c10d::ReduceOp::MAX;
    case BRAID_REDUCE_MIN:
      return c10d::ReduceOp::MIN;
  }
  throw std::invalid_argument("unknown reduction operator " + std::to_string(op));
}

// An average the backend cannot do is a sum divided by the group size afterwards. Integer
// tensors are refused before anything is sent: every rank of an SPMD program makes the same
// call, so all of them refuse it and none is left waiting.
bool divide_after(int op, const BraidGroup& group, const std::vector<at::Tensor>& tensors) {
  if (op != BRAID_REDUCE_AVG || group.native_average) {
    return false;
  }
  for (const auto& t : tensors) {
    TORCH_CHECK(at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()),
                "an average needs floating-point tensors, got ", t.scalar_type());
  }
  return true;
}

void wait(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout) {
  // Work::wait throws the backend's error, or c10's "Operation timed out!" after `timeout`.
  work->wait(timeout);
}

}  // namespace

namespace braid_c10d {

char* error_string(const std::string& message) noexcept {
  char* copy = static_cast<char*>(std::malloc(message.size() + 1));
  if (copy == nullptr) {
    return kOutOfMemory;
  }
  std::memcpy(copy, message.data(), message.size());
  copy[message.size()] = '\0';
  return copy;
}

}  // namespace braid_c10d

using braid_c10d::guarded;
using braid_c10d::millis;

extern "C" {

void braid_c10d_free(void* ptr) {
  if (ptr != kOutOfMemory) {
    std::free(ptr);
  }
}

char* braid_store_tcp(const char* host, size_t host_len, uint16_t port, int is_server,
                      uint32_t world_size, int64_t timeout_ms, BraidStore** out) {
  return guarded([&] {
    c10d::TCPStoreOptions options;
    options.port = port;
    options.isServer = is_server != 0;
    options.numWorkers = world_size;
    options.waitWorkers = true;
    options.timeout = millis(timeout_ms);
    auto store = c10::make_intrusive<c10d::TCPStore>(to_string(host, host_len), options);
    *out = new BraidStore{std::move(store)};
  });
}

char* braid_store_prefix(const BraidStore* base, const char* prefix, size_t prefix_len,
                         BraidStore** out) {
  return guarded([&] {
    auto store = c10::make_intrusive<c10d::PrefixStore>(to_string(prefix, prefix_len), base->store);
    *out = new BraidStore{std::move(store)};
  });
}

char* braid_store_clone(const BraidStore* store, BraidStore** out) {
  return guarded([&] { *out = new BraidStore{store->store->clone()}; });
}

void braid_store_free(BraidStore* store) {
  delete store;
}

char* braid_store_set(const BraidStore* store, const char* key, size_t key_len,
                      const uint8_t* value, size_t value_len) {
  return guarded([&] {
    std::vector<uint8_t> bytes(value, value + value_len);
    store->store->set(to_string(key, key_len), bytes);
  });
}

char* braid_store_get(const BraidStore* store, const char* key, size_t key_len,
                      int64_t timeout_ms, uint8_t** value, size_t* value_len) {
  return guarded([&] {
    std::string k = to_string(key, key_len);
    // Store::get waits with the store's own timeout; waiting first bounds it by the caller's.
    store->store->wait({k}, millis(timeout_ms));
    std::vector<uint8_t> bytes = store->store->get(k);
    uint8_t* copy = nullptr;
    if (!bytes.empty()) {
      copy = static_cast<uint8_t*>(std::malloc(bytes.size()));
      if (copy == nullptr) {
        throw std::bad_alloc();
      }
      std::memcpy(copy, bytes.data(), bytes.size());
    }
    *value = copy;
    *value_len = bytes.size();
  });
}

char* braid_store_add(const BraidStore* store, const char* key, size_t key_len, int64_t delta,
                      int64_t* out) {
  return guarded([&] { *out = store->store->add(to_string(key, key_len), delta); });
}

char* braid_store_wait(const BraidStore* store, const char* const* keys, const size_t* key_lens,
                       size_t n, int64_t timeout_ms) {
  return guarded([&] {
    std::vector<std::string> names;
    names.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      names.push_back(to_string(keys[i], key_lens[i]));
    }
    store->store->wait(names, millis(timeout_ms));
  });
}

char* braid_group_gloo(const BraidStore* store, int rank, int size, int64_t timeout_ms,
                       BraidGroup** out) {
  return guarded([&] {
    auto options = c10d::ProcessGroupGloo::Options::create_default(millis(timeout_ms));
    auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store->store, rank, size, options);
    *out = new BraidGroup{std::move(backend), rank, size, /*native_average=*/false};
  });
}

void braid_group_free(BraidGroup* group) {
  delete group;
}

char* braid_group_all_reduce(BraidGroup* group, void* const* tensors, size_t n, int op,
                             int64_t timeout_ms) {
  return guarded([&] {
    TORCH_CHECK(n > 0, "all_reduce needs at least one tensor");
    std::vector<at::Tensor> ts;
    ts.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      ts.push_back(tensor(tensors[i]));
    }
    bool divide = divide_after(op, *group, ts);
    auto timeout = millis(timeout_ms);
    c10::intrusive_ptr<c10d::Work> work;
    if (n == 1) {
      c10d::AllreduceOptions options;
      options.reduceOp = reduce_op(op, *group);
      options.timeout = timeout;
      work = group->backend->allreduce(ts, options);
    } else {
      c10d::AllreduceCoalescedOptions options;
      options.reduceOp = reduce_op(op, *group);
      options.timeout = timeout;
      work = group->backend->allreduce_coalesced(ts, options);
    }
    wait(work, timeout);
    if (divide) {
      for (auto& t : ts) {
        t.div_(group->size);
      }
    }
  });
}

char* braid_group_broadcast(BraidGroup* group, void* t, int root, int64_t timeout_ms) {
  return guarded([&] {
    std::vector<at::Tensor> ts{tensor(t)};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    options.timeout = millis(timeout_ms);
    wait(group->backend->broadcast(ts, options), options.timeout);
  });
}

char* braid_group_all_gather(BraidGroup* group, void* output, void* input, int64_t timeout_ms) {
  return guarded([&] {
    c10d::AllgatherOptions options;
    options.timeout = millis(timeout_ms);
    wait(group->backend->_allgather_base(tensor(output), tensor(input), options), options.timeout);
  });
}

char* braid_group_reduce_scatter(BraidGroup* group, void* output, void* input, int op,
                                 int64_t timeout_ms) {
  return guarded([&] {
    at::Tensor& out = tensor(output);
    bool divide = divide_after(op, *group, {out});
    c10d::ReduceScatterOptions options;
    options.reduceOp = reduce_op(op, *group);
    options.timeout = millis(timeout_ms);
    wait(group->backend->_reduce_scatter_base(out, tensor(input), options), options.timeout);
    if (divide) {
      out.div_(group->size);
    }
  });
}

char* braid_group_send(BraidGroup* group, void* t, int dst, int tag, int64_t timeout_ms) {
  return guarded([&] {
    std::vector<at::Tensor> ts{tensor(t)};
    wait(group->backend->send(ts, dst, tag), millis(timeout_ms));
  });
}

char* braid_group_recv(BraidGroup* group, void* t, int src, int tag, int64_t timeout_ms) {
  return guarded([&] {
    std::vector<at::Tensor> ts{tensor(t)};
    wait(group->backend->recv(ts, src, tag), millis(timeout_ms));
  });
}

char* braid_group_barrier(BraidGroup* group, int64_t timeout_ms) {
  return guarded([&] {
    c10d::BarrierOptions options;
    options.timeout = millis(timeout_ms);
    wait(group->backend->barrier(options), options.timeout);
  });
}

}  // extern "C"
