// Activation checkpointing (activation_checkpoint.h): the same gradients as a plain backward, bit
// for bit (dropout included: the generator's state is restored for the recomputation), and less
// memory held between forward and backward.

#include "trainer_runtime/model/activation_checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <malloc.h>

#include <string>
#include <vector>

#include "trainer_runtime/model/model.h"
#include "trainer_runtime/util/doctest_torch.h"  // last: after every torch header

namespace launch::trainer {
namespace {

struct Run {
  torch::Tensor loss;
  std::vector<torch::Tensor> grads;  // the parameters', in NamedParameters order
  torch::Tensor input_grad;          // float inputs only
  NamedTensors buffers;
  double next_draw = 0;  // the generator after backward: unaffected by the recomputation
};

// One forward and backward of the model `m` builds (seeded), on `input`.
Run TrainOnce(config::ModelConfig m, bool checkpoint, const torch::Tensor& input,
              const torch::Tensor& target) {
  m.activation_checkpointing = checkpoint;
  torch::manual_seed(7);
  std::unique_ptr<Model> model = std::move(CreateModel(m)).value();
  model->SetTraining(true);
  torch::manual_seed(11);  // the dropout masks' stream
  torch::Tensor x = input.detach().clone();
  if (x.is_floating_point()) x.requires_grad_(true);
  torch::Tensor logits = model->Forward(x);
  Run r;
  r.loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                target.reshape({-1}));
  r.loss.backward();
  for (auto& [name, p] : model->NamedParameters()) {
    REQUIRE_MESSAGE(p.grad().defined(), name);
    r.grads.push_back(p.grad().clone());
  }
  if (x.is_floating_point()) r.input_grad = x.grad().clone();
  for (auto& [name, b] : model->NamedBuffers()) r.buffers.emplace_back(name, b.clone());
  r.next_draw = torch::rand({1}).item<double>();
  return r;
}

void CheckSame(const Run& plain, const Run& ckpt) {
  CHECK(torch::equal(plain.loss, ckpt.loss));
  REQUIRE(plain.grads.size() == ckpt.grads.size());
  for (size_t i = 0; i < plain.grads.size(); ++i)
    CHECK_MESSAGE(torch::equal(plain.grads[i], ckpt.grads[i]), "parameter " << i);
  if (plain.input_grad.defined()) CHECK(torch::equal(plain.input_grad, ckpt.input_grad));
  REQUIRE(plain.buffers.size() == ckpt.buffers.size());
  for (size_t i = 0; i < plain.buffers.size(); ++i)
    CHECK_MESSAGE(torch::equal(plain.buffers[i].second, ckpt.buffers[i].second),
                  plain.buffers[i].first);
  CHECK(plain.next_draw == ckpt.next_draw);
}

TEST_CASE("CheckpointedMlpGradientsEqualPlainOnesBitForBitWithDropout") {
  config::ModelConfig m;
  m.mlp_layers = {16, 64, 64, 64, 64, 64, 10};  // 5 hidden layers: runs of 3 and 2
  for (double dropout : {0.0, 0.3}) {
    CAPTURE(dropout);
    m.dropout = dropout;
    torch::manual_seed(3);
    torch::Tensor x = torch::randn({32, 16});
    torch::Tensor y = torch::randint(0, 10, {32});
    const Run plain = TrainOnce(m, false, x, y);
    const Run ckpt = TrainOnce(m, true, x, y);
    CheckSame(plain, ckpt);
  }
}

TEST_CASE("CheckpointedTransformerAndCnnGradientsEqualPlainOnesBitForBit") {
  SUBCASE("transformer blocks with dropout") {
    config::ModelConfig m;
    m.type = config::ModelType::kTransformer;
    m.d_model = 32;
    m.heads = 4;
    m.transformer_layers = 3;
    m.context = 16;
    m.dropout = 0.2;
    torch::manual_seed(5);
    torch::Tensor tokens = torch::randint(0, 256, {4, 16});
    torch::Tensor next = torch::randint(0, 256, {4, 16});
    CheckSame(TrainOnce(m, false, tokens, next), TrainOnce(m, true, tokens, next));
  }
  SUBCASE("conv blocks with batch norm: running statistics updated once") {
    config::ModelConfig m;
    m.type = config::ModelType::kCnn;
    m.cnn_channels = {4, 8};
    m.cnn_hidden = 16;
    m.input_shape = {1, 8, 8};
    m.dropout = 0.2;
    torch::manual_seed(6);
    torch::Tensor images = torch::randn({8, 1, 8, 8});
    torch::Tensor labels = torch::randint(0, 10, {8});
    CheckSame(TrainOnce(m, false, images, labels), TrainOnce(m, true, images, labels));
  }
}

TEST_CASE("CheckpointedForwardIsPlainWithoutGradAndRecomputesForAUsersBlock") {
  torch::manual_seed(1);
  torch::nn::Linear fc1(8, 8), fc2(8, 4);
  int calls = 0;
  bool recomputing_seen = false;
  auto block = [&](const torch::Tensor& h) {
    ++calls;
    recomputing_seen = recomputing_seen || RecomputingForCheckpoint();
    return fc2(torch::dropout(torch::relu(fc1(h)), 0.5, true));
  };
  torch::Tensor x = torch::randn({5, 8});
  {
    torch::NoGradGuard no_grad;
    CheckpointedForward(block, x);
    CHECK(calls == 1);
  }
  // The input needs no gradient (data): the parameters get theirs all the same.
  torch::manual_seed(2);
  torch::Tensor plain = block(x);
  plain.sum().backward();
  const torch::Tensor w1 = fc1->weight.grad().clone(), w2 = fc2->weight.grad().clone();
  fc1->zero_grad();
  fc2->zero_grad();
  calls = 0;
  torch::manual_seed(2);
  torch::Tensor out = CheckpointedForward(block, x);
  CHECK(torch::equal(out, plain));
  CHECK_FALSE(recomputing_seen);
  out.sum().backward();
  CHECK(calls == 2);  // forward, and again in backward
  CHECK(recomputing_seen);
  CHECK_FALSE(RecomputingForCheckpoint());
  CHECK(torch::equal(fc1->weight.grad(), w1));
  CHECK(torch::equal(fc2->weight.grad(), w2));
}

// Bytes malloc has handed out and not had back (arenas and mmapped blocks).
size_t HeapInUse() {
  struct mallinfo2 info = ::mallinfo2();
  return info.uordblks + info.hblkhd;
}

// Not timed: the heap held by the graph between forward and backward, which is what
// checkpointing trades for recomputation.
TEST_CASE("CheckpointingHoldsLessMemoryBetweenForwardAndBackwardOnADeepMlp") {
  config::ModelConfig m;
  m.mlp_layers = std::vector<int64_t>(17, 512);  // 16 hidden layers: 4 runs of 4
  m.mlp_layers.front() = 64;
  m.mlp_layers.back() = 10;
  torch::manual_seed(1);
  torch::Tensor x = torch::randn({512, 64});
  torch::Tensor y = torch::randint(0, 10, {512});
  size_t held[2] = {0, 0};
  for (int checkpoint = 0; checkpoint < 2; ++checkpoint) {
    m.activation_checkpointing = checkpoint == 1;
    std::unique_ptr<Model> model = std::move(CreateModel(m)).value();
    const size_t before = HeapInUse();
    torch::Tensor loss = torch::nn::functional::cross_entropy(model->Forward(x), y);
    held[checkpoint] = HeapInUse() - before;
    loss.backward();
  }
  // One activation is 512 x 512 floats = 1 MiB: a plain forward keeps one per hidden layer (16),
  // the checkpointed one the inputs of its 4 runs.
  MESSAGE("held between forward and backward: plain " << (held[0] >> 10) << " KiB, checkpointed "
                                                      << (held[1] >> 10) << " KiB");
  CHECK(held[0] > (size_t{12} << 20));
  CHECK(held[1] < (size_t{6} << 20));
}

}  // namespace
}  // namespace launch::trainer
