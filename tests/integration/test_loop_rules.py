"""Loop rules end to end: real store, real snapshot tools, scripted model replies
(seed 000, "Model/controller contract" and "Budget and stopping")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update
from sqlmodel import col, select

from investigation import operations
from investigation.budget import rules
from investigation.config import BudgetConfig, InvestigationConfig, LoopConfig
from investigation.constants import (
    ARTIFACT_CONTEXT,
    BLOCK_INVALID_LLM_RESPONSES,
    BLOCKED,
    COMPLETED,
    PROGRESSED,
    REJECTED,
)
from investigation.errors import InvestigationError
from investigation.loop.investigator import Investigator
from investigation.store import Store
from investigation.store.models import (
    BudgetAccount,
    Evidence,
    HypothesisNote,
    LedgerEntry,
    Plan,
    Question,
)
from tests.casekit import (
    HAPPY_REPLIES,
    Case,
    finish,
    make_case,
    q,
    refused_by_store,
    unguarded,
)

H = HAPPY_REPLIES


def context_at(case: Case, seq: int) -> dict[str, Any]:
    """The stored context document of step ``seq``."""
    with case.store.session() as s:
        art = Store.get_artifact(s, case.case_id, ARTIFACT_CONTEXT.format(seq=seq))
    assert art is not None, f"no context for step {seq}"
    return dict(json.loads(art.data))


def effects(case: Case) -> dict[str, Any]:
    """Every investigation effect a decision may have (not the retry/audit bookkeeping)."""
    with case.store.session() as s:
        accounts = s.exec(select(BudgetAccount).where(BudgetAccount.case_id == case.case_id)
                          .order_by(col(BudgetAccount.hypothesis_id))).all()
        ledger = s.exec(select(LedgerEntry).where(LedgerEntry.case_id == case.case_id)
                        .order_by(col(LedgerEntry.id))).all()
        evidence = s.exec(select(Evidence).where(Evidence.case_id == case.case_id)
                          .order_by(col(Evidence.ordinal))).all()
        questions = s.exec(select(Question).where(Question.case_id == case.case_id)
                           .order_by(col(Question.ordinal))).all()
        plans = s.exec(select(Plan).where(Plan.case_id == case.case_id)).all()
        notes = s.exec(select(HypothesisNote).where(HypothesisNote.case_id == case.case_id)
                       .order_by(col(HypothesisNote.hypothesis_id),
                                 col(HypothesisNote.step_seq))).all()
        return {
            "accounts": [(a.hypothesis_id, a.status, a.confidence, a.balance_units,
                          a.credit_units, a.turns, a.iterations, a.pending_evidence_id,
                          a.no_novelty_streak) for a in accounts],
            "notes": [(n.hypothesis_id, n.step_seq, n.note) for n in notes],
            "ledger": [(r.hypothesis_id, r.step_seq, r.kind, r.amount_units) for r in ledger],
            "evidence": [(e.evidence_id, e.hypothesis_id, e.assessed, e.refund_units)
                         for e in evidence],
            "questions": [(x.question_id, x.hypothesis_id, x.status, x.text)
                          for x in questions],
            "plans": len(plans),
        }


def account(case: Case, hid: int) -> BudgetAccount:
    with case.store.session() as s:
        return s.exec(select(BudgetAccount).where(BudgetAccount.case_id == case.case_id,
                                                  BudgetAccount.hypothesis_id == hid)).one()


def steps(inv: Investigator, case: Case, n: int) -> list[tuple[str, str | None, int | None]]:
    out = []
    for _ in range(n):
        o = inv.step(case.case_id)
        out.append((o.outcome, o.reason, o.hypothesis_id))
    return out


def run_to_end(inv: Investigator, case: Case, limit: int = 20) -> int:
    for i in range(limit):
        if inv.step(case.case_id).outcome == COMPLETED:
            return i + 1
    raise AssertionError("the investigation did not complete")


# -- a rejected reply --------------------------------------------------------------------


def test_rejected_reply_changes_nothing_and_the_next_context_carries_its_code(
        tmp_path: Path) -> None:
    # Hypothesis 1's second turn repeats its open question Q1 while assessing E1 and
    # asking for a paid query: everything of it must be discarded.
    bad = q("source.read", {"path": "shop/pricing.py", "start_line": 1, "end_line": 3},
            confidence="supported", assessment=(90, ["E1"]), evidence=["E1"],
            new_questions=["  WHERE is the   divisor? "])
    case = make_case(tmp_path / "c", replies=[H[0], H[1], bad, *H[2:]])
    inv = case.investigator()
    assert steps(inv, case, 2) == [(PROGRESSED, None, 1), (PROGRESSED, None, 2)]
    before = effects(case)
    assert before["accounts"][0][7] == "E1"  # hypothesis 1 has a pending finding

    assert steps(inv, case, 1) == [(REJECTED, "DUPLICATE_QUESTION", 1)]
    assert effects(case) == before
    assert account(case, 1).invalid_streak == 1

    # A valid reply continues; the context it was given carries the rejection.
    assert steps(inv, case, 1) == [(PROGRESSED, None, 1)]
    ctx = context_at(case, 4)
    assert ctx["hypothesis"]["id"] == 1
    assert ctx["last_rejection"]["code"] == "DUPLICATE_QUESTION"
    assert ctx["last_rejection"]["step_seq"] == 3
    assert ctx["hypothesis"]["balance_units"] == 57
    assert ctx["previous_result"]["evidence_id"] == "E1"
    assert [x["status"] for x in ctx["questions"]] == ["open"]
    assert account(case, 1).invalid_streak == 0
    assert run_to_end(inv, case) == 2
    assert context_at(case, 5)["hypothesis"]["id"] == 1
    assert context_at(case, 5)["last_rejection"] is None


def test_first_turn_rejection_keeps_the_turn_with_the_same_hypothesis(tmp_path: Path) -> None:
    bad = q("source.search", {"pattern": "percent"}, evidence=["E1"])
    case = make_case(tmp_path / "c", replies=[bad, *H])
    inv = case.investigator()
    assert steps(inv, case, 1) == [(REJECTED, "UNKNOWN_EVIDENCE_ID", 1)]
    after = effects(case)
    assert [a[3] for a in after["accounts"]] == [60, 60]
    assert after["ledger"] == [(1, 0, "credit", 60), (2, 0, "credit", 60)]
    assert (after["evidence"], after["questions"], after["plans"]) == ([], [], 0)
    assert steps(inv, case, 1) == [(PROGRESSED, None, 1)]
    ctx = context_at(case, 2)
    assert ctx["hypothesis"]["id"] == 1 and ctx["hypothesis"]["turn"] == 1
    assert ctx["previous_result"] is None
    assert ctx["last_rejection"]["code"] == "UNKNOWN_EVIDENCE_ID"


def test_valid_assessment_with_an_unsafe_next_action_settles_nothing(tmp_path: Path) -> None:
    bad = q("db.query", {"sql": "DELETE FROM orders"}, confidence="supported",
            assessment=(90, ["E1"]), evidence=["E1"], resolve=["Q1"])
    case = make_case(tmp_path / "c", replies=[H[0], H[1], bad, *H[2:]])
    inv = case.investigator()
    steps(inv, case, 2)
    before = effects(case)
    assert steps(inv, case, 1) == [(REJECTED, "TOOL_SQL_NOT_READ_ONLY", 1)]
    after = effects(case)
    assert after == before
    assert ("E1", 1, False, None) in after["evidence"]  # not assessed, no refund
    assert all(kind != "refund" for _, _, kind, _ in after["ledger"])
    assert after["questions"][0][2] == "open"
    assert after["accounts"][0][2] == "plausible"


# -- repeated invalid replies ------------------------------------------------------------


def test_three_invalid_replies_block_and_resume_continues(tmp_path: Path) -> None:
    schema_bad = json.dumps({**H[2], "assessment": {"score": "90", "reason": "r",
                                                    "evidence_ids": ["E1"]}})
    # One line each: the scripted provider reads JSON Lines.
    # Prose around the object is not normalised away (only one whole-reply fence is).
    invalid = ["The answer is obvious.", "Here it is: " + json.dumps(H[2]), schema_bad]
    case = make_case(tmp_path / "c", replies=[H[0], H[1], *invalid, *H[2:]])
    inv = case.investigator()
    assert steps(inv, case, 2) == [(PROGRESSED, None, 1), (PROGRESSED, None, 2)]
    before = effects(case)
    assert steps(inv, case, 3) == [(REJECTED, "REPLY_NOT_JSON", 1),
                                   (REJECTED, "REPLY_NOT_JSON", 1),
                                   (BLOCKED, BLOCK_INVALID_LLM_RESPONSES, 1)]
    assert account(case, 1).invalid_streak == 3
    assert json.loads(account(case, 1).last_rejection_json or "")["code"] == \
        "REPLY_SCHEMA_INVALID"
    # Blocked: pending finding, reservation and credit are preserved; nothing fabricated.
    assert effects(case) == before
    hyp1 = account(case, 1)
    assert (hyp1.status, hyp1.pending_evidence_id, hyp1.balance_units) == \
        (rules.ACTIVE, "E1", 57)
    status = operations.status(case.store, case.case_id)
    assert (status["state"], status["blocked_reason"], status["steps"]) == \
        ("BLOCKED", BLOCK_INVALID_LLM_RESPONSES, 5)
    # Stepping a blocked case does nothing.
    assert steps(inv, case, 1) == [(BLOCKED, BLOCK_INVALID_LLM_RESPONSES, None)]
    assert operations.status(case.store, case.case_id)["steps"] == 5

    with pytest.raises(InvestigationError) as info:
        operations.resume(case.store, case.case_id, retry_id="r1")
    assert info.value.code == "RETRY_ID_NOT_APPLICABLE"
    resumed = operations.resume(case.store, case.case_id)
    assert resumed["resumed_from"] == BLOCK_INVALID_LLM_RESPONSES
    with pytest.raises(InvestigationError) as info:
        operations.resume(case.store, case.case_id)
    assert info.value.code == "CASE_NOT_BLOCKED"

    assert steps(inv, case, 1) == [(PROGRESSED, None, 1)]
    hyp1 = account(case, 1)
    assert (hyp1.invalid_streak, hyp1.pending_evidence_id) == (0, "E3")
    assert run_to_end(inv, case) == 2
    # summary.md says the case was blocked and went on (an engineer reading a long case
    # found the block only as one more rejected reply).
    summary = operations.summary_bytes(case.store, case.case_id).decode()
    assert "\n## Interruptions\n\n- Step 5 (hypothesis 1): blocked, " \
        f"{BLOCK_INVALID_LLM_RESPONSES}; resumed, the case went on at step 6\n\n" \
        "## Model usage" in summary, summary


def test_invalid_streak_counts_only_consecutive_rejections(tmp_path: Path) -> None:
    bad = "not json"
    case = make_case(tmp_path / "c", replies=[bad, bad, H[0], bad, bad, H[1]])
    inv = case.investigator()
    assert [o for o, _, _ in steps(inv, case, 6)] == \
        [REJECTED, REJECTED, PROGRESSED, REJECTED, REJECTED, PROGRESSED]


# -- unsafe tool arguments ---------------------------------------------------------------


@pytest.mark.parametrize(("operation", "arguments", "expected"), [
    ("db.query", {"sql": "DELETE FROM orders"}, "TOOL_SQL_NOT_READ_ONLY"),
    ("db.query", {"sql": "UPDATE orders SET discount = 0"}, "TOOL_SQL_NOT_READ_ONLY"),
    ("db.query", {"sql": "ATTACH DATABASE 'other.db' AS other"}, "TOOL_SQL_NOT_READ_ONLY"),
    ("db.query", {"sql": "PRAGMA writable_schema = 1"}, "TOOL_SQL_NOT_READ_ONLY"),
    ("db.query", {"sql": "SELECT 1; DROP TABLE orders"}, "TOOL_SQL_MULTIPLE_STATEMENTS"),
    ("source.read", {"path": "../report.md", "start_line": 1, "end_line": 1},
     "TOOL_PATH_ESCAPE"),
    ("source.read", {"path": "/etc/passwd", "start_line": 1, "end_line": 1},
     "TOOL_PATH_ESCAPE"),
], ids=["delete", "update", "attach", "pragma", "two-statements", "dotdot", "absolute"])
def test_unsafe_arguments_are_rejected_and_nothing_is_charged(
        tmp_path: Path, operation: str, arguments: dict[str, Any], expected: str) -> None:
    case = make_case(tmp_path / "c", replies=[q(operation, arguments)])
    assert steps(case.investigator(), case, 1) == [(REJECTED, expected, 1)]
    after = effects(case)
    assert after["ledger"] == [(1, 0, "credit", 60), (2, 0, "credit", 60)]
    assert (after["evidence"], after["plans"]) == ([], 0)
    assert [(a[3], a[5], a[6]) for a in after["accounts"]] == [(60, 0, 0), (60, 0, 0)]
    assert account(case, 1).last_rejection_json is not None


def test_the_snapshot_database_survives_a_refused_write(tmp_path: Path) -> None:
    case = make_case(tmp_path / "c", replies=[
        q("db.query", {"sql": "DELETE FROM orders"}),
        q("db.query", {"sql": "SELECT count(*) AS n FROM orders"})])
    inv = case.investigator()
    assert steps(inv, case, 2) == [(REJECTED, "TOOL_SQL_NOT_READ_ONLY", 1),
                                   (PROGRESSED, None, 1)]
    with case.store.session() as s:
        ev = s.exec(select(Evidence)).one()
    assert [item["row"] for item in json.loads(ev.findings_json)] == [{"n": 3}]


# -- iteration cap -----------------------------------------------------------------------


def test_iteration_cap_leaves_one_closing_turn(tmp_path: Path) -> None:
    cfg = InvestigationConfig(loop=LoopConfig(max_iterations_per_hypothesis=1))
    close1 = finish("supported", (90, ["E1"]), ["E1"], resolve=["Q1"])
    case = make_case(tmp_path / "c", replies=[H[0], H[1], H[2], close1, H[4]])
    inv = case.investigator(cfg)
    assert steps(inv, case, 3) == [(PROGRESSED, None, 1), (PROGRESSED, None, 2),
                                   (REJECTED, "ACTION_NOT_ALLOWED", 1)]
    ctx = context_at(case, 3)
    assert ctx["allowed_actions"] == ["finish", "reject"]
    assert ctx["closing_reason"] == "iteration_cap"
    assert (ctx["hypothesis"]["iterations"], ctx["hypothesis"]["max_iterations"]) == (1, 1)
    assert ctx["previous_result"]["evidence_id"] == "E1"
    # The final extra turn may still assess the pending result and close.
    assert steps(inv, case, 2) == [(PROGRESSED, None, 1), (COMPLETED, None, 2)]
    hyp1 = account(case, 1)
    assert (hyp1.status, hyp1.iterations, hyp1.pending_evidence_id) == \
        (rules.FINISHED, 1, None)
    with case.store.session() as s:
        e1 = s.exec(select(Evidence).where(Evidence.evidence_id == "E1")).one()
    assert (e1.assessed, e1.refund_units) == (True, 2)
    assert hyp1.balance_units == 60 - 3 + 2


# -- refund-dependent affordability ------------------------------------------------------


def test_settlement_refund_can_pay_for_the_next_query(tmp_path: Path) -> None:
    cfg = InvestigationConfig(budget=BudgetConfig(credit_units=4))
    sql = "SELECT id, total, discount FROM orders ORDER BY id"
    broke = q("source.search", {"pattern": "discount"}, assessment=(0, ["E1"]))
    refunded = q("source.search", {"pattern": "discount"}, assessment=(100, ["E1"]))
    case = make_case(tmp_path / "c", replies=[
        q("db.query", {"sql": sql}), q("db.tables", {}, confidence="weak"), broke, refunded])
    inv = case.investigator(cfg)
    assert steps(inv, case, 4) == [(PROGRESSED, None, 1), (PROGRESSED, None, 2),
                                   (REJECTED, "BUDGET_UNAFFORDABLE", 1),
                                   (PROGRESSED, None, 1)]
    assert context_at(case, 3)["hypothesis"]["balance_units"] == 0
    # 4 * 80 % * full novelty * 100/100 = 3.2 -> 3 refunded, then 3 reserved.
    with case.store.session() as s:
        rows = s.exec(select(LedgerEntry).where(LedgerEntry.hypothesis_id == 1)
                      .order_by(col(LedgerEntry.id))).all()
    assert [(r.step_seq, r.kind, r.amount_units, r.balance_after_units) for r in rows] == \
        [(0, "credit", 4, 4), (1, "reserve", -4, 0), (4, "refund", 3, 3),
         (4, "reserve", -3, 0)]
    assert account(case, 1).pending_evidence_id == "E3"


# -- ledger and determinism --------------------------------------------------------------


def test_ledger_identity_after_a_full_investigation(tmp_path: Path) -> None:
    case = make_case(tmp_path / "c")
    assert run_to_end(case.investigator(), case) == 5
    with case.store.session() as s:
        accounts = s.exec(select(BudgetAccount).where(BudgetAccount.case_id == case.case_id)
                          .order_by(col(BudgetAccount.hypothesis_id))).all()
        ledger = s.exec(select(LedgerEntry).where(LedgerEntry.case_id == case.case_id)).all()
        evidence = s.exec(select(Evidence).where(Evidence.case_id == case.case_id)).all()
    assert [(a.status, a.balance_units) for a in accounts] == \
        [(rules.FINISHED, 58), (rules.REJECTED, 58)]
    for a in accounts:
        rows = [r for r in ledger if r.hypothesis_id == a.hypothesis_id]
        credit = sum(r.amount_units for r in rows if r.kind == "credit")
        reserves = -sum(r.amount_units for r in rows if r.kind == "reserve")
        refunds = sum(r.amount_units for r in rows if r.kind == "refund")
        assert {r.kind for r in rows} <= {"credit", "reserve", "refund"}
        assert credit == a.credit_units == 60
        assert a.balance_units == credit - reserves + refunds
        own = [e for e in evidence if e.hypothesis_id == a.hypothesis_id]
        assert reserves == sum(e.cost_units for e in own)
        assert refunds == sum(e.refund_units or 0 for e in own)
        for e in own:
            assert e.assessed
            assert 0 <= (e.refund_units or 0) < e.cost_units
    # E1: 3*80*1000*90 // 10**7 = 2; E3 (2 of 3 items new): 2*80*666*95 // 10**7 = 1;
    # E2: 4*80*1000*80 // 10**7 = 2.
    assert sorted((e.evidence_id, e.cost_units, e.refund_units) for e in evidence) == \
        [("E1", 3, 2), ("E2", 4, 2), ("E3", 2, 1)]


def test_tampered_balance_stops_the_next_step(tmp_path: Path) -> None:
    case = make_case(tmp_path / "c")
    inv = case.investigator()
    steps(inv, case, 1)
    with case.store.session() as s:
        s.execute(update(BudgetAccount).where(col(BudgetAccount.hypothesis_id) == 2)
                  .values(balance_units=1000))
    with pytest.raises(InvestigationError) as info:
        inv.step(case.case_id)
    assert info.value.code == "STATE_TAMPERED"  # the account differs from the checkpoint


def test_a_tampered_ledger_is_refused_by_the_store_or_stops_the_next_step(
        tmp_path: Path) -> None:
    case = make_case(tmp_path / "c")
    inv = case.investigator()
    steps(inv, case, 1)
    forged = update(LedgerEntry).where(col(LedgerEntry.hypothesis_id) == 1,
                                       col(LedgerEntry.kind) == "reserve").values(amount_units=0)
    refused_by_store(case.store, forged)  # ledger rows are write-once
    with unguarded(case.store), case.store.session() as s:
        s.execute(forged)  # the account still matches its checkpoint
    # Someone who can drop the guards is found where the ledger is read in full: by a
    # process meeting the case (decision 121; a warm runner compares the newest balance).
    with pytest.raises(InvestigationError) as info:
        case.investigator().step(case.case_id)
    assert info.value.code == "BUDGET_ORIGIN_MISMATCH"


def test_a_ledger_entry_inserted_behind_the_engine_stops_the_next_step(
        tmp_path: Path) -> None:
    """The store takes new ledger rows (the engine writes them at every step): one added
    behind its back changes the newest balance, which a warm runner compares with the
    account at every step; one that keeps the newest balance is found at full depth."""
    case = make_case(tmp_path / "c")
    inv = case.investigator()
    steps(inv, case, 1)
    with case.store.session() as s:
        newest = s.exec(select(LedgerEntry).where(LedgerEntry.hypothesis_id == 1)
                        .order_by(col(LedgerEntry.id).desc())).first()
        assert newest is not None
        balance = newest.balance_after_units
        s.add(LedgerEntry(case_id=case.case_id, revision=1, hypothesis_id=1, step_seq=90,
                          kind="refund", amount_units=100, balance_after_units=balance + 100))
    with pytest.raises(InvestigationError) as info:
        inv.step(case.case_id)
    assert info.value.code == "BUDGET_ORIGIN_MISMATCH"

    other = make_case(tmp_path / "d")
    inv = other.investigator()
    steps(inv, other, 1)
    with other.store.session() as s:
        newest = s.exec(select(LedgerEntry).where(LedgerEntry.hypothesis_id == 1)
                        .order_by(col(LedgerEntry.id).desc())).first()
        assert newest is not None
        s.add(LedgerEntry(case_id=other.case_id, revision=1, hypothesis_id=1, step_seq=90,
                          kind="refund", amount_units=100,
                          balance_after_units=newest.balance_after_units))
    with pytest.raises(InvestigationError) as info:
        other.investigator().step(other.case_id)
    assert info.value.code == "BUDGET_ORIGIN_MISMATCH"


def test_a_ledger_entry_inserted_into_a_finished_case_fails_verify_and_export(
        tmp_path: Path) -> None:
    """No step reads a finished case's ledger again, so ``investigate verify`` and
    ``export`` read all of it: a credit added behind the engine's back is found, and
    export writes nothing."""
    case = make_case(tmp_path / "c")
    run_to_end(case.investigator(), case)
    assert operations.verify(case.store, case.case_id)["budget_accounts"] == 2
    with case.store.session() as s:
        newest = s.exec(select(LedgerEntry).where(LedgerEntry.hypothesis_id == 2)
                        .order_by(col(LedgerEntry.id).desc())).first()
        assert newest is not None
        s.add(LedgerEntry(case_id=case.case_id, revision=1, hypothesis_id=2, step_seq=99,
                          kind="refund", amount_units=100,
                          balance_after_units=newest.balance_after_units + 100))
    with pytest.raises(InvestigationError) as info:
        operations.verify(case.store, case.case_id)
    assert (info.value.code, info.value.details.get("hypothesis_id")) == \
        ("BUDGET_ORIGIN_MISMATCH", 2)
    target = tmp_path / "export"
    with pytest.raises(InvestigationError) as info:
        operations.export(case.store, case.case_id, target)
    assert info.value.code == "BUDGET_ORIGIN_MISMATCH"
    assert not target.exists()


def test_summary_bytes_identical_across_two_fresh_stores(tmp_path: Path) -> None:
    outputs = []
    heads = []
    for name in ("first", "second"):
        case = make_case(tmp_path / name)
        run_to_end(case.investigator(), case)
        outputs.append(operations.summary_bytes(case.store, case.case_id))
        heads.append(operations.status(case.store, case.case_id)["head_hash"])
    assert outputs[0] == outputs[1]
    assert outputs[0].startswith(b"# Investigation summary")
    assert heads[0] == heads[1]


# -- a reply that is not valid Unicode ---------------------------------------------------


@pytest.mark.parametrize(("operation", "arguments"), [
    ("source.list", {"prefix": "\ud800"}),
    ("source.search", {"pattern": "x", "path_glob": "\ud800"}),
    ("db.query", {"sql": "SELECT ? AS v", "params": ["\ud800"]}),
], ids=["source.list", "path_glob", "db.params"])
def test_unpaired_surrogate_reply_is_rejected_not_wedged(
        tmp_path: Path, operation: str, arguments: dict[str, Any]) -> None:
    case = make_case(tmp_path / "c", replies=[q(operation, arguments), *H])
    inv = case.investigator()
    outcome, reason, hid = steps(inv, case, 1)[0]
    assert (outcome, hid) == (REJECTED, 1)
    assert reason is not None
    assert steps(inv, case, 1) == [(PROGRESSED, None, 1)]
