"""Example tests from a mutation audit of the loop rules (seed 000, "Model/controller
contract" and "Budget and stopping"): each fails if the rule it names is removed.

Real store, real snapshot tools, scripted replies (``tests.casekit``). Hypothesis 2 rejects
itself on its first turn where a test needs only hypothesis 1 to keep the turn.
"""

from __future__ import annotations

import json
from pathlib import Path

from sqlmodel import col, select

from investigation import operations
from investigation.budget import rules
from investigation.config import InvestigationConfig, LoopConfig
from investigation.constants import COMPLETED, PROGRESSED, REJECTED
from investigation.loop.investigator import Investigator
from investigation.store.models import (
    CaseRecord,
    Evidence,
    HypothesisBirth,
    LedgerEntry,
    Question,
    RevisionRecord,
)
from tests.casekit import Case, finish, make_case, q
from tests.integration.test_loop_rules import account, context_at, effects, steps

#: Hypothesis 2 leaves at once, so every later turn is hypothesis 1's.
H2_REJECTS = finish("weakened", None, [], reason="not this one", action="reject")
DIVISOR = {"pattern": "percent / 10"}


def evidence(case: Case, eid: str) -> Evidence:
    with case.store.session() as s:
        return s.exec(select(Evidence).where(Evidence.case_id == case.case_id,
                                             Evidence.evidence_id == eid)).one()


def questions(case: Case) -> list[tuple[str, int, str, str, int | None, list[str] | None]]:
    with case.store.session() as s:
        rows = s.exec(select(Question).where(Question.case_id == case.case_id)
                      .order_by(col(Question.ordinal))).all()
        return [(x.question_id, x.hypothesis_id, x.status, x.text, x.resolved_step,
                 json.loads(x.resolution_evidence_json) if x.resolution_evidence_json
                 else None) for x in rows]


# -- rule 3 (and 2): a repeated query is a duplicate; results without new items end the run


def test_repeated_query_is_a_duplicate_without_refund_and_ends_low_information(
        tmp_path: Path) -> None:
    cfg = InvestigationConfig(loop=LoopConfig(max_results_without_novelty=2))
    # The second spelling adds a default: the normalised arguments are the same.
    same_again = {"pattern": "percent / 10", "regex": False}
    case = make_case(tmp_path / "c", replies=[
        q("source.search", DIVISOR),
        H2_REJECTS,
        q("source.search", same_again, assessment=(100, ["E1"])),
        q("source.search", DIVISOR, assessment=(100, ["E2"])),
        q("source.read", {"path": "shop/pricing.py", "start_line": 1, "end_line": 3},
          assessment=(100, ["E3"])),
        finish("plausible", (100, ["E3"]), ["E1"], reason="nothing new"),
    ])
    inv = case.investigator(cfg)
    assert steps(inv, case, 4) == [(PROGRESSED, None, 1), (PROGRESSED, None, 2),
                                   (PROGRESSED, None, 1), (PROGRESSED, None, 1)]
    first, second, third = (evidence(case, e) for e in ("E1", "E2", "E3"))
    assert (first.duplicate, first.item_count, first.new_item_count) == (False, 1, 1)
    for again in (second, third):
        assert json.loads(again.arguments_json) == json.loads(first.arguments_json)
        assert again.fingerprint == first.fingerprint
        assert (again.duplicate, again.item_count, again.new_item_count) == (True, 1, 0)
    # Full score, but no novelty: the duplicate earns nothing; the new finding did.
    assert (first.refund_units, second.refund_units) == (2, 0)
    assert account(case, 1).no_novelty_streak == 2

    # Two results without a new item: the next turn may only close the account.
    assert steps(inv, case, 2) == [(REJECTED, "ACTION_NOT_ALLOWED", 1), (COMPLETED, None, 1)]
    ctx = context_at(case, 5)
    assert (ctx["closing_reason"], ctx["allowed_actions"]) == \
        ("low_information", ["finish", "reject"])
    hyp1 = account(case, 1)
    assert (hyp1.status, hyp1.disposition_reason, hyp1.iterations) == \
        (rules.FINISHED, "low_information: nothing new", 3)

    # summary.md: the hypothesis says what its records amount to, and a duplicate names
    # the record it repeats instead of quoting the same findings again (a 500-step case's
    # summary quoted 100 copies of one listing).
    summary = operations.summary_bytes(case.store, case.case_id).decode()
    section = summary.split("### Hypothesis 1", 1)[1].split("### Hypothesis 2", 1)[0]
    assert "- Evidence records: 3: 1 found new items, 2 found nothing new (2 duplicates " \
        "of earlier records)\n" in section, section
    lines = section.split("#### Evidence", 1)[1].strip().splitlines()
    assert lines[0].startswith("- **E1** (step 1) `source.search`") and \
        ": 1 item(s), 1 new; cost" in lines[0], lines
    assert lines[1].startswith("    - `shop/pricing.py:"), lines  # E1's finding, quoted
    for line, (ev, step) in zip(lines[2:4], (("E2", 3), ("E3", 4)), strict=True):
        assert line.startswith(f"- **{ev}** (step {step}) `source.search`") and \
            ": 1 item(s), 0 new, duplicate of E1; cost" in line, lines
    assert not lines[4:] or not lines[4].startswith("    - "), lines  # no quote repeated
    # A hypothesis whose every record found something new has no such line (the demo's).
    assert "- Evidence records:" not in summary.split("### Hypothesis 2", 1)[1]


# -- rule 3: context and novelty use only the current revision's evidence ----------------


def _open_revision_2(case: Case) -> None:
    """Start analysis revision 2 of the case with the same interpretation and hypotheses
    (no command does this yet; the store supports it)."""
    with case.store.session() as s:
        old = s.exec(select(RevisionRecord).where(RevisionRecord.case_id == case.case_id,
                                                  RevisionRecord.revision == 1)).one()
        s.add(RevisionRecord(case_id=case.case_id, revision=2,
                             interpretation_json=old.interpretation_json,
                             hypotheses_sha256=old.hypotheses_sha256))
        for b in s.exec(select(HypothesisBirth).where(HypothesisBirth.case_id == case.case_id,
                                                      HypothesisBirth.revision == 1)).all():
            s.add(HypothesisBirth(case_id=case.case_id, revision=2,
                                  hypothesis_id=b.hypothesis_id, statement=b.statement,
                                  record_json=b.record_json, record_sha256=b.record_sha256))
        rec = s.get(CaseRecord, case.case_id)
        assert rec is not None
        rec.current_revision = 2
        s.add(rec)


def test_context_and_novelty_use_only_the_current_revision(tmp_path: Path) -> None:
    case = make_case(tmp_path / "c", replies=[
        q("source.search", DIVISOR, new_questions=["Where is the divisor?"]),
        q("db.tables", {}), q("source.search", DIVISOR)])
    inv = case.investigator()
    assert steps(inv, case, 2) == [(PROGRESSED, None, 1), (PROGRESSED, None, 2)]
    _open_revision_2(case)

    assert steps(inv, case, 1) == [(PROGRESSED, None, 1)]
    ctx = context_at(case, 3)
    assert ctx["case"]["revision"] == 2
    assert ctx["evidence"] == []  # E1 and E2 belong to revision 1
    assert ctx["questions"] == []  # so does Q1: a revision does not inherit questions
    assert ctx["previous_result"] is None
    assert ctx["hypothesis"]["balance_units"] == 60  # a fresh account of revision 2
    # The same query in the new revision: new evidence, every item new again.
    again = evidence(case, "E3")
    assert (again.revision, again.duplicate, again.item_count, again.new_item_count) == \
        (2, False, 1, 1)
    assert again.fingerprint == evidence(case, "E1").fingerprint


# -- rule 4: question history ------------------------------------------------------------


def test_question_history_is_immutable_and_reconfirming_is_idempotent(tmp_path: Path) -> None:
    unknown = q("db.tables", {}, assessment=(50, ["E2"]), resolve=["Q9"])
    reconfirm = q("db.tables", {}, assessment=(50, ["E2"]), resolve=["Q1"],
                  new_questions=["Where is the divisor?"])
    case = make_case(tmp_path / "c", replies=[
        q("source.search", DIVISOR, new_questions=["Where is the divisor?", "Is tax wrong?"]),
        H2_REJECTS,
        q("source.read", {"path": "shop/pricing.py", "start_line": 1, "end_line": 3},
          assessment=(90, ["E1"]), evidence=["E1"], resolve=["Q1"]),
        unknown,
        reconfirm,
        finish("plausible", (10, ["E3"]), ["E2"]),
    ])
    inv = case.investigator()
    assert steps(inv, case, 3) == [(PROGRESSED, None, 1), (PROGRESSED, None, 2),
                                   (PROGRESSED, None, 1)]
    resolved_q1 = ("Q1", 1, "resolved", "Where is the divisor?", 3, ["E1"])
    assert questions(case) == [resolved_q1, ("Q2", 1, "open", "Is tax wrong?", None, None)]

    # An unknown question id invalidates the whole decision: no assessment, no tool, no
    # budget or question change.
    before = effects(case)
    assert steps(inv, case, 1) == [(REJECTED, "UNKNOWN_QUESTION_ID", 1)]
    assert effects(case) == before

    # Re-confirming Q1 needs no evidence and keeps its resolution; asking its text again
    # adds a new record instead of reopening or rewriting Q1.
    assert steps(inv, case, 2) == [(PROGRESSED, None, 1), (COMPLETED, None, 1)]
    assert questions(case) == [resolved_q1, ("Q2", 1, "open", "Is tax wrong?", None, None),
                               ("Q3", 1, "open", "Where is the divisor?", None, None)]
    summary = operations.summary_bytes(case.store, case.case_id).decode()
    assert "- Q1 (resolved at step 3 with E1): Where is the divisor?" in summary
    outstanding = summary.split("## Outstanding questions\n\n", 1)[1]
    assert outstanding == ("- Q2 (hypothesis 1): Is tax wrong?\n"
                           "- Q3 (hypothesis 1): Where is the divisor?\n")


# -- rule 5 (and 2): support needs stored findings; supported cannot be rejected ----------


def test_support_needs_stored_findings_and_finish_never_rejects(tmp_path: Path) -> None:
    absent = {"pattern": "no such text anywhere"}
    case = make_case(tmp_path / "c", replies=[
        q("source.search", absent),
        H2_REJECTS,
        q("source.search", DIVISOR, confidence="supported", assessment=(60, ["E1"]),
          evidence=["E1"]),
        q("source.search", DIVISOR, confidence="weak", assessment=(60, ["E1"]),
          evidence=["E1"]),
        finish("strongly_supported", (90, ["E2"]), ["E2"], action="reject"),
        finish("strongly_supported", (90, ["E2"]), ["E2"], reason="the divisor is 10"),
    ])
    inv = case.investigator()
    assert steps(inv, case, 2) == [(PROGRESSED, None, 1), (PROGRESSED, None, 2)]
    assert evidence(case, "E1").item_count == 0
    assert steps(inv, case, 4) == [(REJECTED, "SUPPORT_WITHOUT_FINDINGS", 1),
                                   (PROGRESSED, None, 1),
                                   (REJECTED, "INCONSISTENT_REJECT", 1),
                                   (COMPLETED, None, 1)]
    hyp1 = account(case, 1)
    # complete: investigation_finished, balance kept (60 - 3 - 3 + 2 refunded for E2).
    assert (hyp1.status, hyp1.confidence, hyp1.disposition_reason, hyp1.balance_units) == \
        (rules.FINISHED, "strongly_supported", "the divisor is 10", 56)
    assert (hyp1.pending_evidence_id, evidence(case, "E2").assessed) == (None, True)
    with case.store.session() as s:
        last = s.exec(select(LedgerEntry).where(LedgerEntry.case_id == case.case_id,
                                                LedgerEntry.hypothesis_id == 1)
                      .order_by(col(LedgerEntry.id))).all()[-1]
    assert (last.kind, last.balance_after_units) == ("refund", 56)


# -- rule 7: what the summary reports ----------------------------------------------------


def _summary_after_happy_run(root: Path) -> str:
    case = make_case(root)
    out = Investigator(case.env()).run(case.case_id, max_steps=20)
    assert out.outcome == COMPLETED
    return operations.summary_bytes(case.store, case.case_id).decode()


def test_summary_reports_balances_confidence_dispositions_evidence_and_counterchecks(
        tmp_path: Path) -> None:
    text = _summary_after_happy_run(tmp_path / "a")
    lines = text.splitlines()
    # E1 (cost 3, refund 2) and E3 (cost 2, refund 1) for H1; E2 (cost 4, refund 2) for H2.
    assert "| 1 | investigation_finished | strongly_supported | 58 of 60 | 5 | 3 | 2 | 2 " \
           "| 1 action(s) on alternatives |" in lines
    assert "| 2 | rejected | weakened | 58 of 60 | 4 | 2 | 1 | 1 " \
           "| 2 action(s) on alternatives |" in lines
    h1 = text.split("### Hypothesis 1\n", 1)[1].split("### Hypothesis 2\n", 1)[0]
    h2 = text.split("### Hypothesis 2\n", 1)[1].split("## Outstanding questions", 1)[0]
    for block, expected in (
        (h1, ["- Disposition: investigation_finished (done)",
              "- Confidence: strongly_supported", "- Balance: 58 of 60 units",
              "- Turns: 3; research iterations: 2",
              "- Countercheck (actions on alternatives): H2: 1",
              "- Q1 (resolved at step 4 with E1, E3): Where is the divisor?"]),
        (h2, ["- Disposition: rejected (discounts are stored as percents)",
              "- Confidence: weakened", "- Balance: 58 of 60 units",
              "- Countercheck (actions on alternatives): H1: 2"]),
    ):
        for line in expected:
            assert line in block.splitlines(), line
    assert [ln.split(" (step")[0] for ln in h1.splitlines() if ln.startswith("- **E")] == \
        ["- **E1**", "- **E3**"]
    assert [ln.split(" (step")[0] for ln in h2.splitlines() if ln.startswith("- **E")] == \
        ["- **E2**"]
    assert "- **E1** (step 1) `source.search` " in h1
    assert "cost 3; assessed 90/100, refund 2" in h1
    assert text.endswith("## Outstanding questions\n\n- none\n")
    # Deterministic: a second run on a fresh store renders the same bytes.
    assert _summary_after_happy_run(tmp_path / "b") == text
