#include "config/loader.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>

#include "base/strings.h"
#include "config/value_text.h"

namespace launch::config {
namespace {

// ---------------------------------------------------------------------------------------------
// Scalar parsing from strings. Each returns an error description ("" on success) that callers
// prefix with the location and key.

std::string ParseValue(const std::string& s, std::string* out) {
  *out = s;
  return "";
}

std::string ParseValue(const std::string& s, bool* out) {
  std::string l = ToLower(Trim(s));
  if (l == "true" || l == "yes" || l == "on" || l == "1") {
    *out = true;
  } else if (l == "false" || l == "no" || l == "off" || l == "0") {
    *out = false;
  } else {
    return "expected true or false, got '" + s + "'";
  }
  return "";
}

std::string ParseValue(const std::string& s, int64_t* out) {
  long long v = 0;
  if (!ParseInt64(s, &v)) {
    // Accept integral floats written as 1e3 or 20000.0.
    double d = 0;
    if (ParseDouble(s, &d) && std::floor(d) == d && std::fabs(d) < 9e15) {
      *out = static_cast<int64_t>(d);
      return "";
    }
    return "expected an integer, got '" + s + "'";
  }
  *out = v;
  return "";
}

std::string ParseValue(const std::string& s, int* out) {
  int64_t v = 0;
  std::string err = ParseValue(s, &v);
  if (!err.empty()) return err;
  if (v < INT32_MIN || v > INT32_MAX) return "value " + s + " is out of range";
  *out = static_cast<int>(v);
  return "";
}

std::string ParseValue(const std::string& s, uint64_t* out) {
  int64_t v = 0;
  std::string err = ParseValue(s, &v);
  if (!err.empty()) return err;
  if (v < 0) return "expected a non-negative integer, got '" + s + "'";
  *out = static_cast<uint64_t>(v);
  return "";
}

std::string ParseValue(const std::string& s, double* out) {
  if (!ParseDouble(s, out) || !std::isfinite(*out)) return "expected a number, got '" + s + "'";
  return "";
}

template <typename E>
using EnumTable = std::vector<std::pair<std::string, E>>;

template <typename E>
std::string ParseEnum(const std::string& s, const EnumTable<E>& table, E* out) {
  std::string l = ToLower(Trim(s));
  std::vector<std::string> names;
  for (const auto& [name, value] : table) {
    if (l == ToLower(name)) {
      *out = value;
      return "";
    }
    names.push_back(name);
  }
  std::string msg = "'" + s + "' is not one of " + Join(names, ", ");
  std::string near = ClosestMatch(s, names);
  if (!near.empty()) msg += " (did you mean '" + near + "'?)";
  return msg;
}

const EnumTable<ModelType> kModelTypes = {{"mlp", ModelType::kMlp},
                                          {"transformer", ModelType::kTransformer},
                                          {"cnn", ModelType::kCnn},
                                          {"torchscript", ModelType::kTorchScript}};
const EnumTable<DataType> kDataTypes = {{"synthetic", DataType::kSynthetic},
                                        {"csv", DataType::kCsv},
                                        {"text", DataType::kText},
                                        {"idx", DataType::kIdx}};
const EnumTable<LossType> kLossTypes = {{"auto", LossType::kAuto},
                                        {"cross_entropy", LossType::kCrossEntropy},
                                        {"mse", LossType::kMse},
                                        {"bce_with_logits", LossType::kBceWithLogits}};
const EnumTable<SaveModel> kSaveModel = {{"end", SaveModel::kEnd},
                                         {"checkpoints", SaveModel::kCheckpoints},
                                         {"never", SaveModel::kNever}};
const EnumTable<OptimizerType> kOptimizers = {
    {"sgd", OptimizerType::kSgd}, {"adam", OptimizerType::kAdam}, {"adamw", OptimizerType::kAdamW}};
const EnumTable<SchedulerType> kSchedulers = {{"constant", SchedulerType::kConstant},
                                              {"linear", SchedulerType::kLinear},
                                              {"cosine", SchedulerType::kCosine}};
const EnumTable<ParallelMode> kParallelModes = {{"none", ParallelMode::kNone},
                                                {"dp", ParallelMode::kDp},
                                                {"ddp", ParallelMode::kDdp},
                                                {"pipeline", ParallelMode::kPipeline}};
const EnumTable<PipelineSchedule> kSchedules = {{"gpipe", PipelineSchedule::kGPipe},
                                                {"1f1b", PipelineSchedule::k1F1B}};
const EnumTable<CommHook> kCommHooks = {{"none", CommHook::kNone}, {"bf16", CommHook::kBf16}};
const EnumTable<DistributedType> kDistributedTypes = {
    {"NO", DistributedType::kNo},
    {"MULTI_CPU", DistributedType::kMultiCpu},
    {"MULTI_GPU", DistributedType::kMultiGpu},
    {"FSDP", DistributedType::kFsdp},
    {"DEEPSPEED", DistributedType::kDeepSpeed},
    {"MEGATRON_LM", DistributedType::kMegatronLm}};

// "3" or "0:1,1:3" (torchrun's --tee/--redirects).
std::string ParseStreamSpec(const std::string& s, StreamSpec* out) {
  StreamSpec spec;
  auto parse_mask = [](const std::string& m, int* mask) {
    long long v = 0;
    if (!ParseInt64(m, &v) || v < 0 || v > 3) return false;
    *mask = static_cast<int>(v);
    return true;
  };
  const std::string kExpect =
      "expected 0 (none), 1 (stdout), 2 (stderr), 3 (both) or "
      "LOCAL_RANK:MASK pairs like '0:1,1:3', got '" +
      s + "'";
  if (s.find(':') == std::string::npos) {
    if (!parse_mask(s, &spec.all)) return kExpect;
  } else {
    for (const std::string& part : Split(s, ',')) {
      auto kv = Split(part, ':');
      long long rank = 0;
      int mask = 0;
      if (kv.size() != 2 || !ParseInt64(kv[0], &rank) || rank < 0 || !parse_mask(kv[1], &mask))
        return kExpect;
      spec.per_rank[static_cast<int>(rank)] = mask;
    }
  }
  *out = spec;
  return "";
}

std::string ParseNodes(const std::string& s, int* min_nodes, int* max_nodes) {
  auto parts = Split(Trim(s), ':');
  long long lo = 0, hi = 0;
  if (parts.size() == 1 && ParseInt64(parts[0], &lo)) {
    hi = lo;
  } else if (parts.size() != 2 || !ParseInt64(parts[0], &lo) || !ParseInt64(parts[1], &hi)) {
    return "expected N or MIN:MAX, got '" + s + "'";
  }
  if (lo < 1 || hi < lo || hi > 100000) return "expected 1 <= MIN <= MAX, got '" + s + "'";
  *min_nodes = static_cast<int>(lo);
  *max_nodes = static_cast<int>(hi);
  return "";
}

std::string ParsePort(const std::string& s, int* port) {
  int v = 0;
  std::string err = ParseValue(s, &v);
  if (!err.empty()) return err;
  if (v < 0 || v > 65535) return "port " + s + " is out of range 0..65535";
  *port = v;
  return "";
}

// "host:port", "[v6]:port".
std::string ParseEndpoint(const std::string& s, std::string* host, int* port) {
  std::string h, p;
  if (!s.empty() && s[0] == '[') {
    size_t close = s.find(']');
    if (close == std::string::npos) return "expected [IPv6]:PORT, got '" + s + "'";
    h = s.substr(1, close - 1);
    if (close + 1 < s.size()) {
      if (s[close + 1] != ':') return "expected [IPv6]:PORT, got '" + s + "'";
      p = s.substr(close + 2);
    }
  } else {
    size_t colon = s.rfind(':');
    if (colon == std::string::npos) {
      h = s;
    } else {
      h = s.substr(0, colon);
      p = s.substr(colon + 1);
    }
  }
  if (h.empty()) return "expected HOST:PORT, got '" + s + "'";
  *host = h;
  if (!p.empty()) return ParsePort(p, port);
  return "";
}

std::string ParseIntList(const std::string& s, std::vector<int>* out) {
  std::vector<int> v;
  for (const std::string& part : Split(s, ',')) {
    long long x = 0;
    if (!ParseInt64(part, &x) || x < 0)
      return "expected a comma-separated list of ranks, got '" + s + "'";
    v.push_back(static_cast<int>(x));
  }
  *out = v;
  return "";
}

// ---------------------------------------------------------------------------------------------
// Top-level keys: ONE table serves the YAML file, LAUNCH_* / PET_* variables, command-line flags
// (the launcher builds its flags and --help from FlagSettings()), --rdzv_conf and --print_config,
// so a key is named, parsed, validated and shown in one place.

using Setter = std::function<std::string(const std::string&, LaunchConfig*)>;
using Shower = std::function<std::string(const LaunchConfig&)>;

enum Place : unsigned {
  kYaml = 1,      // a top-level YAML key
  kEnv = 2,       // LAUNCH_<NAME> / PET_<NAME> for the name, the synonyms and the flag names
  kRdzvConf = 4,  // a key of `rdzv_conf:` / --rdzv_conf / PET_RDZV_CONF
  kFlagOnly = 8,  // a command-line flag and nothing else (accelerate's own flags)
};

struct KeyDef {
  std::string name;                   // canonical: accelerate's name where one exists
  std::vector<std::string> synonyms;  // other spellings (torchrun's), accepted everywhere
  Setter set;
  unsigned places = kYaml | kEnv;
  std::vector<std::string> flags;      // flag names, underscore spelling, no dashes ("t" = -t)
  std::string group, help;             // --help section and text
  const char* switch_value = nullptr;  // a flag without a value: given = set(switch_value)
  std::vector<std::string> records;    // keys whose origin a setting records (default: name)
  Shower show;                         // --print_config's value; none = not shown

  KeyDef& Syn(std::vector<std::string> s) {
    synonyms = std::move(s);
    return *this;
  }
  KeyDef& In(unsigned p) {
    places = p;
    return *this;
  }
  KeyDef& Flag(std::vector<std::string> names, const char* g, const char* h) {
    flags = std::move(names);
    group = g;
    help = h;
    return *this;
  }
  KeyDef& Switch(const char* value = "true") {
    switch_value = value;
    return *this;
  }
  KeyDef& Records(std::vector<std::string> keys) {
    records = std::move(keys);
    return *this;
  }
  KeyDef& Show(Shower s) {
    show = std::move(s);
    return *this;
  }
  const std::string& Label() const { return records.empty() ? name : records.front(); }
};

KeyDef Key(std::string name, Setter set) {
  KeyDef d;
  d.name = std::move(name);
  d.set = std::move(set);
  return d;
}

const char* kGroupProcs = "Processes";
const char* kGroupNodes = "Multiple machines and rendezvous";
const char* kGroupLogs = "Output and logs";
const char* kGroupProgram = "Program";
const char* kGroupFaults = "Failures and restarts";
const char* kGroupCompat = "Accepted for torchrun / accelerate command lines";

template <typename T>
Setter Field(T LaunchConfig::*member) {
  return [member](const std::string& s, LaunchConfig* c) { return ParseValue(s, &(c->*member)); };
}

Setter NonNegative(int LaunchConfig::*member) {
  return [member](const std::string& s, LaunchConfig* c) {
    int v = 0;
    std::string err = ParseValue(s, &v);
    if (!err.empty()) return err;
    if (v < 0) return "expected a value >= 0, got " + s;
    c->*member = v;
    return std::string();
  };
}

// Seconds in (0, 1e7] ([0, 1e7] when zero_ok).
Setter Seconds(double* (*field)(LaunchConfig*), bool zero_ok = false) {
  return [field, zero_ok](const std::string& s, LaunchConfig* c) {
    double v = 0;
    std::string err = ParseValue(s, &v);
    if (!err.empty()) return err;
    if (v < 0 || (v == 0 && !zero_ok) || v > 1e7)
      return std::string("expected a duration in seconds ") + (zero_ok ? ">= 0" : "> 0") +
             ", got " + s;
    *field(c) = v;
    return std::string();
  };
}

Setter AnyBool() {
  return [](const std::string& s, LaunchConfig*) {
    bool v = false;
    return ParseValue(s, &v);
  };
}

// Accepted without effect here; a warning says `why` unless the value is one of `harmless`
// (values that ask for what launch does anyway).
Setter NoEffect(const char* key, std::vector<std::string> harmless, const char* why) {
  return [key, harmless, why](const std::string& s, LaunchConfig* c) {
    std::string l = ToLower(Trim(s));
    if (std::find(harmless.begin(), harmless.end(), l) == harmless.end())
      c->warnings.push_back(std::string(key) + " '" + s + "' has no effect: " + why);
    return std::string();
  };
}

// A torchrun flag with no counterpart: a precise error instead of "unknown flag".
Setter Unsupported(const char* why) {
  return [why](const std::string&, LaunchConfig*) { return std::string("not supported: ") + why; };
}

std::string ParseSignals(const std::string& s, LaunchConfig* c);

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

const std::vector<KeyDef>& TopLevelTable() {
  static std::vector<KeyDef> table = {
      // ---- Processes
      Key("distributed_type",
          [](const std::string& s, LaunchConfig* c) {
            std::string u = Trim(s);
            for (char& ch : u) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
            if (u == "XLA" || (StartsWith(u, "MULTI_") && u != "MULTI_CPU" && u != "MULTI_GPU"))
              return "'" + s +
                     "': launch runs CPU and NVIDIA GPU workers only (NO, MULTI_CPU, "
                     "MULTI_GPU, FSDP, DEEPSPEED, MEGATRON_LM)";
            return ParseEnum(u, kDistributedTypes, &c->distributed_type);
          })
          .Flag({"multi_gpu"}, kGroupProcs,
                "GPU workers (accelerate --multi_gpu; distributed_type MULTI_GPU)")
          .Switch("MULTI_GPU")
          .Show([](const LaunchConfig& c) { return std::string(ToString(c.distributed_type)); }),
      Key("use_cpu",
          [](const std::string& s, LaunchConfig* c) {
            bool v = false;
            std::string err = ParseValue(s, &v);
            if (err.empty() && v) c->distributed_type = DistributedType::kMultiCpu;
            return err;
          })
          .Flag({"cpu"}, kGroupProcs, "CPU workers even where GPUs exist (accelerate --cpu)")
          .Switch()
          .Records({"use_cpu", "distributed_type"}),
      Key("num_processes",
          [](const std::string& s, LaunchConfig* c) {
            int v = 0;
            std::string err = ParseValue(s, &v);
            if (!err.empty()) return err;
            if (v < 1) return "expected at least 1 process, got " + s;
            c->num_processes = v;
            return std::string();
          })
          .Flag({"num_processes"}, kGroupProcs,
                "workers in total over all machines (accelerate's meaning)")
          .Show([](const LaunchConfig& c) {
            return c.num_processes ? std::to_string(c.num_processes) : "";
          }),
      Key("nproc_per_node",
          [](const std::string& s, LaunchConfig* c) {
            std::string l = ToLower(Trim(s));
            long long v = 0;
            if (l == "auto" || l == "gpu" || l == "cpu") {
              c->nproc_per_node = l;
            } else if (ParseInt64(l, &v) && v >= 1 && v <= 4096) {
              c->nproc_per_node = std::to_string(v);
            } else {
              return "expected a number >= 1, 'auto', 'gpu' or 'cpu', got '" + s + "'";
            }
            return std::string();
          })
          .Flag({"nproc_per_node"}, kGroupProcs,
                "workers on this machine: N (default 1), gpu (one per visible GPU), cpu (one "
                "per CPU slot) or auto (GPUs, else CPU slots)")
          .Show([](const LaunchConfig& c) { return c.nproc_per_node; }),
      Key("gpu_ids",
          [](const std::string& s, LaunchConfig* c) {
            std::string t = Trim(s);
            if (ToLower(t) != "all") {
              for (const std::string& id : Split(t, ',')) {
                long long v = 0;
                if (!ParseInt64(id, &v) || v < 0)
                  return "expected 'all' or a comma-separated list of GPU ids, got '" + s + "'";
              }
            }
            c->gpu_ids = ToLower(t) == "all" ? "all" : t;
            return std::string();
          })
          .Flag({"gpu_ids"}, kGroupProcs, "GPUs to use, e.g. 0,2 (CUDA_VISIBLE_DEVICES)")
          .Show([](const LaunchConfig& c) { return c.gpu_ids; }),
      Key("mixed_precision",
          [](const std::string& s, LaunchConfig* c) {
            std::string l = ToLower(Trim(s));
            if (l == "false") l = "no";  // unquoted `no` in a YAML 1.1 writer
            if (l != "no" && l != "bf16" && l != "fp16" && l != "fp8") {
              std::string msg = "'" + s + "' is not one of no, bf16, fp16, fp8";
              std::string near = ClosestMatch(l, {"no", "bf16", "fp16", "fp8"});
              if (!near.empty()) msg += " (did you mean '" + near + "'?)";
              return msg;
            }
            c->mixed_precision = l;
            return std::string();
          })
          .Flag({"mixed_precision"}, kGroupProcs,
                "no | bf16 | fp16 | fp8 (`train`: bf16 is CPU autocast; fp16 and fp8 need a GPU)")
          .Show([](const LaunchConfig& c) { return c.mixed_precision; }),
      // Older accelerate files say `fp16: true` instead of `mixed_precision: fp16`.
      Key("fp16",
          [](const std::string& s, LaunchConfig* c) {
            bool v = false;
            std::string err = ParseValue(s, &v);
            if (err.empty() && v) c->mixed_precision = "fp16";
            return err;
          })
          .In(kYaml),
      Key("virtual_local_rank", Field(&LaunchConfig::virtual_local_rank))
          .Flag({"virtual_local_rank"}, kGroupProcs,
                "every worker gets LOCAL_RANK=0 and sees only its own GPU (torchrun's meaning)")
          .Switch()
          .Show([](const LaunchConfig& c) { return Bool(c.virtual_local_rank); }),

      // ---- Multiple machines and rendezvous
      Key("num_machines",
          [](const std::string& s, LaunchConfig* c) {
            return ParseNodes(s, &c->min_nodes, &c->max_nodes);
          })
          .Syn({"nnodes"})
          .Flag({"num_machines", "nnodes"}, kGroupNodes, "machines: N or MIN:MAX")
          .Show([](const LaunchConfig& c) {
            return c.min_nodes == c.max_nodes
                       ? std::to_string(c.min_nodes)
                       : std::to_string(c.min_nodes) + ":" + std::to_string(c.max_nodes);
          }),
      Key("machine_rank",
          [](const std::string& s, LaunchConfig* c) {
            int v = 0;
            std::string err = ParseValue(s, &v);
            if (!err.empty()) return err;
            if (v < -1) return "expected a node rank >= 0, got " + s;
            c->machine_rank = v;
            return std::string();
          })
          .Syn({"node_rank"})
          .Flag({"machine_rank", "node_rank"}, kGroupNodes,
                "this machine's rank (assigned by the rendezvous when absent)")
          .Show([](const LaunchConfig& c) {
            return c.machine_rank < 0 ? "" : std::to_string(c.machine_rank);
          }),
      Key("main_process_ip", Field(&LaunchConfig::main_process_ip))
          .Syn({"master_addr"})
          .Flag({"main_process_ip", "master_addr"}, kGroupNodes,
                "rendezvous host (MASTER_ADDR on one machine)")
          .Show([](const LaunchConfig& c) { return c.main_process_ip; }),
      Key("main_process_port",
          [](const std::string& s, LaunchConfig* c) { return ParsePort(s, &c->main_process_port); })
          .Syn({"master_port"})
          .Flag({"main_process_port", "master_port"}, kGroupNodes,
                "rendezvous port (0 = pick a free port)")
          .Show([](const LaunchConfig& c) {
            return c.main_process_port < 0 ? "" : std::to_string(c.main_process_port);
          }),
      Key("rdzv_endpoint",
          [](const std::string& s, LaunchConfig* c) {
            return ParseEndpoint(s, &c->main_process_ip, &c->main_process_port);
          })
          .Flag({"rdzv_endpoint"}, kGroupNodes, "HOST:PORT or [IPv6]:PORT")
          .Records({"main_process_ip", "main_process_port"}),
      Key("rdzv_token", Field(&LaunchConfig::rdzv_token))
          .Flag({"rdzv_token"}, kGroupNodes,
                "shared secret for the rendezvous (or env LAUNCH_RDZV_TOKEN)")
          .Show([](const LaunchConfig& c) {
            return c.rdzv_token.empty() ? "" : std::string("(set, hidden)");
          }),
      Key("rdzv_local_addr", Field(&LaunchConfig::rdzv_local_addr))
          .Syn({"local_addr"})
          .Flag({"rdzv_local_addr", "local_addr"}, kGroupNodes,
                "this machine's address towards the rendezvous (multi-homed hosts)")
          .Show([](const LaunchConfig& c) { return c.rdzv_local_addr; }),
      Key("rdzv_conf", nullptr)  // SetKey applies each KEY=VALUE through this table
          .Flag({"rdzv_conf"}, kGroupNodes,
                "KEY=VALUE[,KEY=VALUE] (torchrun's): join_timeout, last_call_timeout, "
                "heartbeat_timeout, keep_alive_interval, keep_alive_max_attempt"),
      Key("join_timeout", Seconds([](LaunchConfig* c) { return &c->rdzv_conf.join_timeout_s; }))
          .In(kYaml | kEnv | kRdzvConf)
          .Flag({"join_timeout"}, kGroupNodes, "seconds to wait for the machines (600)")
          .Records({"rdzv_conf.join_timeout"})
          .Show([](const LaunchConfig& c) { return Num(c.rdzv_conf.join_timeout_s); }),
      Key("last_call_timeout",
          Seconds([](LaunchConfig* c) { return &c->rdzv_conf.last_call_timeout_s; }, true))
          .In(kYaml | kEnv | kRdzvConf)
          .Flag({"last_call_timeout"}, kGroupNodes,
                "seconds to wait for more machines once MIN arrived (1)")
          .Records({"rdzv_conf.last_call_timeout"})
          .Show([](const LaunchConfig& c) { return Num(c.rdzv_conf.last_call_timeout_s); }),
      Key("heartbeat_timeout",
          Seconds([](LaunchConfig* c) { return &c->rdzv_conf.heartbeat_timeout_s; }))
          .In(kYaml | kEnv | kRdzvConf)
          .Flag({"heartbeat_timeout"}, kGroupNodes,
                "seconds of silence before a machine is declared lost (5)")
          .Records({"rdzv_conf.heartbeat_timeout"})
          .Show([](const LaunchConfig& c) { return Num(c.rdzv_conf.heartbeat_timeout_s); }),
      // torchrun's keep-alive pair: a node is lost after keep_alive_max_attempt missed
      // keep-alives keep_alive_interval seconds apart, so heartbeat_timeout is their product.
      Key("keep_alive_interval",
          [](const std::string& s, LaunchConfig* c) {
            std::string err =
                Seconds([](LaunchConfig* x) { return &x->rdzv_conf.keep_alive_interval_s; })(s, c);
            if (err.empty())
              c->rdzv_conf.heartbeat_timeout_s =
                  c->rdzv_conf.keep_alive_interval_s * c->rdzv_conf.keep_alive_max_attempt;
            return err;
          })
          .In(kRdzvConf)
          .Records({"rdzv_conf.heartbeat_timeout"}),
      Key("keep_alive_max_attempt",
          [](const std::string& s, LaunchConfig* c) {
            int v = 0;
            std::string err = ParseValue(s, &v);
            if (!err.empty()) return err;
            if (v < 1) return "expected a count >= 1, got " + s;
            c->rdzv_conf.keep_alive_max_attempt = v;
            c->rdzv_conf.heartbeat_timeout_s = c->rdzv_conf.keep_alive_interval_s * v;
            return std::string();
          })
          .In(kRdzvConf)
          .Records({"rdzv_conf.heartbeat_timeout"}),
      Key("read_timeout",
          NoEffect("rdzv_conf read_timeout", {}, "every rendezvous message has its own deadline"))
          .In(kRdzvConf),
      Key("close_timeout", NoEffect("rdzv_conf close_timeout", {},
                                    "launch's rendezvous closes once the round is decided"))
          .In(kRdzvConf),
      Key("timeout", NoEffect("rdzv_conf timeout", {},
                              "it configures etcd, which launch "
                              "does not use"))
          .In(kRdzvConf),
      Key("store_type", NoEffect("rdzv_conf store_type", {},
                                 "workers create their own TCPStore at MASTER_ADDR:MASTER_PORT"))
          .In(kRdzvConf),
      Key("is_host", NoEffect("rdzv_conf is_host", {},
                              "the node that can bind the endpoint hosts the rendezvous"))
          .In(kRdzvConf),
      Key("run_id", Field(&LaunchConfig::run_id))
          .Syn({"rdzv_id"})
          .Flag({"run_id", "rdzv_id"}, kGroupNodes, "job id shared by all machines")
          .Show([](const LaunchConfig& c) { return c.run_id; }),
      Key("role", Field(&LaunchConfig::role))
          .Flag({"role"}, kGroupNodes, "worker role name (ROLE_NAME)")
          .Show([](const LaunchConfig& c) { return c.role; }),

      // ---- Failures and restarts
      Key("max_restarts", NonNegative(&LaunchConfig::max_restarts))
          .Flag({"max_restarts"}, kGroupFaults,
                "restart the whole group up to N times after a failure")
          .Show([](const LaunchConfig& c) { return std::to_string(c.max_restarts); }),
      Key("stop_grace", Seconds([](LaunchConfig* c) { return &c->stop_grace_s; }))
          .Syn({"shutdown_timeout"})
          .Flag({"stop_grace", "shutdown_timeout"}, kGroupFaults,
                "seconds between SIGTERM and SIGKILL when stopping workers (30)")
          .Show([](const LaunchConfig& c) { return Num(c.stop_grace_s); }),

      // ---- Output and logs
      Key("log_dir", Field(&LaunchConfig::log_dir))
          .Flag({"log_dir"}, kGroupLogs, "per-rank log files under DIR/RUN_ID/attempt_K/")
          .Show([](const LaunchConfig& c) { return c.log_dir; }),
      Key("tee", [](const std::string& s, LaunchConfig* c) { return ParseStreamSpec(s, &c->tee); })
          .Flag({"tee", "t"}, kGroupLogs,
                "copy streams to log files too: 1 stdout, 2 stderr, 3 both, or 0:1,1:3 per "
                "local rank")
          .Show([](const LaunchConfig& c) { return StreamSpecText(c.tee); }),
      Key("redirects",
          [](const std::string& s, LaunchConfig* c) { return ParseStreamSpec(s, &c->redirects); })
          .Flag({"redirects", "r"}, kGroupLogs,
                "send streams to log files only (same values as --tee)")
          .Show([](const LaunchConfig& c) { return StreamSpecText(c.redirects); }),
      Key("local_ranks_filter",
          [](const std::string& s, LaunchConfig* c) {
            return ParseIntList(s, &c->local_ranks_filter);
          })
          .Flag({"local_ranks_filter"}, kGroupLogs,
                "show only these local ranks on the console, e.g. 0 or 0,1")
          .Show([](const LaunchConfig& c) {
            return c.local_ranks_filter.empty() ? "" : ListText(c.local_ranks_filter);
          }),

      // ---- Program
      Key("python", Field(&LaunchConfig::python))
          .Flag({"python"}, kGroupProgram,
                "interpreter for Python programs (default: PYTHON_EXEC, else python3)")
          .Show([](const LaunchConfig& c) { return c.python; }),
      Key("no_python", Field(&LaunchConfig::no_python))
          .Flag({"no_python"}, kGroupProgram, "run the program as given, never via python")
          .Switch(),
      Key("module", Field(&LaunchConfig::run_module))
          .In(kEnv)
          .Flag({"module", "m"}, kGroupProgram, "the program is a Python module (python -u -m)")
          .Switch(),
      Key("run_path", Field(&LaunchConfig::run_path))
          .In(kEnv)
          .Flag({"run_path"}, kGroupProgram,
                "the program is a Python script whatever its name (python -u PROGRAM)")
          .Switch(),

      // ---- Accepted so torchrun and accelerate command lines work unchanged
      Key("monitor_interval",
          [](const std::string& s, LaunchConfig*) {
            double v = 0;
            return ParseValue(s, &v);
          })
          .In(kEnv)
          .Flag({"monitor_interval"}, kGroupCompat,
                "no effect: launch sees a worker's exit at once"),
      Key("start_method", NoEffect("start_method", {"spawn", "fork", "forkserver"},
                                   "launch starts every worker as a new process"))
          .In(kEnv)
          .Flag({"start_method"}, kGroupCompat, "no effect: every worker is a new process"),
      Key("rdzv_backend", NoEffect("rdzv_backend", {"static", "c10d"},
                                   "launch always uses its own TCP rendezvous at rdzv_endpoint"))
          .In(kEnv)
          .Flag({"rdzv_backend"}, kGroupCompat, "no effect: launch uses its own rendezvous"),
      Key("standalone", AnyBool())
          .In(kEnv)
          .Flag({"standalone"}, kGroupCompat,
                "no effect: one machine with a free port is the default")
          .Switch(),
      Key("same_network", AnyBool())
          .In(kEnv)
          .Flag({"same_network"}, kGroupCompat, "no effect: one rendezvous serves every network")
          .Switch(),
      Key("signals_to_handle", ParseSignals)
          .In(kEnv)
          .Flag({"signals_to_handle"}, kGroupCompat,
                "no effect: launch always stops on TERM, INT, HUP, QUIT and forwards USR1, USR2"),
      Key("event_log_handler",
          [](const std::string& s, LaunchConfig*) {
            return ToLower(Trim(s)) == "null"
                       ? std::string()
                       : "not supported: launch has no event-log handlers; only 'null' is "
                         "accepted";
          })
          .In(kEnv)
          .Flag({"event_log_handler"}, kGroupCompat, "only 'null' (no event-log handlers)"),
      Key("logs_specs", Unsupported("launch has no Python LogsSpecs plugins; --log_dir, --tee, "
                                    "--redirects and --local_ranks_filter choose where output "
                                    "goes"))
          .In(kEnv)
          .Flag({"logs_specs"}, kGroupCompat, "not supported (a Python plugin)"),
      Key("numa_binding", Unsupported("launch does not bind workers to NUMA nodes; run the "
                                      "program under numactl (launch -- numactl ARGS python3 "
                                      "-u train.py)"))
          .In(kEnv)
          .Flag({"numa_binding"}, kGroupCompat, "not supported; use numactl"),
      Key("duplicate_stdout_filters",
          Unsupported("launch does not copy matching lines into a separate file; --tee keeps "
                      "every line in per-rank files"))
          .In(kEnv)
          .Flag({"duplicate_stdout_filters"}, kGroupCompat, "not supported; use --tee"),
      Key("duplicate_stderr_filters",
          Unsupported("launch does not copy matching lines into a separate file; --tee keeps "
                      "every line in per-rank files"))
          .In(kEnv)
          .Flag({"duplicate_stderr_filters"}, kGroupCompat, "not supported; use --tee"),
  };
  static const bool extended = [] {
    AddAccelerateKeys(&table);
    return true;
  }();
  (void)extended;
  return table;
}

std::string ParseSignals(const std::string& s, LaunchConfig*) {
  const std::vector<std::string> known = {"SIGTERM", "SIGINT",  "SIGHUP",
                                          "SIGQUIT", "SIGUSR1", "SIGUSR2"};
  for (const std::string& item : Split(s, ',')) {
    std::string sig = Trim(item);
    std::string upper = sig;
    for (char& ch : upper) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    if (!StartsWith(upper, "SIG")) upper = "SIG" + upper;
    if (std::find(known.begin(), known.end(), upper) == known.end())
      return "launch stops the workers on SIGTERM, SIGINT, SIGHUP and SIGQUIT and forwards "
             "SIGUSR1 and SIGUSR2; '" +
             sig + "' cannot be chosen";
  }
  return "";
}

// accelerate config keys that change nothing here, with the values that ask for nothing (a
// value outside them is named in the one no-effect warning; "*" = any value).
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

// accelerate's config sections whose keys are accelerate's flag names (the prefix is added
// when missing, as accelerate does: fsdp_config's `sharding_strategy` is fsdp_sharding_strategy).
const std::map<std::string, std::string>& AccelerateSections() {
  static const std::map<std::string, std::string> sections = {
      {"fsdp_config", "fsdp_"}, {"fp8_config", "fp8_"},     {"dynamo_config", "dynamo_"},
      {"deepspeed_config", ""}, {"megatron_lm_config", ""}, {"parallelism_config", ""}};
  return sections;
}

// A value as accelerate passes it on: scalars as written, a list as "a,b".
std::string AccelerateText(const YAML::Node& v) {
  if (v.IsScalar()) return v.Scalar();
  std::vector<std::string> items;
  if (v.IsSequence())
    for (const YAML::Node& item : v) items.push_back(item.IsScalar() ? item.Scalar() : "");
  return Join(items, ",");
}

std::string Canonical(const std::string& key) {
  std::string k = ToLower(Trim(key));
  std::replace(k.begin(), k.end(), '-', '_');
  return k;
}

// The key named `key` (its name or a synonym) among those that may be given at `places`.
const KeyDef* FindKey(const std::string& key, unsigned places) {
  std::string k = Canonical(key);
  for (const KeyDef& def : TopLevelTable()) {
    if ((def.places & places) == 0) continue;
    if (def.name == k) return &def;
    for (const auto& syn : def.synonyms)
      if (syn == k) return &def;
  }
  return nullptr;
}

std::vector<std::string> NamesAt(unsigned places) {
  std::vector<std::string> names;
  for (const KeyDef& def : TopLevelTable()) {
    if ((def.places & places) == 0) continue;
    names.push_back(def.name);
    for (const auto& syn : def.synonyms) names.push_back(syn);
  }
  if (places & kYaml) names.push_back("train");
  return names;
}

std::vector<std::string> AllTopLevelNames() { return NamesAt(kYaml | kEnv); }

std::string NearMiss(const std::string& key, const std::vector<std::string>& names);
Status ApplyRdzvConf(const std::string& text, const Origin& origin, const std::string& where,
                     LaunchConfig* cfg);

// Sets `def` from `value`; records the origin under the key(s) it sets.
Status SetKey(const KeyDef& def, const std::string& value, const Origin& origin,
              const std::string& where, LaunchConfig* cfg) {
  if (!def.set) return ApplyRdzvConf(value, origin, where, cfg);  // rdzv_conf: a list of keys
  std::string err = def.set(value, cfg);
  if (!err.empty()) return Status::InvalidConfig(where + ": " + err);
  if (def.records.empty()) cfg->origins[def.name] = origin;
  for (const std::string& k : def.records) cfg->origins[k] = origin;
  if (def.name == "mixed_precision" || def.name == "fp16")
    cfg->train.mixed_precision = cfg->mixed_precision;
  return Status::Ok();
}

// torchrun's --rdzv_conf text: KEY=VALUE[,KEY=VALUE...], keys from the table's rdzv_conf set.
Status ApplyRdzvConf(const std::string& text, const Origin& origin, const std::string& where,
                     LaunchConfig* cfg) {
  for (const std::string& kv : Split(text, ',')) {
    if (Trim(kv).empty()) continue;
    size_t eq = kv.find('=');
    if (eq == std::string::npos)
      return Status::InvalidConfig(where + ": expected KEY=VALUE, got '" + kv + "'");
    std::string key = Canonical(kv.substr(0, eq));
    const KeyDef* def = FindKey(key, kRdzvConf);
    if (!def)
      return Status::InvalidConfig(where + ": unknown key '" + key + "'" +
                                   NearMiss(key, NamesAt(kRdzvConf)));
    LAUNCH_RETURN_IF_ERROR(SetKey(*def, Trim(kv.substr(eq + 1)), origin, where + ": " + key, cfg));
  }
  return Status::Ok();
}

std::string NearMiss(const std::string& key, const std::vector<std::string>& names) {
  std::string near = ClosestMatch(key, names);
  return near.empty() ? "" : " (did you mean '" + near + "'?)";
}

// ---------------------------------------------------------------------------------------------
// YAML walking with locations.

struct YamlContext {
  std::string file;
  LaunchConfig* cfg;
  std::string Where(const YAML::Node& n) const {
    const YAML::Mark m = n.Mark();
    if (m.is_null()) return file;
    return file + ":" + std::to_string(m.line + 1);
  }
};

std::string ScalarText(const YAML::Node& n) { return n.IsScalar() ? n.Scalar() : std::string(); }

// Reads a YAML mapping key by key, recording origins; Finish() rejects unknown keys.
class MapReader {
 public:
  MapReader(const YamlContext& ctx, const YAML::Node& node, std::string path)
      : ctx_(ctx), node_(node), path_(std::move(path)) {}

  // Whether the key is present (and not null).
  bool Has(const std::string& key) {
    known_.push_back(key);
    YAML::Node v = node_[key];
    return v.IsDefined() && !v.IsNull();
  }

  YAML::Node Raw(const std::string& key) {
    known_.push_back(key);
    return node_[key];
  }

  template <typename T>
  Status Get(const std::string& key, T* out) {
    known_.push_back(key);
    YAML::Node v = node_[key];
    if (!v.IsDefined() || v.IsNull()) return Status::Ok();
    if (!v.IsScalar()) return Error(v, key, "expected a single value");
    std::string err = ParseValue(v.Scalar(), out);
    if (!err.empty()) return Error(v, key, err);
    Record(key, v);
    return Status::Ok();
  }

  // Like Get, then checks lo <= value (and value <= hi when hi given).
  template <typename T>
  Status GetInRange(const std::string& key, T* out, T lo, T hi) {
    T before = *out;
    LAUNCH_RETURN_IF_ERROR(Get(key, out));
    YAML::Node v = node_[key];
    if (!v.IsDefined() || v.IsNull()) return Status::Ok();
    if (*out < lo || *out > hi) {
      std::ostringstream msg;
      msg << "value " << *out << " is out of range [" << lo << ", " << hi << "]";
      *out = before;
      return Error(node_[key], key, msg.str());
    }
    return Status::Ok();
  }

  template <typename E>
  Status GetEnum(const std::string& key, const EnumTable<E>& table, E* out) {
    known_.push_back(key);
    YAML::Node v = node_[key];
    if (!v.IsDefined() || v.IsNull()) return Status::Ok();
    if (!v.IsScalar()) return Error(v, key, "expected a single value");
    std::string err = ParseEnum(v.Scalar(), table, out);
    if (!err.empty()) return Error(v, key, err);
    Record(key, v);
    return Status::Ok();
  }

  template <typename T>
  Status GetList(const std::string& key, std::vector<T>* out, T min_value) {
    known_.push_back(key);
    YAML::Node v = node_[key];
    if (!v.IsDefined() || v.IsNull()) return Status::Ok();
    if (!v.IsSequence()) return Error(v, key, "expected a list like [a, b, c]");
    std::vector<T> items;
    for (const YAML::Node& item : v) {
      T x{};
      std::string err = item.IsScalar() ? ParseValue(item.Scalar(), &x) : "expected a scalar";
      if (err.empty() && x < min_value) {
        std::ostringstream msg;
        msg << "list items must be >= " << min_value << ", got " << item.Scalar();
        err = msg.str();
      }
      if (!err.empty()) return Error(item, key, err);
      items.push_back(x);
    }
    *out = items;
    Record(key, v);
    return Status::Ok();
  }

  Status Finish() {
    for (auto it = node_.begin(); it != node_.end(); ++it) {
      std::string key = ScalarText(it->first);
      if (std::find(known_.begin(), known_.end(), key) != known_.end()) continue;
      return Status::InvalidConfig(ctx_.Where(it->first) + ": " + Qualify(key) + ": unknown key" +
                                   NearMiss(key, known_));
    }
    return Status::Ok();
  }

  Status Error(const YAML::Node& at, const std::string& key, const std::string& msg) const {
    return Status::InvalidConfig(ctx_.Where(at) + ": " + Qualify(key) + ": " + msg);
  }
  std::string Qualify(const std::string& key) const {
    return path_.empty() ? key : path_ + "." + key;
  }
  void Record(const std::string& key, const YAML::Node& v) {
    ctx_.cfg->origins[Qualify(key)] = Origin{Origin::Kind::kFile, ctx_.Where(v)};
  }
  const YamlContext& ctx() const { return ctx_; }

 private:
  const YamlContext& ctx_;
  YAML::Node node_;
  std::string path_;
  std::vector<std::string> known_;
};

Status RequireMap(const YamlContext& ctx, const YAML::Node& n, const std::string& key) {
  if (!n.IsMap())
    return Status::InvalidConfig(ctx.Where(n) + ": " + key + ": expected a mapping (key: value)");
  return Status::Ok();
}

Status LoadModel(const YamlContext& ctx, const YAML::Node& node, ModelConfig* m) {
  LAUNCH_RETURN_IF_ERROR(RequireMap(ctx, node, "train.model"));
  MapReader r(ctx, node, "train.model");
  // `{torchscript: path.pt}` selects the TorchScript model without a `type`.
  if (r.Has("torchscript")) {
    m->type = ModelType::kTorchScript;
    YAML::Node ts = r.Raw("torchscript");
    if (ts.IsSequence()) {
      LAUNCH_RETURN_IF_ERROR(r.GetList("torchscript", &m->torchscript_stages, std::string()));
    } else {
      LAUNCH_RETURN_IF_ERROR(r.Get("torchscript", &m->torchscript_path));
    }
  }
  LAUNCH_RETURN_IF_ERROR(r.GetEnum("type", kModelTypes, &m->type));
  if (m->type == ModelType::kTransformer) {
    YAML::Node vocab = r.Raw("vocab");
    if (vocab.IsDefined() && !vocab.IsNull()) {
      if (vocab.IsScalar() && ToLower(vocab.Scalar()) == "bytes") {
        m->vocab_size = 256;
        r.Record("vocab", vocab);
      } else {
        LAUNCH_RETURN_IF_ERROR(r.GetInRange<int64_t>("vocab", &m->vocab_size, 2, 1 << 20));
      }
    }
    LAUNCH_RETURN_IF_ERROR(r.GetInRange<int64_t>("d_model", &m->d_model, 1, 1 << 16));
    LAUNCH_RETURN_IF_ERROR(r.GetInRange<int64_t>("layers", &m->transformer_layers, 1, 1024));
    LAUNCH_RETURN_IF_ERROR(r.GetInRange<int64_t>("heads", &m->heads, 1, 1024));
    LAUNCH_RETURN_IF_ERROR(r.GetInRange<int64_t>("context", &m->context, 1, 1 << 20));
    LAUNCH_RETURN_IF_ERROR(r.GetInRange("dropout", &m->dropout, 0.0, 0.99));
    if (m->d_model % m->heads != 0)
      return r.Error(node["heads"], "heads",
                     "d_model " + std::to_string(m->d_model) + " is not divisible by heads " +
                         std::to_string(m->heads));
  } else if (m->type == ModelType::kCnn) {
    LAUNCH_RETURN_IF_ERROR(r.GetList<int64_t>("channels", &m->cnn_channels, 1));
    LAUNCH_RETURN_IF_ERROR(r.GetInRange<int64_t>("hidden", &m->cnn_hidden, 0, 1 << 24));
    LAUNCH_RETURN_IF_ERROR(r.GetInRange<int64_t>("classes", &m->classes, 2, 1 << 24));
    LAUNCH_RETURN_IF_ERROR(r.Get("batch_norm", &m->batch_norm));
    LAUNCH_RETURN_IF_ERROR(r.GetList<int64_t>("input", &m->input_shape, 1));
    LAUNCH_RETURN_IF_ERROR(r.GetInRange("dropout", &m->dropout, 0.0, 0.99));
    if (m->cnn_channels.empty())
      return r.Error(node["channels"], "channels", "needs at least one block, e.g. [16, 32]");
    if (m->input_shape.size() != 3)
      return r.Error(node["input"], "input",
                     "expected [channels, height, width], e.g. [1, 28, 28]");
    const int64_t shrink = int64_t{1} << std::min<size_t>(m->cnn_channels.size(), 30);
    if (m->input_shape[1] < shrink || m->input_shape[2] < shrink)
      return r.Error(node["channels"].IsDefined() ? node["channels"] : node, "channels",
                     std::to_string(m->cnn_channels.size()) + " blocks halve a " +
                         std::to_string(m->input_shape[1]) + "x" +
                         std::to_string(m->input_shape[2]) +
                         " image to nothing; use fewer blocks (each 2x2 pooling halves it)");
  } else {
    LAUNCH_RETURN_IF_ERROR(r.GetList<int64_t>("layers", &m->mlp_layers, 1));
    if (m->type == ModelType::kMlp && m->mlp_layers.size() < 2)
      return r.Error(node["layers"], "layers",
                     "an MLP needs at least an input and an output width, e.g. [32, 10]");
    LAUNCH_RETURN_IF_ERROR(r.GetInRange("dropout", &m->dropout, 0.0, 0.99));
  }
  if (m->type == ModelType::kTorchScript) {
    LAUNCH_RETURN_IF_ERROR(r.GetList("inputs", &m->inputs, std::string()));
    for (const std::string& field : m->inputs)
      if (field != "input" && field != "target")
        return r.Error(node["inputs"], "inputs",
                       "'" + field + "' is not a batch field; fields are input, target");
    if (m->inputs.empty())
      return r.Error(node["inputs"], "inputs", "forward needs at least one input, e.g. [input]");
    if (r.Has("outputs")) {
      YAML::Node on = r.Raw("outputs");
      LAUNCH_RETURN_IF_ERROR(RequireMap(ctx, on, "train.model.outputs"));
      MapReader o(ctx, on, "train.model.outputs");
      LAUNCH_RETURN_IF_ERROR(o.Get("logits", &m->output_logits));
      LAUNCH_RETURN_IF_ERROR(o.Get("loss", &m->output_loss));
      LAUNCH_RETURN_IF_ERROR(o.Finish());
    }
  }
  if (m->type == ModelType::kTorchScript && m->torchscript_path.empty() &&
      m->torchscript_stages.empty())
    return Status::InvalidConfig(ctx.Where(node) +
                                 ": train.model: type torchscript needs `torchscript: PATH`");
  return r.Finish();
}

Status LoadData(const YamlContext& ctx, const YAML::Node& node, DataConfig* d) {
  LAUNCH_RETURN_IF_ERROR(RequireMap(ctx, node, "train.data"));
  MapReader r(ctx, node, "train.data");
  LAUNCH_RETURN_IF_ERROR(r.GetEnum("type", kDataTypes, &d->type));
  LAUNCH_RETURN_IF_ERROR(r.GetInRange<int64_t>("samples", &d->samples, 1, int64_t(1) << 40));
  LAUNCH_RETURN_IF_ERROR(r.Get("teacher_seed", &d->teacher_seed));
  LAUNCH_RETURN_IF_ERROR(r.Get("path", &d->path));
  LAUNCH_RETURN_IF_ERROR(r.Get("label_column", &d->label_column));
  LAUNCH_RETURN_IF_ERROR(r.GetInRange<int64_t>("context", &d->context, 1, 1 << 20));
  LAUNCH_RETURN_IF_ERROR(r.Get("shuffle", &d->shuffle));
  if (d->type == DataType::kIdx) {
    LAUNCH_RETURN_IF_ERROR(r.GetInRange("mean", &d->mean, -1e6, 1e6));
    LAUNCH_RETURN_IF_ERROR(r.GetInRange("std", &d->std, 1e-9, 1e6));
    if (r.Has("augment")) {
      YAML::Node an = r.Raw("augment");
      LAUNCH_RETURN_IF_ERROR(RequireMap(ctx, an, "train.data.augment"));
      MapReader a(ctx, an, "train.data.augment");
      LAUNCH_RETURN_IF_ERROR(a.GetInRange<int64_t>("crop_padding", &d->crop_padding, 0, 1024));
      LAUNCH_RETURN_IF_ERROR(a.Get("flip", &d->flip));
      LAUNCH_RETURN_IF_ERROR(a.Finish());
    }
    if (d->path.empty()) d->path = kFashionMnistDir;
  }
  if ((d->type == DataType::kCsv || d->type == DataType::kText) && d->path.empty())
    return Status::InvalidConfig(ctx.Where(node) + ": train.data: type " + ToString(d->type) +
                                 " needs `path: FILE`");
  if (d->type == DataType::kIdx) {
    std::error_code ec;
    if (!std::filesystem::is_directory(d->path, ec))
      return r.Error(node["path"].IsDefined() ? node["path"] : node, "path",
                     "'" + d->path + "' is not a directory of IDX files" +
                         (d->path == kFashionMnistDir
                              ? std::string(" (install Debian's dataset-fashion-mnist)")
                              : std::string()));
  } else if (!d->path.empty() && d->type != DataType::kSynthetic) {
    std::ifstream probe(d->path);
    if (!probe) return r.Error(node["path"], "path", "cannot read '" + d->path + "'");
  }
  return r.Finish();
}

Status LoadTrain(const YamlContext& ctx, const YAML::Node& node, TrainConfig* t) {
  LAUNCH_RETURN_IF_ERROR(RequireMap(ctx, node, "train"));
  t->present = true;
  MapReader r(ctx, node, "train");
  LAUNCH_RETURN_IF_ERROR(r.Get("seed", &t->seed));
  LAUNCH_RETURN_IF_ERROR(r.Get("output_dir", &t->output_dir));
  if (r.Has("model")) LAUNCH_RETURN_IF_ERROR(LoadModel(ctx, r.Raw("model"), &t->model));
  if (r.Has("data")) LAUNCH_RETURN_IF_ERROR(LoadData(ctx, r.Raw("data"), &t->data));
  LAUNCH_RETURN_IF_ERROR(r.GetInRange("eval_fraction", &t->eval_fraction, 0.0, 0.9));
  LAUNCH_RETURN_IF_ERROR(r.GetInRange<int64_t>("batch_size", &t->batch_size, 1, 1 << 24));
  LAUNCH_RETURN_IF_ERROR(r.GetInRange<int64_t>("max_steps", &t->max_steps, 0, int64_t(1) << 40));
  LAUNCH_RETURN_IF_ERROR(r.GetInRange<int64_t>("epochs", &t->epochs, 0, 1 << 20));
  if (r.Has("optimizer")) {
    YAML::Node on = r.Raw("optimizer");
    LAUNCH_RETURN_IF_ERROR(RequireMap(ctx, on, "train.optimizer"));
    MapReader o(ctx, on, "train.optimizer");
    OptimizerConfig& oc = t->optimizer;
    LAUNCH_RETURN_IF_ERROR(o.GetEnum("type", kOptimizers, &oc.type));
    if (oc.type == OptimizerType::kAdamW) oc.weight_decay = 0.01;
    LAUNCH_RETURN_IF_ERROR(o.GetInRange("lr", &oc.lr, 1e-12, 1e3));
    LAUNCH_RETURN_IF_ERROR(o.GetInRange("weight_decay", &oc.weight_decay, 0.0, 10.0));
    LAUNCH_RETURN_IF_ERROR(o.GetInRange("momentum", &oc.momentum, 0.0, 0.9999));
    LAUNCH_RETURN_IF_ERROR(o.GetInRange("beta1", &oc.beta1, 0.0, 0.9999999));
    LAUNCH_RETURN_IF_ERROR(o.GetInRange("beta2", &oc.beta2, 0.0, 0.9999999));
    LAUNCH_RETURN_IF_ERROR(o.GetInRange("eps", &oc.eps, 1e-30, 1.0));
    LAUNCH_RETURN_IF_ERROR(o.GetList("no_decay", &oc.no_decay, std::string()));
    LAUNCH_RETURN_IF_ERROR(o.Finish());
  } else {
    t->optimizer.weight_decay = 0.01;  // adamw default
  }
  if (r.Has("scheduler")) {
    YAML::Node sn = r.Raw("scheduler");
    LAUNCH_RETURN_IF_ERROR(RequireMap(ctx, sn, "train.scheduler"));
    MapReader s(ctx, sn, "train.scheduler");
    LAUNCH_RETURN_IF_ERROR(s.GetEnum("type", kSchedulers, &t->scheduler.type));
    LAUNCH_RETURN_IF_ERROR(
        s.GetInRange<int64_t>("warmup_steps", &t->scheduler.warmup_steps, 0, int64_t(1) << 40));
    LAUNCH_RETURN_IF_ERROR(s.GetInRange("min_lr_ratio", &t->scheduler.min_lr_ratio, 0.0, 1.0));
    LAUNCH_RETURN_IF_ERROR(s.Finish());
  }
  if (r.Has("loss")) {
    YAML::Node ln = r.Raw("loss");
    LAUNCH_RETURN_IF_ERROR(RequireMap(ctx, ln, "train.loss"));
    MapReader l(ctx, ln, "train.loss");
    LossConfig& lc = t->loss;
    LAUNCH_RETURN_IF_ERROR(l.GetEnum("type", kLossTypes, &lc.type));
    LAUNCH_RETURN_IF_ERROR(l.GetInRange("label_smoothing", &lc.label_smoothing, 0.0, 1.0));
    LAUNCH_RETURN_IF_ERROR(l.Get("ignore_index", &lc.ignore_index));
    LAUNCH_RETURN_IF_ERROR(l.GetList("class_weights", &lc.class_weights, 0.0));
    LAUNCH_RETURN_IF_ERROR(l.Finish());
    const bool ce = lc.type == LossType::kAuto || lc.type == LossType::kCrossEntropy;
    if (!ce &&
        (lc.label_smoothing > 0 || !lc.class_weights.empty() || ln["ignore_index"].IsDefined()))
      return l.Error(ln["type"], "type",
                     std::string("label_smoothing, ignore_index and class_weights are "
                                 "cross_entropy options, not ") +
                         ToString(lc.type));
  }
  LAUNCH_RETURN_IF_ERROR(r.GetEnum("save_model", kSaveModel, &t->save_model));
  LAUNCH_RETURN_IF_ERROR(r.GetInRange("max_grad_norm", &t->max_grad_norm, 0.0, 1e9));
  if (r.Has("parallel")) {
    YAML::Node pn = r.Raw("parallel");
    LAUNCH_RETURN_IF_ERROR(RequireMap(ctx, pn, "train.parallel"));
    MapReader p(ctx, pn, "train.parallel");
    ParallelConfig& pc = t->parallel;
    LAUNCH_RETURN_IF_ERROR(p.GetEnum("mode", kParallelModes, &pc.mode));
    LAUNCH_RETURN_IF_ERROR(p.GetInRange("bucket_cap_mb", &pc.bucket_cap_mb, 0.001, 1e5));
    LAUNCH_RETURN_IF_ERROR(p.GetInRange("replicas", &pc.replicas, 1, 1024));
    LAUNCH_RETURN_IF_ERROR(p.GetInRange("stages", &pc.stages, 1, 1024));
    LAUNCH_RETURN_IF_ERROR(p.GetInRange("microbatches", &pc.microbatches, 1, 1 << 20));
    LAUNCH_RETURN_IF_ERROR(p.GetEnum("schedule", kSchedules, &pc.schedule));
    LAUNCH_RETURN_IF_ERROR(p.GetList<int64_t>("partition", &pc.partition, 1));
    LAUNCH_RETURN_IF_ERROR(p.Get("loss_in_replica", &pc.loss_in_replica));
    LAUNCH_RETURN_IF_ERROR(p.Get("find_unused_parameters", &pc.find_unused_parameters));
    LAUNCH_RETURN_IF_ERROR(p.GetEnum("comm_hook", kCommHooks, &pc.comm_hook));
    LAUNCH_RETURN_IF_ERROR(p.Get("dp_seeded_replicas", &pc.dp_seeded_replicas));
    LAUNCH_RETURN_IF_ERROR(p.Finish());
    if (pc.comm_hook != CommHook::kNone && pc.mode != ParallelMode::kDdp)
      return p.Error(
          pn["comm_hook"], "comm_hook",
          "applies to mode ddp (its gradient buckets), not " + std::string(ToString(pc.mode)));
    if (pc.mode == ParallelMode::kPipeline && pc.schedule == PipelineSchedule::k1F1B &&
        pc.microbatches < pc.stages)
      return p.Error(pn["microbatches"].IsDefined() ? pn["microbatches"] : pn, "microbatches",
                     "1F1B needs at least as many micro-batches (" +
                         std::to_string(pc.microbatches) + ") as stages (" +
                         std::to_string(pc.stages) + ")");
    if (!pc.partition.empty() && pc.mode == ParallelMode::kPipeline &&
        static_cast<int>(pc.partition.size()) != pc.stages)
      return p.Error(pn["partition"], "partition",
                     "has " + std::to_string(pc.partition.size()) + " entries but stages is " +
                         std::to_string(pc.stages));
  }
  LAUNCH_RETURN_IF_ERROR(
      r.GetInRange("gradient_accumulation_steps", &t->gradient_accumulation_steps, 1, 1 << 20));
  LAUNCH_RETURN_IF_ERROR(r.Get("sync_each_batch", &t->sync_each_batch));
  LAUNCH_RETURN_IF_ERROR(r.Get("sync_with_dataloader", &t->sync_with_dataloader));
  LAUNCH_RETURN_IF_ERROR(r.GetInRange("local_sgd_steps", &t->local_sgd_steps, 0, 1 << 20));
  LAUNCH_RETURN_IF_ERROR(
      r.GetInRange<int64_t>("checkpoint_every", &t->checkpoint_every, 0, int64_t(1) << 40));
  LAUNCH_RETURN_IF_ERROR(r.Get("resume", &t->resume));
  LAUNCH_RETURN_IF_ERROR(r.Get("resume_allow_changes", &t->resume_allow_changes));
  LAUNCH_RETURN_IF_ERROR(r.GetInRange<int64_t>("log_every", &t->log_every, 1, int64_t(1) << 40));
  LAUNCH_RETURN_IF_ERROR(r.GetInRange<int64_t>("eval_every", &t->eval_every, 0, int64_t(1) << 40));
  if (r.Has("timeline")) {
    YAML::Node tn = r.Raw("timeline");
    LAUNCH_RETURN_IF_ERROR(RequireMap(ctx, tn, "train.timeline"));
    MapReader tl(ctx, tn, "train.timeline");
    LAUNCH_RETURN_IF_ERROR(
        tl.GetInRange<int64_t>("from_step", &t->timeline.from_step, 1, int64_t(1) << 40));
    // Bounded: every event of these steps is kept in memory until the end.
    LAUNCH_RETURN_IF_ERROR(tl.GetInRange<int64_t>("steps", &t->timeline.steps, 0, 1000));
    LAUNCH_RETURN_IF_ERROR(tl.Finish());
  }
  if (t->model.type == ModelType::kTransformer && t->data.type != DataType::kText)
    return Status::InvalidConfig(ctx.Where(node) +
                                 ": train.model: a transformer needs `data: {type: text, ...}`");
  if (t->parallel.mode == ParallelMode::kPipeline && t->model.type == ModelType::kCnn)
    return Status::InvalidConfig(ctx.Where(node) +
                                 ": train.model: pipeline mode splits mlp, transformer or a list "
                                 "of TorchScript stages, not a cnn");
  if (t->parallel.mode == ParallelMode::kPipeline &&
      (t->model.inputs != std::vector<std::string>{"input"} || !t->model.output_loss.empty()))
    return Status::InvalidConfig(ctx.Where(node) +
                                 ": train.model: pipeline stages take one tensor and return one "
                                 "tensor (no `inputs` or `outputs.loss`)");
  if (t->local_sgd_steps > 0 && t->parallel.mode == ParallelMode::kPipeline)
    return r.Error(node["local_sgd_steps"], "local_sgd_steps",
                   "Local SGD does not combine with pipeline mode");
  return r.Finish();
}

Status LoadDocument(const YAML::Node& root, const std::string& name, LaunchConfig* cfg) {
  YamlContext ctx{name, cfg};
  if (root.IsNull() || !root.IsDefined()) return Status::Ok();  // empty file: all defaults
  if (!root.IsMap())
    return Status::InvalidConfig(ctx.Where(root) + ": expected a mapping of keys at the top level");
  std::vector<std::string> ignored;
  for (auto it = root.begin(); it != root.end(); ++it) {
    std::string key = ScalarText(it->first);
    const YAML::Node& value = it->second;
    std::string where = ctx.Where(it->first);
    if (key == "train") {
      LAUNCH_RETURN_IF_ERROR(LoadTrain(ctx, value, &cfg->train));
      continue;
    }
    // accelerate's own settings: kept for the script's Accelerator (LaunchConfig::accelerate).
    if (AccelerateSections().count(key)) {
      if (value.IsNull()) continue;
      if (!value.IsMap())
        return Status::InvalidConfig(ctx.Where(value) + ": " + key + ": expected a mapping");
      const std::string& prefix = AccelerateSections().at(key);
      std::vector<std::string> fields;
      for (auto kv = value.begin(); kv != value.end(); ++kv) {
        std::string sub = ScalarText(kv->first);
        fields.push_back(sub);
        if (kv->second.IsNull()) continue;
        std::string arg = StartsWith(sub, prefix) ? sub : prefix + sub;
        if (key == "fsdp_config" && StartsWith(sub, "fsdp")) arg = sub;
        cfg->accelerate[arg] = AccelerateText(kv->second);
        cfg->origins["accelerate." + arg] = Origin{Origin::Kind::kFile, ctx.Where(kv->second)};
      }
      if (key == "deepspeed_config")
        cfg->accelerate["_deepspeed_config_fields"] = Join(fields, ",");
      continue;
    }
    if (key == "debug" || key == "num_cpu_threads_per_process" || key == "enable_cpu_affinity" ||
        key == "dynamo_backend") {
      if (!value.IsNull()) cfg->accelerate[key] = AccelerateText(value);
      continue;
    }
    auto inert = InertAccelerateKeys().find(key);
    if (inert != InertAccelerateKeys().end() || StartsWith(key, "tpu_")) {
      std::string v = ToLower(AccelerateText(value));
      std::vector<std::string> fine = {"false", ""};
      if (inert != InertAccelerateKeys().end()) fine = inert->second;
      bool harmless = value.IsNull() || (value.IsMap() && value.size() == 0) ||
                      std::find(fine.begin(), fine.end(), "*") != fine.end() ||
                      std::find(fine.begin(), fine.end(), v) != fine.end();
      if (!harmless) ignored.push_back(key);
      continue;
    }
    const KeyDef* def = FindKey(key, kYaml);
    if (!def) {
      return Status::InvalidConfig(where + ": unknown key '" + key + "'" +
                                   NearMiss(key, NamesAt(kYaml)));
    }
    if (value.IsNull()) continue;  // `log_dir: null` keeps the default
    if (def->name == "rdzv_conf" && value.IsMap()) {
      for (auto kv = value.begin(); kv != value.end(); ++kv) {
        std::string sub = ScalarText(kv->first);
        const KeyDef* d = FindKey(sub, kRdzvConf);
        if (!d)
          return Status::InvalidConfig(ctx.Where(kv->first) + ": rdzv_conf." + sub +
                                       ": unknown key" + NearMiss(sub, NamesAt(kRdzvConf)));
        if (!kv->second.IsScalar())
          return Status::InvalidConfig(ctx.Where(kv->second) + ": rdzv_conf." + sub +
                                       ": expected a single value");
        LAUNCH_RETURN_IF_ERROR(SetKey(*d, kv->second.Scalar(),
                                      Origin{Origin::Kind::kFile, ctx.Where(kv->second)},
                                      ctx.Where(kv->second) + ": rdzv_conf." + sub, cfg));
      }
      continue;
    }
    std::string text;
    if (value.IsScalar()) {
      text = value.Scalar();
    } else if (value.IsSequence() &&
               (def->name == "gpu_ids" || def->name == "local_ranks_filter")) {
      std::vector<std::string> items;
      for (const YAML::Node& item : value) items.push_back(ScalarText(item));
      text = Join(items, ",");
    } else {
      return Status::InvalidConfig(ctx.Where(value) + ": " + key + ": expected a single value");
    }
    LAUNCH_RETURN_IF_ERROR(SetKey(*def, text, Origin{Origin::Kind::kFile, ctx.Where(value)},
                                  ctx.Where(value) + ": " + key, cfg));
  }
  for (const std::string& key : ignored) cfg->no_effect.push_back(key + " (" + name + ")");
  cfg->train.mixed_precision = cfg->mixed_precision;
  return Status::Ok();
}

}  // namespace

std::string Origin::ToString() const {
  switch (kind) {
    case Kind::kDefault:
      return "default";
    case Kind::kFile:
      return detail;
    case Kind::kEnvironment:
      return "environment " + detail;
    case Kind::kFlag:
      return "flag " + detail;
    case Kind::kDerived:
      return "derived (" + detail + ")";
  }
  return "?";
}

Status LoadYamlString(const std::string& text, const std::string& name, LaunchConfig* cfg) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return Status::InvalidConfig(name + ":" + std::to_string(e.mark.line + 1) + ": " + e.msg);
  }
  return LoadDocument(root, name, cfg);
}

Status LoadYamlFile(const std::string& path, LaunchConfig* cfg) {
  std::ifstream in(path);
  if (!in) return Status::InvalidConfig(path + ": cannot open the config file");
  std::stringstream buf;
  buf << in.rdbuf();
  cfg->config_path = path;
  return LoadYamlString(buf.str(), path, cfg);
}

StatusOr<TrainConfig> LoadTrainConfigFile(const std::string& path) {
  LaunchConfig cfg;
  LAUNCH_RETURN_IF_ERROR(LoadYamlFile(path, &cfg));
  if (!cfg.train.present)
    return Status::InvalidConfig(path + ": no `train:` section (see configs/quickstart.yaml)");
  return cfg.train;
}

Status ApplySetting(const std::string& key, const std::string& value, const Origin& origin,
                    LaunchConfig* cfg) {
  const KeyDef* def = FindKey(key, kYaml | kEnv | kFlagOnly);
  std::string where = origin.kind == Origin::Kind::kFlag ? origin.detail : origin.ToString();
  if (!def)
    return Status::InvalidConfig(where + ": unknown setting '" + key + "'" +
                                 NearMiss(key, AllTopLevelNames()));
  return SetKey(*def, value, origin, where, cfg);
}

Status ApplyEnvironment(const std::map<std::string, std::string>& env, LaunchConfig* cfg) {
  // torchrun runs Python workers with PYTHON_EXEC when set; LAUNCH_PYTHON (below) still wins.
  auto exec = env.find("PYTHON_EXEC");
  if (exec != env.end() && !exec->second.empty())
    LAUNCH_RETURN_IF_ERROR(ApplySetting("python", exec->second,
                                        Origin{Origin::Kind::kEnvironment, "PYTHON_EXEC"}, cfg));
  // torchrun's --shutdown_timeout falls back to this; LAUNCH_STOP_GRACE (below) still wins.
  auto shutdown = env.find("TORCH_ELASTIC_SHUTDOWN_TIMEOUT");
  if (shutdown != env.end() && !shutdown->second.empty())
    LAUNCH_RETURN_IF_ERROR(
        ApplySetting("stop_grace", shutdown->second,
                     Origin{Origin::Kind::kEnvironment, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}, cfg));
  for (const KeyDef& def : TopLevelTable()) {
    if ((def.places & kEnv) == 0) continue;
    // LAUNCH_* is ours; PET_* is what torchrun reads for its flags (PET_NPROC_PER_NODE, ...).
    std::vector<std::string> names = {def.name};
    names.insert(names.end(), def.synonyms.begin(), def.synonyms.end());
    for (const std::string& f : def.flags)
      if (f.size() > 1 && std::find(names.begin(), names.end(), f) == names.end())
        names.push_back(f);
    for (const std::string& n : names) {
      std::string upper = n;
      for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      const bool is_flag_name = n != def.name && std::find(def.synonyms.begin(), def.synonyms.end(),
                                                           n) == def.synonyms.end();
      for (const std::string& var : {"LAUNCH_" + upper, "PET_" + upper}) {
        auto it = env.find(var);
        if (it == env.end() || it->second.empty()) continue;
        Origin origin{Origin::Kind::kEnvironment, var};
        std::string value = it->second;
        if (is_flag_name && def.switch_value) {
          // A switch given as a variable (PET_MULTI_GPU=1): its value says whether it is on.
          bool on = false;
          std::string err = ParseValue(value, &on);
          if (!err.empty()) return Status::InvalidConfig(origin.ToString() + ": " + err);
          if (!on) continue;
          value = def.switch_value;
        }
        LAUNCH_RETURN_IF_ERROR(SetKey(def, value, origin, origin.ToString(), cfg));
      }
    }
  }
  return Status::Ok();
}

std::vector<FlagSetting> FlagSettings() {
  std::vector<FlagSetting> out;
  for (const KeyDef& def : TopLevelTable()) {
    if (def.flags.empty()) continue;
    FlagSetting f;
    f.key = def.name;
    f.names = def.flags;
    f.group = def.group;
    f.help = def.help;
    f.switch_value = def.switch_value ? def.switch_value : "";
    out.push_back(f);
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> ShownSettings(const LaunchConfig& cfg) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const KeyDef& def : TopLevelTable())
    if (def.show) out.emplace_back(def.Label(), def.show(cfg));
  return out;
}

Status Validate(LaunchConfig* cfg) {
  if (cfg->machine_rank >= cfg->max_nodes)
    return Status::InvalidConfig(cfg->origins["machine_rank"].ToString() + ": machine_rank " +
                                 std::to_string(cfg->machine_rank) +
                                 " must be below num_machines (" + std::to_string(cfg->max_nodes) +
                                 ")");
  // num_processes (total) and nproc_per_node (per node) describe the same thing; a value from
  // a higher-precedence layer wins, and two values from the same layer must agree.
  bool nproc_explicit =
      cfg->nproc_per_node != "auto" && cfg->nproc_per_node != "gpu" && cfg->nproc_per_node != "cpu";
  if (cfg->num_processes > 0) {
    auto rank_of = [&](const char* key) {
      auto it = cfg->origins.find(key);
      return it == cfg->origins.end() ? 0 : static_cast<int>(it->second.kind) + 1;
    };
    int np_rank = rank_of("num_processes"), ppn_rank = rank_of("nproc_per_node");
    if (!nproc_explicit || np_rank > ppn_rank) {
      if (cfg->num_processes % cfg->min_nodes != 0 || cfg->min_nodes != cfg->max_nodes) {
        if (cfg->min_nodes != cfg->max_nodes || cfg->num_processes % cfg->min_nodes != 0)
          return Status::InvalidConfig(
              cfg->origins["num_processes"].ToString() + ": num_processes " +
              std::to_string(cfg->num_processes) + " is not divisible by num_machines " +
              std::to_string(cfg->min_nodes) +
              " (give nproc_per_node instead for elastic or uneven nodes)");
      }
      cfg->nproc_per_node = std::to_string(cfg->num_processes / cfg->min_nodes);
      cfg->origins["nproc_per_node"] =
          Origin{Origin::Kind::kDerived, "num_processes / num_machines"};
    } else if (np_rank == ppn_rank) {
      long long ppn = 0;
      ParseInt64(cfg->nproc_per_node, &ppn);
      if (ppn * cfg->min_nodes != cfg->num_processes)
        return Status::InvalidConfig(
            cfg->origins["num_processes"].ToString() + ": num_processes " +
            std::to_string(cfg->num_processes) + " disagrees with nproc_per_node " +
            cfg->nproc_per_node + " x num_machines " + std::to_string(cfg->min_nodes) + " (" +
            cfg->origins["nproc_per_node"].ToString() + "); give one of the two");
    }
  }
  if (cfg->distributed_type == DistributedType::kNo && cfg->nproc_per_node == "auto" &&
      cfg->num_processes == 0) {
    cfg->nproc_per_node = "1";
    cfg->origins["nproc_per_node"] = Origin{Origin::Kind::kDerived, "distributed_type: NO"};
  }
  if (!cfg->no_effect.empty()) {
    std::vector<std::string> unique;
    for (const std::string& n : cfg->no_effect)
      if (std::find(unique.begin(), unique.end(), n) == unique.end()) unique.push_back(n);
    cfg->warnings.push_back("these accelerate settings have no effect with launch: " +
                            Join(unique, ", "));
    cfg->no_effect.clear();
  }
  if (cfg->train.present && cfg->mixed_precision == "fp8") {
    auto it = cfg->origins.find("mixed_precision");
    return Status::InvalidConfig(
        (it == cfg->origins.end() ? std::string("mixed_precision") : it->second.ToString()) +
        ": mixed_precision fp8 is for a script's Accelerator; the built-in trainer takes no, "
        "bf16 or fp16");
  }
  if (cfg->train.present) {
    const TrainConfig& t = cfg->train;
    if (t.parallel.mode == ParallelMode::kPipeline) {
      long long ppn = 0;
      if (ParseInt64(cfg->nproc_per_node, &ppn) && cfg->min_nodes == cfg->max_nodes) {
        long long world = ppn * cfg->min_nodes;
        if (world % t.parallel.stages != 0)
          return Status::InvalidConfig(cfg->origins["train.parallel.stages"].ToString() +
                                       ": train.parallel.stages " +
                                       std::to_string(t.parallel.stages) +
                                       " does not divide the world size " + std::to_string(world));
      }
    }
  }
  return Status::Ok();
}

std::vector<std::string> TopLevelKeys() {
  std::vector<std::string> names;
  for (const KeyDef& def : TopLevelTable())
    if (def.places & kYaml) names.push_back(def.name);
  return names;
}

// The names users write, from the same tables the parser reads.
template <typename E>
const char* NameOf(const EnumTable<E>& table, E v) {
  for (const auto& [name, value] : table)
    if (value == v) return name.c_str();
  return "?";
}

const char* ToString(ModelType v) { return NameOf(kModelTypes, v); }
const char* ToString(DataType v) { return NameOf(kDataTypes, v); }
const char* ToString(LossType v) { return NameOf(kLossTypes, v); }
const char* ToString(SaveModel v) { return NameOf(kSaveModel, v); }
const char* ToString(OptimizerType v) { return NameOf(kOptimizers, v); }
const char* ToString(SchedulerType v) { return NameOf(kSchedulers, v); }
const char* ToString(ParallelMode v) { return NameOf(kParallelModes, v); }
const char* ToString(PipelineSchedule v) { return NameOf(kSchedules, v); }
const char* ToString(CommHook v) { return NameOf(kCommHooks, v); }
const char* ToString(DistributedType v) {
  return v == DistributedType::kAuto ? "auto" : NameOf(kDistributedTypes, v);
}

}  // namespace launch::config
