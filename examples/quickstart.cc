// The README's library snippet as a whole program: a data set, a model and a loop of your own on
// the trainer runtime. README.md shows Train(), between the two markers below, as it is here
// (tests/examples checks it), and this file builds with -Wall -Wextra -Werror: the snippet drops
// no Status.
//
//   launch --num_processes 2 -- ./quickstart

#include <cstdio>

#include <torch/torch.h>

#include "trainer_runtime/api/accelerator.h"

using launch::Status;
using launch::trainer::Accelerator;

struct Rows : torch::data::datasets::Dataset<Rows> {  // your data: 4,096 rows of 8 features
  torch::data::Example<> get(size_t i) override {
    torch::Tensor x = torch::sin(torch::arange(8, torch::kFloat) * static_cast<double>(i % 97));
    return {x, (x.sum() > 0).to(torch::kLong)};
  }
  torch::optional<size_t> size() const override { return 4096; }
};

// README begin
Status Train() {
  launch::config::TrainConfig options;  // or config::LoadTrainConfigFile("job.yaml"): its train:
  options.gradient_accumulation_steps = 2;
  LAUNCH_ASSIGN_OR_RETURN(auto accel, Accelerator::Create(options));  // torchrun's environment
  torch::nn::Sequential model(torch::nn::Linear(8, 32), torch::nn::ReLU(),
                              torch::nn::Linear(32, 2));
  torch::optim::Adam optimizer(model->parameters());
  LAUNCH_RETURN_IF_ERROR(accel->Prepare(model, optimizer));  // DDP: rank 0's weights everywhere
  auto loader = accel->PrepareDataLoader(Rows(), /*batch_size=*/64);  // sharded over the ranks
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    for (auto& batch : loader.Epoch(epoch)) {
      accel->Accumulate();  // all-reduce on the last micro-batch of each window only
      accel->Backward(
          torch::nn::functional::cross_entropy(model->forward(batch.data), batch.target));
      accel->Step();  // clip, step and zero_grad once the window closes
    }
    LAUNCH_RETURN_IF_ERROR(accel->SaveState("ckpt"));  // model, optimizer, position, every RNG
  }
  LAUNCH_RETURN_IF_ERROR(accel->Finish());  // the replicas agree, or it says which ranks differ
  return accel->SaveForPython("model.pt");  // torch.load("model.pt") in Python
}
// README end

int main() {
  const Status s = Train();
  if (!s.ok()) std::fprintf(stderr, "quickstart: %s\n", s.ToString().c_str());
  return s.ok() ? 0 : 1;
}
