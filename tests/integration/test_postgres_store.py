"""The store on PostgreSQL: the same investigation, the same bytes, the same fencing."""

from __future__ import annotations

from pathlib import Path

import pytest

from investigation.constants import COMPLETED
from investigation.errors import StaleStateError
from investigation.loop.checkpoints import verify_chain
from investigation.loop.outcome import StepKey
from investigation.loop.stages import Stages
from investigation.operations import summary_bytes
from tests.casekit import make_case

pytestmark = pytest.mark.postgres


def test_full_investigation_on_postgres_matches_sqlite(tmp_path: Path,
                                                       postgres_url: str) -> None:
    pg = make_case(tmp_path / "pg", database_url=postgres_url)
    lite = make_case(tmp_path / "lite")
    for case in (pg, lite):
        assert case.investigator().run(case.case_id, max_steps=50).outcome == COMPLETED
    assert summary_bytes(pg.store, pg.case_id) == summary_bytes(lite.store, lite.case_id)
    with pg.store.session() as s:
        assert verify_chain(s, pg.case_id) == 5


def test_stale_worker_cannot_run_a_published_step(tmp_path: Path, postgres_url: str) -> None:
    case = make_case(tmp_path / "stale", database_url=postgres_url)
    case.investigator().step(case.case_id)  # publishes step 1
    stale = StepKey(case.case_id, 1, 1)
    # Through the entry point a finished step is read back, never redone ...
    assert Stages(case.env()).run("publish", stale).output["outcome"] == "PROGRESSED"
    # ... and a worker that was inside a stage when the head moved cannot write.
    with pytest.raises(StaleStateError):
        Stages(case.env())._settle_reserve(stale)


def _entry_markers(stages: Stages, key: StepKey, statement: object | None = None) -> list[str]:
    """The stage names a stage entry reads with the case lock (the engine's statement, or
    ``statement`` in its place), in a session of its own."""
    from sqlmodel import Session

    from investigation.loop import stagebase

    with Session(stages.store.engine) as s:
        if statement is None:
            _, markers = stages._lock_case_and_markers(s, key)
            names = [name for name, _ in markers]
        else:
            rows = s.connection().execute(statement, key.to_dict()).all()  # type: ignore[arg-type]
            names = [str(r[4]) for r in rows if r[4] is not None]
        s.commit()
    assert stagebase  # the module whose statements these are
    return sorted(names)


def _runner_that_holds_the_lock(case: object, key: StepKey, stage: str) -> tuple[object, object]:
    """Another runner: its transaction holds the case row and has written ``stage``'s
    marker, not yet committed. Returns its connection and transaction."""
    from sqlalchemy import text

    conn = case.store.engine.connect()  # type: ignore[attr-defined]
    tx = conn.begin()
    conn.execute(text('SELECT id FROM "case" WHERE id = :id FOR UPDATE'), {"id": key.case_id})
    conn.execute(text("INSERT INTO stage_run (case_id, revision, step_seq, stage, output_json, "
                      "completed_at) VALUES (:case_id, :revision, :step_seq, :stage, '{}', "
                      "now())"), {**key.to_dict(), "stage": stage})
    return conn, tx


@pytest.mark.parametrize("engine_statement", [True, False])
def test_a_stage_entry_that_waited_for_the_case_lock_sees_the_holders_marker(
        tmp_path: Path, postgres_url: str, engine_statement: bool) -> None:
    """The entry's lock and markers are one round trip (migration 0010's function), and
    still read the markers after the lock is granted: a runner that waited for the holder
    sees the marker the holder committed. The same read as one locking statement (the
    joined query SQLite runs, ``FOR UPDATE`` of the case row) misses it on PostgreSQL:
    its snapshot predates the holder's commit."""
    import threading
    import time

    from investigation.loop import stagebase
    from investigation.store.engine import table_of
    from investigation.store.models import CaseRecord

    case = make_case(tmp_path / "entry", database_url=postgres_url)
    stages = Stages(case.env())
    key = StepKey(case.case_id, 1, 1)
    assert stages.run("build_context", key).output["finalize"] is False
    one_statement = stagebase._CASE_AND_MARKERS.with_for_update(of=table_of(CaseRecord))
    conn, tx = _runner_that_holds_the_lock(case, key, "llm_call")
    seen: list[list[str]] = []
    try:
        waiting = threading.Thread(target=lambda: seen.append(_entry_markers(
            stages, key, None if engine_statement else one_statement)), daemon=True)
        waiting.start()
        time.sleep(0.5)  # the entry waits for the row lock
        assert waiting.is_alive() and not seen
    finally:
        tx.commit()  # type: ignore[attr-defined]
        conn.close()  # type: ignore[attr-defined]
    waiting.join(30)
    if engine_statement:
        assert seen == [["build_context", "llm_call"]]
    else:
        assert seen == [["build_context"]]  # why PostgreSQL needs the function
