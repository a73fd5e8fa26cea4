"""The dev cluster kubelet's API (kubetune_dev.kubelet_api) as the API server calls it for `kubectl logs`
and `kubectl exec`: over TLS with the API server's client certificate, a container's last start or the
one before, tail and byte limits, following until the container ends; exec's channels over a WebSocket;
refusals that say what to do. The e2e suite does both through a real API server with kubectl
(tests/e2e/test_control_plane.py, tests/e2e/test_operator.py)."""
from __future__ import annotations

import http.client
import json
import socket
import ssl
import struct
import threading
import time
import zlib
from pathlib import Path
from urllib.parse import quote

import pytest
import websocket as websocket_client

from kubetune_api.ports import free_listen_port
from kubetune_dev import certs, kubelet_exec, spdy
from kubetune_dev.kubelet_api import KubeletAPI
from kubetune_dev.podrunner import Container


class StandInPod:
    """What the API reads of a pod runner: its containers, their log files, its address, whether it ended."""

    finished = False  # the pod's runner still runs
    ip = "127.0.0.1"

    def __init__(self, directory: Path):
        self.directory = directory
        self.containers = {"main": Container({"name": "main"})}

    def container(self, name: str) -> Container | None:
        return self.containers.get(name)

    def log_file(self, name: str) -> Path:
        return self.directory / f"{name}.log"

    def start(self, output: bytes) -> None:
        """The container starts (again), writing OUTPUT, as PodRunner._launch lays out its log."""
        c, file = self.containers["main"], self.log_file("main")
        with open(file, "ab") as out:
            end = out.tell()
            if c.log_starts:
                out.write(b"--- restart ---\n")
            c.log_starts.append((end, out.tell()))
            out.write(output)
        c.proc = object()  # running

    def write(self, output: bytes) -> None:
        with open(self.log_file("main"), "ab") as out:
            out.write(output)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("pki")
    certs.ensure_pki(directory)
    return directory


@pytest.fixture
def kubelet(pki, tmp_path):
    pod = StandInPod(tmp_path)
    server = KubeletAPI(free_listen_port(), pki, lambda namespace, name: pod if (namespace, name) == ("ns", "p") else None)
    server.start()
    yield server, pod
    server.close()


def get(server: KubeletAPI, pki: Path, path: str, client: str | None = certs.KUBELET_CLIENT) -> tuple[int, bytes]:
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if client:
        context.load_cert_chain(pki / f"{client}.crt", pki / f"{client}.key")
    connection = http.client.HTTPSConnection("127.0.0.1", server.server_port, context=context, timeout=20)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_logs_are_the_last_start_or_the_one_before_cut_to_a_tail_or_a_byte_limit(kubelet, pki):
    server, pod = kubelet
    pod.start(b"first 1\nfirst 2\n")
    assert get(server, pki, "/containerLogs/ns/p/main") == (200, b"first 1\nfirst 2\n")
    status, body = get(server, pki, "/containerLogs/ns/p/main?previous=true")
    assert status == 400 and body == b'previous terminated container "main" in pod "p" not found'

    pod.start(b"second 1\nsecond 2\nsecond 3\n")
    assert get(server, pki, "/containerLogs/ns/p/main") == (200, b"second 1\nsecond 2\nsecond 3\n")
    assert get(server, pki, "/containerLogs/ns/p/main?previous=true") == (200, b"first 1\nfirst 2\n")
    assert get(server, pki, "/containerLogs/ns/p/main?tailLines=2") == (200, b"second 2\nsecond 3\n")
    assert get(server, pki, "/containerLogs/ns/p/main?tailLines=0") == (200, b"")
    assert get(server, pki, "/containerLogs/ns/p/main?tailLines=10") == (200, b"second 1\nsecond 2\nsecond 3\n")
    assert get(server, pki, "/containerLogs/ns/p/main?limitBytes=10") == (200, b"second 1\ns")


def test_following_streams_what_the_container_writes_until_it_ends(kubelet, pki):
    server, pod = kubelet
    pod.start(b"line 0\n")
    got: list = []
    reader = threading.Thread(target=lambda: got.append(get(server, pki, "/containerLogs/ns/p/main?follow=true")))
    reader.start()
    for i in range(1, 4):
        time.sleep(0.3)
        pod.write(f"line {i}\n".encode())
    assert reader.is_alive(), "a followed log stays open while the container runs"
    pod.containers["main"].proc = None  # the container exits
    reader.join(timeout=10)
    assert not reader.is_alive(), "a followed log ends when the container does"
    assert got == [(200, b"line 0\nline 1\nline 2\nline 3\n")]


def test_only_the_api_server_is_answered_and_what_cannot_be_answered_says_why(kubelet, pki):
    server, pod = kubelet
    status, body = get(server, pki, "/containerLogs/ns/p/main")
    assert status == 400 and b"is waiting to start: ContainerCreating" in body
    pod.start(b"hello\n")

    status, body = get(server, pki, "/containerLogs/ns/p/main", client="admin")  # a cluster admin's certificate
    assert status == 403 and certs.KUBELET_CLIENT.encode() in body
    with pytest.raises(ssl.SSLError):  # no client certificate: no TLS session at all
        get(server, pki, "/containerLogs/ns/p/main", client=None)

    for option in ("timestamps=true", "sinceSeconds=10", "sinceTime=2026-01-01T00:00:00Z"):
        status, body = get(server, pki, f"/containerLogs/ns/p/main?{option}")
        assert status == 400 and b"keeps no time per log line" in body, option
    status, body = get(server, pki, "/containerLogs/ns/p/main?tailLines=-1")
    assert status == 400 and b"tailLines" in body
    assert get(server, pki, "/containerLogs/ns/other/main")[0] == 404
    assert get(server, pki, "/containerLogs/ns/p/sidecar")[0] == 404
    assert get(server, pki, "/run/ns/p/main")[0] == 404
    status, body = get(server, pki, "/exec/ns/p/main?command=true")
    assert status == 400 and b"needs a WebSocket upgrade" in body


def exec_session(server: KubeletAPI, pki: Path, query: str, stdin: bytes = b"") -> dict[int, bytes]:
    """`kubectl exec` as the API server passes it on: a WebSocket of channel protocol v5; what came back on
    each channel."""
    connection = websocket_client.create_connection(
        f"wss://127.0.0.1:{server.server_port}/exec/ns/p/main?{query}", subprotocols=["v5.channel.k8s.io"],
        sslopt={"ca_certs": str(pki / "ca.crt"), "certfile": str(pki / f"{certs.KUBELET_CLIENT}.crt"),
                "keyfile": str(pki / f"{certs.KUBELET_CLIENT}.key")}, timeout=20)
    if stdin:
        connection.send_binary(bytes([kubelet_exec.STDIN]) + stdin)
        connection.send_binary(bytes([kubelet_exec.CLOSE, kubelet_exec.STDIN]))  # v5: stdin ends
    got: dict[int, bytes] = {}
    while True:
        opcode, message = connection.recv_data()
        if opcode == websocket_client.ABNF.OPCODE_CLOSE:
            return got
        got[message[0]] = got.get(message[0], b"") + message[1:]


def test_exec_relays_stdin_stdout_stderr_and_the_exit_code_over_the_channel_protocol(kubelet, pki, monkeypatch):
    server, pod = kubelet
    pod.start(b"")
    pod.containers["main"].container_name = "k8s_main_p_ns_0"
    # The command runs here instead of in a container: podman exec is what tests/images and the e2e exercise.
    monkeypatch.setattr(kubelet_exec, "command_line", lambda container, pod, name, query: kubelet_exec.Command(
        query["command"], stdin="input" in query, tty=False))
    script = "import sys; data = sys.stdin.read(); print(data.upper()); print('to stderr', file=sys.stderr); sys.exit(3)"
    got = exec_session(server, pki, "command=python3&command=-c&command=" + quote(script) + "&input=1&output=1&error=1",
                       stdin=b"hello")
    assert got[kubelet_exec.STDOUT] == b"HELLO\n" and got[kubelet_exec.STDERR] == b"to stderr\n"
    status = json.loads(got[kubelet_exec.ERROR])
    assert status["status"] == "Failure" and status["details"]["causes"] == [{"reason": "ExitCode", "message": "3"}]
    ok = exec_session(server, pki, "command=true&output=1")
    assert json.loads(ok[kubelet_exec.ERROR])["status"] == "Success"


def test_exec_is_refused_saying_why_where_it_cannot_run(kubelet, pki):
    server, pod = kubelet
    pod.start(b"")  # a container run as a local process (no podman name)
    with pytest.raises(websocket_client.WebSocketBadStatusException) as refused:
        exec_session(server, pki, "command=true&output=1")
    assert refused.value.status_code == 400 and b"kubectl exec reaches containers only" in refused.value.resp_body
    pod.containers["main"].container_name = "k8s_main_p_ns_0"
    with pytest.raises(websocket_client.WebSocketBadStatusException) as refused:
        exec_session(server, pki, "output=1")
    assert b"no command" in refused.value.resp_body


class SpdyClient:
    """kubectl's side of a port-forward session, written from the SPDY/3 draft independently of
    kubetune_dev.spdy (whose dictionary it shares: the draft's, checked by its zlib id)."""

    def __init__(self, sock):
        self.sock, self.file = sock, sock.makefile("rb")
        self.deflate = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, 15, zdict=spdy.DICTIONARY)
        self.inflate = zlib.decompressobj(zdict=spdy.DICTIONARY)

    def open(self, stream: int, headers: dict[str, str]) -> None:
        block = struct.pack("!I", len(headers)) + b"".join(
            struct.pack("!I", len(k)) + k.encode() + struct.pack("!I", len(v)) + v.encode() for k, v in headers.items())
        payload = struct.pack("!IIBB", stream, 0, 0, 0) + self.deflate.compress(block) + self.deflate.flush(zlib.Z_SYNC_FLUSH)
        self.sock.sendall(struct.pack("!II", 0x80030001, len(payload)) + payload)

    def send(self, stream: int, data: bytes, fin: bool = False) -> None:
        self.sock.sendall(struct.pack("!II", stream, (1 << 24 if fin else 0) | len(data)) + data)

    def frames(self):
        """(control type or None for DATA, stream, flags, payload) until the server's GOAWAY."""
        while True:
            first, second = struct.unpack("!II", self.file.read(8))
            payload = self.file.read(second & 0xFFFFFF)
            kind = first & 0xFFFF if first & 0x80000000 else None
            if kind == spdy.SYN_REPLY:
                self.inflate.decompress(payload[4:])  # keeps the shared zlib stream in step
            yield kind, (first & 0x7FFFFFFF) if kind is None else struct.unpack("!I", payload[:4])[0], second >> 24, payload
            if kind == spdy.GOAWAY:
                return


def port_forward_session(server: KubeletAPI, pki: Path) -> SpdyClient:
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    context.load_cert_chain(pki / f"{certs.KUBELET_CLIENT}.crt", pki / f"{certs.KUBELET_CLIENT}.key")
    sock = context.wrap_socket(socket.create_connection(("127.0.0.1", server.server_port)), server_hostname="127.0.0.1")
    sock.sendall(b"POST /portForward/ns/p HTTP/1.1\r\nHost: kubelet\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
                 b"X-Stream-Protocol-Version: portforward.k8s.io\r\nContent-Length: 0\r\n\r\n")
    client = SpdyClient(sock)
    status = client.file.readline()
    while client.file.readline() not in (b"\r\n", b""):
        pass
    assert status.startswith(b"HTTP/1.1 101"), status
    return client


def test_port_forward_copies_both_ways_over_spdy_and_says_when_nothing_listens(kubelet, pki):
    """Two streams per connection (error, data) with one requestid, as kubectl opens them: bytes reach the
    pod's port and its answer comes back, each side's end ends the other; a port nobody listens on is
    answered on the error stream."""
    server, pod = kubelet
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def echo_upper():
        connection, _ = listener.accept()
        with connection:
            received = b""
            while chunk := connection.recv(1024):
                received += chunk
            connection.sendall(received.upper())  # after kubectl's side ended: half-close reached the pod

    threading.Thread(target=echo_upper, daemon=True).start()
    client = port_forward_session(server, pki)
    client.open(1, {"streamtype": "error", "port": str(port), "requestid": "0"})
    client.open(3, {"streamtype": "data", "port": str(port), "requestid": "0"})
    client.send(3, b"hello ")
    client.send(3, b"pod", fin=True)
    data, replies, ended = b"", set(), set()
    for kind, stream, flags, payload in client.frames():
        if kind == spdy.SYN_REPLY:
            replies.add(stream)
        elif kind is None:
            data += payload if stream == 3 else b""
            if flags & spdy.FLAG_FIN:
                ended.add(stream)
        if ended == {1, 3}:
            break
    assert replies == {1, 3} and data == b"HELLO POD"
    client.sock.close()
    listener.close()

    client = port_forward_session(server, pki)
    client.open(1, {"streamtype": "error", "port": str(port), "requestid": "7"})
    client.open(3, {"streamtype": "data", "port": str(port), "requestid": "7"})
    error = b""
    for kind, stream, flags, payload in client.frames():
        if kind is None and stream == 1:
            error += payload
            if flags & spdy.FLAG_FIN:
                break
    assert error.startswith(f"error forwarding port {port} to pod p: ".encode()), error
    client.sock.close()


def test_the_spdy_dictionary_is_the_drafts():
    assert (len(spdy.DICTIONARY), zlib.adler32(spdy.DICTIONARY)) == (1423, 3821447106)
