// Local SGD on Fashion-MNIST: each process trains its own replica with no communication at all
// during backward, and the replicas' parameters are averaged every K optimizer steps (and once
// more at the end). Communication drops by a factor of K against DDP, at some cost in accuracy
// per step; useful when the network, not the compute, is the bottleneck.
//
//   launch --num_processes 2 -- ./local_sgd --local_sgd_steps 8
//
// The loop is the same as in fashion_mnist_ddp.cc: only the option differs. The model here is
// a small MLP, built as a torch::nn::Sequential: any module works.
//
// Flags: --local_sgd_steps K (8), --epochs E (1), --max_steps S (0 = no limit), --data DIR.
// The last line printed is `test_accuracy=0.XXXX`.

#include <cstdint>
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
using launch::trainer::IdxDataset;
using launch::trainer::IdxSplit;

Status Run(int argc, char** argv) {
  LAUNCH_ASSIGN_OR_RETURN(
      examples::Flags flags,
      examples::Flags::Parse(argc, argv, {"local_sgd_steps", "epochs", "max_steps", "data"}));
  LAUNCH_ASSIGN_OR_RETURN(int64_t k, flags.GetInt("local_sgd_steps", 8));
  LAUNCH_ASSIGN_OR_RETURN(int64_t epochs, flags.GetInt("epochs", 1));
  LAUNCH_ASSIGN_OR_RETURN(int64_t max_steps, flags.GetInt("max_steps", 0));

  launch::config::TrainConfig options;
  options.parallel.mode = launch::config::ParallelMode::kDdp;
  options.local_sgd_steps = static_cast<int>(k);  // > 0: Local SGD instead of DDP's all-reduce
  options.batch_size = 64;
  options.optimizer.lr = 1e-3;
  LAUNCH_ASSIGN_OR_RETURN(std::unique_ptr<Accelerator> accel, Accelerator::Create(options));
  const std::string dir = flags.Get("data", launch::trainer::kFashionMnistDir);
  LAUNCH_ASSIGN_OR_RETURN(IdxDataset train, IdxDataset::Load(dir, IdxSplit::kTrain));
  LAUNCH_ASSIGN_OR_RETURN(IdxDataset test, IdxDataset::Load(dir, IdxSplit::kTest));

  torch::manual_seed(options.seed);
  torch::nn::Sequential net(torch::nn::Flatten(), torch::nn::Linear(28 * 28, 128),
                            torch::nn::ReLU(), torch::nn::Linear(128, 10));
  auto optimizer = std::make_shared<torch::optim::Adam>(
      net->parameters(), torch::optim::AdamOptions(options.optimizer.lr));
  // Prepare still broadcasts rank 0's weights, so the replicas start equal.
  LAUNCH_RETURN_IF_ERROR(accel->Prepare(net.ptr(), optimizer));
  // mode_name() is "local_sgd" from here on.
  accel->Print("local_sgd: " + std::to_string(accel->world_size()) + " process(es), " +
               accel->mode_name() + ", parameters averaged every " + std::to_string(k) + " steps");
  auto loader = accel->PrepareDataLoader(std::move(train), options.batch_size);

  bool done = false;
  for (int64_t epoch = accel->epoch(); epoch < epochs && !done; ++epoch) {
    for (torch::data::Example<>& batch : loader.Epoch(epoch)) {
      accel->Accumulate();
      torch::Tensor loss =
          torch::nn::functional::cross_entropy(net->forward(batch.data), batch.target);
      accel->Backward(loss);  // local gradients only
      accel->Step();          // steps this replica; every K steps, averages the parameters
      if (accel->step() % 100 == 0) {
        // Between averages the replicas differ: this is rank 0's own loss.
        accel->Print("epoch " + std::to_string(epoch + 1) + " step " +
                     std::to_string(accel->step()) + " loss " +
                     examples::Fixed(loss.item<double>(), 4));
      }
      if (max_steps > 0 && accel->step() >= max_steps) {
        done = true;
        break;
      }
    }
  }
  // The final average (when steps were taken since the last one): the replicas agree again,
  // so evaluating with each process's own copy measures the one averaged model.
  LAUNCH_RETURN_IF_ERROR(accel->Finish());

  net->eval();
  double accuracy = examples::TestAccuracy(
      *accel, test, [&](const torch::Tensor& images) { return net->forward(images); });
  accel->Print(examples::AccuracyLine(accuracy));
  return Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  Status status = Run(argc, argv);
  if (!status.ok()) {
    std::cerr << "local_sgd: " << status.ToString() << "\n";
    return 1;
  }
  return 0;
}
