#include "launcher/launcher.h"
#include "launcher/ssh_head.h"

#include <csignal>
#include <cstdlib>
#include <filesystem>

#include "base/files.h"

#include <doctest/doctest.h>

namespace launch::launcher {
namespace {

struct Parsed {
  Status status;
  config::LaunchConfig cfg;
  bool print = false;
  bool exit_now = false;
};

Parsed Parse(std::vector<std::string> args) {
  // Never pick up the user's ~/.config/launch/default_config.yaml.
  setenv("XDG_CONFIG_HOME", "/nonexistent/launch-test", 1);
  Parsed p;
  StatusOr<CommandLine> cl = ParseCommandLine(args);
  p.status = cl.status();
  if (cl.ok()) {
    p.cfg = cl->cfg;
    p.print = cl->action == CommandLine::Action::kPrintConfig;
    p.exit_now = cl->action == CommandLine::Action::kPrint;
  }
  return p;
}

TEST_CASE("BothSpellingsOfEveryFlag") {
  Parsed a = Parse({"--nproc-per-node", "3", "--max-restarts", "2", "--", "true"});
  REQUIRE(a.status.ok());
  CHECK(a.cfg.nproc_per_node == "3");
  CHECK(a.cfg.max_restarts == 2);
  Parsed b = Parse({"--nproc_per_node", "3", "--node_rank", "0", "--", "true"});
  REQUIRE(b.status.ok());
  CHECK(b.cfg.nproc_per_node == "3");
  CHECK(b.cfg.origins["nproc_per_node"].ToString() == "flag --nproc_per_node");
}

TEST_CASE("ProgramAfterDashDashKeepsItsOwnFlags") {
  Parsed p = Parse({"--nproc_per_node", "2", "--", "prog", "--nproc_per_node", "9", "-x"});
  REQUIRE(p.status.ok());
  CHECK(p.cfg.program == std::vector<std::string>{"prog", "--nproc_per_node", "9", "-x"});
  CHECK(p.cfg.nproc_per_node == "2");
}

TEST_CASE("TorchrunStyleScriptWithoutDashDash") {
  Parsed p = Parse({"--nproc_per_node", "2", "train.py", "--lr", "0.1"});
  REQUIRE(p.status.ok());
  CHECK(p.cfg.program == std::vector<std::string>{"train.py", "--lr", "0.1"});
}

TEST_CASE("UnknownFlagSuggestsTheNearestOne") {
  Parsed p = Parse({"--nprocs", "2", "--", "true"});
  CHECK(p.status.code() == Status::Code::kInvalidConfig);
  CHECK(p.status.message() ==
        "unknown flag '--nprocs' (did you mean '--nproc_per_node'?); see launch --help");
}

TEST_CASE("RdzvConfPairs") {
  Parsed p = Parse({"--rdzv_conf", "join_timeout=5,last_call_timeout=0.5", "--", "true"});
  REQUIRE(p.status.ok());
  CHECK(p.cfg.rdzv_conf.join_timeout_s == 5);
  CHECK(p.cfg.rdzv_conf.last_call_timeout_s == 0.5);
  Parsed bad = Parse({"--rdzv_conf", "join_timout=5", "--", "true"});
  CHECK(bad.status.message() ==
        "--rdzv_conf: unknown key 'join_timout' (did you mean 'join_timeout'?)");
}

// Fake machines for the planner: it probes nothing itself.
const HostFacts kCpuHost{/*cpu_slots=*/6, /*gpus=*/0};
const HostFacts kGpuHost{/*cpu_slots=*/32, /*gpus=*/4};

// The machine as a test describes it (ninja's VirtualFileSystem): it binds no port, searches no
// PATH and reads no file, and counts the ports it was asked for.
class FakePlanSystem : public PlanSystem {
 public:
  std::map<std::string, std::string> programs;  // name -> path; a name with '/' runs as given
  std::map<std::string, FileFacts> files;       // others do not exist
  std::map<std::string, std::string> contents;  // for ReadRegularFile
  std::map<std::string, std::vector<std::string>> needed;  // ELF dependencies
  std::string cwd = "/fake/cwd";
  int next_port = 41000;
  int ports_picked = 0;

  StatusOr<std::string> ResolveProgram(const std::string& program) override {
    auto it = programs.find(program);
    if (it != programs.end()) return it->second;
    if (program.find('/') != std::string::npos) return program;
    return Status::NotFound("'" + program + "' was not found on PATH");
  }
  StatusOr<int> PickFreePort(const std::string&) override {
    ++ports_picked;
    return next_port++;
  }
  FileFacts Inspect(const std::string& path) override {
    auto it = files.find(path);
    return it == files.end() ? FileFacts{} : it->second;
  }
  StatusOr<std::string> ReadRegularFile(const std::string& path, size_t) override {
    auto it = contents.find(path);
    if (it == contents.end()) return Status::NotFound(path + ": no such file");
    return it->second;
  }
  std::vector<std::string> ElfNeededLibraries(const std::string& path) override {
    auto it = needed.find(path);
    return it == needed.end() ? std::vector<std::string>{} : it->second;
  }
  std::string CurrentDir() override { return cwd; }
  std::string HostName() override { return "fakehost"; }
  std::string NewRunId() override { return "fake-run"; }
};

// For the cases that plan against this machine's files and PATH.
RealPlanSystem real;

StatusOr<Plan> PlanFor(std::vector<std::string> args, const HostFacts& host,
                       const std::map<std::string, std::string>& env = {}) {
  args.insert(args.end(), {"--", "/bin/true"});
  Parsed p = Parse(args);
  REQUIRE(p.status.ok());
  FakePlanSystem fake;
  return MakePlan(p.cfg, "/nonexistent", host, env, fake);
}

TEST_CASE("PlanCountsWorkersFromHostFactsAndTheEnvironment") {
  CHECK(PlanFor({"--nproc_per_node", "auto"}, kCpuHost)->nproc_per_node == 6);
  CHECK(PlanFor({"--nproc_per_node", "auto"}, kCpuHost)->device_kind == "cpu");
  CHECK(PlanFor({"--nproc_per_node", "auto"}, kGpuHost)->nproc_per_node == 4);
  CHECK(PlanFor({"--nproc_per_node", "auto"}, kGpuHost)->device_kind == "gpu");
  CHECK(PlanFor({"--nproc_per_node", "cpu"}, kGpuHost)->nproc_per_node == 32);
  CHECK(PlanFor({"--nproc_per_node", "gpu"}, kGpuHost)->nproc_per_node == 4);
  // CUDA_VISIBLE_DEVICES narrows what CUDA shows the workers, as torch counts.
  CHECK(PlanFor({"--nproc_per_node", "gpu"}, kGpuHost, {{"CUDA_VISIBLE_DEVICES", "2,0"}})
            ->nproc_per_node == 2);
  CHECK(PlanFor({"--nproc_per_node", "gpu"}, kGpuHost, {{"CUDA_VISIBLE_DEVICES", ""}})
            .status()
            .message()
            .find("nproc_per_node gpu: no GPU is visible (CUDA_VISIBLE_DEVICES='')") !=
        std::string::npos);
  CHECK(PlanFor({"--nproc_per_node", "gpu"}, kCpuHost).status().message().find("NVML finds none") !=
        std::string::npos);
  CHECK(PlanFor({"--gpu_ids", "1,3", "--nproc_per_node", "gpu"}, kGpuHost)->nproc_per_node == 2);
  CHECK(PlanFor({"--cpu", "--nproc_per_node", "auto"}, kGpuHost)->nproc_per_node == 32);
  // One thread per worker unless the user chose; GPU workers get NCCL's error handling.
  StatusOr<Plan> gpu = PlanFor({"--nproc_per_node", "2"}, kGpuHost);
  CHECK(gpu->extra_env.at("OMP_NUM_THREADS") == "1");
  CHECK(gpu->extra_env.at("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1");
  StatusOr<Plan> own = PlanFor({"--nproc_per_node", "2"}, kGpuHost,
                               {{"OMP_NUM_THREADS", "4"}, {"NCCL_ASYNC_ERROR_HANDLING", "0"}});
  CHECK(own->extra_env.count("OMP_NUM_THREADS") == 0);
  CHECK(own->extra_env.count("TORCH_NCCL_ASYNC_ERROR_HANDLING") == 0);
  CHECK(PlanFor({"--nproc_per_node", "1"}, kCpuHost)->extra_env.count("OMP_NUM_THREADS") == 0);
}

TEST_CASE("PlanAsksTheMachineOnlyThroughItsSystem") {
  FakePlanSystem fake;
  const FileFacts script{/*regular=*/true, /*readable=*/true, /*executable=*/false};
  const FileFacts library{/*regular=*/true, /*readable=*/true, /*executable=*/true};
  const std::string bin = "/inst/bin";
  const std::string linebuf = bin + "/" + LAUNCH_LINEBUF_FROM_BIN;
  fake.programs["mytool"] = "/opt/tools/mytool";
  fake.files[linebuf] = library;
  // An environment whose PATH holds nothing: the program is found by the fake alone.
  const std::map<std::string, std::string> env = {{"PATH", "/nonexistent"}};
  Parsed p = Parse({"--nproc_per_node", "2", "--", "mytool", "--x"});
  REQUIRE(p.status.ok());
  StatusOr<Plan> plan = MakePlan(p.cfg, bin, kCpuHost, env, fake);
  REQUIRE(plan.ok());
  CHECK(plan->argv == std::vector<std::string>{"/opt/tools/mytool", "--x"});
  CHECK(plan->master_port == 41000);
  CHECK(fake.ports_picked == 1);
  CHECK(plan->run_id == "fake-run");
  CHECK(plan->extra_env.at("LD_PRELOAD") == linebuf);
  // A program built with a sanitizer's shared runtime keeps its own buffering.
  fake.needed["/opt/tools/mytool"] = {"libasan.so.8", "libc.so.6"};
  CHECK(MakePlan(p.cfg, bin, kCpuHost, env, fake)->extra_env.count("LD_PRELOAD") == 0);
  // A given port is not picked.
  Parsed port = Parse({"--main_process_port", "29600", "--", "mytool"});
  REQUIRE(port.status.ok());
  CHECK(MakePlan(port.cfg, bin, kCpuHost, env, fake)->master_port == 29600);
  CHECK(fake.ports_picked == 2);
  // A file that is not executable runs under the interpreter, with the shim first on its path.
  const std::string shim =
      std::filesystem::path(bin + "/" + LAUNCH_PYTHON_SHIM_FROM_BIN).lexically_normal();
  fake.files["/job/run"] = script;
  fake.files[shim + "/sitecustomize.py"] = script;
  Parsed py = Parse({"--python", "/venv/bin/python", "/job/run"});
  REQUIRE(py.status.ok());
  plan = MakePlan(py.cfg, bin, kCpuHost, {{"PYTHONPATH", "/mine"}}, fake);
  REQUIRE(plan.ok());
  CHECK(plan->argv == std::vector<std::string>{"/venv/bin/python", "-u", "/job/run"});
  CHECK(plan->extra_env.at("PYTHONPATH") == shim + ":/mine");
  // Not on the fake PATH: refused, as on a machine without it.
  Parsed missing = Parse({"--", "othertool"});
  REQUIRE(missing.status.ok());
  CHECK(MakePlan(missing.cfg, bin, kCpuHost, env, fake).status().message() ==
        "cannot run the program: 'othertool' was not found on PATH");
  // Several machines: the run id hashes the script's content, as the fake gives it.
  Parsed multi = Parse(
      {"--num_machines", "2", "--machine_rank", "0", "--python", "/venv/bin/python", "/job/run"});
  REQUIRE(multi.status.ok());
  fake.contents["/job/run"] = "print(1)";
  StatusOr<Plan> first = MakePlan(multi.cfg, bin, kCpuHost, env, fake);
  fake.contents["/job/run"] = "print(2)";
  StatusOr<Plan> second = MakePlan(multi.cfg, bin, kCpuHost, env, fake);
  REQUIRE(first.ok());
  REQUIRE(second.ok());
  CHECK(first->run_id.rfind("job-", 0) == 0);
  CHECK(first->run_id != second->run_id);
}

TEST_CASE("PlanRefusesMoreGpuWorkersThanVisibleGpus") {
  const HostFacts one_gpu{/*cpu_slots=*/8, /*gpus=*/1};
  const HostFacts two_gpus{/*cpu_slots=*/8, /*gpus=*/2};
  // accelerate's `--multi_gpu --num_processes 2` on one GPU: the second worker would land on
  // the CPU and hang the first collective.
  StatusOr<Plan> refused = PlanFor({"--multi_gpu", "--num_processes", "2"}, one_gpu);
  CHECK(refused.status().code() == Status::Code::kInvalidConfig);
  CHECK(refused.status().message() ==
        "flag --num_processes: 2 processes per machine, but 1 GPU is visible here "
        "(CUDA_VISIBLE_DEVICES is unset) and a GPU job runs one process per GPU; give "
        "--num_processes 1, or --cpu for CPU processes");
  // torchrun's spelling, without --multi_gpu: the workers are GPU workers all the same.
  CHECK(PlanFor({"--nproc_per_node", "3"}, two_gpus)
            .status()
            .message()
            .find("flag --nproc_per_node: 3 processes per machine, but 2 GPUs are visible here") ==
        0);
  // As many workers as GPUs is fine.
  StatusOr<Plan> fits = PlanFor({"--multi_gpu", "--num_processes", "2"}, two_gpus);
  REQUIRE(fits.ok());
  CHECK(fits->nproc_per_node == 2);
  CHECK(fits->device_kind == "gpu");
  // CUDA_VISIBLE_DEVICES narrows what counts, and the message names it.
  CHECK(PlanFor({"--nproc_per_node", "2"}, two_gpus, {{"CUDA_VISIBLE_DEVICES", "1"}})
            .status()
            .message()
            .find("but 1 GPU is visible here (CUDA_VISIBLE_DEVICES='1')") != std::string::npos);
  CHECK(PlanFor({"--gpu_ids", "0", "--nproc_per_node", "2"}, two_gpus)
            .status()
            .message()
            .find("(CUDA_VISIBLE_DEVICES is unset, gpu_ids '0')") != std::string::npos);
  // Several machines: num_processes counts all of them.
  CHECK(PlanFor({"--num_machines", "2", "--machine_rank", "0", "--num_processes", "4"}, one_gpu)
            .status()
            .message()
            .find("give --num_processes 2 (1 per machine), or --cpu") != std::string::npos);
  // CUDA_VISIBLE_DEVICES="" hides every GPU: CPU workers, as on a machine without any.
  StatusOr<Plan> hidden =
      PlanFor({"--multi_gpu", "--num_processes", "2"}, two_gpus, {{"CUDA_VISIBLE_DEVICES", ""}});
  REQUIRE(hidden.ok());
  CHECK(hidden->device_kind == "cpu");
  CHECK(hidden->nproc_per_node == 2);
  // --cpu asks for CPU workers, whatever the GPUs.
  StatusOr<Plan> cpu = PlanFor({"--cpu", "--num_processes", "2"}, one_gpu);
  REQUIRE(cpu.ok());
  CHECK(cpu->device_kind == "cpu");
  CHECK(cpu->nproc_per_node == 2);
  // No GPU at all: CPU workers, as many as asked, as before.
  StatusOr<Plan> none = PlanFor({"--multi_gpu", "--num_processes", "4"}, kCpuHost);
  REQUIRE(none.ok());
  CHECK(none->device_kind == "cpu");
  CHECK(none->nproc_per_node == 4);
}

TEST_CASE("PlanResolvesPythonScriptsAndWorkerCount") {
  Parsed p = Parse({"--nproc_per_node", "3", "--python", "/bin/sh", "x.py", "arg"});
  REQUIRE(p.status.ok());
  StatusOr<Plan> plan = MakePlan(p.cfg, "/nonexistent", kCpuHost, {}, real);
  REQUIRE(plan.ok());
  CHECK(plan->nproc_per_node == 3);
  // -u: unbuffered, as torchrun runs Python workers.
  CHECK(plan->argv == std::vector<std::string>{"/bin/sh", "-u", "x.py", "arg"});
  CHECK(plan->master_port > 0);
  CHECK(plan->extra_env.at("OMP_NUM_THREADS") == "1");  // 3 workers x all cores would thrash
}

TEST_CASE("PlanLogStreams") {
  Parsed p = Parse({"--nproc_per_node", "2", "--redirects", "0:3", "--tee", "1",
                    "--local_ranks_filter", "1", "--", "/bin/true"});
  REQUIRE(p.status.ok());
  StatusOr<Plan> plan = MakePlan(p.cfg, "/nonexistent", kCpuHost, {}, real);
  REQUIRE(plan.ok());
  CHECK(plan->file_streams == std::vector<int>{3, 1});
  CHECK(plan->console_streams == std::vector<int>{0, 3});
  CHECK(plan->log_root.empty());  // a private directory, made when the job starts
  CHECK(plan->private_log_parent.find("/launch-logs-XXXXXX") != std::string::npos);
}

TEST_CASE("PlanRejectsMissingPrograms") {
  Parsed p = Parse({"--", "definitely-not-a-program-xyz"});
  REQUIRE(p.status.ok());
  StatusOr<Plan> plan = MakePlan(p.cfg, "/nonexistent", kCpuHost, {}, real);
  CHECK(plan.status().message() ==
        "cannot run the program: 'definitely-not-a-program-xyz' was not found on PATH");
  Parsed none = Parse({});
  REQUIRE(none.status.ok());
  CHECK(MakePlan(none.cfg, "/x", kCpuHost, {}, real).status().message().find("nothing to run") ==
        0);
}

// A bin/ folder with the preload library where the launcher looks for it.
std::string FakeInstall() {
  char templ[] = "/tmp/launch-plan-test-XXXXXX";
  REQUIRE(mkdtemp(templ) != nullptr);
  std::string bin = std::string(templ) + "/bin";
  const std::string lib = bin + "/" + LAUNCH_LINEBUF_FROM_BIN;
  REQUIRE(MakeDirs(bin).ok());
  REQUIRE(WriteFileAtomically(lib, "").ok());
  return bin;
}

TEST_CASE("PlanMakesWorkerOutputLive") {
  const std::string bin = FakeInstall();
  const std::string lib = bin + "/" + LAUNCH_LINEBUF_FROM_BIN;
  Parsed c = Parse({"--", "/bin/true"});
  REQUIRE(c.status.ok());
  StatusOr<Plan> plan = MakePlan(c.cfg, bin, kCpuHost, {}, real);
  REQUIRE(plan.ok());
  CHECK(plan->extra_env.at("LD_PRELOAD") == lib);
  CHECK(plan->extra_env.at("PYTHONUNBUFFERED") == "1");
  CHECK(plan->python.empty());
  // The user's preload stays, and theirs comes first; their PYTHONUNBUFFERED is theirs.
  plan = MakePlan(c.cfg, bin, kCpuHost, {{"LD_PRELOAD", "/x/libmine.so"}, {"PYTHONUNBUFFERED", ""}},
                  real);
  REQUIRE(plan.ok());
  CHECK(plan->extra_env.at("LD_PRELOAD") == "/x/libmine.so " + lib);
  CHECK(plan->extra_env.count("PYTHONUNBUFFERED") == 0);
  // Python reads neither C stdio nor the preload: -u and the variable do it.
  Parsed py = Parse({"--python", "/bin/sh", "x.py"});
  REQUIRE(py.status.ok());
  plan = MakePlan(py.cfg, bin, kCpuHost, {}, real);
  REQUIRE(plan.ok());
  CHECK(plan->extra_env.count("LD_PRELOAD") == 0);
  CHECK(plan->python == "/bin/sh");
  CHECK(plan->python_origin == "flag --python");
  // Turned off: nothing is added.
  Parsed off = Parse({"--line_buffered", "false", "--", "/bin/true"});
  REQUIRE(off.status.ok());
  plan = MakePlan(off.cfg, bin, kCpuHost, {}, real);
  REQUIRE(plan.ok());
  CHECK(plan->extra_env.count("LD_PRELOAD") == 0);
  CHECK(plan->extra_env.count("PYTHONUNBUFFERED") == 0);
  // No library where the launcher looks (a partial install): no preload, and no ld.so warning
  // in every worker.
  plan = MakePlan(c.cfg, "/nonexistent", kCpuHost, {}, real);
  REQUIRE(plan.ok());
  CHECK(plan->extra_env.count("LD_PRELOAD") == 0);
}

TEST_CASE("PlanPutsThePythonShimFirstOnPythonWorkersPath") {
  const std::string bin = FakeInstall();
  const std::string shim =
      std::filesystem::path(bin + "/" + LAUNCH_PYTHON_SHIM_FROM_BIN).lexically_normal();
  REQUIRE(MakeDirs(shim).ok());
  REQUIRE(WriteFileAtomically(shim + "/sitecustomize.py", "").ok());
  Parsed py = Parse({"--python", "/bin/sh", "x.py"});
  REQUIRE(py.status.ok());
  StatusOr<Plan> plan = MakePlan(py.cfg, bin, kCpuHost, {}, real);
  REQUIRE(plan.ok());
  CHECK(plan->extra_env.at("PYTHONPATH") == shim);
  // The user's path follows it (their sitecustomize is chained by the shim).
  plan = MakePlan(py.cfg, bin, kCpuHost, {{"PYTHONPATH", "/mine:/other"}}, real);
  REQUIRE(plan.ok());
  CHECK(plan->extra_env.at("PYTHONPATH") == shim + ":/mine:/other");
  // `-- python3 x.py` is a Python worker too; a program that is not is left alone.
  Parsed given = Parse({"--", "/usr/bin/python3", "x.py"});
  REQUIRE(given.status.ok());
  CHECK(MakePlan(given.cfg, bin, kCpuHost, {}, real)->extra_env.at("PYTHONPATH") == shim);
  Parsed other = Parse({"--", "/bin/true"});
  REQUIRE(other.status.ok());
  CHECK(MakePlan(other.cfg, bin, kCpuHost, {}, real)->extra_env.count("PYTHONPATH") == 0);
  // Off, or not installed: PYTHONPATH stays as inherited.
  Parsed off = Parse({"--python_shim", "false", "--python", "/bin/sh", "x.py"});
  REQUIRE(off.status.ok());
  CHECK(MakePlan(off.cfg, bin, kCpuHost, {}, real)->extra_env.count("PYTHONPATH") == 0);
  CHECK(MakePlan(py.cfg, "/nonexistent", kCpuHost, {}, real)->extra_env.count("PYTHONPATH") == 0);
}

TEST_CASE("PlanNamesTheInterpreterAndWhatChoseIt") {
  Parsed p = Parse({"x.py"});
  REQUIRE(p.status.ok());
  p.cfg.python = "/bin/sh";  // as the default python3 would resolve
  p.cfg.origins.erase("python");
  StatusOr<Plan> plan = MakePlan(p.cfg, "/nonexistent", kCpuHost, {}, real);
  REQUIRE(plan.ok());
  CHECK(plan->python_origin == "python3 on PATH");
  // `-- python3 x.py`: the program is the interpreter.
  Parsed given = Parse({"--", "/bin/sh", "x.py"});
  REQUIRE(given.status.ok());
  CHECK(MakePlan(given.cfg, "/nonexistent", kCpuHost, {}, real)->python.empty());
  p.cfg.python = "/nonexistent/venv/bin/python";
  p.cfg.origins["python"] = config::Origin{config::Origin::Kind::kEnvironment, "VIRTUAL_ENV"};
  plan = MakePlan(p.cfg, "/nonexistent", kCpuHost, {}, real);
  CHECK(plan.status().message().find("cannot run the Python interpreter (python: "
                                     "/nonexistent/venv/bin/python, environment VIRTUAL_ENV)") ==
        0);
  CHECK(plan.status().message().find("--python PATH (or PYTHON_EXEC)") != std::string::npos);
}

}  // namespace
}  // namespace launch::launcher

namespace launch::launcher {

TEST_CASE("SshHeadPassesTheTokenOnStdinOnly") {
  HeadJob job;
  job.hosts = {{"a", 2, "h:1"}, {"b", 1, "h:2"}};
  job.args = {"--", "/bin/echo", "it's"};
  job.launch_path = "/opt/launch";
  job.cwd = "/data/job";
  job.master_addr = "a";
  job.run_id = "r";
  job.token = "s3cret";
  job.env = {{"GLOO_SOCKET_IFNAME", "eth0"}};
  std::vector<std::string> argv = SshArgv(job, 1);
  CHECK(argv[argv.size() - 2] == "b");
  CHECK(argv.back() ==
        "cd '/data/job' && exec '/opt/launch' '--head_stdin' '--num_machines' '2' "
        "'--machine_rank' '1' '--nproc_per_node' '1' '--main_process_ip' 'a' "
        "'--main_process_port' '29500' '--run_id' 'r' '--' '/bin/echo' 'it'\\''s'");
  for (const std::string& a : argv) CHECK(a.find("s3cret") == std::string::npos);
  CHECK(HeadMessage(job) == "launch-head 1\nenv GLOO_SOCKET_IFNAME=eth0\ntoken s3cret\nend\n");
}

TEST_CASE("SshHeadForwardsOnlyTheSignalsForWorkersAndReports") {
  CHECK(ForwardedSignalLine(SIGUSR1) == "signal USR1\n");
  CHECK(ForwardedSignalLine(SIGURG) == "signal URG\n");
  for (int signo : {SIGUSR1, SIGUSR2, SIGURG}) {
    std::string line = ForwardedSignalLine(signo);
    line.pop_back();
    CHECK(ForwardedSignal(line) == signo);
  }
  // Stopping is the end of stdin, never a line: the head cannot ask a host to TERM or KILL.
  CHECK(ForwardedSignalLine(SIGTERM).empty());
  CHECK(ForwardedSignalLine(SIGKILL).empty());
  CHECK(ForwardedSignal("signal TERM") == 0);
  CHECK(ForwardedSignal("signal KILL") == 0);
  CHECK(ForwardedSignal("signal USR1 ") == 0);
  CHECK(ForwardedSignal("") == 0);
}

TEST_CASE("EnvFileIsKeyValueLines") {
  auto env = ParseEnvFile("# c\nA=1\nexport B = x=y\n\n", "e");
  REQUIRE(env.ok());
  REQUIRE(env->size() == 2);
  CHECK((*env)[1].first == "B");
  CHECK((*env)[1].second == " x=y");
  env = ParseEnvFile("A=\"x y\"\nB='z'\nC=\"a\"b\"\nD=\"\nE=it's\n", "e");
  REQUIRE(env.ok());
  REQUIRE(env->size() == 5);
  CHECK((*env)[0].second == "x y");
  CHECK((*env)[1].second == "z");
  CHECK((*env)[2].second == "\"a\"b\"");  // inner quotes: kept as written
  CHECK((*env)[3].second == "\"");
  CHECK((*env)[4].second == "it's");
  CHECK(ParseEnvFile("A=1\nnot a line\n", "e").status().message() ==
        "e:2: expected KEY=VALUE, got 'not a line'");
}

}  // namespace launch::launcher
