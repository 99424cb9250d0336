"""The OpenAI-compatible chat-completions provider (hosted APIs, vLLM, llama.cpp, Ollama, LiteLLM).

One request is one ``POST {base_url}/chat/completions`` over httpx with a canonical JSON
body. Every httpx exception and every HTTP status is classified here, once, into the
:mod:`investigation.errors` provider tree (table in :mod:`investigation.llm.types`).

The API key is read from the environment variable named by ``api_key_env`` at send
time. It is sent only in the ``Authorization`` header: it is never part of the request
bytes the gateway stores, and it is redacted from every error message.
"""

from __future__ import annotations

import contextlib
import contextvars
import email.utils
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

import httpx

from investigation import jsonio
from investigation.config import MAX_COUNT, ProviderConfig, ordered_json
from investigation.errors import (
    ProviderConfigurationError,
    ProviderCredentialsError,
    ProviderError,
    ProviderRequestRejected,
    TransientProviderError,
)
from investigation.llm import dialects, tokens
from investigation.llm.body import ACCEPT_ENCODING, BodyTooLarge, BodyUndecodable, read_body
from investigation.llm.spend import MIN_OUTPUT_TOKENS
from investigation.llm.tokens import output_budget
from investigation.llm.types import (
    MAX_RESPONSE_BYTES,
    PROVIDER_BAD_CONFIG,
    PROVIDER_CREDENTIALS,
    PROVIDER_CREDENTIALS_MISSING,
    PROVIDER_HTTP_CLIENT_ERROR,
    PROVIDER_MALFORMED_RESPONSE,
    PROVIDER_NETWORK_ERROR,
    PROVIDER_RATE_LIMITED,
    PROVIDER_REQUEST_TOO_LARGE,
    PROVIDER_RETRYABLE_STATUS,
    PROVIDER_SCHEMA_REFUSED,
    PROVIDER_SERVER_ERROR,
    PROVIDER_TIMEOUT,
    PROVIDER_UNEXPECTED_STATUS,
    PROVIDER_UNREACHABLE,
    ChatRequest,
    ProviderReply,
    attach_response,
    redact,
)
from investigation.text_safety import escape_text, url_for_display

log = logging.getLogger(__name__)

#: Statuses worth retrying later (besides every 5xx).
RETRYABLE_STATUSES = frozenset({408, 409, 425, 429})
#: Every exception httpx raises from a request (``HTTPError`` is not the root of all).
HTTPX_ERRORS = (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError, httpx.CookieConflict)
#: Error ``code``/``type`` values that mean "this request is too large for the model".
CONTEXT_LENGTH_CODES = frozenset(
    {
        "context_length_exceeded",
        "string_above_max_length",
        "request_too_large",
        "exceed_context_size_error",
    }
)
_CONTEXT_LENGTH_MESSAGE = re.compile(
    r"context[ _-]?(length|window|size)|maximum context|prompt is too long"
    r"|request (entity )?(is )?too large|too many (input )?tokens",
    re.IGNORECASE,
)
#: Characters of a server's error message quoted in our error messages.
ERROR_EXCERPT_CHARS = 300
#: ``OpenAIProvider._model_listing`` before its one read.
_UNREAD: Any = object()
#: What :func:`_within` returns for work that did not finish in time.
_LATE: Any = object()


def _within(name: str, wait_s: float, work: Callable[[list[httpx.Client]], Any]) -> Any:
    """Run ``work(clients)`` in a helper thread named ``name`` and wait ``wait_s`` seconds
    for it: its result, the exception it raised (returned, not raised), or :data:`_LATE`.

    httpx bounds each read, not a whole exchange: a server dripping its status line or
    headers would hold the caller indefinitely (one header line every half second held
    ``providers check`` past two minutes, a hostile-input trial). ``work`` appends each
    ``httpx.Client`` it opens to ``clients``; when the wait runs out they are closed, so
    the helper's next read fails and the thread ends. The helper runs in a copy of the
    caller's context variables (the log lines' step context)."""
    outcome: list[Any] = []
    clients: list[httpx.Client] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append(work(clients))
        except BaseException as exc:
            outcome.append(exc)
        finally:
            done.set()

    # In the caller's context: what it logs carries the caller's step context (a fleet
    # trial's httpx lines inside llm_call named only the worker).
    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(run,), name=name, daemon=True).start()
    if not done.wait(wait_s):
        for client in clients:
            with contextlib.suppress(Exception):  # racing the helper thread
                client.close()
        return _LATE
    return outcome[0]


def _plausible_window(size: Any) -> int | None:
    """A server's stated window when it is a token count the config could hold."""
    if isinstance(size, int) and not isinstance(size, bool) and 256 <= size <= MAX_COUNT:
        return size
    return None


class OpenAIProvider:
    """An OpenAI-compatible chat-completions provider.

    Args:
        config: the provider entry (``kind = "openai"``; ``base_url`` and ``model``
            required). ``timeout_s`` bounds the connect, each read, each write and the
            pool wait separately (httpx semantics), in seconds.
        env: where the API key variable named by ``config.api_key_env`` is looked up at
            send time. Defaults to ``os.environ``.
        transport: an httpx transport to use instead of the network (tests pass
            ``httpx.MockTransport``). It is never closed by the provider.
        clock: timezone-aware "now", used to turn an HTTP-date ``Retry-After`` into
            seconds. Defaults to the system clock (UTC).

    Raises:
        ProviderConfigurationError: ``PROVIDER_BAD_CONFIG`` when ``base_url`` is not an
            ``http(s)://`` URL or ``model`` is missing.
    """

    def __init__(
        self,
        config: ProviderConfig,
        env: Mapping[str, str] = os.environ,
        transport: httpx.BaseTransport | None = None,
        *,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        if not config.base_url or not config.base_url.startswith(("http://", "https://")):
            raise ProviderConfigurationError(
                PROVIDER_BAD_CONFIG,
                f"provider {config.name!r}: base_url must be an http:// or https:// URL "
                f"(e.g. http://127.0.0.1:8000/v1), got "
                f"{url_for_display(config.base_url or '')!r}",
                provider=config.name,
            )
        if not config.model:
            raise ProviderConfigurationError(
                PROVIDER_BAD_CONFIG,
                f"provider {config.name!r}: set `model` to the model name the server serves",
                provider=config.name,
            )
        self.config = config
        self._env = env
        self._transport = transport
        self._clock = clock or (lambda: datetime.now(UTC))
        self.url = config.base_url.rstrip("/") + "/chat/completions"
        #: Why the configured ``tokenizer`` failed on the last count (the estimate was used
        #: instead), or ``None``; ``providers check`` reports it.
        self.tokenizer_failure: str | None = None
        self._listing: list[dict[str, Any]] | None = _UNREAD
        #: A window the server stated that is no token count, named for the probe's
        #: note (``served_window``), or ``None``.
        self.window_not_believed: str | None = None
        #: Seconds the last :meth:`send`'s HTTP exchange took (the POST and its answer,
        #: without counting the prompt's tokens first), or ``None`` before any; what
        #: ``providers check`` reports as the call's seconds and tokens per second.
        self.last_exchange_s: float | None = None

    @property
    def name(self) -> str:
        """The configured provider name."""
        return self.config.name

    @property
    def timeout_s(self) -> float:
        """The configured per-phase timeout in seconds."""
        return self.config.timeout_s

    # -- request -----------------------------------------------------------------------------

    def request_body(self, req: ChatRequest) -> dict[str, Any]:
        """The JSON body for ``req``: model, messages, options and the schema by dialect.

        ``structured_output`` selects how the per-turn reply schema is sent
        (:mod:`investigation.llm.dialects`). ``max_tokens`` is the request's own cap
        (a money cap may lower it) or the provider's.
        """
        body: dict[str, Any] = {
            "model": self.config.model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in req.messages],
        }
        if self.config.temperature is not None:
            body["temperature"] = self.config.temperature
        max_tokens = req.max_tokens if req.max_tokens is not None else self.config.max_tokens
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        response_format = dialects.response_format(
            self.config.structured_output, req.response_schema, req.schema_name,
            self.config.schema_max_string_chars)
        if response_format is not None:
            body["response_format"] = response_format
        return body

    def build_request_bytes(self, req: ChatRequest) -> bytes:
        """Compact JSON of :meth:`request_body` in the key order built (UTF-8):
        deterministic, and the schema's property order (the order a grammar-constrained
        server has the model write keys in) reaches the server unchanged.

        Raises:
            ProviderConfigurationError: ``PROVIDER_BAD_CONFIG`` when the request holds
                values JSON cannot carry (NaN, non-string keys, objects).
        """
        try:
            return ordered_json(self.request_body(req))
        except (TypeError, ValueError) as exc:
            raise ProviderConfigurationError(
                PROVIDER_BAD_CONFIG,
                f"provider {self.name!r}: the request cannot be encoded as JSON: {exc}",
                provider=self.name,
            ) from exc

    # -- send --------------------------------------------------------------------------------

    def send(self, request_bytes: bytes, req: ChatRequest) -> ProviderReply:
        """POST ``request_bytes`` and parse the chat completion.

        Raises:
            ProviderCredentialsError: the key variable is unset/empty
                (``PROVIDER_CREDENTIALS_MISSING``) or HTTP 401/403 (``PROVIDER_CREDENTIALS``).
            TransientProviderError: timeouts, network failures, 408/409/425/429/5xx (with
                ``retry_after_s`` from ``Retry-After``), malformed or truncated answers.
            ProviderRequestRejected: HTTP 413 or a context-length error.
            ProviderConfigurationError: any other 4xx, a 1xx/3xx status, a bad URL.
        """
        headers = {"Content-Type": "application/json", "Accept": "application/json",
                   "Accept-Encoding": ACCEPT_ENCODING}
        key = self._api_key()
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        secrets = [key]
        self._check_window(req, headers)
        started = time.monotonic()
        result = _within(f"provider-{self.name}", self.config.timeout_s + 1.0,
                         lambda clients: self._exchange(request_bytes, headers, key, secrets,
                                                        clients))
        self.last_exchange_s = time.monotonic() - started  # (_within returns, never raises)
        if result is _LATE:
            raise TransientProviderError(
                PROVIDER_TIMEOUT,
                f"provider {self.name!r}: no complete response within "
                f"timeout_s={self.config.timeout_s} (total)", provider=self.name)
        if isinstance(result, BaseException):
            raise result
        status, response_headers, raw = result
        return parse_http_response(status, response_headers, raw, self.name, self._clock(),
                                   secrets)

    def _exchange(self, request_bytes: bytes, headers: dict[str, str], key: str | None,
                  secrets: list[str | None],
                  clients: list[httpx.Client]) -> tuple[int, httpx.Headers, bytes]:
        deadline = time.monotonic() + self.config.timeout_s
        try:
            with self._client() as client:
                clients.append(client)  # the caller closes it at the total deadline
                with client.stream("POST", self.url, content=request_bytes,
                                   headers=headers) as response:
                    def in_time() -> None:
                        if time.monotonic() > deadline:
                            raise TransientProviderError(
                                PROVIDER_TIMEOUT,
                                f"provider {self.name!r}: the response took longer than "
                                f"timeout_s={self.config.timeout_s} in total", provider=self.name)

                    try:
                        body = read_body(response, MAX_RESPONSE_BYTES, in_time)
                    except BodyTooLarge as exc:
                        raise TransientProviderError(
                            PROVIDER_MALFORMED_RESPONSE,
                            f"provider {self.name!r}: response larger than "
                            f"{MAX_RESPONSE_BYTES} bytes", provider=self.name) from exc
                    except BodyUndecodable as exc:
                        raise TransientProviderError(
                            PROVIDER_MALFORMED_RESPONSE,
                            f"provider {self.name!r}: {exc}", provider=self.name) from exc
                    raw = redact_bytes(body, key)
        except HTTPX_ERRORS as exc:
            error = classify_httpx_error(exc, self.name, secrets,
                                         where=url_for_display(self.config.base_url or ""))
            if isinstance(exc, httpx.ReadTimeout | httpx.WriteTimeout):
                # The bound that ran out, to raise it; a connect or pool timeout is an
                # address that does not answer, which a longer bound only waits longer for.
                error = TransientProviderError(
                    PROVIDER_TIMEOUT, f"{error.message}; timeout_s = "
                    f"{self.config.timeout_s:g} bounds each read: raise it above the "
                    "seconds a call of this model takes (providers check measures one)",
                    **error.details)
            raise error from exc
        return response.status_code, response.headers, raw

    def content_from_raw(self, raw: bytes) -> str:
        """The assistant content of a stored successful chat-completion body.

        Raises:
            TransientProviderError: ``raw`` is malformed or truncated.
        """
        return parse_chat_completion(raw, 200, self.name).content

    def _check_window(self, req: ChatRequest, headers: dict[str, str]) -> None:
        """Refuse, before sending, a request over the model's context window.

        The prompt is counted by the server's tokenizer when ``tokenizer`` names one (a
        failing tokenizer falls back to the estimate), else estimated (``llm.tokens``).

        Raises:
            ProviderRequestRejected: ``PROVIDER_REQUEST_TOO_LARGE`` with the numbers.
        """
        window = self.config.context_window_tokens
        if window is None:
            return
        output = req.max_tokens or output_budget(self.config)
        count, method = None, f"estimate at {self.config.bytes_per_token:g} bytes per token"
        if self.config.tokenizer != "estimate":
            count = self._server_count(req, headers)
            if count is not None:
                method = f"the server's {self.config.tokenizer} tokenizer"
            else:
                method += f"; {self.tokenizer_note()}"
        if count is None:
            count = tokens.estimate_tokens(req.messages, self.config.bytes_per_token)
        if count + output > window:
            # The context was already shrunk towards this window (``fit_for_model``), so a
            # smaller policy limit cannot help; say what can (a real model's user tried
            # limits.max_context_bytes, which it named, to no effect).
            fits = window - count
            lower = (f"lower max_tokens to at most {fits} (replies longer than that would "
                     "be cut), or " if fits >= MIN_OUTPUT_TOKENS else "")
            raise ProviderRequestRejected(
                PROVIDER_REQUEST_TOO_LARGE,
                f"provider {self.name!r}: the request is {count} prompt tokens ({method}) "
                f"and {output} are kept for the reply, over the model's context window of "
                f"{window} tokens; not sent. The context is already as small as this step "
                f"allows: {lower}serve the model with a window of at least {count + output} "
                "tokens for this step, and leave room: a case's requests grow with its "
                "evidence and questions, often by a few thousand tokens (llama.cpp -c, "
                "llama-cpp-python --n_ctx, vLLM --max-model-len); set "
                "context_window_tokens to the window served, or use a model with a larger "
                "window",
                provider=self.name, prompt_tokens=count, context_window_tokens=window)

    def _server_count(self, req: ChatRequest, headers: dict[str, str]) -> int | None:
        """The server's token count of ``req``'s messages within ``timeout_s`` in total
        (a helper thread, closed at the deadline, as for the chat exchange), or ``None``
        when the tokenizer fails, is too slow or answers implausibly (the estimate is
        used then)."""
        deadline = time.monotonic() + self.config.timeout_s

        def count(clients: list[httpx.Client]) -> int:
            with self._client() as client:
                clients.append(client)
                return tokens.server_count(self.config, req.messages, client, headers,
                                           deadline)

        result = _within(f"tokenize-{self.name}", self.config.timeout_s + 1.0, count)
        if result is _LATE:
            log.info("provider %r: tokenize took longer than timeout_s; using the estimate",
                     self.name)
            self.tokenizer_failure = "it took longer than timeout_s"
            return None
        if isinstance(result, BaseException):
            log.info("provider %r: tokenize failed (%s); using the estimate", self.name,
                     type(result).__name__)
            self.tokenizer_failure = escape_text(str(result)[:200]) or type(result).__name__
            return None
        self.tokenizer_failure = None
        return int(result)

    def tokenizer_note(self) -> str:
        """Why the configured tokenizer was not used, and the likely fix: a llama.cpp
        server and llama-cpp-python count tokens at different paths (a real model's user
        set the example's "llama.cpp" for llama-cpp-python: a 404, and the estimate,
        counted 2929 tokens where the server counted 1980, without a word)."""
        tokenizer = self.config.tokenizer
        note = (f"the server's {tokenizer} tokenizer failed ({self.tokenizer_failure}), "
                "so tokens were estimated")
        other = {"llama.cpp": "llama-cpp-python", "llama-cpp-python": "llama.cpp"}.get(
            tokenizer)
        if other and "HTTP 404" in (self.tokenizer_failure or ""):
            note += f": if the server is {other}, set tokenizer = \"{other}\""
        return note

    def _get_json(self, url: str, limit_s: float) -> Any:
        """The JSON document the server answers to ``GET url`` (with the API key when one
        is set), or ``None``: an error status, a body that is not JSON or larger than
        1 MB, no answer within ``min(timeout_s, limit_s)`` seconds in all. Never raises
        for what the server does."""
        headers = {"Accept": "application/json", "Accept-Encoding": ACCEPT_ENCODING}
        try:
            key = self._api_key()
        except ProviderCredentialsError:
            return None
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        bound_s = min(self.config.timeout_s, limit_s)
        deadline = time.monotonic() + bound_s

        def in_time() -> None:
            if time.monotonic() > deadline:
                raise TimeoutError("the server took too long")

        def fetch(clients: list[httpx.Client]) -> Any:
            with self._client() as client:
                clients.append(client)
                with client.stream("GET", url, headers=headers) as response:
                    if response.status_code != 200:
                        return None
                    return jsonio.loads(read_body(response, 1 << 20, in_time))

        result = _within(f"get-{self.name}", bound_s + 0.5, fetch)
        if result is _LATE or isinstance(result, BaseException):  # whatever the server did
            return None
        return result

    def _model_listing(self, limit_s: float) -> list[dict[str, Any]] | None:
        """The entries of ``GET {base_url}/models`` (the OpenAI API's list,
        ``{"data": [{"id": ...}, ...]}``) that have a string ``id``, read once per
        provider object; ``None`` when the server lists none."""
        if self._listing is _UNREAD:
            listed = self._get_json(self.config.base_url.rstrip("/") + "/models",  # type: ignore[union-attr]
                                    limit_s)
            data = listed.get("data") if isinstance(listed, dict) else None
            entries = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)] \
                if isinstance(data, list) else []
            self._listing = entries or None
        return self._listing

    def served_models(self, limit_s: float = 10.0) -> list[str] | None:
        """The model ids the server lists at ``GET {base_url}/models``, or ``None`` when it
        lists none (see :meth:`_get_json` for what counts as none). ``providers check``
        compares the list with ``model`` (a server that serves one model answers a
        request for any name)."""
        listing = self._model_listing(limit_s)
        return [m["id"] for m in listing] if listing else None

    def served_window(self, limit_s: float = 10.0) -> tuple[int, str] | None:
        """The context window the server says one request has, in tokens, and where it
        said so, or ``None`` when it does not say:

        * vLLM: ``max_model_len`` of the listed model (``GET {base_url}/models``; the
          entry named ``model``, or the only one);
        * llama.cpp's ``llama-server``: ``default_generation_settings.n_ctx`` of
          ``GET {server}/props``, the window of one slot (``-c`` divided among
          ``--parallel`` slots).

        llama-cpp-python and Ollama do not say. ``providers check`` compares it with
        ``context_window_tokens``: a claim larger than the server's window passed the
        probe's small prompt and was refused by the server in the middle of a case."""
        self.window_not_believed = None
        listing = self._model_listing(limit_s) or []
        named = [m for m in listing if m["id"] == self.config.model] or \
            (listing if len(listing) == 1 else [])
        stated = named[0].get("max_model_len") if named else None
        if (size := _plausible_window(stated)) is not None:
            return size, "vLLM's max_model_len at /v1/models"
        self._note_unbelieved("max_model_len at /v1/models", stated)
        props = self._get_json(tokens.server_root(self.config.base_url or "") + "/props",
                               limit_s)
        settings = props.get("default_generation_settings") if isinstance(props, dict) \
            else None
        stated = settings.get("n_ctx") if isinstance(settings, dict) else None
        if (size := _plausible_window(stated)) is not None:
            return size, "llama.cpp's n_ctx per slot at /props"
        self._note_unbelieved("n_ctx at /props", stated)
        return None

    def _note_unbelieved(self, where: str, stated: Any) -> None:
        """Keep a stated window that is no token count (a hostile-input trial's server
        stated ``"2048"``, ``1024.0``, ``-5``; the note said "does not say")."""
        if stated is not None and self.window_not_believed is None:
            shown = escape_text(repr(stated))[:40]
            self.window_not_believed = f"{where} is {shown}, not a token count from 256 " \
                f"to {MAX_COUNT}"

    def check_credentials(self) -> None:
        """Check this provider's key as a call would read it, sending nothing (a worker's
        start-up check: a fleet trial's workers started without the key, passed every
        check and blocked each case at its first model call).

        Raises:
            ProviderCredentialsError: ``PROVIDER_CREDENTIALS_MISSING`` when the variable
                ``api_key_env`` names is unset or empty here, or holds whitespace or
                control characters inside the key. Nothing without ``api_key_env``.
        """
        self._api_key()

    def _api_key(self) -> str | None:
        var = self.config.api_key_env
        if not var:
            return None
        # A key read from a file often ends in a newline: surrounding whitespace is not
        # part of any key (and a header with it would fail, quoting the key).
        key = (self._env.get(var) or "").strip()
        if not key:
            raise ProviderCredentialsError(
                PROVIDER_CREDENTIALS_MISSING,
                f"provider {self.name!r}: environment variable {var} is not set; export the "
                f"API key in {var} where the model is called (the shell of `investigate run`, or "
                f"the workers' environment; the providers file names only the variable)",
                provider=self.name,
                api_key_env=var,
            )
        if any(ch.isspace() or not ch.isprintable() for ch in key):
            raise ProviderCredentialsError(
                PROVIDER_CREDENTIALS_MISSING,
                f"provider {self.name!r}: the key in {var} holds whitespace or control "
                "characters inside it; export the key alone", provider=self.name,
                api_key_env=var)
        return key

    @contextlib.contextmanager
    def _client(self) -> Iterator[httpx.Client]:
        timeout = httpx.Timeout(self.config.timeout_s)
        if self._transport is not None:
            # An injected transport belongs to the caller: do not close it.
            yield httpx.Client(transport=self._transport, timeout=timeout)
            return
        with httpx.Client(timeout=timeout, follow_redirects=False) as client:
            yield client


# -- classification ------------------------------------------------------------------------


def classify_httpx_error(
    exc: Exception, provider: str, secrets: list[str | None] | None = None,
    where: str | None = None,
) -> ProviderError:
    """Map an httpx exception to the provider error tree (no response was received).

    ================================================  =====================================
    httpx exception                                   result
    ================================================  =====================================
    ``TimeoutException`` (connect/read/write/pool)    transient ``PROVIDER_TIMEOUT``
    ``ConnectError``, ``ProxyError``                  transient ``PROVIDER_UNREACHABLE``
    ``ReadError``, ``WriteError``, ``CloseError``,    transient ``PROVIDER_NETWORK_ERROR``
    ``RemoteProtocolError``, ``DecodingError``,
    other ``NetworkError``/``TransportError``
    ``UnsupportedProtocol``, ``LocalProtocolError``,  configuration ``PROVIDER_BAD_CONFIG``
    ``TooManyRedirects``, ``InvalidURL``, stream
    misuse, ``CookieConflict``
    ================================================  =====================================

    Args:
        exc: the exception httpx raised.
        provider: provider name for the message.
        secrets: values to redact from the message.
        where: the address called (a password masked), named where no answer came back
            (a user's `run` said "unreachable" without saying where).

    Returns:
        The classified error (the caller raises it ``from exc``).
    """
    text = redact(f"{type(exc).__name__}: {exc}", secrets or [])
    name = type(exc).__name__
    at = f" at {redact(where, secrets or [])}" if where else ""
    if isinstance(exc, httpx.TimeoutException):
        return TransientProviderError(
            PROVIDER_TIMEOUT, f"provider {provider!r}{at} timed out ({text})",
            provider=provider, exception=name,
        )
    if isinstance(exc, httpx.ConnectError | httpx.ProxyError):
        return TransientProviderError(
            PROVIDER_UNREACHABLE,
            f"provider {provider!r}{at} is unreachable ({text}); check that the server runs",
            provider=provider, exception=name,
        )
    if isinstance(
        exc,
        httpx.UnsupportedProtocol
        | httpx.LocalProtocolError
        | httpx.TooManyRedirects
        | httpx.InvalidURL
        | httpx.StreamError
        | httpx.CookieConflict,
    ):
        return ProviderConfigurationError(
            PROVIDER_BAD_CONFIG,
            f"provider {provider!r} cannot be used as configured ({text}); check base_url",
            provider=provider, exception=name,
        )
    # NetworkError (read/write/close), RemoteProtocolError, DecodingError, any other
    # transport or request error: the exchange broke; trying again may work.
    return TransientProviderError(
        PROVIDER_NETWORK_ERROR, f"provider {provider!r}: connection failed ({text})",
        provider=provider, exception=name,
    )


def parse_http_response(
    status: int,
    headers: Mapping[str, str],
    raw: bytes,
    provider: str,
    now: datetime,
    secrets: list[str | None] | None = None,
) -> ProviderReply:
    """Classify an HTTP answer and parse a successful chat completion.

    Args:
        status: HTTP status code.
        headers: response headers (case-insensitive mapping).
        raw: the exact response body.
        provider: provider name for messages.
        now: timezone-aware now, for an HTTP-date ``Retry-After``.
        secrets: values to redact from messages.

    Returns:
        The parsed reply for a 2xx with a complete message content.

    Raises:
        ProviderError: see :class:`OpenAIProvider.send`; ``raw`` and ``status`` are
            attached (:func:`~investigation.llm.types.attach_response`).
    """
    if 200 <= status < 300:
        return parse_chat_completion(raw, status, provider)
    excerpt = redact(_error_excerpt(raw), secrets or [])
    details = {"provider": provider, "http_status": status}
    error: ProviderError
    if status in (401, 403):
        error = ProviderCredentialsError(
            PROVIDER_CREDENTIALS,
            f"provider {provider!r} refused the credentials (HTTP {status}: {excerpt}); "
            + ("check the key in the variable named by api_key_env" if any(secrets or [])
               else "no key was sent: the provider has no api_key_env (add it, naming "
               "the environment variable that holds the key)"),
            **details,
        )
    elif status not in RETRYABLE_STATUSES and status not in (413, 502, 503, 504) \
            and not (status == 400 and _is_context_length_error(raw)) \
            and _names_structured_output(raw):
        error = ProviderConfigurationError(
            PROVIDER_SCHEMA_REFUSED,
            f"provider {provider!r} refused the structured-output request (HTTP {status}: "
            f"{excerpt}); set structured_output to the dialect this server takes"
            f"{_dialect_hint(excerpt)} (docs/reply-contract.md) and check it with "
            "`investigate providers check`",
            **details,
        )
    elif status in RETRYABLE_STATUSES or 500 <= status < 600:
        code = (
            PROVIDER_RATE_LIMITED
            if status == 429
            else PROVIDER_SERVER_ERROR
            if status >= 500
            else PROVIDER_RETRYABLE_STATUS
        )
        error = TransientProviderError(
            code,
            f"provider {provider!r} answered HTTP {status}: {excerpt}",
            retry_after_s=retry_after_seconds(headers, now),
            **details,
        )
    elif status == 413 or (status == 400 and _is_context_length_error(raw)):
        error = ProviderRequestRejected(
            PROVIDER_REQUEST_TOO_LARGE,
            f"provider {provider!r} cannot accept a request this large (HTTP {status}: "
            f"{excerpt}); set the provider's context_window_tokens to the server's window "
            "(the context is then fitted to it), or serve a model with a larger one",
            **details,
        )
    elif 400 <= status < 500:
        error = ProviderConfigurationError(
            PROVIDER_HTTP_CLIENT_ERROR,
            f"provider {provider!r} rejected the request (HTTP {status}: {excerpt}); check "
            "base_url, model and structured_output for this server",
            **details,
        )
    else:
        error = ProviderConfigurationError(
            PROVIDER_UNEXPECTED_STATUS,
            f"provider {provider!r} answered HTTP {status}, which is neither success nor "
            "error; check base_url (redirects are not followed)",
            **details,
        )
    raise attach_response(error, raw, status)


def parse_chat_completion(raw: bytes, status: int | None, provider: str) -> ProviderReply:
    """Parse a chat-completion body into a :class:`ProviderReply`.

    A reply cut at the token limit (``finish_reason: "length"``) is a reply: it is
    returned with its ``finish_reason``, stored, and judged by validation
    (``REPLY_TRUNCATED`` when it does not parse), so the next request carries that
    rejection and is never the same request resent unchanged.

    Raises:
        TransientProviderError: ``PROVIDER_MALFORMED_RESPONSE`` when the body is not JSON
            or lacks ``choices[0].message.content`` as a string.
    """

    def malformed(why: str) -> TransientProviderError:
        error = TransientProviderError(
            PROVIDER_MALFORMED_RESPONSE,
            f"provider {provider!r} sent a malformed chat completion: {why}",
            provider=provider,
            http_status=status,
        )
        attach_response(error, raw, status)
        return error

    try:
        doc = jsonio.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise malformed(f"body is not JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise malformed("body is not a JSON object")
    choices = doc.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise malformed("no choices[0]")
    choice = choices[0]
    message = choice.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        refusal = message.get("refusal") if isinstance(message, dict) else None
        why = "the model refused" if refusal else "choices[0].message.content is not a string"
        raise malformed(why)
    usage_doc = doc.get("usage")
    usage: dict[str, Any] = usage_doc if isinstance(usage_doc, dict) else {}
    finish = choice.get("finish_reason")
    return ProviderReply(
        content=content,
        raw=raw,
        http_status=status,
        prompt_tokens=_count(usage.get("prompt_tokens")),
        completion_tokens=_count(usage.get("completion_tokens")),
        finish_reason=finish if isinstance(finish, str) and _FINISH.fullmatch(finish)
        else None,
    )


#: A ``finish_reason`` worth keeping (``stop``, ``length``, ``tool_calls``, ``eos``...):
#: anything else is dropped, never stored (a NUL in it failed PostgreSQL's text column
#: and lost the paid reply, a hostile-input trial).
_FINISH = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def retry_after_seconds(headers: Mapping[str, str], now: datetime) -> float | None:
    """Seconds to wait from ``Retry-After`` (delta-seconds or HTTP-date) or ``retry-after-ms``.

    Args:
        headers: response headers (case-insensitive mapping).
        now: timezone-aware now; an HTTP-date in the past gives ``0.0``.

    Returns:
        Non-negative seconds, or ``None`` when no usable header is present.
    """
    value = (headers.get("retry-after") or "").strip()
    if value:
        try:
            seconds = float(value)
        except ValueError:
            seconds = None
        if seconds is not None:
            return seconds if math.isfinite(seconds) and seconds >= 0 else None
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            when = None
        if when is not None:
            if when.tzinfo is None:
                when = when.replace(tzinfo=UTC)
            return max(0.0, (when - now).total_seconds())
    millis = (headers.get("retry-after-ms") or "").strip()
    if millis:
        try:
            ms = float(millis)
        except ValueError:
            return None
        return ms / 1000.0 if math.isfinite(ms) and ms >= 0 else None
    return None


#: Words of a server's error that name the structured-output part of a request.
_STRUCTURED_OUTPUT_WORDS = re.compile(
    r"response_format|json_schema|json_object|\bschema\b|grammar|guided_(json|decoding)"
    r"|\bgbnf\b|xgrammar|outlines|llguidance", re.IGNORECASE)


def _names_structured_output(raw: bytes) -> bool:
    """Whether an error body names ``response_format``, a schema or a grammar."""
    return bool(_STRUCTURED_OUTPUT_WORDS.search(raw[:8192].decode("utf-8", "replace")))


def _is_context_length_error(raw: bytes) -> bool:
    try:
        doc = jsonio.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return bool(_CONTEXT_LENGTH_MESSAGE.search(raw[:4096].decode("utf-8", "replace")))
    error = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(error, dict):
        for key in ("code", "type"):
            if str(error.get(key, "")).lower() in CONTEXT_LENGTH_CODES:
                return True
        message = str(error.get("message", ""))
    elif isinstance(error, str):
        message = error
    elif isinstance(doc, dict):
        message = str(doc.get("message") or doc.get("detail") or "")
    else:
        message = ""
    return bool(_CONTEXT_LENGTH_MESSAGE.search(message[:4096]))


def _error_excerpt(raw: bytes) -> str:
    """The server's error message (OpenAI ``{"error": {"message"}}`` or raw text), bounded."""
    text: str
    try:
        doc = jsonio.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        text = raw[: ERROR_EXCERPT_CHARS * 4].decode("utf-8", "replace")
    else:
        error = doc.get("error") if isinstance(doc, dict) else None
        if isinstance(error, dict) and error.get("message"):
            text = str(error["message"])
        elif isinstance(error, str):
            text = error
        elif isinstance(doc, dict) and (doc.get("detail") or doc.get("message")):
            text = str(doc.get("detail") or doc.get("message"))
        else:
            text = raw[: ERROR_EXCERPT_CHARS * 4].decode("utf-8", "replace")
    text = " ".join(text.split())
    # A server's own traceback is noise to the reader (a real model's user read
    # 'File "/.../app.py", lin...' in a dialect refusal): the message ends before it.
    for marker in ("Traceback (most recent call last)", 'File "'):
        at = text.find(marker)
        if at > 0:
            text = text[:at].rstrip(" ,:;") + " ..."
    if len(text) > ERROR_EXCERPT_CHARS:
        text = text[:ERROR_EXCERPT_CHARS] + "..."
    return text or "(empty body)"


#: What a server's refusal of a structured-output request says, and the dialect that server
#: takes (docs/reply-contract.md).
_DIALECT_SIGNATURES = (
    ("'text' or 'json_object'", "llama-cpp-python takes structured_output = \"llama_cpp\""),
)


def _dialect_hint(excerpt: str) -> str:
    """The dialect to set when a refusal reads as a known server's (a real model's user
    was told to set 'the dialect this server takes' without a name)."""
    for signature, hint in _DIALECT_SIGNATURES:
        if signature in excerpt:
            return f" ({hint})"
    return ""


def _count(value: Any) -> int | None:
    """A plausible token count (0 <= n < 2**31), else ``None``: usage is informative only."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31
    return value if ok else None


def redact_bytes(raw: bytes, secret: str | None) -> bytes:
    """``raw`` with every occurrence of ``secret`` replaced by ``[REDACTED]``: a server that
    echoes the API key must not put it in the store (stored bytes are exact otherwise)."""
    if not secret or len(secret) < 4:
        return raw
    raw = raw.replace(secret.encode("utf-8"), b"[REDACTED]")
    # A JSON body may carry the key escaped (\u0073\u006b...): find it in the decoded
    # strings and, if there, store the body re-serialised with the key replaced.
    try:
        doc = jsonio.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return raw
    if secret not in json.dumps(doc, ensure_ascii=False):
        return raw

    def scrub(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace(secret, "[REDACTED]")
        if isinstance(value, list):
            return [scrub(v) for v in value]
        if isinstance(value, dict):
            return {scrub(k): scrub(v) for k, v in value.items()}
        return value

    return json.dumps(scrub(doc), ensure_ascii=False).encode("utf-8", "surrogatepass")
