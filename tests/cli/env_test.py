"""`launch env`: the bug-report summary names the version, LibTorch, BLAS, CPU, GPUs and the
config in effect with where it came from, hides secrets, and never fails on a bad config."""

import os
import re
import shutil
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))

import harness  # noqa: E402
from cli_common import cli_command  # noqa: E402


def project_version():
    with open(os.path.join(harness.REPO, "CMakeLists.txt")) as f:
        return re.search(r"project\(launch VERSION ([0-9.]+)", f.read()).group(1)


class EnvReportTest(unittest.TestCase):
    def setUp(self):
        self.env_cmd = cli_command("env")
        self.config_cmd = cli_command("config")
        if self.env_cmd is None:
            self.skipTest(harness.needs_setup(
                "neither build/bin/launch (with `env`) nor launch-cli-driver is built"))
        self.dir = harness.tmpdir()
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SLURM_", "OMPI_", "PMI_", "LAUNCH_", "PET_"))}
        self.env.update({"XDG_CONFIG_HOME": os.path.join(self.dir, "xdg"), "HOME": self.dir})

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def report(self, *args, env=None):
        e = dict(self.env)
        if env:
            e.update(env)
        start = time.monotonic()
        r = subprocess.run([*self.env_cmd, *args], capture_output=True, text=True, timeout=60,
                           env=e, stdin=subprocess.DEVNULL)
        self.elapsed = time.monotonic() - start
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return r.stdout

    def test_report_names_every_component(self):
        out = self.report()
        self.assertRegex(out, r"launch:\s+" + re.escape(project_version()) + " ")
        self.assertRegex(out, r"system:\s+Linux ")
        self.assertRegex(out, r"LibTorch:\s+")
        if os.path.exists("/usr/include/torch/csrc/api/include/torch/version.h"):
            self.assertRegex(out, r"LibTorch:\s+\d+\.\d+")
            self.assertRegex(out, r"backends:\s+Gloo yes")
        self.assertRegex(out, r"BLAS:\s+")
        if "openblas" in os.path.realpath("/usr/lib/x86_64-linux-gnu/libblas.so.3"):
            self.assertRegex(out, r"BLAS:\s+OpenBLAS")
        with open("/proc/cpuinfo") as f:
            model = re.search(r"model name\s*:\s*(.*)", f.read())
        if model:
            self.assertIn(model.group(1).strip(), out)
        self.assertRegex(out, r"cores:\s+%d online, %d usable" % (os.cpu_count(),
                                                                   len(os.sched_getaffinity(0))))
        self.assertRegex(out, r"GPUs:\s+")
        self.assertRegex(out, r"config file:\s+none")
        self.assertIn("# effective configuration (no config file)", out)
        # Bounded, not timed: the workers' Python imports torch (seconds on a loaded machine).
        self.assertLess(self.elapsed, 30.0)

    def test_default_config_file_is_reported_with_origins(self):
        if self.config_cmd is None:
            self.skipTest(harness.needs_setup("no `launch config`"))
        r = subprocess.run([*self.config_cmd, "default"], capture_output=True, text=True,
                           env=self.env, timeout=30, stdin=subprocess.DEVNULL)
        self.assertEqual(r.returncode, 0, r.stderr)
        path = os.path.join(self.dir, "xdg", "launch", "default_config.yaml")
        out = self.report(env={"LAUNCH_MAX_RESTARTS": "3", "LAUNCH_RDZV_TOKEN": "hunter2secret"})
        self.assertIn(f"config file:       {path} (launch's default config file)", out)
        self.assertRegex(out, r"max_restarts: 3\s+# environment LAUNCH_MAX_RESTARTS")
        self.assertRegex(out, r"distributed_type: MULTI_(CPU|GPU)\s+# " + re.escape(path))
        self.assertIn("LAUNCH_RDZV_TOKEN=(set, hidden)", out)
        self.assertNotIn("hunter2secret", out)

    def test_accelerates_config_under_hf_home_is_the_one_in_use(self):
        # What `accelerate config` writes for a CPU machine: launch runs with it, and says so.
        hf = os.path.join(self.dir, "hf")
        os.makedirs(os.path.join(hf, "accelerate"))
        path = os.path.join(hf, "accelerate", "default_config.yaml")
        with open(path, "w") as f:
            f.write("compute_environment: LOCAL_MACHINE\ndebug: false\n"
                    "distributed_type: MULTI_CPU\ndowncast_bf16: 'no'\n"
                    "enable_cpu_affinity: false\nipex_config:\n  ipex: false\nmachine_rank: 0\n"
                    "main_training_function: main\nmixed_precision: bf16\nmpirun_config: {}\n"
                    "num_machines: 1\nnum_processes: 2\nrdzv_backend: static\n"
                    "same_network: true\ntpu_env: []\ntpu_use_cluster: false\n"
                    "tpu_use_sudo: false\nuse_cpu: true\n")
        out = self.report(env={"HF_HOME": hf})
        self.assertIn(f"config file:       {path} (accelerate's default config file", out)
        self.assertIn(f"HF_HOME={hf}", out)
        self.assertRegex(out, r"mixed_precision: bf16\s+# " + re.escape(path))
        self.assertNotIn("warning:", out)  # every value is accelerate's default for a CPU

    def test_the_workers_python_and_whether_it_imports_torch(self):
        venv = os.path.join(self.dir, "venv")
        os.makedirs(os.path.join(venv, "bin"))
        os.symlink(harness.SYSTEM_PYTHON, os.path.join(venv, "bin", "python"))
        out = self.report(env={"VIRTUAL_ENV": venv})
        self.assertIn(f"workers' Python:   {venv}/bin/python (environment VIRTUAL_ENV)", out)
        self.assertRegex(out, r"\n  Python 3\.\d+")
        self.assertRegex(out, r"\n  torch \d+\.\d+\S* \(CUDA (yes|no)\)")
        self.assertIn(f"VIRTUAL_ENV={venv}", out)
        # An interpreter without torch says why it cannot import it.
        bare = os.path.join(self.dir, "bare-python")
        with open(bare, "w") as f:
            f.write("#!/bin/sh\nexec %s -S \"$@\"\n" % harness.SYSTEM_PYTHON)
        os.chmod(bare, 0o755)
        out = self.report(env={"PYTHON_EXEC": bare})
        self.assertIn(f"workers' Python:   {bare} (environment PYTHON_EXEC)", out)
        self.assertIn("torch: cannot be imported (ModuleNotFoundError: No module named 'torch')",
                      out)
        if os.path.exists(harness.TRAIN):
            self.assertRegex(out, r"trainer:\s+train %s \(LibTorch \d+\.\d+" %
                             re.escape(project_version()))
            # The LibTorch reported is the one the trainer loaded (`train --version` says).
            version = subprocess.run([harness.TRAIN, "--version"], capture_output=True,
                                     text=True, timeout=60).stdout
            loaded = re.search(r"^LibTorch library: (.+)$", version, re.M)
            self.assertIsNotNone(loaded, version)
            self.assertRegex(out, r"\n  library:\s+" + re.escape(os.path.realpath(loaded.group(1))))

    def test_given_config_and_bad_config(self):
        good = os.path.join(self.dir, "job.yaml")
        with open(good, "w") as f:
            f.write("num_processes: 2\nmixed_precision: bf16\ncompute_environment: LOCAL_MACHINE\n"
                    "downcast_bf16: true\n")
        out = self.report("--config_file", good)
        self.assertIn(f"{good} (given on the command line)", out)
        self.assertRegex(out, r"mixed_precision: bf16\s+# " + re.escape(good) + ":2")
        # Only a setting away from accelerate's default is named (downcast_bf16, a TPU option).
        self.assertIn("warning: these accelerate settings have no effect with launch: "
                      f"downcast_bf16 ({good})", out)
        bad = os.path.join(self.dir, "bad.yaml")
        with open(bad, "w") as f:
            f.write("num_procesess: 2\n")
        out = self.report(bad)
        self.assertIn("the config does not load: " + bad + ":1: unknown key 'num_procesess'", out)

    def test_scheduler_variables_are_shown_and_applied(self):
        out = self.report(env={"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0",
                               "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_NUM_TASKS": "2",
                               "SLURM_PROCID": "1", "NCCL_P2P_DISABLE": "1"})
        self.assertIn("SLURM_JOB_NODELIST=gpu[07-08]", out)
        self.assertIn("NCCL_P2P_DISABLE=1", out)
        self.assertRegex(out, r"main_process_ip: gpu07\s+# environment SLURM_JOB_NODELIST")
        self.assertRegex(out, r"machine_rank: 1\s+# environment SLURM_PROCID")

    def test_gpus_through_nvml(self):
        fake = os.path.join(harness.BIN_DIR, "..", "fake_nvml")
        if not os.path.exists(os.path.join(fake, "libnvidia-ml.so.1")):
            self.skipTest(harness.needs_setup("the fake libnvidia-ml.so.1 is not built"))
        out = self.report(env={"LD_LIBRARY_PATH": os.path.abspath(fake)})
        self.assertRegex(out, r"GPUs:\s+2 NVIDIA GPUs, driver 535.104.05, CUDA 12.2")
        self.assertRegex(out, r"\n  0:\s+NVIDIA H100 80GB HBM3, 81559 MiB \(1450 MiB used\)")
        self.assertRegex(out, r"\n  1:\s+NVIDIA A100-SXM4-40GB, 40960 MiB \(0 MiB used\)")

    def test_usage_errors(self):
        r = subprocess.run([*self.env_cmd, "--bogus"], capture_output=True, text=True,
                           env=self.env, timeout=30)
        self.assertEqual(r.returncode, 2)
        self.assertIn("unknown argument '--bogus'", r.stderr)


if __name__ == "__main__":
    unittest.main()
