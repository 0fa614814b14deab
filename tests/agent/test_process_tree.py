"""No process a job starts outlives it, and workers hold only the descriptors they should: workers
that are wrapper shells, fork children, leave setsid'd daemons behind and read stdin, under
SIGKILL and SIGTERM of launch, a worker failure, success, SIGUSR1 and an inherited SIGCHLD=SIG_IGN.
Real processes; the process table is the judge."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import unittest

import harness
from harness import LAUNCH, SYSTEM_PYTHON, pids_with_marker, tmpdir, unique_marker, wait_until

# The worker: a wrapper shell (it stays: `sh -c 'python3 ...; echo after'`) running a Python
# program that forks two children in its process group (DataLoader workers), leaves a daemon in
# a session of its own (double fork + setsid), handles SIGUSR1, and does what MODE says.
TREE = r'''
import os, signal, subprocess, sys, time
mode = sys.argv[1]
rank = os.environ["RANK"]
for _ in range(2):
    if os.fork() == 0:
        time.sleep(120); os._exit(0)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(120); os._exit(0)
    os._exit(0)
def on_usr1(*_):
    print("usr1 handled by rank", rank, flush=True)
    sys.exit(0)
signal.signal(signal.SIGUSR1, on_usr1)
print("ready", rank, flush=True)
if mode == "fail" and rank == "1":
    time.sleep(0.3); sys.exit(3)
if mode == "succeed":
    time.sleep(0.3); sys.exit(0)
time.sleep(120)
'''


def descendants_alive(marker):
    return pids_with_marker(marker)


class ProcessTree(unittest.TestCase):
    def setUp(self):
        d = tmpdir()
        self.script = os.path.join(d, "tree.py")
        with open(self.script, "w") as f:
            f.write(TREE)
        self.marker = unique_marker("tree")

    def tearDown(self):
        for pid in pids_with_marker(self.marker):  # never leave the test's own mess behind
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def start(self, mode, preexec=None, extra=()):
        env = dict(os.environ, LAUNCH_TEST_MARKER=self.marker)
        cmd = [LAUNCH, "--nproc_per_node", "2", "--stop_grace", "2", *extra, "--", "/bin/sh",
               "-c", f'{SYSTEM_PYTHON} {self.script} {mode}; s=$?; echo "wrapper after $s"; exit $s']
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, start_new_session=True, preexec_fn=preexec)

    def wait_ready(self, p):
        seen = 0
        lines = []
        deadline = time.monotonic() + 30
        while seen < 2 and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            seen += "ready" in line
        self.assertEqual(seen, 2, "".join(lines))
        # Every worker has its wrapper, python, two children and one daemon (5 processes).
        self.assertTrue(wait_until(lambda: len(descendants_alive(self.marker)) >= 10, 10),
                        descendants_alive(self.marker))

    def assert_nothing_left(self, within=3.0):
        gone = wait_until(lambda: descendants_alive(self.marker) == [], within, 0.05)
        self.assertTrue(gone, f"survivors: {descendants_alive(self.marker)}")

    def test_sigkill_of_launch(self):
        p = self.start("wait")
        self.wait_ready(p)
        p.kill()
        p.wait(timeout=10)
        self.assert_nothing_left()

    def test_sigterm_of_launch(self):
        p = self.start("wait")
        self.wait_ready(p)
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
        self.assertEqual(p.returncode, 128 + signal.SIGTERM)
        self.assert_nothing_left(1.0)

    def test_worker_failure(self):
        p = self.start("fail")
        self.wait_ready(p)
        out, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 3, err)
        self.assertIn("root cause: rank 1", err)
        self.assert_nothing_left(1.0)

    def test_success_leaves_no_daemon(self):
        p = self.start("succeed")
        self.wait_ready(p)
        out, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 0, err)
        self.assertEqual(out.count("wrapper after 0"), 2, out)
        self.assert_nothing_left(1.0)

    def test_sigusr1_reaches_the_program_not_the_wrapper(self):
        # Neither the wrapper shell nor the forked children handle SIGUSR1 (its default action
        # kills); the Python program does: it alone gets it, checkpoints (here: exits 0), and
        # the wrapper reports its status.
        p = self.start("wait")
        self.wait_ready(p)
        p.send_signal(signal.SIGUSR1)
        out, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 0, err)
        self.assertEqual(out.count("usr1 handled by rank"), 2, out)
        self.assertEqual(out.count("wrapper after 0"), 2, out)
        self.assert_nothing_left(1.0)

    def test_sigusr1_without_any_handler_is_not_delivered(self):
        env = dict(os.environ, LAUNCH_TEST_MARKER=self.marker)
        p = subprocess.Popen([LAUNCH, "--", "/bin/sh", "-c", "echo ready 0; echo ready 1; sleep 2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)
        self.assertIn("ready", p.stdout.readline())
        time.sleep(0.3)
        p.send_signal(signal.SIGUSR1)
        out, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 0, err)
        self.assertIn("SIGUSR1 not delivered: no process of this worker handles it", err)

    def test_sigusr1_to_a_python_worker_is_handled(self):
        env = dict(os.environ, LAUNCH_TEST_MARKER=self.marker)
        p = subprocess.Popen([LAUNCH, "--nproc_per_node", "2", "--python", SYSTEM_PYTHON,
                              self.script, "wait"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        self.wait_ready(p)
        p.send_signal(signal.SIGUSR1)
        out, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 0, err)
        self.assertEqual(out.count("usr1 handled by rank"), 2, out)
        self.assert_nothing_left(1.0)

    def test_inherited_sigchld_ignored_does_not_hide_a_failure(self):
        p = self.start("fail", preexec=lambda: signal.signal(signal.SIGCHLD, signal.SIG_IGN))
        self.wait_ready(p)
        out, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 3, err)
        self.assert_nothing_left(1.0)

    def test_sighup_ignored_at_start_stays_ignored_as_nohup_asks(self):
        # `nohup launch ...`: a hang-up must not stop the job (and SIGTERM still does).
        def nohup():
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
        env = dict(os.environ, LAUNCH_TEST_MARKER=self.marker)
        p = subprocess.Popen([LAUNCH, "--", "/bin/sh", "-c", "echo ready; sleep 1.5; echo finished"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True, preexec_fn=nohup)
        self.assertIn("ready", p.stdout.readline())
        p.send_signal(signal.SIGHUP)
        out, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 0, err)
        self.assertIn("finished", out)
        self.assertNotIn("SIGHUP", err)

    def test_sighup_stops_the_job_when_not_ignored(self):
        p = self.start("wait")
        self.wait_ready(p)
        p.send_signal(signal.SIGHUP)
        out, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 128 + signal.SIGHUP, err)
        self.assert_nothing_left(1.0)


def cgroup_parent():
    """Where launch makes its job cgroups here (`launch env`), or None (subreaper only)."""
    out = subprocess.run([LAUNCH, "env"], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"process containment: cgroup v2 with cgroup.kill, under (\S+),", out)
    return m.group(1) if m else None


class Cgroup(unittest.TestCase):
    """Where a cgroup v2 with cgroup.kill is writable, the job lives in one: a shim killed by
    someone else (the one hole a subreaper leaves) does not let its worker's children escape,
    and no cgroup is left behind on any exit path."""

    def setUp(self):
        self.parent = cgroup_parent()
        if self.parent is None:
            self.skipTest(harness.env_dependent(
                "no writable cgroup v2 with cgroup.kill on this machine"))
        self.tree = ProcessTree("test_sigkill_of_launch")
        self.tree.setUp()
        self.addCleanup(self.tree.tearDown)

    def job_cgroups(self, pid):
        return [d for d in os.listdir(self.parent) if d == harness.job_cgroup_name(pid)]

    def shims_of(self, launch_pid):
        out = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if ppid == launch_pid and b"launch-exec" in cmd:
                out.append(int(pid))
        return out

    def test_a_shim_killed_by_someone_else_leaves_nothing(self):
        p = self.tree.start("wait")
        self.tree.wait_ready(p)
        self.assertEqual(len(self.job_cgroups(p.pid)), 1, os.listdir(self.parent))
        shims = self.shims_of(p.pid)
        self.assertEqual(len(shims), 2)
        os.kill(shims[0], signal.SIGKILL)  # its worker dies with it; its children would not
        out, err = p.communicate(timeout=30)
        self.assertNotEqual(p.returncode, 0, err)
        self.assertIn("SIGKILL", err)
        self.tree.assert_nothing_left(1.0)
        self.assertEqual(self.job_cgroups(p.pid), [])

    def test_no_cgroup_is_left_after_sigkill_of_launch(self):
        p = self.tree.start("wait")
        self.tree.wait_ready(p)
        self.assertEqual(len(self.job_cgroups(p.pid)), 1)
        p.kill()
        p.wait(timeout=10)
        self.tree.assert_nothing_left()
        self.assertTrue(wait_until(lambda: self.job_cgroups(p.pid) == [], 5),
                        os.listdir(self.parent))

    def test_no_cgroup_is_left_after_success(self):
        p = self.tree.start("succeed")
        self.tree.wait_ready(p)
        out, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 0, err)
        self.assertEqual(self.job_cgroups(p.pid), [])


class Descriptors(unittest.TestCase):
    LIST_FDS = ("import os; fds = sorted(int(f) for f in os.listdir('/proc/self/fd')); "
                "print('FDS', [f for f in fds if os.path.exists(f'/proc/self/fd/{f}')], "
                "os.readlink('/proc/self/fd/0'), flush=True)")

    def fds_of_workers(self, out):
        rows = [l.split("FDS ", 1)[1] for l in out.splitlines() if "FDS " in l]
        self.assertTrue(rows, out)
        return rows

    def test_workers_hold_only_stdio_and_what_launch_was_given(self):
        r, w = os.pipe()  # passed down to launch: it stays open for the workers, as given
        try:
            for extra in ([], ["--nnodes", "1:2", "--main_process_ip", "127.0.0.1",
                               "--rdzv_conf", "last_call_timeout=0.1", "--run_id", "fds"]):
                port = []
                if extra:
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", 0))
                        port = ["--main_process_port", str(s.getsockname()[1])]
                p = subprocess.run([LAUNCH, "--nproc_per_node", "2", *extra, *port, "--",
                                    SYSTEM_PYTHON, "-c", self.LIST_FDS],
                                   capture_output=True, text=True, timeout=60, pass_fds=(w,))
                self.assertEqual(p.returncode, 0, p.stderr)
                for row in self.fds_of_workers(p.stdout):
                    # listdir's own descriptor is gone by the time it is checked.
                    self.assertEqual(row, f"[0, 1, 2, {w}] /dev/null", (extra, p.stdout))
        finally:
            os.close(r)
            os.close(w)

    def test_rendezvous_port_is_free_even_when_a_daemon_outlives_its_worker(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        marker = unique_marker("daemon")
        # The worker leaves a setsid'd daemon and exits 0; once launch is done, nothing may hold
        # the rendezvous port (or anything else).
        p = subprocess.run([LAUNCH, "--nnodes", "1:2", "--nproc_per_node", "1",
                            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
                            "--rdzv_conf", "last_call_timeout=0.1", "--", "/bin/sh", "-c",
                            "setsid sleep 30 & echo started"],
                           capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, LAUNCH_TEST_MARKER=marker))
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertTrue(wait_until(lambda: pids_with_marker(marker) == [], 3, 0.05),
                        pids_with_marker(marker))
        with socket.socket() as s:
            # SO_REUSEADDR as servers bind (closed connections linger in TIME_WAIT); it still
            # fails while anything listens on the port.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()

    def test_default_log_directory_is_private_and_symlinks_are_not_followed(self):
        p = subprocess.run([LAUNCH, "-r", "1", "--run_id", "r1", "--", "/bin/echo", "hello"],
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 0, p.stderr)
        m = re.search(r"logs: (\S+)/attempt_<k>", p.stdout + p.stderr)
        self.assertIsNotNone(m, p.stderr)
        root = os.path.dirname(m.group(1))
        self.assertRegex(root, r"/launch-logs-\w{6}$")
        self.assertEqual(os.stat(root).st_mode & 0o777, 0o700)
        with open(os.path.join(m.group(1), "attempt_0", "rank_0.stdout")) as f:
            self.assertEqual(f.read(), "hello\n")
        # A symlink planted where a log file goes is not followed (its target stays intact).
        logs = tmpdir()
        victim = os.path.join(logs, "victim")
        with open(victim, "w") as f:
            f.write("precious")
        os.makedirs(os.path.join(logs, "j", "attempt_0"))
        os.symlink(victim, os.path.join(logs, "j", "attempt_0", "rank_0.stdout"))
        p = subprocess.run([LAUNCH, "--log_dir", logs, "--run_id", "j", "--", "/bin/echo", "x"],
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(victim) as f:
            self.assertEqual(f.read(), "precious")
        self.assertIn("symbolic link; not followed", p.stderr)

    def test_stdin_reads_end_instead_of_stopping_the_worker(self):
        p = subprocess.run([LAUNCH, "--", "/bin/sh", "-c", 'read x; echo "read returned $?"'],
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("read returned 1", p.stdout)


if __name__ == "__main__":
    unittest.main()
