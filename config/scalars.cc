// Scalar parsing and the enum name tables (config/scalars.h).

#include "config/scalars.h"

#include <algorithm>
#include <cmath>

namespace launch::config {

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
const EnumTable<OptimizerImplementation> kOptimizerImplementations = {
    {"auto", OptimizerImplementation::kAuto},
    {"for_loop", OptimizerImplementation::kForLoop},
    {"foreach", OptimizerImplementation::kForeach},
    {"fused", OptimizerImplementation::kFused}};
const EnumTable<SchedulerType> kSchedulers = {{"constant", SchedulerType::kConstant},
                                              {"linear", SchedulerType::kLinear},
                                              {"cosine", SchedulerType::kCosine}};
const EnumTable<ParallelMode> kParallelModes = {{"none", ParallelMode::kNone},
                                                {"dp", ParallelMode::kDp},
                                                {"ddp", ParallelMode::kDdp},
                                                {"pipeline", ParallelMode::kPipeline},
                                                {"zero", ParallelMode::kZero}};
const EnumTable<PipelineSchedule> kSchedules = {
    {"gpipe", PipelineSchedule::kGPipe},
    {"1f1b", PipelineSchedule::k1F1B},
    {"interleaved_1f1b", PipelineSchedule::kInterleaved1F1B},
    {"zero_bubble", PipelineSchedule::kZeroBubble}};
const EnumTable<CommHook> kCommHooks = {{"none", CommHook::kNone},
                                        {"bf16", CommHook::kBf16},
                                        {"fp16", CommHook::kFp16},
                                        {"power_sgd", CommHook::kPowerSgd}};
const EnumTable<OuterOptimizer> kOuterOptimizers = {{"average", OuterOptimizer::kAverage},
                                                    {"nesterov", OuterOptimizer::kNesterov}};
const EnumTable<DistributedType> kDistributedTypes = {
    {"NO", DistributedType::kNo},
    {"MULTI_CPU", DistributedType::kMultiCpu},
    {"MULTI_GPU", DistributedType::kMultiGpu},
    {"FSDP", DistributedType::kFsdp},
    {"DEEPSPEED", DistributedType::kDeepSpeed},
    {"MEGATRON_LM", DistributedType::kMegatronLm}};

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
  if (lo < 1 || hi < lo || hi > kMaxNodes)
    return "expected 1 <= MIN <= MAX <= " + std::to_string(kMaxNodes) + ", got '" + s + "'";
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

std::string Canonical(const std::string& key) {
  std::string k = ToLower(Trim(key));
  std::replace(k.begin(), k.end(), '-', '_');
  return k;
}

std::string NearMiss(const std::string& key, const std::vector<std::string>& names) {
  std::string near = ClosestMatch(key, names);
  return near.empty() ? "" : " (did you mean '" + near + "'?)";
}

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
const char* ToString(OptimizerImplementation v) { return NameOf(kOptimizerImplementations, v); }
const char* ToString(SchedulerType v) { return NameOf(kSchedulers, v); }
const char* ToString(ParallelMode v) { return NameOf(kParallelModes, v); }
const char* ToString(PipelineSchedule v) { return NameOf(kSchedules, v); }
const char* ToString(CommHook v) { return NameOf(kCommHooks, v); }
const char* ToString(OuterOptimizer v) { return NameOf(kOuterOptimizers, v); }
const char* ToString(DistributedType v) {
  return v == DistributedType::kAuto ? "auto" : NameOf(kDistributedTypes, v);
}

}  // namespace launch::config
