"""What real OpenAI-compatible servers do, over loopback HTTP, through the whole loop.

* the request carries this turn's reply schema in the dialect's form, and a plain
  language header before the context;
* a rejected reply goes back as the model's own turn, followed by the rejection;
* a fenced reply with raw newlines is normalised (recorded), its raw bytes kept;
* a reply cut at ``max_tokens`` is rejected as ``REPLY_TRUNCATED``, never resent unchanged;
* configuration errors block at once with the server's words: a body naming
  ``response_format``; the same 5xx body to identical bytes; a connection dropped again
  and again on identical bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import select

from investigation.cases.reader import PackageReader
from investigation.config import GatewayConfig, InvestigationConfig, ProviderConfig
from investigation.constants import BLOCKED, PROGRESSED, REJECTED, RETRY_PENDING
from investigation.llm import dialects
from investigation.llm.gateway import LLMGateway
from investigation.llm.openai import OpenAIProvider
from investigation.llm.replay_server import Fault, ReplayServer
from investigation.loop.env import StageEnv
from investigation.loop.investigator import Investigator
from investigation.loop.outcome import Outcome
from investigation.store import Store
from investigation.store.models import LLMAttempt, StageRun
from tests import casekit
from tests.casekit import Case, make_case

FIRST = casekit.q("source.search", {"pattern": "percent / 10"}, new_questions=["Where?"])
SECOND = casekit.q("db.query", {"sql": "SELECT id, total, discount FROM orders ORDER BY id"},
                   confidence="weak")


class Rig:
    """A tiny case whose model is a loopback OpenAI-compatible server."""

    def __init__(self, case: Case, server: ReplayServer, dialect: str,
                 attempts: int = 5) -> None:
        self.case, self.server = case, server
        cfg = ProviderConfig(name="local", kind="openai", base_url=server.base_url,
                             model="m", structured_output=dialect)  # type: ignore[arg-type]
        self.env = StageEnv(
            store=case.store, config=InvestigationConfig(),
            gateway_factory=lambda: LLMGateway(
                case.store, [OpenAIProvider(cfg, env={})],
                GatewayConfig(attempts=attempts, delay_s=0.0)),
            reader=PackageReader(InvestigationConfig().package))

    def step(self) -> Outcome:
        return Investigator(self.env).step(self.case.case_id)

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.body) for r in self.server.requests]

    def stage(self, step: int, stage: str) -> dict[str, Any]:
        with self.case.store.session() as s:
            row = s.exec(select(StageRun).where(StageRun.step_seq == step,
                                                StageRun.stage == stage)).one()
        return dict(json.loads(row.output_json))

    def artifact(self, path: str) -> bytes:
        with self.case.store.session() as s:
            art = Store.get_artifact(s, self.case.case_id, path)
        assert art is not None
        return bytes(art.data)


@pytest.fixture
def rig(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Rig]:
    replies, dialect = request.param
    case = make_case(tmp_path / "c", replies=[])
    with ReplayServer(replies) as server:
        yield Rig(case, server, dialect)


@pytest.mark.parametrize("rig", [([json.dumps(FIRST)], "llama_cpp")], indirect=True)
@pytest.mark.parametrize("body", [
    b'{"detail": "Internal Server Error"}',
    b'{"error": {"message": "internal server error", "code": 500}}',
    b"Internal Server Error\n",
])
def test_a_generic_500_repeated_stays_a_server_error(rig: Rig, body: bytes) -> None:
    """A flaky backend's generic 500, twice to the same bytes, blocked its case as
    PROVIDER_DETERMINISTIC_ERROR with "fix the providers file" (a fleet trial): words that
    say nothing of the request, in JSON or not, are an overloaded or broken server."""
    rig.server.add_faults(Fault(status=500, body=body), Fault(status=500, body=body))
    for _ in range(2):  # (no backoff: the rig's delay_s is 0)
        pending = rig.step()
        assert (pending.outcome, pending.reason) == (RETRY_PENDING, "PROVIDER_SERVER_ERROR")
    assert len(rig.server.requests) == 2
    assert rig.step().outcome == PROGRESSED  # the server works again: the step goes on


def test_which_5xx_bodies_say_something() -> None:
    from investigation.llm.failures import _says_something

    for said in (b'{"error": {"message": "failed to load grammar"}}', b"boom 42",
                 b'{"detail": "model not found"}', b'{"error": "bad schema"}', b"[1]",
                 b'{"unexpected": 1}', b'{"detail": ["Internal Server Error", 1]}',
                 b"[" * 200_000, b"\xff\xfe{"):
        assert _says_something(said), said
    for generic in (b"", b"  Error ", b'{"detail": "Internal Server Error"}',
                    b'{"message": "error", "error": {"message": "Server Error"}}'):
        assert not _says_something(generic), generic


@pytest.mark.parametrize("rig", [([json.dumps(FIRST)], "llama_cpp")], indirect=True)
def test_request_carries_the_turn_schema_and_a_header(rig: Rig) -> None:
    assert rig.step().outcome == PROGRESSED
    (body,) = rig.bodies()
    built = rig.stage(1, "build_context")
    stored = json.loads(rig.artifact(built["reply_schema_path"]))
    assert body["response_format"] == dialects.response_format("llama_cpp", stored,
                                                               "investigation_reply")
    assert body["response_format"]["type"] == "json_object"
    _system, user = body["messages"]
    assert user["content"].startswith("Turn 1 of hypothesis 1 (of 2): ")
    assert '- "assessment": null' in user["content"]
    assert "Operations you can afford: source.list (2 units)" in user["content"]
    assert "\n\nContext (investigation-v3):\n{" in user["content"]


BAD = json.dumps({**FIRST, "assessment": {"score": 50, "reason": "r", "evidence_ids": ["E9"]}})


@pytest.mark.parametrize("rig", [([BAD, json.dumps(FIRST)], "openai")], indirect=True)
def test_a_rejected_reply_goes_back_as_a_turn_with_the_exact_rejection(rig: Rig) -> None:
    first = rig.step()
    assert (first.outcome, first.reason) == (REJECTED, "ASSESSMENT_UNEXPECTED")
    assert rig.step().outcome == PROGRESSED
    _, second = rig.bodies()
    roles = [m["role"] for m in second["messages"]]
    assert roles == ["system", "user", "assistant", "user"]
    assert second["messages"][2]["content"] == BAD  # the model's own reply, exact
    rejection = rig.stage(1, "validate")
    assert second["messages"][3]["content"].startswith(
        f"Your previous reply was refused: ASSESSMENT_UNEXPECTED: {rejection['detail']}")
    # The strict dialect: every property required, optional ones nullable.
    schema = second["response_format"]["json_schema"]["schema"]
    assert second["response_format"]["json_schema"]["strict"] is True
    assert schema["required"] == ["assessment", "update", "next"]


FENCED = "```json\n" + json.dumps(FIRST).replace(
    '"note": ""', '"note": "line one\nline\ttwo"') + "\n```"


@pytest.mark.parametrize("rig", [([FENCED], "llama_cpp")], indirect=True)
def test_a_fenced_reply_with_raw_newlines_is_normalised_and_recorded(rig: Rig) -> None:
    assert "\n" in FENCED and "line one\nline" in FENCED
    assert rig.step().outcome == PROGRESSED
    verdict = rig.stage(1, "validate")
    assert verdict["accepted"] is True
    assert verdict["normalised"] == ["CODE_FENCE", "RAW_CONTROL_IN_STRING"]
    assert verdict["decision"]["reply"]["update"]["note"] == "line one\nline\ttwo"
    with rig.case.store.session() as s:
        attempt = s.exec(select(LLMAttempt)).one()
    raw = json.loads(rig.artifact(attempt.response_path or ""))
    assert raw["choices"][0]["message"]["content"] == FENCED  # raw bytes kept


CUT = json.dumps(FIRST)[:80]


@pytest.mark.parametrize("rig", [([CUT, json.dumps(FIRST)], "llama_cpp")], indirect=True)
def test_a_reply_cut_at_max_tokens_is_rejected_and_not_resent_unchanged(rig: Rig) -> None:
    rig.server.add_faults(Fault(finish_reason="length"))
    first = rig.step()
    assert (first.outcome, first.reason) == (REJECTED, "REPLY_TRUNCATED")
    assert "token limit" in rig.stage(1, "validate")["detail"]
    assert rig.step().outcome == PROGRESSED
    one, two = rig.bodies()
    assert one != two and two["messages"][-1]["content"].startswith(
        "Your previous reply was refused: REPLY_TRUNCATED")


LLAMA_500 = json.dumps({"error": {"message": "[{'type': 'literal_error', 'loc': ('body', "
                                  "'response_format', 'type'), 'msg': \"Input should be "
                                  "'text' or 'json_object'\"}]", "type": "internal_server_error"}})


@pytest.mark.parametrize("rig", [([json.dumps(FIRST)], "openai")], indirect=True)
def test_a_server_refusing_the_dialect_blocks_at_once_with_its_words(rig: Rig) -> None:
    rig.server.add_faults(Fault(status=500, body=LLAMA_500.encode()))
    outcome = rig.step()
    assert (outcome.outcome, outcome.reason) == (BLOCKED, "PROVIDER_CONFIGURATION")
    assert outcome.details["error_code"] == "PROVIDER_SCHEMA_REFUSED"
    assert "Input should be 'text' or 'json_object'" in outcome.details["message"]
    assert "structured_output" in outcome.details["message"]
    assert len(rig.server.requests) == 1  # no backoff ladder


@pytest.mark.parametrize("rig", [([json.dumps(FIRST)], "llama_cpp")], indirect=True)
def test_the_same_500_to_identical_bytes_is_a_configuration_error(rig: Rig) -> None:
    body = json.dumps({"error": {"message": "failed to load grammar"}}).encode()
    plain = json.dumps({"error": {"message": "boom 42"}}).encode()
    rig.server.add_faults(Fault(status=500, body=plain), Fault(status=500, body=plain))
    assert b"grammar" in body  # (a body naming the grammar would block at once)
    first = rig.step()
    assert (first.outcome, first.reason) == (RETRY_PENDING, "PROVIDER_SERVER_ERROR")
    second = rig.step()
    assert (second.outcome, second.reason) == (BLOCKED, "PROVIDER_CONFIGURATION")
    assert second.details["error_code"] == "PROVIDER_DETERMINISTIC_ERROR"
    assert "boom 42" in second.details["message"]
    assert "analysis/investigation/0001/llm/1/attempt-02.request.json" in \
        second.details["message"]
    assert len(rig.server.requests) == 2


@pytest.mark.parametrize("rig", [([json.dumps(FIRST)], "llama_cpp")], indirect=True)
def test_a_connection_dropped_again_and_again_names_the_request(rig: Rig) -> None:
    rig.server.add_faults(*[Fault.cut_off(10)] * 3)
    assert [rig.step().reason for _ in range(2)] == ["PROVIDER_NETWORK_ERROR"] * 2
    third = rig.step()
    assert (third.outcome, third.reason) == (BLOCKED, "PROVIDER_CONFIGURATION")
    assert third.details["error_code"] == "PROVIDER_REQUEST_DROPPED"
    assert "dropped the connection 3 times on identical request bytes" in \
        third.details["message"]
    assert "analysis/investigation/0001/llm/1/attempt-03.request.json" in \
        third.details["message"]


@pytest.mark.parametrize("rig", [([json.dumps(FIRST)], "llama_cpp")], indirect=True)
def test_the_report_says_a_step_retried_past_a_provider_error(rig: Rig) -> None:
    """A 503 then a reply: the step progressed, and its row showed "provider: 503's code"
    in the rejection column as if that had stopped it (a 300-step case's reader)."""
    from investigation.report import render_report

    rig.server.add_faults(Fault(status=503))
    assert rig.step().outcome == RETRY_PENDING
    waiting = render_report(rig.case.store, rig.case.case_id)
    assert '<span class="muted">provider: PROVIDER_SERVER_ERROR</span>' in waiting
    assert rig.step().outcome == PROGRESSED
    html = render_report(rig.case.store, rig.case.case_id)
    assert '<span class="muted">retried after: PROVIDER_SERVER_ERROR</span>' in html
    assert "provider: PROVIDER_SERVER_ERROR" not in html
