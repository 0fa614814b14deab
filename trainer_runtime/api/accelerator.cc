#include "trainer_runtime/api/accelerator.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "base/environment.h"
#include "base/exit_status.h"
#include "base/files.h"
#include "base/strings.h"
#include "config/train_keys.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/model/model.h"
#include "trainer_runtime/parallel/layout.h"
#include "trainer_runtime/parallel/pipeline_engine.h"
#include "trainer_runtime/parallel/strategy.h"
#include "trainer_runtime/parallel/strategy_factory.h"
#include "trainer_runtime/state/checkpoint.h"
#include "trainer_runtime/util/loop_util.h"
#include "trainer_runtime/util/timeline.h"

namespace launch::trainer {
namespace {

using config::ParallelMode;

// The one signal flag: the last signal received, 0 when none. A stop (SIGTERM,
// SIGINT) outranks a checkpoint request (SIGUSR1, SIGUSR2). PollSignals reads and clears it at
// a step boundary, where the state is consistent.
volatile std::sig_atomic_t g_signal = 0;

extern "C" void OnSignal(int signo) {
  const bool stop_pending = g_signal == SIGTERM || g_signal == SIGINT;
  if ((signo == SIGUSR1 || signo == SIGUSR2) && stop_pending) return;
  g_signal = signo;
}

bool IsStop(int signo) { return signo == SIGTERM || signo == SIGINT; }

// The run settings a checkpoint was written with (Accelerator::AddRunSetting), "key: value"
// per line: small, and readable by whoever wonders why a resume was refused.
constexpr const char* kRunFile = "run.txt";

std::string StepDir(const std::string& dir, int64_t step) {
  return dir + "/step" + std::to_string(step);
}

// Removes `dir`'s step<N> folders other than step<keep> (files first; they hold no folders).
void RemoveOtherSteps(const std::string& dir, int64_t keep) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  std::vector<std::string> stale;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    long long n = 0;
    if (StartsWith(name, "step") && ParseInt64(name.substr(4), &n) && n != keep)
      stale.push_back(dir + "/" + name);
  }
  ::closedir(d);
  for (const std::string& path : stale) {
    if (DIR* sd = ::opendir(path.c_str())) {
      while (dirent* e = ::readdir(sd)) {
        std::string name = e->d_name;
        if (name != "." && name != "..") std::remove((path + "/" + name).c_str());
      }
      ::closedir(sd);
    }
    ::rmdir(path.c_str());
  }
}

// The seed of the CPU generator of a rank that resumes a checkpoint holding no RNG state of its
// own (it joined at a world-size change): distinct per rank and per resume step, and distinct
// from the streams `train` seeds at start (seed + 1000003 * (rank + 1)).
uint64_t NewRankSeed(uint64_t seed, int rank, int64_t step) {
  uint64_t h = seed * 0x9E3779B97F4A7C15ull + 0x7F4A7C15D1B54A32ull;
  for (uint64_t v : {static_cast<uint64_t>(rank), static_cast<uint64_t>(step)})
    h = (h ^ (v + 0x632BE59BD9B4E019ull)) * 0xBF58476D1CE4E5B9ull;
  return h ^ (h >> 31);
}

}  // namespace

Accelerator::Accelerator(const config::TrainConfig& options, const DistEnv& env)
    : options_(options), env_(env), run_settings_(config::TrajectorySettings(options)) {
  bf16_ = options_.mixed_precision == "bf16";
  Timeline::Get().Configure(env_.rank, options_.timeline.from_step, options_.timeline.steps);
}

void Accelerator::SetLayout(const ParallelLayout& layout) {
  stages_ = layout.degree(Axis::kStage);
  stage_ = layout.coordinate(Axis::kStage);
  data_world_ = layout.degree(Axis::kData);
  data_rank_ = layout.coordinate(Axis::kData);
  main_rank_ = layout.main_rank();
  origin_data_world_ = data_world_;
}

Accelerator::~Accelerator() {
  if (trace_fd_ >= 0) ::close(trace_fd_);
  // A save never committed (the program ends on an error): its writer goes too, and is reaped.
  if (writer_pid_ > 0) {
    ::kill(writer_pid_, SIGKILL);
    while (::waitpid(writer_pid_, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
}

StatusOr<std::unique_ptr<Accelerator>> Accelerator::Create(const config::TrainConfig& options,
                                                           double init_timeout_s) {
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
                                                           const DistEnv& env,
                                                           double init_timeout_s) {
  // The configuration's own rules (config/train_keys.h), for options built in code: what
  // launch and train checked with the keys' places, here with the real world size.
  LAUNCH_ASSIGN_OR_RETURN(const ParallelLayout layout, ParallelLayout::Create(options, env));
  if (options.mixed_precision != "no" && options.mixed_precision != "bf16")
    return Status::InvalidConfig(
        "mixed_precision: '" + options.mixed_precision +
        "' needs a GPU (CUDA autocast) and this LibTorch is CPU-only; use bf16 (CPU autocast) "
        "or no");
  std::unique_ptr<Accelerator> accel(new Accelerator(options, env));
  accel->SetLayout(layout);
  if (const int cuda = CudaDeviceOf(env); cuda >= 0) {
    // The GPU path is DDP over NCCL (and one process); the other modes move tensors between
    // threads, stages and replicas on the CPU.
    if (options.parallel.mode != ParallelMode::kNone && options.parallel.mode != ParallelMode::kDdp)
      return Status::InvalidConfig(std::string("train.parallel.mode: ") + accel->mode_name() +
                                   " runs on the CPU only; on GPUs use ddp or none, or run "
                                   "launch --cpu");
    if (accel->bf16_)
      return Status::InvalidConfig(
          "mixed_precision: bf16 is CPU autocast here; on GPUs use no, or run launch --cpu");
    accel->device_ = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(cuda));
  }
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(init_timeout_s * 1000));
  if (env.distributed()) {
    LAUNCH_ASSIGN_OR_RETURN(accel->pg_, CreateProcessGroup(env, timeout));
  }
  if (options.parallel.mode == ParallelMode::kPipeline) {
    LAUNCH_ASSIGN_OR_RETURN(accel->pipeline_,
                            PipelineEngine::Create(options, env, layout, accel->pg_, timeout));
  }
  return accel;
}

const char* Accelerator::mode_name() const {
  if (pipeline_) return "pipeline";
  if (strategy_) return strategy_->Name();
  return config::ToString(options_.parallel.mode);
}

void Accelerator::Print(const std::string& line) const {
  if (!IsMainProcess()) return;
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
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
  LAUNCH_CHECK(!prepared_);
  if (pipeline_)
    return Status::InvalidConfig(
        "train.parallel.mode is pipeline: hand over this rank's stage with PreparePipeline");
  if (!model || !optimizer) return Status::InvalidArgument("Prepare: model and optimizer needed");
  module_ = std::move(model);
  // In place (Module::to replaces each parameter's data), so the optimizer's references hold.
  if (!device_.is_cpu()) module_->to(device_);
  model_ = std::make_shared<Model>(module_);
  optimizer_ = std::move(optimizer);
  // A model whose parameters are all frozen trains nothing: say so instead of a Reducer error.
  if (model_->NamedParameters().empty())
    return Status::InvalidConfig("the model has no parameters that require grad");
  if (options_.parallel.comm_hook == config::CommHook::kBf16 && pg_ && !pg_->shm() &&
      !pg_->hierarchical())
    return Status::InvalidConfig(
        "train.parallel.comm_hook: bf16 all-reduces the buckets in bfloat16, which this "
        "LibTorch's Gloo cannot do; it needs shared memory on every host (the shared-memory "
        "or hierarchical transport), here: " +
        pg_->allreduce_transport());
  LAUNCH_ASSIGN_OR_RETURN(strategy_, CreateStrategy(options_, model_.get(), optimizer_.get(), pg_));
  strategy_->Setup();  // broadcast (ddp, local_sgd), reducer (ddp)
  strategy_->TakeStepStats();
  prepared_ = true;
  return Status::Ok();
}

Status Accelerator::PreparePipeline(torch::nn::AnyModule stage,
                                    std::shared_ptr<torch::optim::Optimizer> optimizer) {
  LAUNCH_CHECK(!prepared_);
  if (!pipeline_)
    return Status::InvalidConfig("PreparePipeline needs train.parallel.mode: pipeline (got " +
                                 std::string(config::ToString(options_.parallel.mode)) + ")");
  module_ = stage.ptr();
  model_ = std::make_shared<Model>(module_);
  optimizer_ = std::move(optimizer);
  pipeline_->SetStage(
      model_, [stage](const torch::Tensor& x) mutable { return stage.forward<torch::Tensor>(x); });
  prepared_ = true;
  return Status::Ok();
}

std::vector<torch::Tensor> Accelerator::parameters() const {
  return model_ ? model_->Parameters() : std::vector<torch::Tensor>();
}

// --- Data ------------------------------------------------------------------------------------

void Accelerator::AttachCursor(std::shared_ptr<LoaderCursor> cursor) {
  cursor_ = std::move(cursor);
  if (!restored_cursor_) return;
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
          std::to_string(data_world_) + " ranks (rank r takes positions " + std::to_string(start) +
          " + r, " + std::to_string(start) + " + r + " + std::to_string(data_world_) + ", ...): " +
          std::to_string(dealt) + " batches of " + std::to_string(c.global_batch / data_world_) +
          " per rank, the epoch's last " + std::to_string(rest - dealt * c.global_batch) +
          " samples (less than a global batch) skipped; later epochs as usual (" +
          std::to_string(c.batches_per_epoch) + " batches per rank)");
    resharded_from_ = 0;
  }
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
  const bool end_of_data = options_.sync_with_dataloader && cursor_ && cursor_->last_was_end;
  const bool closes = micro_in_window_ + 1 >= options_.gradient_accumulation_steps || end_of_data;
  if (micro_in_window_ == 0) Timeline::Get().BeginStep(step_ + 1);
  sync_ = pipeline_ ? closes : strategy_->SyncGradients(closes);
  window_closes_ = closes;
  if (strategy_) strategy_->BeforeForward(sync_);
  in_micro_ = true;
}

void Accelerator::Backward(const torch::Tensor& loss) {
  // dp's replicas exist only inside ForwardBackward: a loss computed by the caller comes from
  // replica 0 alone, which would then train on the whole batch while the others sit idle.
  if (strategy_ && strategy_->RunsForwardBackward())
    throw compat::MakeError(
        "Accelerator::Backward: train.parallel.mode dp runs every replica's forward and backward "
        "itself; call ForwardBackward(batch, fn) instead of a forward of your own and "
        "Backward(loss)");
  if (!in_micro_) Accumulate();
  strategy_->BeforeBackward(loss, sync_);
  // Accelerate's convention: the loss of every micro-batch is divided by N.
  {
    // Includes waiting for the last buckets' all-reduces (the Reducer's final callback).
    Timeline::Scope span("train", sync_ ? "backward" : "backward (no_sync)");
    (loss / static_cast<double>(options_.gradient_accumulation_steps)).backward();
  }
  strategy_->AfterBackward(sync_);
  EndMicroBatch();
}

void Accelerator::EndMicroBatch() {
  in_micro_ = false;
  ++micro_in_window_;
}

torch::Tensor Accelerator::ForwardBackward(const torch::data::Example<>& batch,
                                           const ChunkLoss& fn) {
  LAUNCH_CHECK(!pipeline_);
  if (!in_micro_) Accumulate();
  if (!strategy_->RunsForwardBackward()) {
    torch::Tensor loss;
    {
      Timeline::Scope span("train", "forward");
      AutocastScope amp(bf16_);
      loss = fn(*module_, batch);
    }
    Backward(loss);
    return loss.detach();
  }
  const double scale = 1.0 / static_cast<double>(options_.gradient_accumulation_steps);
  Timeline::Scope span("train", "forward + backward (replicas)");
  torch::Tensor loss = strategy_->ForwardBackward(
      batch.data, batch.target,
      [&fn, this](Model& replica, const torch::Tensor& x, const torch::Tensor& y) {
        AutocastScope amp(bf16_);  // on the replica's own thread (dp)
        return fn(replica.module(), torch::data::Example<>(x, y));
      },
      criterion_, scale);
  EndMicroBatch();
  return loss;
}

torch::Tensor Accelerator::PipelineForwardBackward(
    const torch::data::Example<>& batch,
    const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>& loss_fn) {
  LAUNCH_CHECK(pipeline_ != nullptr);
  if (!in_micro_) Accumulate();
  const int64_t rows = pipeline_->first() ? batch.data.size(0) : batch.target.size(0);
  const double scale = 1.0 / static_cast<double>(options_.gradient_accumulation_steps);
  const double loss = pipeline_->ForwardBackward(batch.data, batch.target, rows, loss_fn, scale);
  window_loss_ += loss;
  EndMicroBatch();
  return pipeline_->last() ? torch::tensor(loss, torch::kDouble) : torch::Tensor();
}

torch::Tensor Accelerator::PipelineForward(const torch::Tensor& inputs) {
  LAUNCH_CHECK(pipeline_ != nullptr);
  return pipeline_->Forward(inputs);
}

double Accelerator::ClipGradNorm(double max_norm) {
  if (pipeline_) return pipeline_->ClipGradNorm(max_norm);
  return strategy_->ClipGradNorm(max_norm);
}

bool Accelerator::Step() {
  LAUNCH_CHECK(prepared_);
  if (in_micro_) EndMicroBatch();  // a micro-batch whose loss did not need a backward
  if (!window_closes_) return false;
  if (pipeline_) {
    Timeline::Scope span("train", "gradient all-reduce (stage replicas)");
    pipeline_loss_ = pipeline_->AllReduceGradients(window_loss_ / micro_in_window_);
    window_loss_ = 0;
  }
  Timeline::Scope span("train", "optimizer");
  if (options_.max_grad_norm > 0) ClipGradNorm(options_.max_grad_norm);
  if (lr_schedule_) {
    const double lr = lr_schedule_(step_);
    for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
  }
  if (pipeline_) {
    optimizer_->step();
    // Zero in place (not set to undefined) so gradient memory stays put across steps.
    for (auto& p : model_->Parameters())
      if (p.grad().defined()) p.mutable_grad().zero_();
  } else {
    strategy_->Step(*optimizer_);
  }
  ++step_;
  micro_last_step_ = micro_in_window_;
  micro_in_window_ = 0;
  window_closes_ = false;
  if (strategy_) strategy_->AfterOptimizerStep(step_);
  if (save_pending_) PollPendingSave();
  Timeline::Get().EndStep();
  return true;
}

double Accelerator::learning_rate() const {
  const auto& groups = optimizer_->param_groups();
  return groups.empty() ? 0.0 : groups.front().options().get_lr();
}

std::string Accelerator::allreduce_transport() const {
  return pg_ ? pg_->allreduce_transport() : std::string();
}

Status Accelerator::Finish() {
  LAUNCH_RETURN_IF_ERROR(WaitForCheckpoint());
  finished_ = true;  // saves from here on are synchronous: the run is about to end
  if (strategy_) strategy_->Finish(step_);
  SyncBuffers();
  if (options_.timeline.steps > 0) WriteTimeline();
  return Status::Ok();
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
  if (strategy_) strategy_->SyncBuffers();
  if (pipeline_) pipeline_->SyncBuffers();
}

Status Accelerator::SaveForPython(const std::string& path) {
  if (!model_ || pipeline_)
    return Status::InvalidArgument(
        "SaveForPython: needs a model prepared with Prepare (a pipeline stage writes its own "
        "module: trainer::SaveForPython in model.h)");
  SyncBuffers();
  return IsMainProcess() ? ::launch::trainer::SaveForPython(*model_, path) : Status::Ok();
}

// --- Across ranks ----------------------------------------------------------------------------

torch::Tensor& Accelerator::AllReduceSum(torch::Tensor& t) {
  // Through shared memory when the group has it: the trainer agrees on signals with this after
  // every step, and a Gloo round trip costs 0.2-2 ms on 2 busy cores (most of a small model's
  // step) against ~20 us. Not counted as gradient communication either way.
  ShmAllReduce* shm = pg_ ? pg_->shm() : nullptr;
  if (shm && ShmAllReduce::Supports({t}, c10d::AllreduceOptions())) {
    const Status status = shm->AllReduceNow(t);
    if (!status.ok()) throw compat::MakeError(status.ToString());
    return t;
  }
  if (c10d::ProcessGroup* pg = control()) {
    std::vector<at::Tensor> v = {t};
    pg->allreduce(v, c10d::AllreduceOptions())->wait();
  }
  return t;
}

double Accelerator::Mean(double value) {
  auto t = torch::tensor({value}, torch::kDouble);
  AllReduceSum(t);
  return t.item<double>() / world_size();
}

torch::Tensor Accelerator::Gather(const torch::Tensor& t) {
  c10d::ProcessGroup* pg = control();
  if (!pg) return t.clone();
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < world_size(); ++r) out[0].push_back(torch::empty_like(t));
  std::vector<at::Tensor> in = {t.contiguous()};
  pg->allgather(out, in, c10d::AllgatherOptions())->wait();
  return torch::cat(out[0]);
}

void Accelerator::Barrier() {
  if (c10d::ProcessGroup* pg = control()) pg->barrier(c10d::BarrierOptions())->wait();
}

bool Accelerator::CheckTrigger() {
  auto t = torch::tensor({trigger_ ? 1.0 : 0.0}, torch::kDouble);
  AllReduceSum(t);
  trigger_ = false;
  return t.item<double>() > 0;
}

// --- Signals and state -----------------------------------------------------------------------

void Accelerator::InstallSignalHandlers() {
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int signo : {SIGUSR1, SIGUSR2, SIGTERM, SIGINT}) sigaction(signo, &sa, nullptr);
}

SignalRequest Accelerator::PollSignals() {
  const int local = g_signal;
  if (local != 0) g_signal = 0;
  // Agree on the largest (stop, signal) any rank received: a stop anywhere stops everyone at
  // this step. Each rank marks its own in a presence vector, summed over the ranks (a sum, so it
  // takes the shared-memory path; see AllReduceSum).
  constexpr int kSignals = 65;  // signal numbers below 65; index = stop * kSignals + signo
  auto t = torch::zeros({2 * kSignals}, torch::kDouble);
  if (local > 0 && local < kSignals) t[(IsStop(local) ? kSignals : 0) + local] = 1.0;
  AllReduceSum(t);
  SignalRequest r;
  const auto seen = t.accessor<double, 1>();
  for (int code = 2 * kSignals - 1; code > 0; --code) {
    if (seen[code] == 0) continue;
    r.signal = code % kSignals;
    r.stop = code >= kSignals;
    r.checkpoint = true;
    break;
  }
  return r;
}

std::string Accelerator::StageFileName() const { return "stage" + std::to_string(stage_) + ".pt"; }

TrainState Accelerator::CurrentTrainState() const {
  TrainState state;
  state.step = step_;
  state.epoch = cursor_ ? cursor_->epoch : 0;
  state.batch_in_epoch = cursor_ ? cursor_->batch : 0;
  state.samples_seen = samples_seen_;
  state.world_size = world_size();
  state.data_world = data_world_;
  state.epoch_start = cursor_ ? cursor_->start : 0;
  state.epoch_offset = cursor_ ? cursor_->offset() : 0;
  state.samples_seen_global = samples_seen_global_;
  state.origin_data_world = origin_data_world_;
  state.anchor_step = schedule_anchor_.step;
  state.anchor_position = schedule_anchor_.position;
  state.anchor_slope = schedule_anchor_.slope;
  return state;
}

Status Accelerator::WriteStateFiles(const std::string& step_dir, const TrainState& state) {
  Status status = Status::Ok();
  if (pipeline_ && data_rank_ == 0)  // one copy per stage
    status = SaveModelState(step_dir + "/" + StageFileName(), *model_, *optimizer_);
  if (status.ok() && !pipeline_) status = strategy_->SaveModelState(step_dir, *optimizer_);
  if (status.ok())
    status = SaveRankState(step_dir + "/rank" + std::to_string(rank()) + ".pt", state);
  return status;
}

Status Accelerator::SaveState(const std::string& dir) {
  LAUNCH_CHECK(prepared_);
  // One save at a time: an earlier asynchronous one is committed first.
  LAUNCH_RETURN_IF_ERROR(WaitForCheckpoint());
  const auto start = std::chrono::steady_clock::now();
  const std::string step_dir = StepDir(dir, step_);
  const TrainState state = CurrentTrainState();
  Status status = MakeDirs(step_dir);
  if (status.ok() && rank() == 0) {
    std::string run;
    for (const auto& [key, value] : run_settings_) run += key + ": " + value + "\n";
    status = WriteFileAtomically(step_dir + "/" + kRunFile, run);
  }
  if (!finished_) ++checkpoints_saved_;
  if (!options_.checkpoint_async || finished_) {
    if (status.ok()) status = WriteStateFiles(step_dir, state);
    status = CommitState(dir, step_, status);
    if (!finished_)
      checkpoint_blocking_ms_ += 1000 * Seconds(std::chrono::steady_clock::now() - start);
    return status;
  }
  if (status.ok()) status = ForkStateWriter(step_dir, state);
  // Pending on every rank alike, so that all take part in the commit's collectives; a rank
  // that could not start its writer fails the commit for all.
  save_pending_ = true;
  pending_dir_ = dir;
  pending_step_ = step_;
  writer_status_ = status;
  checkpoint_blocking_ms_ += 1000 * Seconds(std::chrono::steady_clock::now() - start);
  return Status::Ok();
}

Status Accelerator::ForkStateWriter(const std::string& step_dir, const TrainState& state) {
  Timeline::Scope span("train", "checkpoint (fork)");
  // What needs the group happens here (zero stage 3 gathers its parameters); the child only
  // writes files.
  if (strategy_) strategy_->BeginSnapshot();
  std::fflush(nullptr);  // nothing buffered is written twice
  const pid_t parent = ::getpid();
  const pid_t child = ::fork();
  if (child == 0) {
    // The child dies with the worker, so a kill never leaves a writer behind, and it never
    // returns into the program: _exit skips every destructor and atexit handler.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    const Status written = WriteStateFiles(step_dir, state);
    if (!written.ok())
      std::fprintf(stderr, "train: rank %d: writing the checkpoint of step %lld: %s\n", rank(),
                   static_cast<long long>(state.step), written.message().c_str());
    ::_exit(written.ok() ? 0 : 1);
  }
  const int fork_errno = errno;
  if (strategy_) strategy_->EndSnapshot();
  if (child < 0)
    return Status::IoError("rank " + std::to_string(rank()) + ": the checkpoint of step " +
                           std::to_string(state.step) + ": fork: " + std::strerror(fork_errno));
  writer_pid_ = child;
  return Status::Ok();
}

Status Accelerator::CommitState(const std::string& dir, int64_t step, const Status& status) {
  // Everyone learns whether every file was written before `latest` moves.
  auto failed = torch::tensor({status.ok() ? 0.0 : 1.0}, torch::kDouble);
  AllReduceSum(failed);
  if (!status.ok()) return status;
  if (failed.item<double>() > 0)
    return Status::IoError("another rank failed to write its part of the checkpoint for step " +
                           std::to_string(step));
  if (rank() == 0) {
    LAUNCH_RETURN_IF_ERROR(WriteFileAtomically(dir + "/latest", std::to_string(step) + "\n"));
    RemoveOtherSteps(dir, step);  // superseded once `latest` names the new step
  }
  Barrier();  // nobody reads `latest` before it is written
  return Status::Ok();
}

void Accelerator::ReapStateWriter(bool block) {
  if (writer_pid_ <= 0) return;
  int wait_status = 0;
  pid_t got;
  do {
    got = ::waitpid(writer_pid_, &wait_status, block ? 0 : WNOHANG);
  } while (got < 0 && errno == EINTR);
  if (got == 0) return;  // still writing
  if (got < 0) {
    writer_status_ =
        Status::IoError("rank " + std::to_string(rank()) +
                        ": waiting for the checkpoint writer: " + std::strerror(errno));
  } else if (const ExitStatus exit = ExitStatus::FromWaitStatus(wait_status); !exit.success()) {
    writer_status_ = Status::IoError("rank " + std::to_string(rank()) +
                                     ": the process writing the checkpoint of step " +
                                     std::to_string(pending_step_) + " " + exit.ToString());
  }
  writer_pid_ = -1;
}

Status Accelerator::WaitForCheckpoint() {
  if (save_pending_) {
    Timeline::Scope span("train", "checkpoint (waiting for the writer)");
    const auto start = std::chrono::steady_clock::now();
    ReapStateWriter(/*block=*/true);
    save_pending_ = false;
    Status committed = CommitState(pending_dir_, pending_step_, writer_status_);
    checkpoint_blocking_ms_ += 1000 * Seconds(std::chrono::steady_clock::now() - start);
    if (!committed.ok()) return committed;
  }
  Status error = save_error_;
  save_error_ = Status::Ok();
  return error;
}

void Accelerator::PollPendingSave() {
  ReapStateWriter(/*block=*/false);
  // Ranks whose writer still runs: all act on the same count.
  auto writing = torch::tensor({writer_pid_ > 0 ? 1.0 : 0.0}, torch::kDouble);
  AllReduceSum(writing);
  if (writing.item<double>() > 0) return;
  save_pending_ = false;
  Status committed = CommitState(pending_dir_, pending_step_, writer_status_);
  if (!committed.ok()) {
    // Said now, and returned by the next SaveState, WaitForCheckpoint or Finish.
    std::fprintf(stderr, "train: rank %d: the checkpoint of step %lld was not committed: %s\n",
                 rank(), static_cast<long long>(pending_step_), committed.message().c_str());
    save_error_ = committed;
  }
}

void Accelerator::AddRunSetting(const std::string& key, const std::string& value) {
  for (auto& [k, v] : run_settings_)
    if (k == key) {
      v = value;
      return;
    }
  run_settings_.emplace_back(key, value);
}

std::vector<std::string> Accelerator::ChangedSettings(const std::string& dir) const {
  std::vector<std::string> changes;
  StatusOr<int64_t> latest = LatestStep(dir);
  if (!latest.ok()) return changes;
  StatusOr<std::string> text = ReadFile(StepDir(dir, *latest) + "/" + kRunFile);
  if (!text.ok()) return changes;
  std::vector<std::pair<std::string, std::string>> recorded;
  for (const std::string& line : Split(*text, '\n')) {
    const size_t colon = line.find(": ");
    if (colon != std::string::npos)
      recorded.emplace_back(line.substr(0, colon), line.substr(colon + 2));
  }
  auto find = [](const auto& list, const std::string& key) -> const std::string* {
    for (const auto& [k, v] : list)
      if (k == key) return &v;
    return nullptr;
  };
  for (const auto& [key, value] : run_settings_) {
    const std::string* old = find(recorded, key);
    if (!old) {
      changes.push_back(key + ": (not set) -> " + value);
    } else if (*old != value) {
      changes.push_back(key + ": " + *old + " -> " + value);
    }
  }
  for (const auto& [key, value] : recorded)
    if (!find(run_settings_, key)) changes.push_back(key + ": " + value + " -> (not set)");
  return changes;
}

StatusOr<int64_t> Accelerator::LatestStep(const std::string& dir) {
  StatusOr<std::string> latest = ReadFile(dir + "/latest");
  if (!latest.ok()) return Status::NotFound("no checkpoint in '" + dir + "'");
  long long step = 0;
  if (!ParseInt64(Trim(*latest), &step) || step < 0)
    return Status::IoError(dir + "/latest: expected a step number, got '" + *latest + "'");
  return static_cast<int64_t>(step);
}

StatusOr<bool> Accelerator::LoadState(const std::string& dir) {
  LAUNCH_CHECK(prepared_);
  StatusOr<int64_t> latest = LatestStep(dir);
  if (!latest.ok() && latest.status().code() != Status::Code::kNotFound) return latest.status();
  const int64_t mine = latest.ok() ? *latest : -1;
  // Every rank must resume the same step (or none): a rank that sees another file system would
  // otherwise run a different number of steps and hang in a mismatched collective.
  auto range =
      torch::tensor({static_cast<double>(mine), -static_cast<double>(mine)}, torch::kDouble);
  if (c10d::ProcessGroup* pg = control()) {
    std::vector<at::Tensor> v = {range};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MAX;
    pg->allreduce(v, opts)->wait();
  }
  const int64_t highest = static_cast<int64_t>(range[0].item<double>());
  const int64_t lowest = -static_cast<int64_t>(range[1].item<double>());
  if (highest != lowest)
    return Status::Internal("rank " + std::to_string(rank()) + " sees checkpoint step " +
                            (mine < 0 ? std::string("none") : std::to_string(mine)) + " in " + dir +
                            " but other ranks see steps " + std::to_string(lowest) + ".." +
                            std::to_string(highest) +
                            " (is the output folder on a file system every node shares?)");
  if (mine < 0) return false;
  // Every rank reads the same run.txt and holds the same settings, so all decide alike.
  const std::vector<std::string> changes = ChangedSettings(dir);
  if (!changes.empty() && !options_.resume_allow_changes)
    return Status::InvalidConfig(
        "the checkpoint in " + dir + " (step " + std::to_string(mine) +
        ") was written with other settings: " + Join(changes, "; ") +
        ". Resume with the settings it was written with, start a new run (another output_dir "
        "or `resume: never`), or set `train.resume_allow_changes: true` to continue with the "
        "new settings");
  if (!changes.empty())
    Print("train: resuming step " + std::to_string(mine) +
          " with changed settings: " + Join(changes, "; "));
  const std::string step_dir = StepDir(dir, mine);
  std::string rank_file = step_dir + "/rank" + std::to_string(rank()) + ".pt";
  const bool own_rng = FileExists(rank_file);
  if (!own_rng) rank_file = step_dir + "/rank0.pt";
  LAUNCH_ASSIGN_OR_RETURN(TrainState state, LoadRankState(rank_file, own_rng));
  if (pipeline_) {
    LAUNCH_RETURN_IF_ERROR(LoadModelState(step_dir + "/" + StageFileName(), *model_, *optimizer_));
  } else {
    LAUNCH_RETURN_IF_ERROR(strategy_->LoadModelState(step_dir, *optimizer_, state.world_size));
  }
  LoadTrainState(state);
  if (!own_rng) {
    const uint64_t seed = NewRankSeed(options_.seed, rank(), state.step);
    torch::manual_seed(seed);
    std::fprintf(stderr,
                 "train: rank %d: the checkpoint (written by %lld ranks) has no RNG state for this "
                 "rank; it draws a new stream seeded from (seed %llu, rank %d, step %lld)\n",
                 rank(), static_cast<long long>(state.world_size),
                 static_cast<unsigned long long>(options_.seed), rank(),
                 static_cast<long long>(state.step));
  }
  if (cursor_) AttachCursor(cursor_);
  return true;
}

void Accelerator::LoadTrainState(const TrainState& state) {
  step_ = state.step;
  schedule_anchor_ = {state.anchor_step, state.anchor_position, state.anchor_slope};
  // Checkpoints from before data_world was recorded know only the world size.
  const bool recorded = state.data_world > 0;
  const int64_t old_world =
      recorded ? state.data_world : std::max<int64_t>(1, state.world_size / stages_);
  restored_data_world_ = recorded ? state.data_world : 0;
  origin_data_world_ = state.origin_data_world > 0 ? state.origin_data_world : old_world;
  samples_seen_global_ = recorded ? state.samples_seen_global : state.samples_seen * old_world;
  samples_seen_ =
      old_world == data_world_ ? state.samples_seen : samples_seen_global_ / data_world_;
  LoaderCursor cursor;
  cursor.epoch = state.epoch;
  if (recorded ? old_world == data_world_ : state.world_size == world_size()) {
    cursor.start = state.epoch_start;  // the same batches, numbered alike: bit-identical
    cursor.batch = state.batch_in_epoch;
  } else if (recorded) {
    cursor.start = state.epoch_offset;  // the rest of the epoch over the new ranks (sampler.h)
    resharded_from_ = old_world;        // AttachCursor says how it is dealt
  } else {
    Print(WorldSizeChangedWarning(state.world_size, world_size()));
    ++cursor.epoch;
  }
  restored_cursor_ = cursor;
}

// --- Internal --------------------------------------------------------------------------------

Accelerator::CommStats Accelerator::TakeCommStats() {
  CommStats out;
  if (strategy_) {
    StepCommStats s = strategy_->TakeStepStats();
    out.allreduces = s.allreduces;
    out.reduce_scatters = s.reduce_scatters;
    out.allgathers = s.allgathers;
    out.blocking_comm_ms = s.blocking_comm_ms;
    out.launched_before_grads_done = s.launched_before_grads_done;
  } else if (pipeline_) {
    out.blocking_comm_ms = pipeline_->last_comm_ms();
    const int64_t now = pipeline_->stage_allreduces();
    out.allreduces = now - pipeline_allreduces_seen_;
    pipeline_allreduces_seen_ = now;
  }
  return out;
}

int64_t Accelerator::num_buckets() const { return strategy_ ? strategy_->num_buckets() : 0; }

int64_t Accelerator::allreduces_total() const {
  if (pipeline_) return pipeline_->stage_allreduces();
  return pg_ ? pg_->allreduce_count() : 0;
}

int64_t Accelerator::pair_exchanges_total() const { return pg_ ? pg_->recorded_count() : 0; }

int64_t Accelerator::reduce_scatters_total() const {
  return pg_ && !pipeline_ ? pg_->reduce_scatter_count() : 0;
}

int64_t Accelerator::allgathers_total() const {
  return pg_ && !pipeline_ ? pg_->allgather_count() : 0;
}

std::vector<int64_t> Accelerator::StateBytes() const {
  const trainer::StateBytes b =
      pipeline_ ? WholeStateBytes(*model_, *optimizer_) : strategy_->MemoryBytes(*optimizer_);
  return {b.parameters, b.gradients, b.optimizer};
}

std::vector<double> Accelerator::GatherPipelineStats(uint64_t checksum) {
  LAUNCH_CHECK(pipeline_ != nullptr);
  constexpr int kFields = PipelineEngine::kStatFields;
  auto gathered = torch::zeros({stages_ * kFields}, torch::kDouble);
  if (data_rank_ == 0) {
    std::vector<double> mine = pipeline_->Stats(checksum);
    auto g = gathered.accessor<double, 1>();
    for (int f = 0; f < kFields; ++f) g[stage_ * kFields + f] = mine[static_cast<size_t>(f)];
  }
  AllReduceSum(gathered);
  return std::vector<double>(gathered.data_ptr<double>(),
                             gathered.data_ptr<double>() + gathered.numel());
}

}  // namespace launch::trainer
