#include "base/files.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "base/check.h"
#include "base/strings.h"

namespace launch {

std::string Basename(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string Dirname(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

Status MakeDirs(const std::string& path) {
  std::string cur;
  for (const std::string& part : Split(path, '/')) {
    cur += part;
    cur += '/';
    if (part.empty()) continue;
    if (::mkdir(cur.c_str(), 0755) == 0) continue;
    const int err = errno;
    struct stat st;
    if (err == EEXIST && ::stat(cur.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) continue;
    return Status::FromErrno("cannot create folder " + cur, err == EEXIST ? ENOTDIR : err);
  }
  return Status::Ok();
}

namespace {

// Writes all of `bytes` to `fd`, retrying short writes and EINTR: 0 or errno.
int WriteAll(int fd, std::string_view bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    done += static_cast<size_t>(n);
  }
  return 0;
}

}  // namespace

AtomicFileWriter::AtomicFileWriter(std::string path, WriteOptions options)
    : path_(std::move(path)), options_(options) {
  if (path_.empty()) {
    status_ = Status::InvalidArgument("no file name to write to");
    return;
  }
  const size_t slash = path_.rfind('/');
  dir_ = slash == std::string::npos ? "." : slash == 0 ? "/" : path_.substr(0, slash);
  status_ = MakeDirs(dir_);
  if (!status_.ok()) return;
  // The pid and a counter keep two writers (threads or processes) off one temp file.
  static std::atomic<unsigned> counter{0};
  tmp_ = path_ + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC,
               static_cast<mode_t>(options_.mode));
  if (fd_ < 0) {
    status_ = Status::FromErrno("cannot create " + tmp_, errno);
    tmp_.clear();  // not ours: nothing to remove
  }
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !tmp_.empty()) ::unlink(tmp_.c_str());
}

void AtomicFileWriter::Fail(Status status) {
  if (status_.ok()) status_ = std::move(status);
}

bool AtomicFileWriter::Append(std::string_view bytes) {
  if (!status_.ok()) return false;
  if (int err = WriteAll(fd_, bytes)) Fail(Status::FromErrno("cannot write " + tmp_, err));
  return status_.ok();
}

Status AtomicFileWriter::Commit() {
  LAUNCH_CHECK(!committed_);
  if (!status_.ok()) return status_;
  // The data must be on disk before the rename makes it visible, or a power cut could expose
  // an empty file under the final name.
  if (::fsync(fd_) != 0) Fail(Status::FromErrno("cannot write " + tmp_, errno));
  const int closed = ::close(fd_);
  fd_ = -1;
  if (closed != 0) Fail(Status::FromErrno("cannot write " + tmp_, errno));
  if (!status_.ok()) return status_;
  if (options_.exclusive) {
    if (::link(tmp_.c_str(), path_.c_str()) != 0) {
      Fail(Status::FromErrno("cannot create " + path_, errno));
      return status_;
    }
    ::unlink(tmp_.c_str());
  } else if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    Fail(Status::FromErrno("cannot rename " + tmp_ + " to " + path_, errno));
    return status_;
  }
  committed_ = true;
  // Make the new name durable; a failure here loses nothing already visible.
  int dfd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return Status::Ok();
}

Status WriteFileAtomically(const std::string& path, std::string_view bytes, WriteOptions options) {
  AtomicFileWriter file(path, options);
  file.Append(bytes);
  return file.Commit();
}

bool FileExists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

namespace {

// Reads `fd` to its end, or until more than `limit` bytes were read, and closes it. IoError
// naming `path` on a read error.
StatusOr<std::string> ReadAndClose(int fd, const std::string& path, size_t limit) {
  std::string text;
  char buf[65536];
  while (text.size() <= limit) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return Status::FromErrno("read error on '" + path + "'", err);
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return text;
}

}  // namespace

StatusOr<std::string> ReadFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::NotFound("cannot open '" + path + "': " + std::strerror(errno));
  return ReadAndClose(fd, path, std::numeric_limits<size_t>::max());
}

StatusOr<std::string> ReadRegularFile(const std::string& path, size_t max_bytes) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return Status::NotFound("cannot open '" + path + "': " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const bool dir = S_ISDIR(st.st_mode);
    ::close(fd);
    return Status::InvalidArgument("'" + path + "' is " +
                                   (dir ? "a directory" : "not a regular file") +
                                   ", not a file to read");
  }
  // Read up to one byte past the limit: a file that grows while it is read is caught too.
  StatusOr<std::string> text = ReadAndClose(fd, path, max_bytes);
  if (text.ok() && text->size() > max_bytes)
    return Status::InvalidArgument("'" + path + "' has more than the " + std::to_string(max_bytes) +
                                   " bytes it may have");
  return text;
}

std::string ReadSmallFile(const std::string& path, size_t limit) {
  // In pieces, growing with what is there: a buffer of `limit` bytes up front would cost its
  // whole size in resident memory (launch reads /proc/self/mountinfo with a 4 MiB limit at
  // every start).
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  std::string text;
  char buf[16384];
  while (text.size() < limit) {
    ssize_t n = ::read(fd, buf, std::min(sizeof(buf), limit - text.size()));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
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
