"""Network outages between two "hosts" during a 2-node `train` job: node 0 (which hosts the
rendezvous) in this network namespace, node 1 in another, joined by a veth pair that the test
cuts and restores (tests/rendezvous/netns.py). Gradients cross that link too (Gloo, no shared
memory). heartbeat_timeout is 2 s to keep the tests short.

  * An outage of 0.8 x heartbeat_timeout costs nothing: no node is lost, no restart, and the
    parameters are bit-identical to an undisturbed run's.
  * An outage of 2 x heartbeat_timeout costs exactly one restart: both sides lose each other,
    node 1's agent joins again by itself as machine_rank 1 once the link is back, and the job
    resumes from its last checkpoint to the same bit-identical end."""

import os
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "trainer"))
import harness  # noqa: E402
import netns  # noqa: E402
from trainer_helpers import final, metrics, write_config  # noqa: E402

HEARTBEAT_S = 2.0
STEPS = 500
CUT_AT_STEP = 60
JOB = """
train:
  seed: 7
  output_dir: {out}
  model: {{type: mlp, layers: [16, 32, 4]}}
  data: {{type: synthetic, samples: 4000}}
  batch_size: 16
  max_steps: {steps}
  optimizer: {{type: adamw, lr: 2.0e-3}}
  scheduler: {{type: cosine, warmup_steps: 10}}
  parallel: {{mode: ddp}}
  checkpoint_every: 20
  log_every: 100
"""
# Gradients over the link (Gloo), never through shared memory: both "hosts" share /dev/shm.
# One thread per worker, as in the reference run.
JOB_ENV = {"LAUNCH_SHM_ALLREDUCE": "0", "OMP_NUM_THREADS": "1"}


def last_step(out):
    try:
        m = metrics(out)
    except (OSError, ValueError):
        return 0
    return m[-1]["step"] if m else 0


@unittest.skipUnless(os.path.exists(harness.TRAIN) and os.path.exists(harness.LAUNCH),
                     harness.needs_setup("train/launch not built"))
class OutageTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = harness.tmpdir()
        # The undisturbed reference: the same two ranks on one node.
        out = os.path.join(cls.tmp, "reference")
        cfg = write_config(cls.tmp, JOB.format(out=out, steps=STEPS), "ref.yaml")
        r = harness.launch("--nproc_per_node", "2", cfg, timeout=300, env=JOB_ENV)
        assert r.returncode == 0, r.stdout + r.stderr
        cls.reference = final(out)

    def setUp(self):
        self.link = netns.make_netns(self, "o")
        self.marker = harness.unique_marker("outage")
        self.agents = []
        self.addCleanup(self.stop_agents)

    def stop_agents(self):
        for a, log in self.agents:
            if a.poll() is None:
                a.kill()
                a.wait()
            log.close()
        gone = harness.wait_until(lambda: not harness.pids_with_marker(self.marker), 15)
        self.assertTrue(gone, f"processes of the job outlived it: "
                              f"{harness.pids_with_marker(self.marker)}")

    def start_job(self, name, cfg):
        port = harness.free_port()
        for rank, (dev, prefix) in enumerate(
                [(self.link.host_dev, []), (self.link.peer_dev, ["ip", "netns", "exec",
                                                                 self.link.ns])]):
            env = dict(os.environ, LAUNCH_TEST_MARKER=self.marker, GLOO_SOCKET_IFNAME=dev,
                       **JOB_ENV)
            log = open(os.path.join(self.tmp, f"{name}-node{rank}.log"), "w")
            args = [*prefix, harness.LAUNCH, "--nnodes", "2", "--node_rank", str(rank),
                    "--nproc_per_node", "1", "--rdzv_endpoint", f"{self.link.host}:{port}",
                    "--max_restarts", "3", "--rdzv_conf",
                    f"heartbeat_timeout={HEARTBEAT_S:g},join_timeout=60", cfg]
            self.agents.append((subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                                 env=env), log))

    def logs(self, name):
        text = ""
        for rank in range(2):
            with open(os.path.join(self.tmp, f"{name}-node{rank}.log")) as f:
                text += f"--- node {rank}\n{f.read()}"
        return text

    def run_with_outage(self, name, kind, outage_s):
        """The 2-node job with one outage of `outage_s` from step CUT_AT_STEP on; returns
        (exit codes, both logs, the outage's last step before it)."""
        out = os.path.join(self.tmp, name)
        cfg = write_config(self.tmp, JOB.format(out=out, steps=STEPS), f"{name}.yaml")
        self.start_job(name, cfg)
        ok = harness.wait_until(lambda: last_step(out) >= CUT_AT_STEP, 120, 0.02)
        self.assertTrue(ok, f"no progress to step {CUT_AT_STEP}:\n{self.logs(name)}")
        self.link.cut(kind)
        cut_step = last_step(out)
        time.sleep(outage_s)
        self.link.restore()
        deadline = time.monotonic() + 180
        codes = []
        for a, _ in self.agents:
            try:
                codes.append(a.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        log = self.logs(name)
        self.assertEqual(codes, [0, 0], log)
        self.assertLess(cut_step, STEPS - 50, "the job ended before the outage did:\n" + log)
        got = final(out)
        self.assertEqual(got["param_checksum"], self.reference["param_checksum"], log)
        self.assertEqual(got["eval_loss"], self.reference["eval_loss"], log)
        steps = [m["step"] for m in metrics(out)]
        self.assertEqual(steps, list(range(1, STEPS + 1)), "a step missing or counted twice")
        return log, got

    def test_outage_below_the_heartbeat_timeout_costs_no_restart(self):
        kind = "blackhole" if self.link.can_blackhole() else "down"
        log, got = self.run_with_outage("short", kind, 0.8 * HEARTBEAT_S)
        self.assertNotIn("lost", log)
        self.assertNotIn("restarting every node", log)
        self.assertNotIn("round 1", log)
        self.assertEqual(got["steps_this_run"], STEPS, log)

    def test_outage_of_twice_the_heartbeat_timeout_costs_one_restart(self):
        log, got = self.run_with_outage("long", "down", 2 * HEARTBEAT_S)
        self.assertIn("lost node 1", log)
        self.assertIn("joining again as machine_rank 1", log)
        # One restart: round 1 on both nodes, no round 2.
        self.assertIn("round 1: node 0 of 2", log)
        self.assertIn("round 1: node 1 of 2", log)
        self.assertNotIn("round 2:", log)
        self.assertLess(got["steps_this_run"], STEPS, "the restart did not resume:\n" + log)


class UnreachableServerTest(unittest.TestCase):
    def test_a_server_that_never_answers_is_named_so_at_join_timeout(self):
        # Node 1 dials node 0's address through a blackhole: SYNs vanish, nothing refuses. The
        # failure says that nothing answered (not "Operation canceled", the connect timer's own
        # cancellation) and the last attempt ends at join_timeout, not a handshake later.
        link = netns.make_netns(self, "u")
        if not link.can_blackhole():
            self.skipTest(harness.env_dependent("no blackhole qdisc on this kernel"))
        link.cut("blackhole")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LAUNCH_", "PET_"))}
        r = subprocess.run(["ip", "netns", "exec", link.ns, harness.LAUNCH, "--nnodes", "2",
                            "--node_rank", "1", "--nproc_per_node", "1", "--rdzv_endpoint",
                            f"{link.host}:{harness.free_port()}", "--rdzv_conf",
                            "join_timeout=3", "--", "true"],
                           capture_output=True, text=True, timeout=60, env=env)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn(f"cannot reach the rendezvous server at {link.host}:", r.stderr)
        self.assertIn("within 3 s (join_timeout): no answer to the connection attempt",
                      r.stderr)
        self.assertNotIn("canceled", r.stderr)


if __name__ == "__main__":
    unittest.main()
