"""The HTTP provider against hostile loopback servers: a total deadline and no key stored."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from investigation.config import ProviderConfig
from investigation.errors import ProviderCredentialsError, TransientProviderError
from investigation.llm.openai import OpenAIProvider, redact_bytes
from investigation.llm.types import ChatRequest

REQ = ChatRequest(messages=[{"role": "user", "content": "hi"}], response_schema={},
                  schema_name="r", call_index=0, case_id="c")


class _Drip(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "1000")
        self.end_headers()
        for _ in range(40):  # one byte every 0.2 s: each read is quick, the whole is slow
            try:
                self.wfile.write(b" ")
                self.wfile.flush()
            except OSError:
                return
            time.sleep(0.2)

    def log_message(self, *_: object) -> None:
        return


class _Echo(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"error": {"message": "bad key " + self.headers["Authorization"]}})
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *_: object) -> None:
        return


def serve_handler(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def drip_url() -> Iterator[str]:
    yield from serve_handler(_Drip)


@pytest.fixture
def echo_url() -> Iterator[str]:
    yield from serve_handler(_Echo)


def test_a_dripping_server_hits_the_total_deadline(drip_url: str) -> None:
    provider = OpenAIProvider(ProviderConfig(name="p", kind="openai", base_url=drip_url,
                                             model="m", timeout_s=1.0), env={})
    started = time.monotonic()
    with pytest.raises(TransientProviderError) as err:
        provider.send(provider.build_request_bytes(REQ), REQ)
    assert err.value.code == "PROVIDER_TIMEOUT"
    assert time.monotonic() - started < 4.0  # 8 s of dripping were not waited out


def test_an_echoed_key_is_redacted_in_the_response_bytes(echo_url: str) -> None:
    secret = "sk-test-0123456789"
    provider = OpenAIProvider(ProviderConfig(name="p", kind="openai", base_url=echo_url,
                                             model="m", api_key_env="K"), env={"K": secret})
    with pytest.raises(ProviderCredentialsError) as err:
        provider.send(provider.build_request_bytes(REQ), REQ)
    from investigation.llm.types import response_of

    raw, status = response_of(err.value)
    assert status == 401 and raw is not None
    assert secret.encode() not in raw and b"[REDACTED]" in raw
    assert secret not in str(err.value)


def test_redact_bytes_leaves_other_bytes_exact() -> None:
    assert redact_bytes(b"a KEY1234 b KEY1234", "KEY1234") == b"a [REDACTED] b [REDACTED]"
    assert redact_bytes(b"abc", None) == b"abc"


def test_an_escaped_echoed_key_is_redacted_too() -> None:
    secret = "sk-test-0123456789"
    escaped = "".join(f"\\u{ord(c):04x}" for c in secret)
    raw = ('{"choices": [{"message": {"content": "key ' + escaped + '"}}]}').encode()
    cleaned = redact_bytes(raw, secret)
    assert secret not in json.loads(cleaned)["choices"][0]["message"]["content"]
    assert "[REDACTED]" in json.loads(cleaned)["choices"][0]["message"]["content"]
    assert redact_bytes(b'{"a": "b"}', secret) == b'{"a": "b"}'  # untouched otherwise


class _DripHeaders(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        try:
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            for i in range(60):  # a header line every 0.2 s, never the blank line
                self.wfile.write(f"X-Slow-{i}: y\r\n".encode())
                self.wfile.flush()
                time.sleep(0.2)
        except OSError:
            return

    def log_message(self, *_: object) -> None:
        return


@pytest.fixture
def header_drip_url() -> Iterator[str]:
    yield from serve_handler(_DripHeaders)


def test_dripping_headers_hit_the_total_deadline(header_drip_url: str) -> None:
    provider = OpenAIProvider(ProviderConfig(name="p", kind="openai",
                                             base_url=header_drip_url, model="m",
                                             timeout_s=1.0), env={})
    started = time.monotonic()
    with pytest.raises(TransientProviderError) as err:
        provider.send(provider.build_request_bytes(REQ), REQ)
    assert err.value.code == "PROVIDER_TIMEOUT"
    assert time.monotonic() - started < 4.0  # 12 s of dripping headers were not waited out
    # The abandoned exchange does not linger: its client was closed at the deadline.
    for _ in range(30):
        if not [t for t in threading.enumerate() if t.name.startswith("provider-")]:
            break
        time.sleep(0.1)
    assert not [t for t in threading.enumerate() if t.name.startswith("provider-")]
