#pragma once

// DDP (`train.parallel.mode: ddp`, one replica per process), PyTorch's DistributedDataParallel
// on c10d::Reducer: gradients bucketed in reverse parameter order (a small first bucket), each
// full bucket all-reduced asynchronously during backward and averaged over the world; rank 0's
// buffers broadcast before each forward that follows a synchronised one; no_sync skips
// prepare_for_backward. parallel.comm_hook bf16 / fp16 all-reduce the buckets in that dtype.
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

// Builds the DDP strategy around `model` (must outlive the strategy) from cfg.parallel
// (bucket_cap_mb, find_unused_parameters, comm_hook), cfg.sync_each_batch and
// tuning.ddp_exchange_max_bytes (the two-rank path of the last bucket).
// REQUIRES: `pg` is not null.
std::unique_ptr<ParallelStrategy> CreateDdpStrategy(const config::TrainConfig& cfg, Model* model,
                                                    c10::intrusive_ptr<CountingProcessGroup> pg,
                                                    const Tuning& tuning);

// Whether ddp runs on `platform`: on the CPU (Gloo or shared memory) and on CUDA (NCCL; CPU
// buckets alone take the two-rank path), with the autocast Platform::CheckAutocast allows.
// InvalidConfig naming the key otherwise. Also what ddp over pipeline replicas
// (parallel.mode pipeline) asks of its data axis.
Status DdpSupports(const Platform& platform);

}  // namespace launch::trainer
