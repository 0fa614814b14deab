// How the effective configuration is written out: `launch --print_config` (one key per line,
// with its origin) and the YAML file `launch` hands its workers (EffectiveConfigYaml).

#include <yaml-cpp/yaml.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "base/strings.h"
#include "config/loader.h"
#include "config/train_keys.h"
#include "config/value_text.h"

namespace launch::config {

std::string StreamSpecText(const StreamSpec& s) {
  if (s.per_rank.empty()) return std::to_string(s.all);
  std::vector<std::string> parts;
  for (const auto& [rank, mask] : s.per_rank)
    parts.push_back(std::to_string(rank) + ":" + std::to_string(mask));
  return Join(parts, ",");
}

std::string Num(double v) {
  // The shortest %g form that reads back as the same double: the effective configuration
  // `launch` hands its workers must mean exactly what was resolved.
  char buf[32];
  for (int precision = 6; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

std::string Bool(bool v) { return v ? "true" : "false"; }

std::string FormatConfig(const LaunchConfig& c) {
  std::ostringstream out;
  auto line = [&](const std::string& key, const std::string& value) {
    auto it = c.origins.find(key);
    std::string origin = it == c.origins.end() ? "default" : it->second.ToString();
    std::string shown = value.empty() ? "(unset)" : value;
    std::string lhs = key + ": " + shown;
    if (lhs.size() < 44) lhs.resize(44, ' ');
    out << lhs << "  # " << origin << "\n";
  };
  out << "# effective configuration (" << (c.config_path.empty() ? "no config file" : c.config_path)
      << "); precedence: flag > environment > YAML > default\n";
  for (const auto& [key, value] : ShownSettings(c)) line(key, value);
  if (!c.program.empty()) out << "program: " << Join(c.program, " ") << "\n";
  if (c.train.present) {
    out << "train:\n";
    for (const auto& [key, value] : TrainSettings(c.train)) line(key, value);
  }
  for (const auto& w : c.warnings) out << "# warning: " << w << "\n";
  return out.str();
}

namespace {

// The applicable train keys as a tree of sections, in table order, for the emitter.
struct Node {
  std::string name;
  const TrainKey* key = nullptr;  // a leaf
  std::vector<Node> children;
  Node& Child(const std::string& n) {
    for (Node& c : children)
      if (c.name == n && !c.key) return c;
    children.push_back(Node{n, nullptr, {}});
    return children.back();
  }
};

void Emit(YAML::Emitter& y, const Node& node, const LaunchConfig& c, const std::string& prefix) {
  y << YAML::BeginMap;
  for (const Node& child : node.children) {
    const std::string path = prefix + child.name;
    y << YAML::Key << child.name << YAML::Value;
    if (!child.key) {
      Emit(y, child, c, path + ".");
      continue;
    }
    TrainValue v = child.key->show(c.train);
    if (v.is_list) {
      y << YAML::Flow << YAML::BeginSeq;
      for (const std::string& item : v.items) y << item;
      y << YAML::EndSeq;
    } else {
      y << v.scalar;  // quoted by the emitter where plain text would read back otherwise
    }
    auto origin = c.origins.find("train." + path);
    if (origin != c.origins.end()) y << YAML::Comment(origin->second.ToString());
  }
  y << YAML::EndMap;
}

}  // namespace

std::string EffectiveConfigYaml(const LaunchConfig& c) {
  Node root;
  for (const TrainKey& k : TrainKeys()) {
    if (!k.AppliesTo(c.train)) continue;
    Node* at = &root;
    std::vector<std::string> parts = Split(k.path, '.');
    for (size_t i = 0; i + 1 < parts.size(); ++i) at = &at->Child(parts[i]);
    bool seen = false;
    for (const Node& n : at->children) seen |= n.key && n.name == parts.back();
    if (!seen) at->children.push_back(Node{parts.back(), &k, {}});
  }
  YAML::Emitter y;
  y << YAML::BeginMap;
  y << YAML::Key << "mixed_precision" << YAML::Value << c.mixed_precision;
  auto mp = c.origins.find("mixed_precision");
  if (mp != c.origins.end()) y << YAML::Comment(mp->second.ToString());
  y << YAML::Key << "train" << YAML::Value;
  Emit(y, root, c, "");
  y << YAML::EndMap;
  return "# The effective configuration of this run: " +
         (c.config_path.empty() ? std::string("no config file") : c.config_path) +
         " resolved once by launch\n"
         "# (flag > environment > YAML > default; a value's origin is its comment, none = "
         "default).\n# Every worker trains exactly this: `train --effective_config FILE` applies "
         "no environment\n# and no flags.\n" +
         y.c_str() + "\n";
}

}  // namespace launch::config
