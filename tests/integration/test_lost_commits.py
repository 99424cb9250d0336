"""A store that loses its last commits while worker processes live on (decision 126).

On PostgreSQL, stage transactions the engine can redo commit asynchronously: a crash of
the database server may lose the last of them, while every worker process keeps the
stage outputs it saw committed. Simulated here on SQLite by putting back a copy of the
store file taken earlier, under the same ``Stages`` object.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from investigation.constants import COMPLETED, STAGES
from investigation.errors import StaleStateError
from investigation.loop.investigator import Investigator
from investigation.loop.stages import Stages
from investigation.operations import summary_bytes
from tests.casekit import Case, make_case


def _store_file(case: Case) -> Path:
    return Path(case.store.url.removeprefix("sqlite:///"))


def _snapshot(case: Case, to: Path) -> None:
    case.store.engine.dispose()  # the last connection closed: the WAL is checkpointed
    shutil.copyfile(_store_file(case), to)


def _lose_commits_since(case: Case, snapshot: Path) -> None:
    """The store goes back to ``snapshot`` (what a server crash keeps)."""
    case.store.engine.dispose()
    path = _store_file(case)
    for extra in (Path(f"{path}-wal"), Path(f"{path}-shm")):
        extra.unlink(missing_ok=True)
    shutil.copyfile(snapshot, path)


@pytest.mark.parametrize("kept", ["build_context", "llm_call", "settle_reserve",
                                  "execute_tool"])
def test_a_process_that_outlives_lost_commits_redoes_the_step_from_the_store(
        tmp_path: Path, kept: str) -> None:
    lossy = make_case(tmp_path / "lossy")
    clean = make_case(tmp_path / "clean")
    assert clean.investigator().run(clean.case_id, max_steps=50).outcome == COMPLETED
    stages = Stages(lossy.env())
    first = Investigator(lossy.env())
    assert first.step(lossy.case_id).outcome != COMPLETED  # step 1 published
    key = first.next_step(lossy.case_id)
    snapshot = tmp_path / "kept.db"
    upto = STAGES.index(kept)
    for stage in STAGES[:upto + 1]:
        assert stages.run(stage, key).halt is None
    _snapshot(lossy, snapshot)
    later = STAGES[upto + 1:-1]  # stages whose commits the store loses, publish excepted
    for stage in later:
        assert stages.run(stage, key).halt is None
    _lose_commits_since(lossy, snapshot)
    # The same process goes on with the step's last stage: it must not publish from
    # outputs the store no longer holds.
    with pytest.raises(StaleStateError) as info:
        stages.run("publish", key)
    assert info.value.details["lost"] == list(later)
    # Dispatched again (the recovery sweep), the same process redoes the step from the
    # store, and the case ends exactly as a case that lost nothing.
    for stage in STAGES:
        result = stages.run(stage, key)
        if result.halt is not None:
            break
    with lossy.store.session() as s:
        from investigation.store.models import CaseRecord

        assert s.get(CaseRecord, lossy.case_id).head_seq == key.step_seq  # type: ignore[union-attr]
    assert lossy.investigator().run(lossy.case_id, max_steps=50).outcome == COMPLETED
    assert summary_bytes(lossy.store, lossy.case_id) == summary_bytes(clean.store,
                                                                     clean.case_id)


def test_a_lost_build_context_is_taken_from_the_store_again(tmp_path: Path) -> None:
    """The first stage of a step whose outputs were lost goes on from the store."""
    case = make_case(tmp_path / "c")
    stages = Stages(case.env())
    key = Investigator(case.env()).next_step(case.case_id)
    snapshot = tmp_path / "kept.db"
    _snapshot(case, snapshot)
    stages.run("build_context", key)
    stages.run("llm_call", key)
    _lose_commits_since(case, snapshot)
    assert stages.run("build_context", key).halt is None  # built again, no error
    for stage in STAGES[1:]:
        result = stages.run(stage, key)
        if result.halt is not None:
            break
    assert case.investigator().run(case.case_id, max_steps=50).outcome == COMPLETED
