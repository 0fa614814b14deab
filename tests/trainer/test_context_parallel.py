"""Context parallelism (train.parallel.context; DeepSpeed-Ulysses, model/tensor_parallel.h's
AllToAllRegion) against one process and DDP on the same data and seed: real `train` processes
split every sequence of the built-in transformer, exchange sequence for heads around attention,
and must end where the whole model does within float32's reordering of sums: alone (context 2,
with dropout and clipping), with tensor and sequence parallelism (context 2 x tensor 2), with
ZeRO-3 on the data axis (context 2 x data 2, gradients averaged over context x data); the logged
losses are the whole sequences'; checkpoints resume bit-identically and at another context
degree; bad layouts are refused naming the key."""

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
  eval_every: {eval_every}
  batch_size: 8
  max_steps: {steps}
  optimizer: {{type: adamw, lr: 0.003, weight_decay: 0.1}}
  max_grad_norm: 0.5
  checkpoint_every: {ckpt}
  resume: {resume}
  log_every: 1
  parallel: {{mode: {mode}, context: {context}{extra}}}
  local_sgd_steps: {local_sgd}
"""


def config(tmp, name, context=2, mode="ddp", steps=12, dropout=0.1, ckpt=0, resume="never",
           model=None, extra="", local_sgd=0, out=None, eval_every=6):
    out = out or os.path.join(tmp, name)
    model = model or ("{type: transformer, vocab: bytes, d_model: 32, layers: 2, heads: 4, "
                      f"context: 16, dropout: {dropout}}}")
    text = BASE.format(out=out, model=model, steps=steps, ckpt=ckpt, resume=resume, mode=mode,
                       context=context, extra=extra, local_sgd=local_sgd, eval_every=eval_every)
    return write_config(tmp, text, name + ".yaml"), out


def train(cfg, world):
    return "".join(out + err for _, out, err in run_ranks(cfg, world, timeout=180))


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class ContextParallelTest(unittest.TestCase):
    references = {}  # world -> the unsplit run's folder (one process, or DDP), run once

    def setUp(self):
        self.tmp = harness.tmpdir()

    def reference(self, world):
        """The same training unsplit (context 1): one process, or DDP over `world` ranks."""
        if world not in self.references:
            tmp = harness.tmpdir()
            cfg, out = config(tmp, f"whole_w{world}", context=1)
            train(cfg, world)
            self.references[world] = out
        return self.references[world]

    def check_near(self, split_out, whole_out):
        got = compare_models(os.path.join(split_out, "model.pt"),
                             os.path.join(whole_out, "model.pt"))
        self.assertTrue(got["same_names_and_shapes"], got)
        # Within torch.testing.assert_close's float32 tolerances.
        self.assertLessEqual(got["ratio"], 1.0, f"max abs difference {got['max_abs_diff']:g}")
        # The logged losses are the whole sequences' (each rank's part averaged over the
        # context group), step by step, and so are the evaluations.
        for evals in (False, True):
            a, b = metrics(split_out, evals), metrics(whole_out, evals)
            self.assertEqual([m["step"] for m in a], [m["step"] for m in b])
            key = "eval_loss" if evals else "loss"
            for x, y in zip(a, b):
                self.assertAlmostEqual(x[key], y[key], delta=1e-4)
        self.assertLess(metrics(split_out)[-1]["loss"], metrics(split_out)[0]["loss"])
        self.assertAlmostEqual(final(split_out)["eval_loss"], final(whole_out)["eval_loss"],
                               delta=1e-4)
        return got["max_abs_diff"]

    def test_two_context_ranks_train_as_one_process_with_dropout_and_clipping(self):
        split_cfg, split_out = config(self.tmp, "cp2")
        log = train(split_cfg, 2)
        self.assertIn("context 2, ddp", log)
        self.assertIn("x 1 replicas", log)
        self.check_near(split_out, self.reference(1))
        # Both ranks hold the whole model: one model file, no shard folders.
        self.assertEqual(final(split_out)["world_size"], 2)
        # The context group's all-to-alls: 2 per layer forward and 2 backward in each of the 12
        # steps (one micro-batch each, 2 layers), then 2 per layer in each evaluation batch's
        # forward; none in one process.
        alltoalls = final(split_out)["alltoalls_total"]
        self.assertGreaterEqual(alltoalls, 12 * 2 * 4)
        self.assertEqual((alltoalls - 12 * 2 * 4) % (2 * 2), 0, alltoalls)
        self.assertEqual(final(self.reference(1))["alltoalls_total"], 0)

    def test_context_by_tensor_with_sequence_parallelism_matches_one_process(self):
        # 4 ranks: tensor 2 x context 2; attention runs heads / 4 per rank, the rest of each
        # block a quarter of the sequence.
        split_cfg, split_out = config(self.tmp, "tp_cp_sp",
                                      extra=", tensor: 2, sequence_parallel: true")
        log = train(split_cfg, 4)
        self.assertIn("tensor 2 x context 2 (sequence parallel)", log)
        self.check_near(split_out, self.reference(1))

    def test_context_by_data_with_zero3_matches_ddp(self):
        # Gradients are reduce-scattered over context x data (4 ranks) and the parameters
        # gathered per block: the same run as DDP over the 2 data replicas.
        split_cfg, split_out = config(self.tmp, "cp_dp_zero3", mode="zero",
                                      extra=", zero_stage: 3")
        log = train(split_cfg, 4)
        self.assertIn("context 2 x data 2", log)
        self.assertEqual(final(split_out)["strategy"], "zero")
        self.check_near(split_out, self.reference(2))

    def test_checkpoints_resume_bit_identically_and_at_another_context_degree(self):
        through_cfg, through_out = config(self.tmp, "through")
        train(through_cfg, 2)
        out = os.path.join(self.tmp, "halves")
        for steps in (6, 12):
            cfg, _ = config(self.tmp, f"halves{steps}", steps=steps, ckpt=6, resume="auto", out=out)
            log = train(cfg, 2)
        self.assertIn("resum", log)
        got = compare_models(os.path.join(out, "model.pt"), os.path.join(through_out, "model.pt"))
        self.assertEqual(got["max_abs_diff"], 0.0)
        # Context ranks hold the whole model, so any degree resumes it: 6 steps at context 2,
        # the rest in one process, ends where one process does all along.
        out = os.path.join(self.tmp, "regrouped")
        for world, context, steps in ((2, 2, 6), (1, 1, 12)):
            cfg, _ = config(self.tmp, f"regrouped{steps}", context=context, steps=steps, ckpt=6,
                            resume="auto", out=out)
            train(cfg, world)
        got = compare_models(os.path.join(out, "model.pt"),
                             os.path.join(self.reference(1), "model.pt"))
        self.assertLessEqual(got["ratio"], 1.0, got)

    def refused(self, cfg, world):
        procs, _ = start_ranks(cfg, world)
        results = wait_all(procs, 60)
        for rc, out, err in results:
            self.assertNotEqual(rc, 0)
        return results[0][2]

    def test_bad_layouts_are_refused_naming_the_key(self):
        cfg, _ = config(self.tmp, "heads", context=4, extra=", tensor: 2")
        self.assertIn("train.parallel.context: tensor x context (2 x 4) does not divide "
                      "model.heads 4", self.refused(cfg, 8))
        cfg, _ = config(self.tmp, "world", context=2)
        self.assertIn("train.parallel.context: stages x tensor x context (1 x 1 x 2) does not "
                      "divide the world size 3", self.refused(cfg, 3))
        cfg, _ = config(self.tmp, "mlp", model="{type: mlp, layers: [16, 8, 256]}")
        self.assertIn("train.parallel.context: splits the built-in transformer's sequences; "
                      "model.type mlp has none", self.refused(cfg, 2))
        cfg, _ = config(self.tmp, "diloco", local_sgd=4)
        self.assertIn("Local SGD lets replicas drift", self.refused(cfg, 2))
        cfg, _ = config(self.tmp, "stages", extra=", stages: 2")
        self.assertIn("train.parallel.context: does not combine with pipeline stages",
                      self.refused(cfg, 4))


if __name__ == "__main__":
    unittest.main()
