#include "trainer_runtime/trainer.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <sstream>

#include "base/environment.h"
#include "base/strings.h"
#include "config/loader.h"
#include "trainer_runtime/atomic_file.h"
#include "trainer_runtime/checkpoint.h"
#include "trainer_runtime/data.h"
#include "trainer_runtime/env.h"
#include "trainer_runtime/loop_util.h"
#include "trainer_runtime/model.h"
#include "trainer_runtime/pipeline.h"
#include "trainer_runtime/process_group.h"
#include "trainer_runtime/sampler.h"
#include "trainer_runtime/schedule.h"
#include "trainer_runtime/strategy.h"

namespace launch::trainer {
namespace {

// The one signal flag (STYLE.md): the last signal received, 0 when none. SIGUSR1/SIGUSR2 (what
// SLURM sends before preemption; `launch` forwards them) ask for a checkpoint and training
// goes on; SIGTERM/SIGINT ask for a checkpoint and a clean stop. Acted on at the next
// optimizer-step boundary, where the state is consistent.
volatile std::sig_atomic_t g_signal = 0;

extern "C" void OnSignal(int signo) {
  const bool stop_pending = g_signal == SIGTERM || g_signal == SIGINT;
  if ((signo == SIGUSR1 || signo == SIGUSR2) && stop_pending) return;  // a stop outranks
  g_signal = signo;
}

void InstallSignalHandlers() {
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int signo : {SIGUSR1, SIGUSR2, SIGTERM, SIGINT}) sigaction(signo, &sa, nullptr);
}

using Clock = std::chrono::steady_clock;
using config::OptimizerType;

std::string Eta(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--:--";
  long s = std::lround(seconds);
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof(buf), "%ld:%02ld:%02ld", s / 3600, (s / 60) % 60, s % 60);
  } else {
    std::snprintf(buf, sizeof(buf), "%02ld:%02ld", s / 60, s % 60);
  }
  return buf;
}

// FNV-1a over the raw bytes of every parameter: equal checksums mean bit-identical weights.
std::string Checksum(Model& model) {
  uint64_t h = 1469598103934665603ull;
  for (auto& [name, p] : model.NamedParameters()) {
    auto t = p.detach().contiguous();
    const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
    const size_t n = static_cast<size_t>(t.numel()) * t.element_size();
    for (size_t i = 0; i < n; ++i) {
      h ^= bytes[i];
      h *= 1099511628211ull;
    }
  }
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

class Trainer {
 public:
  Trainer(const config::TrainConfig& cfg, const TrainerOptions& opts, const DistEnv& env)
      : cfg_(cfg), opts_(opts), env_(env) {
    if (!opts_.output_dir.empty()) cfg_.output_dir = opts_.output_dir;
    if (opts_.max_steps > 0) {
      cfg_.max_steps = opts_.max_steps;
    }
    is_main_ = env_.rank == 0;
    tty_ = is_main_ && ::isatty(STDOUT_FILENO);
  }

  Status Run();
  // What the loop was doing, for error messages: "backward at step 12".
  std::string Phase() const { return phase_ + " at step " + std::to_string(state_.step + 1); }

 private:
  Status Prepare();
  Status MaybeResume();
  void TrainStep();
  void Evaluate(double* loss, double* accuracy);
  Status WriteMetricsLine(const StepCommStats& comm, double loss, double lr, double step_s,
                          int64_t samples);
  Status WriteFinal(double train_loss, double eval_loss, double eval_acc, double wall_s);
  Status DumpParams();
  void Report(double loss, double lr, double samples_per_s, double comm_ms);
  void Log(const std::string& line) {
    if (is_main_) std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }
  std::string CheckpointPath() const { return cfg_.output_dir + "/checkpoints/latest.pt"; }

  config::TrainConfig cfg_;
  TrainerOptions opts_;
  DistEnv env_;
  bool is_main_ = true;
  bool tty_ = false;

  c10::intrusive_ptr<CountingProcessGroup> pg_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<ParallelStrategy> strategy_;
  std::unique_ptr<ShardedSampler> sampler_;
  Dataset data_;
  TrainState state_;
  int64_t total_steps_ = 0;
  std::string phase_ = "setup";
  std::ofstream metrics_;
  double last_loss_ = std::nan("");
  double ema_samples_per_s_ = 0;
  Clock::time_point train_start_;
  int64_t steps_this_run_ = 0;
  int64_t micro_last_step_ = 0;
  double window_loss_sum_ = 0;  // plain log lines: loss summed since the last line
  int64_t window_steps_ = 0;
  double loop_s_ = 0;  // the training loop alone (no setup, no final eval): for benchmarks
  double lr_last_step_ = 0;
};

Status Trainer::Prepare() {
  if (cfg_.mixed_precision != "no")
    Log("train: warning: mixed_precision '" + cfg_.mixed_precision +
        "' is not implemented by the trainer yet; training in float32");
  phase_ = "loading data";
  LAUNCH_ASSIGN_OR_RETURN(data_, LoadDataset(cfg_));
  sampler_ =
      std::make_unique<ShardedSampler>(static_cast<int64_t>(data_.train_indices.size()), env_.rank,
                                       env_.world_size, cfg_.batch_size, cfg_.seed);
  const int64_t per_epoch = sampler_->batches_per_epoch();
  if (per_epoch == 0)
    return Status::InvalidConfig(
        "train.batch_size " + std::to_string(cfg_.batch_size) + " is larger than the " +
        std::to_string(sampler_->samples_per_rank()) + " training samples each of " +
        std::to_string(env_.world_size) + " ranks gets; lower it or add data");
  const int64_t n = cfg_.gradient_accumulation_steps;
  const int64_t steps_per_epoch =
      cfg_.sync_with_dataloader ? (per_epoch + n - 1) / n : std::max<int64_t>(1, per_epoch / n);
  total_steps_ =
      cfg_.max_steps > 0 ? cfg_.max_steps : std::max<int64_t>(1, cfg_.epochs) * steps_per_epoch;

  phase_ = "building the model";
  // Same seed on every rank: identical initial weights even before the broadcast.
  torch::manual_seed(cfg_.seed);
  LAUNCH_ASSIGN_OR_RETURN(model_, CreateModel(cfg_.model));
  optimizer_ = MakeOptimizer(cfg_.optimizer, model_->Parameters());
  // Different dropout masks per rank, reproducible per (seed, rank).
  torch::manual_seed(cfg_.seed + 1000003ull * static_cast<uint64_t>(env_.rank + 1));

  if (env_.distributed()) {
    phase_ = "joining the process group";
    auto timeout = std::chrono::milliseconds(static_cast<int64_t>(opts_.init_timeout_s * 1000));
    LAUNCH_ASSIGN_OR_RETURN(pg_, CreateProcessGroup(env_, timeout));
  }
  LAUNCH_ASSIGN_OR_RETURN(strategy_, CreateStrategy(cfg_, model_.get(), pg_));
  LAUNCH_RETURN_IF_ERROR(MaybeResume());
  phase_ = "broadcasting parameters";
  strategy_->Setup();
  strategy_->TakeStepStats();

  int64_t num_params = 0;
  for (auto& p : model_->Parameters()) num_params += p.numel();
  std::string shape;
  if (cfg_.model.type == config::ModelType::kMlp) {
    std::vector<std::string> widths;
    for (int64_t w : cfg_.model.mlp_layers) widths.push_back(std::to_string(w));
    shape = " " + Join(widths, "-");
  }
  Log("train: " + std::to_string(env_.world_size) + " process(es), " + strategy_->Name() +
      (strategy_->num_buckets() ? " (" + std::to_string(strategy_->num_buckets()) + " buckets)"
                                : "") +
      (cfg_.local_sgd_steps > 0 ? " every " + std::to_string(cfg_.local_sgd_steps) + " steps"
                                : "") +
      "; model " + config::ToString(cfg_.model.type) + shape + " (" + std::to_string(num_params) +
      " parameters); " + data_.description + "; batch " + std::to_string(cfg_.batch_size) + " x " +
      std::to_string(cfg_.gradient_accumulation_steps) + " micro-batches x " +
      std::to_string(env_.world_size) + " ranks; " + std::to_string(total_steps_) +
      " steps; output " + cfg_.output_dir);
  return Status::Ok();
}

Status Trainer::MaybeResume() {
  phase_ = "resuming";
  std::string path;
  bool explicit_path = false;
  if (cfg_.resume == "never") return Status::Ok();
  if (cfg_.resume == "auto") {
    path = CheckpointPath();
    if (!std::ifstream(path)) {
      if (env_.restart_count > 0)
        Log("train: restart " + std::to_string(env_.restart_count) +
            ": no checkpoint yet, starting from step 0");
      return Status::Ok();
    }
  } else {
    path = cfg_.resume;
    explicit_path = true;
    if (!std::ifstream(path))
      return Status::NotFound("train.resume: checkpoint '" + path + "' does not exist");
  }
  LAUNCH_ASSIGN_OR_RETURN(TrainState peek, PeekCheckpoint(path));
  if (!explicit_path && env_.restart_count == 0 && peek.step >= total_steps_) {
    // A finished run's checkpoint: running the same command again trains afresh rather than
    // silently doing nothing.
    Log(FinishedRunMessage(path, peek.step));
    return Status::Ok();
  }
  LAUNCH_ASSIGN_OR_RETURN(state_, LoadCheckpoint(path, *model_, *optimizer_));
  if (state_.world_size != env_.world_size) {
    Log(WorldSizeChangedWarning(state_.world_size, env_.world_size));
    state_.batch_in_epoch = 0;
    ++state_.epoch;
  }
  Log("train: resumed from " + path + " at step " + std::to_string(state_.step) +
      RestartSuffix(env_.restart_count));
  return Status::Ok();
}

void Trainer::TrainStep() {
  const int64_t n = cfg_.gradient_accumulation_steps;
  const int64_t per_epoch = sampler_->batches_per_epoch();
  for (auto& p : model_->Parameters()) {
    // Zero in place (not set to undefined) so gradient memory stays put across steps.
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  double loss_sum = 0;
  int64_t micro = 0;
  while (true) {
    const bool last_of_loader = state_.batch_in_epoch == per_epoch - 1;
    const bool closes = micro == n - 1 || (cfg_.sync_with_dataloader && last_of_loader);
    const bool sync = strategy_->SyncGradients(closes);
    std::vector<int64_t> positions = sampler_->Batch(state_.epoch, state_.batch_in_epoch);
    std::vector<int64_t> rows;
    rows.reserve(positions.size());
    for (int64_t pos : positions) rows.push_back(data_.train_indices[static_cast<size_t>(pos)]);
    torch::Tensor x = data_.Inputs(rows), y = data_.Targets(rows);

    phase_ = "forward";
    strategy_->BeforeForward(sync);
    // dp runs forward and backward on its replicas' threads (dp.h).
    const bool owns = strategy_->RunsForwardBackward();
    torch::Tensor loss = owns ? strategy_->ForwardBackward(
                                    x, y,
                                    [&](const torch::Tensor& l, const torch::Tensor& t) {
                                      return Loss(data_.task, l, t);
                                    },
                                    1.0 / static_cast<double>(n))
                              : Loss(data_.task, model_->Forward(x), y);
    strategy_->BeforeBackward(loss, sync);
    phase_ = "backward";
    // Accelerate's convention: the loss of every micro-batch is divided by N.
    if (!owns) (loss / static_cast<double>(n)).backward();
    strategy_->AfterBackward(sync);
    loss_sum += loss.item<double>();

    ++micro;
    state_.samples_seen += cfg_.batch_size;
    if (++state_.batch_in_epoch == per_epoch) {
      state_.batch_in_epoch = 0;
      ++state_.epoch;
    }
    if (closes) break;
  }
  phase_ = "optimizer step";
  if (cfg_.max_grad_norm > 0)
    torch::nn::utils::clip_grad_norm_(model_->Parameters(), cfg_.max_grad_norm);
  const double lr = LearningRate(cfg_.scheduler, cfg_.optimizer.lr, state_.step, total_steps_);
  for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
  optimizer_->step();
  ++state_.step;
  strategy_->AfterOptimizerStep(state_.step);
  last_loss_ = loss_sum / static_cast<double>(micro);
  micro_last_step_ = micro;
  lr_last_step_ = lr;
}

void Trainer::Evaluate(double* loss, double* accuracy) {
  phase_ = "evaluation";
  torch::NoGradGuard no_grad;
  model_->SetTraining(false);
  double loss_sum = 0, weight = 0, correct = 0, predictions = 0;
  std::vector<int64_t> mine;
  for (size_t i = static_cast<size_t>(env_.rank); i < data_.eval_indices.size();
       i += static_cast<size_t>(env_.world_size))
    mine.push_back(data_.eval_indices[i]);
  const size_t chunk = static_cast<size_t>(std::max<int64_t>(cfg_.batch_size, 256));
  for (size_t start = 0; start < mine.size(); start += chunk) {
    std::vector<int64_t> rows(
        mine.begin() + static_cast<std::ptrdiff_t>(start),
        mine.begin() + static_cast<std::ptrdiff_t>(std::min(mine.size(), start + chunk)));
    auto logits = model_->Forward(data_.Inputs(rows));
    auto y = data_.Targets(rows);
    loss_sum += Loss(data_.task, logits, y).item<double>() * static_cast<double>(rows.size());
    weight += static_cast<double>(rows.size());
    auto [c, p] = CountCorrect(data_.task, logits, y);
    correct += static_cast<double>(c);
    predictions += static_cast<double>(p);
  }
  model_->SetTraining(true);
  // Weighted by sample counts, so the average over ranks equals the average over the split.
  auto totals = torch::tensor({loss_sum, weight, correct, predictions}, torch::kDouble);
  AllReduceSum(pg_, totals);
  auto t = totals.accessor<double, 1>();
  *loss = t[1] > 0 ? t[0] / t[1] : std::nan("");
  *accuracy = t[3] > 0 ? t[2] / t[3] : std::nan("");
  strategy_->TakeStepStats();  // eval's all-reduce belongs to no optimizer step
}

Status Trainer::WriteMetricsLine(const StepCommStats& comm, double loss, double lr, double step_s,
                                 int64_t samples) {
  if (!is_main_) return Status::Ok();
  const double step_ms = step_s * 1000;
  const double comm_ms = std::min(comm.blocking_comm_ms, step_ms);
  metrics_ << "{\"step\": " << state_.step << ", \"loss\": " << Num(loss) << ", \"lr\": " << Num(lr)
           << ", \"samples_per_s\": " << Num(samples / step_s) << ", \"comm_ms\": " << Num(comm_ms)
           << ", \"compute_ms\": " << Num(step_ms - comm_ms) << ", \"step_ms\": " << Num(step_ms)
           << ", \"allreduces\": " << comm.allreduces << ", \"micro_batches\": " << micro_last_step_
           << ", \"buckets_launched_before_grads_done\": " << comm.launched_before_grads_done
           << ", \"epoch\": " << state_.epoch << "}\n";
  metrics_.flush();
  if (!metrics_) return Status::IoError("writing " + cfg_.output_dir + "/metrics.jsonl");
  return Status::Ok();
}

void Trainer::Report(double loss, double lr, double samples_per_s, double comm_ms) {
  if (!is_main_) return;
  const int64_t done = state_.step;
  const double elapsed = Seconds(Clock::now() - train_start_);
  const double eta = steps_this_run_ > 0
                         ? elapsed / steps_this_run_ * static_cast<double>(total_steps_ - done)
                         : NAN;
  if (tty_) {
    const int width = 24;
    const int filled = static_cast<int>(width * done / std::max<int64_t>(1, total_steps_));
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(width, '.');
    std::printf("\r[%s] %lld/%lld loss %.4f %.0f samples/s ETA %s   ", bar.c_str(),
                static_cast<long long>(done), static_cast<long long>(total_steps_), loss,
                samples_per_s, Eta(eta).c_str());
    if (done == total_steps_) std::printf("\n");
    std::fflush(stdout);
    return;
  }
  window_loss_sum_ += loss;
  ++window_steps_;
  if (done % cfg_.log_every != 0 && done != total_steps_ && done != 1) return;
  // The mean over the steps since the last line: one batch's loss is too noisy to read.
  const double mean_loss = window_loss_sum_ / static_cast<double>(window_steps_);
  window_loss_sum_ = 0;
  window_steps_ = 0;
  std::ostringstream line;
  line << "step " << done << "/" << total_steps_ << " loss " << Fixed(mean_loss, 4) << " lr "
       << std::scientific << std::setprecision(2) << lr << std::fixed << " samples/s "
       << Fixed(samples_per_s, 0) << " comm_ms " << Fixed(comm_ms, 2) << " eta " << Eta(eta);
  Log(line.str());
}

Status Trainer::WriteFinal(double train_loss, double eval_loss, double eval_acc, double wall_s) {
  if (!is_main_) return Status::Ok();
  std::ostringstream o;
  o << "{\n  \"steps\": " << state_.step << ",\n  \"train_loss\": " << Num(train_loss)
    << ",\n  \"eval_loss\": " << Num(eval_loss) << ",\n  \"eval_accuracy\": " << Num(eval_acc)
    << ",\n  \"loss_floor\": " << Num(data_.loss_floor) << ",\n  \"param_checksum\": \""
    << Checksum(*model_) << "\""
    << ",\n  \"world_size\": " << env_.world_size << ",\n  \"strategy\": \"" << strategy_->Name()
    << "\",\n  \"buckets\": " << strategy_->num_buckets()
    << ",\n  \"allreduces_total\": " << (pg_ ? pg_->allreduce_count() : 0)
    << ",\n  \"pair_exchanges_total\": " << (pg_ ? pg_->recorded_count() : 0)
    << ",\n  \"samples_seen_per_rank\": " << state_.samples_seen
    << ",\n  \"steps_this_run\": " << steps_this_run_ << ",\n  \"wall_s\": " << Num(wall_s)
    << ",\n  \"loop_s\": " << Num(loop_s_) << "\n}\n";
  return WriteFileAtomically(cfg_.output_dir + "/final.json", o.str());
}

Status Trainer::DumpParams() {
  std::string bytes;
  for (auto& p : model_->Parameters()) {
    auto t = p.detach().to(torch::kFloat).contiguous();
    bytes.append(static_cast<const char*>(t.data_ptr()),
                 static_cast<size_t>(t.numel()) * sizeof(float));
  }
  return WriteFileAtomically(cfg_.output_dir + "/params_rank" + std::to_string(env_.rank) + ".bin",
                             bytes);
}

Status Trainer::Run() {
  const auto wall_start = Clock::now();
  LAUNCH_RETURN_IF_ERROR(Prepare());
  LAUNCH_RETURN_IF_ERROR(MakeDirs(cfg_.output_dir));
  if (is_main_) {
    // Keep the history of the steps this run continues from; drop lines of redone steps.
    const std::string metrics_path = cfg_.output_dir + "/metrics.jsonl";
    const std::string kept = MetricsHistoryUpTo(metrics_path, state_.step);
    metrics_.open(metrics_path, std::ios::trunc);
    if (!metrics_) return Status::IoError("cannot write " + metrics_path);
    metrics_ << kept;
  }
  model_->SetTraining(true);
  train_start_ = Clock::now();
  while (state_.step < total_steps_) {
    const auto step_start = Clock::now();
    const int64_t samples_before = state_.samples_seen;
    TrainStep();
    const double step_s = std::max(1e-9, Seconds(Clock::now() - step_start));
    ++steps_this_run_;
    StepCommStats comm = strategy_->TakeStepStats();
    const int64_t samples = (state_.samples_seen - samples_before) * env_.world_size;
    const double sps = samples / step_s;
    ema_samples_per_s_ = ema_samples_per_s_ == 0 ? sps : 0.9 * ema_samples_per_s_ + 0.1 * sps;
    LAUNCH_RETURN_IF_ERROR(WriteMetricsLine(comm, last_loss_, lr_last_step_, step_s, samples));
    Report(last_loss_, lr_last_step_, ema_samples_per_s_, comm.blocking_comm_ms);
    if (cfg_.eval_every > 0 && state_.step % cfg_.eval_every == 0 && state_.step < total_steps_) {
      double el = 0, ea = 0;
      Evaluate(&el, &ea);
      Log("eval at step " + std::to_string(state_.step) + ": loss " + Fixed(el, 4) +
          (std::isnan(ea) ? "" : " accuracy " + Fixed(ea, 4)));
    }
    const int signo = g_signal;
    if (signo != 0) g_signal = 0;
    const bool scheduled = cfg_.checkpoint_every > 0 && state_.step % cfg_.checkpoint_every == 0;
    if ((scheduled || signo != 0) && state_.step < total_steps_ && is_main_) {
      phase_ = "checkpoint";
      state_.world_size = env_.world_size;
      LAUNCH_RETURN_IF_ERROR(SaveCheckpoint(CheckpointPath(), *model_, *optimizer_, state_));
      if (signo != 0)
        Log("train: " + SignalName(signo) + ": wrote " + CheckpointPath() + " at step " +
            std::to_string(state_.step));
    }
    if (signo == SIGTERM || signo == SIGINT)
      return Status::Interrupted("stopped by " + SignalName(signo) + " at step " +
                                 std::to_string(state_.step) +
                                 (is_main_ ? "; checkpoint written, the next run resumes" : ""));
  }
  loop_s_ = Seconds(Clock::now() - train_start_);
  phase_ = "finishing";
  strategy_->Finish(state_.step);
  double eval_loss = 0, eval_acc = 0;
  Evaluate(&eval_loss, &eval_acc);
  // The final train loss: the last step's loss averaged over ranks.
  auto loss = torch::tensor({std::isnan(last_loss_) ? 0.0 : last_loss_}, torch::kDouble);
  AllReduceSum(pg_, loss);
  const double train_loss =
      std::isnan(last_loss_) ? last_loss_ : loss.item<double>() / env_.world_size;
  if (is_main_) {
    state_.world_size = env_.world_size;
    LAUNCH_RETURN_IF_ERROR(SaveCheckpoint(CheckpointPath(), *model_, *optimizer_, state_));
  }
  if (opts_.dump_params) LAUNCH_RETURN_IF_ERROR(DumpParams());
  const double wall_s = Seconds(Clock::now() - wall_start);
  LAUNCH_RETURN_IF_ERROR(WriteFinal(train_loss, eval_loss, eval_acc, wall_s));
  Log("done: " + std::to_string(state_.step) + " steps, train loss " + Fixed(train_loss, 4) +
      ", eval loss " + Fixed(eval_loss, 4) +
      (std::isnan(eval_acc) ? "" : ", eval accuracy " + Fixed(eval_acc, 4)) +
      (std::isnan(data_.loss_floor) ? "" : " (teacher floor " + Fixed(data_.loss_floor, 4) + ")") +
      ", " + Fixed(wall_s, 1) + " s; wrote " + cfg_.output_dir + "/final.json");
  if (pg_) {
    // Nobody exits while a peer may still need it for the last collective.
    pg_->barrier(c10d::BarrierOptions())->wait();
  }
  return Status::Ok();
}

}  // namespace

Status RunTrainer(const config::TrainConfig& train, const TrainerOptions& options) {
  // Pipeline stages run their own loop (pipeline.h): the schedule replaces forward/backward.
  if (train.parallel.mode == config::ParallelMode::kPipeline)
    return RunPipelineTrainer(train, options);
  StatusOr<DistEnv> env = ParseDistEnv(CurrentEnvironment());
  if (!env.ok()) return env.status();
  Trainer trainer(train, options, *env);
  InstallSignalHandlers();
  try {
    return trainer.Run();
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    const std::string where = "rank " + std::to_string(env->rank) + ", " + trainer.Phase() + ": ";
    if (IsLostPeerError(what))
      return Status::PeerLost(where + "lost a peer during training: " + what);
    return Status::Internal(where + what);
  } catch (const std::exception& e) {
    return Status::Internal("rank " + std::to_string(env->rank) + ": " + e.what());
  }
}

}  // namespace launch::trainer
