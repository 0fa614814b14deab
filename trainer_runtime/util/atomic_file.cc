#include "trainer_runtime/util/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <sstream>

namespace launch::trainer {

Status MakeDirs(const std::string& path) {
  if (path.empty()) return Status::Ok();
  std::string partial;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    partial = path.substr(0, pos);
    if (partial.empty()) continue;
    if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST)
      return Status::FromErrno("mkdir " + partial, errno);
  }
  return Status::Ok();
}

Status WriteFileAtomically(const std::string& path, std::string_view contents) {
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
  LAUNCH_RETURN_IF_ERROR(MakeDirs(dir));
  // The pid in the name keeps two writers (which should never happen) from sharing a temp file.
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::FromErrno("open " + tmp, errno);
  size_t done = 0;
  while (done < contents.size()) {
    ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      Status s = Status::FromErrno("write " + tmp, errno);
      ::close(fd);
      ::unlink(tmp.c_str());
      return s;
    }
    done += static_cast<size_t>(n);
  }
  // Data must be on disk before the rename makes it visible, or a power cut could expose an
  // empty file under the final name.
  if (::fsync(fd) != 0) {
    Status s = Status::FromErrno("fsync " + tmp, errno);
    ::close(fd);
    ::unlink(tmp.c_str());
    return s;
  }
  if (::close(fd) != 0) return Status::FromErrno("close " + tmp, errno);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    Status s = Status::FromErrno("rename " + tmp + " -> " + path, errno);
    ::unlink(tmp.c_str());
    return s;
  }
  // Persist the directory entry too.
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return Status::Ok();
}

StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound("cannot open '" + path + "'");
  std::ostringstream out;
  out << in.rdbuf();
  if (in.bad()) return Status::IoError("read error on '" + path + "'");
  return out.str();
}

}  // namespace launch::trainer
