"""launch under a real SLURM (slurmctld + two slurmd on localhost): srun on one node, the
sbatch templates, signals from scancel reaching the workers, and two nodes when this launch
supports several machines. Skips only when the SLURM daemons are not installed."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))

import harness  # noqa: E402
import slurm_cluster  # noqa: E402

# Prints the worker contract variables on one line per worker.
PRINT_ENV = ("import os; print('ENV', ' '.join(k + '=' + os.environ.get(k, '-') for k in "
             "('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', "
             "'GROUP_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')), flush=True)")
QUICKSTART = os.path.join(harness.REPO, "configs", "quickstart.yaml")


def parse_env_lines(text):
    rows = []
    for line in text.splitlines():
        if "ENV " not in line:
            continue
        fields = line.split("ENV ", 1)[1].split()
        rows.append(dict(f.split("=", 1) for f in fields))
    return rows


def multi_node_support():
    """None when two launches on localhost can form a 2-machine job, else why not."""
    port = slurm_cluster._free_ports(1)[0]
    common = ["--nnodes", "2", "--nproc_per_node", "1", "--main_process_ip", "127.0.0.1",
              "--main_process_port", str(port), "--join_timeout", "20"]
    procs = [subprocess.Popen([harness.LAUNCH, *common, "--machine_rank", str(r), "--",
                               harness.SYSTEM_PYTHON, "-c", "print('ok')"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL) for r in (0, 1)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=60))
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate())
    if all(p.returncode == 0 for p in procs):
        return None
    err = next((o[1] for p, o in zip(procs, outs) if p.returncode != 0), "")
    return (err.strip().splitlines() or ["exit codes %s" % [p.returncode for p in procs]])[-1]


class SlurmTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        missing = slurm_cluster.missing_programs()
        if missing:
            raise unittest.SkipTest(harness.needs_setup(
                "SLURM is not installed (missing: %s; slurmctld slurmd slurm-client munge)"
                % ", ".join(missing)))
        if not os.path.exists(harness.LAUNCH):
            raise unittest.SkipTest(harness.needs_setup(f"{harness.LAUNCH} is not built"))
        cls.cluster = slurm_cluster.LocalSlurm()
        try:
            cls.cluster.start()
        except Exception:
            cls.cluster.stop()
            raise
        # Made-up node names do not resolve: then say where the head node is ourselves.
        cls.extra_env = {} if cls.cluster.names_resolve else {
            "LAUNCH_MAIN_PROCESS_IP": "127.0.0.1"}
        cls.dir = harness.tmpdir()

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def srun(self, *args, timeout=120, env=None):
        e = dict(self.extra_env)
        if env:
            e.update(env)
        return self.cluster.run(["srun", *args], timeout=timeout, env=e)

    def check(self, r):
        self.assertEqual(r.returncode, 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}\n"
                         + self.cluster.logs())

    def test_launch_reads_slurm_for_machines_rank_and_head_node(self):
        node = self.cluster.nodes[0]
        r = self.srun("-N1", "-w", node, "--ntasks-per-node=1", harness.LAUNCH, "--print_config")
        self.check(r)
        out = r.stdout
        self.assertRegex(out, r"num_machines: 1\s+# environment SLURM_STEP_NUM_TASKS")
        self.assertRegex(out, r"machine_rank: 0\s+# environment SLURM_PROCID")
        if self.cluster.names_resolve:
            self.assertRegex(out, rf"main_process_ip: {node}\s+# environment SLURM_STEP_NODELIST")
        # One job, one run id (two jobs on a shared head node never join each other).
        self.assertRegex(out, r"run_id: slurm-\d+\s+# environment SLURM_JOB_ID")
        # No process count and no GPUs through GRES: the GPUs the node shows, else its CPUs
        # (not one worker per CPU of a GPU node allocated without --gres).
        self.assertRegex(out, r"nproc_per_node: auto\s+# derived \(SLURM allocated no GPUs")
        r = self.srun("-N1", "-w", node, "--ntasks-per-node=1", "--cpus-per-task=2",
                      harness.LAUNCH, "--cpu", "--print_config")
        self.check(r)
        self.assertRegex(r.stdout, r"nproc_per_node: 2\s+# environment SLURM_CPUS_ON_NODE")

    def test_flags_win_over_slurm(self):
        r = self.srun("-N1", "--ntasks-per-node=1", harness.LAUNCH, "--machine_rank", "0",
                      "--main_process_ip", "127.0.0.1", "--nproc_per_node", "2",
                      "--print_config")
        self.check(r)
        self.assertRegex(r.stdout, r"machine_rank: 0\s+# flag --machine_rank")
        self.assertRegex(r.stdout, r"main_process_ip: 127.0.0.1\s+# flag --main_process_ip")
        self.assertRegex(r.stdout, r"nproc_per_node: 2\s+# flag --nproc_per_node")

    def test_srun_one_node_two_workers(self):
        if os.path.exists(QUICKSTART) and os.path.exists(harness.TRAIN):
            # The README's job, briefly: srun's part is the start, not the 3 epochs (the whole
            # job is test_lifecycle's).
            out = os.path.join(self.dir, "quickstart")
            r = self.srun("-N1", "--ntasks-per-node=1", harness.LAUNCH, "--num_processes", "2",
                          QUICKSTART, "--", "--max_steps", "30", "--output_dir", out,
                          timeout=600)
            self.check(r)
            with open(os.path.join(out, "final.json")) as f:
                done = json.load(f)
            self.assertEqual((done["steps"], done["world_size"]), (30, 2), done)
            return
        # Without the trainer: the same command shape with a program that prints its contract.
        r = self.srun("-N1", "--ntasks-per-node=1", harness.LAUNCH, "--num_processes", "2", "--",
                      harness.SYSTEM_PYTHON, "-c", PRINT_ENV)
        self.check(r)
        rows = parse_env_lines(r.stdout)
        self.assertEqual(sorted(row["RANK"] for row in rows), ["0", "1"], r.stdout)
        for row in rows:
            self.assertEqual(row["WORLD_SIZE"], "2")
            self.assertEqual(row["LOCAL_WORLD_SIZE"], "2")
            self.assertEqual(row["GROUP_RANK"], "0")
            self.assertEqual(row["GROUP_WORLD_SIZE"], "1")

    def test_sbatch_one_node_template(self):
        out = os.path.join(self.dir, "one.out")
        r = self.cluster.run(
            ["sbatch", "--wait", "--cpus-per-task=1", "--time=5", "-o", out,
             os.path.join(harness.REPO, "scripts/slurm/one_node.sbatch"),
             "--nproc_per_node", "2", "--", harness.SYSTEM_PYTHON, "-c", PRINT_ENV],
            env={"LAUNCH": harness.LAUNCH, **self.extra_env}, timeout=120)
        with open(out) as f:
            text = f.read()
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr + text)
        rows = parse_env_lines(text)
        self.assertEqual(sorted(row["RANK"] for row in rows), ["0", "1"], text)

    def test_batch_script_without_srun_uses_one_node_and_warns(self):
        out = os.path.join(self.dir, "batch.out")
        r = self.cluster.run(["sbatch", "--wait", "-N2", "--time=5", "-o", out, "--wrap",
                              f"{harness.LAUNCH} --print_config"], timeout=120)
        with open(out) as f:
            text = f.read()
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr + text)
        self.assertIn("2-node SLURM job without srun", text)
        self.assertRegex(text, r"num_machines: 1\s+# default")

    def scancel_reaches_workers(self, signame, scancel_args):
        """Workers that record `signame` in a file; scancel with `scancel_args` must reach both.
        SLURM signals every process of the step (proctrack), and launch forwards what it gets
        too, so a worker may see the signal twice (a Python worker that exits on the first copy
        can be killed by the second while it shuts down, when default handlers are back); this
        checks that it arrives at all."""
        marker = os.path.join(self.dir, signame.lower())
        program = ("import os, signal, sys, time\n"
                   "def on(s, f):\n"
                   # A second copy may follow (see above); it must not kill us while exiting.
                   "    signal.signal(s, signal.SIG_IGN)\n"
                   f"    open('{marker}.' + os.environ['RANK'], 'w').write('got')\n"
                   "    sys.exit(0)\n"
                   f"signal.signal(signal.{signame}, on)\n"
                   "print('ready', os.environ['RANK'], flush=True)\n"
                   "time.sleep(60)\n")
        name = harness.unique_marker("slurmsig")
        env = dict(self.cluster.env)
        env.update(self.extra_env)
        p = subprocess.Popen(["srun", "-J", name, "-N1", "--ntasks-per-node=1", harness.LAUNCH,
                              "--nproc_per_node", "2", "--", harness.SYSTEM_PYTHON, "-c",
                              program], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, cwd=harness.REPO)
        try:
            ready = 0
            deadline = time.monotonic() + 60
            lines = []
            while ready < 2 and time.monotonic() < deadline:
                line = p.stdout.readline()
                if not line:
                    break
                lines.append(line)
                ready += "ready" in line
            self.assertEqual(ready, 2, "".join(lines))
            r = self.cluster.run(["scancel", *scancel_args, "--name", name])
            self.assertEqual(r.returncode, 0, r.stderr + self.cluster.logs())
            rest, _ = p.communicate(timeout=60)
            self.assertTrue(os.path.exists(marker + ".0") and os.path.exists(marker + ".1"),
                            "".join(lines) + rest)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()

    def test_scancel_usr1_reaches_the_workers(self):
        # What `#SBATCH --signal=USR1@120` does before the time limit.
        self.scancel_reaches_workers("SIGUSR1", ["--signal=USR1"])

    def test_scancel_sigterm_reaches_the_workers(self):
        # Cancellation and preemption: SIGTERM to the step, SIGKILL after KillWait.
        self.scancel_reaches_workers("SIGTERM", [])

    def test_one_task_per_gpu_layout_runs_one_worker_per_task(self):
        # Lightning's layout (srun --ntasks-per-node=G): G launches on a node, one worker each,
        # LOCAL_RANK = SLURM_LOCALID; not G workers per task.
        why = multi_node_support()
        if why is not None:
            self.skipTest(harness.needs_setup(
                f"this launch cannot run 2 machines on localhost: {why}"))
        for nodes in (1, 2):
            r = self.srun(f"-N{nodes}", "--ntasks-per-node=2", harness.LAUNCH, "--",
                          harness.SYSTEM_PYTHON, "-c", PRINT_ENV, timeout=180)
            self.check(r)
            rows = parse_env_lines(r.stdout)
            world = 2 * nodes
            self.assertEqual(sorted(int(row["RANK"]) for row in rows), list(range(world)), r.stdout)
            for row in rows:
                self.assertEqual(row["WORLD_SIZE"], str(world))
                self.assertEqual(row["LOCAL_WORLD_SIZE"], "2")
                self.assertEqual(row["GROUP_WORLD_SIZE"], str(nodes))
                # Ranks are laid out node by node, as SLURM numbers its tasks.
                self.assertEqual(int(row["LOCAL_RANK"]), int(row["RANK"]) % 2)
                self.assertEqual(int(row["GROUP_RANK"]), int(row["RANK"]) // 2)
        # A per-launch worker count on top of that layout would start G*N workers per node.
        r = self.srun("-N1", "--ntasks-per-node=2", harness.LAUNCH, "--nproc_per_node", "2",
                      "--", "/bin/true", timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("one worker each; nproc_per_node 2", r.stderr)

    def test_usr1_before_the_time_limit_checkpoints_and_requeues(self):
        # The template's recipe: SIGUSR1 to the batch shell (what --signal=B:USR1@120 sends)
        # reaches a worker that handles it, then the job is requeued.
        marker = os.path.join(self.dir, "usr1")
        out = os.path.join(self.dir, "requeue.out")
        program = ("import os, signal, time\n"
                   "def on(s, f):\n"
                   f"    open('{marker}.' + os.environ.get('SLURM_RESTART_COUNT', '0'), 'w').write('ckpt')\n"
                   "signal.signal(signal.SIGUSR1, on)\n"
                   "print('ready', os.environ.get('SLURM_RESTART_COUNT', '0'), flush=True)\n"
                   "time.sleep(120)\n")
        r = self.cluster.run(
            ["sbatch", "--parsable", "--cpus-per-task=1", "--time=5", "-o", out,
             os.path.join(harness.REPO, "scripts/slurm/one_node.sbatch"),
             "--nproc_per_node", "1", "--", harness.SYSTEM_PYTHON, "-c", program],
            env={"LAUNCH": harness.LAUNCH, "FORWARD_USR1": "1", "CHECKPOINT_SECONDS": "2",
                 **self.extra_env}, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        job = r.stdout.strip().split(";")[0]
        try:
            def output():
                if not os.path.exists(out):
                    return ""
                with open(out) as f:
                    return f.read()
            self.assertTrue(harness.wait_until(lambda: "ready 0" in output(), 60, 0.2), output())
            r = self.cluster.run(["scancel", "--batch", "--signal=USR1", job])
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertTrue(harness.wait_until(lambda: os.path.exists(marker + ".0"), 60, 0.2),
                            output())

            def restarts():
                info = self.cluster.run(["scontrol", "show", "job", job]).stdout
                m = re.search(r"Restarts=(\d+)", info)
                return int(m.group(1)) if m else 0
            self.assertTrue(harness.wait_until(lambda: restarts() >= 1, 60, 0.5), output())
            self.assertIn("checkpoint and requeue", output())
        finally:
            self.cluster.run(["scancel", job])

    def test_srun_two_nodes(self):
        why = multi_node_support()
        if why is not None:
            self.skipTest(harness.needs_setup(
                f"this launch cannot run 2 machines on localhost: {why}"))
        port = str(slurm_cluster._free_ports(1)[0])
        r = self.srun("-N2", "--ntasks-per-node=1", harness.LAUNCH, "--nproc_per_node", "2",
                      "--", harness.SYSTEM_PYTHON, "-c", PRINT_ENV,
                      env={"LAUNCH_MAIN_PROCESS_PORT": port}, timeout=180)
        self.check(r)
        rows = parse_env_lines(r.stdout)
        self.assertEqual(sorted(int(row["RANK"]) for row in rows), [0, 1, 2, 3], r.stdout)
        for row in rows:
            self.assertEqual(row["WORLD_SIZE"], "4")
            self.assertEqual(row["GROUP_WORLD_SIZE"], "2")
        self.assertEqual(sorted(row["GROUP_RANK"] for row in rows), ["0", "0", "1", "1"])

    def test_sbatch_multi_node_template(self):
        why = multi_node_support()
        if why is not None:
            self.skipTest(harness.needs_setup(
                f"this launch cannot run 2 machines on localhost: {why}"))
        out = os.path.join(self.dir, "multi.out")
        r = self.cluster.run(
            ["sbatch", "--wait", "--cpus-per-task=1", "--time=5", "-o", out,
             os.path.join(harness.REPO, "scripts/slurm/multi_node.sbatch"),
             "--nproc_per_node", "1", "--", harness.SYSTEM_PYTHON, "-c", PRINT_ENV],
            env={"LAUNCH": harness.LAUNCH, **self.extra_env}, timeout=180)
        with open(out) as f:
            text = f.read()
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr + text)
        rows = parse_env_lines(text)
        self.assertEqual(sorted(row["RANK"] for row in rows), ["0", "1"], text)


if __name__ == "__main__":
    unittest.main()
