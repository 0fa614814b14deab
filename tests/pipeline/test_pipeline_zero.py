"""Pipeline x ZeRO: the pipeline engine hands every point but forward and backward to the data
strategy of each stage's data group, so `parallel: {mode: zero, zero_stage: S, stages: 2}` shards
each stage's optimizer state (S >= 1), gradients (S >= 2) and parameters (S = 3) over that
stage's replicas. On 4 ranks (2 stages x 2 replicas, the built-in transformer, Adam, clipping by
the norm over both stages) the parameters after the run equal pipeline x DDP's on the same global
batch within 1e-6 (relative), and each rank's state_bytes follow ZeRO's formulas for its stage's
parameters."""

import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "trainer"))
from trainer_helpers import TRAIN, final, metrics, params, rel_diff, run_ranks, write_config
import harness

TEXT = """
train:
  seed: 5
  output_dir: {out}
  model: {{type: transformer, vocab: bytes, d_model: 32, layers: 4, heads: 2, context: 16}}
  data: {{type: text, path: /usr/share/common-licenses/GPL-3}}
  eval_fraction: 0.0
  batch_size: 8
  max_steps: 8
  optimizer: {{type: adam, lr: 0.003}}
  max_grad_norm: 0.5
  checkpoint_every: 0
  resume: never
  parallel: {parallel}
"""

STAGES, REPLICAS = 2, 2
VOCAB, D_MODEL, CONTEXT = 256, 32, 16  # vocab: bytes
# Parameters of each stage outside every ShardUnit: token and position embeddings on stage 0;
# ln_f (weight, bias) and the head (weight, bias) on stage 1.
ROOT_FLOATS = [VOCAB * D_MODEL + CONTEXT * D_MODEL, 2 * D_MODEL + D_MODEL * VOCAB + VOCAB]
WORLD = STAGES * REPLICAS


def stage_rank(stage, replica):
    """The layout's rank order (trainer_runtime/parallel/layout.h): stage outermost."""
    return stage * REPLICAS + replica


def whole(out, replica):
    flat = []
    for s in range(STAGES):
        flat += params(out, stage_rank(s, replica))
    return flat


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class PipelineZeroTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = harness.tmpdir()
        cls.ddp = cls.run_mode("ddp", "{mode: pipeline, stages: 2, microbatches: 4}")

    @classmethod
    def run_mode(cls, name, parallel):
        out = os.path.join(cls.tmp, name)
        cfg = write_config(cls.tmp, TEXT.format(out=out, parallel=parallel), name + ".yaml")
        run_ranks(cfg, WORLD, ["--dump_params"], timeout=240)
        return out

    def check_stage(self, zero_stage):
        out = self.run_mode(f"zero{zero_stage}",
                            f"{{mode: zero, zero_stage: {zero_stage}, stages: 2, "
                            f"microbatches: 4, bucket_cap_mb: 0.01}}")
        got, ref = whole(out, 0), whole(self.ddp, 0)
        # The replicas of each stage hold the same parameters (all-gathered after every step).
        self.assertEqual(got, whole(out, 1), "the replicas of a stage differ")
        rel, worst = rel_diff(got, ref)
        self.assertLess(rel, 1e-6, f"zero {zero_stage}: relative difference {rel:g} "
                                   f"(max abs {worst:g}) from pipeline x ddp")
        # Training moved the weights (two runs that did nothing would agree too).
        m = metrics(out)
        self.assertEqual(len(m), 8)
        self.assertLess(m[-1]["loss"], m[0]["loss"])
        f, d = final(out), final(self.ddp)
        self.assertEqual(f["strategy"], "pipeline")
        self.assertGreaterEqual(f["buckets"], 2, "the units were not cut small")
        # ZeRO's formulas over each stage's parameters P_s and its W = 2 replicas, Adam:
        # stage 1 holds P_s parameters and gradients and 8 P_s / W of optimizer state; stage 2
        # also only P_s / W of gradients; stage 3 also only P_s / W of parameters. DDP holds
        # P_s, P_s and 8 P_s. Each unit's padding costs fewer than W elements per tensor.
        zb, db = f["state_bytes"], d["state_bytes"]
        for s in range(STAGES):
            for r in (stage_rank(s, 0), stage_rank(s, 1)):
                pad = f["buckets"] * REPLICAS * 4 * 3
                ddp_params = db["parameters"][r]
                self.assertEqual(ddp_params, db["parameters"][stage_rank(s, 0)])
                self.assertAlmostEqual(zb["optimizer"][r], db["optimizer"][r] / REPLICAS,
                                       delta=pad, msg=f"rank {r} (stage {s}) optimizer state")
                # Stage 3 shards the units (the transformer's blocks); the parameters outside
                # every unit, the root, stay whole (parallel/zero.h): the embeddings on the
                # first stage, ln_f and the head on the last.
                root = 4 * ROOT_FLOATS[s]
                self.assertAlmostEqual(
                    zb["parameters"][r],
                    (ddp_params - root) / REPLICAS + root if zero_stage == 3 else ddp_params,
                    delta=pad, msg=f"rank {r} (stage {s}) parameters")
                if zero_stage >= 2:
                    self.assertAlmostEqual(zb["gradients"][r], db["gradients"][r] / REPLICAS,
                                           delta=pad, msg=f"rank {r} (stage {s}) gradients")
        # The stages hold different parts of the model.
        self.assertNotEqual(db["parameters"][stage_rank(0, 0)], db["parameters"][stage_rank(1, 0)])
        self.assertGreater(f["reduce_scatters_total"], 0)

    def test_zero_stage_1_over_pipeline_replicas_equals_pipeline_ddp(self):
        self.check_stage(1)

    def test_zero_stage_2_over_pipeline_replicas_equals_pipeline_ddp(self):
        self.check_stage(2)

    def test_zero_stage_3_over_pipeline_replicas_equals_pipeline_ddp(self):
        self.check_stage(3)


if __name__ == "__main__":
    unittest.main()
