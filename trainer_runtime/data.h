#pragma once

// Data sets for the trainer: synthetic (a fixed random teacher network labels Gaussian inputs,
// so the best achievable loss is known), CSV (numeric features + a label column) and text
// (any file; byte-level next-token prediction). Everything is read into memory; nothing is
// downloaded.
//
// Internal to trainer_runtime (includes LibTorch).

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "base/status.h"
#include "config/train_config.h"

namespace launch::trainer {

enum class Task {
  kClassification,  // inputs [N, F] float, targets [N] int64; cross-entropy
  kRegression,      // inputs [N, F] float, targets [N, 1] float; mean squared error
  kLanguageModel,   // inputs [N, T] int64, targets [N, T] int64 (next byte); cross-entropy
};

struct Dataset {
  Task task = Task::kClassification;
  torch::Tensor inputs;
  torch::Tensor targets;
  std::vector<int64_t> train_indices;  // rows used for training
  std::vector<int64_t> eval_indices;   // held-out rows (eval_fraction), disjoint from train
  // Synthetic data only: the teacher's own expected loss, the floor a student can approach.
  double loss_floor = std::numeric_limits<double>::quiet_NaN();
  std::string description;  // "synthetic teacher: 20000 samples, 32 features, 10 classes"

  // Rows `indices` of inputs/targets (a batch).
  torch::Tensor Inputs(const std::vector<int64_t>& indices) const;
  torch::Tensor Targets(const std::vector<int64_t>& indices) const;
};

// Loads the configured data and splits off eval_fraction with a shuffle seeded by cfg.seed.
// Checks that the data fits the model (feature count vs the MLP's input width, classes vs its
// output width, vocabulary vs the language model) and says which key to change when not.
StatusOr<Dataset> LoadDataset(const config::TrainConfig& cfg);

// Mean loss of `logits` against `targets` for `task`.
torch::Tensor Loss(Task task, const torch::Tensor& logits, const torch::Tensor& targets);

// Number of correct predictions (classification / LM tokens) and number of predictions.
std::pair<int64_t, int64_t> CountCorrect(Task task, const torch::Tensor& logits,
                                         const torch::Tensor& targets);

}  // namespace launch::trainer
