// The rows of the `train:` key table (config/train_keys.h) and what iterates them outside the
// YAML reader: flags and variables, cross-field rules, printing.

#include "config/train_keys.h"

#include <algorithm>
#include <sstream>

#include "base/check.h"
#include "base/strings.h"
#include "config/scalars.h"
#include "config/value_text.h"

namespace launch::config {

std::string TrainValue::Text() const { return is_list ? ListText(items) : scalar; }

TrainValue TrainValue::Scalar(std::string s) {
  TrainValue v;
  v.scalar = std::move(s);
  return v;
}

TrainValue TrainValue::List(std::vector<std::string> items) {
  TrainValue v;
  v.is_list = true;
  v.items = std::move(items);
  return v;
}

TrainValue TrainValue::FromText(const std::string& text, bool list_key) {
  std::string t = Trim(text);
  const bool bracketed = t.size() >= 2 && t.front() == '[' && t.back() == ']';
  if (!list_key && !bracketed) return Scalar(text);
  if (bracketed) t = t.substr(1, t.size() - 2);
  std::vector<std::string> items;
  if (!Trim(t).empty())
    for (const std::string& item : Split(t, ',')) items.push_back(Trim(item));
  return List(std::move(items));
}

namespace {

// ---------------------------------------------------------------------------------------------
// Row builders. A field is reached through a function (captureless lambda) so rows can name
// nested members; `show` goes through the same accessor.

template <typename T>
using Ref = T& (*)(TrainConfig&);

template <typename T>
T& Get(Ref<T> ref, const TrainConfig& t) {
  return ref(const_cast<TrainConfig&>(t));
}

std::string Text(const std::string& v) { return v; }
std::string Text(bool v) { return Bool(v); }
std::string Text(double v) { return Num(v); }
std::string Text(int v) { return std::to_string(v); }
std::string Text(int64_t v) { return std::to_string(v); }
std::string Text(uint64_t v) { return std::to_string(v); }

std::string NeedScalar(const TrainValue& v) { return v.is_list ? "expected a single value" : ""; }

TrainKey Row(std::string path, std::string doc) {
  TrainKey k;
  k.path = std::move(path);
  k.doc = std::move(doc);
  return k;
}

template <typename T>
TrainKey Value(std::string path, Ref<T> ref, std::string doc) {
  TrainKey k = Row(std::move(path), std::move(doc));
  k.set = [ref](const TrainValue& v, TrainConfig* t) {
    std::string err = NeedScalar(v);
    if (err.empty()) err = ParseValue(v.scalar, &ref(*t));
    return err;
  };
  k.show = [ref](const TrainConfig& t) { return TrainValue::Scalar(Text(Get(ref, t))); };
  return k;
}

// A number in [lo, hi]; out of range leaves the field as it was.
template <typename T>
TrainKey Range(std::string path, Ref<T> ref, T lo, T hi, std::string doc) {
  TrainKey k = Value(std::move(path), ref, std::move(doc));
  k.set = [ref, lo, hi](const TrainValue& v, TrainConfig* t) {
    std::string err = NeedScalar(v);
    T x{};
    if (err.empty()) err = ParseValue(v.scalar, &x);
    if (!err.empty()) return err;
    if (x < lo || x > hi) {
      std::ostringstream msg;
      msg << "value " << x << " is out of range [" << lo << ", " << hi << "]";
      return msg.str();
    }
    ref(*t) = x;
    return std::string();
  };
  return k;
}

template <typename E>
TrainKey Enum(std::string path, Ref<E> ref, const EnumTable<E>& table, std::string doc) {
  TrainKey k = Row(std::move(path), std::move(doc));
  k.set = [ref, &table](const TrainValue& v, TrainConfig* t) {
    std::string err = NeedScalar(v);
    return err.empty() ? ParseEnum(v.scalar, table, &ref(*t)) : err;
  };
  k.show = [ref, &table](const TrainConfig& t) {
    for (const auto& [name, value] : table)
      if (value == Get(ref, t)) return TrainValue::Scalar(name);
    return TrainValue::Scalar("?");
  };
  k.choices = EnumNames(table);
  return k;
}

// A list whose items are each >= min_value.
template <typename T>
TrainKey List(std::string path, Ref<std::vector<T>> ref, T min_value, std::string doc) {
  TrainKey k = Row(std::move(path), std::move(doc));
  k.is_list = true;
  k.set = [ref, min_value](const TrainValue& v, TrainConfig* t) {
    if (!v.is_list) return std::string("expected a list like [a, b, c]");
    std::vector<T> items;
    for (const std::string& item : v.items) {
      T x{};
      std::string err = ParseValue(item, &x);
      if (err.empty() && x < min_value) {
        std::ostringstream msg;
        msg << "list items must be >= " << min_value << ", got " << item;
        err = msg.str();
      }
      if (!err.empty()) return err;
      items.push_back(x);
    }
    ref(*t) = items;
    return std::string();
  };
  k.show = [ref](const TrainConfig& t) {
    std::vector<std::string> items;
    for (const T& x : Get(ref, t)) items.push_back(Text(x));
    return TrainValue::List(items);
  };
  return k;
}

// Chainable refinements of a row.
TrainKey When(TrainKey k, std::function<bool(const TrainConfig&)> applies, std::string doc) {
  k.applies = std::move(applies);
  k.applies_doc = std::move(doc);
  return k;
}
TrainKey Identity(TrainKey k, std::function<bool(const TrainConfig&)> only_if = nullptr) {
  k.identity = true;
  k.identity_if = std::move(only_if);
  return k;
}
// Also checked when set: a rule about this key alone.
TrainKey Check(TrainKey k, std::function<std::string(const TrainConfig&)> rule) {
  auto set = k.set;
  k.set = [set, rule](const TrainValue& v, TrainConfig* t) {
    TrainConfig before = *t;
    std::string err = set(v, t);
    if (err.empty()) err = rule(*t);
    if (!err.empty()) *t = before;
    return err;
  };
  return k;
}

bool ModelIs(const TrainConfig& t, ModelType m) { return t.model.type == m; }
bool DataIs(const TrainConfig& t, DataType d) { return t.data.type == d; }
bool ModeIs(const TrainConfig& t, ParallelMode m) { return t.parallel.mode == m; }

auto Model(ModelType m) {
  return [m](const TrainConfig& t) { return ModelIs(t, m); };
}
auto Data(DataType d) {
  return [d](const TrainConfig& t) { return DataIs(t, d); };
}
auto Mode(ParallelMode m) {
  return [m](const TrainConfig& t) { return ModeIs(t, m); };
}

std::vector<TrainKey> BuildTable() {
  using T = TrainConfig;
  const int64_t kBig = int64_t{1} << 40;
  std::vector<TrainKey> rows = {
      Identity(Value<uint64_t>(
          "seed", [](T& t) -> uint64_t& { return t.seed; },
          "seed of initialisation, data order, dropout and augmentation")),
      Value<std::string>(
          "output_dir", [](T& t) -> std::string& { return t.output_dir; },
          "metrics.jsonl, final.json, model.pt, checkpoints/ (and effective_config.yaml)"),

      // ---- model: `torchscript: PATH` (or a list, one module per pipeline stage) selects the
      // TorchScript model without a type, so it comes first.
      [] {
        TrainKey k = Row("model.torchscript",
                         "a module saved by torch.jit.save (a list: one per pipeline stage)");
        k.applies = Model(ModelType::kTorchScript);
        k.applies_doc = "model.type torchscript";
        k.set = [](const TrainValue& v, T* t) {
          t->model.type = ModelType::kTorchScript;
          if (v.is_list) {
            t->model.torchscript_stages = v.items;
          } else {
            t->model.torchscript_path = v.scalar;
          }
          return std::string();
        };
        k.show = [](const T& t) {
          return t.model.torchscript_stages.empty() ? TrainValue::Scalar(t.model.torchscript_path)
                                                    : TrainValue::List(t.model.torchscript_stages);
        };
        return Identity(k);
      }(),
      Identity(Enum<ModelType>(
          "model.type", [](T& t) -> ModelType& { return t.model.type; }, kModelTypes,
          "the network")),
      Identity(
          When(
              List<int64_t>(
                  "model.layers", [](T& t) -> std::vector<int64_t>& { return t.model.mlp_layers; },
                  1, "layer widths, input first and output last"),
              [](const T& t) {
                return !ModelIs(t, ModelType::kTransformer) && !ModelIs(t, ModelType::kCnn);
              },
              "model.type mlp or torchscript"),
          Model(ModelType::kMlp)),
      Identity(When(
          [] {
            TrainKey k = Range<int64_t>(
                "model.vocab", [](T& t) -> int64_t& { return t.model.vocab_size; }, 2, 1 << 20,
                "token count; `bytes` = 256 byte tokens");
            auto number = k.set;
            k.set = [number](const TrainValue& v, T* t) {
              if (!v.is_list && ToLower(Trim(v.scalar)) == "bytes") {
                t->model.vocab_size = 256;
                return std::string();
              }
              return number(v, t);
            };
            return k;
          }(),
          Model(ModelType::kTransformer), "model.type transformer")),
      Identity(When(Range<int64_t>(
                        "model.d_model", [](T& t) -> int64_t& { return t.model.d_model; }, 1,
                        1 << 16, "embedding width"),
                    Model(ModelType::kTransformer), "model.type transformer")),
      Identity(When(Range<int64_t>(
                        "model.layers", [](T& t) -> int64_t& { return t.model.transformer_layers; },
                        1, 1024, "transformer blocks"),
                    Model(ModelType::kTransformer), "model.type transformer")),
      Identity(When(Range<int64_t>(
                        "model.heads", [](T& t) -> int64_t& { return t.model.heads; }, 1, 1024,
                        "attention heads (divide d_model)"),
                    Model(ModelType::kTransformer), "model.type transformer")),
      Identity(When(Range<int64_t>(
                        "model.context", [](T& t) -> int64_t& { return t.model.context; }, 1,
                        1 << 20, "maximum sequence length"),
                    Model(ModelType::kTransformer), "model.type transformer")),
      Identity(When(
          List<int64_t>(
              "model.channels", [](T& t) -> std::vector<int64_t>& { return t.model.cnn_channels; },
              1, "one conv/batch-norm/ReLU/pool block per entry"),
          Model(ModelType::kCnn), "model.type cnn")),
      Identity(When(Range<int64_t>(
                        "model.hidden", [](T& t) -> int64_t& { return t.model.cnn_hidden; }, 0,
                        1 << 24, "classifier's hidden width; 0 = none"),
                    Model(ModelType::kCnn), "model.type cnn")),
      Identity(When(Range<int64_t>(
                        "model.classes", [](T& t) -> int64_t& { return t.model.classes; }, 2,
                        1 << 24, "outputs of the head"),
                    Model(ModelType::kCnn), "model.type cnn")),
      Identity(When(Value<bool>(
                        "model.batch_norm", [](T& t) -> bool& { return t.model.batch_norm; },
                        "batch norm in each block"),
                    Model(ModelType::kCnn), "model.type cnn")),
      Identity(When(Check(List<int64_t>(
                              "model.input",
                              [](T& t) -> std::vector<int64_t>& { return t.model.input_shape; }, 1,
                              "one image's [channels, height, width]"),
                          [](const T& t) {
                            return t.model.input_shape.size() != 3
                                       ? "expected [channels, height, width], e.g. [1, 28, 28]"
                                       : "";
                          }),
                    Model(ModelType::kCnn), "model.type cnn")),
      Identity(Range<double>(
                   "model.dropout", [](T& t) -> double& { return t.model.dropout; }, 0.0, 0.99,
                   "dropout probability"),
               [](const T& t) { return !ModelIs(t, ModelType::kTorchScript); }),
      Identity(When(Check(List<std::string>(
                              "model.inputs",
                              [](T& t) -> std::vector<std::string>& { return t.model.inputs; },
                              std::string(), "batch fields passed to forward: input, target"),
                          [](const T& t) -> std::string {
                            for (const std::string& field : t.model.inputs)
                              if (field != "input" && field != "target")
                                return "'" + field +
                                       "' is not a batch field; fields are input, target";
                            if (t.model.inputs.empty())
                              return "forward needs at least one input, e.g. [input]";
                            return "";
                          }),
                    Model(ModelType::kTorchScript), "model.type torchscript")),
      Identity(When(
          Value<std::string>(
              "model.outputs.logits", [](T& t) -> std::string& { return t.model.output_logits; },
              "where the logits are: tuple index or dict key (default 0 / logits)"),
          Model(ModelType::kTorchScript), "model.type torchscript")),
      Identity(
          When(Value<std::string>(
                   "model.outputs.loss", [](T& t) -> std::string& { return t.model.output_loss; },
                   "where a model's own loss is (tuple index or dict key); none by default"),
               Model(ModelType::kTorchScript), "model.type torchscript")),

      // ---- data
      Identity(Enum<DataType>(
          "data.type", [](T& t) -> DataType& { return t.data.type; }, kDataTypes, "the data set")),
      Identity(Range<int64_t>(
                   "data.samples", [](T& t) -> int64_t& { return t.data.samples; }, 1, kBig,
                   "synthetic: samples drawn"),
               Data(DataType::kSynthetic)),
      Identity(Value<uint64_t>(
                   "data.teacher_seed", [](T& t) -> uint64_t& { return t.data.teacher_seed; },
                   "synthetic: the teacher network's seed"),
               Data(DataType::kSynthetic)),
      Identity(Value<std::string>(
                   "data.path", [](T& t) -> std::string& { return t.data.path; },
                   "csv/text: the file; idx: the directory (default Debian's Fashion-MNIST)"),
               [](const T& t) { return !DataIs(t, DataType::kSynthetic); }),
      Identity(Value<std::string>(
                   "data.label_column", [](T& t) -> std::string& { return t.data.label_column; },
                   "csv: the label's column"),
               Data(DataType::kCsv)),
      Identity(Range<int64_t>(
                   "data.context", [](T& t) -> int64_t& { return t.data.context; }, 0, 1 << 20,
                   "text: bytes per sample; 0 = model.context"),
               Data(DataType::kText)),
      Identity(When(Range<double>(
                        "data.mean", [](T& t) -> double& { return t.data.mean; }, -1e6, 1e6,
                        "pixel normalisation: (byte / 255 - mean) / std"),
                    Data(DataType::kIdx), "data.type idx")),
      Identity(When(Range<double>(
                        "data.std", [](T& t) -> double& { return t.data.std; }, 1e-9, 1e6,
                        "pixel normalisation: (byte / 255 - mean) / std"),
                    Data(DataType::kIdx), "data.type idx")),
      Identity(When(
          Range<int64_t>(
              "data.augment.crop_padding", [](T& t) -> int64_t& { return t.data.crop_padding; }, 0,
              1024, "random crop after padding each side by this many pixels; 0 = none"),
          Data(DataType::kIdx), "data.type idx")),
      Identity(When(Value<bool>(
                        "data.augment.flip", [](T& t) -> bool& { return t.data.flip; },
                        "random horizontal flips"),
                    Data(DataType::kIdx), "data.type idx")),
      Identity(Value<bool>(
          "data.shuffle", [](T& t) -> bool& { return t.data.shuffle; },
          "reshuffle every epoch (DistributedSampler's order)")),
      Identity(Range<double>(
          "eval_fraction", [](T& t) -> double& { return t.eval_fraction; }, 0.0, 0.9,
          "held-out share of the data (idx: the t10k-* files when present)")),
      Identity(Range<int64_t>(
          "batch_size", [](T& t) -> int64_t& { return t.batch_size; }, 1, 1 << 24,
          "per process, per micro-batch")),
      Range<int64_t>(
          "max_steps", [](T& t) -> int64_t& { return t.max_steps; }, 0, kBig,
          "optimizer steps; 0 = run `epochs`"),
      Range<int64_t>(
          "epochs", [](T& t) -> int64_t& { return t.epochs; }, 0, 1 << 20,
          "used when max_steps is 0 (then at least 1)"),

      // ---- optimizer (its type sets weight_decay's default: 0.01 for adamw, else 0)
      Identity(Enum<OptimizerType>(
          "optimizer.type", [](T& t) -> OptimizerType& { return t.optimizer.type; }, kOptimizers,
          "the optimizer")),
      Identity(Range<double>(
          "optimizer.lr", [](T& t) -> double& { return t.optimizer.lr; }, 1e-12, 1e3,
          "learning rate (peak, with a scheduler)")),
      Identity(Range<double>(
          "optimizer.weight_decay", [](T& t) -> double& { return t.optimizer.weight_decay; }, 0.0,
          10.0, "decoupled for adamw; default 0.01 for adamw, else 0")),
      Identity(Range<double>(
                   "optimizer.momentum", [](T& t) -> double& { return t.optimizer.momentum; }, 0.0,
                   0.9999, "sgd: momentum"),
               [](const T& t) { return t.optimizer.type == OptimizerType::kSgd; }),
      Identity(Range<double>(
                   "optimizer.beta1", [](T& t) -> double& { return t.optimizer.beta1; }, 0.0,
                   0.9999999, "adam/adamw: first-moment decay"),
               [](const T& t) { return t.optimizer.type != OptimizerType::kSgd; }),
      Identity(Range<double>(
                   "optimizer.beta2", [](T& t) -> double& { return t.optimizer.beta2; }, 0.0,
                   0.9999999, "adam/adamw: second-moment decay"),
               [](const T& t) { return t.optimizer.type != OptimizerType::kSgd; }),
      Identity(Range<double>(
                   "optimizer.eps", [](T& t) -> double& { return t.optimizer.eps; }, 1e-30, 1.0,
                   "adam/adamw: denominator term"),
               [](const T& t) { return t.optimizer.type != OptimizerType::kSgd; }),
      Identity(List<std::string>(
          "optimizer.no_decay",
          [](T& t) -> std::vector<std::string>& { return t.optimizer.no_decay; }, std::string(),
          "parameters without weight decay (name contains; `norm`: norm layers)")),

      // ---- scheduler
      Identity(Enum<SchedulerType>(
          "scheduler.type", [](T& t) -> SchedulerType& { return t.scheduler.type; }, kSchedulers,
          "learning-rate schedule")),
      Identity(Range<int64_t>(
          "scheduler.warmup_steps", [](T& t) -> int64_t& { return t.scheduler.warmup_steps; }, 0,
          kBig, "linear warm-up from 0 to lr")),
      Identity(
          Range<double>(
              "scheduler.min_lr_ratio", [](T& t) -> double& { return t.scheduler.min_lr_ratio; },
              0.0, 1.0, "decay floor as a fraction of lr"),
          [](const T& t) { return t.scheduler.type != SchedulerType::kConstant; }),
      Identity(Range<double>(
          "max_grad_norm", [](T& t) -> double& { return t.max_grad_norm; }, 0.0, 1e9,
          "clip the global gradient norm; 0 = no clipping")),

      // ---- loss
      Identity(Enum<LossType>(
          "loss.type", [](T& t) -> LossType& { return t.loss.type; }, kLossTypes,
          "auto: cross_entropy for classes, mse for regression")),
      Identity(Range<double>(
          "loss.label_smoothing", [](T& t) -> double& { return t.loss.label_smoothing; }, 0.0, 1.0,
          "cross_entropy")),
      Identity(Value<int64_t>(
          "loss.ignore_index", [](T& t) -> int64_t& { return t.loss.ignore_index; },
          "cross_entropy: targets equal to it do not count")),
      Identity(List<double>(
          "loss.class_weights", [](T& t) -> std::vector<double>& { return t.loss.class_weights; },
          0.0, "cross_entropy: one weight per class; [] = equal")),
      Enum<SaveModel>(
          "save_model", [](T& t) -> SaveModel& { return t.save_model; }, kSaveModel,
          "model.pt for PyTorch: at the end, at every checkpoint too, or never"),

      // ---- parallel
      Identity(Enum<ParallelMode>(
          "parallel.mode", [](T& t) -> ParallelMode& { return t.parallel.mode; }, kParallelModes,
          "how processes share the work")),
      Range<double>(
          "parallel.bucket_cap_mb", [](T& t) -> double& { return t.parallel.bucket_cap_mb; }, 0.001,
          1e5, "ddp: gradient bucket size (the first bucket is 1 MB)"),
      Identity(Range<int>(
                   "parallel.replicas", [](T& t) -> int& { return t.parallel.replicas; }, 1, 1024,
                   "dp: replicas (threads or devices) in one process"),
               Mode(ParallelMode::kDp)),
      Identity(Range<int>(
                   "parallel.stages", [](T& t) -> int& { return t.parallel.stages; }, 1, 1024,
                   "pipeline: processes per pipeline (world = stages x replicas)"),
               Mode(ParallelMode::kPipeline)),
      Identity(Range<int>(
                   "parallel.microbatches", [](T& t) -> int& { return t.parallel.microbatches; }, 1,
                   1 << 20, "pipeline: micro-batches per optimizer step"),
               Mode(ParallelMode::kPipeline)),
      Identity(
          Enum<PipelineSchedule>(
              "parallel.schedule", [](T& t) -> PipelineSchedule& { return t.parallel.schedule; },
              kSchedules, "pipeline schedule"),
          Mode(ParallelMode::kPipeline)),
      Identity(List<int64_t>(
                   "parallel.partition",
                   [](T& t) -> std::vector<int64_t>& { return t.parallel.partition; }, 1,
                   "pipeline: layers per stage; [] = balanced by parameters"),
               Mode(ParallelMode::kPipeline)),
      Identity(
          Value<bool>(
              "parallel.loss_in_replica", [](T& t) -> bool& { return t.parallel.loss_in_replica; },
              "dp: the loss inside each replica (scalar gather)"),
          Mode(ParallelMode::kDp)),
      Value<bool>(
          "parallel.find_unused_parameters",
          [](T& t) -> bool& { return t.parallel.find_unused_parameters; },
          "ddp: find parameters a forward did not use (costs a graph walk)"),
      Identity(Enum<CommHook>(
                   "parallel.comm_hook", [](T& t) -> CommHook& { return t.parallel.comm_hook; },
                   kCommHooks, "ddp: buckets all-reduced as they are, or in bfloat16"),
               [](const T& t) {
                 return ModeIs(t, ParallelMode::kDdp) && t.parallel.comm_hook != CommHook::kNone;
               }),
      Identity(Value<bool>(
                   "parallel.dp_seeded_replicas",
                   [](T& t) -> bool& { return t.parallel.dp_seeded_replicas; },
                   "dp: forwards one at a time, each from its own seeded stream"),
               Mode(ParallelMode::kDp)),

      // ---- the step
      Identity(Range<int>(
          "gradient_accumulation_steps", [](T& t) -> int& { return t.gradient_accumulation_steps; },
          1, 1 << 20, "micro-batches per optimizer step")),
      Identity(Value<bool>(
          "sync_each_batch", [](T& t) -> bool& { return t.sync_each_batch; },
          "all-reduce every micro-batch (no no_sync)")),
      Identity(Value<bool>(
          "sync_with_dataloader", [](T& t) -> bool& { return t.sync_with_dataloader; },
          "the accumulation window also closes at the loader's end")),
      Identity(Range<int>(
          "local_sgd_steps", [](T& t) -> int& { return t.local_sgd_steps; }, 0, 1 << 20,
          "> 0: no gradient all-reduce; average parameters every K steps")),

      // ---- checkpoints, logs
      Range<int64_t>(
          "checkpoint_every", [](T& t) -> int64_t& { return t.checkpoint_every; }, 0, kBig,
          "optimizer steps; 0 = only at the end"),
      Value<std::string>(
          "resume", [](T& t) -> std::string& { return t.resume; },
          "auto | never | PATH of a checkpoint file"),
      Value<bool>(
          "resume_allow_changes", [](T& t) -> bool& { return t.resume_allow_changes; },
          "resume although trajectory settings changed (they are listed)"),
      Range<int64_t>(
          "log_every", [](T& t) -> int64_t& { return t.log_every; }, 1, kBig,
          "optimizer steps between log lines"),
      Range<int64_t>(
          "eval_every", [](T& t) -> int64_t& { return t.eval_every; }, 0, kBig,
          "optimizer steps between evaluations; 0 = only at the end"),
      Range<int64_t>(
          "timeline.from_step", [](T& t) -> int64_t& { return t.timeline.from_step; }, 1, kBig,
          "first optimizer step traced into output_dir/timeline.json"),
      // Bounded: every event of these steps is kept in memory until the end.
      Range<int64_t>(
          "timeline.steps", [](T& t) -> int64_t& { return t.timeline.steps; }, 0, 1000,
          "steps traced; 0 = none"),
  };
  return rows;
}

std::string StripTrainPrefix(const std::string& path) {
  return StartsWith(path, "train.") ? path.substr(6) : path;
}

std::string Section(const std::string& path) {
  size_t dot = path.rfind('.');
  return dot == std::string::npos ? "" : path.substr(0, dot);
}

}  // namespace

const std::vector<TrainKey>& TrainKeys() {
  static const std::vector<TrainKey> rows = BuildTable();
  return rows;
}

const TrainKey* FindTrainKey(const std::string& path, const TrainConfig& t, bool* any) {
  const std::string p = StripTrainPrefix(path);
  if (any) *any = false;
  for (const TrainKey& k : TrainKeys()) {
    if (k.path != p) continue;
    if (any) *any = true;
    // model.torchscript selects its own model type, so it is always accepted.
    if (k.AppliesTo(t) || p == "model.torchscript") return &k;
  }
  return nullptr;
}

bool IsTrainSection(const std::string& path) {
  const std::string p = StripTrainPrefix(path);
  for (const TrainKey& k : TrainKeys())
    for (std::string s = Section(k.path); !s.empty(); s = Section(s))
      if (s == p) return true;
  return false;
}

std::vector<std::string> TrainNamesBelow(const std::string& section, const TrainConfig& t) {
  std::vector<std::string> names;
  const std::string prefix = section.empty() ? "" : section + ".";
  for (const TrainKey& k : TrainKeys()) {
    if (!StartsWith(k.path, prefix)) continue;
    if (!k.AppliesTo(t) && k.path != "model.torchscript") continue;
    std::string rest = k.path.substr(prefix.size());
    std::string name = rest.substr(0, rest.find('.'));
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  return names;
}

Status ApplyTrainSetting(const std::string& path, const TrainValue& value, const Origin& origin,
                         const std::string& where, LaunchConfig* cfg) {
  const std::string p = StripTrainPrefix(path);
  bool any = false;
  const TrainKey* key = FindTrainKey(p, cfg->train, &any);
  if (!key) {
    if (any) {
      for (const TrainKey& k : TrainKeys())
        if (k.path == p)
          return Status::InvalidConfig(where + ": train." + p + ": applies only with " +
                                       k.applies_doc);
    }
    std::vector<std::string> names;
    for (const TrainKey& k : TrainKeys()) names.push_back(k.path);
    return Status::InvalidConfig(where + ": train." + p + ": unknown key" + NearMiss(p, names));
  }
  std::string err = key->set(value, &cfg->train);
  if (!err.empty()) return Status::InvalidConfig(where + ": train." + p + ": " + err);
  cfg->origins["train." + p] = origin;
  return Status::Ok();
}

std::string TrainEnvName(const std::string& path) {
  std::string name = "LAUNCH_TRAIN_" + StripTrainPrefix(path);
  for (char& c : name)
    c = c == '.' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return name;
}

Status ApplyTrainEnvironment(const std::map<std::string, std::string>& env, LaunchConfig* cfg) {
  std::vector<std::string> known;
  for (const TrainKey& k : TrainKeys()) known.push_back(TrainEnvName(k.path));
  for (const auto& [var, value] : env) {
    if (!StartsWith(var, "LAUNCH_TRAIN_")) continue;
    if (std::find(known.begin(), known.end(), var) == known.end())
      return Status::InvalidConfig("environment " + var + ": no train: key has this name" +
                                   NearMiss(var, known));
  }
  // In table order, so a type is set before the keys that depend on it.
  std::vector<std::string> done;
  for (const TrainKey& k : TrainKeys()) {
    const std::string var = TrainEnvName(k.path);
    auto it = env.find(var);
    if (it == env.end() || it->second.empty()) continue;
    if (std::find(done.begin(), done.end(), var) != done.end()) continue;
    const TrainKey* key = FindTrainKey(k.path, cfg->train);
    if (key != &k && key) continue;  // another row of the same path applies: set there
    done.push_back(var);
    Origin origin{Origin::Kind::kEnvironment, var};
    LAUNCH_RETURN_IF_ERROR(ApplyTrainSetting(k.path, TrainValue::FromText(it->second, k.is_list),
                                             origin, origin.ToString(), cfg));
  }
  return Status::Ok();
}

namespace {
const TrainKey& KeyNamed(const std::string& path) {
  for (const TrainKey& k : TrainKeys())
    if (k.path == path) return k;
  LAUNCH_CHECK(false, "no train key " + path);
  return TrainKeys().front();
}
}  // namespace

std::string TrainDefault(const std::string& path) {
  return KeyNamed(path).show(TrainConfig{}).Text();
}
std::string TrainChoices(const std::string& path) { return Join(KeyNamed(path).choices, " | "); }
std::string TrainDoc(const std::string& path) { return KeyNamed(path).doc; }

std::vector<std::pair<std::string, std::string>> TrainSettings(const TrainConfig& t) {
  std::vector<std::pair<std::string, std::string>> out;
  std::vector<std::string> seen;
  for (const TrainKey& k : TrainKeys()) {
    if (!k.AppliesTo(t)) continue;
    if (std::find(seen.begin(), seen.end(), k.path) != seen.end()) continue;
    seen.push_back(k.path);
    out.emplace_back("train." + k.path, k.show(t).Text());
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> TrajectorySettings(const TrainConfig& t) {
  std::vector<std::pair<std::string, std::string>> out;
  std::vector<std::string> seen;
  for (const TrainKey& k : TrainKeys()) {
    if (!k.identity || !k.AppliesTo(t) || (k.identity_if && !k.identity_if(t))) continue;
    if (std::find(seen.begin(), seen.end(), k.path) != seen.end()) continue;
    seen.push_back(k.path);
    out.emplace_back("train." + k.path, k.show(t).Text());
  }
  out.emplace_back("train.mixed_precision", t.mixed_precision);
  return out;
}

}  // namespace launch::config
