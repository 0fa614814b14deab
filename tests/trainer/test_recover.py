"""In-place recovery (`launch --recover in_place`): a SIGKILLed DDP rank is replaced alone while
the other ranks wait for it, re-form their group with it and hand it the run's state; the job
ends with the parameters of an undisturbed run, bit for bit, with the survivors' processes the
same throughout, no checkpoint read, and nothing left behind. Real `launch` and `train`
processes on one host (shared-memory transport); the ranks SIGKILL themselves at a chosen step
and phase (LAUNCH_TEST_SIGKILL_AT, trainer.cc), so the point of failure is exact."""

import json
import os
import re
import shutil
import signal
import subprocess
import time
import unittest

from trainer_helpers import LAUNCH, TRAIN, final, metrics, write_config
import harness

WORLD = 3
STEPS = 24
JOB = """
train:
  seed: 5
  output_dir: {out}
  model: {{type: mlp, layers: [16, 64, 64, 4], dropout: 0.2}}
  data: {{type: synthetic, samples: 4096}}
  eval_fraction: 0.0
  batch_size: 8
  max_steps: {steps}
  optimizer: {{type: adamw, lr: 3.0e-3, weight_decay: 0.01}}
  scheduler: {{type: cosine, warmup_steps: 4}}
  max_grad_norm: 1.0
  checkpoint_every: {ckpt}
  resume: never
  parallel: {{mode: {mode}, bucket_cap_mb: 25}}
"""


# The model and data of the layouts that split sequences or layers (test_tensor_parallel.py's).
TRANSFORMER = [("{type: mlp, layers: [16, 64, 64, 4], dropout: 0.2}",
                "{type: transformer, vocab: bytes, d_model: 32, layers: 2, heads: 4, context: 16, "
                "dropout: 0.2}"),
               ("{type: synthetic, samples: 4096}",
                "{type: text, path: /usr/share/common-licenses/GPL-3, context: 16}")]


def shm_files(marker):
    """/dev/shm entries of the job whose run id is `marker` (other jobs may run beside it)."""
    try:
        return [name for name in os.listdir("/dev/shm") if marker in name]
    except OSError:
        return []


@unittest.skipUnless(os.path.exists(TRAIN) and os.path.exists(LAUNCH),
                     harness.needs_setup(f"{TRAIN} or {LAUNCH} not built"))
class RecoverInPlaceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = harness.tmpdir()
        cls.reference = cls.run_job("reference", kill="")
        assert cls.reference[0].returncode == 0, cls.reference[0].stderr

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    @classmethod
    def run_job(cls, name, kill, max_restarts=3, mode="ddp", ckpt=0, extra=(), env=None,
                world=WORLD, flags=(), transformer=False):
        out = os.path.join(cls.dir, name)
        text = JOB.format(out=out, steps=STEPS, mode=mode, ckpt=ckpt)
        for old, new in TRANSFORMER if transformer else ():
            text = text.replace(old, new)
        cfg = write_config(cls.dir, text, name=name + ".yaml")
        marker = harness.unique_marker("recover")
        env = dict(env or {}, LAUNCH_TEST_SIGKILL_AT=kill or None, RECOVER_TEST_MARKER=marker,
                   LAUNCH_INIT_TIMEOUT_S="60")
        r = harness.launch("--nproc_per_node", str(world), "--run_id", marker,
                           "--recover", "in_place",
                           "--max_restarts", str(max_restarts), *flags, cfg, *extra, timeout=240,
                           env=env)
        return r, out, marker

    def check_clean(self, marker):
        # Every worker and replacement is gone with launch, and so is every shared-memory
        # segment of the job (memfds: none of them has a name in /dev/shm either).
        self.assertEqual(harness.pids_with_marker(marker), [])
        self.assertEqual(shm_files(marker), [])

    def start_pids(self, text):
        """{rank: [pids of its workers in start order]} from the trainer's start lines."""
        pids = {}
        for rank, pid in re.findall(r"train: rank (\d+) \(pid (\d+)\): in-place recovery on", text):
            pids.setdefault(int(rank), []).append(int(pid))
        return pids

    def run_to_the_reference(self, name, kill):
        """Runs with `kill`: exit 0, every step once, the reference's parameters. Returns the
        output, the ranks replaced (in order) and the run's marker."""
        r, out, marker = self.run_job(name, kill)
        text = r.stdout + r.stderr
        self.assertEqual(r.returncode, 0, text[-4000:])
        self.assertEqual(final(out)["param_checksum"],
                         final(self.reference[1])["param_checksum"], text[-4000:])
        self.assertEqual([m["step"] for m in metrics(out)], list(range(1, STEPS + 1)))
        # final.json describes the whole run, not the part since the last recovery (nor the
        # replacement's part when rank 0 was replaced): the same collectives as undisturbed.
        for key in ("allreduces_total", "pair_exchanges_total", "reduce_scatters_total",
                    "allgathers_total", "samples_seen", "steps_this_run"):
            self.assertEqual(final(out)[key], final(self.reference[1])[key], key)
        # Its loop time too is the run's (rank 0 may be a replacement that started mid-run): at
        # least the steps' own time, every step's as metrics.jsonl has it.
        self.assertGreaterEqual(final(out)["loop_s"],
                                sum(m["step_ms"] for m in metrics(out)) / 1000 * 0.99)
        replaced = [int(x) for x in re.findall(r"starting a replacement for rank (\d+) alone", text)]
        return text, replaced, marker

    def check_recovered(self, name, kill, lost):
        """Runs with `kill`; `lost` lists the ranks that die, in order."""
        text, replaced, marker = self.run_to_the_reference(name, kill)
        # One replacement per death, for that rank alone.
        self.assertEqual(replaced, lost, text[-4000:])
        pids = self.start_pids(text)
        for rank in range(WORLD):
            self.assertEqual(len(pids.get(rank, [])), 1 + lost.count(rank), text[-4000:])
        # The survivors' processes are the ones that started: each "lost a peer" line comes
        # from a first worker (or an earlier replacement) of its rank, never from a new one.
        for rank, pid in re.findall(r"train: rank (\d+) \(pid (\d+)\): lost a peer", text):
            self.assertIn(int(pid), pids[int(rank)])
        self.assertIn("replacement (generation 1) took the state of step", text)
        self.assertEqual(final(self.reference[1])["recoveries"], 0)
        self.assertEqual(final(os.path.join(self.dir, name))["recoveries"], len(lost))
        self.assertNotIn("resumed from", text)  # no checkpoint read
        self.check_clean(marker)
        return text

    def test_warm_spares_take_the_dead_ranks_places_and_end_bit_identical(self):
        # --spares 1: a spare starts with the job (LibTorch loaded, data built) and waits. Rank 1
        # dies in step 6, rank 0 (the store's host) in step 15: each time the waiting spare is
        # handed the dead rank (no process start) and another spare starts for later. The spare
        # left waiting at the end is let go and exits 0.
        r, out, marker = self.run_job("spares", "1:6:backward,0:15:backward",
                                      flags=("--spares", "1"))
        text = r.stdout + r.stderr
        self.assertEqual(r.returncode, 0, text[-4000:])
        self.assertEqual(final(out)["param_checksum"],
                         final(self.reference[1])["param_checksum"], text[-4000:])
        self.assertEqual([m["step"] for m in metrics(out)], list(range(1, STEPS + 1)))
        self.assertEqual(final(out)["recoveries"], 2)
        self.assertIn("rank 1: spare 0 (started and loaded) takes its place", text)
        self.assertIn("rank 0: spare 1 (started and loaded) takes its place", text)
        # Three spares were started, each said it was ready (spare 1, started after the first
        # recovery, may be handed rank 0 while it still loads: its line then has rank 0's prefix).
        ready = [int(pid) for pid in re.findall(r"train: spare \(pid (\d+)\) ready", text)]
        self.assertEqual(len(ready), 3, text[-4000:])
        self.assertRegex(text, r"\[spare 0\]: train: spare \(pid \d+\) ready")
        # The replacements are the spares' processes, not new ones.
        pids = self.start_pids(text)
        self.assertEqual(len(pids[1]), 2, text[-4000:])
        self.assertEqual(len(pids[0]), 2, text[-4000:])
        self.assertIn(pids[1][1], ready)
        self.assertIn(pids[0][1], ready)
        self.assertEqual(len(re.findall(r"recovered \d+\.\d+ s after the failure", text)), 4)
        self.assertNotIn("before it was needed", text)
        self.assertNotIn("resumed from", text)
        self.check_clean(marker)

    def test_spares_need_in_place_recovery_and_the_built_in_trainer(self):
        cfg = write_config(self.dir, JOB.format(out=os.path.join(self.dir, "x"), steps=2,
                                                mode="ddp", ckpt=0), name="spares_bad.yaml")
        r = harness.launch("--nproc_per_node", "2", "--spares", "1", cfg, timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("spares need recover in_place", r.stderr)
        r = harness.launch("--nproc_per_node", "2", "--spares", "1", "--recover", "in_place",
                           "--", "true", timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("spares need the built-in trainer", r.stderr)

    def test_rank0_killed_in_backward_ends_bit_identical(self):
        self.check_recovered("r0_backward", "0:9:backward", [0])

    def test_rank1_killed_before_forward_ends_bit_identical(self):
        self.check_recovered("r1_forward", "1:9:forward", [1])

    def test_rank2_killed_in_the_optimizer_step_ends_bit_identical(self):
        # Its peers finished the step (the gradients were averaged): nothing is redone.
        self.check_recovered("r2_optimizer", "2:9:optimizer", [2])

    def test_two_failures_in_a_row_end_bit_identical(self):
        text = self.check_recovered("two", "1:6:backward,2:15:backward", [1, 2])
        self.assertIn("replacement (generation 2) took the state of step", text)

    def test_two_ranks_lost_at_once_meet_in_one_generation_and_end_bit_identical(self):
        # Each replacement announces a generation of its own. The group of the first never
        # fills (the second replacement goes to its own): everyone meets in the second, at
        # once, instead of forming the first and waiting out the group timeout.
        text, replaced, marker = self.run_to_the_reference("both", "1:9:backward,2:9:backward")
        self.assertEqual(sorted(replaced), [1, 2], text[-4000:])
        # Both replacements and the survivor in generation 2; nobody restarted.
        self.assertEqual(len(re.findall(r"replacement \(generation 2\) took the state of step 8",
                                        text)), 2, text[-4000:])
        self.assertRegex(text, r"train: rank 0: recovered [0-9.]+ s after the failure "
                               r"\(first noticed [^)]+\): group generation 2 with the replacement")
        self.assertNotIn("resumed from", text)
        self.assertNotRegex(text, r"restart \d of 3\b(?!, in place)")
        self.check_clean(marker)

    def test_rank0_lost_during_a_recovery_takes_the_store_and_everyone_meets_in_the_next(self):
        # Rank 1 dies in step 9; while rank 0 (the store's host) recovers, it is SIGKILLed too.
        # Rank 2, the survivor, loses the store while it waits in it for rank 1's replacement;
        # it meets everyone again in the store rank 0's replacement hosts, in that one's
        # generation: one recovery, in place, bit-identical.
        out = os.path.join(self.dir, "store_lost")
        cfg = write_config(self.dir, JOB.format(out=out, steps=STEPS, mode="ddp", ckpt=0),
                           name="store_lost.yaml")
        marker = harness.unique_marker("recover")
        env = dict(os.environ, LAUNCH_TEST_SIGKILL_AT="1:9:backward", RECOVER_TEST_MARKER=marker,
                   LAUNCH_INIT_TIMEOUT_S="60")
        proc = subprocess.Popen([LAUNCH, "--nproc_per_node", str(WORLD), "--run_id", marker,
                                 "--recover", "in_place", "--max_restarts", "3", cfg],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env)
        lines = []
        with proc:
            try:
                for line in proc.stdout:
                    lines.append(line)
                    m = re.search(r"train: rank 0 \(pid (\d+)\): lost a peer during step", line)
                    if m:
                        # Rank 2 waits in the store by then (it saw the loss as rank 0 did);
                        # rank 1's replacement takes longer than this to start.
                        time.sleep(0.15)
                        os.kill(int(m.group(1)), signal.SIGKILL)
                rc = proc.wait(timeout=240)
            finally:
                if proc.poll() is None:
                    proc.kill()
        text = "".join(lines)
        self.assertEqual(rc, 0, text[-4000:])
        self.assertEqual(final(out)["param_checksum"],
                         final(self.reference[1])["param_checksum"], text[-4000:])
        replaced = [int(x) for x in re.findall(r"starting a replacement for rank (\d+) alone", text)]
        self.assertEqual(replaced, [1, 0], text[-4000:])
        # (Rank 2 says "the store failed while waiting" when the kill found it in the store, as
        # it mostly does; found before, it reconnects as after rank 0's loss alone.)
        self.assertEqual(len(re.findall(r"replacement \(generation 2\) took the state of step 8",
                                        text)), 2, text[-4000:])
        self.assertRegex(text, r"train: rank 2: recovered [0-9.]+ s after the failure "
                               r"\(first noticed [^)]+\): group generation 2 with the replacement")
        self.assertNotIn("in-place recovery failed", text)
        self.assertNotIn("resumed from", text)
        self.check_clean(marker)

    def test_kill_during_a_checkpoint_skips_it_and_ends_bit_identical(self):
        # Checkpoints do not change the trajectory: the reference needs none.
        r, out, marker = self.run_job("ckpt", "1:8:checkpoint", ckpt=4)
        text = r.stdout + r.stderr
        self.assertEqual(r.returncode, 0, text[-4000:])
        self.assertEqual(final(out)["param_checksum"],
                         final(self.reference[1])["param_checksum"], text[-4000:])
        self.assertIn("was not committed: a peer was lost", text)
        with open(os.path.join(out, "checkpoints", "latest")) as f:
            self.assertEqual(f.read().strip(), str(STEPS))
        self.check_clean(marker)

    def test_context_parallel_rank3_killed_in_backward_ends_bit_identical(self):
        # Context 2 x data 2: rank 3 holds the second half of replica 1's sequences and trades
        # heads for tokens with rank 2 inside every attention layer; it dies as its backward
        # begins, so rank 2 waits for it in the backward's first exchange. Its replacement takes
        # the live state and the context group is re-formed with it (the layers keep the group
        # they hold).
        mode = "ddp, context: 2"
        ref, ref_out, _ = self.run_job("cp_ref", "", mode=mode, world=4, transformer=True)
        self.assertEqual(ref.returncode, 0, ref.stderr[-4000:])
        self.assertIn("context 2 x data 2", ref.stdout)
        r, out, marker = self.run_job("cp", "3:9:backward", mode=mode, world=4, transformer=True)
        text = r.stdout + r.stderr
        self.assertEqual(r.returncode, 0, text[-4000:])
        self.assertEqual(final(out)["param_checksum"], final(ref_out)["param_checksum"],
                         text[-4000:])
        self.assertEqual(final(out)["recoveries"], 1)
        # The abandoned step's all-to-alls are not the run's; the redone step's are.
        self.assertGreater(final(ref_out)["alltoalls_total"], 0)
        self.assertEqual(final(out)["alltoalls_total"], final(ref_out)["alltoalls_total"])
        self.assertEqual(re.findall(r"starting a replacement for rank (\d+) alone", text), ["3"])
        self.assertEqual([m["step"] for m in metrics(out)], list(range(1, STEPS + 1)))
        self.assertNotIn("resumed from", text)
        self.check_clean(marker)

    def test_recovery_over_gloo_ends_bit_identical(self):
        # Without shared memory a dead peer shows as a closed Gloo connection. Gloo's ring sums
        # in another order than shared memory: compared with an undisturbed Gloo run.
        gloo = {"LAUNCH_SHM_ALLREDUCE": "0"}
        ref, ref_out, _ = self.run_job("gloo_ref", "", env=gloo)
        self.assertEqual(ref.returncode, 0, ref.stderr[-4000:])
        r, out, marker = self.run_job("gloo", "2:9:backward", env=gloo)
        text = r.stdout + r.stderr
        self.assertEqual(r.returncode, 0, text[-4000:])
        # LibTorch 1.13's Gloo says "closed", 2.6's "reset".
        self.assertRegex(text, r"Connection (closed|reset) by peer")
        self.assertIn("replacement (generation 1) took the state of step 8", text)
        self.assertEqual(final(out)["param_checksum"], final(ref_out)["param_checksum"])
        self.check_clean(marker)

    def test_a_loss_over_gloo_reaches_every_survivor_at_once(self):
        # Four ranks over Gloo, whose ring has each rank receive from one neighbour only: rank
        # 3 never talks to rank 1, and rank 2 neither to rank 0. Each survivor that sees the
        # loss abandons the broken group (its connections close under the others) and every
        # survivor watches the store for the replacement's generation (and for the store's own
        # loss, with rank 0): none waits out the group's collective timeout
        # (train.collective_timeout, 3600 s).
        gloo = {"LAUNCH_SHM_ALLREDUCE": "0"}
        ref, ref_out, _ = self.run_job("gloo4_ref", "", env=gloo, world=4)
        self.assertEqual(ref.returncode, 0, ref.stderr[-4000:])
        for lost in (1, 0):
            with self.subTest(lost=lost):
                r, out, marker = self.run_job(f"gloo4_{lost}", f"{lost}:9:backward", env=gloo,
                                              world=4)
                text = r.stdout + r.stderr
                self.assertEqual(r.returncode, 0, text[-4000:])
                self.assertEqual(final(out)["param_checksum"], final(ref_out)["param_checksum"])
                # Every survivor recovered, each well inside the timeout, counted from the
                # loss's first notice anywhere (the agent's, which saw the worker die).
                costs = re.findall(r"train: rank (\d+): recovered ([0-9.]+) s after the failure "
                                   r"\(first noticed ([^)]+)\)", text)
                self.assertEqual(sorted(int(c[0]) for c in costs),
                                 [rank for rank in range(4) if rank != lost], text[-4000:])
                for _, seconds, _ in costs:
                    self.assertLess(float(seconds), 30, text[-4000:])
                self.check_clean(marker)

    def test_a_rank_lost_before_the_group_formed_restarts_every_worker_at_once(self):
        # Rank 1 dies while the others form the first group: there is no step to recover, and
        # nothing would tell them of the loss in Gloo's formation, where they would wait the
        # init timeout (60 s here) for it. The agent restarts the group at once instead.
        r, out, marker = self.run_job("before_join", "1:0:join")
        text = r.stdout + r.stderr
        self.assertEqual(r.returncode, 0, text[-4000:])
        self.assertIn("rank 1 cannot be recovered in place (it died before its process group "
                      "formed): every worker restarts", text)
        self.assertNotIn("did not form within", text)
        self.assertNotIn("starting a replacement", text)
        self.assertEqual(final(out)["param_checksum"],
                         final(self.reference[1])["param_checksum"], text[-4000:])
        self.check_clean(marker)

    def test_recoveries_count_against_max_restarts(self):
        # One restart: the first death is recovered in place, the second ends the job.
        r, out, marker = self.run_job("budget", "1:6:backward,2:15:backward", max_restarts=1)
        text = r.stdout + r.stderr
        self.assertEqual(r.returncode, 137, text[-4000:])
        self.assertEqual(len(re.findall(r"starting a replacement for rank", text)), 1)
        self.check_clean(marker)

    def test_mode_without_in_place_recovery_restarts_everyone(self):
        # parallel.mode none: each rank trains alone and nothing keeps its state elsewhere, so a
        # lost rank restarts the job (no checkpoint here: from step 0), which still ends as an
        # undisturbed run does. The agent restarts everyone at once, as --recover restart would:
        # with one restart allowed, the job finishes (a replacement first would have spent it).
        ref, ref_out, _ = self.run_job("none_ref", "", mode="none")
        self.assertEqual(ref.returncode, 0, ref.stderr[-4000:])
        r, out, marker = self.run_job("none", "1:9:forward", max_restarts=1, mode="none")
        text = r.stdout + r.stderr
        self.assertEqual(r.returncode, 0, text[-4000:])
        self.assertIn("in-place recovery needs ddp, zero or local_sgd (under any layout); in none "
                      "mode", text)
        self.assertIn("rank 1 cannot be recovered in place (its mode keeps state on each rank "
                      "alone, or it died before Prepare): every worker restarts", text)
        self.assertNotIn("starting a replacement", text)
        self.assertRegex(text, r"restart 1 of 1\b")
        self.assertEqual(final(out)["param_checksum"], final(ref_out)["param_checksum"])
        self.check_clean(marker)

    def test_power_sgd_restarts_everyone(self):
        # Each rank's PowerSGD error feedback is its own: a lost rank (here at step 15,
        # compressing since step 5) restarts every worker at once, as --recover restart would
        # (resume: never here: from step 0; ExactResumeTest resumes PowerSGD from a
        # checkpoint), and the job ends as the undisturbed run does.
        mode = "ddp, comm_hook: power_sgd, power_sgd: {start_powerSGD_iter: 4}"
        ref, ref_out, _ = self.run_job("psgd_ref", "", mode=mode)
        self.assertEqual(ref.returncode, 0, ref.stderr[-4000:])
        r, out, marker = self.run_job("psgd", "1:15:forward", max_restarts=1, mode=mode)
        text = r.stdout + r.stderr
        self.assertEqual(r.returncode, 0, text[-4000:])
        self.assertIn("in-place recovery: comm_hook power_sgd keeps each rank's own error "
                      "feedback", text)
        self.assertIn("every worker restarts", text)
        self.assertRegex(text, r"restart 1 of 1\b")
        self.assertIn("power_sgd: compressing from synchronised step 5", ref.stdout)
        self.assertEqual(final(out)["param_checksum"], final(ref_out)["param_checksum"])
        self.check_clean(marker)


if __name__ == "__main__":
    unittest.main()
