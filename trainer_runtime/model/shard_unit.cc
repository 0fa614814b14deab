#include "trainer_runtime/model/shard_unit.h"

#include <atomic>

namespace launch::trainer {
namespace {

std::atomic<UnitGatherer*> current_gatherer{nullptr};

}  // namespace

void SetUnitGatherer(UnitGatherer* gatherer) { current_gatherer.store(gatherer); }

torch::Tensor ShardedForward(torch::nn::Module& unit,
                             const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                             const torch::Tensor& input) {
  UnitGatherer* gatherer = current_gatherer.load();
  if (gatherer == nullptr || !gatherer->IsUnit(unit)) return fn(input);
  gatherer->BeforeUnitForward(unit);
  torch::Tensor output = fn(input);
  gatherer->AfterUnitForward(unit, output);
  return output;
}

}  // namespace launch::trainer
