"""Helpers for the CLI tests: which binary runs `launch config` / `launch env`, and a small
pseudo-terminal driver for the wizard."""

import os
import pty
import re
import select
import signal
import subprocess
import time

import harness

DRIVER = os.path.join(harness.BIN_DIR, "launch-cli-driver")
_ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


def cli_command(subcommand):
    """argv prefix for `launch SUBCOMMAND`: the real `launch` when it dispatches the subcommand,
    else the test driver that calls the same entry point. None when neither is built."""
    if os.path.exists(harness.LAUNCH):
        probe = subprocess.run([harness.LAUNCH, subcommand, "--help"], capture_output=True,
                               text=True, timeout=30, stdin=subprocess.DEVNULL)
        if probe.returncode == 0 and f"launch {subcommand}" in probe.stdout:
            return [harness.LAUNCH, subcommand]
    if os.path.exists(DRIVER):
        return [DRIVER, subcommand]
    return None


class PtySession:
    """Runs argv on a fresh pseudo-terminal; expect() waits for text (ANSI codes stripped)."""

    def __init__(self, argv, env=None, cwd=None):
        full_env = dict(os.environ)
        full_env.update({"TERM": "xterm"})
        if env:
            full_env.update(env)
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child
            try:
                if cwd:
                    os.chdir(cwd)
                os.execvpe(argv[0], argv, full_env)
            finally:
                os._exit(127)
        self.raw = b""
        self.seen = 0  # expect() searches after the previous match
        self.status = None

    def _read(self, timeout):
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child side closed
            return None
        if not data:
            return None
        self.raw += data
        return True

    def text(self):
        return _ANSI.sub(b"", self.raw).decode("utf-8", "replace")

    def expect(self, needle, timeout=10):
        deadline = time.monotonic() + timeout
        while True:
            t = self.text()
            pos = t.find(needle, self.seen)
            if pos >= 0:
                self.seen = pos + len(needle)
                return t
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {needle!r}; screen so far:\n{t}")
            if self._read(min(left, 0.2)) is None:
                t = self.text()
                if t.find(needle, self.seen) >= 0:
                    continue
                raise AssertionError(f"program ended before {needle!r}; output:\n{t}")

    def send(self, keys):
        os.write(self.fd, keys.encode() if isinstance(keys, str) else keys)

    def wait(self, timeout=10):
        """Drains output until the child exits; returns its exit code (or -signal)."""
        deadline = time.monotonic() + timeout
        while self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = status
                break
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError("the program did not exit; output:\n" + self.text())
            self._read(0.05)
        while self._read(0.05):
            pass
        return os.waitstatus_to_exitcode(self.status)

    def kill(self):
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                _, self.status = os.waitpid(self.pid, 0)
            except ProcessLookupError:
                pass

    def close(self):
        self.kill()
        try:
            os.close(self.fd)
        except OSError:
            pass
