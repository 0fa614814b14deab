// `launch --print_config`: the effective configuration, one key per line, with its origin.

#include <sstream>

#include "base/strings.h"
#include "config/loader.h"
#include "config/value_text.h"

namespace launch::config {

std::string StreamSpecText(const StreamSpec& s) {
  if (s.per_rank.empty()) return std::to_string(s.all);
  std::vector<std::string> parts;
  for (const auto& [rank, mask] : s.per_rank)
    parts.push_back(std::to_string(rank) + ":" + std::to_string(mask));
  return Join(parts, ",");
}

std::string Num(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

std::string Bool(bool v) { return v ? "true" : "false"; }

std::vector<std::pair<std::string, std::string>> TrajectorySettings(const TrainConfig& t) {
  std::vector<std::pair<std::string, std::string>> out;
  auto add = [&](const std::string& key, const std::string& value) {
    out.emplace_back("train." + key, value);
  };
  const ModelConfig& m = t.model;
  add("seed", std::to_string(t.seed));
  add("model.type", ToString(m.type));
  switch (m.type) {
    case ModelType::kMlp:
      add("model.layers", ListText(m.mlp_layers));
      add("model.dropout", Num(m.dropout));
      break;
    case ModelType::kCnn:
      add("model.channels", ListText(m.cnn_channels));
      add("model.hidden", std::to_string(m.cnn_hidden));
      add("model.classes", std::to_string(m.classes));
      add("model.batch_norm", Bool(m.batch_norm));
      add("model.input", ListText(m.input_shape));
      add("model.dropout", Num(m.dropout));
      break;
    case ModelType::kTransformer:
      add("model.vocab", std::to_string(m.vocab_size));
      add("model.d_model", std::to_string(m.d_model));
      add("model.layers", std::to_string(m.transformer_layers));
      add("model.heads", std::to_string(m.heads));
      add("model.context", std::to_string(m.context));
      add("model.dropout", Num(m.dropout));
      break;
    case ModelType::kTorchScript:
      add("model.torchscript",
          m.torchscript_stages.empty() ? m.torchscript_path : ListText(m.torchscript_stages));
      add("model.inputs", ListText(m.inputs));
      add("model.outputs", "{logits: " + m.output_logits + ", loss: " + m.output_loss + "}");
      break;
  }
  const DataConfig& d = t.data;
  add("data.type", ToString(d.type));
  switch (d.type) {
    case DataType::kSynthetic:
      add("data.samples", std::to_string(d.samples));
      add("data.teacher_seed", std::to_string(d.teacher_seed));
      break;
    case DataType::kCsv:
      add("data.path", d.path);
      add("data.label_column", d.label_column);
      break;
    case DataType::kText:
      add("data.path", d.path);
      add("data.context", std::to_string(d.context));
      break;
    case DataType::kIdx:
      add("data.path", d.path);
      add("data.mean", Num(d.mean));
      add("data.std", Num(d.std));
      add("data.augment",
          "{crop_padding: " + std::to_string(d.crop_padding) + ", flip: " + Bool(d.flip) + "}");
      break;
  }
  add("data.shuffle", Bool(d.shuffle));
  add("eval_fraction", Num(t.eval_fraction));
  add("batch_size", std::to_string(t.batch_size));
  add("gradient_accumulation_steps", std::to_string(t.gradient_accumulation_steps));
  add("sync_each_batch", Bool(t.sync_each_batch));
  add("sync_with_dataloader", Bool(t.sync_with_dataloader));
  add("local_sgd_steps", std::to_string(t.local_sgd_steps));
  const OptimizerConfig& o = t.optimizer;
  add("optimizer.type", ToString(o.type));
  add("optimizer.lr", Num(o.lr));
  add("optimizer.weight_decay", Num(o.weight_decay));
  if (o.type == OptimizerType::kSgd) {
    add("optimizer.momentum", Num(o.momentum));
  } else {
    add("optimizer.beta1", Num(o.beta1));
    add("optimizer.beta2", Num(o.beta2));
    add("optimizer.eps", Num(o.eps));
  }
  add("optimizer.no_decay", ListText(o.no_decay));
  add("scheduler.type", ToString(t.scheduler.type));
  add("scheduler.warmup_steps", std::to_string(t.scheduler.warmup_steps));
  if (t.scheduler.type != SchedulerType::kConstant)
    add("scheduler.min_lr_ratio", Num(t.scheduler.min_lr_ratio));
  add("max_grad_norm", Num(t.max_grad_norm));
  add("loss.type", ToString(t.loss.type));
  add("loss.label_smoothing", Num(t.loss.label_smoothing));
  add("loss.ignore_index", std::to_string(t.loss.ignore_index));
  add("loss.class_weights", ListText(t.loss.class_weights));
  const ParallelConfig& p = t.parallel;
  add("parallel.mode", ToString(p.mode));
  if (p.mode == ParallelMode::kDdp && p.comm_hook != CommHook::kNone)
    add("parallel.comm_hook", ToString(p.comm_hook));
  if (p.mode == ParallelMode::kDp) {
    add("parallel.replicas", std::to_string(p.replicas));
    add("parallel.loss_in_replica", Bool(p.loss_in_replica));
    add("parallel.dp_seeded_replicas", Bool(p.dp_seeded_replicas));
  }
  if (p.mode == ParallelMode::kPipeline) {
    add("parallel.stages", std::to_string(p.stages));
    add("parallel.microbatches", std::to_string(p.microbatches));
    add("parallel.schedule", ToString(p.schedule));
    add("parallel.partition", ListText(p.partition));
  }
  add("mixed_precision", t.mixed_precision);
  return out;
}

std::string FormatConfig(const LaunchConfig& c) {
  std::ostringstream out;
  auto line = [&](const std::string& key, const std::string& value) {
    auto it = c.origins.find(key);
    std::string origin = it == c.origins.end() ? "default" : it->second.ToString();
    std::string shown = value.empty() ? "(unset)" : value;
    std::string lhs = key + ": " + shown;
    if (lhs.size() < 44) lhs.resize(44, ' ');
    out << lhs << "  # " << origin << "\n";
  };
  out << "# effective configuration (" << (c.config_path.empty() ? "no config file" : c.config_path)
      << "); precedence: flag > environment > YAML > default\n";
  for (const auto& [key, value] : ShownSettings(c)) line(key, value);
  if (!c.program.empty()) out << "program: " << Join(c.program, " ") << "\n";
  if (c.train.present) {
    const TrainConfig& t = c.train;
    out << "train:\n";
    line("train.output_dir", t.output_dir);
    line("train.max_steps", std::to_string(t.max_steps));
    line("train.epochs", std::to_string(t.epochs));
    line("train.checkpoint_every", std::to_string(t.checkpoint_every));
    line("train.resume", t.resume);
    for (const auto& [key, value] : TrajectorySettings(t)) line(key, value);
  }
  for (const auto& w : c.warnings) out << "# warning: " << w << "\n";
  return out.str();
}

}  // namespace launch::config
