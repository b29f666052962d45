// What the shim's translation units share: the handle types and the exception barrier.
// Not part of the FFI boundary (that is c10d_shim.h).

#pragma once

#include "c10d_shim.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <exception>
#include <string>

struct BraidStore {
  c10::intrusive_ptr<c10d::Store> store;
};

struct BraidGroup {
  c10::intrusive_ptr<c10d::Backend> backend;
  int rank;
  int size;
  // Gloo rejects ReduceOp::AVG; the shim sums and divides instead. NCCL averages natively.
  bool native_average;
};

namespace braid_c10d {

// Copies `message` into a `malloc`ed string for the caller to free with `braid_c10d_free`.
char* error_string(const std::string& message) noexcept;

// Runs `body` and turns whatever it throws into an error string: the one place where C++
// exceptions stop, so that none unwinds into Rust. c10 errors lose their C++ backtrace, which
// names frames of libtorch rather than anything the caller can act on.
template <class Body>
char* guarded(Body&& body) noexcept {
  try {
    body();
    return nullptr;
  } catch (const c10::Error& e) {
    return error_string(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return error_string(e.what());
  } catch (...) {
    return error_string("unknown C++ exception");
  }
}

inline std::chrono::milliseconds millis(int64_t ms) {
  TORCH_CHECK(ms > 0, "timeout must be positive, got ", ms, " ms");
  return std::chrono::milliseconds(ms);
}

}  // namespace braid_c10d
