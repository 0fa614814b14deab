"""Strangers at a real `launch` hosting the rendezvous (issue 27 item 3, review findings F3 and F6):
connections from no agent, speaking the protocol well enough to cost something. The hosting agent
must stay small, say what it closed, and still admit the real node and finish the job."""

import hashlib
import hmac
import os
import socket
import struct
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import harness  # noqa: E402
from multinode_test import Node  # noqa: E402

MAGIC = b"LRDZ"
HELLO, WELCOME, JOIN = 2, 3, 4


def frame(msg_type, fields, length=None):
    payload = struct.pack(">H", len(fields))
    for key in sorted(fields):
        value = fields[key]
        payload += struct.pack(">B", len(key)) + key.encode() + struct.pack(">I", len(value)) + value
    n = len(payload) if length is None else length
    return MAGIC + struct.pack(">HHI", 1, msg_type, n) + payload


def read_frame(sock):
    """(type, fields) of the next frame on a blocking socket."""
    def exactly(n):
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data
    _, _, msg_type, length = struct.unpack(">4sHHI", exactly(12))
    body = exactly(length)
    count, pos, fields = struct.unpack(">H", body[:2])[0], 2, {}
    for _ in range(count):
        klen = body[pos]
        key = body[pos + 1:pos + 1 + klen].decode()
        pos += 1 + klen
        (vlen,) = struct.unpack(">I", body[pos:pos + 4])
        fields[key] = body[pos + 4:pos + 4 + vlen]
        pos += 4 + vlen
    return msg_type, fields


def proof(token, label, first, second):
    """auth.cc ComputeProof: HMAC-SHA256(token, label \\0 len(first) first len(second) second)."""
    message = label + b"\0" + struct.pack(">I", len(first)) + first + struct.pack(">I", len(second)) + second
    return hmac.new(token, message, hashlib.sha256).digest()


def authenticate_without_token(port):
    """A stranger that authenticates with the empty token, which a token-less server accepts."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    _, challenge = read_frame(sock)
    nonce = os.urandom(32)
    sock.sendall(frame(HELLO, {"nonce": nonce,
                               "proof": proof(b"", b"launch-rdzv-agent", challenge["nonce"], nonce)}))
    msg_type, _ = read_frame(sock)
    assert msg_type == WELCOME, msg_type
    return sock


def vm_rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class StrangersTest(unittest.TestCase):
    def setUp(self):
        self.tmp = harness.tmpdir()
        self.port = harness.free_port()
        self.marker = harness.unique_marker("strangers")
        self.nodes = []
        self.sockets = []

    def tearDown(self):
        for s in self.sockets:
            s.close()
        for n in self.nodes:
            n.kill()

    def start(self, index, rank):
        n = Node(index, self.port, 2, rank=rank, marker=self.marker, tmp=self.tmp,
                 extra=["--rdzv_conf", "join_timeout=60"])
        self.nodes.append(n)
        return n

    def wait_for_host(self, node):
        ok = harness.wait_until(lambda: "hosting the rendezvous" in node.output(), 15)
        self.assertTrue(ok, node.output())

    def test_token_less_64_mib_frames_from_24_connections_leave_the_host_small(self):
        # F3: each stranger authenticates with the empty token and announces a 64 MiB JOIN, then
        # streams it. The host used to buffer every byte (11 MB -> 1.6 GB in 3 s, nothing logged).
        host = self.start(0, 0)
        self.wait_for_host(host)
        time.sleep(0.3)
        before = vm_rss_kb(host.proc.pid)
        chunk = b"x" * (1 << 20)
        sent = []

        def stream():
            try:
                sock = authenticate_without_token(self.port)
                self.sockets.append(sock)
                sock.sendall(frame(JOIN, {}, length=(64 << 20) + 32)[:12])
                for _ in range(63):
                    sock.sendall(chunk)
                    sent.append(len(chunk))
            except OSError:
                pass  # closed by the host: what we want

        threads = [threading.Thread(target=stream) for _ in range(24)]
        for t in threads:
            t.start()
        peak = before
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            peak = max(peak, vm_rss_kb(host.proc.pid))
            time.sleep(0.02)
        for t in threads:
            t.join(30)
        peak = max(peak, vm_rss_kb(host.proc.pid))
        print(f"\nhost VmRSS {before} kB before, {peak} kB at most during 24 x 64 MiB "
              f"({sum(sent) >> 20} MiB sent in all)", file=sys.stderr)
        self.assertLess(peak - before, 32 << 10, "the host buffered what strangers sent")
        # The job still forms and completes; the host said what it closed, with the address.
        node = self.start(1, 1)
        self.assertEqual([n.wait(60) for n in (host, node)], [0, 0], host.output() + node.output())
        out = host.output()
        self.assertIn("closed the connection from 127.0.0.1 before it joined", out)
        self.assertIn("a JOIN frame of 67108896 bytes", out)
        self.assertLess(out.count("before it joined"), 24)  # rate-limited

    def test_600_slow_handshakes_do_not_stop_a_healthy_agent(self):
        # F6: 600 loopback connections that send one header byte a second fill every handshake
        # slot and the queue behind them. The real node used to hit its own handshake deadline
        # and exit 2 ("not a launch rendezvous server").
        host = self.start(0, 0)
        self.wait_for_host(host)
        for _ in range(600):
            s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            s.setblocking(False)
            self.sockets.append(s)
        stop = threading.Event()

        def dribble():
            i = 0
            while not stop.is_set():
                for s in self.sockets:
                    try:
                        s.send(MAGIC[i % 4:i % 4 + 1])
                    except OSError:
                        pass
                i += 1
                stop.wait(1)

        dribbler = threading.Thread(target=dribble)
        dribbler.start()
        try:
            time.sleep(0.5)
            node = self.start(1, 1)  # from 127.0.0.2
            started = time.monotonic()
            rcs = [n.wait(60) for n in (node, host)]
            took = time.monotonic() - started
        finally:
            stop.set()
            dribbler.join()
        print(f"\nnode 1 joined and the job finished {took:.1f} s after it started, beside 600 "
              "slow handshakes", file=sys.stderr)
        self.assertEqual(rcs, [0, 0], node.output() + host.output())
        self.assertNotIn("not a launch rendezvous server", node.output())
        self.assertIn("before it joined", host.output())


if __name__ == "__main__":
    unittest.main()
