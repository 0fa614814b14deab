"""ZeRO (parallel.mode zero, stages 1 and 2) against DDP and one process on the same data and
seed: the sharded optimizer step, the reduce-scattered gradients and the all-gathered
parameters give DDP's parameters (bit for bit on shared memory, where the sums run in the same
order; within 1e-6 over Gloo or with accumulation), on 2 and 3 ranks, with units cut small so
that shards split parameters and carry padding; clipping by the global norm; checkpoints that
resume bit-identically; clear refusals."""

import os
import unittest

from trainer_helpers import (TRAIN, final, metrics, params, rel_diff, run_ranks, start_ranks,
                             wait_all, write_config)
import harness

BASE = """
train:
  seed: 7
  output_dir: {out}
  model: {{type: mlp, layers: [16, 64, 64, 4]}}
  data: {{type: synthetic, samples: 2048}}
  eval_fraction: 0.0
  batch_size: {batch}
  max_steps: {steps}
  optimizer: {optimizer}
  max_grad_norm: {clip}
  checkpoint_every: {ckpt}
  resume: {resume}
  parallel: {{mode: {mode}, zero_stage: {stage}, bucket_cap_mb: {cap}}}
  gradient_accumulation_steps: {accum}
  sync_each_batch: {sync_each}
"""

ADAMW = "{type: adamw, lr: 0.003, weight_decay: 0.1}"


def config(tmp, name, batch, mode="zero", stage=1, steps=20, optimizer=ADAMW, cap=0.004,
           accum=1, clip=0.0, ckpt=0, resume="never", sync_each="false"):
    out = os.path.join(tmp, name)
    text = BASE.format(out=out, batch=batch, steps=steps, optimizer=optimizer, mode=mode,
                       stage=stage, cap=cap, accum=accum, clip=clip, ckpt=ckpt, resume=resume,
                       sync_each=sync_each)
    return write_config(tmp, text, name + ".yaml"), out


def train(cfg, world, env=None, args=("--dump_params",)):
    run_ranks(cfg, world, list(args), timeout=120, extra_env=env)


@unittest.skipUnless(os.path.exists(TRAIN), f"{TRAIN} not built")
class ZeroNumericsTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def run_pair(self, world, stage, env=None, **kw):
        """Runs zero and ddp with the same settings; returns their rank 0 parameters."""
        zcfg, zout = config(self.tmp, f"zero{stage}_w{world}", batch=8, stage=stage, **kw)
        dcfg, dout = config(self.tmp, f"ddp_w{world}", batch=8, mode="ddp", **kw)
        train(zcfg, world, env)
        train(dcfg, world, env)
        z = [params(zout, r) for r in range(world)]
        for r in range(1, world):
            self.assertEqual(z[0], z[r], f"zero replicas 0 and {r} differ")
        f = final(zout)
        self.assertEqual(f["strategy"], "zero")
        self.assertGreaterEqual(f["buckets"], 3, "units were not cut small")
        m = metrics(zout)
        self.assertLess(m[-1]["loss"], m[0]["loss"])
        # What each rank holds: the optimizer state (and in stage 2 the gradients) is a 1/W
        # share of DDP's, give or take each unit's padding (fewer than W elements a unit).
        zb, db = f["state_bytes"], final(dout)["state_bytes"]
        pad = f["buckets"] * world * 4 * 3
        self.assertEqual(len(zb["optimizer"]), world)
        for r in range(world):
            self.assertAlmostEqual(zb["optimizer"][r], db["optimizer"][r] / world, delta=pad)
            self.assertAlmostEqual(zb["parameters"][r], db["parameters"][r], delta=pad)
            if stage == 2:
                self.assertAlmostEqual(zb["gradients"][r], db["gradients"][r] / world, delta=pad)
        every_micro = stage == 2 or kw.get("sync_each") == "true"
        self.assertEqual(f["reduce_scatters_total"], f["buckets"] * m[-1]["step"] *
                         (kw.get("accum", 1) if every_micro else 1))
        self.assertEqual(f["allgathers_total"], f["buckets"] * m[-1]["step"])
        return z[0], params(dout, 0)

    def check_equals_ddp_bitwise(self, world, stage):
        z, d = self.run_pair(world, stage)
        rel, worst = rel_diff(z, d)
        self.assertEqual(z, d, f"stage {stage} at W={world} differs from ddp: rel {rel:g}, "
                               f"max abs {worst:g}")

    def test_stage1_two_ranks_is_ddp_bit_for_bit(self):
        self.check_equals_ddp_bitwise(2, 1)

    def test_stage2_two_ranks_is_ddp_bit_for_bit(self):
        self.check_equals_ddp_bitwise(2, 2)

    def test_stage1_three_ranks_is_ddp_bit_for_bit(self):
        self.check_equals_ddp_bitwise(3, 1)

    def test_stage2_three_ranks_is_ddp_bit_for_bit(self):
        self.check_equals_ddp_bitwise(3, 2)

    def test_stages_equal_one_process_on_the_whole_batch(self):
        for stage in (1, 2):
            zcfg, zout = config(self.tmp, f"z{stage}", batch=8, stage=stage)
            train(zcfg, 2)
            rcfg, rout = config(self.tmp, "ref", batch=16, mode="none")
            train(rcfg, 1)
            rel, worst = rel_diff(params(zout, 0), params(rout, 0))
            self.assertLess(rel, 1e-5, f"stage {stage}: rel {rel:g} (max abs {worst:g})")

    def test_sgd_momentum_with_accumulation_and_clipping_near_ddp(self):
        for stage in (1, 2):
            z, d = self.run_pair(2, stage, optimizer="{type: sgd, lr: 0.05, momentum: 0.9}",
                                 accum=2, clip=0.5)
            rel, worst = rel_diff(z, d)
            self.assertLess(rel, 1e-6, f"stage {stage}: rel {rel:g} (max abs {worst:g})")

    def test_stage1_sync_each_batch_near_ddp(self):
        z, d = self.run_pair(2, 1, accum=2, sync_each="true")
        rel, worst = rel_diff(z, d)
        self.assertLess(rel, 1e-6, f"rel {rel:g} (max abs {worst:g})")

    def test_over_gloo_near_ddp(self):
        for stage in (1, 2):
            z, d = self.run_pair(2, stage, env={"LAUNCH_SHM_ALLREDUCE": "0"})
            rel, worst = rel_diff(z, d)
            self.assertLess(rel, 1e-6, f"stage {stage}: rel {rel:g} (max abs {worst:g})")


@unittest.skipUnless(os.path.exists(TRAIN), f"{TRAIN} not built")
class ZeroCheckpointTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def test_resume_is_bit_identical_and_other_world_is_refused(self):
        whole_cfg, whole_out = config(self.tmp, "whole", batch=8, stage=2, steps=20)
        train(whole_cfg, 2)
        half_cfg, half_out = config(self.tmp, "half", batch=8, stage=2, steps=10, ckpt=10,
                                    resume="auto")
        train(half_cfg, 2, args=())
        shards = os.listdir(os.path.join(half_out, "checkpoints", "step10"))
        self.assertIn("zero_rank0.pt", shards)
        self.assertIn("zero_rank1.pt", shards)
        rest_cfg, _ = config(self.tmp, "half", batch=8, stage=2, steps=20, ckpt=10,
                             resume="auto")
        # Another world size: refused, naming both (and the checkpoint stays usable).
        procs, _ = start_ranks(rest_cfg, 3, [])
        outputs = "".join(out + err for _, out, err in wait_all(procs, 90))
        self.assertIn("sharded over 2 ranks", outputs)
        train(rest_cfg, 2)
        self.assertEqual(params(half_out, 0), params(whole_out, 0))


@unittest.skipUnless(os.path.exists(TRAIN), f"{TRAIN} not built")
class ZeroRefusalTest(unittest.TestCase):
    def test_stage3_is_refused_clearly(self):
        tmp = harness.tmpdir()
        cfg, _ = config(tmp, "z3", batch=8, stage=3)
        procs, _ = start_ranks(cfg, 2, [])
        for rc, out, err in wait_all(procs, 90):
            self.assertEqual(rc, 2, out + err)
            self.assertIn("zero_stage", err)


if __name__ == "__main__":
    unittest.main()
