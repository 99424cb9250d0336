"""A loopback OpenAI-compatible chat-completions server that replays recorded replies.

Use it to run the real HTTP provider end to end without a model: demos, integration
tests, reproducing a recorded investigation through the network path.

* ``POST /v1/chat/completions`` answers a standard ``chat.completion`` whose message
  content is the next unused reply line. Keyed by the sha256 of the request body: an
  identical body (a resend after a crash or a retry) gets the same reply again, a new
  body gets the next line. Past the last line: HTTP 400 with an OpenAI-style error.
* ``GET /v1/models`` lists one model; with ``window``, the server states its context
  window as vLLM (``max_model_len`` in that list) or llama.cpp (``GET /props``) do.
* ``POST /extras/tokenize/count`` (llama-cpp-python's) counts a token per 4 bytes.
* Binding is refused for anything but a loopback address.
* ``faults`` inject failures (status, headers, body, delay, truncation) into the next
  matching requests, in order; see :class:`Fault`.

The answer is deterministic: ``id`` is derived from the reply index, ``created`` is 0
and token counts are derived from byte lengths.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import socket
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any

from investigation import jsonio
from investigation.llm.scripted import read_script_lines

log = logging.getLogger(__name__)

#: Largest request body accepted, in bytes (larger: HTTP 413).
MAX_REQUEST_BYTES = 32 << 20
CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
#: llama.cpp's server properties (its window per slot).
PROPS_PATH = "/props"
TOKENIZE_COUNT_PATH = "/extras/tokenize/count"
#: Internal marker from ``handle`` to the handler: cut the body after N bytes (never sent).
_CUT_AFTER_HEADER = "x-replay-cut-after"


@dataclass(frozen=True)
class Fault:
    """A failure injected into the next request whose path equals ``path``.

    If ``status`` or ``body`` is set, that answer is sent (after ``delay_s``) and no
    reply line is used. Otherwise the request is answered normally after ``delay_s``
    seconds, with ``finish_reason`` overriding ``"stop"`` when given.

    Args:
        status: HTTP status to answer with (default 200 when only ``body`` is set).
        headers: extra response headers, e.g. ``{"Retry-After": "30"}``.
        body: exact response body; default for a status >= 400 is an OpenAI-style
            error object.
        delay_s: seconds to wait before answering (a client timeout test).
        finish_reason: ``finish_reason`` of a normal answer, e.g. ``"length"``.
        path: request path the fault applies to.
        cut_after: when set, the connection is closed after this many bytes of the body,
            although ``Content-Length`` announces all of it (a reply cut off in transit).
    """

    status: int | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes | None = None
    delay_s: float = 0.0
    finish_reason: str | None = None
    path: str = CHAT_PATH
    cut_after: int | None = None

    @classmethod
    def http(cls, status: int, retry_after: str | None = None, body: bytes | None = None) -> Fault:
        """Answer with ``status`` (and ``Retry-After`` when given)."""
        headers = {"Retry-After": retry_after} if retry_after is not None else {}
        return cls(status=status, headers=headers, body=body)

    @classmethod
    def malformed(cls) -> Fault:
        """Answer 200 with a body that is not JSON."""
        return cls(status=200, body=b'{"choices": [ this is not json')

    @classmethod
    def truncated(cls) -> Fault:
        """Answer normally, but with ``finish_reason: "length"``."""
        return cls(finish_reason="length")

    @classmethod
    def cut_off(cls, after_bytes: int = 20) -> Fault:
        """Answer normally, but close the connection after ``after_bytes`` body bytes."""
        return cls(cut_after=after_bytes)

    @classmethod
    def delay(cls, seconds: float) -> Fault:
        """Answer normally after ``seconds``."""
        return cls(delay_s=seconds)


@dataclass(frozen=True)
class RecordedRequest:
    """A request the server received (for assertions): method, path, headers, exact body."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


def _error_body(message: str, code: str, kind: str = "invalid_request_error") -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": kind, "code": code, "param": None}}
    ).encode("utf-8")


class ReplayServer:
    """A threaded loopback HTTP server answering chat completions from ``replies``.

    Args:
        replies: reply texts in order (typically JSON documents, one per decision).
        host: loopback address to bind (``127.0.0.1``, ``::1`` or ``localhost``).
        port: TCP port; 0 picks a free one (see :attr:`base_url`).
        faults: failures to inject, consumed in order (see :class:`Fault`).
        model: the model id reported by ``/v1/models`` and in answers.
        window: a context window the server states, as ``(tokens, server)``: ``"vllm"``
            lists it as ``max_model_len`` at ``/v1/models``, ``"llama.cpp"`` answers
            ``GET /props`` with ``default_generation_settings.n_ctx``; default none (as
            llama-cpp-python: ``/props`` is not found).

    Raises:
        ValueError: ``host`` is not a loopback address.
    """

    def __init__(
        self,
        replies: Sequence[str],
        host: str = "127.0.0.1",
        port: int = 0,
        faults: Sequence[Fault] = (),
        model: str = "replay",
        window: tuple[int, str] | None = None,
    ) -> None:
        bind_host = "127.0.0.1" if host == "localhost" else host
        try:
            address = ipaddress.ip_address(bind_host)
        except ValueError as exc:
            raise ValueError(f"ReplayServer binds only to loopback addresses, got {host!r}") from exc
        if not address.is_loopback:
            raise ValueError(f"ReplayServer binds only to loopback addresses, got {host!r}")
        self.replies = list(replies)
        self.model = model
        self.window = window
        self._host = bind_host
        self._ipv6 = address.version == 6
        self._port = port
        self._faults = list(faults)
        self._lock = threading.Lock()
        self._by_body: dict[str, int] = {}
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.requests: list[RecordedRequest] = []

    @classmethod
    def from_jsonl(cls, path: str | Path, **kwargs: Any) -> ReplayServer:
        """A server replaying the non-blank lines of a JSON Lines file (UTF-8)."""
        lines = [line.decode("utf-8") for line in read_script_lines(Path(path))]
        return cls(lines, **kwargs)

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """``http://HOST:PORT/v1`` (valid after :meth:`start`)."""
        if self._server is None:
            raise RuntimeError("ReplayServer is not started")
        port = self._server.server_address[1]
        host = f"[{self._host}]" if self._ipv6 else self._host
        return f"http://{host}:{port}/v1"

    def start(self) -> ReplayServer:
        """Bind and serve in a daemon thread; returns ``self``."""
        if self._server is not None:
            raise RuntimeError("ReplayServer already started")
        handler = _make_handler(self)
        server_cls = _IPv6Server if self._ipv6 else _Server
        self._server = server_cls((self._host, self._port), handler)
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
            name="replay-server", daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, interrupt injected delays and close the socket (idempotent)."""
        if self._server is None:
            return
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None
        self._thread = None

    def __enter__(self) -> ReplayServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def add_faults(self, *faults: Fault) -> None:
        """Queue more failures after those given at construction (thread-safe).

        A running server can so answer a case's first requests normally and fail a later
        one: tests inject the fault just before the step that should meet it.
        """
        with self._lock:
            self._faults.extend(faults)

    # -- request handling (called from handler threads) --------------------------------------

    def _take_fault(self, path: str) -> Fault | None:
        with self._lock:
            for i, fault in enumerate(self._faults):
                if fault.path == path:
                    return self._faults.pop(i)
        return None

    def _reply_index(self, body: bytes) -> int | None:
        """The reply line for ``body``: the same for an identical body, else the next one."""
        key = hashlib.sha256(body).hexdigest()
        with self._lock:
            if key in self._by_body:
                return self._by_body[key]
            index = len(self._by_body)
            if index >= len(self.replies):
                return None
            self._by_body[key] = index
            return index

    def _chat(self, body: bytes, finish_reason: str | None) -> tuple[int, dict[str, str], bytes]:
        try:
            doc = jsonio.loads(body)
        except (ValueError, UnicodeDecodeError):
            return 400, {}, _error_body("request body is not JSON", "invalid_json")
        if not isinstance(doc, dict) or not isinstance(doc.get("messages"), list):
            return 400, {}, _error_body("request needs a 'messages' list", "invalid_request")
        index = self._reply_index(body)
        if index is None:
            return 400, {}, _error_body(
                f"replay script exhausted: all {len(self.replies)} replies are served",
                "replay_exhausted",
            )
        content = self.replies[index]
        prompt_tokens = len(body) // 4
        completion_tokens = max(1, len(content.encode("utf-8")) // 4)
        answer = {
            "id": f"chatcmpl-replay-{index}",
            "object": "chat.completion",
            "created": 0,
            "model": str(doc.get("model") or self.model),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": finish_reason or "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
        return 200, {}, json.dumps(answer, ensure_ascii=False).encode("utf-8")

    def _models(self) -> bytes:
        entry: dict[str, Any] = {"id": self.model, "object": "model", "created": 0,
                                 "owned_by": "replay"}
        if self.window is not None and self.window[1] == "vllm":
            entry["max_model_len"] = self.window[0]
        return json.dumps({"object": "list", "data": [entry]}).encode("utf-8")

    def handle(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes] | None:
        """Compute the answer ``(status, headers, body)``; ``None`` when stopped during a delay."""
        with self._lock:
            self.requests.append(RecordedRequest(method, path, headers, body))
        fault = self._take_fault(path)
        if fault is not None and fault.delay_s > 0 and self._stopping.wait(fault.delay_s):
            return None
        if fault is not None and (fault.status is not None or fault.body is not None):
            status = fault.status if fault.status is not None else 200
            payload = fault.body
            if payload is None:
                payload = (
                    _error_body(f"injected HTTP {status}", f"injected_{status}", "server_error")
                    if status >= 400 else b""
                )
            return status, dict(fault.headers), payload
        extra = dict(fault.headers) if fault is not None else {}
        if fault is not None and fault.cut_after is not None:
            extra[_CUT_AFTER_HEADER] = str(fault.cut_after)
        if method == "POST" and path == CHAT_PATH:
            status, hdrs, payload = self._chat(body, fault.finish_reason if fault else None)
            return status, {**hdrs, **extra}, payload
        if method == "GET" and path == MODELS_PATH:
            return 200, extra, self._models()
        if method == "GET" and path == PROPS_PATH and self.window is not None \
                and self.window[1] == "llama.cpp":
            return 200, extra, json.dumps({"default_generation_settings": {
                "n_ctx": self.window[0]}, "total_slots": 1}).encode("utf-8")
        if method == "POST" and path == TOKENIZE_COUNT_PATH:
            return self._tokenize_count(body)
        return 404, {}, _error_body(f"no route {method} {path}", "not_found")

    def _tokenize_count(self, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """llama-cpp-python's ``/extras/tokenize/count``: a token per 4 bytes, like usage."""
        try:
            doc = jsonio.loads(body)
            text = doc["input"]
        except (ValueError, KeyError, TypeError):
            return 400, {}, _error_body("body needs an 'input' string", "invalid_request")
        if not isinstance(text, str):
            return 400, {}, _error_body("body needs an 'input' string", "invalid_request")
        return 200, {}, json.dumps({"count": len(text.encode("utf-8")) // 4}).encode()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out and hung up is expected in fault tests: stay quiet.
        log.debug("replay server: connection from %s ended abruptly", client_address,
                  exc_info=True)


class _IPv6Server(_Server):
    address_family = socket.AF_INET6


def _make_handler(server: ReplayServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "ReplayServer/1"

        def _serve(self, method: str) -> None:
            length_text = self.headers.get("Content-Length", "0")
            try:
                length = int(length_text)
            except ValueError:
                length = -1
            if length < 0 or length > MAX_REQUEST_BYTES:
                self._send(413 if length > 0 else 400, {},
                           _error_body("bad or too large Content-Length", "request_too_large"))
                return
            body = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            answer = server.handle(method, self.path, headers, body)
            if answer is None:
                self.close_connection = True
                return
            self._send(*answer)

        def _send(self, status: int, headers: dict[str, str], body: bytes) -> None:
            headers = dict(headers)
            cut = headers.pop(_CUT_AFTER_HEADER, None)
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body if cut is None else body[: int(cut)])
            except OSError:
                pass  # the client hung up (timeout tests)
            self.close_connection = True

        def do_POST(self) -> None:
            self._serve("POST")

        def do_GET(self) -> None:
            self._serve("GET")

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("replay server: " + format, *args)

    return Handler
