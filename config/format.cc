// `launch --print_config`: the effective configuration, one key per line, with its origin.

#include <sstream>

#include "base/strings.h"
#include "config/loader.h"

namespace launch::config {
namespace {

std::string StreamSpecText(const StreamSpec& s) {
  if (s.per_rank.empty()) return std::to_string(s.all);
  std::vector<std::string> parts;
  for (const auto& [rank, mask] : s.per_rank)
    parts.push_back(std::to_string(rank) + ":" + std::to_string(mask));
  return Join(parts, ",");
}

template <typename T>
std::string ListText(const std::vector<T>& v) {
  std::vector<std::string> parts;
  for (const auto& x : v) {
    std::ostringstream o;
    o << x;
    parts.push_back(o.str());
  }
  return "[" + Join(parts, ", ") + "]";
}

std::string Num(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

}  // namespace

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
  line("distributed_type", ToString(c.distributed_type));
  line("num_processes", c.num_processes ? std::to_string(c.num_processes) : "");
  line("nproc_per_node", c.nproc_per_node);
  line("num_machines", c.min_nodes == c.max_nodes
                           ? std::to_string(c.min_nodes)
                           : std::to_string(c.min_nodes) + ":" + std::to_string(c.max_nodes));
  line("machine_rank", c.machine_rank < 0 ? "" : std::to_string(c.machine_rank));
  line("main_process_ip", c.main_process_ip);
  line("main_process_port", c.main_process_port < 0 ? "" : std::to_string(c.main_process_port));
  line("rdzv_token", c.rdzv_token.empty() ? "" : "(set, hidden)");
  line("rdzv_conf.join_timeout", Num(c.rdzv_conf.join_timeout_s));
  line("rdzv_conf.last_call_timeout", Num(c.rdzv_conf.last_call_timeout_s));
  line("rdzv_conf.heartbeat_timeout", Num(c.rdzv_conf.heartbeat_timeout_s));
  line("run_id", c.run_id);
  line("role", c.role);
  line("max_restarts", std::to_string(c.max_restarts));
  line("gpu_ids", c.gpu_ids);
  line("mixed_precision", c.mixed_precision);
  line("log_dir", c.log_dir);
  line("tee", StreamSpecText(c.tee));
  line("redirects", StreamSpecText(c.redirects));
  line("local_ranks_filter", c.local_ranks_filter.empty() ? "" : ListText(c.local_ranks_filter));
  line("stop_grace", Num(c.stop_grace_s));
  if (!c.program.empty()) out << "program: " << Join(c.program, " ") << "\n";
  if (c.train.present) {
    const TrainConfig& t = c.train;
    out << "train:\n";
    line("train.seed", std::to_string(t.seed));
    line("train.output_dir", t.output_dir);
    line("train.model.type", ToString(t.model.type));
    line("train.data.type", ToString(t.data.type));
    line("train.batch_size", std::to_string(t.batch_size));
    line("train.max_steps", std::to_string(t.max_steps));
    line("train.epochs", std::to_string(t.epochs));
    line("train.optimizer.type", ToString(t.optimizer.type));
    line("train.optimizer.lr", Num(t.optimizer.lr));
    line("train.scheduler.type", ToString(t.scheduler.type));
    line("train.parallel.mode", ToString(t.parallel.mode));
    line("train.gradient_accumulation_steps", std::to_string(t.gradient_accumulation_steps));
    line("train.sync_each_batch", t.sync_each_batch ? "true" : "false");
    line("train.local_sgd_steps", std::to_string(t.local_sgd_steps));
    line("train.checkpoint_every", std::to_string(t.checkpoint_every));
  }
  for (const auto& w : c.warnings) out << "# warning: " << w << "\n";
  return out.str();
}

}  // namespace launch::config
