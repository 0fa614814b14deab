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
// Backward replaces a ported loop's own loss.backward(): a plain backward() is not synchronised
// (each rank would train on its own; Step refuses it in ddp and zero). The loop's
// optimizer.zero_grad() may stay, with or without set_to_none: Step zeroes the gradients
// anyway, and under ddp and ZeRO stage 1 they are plain aliases of the buckets (not views), which
// zero_grad can detach and zero in place.
//
// Mixed precision (options.mixed_precision, the top-level `mixed_precision` key): `bf16` is
// autocast to bfloat16 on the rank's device, as torch.autocast("cpu" or "cuda", torch.bfloat16):
// matmuls and convolutions run in bfloat16 while parameters, gradients, optimizer state and the
// loss stay float32, and gradients are communicated as float32. ForwardBackward,
// PipelineForwardBackward and PipelineForward apply it themselves; a loop that calls its model
// directly puts the forward pass and the loss inside an AutocastScope:
//   { auto amp = accel->Autocast(); loss = criterion(model(batch.data), batch.target); }
//   accel->Backward(loss);
// `fp16` autocasts to float16 the same way (on CUDA, or on a CPU with LibTorch 2.x) with
// dynamic loss scaling, as torch.amp.GradScaler with accelerate: Backward multiplies the loss
// by loss_scale(); Step (or ClipGradNorm on the micro-batch that closes the window, once per
// step) divides the gradients by it, and a step
// whose gradients hold inf or nan anywhere (the ranks that split them agree: the strategy's
// gradient norm) is skipped: no optimizer step, the gradients dropped, the scale halved,
// step_was_skipped() true; after options().grad_scaler.growth_interval clean steps the scale
// doubles (model/loss_scaler.h). A skipped step still counts in step() (the data moved on) but
// not in the LR schedule, which is evaluated at step() - skipped_steps() as accelerate's
// scheduler skips with the optimizer. The scaler's state is in checkpoints and snapshots. With
// several prepared models each Step(model) decides for its own gradients and updates the scale.
// `fp8` is refused (InvalidConfig).
//
// Where a worker sits comes from the environment (torchrun's contract: RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT; OpenMPI's and SLURM's spellings as fallbacks, see env.h), so the
// same binary runs under `launch`, torchrun, srun and mpirun; without them it is one process.
//
// Modes: the parallel layout (options.parallel.stages and .tensor; layout()) places this rank on
// the tensor, data and stage axes, and options.parallel.mode is the strategy of the data axis
// (the same `train:` YAML keys `train` reads, config/train_config.h; docs/trainer.md has each):
//   none       no communication (each replica trains alone);
//   ddp        rank 0's parameters and buffers broadcast by Prepare; gradients through c10d's
//              Reducer (buckets in reverse parameter order, each all-reduced during backward),
//              averaged over the data-parallel ranks; frozen parameters left out, tied ones
//              counted once; parallel.find_unused_parameters as PyTorch's; rank 0's buffers
//              every rank's before each forward that follows a synchronised one
//              (broadcast_buffers), and at Finish / SyncBuffers;
//   local_sgd  (local_sgd_steps K > 0 with ddp) no gradient communication: parameters and
//              floating-point buffers averaged every K optimizer steps and by Finish(); with
//              options.local_sgd.outer nesterov, DiLoCo's outer step (parallel/local_sgd.h);
//   zero       ddp with optimizer state, gradients and parameters sharded (parallel/zero.h);
//   dp         `parallel.replicas` replicas in this process, one thread each (ForwardBackward);
//              needs a torch::nn::Cloneable module; BatchNorm statistics are each chunk's
//              unless parallel.sync_batchnorm shares them (model/sync_batchnorm.h);
//   stages > 1 (or mode pipeline: ddp over pipeline replicas) this process is one stage of a
//              pipeline (PreparePipeline, pipeline_stages.h) and the data strategy runs over
//              the same stage of the other replicas.
// Accumulation (gradient_accumulation_steps N): the all-reduce is skipped on all but the last
// micro-batch of each window (sync_each_batch turns that off); the window also closes at the end
// of the data (sync_with_dataloader); Backward divides the loss by N; Step only steps on a
// micro-batch that synchronised. A window the end of the data cut short (k < N micro-batches)
// is divided by N too, as accelerate's backward divides by gradient_accumulation_steps
// whatever is left: its step gets k/N of the gradient of its mean loss.
//
// Thread-safety: none. One thread (the training loop) makes every call. Collective calls
// (marked COLLECTIVE) must be made by every rank in the same order, as with c10d.
//
// Dead peers: a collective whose peer died throws c10::Error from inside LibTorch, or returns
// PeerLost where the method returns a Status. A program run by `launch` may just let it
// propagate: the agent stops the siblings and, with --max_restarts, restarts everyone, and
// LoadState resumes from the last checkpoint.
//
// In-place recovery (`launch --recover in_place --max_restarts N`, which sets LAUNCH_RECOVER;
// every mode but none, under any layout): a lost peer costs the step in flight, not
// the run. After a collective failed because a peer is gone, every later collective call does
// nothing until Step(), which waits for the replacement the agent starts (up to the init timeout),
// forms a new group with it, and makes every rank take the state of the live rank furthest
// along (lowest rank among equals) at its last step boundary: parameters, optimizer state,
// step, LR-schedule anchor and data position; each survivor keeps its own buffers of that
// boundary, a replacement takes that rank's. The abandoned step's gradients are dropped, no
// checkpoint is read, and the loader serves that step's batches again: Step() returns false,
// redo() true, and the loop redoes the step unchanged. A replacement
// (LAUNCH_RECOVER_GENERATION > 0) receives the state in Prepare; LoadState then reads nothing.
// With recovery on, the CPU generator is reseeded at every micro-batch from (seed, rank, step,
// micro-batch), which a replacement re-derives. A checkpoint whose commit a lost peer
// interrupted is skipped. A replacement that does not come in time, or any other failure
// while recovering, throws c10::Error from Step(): the agent then restarts everyone. Limits:
// buffers are rank 0's running statistics (broadcast_buffers); when rank 0 is the one lost,
// its buffers' last updates are lost with it and another rank's are taken.
// zero (stages 1-3) and Local SGD/DiLoCo, every pipeline (PreparePipeline) and every layout
// with a tensor axis keep state that exists on one rank alone (or on its data replicas): they
// recover from snapshots instead; the layout's groups are re-formed with the world's (the
// tensor group the layers hold goes on over its new group). Every
// options().recover_snapshot_every steps (and before the first) each rank's state is imaged by a
// forked child and exchanged with its keeper while training goes on; after a loss every rank goes
// back to the newest snapshot all hold (the replacement to its keeper's copy) and Step() returns
// false with redo() true as above, the loader then serving the batches of every step since that
// snapshot again. A rank lost with its keeper, or a loss seen only in Finish, throws: the agent
// restarts everyone.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "base/status.h"
#include "config/train_config.h"
#include "trainer_runtime/api/loader_cursor.h"
#include "trainer_runtime/data/sampler.h"
#include "trainer_runtime/model/autocast.h"
#include "trainer_runtime/model/loss_scaler.h"
#include "trainer_runtime/model/tensor_parallel.h"
#include "trainer_runtime/util/env.h"

namespace c10d {  // c10d's process group and store, held by pointer
class ProcessGroup;
class Store;
}  // namespace c10d

namespace launch::trainer {

class CountingProcessGroup;
class EventFileWriter;
class LossWatch;
class Model;
class ParallelLayout;
class ParallelStrategy;
class Platform;
struct SnapshotImage;
struct TrainState;

// What the ranks agreed on at a step boundary (Accelerator::PollSignals).
struct SignalRequest {
  int signal = 0;           // the signal that asked (SIGUSR1, SIGTERM, ...), 0 = none
  bool checkpoint = false;  // SIGUSR1/SIGUSR2/SIGTERM/SIGINT: save state now
  bool stop = false;        // SIGTERM/SIGINT: then stop (exit 143)
};

template <typename DatasetT>
class DistributedDataLoader;
template <typename DatasetT>
class EvalDataLoader;

class Accelerator {
 public:
  // Makes stdout line-buffered (a worker's stdout is a pipe: each printed line reaches the
  // agent as it is printed). Reads DistEnv from this process's environment (LAUNCH_INIT_TIMEOUT_S
  // overrides `init_timeout_s`) and, with more than one process, joins the process group (a
  // TCPStore at MASTER_ADDR:MASTER_PORT, Gloo). InvalidConfig for an unusable option combination
  // (named by its train.* key) or a malformed environment; Timeout when the others did not come.
  // Once formed, a collective waits `options.collective_timeout_s` for a peer before it fails.
  // The process keeps the memory a step frees for the next step (util/allocator.h; opt out with
  // LAUNCH_KEEP_FREED_MEMORY=0). With parallel.tensor > 1 it also forms the tensor group.
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
  bool IsMainProcess() const;
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
  // TensorBoard, as accelerate's log(values, step): on the main process, one event at `step`
  // holding `values` (tag, value; e.g. {"train/loss", 0.52}) appended to an event file in
  // options().output_dir/tensorboard/ (made on the first call; `tensorboard --logdir` reads
  // it); nothing on the other ranks. IoError naming the file. (state/tensorboard.h)
  Status Log(const std::vector<std::pair<std::string, double>>& values, int64_t step);

  // --- Model and optimizer -----------------------------------------------------------------
  // Hands over the user's model and optimizer (over model->parameters()). Broadcasts rank 0's
  // parameters and buffers (ddp, local_sgd), builds the reducer (ddp) or the replicas (dp:
  // model->clone(), InvalidConfig when the module is not Cloneable). Both objects stay the
  // user's; the accelerator keeps them alive. COLLECTIVE. REQUIRES: called before any other
  // method below, not in pipeline mode (PreparePipeline, pipeline_stages.h).
  // May be called again for more (model, optimizer) pairs (a GAN's generator and
  // discriminator, a student and a teacher): each pair gets its own strategy (its own reducer
  // in ddp); the module itself names the pair in later calls (Step(model), NoSync(model),
  // ZeroGrad(model)); see "Several models" below. The first pair is the one optimizer(),
  // parameters(), model(), ClipGradNorm and SaveForPython refer to. InvalidConfig for a second
  // pair in dp (its replicas run one module's forward) or pipeline mode, and for a module
  // prepared twice.
  Status Prepare(std::shared_ptr<torch::nn::Module> model,
                 std::shared_ptr<torch::optim::Optimizer> optimizer);
  // This process's stage of a pipeline: `stage` is built by the caller for stage_index()
  // (pipeline_stages.h cuts a Sequential into stages); the optimizer is over its parameters.
  // The data strategy (parallel.mode) runs over the same stage of the other replicas: under ddp
  // and zero they start from the first replica's weights. COLLECTIVE.
  // REQUIRES: options().parallel.pipelined() (stages > 1, or mode pipeline).
  Status PreparePipeline(torch::nn::AnyModule stage,
                         std::shared_ptr<torch::optim::Optimizer> optimizer);
  // The same with this rank's chunks of an interleaved pipeline (parallel.schedule
  // interleaved_1f1b, virtual_stages v): chunks stage_index() + k x num_stages() for k < v, in
  // that order (pipeline_stages.h: JoinChunks, whose parameters the optimizer is over).
  // InvalidConfig when their number is not parallel.virtual_stages.
  Status PreparePipeline(std::vector<torch::nn::AnyModule> chunks,
                         std::shared_ptr<torch::optim::Optimizer> optimizer);
  std::shared_ptr<torch::optim::Optimizer> optimizer() const { return optimizer_; }
  // Stages per pipeline, this rank's stage; data-parallel ranks (replicas), this rank's replica.
  int num_stages() const;
  int stage_index() const;
  int data_parallel_size() const;
  int data_parallel_rank() const;
  // Where this rank sits on every axis (tensor, data, stage), its groups and neighbours
  // (trainer_runtime/parallel/layout.h, internal: include it to use the result).
  const ParallelLayout& layout() const;
  // The ranks that split this rank's tensor-parallel layers (model/tensor_parallel.h: build them
  // with it; train.parallel.tensor > 1); null when nothing is split. Gradients of the layers'
  // shards are then reduced over the data axis only, clipping counts each shard once.
  const TensorGroupPtr& tensor_group() const { return tensor_group_; }
  // The ranks that split this rank's sequences (train.parallel.context > 1; null otherwise):
  // build the attention layers with it (tensor_parallel.h: AllToAllRegion), and feed the model
  // ContextShard of each batch. Its ranks see the same rows and average their gradients with
  // the data axis' (the replica group); the loss each reports is its part's.
  const TensorGroupPtr& context_group() const { return context_group_; }
  // This rank's part of a batch of sequences along dimension `dim` (tokens and targets [B, S]):
  // the context rank's 1/context of it, in order. `t` itself without a context group or when it
  // has no dimension `dim`. ForwardBackward feeds `fn` these parts itself. c10::Error naming
  // train.parallel.context when the dimension does not split.
  torch::Tensor ContextShard(const torch::Tensor& t, int64_t dim = 1) const;

  // --- Several models (a GAN, a teacher and a student) ----------------------------------------
  // With more than one prepared pair, Backward(loss) walks loss's autograd graph to the
  // parameters it reaches (their AccumulateGrad nodes) and arms exactly the reducers of the
  // models found there, as PyTorch's DDP arms a module's reducer when its forward ran: our API
  // cannot see a LibTorch module's forward, but the graph records which modules took part, so a
  // loss names its models without the caller listing them (and cannot list them wrongly). The
  // ranks compare what they found (one small all-reduce): a loss that reaches a model on one
  // rank but not on another is an error naming the model, not a hang in a mismatched
  // all-reduce. A model whose parameters the loss does not reach (fake.detach() in a GAN's
  // discriminator step, or a model with requires_grad_(false) for the step) is left alone.
  //
  // The GAN loop, each model stepped by its own optimizer:
  //   accel->Accumulate();                               // one call per iteration (REQUIRED)
  //   auto fake = G(noise);
  //   accel->ZeroGrad(*D);                               // drop what G's last loss left in D
  //   accel->Backward(bce(D(real), 1) + bce(D(fake.detach()), 0));   // reaches D only
  //   accel->Step(*D);
  //   accel->Backward(bce(D(fake), 1));                  // reaches G and D (both all-reduced)
  //   accel->Step(*G);                                   // D keeps the gradient: ZeroGrad above
  // One Accumulate() opens an iteration (a micro-batch) in which several Backward and Step(m)
  // calls may follow; a Backward whose models all stepped already in this iteration means the
  // next iteration began without Accumulate() and is an error (CheckError) saying so.
  // Accumulation windows, the LR schedule (applied to every stepped optimizer) and the step
  // count are shared: step() counts iterations whose window closed, once however many models
  // stepped in it. Checkpoints hold every pair: the first under today's file names (model.pt,
  // ...), pair i (i >= 1) the same names in the folder pair<i>/.
  //
  // Steps `model`'s optimizer when the current micro-batch closes the accumulation window and
  // the model's gradients were synchronised (not inside its NoSync scope), then zeroes its
  // gradients in place (clipping first with options().max_grad_norm). Returns whether it
  // stepped; false also when the model already stepped in this micro-batch. CheckError when
  // `model` was not prepared.
  bool Step(const torch::nn::Module& model);
  // Zeroes `model`'s gradients in place, as its optimizer's zero_grad(false) would (both are
  // safe under ddp, see the top of this file); named by the model, for gradients a loss left
  // in a model it did not step (the discriminator, after the generator's step). CheckError
  // when `model` was not prepared.
  void ZeroGrad(const torch::nn::Module& model);
  // DDP's no_sync() for one model: while the scope lives, Backward leaves `model`'s gradients
  // local (no all-reduce; they accumulate) and Step does not step it; the first Backward after
  // the scope synchronises the sum. Independent of Accumulate's windows, which still decide
  // for the other models (and for this one outside the scope). Scopes nest. Every rank must
  // open and close it at the same micro-batches (otherwise the all-reduces mismatch).
  class NoSyncScope {
   public:
    NoSyncScope(NoSyncScope&& other) noexcept : count_(other.count_) { other.count_ = nullptr; }
    NoSyncScope(const NoSyncScope&) = delete;
    NoSyncScope& operator=(const NoSyncScope&) = delete;
    NoSyncScope& operator=(NoSyncScope&&) = delete;
    ~NoSyncScope() {
      if (count_) --*count_;
    }

   private:
    friend class Accelerator;
    explicit NoSyncScope(int* count) : count_(count) { ++*count_; }
    int* count_;  // the pair's open scopes (held by the Accelerator, which outlives the scope)
  };
  [[nodiscard]] NoSyncScope NoSync(const torch::nn::Module& model);

  // --- Order, seeds and user state -----------------------------------------------------------
  // accelerate's main_process_first(): the main process (rank 0) runs the block first, the
  // others run it once rank 0 left its scope (a data set download or cache built once, then
  // read by all). LocalMainProcessFirst: local rank 0 of every machine first. Made of two
  // barriers (COLLECTIVE: every rank opens and closes one). A barrier that fails in the
  // destructor (a peer died) is reported on stderr and not thrown; the next collective fails.
  class MainFirstScope {
   public:
    MainFirstScope(MainFirstScope&& other) noexcept : accel_(other.accel_), first_(other.first_) {
      other.accel_ = nullptr;
    }
    MainFirstScope(const MainFirstScope&) = delete;
    MainFirstScope& operator=(const MainFirstScope&) = delete;
    MainFirstScope& operator=(MainFirstScope&&) = delete;
    ~MainFirstScope();

   private:
    friend class Accelerator;
    MainFirstScope(Accelerator* accel, bool first);
    Accelerator* accel_;  // null once moved from
    bool first_;          // this rank runs the block first
  };
  [[nodiscard]] MainFirstScope MainProcessFirst();
  [[nodiscard]] MainFirstScope LocalMainProcessFirst();
  // accelerate's set_seed: seeds LibTorch's CPU generator and every CUDA generator (present or
  // not) with `seed`, or with seed + rank() when device_specific (each rank draws its own
  // stream: dropout, noise for a GAN). Not collective.
  void SetSeed(uint64_t seed, bool device_specific = false);
  // State of the user's saved and restored with SaveState/LoadState besides the prepared
  // pairs: a torch::nn::Module (an EMA copy of the model: its parameters and buffers) or any
  // object with `void save(torch::serialize::OutputArchive&) const` and
  // `void load(torch::serialize::InputArchive&)` (a step counter, a sampler's position). Every
  // rank writes its own (step<N>/user_rank<r>.pt; a rank the checkpoint has none for reads
  // rank 0's). Registration order is the identity: LoadState fails with InvalidConfig when the
  // checkpoint holds another number or kind of objects, or an object's load throws (named by
  // its position). REQUIRES: `obj` outlives the last SaveState/LoadState.
  template <typename T>
  void RegisterForCheckpointing(T& obj) {
    constexpr bool kModule = std::is_base_of_v<torch::nn::Module, T>;
    user_state_.push_back({kModule, [&obj](torch::serialize::OutputArchive& a) { obj.save(a); },
                           [&obj](torch::serialize::InputArchive& a) { obj.load(a); }});
  }

  // --- Data --------------------------------------------------------------------------------
  // Shards `dataset` (any torch::data dataset: a Dataset<Self, Example<>> whose examples are
  // stacked, or a BatchDataset whose get_batch returns an Example<>) over the data-parallel
  // ranks exactly as PyTorch's DistributedSampler(seed=options().seed) does (sampler.h; in
  // file order when options().data.shuffle is false), the same number of full batches on
  // every rank (a last partial batch is dropped, as DataLoader(drop_last=True)). The first
  // loader prepared is the training loader: its position is part of SaveState/LoadState, its
  // epoch end closes an accumulation window and it is epoch(); any other loader has its own
  // position and changes nothing here (data_loader.h). For evaluation see PrepareEvalLoader.
  template <typename DatasetT>
  DistributedDataLoader<DatasetT> PrepareDataLoader(DatasetT dataset, int64_t batch_size);

  // --- One micro-batch ---------------------------------------------------------------------
  // How gradient all-reduces travel: "shared memory" (every rank on this host), "Gloo (why
  // not shared memory)", or "" with one process.
  std::string allreduce_transport() const;
  bool bf16() const;  // autocast to bfloat16 (mixed_precision bf16)
  bool fp16() const;  // autocast to float16 with loss scaling (mixed_precision fp16)
  // fp16: the factor Backward multiplies the loss by; 1 otherwise.
  double loss_scale() const;
  // fp16: the last stepping Step() found inf or nan gradients and skipped the optimizer step
  // (accelerate's optimizer_step_was_skipped); and how many steps the run skipped so far.
  bool step_was_skipped() const { return step_skipped_; }
  int64_t skipped_steps() const;
  // Autocast for a forward pass and loss run by the caller (see the top of this file), on this
  // rank's device type; a no-op scope when mixed precision is off.
  AutocastScope Autocast() const;
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
  // the batch's mean loss (detached). With a context group, `fn` gets this rank's part of each
  // sequence (ContextShard of data and target) and the mean over the group is returned (an
  // all-reduce of one value over the context group). Calls Accumulate() first if it was not called.
  // In dp, throws c10::Error naming train.parallel.replicas when the batch has fewer rows than
  // replicas.
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
  using CriterionFn = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>;
  torch::Tensor PipelineForwardBackward(const torch::data::Example<>& batch,
                                        const CriterionFn& loss_fn);
  // Pipeline mode, no gradients: the last stage's output for `inputs` (given on the first
  // stage; any tensor elsewhere), undefined on the other stages. COLLECTIVE within a pipeline.
  torch::Tensor PipelineForward(const torch::Tensor& inputs);
  // The mean of `loss` over the ranks that compute a loss (every rank; in a pipeline its last
  // stages): the others' values are ignored. COLLECTIVE.
  double MeanLoss(double loss);

  // Clips the gradient norm over the whole model (all stages of a pipeline) to `max_norm`;
  // returns the norm before clipping: the reduced gradients' (local_sgd: each replica's own).
  // COLLECTIVE in a pipeline and under zero.
  double ClipGradNorm(double max_norm);
  // When the current micro-batch synchronised: clips (options().max_grad_norm > 0), sets the
  // learning rate from the schedule (SetLrSchedule), steps the optimizer, zeroes the gradients,
  // counts the step and, in local_sgd, averages the parameters every K steps. Otherwise does
  // nothing. Returns whether it stepped. COLLECTIVE in local_sgd on averaging steps.
  // With several prepared models: steps every model a Backward reached since its last step
  // (every model when none was reached) that synchronised and did not step in this
  // micro-batch; Step(model) steps one (see "Several models").
  // REQUIRES in ddp and zero at world size > 1: the gradients come from Backward,
  // ForwardBackward or PipelineForwardBackward. A Step with no such call since the last step
  // while the parameters have non-zero gradients (a loop that kept its loss.backward()) fails
  // a CHECK naming the fix on every rank, instead of letting the replicas drift apart.
  // With in-place recovery, after a peer was lost during the step: recovers (see the top of this
  // file; COLLECTIVE with the replacement), returns false and redo() is true.
  bool Step();
  // Whether the last Step() abandoned the step in flight after recovering from a lost peer:
  // the loader serves that step's batches again and the step's losses so far are void.
  bool redo() const { return redo_; }
  // In-place recovery is on for this process (LAUNCH_RECOVER=in_place and a mode that supports
  // it; known after Prepare).
  bool recovers_in_place() const { return recover_; }
  // This process is a replacement that received the run's state from a live peer in Prepare.
  bool joined_from_peer() const { return joined_from_peer_; }
  // Recoveries this process took part in (as a survivor or as the replacement).
  // In-place recoveries in the run so far (a replacement takes the count from the rank that
  // hands it the state).
  int64_t recoveries() const { return recoveries_; }
  // The run's clock, kept over in-place recoveries (every rank takes the one of the rank that
  // hands out the state, so a replacement's says when the run began, not when it did): when the
  // run's first process created its Accelerator and when its training loop began (Unix ms; 0
  // until MarkLoopStart), and the step the loop began at. For outputs that describe the whole
  // run (final.json's wall_s, loop_s, steps_this_run).
  struct RunClock {
    int64_t started_unix_ms = 0;
    int64_t loop_started_unix_ms = 0;
    int64_t loop_first_step = 0;
  };
  const RunClock& run_clock() const { return run_clock_; }
  // The training loop begins now, at step(); a no-op once the clock has a loop start (one taken
  // over from a peer included).
  void MarkLoopStart();
  // LR schedules, applied by Step() before each optimizer step, as functions of the optimizer
  // steps done (0 for the first step). Unset: the optimizer's own learning rates are left
  // alone. A later call replaces the schedule set before.
  //
  // PyTorch's LambdaLR: every parameter group's rate is its own base rate times `factor(step)`
  // (lr_g = base_lr_g * factor(step)), the base rates being the groups' rates when the model
  // was prepared (Prepare / PreparePipeline; a LoadState does not change them). A slower
  // embedding or backbone group keeps its ratio to the others.
  void SetLrLambda(std::function<double(int64_t step)> factor) {
    lr_schedule_ = std::move(factor);
    lr_is_factor_ = true;
  }
  // An absolute learning rate: every parameter group's rate becomes `schedule(step)`, whatever
  // it was (for an optimizer whose groups share one rate, as `train`'s; per-group rates want
  // SetLrLambda).
  void SetLrSchedule(std::function<double(int64_t step)> schedule) {
    lr_schedule_ = std::move(schedule);
    lr_is_factor_ = false;
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
  // The per-rank batch size of that world (options().batch_size unless LoadState restored
  // another): with origin_data_world, the global batch the run's length was counted in.
  int64_t origin_batch_size() const { return origin_batch_size_; }
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
  // SyncBuffers(); then, in ddp and local_sgd, checks that every rank holds the same
  // parameters (their checksum, final.json's param_checksum): Internal naming the ranks whose
  // parameters differ from rank 0's. COLLECTIVE. An error is also written to stderr
  // ("train: rank R: ..."), for programs that only test ok().
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
  // Every rank's `t`, concatenated along dim 0 in rank order; the first dimension may differ
  // between ranks (GatherList). COLLECTIVE.
  torch::Tensor Gather(const torch::Tensor& t);
  void Barrier();
  // accelerate's set_trigger/check_trigger: any rank raises the flag, CheckTrigger returns true
  // on every rank (and lowers it). COLLECTIVE (CheckTrigger).
  void SetTrigger() { trigger_ = true; }
  bool CheckTrigger();

  // --- Evaluation, held objects and collectives of any shape ---------------------------------
  // Prepare for a module and optimizer held by value, as most LibTorch programs hold them
  // (`Net model; torch::optim::SGD opt(model->parameters(), ...); accel->Prepare(model, opt)`):
  // the module is shared with `model` (a ModuleHolder holds a shared_ptr), the optimizer is NOT
  // owned: REQUIRES: `optimizer` outlives every call on this accelerator that steps, saves or
  // loads it (Step, SaveState, LoadState, Finish), and the accelerator's destruction.
  template <typename ModuleImpl>
  Status Prepare(torch::nn::ModuleHolder<ModuleImpl>& model, torch::optim::Optimizer& optimizer) {
    return Prepare(std::static_pointer_cast<torch::nn::Module>(model.ptr()),
                   std::shared_ptr<torch::optim::Optimizer>(std::shared_ptr<void>(), &optimizer));
  }
  // An evaluation loader over `dataset` (data_loader.h): rank r takes samples r, r + W, ...
  // (W = world_size()) in data set order in batches of `batch_size`, nothing padded, dropped or
  // shuffled, the same number of batches on every rank (the last may be partial, or empty on
  // a rank when fewer than W samples are left). Not the training loader: preparing and
  // consuming it changes no accumulation window, epoch or checkpoint. Not collective.
  // REQUIRES: not pipeline mode; batch_size >= 1.
  template <typename DatasetT>
  EvalDataLoader<DatasetT> PrepareEvalLoader(DatasetT dataset, int64_t batch_size);
  // accelerate's gather_for_metrics for an EvalDataLoader batch: `t` holds one row (along dim
  // 0) per sample of this rank's current batch, in the batch's order; returns every rank's rows
  // of that batch in data set order (rank r's row j is the batch's sample r + j*W), the same
  // on every rank. Over a full pass, the concatenated results are exactly the data set's
  // samples, each once, in order. Other dimensions, dtype and device must agree across ranks.
  // COLLECTIVE.
  torch::Tensor GatherForMetrics(const torch::Tensor& t);
  // accelerate's split_between_processes: the range [begin, end) of 0..n this rank takes, in
  // rank order, the first n % world_size() ranks one more. Not collective.
  IndexRange SplitBetweenProcesses(int64_t n) const;
  // `t` padded along `dim` with `pad_value` to the largest size of that dimension over the
  // ranks (after the data, or before it with pad_first), as accelerate's
  // pad_across_processes; `t` itself when it already has that size. The other dimensions may
  // differ. COLLECTIVE.
  torch::Tensor PadAcrossProcesses(const torch::Tensor& t, int64_t dim = 0, double pad_value = 0,
                                   bool pad_first = false);
  // Rank `src`'s `t` on every rank, in place; returns `t`. REQUIRES: same shape and dtype on
  // every rank (use BroadcastObject for anything else). COLLECTIVE.
  torch::Tensor& Broadcast(torch::Tensor& t, int src = 0);
  // Rank `src`'s `bytes` on every rank (the other ranks' argument is ignored): any object
  // serialised to bytes, e.g. through torch::serialize::OutputArchive::save_to(std::ostream&)
  // or a tensor through torch::save. COLLECTIVE.
  std::string BroadcastObject(const std::string& bytes, int src = 0);
  // Every rank's `t`, as a list in rank order; the first dimension may differ between ranks
  // (the others may not). The sizes are all-gathered, each `t` padded to the largest, gathered,
  // then trimmed. A 0-dimensional `t` counts as one row. COLLECTIVE.
  std::vector<torch::Tensor> GatherList(const torch::Tensor& t);

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
  // every rank's RNG state. Layout: dir/step<N>/{model*.pt, rank<r>.pt}, pair<i>/ for the
  // prepared pairs after the first, user_rank<r>.pt for RegisterForCheckpointing, SHA256SUMS
  // (every file's hash, state/file_sums.h); then rank 0 points dir/latest at N and removes
  // older step folders but the last options().checkpoint_keep, so a kill at any moment leaves
  // the last complete checkpoint. IoError (every rank) when any rank failed to write; the
  // partial folder is removed (a full disk keeps its space). COLLECTIVE.
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
  // In-place recovery's snapshots (zero, local_sgd): how many this process completed, the time
  // they blocked it (the fork, and waiting for an exchange still under way), and the time
  // making and exchanging them took behind training.
  int64_t snapshots_taken() const { return snapshots_taken_; }
  double snapshot_ms() const { return snapshot_ms_; }
  double snapshot_copy_ms() const { return snapshot_copy_ms_; }
  // The size of this rank's newest image (its keeper holds as much again).
  int64_t snapshot_bytes() const;
  // Restores what SaveState wrote under `dir` (the step named by dir/latest). Returns false when
  // there is none. Every rank loads its own RNG state; ranks agree on the step or fail with
  // Internal naming both. At another world size (logged, saying what happens):
  //   - data: the global sample position is restored and the rest of the epoch is dealt over
  //     the new ranks (sampler.h); a checkpoint from before positions were recorded restarts
  //     the data order at the next epoch instead (warned);
  //   - local_sgd: every new rank starts from the average of all the old ranks' replicas (as
  //     the final average would make them), with its own optimizer state when it had a rank,
  //     rank 0's otherwise;
  //   - RNG: a new rank draws a fresh stream seeded from (seed, rank, step).
  // Every file is first checked against SHA256SUMS (each rank hashes a share): a damaged
  // latest falls back to the previous kept checkpoint (said), or is refused (IoError naming
  // the files) when none is kept; a missing file is damage. InvalidConfig when the model or
  // optimizer does not match, or when the checkpoint was written with other run settings
  // (ChangedSettings, each named) unless options().resume_allow_changes. COLLECTIVE.
  StatusOr<bool> LoadState(const std::string& dir);
  // The same for the checkpoint of optimizer step `step` under `dir` (`train.checkpoint_keep`
  // keeps the last K), with no fallback. NotFound naming the steps it holds. COLLECTIVE.
  StatusOr<bool> LoadState(const std::string& dir, int64_t step);
  // The complete checkpoints (step<N> folders) under `dir`, ascending; empty when none. Not
  // collective.
  static std::vector<int64_t> SavedSteps(const std::string& dir);
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

  // --- Communication and state ---------------------------------------------------------------
  // Since the last call (communication per optimizer step): collectives issued over the
  // gradient group, the time the loop waited on communication it could not hide, and buckets
  // launched while backward still ran (ddp overlap).
  struct CommStats {
    int64_t allreduces = 0;
    int64_t reduce_scatters = 0;  // zero
    int64_t allgathers = 0;       // zero
    double blocking_comm_ms = 0;
    int64_t launched_before_grads_done = 0;
  };
  CommStats TakeCommStats();
  int64_t num_buckets() const;  // ddp's gradient buckets, zero's units; 0 otherwise
  // The loss of an output and its targets, for the engines that compute it themselves:
  // dp's gather-then-loss (parallel.loss_in_replica false: replicas run TensorForward, model.h,
  // and `criterion(outputs, targets)` runs once on the gathered outputs) and a pipeline's last
  // stage (ForwardBackward there calls it for every micro-batch).
  void SetCriterion(CriterionFn criterion) { criterion_ = std::move(criterion); }
  // The prepared model's trainable parameters (requires grad, each once).
  std::vector<torch::Tensor> parameters() const;

 private:
  Accelerator(const config::TrainConfig& options, const DistEnv& env);
  // A new DistributedDataLoader's cursor: becomes the training cursor when it is the first, or
  // the first made after the training loader and its copies were destroyed (which goes on at
  // its position), and then takes a restored position.
  void AttachCursor(std::shared_ptr<LoaderCursor> cursor);
  bool IsTrainingCursor(const std::shared_ptr<LoaderCursor>& cursor) const {
    return cursor == cursor_;
  }
  // A DistributedDataLoader's Next() served `rows` rows from `cursor`: counted when it is the
  // training cursor, remembered for ConfirmTrainingCursor; a ported loop's loss.backward() is
  // named here (CheckNoStrayGradients).
  void Served(const std::shared_ptr<LoaderCursor>& cursor, int64_t rows);
  // The first Accumulate() after a loader served: the loader the loop drew its batch from is
  // the training loader (data_loader.h).
  void ConfirmTrainingCursor();
  // Moves the training cursor to the position LoadState restored, once.
  void ApplyRestoredCursor();
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
  // --- In-place recovery (see the top of this file) ---
  // Runs `fn` (collective work); with recovery on, a failure from a lost peer is caught and
  // noted (peer_lost_) and false returned; after that, returns false without running `fn`
  // until Recover. Other errors propagate.
  template <typename Fn>
  bool Guarded(Fn&& fn);
  // After a lost peer: waits for the replacement, re-forms the group, takes the live state and
  // resets the step in flight. COLLECTIVE with the replacement.
  Status Recover();
  // Where survivors and replacements meet (comm/recovery.h): notes that `noticed_by` noticed at
  // `noticed_at` the loss of a rank of generation `lost_in` (no note when `noticed_by` is
  // empty), announces `announce` (a replacement's own generation; 0: none),
  // then waits in the newest generation >= `at_least` until the whole world arrived, and returns
  // it. When the store fails meanwhile (rank 0, its host, was lost too), a new client meets the
  // others in the store rank 0's replacement hosts, and the notice and announcement go there.
  // Within `wait` in all; the store host (a rank 0 that survived) never reconnects.
  StatusOr<int> MeetInNewestGeneration(int lost_in,
                                       std::chrono::system_clock::time_point noticed_at,
                                       const std::string& noticed_by, int announce, int at_least,
                                       std::chrono::milliseconds wait);
  // In the group re-formed after a loss, survivors and replacements alike: the strategy goes on
  // over it and every rank takes the run's state (ExchangeState, or RollBack in a mode that
  // recovers from snapshots). COLLECTIVE.
  Status TakeStateOverNewGroup();
  // Every rank of the new group takes the furthest live rank's state. COLLECTIVE.
  Status ExchangeState();
  // The layout's groups over pg_ in generation_ (data_pg_, tensor_pg_ under tensor_group_,
  // context_pg_ under context_group_, stage_pg_). COLLECTIVE over the world.
  Status FormLayoutGroups(std::chrono::milliseconds timeout);
  // The world and this rank's distinct layout groups: what a lost peer abandons.
  std::vector<c10::intrusive_ptr<CountingProcessGroup>> Groups() const;
  // Gives up every group of Groups(): whatever waits in one fails at once.
  void AbandonGroups();
  // After Prepare or PreparePipeline built the strategy: turns in-place recovery on where the
  // strategy allows it (`recoverable`; said otherwise, `why_not` naming the mode or layout),
  // then readies the strategy: Setup, or for a replacement the state from its peers.
  Status StartStrategy(bool recoverable, const std::string& why_not);
  // Snapshots (a mode that RecoversFromSnapshots): this rank's image of the step just done,
  // kept here and sent to its keeper, the rank that keeps a copy of it (on another host where
  // there is one), which receives its ward's in turn. COLLECTIVE. A peer lost meanwhile leaves
  // the newest complete snapshot as it was.
  void TakeSnapshot();
  // The exchange in flight ends: its snapshot becomes the newest held when it completed.
  // `block`: waits for it; else only when it is done.
  void FinishSnapshot(bool block);
  // After a loss, in the new group: every rank goes back to the newest snapshot all hold, a
  // replacement to its keeper's copy of its image. COLLECTIVE.
  Status RollBack();
  int KeeperOf(int rank) const;
  // Notes the state at a step boundary that a recovery goes back to.
  void MarkBoundary();
  TrainState BoundaryTrainState() const;
  // AllReduceSum's work, unguarded.
  void SumInPlace(torch::Tensor& t);
  void CountSamples(int64_t n) {
    samples_seen_ += n;
    samples_seen_global_ += n * data_parallel_size();
  }
  // LAUNCH_TRACE_SAMPLES (tests): appends "step epoch position:index ..." for a batch to
  // <path>.rank<r>. A no-op when the variable is unset.
  void TraceBatch(int64_t epoch, const std::vector<int64_t>& positions,
                  const std::vector<int64_t>& indices);
  bool tracing() const { return trace_fd_ >= 0; }
  friend class AcceleratorInternals;  // accelerator_internal.h
  template <typename DatasetT>
  friend class DistributedDataLoader;
  template <typename DatasetT>
  friend class EvalDataLoader;

  config::TrainConfig options_;
  DistEnv env_;
  std::unique_ptr<ParallelLayout> layout_;            // the authority on groups and coordinates
  c10::intrusive_ptr<CountingProcessGroup> pg_;       // the world (null for one process)
  c10::intrusive_ptr<CountingProcessGroup> data_pg_;  // the gradient group (pg_ when it spans
                                                      // the world; null when it has one rank)
  TensorGroupPtr tensor_group_;  // over the tensor axis' group (null when it has one rank)
  c10::intrusive_ptr<CountingProcessGroup> tensor_pg_;  // that group
  TensorGroupPtr context_group_;  // over the context axis' group (null when it has one rank)
  c10::intrusive_ptr<CountingProcessGroup> context_pg_;  // that group
  // A pipeline's stage group: this replica's stages (null without a pipeline). The engine
  // communicates over it; it is here so that recovery re-forms and abandons it with the others.
  c10::intrusive_ptr<CountingProcessGroup> stage_pg_;
  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<Model> model_;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<ParallelStrategy> strategy_;
  // Every prepared (model, optimizer) pair; pairs_[0] is module_, model_, optimizer_,
  // strategy_ above, later ones own their strategy.
  struct Pair {
    std::shared_ptr<torch::nn::Module> module;
    std::shared_ptr<Model> model;
    std::shared_ptr<torch::optim::Optimizer> optimizer;
    ParallelStrategy* strategy = nullptr;     // set by Prepare / PreparePipeline
    std::unique_ptr<ParallelStrategy> owned;  // pairs after the first
    int no_sync = 0;                          // open NoSync scopes
    bool took_part = false;                   // a Backward reached it since its last step
    bool unsynced = false;                    // its last Backward ran inside NoSync
    bool stepped = false;                     // stepped in the current micro-batch
    bool backward_in_micro = false;           // a Backward reached it in the current micro-batch
    bool unscaled = false;  // fp16: its gradients were divided by the loss scale in this step
    std::vector<double> base_lrs;  // each parameter group's rate at Prepare (SetLrLambda)
  };
  void RecordBaseLearningRates(Pair& pair);  // Prepare: pair.base_lrs from its optimizer's groups
  std::vector<Pair> pairs_;
  // The user state of RegisterForCheckpointing, in registration order.
  struct UserState {
    bool module = false;
    std::function<void(torch::serialize::OutputArchive&)> save;
    std::function<void(torch::serialize::InputArchive&)> load;
  };
  std::vector<UserState> user_state_;
  bool micro_open_ = false;  // Accumulate() opened the micro-batch and no Step() closed it
  bool counted_ = false;     // the current micro-batch's optimizer step was counted (step_)
  // Prepare for the pairs after the first.
  Status PrepareAnother(std::shared_ptr<torch::nn::Module> module,
                        std::shared_ptr<torch::optim::Optimizer> optimizer);
  Pair& PairOf(const torch::nn::Module& model, const char* call);
  // The pairs whose parameters `loss`'s graph reaches, agreed by all ranks (several pairs).
  std::vector<Pair*> PairsReachedBy(const torch::Tensor& loss);
  // Clips, sets the scheduled LR, steps and zeroes each of `pairs`; counts the step once per
  // micro-batch.
  void StepPairs(const std::vector<Pair*>& pairs);
  std::string PairDir(const std::string& step_dir, size_t i) const;
  Status SaveUserState(const std::string& step_dir) const;
  Status LoadUserState(const std::string& step_dir);
  StatusOr<bool> LoadStateAt(const std::string& dir, std::optional<int64_t> step);
  // Pair i's model and optimizer state from step folder `step_dir` of checkpoint folder `dir`,
  // re-cut first when another tensor or pipeline layout wrote it (state/reshard.h).
  Status LoadPairState(const std::string& dir, const std::string& step_dir, size_t i,
                       int64_t written_by);
  std::vector<std::string> ChangedSettingsAt(const std::string& dir, int64_t step) const;
  std::shared_ptr<LoaderCursor> cursor_;     // the training loader's (AttachCursor)
  std::unique_ptr<EventFileWriter> events_;  // Log's, made on its first call
  std::function<double(int64_t)> lr_schedule_;
  bool lr_is_factor_ = false;  // lr_schedule_ is SetLrLambda's factor, not a rate
  bool prepared_ = false;
  std::unique_ptr<const Platform> platform_;  // this rank's device path (compat/platform.h)
  std::optional<LossScaler> scaler_;          // mixed_precision fp16
  bool step_skipped_ = false;                 // the last stepping Step() skipped (fp16)
  // fp16: divides `pair`'s gradients by the loss scale, once per step.
  void Unscale(Pair& pair);
  torch::Device device_ = torch::kCPU;
  void EndMicroBatch();
  void WriteTimeline();  // Finish(): per-rank files, merged by rank 0

  bool in_micro_ = false;       // Accumulate() called, Backward not yet
  bool sync_ = true;            // this micro-batch communicates gradients (ddp)
  bool window_closes_ = false;  // this micro-batch ends the accumulation window
  CriterionFn criterion_;
  // ForwardBackward with the criterion the engine uses (dp's gather, a pipeline's last stage).
  torch::Tensor ForwardBackwardWith(const torch::data::Example<>& batch, const ChunkLoss& fn,
                                    const CriterionFn& criterion);
  int64_t micro_in_window_ = 0;
  int64_t micro_last_step_ = 0;
  int64_t step_ = 0;
  int64_t samples_seen_ = 0;
  int64_t samples_seen_global_ = 0;
  int64_t origin_data_world_ = 1;    // data_world_ until LoadState
  int64_t origin_batch_size_ = 0;    // options_.batch_size until LoadState
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
  // The loader that served last, and its rows; whether the first Accumulate() confirmed the
  // training cursor; whether LoadState's position went to a cursor not confirmed yet.
  std::weak_ptr<LoaderCursor> last_served_;
  int64_t last_served_rows_ = 0;
  bool training_confirmed_ = false;
  bool restored_before_confirmed_ = false;
  // In-place recovery: on; a collective failed for a lost peer (what, when); the last Step()
  // abandoned its step; this process is a replacement; the group generation; the recoveries;
  // the store (a rank 0 that hosts it keeps it) and the watch on it for losses elsewhere; the
  // time of the failure the next stepped Step() reports the cost of; the last step boundary.
  bool recover_ = false;
  bool peer_lost_ = false;
  std::string lost_what_;
  std::chrono::steady_clock::time_point lost_at_;
  bool redo_ = false, joined_from_peer_ = false;
  int generation_ = 0;
  int64_t recoveries_ = 0;
  std::chrono::milliseconds timeout_{300000};
  std::chrono::steady_clock::time_point created_at_ = std::chrono::steady_clock::now();
  c10::intrusive_ptr<c10d::Store> store_;
  std::unique_ptr<LossWatch> loss_watch_;
  std::optional<std::chrono::steady_clock::time_point> report_cost_since_;
  int recovered_from_ = -1;  // the rank whose state the last recovery took
  RunClock run_clock_;
  // Everyone takes `root`'s run clock (collective on the current group; a recovery's last word).
  void ShareRunClock(int root);
  // The run's collectives (final.json's totals) and in-place recoveries: a recovery re-forms
  // the group, whose counts start again, so the totals carry the run's count before it.
  struct RunCounts {
    int64_t allreduces = 0, pair_exchanges = 0, reduce_scatters = 0, allgathers = 0;
    int64_t alltoalls = 0;  // the context group's (Ulysses attention)
    int64_t recoveries = 0;
  };
  RunCounts carried_;           // added to the current group's counts
  RunCounts RunTotals() const;  // the run's, so far
  struct Boundary {
    LoaderCursor cursor;
    bool has_cursor = false;
    int64_t samples_seen = 0;
    int64_t samples_seen_global = 0;
    std::vector<torch::Tensor> buffers;  // clones of the model's buffers
    RunCounts counts;                    // RunTotals() then: a redone step counts once
  } boundary_;
  // Snapshots: on; one of this rank's (own) with the copy of its ward's, taken at `step`; the
  // newest complete ones, oldest first (two: a loss during an exchange leaves one that every
  // rank holds).
  bool snapshots_ = false;
  struct Snapshot {
    int64_t step = -1;
    // This rank's image and its ward's copy (recovery.cc: memory files, or bytes from another
    // host).
    std::shared_ptr<const SnapshotImage> own, ward;
    RunCounts counts;  // RunTotals() then
  };
  std::vector<Snapshot> snapshots_held_;
  // The one being made and exchanged (a forked child writes the image; a thread exchanges it).
  struct PendingSnapshot {
    Snapshot snap;
    std::thread thread;
    std::atomic<int> child{-1};  // the pid making the image, until reaped
    Status status;
    double copy_ms = 0;
    std::atomic<bool> done{false};
  };
  std::shared_ptr<PendingSnapshot> pending_snapshot_;
  bool snapshot_due_ = false;    // a boundary of recover_snapshot_every: the next step takes one
  double snapshot_copy_ms_ = 0;  // behind training: making and exchanging the images
  int64_t snapshots_taken_ = 0;
  double snapshot_ms_ = 0;  // the time spent taking them (final.json)
  std::vector<std::pair<std::string, std::string>> run_settings_;  // AddRunSetting

  bool backward_since_step_ = false;  // Backward (or ForwardBackward) ran since the last step
  // Whether gradients must be averaged by Backward for the replicas to stay equal (ddp, zero).
  bool AveragesGradients() const;
  // Step without a Backward since the last step: a CHECK failure naming the fix when the
  // prepared parameters have gradients anyway (loss.backward() in a loop that needs Backward).
  void CheckNoUnsyncedGradients() const;
  // A CHECK failure naming the fix when a prepared model's strategy saw a gradient computed
  // outside Backward (TakeStrayGradients: loss.backward() in a ported loop, whose
  // optimizer.step() would train each rank on its own). Local and cheap: the training loader's
  // Next(), Accumulate() and Step() ask, so the first iteration's mistake stops the second.
  void CheckNoStrayGradients();
  // Finish: in ddp and local_sgd every rank's parameter checksum equals rank 0's, or Internal
  // naming the ranks that differ. COLLECTIVE.
  Status CheckReplicasAgree();
};

}  // namespace launch::trainer

// The loaders (DistributedDataLoader, EvalDataLoader) and the templates that make them, which
// need Accelerator complete.
#include "trainer_runtime/api/data_loader.h"  // IWYU pragma: export
