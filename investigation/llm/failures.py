"""Failed attempts, classified for the gateway's failover decision, and what repeats mean.

A provider classifies each failure once (:mod:`investigation.llm.types` has the table).
Some failures only reveal what they are when they repeat on *identical request bytes*:
a server that answers the same request with the same 5xx body is not overloaded, it is
refusing this request; a server that drops the connection on the same request again and
again cannot handle it (a llama.cpp server can crash on a schema its grammar parser
refuses). :func:`reclassify` turns such repeats into configuration failures, which block
the case at once with the server's words instead of running the whole backoff ladder.

=====================================================  ===================================
repeat on identical request bytes, same provider       becomes
=====================================================  ===================================
HTTP 5xx (not 502/503/504) with the same status and    configuration
specific body (not empty or a bare status text) as     ``PROVIDER_DETERMINISTIC_ERROR``
an earlier attempt
the connection dropped (``PROVIDER_NETWORK_ERROR``)    configuration
for the :data:`DROPS_BEFORE_BLOCK`-th time             ``PROVIDER_REQUEST_DROPPED``
unreachable after a drop on these bytes                transient, the message says the
                                                       server went away on that request
=====================================================  ===================================
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, replace

from investigation.errors import (
    ProviderCredentialsError,
    ProviderError,
    ProviderRequestRejected,
    TransientProviderError,
)
from investigation.llm.types import (
    PROVIDER_NETWORK_ERROR,
    PROVIDER_SERVER_ERROR,
    PROVIDER_UNEXPECTED,
    PROVIDER_UNREACHABLE,
    response_of,
)

log = logging.getLogger(__name__)

#: The same 5xx body to identical request bytes: the server refuses this request.
PROVIDER_DETERMINISTIC_ERROR = "PROVIDER_DETERMINISTIC_ERROR"
#: The server dropped the connection on identical request bytes again and again.
PROVIDER_REQUEST_DROPPED = "PROVIDER_REQUEST_DROPPED"
#: Drops on identical bytes (this one included) after which the request is blamed.
DROPS_BEFORE_BLOCK = 3
#: 5xx statuses of gateways and overload: a repeated body there still means "later".
OVERLOAD_STATUSES = frozenset({502, 503, 504})
#: Characters of a message kept (``error_message`` columns).
MAX_MESSAGE_CHARS = 2000


def short(text: str) -> str:
    """``text`` fit for an ``error_message`` column: no NUL/C0, no lone surrogates, bounded."""
    text = "".join(ch if ch >= " " or ch in "\t\n" else "?" for ch in text)
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "..."


@dataclass(frozen=True)
class Failure:
    """One failed attempt, classified for the failover decision.

    Attributes:
        kind: ``transient``, ``rejected`` (this provider can never take this request),
            ``credentials`` or ``configuration``.
        code: the stable error code.
        message: what went wrong and how to fix it (never secrets).
        retry_after_s: the server's ``Retry-After``, if any.
        http_status: the HTTP status, if an answer came.
        raw: the response bytes, if any (stored byte for byte).
        cost_micros: what the attempt cost (``llm.spend``), ``None`` if unpriced.
    """

    kind: str
    code: str
    message: str
    retry_after_s: float | None = None
    http_status: int | None = None
    raw: bytes | None = None
    cost_micros: int | None = None


def classify(provider: str, exc: BaseException) -> Failure:
    """The :class:`Failure` of an exception a provider raised (a non-``ProviderError`` is
    a bug in the adapter: configuration, ``PROVIDER_UNEXPECTED``)."""
    raw, status = response_of(exc)
    if isinstance(exc, TransientProviderError):
        return Failure("transient", exc.code, short(exc.message), exc.retry_after_s,
                       status, raw)
    if isinstance(exc, ProviderRequestRejected):
        return Failure("rejected", exc.code, short(exc.message), None, status, raw)
    if isinstance(exc, ProviderCredentialsError):
        return Failure("credentials", exc.code, short(exc.message), None, status, raw)
    if isinstance(exc, ProviderError):
        return Failure("configuration", exc.code, short(exc.message), None, status, raw)
    log.error("provider %r raised an unexpected %s", provider, type(exc).__name__,
              exc_info=exc)
    return Failure(
        "configuration", PROVIDER_UNEXPECTED,
        short(f"provider {provider!r} failed unexpectedly ({type(exc).__name__}: {exc}); "
              "this is a bug in the provider adapter, see the worker log"))


@dataclass(frozen=True)
class EarlierAttempt:
    """What an earlier attempt of the same operation, provider and request bytes got."""

    attempt: int
    error_code: str | None
    http_status: int | None
    response_sha256: str | None


#: Bodies that say nothing about the request (a proxy's page while a backend restarts).
_GENERIC_BODIES = frozenset({b"", b"internal server error", b"server error",
                             b"not implemented", b"error"})


def _says_something(raw: bytes) -> bool:
    """Whether a 5xx body is more than a generic status text: only a specific answer,
    repeated to identical bytes, shows the server refuses this very request. A JSON body
    whose only words are such a text (``{"detail": "Internal Server Error"}``, FastAPI's;
    ``{"error": {"message": "internal server error"}}``) says nothing either: a fleet
    trial's flaky backend blocked its case after two of them."""
    if raw.strip().lower() in _GENERIC_BODIES:
        return False
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # a hostile body too
        return True
    if not isinstance(body, dict):
        return True
    error = body.get("error")
    words = [body.get("detail"), body.get("message"),
             error.get("message") if isinstance(error, dict) else error]
    said = [w for w in words if w is not None]
    return not said or any(
        not isinstance(w, str) or w.strip().lower().encode() not in _GENERIC_BODIES
        for w in said)


def reclassify(failure: Failure, earlier: list[EarlierAttempt], provider: str,
               request_path: str) -> Failure:
    """What ``failure`` means given the ``earlier`` attempts on identical request bytes.

    Args:
        failure: this attempt's failure, as the provider classified it.
        earlier: earlier attempts of this operation to this provider with the same
            request sha256, oldest first.
        provider: the provider's name (for the message).
        request_path: the stored request's logical path (named in the message).

    Returns:
        ``failure`` itself, or the failure it turns out to be (module table).
    """
    if failure.kind != "transient":
        return failure
    if (failure.code == PROVIDER_SERVER_ERROR and failure.raw is not None
            and failure.http_status not in OVERLOAD_STATUSES
            and _says_something(failure.raw)):
        digest = hashlib.sha256(failure.raw).hexdigest()
        same = [e for e in earlier if e.http_status == failure.http_status
                and e.response_sha256 == digest]
        if same:
            return replace(failure, kind="configuration", code=PROVIDER_DETERMINISTIC_ERROR,
                           message=short(
                               f"{failure.message} -- the same answer as attempt "
                               f"{same[-1].attempt} to identical request bytes "
                               f"({request_path}): the server refuses this request, it is "
                               "not overloaded; check structured_output, model and the "
                               "server's log (`investigate providers check`)"))
    if failure.code == PROVIDER_NETWORK_ERROR:
        drops = [e for e in earlier if e.error_code in (PROVIDER_NETWORK_ERROR,
                                                        PROVIDER_REQUEST_DROPPED)]
        if len(drops) + 1 >= DROPS_BEFORE_BLOCK:
            return replace(failure, kind="configuration", code=PROVIDER_REQUEST_DROPPED,
                           message=short(
                               f"provider {provider!r} dropped the connection "
                               f"{len(drops) + 1} times on identical request bytes "
                               f"({request_path}): it cannot handle this request (a llama.cpp "
                               "server can crash on a schema its grammar parser refuses); "
                               "check structured_output and schema_max_string_chars with "
                               f"`investigate providers check` ({failure.message})"))
    if failure.code == PROVIDER_UNREACHABLE:
        drop = next((e for e in reversed(earlier) if e.error_code == PROVIDER_NETWORK_ERROR),
                    None)
        if drop is not None:
            return replace(failure, message=short(
                f"{failure.message}; it has been unreachable since it dropped the connection "
                f"on this request at attempt {drop.attempt} (the same bytes as "
                f"{request_path}): the request may "
                "have crashed the server (`investigate providers check`)"))
    return failure
