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
// Row builders. A row reaches its field through FIELD(path.in.struct), a captureless accessor,
// so rows can name nested members; `show` goes through the same accessor.

#define FIELD(member) \
  [](TrainConfig & t) -> auto& { return t.member; }

template <typename Ref>
using FieldType =
    std::remove_reference_t<decltype(std::declval<Ref>()(std::declval<TrainConfig&>()))>;

template <typename Ref>
FieldType<Ref>& Get(Ref ref, const TrainConfig& t) {
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

// Any value its parser takes: text, a boolean, a number.
template <typename Ref>
TrainKey Value(std::string path, Ref ref, std::string doc) {
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
template <typename Ref>
TrainKey Range(std::string path, Ref ref, FieldType<Ref> lo, FieldType<Ref> hi, std::string doc) {
  TrainKey k = Value(std::move(path), ref, std::move(doc));
  k.set = [ref, lo, hi](const TrainValue& v, TrainConfig* t) {
    std::string err = NeedScalar(v);
    FieldType<Ref> x{};
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

template <typename Ref, typename E>
TrainKey Enum(std::string path, Ref ref, const EnumTable<E>& table, std::string doc) {
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
template <typename Ref>
TrainKey List(std::string path, Ref ref, typename FieldType<Ref>::value_type min_value,
              std::string doc) {
  using Item = typename FieldType<Ref>::value_type;
  TrainKey k = Row(std::move(path), std::move(doc));
  k.is_list = true;
  k.set = [ref, min_value](const TrainValue& v, TrainConfig* t) {
    if (!v.is_list) return std::string("expected a list like [a, b, c]");
    std::vector<Item> items;
    for (const std::string& item : v.items) {
      Item x{};
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
    for (const Item& x : Get(ref, t)) items.push_back(Text(x));
    return TrainValue::List(items);
  };
  return k;
}

bool ModelIs(const TrainConfig& t, ModelType m) { return t.model.type == m; }
bool DataIs(const TrainConfig& t, DataType d) { return t.data.type == d; }
bool ModeIs(const TrainConfig& t, ParallelMode m) { return t.parallel.mode == m; }
bool OptimizerIs(const TrainConfig& t, OptimizerType o) { return t.optimizer.type == o; }
bool Fp16(const TrainConfig& t) { return t.mixed_precision == "fp16"; }
bool PowerSgd(const TrainConfig& t) {
  return t.parallel.data_mode() == ParallelMode::kDdp &&
         t.parallel.comm_hook == CommHook::kPowerSgd;
}

auto Model(ModelType m) {
  return [m](const TrainConfig& t) { return ModelIs(t, m); };
}
auto Data(DataType d) {
  return [d](const TrainConfig& t) { return DataIs(t, d); };
}
auto Mode(ParallelMode m) {
  return [m](const TrainConfig& t) { return ModeIs(t, m); };
}

// `torchscript: PATH` (or a list, one module per pipeline stage) selects the TorchScript model
// without a `type`.
TrainKey TorchScriptKey() {
  TrainKey k =
      Row("model.torchscript", "a module saved by torch.jit.save (a list: one per pipeline stage)");
  k.set = [](const TrainValue& v, TrainConfig* t) {
    t->model.type = ModelType::kTorchScript;
    if (v.is_list) {
      t->model.torchscript_stages = v.items;
    } else {
      t->model.torchscript_path = v.scalar;
    }
    return std::string();
  };
  k.show = [](const TrainConfig& t) {
    return t.model.torchscript_stages.empty() ? TrainValue::Scalar(t.model.torchscript_path)
                                              : TrainValue::List(t.model.torchscript_stages);
  };
  return k;
}

// `vocab: bytes` is 256 byte tokens; otherwise a count.
TrainKey VocabKey() {
  TrainKey k = Range("model.vocab", FIELD(model.vocab_size), 2, 1 << 20,
                     "token count; `bytes` = 256 byte tokens");
  auto number = k.set;
  k.set = [number](const TrainValue& v, TrainConfig* t) {
    if (!v.is_list && ToLower(Trim(v.scalar)) == "bytes") {
      t->model.vocab_size = 256;
      return std::string();
    }
    return number(v, t);
  };
  return k;
}

// The table. Order matters: a key that selects (torchscript, the types, parallel.mode) comes
// before the keys whose applicability depends on it.
std::vector<TrainKey> BuildTable() {
  const int64_t kBig = int64_t{1} << 40;
  const auto mlp_or_script = [](const TrainConfig& t) {
    return ModelIs(t, ModelType::kMlp) || ModelIs(t, ModelType::kTorchScript);
  };
  const auto sgd = [](const TrainConfig& t) { return OptimizerIs(t, OptimizerType::kSgd); };
  const auto not_sgd = [](const TrainConfig& t) { return !OptimizerIs(t, OptimizerType::kSgd); };
  const char* kTransformer = "model.type transformer";
  const char* kCnn = "model.type cnn";
  const char* kScript = "model.type torchscript";
  const char* kIdx = "data.type idx";
  const auto local_sgd = [](const TrainConfig& t) { return t.local_sgd_steps > 0; };
  const auto diloco = [](const TrainConfig& t) {
    return t.local_sgd_steps > 0 && t.local_sgd.outer == OuterOptimizer::kNesterov;
  };
  const char* kLocalSgd = "local_sgd_steps > 0";
  const char* kDiloco = "local_sgd.outer nesterov";
  std::vector<TrainKey> rows = {
      Value("seed", FIELD(seed), "seed of initialisation, data order, dropout, augmentation")
          .Identity(),
      Value("output_dir", FIELD(output_dir),
            "metrics.jsonl, final.json, model.pt, checkpoints/, effective_config.yaml"),

      // ---- model
      TorchScriptKey().When(Model(ModelType::kTorchScript), kScript).Identity(),
      Enum("model.type", FIELD(model.type), kModelTypes, "the network").Identity(),
      List("model.layers", FIELD(model.mlp_layers), 1, "layer widths, input first, output last")
          .When(mlp_or_script, "model.type mlp or torchscript")
          .Identity(Model(ModelType::kMlp)),
      VocabKey().When(Model(ModelType::kTransformer), kTransformer).Identity(),
      Range("model.d_model", FIELD(model.d_model), 1, 1 << 16, "embedding width")
          .When(Model(ModelType::kTransformer), kTransformer)
          .Identity(),
      Range("model.layers", FIELD(model.transformer_layers), 1, 1024, "transformer blocks")
          .When(Model(ModelType::kTransformer), kTransformer)
          .Identity(),
      Range("model.heads", FIELD(model.heads), 1, 1024, "attention heads (divide d_model)")
          .When(Model(ModelType::kTransformer), kTransformer)
          .Identity(),
      Range("model.context", FIELD(model.context), 1, 1 << 20, "maximum sequence length")
          .When(Model(ModelType::kTransformer), kTransformer)
          .Identity(),
      List("model.channels", FIELD(model.cnn_channels), 1,
           "one conv/batch-norm/ReLU/pool block per entry")
          .When(Model(ModelType::kCnn), kCnn)
          .Identity(),
      Range("model.hidden", FIELD(model.cnn_hidden), 0, 1 << 24,
            "classifier's hidden width; 0 = none")
          .When(Model(ModelType::kCnn), kCnn)
          .Identity(),
      Range("model.classes", FIELD(model.classes), 2, 1 << 24, "outputs of the head")
          .When(Model(ModelType::kCnn), kCnn)
          .Identity(),
      Value("model.batch_norm", FIELD(model.batch_norm), "batch norm in each block")
          .When(Model(ModelType::kCnn), kCnn)
          .Identity(),
      Value("model.channels_last", FIELD(model.channels_last),
            "batch norm on channels-last activations (faster; false: NCHW, more exact on "
            "LibTorch 1.13)")
          .When(Model(ModelType::kCnn), kCnn)
          .Identity(),
      List("model.input", FIELD(model.input_shape), 1, "one image's [channels, height, width]")
          .When(Model(ModelType::kCnn), kCnn)
          .Identity(),
      Range("model.dropout", FIELD(model.dropout), 0.0, 0.99, "dropout probability")
          .Identity([](const TrainConfig& t) { return !ModelIs(t, ModelType::kTorchScript); }),
      // Not in the identity: the gradients are the same with and without.
      Value("model.activation_checkpointing", FIELD(model.activation_checkpointing),
            "recompute built-in blocks' activations in backward (less memory, more compute)")
          .When([](const TrainConfig& t) { return !ModelIs(t, ModelType::kTorchScript); },
                "model.type mlp, transformer or cnn"),
      List("model.inputs", FIELD(model.inputs), std::string(),
           "batch fields forward takes: input, target")
          .When(Model(ModelType::kTorchScript), kScript)
          .Identity(),
      Value("model.outputs.logits", FIELD(model.output_logits),
            "where the logits are: tuple index or dict key (default 0 / logits)")
          .When(Model(ModelType::kTorchScript), kScript)
          .Identity(),
      Value("model.outputs.loss", FIELD(model.output_loss),
            "where a model's own loss is: tuple index or dict key; none by default")
          .When(Model(ModelType::kTorchScript), kScript)
          .Identity(),

      // ---- data (keys of one data type are accepted with any: a flag may change the type)
      Enum("data.type", FIELD(data.type), kDataTypes, "the data set").Identity(),
      Range("data.samples", FIELD(data.samples), 1, kBig, "synthetic: samples drawn")
          .Identity(Data(DataType::kSynthetic)),
      Value("data.teacher_seed", FIELD(data.teacher_seed), "synthetic: the teacher's seed")
          .Identity(Data(DataType::kSynthetic)),
      Value("data.path", FIELD(data.path),
            "csv/text: the file; idx: the directory (default Debian's Fashion-MNIST)")
          .Identity([](const TrainConfig& t) { return !DataIs(t, DataType::kSynthetic); }),
      Value("data.label_column", FIELD(data.label_column), "csv: the label's column")
          .Identity(Data(DataType::kCsv)),
      Range("data.context", FIELD(data.context), 0, 1 << 20,
            "text: bytes per sample; 0 = model.context")
          .Identity(Data(DataType::kText)),
      Range("data.mean", FIELD(data.mean), -1e6, 1e6, "normalisation: (byte/255 - mean) / std")
          .When(Data(DataType::kIdx), kIdx)
          .Identity(),
      Range("data.std", FIELD(data.std), 1e-9, 1e6, "normalisation: (byte/255 - mean) / std")
          .When(Data(DataType::kIdx), kIdx)
          .Identity(),
      Range("data.augment.crop_padding", FIELD(data.crop_padding), 0, 1024,
            "random crop after padding each side by this many pixels; 0 = none")
          .When(Data(DataType::kIdx), kIdx)
          .Identity(),
      Value("data.augment.flip", FIELD(data.flip), "random horizontal flips")
          .When(Data(DataType::kIdx), kIdx)
          .Identity(),
      Value("data.shuffle", FIELD(data.shuffle), "reshuffle every epoch (DistributedSampler)")
          .Identity(),
      Range("eval_fraction", FIELD(eval_fraction), 0.0, 0.9,
            "held-out share of the data (idx: the t10k-* files when present)")
          .Identity(),
      Range("batch_size", FIELD(batch_size), 1, 1 << 24, "per process, per micro-batch").Identity(),
      Range("max_steps", FIELD(max_steps), 0, kBig, "optimizer steps; 0 = run `epochs`"),
      Range("epochs", FIELD(epochs), 0, 1 << 20, "used when max_steps is 0 (then at least 1)"),

      // ---- optimizer (its type sets weight_decay's default: ValidateTrain)
      Enum("optimizer.type", FIELD(optimizer.type), kOptimizers, "the optimizer").Identity(),
      Range("optimizer.lr", FIELD(optimizer.lr), 1e-12, 1e3, "learning rate (peak)").Identity(),
      Range("optimizer.weight_decay", FIELD(optimizer.weight_decay), 0.0, 10.0,
            "decoupled for adamw; default 0.01 for adamw, else 0")
          .Identity(),
      Range("optimizer.momentum", FIELD(optimizer.momentum), 0.0, 0.9999, "sgd: momentum")
          .Identity(sgd),
      Range("optimizer.beta1", FIELD(optimizer.beta1), 0.0, 0.9999999,
            "adam/adamw: first-moment decay")
          .Identity(not_sgd),
      Range("optimizer.beta2", FIELD(optimizer.beta2), 0.0, 0.9999999,
            "adam/adamw: second-moment decay")
          .Identity(not_sgd),
      Range("optimizer.eps", FIELD(optimizer.eps), 1e-30, 1.0, "adam/adamw: denominator term")
          .Identity(not_sgd),
      // Not in the identity: every implementation keeps the same state (a checkpoint resumes
      // with any), and their results differ only by rounding.
      Enum("optimizer.implementation", FIELD(optimizer.implementation), kOptimizerImplementations,
           "adam/adamw: auto (foreach on CUDA), for_loop, foreach or fused kernels"),
      List("optimizer.no_decay", FIELD(optimizer.no_decay), std::string(),
           "no weight decay where the name contains one (`norm`: every norm layer)")
          .Identity(),

      // ---- scheduler, clipping, loss
      Enum("scheduler.type", FIELD(scheduler.type), kSchedulers, "learning-rate schedule")
          .Identity(),
      Range("scheduler.warmup_steps", FIELD(scheduler.warmup_steps), 0, kBig,
            "linear warm-up from 0 to lr")
          .Identity(),
      Range("scheduler.min_lr_ratio", FIELD(scheduler.min_lr_ratio), 0.0, 1.0,
            "decay floor as a fraction of lr")
          .Identity(
              [](const TrainConfig& t) { return t.scheduler.type != SchedulerType::kConstant; }),
      Range("max_grad_norm", FIELD(max_grad_norm), 0.0, 1e9,
            "clip the global gradient norm; 0 = no clipping")
          .Identity(),
      // fp16's loss scaling (torch.amp.GradScaler's options): in the identity only under fp16.
      Range("grad_scaler.init_scale", FIELD(grad_scaler.init_scale), 1e-30, 3e38,
            "fp16: the first loss scale")
          .Identity(Fp16),
      Range("grad_scaler.growth_factor", FIELD(grad_scaler.growth_factor), 1.000001, 1e6,
            "fp16: the scale's factor after growth_interval steps without inf or nan")
          .Identity(Fp16),
      Range("grad_scaler.backoff_factor", FIELD(grad_scaler.backoff_factor), 1e-6, 0.999999,
            "fp16: the scale's factor after a step with inf or nan gradients (skipped)")
          .Identity(Fp16),
      Range("grad_scaler.growth_interval", FIELD(grad_scaler.growth_interval), 1, kBig,
            "fp16: steps without inf or nan before the scale grows")
          .Identity(Fp16),
      Enum("loss.type", FIELD(loss.type), kLossTypes,
           "auto: cross_entropy for classes, mse for regression")
          .Identity(),
      Range("loss.label_smoothing", FIELD(loss.label_smoothing), 0.0, 1.0, "cross_entropy")
          .Identity(),
      Value("loss.ignore_index", FIELD(loss.ignore_index),
            "cross_entropy: targets equal to it do not count")
          .Identity(),
      List("loss.class_weights", FIELD(loss.class_weights), 0.0,
           "cross_entropy: one weight per class; [] = equal")
          .Identity(),
      Enum("save_model", FIELD(save_model), kSaveModel,
           "model.pt for PyTorch: at the end, at every checkpoint too, or never"),

      // ---- parallel (a mode's keys are accepted with any mode: a flag may change the mode)
      Enum("parallel.mode", FIELD(parallel.mode), kParallelModes, "how processes share the work")
          .Identity(),
      Range("collective_timeout", FIELD(collective_timeout_s), 1.0, 604800.0,
            "seconds a collective waits for a peer before it fails (the group forms under the "
            "init timeout); a lost peer is noticed sooner under --recover in_place"),
      Range("parallel.bucket_cap_mb", FIELD(parallel.bucket_cap_mb), 0.001, 1e5,
            "ddp: gradient bucket size (the first bucket is 1 MB)"),
      Range("parallel.replicas", FIELD(parallel.replicas), 1, 1024,
            "dp: replicas (threads or devices) in one process")
          .Identity(Mode(ParallelMode::kDp)),
      // The layout (tensor x context x data x stages, and how a pipeline runs) is not part of the
      // run's identity: a checkpoint resumes with another, its shards re-cut (state/reshard.h).
      Range("parallel.stages", FIELD(parallel.stages), 1, 1024,
            "pipeline stages per replica (world = tensor x context x data x stages)"),
      Range("parallel.tensor", FIELD(parallel.tensor), 1, 1024,
            "ranks each layer's weights are split over (tensor parallelism)"),
      Range("parallel.context", FIELD(parallel.context), 1, 1024,
            "ranks each sequence is split over (context parallelism, Ulysses)"),
      Value("parallel.sequence_parallel", FIELD(parallel.sequence_parallel),
            "tensor > 1: norms and residuals on 1/tensor of the sequence each"),
      Range("parallel.microbatches", FIELD(parallel.microbatches), 1, 1 << 20,
            "pipeline: micro-batches per optimizer step"),
      Enum("parallel.schedule", FIELD(parallel.schedule), kSchedules, "pipeline schedule"),
      Range("parallel.virtual_stages", FIELD(parallel.virtual_stages), 1, 64,
            "interleaved_1f1b: model chunks per rank"),
      List("parallel.partition", FIELD(parallel.partition), 1,
           "pipeline: layers per chunk (stages x virtual_stages); [] = balanced by parameters"),
      Value("parallel.loss_in_replica", FIELD(parallel.loss_in_replica),
            "dp: the loss inside each replica (scalar gather)")
          .Identity(Mode(ParallelMode::kDp)),
      Value("parallel.find_unused_parameters", FIELD(parallel.find_unused_parameters),
            "ddp: find parameters a forward did not use (costs a graph walk)"),
      // In the identity only when on: checkpoints from before the key still match.
      Enum("parallel.comm_hook", FIELD(parallel.comm_hook), kCommHooks,
           "ddp: buckets all-reduced as they are, in bfloat16, in float16, or as PowerSGD's "
           "low-rank factors")
          .Identity([](const TrainConfig& t) {
            return t.parallel.data_mode() == ParallelMode::kDdp &&
                   t.parallel.comm_hook != CommHook::kNone;
          }),
      // PowerSGDState's options (PyTorch's names): in the identity only under power_sgd.
      Range("parallel.power_sgd.matrix_approximation_rank",
            FIELD(parallel.power_sgd.matrix_approximation_rank), 1, 1 << 20,
            "power_sgd: the rank of the factors each gradient matrix is sent as")
          .Identity(PowerSgd),
      Range("parallel.power_sgd.start_powerSGD_iter", FIELD(parallel.power_sgd.start_powerSGD_iter),
            1, kBig, "power_sgd: synchronised steps all-reduced whole before compression starts")
          .Identity(PowerSgd),
      Range("parallel.power_sgd.min_compression_rate",
            FIELD(parallel.power_sgd.min_compression_rate), 0.0, 1e9,
            "power_sgd: compress a matrix only when this many times smaller")
          .Identity(PowerSgd),
      Value("parallel.power_sgd.use_error_feedback", FIELD(parallel.power_sgd.use_error_feedback),
            "power_sgd: add what compression lost to the next gradient")
          .Identity(PowerSgd),
      Value("parallel.power_sgd.warm_start", FIELD(parallel.power_sgd.warm_start),
            "power_sgd: start each step's factors from the last step's")
          .Identity(PowerSgd),
      Range("parallel.power_sgd.orthogonalization_epsilon",
            FIELD(parallel.power_sgd.orthogonalization_epsilon), 0.0, 1.0,
            "power_sgd: added to each column's norm before dividing by it")
          .Identity(PowerSgd),
      Range("parallel.power_sgd.random_seed", FIELD(parallel.power_sgd.random_seed), 0,
            4294967295LL, "power_sgd: seeds the first factors (numpy.random.RandomState's)")
          .Identity(PowerSgd),
      // In the identity only when on: checkpoints from before the key still match.
      Value("parallel.sync_batchnorm", FIELD(parallel.sync_batchnorm),
            "ddp, dp: BatchNorm statistics over the whole data-parallel batch (SyncBatchNorm)")
          .Identity([](const TrainConfig& t) { return t.parallel.sync_batchnorm; }),
      Value("parallel.dp_seeded_replicas", FIELD(parallel.dp_seeded_replicas),
            "dp: forwards one at a time, each from its own seeded stream")
          .Identity(Mode(ParallelMode::kDp)),
      Range("parallel.zero_stage", FIELD(parallel.zero_stage), 1, 3,
            "zero: 1 shards optimizer state, 2 also gradients, 3 also parameters")
          .Identity(Mode(ParallelMode::kZero)),

      // ---- the step
      Range("gradient_accumulation_steps", FIELD(gradient_accumulation_steps), 1, 1 << 20,
            "micro-batches per optimizer step")
          .Identity(),
      Value("sync_each_batch", FIELD(sync_each_batch), "all-reduce every micro-batch (no no_sync)")
          .Identity(),
      Value("sync_with_dataloader", FIELD(sync_with_dataloader),
            "the accumulation window also closes at the loader's end")
          .Identity(),
      Range("local_sgd_steps", FIELD(local_sgd_steps), 0, 1 << 20,
            "> 0: no gradient all-reduce; average parameters every K steps")
          .Identity(),
      Enum("local_sgd.outer", FIELD(local_sgd.outer), kOuterOptimizers,
           "at each sync: average the replicas, or nesterov (DiLoCo: an outer SGD step with "
           "Nesterov momentum on the averaged change)")
          .When(local_sgd, kLocalSgd)
          .Identity(),
      Range("local_sgd.outer_lr", FIELD(local_sgd.outer_lr), 0.0, 100.0,
            "nesterov: the outer learning rate (1 with momentum 0 is plain averaging)")
          .When(diloco, kDiloco)
          .Identity(),
      Range("local_sgd.outer_momentum", FIELD(local_sgd.outer_momentum), 0.0, 0.999,
            "nesterov: the outer momentum")
          .When(diloco, kDiloco)
          .Identity(),

      // ---- checkpoints, logs
      Range("checkpoint_every", FIELD(checkpoint_every), 0, kBig,
            "optimizer steps; 0 = only at the end"),
      Value("checkpoint_async", FIELD(checkpoint_async),
            "write checkpoints in a forked child while training goes on"),
      Range("checkpoint_keep", FIELD(checkpoint_keep), 1, kBig,
            "checkpoints kept: the last K steps (1 = only the latest)"),
      Range("recover_snapshot_every", FIELD(recover_snapshot_every), 1, kBig,
            "under --recover in_place, optimizer steps between the in-memory snapshots that "
            "zero and local_sgd roll back to after a lost rank"),
      Value("resume", FIELD(resume), "auto | never | PATH of a checkpoint file"),
      Value("resume_allow_changes", FIELD(resume_allow_changes),
            "resume although trajectory settings changed (they are listed)"),
      Range("log_every", FIELD(log_every), 1, kBig, "optimizer steps between log lines"),
      Value("tensorboard", FIELD(tensorboard),
            "TensorBoard event files in output_dir/tensorboard: loss, learning rate, "
            "throughput, evaluation"),
      Range("eval_every", FIELD(eval_every), 0, kBig,
            "optimizer steps between evaluations; 0 = only at the end"),
      Range("timeline.from_step", FIELD(timeline.from_step), 1, kBig,
            "first optimizer step traced into output_dir/timeline.json"),
      // Bounded: every event of these steps is kept in memory until the end.
      Range("timeline.steps", FIELD(timeline.steps), 0, 1000, "steps traced; 0 = none"),
  };
  return rows;
}

#undef FIELD

std::string StripTrainPrefix(const std::string& path) {
  return StartsWith(path, "train.") ? path.substr(6) : path;
}

}  // namespace

std::string KeySection(const std::string& path) {
  size_t dot = path.rfind('.');
  return dot == std::string::npos ? "" : path.substr(0, dot);
}

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
    for (std::string s = KeySection(k.path); !s.empty(); s = KeySection(s))
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
  // Most environments have none: then the table is not even built (launch's start-up).
  auto first = env.lower_bound("LAUNCH_TRAIN_");
  if (first == env.end() || !StartsWith(first->first, "LAUNCH_TRAIN_")) return Status::Ok();
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

bool FormerTrajectorySetting(const std::string& key) {
  static const char* const kFormer[] = {
      "train.parallel.stages",       "train.parallel.tensor",   "train.parallel.sequence_parallel",
      "train.parallel.microbatches", "train.parallel.schedule", "train.parallel.partition"};
  for (const char* former : kFormer)
    if (key == former) return true;
  return false;
}

}  // namespace launch::config
