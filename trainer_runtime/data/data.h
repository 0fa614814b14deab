#pragma once

// Data sets for the trainer: synthetic (a fixed random teacher network labels Gaussian inputs,
// so the best achievable loss is known), CSV (numeric features + a label column), text (any
// file; byte-level next-token prediction) and IDX images (MNIST / Fashion-MNIST files, kept as
// bytes and normalised per batch). Everything is read into memory once per process; nothing
// is downloaded. Also the loss the `train.loss` section configures.
//
// Internal to trainer_runtime (includes LibTorch).

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "base/status.h"
#include "config/train_config.h"
#include "trainer_runtime/data/idx.h"

namespace launch::trainer {

enum class Task {
  kClassification,  // inputs [N, F] float, targets [N] int64; cross-entropy
  kRegression,      // inputs [N, F] float, targets [N, 1] float; mean squared error
  kLanguageModel,   // inputs [N, T] int64, targets [N, T] int64 (next byte); cross-entropy
};

struct Dataset {
  Task task = Task::kClassification;
  // Images: uint8 [N, C, H, W], normalised by `pixels` in Inputs(); otherwise float or int64.
  torch::Tensor inputs;
  torch::Tensor targets;
  std::vector<int64_t> train_indices;  // rows used for training
  std::vector<int64_t> eval_indices;   // held-out rows (eval_fraction), disjoint from train
  // Synthetic data only: the teacher's own expected loss, the floor a student can approach.
  double loss_floor = std::numeric_limits<double>::quiet_NaN();
  std::string description;  // "synthetic teacher: 20000 samples, 32 features, 10 classes"
  IdxOptions pixels;        // byte images: the normalisation Inputs() applies
  // Byte images: augmentation of training batches (Augment()); none by default.
  int64_t crop_padding = 0;
  bool flip = false;

  // Rows `indices` of inputs/targets (a batch).
  torch::Tensor Inputs(const std::vector<int64_t>& indices) const;
  torch::Tensor Targets(const std::vector<int64_t>& indices) const;
};

// Loads the configured data and splits off eval_fraction with a shuffle seeded by cfg.seed.
// CSV features are standardised with the mean and standard deviation of the training rows only.
// Checks that the data fits the model (feature count vs the MLP's input width, classes vs its
// output width, vocabulary vs the language model) and says which key to change when not.
StatusOr<Dataset> LoadDataset(const config::TrainConfig& cfg);

// The loss `train.loss` configures for `task`: cross-entropy (label smoothing, ignore_index,
// class weights) for class labels and language models, mean squared error, or binary
// cross-entropy on logits (class labels become one-hot targets). kAuto picks cross-entropy for
// classification and language models, MSE for regression.
class Criterion {
 public:
  // InvalidConfig naming the train.loss key for a choice that does not fit the task.
  static StatusOr<Criterion> Create(Task task, const config::LossConfig& cfg);
  Criterion() = default;

  // Mean loss of `logits` against `targets` (may throw c10::Error on mismatched shapes).
  torch::Tensor operator()(const torch::Tensor& logits, const torch::Tensor& targets) const;
  // Correct arg-max predictions and predictions counted (targets equal to ignore_index do not
  // count); {0, 0} for regression.
  std::pair<int64_t, int64_t> CountCorrect(const torch::Tensor& logits,
                                           const torch::Tensor& targets) const;

 private:
  Task task_ = Task::kClassification;
  config::LossConfig cfg_;
  config::LossType type_ = config::LossType::kCrossEntropy;
  torch::Tensor class_weights_;
};

// Training-time augmentation of a batch of normalised images [B, C, H, W] (data.crop_padding,
// data.flip): each image is padded with black by `crop_padding` pixels on each side and
// cropped back to H x W at a random offset, and flipped left-right with probability 1/2.
// Draws come from a generator seeded with `seed`, so a batch's augmentation depends only on
// the seed the caller derives (the trainer: from seed, epoch, rank and batch) and a resumed
// run repeats it exactly. Returns `images` unchanged when neither is configured.
torch::Tensor Augment(const Dataset& data, const torch::Tensor& images, uint64_t seed);

}  // namespace launch::trainer
