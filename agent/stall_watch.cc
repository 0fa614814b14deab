#include "agent/stall_watch.h"

#include <cxxabi.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>

#include "base/files.h"
#include "base/strings.h"

namespace launch::agent {

namespace asio = boost::asio;

namespace {

std::string Bytes(int64_t n) {
  char text[32];
  if (n < 1024)
    std::snprintf(text, sizeof text, "%lld B", static_cast<long long>(n));
  else if (n < (1 << 20))
    std::snprintf(text, sizeof text, "%.1f KiB", n / 1024.0);
  else
    std::snprintf(text, sizeof text, "%.2f MiB", n / 1048576.0);
  return text;
}

std::string Secs(uint64_t ns) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", ns / 1e9);
  return text;
}

std::string GroupName(const RingSnapshot& r, int group) {
  return group >= 0 && group < static_cast<int>(r.groups.size()) ? r.groups[group] : "?";
}

// "all-reduce #7 of group 'world' (4 B)".
std::string Describe(const RingSnapshot& r, const RingEntry& e) {
  return CollectiveOpName(e.op) + " #" + std::to_string(e.seq) + " of group '" +
         GroupName(r, e.group) + "' (" + Bytes(e.bytes) + ")";
}

bool Outstanding(const RingEntry& e) {
  return e.state == static_cast<uint32_t>(CollectiveState::kEnqueued) ||
         e.state == static_cast<uint32_t>(CollectiveState::kStarted);
}

const RingEntry* OldestOutstanding(const RingSnapshot& r) {
  for (const RingEntry& e : r.entries)
    if (Outstanding(e)) return &e;
  return nullptr;
}

std::string LastCompleted(const RingSnapshot& r, uint64_t now_ns) {
  const RingEntry* last = nullptr;
  for (const RingEntry& e : r.entries)
    if (!Outstanding(e) && e.done_ns != 0 && (!last || e.done_ns > last->done_ns)) last = &e;
  if (last)
    return Describe(r, *last) + ", " + Secs(now_ns > last->done_ns ? now_ns - last->done_ns : 0) +
           " ago";
  if (r.completed == 0) return "none";
  return "older than the ring's last " + std::to_string(kRingCapacity) + " operations";
}

std::string Who(const RankView& v) {
  std::string who = "rank " + std::to_string(v.rank);
  if (v.ring.ok()) who += " (pid " + std::to_string(v.ring->pid) + ")";
  return who;
}

int SeqOfGroup(const RingSnapshot& r, const std::string& group) {
  for (size_t g = 0; g < r.groups.size(); ++g)
    if (r.groups[g] == group) return static_cast<int>(g);
  return -1;
}

}  // namespace

RingAnalysis AnalyzeRings(const std::vector<RankView>& ranks, uint64_t now_ns,
                          uint64_t timeout_ns) {
  RingAnalysis a;
  uint64_t progress = 0;
  bool any_ring = false;
  // The collective the others wait in: in the group of the oldest operation still outstanding
  // anywhere, the outstanding one with the highest sequence number (the ranks furthest ahead
  // wait there; a rank stopped inside an earlier one has not entered it).
  const RankView* oldest_view = nullptr;
  const RingEntry* oldest = nullptr;
  for (const RankView& v : ranks) {
    if (!v.ring.ok()) continue;
    any_ring = true;
    progress = std::max({progress, v.ring->last_done_ns, v.ring->created_ns});
    if (const RingEntry* e = OldestOutstanding(*v.ring)) {
      a.waiting.push_back(v.rank);
      if (!oldest || e->enqueued_ns < oldest->enqueued_ns) {
        oldest = e;
        oldest_view = &v;
      }
    }
  }
  const RankView* target_view = oldest_view;
  const RingEntry* target = oldest;
  if (oldest) {
    const std::string group = GroupName(*oldest_view->ring, oldest->group);
    for (const RankView& v : ranks) {
      if (!v.ring.ok()) continue;
      for (const RingEntry& e : v.ring->entries)
        if (Outstanding(e) && GroupName(*v.ring, e.group) == group && e.seq > target->seq) {
          target = &e;
          target_view = &v;
        }
    }
  }
  if (!any_ring) {
    a.lines.push_back(
        "no rank of this node has a collective ring (not library workers, or not "
        "started yet)");
    return a;
  }
  const uint64_t idle_ns = now_ns > progress ? now_ns - progress : 0;
  a.idle_s = idle_ns / 1e9;
  // A stopped rank counts as a waiting one: on a node of its own (its peers wait on other
  // nodes) it is in no collective, yet it is what holds the job up.
  const bool any_stopped =
      std::any_of(ranks.begin(), ranks.end(), [](const RankView& v) { return v.stopped; });
  // A wait counts from its own start: a rank that enters its first collective while a peer
  // still starts up (imports torch on a loaded machine) has waited for nothing yet, however
  // long ago the rings were made.
  const uint64_t waited_ns =
      oldest && now_ns > oldest->enqueued_ns ? now_ns - oldest->enqueued_ns : 0;
  a.stalled = timeout_ns > 0 && idle_ns >= timeout_ns &&
              (any_stopped || (!a.waiting.empty() && waited_ns >= timeout_ns));

  // Desync: the same (group, sequence number) holds different operations on two ranks. Groups
  // are matched by name: ranks may register them in different orders.
  struct Seen {
    int rank;
    uint32_t op;
    int64_t bytes;
  };
  std::map<std::pair<std::string, uint64_t>, std::vector<Seen>> by_seq;
  for (const RankView& v : ranks) {
    if (!v.ring.ok()) continue;
    for (const RingEntry& e : v.ring->entries)
      by_seq[{GroupName(*v.ring, e.group), e.seq}].push_back({v.rank, e.op, e.bytes});
  }
  for (const auto& [key, seen] : by_seq) {
    bool differs = false;
    // All-to-all moves what each rank chooses (uneven splits): only its op must agree.
    const bool sized = seen[0].op != static_cast<uint32_t>(CollectiveOp::kAllToAll);
    for (const Seen& s : seen) differs |= s.op != seen[0].op || (sized && s.bytes != seen[0].bytes);
    if (!differs) continue;
    a.desync = true;
    std::string line =
        "desync in group '" + key.first + "' at #" + std::to_string(key.second) + ":";
    for (size_t i = 0; i < seen.size(); ++i)
      line += std::string(i ? "," : "") + " rank " + std::to_string(seen[i].rank) + " is in " +
              CollectiveOpName(seen[i].op) + " (" + Bytes(seen[i].bytes) + ")";
    a.lines.push_back(line + " - a rank skipped or added a collective");
    break;  // the first one explains the rest
  }

  std::string target_group, target_text;
  if (target) {
    target_group = GroupName(*target_view->ring, target->group);
    target_text = CollectiveOpName(target->op) + " #" + std::to_string(target->seq) +
                  " of group '" + target_group + "'";
  }
  for (const RankView& v : ranks) {
    if (!v.ring.ok()) {
      a.lines.push_back(
          Who(v) + ": " +
          (v.ring.status().code() == Status::Code::kNotFound
               ? "no collective ring (a program not on the library, or no process group yet)"
               : v.ring.status().message()));
      continue;
    }
    const RingSnapshot& r = *v.ring;
    const int g = target ? SeqOfGroup(r, target_group) : -1;
    const bool behind = g >= 0 && r.last_seq[g] < target->seq;
    if (behind) a.lagging.push_back(v.rank);
    if (const RingEntry* e = OldestOutstanding(r)) {
      a.lines.push_back(Who(v) + ": waits in " + Describe(r, *e) + " for " +
                        Secs(now_ns > e->enqueued_ns ? now_ns - e->enqueued_ns : 0) + " (" +
                        CollectiveStateName(e->state) + ")" +
                        (behind ? "; has not entered " + target_text : ""));
    } else if (behind) {
      a.lines.push_back(Who(v) + ": has not entered " + target_text +
                        "; its last completed collective: " + LastCompleted(r, now_ns));
    } else {
      a.lines.push_back(Who(v) + ": in no collective; its last completed collective: " +
                        LastCompleted(r, now_ns));
    }
  }
  std::set<int> blamed(a.lagging.begin(), a.lagging.end());
  for (const RankView& v : ranks)
    if (v.stopped) blamed.insert(v.rank);
  if (blamed.empty()) blamed.insert(a.waiting.begin(), a.waiting.end());
  a.blamed.assign(blamed.begin(), blamed.end());
  a.remote =
      target && a.lagging.empty() && !a.desync && !any_stopped && a.waiting.size() == ranks.size();
  if (a.remote)
    a.lines.push_back(
        "every rank of this node is inside a collective: the ranks it waits for run "
        "on other nodes (their agents report them)");
  return a;
}

std::string DescribeProcessState(pid_t pid) {
  const std::string stat = ReadSmallFile("/proc/" + std::to_string(pid) + "/stat", 4096);
  // "pid (comm) S ...": comm may hold spaces and parentheses; the state follows the last ')'.
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return "gone";
  const char state = stat[paren + 2];
  const std::string s = std::string("state ") + state;
  switch (state) {
    case 'T':
      return "stopped (" + s + ": SIGSTOP or SIGTSTP; it cannot run until SIGCONT)";
    case 't':
      return "stopped by a debugger (" + s + ")";
    case 'R':
      return "running (" + s + ")";
    case 'Z':
      return "exited, not yet reaped (" + s + ")";
    default: {
      const std::string wchan = Trim(ReadSmallFile("/proc/" + std::to_string(pid) + "/wchan", 256));
      return (state == 'D' ? "in uninterruptible sleep" : "sleeping") +
             (wchan.empty() || wchan == "0" ? std::string() : " in " + wchan) + " (" + s + ")";
    }
  }
}

bool IsStopped(pid_t pid) {
  const std::string stat = ReadSmallFile("/proc/" + std::to_string(pid) + "/stat", 4096);
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'T';
}

std::string StackCutShort(const std::vector<std::string>& frames) {
  if (frames.empty() || frames.back().find("(_start+") != std::string::npos) return "";
  if (static_cast<int>(frames.size()) >= kStackDumpFrames)
    return "  (its " + std::to_string(kStackDumpFrames) +
           " innermost frames; the stack goes deeper)\n";
  return "  (the stack ends here: no unwind information past this frame, as in hand-written "
         "assembly such as BLAS kernels)\n";
}

std::vector<std::string> ReadStackFile(const std::string& path) {
  const std::vector<std::string> lines = Split(ReadSmallFile(path, 1 << 16), '\n');
  if (std::find(lines.begin(), lines.end(), "end") == lines.end()) return {};
  std::vector<std::string> frames;
  for (const std::string& line : lines) {
    if (line.empty() || line == "end" || StartsWith(line, "pid ")) continue;
    // "binary(_ZN6launch4StepEv+0x1f) [0x...]": demangle the symbol between '(' and '+'.
    std::string out = line;
    const size_t open = line.find('(');
    const size_t plus = line.find('+', open == std::string::npos ? 0 : open);
    if (open != std::string::npos && plus != std::string::npos && plus > open + 1) {
      const std::string mangled = line.substr(open + 1, plus - open - 1);
      int status = 0;
      char* name = abi::__cxa_demangle(mangled.c_str(), nullptr, nullptr, &status);
      if (status == 0 && name) out = line.substr(0, open + 1) + name + line.substr(plus);
      std::free(name);
    }
    frames.push_back(SanitizeForTerminal(out));
  }
  return frames;
}

// ---------------------------------------------------------------------------------------------

struct StallWatch::Timers {
  explicit Timers(asio::io_context& io) : poll(io), stacks(io) {}
  asio::steady_timer poll;
  asio::steady_timer stacks;
};

StallWatch::StallWatch(asio::io_context& io, StallWatchOptions options, OnStall on_stall)
    : io_(io),
      options_(std::move(options)),
      on_stall_(std::move(on_stall)),
      timers_(std::make_unique<Timers>(io)) {
  RemoveFiles();  // a previous attempt's, should it have left any
}

StallWatch::~StallWatch() {
  Cancel();
  RemoveFiles();
}

std::string StallWatch::DefaultRingPrefix(const std::string& run_id) {
  std::string id = run_id;
  for (char& c : id)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != '-') c = '_';
  std::string dir = "/dev/shm";
  if (::access(dir.c_str(), W_OK) != 0) {
    const char* tmp = std::getenv("TMPDIR");
    dir = tmp && *tmp ? tmp : "/tmp";
  }
  return dir + "/launch-ring-" + id + "-" + std::to_string(::getpid()) + "-r";
}

std::string StallWatch::RingPath(int rank) const {
  return options_.ring_prefix + std::to_string(rank);
}

void StallWatch::RemoveFiles() {
  for (int rank : options_.ranks) {
    ::unlink(RingPath(rank).c_str());
    ::unlink(StackPathFor(RingPath(rank)).c_str());
    ::unlink(InPlacePathFor(RingPath(rank)).c_str());
  }
}

void StallWatch::Start() {
  if (options_.stall_timeout.count() <= 0) return;
  Arm();
}

void StallWatch::Cancel() {
  cancelled_ = true;
  timers_->poll.cancel();
  timers_->stacks.cancel();
}

void StallWatch::Arm() {
  const auto period =
      std::min<std::chrono::milliseconds>(std::chrono::seconds(1), options_.stall_timeout / 5);
  timers_->poll.expires_after(std::max(period, std::chrono::milliseconds(10)));
  std::weak_ptr<StallWatch> weak = weak_from_this();
  timers_->poll.async_wait([weak](boost::system::error_code ec) {
    if (ec) return;
    if (auto self = weak.lock()) self->Poll();
  });
}

std::vector<RankView> StallWatch::ReadAll() const {
  std::vector<RankView> views;
  for (int rank : options_.ranks) {
    StatusOr<RingSnapshot> ring = ReadCollectiveRing(RingPath(rank));
    const bool stopped = ring.ok() && IsStopped(ring->pid);
    views.push_back(RankView{rank, std::move(ring), stopped});
  }
  return views;
}

void StallWatch::Poll() {
  if (fired_ || cancelled_) return;
  std::vector<RankView> views = ReadAll();
  const uint64_t now = MonotonicNanos();
  RingAnalysis a = AnalyzeRings(views, now, options_.stall_timeout.count() * 1000000ull);
  // When the cause is on another node, that node's agent (which sees it stopped or lagging) gets
  // the first word: this one fails the job only if it has not after a grace.
  if (a.stalled && a.remote) {
    const auto grace =
        std::max<std::chrono::milliseconds>(std::chrono::seconds(3), options_.stall_timeout / 2);
    a.stalled = a.idle_s * 1000 >= (options_.stall_timeout + grace).count();
  }
  if (!a.stalled) {
    Arm();
    return;
  }
  fired_ = true;
  char head[200];
  std::snprintf(head, sizeof head,
                "no collective completed for %.1f s (--stall_timeout %.0f s) while %zu rank(s) "
                "of this node wait in one%s\n",
                a.idle_s, options_.stall_timeout.count() / 1000.0, a.waiting.size(),
                a.waiting.empty() ? " and a rank is stopped" : "");
  std::string body = "================ launch: stalled collective ================\n";
  body += head;
  for (const std::string& line : a.lines) body += line + "\n";
  std::weak_ptr<StallWatch> weak = weak_from_this();
  const std::vector<int> blamed = a.blamed;
  CollectStacks(views, blamed, /*resume=*/true, [weak, body, blamed](std::string stacks) {
    if (auto self = weak.lock())
      if (self->on_stall_) self->on_stall_(body + stacks, blamed);
  });
}

void StallWatch::Report(std::function<void(const std::string&)> done) {
  std::vector<RankView> views = ReadAll();
  const uint64_t now = MonotonicNanos();
  RingAnalysis a = AnalyzeRings(views, now, 0);
  std::string body = "================ launch: collective report (on demand) ================\n";
  char head[96];
  std::snprintf(head, sizeof head, "last collective completed %.1f s ago\n", a.idle_s);
  body += head;
  for (const std::string& line : a.lines) body += line + "\n";
  CollectStacks(views, options_.ranks, /*resume=*/false,
                [body, done = std::move(done)](std::string stacks) { done(body + stacks); });
}

struct StallWatch::Pending {
  struct Target {
    int rank;
    pid_t pid;
    std::string state;  // as seen before the signal
    std::string path;
  };
  std::vector<Target> targets;
  std::chrono::steady_clock::time_point deadline;
  std::function<void(std::string)> finish;
};

void StallWatch::CollectStacks(const std::vector<RankView>& views, const std::vector<int>& ranks,
                               bool resume, std::function<void(std::string)> finish) {
  auto pending = std::make_shared<Pending>();
  pending->finish = std::move(finish);
  pending->deadline = std::chrono::steady_clock::now() + options_.stack_wait;
  for (const RankView& v : views) {
    if (!v.ring.ok() || std::find(ranks.begin(), ranks.end(), v.rank) == ranks.end()) continue;
    Pending::Target t{v.rank, v.ring->pid, DescribeProcessState(v.ring->pid),
                      StackPathFor(RingPath(v.rank))};
    ::unlink(t.path.c_str());
    // The ring's pid is the worker's own (it wrote it), in this agent's pid namespace.
    if (t.state != "gone") {
      const bool stopped = IsStopped(t.pid);
      ::kill(t.pid, StackDumpSignal());
      // A stopped process runs no handler; once continued, the pending signal is handled
      // before anything else, so the stack is where it stopped.
      if (stopped && resume) ::kill(t.pid, SIGCONT);
    }
    pending->targets.push_back(std::move(t));
  }
  CheckStacks(pending);
}

void StallWatch::CheckStacks(const std::shared_ptr<Pending>& pending) {
  if (cancelled_) return;
  bool all = true;
  for (const auto& t : pending->targets)
    if (t.state != "gone" && ReadStackFile(t.path).empty()) all = false;
  if (!all && std::chrono::steady_clock::now() < pending->deadline) {
    timers_->stacks.expires_after(std::chrono::milliseconds(20));
    std::weak_ptr<StallWatch> weak = weak_from_this();
    timers_->stacks.async_wait([weak, pending](boost::system::error_code ec) {
      if (ec) return;
      if (auto self = weak.lock()) self->CheckStacks(pending);
    });
    return;
  }
  std::string text;
  for (const auto& t : pending->targets) {
    text += "rank " + std::to_string(t.rank) + " (pid " + std::to_string(t.pid) + ") is " + t.state;
    if (t.state == "gone" && options_.replacement) {
      if (const std::optional<Replacement> r = options_.replacement(t.rank))
        text += ": replaced in place (generation " + std::to_string(r->generation) +
                ", started as pid " + std::to_string(r->pid) +
                "), which records no collective until its group has formed: it is joining";
    }
    text += "\n";
    std::vector<std::string> frames = ReadStackFile(t.path);
    if (frames.empty()) {
      if (t.state != "gone")
        text += "  no stack: it did not answer " + SignalName(StackDumpSignal()) + " within " +
                std::to_string(options_.stack_wait.count()) + " ms\n";
      continue;
    }
    // A Python worker's file holds faulthandler's dump of every thread (agent/python_shim/).
    const bool python =
        StartsWith(frames[0], "Current thread 0x") || StartsWith(frames[0], "Thread 0x");
    text += python ? "  its Python threads' stacks (faulthandler, most recent call first):\n"
                   : "  its main thread's stack:\n";
    for (const std::string& f : frames) text += "    " + f + "\n";
    if (!python) text += StackCutShort(frames);
  }
  pending->finish(text);
}

}  // namespace launch::agent
