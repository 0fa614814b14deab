#pragma once

// Status and StatusOr<T>: the error currency at every module boundary.
//
// A Status is either OK or carries a Code (which drives what the caller does next: an
// InvalidConfig exits 2 before anything starts, a WorkerFailed may trigger a restart, ...)
// and a message written for a person ("train.yaml:12: unknown key 'nprocs'").
// Statuses are cheap to copy when OK (no allocation) and are [[nodiscard]].

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "base/check.h"

namespace launch {

class [[nodiscard]] Status {
 public:
  enum class Code {
    kOk = 0,
    kInvalidConfig,    // bad YAML, flag or environment value; nothing was started
    kInvalidArgument,  // bad argument to an API (a programming or input error)
    kNotFound,         // a file, key, program or device that does not exist
    kIoError,          // a system call on a file, pipe or socket failed
    kTimeout,          // a deadline passed
    kPeerLost,         // a remote agent or worker went away
    kProtocolError,    // a peer sent something malformed
    kAuthFailed,       // a peer could not prove the shared secret
    kWorkerFailed,     // a worker exited non-zero or died of a signal
    kInterrupted,      // we were asked to stop (signal)
    kInternal,         // anything else
  };

  Status() = default;
  static Status Ok() { return Status(); }
  static Status InvalidConfig(std::string m) { return Status(Code::kInvalidConfig, std::move(m)); }
  static Status InvalidArgument(std::string m) {
    return Status(Code::kInvalidArgument, std::move(m));
  }
  static Status NotFound(std::string m) { return Status(Code::kNotFound, std::move(m)); }
  static Status IoError(std::string m) { return Status(Code::kIoError, std::move(m)); }
  // IoError with ": strerror(errno_value)" appended.
  static Status FromErrno(const std::string& what, int errno_value);
  static Status Timeout(std::string m) { return Status(Code::kTimeout, std::move(m)); }
  static Status PeerLost(std::string m) { return Status(Code::kPeerLost, std::move(m)); }
  static Status ProtocolError(std::string m) { return Status(Code::kProtocolError, std::move(m)); }
  static Status AuthFailed(std::string m) { return Status(Code::kAuthFailed, std::move(m)); }
  static Status WorkerFailed(std::string m) { return Status(Code::kWorkerFailed, std::move(m)); }
  static Status Interrupted(std::string m) { return Status(Code::kInterrupted, std::move(m)); }
  static Status Internal(std::string m) { return Status(Code::kInternal, std::move(m)); }

  bool ok() const { return rep_ == nullptr; }
  Code code() const { return rep_ ? rep_->code : Code::kOk; }
  const std::string& message() const;
  // "InvalidConfig: message", or "OK".
  std::string ToString() const;
  // A copy with "context: " prefixed to the message; OK stays OK.
  Status WithContext(const std::string& context) const;

  static const char* CodeName(Code code);

 private:
  struct Rep {
    Code code;
    std::string message;
  };
  Status(Code code, std::string message)
      : rep_(std::make_shared<Rep>(Rep{code, std::move(message)})) {}
  std::shared_ptr<const Rep> rep_;
};

// Holds either a value or a non-OK Status.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    LAUNCH_CHECK(!status_.ok(), "StatusOr constructed from an OK Status without a value");
  }
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  // REQUIRES: ok()
  T& value() & {
    LAUNCH_CHECK(ok(), "value() on error: " + status_.ToString());
    return *value_;
  }
  const T& value() const& {
    LAUNCH_CHECK(ok(), "value() on error: " + status_.ToString());
    return *value_;
  }
  T&& value() && {
    LAUNCH_CHECK(ok(), "value() on error: " + status_.ToString());
    return std::move(*value_);
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace launch

// Returns early from the enclosing function when `expr` (a Status) is not OK.
#define LAUNCH_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::launch::Status _launch_status = (expr);        \
    if (!_launch_status.ok()) return _launch_status; \
  } while (0)

#define LAUNCH_CONCAT_INNER(a, b) a##b
#define LAUNCH_CONCAT(a, b) LAUNCH_CONCAT_INNER(a, b)
// LAUNCH_ASSIGN_OR_RETURN(auto x, MakeX()); returns the Status when MakeX() failed.
#define LAUNCH_ASSIGN_OR_RETURN(lhs, expr) \
  LAUNCH_ASSIGN_OR_RETURN_IMPL(LAUNCH_CONCAT(_launch_or_, __COUNTER__), lhs, expr)
#define LAUNCH_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()
