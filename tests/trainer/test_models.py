"""Model types end to end: a TorchScript module scripted by Debian's python3-torch in the test
itself trains under 2-rank DDP in C++; the character-level transformer learns a text file; CSV
data trains an MLP."""

import os
import subprocess
import unittest

from trainer_helpers import TRAIN, final, metrics, params, run_ranks, write_config
import harness

SCRIPT_MODULE = r"""
import sys, torch
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 32)
        self.b = torch.nn.Linear(32, 3)
    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))
torch.manual_seed(0)
m = torch.jit.script(Net())
m.eval()  # saved in eval mode on purpose: the trainer must switch it to training
m.save(sys.argv[1])
"""

# One float64 parameter among float32 ones: every flat all-reduce (Local SGD's average, DDP's
# buckets) must handle a model that mixes dtypes.
MIXED_DTYPE_MODULE = r"""
import sys, torch
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 32)
        self.b = torch.nn.Linear(32, 3)
        self.scale = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.scale.float()
torch.manual_seed(0)
torch.jit.script(Net()).save(sys.argv[1])
"""


def write_csv(path, rows=1200):
    # Label = which of three linear scores is largest: learnable, not trivially separable.
    import random
    rng = random.Random(5)
    with open(path, "w") as f:
        f.write("f0,f1,f2,label,f3,f4,f5\n")
        for _ in range(rows):
            x = [rng.gauss(0, 1) for _ in range(6)]
            s = [x[0] + x[1] - x[2], x[3] - x[4] + 0.5 * x[5], x[2] + x[5] - x[0]]
            y = s.index(max(s))
            f.write(",".join(f"{v:.5f}" for v in x[:3]) + f",{y}," +
                    ",".join(f"{v:.5f}" for v in x[3:]) + "\n")


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class ModelsTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def test_torchscript_module_from_python_trains_under_ddp(self):
        pt = os.path.join(self.tmp, "net.pt")
        # torch.jit.script reads the class's source, so the exporter must be a file.
        exporter = write_config(self.tmp, SCRIPT_MODULE, "export.py")
        subprocess.run([harness.SYSTEM_PYTHON, exporter, pt], check=True, timeout=120)
        csv = os.path.join(self.tmp, "d.csv")
        write_csv(csv)
        out = os.path.join(self.tmp, "ts")
        cfg = write_config(self.tmp, f"""
train:
  output_dir: {out}
  model: {{torchscript: {pt}}}
  data: {{type: csv, path: {csv}, label_column: label}}
  batch_size: 32
  max_steps: 60
  optimizer: {{type: adam, lr: 0.01}}
  resume: never
""")
        run_ranks(cfg, 2, ["--dump_params"], timeout=120)
        self.assertEqual(params(out, 0), params(out, 1))
        m, f = metrics(out), final(out)
        self.assertEqual(f["strategy"], "ddp")
        first = sum(x["loss"] for x in m[:5]) / 5
        self.assertLess(f["train_loss"], first * 0.6, (first, f))
        self.assertGreater(f["eval_accuracy"], 0.8, f)
        # The trained weights differ from the scripted module's initial ones.
        check = f"import torch; m = torch.jit.load('{pt}'); " \
                "print(sum(p.numel() for p in m.parameters()))"
        n = int(subprocess.run([harness.SYSTEM_PYTHON, "-c", check], capture_output=True,
                               text=True, timeout=120, check=True).stdout)
        self.assertEqual(len(params(out)), n)

    def test_mixed_dtype_parameters_train_under_local_sgd_and_ddp(self):
        pt = os.path.join(self.tmp, "mixed.pt")
        exporter = write_config(self.tmp, MIXED_DTYPE_MODULE, "export_mixed.py")
        subprocess.run([harness.SYSTEM_PYTHON, exporter, pt], check=True, timeout=120)
        csv = os.path.join(self.tmp, "d.csv")
        write_csv(csv, rows=600)
        for name, extra in (("local_sgd", "local_sgd_steps: 3"), ("ddp", "")):
            out = os.path.join(self.tmp, name)
            cfg = write_config(self.tmp, f"""
train:
  output_dir: {out}
  model: {{torchscript: {pt}}}
  data: {{type: csv, path: {csv}, label_column: label}}
  batch_size: 16
  max_steps: 20
  optimizer: {{type: adam, lr: 0.01}}
  resume: never
  {extra}
""", name + ".yaml")
            run_ranks(cfg, 2, ["--dump_params"], timeout=120)
            # Local SGD's final average (or DDP's averaged gradients) leaves equal replicas,
            # the float64 parameter included, and it trained.
            p0, p1 = params(out, 0), params(out, 1)
            self.assertEqual(p0, p1, name)
            self.assertNotEqual(p0[-3:], [1.0, 1.0, 1.0], name)
            self.assertEqual(final(out)["strategy"], name)

    def test_character_transformer_learns_text(self):
        out = os.path.join(self.tmp, "lm")
        cfg = write_config(self.tmp, f"""
train:
  output_dir: {out}
  model: {{type: transformer, vocab: bytes, d_model: 64, layers: 2, heads: 4, context: 64}}
  data: {{type: text, path: /usr/share/common-licenses/GPL-3}}
  batch_size: 16
  max_steps: 60
  optimizer: {{type: adamw, lr: 3.0e-3}}
  resume: never
""")
        run_ranks(cfg, 2, timeout=180)
        m, f = metrics(out), final(out)
        self.assertGreater(m[0]["loss"], 4.5)  # ~log(256) at the start
        self.assertLess(f["eval_loss"], 3.2, f)  # well below a uniform guess: it learned


if __name__ == "__main__":
    unittest.main()
