#include "trainer_runtime/model/flops.h"

namespace launch::trainer {
namespace {

int64_t MlpForward(const config::ModelConfig& m) {
  int64_t flops = 0;
  for (size_t i = 0; i + 1 < m.mlp_layers.size(); ++i)
    flops += 2 * m.mlp_layers[i] * m.mlp_layers[i + 1];
  return flops;
}

// The shapes CnnImpl::reset builds (model.cc): same-size 3x3 convolutions, each followed by a
// 2x2 max pool that halves H and W, rounding down.
int64_t CnnForward(const config::ModelConfig& m) {
  int64_t c = m.input_shape[0], h = m.input_shape[1], w = m.input_shape[2];
  int64_t flops = 0;
  for (int64_t out : m.cnn_channels) {
    flops += 2 * 3 * 3 * c * out * h * w;
    c = out;
    h /= 2;
    w /= 2;
  }
  int64_t width = c * h * w;
  if (m.cnn_hidden > 0) {
    flops += 2 * width * m.cnn_hidden;
    width = m.cnn_hidden;
  }
  return flops + 2 * width * m.classes;
}

}  // namespace

std::optional<ModelFlops> CountModelFlops(const config::TrainConfig& cfg) {
  const config::ModelConfig& m = cfg.model;
  ModelFlops f;
  switch (m.type) {
    case config::ModelType::kMlp:
      f.forward_per_sample = MlpForward(m);
      break;
    case config::ModelType::kCnn:
      f.forward_per_sample = CnnForward(m);
      break;
    case config::ModelType::kTransformer: {
      const int64_t d = m.d_model, layers = m.transformer_layers;
      const int64_t t = cfg.data.context > 0 ? cfg.data.context : m.context;
      // Weights that multiply activations (BlockImpl in layers.h: qkv d x 3d, proj d x d,
      // fc1 d x 4d, fc2 4d x d; the head d x vocab).
      const int64_t n = layers * 12 * d * d + d * m.vocab_size;
      f.tokens_per_sample = t;
      f.forward_per_sample = t * (2 * n + 4 * layers * d * t);
      break;
    }
    case config::ModelType::kTorchScript:
      return std::nullopt;
  }
  f.train_per_sample = 3 * f.forward_per_sample;
  return f;
}

}  // namespace launch::trainer
