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
