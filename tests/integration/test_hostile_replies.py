"""Replies that once wedged a case are now rejected, and the case goes on.

Each of these raised an unhandled exception on every retry of a stage, so the case stayed
INVESTIGATING forever: a lone surrogate in a provider's content, an integer beyond
SQLite's range in ``db.query`` params, a NUL in text stored on PostgreSQL.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from investigation.cases.reader import PackageReader
from investigation.config import GatewayConfig, InvestigationConfig, ProviderConfig
from investigation.constants import COMPLETED, REJECTED
from investigation.llm.gateway import LLMGateway
from investigation.llm.openai import OpenAIProvider
from investigation.llm.replay_server import Fault, ReplayServer
from investigation.loop.env import StageEnv
from investigation.loop.investigator import Investigator
from investigation.store.models import BudgetAccount
from tests import casekit
from tests.casekit import make_case

FINISH_1 = casekit.finish("weak", None, [], reason="nothing more")
REJECT_2 = casekit.finish("weakened", None, [], reason="nothing", action="reject")


def _balances(case: casekit.Case) -> list[int]:
    from sqlmodel import select

    with case.store.session() as s:
        return [a.balance_units for a in s.exec(select(BudgetAccount))]


def test_lone_surrogate_from_an_http_provider_is_rejected(tmp_path: Path) -> None:
    case = make_case(tmp_path / "c", replies=[])
    # The completion JSON escapes a lone surrogate: valid JSON, but the content is not
    # Unicode text (json.loads gives a str holding U+D800 alone).
    raw = (rb'{"id": "x", "object": "chat.completion", "created": 0, "model": "m", '
           rb'"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": '
           rb'"assistant", "content": "{\"note\": \"\ud800\"}"}}]}')
    assert "\ud800" in json.loads(raw)["choices"][0]["message"]["content"]
    replies = [json.dumps(FINISH_1), json.dumps(REJECT_2)]
    with ReplayServer(replies, faults=[Fault(status=200, body=raw)]) as server:
        cfg = ProviderConfig(name="http", kind="openai", base_url=server.base_url, model="m")
        env = StageEnv(store=case.store, config=InvestigationConfig(),
                       gateway_factory=lambda: LLMGateway(
                           case.store, [OpenAIProvider(cfg, env={})], GatewayConfig()),
                       reader=PackageReader(InvestigationConfig().package))
        first = Investigator(env).step(case.case_id)
        assert (first.outcome, first.reason) == (REJECTED, "REPLY_NOT_JSON")
        assert Investigator(env).run(case.case_id, max_steps=10).outcome == COMPLETED


def test_integer_beyond_sqlite_range_is_rejected(tmp_path: Path) -> None:
    huge = casekit.q("db.query", {"sql": "SELECT ?", "params": [2**70]})
    case = make_case(tmp_path / "c", replies=[huge, FINISH_1, REJECT_2])
    first = case.investigator().step(case.case_id)
    assert (first.outcome, first.reason) == (REJECTED, "TOOL_INVALID_ARGUMENTS")
    assert _balances(case) == [60, 60]  # nothing was charged
    assert case.investigator().run(case.case_id, max_steps=10).outcome == COMPLETED


@pytest.mark.postgres
def test_nul_in_text_is_rejected_on_postgres(tmp_path: Path, postgres_url: str) -> None:
    nul = casekit.q("source.list", {}, new_questions=["why\x00"])
    case = make_case(tmp_path / "c", replies=[nul, FINISH_1, REJECT_2],
                     database_url=postgres_url)
    first = case.investigator().step(case.case_id)
    assert (first.outcome, first.reason) == (REJECTED, "REPLY_SCHEMA_INVALID")
    assert case.investigator().run(case.case_id, max_steps=10).outcome == COMPLETED
