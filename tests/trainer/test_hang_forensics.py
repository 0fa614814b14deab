"""Hang forensics (agent/stall_watch.h, base/collective_ring.h), with real processes under
`launch`: a SIGSTOPped rank of a `train` job is named with the collective the other waits in,
its state and its stack, and the job fails naming the stall; a rank that skips a collective is
named as a desync; on two test hosts (tests/hosts.py), the agent of the host where a rank is
stopped names it; SIGURG prints the report while a healthy job runs on. After each, no process
and no ring file is left."""

import glob
import os
import re
import signal
import subprocess
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import harness  # noqa: E402
import trainer_helpers as th  # noqa: E402
from hosts import make_hosts  # noqa: E402

HANG = os.path.join(harness.BIN_DIR, "collective-hang")

# A DDP job that runs until stopped.
JOB = """
train:
  output_dir: {out}
  model: {{type: mlp, layers: [32, 64, 10]}}
  data: {{type: synthetic, samples: 4000}}
  batch_size: 32
  max_steps: 1000000
  checkpoint_every: 0
  log_every: 20
"""


class Job:
    """`launch ARGS` with stdout and stderr merged into one list of lines, read as they come."""

    def __init__(self, args, marker):
        env = dict(os.environ, OMP_NUM_THREADS="1", HANG_TEST_MARKER=marker)
        self.proc = subprocess.Popen([harness.LAUNCH, *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        self.lines = []
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self.lock:
                self.lines.append(line.rstrip("\n"))

    def text(self):
        with self.lock:
            return "\n".join(self.lines)

    def wait_for(self, pattern, timeout):
        return harness.wait_until(lambda: re.search(pattern, self.text(), re.M), timeout, 0.05)

    def finish(self, timeout):
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(10)
        return self.proc.returncode


def worker_pid(marker, rank, comm):
    """The worker process (not its shim) of global `rank` whose environment holds `marker`."""
    for pid in harness.pids_with_marker(marker):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() != comm[:15]:
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


def section(text, header):
    """The lines of the report that starts with `header`, up to the next blank or '[rank' line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if header in line)
    out = []
    for line in lines[start + 1:]:
        if not line or line.startswith("[rank") or line.startswith("====="):
            break
        out.append(line)
    return out


@unittest.skipUnless(os.path.exists(harness.TRAIN) and os.path.exists(HANG),
                     "needs build/bin/train and collective-hang")
class HangForensicsTest(unittest.TestCase):
    def setUp(self):
        self.marker = harness.unique_marker("hang")
        self.dir = harness.tmpdir()

    def assert_nothing_left(self, job):
        self.assertTrue(harness.wait_until(lambda: not harness.pids_with_marker(self.marker), 10),
                        "processes left: %s" % harness.pids_with_marker(self.marker))
        rings = glob.glob(f"/dev/shm/launch-ring-*-{job.proc.pid}-r*")
        self.assertEqual(rings, [], "ring files left")

    def test_stopped_rank_is_named_with_the_collective_its_peer_waits_in(self):
        cfg = th.write_config(self.dir, "num_processes: 2\n" + JOB.format(out=self.dir + "/run"))
        job = Job(["--stall_timeout", "5", cfg], self.marker)
        try:
            self.assertTrue(job.wait_for(r"step\D+40\b", 120), job.text())
            stopped = worker_pid(self.marker, 1, "train")
            waiting = worker_pid(self.marker, 0, "train")
            self.assertIsNotNone(stopped)
            os.kill(stopped, signal.SIGSTOP)
            rc = job.finish(90)
        finally:
            if job.proc.poll() is None:
                job.proc.kill()
        text = job.text()
        self.assertNotEqual(rc, 0, text)
        self.assertEqual(text.count("launch: stalled collective"), 1, text)
        report = section(text, "launch: stalled collective")
        self.assertRegex(report[0], r"^no collective completed for \d+\.\d s \(--stall_timeout 5 s\)"
                                    r" while [12] rank\(s\) of this node wait in one$")
        wait = re.fullmatch(rf"rank 0 \(pid {waiting}\): waits in (\S+) #(\d+) of group 'world' "
                            r"\(.+\) for \d+\.\d s \((enqueued|started)\)", report[1])
        self.assertIsNotNone(wait, report)
        op, seq = wait.group(1), int(wait.group(2))
        # Rank 1's line names that collective whatever rank 1 was doing when stopped: between
        # collectives (most of a step is computation) it "has not entered" it; stopped inside an
        # earlier one (rank 0 could finish it, rank 1 never returned) it waits there and "has not
        # entered" this one; stopped after issuing this one, it waits in it too.
        self.assertTrue(report[2].startswith(f"rank 1 (pid {stopped}): "), report)
        self.assertIn(f"{op} #{seq} of group 'world'", report[2])
        self.assertRegex(report[2], r": (has not entered \S+ #\d+ of group 'world'; its last "
                                    r"completed collective: .+ ago|waits in \S+ #\d+ of group "
                                    r"'world' \(.+\) for \d+\.\d s \(\w+\)(; has not entered "
                                    r"\S+ #\d+ of group 'world')?)$")
        self.assertRegex(report[3], rf"^rank 1 \(pid {stopped}\) is stopped \(state T")
        self.assertEqual(report[4], "  its main thread's stack:")
        frames = [f for f in report[5:] if f.startswith("    ")]
        self.assertTrue(frames and all("[0x" in f for f in frames), report)
        # The whole stack, down to the program's _start; or, where rank 1 was stopped inside
        # code the unwinder cannot go past (an OpenBLAS kernel, now and then), what it has and
        # a line saying why it ends there.
        if "(_start+" in frames[-1]:
            self.assertGreater(len(frames), 3, report)
            self.assertEqual(report[5 + len(frames):], [], report)
        else:
            self.assertEqual(report[5 + len(frames):],
                             ["  (the stack ends here: no unwind information past this frame, as "
                              "in hand-written assembly such as BLAS kernels)"], report)
        # The failure path names the stall as the root cause's error, and the same process:
        # the worker's pid, not its exec shim's.
        self.assertRegex(text, rf"root cause: rank 1 \(local_rank 1, pid {stopped}\).*\n  error: "
                               r"stalled: no collective completed for 5\.0 s \(--stall_timeout\)")
        self.assert_nothing_left(job)

    def test_a_skipped_collective_is_named_as_a_desync(self):
        job = Job(["--num_processes", "2", "--stall_timeout", "3", "--", HANG, "--skip_at", "20"],
                  self.marker)
        rc = job.finish(90)
        text = job.text()
        self.assertNotEqual(rc, 0, text)
        report = section(text, "launch: stalled collective")
        self.assertRegex(report[0], r"^no collective completed for .* while 2 rank\(s\)")
        desync = re.fullmatch(r"desync in group 'world' at #(\d+): rank 0 is in all-reduce "
                              r"\(64 B\), rank 1 is in barrier \(0 B\) - a rank skipped or added "
                              r"a collective", report[1])
        self.assertIsNotNone(desync, report)
        seq = desync.group(1)
        self.assertRegex(report[2], rf"^rank 0 \(pid \d+\): waits in all-reduce #{seq} of group "
                                    r"'world' \(64 B\)")
        self.assertRegex(report[3], rf"^rank 1 \(pid \d+\): waits in barrier #{seq} of group "
                                    r"'world' \(0 B\)")
        # Both wait: both are blamed, with their stacks.
        self.assertEqual(sum("its main thread's stack:" in line for line in report), 2, report)
        self.assertIn("error: stalled:", text)
        self.assert_nothing_left(job)

    def test_a_stopped_rank_on_another_host_is_named_by_its_own_agent(self):
        hosts = make_hosts(self, 2)
        cfg = th.write_config(self.dir, JOB.format(out=self.dir + "/run"))
        port = harness.free_port()
        env = dict(os.environ, OMP_NUM_THREADS="1", HANG_TEST_MARKER=self.marker)
        env.pop("GLOO_SOCKET_IFNAME", None)
        procs, logs = [], []
        for i, host in enumerate(hosts):
            logs.append(os.path.join(self.dir, f"host{i}.log"))
            with open(logs[-1], "w") as log:
                procs.append(host.popen(
                    [harness.LAUNCH, "--nnodes", "2", "--nproc_per_node", "1", "--node_rank",
                     str(i), "--main_process_ip", hosts[0].addr, "--main_process_port",
                     str(port), "--stall_timeout", "5", cfg], stdout=log, stderr=log, env=env))

        def read(i):
            with open(logs[i]) as f:
                return f.read()
        try:
            self.assertTrue(harness.wait_until(lambda: re.search(r"step\D+40\b", read(0)), 120),
                            read(0) + read(1))
            os.kill(worker_pid(self.marker, 1, "train"), signal.SIGSTOP)
            rcs = [p.wait(timeout=120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        host0, host1 = read(0), read(1)
        self.assertNotIn(0, rcs, host0 + host1)
        # Host 1's agent sees its rank stopped (between collectives it waits in none) and reports
        # first; host 0's, whose rank only waits, gives it a grace and then learns of the failure.
        report = section(host1, "launch: stalled collective")
        self.assertRegex(report[0], r"^no collective completed for \d+\.\d s \(--stall_timeout 5 "
                                    r"s\) while [01] rank\(s\) of this node wait in one")
        self.assertRegex(report[1], r"^rank 1 \(pid \d+\): ")
        self.assertRegex(report[2], r"^rank 1 \(pid \d+\) is stopped \(state T")
        self.assertEqual(report[3], "  its main thread's stack:")
        self.assertNotIn("launch: stalled collective", host0)
        self.assertTrue(harness.wait_until(lambda: not harness.pids_with_marker(self.marker), 10))

    def test_sigkill_of_launch_leaves_no_ring(self):
        job = Job(["--num_processes", "2", "--", HANG, "--steps", "0", "--print_every", "100"],
                  self.marker)
        try:
            self.assertTrue(job.wait_for(r"^\[rank 1\]: step 100$", 120), job.text())
            self.assertEqual(len(glob.glob(f"/dev/shm/launch-ring-*-{job.proc.pid}-r*")), 2)
        finally:
            job.proc.kill()  # the workers' shims remove the rings once launch is gone
            job.finish(60)
        self.assert_nothing_left(job)

    def test_sigurg_prints_the_report_and_the_job_runs_on(self):
        job = Job(["--num_processes", "2", "--", HANG, "--steps", "0", "--print_every", "100"],
                  self.marker)
        try:
            self.assertTrue(job.wait_for(r"^\[rank 1\]: step 200$", 120), job.text())
            os.kill(job.proc.pid, signal.SIGURG)
            self.assertTrue(job.wait_for(r"launch: collective report \(on demand\)", 30),
                            job.text())
            self.assertTrue(job.wait_for(r"rank 1 \(pid \d+\) is .*\n  its main thread's stack:",
                                         30), job.text())
            report = section(job.text(), "launch: collective report (on demand)")
            self.assertRegex(report[0], r"^last collective completed \d+\.\d s ago$")
            for rank in (0, 1):
                # A snapshot of a running job: a rank may be in a collective, between two, or
                # not yet in the one its peer already entered.
                self.assertTrue(any(re.match(rf"rank {rank} \(pid \d+\): (waits in|in no "
                                             r"collective|has not entered)", line)
                                    for line in report), report)
            # The job goes on: steps after the report.
            last = int(re.findall(r"^\[rank 1\]: step (\d+)$", job.text(), re.M)[-1])
            self.assertTrue(job.wait_for(rf"^\[rank 1\]: step {last + 100}$", 60))
            self.assertIsNone(job.proc.poll())
            job.proc.send_signal(signal.SIGTERM)
            job.finish(60)
        finally:
            if job.proc.poll() is None:
                job.proc.kill()
        self.assertNotIn("stalled collective", job.text())
        self.assert_nothing_left(job)


if __name__ == "__main__":
    unittest.main()
