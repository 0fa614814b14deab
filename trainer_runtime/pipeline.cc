#include "trainer_runtime/pipeline.h"

#include <sys/resource.h>
#include <torch/script.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <map>
#include <sstream>

#include "base/environment.h"
#include "base/strings.h"
#include "config/loader.h"
#include "trainer_runtime/atomic_file.h"
#include "trainer_runtime/checkpoint.h"
#include "trainer_runtime/data.h"
#include "trainer_runtime/env.h"
#include "trainer_runtime/layers.h"
#include "trainer_runtime/loop_util.h"
#include "trainer_runtime/model.h"
#include "trainer_runtime/pipeline_schedule.h"
#include "trainer_runtime/process_group.h"
#include "trainer_runtime/sampler.h"
#include "trainer_runtime/schedule.h"
#include "trainer_runtime/strategy.h"

namespace launch::trainer {
namespace {

using Clock = std::chrono::steady_clock;
using config::ModelType;

// --- Stage modules ------------------------------------------------------------------------------
// Parameter names equal the whole model's (model.cc), so a stage copies its slice by name and
// checkpoints carry the same names.

// Linear layers [first, last) of the MLP; ReLU (and dropout) after every layer but the model's
// last.
class MlpStageImpl : public torch::nn::Module {
 public:
  MlpStageImpl(const std::vector<int64_t>& widths, int64_t first, int64_t last, double dropout)
      : first_(first), num_layers_(static_cast<int64_t>(widths.size()) - 1), dropout_(dropout) {
    for (int64_t i = first; i < last; ++i)
      layers_.push_back(register_module(
          "fc" + std::to_string(i),
          torch::nn::Linear(widths[static_cast<size_t>(i)], widths[static_cast<size_t>(i) + 1])));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t i = 0; i < layers_.size(); ++i) {
      x = layers_[i]->forward(x);
      if (first_ + static_cast<int64_t>(i) + 1 < num_layers_) {
        x = torch::relu(x);
        if (dropout_ > 0) x = torch::dropout(x, dropout_, is_training());
      }
    }
    return x;
  }

 private:
  int64_t first_, num_layers_;
  double dropout_;
  std::vector<torch::nn::Linear> layers_;
};
TORCH_MODULE(MlpStage);

// Blocks [first, last); the first stage also embeds tokens, the last applies ln_f and the head.
class TransformerStageImpl : public torch::nn::Module {
 public:
  TransformerStageImpl(const config::ModelConfig& cfg, int64_t first, int64_t last)
      : context_(cfg.context),
        has_embedding_(first == 0),
        has_head_(last == cfg.transformer_layers) {
    if (has_embedding_) {
      tok_ = register_module("tok", torch::nn::Embedding(cfg.vocab_size, cfg.d_model));
      pos_ = register_module("pos", torch::nn::Embedding(cfg.context, cfg.d_model));
    }
    for (int64_t i = first; i < last; ++i)
      blocks_.push_back(
          register_module("block" + std::to_string(i), Block(cfg.d_model, cfg.heads, cfg.dropout)));
    if (has_head_) {
      ln_ =
          register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({cfg.d_model})));
      head_ = register_module("head", torch::nn::Linear(cfg.d_model, cfg.vocab_size));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    const int64_t t = x.size(1);
    if (has_embedding_) {
      TORCH_CHECK(t <= context_, "sequence length ", t, " exceeds the model context ", context_);
      x = tok_->forward(x) + pos_->forward(torch::arange(t, torch::kLong));
    }
    auto mask = torch::ones({t, t}, torch::kBool).triu(1);
    for (auto& block : blocks_) x = block->forward(x, mask);
    if (has_head_) x = head_->forward(ln_->forward(x));
    return x;
  }

 private:
  int64_t context_;
  bool has_embedding_, has_head_;
  torch::nn::Embedding tok_{nullptr}, pos_{nullptr};
  std::vector<Block> blocks_;
  torch::nn::LayerNorm ln_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(TransformerStage);

// Parameter count of each partitionable layer (the balancing cost).
std::vector<int64_t> LayerCosts(const config::ModelConfig& m) {
  std::vector<int64_t> costs;
  if (m.type == ModelType::kMlp) {
    for (size_t i = 0; i + 1 < m.mlp_layers.size(); ++i)
      costs.push_back(m.mlp_layers[i] * m.mlp_layers[i + 1] + m.mlp_layers[i + 1]);
  } else if (m.type == ModelType::kTransformer) {
    const int64_t d = m.d_model;
    for (int64_t i = 0; i < m.transformer_layers; ++i) costs.push_back(12 * d * d + 13 * d);
    if (!costs.empty()) {
      costs.front() += (m.vocab_size + m.context) * d;
      costs.back() += 2 * d + d * m.vocab_size + m.vocab_size;
    }
  }
  return costs;
}

// Builds this stage: the whole model from the seed (identical to a single process), then the
// stage's layers with the whole model's values copied in by name.
StatusOr<std::unique_ptr<Model>> BuildStage(const config::TrainConfig& cfg, int stage,
                                            const std::vector<int64_t>& sizes) {
  const config::ModelConfig& m = cfg.model;
  if (m.type == ModelType::kTorchScript) {
    const std::string& path = m.torchscript_stages[static_cast<size_t>(stage)];
    if (!std::ifstream(path))
      return Status::NotFound("train.model.torchscript[" + std::to_string(stage) +
                              "]: cannot read '" + path + "'");
    try {
      torch::jit::Module module = torch::jit::load(path);
      module.train();
      return std::unique_ptr<Model>(std::make_unique<ScriptModel>(std::move(module)));
    } catch (const c10::Error& e) {
      return Status::InvalidConfig("train.model.torchscript[" + std::to_string(stage) +
                                   "]: cannot load '" + path + "': " + e.what_without_backtrace());
    }
  }
  int64_t first = 0;
  for (int s = 0; s < stage; ++s) first += sizes[static_cast<size_t>(s)];
  const int64_t last = first + sizes[static_cast<size_t>(stage)];
  torch::manual_seed(cfg.seed);
  LAUNCH_ASSIGN_OR_RETURN(std::unique_ptr<Model> whole, CreateModel(m));
  std::unique_ptr<Model> part;
  if (m.type == ModelType::kMlp) {
    part = std::make_unique<NativeModel<MlpStage>>(MlpStage(m.mlp_layers, first, last, m.dropout));
  } else {
    part = std::make_unique<NativeModel<TransformerStage>>(TransformerStage(m, first, last));
  }
  std::map<std::string, torch::Tensor> values;
  for (auto& [name, t] : whole->NamedParameters()) values[name] = t;
  for (auto& [name, t] : whole->NamedBuffers()) values[name] = t;
  torch::NoGradGuard no_grad;
  auto copy = [&](NamedTensors tensors) -> Status {
    for (auto& [name, t] : tensors) {
      auto it = values.find(name);
      if (it == values.end() || !it->second.sizes().equals(t.sizes()))
        return Status::Internal("pipeline stage tensor '" + name +
                                "' does not match the whole model");
      t.copy_(it->second);
    }
    return Status::Ok();
  };
  LAUNCH_RETURN_IF_ERROR(copy(part->NamedParameters()));
  LAUNCH_RETURN_IF_ERROR(copy(part->NamedBuffers()));
  return part;
}

uint64_t Fnv(Model& model) {
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
  return h;
}

std::string Hex(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

double PeakRssMb() {
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

// The Gloo group of stage `stage` across the D pipeline replicas: a second client of the job's
// TCPStore (rank 0 hosts it, or the agent), seen through a prefix per stage and restart.
StatusOr<c10::intrusive_ptr<CountingProcessGroup>> CreateStageGroup(
    const DistEnv& env, int stage, int replica, int replicas, std::chrono::milliseconds timeout) {
  try {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<uint16_t>(env.master_port);
    opts.isServer = false;
    opts.waitWorkers = false;
    opts.timeout = timeout;
    auto store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(
        "launch_pp/" + std::to_string(env.restart_count) + "/stage" + std::to_string(stage), store);
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(GlooDevice(env.master_addr));
    options->threads = 2;
    auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, replica, replicas, options);
    return c10::make_intrusive<CountingProcessGroup>(gloo);
  } catch (const std::exception& e) {
    return Status::Timeout("rank " + std::to_string(env.rank) +
                           ": the data-parallel group of stage " + std::to_string(stage) + " (" +
                           std::to_string(replicas) + " replicas) did not form: " + e.what());
  }
}

// Activations travel with a fixed-size header: ndim, up to 6 sizes, scalar type.
constexpr int kHeaderLen = 8;
constexpr int kMaxDims = kHeaderLen - 2;
constexpr int kActivationTag = 0;
constexpr int kGradientTag = 1;

struct StageTotals {
  double busy_s = 0;    // forward + backward compute (no waiting)
  double window_s = 0;  // from the first op's start to the end of the last (with waits)
  int64_t flushes = 0;
  int peak_live = 0;                // micro-batches alive at once (executor count)
  int64_t peak_boundary_bytes = 0;  // bytes of the stage inputs/outputs kept alive
};

class PipelineTrainer {
 public:
  PipelineTrainer(const config::TrainConfig& cfg, const TrainerOptions& opts, const DistEnv& env)
      : cfg_(cfg), opts_(opts), env_(env) {
    if (!opts_.output_dir.empty()) cfg_.output_dir = opts_.output_dir;
    if (opts_.max_steps > 0) cfg_.max_steps = opts_.max_steps;
    stages_ = cfg_.parallel.stages;
    stage_ = env_.rank % stages_;
    replicas_ = env_.world_size / stages_;
    replica_ = env_.rank / stages_;
    first_ = stage_ == 0;
    last_ = stage_ == stages_ - 1;
    is_main_ = last_ && replica_ == 0;
  }

  Status Run();
  std::string Phase() const {
    return "stage " + std::to_string(stage_) + ", " + phase_ + " at step " +
           std::to_string(state_.step + 1);
  }

 private:
  Status Prepare();
  Status MaybeResume();
  Status SaveShard();
  void TrainStep();
  void Flush(const torch::Tensor& x, const torch::Tensor& y, double scale, double* loss_sum);
  void SendActivation(const torch::Tensor& t);
  torch::Tensor RecvActivation();
  void EvaluatePipeline(double* loss, double* accuracy);
  Status WriteFinal(double train_loss, double eval_loss, double eval_acc, double wall_s);
  void Log(const std::string& line) {
    if (is_main_) std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }
  std::string PipelineDir() const {
    return cfg_.resume != "auto" && cfg_.resume != "never"
               ? cfg_.resume
               : cfg_.output_dir + "/checkpoints/pipeline";
  }
  int Prev() const { return env_.rank - 1; }
  int Next() const { return env_.rank + 1; }

  config::TrainConfig cfg_;
  TrainerOptions opts_;
  DistEnv env_;
  int stages_ = 1, stage_ = 0, replicas_ = 1, replica_ = 0;
  bool first_ = true, last_ = true, is_main_ = true;

  c10::intrusive_ptr<CountingProcessGroup> pg_;        // the world: p2p between stages
  c10::intrusive_ptr<CountingProcessGroup> stage_pg_;  // this stage across replicas (D > 1)
  std::unique_ptr<Model> model_;
  std::vector<torch::Tensor> params_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<ShardedSampler> sampler_;
  std::vector<PipeOp> ops_;
  std::vector<int64_t> partition_;
  Dataset data_;
  TrainState state_;
  int64_t total_steps_ = 0;
  std::string phase_ = "setup";
  std::ofstream metrics_;
  StageTotals totals_;
  std::vector<c10::intrusive_ptr<c10d::Work>> pending_sends_;
  std::vector<torch::Tensor> pending_tensors_;  // kept alive until their sends complete
  double last_loss_ = std::nan("");
  double lr_last_step_ = 0;
  int64_t steps_this_run_ = 0;
  double loop_s_ = 0;
  double comm_ms_ = 0;                   // per step: gradient all-reduce + norm (blocking)
  std::vector<int64_t> previous_steps_;  // rank 0: checkpoint steps to delete once superseded
};

Status PipelineTrainer::Prepare() {
  const config::ParallelConfig& pc = cfg_.parallel;
  // Checks the loader cannot do (it does not know the world size, or ran without a model).
  if (env_.world_size % stages_ != 0)
    return Status::InvalidConfig(
        "train.parallel.stages " + std::to_string(stages_) + " does not divide the world size " +
        std::to_string(env_.world_size) + " (world = stages x data-parallel replicas)");
  if (pc.schedule == config::PipelineSchedule::k1F1B && pc.microbatches < stages_)
    return Status::InvalidConfig("train.parallel.microbatches (" + std::to_string(pc.microbatches) +
                                 ") must be at least train.parallel.stages (" +
                                 std::to_string(stages_) + ") for the 1f1b schedule");
  if (cfg_.batch_size < pc.microbatches)
    return Status::InvalidConfig("train.batch_size " + std::to_string(cfg_.batch_size) +
                                 " is smaller than train.parallel.microbatches " +
                                 std::to_string(pc.microbatches) +
                                 "; every micro-batch needs at least one row");
  if (cfg_.local_sgd_steps > 0)
    return Status::InvalidConfig(
        "train.local_sgd_steps: Local SGD does not combine with pipeline mode");
  if (cfg_.model.type == ModelType::kTorchScript) {
    if (static_cast<int>(cfg_.model.torchscript_stages.size()) != stages_)
      return Status::InvalidConfig(
          "train.model.torchscript: pipeline mode needs a list of " + std::to_string(stages_) +
          " TorchScript files (one per stage, train.parallel.stages), got " +
          (cfg_.model.torchscript_stages.empty()
               ? std::string("one file")
               : std::to_string(cfg_.model.torchscript_stages.size())));
    if (!pc.partition.empty())
      return Status::InvalidConfig(
          "train.parallel.partition does not apply to a list of TorchScript stages");
  } else {
    LAUNCH_ASSIGN_OR_RETURN(partition_,
                            PartitionLayers(LayerCosts(cfg_.model), stages_, pc.partition));
  }
  if (cfg_.mixed_precision != "no")
    Log("train: warning: mixed_precision '" + cfg_.mixed_precision +
        "' is not implemented by the trainer yet; training in float32");

  phase_ = "loading data";
  LAUNCH_ASSIGN_OR_RETURN(data_, LoadDataset(cfg_));
  sampler_ = std::make_unique<ShardedSampler>(static_cast<int64_t>(data_.train_indices.size()),
                                              replica_, replicas_, cfg_.batch_size, cfg_.seed);
  const int64_t per_epoch = sampler_->batches_per_epoch();
  if (per_epoch == 0)
    return Status::InvalidConfig("train.batch_size " + std::to_string(cfg_.batch_size) +
                                 " is larger than the " +
                                 std::to_string(sampler_->samples_per_rank()) +
                                 " training samples each pipeline replica gets");
  const int64_t n = cfg_.gradient_accumulation_steps;
  const int64_t steps_per_epoch =
      cfg_.sync_with_dataloader ? (per_epoch + n - 1) / n : std::max<int64_t>(1, per_epoch / n);
  total_steps_ =
      cfg_.max_steps > 0 ? cfg_.max_steps : std::max<int64_t>(1, cfg_.epochs) * steps_per_epoch;

  phase_ = "building the stage";
  LAUNCH_ASSIGN_OR_RETURN(model_, BuildStage(cfg_, stage_, partition_));
  params_ = model_->Parameters();
  optimizer_ = MakeOptimizer(cfg_.optimizer, params_);
  torch::manual_seed(cfg_.seed + 1000003ull * static_cast<uint64_t>(env_.rank + 1));
  ops_ = BuildPipelineSchedule(pc.schedule, stages_, stage_, pc.microbatches);

  if (env_.distributed()) {
    phase_ = "joining the process group";
    auto timeout = std::chrono::milliseconds(static_cast<int64_t>(opts_.init_timeout_s * 1000));
    LAUNCH_ASSIGN_OR_RETURN(pg_, CreateProcessGroup(env_, timeout));
    if (replicas_ > 1) {
      LAUNCH_ASSIGN_OR_RETURN(stage_pg_,
                              CreateStageGroup(env_, stage_, replica_, replicas_, timeout));
    }
  }
  LAUNCH_RETURN_IF_ERROR(MaybeResume());

  int64_t num_params = 0;
  for (auto& p : params_) num_params += p.numel();
  std::vector<std::string> parts;
  for (int64_t v : partition_) parts.push_back(std::to_string(v));
  std::printf("train: pipeline stage %d/%d of replica %d/%d: %lld parameters%s; schedule %s: %s\n",
              stage_, stages_, replica_, replicas_, static_cast<long long>(num_params),
              parts.empty() ? "" : (" (partition " + Join(parts, ",") + ")").c_str(),
              config::ToString(pc.schedule), ScheduleToString(ops_).c_str());
  std::fflush(stdout);
  Log("train: " + std::to_string(env_.world_size) + " process(es), pipeline " +
      std::to_string(stages_) + " stages x " + std::to_string(replicas_) + " replicas, " +
      std::to_string(pc.microbatches) + " micro-batches, " + config::ToString(pc.schedule) + "; " +
      data_.description + "; batch " + std::to_string(cfg_.batch_size) + " per replica x " +
      std::to_string(cfg_.gradient_accumulation_steps) + " accumulation; " +
      std::to_string(total_steps_) + " steps; output " + cfg_.output_dir);
  return Status::Ok();
}

Status PipelineTrainer::MaybeResume() {
  phase_ = "resuming";
  if (cfg_.resume == "never") return Status::Ok();
  const std::string dir = PipelineDir();
  StatusOr<std::string> latest = ReadFile(dir + "/latest");
  if (!latest.ok()) {
    if (cfg_.resume != "auto")
      return Status::NotFound("train.resume: '" + dir +
                              "/latest' does not exist (a pipeline "
                              "resumes from its checkpoints/pipeline directory)");
    return Status::Ok();
  }
  long long step = 0;
  if (!ParseInt64(Trim(*latest), &step))
    return Status::IoError(dir + "/latest: expected a step number, got '" + *latest + "'");
  const std::string shard =
      dir + "/step" + std::to_string(step) + "/stage" + std::to_string(stage_) + ".pt";
  if (cfg_.resume == "auto" && env_.restart_count == 0 && step >= total_steps_) {
    Log(FinishedRunMessage(dir, step));
    return Status::Ok();
  }
  LAUNCH_ASSIGN_OR_RETURN(state_, LoadCheckpoint(shard, *model_, *optimizer_));
  if (state_.world_size != env_.world_size) {
    Log(WorldSizeChangedWarning(state_.world_size, env_.world_size));
    state_.batch_in_epoch = 0;
    ++state_.epoch;
  }
  // Dropout masks after a restart differ from an uninterrupted run's only through the RNG,
  // which the shard restored.
  Log("train: resumed all stages from " + dir + " at step " + std::to_string(state_.step) +
      RestartSuffix(env_.restart_count));
  return Status::Ok();
}

Status PipelineTrainer::SaveShard() {
  phase_ = "checkpoint";
  const std::string dir = cfg_.output_dir + "/checkpoints/pipeline";
  const std::string step_dir = dir + "/step" + std::to_string(state_.step);
  Status status = Status::Ok();
  if (replica_ == 0) {
    state_.world_size = env_.world_size;
    status = SaveCheckpoint(step_dir + "/stage" + std::to_string(stage_) + ".pt", *model_,
                            *optimizer_, state_);
  }
  // Everyone learns whether every shard was written before `latest` moves.
  auto failed = torch::tensor({status.ok() ? 0.0 : 1.0}, torch::kDouble);
  AllReduceSum(pg_, failed);
  if (!status.ok()) return status;
  if (failed.item<double>() > 0)
    return Status::IoError("another stage failed to write its checkpoint shard for step " +
                           std::to_string(state_.step));
  if (env_.rank == 0) {
    LAUNCH_RETURN_IF_ERROR(
        WriteFileAtomically(dir + "/latest", std::to_string(state_.step) + "\n"));
    // Older steps are superseded once `latest` names the new one.
    for (int64_t old : previous_steps_) {
      for (int s = 0; s < stages_; ++s)
        std::remove(
            (dir + "/step" + std::to_string(old) + "/stage" + std::to_string(s) + ".pt").c_str());
      ::rmdir((dir + "/step" + std::to_string(old)).c_str());
    }
    previous_steps_.clear();
    previous_steps_.push_back(state_.step);
  }
  return Status::Ok();
}

void PipelineTrainer::SendActivation(const torch::Tensor& t) {
  TORCH_CHECK(t.dim() <= kMaxDims, "pipeline activations may have at most ", kMaxDims,
              " dimensions, got ", t.dim());
  auto header = torch::zeros({kHeaderLen}, torch::kLong);
  auto h = header.accessor<int64_t, 1>();
  h[0] = t.dim();
  for (int64_t i = 0; i < t.dim(); ++i) h[1 + i] = t.size(i);
  h[kHeaderLen - 1] = static_cast<int64_t>(t.scalar_type());
  torch::Tensor body = t.contiguous();
  for (torch::Tensor* part : {&header, &body}) {
    std::vector<at::Tensor> v = {*part};
    pending_sends_.push_back(pg_->send(v, Next(), kActivationTag));
    pending_tensors_.push_back(*part);
  }
}

torch::Tensor PipelineTrainer::RecvActivation() {
  auto header = torch::empty({kHeaderLen}, torch::kLong);
  std::vector<at::Tensor> hv = {header};
  pg_->recv(hv, Prev(), kActivationTag)->wait();
  auto h = header.accessor<int64_t, 1>();
  std::vector<int64_t> sizes;
  for (int64_t i = 0; i < h[0]; ++i) sizes.push_back(h[1 + i]);
  auto body = torch::empty(
      sizes, torch::TensorOptions().dtype(static_cast<c10::ScalarType>(h[kHeaderLen - 1])));
  std::vector<at::Tensor> bv = {body};
  pg_->recv(bv, Prev(), kActivationTag)->wait();
  return body;
}

// One pass of the schedule over one batch: M micro-batches forward and backward. `scale`
// multiplies every micro-batch's share of the loss (1 / accumulation steps).
void PipelineTrainer::Flush(const torch::Tensor& x, const torch::Tensor& y, double scale,
                            double* loss_sum) {
  const int64_t batch = cfg_.batch_size;
  const auto chunks = SplitRows(batch, cfg_.parallel.microbatches);
  struct Live {
    torch::Tensor input;   // requires grad on every stage but the first
    torch::Tensor output;  // activation sent on, or the weighted loss on the last stage
    int64_t bytes = 0;
  };
  std::map<int, Live> live;
  int64_t live_bytes = 0;
  double busy = 0;
  const auto window_start = Clock::now();
  for (const PipeOp& op : ops_) {
    const auto [offset, rows] = chunks[static_cast<size_t>(op.micro)];
    const double weight = scale * static_cast<double>(rows) / static_cast<double>(batch);
    if (op.kind == PipeOp::Kind::kForward) {
      phase_ = "forward";
      torch::Tensor input = first_ ? x.narrow(0, offset, rows) : RecvActivation();
      if (!first_ && input.is_floating_point()) input.requires_grad_(true);
      const auto t0 = Clock::now();
      torch::Tensor out = model_->Forward(input);
      Live entry{input, out, 0};
      if (last_) {
        torch::Tensor loss = Loss(data_.task, out, y.narrow(0, offset, rows));
        *loss_sum += loss.item<double>() * static_cast<double>(rows) / static_cast<double>(batch);
        entry.output = loss * weight;
      }
      busy += Seconds(Clock::now() - t0);
      if (!last_) SendActivation(out.detach());
      entry.bytes = input.numel() * input.element_size() + out.numel() * out.element_size();
      live_bytes += entry.bytes;
      live.emplace(op.micro, std::move(entry));
      totals_.peak_live = std::max(totals_.peak_live, static_cast<int>(live.size()));
      totals_.peak_boundary_bytes = std::max(totals_.peak_boundary_bytes, live_bytes);
    } else {
      phase_ = "backward";
      auto it = live.find(op.micro);
      TORCH_CHECK(it != live.end(), "schedule runs backward of micro-batch ", op.micro,
                  " before its forward");
      Live entry = std::move(it->second);
      live.erase(it);
      live_bytes -= entry.bytes;
      torch::Tensor grad;
      if (!last_) {
        grad = torch::empty_like(entry.output);
        std::vector<at::Tensor> gv = {grad};
        pg_->recv(gv, Next(), kGradientTag)->wait();
      }
      const auto t0 = Clock::now();
      if (last_) {
        torch::autograd::backward({entry.output});
      } else {
        torch::autograd::backward({entry.output}, {grad});
      }
      busy += Seconds(Clock::now() - t0);
      if (!first_) {
        torch::Tensor g = entry.input.grad().contiguous();
        std::vector<at::Tensor> v = {g};
        pending_sends_.push_back(pg_->send(v, Prev(), kGradientTag));
        pending_tensors_.push_back(g);
      }
    }
  }
  for (auto& work : pending_sends_) work->wait();
  pending_sends_.clear();
  pending_tensors_.clear();
  totals_.busy_s += busy;
  totals_.window_s += Seconds(Clock::now() - window_start);
  ++totals_.flushes;
}

void PipelineTrainer::TrainStep() {
  const int64_t n = cfg_.gradient_accumulation_steps;
  const int64_t per_epoch = sampler_->batches_per_epoch();
  for (auto& p : params_) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  double loss_sum = 0;
  int64_t micro = 0;
  comm_ms_ = 0;
  while (true) {
    const bool last_of_loader = state_.batch_in_epoch == per_epoch - 1;
    const bool closes = micro == n - 1 || (cfg_.sync_with_dataloader && last_of_loader);
    std::vector<int64_t> positions = sampler_->Batch(state_.epoch, state_.batch_in_epoch);
    std::vector<int64_t> rows;
    rows.reserve(positions.size());
    for (int64_t pos : positions) rows.push_back(data_.train_indices[static_cast<size_t>(pos)]);
    // Only the ends of the pipeline touch the data: inputs on the first stage, labels on the last.
    torch::Tensor x = first_ ? data_.Inputs(rows) : torch::Tensor();
    torch::Tensor y = last_ ? data_.Targets(rows) : torch::Tensor();
    Flush(x, y, 1.0 / static_cast<double>(n), &loss_sum);
    ++micro;
    state_.samples_seen += cfg_.batch_size;
    if (++state_.batch_in_epoch == per_epoch) {
      state_.batch_in_epoch = 0;
      ++state_.epoch;
    }
    if (closes) break;
  }
  double loss = loss_sum / static_cast<double>(micro);
  const auto comm_start = Clock::now();
  if (stage_pg_) {
    phase_ = "gradient all-reduce";
    // One flat all-reduce per step over this stage's replicas (per-call latency dominates on
    // Gloo); the last stage carries its loss along so replica 0 logs the mean.
    std::vector<torch::Tensor> flat_parts;
    for (auto& p : params_) {
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
      flat_parts.push_back(p.grad().reshape({-1}));
    }
    flat_parts.push_back(
        torch::full({1}, loss, params_.empty() ? torch::kFloat : params_[0].scalar_type()));
    std::vector<at::Tensor> flat = {torch::cat(flat_parts)};
    stage_pg_->allreduce(flat, c10d::AllreduceOptions())->wait();
    flat[0].div_(replicas_);
    int64_t offset = 0;
    for (auto& p : params_) {
      const int64_t k = p.numel();
      p.mutable_grad().copy_(flat[0].narrow(0, offset, k).view_as(p));
      offset += k;
    }
    loss = flat[0][offset].item<double>();
  }
  phase_ = "optimizer step";
  if (cfg_.max_grad_norm > 0) {
    // The norm over the whole model: squares summed over stages (and over identical replicas,
    // hence the division).
    double sq = 0;
    for (auto& p : params_)
      if (p.grad().defined()) sq += p.grad().pow(2).sum().item<double>();
    auto total = torch::tensor({sq}, torch::kDouble);
    AllReduceSum(pg_, total);
    const double norm = std::sqrt(total.item<double>() / replicas_);
    const double coef = cfg_.max_grad_norm / (norm + 1e-6);
    if (coef < 1) {
      torch::NoGradGuard no_grad;
      for (auto& p : params_)
        if (p.grad().defined()) p.mutable_grad().mul_(coef);
    }
  }
  comm_ms_ = std::chrono::duration<double, std::milli>(Clock::now() - comm_start).count();
  const double lr = LearningRate(cfg_.scheduler, cfg_.optimizer.lr, state_.step, total_steps_);
  for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
  optimizer_->step();
  ++state_.step;
  last_loss_ = loss;
  lr_last_step_ = lr;
}

void PipelineTrainer::EvaluatePipeline(double* loss, double* accuracy) {
  phase_ = "evaluation";
  torch::NoGradGuard no_grad;
  model_->SetTraining(false);
  double loss_sum = 0, weight = 0, correct = 0, predictions = 0;
  std::vector<int64_t> mine;
  for (size_t i = static_cast<size_t>(replica_); i < data_.eval_indices.size();
       i += static_cast<size_t>(replicas_))
    mine.push_back(data_.eval_indices[i]);
  const size_t chunk = static_cast<size_t>(std::max<int64_t>(cfg_.batch_size, 256));
  for (size_t start = 0; start < mine.size(); start += chunk) {
    std::vector<int64_t> rows(
        mine.begin() + static_cast<std::ptrdiff_t>(start),
        mine.begin() + static_cast<std::ptrdiff_t>(std::min(mine.size(), start + chunk)));
    torch::Tensor in = first_ ? data_.Inputs(rows) : RecvActivation();
    torch::Tensor out = model_->Forward(in);
    if (!last_) {
      SendActivation(out);
      continue;
    }
    auto y = data_.Targets(rows);
    loss_sum += Loss(data_.task, out, y).item<double>() * static_cast<double>(rows.size());
    weight += static_cast<double>(rows.size());
    auto [c, p] = CountCorrect(data_.task, out, y);
    correct += static_cast<double>(c);
    predictions += static_cast<double>(p);
  }
  for (auto& work : pending_sends_) work->wait();
  pending_sends_.clear();
  pending_tensors_.clear();
  model_->SetTraining(true);
  auto totals = torch::tensor({loss_sum, weight, correct, predictions}, torch::kDouble);
  AllReduceSum(pg_, totals);
  auto t = totals.accessor<double, 1>();
  *loss = t[1] > 0 ? t[0] / t[1] : std::nan("");
  *accuracy = t[3] > 0 ? t[2] / t[3] : std::nan("");
}

Status PipelineTrainer::WriteFinal(double train_loss, double eval_loss, double eval_acc,
                                   double wall_s) {
  // Per-stage figures, gathered from replica 0 of each stage by one sum all-reduce.
  constexpr int kFields = 8;
  auto gathered = torch::zeros({stages_ * kFields}, torch::kDouble);
  if (replica_ == 0) {
    const uint64_t h = Fnv(*model_);
    auto g = gathered.accessor<double, 1>();
    const int base = stage_ * kFields;
    g[base + 0] = totals_.peak_live;
    g[base + 1] = totals_.window_s > 0 ? 1.0 - totals_.busy_s / totals_.window_s : 0.0;
    g[base + 2] = totals_.busy_s;
    g[base + 3] = totals_.window_s;
    g[base + 4] = PeakRssMb();
    g[base + 5] = static_cast<double>(h >> 32);
    g[base + 6] = static_cast<double>(h & 0xffffffffull);
    g[base + 7] = static_cast<double>(totals_.peak_boundary_bytes);
  }
  AllReduceSum(pg_, gathered);
  if (!is_main_) return Status::Ok();
  auto g = gathered.accessor<double, 1>();
  auto list = [&](int field, bool integer) {
    std::string out = "[";
    for (int s = 0; s < stages_; ++s) {
      const double v = g[s * kFields + field];
      out += (s ? ", " : "") + (integer ? std::to_string(std::llround(v)) : Num(v));
    }
    return out + "]";
  };
  std::string checksums = "[";
  uint64_t combined = 1469598103934665603ull;
  for (int s = 0; s < stages_; ++s) {
    const uint64_t h = (static_cast<uint64_t>(g[s * kFields + 5]) << 32) |
                       static_cast<uint64_t>(g[s * kFields + 6]);
    combined = (combined ^ h) * 1099511628211ull;
    checksums += std::string(s ? ", " : "") + "\"" + Hex(h) + "\"";
  }
  checksums += "]";
  std::ostringstream o;
  o << "{\n  \"steps\": " << state_.step << ",\n  \"train_loss\": " << Num(train_loss)
    << ",\n  \"eval_loss\": " << Num(eval_loss) << ",\n  \"eval_accuracy\": " << Num(eval_acc)
    << ",\n  \"loss_floor\": " << Num(data_.loss_floor) << ",\n  \"param_checksum\": \""
    << Hex(combined) << "\",\n  \"world_size\": " << env_.world_size
    << ",\n  \"strategy\": \"pipeline\",\n  \"buckets\": 0"
    << ",\n  \"allreduces_total\": " << (stage_pg_ ? stage_pg_->allreduce_count() : 0)
    << ",\n  \"samples_seen_per_rank\": " << state_.samples_seen
    << ",\n  \"steps_this_run\": " << steps_this_run_ << ",\n  \"wall_s\": " << Num(wall_s)
    << ",\n  \"loop_s\": " << Num(loop_s_) << ",\n  \"pipeline\": {\n    \"stages\": " << stages_
    << ",\n    \"replicas\": " << replicas_
    << ",\n    \"microbatches\": " << cfg_.parallel.microbatches << ",\n    \"schedule\": \""
    << config::ToString(cfg_.parallel.schedule) << "\",\n    \"partition\": [";
  for (size_t i = 0; i < partition_.size(); ++i) o << (i ? ", " : "") << partition_[i];
  o << "],\n    \"peak_live_microbatches\": " << list(0, true)
    << ",\n    \"idle_fraction\": " << list(1, false) << ",\n    \"theoretical_bubble\": "
    << Num(TheoreticalBubble(stages_, cfg_.parallel.microbatches))
    << ",\n    \"busy_s\": " << list(2, false) << ",\n    \"window_s\": " << list(3, false)
    << ",\n    \"peak_rss_mb\": " << list(4, false)
    << ",\n    \"peak_boundary_activation_bytes\": " << list(7, true)
    << ",\n    \"stage_param_checksums\": " << checksums << "\n  }\n}\n";
  return WriteFileAtomically(cfg_.output_dir + "/final.json", o.str());
}

Status PipelineTrainer::Run() {
  const auto wall_start = Clock::now();
  LAUNCH_RETURN_IF_ERROR(Prepare());
  LAUNCH_RETURN_IF_ERROR(MakeDirs(cfg_.output_dir));
  if (is_main_) {
    const std::string metrics_path = cfg_.output_dir + "/metrics.jsonl";
    const std::string kept = MetricsHistoryUpTo(metrics_path, state_.step);
    metrics_.open(metrics_path, std::ios::trunc);
    if (!metrics_) return Status::IoError("cannot write " + metrics_path);
    metrics_ << kept;
  }
  model_->SetTraining(true);
  const auto train_start = Clock::now();
  while (state_.step < total_steps_) {
    const auto step_start = Clock::now();
    const int64_t samples_before = state_.samples_seen;
    TrainStep();
    const double step_s = std::max(1e-9, Seconds(Clock::now() - step_start));
    if (++steps_this_run_ == 1) {
      // The first step pays for allocations and lazy initialisation: leave it out of the
      // idle-fraction figures (peak live counts keep it).
      totals_.busy_s = totals_.window_s = 0;
      totals_.flushes = 0;
    }
    const int64_t samples = (state_.samples_seen - samples_before) * replicas_;
    if (is_main_) {
      metrics_ << "{\"step\": " << state_.step << ", \"loss\": " << Num(last_loss_)
               << ", \"lr\": " << Num(lr_last_step_)
               << ", \"samples_per_s\": " << Num(samples / step_s)
               << ", \"comm_ms\": " << Num(comm_ms_) << ", \"step_ms\": " << Num(step_s * 1000)
               << ", \"micro_batches\": " << cfg_.parallel.microbatches
               << ", \"peak_live_microbatches\": " << totals_.peak_live
               << ", \"epoch\": " << state_.epoch << "}\n";
      metrics_.flush();
      if (!metrics_) return Status::IoError("writing " + cfg_.output_dir + "/metrics.jsonl");
      if (state_.step % cfg_.log_every == 0 || state_.step == total_steps_ || state_.step == 1)
        Log("step " + std::to_string(state_.step) + "/" + std::to_string(total_steps_) + " loss " +
            Fixed(last_loss_, 4) + " samples/s " + Fixed(samples / step_s, 0));
    }
    if (cfg_.checkpoint_every > 0 && state_.step % cfg_.checkpoint_every == 0 &&
        state_.step < total_steps_)
      LAUNCH_RETURN_IF_ERROR(SaveShard());
  }
  loop_s_ = Seconds(Clock::now() - train_start);
  phase_ = "finishing";
  double eval_loss = 0, eval_acc = 0;
  EvaluatePipeline(&eval_loss, &eval_acc);
  LAUNCH_RETURN_IF_ERROR(SaveShard());
  if (opts_.dump_params) {
    std::string bytes;
    for (auto& p : params_) {
      auto t = p.detach().to(torch::kFloat).contiguous();
      bytes.append(static_cast<const char*>(t.data_ptr()),
                   static_cast<size_t>(t.numel()) * sizeof(float));
    }
    LAUNCH_RETURN_IF_ERROR(WriteFileAtomically(
        cfg_.output_dir + "/params_rank" + std::to_string(env_.rank) + ".bin", bytes));
  }
  const double wall_s = Seconds(Clock::now() - wall_start);
  LAUNCH_RETURN_IF_ERROR(WriteFinal(last_loss_, eval_loss, eval_acc, wall_s));
  Log("done: " + std::to_string(state_.step) + " steps, train loss " + Fixed(last_loss_, 4) +
      ", eval loss " + Fixed(eval_loss, 4) +
      (std::isnan(eval_acc) ? "" : ", eval accuracy " + Fixed(eval_acc, 4)) + ", " +
      Fixed(wall_s, 1) + " s; wrote " + cfg_.output_dir + "/final.json");
  if (pg_) pg_->barrier(c10d::BarrierOptions())->wait();
  return Status::Ok();
}

}  // namespace

Status RunPipelineTrainer(const config::TrainConfig& train, const TrainerOptions& options) {
  StatusOr<DistEnv> env = ParseDistEnv(CurrentEnvironment());
  if (!env.ok()) return env.status();
  PipelineTrainer trainer(train, options, *env);
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
