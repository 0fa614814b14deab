#pragma once

// Pipeline stages for Accelerator::PreparePipeline (accelerator.h): cut a model into the
// consecutive stages of a pipeline, one per process.
//
//   torch::nn::Sequential net(torch::nn::Linear(784, 256), torch::nn::ReLU(), ...);
//   auto stage = launch::trainer::SequentialStage(net, {3, 2}, accel->stage_index());
//   auto optimizer = std::make_shared<torch::optim::Adam>(stage.ptr()->parameters(), ...);
//   accel->PreparePipeline(stage, optimizer);
//
// Build the whole model from the same seed on every rank (so each stage starts from the
// weights a single process would have), then keep the stage: the other layers are released
// when `whole` goes out of scope.

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "base/status.h"

namespace launch::trainer {

// A Sequential of `whole`'s modules for stage `stage` when stage s gets layers_per_stage[s]
// consecutive modules (the modules are shared, not copied). InvalidArgument when the
// partition does not cover `whole` exactly, has an empty stage, or `stage` is out of range.
StatusOr<torch::nn::AnyModule> SequentialStage(const torch::nn::Sequential& whole,
                                               const std::vector<int64_t>& layers_per_stage,
                                               int stage);

}  // namespace launch::trainer
