#pragma once

// What `accelerate launch` exports for a script's Accelerator() (accelerate's
// utils/launch.py: prepare_simple_launcher_cmd_env, prepare_multi_gpu_env,
// prepare_deepspeed_cmd_env), computed from the same settings: mixed precision, CPU, debug,
// CPU threads and affinity, torch dynamo, FSDP, DeepSpeed, Megatron-LM, fp8 and the parallelism
// config. accelerate's Accelerator does the sharding; launch only has to tell it what the user
// configured, so a script behaves as it would under `accelerate launch`.
//
// Values are written as accelerate writes them ("True"/"False" for dynamo's switches, lower
// case for FSDP's and DeepSpeed's booleans, the backend upper case). An invalid combination
// accelerate refuses (fsdp_cpu_ram_efficient_loading without fsdp_sync_module_states) is an
// InvalidConfig naming the settings.

#include <map>
#include <string>

#include "base/status.h"
#include "config/launch_config.h"

namespace launch::launcher {

// KEY -> VALUE to add to every worker's environment. `cpu_workers`: the plan runs CPU workers
// (accelerate's ACCELERATE_USE_CPU). `pythonpath`, the PYTHONPATH the workers inherit ("" for
// none), and `cwd`, the working directory ("" when unknown): accelerate puts the working
// directory on DeepSpeed workers' PYTHONPATH. Reads nothing else: no environment, no files.
StatusOr<std::map<std::string, std::string>> AccelerateEnv(const config::LaunchConfig& cfg,
                                                           bool cpu_workers,
                                                           const std::string& pythonpath,
                                                           const std::string& cwd);

}  // namespace launch::launcher
