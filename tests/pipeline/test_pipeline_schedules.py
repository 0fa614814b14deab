"""Interleaved 1F1B and ZB-H1 (train.parallel.schedule interleaved_1f1b with virtual_stages, and
zero_bubble; trainer_runtime/parallel/pipeline_engine.h) run by real `train` processes against one
process on the same data and seed: the whole model (model.pt, joined from the stages) ends within
float32's reordering of sums of the unsplit run's, alone, with DDP and ZeRO 1 on the data axis and
with tensor parallelism inside the stages; each rank holds non-adjacent chunks (interleaved) and
runs the weight passes apart from the input gradients (ZB-H1, seen in its timeline); a checkpoint
written under one schedule resumes under another (its stage folders re-cut); bad settings are
refused naming the keys."""

import json
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "trainer"))
from trainer_helpers import (TRAIN, final, free_port, metrics, rank_env, run_ranks,
                             write_config)
import harness

BASE = """
train:
  seed: 11
  output_dir: {out}
  model: {model}
  data: {data}
  eval_fraction: 0.0
  batch_size: {batch}
  max_steps: {steps}
  optimizer: {{type: adamw, lr: 0.003}}
  max_grad_norm: 0.5
  checkpoint_every: {ckpt}
  resume: {resume}
  log_every: 1
  parallel: {parallel}
"""

MLP = "{type: mlp, layers: [12, 24, 24, 24, 4]}"
SYNTHETIC = "{type: synthetic, samples: 640}"
TRANSFORMER = "{type: transformer, vocab: bytes, d_model: 32, layers: 4, heads: 4, context: 16}"
TEXT = "{type: text, path: /usr/share/common-licenses/GPL-3, context: 16}"

# Two model files (Debian's python3 has torch): their names and shapes agree, and the largest
# difference relative to PyTorch's float32 assert_close tolerances (rtol 1.3e-6, atol 1e-5):
# at most 1 passes. Also each stage file's parameter names.
COMPARE = r"""
import json, sys, torch
a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
same = sorted(a) == sorted(b) and all(a[k].shape == b[k].shape for k in a)
ratio = max(((a[k] - b[k]).abs() / (1e-5 + 1.3e-6 * b[k].abs())).max().item()
            for k in a) if same else None
stages = [sorted(torch.load(p)) for p in sys.argv[3:]]
print(json.dumps({"same": same, "ratio": ratio, "stages": stages}))
"""


def config(tmp, name, parallel, batch=8, model=MLP, data=SYNTHETIC, steps=10, ckpt=0,
           resume="never", out=None):
    out = out or os.path.join(tmp, name)
    text = BASE.format(out=out, model=model, data=data, batch=batch, steps=steps, ckpt=ckpt,
                       resume=resume, parallel=parallel)
    return write_config(tmp, text, name + ".yaml"), out


def train(cfg, world):
    return "".join(o + e for _, o, e in run_ranks(cfg, world, timeout=180))


def compare(out, ref_out, stages=0):
    files = [os.path.join(out, f"model_stage{s}.pt") for s in range(stages)]
    r = harness.run([harness.SYSTEM_PYTHON, "-c", COMPARE, os.path.join(out, "model.pt"),
                     os.path.join(ref_out, "model.pt")] + files, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class ScheduleNumericsTest(unittest.TestCase):
    references = {}  # (model, batch, steps) -> the one-process run's folder
    reference_of = {}  # and back: folder -> (model, data, batch)

    def setUp(self):
        self.tmp = harness.tmpdir()

    def reference(self, model=MLP, data=SYNTHETIC, batch=8, steps=10):
        key = (model, batch, steps)
        if key not in self.references:
            cfg, out = config(harness.tmpdir(), "whole", "{mode: none}", batch=batch,
                              model=model, data=data, steps=steps)
            train(cfg, 1)
            self.references[key] = out
            self.reference_of[out] = (model, data, batch)
        return self.references[key]

    def near(self, out, ref_out, stages=0, losses=True):
        got = compare(out, ref_out, stages)
        self.assertTrue(got["same"], got)
        self.assertLessEqual(got["ratio"], 1.0,
                             "the pipeline ended elsewhere than one process (ratio to "
                             "assert_close's tolerance)")
        # Far from where one step leaves the model: agreeing with the reference means something.
        moved = compare(out, self.reference(*self.reference_of[ref_out], steps=1))
        self.assertGreater(moved["ratio"], 100)
        if losses:  # the logged loss is the whole batch's (with one replica)
            a, b = metrics(out), metrics(ref_out)
            self.assertEqual([m["step"] for m in a], [m["step"] for m in b])
            for x, y in zip(a, b):
                self.assertAlmostEqual(x["loss"], y["loss"], delta=1e-4)
        return got

    def test_interleaved_two_chunks_per_rank_equals_one_process(self):
        cfg, out = config(self.tmp, "il", "{mode: pipeline, stages: 2, microbatches: 4, "
                          "schedule: interleaved_1f1b, virtual_stages: 2}")
        log = train(cfg, 2)
        self.assertIn("schedule interleaved_1f1b: F0 F1 F0@1 F1@1", log)
        got = self.near(out, self.reference(), stages=2)
        # Four chunks of one layer each: rank 0 holds layers 0 and 2, rank 1 layers 1 and 3.
        self.assertEqual(got["stages"], [["fc0.bias", "fc0.weight", "fc2.bias", "fc2.weight"],
                                         ["fc1.bias", "fc1.weight", "fc3.bias", "fc3.weight"]])
        pipe = final(out)["pipeline"]
        self.assertEqual(pipe["schedule"], "interleaved_1f1b")
        self.assertEqual(pipe["virtual_stages"], 2)
        self.assertEqual(pipe["partition"], [1, 1, 1, 1])
        # Chunk activations alive at once: warm-up 2(P-1-s) + (v-1)P + 1 on rank s.
        self.assertEqual(pipe["peak_live_microbatches"], [5, 3])
        self.assertAlmostEqual(pipe["theoretical_bubble"], 1 / 9)

    def test_zero_bubble_runs_weight_passes_apart_and_equals_one_process(self):
        cfg, out = config(self.tmp, "zb", "{mode: pipeline, stages: 2, microbatches: 4, "
                          "schedule: zero_bubble}", steps=10)
        with open(cfg, "a") as f:
            f.write("  timeline: {from_step: 2, steps: 1}\n")
        log = train(cfg, 2)
        self.assertIn("schedule zero_bubble: F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3", log)
        self.near(out, self.reference())
        self.assertAlmostEqual(final(out)["pipeline"]["theoretical_bubble"], 1 / 13)
        with open(os.path.join(out, "timeline.json")) as f:
            events = [e for e in json.load(f) if e["ph"] == "X" and e["tid"] == "pipeline"]
        for rank in (0, 1):
            names = [e["name"] for e in sorted(events, key=lambda e: e["ts"])
                     if e["pid"] == rank]
            kinds = [n for n in names if n.startswith(("forward", "backward"))]
            self.assertEqual(sorted(kinds), sorted(
                [f"forward micro-batch {m}" for m in range(4)] +
                [f"backward (input gradient) micro-batch {m}" for m in range(4)] +
                [f"backward (weight gradients) micro-batch {m}" for m in range(4)]))
            if rank == 1:
                # The last stage defers each weight pass past the next input gradient.
                self.assertLess(kinds.index("backward (input gradient) micro-batch 1"),
                                kinds.index("backward (weight gradients) micro-batch 0"))

    def test_data_axis_ddp_and_zero_synchronise_after_the_schedule(self):
        # 2 stages x 2 replicas x batch 8 == one process on batch 16.
        ref = self.reference(batch=16)
        for mode, schedule in (("pipeline", "interleaved_1f1b, virtual_stages: 2"),
                               ("zero", "zero_bubble")):
            with self.subTest(mode=mode, schedule=schedule):
                cfg, out = config(self.tmp, f"{mode}_{schedule[:4]}",
                                  f"{{mode: {mode}, stages: 2, microbatches: 2, "
                                  f"schedule: {schedule}}}")
                train(cfg, 4)
                self.near(out, ref, losses=False)
                f = final(out)
                self.assertEqual(f["allreduces_total"], 10, "one gradient reduction per step")
                self.assertEqual(len(set(f["pipeline"]["stage_param_checksums"])), 2)

    def test_tensor_parallel_stages_under_both_schedules_match_one_process(self):
        # tensor 2 x stages 2: Megatron's layers inside interleaved chunks (with sequence
        # parallelism) and inside ZB-H1's split backward, 20 steps (the issue's goal).
        ref = self.reference(model=TRANSFORMER, data=TEXT, steps=20)
        for extra in ("schedule: interleaved_1f1b, virtual_stages: 2, sequence_parallel: true",
                      "schedule: zero_bubble"):
            with self.subTest(extra=extra):
                cfg, out = config(self.tmp, extra[10:14], "{mode: pipeline, tensor: 2, stages: 2, "
                                  f"microbatches: 4, {extra}}}", model=TRANSFORMER, data=TEXT,
                                  steps=20)
                log = train(cfg, 4)
                self.assertIn("tensor 2 x stage 2", log)
                self.near(out, ref)

    def test_a_checkpoint_resumes_under_another_schedule(self):
        # Interleaved (rank 0: layers 0 and 2) for 6 steps, then ZB-H1 (rank 0: layers 0 and 1):
        # the same folder names hold other layers, so each rank re-cuts its own.
        cfg, out = config(self.tmp, "sw", "{mode: pipeline, stages: 2, microbatches: 4, "
                          "schedule: interleaved_1f1b, virtual_stages: 2}", steps=6, ckpt=6)
        train(cfg, 2)
        cfg2, _ = config(self.tmp, "sw2", "{mode: pipeline, stages: 2, microbatches: 4, "
                         "schedule: zero_bubble}", steps=10, resume="auto", out=out)
        log = train(cfg2, 2)
        self.assertIn("re-cuts its shard", log)
        self.near(out, self.reference())
        self.assertFalse([d for d in os.listdir(os.path.join(out, "checkpoints"))
                          if d.startswith(".recut")])


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class ScheduleConfigErrorsTest(unittest.TestCase):
    """Each fails with exit 2 before joining the process group (only rank 0 is started)."""

    def fails(self, parallel, world, *expected):
        tmp = harness.tmpdir()
        cfg, _ = config(tmp, "bad", parallel)
        r = subprocess.run([TRAIN, cfg], capture_output=True, text=True, timeout=60,
                           env=rank_env(0, world, free_port()))
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        for e in expected:
            self.assertIn(e, r.stderr)

    def test_virtual_stages_need_the_interleaved_schedule(self):
        self.fails("{mode: pipeline, stages: 2, microbatches: 4, virtual_stages: 2}", 2,
                   "bad.yaml:", "train.parallel.virtual_stages applies to schedule "
                   "interleaved_1f1b")

    def test_interleaved_needs_two_chunks_and_whole_groups_of_micro_batches(self):
        self.fails("{mode: pipeline, stages: 2, microbatches: 4, schedule: interleaved_1f1b}", 2,
                   "needs at least 2 model chunks per rank")
        self.fails("{mode: pipeline, stages: 2, microbatches: 3, schedule: interleaved_1f1b, "
                   "virtual_stages: 2}", 2, "microbatches", "3 is not a multiple of it")

    def test_more_chunks_than_layers_and_a_partition_of_chunks(self):
        self.fails("{mode: pipeline, stages: 2, microbatches: 4, schedule: interleaved_1f1b, "
                   "virtual_stages: 3}", 2, "stages x virtual_stages (2 x 3 = 6) is more than "
                   "the model's 4 layers")
        self.fails("{mode: pipeline, stages: 2, microbatches: 4, schedule: interleaved_1f1b, "
                   "virtual_stages: 2, partition: [2, 2]}", 2,
                   "has 2 entries but the model is cut into 4 chunks (stages 2 x virtual_stages 2)")

    def test_zero_bubble_refuses_a_reduction_each_micro_batch(self):
        self.fails("{mode: zero, zero_stage: 2, stages: 2, microbatches: 4, "
                   "schedule: zero_bubble}", 4, "parallel.schedule", "zero_stage 1")


if __name__ == "__main__":
    unittest.main()
