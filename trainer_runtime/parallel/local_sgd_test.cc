#include "trainer_runtime/parallel/local_sgd.h"

#include "trainer_runtime/util/doctest_torch.h"  // last: after every torch header

namespace launch::trainer {
namespace {

// Two outer steps worked by hand (PyTorch's SGD, nesterov=True: buf = mu * buf + g,
// p -= lr * (g + mu * buf)), with values that are exact in float32.
TEST_CASE("OuterNesterovStepIsSgdWithNesterovMomentumOnTheAveragedChange") {
  std::vector<torch::Tensor> params = {torch::tensor({1.0f, 2.0f})};  // the averaged replicas
  std::vector<torch::Tensor> anchor = {torch::tensor({2.0f, 2.0f})};  // the last sync's
  std::vector<torch::Tensor> momentum = {torch::zeros({2})};
  // g = [1, 0], buf = [1, 0], step = g + 0.5 buf = [1.5, 0], anchor = [2 - 0.75, 2].
  OuterNesterovStep(params, anchor, momentum, /*lr=*/0.5, /*mu=*/0.5);
  CHECK(torch::equal(anchor[0], torch::tensor({1.25f, 2.0f})));
  CHECK(torch::equal(params[0], anchor[0]));
  CHECK(torch::equal(momentum[0], torch::tensor({1.0f, 0.0f})));
  // The replicas drift to [1, 3]: g = [0.25, -1], buf = [0.75, -1], step = [0.625, -1.5].
  params[0].copy_(torch::tensor({1.0f, 3.0f}));
  OuterNesterovStep(params, anchor, momentum, 0.5, 0.5);
  CHECK(torch::equal(momentum[0], torch::tensor({0.75f, -1.0f})));
  CHECK(torch::equal(anchor[0], torch::tensor({0.9375f, 2.75f})));
  CHECK(torch::equal(params[0], anchor[0]));
}

TEST_CASE("OuterNesterovStepWithLrOneAndNoMomentumIsTheAverage") {
  std::vector<torch::Tensor> params = {torch::tensor({0.5f, -4.0f, 8.0f})};
  std::vector<torch::Tensor> anchor = {torch::tensor({1.0f, 2.0f, 8.0f})};
  std::vector<torch::Tensor> momentum = {torch::zeros({3})};
  OuterNesterovStep(params, anchor, momentum, 1.0, 0.0);
  CHECK(torch::equal(params[0], torch::tensor({0.5f, -4.0f, 8.0f})));
}

}  // namespace
}  // namespace launch::trainer
