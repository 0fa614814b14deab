// The cross-field rules of `train:` (config/train_keys.h), written once for launch, train and
// programs that build a TrainConfig in code.

#include <filesystem>
#include <fstream>

#include "base/strings.h"
#include "config/key_table.h"  // ApplyAccelerateSharding
#include "config/train_keys.h"

namespace launch::config {
namespace {

// Where a rule about `keys` points: the first of them given anywhere, else the section they
// live in, else the train: section itself.
std::string WhereOf(const LaunchConfig& cfg, const std::vector<std::string>& keys) {
  for (const std::string& k : keys) {
    auto it = cfg.origins.find("train." + k);
    if (it != cfg.origins.end()) return it->second.ToString();
  }
  for (const std::string& k : keys) {
    for (std::string s = KeySection(k); !s.empty(); s = KeySection(s)) {
      auto it = cfg.origins.find("train." + s);
      if (it != cfg.origins.end()) return it->second.ToString();
    }
  }
  auto it = cfg.origins.find("train");
  return it == cfg.origins.end() ? cfg.config_path : it->second.ToString();
}

TrainRuleViolation Broken(std::string key, std::string message, std::vector<std::string> at = {}) {
  return TrainRuleViolation{std::move(key), std::move(message), std::move(at)};
}

std::string N(int64_t v) { return std::to_string(v); }

}  // namespace

std::optional<TrainRuleViolation> CheckTrainRules(const TrainConfig& t, int world_size,
                                                  bool builtin_model) {
  if (t.gradient_accumulation_steps < 1)
    return Broken("gradient_accumulation_steps", "must be at least 1");
  if (t.local_sgd_steps < 0) return Broken("local_sgd_steps", "must be 0 (off) or positive");

  const ModelConfig& m = t.model;
  switch (m.type) {
    case ModelType::kTransformer:
      if (m.heads < 1 || m.d_model % m.heads != 0)
        return Broken("model.heads",
                      "d_model " + N(m.d_model) + " is not divisible by heads " + N(m.heads),
                      {"model.heads", "model.d_model"});
      if (t.data.type != DataType::kText)
        return Broken("model", "a transformer needs `data: {type: text, ...}`", {"model.type"});
      break;
    case ModelType::kCnn: {
      if (m.cnn_channels.empty())
        return Broken("model.channels", "needs at least one block, e.g. [16, 32]");
      if (m.input_shape.size() != 3)
        return Broken("model.input", "expected [channels, height, width], e.g. [1, 28, 28]");
      const int64_t shrink = int64_t{1} << std::min<size_t>(m.cnn_channels.size(), 30);
      if (m.input_shape[1] < shrink || m.input_shape[2] < shrink)
        return Broken("model.channels",
                      N(static_cast<int64_t>(m.cnn_channels.size())) + " blocks halve a " +
                          N(m.input_shape[1]) + "x" + N(m.input_shape[2]) +
                          " image to nothing; use fewer blocks (each 2x2 pooling halves it)",
                      {"model.channels", "model.input"});
      break;
    }
    case ModelType::kMlp:
      if (m.mlp_layers.size() < 2)
        return Broken("model.layers",
                      "an MLP needs at least an input and an output width, e.g. [32, 10]");
      break;
    case ModelType::kTorchScript:
      if (m.torchscript_path.empty() && m.torchscript_stages.empty())
        return Broken("model", "type torchscript needs `torchscript: PATH`", {"model.type"});
      for (const std::string& field : m.inputs)
        if (field != "input" && field != "target")
          return Broken("model.inputs",
                        "'" + field + "' is not a batch field; fields are input, target");
      if (m.inputs.empty())
        return Broken("model.inputs", "forward needs at least one input, e.g. [input]");
      break;
  }

  const DataConfig& d = t.data;
  if ((d.type == DataType::kCsv || d.type == DataType::kText) && d.path.empty())
    return Broken("data", std::string("type ") + ToString(d.type) + " needs `path: FILE`",
                  {"data.type"});

  const LossConfig& l = t.loss;
  const bool ce = l.type == LossType::kAuto || l.type == LossType::kCrossEntropy;
  if (!ce && (l.label_smoothing > 0 || !l.class_weights.empty() || l.ignore_index != -100))
    return Broken("loss.type", std::string("label_smoothing, ignore_index and class_weights are "
                                           "cross_entropy options, not ") +
                                   ToString(l.type));

  const OptimizerConfig& o = t.optimizer;
  if (o.type == OptimizerType::kSgd && (o.implementation == OptimizerImplementation::kForeach ||
                                        o.implementation == OptimizerImplementation::kFused))
    return Broken("optimizer.implementation",
                  std::string(ToString(o.implementation)) +
                      " is an Adam and AdamW implementation; sgd takes auto or for_loop",
                  {"optimizer.implementation", "optimizer.type"});

  const ParallelConfig& p = t.parallel;
  // The layout: world = tensor x context x data x stages (trainer_runtime/parallel/layout.h).
  if (world_size > 0 && world_size % (p.stages * p.tensor * p.context) != 0) {
    const char* key = p.context > 1  ? "parallel.context"
                      : p.tensor > 1 ? "parallel.tensor"
                                     : "parallel.stages";
    return Broken(key,
                  "stages x tensor x context (" + N(p.stages) + " x " + N(p.tensor) + " x " +
                      N(p.context) + ") does not divide the world size " + N(world_size) +
                      " (world = tensor x context x data x stages)",
                  {"parallel.stages", "parallel.tensor", "parallel.context"});
  }
  if (p.context > 1) {
    // The context ranks of a replica run one forward together, so their parameters must stay
    // equal every step: gradients are averaged over context x data (Megatron's dp-cp group).
    if (p.pipelined())
      return Broken("parallel.context", "does not combine with pipeline stages yet",
                    {"parallel.context", "parallel.stages"});
    if (p.mode != ParallelMode::kDdp && p.mode != ParallelMode::kZero)
      return Broken("parallel.context",
                    "splits each sequence over ranks that average their gradients every step; it "
                    "combines with parallel.mode ddp or zero, not " +
                        std::string(ToString(p.mode)),
                    {"parallel.context", "parallel.mode"});
    if (t.local_sgd_steps > 0)
      return Broken("parallel.context",
                    "the ranks that split a sequence must step together; Local SGD lets replicas "
                    "drift for local_sgd_steps steps",
                    {"parallel.context", "local_sgd_steps"});
    if (builtin_model) {
      if (m.type != ModelType::kTransformer)
        return Broken("parallel.context",
                      std::string("splits the built-in transformer's sequences; model.type ") +
                          ToString(m.type) + " has none",
                      {"parallel.context", "model.type"});
      if (m.heads % (p.tensor * p.context) != 0)
        return Broken("parallel.context",
                      "tensor x context (" + N(p.tensor) + " x " + N(p.context) +
                          ") does not divide model.heads " + N(m.heads) +
                          " (attention runs heads / (tensor x context) of them on each rank)",
                      {"parallel.context", "parallel.tensor", "model.heads"});
      const int64_t sequence = t.data.context > 0 ? t.data.context : m.context;
      const int64_t pieces = p.context * (p.sequence_parallel ? p.tensor : 1);
      if (sequence % pieces != 0)
        return Broken("parallel.context",
                      "a sequence of " + N(sequence) +
                          " tokens (data.context, else model.context) does not split into " +
                          N(pieces) + " equal parts (context" +
                          (p.sequence_parallel ? " x tensor, with sequence_parallel)" : ")"),
                      {"parallel.context", "data.context", "model.context"});
    }
  }
  if (p.comm_hook != CommHook::kNone && p.data_mode() != ParallelMode::kDdp)
    return Broken("parallel.comm_hook", "applies to mode ddp (its gradient buckets), not " +
                                            std::string(ToString(p.mode)));
  if (p.comm_hook == CommHook::kPowerSgd) {
    if (p.pipelined() || p.tensor > 1 || p.context > 1)
      return Broken("parallel.comm_hook",
                    "power_sgd applies to ddp over whole replicas (no stages, no tensor or "
                    "context groups)",
                    {"parallel.comm_hook", p.context > 1  ? "parallel.context"
                                           : p.tensor > 1 ? "parallel.tensor"
                                                          : "parallel.stages"});
    // PowerSGDState's own rule (it keeps the error and the factors per bucket, and DDP rebuilds
    // its buckets after the first step): what PyTorch refuses is refused here too.
    const PowerSgdConfig& s = p.power_sgd;
    if ((s.use_error_feedback || s.warm_start) && s.start_powerSGD_iter <= 1)
      return Broken("parallel.power_sgd.start_powerSGD_iter",
                    "must be > 1 with use_error_feedback or warm_start (PowerSGD starts after "
                    "DDP's first two steps)");
  }
  if (p.sync_batchnorm) {
    if (p.mode != ParallelMode::kDdp && p.mode != ParallelMode::kDp)
      return Broken("parallel.sync_batchnorm",
                    "applies to modes ddp and dp (statistics over the data-parallel batch), not " +
                        std::string(ToString(p.mode)),
                    {"parallel.sync_batchnorm", "parallel.mode"});
    if (t.local_sgd_steps > 0)
      return Broken("parallel.sync_batchnorm",
                    "Local SGD replicas train on their own; it does not combine with "
                    "local_sgd_steps",
                    {"parallel.sync_batchnorm", "local_sgd_steps"});
    if (m.activation_checkpointing)
      return Broken("parallel.sync_batchnorm",
                    "does not combine with model.activation_checkpointing (the recomputed "
                    "forward would need the group's statistics again)",
                    {"parallel.sync_batchnorm", "model.activation_checkpointing"});
  }
  if (p.mode == ParallelMode::kDp) {
    if (world_size > 1)
      return Broken("parallel.mode", "dp drives its replicas inside one process (WORLD_SIZE " +
                                         N(world_size) + "); use ddp across processes");
    if (t.local_sgd_steps > 0)
      return Broken("local_sgd_steps",
                    "Local SGD averages replicas across processes; it does not combine with "
                    "parallel.mode dp");
  }
  // mode none promises no communication; Local SGD averages parameters across processes.
  if (p.mode == ParallelMode::kNone && t.local_sgd_steps > 0)
    return Broken("local_sgd_steps",
                  "Local SGD averages parameters across processes every K steps; "
                  "parallel.mode none trains each process alone (use mode ddp, the default, "
                  "with local_sgd_steps)",
                  {"local_sgd_steps", "parallel.mode"});
  // Local SGD never all-reduces gradients, so there is nothing to synchronise each batch.
  if (t.local_sgd_steps > 0 && t.sync_each_batch)
    return Broken("sync_each_batch",
                  "all-reduces gradients every micro-batch, but Local SGD (local_sgd_steps " +
                      N(t.local_sgd_steps) +
                      ") all-reduces no gradients; it averages parameters every K steps",
                  {"sync_each_batch", "local_sgd_steps"});
  if (p.mode == ParallelMode::kZero && t.local_sgd_steps > 0)
    return Broken("local_sgd_steps",
                  "Local SGD keeps a whole replica on every rank and averages parameters; it "
                  "does not combine with parallel.mode zero (state sharded over the ranks)",
                  {"local_sgd_steps", "parallel.mode"});
  if (p.mode == ParallelMode::kDp && (p.stages > 1 || p.tensor > 1))
    return Broken("parallel.mode",
                  "dp runs its replicas in one process; it does not combine with "
                  "parallel.stages or parallel.tensor",
                  {"parallel.mode", "parallel.stages", "parallel.tensor"});
  if (p.sequence_parallel && p.tensor == 1)
    return Broken("parallel.sequence_parallel",
                  "shards the sequence over the tensor-parallel ranks; it needs parallel.tensor "
                  "above 1",
                  {"parallel.sequence_parallel", "parallel.tensor"});
  if (p.tensor > 1 && builtin_model) {
    if (m.type != ModelType::kTransformer)
      return Broken("parallel.tensor",
                    std::string("splits the built-in transformer's layers; model.type ") +
                        ToString(m.type) + " has no tensor-parallel layers",
                    {"parallel.tensor", "model.type"});
    if (m.heads % p.tensor != 0)
      return Broken("parallel.tensor",
                    N(p.tensor) + " does not divide model.heads " + N(m.heads) +
                        " (each rank computes heads / tensor of them)",
                    {"parallel.tensor", "model.heads"});
    if (m.vocab_size % p.tensor != 0)
      return Broken("parallel.tensor",
                    N(p.tensor) + " does not divide the vocabulary (" + N(m.vocab_size) +
                        ": each rank embeds and predicts vocabulary / tensor of it)",
                    {"parallel.tensor", "model.vocab"});
    if (p.sequence_parallel) {
      const int64_t sequence = t.data.context > 0 ? t.data.context : m.context;
      if (sequence % p.tensor != 0)
        return Broken("parallel.sequence_parallel",
                      "a sequence of " + N(sequence) +
                          " tokens (data.context, else "
                          "model.context) does not split over parallel.tensor " +
                          N(p.tensor) + " ranks",
                      {"parallel.sequence_parallel", "data.context", "model.context"});
    }
  }
  if (p.pipelined()) {
    if ((p.schedule == PipelineSchedule::k1F1B || p.schedule == PipelineSchedule::kZeroBubble) &&
        p.microbatches < p.stages)
      return Broken("parallel.microbatches",
                    std::string(p.schedule == PipelineSchedule::k1F1B ? "1F1B" : "zero_bubble") +
                        " needs at least as many micro-batches (" + N(p.microbatches) +
                        ") as stages (" + N(p.stages) + ")",
                    {"parallel.microbatches", "parallel.stages"});
    if (p.schedule == PipelineSchedule::kInterleaved1F1B) {
      if (p.stages < 2)
        return Broken("parallel.schedule",
                      "interleaved_1f1b passes each micro-batch around the ranks of a pipeline "
                      "virtual_stages times; it needs parallel.stages above 1",
                      {"parallel.schedule", "parallel.stages"});
      if (p.virtual_stages < 2)
        return Broken("parallel.virtual_stages",
                      "interleaved_1f1b needs at least 2 model chunks per rank (got " +
                          N(p.virtual_stages) + "); with one, use schedule 1f1b",
                      {"parallel.virtual_stages", "parallel.schedule"});
      if (p.microbatches % p.stages != 0)
        return Broken("parallel.microbatches",
                      "interleaved_1f1b runs micro-batches in groups of parallel.stages (" +
                          N(p.stages) + "); " + N(p.microbatches) + " is not a multiple of it",
                      {"parallel.microbatches", "parallel.stages"});
    }
    if ((p.schedule == PipelineSchedule::kZeroBubble ||
         p.schedule == PipelineSchedule::kInterleaved1F1B) &&
        ((p.data_mode() == ParallelMode::kZero && p.zero_stage >= 2) || t.sync_each_batch))
      return Broken("parallel.schedule",
                    std::string(ToString(p.schedule)) +
                        " leaves a parameter's gradient whole only after the schedule's last "
                        "pass over it (weight passes run late; each chunk's passes interleave "
                        "with the others'), so the data axis reduces once per step; it does not "
                        "combine with reducing each micro-batch (parallel.zero_stage 2 or 3, "
                        "sync_each_batch): use zero_stage 1 or schedule 1f1b",
                    {"parallel.schedule", "parallel.zero_stage", "sync_each_batch"});
    if (t.batch_size < p.microbatches)
      return Broken("batch_size",
                    N(t.batch_size) + " is smaller than train.parallel.microbatches " +
                        N(p.microbatches) + "; every micro-batch needs at least one row",
                    {"batch_size", "parallel.microbatches"});
    if (!p.partition.empty() && static_cast<int>(p.partition.size()) != p.stages * p.virtual_stages)
      return Broken("parallel.partition",
                    "has " + N(static_cast<int64_t>(p.partition.size())) +
                        " entries but the model is cut into " + N(p.stages * p.virtual_stages) +
                        " chunks (stages " + N(p.stages) +
                        (p.virtual_stages > 1 ? " x virtual_stages " + N(p.virtual_stages) : "") +
                        ")",
                    {"parallel.partition", "parallel.stages", "parallel.virtual_stages"});
    if (t.local_sgd_steps > 0)
      return Broken("local_sgd_steps", "Local SGD does not combine with pipeline mode");
    if (m.type == ModelType::kCnn)
      return Broken("model",
                    "pipeline mode splits mlp, transformer or a list of TorchScript stages, not "
                    "a cnn",
                    {"parallel.mode"});
    if (m.inputs != std::vector<std::string>{"input"} || !m.output_loss.empty())
      return Broken("model",
                    "pipeline stages take one tensor and return one tensor (no `inputs` or "
                    "`outputs.loss`)",
                    {"model.inputs", "model.outputs.loss"});
    if (m.type == ModelType::kTorchScript) {
      if (static_cast<int>(m.torchscript_stages.size()) != p.stages)
        return Broken("model.torchscript",
                      "pipeline mode needs a list of " + N(p.stages) +
                          " TorchScript files (one per stage, train.parallel.stages), got " +
                          (m.torchscript_stages.empty()
                               ? std::string("one file")
                               : N(static_cast<int64_t>(m.torchscript_stages.size()))));
      if (!p.partition.empty())
        return Broken("parallel.partition", "does not apply to a list of TorchScript stages");
      if (p.virtual_stages > 1)
        return Broken("parallel.virtual_stages",
                      "a list of TorchScript stages holds one per rank; interleaving needs the "
                      "built-in mlp or transformer (or the library's PreparePipeline with chunks)",
                      {"parallel.virtual_stages", "model.torchscript"});
    }
  }
  return std::nullopt;
}

Status CheckTrainRulesStatus(const TrainConfig& t, int world_size, bool builtin_model) {
  std::optional<TrainRuleViolation> v = CheckTrainRules(t, world_size, builtin_model);
  if (!v) return Status::Ok();
  return Status::InvalidConfig("train." + v->key + ": " + v->message);
}

Status ValidateTrain(LaunchConfig* cfg, int world_size) {
  TrainConfig& t = cfg->train;
  if (!t.present) return Status::Ok();
  // Derived defaults: they depend on other keys, so they are settled once every layer is in.
  if (!cfg->origins.count("train.optimizer.weight_decay"))
    t.optimizer.weight_decay = t.optimizer.type == OptimizerType::kAdamW ? 0.01 : 0.0;
  if (t.data.type == DataType::kIdx && t.data.path.empty()) t.data.path = kFashionMnistDir;

  if (t.mixed_precision == "fp8") {
    auto it = cfg->origins.find("mixed_precision");
    return Status::InvalidConfig(
        (it == cfg->origins.end() ? std::string("mixed_precision") : it->second.ToString()) +
        ": mixed_precision fp8 is for a script's Accelerator; the built-in trainer takes no, "
        "bf16 or fp16");
  }
  // accelerate's FSDP / DeepSpeed settings choose the mode where train: does not: a derived
  // value too, so the rules below see the mode that will run.
  LAUNCH_RETURN_IF_ERROR(ApplyAccelerateSharding(cfg));
  LAUNCH_RETURN_IF_ERROR(ApplyAccelerateTensorParallel(cfg));
  // A key of one strategy given to another would be ignored, and the run would quietly be
  // another one than the user meant (`zero_stage: 3` without `mode: zero` trains ddp). Unless
  // a higher layer (a flag over the file) changed the mode: the file's keys are then inert by
  // design, and so are they in the effective configuration, which carries every key.
  const ParallelConfig& p = t.parallel;
  const auto mode_origin = cfg->origins.find("train.parallel.mode");
  const Origin::Kind mode_kind =
      mode_origin == cfg->origins.end() ? Origin::Kind::kDefault : mode_origin->second.kind;
  const ParallelMode data = p.data_mode();
  const struct {
    const char* key;
    bool applies;
    const char* where;
  } mode_keys[] = {
      {"parallel.zero_stage", data == ParallelMode::kZero, "mode zero"},
      {"parallel.replicas", data == ParallelMode::kDp, "mode dp"},
      {"parallel.loss_in_replica", data == ParallelMode::kDp, "mode dp"},
      {"parallel.dp_seeded_replicas", data == ParallelMode::kDp, "mode dp"},
      {"parallel.find_unused_parameters", data == ParallelMode::kDdp, "mode ddp"},
      {"parallel.microbatches", p.pipelined(), "a pipeline (stages > 1, or mode pipeline)"},
      {"parallel.schedule", p.pipelined(), "a pipeline (stages > 1, or mode pipeline)"},
      {"parallel.partition", p.pipelined(), "a pipeline (stages > 1, or mode pipeline)"},
      {"parallel.virtual_stages", p.schedule == PipelineSchedule::kInterleaved1F1B,
       "schedule interleaved_1f1b"},
  };
  for (const auto& k : mode_keys) {
    auto given = cfg->origins.find(std::string("train.") + k.key);
    if (k.applies || cfg->effective || given == cfg->origins.end() ||
        given->second.kind == Origin::Kind::kDerived ||
        (mode_kind != Origin::Kind::kDefault && given->second.kind < mode_kind))
      continue;
    return Status::InvalidConfig(given->second.ToString() + ": train." + k.key + " applies to " +
                                 k.where + ", but train.parallel.mode is " + ToString(p.mode) +
                                 (p.pipelined() ? " over a pipeline" : "") +
                                 ": it would be ignored; set the mode it belongs to, or drop it");
  }
  if (std::optional<TrainRuleViolation> v = CheckTrainRules(t, world_size))
    return Status::InvalidConfig(
        WhereOf(*cfg, v->at.empty() ? std::vector<std::string>{v->key} : v->at) + ": train." +
        v->key + ": " + v->message);

  // The data must be there before any process starts.
  const DataConfig& d = t.data;
  if (d.type == DataType::kIdx) {
    std::error_code ec;
    if (!std::filesystem::is_directory(d.path, ec))
      return Status::InvalidConfig(
          WhereOf(*cfg, {"data.path", "data.type"}) + ": train.data.path: '" + d.path +
          "' is not a directory of IDX files" +
          (d.path == kFashionMnistDir ? std::string(" (install Debian's dataset-fashion-mnist)")
                                      : std::string()));
  } else if (!d.path.empty() && d.type != DataType::kSynthetic) {
    std::ifstream probe(d.path);
    if (!probe)
      return Status::InvalidConfig(WhereOf(*cfg, {"data.path"}) +
                                   ": train.data.path: cannot read '" + d.path + "'");
  }
  return Status::Ok();
}

}  // namespace launch::config
