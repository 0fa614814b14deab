#include "launcher/scheduler_env.h"

#include <doctest/doctest.h>

#include "config/loader.h"

namespace launch::config {
namespace {

using Env = std::map<std::string, std::string>;
using Hosts = std::vector<std::string>;

Hosts Expand(const std::string& list) {
  StatusOr<Hosts> hosts = ExpandHostList(list);
  REQUIRE_MESSAGE(hosts.ok(), (hosts.status().ToString()));
  return *hosts;
}

std::string ExpandError(const std::string& list) {
  StatusOr<Hosts> hosts = ExpandHostList(list);
  REQUIRE_MESSAGE(!hosts.ok(), (std::string("expected an error for ") + list));
  CHECK(hosts.status().code() == Status::Code::kInvalidArgument);
  return hosts.status().message();
}

TEST_CASE("HostListSingleNames") {
  CHECK(Expand("node1") == Hosts{"node1"});
  CHECK(Expand("a,b,c") == Hosts{"a", "b", "c"});
  CHECK(Expand("host-01.cluster.example.org") == Hosts{"host-01.cluster.example.org"});
  CHECK(Expand("").empty());
}

TEST_CASE("HostListRangesKeepZeroPadding") {
  CHECK(Expand("gpu[01-04,07]") == Hosts{"gpu01", "gpu02", "gpu03", "gpu04", "gpu07"});
  CHECK(Expand("n[8-11]") == Hosts{"n8", "n9", "n10", "n11"});
  CHECK(Expand("n[08-11]") == Hosts{"n08", "n09", "n10", "n11"});
  CHECK(Expand("n[098-101]") == Hosts{"n098", "n099", "n100", "n101"});
  CHECK(Expand("n[0-2]") == Hosts{"n0", "n1", "n2"});
  CHECK(Expand("n[5]") == Hosts{"n5"});
  CHECK(Expand("n[007]") == Hosts{"n007"});
}

TEST_CASE("HostListSeveralGroupsAndSuffixes") {
  CHECK(Expand("gpu[01-04,07],cpu-a[1-2]") ==
        Hosts{"gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu-a1", "cpu-a2"});
  CHECK(Expand("login,c[1-2]-ib,d3") == Hosts{"login", "c1-ib", "c2-ib", "d3"});
  CHECK(Expand("rack[1-2]-n[01-02]") == Hosts{"rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"});
  CHECK(Expand(" a[1-2] , b ") == Hosts{"a1", "a2", "b"});
  // Order and duplicates are kept as SLURM gives them.
  CHECK(Expand("n[3,1,3]") == Hosts{"n3", "n1", "n3"});
}

TEST_CASE("HostListErrorsSayWhatIsWrong") {
  CHECK(ExpandError("gpu[01-04").find("unbalanced '['") != std::string::npos);
  CHECK(ExpandError("gpu01-04]").find("unbalanced ']'") != std::string::npos);
  CHECK(ExpandError("gpu[[1-2]]").find("nested") != std::string::npos);
  CHECK(ExpandError("gpu[]").find("empty brackets") != std::string::npos);
  CHECK(ExpandError("gpu[1,,2]").find("empty entry") != std::string::npos);
  CHECK(ExpandError("gpu[4-1]").find("backwards") != std::string::npos);
  CHECK(ExpandError("gpu[a-b]").find("not a number") != std::string::npos);
  CHECK(ExpandError("gpu[1-]").find("not a number") != std::string::npos);
  CHECK(ExpandError("a,,b").find("empty host name") != std::string::npos);
  CHECK(ExpandError("a,").find("empty host name") != std::string::npos);
  CHECK(ExpandError("n[0-999999999]").find("more than") != std::string::npos);
  CHECK(ExpandError("a[0-9999]b[0-9999]").find("more than") != std::string::npos);
}

// The variables srun sets for `srun -N2 --ntasks-per-node=1` on the node with rank `rank`.
Env SlurmStep(int rank, const std::string& nodelist = "gpu[01-02]") {
  return {{"SLURM_JOB_ID", "42"},
          {"SLURM_STEP_ID", "0"},
          {"SLURM_JOB_NODELIST", nodelist},
          {"SLURM_STEP_NODELIST", nodelist},
          {"SLURM_NNODES", "2"},
          {"SLURM_JOB_NUM_NODES", "2"},
          {"SLURM_STEP_NUM_NODES", "2"},
          {"SLURM_NTASKS", "2"},
          {"SLURM_STEP_NUM_TASKS", "2"},
          {"SLURM_NODEID", std::to_string(rank)},
          {"SLURM_PROCID", std::to_string(rank)},
          {"SLURM_LOCALID", "0"},
          {"SLURM_CPUS_ON_NODE", "8"}};
}

TEST_CASE("SlurmStepFillsMachinesRankAndHeadNode") {
  LaunchConfig cfg;
  REQUIRE(ApplySchedulerEnvironment(SlurmStep(1), &cfg).ok());
  CHECK(cfg.min_nodes == 2);
  CHECK(cfg.max_nodes == 2);
  CHECK(cfg.machine_rank == 1);
  CHECK(cfg.main_process_ip == "gpu01");
  CHECK(cfg.origins["num_machines"].ToString() == "environment SLURM_STEP_NUM_TASKS");
  CHECK(cfg.origins["machine_rank"].ToString() == "environment SLURM_PROCID");
  CHECK(cfg.origins["main_process_ip"].ToString() == "environment SLURM_STEP_NODELIST");
  // One run id per job; a rendezvous port per job (15000 + the id's last 4 digits).
  CHECK(cfg.run_id == "slurm-42");
  CHECK(cfg.origins["run_id"].ToString() == "environment SLURM_JOB_ID");
  CHECK(cfg.main_process_port == 15042);
  // No process count anywhere and no GPUs through GRES: a GPU node allocated without --gres
  // still counts its GPUs (auto), it does not get one worker per CPU.
  CHECK(cfg.nproc_per_node == "auto");
  CHECK(cfg.origins["nproc_per_node"].ToString().find("SLURM allocated no GPUs") !=
        std::string::npos);
  CHECK(cfg.warnings.empty());
  REQUIRE(Validate(&cfg).ok());
}

TEST_CASE("SlurmCpuJobsTakeTheAllocatedCpus") {
  LaunchConfig cfg;
  REQUIRE(ApplySetting("use_cpu", "true", Origin{Origin::Kind::kFlag, "--cpu"}, &cfg).ok());
  REQUIRE(ApplySchedulerEnvironment(SlurmStep(1), &cfg).ok());
  CHECK(cfg.nproc_per_node == "8");
  CHECK(cfg.origins["nproc_per_node"].ToString() == "environment SLURM_CPUS_ON_NODE");
}

TEST_CASE("SlurmEndpointFromLaunchVariableWinsOverTheNodeList") {
  // The endpoint's host and port keep their origin (a LAUNCH_* variable beats SLURM).
  LaunchConfig cfg;
  REQUIRE(ApplyEnvironment({{"LAUNCH_RDZV_ENDPOINT", "login5:29400"}}, &cfg).ok());
  REQUIRE(ApplySchedulerEnvironment(SlurmStep(1), &cfg).ok());
  CHECK(cfg.main_process_ip == "login5");
  CHECK(cfg.main_process_port == 29400);
  CHECK(cfg.origins["main_process_ip"].ToString() == "environment LAUNCH_RDZV_ENDPOINT");
}

TEST_CASE("SlurmGpusOnNodeGiveProcessesPerNode") {
  LaunchConfig cfg;
  Env env = SlurmStep(0);
  env["SLURM_GPUS_ON_NODE"] = "4";
  REQUIRE(ApplySchedulerEnvironment(env, &cfg).ok());
  CHECK(cfg.nproc_per_node == "4");
  CHECK(cfg.origins["nproc_per_node"].ToString() == "environment SLURM_GPUS_ON_NODE");
}

TEST_CASE("SlurmHeadNodeIsFirstHostOfComplexList") {
  LaunchConfig cfg;
  REQUIRE(ApplySchedulerEnvironment(SlurmStep(0, "gpu[07-09],cpu-a[1-2]"), &cfg).ok());
  CHECK(cfg.main_process_ip == "gpu07");
}

TEST_CASE("SlurmDoesNotOverrideFlagsOrLaunchVariables") {
  LaunchConfig cfg;
  REQUIRE(ApplyEnvironment({{"LAUNCH_MAIN_PROCESS_IP", "10.0.0.5"}}, &cfg).ok());
  REQUIRE(
      ApplySetting("machine_rank", "0", Origin{Origin::Kind::kFlag, "--machine_rank"}, &cfg).ok());
  REQUIRE(ApplySchedulerEnvironment(SlurmStep(1), &cfg).ok());
  CHECK(cfg.main_process_ip == "10.0.0.5");
  CHECK(cfg.origins["main_process_ip"].ToString() == "environment LAUNCH_MAIN_PROCESS_IP");
  CHECK(cfg.machine_rank == 0);
  CHECK(cfg.min_nodes == 2);  // not given above: SLURM fills it
}

TEST_CASE("SlurmOverridesYamlButKeepsItsProcessCount") {
  LaunchConfig cfg;
  REQUIRE(LoadYamlString("num_processes: 4\nnum_machines: 1\nmain_process_ip: 1.2.3.4\n", "a.yaml",
                         &cfg)
              .ok());
  REQUIRE(ApplySchedulerEnvironment(SlurmStep(0), &cfg).ok());
  CHECK(cfg.min_nodes == 2);
  CHECK(cfg.main_process_ip == "gpu01");
  CHECK(cfg.nproc_per_node == "1");  // num_processes from the YAML stays in charge
  REQUIRE(Validate(&cfg).ok());
  CHECK(cfg.nproc_per_node == "2");  // 4 in total over 2 nodes
}

TEST_CASE("SlurmBatchScriptWithoutSrunOnlyWarns") {
  LaunchConfig cfg;
  Env env = {{"SLURM_JOB_ID", "7"},        {"SLURM_JOB_NODELIST", "n[1-4]"},
             {"SLURM_JOB_NUM_NODES", "4"}, {"SLURM_NNODES", "4"},
             {"SLURM_NODEID", "0"},        {"SLURM_PROCID", "0"}};
  REQUIRE(ApplySchedulerEnvironment(env, &cfg).ok());
  CHECK(cfg.min_nodes == 1);
  CHECK(cfg.machine_rank == -1);
  CHECK(cfg.main_process_ip == "127.0.0.1");
  REQUIRE(cfg.warnings.size() == 1);
  CHECK(cfg.warnings[0].find("srun --ntasks-per-node=1") != std::string::npos);
}

TEST_CASE("SlurmOneTaskPerGpuRunsOneWorkerPerTask") {
  // srun -N2 --ntasks-per-node=4: task 6 is local task 2 on node 1.
  LaunchConfig cfg;
  Env env = SlurmStep(1);
  env["SLURM_NTASKS"] = env["SLURM_STEP_NUM_TASKS"] = "8";
  env["SLURM_PROCID"] = "6";
  env["SLURM_LOCALID"] = "2";
  env["SLURM_STEP_TASKS_PER_NODE"] = "4(x2)";
  env["SLURM_GPUS_ON_NODE"] = "4";
  REQUIRE(ApplySchedulerEnvironment(env, &cfg).ok());
  CHECK(cfg.min_nodes == 8);
  CHECK(cfg.machine_rank == 6);
  CHECK(cfg.nproc_per_node == "1");  // not 4 per task (16 on the node)
  CHECK(cfg.task_layout.local_rank == 2);
  CHECK(cfg.task_layout.local_world_size == 4);
  CHECK(cfg.task_layout.node_rank == 1);
  CHECK(cfg.task_layout.num_nodes == 2);
  CHECK(cfg.warnings.empty());
  // Uneven nodes: this node's own count.
  env["SLURM_STEP_TASKS_PER_NODE"] = "5,3";
  LaunchConfig uneven;
  REQUIRE(ApplySchedulerEnvironment(env, &uneven).ok());
  CHECK(uneven.task_layout.local_world_size == 3);
  env["SLURM_STEP_TASKS_PER_NODE"] = "4(x";
  LaunchConfig bad;
  CHECK(ApplySchedulerEnvironment(env, &bad).message().find("SLURM_STEP_TASKS_PER_NODE") !=
        std::string::npos);
}

TEST_CASE("SlurmBadNodeListNamesTheVariable") {
  LaunchConfig cfg;
  Status s = ApplySchedulerEnvironment(SlurmStep(0, "gpu[01-"), &cfg);
  REQUIRE(!s.ok());
  CHECK(s.code() == Status::Code::kInvalidConfig);
  CHECK(s.message().find("SLURM_STEP_NODELIST") != std::string::npos);
}

TEST_CASE("OpenMpiOnOneHost") {
  LaunchConfig cfg;
  Env env = {{"OMPI_COMM_WORLD_SIZE", "2"},
             {"OMPI_COMM_WORLD_RANK", "1"},
             {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
             {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
  REQUIRE(ApplySchedulerEnvironment(env, &cfg).ok());
  CHECK(cfg.min_nodes == 2);
  CHECK(cfg.machine_rank == 1);
  CHECK(cfg.main_process_ip == "127.0.0.1");
  CHECK(cfg.origins["num_machines"].ToString() == "environment OMPI_COMM_WORLD_SIZE");
  CHECK(cfg.origins["machine_rank"].ToString() == "environment OMPI_COMM_WORLD_RANK");
  CHECK(cfg.warnings.empty());
}

TEST_CASE("OpenMpiAcrossHostsAsksForMainProcessIp") {
  LaunchConfig cfg;
  Env env = {{"OMPI_COMM_WORLD_SIZE", "4"},
             {"OMPI_COMM_WORLD_RANK", "2"},
             {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}};
  REQUIRE(ApplySchedulerEnvironment(env, &cfg).ok());
  CHECK(cfg.min_nodes == 4);
  CHECK(cfg.machine_rank == 2);
  REQUIRE(cfg.warnings.size() == 1);
  CHECK(cfg.warnings[0].find("--main_process_ip") != std::string::npos);

  LaunchConfig given;
  REQUIRE(ApplyEnvironment({{"LAUNCH_MAIN_PROCESS_IP", "10.0.0.1"}}, &given).ok());
  REQUIRE(ApplySchedulerEnvironment(env, &given).ok());
  CHECK(given.warnings.empty());
  CHECK(given.main_process_ip == "10.0.0.1");
}

TEST_CASE("OpenMpiInsideSlurmAllocationWinsAndUsesFirstNode") {
  // mpirun inside sbatch: the SLURM step variables belong to mpirun's daemons.
  LaunchConfig cfg;
  Env env = SlurmStep(0, "c[3-4]");
  env["SLURM_PROCID"] = "0";
  env["OMPI_COMM_WORLD_SIZE"] = "2";
  env["OMPI_COMM_WORLD_RANK"] = "1";
  env["OMPI_COMM_WORLD_LOCAL_SIZE"] = "1";
  REQUIRE(ApplySchedulerEnvironment(env, &cfg).ok());
  CHECK(cfg.machine_rank == 1);
  CHECK(cfg.main_process_ip == "c3");
  CHECK(cfg.origins["main_process_ip"].ToString() == "environment SLURM_JOB_NODELIST");
  CHECK(cfg.nproc_per_node == "1");
}

TEST_CASE("MpichPmiVariables") {
  LaunchConfig cfg;
  Env env = {{"PMI_SIZE", "3"}, {"PMI_RANK", "2"}, {"MPI_LOCALNRANKS", "3"}};
  REQUIRE(ApplySchedulerEnvironment(env, &cfg).ok());
  CHECK(cfg.min_nodes == 3);
  CHECK(cfg.machine_rank == 2);
  CHECK(cfg.origins["machine_rank"].ToString() == "environment PMI_RANK");

  LaunchConfig broken;
  Status s = ApplySchedulerEnvironment({{"PMI_SIZE", "3"}}, &broken);
  CHECK(s.code() == Status::Code::kInvalidConfig);
  CHECK(s.message().find("PMI_RANK") != std::string::npos);
}

TEST_CASE("MalformedRankNamesTheVariable") {
  LaunchConfig cfg;
  Status s = ApplySchedulerEnvironment(
      {{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "one"}}, &cfg);
  CHECK(s.code() == Status::Code::kInvalidConfig);
  CHECK(s.message().find("OMPI_COMM_WORLD_RANK") != std::string::npos);
}

TEST_CASE("NoSchedulerChangesNothing") {
  LaunchConfig cfg;
  REQUIRE(ApplySchedulerEnvironment({{"HOME", "/root"}, {"PATH", "/bin"}}, &cfg).ok());
  CHECK(cfg.origins.empty());
  CHECK(cfg.warnings.empty());
}

// accelerate's own files, as `accelerate config` writes them, load unchanged.
TEST_CASE("RealAccelerateDefaultConfigLoads") {
  LaunchConfig cfg;
  Status s = LoadYamlString(
      "compute_environment: LOCAL_MACHINE\n"
      "debug: false\n"
      "distributed_type: MULTI_GPU\n"
      "downcast_bf16: 'no'\n"
      "enable_cpu_affinity: false\n"
      "gpu_ids: all\n"
      "machine_rank: 0\n"
      "main_process_ip: 10.22.4.87\n"
      "main_process_port: 8002\n"
      "main_training_function: main\n"
      "mixed_precision: bf16\n"
      "num_machines: 2\n"
      "num_processes: 16\n"
      "rdzv_backend: static\n"
      "same_network: true\n"
      "tpu_env: []\n"
      "tpu_use_cluster: false\n"
      "tpu_use_sudo: false\n"
      "use_cpu: false\n",
      "default_config.yaml", &cfg);
  REQUIRE_MESSAGE(s.ok(), (s.ToString()));
  CHECK(cfg.distributed_type == DistributedType::kMultiGpu);
  CHECK(cfg.min_nodes == 2);
  CHECK(cfg.main_process_port == 8002);
  CHECK(cfg.mixed_precision == "bf16");
  REQUIRE(Validate(&cfg).ok());
  CHECK(cfg.nproc_per_node == "8");

  // A single-process file with `main_process_ip: null` keeps the defaults.
  LaunchConfig single;
  s = LoadYamlString(
      "compute_environment: LOCAL_MACHINE\n"
      "deepspeed_config: {}\n"
      "distributed_type: 'NO'\n"
      "fsdp_config: {}\n"
      "machine_rank: 0\n"
      "main_process_ip: null\n"
      "main_process_port: null\n"
      "main_training_function: main\n"
      "mixed_precision: 'no'\n"
      "num_machines: 1\n"
      "num_processes: 1\n"
      "use_cpu: false\n",
      "default_config.yaml", &single);
  REQUIRE_MESSAGE(s.ok(), (s.ToString()));
  CHECK(single.distributed_type == DistributedType::kNo);
  CHECK(single.main_process_ip == "127.0.0.1");
}

}  // namespace
}  // namespace launch::config
