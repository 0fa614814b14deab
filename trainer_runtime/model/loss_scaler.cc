#include "trainer_runtime/model/loss_scaler.h"

#include <cmath>

namespace launch::trainer {

StatusOr<LossScaler> LossScaler::Create(const LossScalerOptions& o) {
  auto bad = [](const std::string& key, const std::string& why) {
    return Status::InvalidConfig("train.grad_scaler." + key + ": " + why);
  };
  const float scale = static_cast<float>(o.init_scale);
  if (!(o.init_scale > 0) || !std::isfinite(scale))
    return bad("init_scale", "must be positive and below float32's largest value (3.4e38)");
  if (!(o.growth_factor > 1) || !std::isfinite(o.growth_factor))
    return bad("growth_factor", "must be above 1");
  if (!(o.backoff_factor > 0 && o.backoff_factor < 1))
    return bad("backoff_factor", "must be between 0 and 1");
  if (o.growth_interval < 1) return bad("growth_interval", "must be at least 1");
  return LossScaler(o);
}

float LossScaler::inverse_scale() const {
  // GradScaler's `scale.double().reciprocal().float()`.
  return static_cast<float>(1.0 / static_cast<double>(scale_));
}

void LossScaler::Update(bool found_inf) {
  // at::_amp_update_scale_: the products in double, stored as float32.
  if (found_inf) {
    scale_ = static_cast<float>(static_cast<double>(scale_) * options_.backoff_factor);
    growth_tracker_ = 0;
    ++skipped_;
    return;
  }
  if (++growth_tracker_ < options_.growth_interval) return;
  const float grown = static_cast<float>(static_cast<double>(scale_) * options_.growth_factor);
  if (std::isfinite(grown)) scale_ = grown;
  growth_tracker_ = 0;
}

void LossScaler::Restore(float scale, int64_t growth_tracker, int64_t skipped) {
  if (scale > 0 && std::isfinite(scale)) scale_ = scale;
  growth_tracker_ = growth_tracker;
  skipped_ = skipped;
}

}  // namespace launch::trainer
