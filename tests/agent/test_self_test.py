"""`launch test`: the distributed self-check, passing on 2 and 3 processes and failing with the
failing check named when the store port is taken."""

import os
import socket
import unittest

import harness
from harness import TRAIN, launch


@unittest.skipUnless(os.path.exists(TRAIN),
                     harness.needs_setup("the trainer is not built (LAUNCH_BUILD_TRAINER=OFF)"))
class LaunchTest(unittest.TestCase):
    def test_passes_on_two_processes_by_default(self):
        r = launch("test", "--nproc_per_node", "1", timeout=180)  # raised to 2: a check needs peers
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        for check in ("all-reduce (sum of ranks)", "all-reduce (4 MB)", "broadcast from rank 0",
                      "all-gather of ranks", "barrier", "DDP step == one process"):
            self.assertRegex(r.stdout, r"\[rank 0\]: \[self-test\] check \d/7 " + check.replace("(", r"\(")
                             .replace(")", r"\)") + r" +ok")
        self.assertIn("launch test: PASSED (2 process(es) on this machine)", r.stdout)

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
        self.assertIn("check 1/7 process group (gloo): FAILED on rank 0", r.stderr)
        self.assertIn(f"127.0.0.1:{port} (is the port in use?)", r.stderr)
        self.assertIn("launch test: FAILED", r.stdout)

    def test_refuses_a_program(self):
        r = launch("test", "--", "/bin/true")
        self.assertEqual(r.returncode, 2)
        self.assertIn("`launch test` runs its own check", r.stderr)


if __name__ == "__main__":
    unittest.main()
