#pragma once

// HierarchicalAllReduce: the all-reduce and the broadcast of a group whose ranks span hosts, in
// two levels, so that only one rank per host sends over the network:
//
//   all-reduce:  1. the ranks of each host sum through shared memory (ShmAllReduce, in local-rank
//                   order: local rank = place among the host's ranks by group rank);
//                2. one leader per host (its lowest group rank) all-reduces the host sums through
//                   a Gloo group of the leaders only (its own store prefix);
//                3. each leader broadcasts the result to its host through shared memory.
//   broadcast:   the leaders broadcast from rank 0 (always host 0's leader) through Gloo, then
//                each leader to its host through shared memory.
//
// Why: with Gloo's ring over every rank, each byte of a bucket crosses the network once per
// rank on a host; here once per host, and the host-local part runs at memory speed.
//
// Results are bit-identical on every rank: a host's sum is computed once per element in
// local-rank order (shm_allreduce.h), the leaders' Gloo sum gives every leader the same bits
// (each element is reduced by one leader and copied; with two hosts a + b == b + a anyway), and
// every other rank copies its leader's bytes. The order is ((h0 r0 + h0 r1 + ...) + (h1 r0 +
// ...)): equal to a one-host job's rank-order sum with two ranks per host and two hosts only up
// to float rounding in general. bfloat16 and float16 host sums round after each addition (as
// LibTorch does); the leaders add bfloat16 in float (LibTorch 1.13's Gloo cannot add it) and
// round once, float16 in float16 through Gloo (rounded after each addition).
//
// Operations run in issue order on one background thread (the DDP Reducer issues all-reduces
// from the autograd engine and expects them asynchronous, like Gloo's). Each rank's sequence of
// operations must be the same on every rank (COLLECTIVE), as for any process group. A failure
// (a peer died, a timeout) fails the operation with a c10::Error naming it; when a leader's
// Gloo step fails it aborts its host's segment, so the other ranks of its host fail at once
// instead of waiting out the timeout; every later operation fails with the first error.
//
// Internal to trainer_runtime (includes LibTorch).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "base/mutex.h"
#include "base/status.h"
#include "base/thread_annotations.h"
#include "trainer_runtime/comm/shm_allreduce.h"

namespace launch::trainer {

// Makes the leaders' Gloo group: rank `rank` of `size` over `store` (already prefixed). Throws
// what the backend throws when the group does not form.
using LeaderGroupFactory = std::function<c10::intrusive_ptr<c10d::ProcessGroup>(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size)>;

class HierarchicalAllReduce;
// What HierarchicalAllReduce::Create decided.
struct HierarchicalSetup {
  std::unique_ptr<HierarchicalAllReduce> hierarchical;  // null: not hierarchical
  std::string reason;  // why not, when null ("one rank per host", ...)
};

class HierarchicalAllReduce {
 public:
  // Builds the two levels for rank `rank` of the group whose ranks run on `hosts` (indexed by
  // rank: every rank's host identity, as ShmSetup::hosts holds them; "off" means that rank
  // disabled shared memory). COLLECTIVE: every rank of the group calls it with the same `hosts`
  // and a store (a fresh prefix of the group's) shared by them. Returns {nullptr, reason} (not
  // an error), alike on every rank, when the group is on one host, when every host has one
  // rank, when any rank is "off", or when any host could not set up its segment. `shm`: the
  // host segments' options (their host_identity is this rank's hosts[rank]). `leaders` makes
  // the Gloo group of the leaders (only leaders call it). Errors: the store failed or timed
  // out, or the leaders' group did not form (Timeout).
  static StatusOr<HierarchicalSetup> Create(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                            const std::vector<std::string>& hosts,
                                            const LeaderGroupFactory& leaders,
                                            const ShmAllReduceOptions& shm);

  // One dense, contiguous CPU tensor of float, double, bfloat16 or float16, ReduceOp SUM
  // (ShmAllReduce::Supports). Anything else stays on the group's Gloo.
  static bool Supports(const std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts);
  // One dense, contiguous CPU tensor of any dtype (its bytes are copied).
  static bool SupportsBroadcast(const at::Tensor& tensor);

  // Fails what is still queued ("shut down"), stops the thread, then the host segment (whose
  // destructor tells the host's peers if an operation was running) and the leaders' group.
  ~HierarchicalAllReduce();
  HierarchicalAllReduce(const HierarchicalAllReduce&) = delete;
  HierarchicalAllReduce& operator=(const HierarchicalAllReduce&) = delete;

  // Sums `tensor` in place over the group, asynchronously (queued, run in issue order). The
  // Work's future completes with [tensor] or a c10::Error; wait() rethrows it. COLLECTIVE.
  // REQUIRES: Supports({tensor}, SUM); the caller keeps `tensor` unchanged until completion.
  // Thread-safe.
  c10::intrusive_ptr<c10d::Work> AllReduceAsync(const at::Tensor& tensor);
  // Makes `tensor` equal to group rank 0's, asynchronously as above. COLLECTIVE.
  // REQUIRES: SupportsBroadcast(tensor).
  c10::intrusive_ptr<c10d::Work> BroadcastFromRank0Async(const at::Tensor& tensor);

  // Raises the host segment's abort flag (ShmAllReduce::AbortPeers): this host's ranks fail
  // their current and later operations at once. The leaders' connections are the caller's to
  // shut (CountingProcessGroup::Abandon). Thread-safe.
  void AbortPeers() {
    if (local_) local_->AbortPeers();
  }

  // "hierarchical: shared memory within 2 hosts + Gloo across", for logs.
  std::string Describe() const;
  int host_count() const { return host_count_; }
  // This rank's place on its host, and whether it is the host's leader.
  int local_rank() const { return local_rank_; }
  bool leader() const { return local_rank_ == 0; }
  // Operations this rank ran through the leaders' Gloo group, and the bytes it handed to them
  // (0 on a rank that is no leader): what crossed hosts from here.
  int64_t cross_host_count() const { return cross_host_count_.load(); }
  int64_t cross_host_bytes() const { return cross_host_bytes_.load(); }

 private:
  enum class Kind { kAllReduce, kBroadcast };
  struct Op {
    Kind kind = Kind::kAllReduce;
    at::Tensor tensor;
    c10::intrusive_ptr<c10::ivalue::Future> future;
  };

  HierarchicalAllReduce(int host, int host_count, int local_rank,
                        std::unique_ptr<ShmAllReduce> local,
                        c10::intrusive_ptr<c10d::ProcessGroup> leaders);
  c10::intrusive_ptr<c10d::Work> Enqueue(Op op, c10d::OpType type);
  void WorkerLoop();
  Status Execute(const Op& op);
  // The leaders' Gloo step of `op`; c10d's exceptions as a Status.
  Status CrossHost(const Op& op);

  const int host_;
  const int host_count_;
  const int local_rank_;
  std::unique_ptr<ShmAllReduce> local_;             // null when this host has one rank
  c10::intrusive_ptr<c10d::ProcessGroup> leaders_;  // null on a rank that is no leader
  std::atomic<int64_t> cross_host_count_{0};
  std::atomic<int64_t> cross_host_bytes_{0};
  Status failed_;  // the first error; only the worker thread

  Mutex mu_;
  CondVar cv_{&mu_};
  std::deque<Op> queue_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread worker_;
};

}  // namespace launch::trainer
