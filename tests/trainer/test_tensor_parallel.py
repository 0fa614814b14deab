"""Tensor parallelism (train.parallel.tensor; model/tensor_parallel.h) against one process and DDP
on the same data and seed: real `train` processes split the built-in transformer's heads, MLP and
vocabulary (Megatron's layers) and must end where the whole model does, within float32's
reordering of sums: alone (tensor 2), with dropout (each rank keeps its part of the whole mask)
and clipping (the norm counts replicated parameters once); by DDP and ZeRO on the data axis
(tensor 2 x data 2); with sequence parallelism. model.pt is the whole model under the whole
model's names; checkpoints keep one folder per tensor shard, resume bit-identically, and resume
with another tensor and pipeline layout (re-cut); bad splits are refused naming the key."""

import os
import unittest

from trainer_helpers import (TRAIN, compare_models, final, metrics, run_ranks, start_ranks,
                             wait_all, write_config)
import harness

BASE = """
train:
  seed: 5
  output_dir: {out}
  model: {model}
  data: {{type: text, path: /usr/share/common-licenses/GPL-3, context: 16}}
  eval_fraction: 0.05
  batch_size: 8
  max_steps: {steps}
  optimizer: {{type: adamw, lr: 0.003, weight_decay: 0.1}}
  max_grad_norm: {clip}
  checkpoint_every: {ckpt}
  resume: {resume}
  log_every: 1
  parallel: {{mode: {mode}, tensor: {tensor}{extra}}}
  local_sgd_steps: {local_sgd}
"""

def config(tmp, name, tensor=2, mode="ddp", steps=12, dropout=0.0, clip=0.5, ckpt=0,
           resume="never", model=None, extra="", local_sgd=0, out=None):
    out = out or os.path.join(tmp, name)
    model = model or ("{type: transformer, vocab: bytes, d_model: 32, layers: 2, heads: 4, "
                      f"context: 16, dropout: {dropout}}}")
    text = BASE.format(out=out, model=model, dropout=dropout, steps=steps, clip=clip, ckpt=ckpt,
                       resume=resume, mode=mode, tensor=tensor, extra=extra,
                       local_sgd=local_sgd)
    return write_config(tmp, text, name + ".yaml"), out


def train(cfg, world):
    return "".join(out + err for _, out, err in run_ranks(cfg, world, timeout=180))


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class TensorParallelTest(unittest.TestCase):
    references = {}  # (world, dropout) -> the unsplit run's folder, run once for every test

    def setUp(self):
        self.tmp = harness.tmpdir()

    def reference(self, world, dropout=0.0):
        """The same training unsplit (tensor 1): one process, or DDP over `world` ranks."""
        key = (world, dropout)
        if key not in self.references:
            tmp = harness.tmpdir()
            cfg, out = config(tmp, f"whole_w{world}", tensor=1, dropout=dropout)
            train(cfg, world)
            self.references[key] = out
        return self.references[key]

    def compare(self, out_a, out_b, stages=1):
        a = ",".join(os.path.join(out_a, f"model_stage{s}.pt") for s in range(stages))
        got = compare_models(a if stages > 1 else os.path.join(out_a, "model.pt"),
                             os.path.join(out_b, "model.pt"))
        self.assertTrue(got["same_names_and_shapes"], got)
        self.ratio = got["ratio"]
        return got["max_abs_diff"]

    def check_near(self, split_out, whole_out, tol=5e-5, stages=1, assert_close=True):
        diff = self.compare(split_out, whole_out, stages)
        self.assertLess(diff, tol, "the split model ended elsewhere than the whole one")
        # Within torch.testing.assert_close's float32 tolerances (the goal for every
        # layout of gradient-averaging modes).
        if assert_close:
            self.assertLessEqual(self.ratio, 1.0, f"max abs difference {diff:g}")
        a, b = metrics(split_out), metrics(whole_out)
        self.assertEqual([m["step"] for m in a], [m["step"] for m in b])
        for x, y in zip(a, b):
            self.assertAlmostEqual(x["loss"], y["loss"], delta=1e-4)
        self.assertLess(a[-1]["loss"], a[0]["loss"])
        return diff

    def test_two_ranks_split_the_layers_and_train_as_one_process_with_dropout_and_clipping(self):
        split_cfg, split_out = config(self.tmp, "split", dropout=0.1)
        log = train(split_cfg, 2)
        whole_out = self.reference(1, dropout=0.1)
        self.assertIn("tensor 2", log)
        self.check_near(split_out, whole_out)
        # Each rank holds about half the model (norms, biases after a sum and the position
        # embedding stay whole).
        held = final(split_out)["state_bytes"]["parameters"]
        whole = final(whole_out)["state_bytes"]["parameters"][0]
        self.assertEqual(len(held), 2)
        for b in held:
            self.assertLess(b, 0.6 * whole)

    def test_dropout_masks_follow_the_whole_model(self):
        # The same run without the per-rank part of the mask would differ at the first step.
        split_cfg, split_out = config(self.tmp, "split_drop", dropout=0.3, steps=3)
        whole_cfg, whole_out = config(self.tmp, "whole_drop", tensor=1, dropout=0.3, steps=3)
        train(split_cfg, 2)
        train(whole_cfg, 1)
        self.check_near(split_out, whole_out)

    def test_tensor_by_data_ddp_with_sequence_parallelism_matches_ddp(self):
        split_cfg, split_out = config(self.tmp, "tp_dp_sp", extra=", sequence_parallel: true")
        log = train(split_cfg, 4)
        whole_out = self.reference(2)
        self.assertIn("tensor 2 x data 2", log)
        self.check_near(split_out, whole_out)

    def test_zero_on_the_data_axis_matches_ddp(self):
        # Clipping by the norm of gradients split over both axes.
        split_cfg, split_out = config(self.tmp, "tp_zero", mode="zero", extra=", zero_stage: 2")
        train(split_cfg, 4)
        whole_out = self.reference(2)
        self.assertEqual(final(split_out)["strategy"], "zero")
        self.check_near(split_out, whole_out)

    def test_local_sgd_averages_each_shard_over_its_data_group(self):
        # DiLoCo's outer Nesterov step every 4 steps, on each tensor shard's replicas.
        extra = ", sequence_parallel: true"
        split_cfg, split_out = config(self.tmp, "tp_diloco", local_sgd=4, clip=0.0,
                                      extra=extra + "}\n  local_sgd: {outer: nesterov, outer_lr: 0.7")
        whole_cfg, whole_out = config(self.tmp, "diloco", tensor=1, local_sgd=4, clip=0.0,
                                      extra="}\n  local_sgd: {outer: nesterov, outer_lr: 0.7")
        train(split_cfg, 4)
        train(whole_cfg, 2)
        # The outer Nesterov step (lr 0.7 on the averaged deltas) magnifies the split sums'
        # reordering: 1.08e-5 against assert_close's 1e-5 + 1.3e-6 |w| on LibTorch 2.6.
        self.check_near(split_out, whole_out, assert_close=False)

    def test_tensor_inside_pipeline_stages_matches_one_process(self):
        # tensor 2 x stages 2, sequence parallel: the activations between the stages are
        # sequence shards; each stage's model file is its part of the whole model, and rank 0
        # joins them into model.pt (the whole model, compared here).
        split_cfg, split_out = config(self.tmp, "tp_pp",
                                      extra=", stages: 2, microbatches: 2, sequence_parallel: true")
        log = train(split_cfg, 4)
        whole_out = self.reference(1)
        self.assertIn("tensor 2", log)
        self.check_near(split_out, whole_out)
        self.assertEqual(self.compare(split_out, split_out, stages=2), 0.0)

    def test_three_axes_tensor_data_stages_match_ddp(self):
        # 8 processes: tensor 2 x data 2 x stages 2 (Megatron's rank order), clipping over all
        # three; a checkpoint folder per (stage, tensor) shard.
        split_cfg, split_out = config(self.tmp, "3d", ckpt=12,
                                      extra=", stages: 2, microbatches: 2")
        log = train(split_cfg, 8)
        whole_out = self.reference(2)
        self.assertIn("tensor 2 x data 2 x stage 2", log)
        self.check_near(split_out, whole_out, stages=2)
        step = os.listdir(os.path.join(split_out, "checkpoints", "step12"))
        for shard in ("stage0_tensor0", "stage0_tensor1", "stage1_tensor0", "stage1_tensor1"):
            self.assertIn(shard, step)

    def test_checkpoints_keep_a_folder_per_shard_and_resume_bit_identically(self):
        whole_cfg, whole_out = config(self.tmp, "through", steps=8)
        train(whole_cfg, 2)
        half_cfg, half_out = config(self.tmp, "halves", steps=4, ckpt=4, resume="auto")
        train(half_cfg, 2)
        step = os.path.join(half_out, "checkpoints", "step4")
        for shard in ("tensor0", "tensor1"):
            self.assertIn("model.pt", os.listdir(os.path.join(step, shard)))
        rest_cfg, _ = config(self.tmp, "halves", steps=8, ckpt=4, resume="auto")
        log = train(rest_cfg, 2)
        self.assertIn("resum", log)
        self.assertEqual(self.compare(half_out, whole_out), 0.0)

    def test_a_checkpoint_resumes_with_another_tensor_and_pipeline_layout(self):
        # tensor 2 x stages 2 for 6 steps, one process (tensor 1, one stage) for 3, tensor 2
        # for the last 3: each resume re-cuts the shards (parameters and AdamW's moments) and
        # the run ends where one uninterrupted process does.
        out = os.path.join(self.tmp, "recut")
        legs = [(4, 2, 6, ", stages: 2, microbatches: 2"), (1, 1, 9, ""), (2, 2, 12, "")]
        logs = []
        for world, tensor, steps, extra in legs:
            cfg, _ = config(self.tmp, f"recut{steps}", tensor=tensor, steps=steps, ckpt=3,
                            resume="auto", extra=extra, out=out)
            logs.append(train(cfg, world))
        self.assertIn("was cut as tensor 2 x stages 2; each rank re-cuts its shard for 1 process",
                      logs[1])
        self.assertIn("was cut as the whole model; each rank re-cuts its shard for tensor 2",
                      logs[2])
        step = os.path.join(out, "checkpoints", "step12", "tensor1")
        self.assertIn("zero_rank0.pt", os.listdir(step))  # the optimizer state in pieces
        self.assertFalse([f for f in os.listdir(os.path.join(out, "checkpoints"))
                          if f.startswith(".recut")])
        self.assertLess(self.compare(out, self.reference(1)), 5e-5)

    def refused(self, cfg, world):
        procs, _ = start_ranks(cfg, world)
        results = wait_all(procs, 60)
        for rc, out, err in results:
            self.assertNotEqual(rc, 0)
        return results[0][2]

    def test_bad_splits_are_refused_naming_the_key(self):
        cfg, _ = config(self.tmp, "heads", tensor=3)
        self.assertIn("train.parallel.tensor: 3 does not divide model.heads 4", self.refused(cfg, 3))
        cfg, _ = config(self.tmp, "mlp", model="{type: mlp, layers: [16, 8, 256]}")
        self.assertIn("model.type mlp has no tensor-parallel layers", self.refused(cfg, 2))
        cfg, _ = config(self.tmp, "sp_alone", tensor=1, extra=", sequence_parallel: true")
        self.assertIn("train.parallel.sequence_parallel", self.refused(cfg, 1))


if __name__ == "__main__":
    unittest.main()
