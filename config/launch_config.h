#pragma once

// The job description: one plain struct tree, filled in exactly one place (config/loader.h)
// from defaults, the YAML file, the environment and command-line flags, in that order of
// increasing precedence:   flag > environment > YAML > default.
//
// Every field states its default and meaning. No YAML or CLI types leak past the loader.
// The trainer's part (`train:`) is in train_config.h, which trainer_runtime includes alone, so
// an edit to a launcher-only option recompiles no LibTorch translation unit.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "config/hostfile.h"
#include "config/limits.h"
#include "config/train_config.h"

namespace launch::config {

// Where a value came from, for `launch --print_config`.
struct Origin {
  enum class Kind { kDefault, kFile, kEnvironment, kFlag, kDerived };
  Kind kind = Kind::kDefault;
  std::string detail;  // "train.yaml:12", "--nproc_per_node", "SLURM_NNODES", ...
  std::string ToString() const;
};

// ---------------------------------------------------------------------------------------------
// Where the job runs (top-level keys; accelerate's names, torchrun's spellings as synonyms).

// accelerate's distributed_type. FSDP, DEEPSPEED and MEGATRON_LM are GPU jobs like MULTI_GPU
// whose sharding the script's Accelerator does; launch exports what it needs to know
// (ACCELERATE_USE_FSDP, FSDP_*, ...; see `accelerate` below).
enum class DistributedType { kAuto, kNo, kMultiCpu, kMultiGpu, kFsdp, kDeepSpeed, kMegatronLm };
inline bool WantsGpus(DistributedType t) {
  return t == DistributedType::kMultiGpu || t == DistributedType::kFsdp ||
         t == DistributedType::kDeepSpeed || t == DistributedType::kMegatronLm;
}

// torchrun's --tee / --redirects: which streams of which local ranks go to files.
// Bit 1 = stdout, bit 2 = stderr (so 3 = both), optionally per local rank ("0:1,1:3").
struct StreamSpec {
  int all = 0;                  // applies to ranks not in `per_rank`
  std::map<int, int> per_rank;  // local rank -> mask
  int For(int local_rank) const {
    auto it = per_rank.find(local_rank);
    return it == per_rank.end() ? all : it->second;
  }
};

struct RdzvConf {
  double join_timeout_s = 600;     // how long agents wait for the minimum number of nodes
  double last_call_timeout_s = 1;  // after MIN nodes joined, wait this long for more (up to MAX)
  // Liveness between the agents and the rendezvous (rendezvous/protocol.h): heartbeats every
  // fifth of it; an outage or a pause of up to 0.8 x this costs nothing, a peer silent (or not
  // acknowledging) for 1.5 x this is lost. 10: a lost node is known within 15 s, torchrun's
  // keep-alive (5 s x 3), and the outages torchrun rides out (5 s cut, 8 s SIGSTOP) cost nothing.
  double heartbeat_timeout_s = 10;
  // torchrun's spelling of the same: once either is given, heartbeat_timeout becomes
  // keep_alive_interval x keep_alive_max_attempt (torchrun's defaults 5 s and 3 for the other).
  double keep_alive_interval_s = 5;
  int keep_alive_max_attempt = 3;
};

struct LaunchConfig {
  std::string config_path;  // the YAML file in effect; empty when none

  DistributedType distributed_type = DistributedType::kAuto;  // derived from hardware when auto
  // Workers per node: a number, "auto" (GPUs if any, else CPU slots), "gpu" (every visible GPU;
  // an error without one) or "cpu" (CPU slots). 1 by default, as torchrun's. Derived from
  // num_processes / num_machines when only num_processes is given.
  std::string nproc_per_node = "1";
  int num_processes = 0;  // accelerate's meaning: total over all machines; 0 = unset
  int min_nodes = 1;      // num_machines / nnodes ("2" or "MIN:MAX")
  int max_nodes = 1;
  int machine_rank = -1;                      // node rank; -1 = assigned by the rendezvous
  std::string main_process_ip = "127.0.0.1";  // rendezvous endpoint host (MASTER_ADDR on 1 node)
  int main_process_port = -1;  // -1 = default: a free port on one node, 29500 across nodes
  std::string rdzv_token;      // shared secret (also env LAUNCH_RDZV_TOKEN)
  // Local address the agent connects to the rendezvous from (multi-homed hosts; the tests use
  // 127.0.0.2, 127.0.0.3, ... as stand-in nodes). Empty = chosen by the kernel.
  std::string rdzv_local_addr;
  RdzvConf rdzv_conf;
  // rdzv_backend: "c10d" (torchrun's "static" and "c10d" too) is launch's own TCP rendezvous,
  // hosted by node 0's agent at main_process_ip:main_process_port; "etcd" ("etcd-v2") keeps the
  // rendezvous' state in an etcd cluster, whose client endpoints rdzv_endpoint lists
  // (etcd_endpoints), and the agents elect which of them serves it (agent/etcd_rendezvous.h).
  std::string rdzv_backend = "c10d";
  std::vector<std::string> etcd_endpoints;  // "host:port", from rdzv_endpoint under etcd
  std::vector<std::string> rdzv_endpoints;  // rdzv_endpoint as given, split at commas
  // The job's machines when this launch is the head that starts them all over ssh (--hostfile
  // FILE, or --hosts h1:2,h2:2; launcher/ssh_head.h); empty = this launch is one node. Flags
  // only: the YAML and the environment reach every host, where they must not start heads.
  std::vector<HostSlots> hosts;
  std::string hosts_origin;  // "--hostfile hosts.txt" or "--hosts": for messages
  // Empty: a fresh one on one node; across nodes one derived from what the nodes share
  // (launcher.cc DerivedRunId), or slurm-$SLURM_JOB_ID under SLURM.
  std::string run_id;
  std::string role = "default";
  int max_restarts = 0;  // whole-group restarts after a failure
  // What a worker's death costs (`recover`, --recover): false ("restart", the default) stops
  // every worker and restarts them all; true ("in_place") starts a replacement for the dead
  // rank alone while the others wait for it (agent/worker_group.h replace_in_place). Both
  // count against max_restarts.
  bool recover_in_place = false;
  // Warm spares per machine (`spares`, --spares N; needs recover_in_place and the built-in
  // trainer): processes started with the job, LibTorch loaded and data built, each of which takes
  // a dead rank's place without a process start (agent/worker_group.h WorkerGroupSpec::spares).
  int spares = 0;
  std::string gpu_ids = "all";  // CUDA_VISIBLE_DEVICES for the workers ("all" = leave as is)
  std::string mixed_precision = "no";
  std::string log_dir;                  // per-rank log files under <log_dir>/<run_id>/attempt_<k>/
  StreamSpec tee;                       // streams copied to files and still shown on the console
  StreamSpec redirects;                 // streams sent to files only
  std::vector<int> local_ranks_filter;  // console shows only these local ranks; empty = all
  // Seconds within which identical console lines of several local ranks become one
  // "[ranks 0-3]: " line (agent/line_merge.h); 0 = every rank's line as printed.
  double dedup_output_s = 0;
  double stop_grace_s = 30;  // SIGTERM -> SIGKILL grace period for workers
  // No collective completed on a node for this long while a worker waits in one: the stall
  // report, then the job fails (agent/stall_watch.h). 1800 by default, far beyond any healthy
  // gap between collectives; 0 = never.
  double stall_timeout_s = 1800;
  std::string python = "python3";  // interpreter for .py programs and -m
  // Workers' output arrives as it is printed: PYTHONUNBUFFERED=1 (unless set) and, for a
  // program not run under Python, stdout line-buffered through LD_PRELOAD (agent/linebuf.c).
  bool line_buffered = true;
  // Python workers (a script, -m, or a python given after --) get launch's shim first on
  // PYTHONPATH (agent/python_shim/sitecustomize.py): their torch.distributed collectives are
  // recorded for the stall watch and their Python stacks answer its stack signal. false: none.
  bool python_shim = true;
  bool no_python = false;   // run the program as given (torchrun --no_python)
  bool run_module = false;  // -m: the program is a Python module
  bool run_path = false;    // torchrun --run_path: the program is a Python script
  // torchrun --virtual_local_rank: every worker sees LOCAL_RANK=0 and, on GPUs, only its own
  // device (CUDA_VISIBLE_DEVICES narrowed to it), so per-process code never indexes a device.
  bool virtual_local_rank = false;
  std::vector<std::string> program;     // after `--`, or the trainer command
  std::vector<std::string> extra_args;  // after `--` when a CONFIG with train: is given

  // accelerate's settings that launch does not act on itself but hands to the script, as
  // `accelerate launch` does, through the environment its Accelerator() reads (AccelerateEnv in
  // launcher/accelerate_env.h): dynamo, FSDP, DeepSpeed, Megatron-LM, fp8, parallelism config,
  // debug, CPU threads and affinity. Keyed by accelerate's argument name (dynamo_backend,
  // fsdp_sharding_strategy, zero_stage, ...), from its flags or its config file's sections.
  std::map<std::string, std::string> accelerate;
  // accelerate settings given with a non-default value that change nothing here (TPU, SageMaker,
  // ...): named together in one warning.
  std::vector<std::string> no_effect;

  // One worker per SLURM task (`srun --ntasks-per-node=G launch ...`, Lightning's layout): this
  // launch is one of the node's G tasks and starts one worker, whose LOCAL_RANK,
  // LOCAL_WORLD_SIZE, GROUP_RANK and GROUP_WORLD_SIZE describe the node (SLURM_LOCALID, tasks on
  // the node, SLURM_NODEID, nodes). local_rank < 0: off (one launch per node, the usual layout).
  struct TaskLayout {
    int local_rank = -1;
    int local_world_size = 0;
    int node_rank = 0;
    int num_nodes = 0;
  } task_layout;

  TrainConfig train;

  std::map<std::string, Origin> origins;  // key path -> where its value came from
  // Loaded from launch's resolved configuration (train --effective_config), which writes every
  // key, those inert in the run's mode too: it was checked when launch resolved it.
  bool effective = false;
  std::vector<std::string> warnings;  // e.g. accelerate keys with no meaning here
};

const char* ToString(DistributedType v);

}  // namespace launch::config
