#pragma once

// Mixed precision on CPU: a scope in which LibTorch's CPU autocast runs the operators it lists
// (matmul, linear, convolution, ...) in bfloat16, as torch.autocast("cpu", torch.bfloat16).
// Parameters stay float32 (autocast casts a bfloat16 copy of each weight once per scope), so
// gradients and optimizer state are float32 too.
//
//   { launch::trainer::AutocastScope amp(/*bf16=*/true); loss = loss_fn(model(x), y); }
//   loss.backward();   // outside the scope, as with torch.autocast
//
// Thread-safety: autocast state is per thread; a scope affects only the thread that opened it
// (open one on each thread that runs a forward pass). Scopes nest and must end in reverse order
// of construction on the thread that made them.

#include <ATen/autocast_mode.h>

#include "trainer_runtime/compat/torch_compat.h"

namespace launch::trainer {

class AutocastScope {
 public:
  // `bf16` false: a scope that does nothing (so callers need no branch).
  explicit AutocastScope(bool bf16) : active_(bf16) {
    if (!active_) return;
    previous_enabled_ = compat::CpuAutocastEnabled();
    previous_dtype_ = compat::CpuAutocastDtype();
    compat::SetCpuAutocast(true, at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~AutocastScope() {
    if (!active_) return;
    // The cache holds bfloat16 copies of the weights; they are stale once the optimizer steps,
    // so the outermost scope drops them (torch.autocast's __exit__ does the same).
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    compat::SetCpuAutocast(previous_enabled_, previous_dtype_);
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool active_;
  bool previous_enabled_ = false;
  at::ScalarType previous_dtype_ = at::kBFloat16;
};

}  // namespace launch::trainer
