#pragma once

// Dynamic loss scaling for float16 mixed precision, as PyTorch's torch.amp.GradScaler: float16
// holds values up to 65504 and loses everything below ~6e-8, so small gradients underflow to
// zero. The loss is multiplied by a large factor (the scale) before backward, the gradients are
// divided by it before the optimizer sees them, and a step whose gradients came out inf or nan
// (the scale was too large) is skipped and the scale halved; after `growth_interval` steps in a
// row without one, the scale doubles.
//
//   LossScaler scaler(options);
//   (loss * scaler.scale()).backward();
//   grads *= scaler.inverse_scale();          // unscale (ParallelStrategy::ScaleGradients)
//   const bool finite = /* every gradient element finite, agreed by the ranks that share it */;
//   if (finite) optimizer.step();
//   scaler.Update(!finite);
//
// The arithmetic is GradScaler's, in float32 (its scale is a float32 tensor): the inverse is the
// float32 of the double reciprocal, a backoff multiplies by backoff_factor, a growth by
// growth_factor unless the product would be inf. With the defaults every value is a power of two,
// so scaling and unscaling are exact. Who decides "finite" over which ranks is the caller's
// (Accelerator::Step: the strategy's gradient norm, reduced where the gradients are split).
//
// Thread-safety: a plain value; not synchronised.

#include <cstdint>
#include <string>

#include "base/status.h"
#include "config/train_config.h"

namespace launch::trainer {

// init_scale, growth_factor, backoff_factor, growth_interval: the `train.grad_scaler` keys.
using LossScalerOptions = config::GradScalerConfig;

class LossScaler {
 public:
  // InvalidConfig naming the option when init_scale <= 0 or not finite, growth_factor <= 1,
  // backoff_factor outside (0, 1), or growth_interval < 1.
  static StatusOr<LossScaler> Create(const LossScalerOptions& options);

  // The factor the loss is multiplied by, and its float32 reciprocal (what unscaling multiplies
  // the gradients by).
  float scale() const { return scale_; }
  float inverse_scale() const;
  // Steps since the last overflow (resets at each growth too).
  int64_t growth_tracker() const { return growth_tracker_; }
  // Skipped steps so far.
  int64_t skipped() const { return skipped_; }

  // After a step's gradients were checked: `found_inf` backs the scale off and counts a skipped
  // step; otherwise counts towards the next growth.
  void Update(bool found_inf);

  // The state a checkpoint or a peer carries (scale, tracker, skipped steps): Restore takes back
  // what these return. A scale <= 0 (a checkpoint without one) keeps the options' initial scale.
  void Restore(float scale, int64_t growth_tracker, int64_t skipped);

 private:
  explicit LossScaler(const LossScalerOptions& options)
      : options_(options), scale_(static_cast<float>(options.init_scale)) {}

  LossScalerOptions options_;
  float scale_;
  int64_t growth_tracker_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace launch::trainer
