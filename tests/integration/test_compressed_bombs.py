"""Compressed provider responses against the response limit, on a loopback HTTP server.

A small zstd or gzip body that expands past the limit is refused as the uncompressed
over-limit body is (``PROVIDER_MALFORMED_RESPONSE``) without ever holding much more than
the limit in memory: the chat call, the server tokenizer and ``providers check``.
Memory is measured with tracemalloc (Python allocations, which is where decoded bytes
live); no timing is asserted.
"""

from __future__ import annotations

import json
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import httpx
import pytest
import zstandard

from investigation.config import ProviderConfig
from investigation.errors import TransientProviderError
from investigation.llm import tokens
from investigation.llm.body import (
    ACCEPT_ENCODING,
    BodyTooLarge,
    BodyUndecodable,
    read_body,
)
from investigation.llm.openai import MAX_RESPONSE_BYTES, OpenAIProvider
from investigation.llm.types import PROVIDER_MALFORMED_RESPONSE, ChatRequest
from investigation.loop.probe import probe_provider
from tests.integration.test_http_provider_limits import serve_handler

REQ = ChatRequest(messages=[{"role": "user", "content": "hi"}], response_schema={},
                  schema_name="r", call_index=0, case_id="c")
MiB = 1 << 20
#: What a bomb expands to (well past the 16 MiB limit).
BOMB_BYTES = 256 * MiB
#: Peak traced memory allowed while a bomb is refused: the limit, its join, slack.
BOUND = MAX_RESPONSE_BYTES * 2 + 8 * MiB


def zstd_bomb(size: int = BOMB_BYTES) -> bytes:
    co = zstandard.ZstdCompressor(level=3).compressobj()
    return b"".join(co.compress(bytes(MiB)) for _ in range(size // MiB)) + co.flush()


def gzip_bomb(size: int = BOMB_BYTES) -> bytes:
    co = zlib.compressobj(9, zlib.DEFLATED, 31)
    return b"".join(co.compress(bytes(MiB)) for _ in range(size // MiB)) + co.flush()


COMPLETION = json.dumps({"choices": [{"message": {"role": "assistant", "content": "ok"},
                                      "finish_reason": "stop"}]}).encode()


def _serve(body: bytes, encoding: str, seen: list[dict[str, str]]) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(dict(self.headers))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Encoding", encoding)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except OSError:
                return

        def log_message(self, *_: object) -> None:
            return

    yield from serve_handler(Handler)


@pytest.fixture
def serve() -> Iterator[Callable[..., str]]:
    servers: list[Iterator[str]] = []
    seen: list[dict[str, str]] = []

    def start(body: bytes, encoding: str) -> str:
        gen = _serve(body, encoding, seen)
        servers.append(gen)
        return next(gen)

    start.seen = seen  # type: ignore[attr-defined]
    yield start
    for gen in servers:
        next(gen, None)


def peak_of(call: Callable[[], Any]) -> tuple[Any, int]:
    """``call()``'s result (or exception) and the peak traced memory during it."""
    tracemalloc.start()
    try:
        try:
            result: Any = call()
        except Exception as exc:
            result = exc
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def config(url: str, **extra: Any) -> ProviderConfig:
    return ProviderConfig(name="p", kind="openai", base_url=url, model="m", timeout_s=60.0,
                          **extra)


@pytest.mark.parametrize("encoding, bomb", [("zstd", zstd_bomb), ("gzip", gzip_bomb)])
def test_a_bomb_in_the_chat_call_is_refused_within_the_limit(
        serve: Callable[..., str], encoding: str, bomb: Callable[[], bytes]) -> None:
    url = serve(bomb(), encoding)
    provider = OpenAIProvider(config(url), env={})
    error, peak = peak_of(lambda: provider.send(provider.build_request_bytes(REQ), REQ))
    assert isinstance(error, TransientProviderError), error
    assert error.code == PROVIDER_MALFORMED_RESPONSE
    assert f"larger than {MAX_RESPONSE_BYTES} bytes" in error.message
    assert peak < BOUND, f"peak {peak >> 20} MiB"


def test_a_bomb_in_providers_check_is_refused_within_the_limit(
        serve: Callable[..., str]) -> None:
    url = serve(zstd_bomb(), "zstd")
    result, peak = peak_of(lambda: probe_provider(config(url), env={}))
    assert (result.verdict, result.code) == ("refused", PROVIDER_MALFORMED_RESPONSE)
    assert peak < BOUND, f"peak {peak >> 20} MiB"


def test_a_bomb_from_the_tokenizer_is_refused_within_its_limit(
        serve: Callable[..., str]) -> None:
    # Asked for identity, the server sends zstd anyway.
    url = serve(zstd_bomb(), "zstd")
    with httpx.Client(timeout=60.0) as client:
        error, peak = peak_of(lambda: tokens.server_count(
            config(url, tokenizer="llama.cpp"), REQ.messages, client, {}))
    assert isinstance(error, ValueError), error
    assert "more than" in str(error)
    assert peak < tokens.MAX_TOKENIZE_RESPONSE_BYTES * 2 + 8 * MiB, f"peak {peak >> 20} MiB"


def test_an_unknown_encoding_is_refused_as_malformed(serve: Callable[..., str]) -> None:
    url = serve(b"\x0b\x02\x80ok\x03", "br")
    provider = OpenAIProvider(config(url), env={})
    with pytest.raises(TransientProviderError) as info:
        provider.send(provider.build_request_bytes(REQ), REQ)
    assert info.value.code == PROVIDER_MALFORMED_RESPONSE
    assert "'br'" in info.value.message


@pytest.mark.parametrize("encoding, encode", [
    ("gzip", lambda b: zlib.compress(b, wbits=31)),
    ("deflate", zlib.compress),
    ("deflate", lambda b: zlib.compress(b, wbits=-15)),  # raw deflate, as some servers send
    ("zstd", lambda b: zstandard.ZstdCompressor().compress(b)),
    ("identity", lambda b: b),
])
def test_a_compressed_completion_within_the_limit_is_read(
        serve: Callable[..., str], encoding: str, encode: Callable[[bytes], bytes]) -> None:
    url = serve(encode(COMPLETION), encoding)
    provider = OpenAIProvider(config(url), env={})
    assert provider.send(provider.build_request_bytes(REQ), REQ).content == "ok"
    assert serve.seen[-1]["Accept-Encoding"] == ACCEPT_ENCODING  # type: ignore[attr-defined]


def _response(body: bytes, encoding: str) -> httpx.Response:
    return httpx.Response(200, headers={"Content-Encoding": encoding},
                          stream=httpx.ByteStream(body))


def test_read_body_bounds_and_encodings() -> None:
    data = bytes(range(256)) * 64  # 16 KiB
    gz = zlib.compress(data, wbits=31)
    assert read_body(_response(gz, "gzip"), len(data)) == data
    with pytest.raises(BodyTooLarge):
        read_body(_response(gz, "gzip"), len(data) - 1)
    with pytest.raises(BodyTooLarge):  # the raw body alone is over
        read_body(_response(data, "identity"), len(data) - 1)
    # Encodings listed in the order applied: zstd first, then gzip.
    both = zlib.compress(zstandard.ZstdCompressor().compress(data), wbits=31)
    assert read_body(_response(both, "zstd, gzip"), len(data)) == data
    with pytest.raises(BodyUndecodable):
        read_body(_response(b"not gzip at all", "gzip"), 1 << 20)
    with pytest.raises(BodyUndecodable):
        read_body(_response(b"x", "compress"), 1 << 20)
    # A zstd frame that asks for a window over 8 MB is refused, not allocated.
    params = zstandard.ZstdCompressionParameters(window_log=27, write_content_size=False)
    co = zstandard.ZstdCompressor(compression_params=params).compressobj()
    wide = co.compress(bytes(MiB)) + co.flush()
    assert zstandard.get_frame_parameters(wide).window_size == 128 * MiB
    with pytest.raises(BodyUndecodable):
        read_body(_response(wide, "zstd"), 64 * MiB)
