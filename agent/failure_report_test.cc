// The failure report's hint for a Python worker that could not import a module.

#include "agent/failure_report.h"

#include <doctest/doctest.h>

namespace launch::agent {
namespace {

WorkerExit FailedAfter(std::chrono::seconds ran, std::vector<std::string> stderr_tail) {
  WorkerExit e;
  e.started = std::chrono::system_clock::now() - ran;
  e.time = std::chrono::system_clock::now();
  e.status = ExitStatus::FromWaitStatus(1 << 8);
  e.stderr_tail = std::move(stderr_tail);
  return e;
}

TEST_CASE("AMissingModuleAtStartNamesTheInterpreterAndHowToChooseAnother") {
  const std::string python = "/usr/local/bin/python3 (python3 on PATH)";
  WorkerExit early = FailedAfter(std::chrono::seconds(2),
                                 {"Traceback (most recent call last):", "    import torch",
                                  "ModuleNotFoundError: No module named 'torch'"});
  std::string hint = MissingModuleHint(early, python);
  CHECK(hint.find("the workers' Python is /usr/local/bin/python3 (python3 on PATH), which "
                  "cannot import 'torch'") != std::string::npos);
  CHECK(hint.find("--python PATH") != std::string::npos);

  GroupResult result;
  result.outcome = GroupResult::Outcome::kFailed;
  result.failures = {early};
  ReportContext ctx;
  ctx.python = python;
  CHECK(FormatFailureReport(result, ctx).find("  " + hint + "\n") != std::string::npos);
  ctx.python.clear();  // not a Python program: no hint
  CHECK(FormatFailureReport(result, ctx).find("hint:") == std::string::npos);

  // A --hostfile host's hint names what reaches it: the head's --python and the hosts'
  // .launch_env, never the head's PYTHON_EXEC alone.
  ctx.python = python;
  ctx.python_choice = kHostfilePythonChoice;
  const std::string remote = FormatFailureReport(result, ctx);
  CHECK(remote.find("--python PATH on the head's command line") != std::string::npos);
  CHECK(remote.find(".launch_env") != std::string::npos);

  // From @record's error file as well as from stderr.
  WorkerExit recorded = FailedAfter(std::chrono::seconds(1), {});
  recorded.error_message = "ModuleNotFoundError: No module named 'numpy'";
  CHECK(MissingModuleHint(recorded, python).find("cannot import 'numpy'") != std::string::npos);

  // An hour into training, or another error: something else went wrong.
  CHECK(MissingModuleHint(FailedAfter(std::chrono::hours(1), early.stderr_tail), python).empty());
  CHECK(MissingModuleHint(FailedAfter(std::chrono::seconds(1), {"ValueError: boom"}), python)
            .empty());
}

TEST_CASE("AnErrorFilesMessageCannotDriveTheTerminalAndKeepsItsLines") {
  GroupResult result;
  result.outcome = GroupResult::Outcome::kFailed;
  WorkerExit e = FailedAfter(std::chrono::seconds(1), {});
  e.error_message = "ValueError: bad\x1b[2J\nsecond line";
  result.failures = {e};
  const std::string report = FormatFailureReport(result, ReportContext{});
  CHECK(report.find('\x1b') == std::string::npos);
  CHECK(report.find("  error: ValueError: bad?[2J\n         second line\n") != std::string::npos);
}

}  // namespace
}  // namespace launch::agent
