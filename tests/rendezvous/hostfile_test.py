"""`launch --hostfile` across test hosts (tests/hosts.py): each host runs its own sshd (Debian's
openssh-server, on port 22 of its own network namespace, with a host key and an authorized key
made for the test), and the head, in host 0, starts every node over real ssh.

  * A 2-host DDP `train` job (2 slots each) ends 0; every rank's output reaches the head,
    prefixed with its host and rank; the environment allowlist (./.launch_env) reaches host 1's
    workers.
  * The rendezvous token is on no command line of any host while the job runs.
  * A host without sshd is named at once with ssh's error, and the job stops everywhere.
  * SIGINT to the head stops every host: no process of the job is left on any.
  * A worker failing on host 1 ends the job on every host, with its exit code and rank named.
  * Bad host files and host lists are refused with file:line (or the entry) before anything
    starts."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import harness  # noqa: E402
import hosts as test_hosts  # noqa: E402

SSHD = "/usr/sbin/sshd"
JOB = """
train:
  seed: 7
  output_dir: {out}
  model: {{type: mlp, layers: [16, 32, 4]}}
  data: {{type: synthetic, samples: 2000}}
  batch_size: 16
  max_steps: 30
  optimizer: {{type: adamw, lr: 2.0e-3}}
  parallel: {{mode: ddp}}
  log_every: 10
"""
# Each worker says who it is, then waits for the test's go file (or for being stopped), so the
# test looks at every host while the whole job runs. Rank 3 (on host 1) may be told to fail.
# A forwarded SIGUSR1 reaches it as a line (sh runs the trap after its current sleep).
WORKER = ('trap \'echo "worker $RANK got USR1"\' USR1; '
          'echo "worker $RANK on $(hostname) mark=$JOB_MARK"; '
          'if [ "$RANK" = "$FAIL_RANK" ]; then echo "rank $RANK fails" >&2; exit 7; fi; '
          'while [ ! -e "$GO_FILE" ]; do sleep 0.05; done; echo "worker $RANK done"')


def _can_run_sshd():
    return os.path.exists(SSHD) and shutil.which("ssh") and shutil.which("ssh-keygen")


@unittest.skipUnless(os.path.exists(harness.LAUNCH), harness.needs_setup("launch not built"))
@unittest.skipUnless(_can_run_sshd(),
                     harness.needs_setup("openssh-server / openssh-client not installed"))
class HostfileTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.keys = tempfile.mkdtemp(prefix="launch-test-ssh-")
        for name in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                            os.path.join(cls.keys, name)], check=True, timeout=30)
        shutil.copy(os.path.join(cls.keys, "client_key.pub"),
                    os.path.join(cls.keys, "authorized_keys"))
        with open(os.path.join(cls.keys, "sshd_config"), "w") as f:
            f.write(f"""Port 22
HostKey {cls.keys}/host_key
AuthorizedKeysFile {cls.keys}/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile none
""")
        # The test's own ssh client settings: the user's ~/.ssh is never read or written. ssh
        # takes its config from -F only (not from $HOME), so `ssh` on the head's PATH is a
        # wrapper that adds it.
        with open(os.path.join(cls.keys, "ssh_config"), "w") as f:
            f.write(f"""Host *
  User root
  IdentityFile {cls.keys}/client_key
  IdentitiesOnly yes
  UserKnownHostsFile /dev/null
  StrictHostKeyChecking no
  LogLevel ERROR
""")
        os.makedirs(os.path.join(cls.keys, "bin"))
        wrapper = os.path.join(cls.keys, "bin", "ssh")
        with open(wrapper, "w") as f:
            f.write(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {cls.keys}/ssh_config "$@"\n')
        os.chmod(wrapper, 0o755)
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.keys, ignore_errors=True)

    def make_hosts(self, n, sshd=None):
        """`n` test hosts, with sshd running on those whose index is in `sshd` (all: None)."""
        hosts = test_hosts.make_hosts(self, n)
        for i, host in enumerate(hosts):
            if sshd is not None and i not in sshd:
                continue
            p = host.popen([SSHD, "-D", "-e", "-f", f"{self.keys}/sshd_config"],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            # nsenter goes now; sshd, inside, with its host (the cleanup registered before).
            self.addCleanup(lambda p=p: (p.kill(), p.wait(10)))

            def listening(addr=host.addr):
                try:
                    socket.create_connection((addr, 22), timeout=1).close()
                    return True
                except OSError:
                    return False
            self.assertTrue(harness.wait_until(listening, 10), f"sshd on {host.name} did not start")
        return hosts

    def job_dir(self, env_lines=()):
        """A job folder, the head's working directory, with its ./.launch_env; "{dir}" in
        `env_lines` is the folder."""
        d = harness.tmpdir()
        self.addCleanup(shutil.rmtree, d, True)
        # The environment allowlist file (DeepSpeed's .deepspeed_env): a mark the workers print,
        # and the test's isolation from root's own launch/accelerate config files. No
        # GLOO_SOCKET_IFNAME: the workers find the interface themselves.
        with open(os.path.join(d, ".launch_env"), "w") as f:
            f.write("# read by the head, passed to every host\nJOB_MARK=from-env-file\n")
            f.write(f"XDG_CONFIG_HOME={os.environ['XDG_CONFIG_HOME']}\n")
            f.write(f"HF_HOME={os.environ['HF_HOME']}\n")
            for line in env_lines:
                f.write(line.format(dir=d) + "\n")
        return d

    def hostfile(self, d, hosts, slots=2):
        path = os.path.join(d, "hosts")
        with open(path, "w") as f:
            f.write("# the test hosts, by address\n")
            for h in hosts:
                f.write(f"{h.addr} slots={slots}\n")
        return path

    def head(self, host, d, args, token):
        env = dict(os.environ)
        env["PATH"] = f"{self.keys}/bin:{env['PATH']}"
        env["LAUNCH_RDZV_TOKEN"] = token
        p = host.popen([harness.LAUNCH, *args], cwd=d, env=env, stdin=subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.addCleanup(lambda: p.poll() is None and p.kill())
        return p

    def head_pid(self, p):
        """The head launch's pid as this namespace numbers it (nsenter forks it)."""
        kids = harness.wait_until(lambda: test_hosts._children(p.pid), 10)
        self.assertTrue(kids, "the head did not start")
        return kids[0]

    def job_processes(self, host):
        """What is left of a job on `host`: anything but its init, sshd's listener and ps."""
        r = host.run(["ps", "-eo", "pid=,args="])
        self.assertEqual(r.returncode, 0, r.stderr)
        left = []
        for line in r.stdout.splitlines():
            pid, _, args = line.strip().partition(" ")
            if (args.startswith(("sleep infinity", "ps -eo")) or pid == "1" or
                    (args.startswith(f"sshd: {SSHD} -D") and "[listener]" in args)):
                continue
            left.append(line.strip())
        return left

    def assert_nothing_left(self, hosts):
        for h in hosts:
            left = harness.wait_until(lambda: not self.job_processes(h), 15)
            self.assertTrue(left, f"left on {h.name}: {self.job_processes(h)}")

    def wait_lines(self, p, needles, out):
        """Reads the head's stdout into `out` until every needle has been seen."""
        while not all(n in "".join(out) for n in needles):
            line = p.stdout.readline()
            if not line:
                break
            out.append(line)
        return all(n in "".join(out) for n in needles)

    def test_two_host_ddp_job(self):
        hosts = self.make_hosts(2)
        d = self.job_dir()
        out_dir = os.path.join(d, "out")
        with open(os.path.join(d, "job.yaml"), "w") as f:
            f.write(JOB.format(out=out_dir))
        p = self.head(hosts[0], d, ["--hostfile", self.hostfile(d, hosts), "job.yaml"],
                      harness.unique_marker("tok"))
        out, err = p.communicate(timeout=300)
        self.assertEqual(p.returncode, 0, out + err)
        with open(os.path.join(out_dir, "final.json")) as f:
            self.assertIn("world_size", f.read())
        self.assert_nothing_left(hosts)

    def start_waiting_job(self, hosts, fail_rank=-1):
        """A job of waiting workers (WORKER) on `hosts`; returns the head, its job folder and
        the head's stdout lines read until every worker said who it is."""
        d = self.job_dir(["GO_FILE={dir}/go", f"FAIL_RANK={fail_rank}"])
        token = harness.unique_marker("secret")
        p = self.head(hosts[0], d, ["--hostfile", self.hostfile(d, hosts), "--",
                                    "/bin/sh", "-c", WORKER], token)
        return p, d, token

    def test_every_rank_reaches_the_head_and_the_token_no_command_line(self):
        hosts = self.make_hosts(2)
        p, d, token = self.start_waiting_job(hosts)
        # Each rank's line, prefixed with its host (by the head) and its rank (by that host's
        # launch); mark=from-env-file came from the head's ./.launch_env.
        needles = [f"{h.addr}: [rank {r}]: worker {r} on {h.name} mark=from-env-file"
                   for h, ranks in ((hosts[0], (0, 1)), (hosts[1], (2, 3))) for r in ranks]
        out = []
        self.assertTrue(self.wait_lines(p, needles, out), "".join(out))
        # The whole job runs now: ssh on the head, sshd's sessions, every launch and worker.
        for h in hosts:
            r = h.run(["sh", "-c", "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; "
                       "echo; done"])
            self.assertIn("--head_stdin", r.stdout)
            self.assertNotIn(token, r.stdout, f"the token is on a command line on {h.name}")
        open(os.path.join(d, "go"), "w").close()
        rest, err = p.communicate(timeout=60)
        self.assertEqual(p.returncode, 0, "".join(out) + rest + err)
        for r in range(4):
            self.assertIn(f"[rank {r}]: worker {r} done", rest)
        self.assert_nothing_left(hosts)

    def test_sigint_on_the_head_stops_every_host(self):
        hosts = self.make_hosts(2)
        p, d, _ = self.start_waiting_job(hosts)
        out = []
        self.assertTrue(self.wait_lines(p, [f"worker {r} on" for r in range(4)], out),
                        "".join(out))
        os.kill(self.head_pid(p), signal.SIGINT)
        rest, err = p.communicate(timeout=60)
        self.assertEqual(p.returncode, 128 + signal.SIGINT, "".join(out) + rest + err)
        self.assertIn("stopping every host: SIGINT", err)
        self.assertNotIn("done", rest)
        self.assert_nothing_left(hosts)

    def test_usr1_and_urg_on_the_head_reach_every_host(self):
        hosts = self.make_hosts(2)
        p, d, _ = self.start_waiting_job(hosts)
        out = []
        self.assertTrue(self.wait_lines(p, [f"worker {r} on" for r in range(4)], out),
                        "".join(out))
        head = self.head_pid(p)
        # SIGUSR1 (a scheduler's warning before preemption): every worker on every host gets it,
        # and the job goes on.
        os.kill(head, signal.SIGUSR1)
        self.assertTrue(self.wait_lines(
            p, [f"{h.addr}: [rank {r}]: worker {r} got USR1"
                for h, ranks in ((hosts[0], (0, 1)), (hosts[1], (2, 3))) for r in ranks], out),
            "".join(out))
        # SIGURG: every host's launch prints its collective report (these shell workers keep no
        # collective ring, which the report says).
        os.kill(head, signal.SIGURG)
        open(os.path.join(d, "go"), "w").close()
        rest, err = p.communicate(timeout=60)
        self.assertEqual(p.returncode, 0, "".join(out) + rest + err)
        self.assertIn("forwarding SIGUSR1 to every host", err)
        self.assertIn("forwarding SIGURG to every host", err)
        for h in hosts:
            self.assertRegex(err, rf"{h.addr}: .*no rank of this node has a collective ring")
        for r in range(4):
            self.assertIn(f"[rank {r}]: worker {r} done", rest)
        self.assert_nothing_left(hosts)

    def test_worker_failure_on_host_1_ends_the_job_everywhere(self):
        hosts = self.make_hosts(2)
        p, d, _ = self.start_waiting_job(hosts, fail_rank=3)
        out, err = p.communicate(timeout=120)
        self.assertEqual(p.returncode, 7, out + err)
        self.assertIn(f"{hosts[1].addr}: [rank 3]: rank 3 fails", err)
        # Both hosts' launches name the root cause, rank 3's exit 7, in a line each; the
        # failure report is printed once, by node 0, and the head points at it (not at whichever
        # host's ssh ended first).
        for h in hosts:
            lines = [l for l in err.splitlines() if l.startswith(f"{h.addr}: ") and "rank 3" in l
                     and "7" in l and "fails" not in l]
            self.assertTrue(lines, f"{h.addr} does not name rank 3's failure:\n{err}")
        reports = [l for l in err.splitlines() if "root cause: rank 3" in l]
        self.assertEqual(len(reports), 1, err)
        self.assertTrue(reports[0].startswith(f"{hosts[0].addr}: "), err)
        self.assertRegex(err.rstrip().splitlines()[-1],
                         r"\[launch\] error: the job failed \(exit 7\): node 0's failure report "
                         rf"above \({re.escape(hosts[0].addr)}: \.\.\.\) names the root cause")
        self.assert_nothing_left(hosts)

    def test_unreachable_host_is_named_and_the_job_stops(self):
        hosts = self.make_hosts(2, sshd={0})  # nothing listens on host 1's port 22
        p, d, _ = self.start_waiting_job(hosts)
        out, err = p.communicate(timeout=120)
        self.assertEqual(p.returncode, 1, out + err)
        self.assertIn(f"{hosts[1].addr} (node 1, {d}/hosts:3): launch could not be started "
                      f"there (ssh exited 255: ssh: connect to host {hosts[1].addr} port 22: "
                      "Connection refused)", err)
        self.assert_nothing_left(hosts)

    def test_bad_host_files_are_refused_with_file_and_line(self):
        d = harness.tmpdir()
        self.addCleanup(shutil.rmtree, d, True)
        cases = {
            "h1 slots=2\nh2 slots=two\n": "bad:2: slots must be an integer from 1 to 4096, got 'two'",
            "h1 slots=0\n": "bad:1: slots must be an integer from 1 to 4096, got '0'",
            "# hosts\nh1 slots=2\nh2 gpus=2\n": "bad:3: expected `HOST slots=N`, got 'h2 gpus=2'",
            "h1 slots=2\n\nh1 slots=4\n": "bad:3: host 'h1' is already listed at",
            "# nothing\n\n": "bad:2: no host in the file",
            "": "bad:1: no host in the file",
            "-oProxyCommand=x slots=1\n": "bad:1: '-oProxyCommand=x' is not a host name",
        }
        for text, message in cases.items():
            with open(os.path.join(d, "bad"), "w") as f:
                f.write(text)
            r = harness.launch("--hostfile", "bad", "--", "/bin/true", cwd=d)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn(f"--hostfile: {message}", r.stderr)
        for hosts, message in (("h1:2,h2:0", "entry 2 ('h2:0'): slots must be"),
                               ("h1:2,h1:2", "host 'h1' is already listed at entry 1"),
                               ("", "entry 1 (''): empty host name")):
            r = harness.launch("-H", hosts, "--", "/bin/true", cwd=d)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn(message, r.stderr)
        r = harness.launch("-H", "h1:2,h2:2", "--nproc_per_node", "2", "--", "/bin/true", cwd=d)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("nproc_per_node cannot be given with --hosts", r.stderr)


if __name__ == "__main__":
    unittest.main()
