// Tensor parallelism's two differentiable collectives (Megatron-LM's `f` and `g`) and the
// plain collectives a tensor-parallel forward needs, on a c10d backend (c10d_shim.h says the
// ABI rules; this file includes no gloo header and uses only c10d's device-generic Backend).
//
// - `braid_tp_copy` (f): the identity forward; backward sums the gradient over the group. It
//   sits where a replicated activation enters column-parallel products, whose gradients with
//   respect to that activation are partial on each rank.
// - `braid_tp_reduce` (g): sums over the group forward; backward passes the gradient through.
//   It sits after row-parallel products, whose outputs are partial sums.
//
// The autograd nodes keep their own reference to the backend (`TpState`), so a graph that
// outlives the Rust handle still reduces on a live backend. The backward of a CPU graph runs
// on the thread that called `backward`; on CUDA on the engine's device thread while the caller
// waits: either way one thread issues the group's collectives at a time, in the order every
// rank's identical graph gives them (the engine orders ready nodes by sequence number).

#include "c10d_internal.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <memory>
#include <string>
#include <vector>

struct TpState {
  c10::intrusive_ptr<c10d::Backend> backend;
  std::chrono::milliseconds timeout;
  int size;
};

struct BraidTp {
  std::shared_ptr<TpState> state;
};

namespace {

using torch::autograd::variable_list;

at::Tensor& tensor_of(void* ptr) {
  TORCH_CHECK(ptr != nullptr, "null tensor handle");
  return *static_cast<at::Tensor*>(ptr);
}

void all_reduce(const TpState& s, at::Tensor& t, c10d::ReduceOp op) {
  std::vector<at::Tensor> ts{t};
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  options.timeout = s.timeout;
  s.backend->allreduce(ts, options)->wait(s.timeout);
}

// A contiguous copy of `t` without autograd history, for a collective to write into.
at::Tensor fresh_copy(const at::Tensor& t) {
  at::NoGradGuard no_grad;
  return t.clone(at::MemoryFormat::Contiguous);
}

// Backward of `f`: the sum of every rank's gradient.
struct TpCopyBackward : public torch::autograd::Node {
  std::shared_ptr<TpState> state;
  explicit TpCopyBackward(std::shared_ptr<TpState> s) : state(std::move(s)) {}
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) {
      return {at::Tensor()};
    }
    at::Tensor g = fresh_copy(grads[0]);
    all_reduce(*state, g, c10d::ReduceOp::SUM);
    return {g};
  }
  std::string name() const override {
    return "braid::TpCopyBackward";
  }
};

// Backward of `g`: the gradient unchanged.
struct TpReduceBackward : public torch::autograd::Node {
  variable_list apply(variable_list&& grads) override {
    return {grads[0]};
  }
  std::string name() const override {
    return "braid::TpReduceBackward";
  }
};

template <class NodeT>
void attach(at::Tensor& out, const at::Tensor& input, std::shared_ptr<NodeT> node) {
  node->set_next_edges(torch::autograd::collect_next_edges(input));
  torch::autograd::set_history(out, node);
}

bool records(const at::Tensor& t) {
  return at::GradMode::is_enabled() && t.requires_grad();
}

}  // namespace

using braid_c10d::guarded;
using braid_c10d::millis;

extern "C" {

char* braid_tp_new(const BraidGroup* group, int64_t timeout_ms, BraidTp** out) {
  return guarded([&] {
    TORCH_CHECK(group != nullptr, "null group handle");
    auto state = std::make_shared<TpState>(TpState{group->backend, millis(timeout_ms), group->size});
    *out = new BraidTp{std::move(state)};
  });
}

void braid_tp_free(BraidTp* tp) {
  delete tp;
}

char* braid_tp_copy(const BraidTp* tp, void* input, void** out) {
  return guarded([&] {
    const at::Tensor& x = tensor_of(input);
    if (!records(x)) {
      *out = new at::Tensor(x);
      return;
    }
    at::Tensor y = fresh_copy(x);
    attach(y, x,
           std::shared_ptr<TpCopyBackward>(new TpCopyBackward(tp->state),
                                           torch::autograd::deleteNode));
    *out = new at::Tensor(std::move(y));
  });
}

char* braid_tp_reduce(const BraidTp* tp, void* input, int op, void** out) {
  return guarded([&] {
    const at::Tensor& x = tensor_of(input);
    at::Tensor y = fresh_copy(x);
    c10d::ReduceOp reduce;
    switch (op) {
      case BRAID_REDUCE_SUM:
        reduce = c10d::ReduceOp::SUM;
        break;
      case BRAID_REDUCE_MAX:
        reduce = c10d::ReduceOp::MAX;
        break;
      default:
        throw std::invalid_argument("tensor-parallel reduce: sum or max, got " +
                                    std::to_string(op));
    }
    TORCH_CHECK(op == BRAID_REDUCE_SUM || !records(x),
                "a maximum over the group has no gradient; detach its input");
    all_reduce(*tp->state, y, reduce);
    if (records(x)) {
      attach(y, x,
             std::shared_ptr<TpReduceBackward>(new TpReduceBackward(),
                                               torch::autograd::deleteNode));
    }
    *out = new at::Tensor(std::move(y));
  });
}

char* braid_tp_all_gather(const BraidTp* tp, void* input, void** out) {
  return guarded([&] {
    const at::Tensor& x = tensor_of(input);
    TORCH_CHECK(!records(x), "the tensor-parallel gather has no gradient; detach its input");
    at::Tensor in = x.contiguous();
    std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
    TORCH_CHECK(!shape.empty(), "the tensor-parallel gather needs at least one dimension");
    shape[0] *= tp->state->size;
    at::Tensor gathered = at::empty(shape, in.options());
    c10d::AllgatherOptions options;
    options.timeout = tp->state->timeout;
    tp->state->backend->_allgather_base(gathered, in, options)->wait(tp->state->timeout);
    *out = new at::Tensor(std::move(gathered));
  });
}

}  // extern "C"
