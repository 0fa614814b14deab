"""A second "host" for network tests: a network namespace joined to this one by a veth pair, and
ways to cut that link and restore it. Everything created is removed by the test's cleanups
(deleting the namespace deletes its end of the pair, and with it the other end)."""

import os
import subprocess

import harness


class Link:
    """The veth pair between this namespace (HOST_DEV, address HOST) and namespace NS (PEER_DEV,
    address PEER)."""

    def __init__(self, ns, host_dev, peer_dev, host, peer):
        self.ns, self.host_dev, self.peer_dev, self.host, self.peer = (
            ns, host_dev, peer_dev, host, peer)
        self.cut_kind = None

    def _run(self, *cmd):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        return r.returncode == 0, r.stderr

    def can_blackhole(self):
        """Whether this kernel has the blackhole qdisc (it drops everything sent, link up)."""
        ok, _ = self._run("tc", "qdisc", "replace", "dev", self.host_dev, "root", "blackhole")
        if ok:
            self._run("tc", "qdisc", "del", "dev", self.host_dev, "root")
        return ok

    def cut(self, kind):
        """"blackhole": every packet both ways is dropped, the link stays up (100% loss, as
        `tc netem loss 100%` where netem exists). "down": the namespace's end goes down (a
        pulled cable: the host's end loses its carrier)."""
        assert self.cut_kind is None
        if kind == "blackhole":
            cmds = [("tc", "qdisc", "replace", "dev", self.host_dev, "root", "blackhole"),
                    ("tc", "-n", self.ns, "qdisc", "replace", "dev", self.peer_dev, "root",
                     "blackhole")]
        else:
            cmds = [("ip", "-n", self.ns, "link", "set", self.peer_dev, "down")]
        for cmd in cmds:
            ok, err = self._run(*cmd)
            assert ok, f"{' '.join(cmd)}: {err}"
        self.cut_kind = kind

    def restore(self):
        if self.cut_kind == "blackhole":
            self._run("tc", "qdisc", "del", "dev", self.host_dev, "root")
            self._run("tc", "-n", self.ns, "qdisc", "del", "dev", self.peer_dev, "root")
        elif self.cut_kind == "down":
            self._run("ip", "-n", self.ns, "link", "set", self.peer_dev, "up")
        self.cut_kind = None


def make_netns(test, tag):
    """A namespace with its own stack joined to this one by a veth pair; returns its Link.
    Skips `test` when this machine does not allow creating one (no CAP_NET_ADMIN). The
    namespace (and so the pair) is deleted by the test's cleanups, after restoring the link."""
    tag = f"{os.getpid() % 10000}{tag}"
    ns, here, there = f"lt{tag}", f"lth{tag}", f"ltn{tag}"
    net = f"10.213.{os.getpid() % 250}"
    if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode != 0:
        test.skipTest(harness.env_dependent("cannot create a network namespace here"))
    test.addCleanup(subprocess.run, ["ip", "link", "del", here], capture_output=True)
    test.addCleanup(subprocess.run, ["ip", "netns", "del", ns], capture_output=True)
    for cmd in (["ip", "link", "add", here, "type", "veth", "peer", "name", there],
                ["ip", "link", "set", there, "netns", ns],
                ["ip", "addr", "add", f"{net}.1/24", "dev", here],
                ["ip", "link", "set", here, "up"],
                ["ip", "-n", ns, "addr", "add", f"{net}.2/24", "dev", there],
                ["ip", "-n", ns, "link", "set", there, "up"],
                ["ip", "-n", ns, "link", "set", "lo", "up"]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            test.skipTest(harness.env_dependent(
                f"cannot set up the namespace's link ({' '.join(cmd)}): {r.stderr}"))
    link = Link(ns, here, there, f"{net}.1", f"{net}.2")
    test.addCleanup(link.restore)
    return link
