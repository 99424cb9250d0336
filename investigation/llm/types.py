"""Shared shapes of the LLM layer: requests, replies, the provider protocol, outcomes.

A :class:`Provider` turns a :class:`ChatRequest` into exact request bytes
(:meth:`Provider.build_request_bytes`), sends those bytes
(:meth:`Provider.send`) and classifies every failure once, as a
:class:`~investigation.errors.ProviderError` subclass:

=====================================  ==============================================
failure                                class (gateway reaction)
=====================================  ==============================================
timeout, connection, protocol errors   ``TransientProviderError`` (failover, backoff)
HTTP 408/409/425/429/5xx               ``TransientProviderError`` with ``retry_after_s``
malformed 2xx body                     ``TransientProviderError``
HTTP 401/403, missing key variable     ``ProviderCredentialsError`` (block)
HTTP 413, context length exceeded,     ``ProviderRequestRejected`` (failover, else block)
a request over the context window
4xx/5xx naming response_format,        ``ProviderConfigurationError`` (block at once)
a schema or a grammar
other 4xx, bad URL, script exhausted   ``ProviderConfigurationError`` (block)
=====================================  ==============================================

A reply cut at the token limit (``finish_reason: "length"``) is a reply, not a failure
(validation judges it). Repeats on identical request bytes are reclassified by
:mod:`investigation.llm.failures`:

=====================================  ==============================================
the same 5xx body twice                ``PROVIDER_DETERMINISTIC_ERROR`` (block)
the connection dropped three times     ``PROVIDER_REQUEST_DROPPED`` (block)
=====================================  ==============================================

The :class:`~investigation.llm.gateway.LLMGateway` returns one of the three outcome
types :class:`Succeeded`, :class:`RetryPending` and :class:`Blocked`; it never raises a
provider failure and never sleeps.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from investigation.errors import ProviderError

#: Roles accepted in :attr:`ChatRequest.messages`.
MESSAGE_ROLES = ("system", "user", "assistant")
#: Largest reply a provider may give (bytes): an HTTP response body beyond it is a failed
#: attempt; a scripted reply line beyond it makes the script unreadable.
MAX_RESPONSE_BYTES = 16 << 20

# -- stable provider error codes (``ProviderError.code``) -----------------------------------
#: A timeout (connect, read, write or pool) elapsed. Transient.
PROVIDER_TIMEOUT = "PROVIDER_TIMEOUT"
#: The server could not be reached (connection refused, DNS, proxy). Transient.
PROVIDER_UNREACHABLE = "PROVIDER_UNREACHABLE"
#: The connection broke while talking to the server. Transient.
PROVIDER_NETWORK_ERROR = "PROVIDER_NETWORK_ERROR"
#: HTTP 429. Transient, usually with ``Retry-After``.
PROVIDER_RATE_LIMITED = "PROVIDER_RATE_LIMITED"
#: HTTP 5xx. Transient.
PROVIDER_SERVER_ERROR = "PROVIDER_SERVER_ERROR"
#: HTTP 408, 409 or 425. Transient.
PROVIDER_RETRYABLE_STATUS = "PROVIDER_RETRYABLE_STATUS"
#: A 2xx body that is not a chat completion with a message content. Transient.
PROVIDER_MALFORMED_RESPONSE = "PROVIDER_MALFORMED_RESPONSE"
#: A 4xx/5xx whose body names ``response_format``, a schema or a grammar. Configuration.
PROVIDER_SCHEMA_REFUSED = "PROVIDER_SCHEMA_REFUSED"
#: HTTP 401/403. Credentials.
PROVIDER_CREDENTIALS = "PROVIDER_CREDENTIALS"
#: The environment variable named by ``api_key_env`` is unset or empty. Credentials.
PROVIDER_CREDENTIALS_MISSING = "PROVIDER_CREDENTIALS_MISSING"
#: HTTP 413 or a context-length error. Rejected request.
PROVIDER_REQUEST_TOO_LARGE = "PROVIDER_REQUEST_TOO_LARGE"
#: Any other HTTP 4xx (wrong model, wrong URL, unsupported schema dialect). Configuration.
PROVIDER_HTTP_CLIENT_ERROR = "PROVIDER_HTTP_CLIENT_ERROR"
#: A status that is neither success nor error (1xx, 3xx). Configuration.
PROVIDER_UNEXPECTED_STATUS = "PROVIDER_UNEXPECTED_STATUS"
#: The provider settings cannot work (bad URL, missing model or path). Configuration.
PROVIDER_BAD_CONFIG = "PROVIDER_BAD_CONFIG"
#: A scripted provider has no reply line for the requested call index. Configuration.
PROVIDER_SCRIPT_EXHAUSTED = "PROVIDER_SCRIPT_EXHAUSTED"
#: A scripted provider's file cannot be read or is not UTF-8. Configuration.
PROVIDER_SCRIPT_UNREADABLE = "PROVIDER_SCRIPT_UNREADABLE"
#: A provider raised something that is not a ``ProviderError`` (a bug). Configuration.
PROVIDER_UNEXPECTED = "PROVIDER_UNEXPECTED"
#: An attempt was stored as sent but its worker never recorded a response.
PROVIDER_INTERRUPTED = "PROVIDER_INTERRUPTED"
#: Another runner's attempt of the same operation may still be in flight (the step is
#: ``RETRY_PENDING`` until it has answered or its grace has passed). Not a failure.
PROVIDER_CALL_IN_FLIGHT = "PROVIDER_CALL_IN_FLIGHT"
#: Every configured provider rejected this exact request. Configuration.
PROVIDER_REQUEST_REJECTED = "PROVIDER_REQUEST_REJECTED"


@dataclass(frozen=True)
class ChatRequest:
    """One model decision call, independent of any provider's wire format.

    Args:
        messages: chat messages in order, each ``{"role": "system"|"user"|"assistant",
            "content": str}``. Treat as immutable.
        response_schema: JSON Schema (draft 2020-12 subset) of the expected reply object.
        schema_name: short identifier of the schema (``[A-Za-z0-9_-]``, at most 64
            characters, as OpenAI requires), e.g. ``"investigation_reply"``.
        call_index: ordinal of this decision call within the case, 0-based. Scripted
            providers serve reply line ``call_index``.
        case_id: the case this call belongs to.
        metadata: ids only (``{"hypothesis_id": "3"}``); never prompts or secrets.
        max_tokens: output token cap of this request (a money cap lowers it); ``None``:
            the provider's configured ``max_tokens``.
        money_cap_micros: the case's cap on model spending (micros of ``currency``), or
            ``None`` (no cap; see :mod:`investigation.llm.spend`).
        currency: the label of prices and the cap (``limits.currency``), for messages.
        max_response_bytes: the largest reply stored as an artifact
            (``limits.max_artifact_bytes``, seed 000's "4 MiB JSON artifact"); a longer one
            is a failed attempt (``PROVIDER_MALFORMED_RESPONSE``) whose bytes are not
            stored. ``None``: only :data:`MAX_RESPONSE_BYTES` bounds it.

    Raises:
        ValueError: a message lacks a known role or string content, or ``call_index < 0``.
    """

    messages: list[dict[str, str]]
    response_schema: dict[str, Any]
    schema_name: str
    call_index: int
    case_id: str
    metadata: dict[str, str] = field(default_factory=dict)
    max_tokens: int | None = None
    money_cap_micros: int | None = None
    currency: str = "USD"
    max_response_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.call_index < 0:
            raise ValueError(f"call_index must be >= 0, got {self.call_index}")
        if not self.messages:
            raise ValueError("a chat request needs at least one message")
        for i, message in enumerate(self.messages):
            if message.get("role") not in MESSAGE_ROLES or not isinstance(
                message.get("content"), str
            ):
                raise ValueError(
                    f"message {i} must be {{'role': one of {MESSAGE_ROLES}, 'content': str}}"
                )
        if not self.schema_name:
            raise ValueError("schema_name must not be empty")


@dataclass(frozen=True)
class ProviderReply:
    """A successful provider answer.

    Args:
        content: the assistant message text (for the loop: the reply JSON document).
        raw: the exact response bytes as received (stored byte for byte).
        http_status: the HTTP status, or ``None`` for non-HTTP providers.
        prompt_tokens: input tokens reported by the provider, if any.
        completion_tokens: output tokens reported by the provider, if any.
        finish_reason: why generation stopped (``"stop"``, ``"length"``, ...), if given.
    """

    content: str
    raw: bytes
    http_status: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None


@runtime_checkable
class Provider(Protocol):
    """A model provider: deterministic request bytes, one send, failures classified once.

    Implementations: :class:`~investigation.llm.openai.OpenAIProvider` (HTTP) and
    :class:`~investigation.llm.scripted.ScriptedProvider` (JSON Lines replay).
    """

    @property
    def name(self) -> str:
        """The configured provider name (unique within a failover list)."""
        ...

    def build_request_bytes(self, req: ChatRequest) -> bytes:
        """Return the exact bytes :meth:`send` will transmit for ``req``.

        The gateway stores them before sending. They must be deterministic for equal
        requests and must never contain credentials.

        Raises:
            ProviderConfigurationError: the request cannot be expressed for this provider.
        """
        ...

    def send(self, request_bytes: bytes, req: ChatRequest) -> ProviderReply:
        """Send ``request_bytes`` (from :meth:`build_request_bytes`) and parse the answer.

        Raises:
            ProviderError: only subclasses of it (see the module table). Response bytes
                received before the failure are attached (:func:`response_of`).
        """
        ...

    def content_from_raw(self, raw: bytes) -> str:
        """Re-derive the assistant content from stored response bytes of a success.

        Raises:
            ProviderError: ``raw`` is not a complete successful answer of this provider.
        """
        ...

    def check_credentials(self) -> None:
        """Check, sending nothing, that a call would find the credentials it needs here (a
        worker checks it before it joins the queue).

        Raises:
            ProviderCredentialsError: ``PROVIDER_CREDENTIALS_MISSING``.
        """
        ...


def attach_response(exc: ProviderError, raw: bytes | None, http_status: int | None) -> ProviderError:
    """Attach the received response bytes and status to a provider error; returns ``exc``.

    The gateway stores them byte for byte next to the failed attempt.
    """
    exc.response_raw = raw  # type: ignore[attr-defined]
    exc.http_status = http_status  # type: ignore[attr-defined]
    return exc


def response_of(exc: BaseException) -> tuple[bytes | None, int | None]:
    """The ``(raw bytes, http status)`` attached by :func:`attach_response`, else ``(None, None)``."""
    return getattr(exc, "response_raw", None), getattr(exc, "http_status", None)


# -- gateway outcomes ----------------------------------------------------------------------


@dataclass(frozen=True)
class Succeeded:
    """The operation has a stored successful answer.

    Args:
        operation_id: ``LLMOperation.id``.
        attempt: the successful attempt number (1-based, over all providers and rounds).
        provider: name of the provider that answered.
        content: the assistant message text.
        response_sha256: sha256 of the stored response bytes.
        request_sha256: sha256 of the stored request bytes of that attempt.
        finish_reason: the provider's ``finish_reason`` (``"length"``: cut at the token
            limit), if it gave one.
        completion_tokens: output tokens the provider reported, if any.
    """

    operation_id: int
    attempt: int
    provider: str
    content: str
    response_sha256: str
    request_sha256: str
    finish_reason: str | None = None
    completion_tokens: int | None = None


@dataclass(frozen=True)
class RetryPending:
    """Every provider of the current round failed transiently; call again later.

    Args:
        operation_id: ``LLMOperation.id``.
        retry_not_before: timezone-aware UTC instant before which a call returns this
            outcome again without contacting any provider.
        error_code: code of the last failure (e.g. ``PROVIDER_RATE_LIMITED``).
    """

    operation_id: int
    retry_not_before: datetime
    error_code: str


@dataclass(frozen=True)
class Blocked:
    """The operation cannot succeed without an operator.

    Args:
        operation_id: ``LLMOperation.id``.
        reason: ``PROVIDER_EXHAUSTED``, ``PROVIDER_CONFIGURATION`` or ``PROVIDER_CREDENTIALS``
            (``investigation.constants.BLOCK_*``).
        error_code: code of the failure that blocked (e.g. ``PROVIDER_HTTP_CLIENT_ERROR``).
        message: what went wrong and how to fix it (never secrets).
    """

    operation_id: int
    reason: str
    error_code: str
    message: str


#: What :meth:`LLMGateway.call <investigation.llm.gateway.LLMGateway.call>` returns.
GatewayOutcome = Succeeded | RetryPending | Blocked


def redact(text: str, secrets: Iterable[str | None]) -> str:
    """Replace every non-empty secret value in ``text`` with ``***``: as it is, and as a
    ``repr`` or a JSON string would spell it (an exception message quotes values that way,
    escaping a newline, say)."""
    for value in secrets:
        if value:
            for form in {value, repr(value)[1:-1], json.dumps(value)[1:-1],
                         value.strip()}:
                if form:
                    text = text.replace(form, "***")
    return text
