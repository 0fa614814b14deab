// Unit tests for trainer_runtime. Multi-process behaviour (DDP numerics, no_sync, Local SGD,
// restarts) is tested with real processes in tests/trainer/.

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>

#include "trainer_runtime/atomic_file.h"
#include "trainer_runtime/checkpoint.h"
#include "trainer_runtime/data.h"
#include "trainer_runtime/env.h"
#include "trainer_runtime/model.h"
#include "trainer_runtime/sampler.h"
#include "trainer_runtime/schedule.h"

#include "trainer_runtime/doctest_torch.h"  // last: after every torch header

namespace launch::trainer {
namespace {

std::string TempDir() {
  char tmpl[] = "/tmp/trainer-test-XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  return tmpl;
}

TEST_CASE("ParseDistEnvDefaultsToSingleProcess") {
  auto env = ParseDistEnv({});
  REQUIRE(env.ok());
  CHECK(env->rank == 0);
  CHECK(env->world_size == 1);
  CHECK_FALSE(env->distributed());
}

TEST_CASE("ParseDistEnvReadsTorchrunContract") {
  auto env = ParseDistEnv({{"RANK", "1"},
                           {"WORLD_SIZE", "2"},
                           {"LOCAL_RANK", "1"},
                           {"MASTER_ADDR", "10.0.0.2"},
                           {"MASTER_PORT", "29600"},
                           {"TORCHELASTIC_RESTART_COUNT", "3"}});
  REQUIRE(env.ok());
  CHECK(env->rank == 1);
  CHECK(env->world_size == 2);
  CHECK(env->master_addr == "10.0.0.2");
  CHECK(env->master_port == 29600);
  CHECK(env->restart_count == 3);
  CHECK_FALSE(env->use_agent_store);
  auto agent = ParseDistEnv({{"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  REQUIRE(agent.ok());
  CHECK(agent->use_agent_store);
}

TEST_CASE("ParseDistEnvFallsBackToOpenMpi") {
  auto env = ParseDistEnv({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"}});
  REQUIRE(env.ok());
  CHECK(env->rank == 1);
  CHECK(env->world_size == 4);
}

TEST_CASE("ParseDistEnvRejectsBadValuesNamingTheVariable") {
  auto bad = ParseDistEnv({{"RANK", "x"}, {"WORLD_SIZE", "2"}});
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("RANK") != std::string::npos);
  auto too_big = ParseDistEnv({{"RANK", "2"}, {"WORLD_SIZE", "2"}});
  REQUIRE_FALSE(too_big.ok());
  CHECK(too_big.status().message().find("WORLD_SIZE 2") != std::string::npos);
  auto half = ParseDistEnv({{"RANK", "0"}});
  CHECK_FALSE(half.ok());
}

TEST_CASE("LearningRateWarmupThenCosineReachesFloor") {
  config::SchedulerConfig s;
  s.type = config::SchedulerType::kCosine;
  s.warmup_steps = 10;
  s.min_lr_ratio = 0.1;
  CHECK(LearningRate(s, 1.0, 0, 110) == doctest::Approx(0.1));
  CHECK(LearningRate(s, 1.0, 9, 110) == doctest::Approx(1.0));
  CHECK(LearningRate(s, 1.0, 10, 110) == doctest::Approx(1.0));
  CHECK(LearningRate(s, 1.0, 60, 110) == doctest::Approx(0.55));
  CHECK(LearningRate(s, 1.0, 110, 110) == doctest::Approx(0.1));
}

TEST_CASE("LearningRateLinearAndConstant") {
  config::SchedulerConfig s;
  CHECK(LearningRate(s, 0.5, 1000, 10) == 0.5);
  s.type = config::SchedulerType::kLinear;
  CHECK(LearningRate(s, 1.0, 0, 100) == doctest::Approx(1.0));
  CHECK(LearningRate(s, 1.0, 50, 100) == doctest::Approx(0.5));
}

TEST_CASE("SamplerShardsAreDisjointEqualAndReshuffledEachEpoch") {
  const int64_t n = 103;
  ShardedSampler r0(n, 0, 2, 10, 7), r1(n, 1, 2, 10, 7);
  CHECK(r0.batches_per_epoch() == 5);  // ceil(103/2)=52 per rank -> 5 full batches
  CHECK(r1.batches_per_epoch() == r0.batches_per_epoch());
  std::set<int64_t> seen;
  for (int64_t b = 0; b < r0.batches_per_epoch(); ++b) {
    for (int64_t i : r0.Batch(0, b)) CHECK(seen.insert(i).second);
    for (int64_t i : r1.Batch(0, b)) CHECK(seen.insert(i).second);
  }
  CHECK(seen.size() == 100);
  CHECK(r0.Batch(0, 0) != r0.Batch(1, 0));
  CHECK(r0.Batch(1, 0) == ShardedSampler(n, 0, 2, 10, 7).Batch(1, 0));
}

TEST_CASE("SamplerGlobalBatchEqualsSingleProcessBigBatch") {
  // The property the DDP numerics tests rely on.
  const int64_t n = 64;
  ShardedSampler big(n, 0, 1, 8, 3), a(n, 0, 2, 4, 3), b(n, 1, 2, 4, 3);
  for (int64_t k = 0; k < big.batches_per_epoch(); ++k) {
    std::multiset<int64_t> want, got;
    for (int64_t i : big.Batch(2, k)) want.insert(i);
    for (int64_t i : a.Batch(2, k)) got.insert(i);
    for (int64_t i : b.Batch(2, k)) got.insert(i);
    CHECK(want == got);
  }
}

TEST_CASE("WriteFileAtomicallyReplacesAndLeavesNoTempFile") {
  const std::string dir = TempDir();
  const std::string path = dir + "/sub/file.bin";
  REQUIRE(WriteFileAtomically(path, "first").ok());
  REQUIRE(WriteFileAtomically(path, "second").ok());
  auto read = ReadFile(path);
  REQUIRE(read.ok());
  CHECK(*read == "second");
  CHECK_FALSE(std::ifstream(path + ".tmp." + std::to_string(::getpid())).good());
  CHECK(ReadFile(dir + "/missing").status().code() == Status::Code::kNotFound);
}

TEST_CASE("SyntheticDataHasAFloorBelowGuessing") {
  config::TrainConfig cfg;
  cfg.data.samples = 2000;
  cfg.model.mlp_layers = {16, 32, 4};
  auto d = LoadDataset(cfg);
  REQUIRE(d.ok());
  CHECK(d->inputs.size(0) == 2000);
  CHECK(d->eval_indices.size() == 200);
  CHECK(d->train_indices.size() == 1800);
  CHECK(d->loss_floor > 0.05);
  CHECK(d->loss_floor < std::log(4.0) - 0.2);
  // Same teacher seed, same data.
  auto again = LoadDataset(cfg);
  CHECK(torch::equal(d->targets, again->targets));
}

TEST_CASE("CsvErrorsNameFileAndLine") {
  const std::string dir = TempDir();
  std::ofstream(dir + "/d.csv") << "a,b,label\n1,2,0\n3,x,1\n";
  config::TrainConfig cfg;
  cfg.data.type = config::DataType::kCsv;
  cfg.data.path = dir + "/d.csv";
  cfg.model.mlp_layers = {2, 2};
  auto d = LoadDataset(cfg);
  REQUIRE_FALSE(d.ok());
  CHECK(d.status().message().find("d.csv:3") != std::string::npos);
}

TEST_CASE("CsvLoadsFeaturesAndLabels") {
  const std::string dir = TempDir();
  {
    std::ofstream f(dir + "/d.csv");
    f << "x1,label,x2\n";
    for (int i = 0; i < 20; ++i) f << i << "," << (i % 3) << "," << -i << "\n";
  }
  config::TrainConfig cfg;
  cfg.data.type = config::DataType::kCsv;
  cfg.data.path = dir + "/d.csv";
  cfg.model.mlp_layers = {2, 8, 3};
  auto d = LoadDataset(cfg);
  REQUIRE(d.ok());
  CHECK(d->inputs.size(1) == 2);
  CHECK(d->targets.max().item<int64_t>() == 2);
}

TEST_CASE("TransformerIsCausal") {
  config::ModelConfig m;
  m.type = config::ModelType::kTransformer;
  m.d_model = 16;
  m.heads = 2;
  m.transformer_layers = 2;
  m.context = 8;
  torch::manual_seed(0);
  auto model = CreateModel(m);
  REQUIRE(model.ok());
  auto x = torch::randint(0, 256, {1, 8}, torch::kLong);
  auto y = x.clone();
  y[0][7] = (x[0][7].item<int64_t>() + 1) % 256;
  auto a = (*model)->Forward(x), b = (*model)->Forward(y);
  CHECK(a.sizes() == torch::IntArrayRef({1, 8, 256}));
  // Changing the last token cannot change predictions at earlier positions.
  CHECK(torch::allclose(a.narrow(1, 0, 7), b.narrow(1, 0, 7)));
  CHECK_FALSE(torch::allclose(a.narrow(1, 7, 1), b.narrow(1, 7, 1)));
}

TEST_CASE("CheckpointRoundTripRestoresModelOptimizerAndPosition") {
  const std::string dir = TempDir();
  config::ModelConfig m;
  m.mlp_layers = {4, 8, 2};
  torch::manual_seed(1);
  auto a = CreateModel(m);
  REQUIRE(a.ok());
  torch::optim::Adam opt_a((*a)->Parameters(), torch::optim::AdamOptions(0.1));
  auto loss = (*a)->Forward(torch::randn({3, 4})).sum();
  loss.backward();
  opt_a.step();
  TrainState s;
  s.step = 7;
  s.epoch = 2;
  s.batch_in_epoch = 5;
  REQUIRE(SaveModelState(dir + "/ck.pt", **a, opt_a).ok());
  REQUIRE(SaveRankState(dir + "/rank0.pt", s).ok());
  const torch::Tensor draw = torch::rand({4});

  torch::manual_seed(2);
  auto b = CreateModel(m);
  torch::optim::Adam opt_b((*b)->Parameters(), torch::optim::AdamOptions(0.1));
  REQUIRE(LoadModelState(dir + "/ck.pt", **b, opt_b).ok());
  auto restored = LoadRankState(dir + "/rank0.pt", /*restore_rng=*/true);
  REQUIRE(restored.ok());
  // The generator is back where it was when the rank file was written: the same draws follow.
  CHECK(torch::equal(torch::rand({4}), draw));

  CHECK(restored->step == 7);
  CHECK(restored->epoch == 2);
  CHECK(restored->batch_in_epoch == 5);
  auto pa = (*a)->Parameters(), pb = (*b)->Parameters();
  for (size_t i = 0; i < pa.size(); ++i) CHECK(torch::equal(pa[i], pb[i]));
  // Same optimizer state: one more identical step keeps them identical.
  opt_a.zero_grad();
  opt_b.zero_grad();
  (*a)->Forward(torch::ones({1, 4})).sum().backward();
  (*b)->Forward(torch::ones({1, 4})).sum().backward();
  opt_a.step();
  opt_b.step();
  for (size_t i = 0; i < pa.size(); ++i) CHECK(torch::equal(pa[i], pb[i]));

  // A torn temp file from a killed writer does not affect the checkpoint.
  std::ofstream(dir + "/ck.pt.tmp.99999") << "garbage";
  CHECK(LoadRankState(dir + "/rank0.pt", /*restore_rng=*/false).ok());
  // A model of another shape is refused with a message naming the tensor.
  config::ModelConfig other;
  other.mlp_layers = {4, 9, 2};
  auto c = CreateModel(other);
  torch::optim::Adam opt_c((*c)->Parameters(), torch::optim::AdamOptions(0.1));
  Status mismatch = LoadModelState(dir + "/ck.pt", **c, opt_c);
  REQUIRE_FALSE(mismatch.ok());
  CHECK(mismatch.message().find("param/fc0.weight") != std::string::npos);
}

}  // namespace
}  // namespace launch::trainer
