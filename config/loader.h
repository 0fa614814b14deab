#pragma once

// The one place where configuration is parsed and merged.
//
//   LaunchConfig cfg;                                  // documented defaults
//   LoadYamlFile("train.yaml", &cfg);                  // YAML over defaults
//   ApplyEnvironment(environ_map, &cfg);               // environment over YAML
//   ApplySetting("num_processes", "4", Origin{kFlag, "--num_processes"}, &cfg);  // flags last
//   Validate(&cfg);                                    // cross-field checks, derived values
//
// Every error names its place: "train.yaml:12: train.parallel.mode: 'dpp' is not one of
// none, dp, ddp, pipeline (did you mean 'ddp'?)", "--num_processes: expected an integer, got
// 'two'", "environment LAUNCH_MAX_RESTARTS: ...". All are Status::InvalidConfig.

#include <map>
#include <string>
#include <vector>

#include "base/status.h"
#include "config/launch_config.h"

namespace launch::config {

// Parses `path` into `cfg` (which holds defaults or earlier layers). Records origins and
// collects warnings (accelerate keys that have no meaning here). Unknown keys are errors.
Status LoadYamlFile(const std::string& path, LaunchConfig* cfg);
// Same for YAML text; `name` is used in messages in place of a file name.
Status LoadYamlString(const std::string& text, const std::string& name, LaunchConfig* cfg);

// The `train:` section of the YAML file at `path`, over TrainConfig's defaults: what a program
// on the trainer runtime reads to take the same section `train` takes. InvalidConfig naming the
// file and line of a bad key, or saying the file has no `train:` section.
StatusOr<TrainConfig> LoadTrainConfigFile(const std::string& path);

// Sets one top-level key (canonical name or synonym, e.g. "nnodes") from its string form.
// Used for flags and environment variables; `origin` goes into cfg->origins and error messages.
Status ApplySetting(const std::string& key, const std::string& value, const Origin& origin,
                    LaunchConfig* cfg);

// Applies LAUNCH_<KEY> (and torchrun's PET_<KEY>) variables, plus LAUNCH_RDZV_TOKEN.
// `env` maps variable names to values (tests pass their own; main passes ::environ).
Status ApplyEnvironment(const std::map<std::string, std::string>& env, LaunchConfig* cfg);

// Cross-field checks after all layers are applied (e.g. machine_rank < nnodes).
Status Validate(LaunchConfig* cfg);

// Canonical top-level YAML key names (for help text and suggestions).
std::vector<std::string> TopLevelKeys();

// A key's command-line flag, from the same table the YAML and the environment go through: the
// launcher registers `names` (both --a_b and --a-b; a one-letter name is -x) and passes what it
// reads to ApplySetting(key, ...).
struct FlagSetting {
  std::string key;                 // for ApplySetting
  std::vector<std::string> names;  // underscore spelling, no dashes
  std::string group, help;         // --help section and text
  std::string switch_value;        // non-empty: the flag takes no value and means this one
};
std::vector<FlagSetting> FlagSettings();

// The top-level settings --print_config shows, in the table's order: (key, value as text).
std::vector<std::pair<std::string, std::string>> ShownSettings(const LaunchConfig& cfg);

// `launch --print_config`: every key with its effective value and origin.
std::string FormatConfig(const LaunchConfig& cfg);

}  // namespace launch::config
