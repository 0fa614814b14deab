#include "agent/agent.h"

#include <sys/stat.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <csignal>
#include <cstdio>
#include <optional>

#include "agent/failure_report.h"
#include "agent/output_writer.h"
#include "base/exit_code.h"
#include "base/files.h"
#include "base/log.h"
#include "base/strings.h"

namespace launch::agent {

namespace asio = boost::asio;

int ExitCodeFor(const GroupResult& result) {
  if (result.failures.empty()) return kExitFailure;
  const ExitStatus& s = result.failures.front().status;
  return ExitCodeForWorker(s.code, s.signaled ? s.signal : 0);
}

int RunLocalAgent(const AgentOptions& options) {
  asio::io_context io;
  return RunLocalAgent(options, io, [](asio::io_context& ctx) {
    return std::unique_ptr<GroupSupervisor>(new WorkerGroup(ctx));
  });
}

void AddAgentSignals(asio::signal_set& signals) {
  for (int signo : {SIGINT, SIGHUP}) {
    struct sigaction current {};
    if (::sigaction(signo, nullptr, &current) == 0 && current.sa_handler == SIG_IGN) continue;
    signals.add(signo);
  }
  signals.add(SIGTERM);
  signals.add(SIGQUIT);  // torchrun stops on it too
  signals.add(SIGUSR1);
  signals.add(SIGUSR2);
  signals.add(kCollectiveReportSignal);
}

int RunLocalAgent(const AgentOptions& options, asio::io_context& io,
                  const GroupFactory& make_group) {
  asio::signal_set signals(io);
  AddAgentSignals(signals);
  RouteLogThroughConsole();  // from the first line on: a stalled console never blocks the loop
  std::signal(SIGPIPE, SIG_IGN);

  int interrupt_signal = 0;
  std::unique_ptr<GroupSupervisor> group;
  std::function<void()> arm_signals = [&] {
    signals.async_wait([&](boost::system::error_code ec, int signo) {
      if (ec) return;
      if (signo == kCollectiveReportSignal) {
        if (group) group->ReportCollectives();
      } else if (signo == SIGUSR1 || signo == SIGUSR2) {
        log::Info("forwarding " + SignalName(signo) + " to the workers");
        if (group) group->Signal(signo);
      } else if (interrupt_signal != 0) {
        log::Info("second " + SignalName(signo) + ": killing the workers now");
        if (group) group->Kill();
      } else {
        interrupt_signal = signo;
        log::Info("received " + SignalName(signo) + ": stopping the workers (SIGKILL in " +
                  std::to_string(options.group.stop_grace.count() / 1000.0).substr(0, 4) + " s)");
        if (group) group->Stop(signo);
      }
      arm_signals();
    });
  };
  arm_signals();

  // Restarts spent: whole-group restarts and in-place replacements alike.
  int restarts_used = 0;
  // The newest replacement's LAUNCH_RECOVER_GENERATION: one count for the whole run, so that
  // the survivors of a group always wait for a newer one than they run.
  int generation = 0;
  for (int attempt = 0;; ++attempt) {
    WorkerGroupSpec spec = options.group;
    spec.restart_count = attempt;
    spec.max_restarts = options.max_restarts;
    if (options.recover_in_place) {
      spec.replace_in_place = [&](const WorkerExit& e, WorkerGroupSpec::ReplaceDecision decide) {
        if (interrupt_signal != 0 || restarts_used >= options.max_restarts) return decide(0);
        ++restarts_used;
        // The worker's own log says when its replacement redid the step (the recovery's cost).
        log::Info("rank " + std::to_string(e.rank) + " (pid " + std::to_string(e.pid) + ") " +
                  e.status.ToString() + ": starting a replacement for rank " +
                  std::to_string(e.rank) + " alone; the other workers keep running (restart " +
                  std::to_string(restarts_used) + " of " + std::to_string(options.max_restarts) +
                  ", in place)");
        decide(++generation);
      };
    }
    if (!options.log_root.empty()) {
      spec.log_dir = options.log_root + "/attempt_" + std::to_string(attempt);
      Status s = MakeDirs(spec.log_dir);
      if (!s.ok()) {
        log::Error(s.message());
        return 1;
      }
    }
    std::optional<GroupResult> result;
    group = make_group(io);
    Status started = group->Start(spec, [&](const GroupResult& r) { result = r; });
    if (!started.ok()) {
      log::Error(started.message());
      return 1;
    }
    if (interrupt_signal != 0) group->Stop(interrupt_signal);
    while (!result) {
      if (io.run_one() == 0) break;  // cannot happen while workers live; guards a stuck loop
    }
    group.reset();
    if (!result) {
      log::Error("lost track of the workers");
      return 1;
    }
    if (interrupt_signal != 0) {
      log::Info("workers stopped after " + SignalName(interrupt_signal));
      return ExitCodeForSignal(interrupt_signal);
    }
    if (result->outcome == GroupResult::Outcome::kSucceeded) return 0;
    bool will_restart = restarts_used < options.max_restarts;
    ReportContext ctx;
    ctx.restarts_used = restarts_used;
    ctx.max_restarts = options.max_restarts;
    ctx.will_restart = will_restart;
    ctx.python = options.python;
    ctx.python_choice = options.python_choice;
    std::string report = FormatFailureReport(*result, ctx);
    // Through the console's writer (never a blocking write on the loop), in order with the
    // workers' lines.
    if (std::optional<ConsoleSink> console = ConsoleWriterFor(STDERR_FILENO)) {
      console->writer->Write(console->sink, std::move(report));
    } else {
      std::fwrite(report.data(), 1, report.size(), stderr);
    }
    if (!will_restart) return ExitCodeFor(*result);
    ++restarts_used;
    log::Info("restart " + std::to_string(restarts_used) + " of " +
              std::to_string(options.max_restarts));
  }
}

}  // namespace launch::agent
