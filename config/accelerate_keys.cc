// accelerate's settings: the flags `accelerate launch` takes and the config-file keys it writes,
// kept for the script's Accelerator (LaunchConfig::accelerate) or named as having no effect.

#include <yaml-cpp/yaml.h>

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

// ---- accelerate's sharding, for the built-in trainer (ApplyAccelerateSharding).

// An accelerate setting's origin: its line in a config section, or its flag.
const Origin* AccelerateOrigin(const LaunchConfig& c, const std::string& arg) {
  for (const std::string& key : {"accelerate." + arg, arg}) {
    auto it = c.origins.find(key);
    if (it != c.origins.end()) return &it->second;
  }
  return nullptr;
}

std::string Given(const LaunchConfig& c, const std::string& arg) {
  auto it = c.accelerate.find(arg);
  return it == c.accelerate.end() ? std::string() : Trim(it->second);
}

bool IsTrue(const std::string& v) {
  bool on = false;
  return !v.empty() && ParseValue(v, &on).empty() && on;
}

// What accelerate's settings ask the trainer for, and the settings that said so.
struct Sharding {
  ParallelMode mode = ParallelMode::kDdp;
  int zero_stage = 1;                // when mode is zero
  bool stage_named = true;           // false: accelerate's default stage, no setting named one
  bool hybrid = false;               // FSDP's HYBRID_SHARD*: shard within a host, replicate across
  std::vector<std::string> because;  // "distributed_type: FSDP at acc.yaml:1", ...
  int layer = 0;                     // the highest layer among them (OriginLayer)

  void Cite(const std::string& key, const std::string& value, const Origin* origin) {
    because.push_back(key + ": " + value + (origin ? " at " + origin->ToString() : ""));
    layer = std::max(layer, OriginLayer(origin));
  }
  std::string Means() const {
    return mode == ParallelMode::kZero
               ? "parallel.mode zero, zero_stage " + std::to_string(zero_stage)
               : std::string("parallel.mode ") + ToString(mode);
  }
};

// accelerate's FSDP_SHARDING_STRATEGY (utils/constants.py), in order: accelerate also takes the
// 1-based index, which is torch's ShardingStrategy value. torch spells the last
// _HYBRID_SHARD_ZERO2.
struct FsdpStrategy {
  const char* name;
  ParallelMode mode;
  int zero_stage;
  bool hybrid;
};
const FsdpStrategy kFsdpStrategies[] = {
    {"FULL_SHARD", ParallelMode::kZero, 3, false},
    {"SHARD_GRAD_OP", ParallelMode::kZero, 2, false},
    {"NO_SHARD", ParallelMode::kDdp, 0, false},
    {"HYBRID_SHARD", ParallelMode::kZero, 3, true},
    {"HYBRID_SHARD_ZERO2", ParallelMode::kZero, 2, true},
};

const FsdpStrategy* FindFsdpStrategy(const std::string& text) {
  std::string v = text;
  for (char& ch : v) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  if (StartsWith(v, "SHARDINGSTRATEGY.")) v = v.substr(17);
  while (StartsWith(v, "_")) v = v.substr(1);
  long long index = 0;
  if (ParseInt64(v, &index))
    return index >= 1 && index <= 5 ? &kFsdpStrategies[index - 1] : nullptr;
  for (const FsdpStrategy& s : kFsdpStrategies)
    if (v == s.name) return &s;
  return nullptr;
}

std::string Where(const Origin* o, const std::string& fallback) {
  return o ? o->ToString() : fallback;
}

// FSDP: fsdp_sharding_strategy (accelerate's older key), else fsdp_reshard_after_forward, which
// newer accelerate writes instead: a strategy name for FSDP1, true/false for FSDP2 (true frees
// parameters after forward: FULL_SHARD; false keeps them: SHARD_GRAD_OP). Neither: FULL_SHARD,
// accelerate's default.
Status FsdpSharding(const LaunchConfig& c, Sharding* s) {
  for (const char* arg : {"fsdp_sharding_strategy", "fsdp_reshard_after_forward"}) {
    const std::string v = Given(c, arg);
    if (v.empty()) continue;
    const Origin* o = AccelerateOrigin(c, arg);
    bool on = false;
    const FsdpStrategy* f = FindFsdpStrategy(v);
    if (!f && std::string(arg) == "fsdp_reshard_after_forward" && ParseValue(v, &on).empty())
      f = &kFsdpStrategies[on ? 0 : 1];
    if (!f)
      return Status::InvalidConfig(
          Where(o, arg) + ": " + arg + ": '" + v +
          "' is not one of FULL_SHARD (1), SHARD_GRAD_OP (2), NO_SHARD (3), HYBRID_SHARD (4), "
          "HYBRID_SHARD_ZERO2 (5)" +
          (std::string(arg) == "fsdp_reshard_after_forward" ? ", true, false" : ""));
    s->Cite(arg, v, o);
    s->mode = f->mode;
    s->zero_stage = f->zero_stage;
    s->hybrid = f->hybrid;
    return Status::Ok();
  }
  s->mode = ParallelMode::kZero;
  s->zero_stage = 3;
  s->stage_named = false;
  return Status::Ok();
}

// `key` of a mapping; a null node when `n` is no mapping or lacks it (a const yaml-cpp node's
// operator[] gives a node that throws when asked anything).
YAML::Node Child(const YAML::Node& n, const char* key) {
  if (!n.IsMap()) return YAML::Node();
  const YAML::Node c = n[key];
  return c ? c : YAML::Node();
}

// DeepSpeed's stage: zero_stage, else zero_optimization.stage of deepspeed_config_file (JSON,
// which yaml-cpp reads; DeepSpeed's default 0 when absent), else accelerate's default 2.
// `unused` collects the file's offload settings, which the trainer does not honour.
Status DeepSpeedSharding(const LaunchConfig& c, Sharding* s, std::vector<std::string>* unused) {
  std::string stage_text = Given(c, "zero_stage");
  const Origin* o = AccelerateOrigin(c, "zero_stage");
  std::string key = "zero_stage";
  const std::string file = Given(c, "deepspeed_config_file");
  if (stage_text.empty() && !file.empty() && ToLower(file) != "none") {
    const Origin* fo = AccelerateOrigin(c, "deepspeed_config_file");
    YAML::Node root;
    try {
      root = YAML::LoadFile(file);
    } catch (const YAML::Exception& e) {
      return Status::InvalidConfig(Where(fo, "deepspeed_config_file") +
                                   ": deepspeed_config_file: cannot read '" + file +
                                   "': " + e.what());
    }
    const YAML::Node zero = Child(root, "zero_optimization");
    const YAML::Node stage = Child(zero, "stage");
    stage_text = stage.IsScalar() ? stage.Scalar() : "0";
    for (const char* part : {"offload_optimizer", "offload_param"}) {
      const YAML::Node device = Child(Child(zero, part), "device");
      if (device.IsScalar() && ToLower(device.Scalar()) != "none")
        unused->push_back(file + ": zero_optimization." + part + ".device " + device.Scalar());
    }
    key = "zero_optimization.stage in " + file;
    o = fo;
  }
  if (stage_text.empty()) {
    s->mode = ParallelMode::kZero;
    s->zero_stage = 2;
    s->stage_named = false;
    return Status::Ok();
  }
  long long stage = -1;
  if (!ParseInt64(stage_text, &stage) || stage < 0 || stage > 3)
    return Status::InvalidConfig(Where(o, key) + ": " + key + ": '" + stage_text +
                                 "' is not one of 0, 1, 2, 3");
  s->Cite(key, stage_text, o);
  s->mode = stage == 0 ? ParallelMode::kDdp : ParallelMode::kZero;
  s->zero_stage = stage == 0 ? 1 : static_cast<int>(stage);
  return Status::Ok();
}

// Settings of accelerate's FSDP and DeepSpeed sections the built-in trainer does not honour,
// with the values that ask for nothing (lower case; empty = any value asks for something) and
// what to do instead. Those not listed either mean nothing to the trainer's own sharding
// (fsdp_version, prefetching, fsdp_use_orig_params, fsdp_sync_module_states: every rank starts
// from the same weights, fsdp_state_dict_type: checkpoints have the trainer's own layout) or
// are mapped (strategy, stage).
struct Unhonoured {
  const char* arg;
  std::vector<std::string> fine;
  const char* why;
};

const std::vector<Unhonoured>& FsdpUnhonoured() {
  static const std::vector<Unhonoured> keys = {
      {"fsdp_offload_params", {"false"}, "no CPU offload"},
      {"fsdp_activation_checkpointing", {"false"}, "no activation checkpointing"},
      {"fsdp_auto_wrap_policy", {"no_wrap"}, "the trainer picks its own units"},
      {"fsdp_transformer_layer_cls_to_wrap", {}, "the trainer picks its own units"},
      {"fsdp_min_num_params", {}, "the trainer picks its own units"},
      {"fsdp_ignored_modules", {}, "every parameter is sharded"},
  };
  return keys;
}

const std::vector<Unhonoured>& DeepSpeedUnhonoured() {
  static const std::vector<Unhonoured> keys = {
      {"offload_optimizer_device", {"none"}, "no offload"},
      {"offload_param_device", {"none"}, "no offload"},
      {"offload_optimizer_nvme_path", {"none"}, "no offload"},
      {"offload_param_nvme_path", {"none"}, "no offload"},
      {"zero3_init_flag", {"false"}, "every rank builds the model, then shards it"},
      {"zero3_save_16bit_model", {"false"}, "checkpoints keep the parameters' dtype"},
      {"gradient_accumulation_steps", {"1"}, "use train.gradient_accumulation_steps"},
      {"gradient_clipping", {}, "use train.max_grad_norm"},
      {"deepspeed_moe_layer_cls_names", {}, "no mixture-of-experts layers"},
  };
  return keys;
}

void PushOnce(std::vector<std::string>* warnings, std::string w) {
  if (std::find(warnings->begin(), warnings->end(), w) == warnings->end())
    warnings->push_back(std::move(w));
}

}  // namespace

// The precedence layer a value came from: flag 3 > environment 2 > file 1 > default or derived
// 0 (a derived value ranks as its default: no layer asked for it).
int OriginLayer(const Origin* o) {
  if (!o) return 0;
  switch (o->kind) {
    case Origin::Kind::kFlag:
      return 3;
    case Origin::Kind::kEnvironment:
      return 2;
    case Origin::Kind::kFile:
      return 1;
    case Origin::Kind::kDefault:
    case Origin::Kind::kDerived:
      return 0;
  }
  return 0;
}

Status ApplyAccelerateSharding(LaunchConfig* cfg) {
  const LaunchConfig& c = *cfg;
  const bool fsdp = c.distributed_type == DistributedType::kFsdp || IsTrue(Given(c, "use_fsdp"));
  const bool deepspeed =
      c.distributed_type == DistributedType::kDeepSpeed || IsTrue(Given(c, "use_deepspeed"));
  if (!fsdp && !deepspeed) return Status::Ok();
  if (fsdp && deepspeed)
    return Status::InvalidConfig(
        "use_deepspeed and use_fsdp (or distributed_type) exclude each other (accelerate "
        "refuses them together)");

  Sharding s;
  if (c.distributed_type == DistributedType::kFsdp ||
      c.distributed_type == DistributedType::kDeepSpeed) {
    auto it = c.origins.find("distributed_type");
    s.Cite("distributed_type", ToString(c.distributed_type),
           it == c.origins.end() ? nullptr : &it->second);
  } else {
    const char* flag = fsdp ? "use_fsdp" : "use_deepspeed";
    s.Cite(flag, "true", AccelerateOrigin(c, flag));
  }
  std::vector<std::string> unused;
  LAUNCH_RETURN_IF_ERROR(fsdp ? FsdpSharding(c, &s) : DeepSpeedSharding(c, &s, &unused));
  for (const Unhonoured& u : fsdp ? FsdpUnhonoured() : DeepSpeedUnhonoured()) {
    const std::string v = Given(c, u.arg);
    if (v.empty() || std::find(u.fine.begin(), u.fine.end(), ToLower(v)) != u.fine.end()) continue;
    const Origin* o = AccelerateOrigin(c, u.arg);
    unused.push_back(std::string(u.arg) + " " + v + (o ? " at " + o->ToString() : "") + ": " +
                     u.why);
  }

  // The train: keys, where given, against what accelerate's settings ask for. A higher layer
  // wins (flag > environment > file); two values from the same layer must agree, as
  // num_processes and nproc_per_node must.
  TrainConfig& t = cfg->train;
  auto train_origin = [&](const char* key) -> const Origin* {
    auto it = c.origins.find(key);
    return it == c.origins.end() || OriginLayer(&it->second) == 0 ? nullptr : &it->second;
  };
  const Origin* mode_o = train_origin("train.parallel.mode");
  const Origin* stage_o = train_origin("train.parallel.zero_stage");
  const bool mode_agrees = !mode_o || t.parallel.mode == s.mode;
  const bool stage_agrees = s.mode != ParallelMode::kZero || !stage_o || !s.stage_named ||
                            t.parallel.zero_stage == s.zero_stage;
  const std::string because = Join(s.because, ", ");
  if (!mode_agrees || !stage_agrees) {
    const Origin* o = !mode_agrees ? mode_o : stage_o;
    const int train_layer = std::max(OriginLayer(mode_o), OriginLayer(stage_o));
    if (train_layer == s.layer) {
      const std::string key =
          !mode_agrees ? "train.parallel.mode " + std::string(ToString(t.parallel.mode))
                       : "train.parallel.zero_stage " + std::to_string(t.parallel.zero_stage);
      return Status::InvalidConfig(o->ToString() + ": " + key + " disagrees with " + because +
                                   ", which the built-in trainer runs as " + s.Means() +
                                   "; give one of the two");
    }
    if (train_layer > s.layer) return Status::Ok();  // the train: key outranks accelerate's
  }
  const Origin derived{Origin::Kind::kDerived, because};
  if (!mode_o || !mode_agrees) {
    t.parallel.mode = s.mode;
    cfg->origins["train.parallel.mode"] = derived;
  }
  if (s.mode == ParallelMode::kZero && (!stage_o || (!stage_agrees && s.stage_named))) {
    t.parallel.zero_stage = s.zero_stage;
    cfg->origins["train.parallel.zero_stage"] = derived;
  }

  if (s.hybrid && c.max_nodes > 1)
    PushOnce(&cfg->warnings,
             because + ": the built-in trainer shards over every rank of every machine (" +
                 s.Means() +
                 "); sharding within a machine and replicating across machines is not built yet");
  if (!unused.empty())
    PushOnce(&cfg->warnings, "the built-in trainer runs " + because + " as " + s.Means() +
                                 "; these settings have no effect on it: " + Join(unused, "; "));
  return Status::Ok();
}

Status ApplyAccelerateTensorParallel(LaunchConfig* cfg) {
  const LaunchConfig& c = *cfg;
  std::string arg = "parallelism_config_tp_size";
  std::string value = Given(c, arg);
  if (value.empty() &&
      (c.distributed_type == DistributedType::kMegatronLm || IsTrue(Given(c, "use_megatron_lm")))) {
    arg = "megatron_lm_tp_degree";
    value = Given(c, arg);
  }
  if (value.empty()) return Status::Ok();
  const Origin* o = AccelerateOrigin(c, arg);
  const std::string where = o ? o->ToString() + ": " : std::string();
  int tp = 0;
  if (!ParseValue(value, &tp).empty() || tp < 1)
    return Status::InvalidConfig(where + arg + " " + value + ": expected a whole number >= 1");
  TrainConfig& t = cfg->train;
  auto given = c.origins.find("train.parallel.tensor");
  const Origin* train_o = given == c.origins.end() ? nullptr : &given->second;
  const int train_layer = OriginLayer(train_o);
  if (train_layer > 0 && t.parallel.tensor != tp) {
    if (train_layer == OriginLayer(o))
      return Status::InvalidConfig(train_o->ToString() + ": train.parallel.tensor " +
                                   std::to_string(t.parallel.tensor) + " disagrees with " + arg +
                                   " " + value + (o ? " at " + o->ToString() : "") +
                                   "; give one of the two");
    if (train_layer > OriginLayer(o)) return Status::Ok();  // the train: key outranks it
  }
  if (train_layer > 0 && t.parallel.tensor == tp) return Status::Ok();
  t.parallel.tensor = tp;
  cfg->origins["train.parallel.tensor"] =
      Origin{Origin::Kind::kDerived, arg + ": " + value + (o ? " at " + o->ToString() : "")};
  return Status::Ok();
}

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
      {"same_network", {"*"}},
      {"main_training_function", {"main"}},
      {"downcast_bf16", {"false", "no"}},
      {"monitor_interval", {"*"}},
      {"start_method", {"*"}},
      {"standalone", {"*"}},
      {"commands", {}},
      {"command_file", {}},
      {"gpu_type", {"*"}},
      {"ipex_config", {"false"}},  // per field: {ipex: false}
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
