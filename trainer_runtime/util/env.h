#pragma once

// Where this worker sits in the job, read from the environment. torchrun's contract first
// (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
// TORCHELASTIC_RESTART_COUNT), then OpenMPI's and SLURM's spellings as fallbacks, so `train`
// runs unchanged under `launch`, torchrun, mpirun and srun. No LibTorch here.

#include <map>
#include <string>

#include "base/status.h"

namespace launch::trainer {

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
  // LAUNCH_RECOVER=in_place (launch --recover in_place): the agent replaces a dead worker alone
  // and the others wait for it (accelerator.h, "In-place recovery"); "restart" or unset: off.
  bool recover_in_place = false;
  // LAUNCH_RECOVER_GENERATION: 0 for the job's first workers; N > 0 for the N-th replacement
  // the agent started, which joins the survivors instead of starting a run.
  int recover_generation = 0;
  // LAUNCH_RECOVER_WAIT_S: how long a survivor waits for a replacement's generation, in whole
  // seconds; 0 (unset): the init timeout. The multi-node agent sets it to cover the rendezvous'
  // detection of a lost node and its wait for a replacement (join_timeout).
  int recover_wait_s = 0;

  bool distributed() const { return world_size > 1; }
  // "rank 1/2 (local 1) store 127.0.0.1:29500"
  std::string Describe() const;
};

// Parses `env` (variable -> value). Missing variables mean a single process (rank 0 of 1).
// Errors (Status::InvalidConfig) name the variable: "environment RANK: expected an integer,
// got 'x'", and inconsistent values (RANK >= WORLD_SIZE).
StatusOr<DistEnv> ParseDistEnv(const std::map<std::string, std::string>& env);

}  // namespace launch::trainer
