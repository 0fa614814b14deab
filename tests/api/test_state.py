"""State that stays right (issue 25, item 3), through the public API (state_check.cc) and against
PyTorch where PyTorch defines the behaviour: SetLrLambda scales each parameter group's own base
rate as torch.optim.lr_scheduler.LambdaLR does; a window the end of the data cuts short is
divided by N as accelerate's backward does; SyncBatchNorm under ddp (2 processes) and dp (2
replicas on threads) trains exactly as one process with BatchNorm on the global batch; pipeline
replicas seeded differently end bit-identical (api_check.cc --skew_init)."""

import json
import os
import subprocess
import unittest

import harness
from api_helpers import floats

BIN = os.environ.get("LAUNCH_BIN_DIR", os.path.join(harness.REPO, "build", "bin"))
CHECK = os.path.join(BIN, "state_check")
API_CHECK = os.path.join(BIN, "api_check")
LAUNCH = os.path.join(BIN, "launch")


def max_diff(a, b):
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


# PyTorch's LambdaLR on the model, data and optimizer of state_check --case lr_lambda.
LAMBDA_LR = r"""
import json, sys, array
import torch
torch.set_num_threads(1)
def inputs(rows, features):
    return torch.sin(torch.arange(rows * features, dtype=torch.float32) * 0.37).reshape(rows, features)
def init(l, phase):
    with torch.no_grad():
        l.weight.copy_((torch.cos(torch.arange(l.weight.numel(), dtype=torch.float32) * 0.5 + phase)
                        .reshape(l.weight.shape)) * 0.4)
        l.bias.copy_(torch.linspace(-0.1, 0.1, l.bias.numel()))
body, head = torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)
init(body, 0.0)
init(head, 1.0)
net = torch.nn.Sequential(body, torch.nn.Tanh(), head)
opt = torch.optim.SGD([{"params": body.parameters(), "lr": 0.02},
                       {"params": head.parameters(), "lr": 0.2}], lr=0.1, momentum=0.9)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.5 * s))
x, y = inputs(40, 5), torch.arange(40) % 3
for step in range(10):
    b = step % 5
    loss = torch.nn.functional.cross_entropy(net(x[b * 8:(b + 1) * 8]), y[b * 8:(b + 1) * 8])
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step < 9:
        sched.step()
out = [float(v) for t in (body.weight, body.bias, head.weight, head.bias)
       for v in t.detach().flatten()]
print(json.dumps({"params": out, "lrs": [g["lr"] for g in opt.param_groups]}))
"""


@unittest.skipUnless(os.path.exists(CHECK) and os.path.exists(LAUNCH),
                     harness.needs_setup("state_check not built"))
class StateStaysRightTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def check(self, *args, timeout=120):
        r = subprocess.run([CHECK, *args], capture_output=True, text=True, timeout=timeout)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return r.stdout

    def test_lr_lambda_scales_each_groups_base_rate_as_pytorch_lambdalr(self):
        out = os.path.join(self.tmp, "lambda")
        log = self.check("--case", "lr_lambda", "--out", out)
        r = harness.run([harness.SYSTEM_PYTHON, "-c", LAMBDA_LR], timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        ref = json.loads(r.stdout)
        lrs = [float(v) for v in log.split("lrs")[1].split()[:2]]
        # The last step's rates: each group's own base times 1 / (1 + 0.5 * 9); ratio 10 kept.
        for got, want in zip(lrs, ref["lrs"]):
            self.assertAlmostEqual(got, want, delta=1e-9)
        self.assertAlmostEqual(lrs[1] / lrs[0], 10.0, places=9)
        self.assertLess(max_diff(floats(out), ref["params"]), 1e-5)

    def test_short_last_window_gets_k_over_n_as_accelerate(self):
        log = self.check("--case", "short_window")
        got = dict(line.split() for line in log.splitlines())
        self.assertEqual(got["steps"], "2", log)  # 4 micro-batches, then 2 cut by the epoch end
        self.assertLess(float(got["diff_k_over_n"]), 1e-6, log)
        # And not the window's mean: the two readings are told apart.
        self.assertGreater(float(got["diff_mean"]), 1e-3, log)

    def sync_bn(self, mode, world, *extra):
        name = f"{mode}_{world}{'_'.join(extra)}"
        ref = os.path.join(self.tmp, name + ".ref")
        self.check("--case", "sync_bn", "--reference", "--world", "2", "--out", ref)
        out = os.path.join(self.tmp, name)
        argv = [CHECK, "--case", "sync_bn", "--mode", mode, *extra, "--out", out]
        if world > 1:
            argv = [LAUNCH, "--num_processes", str(world), "--"] + argv
        r = subprocess.run(argv, capture_output=True, text=True, timeout=180)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        ranks = [floats(f"{out}.{rank}") for rank in range(world)]
        for rank in range(1, world):
            self.assertEqual(ranks[rank], ranks[0], f"{name}: rank {rank} != rank 0")
        return max_diff(ranks[0], floats(ref)), r.stdout

    def test_sync_batchnorm_ddp_two_ranks_equals_one_process_on_the_global_batch(self):
        # Parameters and running statistics (torch 1.13's own SyncBatchNorm needs CUDA, so the
        # reference is what it equals: BatchNorm in one process on both ranks' rows).
        diff, log = self.sync_bn("ddp", 2)
        self.assertIn("converted 1", log)
        self.assertLess(diff, 1e-5)
        # Without it each rank normalises its own rows: visibly not the global batch.
        plain, _ = self.sync_bn("ddp", 2, "--plain_bn")
        self.assertGreater(plain, 1e-3)

    def test_sync_batchnorm_dp_two_replicas_equals_one_process_on_the_global_batch(self):
        diff, _ = self.sync_bn("dp", 1)
        self.assertLess(diff, 1e-5)
        plain, _ = self.sync_bn("dp", 1, "--plain_bn")
        self.assertGreater(plain, 1e-3)


@unittest.skipUnless(os.path.exists(API_CHECK) and os.path.exists(LAUNCH),
                     harness.needs_setup("api_check not built"))
class PipelineReplicasStartEqualTest(unittest.TestCase):
    def test_pipeline_replicas_seeded_differently_end_bit_identical(self):
        # 2 stages x 2 replicas, every rank built from its own seed: PreparePipeline makes each
        # stage replica 0's, so both pipelines equal one process (seeded as rank 0) and each other.
        tmp = harness.tmpdir()
        flags = ["--mode", "pipeline", "--schedule", "1f1b", "--accum", "2", "--skew_init"]
        ref = os.path.join(tmp, "ref")
        r = subprocess.run([API_CHECK, "--reference", "--world", "4", *flags, "--out", ref],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        out = os.path.join(tmp, "pp")
        r = subprocess.run([LAUNCH, "--num_processes", "4", "--", API_CHECK, *flags, "--out", out],
                           capture_output=True, text=True, timeout=180)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        # The stage axis is outermost (layout.h): stage s of replica d is rank 2 * s + d.
        first = floats(out + ".0") + floats(out + ".2")
        second = floats(out + ".1") + floats(out + ".3")
        self.assertEqual(second, first, "the pipeline replicas differ")
        self.assertLess(max_diff(first, floats(ref)), 1e-5)


if __name__ == "__main__":
    unittest.main()
