"""Shared helpers for the multi-process tests: where the binaries are, running them with a
hard timeout, and checking the process table for leftovers."""

import atexit
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time

BIN_DIR = os.environ.get("LAUNCH_BIN_DIR", os.path.join(os.path.dirname(__file__), "..", "build", "bin"))
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
LAUNCH = os.path.join(BIN_DIR, "launch")
TRAIN = os.path.join(BIN_DIR, "train")
SYSTEM_PYTHON = "/usr/bin/python3"

# Every skip says which kind it is, in its reason (tests/run_unittest.py reads it back):
#   needs_setup: a binary, package or data set that scripts/setup builds or installs is missing.
#                scripts/test fails on it: CI that skips such a test has tested nothing.
#   env_dependent: this machine cannot run the test whatever is installed (no CAP_NET_ADMIN, no
#                writable cgroup v2, no GPU, no IPv6). A skip, listed at the end of scripts/test.
#   @unittest.skipUnless(os.path.exists(TRAIN), harness.needs_setup(f"{TRAIN} not built"))
#   self.skipTest(harness.env_dependent("no IPv6 loopback"))
_SETUP_MARK = "[setup] "
_ENV_MARK = "[env] "


def needs_setup(what):
    """The reason of a skip for something scripts/setup provides (see above)."""
    return _SETUP_MARK + what


def env_dependent(why):
    """The reason of a skip for something no install provides (see above)."""
    return _ENV_MARK + why


def skip_kind(reason):
    """(kind, text) of a skip reason: kind is "setup", "env", or "unmarked" when the reason came
    from neither helper (scripts/test treats it as "setup": the skip has to say)."""
    for kind, mark in (("setup", _SETUP_MARK), ("env", _ENV_MARK)):
        if reason.startswith(mark):
            return kind, reason[len(mark):]
    return "unmarked", reason


_made_dirs = []


@atexit.register
def _remove_made_dirs():
    # Every run made thousands of them (checkpoints, data sets: gigabytes of /tmp a day) and
    # none was ever read after its test. LAUNCH_KEEP_TEST_DIRS=1 keeps them for a post-mortem.
    if os.environ.get("LAUNCH_KEEP_TEST_DIRS") == "1":
        return
    for d in _made_dirs:
        shutil.rmtree(d, ignore_errors=True)


# Tests never read the user's ~/.config/launch/default_config.yaml.
_ISOLATED_CONFIG_HOME = tempfile.mkdtemp(prefix="launch-test-xdg-")
_made_dirs.append(_ISOLATED_CONFIG_HOME)
os.environ.setdefault("XDG_CONFIG_HOME", _ISOLATED_CONFIG_HOME)
# ... nor accelerate's (launch falls back to $HF_HOME/accelerate/default_config.yaml).
_made_dirs.append(tempfile.mkdtemp(prefix="launch-test-hf-"))
os.environ.setdefault("HF_HOME", _made_dirs[-1])


def _ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


_ports = random.Random(os.getpid() ^ time.monotonic_ns())


def free_port():
    """A port that is free now and that no outgoing connection can take before the test binds
    it: outside the kernel's ephemeral range. (Binding port 0 returns one from inside that range,
    and any connect() on the machine, a Gloo pair of the previous run say, may be given the same
    port in between: "Address already in use" at the store's bind.)"""
    lo, hi = _ephemeral_range()
    span = (20000, lo) if lo > 21000 else (hi + 1, 65536)
    for _ in range(1000):
        port = _ports.randrange(*span)
        try:
            for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
                with socket.socket(family) as s:
                    s.bind((addr, port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no free port in {span}")


def run(args, timeout=120, env=None, cwd=None, input=None):
    """Runs a command to completion; returns CompletedProcess with text stdout/stderr."""
    full_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)  # None removes the variable
        else:
            full_env[key] = value
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=cwd, input=input)


def launch(*args, timeout=120, env=None, cwd=None):
    return run([LAUNCH, *args], timeout=timeout, env=env, cwd=cwd)


def pids_with_marker(marker):
    """PIDs of live (non-zombie) processes whose command line or environment contains `marker`."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            env = b""
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                pass
            if marker.encode() in cmd or marker.encode() in env:
                found.append(int(pid))
        except (OSError, IndexError):
            continue
    return found


def _state_and_ppid(pid):
    """(state letter, parent pid) of a process from /proc/PID/stat, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid):
    """Whether `pid` is a live (not zombie) process."""
    got = _state_and_ppid(pid)
    return got is not None and got[0] != "Z"


def live_children(pid):
    """The live (not zombie) child processes of `pid`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            got = _state_and_ppid(int(entry))
            if got is not None and got[0] != "Z" and got[1] == pid:
                out.append(int(entry))
    return out


def wait_until(predicate, timeout, interval=0.02):
    """Polls `predicate` until it is true or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


def wait_codes(procs, timeout):
    """Exit codes of `procs`, all waited for within `timeout` seconds together; a process still
    running then is killed and its code is None."""
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append(None)
    return codes


def unique_marker(prefix="launchtest"):
    return f"{prefix}_{os.getpid()}_{time.monotonic_ns()}"


def job_cgroup_name(pid):
    """The name of the job cgroup of a launch with `pid` in this test's pid namespace
    (agent/cgroup.h: launch-<pid>-<pid namespace id>)."""
    ns = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    return f"launch-{pid}-{ns[ns.index('[') + 1:-1]}"


def tmpdir():
    """A fresh directory, removed when the test process exits (unless LAUNCH_KEEP_TEST_DIRS=1)."""
    d = tempfile.mkdtemp(prefix="launch-test-")
    _made_dirs.append(d)
    return d
