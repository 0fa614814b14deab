#include "trainer_runtime/data.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "base/strings.h"
#include "trainer_runtime/sampler.h"

namespace launch::trainer {

torch::Tensor Dataset::Inputs(const std::vector<int64_t>& indices) const {
  return inputs.index_select(0, torch::tensor(indices, torch::kLong));
}

torch::Tensor Dataset::Targets(const std::vector<int64_t>& indices) const {
  return targets.index_select(0, torch::tensor(indices, torch::kLong));
}

torch::Tensor Loss(Task task, const torch::Tensor& logits, const torch::Tensor& targets) {
  switch (task) {
    case Task::kClassification:
      return torch::nn::functional::cross_entropy(logits, targets);
    case Task::kRegression:
      return torch::mse_loss(logits, targets);
    case Task::kLanguageModel:
      return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                  targets.reshape({-1}));
  }
  return {};
}

std::pair<int64_t, int64_t> CountCorrect(Task task, const torch::Tensor& logits,
                                         const torch::Tensor& targets) {
  if (task == Task::kRegression) return {0, 0};
  auto pred = logits.argmax(-1);
  return {pred.eq(targets).sum().item<int64_t>(), targets.numel()};
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
  // Standardise features so any CSV trains with default learning rates.
  auto mean = d.inputs.mean(0, true);
  auto std = d.inputs.std(0, true, true).clamp_min(1e-6);
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
    }
  } catch (const c10::Error& e) {
    return Status::Internal("loading train.data: " + std::string(e.what_without_backtrace()));
  }
  if (!loaded.ok()) return loaded.status();
  Dataset d = std::move(loaded).value();
  if (d.task == Task::kLanguageModel && cfg.model.type == config::ModelType::kMlp)
    return Status::InvalidConfig("train.data: text data needs a transformer or TorchScript model");
  const int64_t n = d.inputs.size(0);
  // The split depends on the seed and the data only, never on the world size.
  std::vector<int64_t> perm = ShardedSampler::Permutation(n, cfg.seed ^ 0x5eedull, -1);
  int64_t n_eval = static_cast<int64_t>(std::llround(cfg.eval_fraction * static_cast<double>(n)));
  if (cfg.eval_fraction > 0 && n_eval == 0) n_eval = 1;
  if (n_eval >= n) n_eval = n - 1;
  d.eval_indices.assign(perm.begin(), perm.begin() + n_eval);
  d.train_indices.assign(perm.begin() + n_eval, perm.end());
  return d;
}

}  // namespace launch::trainer
