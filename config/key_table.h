#pragma once

// The top-level key table (KeyDef): ONE row per key serves the YAML file, LAUNCH_* / PET_*
// variables, command-line flags (the launcher builds its flags and --help from FlagSettings()),
// --rdzv_conf and --print_config, so a key is named, parsed, validated and shown in one place.
// Internal to config/; top_level_keys.cc holds the rows, accelerate_keys.cc accelerate's.

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "base/status.h"
#include "config/launch_config.h"

namespace launch::config {

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

inline KeyDef Key(std::string name, Setter set) {
  KeyDef d;
  d.name = std::move(name);
  d.set = std::move(set);
  return d;
}

// A flag with no counterpart: a precise error instead of "unknown flag".
inline Setter Unsupported(const char* why) {
  return [why](const std::string&, LaunchConfig*) { return std::string("not supported: ") + why; };
}

// Every row: launch's own keys, then accelerate's flags (AddAccelerateKeys).
const std::vector<KeyDef>& TopLevelTable();
void AddAccelerateKeys(std::vector<KeyDef>* table);

// accelerate config keys that change nothing here, with the values that ask for nothing (a
// value outside them is named in the one no-effect warning; "*" = any value).
const std::map<std::string, std::vector<std::string>>& InertAccelerateKeys();
// accelerate's config sections whose keys are accelerate's flag names, with the prefix added
// when missing, as accelerate does: fsdp_config's `sharding_strategy` is fsdp_sharding_strategy.
const std::map<std::string, std::string>& AccelerateSections();

// The built-in trainer's parallel mode from accelerate's FSDP and DeepSpeed settings
// (distributed_type FSDP / DEEPSPEED or --use_fsdp / --use_deepspeed, with
// fsdp_sharding_strategy, fsdp_reshard_after_forward, zero_stage or deepspeed_config_file):
// sets train.parallel.mode and zero_stage as derived values, unless train: keys from a higher
// layer say otherwise; a disagreement within one layer is InvalidConfig. Settings the trainer
// does not honour (offload, wrap policies, ...) are named in one warning. ValidateTrain calls it.
Status ApplyAccelerateSharding(LaunchConfig* cfg);
// accelerate's tensor-parallel degree (parallelism_config_tp_size; megatron_lm_tp_degree with
// use_megatron_lm or distributed_type MEGATRON_LM) is the built-in trainer's train.parallel.tensor:
// taken where train: gives none (a derived value), refused naming both where the same layer gives
// another, a higher layer's value kept.
Status ApplyAccelerateTensorParallel(LaunchConfig* cfg);

// The precedence layer a value came from: flag 3 > environment 2 > file 1 > default or derived
// 0 (null: 0).
int OriginLayer(const Origin* o);

// The key named `key` (its name or a synonym) among those that may be given at `places`.
const KeyDef* FindKey(const std::string& key, unsigned places);
std::vector<std::string> NamesAt(unsigned places);
std::vector<std::string> AllTopLevelNames();

// Sets `def` from `value`; records the origin under the key(s) it sets.
Status SetKey(const KeyDef& def, const std::string& value, const Origin& origin,
              const std::string& where, LaunchConfig* cfg);

}  // namespace launch::config
