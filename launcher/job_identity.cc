#include "launcher/job_identity.h"

#include <string_view>

#include "base/strings.h"
#include "config/train_config.h"

namespace launch::launcher {

// The built-in trainer's settings that every rank must share (TrajectorySettings, output_dir):
// not the top-level keys, which legitimately differ per machine (machine_rank in the wizard's
// per-machine files). Empty when the job runs a program of its own.
std::string TrainerIdentity(const config::LaunchConfig& cfg) {
  if (!cfg.program.empty() || !cfg.train.present) return "";
  std::string text = cfg.train.output_dir;
  for (const auto& [key, value] : config::TrajectorySettings(cfg.train))
    text += "\n" + key + "=" + value;
  return Hex64(Fnv1a64(text)).substr(0, 12);
}

// What makes a job this job, as every node of it sees it: the role, the program as given
// (not as resolved: install paths may differ between machines) with the content of each
// argument that names a small file here (the script: two projects' `python train.py` differ
// there, not in the command), and for the trainer its settings (above).
std::string JobIdentityHash(const config::LaunchConfig& cfg, PlanSystem& sys) {
  uint64_t h = kFnv1aInit;
  auto add = [&h](const std::string& part) {
    h = Fnv1a64(std::string_view(part.c_str(), part.size() + 1), h);
  };
  add(cfg.role);
  add(cfg.run_module ? "-m" : "");
  for (const std::string& arg : cfg.program) {
    add(arg);
    // Not a file, or a larger one (a data set given as an argument): the name alone.
    StatusOr<std::string> content = sys.ReadRegularFile(arg, 1 << 20);
    if (content.ok()) add(*content);
  }
  for (const std::string& arg : cfg.extra_args) add(arg);
  return Hex64(Fnv1a64(TrainerIdentity(cfg), h)).substr(0, 12);
}

// The run id of a multi-node job that names none. The nodes of one job must agree on it
// without talking to each other, and an unrelated job pointed at the same endpoint must get
// another one, so that the rendezvous refuses it (naming both ids) instead of letting it join
// as a node or a spare. Hence a hash of what the nodes of one job share: the node count,
// max_restarts and the job's identity (above). Not the endpoint: it is the same for both jobs
// anyway, and the machines of one job may spell it differently (a name here, an address there).
std::string DerivedRunId(const config::LaunchConfig& cfg, PlanSystem& sys) {
  std::string parts = std::to_string(cfg.min_nodes) + ":" + std::to_string(cfg.max_nodes) + " " +
                      std::to_string(cfg.max_restarts) + " " + JobIdentityHash(cfg, sys);
  return "job-" + Hex64(Fnv1a64(parts)).substr(0, 12);
}

}  // namespace launch::launcher
