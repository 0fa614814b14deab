#pragma once

// The `train` program's Trainer (trainer.cc: preparing and the loop; outputs.cc: metrics.jsonl,
// the progress line, final.json, the model files), shared by its two files. Internal to `train`.

#include "trainer_runtime/train/trainer.h"

#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include "base/files.h"
#include "base/host.h"
#include "base/strings.h"
#include "trainer_runtime/api/accelerator.h"
#include "trainer_runtime/api/accelerator_internal.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/compat/cuda_device.h"
#include "trainer_runtime/compat/peak_flops.h"
#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/data/data.h"
#include "trainer_runtime/model/flops.h"
#include "trainer_runtime/model/model.h"
#include "trainer_runtime/model/pipeline_stages.h"
#include "trainer_runtime/parallel/pipeline_engine.h"
#include "trainer_runtime/state/checkpoint.h"
#include "trainer_runtime/util/loop_util.h"
#include "trainer_runtime/util/lr_schedule.h"
#include "trainer_runtime/util/pipeline_schedule.h"
#include "trainer_runtime/util/timeline.h"

namespace launch::trainer {
namespace train_internal {

using Clock = std::chrono::steady_clock;
using config::ParallelMode;
using nlohmann::ordered_json;  // metrics.jsonl and final.json keep their documented key order

// `j` as one line of text (indent -1) or indented, ending in a newline. NaN and infinities
// are written as null (JSON has neither); a string that is not UTF-8 gets U+FFFD instead of
// failing the write.
inline std::string JsonText(const ordered_json& j, int indent) {
  return j.dump(indent, ' ', false, ordered_json::error_handler_t::replace) + "\n";
}

inline std::string Eta(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--:--";
  long s = std::lround(seconds);
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof(buf), "%ld:%02ld:%02ld", s / 3600, (s / 60) % 60, s % 60);
  } else {
    std::snprintf(buf, sizeof(buf), "%02ld:%02ld", s / 60, s % 60);
  }
  return buf;
}

// The built-in data set's training rows as a torch::data batch dataset (positions index
// train_indices), so the built-in data go through the same sharded loader as a user's.
class TrainRows : public torch::data::datasets::BatchDataset<TrainRows, torch::data::Example<>,
                                                             c10::ArrayRef<size_t>> {
 public:
  explicit TrainRows(const Dataset* data) : data_(data) {}
  torch::data::Example<> get_batch(c10::ArrayRef<size_t> positions) override {
    std::vector<int64_t> rows;
    rows.reserve(positions.size());
    for (size_t pos : positions) rows.push_back(data_->train_indices[pos]);
    return {data_->Inputs(rows), data_->Targets(rows)};
  }
  c10::optional<size_t> size() const override { return data_->train_indices.size(); }

 private:
  const Dataset* data_;
};

// LAUNCH_TEST_SIGKILL_AT="RANK:STEP:PHASE[,...]" (tests of in-place recovery): the first
// workers (not replacements, not a restarted group's) of rank RANK SIGKILL themselves in step STEP
// at PHASE: forward (before it), backward (as it starts), optimizer (as the optimizer steps, after
// the gradients were averaged) or checkpoint (before the checkpoint after step STEP). PHASE stop:
// before the forward, the rank says so on stderr and stops itself (SIGSTOP) instead, holding the
// others in step STEP's collectives, so that a test can take its whole host away at that point.
// PHASE join (STEP 0): before it joins the process group, while the others form it.
struct DieAt {
  int rank = -1;
  int64_t step = 0;
  std::string phase;
};

inline StatusOr<std::vector<DieAt>> ParseDieAt(const char* text) {
  std::vector<DieAt> out;
  if (text == nullptr || *text == '\0') return out;
  for (const std::string& item : Split(text, ',')) {
    const std::vector<std::string> parts = Split(item, ':');
    long long rank = 0, step = 0;
    if (parts.size() != 3 || !ParseInt64(parts[0], &rank) || !ParseInt64(parts[1], &step) ||
        (parts[2] != "forward" && parts[2] != "backward" && parts[2] != "optimizer" &&
         parts[2] != "checkpoint" && parts[2] != "stop" && parts[2] != "join"))
      return Status::InvalidConfig(
          "environment LAUNCH_TEST_SIGKILL_AT: expected RANK:STEP:PHASE (forward, backward, "
          "optimizer, checkpoint, stop or join), got '" +
          item + "'");
    out.push_back({static_cast<int>(rank), static_cast<int64_t>(step), parts[2]});
  }
  return out;
}

// Seconds from `unix_ms` (Unix epoch milliseconds) to now; 0 for 0 (not set).
inline double SecondsSinceUnixMs(int64_t unix_ms) {
  if (unix_ms == 0) return 0;
  const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  return static_cast<double>(now - unix_ms) / 1000.0;
}

class Trainer {
 public:
  Trainer(const config::TrainConfig& cfg, const TrainerOptions& opts) : cfg_(cfg), opts_(opts) {}

  Status Run();
  // launch --spares: builds what needs no rank (the data set; LibTorch is loaded already), then
  // waits for the agent to hand this process a rank (AwaitSpareAssignment). False: the job needs
  // no spare any more (exit 0 without training). Called before signal handlers are installed,
  // so that a SIGTERM ends a waiting spare at once. True at once for a process that is not one.
  StatusOr<bool> WaitAsSpare();
  // What the loop was doing, for error messages: "rank 1, stage 0, backward at step 12", or
  // "rank 0, signal poll after step 11" for the work between two steps.
  std::string Phase() const {
    std::string where = "rank " + std::to_string(accel_ ? accel_->rank() : 0) + ", ";
    if (accel_ && accel_->num_stages() > 1)
      where += "stage " + std::to_string(accel_->stage_index()) + ", ";
    const int64_t done = accel_ ? accel_->step() : 0;
    if (between_steps_.load()) return where + phase_.load() + " after step " + std::to_string(done);
    return where + phase_.load() + " at step " + std::to_string(done + 1);
  }

 private:
  Status Prepare();
  Status PrepareReplica();
  // Seeds the dropout stream of this rank's replica (after the model is built).
  void SeedDropout();
  Status PreparePipelineStage();
  Status MaybeResume();
  // The model's FLOPs per sample and this rank's peak FLOP/s (measured on the CPU: every rank
  // measures its own, at the same time as the others, as it will train), announced in one line.
  void PrepareUtilization();
  // This rank's share of the model FLOPs of `samples` samples of the whole job: the whole
  // model's training FLOPs spread evenly over the world. Data-parallel ranks each train their
  // own samples; pipeline stages and ZeRO shards split one replica's work between them, and
  // an even split is what MFU compares against the per-rank peak. NaN without a count.
  double RankFlops(double samples) const {
    if (!flops_) return std::nan("");
    return static_cast<double>(flops_->train_per_sample) * samples / accel_->world_size();
  }
  // Achieved over peak, or NaN when either is unknown.
  double Mfu(double flops_per_s) const {
    return peak_.known() ? flops_per_s / peak_.flops_per_s : std::nan("");
  }
  // Optimizer steps of the configured run when each rank has `batches_per_epoch` batches an
  // epoch: max_steps, or `epochs` of them.
  int64_t RunSteps(int64_t batches_per_epoch) const;
  // Steps left from the loader's position to the end of the configured epochs (after a resume
  // at another world size, whose epochs have other lengths).
  int64_t RemainingSteps() const;
  // After a resume: the run's length in this world, and the LR schedule's anchor when the
  // world size changed (Accelerator::ScheduleAnchor).
  void SetRunLength();
  void TrainStep();
  void Evaluate(double* loss, double* accuracy);
  // metrics.jsonl's line for an evaluation during training: step, eval_loss, eval_accuracy.
  Status WriteEvalLine(double loss, double accuracy);
  // An evaluation's loss (and accuracy unless NaN) as TensorBoard scalars at this step.
  Status LogEval(double loss, double accuracy);
  Status WriteMetricsLine(const Accelerator::CommStats& comm, double loss, double step_s,
                          int64_t samples);
  Status AppendMetrics(const ordered_json& line);  // one line, flushed; IoError naming the file
  Status WriteFinal(double train_loss, double eval_loss, double eval_acc, double wall_s);
  Status DumpParams();
  Status SaveModel();
  void Report(double loss, double samples_per_s, double comm_ms);
  std::string CheckpointDir() const {
    return cfg_.resume != "auto" && cfg_.resume != "never" ? cfg_.resume
                                                           : cfg_.output_dir + "/checkpoints";
  }
  std::string WriteDir() const { return cfg_.output_dir + "/checkpoints"; }
  // LAUNCH_TEST_SIGKILL_AT: dies here when this rank, `step` and `phase` are listed.
  void MaybeDie(int64_t step, const char* phase) const {
    for (const DieAt& d : die_at_) {
      if (d.rank != accel_->rank() || d.step != step) continue;
      if (d.phase == phase) ::raise(SIGKILL);
      if (d.phase == "stop" && std::string(phase) == "forward") {
        std::fprintf(stderr, "train: rank %d: LAUNCH_TEST_SIGKILL_AT: stopped before step %lld\n",
                     d.rank, static_cast<long long>(step));
        std::fflush(stderr);
        ::raise(SIGSTOP);
      }
    }
  }
  // Seed of the augmentation of this rank's batch `batch` of epoch `epoch`.
  uint64_t AugmentSeed(int64_t epoch, int64_t batch) const {
    uint64_t h = cfg_.seed * 0x9E3779B97F4A7C15ull;
    for (uint64_t v : {static_cast<uint64_t>(epoch), static_cast<uint64_t>(batch),
                       static_cast<uint64_t>(accel_->data_parallel_rank())})
      h = (h ^ (v + 0x632BE59BD9B4E019ull)) * 0xBF58476D1CE4E5B9ull;
    return h;
  }

  config::TrainConfig cfg_;
  TrainerOptions opts_;
  std::unique_ptr<Accelerator> accel_;
  AcceleratorInternals internals() const { return AcceleratorInternals(*accel_); }
  bool tty_ = false;
  Clock::time_point last_redraw_;  // the progress bar's (Report)
  Dataset data_;
  bool data_loaded_ = false;  // by WaitAsSpare, before the process group
  Criterion criterion_;
  std::optional<DistributedDataLoader<TrainRows>> loader_;
  std::vector<int64_t> partition_;
  int64_t total_steps_ = 0;     // the step the run ends at, in this world
  int64_t schedule_steps_ = 0;  // the LR schedule's length: the run's steps in its first world
  std::optional<TrainState> peeked_;  // the checkpoint MaybeResume may resume (rank 0's file)
  // The phase for Phase(): a string literal. Atomic because dp's replicas run the forward
  // closure (which sets "forward" and "backward") on their own threads.
  std::atomic<const char*> phase_{"setup"};
  std::atomic<bool> between_steps_{false};  // phase_ is work after a step (poll, checkpoint)
  void SetPhase(const char* phase, bool between_steps = false) {
    phase_ = phase;
    between_steps_ = between_steps;
  }
  std::ofstream metrics_;
  double last_loss_ = std::nan("");
  double ema_samples_per_s_ = 0;
  Clock::time_point train_start_;
  int64_t steps_this_run_ = 0;
  double window_loss_sum_ = 0;  // plain log lines: loss summed since the last line
  int64_t window_steps_ = 0;
  double loop_s_ = 0;          // the training loop alone (no setup, no final eval): for benchmarks
  std::vector<DieAt> die_at_;  // LAUNCH_TEST_SIGKILL_AT (first workers only)

  // Utilization (PrepareUtilization).
  std::optional<ModelFlops> flops_;  // none for a TorchScript model
  PeakFlops peak_;                   // this rank's
  double run_rank_flops_ = 0;        // RankFlops of this run's steps so far
  double run_step_s_ = 0;            // and their time
};

}  // namespace train_internal
}  // namespace launch::trainer
