// Adam and AdamW's foreach and fused steps (fused_adam.h) against LibTorch's own torch::optim
// Adam and AdamW: the same parameters and state after several steps (two groups with their own
// learning rates, weight decay on and off, amsgrad on and off, a parameter without gradient),
// checkpoints that move between implementations, `auto` as the for loop itself on the CPU, and
// the config path through MakeOptimizer. The CUDA case runs the same comparisons on a GPU.

#include "trainer_runtime/model/fused_adam.h"

#include <sstream>
#include <string>
#include <vector>

#include <torch/csrc/api/include/torch/version.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/model/model.h"
#include "trainer_runtime/util/doctest_torch.h"  // last: after every torch header

namespace launch::trainer {
namespace {

namespace optim = torch::optim;

struct AdamKind {
  using Options = optim::AdamOptions;
  using State = optim::AdamParamState;
};
struct AdamWKind {
  using Options = optim::AdamWOptions;
  using State = optim::AdamWParamState;
};

// fp32 after a few steps of the same arithmetic in another kernel order.
constexpr double kRtol = 1e-6;
constexpr double kAtol = 1e-7;

// Two groups' parameters; the last of the second never gets a gradient.
struct Params {
  std::vector<torch::Tensor> first, second;
  std::vector<torch::Tensor> All() const {
    std::vector<torch::Tensor> all = first;
    all.insert(all.end(), second.begin(), second.end());
    return all;
  }
};

Params MakeParams(torch::Device device) {
  torch::manual_seed(7);
  auto p = [device](std::vector<int64_t> shape) {
    return torch::randn(shape).to(device).requires_grad_();
  };
  return {{p({4, 3}), p({3}), p({5, 2, 2})}, {p({7}), p({2, 3}), p({6})}};
}

// Step `step`'s gradients: the same values for every copy of the parameters; none for the
// frozen one.
void SetGrads(const Params& params, int step) {
  const std::vector<torch::Tensor> all = params.All();
  for (size_t i = 0; i + 1 < all.size(); ++i) {
    torch::manual_seed(1000 * step + static_cast<int64_t>(i));
    all[i].mutable_grad() = torch::randn(all[i].sizes()).to(all[i].device());
  }
}

Params Copy(const Params& from) {
  auto copy = [](const std::vector<torch::Tensor>& ts) {
    std::vector<torch::Tensor> out;
    for (const auto& t : ts) out.push_back(t.detach().clone().requires_grad_());
    return out;
  };
  return {copy(from.first), copy(from.second)};
}

template <typename Kind>
typename Kind::Options Options(double weight_decay, bool amsgrad) {
  typename Kind::Options o(1e-2);
  o.betas({0.8, 0.95}).eps(1e-6).weight_decay(weight_decay).amsgrad(amsgrad);
  return o;
}

// An optimizer over `params` in two groups, the second with a third of the learning rate.
template <typename Kind>
std::unique_ptr<optim::Optimizer> Make(const Params& params, const typename Kind::Options& o,
                                       OptimizerImplementation implementation) {
  std::vector<optim::OptimizerParamGroup> groups;
  groups.emplace_back(params.first, std::make_unique<typename Kind::Options>(o));
  auto second = std::make_unique<typename Kind::Options>(o);
  second->lr(o.lr() / 3);
  groups.emplace_back(params.second, std::move(second));
  auto made = NewAdam(std::move(groups), o, implementation);
  REQUIRE_MESSAGE(made.ok(), made.status().ToString());
  return std::move(made).value();
}

void Run(optim::Optimizer& optimizer, const Params& params, int from, int to) {
  for (int step = from; step < to; ++step) {
    SetGrads(params, step);
    optimizer.step();
  }
}

bool Close(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.defined() != b.defined()) return false;
  return !a.defined() || torch::allclose(a.cpu(), b.cpu(), kRtol, kAtol);
}

// Parameters and every state tensor of `got` match `want`'s within fp32 tolerance (bit for bit
// when `exact`); the frozen parameter is untouched and has no state in either.
template <typename Kind>
void CheckSame(optim::Optimizer& want, const Params& want_params, optim::Optimizer& got,
               const Params& got_params, bool exact = false) {
  const std::vector<torch::Tensor> w = want_params.All(), g = got_params.All();
  for (size_t i = 0; i < w.size(); ++i) {
    CAPTURE(i);
    if (exact) {
      CHECK(torch::equal(w[i].cpu(), g[i].cpu()));
    } else {
      CHECK(Close(w[i], g[i]));
    }
    auto* ws = static_cast<typename Kind::State*>(compat::FindParamState(want, w[i]));
    auto* gs = static_cast<typename Kind::State*>(compat::FindParamState(got, g[i]));
    REQUIRE((ws == nullptr) == (gs == nullptr));
    if (ws == nullptr) continue;
    CHECK(ws->step() == gs->step());
    auto tensors = [](typename Kind::State& s) {
      return std::vector<torch::Tensor>{s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()};
    };
    const std::vector<torch::Tensor> a = tensors(*ws), b = tensors(*gs);
    for (size_t k = 0; k < a.size(); ++k) {
      CAPTURE(k);
      REQUIRE(a[k].defined() == b[k].defined());
      if (!a[k].defined()) continue;
      CHECK((exact ? torch::equal(a[k].cpu(), b[k].cpu()) : Close(a[k], b[k])));
    }
  }
  const torch::Tensor frozen = g.back();
  CHECK(compat::FindParamState(got, frozen) == nullptr);
  CHECK(torch::equal(frozen.cpu(), w.back().cpu()));
  CHECK(OptimizerStateBytes(want) == OptimizerStateBytes(got));
}

// The implementations to compare with the for loop on `device` in this LibTorch.
std::vector<OptimizerImplementation> Candidates(torch::Device device) {
  std::vector<OptimizerImplementation> out = {OptimizerImplementation::kForeach};
  if (compat::HasFusedAdam(device.type())) out.push_back(OptimizerImplementation::kFused);
  return out;
}

// Every combination of weight decay and amsgrad, 5 steps, each candidate against the for loop.
template <typename Kind>
void CompareWithForLoop(torch::Device device) {
  const Params initial = MakeParams(device);
  for (double weight_decay : {0.0, 0.1}) {
    for (bool amsgrad : {false, true}) {
      const auto o = Options<Kind>(weight_decay, amsgrad);
      Params ref_params = Copy(initial);
      auto ref = Make<Kind>(ref_params, o, OptimizerImplementation::kForLoop);
      Run(*ref, ref_params, 0, 5);
      for (OptimizerImplementation implementation : Candidates(device)) {
        CAPTURE(weight_decay);
        CAPTURE(amsgrad);
        CAPTURE(config::ToString(implementation));
        Params params = Copy(initial);
        auto optimizer = Make<Kind>(params, o, implementation);
        CHECK(AdamImplementationOf(*optimizer) == implementation);
        Run(*optimizer, params, 0, 5);
        CheckSame<Kind>(*ref, ref_params, *optimizer, params);
      }
    }
  }
}

std::string Save(optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

void Load(optim::Optimizer& optimizer, const std::string& bytes) {
  torch::serialize::InputArchive archive;
  std::istringstream in(bytes);
  archive.load_from(in);
  optimizer.load(archive);
}

TEST_CASE_TEMPLATE("ForeachAndFusedAdamMatchTorchOptimOnTheCpu", Kind, AdamKind, AdamWKind) {
  CompareWithForLoop<Kind>(torch::kCPU);
}

TEST_CASE_TEMPLATE("AdamCheckpointsMoveBetweenImplementations", Kind, AdamKind, AdamWKind) {
  const Params initial = MakeParams(torch::kCPU);
  const auto o = Options<Kind>(0.1, /*amsgrad=*/true);
  Params ref_params = Copy(initial);
  auto ref = Make<Kind>(ref_params, o, OptimizerImplementation::kForLoop);
  Run(*ref, ref_params, 0, 6);
  std::vector<OptimizerImplementation> all = {OptimizerImplementation::kForLoop,
                                              OptimizerImplementation::kAuto};
  for (OptimizerImplementation i : Candidates(torch::kCPU)) all.push_back(i);
  for (OptimizerImplementation writer : all) {
    for (OptimizerImplementation reader : all) {
      CAPTURE(config::ToString(writer));
      CAPTURE(config::ToString(reader));
      // Three steps under `writer`, saved; the parameters and the state move to a fresh
      // optimizer of `reader`, which takes three more.
      Params params = Copy(initial);
      auto first = Make<Kind>(params, o, writer);
      Run(*first, params, 0, 3);
      const std::string bytes = Save(*first);
      Params resumed = Copy(params);
      auto second = Make<Kind>(resumed, o, reader);
      Load(*second, bytes);
      Run(*second, resumed, 3, 6);
      CheckSame<Kind>(*ref, ref_params, *second, resumed);
    }
  }
}

TEST_CASE_TEMPLATE("AutoOnTheCpuIsTheForLoopBitForBit", Kind, AdamKind, AdamWKind) {
  const Params initial = MakeParams(torch::kCPU);
  for (bool amsgrad : {false, true}) {
    const auto o = Options<Kind>(0.1, amsgrad);
    Params ref_params = Copy(initial), params = Copy(initial);
    auto ref = Make<Kind>(ref_params, o, OptimizerImplementation::kForLoop);
    auto optimizer = Make<Kind>(params, o, OptimizerImplementation::kAuto);
    CHECK(AdamImplementationOf(*optimizer) == OptimizerImplementation::kAuto);
    Run(*ref, ref_params, 0, 4);
    Run(*optimizer, params, 0, 4);
    CheckSame<Kind>(*ref, ref_params, *optimizer, params, /*exact=*/true);
  }
}

TEST_CASE("AdamStepEvaluatesTheClosureWithGradients") {
  Params params = MakeParams(torch::kCPU);
  auto optimizer =
      Make<AdamKind>(params, Options<AdamKind>(0.0, false), OptimizerImplementation::kForeach);
  const torch::Tensor before = params.first[0].detach().clone();
  const torch::Tensor loss = optimizer->step([&] {
    optimizer->zero_grad();
    torch::Tensor l = params.first[0].square().sum();
    l.backward();
    return l;
  });
  CHECK(loss.defined());
  CHECK(!torch::equal(before, params.first[0]));
  CHECK(compat::FindParamState(*optimizer, params.first[1]) == nullptr);  // no gradient
}

TEST_CASE("MakeOptimizerStepsAsOptimizerImplementationSays") {
  std::vector<torch::Tensor> params = {torch::randn({3, 2}).requires_grad_()};
  config::OptimizerConfig c;
  c.type = config::OptimizerType::kAdam;
  for (OptimizerImplementation i :
       {OptimizerImplementation::kAuto, OptimizerImplementation::kForLoop,
        OptimizerImplementation::kForeach}) {
    c.implementation = i;
    auto made = MakeOptimizer(c, params);
    REQUIRE(made.ok());
    CHECK(AdamImplementationOf(**made) == i);
    CHECK(dynamic_cast<optim::Adam*>(made->get()) != nullptr);
    // ZeRO's shard optimizers step as the prepared one.
    auto like = AdamLike(**made, {});
    REQUIRE(like.ok());
    CHECK(AdamImplementationOf(**like) == i);
    CHECK(dynamic_cast<optim::AdamW*>(like->get()) == nullptr);
  }
  c.type = config::OptimizerType::kAdamW;
  c.implementation = OptimizerImplementation::kForeach;
  auto adamw = MakeOptimizer(c, params);
  REQUIRE(adamw.ok());
  CHECK(dynamic_cast<MultiTensorAdamW*>(adamw->get()) != nullptr);
  CHECK(dynamic_cast<MultiTensorAdamW*>(AdamLike(**adamw, {})->get()) != nullptr);
  // fused: built where this LibTorch has fused kernels for the CPU or for CUDA (where `train`
  // moves the model), refused at creation, naming the key, where it has none.
  c.implementation = OptimizerImplementation::kFused;
  auto fused = MakeOptimizer(c, params);
  if (compat::HasFusedAdam(c10::DeviceType::CPU) || compat::HasFusedAdam(c10::DeviceType::CUDA)) {
    REQUIRE(fused.ok());
    CHECK(AdamImplementationOf(**fused) == OptimizerImplementation::kFused);
  } else {
    CHECK(fused.status().code() == Status::Code::kInvalidConfig);
    CHECK(fused.status().message() ==
          "train.optimizer.implementation: fused: LibTorch " + compat::LibTorchVersion() +
              " has no fused Adam/AdamW kernels for cpu tensors (CUDA has them from LibTorch "
              "2.0, the CPU from 2.4); use foreach or for_loop");
  }
}

TEST_CASE("FusedAdamKernelsAreWhereThisLibTorchHasThem") {
  // CPU kernels arrived in 2.4; a CUDA build has them for CUDA from 2.0.
  const bool cpu_expected =
      TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4);
  CHECK(compat::HasFusedAdam(c10::DeviceType::CPU) == cpu_expected);
  if (TORCH_VERSION_MAJOR < 2) CHECK(!compat::HasFusedAdam(c10::DeviceType::CUDA));
}

// Runs where a GPU is (scripts/bench/gpu runs this binary there). Without one, doctest lists it
// as skipped; not through the skip protocol, which would mark the whole binary skipped in CTest.
TEST_CASE("ForeachAndFusedAdamMatchTorchOptimOnAGpu" *
          doctest::skip(!torch::cuda::is_available())) {
  CompareWithForLoop<AdamKind>(torch::kCUDA);
  CompareWithForLoop<AdamWKind>(torch::kCUDA);
  // auto takes foreach on CUDA: within the tolerance, not necessarily bit for bit.
  const Params initial = MakeParams(torch::kCUDA);
  const auto o = Options<AdamWKind>(0.1, false);
  Params ref_params = Copy(initial), params = Copy(initial);
  auto ref = Make<AdamWKind>(ref_params, o, OptimizerImplementation::kForLoop);
  auto optimizer = Make<AdamWKind>(params, o, OptimizerImplementation::kAuto);
  Run(*ref, ref_params, 0, 5);
  Run(*optimizer, params, 0, 5);
  CheckSame<AdamWKind>(*ref, ref_params, *optimizer, params);
}

}  // namespace
}  // namespace launch::trainer
