#pragma once

// ShmPointToPoint: send/recv between processes of one host through shared-memory rings, used by
// CountingProcessGroup (process_group.h) for every send() and recv() when the group's ranks
// share a host (the same condition as the shared-memory all-reduce, decided once for the group).
// The pipeline's activations and gradients are its traffic.
//
// Why: with Gloo every message is a rendezvous between the two ranks' Gloo I/O threads (the
// receiver announces its buffer, the sender's thread then writes through loopback TCP and the
// receiver's thread reads it), so its latency is set by when those threads get a core. On a
// machine whose cores are busy with the stages' compute that was 0.3-3 ms per message, more than
// the pipeline bubble itself at 8 micro-batches. Here a send copies the tensor into a ring the
// receiver maps, on the calling thread, and the receiver copies it out on its calling thread: no
// thread hand-off on either side, a futex wake when the receiver is already waiting.
//
// Channels: one per ordered pair (sender, receiver), created by the sender on its first send to
// that receiver: a memfd segment (header + a ring of `ring_bytes`), published through the store
// as "pid fd size token"; the receiver opens /proc/<pid>/fd/<n> on its first receive from that
// sender (waiting for the record if the sender has not sent yet) and says so in the header, so
// the sender can close its fd. Nothing exists in any file system: no exit, SIGKILL included, can
// leave anything behind. Pairs that never talk cost nothing.
//
// Messages: a 32-byte header (tag, dtype, bytes, sequence number) and the tensor's bytes, as one
// byte stream through the ring (single producer, single consumer: `head` written only by the
// sender, `tail` only by the receiver). A message larger than the free space is streamed as the
// receiver drains it.
//
// Semantics, and where they differ from Gloo's:
//   - send() completes when the bytes are in a ring the receiver has mapped (the caller may
//     reuse the tensor; the message survives the sender's exit). It copies on the calling
//     thread when the receiver has opened the channel, the whole message fits and no earlier
//     send to that receiver is pending, which in a pipeline's steady state is every send;
//     otherwise a thread of the channel streams it, in order, so send() never blocks on the
//     receiver. The destructor fails sends still pending (as Gloo's does not wait for them).
//   - recv() only posts the receive; the copy happens in the Work's wait() on the waiting thread
//     (isCompleted() also completes it when the whole message is already in the ring). Receives
//     from one sender complete in the order they were posted, and messages are matched in the
//     order they were sent: unlike Gloo, tags do not reorder messages. A message whose tag,
//     dtype or size differs from the posted receive fails with an error naming both, never
//     lands in the wrong tensor.
//   - A failure (the peer died, gave up, or did not send within `timeout`) fails the operation
//     with a c10::Error and leaves the channel failed: every later operation on it fails at once
//     with the first error. A waiting side checks the peer's liveness every `liveness_interval`
//     (pidfd), so a SIGKILLed peer fails a waiting receive in about that long; bytes the peer
//     wrote before it died are still received.
//
// Thread-safe. Internal to trainer_runtime (includes LibTorch).

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "base/mutex.h"
#include "base/status.h"
#include "base/thread_annotations.h"

namespace launch::trainer {

struct ShmPointToPointOptions {
  // Default 8 MiB: the ring of each channel (one per ordered pair that communicates), allocated
  // when the sender first sends. A pipeline micro-batch's activation up to this size is sent
  // without waiting; bigger ones are streamed.
  size_t ring_bytes = 8u << 20;
  // Default 300 s: how long a receive waits for its message, and a streaming send for room in
  // the ring, before failing with a timeout (the group's timeout).
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // Default 10 ms: how often a waiting side checks that its peer is alive.
  std::chrono::milliseconds liveness_interval{10};
};

class ShmPointToPoint {
 public:
  // For rank `rank` of `world_size`, whose ranks have pids `pids` (ShmAllReduce::pids(): the
  // ranks already agreed that they share a host and pid namespace). `store` is a store shared by
  // the group's ranks under a prefix of this group's own; it is used only when a channel is
  // first used. Not collective: nothing happens until a send or receive.
  ShmPointToPoint(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                  std::vector<int> pids, const ShmPointToPointOptions& options = {});
  // Stops the channels' threads (a send still pending fails with "shut down"), tells the peers
  // (their waits fail promptly instead of timing out), unmaps every segment, closes every fd.
  ~ShmPointToPoint();
  ShmPointToPoint(const ShmPointToPoint&) = delete;
  ShmPointToPoint& operator=(const ShmPointToPoint&) = delete;

  // Whether send/recv of `tensors` can go here: one defined strided CPU tensor (any dtype;
  // a non-contiguous one is copied). Anything else stays on Gloo.
  static bool Supports(const std::vector<at::Tensor>& tensors);

  // Sends `tensor` to rank `dst` with `tag`; see the header comment for completion.
  // REQUIRES: Supports({tensor}), dst != rank, 0 <= dst < world_size.
  c10::intrusive_ptr<c10d::Work> Send(const at::Tensor& tensor, int dst, int tag);
  // Receives the next message from rank `src` into `tensor` (same dtype and number of bytes,
  // same tag). REQUIRES: as Send.
  c10::intrusive_ptr<c10d::Work> Recv(const at::Tensor& tensor, int src, int tag);

  // Gives up on the group (CountingProcessGroup::Abandon, from any thread): an operation
  // waiting now or later fails with PeerLost within liveness_interval and marks its channel
  // failed, so the peer's waits on it end too. Never blocks.
  void AbandonPeers() { abandoned_.store(true); }

  int rank() const { return rank_; }

 private:
  struct Channel;
  struct Outgoing;
  struct Incoming;
  class RecvWork;

  // The channel to `dst`, created (segment, store record) on first use.
  StatusOr<Outgoing*> GetOutgoing(int dst);
  // The channel from `src`, opened on first use: waits (bounded by the timeout, checking that
  // `src` is alive) for the sender's record.
  StatusOr<Incoming*> GetIncoming(int src);

  // Maps the segment of the channel `in` (its sender publishes the record with its first
  // send): waits for the record (bounded by the timeout, checking that the sender is alive), or
  // with block = false sets *not_yet when there is none yet. REQUIRES: in->mu held.
  Status OpenIncoming(Incoming* in, bool block, bool* not_yet);

  void SenderLoop(Outgoing* out);
  // Completes the posted receives of `in` in order, up to and including the one whose future
  // is `until` (null: only as far as complete messages are already in the ring, never waiting).
  void Progress(Incoming* in, const c10::ivalue::Future* until);

  const c10::intrusive_ptr<c10d::Store> store_;
  const int rank_;
  const int world_;
  const std::vector<int> pids_;
  const ShmPointToPointOptions options_;
  std::atomic<bool> abandoned_{false};

  Mutex mu_;  // channels are created once, never removed before ~
  std::map<int, std::unique_ptr<Outgoing>> outgoing_ GUARDED_BY(mu_);
  std::map<int, std::unique_ptr<Incoming>> incoming_ GUARDED_BY(mu_);
};

}  // namespace launch::trainer
