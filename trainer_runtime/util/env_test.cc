// Unit tests for env.h (plain C++: this binary links no LibTorch).

#include "trainer_runtime/util/env.h"

#include <string>

#include <doctest/doctest.h>

namespace launch::trainer {
namespace {

TEST_CASE("ParseDistEnvDefaultsToSingleProcess") {
  auto env = ParseDistEnv({});
  REQUIRE(env.ok());
  CHECK(env->rank == 0);
  CHECK(env->world_size == 1);
  CHECK_FALSE(env->distributed());
}

TEST_CASE("ParseDistEnvReadsTorchrunContract") {
  auto env = ParseDistEnv({{"RANK", "1"},
                           {"WORLD_SIZE", "2"},
                           {"LOCAL_RANK", "1"},
                           {"MASTER_ADDR", "10.0.0.2"},
                           {"MASTER_PORT", "29600"},
                           {"TORCHELASTIC_RESTART_COUNT", "3"}});
  REQUIRE(env.ok());
  CHECK(env->rank == 1);
  CHECK(env->world_size == 2);
  CHECK(env->master_addr == "10.0.0.2");
  CHECK(env->master_port == 29600);
  CHECK(env->restart_count == 3);
  CHECK_FALSE(env->use_agent_store);
  auto agent = ParseDistEnv({{"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  REQUIRE(agent.ok());
  CHECK(agent->use_agent_store);
}

TEST_CASE("ParseDistEnvReadsInPlaceRecovery") {
  auto off = ParseDistEnv({});
  REQUIRE(off.ok());
  CHECK_FALSE(off->recover_in_place);
  CHECK(off->recover_generation == 0);
  auto on = ParseDistEnv({{"LAUNCH_RECOVER", "in_place"}, {"LAUNCH_RECOVER_GENERATION", "2"}});
  REQUIRE(on.ok());
  CHECK(on->recover_in_place);
  CHECK(on->recover_generation == 2);
  auto bad = ParseDistEnv({{"LAUNCH_RECOVER", "yes"}});
  CHECK(bad.status().message() ==
        "environment LAUNCH_RECOVER: expected in_place or restart, got 'yes'");
  CHECK_FALSE(ParseDistEnv({{"LAUNCH_RECOVER_GENERATION", "-1"}}).ok());
}

TEST_CASE("ParseDistEnvFallsBackToOpenMpi") {
  auto env = ParseDistEnv({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"}});
  REQUIRE(env.ok());
  CHECK(env->rank == 1);
  CHECK(env->world_size == 4);
}

TEST_CASE("ParseDistEnvRejectsBadValuesNamingTheVariable") {
  auto bad = ParseDistEnv({{"RANK", "x"}, {"WORLD_SIZE", "2"}});
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("RANK") != std::string::npos);
  auto too_big = ParseDistEnv({{"RANK", "2"}, {"WORLD_SIZE", "2"}});
  REQUIRE_FALSE(too_big.ok());
  CHECK(too_big.status().message().find("WORLD_SIZE 2") != std::string::npos);
  auto half = ParseDistEnv({{"RANK", "0"}});
  CHECK_FALSE(half.ok());
}

}  // namespace
}  // namespace launch::trainer
