// Unit tests for lr_schedule.h (plain C++: this binary links no LibTorch).

#include "trainer_runtime/util/lr_schedule.h"

#include <doctest/doctest.h>

namespace launch::trainer {
namespace {

TEST_CASE("LearningRateWarmupThenCosineReachesFloor") {
  config::SchedulerConfig s;
  s.type = config::SchedulerType::kCosine;
  s.warmup_steps = 10;
  s.min_lr_ratio = 0.1;
  CHECK(LearningRate(s, 1.0, 0, 110) == doctest::Approx(0.1));
  CHECK(LearningRate(s, 1.0, 9, 110) == doctest::Approx(1.0));
  CHECK(LearningRate(s, 1.0, 10, 110) == doctest::Approx(1.0));
  CHECK(LearningRate(s, 1.0, 60, 110) == doctest::Approx(0.55));
  CHECK(LearningRate(s, 1.0, 110, 110) == doctest::Approx(0.1));
}

TEST_CASE("LearningRateLinearAndConstant") {
  config::SchedulerConfig s;
  CHECK(LearningRate(s, 0.5, 1000, 10) == 0.5);
  s.type = config::SchedulerType::kLinear;
  CHECK(LearningRate(s, 1.0, 0, 100) == doctest::Approx(1.0));
  CHECK(LearningRate(s, 1.0, 50, 100) == doctest::Approx(0.5));
}

TEST_CASE("LearningRateAtWholePositionsEqualsLearningRate") {
  config::SchedulerConfig s;
  s.type = config::SchedulerType::kCosine;
  s.warmup_steps = 5;
  s.min_lr_ratio = 0.1;
  for (int64_t step : {0, 3, 5, 17, 60, 99, 100, 120})
    CHECK(LearningRateAt(s, 0.3, static_cast<double>(step), 100) ==
          LearningRate(s, 0.3, step, 100));
  // Between whole positions it lies between their values (decaying part).
  const double mid = LearningRateAt(s, 0.3, 40.5, 100);
  CHECK(mid < LearningRate(s, 0.3, 40, 100));
  CHECK(mid > LearningRate(s, 0.3, 41, 100));
}

}  // namespace
}  // namespace launch::trainer
