"""`train`'s TensorBoard event files read by TensorBoard's own reader (EventAccumulator), where
TensorBoard is installed: Debian packages none, so on a machine set up by scripts/setup this is
an [env] skip, and test_lifecycle.py's reader of our own checks the same files (framing, CRCs,
every value against metrics.jsonl)."""

import os
import subprocess
import unittest

import test_lifecycle
from trainer_helpers import TRAIN, free_port, metrics, rank_env, write_config
import harness

# test_lifecycle's 30-step job, with an evaluation every 10 steps and the event files.
CONFIG = test_lifecycle.OutputTest.CONFIG + "  eval_every: 10\n  tensorboard: true\n"


@unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
class TensorBoardReaderTest(unittest.TestCase):
    def test_tensorboards_reader_sees_every_step_and_evaluation(self):
        try:
            from tensorboard.backend.event_processing import event_accumulator
        except ImportError:
            self.skipTest(harness.env_dependent("TensorBoard is not installed (Debian has no "
                                                "package)"))
        tmp = harness.tmpdir()
        out = os.path.join(tmp, "o")
        cfg = write_config(tmp, CONFIG.format(out=out))
        r = subprocess.run([TRAIN, cfg], capture_output=True, text=True, timeout=60,
                           env=rank_env(0, 1, free_port()))
        self.assertEqual(r.returncode, 0, r.stderr)
        acc = event_accumulator.EventAccumulator(os.path.join(out, "tensorboard"))
        acc.Reload()
        train = metrics(out)
        self.assertEqual([e.step for e in acc.Scalars("train/loss")], [m["step"] for m in train])
        for e, m in zip(acc.Scalars("train/loss"), train):
            self.assertAlmostEqual(e.value, m["loss"], places=5)
        self.assertEqual([e.step for e in acc.Scalars("eval/loss")], [10, 20, 30])


if __name__ == "__main__":
    unittest.main()
