#include "base/exit_code.h"

#include <doctest/doctest.h>

#include <csignal>

namespace launch {
namespace {

TEST_CASE("ExitCodesFollowOnePolicy") {
  CHECK(ExitCodeFor(Status::Ok()) == 0);
  CHECK(ExitCodeFor(Status::InvalidConfig("x")) == 2);
  CHECK(ExitCodeFor(Status::NotFound("x")) == 2);
  CHECK(ExitCodeFor(Status::AuthFailed("x")) == 2);
  CHECK(ExitCodeFor(Status::Interrupted("x")) == 128 + SIGTERM);
  CHECK(ExitCodeFor(Status::Timeout("x"), Phase::kSetup) == 2);
  CHECK(ExitCodeFor(Status::Timeout("x"), Phase::kRun) == 1);
  CHECK(ExitCodeFor(Status::PeerLost("x")) == 1);
  CHECK(ExitCodeFor(Status::IoError("x")) == 1);
  CHECK(ExitCodeForWorker(3, 0) == 3);
  CHECK(ExitCodeForWorker(0, SIGKILL) == 128 + SIGKILL);
  CHECK(ExitCodeForWorker(0, 0) == 1);  // a failure never reads as success
  CHECK(ExitCodeForWorker(-1, 0) == 1);
}

}  // namespace
}  // namespace launch
