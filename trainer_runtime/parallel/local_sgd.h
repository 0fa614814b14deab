#pragma once

// Local SGD (`train.local_sgd_steps: K`): no gradient communication; every process steps its
// own replica, and the parameters are averaged over the world every K optimizer steps and once
// at the end (one flat all-reduce per dtype).
//
// Internal to trainer_runtime (includes LibTorch).

#include <memory>

#include "config/train_config.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/model/model.h"
#include "trainer_runtime/parallel/strategy.h"

namespace launch::trainer {

// Builds the Local SGD strategy around `model` (must outlive the strategy), averaging every
// cfg.local_sgd_steps steps. A null `pg` (one process) averages nothing.
// REQUIRES: cfg.local_sgd_steps >= 1.
std::unique_ptr<ParallelStrategy> CreateLocalSgdStrategy(
    const config::TrainConfig& cfg, Model* model, c10::intrusive_ptr<CountingProcessGroup> pg);

}  // namespace launch::trainer
