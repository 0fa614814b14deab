#include "agent/error_file.h"

#include <fcntl.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

namespace launch::agent {

std::optional<WorkerError> ReadErrorFile(const std::string& path) {
  constexpr size_t kMaxBytes = 1 << 20;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return std::nullopt;
  std::string text;
  char buf[65536];
  ssize_t n;
  while (text.size() <= kMaxBytes && (n = ::read(fd, buf, sizeof(buf))) != 0) {
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  if (text.empty() || text.size() > kMaxBytes) return std::nullopt;
  // JSON is YAML's flow style: yaml-cpp reads it, escapes included.
  try {
    YAML::Node root = YAML::Load(text);
    if (!root.IsMap()) return std::nullopt;
    YAML::Node m = root["message"];
    WorkerError e;
    if (m.IsScalar()) {
      e.message = m.Scalar();
    } else if (m.IsMap()) {
      if (m["message"].IsScalar()) e.message = m["message"].Scalar();
      YAML::Node extra = m["extraInfo"];
      if (extra.IsMap() && extra["py_callstack"].IsScalar())
        e.traceback = extra["py_callstack"].Scalar();
    }
    if (e.message.empty() && e.traceback.empty()) return std::nullopt;
    return e;
  } catch (const YAML::Exception&) {
    return std::nullopt;
  }
}

}  // namespace launch::agent
