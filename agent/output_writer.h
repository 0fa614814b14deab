#pragma once

// OutputWriter: a thread that owns blocking writes, so that the agent's event loop never makes
// one. That loop also runs the rendezvous heartbeats, the in-process rendezvous server (node 0),
// signal handling and worker monitoring; one write() to a console whose reader has stopped
// (`launch ... | less` left paused, Ctrl-S, a hung `tee`) or to a log file on a stalled file
// system would freeze all of them, and the node would be declared lost.
//
// A writer has one or more sinks (descriptors), each a FIFO of byte chunks. Its thread writes the
// chunks in order, each one whole, and it is the only writer of its sinks' files (see
// ConsoleWriterFor): a chunk made of whole lines is never torn by another producer's. The sinks of
// one writer stall together; the console and the per-rank log files have separate writers.
//
// Back-pressure, not unbounded memory: Write() always queues (the producer has already read the
// bytes) but reports the sink Full() from `high_water` queued bytes on. The producer then stops
// reading its source (the worker's pipe: the worker blocks in its own write, as under torchrun,
// whose workers write to inherited descriptors) and resumes when a waiter is called: after each
// write that leaves a sink at `low_water` or less. A sink's memory is so bounded by high_water
// plus what its producers queue per read after seeing it not Full. Offer() is for what may be
// lost (launch's own log lines): it drops from `drop_above` queued bytes on and counts, and the
// count is written to the sink ("... lines of launch's own output were dropped ...") once it is
// back at low_water.
//
// Errors: a sink whose write fails (EPIPE: the console was closed; ENOSPC; EIO) is broken: what
// it holds and every later chunk are discarded, it is never Full, and nothing else stops. The
// thread runs with every signal blocked (signals go to the agent's loop; a SIGPIPE stays pending
// on it instead of killing launch).
//
// Thread-safety: every method may be called from any thread. None blocks on I/O except Flush():
// they share a mutex that the writing thread never holds across a write.
// Lifecycle: the destructor discards what is queued and does not wait for a write in progress:
// the thread finishes it, closes the sinks it owns and exits on its own.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace launch::agent {

class OutputWriter {
 public:
  struct Limits {
    size_t high_water = size_t{1} << 20;   // Full() from this many queued bytes on
    size_t low_water = size_t{256} << 10;  // waiters are called when a write leaves this or less
    size_t drop_above = size_t{2} << 20;   // Offer() drops from this many queued bytes on
  };
  using Sink = int;

  // Starts the thread. Throws std::system_error when no thread can be created.
  OutputWriter();
  explicit OutputWriter(Limits limits);
  ~OutputWriter();
  OutputWriter(const OutputWriter&) = delete;
  OutputWriter& operator=(const OutputWriter&) = delete;

  // A new sink writing to `fd`; with `owns_fd` the writer closes it (after CloseSink, or when the
  // writer goes). A `terminal` sink erases a progress bar's rest before the line written over
  // it (EraseAfterRedraws, line_buffer.h): positions count the bytes as written.
  // REQUIRES: an `fd` not owned stays open while anything is queued for it, and after the
  // writer goes until the write in progress ends (the console's descriptors: always).
  Sink AddSink(int fd, bool owns_fd, bool terminal = false);
  // Queues `bytes` (never drops them unless the sink is broken or closed). Returns the sink's
  // position after them, to compare with Done().
  uint64_t Write(Sink sink, std::string bytes);
  // Queues `bytes` unless the sink holds drop_above bytes or more; false when dropped.
  bool Offer(Sink sink, std::string bytes);
  // Writes what the sink holds, then closes its descriptor when owned; later writes are
  // discarded.
  void CloseSink(Sink sink);

  bool Full(Sink sink) const;
  // Bytes of the sink written or discarded so far (its position).
  uint64_t Done(Sink sink) const;
  // Bytes queued in every sink, a write in progress included.
  size_t Backlog() const;

  // `fn` runs on the writer's thread after every write that leaves a sink at low_water or less,
  // and when a sink breaks. It must be quick, must not throw and must not call this writer
  // (post to an event loop instead). After RemoveWaiter returns, it is never called again.
  int AddWaiter(std::function<void()> fn);
  void RemoveWaiter(int id);

  // Blocks until nothing is queued or `deadline` passes; returns the bytes still queued.
  size_t Flush(std::chrono::steady_clock::time_point deadline);

 private:
  struct State;
  std::shared_ptr<State> state_;  // shared with the thread, which may outlive this object
};

// The writer of a console descriptor (launch's stdout or stderr, or what a test passes as
// WorkerGroupSpec::console_*_fd): one per open file (by fstat identity), so a stdout and a stderr
// that are the same pipe or terminal share one queue and one line order, across worker groups
// (restarts) and with launch's own lines. A terminal's (base/log.h AnsiTerminal) is a terminal
// sink. Created on first use, never destroyed. At exit
// (std::atexit) every console writer gets at most kExitFlushLimit in all to write what it holds;
// whatever is left is dropped, and counted on stderr when stderr itself is not what is stalled.
// nullopt for a descriptor that is not open. Does not own the descriptor.
struct ConsoleSink {
  OutputWriter* writer;
  OutputWriter::Sink sink;
};
std::optional<ConsoleSink> ConsoleWriterFor(int fd);
constexpr std::chrono::milliseconds kExitFlushLimit{2000};

// Routes launch's own lines (base/log.h) through stderr's console writer as Offer()s, so that a
// stalled console cannot block the loop on a log line either. Idempotent.
// REQUIRES: called on the thread that logs (log's sink is not thread-safe).
void RouteLogThroughConsole();

}  // namespace launch::agent
