"""A TCP forwarder in front of a lab sshd: it counts the connections it accepts (how the tests
prove that a command opened no new SSH connection) and can delay each direction, as a network
would (bench/inspect_overhead.py's 40 ms round trip: 20 ms each way)."""

from __future__ import annotations

import queue
import socket
import threading
import time


class TcpProxy:
    def __init__(self, target: tuple[str, int], address: str = "127.0.0.1", delay: float = 0.0):
        self.target, self.delay = target, delay
        self.listener = socket.create_server((address, 0))
        self.address, self.port = self.listener.getsockname()[:2]
        self.connections = 0
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def known_hosts_line(self, server_line: str) -> str:
        """A lab server's known_hosts line, for the address and port clients dial: the proxy's."""
        _name, kind, key = server_line.split()[:3]
        return f"[{self.address}]:{self.port} {kind} {key}\n"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self.connections += 1
                self._open += [client, upstream]
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = (client, upstream)
            ended = []  # directions done: at two, both sockets go
            for src, dst in ((client, upstream), (upstream, client)):
                self._forward(src, dst, lambda pair=pair, ended=ended: self._ended(ended, pair))

    def _ended(self, ended: list, pair: tuple[socket.socket, socket.socket]) -> None:
        with self._lock:
            ended.append(1)
            if len(ended) < 2:
                return
            for sock in pair:
                if sock in self._open:
                    self._open.remove(sock)
                sock.close()

    def _forward(self, src: socket.socket, dst: socket.socket, done) -> None:
        """src -> dst; with a delay, each chunk leaves `delay` after it arrived (pipelined)."""
        chunks: queue.Queue = queue.Queue()

        def read() -> None:
            while True:
                try:
                    data = src.recv(1 << 16)
                except OSError:
                    data = b""
                chunks.put((time.monotonic() + self.delay, data))
                if not data:
                    return

        def write() -> None:
            try:
                while True:
                    due, data = chunks.get()
                    wait = due - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    if not data:
                        dst.shutdown(socket.SHUT_WR)
                        return
                    dst.sendall(data)
            except OSError:
                return
            finally:
                done()

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            for sock in self._open:
                try:
                    sock.close()
                except OSError:
                    pass
