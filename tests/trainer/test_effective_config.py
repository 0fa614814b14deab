"""What `launch` says is effective is what every worker trains: flags, LAUNCH_* / LAUNCH_TRAIN_*
variables and the trainer flags after `--` are resolved once by launch, written to
output_dir/effective_config.yaml and run by every rank (train --effective_config); `train` run
directly resolves the same layers itself. Real `launch` and `train` processes, real training."""

import os
import subprocess
import unittest

import harness
from trainer_helpers import LAUNCH, TRAIN, final, free_port, params, run_ranks, write_config

CONFIG = """
distributed_type: MULTI_CPU
{top}
train:
  seed: 5
  output_dir: {out}
  model: {{type: mlp, layers: [16, 64, 10]}}
  data: {{type: synthetic, samples: 4000}}
  batch_size: 32
  max_steps: {steps}
  optimizer: {{type: adamw, lr: 2.0e-3}}
  checkpoint_every: 0
  log_every: 5
"""


def env_without(*names):
    env = dict(os.environ)
    for n in names:
        env.pop(n, None)
    env.pop("PYTHONUNBUFFERED", None)  # users' machines do not set it
    return env


class EffectiveConfigTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def config(self, name, top="", steps=12):
        out = os.path.join(self.tmp, name)
        return write_config(self.tmp, CONFIG.format(top=top, out=out, steps=steps),
                            name + ".yaml"), out

    def launch(self, *args, env=None, timeout=120):
        r = subprocess.run([LAUNCH, "--num_processes", "2", *args], capture_output=True,
                           text=True, timeout=timeout,
                           env=env or env_without("LAUNCH_MIXED_PRECISION",
                                                  "ACCELERATE_MIXED_PRECISION"))
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return r.stdout + r.stderr

    def test_mixed_precision_from_a_flag_or_the_environment_trains_in_bf16(self):
        yaml_cfg, yaml_out = self.config("yaml", top="mixed_precision: bf16")
        plain_cfg, flag_out = self.config("flag")
        env_cfg, env_out = self.config("env")
        fp32_cfg, fp32_out = self.config("fp32")
        logs = {
            "yaml": self.launch(yaml_cfg),
            "flag": self.launch("--mixed_precision", "bf16", plain_cfg),
            "env": self.launch(env_cfg, env=dict(env_without("ACCELERATE_MIXED_PRECISION"),
                                                 LAUNCH_MIXED_PRECISION="bf16")),
            "fp32": self.launch(fp32_cfg),
        }
        for name in ("yaml", "flag", "env"):
            self.assertIn("mixed precision bf16", logs[name], name)
        self.assertNotIn("mixed precision bf16", logs["fp32"])
        # The same training to the last bit, whichever layer asked for bf16; not fp32's.
        ref = final(yaml_out)
        for out in (flag_out, env_out):
            self.assertEqual(final(out)["train_loss"], ref["train_loss"])
            self.assertEqual(final(out)["param_checksum"], ref["param_checksum"])
        self.assertNotEqual(final(fp32_out)["train_loss"], ref["train_loss"])
        with open(os.path.join(flag_out, "effective_config.yaml")) as f:
            text = f.read()
        self.assertIn("mixed_precision: bf16  # flag --mixed_precision", text)
        with open(os.path.join(env_out, "effective_config.yaml")) as f:
            self.assertIn("# environment LAUNCH_MIXED_PRECISION", f.read())

    def test_train_run_directly_reads_the_same_environment_and_flags(self):
        # ACCELERATE_MIXED_PRECISION is what launch (and accelerate launch) export: a trainer
        # started as a program under either trains in the precision they resolved.
        cfg, out = self.config("direct")
        results = run_ranks(cfg, 2, ["--max_steps", "6", "--optimizer.lr", "0.004"],
                            extra_env={"ACCELERATE_MIXED_PRECISION": "bf16",
                                       "LAUNCH_TRAIN_BATCH_SIZE": "16"}, timeout=120)
        self.assertIn("mixed precision bf16", results[0][1] + results[0][2])
        self.assertIn("batch 16 x 1 micro-batches x 2 ranks; 6 steps", results[0][1] + results[0][2])
        # The same through launch, the flags after `--` and the variable resolved by launch.
        cfg2, out2 = self.config("through_launch")
        log = self.launch("--mixed_precision", "bf16", cfg2, "--", "--max_steps", "6",
                          "--optimizer.lr", "0.004",
                          env=dict(env_without("ACCELERATE_MIXED_PRECISION"),
                                   LAUNCH_TRAIN_BATCH_SIZE="16"))
        self.assertIn("batch 16 x 1 micro-batches x 2 ranks; 6 steps", log)
        self.assertEqual(final(out2)["param_checksum"], final(out)["param_checksum"])

    def test_bad_trainer_flags_and_variables_are_named(self):
        cfg, _ = self.config("bad")
        r = subprocess.run([LAUNCH, cfg, "--", "--max_stepz", "3"], capture_output=True,
                           text=True, timeout=30)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("unknown flag '--max_stepz' (did you mean 'max_steps'?)", r.stderr)
        r = subprocess.run([LAUNCH, cfg, "--", "--batch_size", "0"], capture_output=True,
                           text=True, timeout=30)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--batch_size: train.batch_size: value 0 is out of range", r.stderr)
        r = subprocess.run([LAUNCH, cfg], capture_output=True, text=True, timeout=30,
                           env=dict(os.environ, LAUNCH_TRAIN_OPTIMIZER_LR="fast"))
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("environment LAUNCH_TRAIN_OPTIMIZER_LR: train.optimizer.lr: expected a "
                      "number, got 'fast'", r.stderr)
        r = subprocess.run([TRAIN, cfg, "--model.heads", "4"], capture_output=True, text=True,
                           timeout=30)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("train.model.heads: applies only with model.type transformer", r.stderr)

    def test_flag_and_variable_reach_every_rank_on_two_stand_in_nodes(self):
        # Two agents at 127.0.0.1 and 127.0.0.2, one rank each. If a rank had missed the flag or
        # the variable, the ranks would disagree on the step count (a collective would fail) or
        # on the learning rate (the DDP replicas would drift apart).
        cfg, out = self.config("two_nodes")
        port = free_port()
        marker = harness.unique_marker("effcfg")
        procs, logs = [], []
        for node in range(2):
            log = open(os.path.join(self.tmp, f"node{node}.log"), "w")
            logs.append(log)
            env = env_without("LAUNCH_MIXED_PRECISION", "ACCELERATE_MIXED_PRECISION")
            env.update({"LAUNCH_RDZV_LOCAL_ADDR": f"127.0.0.{node + 1}",
                        "LAUNCH_TRAIN_OPTIMIZER_LR": "0.01", "LAUNCH_TEST_MARKER": marker})
            procs.append(subprocess.Popen(
                [LAUNCH, "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node),
                 "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), cfg, "--",
                 "--max_steps", "9", "--dump_params"],
                stdout=log, stderr=subprocess.STDOUT, env=env))
        try:
            rcs = [p.wait(timeout=120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()
        text = "".join(open(log.name).read() for log in logs)
        self.assertEqual(rcs, [0, 0], text)
        self.assertEqual(final(out)["steps"], 9, text)
        self.assertEqual(params(out, 0), params(out, 1))
        for node in range(2):
            with open(os.path.join(out, f"effective_config.node{node}.yaml")) as f:
                mine = f.read()
            self.assertIn("max_steps: 9  # flag --max_steps (after --)", mine)
            self.assertIn("lr: 0.01  # environment LAUNCH_TRAIN_OPTIMIZER_LR", mine)
        # The same job on one node with both values in its YAML trains to the same parameters.
        one_cfg, one_out = self.config("one_node", steps=9)
        with open(one_cfg) as f:
            text = f.read().replace("lr: 2.0e-3", "lr: 0.01")
        with open(one_cfg, "w") as f:
            f.write(text)
        self.launch(one_cfg, "--", "--dump_params")
        self.assertEqual(params(one_out, 0), params(out, 0))


if __name__ == "__main__":
    unittest.main()
