"""`launch --recover in_place` across machines: two test hosts (tests/hosts.py: own network,
hostname and pid namespace each, one bridge), two `train` workers (DDP over Gloo) each, one
`launch` per host, node 0 hosting the rendezvous.

  * A worker SIGKILLed on host 1 is replaced alone: its agent asks the rendezvous (REPLACE), which
    grants generation 1 and counts a restart; the job ends 0 with the parameters of an
    undisturbed run, bit for bit, and every other worker is the process that started. With
    --max_restarts 1 a second death is refused and ends the job as without recovery.
  * Host 1 lost whole (Host.stop()) while its rank 2 holds the others in step 9: the rendezvous
    keeps the round and waits; a `launch` with machine_rank 1 on a fresh host takes the lost
    node's place (same ranks, generation 1), its workers receive the state from host 0's, and the
    job ends 0, bit-identical, host 0's workers never restarted.
  * The same with host 1 gone silent (its network blackholed before it stops, as at a power
    loss): the survivors learn of the replacement from the store, not from Gloo's timeout.
  * Host 1 lost and nobody takes its place within join_timeout: every node restarts as with
    --recover restart, and with nobody to form the new round either, the job fails saying so.
  * Nothing of any job (process, /dev/shm segment) is left on any host (each host has its own
    /dev/shm, as machines do: a lost host's goes with it).

The ranks kill or stop themselves at an exact step (LAUNCH_TEST_SIGKILL_AT, trainer.cc), so the
point of failure does not depend on timing."""

import os
import re
import shutil
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "trainer"))
import harness  # noqa: E402
from hosts import make_hosts  # noqa: E402
from trainer_helpers import final, metrics, write_config  # noqa: E402

# The single-machine tests' job (tests/trainer/test_recover.py), in ddp without checkpoints.
from test_recover import JOB, STEPS  # noqa: E402

TIMEOUT = 240


def shm_files(hosts, marker):
    """/dev/shm entries of the job on the hosts still up (each host has its own /dev/shm, which
    goes with it, as a machine's does)."""
    found = []
    for host in hosts:
        if host.alive():
            r = host.run(["ls", "/dev/shm"])
            found += [f"{host.name}:{n}" for n in r.stdout.split() if marker in n]
    return found


def start_pids(text):
    """{rank: [pids of its workers in start order]} from the trainer's start lines (pids as the
    host's own pid namespace numbers them: unique per host, and each rank lives on one host)."""
    pids = {}
    for rank, pid in re.findall(r"train: rank (\d+) \(pid (\d+)\): in-place recovery on", text):
        pids.setdefault(int(rank), []).append(int(pid))
    return pids


class Job:
    """One `launch` per host of a 2-node job; output of each in its own file."""

    def __init__(self, test, hosts, name, kill="", max_restarts=3, join_timeout=60, mode="ddp"):
        self.test, self.hosts, self.name = test, hosts, name
        self.out = os.path.join(test.tmp, name)
        # zero: a snapshot every 4 steps, each copy waited for (which one a recovery goes back
        # to does not then depend on timing).
        text = JOB.format(out=self.out, steps=STEPS, mode=mode, ckpt=0)
        if mode != "ddp":
            text += "  recover_snapshot_every: 4\n"
        self.cfg = write_config(test.tmp, text, f"{name}.yaml")
        self.mode = mode
        self.marker = harness.unique_marker("recovermn")
        self.port = harness.free_port()
        self.kill, self.max_restarts, self.join_timeout = kill, max_restarts, join_timeout
        self.procs, self.logs = [], []

    def start(self, host, node_rank):
        env = {k: v for k, v in os.environ.items()
               if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
        env.update(OMP_NUM_THREADS="1", LAUNCH_RDZV_TOKEN="recover-multinode-test",
                   LAUNCH_INIT_TIMEOUT_S="60", RECOVER_TEST_MARKER=self.marker)
        if self.mode != "ddp":
            env["LAUNCH_TEST_SNAPSHOT_SYNC"] = "1"
        if self.kill:
            env["LAUNCH_TEST_SIGKILL_AT"] = self.kill
        path = os.path.join(self.test.tmp, f"{self.name}-{len(self.logs)}-{host.name}.log")
        log = open(path, "w")
        self.test.addCleanup(log.close)
        argv = [harness.LAUNCH, "--nnodes", "2", "--node_rank", str(node_rank),
                "--nproc_per_node", "2", "--master_addr", self.hosts[0].addr,
                "--master_port", str(self.port), "--run_id", self.marker,
                "--recover", "in_place", "--max_restarts", str(self.max_restarts),
                "--join_timeout", str(self.join_timeout), "--heartbeat_timeout", "6", self.cfg]
        p = host.popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.test.addCleanup(lambda: p.poll() is None and (p.kill(), p.wait()))
        self.procs.append(p)
        self.logs.append(path)
        return p

    def start_all(self):
        for rank, host in enumerate(self.hosts[:2]):
            self.start(host, rank)

    def text(self, i):
        with open(self.logs[i]) as f:
            return f.read()

    def all_text(self):
        return "\n".join(f"--- {os.path.basename(p)}\n" + self.text(i)
                         for i, p in enumerate(self.logs))

    def wait_for(self, i, pattern, timeout=120):
        ok = harness.wait_until(lambda: re.search(pattern, self.text(i)) is not None, timeout,
                                interval=0.05)
        self.test.assertTrue(ok, f"'{pattern}' not seen:\n{self.all_text()[-6000:]}")

    def wait(self, indices=None):
        """Exit codes of the `launch` processes at `indices` (all by default), bounded."""
        return harness.wait_codes(
            [p for i, p in enumerate(self.procs) if indices is None or i in indices], TIMEOUT)

    def check_clean(self):
        # Every worker and replacement is gone with its `launch`, on every host, and so is every
        # shared-memory segment of the job.
        left = harness.wait_until(lambda: not harness.pids_with_marker(self.marker), 10)
        self.test.assertTrue(left, f"left running: {harness.pids_with_marker(self.marker)}")
        self.test.assertEqual(shm_files(self.hosts, self.marker), [])


@unittest.skipUnless(os.path.exists(harness.TRAIN) and os.path.exists(harness.LAUNCH),
                     harness.needs_setup("train/launch not built"))
class RecoverMultiNodeTest(unittest.TestCase):
    references = {}  # mode: the checksum of an undisturbed 2 x 2 run (the first test needing it)

    def setUp(self):
        self.tmp = harness.tmpdir()
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

    def checksum_of_undisturbed_run(self, hosts, mode="ddp"):
        refs = type(self).references
        if mode not in refs:
            job = Job(self, hosts, "reference_" + re.sub(r"\W+", "_", mode), mode=mode)
            job.start_all()
            self.assertEqual(job.wait(), [0, 0], job.all_text()[-6000:])
            refs[mode] = final(job.out)["param_checksum"]
        return refs[mode]

    def check_same_run(self, job, hosts):
        text = job.all_text()
        self.assertEqual(final(job.out)["param_checksum"],
                         self.checksum_of_undisturbed_run(hosts, job.mode), text[-6000:])
        # Every step ran once (ddp redoes the step in flight: logged once), or at least once (a
        # rollback redoes the steps since the snapshot: each is logged again).
        steps = [m["step"] for m in metrics(job.out)]
        self.assertEqual(steps if job.mode == "ddp" else sorted(set(steps)),
                         list(range(1, STEPS + 1)))
        self.assertNotIn("resumed from", text)  # no checkpoint read

    def test_a_worker_killed_on_host_1_is_replaced_alone(self):
        hosts = make_hosts(self, 2, private_shm=True)
        job = Job(self, hosts, "worker", kill="2:9:backward")
        job.start_all()
        codes = job.wait()
        text = job.all_text()
        self.assertEqual(codes, [0, 0], text[-6000:])
        self.check_same_run(job, hosts)
        # Host 1's agent asked; the rendezvous (on host 0) granted generation 1, one restart.
        self.assertIn("rank 2 on node 1", job.text(0))
        self.assertIn("replaced alone, generation 1 (restart 1 of 3, in place)", job.text(0))
        self.assertEqual(re.findall(r"starting a replacement for rank (\d+) alone", job.text(1)),
                         ["2"])
        self.assertIn("restart 1 of 3, in place, generation 1", job.text(1))
        self.assertIn("replacement (generation 1) took the state of step", text)
        # Every worker but rank 2's is the one that started; the ones that lost a peer too.
        pids = start_pids(text)
        self.assertEqual({r: len(p) for r, p in pids.items()}, {0: 1, 1: 1, 2: 2, 3: 1}, text)
        lost = re.findall(r"train: rank (\d+) \(pid (\d+)\): lost a peer", text)
        self.assertTrue(lost, text[-6000:])
        for rank, pid in lost:
            self.assertIn(int(pid), pids[int(rank)])
        # The recovery's cost, as each survivor measured it.
        self.assertRegex(text, r"recovered \d+\.\d+ s after the failure")
        job.check_clean()

    def test_a_second_death_with_no_restart_left_ends_the_job_as_without_recovery(self):
        hosts = make_hosts(self, 2, private_shm=True)
        job = Job(self, hosts, "budget", kill="2:6:backward,3:15:backward", max_restarts=1)
        job.start_all()
        codes = job.wait()
        text = job.all_text()
        self.assertEqual(codes, [137, 137], text[-6000:])  # 128 + SIGKILL, the root cause's
        self.assertEqual(len(re.findall(r"starting a replacement for rank", text)), 1, text)
        self.assertIn("is not replaced in place: no restarts left (max_restarts 1)", text)
        self.assertRegex(text, r"root cause: rank 3 \(node 1")
        job.check_clean()

    def test_host_1_lost_whole_is_replaced_by_a_new_host_in_the_running_round(self):
        self.lose_host_1(silent=False)

    def test_host_1_gone_silent_is_replaced_and_the_survivors_learn_it_at_once(self):
        # Host 1 loses power: its network goes first, so nothing (no FIN, no RST) reaches the
        # survivors, whose Gloo would wait for host 1's leader until the group's collective
        # timeout (train.collective_timeout, 3600 s). The new host's replacements announce their generation in
        # the store, which the survivors watch.
        self.lose_host_1(silent=True)

    def test_zero_host_1_lost_whole_its_ranks_go_back_to_the_copies_host_0_keeps(self):
        # ZeRO stage 2: ranks 2 and 3 hold the only shards of their optimizer state; their
        # keepers are ranks 0 and 1, the same local ranks on host 0. The new host's workers take
        # the lost ranks' images from there, every rank goes back to the snapshot of step 8, and
        # the job ends as undisturbed.
        text = self.lose_host_1(silent=False, mode="zero, zero_stage: 2")
        self.assertEqual(len(re.findall(r"rank [23]: replacement \(generation 1\) took the snapshot "
                                        r"of step 8 from rank [01]", text)), 2, text[-6000:])
        self.assertEqual(len(re.findall(r"rank [01]: recovered .* rolled back to the snapshot of "
                                        r"step 8", text)), 2, text[-6000:])

    def lose_host_1(self, silent, mode="ddp"):
        hosts = make_hosts(self, 3, private_shm=True)
        self.checksum_of_undisturbed_run(hosts, mode)  # while host 1 is there
        name = "silent" if silent else "node"
        job = Job(self, hosts, name if mode == "ddp" else "zero_" + name, kill="2:9:stop",
                  mode=mode)
        job.start_all()
        # Rank 2 holds everyone in step 9; then its host goes, with everything on it.
        job.wait_for(1, r"rank 2: LAUNCH_TEST_SIGKILL_AT: stopped before step 9")
        if silent:
            hosts[1].run(["tc", "qdisc", "replace", "dev", "eth0", "root", "blackhole"])
        hosts[1].stop()
        job.wait_for(0, r"are recovered in place: waiting up to 60 s \(join_timeout\) for a node "
                        r"to join as machine_rank 1")
        job.start(hosts[2], 1)  # a fresh machine, as machine_rank 1
        # Both survivors recover long before the group's collective timeout would let them.
        for rank in (0, 1):
            job.wait_for(0, rf"rank {rank}: recovered", timeout=30)
        codes = job.wait(indices=[0, 2])
        text = job.all_text()
        self.assertEqual(codes, [0, 0], text[-6000:])
        self.check_same_run(job, hosts)
        self.assertIn("takes the place of node 1 in round 0", job.text(0))
        self.assertIn("generation 1, restart 1 of 3", job.text(0))
        self.assertIn("taking a lost node's place in the running round 0", job.text(2))
        self.assertNotRegex(job.text(0), r"restarting every node")
        # Host 0's workers are the ones that started, and both waited for the new host's.
        host0 = start_pids(job.text(0))
        self.assertEqual({r: len(p) for r, p in host0.items()}, {0: 1, 1: 1}, job.text(0))
        for rank, pid in re.findall(r"train: rank (\d+) \(pid (\d+)\): lost a peer", job.text(0)):
            self.assertIn(int(pid), host0[int(rank)])
        self.assertIn("replacement generation 1", job.text(2))
        # They would have waited longer than the rendezvous does (LAUNCH_RECOVER_WAIT_S from the
        # agent): join_timeout 60 s + 1.5 x heartbeat_timeout 6 s + 60 s for the new workers.
        self.assertIn("waiting up to 129 s for its replacement", job.text(0))
        # Counted from the rendezvous' notice of the loss (for a silent host, its heartbeat
        # deadline), which no survivor saw before the new host came: the place's vacancy is in it.
        recovered = re.findall(r"rank [01]: recovered (\d+\.\d+) s after the failure "
                               r"\(first noticed by the rendezvous \(node 1 lost\)", job.text(0))
        self.assertEqual(len(recovered), 2, job.text(0)[-4000:])
        vacant_ms = int(re.search(r"the place was vacant for (\d+) ms", job.text(0)).group(1))
        for seconds in recovered:
            self.assertGreaterEqual(float(seconds), vacant_ms / 1000 - 0.2, job.text(0)[-4000:])
        job.check_clean()
        return text

    def test_host_1_lost_with_no_replacement_restarts_every_node_then_fails_saying_why(self):
        hosts = make_hosts(self, 2, private_shm=True)
        job = Job(self, hosts, "nobody", kill="2:9:stop", join_timeout=3)
        job.start_all()
        job.wait_for(1, r"rank 2: LAUNCH_TEST_SIGKILL_AT: stopped before step 9")
        hosts[1].stop()
        codes = job.wait(indices=[0])
        text = job.text(0)
        self.assertNotEqual(codes, [0], text[-6000:])
        self.assertIn("waiting up to 3 s (join_timeout) for a node to join as machine_rank 1",
                      text)
        self.assertIn("node 1 is not recovered in place: no node joined to replace it within "
                      "join_timeout (3 s)", text)
        self.assertIn("restarting every node (round 1)", text)
        self.assertIn("no replacement node joined", text)
        job.check_clean()


if __name__ == "__main__":
    unittest.main()
