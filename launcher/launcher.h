#pragma once

// The `launch` command: flags (CLI11) + YAML + environment -> LaunchConfig -> a plan (how many
// workers, which program, which ports) -> the agent. main.cc is a thin wrapper around Main().

#include <map>
#include <string>
#include <vector>

#include "base/exit_code.h"
#include "base/host.h"
#include "base/status.h"
#include "config/launch_config.h"
#include "launcher/plan_system.h"

namespace launch::launcher {

// What `launch` will run on this node, derived from the merged config.
struct Plan {
  int nproc_per_node = 1;
  std::string device_kind = "cpu";  // "gpu" or "cpu": what one worker slot is
  std::vector<std::string> argv;    // resolved program and arguments for every worker
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // resolved (a free port when 0 was asked for)
  std::string run_id;
  std::string log_root;  // <log_dir>/<run_id>; empty = no files
  // No log_dir but --tee/--redirects: a mkdtemp template the job's files go under (made when
  // the job starts, not by --print_config); log_root is set then.
  std::string private_log_parent;
  std::vector<int> file_streams;     // per local rank
  std::vector<int> console_streams;  // per local rank
  std::map<std::string, std::string> extra_env;
  // The interpreter the workers run when the program is Python (a .py file, -m, or a program
  // named python*), and what chose it ("python3 on PATH", "environment VIRTUAL_ENV", ...):
  // --print_config names it, and a failure report that looks like a missing package too.
  std::string python;
  std::string python_origin;
  // The built-in trainer: where the effective configuration goes (train.output_dir/
  // effective_config[.nodeR].yaml); the workers run `train --effective_config` on it.
  std::string effective_config;
};

// What a command line asks for: the merged configuration (config file, environment, flags,
// validated) and what to do with it.
struct CommandLine {
  enum class Action {
    kLaunch,       // start the job
    kPrintConfig,  // --print_config: print the effective configuration and the plan
    kPrint,        // --help, --version: print `text` and exit 0
  };
  Action action = Action::kLaunch;
  config::LaunchConfig cfg;
  std::string text;
};

// Parses `launch`'s arguments (without the program name and without a subcommand).
// InvalidConfig on any bad input, naming the flag, variable or file:line.
StatusOr<CommandLine> ParseCommandLine(const std::vector<std::string>& args);

// Resolves worker count, program, ports and log layout for a single node, from the merged
// config, this machine's facts (base/host.h), the environment the workers will inherit
// (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS, TMPDIR, PYTHONPATH, LD_PRELOAD, the NCCL
// error-handling variables) and what `sys` (plan_system.h) answers: the program's path, a free
// port, what the installed files and the program's files are (and contain), the working
// directory, the host name and a fresh run id. No probe and no getenv inside: everything it
// knows of the machine comes from `host`, `env` and `sys`, so tests plan for machines they are
// not. Its one effect is a warning logged when a GPU job finds no GPU.
StatusOr<Plan> MakePlan(const config::LaunchConfig& cfg, const std::string& bin_dir,
                        const HostFacts& host, const std::map<std::string, std::string>& env,
                        PlanSystem& sys);

// Entry point of the `launch` binary; returns the process exit code.
int Main(int argc, char** argv);

// Folder holding the running executable (where `train` and `launch-exec` live).
std::string ExecutableDir();

}  // namespace launch::launcher
