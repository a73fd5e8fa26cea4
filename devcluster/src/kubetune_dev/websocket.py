"""The server side of a WebSocket (RFC 6455), as much as `kubectl exec` needs through the API server:
the opening handshake, binary and close frames, ping answered. Messages are read whole (no client
here fragments them), frames from the client are masked and ours are not, as the RFC says."""
from __future__ import annotations

import base64
import hashlib
import struct
from typing import BinaryIO

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455, section 1.3
OP_CONTINUATION, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
MAX_MESSAGE = 16 * 2**20  # a stdin message larger than this is a broken or hostile client


class Closed(Exception):
    """The client closed the connection (a close frame, or end of stream)."""


def accept_key(key: str) -> str:
    return base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()


class WebSocket:
    def __init__(self, reader: BinaryIO, writer: BinaryIO):
        self.reader, self.writer = reader, writer

    def _read_exactly(self, size: int) -> bytes:
        data = self.reader.read(size)
        if len(data) < size:
            raise Closed()
        return data

    def receive(self) -> tuple[int, bytes]:
        """The next data message (opcode, payload); pings are answered on the way."""
        while True:
            first, second = self._read_exactly(2)
            opcode, length = first & 0x0F, second & 0x7F
            if length == 126:
                length = struct.unpack("!H", self._read_exactly(2))[0]
            elif length == 127:
                length = struct.unpack("!Q", self._read_exactly(8))[0]
            if length > MAX_MESSAGE:
                raise Closed()
            mask = self._read_exactly(4) if second & 0x80 else b"\0\0\0\0"
            masked = self._read_exactly(length)
            key = (mask * (length // 4 + 1))[:length]
            payload = (int.from_bytes(masked, "big") ^ int.from_bytes(key, "big")).to_bytes(length, "big")
            if opcode == OP_CLOSE:
                raise Closed()
            if opcode == OP_PING:
                self.send(payload, OP_PONG)
                continue
            if opcode in (OP_TEXT, OP_BINARY, OP_CONTINUATION):
                return opcode, payload

    def send(self, payload: bytes, opcode: int = OP_BINARY) -> None:
        length = len(payload)
        if length < 126:
            header = struct.pack("!BB", 0x80 | opcode, length)
        elif length < 2**16:
            header = struct.pack("!BBH", 0x80 | opcode, 126, length)
        else:
            header = struct.pack("!BBQ", 0x80 | opcode, 127, length)
        self.writer.write(header + payload)
        self.writer.flush()

    def close(self) -> None:
        try:
            self.send(struct.pack("!H", 1000), OP_CLOSE)  # 1000: a normal closure
        except OSError:
            pass
