#pragma once

// The one place that knows every ParallelStrategy (strategy.h): picks and builds the one a
// config asks for. A new strategy adds its own files and one branch here; the interface and
// the loop stay as they are.
//
// Internal to trainer_runtime (includes LibTorch).

#include <memory>

#include "base/status.h"
#include "config/train_config.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/model/model.h"
#include "trainer_runtime/parallel/strategy.h"

namespace launch::trainer {

// Builds the data strategy for `cfg` (parallel.mode, pipeline read as ddp, and
// local_sgd_steps) over `pg`, this rank's gradient group (ParallelLayout's Use::kGradient; null
// when the data axis has one rank: then nothing is communicated). `model` and `optimizer` (the
// one the loop steps; zero copies its type and options onto the shards) must outlive the
// strategy. A pipeline (pipeline_engine.h) wraps the one built for its stage.
// REQUIRES: `cfg` passed its rules at this world size (ParallelLayout::Create checks them).
// InvalidConfig for what a strategy refuses (zero.h).
StatusOr<std::unique_ptr<ParallelStrategy>> CreateStrategy(
    const config::TrainConfig& cfg, Model* model, torch::optim::Optimizer* optimizer,
    c10::intrusive_ptr<CountingProcessGroup> pg);

}  // namespace launch::trainer
