"""A failed run says which phase failed: a backward pass that cannot run is reported as
"backward", not "forward", and a peer lost while the ranks agree on signals between two steps is
reported as that signal poll after the step, not as a checkpoint. Real `train` processes (the
torchrun environment, no launcher), a real SIGKILL."""

import os
import shutil
import signal
import unittest

from trainer_helpers import TRAIN, start_ranks, wait_all, write_config
import harness

HAVE_TRAIN = os.path.exists(TRAIN)
RUN_TIMEOUT = 90

# A model whose output is cut from the graph: the loss has no gradient function, so LibTorch's
# backward() throws after a forward that succeeded.
EXPORT_DETACHED = r'''
import sys
import torch
from torch import nn


class Detached(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).detach()


torch.jit.script(Detached()).save(sys.argv[1])
'''

JOB = """train:
  seed: 3
  output_dir: {out}
  model: {model}
  data: {data}
  eval_fraction: 0.0
  batch_size: 8
  max_steps: {steps}
  optimizer: {{type: sgd, lr: 0.01}}
  parallel: {{mode: {mode}}}
  checkpoint_every: 0
  log_every: 1
  resume: never
"""


def logged_steps(out):
    """Complete lines in rank 0's metrics.jsonl so far (the last may still be written)."""
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return f.read().count("\n")
    except FileNotFoundError:
        return 0


@unittest.skipUnless(HAVE_TRAIN, harness.needs_setup(f"{TRAIN} not built"))
class ErrorPhaseTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_a_failing_backward_is_named_backward(self):
        model = os.path.join(self.tmp, "detached.pt")
        exporter = write_config(self.tmp, EXPORT_DETACHED, "export.py")
        r = harness.run([harness.SYSTEM_PYTHON, exporter, model], timeout=RUN_TIMEOUT)
        self.assertEqual(r.returncode, 0, r.stderr)
        csv = os.path.join(self.tmp, "d.csv")
        with open(csv, "w") as f:  # 16 features and a class label in [0, 4)
            f.write(",".join(f"x{i}" for i in range(16)) + ",label\n")
            for row in range(64):
                f.write(",".join(str((row * 7 + i) % 11) for i in range(16)) + f",{row % 4}\n")
        cfg = write_config(self.tmp, JOB.format(
            out=os.path.join(self.tmp, "out"), steps=5, mode="none",
            model=f"{{torchscript: {model}}}", data=f"{{type: csv, path: {csv}}}"))
        procs, _ = start_ranks(cfg, 1)
        [(rc, out, err)] = wait_all(procs, RUN_TIMEOUT)
        self.assertNotEqual(rc, 0, out + err)
        self.assertIn("rank 0, backward at step 1: ", err)
        self.assertIn("does not require grad", err)

    def test_a_peer_lost_in_the_signal_poll_is_named_so(self):
        # mode none: the ranks never communicate inside a step, only in the signal poll after
        # it, so a peer killed mid-run is noticed there.
        out = os.path.join(self.tmp, "out")
        cfg = write_config(self.tmp, JOB.format(
            out=out, steps=1000000, mode="none", model="{type: mlp, layers: [32, 64, 10]}",
            data="{type: synthetic, samples: 4096}"))
        procs, _ = start_ranks(cfg, 2)
        try:
            started = harness.wait_until(lambda: logged_steps(out) >= 3, timeout=RUN_TIMEOUT)
            self.assertTrue(started, "rank 0 logged no steps")
            procs[1].send_signal(signal.SIGKILL)
        finally:
            results = wait_all(procs, RUN_TIMEOUT)
        rc, stdout, err = results[0]
        self.assertNotEqual(rc, 0, stdout + err)
        self.assertRegex(err, r"rank 0, signal poll after step \d+: ")
        self.assertNotIn("checkpoint", err)


if __name__ == "__main__":
    unittest.main()
