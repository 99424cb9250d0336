"""How the store waits for and checks its connections (issue 13, the per-step cost).

* SQLite: a writer meeting another connection's write transaction polls ``BEGIN
  IMMEDIATE`` in short pauses and gets the lock soon after it is released; one that never
  gets it fails with SQLAlchemy's ``OperationalError`` (database is locked) after the busy
  timeout, as before. ``Store.reading`` neither takes nor waits for the write lock.
* PostgreSQL: a pooled connection in steady use is not pinged; one idle past
  ``PG_PING_IDLE_S`` is, and a dead one is replaced before a transaction uses it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from psycopg.pq import TransactionStatus
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from investigation.store import Store
from investigation.store import engine as store_engine


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Store:
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    with store.engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (x INTEGER)")
    return store


def test_a_sqlite_writer_gets_the_lock_soon_after_another_releases_it(
        sqlite_store: Store) -> None:
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with sqlite_store.session() as s:
            s.execute(text("INSERT INTO t VALUES (1)"))
            held.set()
            assert release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(10)
    threading.Timer(0.3, release.set).start()
    started = time.monotonic()
    with sqlite_store.session() as s:  # waits for the holder's commit
        s.execute(text("INSERT INTO t VALUES (2)"))
    waited = time.monotonic() - started
    thread.join(10)
    # SQLite's own busy handler would have slept in steps of up to 100 ms by then.
    assert 0.25 <= waited < 0.3 + 0.1
    with sqlite_store.session() as s:
        assert s.execute(text("SELECT count(*) FROM t")).scalar() == 2
        # The connection's busy timeout is back for every other statement.
        assert s.execute(text("PRAGMA busy_timeout")).scalar() == \
            store_engine.SQLITE_BUSY_TIMEOUT_MS


def test_a_sqlite_writer_that_never_gets_the_lock_fails_after_the_busy_timeout(
        sqlite_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_engine, "SQLITE_BUSY_TIMEOUT_MS", 200)
    with sqlite_store.session() as holder:
        holder.execute(text("INSERT INTO t VALUES (1)"))
        started = time.monotonic()
        with pytest.raises(OperationalError, match="locked"), sqlite_store.session() as s:
            s.execute(text("INSERT INTO t VALUES (2)"))
        assert 0.2 <= time.monotonic() - started < 1.0


def test_reading_neither_takes_nor_waits_for_the_sqlite_write_lock(
        sqlite_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_engine, "SQLITE_BUSY_TIMEOUT_MS", 200)  # a wait would fail
    with sqlite_store.session() as writer:
        writer.execute(text("INSERT INTO t VALUES (1)"))
        with sqlite_store.reading() as conn:  # the writer holds the lock: no wait
            assert conn.execute(text("SELECT count(*) FROM t")).scalar() == 0
    with sqlite_store.reading() as conn:
        assert conn.execute(text("SELECT count(*) FROM t")).scalar() == 1
        with sqlite_store.session() as writer:  # a reader holds no write lock
            writer.execute(text("INSERT INTO t VALUES (2)"))
    with sqlite_store.reading() as conn:
        assert conn.execute(text("SELECT count(*) FROM t")).scalar() == 2


@pytest.mark.postgres
def test_postgres_pings_an_idle_connection_and_replaces_a_dead_one(
        postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(postgres_url)
    admin = Store(postgres_url)
    try:
        with store.session() as s:
            pid = s.execute(text("SELECT pg_backend_pid()")).scalar()
        with store.session() as s:  # steady use: the same pooled connection
            assert s.execute(text("SELECT pg_backend_pid()")).scalar() == pid
        # The connection dies while idle in the pool (a server restart, an idle timeout).
        with admin.engine.begin() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        monkeypatch.setattr(store_engine, "PG_PING_IDLE_S", 0.0)
        time.sleep(0.05)
        with store.session() as s:  # its ping fails: a fresh connection is used
            assert s.execute(text("SELECT pg_backend_pid()")).scalar() not in (None, pid)
        with store.reading() as conn:  # autocommit: no transaction round trips
            assert conn.execute(text("SELECT 1")).scalar() == 1
            raw = conn.connection.dbapi_connection
            assert raw is not None and raw.info.transaction_status == TransactionStatus.IDLE
        with store.session() as s:  # the pooled connection opens a transaction again
            assert s.execute(text("SELECT 1")).scalar() == 1
            raw = s.connection().connection.dbapi_connection
            assert raw is not None and raw.info.transaction_status == TransactionStatus.INTRANS
    finally:
        store.dispose()
        admin.dispose()
