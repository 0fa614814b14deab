"""Hang forensics for unchanged PyTorch scripts (agent/python_shim/sitecustomize.py), with real
processes under `launch` and Debian's PyTorch: a SIGSTOPped rank of a DDP job is named with the
collective its peer waits in and its Python stack; a rank that skips an all_reduce is named as a
desync, with both ranks' Python stacks; DDP's bucket all-reduces are recorded with and without a
comm hook of the user's, and the job trains to the same bits as without the shim. The ring the
shim writes is read by the agent's own reader (collective-ring-dump). A user's sitecustomize
still runs, a script without torch is left alone, SIGURG shows every rank's Python stack while the
job runs on, and no ring file is left behind."""

import glob
import hashlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import harness  # noqa: E402
import test_hang_forensics as hf  # noqa: E402  (imported as a module: its tests stay there)

DUMP = os.path.join(harness.BIN_DIR, "collective-ring-dump")
SHIM_DIR = os.path.normpath(os.path.join(harness.BIN_DIR, "..", "libexec", "launch", "python"))
SHIM = os.path.join(SHIM_DIR, "sitecustomize.py")
PYSTACK = os.path.join(os.path.dirname(SHIM_DIR), "liblaunch-pystack.so")
# The start of a Python program that loads the shim as module `shim` under another name, without
# its import hooks (run it with LAUNCH_PYTHON_SHIM=0).
LOAD_SHIM = textwrap.dedent(f'''
    import importlib.util
    spec = importlib.util.spec_from_file_location("launch_shim", {SHIM!r})
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
''')


def have_torch():
    return subprocess.run([harness.SYSTEM_PYTHON, "-c", "import torch.distributed as d; "
                           "assert d.is_available()"], capture_output=True).returncode == 0


# A DDP job: argv[1] steps (0: until stopped), argv[2] "none" or "user" (a comm hook of its own).
# At the end it prints its parameters' digest and, through the agent's reader, the ring the shim
# wrote (found through the recording wrapper's module: the variable is gone from os.environ).
DDP_SCRIPT = r'''
import hashlib, os, subprocess, sys, torch, torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

hook_calls = [0]

def counting_hook(state, bucket):
    hook_calls[0] += 1
    return default_hooks.allreduce_hook(state, bucket)

def train_step(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss

def sync_metrics(loss):
    t = loss.detach().reshape(1).clone()
    dist.all_reduce(t)
    return t.item()

def main():
    steps, hook = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 4)))
    if hook == "user":
        model.register_comm_hook(None, counting_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = 0
    while steps == 0 or step < steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
        loss = sync_metrics(train_step(model, opt, x, y))
        if step % 10 == 0:
            print(f"step {step} loss {loss:.6f}", flush=True)
        step += 1
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"params {digest.hexdigest()} bytes {nbytes} hook_calls {hook_calls[0]}")
    state = dist.all_reduce.__globals__.get("_S")
    if state is not None and state.ring is not None:
        dump = subprocess.run([os.environ["RING_DUMP"], state.ring.path], capture_output=True,
                              text=True)
        for line in (dump.stdout + dump.stderr).splitlines():
            print("ring: " + line)
    print("shim " + ("on" if state is not None else "off"))
    # PyTorch 1.13 aborts at exit (std::terminate) in about 1 run of 6 when a model with a
    # Python comm hook outlives its process group; the shim run waits that out, not this one.
    del model, opt
    dist.destroy_process_group()

main()
'''

# Rank 1 calls barrier where rank 0 calls all_reduce: both wait, at the same sequence number.
DESYNC_SCRIPT = r'''
import torch, torch.distributed as dist

def sync_metrics(t):
    dist.all_reduce(t)

def skip_ahead():
    dist.barrier()

def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(4)
    for step in range(1000000):
        if step == 30 and rank == 1:
            skip_ahead()
        else:
            sync_metrics(t)

main()
'''

# No torch: what the worker sees.
PLAIN_SCRIPT = r'''
import os, sys
ring = os.environ.get("LAUNCH_COLLECTIVE_RING")
print("torch imported:", "torch" in sys.modules)
print("ring variable kept:", bool(ring), "ring file made:", bool(ring) and os.path.exists(ring))
print("PYTHONPATH=" + os.environ.get("PYTHONPATH", ""))
print("sitecustomize: " + getattr(sys.modules.get("sitecustomize"), "__file__", "none"))
'''

USER_SITECUSTOMIZE = 'print("user sitecustomize ran", flush=True)\n'


def ring_entries(text, rank):
    """The `entry` lines a rank printed from collective-ring-dump, as dicts."""
    out = []
    for line in text.splitlines():
        m = re.match(rf"\[rank {rank}\]: ring: entry (.*)$", line)
        if m:
            f = m.group(1).split()
            out.append(dict(index=int(f[0]), **{f[i]: f[i + 1] for i in range(1, len(f), 2)}))
    return out


@unittest.skipUnless(os.path.exists(SHIM) and os.path.exists(DUMP) and have_torch(),
                     "needs the built shim, collective-ring-dump and python3-torch")
class PythonForensicsTest(unittest.TestCase):
    def setUp(self):
        self.marker = harness.unique_marker("pyhang")
        self.dir = harness.tmpdir()

    def script(self, name, text):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def run_launch(self, *args, env=None, timeout=240):
        env = dict({"RING_DUMP": DUMP, "HANG_TEST_MARKER": self.marker, "OMP_NUM_THREADS": "1"},
                   **(env or {}))
        return harness.launch("--python", harness.SYSTEM_PYTHON, *args, env=env, timeout=timeout)

    def assert_nothing_left(self, launch_pid):
        self.assertTrue(harness.wait_until(lambda: not harness.pids_with_marker(self.marker), 10),
                        "processes left: %s" % harness.pids_with_marker(self.marker))
        self.assertEqual(glob.glob(f"/dev/shm/launch-ring-*-{launch_pid}-r*"), [],
                         "ring files left")

    # --- The ring, written by the shim, read by the agent's reader ------------------------------

    def test_the_agents_reader_reads_the_ring_the_shim_writes(self):
        ring = os.path.join(self.dir, "ring")
        # 70 operations in two groups (the ring keeps the last 64), in every state; the shim is
        # loaded under another name, without its import hooks.
        code = LOAD_SHIM + textwrap.dedent(f'''
            r = shim.Ring({ring!r}, 3)
            world, other = r.group("world"), r.group("a-group-name-longer-than-thirty-one")
            for i in range(70):
                group = other if i % 7 == 6 else world
                op = [shim.ALL_REDUCE, shim.BROADCAST, shim.ALL_TO_ALL, shim.GATHER][i % 4]
                token = r.begin(group, op, 1000 + i, shim.STARTED if i % 2 else shim.ENQUEUED)
                if i < 67:
                    r.done(token, ok=i != 60)
            print(r.group("world"), r.group("another"))
        ''')
        env = dict(os.environ, LAUNCH_PYTHON_SHIM="0")
        made = subprocess.run([harness.SYSTEM_PYTHON, "-c", code], capture_output=True, text=True,
                              env=env, timeout=60)
        self.assertEqual(made.returncode, 0, made.stderr)
        self.assertEqual(made.stdout.split(), ["0", "2"])
        dump = subprocess.run([DUMP, ring], capture_output=True, text=True, timeout=60)
        self.assertEqual(dump.returncode, 0, dump.stderr)
        lines = dump.stdout.splitlines()
        header = re.fullmatch(r"header pid (\d+) rank 3 issued 70 completed 67 last_done_ns "
                              r"(\d+) created_ns (\d+)", lines[0])
        self.assertIsNotNone(header, lines[0])
        self.assertGreater(int(header.group(1)), 0)
        self.assertGreaterEqual(int(header.group(2)), int(header.group(3)))
        self.assertEqual(lines[1:4], ["group 0 world last_seq 60",
                                      "group 1 a-group-name-longer-than-thirty last_seq 10",
                                      "group 2 another last_seq 0"])
        entries = lines[4:]
        self.assertEqual(len(entries), 64)
        seqs = {0: 0, 1: 0}
        for i in range(70):
            group = 1 if i % 7 == 6 else 0
            seqs[group] += 1
            if i < 6:
                continue  # overwritten
            op = ["all-reduce", "broadcast", "all-to-all", "gather"][i % 4]
            state = ("started" if i % 2 else "enqueued") if i >= 67 else \
                ("failed" if i == 60 else "done")
            m = re.fullmatch(rf"entry {i} op {op} group {group} seq {seqs[group]} bytes {1000 + i} "
                             rf"state {state} enqueued_ns (\d+) done_ns (\d+)", entries[i - 6])
            self.assertIsNotNone(m, entries[i - 6])
            enqueued, done = int(m.group(1)), int(m.group(2))
            self.assertEqual(done == 0, i >= 67, entries[i - 6])
            if done:
                self.assertGreaterEqual(done, enqueued)

    def test_the_shims_stack_signal_is_the_agents(self):
        import ctypes
        agent = subprocess.run([DUMP, "--signal"], capture_output=True, text=True, timeout=60)
        self.assertEqual(int(agent.stdout), ctypes.CDLL(PYSTACK).launch_pystack_signal())

    def test_a_stack_request_taken_by_another_thread_is_answered_by_the_main_thread(self):
        # The agent signals the process and the kernel picks the thread: here a side thread,
        # while the main thread runs Python. faulthandler walks every thread's frames without
        # the GIL, so the dump must run where the frames stand still: the main thread, which
        # then shows as faulthandler's "Current thread", in the function it was running.
        stack = os.path.join(self.dir, "ring.stack")
        code = LOAD_SHIM + textwrap.dedent(f'''
            import os, signal, threading, time
            shim._install_stack_dump({stack!r})
            ready = threading.Event()
            def side_thread():
                ready.set()
                time.sleep(60)
            threading.Thread(target=side_thread, daemon=True).start()
            ready.wait()
            def main_thread_spinning():
                signal.pthread_kill(threading.enumerate()[-1].ident, shim_signal)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    try:
                        with open({stack!r}) as f:
                            if f.read().endswith("end\\n"):
                                return
                    except OSError:
                        pass
            import ctypes
            shim_signal = ctypes.CDLL({PYSTACK!r}).launch_pystack_signal()
            main_thread_spinning()
        ''')
        env = dict(os.environ, LAUNCH_PYTHON_SHIM="0")
        r = subprocess.run([harness.SYSTEM_PYTHON, "-c", code], capture_output=True, text=True,
                           env=env, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(stack) as f:
            text = f.read()
        self.assertTrue(text.endswith("end\n"), text)
        current = text.split("Current thread", 1)[1].split("\nThread ", 1)[0]
        self.assertIn("main_thread_spinning", current, text)
        self.assertNotIn("side_thread", current, text)

    # --- Under launch ---------------------------------------------------------------------------

    def test_a_stopped_python_rank_is_named_with_the_collective_and_its_python_stack(self):
        script = self.script("train_ddp.py", DDP_SCRIPT)
        job = hf.Job(["--nproc_per_node", "2", "--stall_timeout", "5", "--python",
                      harness.SYSTEM_PYTHON, script, "0", "none"], self.marker)
        try:
            self.assertTrue(job.wait_for(r"^\[rank 1\]: step 30 ", 120), job.text())
            stopped = hf.worker_pid(self.marker, 1, "python3")
            waiting = hf.worker_pid(self.marker, 0, "python3")
            self.assertIsNotNone(stopped)
            os.kill(stopped, signal.SIGSTOP)
            rc = job.finish(90)
        finally:
            if job.proc.poll() is None:
                job.proc.kill()
            job.proc.stdout.close()
        text = job.text()
        self.assertNotEqual(rc, 0, text)
        self.assertEqual(text.count("launch: stalled collective"), 1, text)
        report = hf.section(text, "launch: stalled collective")
        self.assertRegex(report[0], r"^no collective completed for \d+\.\d s \(--stall_timeout 5 s\)"
                                    r" while [12] rank\(s\) of this node wait in one$")
        # Rank 0 waits in DDP's bucket all-reduce (enqueued: the comm hook's async one) or in
        # sync_metrics's (started), wherever rank 1 was stopped.
        wait = re.fullmatch(rf"rank 0 \(pid {waiting}\): waits in all-reduce #(\d+) of group "
                            r"'world' \(.+\) for \d+\.\d s \((enqueued|started)\)", report[1])
        self.assertIsNotNone(wait, report)
        seq = wait.group(1)
        self.assertTrue(report[2].startswith(f"rank 1 (pid {stopped}): "), report)
        self.assertIn(f"all-reduce #{seq} of group 'world'", report[2])
        self.assertRegex(report[3], rf"^rank 1 \(pid {stopped}\) is stopped \(state T")
        self.assertEqual(report[4],
                         "  its Python threads' stacks (faulthandler, most recent call first):")
        self.assertRegex(report[5], r"^    (Current thread|Thread) 0x[0-9a-f]+ \(most recent call "
                                    r"first\):$")
        frames = "\n".join(report[5:])
        self.assertRegex(frames, r'\n      File ".*train_ddp\.py", line \d+ in '
                                 r'(main|train_step|sync_metrics)\n')
        self.assertRegex(frames, r'\n      File ".*train_ddp\.py", line \d+ in <module>')
        self.assertRegex(text, r"root cause: rank 1 .*\n  error: stalled: no collective completed "
                               r"for 5\.0 s \(--stall_timeout\)")
        self.assert_nothing_left(job.proc.pid)

    def test_a_skipped_all_reduce_is_named_as_a_desync_with_both_python_stacks(self):
        script = self.script("desync.py", DESYNC_SCRIPT)
        job = hf.Job(["--nproc_per_node", "2", "--stall_timeout", "3", "--python",
                      harness.SYSTEM_PYTHON, script], self.marker)
        rc = job.finish(120)
        job.proc.stdout.close()
        text = job.text()
        self.assertNotEqual(rc, 0, text)
        report = hf.section(text, "launch: stalled collective")
        self.assertRegex(report[0], r"^no collective completed for .* while 2 rank\(s\)")
        self.assertEqual(report[1], "desync in group 'world' at #31: rank 0 is in all-reduce "
                                    "(16 B), rank 1 is in barrier (0 B) - a rank skipped or added "
                                    "a collective")
        self.assertRegex(report[2], r"^rank 0 \(pid \d+\): waits in all-reduce #31 of group "
                                    r"'world' \(16 B\) for \d+\.\d s \(started\)$")
        self.assertRegex(report[3], r"^rank 1 \(pid \d+\): waits in barrier #31 of group "
                                    r"'world' \(0 B\) for \d+\.\d s \(started\)$")
        # Both wait, both are blamed: each one's stack shows where in the script it waits.
        stacks = "\n".join(report[4:])
        for rank, function in ((0, "sync_metrics"), (1, "skip_ahead")):
            m = re.search(rf"rank {rank} \(pid \d+\) is .*\n  its Python threads' stacks .*\n"
                          rf"((?:    .*\n?)+)", stacks)
            self.assertIsNotNone(m, stacks)
            self.assertRegex(m.group(1), rf'File ".*desync\.py", line \d+ in {function}\n')
        self.assertIn("error: stalled:", text)
        self.assert_nothing_left(job.proc.pid)

    def test_sigurg_shows_every_python_ranks_stack_and_the_job_runs_on(self):
        script = self.script("train_ddp.py", DDP_SCRIPT)
        job = hf.Job(["--nproc_per_node", "2", "--python", harness.SYSTEM_PYTHON, script, "0",
                      "none"], self.marker)
        try:
            self.assertTrue(job.wait_for(r"^\[rank 1\]: step 20 ", 120), job.text())
            os.kill(job.proc.pid, signal.SIGURG)
            self.assertTrue(job.wait_for(r"rank 1 \(pid \d+\) is .*\n  its Python threads' "
                                         r"stacks", 30), job.text())
            report = "\n".join(hf.section(job.text(), "collective report (on demand)"))
            for rank in (0, 1):
                self.assertRegex(report, rf"rank {rank} \(pid \d+\): (waits in all-reduce|in no "
                                         r"collective|has not entered)")
                self.assertRegex(report, rf"rank {rank} \(pid \d+\) is .*\n  its Python threads' "
                                         r"stacks .*\n    (Current thread|Thread) 0x")
            self.assertEqual(len(re.findall(r'File ".*train_ddp\.py", line \d+ in <module>',
                                            report)), 2, report)
            last = int(re.findall(r"^\[rank 1\]: step (\d+) ", job.text(), re.M)[-1])
            self.assertTrue(job.wait_for(rf"^\[rank 1\]: step {last + 20} ", 60), job.text())
            job.proc.send_signal(signal.SIGTERM)
            job.finish(60)
        finally:
            if job.proc.poll() is None:
                job.proc.kill()
            job.proc.stdout.close()
        self.assertNotIn("stalled collective", job.text())
        self.assert_nothing_left(job.proc.pid)

    def test_ddp_bucket_all_reduces_are_recorded_and_train_to_the_same_bits(self):
        script = self.script("train_ddp.py", DDP_SCRIPT)
        digests = {}
        for hook in ("none", "user"):
            for shim in ("1", "0"):
                r = self.run_launch("--nproc_per_node", "3", script, "12", hook,
                                    env={"LAUNCH_PYTHON_SHIM": shim})
                self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
                self.assertEqual(r.stdout.count("shim " + ("on" if shim == "1" else "off")), 3,
                                 r.stdout)
                found = re.findall(r"^\[rank (\d)\]: params (\w+) bytes (\d+) hook_calls (\d+)$",
                                   r.stdout, re.M)
                self.assertEqual(sorted(f[0] for f in found), ["0", "1", "2"], r.stdout)
                self.assertEqual(len({f[1] for f in found}), 1, found)  # replicas agree
                digests[(hook, shim)] = found[0][1]
                nbytes = found[0][2]
                if hook == "user":
                    self.assertTrue(all(f[3] == "12" for f in found), found)  # one bucket a step
                if shim == "0":
                    self.assertNotIn("ring:", r.stdout)
                    continue
                for rank in range(3):
                    entries = ring_entries(r.stdout, rank)
                    # Every step: the bucket's all-reduce (DDP's, through the comm hook: the
                    # user's hook's own all_reduce inside it is not counted again), then
                    # sync_metrics's; nothing else, all done, in order.
                    self.assertEqual(len(entries), 24, r.stdout)
                    for i, e in enumerate(entries):
                        self.assertEqual((e["op"], e["group"], e["seq"], e["state"]),
                                         ("all-reduce", "0", str(i + 1), "done"), e)
                        self.assertEqual(e["bytes"], nbytes if i % 2 == 0 else "4", e)
        # The recording hook reduces as the Reducer's built-in all-reduce does: the same bits.
        self.assertEqual(digests[("none", "1")], digests[("none", "0")])
        self.assertEqual(digests[("user", "1")], digests[("user", "0")])

    def test_ddp_jobs_that_exit_right_after_their_last_step_end_cleanly(self):
        # The backend thread drops the future callbacks of a Python comm hook just after
        # completing the futures: an exit in between aborts the worker (std::terminate). With the
        # shim's hook that happened in about 1 run of 3; PyTorch 1.13 does it with its own
        # allreduce_hook in about 1 of 6 (the second script), which the shim also waits out.
        script = self.script("quick_exit.py", textwrap.dedent('''
            import sys, torch, torch.distributed as dist
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            dist.init_process_group("gloo")
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
            if sys.argv[1] == "user":
                model.register_comm_hook(None, default_hooks.allreduce_hook)
            for _ in range(3):
                model(torch.randn(4, 8)).sum().backward()
            print("trained")
        '''))
        for hook in ("none", "user"):
            for _ in range(6):
                r = self.run_launch("--nproc_per_node", "2", script, hook)
                self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
                self.assertEqual(r.stdout.count("trained"), 2, r.stdout)

    def test_a_users_sitecustomize_still_runs_and_a_script_without_torch_is_untouched(self):
        script = self.script("plain.py", PLAIN_SCRIPT)
        user = os.path.join(self.dir, "user")
        os.mkdir(user)
        with open(os.path.join(user, "sitecustomize.py"), "w") as f:
            f.write(USER_SITECUSTOMIZE)
        r = self.run_launch("--nproc_per_node", "2", script, env={"PYTHONPATH": user})
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        for rank in (0, 1):
            out = [line[len(f"[rank {rank}]: "):] for line in r.stdout.splitlines()
                   if line.startswith(f"[rank {rank}]: ")]
            self.assertEqual(out, [
                "user sitecustomize ran",
                "torch imported: False",
                "ring variable kept: True ring file made: False",
                "PYTHONPATH=" + SHIM_DIR + ":" + user,
                "sitecustomize: " + os.path.join(user, "sitecustomize.py")], r.stdout)
        self.assertNotIn("warning: python shim", r.stderr)
        # Off: PYTHONPATH as the user set it.
        r = self.run_launch("--nproc_per_node", "1", "--python_shim", "false", script,
                            env={"PYTHONPATH": user})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("[rank 0]: PYTHONPATH=" + user + "\n", r.stdout)
        r = self.run_launch("--nproc_per_node", "1", script,
                            env={"PYTHONPATH": user, "LAUNCH_PYTHON_SHIM": "0"})
        self.assertIn("[rank 0]: PYTHONPATH=" + user + "\n", r.stdout)
        # Not a Python worker: no shim.
        r = self.run_launch("--nproc_per_node", "1", "--", "/bin/sh", "-c",
                            'echo "PYTHONPATH=$PYTHONPATH"', env={"PYTHONPATH": user})
        self.assertIn("[rank 0]: PYTHONPATH=" + user + "\n", r.stdout)
        r = self.run_launch("--python_shim", "maybe", script)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--python_shim: expected true or false, got 'maybe'", r.stderr)

    def test_each_collective_is_recorded_with_its_op_bytes_and_completion(self):
        # A 1-process group, without launch: the shim on PYTHONPATH and a ring path given.
        ring = os.path.join(self.dir, "ring")
        code = textwrap.dedent(f'''
            import torch, torch.distributed as dist
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{harness.free_port()}",
                                    rank=0, world_size=1)
            m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
            m._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
            try:
                m.register_comm_hook(None, lambda state, bucket: None)
            except RuntimeError as e:
                print("second hook:", e)
            m(torch.randn(4, 8)).sum().backward()
            w = torch.ones(3, dtype=torch.float64)
            dist.all_reduce(w, async_op=True).wait()
            dist.broadcast(w, 0)
            dist.barrier()
            dist.all_gather([torch.zeros(3, dtype=torch.float64)], w)
            dist.all_to_all_single(torch.zeros(4), torch.ones(4))
            dist.reduce(w, 0)
            dist.gather(torch.ones(2), [torch.zeros(2)], dst=0)
            dist.scatter(torch.zeros(2), [torch.ones(2)], src=0)
            sub = dist.new_group([0])
            dist.all_reduce(torch.ones(5), group=sub)
            print("grad", m.module.weight.grad.dtype)
        ''')
        # USE_LIBUV=0 as launch sets it (PyTorch 2.x's store asks for libuv, Debian 13's has none).
        env = dict(os.environ, PYTHONPATH=SHIM_DIR, LAUNCH_COLLECTIVE_RING=ring, USE_LIBUV="0")
        r = subprocess.run([harness.SYSTEM_PYTHON, "-c", code], capture_output=True, text=True,
                           env=env, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "second hook: register_comm_hook or register_builtin_comm_hook "
                                   "can only be called once.\ngrad torch.float32\n")
        dump = subprocess.run([DUMP, ring], capture_output=True, text=True, timeout=60)
        self.assertEqual(dump.returncode, 0, dump.stderr)
        lines = dump.stdout.splitlines()
        self.assertRegex(lines[0], r"^header pid \d+ rank 0 issued 10 completed 10 ")
        self.assertEqual(lines[1], "group 0 world last_seq 9")
        self.assertRegex(lines[2], r"^group 1 \S+ last_seq 1$")
        got = [re.match(r"entry \d+ op (\S+) group (\d) seq (\d+) bytes (\d+) state (\w+)",
                        line).groups() for line in lines[3:]]
        self.assertEqual(got, [
            ("all-reduce", "0", "1", "72", "done"),  # DDP's bucket: 18 floats, in the FP16 hook
            ("all-reduce", "0", "2", "24", "done"),  # async_op=True, done through its future
            ("broadcast", "0", "3", "24", "done"),
            ("barrier", "0", "4", "0", "done"),
            ("all-gather", "0", "5", "24", "done"),
            ("all-to-all", "0", "6", "16", "done"),
            ("reduce", "0", "7", "24", "done"),
            ("gather", "0", "8", "8", "done"),
            ("scatter", "0", "9", "8", "done"),
            ("all-reduce", "1", "1", "20", "done"),
        ])

    def test_a_ring_that_cannot_be_made_costs_one_warning_and_the_script_runs(self):
        # Without launch: the shim on PYTHONPATH, a ring in a folder that does not exist.
        code = textwrap.dedent(f'''
            import torch, torch.distributed as dist
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{harness.free_port()}",
                                    rank=0, world_size=1)
            t = torch.ones(2)
            dist.all_reduce(t)
            print("sum", t.sum().item())
        ''')
        env = dict(os.environ, PYTHONPATH=SHIM_DIR, USE_LIBUV="0",
                   LAUNCH_COLLECTIVE_RING=os.path.join(self.dir, "missing", "ring"))
        r = subprocess.run([harness.SYSTEM_PYTHON, "-c", code], capture_output=True, text=True,
                           env=env, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "sum 2.0\n")
        warnings = [line for line in r.stderr.splitlines() if "launch: warning" in line]
        self.assertEqual(len(warnings), 1, r.stderr)
        self.assertIn("python shim: no collective ring " + os.path.join(self.dir, "missing"),
                      warnings[0])


if __name__ == "__main__":
    unittest.main()
