"""A console or log file that stops reading must never stall supervision (review item H1).

Workers flood launch's output (5 MiB lines without a newline, '\\r' progress redraws, ordinary
lines) while whoever reads launch's stdout, or a --log_dir file, stops for a few seconds. With
heartbeat_timeout=1 a blocked agent loop would have its node declared lost within about a
second. Checked: no node is lost, every launch exits 0, every byte arrives untorn and in order
once the reader resumes, launch's RSS stays under RSS_LIMIT while stalled, a console that never
reads again cannot keep launch from exiting, and a closed console stops nothing. Real processes on
loopback (node 1 on 127.0.0.2 via LAUNCH_RDZV_LOCAL_ADDR); every wait is bounded."""

import fcntl
import os
import re
import signal
import subprocess
import termios
import threading
import time
import unittest

from harness import LAUNCH, SYSTEM_PYTHON, free_port, tmpdir, wait_until

BIG = 5 << 20  # one line of 5 MiB without a newline per rank (leaves launch in 1 MiB pieces)
PROGRESS = 2000  # '\r'-terminated redraws per rank
LINES = 2000  # ordinary lines per rank
STALL_S = 2.5  # how long the reader stops: well over heartbeat_timeout (1 s)
# launch's resident memory while a reader is stalled. Its queues hold about 1 MiB per console
# stream plus one read per worker stream (agent/output_writer.h); 64 MiB leaves room for the
# allocator and the rendezvous without letting a 20 MiB flood be buffered.
RSS_LIMIT_KIB = 64 << 10

FLOOD = r'''
import os, sys
rank = int(os.environ["RANK"])
ch = b"abcd"[rank]
out = sys.stdout.buffer
out.write(bytes([ch]) * %d)
out.write(b"\n")
for i in range(%d):
    out.write(b"progress %%05d %%s\r" %% (i, bytes([ch]) * 40))
for i in range(%d):
    out.write(b"line %%05d %%s\n" %% (i, bytes([ch]) * 60))
out.flush()
''' % (BIG, PROGRESS, LINES)

RECORD = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")
PREFIXED = re.compile(rb"\[rank (\d+)\]: (.*?)([\r\n]+)$", re.S)




def vm_rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def pipe_backlog(fd):
    return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), "little")


class Reader:
    """Collects everything from `fd` on a thread, once started; `seen(s)` waits for `s`."""

    def __init__(self, fd, start=True):
        self.fd = fd
        self.data = bytearray()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        if start:
            self.thread.start()

    def start(self):
        self.thread.start()

    def _run(self):
        while True:
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                break
            with self.lock:
                self.data += chunk
        os.close(self.fd)

    def text(self):
        with self.lock:
            return self.data.decode(errors="replace")

    def seen(self, s, timeout):
        return wait_until(lambda: s in self.text(), timeout)

    def finish(self, timeout=20):
        self.thread.join(timeout)
        return bytes(self.data)


class Launch:
    """One launch process whose stdout and stderr go to pipes the test reads (stdout later
    when `stall_stdout`)."""

    def __init__(self, args, env=None, stall_stdout=False):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        full_env = dict(os.environ, **(env or {}))
        full_env.pop("PYTHONUNBUFFERED", None)  # the workers buffer as they would by default
        self.proc = subprocess.Popen([LAUNCH, *args], stdout=out_w, stderr=err_w, env=full_env,
                                     start_new_session=True)
        os.close(out_w)
        os.close(err_w)
        self.out_fd = out_r
        self.out = Reader(out_r, start=not stall_stdout)
        self.err = Reader(err_r)

    def wait(self, timeout):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class Backpressure(unittest.TestCase):
    def setUp(self):
        self.launches = []
        d = tmpdir()
        self.flood = os.path.join(d, "flood.py")
        with open(self.flood, "w") as f:
            f.write(FLOOD)

    def tearDown(self):
        for l in self.launches:
            l.kill()

    def start(self, *args, **kw):
        l = Launch(args, **kw)
        self.launches.append(l)
        return l

    def assert_intact(self, data, ranks):
        """Every record is one rank's, whole, and each rank's stream arrived complete, in order."""
        records = RECORD.findall(data)
        self.assertEqual(sum(map(len, records)), len(data), "bytes outside any line")
        big = {r: 0 for r in ranks}
        progress = {r: [] for r in ranks}
        lines = {r: [] for r in ranks}
        for rec in records:
            m = PREFIXED.match(rec)
            self.assertIsNotNone(m, rec[:200])
            rank, body, end = int(m.group(1)), m.group(2), m.group(3)
            self.assertIn(rank, ranks)
            ch = b"abcd"[rank:rank + 1]
            if body.startswith(b"progress "):
                self.assertEqual(end, b"\r", rec[:200])
                self.assertEqual(body[15:], ch * 40, rec[:200])
                progress[rank].append(int(body[9:14]))
            elif body.startswith(b"line "):
                self.assertEqual(body[11:], ch * 60, rec[:200])
                lines[rank].append(int(body[5:10]))
            else:
                self.assertEqual(body.strip(ch), b"", f"torn: {rec[:80]!r}...{rec[-80:]!r}")
                self.assertLessEqual(len(body), 1 << 20)
                big[rank] += len(body)
        for r in ranks:
            self.assertEqual(big[r], BIG, f"rank {r}")
            self.assertEqual(progress[r], list(range(PROGRESS)), f"rank {r}")
            self.assertEqual(lines[r], list(range(LINES)), f"rank {r}")

    def two_nodes(self, stalled_node):
        port = free_port()
        common = ["--nnodes", "2", "--nproc_per_node", "2", "--main_process_ip", "127.0.0.1",
                  "--main_process_port", str(port), "--rdzv_conf", "heartbeat_timeout=1",
                  "--stop_grace", "5"]
        nodes = []
        for rank, addr in ((0, "127.0.0.1"), (1, "127.0.0.2")):
            nodes.append(self.start(*common, "--node_rank", str(rank), "--", SYSTEM_PYTHON,
                                    self.flood, env={"LAUNCH_RDZV_LOCAL_ADDR": addr},
                                    stall_stdout=rank == stalled_node))
        stalled = nodes[stalled_node]
        self.assertTrue(stalled.err.seen("round 0:", 20), stalled.err.text())
        # Stall: launch's stdout pipe fills and stays full; sample launch's memory meanwhile.
        rss = []
        t_end = time.monotonic() + STALL_S
        while time.monotonic() < t_end:
            rss.append(vm_rss_kib(stalled.proc.pid))
            time.sleep(0.05)
        self.assertGreater(pipe_backlog(stalled.out_fd), 60 << 10, "the reader never stalled")
        stalled.out.start()
        codes = [n.wait(30) for n in nodes]
        for n in nodes:
            n.err.finish()  # to the end of the pipe: all of what launch said
        errs = [n.err.text() for n in nodes]
        for node, (code, err) in enumerate(zip(codes, errs)):
            self.assertNotIn("lost", err, f"node {node}")
            self.assertEqual(code, 0, f"node {node}: {err}")
        self.assertLess(max(rss), RSS_LIMIT_KIB, f"VmRSS samples (KiB): {rss}")
        for node, n in enumerate(nodes):
            self.assert_intact(n.out.finish(), [2 * node, 2 * node + 1])

    def test_stalled_console_on_node_1_loses_no_node(self):
        self.two_nodes(stalled_node=1)

    def test_stalled_console_on_the_node_hosting_the_rendezvous_loses_no_node(self):
        self.two_nodes(stalled_node=0)

    def test_unread_log_file_does_not_stop_signal_handling(self):
        # A FIFO where rank 0's stdout log goes stands in for a log directory on a slow file
        # system: opened for reading (so launch's open succeeds) but not read for a while.
        logs = tmpdir()
        attempt = os.path.join(logs, "fifo", "attempt_0")
        os.makedirs(attempt)
        fifo = os.path.join(attempt, "rank_0.stdout")
        os.mkfifo(fifo)
        fifo_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        worker = ("import signal, sys\n"
                  "signal.signal(signal.SIGUSR1, lambda *_: print('usr1 handled', file=sys.stderr,"
                  " flush=True))\n"
                  # Unbuffered (launch's PYTHONUNBUFFERED), a write the signal interrupts
                  # returns what it wrote: the rest is written by the loop.
                  "data = memoryview(b'y' * (2 << 20) + b'\\n')\n"
                  "while data: data = data[sys.stdout.buffer.write(data):]\n")
        l = self.start("--log_dir", logs, "--run_id", "fifo", "--stop_grace", "2", "--",
                       SYSTEM_PYTHON, "-c", worker)
        self.assertTrue(wait_until(lambda: pipe_backlog(fifo_fd) >= 60 << 10, 20),
                        l.err.text())
        time.sleep(0.3)  # the worker is now blocked on its stdout behind the full log file
        l.proc.send_signal(signal.SIGUSR1)
        self.assertTrue(l.err.seen("usr1 handled", 3), l.err.text())
        os.set_blocking(fifo_fd, True)
        log_file = Reader(fifo_fd)
        self.assertEqual(l.wait(20), 0, l.err.text())
        self.assertEqual(log_file.finish(), b"y" * (2 << 20) + b"\n")
        self.assertEqual(l.out.finish(), b"".join(
            b"[rank 0]: " + b"y" * (1 << 20) + b"\n" for _ in range(2)) + b"[rank 0]: \n")

    def test_console_that_never_reads_again_does_not_keep_launch_alive(self):
        # The worker's 256 KiB fit in launch's queue: it exits, and launch must too, within
        # stop_grace plus a bounded wait at exit, dropping (and counting) what nobody read.
        l = self.start("--stop_grace", "1", "--", SYSTEM_PYTHON, "-c",
                       "import sys; sys.stdout.write(('z' * 99 + '\\n') * 2621)",
                       stall_stdout=True)
        t0 = time.monotonic()
        code = l.wait(15)
        elapsed = time.monotonic() - t0
        self.assertEqual(code, 0, l.err.text())
        self.assertLess(elapsed, 8, l.err.text())
        # launch's exit does not mean the reader thread has taken its last line yet: read to
        # the end of the pipe first (a race under load otherwise).
        l.err.finish()
        self.assertRegex(l.err.text(), r"dropped up to \d+ bytes of output at exit")
        os.close(l.out_fd)

    def test_closed_console_stops_nothing(self):
        l = self.start("--nproc_per_node", "2", "--", SYSTEM_PYTHON, "-c",
                       "import sys; sys.stdout.write('w' * (1 << 20) + '\\n'); "
                       "print('stderr still shown', file=sys.stderr)", stall_stdout=True)
        os.close(l.out_fd)  # launch's stdout now has no reader: EPIPE on every write
        self.assertEqual(l.wait(20), 0, l.err.text())
        l.err.finish()  # its last lines may still be in the pipe when launch has exited
        self.assertEqual(l.err.text().count("stderr still shown"), 2, l.err.text())


if __name__ == "__main__":
    unittest.main()
