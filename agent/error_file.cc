#include "agent/error_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include <nlohmann/json.hpp>

namespace launch::agent {

namespace {

using nlohmann::json;

// A field's text: strings as they decode, other scalars as JSON writes them (a number
// "message" reads as "42"); nullopt for null, objects, arrays and absent fields.
std::optional<std::string> ScalarText(const json& object, const char* key) {
  if (!object.is_object()) return std::nullopt;
  const auto it = object.find(key);
  if (it == object.end()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_number() || it->is_boolean()) return it->dump();
  return std::nullopt;
}

}  // namespace

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
  // Python's json writes non-ASCII as \u escapes, surrogate pairs beyond the BMP (an emoji):
  // a JSON parser decodes them to UTF-8. The non-throwing parse: this runs on the agent's
  // thread, and a malformed file only means the report falls back to the stderr tail.
  const json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) return std::nullopt;
  const auto m = root.find("message");
  if (m == root.end()) return std::nullopt;
  WorkerError e;
  if (m->is_object()) {
    e.message = ScalarText(*m, "message").value_or("");
    const auto extra = m->find("extraInfo");
    if (extra != m->end()) e.traceback = ScalarText(*extra, "py_callstack").value_or("");
  } else {
    e.message = ScalarText(root, "message").value_or("");
  }
  if (e.message.empty() && e.traceback.empty()) return std::nullopt;
  return e;
}

}  // namespace launch::agent
