"""Generated bad configs: every one is refused with exit 2 and a message naming a file:line, key,
flag or limit, or accepted with exit 0 — never a crash, a hang or an unbounded allocation.
`launch --print_config` reads each under a memory limit (prlimit) and a timeout; the generator
is seeded, so a failure reproduces."""

import os
import stat
import random
import shutil
import socket
import subprocess
import time
import unittest

from harness import LAUNCH, free_port, tmpdir

MEMORY_LIMIT = 1 << 30  # far above what a real config needs; an unbounded allocation hits it

# Keys and the kinds of values that stress them.
KEYS = ["num_processes", "nproc_per_node", "num_machines", "machine_rank", "max_restarts",
        "main_process_port", "run_id", "stop_grace", "mixed_precision", "distributed_type",
        "rdzv_conf", "gpu_ids", "tee", "local_ranks_filter", "python", "line_buffered"]
TRAIN_KEYS = ["batch_size", "max_steps", "gradient_accumulation_steps", "seed", "output_dir",
              "model", "optimizer", "data", "parallel", "checkpoint_every", "log_every"]
VALUES = ["2000000000", "-1", "0", "1e30", "-1e308", ".nan", ".inf", "9" * 40, "''", "~",
          "[1, 2, 3]", "{a: 1}", "'x'", "true", "'" + "y" * 5000 + "'", "2:1", "1:70000",
          "'\\x00'", "\"\\u0001\\u001b[2J\"", "&a [*a]", "!!binary aGVsbG8=", "{lr: -1}",
          "{type: mlp, layers: [100000, 100000, 100000]}", "{mode: zero, zero_stage: 9}",
          "heartbeat_timeout=0.001", "join_timeout=1e9", "3", "auto", "gpu", "bf16"]


# Lines that load, mixed in so that some generated configs are accepted too.
VALID = ["num_processes: 2", "nproc_per_node: 1", "max_restarts: 3", "mixed_precision: bf16",
         "run_id: ok", "main_process_port: 29500", "rdzv_conf: {join_timeout: 60}",
         "distributed_type: MULTI_CPU", "stop_grace: 5", "line_buffered: false"]


def generate(rng):
    lines = []
    bad_lines = rng.choice([0, 1, 1, 2, 4])
    for _ in range(bad_lines):
        lines.append(f"{rng.choice(KEYS)}: {rng.choice(VALUES)}")
    lines += rng.sample(VALID, rng.randint(0, 3))
    rng.shuffle(lines)
    if rng.random() < 0.3:
        lines.append("train:")
        for _ in range(rng.randint(1, 5)):
            lines.append(f"  {rng.choice(TRAIN_KEYS)}: {rng.choice(VALUES)}")
    if lines and rng.random() < 0.2:
        lines.append(rng.choice(lines))  # a key given twice
    if rng.random() < 0.1:
        lines.append("x: " + "[" * rng.randint(100, 3000))  # deep nesting, unterminated
    return "\n".join(lines) + "\n"


class GeneratedConfigs(unittest.TestCase):
    def setUp(self):
        self.dir = tmpdir()

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_every_generated_config_is_refused_or_accepted_never_a_crash(self):
        rng = random.Random(20261126)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LAUNCH_", "PET_"))}
        outcomes = {0: 0, 2: 0}
        for i in range(300):
            text = generate(rng)
            path = os.path.join(self.dir, f"c{i}.yaml")
            with open(path, "w") as f:
                f.write(text)
            r = subprocess.run(["prlimit", f"--as={MEMORY_LIMIT}", LAUNCH, "--print_config",
                                path, "--", "true"], capture_output=True, text=True,
                               timeout=30, env=env, stdin=subprocess.DEVNULL)
            detail = f"config {i}:\n{text}\nstderr: {r.stderr[-2000:]}"
            self.assertIn(r.returncode, (0, 2), detail)
            self.assertNotIn("terminate called", r.stderr, detail)
            if r.returncode == 2:
                # Refusals name where: the file (with a line where the YAML has one).
                self.assertIn(path, r.stderr, detail)
            outcomes[r.returncode] += 1
        # The generator reaches both sides (a generator that only produces refusals tests less).
        self.assertGreater(outcomes[0], 30, outcomes)
        self.assertGreater(outcomes[2], 100, outcomes)


class RefusalsNameTheirSetting(unittest.TestCase):
    """Refusals the reliability review found naming no key or flag, or the wrong remedy."""

    def setUp(self):
        self.dir = tmpdir()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("LAUNCH_", "PET_"))}

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def launch(self, *args):
        return subprocess.run([LAUNCH, *args], capture_output=True, text=True, timeout=60,
                              env=self.env, cwd=self.dir, stdin=subprocess.DEVNULL)

    def write(self, name, text):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def test_a_log_dir_that_is_a_file(self):
        f = self.write("afile", "")
        r = self.launch("--log_dir", f, "--", "true")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn(f"log_dir '{f}' (--log_dir", r.stderr)
        self.assertIn("Not a directory", r.stderr)

    def test_a_run_folder_planted_as_a_symlink_in_a_shared_log_dir_is_not_followed(self):
        shared, victim = os.path.join(self.dir, "shared"), os.path.join(self.dir, "victim")
        os.makedirs(victim)
        os.makedirs(shared)
        os.chmod(shared, 0o1777)
        os.symlink(victim, os.path.join(shared, "rid"))
        r = self.launch("--log_dir", shared, "--run_id", "rid", "--", "true")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("is a symbolic link, not a folder; refusing to follow it", r.stderr)
        self.assertEqual(os.listdir(victim), [])
        if os.geteuid() != 0:
            return  # planting another user's folder needs root
        # Another user's folder under the run id is refused too.
        planted = os.path.join(shared, "theirs")
        os.makedirs(planted)
        os.chown(planted, 12345, 12345)
        r = self.launch("--log_dir", shared, "--run_id", "theirs", "--", "true")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("belongs to uid 12345, not to this user", r.stderr)
        self.assertEqual(os.listdir(planted), [])

    def test_a_run_folder_in_a_shared_log_dir_is_private(self):
        # Every user may write to the log_dir, so every user could read what is below it: the
        # run's folder is this user's alone (the logs inside keep their own modes).
        shared = os.path.join(self.dir, "shared_logs")
        os.makedirs(shared)
        os.chmod(shared, 0o1777)
        r = self.launch("--log_dir", shared, "--run_id", "mine", "--", "echo", "secret")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(stat.S_IMODE(os.stat(os.path.join(shared, "mine")).st_mode), 0o700)
        logs = os.path.join(shared, "mine", "attempt_0", "rank_0.stdout")
        with open(logs) as f:
            self.assertEqual(f.read(), "secret\n")
        # In a log_dir of one's own the umask decides, as for any folder.
        own = os.path.join(self.dir, "own_logs")
        os.makedirs(own, mode=0o755)
        os.chmod(own, 0o755)
        r = self.launch("--log_dir", own, "--run_id", "mine", "--", "true")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotEqual(stat.S_IMODE(os.stat(os.path.join(own, "mine")).st_mode), 0o700)

    def test_an_output_dir_that_is_a_file(self):
        self.write("out", "")
        cfg = self.write("t.yaml", "train: {output_dir: out, max_steps: 1, model: {type: mlp, "
                         "layers: [4, 2]}, data: {type: synthetic, samples: 64}, "
                         "batch_size: 8}\n")
        r = self.launch(cfg)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("train.output_dir 'out': cannot create folder out/", r.stderr)

    def test_an_empty_key_in_a_json_config(self):
        cfg = self.write("a.json", '{"num_processes": 2,,}')
        r = self.launch("--config_file", cfg, "--", "true")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn(f"{cfg}:1: an empty key", r.stderr)

    def test_a_program_after_a_config_without_train_points_at_config_file(self):
        cfg = self.write("job.yaml", "num_processes: 1\n")
        r = self.launch(cfg, "--", "true")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn(f"give `--config_file {cfg} -- true ...`", r.stderr)
        r = self.launch("--config_file", cfg, "--", "true")
        self.assertEqual(r.returncode, 0, r.stderr)


    def test_a_collective_timeout_below_the_stall_report_is_warned_of(self):
        # The hang would fail with the transport's timeout before the stall report names the
        # rank that hangs. The defaults (3600 s against 1800 s) are in the right order.
        train = ("train: {max_steps: 1, model: {type: mlp, layers: [4, 2]}, "
                 "data: {type: synthetic, samples: 64}, batch_size: 8%s}\n")
        short = self.write("short.yaml", train % ", collective_timeout: 60")
        r = self.launch("--stall_timeout", "120", "--print_config", short)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("train.collective_timeout (60 s) is not above --stall_timeout (120 s)",
                      r.stderr)
        default = self.write("default.yaml", train % "")
        r = self.launch("--print_config", default)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("collective_timeout", r.stderr)


class RendezvousMessagesTest(unittest.TestCase):
    """What a node says when the rendezvous is not what it expects (the ecosystem review's
    silent or misleading cases): said at once, naming the cause."""

    def test_a_refused_endpoint_is_said_at_once_and_until_join_timeout(self):
        port = free_port()
        start = time.monotonic()
        r = subprocess.run([LAUNCH, "--nnodes", "2", "--node_rank", "1", "--master_addr",
                            "127.0.0.1", "--master_port", str(port), "--rdzv_conf",
                            "join_timeout=3", "--", "true"],
                           capture_output=True, text=True, timeout=60)
        self.assertNotEqual(r.returncode, 0, r.stderr)
        self.assertIn(f"waiting for the rendezvous server at 127.0.0.1:{port}: Connection "
                      "refused; retrying until join_timeout (3 s", r.stderr)
        self.assertIn(f"cannot reach the rendezvous server at 127.0.0.1:{port} within 3 s",
                      r.stderr)
        self.assertLess(time.monotonic() - start, 30)

    def test_an_endpoint_that_accepts_and_never_answers_fails_at_join_timeout(self):
        # Something listens on the port but says nothing (not a rendezvous server, or a hung
        # one): the join ends at join_timeout (2 s), not after a whole handshake wait (5 s).
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(8)
            port = listener.getsockname()[1]
            start = time.monotonic()
            r = subprocess.run([LAUNCH, "--nnodes", "2", "--node_rank", "1", "--master_addr",
                                "127.0.0.1", "--master_port", str(port), "--rdzv_conf",
                                "join_timeout=2", "--", "true"],
                               capture_output=True, text=True, timeout=60)
            took = time.monotonic() - start
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn(f"cannot reach the rendezvous server at 127.0.0.1:{port} within 2 s "
                      "(join_timeout): no handshake", r.stderr)
        self.assertLess(took, 4.5, r.stderr)

    def test_another_jobs_rendezvous_on_the_port_is_named_as_such(self):
        port = str(free_port())
        base = [LAUNCH, "--nnodes", "2", "--master_addr", "127.0.0.1", "--master_port", port]
        first = subprocess.Popen(base + ["--node_rank", "0", "--", "true"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            line, deadline = "", time.monotonic() + 30
            while "hosting the rendezvous" not in line and time.monotonic() < deadline:
                line = first.stderr.readline()
                if not line:
                    break
            self.assertIn("hosting the rendezvous", line)
            # Another job's node 0 on the same port: it cannot host, so it joined the other.
            r = subprocess.run(base + ["--node_rank", "0", "--", "false"],
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("run_id mismatch", r.stderr)
            self.assertIn(f"was already taken on this machine, by another job's rendezvous "
                          f"(its run id is the other one above): give this job its own "
                          f"--master_port", r.stderr)
            # A node of another command: what the derived id is made of.
            r = subprocess.run(base + ["--node_rank", "1", "--", "false"],
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("is derived from the node's command", r.stderr)
            self.assertIn("give every node the same --rdzv_id", r.stderr)
            # With --rdzv_id given, the derivation is not the cause.
            r = subprocess.run(base + ["--node_rank", "1", "--rdzv_id", "mine", "--", "true"],
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("run_id mismatch", r.stderr)
            self.assertNotIn("is derived from the node's command", r.stderr)
        finally:
            first.terminate()
            first.communicate(timeout=60)


if __name__ == "__main__":
    unittest.main()
