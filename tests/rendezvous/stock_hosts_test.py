"""Two stock hosts (tests/hosts.py: own network, hostname and pid namespace each, one bridge),
2 workers each, one `launch` per host, no GLOO_SOCKET_IFNAME: the job must just work.

Stock hosts are where PyTorch's Gloo goes wrong: it binds the address the host's own name
resolves to, and that is nothing (names unknown to the resolver) or 127.0.1.1 (Debian's
/etc/hosts), so peers on the other host are told to connect to loopback and are refused.

  * `train` (DDP over Gloo across the hosts) binds the route to MASTER_ADDR and finishes with
    exit 0 on both hosts, its ranks' parameters identical across the hosts, for both kinds of
    host name; its log names the address and interface.
  * A Python worker (torch.distributed's Gloo all-reduce) gets GLOO_SOCKET_IFNAME and
    NCCL_SOCKET_IFNAME from the agent, which says so once per host.
  * A user's GLOO_SOCKET_IFNAME wins: for Python workers the agent leaves it alone; for `train`
    a name the host lacks fails at once naming it, and `lo` (loopback on every host, the
    original failure) fails naming the refused address and the interface, never blaming a
    timeout that did not happen."""

import os
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "trainer"))
import harness  # noqa: E402
from hosts import make_hosts  # noqa: E402
from trainer_helpers import final, write_config  # noqa: E402

JOB = """
train:
  seed: 7
  output_dir: {out}
  model: {{type: mlp, layers: [16, 32, 4]}}
  data: {{type: synthetic, samples: 512}}
  batch_size: 16
  max_steps: 20
  optimizer: {{type: adamw, lr: 2.0e-3}}
  parallel: {{mode: ddp}}
  log_every: 10
"""
INIT_TIMEOUT_S = 30
# A job that must fail waits out its group's deadline: a short one (bounded, not timed).
FAILING_INIT_TIMEOUT_S = 8
WORKER = os.path.join(os.path.dirname(__file__), "gloo_worker.py")


def param_bytes(out, rank):
    with open(os.path.join(out, f"params_rank{rank}.bin"), "rb") as f:
        return f.read()


@unittest.skipUnless(os.path.exists(harness.TRAIN) and os.path.exists(harness.LAUNCH),
                     harness.needs_setup("train/launch not built"))
class StockHostsTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()

    def run_job(self, hosts, name, program, env_per_host=(None, None), timeout=120,
                init_timeout=INIT_TIMEOUT_S):
        """`launch` with `program` (its arguments after the flags) on both hosts, node 0
        hosting the rendezvous; returns (exit codes, [log of host 0, log of host 1], seconds)."""
        port = harness.free_port()
        procs = []
        started = time.monotonic()
        for rank, host in enumerate(hosts):
            env = {k: v for k, v in os.environ.items()
                   if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
            env.update(OMP_NUM_THREADS="1", LAUNCH_RDZV_TOKEN="stock-hosts-test",
                       LAUNCH_INIT_TIMEOUT_S=str(init_timeout))
            env.update(env_per_host[rank] or {})
            log = open(os.path.join(self.tmp, f"{name}-host{rank}.log"), "w")
            self.addCleanup(log.close)
            argv = [harness.LAUNCH, "--nnodes", "2", "--node_rank", str(rank),
                    "--nproc_per_node", "2", "--master_addr", hosts[0].addr,
                    "--master_port", str(port), "--rdzv_conf", "join_timeout=60", *program]
            procs.append(host.popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env))
        codes = harness.wait_codes(procs, timeout)
        seconds = time.monotonic() - started
        logs = []
        for rank in range(2):
            with open(os.path.join(self.tmp, f"{name}-host{rank}.log")) as f:
                logs.append(f.read())
        return codes, logs, seconds

    def train_config(self, name):
        out = os.path.join(self.tmp, name)
        return out, write_config(self.tmp, JOB.format(out=out), f"{name}.yaml")

    def check_train_across_hosts(self, hosts, name):
        out, cfg = self.train_config(name)
        codes, logs, _ = self.run_job(hosts, name, [cfg, "--", "--dump_params"])
        both = "\n--- host 1\n".join(logs)
        self.assertEqual(codes, [0, 0], both)
        # Gradients crossed the link: the ranks of both hosts end with the same parameters.
        reference = param_bytes(out, 0)
        self.assertGreater(len(reference), 0)
        for rank in (1, 2, 3):
            self.assertEqual(param_bytes(out, rank), reference, f"rank {rank} differs\n{both}")
        self.assertEqual(final(out)["steps_this_run"], 20, both)
        # Rank 0's log line names where its Gloo bound: host 0's bridge address, on eth0.
        self.assertIn(f"this rank on {hosts[0].addr} on eth0, the route to MASTER_ADDR "
                      f"{hosts[0].addr}", logs[0])
        # The trainer picks its address itself: the agent exports nothing to it.
        self.assertNotIn("workers get", both)
        self.assertNotIn("did not form", both)

    def test_train_where_host_names_resolve_to_nothing(self):
        hosts = make_hosts(self, 2)
        for h in hosts:  # the premise: the resolver knows neither name
            r = h.run(["getent", "hosts", h.name])
            self.assertNotEqual(r.returncode, 0, r.stdout)
        self.check_train_across_hosts(hosts, "nothing")

    def test_train_where_host_names_resolve_to_loopback_as_on_debian(self):
        hosts = make_hosts(self, 2, etc_hosts="debian")
        for h in hosts:
            r = h.run(["getent", "hosts", h.name])
            self.assertIn("127.0.1.1", r.stdout)
        self.check_train_across_hosts(hosts, "debian")

    def run_python(self, hosts, name, env_per_host=(None, None)):
        codes, logs, _ = self.run_job(hosts, name, ["--", harness.SYSTEM_PYTHON, WORKER],
                                      env_per_host)
        both = "\n--- host 1\n".join(logs)
        self.assertEqual(codes, [0, 0], both)
        # 1 + 2 + 3 + 4: every rank's contribution, across both hosts.
        self.assertEqual(both.count("SUM 10 "), 4, both)
        return logs, both

    def test_python_workers_get_the_interface_and_the_log_says_why_once(self):
        hosts = make_hosts(self, 2, etc_hosts="debian")
        logs, both = self.run_python(hosts, "python")
        for rank, host in enumerate(hosts):
            line = (f"workers get GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0: this host's "
                    f"name {host.name} resolves to 127.0.1.1 (loopback)")
            self.assertEqual(logs[rank].count(line), 1, logs[rank])
            self.assertIn(f"eth0 ({host.addr}) is the route to MASTER_ADDR {hosts[0].addr}",
                          logs[rank])
        self.assertEqual(both.count("ifname gloo=eth0 nccl=eth0"), 4, both)

    def test_python_workers_keep_the_users_gloo_socket_ifname(self):
        hosts = make_hosts(self, 2)
        # Host 1's user chose the interface (rightly); only NCCL's is added there.
        logs, both = self.run_python(hosts, "python-user",
                                     (None, {"GLOO_SOCKET_IFNAME": "eth0"}))
        self.assertIn("workers get GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0:", logs[0])
        self.assertIn("workers get NCCL_SOCKET_IFNAME=eth0:", logs[1])
        self.assertNotIn("workers get GLOO_SOCKET_IFNAME", logs[1])
        self.assertEqual(both.count("ifname gloo=eth0 nccl=eth0"), 4, both)

    def test_train_with_a_gloo_socket_ifname_the_host_lacks_fails_naming_it(self):
        hosts = make_hosts(self, 2)
        _, cfg = self.train_config("noif")
        codes, logs, _ = self.run_job(hosts, "noif", [cfg],
                                      (None, {"GLOO_SOCKET_IFNAME": "nosuch0"}),
                                      init_timeout=FAILING_INIT_TIMEOUT_S)
        both = "\n--- host 1\n".join(logs)
        self.assertNotIn(0, codes, both)
        self.assertIn(f"GLOO_SOCKET_IFNAME=nosuch0 names no interface of this host "
                      f"({hosts[1].name} has: lo, eth0); unset it to use eth0, the route to "
                      f"MASTER_ADDR {hosts[0].addr}", both)

    def test_train_with_gloo_socket_ifname_lo_names_the_refused_address(self):
        # The original failure, on purpose: every rank listens on loopback, so a rank connecting
        # to a peer on the other host reaches its own host's loopback, and nothing is there.
        hosts = make_hosts(self, 2)
        _, cfg = self.train_config("lo")
        lo = {"GLOO_SOCKET_IFNAME": "lo"}
        codes, logs, seconds = self.run_job(hosts, "lo", [cfg], (lo, lo),
                                            init_timeout=FAILING_INIT_TIMEOUT_S)
        both = "\n--- host 1\n".join(logs)
        self.assertNotIn(0, codes, both)
        self.assertIn("this rank on interface lo (127.0.0.1) from GLOO_SOCKET_IFNAME", both)
        if "connect [" in both:  # LibTorch 1.13's Gloo names the refused peer; 2.6's does not
            self.assertIn("[127.0.0.1]", both)
        self.assertIn("GLOO_SOCKET_IFNAME=lo is loopback, out of the other hosts' reach", both)
        if "did not form within" in both:
            # Only a Gloo that retries refused connections until its deadline says so, and then
            # the deadline must really have passed.
            self.assertGreaterEqual(seconds, FAILING_INIT_TIMEOUT_S * 0.9, both)
        else:
            self.assertIn("failed after", both)
            self.assertIn(f"(of its {FAILING_INIT_TIMEOUT_S} s timeout)", both)


if __name__ == "__main__":
    unittest.main()
