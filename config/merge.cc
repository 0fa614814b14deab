// Layers over the YAML: the environment and flags through the same key tables, then the
// cross-field checks (Validate) once every layer is in.

#include <unistd.h>

#include <algorithm>

#include "base/strings.h"
#include "config/key_table.h"
#include "config/loader.h"
#include "config/scalars.h"
#include "config/train_keys.h"
#include "config/value_text.h"

namespace launch::config {

Status ApplySetting(const std::string& key, const std::string& value, const Origin& origin,
                    LaunchConfig* cfg) {
  const KeyDef* def = FindKey(key, kYaml | kEnv | kFlagOnly);
  std::string where = origin.kind == Origin::Kind::kFlag ? origin.detail : origin.ToString();
  if (!def)
    return Status::InvalidConfig(where + ": unknown setting '" + key + "'" +
                                 NearMiss(key, AllTopLevelNames()));
  return SetKey(*def, value, origin, where, cfg);
}

namespace {

// torchrun and `accelerate launch` run workers with their own interpreter (sys.executable): the
// one the user installed torch into. launch is no Python program, so without an explicit
// choice (--python, PYTHON_EXEC, LAUNCH_PYTHON, the YAML) it takes the active environment's:
// a shell that activated a virtualenv or conda environment may still find another python3
// first on PATH (pyenv's shims, a module system, a PATH rebuilt by a job script).
void ApplyPythonEnvironment(const std::map<std::string, std::string>& env, LaunchConfig* cfg) {
  if (cfg->origins.count("python")) return;
  for (const char* var : {"VIRTUAL_ENV", "CONDA_PREFIX"}) {
    auto it = env.find(var);
    if (it == env.end() || it->second.empty()) continue;
    for (const char* name : {"/bin/python", "/bin/python3"}) {
      std::string candidate = it->second + name;
      if (::access(candidate.c_str(), X_OK) != 0) continue;
      cfg->python = candidate;
      cfg->origins["python"] = Origin{Origin::Kind::kEnvironment, var};
      return;
    }
    cfg->warnings.push_back(std::string(var) + "=" + it->second +
                            " has no bin/python; Python programs run under " + cfg->python +
                            " from PATH");
  }
}

}  // namespace

Status ApplyEnvironment(const std::map<std::string, std::string>& env, LaunchConfig* cfg) {
  // What `accelerate launch` (and launch itself) exports to its workers: a trainer started by
  // either runs the precision they resolved. LAUNCH_MIXED_PRECISION (below) still wins.
  auto accelerate_mp = env.find("ACCELERATE_MIXED_PRECISION");
  if (accelerate_mp != env.end() && !accelerate_mp->second.empty())
    LAUNCH_RETURN_IF_ERROR(
        ApplySetting("mixed_precision", accelerate_mp->second,
                     Origin{Origin::Kind::kEnvironment, "ACCELERATE_MIXED_PRECISION"}, cfg));
  // torchrun runs Python workers with PYTHON_EXEC when set; LAUNCH_PYTHON (below) still wins.
  auto exec = env.find("PYTHON_EXEC");
  if (exec != env.end() && !exec->second.empty())
    LAUNCH_RETURN_IF_ERROR(ApplySetting("python", exec->second,
                                        Origin{Origin::Kind::kEnvironment, "PYTHON_EXEC"}, cfg));
  // torchrun's --shutdown_timeout falls back to this; LAUNCH_STOP_GRACE (below) still wins.
  auto shutdown = env.find("TORCH_ELASTIC_SHUTDOWN_TIMEOUT");
  if (shutdown != env.end() && !shutdown->second.empty())
    LAUNCH_RETURN_IF_ERROR(
        ApplySetting("stop_grace", shutdown->second,
                     Origin{Origin::Kind::kEnvironment, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}, cfg));
  for (const KeyDef& def : TopLevelTable()) {
    if ((def.places & kEnv) == 0) continue;
    // LAUNCH_* is ours; PET_* is what torchrun reads for its flags (PET_NPROC_PER_NODE, ...).
    std::vector<std::string> names = {def.name};
    names.insert(names.end(), def.synonyms.begin(), def.synonyms.end());
    for (const std::string& f : def.flags)
      if (f.size() > 1 && std::find(names.begin(), names.end(), f) == names.end())
        names.push_back(f);
    for (const std::string& n : names) {
      std::string upper = n;
      for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      const bool is_flag_name = n != def.name && std::find(def.synonyms.begin(), def.synonyms.end(),
                                                           n) == def.synonyms.end();
      for (const std::string& var : {"LAUNCH_" + upper, "PET_" + upper}) {
        auto it = env.find(var);
        if (it == env.end() || it->second.empty()) continue;
        Origin origin{Origin::Kind::kEnvironment, var};
        std::string value = it->second;
        if (is_flag_name && def.switch_value) {
          // A switch given as a variable (PET_MULTI_GPU=1): its value says whether it is on.
          bool on = false;
          std::string err = ParseValue(value, &on);
          if (!err.empty()) return Status::InvalidConfig(origin.ToString() + ": " + err);
          if (!on) continue;
          value = def.switch_value;
        }
        LAUNCH_RETURN_IF_ERROR(SetKey(def, value, origin, origin.ToString(), cfg));
      }
    }
  }
  ApplyPythonEnvironment(env, cfg);
  return ApplyTrainEnvironment(env, cfg);
}

std::vector<FlagSetting> FlagSettings() {
  std::vector<FlagSetting> out;
  for (const KeyDef& def : TopLevelTable()) {
    if (def.flags.empty()) continue;
    FlagSetting f;
    f.key = def.name;
    f.names = def.flags;
    f.group = def.group;
    f.help = def.help;
    f.switch_value = def.switch_value ? def.switch_value : "";
    out.push_back(f);
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> ShownSettings(const LaunchConfig& cfg) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const KeyDef& def : TopLevelTable())
    if (def.show) out.emplace_back(def.Label(), def.show(cfg));
  return out;
}

Status Validate(LaunchConfig* cfg) {
  // A head's host list says how many machines there are, which is which node and how many
  // workers each runs: the same from a flag or a variable is a contradiction (a YAML file's
  // values are what the host list overrides, as a flag would). main_process_ip stays free: the
  // address the other hosts reach the first at, where its ssh name is not (an ~/.ssh/config
  // alias).
  if (!cfg->hosts.empty()) {
    for (const char* key : {"num_machines", "machine_rank", "nproc_per_node", "num_processes"}) {
      auto it = cfg->origins.find(key);
      if (it != cfg->origins.end() && OriginLayer(&it->second) >= 2)
        return Status::InvalidConfig(
            it->second.ToString() + ": " + key + " cannot be given with " + cfg->hosts_origin +
            ": the host list names the machines (the first hosts the rendezvous) and each "
            "one's workers (its slots)");
    }
  }
  if (cfg->spares > 0 && !cfg->recover_in_place) {
    auto it = cfg->origins.find("spares");
    return Status::InvalidConfig(
        (it == cfg->origins.end() ? std::string("spares") : it->second.ToString()) +
        ": spares need recover in_place (--recover in_place): a spare takes a dead rank's place "
        "while the others wait for it");
  }
  if (cfg->rdzv_backend == "etcd") {
    if (cfg->rdzv_endpoints.empty())
      return Status::InvalidConfig(
          "rdzv_backend etcd needs rdzv_endpoint: the etcd cluster's client endpoints "
          "(--rdzv_endpoint host1:2379,host2:2379,host3:2379)");
    cfg->etcd_endpoints = cfg->rdzv_endpoints;
  } else if (cfg->rdzv_endpoints.size() > 1) {
    auto it = cfg->origins.find("main_process_ip");
    return Status::InvalidConfig(
        (it == cfg->origins.end() ? std::string("rdzv_endpoint") : it->second.ToString()) +
        ": rdzv_endpoint lists " + std::to_string(cfg->rdzv_endpoints.size()) +
        " endpoints; only rdzv_backend etcd takes a list (its cluster's members)");
  }
  if (cfg->machine_rank >= cfg->max_nodes)
    return Status::InvalidConfig(cfg->origins["machine_rank"].ToString() + ": machine_rank " +
                                 std::to_string(cfg->machine_rank) +
                                 " must be below num_machines (" + std::to_string(cfg->max_nodes) +
                                 ")");
  // num_processes (total) and nproc_per_node (per node) describe the same thing; a value from
  // a higher-precedence layer wins, and two values from the same layer must agree.
  bool nproc_explicit =
      cfg->nproc_per_node != "auto" && cfg->nproc_per_node != "gpu" && cfg->nproc_per_node != "cpu";
  if (cfg->num_processes > 0) {
    // Which layer set a key: flag > environment > file > default. A derived value ranks as
    // its default: it is what no layer asked for.
    auto rank_of = [&](const char* key) {
      auto it = cfg->origins.find(key);
      return OriginLayer(it == cfg->origins.end() ? nullptr : &it->second);
    };
    int np_rank = rank_of("num_processes"), ppn_rank = rank_of("nproc_per_node");
    if (!nproc_explicit || np_rank > ppn_rank) {
      if (cfg->min_nodes != cfg->max_nodes || cfg->num_processes % cfg->min_nodes != 0)
        return Status::InvalidConfig(cfg->origins["num_processes"].ToString() + ": num_processes " +
                                     std::to_string(cfg->num_processes) +
                                     " is not divisible by num_machines " +
                                     std::to_string(cfg->min_nodes) +
                                     " (give nproc_per_node instead for elastic or uneven nodes)");
      const int per_node = cfg->num_processes / cfg->min_nodes;
      // The same bound as nproc_per_node's own: a plan holds a few entries per worker.
      if (per_node > kMaxWorkersPerNode)
        return Status::InvalidConfig(cfg->origins["num_processes"].ToString() + ": num_processes " +
                                     std::to_string(cfg->num_processes) + " over " +
                                     std::to_string(cfg->min_nodes) + " machine(s) is " +
                                     std::to_string(per_node) + " workers per machine, more than " +
                                     std::to_string(kMaxWorkersPerNode));
      cfg->nproc_per_node = std::to_string(per_node);
      cfg->origins["nproc_per_node"] =
          Origin{Origin::Kind::kDerived, "num_processes / num_machines"};
    } else if (np_rank == ppn_rank) {
      long long ppn = 0;
      ParseInt64(cfg->nproc_per_node, &ppn);
      if (ppn * cfg->min_nodes != cfg->num_processes)
        return Status::InvalidConfig(
            cfg->origins["num_processes"].ToString() + ": num_processes " +
            std::to_string(cfg->num_processes) + " disagrees with nproc_per_node " +
            cfg->nproc_per_node + " x num_machines " + std::to_string(cfg->min_nodes) + " (" +
            cfg->origins["nproc_per_node"].ToString() + "); give one of the two");
    }
  }
  // What the rendezvous would refuse from another node's point of view ("lost the server"):
  // named here, with where the value came from.
  auto where = [&](const char* key) {
    auto it = cfg->origins.find(key);
    return it == cfg->origins.end() ? std::string(key) : it->second.ToString() + ": " + key;
  };
  if (cfg->run_id.size() > kMaxRunIdBytes || !IsPrintable(cfg->run_id))
    return Status::InvalidConfig(where("run_id") + " must be printable text of at most " +
                                 std::to_string(kMaxRunIdBytes) + " bytes (it is " +
                                 std::to_string(cfg->run_id.size()) + " bytes)");
  for (const auto& [key, value] :
       {std::pair<const char*, double>{"rdzv_conf.join_timeout", cfg->rdzv_conf.join_timeout_s},
        {"rdzv_conf.heartbeat_timeout", cfg->rdzv_conf.heartbeat_timeout_s}})
    if (value < kMinRendezvousTimeoutS)
      return Status::InvalidConfig(where(key) + " is " + Num(value) +
                                   " s; the rendezvous needs at least 0.05 s");
  if (cfg->distributed_type == DistributedType::kNo && cfg->nproc_per_node == "auto" &&
      cfg->num_processes == 0) {
    cfg->nproc_per_node = "1";
    cfg->origins["nproc_per_node"] = Origin{Origin::Kind::kDerived, "distributed_type: NO"};
  }
  if (!cfg->no_effect.empty()) {
    std::vector<std::string> unique;
    for (const std::string& n : cfg->no_effect)
      if (std::find(unique.begin(), unique.end(), n) == unique.end()) unique.push_back(n);
    cfg->warnings.push_back("these accelerate settings have no effect with launch: " +
                            Join(unique, ", "));
    cfg->no_effect.clear();
  }
  // The world size, where this node alone knows it (fixed node count, numeric workers per
  // node): rules about it are then checked before anything starts.
  long long ppn = 0;
  const int world = ParseInt64(cfg->nproc_per_node, &ppn) && cfg->min_nodes == cfg->max_nodes
                        ? static_cast<int>(ppn * cfg->min_nodes)
                        : 0;
  LAUNCH_RETURN_IF_ERROR(ValidateTrain(cfg, world));
  return Status::Ok();
}

std::vector<std::string> TopLevelKeys() {
  std::vector<std::string> names;
  for (const KeyDef& def : TopLevelTable())
    if (def.places & kYaml) names.push_back(def.name);
  return names;
}

}  // namespace launch::config
