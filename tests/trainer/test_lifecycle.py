"""The trainer's life cycle with real processes: bad `train:` values are refused with file:line
before anything starts; an unreachable store is named in the error; a worker killed mid-run
resumes from the last checkpoint and ends bit-identical to an undisturbed run (restarted by hand
with TORCHELASTIC_RESTART_COUNT, and by `launch --max_restarts 1` where `launch` exists); the
README's main command trains for real."""

import json
import os
import signal
import subprocess
import time
import unittest

from trainer_helpers import (LAUNCH, TRAIN, final, free_port, metrics, rank_env, run_ranks,
                             start_ranks, wait_all, write_config)
import harness

HAVE_LAUNCH = os.path.exists(LAUNCH)
NO_LAUNCH = harness.needs_setup(f"{LAUNCH} is not built")

RESUME_CONFIG = """
train:
  seed: 3
  output_dir: {out}
  model: {{type: mlp, layers: [64, 512, 512, 10]}}
  data: {{type: synthetic, samples: 20000}}
  batch_size: 64
  max_steps: {steps}
  optimizer: {{type: adam, lr: 1.0e-3}}
  scheduler: {{type: cosine, warmup_steps: 20}}
  checkpoint_every: 50
  resume: auto
"""


def wait_for_step(out_dir, step, timeout):
    """Polls metrics.jsonl until it records `step` (bounded); returns the last step seen."""
    path = os.path.join(out_dir, "metrics.jsonl")
    deadline = time.monotonic() + timeout
    last = 0
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                lines = [line for line in f if line.strip()]
            if lines:
                last = json.loads(lines[-1])["step"]
        except (OSError, ValueError):
            pass
        if last >= step:
            return last
        time.sleep(0.01)
    return last


def program_of(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0]
    except OSError:
        return b""


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class ConfigErrorTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def test_bad_train_value_fails_with_file_line_before_joining_the_group(self):
        cfg = write_config(self.tmp, "train:\n  seed: 1\n  parallel: {mode: dpp}\n", "bad.yaml")
        # As rank 1 of 2 with nobody hosting the store: a trainer that tried to start would hang
        # until the init timeout; the config check must come first.
        start = time.monotonic()
        r = subprocess.run([TRAIN, cfg], capture_output=True, text=True, timeout=30,
                           env=rank_env(1, 2, free_port()))
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("bad.yaml:3", r.stderr)
        self.assertIn("did you mean 'ddp'", r.stderr)
        self.assertLess(time.monotonic() - start, 10)

    def test_out_of_range_value_names_key_and_line(self):
        cfg = write_config(self.tmp, "train:\n  batch_size: 0\n", "bad.yaml")
        r = subprocess.run([TRAIN, cfg], capture_output=True, text=True, timeout=30,
                           env=rank_env(0, 1, free_port()))
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("bad.yaml:2", r.stderr)
        self.assertIn("batch_size", r.stderr)

    def test_a_full_disk_under_metrics_jsonl_is_named_with_its_cause(self):
        # /dev/full fails every write with ENOSPC, as a disk filled by another process does.
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)
        os.symlink("/dev/full", os.path.join(out, "metrics.jsonl"))
        cfg = write_config(self.tmp, "train:\n  model: {type: mlp, layers: [8, 16, 4]}\n"
                           "  data: {type: synthetic, samples: 1000}\n  batch_size: 8\n"
                           f"  max_steps: 3\n  output_dir: {out}\n  checkpoint_every: 0\n")
        r = subprocess.run([TRAIN, cfg], capture_output=True, text=True, timeout=60,
                           env=rank_env(0, 1, free_port()))
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn(f"writing {out}/metrics.jsonl: No space left on device", r.stderr)

    def test_pipeline_stages_not_dividing_the_world_is_a_config_error(self):
        # (dp and pipeline are implemented; tests/pipeline has their numerics.)
        cfg = write_config(self.tmp, "train:\n  parallel: {mode: pipeline, stages: 2}\n")
        r = subprocess.run([TRAIN, cfg], capture_output=True, text=True, timeout=60,
                           env=rank_env(0, 1, free_port()))
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("does not divide the world size 1", r.stderr)

    @unittest.skipUnless(HAVE_LAUNCH, NO_LAUNCH)
    def test_launch_refuses_bad_train_value_before_starting_workers(self):
        marker = harness.unique_marker()
        cfg = write_config(self.tmp, "train:\n  seed: 1\n  batch_size: -4\n", "bad.yaml")
        r = harness.launch("--nproc_per_node", "2", cfg, timeout=30,
                           env={"LAUNCH_TEST_MARKER": marker})
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("bad.yaml:3", r.stderr)
        self.assertEqual(harness.pids_with_marker(marker), [])


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class ShippedConfigsTest(unittest.TestCase):
    def test_every_shipped_config_trains_two_steps(self):
        tmp = harness.tmpdir()
        for name in ("quickstart", "synthetic", "ddp", "accumulate", "local_sgd", "lm"):
            out = os.path.join(tmp, name)
            r = subprocess.run([TRAIN, f"configs/{name}.yaml", "--max_steps", "2",
                                "--output_dir", out], capture_output=True, text=True,
                               timeout=120, cwd=harness.REPO, env=rank_env(0, 1, free_port()))
            self.assertEqual(r.returncode, 0, f"{name}: {r.stderr}")
            self.assertEqual(final(out)["steps"], 2, name)


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class ProcessGroupInitTest(unittest.TestCase):
    def test_unreachable_store_fails_in_time_naming_the_address(self):
        tmp = harness.tmpdir()
        cfg = write_config(tmp, f"train:\n  output_dir: {tmp}/out\n  max_steps: 1\n")
        port = free_port()
        start = time.monotonic()
        r = subprocess.run([TRAIN, cfg], capture_output=True, text=True, timeout=60,
                           env=rank_env(1, 2, port, extra={"LAUNCH_INIT_TIMEOUT_S": "2"}))
        self.assertNotEqual(r.returncode, 0)
        self.assertIn(f"127.0.0.1:{port}", r.stderr)
        self.assertIn("rank 1", r.stderr)
        self.assertLess(time.monotonic() - start, 30)


IDENTITY_CONFIG = """
train:
  seed: 5
  output_dir: {out}
  model: {{type: mlp, layers: [16, 32, 4]}}
  data: {{type: synthetic, samples: 2000}}
  batch_size: {batch}
  max_steps: {steps}
  optimizer: {{type: sgd, lr: 0.05}}
  scheduler: {{type: {schedule}}}
  checkpoint_every: 10
  resume: {resume}
  resume_allow_changes: {allow}
"""


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class RunIdentityTest(unittest.TestCase):
    """A checkpoint records the settings that shape the run (step<N>/run.txt); a resume with
    other ones is refused naming each change, and a fresh run sets another run's checkpoint
    aside instead of continuing it."""

    def setUp(self):
        self.tmp = harness.tmpdir()
        self.out = os.path.join(self.tmp, "out")

    def train(self, batch=16, steps=30, schedule="constant", resume="auto", allow="false",
              restart=0, args=()):
        cfg = write_config(self.tmp, IDENTITY_CONFIG.format(
            out=self.out, batch=batch, steps=steps, schedule=schedule, resume=resume,
            allow=allow), "identity.yaml")
        return subprocess.run([TRAIN, cfg, *args], capture_output=True, text=True, timeout=120,
                              env=rank_env(0, 1, free_port(), restart=restart))

    def interrupted_run(self, **kw):
        # Stops at step 10 with a checkpoint there: an unfinished run of 30 steps.
        r = self.train(args=("--max_steps", "10"), **kw)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(self.out, "checkpoints", "step10", "run.txt")) as f:
            self.assertIn("train.batch_size: 16\n", f.read())

    def test_unchanged_settings_resume(self):
        self.interrupted_run()
        r = self.train()
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("resumed from", r.stdout)
        self.assertEqual(final(self.out)["steps_this_run"], 20)

    def test_fresh_run_with_other_settings_sets_the_checkpoint_aside(self):
        self.interrupted_run()
        r = self.train(batch=32)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("train.batch_size: 16 -> 32", r.stdout)
        self.assertEqual(final(self.out)["steps_this_run"], 30, "continued a foreign checkpoint")
        aside = os.path.join(self.tmp, "out", "checkpoints.set-aside-step10")
        self.assertTrue(os.path.exists(os.path.join(aside, "latest")), r.stdout)

    def test_restart_or_explicit_resume_with_other_settings_is_refused(self):
        self.interrupted_run()
        ckpt = os.path.join(self.out, "checkpoints")
        for kw in ({"restart": 1}, {"resume": ckpt}):
            r = self.train(batch=32, **kw)
            self.assertEqual(r.returncode, 2, (kw, r.stdout, r.stderr))
            self.assertIn("train.batch_size: 16 -> 32", r.stderr)
            self.assertIn("resume_allow_changes", r.stderr)
        self.assertTrue(os.path.exists(os.path.join(ckpt, "latest")), "the checkpoint was lost")

    def test_opting_in_resumes_with_the_new_settings(self):
        self.interrupted_run()
        r = self.train(batch=32, allow="true")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("with changed settings: train.batch_size: 16 -> 32", r.stdout)
        self.assertEqual(final(self.out)["steps_this_run"], 20)

    def test_a_decaying_schedule_makes_its_length_part_of_the_identity(self):
        # --max_steps 10 made the interrupted run's cosine schedule 10 steps long; continuing
        # it as a 50-step schedule would change every learning rate after step 10.
        self.interrupted_run(schedule="cosine")
        r = self.train(schedule="cosine", steps=50, restart=1)
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("LR schedule length in steps): 10 -> 50", r.stderr)


DP_DROPOUT_CONFIG = """
train:
  seed: 9
  output_dir: {out}
  model: {{type: mlp, layers: [32, 256, 256, 10], dropout: 0.3}}
  data: {{type: synthetic, samples: 4000}}
  batch_size: 64
  max_steps: 40
  optimizer: {{type: adam, lr: 1.0e-3}}
  parallel: {{mode: dp, replicas: 2}}
  checkpoint_every: 10
"""


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class DpDropoutTest(unittest.TestCase):
    """Replica threads draw dropout masks from their own seeded stream (dp.cc ReplicaRandom):
    DP with dropout is reproducible, and a resumed run matches an undisturbed one."""

    def run_dp(self, out, args=(), dropout="0.3"):
        cfg = write_config(harness.tmpdir(), DP_DROPOUT_CONFIG.format(out=out).replace(
            "dropout: 0.3", f"dropout: {dropout}"), "dp.yaml")
        run_ranks(cfg, 1, args)
        return final(out)

    def test_dp_with_dropout_is_reproducible_and_resumes_exactly(self):
        tmp = harness.tmpdir()
        a = self.run_dp(os.path.join(tmp, "a"))
        b = self.run_dp(os.path.join(tmp, "b"))
        self.assertEqual(a["param_checksum"], b["param_checksum"], "two runs differ")
        self.run_dp(os.path.join(tmp, "c"), ("--max_steps", "20"))
        c = self.run_dp(os.path.join(tmp, "c"))
        self.assertEqual(c["steps_this_run"], 20)
        self.assertEqual(c["param_checksum"], a["param_checksum"], "the resumed run differs")
        # Dropout is really drawn: without it the weights differ.
        plain = self.run_dp(os.path.join(tmp, "plain"), dropout="0.0")
        self.assertNotEqual(plain["param_checksum"], a["param_checksum"])


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class LastStepSignalTest(unittest.TestCase):
    def test_sigterm_during_the_last_step_still_finishes_the_run(self):
        # One slow step (~1-3 s of matrix products): the SIGTERM arrives while it runs, so the
        # stop is seen at the last step boundary, where stopping would lose nothing but
        # final.json and model.pt.
        tmp = harness.tmpdir()
        out = os.path.join(tmp, "out")
        cfg = write_config(tmp, f"""
train:
  output_dir: {out}
  model: {{type: mlp, layers: [1024, 4096, 4096, 10]}}
  data: {{type: synthetic, samples: 1100}}
  eval_fraction: 0.05
  batch_size: 512
  max_steps: 1
  optimizer: {{type: sgd, lr: 0.01}}
""")
        proc = subprocess.Popen([TRAIN, cfg], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=rank_env(0, 1, free_port()))
        line = proc.stdout.readline()  # the banner: setup is done, the step starts
        self.assertIn("train: 1 process(es)", line)
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=120)
        self.assertEqual(proc.returncode, 0, err)
        self.assertIn("SIGTERM at the last step: finishing the run", rest)
        self.assertEqual(final(out)["steps"], 1)
        self.assertTrue(os.path.exists(os.path.join(out, "model.pt")))


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class ResumeTest(unittest.TestCase):
    STEPS = 600

    def setUp(self):
        self.tmp = harness.tmpdir()

    def reference(self):
        out = os.path.join(self.tmp, "reference")
        cfg = write_config(self.tmp, RESUME_CONFIG.format(out=out, steps=self.STEPS), "ref.yaml")
        run_ranks(cfg, 2, timeout=120)
        return final(out)

    def check_resumed(self, out, ref, log):
        got = final(out)
        self.assertEqual(got["steps"], self.STEPS)
        self.assertLess(got["steps_this_run"], self.STEPS, "the restart did not resume")
        self.assertEqual(got["param_checksum"], ref["param_checksum"], log)
        self.assertEqual(got["train_loss"], ref["train_loss"])
        steps = [m["step"] for m in metrics(out)]
        self.assertEqual(steps, list(range(1, self.STEPS + 1)))

    def test_killed_worker_resumes_from_checkpoint_and_matches_undisturbed_run(self):
        ref = self.reference()
        out = os.path.join(self.tmp, "disturbed")
        cfg = write_config(self.tmp, RESUME_CONFIG.format(out=out, steps=self.STEPS), "d.yaml")
        procs, port = start_ranks(cfg, 2)
        reached = wait_for_step(out, 120, timeout=60)
        self.assertGreaterEqual(reached, 120)
        self.assertLess(reached, self.STEPS, "run finished before the kill")
        procs[1].send_signal(signal.SIGKILL)
        results = wait_all(procs, timeout=60)
        self.assertNotEqual(results[0][0], 0, "rank 0 should fail when its peer dies")
        self.assertIn("rank 0", results[0][2])
        # The agent's part, done by hand: restart the whole group with the next restart count.
        results = wait_all(start_ranks(cfg, 2, restart=1)[0], timeout=120)
        for rc, _, err in results:
            self.assertEqual(rc, 0, err)
        self.assertIn("resumed from", results[0][1])
        self.check_resumed(out, ref, results[0][1])

    @unittest.skipUnless(HAVE_LAUNCH, NO_LAUNCH)
    def test_launch_max_restarts_resumes_killed_worker(self):
        ref = self.reference()
        out = os.path.join(self.tmp, "launched")
        cfg = write_config(self.tmp, RESUME_CONFIG.format(out=out, steps=self.STEPS), "l.yaml")
        marker = harness.unique_marker()
        env = dict(os.environ, LAUNCH_TEST_MARKER=marker, OMP_NUM_THREADS="1")
        proc = subprocess.Popen([LAUNCH, "--nproc_per_node", "2", "--max_restarts", "1", cfg],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            reached = wait_for_step(out, 120, timeout=90)
            self.assertGreaterEqual(reached, 120)
            workers = [p for p in harness.pids_with_marker(marker)
                       if p != proc.pid and program_of(p).endswith(b"/train")]
            self.assertTrue(workers, "no train worker found")
            os.kill(max(workers), signal.SIGKILL)
            stdout, stderr = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        self.assertEqual(proc.returncode, 0, stdout + stderr)
        self.check_resumed(out, ref, stdout)


def _crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def _masked(data):
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _fields(buf):
    """{field number: [values]} of a protobuf message: varints as ints, 64-bit fields as
    doubles, 32-bit ones as floats, length-delimited ones as bytes."""
    import struct
    out, i = {}, 0
    def varint():
        nonlocal i
        value, shift = 0, 0
        while True:
            b = buf[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value
    while i < len(buf):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            value = varint()
        elif wire == 1:
            value = struct.unpack("<d", buf[i:i + 8])[0]
            i += 8
        elif wire == 5:
            value = struct.unpack("<f", buf[i:i + 4])[0]
            i += 4
        elif wire == 2:
            n = varint()
            value = buf[i:i + n]
            i += n
        else:
            raise ValueError(f"wire type {wire}")
        out.setdefault(number, []).append(value)
    return out


def tensorboard_events(path):
    """The Events of a TensorBoard event file, each record's framing checked: dicts with
    wall_time, step, file_version or values [(tag, value)]."""
    import struct
    with open(path, "rb") as f:
        data = f.read()
    events, at = [], 0
    while at < len(data):
        header = data[at:at + 8]
        (n,) = struct.unpack("<Q", header)
        (crc,) = struct.unpack("<I", data[at + 8:at + 12])
        assert crc == _masked(header), f"length CRC at {at}"
        body = data[at + 12:at + 12 + n]
        (crc,) = struct.unpack("<I", data[at + 12 + n:at + 16 + n])
        assert crc == _masked(body), f"data CRC at {at}"
        at += 16 + n
        e = _fields(body)
        event = {"wall_time": e[1][0], "step": e.get(2, [0])[0]}
        if 3 in e:
            event["file_version"] = e[3][0].decode()
        event["values"] = []
        for summary in e.get(5, []):
            for value in _fields(summary).get(1, []):
                v = _fields(value)
                event["values"].append((v[1][0].decode(), v[2][0]))
        events.append(event)
    return events


def as_float32(x):
    import struct
    return struct.unpack("<f", struct.pack("<f", x))[0]


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class OutputTest(unittest.TestCase):
    CONFIG = """
train:
  output_dir: {out}
  model: {{type: mlp, layers: [16, 32, 4]}}
  data: {{type: synthetic, samples: 2000}}
  max_steps: 30
  log_every: 10
  resume: never
"""

    @staticmethod
    def on_a_terminal(argv, env, stderr_too=False):
        """Runs `argv` with stdout (and stderr) on a pseudo-terminal; returns (rc, text)."""
        import pty
        master, slave = pty.openpty()
        proc = subprocess.Popen(argv, stdout=slave,
                                stderr=slave if stderr_too else subprocess.DEVNULL, env=env)
        os.close(slave)
        chunks = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        os.close(master)
        proc.wait(timeout=30)
        return proc.returncode, b"".join(chunks).decode(errors="replace")

    def test_progress_bar_on_a_terminal(self):
        tmp = harness.tmpdir()
        cfg = write_config(tmp, self.CONFIG.format(out=os.path.join(tmp, "o")))
        rc, text = self.on_a_terminal([TRAIN, cfg], rank_env(0, 1, free_port()))
        self.assertEqual(rc, 0)
        self.assertIn("\r[", text)
        self.assertIn("30/30", text)
        self.assertIn("ETA", text)
        self.assertIn("samples/s", text)
        self.assertNotIn("step 10/30", text)

    @unittest.skipUnless(HAVE_LAUNCH, NO_LAUNCH)
    def test_progress_bar_under_launch_when_its_console_is_a_terminal(self):
        # Through the agent's pipe train cannot see the terminal: launch says so. Rank 0 draws
        # the bar in place; every line written over a redraw (rank 1's, launch's, the bar's
        # next state) first erases the redraw's rest (ESC[K), so no tail of it stays on screen.
        tmp = harness.tmpdir()
        cfg = write_config(tmp, self.CONFIG.format(out=os.path.join(tmp, "o")))
        env = dict(os.environ, TERM="xterm")
        env.pop("LAUNCH_CONSOLE_TTY", None)
        rc, text = self.on_a_terminal([LAUNCH, "--num_processes", "2", cfg], env, stderr_too=True)
        self.assertEqual(rc, 0, text)
        self.assertIn("[rank 0]: [", text)
        self.assertIn("30/30", text)
        self.assertNotIn("[rank 1]: [#", text)  # one bar: rank 0's
        self.assertNotIn("step 10/30", text)     # the bar instead of the lines
        for i, c in enumerate(text[:-1]):
            if c == "\r" and text[i + 1] not in "\r\n":
                self.assertTrue(text.startswith("\x1b[K", i + 1), repr(text[i - 40:i + 40]))
        # Not a terminal: no bar, the plain lines.
        r = subprocess.run([LAUNCH, "--num_processes", "2", cfg], capture_output=True,
                           text=True, timeout=120, env=env)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("\r", r.stdout)
        self.assertIn("step 10/30", r.stdout)

    def test_tensorboard_event_files_hold_the_metrics(self):
        # `tensorboard: true`: output_dir/tensorboard/events.out.tfevents.*, read here with a
        # reader of our own (record framing with CRC-32C, protobuf's wire format); where
        # TensorBoard is installed, test_tensorboard_reader.py reads them with its own.
        tmp = harness.tmpdir()
        out = os.path.join(tmp, "o")
        cfg = write_config(tmp, self.CONFIG.format(out=out) + "  tensorboard: true\n"
                           "  eval_every: 10\n")
        r = subprocess.run([TRAIN, cfg], capture_output=True, text=True, timeout=60,
                           env=rank_env(0, 1, free_port()))
        self.assertEqual(r.returncode, 0, r.stderr)
        files = os.listdir(os.path.join(out, "tensorboard"))
        self.assertEqual(len(files), 1, files)
        self.assertTrue(files[0].startswith("events.out.tfevents."), files)
        path = os.path.join(out, "tensorboard", files[0])
        events = tensorboard_events(path)
        self.assertEqual(events[0]["file_version"], "brain.Event:2")
        scalars = {}
        for e in events[1:]:
            for tag, value in e["values"]:
                scalars.setdefault(tag, {})[e["step"]] = value
        train, evals = metrics(out), metrics(out, evals=True)
        self.assertEqual(sorted(scalars["train/loss"]), [m["step"] for m in train])
        for m in train:  # float32 in the file
            self.assertEqual(scalars["train/loss"][m["step"]], as_float32(m["loss"]))
            self.assertEqual(scalars["train/learning_rate"][m["step"]], as_float32(m["lr"]))
        self.assertEqual([10, 20], [m["step"] for m in evals])
        self.assertEqual(sorted(scalars["eval/loss"]), [10, 20, 30])  # and the final one
        for m in evals:
            self.assertEqual(scalars["eval/accuracy"][m["step"]], as_float32(m["eval_accuracy"]))

    def test_plain_lines_and_metrics_when_not_a_terminal(self):
        tmp = harness.tmpdir()
        out = os.path.join(tmp, "o")
        cfg = write_config(tmp, self.CONFIG.format(out=out))
        r = subprocess.run([TRAIN, cfg], capture_output=True, text=True, timeout=60,
                           env=rank_env(0, 1, free_port()))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("\r", r.stdout)
        for step in (1, 10, 20, 30):
            self.assertIn(f"step {step}/30 loss", r.stdout)
        m = metrics(out)
        self.assertEqual([x["step"] for x in m], list(range(1, 31)))
        for key in ("step", "loss", "lr", "samples_per_s", "comm_ms", "compute_ms"):
            self.assertIn(key, m[0])
        f = final(out)
        for key in ("train_loss", "eval_loss", "eval_accuracy", "steps", "param_checksum"):
            self.assertIn(key, f)


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class SignalTest(unittest.TestCase):
    def test_sigusr1_checkpoints_and_continues_sigterm_checkpoints_and_stops(self):
        tmp = harness.tmpdir()
        out = os.path.join(tmp, "sig")
        steps = 20000
        cfg = write_config(tmp, f"""
train:
  output_dir: {out}
  model: {{type: mlp, layers: [64, 256, 256, 10]}}
  data: {{type: synthetic, samples: 8000}}
  batch_size: 64
  max_steps: {steps}
  checkpoint_every: 0
""")
        ckpt = os.path.join(out, "checkpoints", "latest")
        proc = subprocess.Popen([TRAIN, cfg], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=rank_env(0, 1, free_port()))
        try:
            self.assertGreaterEqual(wait_for_step(out, 50, timeout=60), 50)
            self.assertFalse(os.path.exists(ckpt))
            proc.send_signal(signal.SIGUSR1)
            self.assertTrue(harness.wait_until(lambda: os.path.exists(ckpt), 20))
            self.assertIsNone(proc.poll(), "SIGUSR1 must not stop training")
            proc.send_signal(signal.SIGTERM)
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        self.assertEqual(proc.returncode, 143, stderr)
        self.assertIn("SIGUSR1: wrote", stdout)
        self.assertIn("SIGTERM", stderr)
        self.assertFalse(os.path.exists(os.path.join(out, "final.json")))
        stopped_at = metrics(out)[-1]["step"]
        self.assertLess(stopped_at, steps)
        # The next run continues from the SIGTERM checkpoint (cut short with --max_steps).
        r = subprocess.run([TRAIN, cfg, "--max_steps", str(stopped_at + 20)], capture_output=True,
                           text=True, timeout=120, env=rank_env(0, 1, free_port()))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(f"at step {stopped_at}", r.stdout)
        self.assertEqual(final(out)["steps_this_run"], 20)


@unittest.skipUnless(HAVE_LAUNCH and os.path.exists(TRAIN), NO_LAUNCH)
class ReadmeCommandTest(unittest.TestCase):
    def test_quickstart_trains_a_cnn_on_fashion_mnist_to_090(self):
        # The README's main job as written: real data, real model, the accuracy it promises.
        # Same seed and world size give bit-identical runs, so 0.90 is not a matter of luck.
        out = os.path.join(harness.tmpdir(), "quickstart")
        r = harness.launch("--num_processes", "2", "configs/quickstart.yaml", "--",
                           "--output_dir", out, timeout=400, cwd=harness.REPO)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        m = metrics(out)
        f = final(out)
        self.assertEqual(f["world_size"], 2)
        self.assertEqual(f["steps"], len(m))
        self.assertEqual(f["steps"], 3 * (60000 // 2 // 64))  # 3 epochs of 60,000 images
        first = sum(x["loss"] for x in m[:20]) / 20
        self.assertGreater(first, 1.5)
        self.assertLess(f["eval_loss"], 0.35, f)
        self.assertGreaterEqual(f["eval_accuracy"], 0.90, f)
        self.assertTrue(os.path.exists(os.path.join(out, "model.pt")))

if __name__ == "__main__":
    unittest.main()
