#include "base/status.h"

#include <doctest/doctest.h>

namespace launch {
namespace {

StatusOr<int> Half(int x) {
  if (x % 2) return Status::InvalidArgument(std::to_string(x) + " is odd");
  return x / 2;
}

Status Quarter(int x, int* out) {
  LAUNCH_ASSIGN_OR_RETURN(int h, Half(x));
  LAUNCH_ASSIGN_OR_RETURN(*out, Half(h));
  return Status::Ok();
}

TEST_CASE("OkStatusHasNoMessage") {
  Status s;
  CHECK(s.ok());
  CHECK(s.ToString() == "OK");
  CHECK(s.WithContext("ctx").ok());
}

TEST_CASE("ErrorStatusCarriesCodeAndContext") {
  Status s = Status::Timeout("no reply").WithContext("rendezvous 10.0.0.1:29400");
  CHECK_FALSE(s.ok());
  CHECK(s.code() == Status::Code::kTimeout);
  CHECK(s.message() == "rendezvous 10.0.0.1:29400: no reply");
  CHECK(s.ToString() == "Timeout: rendezvous 10.0.0.1:29400: no reply");
}

TEST_CASE("AssignOrReturnPropagatesTheFirstError") {
  int out = 0;
  CHECK(Quarter(8, &out).ok());
  CHECK(out == 2);
  Status s = Quarter(6, &out);
  CHECK(s.code() == Status::Code::kInvalidArgument);
  CHECK(s.message() == "3 is odd");
}

TEST_CASE("ValueOnErrorIsACheckFailure") {
  StatusOr<int> v = Status::NotFound("x");
  CHECK_THROWS_AS(v.value(), CheckError);
}

}  // namespace
}  // namespace launch
