"""Tokens and money around real HTTP calls (loopback OpenAI-compatible server).

* a context is fitted to the provider's context window by the token estimate; a request
  that cannot fit is refused before it is sent, with the numbers;
* the server's own tokenizer (llama-cpp-python's ``/extras/tokenize/count``) is used
  when configured;
* money: each call reserves its worst case before sending, ``max_tokens`` is lowered to
  what the cap leaves, actual usage is settled after; the cap blocks the case
  (``MODEL_COST_CAP``), raising it and resuming with a retry id continues; a provider
  without prices is refused while a cap is set; status and summary show tokens and money
  per hypothesis.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import select

from investigation import operations
from investigation.cases.reader import PackageReader
from investigation.config import (
    GatewayConfig,
    InvestigationConfig,
    LimitsConfig,
    ProviderConfig,
    canonical_json,
)
from investigation.constants import BLOCKED, COMPLETED, PROGRESSED
from investigation.llm import spend
from investigation.llm.gateway import Blocked, LLMGateway, Succeeded
from investigation.llm.openai import OpenAIProvider
from investigation.llm.replay_server import ReplayServer
from investigation.llm.tokens import PromptBudget, estimate_tokens
from investigation.llm.types import ChatRequest
from investigation.loop.context import fit_for_model
from investigation.loop.env import StageEnv
from investigation.loop.investigator import Investigator
from investigation.loop.outcome import Outcome
from investigation.loop.prompt import build_messages
from investigation.store import Store
from investigation.store.models import LLMAttempt, StageRun
from tests.casekit import HAPPY_REPLIES, Case, make_case, unguarded


class Rig:
    def __init__(self, case: Case, server: ReplayServer, **provider: Any) -> None:
        self.case, self.server = case, server
        self.provider = ProviderConfig(name="local", kind="openai", base_url=server.base_url,
                                       model="m", structured_output="llama_cpp", **provider)
        self.config = InvestigationConfig()

    def env(self) -> StageEnv:
        return StageEnv(
            store=self.case.store, config=self.config,
            gateway_factory=lambda: LLMGateway(self.case.store,
                                               [OpenAIProvider(self.provider, env={})],
                                               GatewayConfig(attempts=3, delay_s=0.0)),
            reader=PackageReader(InvestigationConfig().package))

    def step(self) -> Outcome:
        return Investigator(self.env()).step(self.case.case_id)

    def chat_bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.body) for r in self.server.requests
                if r.path == "/v1/chat/completions"]

    def artifact(self, path: str) -> bytes:
        with self.case.store.session() as s:
            art = Store.get_artifact(s, self.case.case_id, path)
        assert art is not None
        return bytes(art.data)

    def attempts(self) -> list[LLMAttempt]:
        with self.case.store.session() as s:
            return list(s.exec(select(LLMAttempt).order_by(LLMAttempt.id)))  # type: ignore[arg-type]


@pytest.fixture
def rig(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Rig]:
    case = make_case(tmp_path / "c", replies=[])
    with ReplayServer([json.dumps(r) for r in HAPPY_REPLIES]) as server:
        yield Rig(case, server, **getattr(request, "param", {}))


# -- tokens ---------------------------------------------------------------------------------


def test_a_request_over_the_window_is_refused_before_sending(rig: Rig) -> None:
    rig.provider = rig.provider.model_copy(update={"context_window_tokens": 1200,
                                                   "max_tokens": 200})
    outcome = rig.step()
    assert (outcome.outcome, outcome.reason) == (BLOCKED, "PROVIDER_CONFIGURATION")
    assert outcome.details["error_code"] == "PROVIDER_REQUEST_TOO_LARGE"
    message = outcome.details["message"]
    assert "context window of 1200 tokens" in message and "not sent" in message
    # What can help, with the number; not the policy limit that cannot (a real model's
    # user lowered limits.max_context_bytes to no effect).
    needed = outcome.details["message"].split("window of at least ")[1].split(" ")[0]
    assert int(needed) > 1200 and "max_context_bytes" not in message, message
    assert rig.chat_bodies() == []  # the server never saw it
    # the context was shrunk as far as it goes before giving up
    with rig.case.store.session() as s:
        built = json.loads(s.exec(select(StageRun).where(
            StageRun.stage == "build_context")).one().output_json)
        pass
    context = json.loads(rig.artifact(built["context_path"]))
    assert "questions_omitted" in context


def test_the_context_shrinks_in_its_fixed_order_to_fit_the_window(rig: Rig) -> None:
    for _ in range(3):
        assert rig.step().outcome == PROGRESSED
    with rig.case.store.session() as s:
        built = [json.loads(r.output_json) for r in s.exec(
            select(StageRun).where(StageRun.stage == "build_context"))]
        pass
    doc = json.loads(rig.artifact(built[-1]["context_path"]))
    # Make the other evidence heavy, as a long case's is.
    for entry in doc["evidence"]:
        if entry["evidence_id"] != doc["previous_result"]["evidence_id"]:
            entry["items"] = [{"key": f"k{i}", "text": "x" * 200} for i in range(60)]
    full = estimate_tokens(build_messages(canonical_json(doc)), 3.0)
    smallest = estimate_tokens(build_messages(fit_for_model(
        copy.deepcopy(doc), 1 << 20, [PromptBudget("tiny", 1, 3.0)])), 3.0)
    assert smallest < full - 2000
    budget = PromptBudget("local", (full + smallest) // 2, 3.0)
    data = fit_for_model(copy.deepcopy(doc), 1 << 20, [budget])
    shrunk = json.loads(data)
    assert budget.fits(build_messages(data))
    assert any(e.get("items_omitted") for e in shrunk["evidence"])  # first level of fit
    assert shrunk["previous_result"] == doc["previous_result"]  # never cut
    assert "questions_omitted" not in shrunk  # later levels were not needed


def test_a_large_previous_result_is_cut_last_and_carried_once(rig: Rig) -> None:
    for _ in range(3):
        assert rig.step().outcome == PROGRESSED
    with rig.case.store.session() as s:
        built = [json.loads(r.output_json) for r in s.exec(
            select(StageRun).where(StageRun.stage == "build_context"))]
    doc = json.loads(rig.artifact(built[-1]["context_path"]))
    previous = doc["previous_result"]
    # Its findings travel once: the evidence entry is a compact reference.
    entry = next(e for e in doc["evidence"] if e["evidence_id"] == previous["evidence_id"])
    assert "items" not in entry and previous["items"]
    previous["items"] = [{"key": f"k{i}", "text": "y" * 300} for i in range(200)]
    previous["item_count"] = 200
    full = estimate_tokens(build_messages(canonical_json(doc)), 3.0)
    budget = PromptBudget("small", full // 3, 3.0)
    data = fit_for_model(copy.deepcopy(doc), 1 << 20, [budget])
    shrunk = json.loads(data)
    assert budget.fits(build_messages(data))
    shown = shrunk["previous_result"]["items_shown"]
    assert 1 <= shown < 200 and shrunk["previous_result"]["items"] == previous["items"][:shown]
    assert "questions_omitted" in shrunk  # every earlier level was used first


@pytest.mark.parametrize("rig", [{"tokenizer": "llama-cpp-python",
                                  "context_window_tokens": 100_000}], indirect=True)
def test_the_servers_tokenizer_counts_before_sending(rig: Rig) -> None:
    assert rig.step().outcome == PROGRESSED
    paths = [r.path for r in rig.server.requests]
    assert paths[:2] == ["/extras/tokenize/count", "/extras/tokenize/count"]  # per message
    assert paths[-1] == "/v1/chat/completions"
    # a window the server's count exceeds (4 bytes a token), though the estimate would not
    rig.provider = rig.provider.model_copy(update={"context_window_tokens": 1500,
                                                   "max_tokens": 100, "bytes_per_token": 8.0})
    outcome = rig.step()
    assert outcome.details["error_code"] == "PROVIDER_REQUEST_TOO_LARGE"
    assert "the server's llama-cpp-python tokenizer" in outcome.details["message"]


# -- money ----------------------------------------------------------------------------------

PRICED = {"input_price_per_mtok": 2.0, "output_price_per_mtok": 8.0, "max_tokens": 400}


def _request(call_index: int, cap: int | None) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": "decide " * 200}],
                       response_schema={"type": "object"}, schema_name="r",
                       call_index=call_index, case_id="c1", money_cap_micros=cap)


@pytest.mark.parametrize("rig", [PRICED], indirect=True)
def test_a_call_reserves_its_worst_case_lowers_max_tokens_and_settles(rig: Rig) -> None:
    provider = OpenAIProvider(rig.provider, env={})
    gateway = LLMGateway(rig.case.store, [provider], GatewayConfig(attempts=2, delay_s=0))
    # Without a cap: the provider's max_tokens, reserved, then settled at actual usage.
    first = gateway.call("c1", 1, 1, _request(0, None))
    assert isinstance(first, Succeeded)
    (attempt,) = rig.attempts()
    sent = rig.server.requests[-1].body
    assert json.loads(sent)["max_tokens"] == 400
    bpt = rig.provider.bytes_per_token
    prompt = math.ceil(len(sent) / bpt)  # the whole body at bytes_per_token
    assert attempt.reserved_micros == 2 * prompt + 8 * 400
    assert attempt.cost_micros == 2 * attempt.prompt_tokens + 8 * attempt.completion_tokens
    assert attempt.cost_micros < attempt.reserved_micros  # settled below the worst case
    spent = attempt.cost_micros
    # A cap leaving the prompt and exactly 100 output tokens: max_tokens is lowered.
    probe = provider.build_request_bytes(dataclasses.replace(_request(1, None),
                                                             max_tokens=400))
    cap = spent + 2 * math.ceil(len(probe) / bpt) + 8 * 100
    second = gateway.call("c1", 1, 2, _request(1, cap))
    assert isinstance(second, Succeeded)
    assert json.loads(rig.server.requests[-1].body)["max_tokens"] == 100
    assert spent + rig.attempts()[-1].reserved_micros == cap
    # Nothing is left for a third call: refused before sending, the case's cap named.
    requests = len(rig.server.requests)
    third = gateway.call("c1", 1, 3, _request(2, cap))
    assert isinstance(third, Blocked) and third.reason == "MODEL_COST_CAP"
    assert third.error_code == "MODEL_COST_CAP_REACHED"
    assert len(rig.server.requests) == requests


@pytest.mark.parametrize("rig", [PRICED], indirect=True)
def test_the_cap_blocks_the_case_until_raised_and_usage_is_reported(rig: Rig) -> None:
    assert rig.step().outcome == PROGRESSED
    spent = rig.attempts()[0].cost_micros or 0
    rig.config = InvestigationConfig(limits=LimitsConfig(max_model_cost=(spent + 50) / 1e6))
    sent = len(rig.chat_bodies())
    blocked = rig.step()
    assert (blocked.outcome, blocked.reason) == (BLOCKED, "MODEL_COST_CAP")
    assert "limits.max_model_cost" in blocked.details["message"]
    assert len(rig.chat_bodies()) == sent
    info = operations.status(rig.case.store, rig.case.case_id)
    assert info["blocked_reason"] == "MODEL_COST_CAP"
    assert info["model_usage"]["spent_micros"] == spent
    # Raise the cap, resume with a new retry id: the case goes on to the end.
    rig.config = InvestigationConfig(limits=LimitsConfig(max_model_cost=1.0))
    operations.resume(rig.case.store, rig.case.case_id, retry_id="more-money")
    while (outcome := rig.step()).outcome == PROGRESSED:
        pass
    assert outcome.outcome == COMPLETED
    summary = operations.summary_bytes(rig.case.store, rig.case.case_id).decode()
    usage = operations.status(rig.case.store, rig.case.case_id)["model_usage"]
    assert usage["spent_micros"] == sum(a.cost_micros or 0 for a in rig.attempts())
    for entry in usage["hypotheses"]:
        assert entry["cost_micros"] > 0
        line = (f"| {entry['hypothesis_id']} | {entry['calls']} | {entry['attempts']} | "
                f"{entry['prompt_tokens']} | {entry['completion_tokens']} | "
                f"{spend.format_money(entry['cost_micros'], 'USD')} |")
        assert line in summary
    # The case's total, in status's table and in the report (an engineer reading a long
    # case found it only in status --json).
    from rich.console import Console

    from investigation.report import render_report
    from workers.views import model_usage_table

    # The costs carry the currency their attempts recorded (decision 180): a reader whose
    # configuration says EUR (a fleet operator's shell) sees USD, as summary.md does.
    assert usage["currency"] == "USD"
    total = spend.format_money(usage["spent_micros"], "USD")
    table = model_usage_table({"model_usage": usage}, "EUR")
    assert table is not None
    screen = Console(width=200, record=True)
    screen.print(table)
    row = next(line for line in screen.export_text().splitlines() if "total" in line)
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells == ["total", str(sum(u["calls"] for u in usage["hypotheses"])),
                     str(sum(u["attempts"] for u in usage["hypotheses"])),
                     str(sum(u["prompt_tokens"] for u in usage["hypotheses"])),
                     str(sum(u["completion_tokens"] for u in usage["hypotheses"])),
                     total], cells
    page = render_report(rig.case.store, rig.case.case_id, currency="EUR")
    assert f"<b>model cost</b>{total}</div>" in page


@pytest.mark.parametrize("rig", [PRICED], indirect=True)
def test_a_case_keeps_the_currency_its_costs_were_recorded_in(rig: Rig) -> None:
    """Decision 180: the currency was a label of whatever configuration displayed the
    micros (summary.md said EUR, `status` in a shell without the policy file USD). Each
    priced attempt records it; a case whose costs are in one currency blocks before a
    call priced in another, until the label is set back."""
    rig.config = InvestigationConfig(limits=LimitsConfig(currency="EUR"))
    assert rig.step().outcome == PROGRESSED
    assert [a.currency for a in rig.attempts()] == ["EUR"]
    info = operations.status(rig.case.store, rig.case.case_id)
    assert info["model_usage"]["currency"] == "EUR"
    rig.config = InvestigationConfig()  # limits.currency USD
    sent = len(rig.chat_bodies())
    blocked = rig.step()
    assert (blocked.outcome, blocked.reason) == (BLOCKED, "PROVIDER_CONFIGURATION")
    assert blocked.details["error_code"] == "MODEL_COST_CURRENCY_CHANGED"
    assert "set limits.currency back to EUR" in blocked.details["message"]
    assert len(rig.chat_bodies()) == sent  # nothing was sent
    from investigation.guidance import for_case

    advice = for_case(rig.case.store, rig.case.case_id, "distributed")
    assert "limits.currency differs" in advice.headline, advice
    assert "set [limits] currency back" in advice.steps[0].text
    assert advice.steps[1].command is not None and "--retry-id" in advice.steps[1].command
    rig.config = InvestigationConfig(limits=LimitsConfig(currency="EUR"))
    operations.resume(rig.case.store, rig.case.case_id, retry_id="euros-again")
    while (outcome := rig.step()).outcome == PROGRESSED:
        pass
    assert outcome.outcome == COMPLETED
    assert {a.currency for a in rig.attempts()} == {"EUR"}
    # summary.md is written with the running policy; a reader with another label reads
    # the recorded one in status, the report and the summary alike.
    summary = operations.summary_bytes(rig.case.store, rig.case.case_id).decode()
    usage = operations.status(rig.case.store, rig.case.case_id)["model_usage"]
    first = next(u for u in usage["hypotheses"] if u["cost_micros"])
    assert spend.format_money(first["cost_micros"], "EUR") in summary
    assert " USD |" not in summary
    from investigation.report import render_report

    page = render_report(rig.case.store, rig.case.case_id, currency="USD")
    assert spend.format_money(usage["spent_micros"], "EUR") in page
    assert spend.format_money(usage["spent_micros"], "USD") not in page


def test_a_cap_refuses_a_provider_without_prices(rig: Rig) -> None:
    rig.config = InvestigationConfig(limits=LimitsConfig(max_model_cost=5.0))
    outcome = rig.step()
    assert (outcome.outcome, outcome.reason) == (BLOCKED, "PROVIDER_CONFIGURATION")
    assert outcome.details["error_code"] == "PROVIDER_PRICE_UNKNOWN"
    assert rig.chat_bodies() == []


def test_unpriced_usage_is_reported_in_tokens(rig: Rig) -> None:
    while (outcome := rig.step()).outcome == PROGRESSED:
        pass
    assert outcome.outcome == COMPLETED
    summary = operations.summary_bytes(rig.case.store, rig.case.case_id).decode()
    assert "## Model usage" in summary
    usage = operations.status(rig.case.store, rig.case.case_id)["model_usage"]
    assert [u["hypothesis_id"] for u in usage["hypotheses"]] == [1, 2]
    # Not priced is null, not an amount (a reader took -1 for one).
    assert all(u["cost_micros"] is None and u["prompt_tokens"] > 0 for u in usage["hypotheses"])
    assert "| 1 | 3 | 3 |" in summary and "| 2 | 2 | 2 |" in summary
    assert "not priced |" in summary
    from investigation.report import render_report

    assert "<b>model cost</b>not priced</div>" in render_report(rig.case.store,
                                                                rig.case.case_id)


def test_plan_call_lowers_max_tokens_to_what_the_cap_leaves() -> None:
    config = ProviderConfig(name="p", kind="openai", base_url="http://x/v1", model="m",
                            input_price_per_mtok=1.0, output_price_per_mtok=10.0,
                            max_tokens=1000, bytes_per_token=3.0)
    prompt = spend.prompt_estimate(config, b"x" * 336)
    assert prompt == 112
    assert spend.plan_call(config, prompt, None) == spend.CallBudget(112 + 10_000, 1000)
    assert spend.plan_call(config, prompt, 112 + 5000) == spend.CallBudget(5112, 500)
    assert spend.plan_call(config, prompt, 112 + 10 * 63) is None  # below 64 tokens


def test_tokens_no_server_reported_are_not_reported_not_zero(tmp_path: Path) -> None:
    """A scripted provider reports no token counts; status and summary.md showed 0, the
    report "not reported" (a reader's trial)."""
    from rich.console import Console

    from tests.casekit import make_case
    from workers.views import model_usage_table

    case = make_case(tmp_path / "scripted")
    assert case.investigator().run(case.case_id, max_steps=20).outcome == COMPLETED
    usage = operations.status(case.store, case.case_id)["model_usage"]["hypotheses"]
    assert usage and all(u["tokens_reported"] == 0 and u["attempts"] > 0 for u in usage)
    summary = operations.summary_bytes(case.store, case.case_id).decode()
    assert "| not reported | not reported |" in summary
    screen = Console(width=160, record=True)
    table = model_usage_table({"model_usage": {"hypotheses": usage}}, "USD")
    assert table is not None
    screen.print(table)
    assert "not reported" in screen.export_text()
    # Counts from some answered calls only: the sums say of how many. Failed attempts
    # (no reply to count) do not make a sum partial.
    for calls, attempts, shown in ((3, 3, "40 (1 of 3 calls)"), (1, 3, "40 ")):
        partial = [{**usage[0], "tokens_reported": 1, "calls": calls, "attempts": attempts,
                    "prompt_tokens_reported": 1, "completion_tokens_reported": 1,
                    "prompt_tokens": 40, "completion_tokens": 5}]
        table = model_usage_table({"model_usage": {"hypotheses": partial}}, "USD")
        assert table is not None
        screen = Console(width=160, record=True)
        screen.print(table)
        text = screen.export_text()
        assert shown in text and ("of 3" in text) is (calls == 3), text
    # The total row, summary.md and the report say so too (a 500-step reader's trial:
    # only the per-hypothesis rows of `status` did).
    from sqlalchemy import text as sql

    from investigation.loop.summary import render_summary
    from investigation.report.history import case_history
    from investigation.report.html import render as render_report

    two = [{**usage[0], "hypothesis_id": 1, "tokens_reported": 2, "calls": 2,
            "prompt_tokens_reported": 2, "completion_tokens_reported": 2,
            "prompt_tokens": 40, "completion_tokens": 5},
           {**usage[0], "hypothesis_id": 2, "tokens_reported": 0, "calls": 1}]
    table = model_usage_table({"model_usage": {"hypotheses": two}}, "USD")
    assert table is not None
    screen = Console(width=160, record=True)
    screen.print(table)
    total = next(line for line in screen.export_text().splitlines() if "total" in line)
    assert "40 (2 of 3 calls)" in total and "5 (2 of 3 calls)" in total, total
    # A server that reports one count and not the other: each column says of how many
    # calls it holds counts (a hostile trial read "(1 of 3 calls)" under a column no call
    # had reported).
    from investigation.llm.spend import token_cells

    halves = {**two[0], "calls": 3, "tokens_reported": 2, "prompt_tokens_reported": 1,
              "completion_tokens_reported": 2}
    assert token_cells([halves]) == ("40 (1 of 3 calls)", "5 (2 of 3 calls)")
    assert token_cells([{**halves, "prompt_tokens_reported": 0, "prompt_tokens": 0}]) == \
        ("not reported", "5 (2 of 3 calls)")
    with unguarded(case.store), case.store.session() as s:  # a closed attempt is guarded
        s.execute(sql("UPDATE llm_attempt SET prompt_tokens = 40, completion_tokens = 5 "
                      "WHERE id = (SELECT min(id) FROM llm_attempt WHERE status = "
                      "'succeeded')"))
        s.commit()
    with case.store.session() as s:
        hid, calls = s.execute(sql(
            "SELECT o.hypothesis_id, count(*) FROM llm_attempt a JOIN llm_operation o ON "
            "o.id = a.operation_id WHERE a.status = 'succeeded' GROUP BY o.hypothesis_id "
            "HAVING min(a.id) = (SELECT min(id) FROM llm_attempt WHERE status = "
            "'succeeded')")).one()
        summary = render_summary(s, case.case_id, 1).decode()
    row = f"| {hid} | {calls} |"
    shown_row = next(line for line in summary.splitlines() if line.startswith(row))
    assert f"| 40 (1 of {calls} calls) | 5 (1 of {calls} calls) |" in shown_row, shown_row
    total_calls = sum(u["calls"] for u in usage)
    page = render_report(case_history(case.store, case.case_id))
    assert f"40 (1 of {total_calls} calls) + 5 (1 of {total_calls} calls)" in page


def test_status_says_which_attempts_await_their_answer(rig: Rig) -> None:
    """A call in flight was counted in `attempts` like a retry (a real model's user read
    "attempts 2" during a two-minute call as a failure)."""
    import threading
    import time

    from rich.console import Console

    from investigation.llm.replay_server import Fault
    from workers.views import model_usage_table

    def usage() -> dict[int, dict[str, Any]]:
        return {u["hypothesis_id"]: dict(u) for u in operations.status(
            rig.case.store, rig.case.case_id)["model_usage"]["hypotheses"]}

    assert rig.step().outcome == PROGRESSED  # hypothesis 1
    assert usage()[1]["awaiting_answer"] == 0
    rig.server.add_faults(Fault.delay(6.0))
    stepped: list[Outcome] = []
    worker = threading.Thread(target=lambda: stepped.append(rig.step()))  # hypothesis 2
    worker.start()
    try:
        deadline = time.monotonic() + 5.0
        while 2 not in (during := usage()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 2 in during, during  # the attempt was recorded before its answer came
        assert during[2]["attempts"] == 1 and during[2]["awaiting_answer"] == 1, during
        assert during[1]["awaiting_answer"] == 0, during
        screen = Console(width=160, record=True)
        table = model_usage_table({"model_usage": {"hypotheses": list(during.values())}},
                                  "USD")
        assert table is not None
        screen.print(table)
        assert "1 (1 awaiting answer)" in screen.export_text()
    finally:
        worker.join(30)
    assert stepped and stepped[0].outcome == PROGRESSED
    after = usage()[2]
    assert (after["attempts"], after["awaiting_answer"], after["calls"]) == (1, 0, 1)
