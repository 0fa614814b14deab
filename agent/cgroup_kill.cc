// KillAndRemoveCgroup (cgroup.h): plain libc, so that launch-exec, which has no dependency,
// can share it with launch.

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "agent/cgroup.h"

namespace launch::agent {
namespace {

// False once the kernel says the cgroup and those below it hold no process (or it is gone).
bool Populated(const std::string& dir) {
  int fd = open((dir + "/cgroup.events").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[256];
  ssize_t n = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (n <= 0) return false;
  buf[n] = '\0';
  return std::strstr(buf, "populated 1") != nullptr;
}

// rmdir of `dir` after the cgroups below it, deepest first (a worker may have made its own).
void RemoveTree(const std::string& dir, int depth) {
  if (depth < 32) {
    if (DIR* d = opendir(dir.c_str())) {
      while (dirent* e = readdir(d)) {
        if (e->d_type == DT_DIR && std::strcmp(e->d_name, ".") != 0 &&
            std::strcmp(e->d_name, "..") != 0)
          RemoveTree(dir + "/" + e->d_name, depth + 1);
      }
      closedir(d);
    }
  }
  rmdir(dir.c_str());
}

}  // namespace

bool KillAndRemoveCgroup(const std::string& dir, std::chrono::milliseconds timeout) {
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) return true;  // gone already (the usual case)
  int fd = open((dir + "/cgroup.kill").c_str(), O_WRONLY | O_CLOEXEC);
  if (fd >= 0) {
    ssize_t n = write(fd, "1", 1);
    (void)n;  // a failure shows below: the cgroup stays populated
    close(fd);
  }
  // The kill is asynchronous: the cgroup can go once the kernel says it is empty.
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (Populated(dir) && std::chrono::steady_clock::now() < deadline) usleep(1000);
  RemoveTree(dir, 0);
  return stat(dir.c_str(), &st) != 0;
}

}  // namespace launch::agent
