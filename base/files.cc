#include "base/files.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <sys/stat.h>

#include <cerrno>
#include <fstream>

#include "base/strings.h"

namespace launch {

Status MakeDirs(const std::string& path) {
  std::string cur;
  for (const std::string& part : Split(path, '/')) {
    cur += part;
    cur += '/';
    if (part.empty()) continue;
    if (::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST)
      return Status::FromErrno("cannot create folder " + cur, errno);
  }
  return Status::Ok();
}

std::string ReadSmallFile(const std::string& path, size_t limit) {
  std::ifstream in(path);
  if (!in) return "";
  std::string text(limit, '\0');
  in.read(&text[0], static_cast<std::streamsize>(limit));
  text.resize(static_cast<size_t>(in.gcount()));
  return text;
}

Status WriteExistingFile(const std::string& path, const std::string& text) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno("cannot open " + path, errno);
  ssize_t n = ::write(fd, text.data(), text.size());
  int err = errno;
  ::close(fd);
  if (n != static_cast<ssize_t>(text.size()))
    return Status::FromErrno("cannot write " + path, n < 0 ? err : EIO);
  return Status::Ok();
}

namespace {
rlimit StartLimit() {
  rlimit lim{};
  getrlimit(RLIMIT_NOFILE, &lim);
  return lim;
}
const rlimit kStartNofile = StartLimit();  // before main(): before anyone raises it
}  // namespace

void RaiseDescriptorLimit() {
  rlimit lim = kStartNofile;
  if (lim.rlim_cur >= lim.rlim_max) return;
  lim.rlim_cur = lim.rlim_max;
  setrlimit(RLIMIT_NOFILE, &lim);
}

unsigned long long OriginalDescriptorLimit() {
  return static_cast<unsigned long long>(kStartNofile.rlim_cur);
}

}  // namespace launch
