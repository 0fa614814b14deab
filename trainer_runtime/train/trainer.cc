// `train`'s one training loop, on the public Accelerator API (accelerator.h): the built-in
// models and data sets plus what a job needs around the API (resume policy, checkpoint and
// evaluation cadence, signals, metrics.jsonl, progress, final.json). Every mode (none, ddp,
// local_sgd, dp, pipeline) runs through the same loop; only the call that runs one micro-batch
// differs between pipeline stages and the others.
#include "trainer_runtime/train/trainer.h"

#include "trainer_runtime/train/trainer_internal.h"

namespace launch::trainer {
namespace train_internal {

Status Trainer::Prepare() {
  const bool pipelined = cfg_.parallel.pipelined();
  if (pipelined && cfg_.model.type != config::ModelType::kTorchScript) {
    // Before joining anything: a bad partition fails at once with its key named.
    LAUNCH_ASSIGN_OR_RETURN(partition_,
                            PartitionLayers(LayerCosts(cfg_.model), cfg_.parallel.stages,
                                            cfg_.parallel.partition, cfg_.parallel.virtual_stages));
  }
  // A built-in model draws random numbers only for dropout: without it, DP replicas need no
  // seeded streams and run their forward passes concurrently (same results, faster).
  if (cfg_.model.type != config::ModelType::kTorchScript && cfg_.model.dropout == 0)
    cfg_.parallel.dp_seeded_replicas = false;
  SetPhase("joining the process group");
  {
    // LAUNCH_TEST_SIGKILL_AT's join, read from the environment the group has not confirmed yet.
    LAUNCH_ASSIGN_OR_RETURN(std::vector<DieAt> die,
                            ParseDieAt(std::getenv("LAUNCH_TEST_SIGKILL_AT")));
    const char* rank = std::getenv("RANK");
    const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
    const bool first =
        (!restart || std::string(restart) == "0") && !std::getenv("LAUNCH_RECOVER_GENERATION");
    for (const DieAt& d : die)
      if (d.phase == "join" && first && rank && std::to_string(d.rank) == rank) ::raise(SIGKILL);
  }
  LAUNCH_ASSIGN_OR_RETURN(accel_, Accelerator::Create(cfg_, opts_.init_timeout_s));
  if (accel_->env().recover_generation == 0 && accel_->env().restart_count == 0) {
    LAUNCH_ASSIGN_OR_RETURN(die_at_, ParseDieAt(std::getenv("LAUNCH_TEST_SIGKILL_AT")));
  }
  // A bar where a person watches: stdout a terminal, or under launch its console.
  tty_ = accel_->IsMainProcess() && (::isatty(STDOUT_FILENO) || accel_->env().console_tty);
  // The pipeline's send/recv use shared memory exactly when the all-reduce does (one decision
  // per group, process_group.h).
  if (accel_->world_size() > 1)
    accel_->Print(std::string(pipelined ? "train: pipeline send/recv over "
                                        : "train: gradient all-reduce over ") +
                  accel_->allreduce_transport());
  if (accel_->bf16() || accel_->fp16())
    accel_->Print(std::string("train: mixed precision ") + (accel_->bf16() ? "bf16" : "fp16") +
                  " (" + (accel_->device().is_cuda() ? "CUDA" : "CPU") +
                  " autocast; weights, gradients and optimizer state in float32" +
                  (accel_->fp16() ? "; dynamic loss scaling from " + Fixed(accel_->loss_scale(), 0)
                                  : std::string()) +
                  ")");

  SetPhase("loading data");
  if (!data_loaded_) {
    LAUNCH_ASSIGN_OR_RETURN(data_, LoadDataset(cfg_));
  }
  LAUNCH_ASSIGN_OR_RETURN(criterion_, Criterion::Create(data_.task, cfg_.loss));
  loader_.emplace(accel_->PrepareDataLoader(TrainRows(&data_), cfg_.batch_size));
  const int64_t per_epoch = loader_->batches_per_epoch();
  if (per_epoch == 0)
    return Status::InvalidConfig(
        "train.batch_size " + std::to_string(cfg_.batch_size) + " is larger than the " +
        std::to_string(data_.train_indices.size() / accel_->data_parallel_size()) +
        " training samples each of " + std::to_string(accel_->data_parallel_size()) +
        (pipelined ? " pipeline replicas" : " ranks") + " gets; lower it or add data");
  total_steps_ = RunSteps(per_epoch);
  // The schedule is as long as the run is in the world it started in, whatever world resumes
  // it: a checkpoint names that world (origin_data_world).
  schedule_steps_ = total_steps_;
  // A replacement (in-place recovery) reads no checkpoint: its state comes from a live peer.
  if (cfg_.resume != "never" && accel_->env().recover_generation == 0) {
    const std::string dir = CheckpointDir();
    if (StatusOr<int64_t> latest = Accelerator::LatestStep(dir); latest.ok()) {
      // dir/step<N>/rank0.pt: the layout SaveState documents (accelerator.h).
      StatusOr<TrainState> state = LoadRankState(
          dir + "/step" + std::to_string(*latest) + "/rank0.pt", /*restore_rng=*/false);
      if (state.ok()) peeked_ = *state;
    }
  }
  if (peeked_ && peeked_->data_world > 0) {
    const int64_t origin =
        peeked_->origin_data_world > 0 ? peeked_->origin_data_world : peeked_->data_world;
    // In that world's batch size too: a resume that keeps the global batch (the docs'
    // advice) changes the per-rank one, and the schedule must keep its length.
    const int64_t origin_batch =
        peeked_->origin_batch_size > 0 ? peeked_->origin_batch_size : cfg_.batch_size;
    if (origin != accel_->data_parallel_size())
      schedule_steps_ = RunSteps(ShardedSampler(static_cast<int64_t>(data_.train_indices.size()), 0,
                                                static_cast<int>(origin), origin_batch, cfg_.seed)
                                     .batches_per_epoch());
  }

  SetPhase("building the model");
  // The loss of an output: the engines that compute it themselves (dp's gather, a pipeline's
  // last stage) call it.
  const Criterion criterion = criterion_;
  accel_->SetCriterion([criterion](const torch::Tensor& logits, const torch::Tensor& y) {
    return criterion(logits, y);
  });
  LAUNCH_RETURN_IF_ERROR(pipelined ? PreparePipelineStage() : PrepareReplica());
  const config::SchedulerConfig sched = cfg_.scheduler;
  const double base_lr = cfg_.optimizer.lr;
  accel_->SetLrSchedule([this, sched, base_lr](int64_t step) {
    MaybeDie(step + 1, "optimizer");  // Step() asks for the rate just before the update
    // Past a world-size change the rest of the schedule is stretched over the steps left
    // (SetRunLength); before any, the position is the step, as it always was.
    const Accelerator::ScheduleAnchor& a = accel_->schedule_anchor();
    if (a.step < 0) return LearningRate(sched, base_lr, step, schedule_steps_);
    const double position = a.position + static_cast<double>(step - a.step) * a.slope;
    return LearningRateAt(sched, base_lr, position, schedule_steps_);
  });
  // A decaying schedule's learning rates depend on its length: part of the run's identity.
  const char* kScheduleKey = "train.max_steps/epochs (LR schedule length in steps)";
  if (sched.type != config::SchedulerType::kConstant)
    accel_->AddRunSetting(kScheduleKey, std::to_string(schedule_steps_));
  LAUNCH_RETURN_IF_ERROR(MaybeResume());
  if (accel_->step() == 0 && schedule_steps_ != total_steps_) {
    // Not resumed after all (a finished or foreign checkpoint): a new run in this world.
    schedule_steps_ = total_steps_;
    if (sched.type != config::SchedulerType::kConstant)
      accel_->AddRunSetting(kScheduleKey, std::to_string(schedule_steps_));
  }
  if (accel_->step() > 0) SetRunLength();
  const int64_t origin_global = accel_->origin_data_world() * accel_->origin_batch_size();
  const int64_t global = accel_->data_parallel_size() * cfg_.batch_size;
  if (accel_->step() > 0 && origin_global != global)
    accel_->Print(
        "train: the global batch is " + std::to_string(global) + " (" +
        std::to_string(accel_->data_parallel_size()) + " x " + std::to_string(cfg_.batch_size) +
        "); the run began with " + std::to_string(origin_global) + " (" +
        std::to_string(accel_->origin_data_world()) + " x " +
        std::to_string(accel_->origin_batch_size()) +
        (origin_global % accel_->data_parallel_size() == 0
             ? "): train.batch_size " +
                   std::to_string(origin_global / accel_->data_parallel_size()) + " keeps it"
             : "), which " + std::to_string(accel_->data_parallel_size()) +
                   " ranks cannot split evenly"));

  int64_t num_params = 0;
  for (auto& p : accel_->parameters()) num_params += p.numel();
  const int world = accel_->world_size();
  if (const PipelineEngine* engine = internals().pipeline()) {
    std::vector<std::string> parts;
    for (int64_t v : partition_) parts.push_back(std::to_string(v));
    const PipelineEngine& pe = *engine;
    std::printf(
        "train: pipeline stage %d/%d of replica %d/%d: %lld parameters%s; schedule %s: %s\n",
        pe.stage(), pe.stages(), pe.replica(), pe.replicas(), static_cast<long long>(num_params),
        parts.empty() ? "" : (" (partition " + Join(parts, ",") + ")").c_str(),
        config::ToString(cfg_.parallel.schedule), ScheduleToString(pe.schedule()).c_str());
    std::fflush(stdout);
    accel_->Print("train: " + std::to_string(world) + " process(es), " +
                  (accel_->tensor_group() ? accel_->layout().Describe() + ", " : std::string()) +
                  "pipeline " + std::to_string(pe.stages()) + " stages x " +
                  std::to_string(pe.replicas()) + " replicas (" + pe.DataStrategyName() +
                  (cfg_.parallel.data_mode() == ParallelMode::kZero
                       ? " stage " + std::to_string(cfg_.parallel.zero_stage)
                       : std::string()) +
                  "), " + std::to_string(cfg_.parallel.microbatches) + " micro-batches, " +
                  config::ToString(cfg_.parallel.schedule) + "; " + data_.description + "; batch " +
                  std::to_string(cfg_.batch_size) + " per replica x " +
                  std::to_string(cfg_.gradient_accumulation_steps) + " accumulation; " +
                  std::to_string(total_steps_) + " steps; output " + cfg_.output_dir);
    return Status::Ok();
  }
  std::string shape;
  if (cfg_.model.type == config::ModelType::kMlp) {
    std::vector<std::string> widths;
    for (int64_t w : cfg_.model.mlp_layers) widths.push_back(std::to_string(w));
    shape = " " + Join(widths, "-");
  } else if (cfg_.model.type == config::ModelType::kCnn) {
    std::vector<std::string> channels;
    for (int64_t c : cfg_.model.cnn_channels) channels.push_back(std::to_string(c));
    shape = " channels " + Join(channels, ",") + " hidden " + std::to_string(cfg_.model.cnn_hidden);
  }
  const int64_t buckets = accel_->num_buckets();
  // Split layers: the layout, and the whole model's size beside this rank's share of it.
  std::string layout, held;
  const bool split_rows = accel_->tensor_group() || accel_->context_group();
  if (split_rows)
    layout = accel_->layout().Describe() +
             (cfg_.parallel.sequence_parallel ? " (sequence parallel)" : "") + ", ";
  if (const TensorGroupPtr& tensor = accel_->tensor_group()) {
    const std::vector<torch::Tensor> params = accel_->parameters();
    const std::vector<bool> split = SplitParameters(*internals().model()->shared_module(), params);
    int64_t whole = 0;
    for (size_t i = 0; i < params.size(); ++i)
      whole += params[i].numel() * (split[i] ? tensor->size() : 1);
    held = ", " + std::to_string(num_params) + " on each rank";
    num_params = whole;
  }
  accel_->Print(
      "train: " + std::to_string(world) + " process(es), " + layout + accel_->mode_name() +
      (buckets ? " (" + std::to_string(buckets) + " buckets)" : "") +
      (cfg_.local_sgd_steps > 0 ? " every " + std::to_string(cfg_.local_sgd_steps) + " steps"
                                : "") +
      "; model " + config::ToString(cfg_.model.type) + shape + " (" + std::to_string(num_params) +
      " parameters" + held + "); " + data_.description + "; batch " +
      std::to_string(cfg_.batch_size) + " x " + std::to_string(cfg_.gradient_accumulation_steps) +
      " micro-batches x " +
      (!split_rows ? std::to_string(world) + " ranks; "
                   : std::to_string(accel_->data_parallel_size()) + " replicas; ") +
      std::to_string(total_steps_) + " steps; output " + cfg_.output_dir);
  return Status::Ok();
}

void Trainer::PrepareUtilization() {
  flops_ = CountModelFlops(cfg_);
  peak_ = DevicePeak(accel_->device(), cfg_.mixed_precision);
  std::string model = "model FLOPs unknown (a TorchScript model has no count)";
  if (flops_) {
    model = Fixed(static_cast<double>(flops_->train_per_sample) / 1e6, 3) +
            " MFLOP per training sample";
    if (flops_->tokens_per_sample > 0)
      model += " (" + std::to_string(flops_->tokens_per_sample) + " tokens)";
  }
  accel_->Print("train: " + model + "; peak " +
                (peak_.known() ? Fixed(peak_.flops_per_s / 1e12, 3) + " TFLOP/s per rank"
                               : std::string("unknown")) +
                " (" + peak_.source + ")");
}

int64_t Trainer::RunSteps(int64_t batches_per_epoch) const {
  if (cfg_.max_steps > 0) return cfg_.max_steps;
  const int64_t n = cfg_.gradient_accumulation_steps;
  const int64_t steps_per_epoch = cfg_.sync_with_dataloader
                                      ? (batches_per_epoch + n - 1) / n
                                      : std::max<int64_t>(1, batches_per_epoch / n);
  return std::max<int64_t>(1, cfg_.epochs) * steps_per_epoch;
}

int64_t Trainer::RemainingSteps() const {
  const LoaderCursor& c = loader_->cursor();
  const int64_t epochs = std::max<int64_t>(1, cfg_.epochs);
  if (c.epoch >= epochs) return 0;
  const int64_t n = cfg_.gradient_accumulation_steps;
  const int64_t now = c.batches_this_epoch - c.batch;  // windows close at step boundaries
  const int64_t later = epochs - c.epoch - 1;
  if (cfg_.sync_with_dataloader)
    return (now + n - 1) / n + later * ((c.batches_per_epoch + n - 1) / n);
  return (now + later * c.batches_per_epoch) / n;
}

void Trainer::SetRunLength() {
  const int64_t restored = accel_->restored_data_world();
  const bool changed_now = restored > 0 && restored != accel_->data_parallel_size();
  Accelerator::ScheduleAnchor anchor = accel_->schedule_anchor();
  // max_steps counts steps in any world; a checkpoint that never saw a world-size change
  // (and older ones, which resume a changed world as they always did) keeps the step count.
  if (cfg_.max_steps > 0 || (!changed_now && anchor.step < 0)) return;
  const int64_t step = accel_->step();
  total_steps_ = step + RemainingSteps();
  if (!changed_now) return;  // the anchor of the earlier change still holds
  const double position =
      anchor.step < 0 ? static_cast<double>(step)
                      : anchor.position + static_cast<double>(step - anchor.step) * anchor.slope;
  anchor.step = step;
  anchor.position = position;
  anchor.slope = (static_cast<double>(schedule_steps_) - position) /
                 static_cast<double>(std::max<int64_t>(1, total_steps_ - step));
  accel_->set_schedule_anchor(anchor);
  accel_->Print("train: the run ends after its " +
                std::to_string(std::max<int64_t>(1, cfg_.epochs)) + " epochs at step " +
                std::to_string(total_steps_) + " in this world (" +
                std::to_string(total_steps_ - step) + " steps left); the LR schedule (" +
                std::to_string(schedule_steps_) + " steps, at " + Fixed(position, 2) +
                ") is stretched over them");
}

void Trainer::SeedDropout() {
  // Different dropout masks per replica, reproducible per (seed, rank). The ranks of a tensor
  // and context group draw alike (ParallelLayout::RandomStream): each keeps its part of the
  // same whole mask (layers.h), so the split model drops what the unsplit one would.
  const int stream = accel_->layout().RandomStream();
  torch::manual_seed(cfg_.seed + 1000003ull * static_cast<uint64_t>(stream + 1));
}

Status Trainer::PrepareReplica() {
  // Same seed on every rank: identical initial weights even before the broadcast.
  torch::manual_seed(cfg_.seed);
  LAUNCH_ASSIGN_OR_RETURN(std::unique_ptr<Model> model,
                          CreateModel(cfg_.model, accel_->tensor_group(),
                                      cfg_.parallel.sequence_parallel, accel_->context_group()));
  LAUNCH_ASSIGN_OR_RETURN(std::unique_ptr<torch::optim::Optimizer> made,
                          MakeOptimizer(cfg_.optimizer, *model));
  auto optimizer = std::shared_ptr<torch::optim::Optimizer>(std::move(made));
  SeedDropout();
  SetPhase("broadcasting parameters");
  return accel_->Prepare(model->shared_module(), optimizer);
}

Status Trainer::PreparePipelineStage() {
  // This rank's chunks: one, or virtual_stages of an interleaved schedule.
  LAUNCH_ASSIGN_OR_RETURN(
      std::vector<torch::nn::AnyModule> chunks,
      BuildStageChunks(cfg_, accel_->stage_index(), partition_, accel_->tensor_group()));
  std::shared_ptr<torch::nn::Module> stage = chunks.front().ptr();
  if (chunks.size() > 1) {
    LAUNCH_ASSIGN_OR_RETURN(stage, JoinChunks(chunks));
  }
  Model view(stage);
  LAUNCH_ASSIGN_OR_RETURN(std::unique_ptr<torch::optim::Optimizer> made,
                          MakeOptimizer(cfg_.optimizer, view));
  auto optimizer = std::shared_ptr<torch::optim::Optimizer>(std::move(made));
  SeedDropout();
  return accel_->PreparePipeline(std::move(chunks), optimizer);
}

Status Trainer::MaybeResume() {
  SetPhase("resuming");
  if (cfg_.resume == "never" || accel_->joined_from_peer()) return Status::Ok();
  const std::string dir = CheckpointDir();
  const bool explicit_path = cfg_.resume != "auto";
  StatusOr<int64_t> latest = Accelerator::LatestStep(dir);
  if (!latest.ok() && explicit_path)
    return Status::NotFound("train.resume: '" + dir +
                            "' holds no checkpoint (a checkpoint folder has a `latest` file)");
  // Finished: the step count reached the end, or (since checkpoints record the data position,
  // which counts at any world size) the configured epochs are done. A `latest` naming no
  // saved folder is damage, for LoadState to fall back from, never a finished run.
  const std::vector<int64_t> saved = Accelerator::SavedSteps(dir);
  const bool finished =
      latest.ok() && std::find(saved.begin(), saved.end(), *latest) != saved.end() &&
      (*latest >= total_steps_ ||
       (cfg_.max_steps == 0 && peeked_ && peeked_->data_world > 0 && peeked_->step == *latest &&
        peeked_->epoch >= std::max<int64_t>(1, cfg_.epochs)));
  if (latest.ok() && !explicit_path && accel_->env().restart_count == 0 && finished) {
    // A finished run's checkpoint: running the same command again trains afresh rather than
    // silently doing nothing, and the old checkpoint must not come back if this run is
    // restarted before it writes its own (the restart would resume it and "finish" at once).
    accel_->Print(FinishedRunMessage(dir, *latest));
    accel_->Barrier();  // every rank has seen `latest` before it goes
    if (accel_->rank() == 0) std::remove((dir + "/latest").c_str());
    accel_->Barrier();
    return Status::Ok();
  }
  const std::vector<std::string> changes = accel_->ChangedSettings(dir);
  if (latest.ok() && !explicit_path && accel_->env().restart_count == 0 && !changes.empty() &&
      !cfg_.resume_allow_changes) {
    // Another run's checkpoint (other settings) in this output_dir: a fresh run neither
    // continues it nor destroys it. Restarts of this run (restart_count > 0) never get here:
    // for them a mismatch is an error (LoadState).
    std::string aside = dir + ".set-aside-step" + std::to_string(*latest);
    for (int i = 2; std::ifstream(aside + "/latest"); ++i)
      aside = dir + ".set-aside-step" + std::to_string(*latest) + "-" + std::to_string(i);
    accel_->Barrier();  // every rank has compared before the folder moves
    if (accel_->rank() == 0) {
      std::error_code ec;
      std::filesystem::rename(dir, aside, ec);
      if (ec) return Status::IoError("moving " + dir + " to " + aside + ": " + ec.message());
    }
    accel_->Barrier();
    accel_->Print("train: " + dir + " holds a checkpoint (step " + std::to_string(*latest) +
                  ") of a run with other settings (" + Join(changes, "; ") + "); moved it to " +
                  aside +
                  " and starting a new run (set `train.resume_allow_changes: true` to "
                  "continue it instead)");
    return Status::Ok();
  }
  LAUNCH_ASSIGN_OR_RETURN(bool resumed, accel_->LoadState(dir));
  if (!resumed) {
    if (accel_->env().restart_count > 0)
      accel_->Print("train: restart " + std::to_string(accel_->env().restart_count) +
                    ": no checkpoint yet, starting from step 0");
    return Status::Ok();
  }
  accel_->Print("train: resumed from " + dir + " at step " + std::to_string(accel_->step()) +
                RestartSuffix(accel_->env().restart_count));
  return Status::Ok();
}

void Trainer::TrainStep() {
  double loss_sum = 0;
  int64_t micro = 0;
  Timeline::Get().BeginStep(accel_->step() + 1);  // the span below starts before Accumulate()
  Timeline::Scope step_span("train", "step " + std::to_string(accel_->step() + 1));
  do {
    SetPhase("loading a batch");
    torch::data::Example<> batch;
    {
      Timeline::Scope span("train", "data");
      // The batch's place in the data order seeds its augmentation: exact again after a resume.
      const LoaderCursor at = loader_->cursor();
      batch = loader_->Next();
      if (data_.crop_padding > 0 || data_.flip)
        batch.data = Augment(data_, batch.data, AugmentSeed(at.epoch, at.batch));
    }
    SetPhase("forward");
    accel_->Accumulate();
    MaybeDie(accel_->step() + 1, "forward");
    // A pipeline's engine runs the schedule of micro-batches and calls the criterion on its last
    // stage (its loss is 0 elsewhere); every other mode runs `fn` on the batch.
    torch::Tensor loss = accel_->ForwardBackward(
        batch, [this](torch::nn::Module& m, const torch::data::Example<>& b) {
          SetPhase("forward");
          ForwardOutput out = RunForward(m, b, cfg_.model);
          torch::Tensor loss = out.loss.defined() ? out.loss : criterion_(out.logits, b.target);
          if (!die_at_.empty() && loss.requires_grad())
            loss.register_hook([this, step = accel_->step() + 1](torch::Tensor grad) {
              MaybeDie(step, "backward");
              return grad;
            });
          SetPhase("backward");  // what ForwardBackward runs next with this loss
          return loss;
        });
    loss_sum += loss.item<double>();
    ++micro;
    SetPhase("optimizer step");
    const bool stepped = accel_->Step();
    if (accel_->redo()) {  // a lost peer was replaced: the step starts over (accelerator.h)
      loss_sum = 0;
      micro = 0;
    }
    if (stepped) break;
  } while (true);
  last_loss_ = loss_sum / static_cast<double>(micro);
}

void Trainer::Evaluate(double* loss, double* accuracy) {
  SetPhase("evaluation", /*between_steps=*/true);
  torch::NoGradGuard no_grad;
  Model* model = internals().model();
  model->SetTraining(false);
  double loss_sum = 0, weight = 0, correct = 0, predictions = 0;
  const size_t data_rank = static_cast<size_t>(accel_->data_parallel_rank());
  const size_t data_world = static_cast<size_t>(accel_->data_parallel_size());
  std::vector<int64_t> mine;
  for (size_t i = data_rank; i < data_.eval_indices.size(); i += data_world)
    mine.push_back(data_.eval_indices[i]);
  const size_t chunk = static_cast<size_t>(std::max<int64_t>(cfg_.batch_size, 256));
  for (size_t start = 0; start < mine.size(); start += chunk) {
    std::vector<int64_t> rows(
        mine.begin() + static_cast<std::ptrdiff_t>(start),
        mine.begin() + static_cast<std::ptrdiff_t>(std::min(mine.size(), start + chunk)));
    PipelineEngine* engine = internals().pipeline();
    ForwardOutput out;
    torch::Tensor y = accel_->ToDevice(data_.Targets(rows));
    if (engine) {
      out.logits = engine->Forward(engine->first() ? data_.Inputs(rows) : torch::Tensor());
      if (!out.logits.defined()) continue;  // a pipeline stage before the last
    } else {
      auto amp = accel_->Autocast();
      // With a context group, each rank scores its part of every sequence.
      y = accel_->ContextShard(y);
      out = RunForward(model->module(),
                       {accel_->ContextShard(accel_->ToDevice(data_.Inputs(rows))), y}, cfg_.model);
    }
    if (accel_->bf16() || accel_->fp16()) {  // loss and accuracy in float32, as in training
      if (out.logits.defined()) out.logits = out.logits.to(torch::kFloat);
      if (out.loss.defined()) out.loss = out.loss.to(torch::kFloat);
    }
    torch::Tensor loss = out.loss.defined() ? out.loss : criterion_(out.logits, y);
    loss_sum += loss.item<double>() * static_cast<double>(rows.size());
    weight += static_cast<double>(rows.size());
    if (out.logits.defined()) {
      auto [c, p] = criterion_.CountCorrect(out.logits, y);
      correct += static_cast<double>(c);
      predictions += static_cast<double>(p);
    }
  }
  model->SetTraining(true);
  // Weighted by sample counts, so the average over ranks equals the average over the split.
  auto totals = torch::tensor({loss_sum, weight, correct, predictions}, torch::kDouble);
  accel_->AllReduceSum(totals);
  auto t = totals.accessor<double, 1>();
  *loss = t[1] > 0 ? t[0] / t[1] : std::nan("");
  *accuracy = t[3] > 0 ? t[2] / t[3] : std::nan("");
}

Status Trainer::Run() {
  const auto wall_start = Clock::now();
  LAUNCH_RETURN_IF_ERROR(Prepare());
  PrepareUtilization();
  LAUNCH_RETURN_IF_ERROR(MakeDirs(cfg_.output_dir));
  if (accel_->IsMainProcess()) {
    // Keep the history of the steps this run continues from; drop lines of redone steps.
    const std::string metrics_path = cfg_.output_dir + "/metrics.jsonl";
    const std::string kept = MetricsHistoryUpTo(metrics_path, accel_->step());
    metrics_.open(metrics_path, std::ios::trunc);
    if (!metrics_) return Status::IoError("cannot write " + metrics_path);
    metrics_ << kept;
  }
  internals().model()->SetTraining(true);
  accel_->TakeCommStats();
  train_start_ = Clock::now();
  accel_->MarkLoopStart();
  while (accel_->step() < total_steps_) {
    const auto step_start = Clock::now();
    const int64_t samples_before = accel_->samples_seen();
    TrainStep();
    const double step_s = std::max(1e-9, Seconds(Clock::now() - step_start));
    if (PipelineEngine* engine = internals().pipeline(); ++steps_this_run_ == 1 && engine) {
      // The first step pays for allocations and lazy initialisation: leave it out of the
      // idle-fraction figures (peak live counts keep it).
      engine->ResetTimings();
    }
    Accelerator::CommStats comm = accel_->TakeCommStats();
    const int64_t samples =
        (accel_->samples_seen() - samples_before) * accel_->data_parallel_size();
    const double sps = samples / step_s;
    run_rank_flops_ += RankFlops(static_cast<double>(samples));
    run_step_s_ += step_s;
    ema_samples_per_s_ = ema_samples_per_s_ == 0 ? sps : 0.9 * ema_samples_per_s_ + 0.1 * sps;
    LAUNCH_RETURN_IF_ERROR(WriteMetricsLine(comm, last_loss_, step_s, samples));
    Report(last_loss_, ema_samples_per_s_, comm.blocking_comm_ms);
    const int64_t step = accel_->step();
    if (cfg_.eval_every > 0 && step % cfg_.eval_every == 0 && step < total_steps_) {
      accel_->SyncBuffers();
      double el = 0, ea = 0;
      Evaluate(&el, &ea);
      accel_->Print("eval at step " + std::to_string(step) + ": loss " + Fixed(el, 4) +
                    (std::isnan(ea) ? "" : " accuracy " + Fixed(ea, 4)));
      LAUNCH_RETURN_IF_ERROR(WriteEvalLine(el, ea));
    }
    // Every rank acts on a signal any rank received, at this same step.
    SetPhase("signal poll", /*between_steps=*/true);
    const SignalRequest signal = accel_->PollSignals();
    SetPhase("checkpoint", /*between_steps=*/true);
    const bool scheduled = cfg_.checkpoint_every > 0 && step % cfg_.checkpoint_every == 0;
    // At the last step the run's own end writes the checkpoint (and final.json) below.
    const bool last = step >= total_steps_;
    if ((scheduled || signal.checkpoint) && !last) {
      MaybeDie(step, "checkpoint");
      LAUNCH_RETURN_IF_ERROR(accel_->SaveState(WriteDir()));
      // A signal's checkpoint is committed before going on (preemption may follow at once).
      if (signal.checkpoint) LAUNCH_RETURN_IF_ERROR(accel_->WaitForCheckpoint());
      if (cfg_.save_model == config::SaveModel::kCheckpoints) LAUNCH_RETURN_IF_ERROR(SaveModel());
      if (signal.checkpoint)
        accel_->Print("train: " + SignalName(signal.signal) + ": wrote " + WriteDir() +
                      " at step " + std::to_string(step));
    }
    if (signal.stop && last)
      accel_->Print("train: " + SignalName(signal.signal) +
                    " at the last step: finishing the run (checkpoint and final.json)");
    if (signal.stop && !last)
      return Status::Interrupted("stopped by " + SignalName(signal.signal) + " at step " +
                                 std::to_string(step) +
                                 "; checkpoint written, the next run resumes");
  }
  // The run's loop, not this process's part of it: a replacement took the run's clock with its
  // state (Accelerator::run_clock).
  loop_s_ = std::max(Seconds(Clock::now() - train_start_),
                     SecondsSinceUnixMs(accel_->run_clock().loop_started_unix_ms));
  SetPhase("finishing", /*between_steps=*/true);
  // Finish writes its own error; a stop by signal keeps its code (exit 143).
  if (Status finished = accel_->Finish(); !finished.ok())
    return finished.code() == Status::Code::kInterrupted
               ? finished
               : Status::Internal("the end of training failed (the line above says why)");
  double eval_loss = 0, eval_acc = 0;
  Evaluate(&eval_loss, &eval_acc);
  // The last evaluation goes to final.json, and to TensorBoard as the run's last point.
  if (cfg_.tensorboard) LAUNCH_RETURN_IF_ERROR(LogEval(eval_loss, eval_acc));
  // The final train loss: the last step's loss averaged over the ranks that compute it.
  const double mean_loss = accel_->MeanLoss(std::isnan(last_loss_) ? 0.0 : last_loss_);
  const double train_loss = std::isnan(last_loss_) ? last_loss_ : mean_loss;
  LAUNCH_RETURN_IF_ERROR(accel_->SaveState(WriteDir()));
  if (cfg_.save_model != config::SaveModel::kNever) LAUNCH_RETURN_IF_ERROR(SaveModel());
  if (opts_.dump_params) LAUNCH_RETURN_IF_ERROR(DumpParams());
  const double wall_s = std::max(Seconds(Clock::now() - wall_start),
                                 SecondsSinceUnixMs(accel_->run_clock().started_unix_ms));
  LAUNCH_RETURN_IF_ERROR(WriteFinal(train_loss, eval_loss, eval_acc, wall_s));
  accel_->Print(
      "done: " + std::to_string(accel_->step()) + " steps, train loss " + Fixed(train_loss, 4) +
      ", eval loss " + Fixed(eval_loss, 4) +
      (std::isnan(eval_acc) ? "" : ", eval accuracy " + Fixed(eval_acc, 4)) +
      (std::isnan(data_.loss_floor) ? "" : " (teacher floor " + Fixed(data_.loss_floor, 4) + ")") +
      ", " + Fixed(wall_s, 1) + " s; wrote " + cfg_.output_dir + "/final.json");
  // Nobody exits while a peer may still need it for the last collective.
  accel_->Barrier();
  return Status::Ok();
}

StatusOr<bool> Trainer::WaitAsSpare() {
  if (!IsSpare()) return true;
  const auto start = Clock::now();
  SetPhase("loading data as a spare");
  LAUNCH_ASSIGN_OR_RETURN(data_, LoadDataset(cfg_));
  data_loaded_ = true;
  std::printf(
      "train: spare (pid %d) ready (LibTorch loaded, data built in %.2f s); waiting for a "
      "rank\n",
      static_cast<int>(::getpid()), Seconds(Clock::now() - start));
  std::fflush(stdout);
  SetPhase("waiting as a spare");
  return AwaitSpareAssignment();
}

}  // namespace train_internal

Status RunTrainer(const config::TrainConfig& train, const TrainerOptions& options) {
  train_internal::Trainer trainer(train, options);
  try {
    LAUNCH_ASSIGN_OR_RETURN(bool assigned, trainer.WaitAsSpare());
    if (!assigned) return Status::Ok();  // a spare the job never needed
  } catch (const std::exception& e) {
    return Status::Internal(trainer.Phase() + ": " + e.what());
  }
  Accelerator::InstallSignalHandlers();
  try {
    return trainer.Run();
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    const std::string where = trainer.Phase() + ": ";
    if (IsLostPeerError(what))
      return Status::PeerLost(where + "lost a peer during training: " + what);
    return Status::Internal(where + what);
  } catch (const std::exception& e) {
    return Status::Internal(trainer.Phase() + ": " + e.what());
  }
}

std::string BuildDescription() {
  return "LibTorch " + compat::LibTorchVersion() + ", Gloo, NCCL " +
         (compat::HasNccl() ? "yes" : "no");
}

std::string LibTorchLibrary() { return compat::LoadedLibTorchPath(); }

}  // namespace launch::trainer
