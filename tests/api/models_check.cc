// A user's program with several models on the public API (accelerator.h), for
// tests/api/test_models.py. Modes (distributed under `launch`, or --reference: the same training
// in plain LibTorch in one process on the global batch). Parameters are written as raw float32
// to --out (rank R appends .R).
//
//   models_check --mode gan [--steps S] --out FILE        two models, two optimizers, alternating
//   models_check --mode gan --reference --world W --out FILE
//     --batchnorm: both models with a BatchNorm1d (cpp/dcgan's models have BatchNorm2d)
//   models_check --mode gan_no_accumulate                 the GAN loop without Accumulate(): error
//   models_check --mode nosync [--steps S] --out FILE     NoSync(model) then a synced micro-batch
//   models_check --mode nosync --reference --world W --out FILE
//   models_check --mode resume --ckpt DIR --out FILE [--die_at K]   EMA model + counter
//                                                         registered; rank 1 SIGKILLs itself
//                                                         after the save of step K (first attempt)
//   models_check --mode loadstep --ckpt DIR               checkpoint_keep 3, LoadState(dir, step)
//   models_check --mode order --log FILE                  MainProcessFirst, SetSeed
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "tests/api/check_util.h"
#include "trainer_runtime/api/accelerator.h"
#include "trainer_runtime/data/sampler.h"

namespace {

using launch::trainer::Accelerator;
using launch::trainer::check::WriteFloats;

constexpr int64_t kSamples = 512, kFeatures = 6, kNoise = 4, kBatch = 8;
constexpr uint64_t kSeed = 5;

class Blobs : public torch::data::datasets::Dataset<Blobs> {
 public:
  Blobs() {
    auto gen = at::detail::createCPUGenerator(77);
    x_ = torch::randn({kSamples, kFeatures}, gen);
    y_ = torch::randint(0, 3, {kSamples}, gen);
  }
  torch::data::Example<> get(size_t i) override { return {x_[i], y_[i]}; }
  c10::optional<size_t> size() const override { return kSamples; }
  torch::Tensor x_, y_;
};

struct Flags {
  std::string mode = "gan", out, ckpt, log;
  int steps = 10, world = 1, die_at = 0;
  bool reference = false, batchnorm = false;
};

// With `batchnorm`, a BatchNorm1d after the first layer: statistics of each rank's own rows,
// running statistics as buffers, which DDP makes rank 0's before each synchronised forward.
torch::nn::Sequential Generator(bool batchnorm) {
  torch::nn::Sequential net(torch::nn::Linear(kNoise, 16));
  if (batchnorm) net->push_back(torch::nn::BatchNorm1d(16));
  net->push_back(torch::nn::Tanh());
  net->push_back(torch::nn::Linear(16, kFeatures));
  return net;
}
torch::nn::Sequential Discriminator(bool batchnorm) {
  torch::nn::Sequential net(torch::nn::Linear(kFeatures, 16));
  if (batchnorm) net->push_back(torch::nn::BatchNorm1d(16));
  net->push_back(torch::nn::Tanh());
  net->push_back(torch::nn::Linear(16, 1));
  return net;
}
torch::nn::Sequential Classifier() {
  return torch::nn::Sequential(torch::nn::Linear(kFeatures, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 3));
}
std::shared_ptr<torch::optim::SGD> Sgd(torch::nn::Module& m) {
  return std::make_shared<torch::optim::SGD>(m.parameters(),
                                             torch::optim::SGDOptions(0.05).momentum(0.9));
}

std::vector<torch::Tensor> Concat(torch::nn::Module& a, torch::nn::Module& b) {
  std::vector<torch::Tensor> out = a.parameters();
  for (auto& p : b.parameters()) out.push_back(p);
  return out;
}

// The global batch of micro-batch `micro` (all `world` ranks' rows, rank after rank) and rank
// `rank`'s part of it, as the prepared loader deals epoch 0 (sampler.h).
torch::Tensor Rows(int64_t micro, int64_t rank, int64_t world) {
  static const std::vector<int64_t> perm =
      launch::trainer::ShardedSampler::Permutation(kSamples, kSeed, 0);
  std::vector<int64_t> r;
  for (int64_t i = 0; i < kBatch; ++i) r.push_back(perm[(micro * kBatch + i) * world + rank]);
  return torch::tensor(r, torch::kLong);
}
torch::Tensor GlobalRows(int64_t micro, int64_t world) {
  std::vector<torch::Tensor> parts;
  for (int64_t r = 0; r < world; ++r) parts.push_back(Rows(micro, r, world));
  return torch::cat(parts);
}
// The generator's input of `step`: the global batch's rows, rank r's are rows [r*B, (r+1)*B).
torch::Tensor Noise(int64_t step, int64_t world) {
  auto gen = at::detail::createCPUGenerator(1000 + static_cast<uint64_t>(step));
  return torch::randn({world * kBatch, kNoise}, gen);
}
torch::Tensor Bce(const torch::Tensor& logits, double target) {
  return torch::nn::functional::binary_cross_entropy_with_logits(logits,
                                                                 torch::full_like(logits, target));
}

std::unique_ptr<Accelerator> MakeAccelerator(launch::config::TrainConfig options) {
  options.seed = kSeed;
  options.batch_size = kBatch;
  auto created = Accelerator::Create(options);
  if (!created.ok()) {
    std::fprintf(stderr, "models_check: %s\n", created.status().message().c_str());
    std::exit(2);
  }
  return std::move(created).value();
}

void Require(const launch::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "models_check: %s: %s\n", what, s.message().c_str());
  std::exit(2);
}

// --- gan: the discriminator steps on real and detached fake rows, then the generator through
// the (just stepped) discriminator. Each model's replicas must stay bit-identical. The reference
// runs each rank's rows through the models on their own (BatchNorm's statistics are a rank's)
// and averages the ranks' losses, which is what averaging their gradients computes.
int GanReference(const Flags& f) {
  Blobs data;
  torch::manual_seed(kSeed);
  auto g = Generator(f.batchnorm);
  auto d = Discriminator(f.batchnorm);
  auto opt_g = Sgd(*g), opt_d = Sgd(*d);
  for (int step = 0; step < f.steps; ++step) {
    const torch::Tensor noise = Noise(step, f.world);
    std::vector<torch::Tensor> fakes;
    for (int64_t r = 0; r < f.world; ++r)
      fakes.push_back(g->forward(noise.slice(0, r * kBatch, (r + 1) * kBatch)));
    opt_d->zero_grad();
    torch::Tensor d_loss = torch::zeros({});
    for (int64_t r = 0; r < f.world; ++r) {
      auto real = data.x_.index_select(0, Rows(step, r, f.world));
      d_loss = d_loss + Bce(d->forward(real), 1) + Bce(d->forward(fakes[r].detach()), 0);
    }
    (d_loss / f.world).backward();
    opt_d->step();
    opt_g->zero_grad();
    torch::Tensor g_loss = torch::zeros({});
    for (int64_t r = 0; r < f.world; ++r) g_loss = g_loss + Bce(d->forward(fakes[r]), 1);
    (g_loss / f.world).backward();
    opt_g->step();
  }
  WriteFloats(f.out, Concat(*g, *d));
  return 0;
}

int Gan(const Flags& f, bool accumulate) {
  auto accel = MakeAccelerator({});
  // Ranks start from different weights (rank 0 from the reference's): Prepare broadcasts rank
  // 0's, for each model.
  torch::manual_seed(kSeed + static_cast<uint64_t>(accel->rank()));
  auto g = Generator(f.batchnorm);
  auto d = Discriminator(f.batchnorm);
  Require(accel->Prepare(g.ptr(), Sgd(*g)), "Prepare(G)");
  Require(accel->Prepare(d.ptr(), Sgd(*d)), "Prepare(D)");
  auto loader = accel->PrepareDataLoader(Blobs(), kBatch);
  const int64_t w = accel->world_size(), r = accel->rank();
  for (int step = 0; step < f.steps; ++step) {
    auto batch = loader.Next();
    if (accumulate) accel->Accumulate();
    auto fake = g->forward(Noise(step, w).slice(0, r * kBatch, (r + 1) * kBatch));
    accel->ZeroGrad(*d);  // what the generator's loss left in the discriminator
    accel->Backward(Bce(d->forward(batch.data), 1) + Bce(d->forward(fake.detach()), 0));
    if (!accel->Step(*d)) return 3;
    // With BatchNorm: this backward syncs the discriminator's buffers after the forward below
    // saved them (cpp/dcgan's loop aborted here at 2 ranks).
    accel->Backward(Bce(d->forward(fake), 1));
    if (!accel->Step(*g)) return 3;
  }
  Require(accel->Finish(), "Finish");
  WriteFloats(f.out + "." + std::to_string(r), Concat(*g, *d));
  accel->Print("steps=" + std::to_string(accel->step()));
  return 0;
}

// --- nosync: every step is one micro-batch inside NoSync(model) (gradients stay local, Step does
// not step) and one outside (the sum is all-reduced and stepped): the gradient of the two
// micro-batches' global mean losses.
int NoSyncReference(const Flags& f) {
  Blobs data;
  torch::manual_seed(kSeed);
  auto net = Classifier();
  auto opt = Sgd(*net);
  for (int step = 0; step < f.steps; ++step) {
    opt->zero_grad();
    for (int m = 0; m < 2; ++m) {
      auto idx = GlobalRows(2 * step + m, f.world);
      torch::nn::functional::cross_entropy(net->forward(data.x_.index_select(0, idx)),
                                           data.y_.index_select(0, idx))
          .backward();
    }
    opt->step();
  }
  WriteFloats(f.out, net->parameters());
  return 0;
}

int NoSync(const Flags& f) {
  auto accel = MakeAccelerator({});
  torch::manual_seed(kSeed);
  auto net = Classifier();
  Require(accel->Prepare(net.ptr(), Sgd(*net)), "Prepare");
  auto loader = accel->PrepareDataLoader(Blobs(), kBatch);
  auto loss = [&](const torch::data::Example<>& b) {
    return torch::nn::functional::cross_entropy(net->forward(b.data), b.target);
  };
  accel->TakeCommStats();
  int64_t allreduces = 0;
  for (int step = 0; step < f.steps; ++step) {
    {
      auto local = accel->NoSync(*net);
      auto batch = loader.Next();
      accel->Accumulate();
      accel->Backward(loss(batch));
      if (accel->Step()) return 3;  // inside NoSync: never steps
    }
    auto batch = loader.Next();
    accel->Accumulate();
    accel->Backward(loss(batch));
    if (!accel->Step()) return 3;
    allreduces += accel->TakeCommStats().allreduces;
  }
  Require(accel->Finish(), "Finish");
  WriteFloats(f.out + "." + std::to_string(accel->rank()), net->parameters());
  accel->Print("allreduces_per_step=" + std::to_string(static_cast<double>(allreduces) / f.steps) +
               " buckets=" + std::to_string(accel->num_buckets()));
  return 0;
}

// --- resume: an EMA copy of the model and a counter, registered for checkpointing, through a
// kill and a restart: the result equals an undisturbed run's bit for bit.
struct Counter {
  int64_t value = 0;
  void save(torch::serialize::OutputArchive& a) const { a.write("value", torch::tensor(value)); }
  void load(torch::serialize::InputArchive& a) {
    torch::Tensor t;
    a.read("value", t);
    value = t.item<int64_t>();
  }
};

int Resume(const Flags& f) {
  launch::config::TrainConfig options;
  auto accel = MakeAccelerator(options);
  torch::manual_seed(kSeed);
  auto net = Classifier();
  auto ema = Classifier();
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < ema->parameters().size(); ++i)
      ema->parameters()[i].copy_(net->parameters()[i]);
  }
  Counter counter;
  Require(accel->Prepare(net.ptr(), Sgd(*net)), "Prepare");
  accel->RegisterForCheckpointing(*ema);
  accel->RegisterForCheckpointing(counter);
  auto loader = accel->PrepareDataLoader(Blobs(), kBatch);
  auto resumed = accel->LoadState(f.ckpt);
  Require(resumed.status(), "LoadState");
  if (*resumed)
    accel->Print("resumed at step " + std::to_string(accel->step()) +
                 " counter=" + std::to_string(counter.value));
  while (accel->step() < f.steps) {
    auto batch = loader.Next();
    accel->Accumulate();
    accel->Backward(torch::nn::functional::cross_entropy(net->forward(batch.data), batch.target));
    if (!accel->Step()) return 3;
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < ema->parameters().size(); ++i)
        ema->parameters()[i].mul_(0.75).add_(net->parameters()[i], 0.25);
    }
    counter.value += accel->step() * accel->step();
    Require(accel->SaveState(f.ckpt), "SaveState");
    if (!*resumed && accel->rank() == 1 && accel->step() == f.die_at) ::raise(SIGKILL);
  }
  Require(accel->Finish(), "Finish");
  std::vector<torch::Tensor> out = Concat(*net, *ema);
  out.push_back(torch::tensor(static_cast<float>(counter.value)));
  WriteFloats(f.out + "." + std::to_string(accel->rank()), out);
  return 0;
}

// --- loadstep: three checkpoints kept; LoadState(dir, step) restores the chosen one.
int LoadStep(const Flags& f) {
  launch::config::TrainConfig options;
  options.checkpoint_keep = 3;
  auto accel = MakeAccelerator(options);
  torch::manual_seed(kSeed);
  auto net = Classifier();
  Counter counter;
  Require(accel->Prepare(net.ptr(), Sgd(*net)), "Prepare");
  accel->RegisterForCheckpointing(counter);
  auto loader = accel->PrepareDataLoader(Blobs(), kBatch);
  std::vector<std::vector<torch::Tensor>> after(7);
  while (accel->step() < 6) {
    auto batch = loader.Next();
    accel->Accumulate();
    accel->Backward(torch::nn::functional::cross_entropy(net->forward(batch.data), batch.target));
    accel->Step();
    counter.value = accel->step();
    for (auto& p : net->parameters()) after[accel->step()].push_back(p.detach().clone());
    Require(accel->SaveState(f.ckpt), "SaveState");
  }
  std::string steps;
  for (int64_t s : Accelerator::SavedSteps(f.ckpt)) steps += " " + std::to_string(s);
  accel->Print("saved steps:" + steps);
  auto loaded = accel->LoadState(f.ckpt, 4);
  Require(loaded.status(), "LoadState(dir, 4)");
  bool same = accel->step() == 4 && counter.value == 4;
  for (size_t i = 0; i < after[4].size(); ++i)
    same = same && net->parameters()[i].equal(after[4][i]);
  accel->Print(std::string("step 4 restored: ") + (same ? "yes" : "no"));
  auto missing = accel->LoadState(f.ckpt, 2);
  accel->Print("step 2: " + missing.status().ToString());
  // Registration order is the identity: one more object than the checkpoint holds is refused.
  Counter extra;
  accel->RegisterForCheckpointing(extra);
  auto mismatch = accel->LoadState(f.ckpt);
  accel->Print("extra object: " + mismatch.status().ToString());
  Require(accel->Finish(), "Finish");
  return 0;
}

// --- order: MainProcessFirst's block on rank 0 ends before any other rank's begins.
void Append(const std::string& path, const std::string& line) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0 || ::write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size()))
    std::exit(4);
  ::close(fd);
}

int Order(const Flags& f) {
  auto accel = MakeAccelerator({});
  const std::string r = std::to_string(accel->rank());
  for (const char* which : {"main", "local"}) {
    auto first =
        std::string(which) == "main" ? accel->MainProcessFirst() : accel->LocalMainProcessFirst();
    Append(f.log, std::string(which) + " enter " + r + "\n");
    // Work inside the block (a data set built once), so that a rank let in early would
    // write its line before this one's "leave".
    auto x = torch::randn({256, 256});
    for (int i = 0; i < 20; ++i) x = torch::tanh(x.matmul(x) / 256);
    Append(f.log, std::string(which) + " leave " + r + "\n");
  }
  accel->SetSeed(7);
  const double same = torch::rand({1}).item<double>();
  accel->SetSeed(7, /*device_specific=*/true);
  const double own = torch::rand({1}).item<double>();
  auto all = accel->Gather(torch::tensor({same, own}, torch::kDouble).reshape({1, 2}));
  std::string line = "seeds";
  for (int64_t i = 0; i < all.size(0); ++i)
    line += " " + std::to_string(all[i][0].item<double>()) + "/" +
            std::to_string(all[i][1].item<double>());
  accel->Print(line);
  return accel->Finish().ok() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{"models_check: several models on the public trainer API (tests/api/test_models.py)",
               "models_check"};
  launch::trainer::check::UseLastValue(app);
  app.add_option("--mode", f.mode, "gan|gan_no_accumulate|nosync|resume|loadstep|order");
  app.add_option("--out", f.out, "the final parameters, raw float32 (rank R appends .R)");
  app.add_option("--ckpt", f.ckpt, "the checkpoint directory (resume, loadstep)");
  app.add_option("--log", f.log, "the log file (order)");
  app.add_option("--steps", f.steps, "optimizer steps");
  app.add_option("--world", f.world, "ranks to emulate (--reference)");
  app.add_option("--die_at", f.die_at,
                 "rank 1 SIGKILLs itself after the save of this step (resume)");
  app.add_flag("--reference", f.reference, "plain LibTorch in one process");
  app.add_flag("--batchnorm", f.batchnorm, "gan: a BatchNorm1d in both models");
  if (int code = launch::trainer::check::ParseFlags(app, argc, argv); code >= 0) return code;
  if (f.mode == "gan") return f.reference ? GanReference(f) : Gan(f, /*accumulate=*/true);
  if (f.mode == "gan_no_accumulate") return Gan(f, /*accumulate=*/false);
  if (f.mode == "nosync") return f.reference ? NoSyncReference(f) : NoSync(f);
  if (f.mode == "resume") return Resume(f);
  if (f.mode == "loadstep") return LoadStep(f);
  if (f.mode == "order") return Order(f);
  std::fprintf(stderr, "models_check: unknown mode %s\n", f.mode.c_str());
  return 2;
}
