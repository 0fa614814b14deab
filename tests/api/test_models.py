"""Several models on the public Accelerator API (models_check.cc) under `launch`: a GAN's two
models each with its own reducer (bit-identical across ranks, equal to one process on the global
batch), NoSync(model), state registered for checkpointing through a kill and a restart,
LoadState(dir, step), and MainProcessFirst's order."""

import os
import subprocess
import unittest

import harness
from api_helpers import floats, rel_diff

BIN = os.environ.get("LAUNCH_BIN_DIR", os.path.join(harness.REPO, "build", "bin"))
CHECK = os.path.join(BIN, "models_check")
LAUNCH = os.path.join(BIN, "launch")


@unittest.skipUnless(os.path.exists(CHECK) and os.path.exists(LAUNCH),
                     harness.needs_setup("models_check not built"))
class SeveralModelsTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def launch(self, world, *args, extra=()):
        return subprocess.run([LAUNCH, "--num_processes", str(world), *extra, "--", CHECK,
                               *args], capture_output=True, text=True, timeout=180)

    def against_reference(self, world, mode, steps, *args):
        ref = os.path.join(self.tmp, f"{mode}.ref")
        r = subprocess.run([CHECK, "--mode", mode, "--reference", "--world", str(world),
                            "--steps", str(steps), "--out", ref, *args],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        out = os.path.join(self.tmp, f"{mode}.w{world}")
        r = self.launch(world, "--mode", mode, "--steps", str(steps), "--out", out, *args)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        first = floats(out + ".0")
        for rank in range(1, world):
            self.assertEqual(floats(f"{out}.{rank}"), first, f"{mode}: rank {rank} != rank 0")
        self.assertLess(rel_diff(first, floats(ref)), 1e-5, mode)
        return r.stdout

    def test_gan_two_reducers_bit_identical_across_ranks_and_equal_to_one_process(self):
        # Ranks start from different weights; the discriminator steps on real and detached fake
        # rows, the generator through the stepped discriminator.
        for world in (2, 3):
            log = self.against_reference(world, "gan", 10)
            self.assertIn("steps=10", log)  # one counted step per iteration, not two

    def test_gan_with_batchnorm_trains_as_one_process_averaging_the_ranks_losses(self):
        # cpp/dcgan's models have BatchNorm: the discriminator's second Backward of an iteration
        # (under the generator's loss) brings rank 0's buffers after its forward saved them,
        # which aborted the backward ("modified by an inplace operation") at 2 ranks.
        self.against_reference(2, "gan", 6, "--batchnorm")

    def test_gan_loop_without_accumulate_is_an_error_naming_it(self):
        r = self.launch(2, "--mode", "gan_no_accumulate", "--out", os.path.join(self.tmp, "x"))
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("call Accumulate() at the start of every iteration", r.stdout + r.stderr)

    def test_no_sync_accumulates_locally_then_matches_the_synced_sum(self):
        log = self.against_reference(2, "nosync", 6)
        # Only the micro-batch outside NoSync all-reduces: once per bucket per step.
        line = next(l for l in log.splitlines() if "allreduces_per_step=" in l)
        per_step = float(line.split("allreduces_per_step=")[1].split()[0])
        buckets = int(line.split("buckets=")[1])
        self.assertEqual(per_step, buckets, line)

    def test_registered_ema_and_counter_survive_a_kill_and_restart_bit_for_bit(self):
        plain = os.path.join(self.tmp, "plain")
        r = self.launch(2, "--mode", "resume", "--steps", "8", "--ckpt", plain + ".ckpt",
                        "--out", plain)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        killed = os.path.join(self.tmp, "killed")
        r = self.launch(2, "--mode", "resume", "--steps", "8", "--ckpt", killed + ".ckpt",
                        "--out", killed, "--die_at", "3", extra=("--max_restarts", "1"))
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("resumed at step 3 counter=14", r.stdout)  # 1 + 4 + 9
        want = floats(plain + ".0")
        self.assertEqual(want[-1], sum(s * s for s in range(1, 9)))
        for rank in (0, 1):
            self.assertEqual(floats(f"{killed}.{rank}"), want, f"rank {rank}")

    def test_load_state_restores_a_chosen_step_and_names_the_ones_kept(self):
        ckpt = os.path.join(self.tmp, "keep")
        r = self.launch(2, "--mode", "loadstep", "--ckpt", ckpt)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("saved steps: 4 5 6", r.stdout)  # train.checkpoint_keep 3
        self.assertIn("step 4 restored: yes", r.stdout)
        self.assertIn(f"no checkpoint of step 2 in '{ckpt}' (it holds steps 4, 5, 6", r.stdout)
        self.assertIn("holds 1 RegisterForCheckpointing objects (object), this program "
                      "registered 2 (object, object)", r.stdout)
        self.assertEqual(sorted(n for n in os.listdir(ckpt) if n.startswith("step")),
                         ["step4", "step5", "step6"])

    def test_main_process_first_runs_rank_0s_block_before_the_others(self):
        log = os.path.join(self.tmp, "order.log")
        r = self.launch(3, "--mode", "order", "--log", log)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        with open(log) as f:
            lines = f.read().split("\n")[:-1]
        for which in ("main", "local"):
            mine = [l.split(" ", 1)[1] for l in lines if l.startswith(which + " ")]
            self.assertEqual(mine[:2], ["enter 0", "leave 0"], mine)
            self.assertEqual(sorted(mine[2:]), ["enter 1", "enter 2", "leave 1", "leave 2"])
        # SetSeed: the same draw on every rank; with device_specific, each rank its own.
        seeds = next(l for l in r.stdout.splitlines() if "seeds " in l).split("seeds ")[1].split()
        same = {s.split("/")[0] for s in seeds}
        own = {s.split("/")[1] for s in seeds}
        self.assertEqual(len(seeds), 3)
        self.assertEqual(len(same), 1, seeds)
        self.assertEqual(len(own), 3, seeds)


if __name__ == "__main__":
    unittest.main()
