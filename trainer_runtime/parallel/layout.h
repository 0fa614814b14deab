#pragma once

// ParallelLayout: how the ranks of a job are arranged, built once from the train config and the
// environment (torchtitan's ParallelDims is the model). The world is a grid of axes,
//   world = data x stage         (stage innermost: a pipeline's stages are adjacent ranks)
// and each rank has a coordinate on each axis:
//   stage(r) = r % stages        data(r) = r / stages
// Every mode is a point in it: ddp, zero and local_sgd are data = W, stage = 1; pipeline is
// stage = parallel.stages, data = W / stages; none and dp are data = W with no communication.
// The layout validates the degrees against the world size (the config's own rules,
// config/train_keys.h CheckTrainRulesStatus, with the real world), names the rank that reports
// (main_rank), and hands out the process group along any axis through one factory
// (CreateAxisGroup), which attaches the shared-memory transports when the group's ranks share a
// host. A new axis (tensor parallel) is a new Axis value, a degree and a coordinate here.
//
// Internal to trainer_runtime (includes LibTorch through comm/process_group.h).

#include <chrono>
#include <string>
#include <vector>

#include "base/status.h"
#include "config/train_config.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/util/env.h"

namespace launch::trainer {

enum class Axis {
  kData,   // replicas that see different data and average (or shard) gradients
  kStage,  // pipeline stages of one replica
};

class ParallelLayout {
 public:
  // Validates `cfg` against env.world_size (the errors of CheckTrainRulesStatus: the key and
  // why) and computes this rank's coordinates.
  static StatusOr<ParallelLayout> Create(const config::TrainConfig& cfg, const DistEnv& env);
  // A world of one process of mode none: what a program that never asked sees.
  ParallelLayout() = default;

  int world_size() const { return world_; }
  int rank() const { return rank_; }
  // Degree of `axis`: how many ranks one group along it has.
  int degree(Axis axis) const { return axis == Axis::kData ? data_ : stages_; }
  // This rank's coordinate on `axis`, in [0, degree(axis)).
  int coordinate(Axis axis) const {
    return axis == Axis::kData ? rank_ / stages_ : rank_ % stages_;
  }
  // The global rank at (data, stage).
  int RankAt(int data, int stage) const { return data * stages_ + stage; }
  // The global ranks of this rank's group along `axis`, in coordinate order.
  std::vector<int> GroupRanks(Axis axis) const;
  // The rank that reports (logs, metrics, final.json): the last stage of data replica 0, where
  // the loss is.
  int main_rank() const { return RankAt(0, stages_ - 1); }
  // "data 2 x stage 2" (degrees above 1 only; "1 process" for a world of one).
  std::string Describe() const;

 private:
  int world_ = 1;
  int rank_ = 0;
  int data_ = 1;
  int stages_ = 1;
};

// The process group of this rank's group along `axis` over the job's store. When the axis
// spans the whole world, returns `world` itself (no second group). Otherwise builds it with
// CreateGroupOver (name "<axis><index>", the index being the group's coordinate on the other
// axis, so each group has its own keys). COLLECTIVE among the group's ranks; every rank of the
// world calls it for the same axis at the same point. Null for a group of one rank.
StatusOr<c10::intrusive_ptr<CountingProcessGroup>> CreateAxisGroup(
    const ParallelLayout& layout, Axis axis, const DistEnv& env,
    const c10::intrusive_ptr<CountingProcessGroup>& world, std::chrono::milliseconds timeout);

}  // namespace launch::trainer
