#pragma once

// Local SGD (`train.local_sgd_steps: K`): no gradient communication; every process steps its
// own replica, and the parameters are averaged over the world every K optimizer steps and once
// at the end (one flat all-reduce per dtype). Floating-point buffers (BatchNorm's running
// statistics) are averaged with them; other buffers (num_batches_tracked) become rank 0's. After
// the end's average (Accelerator::Finish) every rank holds the same parameters and buffers, so
// the saved model scores what an evaluation over all ranks reports.
//
// With `train.local_sgd.outer: nesterov` it is DiLoCo (Douillard et al., 2023): the parameters
// at the last synchronisation are kept (the anchor), and at each synchronisation the averaged
// change since then, anchor - mean(replicas), is the gradient of an outer SGD step with
// Nesterov momentum (outer_lr, outer_momentum) on the anchor; every replica continues from the
// new anchor. outer_lr 1 and momentum 0 make it plain averaging. The anchor and the momentum
// are the same on every rank; rank 0 writes them to a checkpoint's local_sgd_outer.pt. They cost
// two copies of the parameters. Buffers take no outer step: they are plainly averaged.
//
// Internal to trainer_runtime (includes LibTorch).

#include <memory>

#include "base/status.h"
#include "config/train_config.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/compat/platform.h"
#include "trainer_runtime/model/model.h"
#include "trainer_runtime/parallel/strategy.h"

namespace launch::trainer {

// Builds the Local SGD strategy around `model` (must outlive the strategy), averaging every
// cfg.local_sgd_steps steps. A null `pg` (one process) averages nothing.
// REQUIRES: cfg.local_sgd_steps >= 1.
// DiLoCo's outer step, exactly as torch.optim.SGD(nesterov=True, dampening=0) steps a
// parameter `anchor` whose gradient is anchor - averaged: momentum = mu * momentum + g;
// anchor -= lr * (g + mu * momentum). On entry `params` hold the averaged replicas; on return
// they and `anchor` hold the new parameters. A momentum of zeros is the first step (PyTorch's
// buffer starts as the first gradient, which mu * 0 + g equals).
void OuterNesterovStep(const std::vector<torch::Tensor>& params, std::vector<torch::Tensor>& anchor,
                       std::vector<torch::Tensor>& momentum, double lr, double mu);

std::unique_ptr<ParallelStrategy> CreateLocalSgdStrategy(
    const config::TrainConfig& cfg, Model* model, c10::intrusive_ptr<CountingProcessGroup> pg);

// Whether Local SGD (train.local_sgd_steps > 0) runs on `platform`: on the CPU and on CUDA (its
// averages are flat all-reduces of the parameters, on whatever device they live), with the
// autocast Platform::CheckAutocast allows. InvalidConfig naming the key otherwise.
Status LocalSgdSupports(const Platform& platform);

}  // namespace launch::trainer
