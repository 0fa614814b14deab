"""ZeRO (parallel.mode zero, stages 1, 2 and 3) against DDP and one process on the same data and
seed: the sharded optimizer step, the reduce-scattered gradients, the all-gathered parameters
and (stage 3) the parameters gathered around each unit's forward and backward give DDP's
parameters (bit for bit on shared memory, where the sums run in the same order; within 1e-6
over Gloo or with accumulation), on 2 and 3 ranks, with units cut small so that shards split
parameters and carry padding; the built-in MLP and transformer, activation checkpointing;
clipping by the global norm; checkpoints that resume bit-identically and at other world sizes
and stages."""

import math
import os
import shutil
import unittest

from trainer_helpers import TRAIN, drop_from_checkpoint, final, metrics, params, rel_diff, run_ranks, write_config
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
  resume_allow_changes: {allow}
  parallel: {{mode: {mode}, {stage}bucket_cap_mb: {cap}}}
  gradient_accumulation_steps: {accum}
  sync_each_batch: {sync_each}
"""

ADAMW = "{type: adamw, lr: 0.003, weight_decay: 0.1}"


def config(tmp, name, batch, mode="zero", stage=1, steps=20, optimizer=ADAMW, cap=0.004,
           accum=1, clip=0.0, ckpt=0, resume="never", sync_each="false", allow=False, out=None):
    """Writes <name>.yaml; the run goes to tmp/<name> unless `out` names another folder (to
    continue another run's checkpoints)."""
    out = out or os.path.join(tmp, name)
    text = BASE.format(out=out, batch=batch, steps=steps, optimizer=optimizer, mode=mode,
                       stage=f"zero_stage: {stage}, " if mode == "zero" else "", cap=cap, accum=accum, clip=clip, ckpt=ckpt, resume=resume,
                       sync_each=sync_each, allow="true" if allow else "false")
    return write_config(tmp, text, name + ".yaml"), out


def train(cfg, world, env=None, args=("--dump_params",)):
    """Runs `world` ranks; returns their stdout and stderr, joined."""
    return "".join(out + err for _, out, err in run_ranks(cfg, world, list(args), timeout=120,
                                                         extra_env=env))


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
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
        # Stage 3 also holds a 1/W share of the parameters between uses (the MLP's layers are
        # its units; nothing is left whole).
        zb, db = f["state_bytes"], final(dout)["state_bytes"]
        pad = f["buckets"] * world * 4 * 3
        self.assertEqual(len(zb["optimizer"]), world)
        for r in range(world):
            self.assertAlmostEqual(zb["optimizer"][r], db["optimizer"][r] / world, delta=pad)
            self.assertAlmostEqual(zb["parameters"][r],
                                   db["parameters"][r] / (world if stage == 3 else 1), delta=pad)
            if stage >= 2:
                self.assertAlmostEqual(zb["gradients"][r], db["gradients"][r] / world, delta=pad)
        steps, accum, units = m[-1]["step"], kw.get("accum", 1), f["buckets"]
        every_micro = stage >= 2 or kw.get("sync_each") == "true"
        self.assertEqual(f["reduce_scatters_total"], units * steps * (accum if every_micro else 1))
        if stage < 3:
            self.assertEqual(f["allgathers_total"], units * steps)
        else:
            # Each micro-batch gathers every unit for forward and all but the last again for
            # backward (the last stays; the first forward, before the order is known, lets it
            # go), and Finish gathers the model whole.
            micros = steps * accum
            self.assertEqual(f["allgathers_total"], micros * (2 * units - 1) + 1 + units)
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

    def test_stage3_two_ranks_is_ddp_bit_for_bit(self):
        self.check_equals_ddp_bitwise(2, 3)

    def test_stage3_three_ranks_is_ddp_bit_for_bit(self):
        self.check_equals_ddp_bitwise(3, 3)

    def test_stage3_transformer_with_activation_checkpointing_and_bf16_is_ddp_bit_for_bit(self):
        """The transformer's blocks are units; its embeddings, final norm and head stay whole
        (the root). With activation checkpointing a block's recomputation in backward runs on
        the parameters its output's gradient gathered; under bf16 autocast the gathered float32
        parameters are cast as DDP's are. Evaluation gathers unit by unit."""
        for checkpointing, precision in (("false", "no"), ("true", "no"), ("false", "bf16")):
            got = {}
            for mode, stage in (("ddp", ""), ("zero", ", zero_stage: 3")):
                name = f"lm_{mode}_{checkpointing}_{precision}"
                out = os.path.join(self.tmp, name)
                cfg = write_config(self.tmp, f"""
mixed_precision: {precision}
train:
  seed: 3
  output_dir: {out}
  model: {{type: transformer, vocab: bytes, d_model: 32, layers: 3, heads: 4, context: 32,
          dropout: 0.1, activation_checkpointing: {checkpointing}}}
  data: {{type: text, path: /usr/share/common-licenses/GPL-3}}
  eval_fraction: 0.02
  batch_size: 4
  max_steps: 8
  optimizer: {{type: adamw, lr: 3.0e-3}}
  resume: never
  parallel: {{mode: {mode}{stage}}}
""", name + ".yaml")
                err = train(cfg, 2)
                got[mode] = [params(out, r) for r in range(2)]
                f = final(out)
                self.assertTrue(math.isfinite(f["eval_loss"]), f)
                if mode == "zero":
                    self.assertIn("ZeRO stage 3: 3 units (ShardUnit modules) hold", err)
                    whole = final(os.path.join(self.tmp, f"lm_ddp_{checkpointing}_{precision}"))
                    shard, full = f["state_bytes"]["parameters"][0], \
                        whole["state_bytes"]["parameters"][0]
                    self.assertLess(shard, full, "stage 3 held the whole transformer")
            self.assertEqual(got["zero"][0], got["zero"][1])
            self.assertEqual(got["zero"][0], got["ddp"][0], f"activation_checkpointing "
                             f"{checkpointing}, {precision}: stage 3 != ddp")

    def test_stages_equal_one_process_on_the_whole_batch(self):
        for stage in (1, 2, 3):
            zcfg, zout = config(self.tmp, f"z{stage}", batch=8, stage=stage)
            train(zcfg, 2)
            rcfg, rout = config(self.tmp, "ref", batch=16, mode="none")
            train(rcfg, 1)
            rel, worst = rel_diff(params(zout, 0), params(rout, 0))
            self.assertLess(rel, 1e-5, f"stage {stage}: rel {rel:g} (max abs {worst:g})")

    def test_sgd_momentum_with_accumulation_and_clipping_near_ddp(self):
        for stage in (1, 2, 3):
            z, d = self.run_pair(2, stage, optimizer="{type: sgd, lr: 0.05, momentum: 0.9}",
                                 accum=2, clip=0.5)
            rel, worst = rel_diff(z, d)
            self.assertLess(rel, 1e-6, f"stage {stage}: rel {rel:g} (max abs {worst:g})")

    def test_stage1_sync_each_batch_near_ddp(self):
        z, d = self.run_pair(2, 1, accum=2, sync_each="true")
        rel, worst = rel_diff(z, d)
        self.assertLess(rel, 1e-6, f"rel {rel:g} (max abs {worst:g})")

    def test_over_gloo_near_ddp(self):
        for stage in (1, 2, 3):
            z, d = self.run_pair(2, stage, env={"LAUNCH_SHM_ALLREDUCE": "0"})
            rel, worst = rel_diff(z, d)
            self.assertLess(rel, 1e-6, f"stage {stage}: rel {rel:g} (max abs {worst:g})")


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class ZeroCheckpointTest(unittest.TestCase):
    """Checkpoints hold each rank's optimizer pieces with their element ranges (and rank 0 an
    index of them), so that a resume recuts them for any world size, stage or unit size, or
    gathers them whole in one process."""

    def setUp(self):
        self.tmp = harness.tmpdir()

    def test_resume_is_bit_identical_and_another_world_recuts(self):
        whole_cfg, whole_out = config(self.tmp, "whole", batch=8, stage=2, steps=20)
        train(whole_cfg, 2)
        half_cfg, half_out = config(self.tmp, "half", batch=8, stage=2, steps=10, ckpt=10,
                                    resume="auto")
        train(half_cfg, 2, args=())
        files = os.listdir(os.path.join(half_out, "checkpoints", "step10"))
        for f in ("zero_index.pt", "zero_rank0.pt", "zero_rank1.pt"):
            self.assertIn(f, files)
        # Another world size continues from the same checkpoint (into its own folder): no longer
        # refused.
        other_cfg, other_out = config(self.tmp, "other", batch=8, stage=2, steps=20,
                                      resume=os.path.join(half_out, "checkpoints"))
        err = train(other_cfg, 3)
        self.assertIn("ZeRO optimizer state recut: written as [2, 2,", err)
        self.assertIn("read as [3, 2,", err)
        for r in (1, 2):
            self.assertEqual(params(other_out, 0), params(other_out, r))
        self.assertEqual(metrics(other_out)[-1]["step"], 20)
        # The same world reads each shard file as it was cut: bit for bit.
        rest_cfg, _ = config(self.tmp, "half", batch=8, stage=2, steps=20, ckpt=10,
                             resume="auto")
        err = train(rest_cfg, 2)
        self.assertNotIn("recut", err)
        self.assertEqual(params(half_out, 0), params(whole_out, 0))

    def test_two_ranks_resumed_on_one_with_the_global_batch_match_one_process(self):
        """The issue's numerics goal: a stage-3 checkpoint of 2 ranks resumed on 1 with the same
        global batch ends within 1e-5 of the undisturbed run. Stage 3 gathers the parameters
        into model.pt for the save; one process has no group, so it trains one whole optimizer:
        it gathers all the pieces."""
        ref_cfg, ref_out = config(self.tmp, "ref", batch=16, mode="none", steps=20)
        train(ref_cfg, 1)
        first_cfg, out = config(self.tmp, "run", batch=8, stage=3, steps=10, ckpt=10)
        train(first_cfg, 2, args=())
        # The control: the same resume without the shard files (a fresh optimizer at step 10).
        cold_ckpt = os.path.join(self.tmp, "cold_from")
        shutil.copytree(os.path.join(out, "checkpoints"), cold_ckpt)
        for name in os.listdir(os.path.join(cold_ckpt, "step10")):
            if name.startswith("zero_"):
                drop_from_checkpoint(os.path.join(cold_ckpt, "step10"), name)
        # batch_size is part of the run's identity: the changed global split must be allowed.
        rest_cfg, _ = config(self.tmp, "rest", batch=16, stage=3, steps=20, ckpt=10,
                             resume=os.path.join(out, "checkpoints"), allow=True, out=out)
        train(rest_cfg, 1)
        rel, worst = rel_diff(params(out, 0), params(ref_out, 0))
        self.assertLess(rel, 1e-5, f"rel {rel:g} (max abs {worst:g})")
        cold_cfg, cold_out = config(self.tmp, "cold", batch=16, stage=3, steps=20,
                                    resume=cold_ckpt, allow=True)
        train(cold_cfg, 1)
        cold_rel, _ = rel_diff(params(cold_out, 0), params(ref_out, 0))
        print(f"\n2 -> 1: rel {rel:g} (max abs {worst:g}); without the state: rel {cold_rel:g}")
        self.assertGreater(cold_rel, 10 * 1e-5, "the bound does not tell a lost state apart")

    def test_one_process_resumed_on_two_ranks_takes_its_pieces(self):
        """The other way: one process (mode zero, unsharded there) leaves the whole optimizer in
        model.pt; two stage-1 ranks each take their pieces of it."""
        ref_cfg, ref_out = config(self.tmp, "ref", batch=16, mode="none", steps=20)
        train(ref_cfg, 1)
        first_cfg, out = config(self.tmp, "run", batch=16, stage=1, steps=10, ckpt=10)
        train(first_cfg, 1, args=())
        rest_cfg, _ = config(self.tmp, "rest", batch=8, stage=1, steps=20, ckpt=10,
                             resume=os.path.join(out, "checkpoints"), allow=True, out=out)
        train(rest_cfg, 2)
        self.assertEqual(params(out, 0), params(out, 1))
        rel, worst = rel_diff(params(out, 0), params(ref_out, 0))
        print(f"\n1 -> 2: rel {rel:g} (max abs {worst:g})")
        self.assertLess(rel, 1e-5, f"rel {rel:g} (max abs {worst:g})")

    def test_stage3_resumes_bit_identically_and_as_stage_1_at_three_ranks(self):
        """A stage-3 save gathers the parameters for model.pt and each rank's optimizer pieces;
        the same world resumes it bit for bit, and three stage-1 ranks recut it."""
        whole_cfg, whole_out = config(self.tmp, "whole", batch=8, stage=3, steps=20)
        train(whole_cfg, 2)
        half_cfg, half_out = config(self.tmp, "half", batch=8, stage=3, steps=10, ckpt=10)
        train(half_cfg, 2, args=())
        other_cfg, other_out = config(self.tmp, "other", batch=8, stage=1, steps=20,
                                      resume=os.path.join(half_out, "checkpoints"), allow=True)
        err = train(other_cfg, 3)
        self.assertIn("ZeRO optimizer state recut: written as [2, 3,", err)
        self.assertEqual(params(other_out, 0), params(other_out, 2))
        rest_cfg, _ = config(self.tmp, "rest", batch=8, stage=3, steps=20, ckpt=10,
                             resume=os.path.join(half_out, "checkpoints"), out=half_out)
        err = train(rest_cfg, 2)
        self.assertNotIn("recut", err)
        self.assertEqual(params(half_out, 0), params(whole_out, 0))

    def test_stage_and_unit_size_change_is_bit_identical(self):
        """Stage 2 with small units resumed as stage 1 with other units, at the same world:
        every piece is recut, and copying state is exact, so the run is the undisturbed one bit
        for bit (both stages are DDP's bit for bit on shared memory)."""
        whole_cfg, whole_out = config(self.tmp, "whole", batch=8, stage=2, steps=20)
        train(whole_cfg, 2)
        first_cfg, out = config(self.tmp, "run", batch=8, stage=2, steps=10, ckpt=10)
        train(first_cfg, 2, args=())
        rest_cfg, _ = config(self.tmp, "rest", batch=8, stage=1, cap=0.011, steps=20, ckpt=10,
                             resume=os.path.join(out, "checkpoints"), allow=True, out=out)
        err = train(rest_cfg, 2)
        self.assertIn("recut", err)
        self.assertEqual(params(out, 0), params(whole_out, 0))

    def test_sgd_momentum_two_to_three_ranks_stays_near_the_undisturbed_run(self):
        """SGD keeps a momentum buffer and no step count: stage 2, 2 ranks x 12 -> 3 x 8."""
        sgd = "{type: sgd, lr: 0.05, momentum: 0.9}"
        ref_cfg, ref_out = config(self.tmp, "ref", batch=12, stage=2, steps=16, optimizer=sgd)
        train(ref_cfg, 2)
        out = os.path.join(self.tmp, "run")
        ckpt = os.path.join(out, "checkpoints")
        for world, batch, steps, resume in ((2, 12, 8, "never"), (3, 8, 16, ckpt)):
            cfg, _ = config(self.tmp, f"w{world}", batch=batch, stage=2, steps=steps, ckpt=8,
                            optimizer=sgd, resume=resume, allow=True, out=out)
            train(cfg, world)
        rel, worst = rel_diff(params(out, 0), params(ref_out, 0))
        print(f"\nsgd 2 -> 3: rel {rel:g} (max abs {worst:g})")
        self.assertLess(rel, 1e-5, f"rel {rel:g} (max abs {worst:g})")

    def test_world_three_two_three_with_adam_stays_near_the_undisturbed_run(self):
        """3 -> 2 -> 3 ranks, stage 1, Adam, the same global batch (3 x 8 = 2 x 12). The data
        after a world change is the same global order, so every step averages the gradients of
        the same 24 samples; only the summation order (and DDP-style 1/W scaling) differs, so
        the parameters stay within float rounding of the undisturbed 3-rank run."""
        adam = "{type: adam, lr: 0.003}"
        ref_cfg, ref_out = config(self.tmp, "ref", batch=8, steps=18, optimizer=adam)
        train(ref_cfg, 3)
        out = os.path.join(self.tmp, "run")
        ckpt = os.path.join(out, "checkpoints")
        for world, batch, steps, resume in ((3, 8, 6, "never"), (2, 12, 12, ckpt),
                                            (3, 8, 18, ckpt)):
            cfg, _ = config(self.tmp, f"w{world}_{steps}", batch=batch, steps=steps, ckpt=6,
                            optimizer=adam, resume=resume, allow=True, out=out)
            err = train(cfg, world)
            if resume != "never":
                self.assertIn("ZeRO optimizer state recut", err)
        for r in (1, 2):
            self.assertEqual(params(out, 0), params(out, r))
        rel, worst = rel_diff(params(out, 0), params(ref_out, 0))
        print(f"\n3 -> 2 -> 3: rel {rel:g}, max abs {worst:g}")
        self.assertLess(rel, 1e-5, f"rel {rel:g} (max abs {worst:g})")


if __name__ == "__main__":
    unittest.main()
