#pragma once

// Stand-in for the LibTorch header that Debian's libtorch-dev does not ship.
// c10d/reducer.hpp includes it only to hold a std::shared_ptr<DistAutogradContext> member
// and to static_assert the GradCallback type, so a declaration with the same GradCallback
// keeps the Reducer's layout identical to the compiled library. Never define or use the
// class here: distributed autograd (RPC) is not part of this project.

#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>

namespace torch {
namespace distributed {
namespace autograd {

class DistAutogradContext {
 public:
  using GradCallback = std::function<bool(at::Tensor&)>;
};
using ContextPtr = std::shared_ptr<DistAutogradContext>;

}  // namespace autograd
}  // namespace distributed
}  // namespace torch
