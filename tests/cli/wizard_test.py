"""`launch config` for real in a pseudo-terminal: menus with arrow and number keys, invalid
answers re-asked, the written YAML loads, Ctrl-C leaves nothing behind and restores the
terminal; `launch config default` never overwrites silently; no terminal -> exit 2."""

import fcntl
import os
import shutil
import stat
import struct
import subprocess
import sys
import termios
import unittest

sys.path.insert(0, os.path.dirname(__file__))

import harness  # noqa: E402
from cli_common import PtySession, cli_command  # noqa: E402

import yaml  # noqa: E402

DOWN = "\x1b[B"
UP = "\x1b[A"
LEFT = "\x1b[D"
HOME = "\x1b[H"
END = "\x1b[F"
TAB = "\t"
ENTER = "\r"
CTRL_C = "\x03"


class WizardTest(unittest.TestCase):
    def setUp(self):
        self.config = cli_command("config")
        if self.config is None:
            self.skipTest(harness.needs_setup(
                "neither build/bin/launch (with `config`) nor launch-cli-driver is built"))
        self.dir = harness.tmpdir()
        self.env = {"XDG_CONFIG_HOME": os.path.join(self.dir, "xdg"), "HOME": self.dir}
        self.default_path = os.path.join(self.dir, "xdg", "launch", "default_config.yaml")
        self.sessions = []

    def tearDown(self):
        for s in self.sessions:
            s.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def start(self, *args, shell_wrap=None):
        argv = [*self.config, *args]
        if shell_wrap:
            argv = ["/bin/sh", "-c", shell_wrap, "sh", *argv]
        s = PtySession(argv, env=self.env, cwd=self.dir)
        # Wide enough that no prompt wraps: libedit marks a wrap with " \r", which would split
        # the text the tests look for. libedit reads the size at the first text answer.
        fcntl.ioctl(s.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 250, 0, 0))
        self.sessions.append(s)
        return s

    def cpus_and_defaults(self, s):
        """Answers the device question with CPUs, then Enter up to and including the trainer."""
        s.expect("Which devices")
        s.send("1" + ENTER)
        for prompt in ("processes per machine?", "Mixed precision?", "restart after a failure?",
                       "built-in trainer"):
            s.expect(prompt)
            s.send(ENTER)

    def print_config(self, path):
        """The file as `launch --print_config` sees it, when the launch binary is built."""
        if not os.path.exists(harness.LAUNCH):
            return None
        r = harness.launch("--print_config", "--config_file", path, env=self.env)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return r.stdout

    def test_cluster_walkthrough_with_reasks_writes_loadable_yaml(self):
        path = os.path.join(self.dir, "cluster.yaml")
        s = self.start("--config_file", path)
        s.expect("Where will the job run?")
        s.expect("> 1) on this machine only")
        s.send("3")  # number key jumps to entry 3 ...
        s.expect("> 3) on a SLURM cluster")
        s.send(UP)  # ... and the arrow keys move from there
        s.expect("> 2) on several machines")
        s.send(ENTER)
        s.expect("How many machines? [2]:")
        s.send("x" + ENTER)
        s.expect("'x' is not a whole number")
        s.expect("How many machines? [2]:")  # asked again
        s.send("3" + ENTER)
        s.expect("rank of this machine? (0 is the main machine) [0]:")
        s.send("5" + ENTER)
        s.expect("expected a number from 0 to 2, got 5")
        s.send(UP + "\x7f1" + ENTER)  # Up recalls the rejected "5" (history); it is edited to 1
        s.expect("main machine, rank 0?:")
        s.send(ENTER)  # no default: an answer is required
        s.expect("the address of the main machine is needed")
        s.send("127.0.0.1" + ENTER)  # loopback in a 3-machine job: warned, then asked again
        s.expect("127.0.0.1 is a loopback address: the other machines cannot reach it")
        s.expect("Keep it anyway?")
        s.send(ENTER)
        s.expect("main machine, rank 0?:")
        s.send("10.0.0.77\x7f" + ENTER)  # backspace edits the answer
        s.expect("port should the rendezvous use on the main machine? [29500]:")
        s.send(ENTER)
        s.expect("shared secret")
        s.send("tok1234\x7f" + ENTER)  # not shown; Backspace still edits
        s.expect("Which devices should the workers use?")
        s.send("1" + ENTER)  # CPUs whatever this machine has
        s.expect("How many processes per machine?")
        s.send("0" + ENTER)
        s.expect("expected a number from 1 to 4096 or 'auto', got '0'")
        s.send("2" + ENTER)
        s.expect("Mixed precision?")
        s.send(DOWN + ENTER)
        s.expect("Mixed precision? bf16")
        s.expect("restart after a failure? [0]:")
        s.send("1" + ENTER)
        s.expect("built-in trainer (model, data, parallel mode)? [yes/NO]:")
        s.send("maybe" + ENTER)
        s.expect("please answer yes or no")
        s.send("y" + ENTER)
        s.expect("Which model?")
        s.send(ENTER)
        s.expect("Which training data?")
        s.send(ENTER)
        s.expect("Which parallel mode?")
        s.send(ENTER)
        s.expect("micro-batches per optimizer step? [1]:")
        s.send("2" + ENTER)
        s.expect("Batch size per process? [32]:")
        s.send(ENTER)
        s.expect("How many optimizer steps? [300]:")
        s.send("40" + ENTER)
        s.expect("Directory for metrics and checkpoints? [runs/launch]:")
        # Tab completes the folder's name; then Left inserts before the last letter, Home and End
        # jump to either end of the line.
        os.mkdir(os.path.join(self.dir, "checkpoints_here"))
        s.send("chec" + TAB)  # libedit redraws with cursor moves: the file shows the result
        s.send("abd" + LEFT + "c" + HOME + "./" + END + "e" + ENTER)
        s.expect("Wrote " + path)
        s.expect("--machine_rank R")
        self.assertEqual(s.wait(), 0, s.text())
        self.assertNotIn("tok12", s.text())  # the secret never reached the screen

        with open(path) as f:
            text = f.read()
        self.assertTrue(text.startswith("# "), text)
        self.assertIn("# total over all machines", text)
        doc = yaml.safe_load(text)
        self.assertEqual(doc["distributed_type"], "MULTI_CPU")
        self.assertEqual(doc["num_machines"], 3)
        self.assertEqual(doc["machine_rank"], 1)
        self.assertEqual(doc["main_process_ip"], "10.0.0.7")
        self.assertEqual(doc["main_process_port"], 29500)
        self.assertEqual(doc["num_processes"], 6)  # accelerate's total: 2 x 3 machines
        self.assertEqual(doc["mixed_precision"], "bf16")
        self.assertEqual(doc["max_restarts"], 1)
        self.assertEqual(doc["rdzv_token"], "tok123")
        self.assertEqual(doc["train"]["gradient_accumulation_steps"], 2)
        self.assertEqual(doc["train"]["max_steps"], 40)
        self.assertEqual(doc["train"]["output_dir"], "./checkpoints_here/abcde")
        self.assertEqual(doc["train"]["parallel"]["mode"], "ddp")
        # A file holding the rendezvous secret is private.
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
        self.assertEqual(sorted(os.listdir(self.dir)), ["checkpoints_here", "cluster.yaml"])

        # The file as launch's loader sees it (`launch env` loads and validates it; --print_config
        # would also start planning a 3-machine job).
        env_cmd = cli_command("env")
        r = harness.run([*env_cmd, "--config_file", path], env=self.env)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("does not load", r.stdout)
        self.assertRegex(r.stdout, r"num_machines: 3\s+# " + path)
        self.assertRegex(r.stdout, r"main_process_ip: 10.0.0.7\s+# " + path)
        self.assertRegex(r.stdout, r"nproc_per_node: 2\s+# derived")

        # Running the wizard again offers the file's answers as defaults: Enter everywhere
        # (and yes to replacing it) writes the same settings.
        s = self.start("--config_file", path)
        s.expect("The defaults below are the answers in the existing " + path)
        prompts = ["Where will the job run?", "How many machines? [3]:",
                   "(0 is the main machine) [1]:", "rank 0? [10.0.0.7]:", "[29500]:",
                   "LAUNCH_RDZV_TOKEN) [Enter keeps the current one]:", "Which devices",
                   "processes per machine?",
                   "Mixed precision?", "after a failure? [1]:", "parallel mode)? [YES/no]:",
                   "Which model?", "Which training data?", "Which parallel mode?",
                   "per optimizer step? [2]:", "Batch size per process? [32]:",
                   "optimizer steps? [40]:", "checkpoints? [./checkpoints_here/abcde]:"]
        for prompt in prompts:
            s.expect(prompt)
            s.send(ENTER)
        s.expect("drops any keys the wizard does not ask about")
        s.expect("exists. Overwrite it? [yes/NO]:")
        s.send("y" + ENTER)
        s.expect("Wrote " + path)
        self.assertEqual(s.wait(), 0, s.text())
        with open(path) as f:
            self.assertEqual(yaml.safe_load(f), doc)
        self.assertNotIn("tok123", s.text())  # the current secret is kept, not shown

    def test_loopback_main_address_can_be_kept_explicitly(self):
        # Several launches on one host (a rehearsal of a 2-machine job) need 127.0.0.1 or
        # localhost; the wizard warns, and keeps it when told to.
        path = os.path.join(self.dir, "two.yaml")
        s = self.start("--config_file", path)
        s.expect("Where will the job run?")
        s.send("2" + ENTER)
        s.expect("How many machines? [2]:")
        s.send(ENTER)
        s.expect("(0 is the main machine) [0]:")
        s.send(ENTER)
        s.expect("main machine, rank 0?:")
        s.send("localhost" + ENTER)
        s.expect("localhost is a loopback address: the other machines cannot reach it")
        s.expect("Keep it anyway? (only for trying the job with several launches on this one "
                 "machine) [yes/NO]:")
        s.send("y" + ENTER)
        s.expect("[29500]:")
        s.send(ENTER)
        s.expect("shared secret")
        s.send(ENTER)
        self.cpus_and_defaults(s)
        s.expect("Wrote " + path)
        s.expect("launch --config_file " + path + " train.py")
        s.expect("launch --config_file " + path + " --machine_rank R train.py")
        self.assertEqual(s.wait(), 0, s.text())
        with open(path) as f:
            doc = yaml.safe_load(f)
        self.assertEqual(doc["main_process_ip"], "localhost")
        self.assertEqual(doc["num_machines"], 2)

    def answer(self, s, *steps):
        """For each (prompt, keys): waits for the prompt, then types the keys."""
        for prompt, keys in steps:
            s.expect(prompt)
            s.send(keys)

    def test_trainer_zero_stage_is_offered_and_loads(self):
        path = os.path.join(self.dir, "zero.yaml")
        s = self.start("--config_file", path)
        self.answer(s, ("Where will the job run?", ENTER), ("Which devices", "1" + ENTER),
                    ("processes per machine?", ENTER), ("Mixed precision?", ENTER),
                    ("restart after a failure?", ENTER), ("built-in trainer", "y" + ENTER),
                    ("Which model?", ENTER), ("Which training data?", ENTER),
                    ("local SGD: no gradient all-reduce", "2" + ENTER),  # zero
                    ("What should zero shard?", "2" + ENTER),
                    ("per optimizer step? [1]:", ENTER), ("Batch size", ENTER),
                    ("optimizer steps?", ENTER), ("checkpoints?", ENTER))
        s.expect("Wrote " + path)
        self.assertEqual(s.wait(), 0, s.text())
        with open(path) as f:
            doc = yaml.safe_load(f)
        self.assertEqual(doc["train"]["parallel"]["mode"], "zero")
        self.assertEqual(doc["train"]["parallel"]["zero_stage"], 2)
        shown = self.print_config(path)
        if shown is not None:
            self.assertRegex(shown, r"train.parallel.mode: zero\s+# " + path)
            self.assertRegex(shown, r"train.parallel.zero_stage: 2\s+# " + path)

    def test_trainer_tensor_degree_is_offered_for_the_transformer_and_loads(self):
        path = os.path.join(self.dir, "tensor.yaml")
        s = self.start("--config_file", path)
        self.answer(s, ("Where will the job run?", ENTER), ("Which devices", "1" + ENTER),
                    ("processes per machine?", "4" + ENTER), ("Mixed precision?", ENTER),
                    ("restart after a failure?", ENTER), ("built-in trainer", "y" + ENTER),
                    ("Which model?", "3" + ENTER),  # transformer
                    ("Path of the text corpus?", "/usr/share/common-licenses/GPL-3" + ENTER),
                    ("local SGD: no gradient all-reduce", "6" + ENTER),  # pipeline
                    ("How many pipeline stages?", ENTER), ("micro-batches per step?", ENTER),
                    ("tensor parallelism", "2" + ENTER),  # over 2 processes
                    ("per optimizer step? [1]:", ENTER), ("Batch size", ENTER),
                    ("optimizer steps?", ENTER), ("checkpoints?", ENTER))
        s.expect("Wrote " + path)
        self.assertEqual(s.wait(), 0, s.text())
        with open(path) as f:
            doc = yaml.safe_load(f)
        self.assertEqual(doc["train"]["parallel"]["tensor"], 2)
        self.assertEqual(doc["train"]["parallel"]["stages"], 2)
        shown = self.print_config(path)
        if shown is not None:
            self.assertRegex(shown, r"train.parallel.tensor: 2\s+# " + path)

    def test_script_sharding_is_offered_for_gpu_jobs_without_the_trainer(self):
        path = os.path.join(self.dir, "fsdp.yaml")
        s = self.start("--config_file", path)
        self.answer(s, ("Where will the job run?", ENTER),
                    ("Which devices", "2" + ENTER),  # GPUs, whether or not this machine has one
                    ("processes per machine?", ENTER), ("Which GPUs", ENTER),
                    ("Mixed precision?", ENTER), ("restart after a failure?", ENTER),
                    ("built-in trainer", ENTER),
                    ("Should your script's Accelerator shard the model?", "2" + ENTER),
                    ("Which FSDP sharding strategy?", "2" + ENTER))
        s.expect("Wrote " + path)
        self.assertEqual(s.wait(), 0, s.text())
        with open(path) as f:
            doc = yaml.safe_load(f)
        self.assertEqual(doc["distributed_type"], "FSDP")
        self.assertEqual(doc["fsdp_config"]["fsdp_sharding_strategy"], "SHARD_GRAD_OP")
        shown = self.print_config(path)
        if shown is not None:
            self.assertRegex(shown, r"distributed_type: FSDP\s+# " + path)

    def test_ctrl_c_writes_nothing_and_restores_the_terminal(self):
        # The shell ignores SIGINT so that it survives to report; the wizard installs its own
        # handler. `stty -a` afterwards shows the terminal mode the wizard left behind.
        s = self.start(shell_wrap='trap "" INT; "$@"; echo "rc=$?"; stty -a')
        s.expect("Where will the job run?")
        s.send(ENTER)
        s.expect("Which devices should the workers use?")
        s.send(DOWN)
        s.expect("> 2) NVIDIA GPUs")  # the key was read in raw mode before Ctrl-C arrives
        self.assert_ctrl_c_writes_nothing_and_restores_the_terminal(s)

    def test_ctrl_c_while_editing_a_text_answer(self):
        s = self.start(shell_wrap='trap "" INT; "$@"; echo "rc=$?"; stty -a')
        s.expect("Where will the job run?")
        s.send(ENTER)
        s.expect("Which devices should the workers use?")
        s.send("1" + ENTER)
        s.expect("How many processes per machine?")
        s.send("12" + LEFT)  # libedit has the line
        self.assert_ctrl_c_writes_nothing_and_restores_the_terminal(s)

    def assert_ctrl_c_writes_nothing_and_restores_the_terminal(self, s):
        s.send(CTRL_C)
        s.expect("Interrupted; nothing was written.")
        s.expect("rc=130")
        self.assertEqual(s.wait(), 0)
        out = s.text()
        flags = out[out.find("rc=130"):].split()
        self.assertIn("speed", flags)
        self.assertIn("icanon", flags)
        self.assertIn("echo", flags)
        self.assertNotIn("-icanon", flags)
        self.assertFalse(os.path.exists(os.path.dirname(self.default_path)) and
                         os.listdir(os.path.dirname(self.default_path)),
                         "Ctrl-C left files behind")
        self.assertFalse(os.path.exists(self.default_path))

    def test_sigterm_writes_nothing(self):
        s = self.start()
        s.expect("Where will the job run?")
        s.send(ENTER)
        s.expect("Which devices")
        os.kill(s.pid, 15)
        s.expect("nothing was written")
        self.assertEqual(s.wait(), 130)
        self.assertFalse(os.path.exists(self.default_path))

    def test_existing_file_is_kept_unless_confirmed(self):
        r = harness.run([*self.config, "default"], env=self.env)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(self.default_path) as f:
            before = f.read()
        s = self.start()
        s.expect("Where will the job run?")
        s.send(ENTER)
        self.cpus_and_defaults(s)
        s.expect(self.default_path + " exists. Overwrite it? [yes/NO]:")
        s.send(ENTER)
        s.expect("Nothing was written")
        self.assertEqual(s.wait(), 1)
        with open(self.default_path) as f:
            self.assertEqual(f.read(), before)

    def test_defaults_on_this_machine_go_to_the_default_path(self):
        s = self.start()
        s.expect("Where will the job run?")
        s.send(ENTER)
        self.cpus_and_defaults(s)
        s.expect("Wrote " + self.default_path)
        s.expect("Next:")
        s.expect("  launch train.py\r\n")  # the script form: python3 -u, as torchrun runs it
        self.assertEqual(s.wait(), 0)
        with open(self.default_path) as f:
            doc = yaml.safe_load(f)
        self.assertEqual(doc["num_machines"], 1)
        self.assertEqual(doc["nproc_per_node"], "auto")
        self.assertEqual(doc["mixed_precision"], "no")
        self.assertNotIn("train", doc)
        self.assertEqual(stat.S_IMODE(os.stat(self.default_path).st_mode), 0o644)
        if self.print_config(self.default_path) is None:
            return
        # With no config given, `launch` uses the default file (the lead's part): only checked
        # when this launch says which file it used.
        r = harness.launch("--print_config", env=self.env)
        if self.default_path in r.stdout + r.stderr:
            self.assertIn("num_machines: 1", r.stdout)

    def test_without_a_terminal_points_to_config_default(self):
        r = subprocess.run([*self.config], capture_output=True, text=True, timeout=30,
                           stdin=subprocess.DEVNULL, env={**os.environ, **self.env})
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("needs a terminal", r.stderr)
        self.assertIn("launch config default", r.stderr)
        self.assertIn("docs/launcher.md#the-yaml", r.stderr)  # where the keys are documented
        self.assertFalse(os.path.exists(self.default_path))

    def test_config_default_never_overwrites_silently(self):
        env = {**os.environ, **self.env}
        run = lambda *a: subprocess.run([*self.config, *a], capture_output=True, text=True,
                                        timeout=30, stdin=subprocess.DEVNULL, env=env)
        r = run("default")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("Wrote " + self.default_path, r.stdout)
        with open(self.default_path) as f:
            first = f.read()
        self.assertIn("distributed_type:", first)
        with open(self.default_path, "a") as f:
            f.write("# my edit\n")
        r = run("default")
        self.assertEqual(r.returncode, 1)
        self.assertIn("already exists", r.stderr)
        with open(self.default_path) as f:
            self.assertTrue(f.read().endswith("# my edit\n"))
        r = run("default", "--force")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("Overwrote", r.stdout)
        with open(self.default_path) as f:
            self.assertEqual(f.read(), first)
        other = os.path.join(self.dir, "sub", "dir", "c.yaml")
        r = run("default", "--config_file", other)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(os.path.exists(other))
        r = run("--bogus")
        self.assertEqual(r.returncode, 2)
        self.assertIn("unknown argument '--bogus'", r.stderr)


if __name__ == "__main__":
    unittest.main()
