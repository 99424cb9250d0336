"""Operator control and the lifecycle of every case (seed 001; docs/lifecycle.md): pause
stops at the next stage boundary and resume continues exactly there (same checkpoints and
summary as an undisturbed run); cancel is final; status shows the lifecycle; each step is
a lifecycle round and completion is OBJECTIVE_MET."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import col, select
from typer.testing import CliRunner

from investigation import operations
from investigation.config import InvestigationConfig, LimitsConfig
from investigation.constants import BLOCKED, COMPLETED, PROGRESSED
from investigation.errors import InvestigationError
from investigation.external_tests import AsyncTestCoordinator, derive_secret
from investigation.lifecycle import InvestigationSession, SessionState
from investigation.loop import lifecycle
from investigation.loop.outcome import StepKey
from investigation.loop.stages import Stages
from investigation.store.models import CaseRecord, Checkpoint, LLMOperation, StageRun, utcnow
from tests.casekit import Case, make_case
from tests.integration.test_external_tests import CFG, REPLIES
from tests.integration.test_loop_rules import run_to_end


def hashes(case: Case) -> list[str]:
    with case.store.session() as s:
        return list(s.exec(select(Checkpoint.hash).where(Checkpoint.case_id == case.case_id)
                           .order_by(col(Checkpoint.seq))).all())


def session_of(case: Case) -> InvestigationSession:
    with case.store.session() as s:
        row = s.get(CaseRecord, case.case_id)
        assert row is not None
        loaded = lifecycle.load(row)
    assert loaded is not None
    return loaded


@pytest.fixture
def reference(tmp_path: Path) -> tuple[list[str], bytes]:
    """Checkpoint hashes and summary of an undisturbed run of the tiny case."""
    case = make_case(tmp_path / "ref")
    run_to_end(case.investigator(), case)
    return hashes(case), operations.summary_bytes(case.store, case.case_id)


def test_every_step_is_a_lifecycle_round_and_completion_meets_the_objective(
        tmp_path: Path) -> None:
    case = make_case(tmp_path / "c")
    assert operations.status(case.store, case.case_id)["lifecycle"] == \
        {"state": "PLANNING", "started": False}
    steps = run_to_end(case.investigator(), case)
    session = session_of(case)
    assert session.state == SessionState.COMPLETED
    assert session.termination_reason is not None
    assert session.termination_reason.value == "OBJECTIVE_MET"
    # 5 accepted decisions (3 queries, finish, reject): 4 complete rounds, the 5th ends in
    # COMPLETED from UPDATING; the last step only builds the summary (no model call).
    assert (session.iterations, session.usage.investigations, session.usage.agent_runs) == \
        (4, 3, 5)
    assert session.usage.cost_units == 3 + 4 + 2  # source.search, db.query, source.read
    assert steps == 5
    life = operations.status(case.store, case.case_id)["lifecycle"]
    assert (life["state"], life["termination_reason"]) == ("COMPLETED", "OBJECTIVE_MET")


def test_pause_between_steps_and_resume_gives_the_undisturbed_result(
        tmp_path: Path, reference: tuple[list[str], bytes]) -> None:
    case = make_case(tmp_path / "c")
    inv = case.investigator()
    assert inv.step(case.case_id).outcome == PROGRESSED
    assert operations.pause(case.store, case.case_id)["paused_from"] == "INVESTIGATING"
    life = operations.status(case.store, case.case_id)["lifecycle"]
    assert (life["state"], life["paused_from"]) == ("PAUSED", "PLANNING")
    before = hashes(case)
    for _ in range(2):
        o = inv.step(case.case_id)
        assert (o.outcome, o.reason) == (BLOCKED, "PAUSED")
    assert hashes(case) == before
    with pytest.raises(InvestigationError) as info:
        operations.pause(case.store, case.case_id)
    assert info.value.code == "CASE_NOT_ACTIVE"
    assert operations.resume(case.store, case.case_id)["state"] == "INVESTIGATING"
    assert session_of(case).state == SessionState.PLANNING
    run_to_end(inv, case)
    assert (hashes(case), operations.summary_bytes(case.store, case.case_id)) == reference


def test_pause_mid_step_stops_at_the_next_stage_and_keeps_the_finished_one(
        tmp_path: Path, reference: tuple[list[str], bytes]) -> None:
    case = make_case(tmp_path / "c")
    inv = case.investigator()
    inv.step(case.case_id)
    stages = Stages(case.env())
    key = StepKey(case.case_id, 1, 2)
    real = stages.env.gateway.call

    def pausing_call(*args: Any, **kwargs: Any) -> Any:
        operations.pause(case.store, case.case_id)  # arrives while this stage runs
        return real(*args, **kwargs)

    stages.env.gateway.call = pausing_call  # type: ignore[method-assign]
    assert stages.run("build_context", key).halt is None
    assert stages.run("llm_call", key).halt is None  # the running stage finishes
    halted = stages.run("validate", key).halt
    assert halted is not None and (halted.outcome, halted.reason) == (BLOCKED, "PAUSED")
    with case.store.session() as s:
        done = {r.stage for r in s.exec(select(StageRun).where(StageRun.step_seq == 2))}
        calls = len(s.exec(select(LLMOperation)).all())
    assert done == {"build_context", "llm_call"}
    operations.resume(case.store, case.case_id)
    run_to_end(case.investigator(), case)
    with case.store.session() as s:
        assert len(s.exec(select(LLMOperation)).all()) == calls + 3  # llm_call not redone
    assert (hashes(case), operations.summary_bytes(case.store, case.case_id)) == reference


def test_cancel_is_final_and_keeps_what_was_done(tmp_path: Path) -> None:
    case = make_case(tmp_path / "c")
    inv = case.investigator()
    inv.step(case.case_id)
    inv.step(case.case_id)
    operations.pause(case.store, case.case_id)
    assert operations.cancel(case.store, case.case_id)["cancelled_from"] == "PAUSED"
    session = session_of(case)
    assert session.state == SessionState.CANCELLED
    assert session.termination_reason is not None
    assert session.termination_reason.value == "USER_CANCELLED"
    o = inv.step(case.case_id)
    assert (o.outcome, o.reason) == (BLOCKED, "CANCELLED")
    assert operations.verify(case.store, case.case_id)["live_rows"] == "checked"
    info = operations.status(case.store, case.case_id)
    assert (info["state"], info["steps"], info["evidence_count"]) == ("CANCELLED", 2, 2)
    for fn in (operations.pause, operations.cancel):
        with pytest.raises(InvestigationError) as err:
            fn(case.store, case.case_id)
        assert err.value.code == "CASE_NOT_ACTIVE"
    with pytest.raises(InvestigationError) as err:
        operations.resume(case.store, case.case_id)
    assert err.value.code == "CASE_NOT_BLOCKED"
    # Never "no summary yet": a cancelled case never gets one (a new user's trial).
    with pytest.raises(InvestigationError) as err:
        operations.summary_bytes(case.store, case.case_id)
    assert err.value.code == "SUMMARY_NOT_READY"
    assert "is CANCELLED and has no summary" in err.value.message
    assert "yet" not in err.value.message


def test_a_summary_asked_for_too_early_says_where_to_look(tmp_path: Path) -> None:
    """SUMMARY_NOT_READY gave no next step (a real model's user)."""
    case = make_case(tmp_path / "c")
    case.investigator().step(case.case_id)
    with pytest.raises(InvestigationError) as err:
        operations.summary_bytes(case.store, case.case_id)
    assert err.value.code == "SUMMARY_NOT_READY"
    assert "is INVESTIGATING and has no summary yet" in err.value.message
    assert f"`investigate status {case.case_id}` shows where it is" in err.value.message


def test_verify_of_a_case_cancelled_mid_step_says_the_step_stays_unfinished(
        tmp_path: Path) -> None:
    """`verify` said "step 3 in progress" of a cancelled case, where nothing runs any more
    (a new user's trial)."""
    case = make_case(tmp_path / "c")
    case.investigator().step(case.case_id)
    assert Stages(case.env()).run("build_context", StepKey(case.case_id, 1, 2)).halt is None
    assert operations.verify(case.store, case.case_id)["live_rows"] == "step 2 in progress"
    operations.cancel(case.store, case.case_id)
    assert operations.verify(case.store, case.case_id)["live_rows"] == \
        "step 2 left unfinished when the case was CANCELLED"


def test_a_case_paused_while_awaiting_feedback_takes_it_and_resumes_investigating(
        tmp_path: Path) -> None:
    case = make_case(tmp_path / "c", replies=REPLIES)
    inv = case.investigator(CFG)
    outcomes = [inv.step(case.case_id) for _ in range(3)]
    assert (outcomes[-1].outcome, outcomes[-1].reason) == (BLOCKED, "AWAITING_TEST_FEEDBACK")
    assert session_of(case).state == SessionState.EXECUTING  # waiting for the result
    operations.pause(case.store, case.case_id)
    coord = AsyncTestCoordinator(case.store, b"unused")
    secret = derive_secret(case.env().feedback_key or b"", case.case_id, "T1")
    sub = coord.submit(case.case_id, "T1", secret, {"outcome": "as_expected",
                                                     "observation": "90"})
    coord.confirm(case.case_id, "T1", secret, sub["feedback_sha256"])
    session = session_of(case)
    assert (session.state, session.paused_from) == (SessionState.PAUSED,
                                                    SessionState.PLANNING)
    assert operations.status(case.store, case.case_id)["state"] == "PAUSED"
    assert operations.resume(case.store, case.case_id)["state"] == "INVESTIGATING"
    assert [inv.step(case.case_id).outcome for _ in range(2)] == [PROGRESSED, COMPLETED]


def test_resuming_a_case_paused_while_blocked_exits_1(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`resume` said "now BLOCKED" and exited 0, although the commands that advance a
    case exit 1 on a blocked one (README; a new user's trial)."""
    from workers.cli import app

    case = make_case(tmp_path / "c", replies=REPLIES)
    inv = case.investigator(CFG)
    outcomes = [inv.step(case.case_id) for _ in range(3)]
    assert (outcomes[-1].outcome, outcomes[-1].reason) == (BLOCKED, "AWAITING_TEST_FEEDBACK")
    monkeypatch.setenv("INVESTIGATE_DATABASE_URL", str(case.store.engine.url))
    monkeypatch.setenv("INVESTIGATE_HOME", str(tmp_path / "home"))
    runner = CliRunner()
    assert runner.invoke(app, ["pause", case.case_id]).exit_code == 0
    resumed = runner.invoke(app, ["resume", case.case_id])
    assert resumed.exit_code == 1 and "now BLOCKED" in resumed.output, resumed.output
    assert runner.invoke(app, ["pause", case.case_id]).exit_code == 0
    as_json = runner.invoke(app, ["resume", case.case_id, "--json"])
    assert as_json.exit_code == 1 and json.loads(as_json.stdout)["state"] == "BLOCKED"


def test_cancelled_cases_take_no_feedback(tmp_path: Path) -> None:
    case = make_case(tmp_path / "c", replies=REPLIES)
    inv = case.investigator(CFG)
    for _ in range(3):
        inv.step(case.case_id)
    operations.cancel(case.store, case.case_id)
    key = case.env().feedback_key or b""
    coord = AsyncTestCoordinator(case.store, key)
    with pytest.raises(InvestigationError) as err:
        coord.submit(case.case_id, "T1", derive_secret(key, case.case_id, "T1"),
                     {"outcome": "as_expected", "observation": "90"})
    assert err.value.code == "CASE_CANCELLED"
    assert coord.expire_due(utcnow() + timedelta(days=2)) == []


def test_the_session_execution_bound_stops_the_case(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = InvestigationConfig(limits=LimitsConfig(max_execution_seconds=30))
    case = make_case(tmp_path / "c")
    inv = case.investigator(cfg)
    inv.step(case.case_id)  # well within 30 s, even on a loaded machine
    # Make step 2 look like it took a minute (it publishes 60 s after its context was
    # stored: the artifact rows themselves are write-once).
    stages = Stages(case.env(cfg))
    key = StepKey(case.case_id, 1, 2)
    for stage in ("build_context", "llm_call", "validate", "persist_plan", "settle_reserve",
                  "execute_tool", "record_evidence"):
        stages.run(stage, key)
    from investigation.loop import lifecycle

    monkeypatch.setattr(lifecycle, "utcnow", lambda: utcnow() + timedelta(seconds=60))
    out = stages.run("publish", key).halt
    monkeypatch.undo()
    assert out is not None and out.outcome == PROGRESSED
    info = operations.status(case.store, case.case_id)
    assert (info["state"], info["blocked_reason"]) == ("STOPPED",
                                                       "SESSION_BUDGET_EXHAUSTED")
    assert info["lifecycle"]["termination_reason"] == "BUDGET_EXHAUSTED"
    o = inv.step(case.case_id)
    assert (o.outcome, o.reason) == (BLOCKED, "SESSION_BUDGET_EXHAUSTED")


def test_operator_control_from_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.cli import app

    case = make_case(tmp_path / "c")
    monkeypatch.setenv("INVESTIGATE_DATABASE_URL", str(case.store.engine.url))
    monkeypatch.setenv("INVESTIGATE_HOME", str(tmp_path / "home"))
    runner = CliRunner()
    paused = runner.invoke(app, ["pause", case.case_id])
    assert paused.exit_code == 0 and "paused" in paused.output, paused.output
    st = runner.invoke(app, ["status", case.case_id])
    assert "state PAUSED" in st.output and "lifecycle PAUSED (paused from PLANNING)" in \
        st.output
    ran = runner.invoke(app, ["run", case.case_id, "--providers", str(case.providers_path)])
    # A held case is named by its state (a fleet trial read "BLOCKED (PAUSED)" as a block);
    # exit 1: an operator must resume it.
    assert ran.exit_code == 1 and f"case {case.case_id}: PAUSED\n" in ran.output, ran.output
    assert "BLOCKED" not in ran.output, ran.output
    resumed = runner.invoke(app, ["resume", case.case_id])
    assert resumed.exit_code == 0 and "now INVESTIGATING" in resumed.output
    ran = runner.invoke(app, ["run", case.case_id, "--providers", str(case.providers_path)])
    assert ran.exit_code == 0 and "COMPLETED" in ran.output, ran.output
    st = runner.invoke(app, ["status", case.case_id])
    assert "lifecycle COMPLETED (OBJECTIVE_MET: every hypothesis account is terminal" \
        in " ".join(st.output.split())
    # What the session's count is, beside the accounts' and the steps' (a reader's trial).
    assert "session iterations 4 (accepted decision rounds, the last, which ended the " \
        "session, not counted; an account's iterations count only its queries and tests)" \
        in " ".join(st.output.split())
    again = runner.invoke(app, ["cancel", case.case_id])
    assert again.exit_code == 2 and "CASE_NOT_ACTIVE" in again.output
    # A cancelled case is over: run says so and exits 0, as for a completed one.
    other = make_case(tmp_path / "other")
    monkeypatch.setenv("INVESTIGATE_DATABASE_URL", str(other.store.engine.url))
    assert runner.invoke(app, ["cancel", other.case_id]).exit_code == 0
    ran = runner.invoke(app, ["run", other.case_id, "--providers", str(other.providers_path)])
    assert ran.exit_code == 0 and f"case {other.case_id}: CANCELLED\n" in ran.output, \
        ran.output
    assert "BLOCKED" not in ran.output, ran.output
    other.store.dispose()


def test_a_pause_before_the_first_step_does_not_fix_the_session_budget(
        tmp_path: Path) -> None:
    cfg = InvestigationConfig(limits=LimitsConfig(max_execution_seconds=5))
    case = make_case(tmp_path / "c")
    operations.pause(case.store, case.case_id)  # starts the session with default bounds
    assert session_of(case).budget.max_execution_ms == 7 * 24 * 3600 * 1000
    operations.resume(case.store, case.case_id)
    case.investigator(cfg).step(case.case_id)
    assert session_of(case).budget.max_execution_ms == 5000  # the frozen policy's


def test_a_closing_step_without_a_model_call_completes_from_planning(tmp_path: Path) -> None:
    from investigation.config import BudgetConfig
    from investigation.constants import OPERATIONS

    cfg = InvestigationConfig(budget=BudgetConfig(credit_units=1,
                                                  costs={op: 2 for op in OPERATIONS}))
    case = make_case(tmp_path / "c")
    o = case.investigator(cfg).step(case.case_id)
    assert (o.outcome, o.step_seq) == (COMPLETED, 1)  # both accounts exhausted at once
    session = session_of(case)
    assert session.state == SessionState.COMPLETED
    assert (session.usage.agent_runs, session.iterations) == (0, 0)
    assert session.termination_reason is not None
    assert session.termination_reason.value == "OBJECTIVE_MET"
