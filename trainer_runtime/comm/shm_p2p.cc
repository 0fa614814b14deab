#include "trainer_runtime/comm/shm_p2p.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <new>
#include <random>
#include <sstream>

#include <ATen/ATen.h>

#include "trainer_runtime/comm/shm_common.h"

namespace launch::trainer {

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kP2pMagic = 0x6c61756e63683270ull;  // "launch2p"
constexpr uint32_t kP2pVersion = 1;
constexpr uint32_t kMessageMagic = 0x7032706d;  // "mp2p"
// The segment: this page, then the ring.
constexpr size_t kHeaderBytes = 4096;

struct SegmentHeader {
  uint64_t magic;
  uint64_t token;  // random, published with the fd: the right segment was opened
  uint32_t version;
  int32_t sender;
  int32_t receiver;
  uint64_t ring_bytes;
  alignas(shm::kCacheLine) std::atomic<uint64_t> head;  // bytes written; only the sender
  alignas(shm::kCacheLine) std::atomic<uint64_t> tail;  // bytes consumed; only the receiver
  // The futex word: bumped after every change of head or tail, and on a failure.
  alignas(shm::kCacheLine) std::atomic<uint32_t> wake_seq;
  std::atomic<uint32_t> waiters;          // sides in (or about to enter) FUTEX_WAIT
  std::atomic<uint32_t> receiver_opened;  // the sender may close its fd
  std::atomic<int32_t> failed_by;         // rank + 1 of the side that gave up; 0: none
};
static_assert(sizeof(SegmentHeader) <= kHeaderBytes, "the header fits its page");

struct MessageHeader {
  uint32_t magic;
  int32_t tag;
  uint64_t bytes;
  uint64_t seq;  // messages sent on this channel before this one
  int32_t dtype;
  uint32_t reserved;
};
static_assert(sizeof(MessageHeader) == 32, "fixed wire size");

std::string Key(int src, int dst) {
  return "p2p/" + std::to_string(src) + "/" + std::to_string(dst);
}

std::string Describe(const MessageHeader& m) {
  return "tag " + std::to_string(m.tag) + ", " + std::to_string(m.bytes) + " bytes of " +
         c10::toString(static_cast<c10::ScalarType>(m.dtype));
}

}  // namespace

// One direction between two ranks: the mapping and the waiting logic both ends share.
struct ShmPointToPoint::Channel {
  int self = -1;
  int peer = -1;
  int peer_pid = 0;
  int peer_pidfd = -1;
  void* base = nullptr;  // null until created (sender) or opened (receiver)
  size_t size = 0;
  uint64_t seq = 0;  // messages passed; only under the side's mutex
  Status failed;     // the first error, sticky; only under the side's mutex
  std::atomic<bool> stopping{false};
  const std::atomic<bool>* abandoned = nullptr;  // the owner's AbandonPeers flag

  bool Abandoned() const { return abandoned && abandoned->load(); }
  // After AbandonPeers: marks the channel given up in its header (the peer's waits end too).
  Status GiveUp(const std::string& what) const {
    if (base) {
      int32_t none = 0;
      h()->failed_by.compare_exchange_strong(none, self + 1);
      Wake();
    }
    return Status::PeerLost("shared-memory send/recv: rank " + std::to_string(self) +
                            " gave up its group (a peer was lost elsewhere) while it waited for " +
                            what);
  }

  SegmentHeader* h() const { return static_cast<SegmentHeader*>(base); }
  char* ring() const { return static_cast<char*>(base) + kHeaderBytes; }
  uint64_t capacity() const { return h()->ring_bytes; }

  ~Channel() {
    if (base) ::munmap(base, size);
    if (peer_pidfd >= 0) ::close(peer_pidfd);
  }

  void Wake() const {
    h()->wake_seq.fetch_add(1);
    if (h()->waiters.load() > 0) shm::FutexWakeAll(&h()->wake_seq);
  }

  // Marks the channel failed on both ends (the peer's waits end at once).
  void Fail(const Status& status) {
    if (failed.ok()) failed = status;
    if (!base) return;
    int32_t none = 0;
    h()->failed_by.compare_exchange_strong(none, self + 1);
    Wake();
  }

  // Copies n bytes to the ring at stream position `pos` (wrapping), or from it.
  void CopyIn(uint64_t pos, const char* src, size_t n) const {
    const size_t at = pos % capacity();
    const size_t first = std::min<size_t>(n, capacity() - at);
    std::memcpy(ring() + at, src, first);
    std::memcpy(ring(), src + first, n - first);
  }
  void CopyOut(uint64_t pos, char* dst, size_t n) const {
    const size_t at = pos % capacity();
    const size_t first = std::min<size_t>(n, capacity() - at);
    std::memcpy(dst, ring() + at, first);
    std::memcpy(dst + first, ring(), n - first);
  }

  // Waits until ready() holds; `what` says what for, in errors ("rank 1 waited for ...").
  template <typename Ready>
  Status Wait(const Ready& ready, const ShmPointToPointOptions& options,
              const std::string& what) const {
    for (int i = 0; i < shm::kSpins; ++i) {
      if (ready()) return Status::Ok();
      shm::CpuRelax();
    }
    const Clock::time_point deadline = Clock::now() + options.timeout;
    SegmentHeader* hd = h();
    while (true) {
      hd->waiters.fetch_add(1);
      const uint32_t seq_now = hd->wake_seq.load();
      if (!ready() && hd->failed_by.load() == 0 && !stopping.load()) {
        const auto left = std::max<Clock::duration>(deadline - Clock::now(), Clock::duration(0));
        shm::FutexWait(&hd->wake_seq, seq_now,
                       std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::min<Clock::duration>(options.liveness_interval, left)));
      }
      hd->waiters.fetch_sub(1);
      if (ready()) return Status::Ok();
      if (Abandoned()) return GiveUp(what);
      if (const int32_t by = hd->failed_by.load(); by != 0)
        return Status::PeerLost("shared-memory send/recv: rank " + std::to_string(by - 1) +
                                " gave up on the channel between ranks " + std::to_string(self) +
                                " and " + std::to_string(peer) + " (see that rank's error)");
      if (stopping.load())
        return Status::Interrupted("shared-memory send/recv shut down while rank " +
                                   std::to_string(self) + " waited for " + what);
      if (shm::PidExited(peer_pid, peer_pidfd)) {
        if (ready()) return Status::Ok();  // it wrote what we need before it went
        return Status::PeerLost("shared-memory send/recv: rank " + std::to_string(peer) + " (pid " +
                                std::to_string(peer_pid) + ") exited while rank " +
                                std::to_string(self) + " waited for " + what);
      }
      if (Clock::now() >= deadline)
        return Status::Timeout("shared-memory send/recv: rank " + std::to_string(self) +
                               " waited " + std::to_string(options.timeout.count()) + " ms for " +
                               what + " from rank " + std::to_string(peer));
    }
  }
};

struct ShmPointToPoint::Outgoing : Channel {
  struct Op {
    at::Tensor tensor;  // contiguous
    int tag = 0;
    c10::intrusive_ptr<c10::ivalue::Future> future;
  };
  int memfd = -1;  // until the receiver has opened the segment
  Mutex mu;
  CondVar cv{&mu};
  std::deque<Op> queue GUARDED_BY(mu);  // the front is being streamed by `thread`
  bool stop GUARDED_BY(mu) = false;
  std::thread thread;

  ~Outgoing() {
    if (memfd >= 0) ::close(memfd);
  }

  void CloseFdOnceOpened() {
    if (memfd >= 0 && h()->receiver_opened.load()) {
      ::close(memfd);
      memfd = -1;
    }
  }

  MessageHeader HeaderFor(const Op& op) const {
    MessageHeader m{};
    m.magic = kMessageMagic;
    m.tag = op.tag;
    m.bytes = static_cast<uint64_t>(op.tensor.nbytes());
    m.seq = seq;
    m.dtype = static_cast<int32_t>(op.tensor.scalar_type());
    return m;
  }

  // The whole message if the receiver has mapped the ring and it fits in the free space now,
  // without waiting. REQUIRES: mu held, queue empty (nobody else writes).
  bool TryWriteWhole(const Op& op) {
    if (!h()->receiver_opened.load(std::memory_order_acquire)) return false;
    const MessageHeader m = HeaderFor(op);
    const uint64_t head = h()->head.load(std::memory_order_relaxed);
    const uint64_t free = capacity() - (head - h()->tail.load(std::memory_order_acquire));
    if (free < sizeof(m) + m.bytes) return false;
    CopyIn(head, reinterpret_cast<const char*>(&m), sizeof(m));
    CopyIn(head + sizeof(m), static_cast<const char*>(op.tensor.data_ptr()), m.bytes);
    h()->head.store(head + sizeof(m) + m.bytes, std::memory_order_release);
    ++seq;
    Wake();
    return true;
  }

  // Streams the message as the receiver makes room. Only the channel's thread, for the queue's
  // front (so nobody else writes meanwhile).
  Status Stream(const Op& op, const ShmPointToPointOptions& options) {
    const MessageHeader m = HeaderFor(op);
    const char* parts[2] = {reinterpret_cast<const char*>(&m),
                            static_cast<const char*>(op.tensor.data_ptr())};
    const uint64_t lengths[2] = {sizeof(m), m.bytes};
    // Until the receiver has mapped the segment, only this process holds it: a send completed
    // before that would be lost if this process exited.
    LAUNCH_RETURN_IF_ERROR(
        Wait([&] { return h()->receiver_opened.load(std::memory_order_acquire) != 0; }, options,
             "the receiver to open the channel"));
    const std::string what = "room in the ring to send " + Describe(m);
    for (int part = 0; part < 2; ++part) {
      uint64_t done = 0;
      while (done < lengths[part]) {
        const uint64_t head = h()->head.load(std::memory_order_relaxed);
        // The message header goes in one piece, so the receiver never sees half of one.
        const uint64_t need = part == 0 ? sizeof(m) : 1;
        auto room = [&] {
          return capacity() - (head - h()->tail.load(std::memory_order_acquire)) >= need;
        };
        LAUNCH_RETURN_IF_ERROR(Wait(room, options, what));
        const uint64_t free = capacity() - (head - h()->tail.load(std::memory_order_acquire));
        const uint64_t n = std::min(free, lengths[part] - done);
        CopyIn(head, parts[part] + done, n);
        h()->head.store(head + n, std::memory_order_release);
        Wake();
        done += n;
      }
    }
    return Status::Ok();
  }
};

struct ShmPointToPoint::Incoming : Channel {
  struct Op {
    at::Tensor target;  // contiguous: the user's tensor, or a buffer copied into it at the end
    at::Tensor user;
    int tag = 0;
    c10::intrusive_ptr<c10::ivalue::Future> future;
  };
  Mutex mu;
  std::deque<Op> posted GUARDED_BY(mu);

  // Receives the front message into op.target. block = false: only when the whole message is
  // already in the ring; otherwise sets *not_yet and consumes nothing.
  Status Receive(const Op& op, bool block, const ShmPointToPointOptions& options, bool* not_yet) {
    *not_yet = false;
    SegmentHeader* hd = h();
    uint64_t tail = hd->tail.load(std::memory_order_relaxed);
    auto available = [&] { return hd->head.load(std::memory_order_acquire) - tail; };
    const std::string expect = "tag " + std::to_string(op.tag) + ", " +
                               std::to_string(op.target.nbytes()) + " bytes of " +
                               c10::toString(op.target.scalar_type());
    if (block) {
      LAUNCH_RETURN_IF_ERROR(Wait([&] { return available() >= sizeof(MessageHeader); }, options,
                                  "a message (" + expect + ")"));
    } else if (available() < sizeof(MessageHeader)) {
      *not_yet = true;
      return Status::Ok();
    }
    MessageHeader m;
    CopyOut(tail, reinterpret_cast<char*>(&m), sizeof(m));
    if (m.magic != kMessageMagic || m.seq != seq)
      return Status::ProtocolError("shared-memory send/recv: corrupt message from rank " +
                                   std::to_string(peer) + " to rank " + std::to_string(self));
    if (m.tag != op.tag || m.bytes != static_cast<uint64_t>(op.target.nbytes()) ||
        m.dtype != static_cast<int32_t>(op.target.scalar_type()))
      return Status::ProtocolError(
          "shared-memory send/recv: rank " + std::to_string(self) + " posted a receive of " +
          expect + " from rank " + std::to_string(peer) + ", whose next message is " + Describe(m) +
          " (messages between two ranks are matched in the order they were sent)");
    if (!block && available() < sizeof(m) + m.bytes) {
      *not_yet = true;
      return Status::Ok();
    }
    tail += sizeof(m);
    hd->tail.store(tail, std::memory_order_release);
    char* dst = static_cast<char*>(op.target.data_ptr());
    uint64_t done = 0;
    while (done < m.bytes) {
      LAUNCH_RETURN_IF_ERROR(
          Wait([&] { return available() > 0; }, options, "the rest of a message (" + expect + ")"));
      const uint64_t n = std::min(available(), m.bytes - done);
      CopyOut(tail, dst + done, n);
      tail += n;
      hd->tail.store(tail, std::memory_order_release);
      done += n;
    }
    ++seq;
    Wake();  // a sender streaming into a full ring has room now
    return Status::Ok();
  }
};

// The Work of a receive: the copy happens in wait() (and in isCompleted() when the message is
// already complete in the ring), on the caller's thread.
class ShmPointToPoint::RecvWork : public shm::FutureWork {
 public:
  RecvWork(ShmPointToPoint* owner, Incoming* in, c10::intrusive_ptr<c10::ivalue::Future> future)
      : FutureWork(std::move(future), c10d::OpType::RECV), owner_(owner), in_(in) {}
  bool isCompleted() override {
    if (!future_->completed()) owner_->Progress(in_, nullptr);
    return future_->completed();
  }
  bool wait(std::chrono::milliseconds timeout) override {
    if (!future_->completed()) owner_->Progress(in_, future_.get());
    return FutureWork::wait(timeout);
  }

 private:
  ShmPointToPoint* owner_;
  Incoming* in_;
};

ShmPointToPoint::ShmPointToPoint(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                                 std::vector<int> pids, const ShmPointToPointOptions& options)
    : store_(std::move(store)),
      rank_(rank),
      world_(world_size),
      pids_(std::move(pids)),
      options_(options) {}

ShmPointToPoint::~ShmPointToPoint() {
  const Status shut = Status::Interrupted("shared-memory send/recv shut down");
  for (auto& [dst, out] : outgoing_) {
    {
      MutexLock lock(&out->mu);
      out->stop = true;
    }
    out->stopping.store(true);
    out->cv.NotifyAll();
    if (out->base) out->Wake();  // a streaming send sleeping on the futex sees `stopping`
    if (out->thread.joinable()) out->thread.join();
    for (auto& op : out->queue) shm::Complete(*op.future, shut, op.tensor);
    out->queue.clear();
    // The receiver stops waiting for messages that will not come (what is in the ring it
    // still gets: it reads before it looks at the flag).
    out->Fail(shut);
  }
  for (auto& [src, in] : incoming_) {
    // A receive waiting on another thread (it holds the channel's mutex) gives up at its next
    // wake-up, within liveness_interval.
    in->stopping.store(true);
    MutexLock lock(&in->mu);
    for (auto& op : in->posted) shm::Complete(*op.future, shut, op.user);
    in->posted.clear();
    in->Fail(shut);
  }
}

bool ShmPointToPoint::Supports(const std::vector<at::Tensor>& tensors) {
  if (tensors.size() != 1) return false;
  const at::Tensor& t = tensors[0];
  return t.defined() && t.device().is_cpu() && t.layout() == c10::kStrided;
}

StatusOr<ShmPointToPoint::Outgoing*> ShmPointToPoint::GetOutgoing(int dst) {
  MutexLock lock(&mu_);
  auto it = outgoing_.find(dst);
  if (it != outgoing_.end()) return it->second.get();
  auto out = std::make_unique<Outgoing>();
  out->self = rank_;
  out->peer = dst;
  out->peer_pid = pids_[dst];
  out->peer_pidfd = shm::PidfdOpen(pids_[dst]);  // -1: kill() and /proc instead
  out->abandoned = &abandoned_;
  const size_t ring = std::max<size_t>(shm::kCacheLine, options_.ring_bytes);
  out->size = kHeaderBytes + ring;
  std::string error;
  void* base = nullptr;
  out->memfd = shm::CreateSegment("launch-shm-p2p", out->size, &base, &error);
  Outgoing* raw = out.get();
  try {
    if (out->memfd < 0) {
      // The receiver learns why instead of waiting for a record that never comes.
      shm::StoreSet(*store_, Key(rank_, dst), "error " + error);
      out->failed =
          Status::IoError("rank " + std::to_string(rank_) + ": shared-memory channel to rank " +
                          std::to_string(dst) + ": " + error);
    } else {
      out->base = base;
      auto* h = new (base) SegmentHeader();
      h->magic = kP2pMagic;
      h->token = std::random_device{}() | (static_cast<uint64_t>(std::random_device{}()) << 32);
      h->version = kP2pVersion;
      h->sender = rank_;
      h->receiver = dst;
      h->ring_bytes = ring;
      std::ostringstream record;
      record << ::getpid() << " " << out->memfd << " " << out->size << " " << h->token;
      shm::StoreSet(*store_, Key(rank_, dst), record.str());
    }
  } catch (const std::exception& e) {
    out->failed = Status::IoError("rank " + std::to_string(rank_) +
                                  ": publishing the shared-memory channel to rank " +
                                  std::to_string(dst) + " in the store: " + e.what());
  }
  outgoing_.emplace(dst, std::move(out));
  return raw;
}

StatusOr<ShmPointToPoint::Incoming*> ShmPointToPoint::GetIncoming(int src) {
  MutexLock lock(&mu_);
  auto it = incoming_.find(src);
  if (it != incoming_.end()) return it->second.get();
  auto in = std::make_unique<Incoming>();
  in->self = rank_;
  in->peer = src;
  in->peer_pid = pids_[src];
  in->peer_pidfd = shm::PidfdOpen(pids_[src]);
  in->abandoned = &abandoned_;
  Incoming* raw = in.get();
  incoming_.emplace(src, std::move(in));
  return raw;
}

c10::intrusive_ptr<c10d::Work> ShmPointToPoint::Send(const at::Tensor& tensor, int dst, int tag) {
  auto future = shm::TensorListFuture();
  auto fail = [&](const Status& s) {
    shm::Complete(*future, s, tensor);
    return c10::make_intrusive<shm::FutureWork>(future, c10d::OpType::SEND);
  };
  StatusOr<Outgoing*> got = GetOutgoing(dst);
  if (!got.ok()) return fail(got.status());
  Outgoing* out = *got;
  Outgoing::Op op{tensor.contiguous(), tag, future};
  {
    MutexLock lock(&out->mu);
    if (!out->failed.ok()) return fail(out->failed);
    if (out->stop) return fail(Status::Interrupted("shared-memory send/recv shut down"));
    out->CloseFdOnceOpened();
    if (!out->queue.empty() || !out->TryWriteWhole(op)) {
      out->queue.push_back(std::move(op));
      if (!out->thread.joinable()) out->thread = std::thread([this, out] { SenderLoop(out); });
      lock.Unlock();
      out->cv.NotifyAll();
      return c10::make_intrusive<shm::FutureWork>(future, c10d::OpType::SEND);
    }
  }
  shm::Complete(*future, Status::Ok(), tensor);
  return c10::make_intrusive<shm::FutureWork>(future, c10d::OpType::SEND);
}

void ShmPointToPoint::SenderLoop(Outgoing* out) {
  MutexLock lock(&out->mu);
  while (true) {
    while (!out->stop && out->queue.empty()) out->cv.Wait();
    if (out->stop) return;
    Outgoing::Op op = out->queue.front();  // stays queued: Send() must not write meanwhile
    Status status = out->failed;
    lock.Unlock();
    if (status.ok()) status = out->Stream(op, options_);
    lock.Lock();
    if (!status.ok()) {
      out->Fail(status);
    } else {
      ++out->seq;
    }
    out->queue.pop_front();
    lock.Unlock();
    shm::Complete(*op.future, status, op.tensor);
    op = Outgoing::Op();
    lock.Lock();
  }
}

c10::intrusive_ptr<c10d::Work> ShmPointToPoint::Recv(const at::Tensor& tensor, int src, int tag) {
  auto future = shm::TensorListFuture();
  StatusOr<Incoming*> got = GetIncoming(src);
  if (!got.ok()) {
    shm::Complete(*future, got.status(), tensor);
    return c10::make_intrusive<shm::FutureWork>(future, c10d::OpType::RECV);
  }
  Incoming* in = *got;
  Incoming::Op op;
  op.user = tensor;
  op.target = tensor.is_contiguous() ? tensor : at::empty(tensor.sizes(), tensor.options());
  op.tag = tag;
  op.future = future;
  {
    MutexLock lock(&in->mu);
    in->posted.push_back(std::move(op));
  }
  return c10::make_intrusive<RecvWork>(this, in, future);
}

Status ShmPointToPoint::OpenIncoming(Incoming* in, bool block, bool* not_yet) {
  *not_yet = false;
  Status status;
  const std::string key = Key(in->peer, rank_);
  try {
    if (!block && !store_->check({key})) {
      *not_yet = true;
      return status;
    }
    auto pause = std::chrono::microseconds(50);
    const auto deadline = Clock::now() + options_.timeout;
    while (status.ok() && !store_->check({key})) {
      if (in->stopping.load()) {
        status = Status::Interrupted("shared-memory send/recv shut down");
      } else if (in->Abandoned()) {
        status = in->GiveUp("a message from rank " + std::to_string(in->peer));
      } else if (shm::PidExited(in->peer_pid, in->peer_pidfd)) {
        status = Status::PeerLost("shared-memory send/recv: rank " + std::to_string(in->peer) +
                                  " (pid " + std::to_string(in->peer_pid) +
                                  ") exited before it sent to rank " + std::to_string(rank_));
      } else if (Clock::now() >= deadline) {
        status = Status::Timeout("shared-memory send/recv: rank " + std::to_string(rank_) +
                                 " waited " + std::to_string(options_.timeout.count()) +
                                 " ms for a message from rank " + std::to_string(in->peer));
      } else {
        std::this_thread::sleep_for(pause);
        pause = std::min<std::chrono::microseconds>(pause * 2, options_.liveness_interval);
      }
    }
    if (status.ok()) {
      const std::string record = shm::StoreGet(*store_, key);
      std::istringstream fields(record);
      long long pid = 0, fd = -1;
      unsigned long long size = 0, token = 0;
      if (record.rfind("error ", 0) == 0) {
        status = Status::IoError("shared-memory send/recv: rank " + std::to_string(in->peer) +
                                 " could not create its channel to rank " + std::to_string(rank_) +
                                 ": " + record.substr(6));
      } else if (!(fields >> pid >> fd >> size >> token) || size <= kHeaderBytes) {
        status = Status::ProtocolError("shared-memory send/recv: malformed channel record '" +
                                       record + "'");
      } else {
        std::string error;
        void* base = shm::OpenSegment(static_cast<int>(pid), static_cast<int>(fd), size, &error);
        const auto* h = static_cast<const SegmentHeader*>(base);
        if (!base) {
          status = Status::IoError("shared-memory send/recv: rank " + std::to_string(rank_) + " " +
                                   error);
        } else if (h->magic != kP2pMagic || h->token != token || h->version != kP2pVersion ||
                   h->sender != in->peer || h->receiver != rank_ ||
                   h->ring_bytes != size - kHeaderBytes) {
          ::munmap(base, size);
          status = Status::ProtocolError("shared-memory send/recv: the segment of rank " +
                                         std::to_string(in->peer) + " is not its channel to rank " +
                                         std::to_string(rank_));
        } else {
          in->base = base;
          in->size = size;
          in->h()->receiver_opened.store(1);
        }
      }
    }
  } catch (const std::exception& e) {
    status = Status::IoError("shared-memory send/recv: rank " + std::to_string(rank_) +
                             " reading rank " + std::to_string(in->peer) +
                             "'s channel record from the store: " + e.what());
  }
  return status;
}

void ShmPointToPoint::Progress(Incoming* in, const c10::ivalue::Future* until) {
  const bool block = until != nullptr;
  if (block) {
    in->mu.Lock();
  } else if (!in->mu.TryLock()) {
    return;  // another thread is receiving
  }
  MutexLock lock(&in->mu, AdoptLock{});
  std::vector<std::pair<Incoming::Op, Status>> done;
  while (!in->posted.empty()) {
    Incoming::Op& op = in->posted.front();
    Status status = in->failed;
    if (status.ok() && !in->base) {
      bool not_yet = false;
      status = OpenIncoming(in, block, &not_yet);
      if (not_yet) break;
    }
    if (status.ok()) {
      bool not_yet = false;
      status = in->Receive(op, block, options_, &not_yet);
      if (not_yet) break;  // nothing consumed
    }
    if (!status.ok()) in->Fail(status);
    const bool last = op.future.get() == until;
    done.emplace_back(std::move(op), status);
    in->posted.pop_front();
    if (last) break;
  }
  lock.Unlock();
  for (auto& [op, status] : done) {
    if (status.ok() && !op.target.is_same(op.user)) op.user.copy_(op.target);
    shm::Complete(*op.future, status, op.user);
  }
}

}  // namespace launch::trainer
