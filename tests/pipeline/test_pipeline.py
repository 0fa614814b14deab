"""Pipeline stages, pipeline x data parallel and in-process DP against single-process references
(same data, same seed): the parameters after 10 steps agree to 1e-5 relative; the executor's count
of live activation micro-batches per stage matches the schedule (1F1B: P - s <= P; GPipe: M);
stages resume consistently; bad settings fail before anything trains."""

import json
import os
import signal
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "trainer"))
from trainer_helpers import (LIBTORCH_MAJOR, TRAIN, final, free_port, metrics, params, rank_env,
                             rel_diff, run_ranks, start_ranks, wait_all, write_config)
import harness
from test_shm_allreduce import maps_have_segment, run_watching

BASE = """
mixed_precision: {precision}
train:
  seed: 11
  output_dir: {out}
  model: {{type: mlp, layers: [12, 24, 24, 24, 4]}}
  data: {{type: synthetic, samples: 640}}
  eval_fraction: 0.0
  batch_size: {batch}
  max_steps: {steps}
  optimizer: {optimizer}
  checkpoint_every: {ckpt}
  resume: {resume}
  gradient_accumulation_steps: {accum}
  parallel: {parallel}
{extra}"""

SGD = "{type: sgd, lr: 0.05, momentum: 0.9}"
ADAM = "{type: adam, lr: 0.003}"


def config(tmp, name, batch, parallel, steps=10, optimizer=SGD, accum=1, ckpt=0, resume="never",
           precision="'no'", extra=""):
    out = os.path.join(tmp, name)
    text = BASE.format(out=out, batch=batch, steps=steps, optimizer=optimizer, accum=accum,
                       parallel=parallel, ckpt=ckpt, resume=resume, precision=precision,
                       extra=extra)
    return write_config(tmp, text, name + ".yaml"), out


def pipeline_params(out, stages, replica=0, replicas=1):
    """The whole model's parameters: stage 0..P-1 of one pipeline replica, concatenated. The
    layout (trainer_runtime/parallel/layout.h) puts the stage axis outermost: stage s of
    replica d is rank s * replicas + d."""
    flat = []
    for s in range(stages):
        flat += params(out, s * replicas + replica)
    return flat


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class PipelineNumericsTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def reference(self, batch, optimizer=SGD, accum=1, steps=10):
        cfg, out = config(self.tmp, f"ref{batch}_{accum}_{len(optimizer)}_{steps}", batch,
                          "{mode: none}", optimizer=optimizer, accum=accum, steps=steps)
        run_ranks(cfg, 1, ["--dump_params"], timeout=60)
        return params(out), out

    def check(self, stages, micro, schedule, expected_live, optimizer=SGD):
        ref, ref_out = self.reference(8, optimizer)
        name = f"pp{stages}_{micro}_{schedule}"
        cfg, out = config(self.tmp, name, 8, f"{{mode: pipeline, stages: {stages}, "
                          f"microbatches: {micro}, schedule: {schedule}}}", optimizer=optimizer)
        run_ranks(cfg, stages, ["--dump_params"], timeout=90)
        got = pipeline_params(out, stages)
        rel, worst = rel_diff(got, ref)
        self.assertLess(rel, 1e-5, f"{name}: relative difference {rel:g} (max abs {worst:g})")
        m = metrics(out)
        self.assertEqual(len(m), 10)
        # Training moved the weights well beyond one step's change (a pipeline and a reference
        # that both did nothing would also agree). One batch's loss is too noisy to show it in
        # ten small steps.
        one_step, _ = self.reference(8, optimizer, steps=1)
        self.assertGreater(rel_diff(got, one_step)[0], 10 * rel)
        self.assertGreater(rel_diff(got, one_step)[0], 1e-3)
        # The logged loss is the full batch's mean, as the reference logs it.
        ref_m = metrics(ref_out)
        self.assertAlmostEqual(m[0]["loss"], ref_m[0]["loss"], places=5)
        pipe = final(out)["pipeline"]
        self.assertEqual(pipe["peak_live_microbatches"], expected_live)
        self.assertEqual(final(out)["strategy"], "pipeline")
        return pipe

    def test_two_stages_1f1b_equals_single_process(self):
        self.check(2, 4, "1f1b", [2, 1])

    def test_two_stages_gpipe_equals_single_process_adam(self):
        self.check(2, 4, "gpipe", [4, 4], optimizer=ADAM)

    def test_four_stages_1f1b_keeps_at_most_p_minus_s_alive(self):
        pipe = self.check(4, 6, "1f1b", [4, 3, 2, 1])
        self.assertTrue(all(v <= 4 for v in pipe["peak_live_microbatches"]))
        # Balanced by parameter count: the 12->24 first layer is the small one.
        self.assertEqual(sum(pipe["partition"]), 4)

    def test_four_stages_gpipe_keeps_all_m_alive(self):
        self.check(4, 6, "gpipe", [6, 6, 6, 6])

    def test_pipeline_times_data_parallel_2x2_with_accumulation(self):
        # 2 replicas x batch 8 x 2 accumulated flushes == one process on batch 32.
        ref, _ = self.reference(32)
        cfg, out = config(self.tmp, "ppdp", 8, "{mode: pipeline, stages: 2, microbatches: 2, "
                          "schedule: 1f1b}", accum=2)
        run_ranks(cfg, 4, ["--dump_params"], timeout=120)
        r0, r1 = pipeline_params(out, 2, 0, 2), pipeline_params(out, 2, 1, 2)
        self.assertEqual(r0, r1, "pipeline replicas diverged")
        rel, worst = rel_diff(r0, ref)
        self.assertLess(rel, 1e-5, f"relative difference {rel:g} (max abs {worst:g})")
        f = final(out)
        self.assertEqual(f["pipeline"]["replicas"], 2)
        self.assertEqual(f["pipeline"]["peak_live_microbatches"], [2, 1])
        self.assertEqual(f["allreduces_total"], 10, "one gradient all-reduce per step")

    def test_explicit_partition_is_used(self):
        ref, _ = self.reference(8)
        cfg, out = config(self.tmp, "part", 8, "{mode: pipeline, stages: 2, microbatches: 3, "
                          "schedule: 1f1b, partition: [3, 1]}")
        run_ranks(cfg, 2, ["--dump_params"], timeout=90)
        self.assertEqual(final(out)["pipeline"]["partition"], [3, 1])
        # Stage 1 holds only the last layer (24x4 + 4 values).
        self.assertEqual(len(params(out, 1)), 24 * 4 + 4)
        self.assertLess(rel_diff(pipeline_params(out, 2), ref)[0], 1e-5)

    def test_transformer_blocks_two_stages_equal_single_process(self):
        text = """
train:
  seed: 5
  output_dir: {out}
  model: {{type: transformer, vocab: bytes, d_model: 16, layers: 3, heads: 2, context: 16}}
  data: {{type: text, path: /usr/share/common-licenses/GPL-3}}
  eval_fraction: 0.0
  batch_size: 6
  max_steps: 10
  optimizer: {{type: adam, lr: 0.003}}
  checkpoint_every: 0
  resume: never
  parallel: {parallel}
"""
        ref_out, out = os.path.join(self.tmp, "lmref"), os.path.join(self.tmp, "lmpp")
        ref_cfg = write_config(self.tmp, text.format(out=ref_out, parallel="{mode: none}"),
                               "lmref.yaml")
        cfg = write_config(self.tmp, text.format(out=out, parallel="{mode: pipeline, stages: 2, "
                                                 "microbatches: 3, schedule: 1f1b}"), "lmpp.yaml")
        run_ranks(ref_cfg, 1, ["--dump_params"], timeout=90)
        run_ranks(cfg, 2, ["--dump_params"], timeout=90)
        rel, worst = rel_diff(pipeline_params(out, 2), params(ref_out))
        self.assertLess(rel, 1e-5, f"relative difference {rel:g} (max abs {worst:g})")
        self.assertEqual(final(out)["pipeline"]["peak_live_microbatches"], [2, 1])


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class PipelineResumeTest(unittest.TestCase):
    def test_stages_resume_from_the_same_step_and_match_an_uninterrupted_run(self):
        tmp = harness.tmpdir()
        par = "{mode: pipeline, stages: 2, microbatches: 2, schedule: 1f1b}"
        ref_cfg, ref_out = config(tmp, "whole", 8, par, optimizer=ADAM, ckpt=3)
        run_ranks(ref_cfg, 2, ["--dump_params"], timeout=90)
        cfg, out = config(tmp, "split", 8, par, optimizer=ADAM, ckpt=3, resume="auto")
        run_ranks(cfg, 2, ["--max_steps", "4"], timeout=90)
        with open(os.path.join(out, "checkpoints", "latest")) as f:
            self.assertEqual(f.read().strip(), "4")
        # The second run (a restart as the agent would do it) continues from step 4.
        results = run_ranks(cfg, 2, ["--dump_params"], timeout=90, restart=1)
        self.assertIn("resumed from", results[1][1])
        got = final(out)
        self.assertEqual(got["steps_this_run"], 6)
        self.assertEqual(pipeline_params(out, 2), pipeline_params(ref_out, 2))
        self.assertEqual([m["step"] for m in metrics(out)], list(range(1, 11)))


def last_step(out):
    try:
        m = metrics(out)
        return m[-1]["step"] if m else 0
    except (OSError, ValueError):
        return 0


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class PipelineSignalTest(unittest.TestCase):
    """The pipeline runs the same loop as every other mode: SIGUSR1 on any stage checkpoints and
    training goes on; SIGTERM delivered to one stage only stops both at the same step with a
    checkpoint (exit 143), and the next run resumes it and evaluates on schedule."""

    def test_sigusr1_checkpoints_and_continues_sigterm_to_one_stage_stops_both(self):
        tmp = harness.tmpdir()
        par = "{mode: pipeline, stages: 2, microbatches: 2, schedule: 1f1b}"
        cfg, out = config(tmp, "sig", 8, par, steps=1000000, resume="auto")
        with open(cfg) as f:
            text = f.read().replace("eval_fraction: 0.0", "eval_fraction: 0.1")
        with open(cfg, "w") as f:
            f.write(text)
        latest = os.path.join(out, "checkpoints", "latest")
        procs, _ = start_ranks(cfg, 2)
        try:
            self.assertTrue(harness.wait_until(lambda: last_step(out) >= 20, 60),
                            "the pipeline did not reach step 20")
            self.assertFalse(os.path.exists(latest))
            procs[0].send_signal(signal.SIGUSR1)  # the first stage, not the one that logs
            self.assertTrue(harness.wait_until(lambda: os.path.exists(latest), 20),
                            "SIGUSR1 wrote no checkpoint")
            time.sleep(0.2)
            self.assertEqual([p.poll() for p in procs], [None, None],
                             "SIGUSR1 must not stop training")
            procs[1].send_signal(signal.SIGTERM)  # only the last stage gets it
            results = wait_all(procs, 60)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        for r, (rc, _, err) in enumerate(results):
            self.assertEqual(rc, 143, f"rank {r}: {err}")
            self.assertIn("stopped by SIGTERM", err)
        self.assertIn("SIGUSR1: wrote", results[1][1])
        self.assertFalse(os.path.exists(os.path.join(out, "final.json")))
        with open(latest) as f:
            stopped_at = int(f.read())
        self.assertEqual(stopped_at, last_step(out))
        # The next run resumes at that step on both stages and runs eval_every.
        cfg2 = write_config(tmp, open(cfg).read().replace("resume: auto", "resume: auto\n"
                                                          "  eval_every: 5"), "sig2.yaml")
        results = run_ranks(cfg2, 2, ["--max_steps", str(stopped_at + 10)], timeout=90)
        self.assertIn(f"resumed from {os.path.join(out, 'checkpoints')} at step {stopped_at}",
                      results[1][1])
        self.assertEqual(final(out)["steps_this_run"], 10)
        self.assertRegex(results[1][1], r"eval at step \d+: loss \d+\.\d+ accuracy 0\.\d+")
        # Each evaluation is a line of metrics.jsonl too (the last step's is final.json's).
        evals = metrics(out, evals=True)
        self.assertEqual([m["step"] for m in evals],
                         [s for s in range(stopped_at + 1, stopped_at + 10) if s % 5 == 0])
        for m in evals:
            self.assertGreater(m["eval_loss"], 0)
            self.assertTrue(0 <= m["eval_accuracy"] <= 1)


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class DpNumericsTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def check(self, replicas, loss_in_replica, optimizer=SGD):
        # batch 10: 5+5 for two replicas, 4+3+3 for three (uneven last chunks).
        ref_cfg, ref_out = config(self.tmp, "ref", 10, "{mode: none}", optimizer=optimizer)
        run_ranks(ref_cfg, 1, ["--dump_params"], timeout=60)
        name = f"dp{replicas}_{loss_in_replica}"
        cfg, out = config(self.tmp, name, 10, f"{{mode: dp, replicas: {replicas}, "
                          f"loss_in_replica: {loss_in_replica}}}", optimizer=optimizer)
        run_ranks(cfg, 1, ["--dump_params"], timeout=60)
        rel, worst = rel_diff(params(out), params(ref_out))
        self.assertLess(rel, 1e-5, f"{name}: relative difference {rel:g} (max abs {worst:g})")
        # Every step's logged loss (the full batch's mean, gathered from the replicas' scalar
        # losses) equals the reference's, and training changed it.
        m, ref_m = metrics(out), metrics(ref_out)
        self.assertEqual(len(m), 10)
        for a, b in zip(m, ref_m):
            self.assertAlmostEqual(a["loss"], b["loss"], places=5)
        self.assertNotEqual(m[-1]["loss"], m[0]["loss"])
        self.assertEqual(final(out)["strategy"], "dp")

    def test_two_replicas_loss_in_replica(self):
        self.check(2, "true")

    def test_three_replicas_uneven_chunks_loss_in_replica_adam(self):
        self.check(3, "true", ADAM)

    def test_three_replicas_loss_on_first_replica(self):
        self.check(3, "false")


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class PipelineTimelineTest(unittest.TestCase):
    def test_stages_trace_micro_batches_and_waits(self):
        tmp = harness.tmpdir()
        cfg, out = config(tmp, "trace", 8, "{mode: pipeline, stages: 2, microbatches: 4, "
                          "schedule: 1f1b}", steps=6)
        with open(cfg, "a") as f:
            f.write("  timeline: {from_step: 2, steps: 2}\n")
        run_ranks(cfg, 2, timeout=90)
        with open(os.path.join(out, "timeline.json")) as f:
            events = [e for e in json.load(f) if e["ph"] == "X"]
        for rank in (0, 1):
            names = [e["name"] for e in events if e["pid"] == rank and e["tid"] == "pipeline"]
            for kind in ("forward", "backward"):
                self.assertEqual(sorted(n for n in names if n.startswith(kind)),
                                 sorted([f"{kind} micro-batch {m}" for m in range(4)] * 2))
        # Stage 1 waits for stage 0's activations; stage 0 for stage 1's gradients.
        self.assertIn("idle: receive activation from rank 0",
                      [e["name"] for e in events if e["pid"] == 1])
        self.assertIn("idle: receive gradient from rank 1",
                      [e["name"] for e in events if e["pid"] == 0])


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class PipelineSharedMemoryTest(unittest.TestCase):
    """Stages on one host send activations and gradients through shared-memory rings
    (trainer_runtime/shm_p2p.h): every stage maps its peers' ring segments, the result is bit for
    bit the one over Gloo (send/recv only move bytes), and a SIGKILLed stage fails the other
    promptly."""

    P2P_SEGMENT = "memfd:launch-shm-p2p"

    def run_stages(self, tmp, name, stages, micro, shm):
        # Activations of 8 rows x 24 floats: several messages per step in each direction.
        cfg, out = config(tmp, name, 8, f"{{mode: pipeline, stages: {stages}, "
                          f"microbatches: {micro}, schedule: 1f1b}}", steps=10)
        env = {} if shm else {"LAUNCH_SHM_ALLREDUCE": "0"}
        results, seen = run_watching(cfg, stages, env, segment=self.P2P_SEGMENT)
        self.assertEqual(seen, set(range(stages)) if shm else set())
        logs = "".join(out_text for _, out_text, _ in results)
        self.assertIn("pipeline send/recv over " + ("shared memory" if shm else "Gloo"), logs)
        return pipeline_params(out, stages)

    def test_stages_over_shared_memory_equal_gloo_bit_for_bit(self):
        tmp = harness.tmpdir()
        for stages, micro in ((2, 4), (4, 4)):
            shm = self.run_stages(tmp, f"shm{stages}", stages, micro, True)
            gloo = self.run_stages(tmp, f"gloo{stages}", stages, micro, False)
            self.assertEqual(shm, gloo, f"{stages} stages: shared memory and Gloo differ")

    def test_killed_stage_fails_the_other_promptly(self):
        tmp = harness.tmpdir()
        cfg, out = config(tmp, "kill", 8, "{mode: pipeline, stages: 2, microbatches: 4, "
                          "schedule: 1f1b}", steps=1000000)
        procs, _ = start_ranks(cfg, 2)
        try:
            up = harness.wait_until(
                lambda: all(maps_have_segment(p.pid, self.P2P_SEGMENT) for p in procs)
                and os.path.exists(os.path.join(out, "metrics.jsonl")), 60)
            self.assertTrue(up, "the stages did not start sending through shared memory")
            time.sleep(0.3)
            procs[1].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            (rc, _, err), _ = wait_all(procs, 20)
            self.assertNotEqual(rc, 0, err)
            # Whichever transport noticed first (a shared-memory receive, or Gloo in a
            # collective) names the failure.
            self.assertIn("train: error: rank 0", err)
            # The group's timeout is 30 s: a prompt exit means the death was noticed.
            self.assertLess(time.monotonic() - killed, 10, err)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class Bf16NumericsTest(unittest.TestCase):
    """mixed_precision: bf16 in every mode against one process in bf16 on the same data and
    seed: close to it (bfloat16 rounding of differently shaped chunks makes it inexact), and
    clearly closer to it than to the float32 run, so autocast ran in the mode under test."""

    TOLERANCE = 5e-4

    def setUp(self):
        self.tmp = harness.tmpdir()

    def reference(self, precision="bf16"):
        cfg, out = config(self.tmp, "ref_" + precision, 8, "{mode: none}", precision=precision)
        run_ranks(cfg, 1, ["--dump_params"], timeout=60)
        return params(out)

    def check(self, name, parallel, ranks, flat):
        ref = self.reference()
        cfg, out = config(self.tmp, name, 8 // (ranks if "ddp" in parallel else 1), parallel,
                          precision="bf16")
        r = run_ranks(cfg, ranks, ["--dump_params"], timeout=90)
        got = flat(out)
        rel, worst = rel_diff(got, ref)
        self.assertLess(rel, self.TOLERANCE, f"{name}: relative difference {rel:g} "
                        f"(max abs {worst:g})")
        to_fp32, _ = rel_diff(got, self.reference("'no'"))
        self.assertGreater(to_fp32, 3 * rel, f"{name}: as close to the float32 run "
                           f"({to_fp32:g}) as to the bf16 one ({rel:g})")
        return out

    def test_ddp(self):
        out = self.check("ddp", "{mode: ddp}", 2, params)
        self.assertEqual(params(out, 0), params(out, 1), "DDP replicas diverged")

    def test_dp_loss_in_replica_and_on_first_replica(self):
        self.check("dp_in", "{mode: dp, replicas: 2, loss_in_replica: true}", 1, params)
        self.check("dp_first", "{mode: dp, replicas: 2, loss_in_replica: false}", 1, params)

    def test_pipeline_two_stages_1f1b(self):
        self.check("pp", "{mode: pipeline, stages: 2, microbatches: 2, schedule: 1f1b}", 2,
                   lambda out: pipeline_params(out, 2))


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
@unittest.skipUnless(LIBTORCH_MAJOR >= 2,
                     harness.env_dependent("LibTorch 1.13's CPU autocast is bfloat16 only"))
class Fp16NumericsTest(unittest.TestCase):
    """mixed_precision: fp16 with dynamic loss scaling where a mode splits the gradients or the
    batch: a first scale far too large for float16 makes the first steps overflow, and the
    scale grows again every 3 clean steps. Each mode skips exactly the steps its reference
    skipped (zero's ranks agree although each checks its own shard; a pipeline's stages agree
    although each holds its own layers) and ends close to it. Whether a step overflows depends
    on how the batch is cut (a bias' gradient summed over half a batch can exceed float16 where
    the whole batch's sum does not), so each reference cuts it alike: zero against ddp on the
    same ranks, the pipeline's and dp's two micro-batches against one process accumulating two
    micro-batches."""

    TOLERANCE = 1e-5
    SCALER = "  grad_scaler: {init_scale: 16777216, growth_interval: 3}\n"

    def setUp(self):
        self.tmp = harness.tmpdir()

    def run_mode(self, name, parallel, ranks, flat, batch=8, accum=1):
        cfg, out = config(self.tmp, name, batch, parallel, steps=12, precision="fp16",
                          accum=accum, extra=self.SCALER)
        run_ranks(cfg, ranks, ["--dump_params"], timeout=90)
        return flat(out), final(out)["skipped_steps"]

    def check(self, name, got, ref):
        (p, skipped), (ref_p, ref_skipped) = got, ref
        self.assertTrue(0 < ref_skipped < 12, ref_skipped)
        self.assertEqual(skipped, ref_skipped, f"{name}: skipped other steps than its reference")
        rel, worst = rel_diff(p, ref_p)
        self.assertLess(rel, self.TOLERANCE, f"{name}: relative difference {rel:g} "
                        f"(max abs {worst:g})")

    def test_zero_stages_2_and_3_skip_with_ddp(self):
        ddp = self.run_mode("ddp", "{mode: ddp}", 2, params, batch=4)
        for stage in (2, 3):
            self.check(f"zero{stage}", self.run_mode(f"zero{stage}", "{mode: zero, zero_stage: "
                                                     f"{stage}}}", 2, params, batch=4), ddp)

    def test_pipeline_and_dp_skip_with_one_process(self):
        one = self.run_mode("one", "{mode: none}", 1, params, batch=4, accum=2)
        self.check("pp", self.run_mode(
            "pp", "{mode: pipeline, stages: 2, microbatches: 2, schedule: 1f1b}", 2,
            lambda out: pipeline_params(out, 2)), one)
        self.check("dp", self.run_mode("dp", "{mode: dp, replicas: 2}", 1, params), one)


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class PipelineConfigErrorsTest(unittest.TestCase):
    """Each fails with exit 2 before joining the process group (only rank 0 is started)."""

    def setUp(self):
        self.tmp = harness.tmpdir()

    def fails(self, parallel, world, *expected, model=None, precision="'no'"):
        cfg, _ = config(self.tmp, "bad", 8, parallel, precision=precision)
        if model:
            with open(cfg) as f:
                text = f.read().replace("{type: mlp, layers: [12, 24, 24, 24, 4]}", model)
            with open(cfg, "w") as f:
                f.write(text)
        r = subprocess.run([TRAIN, cfg], capture_output=True, text=True, timeout=60,
                           env=rank_env(0, world, free_port()))
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        for e in expected:
            self.assertIn(e, r.stderr)
        return r.stderr

    @unittest.skipIf(LIBTORCH_MAJOR >= 2,
                     harness.env_dependent("LibTorch 2.x's CPU autocast runs float16"))
    def test_fp16_on_a_cpu_whose_autocast_is_bfloat16_only(self):
        self.fails("{mode: none}", 1, "mixed_precision: fp16 on the CPU needs LibTorch 2.x",
                   "use bf16", precision="fp16")

    def test_world_not_divisible_by_stages(self):
        self.fails("{mode: pipeline, stages: 2, microbatches: 2}", 3, "does not divide the world size 3")

    def test_fewer_microbatches_than_stages_for_1f1b_names_the_line(self):
        self.fails("{mode: pipeline, stages: 4, microbatches: 2, schedule: 1f1b}", 4,
                   "bad.yaml:", "microbatches")

    def test_more_stages_than_layers(self):
        self.fails("{mode: pipeline, stages: 5, microbatches: 5}", 5,
                   "train.parallel.stages 5 is more than the model's 4 layers")

    def test_partition_that_does_not_cover_the_model(self):
        self.fails("{mode: pipeline, stages: 2, microbatches: 2, partition: [1, 2]}", 2,
                   "train.parallel.partition sums to 3", "has 4")

    def test_partition_of_wrong_length_names_the_line(self):
        self.fails("{mode: pipeline, stages: 2, microbatches: 2, partition: [1, 2, 1]}", 2,
                   "bad.yaml:", "partition")

    def test_dp_across_processes_is_refused(self):
        # dp runs inside one process; the check happens when the strategy is built, after the
        # group forms, so this one starts both ranks.
        cfg, _ = config(self.tmp, "dpw", 8, "{mode: dp, replicas: 2}")
        procs = [subprocess.Popen([TRAIN, cfg], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=rank_env(r, 2, port))
                 for port in [free_port()] for r in range(2)]
        outs = [p.communicate(timeout=60) for p in procs]
        self.assertEqual([p.returncode for p in procs], [2, 2])
        self.assertIn("use ddp across processes", outs[0][1])


if __name__ == "__main__":
    unittest.main()
