#pragma once

// ZeRO (`train.parallel.mode: zero`): data parallel like ddp (every rank a replica on its own
// data, gradients averaged over the world), with the training state sharded over the ranks so
// that memory per rank falls as ranks are added (DeepSpeed's stages; PyTorch's
// ZeroRedundancyOptimizer is stage 1, FSDP's SHARD_GRAD_OP stage 2):
//   stage 1  optimizer state: each rank steps only its shard of the parameters with its own
//            optimizer, then the parameters are all-gathered;
//   stage 2  also gradients: each rank keeps only its shard of the averaged gradients;
//   stage 3  also parameters (FSDP's FULL_SHARD): between uses each rank holds only its slice
//            of each unit's parameters, gathered around the unit's forward and backward.
// Bytes per parameter with fp32 Adam: ddp 16, stage 1 8 + 8/W, stage 2 4 + 12/W, stage 3 16/W.
//
// Layout. The trained parameters (Model::Parameters) are cut, walking them backwards (the order
// backward produces gradients in), into units of about parallel.bucket_cap_mb. Each unit is one
// flat buffer padded to a multiple of W; the parameters become views into it. Rank r owns the
// r-th of W equal slices of every unit: its optimizer steps "segments", one per parameter that
// meets the slice, views into the slice, with the options of that parameter's group in the
// user's optimizer (the same elementwise update as the whole parameter gets).
//
// Gradients. A hook after each parameter's gradient accumulation counts the unit's parameters
// done; a unit whose parameters are all done is reduce-scattered (shared memory on one host,
// Gloo otherwise; CountingProcessGroup::ReduceScatterFlat) while backward goes on, in unit order
// on every rank (a unit finished early waits for those before it, so every rank issues the same
// sequence). Each rank's gradients are divided by W before the sum, as DDP's are, and the
// shared-memory transport sums in rank order: with it, the averaged gradients, and so the steps,
// are DDP's bit for bit. Stage 1 keeps whole gradients (views into per-unit buffers) and
// reduces at the micro-batch that closes the accumulation window (no_sync before it, as ddp);
// stage 2 copies each gradient into its unit's bucket as it is produced, frees it, and reduces
// every micro-batch into the shard (accumulating there), so no whole gradient outlives its unit.
//
// Stage 3. The units of the model's ShardUnit modules (model/shard_unit.h) hold their
// parameters only; the rest (the root: parameters outside every unit or shared between units)
// is cut by size as above and stays whole. A module unit's flat buffer releases its storage
// between uses, and shard_param holds this rank's slice, which the optimizer steps (so no
// all-gather follows the step). ShardedForward comes to this strategy (UnitGatherer): the unit
// is all-gathered for the forward (the next unit of the previous forward prefetched), released
// after it but for the forward's last, and gathered again when its output's gradient arrives in
// backward (the unit before it prefetched); once all its gradients are accumulated it is
// released and reduce-scattered as in stage 2. Checkpoints, BeginSnapshot and Finish gather all
// units (model.pt holds whole parameters); Finish leaves them whole.
//
// Checkpoints: rank 0 writes model.pt (parameters and buffers, as ddp) and the shards' index,
// every rank its optimizer shard (zero_rank<r>.pt): each segment's parameter, element range and
// state tensors (state/checkpoint.h). A resume at any world size, stage or unit size reads the
// shard files that meet its segments, one at a time, and copies the overlapping elements; a
// run without zero (one process, ddp) reads them all into its whole optimizer, and zero takes
// its segments of a whole optimizer state that such a run left in model.pt.
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

// The ZeRO strategy of cfg.parallel.zero_stage around `model` (must outlive it) and `optimizer`
// (the user's: its type, groups and options, and Adam's and AdamW's implementation, are copied
// onto the shards; it is not stepped).
// InvalidConfig when the optimizer is not one of torch::optim's SGD, Adam, AdamW, RMSprop or
// Adagrad, holds a tensor twice or one that is not a trained parameter, or when parameters mix
// dtypes or devices.
// REQUIRES: `pg` is not null.
StatusOr<std::unique_ptr<ParallelStrategy>> CreateZeroStrategy(
    const config::TrainConfig& cfg, Model* model, torch::optim::Optimizer* optimizer,
    c10::intrusive_ptr<CountingProcessGroup> pg);

// Whether zero runs on `platform`: on the CPU and on CUDA (flat buffers and shards live on the
// parameters' device: shared memory or Gloo between CPU ranks, NCCL between GPUs), with the
// autocast Platform::CheckAutocast allows. InvalidConfig naming mixed_precision otherwise.
Status ZeroSupports(const Platform& platform);

}  // namespace launch::trainer
