#include "trainer_runtime/parallel/layout.h"

#include "config/train_keys.h"

namespace launch::trainer {

StatusOr<ParallelLayout> ParallelLayout::Create(const config::TrainConfig& cfg,
                                                const DistEnv& env) {
  LAUNCH_RETURN_IF_ERROR(config::CheckTrainRulesStatus(cfg, env.world_size));
  ParallelLayout layout;
  layout.world_ = env.world_size;
  layout.rank_ = env.rank;
  if (cfg.parallel.mode == config::ParallelMode::kPipeline) layout.stages_ = cfg.parallel.stages;
  layout.data_ = layout.world_ / layout.stages_;
  return layout;
}

std::vector<int> ParallelLayout::GroupRanks(Axis axis) const {
  std::vector<int> ranks;
  for (int i = 0; i < degree(axis); ++i)
    ranks.push_back(axis == Axis::kData ? RankAt(i, coordinate(Axis::kStage))
                                        : RankAt(coordinate(Axis::kData), i));
  return ranks;
}

std::string ParallelLayout::Describe() const {
  if (world_ == 1) return "1 process";
  std::string out;
  if (data_ > 1) out = "data " + std::to_string(data_);
  if (stages_ > 1)
    out += (out.empty() ? "" : " x ") + std::string("stage ") + std::to_string(stages_);
  return out;
}

StatusOr<c10::intrusive_ptr<CountingProcessGroup>> CreateAxisGroup(
    const ParallelLayout& layout, Axis axis, const DistEnv& env,
    const c10::intrusive_ptr<CountingProcessGroup>& world, std::chrono::milliseconds timeout) {
  const int size = layout.degree(axis);
  if (size <= 1) return c10::intrusive_ptr<CountingProcessGroup>();
  if (size == layout.world_size()) return world;
  // The group's index: its coordinate on the other axis.
  const Axis other = axis == Axis::kData ? Axis::kStage : Axis::kData;
  const std::string name = std::string(axis == Axis::kData ? "data" : "stage") + "_of_" +
                           (other == Axis::kStage ? "stage" : "data") +
                           std::to_string(layout.coordinate(other));
  LAUNCH_ASSIGN_OR_RETURN(auto store, ConnectStore(env, /*host=*/false, timeout));
  StatusOr<c10::intrusive_ptr<CountingProcessGroup>> group =
      CreateGroupOver(store, name, layout.coordinate(axis), size, env, timeout);
  if (!group.ok())
    return group.status().WithContext("the " + std::string(axis == Axis::kData ? "data" : "stage") +
                                      "-parallel group of " + std::to_string(size) + " ranks");
  return group;
}

}  // namespace launch::trainer
