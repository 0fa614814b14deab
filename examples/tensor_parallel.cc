// Tensor parallelism in a model of your own, Megatron's recipe (trainer_runtime/model/
// tensor_parallel.h): each Fashion-MNIST image is read as a sequence of its 28 rows; an attention
// block splits its heads over the processes of the tensor group, an MLP block its hidden
// features, and the classifier its classes, whose split logits the vocabulary-parallel
// cross-entropy takes without gathering them.
//
//   launch --num_processes 2 -- ./tensor_parallel --tensor 2    (each layer split over 2)
//   launch --num_processes 1 -- ./tensor_parallel --tensor 1    (the same model whole)
//
// Both print the same losses, to float32's reordering of sums: every process builds the whole
// model from the seed and keeps its shards of it (LoadShardsFromWhole), so the split run starts
// where one process starts. With 4 processes and --tensor 2 there are two replicas of the split
// model, and DDP averages each shard's gradients over them.
//
// Flags: --tensor T (1), --max_steps S (150), --data DIR.
// The last line printed is `test_accuracy=0.XXXX`.

#include <cmath>
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
using launch::trainer::ColumnParallelLinear;
using launch::trainer::ColumnParallelOptions;
using launch::trainer::IdxDataset;
using launch::trainer::IdxSplit;
using launch::trainer::RowParallelLinear;
using launch::trainer::TensorGroupPtr;

constexpr int64_t kRows = 28, kWidth = 64, kHeads = 4, kClasses = 10;

// One pre-norm transformer block over the image's rows, then a classifier. `group` null (or of
// one process): every layer whole.
class RowTransformerImpl : public torch::nn::Module {
 public:
  explicit RowTransformerImpl(TensorGroupPtr group)
      : group_(group), ranks_(group ? group->size() : 1) {
    embed_ = register_module("embed", torch::nn::Linear(kRows, kWidth));
    position_ = register_parameter("position", torch::randn({kRows, kWidth}) * 0.02);
    ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    // q, k and v in one layer; fused(3) gives each process its heads' share of each of the three.
    qkv_ = register_module(
        "qkv", ColumnParallelLinear(kWidth, 3 * kWidth, group, ColumnParallelOptions().fused(3)));
    proj_ = register_module("proj", RowParallelLinear(kWidth, kWidth, group));
    ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    fc1_ = register_module("fc1", ColumnParallelLinear(kWidth, 4 * kWidth, group));
    fc2_ = register_module("fc2", RowParallelLinear(4 * kWidth, kWidth, group));
    // The classes split too: the logits stay split (Logits gathers them for a prediction).
    head_ = register_module("head", ColumnParallelLinear(kWidth, kClasses, group));
  }

  // This process's share of the logits, [B, classes / T].
  torch::Tensor forward(const torch::Tensor& images) {
    const int64_t b = images.size(0);
    torch::Tensor h = embed_->forward(images.view({b, kRows, kRows})) + position_;
    // Attention over this process's kHeads / T heads: nothing crosses processes until proj,
    // whose row-parallel sum is one all-reduce.
    const int64_t heads = kHeads / ranks_, dim = kWidth / kHeads;
    torch::Tensor qkv = qkv_->forward(ln1_->forward(h)).view({b, kRows, 3, heads, dim});
    torch::Tensor q = qkv.select(2, 0).transpose(1, 2);  // [B, heads, rows, dim]
    torch::Tensor k = qkv.select(2, 1).transpose(1, 2);
    torch::Tensor v = qkv.select(2, 2).transpose(1, 2);
    torch::Tensor att =
        torch::softmax(torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(dim)), -1);
    torch::Tensor y =
        torch::matmul(att, v).transpose(1, 2).contiguous().view({b, kRows, heads * dim});
    h = h + proj_->forward(y);
    // The MLP: this process's 1/T of the hidden features, summed back by fc2.
    h = h + fc2_->forward(torch::gelu(fc1_->forward(ln2_->forward(h))));
    return head_->forward(h.mean(1));
  }

  // Whole logits [B, classes], for a prediction (arg-max over every class).
  torch::Tensor Logits(const torch::Tensor& images) {
    return launch::trainer::GatherFromTensorRegion(forward(images), group_);
  }

 private:
  TensorGroupPtr group_;
  int64_t ranks_;
  torch::nn::Linear embed_{nullptr};
  torch::Tensor position_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  ColumnParallelLinear qkv_{nullptr}, fc1_{nullptr}, head_{nullptr};
  RowParallelLinear proj_{nullptr}, fc2_{nullptr};
};
TORCH_MODULE(RowTransformer);

Status Run(int argc, char** argv) {
  LAUNCH_ASSIGN_OR_RETURN(examples::Flags flags,
                          examples::Flags::Parse(argc, argv, {"tensor", "max_steps", "data"}));
  LAUNCH_ASSIGN_OR_RETURN(int64_t tensor, flags.GetInt("tensor", 1));
  LAUNCH_ASSIGN_OR_RETURN(int64_t max_steps, flags.GetInt("max_steps", 150));

  launch::config::TrainConfig options;
  options.parallel.mode = launch::config::ParallelMode::kDdp;  // over the replicas, if any
  options.parallel.tensor = static_cast<int>(tensor);          // the processes a layer spans
  options.batch_size = 64;
  options.optimizer.lr = 2e-3;
  // InvalidConfig when `tensor` does not divide the processes.
  LAUNCH_ASSIGN_OR_RETURN(std::unique_ptr<Accelerator> accel, Accelerator::Create(options));
  const TensorGroupPtr& group = accel->tensor_group();  // null with one process per layer
  if (kHeads % tensor != 0 || kClasses % tensor != 0)
    return Status::InvalidArgument("--tensor " + std::to_string(tensor) + " must divide the " +
                                   std::to_string(kHeads) + " heads and " +
                                   std::to_string(kClasses) + " classes");

  const std::string dir = flags.Get("data", launch::trainer::kFashionMnistDir);
  LAUNCH_ASSIGN_OR_RETURN(IdxDataset train, IdxDataset::Load(dir, IdxSplit::kTrain));
  LAUNCH_ASSIGN_OR_RETURN(IdxDataset test, IdxDataset::Load(dir, IdxSplit::kTest));

  // The whole model from the seed, on every process; each keeps its shards of it.
  torch::manual_seed(options.seed);
  RowTransformer whole(TensorGroupPtr{});
  RowTransformer net(group);
  launch::trainer::LoadShardsFromWhole(*net, *whole);
  auto optimizer = std::make_shared<torch::optim::Adam>(
      net->parameters(), torch::optim::AdamOptions(options.optimizer.lr));
  // Prepare finds the split layers itself: DDP averages each shard over its replicas, and
  // clipping (none here) would count replicated parameters once.
  LAUNCH_RETURN_IF_ERROR(accel->Prepare(net.ptr(), optimizer));
  accel->Print("tensor_parallel: " + std::to_string(accel->world_size()) + " process(es): tensor " +
               std::to_string(tensor) + " x data " + std::to_string(accel->data_parallel_size()));

  auto loader = accel->PrepareDataLoader(std::move(train), options.batch_size);
  bool done = false;
  for (int64_t epoch = accel->epoch(); !done; ++epoch) {
    for (torch::data::Example<>& batch : loader.Epoch(epoch)) {
      // The loss over split logits: max, target logit and sum of exponentials agreed over the
      // group (three all-reduces of one value per row); no process holds every class's logit.
      torch::Tensor loss =
          launch::trainer::VocabParallelCrossEntropy(net->forward(batch.data), batch.target, group)
              .mean();
      accel->Backward(loss);
      accel->Step();
      if (accel->step() % 50 == 0)
        accel->Print("step " + std::to_string(accel->step()) + " loss " +
                     examples::Fixed(accel->Mean(loss.item<double>()), 5));
      if (accel->step() >= max_steps) {
        done = true;
        break;
      }
    }
  }
  LAUNCH_RETURN_IF_ERROR(accel->Finish());
  net->eval();
  double accuracy = examples::TestAccuracy(
      *accel, test, [&](const torch::Tensor& images) { return net->Logits(images); });
  accel->Print(examples::AccuracyLine(accuracy));
  return Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  Status status = Run(argc, argv);
  if (!status.ok()) {
    std::cerr << "tensor_parallel: " << status.ToString() << "\n";
    return 1;
  }
  return 0;
}
