#include "base/status.h"

#include <cstring>

namespace launch {

void CheckFailed(const char* file, int line, const char* condition, const std::string& message) {
  std::string what = std::string(file) + ":" + std::to_string(line) +
                     ": check failed: " + condition + (message.empty() ? "" : " (" + message + ")");
  throw CheckError(what);
}

Status Status::FromErrno(const std::string& what, int errno_value) {
  return IoError(what + ": " + std::strerror(errno_value));
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return rep_ ? rep_->message : kEmpty;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(CodeName(rep_->code)) + ": " + rep_->message;
}

Status Status::WithContext(const std::string& context) const {
  if (ok()) return *this;
  return Status(rep_->code, context + ": " + rep_->message);
}

const char* Status::CodeName(Code code) {
  switch (code) {
    case Code::kOk:
      return "OK";
    case Code::kInvalidConfig:
      return "InvalidConfig";
    case Code::kInvalidArgument:
      return "InvalidArgument";
    case Code::kNotFound:
      return "NotFound";
    case Code::kIoError:
      return "IoError";
    case Code::kTimeout:
      return "Timeout";
    case Code::kPeerLost:
      return "PeerLost";
    case Code::kProtocolError:
      return "ProtocolError";
    case Code::kAuthFailed:
      return "AuthFailed";
    case Code::kWorkerFailed:
      return "WorkerFailed";
    case Code::kInterrupted:
      return "Interrupted";
    case Code::kInternal:
      return "Internal";
  }
  return "Unknown";
}

}  // namespace launch
