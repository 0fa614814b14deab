#pragma once

// `train`'s command line, parsed in one place for the two programs that read it: `train` itself
// and `launch CONFIG.yaml -- ARGS`, which resolves the config flags among ARGS once for every
// worker and passes the rest on.
//
//   train CONFIG.yaml [--KEY VALUE ...] [--dump_params]   KEY: any train: key, e.g. --max_steps 50,
//                                                         --optimizer.lr 0.01, --model.layers 8,4
//   train --effective_config FILE [--dump_params]         what launch starts: a resolved config
//   train --self_test                                     the check behind `launch test`
//
// Resolution when run directly: defaults < CONFIG.yaml < environment (LAUNCH_*, LAUNCH_TRAIN_*,
// ACCELERATE_MIXED_PRECISION) < flags, then ValidateTrain: the same functions `launch` uses.
// An effective configuration is taken as it is: no environment, no flags.

#include <map>
#include <string>
#include <vector>

#include "base/status.h"
#include "config/launch_config.h"

namespace launch::config {

struct TrainCommandLine {
  std::string config_path;       // CONFIG.yaml
  std::string effective_config;  // --effective_config FILE
  bool self_test = false;        // --self_test
  bool dump_params = false;      // --dump_params (trainer_runtime/trainer.h TrainerOptions)
  bool help = false;             // -h/--help: print help_text and exit 0
  bool version = false;          // --version: print the version and exit 0
  std::string help_text;
  struct Setting {
    std::string path;  // train key, e.g. "optimizer.lr"
    std::string value;
    std::string flag;  // as it names the origin: "--optimizer.lr"
  };
  std::vector<Setting> settings;  // config keys given as flags, in table order

  // The options that are not configuration (for a worker's argv): --dump_params.
  std::vector<std::string> ProgramOptions() const;
};

// Parses `args` (without the program name). InvalidArgument names an unknown flag (with the
// nearest known one) or a missing value.
StatusOr<TrainCommandLine> ParseTrainCommandLine(const std::vector<std::string>& args);

// Applies the command line's config flags to cfg->train (origin: the flag; `suffix` is added to
// the origin's name, e.g. " (after --)").
Status ApplyTrainFlags(const TrainCommandLine& cl, const std::string& suffix, LaunchConfig* cfg);

// What `train` runs: the effective configuration file as it is, or CONFIG.yaml resolved with
// `env` and the flags, validated. InvalidConfig names file:line, variable or flag.
StatusOr<LaunchConfig> ResolveTrainConfig(const TrainCommandLine& cl,
                                          const std::map<std::string, std::string>& env);

}  // namespace launch::config
