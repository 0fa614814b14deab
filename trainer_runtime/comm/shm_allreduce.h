#pragma once

// ShmAllReduce: a sum all-reduce between the processes of one host through a shared-memory
// segment, used by CountingProcessGroup (process_group.h) instead of Gloo's loopback-TCP ring
// when every rank of the group runs on this host; the same segment also carries a broadcast
// from rank 0 and ZeRO's reduce-scatter and all-gather. Gloo still carries everything else.
//
// Why: on a small machine the ranks' compute already fills the cores, and Gloo's ring costs
// kernel copies (two per byte per hop through loopback TCP) plus thread hand-offs. Here each
// rank copies its tensor into the segment once, reduces its own 1/W slice of it, and copies the
// result back: memcpy speed, no system call on the data path, futex sleeps instead of spinning.
// The operation is memory-bound, so no byte is moved twice: a rank does not stage its own
// slice (it reads it from its tensor) and stores each sum into the result region and its
// tensor in the same pass.
//
// Protocol (per chunk of at most `chunk_bytes`; bigger tensors go chunk by chunk). Rank r owns
// slice r: the r-th of W equal, cache-line-aligned parts of the chunk.
//   1. rank r copies its chunk, except slice r, into input slot r, writes the chunk's
//      descriptor (operation, total bytes, offset, dtype) and arrives at phase A;
//   2. once every rank arrived at A (descriptors must match: a mismatch is an error, not silent
//      corruption), rank r sums slice r over ranks 0, 1, ..., W-1 in rank order (its own part
//      from its tensor, the others' from their slots) into the shared result region and its
//      tensor, and arrives at phase B;
//   3. once every rank arrived at B, rank r copies the other slices of the result into its
//      tensor.
// Every element is summed by one rank in rank order and every rank copies the same bytes, so
// results are bit-identical on all ranks and equal to ((t0 + t1) + t2) + ... computed in one
// process (bfloat16 and float16 round after each addition, as LibTorch does). Phase A of chunk k+1
// cannot complete before every rank finished copying the result of chunk k, so one set of slots is
// enough.
//
// The all-reduce is a reduce-scatter (step 2) followed by an all-gather (step 3); ZeRO needs
// each half on its own, with the same two phases per chunk:
//   reduce-scatter (input of W shards of S elements; rank r keeps the sum of shard r): a chunk
//     covers the same m elements of every shard. Rank r copies its part of every other rank's
//     shard into its slot (W - 1 pieces of m elements; its own shard stays in its tensor),
//     arrives at A, sums its shard's part over ranks 0..W-1 in rank order (the same function as
//     step 2, so the bits equal the all-reduce's) into its output and arrives at B.
//   all-gather (every rank's input of B bytes, concatenated in rank order): rank r copies its
//     chunk into its slot (and into its own place in the output), arrives at A, copies the
//     other ranks' chunks from their slots into their places and arrives at B.
// Neither uses the result region. A rank does not wait for B after its last chunk (its output
// is complete once it arrived); it waits for the B it passed last before it next writes its
// slot or its descriptor, which is when the peers must have finished reading them.
//
// Waiting: each rank publishes how many phases it has passed (an atomic counter in the
// segment); a waiter spins briefly, then sleeps in FUTEX_WAIT on a shared wake counter with a
// timeout of `liveness_interval`, checking on each wake-up that the ranks it waits for are alive
// (pidfd; kill(pid, 0) and /proc/<pid>/stat where pidfd_open is unavailable). A dead peer, a
// peer that does not arrive within `timeout`, or a rank that gave up (it raises an abort flag
// in the segment so the others stop waiting too) fails the operation with a c10::Error; the
// transport then stays failed: every later operation fails at once with the first error.
//
// Segment: memfd_create (anonymous: nothing in any file system, so nothing can be left behind
// by any exit, SIGKILL included; the memory goes when the last rank unmaps it), sealed against
// resizing (a truncation would SIGBUS every rank) and allocated up front with fallocate (an
// out-of-memory shows at setup, not as a SIGBUS mid-training). Rank 0 publishes its pid and fd
// number through the c10d store and the others open /proc/<pid>/fd/<n>, rather than passing
// the fd with SCM_RIGHTS: no listening socket or socket name to create, secure and clean up
// (abstract names are per network namespace, path names can be left behind), one store key.
// Opening fails when the ranks do not share a pid namespace (containers); then every rank
// falls back to Gloo (the decision is made collectively through the store).
//
// Internal to trainer_runtime (includes LibTorch).

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "base/mutex.h"
#include "base/status.h"
#include "base/thread_annotations.h"

namespace launch::trainer {

struct ShmAllReduceOptions {
  // Default 4 MiB: bytes of one chunk, the size of each rank's input slot and of the result
  // region (the segment holds W + 1 of them). Bigger tensors are reduced chunk by chunk.
  // Rounded down to a multiple of 64 (slices start on cache lines); at least 64 per rank (a
  // reduce-scatter's slot holds a piece of every other rank's shard).
  size_t chunk_bytes = 4u << 20;
  // Default 300 s: how long one operation waits for a slow peer before it fails with a timeout
  // (the group's timeout; Gloo's collectives use the same).
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // Default 10 ms: how often a waiting rank checks that the peers it waits for are alive, so a
  // SIGKILLed peer fails the operation within about this long.
  std::chrono::milliseconds liveness_interval{10};
  // Default empty: where this rank runs is this process's host identity (hostname, boot id and
  // pid namespace; ranks share memory only when theirs are equal). Tests set it to pose as
  // ranks of several hosts on one machine (hierarchical.h's tests).
  std::string host_identity;
};

// What ShmAllReduce::Create decided.
class ShmAllReduce;
struct ShmSetup {
  std::unique_ptr<ShmAllReduce> shm;  // null: use Gloo
  std::string reason;                 // why not, when shm is null ("LAUNCH_SHM_ALLREDUCE=0", ...)
  // Every rank's host identity as the ranks published it, indexed by rank ("off": that rank
  // disabled the transport); empty when world_size < 2. The same on every rank: what
  // hierarchical.h groups the ranks of a group spanning hosts by.
  std::vector<std::string> hosts;
};

class ShmAllReduce {
 public:
  // Builds the transport for rank `rank` of `world_size`. COLLECTIVE: every rank of the group
  // calls it with the same world size and a store (a prefix of the group's, fresh per group)
  // shared by them; `enabled` (DistEnv::tuning.shm_allreduce, LAUNCH_SHM_ALLREDUCE) may differ
  // between ranks (any rank's false disables it for all).
  // Returns {nullptr, reason} (not an error) when the ranks are not all on this host and in
  // one pid namespace, when world_size < 2, when any rank passed enabled = false or could not
  // map the segment: all ranks get the same answer. Errors: the store failed or timed out
  // (Timeout/IoError), the segment could not be created (IoError).
  static StatusOr<ShmSetup> Create(c10d::Store& store, int rank, int world_size, bool enabled,
                                   const ShmAllReduceOptions& options = {});

  // Whether this transport can carry allreduce(tensors, opts): one dense, contiguous CPU tensor
  // of float, double, bfloat16 or float16, ReduceOp SUM. Anything else stays on Gloo.
  static bool Supports(const std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts);

  // Stops the worker thread: an operation still queued or running fails ("shut down") and, if
  // one was running, the peers are told (the abort flag) so they fail instead of waiting out
  // the timeout. Unmaps the segment; leaves no fd open.
  ~ShmAllReduce();
  ShmAllReduce(const ShmAllReduce&) = delete;
  ShmAllReduce& operator=(const ShmAllReduce&) = delete;

  // Sums `tensor` in place over the group, asynchronously: returns at once; a background thread
  // runs the operations in the order they were issued. The Work's future completes with
  // [tensor] (a tensor list, as Gloo's does) or with a c10::Error naming the failure; wait()
  // rethrows it. COLLECTIVE: every rank issues the same sequence of operations (same sizes and
  // dtypes, in the same order; checked, also for an empty tensor, which takes part in the
  // agreement like any other). REQUIRES: Supports({tensor}, SUM). The caller keeps `tensor`
  // unchanged until the future completes. Thread-safe.
  c10::intrusive_ptr<c10d::Work> AllReduceAsync(const at::Tensor& tensor);

  // The same operation run on the calling thread, after every operation issued before it (no
  // hand-off to the background thread: for a result the caller would wait for at once).
  // COLLECTIVE, REQUIRES as above. Thread-safe. Errors: PeerLost (a peer died or gave up),
  // Timeout, ProtocolError (the ranks issued different operations), Interrupted (shut down).
  Status AllReduceNow(const at::Tensor& tensor);

  // Makes `tensor` (any dtype: the bytes are copied) equal to rank 0's, on the calling thread
  // after every operation issued before it, chunk by chunk: once every rank has arrived (so
  // nobody still reads the result region), rank 0 copies its chunk there and the others copy it
  // out. Returns a completed Work (its wait() rethrows a failure, named as above). Used for
  // DDP's buffer broadcast before each forward, which Gloo makes cost a round trip through its
  // worker threads. COLLECTIVE: every rank calls it for the same sizes in the same order.
  // REQUIRES: SupportsBroadcast(tensor). Thread-safe.
  c10::intrusive_ptr<c10d::Work> BroadcastFromRank0(const at::Tensor& tensor);
  // One dense, contiguous CPU tensor.
  static bool SupportsBroadcast(const at::Tensor& tensor);

  // Reduce-scatter: `output` = the sum over ranks, in rank order 0, 1, ..., W-1, of each rank's
  // input[rank * S, (rank + 1) * S), where S = output.numel() (any size). Bit-identical to the
  // same elements of AllReduceAsync(input) (ZeRO is compared bit for bit with DDP). `input` is
  // left unchanged. Asynchronous and queued with the other operations in issue order; the
  // Work's future completes with [output], or with a c10::Error (wait() rethrows it).
  // COLLECTIVE: every rank issues it with the same sizes and dtype at the same point of its
  // sequence. REQUIRES: SupportsReduceScatter(input, output) (checked: a violation fails this
  // operation with InvalidArgument and issues nothing). `output` may be input's own shard
  // (input.narrow(0, rank * S, S) of a flat input), in place; no other overlap. The caller
  // keeps both tensors alive and `input` unchanged until the future completes. Thread-safe.
  c10::intrusive_ptr<c10d::Work> ReduceScatterAsync(const at::Tensor& input,
                                                    const at::Tensor& output);
  // The same on the calling thread after every operation issued before it (as AllReduceNow).
  // Errors: InvalidArgument (REQUIRES violated), and those of AllReduceNow.
  Status ReduceScatterNow(const at::Tensor& input, const at::Tensor& output);
  // Dense, contiguous CPU tensors of one dtype (float, double, bfloat16 or float16) with
  // input.numel() == world_size() * output.numel().
  bool SupportsReduceScatter(const at::Tensor& input, const at::Tensor& output) const;

  // All-gather: `output` = the concatenation of every rank's `input` in rank order (bytes
  // copied: any dtype). Asynchronous, queued, completed and failed as ReduceScatterAsync; the
  // future's value is [output]. COLLECTIVE, as above. REQUIRES: SupportsAllGather(input,
  // output) (checked as above). `input` may be output's own part (output.narrow(0, rank * N,
  // N) of a flat output), in place; no other overlap. Thread-safe.
  c10::intrusive_ptr<c10d::Work> AllGatherAsync(const at::Tensor& input, const at::Tensor& output);
  // The same on the calling thread after every operation issued before it.
  Status AllGatherNow(const at::Tensor& input, const at::Tensor& output);
  // Dense, contiguous CPU tensors of one dtype with output.numel() == world_size() *
  // input.numel().
  bool SupportsAllGather(const at::Tensor& input, const at::Tensor& output) const;

  // Gives up on the group: raises the abort flag, so the peers' current and later operations
  // fail (PeerLost, naming this rank) instead of waiting out the timeout, and so do this rank's.
  // For a caller whose own part of a larger collective failed elsewhere (hierarchical.h's
  // leader, when the cross-host step fails). Thread-safe.
  void AbortPeers() { Abort(); }

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  // Each rank's pid, as the ranks published them at setup (for ShmPointToPoint's liveness checks).
  const std::vector<int>& pids() const { return pids_; }

 private:
  struct Header;
  struct RankState;
  // What an operation does; also its tag in the chunk descriptor (two bits).
  enum class Kind : uint8_t { kAllReduce = 0, kBroadcast = 1, kReduceScatter = 2, kAllGather = 3 };
  struct Op {
    Kind kind = Kind::kAllReduce;
    at::Tensor input;   // the all-reduced or broadcast tensor, or a collective's input
    at::Tensor output;  // the same tensor for an all-reduce or broadcast
    c10::intrusive_ptr<c10::ivalue::Future> future;
  };

  ShmAllReduce(int rank, int world, const ShmAllReduceOptions& options, void* base, size_t size,
               std::vector<int> peer_pids);

  c10::intrusive_ptr<c10d::Work> Enqueue(Op op, c10d::OpType type);
  // Runs `op` on the calling thread once every operation issued before it is done.
  Status RunInline(const Op& op);
  void WorkerLoop();
  // Runs one operation; REQUIRES: busy_ was set by this thread.
  Status Execute(const Op& op);
  Status BroadcastChunk(char* data, size_t total_bytes, size_t offset, size_t bytes,
                        c10::ScalarType dtype);
  // Shard elements [first, first + n) of a reduce-scatter; `per` elements per piece of a slot.
  Status ReduceScatterChunk(const char* in, char* out, size_t shard, size_t first, size_t n,
                            size_t per, c10::ScalarType dtype);
  // Bytes [offset, offset + bytes) of each rank's all-gather input of `total_bytes`.
  Status AllGatherChunk(const char* in, char* out, size_t total_bytes, size_t offset, size_t bytes,
                        c10::ScalarType dtype);
  // Waits until the peers finished reading this rank's slot and descriptor (see the protocol).
  Status WaitSlotFree();
  // Publishes this rank's descriptor of the next chunk, arrives and checks that every rank
  // issued the same operation.
  Status AgreeOnChunk(Kind kind, size_t total_bytes, size_t offset, c10::ScalarType dtype);
  Status ExecuteChunk(char* data, size_t total_bytes, size_t offset, size_t bytes,
                      c10::ScalarType dtype);
  void Arrive(uint64_t phase);
  Status WaitAll(uint64_t phase);
  Status CheckPeersAlive(uint64_t phase);
  void Abort();

  // Where the input slots start: after the header and the rank states, page-aligned.
  static size_t DataOffset(int world);
  Header* header() const;
  RankState* state(int r) const;
  char* slot(int r) const;
  char* result() const;

  const int rank_;
  const int world_;
  const ShmAllReduceOptions options_;
  void* base_;
  size_t size_;
  std::vector<int> pids_;      // per rank (ours included)
  std::vector<int> pidfds_;    // per rank, -1 for ours or where pidfd_open is unavailable
  uint64_t phase_ = 0;         // phases this rank has passed; only the executing thread
  uint64_t slot_read_by_ = 0;  // every rank passing this phase frees our slot; executing thread
  Status failed_;              // the first error; only the executing thread

  Mutex mu_;
  CondVar cv_{&mu_};
  std::deque<Op> queue_ GUARDED_BY(mu_);
  bool busy_ GUARDED_BY(mu_) = false;  // an operation is executing (worker or AllReduceNow)
  bool stop_ GUARDED_BY(mu_) = false;
  std::atomic<bool> stopping_{false};  // read by a waiting operation
  std::thread worker_;
};

}  // namespace launch::trainer
