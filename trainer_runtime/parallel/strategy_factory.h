#pragma once

// The one place that knows every ParallelStrategy (strategy.h): picks and builds the one a
// config asks for, and asks it whether it runs on the worker's Platform. A new strategy adds its
// own files and one branch here; the interface and the loop stay as they are.
//
// Internal to trainer_runtime (includes LibTorch).

#include <memory>

#include "base/status.h"
#include "config/train_config.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/compat/platform.h"
#include "trainer_runtime/model/model.h"
#include "trainer_runtime/parallel/strategy.h"
#include "trainer_runtime/util/env.h"

namespace launch::trainer {

// Builds the data strategy for `cfg` (parallel.mode, pipeline read as ddp, and
// local_sgd_steps) over `pg`, this rank's gradient group (ParallelLayout's Use::kGradient; null
// when the data axis has one rank: then nothing is communicated). `model` and `optimizer` (the
// one the loop steps; zero copies its type and options onto the shards) must outlive the
// strategy. A pipeline (pipeline_engine.h) wraps the one built for its stage. `tuning`: the
// worker's DistEnv::tuning (ddp's two-rank path, dp's threads).
// REQUIRES: `cfg` passed its rules at this world size (ParallelLayout::Create checks them), and
// CheckPlatformSupport(cfg, platform) for the platform the model lives on.
// InvalidConfig for what a strategy refuses (zero.h).
StatusOr<std::unique_ptr<ParallelStrategy>> CreateStrategy(
    const config::TrainConfig& cfg, Model* model, torch::optim::Optimizer* optimizer,
    c10::intrusive_ptr<CountingProcessGroup> pg, const Tuning& tuning);

// Whether the strategy `cfg` selects runs on `platform` (gloo's hasGPUDirect(): each strategy
// declares what it supports, in its own header): parallel.mode dp (DpSupports), else
// local_sgd_steps > 0 (LocalSgdSupports), none (here), zero (ZeroSupports), ddp (DdpSupports).
// With stages above 1 (or mode pipeline, ddp over pipeline replicas) the pipeline engine's
// PipelineSupports first, then the data strategy's. OK, or InvalidConfig naming the train.* key (or
// mixed_precision) and the way out: "train.parallel.mode: dp runs on the CPU only; on GPUs use ddp
// or none, or run launch --cpu", "mixed_precision: fp16 needs dynamic loss scaling, ...".
// Call before building anything on the platform (Accelerator::Create).
Status CheckPlatformSupport(const config::TrainConfig& cfg, const Platform& platform);

}  // namespace launch::trainer
