// Pipeline parallelism on Fashion-MNIST: an MLP cut into two stages, one per process. Each batch
// is split into micro-batches that flow through the stages; with the 1F1B schedule a stage
// starts a micro-batch's backward pass as soon as it can, so at most `stages` micro-batches
// hold activations at a time.
//
//   launch --num_processes 2 -- ./pipeline --epochs 1
//
// With 4 processes there are two pipelines of two stages, and each stage's gradients are also
// averaged with the same stage of the other pipeline (pipeline x data parallel).
//
// --schedule interleaved_1f1b cuts the model into 4 chunks instead, each process holding two
// that are not adjacent (chunks 0 and 2, 1 and 3), so each micro-batch goes round the two
// processes twice and the pipeline idles less; zero_bubble splits each backward into the input's
// gradient and the weights' (for layers that compute with SplitLinear; these torch::nn::Linear
// layers back-propagate whole in the first half), gpipe runs every forward first.
//
// Flags: --epochs E (1), --max_steps S (0 = no limit), --data DIR, --schedule S (1f1b).
// The last line printed (by the last stage) is `test_accuracy=0.XXXX`.

#include <cstdint>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "base/status.h"
#include "common.h"
#include "config/train_config.h"
#include "trainer_runtime/api/accelerator.h"
#include "trainer_runtime/data/idx.h"
#include "trainer_runtime/model/pipeline_stages.h"

namespace {

using launch::Status;
using launch::trainer::Accelerator;
using launch::trainer::IdxDataset;
using launch::trainer::IdxSplit;

Status Run(int argc, char** argv) {
  LAUNCH_ASSIGN_OR_RETURN(
      examples::Flags flags,
      examples::Flags::Parse(argc, argv, {"epochs", "max_steps", "data", "schedule"}));
  LAUNCH_ASSIGN_OR_RETURN(int64_t epochs, flags.GetInt("epochs", 1));
  LAUNCH_ASSIGN_OR_RETURN(int64_t max_steps, flags.GetInt("max_steps", 0));

  launch::config::TrainConfig options;
  options.parallel.mode = launch::config::ParallelMode::kPipeline;
  options.parallel.stages = 2;        // processes per pipeline
  options.parallel.microbatches = 4;  // a batch of 64 flows as 4 micro-batches of 16
  using launch::config::PipelineSchedule;
  const std::string schedule = flags.Get("schedule", "1f1b");
  const std::map<std::string, PipelineSchedule> schedules = {
      {"gpipe", PipelineSchedule::kGPipe},
      {"1f1b", PipelineSchedule::k1F1B},
      {"interleaved_1f1b", PipelineSchedule::kInterleaved1F1B},
      {"zero_bubble", PipelineSchedule::kZeroBubble}};
  if (!schedules.count(schedule))
    return Status::InvalidArgument("--schedule: '" + schedule +
                                   "' is not gpipe, 1f1b, interleaved_1f1b or zero_bubble");
  options.parallel.schedule = schedules.at(schedule);
  const bool interleaved =
      options.parallel.schedule == launch::config::PipelineSchedule::kInterleaved1F1B;
  if (interleaved) options.parallel.virtual_stages = 2;  // model chunks per process
  options.batch_size = 64;
  options.optimizer.lr = 1e-3;
  LAUNCH_ASSIGN_OR_RETURN(std::unique_ptr<Accelerator> accel, Accelerator::Create(options));
  accel->Print("pipeline: " + std::to_string(accel->num_stages()) + " stages x " +
               std::to_string(accel->data_parallel_size()) + " pipeline(s), " + schedule + ", " +
               std::to_string(options.parallel.microbatches) + " micro-batches");

  const std::string dir = flags.Get("data", launch::trainer::kFashionMnistDir);
  LAUNCH_ASSIGN_OR_RETURN(IdxDataset train, IdxDataset::Load(dir, IdxSplit::kTrain));
  LAUNCH_ASSIGN_OR_RETURN(IdxDataset test, IdxDataset::Load(dir, IdxSplit::kTest));

  // Every process builds the whole model from the same seed, so each stage starts from the
  // weights one process training the whole model would have, then keeps its own layers:
  // stage 0 the first three modules (784 -> 256), stage 1 the other three (256 -> 10). The
  // activations sent between the stages are [micro-batch, 256].
  torch::manual_seed(options.seed);
  torch::nn::Sequential whole(torch::nn::Flatten(), torch::nn::Linear(28 * 28, 256),
                              torch::nn::ReLU(), torch::nn::Linear(256, 128), torch::nn::ReLU(),
                              torch::nn::Linear(128, 10));
  // Interleaved: four chunks (Flatten + Linear | ReLU | Linear + ReLU | Linear), this process's
  // being chunks stage_index() and stage_index() + 2.
  const std::vector<int64_t> cut =
      interleaved ? std::vector<int64_t>{2, 1, 2, 1} : std::vector<int64_t>{3, 3};
  std::vector<torch::nn::AnyModule> chunks;
  for (int c = accel->stage_index(); c < static_cast<int>(cut.size()); c += accel->num_stages()) {
    LAUNCH_ASSIGN_OR_RETURN(torch::nn::AnyModule chunk,
                            launch::trainer::SequentialStage(whole, cut, c));
    chunks.push_back(chunk);
  }
  // One module holding this process's chunks under the whole model's names.
  LAUNCH_ASSIGN_OR_RETURN(std::shared_ptr<torch::nn::Module> stage,
                          launch::trainer::JoinChunks(chunks));
  auto optimizer = std::make_shared<torch::optim::Adam>(
      stage->parameters(), torch::optim::AdamOptions(options.optimizer.lr));
  LAUNCH_RETURN_IF_ERROR(accel->PreparePipeline(chunks, optimizer));

  // Both stages take the same batches: the first uses the images, the last the labels.
  auto loader = accel->PrepareDataLoader(std::move(train), options.batch_size);
  auto loss_fn = [](const torch::Tensor& logits, const torch::Tensor& labels) {
    return torch::nn::functional::cross_entropy(logits, labels);
  };
  bool done = false;
  for (int64_t epoch = accel->epoch(); epoch < epochs && !done; ++epoch) {
    for (torch::data::Example<>& batch : loader.Epoch(epoch)) {
      // The whole schedule for this batch: forward and backward of every micro-batch, the
      // activations and their gradients sent between the stages. The loss is defined on the
      // last stage only.
      torch::Tensor loss = accel->PipelineForwardBackward(batch, loss_fn);
      accel->Step();  // each stage steps its own optimizer
      if (accel->step() % 100 == 0 && loss.defined()) {
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
  LAUNCH_RETURN_IF_ERROR(accel->Finish());

  // Evaluation runs the test images through the pipeline too: the first stage feeds them and
  // the last returns the logits (undefined on the first stage, which then counts nothing).
  stage->eval();
  double accuracy = examples::TestAccuracy(
      *accel, test, [&](const torch::Tensor& images) { return accel->PipelineForward(images); });
  accel->Print(examples::AccuracyLine(accuracy));
  return Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  Status status = Run(argc, argv);
  if (!status.ok()) {
    std::cerr << "pipeline: " << status.ToString() << "\n";
    return 1;
  }
  return 0;
}
