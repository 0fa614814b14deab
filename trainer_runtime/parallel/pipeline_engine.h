#pragma once

// The step engine of pipeline mode: runs one stage's schedule (GPipe or 1F1B, see
// pipeline_schedule.h) over the micro-batches of a batch, moves activations forward and their
// gradients back with the job group's send/recv (shared-memory rings when the ranks share a
// host, Gloo otherwise: process_group.h), all-reduces the stage's gradients with the same stage of
// the other pipeline replicas, and clips by the norm over all stages. The Accelerator owns one
// in pipeline mode (PreparePipeline); everything else (data, checkpoints, signals, metrics) is
// shared with the other modes.
//
// Layout: with P stages and world W = P x D, global rank r runs stage r % P of pipeline replica
// r / P (a pipeline's stages are adjacent ranks). Stage s of every replica forms its own Gloo
// group (a PrefixStore view of the job's TCPStore, one per restart).
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
#include <map>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "base/status.h"
#include "config/train_config.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/model/model.h"
#include "trainer_runtime/parallel/layout.h"
#include "trainer_runtime/util/env.h"
#include "trainer_runtime/util/pipeline_schedule.h"

namespace launch::trainer {

class PipelineEngine {
 public:
  using ForwardFn = std::function<torch::Tensor(const torch::Tensor&)>;
  using LossFn = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>;

  // Joins the stage's data-parallel group (CreateAxisGroup) when there is more than one
  // replica. `pg` is the world (null for one process); `layout` was built from `cfg` (its
  // validation covers the pipeline's rules: stages divide the world, 1F1B micro-batches >=
  // stages, batch_size >= micro-batches, no Local SGD).
  static StatusOr<std::unique_ptr<PipelineEngine>> Create(
      const config::TrainConfig& cfg, const DistEnv& env, const ParallelLayout& layout,
      c10::intrusive_ptr<CountingProcessGroup> pg, std::chrono::milliseconds timeout);

  // This rank's stage: `model` is its parameter view, `forward` runs it. With pipeline
  // replicas, replica 0's parameters and buffers of this stage become every replica's (as DDP's
  // Prepare broadcasts rank 0's). COLLECTIVE over the stage's replicas.
  void SetStage(std::shared_ptr<Model> model, ForwardFn forward);

  int stages() const { return stages_; }
  int stage() const { return stage_; }
  int replicas() const { return replicas_; }
  int replica() const { return replica_; }
  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ == stages_ - 1; }
  const std::vector<PipeOp>& schedule() const { return ops_; }

  // One pass of the schedule over `x` (first stage) / `y` (last stage) with `rows` rows: every
  // micro-batch forward and backward. Returns the batch's mean loss on the last stage, 0
  // elsewhere. With pipeline replicas, a pass that follows a gradient all-reduce first makes
  // replica 0's buffers this stage's (SyncBuffers), as DDP's broadcast_buffers does. Throws
  // c10::Error naming train.parallel.microbatches when `rows` < microbatches (CheckRowsFor).
  double ForwardBackward(const torch::Tensor& x, const torch::Tensor& y, int64_t rows,
                         const LossFn& loss_fn, double scale);
  // Averages this stage's gradients over the pipeline replicas (one flat all-reduce per dtype;
  // a gradient no replica produced stays undefined) and `loss` along with them; returns the
  // replicas' mean loss.
  double AllReduceGradients(double loss);
  // This stage's buffers (running statistics) become replica 0's. COLLECTIVE over the stage's
  // replicas; nothing with one replica.
  void SyncBuffers();
  // Clips by the norm over every stage's gradients; returns the norm. COLLECTIVE (world).
  double ClipGradNorm(double max_norm);
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
  double last_comm_ms() const { return comm_ms_; }
  int64_t stage_allreduces() const { return stage_pg_ ? stage_pg_->allreduce_count() : 0; }

 private:
  bool bf16() const { return cfg_.mixed_precision == "bf16"; }
  // forward_ under autocast when mixed precision is bf16, the output back in float32.
  torch::Tensor StageForward(const torch::Tensor& input);
  PipelineEngine(const config::TrainConfig& cfg, const DistEnv& env, const ParallelLayout& layout,
                 c10::intrusive_ptr<CountingProcessGroup> pg);
  void SendActivation(const torch::Tensor& t);
  torch::Tensor RecvActivation();
  void WaitSends();
  int Prev() const { return env_.rank - 1; }
  int Next() const { return env_.rank + 1; }

  struct Totals {
    double busy_s = 0;    // forward + backward compute (no waiting)
    double window_s = 0;  // from the first op's start to the end of the last (with waits)
    int peak_live = 0;    // micro-batches alive at once (executor count)
    int64_t peak_boundary_bytes = 0;  // bytes of the stage inputs/outputs kept alive
  };

  config::TrainConfig cfg_;
  DistEnv env_;
  int stages_ = 1, stage_ = 0, replicas_ = 1, replica_ = 0;
  c10::intrusive_ptr<CountingProcessGroup> pg_;        // the world: p2p between stages
  c10::intrusive_ptr<CountingProcessGroup> stage_pg_;  // this stage across replicas (D > 1)
  bool gradients_synced_ = true;  // the last pass ended in AllReduceGradients (or none ran)
  std::shared_ptr<Model> model_;
  ForwardFn forward_;
  std::vector<PipeOp> ops_;
  Totals totals_;
  double comm_ms_ = 0;
  std::vector<c10::intrusive_ptr<c10d::Work>> pending_sends_;
  std::vector<torch::Tensor> pending_tensors_;  // kept alive until their sends complete
};

}  // namespace launch::trainer
