"""Valid replies cannot grow the context past its bound: it shrinks deterministically."""

from __future__ import annotations

import json
from pathlib import Path

from investigation.config import InvestigationConfig
from investigation.constants import ARTIFACT_CONTEXT, COMPLETED, REJECTED
from investigation.loop.investigator import Investigator
from investigation.store import Store
from tests import casekit
from tests.casekit import make_case


def _bulky_query(n: int) -> dict[str, object]:
    comment = "/* " + ("x" * 3000) + f" {n} */"
    # Each result has new rows (the literal differs), so no account runs out of novelty.
    return casekit.q("db.query", {"sql": f"SELECT {n} AS n, id {comment} FROM orders"},
                     note="n" * 3000)


def test_many_bulky_queries_never_wedge_the_case(tmp_path: Path) -> None:
    replies = [_bulky_query(0), casekit.q("db.tables", {}, confidence="weak")]
    # H1 assesses E1, then each of its own results E3..E9 (E2 is H2's db.tables).
    previous = ["E1", *[f"E{n}" for n in range(3, 10)]]
    replies += [_bulky_query(i + 1) | {"assessment": {"score": 10, "reason": "more",
                                                      "evidence_ids": [prev]}}
                for i, prev in enumerate(previous)]
    replies += [casekit.finish("weak", (10, ["E10"]), ["E10"]),
                casekit.finish("weak", (10, ["E2"]), ["E2"], action="reject")]
    case = make_case(tmp_path / "c", replies=replies)
    config = InvestigationConfig.model_validate({"limits": {"max_context_bytes": 20_000}})
    outcome = Investigator(case.env(config)).run(case.case_id, max_steps=30)
    assert outcome.outcome == COMPLETED, outcome
    with case.store.session() as s:
        sizes = []
        for seq in range(1, 12):
            art = Store.get_artifact(s, case.case_id, ARTIFACT_CONTEXT.format(seq=seq))
            assert art is not None
            sizes.append(len(art.data))
            doc = json.loads(art.data)
        assert max(sizes) <= 20_000
        assert any(e.get("items_omitted") for e in doc["evidence"])


def test_oversized_arguments_are_rejected(tmp_path: Path) -> None:
    huge = casekit.q("db.query", {"sql": "SELECT ?", "params": ["A" * 20_000]})
    case = make_case(tmp_path / "c", replies=[huge, *casekit.HAPPY_REPLIES])
    first = case.investigator().step(case.case_id)
    assert (first.outcome, first.reason) == (REJECTED, "REPLY_SCHEMA_INVALID")
    assert "bytes" in first.details["message"]


def test_many_hypotheses_with_many_questions_never_wedge_the_case(tmp_path: Path) -> None:
    """Each hypothesis adds 10 long questions; the other hypotheses' questions are the
    first thing a full context sheds after evidence, so every hypothesis still runs."""
    from investigation.cases.reader import PackageReader
    from investigation.cases.registry import register_case
    from investigation.config import ProvidersConfig
    from investigation.llm.gateway import LLMGateway, build_providers
    from investigation.loop.env import StageEnv

    n = 12
    hypotheses = [{"id": i, "statement": f"hypothesis {i} " + "s" * 3000}
                  for i in range(1, n + 1)]
    question = "why " + "\U0001f600" * 499  # 2,000 bytes each, in words
    replies = [casekit.finish("weak", None, [], reason="enough") | {
        "update": {"confidence": "weak", "evidence_ids": [], "resolve_questions": [],
                   "new_questions": [f"{i} {question}"[:498] + f"{j:02d}" for j in range(10)],
                   "note": "n" * 3000}} for i in range(n)]
    case = make_case(tmp_path / "c", replies=replies)
    case_id = register_case(case.store, case.package.read_bytes(), casekit.INTERPRETATION,
                            hypotheses, PackageReader(InvestigationConfig().package))
    providers = ProvidersConfig.load(case.providers_path)
    config = InvestigationConfig.model_validate({"limits": {"max_context_bytes": 100_000}})
    env = StageEnv(store=case.store, config=config,
                   gateway_factory=lambda: LLMGateway(case.store, build_providers(providers),
                                                      providers.gateway),
                   reader=PackageReader(config.package))
    outcome = Investigator(env).run(case_id, max_steps=n + 2)
    assert outcome.outcome == COMPLETED, outcome
