"""Engine factory and the ``Store`` facade over SQLModel sessions.

SQLite (WAL, busy timeout, foreign keys) is the embedded default; any SQLAlchemy
PostgreSQL URL (``postgresql+psycopg://...``) works the same way.
"""

from __future__ import annotations

import os
import sqlite3
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple, cast

from sqlalchemy import String, Table, bindparam, event, exists, func
from sqlalchemy import select as sa_select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError, IntegrityError, OperationalError
from sqlalchemy.pool import QueuePool
from sqlmodel import Session, col, create_engine, select

from investigation.errors import InvestigationError, StoreError
from investigation.store import blobs, direct, models
from investigation.store.models import Artifact, CaseRecord, ManifestPointer, RevisionRecord
from investigation.text_safety import escape_text

#: SQLite busy timeout: writers wait for each other instead of failing at once.
SQLITE_BUSY_TIMEOUT_MS = 30_000
#: Execution option of :meth:`Store.read_one`'s connection: no write lock on SQLite.
READ_ONE = "investigate_read_one"
#: How a SQLite writer waits for the write lock held by another connection: it polls
#: ``BEGIN IMMEDIATE`` after a pause that starts here and doubles up to
#: :data:`SQLITE_LOCK_POLL_MAX_S`, until :data:`SQLITE_BUSY_TIMEOUT_MS` has passed.
SQLITE_LOCK_POLL_FIRST_S = 0.0001
SQLITE_LOCK_POLL_MAX_S = 0.002
#: A pooled PostgreSQL connection idle for longer than this is pinged before it is used
#: (one round trip); one in steady use is not (a dead one fails its first statement and
#: the pool is replaced, as after any disconnect).
PG_PING_IDLE_S = 5.0


sha256_hex = blobs.sha256_hex


def table_of(model: Any) -> Table:
    """The Core table of a SQLModel table class."""
    return cast(Table, model.__table__)


def core(session: Session) -> Connection:
    """The connection of ``session``'s transaction, for Core statements on the tables the
    ORM never writes (``artifact``, ``blob``, ``stage_run``, ``checkpoint``,
    ``manifest_pointer``): no ORM result processing, no bulk-insert machinery, no
    autoflush (nothing of theirs is pending).

    On SQLite and on PostgreSQL (psycopg) it is a
    :class:`~investigation.store.direct.DirectConnection` over that connection: its
    ``execute`` runs a statement built once on the driver's cursor (decisions 132 and
    134), on PostgreSQL through the transaction's pipeline; any other attribute is the
    connection's."""
    return direct.session_connection(session)


_ART = table_of(Artifact).c
# Statements built once (building a statement costs more than running it on SQLite).
_ARTIFACT_ROW = sa_select(_ART.sha256, _ART.media_type, _ART.size_bytes, _ART.created_at) \
    .where(_ART.case_id == bindparam("case_id"), _ART.path == bindparam("path"))
_ARTIFACT_ROWS = sa_select(_ART.path, _ART.sha256, _ART.media_type, _ART.size_bytes,
                           _ART.created_at).where(
    _ART.case_id == bindparam("case_id"), _ART.path.in_(bindparam("paths", expanding=True)))
# A path holds one artifact for ever: a second write of it inserts nothing.
# On PostgreSQL the row also brings the lineage head its blob is stored against (one round
# trip fewer for each new artifact; the subqueries read the statement's snapshot, which
# does not hold the row being inserted).
_ARTIFACT_INSERTS = {
    "postgresql": pg_insert(table_of(Artifact)).on_conflict_do_nothing(
        index_elements=["case_id", "path"]).returning(_ART.id, *blobs.LINEAGE_HEAD_RETURNING),
    "sqlite": sqlite_insert(table_of(Artifact)).on_conflict_do_nothing(
        index_elements=["case_id", "path"]).returning(_ART.id)}
#: The case row's columns, as ``Session.get(CaseRecord, id, populate_existing=True)`` reads
#: them, and how ``direct.loaded`` makes them its ORM object (decision 139); a statement
#: that selects them first may select more after them (``loop.stagebase``'s entries).
CASE_LOADED, CASE_COLUMNS = direct.loaded_rows(CaseRecord)
_CASE_ROW = sa_select(*CASE_COLUMNS).where(table_of(CaseRecord).c.id == bindparam("id"))
_CASE_ROW_FOR_UPDATE = _CASE_ROW.with_for_update()
#: PostgreSQL: this transaction's commit does not wait for its WAL to reach the disk
#: (``SET LOCAL synchronous_commit = off`` as an expression, so that it rides on a
#: statement the transaction runs anyway; decision 126).
ASYNC_COMMIT = func.set_config("synchronous_commit", "off", True)
_CASE_ROW_FOR_UPDATE_ASYNC = sa_select(*CASE_COLUMNS, ASYNC_COMMIT).where(
    table_of(CaseRecord).c.id == bindparam("id")).with_for_update(of=table_of(CaseRecord))
_REVISION_ROW = select(RevisionRecord).where(
    col(RevisionRecord.case_id) == bindparam("case_id"),
    col(RevisionRecord.revision) == bindparam("revision"))
_REV = table_of(RevisionRecord).c
_POLICY_COLUMNS = sa_select(_REV.policy_sha256, _REV.policy_json).where(
    _REV.case_id == bindparam("case_id"), _REV.revision == bindparam("revision"))
_REVISION_COLUMNS = sa_select(_REV.interpretation_json, _REV.policy_sha256,
                              _REV.policy_json).where(
    _REV.case_id == bindparam("case_id"), _REV.revision == bindparam("revision"))
_POINTER = table_of(ManifestPointer)


class RevisionColumns(NamedTuple):
    """What a stage reads of a revision row (:meth:`Store.revision_columns`)."""

    interpretation_json: str
    policy_sha256: str | None
    policy_json: str | None


def _read_in_transaction(session: Session) -> dict[Any, Any]:
    """Values read once per transaction of ``session`` (dropped at its next one)."""
    transaction = core(session).get_transaction()
    held, read = session.info.get("read_once", (None, None))
    if held is not transaction or read is None:
        read = {}
        session.info["read_once"] = (transaction, read)
    return cast("dict[Any, Any]", read)


@dataclass(frozen=True)
class StoredArtifact:
    """An artifact read back: its path, recorded sha256, media type, size, creation time
    and exact bytes (already checked against the sha256)."""

    case_id: str
    path: str
    sha256: str
    media_type: str
    size_bytes: int
    created_at: datetime
    data: bytes


def normalise_url(url: str) -> str:
    """``url`` with a PostgreSQL scheme in any case and spelling (``postgres://``,
    libpq's and Heroku's, which SQLAlchemy no longer reads: "Can't load plugin:
    sqlalchemy.dialects:postgres", a new user's trial; ``POSTGRES://``; ``postgresql://``)
    written ``postgresql+psycopg://``, a driver named after ``+`` kept; any other URL
    unchanged."""
    scheme, sep, rest = url.partition("://")
    lowered = scheme.lower()
    if not sep or not lowered.startswith("postgres"):
        return url
    if lowered == "postgres" or lowered.startswith("postgres+"):  # libpq's spelling
        lowered = "postgresql" + lowered[len("postgres"):]
    if lowered == "postgresql":  # the one driver the engine pipelines (decision 128)
        lowered = "postgresql+psycopg"
    return f"{lowered}://{rest}"


#: The (backend, driver) pairs a store URL may name: SQLite through Python's sqlite3,
#: PostgreSQL through psycopg 3 (the one driver the engine pipelines, decision 128).
STORE_DRIVERS = frozenset({("sqlite", "pysqlite"), ("postgresql", "psycopg")})
#: The driver of a URL that names none (``postgresql://`` is written with psycopg by
#: :func:`normalise_url` first).
DEFAULT_DRIVERS = {"sqlite": "pysqlite", "postgresql": "psycopg"}


def check_url(url: str) -> None:
    """Refuse a database URL that cannot be used, never echoing it (it may hold a
    password).

    Raises:
        StoreError: ``STORE_URL_INVALID``: a URL SQLAlchemy cannot read, or whose host or
        database holds ``@`` (a raw ``@`` in a password: a hostile trial's password tail
        was printed in the parser's error, and ``pa@ss`` resolved host ``ss@...``); a
        PostgreSQL URL that names no database (``postgres://`` alone reached the local
        socket's database of the user running the command); a database or driver the
        engine does not use (``mysql://``, ``postgresql+psycopg2://``: the command failed
        with DEPENDENCY_MISSING, which advised installing the engine again).
    """
    unreadable = StoreError(
        "STORE_URL_INVALID", "the store URL cannot be read (not shown: it may hold a "
        "password); in a password, write @ as %40, : as %3A, / as %2F and % as %25")
    try:
        parsed = make_url(url)
    except Exception:
        raise unreadable from None
    if "@" in (parsed.host or "") or "@" in (parsed.database or ""):
        raise unreadable
    backend, plus, driver = parsed.drivername.partition("+")
    # ``postgresql+://`` names an empty driver, not the default one (SQLAlchemy then
    # failed with "Can't load plugin", a hostile trial).
    if (backend, driver if plus else DEFAULT_DRIVERS.get(backend)) not in STORE_DRIVERS:
        raise StoreError("STORE_URL_INVALID",
                         f"the store URL names a database or driver this engine does not "
                         f"use ({escape_text(parsed.drivername)[:60]}); the store is SQLite "
                         "(sqlite:///PATH) or "
                         "PostgreSQL (postgresql+psycopg://USER@HOST:5432/DATABASE)")
    if parsed.get_backend_name() == "postgresql" and not parsed.database:
        raise StoreError("STORE_URL_INVALID", "the store URL names no database: "
                         "postgresql+psycopg://USER@HOST:5432/DATABASE")


def make_engine(url: str) -> Engine:
    """Create an engine for ``url`` (``sqlite:///path`` or ``postgresql+psycopg://...``;
    ``postgres://`` is read as ``postgresql+psycopg://``, :func:`normalise_url`).

    SQLite gets WAL journaling, a busy timeout and foreign keys on every connection.
    Connections are pooled per process; :class:`Store` drops an inherited pool in a
    forked child, so prefork children never share a connection.
    """
    url = normalise_url(url)
    check_url(url)
    if url.startswith("sqlite"):
        if url.startswith("sqlite:///") and not url.startswith("sqlite:///:memory:"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "check_same_thread": False},
            poolclass=QueuePool, pool_size=4, max_overflow=8,
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            # Let SQLAlchemy's own BEGIN handling work with pysqlite (see its docs on
            # "Serializable isolation / Savepoints / Transactional DDL").
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            # INSERT OR REPLACE deletes the row it replaces: only with recursive triggers
            # does that deletion meet the store's guards (store.guards).
            cur.execute("PRAGMA recursive_triggers=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Any) -> None:
            # BEGIN IMMEDIATE: take the write lock at the start, so two writers never
            # deadlock upgrading read locks (a "database is locked" the busy timeout
            # cannot resolve). A single read (``Store.read_one``) runs in autocommit; a
            # read-only connection (``Store.reading``) begins a deferred transaction
            # instead: neither takes the write lock.
            options = conn.get_execution_options()
            if options.get(READ_ONE):
                return
            if options.get(READ_ONLY):
                conn.exec_driver_sql("BEGIN")
                return
            _begin_immediate(conn)

        return engine
    # The driver runs in autocommit; a transaction's BEGIN is sent by the engine, in one
    # round trip with the transaction's first statement (decision 128), and a deferred
    # write with what follows it (decision 130).
    engine = create_engine(url, pool_size=5, max_overflow=5, isolation_level="AUTOCOMMIT")
    _pipelined_transactions(engine)

    @event.listens_for(engine, "checkout")
    def _ping_idle(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        # pool_pre_ping pinged before every transaction (a round trip each, about 15 per
        # step); only a connection that sat idle in the pool is pinged now.
        if time.monotonic() - record.info.get("checked_in", 0.0) <= PG_PING_IDLE_S:
            return
        try:
            with dbapi_conn.cursor() as cur:
                cur.execute("SELECT 1")
            dbapi_conn.rollback()
        except Exception as exc:  # a dead connection: the pool opens a new one
            raise DisconnectionError(f"idle connection failed its ping: {exc}") from exc

    @event.listens_for(engine, "connect")
    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_conn: Any, record: Any) -> None:
        record.info["checked_in"] = time.monotonic()

    return engine


#: PostgreSQL: the statement that opens a transaction, at the server's default isolation
#: (``default_transaction_isolation``: READ COMMITTED unless the operator set another).
PG_BEGIN = "BEGIN"
#: PostgreSQL: the statement that ends a transaction with deferred writes (decision 130).
PG_COMMIT = "COMMIT"
#: Execution option of a write whose result nobody reads (no ``RETURNING``, no rowcount;
#: build it with :func:`deferred`): on PostgreSQL it waits on its connection and goes
#: out in one pipeline exchange with the transaction's next statement or with its
#: ``COMMIT`` (decision 130); on SQLite it runs at once (and directly, decision 132).
DEFERRED = direct.DEFERRED


def deferred(statement: Any) -> Any:
    """``statement`` (an INSERT whose result the caller never reads) made ``inline``, so
    that no primary key is fetched for it, and marked :data:`DEFERRED`.
    An error it raises (a unique violation: another runner wrote the row) surfaces at
    the transaction's next statement or at its commit, as a
    :class:`~sqlalchemy.exc.DBAPIError` like any other (naming that statement's SQL,
    not the write's). Outside a transaction of its own (autocommit, a savepoint) it runs
    at once."""
    return statement.inline().execution_options(**{DEFERRED: True})


# A pointer is moved, or inserted when it does not exist, by one deferred statement: no
# round trip of its own on PostgreSQL (decision 139). There an UPDATE in a CTE, then an
# INSERT only when it moved nothing (an upsert would take a value of the int4 id sequence
# at every move, and a second creator of the same pointer would overwrite the first one
# instead of losing the race on the unique (case, name)); SQLite's upsert takes none.
_PTR = _POINTER.c
# Parameters named apart from the columns (an UPDATE would SET a column its parameters
# name): pointer_case, pointer_name, pointer_path, pointer_sha256.
_POINTER_VALUES = {name: bindparam(f"pointer_{key}", type_=String())
                   for name, key in (("case_id", "case"), ("name", "name"),
                                     ("path", "path"), ("sha256", "sha256"))}
_POINTER_MOVED = _POINTER.update().where(
    _PTR.case_id == _POINTER_VALUES["case_id"], _PTR.name == _POINTER_VALUES["name"]
).values(path=_POINTER_VALUES["path"], sha256=_POINTER_VALUES["sha256"]
         ).returning(_PTR.id).cte("moved")
_SQLITE_POINTER = sqlite_insert(_POINTER)
_POINTER_SET = {
    "postgresql": deferred(_POINTER.insert().from_select(
        list(_POINTER_VALUES), sa_select(*_POINTER_VALUES.values()).where(
            ~exists(sa_select(_POINTER_MOVED.c.id))))),
    "sqlite": deferred(_SQLITE_POINTER.values(_POINTER_VALUES).on_conflict_do_update(
        index_elements=["case_id", "name"], set_={
            "path": _SQLITE_POINTER.excluded.path, "sha256": _SQLITE_POINTER.excluded.sha256})),
}


def _pipelined_transactions(engine: Engine) -> None:
    """PostgreSQL: open each transaction with its first statement, in one round trip, and
    send deferred writes with what follows them.

    psycopg sends a transaction's ``BEGIN`` alone and waits for its answer before the
    first statement: a round trip per transaction, 13 per step. Here the driver runs in
    autocommit (SQLAlchemy's ``isolation_level="AUTOCOMMIT"`` on the engine) and the
    engine sends ``BEGIN`` itself: when SQLAlchemy begins a transaction the connection is
    marked, and the transaction's first statement goes out in a psycopg pipeline behind
    ``BEGIN`` (one round trip; an error of either is raised as the statement's). The
    driver's ``commit()`` and ``rollback()`` act on the server's transaction status, not
    on the autocommit flag, so COMMIT and ROLLBACK are unchanged. A connection given
    ``isolation_level="AUTOCOMMIT"`` explicitly (``Store.read_one``, ``Store.reading``)
    gets no ``BEGIN``: each statement stands alone, as before.

    A statement executed with :data:`DEFERRED` inside an open transaction (not on an
    autocommit connection, not inside a savepoint) is not sent: it waits on its
    connection and goes out, in order, in one pipeline exchange with the next statement,
    or with ``COMMIT`` when the transaction ends (the driver's own ``commit()`` is not
    called then; when a write fails, the aborted transaction is rolled back there, as a
    failed ``COMMIT`` would have ended it); a rollback drops it (decision 130). A stage's
    marker, the last write of every stage transaction, costs no round trip of its own.

    Statements a :class:`~investigation.store.direct.DirectConnection` runs on the
    driver's cursor (decision 134) go through the same function (registered with
    :func:`~investigation.store.direct.register_runner`): the same ``BEGIN``, the same
    waiting writes, the same refusal.

    Raises:
        StoreError: ``STORE_TRANSACTION_NOT_OPEN`` when a statement would run outside the
            transaction SQLAlchemy believes open (a path that escaped this mechanism:
            refused rather than committed statement by statement).
        sqlalchemy.exc.DBAPIError: a deferred write failed; raised at the statement or
            commit it went out with.
    """
    from psycopg.pq import TransactionStatus

    idle, in_error = TransactionStatus.IDLE, TransactionStatus.INERROR
    pending: weakref.WeakSet[Any] = weakref.WeakSet()
    waiting: weakref.WeakKeyDictionary[Any, list[tuple[str, Any]]] = \
        weakref.WeakKeyDictionary()

    def _send(raw: Any, writes: list[tuple[str, Any]]) -> None:
        """Queue ``writes`` (the driver's statements and parameters) in ``raw``'s open
        pipeline, in order."""
        for statement, parameters in writes:
            raw.execute(statement, parameters)

    @event.listens_for(engine, "begin")
    def _mark(conn: Connection) -> None:
        if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
            return
        pending.add(conn.connection.dbapi_connection)

    @event.listens_for(engine, "commit")
    def _committing(conn: Connection) -> None:
        if not conn.invalidated:
            pending.discard(conn.connection.dbapi_connection)

    # SQLAlchemy has no event in place of the driver's commit: the engine's own dialect
    # instance (one per engine) sends the waiting writes and COMMIT in one exchange. An
    # error is raised from the commit, which SQLAlchemy wraps as it wraps any (a unique
    # violation stays an IntegrityError, for ``is_lost_race``).
    dialect = engine.dialect
    commit_alone = dialect.do_commit

    def _do_commit(connection: Any) -> None:
        # SQLAlchemy passes the pool's proxy of the driver's connection.
        raw = getattr(connection, "dbapi_connection", connection)
        writes = waiting.pop(raw, None)
        if not writes:
            commit_alone(connection)
            return
        try:
            with raw.pipeline():
                _send(raw, writes)
                raw.execute(PG_COMMIT)
        except Exception:
            # A write failed, so the pipeline skipped COMMIT: the transaction is aborted,
            # not ended. End it, as a failed COMMIT does, or the pool would keep the
            # connection inside it (SQLAlchemy counts the transaction as finished).
            if not raw.closed and raw.info.transaction_status == in_error:
                raw.rollback()
            raise
        # The server is idle now: the driver's commit() would send nothing.

    dialect.do_commit = _do_commit  # type: ignore[method-assign,assignment]

    @event.listens_for(engine, "rollback")
    def _unmark(conn: Connection) -> None:
        if conn.invalidated:
            # A lost connection (its error is on its way; ``conn.connection`` would raise
            # PendingRollbackError in its place): it is discarded, and the set is weak.
            return
        raw = conn.connection.dbapi_connection
        pending.discard(raw)
        waiting.pop(raw, None)

    @event.listens_for(engine, "checkin")
    def _returned(dbapi_conn: Any, _record: Any) -> None:
        # A connection back in the pool with writes never sent: their transaction never
        # committed (the pool's reset rolls it back); they must not join the next one.
        if dbapi_conn is not None:
            pending.discard(dbapi_conn)
            waiting.pop(dbapi_conn, None)

    def _check(raw: Any, root: Connection | None, statement: str) -> bool:
        """Whether ``BEGIN`` is still to be sent on ``raw``; refuses a lost transaction."""
        if raw in pending:
            pending.discard(raw)
            return True
        if root is not None and raw.pgconn.transaction_status == idle \
                and root.in_transaction() \
                and root.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
            raise StoreError(
                "STORE_TRANSACTION_NOT_OPEN",
                "a statement would have run outside its transaction: " + statement[:80])
        return False

    def _root(context: Any) -> Connection | None:
        return context.root_connection if context is not None else None

    def _may_wait(root: Connection) -> bool:
        """A deferred write waits only in an open transaction of its own: not on an
        autocommit connection (nothing would send it), nor inside a savepoint (its error
        must be raised there, where a ``begin_nested`` block can roll it back)."""
        return root.in_transaction() and not root.in_nested_transaction() and \
            root.get_execution_options().get("isolation_level") != "AUTOCOMMIT"

    def _send_waiting(raw: Any) -> None:
        """Send the writes waiting on ``raw`` before a statement that cannot join them."""
        writes = waiting.pop(raw, None)
        if writes:
            with raw.pipeline():
                _send(raw, writes)

    def _run(cursor: Any, statement: str, parameters: Any, root: Connection | None,
             is_deferred: bool) -> bool:
        """Send ``statement`` on ``cursor`` behind a pending ``BEGIN`` and the writes
        waiting on its connection, or queue it when it is a deferred write; ``False``
        when nothing is pending (the caller executes it alone)."""
        raw = cursor.connection
        begin = _check(raw, root, statement)
        if not begin and is_deferred and root is not None and _may_wait(root):
            waiting.setdefault(raw, []).append((statement, parameters))
            return True
        writes = waiting.pop(raw, None)
        if not begin and not writes:
            return False
        with raw.pipeline():
            if begin:
                raw.execute(PG_BEGIN)
            _send(raw, writes or [])
            cursor.execute(statement, parameters)
        return True

    @event.listens_for(engine, "do_execute")
    def _execute(cursor: Any, statement: str, parameters: Any, context: Any) -> bool:
        is_deferred = context is not None and bool(context.execution_options.get(DEFERRED))
        return _run(cursor, statement, parameters, _root(context), is_deferred)

    # The statements a stage runs on the driver's cursor (decision 134) go through the
    # same pipeline.
    direct.register_runner(engine, _run)

    @event.listens_for(engine, "do_execute_no_params")
    def _execute_no_params(cursor: Any, statement: str, context: Any) -> bool:
        if _check(cursor.connection, _root(context), statement):
            cursor.connection.execute(PG_BEGIN)
        _send_waiting(cursor.connection)
        return False

    @event.listens_for(engine, "do_executemany")
    def _executemany(cursor: Any, statement: str, parameters: Any, context: Any) -> bool:
        if _check(cursor.connection, _root(context), statement):
            cursor.connection.execute(PG_BEGIN)
        _send_waiting(cursor.connection)
        return False


#: Execution option of the connections ``Store.reading`` hands out.
READ_ONLY = "investigation_read_only"


def _begin_immediate(conn: Connection) -> None:
    """``BEGIN IMMEDIATE`` on SQLite, waiting for another writer in short polls.

    SQLite's own busy handler sleeps 1, 2, 5, 10, 15, 20, 25 ... ms between tries, so a
    writer that meets a transaction of a millisecond or two often sleeps far longer than
    the lock was held (two worker processes on one store meet at almost every stage).
    Here the busy timeout is off for the ``BEGIN`` alone and the lock is polled after
    0.1 ms, doubling up to 2 ms, for at most :data:`SQLITE_BUSY_TIMEOUT_MS` as before.

    Raises:
        sqlalchemy.exc.OperationalError: "database is locked" after the busy timeout.
    """
    raw = conn.connection.dbapi_connection
    assert raw is not None
    raw.execute("PRAGMA busy_timeout=0")
    try:
        deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
        pause = SQLITE_LOCK_POLL_FIRST_S
        while True:
            try:
                raw.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                busy = getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_BUSY \
                    or "locked" in str(exc)
                if not busy or time.monotonic() >= deadline:
                    raise OperationalError("BEGIN IMMEDIATE", None, exc) from exc
            time.sleep(pause)
            pause = min(pause * 2, SQLITE_LOCK_POLL_MAX_S)
    finally:
        raw.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")


def _check_existing_artifact(conn: Any, case_id: str, path: str, digest: str) -> None:
    """An artifact insert met an existing row at ``path``: storing the same bytes again
    is a no-op (idempotent stages rely on it).

    Raises:
        StoreError: ``STORE_ARTIFACT_CONFLICT`` when the row holds other bytes.
    """
    existing = conn.execute(_ARTIFACT_ROW, {"case_id": case_id, "path": path}).first()
    if existing is None or existing[0] != digest:
        raise StoreError(
            "STORE_ARTIFACT_CONFLICT",
            f"artifact {path} of case {case_id} already holds other bytes",
            path=path,
        )


class Store:
    """The SQL store: sessions, schema creation and artifact bytes.

    Args:
        url: SQLAlchemy database URL.
    """

    def __init__(self, url: str) -> None:
        self.url = url = normalise_url(url)
        self.engine = make_engine(url)
        ref = weakref.ref(self)

        def _after_fork() -> None:
            store = ref()
            if store is not None:  # the parent's connections stay the parent's
                store.engine.dispose(close=False)

        os.register_at_fork(after_in_child=_after_fork)

    def create_schema(self) -> None:
        """Bring the schema to the newest migration (idempotent; concurrent callers are
        serialised by the database)."""
        from investigation.store.migrate import upgrade

        _ = models  # the import registers the tables
        upgrade(self.engine)

    def dispose(self) -> None:
        """Close pooled connections (call after fork or at shutdown)."""
        self.engine.dispose()

    @contextmanager
    def reading(self) -> Iterator[Connection]:
        """A connection for reads that change nothing and need no lock: on SQLite a
        deferred transaction (``BEGIN``, never the write lock ``BEGIN IMMEDIATE`` that a
        session takes, so it does not wait for or hold up a writer); on PostgreSQL
        autocommit (no ``BEGIN``/``COMMIT`` round trips; each statement reads its own
        snapshot). Nothing written on it is kept."""
        with self.engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            else:
                conn = conn.execution_options(**{READ_ONLY: True})
            try:
                yield conn
            finally:
                conn.rollback()

    @contextmanager
    def session(self) -> Iterator[Session]:
        """One transaction: commits on success, rolls back on any exception."""
        with Session(self.engine, expire_on_commit=False) as session:
            try:
                yield session
                session.commit()
            except BaseException:
                session.rollback()
                raise

    def read_one(self, statement: Any, params: dict[str, Any]) -> Any:
        """The first row of one read-only ``statement`` (or ``None``), outside any stage
        transaction, in autocommit: the statement alone is atomic (one snapshot); on
        SQLite it takes no write lock, on PostgreSQL it costs one round trip instead of
        three (no ``BEGIN`` and ``COMMIT``)."""
        with self.engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            else:
                conn = conn.execution_options(**{READ_ONE: True})
            row = conn.execute(statement, params).first()
            conn.commit()
        return row

    # -- artifacts -------------------------------------------------------------------------

    @staticmethod
    def put_artifact(
        session: Session, case_id: str, path: str, data: bytes,
        media_type: str = "application/json",
    ) -> str:
        """Store ``data`` under ``path`` once; return its sha256.

        The bytes go to the content-addressed, compressed blob store
        (``investigation.store.blobs``: stored once, as a delta of the previous artifact of
        the same kind). Writing the same bytes again is a no-op (idempotent stages rely on
        it).

        Raises:
            StoreError: ``STORE_ARTIFACT_CONFLICT`` when different bytes exist at ``path``.
        """
        digest = sha256_hex(data)
        kind = blobs.kind_of(path)
        conn = core(session)
        _read_in_transaction(session).pop(("artifact", case_id, path), None)
        row = {"case_id": case_id, "path": path, "kind": kind, "sha256": digest,
               "size_bytes": len(data), "media_type": media_type,
               "created_at": models.utcnow()}
        postgres = conn.dialect.name == "postgresql"
        planned = blobs.plan(conn, case_id, kind, data, digest, path) if postgres else None
        if planned is not None:
            # The usual step on PostgreSQL: the row and its blob (a delta of the lineage
            # head this process remembers) in one statement, one round trip (decision 138).
            inserted_id, depth = conn.execute(blobs.WITH_ARTIFACT[planned.keyframe],
                                              {**row, **planned.values}).one()
            if inserted_id is None:
                _check_existing_artifact(conn, case_id, path, digest)
                return digest
            if not blobs.planned_stored(conn, planned, data, depth):
                blobs.store(session, case_id, kind, data, digest, path, fast=False)
            return digest
        # The row first (one statement when the path is new, the usual case); its blob
        # next: the lineage head ``blobs.store`` reads joins ``blob``, so it never finds
        # this row unless the same bytes are stored already.
        inserted = conn.execute(_ARTIFACT_INSERTS["postgresql" if postgres else "sqlite"], {
            **row, "head_case_id": case_id, "head_kind": kind}).first()
        if inserted is None:
            _check_existing_artifact(conn, case_id, path, digest)
            return digest
        head: Any = blobs.UNREAD
        if postgres:
            head = None if inserted[1] is None else (str(inserted[1]), int(inserted[2]))
        blobs.store(session, case_id, kind, data, digest, path, head)
        return digest

    @staticmethod
    def get_artifact(session: Session, case_id: str, path: str, *,
                     cache: blobs.ByteCache | None = None) -> StoredArtifact | None:
        """The artifact at ``path`` with its exact bytes, or ``None``.

        Args:
            cache: decoded bytes to reuse (default: the process cache); pass a new
                :class:`~investigation.store.blobs.ByteCache` to decode from the store.

        Raises:
            StoreError: ``STORE_ARTIFACT_CORRUPT`` when its bytes are missing or altered.
        """
        read = _read_in_transaction(session)
        key = ("artifact", case_id, path)
        if key in read:  # read with others (:meth:`prefetch_artifacts`) in this transaction
            row = read[key]
        else:
            row = core(session).execute(_ARTIFACT_ROW, {"case_id": case_id,
                                                        "path": path}).first()
        if row is None:
            return None
        sha, media_type, size, created = row
        return StoredArtifact(case_id, path, sha, media_type, size, created,
                              blobs.load(session, sha, cache=cache))

    @staticmethod
    def prefetch_artifacts(session: Session, case_id: str, paths: list[str]) -> None:
        """Read the rows of several artifacts in one query, for :meth:`get_artifact` calls
        later in this transaction (a path found missing stays missing until this
        transaction stores it)."""
        read = _read_in_transaction(session)
        found = {path: (sha, media_type, size, created) for path, sha, media_type, size, created
                 in core(session).execute(_ARTIFACT_ROWS, {"case_id": case_id,
                                                           "paths": paths})}
        for path in paths:
            read[("artifact", case_id, path)] = found.get(path)

    @staticmethod
    def artifact_sha256(session: Session, case_id: str, path: str) -> str | None:
        """The sha256 recorded for ``path`` (no bytes are read), or ``None``."""
        row = core(session).execute(_ARTIFACT_ROW, {"case_id": case_id, "path": path}).first()
        return None if row is None else str(row[0])

    @staticmethod
    def artifact_created_at(session: Session, case_id: str, path: str) -> datetime | None:
        """When the artifact at ``path`` was stored (no bytes are read), or ``None``."""
        row = core(session).execute(_ARTIFACT_ROW, {"case_id": case_id, "path": path}).first()
        return None if row is None else row[3]

    @staticmethod
    def artifacts(session: Session, case_id: str) -> Iterator[StoredArtifact]:
        """Every artifact of the case in path order, each with its exact bytes, decoded from
        the store (not from a process cache) and checked against its sha256.

        Raises:
            StoreError: ``STORE_ARTIFACT_CORRUPT`` at the first artifact whose bytes are
            missing or altered.
        """
        rows = session.execute(sa_select(
            col(Artifact.path), col(Artifact.sha256), col(Artifact.media_type),
            col(Artifact.size_bytes), col(Artifact.created_at)).where(col(Artifact.case_id) == case_id)
            .order_by(col(Artifact.path))).all()
        fresh = blobs.ByteCache()
        for path, sha, media_type, size, created in rows:
            yield StoredArtifact(case_id, path, sha, media_type, size, created,
                                 blobs.load(session, sha, cache=fresh))

    @staticmethod
    def lock_case(session: Session, case_id: str, *, async_commit: bool = False) -> CaseRecord:
        """The case row, locked for the rest of the transaction: ``SELECT ... FOR UPDATE``
        on PostgreSQL; on SQLite the transaction already holds the write lock
        (``BEGIN IMMEDIATE``).

        Args:
            async_commit: on PostgreSQL, the same statement sets ``synchronous_commit``
                off for this transaction (:data:`ASYNC_COMMIT`: only for a transaction
                whose writes the engine can derive again from what is durable, decision
                126); ignored on SQLite.

        Raises:
            InvestigationError: ``CASE_NOT_FOUND``.
        """
        case = Store.lock_case_row(session, case_id, async_commit=async_commit)
        if case is None:
            raise InvestigationError("CASE_NOT_FOUND", f"no case {case_id}")
        return case

    @staticmethod
    def revision(session: Session, case_id: str, revision: int) -> RevisionRecord:
        """The revision row, read once per transaction (it changes only when its policy is
        frozen, through this very object).

        Raises:
            sqlalchemy.exc.NoResultFound: no such revision.
        """
        memo: dict[tuple[str, int], RevisionRecord] = session.info.setdefault("revisions", {})
        row = memo.get((case_id, revision))
        if row is None:
            row = session.exec(_REVISION_ROW, params={"case_id": case_id,
                                                      "revision": revision}).one()
            memo[(case_id, revision)] = row
        return row

    @staticmethod
    def policy_columns(session: Session, case_id: str,
                       revision: int) -> tuple[str | None, str | None]:
        """``(policy_sha256, policy_json)`` of a revision: from the revision object this
        transaction already holds (:meth:`revision`, whose policy may have just been
        frozen), else one Core query (no ORM object), once per transaction.

        Raises:
            sqlalchemy.exc.NoResultFound: no such revision.
        """
        memo: dict[tuple[str, int], RevisionRecord] = session.info.get("revisions", {})
        row = memo.get((case_id, revision))
        if row is not None:
            return row.policy_sha256, row.policy_json
        # Read once per transaction too (a policy is frozen through the revision object,
        # which then takes precedence above).
        read = _read_in_transaction(session)
        whole = read.get(("revision", case_id, revision))
        if whole is not None:
            return whole.policy_sha256, whole.policy_json
        columns: tuple[str | None, str | None] | None = read.get(("policy", case_id, revision))
        if columns is None:
            sha, text = core(session).execute(_POLICY_COLUMNS, {
                "case_id": case_id, "revision": revision}).one()
            columns = read[("policy", case_id, revision)] = (sha, text)
        return columns

    @staticmethod
    def remember_policy_columns(session: Session, case_id: str, revision: int,
                                policy_sha256: str | None, policy_json: str | None) -> None:
        """Keep a revision's policy columns, read with other rows in this transaction,
        for :meth:`policy_columns` (what this transaction read or froze before takes
        precedence)."""
        _read_in_transaction(session).setdefault(("policy", case_id, revision),
                                                 (policy_sha256, policy_json))

    @staticmethod
    def remember_revision_columns(session: Session, case_id: str, revision: int,
                                  columns: RevisionColumns) -> None:
        """Keep a revision's columns read (with other rows) in this transaction for
        :meth:`revision_columns` and :meth:`policy_columns` (its ORM object, when this
        transaction holds one, still takes precedence)."""
        _read_in_transaction(session).setdefault(("revision", case_id, revision), columns)

    @staticmethod
    def revision_columns(session: Session, case_id: str, revision: int) -> RevisionColumns:
        """The interpretation and policy columns of a revision, without an ORM object:
        from the revision object this transaction holds (:meth:`revision`), else one
        Core query, once per transaction.

        Raises:
            sqlalchemy.exc.NoResultFound: no such revision.
        """
        memo: dict[tuple[str, int], RevisionRecord] = session.info.get("revisions", {})
        row = memo.get((case_id, revision))
        if row is not None:
            return RevisionColumns(row.interpretation_json, row.policy_sha256, row.policy_json)
        read = _read_in_transaction(session)
        columns: RevisionColumns | None = read.get(("revision", case_id, revision))
        if columns is None:
            columns = read[("revision", case_id, revision)] = RevisionColumns(
                *core(session).execute(_REVISION_COLUMNS, {
                    "case_id": case_id, "revision": revision}).one())
        return columns

    @staticmethod
    def lock_case_row(session: Session, case_id: str, *,
                      async_commit: bool = False) -> CaseRecord | None:
        """:meth:`lock_case`, but ``None`` for an unknown case."""
        stmt: Any
        if session.get_bind().dialect.name != "postgresql":
            stmt = _CASE_ROW
        else:
            stmt = _CASE_ROW_FOR_UPDATE_ASYNC if async_commit else _CASE_ROW_FOR_UPDATE
        rows = direct.loaded(session, CASE_LOADED, core(session).execute(stmt, {"id": case_id}),
                             refresh=True)
        return cast(CaseRecord, rows[0]) if rows else None

    @staticmethod
    def set_pointer(session: Session, case_id: str, name: str, path: str, sha256: str) -> None:
        """Point manifest pointer ``name`` at an artifact."""
        conn = core(session)  # pointers are written here only, never through the ORM
        dialect = "postgresql" if conn.dialect.name == "postgresql" else "sqlite"
        conn.execute(_POINTER_SET[dialect], {"pointer_case": case_id, "pointer_name": name,
                                             "pointer_path": path, "pointer_sha256": sha256})


def is_unique_violation(exc: BaseException) -> bool:
    """True when ``exc`` is a unique-constraint violation on SQLite or PostgreSQL."""
    if not isinstance(exc, IntegrityError):
        return False
    text = str(exc.orig).lower()
    return "unique" in text or "duplicate key" in text


#: SQLSTATEs of a PostgreSQL transaction that lost a race (serialization failure, deadlock):
#: it was rolled back whole, so running it again is safe.
RACE_SQLSTATES = frozenset({"40001", "40P01"})


def is_serialization_failure(exc: BaseException) -> bool:
    """True when ``exc`` is a PostgreSQL serialization failure or deadlock.

    These arise from races under ``REPEATABLE READ``/``SERIALIZABLE`` (a server whose
    ``default_transaction_isolation`` is raised) or from lock ordering; the failed
    transaction wrote nothing. Callers re-read (the winner's row) or run it again.
    """
    return isinstance(exc, DBAPIError) and getattr(exc.orig, "sqlstate", None) in RACE_SQLSTATES


def is_lost_race(exc: BaseException) -> bool:
    """A unique violation or a serialization failure: another transaction got there first."""
    return is_unique_violation(exc) or is_serialization_failure(exc)
