"""The kubelet's API on its node: what the API server calls for `kubectl logs`, and so for every client
that reads pod logs through it (the Kubeflow SDK's `TrainerClient.get_job_logs` among them), and for
`kubectl exec` (kubelet_exec.py) and `kubectl port-forward` (kubelet_portforward.py).

    GET /containerLogs/NAMESPACE/POD/CONTAINER?follow=&previous=&tailLines=&limitBytes=
    GET /exec/NAMESPACE/POD/CONTAINER?command=…   (a WebSocket)
    POST /portForward/NAMESPACE/POD               (SPDY/3.1)

The API server finds a node's API at the address type it prefers (--kubelet-preferred-address-types:
InternalIP, since no resolver knows the node's hostname) and the port in the Node's
status.daemonEndpoints, over TLS: this server presents a certificate of the dev cluster's CA for
127.0.0.1 and answers only the API server's client certificate (certs.KUBELET_CLIENT). A real kubelet
authorizes each caller with a SubjectAccessReview instead; with the API server as the only caller
allowed, there is nothing to review.

A container's log file holds all its starts (podrunner.Container.log_starts); an answer is the last
start's output, or the one before with `previous`. No time is kept per line, so `timestamps`,
`sinceSeconds` and `sinceTime` are refused with a message that says so, not answered wrongly.
"""
from __future__ import annotations

import logging
import re
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qs, urlsplit

from kubetune_dev import kubelet_exec, kubelet_portforward, spdy, websocket
from kubetune_dev.certs import KUBELET_CLIENT
from kubetune_dev.podrunner import PodRunner

log = logging.getLogger("kubelet.api")
LOGS_PATH = re.compile(r"^/containerLogs/([^/]+)/([^/]+)/([^/]+)$")
EXEC_PATH = re.compile(r"^/exec/([^/]+)/([^/]+)/([^/]+)$")
PORT_FORWARD_PATH = re.compile(r"^/portForward/([^/]+)/([^/]+)$")
UNSUPPORTED = ("timestamps", "sinceSeconds", "sinceTime")
FOLLOW_POLL_S = 0.2
CHUNK = 64 * 1024


class Refused(Exception):
    """An answer other than the log: the HTTP status and the message the API server passes on."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class LogRequest:
    """One `containerLogs` call, checked: which container, which of its starts, and how much."""

    def __init__(self, runner: PodRunner, pod: str, name: str, query: dict[str, list[str]]):
        if asked := [option for option in UNSUPPORTED if query.get(option, ["false"])[0] not in ("", "false")]:
            raise Refused(400, f"{', '.join(asked)}: the dev cluster's kubelet keeps no time per log line; "
                               "ask without it (kubectl logs without --timestamps, --since or --since-time)")
        self.container = runner.container(name)
        if self.container is None:
            raise Refused(404, f'container "{name}" is not valid for pod "{pod}"')
        self.file: Path = runner.log_file(name)
        self.follow = _flag(query, "follow")
        self.tail_lines = _count(query, "tailLines")
        self.limit_bytes = _count(query, "limitBytes")
        starts = self.container.log_starts
        if _flag(query, "previous"):
            if len(starts) < 2:
                raise Refused(400, f'previous terminated container "{name}" in pod "{pod}" not found')
            self.begin, self.end = starts[-2][1], starts[-1][0]
            self.follow = False  # a terminated start's output no longer grows
        elif not starts:
            waiting = (self.container.state or {}).get("waiting") or {}
            raise Refused(400, f'container "{name}" in pod "{pod}" is waiting to start: '
                               f'{waiting.get("reason", "ContainerCreating")}')
        else:
            self.begin, self.end = starts[-1][1], None
        self.start_count = len(starts)

    def still_running(self) -> bool:
        """The start being followed has not ended (the container neither exited nor started again)."""
        return self.container.proc is not None and len(self.container.log_starts) == self.start_count

    def initial(self) -> tuple[bytes, int]:
        """What exists of the chosen start's output now, cut to tailLines, and the file offset after it
        (where following goes on)."""
        with open(self.file, "rb") as f:
            f.seek(self.begin)
            data = f.read() if self.end is None else f.read(self.end - self.begin)
        position = self.begin + len(data)
        if self.tail_lines is not None:
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[max(0, len(lines) - self.tail_lines):] if self.tail_lines else [])
        return data, position


def _flag(query: dict[str, list[str]], name: str) -> bool:
    return query.get(name, ["false"])[0] in ("true", "1")


def _count(query: dict[str, list[str]], name: str) -> int | None:
    if name not in query:
        return None
    value = query[name][0]
    if not value.isdigit():
        raise Refused(400, f"{name}={value!r}: a whole number of 0 or more is expected")
    return int(value)


class Handler(BaseHTTPRequestHandler):
    # HTTP/1.0: a followed log is a body that ends when the connection closes, as the kubelet streams it.
    protocol_version = "HTTP/1.0"
    server: "KubeletAPI"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        try:
            self._check_caller()
            url = urlsplit(self.path)
            if PORT_FORWARD_PATH.match(url.path):
                self.do_POST()
                return
            query = parse_qs(url.query, keep_blank_values=True)
            match = LOGS_PATH.match(url.path) or EXEC_PATH.match(url.path)
            if match is None:
                raise Refused(404, f"{url.path}: the dev cluster's kubelet serves /containerLogs/, /exec/ and "
                                   "/portForward/ only")
            namespace, pod, container = match.groups()
            runner = self.server.find_pod(namespace, pod)
            if runner is None:
                raise Refused(404, f'pod "{pod}" in namespace "{namespace}" is not on this node')
            if match.re is EXEC_PATH:
                self._exec(runner, pod, container, query)
                return
            request = LogRequest(runner, pod, container, query)
        except Refused as e:
            self._send_text(e.status, str(e))
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        try:
            self._stream(request)
        except (BrokenPipeError, ConnectionResetError):  # the client stopped following
            pass

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        """`kubectl port-forward`: the SPDY upgrade, then the forwarded streams (kubelet_portforward.py). (The
        API server may ask with GET or POST, depending on how kubectl reached it.)"""
        try:
            self._check_caller()
            match = PORT_FORWARD_PATH.match(urlsplit(self.path).path)
            if match is None:
                raise Refused(404, f"{self.path}: the dev cluster's kubelet takes POST on /portForward/ only")
            namespace, pod = match.groups()
            runner = self.server.find_pod(namespace, pod)
            if runner is None or runner.finished:
                raise Refused(404, f'pod "{pod}" in namespace "{namespace}" is not running on this node')
            offered = [v.strip() for v in ",".join(self.headers.get_all("X-Stream-Protocol-Version") or []).split(",")]
            if self.headers.get("Upgrade", "").lower() != "spdy/3.1" or kubelet_portforward.PROTOCOL not in offered:
                raise Refused(400, f"port-forward needs an SPDY/3.1 upgrade speaking {kubelet_portforward.PROTOCOL}")
        except Refused as e:
            self._send_text(e.status, str(e))
            return
        self.wfile.write(("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
                          f"X-Stream-Protocol-Version: {kubelet_portforward.PROTOCOL}\r\n\r\n").encode())
        self.wfile.flush()
        kubelet_portforward.serve(spdy.Session(self.rfile, self.wfile), pod, runner.ip)

    def _exec(self, runner: PodRunner, pod: str, name: str, query: dict[str, list[str]]) -> None:
        """`kubectl exec`: the WebSocket handshake, then the command's streams (kubelet_exec.py)."""
        container = runner.container(name)
        if container is None:
            raise Refused(404, f'container "{name}" is not valid for pod "{pod}"')
        if self.headers.get("Upgrade", "").lower() != "websocket" or not self.headers.get("Sec-WebSocket-Key"):
            raise Refused(400, "exec needs a WebSocket upgrade (the API server passes kubectl's on)")
        try:
            chosen = kubelet_exec.protocol(self.headers.get("Sec-WebSocket-Protocol", ""))
            command = kubelet_exec.command_line(container, pod, name, query)
        except kubelet_exec.ExecRefused as e:
            raise Refused(e.status, str(e)) from None
        accept = websocket.accept_key(self.headers["Sec-WebSocket-Key"])
        self.wfile.write(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                          f"Sec-WebSocket-Accept: {accept}\r\nSec-WebSocket-Protocol: {chosen}\r\n\r\n").encode())
        self.wfile.flush()
        kubelet_exec.run(websocket.WebSocket(self.rfile, self.wfile), chosen, command)

    def _check_caller(self) -> None:
        certificate = self.connection.getpeercert() or {}
        names = [value for part in certificate.get("subject", ()) for key, value in part if key == "commonName"]
        if names != [KUBELET_CLIENT]:
            raise Refused(403, f"only the API server ({KUBELET_CLIENT}) may call this kubelet")

    def _stream(self, request: LogRequest) -> None:
        budget = request.limit_bytes
        data, position = request.initial()
        if not self._write(data, budget):
            return
        budget = None if budget is None else budget - len(data)
        if not request.follow:
            return
        with open(request.file, "rb") as f:
            while not self.server.stopped.is_set():
                running = request.still_running()
                f.seek(position)
                chunk = f.read(CHUNK)
                if chunk:
                    position += len(chunk)
                    if not self._write(chunk, budget):
                        return
                    budget = None if budget is None else budget - len(chunk)
                elif not running:  # ended, and everything it wrote was sent
                    return
                else:
                    time.sleep(FOLLOW_POLL_S)

    def _write(self, data: bytes, budget: int | None) -> bool:
        """Send DATA within the limitBytes left; False once the limit is reached."""
        if budget is not None and len(data) >= budget:
            self.wfile.write(data[:budget])
            return False
        self.wfile.write(data)
        self.wfile.flush()
        return True

    def _send_text(self, status: int, message: str) -> None:
        body = message.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
        log.debug("%s " + format, self.address_string(), *args)


class KubeletAPI(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, pki: Path, find_pod: Callable[[str, str], PodRunner | None]):
        super().__init__(("127.0.0.1", port), Handler)
        self.find_pod = find_pod
        self.stopped = threading.Event()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki / "kubelet-serving.crt", pki / "kubelet-serving.key")
        context.load_verify_locations(pki / "ca.crt")
        context.verify_mode = ssl.CERT_REQUIRED  # no certificate of our CA, no answer
        # The handshake happens in each request's thread, so one slow caller holds up no other.
        self.socket = context.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def handle_error(self, request, client_address) -> None:
        # A caller refused in the TLS handshake (no certificate of our CA) is one line, not a traceback.
        log.info("request from %s failed", client_address, exc_info=log.isEnabledFor(logging.DEBUG))

    def start(self) -> None:
        threading.Thread(target=self.serve_forever, args=(0.1,), name="kubelet-api", daemon=True).start()

    def close(self) -> None:
        self.stopped.set()
        self.shutdown()
        self.server_close()
