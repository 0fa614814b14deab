#include "trainer_runtime/parallel/layout.h"

#include "config/train_keys.h"
#include "trainer_runtime/comm/recovery.h"

namespace launch::trainer {

const char* AxisName(Axis axis) {
  switch (axis) {
    case Axis::kTensor:
      return "tensor";
    case Axis::kContext:
      return "context";
    case Axis::kData:
      return "data";
    case Axis::kStage:
      return "stage";
    case Axis::kReplica:
      return "replica";
  }
  return "?";
}

Axis AxisOf(Use use) {
  switch (use) {
    case Use::kBatch:
    case Use::kTensor:
      return Axis::kTensor;
    case Use::kGradient:
      return Axis::kReplica;
    case Use::kContext:
      return Axis::kContext;
    case Use::kStage:
      return Axis::kStage;
  }
  return Axis::kData;
}

StatusOr<ParallelLayout> ParallelLayout::Create(const config::TrainConfig& cfg,
                                                const DistEnv& env) {
  // The model is the program's: `train` checked its built-in model's rules when it loaded them.
  LAUNCH_RETURN_IF_ERROR(
      config::CheckTrainRulesStatus(cfg, env.world_size, /*builtin_model=*/false));
  return FromDegrees(env.world_size, env.rank, cfg.parallel.stages, cfg.parallel.tensor,
                     cfg.parallel.context);
}

StatusOr<ParallelLayout> ParallelLayout::FromDegrees(int world, int rank, int stages, int tensor,
                                                     int context) {
  if (stages < 1) return Status::InvalidArgument("train.parallel.stages: must be at least 1");
  if (tensor < 1) return Status::InvalidArgument("train.parallel.tensor: must be at least 1");
  if (context < 1) return Status::InvalidArgument("train.parallel.context: must be at least 1");
  if (world < 1 || rank < 0 || rank >= world)
    return Status::InvalidArgument("rank " + std::to_string(rank) + " is not in a world of " +
                                   std::to_string(world));
  if (world % (stages * tensor * context) != 0)
    return Status::InvalidArgument(std::string("train.") +
                                   (context > 1  ? "parallel.context"
                                    : tensor > 1 ? "parallel.tensor"
                                                 : "parallel.stages") +
                                   ": stages x tensor x context (" + std::to_string(stages) +
                                   " x " + std::to_string(tensor) + " x " +
                                   std::to_string(context) + ") does not divide the world size " +
                                   std::to_string(world));
  ParallelLayout layout;
  layout.world_ = world;
  layout.rank_ = rank;
  const int data = world / (stages * tensor * context);
  // The replica axis is context and data flattened: context is inside data, so their ranks
  // walk one stride (tensor) through context x data coordinates.
  layout.degree_ = {tensor, context, data, stages, context * data};
  layout.stride_ = {1, tensor, tensor * context, tensor * context * data, tensor};
  return layout;
}

int ParallelLayout::Neighbour(Axis axis, int delta) const {
  const int at = coordinate(axis) + delta;
  if (at < 0 || at >= degree(axis)) return -1;
  return rank_ + delta * stride_[Index(axis)];
}

std::vector<int> ParallelLayout::GroupRanksOf(int rank, Axis axis) const {
  // Hold the other coordinates: the group starts where this axis' coordinate is 0.
  const int stride = stride_[Index(axis)];
  const int first = rank - CoordinateOf(rank, axis) * stride;
  std::vector<int> ranks;
  for (int i = 0; i < degree(axis); ++i) ranks.push_back(first + i * stride);
  return ranks;
}

std::vector<std::vector<int>> ParallelLayout::AllGroups(Axis axis) const {
  std::vector<std::vector<int>> groups;
  for (int r = 0; r < world_; ++r)
    if (CoordinateOf(r, axis) == 0) groups.push_back(GroupRanksOf(r, axis));
  return groups;
}

int ParallelLayout::GroupIndex(Axis axis) const {
  const int first = GroupRanks(axis).front();
  int index = 0;
  for (int r = 0; r < first; ++r)
    if (CoordinateOf(r, axis) == 0) ++index;
  return index;
}

std::string ParallelLayout::ShardName() const {
  std::string name;
  // Context ranks hold the whole of their tensor shard: no folder of their own.
  if (degree(Axis::kStage) > 1) name = "stage" + std::to_string(coordinate(Axis::kStage));
  if (degree(Axis::kTensor) > 1)
    name += (name.empty() ? "" : "_") + std::string("tensor") +
            std::to_string(coordinate(Axis::kTensor));
  return name;
}

std::string ParallelLayout::Describe() const {
  if (world_ == 1) return "1 process";
  std::string out;
  for (Axis axis : {Axis::kTensor, Axis::kContext, Axis::kData, Axis::kStage}) {
    if (degree(axis) <= 1) continue;
    out += (out.empty() ? "" : " x ") + std::string(AxisName(axis)) + " " +
           std::to_string(degree(axis));
  }
  return out;
}

StatusOr<c10::intrusive_ptr<CountingProcessGroup>> CreateAxisGroup(
    const ParallelLayout& layout, Axis axis, const DistEnv& env,
    const c10::intrusive_ptr<CountingProcessGroup>& world, std::chrono::milliseconds timeout,
    int generation) {
  const int size = layout.degree(axis);
  if (size <= 1) return c10::intrusive_ptr<CountingProcessGroup>();
  if (size == layout.world_size()) return world;
  const std::string name = GroupNameIn(
      std::string(AxisName(axis)) + std::to_string(layout.GroupIndex(axis)), generation);
  LAUNCH_ASSIGN_OR_RETURN(auto store, ConnectStore(env, /*host=*/false, timeout));
  StatusOr<c10::intrusive_ptr<CountingProcessGroup>> group =
      CreateGroupOver(store, name, layout.coordinate(axis), size, env, timeout);
  if (!group.ok())
    return group.status().WithContext("the " + std::string(AxisName(axis)) + "-parallel group of " +
                                      std::to_string(size) + " ranks");
  return group;
}

}  // namespace launch::trainer
