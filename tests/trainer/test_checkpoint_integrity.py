"""Checkpoints that cannot lie (state/file_sums.h): every file's SHA-256 is recorded in the step
folder's SHA256SUMS when the checkpoint is committed and checked before it is loaded. A damaged
latest checkpoint (flipped bytes in the model or a rank file, a deleted rank file, a `latest`
naming no folder) falls back to the previous kept one, saying so, and the run ends where an
undisturbed run ends, bit for bit; with nothing to fall back to it is refused naming the file.
A save that fails on one rank leaves no partial folder behind."""

import os
import shutil
import subprocess
import unittest

from trainer_helpers import TRAIN, final, start_ranks, wait_all, write_config
import harness

STEPS = 40
CONFIG = """
train:
  seed: 5
  output_dir: {out}
  model: {{type: mlp, layers: [16, 64, 64, 10], dropout: 0.2}}
  data: {{type: synthetic, samples: 2048}}
  eval_fraction: 0.0
  batch_size: 16
  max_steps: {steps}
  optimizer: {{type: adamw, lr: 1.0e-3}}
  checkpoint_every: 10
  checkpoint_keep: 3
  save_model: never
  log_every: 1000
  parallel: {{mode: ddp}}
"""


def flip(path, count=64):
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        middle = len(data) // 2
        data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
        f.seek(0)
        f.write(data)


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class CheckpointIntegrityTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = harness.tmpdir()
        cls.ref_out = os.path.join(cls.tmp, "ref")
        cfg = write_config(cls.tmp, CONFIG.format(out=cls.ref_out, steps=STEPS), "ref.yaml")
        results = wait_all(start_ranks(cfg, 2)[0], timeout=240)
        for rc, out, err in results:
            assert rc == 0, err
        cls.ref = final(cls.ref_out)

    def case(self, name):
        """A copy of the undisturbed run's checkpoints, `latest` back at step 30 (as if the run
        had stopped there): resuming it trains steps 31-40 again."""
        out = os.path.join(self.tmp, name)
        shutil.copytree(os.path.join(self.ref_out, "checkpoints"), os.path.join(out, "checkpoints"))
        self.ckpt = os.path.join(out, "checkpoints")
        self.set_latest(30)
        self.out = out
        return write_config(self.tmp, CONFIG.format(out=out, steps=STEPS), name + ".yaml")

    def set_latest(self, text):
        with open(os.path.join(self.ckpt, "latest"), "w") as f:
            f.write(f"{text}\n")

    def resume(self, cfg):
        return wait_all(start_ranks(cfg, 2)[0], timeout=240)

    def assert_fell_back(self, results, damaged_step, to_step, named):
        for rc, out, err in results:
            self.assertEqual(rc, 0, err)
        out0, err_all = results[0][1], results[0][2] + results[1][2]
        self.assertIn(f"the checkpoint of step {damaged_step} in {self.ckpt} is damaged", out0)
        self.assertIn(f"resuming from step {to_step}, the previous checkpoint kept", out0)
        self.assertIn(named, err_all)
        self.assertIn(f"resumed from {self.ckpt} at step {to_step}", out0)
        got = final(self.out)
        self.assertEqual(got["steps"], STEPS)
        self.assertEqual(got["param_checksum"], self.ref["param_checksum"])

    def test_every_step_folder_lists_its_files_in_sha256sum_format(self):
        for step in (20, 30, 40):
            folder = os.path.join(self.ref_out, "checkpoints", f"step{step}")
            with open(os.path.join(folder, "SHA256SUMS")) as f:
                listed = sorted(line.split("  ", 1)[1].strip() for line in f if line.strip())
            self.assertEqual(listed, sorted(n for n in os.listdir(folder) if n != "SHA256SUMS"))
            r = subprocess.run(["sha256sum", "--check", "--strict", "SHA256SUMS"], cwd=folder,
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_flipped_bytes_in_the_model_fall_back_to_the_previous_checkpoint(self):
        cfg = self.case("model_flip")
        flip(os.path.join(self.ckpt, "step30", "model.pt"))
        self.assert_fell_back(self.resume(cfg), 30, 20,
                              "model.pt: its contents differ from those committed")

    def test_flipped_bytes_in_a_rank_file_fall_back(self):
        cfg = self.case("rank_flip")
        flip(os.path.join(self.ckpt, "step30", "rank1.pt"), count=16)
        self.assert_fell_back(self.resume(cfg), 30, 20, "rank1.pt: its contents differ")

    def test_a_deleted_rank_file_falls_back(self):
        cfg = self.case("rank_deleted")
        os.remove(os.path.join(self.ckpt, "step30", "rank1.pt"))
        self.assert_fell_back(self.resume(cfg), 30, 20, "rank1.pt: missing")

    def test_latest_naming_no_folder_is_damage_not_a_finished_run(self):
        cfg = self.case("latest_beyond")
        self.set_latest(9000)
        results = self.resume(cfg)
        self.assert_fell_back(results, 9000, 40, "the folder is missing")
        self.assertNotIn("finished run", results[0][1])

    def test_nothing_left_to_fall_back_to_is_refused_naming_the_file(self):
        cfg = self.case("all_damaged")
        flip(os.path.join(self.ckpt, "step30", "model.pt"))
        flip(os.path.join(self.ckpt, "step20", "model.pt"))
        results = self.resume(cfg)
        for rc, out, err in results:
            self.assertNotEqual(rc, 0, out)
        err = results[0][2]
        self.assertIn(f"the checkpoint of step 20 in {self.ckpt} is damaged", err)
        self.assertIn("no earlier checkpoint is kept", err)
        # Named by whichever rank hashed it.
        self.assertIn(f"checkpoint {self.ckpt}/step20: model.pt: its contents differ",
                      results[0][2] + results[1][2])
        self.assertFalse(os.path.exists(os.path.join(self.out, "final.json")))

    def test_a_checkpoint_without_sums_still_refuses_a_missing_rank_file(self):
        # Checkpoints written before SHA256SUMS load unchecked (said), but a rank file missing
        # at the world size that wrote it is still refused rather than replaced by a new stream.
        cfg = self.case("unlisted")
        os.remove(os.path.join(self.ckpt, "step30", "SHA256SUMS"))
        os.remove(os.path.join(self.ckpt, "step30", "rank1.pt"))
        results = self.resume(cfg)
        self.assertNotEqual(results[1][0], 0, results[1][2])
        self.assertIn("lists no SHA256SUMS", results[0][1])
        self.assertIn(f"{self.ckpt}/step30/rank1.pt is missing", results[1][2])

    def test_a_save_failing_on_one_rank_leaves_no_partial_folder(self):
        out = os.path.join(self.tmp, "partial")
        cfg = write_config(self.tmp, CONFIG.format(out=out, steps=STEPS), "partial.yaml")
        # Rank 1 cannot put its file in place (a non-empty folder has its name).
        blocker = os.path.join(out, "checkpoints", "step10", "rank1.pt")
        os.makedirs(os.path.join(blocker, "in-the-way"))
        results = wait_all(start_ranks(cfg, 2)[0], timeout=240)
        self.assertNotEqual(results[1][0], 0, results[1][2])
        self.assertIn("removed the partial checkpoint", results[0][2])
        self.assertFalse(os.path.exists(os.path.join(out, "checkpoints", "step10")))
        self.assertFalse(os.path.exists(os.path.join(out, "checkpoints", "latest")))


if __name__ == "__main__":
    unittest.main()
