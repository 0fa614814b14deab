// Unit tests for env.h (plain C++: this binary links no LibTorch).

#include "trainer_runtime/util/env.h"

#include <map>
#include <string>
#include <utility>

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

TEST_CASE("ParseDistEnvCarriesCudaVisibleDevicesSetOrNot") {
  CHECK_FALSE(ParseDistEnv({})->cuda_visible_devices.has_value());
  CHECK(ParseDistEnv({{"CUDA_VISIBLE_DEVICES", "2,3"}})->cuda_visible_devices == "2,3");
  // Set but empty hides every device: it is not the same as unset.
  CHECK(ParseDistEnv({{"CUDA_VISIBLE_DEVICES", ""}})->cuda_visible_devices == "");
}

TEST_CASE("ParseTuningDefaultsWhenUnsetOrEmpty") {
  for (const auto& env :
       {std::map<std::string, std::string>{},
        std::map<std::string, std::string>{{"LAUNCH_GLOO_THREADS", ""},
                                           {"LAUNCH_SHM_ALLREDUCE", ""},
                                           {"LAUNCH_DDP_EXCHANGE_MAX_KB", ""},
                                           {"LAUNCH_DP_THREADS_PER_REPLICA", ""}}}) {
    auto t = ParseTuning(env);
    REQUIRE(t.ok());
    CHECK(t->gloo_threads == 2);
    CHECK(t->shm_allreduce);
    CHECK(t->ddp_exchange_max_bytes == 512u * 1024);
    CHECK(t->dp_threads_per_replica == 0);
  }
}

TEST_CASE("ParseTuningReadsEachVariable") {
  auto t = ParseTuning({{"LAUNCH_GLOO_THREADS", "1"},
                        {"LAUNCH_SHM_ALLREDUCE", "0"},
                        {"LAUNCH_DDP_EXCHANGE_MAX_KB", "0"},
                        {"LAUNCH_DP_THREADS_PER_REPLICA", "3"}});
  REQUIRE(t.ok());
  CHECK(t->gloo_threads == 1);
  CHECK_FALSE(t->shm_allreduce);
  CHECK(t->ddp_exchange_max_bytes == 0);
  CHECK(t->dp_threads_per_replica == 3);
  CHECK(ParseTuning({{"LAUNCH_DDP_EXCHANGE_MAX_KB", "64"}})->ddp_exchange_max_bytes == 65536);
  for (const char* off : {"false", "off", "Off", " 0 "})
    CHECK_FALSE(ParseTuning({{"LAUNCH_SHM_ALLREDUCE", off}})->shm_allreduce);
  for (const char* on : {"1", "true", "on"})
    CHECK(ParseTuning({{"LAUNCH_SHM_ALLREDUCE", on}})->shm_allreduce);
  // ParseDistEnv carries them.
  CHECK(ParseDistEnv({{"LAUNCH_GLOO_THREADS", "4"}})->tuning.gloo_threads == 4);
}

TEST_CASE("ParseDistEnvRefusesABadTuningValueNamingTheVariable") {
  const std::pair<const char*, const char*> bad[] = {{"LAUNCH_GLOO_THREADS", "0"},
                                                     {"LAUNCH_GLOO_THREADS", "65"},
                                                     {"LAUNCH_GLOO_THREADS", "two"},
                                                     {"LAUNCH_SHM_ALLREDUCE", "maybe"},
                                                     {"LAUNCH_DDP_EXCHANGE_MAX_KB", "-1"},
                                                     {"LAUNCH_DP_THREADS_PER_REPLICA", "0"},
                                                     {"LAUNCH_DP_THREADS_PER_REPLICA", "1.5"}};
  for (const auto& [name, value] : bad) {
    INFO(name << "=" << value);
    auto env = ParseDistEnv({{name, value}});
    REQUIRE_FALSE(env.ok());
    CHECK(env.status().code() == Status::Code::kInvalidConfig);
    CHECK(env.status().message().find(std::string("environment ") + name) != std::string::npos);
    CHECK(env.status().message().find(std::string("'") + value + "'") != std::string::npos);
  }
}

}  // namespace
}  // namespace launch::trainer
