"""`launch --rdzv_backend etcd`: no machine is a single point of failure. Test hosts
(tests/hosts.py: own network, hostname, pid namespace and /dev/shm each, one bridge); hosts 0-2
each run a member of a real 3-member etcd cluster (Debian's etcd-server) and a `launch` of a
`train` job (DDP over Gloo, checkpoints every 4 steps); host 0's agent serves the rendezvous.

  * Host 0 lost whole (Host.stop(): its agent, workers and etcd member at once) while its rank 0
    holds the others in step 9: etcd keeps going on two members, the survivors' agents find the
    server gone, the first to claim the job in etcd takes it over from its record (round 1, one
    restart), a spare `launch` on host 3 takes the lost node's place, every worker resumes from
    the step-8 checkpoint, and the job ends 0 with the parameters of an undisturbed run.
  * The same without a spare, nnodes 2:3: the two survivors go on as a 2-node job and end 0.
  * One of the three members lost (the first of every agent's list, on the serving host): nothing
    happens, the job ends 0.
  * The serving agent's process stalled (SIGSTOP) past its lease while every host and the cluster
    stay healthy: the other agent takes the job over; the stalled one, woken, finds its claim
    gone, stops serving and joins the job as a plain node; both end 0 with the parameters of an
    undisturbed run.
  * Two of the three etcd members lost: the serving agent can renew its claim nowhere, stops
    serving and says why; no agent finds a server within join_timeout and each says why; every
    `launch` exits non-zero, bounded, leaving nothing.
  * No job key stays in etcd after a job; no process and no /dev/shm segment on any host.
  * Without a reachable cluster, or without rdzv_endpoint, launch exits 2 naming it.

Rank 0 stops itself at an exact step (LAUNCH_TEST_SIGKILL_AT=0:9:stop, trainer.cc), so the
point of failure does not depend on timing."""

import os
import re
import shutil
import signal
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "trainer"))
import harness  # noqa: E402
from hosts import make_hosts  # noqa: E402
from trainer_helpers import final, metrics, write_config  # noqa: E402
from test_recover import JOB as RECOVER_JOB  # noqa: E402
import recover_multinode_test  # noqa: E402

ETCD = "/usr/bin/etcd"
ETCDCTL = "/usr/bin/etcdctl"
TIMEOUT = 240
STEPS = 16


def job_text(out):
    """The single-machine recovery tests' job (tests/trainer/test_recover.py) in ddp, with
    checkpoints every 4 steps that a restarted run resumes from."""
    return RECOVER_JOB.format(out=out, steps=STEPS, mode="ddp", ckpt=4).replace(
        "resume: never", "resume: auto")


class Cluster:
    """A 3-member etcd cluster, one member on each of `hosts` (its data in `tmp`)."""

    def __init__(self, test, hosts, tmp):
        self.test, self.hosts = test, hosts
        self.procs = []
        token = harness.unique_marker("etcd")
        initial = ",".join(f"m{i}=http://{h.addr}:2380" for i, h in enumerate(hosts))
        for i, h in enumerate(hosts):
            data = os.path.join(tmp, f"etcd{i}")
            log = open(os.path.join(tmp, f"etcd{i}.log"), "w")
            test.addCleanup(log.close)
            p = h.popen([ETCD, "--name", f"m{i}", "--data-dir", data,
                         "--listen-client-urls", f"http://{h.addr}:2379",
                         "--advertise-client-urls", f"http://{h.addr}:2379",
                         "--listen-peer-urls", f"http://{h.addr}:2380",
                         "--initial-advertise-peer-urls", f"http://{h.addr}:2380",
                         "--initial-cluster", initial, "--initial-cluster-token", token,
                         "--initial-cluster-state", "new"],
                        stdout=log, stderr=subprocess.STDOUT)
            test.addCleanup(lambda p=p: p.poll() is None and (p.kill(), p.wait()))
            self.procs.append(p)
        self.endpoints = ",".join(f"{h.addr}:2379" for h in hosts)
        ok = harness.wait_until(lambda: self.ctl(hosts[0], "endpoint", "health").returncode == 0,
                                30, interval=0.2)
        test.assertTrue(ok, "the etcd cluster did not become healthy:\n" +
                        self.ctl(hosts[0], "endpoint", "health").stderr)

    def ctl(self, host, *args):
        return host.run([ETCDCTL, "--endpoints", self.endpoints, "--command-timeout", "3s",
                         *args], env={**os.environ, "ETCDCTL_API": "3"})

    def keys(self, host, prefix):
        r = self.ctl(host, "get", "--prefix", "--keys-only", prefix)
        self.test.assertEqual(r.returncode, 0, r.stderr)
        return [k for k in r.stdout.split() if k]

    def stop_member(self, i):
        """SIGKILL to member i (inside its host: nsenter's own process is only its parent)."""
        r = self.hosts[i].run(["pkill", "-KILL", "-x", "etcd"])
        self.test.assertEqual(r.returncode, 0, r.stderr)
        self.procs[i].wait(timeout=10)


class Job(recover_multinode_test.Job):
    """One `launch` per host; output of each in its own file (text, all_text, wait_for and wait
    as the multi-host recovery test's)."""

    def __init__(self, test, hosts, cluster, name, nnodes="3", kill=""):
        self.test, self.hosts, self.cluster, self.name = test, hosts, cluster, name
        self.out = os.path.join(test.tmp, name)
        self.cfg = write_config(test.tmp, job_text(self.out), f"{name}.yaml")
        self.marker = harness.unique_marker("etcdjob")
        self.nnodes, self.kill = nnodes, kill
        self.procs, self.logs = [], []

    def start(self, host, node_rank=None, join_timeout=30, program=None):
        env = {k: v for k, v in os.environ.items()
               if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
        env.update(OMP_NUM_THREADS="1", LAUNCH_RDZV_TOKEN="etcd-test", LAUNCH_INIT_TIMEOUT_S="60",
                   ETCD_TEST_MARKER=self.marker)
        if self.kill:
            env["LAUNCH_TEST_SIGKILL_AT"] = self.kill
        path = os.path.join(self.test.tmp, f"{self.name}-{len(self.logs)}-{host.name}.log")
        log = open(path, "w")
        self.test.addCleanup(log.close)
        argv = [harness.LAUNCH, "--nnodes", self.nnodes, "--nproc_per_node", "2",
                "--rdzv_backend", "etcd", "--rdzv_endpoint", self.cluster.endpoints,
                "--run_id", self.marker, "--max_restarts", "3",
                "--join_timeout", str(join_timeout), "--heartbeat_timeout", "2",
                "--last_call_timeout", "1"]
        if node_rank is not None:
            argv += ["--node_rank", str(node_rank)]
        p = host.popen(argv + (["--", *program] if program else [self.cfg]), stdout=log, stderr=subprocess.STDOUT, env=env)
        self.test.addCleanup(lambda: p.poll() is None and (p.kill(), p.wait()))
        self.procs.append(p)
        self.logs.append(path)
        return p

    def start_all(self, n=3):
        """Host 0's agent first, so that it is the one serving the rendezvous."""
        self.start(self.hosts[0], 0)
        self.wait_for(0, r"serving the rendezvous at ")
        for i in range(1, n):
            self.start(self.hosts[i], i)

    def check_clean(self, alive):
        left = harness.wait_until(lambda: not harness.pids_with_marker(self.marker), 10)
        self.test.assertTrue(left, f"left running: {harness.pids_with_marker(self.marker)}")
        for host in alive:
            r = host.run(["ls", "/dev/shm"])
            self.test.assertEqual([n for n in r.stdout.split() if self.marker in n], [])
        self.test.assertEqual(self.cluster.keys(alive[0], f"/launch/{self.marker}/"), [])


@unittest.skipUnless(os.path.exists(harness.TRAIN) and os.path.exists(harness.LAUNCH),
                     harness.needs_setup("train/launch not built"))
@unittest.skipUnless(os.path.exists(ETCD) and os.path.exists(ETCDCTL),
                     harness.needs_setup("etcd-server and etcd-client not installed"))
class EtcdRendezvousTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

    def test_node_0_lost_whole_a_survivor_takes_the_job_over_and_a_spare_its_place(self):
        hosts = make_hosts(self, 4, private_shm=True)
        cluster = Cluster(self, hosts[:3], self.tmp)
        reference = Job(self, hosts, cluster, "reference")
        reference.start_all()
        self.assertEqual(reference.wait([0, 1, 2]), [0, 0, 0], reference.all_text()[-6000:])
        reference.check_clean(hosts)

        job = Job(self, hosts, cluster, "node0", kill="0:9:stop")
        job.start_all()
        job.wait_for(2, r"round 0: node 2 of 3")
        job.start(hosts[3])  # no machine_rank: waits as a spare
        job.wait_for(0, r"host \S+ \(%s\) waits as a spare" % re.escape(hosts[3].addr))
        # Rank 0 holds everyone in step 9; then host 0 goes, with its etcd member.
        job.wait_for(0, r"rank 0: LAUNCH_TEST_SIGKILL_AT: stopped before step 9")
        hosts[0].stop()
        codes = job.wait([1, 2, 3])
        text = job.all_text()
        self.assertEqual(codes, [0, 0, 0], text[-8000:])
        self.assertEqual(final(job.out)["param_checksum"],
                         final(reference.out)["param_checksum"], text[-8000:])
        self.assertEqual(sorted({m["step"] for m in metrics(job.out)}),
                         list(range(1, STEPS + 1)))
        # One survivor took the job over from its record in etcd: round 1, one restart.
        takeover = [i for i in (1, 2, 3) if "taking the job over" in job.text(i)]
        self.assertEqual(len(takeover), 1, text[-8000:])
        self.assertRegex(text, r"taking over job '.*' at round 1 \(restart 1 of 3\)")
        self.assertIn("resumed from", text)  # the step-8 checkpoint
        # The spare runs node 0's ranks now (it asked for no rank; the survivors kept theirs).
        self.assertRegex(job.text(3), r"round 1: node 0 of 3, ranks 0-1 of 6")
        job.check_clean(hosts[1:])

    def test_node_0_lost_with_no_replacement_the_survivors_go_on_as_two_nodes(self):
        hosts = make_hosts(self, 3, private_shm=True)
        cluster = Cluster(self, hosts, self.tmp)
        job = Job(self, hosts, cluster, "shrink", nnodes="2:3", kill="0:9:stop")
        job.start_all()
        job.wait_for(0, r"rank 0: LAUNCH_TEST_SIGKILL_AT: stopped before step 9")
        hosts[0].stop()
        codes = job.wait([1, 2])
        text = job.all_text()
        self.assertEqual(codes, [0, 0], text[-8000:])
        self.assertRegex(text, r"round 1: node \d of 2, ranks \d-\d of 4")
        self.assertEqual(metrics(job.out)[-1]["step"], STEPS)
        job.check_clean(hosts[1:])

    def test_one_of_three_etcd_members_lost_changes_nothing(self):
        # The first member of every agent's endpoint list, on the serving agent's own host: the
        # lease renewals and the record's writes go to the next member; the job runs on, nobody
        # restarts or takes anything over, and its keys are still deleted at the end.
        hosts = make_hosts(self, 3, private_shm=True)
        cluster = Cluster(self, hosts, self.tmp)
        job = Job(self, hosts, cluster, "one_member", nnodes="2")
        job.start(hosts[0], 0, program=["sleep", "12"])
        job.wait_for(0, r"serving the rendezvous at ")
        job.start(hosts[1], 1, program=["sleep", "12"])
        job.wait_for(1, r"round 0: node 1 of 2")
        # Silent (SIGSTOP: connections open, nothing answers), as a member whose host went.
        r = hosts[0].run(["pkill", "-STOP", "-x", "etcd"])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.addCleanup(lambda: hosts[0].run(["pkill", "-KILL", "-x", "etcd"]))
        codes = job.wait([0, 1])
        text = job.all_text()
        self.assertEqual(codes, [0, 0], text[-8000:])
        for gone in ("stops serving", "taking the job over", "restart 1", "lost"):
            self.assertNotIn(gone, text)
        job.check_clean(hosts[1:])

    def test_a_serving_agent_stalled_past_its_lease_stays_in_the_job_as_a_node(self):
        hosts = make_hosts(self, 3, private_shm=True)
        cluster = Cluster(self, hosts, self.tmp)
        reference = Job(self, hosts, cluster, "reference", nnodes="2")
        reference.start_all(2)
        self.assertEqual(reference.wait([0, 1]), [0, 0], reference.all_text()[-6000:])

        job = Job(self, hosts, cluster, "stall", nnodes="2", kill="0:9:stop")
        job.start_all(2)
        job.wait_for(0, r"rank 0: LAUNCH_TEST_SIGKILL_AT: stopped before step 9")
        # The serving agent alone stops (its workers, its host and the etcd member on it go
        # on), longer than its 2 s lease: as a process stalled or a host briefly cut off.
        r = hosts[0].run(["pkill", "-STOP", "-x", "launch"])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.addCleanup(lambda: hosts[0].run(["pkill", "-CONT", "-x", "launch"]))
        job.wait_for(1, r"taking the job over")
        # nsenter (the launch's parent outside the host) stopped itself with its child, as
        # util-linux's --fork does for job control, and continues the child once continued.
        job.procs[0].send_signal(signal.SIGCONT)
        r = hosts[0].run(["pkill", "-CONT", "-x", "launch"])
        self.assertEqual(r.returncode, 0, r.stderr)
        codes = job.wait([0, 1])
        text = job.all_text()
        self.assertEqual(codes, [0, 0], text[-8000:])
        self.assertEqual(final(job.out)["param_checksum"],
                         final(reference.out)["param_checksum"], text[-8000:])
        self.assertIn("this agent stops serving the rendezvous at", job.text(0))
        self.assertIn("it stays in the job as a node", job.text(0))
        self.assertRegex(job.text(0), r"round 1: node 0 of 2")
        self.assertIn("resumed from", text)  # the step-8 checkpoint
        job.check_clean(hosts)

    def test_two_of_three_etcd_members_lost_every_agent_says_why_and_exits(self):
        hosts = make_hosts(self, 3, private_shm=True)
        cluster = Cluster(self, hosts, self.tmp)
        job = Job(self, hosts, cluster, "quorum", nnodes="2")
        job.start(hosts[0], 0, join_timeout=6, program=["sleep", "120"])
        job.wait_for(0, r"serving the rendezvous at ")
        job.start(hosts[1], 1, join_timeout=6, program=["sleep", "120"])
        job.wait_for(1, r"round 0: node 1 of 2")
        cluster.stop_member(1)
        cluster.stop_member(2)
        codes = job.wait([0, 1])
        text = job.all_text()
        self.assertEqual(codes, [1, 1], text[-8000:])
        self.assertIn("this agent stops serving the rendezvous at", job.text(0))
        self.assertIn("no renewal of its etcd lease got through", job.text(0))
        for i in (0, 1):  # the serving agent too, once it looked for another server
            self.assertRegex(job.text(i), r"no rendezvous server found for job '.*' in the etcd "
                                          r"cluster .* within join_timeout \(the last etcd error: ")
        left = harness.wait_until(lambda: not harness.pids_with_marker(job.marker), 10)
        self.assertTrue(left, f"left running: {harness.pids_with_marker(job.marker)}")

    def test_no_cluster_or_no_endpoint_is_a_setup_error_naming_it(self):
        port = harness.free_port()  # nothing listens there
        r = subprocess.run([harness.LAUNCH, "--nnodes", "2", "--rdzv_backend", "etcd",
                            "--rdzv_endpoint", f"127.0.0.1:{port}", "--", "true"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn(f"cannot reach the etcd cluster at rdzv_endpoint 127.0.0.1:{port}", r.stderr)
        r = subprocess.run([harness.LAUNCH, "--nnodes", "2", "--rdzv_backend", "etcd", "--",
                            "true"], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("rdzv_backend etcd needs rdzv_endpoint", r.stderr)
        r = subprocess.run([harness.LAUNCH, "--nnodes", "2", "--rdzv_endpoint",
                            "a:1,b:2", "--", "true"], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("only rdzv_backend etcd takes a list", r.stderr)


if __name__ == "__main__":
    unittest.main()
