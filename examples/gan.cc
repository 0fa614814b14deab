// A small GAN on Fashion-MNIST (pytorch/examples' DCGAN loop, with MLPs and, like its models,
// BatchNorm): two models, two optimizers and alternating steps, data-parallel over the
// processes `launch` starts:
//
//   launch --num_processes 2 -- ./gan --max_steps 300
//
// Each model is prepared with its own optimizer, so each gets its own gradient all-reduce
// (reducer). Backward(loss) finds the models a loss reaches in its autograd graph and averages
// exactly their gradients over the processes:
//   - the discriminator's loss on real and generated images (the latter detached) reaches only
//     the discriminator: Step(*disc) steps it;
//   - the generator's loss goes through the (just stepped) discriminator: it reaches both, and
//     Step(*gen) steps the generator. The discriminator keeps that gradient until ZeroGrad(*disc)
//     at the start of its next step, as netD.zero_grad() does in PyTorch's loop.
// BatchNorm normalises with each process's own batch statistics; its running statistics are
// rank 0's before each synchronised forward, as PyTorch's DDP (broadcast_buffers) makes them.
// SetSeed(seed, /*device_specific=*/true) gives each process its own noise stream, as
// accelerate's set_seed(device_specific=True).
//
// Flags: --max_steps S (300), --data DIR (the IDX files; Debian's dataset-fashion-mnist by
// default), --checkpoint DIR (save the state of both models every 100 steps and resume from
// it). Prints the losses every 50 steps, then one `checksum rank=R gen=... disc=...` line per
// process (a hash of each model's parameter bytes: equal on every rank, bit for bit) and
// `final loss_d=... loss_g=...`.

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "base/status.h"
#include "common.h"
#include "config/train_config.h"
#include "trainer_runtime/api/accelerator.h"
#include "trainer_runtime/data/idx.h"

namespace {

using launch::Status;
using launch::trainer::Accelerator;

constexpr int64_t kNoise = 64, kPixels = 28 * 28, kHidden = 256;

// Image from noise: pixels in [-1, 1] (tanh), the scale the images are normalised to below.
torch::nn::Sequential Generator() {
  return torch::nn::Sequential(
      torch::nn::Linear(kNoise, kHidden), torch::nn::BatchNorm1d(kHidden),
      torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)),
      torch::nn::Linear(kHidden, kHidden),
      torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)),
      torch::nn::Linear(kHidden, kPixels), torch::nn::Tanh());
}

// Real or generated: one logit.
torch::nn::Sequential Discriminator() {
  return torch::nn::Sequential(
      torch::nn::Flatten(), torch::nn::Linear(kPixels, kHidden), torch::nn::BatchNorm1d(kHidden),
      torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)),
      torch::nn::Linear(kHidden, 1));
}

torch::Tensor Bce(const torch::Tensor& logits, double target) {
  return torch::nn::functional::binary_cross_entropy_with_logits(logits,
                                                                 torch::full_like(logits, target));
}

// FNV-1a over the parameters' bytes: equal exactly when every parameter is equal bit for bit.
uint64_t Checksum(torch::nn::Module& model) {
  uint64_t h = 1469598103934665603ull;
  for (const torch::Tensor& p : model.parameters()) {
    const torch::Tensor t = p.detach().contiguous();
    const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
    for (int64_t i = 0; i < t.numel() * static_cast<int64_t>(t.element_size()); ++i)
      h = (h ^ bytes[i]) * 1099511628211ull;
  }
  return h;
}

Status Run(int argc, char** argv) {
  LAUNCH_ASSIGN_OR_RETURN(examples::Flags flags,
                          examples::Flags::Parse(argc, argv, {"max_steps", "data", "checkpoint"}));
  LAUNCH_ASSIGN_OR_RETURN(int64_t max_steps, flags.GetInt("max_steps", 300));

  launch::config::TrainConfig options;
  options.parallel.mode = launch::config::ParallelMode::kDdp;
  options.batch_size = 64;  // per process
  LAUNCH_ASSIGN_OR_RETURN(std::unique_ptr<Accelerator> accel, Accelerator::Create(options));

  // Pixels scaled to [-1, 1], the generator's range.
  launch::trainer::IdxOptions scale;
  scale.mean = 0.5;
  scale.std = 0.5;
  LAUNCH_ASSIGN_OR_RETURN(
      launch::trainer::IdxDataset train,
      launch::trainer::IdxDataset::Load(flags.Get("data", launch::trainer::kFashionMnistDir),
                                        launch::trainer::IdxSplit::kTrain, scale));

  // Both models from the same seed on every process (Prepare would broadcast rank 0's anyway).
  accel->SetSeed(options.seed);
  auto gen = Generator();
  auto disc = Discriminator();
  auto adam = [](torch::nn::Module& m) {
    return std::make_shared<torch::optim::Adam>(
        m.parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}));
  };
  LAUNCH_RETURN_IF_ERROR(accel->Prepare(gen.ptr(), adam(*gen)));
  LAUNCH_RETURN_IF_ERROR(accel->Prepare(disc.ptr(), adam(*disc)));
  auto loader = accel->PrepareDataLoader(std::move(train), options.batch_size);
  const std::string checkpoint = flags.Get("checkpoint", "");
  if (!checkpoint.empty()) {
    LAUNCH_ASSIGN_OR_RETURN(bool resumed, accel->LoadState(checkpoint));
    if (resumed) accel->Print("gan: resumed at step " + std::to_string(accel->step()));
  }
  // Each process draws its own noise (and a resume continues from the restored generator
  // state, which LoadState brought back).
  if (accel->step() == 0) accel->SetSeed(options.seed, /*device_specific=*/true);
  accel->Print("gan: " + std::to_string(accel->world_size()) + " process(es), two models");

  double loss_d = 0, loss_g = 0;
  while (accel->step() < max_steps) {
    torch::data::Example<> batch = loader.Next();
    accel->Accumulate();  // one per iteration: both models' steps belong to it
    const torch::Tensor real = batch.data;
    const torch::Tensor fake = gen->forward(torch::randn({real.size(0), kNoise}));

    // Discriminator: real images are 1, generated ones 0 (detached: no gradient for gen).
    accel->ZeroGrad(*disc);
    torch::Tensor d_loss = Bce(disc->forward(real), 1) + Bce(disc->forward(fake.detach()), 0);
    accel->Backward(d_loss);
    accel->Step(*disc);

    // Generator: make the discriminator say 1.
    torch::Tensor g_loss = Bce(disc->forward(fake), 1);
    accel->Backward(g_loss);
    accel->Step(*gen);

    if (accel->step() % 50 == 0 || accel->step() == max_steps) {
      loss_d = accel->Mean(d_loss.item<double>());  // collective: every process, same step
      loss_g = accel->Mean(g_loss.item<double>());
      accel->Print("step " + std::to_string(accel->step()) + " loss_d " +
                   examples::Fixed(loss_d, 4) + " loss_g " + examples::Fixed(loss_g, 4));
    }
    if (!checkpoint.empty() && accel->step() % 100 == 0)
      LAUNCH_RETURN_IF_ERROR(accel->SaveState(checkpoint));
  }
  LAUNCH_RETURN_IF_ERROR(accel->Finish());
  // Every process prints its own line: the replicas of each model must agree bit for bit.
  char line[160];
  std::snprintf(line, sizeof line, "checksum rank=%d gen=%016llx disc=%016llx", accel->rank(),
                static_cast<unsigned long long>(Checksum(*gen)),
                static_cast<unsigned long long>(Checksum(*disc)));
  std::printf("%s\n", line);
  std::fflush(stdout);
  accel->Barrier();  // the checksum lines come before the final one
  accel->Print("final loss_d=" + examples::Fixed(loss_d, 4) +
               " loss_g=" + examples::Fixed(loss_g, 4));
  return Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  Status status = Run(argc, argv);
  if (!status.ok()) {
    std::cerr << "gan: " << status.ToString() << "\n";
    return 1;
  }
  return 0;
}
