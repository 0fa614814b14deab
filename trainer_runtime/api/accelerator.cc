#include "trainer_runtime/api/accelerator.h"
#include "trainer_runtime/parallel/tensor_group.h"
#include "trainer_runtime/util/allocator.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "base/collective_ring.h"
#include "base/environment.h"
#include "base/exit_status.h"
#include "base/files.h"
#include "base/strings.h"
#include "config/train_keys.h"
#include "trainer_runtime/api/accelerator_internal.h"
#include "trainer_runtime/comm/device_agreement.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/comm/recovery.h"
#include "trainer_runtime/compat/platform.h"
#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/model/model.h"
#include "trainer_runtime/model/pipeline_stages.h"
#include "trainer_runtime/parallel/layout.h"
#include "trainer_runtime/parallel/pipeline_engine.h"
#include "trainer_runtime/parallel/strategy.h"
#include "trainer_runtime/parallel/strategy_factory.h"
#include "trainer_runtime/state/checkpoint.h"
#include "trainer_runtime/state/tensorboard.h"
#include "trainer_runtime/util/loop_util.h"
#include "trainer_runtime/util/timeline.h"

namespace launch::trainer {

Accelerator::Accelerator(const config::TrainConfig& options, const DistEnv& env)
    : options_(options), env_(env), run_settings_(config::TrajectorySettings(options)) {
  Timeline::Get().Configure(env_.rank, options_.timeline.from_step, options_.timeline.steps);
}

void Accelerator::SetLayout(const ParallelLayout& layout) {
  layout_ = std::make_unique<ParallelLayout>(layout);
  origin_data_world_ = data_parallel_size();
  origin_batch_size_ = options_.batch_size;
}

const ParallelLayout& Accelerator::layout() const { return *layout_; }
bool Accelerator::IsMainProcess() const { return env_.rank == layout_->main_rank(); }
int Accelerator::num_stages() const { return layout_->degree(Axis::kStage); }
int Accelerator::stage_index() const { return layout_->coordinate(Axis::kStage); }
int Accelerator::data_parallel_size() const { return layout_->degree(Axis::kData); }
int Accelerator::data_parallel_rank() const { return layout_->coordinate(Axis::kData); }

Accelerator::~Accelerator() {
  if (trace_fd_ >= 0) ::close(trace_fd_);
  // A snapshot still being made (the program ends on an error): its child goes, and the thread,
  // which holds nothing of this object, is left to the process's exit.
  if (pending_snapshot_) {
    if (const pid_t child = pending_snapshot_->child; child > 0) ::kill(child, SIGKILL);
    if (pending_snapshot_->done) {
      pending_snapshot_->thread.join();
    } else {
      pending_snapshot_->thread.detach();
    }
  }
  // A save never committed (the program ends on an error): its writer goes too, and is reaped.
  if (writer_pid_ > 0) {
    ::kill(writer_pid_, SIGKILL);
    while (::waitpid(writer_pid_, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
}

StatusOr<std::unique_ptr<Accelerator>> Accelerator::Create(const config::TrainConfig& options,
                                                           double init_timeout_s) {
  // A worker's stdout is a pipe to its agent, which C would buffer by the block: progress
  // printed with printf or std::cout would arrive in bursts, or at exit. Line by line instead.
  std::setvbuf(stdout, nullptr, _IOLBF, BUFSIZ);
  const std::map<std::string, std::string> environment = CurrentEnvironment();
  LAUNCH_ASSIGN_OR_RETURN(DistEnv env, ParseDistEnv(environment));
  auto it = environment.find("LAUNCH_INIT_TIMEOUT_S");
  if (it != environment.end()) {
    double v = 0;
    if (!ParseDouble(it->second, &v) || v <= 0)
      return Status::InvalidConfig(
          "environment LAUNCH_INIT_TIMEOUT_S: expected seconds > 0, got '" + it->second + "'");
    init_timeout_s = v;
  }
  LAUNCH_ASSIGN_OR_RETURN(std::unique_ptr<Accelerator> accel, Create(options, env, init_timeout_s));
  it = environment.find("LAUNCH_TRACE_SAMPLES");
  if (it != environment.end() && !it->second.empty()) {
    const std::string path = it->second + ".rank" + std::to_string(env.rank);
    accel->trace_fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (accel->trace_fd_ < 0)
      return Status::IoError("environment LAUNCH_TRACE_SAMPLES: cannot open '" + path + "'");
  }
  return accel;
}

StatusOr<std::unique_ptr<Accelerator>> Accelerator::Create(const config::TrainConfig& options,
                                                           const DistEnv& given_env,
                                                           double init_timeout_s) {
  // Every group this process forms waits this long in a collective (the init timeout is for
  // forming them): what survives a slow peer is this setting's, not how long ranks take to start.
  DistEnv env = given_env;
  env.collective_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(options.collective_timeout_s * 1000));
  // The configuration's own rules (config/train_keys.h), for options built in code: what
  // launch and train checked with the keys' places, here with the real world size.
  LAUNCH_ASSIGN_OR_RETURN(const ParallelLayout layout, ParallelLayout::Create(options, env));
  // Every step allocates what the previous one freed: kept, not faulted in again (allocator.h).
  KeepFreedMemoryForReuse();
  // The device path (compat/platform.h): refuses more processes on this node than CUDA devices
  // it sees; then each strategy, and the pipeline engine, says whether it runs there (autocast
  // included: each answer ends with Platform::CheckAutocast).
  LAUNCH_ASSIGN_OR_RETURN(const Platform platform,
                          Platform::Create(env, options.mixed_precision, PlatformFacts::Read()));
  LAUNCH_RETURN_IF_ERROR(CheckPlatformSupport(options, platform));
  std::unique_ptr<Accelerator> accel(new Accelerator(options, env));
  accel->run_clock_.started_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                          std::chrono::system_clock::now().time_since_epoch())
                                          .count();
  accel->SetLayout(layout);
  accel->device_ = platform.device();
  accel->platform_ = std::make_unique<const Platform>(platform);
  if (platform.autocast().dtype == c10::ScalarType::Half) {
    LAUNCH_ASSIGN_OR_RETURN(LossScaler scaler, LossScaler::Create(options.grad_scaler));
    accel->scaler_ = scaler;
  }
  // Which GPU each rank took, and over what its tensors travel (a CPU run says nothing new).
  // That GPU becomes the current device, as torch.cuda.set_device(LOCAL_RANK) in a script: what
  // allocates without naming a device (NCCL's communicators, raw allocations) lands there.
  if (platform.is_cuda()) {
    c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).setDevice(platform.device());
    std::fprintf(stderr, "train: rank %d: %s\n", env.rank, platform.Describe().c_str());
  }
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(init_timeout_s * 1000));
  accel->timeout_ = timeout;
  if (env.distributed() && env.recover_in_place) {
    // In-place recovery keeps the store (rank 0 hosts it and must keep hosting it when its
    // group is re-formed), and a replacement announces its generation before it forms its group
    // with the survivors (comm/recovery.h).
    LAUNCH_ASSIGN_OR_RETURN(accel->store_,
                            ConnectStore(env, env.rank == 0 && !env.use_agent_store, timeout));
    if (env.recover_generation > 0) {
      // The survivors' recovery times count from when the agent saw the rank this one replaces
      // die, if no survivor noticed earlier. Its own generation, or a newer one when another
      // replacement started meanwhile.
      std::string by;
      if (env.recover_lost_at_ms > 0)
        by = env.recover_lost_by.empty() ? "the agent of rank " + std::to_string(env.rank)
                                         : env.recover_lost_by;
      LAUNCH_ASSIGN_OR_RETURN(
          accel->generation_,
          accel->MeetInNewestGeneration(env.recover_generation - 1,
                                        std::chrono::system_clock::time_point(
                                            std::chrono::milliseconds(env.recover_lost_at_ms)),
                                        by, env.recover_generation, env.recover_generation,
                                        RecoverWait(env, timeout)));
    }
    LAUNCH_ASSIGN_OR_RETURN(
        accel->pg_, CreateGroupOver(accel->store_, WorldGroupName(accel->generation_), env.rank,
                                    env.world_size, env, timeout));
    std::fprintf(
        stderr, "train: rank %d (pid %d): in-place recovery on%s\n", env.rank,
        static_cast<int>(::getpid()),
        env.recover_generation > 0
            ? (", replacement generation " + std::to_string(env.recover_generation)).c_str()
            : "");
  } else if (env.distributed()) {
    LAUNCH_ASSIGN_OR_RETURN(accel->pg_, CreateProcessGroup(env, timeout));
  }
  // Every rank on the same kind of device, or every rank says which ranks are where (a
  // replacement joins survivors that are past this point: it checked nothing they would meet).
  if (accel->pg_ && env.recover_generation == 0)
    LAUNCH_RETURN_IF_ERROR(CheckDeviceKindsAgree(accel->pg_->inner(), platform));
  LAUNCH_RETURN_IF_ERROR(accel->FormLayoutGroups(timeout));
  return accel;
}

Status Accelerator::FormLayoutGroups(std::chrono::milliseconds timeout) {
  // The strategies communicate over this rank's gradient group (the world itself unless other
  // axes split it: no second group then).
  LAUNCH_ASSIGN_OR_RETURN(
      data_pg_, CreateAxisGroup(*layout_, AxisOf(Use::kGradient), env_, pg_, timeout, generation_));
  LAUNCH_ASSIGN_OR_RETURN(
      tensor_pg_, CreateAxisGroup(*layout_, AxisOf(Use::kTensor), env_, pg_, timeout, generation_));
  LAUNCH_ASSIGN_OR_RETURN(context_pg_, CreateAxisGroup(*layout_, AxisOf(Use::kContext), env_, pg_,
                                                       timeout, generation_));
  // Re-formed after a loss: the layers and strategies keep the tensor and context groups they
  // hold.
  const auto form = [](TensorGroupPtr& group, const c10::intrusive_ptr<CountingProcessGroup>& pg) {
    if (group && pg) {
      ReformTensorGroup(group, pg);
    } else {
      group = ProcessTensorGroup(pg);
    }
  };
  form(tensor_group_, tensor_pg_);
  form(context_group_, context_pg_);
  if (options_.parallel.pipelined()) {
    LAUNCH_ASSIGN_OR_RETURN(
        stage_pg_, CreateAxisGroup(*layout_, Axis::kStage, env_, pg_, timeout, generation_));
  }
  return Status::Ok();
}

std::vector<c10::intrusive_ptr<CountingProcessGroup>> Accelerator::Groups() const {
  std::vector<c10::intrusive_ptr<CountingProcessGroup>> groups;
  for (const auto& g : {pg_, data_pg_, stage_pg_, tensor_pg_, context_pg_})
    if (g && std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
  return groups;
}

void Accelerator::AbandonGroups() {
  for (const auto& g : Groups()) g->Abandon();
}

bool Accelerator::bf16() const { return platform_->autocast().dtype == c10::ScalarType::BFloat16; }
bool Accelerator::fp16() const { return scaler_.has_value(); }
double Accelerator::loss_scale() const { return scaler_ ? scaler_->scale() : 1.0; }
int64_t Accelerator::skipped_steps() const { return scaler_ ? scaler_->skipped() : 0; }

void Accelerator::Unscale(Pair& pair) {
  if (!scaler_ || pair.unscaled) return;
  pair.unscaled = true;
  // Sharded gradients included (zero: the shard this rank steps).
  Guarded([&] { pair.strategy->ScaleGradients(scaler_->inverse_scale()); });
}

AutocastScope Accelerator::Autocast() const {
  return AutocastScope(platform_->autocast().device_type, platform_->autocast().dtype);
}

const char* Accelerator::mode_name() const {
  if (strategy_) return strategy_->Name();
  return config::ToString(options_.parallel.mode);
}

void Accelerator::Print(const std::string& line) const {
  if (!IsMainProcess()) return;
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

Status Accelerator::Log(const std::vector<std::pair<std::string, double>>& values, int64_t step) {
  if (!IsMainProcess()) return Status::Ok();
  if (!events_) {
    LAUNCH_ASSIGN_OR_RETURN(events_, EventFileWriter::Create(options_.output_dir + "/tensorboard"));
  }
  return events_->AddScalars(step, values);
}

c10d::ProcessGroup* Accelerator::control() const { return pg_ ? &pg_->inner() : nullptr; }

// --- Model and optimizer ---------------------------------------------------------------------

torch::Tensor Accelerator::ToDevice(const torch::Tensor& t) const {
  if (!t.defined() || t.device() == device_) return t;
  return t.to(device_, /*non_blocking=*/true);
}

torch::data::Example<> Accelerator::ToDevice(torch::data::Example<> batch) const {
  return {ToDevice(batch.data), ToDevice(batch.target)};
}

Status Accelerator::Prepare(std::shared_ptr<torch::nn::Module> model,
                            std::shared_ptr<torch::optim::Optimizer> optimizer) {
  if (options_.parallel.pipelined())
    return Status::InvalidConfig(
        "train.parallel.stages: this rank is one stage of a pipeline; hand over its stage with "
        "PreparePipeline");
  if (!model || !optimizer) return Status::InvalidArgument("Prepare: model and optimizer needed");
  if (prepared_) return PrepareAnother(std::move(model), std::move(optimizer));
  module_ = std::move(model);
  // In place (Module::to replaces each parameter's data), so the optimizer's references hold.
  if (!device_.is_cpu()) module_->to(device_);
  model_ = std::make_shared<Model>(module_);
  optimizer_ = std::move(optimizer);
  // A model whose parameters are all frozen trains nothing: say so instead of a Reducer error.
  if (model_->NamedParameters().empty())
    return Status::InvalidConfig("the model has no parameters that require grad");
  if (options_.parallel.comm_hook == config::CommHook::kBf16 && device_.is_cpu() && pg_ &&
      !pg_->shm() && !pg_->hierarchical())
    return Status::InvalidConfig(
        "train.parallel.comm_hook: bf16 all-reduces the buckets in bfloat16, which this "
        "LibTorch's Gloo cannot do; it needs shared memory on every host (the shared-memory "
        "or hierarchical transport; fp16 needs neither), here: " +
        pg_->allreduce_transport());
  LAUNCH_ASSIGN_OR_RETURN(
      strategy_, CreateStrategy(options_, model_.get(), optimizer_.get(), data_pg_, env_.tuning));
  if (tensor_group_)
    strategy_->SetTensorGroup(tensor_group_, SplitParameters(*module_, model_->Parameters()));
  // ddp over the world hands a replacement the live state; a mode whose state exists on one
  // rank alone goes back to the newest in-memory snapshot (RollBack), and so does every mode
  // under a tensor axis (a shard exists on its data replicas at most). Recovery re-forms the
  // layout's groups, which the strategy must communicate over.
  const bool world_data = data_pg_ == pg_;
  snapshots_ = world_data
                   ? !strategy_->SupportsInPlaceRecovery() && strategy_->RecoversFromSnapshots()
                   : strategy_->CanReform();
  LAUNCH_RETURN_IF_ERROR(
      StartStrategy(world_data ? strategy_->SupportsInPlaceRecovery() || snapshots_ : snapshots_,
                    std::string("in ") + strategy_->Name() + " mode with " + layout_->Describe()));
  strategy_->TakeStepStats();
  pairs_.emplace_back();
  pairs_.back().module = module_;
  pairs_.back().model = model_;
  pairs_.back().optimizer = optimizer_;
  pairs_.back().strategy = strategy_.get();
  RecordBaseLearningRates(pairs_.back());
  prepared_ = true;
  MarkBoundary();
  return Status::Ok();
}

Status Accelerator::PreparePipeline(torch::nn::AnyModule stage,
                                    std::shared_ptr<torch::optim::Optimizer> optimizer) {
  return PreparePipeline(std::vector<torch::nn::AnyModule>{std::move(stage)}, std::move(optimizer));
}

Status Accelerator::PreparePipeline(std::vector<torch::nn::AnyModule> chunks,
                                    std::shared_ptr<torch::optim::Optimizer> optimizer) {
  LAUNCH_CHECK(!prepared_);
  if (!options_.parallel.pipelined())
    return Status::InvalidConfig(
        "PreparePipeline needs a pipeline: train.parallel.stages above 1 or parallel.mode "
        "pipeline (got mode " +
        std::string(config::ToString(options_.parallel.mode)) + ", stages 1)");
  const int virtual_stages = options_.parallel.virtual_stages;
  if (static_cast<int>(chunks.size()) != virtual_stages)
    return Status::InvalidConfig("PreparePipeline got " + std::to_string(chunks.size()) +
                                 " model chunks for this rank; train.parallel.virtual_stages is " +
                                 std::to_string(virtual_stages));
  if (chunks.size() == 1) {
    module_ = chunks.front().ptr();
  } else {
    LAUNCH_ASSIGN_OR_RETURN(module_, JoinChunks(chunks));
  }
  // In place, as Prepare does, so the optimizer's references hold.
  if (!device_.is_cpu()) module_->to(device_);
  model_ = std::make_shared<Model>(module_);
  optimizer_ = std::move(optimizer);
  // The stage's own data strategy over its data group, inside the engine.
  LAUNCH_ASSIGN_OR_RETURN(
      std::unique_ptr<ParallelStrategy> data,
      CreateStrategy(options_, model_.get(), optimizer_.get(), data_pg_, env_.tuning));
  // The engine sums the stage's norm (the data strategy's) over the stages.
  if (tensor_group_)
    data->SetTensorGroup(tensor_group_, SplitParameters(*module_, model_->Parameters()));
  std::vector<PipelineEngine::ForwardFn> forwards;
  for (torch::nn::AnyModule& chunk : chunks)
    forwards.push_back(
        [chunk](const torch::Tensor& x) mutable { return chunk.forward<torch::Tensor>(x); });
  LAUNCH_ASSIGN_OR_RETURN(std::unique_ptr<PipelineEngine> engine,
                          PipelineEngine::Create(options_, *platform_, *layout_, pg_, stage_pg_,
                                                 model_, std::move(forwards), std::move(data)));
  strategy_ = std::move(engine);
  // Every stage recovers from snapshots (its layers exist on its replicas at most); stages
  // start from their first replica's weights, as Prepare's broadcast under ddp.
  snapshots_ = strategy_->RecoversFromSnapshots();
  LAUNCH_RETURN_IF_ERROR(StartStrategy(snapshots_, "with " + layout_->Describe()));
  strategy_->TakeStepStats();
  pairs_.emplace_back();
  pairs_.back().module = module_;
  pairs_.back().model = model_;
  pairs_.back().optimizer = optimizer_;
  pairs_.back().strategy = strategy_.get();
  RecordBaseLearningRates(pairs_.back());
  prepared_ = true;
  MarkBoundary();
  return Status::Ok();
}

Status Accelerator::StartStrategy(bool recoverable, const std::string& why_not) {
  recover_ = env_.recover_in_place && pg_ && recoverable;
  if (!recover_) snapshots_ = false;
  if (env_.recover_in_place && pg_ && !recover_) {
    const std::string refusal = strategy_->InPlaceRefusal();
    Print(!refusal.empty()
              ? "train: in-place recovery: " + refusal +
                    ": a lost rank restarts every worker (from the last checkpoint)"
              : "train: in-place recovery needs ddp, zero or local_sgd (under any layout); " +
                    why_not + " a lost rank restarts every worker (from the last checkpoint)");
  }
  // From here a lost rank of this process is replaced alone (its agent asks the file): the
  // group has formed and the mode can hand a replacement its state.
  if (recover_) (void)DeclareInPlaceRecovery();
  if (recover_ && env_.recover_generation > 0) {
    // A replacement: the run's state comes from a live peer (ExchangeState) or its keeper's
    // copy of the lost rank's snapshot (RollBack), not from rank 0's broadcast, which the
    // survivors are not making.
    LAUNCH_RETURN_IF_ERROR(TakeStateOverNewGroup());
    joined_from_peer_ = true;
    ++recoveries_;  // the one this process joined in (the survivors count it in Recover)
    std::fprintf(stderr,
                 "train: rank %d: replacement (generation %d) took the %s of step %lld from "
                 "rank %d, %.2f s after it began to join\n",
                 rank(), generation_, snapshots_ ? "snapshot" : "state",
                 static_cast<long long>(step_), recovered_from_,
                 Seconds(std::chrono::steady_clock::now() - created_at_));
  } else {
    strategy_->Setup();  // broadcast (ddp, local_sgd, a pipeline's replicas), reducer (ddp)
  }
  if (recover_) {
    // A loss this rank's own transport would tell it of late (comm/loss_watch.h).
    loss_watch_ = std::make_unique<LossWatch>();
    LAUNCH_RETURN_IF_ERROR(WatchGroup(*loss_watch_, env_, timeout_, Groups(), generation_));
  }
  return Status::Ok();
}

void Accelerator::RecordBaseLearningRates(Pair& pair) {
  pair.base_lrs.clear();
  for (auto& group : pair.optimizer->param_groups())
    pair.base_lrs.push_back(group.options().get_lr());
}

std::vector<torch::Tensor> Accelerator::parameters() const {
  return model_ ? model_->Parameters() : std::vector<torch::Tensor>();
}

// --- Data ------------------------------------------------------------------------------------

void Accelerator::AttachCursor(std::shared_ptr<LoaderCursor> cursor) {
  // Only the accelerator holds the training cursor once its loader and every copy are gone.
  if (cursor_ && cursor_.use_count() > 1) return;
  if (cursor_ && !restored_cursor_) {
    // A training loader made anew (e.g. each epoch) goes on where the last one stood.
    LoaderCursor at;
    at.epoch = cursor_->epoch;
    at.batch = cursor_->batch;
    at.start = cursor_->start;
    restored_cursor_ = at;
  }
  cursor_ = std::move(cursor);
  ApplyRestoredCursor();
}

void Accelerator::Served(const std::shared_ptr<LoaderCursor>& cursor, int64_t rows) {
  CheckNoStrayGradients();  // the first batch after a ported loop's loss.backward()
  if (cursor == cursor_) CountSamples(rows);
  if (training_confirmed_) return;
  last_served_ = cursor;
  last_served_rows_ = rows;
}

void Accelerator::ConfirmTrainingCursor() {
  if (training_confirmed_) return;
  std::shared_ptr<LoaderCursor> last = last_served_.lock();
  if (!last) return;  // no loader served yet (or the loop brings its own data)
  training_confirmed_ = true;
  last_served_.reset();
  if (last == cursor_) return;
  // A loader prepared before the training loader (a validation set) was the training cursor
  // until now: what it counted is not training.
  LAUNCH_CHECK(!restored_before_confirmed_,
               "the loop trains on a loader prepared after another one, but LoadState gave the "
               "checkpoint's position to the first loader PrepareDataLoader made; the batch "
               "just served came from the start of the data. Prepare the training loader "
               "first (or make the other an evaluation loader: PrepareEvalLoader)");
  Print(
      "train: the loop trains on a loader prepared after another one: that one is the "
      "training loader (epoch, samples seen, checkpoint position), not the first");
  cursor_ = std::move(last);
  samples_seen_ = last_served_rows_;
  samples_seen_global_ = last_served_rows_ * data_parallel_size();
}

void Accelerator::ApplyRestoredCursor() {
  if (!cursor_ || !restored_cursor_) return;
  LoaderCursor& c = *cursor_;
  c.epoch = restored_cursor_->epoch;
  c.start = restored_cursor_->start;
  c.batches_this_epoch =
      ShardedSampler::BatchesFrom(c.num_samples, c.global_batch, c.batches_per_epoch, c.start);
  c.batch = restored_cursor_->batch;
  const int64_t start = c.start, rest = c.num_samples - c.start, dealt = c.batches_this_epoch;
  // Nothing left of the epoch (its rest is smaller than a global batch, or the batch size
  // grew): the next epoch.
  if (c.batch >= c.batches_this_epoch) c.StartEpoch(c.epoch + 1);
  if (resharded_from_ > 0) {
    Print("train: the checkpoint was written by " + std::to_string(resharded_from_) +
          " data-parallel ranks after " + std::to_string(start) + " of epoch " +
          std::to_string(restored_cursor_->epoch) + "'s " + std::to_string(c.num_samples) +
          " samples; the other " + std::to_string(rest) + " are dealt over " +
          std::to_string(data_parallel_size()) + " ranks (rank r takes positions " +
          std::to_string(start) + " + r, " + std::to_string(start) + " + r + " +
          std::to_string(data_parallel_size()) + ", ...): " + std::to_string(dealt) +
          " batches of " + std::to_string(c.global_batch / data_parallel_size()) +
          " per rank, the epoch's last " + std::to_string(rest - dealt * c.global_batch) +
          " samples (less than a global batch) skipped; later epochs as usual (" +
          std::to_string(c.batches_per_epoch) + " batches per rank)");
    resharded_from_ = 0;
  }
  restored_cursor_.reset();  // once: a later loader is not moved by it
  restored_before_confirmed_ = !training_confirmed_;
  if (prepared_) MarkBoundary();
}

void Accelerator::TraceBatch(int64_t epoch, const std::vector<int64_t>& positions,
                             const std::vector<int64_t>& indices) {
  std::string line = std::to_string(step_ + 1) + " " + std::to_string(epoch);
  for (size_t i = 0; i < indices.size(); ++i)
    line += " " + std::to_string(positions[i]) + ":" + std::to_string(indices[i]);
  line += "\n";
  // One write per batch on an O_APPEND file: a kill never leaves half a line before the next.
  if (::write(trace_fd_, line.data(), line.size()) != static_cast<ssize_t>(line.size()))
    std::fprintf(stderr, "train: warning: LAUNCH_TRACE_SAMPLES: short write\n");
}

// --- One micro-batch -------------------------------------------------------------------------

void Accelerator::Accumulate() {
  LAUNCH_CHECK(prepared_);
  CheckNoStrayGradients();
  ConfirmTrainingCursor();
  const bool end_of_data = options_.sync_with_dataloader && cursor_ && cursor_->last_was_end;
  const bool closes = micro_in_window_ + 1 >= options_.gradient_accumulation_steps || end_of_data;
  if (micro_in_window_ == 0) Timeline::Get().BeginStep(step_ + 1);
  sync_ = strategy_->SyncGradients(closes);
  window_closes_ = closes;
  // The first snapshot holds what Prepare and LoadState left; after a recovery, a new one.
  // Taken here, as the next step begins, rather than at the boundary: after the last step there
  // is none, and the run does not wait for a copy nobody will use.
  if (snapshots_ && micro_in_window_ == 0 &&
      (snapshot_due_ || (snapshots_held_.empty() && !pending_snapshot_))) {
    snapshot_due_ = false;
    TakeSnapshot();
  }
  // (The ranks of a tensor and context group draw alike: ParallelLayout::RandomStream.)
  if (recover_)
    torch::manual_seed(
        MicroBatchSeed(options_.seed, layout_->RandomStream(), step_, micro_in_window_));
  Guarded([&] {
    for (Pair& pair : pairs_)
      if (pair.strategy) pair.strategy->BeforeForward(sync_ && pair.no_sync == 0);
  });
  for (Pair& pair : pairs_) {
    pair.stepped = false;
    pair.backward_in_micro = false;
  }
  counted_ = false;
  in_micro_ = true;
  micro_open_ = true;
}

void Accelerator::Backward(const torch::Tensor& loss) {
  // dp's replicas exist only inside ForwardBackward: a loss computed by the caller comes from
  // replica 0 alone, which would then train on the whole batch while the others sit idle.
  if (strategy_ && strategy_->RunsForwardBackward())
    throw compat::MakeError(std::string("Accelerator::Backward: ") + strategy_->Name() +
                            " runs the forward and backward passes itself (dp: every replica's, "
                            "a pipeline: its stage's micro-batches); call ForwardBackward(batch, "
                            "fn) instead of a forward of your own and Backward(loss)");
  if (!micro_open_) Accumulate();
  // One model: it takes part whatever the graph holds (as before several were possible).
  std::vector<Pair*> reached =
      pairs_.size() == 1 ? std::vector<Pair*>{&pairs_[0]} : PairsReachedBy(loss);
  // A loss whose every model already stepped in this micro-batch could only be stepped in the
  // next one: the loop began its next iteration without Accumulate(). (The generator's loss
  // of a GAN reaches the stepped discriminator too, but also the generator.)
  LAUNCH_CHECK(
      pairs_.size() == 1 || reached.empty() ||
          !std::all_of(reached.begin(), reached.end(), [](const Pair* p) { return p->stepped; }),
      "Backward: every model this loss reaches already stepped in this micro-batch; "
      "with several prepared models call Accumulate() at the start of every iteration");
  // After a lost peer (in-place recovery) the rest of the step is abandoned: Step() recovers.
  Guarded([&] {
    for (Pair* pair : reached) {
      const bool synced = sync_ && pair->no_sync == 0;
      // A model's second backward in one micro-batch (the discriminator under the generator's
      // loss): PyTorch's DDP ran the model's forward hook before it, which rebuilds the reducer's
      // buckets after its first iteration; without it the reducer records the parameters' ready
      // order twice and refuses to rebuild. (Buffers, too, are then rank 0's, as that forward's.)
      if (pair->backward_in_micro) pair->strategy->BeforeForward(synced);
      pair->strategy->BeforeBackward(loss, synced);
      pair->backward_in_micro = true;
    }
    // Accelerate's convention: the loss of every micro-batch is divided by N.
    {
      // Includes waiting for the last buckets' all-reduces (the Reducer's final callback).
      Timeline::Scope span("train", sync_ ? "backward" : "backward (no_sync)");
      torch::Tensor scaled = loss / static_cast<double>(options_.gradient_accumulation_steps);
      // fp16: scaler.scale(loss) after accelerate's division, as accelerator.backward does.
      if (scaler_) scaled = scaled * static_cast<double>(scaler_->scale());
      scaled.backward();
    }
    for (Pair* pair : reached) pair->strategy->AfterBackward(sync_ && pair->no_sync == 0);
  });
  backward_since_step_ = true;
  for (Pair* pair : reached) {
    pair->took_part = true;
    // Only NoSync holds a step back: a micro-batch that closes the window steps also where
    // the strategy never all-reduces gradients (Local SGD, none).
    pair->unsynced = pair->no_sync > 0;
  }
  EndMicroBatch();
}

void Accelerator::EndMicroBatch() {
  if (!in_micro_) return;  // several models: the micro-batch's first Backward counted it
  in_micro_ = false;
  ++micro_in_window_;
  // One model: the micro-batch ends here (the next Backward starts one). Several: it lasts
  // until the next Accumulate() or Step(), for the other models' Backward and Step calls.
  if (pairs_.size() <= 1) micro_open_ = false;
}

torch::Tensor Accelerator::ContextShard(const torch::Tensor& t, int64_t dim) const {
  if (!context_group_ || !t.defined() || t.dim() <= dim) return t;
  const int parts = context_group_->size();
  TORCH_CHECK(t.size(dim) % parts == 0, "train.parallel.context: a sequence of ", t.size(dim),
              " does not split over ", parts, " context-parallel ranks");
  return t.chunk(parts, dim)[static_cast<size_t>(context_group_->rank())].contiguous();
}

torch::Tensor Accelerator::ForwardBackward(const torch::data::Example<>& batch,
                                           const ChunkLoss& fn) {
  if (!context_group_) return ForwardBackwardWith(batch, fn, criterion_);
  torch::Tensor loss =
      ForwardBackwardWith({ContextShard(batch.data), ContextShard(batch.target)}, fn, criterion_);
  // Each rank's loss is its part's; the batch's is their mean (the parts are equal).
  torch::Tensor mean = loss.to(torch::kDouble).clone();
  if (!Guarded([&] { context_group_->AllReduceSum(mean); })) return loss;
  return (mean / context_group_->size()).to(loss.scalar_type());
}

torch::Tensor Accelerator::ForwardBackwardWith(const torch::data::Example<>& batch,
                                               const ChunkLoss& fn, const CriterionFn& criterion) {
  if (!in_micro_) Accumulate();
  if (peer_lost_) {  // the step is abandoned; Step() recovers
    EndMicroBatch();
    return torch::zeros({}, torch::kFloat);
  }
  if (!strategy_->RunsForwardBackward()) {
    torch::Tensor loss;
    // A forward communicates too (ZeRO stage 3 gathers each unit): a lost peer abandons it.
    const bool ran = Guarded([&] {
      Timeline::Scope span("train", "forward");
      AutocastScope amp = Autocast();
      loss = fn(*module_, batch);
    });
    if (!ran) {
      EndMicroBatch();
      return torch::zeros({}, torch::kFloat);
    }
    Backward(loss);
    return loss.detach();
  }
  const double scale = loss_scale() / static_cast<double>(options_.gradient_accumulation_steps);
  Timeline::Scope span("train", "forward + backward (replicas)");
  torch::Tensor loss;
  // A pipeline's sends and receives, and its data group's reductions: a lost peer abandons
  // the step there too.
  const bool ran = Guarded([&] {
    loss = strategy_->ForwardBackward(
        batch.data, batch.target,
        [&fn, this](Model& replica, const torch::Tensor& x, const torch::Tensor& y) {
          AutocastScope amp = Autocast();  // on the replica's own thread (dp)
          return fn(replica.module(), torch::data::Example<>(x, y));
        },
        criterion, scale);
  });
  EndMicroBatch();
  if (!ran) return torch::zeros({}, torch::kFloat);
  backward_since_step_ = true;
  return loss;
}

torch::Tensor Accelerator::PipelineForwardBackward(const torch::data::Example<>& batch,
                                                   const CriterionFn& loss_fn) {
  LAUNCH_CHECK(AcceleratorInternals(*this).pipeline() != nullptr,
               "PipelineForwardBackward: not a pipeline");
  torch::Tensor loss = ForwardBackwardWith(batch, nullptr, loss_fn);
  return strategy_->HoldsLoss() ? loss : torch::Tensor();
}

torch::Tensor Accelerator::PipelineForward(const torch::Tensor& inputs) {
  PipelineEngine* engine = AcceleratorInternals(*this).pipeline();
  LAUNCH_CHECK(engine != nullptr, "PipelineForward: not a pipeline");
  return engine->Forward(inputs);
}

double Accelerator::ClipGradNorm(double max_norm) {
  // accelerate's clip_grad_norm_: the gradients unscaled first (once per step), so that the
  // norm is the true one. Only where the window closes: a later micro-batch's backward would add
  // scaled gradients to unscaled ones.
  if (!pairs_.empty() && window_closes_) Unscale(pairs_.front());
  return strategy_->ClipGradNorm(max_norm);
}

bool Accelerator::Step() {
  LAUNCH_CHECK(prepared_);
  redo_ = false;
  if (in_micro_) EndMicroBatch();  // a micro-batch whose loss did not need a backward
  micro_open_ = false;
  if (peer_lost_) {
    for (Pair& pair : pairs_) pair.unscaled = false;  // the abandoned step's gradients are gone
    const Status recovered = Recover();
    if (!recovered.ok())
      throw compat::MakeError("in-place recovery failed (the agent restarts every worker): " +
                              recovered.ToString());
    redo_ = true;
    return false;
  }
  CheckNoStrayGradients();
  if (!backward_since_step_) CheckNoUnsyncedGradients();
  if (!window_closes_) return false;
  backward_since_step_ = false;
  // The models a Backward reached (all when none was), less those that stepped in this
  // micro-batch or whose gradients stayed local (NoSync).
  std::vector<Pair*> pairs;
  const bool any = std::any_of(pairs_.begin(), pairs_.end(),
                               [](const Pair& p) { return p.took_part || p.stepped; });
  for (Pair& pair : pairs_)
    if ((pair.took_part || !any) && !pair.unsynced && !pair.stepped) pairs.push_back(&pair);
  window_closes_ = false;
  if (pairs.empty()) {
    for (Pair& pair : pairs_) pair.unscaled = false;
    // Every model is inside NoSync: the window ends without a step.
    if (!counted_) micro_in_window_ = 0;
    return false;
  }
  StepPairs(pairs);
  return true;
}

void Accelerator::StepPairs(const std::vector<Pair*>& pairs) {
  Timeline::Scope span("train", "optimizer");
  step_skipped_ = false;
  for (Pair* pair : pairs) {
    if (lr_schedule_) {
      // At the steps the optimizer took (fp16: less the skipped ones, as accelerate's scheduler
      // skips with the optimizer); set on a skipped step too, which the next one repeats.
      const double value = lr_schedule_(step_ - skipped_steps());
      auto& groups = pair->optimizer->param_groups();
      for (size_t g = 0; g < groups.size(); ++g) {
        // A group added after Prepare: its rate when first seen is its base (LambdaLR's
        // initial_lr).
        if (g == pair->base_lrs.size()) pair->base_lrs.push_back(groups[g].options().get_lr());
        groups[g].options().set_lr(lr_is_factor_ ? pair->base_lrs[g] * value : value);
      }
    }
    pair->took_part = false;
    pair->stepped = true;
    // The norm and the step communicate too (ZeRO: an all-reduce, an all-gather): a lost peer
    // leaves the rest of the step undone (Step() then recovers).
    if (scaler_) {
      // fp16: inf or nan anywhere in the gradients skips the step (scaler.step's rule). The
      // ranks that split them agree through the norm, reduced where the strategy splits them
      // (zero's shards, a pipeline's stages, tensor groups); whole gradients are equal anyway.
      // With clipping, clipping's own norm is the one asked (one reduction, not two): clipping
      // gradients that are then dropped changes nothing.
      Unscale(*pair);
      bool finite = true;
      const bool checked = Guarded([&] {
        finite = std::isfinite(options_.max_grad_norm > 0
                                   ? pair->strategy->ClipGradNorm(options_.max_grad_norm)
                                   : pair->strategy->GradNormSquared());
      });
      pair->unscaled = false;
      // A lost peer abandoned the step (Step() recovers): the scale stays the boundary's.
      if (checked) scaler_->Update(!finite);
      if (!finite) {
        step_skipped_ = true;
        pair->strategy->DropGradients();
        continue;
      }
    } else if (options_.max_grad_norm > 0) {
      Guarded([&] { pair->strategy->ClipGradNorm(options_.max_grad_norm); });
    }
    Guarded([&] { pair->strategy->Step(*pair->optimizer); });
  }
  // One optimizer step of the run per micro-batch, however many models stepped in it.
  const bool first = !counted_;
  if (first) {
    ++step_;
    micro_last_step_ = micro_in_window_;
    micro_in_window_ = 0;
    counted_ = true;
  }
  Guarded([&] {
    for (Pair* pair : pairs) pair->strategy->AfterOptimizerStep(step_);
  });
  if (first) {
    if (save_pending_) PollPendingSave();
    MarkBoundary();
    if (snapshots_ && step_ % std::max<int64_t>(1, options_.recover_snapshot_every) == 0)
      snapshot_due_ = true;  // taken by the next step's first micro-batch
    if (report_cost_since_ && recovered_from_ == rank()) {
      // The recovery's cost as the job sees it: from the failure to the redone step, done.
      std::fprintf(stderr,
                   "train: rank %d: recovery %lld: step %lld redone %.2f s after the failure was "
                   "detected (group generation %d, state from rank %d)\n",
                   rank(), static_cast<long long>(recoveries_), static_cast<long long>(step_),
                   Seconds(std::chrono::steady_clock::now() - *report_cost_since_), generation_,
                   recovered_from_);
    }
    report_cost_since_.reset();
    Timeline::Get().EndStep();
  }
}

double Accelerator::learning_rate() const {
  const auto& groups = optimizer_->param_groups();
  return groups.empty() ? 0.0 : groups.front().options().get_lr();
}

std::string Accelerator::allreduce_transport() const {
  return pg_ ? pg_->allreduce_transport() : std::string();
}

Status Accelerator::Finish() {
  Status finished = [&]() -> Status {
    // A peer lost at the last step boundary: its replacement comes straight here. Not where
    // the recovery goes back to a snapshot: the steps since it would not be redone.
    if (peer_lost_ && snapshots_)
      return Status::PeerLost("a peer was lost in the run's last step (" + lost_what_ +
                              "), which a recovery from the snapshot of an earlier step could "
                              "not redo here: every worker restarts");
    if (peer_lost_) LAUNCH_RETURN_IF_ERROR(Recover());
    LAUNCH_RETURN_IF_ERROR(WaitForCheckpoint());
    FinishSnapshot(/*block=*/true);
    finished_ = true;  // saves from here on are synchronous: the run is about to end
    for (Pair& pair : pairs_)
      if (pair.strategy) pair.strategy->Finish(step_);
    SyncBuffers();
    LAUNCH_RETURN_IF_ERROR(CheckReplicasAgree());
    if (options_.timeline.steps > 0) WriteTimeline();
    return Status::Ok();
  }();
  // Said here too: a program that only tests ok() (`if (!accel->Finish().ok()) return 1;`)
  // would otherwise end with nothing on stderr for launch's failure report to show.
  if (!finished.ok())
    std::fprintf(stderr, "train: rank %d: %s\n", rank(), finished.ToString().c_str());
  return finished;
}

void Accelerator::WriteTimeline() {
  // Each rank writes its events; once all have (the barrier), the main process merges them.
  // A failure costs the trace, never the run.
  const std::string dir = options_.output_dir + "/timeline";
  Status s = MakeDirs(dir);
  if (s.ok()) s = Timeline::Get().WriteRank(dir + "/rank" + std::to_string(rank()) + ".json");
  if (!s.ok())
    std::fprintf(stderr, "train: warning: rank %d could not write its timeline: %s\n", rank(),
                 s.message().c_str());
  Barrier();
  if (rank() != 0) return;
  std::vector<std::string> files;
  for (int r = 0; r < world_size(); ++r)
    files.push_back(dir + "/rank" + std::to_string(r) + ".json");
  s = Timeline::Merge(files, options_.output_dir + "/timeline.json");
  if (!s.ok())
    std::fprintf(stderr, "train: warning: could not merge the ranks' timelines: %s\n",
                 s.message().c_str());
  else
    std::printf("train: wrote %s/timeline.json (open it in ui.perfetto.dev)\n",
                options_.output_dir.c_str());
  std::fflush(stdout);
}

void Accelerator::SyncBuffers() {
  Guarded([&] {
    for (Pair& pair : pairs_) pair.strategy->SyncBuffers();
  });
}

Status Accelerator::SaveForPython(const std::string& path) {
  if (!model_ || options_.parallel.pipelined())
    return Status::InvalidArgument(
        "SaveForPython: needs a model prepared with Prepare (a pipeline stage writes its own "
        "module: trainer::SaveForPython in model.h)");
  SyncBuffers();
  if (tensor_group_) {
    // The whole model: every rank of a tensor group gathers its shards (COLLECTIVE).
    auto whole = WholeStateOf(*module_);
    return IsMainProcess() ? SaveStateForPython(whole, path) : Status::Ok();
  }
  return IsMainProcess() ? ::launch::trainer::SaveForPython(*model_, path) : Status::Ok();
}

}  // namespace launch::trainer
