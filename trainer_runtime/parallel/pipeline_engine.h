#pragma once

// The pipeline step engine: this rank is one stage of a pipeline. It runs the stage's schedule
// (GPipe, 1F1B, interleaved 1F1B or ZB-H1, see pipeline_schedule.h) over the micro-batches of a
// batch, moves activations forward and their gradients back with the world group's send/recv to
// the neighbours the layout names along the stage axis (shared-memory rings when the ranks share
// a host, Gloo otherwise: process_group.h), and clips by the norm over every stage.
//
// Interleaved 1F1B: the rank holds v chunks of the model (chunk c is the model's chunk
// c x P + stage), so a micro-batch goes round the ranks v times: the last rank's chunk c sends on
// to the first rank's chunk c + 1 and the gradients come back the same way. ZB-H1: each backward
// runs in two halves (model/split_backward.h): the input's gradient, sent back at once, and the
// Linear layers' weight gradients, which the schedule runs later, in what would be idle time.
//
// It is a ParallelStrategy (strategy.h) that runs forward and backward itself, as dp does, and
// wraps the data strategy of the stage's data group (the same stage of the other pipeline
// replicas): ddp's reducer, zero's shards, or none. That strategy sees the schedule's backward
// passes as the micro-batches of an accumulation window: only the window's last backward
// synchronises (every one for a strategy that syncs each micro-batch: zero stages 2 and 3,
// sync_each_batch), and the step, the checkpoint and the replicas' buffers are its own. So
// pipeline x ddp and pipeline x zero 1/2/3 are the same code.
//
// Layout (layout.h): world = tensor x data x stage, stage outermost; the stage's neighbours and
// its checkpoint folder (stage<s>/, the layout's ShardName) come from the layout.
//
// With several chunks or split backwards the passes that touch a parameter are no longer one
// backward at the window's end, so the data strategy synchronises once after the schedule: a
// backward that adds zero to every gradient runs its hooks (ddp's reducer, ZeRO's buckets) as the
// last backward of a window would. The reduction then follows the compute instead of overlapping
// it. Not with strategies that reduce every micro-batch (ZeRO stages 2 and 3, sync_each_batch):
// with split backwards a micro-batch's gradient is whole only at its weight pass (refused).
//
// Loss weighting: micro-batch m of a batch of B rows is weighted by rows_m / B (and by `scale`,
// 1 / accumulation steps), so the gradients equal one process on the whole batch even when the
// micro-batches are uneven; not with BatchNorm, which normalises each micro-batch by its own
// statistics.
//
// Internal to trainer_runtime (includes LibTorch). Not thread-safe. Methods may throw
// c10::Error when a peer died.

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "base/status.h"
#include "config/train_config.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/compat/platform.h"
#include "trainer_runtime/model/model.h"
#include "trainer_runtime/parallel/layout.h"
#include "trainer_runtime/parallel/strategy.h"
#include "trainer_runtime/util/env.h"
#include "trainer_runtime/util/pipeline_schedule.h"

namespace launch::trainer {

// Whether the pipeline engine runs on `platform`: the CPU only for now (its send/recv headers
// and stage boundaries are CPU tensors, and its shared-memory rings carry CPU memory).
// InvalidConfig naming train.parallel.stages and the way out on CUDA.
Status PipelineSupports(const Platform& platform);

class PipelineEngine : public ParallelStrategy {
 public:
  using ForwardFn = std::function<torch::Tensor(const torch::Tensor&)>;

  // This rank's stage of `cfg`'s pipeline: `model` is the stage's parameter view, `forwards`
  // run its chunks (one, or parallel.virtual_stages under interleaved 1F1B: InvalidConfig
  // otherwise), `data` is the data strategy over the stage's data group (CreateStrategy), which
  // the engine owns (InvalidConfig when it reduces every micro-batch under a schedule that
  // synchronises after the schedule). `world` is the job's group (null for one process):
  // send/recv between stages; `stage` this replica's stages' group (CreateAxisGroup along the
  // stage axis): the norm. The stage computes on `platform`'s device (the model is already
  // there) under its autocast.
  // REQUIRES: `layout` was built from `cfg` (its validation covers the pipeline's rules).
  static StatusOr<std::unique_ptr<PipelineEngine>> Create(
      const config::TrainConfig& cfg, const Platform& platform, const ParallelLayout& layout,
      c10::intrusive_ptr<CountingProcessGroup> world,
      c10::intrusive_ptr<CountingProcessGroup> stage, std::shared_ptr<Model> model,
      std::vector<ForwardFn> forwards, std::unique_ptr<ParallelStrategy> data);

  const char* Name() const override { return "pipeline"; }
  // The data strategy's name ("ddp", "zero", "none").
  const char* DataStrategyName() const { return data_->Name(); }

  int stages() const { return layout_.degree(Axis::kStage); }
  int stage() const { return layout_.coordinate(Axis::kStage); }
  int replicas() const { return layout_.degree(Axis::kData); }
  int replica() const { return layout_.coordinate(Axis::kData); }
  bool first() const { return stage() == 0; }
  bool last() const { return stage() == stages() - 1; }
  int virtual_stages() const { return static_cast<int>(forwards_.size()); }
  const std::vector<PipeOp>& schedule() const { return ops_; }

  // --- The seam (strategy.h): the data strategy's, but for forward and backward ---------------
  void Setup() override { data_->Setup(); }
  bool SyncGradients(bool window_closes) const override {
    return data_->SyncGradients(window_closes);
  }
  void BeforeForward(bool sync) override;
  // (BeforeBackward and AfterBackward: ForwardBackward calls the data strategy's itself.)
  void AfterOptimizerStep(int64_t steps_done) override { data_->AfterOptimizerStep(steps_done); }
  void Finish(int64_t steps_done) override { data_->Finish(steps_done); }
  void SyncBuffers() override { data_->SyncBuffers(); }
  // Clips by the norm over every stage's gradients; returns the norm. COLLECTIVE (the stage
  // group, and the data group where the data strategy shards).
  double ClipGradNorm(double max_norm) override;
  double GradNormSquared() override;
  void ScaleGradients(double coef) override { data_->ScaleGradients(coef); }
  void DropGradients() override { data_->DropGradients(); }
  void Step(torch::optim::Optimizer& optimizer) override { data_->Step(optimizer); }
  StateBytes MemoryBytes(const torch::optim::Optimizer& optimizer) const override {
    return data_->MemoryBytes(optimizer);
  }
  bool ReplicasEqual() const override { return data_->ReplicasEqual(); }
  // The data strategy's files, in the stage's folder of the checkpoint (layout ShardName).
  Status SaveModelState(const std::string& dir, torch::optim::Optimizer& optimizer) override;
  Status LoadModelState(const std::string& dir, torch::optim::Optimizer& optimizer,
                        int64_t written_by) override;
  void BeginSnapshot() override { data_->BeginSnapshot(); }
  void EndSnapshot() override { data_->EndSnapshot(); }
  int64_t num_buckets() const override { return data_->num_buckets(); }
  bool AveragesGradients() const override { return data_->AveragesGradients(); }
  bool ReplicasBitEqual() const override { return data_->ReplicasBitEqual(); }
  bool HoldsLoss() const override { return last(); }

  // In-place recovery (accelerator.h): a stage's layers exist on its replicas at most, and its
  // data strategy's state (a ZeRO shard) maybe on this rank alone, so every stage recovers from
  // snapshots: the image is the data strategy's (parameters, optimizer state, its shards).
  bool RecoversFromSnapshots() const override { return true; }
  void SaveImage(torch::serialize::OutputArchive& archive,
                 torch::optim::Optimizer& optimizer) override {
    data_->SaveImage(archive, optimizer);
  }
  Status LoadImage(torch::serialize::InputArchive& archive,
                   torch::optim::Optimizer& optimizer) override {
    return data_->LoadImage(archive, optimizer);
  }
  // Goes on over the groups of a new generation (the world, the stage group and the data
  // strategy's, which Reforms over `data`): sends of the abandoned pass are dropped. Not
  // Reform(pg), which has only one group to give (c10::Error).
  void ReformGroups(c10::intrusive_ptr<CountingProcessGroup> world,
                    c10::intrusive_ptr<CountingProcessGroup> stage,
                    c10::intrusive_ptr<CountingProcessGroup> data);
  StepCommStats TakeStepStats() override;

  bool RunsForwardBackward() const override { return true; }
  // One pass of the schedule over `x` (read on the first stage) and `y` (on the last): every
  // micro-batch forward and backward, `criterion(output, target)` the loss on the last stage
  // (`chunk_loss` is not used: a stage sees activations, not the model). Returns the batch's
  // mean loss on the last stage, 0 elsewhere. Throws c10::Error naming
  // train.parallel.microbatches when the batch has fewer rows than micro-batches.
  torch::Tensor ForwardBackward(const torch::Tensor& x, const torch::Tensor& y,
                                const ChunkLossFn& chunk_loss, const CriterionFn& criterion,
                                double scale) override;
  // Inference through the pipeline: the last stage's output for `inputs` (read on the first
  // stage), undefined elsewhere. COLLECTIVE within the pipeline.
  torch::Tensor Forward(const torch::Tensor& inputs);

  // final.json: per stage [peak live, idle fraction, busy s, window s, peak RSS MB, checksum hi,
  // checksum lo, peak boundary bytes] (gathered by the caller).
  static constexpr int kStatFields = 8;
  std::vector<double> Stats(uint64_t checksum) const;
  // Forget the first step's timings (allocations, lazy initialisation) but keep peak counts.
  void ResetTimings();
  int peak_live() const { return totals_.peak_live; }

 private:
  PipelineEngine(const config::TrainConfig& cfg, const Platform& platform,
                 const ParallelLayout& layout, c10::intrusive_ptr<CountingProcessGroup> world);
  // Chunk `chunk`'s forward, under autocast when mixed precision is bf16, the output back in
  // float32.
  torch::Tensor StageForward(int chunk, const torch::Tensor& input);
  // An activation for the next rank's chunk `chunk`, micro-batch `micro` (-1: inference), which
  // the receiver checks against the op it runs.
  void SendActivation(const torch::Tensor& t, int chunk, int micro);
  torch::Tensor RecvActivation(int chunk, int micro);
  void WaitSends();
  // The ranks before and after along the stage axis; with chunks the first rank's previous is
  // the last rank (chunk c - 1 there) and the last rank's next the first.
  int Prev() const { return layout_.Neighbour(Axis::kStage, first() ? stages() - 1 : -1); }
  int Next() const { return layout_.Neighbour(Axis::kStage, last() ? 1 - stages() : +1); }
  bool FirstChunk(int chunk) const { return first() && chunk == 0; }
  bool LastChunk(int chunk) const { return last() && chunk == virtual_stages() - 1; }
  // The data strategy's synchronisation after a schedule whose passes each ran unsynchronised.
  void SyncAfterSchedule();

  struct Totals {
    double busy_s = 0;    // forward + backward compute (no waiting)
    double window_s = 0;  // from the first op's start to the end of the last (with waits)
    int peak_live = 0;    // micro-batches alive at once (executor count)
    int64_t peak_boundary_bytes = 0;  // bytes of the stage inputs/outputs kept alive
  };

  const ParallelLayout layout_;
  const int microbatches_;
  const c10::Device device_;                           // where the stage computes and receives
  const c10::ScalarType autocast_dtype_;               // on device_'s type; Undefined: no autocast
  c10::intrusive_ptr<CountingProcessGroup> world_;     // p2p between stages
  c10::intrusive_ptr<CountingProcessGroup> stage_pg_;  // this replica's stages (the norm)
  std::unique_ptr<ParallelStrategy> data_;             // over the stage's data group
  bool sync_ = true;  // the current pass closes a window the data strategy synchronises
  std::shared_ptr<Model> stage_model_;  // model_ (strategy.h) points at it
  std::vector<ForwardFn> forwards_;     // one per chunk
  std::vector<PipeOp> ops_;
  size_t last_backward_ = 0;  // index in ops_ of the pass' last backward
  // Backwards split into input and weight passes (ZB-H1; not under autocast: split_backward.h).
  bool split_backward_ = false;
  // The data strategy synchronises after the schedule, not in its last backward (header).
  bool sync_after_ = false;
  Totals totals_;
  double clip_ms_ = 0;  // the last ClipGradNorm's communication
  std::vector<c10::intrusive_ptr<c10d::Work>> pending_sends_;
  std::vector<torch::Tensor> pending_tensors_;  // kept alive until their sends complete
};

}  // namespace launch::trainer
