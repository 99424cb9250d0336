"""What publishing a step reads for its state document (decisions 141 and 142): the
evidence closed since the parent and the evidence still open in one statement, which on
SQLite looks the open records up in the partial index ``ix_evidence_open``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlmodel import select

from investigation.constants import STAGES
from investigation.loop.checkpoints import _STATE_SINCE_AND_OPEN
from investigation.loop.investigator import Investigator
from investigation.loop.stagebase import StepKey
from investigation.operations import status
from investigation.store.models import Evidence, Question
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


def test_status_counts_what_published_steps_recorded(tmp_path: Path) -> None:
    """A step writes its evidence record and its questions before its checkpoint: `status
    --watch` showed 7 records after 7 steps of which one found nothing (a new user's
    trial). Until the step publishes, status counts neither."""
    case = make_case(tmp_path / "case")
    investigator = Investigator(case.env())
    key = investigator.next_step(case.case_id)
    assert isinstance(key, StepKey)
    for stage in STAGES[:-1]:  # every stage of step 1 but publish
        assert investigator.stages.run(stage, key).halt is None
    with case.store.session() as s:  # step 1 wrote its record and its question
        assert len(s.exec(select(Evidence)).all()) == 1
        assert len(s.exec(select(Question)).all()) == 1
    info = status(case.store, case.case_id)
    assert (info["steps"], info["evidence_count"], info["open_questions"]) == (0, 0, 0)
    assert info["evidence"]["records"] == 0, info["evidence"]
    investigator.stages.run(STAGES[-1], key)
    info = status(case.store, case.case_id)
    assert (info["steps"], info["evidence_count"], info["open_questions"]) == (1, 1, 1)
