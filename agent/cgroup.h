#pragma once

// JobCgroup: a cgroup v2 holding every process of one `launch` job, where the kernel lets us
// make one, so that the whole job can be killed at once with cgroup.kill.
//
// The launch-exec shim (exec_shim.h) is a child subreaper: everything a worker starts, setsid'd
// daemons included, is re-parented to it and killed with it. That covers every exit path but
// one: a shim killed by someone else (SIGKILL from a user, the OOM killer) leaves its worker's
// descendants to init. A cgroup has no such hole, and its kill is atomic (a process forking in
// a loop cannot outrun it). So, where possible, both:
//
//   * Create() makes <launch's own cgroup>/launch-<pid> on the cgroup2 mount. It succeeds only
//     where that cgroup is writable (root, or a delegated subtree such as a systemd user
//     service) and the kernel has cgroup.kill (5.14+); otherwise it says why not and the job
//     relies on the subreaper alone.
//   * Each shim, given the path in LAUNCH_JOB_CGROUP (exec_shim.h), makes a child cgroup for its
//     worker, moves the worker into it before exec, kills it with cgroup.kill when the worker's
//     tree must go, and removes it (and the job's, when it is the last) on the way out; so even
//     when `launch` is SIGKILLed nothing is left behind.
//   * ~JobCgroup kills whatever is still in the job's cgroup (the leftovers of a shim that was
//     killed) and removes the cgroups.
//
// launch itself stays in its own cgroup. Not thread-safe; one per job.

#include <memory>
#include <string>

namespace launch::agent {

class JobCgroup {
 public:
  // The job's cgroup, or null with `*why_not` saying why none could be made.
  static std::unique_ptr<JobCgroup> Create(std::string* why_not);
  ~JobCgroup();  // KillAll(), then removes the worker cgroups and the job's
  JobCgroup(const JobCgroup&) = delete;
  JobCgroup& operator=(const JobCgroup&) = delete;

  const std::string& path() const { return path_; }
  // SIGKILLs every process in the job's cgroup (and its children cgroups) at once.
  void KillAll();

 private:
  explicit JobCgroup(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

// The environment variable that hands the job's cgroup to the shim.
inline constexpr const char* kJobCgroupEnv = "LAUNCH_JOB_CGROUP";

}  // namespace launch::agent
