#pragma once

// The single-node agent: runs a WorkerGroup, restarts it as a whole after a failure while
// restarts remain, forwards signals, and turns the outcome into `launch`'s exit code.

#include <boost/asio/signal_set.hpp>
#include <csignal>
#include <functional>
#include <memory>
#include <string>

#include "agent/failure_report.h"
#include "agent/worker_group.h"

namespace launch::agent {

struct AgentOptions {
  WorkerGroupSpec group;  // the template for every attempt (restart_count is set per attempt)
  int max_restarts = 0;
  // launch --recover in_place: a worker that dies (ends by a signal) is replaced alone while
  // restarts remain (WorkerGroupSpec::replace_in_place); each replacement counts as a restart.
  bool recover_in_place = false;
  // Per-attempt log folders <log_root>/attempt_<k>/ are created when non-empty; the group's
  // log_dir is pointed at them.
  std::string log_root;
  // The workers' interpreter and what chose it, when they run Python (ReportContext::python),
  // and how a user chooses another, as it reaches these workers (ReportContext::python_choice).
  std::string python;
  std::string python_choice = kPythonChoice;
};

// Runs until the workers succeed (returns 0), fail with no restarts left (returns the root
// cause's exit code, 128+signal for a signal), or `launch` receives SIGINT/SIGTERM/SIGHUP
// (forwarded to the workers, then the grace/kill rule; returns 128+signal). SIGUSR1/SIGUSR2 are
// forwarded and change nothing else (schedulers send them before preemption so the trainer can
// checkpoint). A second SIGINT/SIGTERM kills the workers at once.
int RunLocalAgent(const AgentOptions& options);

// The same loop over any GroupSupervisor (tests pass a fake). `make_group` is called once per
// attempt; `io` must be the context the supervisors run on.
using GroupFactory = std::function<std::unique_ptr<GroupSupervisor>(boost::asio::io_context&)>;
int RunLocalAgent(const AgentOptions& options, boost::asio::io_context& io,
                  const GroupFactory& make_group);

// The signal that makes a running `launch` print the collective report of its workers
// (GroupSupervisor::ReportCollectives): SIGURG, which nothing sends a process by accident (the
// kernel sends it only to a socket's owner set with F_SETOWN, which launch never sets) and whose
// default action is to ignore it, so sending it to an older launch does no harm.
// SIGQUIT stops the job, as under torchrun; SIGUSR1/SIGUSR2 are the workers'.
inline constexpr int kCollectiveReportSignal = SIGURG;

// Adds the signals an agent handles to `signals`: SIGTERM, SIGQUIT, SIGUSR1, SIGUSR2,
// kCollectiveReportSignal, and
// SIGINT and SIGHUP unless they were ignored when `launch` started (`nohup launch ...`, or a
// background job of a non-interactive shell, asks for exactly that). Call before any worker
// exists, so no signal can slip between spawn and handling.
void AddAgentSignals(boost::asio::signal_set& signals);

// The exit code for a failed group: the root cause's (128+signal for a signal).
int ExitCodeFor(const GroupResult& result);

}  // namespace launch::agent
