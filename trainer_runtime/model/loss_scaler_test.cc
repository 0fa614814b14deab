// LossScaler (loss_scaler.h) against GradScaler's rules, and where LibTorch has it for CPU
// tensors (2.x) against the op GradScaler.update() runs (at::_amp_update_scale_) over a long
// sequence of overflows and clean steps.

#include "trainer_runtime/model/loss_scaler.h"

#include <cmath>
#include <vector>

#include <torch/torch.h>

#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/util/doctest_torch.h"  // last: after every torch header

namespace launch::trainer {
namespace {

LossScaler Make(LossScalerOptions o) {
  auto s = LossScaler::Create(o);
  REQUIRE(s.ok());
  return *s;
}

TEST_CASE("LossScalerBacksOffOnOverflowAndGrowsAfterTheInterval") {
  LossScalerOptions o;
  o.growth_interval = 3;
  LossScaler s = Make(o);
  CHECK(s.scale() == 65536.0f);
  CHECK(s.inverse_scale() == 1.0f / 65536.0f);
  s.Update(true);  // overflow: halve, count a skipped step
  CHECK(s.scale() == 32768.0f);
  CHECK(s.skipped() == 1);
  s.Update(false);
  s.Update(false);
  CHECK(s.scale() == 32768.0f);
  CHECK(s.growth_tracker() == 2);
  s.Update(false);  // the third clean step in a row: double
  CHECK(s.scale() == 65536.0f);
  CHECK(s.growth_tracker() == 0);
  s.Update(false);
  s.Update(true);  // an overflow resets the run of clean steps
  CHECK(s.growth_tracker() == 0);
  CHECK(s.scale() == 32768.0f);
  CHECK(s.skipped() == 2);
}

TEST_CASE("LossScalerNeverGrowsToInfinity") {
  LossScalerOptions o;
  o.init_scale = 3e38;
  o.growth_interval = 1;
  LossScaler s = Make(o);
  s.Update(false);
  CHECK(std::isfinite(s.scale()));
  CHECK(s.scale() == static_cast<float>(3e38));
}

TEST_CASE("LossScalerRefusesOptionsThatCannotWorkNamingTheKey") {
  auto message = [](LossScalerOptions o) { return LossScaler::Create(o).status().message(); };
  LossScalerOptions o;
  o.init_scale = 0;
  CHECK(message(o).find("train.grad_scaler.init_scale") == 0);
  o = {};
  o.init_scale = 1e39;  // inf as a float32
  CHECK(message(o).find("train.grad_scaler.init_scale") == 0);
  o = {};
  o.growth_factor = 1;
  CHECK(message(o).find("train.grad_scaler.growth_factor") == 0);
  o = {};
  o.backoff_factor = 1;
  CHECK(message(o).find("train.grad_scaler.backoff_factor") == 0);
  o = {};
  o.growth_interval = 0;
  CHECK(message(o).find("train.grad_scaler.growth_interval") == 0);
}

TEST_CASE("LossScalerRestoresWhatACheckpointCarries") {
  LossScaler s = Make({});
  s.Restore(1024.0f, 7, 3);
  CHECK(s.scale() == 1024.0f);
  CHECK(s.growth_tracker() == 7);
  CHECK(s.skipped() == 3);
  s.Restore(0.0f, 0, 0);  // a checkpoint from before fp16: the scale stays
  CHECK(s.scale() == 1024.0f);
}

TEST_CASE("LossScalerFollowsGradScalersUpdateOp") {
  // LibTorch 2.x has the op for CPU tensors; 1.13 for CUDA ones only.
  if (!compat::HasKernel("aten::_amp_update_scale_", c10::DeviceType::CPU)) return;
  // Odd factors, so that rounding to float32 shows; a fixed mixture of overflows and runs.
  LossScalerOptions o;
  o.init_scale = 1000.0;
  o.growth_factor = 1.7;
  o.backoff_factor = 0.3;
  o.growth_interval = 2;
  LossScaler ours = Make(o);
  torch::Tensor scale = torch::tensor({1000.0f});
  torch::Tensor tracker = torch::zeros({1}, torch::kInt);
  const std::vector<bool> overflows = {false, false, false, true,  false, true, true,
                                       false, false, false, false, false, true, false};
  for (bool inf : overflows) {
    ours.Update(inf);
    torch::Tensor found = torch::tensor({inf ? 1.0f : 0.0f});
    at::_amp_update_scale_(scale, tracker, found, o.growth_factor, o.backoff_factor,
                           o.growth_interval);
    CHECK(ours.scale() == scale.item<float>());
    CHECK(ours.growth_tracker() == tracker.item<int>());
  }
}

}  // namespace
}  // namespace launch::trainer
