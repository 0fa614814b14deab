"""launch started by a real mpirun (Debian's OpenMPI): each launch picks up its machine rank and
the number of machines from OMPI_COMM_WORLD_*; with several machines it forms one job.
Skips when mpirun is not installed (CI installs openmpi-bin)."""

import os
import re
import shutil
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))

import harness  # noqa: E402
from slurm_test import PRINT_ENV, multi_node_support, parse_env_lines  # noqa: E402
import slurm_cluster  # noqa: E402

MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]


class MpiTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if shutil.which("mpirun") is None:
            raise unittest.SkipTest(harness.needs_setup("mpirun is not installed (openmpi-bin)"))
        if not os.path.exists(harness.LAUNCH):
            raise unittest.SkipTest(harness.needs_setup(f"{harness.LAUNCH} is not built"))

    def mpirun(self, np, *args, timeout=120):
        # Drop variables of an outer job (SLURM, another mpirun) that would change the mapping.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "LAUNCH_"))}
        return subprocess.run([*MPIRUN, "-np", str(np), *args], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=harness.REPO,
                              stdin=subprocess.DEVNULL)

    def test_each_launch_gets_its_rank_and_the_world(self):
        # `launch env` prints the config in effect (the layers the launcher applies, flags aside).
        r = self.mpirun(2, harness.LAUNCH, "env")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(len(re.findall(
            r"num_machines: 2\s+# environment OMPI_COMM_WORLD_SIZE", r.stdout)), 2, r.stdout)
        ranks = sorted(re.findall(
            r"machine_rank: (\d+)\s+# environment OMPI_COMM_WORLD_RANK", r.stdout))
        self.assertEqual(ranks, ["0", "1"], r.stdout)
        # All ranks on this host: the rendezvous is local, no warning about main_process_ip.
        self.assertNotIn("does not say which host runs rank 0", r.stdout)

    def test_single_rank_runs_workers(self):
        r = self.mpirun(1, harness.LAUNCH, "--nproc_per_node", "2", "--",
                        harness.SYSTEM_PYTHON, "-c", PRINT_ENV)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        rows = parse_env_lines(r.stdout)
        self.assertEqual(sorted(row["RANK"] for row in rows), ["0", "1"], r.stdout)
        self.assertTrue(all(row["GROUP_WORLD_SIZE"] == "1" for row in rows), r.stdout)

    def test_two_launches_form_one_job(self):
        why = multi_node_support()
        if why is not None:
            self.skipTest(harness.needs_setup(
                f"this launch cannot run 2 machines on localhost: {why}"))
        port = str(slurm_cluster._free_ports(1)[0])
        r = self.mpirun(2, harness.LAUNCH, "--nproc_per_node", "1", "--main_process_port", port,
                        "--", harness.SYSTEM_PYTHON, "-c", PRINT_ENV, timeout=180)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        rows = parse_env_lines(r.stdout)
        self.assertEqual(sorted(row["RANK"] for row in rows), ["0", "1"], r.stdout)
        for row in rows:
            self.assertEqual(row["WORLD_SIZE"], "2")
            self.assertEqual(row["GROUP_WORLD_SIZE"], "2")
        self.assertEqual(sorted(row["GROUP_RANK"] for row in rows), ["0", "1"])


if __name__ == "__main__":
    unittest.main()
