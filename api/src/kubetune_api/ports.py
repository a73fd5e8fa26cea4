"""Listen ports chosen below the kernel's ephemeral range.

A port is often chosen some time before it is bound: the local control plane's ports when its
state directory is made (Prometheus binds a minute later), a torchrun rendezvous port before the
launcher's processes start. A port asked of the kernel (bind to port 0) comes from the ephemeral
range, which the kernel also hands to every outgoing connection: in the meantime one may take it
(Prometheus once failed with "address already in use"). Below the range only explicit binds can
take a port. Used by the trainer's launcher, the devcluster and the tests.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

LINUX_DEFAULT_EPHEMERAL = range(32768, 61000)
# How far below the ephemeral range to look: far enough for many free ports, clear of the
# well-known services at the bottom.
SPAN_BELOW = 20000


def ephemeral_ports(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> range:
    """The ports the kernel hands to outgoing connections and to binds of port 0."""
    try:
        low, high = map(int, path.read_text().split())
    except (OSError, ValueError):
        return LINUX_DEFAULT_EPHEMERAL
    return range(low, high + 1)


def free_listen_port(ephemeral: range | None = None, taken: set[int] = frozenset(), tries: int = 200) -> int:
    """A port below EPHEMERAL (default: this kernel's range) that is free on loopback now.
    TAKEN: ports already chosen for something else (free until it starts)."""
    ephemeral = ephemeral if ephemeral is not None else ephemeral_ports()
    low = max(1024, ephemeral.start - SPAN_BELOW)
    candidates = random.sample(range(low, ephemeral.start), min(tries, max(0, ephemeral.start - low)))
    for port in (p for p in candidates if p not in taken):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{ephemeral.start - 1} after {len(candidates)} tries")
