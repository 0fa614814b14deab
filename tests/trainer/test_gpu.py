"""Every mode on a GPU against the same run on the CPU (issue 40): the same seed and data give the
same parameters to fp32 tolerance at world size 1, and at 2 with LAUNCH_TEST_SHARE_GPU=1 (two
ranks on one GPU, their CUDA tensors over Gloo: NCCL refuses two ranks on one device), for none,
ddp, zero 1/2/3, Local SGD, DiLoCo and a two-stage pipeline; bf16 autocast on CUDA trains close
to fp32 but not equal to it; a checkpoint written on the GPU resumes there to the undisturbed
run's parameters. Skipped (machine-dependent) without a CUDA LibTorch and a GPU; what runs
everywhere is the check that every job of them is a config `launch` accepts."""

import os
import shutil
import subprocess
import unittest

from trainer_helpers import TRAIN, final, params, rel_diff, run_ranks, write_config
import harness

BASE = """
train:
  seed: 11
  output_dir: {out}
  model: {{type: mlp, layers: [16, 64, 64, 64, 4]}}
  data: {{type: synthetic, samples: 2048}}
  eval_fraction: 0.0
  batch_size: 32
  max_steps: {steps}
  optimizer: {{type: adamw, lr: 0.003, weight_decay: 0.1}}
  max_grad_norm: 1.0
  checkpoint_every: {ckpt}
  resume: {resume}
  local_sgd_steps: {local_sgd}
{diloco}  parallel: {parallel}
mixed_precision: {precision}
"""

AVERAGE = "{outer: average}"
# (name, parallel section, local_sgd_steps, local_sgd section)
MODES = [
    ("none", "{mode: none}", 0, AVERAGE),
    ("ddp", "{mode: ddp, bucket_cap_mb: 0.01}", 0, AVERAGE),
    ("zero1", "{mode: zero, zero_stage: 1, bucket_cap_mb: 0.004}", 0, AVERAGE),
    ("zero2", "{mode: zero, zero_stage: 2, bucket_cap_mb: 0.004}", 0, AVERAGE),
    ("zero3", "{mode: zero, zero_stage: 3, bucket_cap_mb: 0.004}", 0, AVERAGE),
    ("local_sgd", "{mode: ddp}", 4, AVERAGE),
    ("diloco", "{mode: ddp}", 4, "{outer: nesterov, outer_lr: 0.7, outer_momentum: 0.9}"),
    ("pipeline", "{mode: pipeline, stages: 2, microbatches: 4}", 0, AVERAGE),
]


def job_config(tmp, name, parallel, local_sgd=0, diloco=AVERAGE, precision="no", steps=20,
               ckpt=0, resume="never", out=None):
    """The config file of one job of these tests."""
    # train.local_sgd is refused without local_sgd_steps
    section = f"  local_sgd: {diloco}\n" if local_sgd > 0 else ""
    return write_config(tmp, BASE.format(
        out=out or os.path.join(tmp, name), steps=steps, ckpt=ckpt, resume=resume,
        local_sgd=local_sgd, diloco=section, parallel=parallel, precision=precision),
        name + ".yaml")


class JobConfigsTest(unittest.TestCase):
    """Runs everywhere: the GPU tests' jobs are configs `launch` accepts, so that a rule added
    to the config cannot break them unseen on machines without a GPU."""

    def test_every_job_of_the_gpu_tests_is_a_valid_config(self):
        tmp = harness.tmpdir()
        jobs = [(name, parallel, local_sgd, diloco, "no") for name, parallel, local_sgd, diloco
                in MODES]
        jobs += [("bf16_zero", "{mode: zero, zero_stage: 2}", 0, AVERAGE, "bf16"),
                 ("bf16_pipe", "{mode: pipeline, stages: 2, microbatches: 4}", 0, AVERAGE, "bf16")]
        for name, parallel, local_sgd, diloco, precision in jobs:
            with self.subTest(job=name):
                cfg = job_config(tmp, name, parallel, local_sgd, diloco, precision, ckpt=10,
                                 resume="auto")
                r = subprocess.run([harness.LAUNCH, "--nproc_per_node", "2", "--print_config", cfg], capture_output=True,
                                   text=True, timeout=60)
                self.assertEqual(r.returncode, 0, r.stderr)


def gpu_reason():
    """Why this machine cannot run the GPU tests, or None."""
    if not os.path.exists(TRAIN):
        return harness.needs_setup(f"{TRAIN} not built")
    version = subprocess.run([TRAIN, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    if "NCCL yes" not in version:
        return harness.env_dependent("the trainer's LibTorch has no CUDA and NCCL: " +
                                     version.strip().splitlines()[0])
    smi = shutil.which("nvidia-smi")
    listed = smi and subprocess.run([smi, "-L"], capture_output=True, text=True,
                                    timeout=60).stdout.strip()
    if not listed:
        return harness.env_dependent("no GPU visible (nvidia-smi -L lists none)")
    return None


REASON = gpu_reason()


@unittest.skipIf(REASON is not None, REASON or "")
class GpuModesTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def run_job(self, name, world, parallel, local_sgd=0, diloco=AVERAGE, device="cuda",
                precision="no", steps=20, ckpt=0, resume="never", out=None):
        out = out or os.path.join(self.tmp, name)
        cfg = job_config(self.tmp, name, parallel, local_sgd, diloco, precision, steps, ckpt,
                         resume, out)
        env = {"ACCELERATE_USE_CPU": "1"} if device == "cpu" else {}
        if device == "cuda" and world > 1:
            env["LAUNCH_TEST_SHARE_GPU"] = "1"
        results = run_ranks(cfg, world, ["--dump_params"], timeout=300, extra_env=env)
        log = "".join(o + e for _, o, e in results)
        return out, log

    def compare(self, name, world, parallel, local_sgd=0, diloco=AVERAGE):
        cpu, _ = self.run_job(name + "_cpu", world, parallel, local_sgd, diloco, device="cpu")
        gpu, log = self.run_job(name + "_gpu", world, parallel, local_sgd, diloco)
        self.assertIn("cuda:0", log)
        for rank in range(world):
            rel, worst = rel_diff(params(gpu, rank), params(cpu, rank))
            self.assertLess(rel, 1e-5, f"{name} world {world} rank {rank}: max |diff| {worst}")
        return gpu, log

    def test_every_mode_at_world_one_matches_the_cpu(self):
        for name, parallel, local_sgd, diloco in MODES:
            if name == "pipeline":
                continue  # two stages need two ranks
            with self.subTest(mode=name):
                self.compare(name + "_w1", 1, parallel, local_sgd, diloco)

    def test_every_mode_at_world_two_on_one_shared_gpu_matches_the_cpu(self):
        for name, parallel, local_sgd, diloco in MODES:
            with self.subTest(mode=name):
                gpu, log = self.compare(name + "_w2", 2, parallel, local_sgd, diloco)
                self.assertIn("Gloo (LAUNCH_TEST_SHARE_GPU)", log)

    def test_bf16_autocast_on_cuda_is_close_to_fp32_and_not_equal(self):
        fp32, _ = self.run_job("fp32", 1, "{mode: ddp}")
        bf16, log = self.run_job("bf16", 1, "{mode: ddp}", precision="bf16")
        self.assertIn("mixed precision bf16 (CUDA autocast", log)
        rel, _ = rel_diff(params(bf16), params(fp32))
        self.assertGreater(rel, 0.0)
        self.assertLess(rel, 5e-2)
        # bf16 with ZeRO and a pipeline on the shared GPU run too.
        for name, parallel in (("bf16_zero", "{mode: zero, zero_stage: 2}"),
                               ("bf16_pipe", "{mode: pipeline, stages: 2, microbatches: 4}")):
            with self.subTest(mode=name):
                out, _ = self.run_job(name, 2, parallel, precision="bf16")
                self.assertLess(rel_diff(params(out), params(fp32))[0], 5e-2)

    def test_zero_checkpoint_on_the_gpu_resumes_to_the_undisturbed_run(self):
        whole, _ = self.run_job("whole", 2, "{mode: zero, zero_stage: 3}", steps=20)
        part = os.path.join(self.tmp, "part")
        self.run_job("part_a", 2, "{mode: zero, zero_stage: 3}", steps=10, ckpt=10, out=part)
        self.run_job("part_b", 2, "{mode: zero, zero_stage: 3}", steps=20, ckpt=10,
                     resume="auto", out=part)
        for rank in range(2):
            self.assertEqual(params(part, rank), params(whole, rank))
        self.assertEqual(final(part)["param_checksum"], final(whole)["param_checksum"])


if __name__ == "__main__":
    unittest.main()
