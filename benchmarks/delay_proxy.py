"""A TCP proxy on loopback that adds a fixed delay to every request passing through it: the local S3
server answering as an object store across a network does (first-byte latency per request).

    proxy = DelayProxy("127.0.0.1", server_port, delay_s=0.040); proxy.start(); ... proxy.port
    proxy = delay_s3(settings, 40)   # the same in front of start_versitygw's server, for this process's S3 clients

A connection's bytes from the client are held `delay_s` each time the client starts speaking after
the server has (or at first): once per HTTP request on a kept-alive connection, whatever the body
size, so a request's cost is the delay plus what the server takes. Responses pass unhindered.
"""
from __future__ import annotations

import os
import socket
import threading
import time


class DelayProxy:
    def __init__(self, host: str, port: int, delay_s: float):
        self.upstream, self.delay_s = (host, port), delay_s
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(256)
        self.port = self.listener.getsockname()[1]
        self.requests = 0

    def start(self) -> None:
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(self.upstream)
            turn = {"client": True}  # the client speaks next: its next bytes start a request
            threading.Thread(target=self._pump, args=(client, server, turn, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, turn, False), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, turn: dict, from_client: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if from_client and turn["client"]:
                    turn["client"] = False
                    self.requests += 1
                    time.sleep(self.delay_s)
                elif not from_client:
                    turn["client"] = True
                target.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, target):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def delay_s3(settings: dict, delay_ms: float) -> DelayProxy:
    """A proxy holding each request DELAY_MS in front of the S3 server of SETTINGS (start_versitygw's),
    which this process's S3 clients, and the processes it starts, reach from now on."""
    proxy = DelayProxy("127.0.0.1", int(settings["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]), delay_ms / 1000)
    proxy.start()
    os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{proxy.port}"
    print(f"every S3 request from now on {delay_ms:.0f} ms later (a delaying proxy on loopback)")
    return proxy
