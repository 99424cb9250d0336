"""LLMGateway with fake providers and a fake clock: persistence, failover, timing as data."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlmodel import select

from investigation.config import GatewayConfig, canonical_json
from investigation.constants import ARTIFACT_REQUEST, ARTIFACT_RESPONSE
from investigation.errors import (
    ProviderConfigurationError,
    ProviderCredentialsError,
    ProviderRequestRejected,
    StaleStateError,
    TransientProviderError,
)
from investigation.llm import (
    Blocked,
    ChatRequest,
    LLMGateway,
    ProviderReply,
    RetryPending,
    Succeeded,
)
from investigation.llm.types import attach_response
from investigation.store.engine import Store, sha256_hex
from investigation.store.models import Artifact, LLMAttempt, LLMOperation

T0 = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
CASE = "case-1"


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


class Crash(BaseException):
    """Simulates the worker dying mid-call (not an Exception: nothing may catch it)."""


Outcome = ProviderReply | BaseException | Callable[[bytes, ChatRequest], ProviderReply]


class FakeProvider:
    def __init__(self, name: str, outcomes: list[Outcome] | None = None) -> None:
        self._name = name
        self.outcomes = list(outcomes or [])
        self.sent: list[bytes] = []

    @property
    def name(self) -> str:
        return self._name

    def check_credentials(self) -> None:
        pass

    def build_request_bytes(self, req: ChatRequest) -> bytes:
        return canonical_json({"provider": self._name, "call": req.call_index,
                               "messages": req.messages})

    def send(self, request_bytes: bytes, req: ChatRequest) -> ProviderReply:
        self.sent.append(request_bytes)
        if not self.outcomes:
            raise AssertionError(f"{self._name} called more often than scripted")
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        if callable(outcome):
            return outcome(request_bytes, req)
        return outcome

    def content_from_raw(self, raw: bytes) -> str:
        return raw.decode().removeprefix("RAW:")


def ok(content: str = '{"ok": true}') -> ProviderReply:
    return ProviderReply(content=content, raw=b"RAW:" + content.encode(), http_status=200,
                         prompt_tokens=7, completion_tokens=5)


def transient(retry_after_s: float | None = None, code: str = "PROVIDER_SERVER_ERROR"):
    return TransientProviderError(code, "server hiccup", retry_after_s=retry_after_s)


def request(call_index: int = 0) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": "go"}],
                       response_schema={"type": "object"}, schema_name="reply",
                       call_index=call_index, case_id=CASE)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store("sqlite:///" + str(tmp_path / "s.db"))
    s.create_schema()
    return s


def gateway(store: Store, providers: list[FakeProvider], clock: Clock, **cfg: float) -> LLMGateway:
    config = GatewayConfig(**{"attempts": 10, "delay_s": 2.0, "backoff_factor": 2.0,
                              "max_delay_s": 60.0, **cfg})
    # Grace 0: a "sent" attempt found by a later call is taken as interrupted (the tests of
    # the default grace construct their gateway themselves).
    return LLMGateway(store, providers, config, clock=clock, in_flight_grace_s=0)


def attempts(store: Store) -> list[LLMAttempt]:
    with store.session() as s:
        return list(s.exec(select(LLMAttempt).order_by(LLMAttempt.id)))


def operations(store: Store) -> list[LLMOperation]:
    with store.session() as s:
        return list(s.exec(select(LLMOperation).order_by(LLMOperation.id)))


def artifact(store: Store, path: str) -> Artifact | None:
    with store.session() as s:
        return Store.get_artifact(s, CASE, path)


# -- success and persistence --------------------------------------------------------------------


def test_success_is_stored_and_never_called_again(store: Store) -> None:
    p = FakeProvider("a", [ok('{"x": "\u00e9"}')])
    gw = gateway(store, [p], Clock())
    first = gw.call(CASE, 1, 3, request())
    assert isinstance(first, Succeeded)
    assert first.provider == "a" and first.attempt == 1 and first.content == '{"x": "\u00e9"}'
    again = gw.call(CASE, 1, 3, request())
    assert again == first
    assert len(p.sent) == 1
    # a fresh gateway (new process) also returns the stored success without calling
    assert gateway(store, [FakeProvider("a")], Clock()).call(CASE, 1, 3, request()) == first
    # even with a retry id: a stored success is never asked again
    assert gateway(store, [FakeProvider("a")], Clock()).call(CASE, 1, 3, request(), "r1") == first

    (att,) = attempts(store)
    req_path = ARTIFACT_REQUEST.format(seq=3, operation=first.operation_id, attempt=1)
    resp_path = ARTIFACT_RESPONSE.format(seq=3, operation=first.operation_id, attempt=1)
    assert att.request_path == req_path and att.response_path == resp_path
    assert att.status == "succeeded" and att.http_status == 200
    assert (att.prompt_tokens, att.completion_tokens) == (7, 5)
    stored_req = artifact(store, req_path)
    assert stored_req is not None and stored_req.data == p.sent[0]
    assert first.request_sha256 == sha256_hex(p.sent[0])
    stored_resp = artifact(store, resp_path)
    assert stored_resp is not None
    assert stored_resp.data == ('RAW:{"x": "\u00e9"}').encode()  # byte for byte
    assert stored_resp.media_type == "application/octet-stream"
    assert first.response_sha256 == stored_resp.sha256
    (op,) = operations(store)
    assert op.status == "succeeded" and op.succeeded_attempt == 1 and op.call_index == 0


def test_request_is_committed_before_send(store: Store) -> None:
    seen: dict[str, object] = {}

    def check(request_bytes: bytes, req: ChatRequest) -> ProviderReply:
        fresh = Store(store.url)  # a separate engine: sees only committed rows
        with fresh.session() as s:
            (att,) = s.exec(select(LLMAttempt)).all()
            stored = Store.get_artifact(s, CASE, att.request_path)
            seen["status"] = att.status
            seen["bytes"] = stored.data if stored else None
            seen["response_path"] = att.response_path
        fresh.dispose()
        return ok()

    p = FakeProvider("a", [check])
    assert isinstance(gateway(store, [p], Clock()).call(CASE, 1, 1, request()), Succeeded)
    assert seen == {"status": "sent", "bytes": p.sent[0], "response_path": None}


def test_failed_response_bytes_are_stored(store: Store) -> None:
    error = attach_response(transient(), b"<html>502</html>\r\n", 502)
    p = FakeProvider("a", [error])
    outcome = gateway(store, [p], Clock()).call(CASE, 1, 1, request())
    assert isinstance(outcome, RetryPending)
    (att,) = attempts(store)
    assert att.status == "failed" and att.http_status == 502
    assert att.error_code == "PROVIDER_SERVER_ERROR"
    stored = artifact(store, att.response_path or "")
    assert stored is not None and stored.data == b"<html>502</html>\r\n"


# -- timing --------------------------------------------------------------------------------------


def test_retry_pending_returns_at_once_with_backoff(store: Store) -> None:
    clock = Clock()
    p = FakeProvider("a", [transient(), transient(), ok()])
    gw = gateway(store, [p], clock, delay_s=2.0, backoff_factor=3.0)
    first = gw.call(CASE, 1, 1, request())
    assert isinstance(first, RetryPending)
    assert first.retry_not_before == T0 + timedelta(seconds=2)
    assert first.retry_not_before.tzinfo is not None
    assert first.error_code == "PROVIDER_SERVER_ERROR"
    # before the instant: no provider call, same answer (read back from SQLite, still aware)
    clock.advance(1.9)
    again = gw.call(CASE, 1, 1, request())
    assert again == first and len(p.sent) == 1
    # due: round 1 fails, waits 2 * 3 ** 1 = 6 s
    clock.advance(0.1)
    second = gw.call(CASE, 1, 1, request())
    assert isinstance(second, RetryPending)
    assert second.retry_not_before == clock.now + timedelta(seconds=6)
    clock.advance(6)
    done = gw.call(CASE, 1, 1, request())
    assert isinstance(done, Succeeded) and done.attempt == 3
    (op,) = operations(store)
    assert op.round_index == 2 and op.attempts_made == 3


def test_retry_after_raises_the_delay_and_max_delay_caps_backoff(store: Store) -> None:
    clock = Clock()
    p = FakeProvider("a", [transient(retry_after_s=30), transient(retry_after_s=0.5),
                           transient(retry_after_s=500)])
    gw = gateway(store, [p], clock, delay_s=2.0, backoff_factor=10.0, max_delay_s=15.0)
    first = gw.call(CASE, 1, 1, request())
    assert isinstance(first, RetryPending)
    assert first.retry_not_before == T0 + timedelta(seconds=30)  # Retry-After > backoff
    clock.now = first.retry_not_before
    second = gw.call(CASE, 1, 1, request())
    assert isinstance(second, RetryPending)
    # backoff 2 * 10 = 20, capped at 15; Retry-After 0.5 is lower
    assert second.retry_not_before == clock.now + timedelta(seconds=15)
    clock.now = second.retry_not_before
    third = gw.call(CASE, 1, 1, request())
    assert isinstance(third, RetryPending)
    # Retry-After beyond max_delay_s is still honoured
    assert third.retry_not_before == clock.now + timedelta(seconds=500)


def test_retry_id_does_not_override_backoff(store: Store) -> None:
    clock = Clock()
    p = FakeProvider("a", [transient()])
    gw = gateway(store, [p], clock)
    first = gw.call(CASE, 1, 1, request())
    assert isinstance(first, RetryPending)
    assert gw.call(CASE, 1, 1, request(), retry_id="operator-1") == first
    assert len(operations(store)) == 1 and len(p.sent) == 1


# -- failover ------------------------------------------------------------------------------------


def test_failover_in_order_within_one_call(store: Store) -> None:
    a = FakeProvider("a", [transient()])
    b = FakeProvider("b", [ok()])
    outcome = gateway(store, [a, b], Clock()).call(CASE, 1, 1, request())
    assert isinstance(outcome, Succeeded)
    assert outcome.provider == "b" and outcome.attempt == 2
    assert [(x.attempt, x.provider, x.status) for x in attempts(store)] == [
        (1, "a", "failed"), (2, "b", "succeeded")
    ]


def test_round_failure_then_next_round_starts_at_first_provider(store: Store) -> None:
    clock = Clock()
    a = FakeProvider("a", [transient(retry_after_s=9), ok()])
    b = FakeProvider("b", [transient(retry_after_s=4)])
    gw = gateway(store, [a, b], clock, delay_s=1.0)
    first = gw.call(CASE, 1, 1, request())
    assert isinstance(first, RetryPending)
    assert first.retry_not_before == T0 + timedelta(seconds=9)  # largest Retry-After of round
    clock.now = first.retry_not_before
    done = gw.call(CASE, 1, 1, request())
    assert isinstance(done, Succeeded) and done.provider == "a" and done.attempt == 3


def test_exhaustion_after_configured_attempts(store: Store) -> None:
    clock = Clock()
    a = FakeProvider("a", [transient(), transient(), ok()])
    b = FakeProvider("b", [transient()])
    gw = gateway(store, [a, b], clock, attempts=3, delay_s=1.0)
    assert isinstance(gw.call(CASE, 1, 1, request()), RetryPending)
    clock.advance(1)
    blocked = gw.call(CASE, 1, 1, request())
    assert isinstance(blocked, Blocked)
    assert blocked.reason == "PROVIDER_EXHAUSTED"
    assert blocked.error_code == "PROVIDER_SERVER_ERROR"
    assert "3 attempts" in blocked.message
    assert len(a.sent) + len(b.sent) == 3
    # blocked stays blocked, without calling
    clock.advance(3600)
    assert gw.call(CASE, 1, 1, request()) == blocked
    assert len(a.sent) + len(b.sent) == 3
    (op,) = operations(store)
    assert op.status == "exhausted"
    # an operator retry id opens a new operation
    fresh = gw.call(CASE, 1, 1, request(), retry_id="resume-1")
    assert isinstance(fresh, Succeeded) and fresh.operation_id != blocked.operation_id
    assert [o.retry_id for o in operations(store)] == ["", "resume-1"]


def test_credentials_error_blocks(store: Store) -> None:
    a = FakeProvider("a", [ProviderCredentialsError("PROVIDER_CREDENTIALS", "HTTP 401")])
    b = FakeProvider("b", [ok()])
    gw = gateway(store, [a, b], Clock())
    blocked = gw.call(CASE, 1, 1, request())
    assert blocked == Blocked(blocked.operation_id, "PROVIDER_CREDENTIALS",  # type: ignore[union-attr]
                              "PROVIDER_CREDENTIALS", "HTTP 401")
    assert b.sent == []
    assert gw.call(CASE, 1, 1, request()) == blocked  # read back from the row
    assert operations(store)[0].status == "failed"


def test_missing_key_variable_blocks_as_credentials(store: Store) -> None:
    a = FakeProvider("a", [ProviderCredentialsError("PROVIDER_CREDENTIALS_MISSING", "unset")])
    gw = gateway(store, [a], Clock())
    blocked = gw.call(CASE, 1, 1, request())
    assert isinstance(blocked, Blocked) and blocked.reason == "PROVIDER_CREDENTIALS"
    assert gw.call(CASE, 1, 1, request()) == blocked


def test_configuration_error_blocks(store: Store) -> None:
    a = FakeProvider("a", [ProviderConfigurationError("PROVIDER_SCRIPT_EXHAUSTED", "no line")])
    gw = gateway(store, [a], Clock())
    blocked = gw.call(CASE, 1, 1, request())
    assert isinstance(blocked, Blocked)
    assert (blocked.reason, blocked.error_code) == ("PROVIDER_CONFIGURATION",
                                                     "PROVIDER_SCRIPT_EXHAUSTED")
    assert gw.call(CASE, 1, 1, request()) == blocked


def test_unexpected_exception_blocks_and_never_propagates(store: Store) -> None:
    a = FakeProvider("a", [ZeroDivisionError("bug")])
    blocked = gateway(store, [a], Clock()).call(CASE, 1, 1, request())
    assert isinstance(blocked, Blocked)
    assert (blocked.reason, blocked.error_code) == ("PROVIDER_CONFIGURATION", "PROVIDER_UNEXPECTED")
    assert "ZeroDivisionError" in blocked.message


def test_build_failure_blocks_without_attempt(store: Store) -> None:
    class Broken(FakeProvider):
        def build_request_bytes(self, req: ChatRequest) -> bytes:
            raise ValueError("cannot encode")

    blocked = gateway(store, [Broken("a")], Clock()).call(CASE, 1, 1, request())
    assert isinstance(blocked, Blocked) and blocked.error_code == "PROVIDER_UNEXPECTED"
    assert attempts(store) == []


def test_rejected_request_fails_over(store: Store) -> None:
    a = FakeProvider("a", [ProviderRequestRejected("PROVIDER_REQUEST_TOO_LARGE", "413")])
    b = FakeProvider("b", [ok()])
    outcome = gateway(store, [a, b], Clock()).call(CASE, 1, 1, request())
    assert isinstance(outcome, Succeeded) and outcome.provider == "b"
    assert attempts(store)[0].status == "rejected"


def test_rejected_by_the_only_provider_blocks(store: Store) -> None:
    a = FakeProvider("a", [ProviderRequestRejected("PROVIDER_REQUEST_TOO_LARGE", "413")])
    blocked = gateway(store, [a], Clock()).call(CASE, 1, 1, request())
    assert isinstance(blocked, Blocked)
    assert (blocked.reason, blocked.error_code) == ("PROVIDER_CONFIGURATION",
                                                     "PROVIDER_REQUEST_TOO_LARGE")


def test_rejecting_provider_is_skipped_in_later_rounds(store: Store) -> None:
    clock = Clock()
    a = FakeProvider("a", [ProviderRequestRejected("PROVIDER_REQUEST_TOO_LARGE", "413")])
    b = FakeProvider("b", [transient(), ok()])
    gw = gateway(store, [a, b], clock, delay_s=1.0)
    assert isinstance(gw.call(CASE, 1, 1, request()), RetryPending)
    clock.advance(1)
    done = gw.call(CASE, 1, 1, request())
    assert isinstance(done, Succeeded) and done.provider == "b"
    assert len(a.sent) == 1  # the same bytes never went to "a" again


# -- crashes and concurrency -------------------------------------------------------------------


def test_interrupted_attempt_counts_and_is_retried(store: Store) -> None:
    clock = Clock()
    a = FakeProvider("a", [Crash(), ok()])
    gw = gateway(store, [a], clock)
    with pytest.raises(Crash):
        gw.call(CASE, 1, 1, request())
    (att,) = attempts(store)
    assert att.status == "sent"  # the request was stored, the response never was
    done = gateway(store, [a], clock).call(CASE, 1, 1, request())
    assert isinstance(done, Succeeded) and done.attempt == 2
    first, second = attempts(store)
    assert (first.status, first.error_code) == ("failed", "PROVIDER_INTERRUPTED")
    assert second.status == "succeeded"
    assert a.sent[0] == a.sent[1]  # identical request bytes on the resend
    assert operations(store)[0].attempts_made == 2


def test_interrupted_last_attempt_exhausts(store: Store) -> None:
    a = FakeProvider("a", [Crash()])
    gw = gateway(store, [a], Clock(), attempts=1)
    with pytest.raises(Crash):
        gw.call(CASE, 1, 1, request())
    blocked = gw.call(CASE, 1, 1, request())
    assert isinstance(blocked, Blocked)
    assert (blocked.reason, blocked.error_code) == ("PROVIDER_EXHAUSTED", "PROVIDER_INTERRUPTED")
    assert len(a.sent) == 1


def test_in_flight_grace_returns_retry_pending(store: Store) -> None:
    clock = Clock()
    a = FakeProvider("a", [Crash(), ok()])
    config = GatewayConfig(attempts=5)
    with pytest.raises(Crash):
        LLMGateway(store, [a], config, clock=clock).call(CASE, 1, 1, request())
    gw = LLMGateway(store, [a], config, clock=clock, in_flight_grace_s=120)
    pending = gw.call(CASE, 1, 1, request())
    assert isinstance(pending, RetryPending)
    assert pending.retry_not_before == T0 + timedelta(seconds=120)
    assert pending.error_code == "PROVIDER_CALL_IN_FLIGHT"
    clock.advance(120)
    assert isinstance(gw.call(CASE, 1, 1, request()), Succeeded)


def test_default_grace_covers_the_longest_provider_call(store: Store) -> None:
    a, b = FakeProvider("a", [ok()]), FakeProvider("b", [ok()])
    b.timeout_s = 30.0  # type: ignore[attr-defined]
    gw = LLMGateway(store, [a, b], GatewayConfig())
    assert gw.in_flight_grace_s == 2 * 30.0 + 5.0


def test_late_worker_loses_against_recovery(store: Store) -> None:
    def recovered_meanwhile(request_bytes: bytes, req: ChatRequest) -> ProviderReply:
        # Another worker declared this attempt interrupted while we were waiting.
        with store.session() as s:
            att = s.exec(select(LLMAttempt)).one()
            att.status = "failed"
            s.add(att)
        return ok()

    a = FakeProvider("a", [recovered_meanwhile])
    with pytest.raises(StaleStateError):
        gateway(store, [a], Clock()).call(CASE, 1, 1, request())
    (att,) = attempts(store)
    assert att.response_path is None  # the late answer was not merged


def test_operations_are_per_step_and_case(store: Store) -> None:
    a = FakeProvider("a", [ok("1"), ok("2")])
    gw = gateway(store, [a], Clock())
    one = gw.call(CASE, 1, 1, request(0))
    two = gw.call(CASE, 1, 2, request(1))
    assert isinstance(one, Succeeded) and isinstance(two, Succeeded)
    assert (one.content, two.content) == ("1", "2")
    assert one.operation_id != two.operation_id
    assert json.loads(a.sent[1])["call"] == 1


def test_clock_must_be_aware(store: Store) -> None:
    gw = LLMGateway(store, [FakeProvider("a", [ok()])], GatewayConfig(),
                    clock=lambda: datetime(2030, 1, 1))
    with pytest.raises(ValueError):
        gw.call(CASE, 1, 1, request())


def test_gateway_rejects_duplicate_provider_names(store: Store) -> None:
    with pytest.raises(ValueError):
        LLMGateway(store, [FakeProvider("a"), FakeProvider("a")], GatewayConfig())


def test_a_reply_is_stored_on_a_new_connection_when_the_database_dropped_the_old_one(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PostgreSQL backend killed right after the model answered: the reply was given
    up, the attempt stayed "sent" until its grace ran out and the same request was paid
    for again (a fleet trial). It is stored on a new connection instead; a failure that is
    not a lost connection is raised as before."""
    from sqlalchemy.exc import OperationalError

    real = LLMGateway._store_response
    drops = [OperationalError("INSERT", {}, Exception("server closed the connection"),
                              connection_invalidated=True)]

    def flaky(self: LLMGateway, *args: object) -> tuple[str | None, str | None]:
        if drops:
            raise drops.pop()
        return real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(LLMGateway, "_store_response", flaky)
    p = FakeProvider("a", [ok()])
    result = gateway(store, [p], Clock()).call(CASE, 1, 3, request())
    assert isinstance(result, Succeeded) and len(p.sent) == 1 and not drops
    (att,) = attempts(store)
    assert att.status == "succeeded"

    other = [OperationalError("INSERT", {}, Exception("disk full"))]

    def failing(self: LLMGateway, *args: object) -> tuple[str | None, str | None]:
        raise other[0]

    monkeypatch.setattr(LLMGateway, "_store_response", failing)
    with pytest.raises(OperationalError):
        gateway(store, [FakeProvider("a", [ok()])], Clock()).call(CASE, 1, 4, request())


def test_a_runtime_interruption_in_a_provider_call_is_not_a_provider_failure(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's soft time limit raised inside a model call was classified as
    PROVIDER_UNEXPECTED ("a bug in the provider adapter") and blocked the case as
    PROVIDER_CONFIGURATION (a fleet trial); it reaches the stage, which records
    STAGE_TIME_LIMIT. The worker registers Celery's exception."""
    from celery.exceptions import SoftTimeLimitExceeded

    import workers.tasks  # noqa: F401  (registers the soft time limit)
    from investigation.llm import gateway as gw_module

    assert SoftTimeLimitExceeded in gw_module._interruptions
    p = FakeProvider("a", [SoftTimeLimitExceeded()])
    with pytest.raises(SoftTimeLimitExceeded):
        gateway(store, [p], Clock()).call(CASE, 1, 3, request())
    (att,) = attempts(store)
    assert att.status == "sent"  # as after a crash: the next call counts it interrupted
    assert [op.error_code for op in operations(store)] == [None]
