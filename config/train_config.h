#pragma once

// The trainer's configuration: the `train:` section of a job file, as plain structs with
// documented defaults. Filled by config/loader.h (LoadTrainConfigFile, or as part of a whole
// LaunchConfig), or set in code by a program that links the trainer runtime: both `train` and
// user programs read the same struct, so a YAML section means the same thing to both.
//
// No YAML types and no LibTorch here: this header sits below every module that uses it. Each
// field's YAML key, bounds, doc line and run-identity flag are one row of config/train_keys.cc.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace launch::config {

// Where Debian's dataset-fashion-mnist package installs its four gzipped IDX files.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

enum class ModelType { kMlp, kTransformer, kCnn, kTorchScript };
enum class DataType { kSynthetic, kCsv, kText, kIdx };
enum class LossType { kAuto, kCrossEntropy, kMse, kBceWithLogits };
enum class SaveModel { kEnd, kCheckpoints, kNever };
enum class OptimizerType { kSgd, kAdam, kAdamW };
// How Adam and AdamW update their parameters (PyTorch's foreach= and fused= arguments): one
// tensor at a time (LibTorch's torch::optim), with the multi-tensor _foreach_* ops, or with the
// fused _fused_adam_/_fused_adamw_ kernels. auto: foreach when every parameter of a group is a
// CUDA tensor, else the for loop (PyTorch's default, _default_to_fused_or_foreach).
enum class OptimizerImplementation { kAuto, kForLoop, kForeach, kFused };
enum class SchedulerType { kConstant, kLinear, kCosine };
enum class ParallelMode { kNone, kDp, kDdp, kPipeline, kZero };
enum class PipelineSchedule { kGPipe, k1F1B, kInterleaved1F1B, kZeroBubble };
// ddp: how gradient buckets travel (accelerate's DDPCommunicationHookType): as they are, cast
// to bfloat16 / float16 for the all-reduce and back (PyTorch's bf16_compress_hook,
// fp16_compress_hook), or as PowerSGD's low-rank factors (powerSGD_hook).
enum class CommHook { kNone, kBf16, kFp16, kPowerSgd };
// Local SGD's step at each synchronisation: the replicas become their mean, or (DiLoCo,
// Douillard et al. 2023) the mean change since the last synchronisation is a pseudo-gradient
// for an outer SGD step with Nesterov momentum.
enum class OuterOptimizer { kAverage, kNesterov };

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
  // Recompute each built-in block's forward in backward instead of keeping its activations
  // (the MLP's hidden layers in runs of ceil(sqrt(n)), transformer blocks, CNN conv blocks):
  // less memory, about a third more compute, the same gradients. Default false.
  bool activation_checkpointing = false;
  // cnn: one block per entry of `channels` (3x3 convolution without bias, batch norm, ReLU,
  // 2x2 max pooling), then flatten, a `hidden`-wide Linear + ReLU + dropout (none when
  // hidden is 0) and a Linear head with `classes` outputs. `input` is [C, H, W] of one image.
  std::vector<int64_t> cnn_channels = {16, 32};
  int64_t cnn_hidden = 128;
  int64_t classes = 10;
  bool batch_norm = true;
  // cnn: batch norm on channels-last activations, as the rest of each block (1.3x the
  // throughput of the quickstart's CNN on 2 CPU cores); false: on NCHW, converted around it,
  // for LibTorch 1.13, whose channels-last batch norm sums its statistics less exactly (model.cc).
  bool channels_last = true;
  std::vector<int64_t> input_shape = {1, 28, 28};
  // torchscript: path of a module saved by torch.jit.save.
  std::string torchscript_path;
  // pipeline with TorchScript: one module per stage, in order (overrides torchscript_path).
  std::vector<std::string> torchscript_stages;
  // torchscript: the batch fields passed to forward, in order: `input` (the data) and/or
  // `target` (the labels, for a model that computes its own loss).
  std::vector<std::string> inputs = {"input"};
  // torchscript: where the logits and the loss are in the output. A tensor output is the
  // logits (a 0-dim tensor: the loss). A tuple: element `output_logits` (an index, default 0)
  // and, when set, `output_loss`. A dict: keys `output_logits` (default "logits") and
  // `output_loss` (default "loss"). A model that returns a loss trains on it.
  std::string output_logits;
  std::string output_loss;
};

struct LossConfig {
  // auto: cross_entropy for class labels, mse for regression targets. A model that returns its
  // own loss (see ModelConfig::output_loss) trains on that instead.
  LossType type = LossType::kAuto;
  double label_smoothing = 0.0;       // cross_entropy
  int64_t ignore_index = -100;        // cross_entropy: targets equal to it do not count
  std::vector<double> class_weights;  // cross_entropy: one weight per class; empty = equal
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
  // idx: the directory of MNIST-format files (train-*-ubyte[.gz]; t10k-* when present are the
  // evaluation set, otherwise eval_fraction of the training files is held out). Pixels become
  // (byte / 255 - mean) / std; the defaults are Fashion-MNIST's training statistics.
  double mean = 0.2860;
  double std = 0.3530;
  // idx: augmentation of training images, deterministic per (seed, epoch, rank, batch): a
  // random crop after padding each side by `crop_padding` pixels, a horizontal flip with
  // probability 1/2.
  int64_t crop_padding = 0;
  bool flip = false;
  // Reshuffle the training samples every epoch (PyTorch's DistributedSampler order for the
  // same seed); false = in file order.
  bool shuffle = true;
};

struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdamW;
  double lr = 3e-4;
  double weight_decay = 0.0;  // adamw: 0.01 unless given
  double momentum = 0.0;      // sgd
  double beta1 = 0.9;         // adam, adamw: decay of the first-moment estimate
  double beta2 = 0.999;       // adam, adamw: decay of the second-moment estimate
  double eps = 1e-8;          // adam, adamw: added to the denominator
  // adam, adamw: auto | for_loop | foreach | fused (see OptimizerImplementation); sgd takes
  // auto and for_loop only. The state and checkpoints are the same with every choice. Default
  // auto.
  OptimizerImplementation implementation = OptimizerImplementation::kAuto;
  // Parameters left out of weight decay: those whose name contains one of these strings; the
  // entry `norm` also takes every parameter of a normalisation layer (BatchNorm, LayerNorm,
  // GroupNorm, InstanceNorm), whatever its name. The default leaves out biases and
  // normalisation weights as Hugging Face's Trainer does; [] decays every parameter.
  std::vector<std::string> no_decay = {"bias", "norm"};
};

// mixed_precision fp16's dynamic loss scaling (trainer_runtime/model/loss_scaler.h), with
// torch.amp.GradScaler's defaults; accelerate's GradScalerKwargs.
struct GradScalerConfig {
  double init_scale = 65536.0;     // the first scale (2^16)
  double growth_factor = 2.0;      // the scale's growth after growth_interval clean steps
  double backoff_factor = 0.5;     // its change after a step with inf or nan gradients
  int64_t growth_interval = 2000;  // clean steps in a row before a growth
};

// comm_hook power_sgd (trainer_runtime/parallel/power_sgd.h): PowerSGDState's options, names
// and defaults (accelerate's comm_state_option).
struct PowerSgdConfig {
  int64_t matrix_approximation_rank = 1;  // the factors' rank r: a n x m gradient sends (n+m) r
  int64_t start_powerSGD_iter = 1000;     // synchronised steps all-reduced whole before it starts
  double min_compression_rate = 2.0;      // a matrix is compressed when nm > rate (n+m) r
  bool use_error_feedback = true;         // what compression lost is added to the next gradient
  bool warm_start = true;                 // each step's Q starts from the last step's
  double orthogonalization_epsilon = 0.0;
  int64_t random_seed = 0;  // numpy.random.RandomState's seed, which seeds the first Qs
};

struct SchedulerConfig {
  SchedulerType type = SchedulerType::kConstant;
  int64_t warmup_steps = 0;   // linear warm-up from 0 to lr
  double min_lr_ratio = 0.0;  // linear/cosine decay floor, as a fraction of lr
};

struct ParallelConfig {
  // The strategy of the data axis (trainer_runtime/parallel/layout.h): none: each replica
  // trains alone (no communication); ddp: one replica per process with bucketed all-reduce;
  // dp: `replicas` replicas inside one process; zero: data parallel with state sharded over
  // the ranks (zero_stage). pipeline: the spelling of ddp over replicas of a pipeline of
  // `stages` stages (what it meant before stages combined with every strategy).
  ParallelMode mode = ParallelMode::kDdp;
  double bucket_cap_mb = 25.0;  // ddp: gradient bucket size; the first bucket is 1 MB
  int replicas = 2;             // dp: replicas (CPU threads or devices) in one process
  // The degrees of the other axes; the data degree is world / (stages x tensor x context).
  int stages = 1;  // pipeline stages per replica (> 1, or mode pipeline: the pipeline engine)
  int tensor = 1;  // ranks a layer's weights are split over (tensor parallelism)
  // Ranks each sequence is split over (context parallelism, DeepSpeed-Ulysses): each holds
  // 1/context of every sequence's tokens, and attention trades sequence for heads with an
  // all-to-all.
  int context = 1;
  // tensor > 1: what lies between the tensor-parallel layers (norms, dropout, residuals) runs on
  // each rank's 1/tensor of the sequence (Megatron's sequence parallelism).
  bool sequence_parallel = false;
  int microbatches = 4;  // pipeline: micro-batches per optimizer step
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  // interleaved_1f1b: model chunks each rank holds (Megatron's virtual pipeline stages): the
  // model is cut into stages x virtual_stages chunks, rank s holding chunks s, s + stages, ...
  int virtual_stages = 1;
  // pipeline: layers per chunk (stages x virtual_stages of them, in model order); empty =
  // balanced by parameters.
  std::vector<int64_t> partition;
  bool loss_in_replica = true;  // dp: compute the loss inside each replica (scalar gather)
  // ddp: find the parameters a forward did not use (PyTorch DDP's option of the same name), so
  // a model with an unused head or branch trains; costs a graph walk per synchronised step.
  bool find_unused_parameters = false;
  CommHook comm_hook = CommHook::kNone;  // ddp: none, bf16, fp16 or power_sgd
  PowerSgdConfig power_sgd;              // comm_hook power_sgd
  // ddp, dp: the model's SyncBatchNorm layers (model/sync_batchnorm.h; the built-in CNN's batch
  // norms are such layers) take their training statistics over the whole data-parallel batch,
  // as torch.nn.SyncBatchNorm; false: each replica's own rows, as BatchNorm under DDP.
  bool sync_batchnorm = false;
  // dp: each replica's forward pass runs alone, drawing from its own seeded random stream, so
  // dropout is reproducible and resumes exactly (backward passes still run in parallel).
  // false runs the forwards concurrently: faster, for models that draw no random numbers.
  // `train` turns it off itself for built-in models without dropout.
  bool dp_seeded_replicas = true;
  // zero: what is sharded over the ranks (DeepSpeed's stages): 1 optimizer state, 2 also
  // gradients, 3 also parameters (FSDP's FULL_SHARD).
  int zero_stage = 1;

  // Whether each replica is a pipeline of stages (run by the pipeline engine).
  bool pipelined() const { return mode == ParallelMode::kPipeline || stages > 1; }
  // The data axis' strategy: `mode`, with pipeline read as ddp.
  ParallelMode data_mode() const {
    return mode == ParallelMode::kPipeline ? ParallelMode::kDdp : mode;
  }
};

struct TrainConfig {
  bool present = false;  // true when the YAML has a `train:` section
  uint64_t seed = 42;
  std::string output_dir = "runs/default";  // metrics.jsonl, final.json, checkpoints/
  ModelConfig model;
  DataConfig data;
  LossConfig loss;
  double eval_fraction = 0.1;  // held-out share of the data set
  int64_t batch_size = 32;     // per process, per micro-batch
  int64_t max_steps = 0;       // optimizer steps; 0 = run `epochs` epochs
  int64_t epochs = 0;          // used when max_steps is 0 (then at least 1)
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  double max_grad_norm = 0.0;    // 0 = no clipping
  GradScalerConfig grad_scaler;  // mixed_precision fp16 only
  ParallelConfig parallel;
  int gradient_accumulation_steps = 1;
  bool sync_each_batch = false;      // true: all-reduce every micro-batch (no no_sync)
  bool sync_with_dataloader = true;  // the accumulation window also closes at the loader's end
  // Seconds one collective waits for a peer before it fails (the process group forms under the
  // init timeout instead). Longer than launch's stall report (--stall_timeout, 1800 s), which
  // names the rank that hangs, so a hang is reported before it times out.
  double collective_timeout_s = 3600;
  int local_sgd_steps = 0;  // > 0: no gradient all-reduce; average params every K steps
  struct LocalSgd {
    OuterOptimizer outer = OuterOptimizer::kAverage;
    double outer_lr = 0.7;        // nesterov: DiLoCo's defaults
    double outer_momentum = 0.9;  // nesterov
  } local_sgd;
  int64_t checkpoint_every = 100;  // optimizer steps; 0 = only at the end
  // In-place recovery of a mode whose state exists on one rank alone (zero, local_sgd): steps
  // between the in-memory snapshots every rank rolls back to after a loss (Accelerator).
  int64_t recover_snapshot_every = 50;
  // Checkpoints written by a forked child while training goes on (Accelerator::SaveState).
  bool checkpoint_async = false;
  // Checkpoints (step folders) kept under the checkpoint folder: the last K; 1 = only the
  // latest. More let Accelerator::LoadState(dir, step) go back to an earlier step.
  int64_t checkpoint_keep = 1;
  std::string resume = "auto";  // auto | never | PATH of a checkpoint file
  int64_t log_every = 10;       // optimizer steps between plain log lines
  // train writes TensorBoard event files to output_dir/tensorboard (Accelerator::Log).
  bool tensorboard = false;
  int64_t eval_every = 0;  // optimizer steps between evaluations; 0 = only at the end
  // A per-rank trace of optimizer steps [from_step, from_step + steps) (trainer_runtime/
  // timeline.h), written to output_dir/timeline.json; steps 0 = none.
  struct Timeline {
    int64_t from_step = 1;
    int64_t steps = 0;
  } timeline;
  std::string mixed_precision = "no";  // copied from the top level: no | bf16 | fp16
  // The trained model, for PyTorch to load (output_dir/model.pt): a TorchScript model as
  // itself with the trained weights (torch.jit.load), a built-in model as a dict of parameter
  // and buffer names to tensors (torch.load). Written at the end, also at every checkpoint
  // (checkpoints), or never.
  SaveModel save_model = SaveModel::kEnd;
  // Resume from a checkpoint written with other TrajectorySettings (they are listed, and the
  // run continues with the new ones). Without it such a resume is refused, and a fresh run
  // sets the other run's checkpoint aside instead of continuing it.
  bool resume_allow_changes = false;
};

// The settings that change a run's trajectory (weights, data order, LR), as (YAML key, value)
// pairs in a fixed order: a checkpoint records them, and resuming compares them. Keys of the
// configured model and data type only. Output, logging and checkpoint cadence are not among
// them; max_steps and epochs are not either (a program adds the LR schedule's length when its
// schedule depends on it).
std::vector<std::pair<std::string, std::string>> TrajectorySettings(const TrainConfig& t);
// Whether `key` was among them in earlier versions and no longer is (the tensor and pipeline
// layout, which a checkpoint is now re-cut for): a checkpoint that records it is compared
// without it.
bool FormerTrajectorySetting(const std::string& key);

const char* ToString(ModelType v);
const char* ToString(DataType v);
const char* ToString(LossType v);
const char* ToString(SaveModel v);
const char* ToString(OptimizerType v);
const char* ToString(OptimizerImplementation v);
const char* ToString(SchedulerType v);
const char* ToString(ParallelMode v);
const char* ToString(PipelineSchedule v);
const char* ToString(CommHook v);
const char* ToString(OuterOptimizer v);

}  // namespace launch::config
