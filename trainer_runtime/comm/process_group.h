#pragma once

// The c10d process group the workers communicate through, built from DistEnv: a TCPStore at
// MASTER_ADDR:MASTER_PORT (rank 0 hosts it) and ProcessGroupGloo for CPU tensors (plus
// ProcessGroupNCCL for CUDA tensors when LibTorch has CUDA: torch_compat.h).
//
// CountingProcessGroup wraps the real group and forwards every collective the trainer uses,
// counting all-reduces, reduce-scatters and all-gathers and recording when each was launched. The
// DDP Reducer talks to the wrapper, so tests and metrics see real counts (no_sync really skips
// communication) and real launch times (buckets really start during backward), not assumptions.
//
// When every rank of the group is on this host, CreateProcessGroup also gives the wrapper a
// shared-memory all-reduce (shm_allreduce.h): allreduce() of one dense contiguous CPU tensor of
// float, double or bfloat16 with ReduceOp SUM goes there (asynchronous, in issue order, like
// Gloo's), and so do ZeRO's flat collectives: ReduceScatterFlat of such a tensor and
// AllGatherFlat of a dense contiguous CPU tensor of any dtype (ShmAllReduce::Supports*). Every
// other operation, and everything when LAUNCH_SHM_ALLREDUCE=0, goes to Gloo. When the ranks span
// hosts and some host has more than one, the same all-reduces, the broadcasts from rank 0 and
// the reduce-scatters (as an all-reduce of the input) run in two levels instead
// (hierarchical.h: shared memory inside each host, Gloo between one leader per host); the
// all-gathers stay on Gloo. Otherwise everything goes to Gloo; there the reduce-scatter is an
// all-reduce of the input followed by a copy of this rank's shard (LibTorch 1.13's Gloo has no CPU
// reduce_scatter) and the all-gather is Gloo's allgather into views of the output. Each transport
// sees the same subsequence of operations on every rank, so the two never need ordering between
// them. In the same case send() and recv() of a CPU tensor go through shared-memory rings
// (shm_p2p.h: the pipeline's activations and gradients): all of them, so messages between two ranks
// never straddle two transports. CUDA tensors go to NCCL where the group has it for them; over
// Gloo (ranks sharing a GPU in tests, compat/platform.h) send() and recv() move a host copy, as
// Gloo's point-to-point reads host memory only.
//
// Internal to trainer_runtime (includes LibTorch).

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "base/collective_ring.h"
#include "base/mutex.h"
#include "base/status.h"
#include "base/thread_annotations.h"
#include "trainer_runtime/comm/hierarchical.h"
#include "trainer_runtime/comm/shm_allreduce.h"
#include "trainer_runtime/comm/shm_p2p.h"
#include "trainer_runtime/util/env.h"

namespace launch::trainer {

class CountingProcessGroup : public c10d::ProcessGroup {
 public:
  using Clock = std::chrono::steady_clock;

  // `shm`: the shared-memory all-reduce to route supported all-reduces to; `p2p`: the
  // shared-memory send/recv; `hierarchical`: the two-level all-reduce of a group spanning
  // hosts (REQUIRES: not with `shm`); null: Gloo.
  explicit CountingProcessGroup(c10::intrusive_ptr<c10d::ProcessGroup> inner,
                                std::unique_ptr<ShmAllReduce> shm = nullptr,
                                std::unique_ptr<ShmPointToPoint> p2p = nullptr,
                                std::unique_ptr<HierarchicalAllReduce> hierarchical = nullptr);
  // The send/recv channels go first: their threads may still be streaming.
  ~CountingProcessGroup() override;

  const std::string getBackendName() const override { return inner_->getBackendName(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  // AllGatherFlat(input, output).
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  // ReduceScatterFlat(input, output) for ReduceOp SUM; other ops go to the wrapped group.
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override;

  // ZeRO's gradient reduction: `output` = the sum over ranks of each rank's
  // input[rank * S, (rank + 1) * S), S = output.numel(), asynchronously (the Work's future
  // completes with [output] once it is written; wait() rethrows a failure as c10::Error).
  // Through shared memory when the group has it and ShmAllReduce::SupportsReduceScatter: sums in
  // rank order, bit-identical to allreduce() through shared memory, `input` unchanged. CUDA
  // tensors where the group carries them over NCCL: NCCL's reduce-scatter (in place when
  // `output` is input's own shard). Through Gloo otherwise: an all-reduce of `input` in place, then
  // this rank's shard copied out (bit-identical to allreduce() through Gloo; bfloat16, which
  // LibTorch 1.13's Gloo cannot add, is summed in float and rounded once). So `input`'s contents
  // are unspecified afterwards. COLLECTIVE: every rank, same sizes and dtype, same point in its
  // sequence. REQUIRES (checked: c10::Error): input and output contiguous, one dtype, input.numel()
  // == getSize() * output.numel(); output is input's own shard or does not overlap it. Counted as a
  // reduce-scatter of input's bytes, its launch time recorded with the all-reduces'. An empty
  // output completes at once, without communicating (on every rank alike).
  c10::intrusive_ptr<c10d::Work> ReduceScatterFlat(const at::Tensor& input,
                                                   const at::Tensor& output);
  // ZeRO's parameter gather: `output` = every rank's `input` concatenated in rank order, any
  // dtype, asynchronously (as above). Through shared memory when the group has it and
  // ShmAllReduce::SupportsAllGather, NCCL's all-gather for CUDA tensors where the group carries
  // them over NCCL, Gloo's allgather into views of `output` otherwise. COLLECTIVE, as above.
  // REQUIRES (checked: c10::Error): contiguous, one dtype, output.numel() == getSize() *
  // input.numel(); input is output's own part or does not overlap it. Counted as an all-gather of
  // output's bytes.
  c10::intrusive_ptr<c10d::Work> AllGatherFlat(const at::Tensor& input, const at::Tensor& output);

  // Context parallelism's exchange: `input` is getSize() equal blocks (flat, in rank order); block
  // r goes to rank r, and `output`'s block r is what rank r sent this rank. Any dtype (sent as
  // bytes), asynchronously (as above). NCCL's all-to-all for CUDA tensors where the group carries
  // them over NCCL, Gloo's otherwise. COLLECTIVE, as above. REQUIRES (checked: c10::Error):
  // contiguous, one dtype, equal sizes divisible by getSize(), not overlapping. Counted as an
  // all-to-all of input's bytes.
  c10::intrusive_ptr<c10d::Work> AllToAllFlat(const at::Tensor& input, const at::Tensor& output);

  // Gives up on the group, for a rank that learnt of a lost peer: every operation blocked in it,
  // on this rank or on a peer, and every later one fails at once instead of waiting out a
  // timeout. The group's Gloo connections (the leaders' too, across hosts) are shut down, which
  // a peer's Gloo reads as "Connection closed by peer", and the shared-memory abort flags are
  // raised (PeerLost naming this rank): a loss spreads at once to every survivor connected to
  // this one, whatever the ring order. Afterwards the group is only fit to be destroyed.
  // Thread-safe (the caller keeps the group alive meanwhile).
  void Abandon();
  // The group's connected sockets, for Abandon (CreateGroupOver names them; the group keeps
  // duplicates, closed with it). Before the group is shared.
  void set_sockets(const std::vector<int>& fds);

  // The wrapped group, for control-plane collectives (signals, triggers, metrics) that are not
  // part of a step's gradient communication and must not show in its counts.
  c10d::ProcessGroup& inner() { return *inner_; }

  // The shared-memory all-reduce, or null when all-reduces go to Gloo. For callers that run
  // one inline (ShmAllReduce::AllReduceNow) and account for it with RecordAllreduce.
  ShmAllReduce* shm() const { return shm_.get(); }
  // The shared-memory send/recv, or null when send/recv go to Gloo.
  ShmPointToPoint* p2p() const { return p2p_.get(); }
  // The two-level all-reduce across hosts, or null.
  HierarchicalAllReduce* hierarchical() const { return hierarchical_.get(); }
  // "shared memory", "hierarchical: shared memory within 2 hosts + Gloo across" or
  // "Gloo (<why not shared memory>)", for logs.
  const std::string& allreduce_transport() const { return transport_; }
  void set_allreduce_transport(std::string description) { transport_ = std::move(description); }

  // Counts an all-reduce carried by other means than allreduce() (parallel/ddp.cc's direct path for
  // the last bucket: the two-rank exchange, or the shared-memory all-reduce run inline), so
  // counts and launch times cover every gradient reduction whatever its transport.
  void RecordAllreduce(int64_t bytes);

  // Hang forensics (base/collective_ring.h): from AttachRing on, every collective above
  // (broadcast, the all-reduces, all-gathers, reduce-scatters, barrier; not send/recv, whose
  // order differs between ranks) is recorded in `ring` under group `name`, and marked done when
  // its Work completes. Null `ring`: nothing recorded (the default). Call before the group is
  // used. RingBegin/RingDone record an operation carried by other means (the inline
  // shared-memory all-reduce, the two-rank exchange) in the same sequence; RingBegin returns 0
  // when nothing is recorded, and RingDone(0, ...) does nothing.
  void AttachRing(CollectiveRing* ring, std::string_view name);
  uint64_t RingBegin(CollectiveOp op, int64_t bytes,
                     CollectiveState state = CollectiveState::kStarted);
  void RingDone(uint64_t token, bool ok = true);

  // Counters. Thread-safe: the Reducer launches all-reduces from the autograd engine.
  int64_t allreduce_count() const;
  // How many of those went through RecordAllreduce (the direct last-bucket path).
  int64_t recorded_count() const;
  int64_t allreduce_bytes() const;
  // Reduce-scatters (ReduceScatterFlat) and the bytes of their inputs.
  int64_t reduce_scatter_count() const;
  int64_t reduce_scatter_bytes() const;
  // All-gathers through AllGatherFlat (not the list-form allgather(), which is forwarded
  // uncounted) and the bytes of their outputs.
  int64_t allgather_count() const;
  int64_t allgather_bytes() const;
  // All-to-alls (AllToAllFlat) and the bytes of their inputs.
  int64_t alltoall_count() const;
  int64_t alltoall_bytes() const;
  // Of the operations above, those this rank ran across hosts as its host's leader
  // (hierarchical.h), and the bytes it handed to the leaders' Gloo group; 0 when the group is
  // not hierarchical or this rank is no leader.
  int64_t cross_host_count() const;
  int64_t cross_host_bytes() const;
  // Launch times of gradient reductions (all-reduces and reduce-scatters) since the last
  // TakeLaunchTimes() call: what "launched before the backward pass ended" is measured on.
  std::vector<Clock::time_point> TakeLaunchTimes();
  // Launch times of AllGatherFlat calls since the last call: kept apart, since ZeRO-3 gathers
  // parameters during the backward pass too and they are no gradient reduction.
  std::vector<Clock::time_point> TakeAllgatherLaunchTimes();

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> inner_;
  std::unique_ptr<ShmAllReduce> shm_;
  std::unique_ptr<ShmPointToPoint> p2p_;
  std::unique_ptr<HierarchicalAllReduce> hierarchical_;
  std::string transport_ = "Gloo";
  std::vector<int> sockets_;  // set_sockets' duplicates; read by Abandon
  // CUDA tensors travel over NCCL (the flat collectives then use its reduce-scatter and
  // all-gather, in place).
  bool nccl_ = false;
  // Marks the ring entry `token` done when `work` completes; returns `work`.
  c10::intrusive_ptr<c10d::Work> Tracked(c10::intrusive_ptr<c10d::Work> work, uint64_t token);
  CollectiveRing* ring_ = nullptr;  // not owned (CollectiveRing::ForProcess lives forever)
  int ring_group_ = -1;
  mutable Mutex mu_;
  int64_t allreduce_count_ GUARDED_BY(mu_) = 0;
  int64_t allreduce_bytes_ GUARDED_BY(mu_) = 0;
  int64_t recorded_count_ GUARDED_BY(mu_) = 0;
  int64_t reduce_scatter_count_ GUARDED_BY(mu_) = 0;
  int64_t reduce_scatter_bytes_ GUARDED_BY(mu_) = 0;
  int64_t allgather_count_ GUARDED_BY(mu_) = 0;
  int64_t allgather_bytes_ GUARDED_BY(mu_) = 0;
  int64_t alltoall_count_ GUARDED_BY(mu_) = 0;
  int64_t alltoall_bytes_ GUARDED_BY(mu_) = 0;
  std::vector<Clock::time_point> launch_times_ GUARDED_BY(mu_);
  std::vector<Clock::time_point> allgather_launch_times_ GUARDED_BY(mu_);
};

// Where a worker's Gloo device listens: what its peers are told to connect to.
struct GlooBinding {
  bool from_environment = false;  // GLOO_SOCKET_IFNAME named `interface`
  // The address bound (numeric); with from_environment, the interface's first (Gloo's pick).
  std::string address;
  std::string interface;  // the interface holding it ("eth0"); may be "" when unknown
  std::string why;        // "the route to MASTER_ADDR 10.0.0.1", ...
  // "10.0.0.2 on eth0, the route to MASTER_ADDR 10.0.0.1" or "interface eth0 (10.0.0.2) from
  // GLOO_SOCKET_IFNAME", for logs and errors.
  std::string Describe() const;
};

// Where this worker's Gloo binds, in this order:
//   1. GLOO_SOCKET_IFNAME when set (the user's choice always wins); InvalidConfig naming it and
//      this host's interfaces when no interface has that name;
//   2. 127.0.0.1 when MASTER_ADDR is a loopback address (every rank is on this host);
//   3. otherwise the local address of the route to MASTER_ADDR (base/interfaces.h RouteTo):
//      the address the other hosts reach, whatever this host's own name resolves to (Gloo's
//      default, loopback on stock Debian hosts); IoError when there is no route.
StatusOr<GlooBinding> ChooseGlooBinding(const std::string& master_addr);

// A process group of `size` ranks over `store` (Gloo for CPU tensors; NCCL for CUDA tensors when
// LibTorch has it and this rank has a GPU: torch_compat.h). Gloo's transport device is
// `binding` (ChooseGlooBinding); its worker threads env.tuning.gloo_threads. Every group a worker
// builds (the job's, a pipeline stage's) is made here, alike. Blocks until all ranks joined; throws
// what the backend throws when they do not (at once when a peer's address refuses).
c10::intrusive_ptr<c10d::ProcessGroup> NewGroup(const c10::intrusive_ptr<c10d::Store>& store,
                                                int rank, int size, const DistEnv& env,
                                                std::chrono::milliseconds timeout,
                                                const GlooBinding& binding);

// Sum-all-reduces `tensors` in place over `pg`, then divides them by `divisor`: one flat
// all-reduce per dtype (Gloo's per-call latency dominates small tensors; a model may mix
// dtypes), groups in order of first appearance so every rank builds the same calls.
// COLLECTIVE: every rank passes tensors of the same dtypes and sizes, in the same order.
// Throws c10::Error when a peer fails.
void AllReduceFlat(c10d::ProcessGroup& pg, const std::vector<at::Tensor>& tensors, int64_t divisor);

// Makes `tensors` (in place) equal to the group's rank `root`'s (0 by default), packed into as
// few broadcasts as their total size allows (c10d::broadcast_coalesced; mixed dtypes are fine).
// COLLECTIVE.
void BroadcastFromRank0(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                        std::vector<at::Tensor> tensors, int root = 0);

// After the store's host (rank 0) was lost: waits until a server at MASTER_ADDR:MASTER_PORT
// accepts a connection and keeps it for 100 ms, so the next ConnectStore reaches the
// replacement's new store. A connection the dying host's listener still took is reset as soon
// as that listener goes, which LibTorch 1.13's client does not survive (its callback thread
// throws and the process aborts; 2.x's constructor fails). Timeout after `timeout`.
Status AwaitStoreHost(const DistEnv& env, std::chrono::milliseconds timeout);

// A client of the job's TCPStore at MASTER_ADDR:MASTER_PORT, or its host (`host`: rank 0 when
// no agent hosts it). Errors name the address and the rank: Timeout "rank 1 could not reach
// the process-group store at 10.0.0.9:29500 within 30 s ...: ..." when the timeout passed,
// IoError "...: failed after 0.40 s (of its 30 s timeout): ..." when it ended sooner (a signal).
StatusOr<c10::intrusive_ptr<c10d::Store>> ConnectStore(const DistEnv& env, bool host,
                                                       std::chrono::milliseconds timeout);

// The group `name` ("world", "stage1", "data0", ...) of `size` ranks in which this process is
// `rank`, over the job's `store` (keys under a prefix per name and restart): Gloo (NewGroup),
// then the shared-memory all-reduce and send/recv when every rank of the group is on this host
// and none has LAUNCH_SHM_ALLREDUCE=0, or the hierarchical all-reduce when the ranks span hosts
// and some host has several of them (LAUNCH_SHM_ALLREDUCE=0 on any rank turns both off); all
// ranks decide alike, see allreduce_transport(); its
// operations wait for a peer at most `env.collective_timeout` (0: `timeout`). COLLECTIVE among
// the group's ranks; waits at most `timeout` for them to form it. Errors name the group, the store
// and where this rank's Gloo bound (GlooBinding::Describe): Timeout "... did not form within 300 s:
// ..." only when the timeout passed; IoError "... failed after 0.02 s (of its 300 s timeout): ..."
// when Gloo gave up earlier (a peer's address refused), with a hint when that peer announced a
// loopback address; ChooseGlooBinding's errors as they are. The log's transport names the binding
// too. Every group a worker builds is made here (the layout's axis groups: parallel/layout.h).
StatusOr<c10::intrusive_ptr<CountingProcessGroup>> CreateGroupOver(
    const c10::intrusive_ptr<c10d::Store>& store, const std::string& name, int rank, int size,
    const DistEnv& env, std::chrono::milliseconds timeout);

// The job's group of every rank: connects to (rank 0: hosts) the store, then CreateGroupOver
// with name "world".
StatusOr<c10::intrusive_ptr<CountingProcessGroup>> CreateProcessGroup(
    const DistEnv& env, std::chrono::milliseconds timeout);

}  // namespace launch::trainer
