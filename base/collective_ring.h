#pragma once

// The collective ring: each worker that uses the library records its collectives (op, per-group
// sequence number, bytes, group, state, timestamps) in a small fixed-size file under /dev/shm,
// which its agent reads to explain a hang (agent/stall_watch.h). The agent names the file
// (environment variable kCollectiveRingEnv, one file per global rank), removes it when the
// group ends, and asks for the worker's native stack with StackDumpSignal().
//
// A second writer keeps to the same layout: Python workers' shim (agent/python_shim/
// sitecustomize.py, through ctypes, with StackDumpSignal() answered by faulthandler), so a change
// here is a change there (tests/trainer/test_python_forensics.py reads its rings with
// ReadCollectiveRing).
//
// Layout (little-endian, this host only; every field a lock-free std::atomic of its width):
//   header  magic "LNCHRING", version, capacity (kRingCapacity), pid, rank, issued (operations
//           begun), completed, last_done_ns and created_ns (CLOCK_MONOTONIC), and kRingGroups
//           groups: a NUL-terminated name (written before group_count counts it) and the last
//           sequence number issued in it.
//   entries kRingCapacity slots; operation i (0-based issue order) lives in slot i % capacity.
//           A slot's `stamp` is 0 while its fields are written and i + 1 once they are (written
//           last, release): a reader that sees the same non-zero stamp before and after copying
//           the fields has an untorn entry (a seqlock whose writer is the issuing thread).
//           `state` and `done_ns` change later, from whichever thread completes the operation;
//           each is one atomic word, and a completion for a slot reused meanwhile is dropped.
//
// Cost on the hot path: no system call; two clock reads (vDSO) and a few atomic stores per
// operation.
//
// Thread-safety: CollectiveRing's methods may be called from any thread. Readers are other
// processes; they never block the writer.

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace launch {

inline constexpr const char* kCollectiveRingEnv = "LAUNCH_COLLECTIVE_RING";
inline constexpr uint32_t kRingCapacity = 64;
inline constexpr uint32_t kRingGroups = 8;
inline constexpr uint32_t kRingGroupName = 32;  // bytes, NUL included

enum class CollectiveOp : uint32_t {
  kAllReduce = 1,
  kBroadcast = 2,
  kAllGather = 3,
  kReduceScatter = 4,
  kBarrier = 5,
  // Recorded by Python workers (agent/python_shim/sitecustomize.py: torch.distributed's reduce,
  // gather, scatter, all_to_all); the library issues none of them.
  kReduce = 6,
  kGather = 7,
  kScatter = 8,
  kAllToAll = 9,  // its bytes may differ between ranks (uneven splits)
};
// "all-reduce", "broadcast", ...; "op N" for a value this build does not know.
std::string CollectiveOpName(uint32_t op);

enum class CollectiveState : uint32_t {
  kEnqueued = 1,  // issued; a transport thread will run it
  kStarted = 2,   // running on the issuing thread (an inline all-reduce)
  kDone = 3,
  kFailed = 4,  // completed with an error (a peer lost)
};
std::string CollectiveStateName(uint32_t state);

// CLOCK_MONOTONIC in nanoseconds: the ring's time base (the same for every process of a host).
uint64_t MonotonicNanos();

class CollectiveRing {
 public:
  // Creates (or truncates) the ring file `path` for global rank `rank`, mode 0600.
  // IoError naming the file.
  static StatusOr<std::unique_ptr<CollectiveRing>> Create(const std::string& path, int rank);
  // The ring named by $LAUNCH_COLLECTIVE_RING, created on the first call, with the stack-dump
  // handler installed (InstallStackDump at StackPathFor(path)); null when the variable is unset
  // or the file cannot be made (one warning on stderr: the job runs on without forensics).
  // `rank` is only read on the first call. Lives until the process exits.
  static CollectiveRing* ForProcess(int rank);

  ~CollectiveRing();
  CollectiveRing(const CollectiveRing&) = delete;
  CollectiveRing& operator=(const CollectiveRing&) = delete;

  // The index of group `name` (registered on first use), or -1 when the table is full: that
  // group's operations are then not recorded. Not for the hot path (a mutex).
  int Group(std::string_view name);

  // Records the start of an operation in `group` (a Group() index; < 0: nothing recorded) and
  // returns its token for Done (0: not recorded). `state` is kEnqueued or kStarted.
  uint64_t Begin(int group, CollectiveOp op, int64_t bytes,
                 CollectiveState state = CollectiveState::kEnqueued);
  // Marks the operation `token` completed (kDone, or kFailed when !ok). Token 0: nothing.
  void Done(uint64_t token, bool ok = true);

  const std::string& path() const { return path_; }

  struct Layout;  // the file's layout, defined in collective_ring.cc (readers use it too)

 private:
  CollectiveRing(std::string path, Layout* layout);
  std::string path_;
  Layout* layout_;
  struct GroupTable;
  std::unique_ptr<GroupTable> groups_;
};

// One operation as a reader saw it.
struct RingEntry {
  uint64_t index = 0;  // issue order in this process, 0-based
  uint32_t op = 0;     // CollectiveOp
  int group = -1;
  uint64_t seq = 0;  // 1-based, per group
  int64_t bytes = 0;
  uint32_t state = 0;  // CollectiveState
  uint64_t enqueued_ns = 0;
  uint64_t done_ns = 0;  // 0 until completed
};

struct RingSnapshot {
  pid_t pid = 0;
  int rank = -1;
  uint64_t issued = 0;
  uint64_t completed = 0;
  uint64_t last_done_ns = 0;  // 0: none completed yet
  uint64_t created_ns = 0;
  std::vector<std::string> groups;  // by index
  std::vector<uint64_t> last_seq;   // per group: the last sequence number issued
  std::vector<RingEntry> entries;   // the operations still in the ring, oldest first
};

// Reads the ring at `path`. NotFound when there is no file (the worker has not made it yet),
// IoError when it cannot be read, InvalidArgument naming the file when it is no ring of this
// version. Entries being rewritten while read are retried a few times, then left out.
StatusOr<RingSnapshot> ReadCollectiveRing(const std::string& path);

// The real-time signal that makes a process with InstallStackDump write its main thread's
// stack (SIGRTMIN + 6: glibc keeps the first ones for itself; nothing here uses this one).
int StackDumpSignal();
// Where a ring's worker writes its stack: `ring_path` + ".stack". (Inline: launch-exec, which
// links nothing, removes both files when launch is gone.)
inline std::string StackPathFor(const std::string& ring_path) { return ring_path + ".stack"; }
// Installs the StackDumpSignal() handler: it writes "pid N main thread:" then one frame per line
// (backtrace_symbols_fd: "binary(symbol+0x1f) [0x...]"), at most kStackDumpFrames of them, the
// innermost first, then a line "end", to `path` (truncated each time). A whole stack ends in the
// program's `_start`; the unwinder stops earlier at code without unwind information (hand-written
// assembly, such as BLAS kernels). A signal that lands on another thread is passed on to the main
// thread. Async-signal-safe apart from backtrace()'s first call, which this makes now.
void InstallStackDump(const std::string& path);
inline constexpr int kStackDumpFrames = 62;

// Beside a worker's ring: the file a worker creates once it can be recovered in place (launch
// --recover in_place): its process group has formed and its mode keeps no state on one rank
// alone (ddp; not ZeRO, pipelines, Local SGD). Without it the agent restarts every worker when
// a rank dies, instead of first spending a restart on a replacement the others cannot take in
// (they are still forming their group, or nothing could hand it its state). The agent removes it
// with the ring.
inline std::string InPlacePathFor(const std::string& ring_path) { return ring_path + ".in_place"; }
// Creates InPlacePathFor(this process's kCollectiveRingEnv). False when there is no ring path
// (not started by launch) or the file cannot be made.
bool DeclareInPlaceRecovery();

}  // namespace launch
