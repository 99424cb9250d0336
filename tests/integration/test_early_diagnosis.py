"""Early diagnosis through the real loop (docs/early-diagnosis.md): an accepted review
defers alternatives to one assessment-only closing turn and the summary shows it; a
declined one changes nothing for the alternatives; an invalid one is a rejected reply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlmodel import select

from investigation import operations
from investigation.budget import rules
from investigation.constants import COMPLETED, DEFERRED, PROGRESSED, REJECTED
from investigation.store.models import Plan
from tests.casekit import HAPPY_REPLIES, HYPOTHESES, finish, make_case, q
from tests.integration.test_loop_rules import account, context_at, effects, steps

H = HAPPY_REPLIES
THIRD = {"id": 3, "statement": "The log shows discounts applied twice."}


def early_finish(defer: list[int], confidence: str = "strongly_supported",
                 pending: str = "E3") -> dict[str, Any]:
    """H1 finishes citing E1 and its pending read, asking to defer ``defer``."""
    reply = finish(confidence, (95, [pending]), ["E1", pending], resolve=["Q1"])
    reply["next"]["early_diagnosis"] = {"defer_alternatives": defer,
                                        "rationale": "E1 and the read show the divisor"}
    return reply


def summary(case: Any) -> str:
    data = operations.summary_bytes(case.store, case.case_id)
    assert data is not None
    return data.decode()


def test_an_accepted_review_defers_alternatives_to_one_closing_turn(tmp_path: Path) -> None:
    # E1 (H1 search), E2 (H2 db), E3 (H3 logs), E4 (H1 read); H1 finishes with E1, E4.
    case = make_case(tmp_path / "c", hypotheses=[*HYPOTHESES, THIRD], replies=[
        H[0], H[1], q("logs.search", {"pattern": "discount"}, confidence="weak"),
        H[2], early_finish([3, 2], pending="E4"),
        H[4],  # H2 assesses E2 and rejects
        finish("weakened", (10, ["E3"]), ["E3"], reason="nothing doubles", action="reject"),
    ])
    inv = case.investigator()
    assert steps(inv, case, 5) == [(PROGRESSED, None, 1), (PROGRESSED, None, 2),
                                   (PROGRESSED, None, 3), (PROGRESSED, None, 1),
                                   (DEFERRED, None, 1)]
    for hid in (2, 3):
        acc = account(case, hid)
        assert (acc.status, acc.deferred_by, acc.deferred_step) == (rules.ACTIVE, 1, 5)
    assert steps(inv, case, 1) == [(PROGRESSED, None, 2)]
    ctx = context_at(case, 6)
    assert ctx["hypothesis"]["id"] == 2 and ctx["hypothesis"]["deferred_by"] == 1
    assert (ctx["closing_reason"], ctx["allowed_actions"]) == \
        ("assessment_only", ["finish", "reject"])
    assert ctx["previous_result"]["evidence_id"] == "E2"  # its pending result is assessed
    assert steps(inv, case, 1) == [(COMPLETED, None, 3)]
    h2, h3 = account(case, 2), account(case, 3)
    assert h2.status == h3.status == rules.REJECTED
    assert h2.disposition_reason is not None
    assert h2.disposition_reason.startswith("assessment_only: ")
    text = summary(case)
    assert "| 2 | rejected | weakened |" in text and "deferred by H1 at step 5 |" in text
    assert "- Deferred to assessment-only by hypothesis 1 at step 5 (early diagnosis)" in text
    assert "- Countercheck (actions on alternatives): H2: 1 (deferred), H3: 1 (deferred)" \
        in text
    assert "- Step 5, hypothesis 1 asked to defer H2, H3; accepted: deferred to " \
        "assessment-only. Qualifying evidence: E1, E4." in text


def test_an_assessment_only_turn_cannot_start_research(tmp_path: Path) -> None:
    case = make_case(tmp_path / "c", replies=[
        H[0], H[1], H[2], early_finish([2]),
        q("db.tables", {}, confidence="weak", assessment=(50, ["E2"]), evidence=["E2"]),
        H[4]])
    inv = case.investigator()
    assert steps(inv, case, 4)[-1] == (DEFERRED, None, 1)
    before = effects(case)
    assert steps(inv, case, 1) == [(REJECTED, "ACTION_NOT_ALLOWED", 2)]
    assert effects(case) == before
    assert steps(inv, case, 1) == [(COMPLETED, None, 2)]


def test_a_declined_review_finishes_but_leaves_alternatives_researching(
        tmp_path: Path) -> None:
    case = make_case(tmp_path / "c", replies=[
        H[0], H[1], H[2], early_finish([2], confidence="supported"),
        q("db.tables", {}, confidence="weak", assessment=(50, ["E2"]), evidence=["E2"]),
        finish("weakened", (10, ["E4"]), ["E4"], reason="percent", action="reject")])
    inv = case.investigator()
    assert steps(inv, case, 4)[-1] == (PROGRESSED, None, 1)
    assert account(case, 1).status == rules.FINISHED
    assert account(case, 2).deferred_by is None
    assert steps(inv, case, 1) == [(PROGRESSED, None, 2)]  # H2 still researches
    assert context_at(case, 5)["closing_reason"] is None
    assert steps(inv, case, 1) == [(COMPLETED, None, 2)]
    with case.store.session() as s:
        plan = s.exec(select(Plan).where(Plan.step_seq == 4)).one()
    assert '"accepted":false' in plan.decision_json
    text = summary(case)
    assert "asked to defer H2; declined (ED_CONFIDENCE: confidence is supported, not " \
        "strongly_supported)" in text
    assert "deferred by" not in text


def test_an_invalid_request_is_a_rejected_reply_that_changes_nothing(tmp_path: Path) -> None:
    case = make_case(tmp_path / "c", replies=[H[0], H[1], H[2], early_finish([1]),
                                              early_finish([2])])
    inv = case.investigator()
    steps(inv, case, 3)
    before = effects(case)
    assert steps(inv, case, 1) == [(REJECTED, "EARLY_DIAGNOSIS_INVALID", 1)]
    assert effects(case) == before
    assert steps(inv, case, 1) == [(DEFERRED, None, 1)]
    assert context_at(case, 5)["last_rejection"]["code"] == "EARLY_DIAGNOSIS_INVALID"
