#pragma once

// Checkpoints re-cut for another layout: a model written by T tensor shards and P pipeline
// stages, resumed with T' and P' (and any data-parallel size, as before).
//
// A checkpoint's model is one folder per (stage, tensor) shard: stage<s>_tensor<t>, stage<s>,
// tensor<t>, or the pair folder itself when nothing splits the model. Each names its parameters
// (the whole model's names: a stage keeps them, a shard keeps its layer's) and keeps their
// optimizer state in pieces (SaveModelFolder and ZeRO's shards, checkpoint.h). A rank of the new
// layout takes each of its parameters from the folders that hold it: a split parameter's T
// shards are joined into the whole one and its own shard of T' cut from that (JoinShards,
// CutShard; the cut is its layer's TensorSplit, model/tensor_parallel.h), a replicated one is
// taken as it is; the optimizer's state tensors, elementwise in every optimizer the pieces know,
// are joined and cut alike. The result is written as the folder this rank's layout would have
// written, which the strategy then loads as its own (ZeRO re-cutting it over its data group
// as for any other world size). Exact: nothing is recomputed, only moved.
//
// Internal to trainer_runtime (includes LibTorch).

#include <string>
#include <vector>

#include <torch/torch.h>

#include "base/status.h"
#include "trainer_runtime/model/model.h"

namespace launch::trainer {

// One model folder of a checkpoint and the shard it holds.
struct ShardFolder {
  std::string path;
  int stage = 0;
  int tensor = 0;
};

// The model folders in `dir` (a step folder or its pair<i>): its shard folders, or `dir` itself
// when it holds the model unsplit.
std::vector<ShardFolder> ShardFoldersOf(const std::string& dir);

// Whether `folders` are exactly the shards of `stages` x `tensor` (any number of data ranks).
bool CutAs(const std::vector<ShardFolder>& folders, int stages, int tensor);

// "tensor 2 x stages 2", "the whole model": how `folders` cut it, for messages.
std::string DescribeCut(const std::vector<ShardFolder>& folders);

// Writes into folder `to` what this rank, shard `tensor_rank` of `tensor_size` holding `model`,
// would have saved (SaveModelFolder's files), from the checkpoint's `folders`; `optimizer` gives
// the settings written (its state is not read). Reads every folder's parameters and optimizer
// state (each rank holds the whole model's for the moment). InvalidConfig naming the folder or
// parameter: a folder that does not name its parameters (written before they were, or with an
// optimizer whose state is not in pieces), a parameter no folder holds, or one whose joined
// shape does not fit this model.
Status WriteRecutFolder(const std::vector<ShardFolder>& folders, Model& model,
                        torch::optim::Optimizer& optimizer, int tensor_size, int tensor_rank,
                        const std::string& to);

}  // namespace launch::trainer
