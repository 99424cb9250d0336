"""Reading a provider's response body within a size limit, compressed or not.

httpx decodes ``Content-Encoding`` itself, one network chunk at a time and in full: a
small zstd body can expand to gigabytes before a caller sees its first chunk (and gzip
to about a thousand times each chunk). Here the raw body is read with
``Response.iter_raw()`` and decoded by decoders whose output is bounded, so no more than
``limit`` decoded bytes (plus one decoder step) ever exist in memory.

Requests say :data:`ACCEPT_ENCODING`; a server that answers another encoding anyway is
decoded if it is ``zstd`` (with a window of at most :data:`MAX_ZSTD_WINDOW_BYTES`, the
HTTP limit of RFC 8878) and refused otherwise (``br``, unknown names).
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import zstandard

if TYPE_CHECKING:  # annotations only: the CLI does not import httpx to start
    import httpx

#: The ``Accept-Encoding`` the engine sends to providers (httpx's default adds zstd/br).
ACCEPT_ENCODING = "gzip, deflate"
#: Largest zstd window accepted (RFC 8878 section 3: decoders may refuse more than 8 MB).
MAX_ZSTD_WINDOW_BYTES = 8 << 20
#: Largest piece a zstd decoder step produces.
_ZSTD_WRITE_SIZE = 64 << 10


class BodyTooLarge(Exception):
    """The body, raw or decoded, is larger than the limit."""


class BodyUndecodable(Exception):
    """The body's ``Content-Encoding`` is unsupported or its data does not decode."""


class _Decoder(ABC):
    """One content decoding whose total output is at most ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0

    def _count(self, out: bytes) -> bytes:
        self.total += len(out)
        if self.total > self.limit:
            raise BodyTooLarge(f"decoded body larger than {self.limit} bytes")
        return out

    @abstractmethod
    def decode(self, data: bytes) -> bytes:
        """The decoded bytes ``data`` yields now (counted against the limit)."""

    def finish(self) -> bytes:
        return b""


class _Zlib(_Decoder):
    """gzip (``wbits`` 31) or deflate: zlib-wrapped, else raw, as httpx decodes it."""

    def __init__(self, limit: int, gzip: bool) -> None:
        super().__init__(limit)
        self.gzip = gzip
        self.first = True
        self.obj = zlib.decompressobj(zlib.MAX_WBITS | 16 if gzip else zlib.MAX_WBITS)

    def decode(self, data: bytes) -> bytes:
        first, self.first = self.first, False
        try:
            # At most one byte over what is left: more is refused before it exists.
            out = self.obj.decompress(data, self.limit - self.total + 1)
        except zlib.error as exc:
            if first and not self.gzip:
                self.obj = zlib.decompressobj(-zlib.MAX_WBITS)
                return self.decode(data)
            raise BodyUndecodable(f"invalid {'gzip' if self.gzip else 'deflate'} data: "
                                  f"{exc}") from exc
        # Output below the cap means all input was consumed (no unconsumed_tail).
        return self._count(out)

    def finish(self) -> bytes:
        try:
            return self._count(self.obj.flush(self.limit - self.total + 1))
        except zlib.error as exc:
            raise BodyUndecodable(f"invalid compressed data: {exc}") from exc


class _Zstd(_Decoder):
    """zstd through a stream writer whose sink refuses output past the limit: the decoder
    produces at most :data:`_ZSTD_WRITE_SIZE` bytes per step."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.out: list[bytes] = []
        decompressor = zstandard.ZstdDecompressor(max_window_size=MAX_ZSTD_WINDOW_BYTES)
        self.writer = decompressor.stream_writer(self,  # type: ignore[arg-type]
                                                 write_size=_ZSTD_WRITE_SIZE,
                                                 write_return_read=True, closefd=False)

    def write(self, data: bytes) -> int:  # the stream writer's sink
        self.out.append(self._count(bytes(data)))
        return len(data)

    def decode(self, data: bytes) -> bytes:
        try:
            self.writer.write(data)
        except zstandard.ZstdError as exc:
            raise BodyUndecodable(f"invalid zstd data: {exc}") from exc
        out, self.out = b"".join(self.out), []
        return out


class _Identity(_Decoder):
    def decode(self, data: bytes) -> bytes:
        return self._count(data)


def _decoders(content_encoding: str, limit: int) -> list[_Decoder]:
    """The decoders for a ``Content-Encoding`` header, in the order to apply them (the
    header lists encodings in the order they were applied)."""
    decoders: list[_Decoder] = []
    for name in reversed([n.strip().lower() for n in content_encoding.split(",")]):
        if name in ("", "identity"):
            continue
        if name in ("gzip", "x-gzip"):
            decoders.append(_Zlib(limit, gzip=True))
        elif name == "deflate":
            decoders.append(_Zlib(limit, gzip=False))
        elif name == "zstd":
            decoders.append(_Zstd(limit))
        else:
            raise BodyUndecodable(f"unsupported Content-Encoding {name[:40]!r}")
    return decoders or [_Identity(limit)]


def read_body(response: httpx.Response, limit: int,
              on_chunk: Callable[[], None] | None = None) -> bytes:
    """The decoded body of a streamed ``response``, at most ``limit`` bytes raw and decoded.

    ``on_chunk`` runs after each raw chunk is read (a caller's deadline check, say).

    Raises:
        BodyTooLarge: the raw or the decoded body is larger than ``limit``.
        BodyUndecodable: an unsupported ``Content-Encoding`` or data that does not decode.
        httpx.HTTPError: from reading the response.
    """
    if response.is_stream_consumed:
        # Read in full already (a response built in memory, as a mock transport makes
        # one): httpx has decoded it; only the limit is left to apply.
        if len(response.content) > limit:
            raise BodyTooLarge(f"body larger than {limit} bytes")
        return response.content
    decoders = _decoders(response.headers.get("content-encoding", ""), limit)
    parts: list[bytes] = []
    raw_size = 0

    def push(data: bytes, start: int) -> None:
        for decoder in decoders[start:]:
            if not data:
                return
            data = decoder.decode(data)
        if data:
            parts.append(data)

    for chunk in response.iter_raw():
        raw_size += len(chunk)
        if raw_size > limit:
            raise BodyTooLarge(f"body larger than {limit} bytes")
        push(chunk, 0)
        if on_chunk is not None:
            on_chunk()
    for index, decoder in enumerate(decoders):
        push(decoder.finish(), index + 1)
    return b"".join(parts)
