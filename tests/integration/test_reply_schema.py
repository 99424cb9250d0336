"""The per-turn reply schema against the real validator, on real contexts of a real case.

Soundness: every reply the turn's schema admits (drawn at random by
``tests.schema_sampler``) passes ``validate_reply`` with the real ToolRouter. Strictness:
a reply breaking a rule the schema states is refused by the schema itself (checked with
the ``jsonschema`` package), so a constrained decoder cannot produce it.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from sqlmodel import select

from investigation.config import BudgetConfig, InvestigationConfig, LoopConfig
from investigation.loop.contract import read_reply
from investigation.loop.validation import validate_reply
from investigation.store import Store
from investigation.store.models import StageRun
from tests import casekit
from tests.casekit import Case, make_case
from tests.schema_sampler import sample

SAMPLES_PER_TURN = 25


def turns(case: Case, config: InvestigationConfig) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Run the case to its end; return every step's stored (context, reply schema)."""
    inv = case.investigator(config)
    for _ in range(12):
        if inv.step(case.case_id).outcome in ("COMPLETED", "BLOCKED"):
            break
    out = []
    with case.store.session() as s:
        arts = {a.path: a.data for a in Store.artifacts(s, case.case_id)}
        for row in s.exec(select(StageRun).where(StageRun.stage == "build_context")):
            built = json.loads(row.output_json)
            if built.get("finalize"):
                continue
            out.append((json.loads(arts[built["context_path"]]),
                        json.loads(arts[built["reply_schema_path"]])))
    assert out
    return out


def accepted(case: Case, config: InvestigationConfig, context: dict[str, Any],
             reply: dict[str, Any]) -> None:
    parsed, _ = read_reply(json.dumps(reply))
    router = case.env(config).router(case.case_id)
    validate_reply(parsed, context, config.budget, router,
                   config.loop.max_questions_per_hypothesis)


CONFIGS = {
    "default": InvestigationConfig(),
    "tests_and_cap": InvestigationConfig(
        loop=LoopConfig(max_iterations_per_hypothesis=1),
        budget=BudgetConfig(test_costs={"human": 5, "automated": 70})),
    "poor": InvestigationConfig(budget=BudgetConfig(credit_units=5)),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_reply_the_schema_admits_is_accepted(tmp_path: Path, name: str) -> None:
    config = CONFIGS[name]
    case = make_case(tmp_path / "c")
    rng = random.Random(name)
    seen_actions: set[str] = set()
    for context, schema in turns(case, config):
        jsonschema.Draft202012Validator.check_schema(schema)
        for _ in range(SAMPLES_PER_TURN):
            reply = sample(schema, rng)
            jsonschema.validate(reply, schema)
            accepted(case, config, context, reply)
            seen_actions.add(reply["next"]["action"])
    assert {"query", "finish", "reject"} <= seen_actions
    if name == "tests_and_cap":
        assert "test" in seen_actions


def test_the_schema_follows_the_context(tmp_path: Path) -> None:
    config = CONFIGS["tests_and_cap"]
    case = make_case(tmp_path / "c")
    steps = turns(case, config)
    first_context, first = steps[0]
    assert first_context["previous_result"] is None
    assert first["properties"]["assessment"] == {"type": "null"}
    assert list(first["properties"]) == ["assessment", "update", "next"]  # decoding order
    nexts = first["properties"]["next"]["anyOf"]
    ops = [v["properties"]["operation"]["enum"][0] for v in nexts if "operation" in
           v["properties"]]
    assert ops == ["source.list", "source.search", "source.read", "symbol.occurrences",
                   "db.tables", "db.schema", "db.query", "logs.search"]
    tests = [v for v in nexts if v["properties"]["action"]["enum"] == ["test"]]
    # only the affordable kind (automated costs 70 > 60 credit) is offered
    assert tests[0]["properties"]["test"]["properties"]["kind"]["enum"] == ["human"]
    schema_table = next(v for v in nexts if v["properties"].get("operation", {}).get(
        "enum") == ["db.schema"])["properties"]["arguments"]["properties"]["table"]
    assert schema_table == {"type": "string", "enum": ["orders"]}
    # a closing turn (iteration cap 1): only finish or reject, and the previous result
    closing = [(c, s) for c, s in steps if c["closing_reason"] == "iteration_cap"]
    assert closing
    for context, schema in closing:
        roots = schema.get("anyOf", [schema])
        for root in roots:
            actions = {v["properties"]["action"]["enum"][0]
                       for v in root["properties"]["next"].get("anyOf",
                                                              [root["properties"]["next"]])}
            assert actions <= {"finish", "reject"}
            evidence = root["properties"]["assessment"]["properties"]["evidence_ids"]
            assert evidence["items"]["enum"] == [context["previous_result"]["evidence_id"]]


def test_no_test_action_without_a_test_cost(tmp_path: Path) -> None:
    case = make_case(tmp_path / "c")
    for context, schema in turns(case, InvestigationConfig()):
        assert "test" not in context["allowed_actions"]
        assert context["external_tests"]["available"] is False
        assert '"test"' not in json.dumps(schema)


def _refused(schema: dict[str, Any], reply: dict[str, Any]) -> bool:
    return not jsonschema.Draft202012Validator(schema).is_valid(reply)


def test_the_schema_refuses_what_the_validator_refuses(tmp_path: Path) -> None:
    config = InvestigationConfig()
    case = make_case(tmp_path / "c")
    steps = turns(case, config)
    rng = random.Random(7)
    # A turn with a previous result, evidence with findings and an open question.
    context, schema = next((c, s) for c, s in steps if c["previous_result"] is not None
                           and any(q["status"] == "open" and q["hypothesis_id"]
                                   == c["hypothesis"]["id"] for q in c["questions"]))
    good = sample(schema, rng)
    while good["next"]["action"] != "query":
        good = sample(schema, rng)
    prev_id = context["previous_result"]["evidence_id"]

    def variant(edit: Any) -> dict[str, Any]:
        reply = copy.deepcopy(good)
        edit(reply)
        return reply

    breaks = {
        "ASSESSMENT_REQUIRED": lambda r: r.update(assessment=None),
        "ASSESSMENT_MISSING_PREVIOUS_RESULT":
            lambda r: r["assessment"].update(evidence_ids=["E99"]),
        "UNKNOWN_EVIDENCE_ID": lambda r: r["update"].update(evidence_ids=["E99"]),
        "UNKNOWN_QUESTION_ID": lambda r: r["update"].update(resolve_questions=["Q99"],
                                                            evidence_ids=[prev_id]),
        "RESOLUTION_WITHOUT_EVIDENCE": lambda r: r["update"].update(
            resolve_questions=[q["question_id"] for q in context["questions"]
                               if q["status"] == "open"][:1], evidence_ids=[]),
        "SUPPORT_WITHOUT_FINDINGS": lambda r: r["update"].update(confidence="supported",
                                                                 evidence_ids=[]),
        "INCONSISTENT_REJECT": lambda r: (r["update"].update(confidence="supported",
                                                             evidence_ids=[prev_id]),
                                          r.update(next={"action": "reject",
                                                         "reason": "no"})),
        "UNKNOWN_OPERATION": lambda r: r["next"].update(operation="source.write"),
        "ACTION_NOT_ALLOWED": lambda r: r.update(next={"action": "test", "test": {
            "kind": "human", "title": "t", "instructions": "i",
            "expected_observation": "o"}}),
        "TOO_MANY_QUESTIONS": lambda r: r["update"].update(
            new_questions=[f"question {i}?" for i in range(11)]),
        "SCORE_RANGE": lambda r: r["assessment"].update(score=101),
        "EXTRA_KEY": lambda r: r.update(extra=1),
        "ARGUMENT_TYPE": lambda r: r.update(next={"action": "query",
                                                  "operation": "source.read",
                                                  "arguments": {"path": "shop/pricing.py",
                                                                "start_line": "1",
                                                                "end_line": 2}}),
    }
    for code, edit in breaks.items():
        assert _refused(schema, variant(edit)), code


def test_cited_support_evidence_must_have_findings(tmp_path: Path) -> None:
    # An empty result cannot ground "supported": the schema offers support labels only
    # with evidence that has findings.
    replies = [casekit.q("source.search", {"pattern": "no such text anywhere"}),  # H1: E1
               casekit.finish("weak", None, [], action="reject"),  # H2
               casekit.finish("weak", (0, ["E1"]), [], action="reject")]  # H1 assesses E1
    case = make_case(tmp_path / "c", replies=replies)
    steps = turns(case, InvestigationConfig())
    context, schema = next((c, s) for c, s in steps if c["previous_result"] is not None)
    assert context["evidence"][0]["item_count"] == 0
    assert "supported" not in json.dumps(schema)
