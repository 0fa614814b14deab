#pragma once

// Learning-rate schedules as pure functions of the optimizer step, so a resumed run needs no
// scheduler state beyond the step count (which the checkpoint stores). No LibTorch here.

#include <cstdint>

#include "config/train_config.h"

namespace launch::trainer {

// The learning rate for optimizer step `step` (0-based: the lr used by the step-th update)
// out of `total_steps`:
//   warm-up: lr * (step + 1) / warmup_steps for step < warmup_steps;
//   constant: lr; linear: lr decays linearly to min_lr_ratio * lr at total_steps;
//   cosine: half-cosine from lr to min_lr_ratio * lr over the steps after warm-up.
// REQUIRES: total_steps >= 1, step >= 0.
double LearningRate(const config::SchedulerConfig& schedule, double base_lr, int64_t step,
                    int64_t total_steps);

// The same at a fractional schedule position (a run resumed at another world size stretches
// the rest of its schedule over the steps it has left, trainer.cc); equals LearningRate at
// whole positions. REQUIRES: total_steps >= 1, position >= 0.
double LearningRateAt(const config::SchedulerConfig& schedule, double base_lr, double position,
                      int64_t total_steps);

}  // namespace launch::trainer
