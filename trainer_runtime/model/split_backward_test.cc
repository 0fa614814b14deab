// The zero-bubble split backward (split_backward.h): the input half gives the input's gradient
// and leaves the weights' alone, the weight half gives what one whole backward gives, through
// the parameters' accumulators (their hooks run); without a store nothing changes. And the
// interleaved pipeline's JoinChunks (pipeline_stages.h).

#include "trainer_runtime/model/split_backward.h"

#include <vector>

#include "trainer_runtime/model/pipeline_stages.h"
#include "trainer_runtime/model/tensor_parallel.h"
#include "trainer_runtime/util/doctest_torch.h"  // last: after every torch header

namespace launch::trainer {
namespace {

struct Grads {
  torch::Tensor input, w1, b1, w2;
};

// Two Linears (the second without a bias) with a GELU between, on a [2, 5, 6] input, the loss
// weighted so that every gradient element differs.
Grads RunOnce(WeightGradStore* store, bool flush, int* hook_calls = nullptr) {
  torch::manual_seed(3);
  auto w1 = torch::randn({8, 6}).requires_grad_(true);
  auto b1 = torch::randn({8}).requires_grad_(true);
  auto w2 = torch::randn({4, 8}).requires_grad_(true);
  // Counts the gradients the hook sees (LibTorch 2 also calls it with none in the input pass).
  if (hook_calls)
    w2.register_hook([hook_calls](torch::Tensor g) {
      if (g.defined()) ++*hook_calls;
      return g;
    });
  auto x = torch::randn({2, 5, 6}).requires_grad_(true);
  auto weights = torch::arange(40, torch::kFloat).reshape({2, 5, 4});
  torch::Tensor y;
  {
    WeightGradStore::Scope scope(store);
    y = SplitLinear(torch::gelu(SplitLinear(x, w1, b1)), w2);
  }
  (y * weights).sum().backward();
  Grads g{x.grad(), w1.grad(), b1.grad(), w2.grad()};
  if (flush) {
    store->Flush();
    g = {x.grad(), w1.grad(), b1.grad(), w2.grad()};
  }
  return g;
}

TEST_CASE("SplitLinearLeavesTheWeightGradientsToTheStoreAndFlushGivesWhatOneBackwardGives") {
  const Grads whole = RunOnce(nullptr, false);
  REQUIRE(whole.w1.defined());
  auto store = c10::make_intrusive<WeightGradStore>();

  // The input half: the input's and the bias' gradients, no weight's.
  int hooks = 0;
  const Grads half = RunOnce(store.get(), false, &hooks);
  CHECK(torch::allclose(half.input, whole.input, 1e-6, 1e-6));
  CHECK(torch::allclose(half.b1, whole.b1, 1e-6, 1e-6));
  CHECK_FALSE(half.w1.defined());
  CHECK_FALSE(half.w2.defined());
  CHECK_FALSE(store->empty());
  CHECK(store->bytes() == (2 * 5 * 6 + 2 * 5 * 8 + 2 * 5 * 8 + 2 * 5 * 4) * 4);
  CHECK(hooks == 0);
  store->Flush();
  CHECK(store->empty());

  // Both halves: the weights' gradients as one backward's, through the accumulators' hooks.
  hooks = 0;
  auto second = c10::make_intrusive<WeightGradStore>();
  const Grads both = RunOnce(second.get(), true, &hooks);
  CHECK(torch::allclose(both.w1, whole.w1, 1e-5, 1e-6));
  CHECK(torch::allclose(both.w2, whole.w2, 1e-5, 1e-6));
  CHECK(hooks == 1);
  CHECK(second->empty());
}

TEST_CASE("SplitLinearWithoutAnActiveStoreIsLinearBitForBit") {
  torch::manual_seed(4);
  auto w = torch::randn({3, 5}), b = torch::randn({3}), x = torch::randn({7, 5});
  CHECK(torch::equal(SplitLinear(x, w, b), torch::nn::functional::linear(x, w, b)));
  // Active but with grad mode off (inference): Linear too.
  auto store = c10::make_intrusive<WeightGradStore>();
  WeightGradStore::Scope scope(store.get());
  torch::NoGradGuard no_grad;
  CHECK(torch::equal(SplitLinear(x, w.requires_grad_(true), b),
                     torch::nn::functional::linear(x, w, b)));
}

TEST_CASE("JoinChunksKeepsTheWholeModelsNamesAndSharesTheTensors") {
  torch::nn::Sequential whole(torch::nn::Linear(4, 6), torch::nn::ReLU(), torch::nn::Linear(6, 6),
                              torch::nn::ReLU(), torch::nn::Linear(6, 2));
  // Five modules in four chunks of a 2-rank pipeline, v = 2: rank 0 holds chunks 0 and 2.
  const std::vector<int64_t> cut = {2, 1, 1, 1};
  std::vector<torch::nn::AnyModule> mine = {SequentialStage(whole, cut, 0).value(),
                                            SequentialStage(whole, cut, 2).value()};
  auto joined = JoinChunks(mine);
  REQUIRE(joined.ok());
  std::vector<std::string> names;
  for (const auto& p : (*joined)->named_parameters()) names.push_back(p.key());
  CHECK(names == std::vector<std::string>{"0.weight", "0.bias"});
  // Chunk 2 is module 3 (a ReLU): chunk 3 holds the last Linear.
  std::vector<torch::nn::AnyModule> other = {SequentialStage(whole, cut, 1).value(),
                                             SequentialStage(whole, cut, 3).value()};
  auto joined_other = JoinChunks(other);
  REQUIRE(joined_other.ok());
  names.clear();
  for (const auto& p : (*joined_other)->named_parameters()) names.push_back(p.key());
  CHECK(names == std::vector<std::string>{"2.weight", "2.bias", "4.weight", "4.bias"});
  CHECK((*joined_other)->named_parameters()["4.weight"].is_same(whole[4]->parameters()[0]));
  // The same chunk twice: its names clash.
  auto clash = JoinChunks({mine[0], mine[0]});
  CHECK_FALSE(clash.ok());
  CHECK(clash.status().message().find("'0'") != std::string::npos);
}

}  // namespace
}  // namespace launch::trainer
