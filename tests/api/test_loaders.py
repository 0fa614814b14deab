"""Loaders and evaluation as accelerate has them, through the public API (loader_check.cc) under
`launch`: a second loader leaves the training loader's accumulation windows, epoch and
checkpoint alone (the review's H1 reproductions), an evaluation loader with GatherForMetrics
returns every sample once in data set order, the collectives of unequal shapes, and loops
ported from plain LibTorch that either work or fail loudly."""

import os
import re
import select
import subprocess
import time
import unittest

import harness
from api_helpers import floats

BIN = os.environ.get("LAUNCH_BIN_DIR", os.path.join(harness.REPO, "build", "bin"))
CHECK = os.path.join(BIN, "loader_check")
LAUNCH = os.path.join(BIN, "launch")


def values(log, key):
    """Every `key=value` of the log, in order, as strings."""
    return re.findall(r"\b" + re.escape(key) + r"=(\S+)", log)


@unittest.skipUnless(os.path.exists(CHECK) and os.path.exists(LAUNCH),
                     harness.needs_setup("loader_check not built"))
class LoadersTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def launch(self, world, *args, ok=True):
        r = subprocess.run([LAUNCH, "--num_processes", str(world), "--", CHECK, *args],
                           capture_output=True, text=True, timeout=180)
        if ok:
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return r

    # --- H1: one training loader -----------------------------------------------------------

    def test_an_eval_loader_mid_run_leaves_the_accumulation_windows_and_epoch_alone(self):
        for with_ in ("prepare", "eval"):
            log = self.launch(2, "--case", "windows", "--eval_with", with_).stdout
            self.assertEqual(values(log, "evaluated"), ["48"], log)
            self.assertEqual(values(log, "micro"), ["4"] * 8, log)  # steps 3..10
            self.assertEqual(values(log, "epoch"), ["0"] * 8, log)

    def test_a_save_after_evaluation_records_the_training_loaders_position(self):
        ckpt = os.path.join(self.tmp, "ckpt")
        log = self.launch(2, "--case", "save", "--ckpt", ckpt).stdout
        self.assertIn("saved epoch=0 batch=5", log)
        log = self.launch(2, "--case", "resume", "--ckpt", ckpt).stdout
        self.assertIn("resumed step=5 epoch=0 batch=5", log)

    def test_a_loader_prepared_before_the_training_loader_does_not_take_its_place(self):
        # The review's F3: a validation loader prepared first, and drawn from before training.
        # The loader the loop trains on is the training loader: its epoch, samples and position
        # are the ones recorded, so the checkpoint resumes where training stood.
        ckpt = os.path.join(self.tmp, "ckpt")
        r = self.launch(2, "--case", "save", "--ckpt", ckpt, "--val_first")
        self.assertIn("saved epoch=0 batch=5 samples=20 training=1", r.stdout)
        self.assertIn("the loop trains on a loader prepared after another one", r.stdout)
        log = self.launch(2, "--case", "resume", "--ckpt", ckpt).stdout
        self.assertIn("resumed step=5 epoch=0 batch=5", log)
        # A LoadState into that order has given the position to the first loader before the
        # loop showed which one trains: named, not trained on the wrong batches.
        r = self.launch(2, "--case", "resume", "--ckpt", ckpt, "--val_first", ok=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("Prepare the training loader first", r.stdout + r.stderr)

    def test_an_eval_loader_prepared_after_a_resume_evaluates_the_whole_set(self):
        ckpt = os.path.join(self.tmp, "ckpt")
        self.launch(2, "--case", "save", "--ckpt", ckpt)
        for with_ in ("prepare", "eval"):
            log = self.launch(2, "--case", "resume", "--ckpt", ckpt, "--eval_with", with_).stdout
            self.assertEqual(values(log, "evaluated"), ["48"], log)
            self.assertIn("after epoch=0 batch=5", log)  # the training loader did not move

    # --- Evaluation and collectives ----------------------------------------------------------

    def test_gather_for_metrics_returns_every_sample_once_in_order(self):
        # 101 samples: not a multiple of 2 or 3; batches of 8 per rank leave a partial last one.
        want = []
        for i in range(101):
            want += [float(i), float(i % 3)]  # feature 0 is the index, the label is i % 3
        for world in (1, 2, 3):
            out = os.path.join(self.tmp, f"gather{world}")
            log = self.launch(world, "--case", "gather", "--out", out).stdout
            counts = [int(values(log, f"rank{r}_samples")[0]) for r in range(world)]
            self.assertEqual(sum(counts), 101, log)
            self.assertLessEqual(max(counts) - min(counts), 1, log)
            for r in range(world):
                self.assertEqual(floats(f"{out}.{r}"), want, f"world {world} rank {r}")

    def test_collectives_of_unequal_shapes(self):
        log = self.launch(3, "--case", "collectives").stdout
        for r in range(3):
            # Rank q holds q + 1 rows [10q + i, -1]: 6 rows, in rank order, trimmed.
            rows = "0,-1,10,-1,11,-1,20,-1,21,-1,22,-1"
            self.assertEqual(values(log, f"rank{r}_gather"), [rows], log)
            self.assertEqual(values(log, f"rank{r}_gatherlist"), [rows], log)
            pad = ",".join(str(i) for i in range(r + 1)) + ",7" * (2 - r)
            self.assertEqual(values(log, f"rank{r}_pad"), [pad], log)
            padfirst = "7," * (2 - r) + ",".join(str(i) for i in range(r + 1))
            self.assertEqual(values(log, f"rank{r}_padfirst"), [padfirst], log)
            self.assertEqual(values(log, f"rank{r}_broadcast"), ["101,101"], log)
            self.assertEqual(values(log, f"rank{r}_object"), ["10:from"], log)
        splits = [values(log, f"rank{r}_split")[0] for r in range(3)]
        self.assertEqual(splits, ["0,4", "4,7", "7,10"])

    # --- Ported loops work or fail loudly ----------------------------------------------------

    def run_both_ranks(self, case):
        # Each rank on its own (torchrun's environment by hand), so that neither is stopped by
        # an agent before it says why: both must fail, naming the fix, and neither may hang.
        env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(harness.free_port()), LOCAL_WORLD_SIZE="2")
        procs = [subprocess.Popen([CHECK, "--case", case],
                                  env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        results = []
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=120)
            self.assertNotEqual(p.returncode, 0, out + err)
            self.assertIn(f"rank {r}: a backward pass outside Accelerator::Backward", err)
            self.assertIn("Replace loss.backward() with accel->Backward(loss) and "
                          "optimizer.step() with accel->Step()", err)
            results.append(out)
        return results

    def test_loss_backward_instead_of_backward_fails_at_step_on_both_ranks(self):
        self.run_both_ranks("unsynced")

    def test_a_ported_loop_keeping_backward_and_step_fails_at_its_second_batch(self):
        # cpp/mnist with Prepare and PrepareDataLoader only: the first iteration's
        # loss.backward() is named when the loop asks for its second batch, not at Finish.
        for out in self.run_both_ranks("ported"):
            self.assertEqual(out.split(), ["batch", "0", "batch", "1"], out)

    def test_optimizer_zero_grad_in_every_mode_equals_the_loop_without_it(self):
        # cpp/mnist's optimizer.zero_grad() before Backward: detach_ + zero_ (LibTorch 1.13),
        # and set_to_none (LibTorch 2's default), on gradients kept in ddp's and ZeRO stage 1's
        # buckets; ddp and ZeRO compute the same training, Local SGD its own.
        for mode in ("ddp", "zero1", "zero2", "zero3", "local_sgd"):
            results = {}
            for how in ("keep", "zero", "none"):
                out = os.path.join(self.tmp, f"zg_{mode}_{how}")
                self.launch(2, "--case", "zero_grad", "--mode", mode, "--zero_grad", how,
                            "--out", out)
                results[how] = floats(out + ".0")
                self.assertEqual(floats(out + ".1"), results[how], f"{mode} {how}: rank 1")
            self.assertEqual(results["zero"], results["keep"], mode)
            self.assertEqual(results["none"], results["keep"], mode)
            if mode == "ddp":
                ddp = results["keep"]
            elif mode != "local_sgd":
                self.assertEqual(results["keep"], ddp, mode)

    def test_finish_names_the_rank_whose_replica_differs(self):
        r = self.launch(2, "--case", "disagree", ok=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("the parameters of rank(s) 1 differ from rank 0's", r.stdout + r.stderr)

    def test_workers_fetch_the_same_batches_and_leave_no_thread_behind(self):
        r = subprocess.run([CHECK, "--case", "workers"], capture_output=True, text=True,
                           timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("same=35 differ=0 extra_threads=3 left_threads=0", r.stdout)

    def test_create_makes_stdout_line_buffered(self):
        # stdout is a pipe: "ready" must arrive while the program still runs (it waits for the
        # file this test writes only after reading the line).
        go = os.path.join(self.tmp, "go")
        p = subprocess.Popen([CHECK, "--case", "lines", "--wait", go], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env={k: v for k, v in os.environ.items()
                                  if k not in ("RANK", "WORLD_SIZE", "LD_PRELOAD")})
        try:
            deadline = time.monotonic() + 60  # a deadline, not a measurement
            ready, _, _ = select.select([p.stdout], [], [], max(0, deadline - time.monotonic()))
            self.assertTrue(ready, "no line while the program runs: stdout is block-buffered")
            self.assertEqual(p.stdout.readline(), "ready\n")
        finally:
            open(go, "w").close()
            out, err = p.communicate(timeout=60)
        self.assertEqual(p.returncode, 0, err)
        self.assertEqual(out, "done\n")


if __name__ == "__main__":
    unittest.main()
