"""`train`'s optimizer, schedule, clipping and loss options against PyTorch itself, end to end:
the same TorchScript model, data order and steps trained by two `train` ranks (DDP) and by two
PyTorch DDP processes (torch_ddp_reference.py: torch.optim.AdamW with Hugging Face's no-decay
groups, SequentialLR(LinearLR, CosineAnnealingLR), clip_grad_norm_, F.cross_entropy's
label_smoothing / weight / ignore_index), then every parameter compared (within 1e-5).

Each case also shows that its option changed the result, so a trainer that ignored it would
fail: a run without the option lands measurably away from PyTorch's (no-decay groups, class
weights, ignore_index, label smoothing), the learning rate of every step is PyTorch's
scheduler's (metrics.jsonl), and clipping was active on every step."""

import json
import os
import re
import shutil
import unittest

from trainer_helpers import LIBTORCH_MAJOR, TRAIN, final, metrics, write_config, write_split
import harness

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = os.path.join(HERE, "torch_ddp_reference.py")
HAVE_BINARIES = os.path.exists(TRAIN) and os.path.exists(harness.LAUNCH)

TRAIN_N, EVAL_N = 256, 64  # 8x8 images, 4 classes (trainer_helpers.write_split)
SEED, BATCH, EPOCHS = 7, 8, 1
STEPS = EPOCHS * (TRAIN_N // 2 // BATCH)  # 128 samples per rank: 16 steps
RUN_TIMEOUT = 90  # each run takes a few seconds; the bound only turns a hang into a failure
TOLERANCE = 1e-5

# Linear, LayerNorm (its parameters are left out of weight decay by type: the name says
# nothing), Linear. Written to a file and scripted by Debian's python3.
EXPORT = r'''
import sys
import torch
from torch import nn


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(64, 32)
        self.ln = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.ln(self.stem(x.flatten(1)))))


torch.manual_seed(0)
torch.jit.script(NormNet()).save(sys.argv[1])
'''

# Our trained module (model.pt) against PyTorch's state_dict: the largest difference per tensor.
COMPARE = r'''
import json, sys
import torch
ours = torch.jit.load(sys.argv[1]).state_dict()
ref = torch.load(sys.argv[2])
initial = torch.jit.load(sys.argv[3]).state_dict()
print(json.dumps({
    "keys": [sorted(ours), sorted(ref)],
    "diff": {n: (ours[n] - ref[n]).abs().max().item() for n in ref},
    "moved": {n: (ours[n] - initial[n]).abs().max().item() for n in ref},
}))
'''

JOB = """distributed_type: MULTI_CPU
num_processes: 2
mixed_precision: {precision}
train:
  seed: {seed}
  output_dir: {out}
  model: {{torchscript: {model}}}
  data: {{type: idx, path: {data}, mean: 0.5, std: 0.25}}
  batch_size: {batch}
  epochs: {epochs}
  optimizer: {optimizer}
  scheduler: {scheduler}
  max_grad_norm: {max_grad_norm}
  loss: {loss}
  parallel: {parallel}
  checkpoint_every: 0
  log_every: 1
{extra}"""

SGD = "{type: sgd, lr: 0.05, momentum: 0.9, weight_decay: 0.0}"
SGD_ARGS = ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"]


@unittest.skipUnless(HAVE_BINARIES, harness.needs_setup(f"{TRAIN} or {harness.LAUNCH} not built"))
class TorchReferenceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = harness.tmpdir()
        cls.data = os.path.join(cls.tmp, "idx")
        os.makedirs(cls.data)
        write_split(cls.data, "train", TRAIN_N, seed=11)
        write_split(cls.data, "t10k", EVAL_N, seed=12)
        cls.model = os.path.join(cls.tmp, "norm_net.pt")
        exporter = write_config(cls.tmp, EXPORT, "export.py")
        r = harness.run([harness.SYSTEM_PYTHON, exporter, cls.model], timeout=RUN_TIMEOUT)
        if r.returncode != 0:
            raise AssertionError(f"exporting the model failed:\n{r.stderr}")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def run_ours(self, name, optimizer=SGD, scheduler="{type: constant}", max_grad_norm=0.0,
                 loss="{type: cross_entropy}", precision="'no'", extra="", expect=0,
                 parallel="{mode: ddp}"):
        out = os.path.join(self.tmp, name + "-ours")
        cfg = write_config(self.tmp, JOB.format(
            seed=SEED, out=out, model=self.model, data=self.data, batch=BATCH, epochs=EPOCHS,
            optimizer=optimizer, scheduler=scheduler, max_grad_norm=max_grad_norm, loss=loss,
            precision=precision, extra=extra, parallel=parallel), name + ".yaml")
        r = harness.launch(cfg, timeout=RUN_TIMEOUT)
        self.assertEqual(r.returncode, expect, f"train on {name}:\n{r.stdout}{r.stderr}")
        if expect != 0:
            return r
        self.assertEqual(final(out)["steps"], STEPS)
        return out

    def run_reference(self, name, args):
        ref = os.path.join(self.tmp, name + "-ref.pt")
        r = harness.launch("--nproc_per_node", "2", "--python", harness.SYSTEM_PYTHON, REFERENCE,
                           "--model", self.model, "--data", self.data, "--out", ref,
                           "--seed", str(SEED), "--epochs", str(EPOCHS),
                           "--batch_size", str(BATCH), "--mean", "0.5", "--std", "0.25", *args,
                           timeout=RUN_TIMEOUT)
        self.assertEqual(r.returncode, 0, f"PyTorch reference on {name}:\n{r.stdout}{r.stderr}")
        self.assertIn(f"[rank 0]: steps={STEPS}", r.stdout)
        lrs = json.loads(re.search(r"\[rank 0\]: lrs=(\[.*\])", r.stdout).group(1))
        clipped = int(re.search(r"\[rank 0\]: clipped=(\d+)", r.stdout).group(1))
        self.skipped = int(re.search(r"\[rank 0\]: skipped=(\d+)", r.stdout).group(1))
        return ref, lrs, clipped

    def compare(self, out, ref):
        r = harness.run([harness.SYSTEM_PYTHON, "-c", COMPARE, os.path.join(out, "model.pt"), ref,
                         self.model], timeout=RUN_TIMEOUT)
        self.assertEqual(r.returncode, 0, f"comparison failed:\n{r.stderr}")
        rep = json.loads(r.stdout)
        self.assertEqual(rep["keys"][0], rep["keys"][1])
        return rep

    def assertMatches(self, out, ref):
        """Every parameter within TOLERANCE of PyTorch's, and every one of them trained."""
        rep = self.compare(out, ref)
        far = {n: d for n, d in rep["diff"].items() if d > TOLERANCE}
        self.assertEqual(far, {}, "differ from PyTorch (max |ours - ref|)")
        still = [n for n, m in rep["moved"].items() if m == 0.0]
        self.assertEqual(still, [], "did not train")
        return rep

    def assertDiffers(self, out, ref, names):
        """The run `out` (without the option under test) is measurably away from PyTorch's with
        it, in `names`: the option matters at this tolerance."""
        rep = self.compare(out, ref)
        for n in names:
            self.assertGreater(rep["diff"][n], 100 * TOLERANCE, f"{n}: the option changed nothing")

    def test_adamw_leaves_biases_and_normalisation_layers_out_of_weight_decay(self):
        adamw = "{type: adamw, lr: 0.01, weight_decay: 0.5, no_decay: [bias, norm]}"
        ref, _, _ = self.run_reference("adamw", ["--optimizer", "adamw", "--lr", "0.01",
                                                 "--weight_decay", "0.5",
                                                 "--no_decay", "bias,norm"])
        self.assertMatches(self.run_ours("adamw", optimizer=adamw), ref)
        # Decaying every parameter moves the ones PyTorch's groups leave alone: LayerNorm's
        # weight (found by type) and the biases (by name).
        everything = "{type: adamw, lr: 0.01, weight_decay: 0.5, no_decay: []}"
        self.assertDiffers(self.run_ours("adamw_all", optimizer=everything), ref,
                           ["ln.weight", "ln.bias", "stem.bias", "head.bias"])

    def test_linear_warmup_then_cosine_follows_pytorchs_schedulers(self):
        cosine = "{type: cosine, warmup_steps: 4, min_lr_ratio: 0.1}"
        ref, lrs, _ = self.run_reference("cosine", SGD_ARGS + [
            "--scheduler", "cosine", "--warmup_steps", "4", "--min_lr_ratio", "0.1"])
        out = self.run_ours("cosine", scheduler=cosine)
        self.assertMatches(out, ref)
        ours = [m["lr"] for m in metrics(out) if "lr" in m]
        self.assertEqual(len(ours), STEPS)
        for step, (a, b) in enumerate(zip(ours, lrs), start=1):
            self.assertAlmostEqual(a, b, delta=1e-12 + 1e-9 * b, msg=f"lr of step {step}")
        self.assertLess(lrs[0], lrs[3])  # warm-up rises
        self.assertLess(lrs[-1], lrs[4] / 5)  # the cosine falls towards 0.1 x lr

    def test_gradient_clipping_matches_clip_grad_norm(self):
        ref, _, clipped = self.run_reference("clip", SGD_ARGS + ["--max_grad_norm", "0.05"])
        self.assertEqual(clipped, STEPS, "clipping must be active on every step to be tested")
        self.assertMatches(self.run_ours("clip", max_grad_norm=0.05), ref)
        self.assertDiffers(self.run_ours("clip_off"), ref, ["head.weight", "stem.weight"])

    def check_loss(self, name, loss, args):
        ref, _, _ = self.run_reference(name, SGD_ARGS + args)
        self.assertMatches(self.run_ours(name, loss=loss), ref)
        # Plain cross-entropy lands elsewhere: the option was applied, not ignored.
        if not hasattr(self, "_plain"):
            type(self)._plain = self.run_ours("plain_ce")
        self.assertDiffers(self._plain, ref, ["head.weight", "head.bias"])

    def test_cross_entropy_with_label_smoothing(self):
        self.check_loss("smoothing", "{type: cross_entropy, label_smoothing: 0.2}",
                        ["--label_smoothing", "0.2"])

    def test_cross_entropy_with_class_weights(self):
        self.check_loss("weights", "{type: cross_entropy, class_weights: [1.0, 3.0, 0.5, 2.0]}",
                        ["--class_weights", "1.0,3.0,0.5,2.0"])

    def test_cross_entropy_with_ignore_index(self):
        self.check_loss("ignore", "{type: cross_entropy, ignore_index: 2}",
                        ["--ignore_index", "2"])


    def test_fp16_loss_scaling_matches_grad_scaler(self):
        # A scale far too large for float16 at first: the first steps overflow and are skipped
        # while it backs off, then it doubles every 3 clean steps and overflows again. The
        # warm-up and cosine schedule advance only on the steps taken (accelerate's rule), and
        # clipping sees the unscaled gradients.
        cosine = "{type: cosine, warmup_steps: 4, min_lr_ratio: 0.1}"
        scaler = "  grad_scaler: {init_scale: 16777216, growth_interval: 4}\n"
        if LIBTORCH_MAJOR < 2:
            # LibTorch 1.13's CPU autocast is bfloat16 only: refused before anything starts.
            r = self.run_ours("fp16", precision="fp16", extra=scaler, expect=2)
            self.assertIn("mixed_precision: fp16 on the CPU needs LibTorch 2.x", r.stderr)
            return
        ref, lrs, _ = self.run_reference("fp16", SGD_ARGS + [
            "--fp16", "--init_scale", "16777216", "--growth_interval", "4",
            "--scheduler", "cosine", "--warmup_steps", "4", "--min_lr_ratio", "0.1",
            "--max_grad_norm", "1.0"])
        self.assertTrue(0 < self.skipped < STEPS - 4, self.skipped)  # both kinds of step
        out = self.run_ours("fp16", scheduler=cosine, max_grad_norm=1.0, precision="fp16",
                            extra=scaler)
        self.assertMatches(out, ref)
        f = final(out)
        self.assertEqual(f["skipped_steps"], self.skipped)
        self.assertEqual(f["steps"], STEPS)  # a skipped step still consumed its batch
        lines = [m for m in metrics(out) if "lr" in m]
        for step, (m, b) in enumerate(zip(lines, lrs), start=1):
            self.assertAlmostEqual(m["lr"], b, delta=1e-12 + 1e-9 * b, msg=f"lr of step {step}")
        self.assertEqual(lines[-1]["skipped_steps"], self.skipped)
        self.assertEqual(lines[-1]["loss_scale"], f["loss_scale"])
        # float16 and the skipped steps changed the result: float32 lands elsewhere.
        self.assertDiffers(self.run_ours("fp16_off", scheduler=cosine, max_grad_norm=1.0), ref,
                           ["head.weight", "stem.weight"])

    def test_fp16_comm_hook_matches_fp16_compress_hook(self):
        # Each bucket cast to float16, divided by the world size, summed in float16 and cast
        # back, as PyTorch's fp16_compress_hook (accelerate's comm_hook FP16). Over the
        # shared-memory transport here, over Gloo in the reference: the same float16 sums.
        ref, _, _ = self.run_reference("fp16hook", SGD_ARGS + ["--comm_hook", "fp16"])
        out = self.run_ours("fp16hook", parallel="{mode: ddp, comm_hook: fp16}")
        self.assertMatches(out, ref)
        # float16's 11-bit mantissa changed the result: float32 buckets land outside the
        # tolerance (by less than the other options' 100x: 16 steps of rounding at 2^-11).
        off = self.compare(self.run_ours("fp16hook_off"), ref)["diff"]
        for n in ["head.weight", "stem.weight"]:
            self.assertGreater(off[n], 4 * TOLERANCE, f"{n}: the hook changed nothing")

    def check_power_sgd(self, name, options):
        # PowerSGD from the 4th synchronised step: both weight matrices sent as rank-r factors,
        # the LayerNorm's vector and the biases whole; error feedback and warm start (or not).
        ref, _, _ = self.run_reference(name, SGD_ARGS + [
            "--comm_hook", "power_sgd", "--power_sgd", json.dumps(options)])
        flow = ", ".join(f"{k}: {json.dumps(v)}" for k, v in options.items())
        out = self.run_ours(name, parallel="{mode: ddp, comm_hook: power_sgd, power_sgd: {" +
                            flow + "}}")
        self.assertMatches(out, ref)
        # Compression changed the result: whole gradients land far away.
        off = self.compare(self.run_ours(name + "_off"), ref)["diff"]
        self.assertGreater(off["stem.weight"], 100 * TOLERANCE, "stem.weight: not compressed")

    def test_power_sgd_matches_powerSGD_hook(self):
        self.check_power_sgd("psgd", {"matrix_approximation_rank": 1, "start_powerSGD_iter": 3})

    def test_power_sgd_rank_4_with_qr_and_without_warm_start_or_error_feedback(self):
        self.check_power_sgd("psgd4", {"matrix_approximation_rank": 4, "start_powerSGD_iter": 2,
                                       "warm_start": False, "use_error_feedback": False,
                                       "random_seed": 11})


if __name__ == "__main__":
    unittest.main()
