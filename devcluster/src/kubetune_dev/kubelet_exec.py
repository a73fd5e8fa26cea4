"""`kubectl exec` on the dev cluster's real containers: the kubelet's /exec endpoint over WebSocket.

    GET /exec/NAMESPACE/POD/CONTAINER?command=…&input=1&output=1&error=1[&tty=1]   (Upgrade: websocket)

kubectl speaks the channel protocol v5.channel.k8s.io (or v4) to the API server, which hands the upgraded
connection on to the kubelet unchanged (cluster.py turns off its translation of that WebSocket into SPDY
for the kubelet, TranslateStreamCloseWebsocketRequests, so that a WebSocket is all this kubelet speaks).
Each binary message starts with its channel: 0 stdin, 1 stdout, 2 stderr, 3 the final status (a
metav1.Status: Success, or Failure with the exit code), 4 a terminal's new size; v5 adds 255, by which
the client says a stream ended (stdin closed).

The command runs as `podman exec` in the container, as its user, with its environment and mounts. With
tty=1 it gets a pseudo-terminal (stdout and stderr are one stream then, as on any node). Containers that
run as local processes (images not under localhost/, kubetune_dev/images.py) are refused, saying so.
"""
from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import termios
import threading
from dataclasses import dataclass

from kubetune_dev import container_runtime
from kubetune_dev.podrunner import Container
from kubetune_dev.websocket import Closed, WebSocket

PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")  # preferred first
STDIN, STDOUT, STDERR, ERROR, RESIZE, CLOSE = 0, 1, 2, 3, 4, 255


class ExecRefused(Exception):
    """(status, message): what the kubelet answers instead of upgrading."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def protocol(offered: str) -> str:
    """The channel protocol to speak, of those the client offers (Sec-WebSocket-Protocol)."""
    names = [name.strip() for name in offered.split(",")]
    chosen = next((name for name in PROTOCOLS if name in names), None)
    if chosen is None:
        raise ExecRefused(400, f"the dev cluster's kubelet speaks {' or '.join(PROTOCOLS)}; the client offered "
                               f"{offered or 'none'}")
    return chosen


@dataclass(frozen=True)
class Command:
    argv: list[str]
    stdin: bool  # the client sends input
    tty: bool    # and asks for a terminal


def command_line(container: Container, pod: str, name: str, query: dict[str, list[str]]) -> Command:
    """The `podman exec` the request asks for."""
    if not query.get("command"):
        raise ExecRefused(400, "no command: give one after -- (kubectl exec POD -- COMMAND)")
    if container.container_name is None:
        raise ExecRefused(400, f'container "{name}" of pod "{pod}" runs as a local process in the dev cluster, not '
                               "as a container (only images under localhost/ do): kubectl exec reaches containers only")
    if container.proc is None:
        raise ExecRefused(400, f'container "{name}" of pod "{pod}" is not running')
    stdin, tty = (query.get(flag, ["0"])[0] in ("1", "true") for flag in ("input", "tty"))
    flags = (["--interactive"] if stdin else []) + (["--tty"] if tty else [])
    return Command(["podman", *container_runtime.RUNTIME_FLAGS, "exec", *flags, container.container_name,
                    *query["command"]], stdin, tty)


def final_status(code: int) -> bytes:
    """What kubectl reads on the error channel: Success, or the exit code it exits with."""
    if code == 0:
        return json.dumps({"metadata": {}, "status": "Success"}).encode()
    return json.dumps({"metadata": {}, "status": "Failure", "reason": "NonZeroExitCode",
                       "message": f"command terminated with non-zero exit code: exit code {code}",
                       "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]}}).encode()


def run(socket: WebSocket, chosen: str, command: Command) -> None:
    """Run COMMAND, relaying its streams over SOCKET until it exits; then its status, then close."""
    argv = command.argv
    sending = threading.Lock()

    def send(channel: int, data: bytes) -> None:
        with sending:
            socket.send(bytes([channel]) + data)

    if command.tty:
        controller, terminal = pty.openpty()
        process = subprocess.Popen(argv, stdin=terminal, stdout=terminal, stderr=terminal, start_new_session=True)
        os.close(terminal)
        readers = [(os.fdopen(controller, "rb", buffering=0), STDOUT)]
        stdin = os.fdopen(os.dup(controller), "wb", buffering=0)
    else:
        process = subprocess.Popen(argv, stdin=subprocess.PIPE if command.stdin else subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        readers, stdin = [(process.stdout, STDOUT), (process.stderr, STDERR)], process.stdin

    def relay(stream, channel: int) -> None:
        read = getattr(stream, "read1", stream.read)  # whatever has arrived, not a full buffer
        try:
            while chunk := read(65536):
                send(channel, chunk)
        except OSError:  # a terminal reads EIO once the command's side is closed
            pass

    threads = [threading.Thread(target=relay, args=reader, daemon=True) for reader in readers]
    for thread in threads:
        thread.start()
    if command.stdin:
        threading.Thread(target=_take_input, args=(socket, chosen, stdin, controller if command.tty else None,
                                                   process), daemon=True).start()
    elif stdin is not None:
        stdin.close()  # a terminal's second handle, unused without input
    code = process.wait()
    for thread in threads:
        thread.join(timeout=5)
    try:
        send(ERROR, final_status(code))
        socket.close()
    except OSError:  # the client went away before the command ended
        pass


def _take_input(socket: WebSocket, chosen: str, stdin, terminal: int | None, process: subprocess.Popen) -> None:
    """The client's messages: stdin, a terminal's new size, v5's end of stdin."""
    try:
        while process.poll() is None:
            _, message = socket.receive()
            if not message:
                continue
            channel, data = message[0], message[1:]
            if channel == STDIN:
                stdin.write(data)
                stdin.flush()
            elif channel == RESIZE and terminal is not None:
                size = json.loads(data)
                fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", size["Height"], size["Width"], 0, 0))
            elif channel == CLOSE and chosen == PROTOCOLS[0] and data[:1] == bytes([STDIN]):
                stdin.close()
    except (Closed, OSError, ValueError):
        pass
    finally:
        try:
            stdin.close()
        except OSError:
            pass
