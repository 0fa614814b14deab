#pragma once

// Mixed precision: a scope in which LibTorch's autocast for one device type runs the operators
// it lists (matmul, linear, convolution, ...) in a lower precision, as
// torch.autocast(device_type, dtype): bfloat16 on the CPU; bfloat16 or float16 on CUDA.
// Parameters stay float32 (autocast casts a low-precision copy of each weight once per scope),
// so gradients and optimizer state are float32 too.
//
//   { launch::trainer::AutocastScope amp(c10::DeviceType::CUDA, at::kBFloat16);
//     loss = loss_fn(model(x), y); }
//   loss.backward();   // outside the scope, as with torch.autocast
//
// The platform decides which (compat/platform.h Autocast; Accelerator::Autocast()).
//
// Thread-safety: autocast state is per thread; a scope affects only the thread that opened it
// (open one on each thread that runs a forward pass). Scopes nest and must end in reverse order
// of construction on the thread that made them.

#include <ATen/autocast_mode.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include "trainer_runtime/compat/torch_compat.h"

namespace launch::trainer {

class AutocastScope {
 public:
  // `dtype` Undefined: a scope that does nothing (so callers need no branch).
  AutocastScope(c10::DeviceType device, c10::ScalarType dtype)
      : active_(dtype != c10::ScalarType::Undefined), device_(device) {
    if (!active_) return;
    previous_enabled_ = compat::AutocastEnabled(device_);
    previous_dtype_ = compat::AutocastDtype(device_);
    compat::SetAutocast(device_, true, dtype);
    at::autocast::increment_nesting();
  }
  // CPU bfloat16 when `bf16`, else nothing: the CPU trainer's scope.
  explicit AutocastScope(bool bf16)
      : AutocastScope(c10::DeviceType::CPU,
                      bf16 ? c10::ScalarType::BFloat16 : c10::ScalarType::Undefined) {}
  ~AutocastScope() {
    if (!active_) return;
    // The cache holds low-precision copies of the weights; they are stale once the optimizer
    // steps, so the outermost scope drops them (torch.autocast's __exit__ does the same).
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    compat::SetAutocast(device_, previous_enabled_, previous_dtype_);
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool active_;
  c10::DeviceType device_;
  bool previous_enabled_ = false;
  at::ScalarType previous_dtype_ = at::kBFloat16;
};

}  // namespace launch::trainer
