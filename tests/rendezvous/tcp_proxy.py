"""A small TCP proxy for network-fault tests: agents connect to it, it connects to the real
rendezvous endpoint, and the test decides what gets through.

Modes, switchable at any time (they apply to bytes not yet forwarded):
  "pass"       forward both ways
  "partition"  forward nothing, keep every connection open (a cable pulled, a frozen switch)
  "half-open"  forward agent -> server only; the server's frames vanish (an asymmetric fault)
A delay adds latency to every chunk in both directions (a slow or congested link).
Every thread is a daemon and every socket has a timeout, so a test can never hang on it.
"""
import socket
import threading
import time


class TcpProxy:
    def __init__(self, listen_host, target_host, target_port):
        self.target = (target_host, target_port)
        self.mode = "pass"
        self.delay = 0.0
        self._lock = threading.Lock()
        self._sockets = []
        self._closed = False
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((listen_host, 0))
        self._listener.listen(64)
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self):
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=2)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "down"), daemon=True).start()

    def _blocked(self, direction):
        return self.mode == "partition" or (self.mode == "half-open" and direction == "down")

    def _pump(self, src, dst, direction):
        src.settimeout(0.2)
        while not self._closed:
            try:
                data = src.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                break
            if not data:
                break
            if self.delay:
                time.sleep(self.delay)
            # A blocked direction swallows what arrives (the peer's TCP still acknowledges it:
            # as with a fault beyond the first hop, only the other end's silence tells).
            if self._blocked(direction):
                continue
            try:
                dst.sendall(data)
            except OSError:
                break
        # One side closed: close the other, as a router would pass the FIN or RST on; unless the
        # link is cut, in which case nothing passes and the sockets stay open.
        if not self._blocked(direction):
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self._closed = True
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                try:
                    s.close()
                except OSError:
                    pass
