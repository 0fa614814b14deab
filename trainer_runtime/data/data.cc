#include "trainer_runtime/data/data.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "base/strings.h"
#include "trainer_runtime/data/sampler.h"

namespace launch::trainer {

torch::Tensor Dataset::Inputs(const std::vector<int64_t>& indices) const {
  torch::Tensor rows = inputs.index_select(0, torch::tensor(indices, torch::kLong));
  return rows.scalar_type() == torch::kUInt8 ? NormalizePixels(rows, pixels) : rows;
}

torch::Tensor Dataset::Targets(const std::vector<int64_t>& indices) const {
  return targets.index_select(0, torch::tensor(indices, torch::kLong));
}

StatusOr<Criterion> Criterion::Create(Task task, const config::LossConfig& cfg) {
  using config::LossType;
  Criterion c;
  c.task_ = task;
  c.cfg_ = cfg;
  c.type_ = cfg.type;
  if (c.type_ == LossType::kAuto)
    c.type_ = task == Task::kRegression ? LossType::kMse : LossType::kCrossEntropy;
  if (task == Task::kRegression && c.type_ == LossType::kCrossEntropy)
    return Status::InvalidConfig(
        "train.loss.type: cross_entropy needs class labels, but the data are regression targets "
        "(use mse)");
  if (task == Task::kLanguageModel && c.type_ != LossType::kCrossEntropy)
    return Status::InvalidConfig(std::string("train.loss.type: ") + config::ToString(c.type_) +
                                 " does not apply to next-token prediction (use cross_entropy)");
  if (!cfg.class_weights.empty())
    c.class_weights_ = torch::tensor(cfg.class_weights, torch::kFloat32);
  return c;
}

torch::Tensor Criterion::operator()(const torch::Tensor& logits,
                                    const torch::Tensor& targets) const {
  namespace F = torch::nn::functional;
  using config::LossType;
  switch (type_) {
    case LossType::kAuto:
    case LossType::kCrossEntropy: {
      auto options = F::CrossEntropyFuncOptions()
                         .ignore_index(cfg_.ignore_index)
                         .label_smoothing(cfg_.label_smoothing);
      if (class_weights_.defined()) {
        TORCH_CHECK(class_weights_.size(0) == logits.size(-1), "train.loss.class_weights has ",
                    class_weights_.size(0), " weights but the model gives ", logits.size(-1),
                    " classes");
        options.weight(class_weights_.to(logits.device(), logits.scalar_type()));
      }
      if (task_ == Task::kLanguageModel)
        return F::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}),
                                options);
      return F::cross_entropy(logits, targets, options);
    }
    case LossType::kMse:
      return torch::mse_loss(logits, targets.to(logits.scalar_type()).view_as(logits));
    case LossType::kBceWithLogits: {
      // Class labels become one-hot rows; float targets (multi-label) are taken as they are.
      torch::Tensor y = targets.is_floating_point()
                            ? targets.to(logits.scalar_type()).view_as(logits)
                            : F::one_hot(targets, logits.size(-1)).to(logits.scalar_type());
      return F::binary_cross_entropy_with_logits(logits, y);
    }
  }
  return {};
}

std::pair<int64_t, int64_t> Criterion::CountCorrect(const torch::Tensor& logits,
                                                    const torch::Tensor& targets) const {
  if (task_ == Task::kRegression || targets.is_floating_point()) return {0, 0};
  auto pred = logits.argmax(-1);
  auto counted = targets.ne(cfg_.ignore_index);
  return {pred.eq(targets).logical_and(counted).sum().item<int64_t>(),
          counted.sum().item<int64_t>()};
}

torch::Tensor Augment(const Dataset& data, const torch::Tensor& images, uint64_t seed) {
  const int64_t pad = data.crop_padding;
  if ((pad == 0 && !data.flip) || images.dim() != 4) return images;
  at::Generator gen = at::detail::createCPUGenerator(seed);
  const int64_t b = images.size(0), h = images.size(2), w = images.size(3);
  // Black after normalisation, as torchvision pads the image before normalising it.
  const double black = (0.0 - data.pixels.mean) / data.pixels.std;
  torch::Tensor padded =
      pad > 0 ? torch::constant_pad_nd(images, {pad, pad, pad, pad}, black) : images;
  torch::Tensor offsets = torch::randint(0, 2 * pad + 1, {b, 2}, gen, torch::kLong);
  torch::Tensor flips = torch::randint(0, 2, {b}, gen, torch::kLong);
  torch::Tensor out = torch::empty_like(images);
  auto off = offsets.accessor<int64_t, 2>();
  auto flip = flips.accessor<int64_t, 1>();
  for (int64_t i = 0; i < b; ++i) {
    torch::Tensor crop = padded[i].narrow(1, off[i][0], h).narrow(2, off[i][1], w);
    if (data.flip && flip[i] == 1) crop = crop.flip({2});
    out[i].copy_(crop);
  }
  return out;
}

namespace {

int64_t InputWidth(const config::TrainConfig& cfg) { return cfg.model.mlp_layers.front(); }
int64_t OutputWidth(const config::TrainConfig& cfg) { return cfg.model.mlp_layers.back(); }

StatusOr<Dataset> Synthetic(const config::TrainConfig& cfg) {
  if (cfg.model.type != config::ModelType::kMlp)
    return Status::InvalidConfig(
        "train.data: synthetic data needs an MLP model (its layers give the feature count and "
        "classes); use `model: {type: mlp, layers: [...]}` or another data type");
  const int64_t n = cfg.data.samples, in = InputWidth(cfg), out = OutputWidth(cfg);
  // A private generator: the data depend on teacher_seed only, never on train.seed or rank.
  at::Generator gen = at::detail::createCPUGenerator(cfg.data.teacher_seed);
  torch::NoGradGuard no_grad;
  Dataset d;
  d.inputs = torch::randn({n, in}, gen);
  const int64_t hidden = 64;
  auto w1 = torch::randn({in, hidden}, gen) / std::sqrt(static_cast<double>(in));
  auto b1 = torch::randn({hidden}, gen) * 0.1;
  auto w2 = torch::randn({hidden, out}, gen) / std::sqrt(static_cast<double>(hidden));
  // Scale 3 makes the teacher fairly sure but not certain: a floor well above zero, far below
  // the loss of guessing (log(classes)).
  auto logits = torch::tanh(d.inputs.matmul(w1) + b1).matmul(w2) * 3.0;
  if (out == 1) {
    d.task = Task::kRegression;
    const double noise = 0.1;
    d.targets = logits + noise * torch::randn({n, 1}, gen);
    d.loss_floor = noise * noise;
  } else {
    d.task = Task::kClassification;
    auto probs = torch::softmax(logits, -1);
    d.targets = torch::multinomial(probs, 1, /*replacement=*/true, gen).squeeze(1);
    // Expected cross-entropy of the teacher's own distribution = its mean entropy.
    d.loss_floor = -(probs * torch::log(probs.clamp_min(1e-30))).sum(-1).mean().item<double>();
  }
  d.description = "synthetic teacher: " + std::to_string(n) + " samples, " + std::to_string(in) +
                  " features, " +
                  (out == 1 ? std::string("regression") : std::to_string(out) + " classes");
  return d;
}

// Splits d's rows into eval_fraction held out and the rest for training. The split depends on
// the seed and the data only, never on the world size.
void HoldOut(const config::TrainConfig& cfg, Dataset* d) {
  const int64_t n = d->inputs.size(0);
  std::vector<int64_t> perm = ShardedSampler::Permutation(n, cfg.seed ^ 0x5eedull, -1);
  int64_t n_eval = static_cast<int64_t>(std::llround(cfg.eval_fraction * static_cast<double>(n)));
  if (cfg.eval_fraction > 0 && n_eval == 0) n_eval = 1;
  if (n_eval >= n) n_eval = n - 1;
  d->eval_indices.assign(perm.begin(), perm.begin() + n_eval);
  d->train_indices.assign(perm.begin() + n_eval, perm.end());
}

StatusOr<Dataset> Csv(const config::TrainConfig& cfg) {
  const std::string& path = cfg.data.path;
  std::ifstream in(path);
  if (!in) return Status::NotFound("train.data.path: cannot read '" + path + "'");
  std::string line;
  if (!std::getline(in, line))
    return Status::InvalidConfig(path + ": empty CSV file (a header row is required)");
  std::vector<std::string> header = Split(Trim(line), ',');
  int label_col = -1;
  for (size_t i = 0; i < header.size(); ++i) {
    header[i] = Trim(header[i]);
    if (header[i] == cfg.data.label_column) label_col = static_cast<int>(i);
  }
  if (label_col < 0)
    return Status::InvalidConfig(path + ":1: no column named '" + cfg.data.label_column +
                                 "' (train.data.label_column); columns are " + Join(header, ", "));
  std::vector<float> features;
  std::vector<double> labels;
  int line_no = 1;
  while (std::getline(in, line)) {
    ++line_no;
    if (Trim(line).empty()) continue;
    std::vector<std::string> cells = Split(Trim(line), ',');
    if (cells.size() != header.size())
      return Status::InvalidConfig(path + ":" + std::to_string(line_no) + ": " +
                                   std::to_string(cells.size()) + " cells, header has " +
                                   std::to_string(header.size()));
    for (size_t i = 0; i < cells.size(); ++i) {
      double v = 0;
      if (!ParseDouble(Trim(cells[i]), &v))
        return Status::InvalidConfig(path + ":" + std::to_string(line_no) + ": column '" +
                                     header[i] + "': '" + cells[i] + "' is not a number");
      if (static_cast<int>(i) == label_col) {
        labels.push_back(v);
      } else {
        features.push_back(static_cast<float>(v));
      }
    }
  }
  const int64_t n = static_cast<int64_t>(labels.size());
  const int64_t f = static_cast<int64_t>(header.size()) - 1;
  if (n < 2) return Status::InvalidConfig(path + ": needs at least 2 data rows");
  if (cfg.model.type == config::ModelType::kMlp && f != InputWidth(cfg))
    return Status::InvalidConfig(path + ": has " + std::to_string(f) +
                                 " feature columns but train.model.layers starts with " +
                                 std::to_string(InputWidth(cfg)));
  Dataset d;
  d.inputs = torch::from_blob(features.data(), {n, f}, torch::kFloat).clone();
  // Standardise features so any CSV trains with default learning rates, with statistics of the
  // training rows only: the held-out rows must not leak into what the model is trained on
  // (scikit-learn's fit on train, transform both).
  HoldOut(cfg, &d);
  const torch::Tensor train_rows = d.inputs.index_select(0, torch::tensor(d.train_indices));
  auto mean = train_rows.mean(0, true);
  auto std = train_rows.std(0, true, true).clamp_min(1e-6);
  d.inputs = (d.inputs - mean) / std;
  const int64_t classes = cfg.model.type == config::ModelType::kMlp ? OutputWidth(cfg) : int64_t{0};
  if (classes == 1) {
    d.task = Task::kRegression;
    std::vector<float> y(labels.begin(), labels.end());
    d.targets = torch::from_blob(y.data(), {n, 1}, torch::kFloat).clone();
  } else {
    d.task = Task::kClassification;
    std::vector<int64_t> y;
    for (double v : labels) {
      if (v != std::floor(v) || v < 0 || (classes > 0 && v >= static_cast<double>(classes)))
        return Status::InvalidConfig(path + ": label " + std::to_string(v) +
                                     " is not a class index in [0, " + std::to_string(classes) +
                                     ") (the MLP's last width is the number of classes)");
      y.push_back(static_cast<int64_t>(v));
    }
    d.targets = torch::tensor(y, torch::kLong);
  }
  d.description =
      "csv " + path + ": " + std::to_string(n) + " rows, " + std::to_string(f) + " features";
  return d;
}

StatusOr<Dataset> Text(const config::TrainConfig& cfg) {
  const std::string& path = cfg.data.path;
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound("train.data.path: cannot read '" + path + "'");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const int64_t ctx = cfg.data.context > 0 ? cfg.data.context : cfg.model.context;
  if (cfg.model.type == config::ModelType::kTransformer) {
    if (ctx > cfg.model.context)
      return Status::InvalidConfig("train.data.context " + std::to_string(ctx) +
                                   " exceeds train.model.context " +
                                   std::to_string(cfg.model.context));
    if (cfg.model.vocab_size < 256)
      return Status::InvalidConfig("train.model.vocab must be 256 (bytes) for text data");
  }
  // Windows of ctx+1 bytes with stride ctx: input = first ctx, target = last ctx.
  const int64_t n = (static_cast<int64_t>(bytes.size()) - 1) / ctx;
  if (n < 2)
    return Status::InvalidConfig(path + ": " + std::to_string(bytes.size()) +
                                 " bytes are too few for context " + std::to_string(ctx));
  auto all = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kLong);
  auto acc = all.accessor<int64_t, 1>();
  for (size_t i = 0; i < bytes.size(); ++i) acc[i] = static_cast<unsigned char>(bytes[i]);
  auto starts = torch::arange(n, torch::kLong) * ctx;
  auto offsets = torch::arange(ctx, torch::kLong);
  auto idx = starts.unsqueeze(1) + offsets.unsqueeze(0);  // [n, ctx]
  Dataset d;
  d.task = Task::kLanguageModel;
  d.inputs = all.index({idx});
  d.targets = all.index({idx + 1});
  d.description = "text " + path + ": " + std::to_string(bytes.size()) + " bytes, " +
                  std::to_string(n) + " windows of " + std::to_string(ctx);
  return d;
}

StatusOr<Dataset> Idx(const config::TrainConfig& cfg) {
  const std::string& dir = cfg.data.path;
  const IdxOptions options{cfg.data.mean, cfg.data.std};
  LAUNCH_ASSIGN_OR_RETURN(IdxDataset train, IdxDataset::Load(dir, IdxSplit::kTrain, options));
  StatusOr<IdxDataset> test = IdxDataset::Load(dir, IdxSplit::kTest, options);
  if (!test.ok() && test.status().code() != Status::Code::kNotFound) return test.status();
  Dataset d;
  d.task = Task::kClassification;
  d.pixels = options;
  d.crop_padding = cfg.data.crop_padding;
  d.flip = cfg.data.flip;
  const int64_t n_train = train.pixels().size(0);
  if (test.ok()) {
    if (!test->pixels().sizes().slice(1).equals(train.pixels().sizes().slice(1)))
      return Status::InvalidConfig(
          dir + ": the t10k-* images are " + std::to_string(test->pixels().size(2)) + "x" +
          std::to_string(test->pixels().size(3)) + " but train-* are " +
          std::to_string(train.pixels().size(2)) + "x" + std::to_string(train.pixels().size(3)));
    // One tensor for both splits: rows [0, n_train) train, the rest (the t10k files) evaluate.
    d.inputs = torch::cat({train.pixels(), test->pixels()});
    d.targets = torch::cat({train.labels(), test->labels()});
    const int64_t n = d.inputs.size(0);
    for (int64_t i = 0; i < n_train; ++i) d.train_indices.push_back(i);
    for (int64_t i = n_train; i < n; ++i) d.eval_indices.push_back(i);
  } else {
    d.inputs = train.pixels();
    d.targets = train.labels();
  }
  const auto& shape = d.inputs.sizes();
  d.description = "idx " + dir + ": " + std::to_string(n_train) + " training images " +
                  std::to_string(shape[2]) + "x" + std::to_string(shape[3]) +
                  (test.ok() ? ", " + std::to_string(d.eval_indices.size()) + " test images"
                             : std::string(", no t10k-* files (eval_fraction held out)"));
  // The model must fit the images: a wrong width fails here, with the key to change, rather
  // than as a shape error in the first forward.
  const int64_t classes = d.targets.max().item<int64_t>() + 1;
  const config::ModelConfig& m = cfg.model;
  const int64_t pixels = shape[1] * shape[2] * shape[3];
  if (m.type == config::ModelType::kMlp) {
    if (m.mlp_layers.front() != pixels)
      return Status::InvalidConfig("train.model.layers starts with " +
                                   std::to_string(m.mlp_layers.front()) + " but the images have " +
                                   std::to_string(pixels) + " pixels (" + dir + ")");
    if (m.mlp_layers.back() < classes)
      return Status::InvalidConfig("train.model.layers ends with " +
                                   std::to_string(m.mlp_layers.back()) + " outputs but " + dir +
                                   " has " + std::to_string(classes) + " classes");
  } else if (m.type == config::ModelType::kCnn) {
    if (!shape.slice(1).equals(m.input_shape))
      return Status::InvalidConfig(
          "train.model.input is [" + std::to_string(m.input_shape[0]) + ", " +
          std::to_string(m.input_shape[1]) + ", " + std::to_string(m.input_shape[2]) +
          "] but the images in " + dir + " are [" + std::to_string(shape[1]) + ", " +
          std::to_string(shape[2]) + ", " + std::to_string(shape[3]) + "]");
    if (m.classes < classes)
      return Status::InvalidConfig("train.model.classes is " + std::to_string(m.classes) + " but " +
                                   dir + " has " + std::to_string(classes) + " classes");
  } else if (m.type == config::ModelType::kTransformer) {
    return Status::InvalidConfig("train.model: a transformer needs text data, not images");
  }
  return d;
}

}  // namespace

StatusOr<Dataset> LoadDataset(const config::TrainConfig& cfg) {
  StatusOr<Dataset> loaded = Status::Internal("unknown data type");
  try {
    switch (cfg.data.type) {
      case config::DataType::kSynthetic:
        loaded = Synthetic(cfg);
        break;
      case config::DataType::kCsv:
        loaded = Csv(cfg);
        break;
      case config::DataType::kText:
        loaded = Text(cfg);
        break;
      case config::DataType::kIdx:
        loaded = Idx(cfg);
        break;
    }
  } catch (const c10::Error& e) {
    return Status::Internal("loading train.data: " + std::string(e.what_without_backtrace()));
  }
  if (!loaded.ok()) return loaded.status();
  Dataset d = std::move(loaded).value();
  if (d.task == Task::kLanguageModel && cfg.model.type == config::ModelType::kMlp)
    return Status::InvalidConfig("train.data: text data needs a transformer or TorchScript model");
  if (cfg.model.type == config::ModelType::kCnn && d.inputs.dim() != 4)
    return Status::InvalidConfig("train.model: a cnn needs images (`data: {type: idx}`), not " +
                                 std::string(config::ToString(cfg.data.type)) + " data");
  // The files name their evaluation split (IDX), or the loader held out eval_fraction (CSV).
  if (!d.train_indices.empty()) return d;
  HoldOut(cfg, &d);
  return d;
}

}  // namespace launch::trainer
