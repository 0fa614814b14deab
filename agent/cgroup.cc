#include "agent/cgroup.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "base/files.h"
#include "base/strings.h"

namespace launch::agent {
namespace {

// Where the cgroup2 file system is mounted and which of its directories is its root, from
// /proc/self/mountinfo ("36 25 0:30 / /sys/fs/cgroup rw,... - cgroup2 cgroup2 rw,...").
bool FindCgroup2Mount(std::string* mount_point, std::string* mount_root) {
  for (const std::string& line : Split(ReadSmallFile("/proc/self/mountinfo", 4 << 20), '\n')) {
    size_t dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    std::vector<std::string> after = Split(line.substr(dash + 3), ' ');
    std::vector<std::string> before = Split(line.substr(0, dash), ' ');
    if (after.empty() || after[0] != "cgroup2" || before.size() < 5) continue;
    *mount_root = before[3];
    *mount_point = before[4];
    return true;
  }
  return false;
}

// This process's cgroup v2 path ("0::/user.slice/..."), relative to the hierarchy's root.
std::string OwnCgroupPath() {
  for (const std::string& line : Split(ReadSmallFile("/proc/self/cgroup"), '\n'))
    if (StartsWith(line, "0::")) return line.substr(3);
  return "";
}

// False once the kernel says the cgroup holds no process (or it is gone).
bool Populated(const std::string& dir) {
  for (const std::string& line : Split(ReadSmallFile(dir + "/cgroup.events"), '\n'))
    if (line == "populated 1") return true;
  return false;
}

}  // namespace

std::unique_ptr<JobCgroup> JobCgroup::Create(std::string* why_not) {
  std::string mount_point, mount_root;
  if (!FindCgroup2Mount(&mount_point, &mount_root)) {
    *why_not = "no cgroup2 file system is mounted";
    return nullptr;
  }
  std::string own = OwnCgroupPath();
  if (own.empty()) {
    *why_not = "this process is in no cgroup v2";
    return nullptr;
  }
  // Inside a cgroup namespace or a bind mount, the mount shows a subtree: strip its root.
  if (mount_root != "/" && StartsWith(own, mount_root)) own = own.substr(mount_root.size());
  std::string parent = mount_point + (own == "/" ? "" : own);
  std::string path = parent + "/launch-" + std::to_string(::getpid());
  if (::mkdir(path.c_str(), 0755) != 0) {
    *why_not = "cannot create " + path + ": " + std::strerror(errno);
    return nullptr;
  }
  if (::access((path + "/cgroup.kill").c_str(), W_OK) != 0 ||
      ::access((path + "/cgroup.procs").c_str(), W_OK) != 0) {
    *why_not = path + " has no writable cgroup.kill (Linux 5.14+)";
    ::rmdir(path.c_str());
    return nullptr;
  }
  return std::unique_ptr<JobCgroup>(new JobCgroup(path));
}

void JobCgroup::KillAll() { (void)WriteExistingFile(path_ + "/cgroup.kill", "1"); }

JobCgroup::~JobCgroup() {
  KillAll();
  // The kill is asynchronous: wait (bounded) until the kernel says the tree is empty, so the
  // directories can go.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (Populated(path_) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  if (DIR* dir = ::opendir(path_.c_str())) {
    while (dirent* e = ::readdir(dir)) {
      if (e->d_type == DT_DIR && e->d_name[0] != '.') ::rmdir((path_ + "/" + e->d_name).c_str());
    }
    ::closedir(dir);
  }
  ::rmdir(path_.c_str());
}

}  // namespace launch::agent
