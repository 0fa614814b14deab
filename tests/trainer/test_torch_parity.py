"""`train` trains user TorchScript models exactly as PyTorch's DDP does. Each test runs one model
twice on the same tiny IDX data set and the same model file: with `launch` on a YAML job (two
`train` processes, DDP) and with `launch` on torch_ddp_reference.py (two Python processes,
torch.nn.parallel.DistributedDataParallel over Gloo), then compares the trained state_dicts
tensor by tensor. The models cover the forward conventions the trainer accepts (logits in a
tuple, in a dict, the model's own loss with `inputs: [input, target]`) and the DDP cases that
differ from a plain MLP: frozen parameters plus a head never used (find_unused_parameters), a
Parameter shared by two layers, BatchNorm buffers, a buffer the training forward reads (which
shows whether rank 0's buffers reach rank 1 before each forward), and the same through a
one-stage, two-replica pipeline. Frozen/unused and tied models are also compared with one
PyTorch process on the concatenated batch."""

import json
import os
import unittest

from trainer_helpers import TRAIN, final, write_config, write_split
import harness

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = os.path.join(HERE, "torch_ddp_reference.py")
HAVE_BINARIES = os.path.exists(TRAIN) and os.path.exists(harness.LAUNCH)

TRAIN_N, EVAL_N = 256, 64  # 8x8 images, 4 classes (trainer_helpers.write_split)
SEED, BATCH, EPOCHS = 7, 8, 2
# DistributedSampler splits the 256 samples 128/128; 16 full batches of 8 per rank per epoch.
STEPS = EPOCHS * (TRAIN_N // 2 // BATCH)
RUN_TIMEOUT = 90  # each run takes a few seconds; the bound only turns a hang into a failure

# Every model sees [B,1,8,8]. torch.jit.script reads the classes' source, so this is written to a
# file and run by Debian's python3 (the test runner's python may have no torch).
EXPORT_MODELS = r'''
import os, sys
from typing import Dict, Tuple
import torch
import torch.nn.functional as F
from torch import nn


class TupleNet(nn.Module):  # (logits, hidden features): logits first
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(64, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.hidden(x.flatten(1)))
        return self.head(h), h


class DictNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(64, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        h = torch.tanh(self.hidden(x.flatten(1)))
        return {"logits": self.head(h), "aux": h}


class OwnLossNet(nn.Module):  # the trainer must back-propagate "loss", not its own criterion
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(64, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> Dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.hidden(x.flatten(1))))
        return {"loss": F.cross_entropy(logits, target), "logits": logits}


class FrozenUnusedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(64, 16)
        self.stem.weight.requires_grad_(False)  # saved with the module: frozen for both trainers
        self.stem.bias.requires_grad_(False)
        self.head = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 4)  # never called: DDP needs find_unused_parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.stem(x.flatten(1))))


class TiedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(64, 16)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.b.weight = self.a.weight  # one Parameter, two uses: its gradient is the sum
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x.flatten(1)))
        h = torch.tanh(self.b(torch.tanh(self.a(h))))
        return self.head(h)


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


class RunningCenterNet(nn.Module):
    """A buffer that the training forward both updates and reads: unlike BatchNorm's running
    statistics, it changes the gradients, so rank 1's weights drift from PyTorch's unless rank
    0's buffer is broadcast before each forward exactly as DDP's broadcast_buffers does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 4)
        self.register_buffer("center", torch.zeros(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        if self.training:
            self.center.mul_(0.5).add_(0.5 * x.mean(0).detach())
        return self.fc(x - self.center)


MODELS = {"tuple": TupleNet, "dict": DictNet, "own_loss": OwnLossNet,
          "frozen_unused": FrozenUnusedNet, "tied": TiedNet, "batchnorm": BatchNormNet,
          "running_center": RunningCenterNet}
for name, cls in MODELS.items():
    torch.manual_seed(0)
    torch.jit.script(cls()).save(os.path.join(sys.argv[1], name + ".pt"))
'''

# Compares a run of `train` with the reference and prints one JSON object; the test asserts on
# it. argv[1]: JSON with the file paths, the model's `pass_target` and its tied pair.
COMPARE = r'''
import functools, json, sys
import torch
spec = json.loads(sys.argv[1])
sys.path.insert(0, spec["here"])
from torch_ddp_reference import load_split, loss_and_logits

initial = torch.jit.load(spec["initial"])
ours = torch.jit.load(spec["ours"])
ref = torch.load(spec["ref"])
init_sd, our_sd = initial.state_dict(), ours.state_dict()


def same(a, b, exact):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if exact or not a.is_floating_point():
        return torch.equal(a, b)
    return torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def max_diff(a, b):
    if a.shape != b.shape or not a.is_floating_point() or not b.is_floating_point():
        return None
    return (a - b).abs().max().item()


report = {
    "ref_keys": sorted(ref), "our_keys": sorted(our_sd), "initial_keys": sorted(init_sd),
    # named_parameters() lists a tied Parameter once, under its first name.
    "trainable": [n for n, p in initial.named_parameters() if p.requires_grad],
    "ours_vs_ref": {n: same(our_sd[n], ref[n], False) for n in ref if n in our_sd},
    "max_abs_diff": {n: max_diff(our_sd[n], ref[n]) for n in ref if n in our_sd},
    "ours_unchanged": {n: same(our_sd[n], t, True) for n, t in init_sd.items() if n in our_sd},
    "ref_unchanged": {n: same(ref[n], t, True) for n, t in init_sd.items() if n in ref},
}
if spec["tied"]:
    # Still one tensor after export: both attributes point at the same storage. (ScriptModules
    # have no get_parameter, hence the attribute walk.)
    a, b = (functools.reduce(getattr, n.split("."), ours) for n in spec["tied"])
    report["tied_shared"] = a.data_ptr() == b.data_ptr()

x, y = load_split(spec["data"], "t10k", 0.5, 0.25)
ours.eval()
with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec["bf16"]):
    _, logits = loss_and_logits(ours, x, y, spec["pass_target"])
report["eval_accuracy"] = int((logits.argmax(1) == y).sum()) / len(y)
print(json.dumps(report))
'''


# What each model needs besides the common job, and which state_dict entries have special rules.
MODELS = {
    "tuple": {},
    "dict": {},
    "own_loss": {"pass_target": True},
    "frozen_unused": {"find_unused": True, "single_process": True,
                      "frozen": ["stem.weight", "stem.bias"],
                      "unused": ["aux.weight", "aux.bias"]},
    "tied": {"tied": ["a.weight", "b.weight"], "single_process": True},
    # conv.bias feeds BatchNorm, which subtracts each channel's batch mean: its gradient is zero
    # up to rounding, so it need not move (it is still compared with PyTorch's).
    "batchnorm": {"buffers": ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"],
                  "inert": ["conv.bias"]},
    "running_center": {"buffers": ["center"]},
    # The same model as a one-stage pipeline with two replicas (one micro-batch): the pipeline
    # engine's gradient all-reduce and buffer broadcast must equal DDP's.
    "pipeline_replicas": {"buffers": ["center"], "file": "running_center",
                          "parallel": "{mode: pipeline, stages: 1, microbatches: 1}",
                          "exported": "model_stage0.pt"},
    # mixed_precision: bf16 against torch.autocast("cpu", torch.bfloat16): the same operators
    # in bfloat16 on both sides (convolution, linear), BatchNorm and the loss in float32, so
    # the same tolerance as in float32 holds.
    "batchnorm_bf16": {"file": "batchnorm", "bf16": True,
                       "buffers": ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"],
                       "inert": ["conv.bias"]},
}

JOB = """distributed_type: MULTI_CPU
num_processes: 2
mixed_precision: {precision}
train:
  seed: {seed}
  output_dir: {out}
  model: {{torchscript: {model}{inputs}}}
  data: {{type: idx, path: {data}, mean: 0.5, std: 0.25}}
  batch_size: {batch}
  epochs: {epochs}
  optimizer: {{type: sgd, lr: 0.05, momentum: 0.9, weight_decay: 0.0}}
  scheduler: {{type: constant}}
  parallel: {parallel}
  checkpoint_every: 0
"""


@unittest.skipUnless(HAVE_BINARIES, harness.needs_setup(f"{TRAIN} or {harness.LAUNCH} not built"))
class TorchScriptDdpParityTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = harness.tmpdir()
        cls.data = os.path.join(cls.tmp, "idx")
        cls.models = os.path.join(cls.tmp, "models")
        os.makedirs(cls.data)
        os.makedirs(cls.models)
        write_split(cls.data, "train", TRAIN_N, seed=11)
        write_split(cls.data, "t10k", EVAL_N, seed=12)
        exporter = write_config(cls.tmp, EXPORT_MODELS, "export_models.py")
        r = harness.run([harness.SYSTEM_PYTHON, exporter, cls.models], timeout=RUN_TIMEOUT)
        if r.returncode != 0:
            raise AssertionError(f"exporting the models failed:\n{r.stderr}")

    def run_ours(self, name, model, opts):
        out = os.path.join(self.tmp, name + "-ours")
        # A pipeline takes a list of TorchScript stages (here, one).
        pipeline = "pipeline" in opts.get("parallel", "")
        cfg = write_config(self.tmp, JOB.format(
            seed=SEED, out=out, model=f"[{model}]" if pipeline else model, data=self.data,
            precision="bf16" if opts.get("bf16") else "'no'",
            batch=BATCH, epochs=EPOCHS,
            inputs=", inputs: [input, target]" if opts.get("pass_target") else "",
            parallel=opts.get("parallel", "{mode: ddp" + (
                ", find_unused_parameters: true}" if opts.get("find_unused") else "}"))),
            name + ".yaml")
        r = harness.launch(cfg, timeout=RUN_TIMEOUT)
        self.assertEqual(r.returncode, 0, f"train on {name}:\n{r.stdout}{r.stderr}")
        return out

    def run_reference(self, name, model, opts, processes=2, bf16=True):
        ref = os.path.join(self.tmp, f"{name}-ref{processes}{'' if bf16 else '-fp32'}.pt")
        batch = BATCH * 2 // processes  # the same global batch
        args = ["--model", model, "--data", self.data, "--out", ref, "--seed", str(SEED),
                "--epochs", str(EPOCHS), "--batch_size", str(batch), "--lr", "0.05",
                "--momentum", "0.9", "--mean", "0.5", "--std", "0.25"]
        if opts.get("pass_target"):
            args.append("--pass_target")
        if opts.get("find_unused"):
            args.append("--find_unused_parameters")
        if opts.get("bf16") and bf16:
            args.append("--bf16")
        r = harness.launch("--nproc_per_node", str(processes), "--python", harness.SYSTEM_PYTHON,
                           REFERENCE,
                           *args, timeout=RUN_TIMEOUT)
        self.assertEqual(r.returncode, 0, f"PyTorch reference on {name}:\n{r.stdout}{r.stderr}")
        self.assertIn(f"[rank 0]: steps={STEPS}", r.stdout)
        return ref

    def compare(self, model, out, ref, opts):
        spec = {"here": HERE, "initial": model,
                "ours": os.path.join(out, opts.get("exported", "model.pt")),
                "ref": ref, "data": self.data, "pass_target": bool(opts.get("pass_target")),
                "tied": opts.get("tied"), "bf16": bool(opts.get("bf16"))}
        r = harness.run([harness.SYSTEM_PYTHON, "-c", COMPARE, json.dumps(spec)],
                        timeout=RUN_TIMEOUT)
        self.assertEqual(r.returncode, 0, f"comparison failed:\n{r.stderr}")
        return json.loads(r.stdout)

    def check(self, name):
        opts = MODELS[name]
        model = os.path.join(self.models, opts.get("file", name) + ".pt")
        out = self.run_ours(name, model, opts)
        ref = self.run_reference(name, model, opts)
        f = final(out)
        self.assertEqual(f["steps"], STEPS, f)
        rep = self.compare(model, out, ref, opts)

        # The same tensors (parameters and buffers) under the same names as PyTorch's module.
        self.assertEqual(rep["our_keys"], rep["ref_keys"])
        self.assertEqual(rep["ref_keys"], rep["initial_keys"])
        differ = {n: rep["max_abs_diff"][n] for n, ok in rep["ours_vs_ref"].items() if not ok}
        self.assertEqual(differ, {}, "differ from PyTorch DDP (max |ours - ref|)")

        # Frozen and never-used parameters keep their initial values in both; everything else
        # that trains moved, so a trainer that does nothing cannot pass.
        fixed = opts.get("frozen", []) + opts.get("unused", [])
        for n in fixed:
            self.assertTrue(rep["ours_unchanged"][n], f"{n} changed in our run")
            self.assertTrue(rep["ref_unchanged"][n], f"{n} changed in PyTorch's run")
        inert = fixed + opts.get("inert", [])
        moving = [n for n in rep["trainable"] if n not in inert] + opts.get("buffers", [])
        self.assertTrue(moving)
        for n in moving:
            self.assertFalse(rep["ours_unchanged"][n], f"{n} did not train")
            self.assertFalse(rep["ref_unchanged"][n], f"{n} did not train in PyTorch's run")
        if opts.get("frozen"):
            self.assertFalse(set(opts["frozen"]) & set(rep["trainable"]),
                             "the exported file lost requires_grad=False")
        if opts.get("tied"):
            self.assertTrue(rep["tied_shared"], "the exported module untied " +
                            " and ".join(opts["tied"]))

        # And a single PyTorch process on the concatenated batch (DistributedSampler with one
        # replica visits the same samples per global batch): the same weights.
        if opts.get("single_process"):
            single = self.compare(model, out, self.run_reference(name, model, opts, 1), opts)
            differ = {n: single["max_abs_diff"][n] for n, ok in single["ours_vs_ref"].items()
                      if not ok}
            self.assertEqual(differ, {}, "differ from one PyTorch process (max |ours - ref|)")

        # final.json's evaluation is the exported module's accuracy on the t10k files.
        self.assertAlmostEqual(f["eval_accuracy"], rep["eval_accuracy"], delta=1e-6)

        # bf16 really ran in bfloat16: PyTorch's float32 run ends far outside that tolerance.
        if opts.get("bf16"):
            fp32 = self.compare(model, out, self.run_reference(name, model, opts, bf16=False),
                                opts)
            worst = max(v for v in fp32["max_abs_diff"].values() if v is not None)
            self.assertGreater(worst, 1e-3, fp32["max_abs_diff"])

    def test_tuple_output(self):
        self.check("tuple")

    def test_dict_output(self):
        self.check("dict")

    def test_own_loss_with_target_input(self):
        self.check("own_loss")

    def test_frozen_and_unused_parameters(self):
        self.check("frozen_unused")

    def test_tied_weights(self):
        self.check("tied")

    def test_batchnorm_buffers(self):
        self.check("batchnorm")

    def test_buffers_broadcast_before_each_forward(self):
        self.check("running_center")

    def test_pipeline_replicas_average_gradients_and_broadcast_buffers_as_ddp(self):
        self.check("pipeline_replicas")

    def test_bf16_mixed_precision_matches_torch_autocast(self):
        self.check("batchnorm_bf16")


if __name__ == "__main__":
    unittest.main()
