"""The store's guarantees, on SQLite and on PostgreSQL alike."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from sqlalchemy.exc import IntegrityError
from sqlmodel import select

from investigation.errors import StoreError
from investigation.store import Store, is_unique_violation
from investigation.store.models import (
    CaseRecord,
    Checkpoint,
    Evidence,
    LedgerEntry,
    ManifestPointer,
    PackageRecord,
    StageRun,
)

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "postgres":
        url = request.getfixturevalue("postgres_url")
    else:
        url = f"sqlite:///{tmp_path / 'store.db'}"
    s = Store(url)
    s.create_schema()
    with s.session() as session:  # rows with foreign keys need their case
        session.add(PackageRecord(id="p" * 64, size_bytes=0, manifest_json="{}", data=b""))
        session.flush()
        session.add(CaseRecord(id="c", package_id="p" * 64))
    return s


def test_artifacts_are_exact_and_write_once(store: Store) -> None:
    data = b"\x00\xffexact bytes\n"
    with store.session() as s:
        digest = Store.put_artifact(s, "c1", "analysis/investigation/0001/x.bin", data,
                                    media_type="application/octet-stream")
    with store.session() as s:
        art = Store.get_artifact(s, "c1", "analysis/investigation/0001/x.bin")
        assert art is not None and bytes(art.data) == data and art.sha256 == digest
        assert Store.put_artifact(s, "c1", "analysis/investigation/0001/x.bin", data) == digest
    with pytest.raises(StoreError) as err, store.session() as s:
        Store.put_artifact(s, "c1", "analysis/investigation/0001/x.bin", b"other")
    assert err.value.code == "STORE_ARTIFACT_CONFLICT"


@pytest.mark.parametrize(("model", "row"), [
    (Checkpoint, dict(case_id="c", revision=1, seq=1, hash="h", state_path="p", outcome="X")),
    (StageRun, dict(case_id="c", revision=1, step_seq=1, stage="validate", output_json="{}")),
    (LedgerEntry, dict(case_id="c", revision=1, hypothesis_id=1, step_seq=2, kind="reserve",
                       amount_units=-3, balance_after_units=57)),
])
def test_idempotency_keys_are_unique(store: Store, model: type, row: dict[str, object]) -> None:
    with store.session() as s:
        s.add(model(**row))
    with pytest.raises(IntegrityError) as err, store.session() as s:
        s.add(model(**row))
    assert is_unique_violation(err.value)
    with store.session() as s:
        assert len(s.exec(select(model)).all()) == 1  # the failed insert left nothing


def test_evidence_ids_are_unique_per_case(store: Store) -> None:
    base = dict(revision=1, hypothesis_id=1, operation="db.tables", arguments_json="{}",
                findings_json="[]", item_keys_json="[]", warnings_json="[]",
                fingerprint="f", item_count=0, new_item_count=0, cost_units=1,
                artifact_path="p", artifact_sha256="s")
    with store.session() as s:
        s.add(Evidence(case_id="a", step_seq=1, ordinal=1, evidence_id="E1", **base))
        s.add(Evidence(case_id="b", step_seq=1, ordinal=1, evidence_id="E1", **base))
    with pytest.raises(IntegrityError), store.session() as s:
        s.add(Evidence(case_id="a", step_seq=2, ordinal=2, evidence_id="E1", **base))


def test_pointers_move(store: Store) -> None:
    with store.session() as s:
        Store.set_pointer(s, "c", "investigation_state", "a/0001/state.json", "1" * 64)
    with store.session() as s:
        Store.set_pointer(s, "c", "investigation_state", "a/0002/state.json", "2" * 64)
    with store.session() as s:
        rows = s.exec(select(ManifestPointer)).all()
        assert [(r.path, r.sha256) for r in rows] == [("a/0002/state.json", "2" * 64)]
    # One upsert (decision 139): moved twice in a transaction, beside a new name and
    # another case's pointer of the same name, read back in the same transaction.
    with store.session() as s:
        s.add(CaseRecord(id="d", package_id="p" * 64))
        s.flush()
        Store.set_pointer(s, "c", "investigation_state", "a/0003/state.json", "3" * 64)
        Store.set_pointer(s, "c", "investigation_summary", "summary.md", "5" * 64)
        Store.set_pointer(s, "d", "investigation_state", "d/0001/state.json", "6" * 64)
        Store.set_pointer(s, "c", "investigation_state", "a/0004/state.json", "4" * 64)
        seen = s.exec(select(ManifestPointer.path).where(ManifestPointer.case_id == "c")
                      .order_by(ManifestPointer.name)).all()
        assert seen == ["a/0004/state.json", "summary.md"]
    with store.session() as s:
        rows = s.exec(select(ManifestPointer).order_by(ManifestPointer.case_id,
                                                       ManifestPointer.name)).all()
        # A move takes no id: the three pointers were given the first three.
        assert [r.id for r in rows] == [1, 2, 3]
        assert [(r.case_id, r.name, r.path, r.sha256) for r in rows] == [
            ("c", "investigation_state", "a/0004/state.json", "4" * 64),
            ("c", "investigation_summary", "summary.md", "5" * 64),
            ("d", "investigation_state", "d/0001/state.json", "6" * 64)]
    # A transaction that rolls back moves nothing.
    with pytest.raises(RuntimeError), store.session() as s:
        Store.set_pointer(s, "c", "investigation_state", "a/0005/state.json", "5" * 64)
        raise RuntimeError("rolled back")
    with store.session() as s:
        assert s.exec(select(ManifestPointer.path).where(
            ManifestPointer.case_id == "c", ManifestPointer.name == "investigation_state")
        ).one() == "a/0004/state.json"


@pytest.mark.parametrize("store", [pytest.param("postgres", marks=pytest.mark.postgres)],
                         indirect=True)  # SQLite runs one writer at a time
def test_a_second_creator_of_a_pointer_loses_the_race(store: Store) -> None:
    """Two transactions create the same pointer: the second one waits for the first and
    then fails as a lost race (it does not overwrite the first one's pointer)."""
    from sqlmodel import Session

    from investigation.store.engine import core, is_lost_race

    first, second = Session(store.engine), Session(store.engine)
    try:
        Store.set_pointer(first, "c", "investigation_state", "first", "1" * 64)
        core(first).execute(select(ManifestPointer.id)).all()  # sends the deferred write
        committer = threading.Timer(0.5, first.commit)
        committer.start()
        with pytest.raises(IntegrityError) as lost:
            Store.set_pointer(second, "c", "investigation_state", "second", "2" * 64)
            second.commit()
        committer.join()
        assert is_lost_race(lost.value)
    finally:
        first.close()
        second.close()
    with store.session() as s:
        assert s.exec(select(ManifestPointer.path)).all() == ["first"]
