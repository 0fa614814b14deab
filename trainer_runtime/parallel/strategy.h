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
//   dp        replicas of the model on threads in this process (dp.h).
// Pipeline stages are not a strategy: PipelineEngine (pipeline_engine.h) runs their schedule.
//
// Internal to trainer_runtime (includes LibTorch). Not thread-safe; one loop drives it. Methods
// may throw c10::Error (a peer died, a collective timed out): the loop converts it to Status.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/model/model.h"

namespace launch::trainer {

// Communication observed during one optimizer step (reset by TakeStepStats()).
struct StepCommStats {
  int64_t allreduces = 0;       // all-reduce calls issued (counted at the process group)
  double blocking_comm_ms = 0;  // time the loop waited on communication it could not hide
  int64_t launched_before_grads_done = 0;  // ddp: bucket all-reduces launched while backward
                                           // was still producing gradients (overlap)
};

class ParallelStrategy {
 public:
  virtual ~ParallelStrategy() = default;
  virtual const char* Name() const = 0;

  // Makes every replica start from rank 0's parameters and buffers. Call once, after the
  // model (and any checkpoint) is loaded and before the first forward.
  virtual void Setup() = 0;
  // Whether the micro-batch that does (window_closes) or does not close the accumulation
  // window synchronises gradients.
  virtual bool SyncGradients(bool window_closes) const = 0;
  // Before the forward pass of a micro-batch.
  virtual void BeforeForward(bool sync) = 0;
  // Between forward and backward (DDP arms its reducer here when sync).
  virtual void BeforeBackward(const torch::Tensor& loss, bool sync) = 0;
  // After backward returned; when sync, gradients are averaged over the world on return.
  virtual void AfterBackward(bool sync) = 0;
  // After the optimizer step that brought the count of steps done to `steps_done`.
  virtual void AfterOptimizerStep(int64_t steps_done) = 0;
  // After the last step (Local SGD's final average).
  virtual void Finish(int64_t steps_done) = 0;
  // ddp: makes rank 0's buffers every rank's (before evaluating or saving, as a forward
  // through PyTorch's DDP would). COLLECTIVE in ddp; nothing in other strategies.
  virtual void SyncBuffers() {}
  // Number of gradient buckets (ddp), 0 otherwise.
  virtual int64_t num_buckets() const { return 0; }
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
  // them; otherwise every replica computes its chunk's loss with `chunk_loss`.
  virtual torch::Tensor ForwardBackward(const torch::Tensor& x, const torch::Tensor& y,
                                        const ChunkLossFn& chunk_loss, const CriterionFn& criterion,
                                        double scale) {
    TORCH_CHECK(false, Name(), " does not run forward/backward itself");
  }

  StepCommStats TakeStepStats();

 protected:
  using Clock = std::chrono::steady_clock;
  // Milliseconds from `start` to now (for stats_.blocking_comm_ms).
  static double MsSince(Clock::time_point start);
  // Makes rank 0's parameters and buffers of `model` every rank's. COLLECTIVE.
  static void BroadcastModel(const c10::intrusive_ptr<CountingProcessGroup>& pg, Model* model);

  StepCommStats stats_;
  int64_t allreduces_at_step_start_ = 0;
  // Null when the world has one process.
  c10::intrusive_ptr<CountingProcessGroup> pg_;
};

// Sum-all-reduces `values` (a small double tensor) over the world in place; no-op for a null
// group. Used for eval metrics and the final loss.
void AllReduceSum(const c10::intrusive_ptr<CountingProcessGroup>& pg, torch::Tensor& values);

}  // namespace launch::trainer
