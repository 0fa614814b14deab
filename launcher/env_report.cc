#include "launcher/env_report.h"

#include <CLI/CLI.hpp>

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <gnu/libc-version.h>
#include <poll.h>
#include <sched.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstring>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>

#include "agent/cgroup.h"
#include "agent/subprocess.h"
#include "base/elf.h"
#include "base/environment.h"
#include "base/exit_code.h"
#include "base/files.h"
#include "base/strings.h"
#include "config/loader.h"
#include "launcher/scheduler_env.h"
#include "launcher/subcommand_args.h"
#include "launcher/wizard.h"

#ifndef LAUNCH_VERSION
#define LAUNCH_VERSION "unknown"
#endif

extern char** environ;

namespace launch::launcher {
namespace {

bool Exists(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0;
}

std::string RealPath(const std::string& path) {
  char buf[PATH_MAX];
  return realpath(path.c_str(), buf) ? std::string(buf) : path;
}

// "key: value" with the values aligned.
std::string Row(const std::string& key, const std::string& value) {
  std::string k = key + ":";
  if (k.size() < 18) k.resize(18, ' ');
  return k + " " + value + "\n";
}

// Where the dynamic linker would find `soname`: LD_LIBRARY_PATH first (a LibTorch unpacked
// from pytorch.org is usually found this way), then the usual system directories. (The ld.so
// cache is not parsed; the directories cover Debian, Fedora and /usr/local installs.)
// "" when not found.
std::string FindLibrary(const std::string& soname) {
  if (const char* ld = std::getenv("LD_LIBRARY_PATH")) {
    for (const std::string& dir : Split(ld, ':')) {
      if (dir.empty()) continue;
      std::string p = dir + "/" + soname;
      if (Exists(p)) return p;
    }
  }
  for (const char* dir :
       {"/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
        "/lib/x86_64-linux-gnu", "/usr/local/lib", "/usr/local/cuda/lib64", "/opt/libtorch/lib"}) {
    std::string p = std::string(dir) + "/" + soname;
    if (Exists(p)) return p;
  }
  return "";
}

bool AnyContains(const std::vector<std::string>& items, const std::string& part) {
  for (const std::string& s : items)
    if (s.find(part) != std::string::npos) return true;
  return false;
}

// Runs `argv` without a shell and returns its stdout+stderr (at most 64 KiB), or "" when it
// cannot be started, fails or does not finish within `timeout`.
std::string Capture(const std::vector<std::string>& argv, std::chrono::milliseconds timeout) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return "";
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 2);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    return "";
  }
  std::string out;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  bool timed_out = false;
  while (out.size() < 65536) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    struct pollfd pfd {
      fds[0], POLLIN, 0
    };
    int r = poll(&pfd, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      timed_out = r == 0;
      break;
    }
    char buf[4096];
    ssize_t n = read(fds[0], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  close(fds[0]);
  if (timed_out) kill(pid, SIGKILL);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return "";
  return out;
}

// ---------------------------------------------------------------------------------------------
// Sections.

std::string SelfPath() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  buf[n] = '\0';
  return buf;
}

std::string OsRelease() {
  for (const std::string& line : Split(ReadSmallFile("/etc/os-release"), '\n')) {
    if (StartsWith(line, "PRETTY_NAME=")) {
      std::string v = line.substr(12);
      if (v.size() >= 2 && v.front() == '"') v = v.substr(1, v.size() - 2);
      return v;
    }
  }
  return "unknown distribution";
}

std::string SystemSection() {
  std::string out;
  struct utsname u {};
  if (uname(&u) == 0)
    out += Row("system", std::string(u.sysname) + " " + u.release + " " + u.machine + ", " +
                             OsRelease() + ", glibc " + gnu_get_libc_version());
  {
    // What keeps a job's processes together (agent/cgroup.h): a probe cgroup, removed at once.
    std::string why_not;
    std::unique_ptr<agent::JobCgroup> probe = agent::JobCgroup::ForThisProcess(&why_not);
    if (probe && !probe->Create(/*exec_shim=*/"", &why_not)) probe.reset();
    out += Row("process containment",
               probe ? "cgroup v2 with cgroup.kill, under " +
                           probe->path().substr(0, probe->path().rfind('/')) + ", and subreaper"
                     : "subreaper only (no job cgroup: " + why_not + ")");
  }
#if defined(__clang__)
  out += Row("compiled with", std::string("clang ") + __clang_version__);
#elif defined(__GNUC__)
  out += Row("compiled with", std::string("GCC ") + __VERSION__);
#endif
  return out;
}

// "1.13.0" from torch/version.h under `include_dir`, or "".
std::string TorchHeaderVersion(const std::string& include_dir) {
  std::string text = ReadSmallFile(include_dir + "/torch/csrc/api/include/torch/version.h", 65536);
  if (text.empty()) return "";
  std::string major, minor, patch;
  for (const std::string& line : Split(text, '\n')) {
    std::vector<std::string> words;
    for (const std::string& w : Split(line, ' '))
      if (!w.empty()) words.push_back(w);
    if (words.size() != 3 || words[0] != "#define") continue;
    if (words[1] == "TORCH_VERSION_MAJOR") major = words[2];
    if (words[1] == "TORCH_VERSION_MINOR") minor = words[2];
    if (words[1] == "TORCH_VERSION_PATCH") patch = words[2];
  }
  if (major.empty() || minor.empty()) return "";
  return major + "." + minor + (patch.empty() ? "" : "." + patch);
}

// What `train --version` says of the trainer beside this launch: its version line and the
// LibTorch library it loaded (its second line), "" where it is not built or says nothing.
struct TrainerVersion {
  std::string path;     // the binary, beside launch
  std::string line;     // "train 0.1.0 (LibTorch 2.6.0, Gloo, NCCL no)"
  std::string library;  // "/usr/lib/x86_64-linux-gnu/libtorch_cpu.so.2.6"
};

TrainerVersion AskTrainer(const std::string& self) {
  TrainerVersion t;
  t.path = Dirname(self) + "/train";
  if (!Exists(t.path)) return t;
  const std::string prefix = "LibTorch library: ";
  for (const std::string& line :
       Split(Capture({t.path, "--version"}, std::chrono::seconds(10)), '\n')) {
    if (line.rfind(prefix, 0) == 0)
      t.library = Trim(line.substr(prefix.size()));
    else if (t.line.empty() && !Trim(line).empty())
      t.line = Trim(line);
  }
  return t;
}

// The LibTorch the trainer runs on when it said (its RUNPATH may name a pip wheel's folder
// that no search below covers), else the one the dynamic loader would find.
std::string TorchSection(const TrainerVersion& trainer) {
  std::string out;
  std::string lib = trainer.library;
  if (lib.empty() || !Exists(lib)) lib = FindLibrary("libtorch_cpu.so");
  if (lib.empty()) lib = FindLibrary("libtorch.so");
  if (lib.empty()) {
    return Row("LibTorch",
               "not found (libtorch_cpu.so is not in the usual directories or "
               "LD_LIBRARY_PATH; the trainer needs it, `launch -- PROGRAM` does not)");
  }
  std::string real = RealPath(lib);
  std::string libdir = Dirname(lib);
  // Headers: beside the library (pytorch.org's libtorch/{lib,include}) or the system's.
  std::string version;
  std::string header_dir;
  for (const std::string& inc : {Dirname(libdir) + "/include", std::string("/usr/include"),
                                 std::string("/usr/local/include")}) {
    version = TorchHeaderVersion(inc);
    if (!version.empty()) {
      header_dir = inc;
      break;
    }
  }
  // The soname's version suffix says which release the library itself is.
  std::string so_version;
  size_t pos = real.find(".so.");
  if (pos != std::string::npos) so_version = real.substr(pos + 4);
  std::string v =
      version.empty() ? "headers not found" : version + " (headers in " + header_dir + ")";
  if (!so_version.empty()) v += ", library " + so_version;
  out += Row("LibTorch", v);
  out += Row("  library", real);
  std::vector<std::string> needed = ElfNeededLibraries(real);
  bool cuda = Exists(libdir + "/libtorch_cuda.so") || AnyContains(needed, "libtorch_cuda") ||
              AnyContains(needed, "libcudart");
  bool gloo = AnyContains(needed, "gloo") ||
              Exists(header_dir + "/torch/csrc/distributed/c10d/ProcessGroupGloo.hpp");
  bool nccl = false;
  if (cuda) {
    std::vector<std::string> cuda_needed =
        ElfNeededLibraries(RealPath(libdir + "/libtorch_cuda.so"));
    nccl = AnyContains(cuda_needed, "nccl") ||
           Exists(header_dir + "/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp");
  }
  out += Row("  backends", std::string("Gloo ") + (gloo ? "yes" : "no") + ", CUDA " +
                               (cuda ? "yes" : "no (CPU-only build)") + ", NCCL " +
                               (nccl ? "yes" : "no"));
  std::string blas;
  for (const std::string& n : needed)
    if (n.find("blas") != std::string::npos || n.find("mkl") != std::string::npos)
      blas += (blas.empty() ? "" : ", ") + n;
  if (!blas.empty()) out += Row("  links BLAS", blas);
  return out;
}

std::string TrainerSection(const TrainerVersion& trainer) {
  if (!Exists(trainer.path)) return Row("trainer", "not built (no " + trainer.path + ")");
  if (trainer.line.empty()) return Row("trainer", trainer.path + " (`train --version` failed)");
  return Row("trainer", trainer.line + ": " + trainer.path);
}

// What a Python worker would run under (the interpreter `launch` resolves for script.py, and
// what chose it), its version and whether it imports torch: accelerate env's "Python version,
// PyTorch version" for the interpreter that matters, the workers'.
std::string PythonSection(const config::LaunchConfig& cfg) {
  auto origin = cfg.origins.find("python");
  const std::string why =
      origin == cfg.origins.end() ? "python3 on PATH" : origin->second.ToString();
  StatusOr<std::string> python = agent::ResolveProgram(cfg.python);
  if (!python.ok())
    return Row("workers' Python", cfg.python + " (" + why + "): " + python.status().message());
  static const char* kProbe =
      "import sys\n"
      "print('Python ' + sys.version.split()[0])\n"
      "for name in ('torch', 'numpy'):\n"
      "    try:\n"
      "        m = __import__(name)\n"
      "        extra = ''\n"
      "        if name == 'torch':\n"
      "            extra = ' (CUDA ' + ('yes' if m.cuda.is_available() else 'no') + ')'\n"
      "        print(name + ' ' + m.__version__ + extra)\n"
      "    except Exception as e:\n"
      "        print(name + ': cannot be imported (' + type(e).__name__ + ': ' + str(e) + ')')\n";
  std::string out = Row("workers' Python", *python + " (" + why + ")");
  std::string probe = Trim(Capture({*python, "-c", kProbe}, std::chrono::seconds(30)));
  if (probe.empty()) return out + "  it did not run (or took over 30 s)\n";
  for (const std::string& line : Split(probe, '\n')) out += "  " + line + "\n";
  return out;
}

std::string BlasSection() {
  std::string lib = FindLibrary("libblas.so.3");
  if (lib.empty()) return Row("BLAS", "libblas.so.3 not found");
  std::string real = RealPath(lib);
  std::string l = ToLower(real);
  std::string kind = "reference BLAS (netlib): slow; install OpenBLAS (libopenblas0-pthread)";
  if (l.find("openblas") != std::string::npos) {
    kind = "OpenBLAS";
    if (l.find("pthread") != std::string::npos) kind += " (pthreads)";
    if (l.find("openmp") != std::string::npos) kind += " (OpenMP)";
    if (l.find("serial") != std::string::npos) kind += " (serial)";
  } else if (l.find("blis") != std::string::npos) {
    kind = "BLIS";
  } else if (l.find("atlas") != std::string::npos) {
    kind = "ATLAS";
  } else if (l.find("mkl") != std::string::npos) {
    kind = "Intel MKL";
  }
  return Row("BLAS", kind + ": " + lib + " -> " + real);
}

std::string CpuSection() {
  std::string model = "unknown";
  std::string flags;
  int processors = 0;
  for (const std::string& line : Split(ReadSmallFile("/proc/cpuinfo", 8 << 20), '\n')) {
    size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = Trim(line.substr(0, colon));
    std::string value = Trim(line.substr(colon + 1));
    if (key == "processor") ++processors;
    if (key == "model name" && model == "unknown") model = value;
    if (key == "flags" && flags.empty()) flags = " " + value + " ";
  }
  cpu_set_t set;
  CPU_ZERO(&set);
  int usable = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : -1;
  long online = sysconf(_SC_NPROCESSORS_ONLN);
  std::string out = Row("CPU", model);
  out += Row("  cores", std::to_string(online) + " online, " + std::to_string(usable) +
                            " usable by this process (affinity)" +
                            (processors ? "" : "; /proc/cpuinfo unreadable"));
  std::vector<std::string> wanted;
  for (const char* f : {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    if (flags.find(std::string(" ") + f + " ") != std::string::npos) wanted.push_back(f);
  if (!flags.empty())
    out += Row("  extensions", wanted.empty() ? "none of avx2/avx512/amx" : Join(wanted, " "));
  for (const std::string& line : Split(ReadSmallFile("/proc/meminfo", 65536), '\n')) {
    if (!StartsWith(line, "MemTotal:")) continue;
    long long kb = 0;
    std::vector<std::string> words;
    for (const std::string& w : Split(line, ' '))
      if (!w.empty()) words.push_back(w);
    if (words.size() >= 2 && ParseInt64(words[1], &kb))
      out += Row("  memory", std::to_string(kb / 1024 / 1024) + " GiB");
  }
  return out;
}

// NVML through dlopen: the driver's library, present wherever an NVIDIA driver is installed.
std::string GpuSection() {
  void* nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!nvml) {
    bool device_nodes = Exists("/dev/nvidia0");
    return Row("GPUs", std::string("none found (libnvidia-ml.so.1 is not installed") +
                           (device_nodes ? ", although /dev/nvidia0 exists)" : ")"));
  }
  using NvmlDevice = void*;
  struct NvmlMemory {
    unsigned long long total, free, used;
  };
  using InitFn = int (*)();
  using CountFn = int (*)(unsigned int*);
  using HandleFn = int (*)(unsigned int, NvmlDevice*);
  using NameFn = int (*)(NvmlDevice, char*, unsigned int);
  using MemoryFn = int (*)(NvmlDevice, NvmlMemory*);
  using DriverFn = int (*)(char*, unsigned int);
  using CudaFn = int (*)(int*);
  auto init = reinterpret_cast<InitFn>(dlsym(nvml, "nvmlInit_v2"));
  auto shutdown = reinterpret_cast<InitFn>(dlsym(nvml, "nvmlShutdown"));
  auto count_fn = reinterpret_cast<CountFn>(dlsym(nvml, "nvmlDeviceGetCount_v2"));
  auto handle_fn = reinterpret_cast<HandleFn>(dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2"));
  auto name_fn = reinterpret_cast<NameFn>(dlsym(nvml, "nvmlDeviceGetName"));
  auto memory_fn = reinterpret_cast<MemoryFn>(dlsym(nvml, "nvmlDeviceGetMemoryInfo"));
  auto driver_fn = reinterpret_cast<DriverFn>(dlsym(nvml, "nvmlSystemGetDriverVersion"));
  auto cuda_fn = reinterpret_cast<CudaFn>(dlsym(nvml, "nvmlSystemGetCudaDriverVersion"));
  std::string out;
  if (!init || !count_fn || !handle_fn || init() != 0) {
    dlclose(nvml);
    return Row("GPUs", "libnvidia-ml.so.1 present but NVML did not initialise (driver loaded?)");
  }
  unsigned int count = 0;
  count_fn(&count);
  std::string summary = std::to_string(count) + " NVIDIA GPU" + (count == 1 ? "" : "s");
  char driver[96] = {0};
  if (driver_fn && driver_fn(driver, sizeof(driver)) == 0)
    summary += ", driver " + std::string(driver);
  int cuda = 0;
  if (cuda_fn && cuda_fn(&cuda) == 0)
    summary += ", CUDA " + std::to_string(cuda / 1000) + "." + std::to_string(cuda % 1000 / 10);
  out += Row("GPUs", summary);
  for (unsigned int i = 0; i < count; ++i) {
    NvmlDevice dev = nullptr;
    if (handle_fn(i, &dev) != 0) continue;
    char name[128] = "?";
    if (name_fn) name_fn(dev, name, sizeof(name));
    std::string line = std::string(name);
    NvmlMemory mem{};
    if (memory_fn && memory_fn(dev, &mem) == 0)
      line += ", " + std::to_string(mem.total >> 20) + " MiB (" + std::to_string(mem.used >> 20) +
              " MiB used)";
    out += Row("  " + std::to_string(i), line);
  }
  if (shutdown) shutdown();
  dlclose(nvml);
  return out;
}

bool IsReportedVariable(const std::string& name) {
  static const std::set<std::string> exact = {"CUDA_VISIBLE_DEVICES",
                                              "CUDA_DEVICE_ORDER",
                                              "OMP_NUM_THREADS",
                                              "MASTER_ADDR",
                                              "MASTER_PORT",
                                              "RANK",
                                              "LOCAL_RANK",
                                              "WORLD_SIZE",
                                              "LOCAL_WORLD_SIZE",
                                              "LD_LIBRARY_PATH",
                                              "XDG_CONFIG_HOME",
                                              "XDG_CACHE_HOME",
                                              "HF_HOME",  // where accelerate's config is
                                              "VIRTUAL_ENV",
                                              "CONDA_PREFIX",
                                              "PYTHON_EXEC",
                                              "PYTHONPATH",
                                              "PYTHONUNBUFFERED",
                                              "LD_PRELOAD",
                                              "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                              "PMI_RANK",
                                              "PMI_SIZE",
                                              "OPENBLAS_NUM_THREADS",
                                              "MKL_NUM_THREADS"};
  if (exact.count(name)) return true;
  for (const char* prefix :
       {"LAUNCH_", "PET_", "TORCHELASTIC_", "ACCELERATE_", "NCCL_", "GLOO_", "SLURM_JOB_ID",
        "SLURM_JOB_NODELIST", "SLURM_STEP_", "SLURM_NNODES", "SLURM_NODEID", "SLURM_PROCID",
        "SLURM_NTASKS", "SLURM_GPUS", "SLURM_CPUS_ON_NODE", "OMPI_COMM_WORLD_"})
    if (StartsWith(name, prefix)) return true;
  return false;
}

std::string EnvironmentSection(const std::map<std::string, std::string>& env) {
  std::string out;
  for (const auto& [name, value] : env) {
    if (!IsReportedVariable(name)) continue;
    std::string upper = name;
    for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    bool secret = upper.find("TOKEN") != std::string::npos ||
                  upper.find("SECRET") != std::string::npos ||
                  upper.find("PASSWORD") != std::string::npos;
    out += "  " + name + "=" + (secret ? "(set, hidden)" : value) + "\n";
  }
  return out.empty() ? "  (none of the variables launch, SLURM, MPI, CUDA or NCCL read)\n" : out;
}

// The configuration `launch` would run with here: the file given, else the first default file
// that exists (launch's, then accelerate's, as `launch` itself picks), then the environment.
struct LoadedConfig {
  std::string header;  // the "config file:" line, and any load error or warning
  config::LaunchConfig cfg;
};

LoadedConfig LoadConfig(const std::string& given, const std::map<std::string, std::string>& env) {
  LoadedConfig out;
  std::string path = given;
  std::string why = "given on the command line";
  if (path.empty()) {
    const std::vector<std::string> candidates = DefaultConfigCandidates(env);
    for (size_t i = 0; i < candidates.size() && path.empty(); ++i) {
      if (!Exists(candidates[i])) continue;
      path = candidates[i];
      why = i == 0 ? "launch's default config file"
                   : "accelerate's default config file, which launch uses when it has none";
    }
    if (path.empty())
      why = "none: no config given and no default config file (" +
            (candidates.empty() ? std::string("HOME unset") : Join(candidates, ", ")) + ")";
  }
  out.header = Row("config file", path.empty() ? why : path + " (" + why + ")");
  Status s = Status::Ok();
  if (!path.empty()) s = config::LoadYamlFile(path, &out.cfg);
  if (s.ok()) s = config::ApplyEnvironment(env, &out.cfg);
  if (s.ok()) s = config::ApplySchedulerEnvironment(env, &out.cfg);
  if (s.ok()) s = config::Validate(&out.cfg);
  if (!s.ok()) out.header += "  the config does not load: " + s.message() + "\n";
  for (const std::string& w : out.cfg.warnings) out.header += "  warning: " + w + "\n";
  return out;
}

}  // namespace

std::string EnvReport(const std::string& config_file) {
  std::map<std::string, std::string> env = CurrentEnvironment();
  std::string self = SelfPath();
  std::string out = "# launch env: paste this into bug reports\n";
  out += Row("launch", std::string(LAUNCH_VERSION) + " (" + (self.empty() ? "?" : self) + ")");
  out += SystemSection();
  const TrainerVersion trainer = AskTrainer(self);
  out += TorchSection(trainer);
  out += TrainerSection(trainer);
  LoadedConfig loaded = LoadConfig(config_file, env);
  out += PythonSection(loaded.cfg);
  out += BlasSection();
  out += CpuSection();
  out += GpuSection();
  out += "environment:\n" + EnvironmentSection(env);
  out += loaded.header + "\n" + config::FormatConfig(loaded.cfg);
  return out;
}

int RunEnvCommand(const std::vector<std::string>& args) {
  std::string config_file, positional;
  CLI::App app{
      "Prints launch's version, LibTorch and its backends, BLAS, CPU and GPUs, the relevant\n"
      "environment variables and the configuration in effect (FILE, else the default config\n"
      "file) with where each value comes from. Paste it into bug reports.",
      "launch env"};
  app.add_option("--config_file,--config-file", config_file, "the config to report");
  app.add_option("file", positional, "the same, as an argument");
  if (int rc = ParseSubcommandArgs(app, "env", args); rc >= 0) return rc;
  if (config_file.empty()) config_file = positional;
  std::cout << EnvReport(config_file) << std::flush;
  return kExitOk;
}

}  // namespace launch::launcher
