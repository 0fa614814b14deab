"""Multi-node jobs with real `launch` agents on one machine: each agent stands in for a node at
its own loopback address (127.0.0.1, .2, .3, .4 via LAUNCH_RDZV_LOCAL_ADDR), all meeting at one
rendezvous endpoint. Workers are tests/rendezvous/worker.py (no torch needed)."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import harness  # noqa: E402
from tcp_proxy import TcpProxy  # noqa: E402
import netns  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


free_port = harness.free_port  # outside the ephemeral range (tests/harness.py)


class Node:
    """One `launch` agent; output (stdout+stderr) goes to a file to avoid pipe stalls."""

    def __init__(self, index, port, nnodes, nproc=2, rank=None, extra=(), worker_args=(),
                 env=None, marker=None, tmp=None, endpoint=None, program=None, prefix=(),
                 cwd=None, config=None):
        self.addr = f"127.0.0.{index + 1}"
        self.log_path = os.path.join(tmp, f"node{index}.log")
        where = (["--rdzv_endpoint", endpoint] if endpoint else
                 ["--main_process_ip", "127.0.0.1", "--main_process_port", str(port)])
        args = [*prefix, harness.LAUNCH, "--nnodes", str(nnodes), "--nproc_per_node", str(nproc),
                *where, *extra]
        if rank is not None:
            args += ["--node_rank", str(rank)]
        if config:  # the built-in trainer
            args.append(config)
        else:
            args += ["--", *(program or [harness.SYSTEM_PYTHON, WORKER, *worker_args])]
        full_env = dict(os.environ)
        if not endpoint:
            full_env["LAUNCH_RDZV_LOCAL_ADDR"] = self.addr
        if marker:
            full_env["LAUNCH_TEST_MARKER"] = marker
        full_env.update(env or {})
        self.log = open(self.log_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=full_env,
                                     cwd=cwd)

    def wait(self, timeout=30):
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"node {self.addr} did not finish in {timeout} s:\n" + self.output())
        self.log.flush()
        return rc

    def output(self):
        with open(self.log_path) as f:
            return f.read()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def env_lines(text):
    """Parsed 'ENV K=V ...' lines the workers printed."""
    out = []
    for line in text.splitlines():
        m = re.search(r"ENV (.*)$", line)
        if m:
            out.append(dict(kv.split("=", 1) for kv in m.group(1).split()))
    return out


class MultiNodeTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()
        self.port = free_port()
        self.marker = harness.unique_marker("rdzvtest")
        self.nodes = []

    def tearDown(self):
        for n in self.nodes:
            n.kill()
        # No worker of any node may outlive the test.
        left = harness.wait_until(lambda: not harness.pids_with_marker(self.marker), 10)
        for pid in harness.pids_with_marker(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.assertTrue(left, "workers left running after the test")

    def start(self, index, nnodes, **kw):
        n = Node(index, self.port, nnodes, marker=self.marker, tmp=self.tmp, **kw)
        self.nodes.append(n)
        return n

    def wait_all(self, nodes, timeout=30):
        return [n.wait(timeout) for n in nodes]

    def wait_for_text(self, node, pattern, timeout=15):
        ok = harness.wait_until(lambda: re.search(pattern, node.output()) is not None, timeout)
        self.assertTrue(ok, f"'{pattern}' not seen on {node.addr}:\n{node.output()}")

    def pid_of(self, rank, attempt, timeout=15):
        path = os.path.join(self.tmp, f"rank{rank}_try{attempt}.pid")
        self.assertTrue(harness.wait_until(lambda: os.path.exists(path), timeout), path)
        with open(path) as f:
            return int(f.read())

    def check_ranks(self, nodes, world):
        seen = []
        for n in nodes:
            seen += env_lines(n.output())
        ranks = sorted(int(e["RANK"]) for e in seen)
        self.assertEqual(ranks, list(range(world)), [n.output() for n in nodes])
        for e in seen:
            self.assertEqual(int(e["WORLD_SIZE"]), world)
        self.assertEqual(len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in seen}), 1)
        return seen

    # ---- membership -----------------------------------------------------------------------

    def test_two_nodes_two_workers_explicit_ranks(self):
        t0 = time.monotonic()
        a = self.start(0, 2, rank=0)
        b = self.start(1, 2, rank=1)
        self.assertEqual(self.wait_all([a, b]), [0, 0], a.output() + b.output())
        seen = self.check_ranks([a, b], 4)
        for e in seen:
            self.assertEqual(e["GROUP_WORLD_SIZE"], "2")
            self.assertEqual(e["MASTER_ADDR"], "127.0.0.1")  # node 0's address
            node = int(e["GROUP_RANK"])
            self.assertEqual(int(e["RANK"]), node * 2 + int(e["LOCAL_RANK"]))
        self.assertLess(time.monotonic() - t0, 10)

    def test_four_nodes_assigned_ranks(self):
        nodes = [self.start(i, 4) for i in range(4)]
        self.assertEqual(self.wait_all(nodes), [0] * 4, "".join(n.output() for n in nodes))
        seen = self.check_ranks(nodes, 8)
        self.assertEqual(sorted({e["GROUP_RANK"] for e in seen}), ["0", "1", "2", "3"])
        # MASTER_ADDR is the address node 0 connected from, whichever node that is.
        node0 = [e for e in seen if e["GROUP_RANK"] == "0"]
        master = node0[0]["MASTER_ADDR"]
        self.assertRegex(master, r"^127\.0\.0\.[1-4]$")

    def test_heterogeneous_workers_per_node(self):
        a = self.start(0, 2, rank=0, nproc=1)
        b = self.start(1, 2, rank=1, nproc=3)
        self.assertEqual(self.wait_all([a, b]), [0, 0])
        seen = self.check_ranks([a, b], 4)
        on_b = sorted(int(e["RANK"]) for e in seen if e["GROUP_RANK"] == "1")
        self.assertEqual(on_b, [1, 2, 3])
        self.assertTrue(all(e["LOCAL_WORLD_SIZE"] == "3" for e in seen if e["GROUP_RANK"] == "1"))

    def test_ipv6_endpoint_in_torchrun_spelling(self):
        try:
            with socket.socket(socket.AF_INET6) as probe:
                probe.bind(("::1", 0))
        except OSError:
            self.skipTest(harness.env_dependent("no IPv6 loopback"))
        endpoint = f"[::1]:{self.port}"
        a = self.start(0, 2, rank=0, endpoint=endpoint)
        b = self.start(1, 2, rank=1, endpoint=endpoint)
        self.assertEqual(self.wait_all([a, b]), [0, 0], a.output() + b.output())
        seen = self.check_ranks([a, b], 4)
        self.assertEqual(seen[0]["MASTER_ADDR"], "::1")

    # ---- fail fast ------------------------------------------------------------------------

    def test_duplicate_rank_refuses_only_the_newcomer_naming_both_hosts(self):
        a = self.start(0, 2, rank=0)
        self.wait_for_text(a, "first agent")
        b = self.start(1, 2, rank=0)
        self.assertEqual(b.wait(15), 2, b.output())
        out = b.output()
        self.assertIn("machine_rank 0", out)
        self.assertIn("127.0.0.1", out)
        self.assertIn("127.0.0.2", out)
        # The forming job was not harmed: the right node 1 completes it.
        c = self.start(2, 2, rank=1)
        self.assertEqual(self.wait_all([a, c]), [0, 0], a.output() + c.output())
        self.check_ranks([a, c], 4)

    def test_mismatched_run_id_is_refused_alone_naming_both_values(self):
        a = self.start(0, 2, rank=0, extra=["--run_id", "alpha"])
        self.wait_for_text(a, "first agent")
        b = self.start(1, 2, rank=1, extra=["--run_id", "beta"])
        self.assertEqual(b.wait(15), 2, b.output())
        self.assertIn("run_id", b.output())
        self.assertIn("'alpha'", b.output())
        self.assertIn("'beta'", b.output())
        c = self.start(2, 2, rank=1, extra=["--run_id", "alpha"])
        self.assertEqual(self.wait_all([a, c]), [0, 0], a.output() + c.output())

    def test_mismatched_heartbeat_timeout_is_a_config_error_at_join(self):
        a = self.start(0, 2, rank=0, extra=["--run_id", "t", "--rdzv_conf", "heartbeat_timeout=1"])
        self.wait_for_text(a, "first agent")
        b = self.start(1, 2, rank=1, extra=["--run_id", "t", "--rdzv_conf", "heartbeat_timeout=8"])
        self.assertEqual(b.wait(15), 2, b.output())
        self.assertIn("heartbeat_timeout", b.output())
        a.proc.send_signal(signal.SIGTERM)
        a.wait(15)

    def test_replacement_agent_takes_the_rank_of_a_frozen_one(self):
        # Node 1 freezes (SIGSTOP) while the job forms; a replacement with the same rank joins
        # after a heartbeat interval and the job completes with it.
        extra = ["--rdzv_conf", "heartbeat_timeout=2"]
        a = self.start(0, 3, rank=0, nproc=1, extra=extra)
        b = self.start(1, 3, rank=1, nproc=1, extra=extra)
        self.wait_for_text(a, "first agent")
        time.sleep(1.0)  # node 1 has joined (milliseconds) and sent heartbeats
        b.proc.send_signal(signal.SIGSTOP)
        self.addCleanup(lambda: b.proc.poll() is None and b.proc.send_signal(signal.SIGCONT))
        time.sleep(0.8)  # longer than one heartbeat interval (heartbeat_timeout / 4)
        c = self.start(2, 3, rank=1, nproc=1, extra=extra)
        # Node rank 2 joins only once the replacement has taken rank 1: had it joined first,
        # the round would have closed with the frozen node in it (a lost node, not a stale join).
        self.wait_for_text(a, " replaces ")
        d = self.start(3, 3, rank=2, nproc=1, extra=extra)
        self.assertEqual(self.wait_all([a, c, d], 30), [0, 0, 0],
                         a.output() + c.output() + d.output())
        self.check_ranks([a, c, d], 3)
        b.proc.send_signal(signal.SIGCONT)
        self.assertNotEqual(b.wait(15), 0, b.output())

    def test_second_job_on_the_same_endpoint_is_refused_naming_both_run_ids(self):
        # Two unrelated jobs, neither naming a run id, pointed at one endpoint: the second is
        # refused at once (exit 2, both derived ids named) and never runs; the first is untouched.
        wa = ["--pid-dir", self.tmp, "--sleep-try", "0:3"]
        a = self.start(0, 2, rank=0, nproc=1, worker_args=wa)
        b = self.start(1, 2, rank=1, nproc=1, worker_args=wa)
        self.pid_of(0, 0)
        self.pid_of(1, 0)
        other = self.start(2, 2, nproc=1, program=["sh", "-c", "echo JOB B WORKER RAN"])
        self.assertEqual(other.wait(15), 2, other.output())
        out = other.output()
        self.assertNotIn("JOB B WORKER RAN", out)
        ids = set(re.findall(r"job-[0-9a-f]{12}", out))
        self.assertEqual(len(ids), 2, out)
        self.assertEqual(self.wait_all([a, b]), [0, 0], a.output() + b.output())
        self.check_ranks([a, b], 2)
        run_ids = {e["TORCHELASTIC_RUN_ID"] for n in (a, b) for e in env_lines(n.output())}
        self.assertEqual(len(run_ids), 1)
        self.assertIn(run_ids.pop(), ids)

    def test_two_projects_written_alike_are_two_jobs(self):
        # `launch --nnodes 1:2 -- python3 train.py` in two project folders: the commands read
        # alike, the scripts differ. The second is refused at once (both ids named), never
        # merged into the first as a scale-up (which restarted both through every attempt).
        dirs = []
        for name in ("project_a", "project_b"):
            d = os.path.join(self.tmp, name)
            os.makedirs(d)
            with open(os.path.join(d, "train.py"), "w") as f:
                f.write("import time\nprint('%s ran', flush=True)\ntime.sleep(3)\n" % name)
            dirs.append(d)
        program = [harness.SYSTEM_PYTHON, "train.py"]
        extra = ["--rdzv_conf", "last_call_timeout=0.2"]
        a = self.start(0, "1:2", nproc=1, extra=extra, program=program, cwd=dirs[0])
        self.wait_for_text(a, r"project_a ran")
        b = self.start(1, "1:2", nproc=1, extra=extra, program=program, cwd=dirs[1])
        self.assertEqual(b.wait(15), 2, b.output())
        self.assertNotIn("project_b ran", b.output())
        self.assertEqual(len(set(re.findall(r"job-[0-9a-f]{12}", b.output()))), 2, b.output())
        self.assertEqual(a.wait(30), 0, a.output())
        self.assertNotIn("scale-up", a.output())
        self.assertEqual(a.output().count("project_a ran"), 1, a.output())

    def test_a_reused_run_id_with_other_trainer_settings_is_refused_at_join(self):
        # Two trainer jobs given the same --rdzv_id: the fingerprint (the trainer's settings)
        # tells them apart, and the newcomer is refused naming it, never merged as a scale-up.
        # (A program of the user's own may differ per node: torchrun's MPMD jobs.)
        if not os.path.exists(harness.TRAIN):
            self.skipTest(harness.needs_setup("train is not built"))
        configs = []
        for name, lr in (("a", "0.01"), ("b", "0.02")):
            path = os.path.join(self.tmp, f"job_{name}.yaml")
            with open(path, "w") as f:
                f.write("train:\n  model: {type: mlp, layers: [8, 16, 4]}\n"
                        "  data: {type: synthetic, samples: 100000}\n  batch_size: 8\n"
                        f"  max_steps: 100000\n  optimizer: {{type: sgd, lr: {lr}}}\n"
                        f"  output_dir: {self.tmp}/out_{name}\n  checkpoint_every: 0\n")
            configs.append(path)
        extra = ["--rdzv_id", "shared-id", "--rdzv_conf", "last_call_timeout=0.2"]
        a = self.start(0, "1:2", nproc=1, extra=extra, config=configs[0])
        self.wait_for_text(a, r"step \d+", timeout=60)
        b = self.start(1, "1:2", nproc=1, extra=extra, config=configs[1])
        self.assertEqual(b.wait(15), 2, b.output())
        self.assertIn("config fingerprint mismatch", b.output())
        self.assertIsNone(a.proc.poll(), a.output())
        self.assertNotIn("scale-up", a.output())

    def test_missing_node_times_out_listing_missing_ranks(self):
        conf = ["--rdzv_conf", "join_timeout=1.5"]
        a = self.start(0, 3, rank=0, extra=conf)
        b = self.start(1, 3, rank=2, extra=conf)
        t0 = time.monotonic()
        self.assertEqual(self.wait_all([a, b], 15), [2, 2])
        self.assertLess(time.monotonic() - t0, 6)
        for n in (a, b):
            self.assertIn("2 of 3 nodes joined", n.output())
            self.assertIn("unclaimed node ranks: 1", n.output())

    def test_wrong_token_is_refused_on_both_sides(self):
        conf = ["--rdzv_conf", "join_timeout=2"]
        a = self.start(0, 2, rank=0, extra=conf, env={"LAUNCH_RDZV_TOKEN": "right"})
        self.wait_for_text(a, "hosting the rendezvous")
        b = self.start(1, 2, rank=1, extra=conf, env={"LAUNCH_RDZV_TOKEN": "wrong"})
        self.assertEqual(b.wait(15), 2)
        self.assertIn("wrong or missing rdzv_token", b.output())
        self.assertEqual(a.wait(15), 2)  # its partner never arrived
        self.assertIn("wrong or missing rdzv_token", a.output())  # the server's side
        self.assertNotIn("right", b.output())
        self.assertNotIn("wrong\n", a.output())

    def test_port_in_use_by_something_else_is_one_line_with_the_address(self):
        squatter = socket.socket()
        squatter.bind(("127.0.0.1", self.port))
        squatter.listen(8)
        try:
            a = self.start(0, 2, rank=0, extra=["--rdzv_conf", "join_timeout=3"])
            self.assertEqual(a.wait(20), 2)
        finally:
            squatter.close()
        self.assertIn(f"127.0.0.1:{self.port}", a.output())
        self.assertIn("not a launch rendezvous server", a.output())

    # ---- failures, restarts, elasticity ------------------------------------------------------

    def test_sigkill_of_a_worker_restarts_every_node_and_the_job_completes(self):
        wa = ["--pid-dir", self.tmp, "--sleep-try", "0:60"]
        a = self.start(0, 2, rank=0, extra=["--max_restarts", "1"], worker_args=wa)
        b = self.start(1, 2, rank=1, extra=["--max_restarts", "1"], worker_args=wa)
        pid = self.pid_of(3, 0)
        for r in range(3):
            self.pid_of(r, 0)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        self.assertEqual(self.wait_all([a, b], 40), [0, 0], a.output() + b.output())
        self.assertLess(time.monotonic() - t0, 20)
        roots = []
        for n in (a, b):
            out = n.output()
            self.assertIn("restarting every node (round 1)", out)
            root = [l.split("] ", 1)[1] for l in out.splitlines() if "root cause:" in l]
            self.assertEqual(len(root), 1, out)
            roots.append(root[0])
            second = [e for e in env_lines(out) if e["TORCHELASTIC_RESTART_COUNT"] == "1"]
            self.assertEqual(len(second), 2)
        self.assertEqual(roots[0], roots[1])  # one story on every node
        self.assertIn("rank 3", roots[0])
        self.assertIn("SIGKILL", roots[0])

    def test_worker_failure_without_restarts_fails_every_node_with_its_exit_code(self):
        wa = ["--fail", "2:0:7", "--sleep-try", "0:60"]
        a = self.start(0, 2, rank=0, worker_args=wa)
        b = self.start(1, 2, rank=1, worker_args=wa)
        self.assertEqual(self.wait_all([a, b], 30), [7, 7], a.output() + b.output())
        for n in (a, b):
            self.assertIn("simulated failure (code 7)", n.output())  # the stderr tail travelled
            self.assertIn("no restarts left", n.output())

    def test_root_cause_is_the_earliest_failure_not_the_first_report(self):
        # Node 0's local rank 0 fails first (t=0.5 s), but its sibling takes 2 s to honour
        # SIGTERM; node 1's worker fails later (t=1 s, as a peer's collateral failure would).
        # The root cause on every node is node 0's, with its exit code and its stderr.
        first = ('if [ "$LOCAL_RANK" = 0 ]; then sleep 0.5; echo "REAL ROOT CAUSE" >&2; exit 3; '
                 'else trap "sleep 2; exit 143" TERM; while :; do sleep 0.1; done; fi')
        later = 'sleep 1; echo "collateral: lost a peer" >&2; exit 7'
        # Different programs on the two nodes: one job only with a run id of their own.
        a = self.start(0, 2, rank=0, nproc=2, program=["sh", "-c", first],
                       extra=["--run_id", "mpmd"])
        b = self.start(1, 2, rank=1, nproc=1, program=["sh", "-c", later],
                       extra=["--run_id", "mpmd"])
        self.assertEqual(self.wait_all([a, b], 30), [3, 3], a.output() + b.output())
        for n in (a, b):
            out = n.output()
            root = [l for l in out.splitlines() if "root cause:" in l]
            self.assertEqual(len(root), 1, out)
            self.assertIn("rank 0", root[0])
            self.assertIn("code 3", root[0])
            self.assertIn("REAL ROOT CAUSE", out)

    def test_sigkill_of_an_agent_whose_worker_has_children_is_seen_at_once(self):
        # The worker's background child must not keep the dead agent's rendezvous connection
        # open (an inherited socket would hide the death until heartbeat_timeout).
        extra = ["--rdzv_conf", "heartbeat_timeout=8"]
        prog = ["sh", "-c", "echo ENV RANK=$RANK; sleep 60 & sleep 59"]
        a = self.start(0, 2, rank=0, nproc=1, extra=extra, program=prog)
        b = self.start(1, 2, rank=1, nproc=1, extra=extra, program=prog)
        self.wait_for_text(a, "ENV RANK=0")
        self.wait_for_text(b, "ENV RANK=1")
        t0 = time.monotonic()
        b.proc.send_signal(signal.SIGKILL)
        b.proc.wait()
        self.assertEqual(a.wait(20), 1, a.output())
        self.assertLess(time.monotonic() - t0, 3)
        self.assertIn("lost node 1", a.output())
        self.assertNotIn("no complete message within", a.output())

    def test_sigkill_of_an_agent_reforms_the_survivors_at_min(self):
        wa = ["--pid-dir", self.tmp, "--sleep-try", "0:60"]
        extra = ["--max_restarts", "1", "--rdzv_conf", "heartbeat_timeout=2,last_call_timeout=1"]
        nodes = [self.start(i, "2:3", nproc=1, rank=None, extra=extra, worker_args=wa)
                 for i in range(3)]
        for r in range(3):
            self.pid_of(r, 0)
        # Kill an agent that does not host the rendezvous.
        victim = next(n for n in nodes if "hosting the rendezvous" not in n.output())
        self.wait_for_text(victim, r"ENV RANK=")
        victim_workers = []
        for e in env_lines(victim.output()):
            victim_workers.append(self.pid_of(int(e["RANK"]), 0))
        self.assertEqual(len(victim_workers), 1)
        t0 = time.monotonic()
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        survivors = [n for n in nodes if n is not victim]
        for n in survivors:
            self.wait_for_text(n, r"restarting every node", timeout=2.5)  # within heartbeat_timeout
        detect = time.monotonic() - t0
        self.assertEqual(self.wait_all(survivors, 40), [0, 0],
                         "".join(n.output() for n in survivors))
        self.assertLess(detect, 2.5)
        for n in survivors:
            self.assertIn("lost node", n.output())
            last = env_lines(n.output())[-1]
            self.assertEqual(last["GROUP_WORLD_SIZE"], "2")
        # The dead agent's worker did not outlive it.
        def gone(pid):
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                return True
        self.assertTrue(harness.wait_until(lambda: all(gone(p) for p in victim_workers), 10))

    def test_sigkill_of_an_agent_below_min_fails_the_other_when_no_replacement_comes(self):
        wa = ["--pid-dir", self.tmp, "--sleep-try", "0:60"]
        extra = ["--max_restarts", "3", "--rdzv_conf", "join_timeout=3"]
        a = self.start(0, 2, rank=0, nproc=1, extra=extra, worker_args=wa)
        b = self.start(1, 2, rank=1, nproc=1, extra=extra, worker_args=wa)
        self.pid_of(0, 0)
        self.pid_of(1, 0)
        t0 = time.monotonic()
        b.proc.send_signal(signal.SIGKILL)
        self.wait_for_text(a, "waiting up to 3 s")
        self.assertNotEqual(a.wait(20), 0, a.output())
        self.assertLess(time.monotonic() - t0, 12)
        self.assertIn("no replacement node joined", a.output())
        self.assertIn("node lost", a.output())  # the root cause, printed with the failure

    def test_sigkill_of_an_agent_below_min_is_replaced_and_the_job_completes(self):
        wa = ["--pid-dir", self.tmp, "--sleep-try", "0:60"]
        extra = ["--max_restarts", "3", "--rdzv_conf", "heartbeat_timeout=2"]
        a = self.start(0, 2, rank=0, nproc=1, extra=extra, worker_args=wa)
        b = self.start(1, 2, rank=1, nproc=1, extra=extra, worker_args=wa)
        self.pid_of(0, 0)
        self.pid_of(1, 0)
        b.proc.send_signal(signal.SIGKILL)
        b.proc.wait()
        self.wait_for_text(a, "waiting up to")
        # A new agent for the same machine rank (a restarted machine, or a spare) joins.
        c = self.start(1, 2, rank=1, nproc=1, extra=extra, worker_args=wa)
        self.assertEqual(self.wait_all([a, c], 40), [0, 0], a.output() + c.output())
        last = env_lines(c.output())[-1]
        self.assertEqual(last["TORCHELASTIC_RESTART_COUNT"], "1")
        self.assertEqual(last["RANK"], "1")

    def test_late_node_scales_up_without_spending_a_restart(self):
        wa = ["--sleep-single", "60"]
        extra = ["--rdzv_conf", "last_call_timeout=0.2"]
        a = self.start(0, "1:2", nproc=1, extra=extra, worker_args=wa)
        self.wait_for_text(a, r"round 0: node 0 of 1")
        b = self.start(1, "1:2", nproc=1, extra=extra, worker_args=wa)
        self.assertEqual(self.wait_all([a, b], 30), [0, 0], a.output() + b.output())
        self.assertIn("re-forming every node (round 1)", a.output())
        self.assertIn("scale-up", a.output())
        last = env_lines(a.output())[-1]
        self.assertEqual(last["GROUP_WORLD_SIZE"], "2")
        self.assertEqual(last["TORCHELASTIC_RESTART_COUNT"], "0")  # no restart spent

    def test_frozen_agent_is_declared_lost_after_heartbeat_timeout(self):
        wa = ["--pid-dir", self.tmp, "--sleep-try", "0:60"]
        extra = ["--max_restarts", "1", "--rdzv_conf", "heartbeat_timeout=1,last_call_timeout=1"]
        nodes = [self.start(i, "2:3", nproc=1, extra=extra, worker_args=wa) for i in range(3)]
        for r in range(3):
            self.pid_of(r, 0)
        victim = next(n for n in nodes if "hosting the rendezvous" not in n.output())
        survivors = [n for n in nodes if n is not victim]
        t0 = time.monotonic()
        victim.proc.send_signal(signal.SIGSTOP)  # alive, connection open, but silent
        try:
            for n in survivors:
                self.wait_for_text(n, r"lost node", timeout=5)
            detect = time.monotonic() - t0
            # Silence is counted from its last heartbeat (sent every heartbeat_timeout / 4).
            self.assertGreater(detect, 0.7)
            self.assertLess(detect, 3.0)     # ...and not long after it
            self.assertEqual(self.wait_all(survivors, 40), [0, 0],
                             "".join(n.output() for n in survivors))
        finally:
            victim.kill()

    # ---- network faults between an agent and the server (tests/rendezvous/tcp_proxy.py) -------

    def through_proxy(self, worker_sleep, heartbeat="1", restarts="0"):
        """Node 0 hosts the rendezvous; node 1 reaches it only through a proxy."""
        wa = ["--pid-dir", self.tmp, "--sleep-try", f"0:{worker_sleep}"]
        extra = ["--rdzv_conf", f"heartbeat_timeout={heartbeat}", "--max_restarts", restarts]
        a = self.start(0, 2, rank=0, nproc=1, extra=extra, worker_args=wa)
        self.wait_for_text(a, "hosting the rendezvous")
        proxy = TcpProxy("127.0.0.5", "127.0.0.1", self.port)
        self.addCleanup(proxy.close)
        b = self.start(1, 2, rank=1, nproc=1, extra=extra, worker_args=wa,
                       endpoint=f"127.0.0.5:{proxy.port}")
        return a, b, proxy

    def test_partitioned_node_is_lost_on_both_sides_within_the_heartbeat_timeout(self):
        a, b, proxy = self.through_proxy(worker_sleep=30)
        self.pid_of(0, 0)
        self.pid_of(1, 0)
        t0 = time.monotonic()
        proxy.mode = "partition"
        self.assertEqual(self.wait_all([a, b], 15), [1, 1], a.output() + b.output())
        self.assertLess(time.monotonic() - t0, 5)
        self.assertIn("lost node 1", a.output())
        self.assertIn("lost the rendezvous server", b.output())

    def test_half_open_link_is_noticed_by_the_side_that_hears_nothing(self):
        # The server still hears node 1's heartbeats; node 1 hears nothing and leaves, which the
        # server then sees as a closed connection.
        a, b, proxy = self.through_proxy(worker_sleep=30)
        self.pid_of(0, 0)
        self.pid_of(1, 0)
        t0 = time.monotonic()
        proxy.mode = "half-open"
        self.assertEqual(self.wait_all([a, b], 15), [1, 1], a.output() + b.output())
        self.assertLess(time.monotonic() - t0, 5)
        self.assertIn("lost the rendezvous server", b.output())
        # Lost after 1.5 x heartbeat_timeout of silence (rendezvous/protocol.h, Liveness).
        self.assertIn("no complete message within 1500 ms", b.output())
        self.assertIn("lost node 1", a.output())

    def test_slow_link_below_the_heartbeat_timeout_changes_nothing(self):
        a, b, proxy = self.through_proxy(worker_sleep=2, heartbeat="2")
        proxy.delay = 0.15
        self.assertEqual(self.wait_all([a, b], 20), [0, 0], a.output() + b.output())
        self.check_ranks([a, b], 2)

    def test_partitioned_node_with_restarts_left_is_replaced_by_the_survivors(self):
        # Elastic 1:2 with a restart: the partitioned node is dropped and node 0 finishes alone.
        # Node 1 tries to join again (restarts are left) until join_timeout, then gives up.
        wa = ["--pid-dir", self.tmp, "--sleep-try", "0:30"]
        extra = ["--rdzv_conf", "heartbeat_timeout=1,join_timeout=6", "--max_restarts", "1"]
        a = self.start(0, "1:2", rank=0, nproc=1, extra=extra, worker_args=wa)
        self.wait_for_text(a, "hosting the rendezvous")
        proxy = TcpProxy("127.0.0.5", "127.0.0.1", self.port)
        self.addCleanup(proxy.close)
        b = self.start(1, "1:2", rank=1, nproc=1, extra=extra, worker_args=wa,
                       endpoint=f"127.0.0.5:{proxy.port}")
        self.pid_of(0, 0)
        self.pid_of(1, 0)
        proxy.mode = "partition"
        self.assertEqual(a.wait(20), 0, a.output())
        self.assertIn("lost node 1", a.output())
        self.assertEqual(b.wait(20), 1, b.output())
        self.assertIn("joining again as machine_rank 1", b.output())
        self.assertIn("lost the rendezvous server", b.output())

    def test_sigkill_of_the_hosting_agent_fails_the_others_cleanly(self):
        wa = ["--pid-dir", self.tmp, "--sleep-try", "0:60"]
        a = self.start(0, 2, rank=0, nproc=1, extra=["--max_restarts", "3"], worker_args=wa)
        b = self.start(1, 2, rank=1, nproc=1, extra=["--max_restarts", "3"], worker_args=wa)
        self.pid_of(0, 0)
        self.pid_of(1, 0)
        self.assertIn("hosting the rendezvous", a.output())
        t0 = time.monotonic()
        a.proc.send_signal(signal.SIGKILL)
        self.assertEqual(b.wait(20), 1, b.output())
        self.assertLess(time.monotonic() - t0, 10)
        self.assertIn("lost the rendezvous server at 127.0.0.1:", b.output())

    def test_sigterm_of_the_hosting_agent_ends_the_job_naming_it_without_a_restart(self):
        # Node 0 hosts the rendezvous; when it leaves, the job cannot go on. The others hear why
        # at once and leave, instead of spending a restart on survivors and then losing the server.
        wa = ["--pid-dir", self.tmp, "--sleep-try", "0:60"]
        a = self.start(0, 2, rank=0, nproc=1, extra=["--max_restarts", "3"], worker_args=wa)
        b = self.start(1, 2, rank=1, nproc=1, extra=["--max_restarts", "3"], worker_args=wa)
        self.pid_of(0, 0)
        self.pid_of(1, 0)
        t0 = time.monotonic()
        a.proc.send_signal(signal.SIGTERM)
        self.assertEqual(b.wait(20), 1, b.output())
        self.assertEqual(a.wait(20), 128 + signal.SIGTERM, a.output())
        self.assertLess(time.monotonic() - t0, 10)
        out = b.output()
        self.assertRegex(out, r"the rendezvous host 127\.0\.0\.1:\d+ is leaving: it received SIGTERM")
        self.assertNotIn("restart", out)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "rank1_try1.pid")), out)

    def test_ctrl_c_on_one_agent_stops_its_workers_and_ends_the_job(self):
        wa = ["--pid-dir", self.tmp, "--sleep-try", "0:60"]
        a = self.start(0, 2, rank=0, nproc=1, worker_args=wa)
        b = self.start(1, 2, rank=1, nproc=1, worker_args=wa)
        self.pid_of(0, 0)
        self.pid_of(1, 0)
        b.proc.send_signal(signal.SIGINT)
        self.assertEqual(b.wait(20), 128 + signal.SIGINT, b.output())
        self.assertEqual(a.wait(20), 1, a.output())
        self.assertIn("lost node 1", a.output())

    # ---- a second host: a network namespace joined by a veth pair ------------------------------

    def make_netns(self):
        """A namespace reachable at its Link's PEER from the host at HOST (tests/rendezvous/netns.py)."""
        link = netns.make_netns(self, len(self.nodes))
        return link.ns, link.host

    def test_master_addr_is_never_loopback_for_a_node_on_another_host(self):
        # Node 0 shares the server's host and reaches it over loopback; node 1 is on "another
        # host" (a network namespace). MASTER_ADDR must be an address node 1 can reach node 0
        # at, and node 1's worker proves it by connecting to node 0's worker there.
        ns, host_addr = self.make_netns()
        server_log = os.path.join(self.tmp, "server.log")
        with open(server_log, "w") as log:
            server = subprocess.Popen([harness.LAUNCH, "rdzv-server", "--port", str(self.port),
                                       "--host", "0.0.0.0"], stdout=log, stderr=subprocess.STDOUT)
        self.addCleanup(lambda: (server.kill(), server.wait()))

        def listening():
            with open(server_log) as f:
                return "listening on" in f.read()
        self.assertTrue(harness.wait_until(listening, 10))
        script = (
            "import os, socket, sys, time\n"
            "addr, port = os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT'])\n"
            "print('ENV MASTER_ADDR=' + addr + ' RANK=' + os.environ['RANK'], flush=True)\n"
            "if os.environ['RANK'] == '0':\n"
            "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "    s.bind(('0.0.0.0', port)); s.listen(1); s.settimeout(15)\n"
            "    c, _ = s.accept(); c.sendall(b'hello from rank 0'); c.close(); sys.exit(0)\n"
            "deadline = time.time() + 15\n"
            "while True:\n"
            "    try:\n"
            "        c = socket.create_connection((addr, port), timeout=1); break\n"
            "    except OSError as e:\n"
            "        if time.time() > deadline: print('cannot reach', addr, e, flush=True); sys.exit(1)\n"
            "        time.sleep(0.1)\n"
            "print('rank 1 got:', c.recv(100).decode(), flush=True)\n")
        program = [harness.SYSTEM_PYTHON, "-c", script]
        a = self.start(0, 2, rank=0, nproc=1, program=program,
                       endpoint=f"127.0.0.1:{self.port}")
        b = self.start(1, 2, rank=1, nproc=1, program=program,
                       endpoint=f"{host_addr}:{self.port}", prefix=["ip", "netns", "exec", ns])
        self.assertEqual(self.wait_all([a, b], 30), [0, 0], a.output() + b.output())
        self.assertIn("rank 1 got: hello from rank 0", b.output())
        for n in (a, b):
            self.assertIn(f"MASTER_ADDR={host_addr} ", n.output())

    # ---- standalone server -------------------------------------------------------------------

    def test_standalone_rdzv_server_serves_two_jobs(self):
        server_log = os.path.join(self.tmp, "server.log")
        with open(server_log, "w") as log:
            server = subprocess.Popen([harness.LAUNCH, "rdzv-server", "--port", str(self.port),
                                       "--host", "127.0.0.1"], stdout=log,
                                      stderr=subprocess.STDOUT)

        def server_output():
            with open(server_log) as f:
                return f.read()
        try:
            self.assertTrue(harness.wait_until(lambda: "listening on" in server_output(), 10))
            for job in range(2):
                a = self.start(2 * job, 2, rank=0)
                b = self.start(2 * job + 1, 2, rank=1)
                self.assertEqual(self.wait_all([a, b]), [0, 0], a.output() + b.output())
                self.assertNotIn("hosting the rendezvous", a.output())
            server.send_signal(signal.SIGTERM)
            self.assertEqual(server.wait(timeout=10), 0)
            out = server_output()
            self.assertEqual(out.count("job done"), 2, out)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()


if __name__ == "__main__":
    unittest.main()
