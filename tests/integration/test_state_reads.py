"""What publishing a step reads for its state document (decisions 141 and 142): the
evidence closed since the parent and the evidence still open in one statement, which on
SQLite looks the open records up in the partial index ``ix_evidence_open``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import event

from investigation.loop.checkpoints import _STATE_SINCE_AND_OPEN
from investigation.loop.investigator import Investigator
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
