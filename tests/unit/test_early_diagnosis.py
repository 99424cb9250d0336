"""Early diagnosis review (``investigation.loop.early_diagnosis``; docs/early-diagnosis.md):
each structural rule rejects the reply, each review criterion declines the request."""

from __future__ import annotations

from typing import Any

import pytest

from investigation.loop import early_diagnosis as ed
from investigation.loop.contract import parse_reply
from tests.unit.test_validation import check, code, context, ev, qn, reply


def other(hid: int, *, status: str = "active", confidence: str = "weak", turns: int = 1,
          deferred_by: int | None = None) -> dict[str, Any]:
    return {"id": hid, "statement": "s", "status": status, "confidence": confidence,
            "turns": turns, "deferred_by": deferred_by}


def ctx(*, others: list[dict[str, Any]] | None = None, enabled: bool = True,
        min_evidence: int = 2, evidence: list[dict[str, Any]] | None = None,
        questions: list[dict[str, Any]] | None = None,
        deferred_by: int | None = None) -> dict[str, Any]:
    doc = context(evidence=evidence if evidence is not None else [ev("E1"), ev("E2")],
                  questions=questions)
    doc["hypothesis"]["deferred_by"] = deferred_by
    doc["other_hypotheses"] = others if others is not None else [other(2), other(3)]
    doc["early_diagnosis"] = {"enabled": enabled, "min_evidence": min_evidence}
    return doc


def early(defer: list[int], *, confidence: str = "strongly_supported",
          evidence: list[str] | None = None, resolve: list[str] | None = None,
          new: list[str] | None = None) -> Any:
    nxt = {"action": "finish", "reason": "grounded",
           "early_diagnosis": {"defer_alternatives": defer, "rationale": "E1 and E2 agree"}}
    return reply(nxt=nxt, confidence=confidence,
                 evidence=["E1", "E2"] if evidence is None else evidence,
                 resolve=resolve, new=new)


def findings(decision: Any) -> list[str]:
    review = decision.early_diagnosis
    assert review is not None
    return [f["code"] for f in review.findings]


# -- the contract ------------------------------------------------------------------------


def test_a_finish_without_a_request_has_no_review() -> None:
    decision = check(reply(nxt={"action": "finish", "reason": "r"},
                           confidence="supported", evidence=["E1"]), ctx())
    assert decision.early_diagnosis is None
    assert decision.to_dict()["early_diagnosis"] is None


@pytest.mark.parametrize("bad", [[], [0], [-1], ["2"], [2.0], [True]])
def test_defer_alternatives_is_a_non_empty_list_of_positive_ids(bad: list[Any]) -> None:
    import json

    doc = {"assessment": None,
           "update": {"confidence": "strongly_supported", "evidence_ids": [],
                      "resolve_questions": [], "new_questions": [], "note": ""},
           "next": {"action": "finish", "reason": "r",
                    "early_diagnosis": {"defer_alternatives": bad, "rationale": "x"}}}
    with pytest.raises(Exception) as info:
        parse_reply(json.dumps(doc))
    assert getattr(info.value, "code", "") == "REPLY_SCHEMA_INVALID"


def test_only_finish_may_carry_a_request() -> None:
    import json

    doc = {"assessment": None,
           "update": {"confidence": "weakened", "evidence_ids": [],
                      "resolve_questions": [], "new_questions": [], "note": ""},
           "next": {"action": "reject", "reason": "r",
                    "early_diagnosis": {"defer_alternatives": [2], "rationale": "x"}}}
    with pytest.raises(Exception) as info:
        parse_reply(json.dumps(doc))
    assert getattr(info.value, "code", "") == "REPLY_SCHEMA_INVALID"


# -- structural rules reject the whole reply ----------------------------------------------


@pytest.mark.parametrize(("defer", "others", "deferred_by"), [
    ([1], None, None),                                   # itself
    ([2, 2], None, None),                                # named twice
    ([9], None, None),                                   # not a hypothesis of the case
    ([2], [other(2, status="rejected"), other(3)], None),  # already terminal
    ([2], [other(2, deferred_by=3), other(3)], None),      # already deferred
    ([3], None, 2),                                      # the finisher is assessment-only
])
def test_structural_breaches_reject_the_reply(defer: list[int],
                                              others: list[dict[str, Any]] | None,
                                              deferred_by: int | None) -> None:
    assert code(early(defer), ctx(others=others, deferred_by=deferred_by)) == \
        "EARLY_DIAGNOSIS_INVALID"


def test_the_structural_check_follows_the_allowed_action_check() -> None:
    doc = ctx()
    doc["allowed_actions"] = ["reject"]
    assert code(early([1]), doc) == "ACTION_NOT_ALLOWED"


# -- the review ----------------------------------------------------------------------------


def test_a_grounded_request_is_accepted() -> None:
    decision = check(early([3, 2]), ctx())
    review = decision.early_diagnosis
    assert review is not None and review.accepted
    assert review.requested == (2, 3) and review.deferred == (2, 3)
    assert review.qualifying_evidence == ("E1", "E2")
    assert decision.to_dict()["early_diagnosis"] == {
        "requested": [2, 3], "accepted": True, "deferred": [2, 3],
        "qualifying_evidence": ["E1", "E2"], "findings": [],
        "rationale": "E1 and E2 agree"}


def test_disabled_policy_declines() -> None:
    decision = check(early([2]), ctx(enabled=False))
    assert findings(decision) == [ed.ED_DISABLED]
    assert decision.early_diagnosis is not None and decision.early_diagnosis.deferred == ()


def test_confidence_below_strong_support_declines() -> None:
    assert findings(check(early([2], confidence="supported"), ctx())) == [ed.ED_CONFIDENCE]


@pytest.mark.parametrize(("evidence", "cited"), [
    ([ev("E1"), ev("E2")], ["E1"]),                    # too few cited
    ([ev("E1"), ev("E2", new=0)], ["E1", "E2"]),       # one has no new findings
    ([ev("E1"), ev("E2", hid=2)], ["E1", "E2"]),       # one belongs to an alternative
    ([ev("E1"), {**ev("E2"), "duplicate": True}], ["E1", "E2"]),  # one is a duplicate
    ([ev("E1"), ev("E2")], ["E1", "E1"]),              # the same record twice
])
def test_too_little_qualifying_evidence_declines(evidence: list[dict[str, Any]],
                                                 cited: list[str]) -> None:
    decision = check(early([2], evidence=cited), ctx(evidence=evidence))
    assert findings(decision) == [ed.ED_EVIDENCE]


def test_the_evidence_bound_is_the_frozen_policy() -> None:
    assert findings(check(early([2]), ctx(min_evidence=3))) == [ed.ED_EVIDENCE]
    assert findings(check(early([2], evidence=["E1"]), ctx(min_evidence=1))) == []


def test_an_open_question_left_open_declines() -> None:
    doc = ctx(questions=[qn("Q1"), qn("Q2", hid=2)])
    assert findings(check(early([2]), doc)) == [ed.ED_OPEN_QUESTIONS]
    # Resolving it in the same update (with evidence) satisfies the criterion; an
    # alternative's open question does not count.
    assert findings(check(early([2], resolve=["Q1"]), doc)) == []


def test_a_new_question_declines() -> None:
    assert findings(check(early([2], new=["Is the divisor configurable?"]), ctx())) == \
        [ed.ED_OPEN_QUESTIONS]


def test_an_unexamined_alternative_declines() -> None:
    decision = check(early([2, 3]), ctx(others=[other(2), other(3, turns=0)]))
    review = decision.early_diagnosis
    assert review is not None
    assert [(f["code"], f.get("hypothesis_id")) for f in review.findings] == \
        [(ed.ED_ALTERNATIVE_UNEXAMINED, 3)]


@pytest.mark.parametrize("label", ["supported", "strongly_supported"])
def test_a_supported_alternative_declines(label: str) -> None:
    decision = check(early([2]), ctx(others=[other(2, confidence=label), other(3)]))
    assert findings(decision) == [ed.ED_ALTERNATIVE_SUPPORTED]


def test_every_failed_criterion_is_listed_in_order() -> None:
    decision = check(early([3, 2], confidence="plausible", evidence=[], new=["Why?"]),
                     ctx(enabled=False, others=[other(2, confidence="supported"),
                                                other(3, turns=0)]))
    assert findings(decision) == [ed.ED_DISABLED, ed.ED_CONFIDENCE, ed.ED_EVIDENCE,
                                  ed.ED_OPEN_QUESTIONS, ed.ED_ALTERNATIVE_UNEXAMINED,
                                  ed.ED_ALTERNATIVE_SUPPORTED]
    assert list(ed.REVIEW_CODES) == findings(decision)


def test_the_review_reads_only_the_context() -> None:
    doc = ctx()
    before = repr(doc)
    first = check(early([2]), doc).to_dict()
    assert repr(doc) == before
    assert check(early([2]), doc).to_dict() == first
