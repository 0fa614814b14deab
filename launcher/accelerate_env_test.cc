#include "launcher/accelerate_env.h"

#include <doctest/doctest.h>

#include "config/loader.h"

namespace launch::launcher {
namespace {

using config::LaunchConfig;

LaunchConfig Load(const std::string& yaml) {
  LaunchConfig cfg;
  REQUIRE(config::LoadYamlString(yaml, "acc.yaml", &cfg).ok());
  REQUIRE(config::Validate(&cfg).ok());
  return cfg;
}

TEST_CASE("FsdpAndDynamoSectionsBecomeAcceleratesVariables") {
  LaunchConfig cfg = Load(
      "distributed_type: FSDP\nmixed_precision: bf16\nnum_cpu_threads_per_process: 3\n"
      "fsdp_config: {fsdp_sharding_strategy: SHARD_GRAD_OP, offload_params: True,\n"
      "              transformer_layer_cls_to_wrap: Block}\n"
      "dynamo_config: {dynamo_backend: inductor, use_fullgraph: true}\n");
  auto env = AccelerateEnv(cfg, false, "", "/work");
  REQUIRE(env.ok());
  CHECK(env->at("ACCELERATE_MIXED_PRECISION") == "bf16");
  CHECK(env->at("ACCELERATE_USE_CPU") == "False");
  CHECK(env->at("ACCELERATE_USE_FSDP") == "true");
  CHECK(env->at("FSDP_SHARDING_STRATEGY") == "SHARD_GRAD_OP");
  CHECK(env->at("FSDP_OFFLOAD_PARAMS") == "true");  // lower case, as accelerate writes it
  CHECK(env->at("FSDP_TRANSFORMER_CLS_TO_WRAP") == "Block");
  CHECK(env->at("FSDP_VERSION") == "1");
  CHECK(env->at("FSDP_SYNC_MODULE_STATES") == "true");
  CHECK(env->count("FSDP_BACKWARD_PREFETCH") == 0);
  CHECK(env->at("ACCELERATE_DYNAMO_BACKEND") == "INDUCTOR");
  CHECK(env->at("ACCELERATE_DYNAMO_MODE") == "default");
  CHECK(env->at("ACCELERATE_DYNAMO_USE_FULLGRAPH") == "True");
  CHECK(env->at("ACCELERATE_DYNAMO_USE_DYNAMIC") == "False");
  CHECK(env->at("OMP_NUM_THREADS") == "3");
  CHECK(env->count("ACCELERATE_USE_DEEPSPEED") == 0);
}

TEST_CASE("DeepSpeedSetsItsOwnVariablesAndNoDynamo") {
  LaunchConfig cfg = Load(
      "distributed_type: DEEPSPEED\nmixed_precision: fp16\n"
      "deepspeed_config: {zero_stage: 3, offload_optimizer_device: CPU, zero3_init_flag: True,\n"
      "                   gradient_accumulation_steps: 4}\n");
  auto env = AccelerateEnv(cfg, false, "", "/work");
  REQUIRE(env.ok());
  CHECK(env->at("ACCELERATE_USE_DEEPSPEED") == "true");
  CHECK(env->at("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3");
  CHECK(env->at("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE") == "cpu");
  CHECK(env->at("ACCELERATE_DEEPSPEED_ZERO3_INIT") == "true");
  CHECK(env->at("ACCELERATE_GRADIENT_ACCUMULATION_STEPS") == "4");
  CHECK(env->at("ACCELERATE_CONFIG_DS_FIELDS") ==
        "zero_stage,offload_optimizer_device,zero3_init_flag,gradient_accumulation_steps,"
        "mixed_precision");
  CHECK(env->count("ACCELERATE_DYNAMO_BACKEND") == 0);
  // The working directory goes after the inherited PYTHONPATH, as accelerate puts it there.
  CHECK(env->at("PYTHONPATH") == "/work");
  CHECK(AccelerateEnv(cfg, false, "/mine", "/work")->at("PYTHONPATH") == "/mine:/work");
  CHECK(AccelerateEnv(cfg, false, "/mine", "")->count("PYTHONPATH") == 0);
}

TEST_CASE("FlagsOverrideTheFileAndRefusedCombinationsAreErrors") {
  LaunchConfig cfg = Load("distributed_type: MULTI_GPU\ndynamo_config: {dynamo_backend: eager}\n");
  REQUIRE(config::ApplySetting("dynamo_backend", "inductor",
                               config::Origin{config::Origin::Kind::kFlag, "--dynamo_backend"},
                               &cfg)
              .ok());
  REQUIRE(config::ApplySetting("debug", "true",
                               config::Origin{config::Origin::Kind::kFlag, "--debug"}, &cfg)
              .ok());
  auto env = AccelerateEnv(cfg, true, "", "/work");
  REQUIRE(env.ok());
  CHECK(env->at("ACCELERATE_DYNAMO_BACKEND") == "INDUCTOR");
  CHECK(env->at("ACCELERATE_DEBUG_MODE") == "true");
  CHECK(env->at("ACCELERATE_USE_CPU") == "True");

  LaunchConfig bad = Load(
      "distributed_type: FSDP\n"
      "fsdp_config: {cpu_ram_efficient_loading: true, sync_module_states: false}\n");
  CHECK(AccelerateEnv(bad, false, "", "/work").status().message().find("fsdp_sync_module_states") !=
        std::string::npos);
}

}  // namespace
}  // namespace launch::launcher
