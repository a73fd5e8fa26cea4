"""`kubectl port-forward` to dev-cluster pods: the kubelet's /portForward endpoint.

    POST /portForward/NAMESPACE/POD   (Upgrade: SPDY/3.1, X-Stream-Protocol-Version: portforward.k8s.io)

The API server hands the kubelet an SPDY session (spdy.py). For each connection kubectl accepts locally it
opens two streams with the same `requestid` header and the pod's `port`: `streamtype: error` and
`streamtype: data`. Once both are there the kubelet connects to that port at the pod's address and copies
bytes both ways; the end of one side half-closes the other (a DATA frame with FIN, a shutdown of the
socket), and a port nobody listens on is answered on the error stream, as a kubelet answers it.
"""
from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass

from kubetune_dev import spdy

log = logging.getLogger("kubelet.portforward")
PROTOCOL = "portforward.k8s.io"
CHUNK = 64 * 1024


@dataclass
class Pair:
    """One forwarded connection: its error and data streams and, once both exist, its socket."""

    port: int
    error: int | None = None
    data: int | None = None
    connection: socket.socket | None = None


def serve(session: spdy.Session, pod: str, address: str) -> None:
    """Answer SESSION's streams until the client goes away, forwarding to ADDRESS (the pod's IP)."""
    pairs: dict[str, Pair] = {}
    by_stream: dict[int, Pair] = {}
    last = 0
    try:
        while True:
            frame = session.receive()
            if frame.kind == spdy.SYN_STREAM:
                last = frame.stream
                session.reply(frame.stream)
                _opened(session, frame, pairs, by_stream, pod, address)
            elif frame.kind is None:  # DATA
                pair = by_stream.get(frame.stream)
                if pair is not None and frame.stream == pair.data and pair.connection is not None:
                    if frame.data:
                        pair.connection.sendall(frame.data)
                    if frame.flags & spdy.FLAG_FIN:  # kubectl's side closed: so does the pod's writing end
                        _shutdown(pair.connection, socket.SHUT_WR)
            elif frame.kind == spdy.RST_STREAM:
                pair = by_stream.get(frame.stream)
                if pair is not None and pair.connection is not None:
                    _shutdown(pair.connection, socket.SHUT_RDWR)
            elif frame.kind == spdy.PING:
                session.ping(frame)
            elif frame.kind == spdy.GOAWAY:
                break
    except (spdy.Closed, OSError):
        pass
    finally:
        for pair in pairs.values():
            if pair.connection is not None:
                _shutdown(pair.connection, socket.SHUT_RDWR)
        try:
            session.go_away(last)
        except OSError:
            pass


def _opened(session: spdy.Session, frame: spdy.Frame, pairs: dict[str, Pair], by_stream: dict[int, Pair],
            pod: str, address: str) -> None:
    headers = frame.headers or {}
    kind, request = headers.get("streamtype"), headers.get("requestid", "")
    try:
        port = int(headers.get("port", ""))
    except ValueError:
        session.reset(frame.stream)
        return
    pair = pairs.setdefault(request, Pair(port))
    if kind == "error":
        pair.error = frame.stream
    elif kind == "data":
        pair.data = frame.stream
    else:
        session.reset(frame.stream)
        return
    by_stream[frame.stream] = pair
    if pair.error is not None and pair.data is not None:
        try:
            pair.connection = socket.create_connection((address, pair.port), timeout=10)
            pair.connection.settimeout(None)
        except OSError as err:
            session.data(pair.error, f"error forwarding port {pair.port} to pod {pod}: {err}".encode(), fin=True)
            session.data(pair.data, b"", fin=True)
            return
        threading.Thread(target=_copy_out, args=(session, pair), daemon=True,
                         name=f"portforward-{pod}-{pair.port}").start()


def _copy_out(session: spdy.Session, pair: Pair) -> None:
    """The pod's bytes to kubectl, then the end of both streams."""
    try:
        while chunk := pair.connection.recv(CHUNK):
            session.data(pair.data, chunk)
        session.data(pair.data, b"", fin=True)
        session.data(pair.error, b"", fin=True)
    except OSError:  # the session ended under us
        pass
    finally:
        pair.connection.close()


def _shutdown(connection: socket.socket, how: int) -> None:
    try:
        connection.shutdown(how)
    except OSError:
        pass
