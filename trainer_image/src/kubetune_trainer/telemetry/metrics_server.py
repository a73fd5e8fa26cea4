"""The main process's /metrics endpoint, which also knows when the operator last read it.

The operator polls rank 0's gauges every few seconds for status.progress and status.validation.
A run that ends between two polls would take its last step, loss and validation with it: a short
sweep trial then had no reading at all and was recorded failed, and a sweep ranked trials by an
earlier validation than their last. So at the end the run waits, a bounded time, for one read by
the operator that began after its final values were set. The operator marks its reads with
contract.OPERATOR_READ_QUERY; Prometheus' scrapes do not count.
"""
from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from kubetune_api.contract import OPERATOR_READ_QUERY


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args) -> None:
        pass  # a line per scrape would drown the training log


def _server_class(addr: str, port: int) -> type:
    """A threading WSGI server of the address family ADDR resolves to (a pod IP may be IPv6)."""
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
    return type("MetricsHTTPServer", (ThreadingMixIn, WSGIServer), {"address_family": family, "daemon_threads": True})


class _Sent:
    """A response body that calls `sent` once the server has written it (WSGI servers call close()
    after the last byte), so the run does not exit with its final reading still unsent."""

    def __init__(self, body, sent):
        self.body, self.sent = body, sent

    def __iter__(self):
        return iter(self.body)

    def close(self) -> None:
        self.sent()


class MetricsServer:
    def __init__(self, registry, port: int, addr: str):
        from prometheus_client import make_wsgi_app

        self._app = make_wsgi_app(registry)
        self._reads = threading.Condition()
        self._started = 0    # operator reads begun so far, numbered from 1
        self._answered = 0   # the highest number among those answered
        self.httpd = make_server(addr, port, self._serve, _server_class(addr, port), handler_class=_QuietHandler)
        threading.Thread(target=self.httpd.serve_forever, name="metrics-server", daemon=True).start()

    def _serve(self, environ, start_response):
        if OPERATOR_READ_QUERY not in environ.get("QUERY_STRING", "").split("&"):
            return self._app(environ, start_response)
        with self._reads:
            self._started += 1
            number = self._started
        body = self._app(environ, start_response)  # the gauges are read here, into the body
        return _Sent(body, lambda: self._answer(number))

    def _answer(self, number: int) -> None:
        with self._reads:
            self._answered = max(self._answered, number)
            self._reads.notify_all()

    @property
    def port(self) -> int:
        return self.httpd.server_port

    def wait_for_operator_read(self, timeout: float) -> bool:
        """True once a read by the operator that began after this call has been answered (so it
        carries every value set before the call); False if none came within TIMEOUT seconds."""
        with self._reads:
            before = self._started
            return self._reads.wait_for(lambda: self._answered > before, timeout)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
