"""Asynchronous checkpoints (train.checkpoint_async): each rank forks a child that writes its
files while training goes on, and `latest` moves only once every rank's writer is done. A kill
that lands while a writer runs (the workers and the writer stopped first, so that nothing can
commit or finish in between, then the workers SIGKILLed) leaves the previous checkpoint the
latest and complete, takes the writer with its worker, and the run resumes from it to the
undisturbed run's parameters bit for bit."""

import os
import signal
import time
import unittest

from trainer_helpers import TRAIN, final, metrics, run_ranks, start_ranks, wait_all, write_config
import harness

STEPS = 400
CONFIG = """
train:
  seed: 11
  output_dir: {out}
  model: {{type: mlp, layers: [64, 1024, 1024, 1024, 4]}}
  data: {{type: synthetic, samples: 4096}}
  eval_fraction: 0.0
  batch_size: 16
  max_steps: {steps}
  optimizer: {{type: adam, lr: 1.0e-4}}
  checkpoint_every: 10
  checkpoint_async: {async_}
  save_model: never
  log_every: 1000
  parallel: {{mode: ddp}}
"""


def writing_into(pid, folder):
    """Whether process `pid` has a file under `folder` open."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(folder + "/"):
                return True
        except OSError:
            pass
    return False


def latest(ckpt):
    with open(os.path.join(ckpt, "latest")) as f:
        return int(f.read())


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class AsyncCheckpointTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def config(self, name, async_):
        out = os.path.join(self.tmp, name)
        return write_config(self.tmp, CONFIG.format(out=out, steps=STEPS, async_=async_),
                            name + ".yaml"), out

    def test_a_kill_during_the_write_leaves_the_previous_checkpoint_and_resumes_exactly(self):
        ref_cfg, ref_out = self.config("sync", "false")
        run_ranks(ref_cfg, 2, timeout=240)
        ref = final(ref_out)
        self.assertGreater(ref["checkpoint_blocking_ms"], 0)

        cfg, out = self.config("async", "true")
        ckpt = os.path.join(out, "checkpoints")
        procs, _ = start_ranks(cfg, 2)
        writer = None
        try:
            # Stop both workers while rank 0's writer runs, after a first checkpoint was
            # committed. Stopped, no worker can reach the step boundary that would commit the
            # save being written. The writer is stopped too, but only once it has a file of the
            # checkpoint open: that comes after it asked to die with its worker
            # (PR_SET_PDEATHSIG), and a child stopped between its fork and that request would
            # outlive any worker. A writer that finished meanwhile means another try.
            deadline = time.monotonic() + 120
            while writer is None and time.monotonic() < deadline:
                self.assertIsNone(procs[0].poll(), "the run ended before a kill landed")
                committed_once = os.path.exists(os.path.join(ckpt, "latest"))
                kids = harness.live_children(procs[0].pid) if committed_once else []
                if not kids:
                    time.sleep(0.002)
                    continue
                for p in procs:
                    p.send_signal(signal.SIGSTOP)
                for _ in range(500):  # up to ~1 s: the writer runs on while its worker is stopped
                    if not harness.alive(kids[0]):
                        break
                    if writing_into(kids[0], ckpt):
                        os.kill(kids[0], signal.SIGSTOP)
                        if harness.alive(kids[0]):
                            writer = kids[0]
                        break
                    time.sleep(0.002)
                if writer is None:
                    for p in procs:
                        p.send_signal(signal.SIGCONT)
            self.assertIsNotNone(writer, "never saw a checkpoint writer at work")
            committed = latest(ckpt)
            # The writer is stopped: only its worker's death can end it now.
            for p in procs:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=30)  # not their pipes: a live writer would hold them open
            # It died with its worker (PR_SET_PDEATHSIG). A bounded wait, not a timing: on a
            # loaded machine the killed writer may take seconds to be scheduled and exit.
            for _ in range(3000):
                if not harness.alive(writer):
                    break
                time.sleep(0.01)
            self.assertFalse(harness.alive(writer), "the checkpoint writer outlived its worker")
        finally:
            if writer is not None and harness.alive(writer):
                os.kill(writer, signal.SIGKILL)
            for p in procs:
                if p.poll() is None:
                    p.kill()
            wait_all(procs, timeout=30)
        # The save it was writing is there but not committed; the previous one is whole.
        steps = sorted(int(d[4:]) for d in os.listdir(ckpt) if d.startswith("step"))
        self.assertEqual(latest(ckpt), committed)
        self.assertGreater(steps[-1], committed, steps)
        whole = os.listdir(os.path.join(ckpt, f"step{committed}"))
        for name in ("model.pt", "rank0.pt", "rank1.pt", "run.txt"):
            self.assertIn(name, whole)

        # The agent's part, by hand: the restarted group resumes from it.
        results = wait_all(start_ranks(cfg, 2, restart=1)[0], timeout=240)
        for rc, _, err in results:
            self.assertEqual(rc, 0, err)
        self.assertIn(f"resumed from", results[0][1])
        got = final(out)
        self.assertEqual(got["steps"], STEPS)
        self.assertEqual(got["param_checksum"], ref["param_checksum"])
        self.assertEqual([m["step"] for m in metrics(out)], list(range(1, STEPS + 1)))
        # Later saves went on in the background: the run committed them and removed the
        # uncommitted folder of the killed one with the rest.
        self.assertEqual(sorted(os.listdir(ckpt)), ["latest", f"step{STEPS}"])
        self.assertGreater(got["checkpoints"], 0)


if __name__ == "__main__":
    unittest.main()
