#pragma once

// `launch env`: a plain-text report to paste into bug reports.
//
//   launch env [--config_file FILE | FILE]
//
// Sections: launch (version, binary), system (kernel, distribution, glibc), LibTorch (version,
// library, CUDA/NCCL/Gloo support; found on disk and read from headers and ELF metadata, never
// loaded: `launch` does not link LibTorch), the trainer's own `--version` when `train` sits
// beside `launch`, BLAS (which libblas.so.3 the dynamic linker picks), CPU (model, online and
// usable cores, vector extensions that matter for training), GPUs (through NVML, loaded with
// dlopen when libnvidia-ml.so.1 exists), the scheduler and distributed variables in the
// environment (secrets hidden), and the configuration in effect (FILE, else the default config
// file when it exists) with the origin of every value, as `launch --print_config` shows it.
//
// Every probe degrades to a line saying what was not found; the report never fails for a
// missing component.

#include <string>
#include <vector>

namespace launch::launcher {

// Prints the report to stdout. `args` are the arguments after "env". Returns 0, or 2 for a
// usage error. A config that does not load is reported inside the report (exit status 0).
int RunEnvCommand(const std::vector<std::string>& args);

// The report as text (RunEnvCommand prints it); `config_file` may be empty.
std::string EnvReport(const std::string& config_file);

}  // namespace launch::launcher
