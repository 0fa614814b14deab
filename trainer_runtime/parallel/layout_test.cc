#include "trainer_runtime/parallel/layout.h"

#include <set>

#include "config/train_keys.h"
#include "trainer_runtime/util/doctest_torch.h"  // last (see there)

namespace launch::trainer {
namespace {

ParallelLayout Make(int world, int rank, int stages, int tensor, int context = 1) {
  StatusOr<ParallelLayout> layout =
      ParallelLayout::FromDegrees(world, rank, stages, tensor, context);
  REQUIRE_MESSAGE(layout.ok(), layout.status().ToString());
  return *layout;
}

using Groups = std::vector<std::vector<int>>;

TEST_CASE("LayoutGroupsAreMegatronsForSixteenRanksTensorTwoStagesFour") {
  // megatron/core/parallel_state.py's docstring: 16 GPUs, tensor 2, pipeline 4 (data 2).
  const ParallelLayout l = Make(16, 0, /*stages=*/4, /*tensor=*/2);
  CHECK(l.degree(Axis::kTensor) == 2);
  CHECK(l.degree(Axis::kData) == 2);
  CHECK(l.degree(Axis::kStage) == 4);
  CHECK(l.AllGroups(Axis::kTensor) ==
        Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}});
  CHECK(l.AllGroups(Axis::kData) ==
        Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}});
  CHECK(l.AllGroups(Axis::kStage) ==
        Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}});
}

TEST_CASE("LayoutGroupsAreMegatronsWithAContextAxis") {
  // Megatron's order tp-cp-dp-pp: 16 ranks, tensor 2, context 2, stages 2 (data 2).
  const ParallelLayout l = Make(16, 0, /*stages=*/2, /*tensor=*/2, /*context=*/2);
  CHECK(l.degree(Axis::kContext) == 2);
  CHECK(l.degree(Axis::kData) == 2);
  CHECK(l.AllGroups(Axis::kTensor) ==
        Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}});
  CHECK(l.AllGroups(Axis::kContext) ==
        Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}});
  CHECK(l.AllGroups(Axis::kData) ==
        Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}});
  // Megatron's dp-cp groups: the ranks holding the same tensor shard of the same stage.
  CHECK(l.AllGroups(Axis::kReplica) ==
        Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}});
  CHECK(l.AllGroups(Axis::kStage) ==
        Groups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}});
  CHECK(AxisOf(Use::kGradient) == Axis::kReplica);
  CHECK(AxisOf(Use::kContext) == Axis::kContext);
  // The ranks that see the same rows (tensor x context) draw from one stream, the one rank
  // d + data x s of the unsplit job draws from; rank 0 of replica 0 of the last stage reports.
  CHECK(Make(16, 7, 2, 2, 2).RandomStream() == 1);
  CHECK(Make(16, 15, 2, 2, 2).RandomStream() == 3);
  CHECK(Make(4, 3, 2, 1).RandomStream() == 3);  // without those axes: the rank itself
  CHECK(l.main_rank() == 8);
  // Context ranks hold the whole of their shard: no folder of their own.
  CHECK(Make(16, 7, 2, 2, 2).ShardName() == "stage0_tensor1");
  CHECK(Make(4, 3, 1, 1, 2).ShardName().empty());
  CHECK(l.Describe() == "tensor 2 x context 2 x data 2 x stage 2");
  CHECK(Make(2, 0, 1, 1, 2).Describe() == "context 2");
  // Without a context axis the replica groups are the data groups.
  const ParallelLayout plain = Make(16, 0, 4, 2);
  CHECK(plain.AllGroups(Axis::kReplica) == plain.AllGroups(Axis::kData));
}

TEST_CASE("LayoutCoordinatesRankAtAndGroupsAgreeOnEveryRankOfFourAxes") {
  // 48 ranks: tensor 2 x context 2 x data 3 x stage 4.
  for (int rank = 0; rank < 48; ++rank) {
    const ParallelLayout l = Make(48, rank, /*stages=*/4, /*tensor=*/2, /*context=*/2);
    const int t = l.coordinate(Axis::kTensor), c = l.coordinate(Axis::kContext),
              d = l.coordinate(Axis::kData), s = l.coordinate(Axis::kStage);
    CHECK(t == rank % 2);
    CHECK(c == rank / 2 % 2);
    CHECK(d == rank / 4 % 3);
    CHECK(s == rank / 12);
    CHECK(l.RankAt(t, c, d, s) == rank);
    // The replica coordinate is context and data flattened, context inside.
    CHECK(l.coordinate(Axis::kReplica) == c + 2 * d);
    for (Axis axis : {Axis::kTensor, Axis::kContext, Axis::kData, Axis::kStage}) {
      const std::vector<int> group = l.GroupRanks(axis);
      CHECK(static_cast<int>(group.size()) == l.degree(axis));
      CHECK(group[static_cast<size_t>(l.coordinate(axis))] == rank);
      // Along one axis only the coordinate of that axis changes.
      for (int i = 0; i < l.degree(axis); ++i) {
        const int r = group[static_cast<size_t>(i)];
        CHECK(l.CoordinateOf(r, axis) == i);
        for (Axis other : {Axis::kTensor, Axis::kContext, Axis::kData, Axis::kStage})
          if (other != axis) CHECK(l.CoordinateOf(r, other) == l.coordinate(other));
      }
      // The group's index names it uniquely and alike on its ranks.
      const Groups all = l.AllGroups(axis);
      CHECK(all[static_cast<size_t>(l.GroupIndex(axis))] == group);
    }
  }
  // Each axis' groups partition the world.
  const ParallelLayout l = Make(48, 0, 4, 2, 2);
  for (Axis axis : {Axis::kTensor, Axis::kContext, Axis::kData, Axis::kStage, Axis::kReplica}) {
    std::set<int> seen;
    for (const auto& group : l.AllGroups(axis))
      for (int r : group) CHECK(seen.insert(r).second);
    CHECK(seen.size() == 48);
  }
}

TEST_CASE("LayoutNeighboursAlongTheStageAxisStopAtTheEnds") {
  // world 8 = tensor 1 x data 2 x stage 4: rank 3 is stage 1 of replica 1.
  const ParallelLayout l = Make(8, 3, 4, 1);
  CHECK(l.coordinate(Axis::kStage) == 1);
  CHECK(l.coordinate(Axis::kData) == 1);
  CHECK(l.Neighbour(Axis::kStage, -1) == 1);
  CHECK(l.Neighbour(Axis::kStage, +1) == 5);
  CHECK(Make(8, 1, 4, 1).Neighbour(Axis::kStage, -1) == -1);
  CHECK(Make(8, 7, 4, 1).Neighbour(Axis::kStage, +1) == -1);
  CHECK(l.Neighbour(Axis::kData, -1) == 2);
  CHECK(l.Neighbour(Axis::kTensor, +1) == -1);  // tensor degree 1
}

TEST_CASE("LayoutMainRankIsTheLastStageOfTheFirstReplicaAndUsesNameTheirAxes") {
  CHECK(Make(8, 0, 4, 1).main_rank() == 6);
  CHECK(Make(8, 0, 2, 2).main_rank() == 4);
  CHECK(Make(4, 0, 1, 1).main_rank() == 0);
  CHECK(AxisOf(Use::kGradient) == Axis::kReplica);
  CHECK(AxisOf(Use::kBatch) == Axis::kTensor);
  CHECK(AxisOf(Use::kStage) == Axis::kStage);
  CHECK(AxisOf(Use::kTensor) == Axis::kTensor);
}

TEST_CASE("LayoutShardNamesAndDescriptionNameOnlyTheAxesThatSplit") {
  CHECK(Make(4, 3, 1, 1).ShardName().empty());
  CHECK(Make(4, 3, 2, 1).ShardName() == "stage1");
  CHECK(Make(8, 5, 2, 2).ShardName() == "stage1_tensor1");
  CHECK(Make(8, 5, 2, 2).Describe() == "tensor 2 x data 2 x stage 2");
  CHECK(Make(4, 0, 2, 1).Describe() == "data 2 x stage 2");
  CHECK(Make(1, 0, 1, 1).Describe() == "1 process");
}

TEST_CASE("LayoutRefusesDegreesThatDoNotDivideTheWorldNamingTheKeys") {
  StatusOr<ParallelLayout> bad = ParallelLayout::FromDegrees(6, 0, 4, 1);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("train.parallel.stages") != std::string::npos);
  CHECK(bad.status().message().find("world size 6") != std::string::npos);
  bad = ParallelLayout::FromDegrees(6, 0, 1, 4);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("train.parallel.tensor") != std::string::npos);
  bad = ParallelLayout::FromDegrees(6, 0, 1, 1, 4);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("train.parallel.context") != std::string::npos);
  CHECK_FALSE(ParallelLayout::FromDegrees(4, 0, 1, 1, 0).ok());
  CHECK_FALSE(ParallelLayout::FromDegrees(4, 0, 0, 1).ok());
  CHECK_FALSE(ParallelLayout::FromDegrees(4, 4, 1, 1).ok());

  // Through the config's rules, as Accelerator::Create builds it.
  config::TrainConfig cfg;
  cfg.model.type = config::ModelType::kTransformer;  // the model with split layers
  cfg.data.type = config::DataType::kText;
  cfg.data.path = "text.txt";  // not read here
  cfg.parallel.tensor = 4;
  DistEnv env;
  env.world_size = 6;
  StatusOr<ParallelLayout> from_config = ParallelLayout::Create(cfg, env);
  REQUIRE_FALSE(from_config.ok());
  CHECK(from_config.status().message().find("train.parallel.tensor") != std::string::npos);
  env.world_size = 8;
  from_config = ParallelLayout::Create(cfg, env);
  REQUIRE(from_config.ok());
  CHECK(from_config->degree(Axis::kData) == 2);
}

TEST_CASE("ModePipelineIsDdpOverPipelineReplicasAndStagesComposeWithZero") {
  config::ParallelConfig p;
  p.mode = config::ParallelMode::kPipeline;
  CHECK(p.pipelined());
  CHECK(p.data_mode() == config::ParallelMode::kDdp);
  p.mode = config::ParallelMode::kZero;
  CHECK_FALSE(p.pipelined());
  p.stages = 2;
  CHECK(p.pipelined());
  CHECK(p.data_mode() == config::ParallelMode::kZero);
}

}  // namespace
}  // namespace launch::trainer
