"""A real SLURM cluster on localhost: munged, slurmctld and two slurmd "nodes", all in a temporary
directory with their own ports, stopped by PID. Nothing is installed here: the tests skip when
the SLURM daemons are not installed (CI installs slurmctld slurmd slurm-client munge)."""

import os
import shutil
import signal
import socket
import subprocess
import time

import harness


def missing_programs():
    need = ["slurmctld", "slurmd", "srun", "sbatch", "sinfo", "munged", "munge"]
    return [p for p in need if shutil.which(p) is None and
            not os.path.exists(os.path.join("/usr/sbin", p))]


def _which(name):
    return shutil.which(name) or os.path.join("/usr/sbin", name)


def _free_ports(n):
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _resolves_to_this_host(name):
    """True when `name` resolves (IPv4) to an address of this machine (one we can bind)."""
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(name, None, socket.AF_INET)}
    except OSError:
        return False
    for addr in addrs:
        try:
            with socket.socket() as s:
                s.bind((addr, 0))
        except OSError:
            return False
    return bool(addrs)


def _node_names():
    """Two node names that resolve to this machine, so that the head node's name works as the
    rendezvous address: the host name and aliases from /etc/hosts. SLURM rewrites the name
    'localhost' to the host name, so it cannot be used. With fewer than two such names the
    nodes get made-up names and `resolvable` is False: the tests then give
    LAUNCH_MAIN_PROCESS_IP themselves."""
    candidates = [socket.gethostname().split(".")[0]]
    try:
        with open("/etc/hosts") as f:
            for line in f:
                words = line.split("#")[0].split()
                candidates += words[1:]
    except OSError:
        pass
    names = []
    for name in candidates:
        if (name and "." not in name and name not in names and not name.startswith("localhost")
                and not name.startswith("ip6-") and _resolves_to_this_host(name)):
            names.append(name)
    if len(names) >= 2:
        return names[:2], True
    return ["n1", "n2"], False


class LocalSlurm:
    def __init__(self):
        self.dir = harness.tmpdir()
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.nodes, self.names_resolve = _node_names()
        self.env = dict(os.environ)
        self.env["SLURM_CONF"] = self.conf
        self.pid_files = []
        self.munged_pid_file = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self):
        self._start_munge()
        ctld_port, p1, p2 = _free_ports(3)
        d = self.dir
        for sub in ("state", "spool"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        lines = [
            "ClusterName=launchtest",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd.%n.pid",
            f"SlurmctldLogFile={d}/slurmctld.log",
            f"SlurmdLogFile={d}/slurmd.%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "SchedulerParameters=batch_sched_delay=0",
            "InactiveLimit=0",
            "KillWait=5",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
        ]
        for name, port in zip(self.nodes, (p1, p2)):
            lines.append(f"NodeName={name} NodeHostname={name} NodeAddr=127.0.0.1 Port={port} "
                         "CPUs=2 Sockets=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=1000")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP OverSubscribe=YES")
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

        self._daemon([_which("slurmctld"), "-i"], os.path.join(d, "slurmctld.pid"))
        for name in self.nodes:
            self._daemon([_which("slurmd"), "-N", name], os.path.join(d, f"slurmd.{name}.pid"))
        ok = harness.wait_until(self._all_idle, timeout=30, interval=0.1)
        if not ok:
            raise RuntimeError("SLURM nodes did not become idle:\n" + self.logs())

    def _all_idle(self):
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True,
                           env=self.env, timeout=10)
        states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
        return r.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes)

    def _daemon(self, argv, pid_file):
        r = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"{argv} failed ({r.returncode}): {r.stderr}\n" + self.logs())
        self.pid_files.append(pid_file)
        harness.wait_until(lambda: os.path.exists(pid_file), timeout=10)

    def _start_munge(self):
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
            return  # a munged already runs; leave it alone
        os.makedirs("/run/munge", exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        r = subprocess.run(["runuser", "-u", "munge", "--", _which("munged")], capture_output=True,
                           text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError("munged did not start: " + r.stderr)
        self.munged_pid_file = "/run/munge/munged.pid"
        if not harness.wait_until(
                lambda: subprocess.run("munge -n | unmunge", shell=True,
                                       capture_output=True).returncode == 0, timeout=10):
            raise RuntimeError("munge does not work after starting munged")

    def stop(self):
        # Let running jobs end first: a slurmstepd whose slurmd is gone lingers, retrying.
        if self.pid_files:
            subprocess.run(["scancel", "--full", "--user", "root"], env=self.env,
                           capture_output=True, timeout=30)
            harness.wait_until(self._no_jobs, timeout=15, interval=0.1)
        pid_files = list(reversed(self.pid_files))
        if self.munged_pid_file:
            pid_files.append(self.munged_pid_file)
        pids = []
        for pf in pid_files:
            try:
                with open(pf) as f:
                    pid = int(f.read().strip())
                os.kill(pid, signal.SIGTERM)
                pids.append(pid)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 10
        for pid in pids:
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        # Whatever still runs with our slurm.conf (a stray slurmstepd): by PID, never by name.
        for pid in harness.pids_with_marker(self.conf):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def _no_jobs(self):
        r = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True,
                           text=True, timeout=10)
        return r.returncode != 0 or not r.stdout.strip()

    def logs(self):
        out = []
        for name in sorted(os.listdir(self.dir)) if os.path.isdir(self.dir) else []:
            if name.endswith(".log"):
                with open(os.path.join(self.dir, name), errors="replace") as f:
                    out.append(f"--- {name}\n" + f.read()[-3000:])
        return "\n".join(out)

    # -- running jobs ------------------------------------------------------------------------
    def run(self, argv, timeout=120, env=None):
        full = dict(self.env)
        if env:
            full.update(env)
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=full,
                              cwd=harness.REPO, stdin=subprocess.DEVNULL)
