#include "launcher/scheduler_env.h"

#include <cctype>

#include "base/strings.h"
#include "config/loader.h"

namespace launch::config {
namespace {

// One bracket group "01-04,07" -> {"01","02","03","04","07"}.
Status ExpandGroup(const std::string& group, std::vector<std::string>* out) {
  if (Trim(group).empty()) return Status::InvalidArgument("empty brackets '[]'");
  for (const std::string& raw : Split(group, ',')) {
    std::string part = Trim(raw);
    if (part.empty()) return Status::InvalidArgument("empty entry in '[" + group + "]'");
    size_t dash = part.find('-');
    std::string lo_text = dash == std::string::npos ? part : Trim(part.substr(0, dash));
    std::string hi_text = dash == std::string::npos ? part : Trim(part.substr(dash + 1));
    auto all_digits = [](const std::string& s) {
      if (s.empty() || s.size() > 18) return false;
      for (char c : s)
        if (!std::isdigit(static_cast<unsigned char>(c))) return false;
      return true;
    };
    if (!all_digits(lo_text) || !all_digits(hi_text))
      return Status::InvalidArgument("'" + part + "' in '[" + group +
                                     "]' is not a number or a range LO-HI");
    long long lo = std::stoll(lo_text), hi = std::stoll(hi_text);
    if (lo > hi)
      return Status::InvalidArgument("range '" + part + "' runs backwards (" + lo_text + " > " +
                                     hi_text + ")");
    if (static_cast<unsigned long long>(hi - lo) >= kMaxHosts)
      return Status::InvalidArgument("range '" + part + "' has more than " +
                                     std::to_string(kMaxHosts) + " hosts");
    // SLURM pads to the width of the low bound when it is written with leading zeros.
    size_t width = lo_text.size() > 1 && lo_text[0] == '0' ? lo_text.size() : 0;
    for (long long v = lo; v <= hi; ++v) {
      std::string s = std::to_string(v);
      if (s.size() < width) s.insert(0, width - s.size(), '0');
      out->push_back(std::move(s));
    }
  }
  return Status::Ok();
}

// One item "rack[1-2]-n[01-02]" (no top-level commas) -> its names, appended to `out`.
Status ExpandItem(const std::string& item, std::vector<std::string>* out) {
  std::vector<std::string> names = {""};
  size_t pos = 0;
  while (pos < item.size()) {
    size_t open = item.find_first_of("[]", pos);
    if (open == std::string::npos) {
      for (std::string& n : names) n += item.substr(pos);
      break;
    }
    if (item[open] == ']') return Status::InvalidArgument("unbalanced ']' in '" + item + "'");
    size_t close = item.find_first_of("[]", open + 1);
    if (close == std::string::npos || item[close] != ']')
      return Status::InvalidArgument("unbalanced '[' in '" + item + "'");
    std::string text = item.substr(pos, open - pos);
    std::vector<std::string> values;
    LAUNCH_RETURN_IF_ERROR(ExpandGroup(item.substr(open + 1, close - open - 1), &values));
    if (names.size() * values.size() > kMaxHosts)
      return Status::InvalidArgument("'" + item + "' expands to more than " +
                                     std::to_string(kMaxHosts) + " hosts");
    std::vector<std::string> next;
    next.reserve(names.size() * values.size());
    for (const std::string& n : names)
      for (const std::string& v : values) next.push_back(n + text + v);
    names = std::move(next);
    pos = close + 1;
  }
  if (out->size() + names.size() > kMaxHosts)
    return Status::InvalidArgument("the host list expands to more than " +
                                   std::to_string(kMaxHosts) + " hosts");
  for (std::string& n : names) out->push_back(std::move(n));
  return Status::Ok();
}

std::string Get(const std::map<std::string, std::string>& env, const std::string& name) {
  auto it = env.find(name);
  return it == env.end() ? std::string() : Trim(it->second);
}

// The first variable of `names` that is set: its name, or "" when none is.
std::string FirstSet(const std::map<std::string, std::string>& env,
                     const std::vector<std::string>& names) {
  for (const std::string& n : names)
    if (!Get(env, n).empty()) return n;
  return "";
}

// A key may take the scheduler's value when nothing above the YAML layer set it.
bool Settable(const LaunchConfig& cfg, const std::string& key) {
  auto it = cfg.origins.find(key);
  if (it == cfg.origins.end()) return true;
  return it->second.kind == Origin::Kind::kDefault || it->second.kind == Origin::Kind::kFile;
}

bool Unset(const LaunchConfig& cfg, const std::string& key) {
  auto it = cfg.origins.find(key);
  return it == cfg.origins.end() || it->second.kind == Origin::Kind::kDefault;
}

// Applies env[var] to `key` when allowed. Malformed values name the variable.
Status SetFrom(const std::map<std::string, std::string>& env, const std::string& var,
               const std::string& key, LaunchConfig* cfg) {
  if (var.empty() || !Settable(*cfg, key)) return Status::Ok();
  return ApplySetting(key, Get(env, var), Origin{Origin::Kind::kEnvironment, var}, cfg);
}

// SLURM_GPUS_ON_NODE may be "2" or, on some versions, "gpu:2" style; SLURM_CPUS_ON_NODE is a
// number. Returns 0 when absent or not a positive count.
long long CountFrom(const std::string& value) {
  std::string v = value;
  size_t colon = v.rfind(':');
  if (colon != std::string::npos) v = v.substr(colon + 1);
  long long n = 0;
  if (!ParseInt64(v, &n) || n < 0) return 0;
  return n;
}

Status ApplyMpi(const std::map<std::string, std::string>& env, LaunchConfig* cfg) {
  // OpenMPI first (it also sets PMIX_RANK), then MPICH / Intel MPI (PMI_*).
  std::string size_var = FirstSet(env, {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"});
  std::string rank_var = size_var == "OMPI_COMM_WORLD_SIZE" ? "OMPI_COMM_WORLD_RANK" : "PMI_RANK";
  std::string local_size_var =
      size_var == "OMPI_COMM_WORLD_SIZE" ? "OMPI_COMM_WORLD_LOCAL_SIZE" : "MPI_LOCALNRANKS";
  if (Get(env, rank_var).empty())
    return Status::InvalidConfig("environment " + size_var + " is set but " + rank_var + " is not");
  LAUNCH_RETURN_IF_ERROR(SetFrom(env, size_var, "num_machines", cfg));
  LAUNCH_RETURN_IF_ERROR(SetFrom(env, rank_var, "machine_rank", cfg));
  long long world = 0, local = 0;
  ParseInt64(Get(env, size_var), &world);
  bool one_host = ParseInt64(Get(env, local_size_var), &local) && local == world;
  std::string list_var = FirstSet(env, {"SLURM_JOB_NODELIST", "SLURM_NODELIST"});
  if (!one_host && world > 1 && !list_var.empty() && Settable(*cfg, "main_process_ip")) {
    // mpirun inside a SLURM allocation maps rank 0 onto the allocation's first node.
    StatusOr<std::vector<std::string>> hosts = ExpandHostList(Get(env, list_var));
    if (!hosts.ok())
      return Status::InvalidConfig("environment " + list_var + ": " + hosts.status().message());
    if (!hosts->empty())
      return ApplySetting("main_process_ip", hosts->front(),
                          Origin{Origin::Kind::kEnvironment, list_var}, cfg);
  }
  if (!one_host && world > 1 && Settable(*cfg, "main_process_ip") &&
      Unset(*cfg, "main_process_ip")) {
    cfg->warnings.push_back(
        "started by MPI (" + size_var + "=" + Get(env, size_var) +
        ") on several hosts: MPI does not say which host runs rank 0; give --main_process_ip "
        "(or main_process_ip in the config) so every launch finds the rendezvous");
  }
  return Status::Ok();
}

// SLURM's per-node task counts: "2(x3),1" -> {2, 2, 2, 1}.
StatusOr<std::vector<long long>> ExpandTaskCounts(const std::string& text) {
  std::vector<long long> counts;
  for (const std::string& raw : Split(text, ',')) {
    std::string item = Trim(raw);
    long long n = 0, times = 1;
    size_t paren = item.find("(x");
    if (paren != std::string::npos) {
      if (item.back() != ')' ||
          !ParseInt64(item.substr(paren + 2, item.size() - paren - 3), &times))
        return Status::InvalidArgument("cannot read '" + text + "'");
      item = item.substr(0, paren);
    }
    if (!ParseInt64(item, &n) || n < 1 || times < 1 || times > 100000)
      return Status::InvalidArgument("cannot read '" + text + "'");
    counts.insert(counts.end(), static_cast<size_t>(times), n);
  }
  return counts;
}

Status ApplySlurm(const std::map<std::string, std::string>& env, LaunchConfig* cfg) {
  // One run id per job, the same on every node and different for every job (no two jobs on a
  // shared head node can join each other's rendezvous by accident).
  std::string job_var = FirstSet(env, {"SLURM_JOB_ID", "SLURM_JOBID"});
  long long job_id = -1;
  ParseInt64(Get(env, job_var), &job_id);
  if (Unset(*cfg, "run_id"))
    LAUNCH_RETURN_IF_ERROR(ApplySetting("run_id", "slurm-" + Get(env, job_var),
                                        Origin{Origin::Kind::kEnvironment, job_var}, cfg));
  long long job_nodes = 0;
  ParseInt64(Get(env, FirstSet(env, {"SLURM_JOB_NUM_NODES", "SLURM_NNODES"})), &job_nodes);
  if (Get(env, "SLURM_STEP_ID").empty()) {
    // The batch script itself: one shell on the first node, whatever the allocation.
    if (job_nodes > 1)
      cfg->warnings.push_back(
          "running in the batch script of a " + std::to_string(job_nodes) +
          "-node SLURM job without srun: only this node is used; start one launch per node "
          "with `srun --ntasks-per-node=1 launch ...`");
    return Status::Ok();
  }
  std::string tasks_var = FirstSet(env, {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"});
  std::string nodes_var = FirstSet(env, {"SLURM_STEP_NUM_NODES", "SLURM_NNODES"});
  std::string machines_var = !tasks_var.empty() ? tasks_var : nodes_var;
  long long tasks = 0, nodes = 0;
  ParseInt64(Get(env, tasks_var), &tasks);
  ParseInt64(Get(env, nodes_var), &nodes);
  LAUNCH_RETURN_IF_ERROR(SetFrom(env, machines_var, "num_machines", cfg));
  LAUNCH_RETURN_IF_ERROR(
      SetFrom(env, FirstSet(env, {"SLURM_PROCID", "SLURM_NODEID"}), "machine_rank", cfg));
  // Several launches: the rendezvous port is derived from the job id, as Lightning does (15000
  // + the id's last 4 digits: below Linux's ephemeral range, and jobs on one head node differ).
  if (tasks > 1 && job_id >= 0 && Unset(*cfg, "main_process_port"))
    LAUNCH_RETURN_IF_ERROR(
        ApplySetting("main_process_port", std::to_string(15000 + job_id % 10000),
                     Origin{Origin::Kind::kDerived, "15000 + " + job_var + " % 10000"}, cfg));

  bool per_task = tasks > 0 && nodes > 0 && tasks > nodes;
  if (per_task) {
    // Lightning's layout (srun --ntasks-per-node=G): each task is one worker. Its LOCAL_RANK is
    // SLURM_LOCALID and LOCAL_WORLD_SIZE the node's task count, not G workers per task (G^2).
    long long local_id = -1, node_id = -1;
    if (!ParseInt64(Get(env, "SLURM_LOCALID"), &local_id) ||
        !ParseInt64(Get(env, "SLURM_NODEID"), &node_id))
      return Status::InvalidConfig("environment " + tasks_var + "=" + std::to_string(tasks) +
                                   " on " + std::to_string(nodes) +
                                   " nodes, but SLURM_LOCALID / SLURM_NODEID are not set");
    std::string per_node_var = FirstSet(env, {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"});
    long long on_node = tasks / nodes;
    if (!per_node_var.empty()) {
      StatusOr<std::vector<long long>> counts = ExpandTaskCounts(Get(env, per_node_var));
      if (!counts.ok())
        return Status::InvalidConfig("environment " + per_node_var + ": " +
                                     counts.status().message());
      if (node_id < static_cast<long long>(counts->size())) on_node = (*counts)[node_id];
    }
    cfg->task_layout.local_rank = static_cast<int>(local_id);
    cfg->task_layout.local_world_size = static_cast<int>(on_node);
    cfg->task_layout.node_rank = static_cast<int>(node_id);
    cfg->task_layout.num_nodes = static_cast<int>(nodes);
    if (Unset(*cfg, "nproc_per_node") && Unset(*cfg, "num_processes"))
      LAUNCH_RETURN_IF_ERROR(
          ApplySetting("nproc_per_node", "1",
                       Origin{Origin::Kind::kDerived,
                              "one worker per SLURM task: " + tasks_var + " > " + nodes_var},
                       cfg));
  }

  std::string list_var =
      FirstSet(env, {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"});
  if (!list_var.empty() && Settable(*cfg, "main_process_ip")) {
    StatusOr<std::vector<std::string>> hosts = ExpandHostList(Get(env, list_var));
    if (!hosts.ok())
      return Status::InvalidConfig("environment " + list_var + ": " + hosts.status().message());
    if (hosts->empty())
      return Status::InvalidConfig("environment " + list_var + ": the host list is empty");
    LAUNCH_RETURN_IF_ERROR(ApplySetting("main_process_ip", hosts->front(),
                                        Origin{Origin::Kind::kEnvironment, list_var}, cfg));
  }

  // Processes per node from the allocation, only when no count was given anywhere: a
  // num_processes from the YAML must not be overridden by an environment-level nproc_per_node.
  // GPUs allocated through GRES count; without GRES a node may still have GPUs (whole-node
  // allocations), so only a CPU job takes the CPU count, anything else counts visible GPUs.
  if (!per_task && Unset(*cfg, "nproc_per_node") && Unset(*cfg, "num_processes")) {
    std::string gpus_var = FirstSet(env, {"SLURM_GPUS_ON_NODE"});
    std::string cpus_var = FirstSet(env, {"SLURM_CPUS_ON_NODE"});
    long long count = 0;
    if (!gpus_var.empty() && (count = CountFrom(Get(env, gpus_var))) > 0) {
      LAUNCH_RETURN_IF_ERROR(ApplySetting("nproc_per_node", std::to_string(count),
                                          Origin{Origin::Kind::kEnvironment, gpus_var}, cfg));
    } else if (cfg->distributed_type == DistributedType::kMultiCpu) {
      if (!cpus_var.empty() && (count = CountFrom(Get(env, cpus_var))) > 0)
        LAUNCH_RETURN_IF_ERROR(ApplySetting("nproc_per_node", std::to_string(count),
                                            Origin{Origin::Kind::kEnvironment, cpus_var}, cfg));
    } else {
      LAUNCH_RETURN_IF_ERROR(
          ApplySetting("nproc_per_node", "auto",
                       Origin{Origin::Kind::kDerived,
                              "SLURM allocated no GPUs through GRES: the GPUs this "
                              "node shows, else one per allocated CPU"},
                       cfg));
    }
  }
  return Status::Ok();
}

}  // namespace

StatusOr<std::vector<std::string>> ExpandHostList(const std::string& host_list) {
  std::vector<std::string> hosts;
  std::string item;
  int depth = 0;
  auto flush = [&]() -> Status {
    std::string t = Trim(item);
    item.clear();
    if (t.empty()) return Status::InvalidArgument("empty host name in '" + host_list + "'");
    return ExpandItem(t, &hosts);
  };
  for (char c : host_list) {
    if (c == '[') {
      if (++depth > 1) return Status::InvalidArgument("nested '[' in '" + host_list + "'");
    } else if (c == ']') {
      if (--depth < 0) return Status::InvalidArgument("unbalanced ']' in '" + host_list + "'");
    } else if (std::isspace(static_cast<unsigned char>(c)) && depth == 0) {
      continue;
    }
    if (c == ',' && depth == 0) {
      LAUNCH_RETURN_IF_ERROR(flush());
      continue;
    }
    item += c;
  }
  if (depth != 0) return Status::InvalidArgument("unbalanced '[' in '" + host_list + "'");
  if (!Trim(item).empty() || !hosts.empty() || !Trim(host_list).empty()) {
    LAUNCH_RETURN_IF_ERROR(flush());
  }
  return hosts;
}

Status ApplySchedulerEnvironment(const std::map<std::string, std::string>& env, LaunchConfig* cfg) {
  // mpirun's own variables describe the launch processes best: under SLURM, mpirun (OpenMPI,
  // MPICH's hydra) starts its daemons with srun, so the SLURM step variables describe the
  // daemons, not the ranks. srun --mpi=pmi2 sets PMI_* consistently with its SLURM_* variables.
  if (!Get(env, "OMPI_COMM_WORLD_SIZE").empty()) return ApplyMpi(env, cfg);
  std::string pmi_size = Get(env, "PMI_SIZE");
  if (!FirstSet(env, {"SLURM_JOB_ID", "SLURM_JOBID"}).empty()) {
    std::string slurm_tasks =
        Get(env, FirstSet(env, {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"}));
    if (!pmi_size.empty() && pmi_size != slurm_tasks) return ApplyMpi(env, cfg);
    return ApplySlurm(env, cfg);
  }
  if (!pmi_size.empty()) return ApplyMpi(env, cfg);
  return Status::Ok();
}

}  // namespace launch::config
