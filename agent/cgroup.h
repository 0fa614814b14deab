#pragma once

// JobCgroup: a cgroup v2 holding every process of one `launch` job, where the kernel lets us
// make one, so that the whole job can be killed at once with cgroup.kill.
//
// The launch-exec shim (exec_shim.h) is a child subreaper: everything a worker starts, setsid'd
// daemons included, is re-parented to it and killed with it. That covers every exit path but
// those where the shim itself is killed by someone else (SIGKILL from a user, `pkill -9 launch`
// which matches `launch-exec` too, the OOM killer): its worker's descendants go to init. A
// cgroup has no such hole, and its kill is atomic (a process forking in a loop cannot outrun
// it). So, where possible, both:
//
//   * ForThisProcess() names <launch's own cgroup>/launch-<pid>-<pid namespace id> on the
//     cgroup2 mount (launches in two pid namespaces on one cgroup tree may share a pid); nothing
//     is made yet. CollectAbandoned() then removes what dead `launch` processes left beside it.
//   * Create(), when the first worker starts, makes it. It succeeds only where that cgroup is
//     writable (root, or a delegated subtree such as a systemd user service) and the kernel has
//     cgroup.kill (5.14+); otherwise it says why not and the job relies on the subreaper alone.
//     It also starts the job's reaper (launch-exec --reap, below), which kills and removes the
//     cgroup when `launch` dies, however it dies: a job cgroup never outlives its `launch`.
//   * Each shim, given the path in LAUNCH_JOB_CGROUP (exec_shim.h), makes a child cgroup
//     worker-<shim pid> for its worker, moves the worker into it before exec, kills it with
//     cgroup.kill when the worker's tree must go, and removes it (and the job's, when it is the
//     last and `launch` is gone) on the way out.
//   * KillWorker() is for a shim that could not do that (it was SIGKILLed): launch calls it when
//     it reaps a shim, before any next attempt starts.
//   * ~JobCgroup kills whatever is still in the job's cgroup and removes the cgroups.
//
// The reaper is launch-exec started as `cgroup-reaper --reap` in a session of its own (no
// terminal signal reaches it), with comm "cgroup-reaper": neither `pkill launch` nor
// `pkill -f launch` matches it, and its command line holds no path. It holds one end of a
// socket pair whose other end only `launch` has (close-on-exec, so no worker inherits it): when
// `launch` exits, the kernel closes it, the reaper reads EOF, kills the job's cgroup, waits for
// it to empty, removes it, and exits. Killing the reaper as well as `launch` (or `launch` in the
// instant between its mkdir and the reaper's start) is the one way left to strand a job cgroup;
// the next `launch` started beside it collects it (CollectAbandoned).
//
// launch itself, the shims and the reaper stay in launch's own cgroup. Not thread-safe; one per
// job.

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace launch::agent {

// How long a cgroup's processes get to die after cgroup.kill (the kill is asynchronous) before
// we give up on removing it: only a process stuck in the kernel (state D) takes longer.
inline constexpr std::chrono::milliseconds kCgroupEmptyTimeout{2000};

class JobCgroup {
 public:
  // Where this process's job cgroup goes. Nothing is made. Null, with `*why_not` saying why,
  // where no cgroup2 file system is mounted or this process is in no cgroup v2.
  static std::unique_ptr<JobCgroup> ForThisProcess(std::string* why_not);
  ~JobCgroup();  // when created: KillAll(), removes the cgroups, ends the reaper
  JobCgroup(const JobCgroup&) = delete;
  JobCgroup& operator=(const JobCgroup&) = delete;

  // Kills and removes the job cgroups beside ours that belong to no live `launch` (see
  // IsAbandoned in cgroup.cc): launch-<pid>-<ns> directories (launch-<pid>, from older
  // launches) owned by our effective user, made in our pid namespace, whose pid is gone, was
  // reused by another program, or is our own (we have not made ours yet). Returns the
  // paths it removed. REQUIRES: before Create().
  std::vector<std::string> CollectAbandoned();

  // Makes the cgroup, the first time; later calls return the first one's answer. With a
  // non-empty `exec_shim` (launch-exec's path) it also starts the reaper. False, with
  // `*why_not`, where it cannot be made.
  bool Create(const std::string& exec_shim, std::string* why_not);
  bool created() const { return created_; }

  const std::string& path() const { return path_; }
  // SIGKILLs every process in the job's cgroup (and its children cgroups) at once.
  void KillAll();
  // Kills what is left in the cgroup of the worker whose shim was `shim` (a shim that exited
  // normally has removed it: nothing to do), waits for it to empty and removes it. False when
  // processes are still there after kCgroupEmptyTimeout.
  bool KillWorker(pid_t shim);

 private:
  explicit JobCgroup(std::string path) : path_(std::move(path)) {}
  void StartReaper(const std::string& exec_shim);
  void EndReaper();  // closes our end of the lifeline and waits (bounded) for the reaper
  std::string path_;
  bool create_tried_ = false;
  bool created_ = false;
  std::string why_not_;  // why Create() failed
  pid_t reaper_ = -1;
  int lifeline_ = -1;  // our end of the reaper's socket pair
};

// Writes cgroup.kill of `dir` (every process in it and below it), waits until the kernel says
// it is empty (at most `timeout`) and removes it with the cgroups below it, deepest first. True
// when it is gone or was never there. Plain libc: launch-exec uses it too.
bool KillAndRemoveCgroup(const std::string& dir, std::chrono::milliseconds timeout);

// The environment variable that hands the job's cgroup to the shim (and to the reaper).
inline constexpr const char* kJobCgroupEnv = "LAUNCH_JOB_CGROUP";
// What launch-exec is told to be the reaper with: argv[0] and argv[1] (see above).
inline constexpr const char* kReaperName = "cgroup-reaper";
inline constexpr const char* kReaperFlag = "--reap";
// The descriptor the reaper gets its end of the socket pair on.
inline constexpr int kReaperLifelineFd = 3;
// The extended attribute that says which process made a job cgroup: "<pid namespace> <pid>
// <start time in clock ticks since boot>", e.g. "pid:[4026531836] 4242 1234567".
inline constexpr const char* kOwnerXattr = "user.launch.owner";

}  // namespace launch::agent
