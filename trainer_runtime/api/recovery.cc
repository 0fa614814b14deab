#include "trainer_runtime/api/accelerator.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
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
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "base/environment.h"
#include "base/exit_status.h"
#include "base/files.h"
#include "base/strings.h"
#include "config/train_keys.h"
#include "trainer_runtime/api/accelerator_internal.h"
#include "trainer_runtime/comm/loss_watch.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/comm/recovery.h"
#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/model/model.h"
#include "trainer_runtime/parallel/layout.h"
#include "trainer_runtime/parallel/pipeline_engine.h"
#include "trainer_runtime/parallel/strategy.h"
#include "trainer_runtime/parallel/strategy_factory.h"
#include "trainer_runtime/state/checkpoint.h"
#include "trainer_runtime/util/loop_util.h"
#include "trainer_runtime/util/timeline.h"

namespace launch::trainer {

// --- In-place recovery -----------------------------------------------------------------------

void Accelerator::MarkBoundary() {
  if (!recover_) return;
  boundary_.has_cursor = cursor_ != nullptr;
  if (cursor_) boundary_.cursor = *cursor_;
  boundary_.samples_seen = samples_seen_;
  boundary_.samples_seen_global = samples_seen_global_;
  boundary_.counts = RunTotals();
  // The buffers as they are now: a redone forward must not count its batch twice in running
  // statistics. Copied into the same tensors every step (no allocation).
  const auto buffers = model_->NamedBuffers();
  if (boundary_.buffers.size() != buffers.size()) {
    boundary_.buffers.clear();
    for (const auto& [name, b] : buffers) boundary_.buffers.push_back(b.detach().clone());
    return;
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < buffers.size(); ++i) boundary_.buffers[i].copy_(buffers[i].second);
}

TrainState Accelerator::BoundaryTrainState() const {
  TrainState state = CurrentTrainState();
  if (boundary_.has_cursor) {
    const LoaderCursor& c = boundary_.cursor;
    state.epoch = c.epoch;
    state.batch_in_epoch = c.batch;
    state.epoch_start = c.start;
    state.epoch_offset = c.offset();
  }
  state.samples_seen = boundary_.samples_seen;
  state.samples_seen_global = boundary_.samples_seen_global;
  return state;
}

Status Accelerator::TakeStateOverNewGroup() {
  if (snapshots_) {
    // The strategy drops the abandoned step's work (or builds a replacement's) first; then
    // every rank goes back.
    if (PipelineEngine* engine = AcceleratorInternals(*this).pipeline()) {
      engine->ReformGroups(pg_, stage_pg_, data_pg_);
    } else {
      strategy_->Reform(data_pg_);
    }
    return RollBack();
  }
  LAUNCH_RETURN_IF_ERROR(ExchangeState());
  // The broken group goes with the old reducer here.
  strategy_->Reform(pg_);
  return Status::Ok();
}

Status Accelerator::ExchangeState() {
  const int world = world_size();
  // The run's counts at the boundary whose state a survivor hands over (taken now: the cursor's
  // restoration below marks a new boundary, in the new group).
  const RunCounts held = boundary_.counts;
  // Who holds the run's state and how far along: slot r is rank r's steps done + 1, or 0 for a
  // replacement. A survivor may be a step ahead of the others: the dead rank's part of the last
  // all-reduce reached it before the others gave up. Its state is then the complete one.
  auto slots = torch::zeros({world}, torch::kDouble);
  if (prepared_) slots[rank()] = static_cast<double>(step_ + 1);
  SumInPlace(slots);
  const auto seen = slots.accessor<double, 1>();
  int src = 0;
  for (int r = 1; r < world; ++r)
    if (seen[r] > seen[src]) src = r;
  if (seen[src] == 0)
    return Status::PeerLost("no live rank holds the run's state (every rank is a replacement)");
  recovered_from_ = src;
  std::string bytes;
  if (rank() == src) {
    LAUNCH_ASSIGN_OR_RETURN(bytes,
                            SerializeReplicaState(*model_, *optimizer_, BoundaryTrainState()));
  }
  auto size = torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kLong);
  c10d::BroadcastOptions from_src;
  from_src.rootRank = src;
  std::vector<at::Tensor> v = {size};
  pg_->broadcast(v, from_src)->wait();
  const int64_t n = size.item<int64_t>();
  at::Tensor payload = torch::empty({n}, torch::kByte);
  if (rank() == src) std::memcpy(payload.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  v = {payload};
  pg_->broadcast(v, from_src)->wait();
  if (rank() != src) {
    bytes.assign(reinterpret_cast<const char*>(payload.data_ptr<uint8_t>()),
                 static_cast<size_t>(n));
    // A replacement takes the buffers too; a survivor keeps its own (below).
    LAUNCH_ASSIGN_OR_RETURN(TrainState state,
                            RestoreReplicaState(bytes, *model_, *optimizer_, !prepared_));
    LoadTrainState(state);
  } else {
    LoadTrainState(BoundaryTrainState());
  }
  torch::NoGradGuard no_grad;
  if (prepared_) {
    // Each survivor's buffers of its last boundary: rank 0's become everyone's at the next
    // forward (broadcast_buffers), as in the undisturbed run.
    const auto buffers = model_->NamedBuffers();
    for (size_t i = 0; i < buffers.size() && i < boundary_.buffers.size(); ++i)
      buffers[i].second.detach().copy_(boundary_.buffers[i]);
  }
  // Nothing of the abandoned step's gradients survives.
  for (auto& p : model_->Parameters())
    if (p.grad().defined()) p.mutable_grad().zero_();
  ApplyRestoredCursor();
  // The run's counts at the boundary of the state handed over, from its holder (a replacement
  // has none of its own): the abandoned step's collectives and this exchange's are not the
  // run's, the redone step's will be.
  auto counts = torch::zeros({6}, torch::kLong);
  if (rank() == src) {
    const RunCounts& c = held;
    counts = torch::tensor({c.allreduces, c.pair_exchanges, c.reduce_scatters, c.allgathers,
                            c.alltoalls, c.recoveries},
                           torch::kLong);
  }
  v = {counts};
  pg_->broadcast(v, from_src)->wait();
  const auto got = counts.accessor<int64_t, 1>();
  carried_ = RunCounts{};
  recoveries_ = 0;
  const RunCounts now = RunTotals();  // this group's, so far: the exchange's own
  carried_ =
      RunCounts{got[0] - now.allreduces, got[1] - now.pair_exchanges, got[2] - now.reduce_scatters,
                got[3] - now.allgathers, got[4] - now.alltoalls,      0};
  recoveries_ = got[5];
  boundary_.counts = RunTotals();
  ShareRunClock(src);
  return Status::Ok();
}

void Accelerator::ShareRunClock(int root) {
  auto t = torch::tensor(
      {run_clock_.started_unix_ms, run_clock_.loop_started_unix_ms, run_clock_.loop_first_step},
      torch::kLong);
  c10d::BroadcastOptions from;
  from.rootRank = root;
  std::vector<at::Tensor> v = {t};
  pg_->broadcast(v, from)->wait();
  const auto got = t.accessor<int64_t, 1>();
  run_clock_ = RunClock{got[0], got[1], got[2]};
}

void Accelerator::MarkLoopStart() {
  if (run_clock_.loop_started_unix_ms != 0) return;
  run_clock_.loop_started_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count();
  run_clock_.loop_first_step = step();
}

// --- Snapshots: recovery where a rank's state exists on it alone --------------------------------

// A snapshot's image: a memory file (the one this rank's child wrote, or a peer's on this host,
// opened through /proc: one copy of the bytes serves both ranks, and nothing is copied to hand
// it over), or the bytes received from a rank on another host.
struct SnapshotImage {
  int fd = -1;  // owned
  std::string bytes;
  size_t size = 0;

  SnapshotImage() = default;
  SnapshotImage(const SnapshotImage&) = delete;
  SnapshotImage& operator=(const SnapshotImage&) = delete;
  ~SnapshotImage() {
    if (fd >= 0) ::close(fd);
  }

  // Calls `fn` with the image's bytes (a memory file mapped for the call). IoError when it
  // cannot be mapped.
  Status Read(const std::function<Status(std::string_view)>& fn) const {
    if (fd < 0) return fn(bytes);
    void* at = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    if (at == MAP_FAILED)
      return Status::IoError(std::string("mapping it: ") + std::strerror(errno));
    Status status = fn(std::string_view(static_cast<const char*>(at), size));
    ::munmap(at, size);
    return status;
  }
};

int64_t Accelerator::snapshot_bytes() const {
  return snapshots_held_.empty() ? 0 : static_cast<int64_t>(snapshots_held_.back().own->size);
}

namespace {

// Point-to-point messages of snapshots travel on the world group's own Gloo pairs (uncounted:
// final.json's totals are the training's collectives), under tags nothing else there uses: the
// image (a record, then its bytes unless the receiver opens the memory file), and the
// receiver's answer to a memory file's record.
constexpr int kSnapshotTag = 0x534e4150;  // "SNAP"
constexpr int kSnapshotAckTag = kSnapshotTag + 1;

// A snapshot's image holds the run's counts at its step as its rank saw them: the ranks of a
// pipeline's stages issue different collectives, so a replacement takes its own from its image.
constexpr const char* kImageCountsKey = "run/counts";

// Sends `image` to `dst` on `group`, as a record [kind, a, b]: kind 1, the memory file's number
// and size, when `same_host` and the image is one (`dst` opens it through /proc and answers
// whether it could); kind 0 and the size, then the bytes, otherwise. Throws what the transport
// throws, and c10::Error when `dst` could not open the file. `die_midway` (tests): SIGKILLs this
// process between the record and the rest.
void HandImage(c10d::ProcessGroup& group, int dst, const SnapshotImage& image, bool same_host,
               bool die_midway = false) {
  const bool by_file = same_host && image.fd >= 0;
  std::vector<at::Tensor> record = {torch::tensor(
      {int64_t{by_file ? 1 : 0}, int64_t{by_file ? image.fd : 0}, static_cast<int64_t>(image.size)},
      torch::kLong)};
  group.send(record, dst, kSnapshotTag)->wait();
  if (die_midway) ::raise(SIGKILL);
  if (by_file) {
    std::vector<at::Tensor> ack = {torch::zeros({1}, torch::kLong)};
    group.recv(ack, dst, kSnapshotAckTag)->wait();
    TORCH_CHECK(ack[0].item<int64_t>() == 1, "rank ", dst,
                " could not open this rank's snapshot image through /proc");
    return;
  }
  // Straight from the image (its memory file mapped for the send): no copy of it here.
  std::string error;
  const Status sent = image.Read([&](std::string_view bytes) {
    std::vector<at::Tensor> payload = {torch::from_blob(
        const_cast<char*>(bytes.data()), {static_cast<int64_t>(bytes.size())}, torch::kByte)};
    try {
      group.send(payload, dst, kSnapshotTag)->wait();
    } catch (const std::exception& e) {
      error = e.what();  // thrown again below, once the mapping is gone
    }
    return Status::Ok();
  });
  TORCH_CHECK(sent.ok(), "the snapshot image: ", sent.message());
  TORCH_CHECK(error.empty(), error);
}

// Receives HandImage's image from `src`, whose pid is `src_pid` (0 when it is on another host).
std::shared_ptr<SnapshotImage> TakeImage(c10d::ProcessGroup& group, int src, int src_pid) {
  std::vector<at::Tensor> record = {torch::zeros({3}, torch::kLong)};
  group.recv(record, src, kSnapshotTag)->wait();
  const auto r = record[0].accessor<int64_t, 1>();
  auto image = std::make_shared<SnapshotImage>();
  image->size = static_cast<size_t>(r[2]);
  if (r[0] == 1) {
    const std::string path = "/proc/" + std::to_string(src_pid) + "/fd/" + std::to_string(r[1]);
    image->fd = src_pid > 0 ? ::open(path.c_str(), O_RDONLY | O_CLOEXEC) : -1;
    const int open_errno = errno;
    std::vector<at::Tensor> ack = {torch::tensor({int64_t{image->fd >= 0 ? 1 : 0}}, torch::kLong)};
    group.send(ack, src, kSnapshotAckTag)->wait();
    TORCH_CHECK(image->fd >= 0, "opening rank ", src, "'s snapshot image ", path, ": ",
                std::strerror(open_errno));
    return image;
  }
  image->bytes.resize(image->size);
  std::vector<at::Tensor> payload = {
      torch::from_blob(image->bytes.data(), {static_cast<int64_t>(image->size)}, torch::kByte)};
  group.recv(payload, src, kSnapshotTag)->wait();
  return image;
}

// The pids of `group`'s ranks when they share this host (its shared-memory transport agreed on
// them); empty otherwise.
std::vector<int> SameHostPids(const CountingProcessGroup& group) {
  return group.shm() ? group.shm()->pids() : std::vector<int>();
}

}  // namespace

int Accelerator::KeeperOf(int r) const {
  // The same local rank on the next host (hosts of equal size, as launch starts them): a host
  // lost whole leaves every copy of its ranks' images on the next one.
  const int world = world_size();
  const int local = env_.local_world_size;
  const int stride = local > 0 && local < world && world % local == 0 ? local : 1;
  return (r + stride) % world;
}

void Accelerator::TakeSnapshot() {
  // One exchange at a time: the previous one (recover_snapshot_every steps ago) ends first.
  FinishSnapshot(/*block=*/true);
  if (peer_lost_) return;
  const auto start = std::chrono::steady_clock::now();
  Timeline::Scope span("train", "snapshot (fork)");
  auto pending = std::make_shared<PendingSnapshot>();
  pending->snap.step = step_;
  pending->snap.counts = boundary_.counts;
  // As of the last step boundary: the first snapshot (and the first after a recovery) is taken
  // at the next micro-batch, whose batch the loader has served already.
  const TrainState state = BoundaryTrainState();
  // The image is made by a forked child from its copy-on-write view of this moment, while this
  // process trains on: what the next steps change, the child still sees as it was. It writes
  // the bytes into a memory file; a thread here reads them and exchanges the copies.
  const int fd = ::memfd_create("launch-snapshot", MFD_CLOEXEC);
  if (fd < 0)
    throw compat::MakeError("rank " + std::to_string(rank()) + ": the snapshot of step " +
                            std::to_string(step_) + ": memfd_create: " + std::strerror(errno));
  // As the checkpoint writer.
  const pid_t child = ForkChild([&] {
    // Straight into the memory file, as LibTorch writes the archive (no copy of it in memory).
    const Status image = SerializeImageTo(
        [fd](const void* data, size_t n) -> size_t {
          size_t done = 0;
          while (done < n) {
            const ssize_t w = ::write(fd, static_cast<const char*>(data) + done, n - done);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) break;
            done += static_cast<size_t>(w);
          }
          return done;
        },
        [&](torch::serialize::OutputArchive& archive) {
          const RunCounts& c = pending->snap.counts;
          archive.write(kImageCountsKey,
                        torch::tensor({c.allreduces, c.pair_exchanges, c.reduce_scatters,
                                       c.allgathers, c.alltoalls},
                                      torch::kLong));
          strategy_->SaveImage(archive, *optimizer_);
        },
        state);
    if (!image.ok()) {
      std::fprintf(stderr, "train: rank %d: the snapshot of step %lld: %s\n", rank(),
                   static_cast<long long>(state.step), image.message().c_str());
      return 1;
    }
    return 0;
  });
  const int fork_errno = errno;
  if (child < 0) {
    ::close(fd);
    throw compat::MakeError("rank " + std::to_string(rank()) + ": the snapshot of step " +
                            std::to_string(step_) + ": fork: " + std::strerror(fork_errno));
  }
  pending->child = child;
  const int world = world_size();
  const int keeper = KeeperOf(rank());
  int ward = rank();
  for (int r = 0; r < world; ++r)
    if (KeeperOf(r) == rank()) ward = r;
  // Tests: LAUNCH_TEST_SIGKILL_IN_SNAPSHOT=RANK:STEP kills a first worker during its copy.
  bool die = false;
  if (const char* at = std::getenv("LAUNCH_TEST_SIGKILL_IN_SNAPSHOT");
      at && env_.recover_generation == 0 && env_.restart_count == 0)
    die = std::string(at) == std::to_string(rank()) + ":" + std::to_string(step_);
  // On one host the keeper opens this rank's memory file instead of receiving a copy.
  const std::vector<int> pids = SameHostPids(*pg_);
  const int ward_pid = pids.empty() ? 0 : pids[static_cast<size_t>(ward)];
  auto own = std::make_shared<SnapshotImage>();
  own->fd = fd;
  // The thread holds what it uses (never this Accelerator): a destructor can leave it behind.
  pending->thread = std::thread([pending, pg = pg_, own, keeper, ward, ward_pid, die] {
    const auto begin = std::chrono::steady_clock::now();
    pending->status = [&]() -> Status {
      int wait_status = 0;
      pid_t got;
      do {
        got = ::waitpid(pending->child.load(), &wait_status, 0);
      } while (got < 0 && errno == EINTR);
      pending->child = -1;
      if (got < 0 || !ExitStatus::FromWaitStatus(wait_status).success())
        return Status::IoError("the process making the image " +
                               (got < 0 ? std::string(std::strerror(errno))
                                        : ExitStatus::FromWaitStatus(wait_status).ToString()));
      struct stat st {};
      if (::fstat(own->fd, &st) != 0) return Status::IoError(std::strerror(errno));
      own->size = static_cast<size_t>(st.st_size);
      // Both directions at once: this rank's image to its keeper, its ward's to it.
      try {
        c10d::ProcessGroup& group = pg->inner();
        std::exception_ptr sent;
        std::thread to_keeper([&] {
          try {
            HandImage(group, keeper, *own, ward_pid > 0, die);
          } catch (...) {
            sent = std::current_exception();
          }
        });
        try {
          pending->snap.ward = TakeImage(group, ward, ward_pid);
        } catch (...) {
          to_keeper.join();
          throw;
        }
        to_keeper.join();
        if (sent) std::rethrow_exception(sent);
      } catch (const std::exception& e) {
        return Status::PeerLost(std::string("exchanging snapshots: ") + e.what());
      }
      pending->snap.own = own;
      return Status::Ok();
    }();
    pending->copy_ms = 1000 * Seconds(std::chrono::steady_clock::now() - begin);
    pending->done = true;
  });
  pending_snapshot_ = std::move(pending);
  snapshot_ms_ += 1000 * Seconds(std::chrono::steady_clock::now() - start);
  // Tests: LAUNCH_TEST_SNAPSHOT_SYNC=1 waits for the exchange here, so that which snapshot a
  // recovery goes back to does not depend on how fast the copies travel.
  if (const char* sync = std::getenv("LAUNCH_TEST_SNAPSHOT_SYNC"); sync && std::string(sync) == "1")
    FinishSnapshot(/*block=*/true);
}

void Accelerator::FinishSnapshot(bool block) {
  if (!pending_snapshot_) return;
  if (!block && !pending_snapshot_->done) return;
  const auto start = std::chrono::steady_clock::now();
  {
    Timeline::Scope span("train", "snapshot (waiting for the copy)");
    pending_snapshot_->thread.join();
  }
  snapshot_ms_ += 1000 * Seconds(std::chrono::steady_clock::now() - start);
  std::shared_ptr<PendingSnapshot> done = std::move(pending_snapshot_);
  snapshot_copy_ms_ += done->copy_ms;
  if (!done->status.ok()) {
    // A lost peer (the recovery goes back to the previous snapshot) or a failure to make the
    // image, which is said: recovery then has only the older one.
    if (done->status.code() != Status::Code::kPeerLost)
      std::fprintf(stderr, "train: rank %d: warning: the snapshot of step %lld: %s\n", rank(),
                   static_cast<long long>(done->snap.step), done->status.message().c_str());
    return;
  }
  snapshots_held_.push_back(std::move(done->snap));
  if (snapshots_held_.size() > 2) snapshots_held_.erase(snapshots_held_.begin());
  ++snapshots_taken_;
}

Status Accelerator::RollBack() {
  // A copy in flight ends (its peer lost, or done): whether it completed decides the step.
  FinishSnapshot(/*block=*/true);
  const int world = world_size();
  const bool replacement = !prepared_;
  // Row r: rank r's newest and previous snapshot steps (-1: none), whether it is a replacement,
  // its recoveries, and the run's counts at its newest snapshot.
  constexpr int kCols = 8;
  auto rows = torch::zeros({world, kCols}, torch::kDouble);
  {
    auto row = rows[rank()];
    const size_t held = snapshots_held_.size();
    row[0] = held > 0 ? static_cast<double>(snapshots_held_.back().step) : -1.0;
    row[1] = held > 1 ? static_cast<double>(snapshots_held_.front().step) : -1.0;
    row[2] = replacement ? 1.0 : 0.0;
    row[3] = static_cast<double>(recoveries_);
  }
  SumInPlace(rows);
  const auto t = rows.accessor<double, 2>();
  std::vector<int> survivors, replacements;
  for (int r = 0; r < world; ++r) (t[r][2] > 0 ? replacements : survivors).push_back(r);
  if (survivors.empty())
    return Status::PeerLost("no live rank holds a snapshot (every rank is a replacement)");
  // The newest step every survivor holds (each keeps two: a loss during an exchange leaves
  // some a step ahead).
  int64_t step = -1;
  for (int r : survivors) {
    const int64_t newest = static_cast<int64_t>(t[r][0]);
    if (step < 0 || newest < step) step = newest;
  }
  if (step < 0)
    return Status::PeerLost(
        "no snapshot was complete on every rank yet (the first is taken "
        "before the first step, and copied while training goes on)");
  for (int r : survivors)
    if (static_cast<int64_t>(t[r][0]) != step && static_cast<int64_t>(t[r][1]) != step)
      return Status::PeerLost("rank " + std::to_string(r) +
                              " holds no snapshot of the step the others can go back to");
  for (int r : replacements)
    if (t[KeeperOf(r)][2] > 0)
      return Status::PeerLost("rank " + std::to_string(r) + " and rank " +
                              std::to_string(KeeperOf(r)) +
                              ", which keeps the copy of its snapshot, were both lost");
  const auto held = std::find_if(snapshots_held_.begin(), snapshots_held_.end(),
                                 [&](const Snapshot& s) { return s.step == step; });
  std::shared_ptr<const SnapshotImage> image = replacement ? nullptr : held->own;
  try {
    c10d::ProcessGroup& group = pg_->inner();
    const std::vector<int> pids = SameHostPids(*pg_);
    for (int r : replacements) {
      const int keeper = KeeperOf(r);
      if (rank() == keeper) HandImage(group, r, *held->ward, !pids.empty());
      if (rank() == r)
        image = TakeImage(group, keeper, pids.empty() ? 0 : pids[static_cast<size_t>(keeper)]);
    }
  } catch (const std::exception& e) {
    return Status::PeerLost(std::string("handing a replacement its snapshot: ") + e.what());
  }
  const std::string what = "the snapshot of step " + std::to_string(step);
  torch::Tensor at_snapshot;
  StatusOr<TrainState> state = Status::Internal(what + " was not read");
  const Status read = image->Read([&](std::string_view bytes) {
    state = RestoreImage(bytes, what, [&](torch::serialize::InputArchive& archive) {
      if (!archive.try_read(kImageCountsKey, at_snapshot) || at_snapshot.numel() != 5)
        return Status::InvalidConfig(what + " has no " + kImageCountsKey);
      return strategy_->LoadImage(archive, *optimizer_);
    });
    return state.status();
  });
  if (!read.ok()) return read.WithContext("restoring " + what);
  LoadTrainState(*state);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model_->Parameters())
      if (p.grad().defined()) p.mutable_grad().zero_();
  }
  ApplyRestoredCursor();
  // This rank's counts at the snapshot, from its image, less this group's own so far; the
  // recoveries are the survivors' (row 3, summed above: only rank r wrote row r).
  const auto got = at_snapshot.accessor<int64_t, 1>();
  carried_ = RunCounts{};
  const RunCounts now = RunTotals();
  carried_ =
      RunCounts{got[0] - now.allreduces, got[1] - now.pair_exchanges, got[2] - now.reduce_scatters,
                got[3] - now.allgathers, got[4] - now.alltoalls,      0};
  recoveries_ = static_cast<int64_t>(t[survivors[0]][3]);
  ShareRunClock(survivors[0]);
  // Everyone takes a new one at the next micro-batch: the replacement holds no copy of its
  // ward's image, and its keeper's copy of its own is of this step.
  snapshots_held_.clear();
  snapshot_due_ = false;
  recovered_from_ = replacements.empty() ? survivors[0] : KeeperOf(replacements[0]);
  return Status::Ok();
}

StatusOr<int> Accelerator::MeetInNewestGeneration(int lost_in,
                                                  std::chrono::system_clock::time_point noticed_at,
                                                  const std::string& noticed_by, int announce,
                                                  int at_least, std::chrono::milliseconds wait) {
  const auto deadline = std::chrono::steady_clock::now() + wait;
  const bool hosts_store = rank() == 0 && !env_.use_agent_store;
  for (int store_losses = 0;; ++store_losses) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    // When rank 0 was lost, the store went with it and its replacement hosts a new one at the
    // same address: a new client, once that one is up. A rank 0 that survived keeps hosting its
    // own, and the others keep their clients while it answers.
    if (!hosts_store) {
      bool alive = true;
      try {
        store_->check({kGenerationKey});
      } catch (const std::exception&) {
        alive = false;
      }
      if (!alive) {
        LAUNCH_RETURN_IF_ERROR(AwaitStoreHost(env_, std::max(left, std::chrono::milliseconds(0))));
        LAUNCH_ASSIGN_OR_RETURN(store_, ConnectStore(env_, /*host=*/false, timeout_));
      }
    }
    // Before this rank counts itself in: once the group forms, every notice is in the store.
    // Only reports depend on it: a failure is ignored.
    if (!noticed_by.empty()) (void)NoteLoss(*store_, lost_in, {noticed_at, noticed_by});
    if (announce > 0) LAUNCH_RETURN_IF_ERROR(AnnounceGeneration(*store_, announce));
    StatusOr<int> met =
        JoinGeneration(*store_, at_least, world_size(), left, [] { return StopRequested(); });
    // Only the store's failure is worth another round (in the new store), and only as long as
    // there can be a new one: a rank 0 hosting it, or a third loss of it, ends here.
    if (met.ok() || met.status().code() != Status::Code::kIoError || hosts_store ||
        store_losses >= 2 || std::chrono::steady_clock::now() >= deadline)
      return met;
    std::fprintf(stderr,
                 "train: rank %d: the store failed while waiting (%s): rank 0 was lost "
                 "too; meeting the others in its replacement's\n",
                 rank(), met.status().message().c_str());
  }
}

Status Accelerator::Recover() {
  const int64_t step = step_ + 1;
  const std::chrono::milliseconds wait = RecoverWait(env_, timeout_);
  // The broken group is abandoned (Guarded) and goes below: nothing watches it any more.
  if (loss_watch_) loss_watch_->Disarm();
  const int lost_in = generation_;
  const auto noticed = std::chrono::system_clock::now() -
                       std::chrono::duration_cast<std::chrono::system_clock::duration>(
                           std::chrono::steady_clock::now() - lost_at_);
  std::fprintf(stderr,
               "train: rank %d (pid %d): lost a peer during step %lld (%s); waiting up to %lld s "
               "for its replacement\n",
               rank(), static_cast<int>(::getpid()), static_cast<long long>(step),
               lost_what_.c_str(), static_cast<long long>(wait.count() / 1000));
  try {
    LAUNCH_ASSIGN_OR_RETURN(
        const int generation,
        MeetInNewestGeneration(lost_in, noticed, "rank " + std::to_string(rank()),
                               /*announce=*/0, generation_ + 1, wait));
    generation_ = generation;
    LAUNCH_ASSIGN_OR_RETURN(pg_, CreateGroupOver(store_, WorldGroupName(generation), rank(),
                                                 world_size(), env_, timeout_));
    // The layout's groups of the new generation (the world itself where the data axis spans
    // it), before the exchange, which carries the run's counts over to them.
    LAUNCH_RETURN_IF_ERROR(FormLayoutGroups(timeout_));
    LAUNCH_RETURN_IF_ERROR(TakeStateOverNewGroup());
    if (loss_watch_)
      LAUNCH_RETURN_IF_ERROR(WatchGroup(*loss_watch_, env_, timeout_, Groups(), generation_));
  } catch (const std::exception& e) {
    return Status::PeerLost(std::string("recovering from a lost peer: ") + e.what());
  }
  peer_lost_ = false;
  in_micro_ = false;
  micro_open_ = false;
  micro_in_window_ = 0;
  window_closes_ = false;
  ++recoveries_;
  // Measured from the loss's first notice anywhere in the job (an agent's, or the rank that
  // saw it first), not from this rank's own, which may have come later.
  const LossNotice first = FirstNoticedLoss(*store_, lost_in)
                               .value_or(LossNotice{noticed, "rank " + std::to_string(rank())});
  report_cost_since_ = std::chrono::steady_clock::now() -
                       std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                           std::chrono::system_clock::now() - std::min(first.at, noticed));
  MarkBoundary();
  const double later = std::chrono::duration<double>(noticed - first.at).count();
  const std::string me = "rank " + std::to_string(rank());
  const std::string who = first.by == me || first.at >= noticed
                              ? "here"
                              : "by " + first.by + ", here " + Fixed(later, 2) + " s later";
  const std::string from =
      snapshots_
          ? "rolled back to the snapshot of step " + std::to_string(step_) +
                " (the replacement's from rank " + std::to_string(recovered_from_) +
                "); redoing steps " + std::to_string(step_ + 1) + " to " + std::to_string(step)
          : "state of step " + std::to_string(step_) + " from rank " +
                std::to_string(recovered_from_) + "; redoing step " + std::to_string(step_ + 1);
  std::fprintf(stderr,
               "train: rank %d: recovered %.2f s after the failure (first noticed %s): group "
               "generation %d with the replacement, %s\n",
               rank(), Seconds(std::chrono::steady_clock::now() - *report_cost_since_), who.c_str(),
               generation_, from.c_str());
  return Status::Ok();
}

uint64_t MicroBatchSeed(uint64_t seed, int rank, int64_t step, int64_t micro) {
  return NewRankSeed(seed ^ 0xA5A5F00DC0FFEE11ull, rank, step * 1000003 + micro);
}

}  // namespace launch::trainer
