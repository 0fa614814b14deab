#pragma once

// The trainer runtime's public API: distributed training for a LibTorch program's own model,
// optimizer, data and loop. What accelerate's library is to PyTorch (prepare, accumulate,
// backward, no_sync, Local SGD, save_state, set_trigger), in C++.
//
//   auto accel = launch::trainer::Accelerator::Create(options).value();   // torchrun's env
//   accel->Prepare(model.ptr(), optimizer);                                // broadcast, reducer
//   auto loader = accel->PrepareDataLoader(MyDataset(...), /*batch_size=*/64);
//   for (int64_t epoch = accel->epoch(); epoch < epochs; ++epoch)
//     for (auto& batch : loader.Epoch(epoch)) {
//       accel->Accumulate();                          // before forward: no_sync or not
//       auto loss = torch::nn::functional::cross_entropy(model(batch.data), batch.target);
//       accel->Backward(loss);                        // loss / N; all-reduce on the last one
//       accel->Step();                                // clip + step + zero_grad when synced
//     }
//   accel->Finish();                                  // Local SGD's last average, barrier
//
// Backward and Step replace a ported loop's own loss.backward() and optimizer.zero_grad(): a
// plain backward() is not synchronised (each rank would train on its own), and under ddp the
// gradients are views into the all-reduce buckets, which zero_grad() cannot detach (it aborts).
//
// Mixed precision (options.mixed_precision, the top-level `mixed_precision` key): `bf16` is CPU
// autocast to bfloat16, as torch.autocast("cpu", torch.bfloat16): matmuls and convolutions run
// in bfloat16 while parameters, gradients, optimizer state and the loss stay float32, and
// gradients are communicated as float32. ForwardBackward, PipelineForwardBackward and
// PipelineForward apply it themselves; a loop that calls its model directly puts the forward
// pass and the loss inside an AutocastScope:
//   { auto amp = accel->Autocast(); loss = criterion(model(batch.data), batch.target); }
//   accel->Backward(loss);
// `fp16` and `fp8` need a GPU (InvalidConfig on this CPU-only LibTorch).
//
// Where a worker sits comes from the environment (torchrun's contract: RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT; OpenMPI's and SLURM's spellings as fallbacks, see env.h), so the
// same binary runs under `launch`, torchrun, srun and mpirun; without them it is one process.
//
// Modes (options.parallel.mode; the same `train:` YAML keys `train` reads, config/loader.h):
//   none       no communication (each process trains alone);
//   ddp        one replica per process: rank 0's parameters and buffers are broadcast by
//              Prepare; gradients go through c10d's Reducer (buckets in reverse parameter order,
//              a small first bucket, each full bucket all-reduced during backward) and are
//              averaged over the world; parameters with requires_grad false are left out, tied
//              (shared) parameters count once; options.parallel.find_unused_parameters lets a
//              forward leave parameters unused (PyTorch's option); rank 0's buffers (BatchNorm
//              statistics) become every rank's before each forward that follows a synchronised
//              one, as PyTorch's broadcast_buffers, and at Finish / SyncBuffers;
//   local_sgd  (local_sgd_steps K > 0 with ddp) no gradient communication: each process
//              steps its own replica and parameters are averaged every K optimizer steps and
//              by Finish(); with options.local_sgd.outer nesterov, DiLoCo's outer step on the
//              averaged change (parallel/local_sgd.h);
//   dp         `parallel.replicas` replicas in this process, one thread each (ForwardBackward);
//              needs a module derived from torch::nn::Cloneable (as torch::nn::parallel does);
//   pipeline   this process is one stage of a pipeline (pipeline_stages.h, PreparePipeline).
// Accumulation (gradient_accumulation_steps N): the all-reduce is skipped on all but the last
// micro-batch of each window (sync_each_batch turns that off); the window also closes at the end
// of the data (sync_with_dataloader); Backward divides the loss by N; Step only steps on a
// micro-batch that synchronised.
//
// Thread-safety: none. One thread (the training loop) makes every call. Collective calls
// (marked COLLECTIVE) must be made by every rank in the same order, as with c10d.
//
// Dead peers: a collective whose peer died throws c10::Error from inside LibTorch, or returns
// PeerLost where the method returns a Status. A program run by `launch` may just let it
// propagate: the agent stops the siblings and, with --max_restarts, restarts everyone, and
// LoadState resumes from the last checkpoint.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "base/status.h"
#include "config/train_config.h"
#include "trainer_runtime/data/sampler.h"
#include "trainer_runtime/model/autocast.h"
#include "trainer_runtime/util/env.h"

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace launch::trainer {

class CountingProcessGroup;
class Model;
class ParallelLayout;
struct TrainState;
class ParallelStrategy;
class PipelineEngine;

// Position of a data loader: the next batch it yields. Part of the saved state. The global
// sample position of the next batch (all data-parallel ranks together) is
// start + batch * global_batch; a checkpoint stores it, so a resume at another world size
// continues from there (sampler.h).
struct LoaderCursor {
  int64_t epoch = 0;
  int64_t batch = 0;              // next batch within the epoch, counted from `start`
  int64_t batches_per_epoch = 0;  // per rank (ShardedSampler: the last partial batch is dropped)
  int64_t start = 0;              // global position of batch 0 of `epoch`: 0, or where a resume
                                  // at another world size took the epoch over
  int64_t batches_this_epoch =
      0;                      // per rank, of `epoch` from `start` (ShardedSampler::BatchesFrom)
  int64_t num_samples = 0;    // the data set's size
  int64_t global_batch = 0;   // data-parallel ranks x batch size
  bool last_was_end = false;  // the batch served last was the epoch's last

  // Samples of `epoch` consumed by all ranks together: the next batch's global position.
  int64_t offset() const { return start + batch * global_batch; }
  // Moves to epoch `e`'s beginning.
  void StartEpoch(int64_t e) {
    epoch = e;
    batch = 0;
    start = 0;
    batches_this_epoch = batches_per_epoch;
  }
};

// What the ranks agreed on at a step boundary (Accelerator::PollSignals).
struct SignalRequest {
  int signal = 0;           // the signal that asked (SIGUSR1, SIGTERM, ...), 0 = none
  bool checkpoint = false;  // SIGUSR1/SIGUSR2/SIGTERM/SIGINT: save state now
  bool stop = false;        // SIGTERM/SIGINT: then stop (exit 143)
};

template <typename DatasetT>
class DistributedDataLoader;

class Accelerator {
 public:
  // Reads DistEnv from this process's environment (LAUNCH_INIT_TIMEOUT_S overrides
  // `init_timeout_s`) and, with more than one process, joins the process group (a TCPStore at
  // MASTER_ADDR:MASTER_PORT, Gloo). InvalidConfig for an unusable option combination (named by
  // its train.* key) or a malformed environment; Timeout when the other ranks did not arrive.
  static StatusOr<std::unique_ptr<Accelerator>> Create(const config::TrainConfig& options,
                                                       double init_timeout_s = 300);
  // Same with an explicit DistEnv (tests).
  static StatusOr<std::unique_ptr<Accelerator>> Create(const config::TrainConfig& options,
                                                       const DistEnv& env, double init_timeout_s);
  ~Accelerator();
  Accelerator(const Accelerator&) = delete;
  Accelerator& operator=(const Accelerator&) = delete;

  // --- Where this process sits ------------------------------------------------------------
  const DistEnv& env() const { return env_; }
  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  int local_rank() const { return env_.local_rank; }
  bool IsMainProcess() const { return env_.rank == main_rank_; }
  bool IsLocalMainProcess() const { return env_.local_rank == 0; }
  const config::TrainConfig& options() const { return options_; }
  // Where this rank computes (accelerate's `accelerator.device`): cuda:LOCAL_RANK when LibTorch
  // has CUDA and the machine that GPU (unless launch --cpu), else the CPU. Prepare moves the
  // model there and prepared loaders yield their batches there; ToDevice moves others.
  torch::Device device() const { return device_; }
  torch::data::Example<> ToDevice(torch::data::Example<> batch) const;
  torch::Tensor ToDevice(const torch::Tensor& t) const;
  // The mode in effect: "none", "ddp", "local_sgd", "dp" or "pipeline".
  const char* mode_name() const;
  // Prints `line` and a newline on the main process only (rank 0; in pipeline mode the last
  // stage of the first replica, which has the loss), flushed at once.
  void Print(const std::string& line) const;

  // --- Model and optimizer -----------------------------------------------------------------
  // Hands over the user's model and optimizer (over model->parameters()). Broadcasts rank 0's
  // parameters and buffers (ddp, local_sgd), builds the reducer (ddp) or the replicas (dp:
  // model->clone(), InvalidConfig when the module is not Cloneable). Both objects stay the
  // user's; the accelerator keeps them alive. COLLECTIVE. REQUIRES: called once, before any
  // other method below, not in pipeline mode (PreparePipeline, pipeline_stages.h).
  Status Prepare(std::shared_ptr<torch::nn::Module> model,
                 std::shared_ptr<torch::optim::Optimizer> optimizer);
  // This process's stage of a pipeline: `stage` is built by the caller for stage_index()
  // (pipeline_stages.h cuts a Sequential into stages); the optimizer is over its parameters. Stages
  // start from their own weights (build them from the same seed, or load a checkpoint).
  // Gradients are all-reduced with the same stage of the other pipeline replicas. COLLECTIVE.
  // REQUIRES: options().parallel.mode == pipeline.
  Status PreparePipeline(torch::nn::AnyModule stage,
                         std::shared_ptr<torch::optim::Optimizer> optimizer);
  std::shared_ptr<torch::optim::Optimizer> optimizer() const { return optimizer_; }
  // Pipeline layout: stages per pipeline, this rank's stage, pipelines (data-parallel replicas)
  // and this rank's pipeline. 1, 0, world_size, rank outside pipeline mode.
  int num_stages() const { return stages_; }
  int stage_index() const { return stage_; }
  int data_parallel_size() const { return data_world_; }
  int data_parallel_rank() const { return data_rank_; }

  // --- Data --------------------------------------------------------------------------------
  // Shards `dataset` (any torch::data dataset: a Dataset<Self, Example<>> whose examples are
  // stacked, or a BatchDataset whose get_batch returns an Example<>) over the data-parallel
  // ranks exactly as PyTorch's DistributedSampler(seed=options().seed) does (sampler.h; in
  // file order when options().data.shuffle is false), the same number of full batches on
  // every rank (a last partial batch is dropped, as DataLoader(drop_last=True)). The loader's
  // position is part of SaveState/LoadState, and its epoch end closes an accumulation window.
  // The accelerator tracks the last loader prepared (one training loader).
  template <typename DatasetT>
  DistributedDataLoader<DatasetT> PrepareDataLoader(DatasetT dataset, int64_t batch_size);

  // --- One micro-batch ---------------------------------------------------------------------
  // How gradient all-reduces travel: "shared memory" (every rank on this host), "Gloo (why
  // not shared memory)", or "" with one process.
  std::string allreduce_transport() const;
  // Whether options().mixed_precision is bf16.
  bool bf16() const { return bf16_; }
  // Autocast for a forward pass and loss run by the caller (see the top of this file); a
  // no-op scope when mixed precision is off.
  AutocastScope Autocast() const { return AutocastScope(bf16_); }
  // Starts a micro-batch: decides whether it synchronises gradients (SyncGradients()), and
  // readies DDP (bucket rebuild, buffer broadcast on a synchronising micro-batch). Call after
  // taking the batch from the loader and before the forward pass. COLLECTIVE in ddp.
  void Accumulate();
  // Whether the current micro-batch closes the accumulation window: its gradients are (after
  // Backward) synchronised and Step() will step (accelerate's sync_gradients).
  bool SyncGradients() const { return window_closes_; }
  // Back-propagates loss / gradient_accumulation_steps; in ddp on a synchronising micro-batch
  // the gradients are averaged over the world when it returns. COLLECTIVE in ddp when synced.
  // In dp it throws c10::Error naming ForwardBackward, the only call that drives the replicas.
  void Backward(const torch::Tensor& loss);
  // Forward, loss and backward for one micro-batch in every mode, dp included: `fn(replica,
  // chunk)` returns the mean loss of `chunk` computed with `replica` (the prepared module, or
  // in dp one of the replicas on its own thread with a consecutive slice of the rows). Returns
  // the batch's mean loss (detached). Calls Accumulate() first if it was not called. In dp,
  // throws c10::Error naming train.parallel.replicas when the batch has fewer rows than replicas.
  using ChunkLoss =
      std::function<torch::Tensor(torch::nn::Module& replica, const torch::data::Example<>& chunk)>;
  torch::Tensor ForwardBackward(const torch::data::Example<>& batch, const ChunkLoss& fn);
  // The same with the module cast to the user's type: ForwardBackwardAs<NetImpl>(batch, fn).
  template <typename ModuleImpl, typename Fn>
  torch::Tensor ForwardBackwardAs(const torch::data::Example<>& batch, Fn fn) {
    return ForwardBackward(batch, [&fn](torch::nn::Module& m, const torch::data::Example<>& chunk) {
      return fn(dynamic_cast<ModuleImpl&>(m), chunk);
    });
  }
  // Pipeline mode: runs the schedule (GPipe or 1F1B) over parallel.microbatches micro-batches
  // of `batch`: the first stage feeds batch.data, the last computes `loss_fn(output, target)`
  // (a mean). Returns the batch's mean loss on the last stage, undefined elsewhere. Throws
  // c10::Error naming train.parallel.microbatches when the batch has fewer rows than that.
  torch::Tensor PipelineForwardBackward(
      const torch::data::Example<>& batch,
      const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>& loss_fn);
  // Pipeline mode, no gradients: the last stage's output for `inputs` (given on the first
  // stage; any tensor elsewhere), undefined on the other stages. COLLECTIVE within a pipeline.
  torch::Tensor PipelineForward(const torch::Tensor& inputs);
  // Pipeline mode: the mean loss of the last optimizer step over the pipeline replicas (last
  // stage; 0 elsewhere).
  double pipeline_loss() const { return pipeline_loss_; }

  // Clips the gradient norm over the whole model (all stages of a pipeline) to `max_norm`;
  // returns the norm before clipping. Correct in every mode: ddp and dp clip the reduced
  // gradients; local_sgd each replica's own. COLLECTIVE in pipeline mode.
  double ClipGradNorm(double max_norm);
  // When the current micro-batch synchronised: clips (options().max_grad_norm > 0), sets the
  // learning rate from the schedule (SetLrSchedule), steps the optimizer, zeroes the gradients,
  // counts the step and, in local_sgd, averages the parameters every K steps. Otherwise does
  // nothing. Returns whether it stepped. COLLECTIVE in local_sgd on averaging steps.
  bool Step();
  // Learning rate as a function of the optimizer steps done, applied by Step() before each
  // optimizer step. Unset: the optimizer's own learning rate is left alone.
  void SetLrSchedule(std::function<double(int64_t step)> schedule) {
    lr_schedule_ = std::move(schedule);
  }
  // The optimizer's learning rate (first parameter group).
  double learning_rate() const;
  // Optimizer steps done (restored by LoadState), and the data epoch of the next batch.
  int64_t step() const { return step_; }
  int64_t epoch() const { return cursor_ ? cursor_->epoch : 0; }
  // Micro-batches in the last optimizer step, and samples this rank took from the loader (a
  // resume at another world size restarts it at its share of the global count).
  int64_t micro_batches_last_step() const { return micro_last_step_; }
  int64_t samples_seen() const { return samples_seen_; }
  // Samples all data-parallel ranks took from the loader since the run began, across resumes
  // at any world size.
  int64_t samples_seen_global() const { return samples_seen_global_; }
  // The data-parallel world size the run started with (restored by LoadState): a program whose
  // run length is counted in steps (an LR schedule over `epochs`) counts them in that world.
  int64_t origin_data_world() const { return origin_data_world_; }
  // Where a program's LR schedule stood when the world size last changed: from step `step` on,
  // the schedule's position is position + (s - step) * slope at step s (train stretches the
  // schedule's rest over the steps the new world has left). Saved and restored with the state;
  // step -1 (the default) means the position is the step itself.
  struct ScheduleAnchor {
    int64_t step = -1;
    double position = 0;
    double slope = 1;
  };
  const ScheduleAnchor& schedule_anchor() const { return schedule_anchor_; }
  void set_schedule_anchor(const ScheduleAnchor& anchor) { schedule_anchor_ = anchor; }
  // The data-parallel world size of the checkpoint LoadState restored (0: none, or one from
  // before checkpoints recorded it): differs from data_parallel_size() after a resume at
  // another world size.
  int64_t restored_data_world() const { return restored_data_world_; }
  // Ends training: Local SGD's final average when steps were taken since the last one, and
  // SyncBuffers(). COLLECTIVE.
  Status Finish();
  // ddp: every rank takes rank 0's buffers (running statistics), so evaluation and saved
  // weights agree across ranks, as evaluating through PyTorch's DDP forward does; pipeline:
  // each stage takes its first replica's. Call before an evaluation; nothing in other modes.
  // COLLECTIVE.
  void SyncBuffers();

  // --- Across ranks ------------------------------------------------------------------------
  // Sum over all ranks, in place; returns `t`. COLLECTIVE.
  torch::Tensor& AllReduceSum(torch::Tensor& t);
  // Mean of a scalar over all ranks. COLLECTIVE.
  double Mean(double value);
  // Every rank's `t` (same shape on all), concatenated along dim 0 in rank order. COLLECTIVE.
  torch::Tensor Gather(const torch::Tensor& t);
  void Barrier();
  // accelerate's set_trigger/check_trigger: any rank raises the flag, CheckTrigger returns true
  // on every rank (and lowers it). COLLECTIVE (CheckTrigger).
  void SetTrigger() { trigger_ = true; }
  bool CheckTrigger();

  // --- Signals and state -------------------------------------------------------------------
  // Installs the process's handlers for SIGUSR1, SIGUSR2 (checkpoint and go on: what SLURM and
  // `launch` send before preemption), SIGTERM and SIGINT (checkpoint and stop). The handlers
  // only record the signal; PollSignals acts on it. Process-wide; idempotent.
  static void InstallSignalHandlers();
  // At a step boundary: what any rank received since the last poll, agreed by every rank (a
  // stop outranks a checkpoint), so all act at the same step. COLLECTIVE.
  SignalRequest PollSignals();
  // Saves the whole training state under `dir` atomically: parameters, buffers, optimizer
  // state, the step count (the LR schedule is a function of it), the loader position, and
  // every rank's RNG state. Layout: dir/step<N>/{model*.pt, rank<r>.pt}; then rank 0 points
  // dir/latest at N and removes older step folders, so a kill at any moment leaves the last
  // complete checkpoint. IoError (every rank) when any rank failed to write. COLLECTIVE.
  //
  // With options().checkpoint_async (`train.checkpoint_async`), before Finish: the state is
  // snapshotted by fork() (the child sees the memory as it was, copy-on-write) and the child
  // writes the files while training goes on; SaveState returns once the child runs. `latest`
  // moves when every rank's child is done: checked at each Step() boundary (one small
  // all-reduce while a save is pending), or waited for by WaitForCheckpoint, the next
  // SaveState and Finish. Until then the previous checkpoint stays the latest, so a kill of
  // a worker (its child dies with it) at any moment leaves the last complete one. A failed
  // background write is reported by the call that commits it (IoError naming the rank).
  Status SaveState(const std::string& dir);
  // Waits for an asynchronous save and commits it (see SaveState); Ok when none is pending.
  // COLLECTIVE.
  Status WaitForCheckpoint();
  // Checkpoints saved before Finish and the time the caller was blocked by them: in SaveState
  // and, with checkpoint_async, in waiting for a writer (WaitForCheckpoint, the next SaveState,
  // Finish) — the fork and whatever was not done by then, not the writing behind training.
  int64_t checkpoints_saved() const { return checkpoints_saved_; }
  double checkpoint_blocking_ms() const { return checkpoint_blocking_ms_; }
  // Restores what SaveState wrote under `dir` (the step named by dir/latest). Returns false when
  // there is none. Every rank loads its own RNG state; ranks agree on the step or fail with
  // Internal naming both. At another world size (logged, saying what happens):
  //   - data: the global sample position is restored and the rest of the epoch is dealt over
  //     the new ranks (sampler.h); a checkpoint from before positions were recorded restarts
  //     the data order at the next epoch instead (warned);
  //   - local_sgd: every new rank starts from the average of all the old ranks' replicas (as
  //     the final average would make them), with its own optimizer state when it had a rank,
  //     rank 0's otherwise;
  //   - RNG: a rank that has no file of its own draws a fresh stream seeded from (seed, rank,
  //     step) rather than repeating another rank's dropout masks.
  // InvalidConfig when the model or optimizer does not match, or when the checkpoint
  // was written with other run settings (ChangedSettings, each named) unless
  // options().resume_allow_changes (then they are printed). COLLECTIVE.
  StatusOr<bool> LoadState(const std::string& dir);
  // The step dir/latest names, or NotFound. Not collective.
  static StatusOr<int64_t> LatestStep(const std::string& dir);

  // A run's identity: the settings a checkpoint records (SaveState writes them to
  // step<N>/run.txt) and a resume must match. Initially config::TrajectorySettings(options());
  // a program adds what else shapes its trajectory, e.g. the length of a decaying LR schedule.
  // Adding a key again replaces its value.
  void AddRunSetting(const std::string& key, const std::string& value);
  // The recorded settings of the checkpoint in `dir` that differ from this run's, as
  // "key: old -> new" (also keys only one side has); empty when they match, when there is no
  // checkpoint, or when it predates run.txt. Not collective.
  std::vector<std::string> ChangedSettings(const std::string& dir) const;
  // Writes the prepared model for PyTorch in Python to `path` (rank 0 writes, atomically): a
  // TorchScript module as itself with its current weights (torch.jit.load), any other module as
  // a dict of parameter and buffer names to tensors (torch.load, then load_state_dict into the
  // same architecture in Python). ddp first makes rank 0's buffers every rank's. Not in
  // pipeline mode (InvalidArgument). IoError naming the path. COLLECTIVE.
  Status SaveForPython(const std::string& path);

  // --- Internal, for `train` and tests -----------------------------------------------------
  // All-reduces issued since the last call (communication per optimizer step), the time the
  // loop waited on communication, and buckets launched during backward (ddp overlap).
  struct CommStats {
    int64_t allreduces = 0;
    int64_t reduce_scatters = 0;  // zero
    int64_t allgathers = 0;       // zero
    double blocking_comm_ms = 0;
    int64_t launched_before_grads_done = 0;
  };
  CommStats TakeCommStats();
  int64_t num_buckets() const;
  int64_t allreduces_total() const;
  int64_t pair_exchanges_total() const;
  // zero's collectives over the run: gradient reduce-scatters and parameter all-gathers.
  int64_t reduce_scatters_total() const;
  int64_t allgathers_total() const;
  // Bytes of parameters, gradients and optimizer state this rank holds ({parameters,
  // gradients, optimizer}; zero: its shards).
  std::vector<int64_t> StateBytes() const;
  PipelineEngine* pipeline() const { return pipeline_.get(); }
  // dp only: DataParallel's gather-then-loss (parallel.loss_in_replica false): replicas run
  // TensorForward (model.h) and `criterion(outputs, targets)` runs once on the gathered outputs.
  void SetDpCriterion(
      std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> criterion) {
    criterion_ = std::move(criterion);
  }
  CountingProcessGroup* process_group() const { return pg_.get(); }
  // The prepared model's trainable parameters (requires grad, each once) and its view.
  std::vector<torch::Tensor> parameters() const;
  Model* model() const { return model_.get(); }
  // Stages x fields of PipelineEngine::Stats from replica 0 of every stage, on every rank.
  // COLLECTIVE.
  std::vector<double> GatherPipelineStats(uint64_t checksum);

 private:
  Accelerator(const config::TrainConfig& options, const DistEnv& env);
  void AttachCursor(std::shared_ptr<LoaderCursor> cursor);
  std::string StageFileName() const;  // pipeline: this stage's model file in a checkpoint
  void SetLayout(const ParallelLayout& layout);
  void LoadTrainState(const TrainState& state);  // LoadState: step, counters, cursor
  TrainState CurrentTrainState() const;          // SaveState: what rank<r>.pt holds
  // Writes this rank's files of a checkpoint into `step_dir` (model and rank state).
  Status WriteStateFiles(const std::string& step_dir, const TrainState& state);
  // Every rank learns whether every rank wrote its files (`status` is this rank's); then rank 0
  // points dir/latest at `step`. COLLECTIVE.
  Status CommitState(const std::string& dir, int64_t step, const Status& status);
  // checkpoint_async: forks the child that writes this rank's files (WriteStateFiles).
  Status ForkStateWriter(const std::string& step_dir, const TrainState& state);
  // Waits for the writer (`block`) or checks whether it ended; once it has, writer_pid_ is -1
  // and a failure is in writer_status_.
  void ReapStateWriter(bool block);
  // At a step boundary with a save pending: commits it when every rank's writer is done.
  // COLLECTIVE.
  void PollPendingSave();
  c10d::ProcessGroup* control() const;
  void CountSamples(int64_t n) {
    samples_seen_ += n;
    samples_seen_global_ += n * data_world_;
  }
  // LAUNCH_TRACE_SAMPLES (tests): appends "step epoch position:index ..." for a batch to
  // <path>.rank<r>. A no-op when the variable is unset.
  void TraceBatch(int64_t epoch, const std::vector<int64_t>& positions,
                  const std::vector<int64_t>& indices);
  bool tracing() const { return trace_fd_ >= 0; }
  template <typename DatasetT>
  friend class DistributedDataLoader;

  config::TrainConfig options_;
  DistEnv env_;
  int main_rank_ = 0;
  int stages_ = 1, stage_ = 0, data_world_ = 1, data_rank_ = 0;
  c10::intrusive_ptr<CountingProcessGroup> pg_;
  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<Model> model_;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<ParallelStrategy> strategy_;
  std::unique_ptr<PipelineEngine> pipeline_;
  std::shared_ptr<LoaderCursor> cursor_;
  std::function<double(int64_t)> lr_schedule_;
  bool prepared_ = false;
  bool bf16_ = false;  // options_.mixed_precision == "bf16"
  torch::Device device_ = torch::kCPU;
  void EndMicroBatch();
  void WriteTimeline();  // Finish(): per-rank files, merged by rank 0

  bool in_micro_ = false;       // Accumulate() called, Backward not yet
  bool sync_ = true;            // this micro-batch communicates gradients (ddp)
  bool window_closes_ = false;  // this micro-batch ends the accumulation window
  double window_loss_ = 0;      // pipeline: loss summed over the window's micro-batches
  double pipeline_loss_ = 0;
  int64_t pipeline_allreduces_seen_ = 0;
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> criterion_;
  int64_t micro_in_window_ = 0;
  int64_t micro_last_step_ = 0;
  int64_t step_ = 0;
  int64_t samples_seen_ = 0;
  int64_t samples_seen_global_ = 0;
  int64_t origin_data_world_ = 1;    // data_world_ until LoadState
  int64_t restored_data_world_ = 0;  // LoadState
  ScheduleAnchor schedule_anchor_;
  int64_t resharded_from_ = 0;  // LoadState at another world size: the old data world
  int trace_fd_ = -1;           // LAUNCH_TRACE_SAMPLES
  bool trigger_ = false;
  bool finished_ = false;  // Finish() ran: saves are synchronous
  // checkpoint_async: a save not committed yet, its folder and step, its writer (the child,
  // -1 once reaped) and how that went; a commit that failed at a step boundary, not returned.
  bool save_pending_ = false;
  std::string pending_dir_;
  int64_t pending_step_ = 0;
  int writer_pid_ = -1;
  Status writer_status_ = Status::Ok();
  Status save_error_ = Status::Ok();
  int64_t checkpoints_saved_ = 0;
  double checkpoint_blocking_ms_ = 0;
  std::optional<LoaderCursor> restored_cursor_;  // LoadState before PrepareDataLoader
  std::vector<std::pair<std::string, std::string>> run_settings_;  // AddRunSetting
};

// A data loader over this rank's shard (Accelerator::PrepareDataLoader). Batches are taken on
// the calling thread, in sampler order; `Epoch(e)` iterates epoch e from the restored position
// (or its start), `Next()` runs on across epochs.
template <typename DatasetT>
class DistributedDataLoader {
 public:
  DistributedDataLoader(Accelerator* accel, DatasetT dataset, int64_t batch_size)
      : accel_(accel),
        dataset_(std::move(dataset)),
        batch_size_(batch_size),
        sampler_(static_cast<int64_t>(dataset_.size().value()), accel->data_parallel_rank(),
                 accel->data_parallel_size(), batch_size, accel->options().seed,
                 accel->options().data.shuffle),
        cursor_(std::make_shared<LoaderCursor>()) {
    cursor_->batches_per_epoch = sampler_.batches_per_epoch();
    cursor_->batches_this_epoch = cursor_->batches_per_epoch;
    cursor_->num_samples = sampler_.num_samples();
    cursor_->global_batch = batch_size * accel->data_parallel_size();
    accel_->AttachCursor(cursor_);
  }

  // Full batches per epoch on this rank (0 when the shard is smaller than one batch); an epoch
  // taken over by a resume at another world size has cursor().batches_this_epoch.
  int64_t batches_per_epoch() const { return cursor_->batches_per_epoch; }
  int64_t batch_size() const { return batch_size_; }
  const DatasetT& dataset() const { return dataset_; }
  const LoaderCursor& cursor() const { return *cursor_; }

  // The next batch, moving to the next epoch after the last one.
  // REQUIRES: batches_per_epoch() > 0.
  torch::data::Example<> Next() {
    std::vector<int64_t> places;
    std::vector<int64_t> positions = sampler_.Batch(cursor_->epoch, cursor_->batch, cursor_->start,
                                                    accel_->tracing() ? &places : nullptr);
    if (accel_->tracing()) accel_->TraceBatch(cursor_->epoch, places, positions);
    std::vector<size_t> indices(positions.begin(), positions.end());
    cursor_->last_was_end = ++cursor_->batch == cursor_->batches_this_epoch;
    if (cursor_->last_was_end) cursor_->StartEpoch(cursor_->epoch + 1);
    accel_->CountSamples(static_cast<int64_t>(indices.size()));
    return accel_->ToDevice(Fetch(indices));
  }

  // Range over the rest of epoch `e` (all of it unless the loader was restored into it).
  class EpochRange {
   public:
    class Iterator {
     public:
      Iterator(DistributedDataLoader* loader, int64_t left) : loader_(loader), left_(left) {}
      torch::data::Example<>& operator*() { return current_; }
      Iterator& operator++() {
        --left_;
        return *this;
      }
      bool operator!=(const Iterator& other) const {
        if (left_ == other.left_) return false;
        current_ = loader_->Next();  // fetched when the loop asks whether to go on
        return true;
      }

     private:
      DistributedDataLoader* loader_;
      int64_t left_;
      mutable torch::data::Example<> current_;  // filled by operator!= (range-for asks it first)
    };
    EpochRange(DistributedDataLoader* loader, int64_t left) : loader_(loader), left_(left) {}
    Iterator begin() { return Iterator(loader_, left_); }
    Iterator end() { return Iterator(loader_, 0); }

   private:
    DistributedDataLoader* loader_;
    int64_t left_;
  };
  EpochRange Epoch(int64_t e) {
    if (cursor_->epoch != e) cursor_->StartEpoch(e);
    return EpochRange(this, cursor_->batches_this_epoch - cursor_->batch);
  }

 private:
  template <typename D>
  static constexpr bool kReturnsExample =
      std::is_same_v<typename D::BatchType, torch::data::Example<>>;

  torch::data::Example<> Fetch(const std::vector<size_t>& indices) {
    if constexpr (kReturnsExample<DatasetT>) {
      return dataset_.get_batch(indices);
    } else {
      return torch::data::transforms::Stack<>().apply_batch(dataset_.get_batch(indices));
    }
  }

  Accelerator* accel_;
  DatasetT dataset_;
  int64_t batch_size_;
  ShardedSampler sampler_;
  std::shared_ptr<LoaderCursor> cursor_;
};

template <typename DatasetT>
DistributedDataLoader<DatasetT> Accelerator::PrepareDataLoader(DatasetT dataset,
                                                               int64_t batch_size) {
  return DistributedDataLoader<DatasetT>(this, std::move(dataset), batch_size);
}

}  // namespace launch::trainer
