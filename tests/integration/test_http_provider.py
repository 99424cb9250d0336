"""The real OpenAIProvider and LLMGateway against ReplayServer over loopback sockets."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from sqlmodel import select

from investigation.config import GatewayConfig, ProviderConfig
from investigation.llm import (
    Blocked,
    ChatRequest,
    LLMGateway,
    OpenAIProvider,
    ReplayServer,
    RetryPending,
    Succeeded,
)
from investigation.llm.replay_server import Fault
from investigation.store.engine import Store
from investigation.store.models import LLMAttempt

T0 = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
CASE = "case-http"
KEY = "sk-loopback-SECRET"
REPLIES = ['{"next": {"action": "finish", "reason": "one"}}',
           '{"next": {"action": "finish", "reason": "zwei \u00fc"}}']


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store("sqlite:///" + str(tmp_path / "s.db"))
    s.create_schema()
    return s


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make_request(call_index: int = 0, text: str = "investigate") -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": text}],
                       response_schema={"type": "object"}, schema_name="reply",
                       call_index=call_index, case_id=CASE)


def provider(server: ReplayServer, timeout_s: float = 2.0, name: str = "local") -> OpenAIProvider:
    config = ProviderConfig(name=name, kind="openai", base_url=server.base_url, model="replay",
                            api_key_env="LOOPBACK_KEY", timeout_s=timeout_s)
    return OpenAIProvider(config, env={"LOOPBACK_KEY": KEY})


def gateway(store: Store, clock: Clock, *providers: OpenAIProvider) -> LLMGateway:
    return LLMGateway(store, list(providers), GatewayConfig(attempts=5, delay_s=2.0),
                      clock=clock)


@pytest.fixture
def server_factory() -> Iterator[list[ReplayServer]]:
    servers: list[ReplayServer] = []
    yield servers
    for server in servers:
        server.stop()


def start(servers: list[ReplayServer], faults: list[Fault] | None = None) -> ReplayServer:
    server = ReplayServer(REPLIES, faults=faults or []).start()
    servers.append(server)
    return server


def test_success_over_http_stores_exact_bytes(
    store: Store, clock: Clock, server_factory: list[ReplayServer]
) -> None:
    server = start(server_factory)
    gw = gateway(store, clock, provider(server))
    outcome = gw.call(CASE, 1, 1, make_request(0))
    assert isinstance(outcome, Succeeded)
    assert outcome.content == REPLIES[0]
    (received,) = server.requests
    assert received.headers["authorization"] == f"Bearer {KEY}"
    with store.session() as s:
        att = s.exec(select(LLMAttempt)).one()
        stored = {a.path: a for a in Store.artifacts(s, CASE)}
    assert stored[att.request_path].data == received.body  # the stored bytes went on the wire
    assert KEY.encode() not in received.body
    response = stored[att.response_path or ""]
    assert json.loads(response.data)["choices"][0]["message"]["content"] == REPLIES[0]
    assert att.prompt_tokens is not None and att.completion_tokens is not None
    second = gw.call(CASE, 1, 2, make_request(1, "next"))
    assert isinstance(second, Succeeded) and second.content == REPLIES[1]
    assert gw.call(CASE, 1, 1, make_request(0)) == outcome
    assert len(server.requests) == 2  # stored success: no third request


def test_429_with_retry_after_is_retry_pending(
    store: Store, clock: Clock, server_factory: list[ReplayServer]
) -> None:
    server = start(server_factory, [Fault.http(429, retry_after="45")])
    gw = gateway(store, clock, provider(server))
    pending = gw.call(CASE, 1, 1, make_request())
    assert isinstance(pending, RetryPending)
    assert pending.error_code == "PROVIDER_RATE_LIMITED"
    assert pending.retry_not_before == T0 + timedelta(seconds=45)
    clock.now = pending.retry_not_before
    done = gw.call(CASE, 1, 1, make_request())
    assert isinstance(done, Succeeded) and done.content == REPLIES[0]


def test_500_then_success_after_the_clock_passes(
    store: Store, clock: Clock, server_factory: list[ReplayServer]
) -> None:
    server = start(server_factory, [Fault.http(500)])
    gw = gateway(store, clock, provider(server))
    pending = gw.call(CASE, 1, 1, make_request())
    assert isinstance(pending, RetryPending)
    assert pending.error_code == "PROVIDER_SERVER_ERROR"
    assert pending.retry_not_before == T0 + timedelta(seconds=2)
    assert gw.call(CASE, 1, 1, make_request()) == pending  # not yet due: no request
    assert len(server.requests) == 1
    clock.now += timedelta(seconds=2)
    done = gw.call(CASE, 1, 1, make_request())
    assert isinstance(done, Succeeded) and done.attempt == 2


def test_failover_to_second_server(
    store: Store, clock: Clock, server_factory: list[ReplayServer]
) -> None:
    down = start(server_factory, [Fault.http(503)])
    up = start(server_factory)
    gw = gateway(store, clock, provider(down, name="down"), provider(up, name="up"))
    done = gw.call(CASE, 1, 1, make_request())
    assert isinstance(done, Succeeded) and done.provider == "up"


def test_timeout_is_transient_and_resend_gets_same_reply(
    store: Store, clock: Clock, server_factory: list[ReplayServer]
) -> None:
    # Generous margins: the second exchange must finish within timeout_s on a loaded host.
    server = start(server_factory, [Fault.delay(4.0)])
    gw = gateway(store, clock, provider(server, timeout_s=1.5))
    pending = gw.call(CASE, 1, 1, make_request())
    assert isinstance(pending, RetryPending)
    assert pending.error_code == "PROVIDER_TIMEOUT"
    clock.now = pending.retry_not_before
    done = gw.call(CASE, 1, 1, make_request())
    # the identical request body maps to the same reply line on the server
    assert isinstance(done, Succeeded) and done.content == REPLIES[0]


def test_unreachable_server_is_transient(store: Store, clock: Clock) -> None:
    server = ReplayServer(REPLIES).start()
    p = provider(server)
    server.stop()  # nothing listens on that port any more
    pending = gateway(store, clock, p).call(CASE, 1, 1, make_request())
    assert isinstance(pending, RetryPending)
    assert pending.error_code in {"PROVIDER_UNREACHABLE", "PROVIDER_NETWORK_ERROR"}


def test_401_blocks_with_credentials(
    store: Store, clock: Clock, server_factory: list[ReplayServer]
) -> None:
    server = start(server_factory, [Fault.http(401)])
    blocked = gateway(store, clock, provider(server)).call(CASE, 1, 1, make_request())
    assert isinstance(blocked, Blocked)
    assert (blocked.reason, blocked.error_code) == ("PROVIDER_CREDENTIALS", "PROVIDER_CREDENTIALS")
    assert KEY not in blocked.message


def test_malformed_json_is_transient_and_stored(
    store: Store, clock: Clock, server_factory: list[ReplayServer]
) -> None:
    server = start(server_factory, [Fault.malformed()])
    pending = gateway(store, clock, provider(server)).call(CASE, 1, 1, make_request())
    assert isinstance(pending, RetryPending)
    assert pending.error_code == "PROVIDER_MALFORMED_RESPONSE"
    with store.session() as s:
        att = s.exec(select(LLMAttempt)).one()
        stored = Store.get_artifact(s, CASE, att.response_path or "")
    assert stored is not None and stored.data == Fault.malformed().body


def test_truncated_reply_succeeds_with_its_finish_reason(
    store: Store, clock: Clock, server_factory: list[ReplayServer]
) -> None:
    server = start(server_factory, [Fault.truncated()])
    gw = gateway(store, clock, provider(server))
    done = gw.call(CASE, 1, 1, make_request())
    assert isinstance(done, Succeeded) and done.finish_reason == "length"
    assert len(server.requests) == 1  # never resent unchanged
    again = gw.call(CASE, 1, 1, make_request())  # a stored success, with its reason
    assert isinstance(again, Succeeded) and again.finish_reason == "length"
    assert len(server.requests) == 1


def test_script_exhausted_is_a_configuration_block(
    store: Store, clock: Clock, server_factory: list[ReplayServer]
) -> None:
    server = start(server_factory)
    gw = gateway(store, clock, provider(server))
    for i in range(2):
        assert isinstance(gw.call(CASE, 1, i + 1, make_request(i, f"m{i}")), Succeeded)
    blocked = gw.call(CASE, 1, 3, make_request(2, "m2"))
    assert isinstance(blocked, Blocked)
    assert (blocked.reason, blocked.error_code) == ("PROVIDER_CONFIGURATION",
                                                     "PROVIDER_HTTP_CLIENT_ERROR")
    assert "exhausted" in blocked.message


def test_models_endpoint_and_loopback_only() -> None:
    with ReplayServer(REPLIES) as server:
        response = httpx.get(server.base_url + "/models")
        assert response.status_code == 200
        assert response.json()["data"][0]["id"] == "replay"
        assert httpx.get(server.base_url + "/nothing").status_code == 404
    for host in ("0.0.0.0", "192.168.1.10", "example.com", "::"):
        with pytest.raises(ValueError):
            ReplayServer(REPLIES, host=host)
