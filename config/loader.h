#pragma once

// The one place where configuration is parsed and merged (the files of config/: key tables in
// key_table.h and train_keys.h, the YAML reader, the merge, the printers).
//
//   LaunchConfig cfg;                                  // documented defaults
//   LoadYamlFile("train.yaml", &cfg);                  // YAML over defaults
//   ApplyEnvironment(environ_map, &cfg);               // environment over YAML
//   ApplySetting("num_processes", "4", Origin{kFlag, "--num_processes"}, &cfg);  // flags last
//   Validate(&cfg);                                    // cross-field checks, derived values
//
// Every error names its place: "train.yaml:12: train.parallel.mode: 'dpp' is not one of
// none, dp, ddp, pipeline, zero (did you mean 'ddp'?)", "--num_processes: expected an integer, got
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

// The `train:` section of the YAML file at `path`, over TrainConfig's defaults, validated
// (ValidateTrain): what a program on the trainer runtime reads to take the same section `train`
// takes (train_cli.h's ResolveTrainConfig also applies the environment and flags). InvalidConfig
// naming the file and line of a bad key, or saying the file has no `train:` section.
StatusOr<TrainConfig> LoadTrainConfigFile(const std::string& path);

// Sets one top-level key (canonical name or synonym, e.g. "nnodes") from its string form.
// Used for flags and environment variables; `origin` goes into cfg->origins and error messages.
Status ApplySetting(const std::string& key, const std::string& value, const Origin& origin,
                    LaunchConfig* cfg);

// Applies LAUNCH_<KEY> (and torchrun's PET_<KEY>) variables, plus LAUNCH_RDZV_TOKEN,
// ACCELERATE_MIXED_PRECISION (under LAUNCH_MIXED_PRECISION) and LAUNCH_TRAIN_<KEY>.
// `env` maps variable names to values (tests pass their own; main passes ::environ).
Status ApplyEnvironment(const std::map<std::string, std::string>& env, LaunchConfig* cfg);

// Cross-field checks after all layers are applied (e.g. machine_rank < nnodes), the train:
// section's included (ValidateTrain, train_keys.h).
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

// `launch --print_config`: every key with its effective value and origin (every train: key
// that applies to this configuration too).
std::string FormatConfig(const LaunchConfig& cfg);

// The effective configuration as a YAML file a worker reads back unchanged: top-level
// mixed_precision and every train: key that applies, each with its origin as a comment.
// LoadYamlFile on it gives the same TrainConfig (a tested round trip).
std::string EffectiveConfigYaml(const LaunchConfig& cfg);

}  // namespace launch::config
