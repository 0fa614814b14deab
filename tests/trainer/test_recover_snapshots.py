"""In-place recovery of the modes whose state exists on one rank alone (zero stages 1-3, Local
SGD, DiLoCo): every rank keeps an in-memory snapshot of its state every
train.recover_snapshot_every steps and its keeper a copy; a SIGKILLed rank is replaced alone, every
rank rolls back to the newest snapshot all hold (the replacement to its keeper's copy) and redoes
the steps since. The job ends with the parameters and collective totals of an undisturbed run,
bit for bit, no checkpoint read, nothing left behind. Real `launch` and `train` processes on one
host; the ranks SIGKILL themselves at a chosen step and phase (LAUNCH_TEST_SIGKILL_AT,
trainer.cc) or in the middle of their snapshot's copy (LAUNCH_TEST_SIGKILL_IN_SNAPSHOT). Copies are
made and exchanged while training goes on; LAUNCH_TEST_SNAPSHOT_SYNC=1 waits for each, so that the
snapshot a recovery goes back to is known in advance (one test runs without it)."""

import os
import re
import shutil
import unittest

from trainer_helpers import LAUNCH, LIBTORCH_MAJOR, TRAIN, final, metrics, write_config
from test_recover import JOB, STEPS, TRANSFORMER, shm_files
import harness

EVERY = 4
MODES = {
    "zero1": ("zero, zero_stage: 1", ""),
    "zero2": ("zero, zero_stage: 2", ""),
    "zero3": ("zero, zero_stage: 3", ""),
    "local_sgd": ("ddp", "  local_sgd_steps: 3"),
    "diloco": ("ddp", "  local_sgd_steps: 3\n  local_sgd: {outer: nesterov}"),
    # A pipeline of 3 stages (one replica: a stage's layers exist on one rank alone), and 2
    # stages x 2 replicas under ddp (4 ranks).
    "pipeline": ("pipeline, stages: 3", ""),
    "pp_ddp": ("ddp, stages: 2", ""),
    "pp_zero": ("zero, zero_stage: 1, stages: 2", ""),
    # Megatron-style tensor parallelism (the built-in transformer on text): tensor 2 x data 2,
    # and tensor 2 x stages 2.
    "tensor": ("ddp, tensor: 2", ""),
    "tensor_pp": ("ddp, tensor: 2, stages: 2", ""),
    # mixed_precision fp16 (LibTorch 2.x on the CPU): a first scale too large for float16 and a
    # growth every 3 clean steps, so that steps are skipped before and after the snapshot.
    "zero2_fp16": ("zero, zero_stage: 2",
                   "  grad_scaler: {init_scale: 16777216, growth_interval: 3}"),
}
# test_recover's job, with a snapshot every EVERY steps.
SNAPSHOTS = f"  recover_snapshot_every: {EVERY}\n"
TOTALS = ("allreduces_total", "pair_exchanges_total", "reduce_scatters_total",
          "allgathers_total", "alltoalls_total", "samples_seen")


@unittest.skipUnless(os.path.exists(TRAIN) and os.path.exists(LAUNCH),
                     harness.needs_setup(f"{TRAIN} or {LAUNCH} not built"))
class RecoverFromSnapshotsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = harness.tmpdir()
        cls.references = {}

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    @classmethod
    def run_job(cls, name, mode, world=3, env=None, max_restarts=3, sync=True):
        out = os.path.join(cls.dir, name)
        parallel, extra = MODES[mode]
        text = JOB.format(out=out, steps=STEPS, mode=parallel, ckpt=0) + SNAPSHOTS + extra + "\n"
        if mode.endswith("_fp16"):
            text = "mixed_precision: fp16\n" + text
        for old, new in TRANSFORMER if mode.startswith("tensor") else ():
            text = text.replace(old, new)
        cfg = write_config(cls.dir, text, name=name + ".yaml")
        marker = harness.unique_marker("snapshot")
        env = dict(env or {}, RECOVER_TEST_MARKER=marker, LAUNCH_INIT_TIMEOUT_S="60",
                   LAUNCH_TEST_SNAPSHOT_SYNC="1" if sync else None)
        r = harness.launch("--nproc_per_node", str(world), "--run_id", marker,
                           "--recover", "in_place", "--max_restarts", str(max_restarts), cfg,
                           timeout=240, env=env)
        return r, out, marker

    def reference(self, mode, world=3):
        key = (mode, world)
        if key not in self.references:
            r, out, _ = self.run_job(f"ref_{mode}_{world}", mode, world=world)
            self.assertEqual(r.returncode, 0, r.stderr[-4000:])
            self.assertEqual(final(out)["recoveries"], 0)
            # Each rank's newest image, rank by rank.
            sizes = final(out)["snapshot_bytes"]
            self.assertEqual(len(sizes), world, sizes)
            self.assertTrue(all(b > 0 for b in sizes), sizes)
            self.references[key] = out
        return self.references[key]

    def check_clean(self, marker):
        self.assertEqual(harness.pids_with_marker(marker), [])
        self.assertEqual(shm_files(marker), [])

    def recover(self, name, mode, kill, lost, back_to, world=3, env=None, sync=True):
        """Runs `mode` with `kill` (LAUNCH_TEST_SIGKILL_AT): exit 0, the reference's parameters
        and totals, one replacement per death in `lost`, each recovery rolled back to the
        snapshot step in `back_to` (None: any). Returns the log and the steps gone back to."""
        ref = self.reference(mode, world)
        r, out, marker = self.run_job(name, mode, world=world, sync=sync,
                                      env=dict(env or {}, LAUNCH_TEST_SIGKILL_AT=kill or None))
        text = r.stdout + r.stderr
        self.assertEqual(r.returncode, 0, text[-4000:])
        self.assertEqual(final(out)["param_checksum"], final(ref)["param_checksum"],
                         text[-4000:])
        for key in TOTALS:
            self.assertEqual(final(out)[key], final(ref)[key], key)
        self.assertEqual(final(out)["recoveries"], len(lost))
        replaced = [int(x) for x in re.findall(r"starting a replacement for rank (\d+) alone", text)]
        self.assertEqual(replaced, lost, text[-4000:])
        # Every survivor went back to the same snapshot; the replacement took its own image
        # from its keeper.
        steps = re.findall(r"train: rank \d+: recovered [0-9.]+ s after the failure .*rolled "
                           r"back to the snapshot of step (\d+)", text)
        if back_to is not None:
            self.assertEqual(sorted(set(int(s) for s in steps)), sorted(set(back_to)),
                             text[-4000:])
        self.assertEqual(len(steps), (world - 1) * len(lost), text[-4000:])
        self.assertEqual(len(re.findall(r"replacement \(generation \d+\) took the snapshot of step",
                                        text)), len(lost), text[-4000:])
        # Every step ran, the redone ones again: the log's last pass is the whole run.
        done = [m["step"] for m in metrics(out)]
        self.assertEqual(sorted(set(done)), list(range(1, STEPS + 1)))
        self.assertNotIn("resumed from", text)
        self.assertNotRegex(text, r"restart \d of 3\b(?!, in place)")
        self.check_clean(marker)
        return text, [int(s) for s in steps]

    def test_zero1_rank1_killed_in_backward(self):
        self.recover("z1", "zero1", "1:9:backward", [1], [8])

    def test_zero2_rank0_killed_three_steps_after_the_snapshot(self):
        # Rank 0 hosts the store: its replacement hosts a new one.
        self.recover("z2", "zero2", "0:11:backward", [0], [8])

    @unittest.skipUnless(LIBTORCH_MAJOR >= 2,
                         harness.env_dependent("LibTorch 1.13's CPU autocast is bfloat16 only"))
    def test_zero2_fp16_rank1_killed_the_loss_scaler_goes_back_too(self):
        # The scale and its run of clean steps are part of the snapshot: a scaler that went on
        # from where the lost step left it would skip other steps than the undisturbed run.
        self.recover("z2fp16", "zero2_fp16", "1:10:backward", [1], [8])
        skipped = final(self.reference("zero2_fp16"))["skipped_steps"]
        self.assertTrue(0 < skipped < STEPS, skipped)

    def test_zero3_rank2_killed_in_forward(self):
        # Stage 3 gathers each unit in the forward: the loss is seen there.
        self.recover("z3", "zero3", "2:10:forward", [2], [8])

    def test_zero3_four_ranks_rank0_killed(self):
        self.recover("z3w4", "zero3", "0:7:backward", [0], [4], world=4)

    def test_local_sgd_rank1_killed_between_averages(self):
        self.recover("lsgd", "local_sgd", "1:11:backward", [1], [8])

    def test_diloco_rank0_killed(self):
        text, _ = self.recover("diloco", "diloco", "0:10:optimizer", [0], [8])
        self.assertIn("took the snapshot of step 8 from rank 1", text)
        # The outer anchor and momentum go in the images of ranks 0 and 1 only.
        sizes = final(self.reference("diloco"))["snapshot_bytes"]
        self.assertGreater(sizes[0], sizes[2], sizes)
        self.assertGreater(sizes[1], sizes[2], sizes)

    def test_diloco_four_ranks_rank3_killed(self):
        # The outer anchor and momentum are in the images of ranks 0 and 1 only: rank 3's
        # replacement and rank 2 take them from rank 0 (an outer step, at 9, came after the
        # snapshot of step 8).
        self.recover("diloco4", "diloco", "3:11:forward", [3], [8], world=4)

    def test_copies_made_while_training_goes_on(self):
        # Without waiting for the copies: the recovery goes back to the newest snapshot whose
        # exchange had completed everywhere, which timing decides; the end is the same.
        _, steps = self.recover("async", "zero1", "1:21:backward", [1], None, sync=False)
        for step in steps:
            self.assertEqual(step % EVERY, 0)
            self.assertLess(step, 21)

    def test_pipeline_middle_stage_killed(self):
        # Stage 1's neighbours wait on it in their send/recv; stage 2 holds the loss.
        self.recover("pp1", "pipeline", "1:10:forward", [1], [8])

    def test_pipeline_first_stage_rank0_killed(self):
        self.recover("pp0", "pipeline", "0:7:optimizer", [0], [4])

    def test_pipeline_by_ddp_four_ranks_rank2_killed(self):
        # Rank 2 is stage 1 of replica 0: its replica (rank 3) and its stage 0 (rank 0) wait on
        # it, in the data group and in the stage's send/recv.
        self.recover("ppd", "pp_ddp", "2:10:optimizer", [2], [8], world=4)

    def test_pipeline_by_zero_four_ranks_rank0_killed(self):
        # Stage 0's ZeRO shards: rank 0's exists on it alone (its keeper's copy), and it hosts
        # the store.
        self.recover("ppz", "pp_zero", "0:6:forward", [0], [4], world=4)

    def test_tensor_by_data_four_ranks_rank1_killed(self):
        # Rank 1 is tensor rank 1 of replica 0: its shard exists on it and on rank 3 (replica
        # 1's same shard); its tensor group (rank 0) waits on it inside every layer.
        self.recover("tp", "tensor", "1:10:forward", [1], [8], world=4)

    def test_tensor_by_stages_four_ranks_rank0_killed(self):
        # Every rank's shard of its stage exists on it alone.
        self.recover("tpp", "tensor_pp", "0:7:optimizer", [0], [4], world=4)

    def test_two_failures_in_a_row(self):
        # The second recovery goes back to a snapshot taken after the first.
        self.recover("two", "zero1", "1:6:backward,2:15:backward", [1, 2], [4, 12])

    def test_kill_during_the_snapshot_copy_goes_back_to_the_previous_one(self):
        # Rank 1 dies between its image's size and its bytes: its keeper never completes the
        # snapshot of step 8, so every rank goes back to step 4.
        self.recover("in_copy", "zero1", "", [1], [4],
                     env={"LAUNCH_TEST_SIGKILL_IN_SNAPSHOT": "1:8"})

    def test_a_rank_lost_with_its_keeper_restarts_every_worker(self):
        # Rank 1's image is kept by rank 2: both lost at once leave it nowhere, so the job
        # restarts every worker (from step 0: no checkpoint) and still ends as undisturbed.
        ref = self.reference("zero1")
        r, out, marker = self.run_job("pair", "zero1",
                                      env={"LAUNCH_TEST_SIGKILL_AT": "1:9:backward,2:9:backward"})
        text = r.stdout + r.stderr
        self.assertEqual(r.returncode, 0, text[-4000:])
        self.assertIn("rank 1 and rank 2, which keeps the copy of its snapshot, were both lost",
                      text)
        self.assertEqual(final(out)["param_checksum"], final(ref)["param_checksum"])
        self.check_clean(marker)


if __name__ == "__main__":
    unittest.main()
