#pragma once

// DP (`train.parallel.mode: dp`): one process drives `parallel.replicas` replicas of the model,
// each on its own thread (on CPU a thread is the "device"; there is no GIL in C++, so they
// really run in parallel). Per micro-batch:
//   1. scatter: the batch is cut into K near-equal consecutive chunks (SplitRows);
//   2. replicate: replicas 1..K-1 copy replica 0's parameters and buffers;
//   3. parallel forward on every replica;
//   4. loss: with parallel.loss_in_replica (default) every replica computes its chunk's mean
//      loss and back-propagates it weighted by rows/batch, and only the K scalar losses are
//      gathered. Without it, the outputs are gathered to the calling thread (replica 0's
//      "device"), the loss is computed there on the whole batch, and each replica receives the
//      gradient of its slice of the outputs — the first replica does more work and holds all
//      outputs, which is the weakness loss_in_replica removes;
//   5. parallel backward, each replica on its own thread;
//   6. reduce: replica 0's gradients += replica 1..K-1's, in replica order (deterministic).
// The optimizer steps replica 0 only (the loop's model). The result equals one replica on the
// whole batch up to float rounding, including uneven chunks (weights are rows / batch), for
// models without BatchNorm: a BatchNorm layer normalises each chunk by its own statistics (as
// PyTorch's DataParallel), unless parallel.sync_batchnorm makes its SyncBatchNorm layers share
// them over the replicas (model/sync_batchnorm.h; the replicas' forwards then run together, so
// it needs dp_seeded_replicas false).
//
// Threads: K workers, created once. Each worker sets its own OpenMP thread budget
// (omp_set_num_threads is per calling thread, unlike at::set_num_threads' global intent):
// max(1, at::get_num_threads() / K), or Tuning::dp_threads_per_replica
// (LAUNCH_DP_THREADS_PER_REPLICA) when set. The loop's own thread keeps its setting.
//
// Internal to trainer_runtime (includes LibTorch).

#include <memory>

#include "base/status.h"
#include "config/train_config.h"
#include "trainer_runtime/compat/platform.h"
#include "trainer_runtime/model/model.h"
#include "trainer_runtime/parallel/strategy.h"
#include "trainer_runtime/util/env.h"

namespace launch::trainer {

// Builds the DP strategy around `model` (replica 0; must outlive the strategy). The other K-1
// replicas are model->module().clone() (the global torch RNG is left as it was); each replica's
// thread gets tuning.dp_threads_per_replica OpenMP threads (0: the split above).
// InvalidConfig when replicas < 1 or the module cannot be cloned (not a torch::nn::Cloneable).
StatusOr<std::unique_ptr<ParallelStrategy>> CreateDpStrategy(const config::TrainConfig& cfg,
                                                             Model* model, const Tuning& tuning);

// Whether dp runs on `platform`: on the CPU only (its replicas are threads that hand tensors to
// each other there), with the autocast Platform::CheckAutocast allows. InvalidConfig naming
// train.parallel.mode (or mixed_precision) otherwise.
Status DpSupports(const Platform& platform);

}  // namespace launch::trainer
