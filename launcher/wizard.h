#pragma once

// `launch config`: the interactive wizard that writes a job's YAML, and `launch config default`,
// which writes a sensible one without questions.
//
//   launch config [--config_file F]                     ask, then write F (or the default path)
//   launch config default [--config_file F] [--force]   write defaults; an existing file is kept
//                                                       unless --force is given
//
// The file is written only after the last answer, atomically (a temporary file in the same
// directory, fsync, rename), so Ctrl-C or a closed terminal leaves no file and no partial file
// behind. What is written always loads with config::LoadYamlFile (checked before writing).
// Keys carry accelerate's names where accelerate has one (its default_config.yaml's);
// nproc_per_node, max_restarts, rdzv_token and `train:` are launch's own. Every key carries a
// comment.

#include <map>
#include <string>
#include <vector>

#include "base/status.h"

namespace launch::launcher {

// $XDG_CONFIG_HOME/launch/default_config.yaml when XDG_CONFIG_HOME is set and absolute, else
// $HOME/.config/launch/default_config.yaml; "" when neither HOME nor XDG_CONFIG_HOME is usable.
// `launch` loads this file when no config is given and it exists.
std::string DefaultConfigPath();
// Same, reading the variables from `env` (for tests).
std::string DefaultConfigPath(const std::map<std::string, std::string>& env);
// Where `launch` looks for a config when none is given, in order: our own default file, then
// accelerate's (`$HF_HOME/accelerate/`, else `$XDG_CACHE_HOME/huggingface/accelerate/`, else
// `~/.cache/huggingface/accelerate/`; default_config.yaml, then the older default_config.json),
// so an accelerate user's `accelerate config` file is used as it is. Empty entries are left out.
std::vector<std::string> DefaultConfigCandidates(const std::map<std::string, std::string>& env);

// Runs `launch config ...`; `args` are the arguments after "config". Returns the exit code:
// 0 written, 1 not written (file exists without --force, I/O error), 2 usage error or no
// terminal on stdin, 130 interrupted (Ctrl-C: nothing written).
int RunConfigCommand(const std::vector<std::string>& args);

// The answers the wizard collects; defaults are what `launch config default` writes.
struct ConfigAnswers {
  enum class Where { kThisMachine, kCluster, kSlurm };
  Where where = Where::kThisMachine;
  bool use_gpu = false;                       // MULTI_GPU (NCCL) instead of MULTI_CPU (Gloo)
  int num_machines = 1;                       // kCluster only; SLURM counts its own nodes
  int machine_rank = 0;                       // kCluster only
  std::string main_process_ip = "127.0.0.1";  // kCluster only; SLURM uses the first node
  int main_process_port = 29500;        // kCluster/kSlurm; a free port is chosen on one machine
  std::string nproc_per_node = "auto";  // "auto" or a number, per machine
  std::string gpu_ids = "all";          // use_gpu only
  std::string mixed_precision = "no";   // no | bf16 | fp16 (fp16 with GPUs only)
  int max_restarts = 0;
  std::string rdzv_token;  // empty: none (or LAUNCH_RDZV_TOKEN at run time)
  // use_gpu without `train:`: how the script's accelerate Accelerator shards the model
  // (distributed_type FSDP or DEEPSPEED); the built-in trainer's own choice is parallel_mode.
  std::string sharding = "none";             // none | fsdp | deepspeed
  std::string fsdp_strategy = "FULL_SHARD";  // fsdp: accelerate's fsdp_sharding_strategy
  int deepspeed_zero_stage = 2;              // deepspeed: 0-3 (accelerate's default 2)

  // The `train:` section, when wanted.
  bool train = false;
  std::string model = "mlp";           // mlp | transformer | torchscript
  std::string torchscript_path;        // model == torchscript
  std::string data = "synthetic";      // synthetic | csv | text
  std::string data_path;               // csv, text: absolute path
  std::string label_column = "label";  // csv
  std::string parallel_mode = "ddp";   // ddp | zero | none | dp | pipeline
  int zero_stage = 1;                  // zero: 1 optimizer state, 2 also gradients, 3 parameters
  int local_sgd_steps = 0;             // ddp: > 0 averages parameters every K optimizer steps
                                       // instead of all-reducing gradients (Local SGD)
  int stages = 2;                      // pipeline
  int microbatches = 4;                // pipeline
  int tensor = 1;                      // transformer: processes each layer is split over
  int gradient_accumulation_steps = 1;
  int batch_size = 32;
  int max_steps = 300;
  std::string output_dir = "runs/launch";
};

// The answers a config file holds, so that running the wizard again on an existing file offers
// its values as defaults. Keys the wizard does not ask about are not carried over (the wizard
// says so before it replaces a file). InvalidConfig when the file does not load.
StatusOr<ConfigAnswers> LoadAnswers(const std::string& path);

// The commented YAML for `answers`.
std::string RenderConfigYaml(const ConfigAnswers& answers);

}  // namespace launch::launcher
