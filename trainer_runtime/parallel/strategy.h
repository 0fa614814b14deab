#pragma once

// How replicas cooperate: the seam where a parallel strategy plugs into the training loop.
// The Accelerator (accelerator.h) owns model, optimizer and data cursor and calls the strategy
// at fixed points of every micro-batch and optimizer step; a strategy decides what, if
// anything, is communicated there. Implementations, each in its own file, and
// strategy_factory.h's CreateStrategy picks one for a config:
//   none      each process trains alone (no communication at all; strategy_factory.cc);
//   ddp       c10d::Reducer: gradients bucketed in reverse parameter order (small first
//             bucket), each full bucket all-reduced asynchronously during backward, averaged
//             over the world; no_sync = skipping prepare_for_backward (ddp.h);
//   local_sgd no gradient communication; parameters averaged every K optimizer steps and
//             once at the end (local_sgd.h);
//   dp        replicas of the model on threads in this process (dp.h);
//   zero      data parallel with optimizer state (stage 1), gradients (2) and parameters (3)
//             sharded over the ranks (zero.h).
//   pipeline  (pipeline_engine.h) a step engine: this rank is one stage of a pipeline; it runs
//             the stage's schedule of micro-batches itself (RunsForwardBackward) and hands every
//             other point to the data strategy above, which it wraps, over the stage's data
//             group: pipeline x ddp, pipeline x zero, pipeline x none.
// Besides the points of a micro-batch, a strategy owns the optimizer step (Step, ClipGradNorm:
// ZeRO steps only this rank's shard and needs a global norm) and where its state goes in a
// checkpoint (SaveModelState, LoadModelState). The Accelerator asks its traits
// (AveragesGradients, ReplicasBitEqual, HoldsLoss) instead of its name.
//
// Every strategy communicates over the group it is given, which the layout (layout.h) chose
// for its use: the data strategies get this rank's gradient group (Use::kGradient, the data
// axis), never the world unless the data axis is the world.
//
// Internal to trainer_runtime (includes LibTorch). Not thread-safe; one loop drives it. Methods
// may throw c10::Error (a peer died, a collective timed out): the loop converts it to Status.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "base/status.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/model/model.h"

namespace launch::trainer {

// Bytes of training state one rank holds (final.json's state_bytes).
struct StateBytes {
  int64_t parameters = 0;
  int64_t gradients = 0;
  int64_t optimizer = 0;
};

// Communication observed during one optimizer step (reset by TakeStepStats()).
struct StepCommStats {
  int64_t allreduces = 0;       // all-reduce calls issued (counted at the process group)
  int64_t reduce_scatters = 0;  // zero: gradient reduce-scatters issued
  int64_t allgathers = 0;       // zero: parameter all-gathers issued
  double blocking_comm_ms = 0;  // time the loop waited on communication it could not hide
  int64_t launched_before_grads_done = 0;  // ddp: bucket all-reduces launched while backward
                                           // was still producing gradients (overlap)
};

class ParallelStrategy {
 public:
  virtual ~ParallelStrategy() = default;
  virtual const char* Name() const = 0;

  // The points of a micro-batch. The defaults do nothing: a strategy overrides where it
  // communicates (none overrides nothing).
  // Makes every replica start from rank 0's parameters and buffers. Call once, after the
  // model (and any checkpoint) is loaded and before the first forward.
  virtual void Setup() {}
  // Whether the micro-batch that does (window_closes) or does not close the accumulation
  // window synchronises gradients (default: never; nothing is communicated).
  virtual bool SyncGradients(bool window_closes) const { return false; }
  // Before the forward pass of a micro-batch.
  virtual void BeforeForward(bool sync) {}
  // Between forward and backward (DDP arms its reducer here when sync).
  virtual void BeforeBackward(const torch::Tensor& loss, bool sync) {}
  // After backward returned; when sync, gradients are averaged over the group on return.
  virtual void AfterBackward(bool sync) {}
  // After the optimizer step that brought the count of steps done to `steps_done`.
  virtual void AfterOptimizerStep(int64_t steps_done) {}
  // After the last step (Local SGD's final average).
  virtual void Finish(int64_t steps_done) {}
  // ddp: makes rank 0's buffers every rank's (before evaluating or saving, as a forward
  // through PyTorch's DDP would). COLLECTIVE in ddp; nothing in other strategies.
  virtual void SyncBuffers() {}

  // --- The optimizer step (after the micro-batch that closed the window) -----------------------
  // Scales the gradients so that their global 2-norm is at most `max_norm` (as
  // torch::nn::utils::clip_grad_norm_) and returns the norm before clipping. The default clips
  // the model's parameters: every rank holds whole gradients, equal after synchronisation.
  // COLLECTIVE where gradients are sharded (zero).
  virtual double ClipGradNorm(double max_norm);
  // The parts of ClipGradNorm, for an engine that takes the norm over more than this group
  // (the pipeline sums it over its stages): the squared 2-norm of the model's gradients as this
  // group holds them (the default sums this rank's whole gradients, equal on every replica;
  // zero sums the shards over the group: COLLECTIVE there), and scaling them all by `coef`.
  virtual double GradNormSquared();
  virtual void ScaleGradients(double coef);
  // Zeroes every gradient without stepping: a float16 step whose gradients held inf or nan is
  // skipped (Accelerator::Step, model/loss_scaler.h). The default zeroes the model's gradients;
  // zero its shards and buckets.
  virtual void DropGradients();
  // Tensor parallelism (model/tensor_parallel.h): the parameters `split` marks (Parameters()
  // order) are shards over `group`, the others replicated on it. The default norm then sums the
  // shards' squares over the group and counts the replicated ones once (COLLECTIVE over it).
  void SetTensorGroup(TensorGroupPtr group, std::vector<bool> split) {
    tensor_group_ = std::move(group);
    split_ = std::move(split);
  }
  // Runs `optimizer`'s step, then zeroes the gradients in place (not set to undefined: DDP's
  // gradients are views into its buckets, and memory stays put across steps). The default
  // steps `optimizer` over every parameter; zero steps this rank's shard with its own optimizer
  // built from `optimizer`'s groups and options (learning rates are read from it every step,
  // so a schedule set on `optimizer` applies), then gathers the parameters. COLLECTIVE in zero.
  virtual void Step(torch::optim::Optimizer& optimizer);

  // What this rank holds of the parameters, their gradients and `optimizer`'s state (zero: its
  // shards). The default counts the model's parameters, their defined gradients and
  // `optimizer`'s state.
  virtual StateBytes MemoryBytes(const torch::optim::Optimizer& optimizer) const;

  // --- Checkpoints ---------------------------------------------------------------------------
  // Whether every rank holds the same parameters between steps (ddp, dp, zero, one process):
  // then one copy of them is saved. Local SGD's replicas and `none`'s differ.
  virtual bool ReplicasEqual() const { return world() == 1; }
  // Writes this rank's part of the model and optimizer state into the checkpoint folder `dir`
  // (Accelerator::SaveState commits the folder as a whole). The default: with equal replicas
  // rank 0 writes the model folder (SaveModelFolder in checkpoint.h: model.pt with parameters
  // and buffers, the optimizer state in pieces another layout can re-cut), otherwise every rank
  // writes model_rank<r>.pt. IoError naming the file.
  virtual Status SaveModelState(const std::string& dir, torch::optim::Optimizer& optimizer);
  // An asynchronous save (Accelerator::SaveState with checkpoint_async) forks between these
  // two: what SaveModelState needs from the other ranks is fetched by BeginSnapshot, so that
  // the child only writes files. zero stage 3 gathers its parameters there (COLLECTIVE) and
  // releases them in EndSnapshot; nothing in other strategies.
  virtual void BeginSnapshot() {}
  virtual void EndSnapshot() {}
  // Restores what SaveModelState wrote into `dir` when `written_by` ranks wrote it. The default
  // reads model.pt, or with differing replicas this rank's model_rank<r>.pt (rank 0's when the
  // checkpoint has none for this rank). Errors: the file is missing or unreadable, or was
  // written by another model (InvalidConfig naming the first mismatch).
  virtual Status LoadModelState(const std::string& dir, torch::optim::Optimizer& optimizer,
                                int64_t written_by);
  // Number of gradient buckets (ddp), 0 otherwise.
  virtual int64_t num_buckets() const { return 0; }

  // --- Traits the Accelerator asks -----------------------------------------------------------
  // Whether Backward must average the gradients for the replicas to stay equal (ddp, zero): a
  // plain loss.backward() in the loop is then a bug Step names.
  virtual bool AveragesGradients() const { return false; }
  // Whether a gradient of the model's parameters was computed outside BeforeBackward ..
  // AfterBackward since the last call (a loss.backward() the accelerator did not run, so it was
  // not averaged), and forgets it. ddp sees every gradient through its parameter hooks; the
  // other strategies answer false.
  virtual bool TakeStrayGradients() { return false; }
  // Whether every replica along the data axis holds bit-identical parameters between steps
  // (ddp, Local SGD after its final average): Finish checks it.
  virtual bool ReplicasBitEqual() const { return false; }
  // Whether this rank computes the loss (a pipeline: its last stage only).
  virtual bool HoldsLoss() const { return true; }

  // --- In-place recovery (accelerator.h) -----------------------------------------------------
  // Whether the strategy can go on over a new group after a peer was lost and replaced: what it
  // keeps between steps is the same on every rank and comes whole from one live peer (ddp).
  virtual bool SupportsInPlaceRecovery() const { return false; }
  // Why not, when the mode could be and an option of this strategy's keeps it from it ("" when
  // none does): the log line of a run under --recover in_place says it.
  virtual std::string InPlaceRefusal() const { return ""; }
  // Goes on over `pg`, the group re-formed with the replacement, instead of the broken one:
  // drops whatever it holds of the step in flight and readies the next step as Setup does,
  // without Setup's broadcast (the state came from a live peer). Gradients must be zero or
  // undefined. REQUIRES: SupportsInPlaceRecovery() (checked: c10::Error).
  virtual void Reform(c10::intrusive_ptr<CountingProcessGroup> pg);
  // Whether a lost rank can be recovered from snapshots instead (Accelerator, "In-place
  // recovery"): what the strategy keeps between steps may exist on one rank alone (a ZeRO
  // shard, a Local SGD replica), so every rank writes it (SaveImage) every
  // recover_snapshot_every steps, a peer keeps a copy, and after a loss every rank rolls back
  // to the newest snapshot (LoadImage), the replacement from its peer's copy. Reform then also
  // readies a replacement that never ran Setup. Such a strategy also supports Reform.
  virtual bool RecoversFromSnapshots() const { return false; }
  // Whether Reform works (it may be given the data group of a layout that splits the world,
  // whose images snapshots then keep: a tensor shard, a pipeline stage): ddp, zero, Local SGD,
  // and none, which holds nothing between steps.
  virtual bool CanReform() const { return SupportsInPlaceRecovery() || RecoversFromSnapshots(); }
  // Everything of the run's state this rank holds at a step boundary (parameters or their
  // shard, buffers, `optimizer`'s or the shard optimizer's state, the strategy's own) into
  // `archive`; throws c10::Error. The default: the model file's keys (WriteModelKeys).
  virtual void SaveImage(torch::serialize::OutputArchive& archive,
                         torch::optim::Optimizer& optimizer);
  // Restores SaveImage's keys, after Reform. InvalidConfig naming the key it cannot restore.
  // May be COLLECTIVE over the group Reform gave (zero gathers what each rank's image holds a
  // slice of): every rank of the group calls it at the same point.
  virtual Status LoadImage(torch::serialize::InputArchive& archive,
                           torch::optim::Optimizer& optimizer);
  // dp (dp.h): the strategy runs forward, loss and backward itself (replicas on threads). When
  // true the loop calls ForwardBackward instead of forward, loss and backward().
  virtual bool RunsForwardBackward() const { return false; }
  // The mean loss of rows `x`, `y` computed with `replica` (a chunk of the batch).
  using ChunkLossFn =
      std::function<torch::Tensor(Model& replica, const torch::Tensor& x, const torch::Tensor& y)>;
  // The mean loss of gathered outputs (DataParallel's gather-then-loss, loss_in_replica false).
  using CriterionFn = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>;
  // Adds the gradient of `scale` x (mean loss over the batch) to the model's .grad and returns
  // that mean loss as a detached scalar. With parallel.loss_in_replica false and a non-null
  // `criterion`, replica outputs (Model::Forward) are gathered and the loss computed once on
  // them; otherwise every replica computes its chunk's loss with `chunk_loss`. dp throws
  // c10::Error naming train.parallel.replicas when `x` has fewer rows than replicas.
  virtual torch::Tensor ForwardBackward(const torch::Tensor& x, const torch::Tensor& y,
                                        const ChunkLossFn& chunk_loss, const CriterionFn& criterion,
                                        double scale) {
    TORCH_CHECK(false, Name(), " does not run forward/backward itself");
  }

  // Communication since the last call (a pipeline: its data strategy's).
  virtual StepCommStats TakeStepStats();

  // This rank and the world (0 and 1 for one process).
  int rank() const { return rank_; }
  int world() const { return world_; }

 protected:
  using Clock = std::chrono::steady_clock;
  // Milliseconds from `start` to now (for stats_.blocking_comm_ms).
  static double MsSince(Clock::time_point start);
  // Makes rank 0's buffers (running statistics) of model_ every rank's, timed as blocking
  // communication (ddp and zero before a forward that follows a synchronised one). COLLECTIVE.
  void BroadcastBuffers();

  StepCommStats stats_;
  int64_t allreduces_at_step_start_ = 0;
  int64_t reduce_scatters_at_step_start_ = 0;
  int64_t allgathers_at_step_start_ = 0;
  // The group the strategy communicates through (null: it does not) and the rank and world it
  // sets.
  void SetGroup(c10::intrusive_ptr<CountingProcessGroup> pg) {
    pg_ = std::move(pg);
    rank_ = pg_ ? pg_->getRank() : 0;
    world_ = pg_ ? pg_->getSize() : 1;
  }
  // Null when the world has one process.
  c10::intrusive_ptr<CountingProcessGroup> pg_;
  int rank_ = 0;
  int world_ = 1;
  // The model the strategy trains; set by every strategy's constructor.
  Model* model_ = nullptr;
  TensorGroupPtr tensor_group_;  // SetTensorGroup's
  std::vector<bool> split_;
};

// What a rank holding `model` whole holds: its parameters, their defined gradients and
// `optimizer`'s state (ParallelStrategy::MemoryBytes's default; pipeline stages).
StateBytes WholeStateBytes(const Model& model, const torch::optim::Optimizer& optimizer);

// Makes rank 0's (of `pg`) parameters and buffers of `model` every rank's: the strategies'
// Setup and the pipeline's stage groups (PipelineEngine::SetStage). No-op for a null group.
// COLLECTIVE.
void BroadcastModel(const c10::intrusive_ptr<CountingProcessGroup>& pg, Model* model);

// Sum-all-reduces `values` (a small double tensor) over the world in place; no-op for a null
// group. Used for eval metrics and the final loss.
void AllReduceSum(const c10::intrusive_ptr<CountingProcessGroup>& pg, torch::Tensor& values);

}  // namespace launch::trainer
