#include "base/collective_ring.h"

#include <doctest/doctest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "base/files.h"

namespace launch {
namespace {

std::string RingPath(const char* name) {
  return "/dev/shm/collective-ring-test-" + std::to_string(::getpid()) + "-" + name;
}

TEST_CASE("RingRecordsOperationsPerGroupAndTheirCompletion") {
  const std::string path = RingPath("basic");
  StatusOr<std::unique_ptr<CollectiveRing>> ring = CollectiveRing::Create(path, 3);
  REQUIRE(ring.ok());
  const int world = (*ring)->Group("world");
  const int stage = (*ring)->Group("stage1");
  CHECK((*ring)->Group("world") == world);
  const uint64_t a = (*ring)->Begin(world, CollectiveOp::kBroadcast, 8);
  (*ring)->Done(a);
  const uint64_t b = (*ring)->Begin(world, CollectiveOp::kAllReduce, 4096);
  const uint64_t c = (*ring)->Begin(stage, CollectiveOp::kAllGather, 16, CollectiveState::kStarted);
  (*ring)->Done(c, /*ok=*/false);

  StatusOr<RingSnapshot> snap = ReadCollectiveRing(path);
  REQUIRE(snap.ok());
  CHECK(snap->pid == ::getpid());
  CHECK(snap->rank == 3);
  CHECK(snap->issued == 3);
  CHECK(snap->completed == 2);
  CHECK(snap->last_done_ns >= snap->created_ns);
  REQUIRE(snap->groups == std::vector<std::string>{"world", "stage1"});
  CHECK(snap->last_seq == std::vector<uint64_t>{2, 1});
  REQUIRE(snap->entries.size() == 3);
  CHECK(snap->entries[0].op == static_cast<uint32_t>(CollectiveOp::kBroadcast));
  CHECK(snap->entries[0].seq == 1);
  CHECK(snap->entries[0].state == static_cast<uint32_t>(CollectiveState::kDone));
  CHECK(snap->entries[0].done_ns >= snap->entries[0].enqueued_ns);
  CHECK(snap->entries[1].seq == 2);
  CHECK(snap->entries[1].bytes == 4096);
  CHECK(snap->entries[1].state == static_cast<uint32_t>(CollectiveState::kEnqueued));
  CHECK(snap->entries[1].done_ns == 0);
  CHECK(snap->entries[2].group == stage);
  CHECK(snap->entries[2].seq == 1);
  CHECK(snap->entries[2].state == static_cast<uint32_t>(CollectiveState::kFailed));
  (void)b;
  ::unlink(path.c_str());
}

TEST_CASE("RingKeepsTheLastCapacityOperationsAndDropsStaleCompletions") {
  const std::string path = RingPath("wrap");
  StatusOr<std::unique_ptr<CollectiveRing>> ring = CollectiveRing::Create(path, 0);
  REQUIRE(ring.ok());
  const int g = (*ring)->Group("world");
  const uint64_t first = (*ring)->Begin(g, CollectiveOp::kAllReduce, 1);
  for (uint32_t i = 1; i < kRingCapacity + 10; ++i)
    (*ring)->Done((*ring)->Begin(g, CollectiveOp::kAllReduce, i));
  // The first operation's slot now holds a later one, already done: a late completion of the
  // first must not touch it.
  (*ring)->Done(first);
  StatusOr<RingSnapshot> snap = ReadCollectiveRing(path);
  REQUIRE(snap.ok());
  REQUIRE(snap->entries.size() == kRingCapacity);
  CHECK(snap->entries.front().seq == 11);
  CHECK(snap->entries.back().seq == kRingCapacity + 10);
  for (const RingEntry& e : snap->entries)
    CHECK(e.state == static_cast<uint32_t>(CollectiveState::kDone));
  ::unlink(path.c_str());
}

TEST_CASE("ReaderNeverSeesATornEntryWhileAnotherThreadWrites") {
  const std::string path = RingPath("torn");
  StatusOr<std::unique_ptr<CollectiveRing>> ring = CollectiveRing::Create(path, 0);
  REQUIRE(ring.ok());
  const int g = (*ring)->Group("world");
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    while (!stop.load()) {
      const uint64_t seq = (*ring)->Begin(g, CollectiveOp::kAllReduce, 0);
      (*ring)->Done(seq);
    }
  });
  int checked = 0;
  for (int i = 0; i < 2000; ++i) {
    StatusOr<RingSnapshot> snap = ReadCollectiveRing(path);
    REQUIRE(snap.ok());
    for (const RingEntry& e : snap->entries) {
      // Issue order and sequence number agree (one group): index i is sequence i + 1.
      if (e.seq != e.index + 1) FAIL("torn entry: index " << e.index << " seq " << e.seq);
      ++checked;
    }
  }
  stop = true;
  writer.join();
  CHECK(checked > 0);
  ::unlink(path.c_str());
}

TEST_CASE("ReadingAMissingOrForeignFileSaysSo") {
  CHECK(ReadCollectiveRing(RingPath("missing")).status().code() == Status::Code::kNotFound);
  const std::string path = RingPath("foreign");
  REQUIRE(WriteFileAtomically(path, std::string(1 << 16, 'x')).ok());
  CHECK(ReadCollectiveRing(path).status().code() == Status::Code::kNotFound);
  ::unlink(path.c_str());
}

TEST_CASE("StackDumpWritesTheMainThreadsFramesEvenWhenAnotherThreadTakesTheSignal") {
  const std::string path = RingPath("stack");
  InstallStackDump(path);
  // Sent to another thread: passed on to the main thread, which writes the file.
  std::thread other([] { ::pthread_kill(::pthread_self(), StackDumpSignal()); });
  other.join();
  std::string text;
  for (int i = 0; i < 1000 && text.find("end\n") == std::string::npos; ++i) {
    ::usleep(1000);  // the signal is handled at the main thread's next return to user space
    StatusOr<std::string> read = ReadFile(path);
    if (read.ok()) text = *read;
  }
  CHECK(text.rfind("pid " + std::to_string(::getpid()) + " main thread:\n", 0) == 0);
  CHECK(text.find("end\n") != std::string::npos);
  ::unlink(path.c_str());
  ::signal(StackDumpSignal(), SIG_DFL);
}

}  // namespace
}  // namespace launch
