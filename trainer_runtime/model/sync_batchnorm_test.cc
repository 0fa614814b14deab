// SyncBatchNorm (sync_batchnorm.h): without a group it is BatchNorm bit for bit; two replicas on
// threads in one group train as one BatchNorm on both batches together (outputs, input and
// parameter gradients, running statistics); ConvertSyncBatchNorm replaces BatchNorm children and
// Sequential entries and keeps their state.

#include "trainer_runtime/model/sync_batchnorm.h"

#include <string>
#include <thread>
#include <vector>

#include "trainer_runtime/util/doctest_torch.h"  // last: after every torch header

namespace launch::trainer {
namespace {

torch::Tensor Input(int64_t rows, double shift) {
  return torch::sin(torch::arange(rows * 3 * 4, torch::kFloat) * 0.3 + shift)
                 .reshape({rows, 3, 4}) *
             2 +
         shift;
}

TEST_CASE("SyncBatchNormWithoutGroupIsBatchNorm") {
  torch::nn::BatchNorm1d bn(3);
  SyncBatchNorm sync(3);
  for (int step = 0; step < 3; ++step) {
    torch::Tensor x = Input(5, step);
    CHECK(torch::equal(bn->forward(x), sync->forward(x)));
  }
  CHECK(torch::equal(bn->running_mean, sync->running_mean));
  CHECK(torch::equal(bn->running_var, sync->running_var));
  CHECK(bn->num_batches_tracked.item<int64_t>() == sync->num_batches_tracked.item<int64_t>());
  bn->eval();
  sync->eval();
  CHECK(torch::equal(bn->forward(Input(2, 9)), sync->forward(Input(2, 9))));
}

TEST_CASE("TwoReplicasInOneGroupTrainAsOneBatchNormOnBothBatches") {
  const torch::Tensor a = Input(4, 0.5), b = Input(6, -1.0);  // uneven shares
  const torch::Tensor weight = torch::linspace(0.5, 1.5, 3), bias = torch::linspace(-0.2, 0.2, 3);
  // The reference: one BatchNorm over all 10 rows; loss weights every row's output alike.
  torch::nn::BatchNorm1d bn(3);
  {
    torch::NoGradGuard no_grad;
    bn->weight.copy_(weight);
    bn->bias.copy_(bias);
  }
  torch::Tensor x = torch::cat({a, b}).requires_grad_(true);
  torch::Tensor coef = torch::cos(torch::arange(x.numel(), torch::kFloat)).reshape(x.sizes());
  const torch::Tensor ref_out = bn->forward(x);
  (ref_out * coef).sum().backward();

  ThreadBatchNormGroup group(2);
  std::vector<SyncBatchNorm> replicas = {SyncBatchNorm(3), SyncBatchNorm(3)};
  std::vector<torch::Tensor> inputs = {a.clone().requires_grad_(true),
                                       b.clone().requires_grad_(true)};
  std::vector<torch::Tensor> outputs(2);
  std::vector<torch::Tensor> coefs = {coef.narrow(0, 0, 4), coef.narrow(0, 4, 6)};
  for (int k = 0; k < 2; ++k) {
    torch::NoGradGuard no_grad;
    replicas[k]->weight.copy_(weight);
    replicas[k]->bias.copy_(bias);
    replicas[k]->set_group(group.member(k));
  }
  // Forward and backward of both replicas together, each on its own thread (as dp runs them).
  std::vector<std::thread> threads;
  for (int k = 0; k < 2; ++k)
    threads.emplace_back([&, k] {
      outputs[k] = replicas[k]->forward(inputs[k]);
      (outputs[k] * coefs[k]).sum().backward();
    });
  for (auto& t : threads) t.join();
  const auto close = [](const torch::Tensor& got, const torch::Tensor& want) {
    return torch::allclose(got, want, /*rtol=*/1e-5, /*atol=*/1e-6);
  };
  CHECK(close(torch::cat({outputs[0], outputs[1]}).detach(), ref_out.detach()));
  CHECK(close(torch::cat({inputs[0].grad(), inputs[1].grad()}), x.grad()));
  CHECK(close(replicas[0]->weight.grad() + replicas[1]->weight.grad(), bn->weight.grad()));
  CHECK(close(replicas[0]->bias.grad() + replicas[1]->bias.grad(), bn->bias.grad()));
  for (int k = 0; k < 2; ++k) {
    CHECK(close(replicas[k]->running_mean, bn->running_mean));
    CHECK(close(replicas[k]->running_var, bn->running_var));
  }
}

TEST_CASE("AReplicaThatFailsBreaksTheRendezvousInsteadOfHangingTheOthers") {
  // Replica 1 throws before its first SyncBatchNorm (dp breaks the group then): replica 0, which
  // waits in the rendezvous, must throw too, and the next step (SetActive) meets normally.
  ThreadBatchNormGroup group(2);
  SyncBatchNorm bn(3);
  bn->set_group(group.member(0));
  bool threw = false;
  std::thread waiter([&] {
    try {
      bn->forward(Input(4, 0.5));
    } catch (const std::exception& e) {
      threw = std::string(e.what()).find("another replica failed") != std::string::npos;
    }
  });
  group.Break();
  waiter.join();
  CHECK(threw);
  group.SetActive(1);  // one replica: meets alone, no wait
  CHECK(bn->forward(Input(4, 0.5)).defined());
}

TEST_CASE("ConvertSyncBatchNormReplacesChildrenAndSequentialEntriesKeepingState") {
  struct NetImpl : torch::nn::Module {
    NetImpl() {
      seq = register_module(
          "seq", torch::nn::Sequential(torch::nn::Linear(3, 3), torch::nn::BatchNorm1d(3)));
      norm = register_module("norm", torch::nn::BatchNorm2d(2));
    }
    torch::nn::Sequential seq{nullptr};
    torch::nn::BatchNorm2d norm{nullptr};
  };
  auto net = std::make_shared<NetImpl>();
  {
    torch::NoGradGuard no_grad;
    net->norm->running_mean.fill_(0.25);
    net->norm->weight.fill_(2.0);
  }
  net->norm->weight.set_requires_grad(false);  // frozen: stays frozen
  const auto before = net->named_parameters(), before_buffers = net->named_buffers();
  int converted = 0;
  auto out = ConvertSyncBatchNorm(net, &converted);
  CHECK(out == net);  // converted in place
  CHECK(converted == 2);
  auto children = net->named_children();
  auto* norm = dynamic_cast<SyncBatchNormImpl*>(children["norm"].get());
  REQUIRE(norm != nullptr);
  CHECK(norm->running_mean[0].item<float>() == 0.25f);
  CHECK(norm->weight[1].item<float>() == 2.0f);
  CHECK_FALSE(norm->weight.requires_grad());
  auto& seq = dynamic_cast<torch::nn::SequentialImpl&>(*children["seq"]);
  CHECK(dynamic_cast<SyncBatchNormImpl*>(seq.ptr(1).get()) != nullptr);
  // The same names, so state dicts and optimizers built after the conversion line up.
  std::vector<std::string> names, names_before;
  for (const auto& p : net->named_parameters()) names.push_back(p.key());
  for (const auto& p : before) names_before.push_back(p.key());
  CHECK(names == names_before);
  CHECK(net->named_buffers().size() == before_buffers.size());
  // A BatchNorm itself becomes a new SyncBatchNorm.
  auto lone = ConvertSyncBatchNorm(torch::nn::BatchNorm1d(4).ptr(), &converted);
  CHECK(converted == 1);
  CHECK(std::dynamic_pointer_cast<SyncBatchNormImpl>(lone) != nullptr);
}

}  // namespace
}  // namespace launch::trainer
