"""`launch test`: the distributed self-check, passing on 2 and 3 processes, naming the transport
each collective ran on (shared memory and Gloo), and failing with the failing check named when the
store port is taken."""

import os
import re
import socket
import unittest

import harness
from harness import TRAIN, launch


@unittest.skipUnless(os.path.exists(TRAIN),
                     harness.needs_setup("the trainer is not built (LAUNCH_BUILD_TRAINER=OFF)"))
class LaunchTest(unittest.TestCase):
    def assertCheckOk(self, stdout, check):
        self.assertRegex(stdout, r"\[rank 0\]: \[self-test\] check \d/9 " + re.escape(check) + r" +ok")

    def test_passes_on_two_processes_by_default(self):
        r = launch("test", "--nproc_per_node", "1", timeout=180)  # raised to 2: a check needs peers
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        # On one host the job's all-reduces and broadcasts take shared memory; Gloo is exercised
        # too, and each check says which one it ran on.
        self.assertIn("[self-test] all-reduces and broadcasts go through shared memory", r.stdout)
        for check in ("all-reduce, sum of ranks (shared memory)", "all-reduce, 4 MB (shared memory)",
                      "all-reduce, 4 MB (Gloo)", "broadcast from rank 0 (shared memory)",
                      "broadcast from rank 0 (Gloo)", "all-gather of ranks (Gloo)", "barrier (Gloo)",
                      "DDP step == one process (shared memory)"):
            self.assertCheckOk(r.stdout, check)
        self.assertIn("launch test: PASSED (2 process(es) on this machine)", r.stdout)

    def test_names_gloo_when_shared_memory_is_off(self):
        r = launch("test", timeout=180, env={"LAUNCH_SHM_ALLREDUCE": "0"})
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("[self-test] all-reduces and broadcasts go through Gloo", r.stdout)
        self.assertNotIn("shared memory)", r.stdout)
        for check in ("all-reduce, sum of ranks (Gloo)", "all-reduce, 4 MB (Gloo)",
                      "DDP step == one process (Gloo)"):
            self.assertCheckOk(r.stdout, check)

    def test_passes_on_three_processes(self):
        r = launch("test", "--nproc_per_node", "3", timeout=180)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("all checks passed on 3 processes", r.stdout)

    def test_names_the_failing_check(self):
        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        try:
            r = launch("test", "--master_port", str(port), "--stop_grace", "1", timeout=180,
                       env={"LAUNCH_INIT_TIMEOUT_S": "10"})
        finally:
            busy.close()
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("check 1/9 process group: FAILED on rank 0", r.stderr)
        self.assertIn(f"127.0.0.1:{port} (is the port in use?)", r.stderr)
        self.assertIn("launch test: FAILED", r.stdout)

    def test_refuses_a_program(self):
        r = launch("test", "--", "/bin/true")
        self.assertEqual(r.returncode, 2)
        self.assertIn("`launch test` runs its own check", r.stderr)


if __name__ == "__main__":
    unittest.main()
