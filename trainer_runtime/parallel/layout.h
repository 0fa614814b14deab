#pragma once

// ParallelLayout: how the ranks of a job are arranged, built once from the train config and the
// environment, and asked by everything that needs a group, a neighbour or a coordinate
// (torchtitan's ParallelDims and Megatron's RankGenerator are the models). The world is a grid
// of axes in one declared order, innermost first:
//   world = tensor x context x data x stage      (Megatron's "tp-cp-dp-pp")
//   rank  = t + tensor * (c + context * (d + data * s))
// Tensor is innermost so that a tensor group (an all-reduce inside every layer) stays on one
// host, where the shared-memory transport serves it; context next (two all-to-alls in every
// attention layer); a pipeline's stages are furthest apart (one send per micro-batch crosses
// hosts). The degrees come from the config: stages, tensor and context (train.parallel.*),
// data = world / (stages x tensor x context), as torchtitan infers dp_shard = -1.
//
// A group along an axis holds the other coordinates fixed and walks that axis (Megatron's
// orthogonal groups): with 16 ranks, tensor 2 and stages 4 the tensor groups are [0,1], [2,3],
// ..., the data groups [0,2], [1,3], [4,6], ..., the stage groups [0,4,8,12], [1,5,9,13], ...
// One more axis is derived: replica, context and data flattened (Megatron's dp-cp group,
// torchtitan's dp_shard_cp), the ranks that hold the same part of the model; without a context
// axis its groups are the data groups.
// The groups are named by use (Use below), so a consumer says what it needs a group for and
// the layout says which axis that is.
//
// Internal to trainer_runtime (includes LibTorch through comm/process_group.h). A value type:
// copy it freely; immutable after Create.

#include <array>
#include <chrono>
#include <string>
#include <vector>

#include "base/status.h"
#include "config/train_config.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/util/env.h"

namespace launch::trainer {

// The axes, innermost first (their order in the rank).
enum class Axis {
  kTensor,   // ranks that split each layer's weights and see the same data
  kContext,  // ranks that split each sequence of the same data (and hold the same weights)
  kData,     // replicas that see different data and average (or shard) gradients
  kStage,    // pipeline stages of one replica
  kReplica,  // derived: context x data flattened, the ranks holding the same part of the model
};
constexpr int kNumAxes = 5;
// "tensor", "context", "data", "stage", "replica".
const char* AxisName(Axis axis);

// What a group is for.
enum class Use {
  kBatch,     // the ranks that read the same rows: this rank's tensor group (the data loader
              // shards over the data coordinate; context ranks read the same rows too and keep
              // their part of each sequence)
  kGradient,  // the ranks that average (ddp) or shard (zero) this rank's gradients: the
              // replica group, whose ranks hold the same part of the model
  kContext,   // the ranks that split this rank's sequences
  kStage,     // the ranks of this rank's pipeline: activations forward, gradients back
  kTensor,    // the ranks that split this rank's layers
};
Axis AxisOf(Use use);

class ParallelLayout {
 public:
  // Validates `cfg` against env.world_size (the errors of CheckTrainRulesStatus: the key and
  // why) and computes this rank's coordinates.
  static StatusOr<ParallelLayout> Create(const config::TrainConfig& cfg, const DistEnv& env);
  // The layout of `world` ranks with these degrees, seen from `rank` (tests, tools).
  // InvalidArgument naming train.parallel.stages / tensor / context when a degree is below 1
  // or their product does not divide `world`.
  static StatusOr<ParallelLayout> FromDegrees(int world, int rank, int stages, int tensor,
                                              int context = 1);
  // A world of one process: what a program that never asked sees.
  ParallelLayout() = default;

  int world_size() const { return world_; }
  int rank() const { return rank_; }
  // How many ranks one group along `axis` has.
  int degree(Axis axis) const { return degree_[Index(axis)]; }
  // This rank's coordinate on `axis`, in [0, degree(axis)).
  int coordinate(Axis axis) const { return CoordinateOf(rank_, axis); }
  // `rank`'s coordinate on `axis`.
  int CoordinateOf(int rank, Axis axis) const {
    return rank / stride_[Index(axis)] % degree_[Index(axis)];
  }
  // The global rank at these coordinates.
  int RankAt(int tensor, int context, int data, int stage) const {
    return tensor * stride_[0] + context * stride_[1] + data * stride_[2] + stage * stride_[3];
  }
  // The random stream of the ranks that see this rank's rows (its tensor and context groups):
  // the rank it would be in the same job without those axes (d + data x s). They draw alike, each
  // keeping its part of the same dropout mask (model/layers.h), and draw what that unsplit job's
  // rank draws: splitting layers or sequences changes no random number. This rank itself
  // without a tensor or context axis.
  int RandomStream() const {
    return coordinate(Axis::kData) + degree(Axis::kData) * coordinate(Axis::kStage);
  }
  // The rank `delta` steps along `axis` from this one (the other coordinates fixed), or -1
  // past either end: Neighbour(kStage, -1) is the previous stage, -1 on the first.
  int Neighbour(Axis axis, int delta) const;
  // The global ranks of this rank's group along `axis`, in coordinate order.
  std::vector<int> GroupRanks(Axis axis) const { return GroupRanksOf(rank_, axis); }
  std::vector<int> GroupRanksOf(int rank, Axis axis) const;
  // Every group along `axis` (a partition of the world), ordered by their first rank.
  std::vector<std::vector<int>> AllGroups(Axis axis) const;
  // The index of this rank's group among AllGroups(axis): distinct per group, the same for
  // every rank of a group (it names the group's keys in the store).
  int GroupIndex(Axis axis) const;
  // The rank that reports (logs, metrics, final.json): tensor 0, context 0 of data replica 0 on
  // the last stage, where the loss is.
  int main_rank() const { return RankAt(0, 0, 0, degree(Axis::kStage) - 1); }
  // Where this rank's part of the model goes in a checkpoint folder: "" when every rank holds
  // the whole model, else "stage<s>" and/or "tensor<t>" joined by "_" (the axes that split it).
  std::string ShardName() const;
  // "tensor 2 x context 2 x data 2 x stage 4" (degrees above 1 only, the derived replica axis
  // left out; "1 process" for a world of one).
  std::string Describe() const;

 private:
  static int Index(Axis axis) { return static_cast<int>(axis); }
  int world_ = 1;
  int rank_ = 0;
  std::array<int, kNumAxes> degree_ = {1, 1, 1, 1, 1};
  std::array<int, kNumAxes> stride_ = {1, 1, 1, 1, 1};
};

// The process group of this rank's group along `axis` over the job's store. When the axis
// spans the whole world, returns `world` itself (no second group). Otherwise builds it with
// CreateGroupOver (named by the axis and GroupIndex, so each group has its own keys), with
// the shared-memory transports when its ranks share a host. COLLECTIVE: every rank of the
// world calls it for the same axis at the same point. Null for a group of one rank.
// `generation` > 0 (in-place recovery, comm/recovery.h): the group re-formed in that
// generation, over `world` of the same generation, with keys of its own.
StatusOr<c10::intrusive_ptr<CountingProcessGroup>> CreateAxisGroup(
    const ParallelLayout& layout, Axis axis, const DistEnv& env,
    const c10::intrusive_ptr<CountingProcessGroup>& world, std::chrono::milliseconds timeout,
    int generation = 0);

}  // namespace launch::trainer
