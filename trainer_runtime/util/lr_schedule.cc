#include "trainer_runtime/util/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace launch::trainer {

double LearningRate(const config::SchedulerConfig& schedule, double base_lr, int64_t step,
                    int64_t total_steps) {
  const int64_t warmup = schedule.warmup_steps;
  if (step < warmup) return base_lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (schedule.type == config::SchedulerType::kConstant) return base_lr;
  const double floor = base_lr * schedule.min_lr_ratio;
  const int64_t decay_steps = std::max<int64_t>(1, total_steps - warmup);
  const double progress =
      std::clamp(static_cast<double>(step - warmup) / static_cast<double>(decay_steps), 0.0, 1.0);
  if (schedule.type == config::SchedulerType::kLinear)
    return floor + (base_lr - floor) * (1.0 - progress);
  return floor + (base_lr - floor) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

double LearningRateAt(const config::SchedulerConfig& schedule, double base_lr, double position,
                      int64_t total_steps) {
  const double warmup = static_cast<double>(schedule.warmup_steps);
  if (position < warmup) return base_lr * (position + 1) / warmup;
  if (schedule.type == config::SchedulerType::kConstant) return base_lr;
  const double floor = base_lr * schedule.min_lr_ratio;
  const double decay_steps = std::max(1.0, static_cast<double>(total_steps) - warmup);
  const double progress = std::clamp((position - warmup) / decay_steps, 0.0, 1.0);
  if (schedule.type == config::SchedulerType::kLinear)
    return floor + (base_lr - floor) * (1.0 - progress);
  return floor + (base_lr - floor) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

}  // namespace launch::trainer
