// The Trainer's outputs: metrics.jsonl's lines, the progress line, final.json, --dump_params and
// the model files for PyTorch (trainer_internal.h).
#include "trainer_runtime/train/trainer_internal.h"

namespace launch::trainer {
namespace train_internal {

Status Trainer::WriteMetricsLine(const Accelerator::CommStats& comm, double loss, double step_s,
                                 int64_t samples) {
  if (!accel_->IsMainProcess()) return Status::Ok();
  const double step_ms = step_s * 1000;
  const double comm_ms = std::min(comm.blocking_comm_ms, step_ms);
  const double lr = accel_->learning_rate(), samples_per_s = samples / step_s;
  const double flops = RankFlops(samples) / step_s, mfu = Mfu(flops);
  ordered_json line = {{"step", accel_->step()},
                       {"loss", loss},
                       {"lr", lr},
                       {"samples_per_s", samples_per_s},
                       {"tflops", flops / 1e12},
                       {"mfu", mfu},
                       {"comm_ms", comm_ms},
                       {"compute_ms", step_ms - comm_ms},
                       {"step_ms", step_ms},
                       {"allreduces", comm.allreduces}};
  if (comm.reduce_scatters || comm.allgathers) {
    line["reduce_scatters"] = comm.reduce_scatters;
    line["allgathers"] = comm.allgathers;
  }
  line["micro_batches"] = accel_->micro_batches_last_step();
  line["buckets_launched_before_grads_done"] = comm.launched_before_grads_done;
  if (const PipelineEngine* engine = internals().pipeline())
    line["peak_live_microbatches"] = engine->peak_live();
  line["epoch"] = accel_->epoch();
  if (accel_->fp16()) {  // the scale the next step's loss is multiplied by
    line["loss_scale"] = accel_->loss_scale();
    line["skipped_steps"] = accel_->skipped_steps();
  }
  if (cfg_.tensorboard) {
    std::vector<std::pair<std::string, double>> scalars = {{"train/loss", loss},
                                                           {"train/learning_rate", lr},
                                                           {"train/samples_per_s", samples_per_s},
                                                           {"train/step_ms", step_ms},
                                                           {"train/comm_ms", comm_ms}};
    if (std::isfinite(mfu)) scalars.emplace_back("train/mfu", mfu);
    LAUNCH_RETURN_IF_ERROR(accel_->Log(scalars, accel_->step()));
  }
  return AppendMetrics(line);
}

Status Trainer::WriteEvalLine(double loss, double accuracy) {
  if (!accel_->IsMainProcess()) return Status::Ok();
  ordered_json line = {{"step", accel_->step()}, {"eval_loss", loss}};
  if (!std::isnan(accuracy)) line["eval_accuracy"] = accuracy;
  if (cfg_.tensorboard) LAUNCH_RETURN_IF_ERROR(LogEval(loss, accuracy));
  return AppendMetrics(line);
}

Status Trainer::LogEval(double loss, double accuracy) {
  std::vector<std::pair<std::string, double>> scalars = {{"eval/loss", loss}};
  if (!std::isnan(accuracy)) scalars.emplace_back("eval/accuracy", accuracy);
  return accel_->Log(scalars, accel_->step());
}

Status Trainer::AppendMetrics(const ordered_json& line) {
  errno = 0;
  metrics_ << JsonText(line, -1);
  metrics_.flush();
  // The stream keeps no error code; the failed write(2) left its errno (ENOSPC, EIO, ...).
  if (!metrics_)
    return errno != 0 ? Status::FromErrno("writing " + cfg_.output_dir + "/metrics.jsonl", errno)
                      : Status::IoError("writing " + cfg_.output_dir + "/metrics.jsonl");
  return Status::Ok();
}

void Trainer::Report(double loss, double samples_per_s, double comm_ms) {
  if (!accel_->IsMainProcess()) return;
  const int64_t done = accel_->step();
  const double elapsed = Seconds(Clock::now() - train_start_);
  const double eta = steps_this_run_ > 0
                         ? elapsed / steps_this_run_ * static_cast<double>(total_steps_ - done)
                         : NAN;
  if (tty_) {
    // At most ten redraws a second (and the last): each is a write, and under launch a line
    // the agent passes on.
    const auto now = Clock::now();
    if (done != total_steps_ && done != 1 && now - last_redraw_ < std::chrono::milliseconds(100))
      return;
    last_redraw_ = now;
    const int width = 24;
    const int filled = static_cast<int>(width * done / std::max<int64_t>(1, total_steps_));
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(width, '.');
    std::printf("\r[%s] %lld/%lld loss %.4f %.0f samples/s ETA %s   ", bar.c_str(),
                static_cast<long long>(done), static_cast<long long>(total_steps_), loss,
                samples_per_s, Eta(eta).c_str());
    if (done == total_steps_) std::printf("\n");
    std::fflush(stdout);
    return;
  }
  window_loss_sum_ += loss;
  ++window_steps_;
  if (done % cfg_.log_every != 0 && done != total_steps_ && done != 1) return;
  // The mean over the steps since the last line: one batch's loss is too noisy to read.
  const double mean_loss = window_loss_sum_ / static_cast<double>(window_steps_);
  window_loss_sum_ = 0;
  window_steps_ = 0;
  std::ostringstream line;
  line << "step " << done << "/" << total_steps_ << " loss " << Fixed(mean_loss, 4) << " lr "
       << std::scientific << std::setprecision(2) << accel_->learning_rate() << std::fixed
       << " samples/s " << Fixed(samples_per_s, 0);
  if (const double mfu = Mfu(RankFlops(samples_per_s)); std::isfinite(mfu))
    line << " mfu " << Fixed(100 * mfu, 1) << "%";
  line << " comm_ms " << Fixed(comm_ms, 2) << " eta " << Eta(eta);
  accel_->Print(line.str());
}

Status Trainer::WriteFinal(double train_loss, double eval_loss, double eval_acc, double wall_s) {
  const uint64_t mine = ParameterChecksum(accel_->parameters());
  std::vector<double> stats;
  const bool pipelined = internals().pipeline() != nullptr;
  if (pipelined) stats = internals().GatherPipelineStats(mine);  // collective: before the return
  // Every rank's state bytes, peak RSS (KiB), peak CUDA allocation (bytes, -1 on the CPU) and
  // newest snapshot image (bytes; 0 without), rank by rank (collective too).
  std::vector<int64_t> own = internals().StateBytes();
  own.push_back(std::llround(PeakRssMb() * 1024));
  const bool cuda = accel_->device().is_cuda();
  own.push_back(cuda ? compat::CudaPeakAllocatedBytes(accel_->device().index()) : -1);
  own.push_back(accel_->snapshot_bytes());
  constexpr int kPerRank = 6;
  const torch::Tensor all = accel_->Gather(torch::tensor(own, torch::kLong));
  if (!accel_->IsMainProcess()) return Status::Ok();
  const int world = accel_->world_size();
  ordered_json state_bytes = ordered_json::object();
  const char* kinds[] = {"parameters", "gradients", "optimizer"};
  for (int k = 0; k < 3; ++k) {
    ordered_json& per_rank = state_bytes[kinds[k]] = ordered_json::array();
    for (int r = 0; r < world; ++r) per_rank.push_back(all[r * kPerRank + k].item<int64_t>());
  }
  ordered_json rss_mb = ordered_json::array(), device_mb = ordered_json::array();
  ordered_json snapshot_bytes = ordered_json::array();
  for (int r = 0; r < world; ++r) {
    rss_mb.push_back(static_cast<double>(all[r * kPerRank + 3].item<int64_t>()) / 1024);
    snapshot_bytes.push_back(all[r * kPerRank + 5].item<int64_t>());
    const int64_t device_bytes = all[r * kPerRank + 4].item<int64_t>();
    device_mb.push_back(device_bytes < 0
                            ? ordered_json(nullptr)
                            : ordered_json(static_cast<double>(device_bytes) / (1024.0 * 1024.0)));
  }
  std::string checksum = Hex64(mine);
  ordered_json pipeline;
  if (pipelined) {
    constexpr int kFields = PipelineEngine::kStatFields;
    const int stages = accel_->num_stages();
    // Field `field` of every stage's stats: counts as integers, the rest as they are.
    auto list = [&](int field, bool integer) {
      ordered_json out = ordered_json::array();
      for (int s = 0; s < stages; ++s) {
        const double v = stats[static_cast<size_t>(s * kFields + field)];
        if (integer) {
          out.push_back(static_cast<int64_t>(std::llround(v)));
        } else {
          out.push_back(v);
        }
      }
      return out;
    };
    ordered_json checksums = ordered_json::array();
    uint64_t combined = kFnv1aInit;
    for (int s = 0; s < stages; ++s) {
      const uint64_t h =
          (static_cast<uint64_t>(stats[static_cast<size_t>(s * kFields + 5)]) << 32) |
          static_cast<uint64_t>(stats[static_cast<size_t>(s * kFields + 6)]);
      combined = (combined ^ h) * 1099511628211ull;
      checksums.push_back(Hex64(h));
    }
    checksum = Hex64(combined);
    pipeline = {{"stages", stages},
                {"replicas", accel_->data_parallel_size()},
                {"microbatches", cfg_.parallel.microbatches},
                {"schedule", config::ToString(cfg_.parallel.schedule)},
                {"partition", partition_},
                {"peak_live_microbatches", list(0, true)},
                {"idle_fraction", list(1, false)},
                {"virtual_stages", cfg_.parallel.virtual_stages},
                {"theoretical_bubble",
                 TheoreticalBubble(stages, cfg_.parallel.microbatches, cfg_.parallel.schedule,
                                   cfg_.parallel.virtual_stages)},
                {"busy_s", list(2, false)},
                {"window_s", list(3, false)},
                {"peak_rss_mb", list(4, false)},
                {"peak_boundary_activation_bytes", list(7, true)},
                {"stage_param_checksums", std::move(checksums)}};
  }
  ordered_json summary = {{"steps", accel_->step()},
                          {"train_loss", train_loss},
                          {"eval_loss", eval_loss},
                          {"eval_accuracy", eval_acc},
                          {"loss_floor", data_.loss_floor},
                          {"param_checksum", checksum},
                          {"world_size", accel_->world_size()},
                          {"strategy", accel_->mode_name()},
                          {"buckets", accel_->num_buckets()},
                          {"allreduces_total", internals().allreduces_total()},
                          {"pair_exchanges_total", internals().pair_exchanges_total()},
                          {"reduce_scatters_total", internals().reduce_scatters_total()},
                          {"allgathers_total", internals().allgathers_total()},
                          {"alltoalls_total", internals().alltoalls_total()},
                          {"state_bytes", std::move(state_bytes)},
                          {"checkpoints", accel_->checkpoints_saved()},
                          {"checkpoint_blocking_ms", accel_->checkpoint_blocking_ms()},
                          {"snapshots", accel_->snapshots_taken()},
                          {"snapshot_ms", accel_->snapshot_ms()},
                          {"snapshot_copy_ms", accel_->snapshot_copy_ms()},
                          {"snapshot_bytes", std::move(snapshot_bytes)},
                          {"samples_seen_per_rank", accel_->samples_seen()},
                          {"samples_seen", accel_->samples_seen_global()},
                          // Steps the run advanced since its loop began (a resumed run: since
                          // the checkpoint), over in-place recoveries and across replacements.
                          {"steps_this_run", accel_->step() - accel_->run_clock().loop_first_step},
                          {"wall_s", wall_s},
                          {"loop_s", loop_s_}};
  // Utilization (model/flops.h, compat/peak_flops.h): this rank's, over this run's steps.
  const double tflops = run_step_s_ > 0 ? run_rank_flops_ / run_step_s_ / 1e12 : std::nan("");
  summary["flops_per_sample"] =
      flops_ ? ordered_json(flops_->train_per_sample) : ordered_json(nullptr);
  if (flops_ && flops_->tokens_per_sample > 0)
    summary["flops_per_token"] = flops_->train_per_sample / flops_->tokens_per_sample;
  summary["tflops"] = tflops;
  summary["mfu"] = Mfu(tflops * 1e12);
  summary["peak_tflops"] =
      peak_.known() ? ordered_json(peak_.flops_per_s / 1e12) : ordered_json(nullptr);
  summary["peak_source"] = peak_.source;
  summary["peak_rss_mb"] = std::move(rss_mb);
  if (cuda) summary["peak_device_memory_mb"] = std::move(device_mb);
  // In-place recovery: the run's recoveries (a replacement took the count with the state).
  if (accel_->recovers_in_place()) summary["recoveries"] = accel_->recoveries();
  if (accel_->fp16()) {  // rank 0's scaler (equal on every rank but under local_sgd and none)
    summary["loss_scale"] = accel_->loss_scale();
    summary["skipped_steps"] = accel_->skipped_steps();
  }
  if (pipelined) summary["pipeline"] = std::move(pipeline);
  // Hierarchical collectives: what rank 0, host 0's leader, ran across hosts (hierarchical.h).
  if (CountingProcessGroup* pg = internals().process_group(); pg && pg->hierarchical())
    summary["cross_host"] = {{"transport", accel_->allreduce_transport()},
                             {"operations_rank0", pg->cross_host_count()},
                             {"bytes_rank0", pg->cross_host_bytes()}};
  return WriteFileAtomically(cfg_.output_dir + "/final.json", JsonText(summary, 2));
}

Status Trainer::DumpParams() {
  std::string bytes;
  for (auto& p : accel_->parameters()) {
    auto t = p.detach().to(torch::kCPU, torch::kFloat).contiguous();
    bytes.append(static_cast<const char*>(t.data_ptr()),
                 static_cast<size_t>(t.numel()) * sizeof(float));
  }
  return WriteFileAtomically(
      cfg_.output_dir + "/params_rank" + std::to_string(accel_->rank()) + ".bin", bytes);
}

// output_dir/model.pt for PyTorch (SaveForPython), by rank 0; in pipeline mode each stage's
// first replica writes model_stage<S>.pt, and rank 0 joins them into model.pt (a built-in
// model; TorchScript stages stay one module each). COLLECTIVE (ddp: rank 0's buffers first).
Status Trainer::SaveModel() {
  const PipelineEngine* engine = internals().pipeline();
  if (!engine) return accel_->SaveForPython(cfg_.output_dir + "/model.pt");
  auto stage_file = [this](int s) {
    return cfg_.output_dir + "/model_stage" + std::to_string(s) + ".pt";
  };
  Status status = Status::Ok();
  if (engine->replica() == 0) {
    if (accel_->tensor_group()) {
      // The whole stage: its tensor group gathers the shards (COLLECTIVE), tensor 0 writes.
      auto whole = WholeStateOf(internals().model()->module());
      if (accel_->tensor_group()->rank() == 0)
        status = SaveStateForPython(whole, stage_file(engine->stage()));
    } else {
      status = SaveForPython(*internals().model(), stage_file(engine->stage()));
    }
  }
  if (cfg_.model.type == config::ModelType::kTorchScript) return status;
  accel_->Barrier();  // every stage's file is written (or failed) before rank 0 reads them
  if (accel_->rank() != 0 || !status.ok()) return status;
  std::vector<std::string> stages;
  for (int s = 0; s < engine->stages(); ++s) {
    if (!FileExists(stage_file(s))) {
      // Written on another machine: output_dir is not shared (checkpoints need it to be).
      accel_->Print("train: model.pt not written: " + stage_file(s) +
                    " is not on this machine (output_dir is not shared); the stages' files are "
                    "the model");
      return Status::Ok();
    }
    stages.push_back(stage_file(s));
  }
  return MergeStatesForPython(stages, cfg_.output_dir + "/model.pt");
}

}  // namespace train_internal
}  // namespace launch::trainer
