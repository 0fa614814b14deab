// flops.h: the training FLOPs of each built-in model against counts done by hand for small
// configurations, and the shapes behind them against the models model.cc really builds.

#include "trainer_runtime/model/flops.h"

#include <string>

#include "trainer_runtime/model/model.h"
#include "trainer_runtime/util/doctest_torch.h"  // last: after every torch header

namespace launch::trainer {
namespace {

config::TrainConfig Mlp(std::vector<int64_t> widths) {
  config::TrainConfig cfg;
  cfg.model.type = config::ModelType::kMlp;
  cfg.model.mlp_layers = std::move(widths);
  return cfg;
}

config::TrainConfig Cnn(std::vector<int64_t> input, std::vector<int64_t> channels, int64_t hidden,
                        int64_t classes) {
  config::TrainConfig cfg;
  cfg.model.type = config::ModelType::kCnn;
  cfg.model.input_shape = std::move(input);
  cfg.model.cnn_channels = std::move(channels);
  cfg.model.cnn_hidden = hidden;
  cfg.model.classes = classes;
  return cfg;
}

config::TrainConfig Lm(int64_t d_model, int64_t layers, int64_t vocab, int64_t context) {
  config::TrainConfig cfg;
  cfg.model.type = config::ModelType::kTransformer;
  cfg.model.d_model = d_model;
  cfg.model.heads = 2;
  cfg.model.transformer_layers = layers;
  cfg.model.vocab_size = vocab;
  cfg.model.context = context;
  return cfg;
}

TEST_CASE("MlpCountsTwoFlopsPerWeightForwardAndThreeForwardsPerTrainingSample") {
  // 4-8-3: 2*4*8 + 2*8*3 = 64 + 48.
  const auto f = CountModelFlops(Mlp({4, 8, 3}));
  REQUIRE(f.has_value());
  CHECK(f->forward_per_sample == 112);
  CHECK(f->train_per_sample == 336);
  CHECK(f->tokens_per_sample == 0);
}

TEST_CASE("CnnCountsSameSizeConvolutionsOnPooledMapsAndTheClassifier") {
  // [1, 8, 8], channels 2, 4: conv1 2*9*1*2*8*8 = 2304 (pooled to 4x4), conv2 2*9*2*4*4*4 =
  // 2304 (pooled to 2x2, 16 features), fc 2*16*5 = 160, head 2*5*3 = 30.
  auto f = CountModelFlops(Cnn({1, 8, 8}, {2, 4}, 5, 3));
  REQUIRE(f.has_value());
  CHECK(f->forward_per_sample == 4798);
  CHECK(f->train_per_sample == 14394);
  // No hidden layer: the head takes the 16 features, 2*16*3 = 96.
  f = CountModelFlops(Cnn({1, 8, 8}, {2, 4}, 0, 3));
  REQUIRE(f.has_value());
  CHECK(f->forward_per_sample == 4704);
  // Odd sizes pool down: [3, 7, 5], conv 2*9*3*2*7*5 = 3780, then 2 x 3 x 2 = 12 features,
  // head 2*12*4 = 96.
  f = CountModelFlops(Cnn({3, 7, 5}, {2}, 0, 4));
  REQUIRE(f.has_value());
  CHECK(f->forward_per_sample == 3876);
}

TEST_CASE("TransformerCountsSixNPlusAttentionPerTokenOverTheSequence") {
  // d 8, 2 layers, vocab 16, 4 tokens. Per token forward: per layer qkv 2*8*24 = 384, proj
  // 2*8*8 = 128, fc1 2*8*32 = 512, fc2 512 (x2 layers = 3072), head 2*8*16 = 256; attention
  // per layer 2*T*d for the scores and 2*T*d for the sum = 128 (x2 = 256). 3584 per token.
  auto f = CountModelFlops(Lm(8, 2, 16, 4));
  REQUIRE(f.has_value());
  CHECK(f->tokens_per_sample == 4);
  CHECK(f->forward_per_sample == 4 * 3584);
  // 6N + 12 L d T per token with N = 2*12*64 + 8*16 = 1664: 9984 + 768.
  CHECK(f->train_per_sample == 4 * (6 * 1664 + 12 * 2 * 8 * 4));
  // The text data's own context (shorter than the model's) is the sequence.
  config::TrainConfig shorter = Lm(8, 2, 16, 4);
  shorter.data.context = 2;
  f = CountModelFlops(shorter);
  REQUIRE(f.has_value());
  CHECK(f->tokens_per_sample == 2);
  CHECK(f->forward_per_sample == 2 * (3328 + 4 * 2 * 8 * 2));
}

TEST_CASE("TorchScriptModelsHaveNoCount") {
  config::TrainConfig cfg;
  cfg.model.type = config::ModelType::kTorchScript;
  cfg.model.torchscript_path = "/nonexistent.pt";
  CHECK_FALSE(CountModelFlops(cfg).has_value());
}

// Sum over the built model's parameters named `suffix` of in x out: what its matmuls multiply.
int64_t MatmulWeights(const Model& model, const std::string& suffix) {
  int64_t n = 0;
  for (const auto& [name, p] : model.NamedParameters()) {
    if (p.dim() == 2 && name.size() >= suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      n += p.numel();
  }
  return n;
}

TEST_CASE("CountsFollowTheShapesModelCcBuilds") {
  // MLP: 2 FLOPs per Linear weight.
  config::TrainConfig mlp = Mlp({5, 7, 6, 2});
  auto built = CreateModel(mlp.model);
  REQUIRE(built.ok());
  CHECK(CountModelFlops(mlp)->forward_per_sample == 2 * MatmulWeights(**built, ".weight"));

  // Transformer: N is every 2-D weight but the token and position embeddings.
  config::TrainConfig lm = Lm(8, 3, 20, 6);
  built = CreateModel(lm.model);
  REQUIRE(built.ok());
  const int64_t n = MatmulWeights(**built, ".weight") - 20 * 8 - 6 * 8;
  CHECK(CountModelFlops(lm)->train_per_sample == 6 * (6 * n + 12 * 3 * 8 * 6));

  // CNN: the classifier's input width is the pooled feature map the count assumes; the whole
  // model's output has `classes` logits for an input of input_shape.
  config::TrainConfig cnn = Cnn({3, 11, 9}, {4, 6}, 10, 7);
  built = CreateModel(cnn.model);
  REQUIRE(built.ok());
  for (const auto& [name, p] : (*built)->NamedParameters()) {
    if (name == "fc.weight") CHECK(p.size(1) == 6 * 2 * 2);  // 11x9 -> 5x4 -> 2x2
  }
  (*built)->SetTraining(false);
  CHECK((*built)->Forward(torch::zeros({1, 3, 11, 9})).sizes() == torch::IntArrayRef({1, 7}));
  // conv1 2*9*3*4*11*9, conv2 2*9*4*6*5*4, fc 2*24*10, head 2*10*7.
  CHECK(CountModelFlops(cnn)->forward_per_sample == 21384 + 8640 + 480 + 140);
}

}  // namespace
}  // namespace launch::trainer
