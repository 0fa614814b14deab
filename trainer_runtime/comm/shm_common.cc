#include "trainer_runtime/comm/shm_common.h"
#include "trainer_runtime/compat/torch_compat.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>

#include <ATen/core/ivalue.h>

namespace launch::trainer::shm {

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

int PidfdOpen(int pid) {
#ifdef SYS_pidfd_open
  // pidfds are close-on-exec by definition.
  return static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
#else
  (void)pid;
  errno = ENOSYS;
  return -1;
#endif
}

bool PidExited(int pid, int pidfd) {
  if (pidfd >= 0) {
    pollfd p{pidfd, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  const size_t paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size()) return false;
  const char state = line[paren + 2];
  return state == 'Z' || state == 'X';
}

int CreateSegment(const char* name, size_t bytes, void** base, std::string* error) {
  *base = MAP_FAILED;
  const int fd = ::memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    *error = std::string("memfd_create: ") + std::strerror(errno);
    return -1;
  }
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    *error = std::string("ftruncate: ") + std::strerror(errno);
  } else if (const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
             rc != 0 && rc != EOPNOTSUPP && rc != EINVAL) {
    // Allocate now: running out of memory here is an error the caller can handle; later it
    // would be a SIGBUS.
    *error = "allocating " + std::to_string(bytes) + " bytes: " + std::strerror(rc);
  } else if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    // A truncation would SIGBUS every process that maps it.
    *error = std::string("sealing: ") + std::strerror(errno);
  } else {
    *base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (*base != MAP_FAILED) return fd;
    *error = std::string("mmap: ") + std::strerror(errno);
  }
  ::close(fd);
  return -1;
}

void* OpenSegment(int pid, int fd, size_t bytes, std::string* error) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int mine = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (mine < 0) {
    *error = "could not open " + path + ": " + std::strerror(errno);
    return nullptr;
  }
  struct stat st {};
  void* base = nullptr;
  if (::fstat(mine, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    *error = path + " is not the segment (size)";
  } else {
    base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, mine, 0);
    if (base == MAP_FAILED) {
      *error = "could not map " + path + ": " + std::strerror(errno);
      base = nullptr;
    }
  }
  ::close(mine);
  return base;
}

std::string StoreGet(c10d::Store& store, const std::string& key) {
  const std::vector<uint8_t> v = store.get(key);
  return std::string(v.begin(), v.end());
}

void StoreSet(c10d::Store& store, const std::string& key, const std::string& value) {
  store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

c10::intrusive_ptr<c10::ivalue::Future> TensorListFuture() {
  return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
}

void Complete(c10::ivalue::Future& future, const Status& status, const at::Tensor& tensor) {
  if (status.ok()) {
    future.markCompleted(c10::IValue(std::vector<at::Tensor>{tensor}));
  } else {
    future.setError(compat::ErrorPtr(status.ToString()));
  }
}

}  // namespace launch::trainer::shm
