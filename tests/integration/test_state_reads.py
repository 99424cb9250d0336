"""What publishing a step reads for its state document (decisions 141 and 142): the
evidence closed since the parent and the evidence still open in one statement, which on
SQLite looks the open records up in the partial index ``ix_evidence_open``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import event

from investigation.constants import STAGES
from investigation.loop.checkpoints import _STATE_SINCE_AND_OPEN
from investigation.loop.investigator import Investigator
from investigation.loop.outcome import StepKey
from investigation.operations import status
from tests.casekit import make_case


def test_the_evidence_section_is_one_statement_that_reads_open_records_by_their_index(
        tmp_path: Path) -> None:
    case = make_case(tmp_path / "case")
    sql = str(_STATE_SINCE_AND_OPEN["sqlite"].compile(
        dialect=case.store.engine.dialect)).split("UNION ALL")[0].strip()
    seen: list[tuple[str, Any]] = []

    def statement(_conn: Any, _cursor: Any, text: str, params: Any, *_: Any) -> None:
        if text.strip().startswith(sql[:60]) and "ix_evidence_open" in text:
            seen.append((text, params))

    event.listen(case.store.engine, "before_cursor_execute", statement)
    try:
        investigator = Investigator(case.env())
        steps = 0
        while investigator.step(case.case_id).outcome not in ("COMPLETED", "BLOCKED"):
            steps += 1
            assert steps < 20
    finally:
        event.remove(case.store.engine, "before_cursor_execute", statement)
    assert len(seen) == steps + 1  # once per published step, each state's one read
    raw = case.store.engine.raw_connection()
    try:
        for text, params in seen:
            plan = [row[-1] for row in raw.execute("EXPLAIN QUERY PLAN " + text, params)]
            assert any("INDEX ix_evidence_open" in line for line in plan), plan
            assert not any(line.startswith("SCAN evidence") for line in plan), plan
    finally:
        raw.close()
    case.store.dispose()


def test_status_says_a_step_is_in_progress_and_that_its_figures_count_it(
        tmp_path: Path) -> None:
    """A step writes its record, charges and questions before its checkpoint: `status
    --watch` showed 3 records after 2 published steps, unexplained (a new user's trial),
    and counting published steps only left balances and scores of the running step
    beside them (a hostile re-trial). Every figure counts what was recorded; status and
    the report say which step is in progress."""
    from typer.testing import CliRunner

    from investigation.report import render_report
    from workers.cli import app

    case = make_case(tmp_path / "case")
    investigator = Investigator(case.env())
    key = investigator.next_step(case.case_id)
    assert isinstance(key, StepKey)
    for stage in STAGES[:-1]:  # every stage of step 1 but publish
        assert investigator.stages.run(stage, key).halt is None
    info = status(case.store, case.case_id)
    assert info["steps"] == 0 and info["evidence_count"] == 1, info
    assert info["step_in_progress"] == {"step_seq": 1, "stages_recorded": 7,
                                        "stages": len(STAGES)}
    shown = CliRunner().invoke(app, ["status", case.case_id],
                               env={"INVESTIGATE_DATABASE_URL": case.store.url})
    assert shown.exit_code == 0, shown.output
    assert ("step 1 in progress (7 of 8 stages recorded, not published): the evidence, "
            "questions and balances above include what it recorded so far") in \
        " ".join(shown.output.split())
    html = render_report(case.store, case.case_id)
    assert ("0; step 1 in progress (7 of 8 stages recorded, not published): the figures "
            "below include what it recorded so far") in html
    checked = CliRunner().invoke(app, ["verify", case.case_id],
                                 env={"INVESTIGATE_DATABASE_URL": case.store.url})
    assert checked.exit_code == 0, checked.output
    assert "live rows step 1 in progress, ledgers not read" in " ".join(
        checked.output.split())  # not "the whole ledger of 0 budget accounts read"
    # Paused (or blocked), the step is not "in progress": it waits (a fleet trial read a
    # blocked case's step as running).
    from investigation.operations import pause, resume, step_in_progress_text

    pause(case.store, case.case_id)
    held = " ".join(CliRunner().invoke(app, ["status", case.case_id], env={
        "INVESTIGATE_DATABASE_URL": case.store.url}).output.split())
    assert "step 1 halted (7 of 8 stages recorded, not published; it goes on from there " \
        "once resumed)" in held, held
    assert step_in_progress_text(info["step_in_progress"], "BLOCKED").startswith(
        "step 1 halted (")
    resume(case.store, case.case_id)
    investigator.stages.run(STAGES[-1], key)
    info = status(case.store, case.case_id)
    assert (info["steps"], info["evidence_count"], info["step_in_progress"]) == (1, 1, None)


def test_a_shell_completes_a_case_argument_from_the_store(tmp_path: Path) -> None:
    """Operators typed or pasted 21-character case ids into every command (no completion):
    a CASE argument completes from the store the settings name, and offers nothing (no
    error) where no store is."""
    from typer.testing import CliRunner

    from workers.cli import app

    case = make_case(tmp_path / "case")
    other = make_case(tmp_path / "other", database_url=case.store.url,
                      interpretation={"summary": "another reading of the same report"})
    env = {"INVESTIGATE_DATABASE_URL": case.store.url, "INVESTIGATE_HOME": str(tmp_path / "h"),
           "_INVESTIGATE_COMPLETE": "complete_bash", "COMP_CWORD": "2"}
    for typed, offered in [("case-", {case.case_id, other.case_id}),
                           (case.case_id[:12], {i for i in (case.case_id, other.case_id)
                                                if i.startswith(case.case_id[:12])}),
                           ("case-zzz", set())]:
        done = CliRunner().invoke(app, [], prog_name="investigate",
                                  env={**env, "COMP_WORDS": f"investigate status {typed}"})
        assert done.exit_code == 0 and set(done.output.split()) == offered, done.output
    done = CliRunner().invoke(app, [], prog_name="investigate", env={
        **env, "INVESTIGATE_DATABASE_URL": f"sqlite:///{tmp_path / 'none.db'}",
        "COMP_WORDS": "investigate steps case-"})
    assert done.exit_code == 0 and done.output.strip() == "", done.output
    assert not (tmp_path / "none.db").exists()
