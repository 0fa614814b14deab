"""Containment without holes, where a writable cgroup v2 with cgroup.kill exists: no job cgroup
outlives its launch, even when launch dies by SIGKILL with no worker running, or together with
its shims (`pkill -9 launch` matches `launch-exec` too); what a SIGKILLed shim's worker started
never runs beside the next attempt; and a launch collects the cgroups that dead launches left
beside it, never a live job's. Real processes; the process table and /sys/fs/cgroup judge."""

import os
import signal
import subprocess
import time
import unittest

import harness
from harness import (LAUNCH, SYSTEM_PYTHON, free_port, pids_with_marker, tmpdir, unique_marker,
                     wait_until)
from test_process_tree import cgroup_parent


def comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def children(pid):
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == pid:
            out.append(int(entry))
    return out


def kill_quietly(pid, sig=signal.SIGKILL):
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def kill_together(launch_pid, others):
    """SIGKILL of launch and `others` (its children) as if at one instant: none of them acts on
    another's death. launch is stopped first (it would kill a dead shim's worker cgroup); the
    shims die before launch does (once launch is gone they would kill their trees on their
    parent-death signal); none is stopped but launch (a stopped shim's process group is
    orphaned when launch dies, and the kernel sends it SIGCONT)."""
    os.kill(launch_pid, signal.SIGSTOP)
    for pid in others:
        os.kill(pid, signal.SIGKILL)
    os.kill(launch_pid, signal.SIGKILL)


def dead_pid():
    """A pid that no process has now (one just reaped)."""
    p = subprocess.Popen(["/bin/true"])
    p.wait()
    return p.pid


def remove_cgroup(path):
    """Kills what runs in `path` and below, and removes it (the tests' own, on any outcome)."""
    if not os.path.isdir(path):
        return
    try:
        with open(os.path.join(path, "cgroup.kill"), "w") as f:
            f.write("1")
    except OSError:
        pass
    def empty():
        with open(os.path.join(path, "cgroup.events")) as f:
            return "populated 0" in f.read()
    wait_until(lambda: not os.path.isdir(path) or empty(), 5)
    for root, dirs, _ in os.walk(path, topdown=False):
        for d in dirs:
            try:
                os.rmdir(os.path.join(root, d))
            except OSError:
                pass
    try:
        os.rmdir(path)
    except OSError:
        pass


class Containment(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.top = cgroup_parent()  # `launch env` takes seconds where Python has torch

    def setUp(self):
        if self.top is None:
            self.skipTest(harness.env_dependent(
                "no writable cgroup v2 with cgroup.kill here (`launch env`: process "
                "containment is subreaper only)"))
        self.marker = unique_marker("contain")
        self.env = dict(os.environ, LAUNCH_TEST_MARKER=self.marker)
        self.procs = []
        # The test's launches run in a cgroup of the test's own: what they collect and what they
        # leave is the test's alone, whatever other launches run on the machine meanwhile.
        # (Not named after the marker: the reaper's environment holds the path.)
        self.parent = os.path.join(self.top, f"test-{os.getpid()}-{time.monotonic_ns()}")
        os.mkdir(self.parent)
        self.addCleanup(remove_cgroup, self.parent)

    def enter_parent(self):
        with open(os.path.join(self.parent, "cgroup.procs"), "w") as f:
            f.write("0")

    def tearDown(self):
        for p in self.procs:
            kill_quietly(p.pid)
            try:
                p.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass
        for pid in pids_with_marker(self.marker):
            kill_quietly(pid)

    def run_launch(self, *args):
        return subprocess.run([LAUNCH, *args], capture_output=True, text=True, timeout=60,
                              env=self.env, preexec_fn=self.enter_parent)

    def job_cgroup(self, pid):
        return os.path.join(self.parent, harness.job_cgroup_name(pid))

    def start(self, *args):
        p = subprocess.Popen([LAUNCH, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=self.env, start_new_session=True,
                             preexec_fn=self.enter_parent)
        self.procs.append(p)
        return p

    def read_until(self, stream, needle, timeout=30):
        lines = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = stream.readline()
            if not line:
                break
            lines.append(line)
            if needle in line:
                return "".join(lines)
        self.fail(f"no {needle!r} within {timeout} s: {''.join(lines)}")

    def workers_left(self):
        """The job's processes below launch (marked through the environment), launch and its
        shims aside."""
        return [pid for pid in pids_with_marker(self.marker)
                if "launch" not in comm(pid)]

    def assert_no_worker_left(self):
        self.assertTrue(wait_until(lambda: self.workers_left() == [], 5, 0.05),
                        f"survivors: {[(pid, cmdline(pid)) for pid in self.workers_left()]}")

    def start_two_workers_with_children(self):
        """A running job of two workers, each a wrapper shell with a child (sleep 300), a
        setsid'd daemon (sleep 301) and its own sleep 302; returns launch and its cgroup."""
        p = self.start("--nproc_per_node", "2", "--", "/bin/sh", "-c",
                       "sleep 300 & (setsid sleep 301 &); echo ready; sleep 302")
        self.read_until(p.stdout, "ready")
        self.read_until(p.stdout, "ready")
        self.assertTrue(wait_until(lambda: len(self.workers_left()) >= 8, 10),
                        self.workers_left())
        path = self.job_cgroup(p.pid)
        self.assertTrue(os.path.isdir(path))
        return p, path

    def test_sigkill_while_waiting_in_the_rendezvous_leaves_no_cgroup(self):
        port = free_port()
        p = self.start("--nnodes", "2", "--node_rank", "0", "--main_process_ip", "127.0.0.1",
                       "--main_process_port", str(port), "--", "/bin/sleep", "5")
        self.read_until(p.stderr, "hosting the rendezvous")
        p.kill()
        p.wait(timeout=10)
        path = self.job_cgroup(p.pid)
        self.assertTrue(wait_until(lambda: not os.path.exists(path), 5), path)

    def test_sigkill_with_no_worker_running_after_one_ran_leaves_no_cgroup(self):
        # Node 0's worker is done; its launch waits for node 1 (no worker of its own runs).
        port = free_port()
        common = ["--nnodes", "2", "--main_process_ip", "127.0.0.1", "--main_process_port",
                  str(port), "--", "/bin/sh", "-c",
                  'if [ "$GROUP_RANK" = 1 ]; then sleep 60; fi; echo "worker done"']
        node0 = self.start("--node_rank", "0", *common)
        node1 = self.start("--node_rank", "1", *common)
        self.read_until(node0.stderr, "waiting for the other nodes")
        path = self.job_cgroup(node0.pid)
        self.assertTrue(os.path.isdir(path), "node 0 ran a worker in a job cgroup")
        node0.kill()
        node0.wait(timeout=10)
        self.assertTrue(wait_until(lambda: not os.path.exists(path), 5), path)
        node1.send_signal(signal.SIGTERM)
        node1.communicate(timeout=30)

    def test_sigkill_of_launch_and_its_shims_together_leaves_nothing(self):
        # What `pkill -9 launch` and `pkill -9 -f launch` do, limited to this job: launch and
        # each child of it whose name or command line says "launch", in one go.
        p, path = self.start_two_workers_with_children()
        matched = [pid for pid in children(p.pid)
                   if "launch" in comm(pid) or "launch" in cmdline(pid)]
        self.assertEqual(len(matched), 2, [(pid, comm(pid), cmdline(pid))
                                           for pid in children(p.pid)])
        kill_together(p.pid, matched)
        p.wait(timeout=10)
        self.assert_no_worker_left()
        self.assertTrue(wait_until(lambda: not os.path.exists(path), 5), path)

    def test_what_launch_its_shims_and_its_reaper_leave_the_next_launch_collects(self):
        p, path = self.start_two_workers_with_children()
        everyone = [p.pid, *children(p.pid)]  # the shims and the reaper
        self.assertEqual(sorted(comm(pid) for pid in everyone[1:]),
                         ["cgroup-reaper", "launch-exec", "launch-exec"])
        kill_together(p.pid, everyone[1:])
        p.wait(timeout=10)
        self.assertTrue(os.path.isdir(path))  # nobody was left to remove it
        self.assertTrue(self.workers_left())
        r = self.run_launch("--", "/bin/true")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(f"removed {path}, left by a launch that is gone", r.stderr)
        self.assertFalse(os.path.exists(path))
        self.assert_no_worker_left()

    def test_a_sigkilled_shims_children_do_not_run_beside_the_next_attempt(self):
        # Attempt 0's worker leaves a child and a setsid'd daemon; its shim is SIGKILLed. Attempt
        # 1's worker looks, as it starts, for any process of attempt 0.
        script = os.path.join(tmpdir(), "look.py")
        with open(script, "w") as f:
            f.write(f"""
import os
left = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        env = open(f"/proc/{{pid}}/environ", "rb").read().split(b"\\0")
        state = open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        continue
    if state != "Z" and b"LAUNCH_TEST_MARKER={self.marker}" in env and \\
            b"TORCHELASTIC_RESTART_COUNT=0" in env:
        left.append(open(f"/proc/{{pid}}/cmdline", "rb").read().replace(b"\\0", b" ").decode())
print("attempt 0 left:", left, flush=True)
""")
        p = self.start("--max_restarts", "1", "--", "/bin/sh", "-c",
                       'if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then '
                       "sleep 300 & (setsid sleep 301 &); echo ready; sleep 302; "
                       f"else {SYSTEM_PYTHON} {script}; fi")
        self.read_until(p.stdout, "ready")
        self.assertTrue(wait_until(lambda: len(self.workers_left()) >= 4, 10),
                        self.workers_left())
        shims = [pid for pid in children(p.pid) if comm(pid) == "launch-exec"]
        self.assertEqual(len(shims), 1, [(pid, comm(pid)) for pid in children(p.pid)])
        os.kill(shims[0], signal.SIGKILL)
        out, err = p.communicate(timeout=60)
        self.assertEqual(p.returncode, 0, err)
        self.assertIn("attempt 0 left: []", out, err)

    def make_cgroup(self, name, with_process=False, owner=None):
        """A job cgroup as a launch makes it, with a worker-1 below and, if asked, a sleeping
        process in that; `owner` is the marker attribute, if any."""
        path = os.path.join(self.parent, name)
        os.mkdir(path)
        os.mkdir(os.path.join(path, "worker-1"))
        if owner is not None:
            os.setxattr(path, "user.launch.owner", owner.encode())
        sleeper = None
        if with_process:
            sleeper = subprocess.Popen(["/bin/sleep", "300"], env=self.env)
            self.procs.append(sleeper)
            with open(os.path.join(path, "worker-1", "cgroup.procs"), "w") as f:
                f.write(str(sleeper.pid))
        return path, sleeper

    def pid_namespace(self):
        return os.readlink("/proc/self/ns/pid")

    def start_time(self, pid):
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]

    def test_cgroups_of_dead_launches_are_collected_and_live_jobs_kept(self):
        # A live job beside ours: it must survive the collection untouched.
        live = self.start("--", "/bin/sh", "-c", "echo ready; sleep 60")
        self.read_until(live.stdout, "ready")
        live_path = self.job_cgroup(live.pid)
        self.assertTrue(os.path.isdir(live_path))
        # Its wrapper shell and `sleep 60`.
        self.assertTrue(wait_until(lambda: len(self.workers_left()) == 2, 10),
                        self.workers_left())
        live_workers = self.workers_left()
        keeper = subprocess.Popen(["/bin/sleep", "300"], env=self.env)
        self.procs.append(keeper)
        ns = self.pid_namespace()
        # Left by dead launches: an older launch's (unmarked) with a process still in it; an
        # unmarked one whose pid is now another program's (this test's); a marked one whose
        # pid now belongs to a process that started later.
        unmarked, sleeper = self.make_cgroup(f"launch-{dead_pid()}", with_process=True)
        reused, _ = self.make_cgroup(f"launch-{os.getpid()}")
        marked_reused, _ = self.make_cgroup(f"launch-{sleeper.pid}",
                                            owner=f"{ns} {sleeper.pid} 1")
        # Kept: a marked one whose maker lives (the marker, not the program's name, says so);
        # one made in another pid namespace (not ours to judge); a name launch never makes.
        marked_live, _ = self.make_cgroup(f"launch-{keeper.pid}",
                                          owner=f"{ns} {keeper.pid} {self.start_time(keeper.pid)}")
        foreign, _ = self.make_cgroup(f"launch-{dead_pid()}", owner=f"pid:[1] 1 1")
        odd, _ = self.make_cgroup(f"launch-0{dead_pid()}")
        # Named by a launch of another pid namespace (a container, a test host) that has a
        # process in it: kept, even when its pid is ours or gone here. The same name in our
        # namespace, unmarked, is a dead launch's.
        other_ns = harness.job_cgroup_name(dead_pid()).rsplit("-", 1)[0] + "-1"
        foreign_named, foreign_sleeper = self.make_cgroup(other_ns, with_process=True)
        ours_dead, _ = self.make_cgroup(harness.job_cgroup_name(dead_pid()))
        r = self.run_launch("--", "/bin/true")
        self.assertEqual(r.returncode, 0, r.stderr)
        for path in (unmarked, reused, marked_reused, ours_dead):
            self.assertFalse(os.path.exists(path), r.stderr)
            self.assertIn(f"removed {path}, left by a launch that is gone", r.stderr)
        self.assertTrue(wait_until(lambda: sleeper.poll() is not None, 5))
        self.assertEqual(sleeper.returncode, -signal.SIGKILL)
        for path in (marked_live, foreign, odd, foreign_named, live_path):
            self.assertTrue(os.path.isdir(path), path)
        self.assertIsNone(foreign_sleeper.poll())
        self.assertIsNone(keeper.poll())
        self.assertEqual(sorted(self.workers_left()),
                         sorted(live_workers + [keeper.pid, foreign_sleeper.pid]))
        self.assertIsNone(live.poll())

    def test_launches_in_two_pid_namespaces_keep_each_others_job(self):
        # Two test hosts (pid namespaces) on this cgroup tree, as containers beside each other,
        # whose launches get the same pid. The second launch must neither take the first one's
        # job cgroup for a dead launch's (it once killed that job) nor share its name.
        import hosts as test_hosts
        hosts = test_hosts.make_hosts(self, 2)
        jobs = []
        for h in hosts:
            # The pid each host gives next is set, not left to how many processes each host
            # happened to start while it came up (make_hosts polls until the host answers).
            r = h.run(["/bin/sh", "-c", "echo 999 > /proc/sys/kernel/ns_last_pid"])
            self.assertEqual(r.returncode, 0, r.stderr)
            p = h.popen([LAUNCH, "--", "/bin/sh", "-c", "echo ready; sleep 60"],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env,
                        preexec_fn=self.enter_parent)
            self.procs.append(p)
            self.read_until(p.stdout, "ready")
            jobs.append(p)
        names = sorted(d for d in os.listdir(self.parent) if d.startswith("launch-"))
        pids = {n.split("-")[1] for n in names}
        self.assertEqual(len(names), 2, names)
        self.assertEqual(pids, {"1000"}, f"the launches' pids are not the one set ({names}): "
                         "the test no longer makes them collide")
        # A collection waits until what it killed is gone, before the collecting launch starts
        # its worker: both jobs' processes must still be there (the shim, the shell, sleep).
        for name in names:
            procs = []
            for root, _, files in os.walk(os.path.join(self.parent, name)):
                if "cgroup.procs" in files:
                    with open(os.path.join(root, "cgroup.procs")) as f:
                        procs += f.read().split()
            self.assertTrue(procs, f"{name} was emptied by the other launch")
        for h in hosts:
            h.stop()
        for p in jobs:
            p.communicate(timeout=30)


if __name__ == "__main__":
    unittest.main()
