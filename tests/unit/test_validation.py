"""``validate_reply``: every rejection code of its module docstring, its checking order,
and the simulated settlement + reservation (seed 000, "Model/controller contract")."""

from __future__ import annotations

import json
from typing import Any

import pytest

from investigation.budget import rules
from investigation.config import BudgetConfig
from investigation.errors import ToolError
from investigation.loop.contract import Reply, ReplyRejected, parse_reply
from investigation.loop.validation import AcceptedDecision, validate_reply

ALL_ACTIONS = ["query", "test", "finish", "reject"]
CLOSING_ONLY = ["finish", "reject"]
BUDGET = BudgetConfig()  # source.search 3, db.query 4, db.tables 1, refund cap 80 %
MAX_Q = 30


class StubRouter:
    """Argument preflight double: refuses escaping paths and writing SQL like the real one."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def validate(self, operation: str, arguments: dict[str, Any]) -> None:
        self.calls.append((operation, arguments))
        path = str(arguments.get("path", ""))
        if path.startswith(("/", "..")):
            raise ToolError("TOOL_PATH_ESCAPE", f"path {path!r} leaves the snapshot")
        sql = str(arguments.get("sql", "")).upper()
        if any(word in sql for word in ("DELETE", "ATTACH", "PRAGMA")):
            raise ToolError("TOOL_SQL_NOT_READ_ONLY", "not a read-only query")


# -- builders ----------------------------------------------------------------------------


def ev(eid: str, hid: int = 1, items: int = 2, new: int | None = None) -> dict[str, Any]:
    """A compact evidence entry as ``loop.context`` writes it."""
    return {"evidence_id": eid, "hypothesis_id": hid, "operation": "source.search",
            "arguments": {"pattern": "x"}, "item_count": items,
            "new_item_count": items if new is None else new, "duplicate": False,
            "warnings": [], "assessed": False}


def prev(eid: str, cost: int = 4, novelty: int = 1000, items: int = 2) -> dict[str, Any]:
    """A ``previous_result`` (the pending finding with its cost and novelty)."""
    return {**ev(eid, items=items), "items": [], "cost_units": cost,
            "novelty_permille": novelty}


def qn(qid: str, hid: int = 1, text: str = "Where is the divisor?",
       status: str = "open") -> dict[str, Any]:
    return {"question_id": qid, "hypothesis_id": hid, "text": text, "status": status}


def context(*, hid: int = 1, balance: int = 60, previous: dict[str, Any] | None = None,
            evidence: list[dict[str, Any]] | None = None,
            questions: list[dict[str, Any]] | None = None,
            allowed: list[str] | None = None, closing: str | None = None) -> dict[str, Any]:
    evidence = list(evidence or [])
    if previous is not None and previous["evidence_id"] not in {e["evidence_id"]
                                                                for e in evidence}:
        evidence.append({k: v for k, v in previous.items()
                         if k not in ("cost_units", "novelty_permille")})
    return {
        "hypothesis": {"id": hid, "statement": "s", "confidence": "unassessed",
                       "balance_units": balance, "credit_units": 60, "iterations": 0,
                       "max_iterations": 50, "turn": 1, "notes": []},
        "allowed_actions": allowed or list(ALL_ACTIONS),
        "closing_reason": closing,
        "previous_result": previous,
        "evidence": evidence,
        "questions": list(questions or []),
        "last_rejection": None,
    }


QUERY = {"action": "query", "operation": "source.search", "arguments": {"pattern": "/ 10"}}
DBQUERY = {"action": "query", "operation": "db.query",
           "arguments": {"sql": "SELECT * FROM orders"}}
FINISH = {"action": "finish", "reason": "enough"}
REJECT = {"action": "reject", "reason": "contradicted"}
HUMAN_TEST = {"action": "test", "test": {"kind": "human", "title": "Try it",
                                         "instructions": "Order 100 with 10 % off",
                                         "expected_observation": "total 90"}}


def reply(*, nxt: dict[str, Any] | None = None, confidence: str = "plausible",
          evidence: list[str] | None = None, resolve: list[str] | None = None,
          new: list[str] | None = None, assess: tuple[int, list[str]] | None = None) -> Reply:
    """A parsed reply (through ``parse_reply``, as the loop does)."""
    doc = {
        "assessment": None if assess is None else
        {"score": assess[0], "reason": "r", "evidence_ids": assess[1]},
        "update": {"confidence": confidence, "evidence_ids": evidence or [],
                   "resolve_questions": resolve or [], "new_questions": new or [],
                   "note": ""},
        "next": nxt or QUERY,
    }
    return parse_reply(json.dumps(doc))


def check(r: Reply, ctx: dict[str, Any], *, budget: BudgetConfig = BUDGET,
          router: StubRouter | None = None, max_questions: int = MAX_Q) -> AcceptedDecision:
    return validate_reply(r, ctx, budget, router or StubRouter(), max_questions)


def code(r: Reply, ctx: dict[str, Any], **kw: Any) -> str:
    with pytest.raises(ReplyRejected) as info:
        check(r, ctx, **kw)
    return info.value.code


def detail(r: Reply, ctx: dict[str, Any], **kw: Any) -> str:
    with pytest.raises(ReplyRejected) as info:
        check(r, ctx, **kw)
    return info.value.detail


# -- accepted baseline -------------------------------------------------------------------


def test_first_turn_query_is_accepted_with_its_projection() -> None:
    router = StubRouter()
    decision = check(reply(), context(), router=router)
    assert decision.cost_units == 3
    assert router.calls == [("source.search", {"pattern": "/ 10"})]
    p = decision.projection
    assert (p.refund_units, p.reserve_units, p.balance_after_settlement, p.balance_after,
            p.status_after) == (0, 3, 60, 57, rules.ACTIVE)
    out = decision.to_dict()
    assert out["cost_units"] == 3
    assert out["reply"]["next"]["operation"] == "source.search"
    assert out["projection"] == {"refund_units": 0, "reserve_units": 3,
                                 "balance_after_settlement": 60, "balance_after": 57,
                                 "status_after": rules.ACTIVE}


# -- question ids ------------------------------------------------------------------------


def test_unknown_question_id() -> None:
    assert code(reply(resolve=["Q9"], evidence=["E1"]),
                context(evidence=[ev("E1")], questions=[qn("Q1")])) == "UNKNOWN_QUESTION_ID"


def test_unknown_question_id_comes_before_everything_else() -> None:
    # Unknown question + unknown evidence + unexpected assessment + disallowed and
    # unaffordable action: the question id decides, and no tool preflight happens.
    router = StubRouter()
    r = reply(resolve=["Q9"], evidence=["E404"], assess=(50, ["E404"]), nxt=DBQUERY,
              confidence="strongly_supported")
    ctx = context(balance=0, allowed=CLOSING_ONLY, questions=[qn("Q1")])
    assert code(r, ctx, router=router) == "UNKNOWN_QUESTION_ID"
    assert router.calls == []


def test_question_of_another_hypothesis() -> None:
    ctx = context(evidence=[ev("E1")], questions=[qn("Q1", hid=2)])
    assert code(reply(resolve=["Q1"], evidence=["E1"]), ctx) == "QUESTION_OTHER_HYPOTHESIS"


def test_question_of_another_hypothesis_precedes_evidence_checks() -> None:
    ctx = context(questions=[qn("Q1", hid=2)])
    assert code(reply(resolve=["Q1"], evidence=["E404"]), ctx) == "QUESTION_OTHER_HYPOTHESIS"


# -- assessment binding ------------------------------------------------------------------


def test_assessment_required_when_a_result_is_pending() -> None:
    assert code(reply(), context(previous=prev("E2"))) == "ASSESSMENT_REQUIRED"


def test_assessment_unexpected_on_a_first_turn() -> None:
    ctx = context(evidence=[ev("E1")])
    assert code(reply(assess=(50, ["E1"])), ctx) == "ASSESSMENT_UNEXPECTED"


def test_assessment_must_cite_the_previous_result() -> None:
    ctx = context(evidence=[ev("E1")], previous=prev("E2"))
    assert code(reply(assess=(50, ["E1"])), ctx) == "ASSESSMENT_MISSING_PREVIOUS_RESULT"
    assert check(reply(assess=(50, ["E1", "E2"])), ctx).projection.refund_units > 0


def test_assessment_required_precedes_unknown_evidence() -> None:
    assert code(reply(evidence=["E404"]), context(previous=prev("E2"))) == \
        "ASSESSMENT_REQUIRED"


# -- evidence references -----------------------------------------------------------------


def test_unknown_evidence_id_in_update() -> None:
    assert code(reply(evidence=["E1", "E7"]), context(evidence=[ev("E1")])) == \
        "UNKNOWN_EVIDENCE_ID"


def test_unknown_evidence_id_in_assessment() -> None:
    ctx = context(evidence=[ev("E1")], previous=prev("E2"))
    assert code(reply(assess=(50, ["E2", "E7"]), evidence=["E1"]), ctx) == \
        "UNKNOWN_EVIDENCE_ID"


def test_evidence_of_another_hypothesis_may_be_cited() -> None:
    decision = check(reply(evidence=["E5"]), context(evidence=[ev("E5", hid=2)]))
    assert decision.reply.update.evidence_ids == ["E5"]


# -- confidence grounding ----------------------------------------------------------------


@pytest.mark.parametrize("label", ["supported", "strongly_supported"])
def test_support_needs_cited_evidence_with_findings(label: str) -> None:
    ctx = context(evidence=[ev("E1", items=0), ev("E2", items=3)])
    assert code(reply(confidence=label, evidence=["E1"]), ctx) == "SUPPORT_WITHOUT_FINDINGS"
    assert code(reply(confidence=label), ctx) == "SUPPORT_WITHOUT_FINDINGS"
    # One cited record with findings is enough.
    assert check(reply(confidence=label, evidence=["E1", "E2"]), ctx).cost_units == 3


def test_support_findings_must_be_cited_in_the_update_not_only_assessed() -> None:
    ctx = context(evidence=[ev("E1", items=0)], previous=prev("E2", items=3))
    r = reply(confidence="supported", evidence=["E1"], assess=(90, ["E2"]))
    assert code(r, ctx) == "SUPPORT_WITHOUT_FINDINGS"


@pytest.mark.parametrize("label", ["unassessed", "weak", "plausible", "weakened"])
def test_lower_labels_need_no_findings(label: str) -> None:
    assert check(reply(confidence=label), context()).cost_units == 3


@pytest.mark.parametrize("label", ["supported", "strongly_supported"])
def test_supported_hypothesis_cannot_be_rejected(label: str) -> None:
    ctx = context(evidence=[ev("E1", items=2)])
    assert code(reply(confidence=label, evidence=["E1"], nxt=REJECT), ctx) == \
        "INCONSISTENT_REJECT"
    finished = check(reply(confidence=label, evidence=["E1"], nxt=FINISH), ctx)
    assert finished.projection.status_after == rules.FINISHED


def test_weakened_hypothesis_can_be_rejected_for_free() -> None:
    decision = check(reply(confidence="weakened", nxt=REJECT), context(balance=0))
    assert decision.cost_units == 0
    p = decision.projection
    assert (p.reserve_units, p.balance_after, p.status_after) == (0, 0, rules.REJECTED)


# -- questions ---------------------------------------------------------------------------


def test_resolving_an_open_question_needs_evidence() -> None:
    ctx = context(evidence=[ev("E1")], questions=[qn("Q1")])
    assert code(reply(resolve=["Q1"]), ctx) == "RESOLUTION_WITHOUT_EVIDENCE"
    assert check(reply(resolve=["Q1"], evidence=["E1"]), ctx).reply.update.resolve_questions \
        == ["Q1"]


def test_reconfirming_a_resolved_question_needs_no_evidence() -> None:
    ctx = context(questions=[qn("Q1", status="resolved")])
    assert check(reply(resolve=["Q1"]), ctx).cost_units == 3


def test_mixing_a_reconfirmation_with_a_new_resolution_still_needs_evidence() -> None:
    ctx = context(evidence=[ev("E1")],
                  questions=[qn("Q1", status="resolved"), qn("Q2", text="Other?")])
    assert code(reply(resolve=["Q1", "Q2"]), ctx) == "RESOLUTION_WITHOUT_EVIDENCE"
    assert check(reply(resolve=["Q1", "Q2"], evidence=["E1"]), ctx).cost_units == 3


@pytest.mark.parametrize("text", ["Where is the divisor?", "  where IS the\tdivisor?  ",
                                  "WHERE   IS THE DIVISOR?"])
def test_new_question_duplicating_an_open_one(text: str) -> None:
    ctx = context(questions=[qn("Q1")])
    assert code(reply(new=[text]), ctx) == "DUPLICATE_QUESTION"
    assert detail(reply(new=["Other?", text]), ctx) == "new question 2 repeats open question Q1"


def test_duplicate_questions_within_one_reply() -> None:
    # The detail names the actual fault: the duplicate is inside new_questions, not an
    # open question (there is none here).
    assert code(reply(new=["Is tax applied?", "is  TAX applied?"]), context()) == \
        "DUPLICATE_QUESTION"
    assert detail(reply(new=["Is tax applied?", "is  TAX applied?"]), context()) == \
        "new question 2 repeats new question 1 of this reply"
    assert check(reply(new=["Is tax applied?", "Is tax rounded?"]), context()).cost_units == 3


def test_a_resolved_question_may_be_asked_again() -> None:
    ctx = context(questions=[qn("Q1", status="resolved")])
    assert check(reply(new=["Where is the divisor?"]), ctx).reply.update.new_questions == \
        ["Where is the divisor?"]


def test_too_many_questions_counts_own_records_of_any_status() -> None:
    ctx = context(questions=[qn("Q1", status="resolved", text="a?"), qn("Q2", text="b?"),
                             qn("Q3", hid=2, text="c?"), qn("Q4", hid=2, text="d?")])
    # Own records: Q1, Q2 (the other hypothesis's two do not count); the bound is 3.
    assert code(reply(new=["Is e set?", "Is f set?"]), ctx, max_questions=3) == \
        "TOO_MANY_QUESTIONS"
    assert detail(reply(new=["Is e set?", "Is f set?"]), ctx, max_questions=3) == \
        "this hypothesis has 2 questions; 2 new would pass the limit of 3"
    assert check(reply(new=["Is e set?"]), ctx, max_questions=3).cost_units == 3


def test_duplicate_question_precedes_too_many_questions() -> None:
    assert code(reply(new=["Is a set?"]), context(questions=[qn("Q1", text="IS A SET?")]),
                max_questions=1) == "DUPLICATE_QUESTION"


@pytest.mark.parametrize("text", ["\\]} } {", "?", "a b", "42", "{}", "...", "x1"])
def test_a_new_question_holds_a_word(text: str) -> None:
    """A small model's stray JSON (`\\]} } {`) became an open question the case carried
    to its end (a real model's user)."""
    assert code(reply(new=["Where is the divisor?", text]), context()) == \
        "QUESTION_WITHOUT_WORDS"
    assert detail(reply(new=[text]), context()).startswith("new question 1 holds no word")


@pytest.mark.parametrize("text", ["Q1", " q12 "])
def test_a_question_id_is_no_new_question(text: str) -> None:
    """A real model wrote "Q1" where a new question's words belong, three times over; the
    refusal said only that it held no word (a real model's user)."""
    said = detail(reply(new=[text]), context(questions=[qn("Q1")]))
    assert code(reply(new=[text]), context()) == "QUESTION_WITHOUT_WORDS"
    assert said.startswith(f"new question 1 is {text.strip()!r}, a question's id: "), said
    assert "resolve_questions" in said


@pytest.mark.parametrize("text", ["schema_version?", "Где делитель?", "為什麼", "Is x1 > 0?"])
def test_a_question_in_words_of_any_script_is_taken(text: str) -> None:
    assert check(reply(new=[text]), context()).reply.update.new_questions == [text]


# -- next action -------------------------------------------------------------------------


@pytest.mark.parametrize("nxt", [QUERY, HUMAN_TEST], ids=["query", "test"])
def test_closing_turn_allows_only_finish_or_reject(nxt: dict[str, Any]) -> None:
    budget = BudgetConfig(test_costs={"human": 5})
    ctx = context(allowed=CLOSING_ONLY, closing="iteration_cap")
    assert code(reply(nxt=nxt), ctx, budget=budget) == "ACTION_NOT_ALLOWED"
    assert check(reply(nxt=FINISH), ctx).projection.status_after == rules.FINISHED


def test_action_not_allowed_precedes_argument_preflight() -> None:
    router = StubRouter()
    bad = {"action": "query", "operation": "source.read",
           "arguments": {"path": "../x", "start_line": 1, "end_line": 2}}
    assert code(reply(nxt=bad), context(allowed=CLOSING_ONLY), router=router) == \
        "ACTION_NOT_ALLOWED"
    assert router.calls == []


@pytest.mark.parametrize("operation", ["shell.exec", "hypothesis.create", "db.write",
                                       "SOURCE.READ"])
def test_unknown_operation_is_refused_before_the_router(operation: str) -> None:
    router = StubRouter()
    nxt = {"action": "query", "operation": operation, "arguments": {}}
    assert code(reply(nxt=nxt), context(), router=router) == "UNKNOWN_OPERATION"
    assert router.calls == []


@pytest.mark.parametrize(("nxt", "expected"), [
    ({"action": "query", "operation": "source.read",
      "arguments": {"path": "../../etc/passwd", "start_line": 1, "end_line": 2}},
     "TOOL_PATH_ESCAPE"),
    ({"action": "query", "operation": "db.query",
      "arguments": {"sql": "DELETE FROM orders"}}, "TOOL_SQL_NOT_READ_ONLY"),
], ids=["path", "sql"])
def test_tool_codes_pass_through_from_the_router(nxt: dict[str, Any], expected: str) -> None:
    with pytest.raises(ReplyRejected) as info:
        check(reply(nxt=nxt), context())
    assert info.value.code == expected
    assert info.value.detail  # the router's message travels with the code


def test_tool_rejection_precedes_affordability() -> None:
    nxt = {"action": "query", "operation": "db.query", "arguments": {"sql": "ATTACH 'x' AS y"}}
    assert code(reply(nxt=nxt), context(balance=0)) == "TOOL_SQL_NOT_READ_ONLY"


def test_test_without_configured_cost() -> None:
    assert code(reply(nxt=HUMAN_TEST), context()) == "TEST_COST_NOT_CONFIGURED"
    human_only = BudgetConfig(test_costs={"human": 5})
    # With a cost the test is still refused: the hand-off is not built, and charging for a
    # test nobody runs would lose credit.
    assert code(reply(nxt=HUMAN_TEST), context(), budget=human_only) == \
        "TEST_HANDOFF_UNAVAILABLE"
    automated = {"action": "test", "test": {**HUMAN_TEST["test"], "kind": "automated"}}
    assert code(reply(nxt=automated), context(), budget=human_only) == \
        "TEST_COST_NOT_CONFIGURED"
    # The context leaves `test` out of allowed_actions then; the code still says why.
    no_tests = context(allowed=["query", "finish", "reject"])
    assert code(reply(nxt=HUMAN_TEST), no_tests) == "TEST_COST_NOT_CONFIGURED"
    assert code(reply(nxt=HUMAN_TEST), no_tests, budget=human_only) == \
        "TEST_HANDOFF_UNAVAILABLE"
    assert detail(reply(nxt=QUERY), context(allowed=CLOSING_ONLY, closing="iteration_cap")) \
        == "query is not allowed now (a closing turn: iteration_cap); allowed: finish, reject"


# -- affordability -----------------------------------------------------------------------


def test_query_beyond_the_balance_is_unaffordable() -> None:
    assert code(reply(nxt=DBQUERY), context(balance=3)) == "BUDGET_UNAFFORDABLE"
    exact = check(reply(nxt=DBQUERY), context(balance=4))
    assert exact.projection.balance_after == 0


def test_a_test_is_refused_before_any_budget_projection() -> None:
    budget = BudgetConfig(test_costs={"human": 50})
    assert code(reply(nxt=HUMAN_TEST), context(balance=49), budget=budget) == \
        "TEST_HANDOFF_UNAVAILABLE"


def test_refund_from_settlement_makes_a_query_affordable() -> None:
    # Balance 3 < db.query cost 4; the pending E2 (cost 4, full novelty) assessed at 100
    # refunds 4 * 80 % * 1000 / 1000 * 100 / 100 = 3.2 -> 3, so 6 remain: affordable.
    ctx = context(balance=3, previous=prev("E2", cost=4, novelty=1000))
    decision = check(reply(nxt=DBQUERY, assess=(100, ["E2"])), ctx)
    expected_refund = rules.refund_units(4, 100, 1000, BUDGET.max_refund_percent)
    assert expected_refund == 3
    assert decision.projection == rules.project(BUDGET, 3, (4, 1000), 100, "query", 4)
    assert (decision.projection.refund_units, decision.projection.balance_after_settlement,
            decision.projection.balance_after) == (3, 6, 2)


@pytest.mark.parametrize(("score", "novelty"), [(0, 1000), (100, 0), (20, 500)])
def test_without_enough_refund_the_same_query_is_unaffordable(score: int, novelty: int) -> None:
    # Refunds here are 0, 0 and 4*80*500*20 // 10**7 = 0: balance stays 3 < 4.
    ctx = context(balance=3, previous=prev("E2", cost=4, novelty=novelty))
    assert code(reply(nxt=DBQUERY, assess=(score, ["E2"])), ctx) == "BUDGET_UNAFFORDABLE"


def test_projection_uses_the_frozen_refund_cap() -> None:
    ctx = context(balance=3, previous=prev("E2", cost=4, novelty=1000))
    r = reply(nxt=DBQUERY, assess=(100, ["E2"]))
    assert code(r, ctx, budget=BudgetConfig(max_refund_percent=20)) == "BUDGET_UNAFFORDABLE"


def test_finish_and_reject_are_free_even_at_zero_balance() -> None:
    ctx = context(balance=0, previous=prev("E2", cost=4, novelty=0))
    decision = check(reply(nxt=FINISH, assess=(10, ["E2"])), ctx)
    assert decision.cost_units == 0
    assert decision.projection.balance_after == 0
    assert decision.projection.status_after == rules.FINISHED


def test_valid_assessment_with_invalid_next_action_is_rejected_as_a_whole() -> None:
    ctx = context(balance=60, previous=prev("E2"))
    good = reply(nxt=DBQUERY, assess=(90, ["E2"]))
    assert check(good, ctx).projection.refund_units == 2  # 4*80*1000*90 // 10**7
    bad_nxt = {"action": "query", "operation": "db.query",
               "arguments": {"sql": "PRAGMA writable_schema=1"}}
    with pytest.raises(ReplyRejected) as info:
        check(reply(nxt=bad_nxt, assess=(90, ["E2"])), ctx)
    assert info.value.code == "TOOL_SQL_NOT_READ_ONLY"


def test_validation_does_not_mutate_the_context() -> None:
    ctx = context(evidence=[ev("E1")], questions=[qn("Q1")], previous=prev("E2"))
    before = json.dumps(ctx, sort_keys=True)
    check(reply(resolve=["Q1"], evidence=["E1"], new=["New?"], assess=(90, ["E2"])), ctx)
    with pytest.raises(ReplyRejected):
        check(reply(resolve=["Q1"], new=["New?"], assess=(90, ["E2"])), ctx)
    assert json.dumps(ctx, sort_keys=True) == before
