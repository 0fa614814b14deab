#pragma once

// Pipeline stages: cut a model into the consecutive stages of a pipeline, one per process.
// SequentialStage is public, for Accelerator::PreparePipeline (accelerator.h); LayerCosts and
// BuildStage are `train`'s stages of its built-in models (model.h).
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
#include "config/train_config.h"
#include "trainer_runtime/model/tensor_parallel.h"

namespace launch::trainer {

// A Sequential of `whole`'s modules for stage `stage` when stage s gets layers_per_stage[s]
// consecutive modules (the modules are shared, not copied). InvalidArgument when the
// partition does not cover `whole` exactly, has an empty stage, or `stage` is out of range.
StatusOr<torch::nn::AnyModule> SequentialStage(const torch::nn::Sequential& whole,
                                               const std::vector<int64_t>& layers_per_stage,
                                               int stage);

// Interleaved schedules (train.parallel.schedule interleaved_1f1b): each rank holds several
// chunks of the model, rank s of P the chunks s, s + P, s + 2P, ... of P x v (cut them with
// SequentialStage or BuildStage, whose `stage` is then the chunk's index) and hands them to
// Accelerator::PreparePipeline as a list. JoinChunks makes them one module for the optimizer and
// the checkpoints: each chunk's submodules, parameters and buffers under their own names (the
// whole model's, so they do not clash); the tensors are shared, not copied. InvalidArgument
// naming a name two chunks both use.
StatusOr<std::shared_ptr<torch::nn::Module>> JoinChunks(
    const std::vector<torch::nn::AnyModule>& chunks);

// Pipeline stages of the built-in models. LayerCosts: parameter count of each partitionable
// layer (the balancing cost for PartitionLayers). BuildStage: stage `stage` of `sizes` layers
// each, built from the whole model made from cfg.seed so its initial weights equal a single
// process's (parameter names equal the whole model's); with a tensor group of more than one
// rank, this rank's shards of it (the transformer; model/tensor_parallel.h). A TorchScript list
// gives stage `stage`'s file as is.
std::vector<int64_t> LayerCosts(const config::ModelConfig& m);
StatusOr<torch::nn::AnyModule> BuildStage(const config::TrainConfig& cfg, int stage,
                                          const std::vector<int64_t>& sizes,
                                          const TensorGroupPtr& tensor = TensorGroupPtr());
// Rank `stage`'s chunks of the built-in model cut into `sizes` (stages x virtual_stages chunks):
// BuildStage of chunks stage, stage + stages, ...; one (BuildStage's) without interleaving.
StatusOr<std::vector<torch::nn::AnyModule>> BuildStageChunks(
    const config::TrainConfig& cfg, int stage, const std::vector<int64_t>& sizes,
    const TensorGroupPtr& tensor = TensorGroupPtr());

}  // namespace launch::trainer
