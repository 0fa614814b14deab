// The YAML reader: a job file's top-level keys through the key table (key_table.h), accelerate's
// sections into LaunchConfig::accelerate, and `train:` through the train key table
// (train_keys.h). Every error names file:line and the key.

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>

#include "base/files.h"
#include "base/strings.h"
#include "config/key_table.h"
#include "config/loader.h"
#include "config/scalars.h"
#include "config/train_keys.h"

namespace launch::config {
namespace {

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

// A value as accelerate passes it on: scalars as written, a list as "a,b".
std::string AccelerateText(const YAML::Node& v) {
  if (v.IsScalar()) return v.Scalar();
  std::vector<std::string> items;
  if (v.IsSequence())
    for (const YAML::Node& item : v) items.push_back(item.IsScalar() ? item.Scalar() : "");
  return Join(items, ",");
}

// The `train:` section, leaf by leaf: the YAML is flattened into (path, node) pairs, then the
// rows of the train key table take theirs in table order (a type before the keys it governs),
// and what no applicable row took is an unknown key.
struct Leaf {
  std::string path;  // below train:
  YAML::Node key, value;
  bool taken = false;
};

Status Flatten(const YamlContext& ctx, const YAML::Node& node, const std::string& section,
               std::vector<Leaf>* leaves) {
  const std::string qualified = section.empty() ? "train" : "train." + section;
  if (!node.IsMap())
    return Status::InvalidConfig(ctx.Where(node) + ": " + qualified +
                                 ": expected a mapping (key: value)");
  ctx.cfg->origins[qualified] = Origin{Origin::Kind::kFile, ctx.Where(node)};
  for (auto it = node.begin(); it != node.end(); ++it) {
    std::string path = (section.empty() ? "" : section + ".") + ScalarText(it->first);
    if (it->second.IsNull()) continue;  // `key: null` keeps the default
    if (IsTrainSection(path)) {
      LAUNCH_RETURN_IF_ERROR(Flatten(ctx, it->second, path, leaves));
    } else {
      leaves->push_back(Leaf{path, it->first, it->second});
    }
  }
  return Status::Ok();
}

Status LoadTrain(const YamlContext& ctx, const YAML::Node& node, LaunchConfig* cfg) {
  std::vector<Leaf> leaves;
  LAUNCH_RETURN_IF_ERROR(Flatten(ctx, node, "", &leaves));
  cfg->train.present = true;
  for (const TrainKey& key : TrainKeys()) {
    for (Leaf& leaf : leaves) {
      if (leaf.taken || leaf.path != key.path) continue;
      if (FindTrainKey(key.path, cfg->train) != &key) continue;
      leaf.taken = true;
      TrainValue value;
      if (leaf.value.IsSequence()) {
        std::vector<std::string> items;
        for (const YAML::Node& item : leaf.value) {
          if (!item.IsScalar())
            return Status::InvalidConfig(ctx.Where(item) + ": train." + leaf.path +
                                         ": expected a scalar");
          items.push_back(item.Scalar());
        }
        value = TrainValue::List(items);
      } else if (leaf.value.IsScalar()) {
        value = TrainValue::Scalar(leaf.value.Scalar());
      } else {
        return Status::InvalidConfig(ctx.Where(leaf.value) + ": train." + leaf.path +
                                     ": expected a single value");
      }
      LAUNCH_RETURN_IF_ERROR(ApplyTrainSetting(leaf.path, value,
                                               Origin{Origin::Kind::kFile, ctx.Where(leaf.value)},
                                               ctx.Where(leaf.value), cfg));
    }
  }
  for (const Leaf& leaf : leaves) {
    if (leaf.taken) continue;
    size_t dot = leaf.path.rfind('.');
    std::string section = dot == std::string::npos ? "" : leaf.path.substr(0, dot);
    std::string name = leaf.path.substr(dot == std::string::npos ? 0 : dot + 1);
    // A key of the table that this configuration does not have: say what it needs.
    std::vector<std::string> needs;
    for (const TrainKey& key : TrainKeys())
      if (key.path == leaf.path && !key.applies_doc.empty()) needs.push_back(key.applies_doc);
    if (!needs.empty())
      return Status::InvalidConfig(ctx.Where(leaf.key) + ": train." + leaf.path +
                                   ": applies only with " + Join(needs, " or "));
    return Status::InvalidConfig(ctx.Where(leaf.key) + ": train." + leaf.path + ": unknown key" +
                                 NearMiss(name, TrainNamesBelow(section, cfg->train)));
  }
  return Status::Ok();
}

// yaml-cpp keeps both entries of a key given twice in one mapping, and the later one would win
// silently: a config edited by appending (`num_processes: 3` under an old `num_processes: 1`)
// is refused, naming both lines. Aliases may make a small file a huge tree ("billion laughs")
// or an endless one (`&a [*a]`): the walk stops after `budget` nodes and below kMaxDepth levels
// (no config key is nested more than a few levels deep).
Status RefuseDuplicateKeys(const YamlContext& ctx, const YAML::Node& node, const std::string& path,
                           int* budget, int depth = 0) {
  constexpr int kMaxDepth = 32;
  if (--*budget < 0 || depth > kMaxDepth) return Status::Ok();
  if (node.IsSequence()) {
    for (const YAML::Node& item : node)
      LAUNCH_RETURN_IF_ERROR(RefuseDuplicateKeys(ctx, item, path, budget, depth + 1));
    return Status::Ok();
  }
  if (!node.IsMap()) return Status::Ok();
  std::map<std::string, YAML::Node> seen;
  for (auto kv = node.begin(); kv != node.end(); ++kv) {
    if (!kv->first.IsScalar()) continue;
    const std::string key = kv->first.Scalar();
    auto [it, fresh] = seen.emplace(key, kv->first);
    if (!fresh)
      return Status::InvalidConfig(ctx.Where(kv->first) + ": " + path + key +
                                   " is given twice (first at line " +
                                   std::to_string(it->second.Mark().line + 1) + ")");
    LAUNCH_RETURN_IF_ERROR(
        RefuseDuplicateKeys(ctx, kv->second, path + key + ".", budget, depth + 1));
  }
  return Status::Ok();
}

Status LoadDocument(const YAML::Node& root, const std::string& name, LaunchConfig* cfg) {
  YamlContext ctx{name, cfg};
  if (root.IsNull() || !root.IsDefined()) return Status::Ok();  // empty file: all defaults
  int budget = 1 << 20;
  LAUNCH_RETURN_IF_ERROR(RefuseDuplicateKeys(ctx, root, "", &budget));
  if (!root.IsMap())
    return Status::InvalidConfig(ctx.Where(root) + ": expected a mapping of keys at the top level");
  std::vector<std::string> ignored;
  for (auto it = root.begin(); it != root.end(); ++it) {
    std::string key = ScalarText(it->first);
    const YAML::Node& value = it->second;
    std::string where = ctx.Where(it->first);
    if (key == "train") {
      LAUNCH_RETURN_IF_ERROR(LoadTrain(ctx, value, cfg));
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
      std::vector<std::string> fine = {"false", ""};
      if (inert != InertAccelerateKeys().end()) fine = inert->second;
      auto fine_value = [&](const std::string& text) {
        return std::find(fine.begin(), fine.end(), "*") != fine.end() ||
               std::find(fine.begin(), fine.end(), ToLower(text)) != fine.end();
      };
      bool harmless = value.IsNull() || (!value.IsMap() && fine_value(AccelerateText(value)));
      if (value.IsMap()) {
        // A section (`ipex_config: {ipex: false}`, which `accelerate config` writes for every
        // CPU machine) asks for nothing when each of its values is one that asks for nothing.
        harmless = true;
        for (auto kv = value.begin(); kv != value.end(); ++kv)
          harmless &= kv->second.IsNull() || fine_value(AccelerateText(kv->second));
      }
      if (!harmless) ignored.push_back(key);
      continue;
    }
    const KeyDef* def = FindKey(key, kYaml);
    if (!def && Trim(key).empty())  // `{"a": 1,,}` reads as an empty key
      return Status::InvalidConfig(where + ": an empty key (a stray ',' or ':'?)");
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
  return Status::Ok();
}

}  // namespace

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
  // A config is a file someone wrote: a directory is not read as an empty one, and /dev/zero
  // is not read until memory runs out.
  StatusOr<std::string> text = ReadRegularFile(path, kMaxConfigBytes);
  if (!text.ok())
    return Status::InvalidConfig(text.status().code() == Status::Code::kNotFound
                                     ? path + ": cannot open the config file"
                                     : "the config file " + text.status().message());
  cfg->config_path = path;
  return LoadYamlString(*text, path, cfg);
}

StatusOr<TrainConfig> LoadTrainConfigFile(const std::string& path) {
  LaunchConfig cfg;
  LAUNCH_RETURN_IF_ERROR(LoadYamlFile(path, &cfg));
  if (!cfg.train.present)
    return Status::InvalidConfig(path + ": no `train:` section (see configs/quickstart.yaml)");
  LAUNCH_RETURN_IF_ERROR(ValidateTrain(&cfg));
  return cfg.train;
}

}  // namespace launch::config
