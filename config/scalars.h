#pragma once

// Scalar parsing and the enum name tables, shared by the top-level key table, the `train:` key
// table and the YAML reader. Internal to config/. Each parser returns an error description
// ("" on success) that callers prefix with the location and key.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "base/strings.h"
#include "config/launch_config.h"

namespace launch::config {

std::string ParseValue(const std::string& s, std::string* out);
std::string ParseValue(const std::string& s, bool* out);     // true/yes/on/1, false/no/off/0
std::string ParseValue(const std::string& s, int64_t* out);  // also 1e3, 20000.0
std::string ParseValue(const std::string& s, int* out);
std::string ParseValue(const std::string& s, uint64_t* out);
std::string ParseValue(const std::string& s, double* out);  // finite

template <typename E>
using EnumTable = std::vector<std::pair<std::string, E>>;

// Case-insensitive; the error lists the names and suggests the nearest.
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

template <typename E>
std::vector<std::string> EnumNames(const EnumTable<E>& table) {
  std::vector<std::string> names;
  for (const auto& entry : table) names.push_back(entry.first);
  return names;
}

extern const EnumTable<ModelType> kModelTypes;
extern const EnumTable<DataType> kDataTypes;
extern const EnumTable<LossType> kLossTypes;
extern const EnumTable<SaveModel> kSaveModel;
extern const EnumTable<OptimizerType> kOptimizers;
extern const EnumTable<OptimizerImplementation> kOptimizerImplementations;
extern const EnumTable<SchedulerType> kSchedulers;
extern const EnumTable<ParallelMode> kParallelModes;
extern const EnumTable<PipelineSchedule> kSchedules;
extern const EnumTable<CommHook> kCommHooks;
extern const EnumTable<OuterOptimizer> kOuterOptimizers;
extern const EnumTable<DistributedType> kDistributedTypes;

std::string ParseStreamSpec(const std::string& s, StreamSpec* out);            // "3" or "0:1,1:3"
std::string ParseNodes(const std::string& s, int* min_nodes, int* max_nodes);  // N or MIN:MAX
std::string ParsePort(const std::string& s, int* port);
std::string ParseEndpoint(const std::string& s, std::string* host, int* port);  // [v6]:port
std::string ParseIntList(const std::string& s, std::vector<int>* out);          // "0,1"

// A key as written, normalised: lower case, dashes as underscores.
std::string Canonical(const std::string& key);
// " (did you mean 'x'?)" when a name is close to `key`, else "".
std::string NearMiss(const std::string& key, const std::vector<std::string>& names);

}  // namespace launch::config
