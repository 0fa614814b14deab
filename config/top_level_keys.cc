// The rows of the top-level key table (config/key_table.h).

#include <algorithm>

#include "base/strings.h"
#include "config/key_table.h"
#include "config/scalars.h"
#include "config/value_text.h"

namespace launch::config {
namespace {

const char* kGroupProcs = "Processes";
const char* kGroupNodes = "Multiple machines and rendezvous";
const char* kGroupLogs = "Output and logs";
const char* kGroupProgram = "Program";
const char* kGroupFaults = "Failures and restarts";
const char* kGroupCompat = "Accepted for torchrun / accelerate command lines";

template <typename T>
Setter Field(T LaunchConfig::*member) {
  return [member](const std::string& s, LaunchConfig* c) { return ParseValue(s, &(c->*member)); };
}

Setter NonNegative(int LaunchConfig::*member) {
  return [member](const std::string& s, LaunchConfig* c) {
    int v = 0;
    std::string err = ParseValue(s, &v);
    if (!err.empty()) return err;
    if (v < 0) return "expected a value >= 0, got " + s;
    c->*member = v;
    return std::string();
  };
}

// Seconds in (0, 1e7] ([0, 1e7] when zero_ok).
Setter Seconds(double* (*field)(LaunchConfig*), bool zero_ok = false) {
  return [field, zero_ok](const std::string& s, LaunchConfig* c) {
    double v = 0;
    std::string err = ParseValue(s, &v);
    if (!err.empty()) return err;
    if (v < 0 || (v == 0 && !zero_ok) || v > 1e7)
      return std::string("expected a duration in seconds ") + (zero_ok ? ">= 0" : "> 0") +
             ", got " + s;
    *field(c) = v;
    return std::string();
  };
}

Setter AnyBool() {
  return [](const std::string& s, LaunchConfig*) {
    bool v = false;
    return ParseValue(s, &v);
  };
}

// Accepted without effect here; a warning says `why` unless the value is one of `harmless`
// (values that ask for what launch does anyway).
Setter NoEffect(const char* key, std::vector<std::string> harmless, const char* why) {
  return [key, harmless, why](const std::string& s, LaunchConfig* c) {
    std::string l = ToLower(Trim(s));
    if (std::find(harmless.begin(), harmless.end(), l) == harmless.end())
      c->warnings.push_back(std::string(key) + " '" + s + "' has no effect: " + why);
    return std::string();
  };
}

std::string ParseSignals(const std::string& s, LaunchConfig*) {
  const std::vector<std::string> known = {"SIGTERM", "SIGINT",  "SIGHUP",
                                          "SIGQUIT", "SIGUSR1", "SIGUSR2"};
  for (const std::string& item : Split(s, ',')) {
    std::string sig = Trim(item);
    std::string upper = sig;
    for (char& ch : upper) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    if (!StartsWith(upper, "SIG")) upper = "SIG" + upper;
    if (std::find(known.begin(), known.end(), upper) == known.end())
      return "launch stops the workers on SIGTERM, SIGINT, SIGHUP and SIGQUIT and forwards "
             "SIGUSR1 and SIGUSR2; '" +
             sig + "' cannot be chosen";
  }
  return "";
}

}  // namespace

const std::vector<KeyDef>& TopLevelTable() {
  static std::vector<KeyDef> table = {
      // ---- Processes
      Key("distributed_type",
          [](const std::string& s, LaunchConfig* c) {
            std::string u = Trim(s);
            for (char& ch : u) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
            if (u == "XLA" || (StartsWith(u, "MULTI_") && u != "MULTI_CPU" && u != "MULTI_GPU"))
              return "'" + s +
                     "': launch runs CPU and NVIDIA GPU workers only (NO, MULTI_CPU, "
                     "MULTI_GPU, FSDP, DEEPSPEED, MEGATRON_LM)";
            return ParseEnum(u, kDistributedTypes, &c->distributed_type);
          })
          .Flag({"multi_gpu"}, kGroupProcs,
                "GPU workers (accelerate --multi_gpu; distributed_type MULTI_GPU)")
          .Switch("MULTI_GPU")
          .Show([](const LaunchConfig& c) { return std::string(ToString(c.distributed_type)); }),
      Key("use_cpu",
          [](const std::string& s, LaunchConfig* c) {
            bool v = false;
            std::string err = ParseValue(s, &v);
            if (err.empty() && v) c->distributed_type = DistributedType::kMultiCpu;
            return err;
          })
          .Flag({"cpu"}, kGroupProcs, "CPU workers even where GPUs exist (accelerate --cpu)")
          .Switch()
          .Records({"use_cpu", "distributed_type"}),
      Key("num_processes",
          [](const std::string& s, LaunchConfig* c) {
            int v = 0;
            std::string err = ParseValue(s, &v);
            if (!err.empty()) return err;
            if (v < 1) return "expected at least 1 process, got " + s;
            c->num_processes = v;
            return std::string();
          })
          .Flag({"num_processes"}, kGroupProcs,
                "workers in total over all machines (accelerate's meaning)")
          .Show([](const LaunchConfig& c) {
            return c.num_processes ? std::to_string(c.num_processes) : "";
          }),
      Key("nproc_per_node",
          [](const std::string& s, LaunchConfig* c) {
            std::string l = ToLower(Trim(s));
            long long v = 0;
            if (l == "auto" || l == "gpu" || l == "cpu") {
              c->nproc_per_node = l;
            } else if (ParseInt64(l, &v) && v >= 1 && v <= kMaxWorkersPerNode) {
              c->nproc_per_node = std::to_string(v);
            } else {
              return "expected a number from 1 to " + std::to_string(kMaxWorkersPerNode) +
                     ", 'auto', 'gpu' or 'cpu', got '" + s + "'";
            }
            return std::string();
          })
          .Flag({"nproc_per_node"}, kGroupProcs,
                "workers on this machine: N (default 1), gpu (one per visible GPU), cpu (one "
                "per CPU slot) or auto (GPUs, else CPU slots)")
          .Show([](const LaunchConfig& c) { return c.nproc_per_node; }),
      Key("gpu_ids",
          [](const std::string& s, LaunchConfig* c) {
            std::string t = Trim(s);
            if (ToLower(t) != "all") {
              for (const std::string& id : Split(t, ',')) {
                long long v = 0;
                if (!ParseInt64(id, &v) || v < 0)
                  return "expected 'all' or a comma-separated list of GPU ids, got '" + s + "'";
              }
            }
            c->gpu_ids = ToLower(t) == "all" ? "all" : t;
            return std::string();
          })
          .Flag({"gpu_ids"}, kGroupProcs, "GPUs to use, e.g. 0,2 (CUDA_VISIBLE_DEVICES)")
          .Show([](const LaunchConfig& c) { return c.gpu_ids; }),
      Key("mixed_precision",
          [](const std::string& s, LaunchConfig* c) {
            std::string l = ToLower(Trim(s));
            if (l == "false") l = "no";  // unquoted `no` in a YAML 1.1 writer
            if (l != "no" && l != "bf16" && l != "fp16" && l != "fp8") {
              std::string msg = "'" + s + "' is not one of no, bf16, fp16, fp8";
              std::string near = ClosestMatch(l, {"no", "bf16", "fp16", "fp8"});
              if (!near.empty()) msg += " (did you mean '" + near + "'?)";
              return msg;
            }
            c->mixed_precision = l;
            c->train.mixed_precision = l;  // what the built-in trainer runs
            return std::string();
          })
          .Flag({"mixed_precision"}, kGroupProcs,
                "no | bf16 | fp16 | fp8 (`train`: bf16 or fp16 autocast, fp16 with loss scaling; "
                "fp8 is refused)")
          .Show([](const LaunchConfig& c) { return c.mixed_precision; }),
      // Older accelerate files say `fp16: true` instead of `mixed_precision: fp16`.
      Key("fp16",
          [](const std::string& s, LaunchConfig* c) {
            bool v = false;
            std::string err = ParseValue(s, &v);
            if (err.empty() && v) c->mixed_precision = c->train.mixed_precision = "fp16";
            return err;
          })
          .In(kYaml),
      Key("virtual_local_rank", Field(&LaunchConfig::virtual_local_rank))
          .Flag({"virtual_local_rank"}, kGroupProcs,
                "every worker gets LOCAL_RANK=0 and sees only its own GPU (torchrun's meaning)")
          .Switch()
          .Show([](const LaunchConfig& c) { return Bool(c.virtual_local_rank); }),

      // ---- Multiple machines and rendezvous
      Key("num_machines",
          [](const std::string& s, LaunchConfig* c) {
            return ParseNodes(s, &c->min_nodes, &c->max_nodes);
          })
          .Syn({"nnodes"})
          .Flag({"num_machines", "nnodes"}, kGroupNodes, "machines: N or MIN:MAX")
          .Show([](const LaunchConfig& c) {
            return c.min_nodes == c.max_nodes
                       ? std::to_string(c.min_nodes)
                       : std::to_string(c.min_nodes) + ":" + std::to_string(c.max_nodes);
          }),
      Key("machine_rank",
          [](const std::string& s, LaunchConfig* c) {
            int v = 0;
            std::string err = ParseValue(s, &v);
            if (!err.empty()) return err;
            if (v < -1) return "expected a node rank >= 0, got " + s;
            c->machine_rank = v;
            return std::string();
          })
          .Syn({"node_rank"})
          .Flag({"machine_rank", "node_rank"}, kGroupNodes,
                "this machine's rank (assigned by the rendezvous when absent or -1)")
          .Show([](const LaunchConfig& c) {
            return c.machine_rank < 0 ? "" : std::to_string(c.machine_rank);
          }),
      Key("main_process_ip", Field(&LaunchConfig::main_process_ip))
          .Syn({"master_addr"})
          .Flag({"main_process_ip", "master_addr"}, kGroupNodes,
                "rendezvous host (MASTER_ADDR on one machine)")
          .Show([](const LaunchConfig& c) { return c.main_process_ip; }),
      Key("main_process_port",
          [](const std::string& s, LaunchConfig* c) { return ParsePort(s, &c->main_process_port); })
          .Syn({"master_port"})
          .Flag({"main_process_port", "master_port"}, kGroupNodes,
                "rendezvous port (0 = pick a free port)")
          .Show([](const LaunchConfig& c) {
            return c.main_process_port < 0 ? "" : std::to_string(c.main_process_port);
          }),
      Key("rdzv_endpoint",
          [](const std::string& s, LaunchConfig* c) {
            c->rdzv_endpoints.clear();
            for (const std::string& item : Split(s, ',')) {
              std::string host;
              int port = 0;
              std::string err = ParseEndpoint(Trim(item), &host, &port);
              if (!err.empty()) return err;
              c->rdzv_endpoints.push_back(Trim(item));
            }
            // One endpoint is the built-in rendezvous' (or etcd's: Validate sorts it out).
            if (c->rdzv_endpoints.size() == 1)
              return ParseEndpoint(s, &c->main_process_ip, &c->main_process_port);
            return std::string();
          })
          .Flag({"rdzv_endpoint"}, kGroupNodes,
                "HOST:PORT or [IPv6]:PORT; under rdzv_backend etcd the cluster's client "
                "endpoints, comma-separated")
          .Records({"main_process_ip", "main_process_port"}),
      Key("rdzv_token", Field(&LaunchConfig::rdzv_token))
          .Flag({"rdzv_token"}, kGroupNodes,
                "shared secret for the rendezvous (or env LAUNCH_RDZV_TOKEN)")
          .Show([](const LaunchConfig& c) {
            return c.rdzv_token.empty() ? "" : std::string("(set, hidden)");
          }),
      Key("rdzv_local_addr", Field(&LaunchConfig::rdzv_local_addr))
          .Syn({"local_addr"})
          .Flag({"rdzv_local_addr", "local_addr"}, kGroupNodes,
                "this machine's address towards the rendezvous (multi-homed hosts)")
          .Show([](const LaunchConfig& c) { return c.rdzv_local_addr; }),
      Key("rdzv_conf", nullptr)  // SetKey applies each KEY=VALUE through this table
          .Flag({"rdzv_conf"}, kGroupNodes,
                "KEY=VALUE[,KEY=VALUE] (torchrun's): join_timeout, last_call_timeout, "
                "heartbeat_timeout, keep_alive_interval, keep_alive_max_attempt"),
      Key("join_timeout", Seconds([](LaunchConfig* c) { return &c->rdzv_conf.join_timeout_s; }))
          .In(kYaml | kEnv | kRdzvConf)
          .Flag({"join_timeout"}, kGroupNodes, "seconds to wait for the machines (600)")
          .Records({"rdzv_conf.join_timeout"})
          .Show([](const LaunchConfig& c) { return Num(c.rdzv_conf.join_timeout_s); }),
      Key("last_call_timeout",
          Seconds([](LaunchConfig* c) { return &c->rdzv_conf.last_call_timeout_s; }, true))
          .In(kYaml | kEnv | kRdzvConf)
          .Flag({"last_call_timeout"}, kGroupNodes,
                "seconds to wait for more machines once MIN arrived (1)")
          .Records({"rdzv_conf.last_call_timeout"})
          .Show([](const LaunchConfig& c) { return Num(c.rdzv_conf.last_call_timeout_s); }),
      Key("heartbeat_timeout",
          Seconds([](LaunchConfig* c) { return &c->rdzv_conf.heartbeat_timeout_s; }))
          .In(kYaml | kEnv | kRdzvConf)
          .Flag({"heartbeat_timeout"}, kGroupNodes,
                "seconds: outages up to 0.8 x this cost nothing, a machine silent 1.5 x this is "
                "lost (10)")
          .Records({"rdzv_conf.heartbeat_timeout"})
          .Show([](const LaunchConfig& c) { return Num(c.rdzv_conf.heartbeat_timeout_s); }),
      // torchrun's keep-alive pair: a node is lost after keep_alive_max_attempt missed
      // keep-alives keep_alive_interval seconds apart, so heartbeat_timeout is their product.
      Key("keep_alive_interval",
          [](const std::string& s, LaunchConfig* c) {
            std::string err =
                Seconds([](LaunchConfig* x) { return &x->rdzv_conf.keep_alive_interval_s; })(s, c);
            if (err.empty())
              c->rdzv_conf.heartbeat_timeout_s =
                  c->rdzv_conf.keep_alive_interval_s * c->rdzv_conf.keep_alive_max_attempt;
            return err;
          })
          .In(kRdzvConf)
          .Records({"rdzv_conf.heartbeat_timeout"}),
      Key("keep_alive_max_attempt",
          [](const std::string& s, LaunchConfig* c) {
            int v = 0;
            std::string err = ParseValue(s, &v);
            if (!err.empty()) return err;
            if (v < 1) return "expected a count >= 1, got " + s;
            c->rdzv_conf.keep_alive_max_attempt = v;
            c->rdzv_conf.heartbeat_timeout_s = c->rdzv_conf.keep_alive_interval_s * v;
            return std::string();
          })
          .In(kRdzvConf)
          .Records({"rdzv_conf.heartbeat_timeout"}),
      Key("read_timeout",
          NoEffect("rdzv_conf read_timeout", {}, "every rendezvous message has its own deadline"))
          .In(kRdzvConf),
      Key("close_timeout", NoEffect("rdzv_conf close_timeout", {},
                                    "launch's rendezvous closes once the round is decided"))
          .In(kRdzvConf),
      Key("timeout", NoEffect("rdzv_conf timeout", {},
                              "it configures etcd, which launch "
                              "does not use"))
          .In(kRdzvConf),
      Key("store_type", NoEffect("rdzv_conf store_type", {},
                                 "workers create their own TCPStore at MASTER_ADDR:MASTER_PORT"))
          .In(kRdzvConf),
      Key("is_host", NoEffect("rdzv_conf is_host", {},
                              "the node that can bind the endpoint hosts the rendezvous"))
          .In(kRdzvConf),
      // A head that starts every machine over ssh (config/hostfile.h, launcher/ssh_head.h).
      // Flags only, so that the remote launches, which get the same YAML and LAUNCH_* variables,
      // never become heads themselves.
      Key("hostfile",
          [](const std::string& s, LaunchConfig* c) {
            if (!c->hosts.empty() && c->hosts_origin != "--hostfile")
              return std::string("give --hostfile or --hosts, not both");
            StatusOr<std::vector<HostSlots>> hosts = LoadHostfile(s);
            if (!hosts.ok()) return hosts.status().message();
            c->hosts = *hosts;
            c->hosts_origin = "--hostfile";
            return std::string();
          })
          .In(kFlagOnly)
          .Flag({"hostfile"}, kGroupNodes,
                "start the job on these machines over ssh from here: `HOST slots=N` lines "
                "(DeepSpeed's host file); the first hosts the rendezvous")
          .Records({"hosts"}),
      Key("hosts",
          [](const std::string& s, LaunchConfig* c) {
            if (!c->hosts.empty() && c->hosts_origin != "--hosts")
              return std::string("give --hostfile or --hosts, not both");
            StatusOr<std::vector<HostSlots>> hosts = ParseHostList(s);
            if (!hosts.ok()) return hosts.status().message();
            c->hosts = *hosts;
            c->hosts_origin = "--hosts";
            return std::string();
          })
          .In(kFlagOnly)
          .Flag({"hosts", "H"}, kGroupNodes,
                "HOST:N,HOST:N (Horovod's -H): as --hostfile, the machines and their workers")
          .Show([](const LaunchConfig& c) {
            std::vector<std::string> parts;
            for (const HostSlots& h : c.hosts)
              parts.push_back(h.host + ":" + std::to_string(h.slots));
            return Join(parts, ",");
          }),
      Key("run_id", Field(&LaunchConfig::run_id))
          .Syn({"rdzv_id"})
          .Flag({"run_id", "rdzv_id"}, kGroupNodes, "job id shared by all machines")
          .Show([](const LaunchConfig& c) { return c.run_id; }),
      Key("role", Field(&LaunchConfig::role))
          .Flag({"role"}, kGroupNodes, "worker role name (ROLE_NAME)")
          .Show([](const LaunchConfig& c) { return c.role; }),

      // ---- Failures and restarts
      Key("max_restarts",
          [](const std::string& s, LaunchConfig* c) {
            std::string err = NonNegative(&LaunchConfig::max_restarts)(s, c);
            if (err.empty() && c->max_restarts > kMaxRestarts)
              return "expected at most " + std::to_string(kMaxRestarts) + " restarts, got " + s;
            return err;
          })
          .Flag({"max_restarts"}, kGroupFaults,
                "restart the whole group up to N times after a failure")
          .Show([](const LaunchConfig& c) { return std::to_string(c.max_restarts); }),
      Key("recover",
          [](const std::string& s, LaunchConfig* c) -> std::string {
            const std::string v = Trim(s);
            if (v != "restart" && v != "in_place")
              return "expected restart or in_place, got '" + s + "'";
            c->recover_in_place = v == "in_place";
            return "";
          })
          .Flag({"recover"}, kGroupFaults,
                "what a worker's death costs: restart (every worker restarts) or in_place (a "
                "replacement for that rank alone; workers that support it wait for it)")
          .Show([](const LaunchConfig& c) {
            return std::string(c.recover_in_place ? "in_place" : "restart");
          }),
      Key("spares",
          [](const std::string& s, LaunchConfig* c) -> std::string {
            long long v = 0;
            if (!ParseInt64(Trim(s), &v) || v < 0 || v > 64)
              return "expected a number of spare processes per machine from 0 to 64, got '" + s +
                     "'";
            c->spares = static_cast<int>(v);
            return "";
          })
          .Flag({"spares"}, kGroupFaults,
                "warm spare processes per machine (with --recover in_place, the built-in "
                "trainer): a dead rank's replacement without a process start")
          .Show([](const LaunchConfig& c) { return std::to_string(c.spares); }),
      Key("stop_grace", Seconds([](LaunchConfig* c) { return &c->stop_grace_s; }))
          .Syn({"shutdown_timeout"})
          .Flag({"stop_grace", "shutdown_timeout"}, kGroupFaults,
                "seconds between SIGTERM and SIGKILL when stopping workers (30)")
          .Show([](const LaunchConfig& c) { return Num(c.stop_grace_s); }),
      Key("stall_timeout", Seconds([](LaunchConfig* c) { return &c->stall_timeout_s; }, true))
          .Flag({"stall_timeout"}, kGroupFaults,
                "seconds without a completed collective, while a worker waits in one, before "
                "launch reports the stall and fails the job (1800; 0 = never)")
          .Show([](const LaunchConfig& c) { return Num(c.stall_timeout_s); }),
      Key("python_shim", Field(&LaunchConfig::python_shim))
          .Flag({"python_shim"}, kGroupFaults,
                "Python workers record torch.distributed's collectives and answer the stall "
                "report with their Python stacks, through a sitecustomize launch puts first on "
                "their PYTHONPATH (true; false leaves PYTHONPATH as it is)")
          .Show([](const LaunchConfig& c) { return Bool(c.python_shim); }),

      // ---- Output and logs
      Key("log_dir", Field(&LaunchConfig::log_dir))
          .Flag({"log_dir"}, kGroupLogs, "per-rank log files under DIR/RUN_ID/attempt_K/")
          .Show([](const LaunchConfig& c) { return c.log_dir; }),
      Key("tee", [](const std::string& s, LaunchConfig* c) { return ParseStreamSpec(s, &c->tee); })
          .Flag({"tee", "t"}, kGroupLogs,
                "copy streams to log files too: 1 stdout, 2 stderr, 3 both, or 0:1,1:3 per "
                "local rank")
          .Show([](const LaunchConfig& c) { return StreamSpecText(c.tee); }),
      Key("line_buffered", Field(&LaunchConfig::line_buffered))
          .Flag({"line_buffered"}, kGroupLogs,
                "workers' output arrives line by line: PYTHONUNBUFFERED=1 for Python, stdout "
                "line-buffered for other dynamically linked programs (true; false keeps the "
                "program's own buffering)")
          .Show([](const LaunchConfig& c) { return Bool(c.line_buffered); }),
      Key("redirects",
          [](const std::string& s, LaunchConfig* c) { return ParseStreamSpec(s, &c->redirects); })
          .Flag({"redirects", "r"}, kGroupLogs,
                "send streams to log files only (same values as --tee)")
          .Show([](const LaunchConfig& c) { return StreamSpecText(c.redirects); }),
      Key("local_ranks_filter",
          [](const std::string& s, LaunchConfig* c) {
            return ParseIntList(s, &c->local_ranks_filter);
          })
          .Flag({"local_ranks_filter"}, kGroupLogs,
                "show only these local ranks on the console, e.g. 0 or 0,1")
          .Show([](const LaunchConfig& c) {
            return c.local_ranks_filter.empty() ? "" : ListText(c.local_ranks_filter);
          }),
      Key("dedup_output", Seconds([](LaunchConfig* c) { return &c->dedup_output_s; }, true))
          .Flag({"dedup_output"}, kGroupLogs,
                "show a line that several ranks of a machine print alike within S seconds once, "
                "as [ranks 0-3]: line (0 = off; lines wait up to S to be merged)")
          .Show([](const LaunchConfig& c) { return Num(c.dedup_output_s); }),

      // ---- Program
      Key("python", Field(&LaunchConfig::python))
          .Flag({"python"}, kGroupProgram,
                "interpreter for Python programs (default: PYTHON_EXEC, else the active "
                "VIRTUAL_ENV's or CONDA_PREFIX's, else python3 on PATH)")
          .Show([](const LaunchConfig& c) { return c.python; }),
      Key("no_python", Field(&LaunchConfig::no_python))
          .Flag({"no_python"}, kGroupProgram, "run the program as given, never via python")
          .Switch(),
      Key("module", Field(&LaunchConfig::run_module))
          .In(kEnv)
          .Flag({"module", "m"}, kGroupProgram, "the program is a Python module (python -u -m)")
          .Switch(),
      Key("run_path", Field(&LaunchConfig::run_path))
          .In(kEnv)
          .Flag({"run_path"}, kGroupProgram,
                "the program is a Python script whatever its name (python -u PROGRAM)")
          .Switch(),

      // ---- Accepted so torchrun and accelerate command lines work unchanged
      Key("monitor_interval",
          [](const std::string& s, LaunchConfig*) {
            double v = 0;
            return ParseValue(s, &v);
          })
          .In(kEnv)
          .Flag({"monitor_interval"}, kGroupCompat,
                "no effect: launch sees a worker's exit at once"),
      Key("start_method", NoEffect("start_method", {"spawn", "fork", "forkserver"},
                                   "launch starts every worker as a new process"))
          .In(kEnv)
          .Flag({"start_method"}, kGroupCompat, "no effect: every worker is a new process"),
      Key("rdzv_backend",
          [](const std::string& s, LaunchConfig* c) {
            const std::string v = ToLower(Trim(s));
            if (v == "c10d" || v == "static") {
              c->rdzv_backend = "c10d";
            } else if (v == "etcd" || v == "etcd-v2") {
              c->rdzv_backend = "etcd";
            } else {
              return "rdzv_backend '" + s +
                     "': expected c10d or static (launch's own rendezvous on node 0), or etcd "
                     "or etcd-v2 (its state in an etcd cluster: survives any one machine)";
            }
            return std::string();
          })
          .Flag({"rdzv_backend"}, kGroupNodes,
                "c10d (own rendezvous on node 0) or etcd (rdzv_endpoint lists the etcd cluster)")
          .Show([](const LaunchConfig& c) { return c.rdzv_backend; }),
      Key("standalone", AnyBool())
          .In(kEnv)
          .Flag({"standalone"}, kGroupCompat,
                "no effect: one machine with a free port is the default")
          .Switch(),
      Key("same_network", AnyBool())
          .In(kEnv)
          .Flag({"same_network"}, kGroupCompat, "no effect: one rendezvous serves every network")
          .Switch(),
      Key("signals_to_handle", ParseSignals)
          .In(kEnv)
          .Flag({"signals_to_handle"}, kGroupCompat,
                "no effect: launch always stops on TERM, INT, HUP, QUIT and forwards USR1, USR2"),
      Key("event_log_handler",
          [](const std::string& s, LaunchConfig*) {
            return ToLower(Trim(s)) == "null"
                       ? std::string()
                       : "not supported: launch has no event-log handlers; only 'null' is "
                         "accepted";
          })
          .In(kEnv)
          .Flag({"event_log_handler"}, kGroupCompat, "only 'null' (no event-log handlers)"),
      Key("logs_specs", Unsupported("launch has no Python LogsSpecs plugins; --log_dir, --tee, "
                                    "--redirects and --local_ranks_filter choose where output "
                                    "goes"))
          .In(kEnv)
          .Flag({"logs_specs"}, kGroupCompat, "not supported (a Python plugin)"),
      Key("numa_binding", Unsupported("launch does not bind workers to NUMA nodes; run the "
                                      "program under numactl (launch -- numactl ARGS python3 "
                                      "-u train.py)"))
          .In(kEnv)
          .Flag({"numa_binding"}, kGroupCompat, "not supported; use numactl"),
      Key("duplicate_stdout_filters",
          Unsupported("launch does not copy matching lines into a separate file; --tee keeps "
                      "every line in per-rank files"))
          .In(kEnv)
          .Flag({"duplicate_stdout_filters"}, kGroupCompat, "not supported; use --tee"),
      Key("duplicate_stderr_filters",
          Unsupported("launch does not copy matching lines into a separate file; --tee keeps "
                      "every line in per-rank files"))
          .In(kEnv)
          .Flag({"duplicate_stderr_filters"}, kGroupCompat, "not supported; use --tee"),
  };
  static const bool extended = [] {
    AddAccelerateKeys(&table);
    return true;
  }();
  (void)extended;
  return table;
}

// The key named `key` (its name or a synonym) among those that may be given at `places`.
const KeyDef* FindKey(const std::string& key, unsigned places) {
  std::string k = Canonical(key);
  for (const KeyDef& def : TopLevelTable()) {
    if ((def.places & places) == 0) continue;
    if (def.name == k) return &def;
    for (const auto& syn : def.synonyms)
      if (syn == k) return &def;
  }
  return nullptr;
}

std::vector<std::string> NamesAt(unsigned places) {
  std::vector<std::string> names;
  for (const KeyDef& def : TopLevelTable()) {
    if ((def.places & places) == 0) continue;
    names.push_back(def.name);
    for (const auto& syn : def.synonyms) names.push_back(syn);
  }
  if (places & kYaml) names.push_back("train");
  return names;
}

std::vector<std::string> AllTopLevelNames() { return NamesAt(kYaml | kEnv); }

namespace {
Status ApplyRdzvConf(const std::string& text, const Origin& origin, const std::string& where,
                     LaunchConfig* cfg);
}  // namespace

// Sets `def` from `value`; records the origin under the key(s) it sets.
Status SetKey(const KeyDef& def, const std::string& value, const Origin& origin,
              const std::string& where, LaunchConfig* cfg) {
  if (!def.set) return ApplyRdzvConf(value, origin, where, cfg);  // rdzv_conf: a list of keys
  std::string err = def.set(value, cfg);
  if (!err.empty()) return Status::InvalidConfig(where + ": " + err);
  if (def.records.empty()) cfg->origins[def.name] = origin;
  for (const std::string& k : def.records) cfg->origins[k] = origin;
  return Status::Ok();
}

namespace {
// torchrun's --rdzv_conf text: KEY=VALUE[,KEY=VALUE...], keys from the table's rdzv_conf set.
Status ApplyRdzvConf(const std::string& text, const Origin& origin, const std::string& where,
                     LaunchConfig* cfg) {
  for (const std::string& kv : Split(text, ',')) {
    if (Trim(kv).empty()) continue;
    size_t eq = kv.find('=');
    if (eq == std::string::npos)
      return Status::InvalidConfig(where + ": expected KEY=VALUE, got '" + kv + "'");
    std::string key = Canonical(kv.substr(0, eq));
    const KeyDef* def = FindKey(key, kRdzvConf);
    if (!def)
      return Status::InvalidConfig(where + ": unknown key '" + key + "'" +
                                   NearMiss(key, NamesAt(kRdzvConf)));
    LAUNCH_RETURN_IF_ERROR(SetKey(*def, Trim(kv.substr(eq + 1)), origin, where + ": " + key, cfg));
  }
  return Status::Ok();
}

}  // namespace
}  // namespace launch::config
