"""SPDY/3.1 framing, as much as `kubectl port-forward` needs from a kubelet (kubelet_portforward.py).

Kubernetes still carries port-forward streams over SPDY to the kubelet (kubectl tunnels them through a
WebSocket to the API server, which passes SPDY on). A frame is a control frame (SYN_STREAM, SYN_REPLY,
RST_STREAM, SETTINGS, PING, GOAWAY, HEADERS, WINDOW_UPDATE) or a DATA frame of a stream. Header blocks are
compressed with zlib, one stream per direction for the whole session, primed with the dictionary the
SPDY/3 draft defines (section 2.6.10.1). Flow control is not kept: Kubernetes' SPDY library neither sends
nor waits for WINDOW_UPDATE.
"""
from __future__ import annotations

import struct
import threading
import zlib
from dataclasses import dataclass
from typing import BinaryIO

VERSION = 3
SYN_STREAM, SYN_REPLY, RST_STREAM, SETTINGS, PING, GOAWAY, HEADERS, WINDOW_UPDATE = 1, 2, 3, 4, 6, 7, 8, 9
FLAG_FIN = 0x01
RST_CANCEL = 5

# The draft's dictionary: these names and values, each after its length as 4 bytes, then this text.
_DICTIONARY_WORDS = (
    "options head post put delete trace accept accept-charset accept-encoding accept-language accept-ranges "
    "age allow authorization cache-control connection content-base content-encoding content-language "
    "content-length content-location content-md5 content-range content-type date etag expect expires from "
    "host if-match if-modified-since if-none-match if-range if-unmodified-since last-modified location "
    "max-forwards pragma proxy-authenticate proxy-authorization range referer retry-after server te trailer "
    "transfer-encoding upgrade user-agent vary via warning www-authenticate method get status").split() + [
    "200 OK"] + "version HTTP/1.1 url public set-cookie keep-alive origin".split()
_DICTIONARY_TEXT = (
    "100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505"
    "203 Non-Authoritative Information204 No Content301 Moved Permanently400 Bad Request401 Unauthorized"
    "403 Forbidden404 Not Found500 Internal Server Error501 Not Implemented503 Service Unavailable"
    "Jan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec 00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMT"
    "chunked,text/html,image/png,image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,"
    "text/javascript,publicprivatemax-age=gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0.")
DICTIONARY = b"".join(struct.pack("!I", len(word)) + word.encode() for word in _DICTIONARY_WORDS) \
    + _DICTIONARY_TEXT.encode()


@dataclass
class Frame:
    kind: int | None         # a control frame's type; None for DATA
    flags: int
    stream: int = 0          # the stream id (SYN_STREAM, SYN_REPLY, RST_STREAM, HEADERS, WINDOW_UPDATE, DATA)
    headers: dict[str, str] | None = None
    data: bytes = b""        # DATA's payload; PING's id, GOAWAY's and RST_STREAM's fields, raw


class Closed(Exception):
    pass


class Session:
    """One SPDY session over READER/WRITER: frames in, frames out (writes from any thread)."""

    def __init__(self, reader: BinaryIO, writer: BinaryIO):
        self.reader, self.writer = reader, writer
        self._inflate = zlib.decompressobj(zdict=DICTIONARY)
        self._deflate = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, 15, zdict=DICTIONARY)
        self._writing = threading.RLock()  # reply() holds it across compressing and sending

    def _read(self, size: int) -> bytes:
        data = self.reader.read(size)
        if len(data) < size:
            raise Closed()
        return data

    def receive(self) -> Frame:
        first, second = struct.unpack("!II", self._read(8))
        flags, length = second >> 24, second & 0xFFFFFF
        payload = self._read(length)
        if not first & 0x80000000:
            return Frame(None, flags, first & 0x7FFFFFFF, data=payload)
        kind = first & 0xFFFF
        if kind == SYN_STREAM:
            stream = struct.unpack("!I", payload[:4])[0] & 0x7FFFFFFF
            return Frame(kind, flags, stream, self._headers(payload[10:]))
        if kind in (SYN_REPLY, HEADERS):
            return Frame(kind, flags, struct.unpack("!I", payload[:4])[0] & 0x7FFFFFFF, self._headers(payload[4:]))
        if kind in (RST_STREAM, WINDOW_UPDATE):
            return Frame(kind, flags, struct.unpack("!I", payload[:4])[0] & 0x7FFFFFFF, data=payload[4:])
        return Frame(kind, flags, data=payload)

    def _headers(self, block: bytes) -> dict[str, str]:
        raw = self._inflate.decompress(block)
        count, at, headers = struct.unpack("!I", raw[:4])[0], 4, {}
        for _ in range(count):
            (size,), at = struct.unpack("!I", raw[at:at + 4]), at + 4
            name, at = raw[at:at + size].decode(), at + size
            (size,), at = struct.unpack("!I", raw[at:at + 4]), at + 4
            headers[name], at = raw[at:at + size].decode(), at + size
        return headers

    def _send(self, first: int, flags: int, payload: bytes) -> None:
        with self._writing:
            self.writer.write(struct.pack("!II", first, flags << 24 | len(payload)) + payload)
            self.writer.flush()

    def _control(self, kind: int, flags: int, payload: bytes) -> None:
        self._send(0x80000000 | VERSION << 16 | kind, flags, payload)

    def reply(self, stream: int, headers: dict[str, str] | None = None, fin: bool = False) -> None:
        """SYN_REPLY: the stream is accepted."""
        pairs = list((headers or {}).items())
        block = struct.pack("!I", len(pairs)) + b"".join(
            struct.pack("!I", len(k)) + k.encode() + struct.pack("!I", len(v)) + v.encode() for k, v in pairs)
        with self._writing:  # one compressor: frames leave in the order it compressed them
            compressed = self._deflate.compress(block) + self._deflate.flush(zlib.Z_SYNC_FLUSH)
            self._control(SYN_REPLY, FLAG_FIN if fin else 0, struct.pack("!I", stream) + compressed)

    def data(self, stream: int, payload: bytes, fin: bool = False) -> None:
        for at in range(0, max(len(payload), 1), 0xFFFFFF):
            last = at + 0xFFFFFF >= len(payload)
            self._send(stream, FLAG_FIN if fin and last else 0, payload[at:at + 0xFFFFFF])

    def ping(self, frame: Frame) -> None:
        self._control(PING, 0, frame.data)

    def reset(self, stream: int, status: int = RST_CANCEL) -> None:
        self._control(RST_STREAM, 0, struct.pack("!II", stream, status))

    def go_away(self, last_stream: int) -> None:
        self._control(GOAWAY, 0, struct.pack("!II", last_stream, 0))
