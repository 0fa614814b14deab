// Prints a collective ring as the agent reads it (base/collective_ring.h ReadCollectiveRing), one
// fact per line, for tests of rings other programs write (the Python shim's,
// agent/python_shim/sitecustomize.py). `--signal` prints StackDumpSignal() instead.
//
//   header pid P rank R issued I completed C last_done_ns T created_ns T
//   group INDEX NAME last_seq S
//   entry INDEX op NAME group G seq S bytes B state NAME enqueued_ns T done_ns T
//
// Exit 1 with the reader's error on stderr when the file is no ring.

#include <cstdio>
#include <cstring>

#include "base/collective_ring.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: collective-ring-dump RING_FILE | --signal\n");
    return 2;
  }
  if (std::strcmp(argv[1], "--signal") == 0) {
    std::printf("%d\n", launch::StackDumpSignal());
    return 0;
  }
  launch::StatusOr<launch::RingSnapshot> ring = launch::ReadCollectiveRing(argv[1]);
  if (!ring.ok()) {
    std::fprintf(stderr, "%s\n", ring.status().message().c_str());
    return 1;
  }
  std::printf(
      "header pid %d rank %d issued %llu completed %llu last_done_ns %llu created_ns %llu\n",
      static_cast<int>(ring->pid), ring->rank, static_cast<unsigned long long>(ring->issued),
      static_cast<unsigned long long>(ring->completed),
      static_cast<unsigned long long>(ring->last_done_ns),
      static_cast<unsigned long long>(ring->created_ns));
  for (size_t g = 0; g < ring->groups.size(); ++g)
    std::printf("group %zu %s last_seq %llu\n", g, ring->groups[g].c_str(),
                static_cast<unsigned long long>(ring->last_seq[g]));
  for (const launch::RingEntry& e : ring->entries)
    std::printf(
        "entry %llu op %s group %d seq %llu bytes %lld state %s enqueued_ns %llu done_ns %llu\n",
        static_cast<unsigned long long>(e.index), launch::CollectiveOpName(e.op).c_str(), e.group,
        static_cast<unsigned long long>(e.seq), static_cast<long long>(e.bytes),
        launch::CollectiveStateName(e.state).c_str(),
        static_cast<unsigned long long>(e.enqueued_ns), static_cast<unsigned long long>(e.done_ns));
  return 0;
}
