"""The public Accelerator API, driven by a user's own module and dataset (api_check.cc) under
`launch`, against the same training written in plain LibTorch in one process (same data, same
seed): ddp (with and without accumulation, sync_each_batch, world 2 and 3), zero stages 1, 2
and 3, Local SGD, dp and pipelines (GPipe, 1F1B, 2x2). Ranks that start from different weights end equal (Prepare
broadcasts rank 0's), and no_sync really skips the all-reduce."""

import os
import subprocess
import unittest

import harness
from api_helpers import floats, rel_diff

BIN = os.environ.get("LAUNCH_BIN_DIR", os.path.join(harness.REPO, "build", "bin"))
CHECK = os.path.join(BIN, "api_check")
LAUNCH = os.path.join(BIN, "launch")


@unittest.skipUnless(os.path.exists(CHECK) and os.path.exists(LAUNCH),
                     harness.needs_setup("api_check not built"))
class AcceleratorMatchesSingleProcessTest(unittest.TestCase):
    # The reference stays inside epoch 0: steps x accum x world x batch 8 <= 512 samples.
    def setUp(self):
        self.tmp = harness.tmpdir()

    def run_case(self, world, flags, stage_files=None):
        """Runs the mode on `world` processes and the plain reference; returns the log."""
        name = "_".join(f.strip("-") for f in flags) + f"_w{world}"
        ref = os.path.join(self.tmp, name + ".ref")
        r = subprocess.run([CHECK, "--reference", "--world", str(world), *flags, "--out", ref],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        out = os.path.join(self.tmp, name)
        r = subprocess.run([LAUNCH, "--num_processes", str(world), "--", CHECK, *flags,
                            "--out", out], capture_output=True, text=True, timeout=180)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        want = floats(ref)
        if stage_files:  # pipeline: stages of the first pipeline, in order, make the model
            got = sum((floats(f"{out}.{rank}") for rank in stage_files), [])
            self.assertLess(rel_diff(got, want), 1e-5, name)
            return r.stdout
        first = floats(out + ".0")
        self.assertLess(rel_diff(first, want), 1e-5, name)
        for rank in range(1, world):
            self.assertEqual(floats(f"{out}.{rank}"), first, f"{name}: rank {rank} != rank 0")
        return r.stdout

    def per_step(self, log):
        for line in log.splitlines():
            if "allreduces_per_step=" in line:
                return float(line.split("allreduces_per_step=")[1])
        self.fail("no allreduces_per_step line in:\n" + log)

    def test_ddp_from_different_initial_weights_equals_one_process(self):
        log = self.run_case(2, ["--mode", "ddp", "--skew_init"])
        self.assertEqual(self.per_step(log), 1.0)

    def test_zero_stages_from_different_initial_weights_equal_one_process(self):
        # The user's own module (with a frozen parameter, and a parameter tied between its two
        # stage-3 units, which leaves it to the root) under ZeRO, units cut to a few hundred
        # elements so shards split its parameters; accumulation, and three ranks.
        for stage in ("1", "2", "3"):
            self.run_case(2, ["--mode", "zero", "--zero_stage", stage, "--skew_init"])
            self.run_case(3, ["--mode", "zero", "--zero_stage", stage, "--accum", "2",
                              "--steps", "8"])

    def test_ddp_three_ranks_default_reducer_path(self):
        self.run_case(3, ["--mode", "ddp", "--accum", "2", "--steps", "8", "--skew_init"])

    def test_accumulation_skips_the_allreduce_on_all_but_the_last_micro_batch(self):
        log = self.run_case(2, ["--mode", "ddp", "--accum", "4", "--steps", "6"])
        self.assertEqual(self.per_step(log), 1.0)

    def test_sync_each_batch_allreduces_every_micro_batch_with_the_same_result(self):
        log = self.run_case(2, ["--mode", "ddp", "--accum", "4", "--steps", "6",
                                 "--sync_each_batch"])
        self.assertEqual(self.per_step(log), 4.0)

    def test_local_sgd_averages_every_k_steps_and_at_the_end(self):
        # 10 steps, K = 3: averages after steps 3, 6, 9 and at the end (Finish).
        self.run_case(2, ["--mode", "local_sgd", "--local_sgd", "3", "--steps", "10",
                          "--skew_init"])

    def test_dp_replicas_on_threads_equal_one_replica(self):
        self.run_case(1, ["--mode", "dp", "--accum", "2"])

    def test_pipeline_gpipe_two_stages(self):
        self.run_case(2, ["--mode", "pipeline", "--schedule", "gpipe"], stage_files=[0, 1])

    def test_pipeline_1f1b_two_stages_times_two_replicas_with_accumulation(self):
        # The stage axis is outermost (layout.h): replica 0's stages are ranks 0 and 2.
        self.run_case(4, ["--mode", "pipeline", "--schedule", "1f1b", "--accum", "2"],
                      stage_files=[0, 2])



@unittest.skipUnless(os.path.exists(CHECK) and os.path.exists(LAUNCH),
                     harness.needs_setup("api_check not built"))
class InPlaceRecoveryThroughTheApiTest(unittest.TestCase):
    """A user's loop written against the API (api_check.cc: Next, Accumulate, ForwardBackward,
    Step) under `launch --recover in_place`: rank 1 SIGKILLs itself in step 5; its replacement
    gets the state from a live peer and the loop redoes the step without knowing: every rank
    ends with the undisturbed run's parameters, bit for bit."""

    def test_a_killed_rank_is_replaced_and_the_loop_ends_bit_identical(self):
        tmp = harness.tmpdir()
        runs = {}
        for name, extra in (("undisturbed", []), ("killed", ["--die", "1:5"])):
            out = os.path.join(tmp, name)
            r = subprocess.run([LAUNCH, "--num_processes", "3", "--recover", "in_place",
                                "--max_restarts", "1", "--", CHECK, "--mode", "ddp", "--steps",
                                "12", *extra, "--out", out], capture_output=True, text=True,
                               timeout=180)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            runs[name] = (out, r.stdout + r.stderr)
        self.assertIn("starting a replacement for rank 1 alone", runs["killed"][1])
        self.assertIn("replacement (generation 1) took the state of step 4", runs["killed"][1])
        want = floats(runs["undisturbed"][0] + ".0")
        for rank in range(3):
            self.assertEqual(floats(f"{runs['killed'][0]}.{rank}"), want, f"rank {rank}")


@unittest.skipUnless(os.path.exists(CHECK) and os.path.exists(LAUNCH),
                     harness.needs_setup("api_check not built"))
class AcceleratorRefusesMisuseTest(unittest.TestCase):
    """A ported loop that misuses the API gets an error naming the fix, not a silent result."""

    def run_check(self, world, flags):
        out = os.path.join(harness.tmpdir(), "params")
        return subprocess.run([LAUNCH, "--num_processes", str(world), "--", CHECK, *flags,
                               "--out", out], capture_output=True, text=True, timeout=180)

    def test_dp_batch_with_fewer_rows_than_replicas_is_an_error(self):
        # options.batch_size is 8 (>= 2 replicas); the loader delivers 1 row.
        r = self.run_check(1, ["--mode", "dp", "--loader_batch", "1"])
        self.assertNotEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("train.parallel.replicas is 2 but this batch has 1 row", r.stderr)

    def test_pipeline_batch_with_fewer_rows_than_micro_batches_is_an_error(self):
        # 4 micro-batches of a 2-row batch: two would be empty (their mean loss nan).
        r = self.run_check(2, ["--mode", "pipeline", "--loader_batch", "2"])
        self.assertNotEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("train.parallel.microbatches is 4 but this batch has 2 rows", r.stderr)
        self.assertNotIn("nan", r.stdout + r.stderr)

    def test_dp_backward_without_forward_backward_is_an_error(self):
        r = self.run_check(1, ["--mode", "dp", "--own_backward"])
        self.assertNotEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("call ForwardBackward(batch, fn) instead", r.stderr)

    def test_ddp_backward_of_an_own_forward_still_trains(self):
        # The same misuse check leaves every other mode's Backward alone.
        r = self.run_check(2, ["--mode", "ddp", "--own_backward", "--steps", "3"])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)


if __name__ == "__main__":
    unittest.main()
