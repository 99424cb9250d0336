"""OpenAIProvider at the transport cut (httpx.MockTransport): bodies and classification."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest
from pydantic import ValidationError

from investigation.config import ProviderConfig
from investigation.errors import (
    ProviderConfigurationError,
    ProviderCredentialsError,
    ProviderError,
    ProviderRequestRejected,
    TransientProviderError,
)
from investigation.llm.openai import OpenAIProvider, classify_httpx_error, retry_after_seconds
from investigation.llm.types import ChatRequest, response_of

NOW = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
KEY = "sk-test-SECRET-123"
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
#: SCHEMA in the OpenAI strict subset (every object closed).
STRICT = {**SCHEMA, "additionalProperties": False}


def make_request(call_index: int = 0) -> ChatRequest:
    return ChatRequest(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        response_schema=SCHEMA,
        schema_name="reply",
        call_index=call_index,
        case_id="case-1",
    )


def completion(content: str | None = '{"x": 1}', finish: str = "stop") -> dict[str, object]:
    return {
        "id": "c1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": finish}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14},
    }


def provider(
    handler: Callable[[httpx.Request], httpx.Response],
    structured_output: str = "json_schema",
    env: dict[str, str] | None = None,
    **extra: object,
) -> OpenAIProvider:
    config = ProviderConfig(
        name="primary", kind="openai", base_url="http://llm.test/v1/", model="m1",
        api_key_env="TEST_KEY", structured_output=structured_output, **extra,
    )
    return OpenAIProvider(config, env={"TEST_KEY": KEY} if env is None else env,
                          transport=httpx.MockTransport(handler), clock=lambda: NOW)


def send(p: OpenAIProvider) -> object:
    req = make_request()
    return p.send(p.build_request_bytes(req), req)


def respond(status: int, body: bytes | dict[str, object], headers: dict[str, str] | None = None):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=raw, headers=headers or {})

    return handler


# -- request bodies ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dialect", "expected_format"),
    [
        ("json_schema", {"type": "json_schema",
                         "json_schema": {"name": "reply", "schema": STRICT, "strict": True}}),
        ("openai", {"type": "json_schema",
                    "json_schema": {"name": "reply", "schema": STRICT, "strict": True}}),
        ("json_object_schema", {"type": "json_object", "schema": SCHEMA}),
        ("llama_cpp", {"type": "json_object", "schema": SCHEMA}),
        ("ollama", {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}),
        ("vllm", {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}),
        ("sglang", {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}),
        ("json_object", {"type": "json_object"}),
        ("none", None),
    ],
)
def test_request_body_by_dialect(dialect: str, expected_format: object) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=completion())

    p = provider(handler, structured_output=dialect, temperature=0.0, max_tokens=256)
    req = make_request()
    data = p.build_request_bytes(req)
    assert data == p.build_request_bytes(req)  # deterministic
    body = json.loads(data)
    expected = {
        "model": "m1",
        "messages": req.messages,
        "temperature": 0.0,
        "max_tokens": 256,
    }
    if expected_format is not None:
        expected["response_format"] = expected_format
    assert body == expected
    # compact, keys in the order built (a schema's property order reaches the server)
    assert data == json.dumps(body, separators=(",", ":")).encode()
    assert list(body) == [k for k in ("model", "messages", "temperature", "max_tokens",
                                      "response_format") if k in body]
    reply = p.send(data, req)
    assert reply.content == '{"x": 1}'
    assert reply.prompt_tokens == 11 and reply.completion_tokens == 3
    assert reply.http_status == 200
    (request,) = seen
    assert request.url == "http://llm.test/v1/chat/completions"
    assert request.method == "POST"
    assert request.content == data  # exactly the stored bytes went on the wire
    assert request.headers["authorization"] == f"Bearer {KEY}"
    assert KEY.encode() not in data


def test_optional_fields_omitted_and_no_auth_without_key_env() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=completion())

    config = ProviderConfig(name="local", kind="openai", base_url="http://l.test/v1", model="m")
    p = OpenAIProvider(config, env={}, transport=httpx.MockTransport(handler))
    req = make_request()
    body = json.loads(p.build_request_bytes(req))
    assert "temperature" not in body and "max_tokens" not in body
    p.send(p.build_request_bytes(req), req)
    assert "authorization" not in seen[0].headers


def test_raw_bytes_are_exact() -> None:
    raw = b'{"choices":[{"message":{"content":"\\u00e9"},"finish_reason":"stop"}]}  \n'
    reply = send(provider(respond(200, raw)))
    assert reply.raw == raw  # type: ignore[attr-defined]
    assert reply.content == "\u00e9"  # type: ignore[attr-defined]


def test_missing_key_variable_is_a_credentials_error_without_network() -> None:
    def handler(request: httpx.Request) -> httpx.Response:  # pragma: no cover
        raise AssertionError("must not send without a key")

    with pytest.raises(ProviderCredentialsError) as info:
        send(provider(handler, env={}))
    assert info.value.code == "PROVIDER_CREDENTIALS_MISSING"
    assert "TEST_KEY" in info.value.message


def test_bad_config_fails_fast() -> None:
    # A built config is checked again where the provider is made (a copy may bypass it).
    built = ProviderConfig.model_construct(name="x", kind="openai", base_url="ftp://h/v1",
                                           model="m")
    with pytest.raises(ProviderConfigurationError):
        OpenAIProvider(built)
    for url in ("ftp://h/v1", "http://127.0.0.1:99999/v1", "http://[::1/v1", "127.0.0.1/v1"):
        with pytest.raises(ValidationError, match="base_url"):
            ProviderConfig(name="x", kind="openai", base_url=url, model="m")
    # A missing base_url or model is refused when the entry is read, naming what is missing.
    with pytest.raises(ValidationError, match="needs base_url"):
        ProviderConfig(name="x", kind="openai", model="m")
    with pytest.raises(ValidationError, match="needs model"):
        ProviderConfig(name="x", kind="openai", base_url="http://h/v1")
    with pytest.raises(ValidationError, match="needs path"):
        ProviderConfig(name="x", kind="scripted")


# -- HTTP status classification ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "body", "cls", "code"),
    [
        (401, {"error": {"message": "bad key"}}, ProviderCredentialsError, "PROVIDER_CREDENTIALS"),
        (403, {"error": {"message": "forbidden"}}, ProviderCredentialsError, "PROVIDER_CREDENTIALS"),
        (408, b"", TransientProviderError, "PROVIDER_RETRYABLE_STATUS"),
        (409, b"", TransientProviderError, "PROVIDER_RETRYABLE_STATUS"),
        (425, b"", TransientProviderError, "PROVIDER_RETRYABLE_STATUS"),
        (429, {"error": {"message": "slow down"}}, TransientProviderError, "PROVIDER_RATE_LIMITED"),
        (500, b"oops", TransientProviderError, "PROVIDER_SERVER_ERROR"),
        (502, b"", TransientProviderError, "PROVIDER_SERVER_ERROR"),
        (503, b"", TransientProviderError, "PROVIDER_SERVER_ERROR"),
        (599, b"", TransientProviderError, "PROVIDER_SERVER_ERROR"),
        (413, b"too big", ProviderRequestRejected, "PROVIDER_REQUEST_TOO_LARGE"),
        (400, {"error": {"message": "x", "code": "context_length_exceeded"}},
         ProviderRequestRejected, "PROVIDER_REQUEST_TOO_LARGE"),
        (400, {"error": {"message": "This model's maximum context length is 4096 tokens."}},
         ProviderRequestRejected, "PROVIDER_REQUEST_TOO_LARGE"),
        (400, {"error": {"code": 400, "type": "exceed_context_size_error",
                         "message": "the request exceeds the available context size"}},
         ProviderRequestRejected, "PROVIDER_REQUEST_TOO_LARGE"),
        (400, {"error": {"message": "unknown field response_format"}},
         ProviderConfigurationError, "PROVIDER_SCHEMA_REFUSED"),
        (500, {"error": {"message": "Input should be 'text' or 'json_object'",
                         "loc": ["body", "response_format", "type"]}},
         ProviderConfigurationError, "PROVIDER_SCHEMA_REFUSED"),
        (400, {"error": {"message": "failed to parse grammar"}},
         ProviderConfigurationError, "PROVIDER_SCHEMA_REFUSED"),
        (503, {"error": {"message": "grammar workers busy"}},
         TransientProviderError, "PROVIDER_SERVER_ERROR"),
        (429, {"error": {"message": "schema requests over quota"}},
         TransientProviderError, "PROVIDER_RATE_LIMITED"),
        (404, {"error": {"message": "model not found"}},
         ProviderConfigurationError, "PROVIDER_HTTP_CLIENT_ERROR"),
        (422, b"{}", ProviderConfigurationError, "PROVIDER_HTTP_CLIENT_ERROR"),
        (302, b"", ProviderConfigurationError, "PROVIDER_UNEXPECTED_STATUS"),
    ],
)
def test_status_classification(
    status: int, body: bytes | dict[str, object], cls: type[ProviderError], code: str
) -> None:
    with pytest.raises(ProviderError) as info:
        send(provider(respond(status, body)))
    assert type(info.value) is cls
    assert info.value.code == code
    assert info.value.details["http_status"] == status
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    assert info.value.response_raw == raw  # type: ignore[attr-defined]
    assert info.value.http_status == status  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"Retry-After": "17"}, 17.0),
        ({"Retry-After": "1.5"}, 1.5),
        ({"Retry-After": format_datetime(NOW + timedelta(seconds=90), usegmt=True)}, 90.0),
        ({"Retry-After": format_datetime(NOW - timedelta(seconds=90), usegmt=True)}, 0.0),
        ({"retry-after-ms": "250"}, 0.25),
        ({"Retry-After": "soon"}, None),
        ({"Retry-After": "-3"}, None),
        ({}, None),
    ],
)
def test_retry_after_on_429(headers: dict[str, str], expected: float | None) -> None:
    with pytest.raises(TransientProviderError) as info:
        send(provider(respond(429, {"error": {"message": "rate"}}, headers)))
    assert info.value.retry_after_s == expected


def test_retry_after_on_503() -> None:
    with pytest.raises(TransientProviderError) as info:
        send(provider(respond(503, b"", {"Retry-After": "5"})))
    assert info.value.retry_after_s == 5.0


def test_retry_after_parser_directly() -> None:
    assert retry_after_seconds(httpx.Headers({"retry-after": " 3 "}), NOW) == 3.0
    assert retry_after_seconds(httpx.Headers({"retry-after": "inf"}), NOW) is None


# -- 200 bodies -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"<html>proxy</html>", "PROVIDER_MALFORMED_RESPONSE"),
        (b"", "PROVIDER_MALFORMED_RESPONSE"),
        (b'{"choices": [', "PROVIDER_MALFORMED_RESPONSE"),
        (b"[1, 2]", "PROVIDER_MALFORMED_RESPONSE"),
        (b'{"choices": []}', "PROVIDER_MALFORMED_RESPONSE"),
        (b'{"choices": [{"message": {}}]}', "PROVIDER_MALFORMED_RESPONSE"),
        (json.dumps(completion(content=None)).encode(), "PROVIDER_MALFORMED_RESPONSE"),
        (b'{"error": {"message": "upstream"}}', "PROVIDER_MALFORMED_RESPONSE"),
        (b'\xff\xfe\x00garbage', "PROVIDER_MALFORMED_RESPONSE"),
    ],
)
def test_bad_200_bodies_are_transient(body: bytes, code: str) -> None:
    with pytest.raises(TransientProviderError) as info:
        send(provider(respond(200, body)))
    assert info.value.code == code
    assert info.value.response_raw == body  # type: ignore[attr-defined]


def test_a_reply_cut_at_max_tokens_is_a_reply_with_its_finish_reason() -> None:
    # Not a transient failure: resending identical bytes would give the same cut reply.
    reply = send(provider(respond(200, completion(finish="length"))))
    assert reply.finish_reason == "length"
    assert send(provider(respond(200, completion()))).finish_reason == "stop"


@pytest.mark.parametrize(("finish", "kept"), [
    ("eos", "eos"), ("tool_calls", "tool_calls"), ("st\x00op", None),
    ("stop\x1b[2J", None), ("x" * 65, None), ("", None), ("stop please", None)])
def test_a_finish_reason_is_kept_only_as_a_plain_word(finish: str, kept: str | None) -> None:
    """A NUL in it failed PostgreSQL's text column and lost the paid reply; control
    characters would reach the report (a hostile-input trial). The reply itself stays."""
    reply = send(provider(respond(200, completion(finish=finish))))
    assert reply.finish_reason == kept and reply.content == '{"x": 1}'


def test_content_from_raw_roundtrip() -> None:
    p = provider(respond(200, completion()))
    reply = send(p)
    assert p.content_from_raw(reply.raw) == reply.content  # type: ignore[attr-defined]


# -- httpx exceptions ------------------------------------------------------------------------------


def _httpx_exception_classes() -> list[type[Exception]]:
    return sorted(
        (obj for _, obj in inspect.getmembers(httpx, inspect.isclass)
         if issubclass(obj, Exception)),
        key=lambda c: c.__name__,
    )


def _instantiate(cls: type[Exception]) -> Exception:
    request = httpx.Request("POST", "http://llm.test/v1/chat/completions")
    if issubclass(cls, httpx.HTTPStatusError):
        return cls("boom", request=request, response=httpx.Response(500, request=request))
    if issubclass(cls, httpx.RequestError):
        return cls("boom", request=request)
    if issubclass(cls, httpx.StreamError):
        try:
            return cls()  # type: ignore[call-arg]
        except TypeError:
            return cls("boom")
    return cls("boom")


EXPECTED_TRANSIENT = {
    "ConnectError", "ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout",
    "TimeoutException", "ReadError", "WriteError", "CloseError", "NetworkError",
    "RemoteProtocolError", "ProtocolError", "ProxyError", "DecodingError", "TransportError",
    "RequestError", "HTTPError", "HTTPStatusError",
}
EXPECTED_CONFIGURATION = {
    "UnsupportedProtocol", "LocalProtocolError", "TooManyRedirects", "InvalidURL",
    "CookieConflict", "StreamError", "StreamConsumed", "StreamClosed", "ResponseNotRead",
    "RequestNotRead",
}


def test_every_httpx_exception_class_is_classified() -> None:
    classes = _httpx_exception_classes()
    names = {c.__name__ for c in classes}
    # The table below covers every exception httpx exports; a new httpx class fails here.
    assert names == EXPECTED_TRANSIENT | EXPECTED_CONFIGURATION, names ^ (
        EXPECTED_TRANSIENT | EXPECTED_CONFIGURATION
    )
    for cls in classes:
        error = classify_httpx_error(_instantiate(cls), "primary", [KEY])
        expected = (TransientProviderError if cls.__name__ in EXPECTED_TRANSIENT
                    else ProviderConfigurationError)
        assert type(error) is expected, cls
        assert error.code.startswith("PROVIDER_")


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (httpx.ConnectTimeout, "PROVIDER_TIMEOUT"),
        (httpx.ReadTimeout, "PROVIDER_TIMEOUT"),
        (httpx.WriteTimeout, "PROVIDER_TIMEOUT"),
        (httpx.PoolTimeout, "PROVIDER_TIMEOUT"),
        (httpx.ConnectError, "PROVIDER_UNREACHABLE"),
        (httpx.ProxyError, "PROVIDER_UNREACHABLE"),
        (httpx.ReadError, "PROVIDER_NETWORK_ERROR"),
        (httpx.WriteError, "PROVIDER_NETWORK_ERROR"),
        (httpx.CloseError, "PROVIDER_NETWORK_ERROR"),
        (httpx.RemoteProtocolError, "PROVIDER_NETWORK_ERROR"),
        (httpx.DecodingError, "PROVIDER_NETWORK_ERROR"),
        (httpx.UnsupportedProtocol, "PROVIDER_BAD_CONFIG"),
        (httpx.LocalProtocolError, "PROVIDER_BAD_CONFIG"),
        (httpx.TooManyRedirects, "PROVIDER_BAD_CONFIG"),
    ],
)
def test_transport_exceptions_raised_by_send(exc: type[httpx.RequestError], code: str) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc(f"failed talking with {KEY}", request=request)

    with pytest.raises(ProviderError) as info:
        send(provider(handler))
    assert info.value.code == code
    assert isinstance(info.value.__cause__, exc)
    assert KEY not in str(info.value)  # the key is redacted even if httpx echoed it
    assert response_of(info.value) == (None, None)
    # A timeout names the bound that ran out (a real model's user met "timed out" alone).
    assert ("timeout_s = 60 bounds each read" in info.value.message) is \
        (exc in (httpx.ReadTimeout, httpx.WriteTimeout)), info.value.message


def test_key_never_in_error_messages() -> None:
    body = {"error": {"message": f"invalid api key {KEY}"}}
    with pytest.raises(ProviderCredentialsError) as info:
        send(provider(respond(401, body)))
    assert KEY not in str(info.value)
    assert KEY not in json.dumps(info.value.to_dict())


def test_a_401_without_a_key_says_none_was_sent() -> None:
    """A provider without api_key_env answered 401 and was told to "check the key in the
    variable named by api_key_env" (a fleet trial): there was no such variable."""
    keyless = OpenAIProvider(ProviderConfig(name="p", kind="openai", base_url="http://h/v1",
                                            model="m"), env={},
                             transport=httpx.MockTransport(respond(401, b"no")))
    with pytest.raises(ProviderCredentialsError) as err:
        send(keyless)
    assert "no key was sent: the provider has no api_key_env" in err.value.message
    with pytest.raises(ProviderCredentialsError) as err:
        send(provider(respond(401, b"no")))
    assert "check the key in the variable named by api_key_env" in err.value.message


def test_the_request_runs_in_the_callers_context() -> None:
    """The request's helper thread sees the caller's context variables: a fleet trial's
    httpx lines inside llm_call carried the worker's name but not the case and step."""
    import contextvars
    import logging

    from workers import logs

    seen: list[object] = []
    marker: contextvars.ContextVar[str | None] = contextvars.ContextVar("marker", default=None)

    def handler(request: httpx.Request) -> httpx.Response:
        record = logging.LogRecord("httpx", logging.INFO, __file__, 1, "HTTP Request", None,
                                   None)
        logs.ContextFilter().filter(record)
        seen.append((marker.get(), record.case_id, record.step, record.stage))  # type: ignore[attr-defined]
        return httpx.Response(200, json=completion())

    token = marker.set("the caller's")
    try:
        with logs.step_context(case_id="case-1", step=3, stage="llm_call"):
            send(provider(handler))
    finally:
        marker.reset(token)
    assert seen == [("the caller's", "case-1", 3, "llm_call")]
