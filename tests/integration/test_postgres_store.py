"""The store on PostgreSQL: the same investigation, the same bytes, the same fencing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import column as sa_column
from sqlalchemy import table as sa_table
from sqlalchemy import text

from investigation.constants import COMPLETED
from investigation.errors import StaleStateError, StoreError
from investigation.loop.checkpoints import verify_chain
from investigation.loop.outcome import StepKey
from investigation.loop.stages import Stages
from investigation.operations import summary_bytes
from investigation.store.engine import Store, core, deferred
from tests.casekit import INTERPRETATION, make_case

pytestmark = pytest.mark.postgres


class Via:
    """How a test's Core statements run: on the session's own connection (SQLAlchemy
    executes them) or on ``core(session)`` (the driver's cursor executes a statement
    from its second execution, decision 134); both keep the transaction's pipeline."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.on_driver = 0

    def conn(self, session: Any) -> Any:
        return core(session) if self.name == "driver" else session.connection()

    def write(self, store: Store) -> Any:
        """A deferred insert into ``scratch``; on the driver's path it has run once (in a
        rolled-back transaction), so that every later execution is the driver's."""
        from sqlalchemy import event
        from sqlmodel import Session

        write = deferred(sa_table("scratch", sa_column("id")).insert())
        if self.name == "driver":
            with Session(store.engine) as s:
                core(s).execute(write, {"id": -1})
                s.rollback()
            event.listen(store.engine, "before_cursor_execute", self._seen)
        return write

    def _seen(self, _conn: Any, _cursor: Any, statement: str, _params: Any, context: Any,
              _many: bool) -> None:
        if context is None and statement.startswith("INSERT INTO scratch"):
            self.on_driver += 1

    def check(self) -> None:
        """On the driver's path, the writes did run on the driver."""
        assert self.name == "sqlalchemy" or self.on_driver > 0


@pytest.fixture(params=["sqlalchemy", "driver"])
def via(request: pytest.FixtureRequest) -> Via:
    return Via(request.param)


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


def _entry_markers(stages: Stages, key: StepKey, statement: object = "columns") -> list[str]:
    """The stage names a stage entry reads with the case lock (the engine's statement:
    ``"columns"`` for the checked columns, ``"whole_row"`` for the case row's ORM object,
    whose ``last_reason`` is then listed as ``row: ...``; or ``statement`` in its place),
    in a session of its own."""
    from sqlmodel import Session

    from investigation.loop import stagebase

    with Session(stages.store.engine) as s:
        if statement == "columns":
            _, markers = stages._lock_case_and_markers(s, key)
            names = [name for name, _ in markers]
        elif statement == "whole_row":
            row, markers = stages._lock_case_row_and_markers(s, key)
            names = [name for name, _ in markers] + [f"row: {row.last_reason}"]
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
    conn.execute(text('UPDATE "case" SET last_reason = \'held\' WHERE id = :id'),
                 {"id": key.case_id})
    conn.execute(text("INSERT INTO stage_run (case_id, revision, step_seq, stage, output_json, "
                      "completed_at) VALUES (:case_id, :revision, :step_seq, :stage, '{}', "
                      "now())"), {**key.to_dict(), "stage": stage})
    return conn, tx


@pytest.mark.parametrize("entry", ["columns", "whole_row", "one_statement"])
def test_a_stage_entry_that_waited_for_the_case_lock_sees_the_holders_marker(
        tmp_path: Path, postgres_url: str, entry: str) -> None:
    """The entry's lock and markers are one round trip (the functions of migrations 0010
    and 0011: the checked columns, or the whole row of a stage that changes it), and
    still read the markers after the lock is granted: a runner that waited for the holder
    sees the marker the holder committed, and the row as the holder left it. The same
    read as one locking statement (the joined query SQLite runs, ``FOR UPDATE`` of the
    case row) misses the marker on PostgreSQL: its snapshot predates the holder's
    commit."""
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
            stages, key, one_statement if entry == "one_statement" else entry)),
            daemon=True)
        waiting.start()
        time.sleep(0.5)  # the entry waits for the row lock
        assert waiting.is_alive() and not seen
    finally:
        tx.commit()  # type: ignore[attr-defined]
        conn.close()  # type: ignore[attr-defined]
    waiting.join(30)
    if entry == "whole_row":
        assert seen == [["build_context", "llm_call", "row: held"]]
    elif entry == "columns":
        assert seen == [["build_context", "llm_call"]]
    else:
        assert seen == [["build_context"]]  # why PostgreSQL needs the functions


def test_the_case_entry_function_returns_every_column_of_the_case_table(
        tmp_path: Path, postgres_url: str) -> None:
    """Migration 0011's function lists the case table's columns itself: a migration that
    changes the table must replace it, or a case stage's entry would load a row without
    the new column (decision 141)."""
    from investigation.store.models import CaseRecord

    case = make_case(tmp_path / "columns", database_url=postgres_url)
    with case.store.engine.connect() as conn:
        table = [r[0] for r in conn.execute(text(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = "
            "current_schema() AND table_name = 'case' ORDER BY ordinal_position"))]
        result = conn.execute(text(
            "SELECT * FROM investigation_case_row_and_markers(:id, 1, 1)"),
            {"id": case.case_id})
        returned = list(result.keys())
        rows = result.all()
    assert sorted(returned) == sorted([*table, "stage", "output_json"])
    assert sorted(table) == sorted(c.name for c in CaseRecord.__table__.c)  # type: ignore[attr-defined]
    assert len(rows) == 1 and rows[0]._mapping["id"] == case.case_id
    assert rows[0]._mapping["stage"] is None  # no marker yet: one row of NULL markers


def _commit_settings(case: object, env: object, monkeypatch: pytest.MonkeyPatch
                     ) -> list[tuple[str | None, str, tuple[str, ...]]]:
    """Run the case to its end with ``env``; for every transaction that wrote, the stage
    running, ``synchronous_commit`` as the transaction commits, and its write statements."""
    from sqlalchemy import event

    from investigation.loop.investigator import Investigator
    from investigation.loop.stagebase import StageFramework

    engine = case.store.engine  # type: ignore[attr-defined]
    current: dict[str, str | None] = {"stage": None}
    writes: list[str] = []
    seen: list[tuple[str | None, str, tuple[str, ...]]] = []
    run = StageFramework.run

    def tagged(self: StageFramework, stage: str, key: StepKey, delivery: object = None) -> object:
        current["stage"] = stage
        try:
            return run(self, stage, key, delivery)  # type: ignore[arg-type]
        finally:
            current["stage"] = None

    def begin(_conn: object) -> None:
        writes.clear()

    def statement(_conn: object, _cursor: object, text: str, *_: object) -> None:
        if text.lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE")):
            writes.append(" ".join(text.split()[:3]))

    def commit(conn: object) -> None:
        if writes:
            raw = conn.connection.dbapi_connection  # type: ignore[attr-defined]
            setting = raw.execute("SHOW synchronous_commit").fetchone()[0]
            seen.append((current["stage"], setting, tuple(writes)))

    monkeypatch.setattr(StageFramework, "run", tagged)
    event.listen(engine, "begin", begin)
    event.listen(engine, "before_cursor_execute", statement)
    event.listen(engine, "commit", commit)
    try:
        assert Investigator(env).run(case.case_id,  # type: ignore[attr-defined,arg-type]
                                     max_steps=50).outcome == COMPLETED
    finally:
        event.remove(engine, "commit", commit)
        event.remove(engine, "before_cursor_execute", statement)
        event.remove(engine, "begin", begin)
    return seen


def _records_outside_input(stage: str | None, writes: tuple[str, ...]) -> bool:
    """A model attempt (request before sending, answer after) or a query's result."""
    return any("llm_attempt" in w for w in writes) or (
        stage == "execute_tool" and any(w.startswith("INSERT INTO artifact") for w in writes))


def test_derived_stage_transactions_commit_without_waiting_for_the_disk(
        tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decision 126: a stage transaction that writes only what the engine can derive again
    commits with synchronous_commit off; model attempts and query results wait for the
    disk; ``async_commit=False`` makes every commit wait."""
    import dataclasses

    case = make_case(tmp_path / "async", database_url=postgres_url)
    seen = _commit_settings(case, case.env(), monkeypatch)
    outside = [(stage, setting) for stage, setting, writes in seen
               if _records_outside_input(stage, writes)]
    derived = [(stage, setting) for stage, setting, writes in seen
               if stage is not None and not _records_outside_input(stage, writes)]
    # Four model calls (two attempt transactions each) and three query results.
    assert len(outside) >= 4 * 2 + 3 and {s for _, s in outside} == {"on"}
    assert {stage for stage, _ in derived} == {
        "build_context", "llm_call", "validate", "persist_plan", "settle_reserve",
        "execute_tool", "record_evidence", "publish"}
    assert {s for _, s in derived} == {"off"}, [d for d in seen if d[1] == "on" and not _records_outside_input(d[0], d[2])]

    # Another case in the same store (another interpretation, another id).
    durable = make_case(tmp_path / "sync", database_url=postgres_url,
                        interpretation={**INTERPRETATION, "note": "durable"})
    seen = _commit_settings(durable, dataclasses.replace(durable.env(), async_commit=False),
                            monkeypatch)
    assert len(seen) > 40 and {setting for _, setting, _ in seen} == {"on"}


# -- decision 128: a transaction's BEGIN rides with its first statement -------------------


@contextmanager
def _traced(store: Store, trace: Path) -> Iterator[None]:
    """libpq's protocol trace of every connection ``store`` checks out, into ``trace``.
    psycopg prepares none of their statements meanwhile, so that every statement sent
    shows its text (a prepared one is sent by name)."""
    from sqlalchemy import event

    out = trace.open("w")

    def on_checkout(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        record.info["prepare_threshold"] = dbapi_conn.prepare_threshold
        dbapi_conn.prepare_threshold = None
        dbapi_conn.pgconn.trace(out.fileno())

    def on_checkin(dbapi_conn: Any, record: Any) -> None:
        if dbapi_conn is not None:
            dbapi_conn.pgconn.untrace()
            dbapi_conn.prepare_threshold = record.info.pop("prepare_threshold", 5)

    event.listen(store.engine, "checkout", on_checkout)
    event.listen(store.engine, "checkin", on_checkin)
    try:
        yield
    finally:
        event.remove(store.engine, "checkout", on_checkout)
        event.remove(store.engine, "checkin", on_checkin)
        out.close()


def _waits(trace: Path) -> list[str]:
    """What the client sent before each wait for the server: the statements since the
    previous wait (a ``Sync`` of the extended protocol or a simple ``Query`` ends one)."""
    waits: list[str] = []
    sent: list[str] = []
    for line in trace.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) < 4 or parts[1] != "F":
            continue
        if parts[3] == "Parse":
            sent.append(parts[4].split('"')[3])
        elif parts[3] == "Query":
            waits.append(parts[4].split('"', 1)[1].rsplit('"', 1)[0])
        elif parts[3] == "Sync":
            waits.append(" + ".join(sent))
            sent = []
    return waits


@pytest.fixture
def scratch(postgres_url: str) -> Iterator[Store]:
    store = Store(postgres_url)
    with store.engine.begin() as conn:
        conn.execute(text("CREATE TABLE scratch (id integer PRIMARY KEY)"))
    try:
        yield store
    finally:
        store.dispose()


def _ids(store: Store) -> list[int]:
    with store.session() as s:
        return [int(r[0]) for r in s.execute(text("SELECT id FROM scratch ORDER BY id"))]


def test_a_transaction_opens_with_its_first_statement_in_one_round_trip(
        scratch: Store, tmp_path: Path) -> None:
    trace = tmp_path / "trace.txt"
    with _traced(scratch, trace):
        with scratch.session() as s:
            first = s.execute(text("SELECT txid_current(), current_setting("
                                   "'transaction_isolation')")).one()
            second = s.execute(text("INSERT INTO scratch VALUES (1) RETURNING txid_current()"
                                    )).scalar()
        with scratch.session() as s:
            third = s.execute(text("SELECT txid_current()")).scalar()
        scratch.read_one(text("SELECT count(*) FROM scratch"), {})
    # One transaction for both statements of a session, at the server's default isolation.
    assert first[0] == second and first[1] == "read committed" and third != second
    # BEGIN went out with each session's first statement; the second statement and the
    # COMMIT cost a round trip each; read_one (autocommit) sent no BEGIN.
    assert _waits(trace) == [
        "BEGIN + SELECT txid_current(), current_setting('transaction_isolation')",
        "INSERT INTO scratch VALUES (1) RETURNING txid_current()",
        "COMMIT",
        "BEGIN + SELECT txid_current()",
        "COMMIT",
        "SELECT count(*) FROM scratch",
    ]


def test_a_failed_transaction_keeps_nothing_whatever_its_first_statement(
        scratch: Store) -> None:
    from sqlalchemy.exc import IntegrityError

    scratch_table = sa_table("scratch", sa_column("id"))
    with pytest.raises(RuntimeError), scratch.session() as s:
        s.execute(text("INSERT INTO scratch VALUES (1)"))
        s.execute(text("INSERT INTO scratch VALUES (2)"))
        raise RuntimeError("the stage failed")
    with pytest.raises(RuntimeError), scratch.session() as s:  # first: an executemany
        s.connection().execute(scratch_table.insert(), [{"id": 3}, {"id": 4}])
        raise RuntimeError("the stage failed")
    with pytest.raises(RuntimeError), scratch.session() as s:  # first: no parameters
        s.connection().exec_driver_sql("INSERT INTO scratch VALUES (5)")
        raise RuntimeError("the stage failed")
    assert _ids(scratch) == []
    with scratch.session() as s:
        s.execute(text("INSERT INTO scratch VALUES (6)"))
    # The first statement fails: its error is the statement's, and the store goes on.
    with pytest.raises(IntegrityError, match="duplicate key"), scratch.session() as s:
        s.execute(text("INSERT INTO scratch VALUES (6)"))
    with scratch.session() as s:
        s.execute(text("INSERT INTO scratch VALUES (7)"))
    assert _ids(scratch) == [6, 7]


def test_a_statement_outside_its_transaction_is_refused(scratch: Store, via: Via) -> None:
    """A transaction that ended behind SQLAlchemy's back (here an explicit COMMIT) would
    run the rest of the session statement by statement: refused, nothing written, on
    SQLAlchemy's path and on the driver's."""
    write = via.write(scratch)
    for later in (lambda s: s.execute(text("INSERT INTO scratch VALUES (2)")),
                  lambda s: via.conn(s).execute(write, {"id": 2})):
        with pytest.raises(StoreError) as caught, scratch.session() as s:
            s.execute(text("INSERT INTO scratch VALUES (1) ON CONFLICT DO NOTHING"))
            s.connection().exec_driver_sql("COMMIT")
            later(s)
        assert caught.value.code == "STORE_TRANSACTION_NOT_OPEN"
        assert _ids(scratch) == [1]  # the first insert was committed by the explicit COMMIT
    via.check()


def test_transactions_keep_the_servers_default_isolation(postgres_url: str) -> None:
    """An operator's ``default_transaction_isolation`` (here SERIALIZABLE, which the
    fencing tests run under too) still applies: the engine's BEGIN names no level."""
    store = Store(postgres_url + "%20-cdefault_transaction_isolation%3Dserializable")
    try:
        with store.session() as s:
            level = s.execute(text("SELECT current_setting('transaction_isolation')")).scalar()
        assert level == "serializable"
    finally:
        store.dispose()


def test_a_lost_connection_raises_its_own_error_and_the_pool_recovers(scratch: Store,
                                                                     via: Via) -> None:
    """A backend gone between two transactions (a server restart, a killed session):
    the next transaction fails with the driver's OperationalError, which the worker
    retries as a store outage (not a PendingRollbackError raised while rolling back),
    and the one after it gets a new connection; so when the failing statement is one
    the driver's cursor runs (decision 134)."""
    from sqlalchemy.exc import OperationalError

    write = via.write(scratch)
    with scratch.session() as s:
        pid = s.execute(text("SELECT pg_backend_pid()")).scalar()
    admin = Store(scratch.url)
    try:
        with admin.engine.begin() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    finally:
        admin.dispose()
    with pytest.raises(OperationalError) as caught, scratch.session() as s:
        via.conn(s).execute(write, {"id": 1})  # the transaction's first: sent at once
    # The statement's own error, on a connection invalidated there (not an error of the
    # rollback that closing the session would then try on the dead connection).
    assert caught.value.connection_invalidated
    assert (caught.value.statement or "").startswith("INSERT INTO scratch")
    with scratch.session() as s:
        via.conn(s).execute(write, {"id": 2})
    assert _ids(scratch) == [2]
    via.check()


# -- decision 130: a deferred write goes out with what follows it -------------------------


def test_a_deferred_write_goes_out_with_the_commit_or_the_next_statement(
        scratch: Store, tmp_path: Path, via: Via) -> None:
    write = via.write(scratch)
    trace = tmp_path / "trace.txt"
    with _traced(scratch, trace):
        with scratch.session() as s:
            s.execute(text("SELECT 1"))
            via.conn(s).execute(write, {"id": 1})
        with scratch.session() as s:
            s.execute(text("SELECT 1"))
            via.conn(s).execute(write, {"id": 2})
            via.conn(s).execute(write, {"id": 3})
            # In order, before the statement they went out with.
            assert s.execute(text("SELECT count(*) FROM scratch")).scalar() == 3
    insert = "INSERT INTO scratch (id) VALUES ($1)"
    assert _waits(trace) == [
        "BEGIN + SELECT 1",
        f"{insert} + COMMIT",
        "BEGIN + SELECT 1",
        f"{insert} + {insert} + SELECT count(*) FROM scratch",
        "COMMIT",
    ]
    assert _ids(scratch) == [1, 2, 3]
    via.check()


def test_a_deferred_write_that_fails_fails_its_commit_and_keeps_nothing(
        scratch: Store, via: Via) -> None:
    """A unique violation surfaces at the commit as SQLAlchemy's IntegrityError (a lost
    race for the stage framework); the transaction keeps nothing, the store goes on."""
    from sqlalchemy.exc import IntegrityError

    from investigation.store.engine import is_lost_race

    write = via.write(scratch)
    with scratch.session() as s:
        s.execute(text("INSERT INTO scratch VALUES (1)"))
    with pytest.raises(IntegrityError) as caught, scratch.session() as s:
        s.execute(text("INSERT INTO scratch VALUES (2)"))
        via.conn(s).execute(write, {"id": 1})  # not sent yet: no error here
    assert is_lost_race(caught.value)
    assert _ids(scratch) == [1]
    with scratch.session() as s:
        s.connection().execute(text("INSERT INTO scratch VALUES (3)"))
        via.conn(s).execute(write, {"id": 4})
    assert _ids(scratch) == [1, 3, 4]
    via.check()


def test_a_deferred_write_of_a_rolled_back_transaction_is_never_sent(
        scratch: Store, tmp_path: Path, via: Via) -> None:
    """Rolled back (an error in the stage) or returned to the pool unfinished: the write
    never reaches the server, nor joins the connection's next transaction."""
    from sqlmodel import Session

    write = via.write(scratch)
    trace = tmp_path / "trace.txt"
    with _traced(scratch, trace):
        with pytest.raises(RuntimeError), scratch.session() as s:
            s.execute(text("SELECT 1"))
            via.conn(s).execute(write, {"id": 1})
            raise RuntimeError("the stage failed")
        s = Session(scratch.engine)
        s.execute(text("SELECT 1"))
        via.conn(s).execute(write, {"id": 2})
        s.close()  # no commit: the pool resets the connection
        with scratch.session() as s:
            s.execute(text("INSERT INTO scratch VALUES (3)"))
    assert _ids(scratch) == [3]
    assert not any("INSERT INTO scratch (id)" in wait for wait in _waits(trace))
    via.check()


def test_a_stage_marker_costs_no_round_trip_of_its_own(tmp_path: Path,
                                                       postgres_url: str) -> None:
    """Every stage transaction ends with its marker: it goes out with the COMMIT, or
    with the ORM's flush of the stage's changed rows that comes before the COMMIT. The
    plan row and the checkpoint row go out with what follows them too."""
    case = make_case(tmp_path / "markers", database_url=postgres_url)
    investigator = case.investigator()
    investigator.step(case.case_id)  # the first step opens the snapshot, the replay ...
    trace = tmp_path / "trace.txt"
    with _traced(case.store, trace):
        assert investigator.step(case.case_id).outcome == "PROGRESSED"
    marker = ("INSERT INTO stage_run (case_id, revision, step_seq, stage, output_json, "
              "completed_at) VALUES ($1::VARCHAR, $2::INTEGER, $3::INTEGER, $4::VARCHAR, "
              "$5::VARCHAR, $6::TIMESTAMP WITH TIME ZONE)")
    waits = _waits(trace)
    assert sum(w.count(marker) for w in waits) == 8  # one per stage
    assert not [w for w in waits if w.endswith(marker)]  # never sent alone or last
    assert sum(w.endswith(f"{marker} + COMMIT") for w in waits) >= 6
    for table in ("plan", "checkpoint"):
        sent = [w for w in waits if f"INSERT INTO {table} " in w]
        assert len(sent) == 1 and not sent[0].split(" + ")[-1].startswith(
            f"INSERT INTO {table} "), sent


def test_a_connection_lost_before_a_deferred_write_fails_the_commit_as_an_outage(
        scratch: Store, via: Via) -> None:
    """The backend dies while a write waits: the commit raises the driver's
    OperationalError on an invalidated connection (a worker retries it as a store
    outage), nothing is kept, and the next transaction gets a new connection."""
    from sqlalchemy.exc import OperationalError

    write = via.write(scratch)
    admin = Store(scratch.url)
    try:
        with pytest.raises(OperationalError) as caught, scratch.session() as s:
            pid = s.execute(text("SELECT pg_backend_pid()")).scalar()
            via.conn(s).execute(write, {"id": 1})
            with admin.engine.begin() as conn:
                conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    finally:
        admin.dispose()
    assert caught.value.connection_invalidated
    with scratch.session() as s:
        via.conn(s).execute(write, {"id": 2})
    assert _ids(scratch) == [2]
    via.check()


def test_a_failed_deferred_commit_leaves_the_pooled_connection_clean(scratch: Store,
                                                                    via: Via) -> None:
    """SQLAlchemy's own pattern (``commit()`` with no rollback after it fails): the next
    transaction on the same pooled connection is not inside the aborted one."""
    from sqlalchemy.exc import IntegrityError
    from sqlmodel import Session

    write = via.write(scratch)
    with scratch.session() as s:
        s.execute(text("INSERT INTO scratch VALUES (1)"))
    with pytest.raises(IntegrityError), Session(scratch.engine) as s:
        s.execute(text("SELECT 1"))
        via.conn(s).execute(write, {"id": 1})
        s.commit()
    with scratch.session() as s:
        s.execute(text("INSERT INTO scratch VALUES (2)"))
    assert _ids(scratch) == [1, 2]
    via.check()


def test_a_deferred_write_in_a_savepoint_or_in_autocommit_runs_at_once(
        scratch: Store, via: Via) -> None:
    """In a savepoint the write's error is raised inside it, which rolls back to the
    savepoint and lets the transaction go on; on an autocommit connection, where no
    commit would send it, it stands alone."""
    from sqlalchemy.exc import IntegrityError

    write = via.write(scratch)
    with scratch.session() as s:
        s.execute(text("INSERT INTO scratch VALUES (1)"))
    with scratch.session() as s:
        s.execute(text("INSERT INTO scratch VALUES (2)"))
        with pytest.raises(IntegrityError), s.begin_nested():
            via.conn(s).execute(write, {"id": 1})
        s.execute(text("INSERT INTO scratch VALUES (3)"))
    with scratch.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(write, {"id": 9})
    assert _ids(scratch) == [1, 2, 3, 9]
    via.check()


def test_a_steps_attempt_row_and_pointer_moves_wait_for_the_next_statement(
        tmp_path: Path, postgres_url: str) -> None:
    """Decision 139: a new model attempt's row and a manifest pointer's move cost no round
    trip of their own; each goes out in one exchange with what follows it (the attempt
    with the COMMIT that makes it durable before the request is sent)."""
    case = make_case(tmp_path / "traced", database_url=postgres_url)
    trace = tmp_path / "trace.txt"
    try:
        with _traced(case.store, trace):
            assert case.investigator().step(case.case_id).outcome == "PROGRESSED"
    finally:
        case.store.dispose()
    # Each wait lists the statements sent before it (a multi-line statement by its
    # first line: the pointer's is "WITH moved AS ...").
    sent = [wait.split(" + ") for wait in _waits(trace)]

    def followed(prefix: str) -> list[list[str]]:
        """The rest of the exchange after each statement starting with ``prefix``."""
        return [parts[i + 1:] for parts in sent
                for i, part in enumerate(parts) if part.startswith(prefix)]

    assert [rest[-1:] for rest in followed("INSERT INTO llm_attempt ")] == [["COMMIT"]]
    pointers = followed("WITH moved AS")
    assert pointers and all(rest for rest in pointers), sent


def test_a_postgres_scheme_url_opens_the_store(postgres_url: str) -> None:
    """`postgres://...` (libpq's spelling) is read as psycopg's: a new user's
    `INVESTIGATE_DATABASE_URL=postgres://...` failed with "Can't load plugin"."""
    spelled = "postgres://" + postgres_url.split("://", 1)[1]
    store = Store(spelled)
    try:
        assert store.engine.dialect.driver == "psycopg"
        with store.session() as s:
            assert s.execute(text("SELECT 1")).scalar_one() == 1
    finally:
        store.dispose()
