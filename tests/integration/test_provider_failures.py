"""Provider failures met by a real case run (seed 000, "Provider failures and external tests").

A loopback OpenAI-compatible server (``ReplayServer``) answers the tiny case's decisions.
After one clean step (so the case has charged budget and pending evidence E1), a fault is
injected into the next model call, and the real stages run the step. Each fault must give
its outcome, block reason and ``retry_not_before`` at once, lose nothing (budgets, pending
evidence, the frozen context) and charge nothing; once the cause is gone (the clock passed
the backoff, or the operator resumed with a retry id) the case completes exactly as a
clean run does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import col, select

from investigation.cases.reader import PackageReader
from investigation.config import GatewayConfig, InvestigationConfig, ProviderConfig
from investigation.constants import BLOCKED, COMPLETED, PROGRESSED, RETRY_PENDING
from investigation.errors import InvestigationError
from investigation.llm import LLMGateway, OpenAIProvider, ReplayServer
from investigation.llm.replay_server import Fault
from investigation.llm.types import ChatRequest, Provider, ProviderReply
from investigation.loop.env import StageEnv
from investigation.loop.investigator import Investigator
from investigation.operations import resume, status, summary_bytes
from investigation.store.engine import Store
from investigation.store.models import (
    Artifact,
    Evidence,
    LedgerEntry,
    LLMAttempt,
    LLMOperation,
    Plan,
    StageRun,
)
from tests import casekit
from tests.casekit import Case, make_case

T0 = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
KEY = "sk-loopback-SECRET"
REPLIES = [json.dumps(r) for r in casekit.HAPPY_REPLIES]
DELAY_S = 2.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


#: Each scripted server's client timeout: long enough that a loaded CI machine answers a
#: healthy request in time (0.5 s flaked under load), short enough for the timeout faults.
PROVIDER_TIMEOUT_S = 2.0


@dataclass
class Rig:
    """A case, its loopback servers, a fake gateway clock and an environment builder."""

    case: Case
    clock: Clock
    servers: list[ReplayServer]
    attempts: int = 10
    wrap: Any = None
    timeouts: dict[str, float] = field(default_factory=dict)

    def provider(self, server: ReplayServer, name: str) -> OpenAIProvider:
        config = ProviderConfig(name=name, kind="openai", base_url=server.base_url,
                                model="replay", api_key_env="LOOPBACK_KEY",
                                timeout_s=self.timeouts.get(name, PROVIDER_TIMEOUT_S))
        return OpenAIProvider(config, env={"LOOPBACK_KEY": KEY})

    def env(self) -> StageEnv:
        """A fresh environment, as a new process (or a fixed providers file) builds it."""
        providers: list[Provider] = [self.provider(s, f"p{i}")
                                     for i, s in enumerate(self.servers)]
        if self.wrap is not None:
            providers = [self.wrap(p) for p in providers]
        gw = GatewayConfig(attempts=self.attempts, delay_s=DELAY_S)
        store = self.case.store
        return StageEnv(store=store, config=InvestigationConfig(),
                        gateway_factory=lambda: LLMGateway(store, providers, gw,
                                                           clock=self.clock),
                        reader=PackageReader(InvestigationConfig().package))

    def step(self) -> Any:
        return Investigator(self.env()).step(self.case.case_id)

    def requests(self) -> int:
        return sum(len(s.requests) for s in self.servers)


def start_server() -> ReplayServer:
    return ReplayServer(REPLIES).start()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    case = make_case(tmp_path / "case")
    servers = [start_server()]
    yield Rig(case, Clock(), servers)
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same case over the same HTTP path without any fault."""
    case = make_case(tmp_path_factory.mktemp("reference"))
    server = start_server()
    try:
        r = Rig(case, Clock(), [server])
        for _ in range(20):
            if r.step().outcome == COMPLETED:
                break
        assert interruptions(case) == []  # nothing failed: no such section
        return outcome_state(case)
    finally:
        server.stop()


def outcome_state(case: Case) -> dict[str, Any]:
    """What a completed case must look like whatever failures it met on the way."""
    with case.store.session() as s:
        evidence = s.exec(select(Evidence).where(Evidence.case_id == case.case_id)).all()
        ledger = s.exec(select(LedgerEntry).where(LedgerEntry.case_id == case.case_id)
                        .order_by(col(LedgerEntry.hypothesis_id), col(LedgerEntry.step_seq),
                                  col(LedgerEntry.kind))).all()
    summary = summary_bytes(case.store, case.case_id).decode()
    # Model usage counts every attempt and the interruptions name the failures, so both
    # differ by design after failed attempts.
    head, _, rest = summary.partition("## Model usage")
    return {
        "summary": head.split("## Interruptions", 1)[0]
        + rest[rest.index("## Early diagnosis reviews"):],
        "evidence": sorted((e.evidence_id, e.step_seq, e.fingerprint) for e in evidence),
        "ledger": [(r.hypothesis_id, r.step_seq, r.kind, r.amount_units) for r in ledger],
    }


def interruptions(case: Case) -> list[str]:
    """The lines of summary.md's ``## Interruptions`` (none: no such section)."""
    summary = summary_bytes(case.store, case.case_id).decode()
    if "## Interruptions" not in summary:
        return []
    section = summary.split("## Interruptions\n\n", 1)[1].split("\n\n", 1)[0]
    return section.splitlines()


def kept(case: Case) -> dict[str, Any]:
    """Everything a provider failure must neither lose nor charge."""
    info = status(case.store, case.case_id)
    with case.store.session() as s:
        ledger = s.exec(select(LedgerEntry).where(LedgerEntry.case_id == case.case_id)).all()
        evidence = s.exec(select(Evidence).where(Evidence.case_id == case.case_id)).all()
        plans = s.exec(select(Plan).where(Plan.case_id == case.case_id)).all()
        non_llm = s.exec(select(Artifact.path, Artifact.sha256).where(
            Artifact.case_id == case.case_id)).all()
    return {
        "accounts": info["accounts"], "steps": info["steps"], "head": info["head_hash"],
        "evidence_count": info["evidence_count"], "open_questions": info["open_questions"],
        "pointers": info["pointers"],
        "ledger": sorted((r.hypothesis_id, r.step_seq, r.kind, r.amount_units)
                         for r in ledger),
        "evidence": sorted((e.evidence_id, e.fingerprint) for e in evidence),
        "plans": len(plans),
        "artifacts": sorted((p, d) for p, d in non_llm if "/llm/" not in p),
    }


def first_step(rig: Rig) -> dict[str, Any]:
    """Run the clean first step; return what must be kept from then on."""
    assert rig.step().outcome == PROGRESSED
    before = kept(rig.case)
    account = before["accounts"][0]
    assert account["pending_evidence_id"] == "E1"  # pending evidence exists
    assert account["balance_units"] < account["credit_units"]  # credit was reserved
    return before


def step2_context(case: Case) -> bytes:
    with case.store.session() as s:
        art = Store.get_artifact(s, case.case_id, "analysis/investigation/0002/context.json")
    assert art is not None
    return art.data


def step2_requests(case: Case) -> list[str]:
    """sha256 of every request sent for step 2, over all operations."""
    with case.store.session() as s:
        ops = [o.id for o in s.exec(select(LLMOperation).where(
            LLMOperation.case_id == case.case_id, LLMOperation.step_seq == 2))]
        return [a.request_sha256 for a in s.exec(select(LLMAttempt).where(
            col(LLMAttempt.operation_id).in_(ops)).order_by(col(LLMAttempt.id)))]


def unchanged_except_context(before: dict[str, Any], after: dict[str, Any]) -> None:
    """Only step 2's frozen context and its reply schema were added; nothing else moved."""
    added = sorted(set(after["artifacts"]) - set(before["artifacts"]))
    assert [p for p, _ in added] == ["analysis/investigation/0002/context.json",
                                     "analysis/investigation/0002/reply-schema.json"]
    assert set(before["artifacts"]) <= set(after["artifacts"])
    assert {k: v for k, v in after.items() if k != "artifacts"} == \
        {k: v for k, v in before.items() if k != "artifacts"}


def complete(rig: Rig) -> None:
    for _ in range(20):
        outcome = rig.step()
        if outcome.outcome == COMPLETED:
            return
        assert outcome.outcome == PROGRESSED, outcome
    raise AssertionError("the case did not complete")


CONTEXT_TOO_LONG = json.dumps({"error": {
    "message": "This model's maximum context length is 8192 tokens", "type":
    "invalid_request_error", "code": "context_length_exceeded", "param": None}}).encode()

#: fault, error code, expected seconds of backoff (transient: RETRY_PENDING).
TRANSIENT = [
    pytest.param(Fault.http(429, retry_after="45"), "PROVIDER_RATE_LIMITED", 45.0,
                 id="429-retry-after"),
    pytest.param(Fault.http(500), "PROVIDER_SERVER_ERROR", DELAY_S, id="500"),
    pytest.param(Fault.delay(2 * PROVIDER_TIMEOUT_S), "PROVIDER_TIMEOUT", DELAY_S, id="timeout"),
    pytest.param(Fault.malformed(), "PROVIDER_MALFORMED_RESPONSE", DELAY_S, id="malformed-json"),
    pytest.param(Fault.cut_off(), "PROVIDER_NETWORK_ERROR", DELAY_S, id="truncated-body"),
]


@pytest.mark.parametrize(("fault", "code", "backoff_s"), TRANSIENT)
def test_transient_failure_returns_retry_pending_at_once_and_loses_nothing(
    rig: Rig, reference: dict[str, Any], fault: Fault, code: str, backoff_s: float
) -> None:
    before = first_step(rig)
    rig.servers[0].add_faults(fault)
    started = time.monotonic()
    pending = rig.step()
    took_s = time.monotonic() - started
    assert (pending.outcome, pending.reason) == (RETRY_PENDING, code)
    assert pending.retry_not_before == T0 + timedelta(seconds=backoff_s)
    assert took_s < PROVIDER_TIMEOUT_S + 5  # the provider's own timeout at most, never the backoff
    info = status(rig.case.store, rig.case.case_id)
    assert info["state"] == "INVESTIGATING" and info["blocked_reason"] is None
    assert info["retry_not_before"] == (T0 + timedelta(seconds=backoff_s)).isoformat()
    unchanged_except_context(before, kept(rig.case))
    context = step2_context(rig.case)
    # Before the backoff ends, the step returns at once without contacting the provider.
    sent = rig.requests()
    rig.clock.now = T0 + timedelta(seconds=backoff_s - 0.5)
    again = rig.step()
    assert (again.outcome, again.retry_not_before) == (RETRY_PENDING, pending.retry_not_before)
    assert rig.requests() == sent
    # Once it is due, the same frozen context is sent again and the step progresses.
    rig.clock.now = T0 + timedelta(seconds=backoff_s)
    assert rig.step().outcome == PROGRESSED
    requests = step2_requests(rig.case)
    assert len(requests) == 2 and len(set(requests)) == 1  # identical bytes resent once
    assert step2_context(rig.case) == context
    complete(rig)
    assert outcome_state(rig.case) == reference
    assert interruptions(rig.case) == [
        f"- Step 2 (hypothesis 2): the model call was answered after 1 failed attempt "
        f"({code})"]


#: fault, block reason, error code, whether the very same request may be sent again.
BLOCKING = [
    pytest.param(Fault.http(401), "PROVIDER_CREDENTIALS", "PROVIDER_CREDENTIALS", id="401"),
    pytest.param(Fault.http(403), "PROVIDER_CREDENTIALS", "PROVIDER_CREDENTIALS", id="403"),
    pytest.param(Fault.http(400), "PROVIDER_CONFIGURATION", "PROVIDER_HTTP_CLIENT_ERROR",
                 id="400"),
    pytest.param(Fault.http(404), "PROVIDER_CONFIGURATION", "PROVIDER_HTTP_CLIENT_ERROR",
                 id="404-wrong-url"),
    pytest.param(Fault.http(413), "PROVIDER_CONFIGURATION", "PROVIDER_REQUEST_TOO_LARGE",
                 id="413"),
    pytest.param(Fault.http(400, body=CONTEXT_TOO_LONG), "PROVIDER_CONFIGURATION",
                 "PROVIDER_REQUEST_TOO_LARGE", id="400-context-length"),
]


@pytest.mark.parametrize(("fault", "reason", "code"), BLOCKING)
def test_blocking_failure_keeps_everything_until_the_operator_resumes(
    rig: Rig, reference: dict[str, Any], fault: Fault, reason: str, code: str
) -> None:
    before = first_step(rig)
    rig.servers[0].add_faults(fault)
    blocked = rig.step()
    assert (blocked.outcome, blocked.reason) == (BLOCKED, reason)
    assert blocked.details["error_code"] == code
    assert blocked.retry_not_before is None
    assert KEY not in json.dumps(blocked.details)
    info = status(rig.case.store, rig.case.case_id)
    assert (info["state"], info["blocked_reason"]) == ("BLOCKED", reason)
    assert info["retry_not_before"] is None
    assert info["blocked_detail"].startswith(code + ": ")
    # Since when (a fleet operator could not tell): the time of the block, in UTC.
    since = datetime.fromisoformat(info["blocked_since"])
    assert since.tzinfo is not None and abs(datetime.now(UTC) - since) < timedelta(minutes=1)
    assert [a["status"] for a in info["accounts"]] == ["active", "active"]  # not abandoned
    unchanged_except_context(before, kept(rig.case))
    # Blocked stays blocked: stepping again sends nothing (the same request is not resent).
    sent = rig.requests()
    assert rig.step().outcome == BLOCKED
    assert rig.requests() == sent
    with pytest.raises(InvestigationError) as err:
        resume(rig.case.store, rig.case.case_id)
    assert err.value.code == "RETRY_ID_REQUIRED"
    unchanged_except_context(before, kept(rig.case))
    # The operator fixed the cause (the fault is gone) and resumes with a new retry id.
    resume(rig.case.store, rig.case.case_id, retry_id="fixed-1")
    assert status(rig.case.store, rig.case.case_id)["blocked_since"] is None
    assert rig.step().outcome == PROGRESSED
    complete(rig)
    assert outcome_state(rig.case) == reference
    assert interruptions(rig.case) == [
        f"- Step 2 (hypothesis 2): blocked, the model call failed with {code} after 1 "
        "attempt; resumed, the step ran again"]


def test_exhaustion_blocks_after_the_configured_attempts_and_keeps_everything(
    rig: Rig, reference: dict[str, Any]
) -> None:
    rig.attempts = 3
    before = first_step(rig)
    rig.servers[0].add_faults(Fault.http(503), Fault.http(503), Fault.http(503))
    first = rig.step()
    assert (first.outcome, first.retry_not_before) == (RETRY_PENDING, T0 + timedelta(seconds=2))
    rig.clock.now = first.retry_not_before
    second = rig.step()  # backoff grows: delay_s * backoff_factor ** round
    assert (second.outcome, second.retry_not_before) == (
        RETRY_PENDING, T0 + timedelta(seconds=2 + 4))
    rig.clock.now = second.retry_not_before
    blocked = rig.step()
    assert (blocked.outcome, blocked.reason) == (BLOCKED, "PROVIDER_EXHAUSTED")
    assert blocked.details["error_code"] == "PROVIDER_SERVER_ERROR"
    assert rig.requests() == 1 + 3
    info = status(rig.case.store, rig.case.case_id)
    assert (info["state"], info["blocked_reason"]) == ("BLOCKED", "PROVIDER_EXHAUSTED")
    assert "all 3 attempts" in info["blocked_detail"]
    unchanged_except_context(before, kept(rig.case))
    context = step2_context(rig.case)
    resume(rig.case.store, rig.case.case_id, retry_id="after-outage")
    assert rig.step().outcome == PROGRESSED
    assert step2_context(rig.case) == context
    assert len(set(step2_requests(rig.case))) == 1  # the frozen context, four times
    complete(rig)
    assert outcome_state(rig.case) == reference


def test_the_default_is_ten_attempts(rig: Rig) -> None:
    first_step(rig)
    # 503 is overload, transient however often it repeats (the same 500 body to the same
    # bytes would be a configuration error: test_real_server_quirks).
    rig.servers[0].add_faults(*[Fault.http(503)] * 10)
    outcomes = []
    for _ in range(10):
        outcome = rig.step()
        outcomes.append(outcome.outcome)
        if outcome.retry_not_before is not None:
            rig.clock.now = outcome.retry_not_before
    assert outcomes == [RETRY_PENDING] * 9 + [BLOCKED]
    assert rig.requests() == 1 + 10


def test_failover_in_order_within_one_step(rig: Rig, reference: dict[str, Any]) -> None:
    rig.servers.append(start_server())
    rig.servers.append(start_server())
    first_step(rig)
    rig.servers[0].add_faults(Fault.http(503))
    rig.servers[1].add_faults(Fault.delay(2 * PROVIDER_TIMEOUT_S))
    assert rig.step().outcome == PROGRESSED  # p0 503, p1 timeout, p2 answers: one step
    assert [len(s.requests) for s in rig.servers] == [2, 1, 1]
    with rig.case.store.session() as s:
        op = s.exec(select(LLMOperation).where(LLMOperation.step_seq == 2)).one()
        attempts = s.exec(select(LLMAttempt).where(LLMAttempt.operation_id == op.id)
                          .order_by(col(LLMAttempt.attempt))).all()
    assert [(a.provider, a.status, a.error_code) for a in attempts] == [
        ("p0", "failed", "PROVIDER_SERVER_ERROR"), ("p1", "failed", "PROVIDER_TIMEOUT"),
        ("p2", "succeeded", None)]


def test_a_request_too_large_goes_to_the_next_provider_never_again_to_the_same(
    rig: Rig,
) -> None:
    rig.servers.append(start_server())
    first_step(rig)
    rig.servers[0].add_faults(Fault.http(413))
    rig.servers[1].add_faults(Fault.http(500))
    pending = rig.step()  # p0 rejects the size, p1 fails transiently: back off
    assert (pending.outcome, pending.reason) == (RETRY_PENDING, "PROVIDER_SERVER_ERROR")
    rig.clock.now = pending.retry_not_before
    assert rig.step().outcome == PROGRESSED  # the next round skips p0
    assert [len(s.requests) for s in rig.servers] == [2, 2]


def test_an_unexpected_provider_error_blocks_instead_of_abandoning(rig: Rig) -> None:
    class Broken:
        """Wraps a real provider; its first send of step 2 fails with a bug."""

        calls = 0

        def __init__(self, inner: OpenAIProvider) -> None:
            self.inner = inner
            self.name = inner.name
            self.timeout_s = 0.5

        def check_credentials(self) -> None:
            self.inner.check_credentials()

        def build_request_bytes(self, req: ChatRequest) -> bytes:
            return self.inner.build_request_bytes(req)

        def send(self, request_bytes: bytes, req: ChatRequest) -> ProviderReply:
            Broken.calls += 1
            if Broken.calls == 2:
                raise KeyError("choices")
            return self.inner.send(request_bytes, req)

        def content_from_raw(self, raw: bytes) -> str:
            return self.inner.content_from_raw(raw)

    rig.wrap = Broken
    before = first_step(rig)
    blocked = rig.step()
    assert (blocked.outcome, blocked.reason) == (BLOCKED, "PROVIDER_CONFIGURATION")
    assert blocked.details["error_code"] == "PROVIDER_UNEXPECTED"
    info = status(rig.case.store, rig.case.case_id)
    assert [a["status"] for a in info["accounts"]] == ["active", "active"]
    unchanged_except_context(before, kept(rig.case))
    resume(rig.case.store, rig.case.case_id, retry_id="patched")
    assert rig.step().outcome == PROGRESSED


def test_stage_markers_stop_at_the_failed_call(rig: Rig) -> None:
    """A failed call records no llm_call marker: the rerun asks the gateway again."""
    first_step(rig)
    rig.servers[0].add_faults(Fault.http(401))
    rig.step()
    with rig.case.store.session() as s:
        stages = s.exec(select(StageRun.stage).where(StageRun.step_seq == 2)).all()
    assert list(stages) == ["build_context"]
