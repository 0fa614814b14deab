#pragma once

// The job description: one plain struct tree, filled in exactly one place (config_loader.cc)
// from defaults, the YAML file, the environment and command-line flags, in that order of
// increasing precedence:   flag > environment > YAML > default.
//
// Every field states its default and meaning. No YAML or CLI types leak past the loader.
// The trainer (trainer_runtime) reads the same structs, so one file describes a whole job.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace launch::config {

// Where a value came from, for `launch --print_config`.
struct Origin {
  enum class Kind { kDefault, kFile, kEnvironment, kFlag, kDerived };
  Kind kind = Kind::kDefault;
  std::string detail;  // "train.yaml:12", "--nproc_per_node", "SLURM_NNODES", ...
  std::string ToString() const;
};

// ---------------------------------------------------------------------------------------------
// The built-in trainer (`train:` section).

enum class ModelType { kMlp, kTransformer, kTorchScript };
enum class DataType { kSynthetic, kCsv, kText };
enum class OptimizerType { kSgd, kAdam, kAdamW };
enum class SchedulerType { kConstant, kLinear, kCosine };
enum class ParallelMode { kNone, kDp, kDdp, kPipeline };
enum class PipelineSchedule { kGPipe, k1F1B };

struct ModelConfig {
  ModelType type = ModelType::kMlp;  // mlp | transformer | torchscript (key `torchscript: PATH`)
  // mlp: layer widths, input first and output last; ReLU between hidden layers.
  std::vector<int64_t> mlp_layers = {32, 256, 256, 10};
  // transformer (causal, character level): `vocab: bytes` means 256 byte tokens.
  int64_t vocab_size = 256;
  int64_t d_model = 128;
  int64_t transformer_layers = 4;  // YAML key `layers` when type is transformer
  int64_t heads = 4;
  int64_t context = 128;  // maximum sequence length
  double dropout = 0.0;
  // torchscript: path of a module saved by torch.jit.save; forward(x) -> logits.
  std::string torchscript_path;
  // pipeline with TorchScript: one module per stage, in order (overrides torchscript_path).
  std::vector<std::string> torchscript_stages;
};

struct DataConfig {
  DataType type = DataType::kSynthetic;
  // synthetic: inputs ~ N(0,1) of width mlp_layers.front(); labels drawn from a fixed random
  // teacher network (its own seed), so the best achievable loss is known.
  int64_t samples = 20000;
  uint64_t teacher_seed = 1234;
  // csv: numeric columns; `label_column` holds the integer class (or regression target).
  std::string path;
  std::string label_column = "label";
  // text: `context` bytes per sample, next-byte prediction (defaults to model.context).
  int64_t context = 0;
};

struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdamW;
  double lr = 3e-4;
  double weight_decay = 0.0;  // adamw: 0.01 unless given
  double momentum = 0.0;      // sgd
  double beta1 = 0.9;         // adam, adamw
  double beta2 = 0.999;
  double eps = 1e-8;
};

struct SchedulerConfig {
  SchedulerType type = SchedulerType::kConstant;
  int64_t warmup_steps = 0;   // linear warm-up from 0 to lr
  double min_lr_ratio = 0.0;  // linear/cosine decay floor, as a fraction of lr
};

struct ParallelConfig {
  // none: each process trains alone (no communication); ddp: one replica per process with
  // bucketed all-reduce; dp: `replicas` replicas inside one process; pipeline: stages.
  ParallelMode mode = ParallelMode::kDdp;
  double bucket_cap_mb = 25.0;  // ddp: gradient bucket size; the first bucket is 1 MB
  int replicas = 2;             // dp: replicas (CPU threads or devices) in one process
  int stages = 1;               // pipeline: processes per pipeline
  int microbatches = 4;         // pipeline: micro-batches per optimizer step
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  std::vector<int64_t> partition;  // pipeline: layers per stage; empty = balance by parameters
  bool loss_in_replica = true;     // dp: compute the loss inside each replica (scalar gather)
};

struct TrainConfig {
  bool present = false;  // true when the YAML has a `train:` section
  uint64_t seed = 42;
  std::string output_dir = "runs/default";  // metrics.jsonl, final.json, checkpoints/
  ModelConfig model;
  DataConfig data;
  double eval_fraction = 0.1;  // held-out share of the data set
  int64_t batch_size = 32;     // per process, per micro-batch
  int64_t max_steps = 0;       // optimizer steps; 0 = run `epochs` epochs
  int64_t epochs = 0;          // used when max_steps is 0 (then at least 1)
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  double max_grad_norm = 0.0;  // 0 = no clipping
  ParallelConfig parallel;
  int gradient_accumulation_steps = 1;
  bool sync_each_batch = false;        // true: all-reduce every micro-batch (no no_sync)
  bool sync_with_dataloader = true;    // the accumulation window also closes at the loader's end
  int local_sgd_steps = 0;             // > 0: no gradient all-reduce; average params every K steps
  int64_t checkpoint_every = 100;      // optimizer steps; 0 = only at the end
  std::string resume = "auto";         // auto | never | PATH of a checkpoint file
  int64_t log_every = 10;              // optimizer steps between plain log lines
  int64_t eval_every = 0;              // optimizer steps between evaluations; 0 = only at the end
  std::string mixed_precision = "no";  // copied from the top level: no | bf16
};

// ---------------------------------------------------------------------------------------------
// Where the job runs (top-level keys; accelerate's names, torchrun's spellings as synonyms).

enum class DistributedType { kAuto, kNo, kMultiCpu, kMultiGpu };

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
  double heartbeat_timeout_s = 5;  // an agent silent this long is declared lost
};

struct LaunchConfig {
  std::string config_path;  // the YAML file in effect; empty when none

  DistributedType distributed_type = DistributedType::kAuto;  // derived from hardware when auto
  // Workers per node: "auto" (GPUs if any, else CPU slots), "gpu", "cpu" or a number.
  // Derived from num_processes / num_machines when only num_processes is given.
  std::string nproc_per_node = "auto";
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
  std::string run_id;  // empty = generated on one node, "default" across nodes
  std::string role = "default";
  int max_restarts = 0;         // whole-group restarts after a failure
  std::string gpu_ids = "all";  // CUDA_VISIBLE_DEVICES for the workers ("all" = leave as is)
  std::string mixed_precision = "no";
  std::string log_dir;                  // per-rank log files under <log_dir>/<run_id>/attempt_<k>/
  StreamSpec tee;                       // streams copied to files and still shown on the console
  StreamSpec redirects;                 // streams sent to files only
  std::vector<int> local_ranks_filter;  // console shows only these local ranks; empty = all
  double stop_grace_s = 30;             // SIGTERM -> SIGKILL grace period for workers
  std::string python = "python3";       // interpreter for .py programs and -m
  bool no_python = false;               // run the program as given (torchrun --no_python)
  bool run_module = false;              // -m: the program is a Python module
  std::vector<std::string> program;     // after `--`, or the trainer command
  std::vector<std::string> extra_args;  // after `--` when a CONFIG with train: is given

  TrainConfig train;

  std::map<std::string, Origin> origins;  // key path -> where its value came from
  std::vector<std::string> warnings;      // e.g. accelerate keys with no meaning here
};

const char* ToString(ModelType v);
const char* ToString(DataType v);
const char* ToString(OptimizerType v);
const char* ToString(SchedulerType v);
const char* ToString(ParallelMode v);
const char* ToString(PipelineSchedule v);
const char* ToString(DistributedType v);

}  // namespace launch::config
