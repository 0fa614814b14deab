// Fashion-MNIST with your own model, optimizer and training loop, data-parallel over the
// processes that `launch` starts:
//
//   launch --num_processes 2 -- ./fashion_mnist_ddp --epochs 1
//
// Every process runs this same program. The Accelerator reads where it sits from the
// environment `launch` (or torchrun, srun, mpirun) sets, joins the others, and then:
//   - Prepare gives every process rank 0's initial weights and averages the gradients over
//     the processes during Backward (DDP), so all replicas take the same optimizer steps;
//   - PrepareDataLoader gives each process its own share of every epoch's shuffled batches;
//   - gradient accumulation: with gradient_accumulation_steps N, the gradients of N
//     micro-batches are summed locally and averaged over the processes once, on the last
//     micro-batch of each window, and Step() only steps then.
//
// Flags: --epochs E (1), --accumulate N (2), --max_steps S (stop after S optimizer steps; 0 =
// no limit), --data DIR (the IDX files; Debian's dataset-fashion-mnist by default),
// --config FILE.yaml (read the options from the file's `train:` section instead of the ones
// set in code below; --accumulate and --epochs still win), --save PATH (write the trained
// weights for PyTorch: torch.load(PATH) gives the state dict), --tensorboard DIR (the losses
// and the test accuracy as TensorBoard scalars, in DIR/tensorboard: `tensorboard --logdir DIR`).
// The last line printed is `test_accuracy=0.XXXX`.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "base/status.h"
#include "common.h"
#include "config/loader.h"
#include "config/train_config.h"
#include "trainer_runtime/api/accelerator.h"
#include "trainer_runtime/data/idx.h"

namespace {

using launch::Status;
using launch::trainer::Accelerator;
using launch::trainer::IdxDataset;
using launch::trainer::IdxSplit;

// The model: two convolutions and a linear classifier, a plain LibTorch module. The
// Accelerator needs nothing from it but its parameters (and, for ddp, that every process
// builds the same one).
struct NetImpl : torch::nn::Module {
  NetImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 5)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 5)))),
        fc(register_module("fc", torch::nn::Linear(32 * 4 * 4, 10))) {}

  torch::Tensor forward(torch::Tensor x) {            // [B, 1, 28, 28]
    x = torch::max_pool2d(torch::relu(conv1(x)), 2);  // [B, 16, 12, 12]
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);  // [B, 32, 4, 4]
    return fc(x.flatten(1));                          // [B, 10] logits
  }

  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc;
};
TORCH_MODULE(Net);

Status Run(int argc, char** argv) {
  LAUNCH_ASSIGN_OR_RETURN(examples::Flags flags,
                          examples::Flags::Parse(argc, argv,
                                                 {"epochs", "accumulate", "max_steps", "data",
                                                  "config", "save", "tensorboard"}));

  // 1. Options: the same struct `train` fills from a job file's `train:` section, so a YAML
  //    file means the same thing here. Set in code, or read from --config.
  launch::config::TrainConfig options;
  if (flags.Has("config")) {
    LAUNCH_ASSIGN_OR_RETURN(options, launch::config::LoadTrainConfigFile(flags.Get("config", "")));
  } else {
    options.parallel.mode = launch::config::ParallelMode::kDdp;
    options.batch_size = 64;                  // per process and micro-batch
    options.gradient_accumulation_steps = 2;  // a step = 2 micro-batches x 2 processes x 64
    options.optimizer.lr = 1e-3;
    options.log_every = 50;  // optimizer steps between loss lines
  }
  LAUNCH_ASSIGN_OR_RETURN(int64_t accumulate,
                          flags.GetInt("accumulate", options.gradient_accumulation_steps));
  options.gradient_accumulation_steps = static_cast<int>(accumulate);
  LAUNCH_ASSIGN_OR_RETURN(int64_t epochs,
                          flags.GetInt("epochs", options.epochs > 0 ? options.epochs : 1));
  LAUNCH_ASSIGN_OR_RETURN(int64_t max_steps, flags.GetInt("max_steps", options.max_steps));
  const bool tensorboard = flags.Has("tensorboard");
  if (tensorboard) options.output_dir = flags.Get("tensorboard", "");  // Log writes under it

  const launch::config::ParallelMode mode = options.parallel.mode;
  if (mode == launch::config::ParallelMode::kDp || options.parallel.pipelined()) {
    // dp runs replicas on threads (ForwardBackwardAs, accelerator.h) and pipeline cuts the
    // model into stages (see pipeline.cc): both need a different loop from the one below.
    return Status::InvalidConfig(
        std::string("train.parallel.mode: this example runs none or ddp, not ") +
        launch::config::ToString(mode));
  }

  // 2. Join the other processes. InvalidConfig names a bad option (by its train.* key).
  LAUNCH_ASSIGN_OR_RETURN(std::unique_ptr<Accelerator> accel, Accelerator::Create(options));

  // 3. Data: every process reads the files; the loader hands each its own shard.
  const std::string dir = flags.Get("data", launch::trainer::kFashionMnistDir);
  LAUNCH_ASSIGN_OR_RETURN(IdxDataset train, IdxDataset::Load(dir, IdxSplit::kTrain));
  LAUNCH_ASSIGN_OR_RETURN(IdxDataset test, IdxDataset::Load(dir, IdxSplit::kTest));

  // 4. Model and optimizer are yours; Prepare broadcasts rank 0's weights and sets up the
  //    gradient all-reduce. Seeding first makes the run reproducible.
  torch::manual_seed(options.seed);
  Net net;
  auto optimizer = std::make_shared<torch::optim::Adam>(
      net->parameters(), torch::optim::AdamOptions(options.optimizer.lr));
  LAUNCH_RETURN_IF_ERROR(accel->Prepare(net.ptr(), optimizer));
  accel->Print("fashion_mnist_ddp: " + std::to_string(accel->world_size()) + " process(es), " +
               accel->mode_name() + ", accumulating " + std::to_string(accumulate) +
               " micro-batch(es)");
  auto loader = accel->PrepareDataLoader(std::move(train), options.batch_size);

  // 5. The loop. Accumulate() before the forward pass decides whether this micro-batch
  //    synchronises; Backward() divides the loss by N and, on the last micro-batch of a
  //    window, averages the gradients over the processes; Step() steps only then.
  bool done = false;
  for (int64_t epoch = accel->epoch(); epoch < epochs && !done; ++epoch) {
    auto start = std::chrono::steady_clock::now();
    for (torch::data::Example<>& batch : loader.Epoch(epoch)) {
      accel->Accumulate();
      torch::Tensor loss =
          torch::nn::functional::cross_entropy(net->forward(batch.data), batch.target);
      accel->Backward(loss);
      if (!accel->Step()) continue;  // inside an accumulation window: no step yet
      if (options.log_every > 0 && accel->step() % options.log_every == 0) {
        // Mean is a collective: every process reaches this line at the same step.
        double mean_loss = accel->Mean(loss.item<double>());
        accel->Print("epoch " + std::to_string(epoch + 1) + " step " +
                     std::to_string(accel->step()) + " loss " + examples::Fixed(mean_loss, 4));
        if (tensorboard)
          LAUNCH_RETURN_IF_ERROR(accel->Log({{"train/loss", mean_loss}}, accel->step()));
      }
      if (max_steps > 0 && accel->step() >= max_steps) {
        done = true;
        break;
      }
    }
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    accel->Print("epoch " + std::to_string(epoch + 1) + " took " + examples::Fixed(seconds, 1) +
                 " s");
  }
  LAUNCH_RETURN_IF_ERROR(accel->Finish());

  // 6. Evaluate: each process classifies its share of the 10,000 test images and the counts
  //    are summed over the processes (examples::TestAccuracy, common.h).
  net->eval();
  double accuracy = examples::TestAccuracy(
      *accel, test, [&](const torch::Tensor& images) { return net->forward(images); });
  // 7. The trained weights for PyTorch: torch.load(PATH) in Python gives the state dict.
  const std::string save = flags.Get("save", "");
  if (!save.empty()) LAUNCH_RETURN_IF_ERROR(accel->SaveForPython(save));
  if (tensorboard) LAUNCH_RETURN_IF_ERROR(accel->Log({{"test/accuracy", accuracy}}, accel->step()));
  accel->Print(examples::AccuracyLine(accuracy));
  return Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  // Errors the program can act on arrive as a Status. A peer that dies mid-collective throws
  // c10::Error from inside LibTorch instead; it is left to end the process, and `launch` stops
  // (or, with --max_restarts, restarts) the other workers.
  Status status = Run(argc, argv);
  if (!status.ok()) {
    std::cerr << "fashion_mnist_ddp: " << status.ToString() << "\n";
    return 1;
  }
  return 0;
}
