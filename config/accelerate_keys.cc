// accelerate's settings: the flags `accelerate launch` takes and the config-file keys it writes,
// kept for the script's Accelerator (LaunchConfig::accelerate) or named as having no effect.

#include <algorithm>

#include "base/strings.h"
#include "config/key_table.h"
#include "config/scalars.h"

namespace launch::config {
namespace {

// ---- accelerate's settings for the script's Accelerator (see LaunchConfig::accelerate).
// `accelerate launch` takes each as a flag; a config file has the same names inside its
// fsdp_config / deepspeed_config / dynamo_config / megatron_lm_config / fp8_config /
// parallelism_config sections (LoadDocument). Values are passed on as written, as accelerate does.
const char* kGroupAccelerate =
    "";  // hidden from --help (about 110 flags); docs/launcher.md lists them

struct PassThrough {
  const char* name;
  bool is_switch;
};

const std::vector<PassThrough>& AccelerateArgs() {
  static const std::vector<PassThrough> args = {
      {"debug", true},
      {"num_cpu_threads_per_process", false},
      {"enable_cpu_affinity", true},
      {"dynamo_backend", false},
      {"dynamo_mode", false},
      {"dynamo_use_fullgraph", true},
      {"dynamo_use_dynamic", true},
      {"dynamo_use_regional_compilation", true},
      {"use_fsdp", true},
      {"use_deepspeed", true},
      {"use_megatron_lm", true},
      {"use_parallelism_config", true},
      {"fsdp_version", false},
      {"fsdp_offload_params", false},
      {"fsdp_min_num_params", false},
      {"fsdp_sharding_strategy", false},
      {"fsdp_reshard_after_forward", false},
      {"fsdp_auto_wrap_policy", false},
      {"fsdp_transformer_layer_cls_to_wrap", false},
      {"fsdp_backward_prefetch", false},
      {"fsdp_state_dict_type", false},
      {"fsdp_forward_prefetch", false},
      {"fsdp_use_orig_params", false},
      {"fsdp_cpu_ram_efficient_loading", false},
      {"fsdp_sync_module_states", false},
      {"fsdp_activation_checkpointing", false},
      {"deepspeed_config_file", false},
      {"zero_stage", false},
      {"offload_optimizer_device", false},
      {"offload_param_device", false},
      {"offload_optimizer_nvme_path", false},
      {"offload_param_nvme_path", false},
      {"gradient_accumulation_steps", false},
      {"gradient_clipping", false},
      {"zero3_init_flag", false},
      {"zero3_save_16bit_model", false},
      {"deepspeed_moe_layer_cls_names", false},
      {"megatron_lm_tp_degree", false},
      {"megatron_lm_use_custom_fsdp", false},
      {"megatron_lm_no_load_optim", false},
      {"megatron_lm_eod_mask_loss", false},
      {"megatron_lm_overlap_cpu_optimizer_d2h_h2d", false},
      {"megatron_lm_no_save_optim", false},
      {"megatron_lm_optimizer_cpu_offload", false},
      {"megatron_lm_use_precision_aware_optimizer", false},
      {"megatron_lm_decoder_last_pipeline_num_layers", false},
      {"megatron_lm_pp_degree", false},
      {"megatron_lm_num_micro_batches", false},
      {"megatron_lm_sequence_parallelism", false},
      {"megatron_lm_recompute_activations", false},
      {"megatron_lm_use_distributed_optimizer", false},
      {"megatron_lm_gradient_clipping", false},
      {"megatron_lm_recompute_granularity", false},
      {"megatron_lm_recompute_method", false},
      {"megatron_lm_recompute_num_layers", false},
      {"megatron_lm_attention_backend", false},
      {"megatron_lm_expert_model_parallel_size", false},
      {"megatron_lm_context_parallel_size", false},
      {"megatron_lm_attention_dropout", false},
      {"megatron_lm_hidden_dropout", false},
      {"megatron_lm_attention_softmax_in_fp32", false},
      {"megatron_lm_expert_tensor_parallel_size", false},
      {"megatron_lm_calculate_per_token_loss", false},
      {"megatron_lm_use_rotary_position_embeddings", false},
      {"fp8_backend", false},
      {"fp8_use_autocast_during_eval", true},
      {"fp8_margin", false},
      {"fp8_interval", false},
      {"fp8_format", false},
      {"fp8_amax_history_len", false},
      {"fp8_amax_compute_algo", false},
      {"fp8_override_linear_precision", false},
      {"fp8_opt_level", false},
      {"fp8_enable_fsdp_float8_all_gather", false},
      {"fp8_pad_inner_dim", false},
      {"parallelism_config_dp_replicate_size", false},
      {"parallelism_config_dp_shard_size", false},
      {"parallelism_config_tp_size", false},
      {"parallelism_config_cp_size", false},
      {"parallelism_config_cp_backend", false},
      {"parallelism_config_cp_comm_strategy", false},
      {"parallelism_config_sp_size", false},
      {"parallelism_config_sp_backend", false},
      {"parallelism_config_sp_seq_length", false},
      {"parallelism_config_sp_seq_length_is_variable", false},
      {"parallelism_config_sp_attn_implementation", false},
  };
  return args;
}

// accelerate launch flags for what launch does not run on: accepted; a value other than
// accelerate's default is named in the one no-effect warning.
struct Inert {
  const char* name;
  bool is_switch;
  std::vector<std::string> defaults;  // values that ask for nothing (lower case)
  const char* why;
};

const std::vector<Inert>& InertAccelerateArgs() {
  static const std::vector<Inert> args = {
      {"quiet",
       true,
       {"true", "false"},
       ""},  // accelerate's own tracebacks; launch prints one report
      {"tpu_cluster", true, {"false"}, "TPU"},
      {"no_tpu_cluster", true, {"true", "false"}, ""},
      {"tpu_use_sudo", true, {"false"}, "TPU"},
      {"vm", false, {}, "TPU"},
      {"env", false, {}, "TPU"},
      {"main_training_function", false, {"main"}, "TPU"},
      {"downcast_bf16", true, {"false", "no"}, "TPU"},
      {"aws_access_key_id", false, {}, "SageMaker"},
      {"aws_secret_access_key", false, {}, "SageMaker"},
      {"deepspeed_hostfile", false, {}, "launch starts every node itself"},
      {"deepspeed_exclusion_filter", false, {}, "launch starts every node itself"},
      {"deepspeed_inclusion_filter", false, {}, "launch starts every node itself"},
      {"deepspeed_multinode_launcher", false, {"standard"}, "launch starts every node itself"},
  };
  return args;
}

}  // namespace

void AddAccelerateKeys(std::vector<KeyDef>* table) {
  for (const PassThrough& a : AccelerateArgs()) {
    std::string name = a.name;
    KeyDef d = Key(name,
                   [name](const std::string& s, LaunchConfig* c) {
                     c->accelerate[name] = Trim(s);
                     return std::string();
                   })
                   .In(kFlagOnly)
                   .Flag({name}, kGroupAccelerate, "accelerate launch's flag, for the script");
    if (a.is_switch) d.Switch();
    table->push_back(d);
  }
  for (const Inert& a : InertAccelerateArgs()) {
    std::string name = a.name;
    std::vector<std::string> defaults = a.defaults;
    std::string why = a.why;
    KeyDef d =
        Key(name,
            [name, defaults, why](const std::string& s, LaunchConfig* c) {
              std::string l = ToLower(Trim(s));
              if (!why.empty() && std::find(defaults.begin(), defaults.end(), l) == defaults.end())
                c->no_effect.push_back(name + " (" + why + ")");
              return std::string();
            })
            .In(kFlagOnly)
            .Flag(name == "quiet" ? std::vector<std::string>{"quiet", "q"}
                                  : std::vector<std::string>{name},
                  kGroupAccelerate, "accelerate launch's flag; no effect here");
    if (a.is_switch) d.Switch();
    table->push_back(d);
  }
  // --tpu asks for hardware launch does not drive: an error, not a silent CPU run.
  table->push_back(Key("tpu",
                       [](const std::string& s, LaunchConfig*) {
                         bool v = false;
                         std::string err = ParseValue(s, &v);
                         if (!err.empty() || !v) return err;
                         return std::string(
                             "not supported: launch runs CPU and NVIDIA GPU workers, not TPUs");
                       })
                       .In(kFlagOnly)
                       .Flag({"tpu"}, kGroupAccelerate, "not supported")
                       .Switch());
  table->push_back(
      Key("mpirun_hostfile",
          Unsupported("launch starts its own workers; to spread them with MPI run `mpirun ... "
                      "launch ...` (launch reads OMPI_* / PMI_*)"))
          .In(kFlagOnly)
          .Flag({"mpirun_hostfile"}, kGroupAccelerate, "not supported"));
}

const std::map<std::string, std::vector<std::string>>& InertAccelerateKeys() {
  static const std::map<std::string, std::vector<std::string>> keys = {
      {"compute_environment", {"local_machine"}},
      {"use_mps_device", {"false"}},
      {"use_xpu", {"false"}},
      {"rdzv_backend", {"static", "c10d"}},
      {"same_network", {"*"}},
      {"main_training_function", {"main"}},
      {"downcast_bf16", {"false", "no"}},
      {"monitor_interval", {"*"}},
      {"start_method", {"*"}},
      {"standalone", {"*"}},
      {"commands", {}},
      {"command_file", {}},
      {"gpu_type", {"*"}},
      {"ipex_config", {}},
      {"mpirun_config", {}},
  };
  return keys;
}

const std::map<std::string, std::string>& AccelerateSections() {
  static const std::map<std::string, std::string> sections = {
      {"fsdp_config", "fsdp_"}, {"fp8_config", "fp8_"},     {"dynamo_config", "dynamo_"},
      {"deepspeed_config", ""}, {"megatron_lm_config", ""}, {"parallelism_config", ""}};
  return sections;
}

}  // namespace launch::config
