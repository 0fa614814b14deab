#pragma once

// The `train:` keys, written once. One row per leaf key carries its path, when it applies (the
// model, data or mode it belongs to), its bounded parser, its printer, its one-line doc, its enum
// names and whether it belongs to the run identity a resume must match. Every consumer iterates
// the rows: the YAML reader (yaml_reader.cc), LAUNCH_TRAIN_* variables, `train`'s and
// `launch -- `'s flags (train_cli.h), --print_config, the effective configuration `launch` hands
// its workers (EffectiveConfigYaml), TrajectorySettings and the wizard's defaults.
//
// Adding a key: a field in train_config.h (default and meaning) and a row in train_keys.cc.

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "config/launch_config.h"

namespace launch::config {

// A value as written: a scalar, or a list of scalars (YAML sequence, or `[a, b]` / `a,b` text).
struct TrainValue {
  bool is_list = false;
  std::string scalar;
  std::vector<std::string> items;
  std::string Text() const;  // the scalar, or "[a, b]"
  static TrainValue Scalar(std::string s);
  static TrainValue List(std::vector<std::string> items);
  // Text from a flag or a variable: a list when `list_key` and it looks like one ("[a, b]", "a,b").
  static TrainValue FromText(const std::string& text, bool list_key);
};

struct TrainKey {
  std::string path;  // below `train.`: "optimizer.lr", "data.augment.flip"
  std::string doc;   // one line: what it means (the default is printed from TrainConfig{})
  // Whether the key exists for this configuration (e.g. model.heads only for a transformer),
  // and the same in words for messages and docs ("model.type transformer"); null = always.
  std::function<bool(const TrainConfig&)> applies;
  std::string applies_doc;
  // Parses and bounds-checks `v` into `t`: "" on success, else the error without location.
  std::function<std::string(const TrainValue& v, TrainConfig* t)> set;
  std::function<TrainValue(const TrainConfig& t)> show;
  std::vector<std::string> choices;  // an enum's names, in the table's order; empty otherwise
  bool is_list = false;              // the value is a list
  // Part of the run identity (TrajectorySettings): changing it changes the trajectory.
  // identity_if narrows that further (e.g. comm_hook only when not none); null = when applies.
  bool identity = false;
  std::function<bool(const TrainConfig&)> identity_if;

  bool AppliesTo(const TrainConfig& t) const { return !applies || applies(t); }

  // Builder steps, in the style of the top-level KeyDef chain.
  TrainKey& When(std::function<bool(const TrainConfig&)> p, std::string doc) {
    applies = std::move(p);
    applies_doc = std::move(doc);
    return *this;
  }
  TrainKey& Identity(std::function<bool(const TrainConfig&)> only_if = nullptr) {
    identity = true;
    identity_if = std::move(only_if);
    return *this;
  }
};

// Every row, in application order (a type before the keys that depend on it).
const std::vector<TrainKey>& TrainKeys();
// The row for `path` ("train." prefix optional) that applies to `t`, else null. `any` = a row
// of that path exists at all (for "does not apply to ..." messages).
const TrainKey* FindTrainKey(const std::string& path, const TrainConfig& t, bool* any = nullptr);
// The sections (maps) of `train:`: "model", "data", "data.augment", "model.outputs", ...
bool IsTrainSection(const std::string& path);
// The section a dotted key lives in: "train.optimizer" for "train.optimizer.lr", "" for a name
// without a dot.
std::string KeySection(const std::string& path);
// The leaf and section names directly below `section` ("" = train itself) that apply to `t`.
std::vector<std::string> TrainNamesBelow(const std::string& section, const TrainConfig& t);

// Sets one key from a flag or variable: `path` is relative to train: ("max_steps",
// "optimizer.lr"; a leading "train." is accepted). Records cfg->origins["train." + path] and
// applies derived defaults (optimizer.type sets weight_decay's default unless it was given).
// InvalidConfig "<where>: train.<path>: <why>".
Status ApplyTrainSetting(const std::string& path, const TrainValue& value, const Origin& origin,
                         const std::string& where, LaunchConfig* cfg);

// LAUNCH_TRAIN_<PATH> (dots as underscores, upper case): LAUNCH_TRAIN_MAX_STEPS,
// LAUNCH_TRAIN_OPTIMIZER_LR. Unknown LAUNCH_TRAIN_* variables are errors.
std::string TrainEnvName(const std::string& path);
Status ApplyTrainEnvironment(const std::map<std::string, std::string>& env, LaunchConfig* cfg);

// A cross-field rule of `train:` that a configuration breaks: the key it is about ("model" for
// the model as a whole), the message, and the keys whose origin locates it (first given wins;
// empty = the key itself).
struct TrainRuleViolation {
  std::string key;
  std::string message;
  std::vector<std::string> at;
};

// The cross-field rules of `train:`, each written once (train_rules.cc): ValidateTrain reports
// them with the place of the key, and the trainer runtime (Accelerator::Create) for
// configurations built in code, as "train.<key>: <message>". `world_size` is the job's process
// count, 0 when not known (launch across elastic nodes; a rule about it then waits for the
// runtime). `builtin_model` false leaves out the rules that tie the layout to `train`'s own
// models (tensor parallelism splits the built-in transformer: its heads and vocabulary), for a
// program that brings its own model (Accelerator::Create).
std::optional<TrainRuleViolation> CheckTrainRules(const TrainConfig& t, int world_size,
                                                  bool builtin_model = true);
// InvalidConfig "train.<key>: <message>" for the first broken rule, else Ok.
Status CheckTrainRulesStatus(const TrainConfig& t, int world_size, bool builtin_model = true);

// Once all layers are applied (YAML, environment, flags): derived defaults (weight_decay for
// the optimizer type, idx data's directory), then the rules and the data files' presence.
// Errors name the file:line (or flag, or variable) of the key in question, from cfg->origins.
Status ValidateTrain(LaunchConfig* cfg, int world_size = 0);

// For the wizard and docs: a key's default (as printed from TrainConfig{}), its enum names
// joined as "a | b | c", its doc line. The key must exist (a broken invariant otherwise).
std::string TrainDefault(const std::string& path);
std::string TrainChoices(const std::string& path);
std::string TrainDoc(const std::string& path);

// Every key that applies to `t`, in table order: ("train.<path>", value as text).
std::vector<std::pair<std::string, std::string>> TrainSettings(const TrainConfig& t);

}  // namespace launch::config
