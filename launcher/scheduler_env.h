#pragma once

// What a batch scheduler or MPI launcher tells us about the job, mapped onto LaunchConfig.
//
// Under `srun --ntasks-per-node=1 launch ...` (SLURM) or `mpirun -np N launch ...` (OpenMPI,
// MPICH, Intel MPI) every `launch` is one "machine" of the job. The scheduler's variables give
// the number of machines, this machine's rank and (SLURM) the head node, which becomes the
// rendezvous endpoint. The caller applies layers in this order:
//
//   LoadYamlFile(...);                        // YAML over defaults
//   ApplyEnvironment(env, &cfg);              // LAUNCH_* / PET_* variables
//   ApplySchedulerEnvironment(env, &cfg);     // SLURM_* / OMPI_* / PMI_* (this file)
//   ApplySetting(..., kFlag, ...);            // command-line flags, which win over everything
//   Validate(&cfg);
//
// A key is filled from the scheduler only when its value so far comes from the YAML file or the
// default: a LAUNCH_* variable (origin kEnvironment) or a flag (kFlag) is never overridden.
// Values are set through config::ApplySetting with an Origin naming the variable
// (Origin{kEnvironment, "SLURM_NNODES"}), so `launch --print_config` shows where they came from.
//
// Which source is used:
//   * MPI, when OMPI_COMM_WORLD_SIZE is set (OpenMPI's mpirun), or PMI_SIZE (MPICH, Intel MPI)
//     outside SLURM or disagreeing with the SLURM step's task count: num_machines = world size,
//     machine_rank = world rank. MPI does not name rank 0's host: when all ranks share this host
//     (OMPI_COMM_WORLD_LOCAL_SIZE / MPI_LOCALNRANKS == world size) main_process_ip stays at its
//     default 127.0.0.1; across hosts inside a SLURM allocation it is the allocation's first
//     node (where mpirun maps rank 0); otherwise a warning asks for --main_process_ip.
//   * SLURM, inside a job step (SLURM_STEP_ID set, i.e. under srun): num_machines = number of
//     tasks of the step (SLURM_STEP_NUM_TASKS / SLURM_NTASKS; equal to the node count with
//     --ntasks-per-node=1), machine_rank = SLURM_PROCID (SLURM_NODEID when absent),
//     main_process_ip = first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST /
//     SLURM_NODELIST). When no process count was given anywhere (neither num_processes nor
//     nproc_per_node), nproc_per_node = SLURM_GPUS_ON_NODE (GPUs allocated on this node) or,
//     without GPUs and unless distributed_type is MULTI_GPU, SLURM_CPUS_ON_NODE. Several tasks
//     per node give a warning.
//   * SLURM outside a step (the batch script itself): nothing is changed; when the job has
//     several nodes a warning says that only this node is used and how to use all of them.
// Warnings are appended to cfg->warnings.

#include <map>
#include <string>
#include <vector>

#include "base/status.h"
#include "config/launch_config.h"

namespace launch::config {

// Fills num_machines, machine_rank, main_process_ip (and nproc_per_node, see above) from the
// scheduler's variables in `env` (variable name -> value). Returns InvalidConfig naming the
// variable when one is malformed (e.g. "SLURM_JOB_NODELIST: unbalanced '['"). No-op when no
// scheduler variables are present.
Status ApplySchedulerEnvironment(const std::map<std::string, std::string>& env, LaunchConfig* cfg);

// Expands a SLURM host list: "gpu[01-04,07],cpu-a[1-2]" -> gpu01 gpu02 gpu03 gpu04 gpu07
// cpu-a1 cpu-a2. Grammar: comma-separated items (commas inside brackets belong to the
// bracket); an item is text with zero or more bracket groups, each a comma-separated list of
// numbers N or ranges LO-HI; several groups in one item multiply ("r[1-2]n[1-2]" -> r1n1 r1n2
// r2n1 r2n2). A range keeps the width of its low bound when that has leading zeros ("[08-10]"
// -> 08 09 10, "[8-10]" -> 8 9 10). Order is preserved, duplicates are kept.
// Errors (InvalidArgument): unbalanced or nested brackets, empty items or groups, non-numeric
// bounds, LO > HI, or more than kMaxHosts names.
StatusOr<std::vector<std::string>> ExpandHostList(const std::string& host_list);

// Upper bound on the names ExpandHostList produces (protects against "n[0-999999999]").
inline constexpr size_t kMaxHosts = 1 << 20;

}  // namespace launch::config
