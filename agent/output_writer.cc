#include "agent/output_writer.h"

#include <poll.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <deque>
#include <map>
#include <string_view>
#include <thread>
#include <vector>

#include "agent/line_buffer.h"
#include "base/log.h"
#include "base/mutex.h"

namespace launch::agent {

namespace {

// Returns 0, or the errno that ended the write. Blocking is the point: only the writer's own
// thread calls this.
int WriteFully(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n >= 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN) {
      // A non-blocking descriptor inherited from our caller (its O_NONBLOCK is shared, so we
      // leave it set): wait for room as a blocking write would.
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, -1);
      continue;
    }
    return errno;
  }
  return 0;
}

}  // namespace

struct OutputWriter::State {
  struct SinkState {
    int fd = -1;
    bool owns_fd = false;
    std::deque<std::string> chunks;
    size_t queued = 0;  // bytes in `chunks` plus the chunk being written
    uint64_t end = 0;   // position after the last byte given to Write/Offer
    uint64_t done = 0;  // position written or discarded
    bool in_flight = false;
    bool broken = false;
    bool closing = false;  // CloseSink: close once empty
    bool closed = false;
    bool terminal = false;  // AddSink(..., terminal): EraseAfterRedraws
    bool after_cr = false;  // the last byte queued was a redraw's '\r'
    uint64_t dropped = 0;   // Offer()s dropped since the last notice
  };

  Limits limits;  // set before the thread starts, then read only
  mutable Mutex mu;
  CondVar work{&mu};  // chunks queued, a sink to close, or stop
  CondVar idle{&mu};  // a write finished (Flush)
  // A deque: references stay valid while sinks are added.
  std::deque<SinkState> sinks GUARDED_BY(mu);
  std::map<int, std::function<void()>> waiters GUARDED_BY(mu);
  int next_waiter GUARDED_BY(mu) = 0;
  size_t next_sink GUARDED_BY(mu) = 0;  // round robin among sinks with chunks
  bool stop GUARDED_BY(mu) = false;
  std::thread thread;

  size_t Backlog() const REQUIRES(mu) {
    size_t total = 0;
    for (const SinkState& k : sinks) total += k.queued;
    return total;
  }

  void Discard(SinkState& k) REQUIRES(mu) {
    for (const std::string& c : k.chunks) k.queued -= c.size();
    k.chunks.clear();
    k.done = k.end - k.queued;  // what remains queued is the chunk in flight, if any
  }

  // The next sink with work for the thread, or -1.
  int NextReady() REQUIRES(mu) {
    for (size_t n = 0; n < sinks.size(); ++n) {
      size_t i = (next_sink + n) % sinks.size();
      SinkState& k = sinks[i];
      if (!k.chunks.empty() || (k.closing && !k.closed)) {
        next_sink = i + 1;
        return static_cast<int>(i);
      }
    }
    return -1;
  }

  void Run() EXCLUDES(mu) {
    MutexLock lock(&mu);
    while (!stop) {
      int i = NextReady();
      if (i < 0) {
        idle.NotifyAll();
        work.Wait();
        continue;
      }
      SinkState& k = sinks[i];
      if (k.chunks.empty()) {  // closing, and everything it held is written
        k.closed = true;
        int fd = k.owns_fd ? k.fd : -1;
        lock.Unlock();
        if (fd >= 0) ::close(fd);  // may block (NFS flushes on close): not under the lock
        lock.Lock();
        continue;
      }
      std::string chunk = std::move(k.chunks.front());
      k.chunks.pop_front();
      k.in_flight = true;
      const int fd = k.fd;
      lock.Unlock();
      const int error = WriteFully(fd, chunk);
      lock.Lock();
      k.in_flight = false;
      k.queued -= chunk.size();
      k.done += chunk.size();
      if (error != 0 && !k.broken) {
        k.broken = true;
        Discard(k);
      }
      if (k.dropped > 0 && k.queued <= limits.low_water && !k.broken && !k.closing) {
        std::string notice = "[launch] warning: " + std::to_string(k.dropped) +
                             " lines of launch's own output were dropped while the console "
                             "was not reading\n";
        k.dropped = 0;
        k.queued += notice.size();
        k.end += notice.size();
        k.chunks.push_back(std::move(notice));
      }
      if (k.queued <= limits.low_water || k.broken)
        for (auto& [id, fn] : waiters) fn();
      idle.NotifyAll();
    }
    for (SinkState& k : sinks) {
      if (k.owns_fd && !k.closed) ::close(k.fd);
      k.closed = true;
    }
    idle.NotifyAll();
  }
};

OutputWriter::OutputWriter() : OutputWriter(Limits()) {}

OutputWriter::OutputWriter(Limits limits) : state_(std::make_shared<State>()) {
  state_->limits = limits;
  // The thread inherits a full signal mask: process signals are the agent loop's business, and
  // a SIGPIPE raised by its write stays pending instead of killing launch.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, &old);
  try {
    state_->thread = std::thread([state = state_] { state->Run(); });
  } catch (...) {
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    throw;
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

OutputWriter::~OutputWriter() {
  bool writing = false;
  {
    MutexLock lock(&state_->mu);
    state_->stop = true;
    state_->waiters.clear();
    for (State::SinkState& k : state_->sinks) {
      state_->Discard(k);
      writing = writing || k.in_flight;
    }
  }
  state_->work.NotifyAll();
  // A write in progress may never return (a reader that never reads again): the thread keeps
  // the state alive, ends that write, closes what it owns and exits on its own.
  if (writing) {
    state_->thread.detach();
  } else {
    state_->thread.join();
  }
}

OutputWriter::Sink OutputWriter::AddSink(int fd, bool owns_fd, bool terminal) {
  MutexLock lock(&state_->mu);
  State::SinkState& k = state_->sinks.emplace_back();
  k.fd = fd;
  k.owns_fd = owns_fd;
  k.terminal = terminal;
  return static_cast<Sink>(state_->sinks.size() - 1);
}

uint64_t OutputWriter::Write(Sink sink, std::string bytes) {
  MutexLock lock(&state_->mu);
  State::SinkState& k = state_->sinks.at(sink);
  if (k.terminal) bytes = EraseAfterRedraws(bytes, &k.after_cr);
  k.end += bytes.size();
  if (k.broken || k.closing || state_->stop || bytes.empty()) {
    k.done += bytes.size();
    return k.end;
  }
  k.queued += bytes.size();
  k.chunks.push_back(std::move(bytes));
  state_->work.NotifyOne();
  return k.end;
}

bool OutputWriter::Offer(Sink sink, std::string bytes) {
  {
    MutexLock lock(&state_->mu);
    State::SinkState& k = state_->sinks.at(sink);
    if (k.broken || k.closing) return false;
    if (k.queued >= state_->limits.drop_above) {
      ++k.dropped;
      return false;
    }
  }
  Write(sink, std::move(bytes));
  return true;
}

void OutputWriter::CloseSink(Sink sink) {
  MutexLock lock(&state_->mu);
  state_->sinks.at(sink).closing = true;
  state_->work.NotifyOne();
}

bool OutputWriter::Full(Sink sink) const {
  MutexLock lock(&state_->mu);
  const State::SinkState& k = state_->sinks.at(sink);
  return !k.broken && k.queued >= state_->limits.high_water;
}

uint64_t OutputWriter::Done(Sink sink) const {
  MutexLock lock(&state_->mu);
  return state_->sinks.at(sink).done;
}

size_t OutputWriter::Backlog() const {
  MutexLock lock(&state_->mu);
  return state_->Backlog();
}

int OutputWriter::AddWaiter(std::function<void()> fn) {
  MutexLock lock(&state_->mu);
  int id = state_->next_waiter++;
  state_->waiters.emplace(id, std::move(fn));
  return id;
}

void OutputWriter::RemoveWaiter(int id) {
  MutexLock lock(&state_->mu);
  state_->waiters.erase(id);
}

size_t OutputWriter::Flush(std::chrono::steady_clock::time_point deadline) {
  MutexLock lock(&state_->mu);
  // Called by WaitUntil with the mutex held.
  state_->idle.WaitUntil(
      deadline, [&]() NO_THREAD_SAFETY_ANALYSIS { return state_->Backlog() == 0 || state_->stop; });
  return state_->Backlog();
}

namespace {

struct ConsoleEntry {
  dev_t dev;
  ino_t ino;
  int fd;
  ConsoleSink console;
};

// Console writers live as long as the process (a worker group, a restart and a log line all
// outlive each other's use of them); their threads end with it.
struct ConsoleRegistry {
  Mutex mu;
  std::vector<ConsoleEntry> entries GUARDED_BY(mu);
};

ConsoleRegistry& Consoles() {
  static ConsoleRegistry* registry = new ConsoleRegistry;
  return *registry;
}

bool SameFile(int fd, dev_t dev, ino_t ino) {
  struct stat st;
  return ::fstat(fd, &st) == 0 && st.st_dev == dev && st.st_ino == ino;
}

void FlushConsolesAtExit() {
  std::vector<ConsoleSink> consoles;
  {
    MutexLock lock(&Consoles().mu);
    for (const ConsoleEntry& e : Consoles().entries) consoles.push_back(e.console);
  }
  const auto deadline = std::chrono::steady_clock::now() + kExitFlushLimit;
  size_t left = 0;
  for (const ConsoleSink& c : consoles) left += c.writer->Flush(deadline);
  if (left == 0) return;
  // Said on stderr only when stderr's own writer is idle: if it is the stalled one, nobody
  // would read this either, and a write from here could tear the line in progress.
  std::optional<ConsoleSink> err = ConsoleWriterFor(STDERR_FILENO);
  if (!err || err->writer->Backlog() != 0) return;
  // "Up to": a write in progress may have been partly taken.
  err->writer->Write(err->sink, "[launch] warning: dropped up to " + std::to_string(left) +
                                    " bytes of output at exit: the console did not read them "
                                    "within " +
                                    std::to_string(kExitFlushLimit.count() / 1000) + " s\n");
  err->writer->Flush(std::chrono::steady_clock::now() + std::chrono::milliseconds(200));
}

}  // namespace

std::optional<ConsoleSink> ConsoleWriterFor(int fd) {
  struct stat st;
  if (fd < 0 || ::fstat(fd, &st) != 0) return std::nullopt;
  ConsoleRegistry& registry = Consoles();
  MutexLock lock(&registry.mu);
  for (const ConsoleEntry& e : registry.entries) {
    // The descriptor it writes to must still be that file (a test may have closed it since).
    if (e.dev == st.st_dev && e.ino == st.st_ino && SameFile(e.fd, e.dev, e.ino)) return e.console;
  }
  if (registry.entries.empty()) std::atexit(FlushConsolesAtExit);
  auto* writer = new OutputWriter();  // never destroyed, see ConsoleRegistry
  ConsoleSink console{writer, writer->AddSink(fd, /*owns_fd=*/false, log::AnsiTerminal(fd))};
  registry.entries.push_back({st.st_dev, st.st_ino, fd, console});
  return console;
}

void RouteLogThroughConsole() {
  static bool routed = false;
  if (routed) return;
  std::optional<ConsoleSink> err = ConsoleWriterFor(STDERR_FILENO);
  if (!err) return;
  routed = true;
  log::SetSink(
      [console = *err](std::string line) { console.writer->Offer(console.sink, std::move(line)); });
}

}  // namespace launch::agent
