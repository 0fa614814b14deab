"""Test hosts: each one a network + UTS + pid + mount namespace (its own addresses, hostname,
process tree and /proc), all joined by a bridge in this namespace, as machines on one switch.

    hosts = make_hosts(self, 2)              # skips the test where namespaces cannot be made
    p = hosts[0].popen(["launch", ...])      # runs inside host 0
    hosts[1].limit("200mbit")                # tbf on host 1's link (this kernel has no netem)

Loopback stand-ins (127.0.0.2, .3) share one kernel's stack and hostname and hide real-network
bugs; these hosts do not: a hostname resolves to nothing (or, with etc_hosts="debian", to
127.0.1.1 as Debian's installer writes it), and only the bridge connects them. Each host's
processes die with it: its first process is the pid namespace's init, and the kernel kills
everything in a pid namespace when its init ends. The test's cleanups end every host and
delete the bridge; every wait is bounded.

This namespace gets the bridge's address (.254), so the test itself can reach every host."""

import os
import socket
import subprocess
import tempfile
import time

import harness

_counter = [0]


class Host:
    """One test host: `name` (its hostname and interface prefix), `addr` (its address on the
    bridge, on interface `dev` = eth0 inside)."""

    def __init__(self, name, addr, holder, init_pid):
        self.name, self.addr, self.dev = name, addr, "eth0"
        self._holder = holder  # `unshare`, whose death (SIGKILL) takes init and so the host
        self.init_pid = init_pid  # the host's init, as this namespace numbers it

    def argv(self, argv, cwd=None):
        """`argv` wrapped to run inside this host (nsenter forks so that it joins the pid
        namespace), in `cwd` (nsenter's --mount would otherwise start it in /). --root keeps the
        host's root directory: entering a mount namespace resets it to the namespace's own
        root, which inside a chroot (scripts/debian13) is the machine's, not the chroot's."""
        return ["nsenter", "-t", str(self.init_pid), "--net", "--uts", "--pid", "--mount", "--root",
                *([f"--wd={cwd}"] if cwd else []), "--", *argv]

    def popen(self, argv, cwd=None, **kwargs):
        return subprocess.Popen(self.argv(argv, cwd), **kwargs)

    def run(self, argv, timeout=60, cwd=None, **kwargs):
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.argv(argv, cwd), timeout=timeout, **kwargs)

    def limit(self, rate, burst="64kb", latency="50ms"):
        """Shapes what this host sends to `rate` (tc tbf, e.g. "200mbit"); None removes it."""
        if rate is None:
            self.run(["tc", "qdisc", "del", "dev", self.dev, "root"])
            return
        r = self.run(["tc", "qdisc", "replace", "dev", self.dev, "root", "tbf", "rate", rate,
                      "burst", burst, "latency", latency])
        assert r.returncode == 0, f"tc tbf on {self.name}: {r.stderr}"

    def tx_bytes(self):
        """Bytes this host has sent over its link (its eth0's counter). From /proc/net/dev, which
        shows the reader's network namespace; /sys inside the host is still the sysfs mounted
        for this machine's namespace (its eth0, or none)."""
        r = self.run(["cat", "/proc/net/dev"])
        assert r.returncode == 0, r.stderr
        for line in r.stdout.splitlines():
            name, _, counters = line.partition(":")
            if name.strip() == self.dev:
                return int(counters.split()[8])  # 8 receive counters, then tx bytes
        raise AssertionError(f"{self.name}: no {self.dev} in /proc/net/dev:\n{r.stdout}")

    def alive(self):
        return self._holder.poll() is None

    def stop(self):
        """Ends the host and every process in it (SIGKILL). Idempotent."""
        if self._holder.poll() is None:
            self._holder.kill()
        try:
            self._holder.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self._holder.stderr:
            self._holder.stderr.close()
        # init gets SIGKILL from unshare's death (PR_SET_PDEATHSIG); wait until it is gone so
        # that the namespace's processes are too.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{self.init_pid}"):
            time.sleep(0.02)


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _ip(*args):
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    return r.returncode == 0, r.stderr


def _claim_subnet(test):
    """X for a 10.215.X.0/24 (and the bridge's name) that no other test process uses now, X from
    0 to 249: held by an abstract unix socket named after X (per network namespace, so seen from
    the Debian 13 root too, and released by the kernel when this process dies, whatever kills
    it) until `test` ends."""
    first = os.getpid() * 7 + _counter[0]
    for k in range(250):
        x = (first + k) % 250
        claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            claim.bind(f"\0launch-test-net-{x}")
        except OSError:
            claim.close()
            continue
        test.addCleanup(claim.close)
        return x
    raise AssertionError("all 250 test subnets are in use")


def make_hosts(test, n, etc_hosts=None, tag=None, private_shm=False):
    """`n` hosts on one bridge, 10.215.X.1 .. .n (X claimed for the test, so tests running side
    by side do not collide). `etc_hosts`: None keeps this machine's /etc/hosts
    (the hosts' names resolve to nothing); "debian" gives each host Debian's default, which maps
    its own hostname to 127.0.1.1. `private_shm`: each host gets its own /dev/shm (a tmpfs that
    goes with the host, as a machine's does; see it with host.run(["ls", "/dev/shm"])); else
    they share this machine's. Skips `test` when namespaces cannot be created (not root).
    Everything is removed by `test`'s cleanups."""
    _counter[0] += 1
    x = _claim_subnet(test)
    tag = tag or f"{x}x{_counter[0]}"
    net = f"10.215.{x}"
    bridge = f"lb{tag}"[:15]
    ok, err = _ip("link", "add", bridge, "type", "bridge")
    if not ok:
        test.skipTest(harness.env_dependent(f"cannot create a bridge here: {err.strip()}"))
    test.addCleanup(_ip, "link", "del", bridge)
    for args in (("addr", "add", f"{net}.254/24", "dev", bridge), ("link", "set", bridge, "up")):
        ok, err = _ip(*args)
        assert ok, f"ip {' '.join(args)}: {err}"
    hosts = []
    for i in range(n):
        name = f"h{i}{tag}"[:15]
        hosts_file = None
        if etc_hosts == "debian":
            fd, hosts_file = tempfile.mkstemp(prefix="launch-test-hosts-")
            with os.fdopen(fd, "w") as f:
                f.write(f"127.0.0.1\tlocalhost\n127.0.1.1\t{name}\n")
            test.addCleanup(os.unlink, hosts_file)
        script = f"hostname {name}"
        if hosts_file:
            script += f" && mount --bind {hosts_file} /etc/hosts"
        if private_shm:
            script += " && mount -t tmpfs -o mode=1777 tmpfs /dev/shm"
        script += " && exec sleep infinity"
        holder = subprocess.Popen(
            ["unshare", "--net", "--uts", "--pid", "--fork", "--mount-proc", "--kill-child",
             "--", "/bin/sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        init_pid = None
        while time.monotonic() < deadline and holder.poll() is None:
            kids = _children(holder.pid)
            if kids:
                init_pid = kids[0]
                break
            time.sleep(0.01)
        if init_pid is None:
            holder.kill()
            err = holder.communicate(timeout=10)[1].decode(errors="replace").strip()
            test.skipTest(harness.env_dependent(
                f"cannot create a test host here: {err or 'unshare did not start'}"))
        host = Host(name, f"{net}.{i + 1}", holder, init_pid)
        test.addCleanup(host.stop)
        # Wait for init's sleep (hostname set, /etc/hosts bound), then plug it into the bridge.
        while time.monotonic() < deadline:
            r = host.run(["hostname"], timeout=10)
            if r.returncode == 0 and r.stdout.strip() == name:
                break
            time.sleep(0.02)
        else:
            test.fail(f"test host {name} did not come up")
        outside = f"v{tag}{i}"[:15]
        for args in (("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns",
                      str(init_pid)),
                     ("link", "set", outside, "master", bridge),
                     ("link", "set", outside, "up")):
            ok, err = _ip(*args)
            assert ok, f"ip {' '.join(args)}: {err}"
        for cmd in (["ip", "link", "set", "lo", "up"],
                    ["ip", "addr", "add", f"{host.addr}/24", "dev", "eth0"],
                    ["ip", "link", "set", "eth0", "up"]):
            r = host.run(cmd)
            assert r.returncode == 0, f"{name}: {' '.join(cmd)}: {r.stderr}"
        hosts.append(host)
    # Without STP a bridge port forwards as soon as it is up; wait for that state (3).
    for i in range(n):
        state = f"/sys/class/net/v{tag}{i}"[:len("/sys/class/net/") + 15] + "/brport/state"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(state) as f:
                if f.read().strip() == "3":
                    break
            time.sleep(0.02)
        else:
            test.fail(f"bridge port of test host {hosts[i].name} does not forward")
    return hosts
