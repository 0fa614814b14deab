#pragma once

// Where this worker sits in the job, read from the environment. torchrun's contract first
// (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
// TORCHELASTIC_RESTART_COUNT), then OpenMPI's and SLURM's spellings as fallbacks, so `train`
// runs unchanged under `launch`, torchrun, mpirun and srun. No LibTorch here.
//
// Beside it, Tuning: the LAUNCH_* variables that tune the transports and strategies, read here
// once (as leveldb's Options carries its Env) and handed to where they are used, which read no
// environment themselves.

#include <chrono>
#include <cstddef>
#include <map>
#include <optional>
#include <string>

#include "base/status.h"

namespace launch::trainer {

// Performance knobs: none changes a result's meaning, only how it is computed. Each field's
// default is what an unset (or empty) variable means.
struct Tuning {
  // LAUNCH_GLOO_THREADS, 1-64. Default 2 (PyTorch's): Gloo worker threads per process group
  // (comm/process_group.h). On a 2-core machine with 2 ranks, fewer can mean fewer switches.
  int gloo_threads = 2;
  // LAUNCH_SHM_ALLREDUCE: 0, false or off turns the shared-memory all-reduce, send/recv and the
  // hierarchical all-reduce off for every group this rank joins (then for all its peers too:
  // comm/shm_allreduce.h); 1, true, on or unset: on. Default true.
  bool shm_allreduce = true;
  // LAUNCH_DDP_EXCHANGE_MAX_KB, >= 0 KiB. Default 512 KiB: ddp's last gradient bucket up to
  // this size takes the direct two-rank path (parallel/ddp.cc); 0: always the group's all-reduce.
  size_t ddp_exchange_max_bytes = 512u << 10;
  // LAUNCH_DP_THREADS_PER_REPLICA, 1-256. Default 0: each dp replica's thread gets
  // max(1, at::get_num_threads() / replicas) OpenMP threads (parallel/dp.h).
  int dp_threads_per_replica = 0;
};

struct DistEnv {
  int rank = 0;              // global rank; RANK (or OMPI_COMM_WORLD_RANK, SLURM_PROCID)
  int world_size = 1;        // WORLD_SIZE (or OMPI_COMM_WORLD_SIZE, SLURM_NTASKS)
  int local_rank = 0;        // LOCAL_RANK (or OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID)
  int local_world_size = 1;  // LOCAL_WORLD_SIZE
  std::string master_addr = "127.0.0.1";  // MASTER_ADDR: host of the c10d TCPStore (rank 0)
  int master_port = 29500;                // MASTER_PORT
  int restart_count = 0;                  // TORCHELASTIC_RESTART_COUNT: > 0 after a restart
  std::string run_id;                     // TORCHELASTIC_RUN_ID (informational)
  bool from_launcher = false;             // true when RANK/WORLD_SIZE (or a fallback) were set
  // TORCHELASTIC_USE_AGENT_STORE=True: the launcher's agent already hosts the TCPStore at
  // MASTER_ADDR:MASTER_PORT (torchrun does), so rank 0 connects as a client instead of hosting.
  bool use_agent_store = false;
  // ACCELERATE_USE_CPU=True (launch --cpu, accelerate's use_cpu): compute on the CPU even where
  // LibTorch and the machine have a GPU.
  bool use_cpu = false;
  // LAUNCH_TEST_SHARE_GPU=1, for tests on a machine with fewer GPUs than ranks (NCCL refuses
  // two ranks on one device): every local rank computes on CUDA device LOCAL_RANK modulo the
  // visible devices, and CUDA tensors travel over Gloo (compat/platform.h). Never for training.
  bool test_share_gpu = false;
  // LAUNCH_CONSOLE_TTY=1: the agent's console is a terminal (agent/worker_group.cc), which a
  // worker writing into the agent's pipe cannot see for itself.
  bool console_tty = false;
  // LAUNCH_RECOVER=in_place (launch --recover in_place): the agent replaces a dead worker alone
  // and the others wait for it (accelerator.h, "In-place recovery"); "restart" or unset: off.
  bool recover_in_place = false;
  // LAUNCH_RECOVER_GENERATION: 0 for the job's first workers; N > 0 for the N-th replacement
  // the agent started, which joins the survivors instead of starting a run.
  int recover_generation = 0;
  // LAUNCH_RECOVER_LOST_AT_MS: when the agent saw the worker this replacement replaces die
  // (milliseconds since the epoch); 0: not given.
  long long recover_lost_at_ms = 0;
  // LAUNCH_RECOVER_LOST_BY: who saw that loss first, for the recovery's report ("the rendezvous
  // (node 1 lost)"); empty: this rank's agent.
  std::string recover_lost_by;
  // LAUNCH_RECOVER_WAIT_S: how long a survivor waits for a replacement's generation, in whole
  // seconds; 0 (unset): the init timeout. The multi-node agent sets it to cover the rendezvous'
  // detection of a lost node and its wait for a replacement (join_timeout).
  int recover_wait_s = 0;
  // How long one collective of the groups this process forms waits for a peer before it fails
  // (Gloo's, NCCL's and the shared-memory transports' operations): not read from the
  // environment; Accelerator::Create sets it from train.collective_timeout. 0: the timeout the
  // group was formed with (CreateGroupOver's).
  std::chrono::milliseconds collective_timeout{0};
  // CUDA_VISIBLE_DEVICES as given ("" included: no device visible); nullopt when unset. Named
  // in errors about devices (compat/platform.h); LibTorch itself applies it.
  std::optional<std::string> cuda_visible_devices;
  // The LAUNCH_* performance knobs above.
  Tuning tuning;

  bool distributed() const { return world_size > 1; }
  // "rank 1/2 (local 1) store 127.0.0.1:29500"
  std::string Describe() const;
};

// Parses `env` (variable -> value). Missing variables mean a single process (rank 0 of 1).
// Errors (Status::InvalidConfig) name the variable: "environment RANK: expected an integer,
// got 'x'", and inconsistent values (RANK >= WORLD_SIZE). Reads Tuning with ParseTuning.
StatusOr<DistEnv> ParseDistEnv(const std::map<std::string, std::string>& env);

// A warm spare (launch --spares, agent/worker_group.h): LAUNCH_SPARE=1 in the environment and the
// agent's pipe on stdin.
bool IsSpare();
// Blocks until the agent hands this spare a rank: "KEY=VALUE" lines and an empty line on stdin,
// which become this process's environment (the rank's torchrun variables, its recovery
// generation, ...); LAUNCH_SPARE is then unset and stdin is left at EOF. Returns false, with
// nothing changed, when stdin ends first: the job is over and needs no spare (exit 0). True at
// once when this process is not a spare. IoError when stdin cannot be read.
StatusOr<bool> AwaitSpareAssignment();

// Parses Tuning's variables from `env` (variable -> value); unset or empty ones keep their
// defaults. InvalidConfig naming the variable for a value out of its range or not a number:
// "environment LAUNCH_GLOO_THREADS: expected an integer from 1 to 64, got 'x'".
StatusOr<Tuning> ParseTuning(const std::map<std::string, std::string>& env);

}  // namespace launch::trainer
