"""A resume at another world size (an elastic restart with fewer or more ranks) continues exactly
where the old run stopped: the rest of the interrupted epoch is dealt over the new ranks, every
sample of an epoch is trained on once (up to the documented tail of a resharded epoch, sampler.h),
the run ends after exactly the configured epochs, and a cosine schedule resumes instead of being
refused and keeps decaying to its end. Real `train` processes, stopped by SIGTERM (checkpoint and
stop) and restarted with another world size; LAUNCH_TRACE_SAMPLES records what each rank trained
on."""

import glob
import os
import signal
import unittest

from test_lifecycle import wait_for_step
from trainer_helpers import TRAIN, final, metrics, start_ranks, wait_all, write_config
import harness

SAMPLES = 12500  # eval_fraction 0.04 keeps 12000 for training: whole global batches at W=2, 3
TRAIN_SAMPLES = 12000
BATCH = 10
EPOCHS = 2
LR = 0.05

CONFIG = """
train:
  seed: 5
  output_dir: {out}
  model: {{type: mlp, layers: [16, 64, 4], dropout: 0.1}}
  data: {{type: synthetic, samples: {samples}}}
  eval_fraction: 0.04
  batch_size: {batch}
  epochs: {epochs}
  optimizer: {{type: sgd, lr: {lr}}}
  scheduler: {{type: cosine}}
  checkpoint_every: 0
  log_every: 1000
{extra}
"""


def read_trace(prefix):
    """[(rank, step, epoch, [(position, index), ...])] from every rank's trace file."""
    rows = []
    for path in sorted(glob.glob(prefix + ".rank*")):
        rank = int(path.rsplit("rank", 1)[1])
        with open(path) as f:
            for line in f:
                parts = line.split()
                pairs = [tuple(int(v) for v in p.split(":")) for p in parts[2:]]
                rows.append((rank, int(parts[0]), int(parts[1]), pairs))
    return rows


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class WorldSizeChangeTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()
        self.out = os.path.join(self.tmp, "out")
        self.trace = os.path.join(self.tmp, "trace")

    def run_segment(self, cfg, world, restart, stop_after=None, args=()):
        """Runs `world` ranks; with `stop_after`, SIGTERMs rank 0 once metrics.jsonl passes that
        step (train checkpoints and exits 143). Returns (results, steps before, steps after)."""
        before = metrics(self.out)[-1]["step"] if os.path.exists(
            os.path.join(self.out, "metrics.jsonl")) else 0
        procs, _ = start_ranks(cfg, world, args, restart=restart,
                               extra_env={"LAUNCH_TRACE_SAMPLES": self.trace})
        if stop_after is not None:
            reached = wait_for_step(self.out, before + stop_after, timeout=90)
            self.assertGreaterEqual(reached, before + stop_after)
            procs[0].send_signal(signal.SIGTERM)
        results = wait_all(procs, timeout=120)
        want = 0 if stop_after is None else 143
        for r, (rc, out, err) in enumerate(results):
            self.assertEqual(rc, want, f"rank {r} of {world}\nstdout:\n{out}\nstderr:\n{err}")
            self.assertNotIn("other settings", out + err)
            self.assertNotIn("warning", out + err)
        return results, before, metrics(self.out)[-1]["step"]

    def check_change(self, extra):
        cfg = write_config(self.tmp, CONFIG.format(out=self.out, samples=SAMPLES, batch=BATCH,
                                                   epochs=EPOCHS, lr=LR, extra=extra))
        # 3 ranks: 400 batches an epoch each; stopped early in epoch 0.
        first, _, s1 = self.run_segment(cfg, 3, restart=0, stop_after=20)
        self.assertLess(s1, 400, "the 3-rank run left epoch 0 before the stop")
        # 2 ranks: the rest of epoch 0 (from 30 * s1) over 2 ranks; stopped again in it.
        second, _, s2 = self.run_segment(cfg, 2, restart=1, stop_after=20)
        log2 = second[0][1]
        self.assertIn(f"written by 3 data-parallel ranks after {30 * s1} of epoch 0's "
                      f"{TRAIN_SAMPLES} samples", log2)
        self.assertIn("dealt over 2 ranks", log2)
        self.assertIn("the global batch is 20 (2 x 10); the run began with 30 (3 x 10): "
                      "train.batch_size 15 keeps it", log2)
        # 3 ranks again, to the end.
        third, _, s3 = self.run_segment(cfg, 3, restart=2)
        log3 = third[0][1]
        self.assertIn("dealt over 3 ranks", log3)

        # Every sample of each epoch once: no position and no index twice within an epoch,
        # and the positions are the epoch's first ones: all of them in an epoch that no world
        # change cut, all but the documented tail of fewer than W'*B in one that was.
        rows = read_trace(self.trace)
        self.assertEqual(sorted({e for _, _, e, _ in rows}), list(range(EPOCHS)),
                         "the run did not train exactly the configured epochs")
        segments = [(0, s1, 3), (s1, s2, 2), (s2, s3, 3)]  # (after step, to step, world)
        for epoch in range(EPOCHS):
            seen = [(pos, idx, step) for _, step, e, pairs in rows if e == epoch
                    for pos, idx in pairs]
            positions = [p for p, _, _ in seen]
            indices = [i for _, i, _ in seen]
            self.assertEqual(len(set(positions)), len(positions), f"epoch {epoch}: repeats")
            self.assertEqual(len(set(indices)), len(indices), f"epoch {epoch}: repeats")
            touching = [seg for seg in segments if any(seg[0] < s <= seg[1] for *_, s in seen)]
            worlds = [w for _, _, w in touching]
            tail = 0
            if len(set(worlds)) > 1:  # resharded mid-epoch: the last taker's tail is skipped
                last_lo, _, last_world = touching[-1]
                taken_over = min(p for p, _, s in seen if s > last_lo)
                tail = (TRAIN_SAMPLES - taken_over) % (last_world * BATCH)
            self.assertEqual(sorted(positions), list(range(TRAIN_SAMPLES - tail)),
                             f"epoch {epoch} (worlds {worlds})")
            self.assertTrue(all(0 <= i < TRAIN_SAMPLES for i in indices))

        # The run ended after exactly the configured epochs; steps are contiguous across the
        # three runs and the global sample count is what was traced.
        got = final(self.out)
        self.assertEqual(got["steps"], s3)
        self.assertEqual([m["step"] for m in metrics(self.out)], list(range(1, s3 + 1)))
        self.assertEqual(got["samples_seen"], sum(len(p) for _, _, _, p in rows))
        self.assertEqual(max(step for _, step, _, _ in rows), s3)
        # The cosine schedule kept its length: it starts at the peak, never rises, and reaches
        # its floor (0 here) at the run's last step, though the world changed twice.
        lrs = [m["lr"] for m in metrics(self.out)]
        self.assertAlmostEqual(lrs[0], LR, places=9)
        for a, b in zip(lrs, lrs[1:]):
            self.assertLessEqual(b, a * (1 + 1e-12))
        self.assertLess(lrs[-1], LR * 1e-3)
        self.assertGreater(lrs[-2], lrs[-1])
        return first, second, third

    def test_ddp_three_two_three_sees_each_sample_once_and_ends_on_time(self):
        _, second, third = self.check_change("  parallel: {mode: ddp}")
        self.assertNotIn("local_sgd:", second[0][1])
        # Rank 2 of the last run had no RNG file in the 2-rank checkpoint: its own stream.
        self.assertIn("rank 2: the checkpoint (written by 2 ranks) has no RNG state", third[2][2])
        self.assertIn("draws a new stream seeded from", third[2][2])

    def test_zero_stage3_three_two_three_sees_each_sample_once_and_ends_on_time(self):
        # Parameters and optimizer state sharded over 3, then 2, then 3 ranks: each resume
        # reads the gathered parameters and recuts the optimizer pieces.
        _, second, third = self.check_change("  parallel: {mode: zero, zero_stage: 3}")
        self.assertIn("ZeRO optimizer state recut: written as [3, 3,", second[0][2])
        self.assertIn("ZeRO optimizer state recut: written as [2, 3,", third[0][2])
        self.assertEqual(final(self.out)["strategy"], "zero")

    def test_local_sgd_averages_the_old_replicas_into_every_new_rank(self):
        _, second, third = self.check_change("  local_sgd_steps: 7")
        self.assertIn("local_sgd: the checkpoint holds 3 replicas and this run has 2 ranks: "
                      "every rank starts from their average", second[0][1])
        self.assertIn("local_sgd: the checkpoint holds 2 replicas and this run has 3 ranks",
                      third[0][1])
        self.assertEqual(final(self.out)["strategy"], "local_sgd")

    def test_a_resume_keeping_the_global_batch_keeps_the_learning_rate_curve(self):
        """The review's F1: 3 ranks x batch 4, stopped, resumed as 2 x 6 (the global batch
        kept, as docs/trainer.md advises). The cosine schedule is as long as it was, and every
        step's rate is the one an uninterrupted 2 x 6 run has there (it jumped 0.0435 ->
        0.0356 when the length was counted with the new per-rank batch in the old world)."""
        extra = "  parallel: {mode: ddp}"
        body = CONFIG.replace("epochs: {epochs}", "epochs: 1")
        ref_out = os.path.join(self.tmp, "ref")
        ref = write_config(self.tmp, body.format(out=ref_out, samples=SAMPLES, batch=6,
                                                 epochs=1, lr=LR, extra=extra), name="ref.yaml")
        results = wait_all(start_ranks(ref, 2)[0], timeout=180)
        for rc, out, err in results:
            self.assertEqual(rc, 0, out + err)
        want = {m["step"]: m["lr"] for m in metrics(ref_out)}
        self.assertEqual(len(want), TRAIN_SAMPLES // 12)

        cfg = write_config(self.tmp, body.format(out=self.out, samples=SAMPLES, batch=4,
                                                 epochs=1, lr=LR, extra=extra))
        _, _, s1 = self.run_segment(cfg, 3, restart=0, stop_after=20)
        second, _, s2 = self.run_segment(cfg, 2, restart=1,
                                         args=("--batch_size", "6", "--resume_allow_changes",
                                               "true"))
        self.assertIn("the LR schedule (1000 steps, at", second[0][1])
        self.assertNotIn("the global batch is", second[0][1])  # said only when it changed
        got = {m["step"]: m["lr"] for m in metrics(self.out)}
        self.assertEqual(s2, len(want))
        self.assertEqual(sorted(got), sorted(want))
        for step in sorted(want):
            self.assertLess(abs(got[step] - want[step]), 1e-6 * LR, f"step {step} (resumed "
                            f"after {s1}): {got[step]} against {want[step]}")


if __name__ == "__main__":
    unittest.main()
