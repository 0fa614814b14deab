#include "trainer_runtime/api/accelerator.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "base/environment.h"
#include "base/exit_status.h"
#include "base/files.h"
#include "base/strings.h"
#include "config/train_keys.h"
#include "trainer_runtime/api/accelerator_internal.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/comm/recovery.h"
#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/model/model.h"
#include "trainer_runtime/parallel/layout.h"
#include "trainer_runtime/parallel/pipeline_engine.h"
#include "trainer_runtime/parallel/strategy.h"
#include "trainer_runtime/parallel/strategy_factory.h"
#include "trainer_runtime/state/checkpoint.h"
#include "trainer_runtime/state/file_sums.h"
#include "trainer_runtime/state/reshard.h"
#include "trainer_runtime/util/loop_util.h"
#include "trainer_runtime/util/timeline.h"

namespace launch::trainer {
namespace {

// The one signal flag: the last signal received, 0 when none. A stop (SIGTERM,
// SIGINT) outranks a checkpoint request (SIGUSR1, SIGUSR2). PollSignals reads and clears it at
// a step boundary, where the state is consistent.
volatile std::sig_atomic_t g_signal = 0;

extern "C" void OnSignal(int signo) {
  const bool stop_pending = g_signal == SIGTERM || g_signal == SIGINT;
  if ((signo == SIGUSR1 || signo == SIGUSR2) && stop_pending) return;
  g_signal = signo;
}

bool IsStop(int signo) { return signo == SIGTERM || signo == SIGINT; }

// The run settings a checkpoint was written with (Accelerator::AddRunSetting), "key: value"
// per line: small, and readable by whoever wonders why a resume was refused.
constexpr const char* kRunFile = "run.txt";

std::string StepDir(const std::string& dir, int64_t step) {
  return dir + "/step" + std::to_string(step);
}

// The step<N> folders in `dir`, by N ascending (complete or not).
std::vector<int64_t> StepFolders(const std::string& dir) {
  std::vector<int64_t> steps;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return steps;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    long long n = 0;
    if (StartsWith(name, "step") && ParseInt64(name.substr(4), &n) && n >= 0) steps.push_back(n);
  }
  ::closedir(d);
  std::sort(steps.begin(), steps.end());
  return steps;
}

// Removes a folder of files and of folders of files (a step folder: pair<i>/ holds files).
void RemoveTree(const std::string& path) {
  if (DIR* d = ::opendir(path.c_str())) {
    while (dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      const std::string child = path + "/" + name;
      if (std::remove(child.c_str()) != 0) RemoveTree(child);
    }
    ::closedir(d);
  }
  ::rmdir(path.c_str());
}

// Removes `dir`'s step folders other than the `keep` highest steps up to `latest` (a folder
// above `latest` was left by a run that resumed an earlier step: superseded too).
void RemoveOtherSteps(const std::string& dir, int64_t latest, int64_t keep) {
  const std::vector<int64_t> steps = StepFolders(dir);
  int64_t kept = 0;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (*it <= latest && kept < keep) {
      ++kept;
      continue;
    }
    RemoveTree(StepDir(dir, *it));
  }
}

bool IsDirectory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// Whether the checkpoint of `step` in `dir` is whole: every rank hashes its share of the
// folder's SHA256SUMS (file_sums.h) and names what it found damaged; all decide alike. Empty
// when whole (or written before checkpoints listed their files: said once), else a summary.
// COLLECTIVE.
std::string CheckpointDamage(Accelerator& accel, const std::string& dir, int64_t step) {
  const std::string step_dir = StepDir(dir, step);
  FileSumsCheck check;
  if (!IsDirectory(step_dir)) {
    check.listed = true;
    if (accel.rank() == 0) check.damage.push_back("the folder is missing");
  } else {
    check = CheckFileSums(step_dir, accel.rank(), accel.world_size());
    // A save killed before its commit leaves no rank0.pt, and `latest` never names it.
    if (!check.listed && accel.rank() == 0 && !FileExists(step_dir + "/rank0.pt"))
      check.damage.push_back("rank0.pt: missing");
  }
  for (const std::string& d : check.damage)
    std::fprintf(stderr, "train: rank %d: checkpoint %s: %s\n", accel.rank(), step_dir.c_str(),
                 d.c_str());
  auto counts = torch::tensor({static_cast<double>(check.damage.size()), check.listed ? 0.0 : 1.0},
                              torch::kDouble);
  accel.AllReduceSum(counts);
  const int64_t damaged = static_cast<int64_t>(counts[0].item<double>());
  if (damaged == 0) {
    if (counts[1].item<double>() > 0)
      accel.Print("train: " + step_dir + " lists no SHA256SUMS (written before checkpoints " +
                  "were verified): loaded unchecked");
    return "";
  }
  return std::to_string(damaged) + " damaged file" + (damaged == 1 ? "" : "s") +
         (check.damage.empty() ? "" : ", e.g. " + check.damage.front()) +
         "; each rank names those it checked above";
}

}  // namespace

// --- Signals and state -----------------------------------------------------------------------

void Accelerator::InstallSignalHandlers() {
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int signo : {SIGUSR1, SIGUSR2, SIGTERM, SIGINT}) sigaction(signo, &sa, nullptr);
}

SignalRequest Accelerator::PollSignals() {
  const int local = g_signal;
  if (local != 0) g_signal = 0;
  // Agree on the largest (stop, signal) any rank received: a stop anywhere stops everyone at
  // this step. Each rank marks its own in a presence vector, summed over the ranks (a sum, so it
  // takes the shared-memory path; see AllReduceSum).
  constexpr int kSignals = 65;  // signal numbers below 65; index = stop * kSignals + signo
  auto t = torch::zeros({2 * kSignals}, torch::kDouble);
  if (local > 0 && local < kSignals) t[(IsStop(local) ? kSignals : 0) + local] = 1.0;
  if (!Guarded([&] { SumInPlace(t); })) {
    // A lost peer (in-place recovery): the ranks agree on it at the next poll, after recovering.
    if (local != 0 && g_signal == 0) g_signal = local;
    return SignalRequest();
  }
  SignalRequest r;
  const auto seen = t.accessor<double, 1>();
  for (int code = 2 * kSignals - 1; code > 0; --code) {
    if (seen[code] == 0) continue;
    r.signal = code % kSignals;
    r.stop = code >= kSignals;
    r.checkpoint = true;
    break;
  }
  return r;
}

TrainState Accelerator::CurrentTrainState() const {
  TrainState state;
  state.step = step_;
  state.epoch = cursor_ ? cursor_->epoch : 0;
  state.batch_in_epoch = cursor_ ? cursor_->batch : 0;
  state.samples_seen = samples_seen_;
  state.world_size = world_size();
  state.data_world = data_parallel_size();
  state.epoch_start = cursor_ ? cursor_->start : 0;
  state.epoch_offset = cursor_ ? cursor_->offset() : 0;
  state.samples_seen_global = samples_seen_global_;
  state.origin_data_world = origin_data_world_;
  state.origin_batch_size = origin_batch_size_;
  state.anchor_step = schedule_anchor_.step;
  state.anchor_position = schedule_anchor_.position;
  state.anchor_slope = schedule_anchor_.slope;
  if (scaler_) {
    state.loss_scale = scaler_->scale();
    state.scale_growth_tracker = scaler_->growth_tracker();
    state.skipped_steps = scaler_->skipped();
  }
  return state;
}

Status Accelerator::WriteStateFiles(const std::string& step_dir, const TrainState& state) {
  RecordingWrites written;  // this rank's half of the folder's SHA256SUMS (file_sums.h)
  Status status = Status::Ok();
  for (size_t i = 0; i < pairs_.size() && status.ok(); ++i)
    status = pairs_[i].strategy->SaveModelState(PairDir(step_dir, i), *pairs_[i].optimizer);
  if (status.ok()) status = SaveUserState(step_dir);
  if (status.ok())
    status = SaveRankState(step_dir + "/rank" + std::to_string(rank()) + ".pt", state);
  if (status.ok()) status = WriteRankFileSums(step_dir, rank(), written.files());
  return status;
}

Status Accelerator::SaveState(const std::string& dir) {
  LAUNCH_CHECK(prepared_);
  if (peer_lost_) {
    std::fprintf(stderr,
                 "train: rank %d: no checkpoint at step %lld: a peer was lost (the previous one "
                 "stays the latest)\n",
                 rank(), static_cast<long long>(step_));
    return Status::Ok();
  }
  // One save at a time: an earlier asynchronous one is committed first.
  LAUNCH_RETURN_IF_ERROR(WaitForCheckpoint());
  const auto start = std::chrono::steady_clock::now();
  const std::string step_dir = StepDir(dir, step_);
  const TrainState state = CurrentTrainState();
  Status status = MakeDirs(step_dir);
  for (size_t i = 0; i < pairs_.size() && status.ok(); ++i) status = MakeDirs(PairDir(step_dir, i));
  if (status.ok() && rank() == 0) {
    std::string run;
    for (const auto& [key, value] : run_settings_) run += key + ": " + value + "\n";
    status = WriteFileAtomically(step_dir + "/" + kRunFile, run);
  }
  if (!finished_) ++checkpoints_saved_;
  if (!options_.checkpoint_async || finished_) {
    if (status.ok()) status = WriteStateFiles(step_dir, state);
    status = CommitState(dir, step_, status);
    if (!finished_)
      checkpoint_blocking_ms_ += 1000 * Seconds(std::chrono::steady_clock::now() - start);
    if (!status.ok() && peer_lost_) {
      std::fprintf(stderr,
                   "train: rank %d: the checkpoint of step %lld was not committed: a peer was "
                   "lost (the previous one stays the latest)\n",
                   rank(), static_cast<long long>(step_));
      return Status::Ok();
    }
    return status;
  }
  if (status.ok()) status = ForkStateWriter(step_dir, state);
  // Pending on every rank alike, so that all take part in the commit's collectives; a rank
  // that could not start its writer fails the commit for all.
  save_pending_ = true;
  pending_dir_ = dir;
  pending_step_ = step_;
  writer_status_ = status;
  checkpoint_blocking_ms_ += 1000 * Seconds(std::chrono::steady_clock::now() - start);
  return Status::Ok();
}

pid_t ForkChild(const std::function<int()>& body) {
  std::fflush(nullptr);
  const pid_t parent = ::getpid();
  const pid_t child = ::fork();
  if (child != 0) return child;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(1);  // the parent died before the line above
  ::_exit(body());
}

Status Accelerator::ForkStateWriter(const std::string& step_dir, const TrainState& state) {
  Timeline::Scope span("train", "checkpoint (fork)");
  // What needs the group happens here (zero stage 3 gathers its parameters); the child only
  // writes files.
  for (Pair& pair : pairs_)
    if (pair.strategy) pair.strategy->BeginSnapshot();
  // The writer dies with the worker, so a kill never leaves one behind.
  const pid_t child = ForkChild([&] {
    const Status written = WriteStateFiles(step_dir, state);
    if (!written.ok())
      std::fprintf(stderr, "train: rank %d: writing the checkpoint of step %lld: %s\n", rank(),
                   static_cast<long long>(state.step), written.message().c_str());
    return written.ok() ? 0 : 1;
  });
  const int fork_errno = errno;
  for (Pair& pair : pairs_)
    if (pair.strategy) pair.strategy->EndSnapshot();
  if (child < 0)
    return Status::IoError("rank " + std::to_string(rank()) + ": the checkpoint of step " +
                           std::to_string(state.step) + ": fork: " + std::strerror(fork_errno));
  writer_pid_ = child;
  return Status::Ok();
}

Status Accelerator::CommitState(const std::string& dir, int64_t step, const Status& status) {
  // Everyone learns whether every file was written before `latest` moves.
  auto failed = torch::tensor({status.ok() ? 0.0 : 1.0}, torch::kDouble);
  AllReduceSum(failed);
  // A lost peer (in-place recovery): whether it wrote its files is unknown, so `latest` stays.
  if (peer_lost_) return Status::PeerLost("a peer was lost before the checkpoint was committed");
  const std::string step_dir = StepDir(dir, step);
  if (failed.item<double>() > 0) {
    // Every writer has ended (each rank waited for its own before the sum): the partial folder
    // goes, or a full disk stays full. Not when `latest` names it (a save of that step again).
    StatusOr<int64_t> latest = LatestStep(dir);
    if (rank() == 0 && !(latest.ok() && *latest == step)) {
      RemoveTree(step_dir);
      std::fprintf(stderr, "train: removed the partial checkpoint %s\n", step_dir.c_str());
    }
    if (!status.ok()) return status;
    return Status::IoError("another rank failed to write its part of the checkpoint for step " +
                           std::to_string(step));
  }
  if (rank() == 0) {
    LAUNCH_RETURN_IF_ERROR(JoinFileSums(step_dir, world_size(), {kRunFile}));
    LAUNCH_RETURN_IF_ERROR(WriteFileAtomically(dir + "/latest", std::to_string(step) + "\n"));
    // Superseded once `latest` names the new step (train.checkpoint_keep keeps more).
    RemoveOtherSteps(dir, step, std::max<int64_t>(1, options_.checkpoint_keep));
  }
  Barrier();  // nobody reads `latest` before it is written
  return Status::Ok();
}

void Accelerator::ReapStateWriter(bool block) {
  if (writer_pid_ <= 0) return;
  int wait_status = 0;
  pid_t got;
  do {
    got = ::waitpid(writer_pid_, &wait_status, block ? 0 : WNOHANG);
  } while (got < 0 && errno == EINTR);
  if (got == 0) return;  // still writing
  if (got < 0) {
    writer_status_ =
        Status::IoError("rank " + std::to_string(rank()) +
                        ": waiting for the checkpoint writer: " + std::strerror(errno));
  } else if (const ExitStatus exit = ExitStatus::FromWaitStatus(wait_status); !exit.success()) {
    writer_status_ = Status::IoError("rank " + std::to_string(rank()) +
                                     ": the process writing the checkpoint of step " +
                                     std::to_string(pending_step_) + " " + exit.ToString());
  }
  writer_pid_ = -1;
}

Status Accelerator::WaitForCheckpoint() {
  if (save_pending_) {
    Timeline::Scope span("train", "checkpoint (waiting for the writer)");
    const auto start = std::chrono::steady_clock::now();
    ReapStateWriter(/*block=*/true);
    save_pending_ = false;
    Status committed = CommitState(pending_dir_, pending_step_, writer_status_);
    checkpoint_blocking_ms_ += 1000 * Seconds(std::chrono::steady_clock::now() - start);
    if (!committed.ok() && !peer_lost_) return committed;
  }
  Status error = save_error_;
  save_error_ = Status::Ok();
  return error;
}

void Accelerator::PollPendingSave() {
  ReapStateWriter(/*block=*/false);
  // Ranks whose writer still runs: all act on the same count.
  auto writing = torch::tensor({writer_pid_ > 0 ? 1.0 : 0.0}, torch::kDouble);
  AllReduceSum(writing);
  if (writing.item<double>() > 0) return;
  save_pending_ = false;
  Status committed = CommitState(pending_dir_, pending_step_, writer_status_);
  if (!committed.ok() && peer_lost_) {
    std::fprintf(stderr, "train: rank %d: the checkpoint of step %lld was not committed: %s\n",
                 rank(), static_cast<long long>(pending_step_), committed.message().c_str());
  } else if (!committed.ok()) {
    // Said now, and returned by the next SaveState, WaitForCheckpoint or Finish.
    std::fprintf(stderr, "train: rank %d: the checkpoint of step %lld was not committed: %s\n",
                 rank(), static_cast<long long>(pending_step_), committed.message().c_str());
    save_error_ = committed;
  }
}

void Accelerator::AddRunSetting(const std::string& key, const std::string& value) {
  for (auto& [k, v] : run_settings_)
    if (k == key) {
      v = value;
      return;
    }
  run_settings_.emplace_back(key, value);
}

std::vector<std::string> Accelerator::ChangedSettings(const std::string& dir) const {
  StatusOr<int64_t> latest = LatestStep(dir);
  if (!latest.ok()) return {};
  return ChangedSettingsAt(dir, *latest);
}

std::vector<std::string> Accelerator::ChangedSettingsAt(const std::string& dir,
                                                        int64_t step) const {
  std::vector<std::string> changes;
  StatusOr<std::string> text = ReadFile(StepDir(dir, step) + "/" + kRunFile);
  if (!text.ok()) return changes;
  std::vector<std::pair<std::string, std::string>> recorded;
  for (const std::string& line : Split(*text, '\n')) {
    const size_t colon = line.find(": ");
    if (colon != std::string::npos)
      recorded.emplace_back(line.substr(0, colon), line.substr(colon + 2));
  }
  auto find = [](const auto& list, const std::string& key) -> const std::string* {
    for (const auto& [k, v] : list)
      if (k == key) return &v;
    return nullptr;
  };
  for (const auto& [key, value] : run_settings_) {
    const std::string* old = find(recorded, key);
    if (!old) {
      changes.push_back(key + ": (not set) -> " + value);
    } else if (*old != value) {
      changes.push_back(key + ": " + *old + " -> " + value);
    }
  }
  for (const auto& [key, value] : recorded)
    if (!find(run_settings_, key) && !config::FormerTrajectorySetting(key))
      changes.push_back(key + ": " + value + " -> (not set)");
  return changes;
}

StatusOr<int64_t> Accelerator::LatestStep(const std::string& dir) {
  StatusOr<std::string> latest = ReadFile(dir + "/latest");
  if (!latest.ok()) return Status::NotFound("no checkpoint in '" + dir + "'");
  long long step = 0;
  if (!ParseInt64(Trim(*latest), &step) || step < 0)
    return Status::IoError(dir + "/latest: expected a step number, got '" + *latest + "'");
  return static_cast<int64_t>(step);
}

std::vector<int64_t> Accelerator::SavedSteps(const std::string& dir) {
  // Complete: the folder has run.txt, which rank 0 writes first, and rank 0's state, written
  // last of its files (a folder of a save killed midway may lack it; `latest` never names one).
  std::vector<int64_t> steps;
  for (int64_t step : StepFolders(dir))
    if (FileExists(StepDir(dir, step) + "/rank0.pt")) steps.push_back(step);
  return steps;
}

StatusOr<bool> Accelerator::LoadState(const std::string& dir) { return LoadStateAt(dir, {}); }

StatusOr<bool> Accelerator::LoadState(const std::string& dir, int64_t step) {
  return LoadStateAt(dir, step);
}

StatusOr<bool> Accelerator::LoadStateAt(const std::string& dir, std::optional<int64_t> step) {
  LAUNCH_CHECK(prepared_);
  if (joined_from_peer_) return true;  // the state came from a live peer (Prepare)
  int64_t mine = -1;
  if (step) {
    const std::vector<int64_t> saved = SavedSteps(dir);
    if (std::find(saved.begin(), saved.end(), *step) != saved.end()) mine = *step;
  } else {
    StatusOr<int64_t> latest = LatestStep(dir);
    if (!latest.ok() && latest.status().code() != Status::Code::kNotFound) return latest.status();
    mine = latest.ok() ? *latest : -1;
  }
  // Every rank must resume the same step (or none): a rank that sees another file system would
  // otherwise run a different number of steps and hang in a mismatched collective.
  auto range =
      torch::tensor({static_cast<double>(mine), -static_cast<double>(mine)}, torch::kDouble);
  if (c10d::ProcessGroup* pg = control()) {
    std::vector<at::Tensor> v = {range};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MAX;
    pg->allreduce(v, opts)->wait();
  }
  const int64_t highest = static_cast<int64_t>(range[0].item<double>());
  const int64_t lowest = -static_cast<int64_t>(range[1].item<double>());
  if (highest != lowest)
    return Status::Internal("rank " + std::to_string(rank()) + " sees checkpoint step " +
                            (mine < 0 ? std::string("none") : std::to_string(mine)) + " in " + dir +
                            " but other ranks see steps " + std::to_string(lowest) + ".." +
                            std::to_string(highest) +
                            " (is the output folder on a file system every node shares?)");
  if (mine < 0 && step) {
    std::string steps;
    for (int64_t s : SavedSteps(dir)) steps += (steps.empty() ? "" : ", ") + std::to_string(s);
    return Status::NotFound("no checkpoint of step " + std::to_string(*step) + " in '" + dir +
                            "' (it holds " + (steps.empty() ? "none" : "steps " + steps) +
                            "; train.checkpoint_keep keeps more than the latest)");
  }
  if (mine < 0) return false;
  // Never a damaged checkpoint: the latest falls back to the previous one kept. Every rank sees
  // the same folders (checked above) and the same damage count, so all walk alike.
  for (std::string damage = CheckpointDamage(*this, dir, mine); !damage.empty();
       damage = CheckpointDamage(*this, dir, mine)) {
    const std::vector<int64_t> saved = SavedSteps(dir);
    const auto earlier =
        std::find_if(saved.rbegin(), saved.rend(), [&](int64_t s) { return s < mine; });
    const std::string what = "the checkpoint of step " + std::to_string(mine) + " in " + dir +
                             " is damaged (" + damage + ")";
    if (step || earlier == saved.rend())
      return Status::IoError(
          what +
          (step ? ""
                : " and no earlier checkpoint is kept (train.checkpoint_keep keeps "
                  "more)") +
          ": restore the files, or start a new run (`resume: never` or another output_dir)");
    Print("train: " + what + "; resuming from step " + std::to_string(*earlier) +
          ", the previous checkpoint kept");
    mine = *earlier;
  }
  // Every rank reads the same run.txt and holds the same settings, so all decide alike.
  const std::vector<std::string> changes = ChangedSettingsAt(dir, mine);
  if (!changes.empty() && !options_.resume_allow_changes)
    return Status::InvalidConfig(
        "the checkpoint in " + dir + " (step " + std::to_string(mine) +
        ") was written with other settings: " + Join(changes, "; ") +
        ". Resume with the settings it was written with, start a new run (another output_dir "
        "or `resume: never`), or set `train.resume_allow_changes: true` to continue with the "
        "new settings");
  if (!changes.empty())
    Print("train: resuming step " + std::to_string(mine) +
          " with changed settings: " + Join(changes, "; "));
  const std::string step_dir = StepDir(dir, mine);
  std::string rank_file = step_dir + "/rank" + std::to_string(rank()) + ".pt";
  const bool own_rng = FileExists(rank_file);
  if (!own_rng) rank_file = step_dir + "/rank0.pt";
  LAUNCH_ASSIGN_OR_RETURN(TrainState state, LoadRankState(rank_file, own_rng));
  if (!own_rng && rank() < state.world_size)
    return Status::IoError(step_dir + "/rank" + std::to_string(rank()) + ".pt is missing (the " +
                           "checkpoint was written by " + std::to_string(state.world_size) +
                           " ranks, this one among them)");
  for (size_t i = 0; i < pairs_.size(); ++i)
    LAUNCH_RETURN_IF_ERROR(LoadPairState(dir, step_dir, i, state.world_size));
  LAUNCH_RETURN_IF_ERROR(LoadUserState(step_dir));
  LoadTrainState(state);
  if (!own_rng) {
    const uint64_t seed = NewRankSeed(options_.seed, rank(), state.step);
    torch::manual_seed(seed);
    std::fprintf(stderr,
                 "train: rank %d: the checkpoint (written by %lld ranks) has no RNG state for this "
                 "rank; it draws a new stream seeded from (seed %llu, rank %d, step %lld)\n",
                 rank(), static_cast<long long>(state.world_size),
                 static_cast<unsigned long long>(options_.seed), rank(),
                 static_cast<long long>(state.step));
  }
  ApplyRestoredCursor();
  MarkBoundary();
  return true;
}

namespace {

// Whether this rank's folder of a checkpoint cut as this layout is holds the parameters `model`
// has: the same cut can hold other layers, as an interleaved pipeline's rank keeps several
// chunks, so another virtual_stages gives its stage folder other parameters.
bool HoldsItsParameters(const std::vector<ShardFolder>& folders, const ParallelLayout& layout,
                        const Model& model) {
  for (const ShardFolder& f : folders) {
    if (f.stage != layout.coordinate(Axis::kStage) ||
        f.tensor != layout.coordinate(Axis::kTensor) || !HasShardedOptimizerState(f.path))
      continue;
    StatusOr<std::vector<std::string>> names = ShardIndexNames(f.path);
    if (!names.ok()) return true;  // loading says what is wrong with the folder
    std::set<std::string> held(names->begin(), names->end()), mine;
    for (const auto& [name, p] : model.NamedParameters()) mine.insert(name);
    return held == mine;
  }
  return true;
}

}  // namespace

Status Accelerator::LoadPairState(const std::string& dir, const std::string& step_dir, size_t i,
                                  int64_t written_by) {
  Pair& pair = pairs_[i];
  const bool pipelined = options_.parallel.pipelined();
  const int stages = pipelined ? layout_->degree(Axis::kStage) : 1;
  const int tensor = layout_->degree(Axis::kTensor);
  const std::vector<ShardFolder> folders =
      ShardFoldersOf(i == 0 ? step_dir : step_dir + "/pair" + std::to_string(i));
  if (CutAs(folders, stages, tensor) &&
      (!pipelined || HoldsItsParameters(folders, *layout_, *pair.model)))
    return pair.strategy->LoadModelState(PairDir(step_dir, i), *pair.optimizer, written_by);
  // Another layout wrote it: this rank's folder is made from the checkpoint's, in a scratch
  // folder of its own, and loaded as if this layout had written it.
  Print("train: the checkpoint in " + step_dir + " was cut as " + DescribeCut(folders) +
        "; each rank re-cuts its shard for " + layout_->Describe() +
        " from the folders that hold its parameters");
  const std::string scratch = dir + "/.recut-rank" + std::to_string(rank());
  std::error_code ec;
  std::filesystem::remove_all(scratch, ec);  // one a killed run left
  const std::string pair_dir = PairDir(scratch, i);
  Status status = WriteRecutFolder(folders, *pair.model, *pair.optimizer, tensor,
                                   layout_->coordinate(Axis::kTensor),
                                   pipelined ? pair_dir + "/" + layout_->ShardName() : pair_dir);
  if (status.ok()) status = pair.strategy->LoadModelState(pair_dir, *pair.optimizer, 1);
  std::filesystem::remove_all(scratch, ec);
  return status;
}

void Accelerator::LoadTrainState(const TrainState& state) {
  step_ = state.step;
  schedule_anchor_ = {state.anchor_step, state.anchor_position, state.anchor_slope};
  if (scaler_)
    scaler_->Restore(static_cast<float>(state.loss_scale), state.scale_growth_tracker,
                     state.skipped_steps);
  // Checkpoints from before data_world was recorded know only the world size.
  const bool recorded = state.data_world > 0;
  const int data_world = data_parallel_size();
  const int64_t old_world =
      recorded ? state.data_world
               : std::max<int64_t>(1, state.world_size / (world_size() / data_world));
  restored_data_world_ = recorded ? state.data_world : 0;
  origin_data_world_ = state.origin_data_world > 0 ? state.origin_data_world : old_world;
  origin_batch_size_ = state.origin_batch_size > 0 ? state.origin_batch_size : options_.batch_size;
  samples_seen_global_ = recorded ? state.samples_seen_global : state.samples_seen * old_world;
  samples_seen_ = old_world == data_world ? state.samples_seen : samples_seen_global_ / data_world;
  LoaderCursor cursor;
  cursor.epoch = state.epoch;
  if (recorded ? old_world == data_world : state.world_size == world_size()) {
    cursor.start = state.epoch_start;  // the same batches, numbered alike: bit-identical
    cursor.batch = state.batch_in_epoch;
  } else if (recorded) {
    cursor.start = state.epoch_offset;  // the rest of the epoch over the new ranks (sampler.h)
    resharded_from_ = old_world;        // AttachCursor says how it is dealt
  } else {
    Print(WorldSizeChangedWarning(state.world_size, world_size()));
    ++cursor.epoch;
  }
  restored_cursor_ = cursor;
}

bool StopRequested() { return IsStop(g_signal); }

uint64_t NewRankSeed(uint64_t seed, int rank, int64_t step) {
  uint64_t h = seed * 0x9E3779B97F4A7C15ull + 0x7F4A7C15D1B54A32ull;
  for (uint64_t v : {static_cast<uint64_t>(rank), static_cast<uint64_t>(step)})
    h = (h ^ (v + 0x632BE59BD9B4E019ull)) * 0xBF58476D1CE4E5B9ull;
  return h ^ (h >> 31);
}

}  // namespace launch::trainer
