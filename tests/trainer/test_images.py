"""Image models on IDX data end to end: the built-in CNN under 2-rank DDP equals one process on the
concatenated batch; augmentation (random crop + flip) is deterministic and a run stopped and
resumed mid-epoch ends bit-identical to one that ran straight through; the weights `launch`
writes for Fashion-MNIST load into PyTorch's own CNN and score exactly final.json's accuracy, also
under Local SGD (whose ranks end with the same BatchNorm statistics); image/model mismatches and broken IDX files fail naming the key or the file."""

import json
import os
import subprocess
import unittest

from trainer_helpers import (IDX_CLASSES, TRAIN, final, free_port, metrics, params, rank_env,
                             rel_diff, run_ranks, write_config, write_split)
import harness

HAVE_BINARIES = os.path.exists(TRAIN) and os.path.exists(harness.LAUNCH)
FASHION = "/usr/share/datasets/fashion-mnist"
BENCH = os.path.join(harness.REPO, "scripts", "bench")
RUN_TIMEOUT = 90  # each run takes seconds; the bound only turns a hang into a failure

TRAIN_N, EVAL_N, SIDE = 256, 64, 8
# write_split's pixel statistics (noise 0-110 plus 0-40 on one quadrant, /255). Centering matters:
# with Fashion-MNIST's or 0.5/0.25 every input is negative and this CNN without batch norm does
# not learn within 40 steps (the loss stays at ln 4).
MEAN, STD = 0.235, 0.135

TINY_JOB = """
train:
  seed: 7
  output_dir: {out}
  model: {{type: cnn, channels: [4, 8], hidden: 16, classes: {classes}, input: [1, {side}, {side}],
          batch_norm: {bn}, dropout: 0}}
  data: {{type: idx, path: {data}, mean: {mean}, std: {std}{augment}}}
  batch_size: {batch}
  max_steps: {steps}
  optimizer: {{type: sgd, lr: 0.05, momentum: 0.9}}
  scheduler: {{type: constant}}
  parallel: {{mode: {mode}}}
  checkpoint_every: {every}
  resume: {resume}
"""


def tiny_data(tmp):
    data = os.path.join(tmp, "idx")
    os.makedirs(data)
    write_split(data, "train", TRAIN_N, seed=11, side=SIDE)
    write_split(data, "t10k", EVAL_N, seed=12, side=SIDE)
    return data


def tiny_job(tmp, name, data, batch, steps, mode="ddp", bn="false", augment="", every=0,
             resume="never"):
    out = os.path.join(tmp, name)
    cfg = write_config(tmp, TINY_JOB.format(
        out=out, data=data, batch=batch, steps=steps, mode=mode, bn=bn, augment=augment,
        every=every, resume=resume, classes=IDX_CLASSES, side=SIDE, mean=MEAN, std=STD),
        name + ".yaml")
    return cfg, out


@unittest.skipUnless(HAVE_BINARIES, harness.needs_setup(f"{TRAIN} or {harness.LAUNCH} not built"))
class TinyImagesTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()
        self.data = tiny_data(self.tmp)

    def test_cnn_ddp_equals_one_process(self):
        # Without batch norm: BatchNorm normalises each rank's own batch of 8, so DDP with BN is
        # not one batch of 16 (PyTorch's DDP behaves the same way). BN under DDP is compared
        # with PyTorch's DDP itself in test_torch_parity.
        # 40 steps (2.5 epochs of 16 steps): the loss of this weak signal only falls after ~25.
        ddp_cfg, ddp_out = tiny_job(self.tmp, "ddp", self.data, batch=8, steps=40)
        ref_cfg, ref_out = tiny_job(self.tmp, "ref", self.data, batch=16, steps=40, mode="none")
        run_ranks(ddp_cfg, 2, ["--dump_params"], timeout=RUN_TIMEOUT)
        run_ranks(ref_cfg, 1, ["--dump_params"], timeout=RUN_TIMEOUT)
        ddp0, ddp1, ref = params(ddp_out, 0), params(ddp_out, 1), params(ref_out, 0)
        self.assertEqual(ddp0, ddp1, "DDP replicas diverged")
        rel, worst = rel_diff(ddp0, ref)
        self.assertLess(rel, 1e-5, f"relative difference {rel:g} (max abs {worst:g})")
        f = final(ddp_out)
        self.assertEqual((f["strategy"], f["world_size"], f["steps"]), ("ddp", 2, 40), f)
        self.assertEqual(final(ref_out)["strategy"], "none")
        # Training really moved the weights (a trainer that does nothing would also "agree"):
        # per-step losses of 8 images are noisy, so compare the means of the first and last 5.
        m = [x["loss"] for x in metrics(ddp_out)]
        self.assertEqual(len(m), 40)
        self.assertLess(sum(m[-5:]) / 5, 0.9 * sum(m[:5]) / 5, m)
        self.assertGreater(f["eval_accuracy"], 0.5, f)  # chance is 0.25

    def test_cnn_with_sync_batchnorm_under_ddp_and_dp_equals_one_process(self):
        # parallel.sync_batchnorm: the CNN's batch norms take the statistics of both ranks' (or
        # replicas') rows, so 2 x 8 trains as one process on 16, BatchNorm included: the
        # parameters, and the running statistics behind the final evaluation.
        ref_cfg, ref_out = tiny_job(self.tmp, "bn_ref", self.data, batch=16, steps=24, bn="true",
                                    mode="none")
        run_ranks(ref_cfg, 1, ["--dump_params"], timeout=RUN_TIMEOUT)
        ref, ref_final = params(ref_out, 0), final(ref_out)
        runs = {"ddp": ("ddp, sync_batchnorm: true", 2, 8),
                "dp": ("dp, sync_batchnorm: true", 1, 16),
                "plain": ("ddp", 2, 8)}
        got = {}
        for name, (mode, world, batch) in runs.items():
            cfg, out = tiny_job(self.tmp, "bn_" + name, self.data, batch=batch, steps=24,
                                bn="true", mode=mode)
            run_ranks(cfg, world, ["--dump_params"], timeout=RUN_TIMEOUT)
            if world == 2:
                self.assertEqual(params(out, 0), params(out, 1), f"{name}: replicas diverged")
            got[name] = (rel_diff(params(out, 0), ref)[0], final(out))
        for name in ("ddp", "dp"):
            rel, f = got[name]
            self.assertLess(rel, 1e-5, f"{name}: relative difference {rel:g}")
            self.assertAlmostEqual(f["eval_loss"], ref_final["eval_loss"],
                                   delta=1e-5 * ref_final["eval_loss"])
        # Without it each rank normalises its own 8 rows: not one process on 16.
        self.assertGreater(got["plain"][0], 1e-3)

    def test_augmentation_is_deterministic_and_resumes_exactly(self):
        # 256 images / 2 ranks / batch 8 = 16 steps per epoch: step 20 is mid-way through the
        # second epoch, so the resumed run must restore the data position and the augmentation.
        augment = ", augment: {crop_padding: 2, flip: true}"
        a_cfg, a_out = tiny_job(self.tmp, "a", self.data, 8, 40, bn="true", augment=augment,
                                every=10, resume="auto")
        b_cfg, b_out = tiny_job(self.tmp, "b", self.data, 8, 40, bn="true", augment=augment,
                                every=10, resume="auto")
        c_cfg, c_out = tiny_job(self.tmp, "c", self.data, 8, 40, bn="true", every=10,
                                resume="auto")
        run_ranks(a_cfg, 2, timeout=RUN_TIMEOUT)
        first = run_ranks(b_cfg, 2, ["--max_steps", "20"], timeout=RUN_TIMEOUT)
        b1 = final(b_out)
        self.assertEqual((b1["steps"], b1["steps_this_run"]), (20, 20), b1)
        second = run_ranks(b_cfg, 2, timeout=RUN_TIMEOUT)
        b2 = final(b_out)
        self.assertEqual((b2["steps"], b2["steps_this_run"]), (40, 20), b2)
        self.assertNotIn("resumed from", first[0][1] + first[0][2])
        self.assertIn("resumed from", second[0][1] + second[0][2])
        a = final(a_out)
        self.assertEqual((a["steps"], a["steps_this_run"]), (40, 40), a)
        self.assertEqual(b2["param_checksum"], a["param_checksum"],
                         "stopped at 20 and resumed != straight to 40")
        self.assertNotEqual(b1["param_checksum"], a["param_checksum"])
        run_ranks(c_cfg, 2, timeout=RUN_TIMEOUT)
        self.assertNotEqual(final(c_out)["param_checksum"], a["param_checksum"],
                            "augmentation changed nothing")


# Scores model.pt with scripts/bench/fashion_mnist_torch.Cnn on all t10k images; prints JSON.
SCORE = r"""
import json, sys
import torch
spec = json.loads(sys.argv[1])
sys.path.insert(0, spec["bench"])
from fashion_mnist_torch import Cnn, load_split
torch.set_num_threads(1)
sd = torch.load(spec["model"])
report = {"is_dict": isinstance(sd, dict),
          "all_tensors": all(isinstance(v, torch.Tensor) for v in sd.values()),
          "keys": sorted(sd)}
model = Cnn(spec["channels"], spec["hidden"], spec["dropout"])
model.load_state_dict(sd, strict=True)
model.eval()
x, y = load_split(spec["data"], "t10k")
correct, loss_sum = 0, 0.0
with torch.no_grad():
    for xs, ys in zip(x.split(1000), y.split(1000)):
        logits = model(xs)
        correct += int((logits.argmax(1) == ys).sum())
        loss_sum += torch.nn.functional.cross_entropy(logits, ys, reduction="sum").item()
report.update(correct=correct, total=len(y), loss=loss_sum / len(y))
print(json.dumps(report))
"""


@unittest.skipUnless(HAVE_BINARIES, harness.needs_setup(f"{TRAIN} or {harness.LAUNCH} not built"))
@unittest.skipUnless(os.path.isdir(FASHION),
                     harness.needs_setup(f"{FASHION} missing (Debian dataset-fashion-mnist)"))
class FashionMnistWeightsTest(unittest.TestCase):
    def test_trained_weights_load_in_python_with_the_reported_accuracy(self):
        tmp = harness.tmpdir()
        out = os.path.join(tmp, "fm")
        cfg = write_config(tmp, f"""distributed_type: MULTI_CPU
num_processes: 2
train:
  seed: 42
  output_dir: {out}
  model: {{type: cnn, channels: [8, 16], hidden: 64, dropout: 0.25}}
  data: {{type: idx}}
  batch_size: 64
  max_steps: 120
  optimizer: {{type: adamw, lr: 3.0e-3, weight_decay: 0.01}}
  scheduler: {{type: cosine, warmup_steps: 20}}
  parallel: {{mode: ddp}}
  checkpoint_every: 0
  resume: never
""", "fm.yaml")
        r = harness.launch(cfg, timeout=RUN_TIMEOUT)
        self.assertEqual(r.returncode, 0, f"launch:\n{r.stdout}{r.stderr}")
        f = final(out)
        self.assertEqual((f["steps"], f["world_size"]), (120, 2), f)
        spec = {"bench": BENCH, "model": os.path.join(out, "model.pt"), "data": FASHION,
                "channels": [8, 16], "hidden": 64, "dropout": 0.25}
        s = harness.run([harness.SYSTEM_PYTHON, "-c", SCORE, json.dumps(spec)],
                        timeout=RUN_TIMEOUT)
        self.assertEqual(s.returncode, 0, f"scoring model.pt in PyTorch failed:\n{s.stderr}")
        rep = json.loads(s.stdout)
        self.assertTrue(rep["is_dict"] and rep["all_tensors"], rep["keys"])
        self.assertEqual(rep["total"], 10000)
        # Exactly: the same weights, the same 10,000 images, the same argmax.
        self.assertEqual(rep["correct"] / rep["total"], f["eval_accuracy"],
                         f"PyTorch scores {rep['correct']}/10000")
        self.assertGreater(f["eval_accuracy"], 0.75, f)
        # The loss only up to float rounding (the trainer scores in chunks of 256, this in 1000).
        self.assertAlmostEqual(rep["loss"], f["eval_loss"], delta=1e-5 * f["eval_loss"])


# Every buffer of two checkpoint files (Accelerator::SaveState's archives: TorchScript modules whose
# tensors are named buffer/<name>) compared; prints JSON.
BUFFERS = r"""
import json, sys
import torch
a, b = (torch.jit.load(p) for p in sys.argv[1:3])
def buffers(m):
    return {k: v for k, v in m.state_dict().items() if k.startswith("buffer/")}
ba, bb = buffers(a), buffers(b)
print(json.dumps({"names": sorted(ba), "same_names": sorted(ba) == sorted(bb),
                  "max_diff": max(float((ba[k].double() - bb[k].double()).abs().max())
                                  for k in ba)}))
"""


@unittest.skipUnless(HAVE_BINARIES, harness.needs_setup(f"{TRAIN} or {harness.LAUNCH} not built"))
@unittest.skipUnless(os.path.isdir(FASHION),
                     harness.needs_setup(f"{FASHION} missing (Debian dataset-fashion-mnist)"))
class LocalSgdBatchNormTest(unittest.TestCase):
    def test_local_sgd_model_pt_scores_final_json_accuracy_with_equal_buffers(self):
        # Local SGD averages the BatchNorm statistics with the parameters, at each sync and at
        # the end: both ranks hold the same model, and the file PyTorch loads scores exactly the
        # accuracy the (all-rank) evaluation reported. 60 steps, K = 25: the end's average
        # follows 10 local steps in which each rank's statistics moved on its own data.
        tmp = harness.tmpdir()
        out = os.path.join(tmp, "lsgd")
        cfg = write_config(tmp, f"""distributed_type: MULTI_CPU
num_processes: 2
train:
  seed: 42
  output_dir: {out}
  model: {{type: cnn, channels: [8, 16], hidden: 64, dropout: 0}}
  data: {{type: idx}}
  batch_size: 64
  max_steps: 60
  optimizer: {{type: adamw, lr: 3.0e-3, weight_decay: 0.01}}
  scheduler: {{type: constant}}
  parallel: {{mode: ddp}}
  local_sgd_steps: 25
  checkpoint_every: 0
  resume: never
""", "lsgd.yaml")
        r = harness.launch(cfg, timeout=RUN_TIMEOUT)
        self.assertEqual(r.returncode, 0, f"launch:\n{r.stdout}{r.stderr}")
        f = final(out)
        self.assertEqual((f["steps"], f["world_size"]), (60, 2), f)
        step = os.path.join(out, "checkpoints", "step60")
        b = harness.run([harness.SYSTEM_PYTHON, "-c", BUFFERS, os.path.join(step, "model_rank0.pt"),
                         os.path.join(step, "model_rank1.pt")], timeout=RUN_TIMEOUT)
        self.assertEqual(b.returncode, 0, f"reading the checkpoints failed:\n{b.stderr}")
        buf = json.loads(b.stdout)
        self.assertTrue(buf["same_names"], buf)
        self.assertIn("buffer/bn2.running_var", buf["names"])
        self.assertEqual(buf["max_diff"], 0.0, "the ranks' BatchNorm statistics differ")
        spec = {"bench": BENCH, "model": os.path.join(out, "model.pt"), "data": FASHION,
                "channels": [8, 16], "hidden": 64, "dropout": 0}
        s = harness.run([harness.SYSTEM_PYTHON, "-c", SCORE, json.dumps(spec)],
                        timeout=RUN_TIMEOUT)
        self.assertEqual(s.returncode, 0, f"scoring model.pt in PyTorch failed:\n{s.stderr}")
        rep = json.loads(s.stdout)
        self.assertEqual(rep["total"], 10000)
        self.assertEqual(rep["correct"] / rep["total"], f["eval_accuracy"],
                         f"PyTorch scores {rep['correct']}/10000")


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class BadImageConfigTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()
        self.data = tiny_data(self.tmp)

    def train_fails(self, model, data):
        """Runs one rank of `train`; returns its stderr + stdout after checking it failed as a
        configuration error (exit 2) without training."""
        out = os.path.join(self.tmp, "out")
        cfg = write_config(self.tmp, f"""
train:
  output_dir: {out}
  model: {model}
  data: {data}
  batch_size: 8
  max_steps: 2
  checkpoint_every: 0
  resume: never
""", "bad.yaml")
        r = subprocess.run([TRAIN, cfg], capture_output=True, text=True, timeout=60,
                           env=rank_env(0, 1, free_port()))
        text = r.stderr + r.stdout
        self.assertEqual(r.returncode, 2, text)
        self.assertFalse(os.path.exists(os.path.join(out, "final.json")), text)
        return text

    def test_bad_image_configs_fail_with_the_key_named(self):
        idx = f"{{type: idx, path: {self.data}}}"
        with self.subTest("cnn input shape"):
            text = self.train_fails("{type: cnn, channels: [4], hidden: 8, classes: 4, "
                                    "input: [1, 28, 28]}", idx)
            self.assertIn("train.model.input", text)
            self.assertIn("[1, 8, 8]", text)
        with self.subTest("mlp first width"):
            text = self.train_fails("{type: mlp, layers: [100, 16, 4]}", idx)
            self.assertIn("train.model.layers", text)
            self.assertIn("64 pixels", text)
        with self.subTest("no IDX files"):
            empty = os.path.join(self.tmp, "empty")
            os.makedirs(empty)
            text = self.train_fails("{type: mlp, layers: [64, 16, 4]}",
                                    f"{{type: idx, path: {empty}}}")
            self.assertIn(os.path.join(empty, "train-images-idx3-ubyte"), text)
        with self.subTest("truncated images"):
            cut = os.path.join(self.tmp, "cut")
            os.makedirs(cut)
            write_split(cut, "train", TRAIN_N, seed=11, side=SIDE)
            images = os.path.join(cut, "train-images-idx3-ubyte")
            with open(images, "r+b") as fh:
                fh.truncate(os.path.getsize(images) - 100)  # header intact, pixels short
            text = self.train_fails("{type: mlp, layers: [64, 16, 4]}",
                                    f"{{type: idx, path: {cut}}}")
            self.assertIn(images, text)
            self.assertIn("truncated", text)


if __name__ == "__main__":
    unittest.main()
