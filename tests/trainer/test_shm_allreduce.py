"""The shared-memory all-reduce (trainer_runtime/shm_allreduce.h) under real DDP training: `train`
ranks on one host use it by default (seen in their memory maps: the memfd segment), train
replicas that stay bit-identical across ranks, and end within float tolerance of the same job
over Gloo (LAUNCH_SHM_ALLREDUCE=0; the summation order differs with more than two ranks). A rank
SIGKILLed mid-training makes the survivors fail promptly instead of hanging."""

import os
import signal
import time
import unittest

from trainer_helpers import TRAIN, final, metrics, params, rel_diff, start_ranks, wait_all, \
    write_config
import harness

JOB = """
train:
  seed: 11
  output_dir: {out}
  model: {{type: mlp, layers: [16, 64, 64, 4]}}
  data: {{type: synthetic, samples: 4096}}
  eval_fraction: 0.0
  batch_size: 8
  max_steps: {steps}
  optimizer: {optimizer}
  checkpoint_every: 0
  resume: never
  parallel: {{mode: ddp, bucket_cap_mb: {cap}}}
"""
SEGMENT = "memfd:launch-shm-allreduce"


def maps_have_segment(pid, segment=SEGMENT):
    try:
        with open(f"/proc/{pid}/maps") as f:
            return segment in f.read()
    except OSError:
        return False


def run_watching(cfg, world, extra_env, timeout=120, segment=SEGMENT):
    """Runs `world` ranks to completion; returns (results, ranks seen with `segment` mapped)."""
    procs, _ = start_ranks(cfg, world, ["--dump_params"], extra_env=extra_env)
    seen = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        for r, p in enumerate(procs):
            if r not in seen and maps_have_segment(p.pid, segment):
                seen.add(r)
        time.sleep(0.005)
    results = wait_all(procs, max(1.0, deadline - time.monotonic()))
    for r, (rc, out, err) in enumerate(results):
        if rc != 0:
            raise AssertionError(f"rank {r} exited {rc}\nstdout:\n{out}\nstderr:\n{err}")
    return results, seen


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class ShmAllReduceTrainingTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def train(self, name, world, shm, steps=40, cap=25,
              optimizer="{type: sgd, lr: 0.05, momentum: 0.9}"):
        out = os.path.join(self.tmp, name)
        cfg = write_config(self.tmp, JOB.format(out=out, steps=steps, cap=cap,
                                                optimizer=optimizer), name + ".yaml")
        env = {} if shm else {"LAUNCH_SHM_ALLREDUCE": "0"}
        _, seen = run_watching(cfg, world, env)
        if shm:
            # Every rank mapped the segment (the default when all ranks are local).
            self.assertEqual(seen, set(range(world)), "not every rank used shared memory")
        else:
            self.assertEqual(seen, set(), "LAUNCH_SHM_ALLREDUCE=0 still mapped the segment")
        ranks = [params(out, r) for r in range(world)]
        for r in range(1, world):
            self.assertEqual(ranks[r], ranks[0], f"rank {r}'s replica differs from rank 0's")
        m = metrics(out)
        self.assertEqual(len(m), steps)
        self.assertLess(m[-1]["loss"], m[0]["loss"])
        return ranks[0], final(out)

    def check_transports_agree(self, world, **kw):
        shm, f = self.train(f"shm{world}", world, True, **kw)
        gloo, _ = self.train(f"gloo{world}", world, False, **kw)
        self.assertGreaterEqual(f["buckets"], 1)
        rel, worst = rel_diff(shm, gloo)
        self.assertLess(rel, 1e-5, f"shm vs Gloo: relative difference {rel:g} (max abs {worst:g})")
        return shm, gloo

    def test_two_ranks_many_buckets_match_gloo(self):
        # ~1 KB buckets: several asynchronous shm all-reduces during backward, then the last
        # bucket inline (parallel/ddp.cc). With two ranks a + b == b + a: equal to Gloo bit for bit.
        shm, gloo = self.check_transports_agree(2, cap=0.001)
        self.assertEqual(shm, gloo)

    def test_three_ranks_adam_within_tolerance_of_gloo(self):
        self.check_transports_agree(3, optimizer="{type: adam, lr: 0.003}")

    def test_killed_rank_fails_the_survivor_promptly(self):
        out = os.path.join(self.tmp, "kill")
        cfg = write_config(self.tmp, JOB.format(out=out, steps=100000, cap=0.001,
                                                optimizer="{type: sgd, lr: 0.01}"), "kill.yaml")
        procs, _ = start_ranks(cfg, 2)
        try:
            up = harness.wait_until(lambda: all(maps_have_segment(p.pid) for p in procs)
                                    and os.path.exists(os.path.join(out, "metrics.jsonl")), 60)
            self.assertTrue(up, "training did not start with shared memory")
            time.sleep(0.3)  # well into training: buckets in flight
            procs[1].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            # A collective waits train.collective_timeout (3600 s) for a peer: a prompt exit
            # means the death was noticed, not waited out.
            (rc, _, err), _ = wait_all(procs, 20)
            took = time.monotonic() - killed
            self.assertNotEqual(rc, 0, err)
            self.assertNotIn("killed after timeout", err)
            self.assertLess(took, 10, err)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


if __name__ == "__main__":
    unittest.main()
