"""`launch --dedup_output S`: a line that several ranks print alike is shown once, as
"[ranks 0-3]: line", on the console of real `launch` runs of 4 Python workers; lines of one
rank keep their prefix and order, and log files keep every rank's lines as printed."""

import os
import textwrap
import unittest

import harness
from harness import launch, tmpdir

# Every rank prints a banner, then (after a file barrier: all ranks are running) a line of its
# own, a warning on stderr that ranks 0 and 2 print, and a last line every rank prints.
SCRIPT = textwrap.dedent("""\
    import os, sys, time
    rank, world, folder = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), sys.argv[1]
    print("banner: starting", flush=True)
    open(os.path.join(folder, "ready-%d" % rank), "w").close()
    deadline = time.monotonic() + 60
    while (sum(os.path.exists(os.path.join(folder, "ready-%d" % r)) for r in range(world)) < world
           and time.monotonic() < deadline):
        time.sleep(0.02)
    print("I am rank %d" % rank, flush=True)
    if rank in (0, 2):
        print("warning: something odd", file=sys.stderr, flush=True)
    print("epoch 1 done", flush=True)
""")


def clean_env():
    # This machine exports PYTHONUNBUFFERED=1; users' machines do not.
    return {"PYTHONUNBUFFERED": None}


class DedupOutputTest(unittest.TestCase):
    def setUp(self):
        self.dir = tmpdir()
        self.script = os.path.join(self.dir, "ranks.py")
        with open(self.script, "w") as f:
            f.write(SCRIPT)

    def run_ranks(self, *flags):
        barrier = tmpdir()
        r = launch("--nproc_per_node", "4", "--python", harness.SYSTEM_PYTHON, *flags,
                   self.script, barrier, env=clean_env(), timeout=120)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return r

    def test_lines_every_rank_prints_are_shown_once_and_the_rest_keep_their_rank(self):
        # A long window: the lines all four ranks print leave as the fourth prints them, so
        # only the lines of fewer ranks wait for it.
        r = self.run_ranks("--dedup_output", "5")
        out = r.stdout.splitlines()
        self.assertEqual(out.count("[ranks 0-3]: banner: starting"), 1, r.stdout)
        self.assertEqual(out.count("[ranks 0-3]: epoch 1 done"), 1, r.stdout)
        self.assertNotIn("banner: starting", "\n".join(l for l in out if "[ranks" not in l))
        for rank in range(4):
            self.assertEqual(out.count(f"[rank {rank}]: I am rank {rank}"), 1, r.stdout)
        # Each rank's order: its banner, its own line, its last line.
        banner = out.index("[ranks 0-3]: banner: starting")
        last = out.index("[ranks 0-3]: epoch 1 done")
        for rank in range(4):
            self.assertLess(banner, out.index(f"[rank {rank}]: I am rank {rank}"), r.stdout)
            self.assertLess(out.index(f"[rank {rank}]: I am rank {rank}"), last, r.stdout)
        # stderr is merged apart: the ranks that printed the warning.
        self.assertEqual(r.stderr.splitlines().count("[ranks 0,2]: warning: something odd"), 1,
                         r.stderr)
        self.assertNotIn("[rank 0]: warning", r.stderr)

    def test_off_by_default_and_log_files_keep_every_ranks_lines(self):
        r = self.run_ranks()
        self.assertEqual(r.stdout.count("banner: starting"), 4, r.stdout)
        self.assertIn("[rank 3]: banner: starting", r.stdout)
        self.assertNotIn("[ranks", r.stdout + r.stderr)
        logs = tmpdir()
        r = self.run_ranks("--dedup_output", "5", "--log_dir", logs, "--tee", "3")
        self.assertEqual(r.stdout.count("banner: starting"), 1, r.stdout)
        files = []
        for folder, _, names in os.walk(logs):
            files += [os.path.join(folder, n) for n in names if n.endswith(".stdout")]
        self.assertEqual(len(files), 4, files)
        for path in files:
            with open(path) as f:
                self.assertEqual(f.read().count("banner: starting"), 1, path)

    def test_a_failing_ranks_last_lines_come_before_its_report(self):
        # Rank 1 prints and fails while the others still run: its line, held for the others'
        # copies (a 60 s window), is written before the failure report, not after the window.
        script = os.path.join(self.dir, "fail.py")
        with open(script, "w") as f:
            f.write("import os, sys, time\n"
                    "if os.environ['RANK'] == '1':\n"
                    "    print('fatal: out of data', file=sys.stderr, flush=True)\n"
                    "    sys.exit(3)\n"
                    "time.sleep(60)\n")
        r = launch("--nproc_per_node", "3", "--dedup_output", "60", "--stop_grace", "5",
                   "--python", harness.SYSTEM_PYTHON, script, env=clean_env(), timeout=120)
        self.assertEqual(r.returncode, 3, r.stdout + r.stderr)  # the root cause's code
        self.assertIn("[rank 1]: fatal: out of data", r.stderr)
        self.assertIn("worker failure", r.stderr)
        self.assertLess(r.stderr.index("[rank 1]: fatal: out of data"),
                        r.stderr.index("worker failure"), r.stderr)

    def test_a_bad_window_is_refused_naming_the_flag(self):
        r = launch("--dedup_output", "soon", "--nproc_per_node", "1", "--", "/bin/true")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--dedup_output", r.stderr)


if __name__ == "__main__":
    unittest.main()
