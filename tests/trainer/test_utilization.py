"""What a job uses of the machine (model/flops.h, compat/peak_flops.h): each built-in model on the
CPU reports its training FLOPs per sample as counted by hand, achieved TFLOP/s and MFU per step
and for the run, the measured peak it is compared with, and every rank's peak RSS; the pipeline
spreads one model's FLOPs over its stages; a TorchScript model has no count (nulls)."""

import math
import os
import subprocess
import unittest

from trainer_helpers import TRAIN, final, metrics, run_ranks, write_config, write_split
from test_models import SCRIPT_MODULE, write_csv  # a 6-32-3 TorchScript module, its CSV data
import harness

# Training FLOPs per sample (3 x forward, a multiply-add = 2), counted by hand:
# MLP 32-64-10: 2*32*64 + 2*64*10 = 5376 forward.
MLP_FLOPS = 3 * 5376
# CNN [1, 8, 8], channels 4, 8, hidden 16, 4 classes: conv1 2*9*1*4*8*8 = 4608 (pooled to 4x4),
# conv2 2*9*4*8*4*4 = 9216 (pooled to 2x2: 32 features), fc 2*32*16 = 1024, head 2*16*4 = 128.
CNN_FLOPS = 3 * (4608 + 9216 + 1024 + 128)
# Transformer d 32, 2 layers, 256 byte tokens, 16 per sample: N = 2*12*32*32 + 32*256 = 32768
# matmul weights; per token 6N + 12*L*d*T = 196608 + 12*2*32*16.
LM_FLOPS_PER_TOKEN = 6 * 32768 + 12 * 2 * 32 * 16
LM_FLOPS = 16 * LM_FLOPS_PER_TOKEN


def positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class UtilizationTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def run_job(self, name, body, world=2, top=""):
        out = os.path.join(self.tmp, name)
        cfg = write_config(self.tmp, f"""{top}
train:
  output_dir: {out}
  max_steps: 6
  log_every: 2
  resume: never
  save_model: never
{body}""", f"{name}.yaml")
        results = run_ranks(cfg, world, timeout=180)
        # Every rank's output: the main process (which logs steps) is a pipeline's last stage.
        return out, "".join(stdout for _, stdout, _ in results)

    def check_counted(self, out, stdout, flops_per_sample, world=2, source="measured: "):
        f = final(out)
        self.assertEqual(f["flops_per_sample"], flops_per_sample, f)
        for key in ("tflops", "mfu", "peak_tflops"):
            self.assertTrue(positive(f[key]), (key, f))
        self.assertLessEqual(f["mfu"], 1.0, f)
        self.assertTrue(f["peak_source"].startswith(source), f["peak_source"])
        self.assertAlmostEqual(f["mfu"], f["tflops"] / f["peak_tflops"], delta=1e-9)
        self.assertEqual(len(f["peak_rss_mb"]), world, f)
        self.assertTrue(all(positive(x) for x in f["peak_rss_mb"]), f)
        self.assertNotIn("peak_device_memory_mb", f)  # the CPU: no device memory
        m = metrics(out)
        self.assertEqual(len(m), 6)
        for line in m:
            self.assertTrue(positive(line["tflops"]) and positive(line["mfu"]), line)
            self.assertLessEqual(line["mfu"], 1.0, line)
            # Per rank: the job's samples' FLOPs spread over the world, in the step's time.
            expected = flops_per_sample * line["samples_per_s"] / world / 1e12
            self.assertAlmostEqual(line["tflops"], expected, delta=1e-9 + 1e-6 * expected)
        self.assertIn("% comm_ms", stdout)
        self.assertRegex(stdout, r"step 2/6 loss [0-9.]+ lr \S+ samples/s \d+ mfu \d+\.\d%")
        return f

    def test_mlp_under_ddp(self):
        out, stdout = self.run_job("mlp", """
  model: {type: mlp, layers: [32, 64, 10]}
  data: {type: synthetic, samples: 2000}
  batch_size: 32
""")
        self.check_counted(out, stdout, MLP_FLOPS)

    def test_cnn_under_ddp(self):
        data = os.path.join(self.tmp, "idx")
        os.makedirs(data)
        write_split(data, "train", 256, seed=1)
        out, stdout = self.run_job("cnn", f"""
  model: {{type: cnn, channels: [4, 8], hidden: 16, classes: 4, input: [1, 8, 8]}}
  data: {{type: idx, path: {data}}}
  batch_size: 16
""")
        self.check_counted(out, stdout, CNN_FLOPS)

    def test_transformer_counts_per_token_too(self):
        out, stdout = self.run_job("lm", """
  model: {type: transformer, vocab: bytes, d_model: 32, layers: 2, heads: 4, context: 16}
  data: {type: text, path: /usr/share/common-licenses/GPL-3}
  batch_size: 8
""")
        f = self.check_counted(out, stdout, LM_FLOPS)
        self.assertEqual(f["flops_per_token"], LM_FLOPS_PER_TOKEN)

    def test_pipeline_spreads_the_model_over_its_stages(self):
        out, stdout = self.run_job("pp", """
  model: {type: mlp, layers: [32, 64, 10]}
  data: {type: synthetic, samples: 2000}
  batch_size: 32
  parallel: {mode: pipeline, stages: 2, microbatches: 2}
""")
        self.check_counted(out, stdout, MLP_FLOPS)

    def test_bf16_peak_is_a_bf16_gemm(self):
        out, _ = self.run_job("bf16", """
  model: {type: mlp, layers: [32, 64, 10]}
  data: {type: synthetic, samples: 2000}
  batch_size: 32
""", world=1, top="mixed_precision: bf16")
        f = final(out)
        self.assertEqual(f["flops_per_sample"], MLP_FLOPS)
        self.assertIn(" bf16 GEMM, ", f["peak_source"])
        self.assertTrue(positive(f["mfu"]), f)

    def test_torchscript_model_has_no_count(self):
        pt = os.path.join(self.tmp, "net.pt")
        exporter = write_config(self.tmp, SCRIPT_MODULE, "export.py")
        subprocess.run([harness.SYSTEM_PYTHON, exporter, pt], check=True, timeout=120)
        csv = os.path.join(self.tmp, "d.csv")
        write_csv(csv, rows=300)
        out, stdout = self.run_job("ts", f"""
  model: {{torchscript: {pt}}}
  data: {{type: csv, path: {csv}, label_column: label}}
  batch_size: 16
""")
        f = final(out)
        for key in ("flops_per_sample", "tflops", "mfu"):
            self.assertIsNone(f[key], (key, f))
        self.assertNotIn("flops_per_token", f)
        self.assertTrue(positive(f["peak_tflops"]), f)  # the device still has a peak
        self.assertTrue(all(positive(x) for x in f["peak_rss_mb"]), f)
        for line in metrics(out):
            self.assertIsNone(line["tflops"], line)
            self.assertIsNone(line["mfu"], line)
        self.assertNotIn(" mfu ", stdout)
        self.assertIn("model FLOPs unknown", stdout)


if __name__ == "__main__":
    unittest.main()
