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
const EnumTable<DistributedType> kDistributedTypes = {{"NO", DistributedType::kNo},
                                                      {"MULTI_CPU", DistributedType::kMultiCpu},
                                                      {"MULTI_GPU", DistributedType::kMultiGpu}};

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
// Top-level keys: one table serves the YAML file, the environment and flags.

using Setter = std::function<std::string(const std::string&, LaunchConfig*)>;

struct KeyDef {
  std::string name;                   // canonical (accelerate's name where one exists)
  std::vector<std::string> synonyms;  // torchrun's spellings
  Setter set;
};

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

Setter PositiveSeconds(double* (*field)(LaunchConfig*)) {
  return [field](const std::string& s, LaunchConfig* c) {
    double v = 0;
    std::string err = ParseValue(s, &v);
    if (!err.empty()) return err;
    if (v <= 0) return "expected a duration in seconds > 0, got " + s;
    *field(c) = v;
    return std::string();
  };
}

const std::vector<KeyDef>& TopLevelTable() {
  static const std::vector<KeyDef> table = {
      {"distributed_type",
       {},
       [](const std::string& s, LaunchConfig* c) {
         return ParseEnum(s, kDistributedTypes, &c->distributed_type);
       }},
      {"num_processes",
       {},
       [](const std::string& s, LaunchConfig* c) {
         int v = 0;
         std::string err = ParseValue(s, &v);
         if (!err.empty()) return err;
         if (v < 1) return "expected at least 1 process, got " + s;
         c->num_processes = v;
         return std::string();
       }},
      {"nproc_per_node",
       {},
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
       }},
      {"num_machines",
       {"nnodes"},
       [](const std::string& s, LaunchConfig* c) {
         return ParseNodes(s, &c->min_nodes, &c->max_nodes);
       }},
      {"machine_rank",
       {"node_rank"},
       [](const std::string& s, LaunchConfig* c) {
         int v = 0;
         std::string err = ParseValue(s, &v);
         if (!err.empty()) return err;
         if (v < -1) return "expected a node rank >= 0, got " + s;
         c->machine_rank = v;
         return std::string();
       }},
      {"main_process_ip", {"master_addr"}, Field(&LaunchConfig::main_process_ip)},
      {"main_process_port",
       {"master_port"},
       [](const std::string& s, LaunchConfig* c) { return ParsePort(s, &c->main_process_port); }},
      {"rdzv_endpoint",
       {},
       [](const std::string& s, LaunchConfig* c) {
         return ParseEndpoint(s, &c->main_process_ip, &c->main_process_port);
       }},
      {"rdzv_token", {}, Field(&LaunchConfig::rdzv_token)},
      {"rdzv_local_addr", {}, Field(&LaunchConfig::rdzv_local_addr)},
      {"run_id", {"rdzv_id"}, Field(&LaunchConfig::run_id)},
      {"role", {}, Field(&LaunchConfig::role)},
      {"max_restarts", {}, NonNegative(&LaunchConfig::max_restarts)},
      {"gpu_ids",
       {},
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
       }},
      {"mixed_precision",
       {},
       [](const std::string& s, LaunchConfig* c) {
         std::string l = ToLower(Trim(s));
         if (l == "false") l = "no";  // unquoted `no` in a YAML 1.1 writer
         if (l != "no" && l != "bf16" && l != "fp16") {
           std::string msg = "'" + s + "' is not one of no, bf16, fp16";
           std::string near = ClosestMatch(l, {"no", "bf16", "fp16"});
           if (!near.empty()) msg += " (did you mean '" + near + "'?)";
           return msg;
         }
         c->mixed_precision = l;
         return std::string();
       }},
      {"log_dir", {}, Field(&LaunchConfig::log_dir)},
      {"tee",
       {},
       [](const std::string& s, LaunchConfig* c) { return ParseStreamSpec(s, &c->tee); }},
      {"redirects",
       {},
       [](const std::string& s, LaunchConfig* c) { return ParseStreamSpec(s, &c->redirects); }},
      {"local_ranks_filter",
       {},
       [](const std::string& s, LaunchConfig* c) {
         return ParseIntList(s, &c->local_ranks_filter);
       }},
      {"stop_grace", {}, PositiveSeconds([](LaunchConfig* c) { return &c->stop_grace_s; })},
      {"python", {}, Field(&LaunchConfig::python)},
      {"no_python", {}, Field(&LaunchConfig::no_python)},
      // Older accelerate files say `fp16: true` instead of `mixed_precision: fp16`.
      {"fp16",
       {},
       [](const std::string& s, LaunchConfig* c) {
         bool v = false;
         std::string err = ParseValue(s, &v);
         if (err.empty() && v) c->mixed_precision = "fp16";
         return err;
       }},
      {"use_cpu",
       {},
       [](const std::string& s, LaunchConfig* c) {
         bool v = false;
         std::string err = ParseValue(s, &v);
         if (err.empty() && v) c->distributed_type = DistributedType::kMultiCpu;
         return err;
       }},
      // rdzv_conf's fields, also settable one by one from flags/environment.
      {"join_timeout", {}, PositiveSeconds([](LaunchConfig* c) {
         return &c->rdzv_conf.join_timeout_s;
       })},
      {"last_call_timeout",
       {},
       [](const std::string& s, LaunchConfig* c) {
         double v = 0;
         std::string err = ParseValue(s, &v);
         if (!err.empty()) return err;
         if (v < 0) return "expected seconds >= 0, got " + s;
         c->rdzv_conf.last_call_timeout_s = v;
         return std::string();
       }},
      {"heartbeat_timeout", {}, PositiveSeconds([](LaunchConfig* c) {
         return &c->rdzv_conf.heartbeat_timeout_s;
       })},
  };
  return table;
}

// Accelerate keys we accept but that change nothing here; they are named in one warning.
const std::set<std::string>& IgnoredAccelerateKeys() {
  static const std::set<std::string> keys = {"compute_environment",
                                             "dynamo_backend",
                                             "use_mps_device",
                                             "use_xpu",
                                             "num_cpu_threads_per_process",
                                             "rdzv_backend",
                                             "same_network",
                                             "debug",
                                             "main_training_function",
                                             "downcast_bf16",
                                             "enable_cpu_affinity",
                                             "dynamo_config",
                                             "fsdp_config",
                                             "deepspeed_config",
                                             "megatron_lm_config",
                                             "ipex_config",
                                             "mpirun_config",
                                             "monitor_interval",
                                             "start_method",
                                             "standalone",
                                             "tpu_env",
                                             "tpu_use_cluster",
                                             "tpu_use_sudo",
                                             "tpu_name",
                                             "tpu_zone",
                                             "commands",
                                             "command_file",
                                             "gpu_type"};
  return keys;
}

const KeyDef* FindKey(const std::string& key) {
  std::string k = ToLower(key);
  std::replace(k.begin(), k.end(), '-', '_');
  for (const KeyDef& def : TopLevelTable()) {
    if (def.name == k) return &def;
    for (const auto& syn : def.synonyms)
      if (syn == k) return &def;
  }
  return nullptr;
}

std::vector<std::string> AllTopLevelNames() {
  std::vector<std::string> names;
  for (const KeyDef& def : TopLevelTable()) {
    names.push_back(def.name);
    for (const auto& syn : def.synonyms) names.push_back(syn);
  }
  names.push_back("rdzv_conf");
  names.push_back("train");
  return names;
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
    LAUNCH_RETURN_IF_ERROR(p.Get("dp_seeded_replicas", &pc.dp_seeded_replicas));
    LAUNCH_RETURN_IF_ERROR(p.Finish());
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
    if (key == "rdzv_conf") {
      if (value.IsNull()) continue;
      LAUNCH_RETURN_IF_ERROR(RequireMap(ctx, value, "rdzv_conf"));
      MapReader r(ctx, value, "rdzv_conf");
      RdzvConf& rc = cfg->rdzv_conf;
      LAUNCH_RETURN_IF_ERROR(r.GetInRange("join_timeout", &rc.join_timeout_s, 0.001, 1e7));
      LAUNCH_RETURN_IF_ERROR(r.GetInRange("last_call_timeout", &rc.last_call_timeout_s, 0.0, 1e7));
      LAUNCH_RETURN_IF_ERROR(
          r.GetInRange("heartbeat_timeout", &rc.heartbeat_timeout_s, 0.001, 1e7));
      LAUNCH_RETURN_IF_ERROR(r.Finish());
      continue;
    }
    if (IgnoredAccelerateKeys().count(key) || StartsWith(key, "tpu_")) {
      ignored.push_back(key);
      continue;
    }
    const KeyDef* def = FindKey(key);
    if (!def) {
      return Status::InvalidConfig(where + ": unknown key '" + key + "'" +
                                   NearMiss(key, AllTopLevelNames()));
    }
    if (value.IsNull()) continue;  // `log_dir: null` keeps the default
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
    std::string err = def->set(text, cfg);
    if (!err.empty()) return Status::InvalidConfig(ctx.Where(value) + ": " + key + ": " + err);
    cfg->origins[def->name] = Origin{Origin::Kind::kFile, ctx.Where(value)};
  }
  if (!ignored.empty())
    cfg->warnings.push_back(
        name + ": these accelerate keys have no effect with launch: " + Join(ignored, ", "));
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
  const KeyDef* def = FindKey(key);
  std::string where = origin.kind == Origin::Kind::kFlag ? origin.detail : origin.ToString();
  if (!def)
    return Status::InvalidConfig(where + ": unknown setting '" + key + "'" +
                                 NearMiss(key, AllTopLevelNames()));
  std::string err = def->set(value, cfg);
  if (!err.empty()) return Status::InvalidConfig(where + ": " + err);
  cfg->origins[def->name] = origin;
  if (def->name == "mixed_precision") cfg->train.mixed_precision = cfg->mixed_precision;
  return Status::Ok();
}

Status ApplyEnvironment(const std::map<std::string, std::string>& env, LaunchConfig* cfg) {
  // torchrun runs Python workers with PYTHON_EXEC when set; LAUNCH_PYTHON (below) still wins.
  auto exec = env.find("PYTHON_EXEC");
  if (exec != env.end() && !exec->second.empty())
    LAUNCH_RETURN_IF_ERROR(ApplySetting("python", exec->second,
                                        Origin{Origin::Kind::kEnvironment, "PYTHON_EXEC"}, cfg));
  for (const KeyDef& def : TopLevelTable()) {
    std::vector<std::string> names = {def.name};
    names.insert(names.end(), def.synonyms.begin(), def.synonyms.end());
    for (const std::string& n : names) {
      std::string upper = n;
      for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      // LAUNCH_* is ours; PET_* is what torchrun reads for its own flags.
      for (const std::string& var : {"LAUNCH_" + upper, "PET_" + upper}) {
        auto it = env.find(var);
        if (it == env.end() || it->second.empty()) continue;
        LAUNCH_RETURN_IF_ERROR(
            ApplySetting(def.name, it->second, Origin{Origin::Kind::kEnvironment, var}, cfg));
      }
    }
  }
  return Status::Ok();
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
  for (const KeyDef& def : TopLevelTable()) names.push_back(def.name);
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
const char* ToString(DistributedType v) {
  return v == DistributedType::kAuto ? "auto" : NameOf(kDistributedTypes, v);
}

}  // namespace launch::config
