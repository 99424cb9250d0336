"""The compact store (issue 13), on SQLite and PostgreSQL alike: artifact bytes are stored
once, compressed and as deltas, read back exactly; the guards refuse rewriting published
rows; migration ``0007_compact_store`` moves an existing store's bytes without
changing one of them, and a migrated case continues exactly as it would have."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import delete, text, update
from sqlmodel import col, select
from typer.testing import CliRunner

from investigation import operations
from investigation.config import canonical_json
from investigation.errors import StoreError
from investigation.loop import checkpoints
from investigation.store import Store, blobs, guards
from investigation.store.migrate import upgrade
from investigation.store.models import (
    Artifact,
    Blob,
    Checkpoint,
    Evidence,
    HypothesisNote,
    LedgerEntry,
    Question,
    RevisionRecord,
    StageRun,
)
from tests.casekit import Case, make_case, refused_by_store

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def _url(request: pytest.FixtureRequest, tmp_path: Path, name: str) -> str:
    if request.param == "postgres":
        if name == "a":
            return str(request.getfixturevalue("postgres_url"))
        return str(request.getfixturevalue("second_postgres_url"))
    return f"sqlite:///{tmp_path / (name + '.db')}"


@pytest.fixture
def second_postgres_url(postgres_url: str) -> Any:
    """Another fresh schema on the test server (the first is ``postgres_url``'s)."""
    import uuid

    base, _, _ = postgres_url.partition("?")
    schema = "t_" + uuid.uuid4().hex[:12]
    admin = sa.create_engine(base)
    with admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
    try:
        yield f"{base}?options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
        admin.dispose()


def _run(case: Case, steps: int | None = None) -> None:
    inv = case.investigator()
    done = 0
    while steps is None or done < steps:
        if inv.step(case.case_id).outcome == "COMPLETED":
            return
        done += 1


def _tree(store: Store, case_id: str, root: Path) -> dict[str, bytes]:
    operations.export(store, case_id, root)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


# -- bytes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS, indirect=["backend"])
def test_bytes_are_exact_deduplicated_and_stored_as_bounded_deltas(backend: str) -> None:
    store = Store(backend)
    store.create_schema()
    base = b'{"evidence":[' + b",".join(b'{"id":"E%d","x":"%s"}' % (i, b"y" * 40)
                                        for i in range(200)) + b"]}"
    versions = [base[:-2] + b',{"id":"N%d"}]}' % i for i in range(blobs.MAX_DELTA_DEPTH + 3)]
    with store.session() as s:
        for i, data in enumerate(versions):
            Store.put_artifact(s, "c1", f"analysis/investigation/{i + 1:04d}/context.json",
                               data)
        Store.put_artifact(s, "c2", "analysis/investigation/0001/context.json", versions[0])
    with store.session() as s:
        rows = s.exec(select(Blob)).all()
        assert len(rows) == len(versions)  # c2's copy is the same blob
        depths = [r.depth for r in sorted(rows, key=lambda r: versions.index(
            next(v for v in versions if hashlib.sha256(v).hexdigest() == r.sha256)))]
        assert depths[0] == 0 and depths[1] == 1
        assert max(depths) == blobs.MAX_DELTA_DEPTH  # then a new keyframe
        assert depths[blobs.MAX_DELTA_DEPTH + 1] == 0
        deltas = [r for r in rows if r.encoding == blobs.ENCODING_DELTA]
        assert all(len(r.data) < 200 for r in deltas)  # a delta costs what it adds
        for i, data in enumerate(versions):
            art = Store.get_artifact(s, "c1", f"analysis/investigation/{i + 1:04d}/context.json",
                                     cache=blobs.ByteCache())
            assert art is not None and art.data == data
            assert art.sha256 == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("backend", BACKENDS, indirect=["backend"])
def test_a_stale_lineage_head_changes_compression_never_bytes(backend: str) -> None:
    """The process remembers each kind's newest blob (``blobs._Heads``): one remembered
    from a rolled-back transaction, one whose blob is gone (a restored database) or one
    that another store wrote past, still gives exact bytes and bounded chains."""
    store = Store(backend)
    store.create_schema()
    path = "analysis/investigation/{:04d}/context.json"
    body = b'{"e":[' + b",".join(b'"%d"' % i for i in range(300)) + b"]}"
    versions = [body + b"%d" % i for i in range(8)]
    with store.session() as s:
        Store.put_artifact(s, "c", path.format(1), versions[1])
    with pytest.raises(RuntimeError), store.session() as s:  # remembered, then rolled back
        Store.put_artifact(s, "c", path.format(2), versions[2])
        raise RuntimeError("rolled back")
    with store.session() as s:  # its delta base never committed: asks the store instead
        Store.put_artifact(s, "c", path.format(2), versions[3])
        Store.put_artifact(s, "c", path.format(3), versions[4])
    # The remembered head of step 3 names a blob whose chain is full: a keyframe follows.
    heads = blobs._HEADS.of(store.engine)
    step, sha, _ = heads[("c", blobs.kind_of(path.format(3)))]
    heads[("c", blobs.kind_of(path.format(3)))] = (step, sha, blobs.MAX_DELTA_DEPTH)
    with store.session() as s:
        Store.put_artifact(s, "c", path.format(4), versions[5])
    # A head remembered for a blob the store no longer has (inserted, not committed).
    heads[("c", blobs.kind_of(path.format(4)))] = (4, "f" * 64, 0)
    blobs.CACHE.put("f" * 64, versions[0])
    with store.session() as s:
        Store.put_artifact(s, "c", path.format(5), versions[6])
    with store.session() as s:
        rows = {r.sha256: r for r in s.exec(select(Blob)).all()}
        for seq, data in ((1, versions[1]), (2, versions[3]), (3, versions[4]),
                          (4, versions[5]), (5, versions[6])):
            art = Store.get_artifact(s, "c", path.format(seq), cache=blobs.ByteCache())
            assert art is not None and art.data == data
            row = rows[hashlib.sha256(data).hexdigest()]
            assert row.base_sha256 is None or row.base_sha256 in rows
        assert rows[hashlib.sha256(versions[5]).hexdigest()].depth == 0  # the keyframe
        assert hashlib.sha256(versions[2]).hexdigest() not in rows
        later = rows[hashlib.sha256(versions[6]).hexdigest()]
        assert later.base_sha256 == hashlib.sha256(versions[5]).hexdigest()
        assert later.depth == 1


@pytest.mark.parametrize("backend", BACKENDS, indirect=["backend"])
def test_a_new_artifact_finds_its_base_without_a_statement_of_its_own(backend: str) -> None:
    """A process that did not write the previous artifact of a kind (another worker
    process did) stores the next one as a delta of it: on PostgreSQL the artifact insert
    returns the lineage head, so the artifact and its blob cost two statements."""
    store = Store(backend)
    store.create_schema()
    path = "analysis/investigation/{:04d}/context.json"
    body = b'{"e":[' + b",".join(b'"%d"' % i for i in range(300)) + b"]}"
    with store.session() as s:
        Store.put_artifact(s, "c", path.format(1), body + b"1")
    blobs._HEADS.of(store.engine).clear()  # as in a process that meets the case now
    statements: list[str] = []

    def seen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement)

    sa.event.listen(store.engine, "before_cursor_execute", seen)
    try:
        with store.session() as s:
            Store.put_artifact(s, "c", path.format(2), body + b"2")
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", seen)
    written = [st.split("(")[0].split("\n")[0].strip() for st in statements]
    if store.engine.dialect.name == "postgresql":
        assert written == ["INSERT INTO artifact", "INSERT INTO blob"]
    else:  # SQLite: no round trip to save; the head is read apart
        assert written == ["INSERT INTO artifact", "SELECT artifact.sha256, blob.depth",
                           "INSERT INTO blob"]
    with store.session() as s:
        row = s.exec(select(Blob).where(
            Blob.sha256 == hashlib.sha256(body + b"2").hexdigest())).one()
        art = Store.get_artifact(s, "c", path.format(2), cache=blobs.ByteCache())
    assert row.base_sha256 == hashlib.sha256(body + b"1").hexdigest() and row.depth == 1
    assert art is not None and art.data == body + b"2"


@pytest.mark.parametrize("backend", BACKENDS, indirect=["backend"])
def test_an_artifact_that_follows_its_remembered_head_costs_one_statement(backend: str) -> None:
    """The usual step (decision 138): the process stored the previous artifact of the kind,
    so the next one's blob is a delta worked out before any statement; on PostgreSQL the
    row and its blob go in one statement. Storing the same bytes at the path again
    changes nothing; other bytes are refused, and their blob is not stored either."""
    store = Store(backend)
    store.create_schema()
    path = "analysis/investigation/{:04d}/context.json"
    # Bytes no other test stored: the process's byte cache spans stores (this process
    # has seen bytes -> they may be stored: the store is asked first).
    body = b'{"e":[' + b",".join(b'"%d"' % i for i in range(300)) + b"]}" \
        + backend.encode()
    with store.session() as s:
        Store.put_artifact(s, "c", path.format(1), body + b"1")
    statements: list[str] = []

    def seen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement.split("(")[0].split("\n")[0].strip())

    sa.event.listen(store.engine, "before_cursor_execute", seen)
    try:
        with store.session() as s:
            Store.put_artifact(s, "c", path.format(2), body + b"2")
        if store.engine.dialect.name == "postgresql":
            assert statements == ["WITH new_artifact AS"]
        else:  # SQLite: no round trip to save
            assert statements == ["INSERT INTO artifact", "INSERT INTO blob"]
        with store.session() as s:  # the same bytes again: nothing changes
            Store.put_artifact(s, "c", path.format(2), body + b"2")
        with pytest.raises(StoreError) as refused, store.session() as s:
            Store.put_artifact(s, "c", path.format(2), body + b"other")
        assert refused.value.code == "STORE_ARTIFACT_CONFLICT"
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", seen)
    with store.session() as s:
        stored = {r.sha256: r for r in s.exec(select(Blob)).all()}
        art = Store.get_artifact(s, "c", path.format(2), cache=blobs.ByteCache())
    assert set(stored) == {hashlib.sha256(body + b"1").hexdigest(),
                           hashlib.sha256(body + b"2").hexdigest()}
    row = stored[hashlib.sha256(body + b"2").hexdigest()]
    assert row.base_sha256 == hashlib.sha256(body + b"1").hexdigest() and row.depth == 1
    assert art is not None and art.data == body + b"2"


@pytest.fixture
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return _url(request, tmp_path, "a")


@pytest.mark.parametrize("backend", BACKENDS, indirect=["backend"])
def test_damaged_bytes_are_never_returned(backend: str) -> None:
    store = Store(backend)
    store.create_schema()
    with store.session() as s:
        sha = Store.put_artifact(s, "c", "analysis/investigation/0001/state.json", b"{}" * 50)
    with store.engine.begin() as conn:
        guards.drop_guards(conn)
        conn.execute(update(Blob).where(col(Blob.sha256) == sha)
                     .values(data=blobs.compress(b"[]" * 50)))
    with pytest.raises(StoreError) as err, store.session() as s:
        Store.get_artifact(s, "c", "analysis/investigation/0001/state.json",
                           cache=blobs.ByteCache())
    assert err.value.code == "STORE_ARTIFACT_CORRUPT"


# -- guards --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS, indirect=["backend"])
def test_every_guard_exists_after_the_migrations(backend: str) -> None:
    store = Store(backend)
    store.create_schema()
    with store.engine.connect() as conn:
        assert guards.guard_names(conn) == guards.expected_guard_names(conn.dialect.name)


@pytest.mark.parametrize("backend", BACKENDS, indirect=["backend"])
def test_a_closed_model_attempt_is_refused_and_a_sent_one_closes_once(
        backend: str, tmp_path: Path) -> None:
    """A hostile trial changed an attempt's token counts, status and cost, which status
    and the report sum, without dropping any guard (migration 0013_attempt_guard)."""
    from investigation.store.models import LLMAttempt

    case = make_case(tmp_path / "c", database_url=backend)
    _run(case)
    store = case.store
    refused_by_store(store, update(LLMAttempt).values(prompt_tokens=1_000_000))
    refused_by_store(store, update(LLMAttempt).values(status="failed"))
    refused_by_store(store, update(LLMAttempt).values(cost_micros=999_999_999))
    refused_by_store(store, delete(LLMAttempt))
    with store.session() as s:
        first = s.exec(select(LLMAttempt).order_by(col(LLMAttempt.id))).first()
        assert first is not None
        s.add(LLMAttempt(operation_id=first.operation_id, attempt=99, provider="p",
                         request_path="r", request_sha256="s"))  # sent: open
    with store.session() as s:  # closed once, as the gateway closes it
        s.execute(update(LLMAttempt).where(col(LLMAttempt.attempt) == 99)
                  .values(status="failed", error_code="X", finished_at=first.started_at))
    refused_by_store(store, update(LLMAttempt).where(col(LLMAttempt.attempt) == 99)
                     .values(error_code="Y"))
    with store.session() as s:  # an open attempt's request is what was sent: fixed
        s.add(LLMAttempt(operation_id=first.operation_id, attempt=98, provider="p",
                         request_path="r", request_sha256="s"))
    refused_by_store(store, update(LLMAttempt).where(col(LLMAttempt.attempt) == 98)
                     .values(request_path="other"))


@pytest.mark.parametrize("backend", BACKENDS, indirect=["backend"])
def test_published_rows_are_refused_and_open_ones_change_once(backend: str,
                                                              tmp_path: Path) -> None:
    case = make_case(tmp_path / "c", database_url=backend)
    _run(case)
    store = case.store
    cid = case.case_id
    for table in (Artifact, Blob, Checkpoint, StageRun, LedgerEntry):
        refused_by_store(store, delete(table))
    refused_by_store(store, update(Artifact).values(sha256="0" * 64))
    refused_by_store(store, update(Checkpoint).values(outcome="COMPLETED"))
    refused_by_store(store, update(StageRun).values(output_json="{}"))
    refused_by_store(store, update(RevisionRecord).values(policy_json="{}"))  # frozen
    refused_by_store(store, update(Evidence).where(col(Evidence.evidence_id) == "E1")
                     .values(refund_units=0))  # assessed
    refused_by_store(store, update(Evidence).values(findings_json="[]"))
    refused_by_store(store, update(Question).values(status="open"))  # resolved
    refused_by_store(store, delete(Evidence))
    if store.engine.dialect.name == "postgresql":
        refused_by_store(store, text("TRUNCATE checkpoint"))
    else:  # a REPLACE deletes the row it replaces: the guards see that deletion
        refused_by_store(store, text(
            "INSERT OR REPLACE INTO checkpoint SELECT * FROM checkpoint LIMIT 1"))
        refused_by_store(store, text(
            "INSERT OR REPLACE INTO evidence SELECT * FROM evidence LIMIT 1"))
    # What the engine itself does is allowed: an open record is assessed once, an open
    # question resolved once, a revision's policy frozen once.
    with store.session() as s:
        s.add(Evidence(case_id=cid, revision=2, step_seq=99, ordinal=99, evidence_id="E99",
                       hypothesis_id=1, operation="db.tables", arguments_json="{}",
                       findings_json="[]", item_keys_json="[]", warnings_json="[]",
                       fingerprint="f", item_count=0, new_item_count=0, cost_units=1,
                       artifact_path="p", artifact_sha256="s"))
        s.add(Question(case_id=cid, revision=2, ordinal=99, question_id="Q99",
                       hypothesis_id=1, text="?", created_step=99))
        s.add(RevisionRecord(case_id=cid, revision=2, interpretation_json="{}",
                             hypotheses_sha256="h"))
    with store.session() as s:
        s.execute(update(Evidence).where(col(Evidence.evidence_id) == "E99")
                  .values(assessed=True, assessment_score=50, refund_units=0))
        s.execute(update(Question).where(col(Question.question_id) == "Q99")
                  .values(status="resolved", resolved_step=100))
        s.execute(update(RevisionRecord).where(col(RevisionRecord.revision) == 2)
                  .values(policy_json="{}", policy_sha256="x"))
    refused_by_store(store, update(Evidence).where(col(Evidence.evidence_id) == "E99")
                     .values(assessed=False))


def test_verify_cli_reports_an_intact_case_and_the_first_difference(tmp_path: Path,
                                                                     monkeypatch: Any) -> None:
    from workers.cli import app

    case = make_case(tmp_path / "c")
    _run(case)
    monkeypatch.setenv("INVESTIGATE_DATABASE_URL", case.store.url)
    runner = CliRunner()
    ok = runner.invoke(app, ["verify", case.case_id, "--json"])
    assert ok.exit_code == 0, ok.output
    assert '"checkpoints": 5' in ok.output and '"live_rows": "checked"' in ok.output
    accounts = json.loads(ok.output)["budget_accounts"]
    assert accounts == 2
    # The plain line says every check --json reports, the ledgers too (a reader's trial).
    plain = runner.invoke(app, ["verify", case.case_id])
    assert plain.exit_code == 0, plain.output
    assert "live rows checked, the whole ledger of 2 budget accounts read" in \
        " ".join(plain.output.split())
    listed = runner.invoke(app, ["cases"])  # times in UTC, said so
    assert listed.exit_code == 0 and re.search(r"\d{2}:\d{2}:\d{2}Z", listed.output), \
        listed.output
    with case.store.engine.begin() as conn:
        guards.drop_guards(conn)
        conn.execute(update(StageRun).where(col(StageRun.step_seq) == 2,
                                            col(StageRun.stage) == "build_context")
                     .values(output_json='{"finalize":false}'))
    bad = runner.invoke(app, ["verify", case.case_id])
    assert bad.exit_code == 2
    assert "CHECKPOINT_INVALID" in bad.output and "checkpoint 2" in bad.output


# -- migration -----------------------------------------------------------------------------


def _copy_to_0005(source: Store, target_url: str) -> Store:
    """A store at migration 0005 holding ``source``'s rows, artifact bytes inline (the
    layout before issue 13)."""
    target = Store(target_url)
    upgrade(target.engine, "0005_case_session")
    meta = sa.MetaData()
    meta.reflect(target.engine)
    arts: dict[tuple[str, str], bytes] = {}
    with source.session() as s:
        for case_id in s.exec(select(Artifact.case_id).distinct()).all():
            for a in Store.artifacts(s, case_id):
                arts[(case_id, a.path)] = a.data
    notes: dict[tuple[str, int, int], list[dict[str, object]]] = {}
    with source.session() as s:
        for n in s.exec(select(HypothesisNote).order_by(col(HypothesisNote.step_seq))).all():
            notes.setdefault((n.case_id, n.revision, n.hypothesis_id), []).append(
                {"note": n.note, "step_seq": n.step_seq})
    with source.engine.connect() as src, target.engine.begin() as dst:
        for table in meta.sorted_tables:
            if table.name == "alembic_version":
                continue
            columns = [c for c in table.columns
                       if not (table.name == "artifact" and c.name == "data")
                       and not (table.name == "budget_account" and c.name == "notes_json")]
            rows = [dict(r._mapping) for r in src.execute(sa.select(*columns))]
            if table.name == "artifact":
                for r in rows:
                    r["data"] = arts[(r["case_id"], r["path"])]
            if table.name == "budget_account":  # notes were a JSON list on the account
                for r in rows:
                    r["notes_json"] = canonical_json(notes.get(
                        (r["case_id"], r["revision"], r["hypothesis_id"]), [])).decode()
            if rows:
                dst.execute(table.insert(), rows)
        if target.engine.dialect.name == "postgresql":
            for table in meta.sorted_tables:
                if "id" in table.columns and isinstance(table.c.id.type, sa.Integer):
                    dst.exec_driver_sql(
                        f"SELECT setval(pg_get_serial_sequence('\"{table.name}\"', 'id'), "
                        f"coalesce((SELECT max(id) FROM \"{table.name}\"), 1))")
    return target


@pytest.mark.parametrize("backend", BACKENDS, indirect=["backend"])
def test_migration_moves_every_byte_and_the_case_continues_as_it_would_have(
        backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    reference = make_case(tmp_path / "ref")
    _run(reference)
    expected = _tree(reference.store, reference.case_id, tmp_path / "ref-out")

    halfway = make_case(tmp_path / "half", database_url=backend)
    _run(halfway, steps=3)
    before = _tree(halfway.store, halfway.case_id, tmp_path / "half-out")
    with halfway.store.session() as s:
        digests = s.exec(select(Checkpoint.archive_digest).order_by(
            col(Checkpoint.seq))).all()
    other_url = (str(request.getfixturevalue("second_postgres_url"))
                 if backend.startswith("postgresql") else f"sqlite:///{tmp_path / 'old.db'}")
    old = _copy_to_0005(halfway.store, other_url)
    with old.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM artifact WHERE length(data) > 0") \
            .scalar_one() == len(before) - 1  # every file but manifest.json, inline
    old.create_schema()  # 0006: bytes to blobs, digests, guards
    with old.session() as s:
        assert s.exec(select(Checkpoint.archive_digest).order_by(
            col(Checkpoint.seq))).all() == digests
        encodings = {b.encoding for b in s.exec(select(Blob)).all()}
        assert encodings == {blobs.ENCODING_WHOLE, blobs.ENCODING_DELTA}
        assert checkpoints.verify_chain(s, halfway.case_id) == 3
    assert _tree(old, halfway.case_id, tmp_path / "migrated-out") == before
    assert operations.verify(old, halfway.case_id)["live_rows"] == "checked"
    with old.engine.connect() as conn:
        assert guards.guard_names(conn) == guards.expected_guard_names(conn.dialect.name)
    migrated = Case(old, halfway.case_id, halfway.package, halfway.replies_path,
                    halfway.providers_path, halfway.root)
    _run(migrated)
    assert _tree(old, halfway.case_id, tmp_path / "done-out") == expected


@pytest.mark.parametrize("backend", BACKENDS, indirect=["backend"])
def test_downgrade_puts_the_bytes_back_inline_and_upgrading_again_changes_nothing(
        backend: str, tmp_path: Path) -> None:
    from alembic import command
    from alembic.config import Config

    from investigation.store.migrate import MIGRATIONS

    case = make_case(tmp_path / "c", database_url=backend)
    _run(case)
    before = _tree(case.store, case.case_id, tmp_path / "before")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with case.store.engine.connect() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0005_case_session")
        conn.commit()
    with case.store.engine.connect() as conn:
        rows = conn.execute(text("SELECT sha256, data FROM artifact")).all()
        assert rows and all(hashlib.sha256(bytes(d)).hexdigest() == sha for sha, d in rows)
        assert guards.guard_names(conn) == set()
    case.store.dispose()
    again = Store(case.store.url)
    again.create_schema()
    assert _tree(again, case.case_id, tmp_path / "after") == before


@pytest.mark.parametrize("backend", BACKENDS, indirect=["backend"])
def test_a_frame_that_declares_more_than_its_blob_is_refused_before_it_is_decoded(
        backend: str) -> None:
    """A blob's frame replaced by one whose header declares 3 GiB (about 100 KB of zeros
    compressed): zstandard would allocate the declared size before decoding (a MemoryError
    in a hostile-input trial's verify and export); the frame is refused as corrupt by the
    size the blob row records, and nothing that size is allocated."""
    import io

    import zstandard

    store = Store(backend)
    store.create_schema()
    with store.session() as s:
        sha = Store.put_artifact(s, "c", "analysis/investigation/0001/result.json", b"{}" * 50)
    forged = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(forged, size=3 << 30, closefd=False) as w:
        for _ in range(3 << 10):
            w.write(bytes(1 << 20))
    with store.engine.begin() as conn:
        guards.drop_guards(conn)
        conn.execute(update(Blob).where(col(Blob.sha256) == sha)
                     .values(data=forged.getvalue(), encoding=blobs.ENCODING_WHOLE,
                             base_sha256=None))
    with pytest.raises(StoreError) as err, store.session() as s:
        Store.get_artifact(s, "c", "analysis/investigation/0001/result.json",
                           cache=blobs.ByteCache())
    assert err.value.code == "STORE_ARTIFACT_CORRUPT"
    assert f"declares {3 << 30} bytes, the blob records 100" in err.value.message
    # A frame without a declared size is bounded by the record as well.
    with pytest.raises(zstandard.ZstdError):
        blobs.decompress(zstandard.ZstdCompressor(write_content_size=False).compress(
            b"x" * 1000), None, 999)
    assert blobs.decompress(zstandard.ZstdCompressor(write_content_size=False).compress(
        b"x" * 1000), None, 1000) == b"x" * 1000
