#include "trainer_runtime/api/accelerator.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

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

#include "base/environment.h"
#include "base/exit_status.h"
#include "base/files.h"
#include "base/strings.h"
#include "config/train_keys.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/comm/recovery.h"
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

// The step<N> folders in `dir`, by N ascending (complete or not).
std::vector<int64_t> StepFolders(const std::string& dir) {
  std::vector<int64_t> steps;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return steps;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    long long n = 0;
    if (StartsWith(name, "step") && ParseInt64(name.substr(4), &n) && n >= 0) steps.push_back(n);
  }
  ::closedir(d);
  std::sort(steps.begin(), steps.end());
  return steps;
}

// Removes a folder of files and of folders of files (a step folder: pair<i>/ holds files).
void RemoveTree(const std::string& path) {
  if (DIR* d = ::opendir(path.c_str())) {
    while (dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      const std::string child = path + "/" + name;
      if (std::remove(child.c_str()) != 0) RemoveTree(child);
    }
    ::closedir(d);
  }
  ::rmdir(path.c_str());
}

// Removes `dir`'s step folders other than the `keep` highest steps up to `latest` (a folder
// above `latest` was left by a run that resumed an earlier step: superseded too).
void RemoveOtherSteps(const std::string& dir, int64_t latest, int64_t keep) {
  const std::vector<int64_t> steps = StepFolders(dir);
  int64_t kept = 0;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (*it <= latest && kept < keep) {
      ++kept;
      continue;
    }
    RemoveTree(StepDir(dir, *it));
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

// In-place recovery's per-micro-batch stream: a function of where the micro-batch is in the
// run, so a replacement draws what the rank it replaces would have drawn (nothing keeps a dead
// rank's generator state). Distinct from NewRankSeed's streams for the same (rank, step).
uint64_t MicroBatchSeed(uint64_t seed, int rank, int64_t step, int64_t micro) {
  return NewRankSeed(seed ^ 0xA5A5F00DC0FFEE11ull, rank, step * 1000003 + micro);
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
  accel->timeout_ = timeout;
  if (env.distributed() && env.recover_in_place) {
    // In-place recovery keeps the store (rank 0 hosts it and must keep hosting it when its
    // group is re-formed), and a replacement announces its generation before it forms its group
    // with the survivors (comm/recovery.h).
    LAUNCH_ASSIGN_OR_RETURN(accel->store_,
                            ConnectStore(env, env.rank == 0 && !env.use_agent_store, timeout));
    if (env.recover_generation > 0) {
      LAUNCH_RETURN_IF_ERROR(AnnounceGeneration(*accel->store_, env.recover_generation));
      accel->generation_ = env.recover_generation;
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

template <typename Fn>
bool Accelerator::Guarded(Fn&& fn) {
  if (!recover_) {
    fn();
    return true;
  }
  if (peer_lost_) return false;
  try {
    fn();
    return true;
  } catch (const std::exception& e) {
    // c10::Error from the transports and the reducer, gloo's own exceptions from Gloo.
    const auto* c10 = dynamic_cast<const c10::Error*>(&e);
    const std::string what = c10 ? c10->what_without_backtrace() : e.what();
    if (!IsLostPeerError(what)) throw;
    peer_lost_ = true;
    lost_what_ = what.substr(0, what.find('\n'));
    lost_at_ = std::chrono::steady_clock::now();
    return false;
  }
}

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
  if (pipeline_)
    return Status::InvalidConfig(
        "train.parallel.mode is pipeline: hand over this rank's stage with PreparePipeline");
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
  if (options_.parallel.comm_hook == config::CommHook::kBf16 && pg_ && !pg_->shm() &&
      !pg_->hierarchical())
    return Status::InvalidConfig(
        "train.parallel.comm_hook: bf16 all-reduces the buckets in bfloat16, which this "
        "LibTorch's Gloo cannot do; it needs shared memory on every host (the shared-memory "
        "or hierarchical transport), here: " +
        pg_->allreduce_transport());
  LAUNCH_ASSIGN_OR_RETURN(strategy_, CreateStrategy(options_, model_.get(), optimizer_.get(), pg_));
  recover_ = env_.recover_in_place && pg_ && strategy_->SupportsInPlaceRecovery();
  if (env_.recover_in_place && pg_ && !recover_)
    Print(std::string("train: in-place recovery needs ddp; in ") + strategy_->Name() +
          " mode a lost rank restarts every worker (from the last checkpoint)");
  if (recover_ && env_.recover_generation > 0) {
    // A replacement: the run's state comes from a live peer (ExchangeState), not from rank 0's
    // broadcast, which the survivors are not making.
    LAUNCH_RETURN_IF_ERROR(ExchangeState());
    strategy_->Reform(pg_);
    joined_from_peer_ = true;
    std::fprintf(stderr,
                 "train: rank %d: replacement (generation %d) took the state of step %lld from "
                 "rank %d, %.2f s after it began to join\n",
                 rank(), generation_, static_cast<long long>(step_), recovered_from_,
                 Seconds(std::chrono::steady_clock::now() - created_at_));
  } else {
    strategy_->Setup();  // broadcast (ddp, local_sgd), reducer (ddp)
  }
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
  LAUNCH_CHECK(!prepared_);
  if (!pipeline_)
    return Status::InvalidConfig("PreparePipeline needs train.parallel.mode: pipeline (got " +
                                 std::string(config::ToString(options_.parallel.mode)) + ")");
  module_ = stage.ptr();
  model_ = std::make_shared<Model>(module_);
  optimizer_ = std::move(optimizer);
  pipeline_->SetStage(
      model_, [stage](const torch::Tensor& x) mutable { return stage.forward<torch::Tensor>(x); });
  pairs_.emplace_back();  // no strategy: the pipeline engine steps it
  pairs_.back().module = module_;
  pairs_.back().model = model_;
  pairs_.back().optimizer = optimizer_;
  RecordBaseLearningRates(pairs_.back());
  prepared_ = true;
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

// --- Several models --------------------------------------------------------------------------

Status Accelerator::PrepareAnother(std::shared_ptr<torch::nn::Module> module,
                                   std::shared_ptr<torch::optim::Optimizer> optimizer) {
  // dp's replicas run one module's forward on threads (ForwardBackward): there is no place for
  // a second model's.
  if (options_.parallel.mode == ParallelMode::kDp)
    return Status::InvalidConfig(
        "Prepare: a second model needs train.parallel.mode ddp, zero, none or Local SGD; dp "
        "runs one model's replicas");
  for (const Pair& pair : pairs_)
    if (pair.module.get() == module.get())
      return Status::InvalidConfig("Prepare: this module was prepared already");
  // Recovery re-forms the group and hands one model's state to the replacement.
  if (recover_)
    return Status::InvalidConfig(
        "Prepare: in-place recovery (launch --recover in_place) supports one prepared model; "
        "with several, run with --recover restart");
  Pair pair;
  pair.module = std::move(module);
  if (!device_.is_cpu()) pair.module->to(device_);
  pair.model = std::make_shared<Model>(pair.module);
  pair.optimizer = std::move(optimizer);
  if (pair.model->NamedParameters().empty())
    return Status::InvalidConfig("Prepare: model " + std::to_string(pairs_.size()) +
                                 " has no parameters that require grad");
  LAUNCH_ASSIGN_OR_RETURN(pair.owned,
                          CreateStrategy(options_, pair.model.get(), pair.optimizer.get(), pg_));
  pair.strategy = pair.owned.get();
  pair.strategy->Setup();  // its own broadcast and reducer
  pair.strategy->TakeStepStats();
  RecordBaseLearningRates(pair);
  pairs_.push_back(std::move(pair));
  return Status::Ok();
}

Accelerator::Pair& Accelerator::PairOf(const torch::nn::Module& model, const char* call) {
  for (Pair& pair : pairs_)
    if (pair.module.get() == &model) return pair;
  LAUNCH_CHECK(false, std::string(call) +
                          ": the module was not prepared (pass the module given to Prepare, "
                          "e.g. *net for a TORCH_MODULE holder)");
  return pairs_.front();  // not reached
}

std::vector<Accelerator::Pair*> Accelerator::PairsReachedBy(const torch::Tensor& loss) {
  // The leaves a backward from `loss` accumulates into are the variables of the AccumulateGrad
  // nodes its graph reaches; Reducer::prepare_for_backward walks the same graph for
  // find_unused_parameters.
  std::unordered_map<const c10::TensorImpl*, size_t> owner;
  for (size_t i = 0; i < pairs_.size(); ++i)
    for (const torch::Tensor& p : pairs_[i].model->Parameters())
      owner.emplace(p.unsafeGetTensorImpl(), i);
  std::vector<char> reached(pairs_.size(), 0);
  std::vector<torch::autograd::Node*> todo;
  std::unordered_set<torch::autograd::Node*> seen;
  if (loss.grad_fn()) todo.push_back(loss.grad_fn().get());
  while (!todo.empty()) {
    torch::autograd::Node* node = todo.back();
    todo.pop_back();
    if (!seen.insert(node).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      auto it = owner.find(acc->variable.unsafeGetTensorImpl());
      if (it != owner.end()) reached[it->second] = 1;
    }
    for (const torch::autograd::Edge& edge : node->next_edges())
      if (edge.function) todo.push_back(edge.function.get());
  }
  // Ranks whose losses reach different models would all-reduce different reducers' buckets
  // and wait for each other forever: compare first (a sum of 0/1 per model).
  auto count = torch::zeros({static_cast<int64_t>(pairs_.size())}, torch::kDouble);
  for (size_t i = 0; i < pairs_.size(); ++i) count[static_cast<int64_t>(i)] = reached[i];
  AllReduceSum(count);
  std::vector<Pair*> out;
  for (size_t i = 0; i < pairs_.size(); ++i) {
    const double ranks = count[static_cast<int64_t>(i)].item<double>();
    LAUNCH_CHECK(ranks == 0 || ranks == world_size(),
                 "Backward: the loss reaches model " + std::to_string(i) + " on " +
                     std::to_string(static_cast<int>(ranks)) + " of " +
                     std::to_string(world_size()) + " ranks (rank " + std::to_string(rank()) +
                     ": " + (reached[i] ? "reached" : "not reached") +
                     "); every rank's loss must go through the same models");
    if (reached[i]) out.push_back(&pairs_[i]);
  }
  return out;
}

bool Accelerator::Step(const torch::nn::Module& model) {
  LAUNCH_CHECK(prepared_);
  Pair& pair = PairOf(model, "Step(model)");
  if (in_micro_) EndMicroBatch();
  if (!window_closes_ || pair.unsynced || pair.stepped) return false;
  StepPairs({&pair});
  return true;
}

void Accelerator::ZeroGrad(const torch::nn::Module& model) {
  for (auto& p : PairOf(model, "ZeroGrad(model)").model->Parameters())
    if (p.grad().defined()) p.mutable_grad().zero_();
}

Accelerator::NoSyncScope Accelerator::NoSync(const torch::nn::Module& model) {
  return NoSyncScope(&PairOf(model, "NoSync(model)").no_sync);
}

Accelerator::MainFirstScope::MainFirstScope(Accelerator* accel, bool first)
    : accel_(accel), first_(first) {
  if (!first_) accel_->Barrier();  // waits for the first ones to leave their scope
}

Accelerator::MainFirstScope::~MainFirstScope() {
  if (!accel_ || !first_) return;
  try {
    accel_->Barrier();  // lets the others in
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train: rank %d: MainProcessFirst: the barrier failed: %s\n",
                 accel_->rank(), e.what());
  }
}

Accelerator::MainFirstScope Accelerator::MainProcessFirst() {
  return MainFirstScope(this, IsMainProcess());
}

Accelerator::MainFirstScope Accelerator::LocalMainProcessFirst() {
  return MainFirstScope(this, IsLocalMainProcess());
}

void Accelerator::SetSeed(uint64_t seed, bool device_specific) {
  // at::manual_seed seeds the CPU generator and every CUDA device's.
  torch::manual_seed(device_specific ? seed + static_cast<uint64_t>(rank()) : seed);
}

std::string Accelerator::PairDir(const std::string& step_dir, size_t i) const {
  return i == 0 ? step_dir : step_dir + "/pair" + std::to_string(i);
}

Status Accelerator::SaveUserState(const std::string& step_dir) const {
  if (user_state_.empty()) return Status::Ok();
  const std::string path = step_dir + "/user_rank" + std::to_string(rank()) + ".pt";
  torch::serialize::OutputArchive archive;
  try {
    // Kinds, in registration order: what LoadUserState compares.
    std::vector<int64_t> kinds;
    for (const UserState& u : user_state_) kinds.push_back(u.module ? 1 : 0);
    archive.write("kinds", torch::tensor(kinds, torch::kLong));
    for (size_t i = 0; i < user_state_.size(); ++i) {
      torch::serialize::OutputArchive object;
      user_state_[i].save(object);
      archive.write("object" + std::to_string(i), object);
    }
  } catch (const c10::Error& e) {
    return Status::IoError("serialising the RegisterForCheckpointing state into " + path + ": " +
                           e.what_without_backtrace());
  }
  return WriteArchive(archive, path);
}

Status Accelerator::LoadUserState(const std::string& step_dir) {
  if (user_state_.empty()) return Status::Ok();
  std::string path = step_dir + "/user_rank" + std::to_string(rank()) + ".pt";
  if (!FileExists(path)) path = step_dir + "/user_rank0.pt";  // fewer ranks wrote it
  auto kind_name = [](int64_t module) { return module ? "module" : "object"; };
  std::string mine;
  for (const UserState& u : user_state_)
    mine += std::string(mine.empty() ? "" : ", ") + kind_name(u.module);
  StatusOr<std::unique_ptr<torch::serialize::InputArchive>> archive = ReadArchive(path);
  if (!archive.ok() && archive.status().code() == Status::Code::kNotFound)
    return Status::InvalidConfig("the checkpoint in " + step_dir +
                                 " holds no RegisterForCheckpointing state; this program "
                                 "registered " +
                                 std::to_string(user_state_.size()) + " (" + mine + ")");
  if (!archive.ok()) return archive.status();
  try {
    torch::Tensor kinds;
    (*archive)->read("kinds", kinds);
    std::string theirs;
    for (int64_t i = 0; i < kinds.numel(); ++i)
      theirs += std::string(i ? ", " : "") + kind_name(kinds[i].item<int64_t>());
    if (theirs != mine)
      return Status::InvalidConfig(
          path + ": the checkpoint holds " + std::to_string(kinds.numel()) +
          " RegisterForCheckpointing objects (" + theirs + "), this program registered " +
          std::to_string(user_state_.size()) + " (" + mine +
          "); registration order is their identity");
  } catch (const c10::Error& e) {
    return Status::IoError(path + ": unreadable: " + e.what_without_backtrace());
  }
  for (size_t i = 0; i < user_state_.size(); ++i) {
    try {
      torch::serialize::InputArchive object;
      (*archive)->read("object" + std::to_string(i), object);
      user_state_[i].load(object);
    } catch (const c10::Error& e) {
      return Status::InvalidConfig(path + ": RegisterForCheckpointing object " + std::to_string(i) +
                                   " (" + kind_name(user_state_[i].module) +
                                   ") does not load: " + e.what_without_backtrace());
    }
  }
  return Status::Ok();
}

// --- Data ------------------------------------------------------------------------------------

bool Accelerator::AttachCursor(std::shared_ptr<LoaderCursor> cursor) {
  // Only the accelerator holds the training cursor once its loader and every copy are gone.
  if (cursor_ && cursor_.use_count() > 1) return false;
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
  return true;
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
          std::to_string(data_world_) + " ranks (rank r takes positions " + std::to_string(start) +
          " + r, " + std::to_string(start) + " + r + " + std::to_string(data_world_) + ", ...): " +
          std::to_string(dealt) + " batches of " + std::to_string(c.global_batch / data_world_) +
          " per rank, the epoch's last " + std::to_string(rest - dealt * c.global_batch) +
          " samples (less than a global batch) skipped; later epochs as usual (" +
          std::to_string(c.batches_per_epoch) + " batches per rank)");
    resharded_from_ = 0;
  }
  restored_cursor_.reset();  // once: a later loader is not moved by it
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
  const bool end_of_data = options_.sync_with_dataloader && cursor_ && cursor_->last_was_end;
  const bool closes = micro_in_window_ + 1 >= options_.gradient_accumulation_steps || end_of_data;
  if (micro_in_window_ == 0) Timeline::Get().BeginStep(step_ + 1);
  sync_ = pipeline_ ? closes : strategy_->SyncGradients(closes);
  window_closes_ = closes;
  if (recover_) torch::manual_seed(MicroBatchSeed(options_.seed, rank(), step_, micro_in_window_));
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
    throw compat::MakeError(
        "Accelerator::Backward: train.parallel.mode dp runs every replica's forward and backward "
        "itself; call ForwardBackward(batch, fn) instead of a forward of your own and "
        "Backward(loss)");
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
      (loss / static_cast<double>(options_.gradient_accumulation_steps)).backward();
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

torch::Tensor Accelerator::ForwardBackward(const torch::data::Example<>& batch,
                                           const ChunkLoss& fn) {
  LAUNCH_CHECK(!pipeline_);
  if (!in_micro_) Accumulate();
  if (peer_lost_) {  // the step is abandoned; Step() recovers
    EndMicroBatch();
    return torch::zeros({}, torch::kFloat);
  }
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
  backward_since_step_ = true;
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
  backward_since_step_ = true;
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
  redo_ = false;
  if (in_micro_) EndMicroBatch();  // a micro-batch whose loss did not need a backward
  micro_open_ = false;
  if (peer_lost_) {
    const Status recovered = Recover();
    if (!recovered.ok())
      throw compat::MakeError("in-place recovery failed (the agent restarts every worker): " +
                              recovered.ToString());
    redo_ = true;
    return false;
  }
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
    // Every model is inside NoSync: the window ends without a step.
    if (!counted_) micro_in_window_ = 0;
    return false;
  }
  StepPairs(pairs);
  return true;
}

void Accelerator::StepPairs(const std::vector<Pair*>& pairs) {
  if (pipeline_) {
    Timeline::Scope span("train", "gradient all-reduce (stage replicas)");
    pipeline_loss_ = pipeline_->AllReduceGradients(window_loss_ / micro_in_window_);
    window_loss_ = 0;
  }
  Timeline::Scope span("train", "optimizer");
  for (Pair* pair : pairs) {
    if (options_.max_grad_norm > 0) {
      if (pipeline_)
        pipeline_->ClipGradNorm(options_.max_grad_norm);
      else
        pair->strategy->ClipGradNorm(options_.max_grad_norm);
    }
    if (lr_schedule_) {
      const double value = lr_schedule_(step_);
      auto& groups = pair->optimizer->param_groups();
      for (size_t g = 0; g < groups.size(); ++g) {
        // A group added after Prepare: its rate when first seen is its base (LambdaLR's
        // initial_lr).
        if (g == pair->base_lrs.size()) pair->base_lrs.push_back(groups[g].options().get_lr());
        groups[g].options().set_lr(lr_is_factor_ ? pair->base_lrs[g] * value : value);
      }
    }
    if (pipeline_) {
      pair->optimizer->step();
      // Zero in place (not set to undefined) so gradient memory stays put across steps.
      for (auto& p : pair->model->Parameters())
        if (p.grad().defined()) p.mutable_grad().zero_();
    } else {
      pair->strategy->Step(*pair->optimizer);
    }
    pair->took_part = false;
    pair->stepped = true;
  }
  // One optimizer step of the run per micro-batch, however many models stepped in it.
  const bool first = !counted_;
  if (first) {
    ++step_;
    micro_last_step_ = micro_in_window_;
    micro_in_window_ = 0;
    counted_ = true;
  }
  for (Pair* pair : pairs)
    if (pair->strategy) pair->strategy->AfterOptimizerStep(step_);
  if (first) {
    if (save_pending_) PollPendingSave();
    MarkBoundary();
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
  // A peer lost at the last step boundary: its replacement comes straight here.
  if (peer_lost_) LAUNCH_RETURN_IF_ERROR(Recover());
  LAUNCH_RETURN_IF_ERROR(WaitForCheckpoint());
  finished_ = true;  // saves from here on are synchronous: the run is about to end
  for (Pair& pair : pairs_)
    if (pair.strategy) pair.strategy->Finish(step_);
  SyncBuffers();
  LAUNCH_RETURN_IF_ERROR(CheckReplicasAgree());
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
  Guarded([&] {
    for (Pair& pair : pairs_)
      if (pair.strategy) pair.strategy->SyncBuffers();
  });
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
  Guarded([&] { SumInPlace(t); });
  return t;
}

void Accelerator::SumInPlace(torch::Tensor& t) {
  // Through shared memory when the group has it: the trainer agrees on signals with this after
  // every step, and a Gloo round trip costs 0.2-2 ms on 2 busy cores (most of a small model's
  // step) against ~20 us. Not counted as gradient communication either way.
  ShmAllReduce* shm = pg_ ? pg_->shm() : nullptr;
  if (shm && ShmAllReduce::Supports({t}, c10d::AllreduceOptions())) {
    // In the collective ring as the group's own operations are: a rank stuck here is as much a
    // hang as one stuck in a gradient all-reduce.
    const uint64_t token = pg_->RingBegin(CollectiveOp::kAllReduce, t.numel() * t.element_size());
    const Status status = shm->AllReduceNow(t);
    pg_->RingDone(token, status.ok());
    if (!status.ok()) throw compat::MakeError(status.ToString());
    return;
  }
  if (c10d::ProcessGroup* pg = control()) {
    std::vector<at::Tensor> v = {t};
    const uint64_t token = pg_->RingBegin(CollectiveOp::kAllReduce, t.numel() * t.element_size());
    try {
      pg->allreduce(v, c10d::AllreduceOptions())->wait();
    } catch (...) {
      pg_->RingDone(token, /*ok=*/false);  // ended, failed: not "started" forever in the ring
      throw;
    }
    pg_->RingDone(token);
  }
}

double Accelerator::Mean(double value) {
  auto t = torch::tensor({value}, torch::kDouble);
  AllReduceSum(t);
  return t.item<double>() / world_size();
}

torch::Tensor Accelerator::Gather(const torch::Tensor& t) { return torch::cat(GatherList(t)); }

void Accelerator::Barrier() {
  if (c10d::ProcessGroup* pg = control()) {
    const uint64_t token = pg_->RingBegin(CollectiveOp::kBarrier, 0);
    bool ok = false;
    try {
      ok = Guarded([&] { pg->barrier(c10d::BarrierOptions())->wait(); });
    } catch (...) {
      pg_->RingDone(token, /*ok=*/false);
      throw;
    }
    pg_->RingDone(token, ok);
  }
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
  if (!Guarded([&] { SumInPlace(t); })) {
    // A lost peer (in-place recovery): the ranks agree on it at the next poll, after recovering.
    if (local != 0 && g_signal == 0) g_signal = local;
    return SignalRequest();
  }
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
  for (size_t i = 0; i < pairs_.size() && status.ok() && !pipeline_; ++i)
    status = pairs_[i].strategy->SaveModelState(PairDir(step_dir, i), *pairs_[i].optimizer);
  if (status.ok()) status = SaveUserState(step_dir);
  if (status.ok())
    status = SaveRankState(step_dir + "/rank" + std::to_string(rank()) + ".pt", state);
  return status;
}

Status Accelerator::SaveState(const std::string& dir) {
  LAUNCH_CHECK(prepared_);
  if (peer_lost_) {
    std::fprintf(stderr,
                 "train: rank %d: no checkpoint at step %lld: a peer was lost (the previous one "
                 "stays the latest)\n",
                 rank(), static_cast<long long>(step_));
    return Status::Ok();
  }
  // One save at a time: an earlier asynchronous one is committed first.
  LAUNCH_RETURN_IF_ERROR(WaitForCheckpoint());
  const auto start = std::chrono::steady_clock::now();
  const std::string step_dir = StepDir(dir, step_);
  const TrainState state = CurrentTrainState();
  Status status = MakeDirs(step_dir);
  for (size_t i = 1; i < pairs_.size() && status.ok(); ++i) status = MakeDirs(PairDir(step_dir, i));
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
    if (!status.ok() && peer_lost_) {
      std::fprintf(stderr,
                   "train: rank %d: the checkpoint of step %lld was not committed: a peer was "
                   "lost (the previous one stays the latest)\n",
                   rank(), static_cast<long long>(step_));
      return Status::Ok();
    }
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
  for (Pair& pair : pairs_)
    if (pair.strategy) pair.strategy->BeginSnapshot();
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
  for (Pair& pair : pairs_)
    if (pair.strategy) pair.strategy->EndSnapshot();
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
  // A lost peer (in-place recovery): whether it wrote its files is unknown, so `latest` stays.
  if (peer_lost_) return Status::PeerLost("a peer was lost before the checkpoint was committed");
  if (!status.ok()) return status;
  if (failed.item<double>() > 0)
    return Status::IoError("another rank failed to write its part of the checkpoint for step " +
                           std::to_string(step));
  if (rank() == 0) {
    LAUNCH_RETURN_IF_ERROR(WriteFileAtomically(dir + "/latest", std::to_string(step) + "\n"));
    // Superseded once `latest` names the new step (train.checkpoint_keep keeps more).
    RemoveOtherSteps(dir, step, std::max<int64_t>(1, options_.checkpoint_keep));
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
    if (!committed.ok() && !peer_lost_) return committed;
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
  if (!committed.ok() && peer_lost_) {
    std::fprintf(stderr, "train: rank %d: the checkpoint of step %lld was not committed: %s\n",
                 rank(), static_cast<long long>(pending_step_), committed.message().c_str());
  } else if (!committed.ok()) {
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
  StatusOr<int64_t> latest = LatestStep(dir);
  if (!latest.ok()) return {};
  return ChangedSettingsAt(dir, *latest);
}

std::vector<std::string> Accelerator::ChangedSettingsAt(const std::string& dir,
                                                        int64_t step) const {
  std::vector<std::string> changes;
  StatusOr<std::string> text = ReadFile(StepDir(dir, step) + "/" + kRunFile);
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

std::vector<int64_t> Accelerator::SavedSteps(const std::string& dir) {
  // Complete: the folder has run.txt, which rank 0 writes first, and rank 0's state, written
  // last of its files (a folder of a save killed midway may lack it; `latest` never names one).
  std::vector<int64_t> steps;
  for (int64_t step : StepFolders(dir))
    if (FileExists(StepDir(dir, step) + "/rank0.pt")) steps.push_back(step);
  return steps;
}

StatusOr<bool> Accelerator::LoadState(const std::string& dir) { return LoadStateAt(dir, {}); }

StatusOr<bool> Accelerator::LoadState(const std::string& dir, int64_t step) {
  return LoadStateAt(dir, step);
}

StatusOr<bool> Accelerator::LoadStateAt(const std::string& dir, std::optional<int64_t> step) {
  LAUNCH_CHECK(prepared_);
  if (joined_from_peer_) return true;  // the state came from a live peer (Prepare)
  int64_t mine = -1;
  if (step) {
    const std::vector<int64_t> saved = SavedSteps(dir);
    if (std::find(saved.begin(), saved.end(), *step) != saved.end()) mine = *step;
  } else {
    StatusOr<int64_t> latest = LatestStep(dir);
    if (!latest.ok() && latest.status().code() != Status::Code::kNotFound) return latest.status();
    mine = latest.ok() ? *latest : -1;
  }
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
  if (mine < 0 && step) {
    std::string steps;
    for (int64_t s : SavedSteps(dir)) steps += (steps.empty() ? "" : ", ") + std::to_string(s);
    return Status::NotFound("no checkpoint of step " + std::to_string(*step) + " in '" + dir +
                            "' (it holds " + (steps.empty() ? "none" : "steps " + steps) +
                            "; train.checkpoint_keep keeps more than the latest)");
  }
  if (mine < 0) return false;
  // Every rank reads the same run.txt and holds the same settings, so all decide alike.
  const std::vector<std::string> changes = ChangedSettingsAt(dir, mine);
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
    for (size_t i = 0; i < pairs_.size(); ++i)
      LAUNCH_RETURN_IF_ERROR(pairs_[i].strategy->LoadModelState(
          PairDir(step_dir, i), *pairs_[i].optimizer, state.world_size));
  }
  LAUNCH_RETURN_IF_ERROR(LoadUserState(step_dir));
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
  ApplyRestoredCursor();
  MarkBoundary();
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

// --- In-place recovery -----------------------------------------------------------------------

void Accelerator::MarkBoundary() {
  if (!recover_) return;
  boundary_.has_cursor = cursor_ != nullptr;
  if (cursor_) boundary_.cursor = *cursor_;
  boundary_.samples_seen = samples_seen_;
  boundary_.samples_seen_global = samples_seen_global_;
  // The buffers as they are now: a redone forward must not count its batch twice in running
  // statistics. Copied into the same tensors every step (no allocation).
  const auto buffers = model_->NamedBuffers();
  if (boundary_.buffers.size() != buffers.size()) {
    boundary_.buffers.clear();
    for (const auto& [name, b] : buffers) boundary_.buffers.push_back(b.detach().clone());
    return;
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < buffers.size(); ++i) boundary_.buffers[i].copy_(buffers[i].second);
}

TrainState Accelerator::BoundaryTrainState() const {
  TrainState state = CurrentTrainState();
  if (boundary_.has_cursor) {
    const LoaderCursor& c = boundary_.cursor;
    state.epoch = c.epoch;
    state.batch_in_epoch = c.batch;
    state.epoch_start = c.start;
    state.epoch_offset = c.offset();
  }
  state.samples_seen = boundary_.samples_seen;
  state.samples_seen_global = boundary_.samples_seen_global;
  return state;
}

Status Accelerator::ExchangeState() {
  const int world = world_size();
  // Who holds the run's state and how far along: slot r is rank r's steps done + 1, or 0 for a
  // replacement. A survivor may be a step ahead of the others: the dead rank's part of the last
  // all-reduce reached it before the others gave up. Its state is then the complete one.
  auto slots = torch::zeros({world}, torch::kDouble);
  if (prepared_) slots[rank()] = static_cast<double>(step_ + 1);
  SumInPlace(slots);
  const auto seen = slots.accessor<double, 1>();
  int src = 0;
  for (int r = 1; r < world; ++r)
    if (seen[r] > seen[src]) src = r;
  if (seen[src] == 0)
    return Status::PeerLost("no live rank holds the run's state (every rank is a replacement)");
  recovered_from_ = src;
  std::string bytes;
  if (rank() == src) {
    LAUNCH_ASSIGN_OR_RETURN(bytes,
                            SerializeReplicaState(*model_, *optimizer_, BoundaryTrainState()));
  }
  auto size = torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kLong);
  c10d::BroadcastOptions from_src;
  from_src.rootRank = src;
  std::vector<at::Tensor> v = {size};
  pg_->broadcast(v, from_src)->wait();
  const int64_t n = size.item<int64_t>();
  at::Tensor payload = torch::empty({n}, torch::kByte);
  if (rank() == src) std::memcpy(payload.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  v = {payload};
  pg_->broadcast(v, from_src)->wait();
  if (rank() != src) {
    bytes.assign(reinterpret_cast<const char*>(payload.data_ptr<uint8_t>()),
                 static_cast<size_t>(n));
    // A replacement takes the buffers too; a survivor keeps its own (below).
    LAUNCH_ASSIGN_OR_RETURN(TrainState state,
                            RestoreReplicaState(bytes, *model_, *optimizer_, !prepared_));
    LoadTrainState(state);
  } else {
    LoadTrainState(BoundaryTrainState());
  }
  torch::NoGradGuard no_grad;
  if (prepared_) {
    // Each survivor's buffers of its last boundary: rank 0's become everyone's at the next
    // forward (broadcast_buffers), as in the undisturbed run.
    const auto buffers = model_->NamedBuffers();
    for (size_t i = 0; i < buffers.size() && i < boundary_.buffers.size(); ++i)
      buffers[i].second.detach().copy_(boundary_.buffers[i]);
  }
  // Nothing of the abandoned step's gradients survives.
  for (auto& p : model_->Parameters())
    if (p.grad().defined()) p.mutable_grad().zero_();
  ApplyRestoredCursor();
  return Status::Ok();
}

Status Accelerator::Recover() {
  const int64_t step = step_ + 1;
  // Across machines a replacement may be a whole new node: the agent sizes this wait from the
  // rendezvous' own deadlines (LAUNCH_RECOVER_WAIT_S).
  const std::chrono::milliseconds wait =
      env_.recover_wait_s > 0 ? std::chrono::milliseconds(env_.recover_wait_s * 1000LL) : timeout_;
  std::fprintf(stderr,
               "train: rank %d (pid %d): lost a peer during step %lld (%s); waiting up to %lld s "
               "for its replacement\n",
               rank(), static_cast<int>(::getpid()), static_cast<long long>(step),
               lost_what_.c_str(), static_cast<long long>(wait.count() / 1000));
  try {
    // A new client: when rank 0 was the one lost, the store went with it and its replacement
    // hosts a new one at the same address. A rank 0 that survived keeps hosting its own.
    if (rank() != 0 || env_.use_agent_store) {
      LAUNCH_ASSIGN_OR_RETURN(store_, ConnectStore(env_, /*host=*/false, timeout_));
    }
    LAUNCH_ASSIGN_OR_RETURN(const int generation, WaitForGeneration(*store_, generation_, wait, [] {
                              return IsStop(g_signal);
                            }));
    generation_ = generation;
    LAUNCH_ASSIGN_OR_RETURN(pg_, CreateGroupOver(store_, WorldGroupName(generation), rank(),
                                                 world_size(), env_, timeout_));
    LAUNCH_RETURN_IF_ERROR(ExchangeState());
    // The broken group goes with the old reducer here.
    strategy_->Reform(pg_);
  } catch (const std::exception& e) {
    return Status::PeerLost(std::string("recovering from a lost peer: ") + e.what());
  }
  peer_lost_ = false;
  in_micro_ = false;
  micro_open_ = false;
  micro_in_window_ = 0;
  window_closes_ = false;
  ++recoveries_;
  report_cost_since_ = lost_at_;
  MarkBoundary();
  std::fprintf(stderr,
               "train: rank %d: recovered %.2f s after the failure: group generation %d with the "
               "replacement, state of step %lld from rank %d; redoing step %lld\n",
               rank(), Seconds(std::chrono::steady_clock::now() - lost_at_), generation_,
               static_cast<long long>(step_), recovered_from_, static_cast<long long>(step_ + 1));
  return Status::Ok();
}

// --- Internal --------------------------------------------------------------------------------

Accelerator::CommStats Accelerator::TakeCommStats() {
  CommStats out;
  if (strategy_) {
    // Each strategy counts the group's all-reduces since its last call, so the first pair's
    // count holds every pair's; the time waited is each pair's own.
    for (size_t i = 0; i < pairs_.size(); ++i) {
      StepCommStats s = pairs_[i].strategy->TakeStepStats();
      if (i == 0) {
        out.allreduces = s.allreduces;
        out.reduce_scatters = s.reduce_scatters;
        out.allgathers = s.allgathers;
      }
      out.blocking_comm_ms += s.blocking_comm_ms;
      out.launched_before_grads_done += s.launched_before_grads_done;
    }
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

// --- Evaluation, held objects and collectives of any shape ----------------------------------

IndexRange Accelerator::SplitBetweenProcesses(int64_t n) const {
  return SplitBetween(n, rank(), world_size());
}

std::vector<torch::Tensor> Accelerator::GatherList(const torch::Tensor& t) {
  const torch::Tensor mine = (t.dim() == 0 ? t.reshape({1}) : t).contiguous();
  c10d::ProcessGroup* pg = control();
  if (!pg) return {mine.clone()};
  // Gloo gathers equal shapes: first the sizes, then every rank's rows padded to the largest.
  std::vector<std::vector<at::Tensor>> sizes(1);
  for (int r = 0; r < world_size(); ++r) sizes[0].push_back(torch::empty({1}, torch::kLong));
  std::vector<at::Tensor> size_in = {torch::tensor({mine.size(0)}, torch::kLong)};
  pg->allgather(sizes, size_in, c10d::AllgatherOptions())->wait();
  int64_t largest = 0;
  for (const auto& s : sizes[0]) largest = std::max(largest, s.item<int64_t>());
  std::vector<int64_t> shape = mine.sizes().vec();
  shape[0] = largest;
  torch::Tensor padded = torch::zeros(shape, mine.options());
  padded.slice(0, 0, mine.size(0)).copy_(mine);
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < world_size(); ++r) out[0].push_back(torch::empty_like(padded));
  std::vector<at::Tensor> in = {padded};
  pg->allgather(out, in, c10d::AllgatherOptions())->wait();
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < world_size(); ++r)
    parts.push_back(out[0][static_cast<size_t>(r)].slice(0, 0, sizes[0][r].item<int64_t>()));
  return parts;
}

torch::Tensor Accelerator::GatherForMetrics(const torch::Tensor& t) {
  const std::vector<torch::Tensor> parts = GatherList(t);
  // Rank r's row j is the batch's sample r + j*W (EvalSampler): row 0 of every rank in rank
  // order, then row 1, ... A rank has at most one row fewer than the rank before it.
  std::vector<int64_t> order;
  int64_t offset = 0;
  std::vector<int64_t> first(parts.size());
  for (size_t r = 0; r < parts.size(); ++r) {
    first[r] = offset;
    offset += parts[r].size(0);
  }
  for (int64_t j = 0; j < (parts.empty() ? 0 : parts[0].size(0)); ++j)
    for (size_t r = 0; r < parts.size(); ++r)
      if (j < parts[r].size(0)) order.push_back(first[r] + j);
  LAUNCH_CHECK(static_cast<int64_t>(order.size()) == offset,
               "GatherForMetrics: rank 0 has fewer rows than a later rank; pass the rows of an "
               "EvalDataLoader batch");
  const torch::Tensor all = torch::cat(parts);
  return all.index_select(0, torch::tensor(order, torch::kLong).to(all.device()));
}

torch::Tensor Accelerator::PadAcrossProcesses(const torch::Tensor& t, int64_t dim, double pad_value,
                                              bool pad_first) {
  LAUNCH_CHECK(t.dim() > 0 && dim >= -t.dim() && dim < t.dim(),
               "PadAcrossProcesses: dim out of range");
  if (dim < 0) dim += t.dim();
  auto size = torch::tensor({t.size(dim)}, torch::kLong);
  if (c10d::ProcessGroup* pg = control()) {
    std::vector<at::Tensor> v = {size};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MAX;
    pg->allreduce(v, opts)->wait();
  }
  const int64_t largest = size.item<int64_t>();
  if (largest == t.size(dim)) return t;
  std::vector<int64_t> shape = t.sizes().vec();
  shape[static_cast<size_t>(dim)] = largest;
  torch::Tensor out = torch::full(shape, pad_value, t.options());
  const int64_t begin = pad_first ? largest - t.size(dim) : 0;
  out.slice(dim, begin, begin + t.size(dim)).copy_(t);
  return out;
}

torch::Tensor& Accelerator::Broadcast(torch::Tensor& t, int src) {
  LAUNCH_CHECK(src >= 0 && src < world_size(), "Broadcast: src is not a rank");
  if (c10d::ProcessGroup* pg = control()) {
    std::vector<at::Tensor> v = {t};
    c10d::BroadcastOptions opts;
    opts.rootRank = src;
    pg->broadcast(v, opts)->wait();
  }
  return t;
}

std::string Accelerator::BroadcastObject(const std::string& bytes, int src) {
  auto size = torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kLong);
  Broadcast(size, src);
  auto data = torch::empty({size.item<int64_t>()}, torch::kUInt8);
  if (rank() == src && !bytes.empty()) std::memcpy(data.data_ptr(), bytes.data(), bytes.size());
  Broadcast(data, src);
  return std::string(static_cast<const char*>(data.data_ptr()), static_cast<size_t>(data.numel()));
}

bool Accelerator::AveragesGradients() const {
  if (!strategy_ || world_size() == 1) return false;
  const std::string name = strategy_->Name();
  return name == "ddp" || name == "zero";
}

void Accelerator::CheckNoUnsyncedGradients() const {
  if (!AveragesGradients()) return;
  // Only reached when no Backward ran since the last step, so a normal loop never pays for it.
  bool any = false;
  for (const torch::Tensor& p : model_->Parameters())
    if (p.grad().defined() && p.grad().ne(0).any().item<bool>()) any = true;
  LAUNCH_CHECK(!any, "Step(): rank " + std::to_string(rank()) +
                         " has gradients that no Accelerator::Backward produced since the last "
                         "step, so they were not averaged over the ranks and each rank would "
                         "train on its own (the replicas drift apart). Replace loss.backward() "
                         "with accel->Backward(loss), or use accel->ForwardBackward");
}

Status Accelerator::CheckReplicasAgree() {
  if (!strategy_ || !pg_) return Status::Ok();
  const std::string name = strategy_->Name();
  if (name != "ddp" && name != "local_sgd") return Status::Ok();
  const uint64_t mine = ParameterChecksum(model_->Parameters());
  const torch::Tensor all = Gather(torch::tensor({static_cast<int64_t>(mine)}, torch::kLong));
  std::vector<std::string> differ;
  for (int r = 1; r < world_size(); ++r)
    if (all[r].item<int64_t>() != all[0].item<int64_t>()) differ.push_back(std::to_string(r));
  if (differ.empty()) return Status::Ok();
  return Status::Internal(
      "Finish: the replicas disagree: the parameters of rank(s) " + Join(differ, ", ") +
      " differ from rank 0's (" + name +
      " keeps them bit-identical; were gradients computed outside Backward, or parameters "
      "changed outside Step?)");
}

}  // namespace launch::trainer
