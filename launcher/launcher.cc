#include "launcher/launcher.h"

#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "agent/agent.h"
#include "agent/cgroup.h"
#include "agent/elastic_agent.h"
#include "agent/subprocess.h"
#include "base/environment.h"
#include "base/exit_code.h"
#include "base/files.h"
#include "base/host.h"
#include "base/log.h"
#include "base/strings.h"
#include "config/help_format.h"
#include "config/loader.h"
#include "config/train_cli.h"
#include "config/value_text.h"
#include "launcher/accelerate_env.h"
#include "launcher/env_report.h"
#include "launcher/job_identity.h"
#include "launcher/plan_system.h"
#include "launcher/scheduler_env.h"
#include "launcher/ssh_head.h"
#include "launcher/subcommands.h"
#include "launcher/wizard.h"

#ifndef LAUNCH_VERSION
#define LAUNCH_VERSION "0.0.0"
#endif

namespace launch::launcher {

using config::LaunchConfig;
using config::Origin;

namespace {

// This launch is a --hostfile host, started by a head (--head_stdin): what the user can set
// for it is the head's command line and the hosts' .launch_env, not the head's environment.
bool g_started_by_head = false;
std::string PythonChoice() {
  return g_started_by_head ? agent::kHostfilePythonChoice : agent::kPythonChoice;
}

// The flags that set config keys come from config::FlagSettings(), the table the YAML file and
// the environment go through; only the flags about this invocation itself are declared here.
const char* kGroupConfig = "Config";

std::string BothSpellings(const std::string& underscore) {
  if (underscore.size() == 1) return "-" + underscore;  // torchrun's short forms: -r, -t
  std::string dash = underscore;
  std::replace(dash.begin(), dash.end(), '_', '-');
  return dash == underscore ? "--" + underscore : "--" + underscore + ",--" + dash;
}

std::vector<std::string> AllFlagNames() {
  std::vector<std::string> names = {"config_file", "print_config", "version", "help"};
  for (const auto& f : config::FlagSettings())
    for (const auto& n : f.names) names.push_back(n);
  return names;
}

// "  launch NAME   SUMMARY" for each subcommand of the table (subcommands.h).
std::string SubcommandList() {
  std::string out;
  for (const Subcommand& s : Subcommands()) {
    std::string left = std::string("  launch ") + s.name;
    left.resize(std::max<size_t>(left.size() + 2, 44), ' ');
    out += left + s.summary + "\n";
  }
  return out + "  (see `launch SUBCOMMAND --help`)\n\n";
}

bool IsYamlPath(const std::string& s) {
  std::string l = ToLower(s);
  return EndsWith(l, ".yaml") || EndsWith(l, ".yml");
}

void Warn(const std::string& msg) { log::Warn(msg); }

// Where the trainer's effective configuration goes: beside the run's outputs, for the user to
// read. The nodes of a job may share output_dir, so there each node writes its own.
std::string EffectiveConfigPath(const config::LaunchConfig& cfg, PlanSystem& sys) {
  std::string name = "effective_config";
  if (cfg.max_nodes > 1)
    name +=
        cfg.machine_rank >= 0 ? ".node" + std::to_string(cfg.machine_rank) : "." + sys.HostName();
  return cfg.train.output_dir + "/" + name + ".yaml";
}

// Into train.output_dir (made here): a failure names the key.
Status WriteEffectiveConfig(const config::LaunchConfig& cfg, const std::string& path) {
  Status written = WriteFileAtomically(path, config::EffectiveConfigYaml(cfg));
  if (written.ok()) return written;
  return Status::InvalidConfig("train.output_dir '" + cfg.train.output_dir +
                               "': " + written.message());
}

// What runs under the interpreter without --no_python: a .py file, or (torchrun runs every
// program under Python) a file that exists but is not executable. An executable (an ELF binary,
// a script with #!) runs as itself.
bool IsPythonScript(const std::string& program, PlanSystem& sys) {
  if (EndsWith(ToLower(program), ".py")) return true;
  FileFacts facts = sys.Inspect(program);
  return facts.regular && !facts.executable;
}

// The multi-node options from the merged config and the single-node template `local` (which
// the launcher builds as for one node). Endpoint = main_process_ip:main_process_port (29500
// when unset), token = rdzv_token, run_id = the plan's, nnodes MIN:MAX, machine_rank,
// max_restarts, rdzv_conf. The environment variable LAUNCH_RDZV_LOCAL_ADDR sets local_address.
agent::ElasticAgentOptions MakeElasticAgentOptions(const config::LaunchConfig& cfg,
                                                   const Plan& plan,
                                                   const agent::AgentOptions& local) {
  agent::ElasticAgentOptions o;
  o.local = local;
  o.endpoint_host = cfg.main_process_ip;
  o.endpoint_port = cfg.main_process_port > 0 ? cfg.main_process_port : 29500;
  o.token = cfg.rdzv_token;
  o.run_id = plan.run_id;
  o.run_id_derived = cfg.run_id.empty();
  // A --hosts head shows every host's output on one console: one failure report, node 0's.
  o.print_failure_report = !g_started_by_head || cfg.machine_rank == 0;
  o.min_nodes = cfg.min_nodes;
  o.max_nodes = cfg.max_nodes;
  o.node_rank = cfg.machine_rank;
  o.max_restarts = cfg.max_restarts;
  o.join_timeout_s = cfg.rdzv_conf.join_timeout_s;
  o.last_call_timeout_s = cfg.rdzv_conf.last_call_timeout_s;
  o.heartbeat_timeout_s = cfg.rdzv_conf.heartbeat_timeout_s;
  o.local_address = cfg.rdzv_local_addr;
  if (cfg.rdzv_backend == "etcd") o.etcd_endpoints = cfg.etcd_endpoints;
  // The built-in trainer binds the route to MASTER_ADDR itself (trainer_runtime/comm/
  // process_group.h ChooseGlooBinding); any other program gets the interface in its environment.
  o.export_socket_interfaces = !(cfg.program.empty() && cfg.train.present);
  // What must agree across nodes beyond run_id, nnodes and max_restarts (compared one by one).
  // The trainer's settings, compared at every JOIN: two trainer jobs given one run id (a reused
  // --rdzv_id) are refused, never merged as a scale-up. A program of the user's own may differ
  // per node (torchrun's MPMD jobs), so only a derived run id tells such jobs apart.
  const std::string trainer = TrainerIdentity(cfg);
  o.fingerprint = "role=" + cfg.role + (trainer.empty() ? "" : " train=" + trainer);
  return o;
}

// Without a log_dir but with --tee/--redirects the job's files go to a private folder made
// now (mkdtemp: 0700, a fresh random name, so no other user can plant or read anything there).
Status MakePrivateLogRoot(Plan* plan) {
  if (plan->private_log_parent.empty()) return Status::Ok();
  std::vector<char> templ(plan->private_log_parent.begin(), plan->private_log_parent.end());
  templ.push_back('\0');
  if (::mkdtemp(templ.data()) == nullptr)
    return Status::FromErrno("cannot create a log directory " + plan->private_log_parent, errno);
  plan->log_root = std::string(templ.data()) + "/" + plan->run_id;
  return Status::Ok();
}

// With a log_dir the run's folder (<log_dir>/<run_id>) is made now, so that a bad log_dir is
// refused before anything starts, naming the setting. In a log_dir other users can write to,
// the run folder must be this user's own directory: a symlink or someone else's folder planted
// under the run id would make the job write wherever that user chose (what is inside is made
// by this process, below a folder nobody else can change).
Status MakeLogRoot(const LaunchConfig& cfg, const Plan& plan) {
  if (cfg.log_dir.empty() || plan.log_root.empty()) return Status::Ok();
  const std::string where = "log_dir '" + cfg.log_dir + "' (--log_dir, or log_dir in the config)";
  Status made = MakeDirs(plan.log_root);
  if (!made.ok()) return Status::InvalidConfig(where + ": " + made.message());
  struct stat st;
  if (::lstat(plan.log_root.c_str(), &st) != 0)
    return Status::FromErrno(where + ": " + plan.log_root, errno);
  if (S_ISLNK(st.st_mode) || !S_ISDIR(st.st_mode))
    return Status::InvalidConfig(where + ": " + plan.log_root +
                                 " is a symbolic link, not a folder; refusing to follow it");
  if (st.st_uid != ::geteuid())
    return Status::InvalidConfig(where + ": " + plan.log_root + " belongs to uid " +
                                 std::to_string(st.st_uid) +
                                 ", not to this user; give another --run_id or log_dir");
  // Where every user may write, they may read too: the run's output is this user's alone, as
  // in the private folder used without a log_dir. In a folder of one's own, the umask decides.
  struct stat parent;
  if (::stat(cfg.log_dir.c_str(), &parent) == 0 && (parent.st_mode & S_IWOTH) &&
      ::chmod(plan.log_root.c_str(), 0700) != 0)
    return Status::FromErrno(where + ": cannot make " + plan.log_root + " private", errno);
  return Status::Ok();
}

// `--print_config`'s last lines: what would run here.
std::string PlanSummary(const StatusOr<Plan>& plan, bool multi_node) {
  if (!plan.ok()) return "# plan: not runnable as is: " + plan.status().message() + "\n";
  return "# plan: " + std::to_string(plan->nproc_per_node) + " " + plan->device_kind +
         " worker(s) on this machine, " +
         (multi_node
              ? "rendezvous at " + plan->master_addr + ":" + std::to_string(plan->master_port) +
                    " (the workers' MASTER_ADDR/MASTER_PORT: node 0's address and a free "
                    "port there, from the rendezvous), run id " +
                    plan->run_id
              : "MASTER_ADDR=" + plan->master_addr +
                    " MASTER_PORT=" + std::to_string(plan->master_port)) +
         "\n# command: " + Join(plan->argv, " ") + "\n" +
         (plan->python.empty() ? ""
                               : "# python: " + plan->python + " (" + plan->python_origin + ")\n");
}

// The local agent's options for this node's plan: the worker group's layout, environment,
// output routing and stop policy (a multi-node job starts from the same template).
agent::AgentOptions MakeAgentOptions(const LaunchConfig& cfg, const Plan& plan,
                                     const std::map<std::string, std::string>& env,
                                     const std::string& bin_dir) {
  agent::AgentOptions opts;
  agent::WorkerGroupSpec& g = opts.group;
  g.argv = plan.argv;
  for (const auto& [k, v] : env) {
    // The rendezvous secret is the agents' business: not in every worker's environment, where
    // experiment trackers and crash dumps would record it.
    if (k == "LAUNCH_RDZV_TOKEN" || k == "PET_RDZV_TOKEN") continue;
    g.base_env.push_back(k + "=" + v);
  }
  g.extra_env = plan.extra_env;
  g.local_world_size = plan.nproc_per_node;
  g.world_size = plan.nproc_per_node;
  g.rank_offset = 0;
  g.group_rank = 0;
  g.group_world_size = 1;
  g.role = cfg.role;
  g.master_addr = plan.master_addr;
  g.master_port = plan.master_port;
  g.run_id = plan.run_id;
  g.exec_shim = bin_dir + "/launch-exec";
  g.file_streams = plan.file_streams;
  g.console_streams = plan.console_streams;
  g.stop_grace = std::chrono::milliseconds(static_cast<int64_t>(cfg.stop_grace_s * 1000));
  g.stall_timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg.stall_timeout_s * 1000));
  g.dedup_window = std::chrono::milliseconds(static_cast<int64_t>(cfg.dedup_output_s * 1000));
  g.virtual_local_rank = cfg.virtual_local_rank;
  g.node_view.local_rank = cfg.task_layout.local_rank;
  g.node_view.local_world_size = cfg.task_layout.local_world_size;
  g.node_view.node_rank = cfg.task_layout.node_rank;
  g.node_view.num_nodes = cfg.task_layout.num_nodes;
  g.gpu_workers = plan.device_kind == "gpu";
  opts.max_restarts = cfg.max_restarts;
  opts.recover_in_place = cfg.recover_in_place;
  // The workers' side of it (trainer_runtime: accelerator.h, "In-place recovery").
  if (cfg.recover_in_place) g.extra_env["LAUNCH_RECOVER"] = "in_place";
  g.spares = cfg.spares;
  if (!plan.python.empty()) opts.python = plan.python + " (" + plan.python_origin + ")";
  opts.python_choice = PythonChoice();
  return opts;
}

// The head's arguments as every host's launch gets them: without the host list (a remote
// launch is one node, never a head itself). Only before "--": what follows is the program's.
std::vector<std::string> WithoutHostList(const std::vector<std::string>& args) {
  std::vector<std::string> out;
  bool program = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (!program && a == "--") program = true;
    if (!program) {
      if (a == "--hostfile" || a == "--hosts" || a == "-H") {
        ++i;  // and its value
        continue;
      }
      if (StartsWith(a, "--hostfile=") || StartsWith(a, "--hosts=") ||
          (StartsWith(a, "-H") && !StartsWith(a, "--")))
        continue;
    }
    out.push_back(a);
  }
  return out;
}

// 128 random bits as hex: the token of a hostfile job whose user set none, so that such a
// job always authenticates.
StatusOr<std::string> RandomToken() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::FromErrno("getrandom", errno);
    got += static_cast<size_t>(n);
  }
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out += kHex[b >> 4];
    out += kHex[b & 15];
  }
  return out;
}

// `launch --hostfile`: this launch starts every host over ssh (ssh_head.h) and runs no worker
// itself. `args` are launch's arguments as given (without "test").
int RunAsHead(LaunchConfig& cfg, const std::vector<std::string>& args, bool self_test,
              bool print_config) {
  HeadJob job;
  job.hosts = cfg.hosts;
  job.args = WithoutHostList(args);
  job.self_test = self_test;
  job.launch_path = ExecutableDir() + "/launch";
  char cwd[4096];
  if (::getcwd(cwd, sizeof(cwd)) == nullptr) {
    std::fprintf(stderr, "launch: error: %s\n",
                 Status::FromErrno("getcwd", errno).message().c_str());
    return kExitUsage;
  }
  job.cwd = cwd;
  auto ip_origin = cfg.origins.find("main_process_ip");
  if (ip_origin != cfg.origins.end() && (ip_origin->second.kind == Origin::Kind::kFlag ||
                                         ip_origin->second.kind == Origin::Kind::kEnvironment)) {
    job.master_addr = cfg.main_process_ip;
  } else {
    const std::string& first = cfg.hosts[0].host;
    job.master_addr = first.substr(first.rfind('@') + 1);  // user@host: the host
  }
  job.port = cfg.main_process_port > 0 ? cfg.main_process_port : 29500;
  cfg.min_nodes = cfg.max_nodes = static_cast<int>(cfg.hosts.size());
  RealPlanSystem sys;
  job.run_id = cfg.run_id.empty() ? DerivedRunId(cfg, sys) : cfg.run_id;
  job.stop_grace_s = cfg.stop_grace_s;
  if (print_config) {
    std::cout << config::FormatConfig(cfg);
    for (size_t i = 0; i < job.hosts.size(); ++i)
      std::cout << "# node " << i << ": " << job.hosts[i].host << ", " << job.hosts[i].slots
                << " worker(s)"
                << (i == 0 ? ", hosts the rendezvous at " + job.master_addr + ":" +
                                 std::to_string(job.port)
                           : std::string())
                << "\n";
    std::cout << "# run id " << job.run_id << "; every host runs " << job.launch_path << " in "
              << job.cwd << " over ssh\n";
    return kExitOk;
  }
  std::vector<std::string> warnings;
  auto env = JobEnvironment(CurrentEnvironment(), job.cwd, &warnings);
  StatusOr<std::string> ssh = agent::ResolveProgram("ssh");
  StatusOr<std::string> token =
      cfg.rdzv_token.empty() ? RandomToken() : StatusOr<std::string>(cfg.rdzv_token);
  for (const Status& s : {env.status(), token.status()})
    if (!s.ok()) {
      std::fprintf(stderr, "launch: error: %s\n", s.message().c_str());
      return kExitUsage;
    }
  if (!ssh.ok()) {
    std::fprintf(stderr, "launch: error: %s needs OpenSSH's client: %s\n", cfg.hosts_origin.c_str(),
                 ssh.status().message().c_str());
    return kExitUsage;
  }
  if (token->find('\n') != std::string::npos) {
    std::fprintf(stderr, "launch: error: the rendezvous token holds a newline\n");
    return kExitUsage;
  }
  for (const std::string& w : warnings) Warn(w);
  job.env = *env;
  job.token = *token;
  job.ssh = *ssh;
  return RunHead(job);
}

// `--head_stdin` (set by a head on the launches it starts): the head's message is read from
// stdin and applied to this process's environment before anything reads it, then stdin is
// watched: its end stops this node.
int AcceptHead() {
  std::vector<std::pair<std::string, std::string>> env;
  std::string token;
  Status received = ReceiveFromHead(0, &env, &token);
  if (!received.ok()) {
    std::fprintf(stderr, "launch: error: %s\n", received.message().c_str());
    return kExitUsage;
  }
  for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
  ::setenv("LAUNCH_RDZV_TOKEN", token.c_str(), 1);
  ::unsetenv("PET_RDZV_TOKEN");
  const std::string ready = std::string(kReadyLine) + "\n";
  if (::write(1, ready.data(), ready.size()) != static_cast<ssize_t>(ready.size())) {
    std::fprintf(stderr, "launch: error: cannot answer the head on stdout\n");
    return kExitFailure;
  }
  StopWhenHeadLeaves(0);
  return kExitOk;
}

}  // namespace

std::string ExecutableDir() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  return Dirname(std::string(buf, static_cast<size_t>(n)));
}

StatusOr<CommandLine> ParseCommandLine(const std::vector<std::string>& args) {
  CommandLine out;
  LaunchConfig* cfg = &out.cfg;
  // Everything after the first "--" is the program (or extra args for the trainer).
  std::vector<std::string> before, after;
  bool seen_dashdash = false;
  for (const auto& a : args) {
    if (!seen_dashdash && a == "--") {
      seen_dashdash = true;
      continue;
    }
    (seen_dashdash ? after : before).push_back(a);
  }

  CLI::App app{
      "launch: start distributed training on one or many machines.\n\n"
      "  launch [flags] CONFIG.yaml [-- extra trainer args]\n"
      "  launch [flags] -- PROGRAM [ARGS...]       (any program; Python scripts run under python3 "
      "-u)\n"
      "  launch [flags] script.py [ARGS...]        (torchrun style)\n"
      "  launch test [flags] [CONFIG.yaml]         distributed self-check with this config\n" +
          SubcommandList() +
          "Precedence: flag > environment (LAUNCH_*, PET_*, SLURM_*, OMPI_*) > YAML > default.\n"
          "Every `accelerate launch` flag is accepted too (not listed below: --use_fsdp, "
          "--fsdp_*,\n"
          "--use_deepspeed, --zero_stage, --dynamo_backend, --debug, ...); what it sets reaches "
          "the\n"
          "script as accelerate would pass it (docs/launcher.md).",
      "launch"};
  app.prefix_command();
  app.set_help_flag("-h,--help", "show this help and exit");
  app.formatter(config::HelpFormatter(34, /*cli11_usage=*/false));  // the usage is above

  std::string config_file;
  app.add_option(BothSpellings("config_file"), config_file,
                 "the YAML config (or give it as the first argument)")
      ->group(kGroupConfig);
  bool print = false, version = false;
  app.add_flag(BothSpellings("print_config"), print,
               "print the effective config with where each value came from, and exit")
      ->group(kGroupConfig);
  app.add_flag("--version", version, "print the version and exit")->group(kGroupConfig);

  // Every other flag sets a config key; a flag given twice keeps its last value.
  struct Given {
    config::FlagSetting setting;
    CLI::Option* option;
    std::string shown;  // how origins name it: "--redirects/-r"
  };
  // Only the flags this command line names are registered, every one only for --help: CLI11
  // checks each new option against all the others, and registering all ~190 (accelerate's
  // included) cost a third of `launch`'s start.
  const bool help_wanted = std::any_of(before.begin(), before.end(), [](const std::string& t) {
    return t == "-h" || t == "--help";
  });
  auto named = [&](const std::string& name) {
    for (const std::string& t : before) {
      if (name.size() == 1) {  // -x, also in a bundle (-mt) or with its value (-t3)
        if (t.size() >= 2 && t[0] == '-' && t[1] != '-' && t.find(name[0]) != std::string::npos)
          return true;
        continue;
      }
      for (const std::string& spelled : Split(BothSpellings(name), ','))
        if (t == spelled || StartsWith(t, spelled + "=")) return true;
    }
    return false;
  };
  const std::vector<config::FlagSetting> settings = config::FlagSettings();
  std::vector<Given> given;
  std::vector<std::unique_ptr<std::string>> storage;
  for (const config::FlagSetting& f : settings) {
    if (!help_wanted && std::none_of(f.names.begin(), f.names.end(), named)) continue;
    std::vector<std::string> spellings, shown;
    for (const std::string& name : f.names) {
      spellings.push_back(BothSpellings(name));
      shown.push_back((name.size() == 1 ? "-" : "--") + name);
    }
    CLI::Option* opt;
    if (!f.switch_value.empty()) {
      opt = app.add_flag(Join(spellings, ","), f.help);
    } else {
      storage.push_back(std::make_unique<std::string>());
      opt = app.add_option(Join(spellings, ","), *storage.back(), f.help)->type_name("");
      opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    }
    opt->group(f.group);
    given.push_back({f, opt, Join(shown, "/")});
  }

  std::vector<std::string> reversed(before.rbegin(), before.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    out.action = CommandLine::Action::kPrint;
    out.text = app.help();
    return out;
  } catch (const CLI::ArgumentMismatch& e) {
    // CLI11 says "--nproc_per_node: 1 required  missing".
    std::string what = e.what();
    return Status::InvalidConfig(what.substr(0, what.find(':')) + " needs a value");
  } catch (const CLI::ParseError& e) {
    return Status::InvalidConfig(e.what());
  }
  if (version) {
    out.action = CommandLine::Action::kPrint;
    out.text = std::string("launch ") + LAUNCH_VERSION + "\n";
    return out;
  }

  std::vector<std::string> rest = app.remaining();
  if (!rest.empty() && StartsWith(rest[0], "-")) {
    std::string name = rest[0].substr(rest[0][1] == '-' ? 2 : 1);
    name = name.substr(0, name.find('='));
    std::replace(name.begin(), name.end(), '-', '_');
    std::string near = ClosestMatch(name, AllFlagNames());
    return Status::InvalidConfig("unknown flag '" + rest[0] + "'" +
                                 (near.empty() ? "" : " (did you mean '--" + near + "'?)") +
                                 "; see launch --help");
  }
  if (!rest.empty() && IsYamlPath(rest[0]) && config_file.empty()) {
    config_file = rest[0];
    rest.erase(rest.begin());
    if (!rest.empty())
      return Status::InvalidConfig("unexpected argument '" + rest[0] + "' after " + config_file +
                                   " (put trainer arguments after `--`)");
    cfg->extra_args = after;
  } else if (!rest.empty()) {
    cfg->program = rest;  // torchrun style: launch script.py args
    if (seen_dashdash) {  // as torchrun: `script.py a -- b` gives the script "a -- b"
      cfg->program.push_back("--");
      cfg->program.insert(cfg->program.end(), after.begin(), after.end());
    }
  } else {
    cfg->program = after;
  }

  // Layers: defaults (cfg as given) < YAML < environment < flags.
  std::map<std::string, std::string> env = CurrentEnvironment();
  if (config_file.empty()) {
    // Like accelerate: the wizard's file (ours, else accelerate's) is used when nothing else
    // is given, and we say which.
    for (const std::string& fallback : DefaultConfigCandidates(env)) {
      if (::access(fallback.c_str(), R_OK) != 0) continue;
      config_file = fallback;
      log::Info("using config " + fallback);
      break;
    }
  }
  if (!config_file.empty()) LAUNCH_RETURN_IF_ERROR(config::LoadYamlFile(config_file, cfg));
  LAUNCH_RETURN_IF_ERROR(config::ApplyEnvironment(env, cfg));
  for (const Given& g : given) {
    if (g.option->count() == 0) continue;
    Origin origin{Origin::Kind::kFlag, g.shown};
    std::string value = g.setting.switch_value;
    if (value.empty()) value = g.option->as<std::string>();
    LAUNCH_RETURN_IF_ERROR(config::ApplySetting(g.setting.key, value, origin, cfg));
  }
  // `launch CONFIG.yaml -- ARGS`: the trainer's config flags among ARGS are resolved here, once
  // for every worker (they reach the workers in the effective configuration); the rest of ARGS
  // (--dump_params) is passed on.
  if (cfg->train.present && !cfg->extra_args.empty()) {
    StatusOr<config::TrainCommandLine> train_args = config::ParseTrainCommandLine(cfg->extra_args);
    if (!train_args.ok())
      return Status::InvalidConfig("after --: " + train_args.status().message());
    if (train_args->help || train_args->self_test || !train_args->config_path.empty() ||
        !train_args->effective_config.empty())
      return Status::InvalidConfig(
          "after --: give the trainer's flags only (--KEY VALUE for train: keys, --dump_params); "
          "the config is " +
          cfg->config_path);
    LAUNCH_RETURN_IF_ERROR(config::ApplyTrainFlags(*train_args, " (after --)", cfg));
    cfg->extra_args = train_args->ProgramOptions();
  }
  // The scheduler's values go under flags and LAUNCH_* variables (it only fills keys nothing
  // above the YAML set); applied last so that it sees what they asked for (--cpu).
  LAUNCH_RETURN_IF_ERROR(config::ApplySchedulerEnvironment(env, cfg));
  auto flag_given = [&](const std::string& key) {
    for (const Given& g : given)
      if (g.setting.key == key && g.option->count() > 0) return true;
    return false;
  };
  // The combinations torchrun and accelerate refuse.
  if (cfg->no_python && (cfg->run_module || cfg->run_path))
    return Status::InvalidConfig(std::string(cfg->run_module ? "-m/--module" : "--run_path") +
                                 " runs the program with Python; it cannot go with --no_python");
  if (flag_given("use_cpu") && flag_given("distributed_type"))  // --cpu, --multi_gpu
    return Status::InvalidConfig("--cpu and --multi_gpu ask for different workers; give one");
  LAUNCH_RETURN_IF_ERROR(config::Validate(cfg));
  if (print) out.action = CommandLine::Action::kPrintConfig;
  return out;
}

StatusOr<Plan> MakePlan(const LaunchConfig& cfg, const std::string& bin_dir, const HostFacts& host,
                        const std::map<std::string, std::string>& env, PlanSystem& sys) {
  auto inherited = [&env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  Plan plan;
  if (cfg.spares > 0 && !(cfg.program.empty() && cfg.train.present)) {
    auto origin = cfg.origins.find("spares");
    return Status::InvalidConfig(
        (origin == cfg.origins.end() ? std::string("spares") : origin->second.ToString()) +
        ": spares need the built-in trainer (a train: section): only it waits for a rank as a "
        "spare; a program of your own would start running at once");
  }
  // Worker count on this node.
  bool force_cpu = cfg.distributed_type == config::DistributedType::kMultiCpu;
  int gpus = force_cpu ? 0 : VisibleGpus(host.gpus, env);
  if (cfg.gpu_ids != "all" && gpus > 0) gpus = static_cast<int>(Split(cfg.gpu_ids, ',').size());
  const std::string& spec = cfg.nproc_per_node;
  if (spec == "gpu" && gpus == 0) {
    // torchrun refuses too: one worker per GPU of none is not a CPU job.
    auto origin = cfg.origins.find("nproc_per_node");
    const char* visible = inherited("CUDA_VISIBLE_DEVICES");
    return Status::InvalidConfig(
        (origin == cfg.origins.end() ? std::string("nproc_per_node") : origin->second.ToString()) +
        ": nproc_per_node gpu: no GPU is visible" +
        (force_cpu ? std::string(" (distributed_type is MULTI_CPU)")
         : visible ? " (CUDA_VISIBLE_DEVICES='" + std::string(visible) + "')"
                   : std::string(" (NVML finds none)")) +
        "; give a number of workers, `cpu` or `auto`");
  }
  if (spec == "auto" || spec == "gpu") {
    if (gpus > 0) {
      plan.nproc_per_node = gpus;
      plan.device_kind = "gpu";
    } else {
      plan.nproc_per_node = host.cpu_slots;
    }
  } else if (spec == "cpu") {
    plan.nproc_per_node = host.cpu_slots;
  } else {
    long long n = 0;
    ParseInt64(spec, &n);
    plan.nproc_per_node = static_cast<int>(n);
    plan.device_kind = gpus > 0 ? "gpu" : "cpu";
  }
  if (cfg.task_layout.local_rank >= 0 && plan.nproc_per_node != 1)
    return Status::InvalidConfig(
        "SLURM runs " + std::to_string(cfg.task_layout.local_world_size) +
        " tasks on this node, one worker each; nproc_per_node " +
        std::to_string(plan.nproc_per_node) + " (" +
        (cfg.origins.count("nproc_per_node") ? cfg.origins.at("nproc_per_node").ToString()
                                             : std::string("default")) +
        ") would start that many per task: drop it, or run one task per node "
        "(srun --ntasks-per-node=1) for several workers per launch");
  if (plan.device_kind == "gpu" && plan.nproc_per_node > gpus) {
    // One GPU per worker: the workers past the last GPU would run on the CPU beside the GPU
    // ranks (the trainer and accelerate fall back to it silently) and the first collective
    // between them would hang. Refused before anything starts.
    // Where the count was given: num_processes when nproc_per_node was derived from it.
    auto origin = cfg.origins.find("nproc_per_node");
    if (origin != cfg.origins.end() && origin->second.kind == Origin::Kind::kDerived &&
        cfg.origins.count("num_processes"))
      origin = cfg.origins.find("num_processes");
    const char* visible = inherited("CUDA_VISIBLE_DEVICES");
    // num_processes counts every machine's; an elastic job's total varies.
    const std::string g = std::to_string(gpus);
    const std::string way_out =
        cfg.min_nodes != cfg.max_nodes ? "--nproc_per_node " + g
        : cfg.max_nodes > 1
            ? "--num_processes " + std::to_string(gpus * cfg.max_nodes) + " (" + g + " per machine)"
            : "--num_processes " + g;
    return Status::InvalidConfig(
        (origin == cfg.origins.end() ? std::string("nproc_per_node") : origin->second.ToString()) +
        ": " + std::to_string(plan.nproc_per_node) + " processes per machine, but " +
        std::to_string(gpus) + (gpus == 1 ? " GPU is" : " GPUs are") + " visible here (" +
        (visible ? "CUDA_VISIBLE_DEVICES='" + std::string(visible) + "'"
                 : std::string("CUDA_VISIBLE_DEVICES is unset")) +
        (cfg.gpu_ids != "all" ? ", gpu_ids '" + cfg.gpu_ids + "'" : std::string()) +
        ") and a GPU job runs one process per GPU; give " + way_out +
        ", or --cpu for CPU processes");
  }
  if (config::WantsGpus(cfg.distributed_type) && gpus == 0)
    Warn(std::string("distributed_type is ") + config::ToString(cfg.distributed_type) +
         " but no GPU was found; running CPU workers");

  // The program.
  std::vector<std::string> argv;
  if (!cfg.program.empty()) {
    const std::string& prog = cfg.program[0];
    // `-u`, as torchrun passes: a worker's stdout is a pipe to the agent, so without it
    // Python would buffer print() output until the worker exits.
    if (cfg.run_module) {
      argv = {cfg.python, "-u", "-m"};
      argv.insert(argv.end(), cfg.program.begin(), cfg.program.end());
    } else if (!cfg.no_python && (cfg.run_path || IsPythonScript(prog, sys))) {
      argv = {cfg.python, "-u"};
      argv.insert(argv.end(), cfg.program.begin(), cfg.program.end());
    } else {
      argv = cfg.program;
    }
  } else if (cfg.train.present) {
    // The workers train on the configuration resolved here (Main writes it before they
    // start), not on the YAML file again: flags and environment reach every rank.
    plan.effective_config = EffectiveConfigPath(cfg, sys);
    argv = {bin_dir + "/train", "--effective_config", plan.effective_config};
    // A hang is to be reported, naming the rank that hangs, before it times out.
    if (cfg.stall_timeout_s > 0 && cfg.train.collective_timeout_s <= cfg.stall_timeout_s)
      Warn("train.collective_timeout (" + config::Num(cfg.train.collective_timeout_s) +
           " s) is not above --stall_timeout (" + config::Num(cfg.stall_timeout_s) +
           " s): a hung collective would fail with the transport's timeout before the stall "
           "report names the rank that hangs");
    argv.insert(argv.end(), cfg.extra_args.begin(), cfg.extra_args.end());
  } else if (cfg.config_path.empty()) {
    return Status::InvalidConfig(
        "nothing to run: give CONFIG.yaml with a `train:` section, or `-- PROGRAM ARGS`");
  } else if (!cfg.extra_args.empty()) {
    // `launch job.yaml -- PROGRAM`: what follows `--` goes to the trainer of job.yaml.
    return Status::InvalidConfig(
        cfg.config_path +
        ": has no `train:` section, and what follows `--` is passed to the "
        "trainer it would describe; to run a program with this file's launch "
        "settings, give `--config_file " +
        cfg.config_path + " -- " + cfg.extra_args.front() + " ...`");
  } else {
    return Status::InvalidConfig(cfg.config_path +
                                 ": has no `train:` section; give `-- PROGRAM ARGS` to run a "
                                 "program, or add a train: section");
  }
  const bool under_python = !cfg.program.empty() && argv[0] == cfg.python;
  StatusOr<std::string> resolved = sys.ResolveProgram(argv[0]);
  if (!resolved.ok()) {
    if (argv[0] == bin_dir + "/train")
      return Status::InvalidConfig("the trainer binary is missing (" + argv[0] +
                                   "): build with -DLAUNCH_BUILD_TRAINER=ON");
    if (under_python) {
      auto origin = cfg.origins.find("python");
      return Status::InvalidConfig("cannot run the Python interpreter (" +
                                   (origin == cfg.origins.end() ? std::string("python3 on PATH")
                                                                : "python: " + cfg.python + ", " +
                                                                      origin->second.ToString()) +
                                   "): " + resolved.status().message() + "; choose one with " +
                                   PythonChoice() + ", or activate its environment");
    }
    return Status::InvalidConfig("cannot run the program: " + resolved.status().message());
  }
  argv[0] = *resolved;
  plan.argv = argv;
  if (under_python) {
    auto origin = cfg.origins.find("python");
    plan.python = argv[0];
    plan.python_origin =
        origin == cfg.origins.end() ? "python3 on PATH" : origin->second.ToString();
  } else if (!cfg.program.empty() && StartsWith(Basename(argv[0]), "python")) {
    plan.python = argv[0];  // `-- python3 train.py`
    plan.python_origin = "the program given";
  }

  // Rendezvous for the workers' own store: one node, so the master is here.
  plan.master_addr = cfg.main_process_ip;
  plan.master_port = cfg.main_process_port;
  if (plan.master_port <= 0) {
    StatusOr<int> port = sys.PickFreePort(plan.master_addr);
    if (!port.ok())
      return Status::InvalidConfig("main_process_ip " + plan.master_addr + ": " +
                                   port.status().message());
    plan.master_port = *port;
  }
  plan.run_id = !cfg.run_id.empty()                               ? cfg.run_id
                : cfg.max_nodes > 1 || cfg.rdzv_backend == "etcd" ? DerivedRunId(cfg, sys)
                                                                  : sys.NewRunId();

  // Output routing, torchrun semantics: --redirects sends streams to files only, --tee to both.
  // A log_dir without either means "tee everything".
  bool any_spec = cfg.tee.all || !cfg.tee.per_rank.empty() || cfg.redirects.all ||
                  !cfg.redirects.per_rank.empty();
  // Without a log_dir the files go to a private directory made when the job starts (mkdtemp:
  // 0700, a fresh random name, so no other user can plant or read anything there).
  if (!cfg.log_dir.empty()) {
    plan.log_root = cfg.log_dir + "/" + plan.run_id;
  } else if (any_spec) {
    const char* tmp = inherited("TMPDIR");
    plan.private_log_parent = std::string(tmp && *tmp ? tmp : "/tmp") + "/launch-logs-XXXXXX";
  }
  for (int lr = 0; lr < plan.nproc_per_node; ++lr) {
    int tee = cfg.tee.For(lr), redirect = cfg.redirects.For(lr);
    // With a log_dir every stream is kept in files; --tee/--redirects only choose which
    // streams leave the console (redirects) and force files even without a log_dir.
    int files = cfg.log_dir.empty() ? (tee | redirect) : 3;
    int console = 3 & ~redirect;
    if (!cfg.local_ranks_filter.empty() &&
        std::find(cfg.local_ranks_filter.begin(), cfg.local_ranks_filter.end(), lr) ==
            cfg.local_ranks_filter.end())
      console = 0;
    plan.file_streams.push_back(files);
    plan.console_streams.push_back(console);
  }

  // Environment beyond the rank contract.
  const char* omp = inherited("OMP_NUM_THREADS");
  if (plan.nproc_per_node > 1 && (omp == nullptr || *omp == '\0'))
    plan.extra_env["OMP_NUM_THREADS"] = "1";  // N workers x all cores each would thrash
  if (cfg.gpu_ids != "all") plan.extra_env["CUDA_VISIBLE_DEVICES"] = cfg.gpu_ids;
  // As torchrun: NCCL errors abort the process group instead of hanging it (the default from
  // torch 2.2 on; torch 1.13 reads the older name).
  if (plan.device_kind == "gpu" && inherited("TORCH_NCCL_ASYNC_ERROR_HANDLING") == nullptr &&
      inherited("NCCL_ASYNC_ERROR_HANDLING") == nullptr) {
    plan.extra_env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1";
    plan.extra_env["NCCL_ASYNC_ERROR_HANDLING"] = "1";
  }
  // Output as it is printed. A worker's stdout is a pipe to the agent, so Python and C stdio
  // would buffer it in blocks (tqdm bars and progress lines arriving late, or at exit). Python
  // gets -u above and PYTHONUNBUFFERED (which reaches `-- python3 x.py` and the interpreters a
  // script starts) unless the user chose; other programs get stdout line-buffered by a
  // preloaded library, as coreutils' stdbuf -oL does (agent/linebuf.c).
  if (cfg.line_buffered) {
    if (!inherited("PYTHONUNBUFFERED")) plan.extra_env["PYTHONUNBUFFERED"] = "1";
    const std::string linebuf = bin_dir + "/" + LAUNCH_LINEBUF_FROM_BIN;
    const char* preload = inherited("LD_PRELOAD");
    std::string current = preload ? preload : "";
    // A program built with GCC's AddressSanitizer or ThreadSanitizer (a shared runtime) aborts
    // when another library is preloaded before its runtime: it keeps its own buffering. Read
    // last, only for a program that would get the preload.
    auto sanitized = [&] {
      for (const std::string& lib : sys.ElfNeededLibraries(plan.argv[0]))
        if (StartsWith(lib, "libasan") || StartsWith(lib, "libtsan") ||
            StartsWith(lib, "libhwasan"))
          return true;
      return false;
    };
    // LD_PRELOAD separates entries by spaces and colons: a path with either cannot be listed.
    if (plan.python.empty() && linebuf.find_first_of(" :") == std::string::npos &&
        sys.Inspect(linebuf).readable && current.find(linebuf) == std::string::npos && !sanitized())
      plan.extra_env["LD_PRELOAD"] = current.empty() ? linebuf : current + " " + linebuf;
  }
  if (force_cpu && cfg.origins.count("distributed_type") + cfg.origins.count("use_cpu") > 0)
    plan.extra_env["CUDA_VISIBLE_DEVICES"] = "";
  // What `accelerate launch` exports for these settings, so a script's Accelerator() sees
  // the configured choices as it would under accelerate.
  const char* pythonpath = inherited("PYTHONPATH");
  StatusOr<std::map<std::string, std::string>> acc =
      AccelerateEnv(cfg, plan.device_kind != "gpu", pythonpath ? pythonpath : "", sys.CurrentDir());
  if (!acc.ok()) return acc.status();
  for (const auto& [k, v] : *acc) plan.extra_env[k] = v;
  // Python workers get the shim (agent/python_shim/sitecustomize.py) first on PYTHONPATH: it
  // records torch.distributed's collectives in the worker's ring and answers the stack signal,
  // so the stall watch sees unchanged PyTorch scripts too. It chains to the sitecustomize it
  // hides. A folder with ':' cannot be listed (PYTHONPATH separates by it); a missing one (a
  // partial install) is skipped, as the line-buffering preload is.
  if (cfg.python_shim && !plan.python.empty()) {
    // Without "bin/..": the entry shows in every worker's environment.
    const std::string shim =
        std::filesystem::path(bin_dir + "/" + LAUNCH_PYTHON_SHIM_FROM_BIN).lexically_normal();
    if (shim.find(':') == std::string::npos && sys.Inspect(shim + "/sitecustomize.py").readable) {
      auto set = plan.extra_env.find("PYTHONPATH");  // accelerate's, which already holds ours
      const std::string rest = set != plan.extra_env.end() ? set->second
                               : pythonpath != nullptr     ? pythonpath
                                                           : "";
      plan.extra_env["PYTHONPATH"] = rest.empty() ? shim : shim + ":" + rest;
    }
  }
  return plan;
}

int Main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (!args.empty())
    if (const Subcommand* sub = FindSubcommand(args[0]))
      return sub->run(std::vector<std::string>(args.begin() + 1, args.end()));
  // `launch test [flags] [CONFIG]`: the same job set-up, running the trainer's distributed
  // self-check on at least 2 processes instead of the configured program.
  bool self_test = !args.empty() && args[0] == "test";
  if (self_test) args.erase(args.begin());
  // --head_stdin comes first, as the head writes it (ssh_head.h); it is not a setting.
  if (!args.empty() && (args[0] == "--head_stdin" || args[0] == "--head-stdin")) {
    args.erase(args.begin());
    if (int rc = AcceptHead(); rc != kExitOk) return rc;
    g_started_by_head = true;
  }
  StatusOr<CommandLine> command = ParseCommandLine(args);
  if (!command.ok()) {
    std::fprintf(stderr, "launch: error: %s\n", command.status().message().c_str());
    return kExitUsage;
  }
  if (command->action == CommandLine::Action::kPrint) {
    std::cout << command->text;
    return kExitOk;
  }
  LaunchConfig& cfg = command->cfg;
  const bool print_config = command->action == CommandLine::Action::kPrintConfig;
  auto token_origin = cfg.origins.find("rdzv_token");
  if (token_origin != cfg.origins.end() && token_origin->second.kind == Origin::Kind::kFlag)
    cfg.warnings.push_back(
        "--rdzv_token on the command line is visible to every user of this machine (ps, "
        "/proc/PID/cmdline); set LAUNCH_RDZV_TOKEN in the environment instead");
  for (const auto& w : cfg.warnings) Warn(w);
  if (!cfg.hosts.empty()) return RunAsHead(cfg, args, self_test, print_config);
  RaiseDescriptorLimit();  // the shim gives workers the original back
  if (self_test) {
    if (!cfg.program.empty()) {
      std::fprintf(stderr, "launch: error: `launch test` runs its own check; drop '%s'\n",
                   Join(cfg.program, " ").c_str());
      return kExitUsage;
    }
    cfg.program = {ExecutableDir() + "/train", "--self_test"};
    cfg.no_python = true;
    cfg.max_restarts = 0;
  }

  // Several machines: main_process_port is the rendezvous endpoint's port (the workers' own
  // MASTER_PORT comes from the rendezvous), so it must not be picked at random.
  // etcd: an agent meets the others through the cluster even when the job has one node (a
  // replacement may join it).
  bool multi_node = cfg.max_nodes > 1 || cfg.rdzv_backend == "etcd";
  if (multi_node && cfg.main_process_port <= 0) cfg.main_process_port = 29500;
  std::string bin_dir = ExecutableDir();
  const HostFacts host = ProbeHost();
  const std::map<std::string, std::string> env = CurrentEnvironment();
  RealPlanSystem sys;
  StatusOr<Plan> plan = MakePlan(cfg, bin_dir, host, env, sys);
  if (self_test && plan.ok() && plan->nproc_per_node < 2 && !multi_node) {
    cfg.nproc_per_node = "2";  // a collective check needs company
    const bool gpu = plan->device_kind == "gpu";
    plan = MakePlan(cfg, bin_dir, host, env, sys);
    // The checks run on CPUs (Gloo, shared memory): on a machine with one GPU, where a GPU job
    // of two processes is refused, they run as a CPU job.
    if (!plan.ok() && gpu) {
      cfg.distributed_type = config::DistributedType::kMultiCpu;
      plan = MakePlan(cfg, bin_dir, host, env, sys);
    }
  }
  if (print_config) {
    std::cout << config::FormatConfig(cfg) << PlanSummary(plan, multi_node);
    return kExitOk;
  }
  if (!plan.ok()) {
    std::fprintf(stderr, "launch: error: %s\n", plan.status().message().c_str());
    return kExitUsage;
  }
  if (!plan->effective_config.empty()) {
    Status written = WriteEffectiveConfig(cfg, plan->effective_config);
    if (!written.ok()) {
      std::fprintf(stderr, "launch: error: %s\n", written.message().c_str());
      return kExitUsage;
    }
  }

  agent::AgentOptions opts = MakeAgentOptions(cfg, *plan, env, bin_dir);
  // The agent's signals stay caught (queued here, never acted on) from the agent's end until
  // after ~JobCgroup below has reaped the job's reaper: asio restores a signal's default action
  // when the last signal_set holding it goes, so without this one a SIGHUP in the moment between
  // the agent's end and the SIG_IGN below (a head's ssh session closing) would end launch and
  // leave the reaper an orphan. Declared before `cgroup`, so it goes after it.
  boost::asio::io_context held_io;
  boost::asio::signal_set held_signals(held_io);
  agent::AddAgentSignals(held_signals);
  // Where the kernel allows it, the job's processes live in a cgroup that is killed as a whole
  // (agent/cgroup.h), made when the first worker starts; otherwise the shims' subreapers alone
  // keep the process tree in check (`launch env` says which). What a launch killed with its
  // reaper left beside it goes now.
  std::string no_cgroup;
  std::unique_ptr<agent::JobCgroup> cgroup = agent::JobCgroup::ForThisProcess(&no_cgroup);
  if (cgroup) {
    for (const std::string& dir : cgroup->CollectAbandoned())
      log::Info("removed " + dir + ", left by a launch that is gone, with what ran in it");
    opts.group.job_cgroup = cgroup.get();
  }
  Status logs = MakePrivateLogRoot(&*plan);
  if (logs.ok()) logs = MakeLogRoot(cfg, *plan);
  if (!logs.ok()) {
    std::fprintf(stderr, "launch: error: %s\n", logs.message().c_str());
    return kExitUsage;
  }
  opts.log_root = plan->log_root;
  if (!plan->log_root.empty())
    log::Info("logs: " + plan->log_root + "/attempt_<k>/rank_<r>.{stdout,stderr}");
  if (multi_node && cfg.recover_in_place)
    log::Info(
        "--recover in_place across machines: a dead worker is replaced alone, and a lost node "
        "other than node 0 by the next `launch` that joins as its machine_rank within "
        "join_timeout; node 0 hosts the workers' store (MASTER_ADDR), so its loss restarts "
        "every node");
  int rc = multi_node ? agent::RunElasticAgent(MakeElasticAgentOptions(cfg, *plan, opts))
                      : agent::RunLocalAgent(opts);
  // The job is over: a signal now (the head's ssh session closing, a late Ctrl-C) must not end
  // launch before ~JobCgroup removes the job's cgroup and reaps its reaper, which would then
  // outlive it as an orphan (held_signals covered the moment until here). What is left is
  // bounded clean-up, and the exit code is the job's already.
  for (int signo : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGPIPE})
    ::signal(signo, SIG_IGN);
  if (self_test) {
    if (rc == 0) {
      std::printf("launch test: PASSED (%d process(es) on this machine%s)\n", plan->nproc_per_node,
                  multi_node ? ", several machines" : "");
    } else {
      std::printf("launch test: FAILED (exit %d; the failing check is named above)\n", rc);
    }
  }
  return rc;
}

}  // namespace launch::launcher
