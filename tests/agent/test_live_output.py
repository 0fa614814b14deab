"""A torchrun user's script under `launch`: the workers' Python is the one the user's environment
chooses (a missing torch is explained, not just a traceback), and every worker's output arrives
while it runs, whether it is Python in any form or a C program that never flushes."""

import os
import re
import select
import shutil
import subprocess
import textwrap
import time
import unittest

import harness
from harness import BIN_DIR, LAUNCH, SYSTEM_PYTHON, launch, tmpdir

PRINTER = os.path.join(BIN_DIR, "unflushed-printer")

# pytorch/examples' distributed/ddp-tutorial-series/multigpu_torchrun.py, reduced to what
# matters here: it imports torch and forms a Gloo group from torchrun's variables.
TORCHRUN_SCRIPT = textwrap.dedent("""\
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    print("sum", int(t.item()), flush=True)
    dist.destroy_process_group()
""")

# Lines that reach the console while the worker waits for the go file (a Python worker).
WAITING_SCRIPT = textwrap.dedent("""\
    import os, sys, time
    print("ready")
    deadline = time.monotonic() + float(sys.argv[2])
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.1)
    print("done", "go" if os.path.exists(sys.argv[1]) else "timeout")
""")


def clean_env(**extra):
    """This machine exports PYTHONUNBUFFERED=1 and may have an environment active; users' do
    not, and the tests say what they need."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONUNBUFFERED", "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHON_EXEC",
                        "LAUNCH_PYTHON", "LD_PRELOAD")}
    env.update(extra)
    return env


class InterpreterTest(unittest.TestCase):
    def setUp(self):
        self.dir = tmpdir()
        self.script = os.path.join(self.dir, "multigpu_torchrun.py")
        with open(self.script, "w") as f:
            f.write(TORCHRUN_SCRIPT)
        # PATH's python3 cannot import torch (a pyenv or system Python without it): -S drops
        # site-packages, where Debian's torch lives.
        self.path_bin = os.path.join(self.dir, "path-bin")
        os.makedirs(self.path_bin)
        self.bare = os.path.join(self.path_bin, "python3")
        with open(self.bare, "w") as f:
            f.write("#!/bin/sh\nexec %s -S \"$@\"\n" % SYSTEM_PYTHON)
        os.chmod(self.bare, 0o755)
        # A virtualenv whose interpreter has torch (what `python3 -m venv
        # --system-site-packages` makes, without needing python3-venv here).
        self.venv = os.path.join(self.dir, "venv")
        os.makedirs(os.path.join(self.venv, "bin"))
        os.symlink(SYSTEM_PYTHON, os.path.join(self.venv, "bin", "python"))
        self.env = clean_env(PATH=self.path_bin + ":" + os.environ["PATH"])

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def run_script(self, **extra):
        env = dict(self.env)
        env.update(extra)
        return subprocess.run([LAUNCH, "--nproc_per_node", "2", self.script], env=env,
                              capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)

    def test_without_an_active_environment_a_missing_torch_is_explained(self):
        r = self.run_script()
        self.assertNotEqual(r.returncode, 0, r.stdout)
        self.assertIn("ModuleNotFoundError: No module named 'torch'", r.stderr)
        self.assertIn("hint: the workers' Python is %s (python3 on PATH), which cannot import "
                      "'torch'" % self.bare, r.stderr)
        self.assertIn("--python PATH", r.stderr)

    def test_the_active_virtualenv_runs_the_workers(self):
        r = self.run_script(VIRTUAL_ENV=self.venv)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("[rank 0]: sum 3", r.stdout)
        self.assertIn("[rank 1]: sum 3", r.stdout)
        self.assertNotIn("hint:", r.stderr)
        shown = subprocess.run([LAUNCH, "--print_config", self.script],
                               env=dict(self.env, VIRTUAL_ENV=self.venv), capture_output=True,
                               text=True, timeout=60)
        self.assertIn("# python: %s/bin/python (environment VIRTUAL_ENV)" % self.venv,
                      shown.stdout)

    def test_a_conda_environment_and_an_explicit_choice(self):
        self.assertEqual(self.run_script(CONDA_PREFIX=self.venv).returncode, 0)
        # PYTHON_EXEC (torchrun's variable) beats the active environment.
        r = self.run_script(VIRTUAL_ENV=self.venv, PYTHON_EXEC=self.bare)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("%s (environment PYTHON_EXEC)" % self.bare, r.stderr)


class LiveOutputTest(unittest.TestCase):
    """The worker prints "ready", then waits for a file the test creates only once "ready" has
    reached launch's stdout. Buffered output would arrive only at the worker's exit, after its
    wait runs out."""

    def setUp(self):
        self.dir = tmpdir()
        self.go = os.path.join(self.dir, "go")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def first_line_arrival(self, program, flags=(), wait_s=30, env=None):
        """Seconds from launch's start until "ready" is on its stdout, and whether the worker
        was still waiting then (it saw the go file, created as soon as "ready" arrived)."""
        if os.path.exists(self.go):
            os.unlink(self.go)
        p = subprocess.Popen([LAUNCH, *flags, "--", *program, self.go, str(wait_s)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, env=env or clean_env())
        start = time.monotonic()
        seen = b""
        arrival = None
        try:
            while b"ready" not in seen and time.monotonic() - start < wait_s + 30:
                readable, _, _ = select.select([p.stdout], [], [], 1.0)
                if readable:
                    chunk = os.read(p.stdout.fileno(), 4096)
                    if not chunk:
                        break
                    seen += chunk
            if b"ready" in seen:
                arrival = time.monotonic() - start
                with open(self.go, "w"):
                    pass
            out, err = p.communicate(timeout=wait_s + 30)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.assertEqual(p.returncode, 0, err)
        self.assertIsNotNone(arrival, seen)
        done = re.search(rb"\[rank 0\]: done (go|timeout)", seen + out)
        self.assertIsNotNone(done, seen + out)
        return arrival, done.group(1) == b"go"

    def test_a_c_program_that_never_flushes(self):
        if not os.path.exists(PRINTER):
            self.skipTest(harness.needs_setup("unflushed-printer is not built"))
        arrival, waiting = self.first_line_arrival([PRINTER])
        self.assertTrue(waiting, "the line arrived only when the worker ended")
        # Off: the program's own buffering, so the line comes with the exit (the wait runs out).
        arrival, waiting = self.first_line_arrival([PRINTER], ["--line_buffered", "false"],
                                                   wait_s=2)
        self.assertFalse(waiting)

    def test_a_program_under_gccs_address_sanitizer_still_runs(self):
        asan = PRINTER + "-asan"
        if not os.path.exists(asan):
            self.skipTest(harness.needs_setup(
                "unflushed-printer-asan is not built (no GCC AddressSanitizer)"))
        # With a library preloaded before its runtime it would abort ("ASan runtime does not
        # come first in initial library list"); launch leaves its buffering alone.
        env = clean_env()
        env.pop("ASAN_OPTIONS", None)
        arrival, waiting = self.first_line_arrival([asan], wait_s=2, env=env)
        self.assertFalse(waiting)

    def test_python_as_a_program_after_dashdash(self):
        script = os.path.join(self.dir, "wait.py")
        with open(script, "w") as f:
            f.write(WAITING_SCRIPT)
        # `-- python3 x.py`: no -u from launch, PYTHONUNBUFFERED does it.
        arrival, waiting = self.first_line_arrival([SYSTEM_PYTHON, script])
        self.assertTrue(waiting, "the line arrived only when the worker ended")


if __name__ == "__main__":
    unittest.main()
