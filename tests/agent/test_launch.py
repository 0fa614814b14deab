"""End-to-end tests of single-node `launch`: real processes, real signals, the process table."""

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
import unittest

import harness
from harness import (LAUNCH, REPO, SYSTEM_PYTHON, launch, pids_with_marker, run, tmpdir,
                     unique_marker, wait_until)

CONTRACT = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
            "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID"]

PRINT_ENV = ("import json, os; print('ENV ' + json.dumps({k: os.environ.get(k) for k in %r + "
             "['OMP_NUM_THREADS', 'CUDA_VISIBLE_DEVICES', 'MY_VAR']}))" % CONTRACT)


def envs_from(stdout):
    out = {}
    for line in stdout.splitlines():
        m = re.match(r"\[rank (\d+)\]: ENV (.*)$", line)
        if m:
            out[int(m.group(1))] = json.loads(m.group(2))
    return out


def start_launch(args, marker, **kw):
    env = dict(os.environ, LAUNCH_TEST_MARKER=marker)
    return subprocess.Popen([LAUNCH, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True, **kw)


class EnvironmentContract(unittest.TestCase):
    def check_world(self, n):
        r = launch("--nproc_per_node", str(n), "--run_id", "job7", "--", SYSTEM_PYTHON, "-c", PRINT_ENV,
                   env={"MY_VAR": "inherited", "OMP_NUM_THREADS": None})
        self.assertEqual(r.returncode, 0, r.stderr)
        envs = envs_from(r.stdout)
        self.assertEqual(sorted(envs), list(range(n)))
        ports = {e["MASTER_PORT"] for e in envs.values()}
        self.assertEqual(len(ports), 1)
        for rank, e in envs.items():
            self.assertEqual(e["RANK"], str(rank))
            self.assertEqual(e["LOCAL_RANK"], str(rank))
            self.assertEqual(e["WORLD_SIZE"], str(n))
            self.assertEqual(e["LOCAL_WORLD_SIZE"], str(n))
            self.assertEqual(e["GROUP_RANK"], "0")
            self.assertEqual(e["GROUP_WORLD_SIZE"], "1")
            self.assertEqual(e["ROLE_RANK"], str(rank))
            self.assertEqual(e["ROLE_NAME"], "default")
            self.assertEqual(e["ROLE_WORLD_SIZE"], str(n))
            self.assertEqual(e["MASTER_ADDR"], "127.0.0.1")
            self.assertTrue(1 <= int(e["MASTER_PORT"]) <= 65535)
            self.assertEqual(e["TORCHELASTIC_RESTART_COUNT"], "0")
            self.assertEqual(e["TORCHELASTIC_MAX_RESTARTS"], "0")
            self.assertEqual(e["TORCHELASTIC_RUN_ID"], "job7")
            self.assertEqual(e["MY_VAR"], "inherited")
            self.assertEqual(e["OMP_NUM_THREADS"], "1" if n > 1 else None)

    def test_one_worker(self):
        self.check_world(1)

    def test_two_workers(self):
        self.check_world(2)

    def test_four_workers(self):
        self.check_world(4)

    def test_empty_omp_num_threads_counts_as_unset(self):
        r = launch("--nproc-per-node", "2", "--", SYSTEM_PYTHON, "-c", PRINT_ENV, env={"OMP_NUM_THREADS": ""})
        self.assertEqual({e["OMP_NUM_THREADS"] for e in envs_from(r.stdout).values()}, {"1"})

    def test_user_omp_num_threads_is_kept(self):
        r = launch("--nproc-per-node", "2", "--", SYSTEM_PYTHON, "-c", PRINT_ENV, env={"OMP_NUM_THREADS": "3"})
        self.assertEqual({e["OMP_NUM_THREADS"] for e in envs_from(r.stdout).values()}, {"3"})

    def test_gpu_ids_set_cuda_visible_devices(self):
        r = launch("--nproc_per_node", "2", "--gpu_ids", "2,0", "--", SYSTEM_PYTHON, "-c", PRINT_ENV)
        self.assertEqual({e["CUDA_VISIBLE_DEVICES"] for e in envs_from(r.stdout).values()}, {"2,0"})

    def test_num_processes_is_the_total(self):
        r = launch("--num_processes", "3", "--", SYSTEM_PYTHON, "-c", PRINT_ENV)
        self.assertEqual(len(envs_from(r.stdout)), 3)

    def test_py_script_runs_under_python_and_module_flag(self):
        d = tmpdir()
        script = os.path.join(d, "hello.py")
        with open(script, "w") as f:
            f.write("import os, sys; print('script', os.environ['RANK'], sys.argv[1:])\n")
        r = launch("--nproc_per_node", "2", "--python", SYSTEM_PYTHON, script, "--lr", "0.1")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("[rank 1]: script 1 ['--lr', '0.1']", r.stdout)
        r = launch("--nproc_per_node", "1", "--python", SYSTEM_PYTHON, "-m", "json.tool", "--help")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("[rank 0]: usage:", r.stdout)


    def test_every_help_fits_100_columns_and_says_its_usage_once(self):
        commands = [[LAUNCH, "--help"], [LAUNCH, "test", "--help"], [LAUNCH, "config", "--help"],
                    [LAUNCH, "env", "--help"], [LAUNCH, "rdzv-server", "--help"]]
        if os.path.exists(harness.TRAIN):
            commands.append([harness.TRAIN, "--help"])
        for command in commands:
            with self.subTest(command=" ".join(command[1:])):
                r = subprocess.run(command, capture_output=True, text=True, timeout=60)
                self.assertEqual(r.returncode, 0, r.stderr)
                wide = [line for line in r.stdout.splitlines() if len(line) > 100]
                self.assertEqual(wide, [])
                self.assertLessEqual(len(re.findall(r"(?im)^usage:", r.stdout)), 1, r.stdout)
        # launch's usage is its own lines at the top: no second one of CLI11's.
        r = subprocess.run([LAUNCH, "--help"], capture_output=True, text=True, timeout=60)
        self.assertNotRegex(r.stdout, r"(?im)^usage:")
        self.assertEqual(r.stdout.count("  launch [flags] CONFIG.yaml"), 1)

    def test_python_worker_output_arrives_while_it_runs(self):
        # Users' machines do not export PYTHONUNBUFFERED (this one does): without it a
        # worker's print() into the agent's pipe would wait for the worker's exit, unless the
        # interpreter runs with -u as torchrun starts it.
        d = tmpdir()
        for name, args in (("script", ["late.py"]), ("module", ["-m", "late"])):
            with open(os.path.join(d, "late.py"), "w") as f:
                f.write("import time; print('first line', flush=False); time.sleep(4)\n")
            env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
            env["PYTHONPATH"] = d
            start = time.monotonic()
            p = subprocess.Popen([LAUNCH, "--nproc_per_node", "1", "--python", SYSTEM_PYTHON,
                                  *args], cwd=d, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
            try:
                line = p.stdout.readline()
                arrived = time.monotonic() - start
            finally:
                p.wait(timeout=30)
            self.assertIn("first line", line, name)
            self.assertLess(arrived, 3, f"{name}: the line came with the worker's exit")


    def test_torchrun_short_forms_of_redirects_and_tee(self):
        r = launch("-r", "3", "-t", "1", "--print_config", "--", "/bin/true")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRegex(r.stdout, r"redirects: 3\s+# flag --redirects/-r")
        self.assertRegex(r.stdout, r"tee: 1\s+# flag --tee/-t")

    def test_python_exec_chooses_the_interpreter_as_in_torchrun(self):
        d = tmpdir()
        script = os.path.join(d, "x.py")
        with open(script, "w") as f:
            f.write("print('never run')\n")
        # /bin/echo as the "interpreter" shows exactly what the worker was started with.
        r = launch("--nproc_per_node", "1", script, env={"PYTHON_EXEC": "/bin/echo"})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(f"[rank 0]: -u {script}", r.stdout)
        r = launch("--print_config", script, env={"PYTHON_EXEC": "/bin/echo"})
        self.assertRegex(r.stdout, r"python: /bin/echo\s+# environment PYTHON_EXEC")
        r = launch("--nproc_per_node", "1", "--python", SYSTEM_PYTHON, script,
                   env={"PYTHON_EXEC": "/bin/echo"})
        self.assertIn("[rank 0]: never run", r.stdout)  # the flag outranks the environment

    def test_carriage_return_progress_is_shown_while_the_worker_runs(self):
        # A tqdm-style bar: redraws that end in '\r' and no newline until the end. Each redraw
        # must reach the console while the worker runs, not when it prints its last newline.
        d = tmpdir()
        script = os.path.join(d, "bar.py")
        with open(script, "w") as f:
            f.write("import sys, time\n"
                    "for i in range(3):\n"
                    "    sys.stderr.write(f'\\rprogress {i}')\n"
                    "    sys.stderr.flush()\n"
                    "    time.sleep(1.5)\n"
                    "sys.stderr.write('\\n')\n")
        start = time.monotonic()
        p = subprocess.Popen([LAUNCH, "--nproc_per_node", "1", "--python", SYSTEM_PYTHON, script],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        seen, shown_at = b"", None
        try:
            while time.monotonic() - start < 10 and shown_at is None:
                ready, _, _ = select.select([p.stderr], [], [], 0.1)
                if ready:
                    chunk = os.read(p.stderr.fileno(), 4096)
                    if not chunk:
                        break
                    seen += chunk
                    if b"progress 0\r" in seen:
                        shown_at = time.monotonic() - start
            still_running = p.poll() is None
        finally:
            p.wait(timeout=30)
        self.assertIsNotNone(shown_at, seen)
        self.assertTrue(still_running, "the redraw came only with the worker's exit")
        self.assertIn(b"[rank 0]: progress 0\r", seen)

    def test_gpu_worker_count_follows_cuda_visible_devices_and_refuses_none(self):
        fake = os.path.abspath(os.path.join(os.path.dirname(LAUNCH), "..", "fake_nvml"))
        if not os.path.exists(os.path.join(fake, "libnvidia-ml.so.1")):
            self.skipTest(harness.needs_setup("the fake libnvidia-ml.so.1 (two GPUs) is not built"))
        base = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        base["LD_LIBRARY_PATH"] = fake
        cmd = ["--nproc_per_node", "gpu", "--", "/bin/sh", "-c", "echo worker $LOCAL_RANK"]
        for visible, workers in ((None, 2), ("1", 1), ("0,1", 2), ("GPU-abc,7", 2)):
            env = dict(base) if visible is None else dict(base, CUDA_VISIBLE_DEVICES=visible)
            r = launch(*cmd, env=env)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(r.stdout.count("worker "), workers, (visible, r.stdout))
        # No GPU visible: an error naming the flag, as torchrun's, not silent CPU workers.
        for env in (dict(base, CUDA_VISIBLE_DEVICES="-1"), dict(base, CUDA_VISIBLE_DEVICES=""),
                    {k: v for k, v in base.items() if k != "LD_LIBRARY_PATH"}):
            r = launch(*cmd, env=env)
            self.assertEqual(r.returncode, 2, r.stdout)
            self.assertIn("--nproc_per_node: nproc_per_node gpu: no GPU is visible", r.stderr)

    def test_more_gpu_workers_than_visible_gpus_is_refused_before_any_starts(self):
        fake = os.path.abspath(os.path.join(os.path.dirname(LAUNCH), "..", "fake_nvml"))
        if not os.path.exists(os.path.join(fake, "libnvidia-ml.so.1")):
            self.skipTest(harness.needs_setup("the fake libnvidia-ml.so.1 (two GPUs) is not built"))
        base = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        base["LD_LIBRARY_PATH"] = fake
        cmd = ["--", "/bin/sh", "-c", "echo worker $LOCAL_RANK"]
        for flags, env, want in (
                (["--multi_gpu", "--num_processes", "3"], base,
                 "3 processes per machine, but 2 GPUs are visible here "
                 "(CUDA_VISIBLE_DEVICES is unset)"),
                (["--nproc_per_node", "2"], dict(base, CUDA_VISIBLE_DEVICES="1"),
                 "2 processes per machine, but 1 GPU is visible here "
                 "(CUDA_VISIBLE_DEVICES='1')")):
            r = launch(*flags, *cmd, env=env)
            self.assertEqual(r.returncode, 2, r.stdout)
            self.assertIn(want, r.stderr)
            self.assertIn("or --cpu for CPU processes", r.stderr)
            self.assertNotIn("worker ", r.stdout)
        # As many as the GPUs, or --cpu: the workers run.
        for flags in (["--multi_gpu", "--num_processes", "2"], ["--cpu", "--num_processes", "3"]):
            r = launch(*flags, *cmd, env=base)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(r.stdout.count("worker "), int(flags[-1]), r.stdout)


    def test_accelerate_default_config_is_found_and_named(self):
        # What `accelerate config` writes, where accelerate keeps it: used when no config is
        # given and launch has none of its own, and the log says which file it is.
        hf = tmpdir()
        path = os.path.join(hf, "accelerate", "default_config.yaml")
        os.makedirs(os.path.dirname(path))
        with open(path, "w") as f:
            f.write("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\n"
                    "mixed_precision: 'no'\nnum_machines: 1\nnum_processes: 2\n"
                    "machine_rank: 0\nmain_training_function: main\nuse_cpu: true\n")
        cmd = ["--", "/bin/sh", "-c",
               "echo world $WORLD_SIZE $ACCELERATE_USE_CPU $ACCELERATE_MIXED_PRECISION"]
        r = launch(*cmd, env={"HF_HOME": hf})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(f"using config {path}", r.stdout + r.stderr)
        # The environment accelerate's launcher would export for this file.
        self.assertEqual(r.stdout.count("world 2 True no"), 2, r.stdout)
        # Without HF_HOME: $XDG_CACHE_HOME/huggingface, as accelerate looks.
        cache = tmpdir()
        os.makedirs(os.path.join(cache, "huggingface"))
        os.rename(os.path.join(hf, "accelerate"), os.path.join(cache, "huggingface", "accelerate"))
        r = launch(*cmd, env={"HF_HOME": None, "XDG_CACHE_HOME": cache})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(os.path.join(cache, "huggingface", "accelerate", "default_config.yaml"),
                      r.stdout + r.stderr)
        self.assertEqual(r.stdout.count("world 2"), 2, r.stdout)


class Failures(unittest.TestCase):
    def test_exit_code_and_report_of_first_failure(self):
        marker = unique_marker()
        t0 = time.monotonic()
        r = launch("--nproc_per_node", "2", "--", "sh", "-c",
                   'if [ "$RANK" = 1 ]; then echo "bad thing happened" >&2; exit 3; fi; exec sleep 60',
                   env={"LAUNCH_TEST_MARKER": marker})
        self.assertLess(time.monotonic() - t0, 20, "the sibling was not stopped")
        self.assertEqual(r.returncode, 3)
        self.assertIn("root cause: rank 1 (local_rank 1", r.stderr)
        self.assertIn("exited with code 3", r.stderr)
        self.assertIn("    bad thing happened", r.stderr)
        self.assertRegex(r.stderr, r"rank 0 .* killed by SIGTERM .*after launch stopped the group")
        self.assertEqual(pids_with_marker(marker), [])

    def test_sigsegv_is_reported_with_signal_name(self):
        r = launch("--nproc_per_node", "2", "--", "sh", "-c",
                   'if [ "$RANK" = 1 ]; then kill -SEGV $$; fi; exec sleep 60')
        self.assertEqual(r.returncode, 128 + signal.SIGSEGV)
        self.assertIn("root cause: rank 1", r.stderr)
        self.assertIn("killed by SIGSEGV (signal 11)", r.stderr)

    def test_missing_program_is_a_usage_error(self):
        r = launch("--nproc_per_node", "2", "--", "/nonexistent/prog")
        self.assertEqual(r.returncode, 2)
        self.assertIn("/nonexistent/prog: no such file", r.stderr)

    def test_restarts_are_counted(self):
        # Fails on the first attempt, succeeds on the second.
        r = launch("--nproc_per_node", "2", "--max_restarts", "2", "--", "sh", "-c",
                   'echo "attempt $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS"; '
                   '[ "$TORCHELASTIC_RESTART_COUNT" -ge 1 ] || [ "$RANK" = 0 ] || exit 5; sleep 0.2')
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("[rank 1]: attempt 0 of 2", r.stdout)
        self.assertIn("[rank 1]: attempt 1 of 2", r.stdout)
        self.assertNotIn("attempt 2 of 2", r.stdout)
        self.assertIn("restarts used: 0 of 2 -- restarting the group", r.stderr)
        self.assertIn("restart 1 of 2", r.stderr)

    def test_restarts_exhausted_reports_count_and_code(self):
        r = launch("--nproc_per_node", "1", "--max_restarts", "1", "--", "sh", "-c", "exit 7")
        self.assertEqual(r.returncode, 7)
        self.assertIn("restarts used: 1 of 1\n", r.stderr)


class Signals(unittest.TestCase):
    def spawn_sleepers(self, marker, extra=()):
        p = start_launch(["--nproc_per_node", "2", "--stop_grace", "2", *extra, "--", "sh", "-c",
                          'echo up; exec sleep 60'], marker)
        self.assertTrue(wait_until(lambda: len(pids_with_marker(marker)) >= 3, 10), "workers did not start")
        return p

    def test_sigterm_to_launch_leaves_no_process(self):
        marker = unique_marker()
        p = self.spawn_sleepers(marker)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=20)
        self.assertEqual(p.returncode, 128 + signal.SIGTERM)
        self.assertIn("received SIGTERM", err)
        self.assertEqual(pids_with_marker(marker), [])

    def test_sigint_forwarded_and_grace_then_kill(self):
        marker = unique_marker()
        p = start_launch(["--nproc_per_node", "2", "--stop_grace", "0.5", "--", "sh", "-c",
                          "trap 'echo got INT' INT; echo up; while :; do sleep 0.05; done"], marker)
        self.assertTrue(wait_until(lambda: len(pids_with_marker(marker)) >= 3, 10))
        time.sleep(0.3)
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=20)
        self.assertEqual(p.returncode, 128 + signal.SIGINT)
        self.assertIn("[rank 0]: got INT", out)  # forwarded; the worker ignored it
        self.assertGreaterEqual(time.monotonic() - t0, 0.4)  # so SIGKILL came after the grace
        self.assertEqual(pids_with_marker(marker), [])

    def test_sigkill_to_launch_kills_workers_within_a_second(self):
        marker = unique_marker()
        p = self.spawn_sleepers(marker)
        p.kill()
        p.wait(timeout=10)
        gone = wait_until(lambda: pids_with_marker(marker) == [], 1.0)
        self.assertTrue(gone, f"workers survived SIGKILL of launch: {pids_with_marker(marker)}")

    def test_sigusr1_is_forwarded_without_stopping(self):
        marker = unique_marker()
        p = start_launch(["--nproc_per_node", "2", "--", "sh", "-c",
                          "trap 'echo usr1 rank $RANK; exit 0' USR1; echo up; while :; do sleep 0.05; done"],
                         marker)
        self.assertTrue(wait_until(lambda: len(pids_with_marker(marker)) >= 3, 10))
        time.sleep(0.3)
        p.send_signal(signal.SIGUSR1)
        out, err = p.communicate(timeout=20)
        self.assertEqual(p.returncode, 0, err)
        self.assertIn("[rank 0]: usr1 rank 0", out)
        self.assertIn("[rank 1]: usr1 rank 1", out)


class Output(unittest.TestCase):
    def test_heavy_concurrent_output_yields_whole_prefixed_lines(self):
        lines_per_rank = 20000
        prog = ("import os, sys\nr = os.environ['RANK']\nw = sys.stdout.write\n"
                "for i in range(%d):\n    w('rank%%s-line%%d-' %% (r, i) + 'x' * (i %% 300) + '\\n')\n"
                "    if i %% 7 == 0: sys.stdout.flush()\n" % lines_per_rank)
        r = launch("--nproc_per_node", "4", "--", SYSTEM_PYTHON, "-c", prog, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        seen = {str(k): 0 for k in range(4)}
        pat = re.compile(r"^\[rank (\d)\]: rank(\d)-line(\d+)-(x*)$")
        for line in r.stdout.splitlines():
            m = pat.match(line)
            self.assertIsNotNone(m, f"torn or interleaved line: {line[:120]!r}")
            self.assertEqual(m.group(1), m.group(2))
            self.assertEqual(len(m.group(4)), int(m.group(3)) % 300)
            self.assertEqual(int(m.group(3)), seen[m.group(1)], "lines of one rank out of order")
            seen[m.group(1)] += 1
        self.assertEqual(set(seen.values()), {lines_per_rank})

    def test_log_dir_layout_redirects_and_filter(self):
        d = tmpdir()
        r = launch("--nproc_per_node", "2", "--log_dir", d, "--run_id", "r1", "--redirects", "0:1",
                   "--local_ranks_filter", "0", "--", "sh", "-c", 'echo out$RANK; echo err$RANK >&2')
        self.assertEqual(r.returncode, 0, r.stderr)
        base = os.path.join(d, "r1", "attempt_0")
        read = lambda n: open(os.path.join(base, n)).read()
        self.assertEqual(read("rank_0.stdout"), "out0\n")
        self.assertEqual(read("rank_1.stdout"), "out1\n")
        self.assertEqual(read("rank_1.stderr"), "err1\n")
        self.assertNotIn("out0", r.stdout)           # rank 0's stdout is redirected to the file
        self.assertIn("[rank 0]: err0", r.stderr)    # its stderr still reaches the console
        self.assertNotIn("rank 1", r.stdout + r.stderr.replace("rank_", ""))  # filtered out

    def test_partial_last_line_is_flushed(self):
        r = launch("--nproc_per_node", "1", "--", "printf", "no newline")
        self.assertEqual(r.stdout, "[rank 0]: no newline\n")


class Config(unittest.TestCase):
    def write(self, text):
        d = tmpdir()
        path = os.path.join(d, "job.yaml")
        with open(path, "w") as f:
            f.write(text)
        return path

    def assert_config_error(self, text, expected, *flags):
        path = self.write(text)
        marker = unique_marker()
        r = launch(*flags, path, "--", "sh", "-c", "touch /tmp/should-not-exist-" + marker)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn(expected.replace("FILE", path), r.stderr)
        self.assertFalse(os.path.exists("/tmp/should-not-exist-" + marker), "a worker was started")

    def test_unknown_key_with_suggestion(self):
        self.assert_config_error("num_processes: 2\nnprocs: 2\n",
                                 "FILE:2: unknown key 'nprocs' (did you mean 'nproc_per_node'?)")

    def test_wrong_type(self):
        self.assert_config_error("max_restarts: lots\n", "FILE:1: max_restarts: expected an integer, got 'lots'")

    def test_out_of_range(self):
        self.assert_config_error("main_process_port: 99999\n",
                                 "FILE:1: main_process_port: port 99999 is out of range 0..65535")

    def test_train_enum_typo(self):
        self.assert_config_error("train:\n  parallel:\n    mode: dpp\n",
                                 "FILE:3: train.parallel.mode: 'dpp' is not one of none, dp, "
                                 "ddp, pipeline, zero (did you mean 'ddp'?)")

    def test_yaml_syntax_error(self):
        self.assert_config_error("num_processes: [2\n", "FILE:")

    def test_bad_flag_values(self):
        self.assert_config_error("{}\n", "--nproc_per_node: expected a number from 1 to 4096", "--nproc_per_node", "0")
        r = launch("--max_restarts", "-1", "--", "true")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--max_restarts: expected a value >= 0", r.stderr)

    def test_bad_input_is_refused_with_its_key_never_a_crash(self):
        # Each case exits 2 naming what is wrong, under a memory limit that an unbounded
        # allocation would hit (the review's bad-input table; std::bad_alloc aborted with 134).
        def refused(args, expected, text=None):
            if text is not None:
                args = [*args, self.write(text)]
            r = run(["prlimit", "--as=%d" % (2 << 30), LAUNCH, *args, "--", "true"], timeout=60)
            self.assertEqual(r.returncode, 2, (args, r.stderr))
            self.assertIn(expected, r.stderr)
            self.assertNotIn("terminate called", r.stderr)

        refused(["--print_config", "--num_processes", "2000000000"],
                "num_processes 2000000000 over 1 machine(s) is 2000000000 workers per machine, "
                "more than 4096")
        refused([], "num_processes 2000000000 over 2 machine(s)",
                "num_processes: 2000000000\nnum_machines: 2\n")
        d = tmpdir()
        refused(["--config_file", d], "is a directory")
        refused(["--config_file", "/dev/zero"], "'/dev/zero' is not a regular file")
        fifo = os.path.join(d, "job.yaml")
        os.mkfifo(fifo)  # no writer: refused at once, not waited on
        refused([fifo], "is not a regular file")
        refused([], ":2: num_processes is given twice (first at line 1)",
                "num_processes: 1\nnum_processes: 3\n")
        refused([], ":4: train.optimizer.lr is given twice (first at line 3)",
                "train:\n  optimizer:\n    lr: 0.1\n    lr: 0.2\n")
        # What only the rendezvous would have refused, named at load time on any node.
        refused(["--run_id", "x" * 2000], "run_id must be printable text of at most 1024 bytes")
        refused(["--nnodes", "2", "--rdzv_conf", "heartbeat_timeout=0.001"],
                "rdzv_conf.heartbeat_timeout is 0.001 s; the rendezvous needs at least 0.05 s")
        refused(["--nproc_per_node"], "--nproc_per_node needs a value")

    def test_missing_config_file(self):
        r = launch("/nonexistent/job.yaml")
        self.assertEqual(r.returncode, 2)
        self.assertIn("/nonexistent/job.yaml: cannot open the config file", r.stderr)

    def test_print_config_shows_origins_and_precedence(self):
        path = self.write("num_processes: 2\nmax_restarts: 1\nrole: fromyaml\n")
        r = launch("--print_config", "--max_restarts", "3", path, env={"LAUNCH_ROLE": "fromenv"})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRegex(r.stdout, r"max_restarts: 3\s+# flag --max_restarts")
        self.assertRegex(r.stdout, r"role: fromenv\s+# environment LAUNCH_ROLE")
        self.assertRegex(r.stdout, r"num_processes: 2\s+# " + re.escape(path) + ":1")
        self.assertRegex(r.stdout, r"stop_grace: 30\s+# default")

    def test_config_without_train_needs_a_program(self):
        path = self.write("num_processes: 2\n")
        r = launch(path)
        self.assertEqual(r.returncode, 2)
        self.assertIn("has no `train:` section", r.stderr)


class Ports(unittest.TestCase):
    def test_free_port_is_picked_and_differs_between_jobs(self):
        ports = set()
        for _ in range(3):
            r = launch("--nproc_per_node", "1", "--", "sh", "-c", "echo port=$MASTER_PORT")
            m = re.search(r"port=(\d+)", r.stdout)
            ports.add(int(m.group(1)))
            s = socket.socket()
            s.bind(("127.0.0.1", int(m.group(1))))  # free again after the job
            s.close()
        self.assertGreaterEqual(len(ports), 2)

    def test_explicit_port_is_used(self):
        r = launch("--nproc_per_node", "1", "--master_port", "29533", "--", "sh", "-c", "echo port=$MASTER_PORT")
        self.assertIn("port=29533", r.stdout)


if __name__ == "__main__":
    unittest.main()
