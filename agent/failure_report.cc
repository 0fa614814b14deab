#include "agent/failure_report.h"

#include <ctime>
#include <sstream>

#include "base/strings.h"

namespace launch::agent {

std::string FormatTime(std::chrono::system_clock::time_point t) {
  std::time_t secs = std::chrono::system_clock::to_time_t(t);
  auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count() % 1000;
  std::tm tm{};
  localtime_r(&secs, &tm);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", &tm);
  char out[80];
  std::snprintf(out, sizeof(out), "%s.%03d", buf, static_cast<int>(ms));
  return out;
}

std::string MissingModuleHint(const WorkerExit& exit, const std::string& python,
                              const std::string& python_choice) {
  if (python.empty() || exit.time - exit.started > std::chrono::minutes(1)) return "";
  // The message is the error file's when the script used @record, else a line of stderr.
  std::vector<std::string> lines = exit.stderr_tail;
  lines.push_back(exit.error_message);
  static const std::string kMarker = "ModuleNotFoundError: No module named ";
  for (const std::string& line : lines) {
    size_t at = line.find(kMarker);
    if (at == std::string::npos) continue;
    std::string module = Trim(line.substr(at + kMarker.size()));
    return "hint: the workers' Python is " + python + ", which cannot import " + module +
           ". If it is installed for another interpreter, choose that one with " + python_choice +
           ", or activate its virtualenv or conda environment before launch.";
  }
  return "";
}

std::string FormatFailureReport(const GroupResult& result, const ReportContext& ctx) {
  std::ostringstream o;
  std::string host = ctx.host.empty() ? "" : " on " + ctx.host;
  o << "================ launch: worker failure ================\n";
  if (result.failures.empty()) {
    o << "no worker failed\n";
    return o.str();
  }
  const WorkerExit& root = result.failures.front();
  o << "root cause: rank " << root.rank << " (local_rank " << root.local_rank << ", pid "
    << root.pid << host << ") " << root.status.ToString() << " at " << FormatTime(root.time)
    << "\n";
  // What a worker wrote goes to the terminal through SanitizeForTerminal: an error file's
  // "\u001b" is a real ESC once decoded.
  if (!root.error_message.empty()) {
    // What the program itself recorded (torch's @record): the exception and its traceback.
    std::vector<std::string> message = Split(SanitizeForTerminal(root.error_message), '\n');
    o << "  error: " << message[0] << "\n";
    for (size_t i = 1; i < message.size(); ++i) o << "         " << message[i] << "\n";
    if (!root.error_traceback.empty()) {
      o << "  traceback (from " << root.error_file << "):\n";
      for (const auto& line : Split(SanitizeForTerminal(root.error_traceback), '\n'))
        if (!line.empty()) o << "    " << line << "\n";
    }
  } else if (root.stderr_tail.empty()) {
    o << "  (no stderr output)\n";
  } else {
    o << "  last " << root.stderr_tail.size() << " line(s) of its stderr:\n";
    for (const auto& line : root.stderr_tail) o << "    " << line << "\n";
  }
  std::string hint = MissingModuleHint(root, ctx.python, ctx.python_choice);
  if (!hint.empty()) o << "  " << hint << "\n";
  if (result.failures.size() > 1) {
    o << "other failures:\n";
    for (size_t i = 1; i < result.failures.size(); ++i) {
      const WorkerExit& f = result.failures[i];
      o << "  rank " << f.rank << " (local_rank " << f.local_rank << ", pid " << f.pid << ") "
        << f.status.ToString() << " at " << FormatTime(f.time)
        << (f.stopped_by_agent ? " (after launch stopped the group)" : "") << "\n";
    }
  }
  o << "restarts used: " << ctx.restarts_used << " of " << ctx.max_restarts
    << (ctx.will_restart ? " -- restarting the group" : "") << "\n";
  o << "=========================================================\n";
  return o.str();
}

}  // namespace launch::agent
