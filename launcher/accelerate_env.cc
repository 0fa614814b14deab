#include "launcher/accelerate_env.h"

#include <algorithm>
#include <cstdlib>
#include <tuple>

#include "base/strings.h"

namespace launch::launcher {
namespace {

using Settings = std::map<std::string, std::string>;

std::string Upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

// accelerate's truthiness of a flag or config value (str_to_bool, and a bare switch = "true").
bool Truthy(const Settings& a, const std::string& key) {
  auto it = a.find(key);
  if (it == a.end()) return false;
  std::string v = ToLower(Trim(it->second));
  return v == "true" || v == "1" || v == "yes" || v == "y" || v == "on";
}

std::string Get(const Settings& a, const std::string& key, const std::string& fallback = "") {
  auto it = a.find(key);
  return it == a.end() || it->second.empty() ? fallback : it->second;
}

// Python's str() of a bool, which is what accelerate writes for its dynamo switches.
std::string PyBool(bool v) { return v ? "True" : "False"; }

}  // namespace

StatusOr<std::map<std::string, std::string>> AccelerateEnv(const config::LaunchConfig& cfg,
                                                           bool cpu_workers,
                                                           const std::string& pythonpath,
                                                           const std::string& cwd) {
  using config::DistributedType;
  const Settings& a = cfg.accelerate;
  std::map<std::string, std::string> env;
  const bool deepspeed =
      Truthy(a, "use_deepspeed") || cfg.distributed_type == DistributedType::kDeepSpeed;
  const bool fsdp = Truthy(a, "use_fsdp") || cfg.distributed_type == DistributedType::kFsdp;
  const bool megatron =
      Truthy(a, "use_megatron_lm") || cfg.distributed_type == DistributedType::kMegatronLm;
  if (deepspeed + fsdp + megatron > 1)
    return Status::InvalidConfig(
        "use_deepspeed, use_fsdp and use_megatron_lm exclude each other (accelerate refuses "
        "them together)");

  env["ACCELERATE_MIXED_PRECISION"] = cfg.mixed_precision;
  env["ACCELERATE_USE_CPU"] = PyBool(cpu_workers);
  if (Truthy(a, "debug")) env["ACCELERATE_DEBUG_MODE"] = "true";
  if (Truthy(a, "enable_cpu_affinity")) env["ACCELERATE_CPU_AFFINITY"] = "1";

  if (!deepspeed) {  // the DeepSpeed path sets neither dynamo nor the thread count
    std::string backend = Upper(Get(a, "dynamo_backend", "no"));
    env["ACCELERATE_DYNAMO_BACKEND"] = backend;
    env["ACCELERATE_DYNAMO_MODE"] = Get(a, "dynamo_mode", "default");
    env["ACCELERATE_DYNAMO_USE_FULLGRAPH"] = PyBool(Truthy(a, "dynamo_use_fullgraph"));
    env["ACCELERATE_DYNAMO_USE_DYNAMIC"] = PyBool(Truthy(a, "dynamo_use_dynamic"));
    env["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] =
        PyBool(Truthy(a, "dynamo_use_regional_compilation"));
    std::string threads = Get(a, "num_cpu_threads_per_process");
    if (!threads.empty()) env["OMP_NUM_THREADS"] = threads;
  }

  if (fsdp) {
    if (Truthy(a, "fsdp_cpu_ram_efficient_loading") && a.count("fsdp_sync_module_states") &&
        !Truthy(a, "fsdp_sync_module_states"))
      return Status::InvalidConfig(
          "fsdp_cpu_ram_efficient_loading needs fsdp_sync_module_states: true (accelerate "
          "refuses the combination)");
    env["ACCELERATE_USE_FSDP"] = "true";
    env["FSDP_VERSION"] = Get(a, "fsdp_version", "1");
    env["FSDP_SHARDING_STRATEGY"] = Get(a, "fsdp_sharding_strategy", "FULL_SHARD");
    env["FSDP_RESHARD_AFTER_FORWARD"] = ToLower(Get(a, "fsdp_reshard_after_forward", "true"));
    env["FSDP_OFFLOAD_PARAMS"] = ToLower(Get(a, "fsdp_offload_params", "false"));
    env["FSDP_MIN_NUM_PARAMS"] = Get(a, "fsdp_min_num_params", "100000000");
    const std::pair<const char*, const char*> optional[] = {
        {"fsdp_auto_wrap_policy", "FSDP_AUTO_WRAP_POLICY"},
        {"fsdp_transformer_layer_cls_to_wrap", "FSDP_TRANSFORMER_CLS_TO_WRAP"},
        {"fsdp_backward_prefetch", "FSDP_BACKWARD_PREFETCH"},
        {"fsdp_state_dict_type", "FSDP_STATE_DICT_TYPE"},
        {"fsdp_ignored_modules", "FSDP_IGNORED_MODULES"}};
    for (const auto& [arg, var] : optional)
      if (!Get(a, arg).empty()) env[var] = Get(a, arg);
    const std::pair<const char*, const char*> lowered[] = {
        {"fsdp_forward_prefetch", "false"},
        {"fsdp_use_orig_params", "true"},
        {"fsdp_cpu_ram_efficient_loading", "true"},
        {"fsdp_sync_module_states", "true"},
        {"fsdp_activation_checkpointing", "false"}};
    for (const auto& [arg, fallback] : lowered) env[Upper(arg)] = ToLower(Get(a, arg, fallback));
  }

  if (deepspeed) {
    env["ACCELERATE_USE_DEEPSPEED"] = "true";
    std::vector<std::string> fields;
    for (const std::string& f : Split(Get(a, "_deepspeed_config_fields"), ','))
      if (!Trim(f).empty()) fields.push_back(ToLower(Trim(f)));
    auto mp = cfg.origins.find("mixed_precision");
    if (mp != cfg.origins.end() && mp->second.kind == config::Origin::Kind::kFile)
      fields.push_back("mixed_precision");
    env["ACCELERATE_CONFIG_DS_FIELDS"] = Join(fields, ",");
    const std::tuple<const char*, const char*, bool> vars[] = {
        {"zero_stage", "ACCELERATE_DEEPSPEED_ZERO_STAGE", false},
        {"gradient_accumulation_steps", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", false},
        {"gradient_clipping", "ACCELERATE_GRADIENT_CLIPPING", true},
        {"offload_optimizer_device", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", true},
        {"offload_param_device", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", true},
        {"zero3_init_flag", "ACCELERATE_DEEPSPEED_ZERO3_INIT", true},
        {"zero3_save_16bit_model", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", true},
        {"deepspeed_config_file", "ACCELERATE_DEEPSPEED_CONFIG_FILE", false},
        {"deepspeed_moe_layer_cls_names", "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES", false}};
    for (const auto& [arg, var, lower] : vars) {
      std::string v = Get(a, arg);
      if (!v.empty()) env[var] = lower ? ToLower(v) : v;
    }
    // accelerate puts the working directory on PYTHONPATH for DeepSpeed's own imports.
    if (!cwd.empty()) env["PYTHONPATH"] = (pythonpath.empty() ? "" : pythonpath + ":") + cwd;
  }

  if (megatron) {
    env["ACCELERATE_USE_MEGATRON_LM"] = "true";
    const std::pair<const char*, const char*> defaults[] = {
        {"megatron_lm_tp_degree", "1"},
        {"megatron_lm_use_custom_fsdp", "False"},
        {"megatron_lm_pp_degree", "1"},
        {"megatron_lm_gradient_clipping", "1.0"},
        {"megatron_lm_no_load_optim", "False"},
        {"megatron_lm_eod_mask_loss", "False"},
        {"megatron_lm_no_save_optim", "False"},
        {"megatron_lm_optimizer_cpu_offload", "False"},
        {"megatron_lm_use_precision_aware_optimizer", "False"},
        {"megatron_lm_overlap_cpu_optimizer_d2h_h2d", "False"}};
    for (const auto& [arg, fallback] : defaults) env[Upper(arg)] = Get(a, arg, fallback);
    for (const auto& [arg, value] : a)
      if (StartsWith(arg, "megatron_lm_") && !value.empty()) env[Upper(arg)] = value;
  }

  if (cfg.mixed_precision == "fp8") {
    for (const auto& [arg, value] : a) {
      if (!StartsWith(arg, "fp8_") || value.empty()) continue;
      if (arg == "fp8_override_linear_precision") {
        std::vector<std::string> parts = Split(value, ',');
        const char* names[] = {"FPROP", "DGRAD", "WGRAD"};
        for (size_t i = 0; i < 3 && i < parts.size(); ++i)
          env[std::string("ACCELERATE_FP8_OVERRIDE_") + names[i]] = Trim(parts[i]);
      } else {
        env["ACCELERATE_" + Upper(arg)] = value;
      }
    }
  }

  if (Truthy(a, "use_parallelism_config")) {
    env["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true";
    const std::pair<const char*, const char*> defaults[] = {
        {"parallelism_config_dp_replicate_size", "1"}, {"parallelism_config_dp_shard_size", "1"},
        {"parallelism_config_tp_size", "1"},           {"parallelism_config_cp_size", "1"},
        {"parallelism_config_cp_backend", "torch"},    {"parallelism_config_sp_size", "1"},
        {"parallelism_config_sp_backend", "deepspeed"}};
    for (const auto& [arg, fallback] : defaults) env[Upper(arg)] = Get(a, arg, fallback);
    if (Get(a, "parallelism_config_cp_size", "1") != "1")
      env["PARALLELISM_CONFIG_CP_COMM_STRATEGY"] =
          Get(a, "parallelism_config_cp_comm_strategy", "allgather");
    if (Get(a, "parallelism_config_sp_size", "1") != "1") {
      for (const char* arg :
           {"parallelism_config_sp_seq_length", "parallelism_config_sp_seq_length_is_variable",
            "parallelism_config_sp_attn_implementation"})
        if (!Get(a, arg).empty()) env[Upper(arg)] = Get(a, arg);
    }
  }
  return env;
}

}  // namespace launch::launcher
