"""Numerics of the parallel strategies against single-process references (same data, same seed):
DDP == one process on the concatenated batch; gradient accumulation with no_sync, with
sync_each_batch and one big batch give the same parameters, with the all-reduce count per step
counted at the process group; Local SGD averages exactly, and with K=1 and plain SGD equals DDP;
DiLoCo's outer step equals its formula and resumes exactly;
bucket all-reduces are launched while backward still computes (overlap)."""

import json
import os
import signal
import subprocess
import sys
import unittest
import xml.etree.ElementTree as ET

from trainer_helpers import (TRAIN, drop_from_checkpoint, final, metrics, params, rel_diff,
                             run_ranks, start_ranks, wait_all, write_config, write_split)
import harness

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

BASE = """
train:
  seed: 7
  output_dir: {out}
  model: {{type: mlp, layers: [16, 64, 64, 4]}}
  data: {{type: synthetic, samples: 2048}}
  eval_fraction: 0.0
  batch_size: {batch}
  max_steps: {steps}
  optimizer: {optimizer}
  checkpoint_every: 0
  resume: never
  parallel: {{mode: {mode}, bucket_cap_mb: {cap}}}
  gradient_accumulation_steps: {accum}
  sync_each_batch: {sync_each}
  local_sgd_steps: {local_sgd}
{extra}"""


def config(tmp, name, batch, steps=20, optimizer="{type: sgd, lr: 0.05, momentum: 0.9}",
           mode="ddp", accum=1, sync_each="false", local_sgd=0, cap=25, extra=""):
    out = os.path.join(tmp, name)
    text = BASE.format(out=out, batch=batch, steps=steps, optimizer=optimizer, mode=mode,
                       accum=accum, sync_each=sync_each, local_sgd=local_sgd, cap=cap,
                       extra=extra)
    return write_config(tmp, text, name + ".yaml"), out



def stop_after_first_checkpoint(test, cfg, out, world, env=None):
    """Starts `world` ranks of `cfg` (writing into `out`) and sends each SIGTERM as soon as the
    first checkpoint exists: every rank saves at the same step and exits 143. Returns that
    step."""
    procs, _ = start_ranks(cfg, world, ["--dump_params"], extra_env=env)
    latest = os.path.join(out, "checkpoints", "latest")
    harness.wait_until(lambda: os.path.exists(latest) or
                       any(p.poll() is not None for p in procs), 120)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    results = wait_all(procs, 120)
    test.assertEqual([rc for rc, _, _ in results], [143] * world, results)
    with open(latest) as f:
        return int(f.read().strip())


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class DdpNumericsTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def check_ddp_equals_big_batch(self, optimizer, cap=25, env=None, min_buckets=1,
                                   exchanged=True):
        ddp_cfg, ddp_out = config(self.tmp, "ddp", batch=8, optimizer=optimizer, cap=cap)
        ref_cfg, ref_out = config(self.tmp, "ref", batch=16, optimizer=optimizer, mode="none")
        run_ranks(ddp_cfg, 2, ["--dump_params"], timeout=90, extra_env=env)
        f = final(ddp_out)
        self.assertGreaterEqual(f["buckets"], min_buckets)
        # Which transport carried the last bucket of each step (see parallel/ddp.cc).
        self.assertEqual(f["pair_exchanges_total"], 20 if exchanged else 0, f)
        run_ranks(ref_cfg, 1, ["--dump_params"], timeout=90)
        ddp0, ddp1, ref = params(ddp_out, 0), params(ddp_out, 1), params(ref_out, 0)
        self.assertEqual(ddp0, ddp1, "DDP replicas diverged")
        rel, worst = rel_diff(ddp0, ref)
        self.assertLess(rel, 1e-5, f"relative difference {rel:g} (max abs {worst:g})")
        # And training really moved the weights (a no-op trainer would also "agree").
        m = metrics(ddp_out)
        self.assertEqual(len(m), 20)
        self.assertLess(m[-1]["loss"], m[0]["loss"])
        self.assertEqual(final(ddp_out)["strategy"], "ddp")

    def test_ddp_two_ranks_equals_one_process_on_concatenated_batch_sgd(self):
        self.check_ddp_equals_big_batch("{type: sgd, lr: 0.05, momentum: 0.9}")

    def test_ddp_two_ranks_equals_one_process_on_concatenated_batch_adam(self):
        self.check_ddp_equals_big_batch("{type: adam, lr: 0.003}")

    def test_ddp_without_exchange_adam(self):
        # The small model's only bucket normally takes the two-rank exchange (parallel/ddp.cc);
        # with it disabled the group's all-reduce must agree just as well.
        self.check_ddp_equals_big_batch("{type: adam, lr: 0.003}",
                                        env={"LAUNCH_DDP_EXCHANGE_MAX_KB": "0"},
                                        exchanged=False)

    def test_bf16_comm_hook(self):
        # comm_hook bf16: buckets travel as bfloat16. Replicas still agree bit for bit, and the
        # result is near (not equal to) the float32 all-reduce's.
        mode = "ddp, comm_hook: bf16"
        bf_cfg, bf_out = config(self.tmp, "bf16hook", batch=8, mode=mode, cap=0.001)
        ref_cfg, ref_out = config(self.tmp, "fp32hook", batch=8, cap=0.001)
        run_ranks(bf_cfg, 2, ["--dump_params"], timeout=90)
        run_ranks(ref_cfg, 2, ["--dump_params"], timeout=90)
        self.assertEqual(params(bf_out, 0), params(bf_out, 1), "replicas diverged")
        rel, worst = rel_diff(params(bf_out, 0), params(ref_out, 0))
        self.assertGreater(rel, 1e-7, "bfloat16 buckets changed nothing: hook not used")
        self.assertLess(rel, 1e-2, f"relative difference {rel:g} (max abs {worst:g})")
        self.assertEqual(final(bf_out)["pair_exchanges_total"], 0)
        m = metrics(bf_out)
        self.assertLess(m[-1]["loss"], m[0]["loss"])

    def test_bf16_comm_hook_needs_shared_memory(self):
        # This LibTorch's Gloo has no bfloat16 all-reduce: a clear setup error, never a crash.
        cfg, _ = config(self.tmp, "bf16gloo", batch=8, mode="ddp, comm_hook: bf16")
        procs, _ = start_ranks(cfg, 2, [], 0, {"LAUNCH_SHM_ALLREDUCE": "0"})
        for rc, out, err in wait_all(procs, 90):
            self.assertEqual(rc, 2, out + err)
            self.assertIn("comm_hook: bf16", err)
            self.assertIn("Gloo", err)

    def test_fp16_comm_hook_over_shared_memory_and_over_gloo(self):
        # comm_hook fp16: buckets travel as float16, over Gloo too (which adds float16, unlike
        # bfloat16). Both transports add each element's two halves once, rounded to float16: the
        # same bits. Near, not equal to, the float32 all-reduce's.
        mode = "ddp, comm_hook: fp16"
        shm_cfg, shm_out = config(self.tmp, "fp16shm", batch=8, mode=mode, cap=0.001)
        gloo_cfg, gloo_out = config(self.tmp, "fp16gloo", batch=8, mode=mode, cap=0.001)
        ref_cfg, ref_out = config(self.tmp, "fp32buckets", batch=8, cap=0.001)
        shm_log = run_ranks(shm_cfg, 2, ["--dump_params"], timeout=90)[0][1]
        gloo_log = run_ranks(gloo_cfg, 2, ["--dump_params"], timeout=90,
                             extra_env={"LAUNCH_SHM_ALLREDUCE": "0"})[0][1]
        run_ranks(ref_cfg, 2, ["--dump_params"], timeout=90)
        self.assertIn("gradient all-reduce over shared memory", shm_log)
        self.assertIn("gradient all-reduce over Gloo", gloo_log)
        self.assertEqual(params(shm_out, 0), params(shm_out, 1), "replicas diverged")
        self.assertEqual(params(gloo_out, 0), params(gloo_out, 1), "replicas diverged")
        self.assertEqual(params(shm_out, 0), params(gloo_out, 0), "the transports disagree")
        rel, worst = rel_diff(params(shm_out, 0), params(ref_out, 0))
        self.assertGreater(rel, 1e-7, "float16 buckets changed nothing: hook not used")
        self.assertLess(rel, 1e-2, f"relative difference {rel:g} (max abs {worst:g})")
        self.assertLess(metrics(shm_out)[-1]["loss"], metrics(shm_out)[0]["loss"])

    def test_ddp_many_buckets_sgd(self):
        # ~1 KB buckets: several asynchronous all-reduces during backward plus the exchange.
        self.check_ddp_equals_big_batch("{type: sgd, lr: 0.05, momentum: 0.9}", cap=0.001,
                                        min_buckets=3)


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class AccumulationTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def test_no_sync_sync_each_batch_and_big_batch_agree_and_count_allreduces(self):
        n = 4
        nosync_cfg, nosync_out = config(self.tmp, "nosync", batch=4, accum=n, steps=10)
        each_cfg, each_out = config(self.tmp, "each", batch=4, accum=n, steps=10,
                                    sync_each="true")
        ref_cfg, ref_out = config(self.tmp, "big", batch=2 * n * 4, steps=10, mode="none")
        run_ranks(nosync_cfg, 2, ["--dump_params"], timeout=90)
        run_ranks(each_cfg, 2, ["--dump_params"], timeout=90)
        run_ranks(ref_cfg, 1, ["--dump_params"], timeout=90)
        ref = params(ref_out)
        for out in (nosync_out, each_out):
            rel, worst = rel_diff(params(out), ref)
            self.assertLess(rel, 1e-5, f"{out}: relative difference {rel:g} (max {worst:g})")
        buckets = final(nosync_out)["buckets"]
        self.assertGreaterEqual(buckets, 1)
        for step in metrics(nosync_out):
            self.assertEqual(step["micro_batches"], n)
            self.assertEqual(step["allreduces"], buckets, f"no_sync step {step}")
        for step in metrics(each_out):
            self.assertEqual(step["allreduces"], n * buckets, f"sync_each_batch step {step}")

    def test_window_closes_at_end_of_loader(self):
        # 2048 samples / 2 ranks / batch 64 = 16 batches per epoch; N = 5 gives windows of
        # 5, 5, 5, 1 per epoch with sync_with_dataloader (the default).
        cfg, out = config(self.tmp, "tail", batch=64, accum=5, steps=8)
        run_ranks(cfg, 2, timeout=90)
        micro = [m["micro_batches"] for m in metrics(out)]
        self.assertEqual(micro, [5, 5, 5, 1, 5, 5, 5, 1])
        buckets = final(out)["buckets"]
        self.assertTrue(all(m["allreduces"] == buckets for m in metrics(out)))


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class LocalSgdTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def test_final_average_is_exact_mean_of_independent_replicas(self):
        # K = max_steps: the replicas train independently (as mode none does) and are averaged
        # once at the end; combined with accumulation (N = 2).
        alone_cfg, alone_out = config(self.tmp, "alone", batch=8, steps=10, mode="none", accum=2)
        lsgd_cfg, lsgd_out = config(self.tmp, "lsgd", batch=8, steps=10, accum=2, local_sgd=10)
        run_ranks(alone_cfg, 2, ["--dump_params"], timeout=90)
        run_ranks(lsgd_cfg, 2, ["--dump_params"], timeout=90)
        a, b = params(alone_out, 0), params(alone_out, 1)
        self.assertNotEqual(a, b, "independent replicas should differ before averaging")
        l0, l1 = params(lsgd_out, 0), params(lsgd_out, 1)
        self.assertEqual(l0, l1, "replicas differ after averaging")
        import struct
        f32 = lambda x: struct.unpack("<f", struct.pack("<f", x))[0]  # noqa: E731
        mean = [f32(f32(x + y) / 2) for x, y in zip(a, b)]
        self.assertEqual(l0, mean, "Local SGD average is not the exact mean")
        # No gradient all-reduce at all: exactly one parameter all-reduce (the final one).
        self.assertEqual(sum(m["allreduces"] for m in metrics(lsgd_out)), 1)

    def test_k1_with_plain_sgd_equals_ddp(self):
        sgd = "{type: sgd, lr: 0.05}"
        ddp_cfg, ddp_out = config(self.tmp, "ddp", batch=8, optimizer=sgd)
        lsgd_cfg, lsgd_out = config(self.tmp, "k1", batch=8, optimizer=sgd, local_sgd=1)
        run_ranks(ddp_cfg, 2, ["--dump_params"], timeout=90)
        run_ranks(lsgd_cfg, 2, ["--dump_params"], timeout=90)
        rel, worst = rel_diff(params(lsgd_out), params(ddp_out))
        self.assertLess(rel, 1e-5, f"relative difference {rel:g} (max {worst:g})")
        self.assertTrue(all(m["allreduces"] == 1 for m in metrics(lsgd_out)))


DILOCO = "  local_sgd: {outer: nesterov, outer_lr: 0.7, outer_momentum: 0.9}\n"


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class DilocoTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def test_outer_step_is_nesterov_sgd_on_the_averaged_change(self):
        # K = max_steps: the replicas train alone from theta0 (as mode none does), then one
        # outer step: g = theta0 - mean, buf = g, theta = theta0 - lr * (g + mu * buf).
        # theta0: one step at a learning rate far below float32's resolution of the weights.
        start_cfg, start_out = config(self.tmp, "start", batch=8, steps=1, mode="none",
                                      optimizer="{type: sgd, lr: 1.0e-12}")
        alone_cfg, alone_out = config(self.tmp, "alone", batch=8, steps=10, mode="none")
        dl_cfg, dl_out = config(self.tmp, "diloco", batch=8, steps=10, local_sgd=10,
                                extra=DILOCO)
        for cfg in (start_cfg, alone_cfg, dl_cfg):
            run_ranks(cfg, 2, ["--dump_params"], timeout=90)
        theta0, a, b = params(start_out, 0), params(alone_out, 0), params(alone_out, 1)
        self.assertEqual(theta0, params(start_out, 1))
        expected = [t - 0.7 * (1 + 0.9) * (t - (x + y) / 2) for t, x, y in zip(theta0, a, b)]
        d0, d1 = params(dl_out, 0), params(dl_out, 1)
        self.assertEqual(d0, d1, "replicas differ after the outer step")
        rel, worst = rel_diff(d0, expected)
        self.assertLess(rel, 1e-6, f"relative difference {rel:g} (max {worst:g})")
        mean = [(x + y) / 2 for x, y in zip(a, b)]
        self.assertGreater(rel_diff(d0, mean)[0], 1e-3, "the outer step did nothing")
        self.assertEqual(sum(m["allreduces"] for m in metrics(dl_out)), 1)

    def test_resume_restores_the_outer_state_exactly(self):
        # K = 4, a checkpoint every 6 steps (between syncs, with momentum from earlier ones).
        # SIGTERM stops a run at a step boundary after its first checkpoint (every rank saves
        # there); resumed, it ends bit-identical to a run that was not stopped. Without the
        # outer state file it does not.
        steps = 1500  # long enough that SIGTERM arrives long before the end

        def config_for(name):
            out = os.path.join(self.tmp, name)
            text = BASE.format(out=out, batch=8, steps=steps,
                               optimizer="{type: sgd, lr: 0.01, momentum: 0.9}", mode="ddp",
                               accum=1, sync_each="false", local_sgd=4, cap=25, extra=DILOCO)
            text = text.replace("checkpoint_every: 0", "checkpoint_every: 6")
            text = text.replace("resume: never", "resume: auto")
            return write_config(self.tmp, text, name + ".yaml"), out

        cfg, out = config_for("whole")
        run_ranks(cfg, 2, ["--dump_params"], timeout=300)
        whole = params(out, 0)
        for name, damage in (("resumed", False), ("damaged", True)):
            cfg, out = config_for(name)
            stopped_at = stop_after_first_checkpoint(self, cfg, out, 2)
            self.assertLess(stopped_at, steps)
            outer = os.path.join(out, "checkpoints", f"step{stopped_at}", "local_sgd_outer.pt")
            self.assertEqual(os.path.exists(outer), bool(DILOCO))
            if damage and DILOCO:
                drop_from_checkpoint(os.path.dirname(outer), "local_sgd_outer.pt")
            results = run_ranks(cfg, 2, ["--dump_params"], timeout=300)
            got = params(out, 0)
            self.assertEqual(got, params(out, 1))
            if damage and DILOCO:
                self.assertIn("no outer (nesterov) state", results[0][1])
                self.assertNotEqual(got, whole, "the outer state made no difference")
            elif not damage:
                self.assertEqual(got, whole, "resumed Local SGD differs from the undisturbed run")


# A CNN with dropout and BatchNorm whose parameters (22 KB) fill several buckets of
# bucket_cap_mb (the reducer's rebuild after the first iteration must keep that layout).
RESUME_JOB = """
train:
  seed: 7
  output_dir: {out}
  model: {{type: cnn, channels: [8, 16], hidden: 64, classes: 4, input: [1, 8, 8], dropout: 0.3}}
  data: {{type: idx, path: {data}, mean: 0.235, std: 0.135}}
  eval_fraction: 0.0
  batch_size: 16
  max_steps: {steps}
  optimizer: {{type: adamw, lr: 0.003}}
  checkpoint_every: 25
  resume: auto
  parallel: {parallel}
"""


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class ExactResumeTest(unittest.TestCase):
    """A job stopped at its first checkpoint and resumed ends with the parameters of the run
    that was not stopped, bit for bit, at world sizes where the order of a sum or a division
    by the world size can change bits (3, 4: with 2 ranks a + b == b + a and x / 2 is exact,
    which hides both), over shared memory and over Gloo; ddp and zero. Each world size and each
    transport once for ddp (3 over shared memory, 4 over Gloo), and zero at 3 over both."""

    STEPS = 150  # SIGTERM is sent at step 25's checkpoint: it arrives long before the end

    @classmethod
    def setUpClass(cls):
        cls.data = os.path.join(harness.tmpdir(), "data")
        os.makedirs(cls.data)
        write_split(cls.data, "train", 1024, seed=5)

    def setUp(self):
        self.tmp = harness.tmpdir()

    def check(self, world, shm, parallel="{mode: ddp, bucket_cap_mb: 0.004}"):
        env = {"LAUNCH_SHM_ALLREDUCE": "1" if shm else "0"}

        def config_for(name):
            out = os.path.join(self.tmp, name)
            text = RESUME_JOB.format(out=out, data=self.data, steps=self.STEPS,
                                     parallel=parallel)
            return write_config(self.tmp, text, name + ".yaml"), out

        cfg, whole_out = config_for("whole")
        run_ranks(cfg, world, ["--dump_params"], timeout=300, extra_env=env)
        whole = params(whole_out)
        cfg, out = config_for("resumed")
        self.assertLess(stop_after_first_checkpoint(self, cfg, out, world, env), self.STEPS)
        run_ranks(cfg, world, ["--dump_params"], timeout=300, extra_env=env)
        got = params(out)
        for r in range(1, world):
            self.assertTrue(params(out, r) == got, f"rank {r} differs from rank 0")
        self.assertEqual(len(got), len(whole))
        differ = sum(x != y for x, y in zip(got, whole))
        self.assertEqual(differ, 0, f"the resumed job differs from the undisturbed run in "
                                    f"{differ} of {len(whole)} parameters")
        return out

    def test_ddp_three_ranks_shared_memory(self):
        self.check(3, shm=True)

    def test_ddp_four_ranks_gloo(self):
        self.check(4, shm=False)

    def test_ddp_power_sgd_three_ranks_shared_memory(self):
        # PowerSGD from step 11, the checkpoint at step 25: each rank's error feedback and the
        # warm-started factors are in the checkpoint (per rank), over buckets of 4 KB that the
        # resumed run's first step lays out otherwise than the rebuilt ones.
        out = self.check(3, shm=True, parallel="{mode: ddp, bucket_cap_mb: 0.004, comm_hook: "
                         "power_sgd, power_sgd: {start_powerSGD_iter: 10, "
                         "matrix_approximation_rank: 2}}")
        with open(os.path.join(out, "checkpoints", "latest")) as f:
            step = os.path.join(out, "checkpoints", "step" + f.read().strip())
        self.assertEqual(sorted(f for f in os.listdir(step) if f.startswith("power_sgd")),
                         [f"power_sgd_rank{r}.pt" for r in range(3)])

    def test_zero_stage1_three_ranks_shared_memory(self):
        self.check(3, shm=True, parallel="{mode: zero, zero_stage: 1, bucket_cap_mb: 0.004}")

    def test_zero_stage3_three_ranks_gloo(self):
        self.check(3, shm=False, parallel="{mode: zero, zero_stage: 3, bucket_cap_mb: 0.004}")


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class ReproducibilityTest(unittest.TestCase):
    def test_same_seed_same_world_is_bit_identical_other_seed_differs(self):
        tmp = harness.tmpdir()
        checksums = []
        for name, seed in (("a", 11), ("b", 11), ("c", 12)):
            out = os.path.join(tmp, name)
            cfg = write_config(tmp, f"""
train:
  seed: {seed}
  output_dir: {out}
  model: {{type: mlp, layers: [16, 64, 64, 4], dropout: 0.2}}
  data: {{type: synthetic, samples: 2048}}
  batch_size: 16
  max_steps: 15
  optimizer: {{type: adamw, lr: 0.003}}
  scheduler: {{type: cosine, warmup_steps: 3}}
  max_grad_norm: 0.5
  resume: never
""", name + ".yaml")
            run_ranks(cfg, 2, timeout=90)
            checksums.append((final(out)["param_checksum"], final(out)["train_loss"]))
        self.assertEqual(checksums[0], checksums[1])
        self.assertNotEqual(checksums[0][0], checksums[2][0])


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class OverlapTest(unittest.TestCase):
    def test_buckets_are_all_reduced_while_backward_still_computes(self):
        tmp = harness.tmpdir()
        out = os.path.join(tmp, "overlap")
        cfg = write_config(tmp, f"""
train:
  output_dir: {out}
  model: {{type: mlp, layers: [256, 512, 512, 512, 512, 10]}}
  data: {{type: synthetic, samples: 4096}}
  batch_size: 64
  max_steps: 12
  optimizer: {{type: sgd, lr: 0.01}}
  checkpoint_every: 0
  resume: never
  parallel: {{mode: ddp, bucket_cap_mb: 0.5}}
""")
        run_ranks(cfg, 2, timeout=90)
        buckets = final(out)["buckets"]
        self.assertGreaterEqual(buckets, 3)
        steps = metrics(out)
        for step in steps:
            self.assertEqual(step["allreduces"], buckets)
        # Every bucket but the last (which holds the first layer, whose gradient is the last
        # produced) should start before backward has produced all gradients.
        early = [s["buckets_launched_before_grads_done"] for s in steps[1:]]
        self.assertTrue(all(e >= 1 for e in early), early)
        self.assertGreaterEqual(sum(early) / len(early), buckets - 1.5, early)


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class TimelineTest(unittest.TestCase):
    """train.timeline writes a Chrome trace (Perfetto) of the chosen steps, all ranks in one
    file; on a multi-bucket DDP model the bucket all-reduces start while backward runs."""

    def test_trace_has_every_rank_and_phase_and_buckets_overlap_backward(self):
        tmp = harness.tmpdir()
        out = os.path.join(tmp, "trace")
        cfg = write_config(tmp, f"""
train:
  output_dir: {out}
  model: {{type: mlp, layers: [256, 512, 512, 512, 512, 10]}}
  data: {{type: synthetic, samples: 4096}}
  batch_size: 64
  max_steps: 8
  optimizer: {{type: sgd, lr: 0.01}}
  checkpoint_every: 0
  resume: never
  parallel: {{mode: ddp, bucket_cap_mb: 0.5}}
  timeline: {{from_step: 4, steps: 3}}
""")
        run_ranks(cfg, 2, timeout=90)
        buckets = final(out)["buckets"]
        self.assertGreaterEqual(buckets, 3)
        with open(os.path.join(out, "timeline.json")) as f:
            events = json.load(f)  # valid JSON: a trace-event array
        self.assertIsInstance(events, list)
        for e in events:
            self.assertIn(e["ph"], ("M", "X", "b", "e"), e)
            self.assertIn(e["pid"], (0, 1), e)
        names = {e["args"]["name"] for e in events if e["ph"] == "M" and
                 e["name"] == "process_name"}
        self.assertEqual(names, {"rank 0", "rank 1"})
        for rank in (0, 1):
            mine = [e for e in events if e["pid"] == rank and e["ph"] != "M"]
            spans = [e for e in mine if e["ph"] == "X"]
            steps = sorted(e["name"] for e in spans if e["name"].startswith("step "))
            self.assertEqual(steps, ["step 4", "step 5", "step 6"])  # only the chosen steps
            for phase in ("data", "forward", "backward", "optimizer"):
                self.assertEqual(sum(e["name"] == phase for e in spans), 3, (rank, phase))
            begins = {e["id"]: e for e in mine if e["ph"] == "b"}
            ends = {e["id"]: e for e in mine if e["ph"] == "e"}
            self.assertEqual(len(begins), 3 * buckets, rank)
            self.assertEqual(set(begins), set(ends))  # every all-reduce completed
            for i, b in begins.items():
                self.assertGreaterEqual(ends[i]["ts"], b["ts"])
            # Overlap: in each step, some bucket's all-reduce starts before backward ends.
            for bw in (e for e in spans if e["name"] == "backward"):
                inside = [b for b in begins.values()
                          if bw["ts"] <= b["ts"] < bw["ts"] + bw["dur"]]
                self.assertGreaterEqual(len(inside), buckets - 1, (rank, bw))
                early = [b for b in inside if b["ts"] < bw["ts"] + bw["dur"] * 0.9]
                self.assertTrue(early, (rank, bw, inside))
        # Both ranks on one time axis: their step 4 spans overlap in time.
        s4 = [e for e in events if e.get("name") == "step 4"]
        a, b = sorted(s4, key=lambda e: e["pid"])
        self.assertLess(max(a["ts"], b["ts"]), min(a["ts"] + a["dur"], b["ts"] + b["dur"]))
        # scripts/timeline_svg draws it: a lane per rank and track, a box per slice (every
        # phase of every step, every bucket's all-reduce).
        svg = os.path.join(tmp, "trace.svg")
        subprocess.run([sys.executable, os.path.join(REPO, "scripts", "timeline_svg"),
                        os.path.join(out, "timeline.json"), svg], check=True, timeout=60)
        root = ET.parse(svg).getroot()
        ns = "{http://www.w3.org/2000/svg}"
        titles = [r.find(ns + "title").text for r in root.iter(ns + "rect")
                  if r.find(ns + "title") is not None]
        for phase in ("data", "forward", "backward", "optimizer"):
            self.assertEqual(sum(t.startswith(phase + ":") for t in titles), 6, phase)
        self.assertEqual(sum(t.startswith(("all-reduce", "allreduce")) for t in titles),
                         6 * buckets)
        labels = {t.text for t in root.iter(ns + "text")}
        self.assertTrue({"rank 0 train", "rank 1 train", "rank 0 allreduce"} <= labels, labels)


if __name__ == "__main__":
    unittest.main()
