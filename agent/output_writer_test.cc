// OutputWriter on real pipes: a pipe the test does not read is a console that stopped reading.

#include "agent/output_writer.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <atomic>

#include <doctest/doctest.h>

namespace launch::agent {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

struct Pipe {
  int r = -1, w = -1;
  Pipe() {
    int fds[2];
    REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
    r = fds[0];
    w = fds[1];
  }
  ~Pipe() {
    if (r >= 0) ::close(r);
    if (w >= 0) ::close(w);
  }
  // Reads until `n` bytes or EOF, for at most 10 s.
  std::string Read(size_t n) const {
    std::string out;
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    char buf[65536];
    while (out.size() < n && Clock::now() < deadline) {
      pollfd p{r, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      ssize_t got = ::read(r, buf, std::min(sizeof buf, n - out.size()));
      if (got <= 0) break;
      out.append(buf, static_cast<size_t>(got));
    }
    return out;
  }
};

OutputWriter::Limits Small() {
  OutputWriter::Limits limits;
  limits.high_water = 64 << 10;
  limits.low_water = 16 << 10;
  limits.drop_above = 128 << 10;
  return limits;
}

TEST_CASE("ChunksArriveWholeAndInOrder") {
  Pipe p;
  OutputWriter writer;
  OutputWriter::Sink sink = writer.AddSink(p.w, /*owns_fd=*/false);
  std::string expected;
  uint64_t end = 0;
  for (int i = 0; i < 5000; ++i) {
    std::string line = "line " + std::to_string(i) + "\n";
    expected += line;
    end = writer.Write(sink, line);
  }
  CHECK(p.Read(expected.size()) == expected);
  CHECK(writer.Flush(Clock::now() + milliseconds(5000)) == 0);
  CHECK(writer.Done(sink) == end);
  CHECK(end == expected.size());
}

TEST_CASE("FullAtHighWaterAndWaitersAreCalledBackAtLowWater") {
  Pipe p;
  OutputWriter writer(Small());
  OutputWriter::Sink sink = writer.AddSink(p.w, false);
  std::atomic<int> calls{0};
  writer.AddWaiter([&] { ++calls; });
  const std::string chunk(8 << 10, 'x');
  size_t written = 0;
  // The pipe takes 64 KiB, then the writer's thread blocks and chunks queue up.
  while (!writer.Full(sink)) {
    writer.Write(sink, chunk);
    written += chunk.size();
    REQUIRE(written < (4 << 20));
  }
  CHECK(writer.Backlog() >= Small().high_water);
  calls = 0;
  CHECK(p.Read(written) == std::string(written, 'x'));
  CHECK(writer.Flush(Clock::now() + milliseconds(5000)) == 0);
  CHECK_FALSE(writer.Full(sink));
  CHECK(calls > 0);
}

TEST_CASE("OfferDropsAboveItsLimitAndSaysHowManyOnceDrained") {
  Pipe p;
  OutputWriter writer(Small());
  OutputWriter::Sink sink = writer.AddSink(p.w, false);
  const std::string big(256 << 10, 'y');  // Write never drops: 64 KiB in the pipe, the rest held
  writer.Write(sink, big);
  CHECK_FALSE(writer.Offer(sink, "one\n"));
  CHECK_FALSE(writer.Offer(sink, "two\n"));
  CHECK(p.Read(big.size()) == big);
  const std::string notice =
      "[launch] warning: 2 lines of launch's own output were dropped while the console was not "
      "reading\n";
  CHECK(p.Read(notice.size()) == notice);
  CHECK(writer.Offer(sink, "three\n"));
  CHECK(p.Read(6) == "three\n");
}

TEST_CASE("AClosedReaderBreaksTheSinkWithoutKillingOrStoppingAnything") {
  Pipe p;
  ::close(p.r);  // every write now fails with EPIPE (and raises SIGPIPE, blocked in the writer)
  p.r = -1;
  OutputWriter writer(Small());
  OutputWriter::Sink sink = writer.AddSink(p.w, false);
  uint64_t end = 0;
  for (int i = 0; i < 64; ++i) end = writer.Write(sink, std::string(16 << 10, 'z'));
  CHECK(writer.Flush(Clock::now() + milliseconds(5000)) == 0);
  CHECK_FALSE(writer.Full(sink));
  CHECK(writer.Done(sink) == end);
}

TEST_CASE("FlushGivesUpAtItsDeadlineAndTheDestructorDoesNotWaitForAStalledWrite") {
  Pipe p;
  const auto t0 = Clock::now();
  {
    OutputWriter writer;
    // Owned: the thread outlives the writer and may still write to its descriptor.
    OutputWriter::Sink sink = writer.AddSink(::dup(p.w), /*owns_fd=*/true);
    writer.Write(sink, std::string(1 << 20, 'w'));
    CHECK(writer.Flush(Clock::now() + milliseconds(200)) > 0);
    CHECK(Clock::now() - t0 >= milliseconds(200));
  }  // its thread is still blocked in write(): the destructor leaves it to finish on its own
  CHECK(Clock::now() - t0 < milliseconds(2000));
  ::close(p.r);  // ends that write (EPIPE)
  p.r = -1;
}

TEST_CASE("CloseSinkClosesAnOwnedDescriptorAfterWritingWhatItHolds") {
  Pipe p;
  OutputWriter writer;
  OutputWriter::Sink sink = writer.AddSink(::dup(p.w), /*owns_fd=*/true);
  ::close(p.w);
  p.w = -1;
  writer.Write(sink, "last words\n");
  writer.CloseSink(sink);
  writer.Write(sink, "discarded\n");
  CHECK(p.Read(1 << 10) == "last words\n");  // then EOF: the writer closed the only write end
}

TEST_CASE("StdoutAndStderrOnOneFileShareOneConsoleWriter") {
  Pipe p;
  int other = ::dup(p.w);
  std::optional<ConsoleSink> a = ConsoleWriterFor(p.w);
  std::optional<ConsoleSink> b = ConsoleWriterFor(other);
  REQUIRE(a);
  REQUIRE(b);
  CHECK(a->writer == b->writer);
  CHECK(a->sink == b->sink);
  CHECK_FALSE(ConsoleWriterFor(-1));
  ::close(other);
}

}  // namespace
}  // namespace launch::agent
