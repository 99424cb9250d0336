"""Opening the store a process's settings name, for the CLI and the upstream API.

A command or call that reads or acts on registered cases opens it ``existing``: the
database must already be an investigation store at this engine's migration head; nothing
is created or migrated, and a foreign database is never written (``STORE_NOT_FOUND``).
Registration opens it to write, creating or migrating it where ``INVESTIGATE_AUTO_MIGRATE``
allows.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

from sqlalchemy.engine import make_url

from investigation.errors import InvestigationError
from investigation.store import Store
from investigation.store.schema_version import HEAD_REVISION
from investigation.text_safety import url_location
from workers.settings import Settings


def open_store(settings: Settings, existing: bool = False, hint: str = "") -> Store:
    """Open the store at ``settings.effective_database_url``.

    Args:
        settings: the process's settings.
        existing: the database must already be an investigation store at this engine's
            migration head (nothing is created or migrated); else the store is created or
            migrated when ``settings.auto_migrate``, or must be at the head.
        hint: words added to the ``STORE_NOT_FOUND`` message (the CLI's demo-store hint).

    Raises:
        InvestigationError: ``STORE_NOT_FOUND`` (``existing``, and the database is no
            investigation store); ``STORE_NOT_MIGRATED`` (the store is behind, and
            ``existing`` or automatic migration off).
    """
    url = settings.effective_database_url
    not_a_store = InvestigationError(
        "STORE_NOT_FOUND",
        f"{url_location(url)} is not an investigation store (no case was ever added "
        "there); nothing was changed. Run where the case was added, or set "
        f"INVESTIGATE_HOME or INVESTIGATE_DATABASE_URL{hint}")
    is_sqlite = make_url(url).get_backend_name() == "sqlite"
    if is_sqlite and not existing:
        # Before the engine opens it: its first connection switches the file to WAL,
        # which changed a foreign database that was then refused as "nothing was
        # changed" (a hostile-input re-trial).
        refuse_foreign_sqlite(Path(make_url(url).database or ""))
    versions: list[str] = []
    if existing and is_sqlite:
        path = Path(make_url(url).database or "")
        if not path.is_file():
            raise not_a_store
        try:  # a plain read-only look (the store engine would switch the file to WAL); a
            # WAL database may get SQLite's -shm index beside it, its content is untouched
            with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as look:
                tables = {r[0] for r in look.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table'")}
                if "alembic_version" not in tables:
                    raise not_a_store
                versions = [r[0] for r in look.execute("SELECT version_num FROM alembic_version")]
        except sqlite3.Error as exc:
            # A file SQLite cannot read (cut short, overwritten) is damaged, not "a store
            # no case was ever added to" (a hostile trial's truncated store), as the
            # writing commands say.
            raise InvestigationError(
                "STORE_UNAVAILABLE", f"{path} is not a SQLite database it can read ({exc}): "
                "a damaged or foreign file, not an empty store; nothing was changed. "
                "Restore it from a backup, or point INVESTIGATE_HOME or "
                "INVESTIGATE_DATABASE_URL at the right store") from None
    store = Store(url)
    if existing and not is_sqlite:
        from sqlalchemy import text
        from sqlalchemy.exc import ProgrammingError

        try:
            with store.engine.connect() as conn:
                versions = [r[0] for r in conn.execute(
                    text("SELECT version_num FROM alembic_version"))]
        except ProgrammingError:
            store.dispose()
            raise not_a_store from None
    if existing:
        if versions != [HEAD_REVISION]:
            from investigation.store.migrate import known_revisions

            store.dispose()
            if versions and set(versions) <= known_revisions():
                # This engine's store, behind: not "not an investigation store" (a
                # hostile trial after `db downgrade`).
                raise InvestigationError(
                    "STORE_NOT_MIGRATED",
                    f"the store at {url_location(url)} is at migration "
                    f"{', '.join(versions)}, this engine needs {HEAD_REVISION}: run "
                    "`investigate db upgrade`; nothing was changed")
            raise not_a_store
        return store
    if settings.auto_migrate:
        store.create_schema()
    else:
        from investigation.store.migrate import require_head

        require_head(store.engine)
    return store


def refuse_foreign_sqlite(path: Path) -> None:
    """Refuse an existing SQLite file that holds tables and none of the engine's, read
    without writing (``migrate.upgrade`` refuses it too, but only after the engine's
    connection changed the file).

    Raises:
        StoreError: ``STORE_FOREIGN`` (``migrate.foreign_store``);
            ``STORE_REVISION_UNKNOWN`` for an Alembic version no migration of this engine
            has (``migrate.unknown_revision``).
        InvestigationError: ``STORE_UNAVAILABLE`` for a file that is no SQLite database.
    """
    from investigation.store.migrate import (
        foreign_store,
        is_foreign,
        known_revisions,
        unknown_revision,
    )

    if not path.is_file() or path.stat().st_size == 0:
        return
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as look:
            tables = {r[0] for r in look.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
            versions = [str(r[0]) for r in look.execute(
                "SELECT version_num FROM alembic_version")] \
                if "alembic_version" in tables else []
    except sqlite3.Error as exc:
        raise InvestigationError("STORE_UNAVAILABLE", f"{path} is not a SQLite database "
                                 f"({exc}); nothing was changed") from None
    if is_foreign(tables):
        raise foreign_store(str(path), tables)
    # Another Alembic application's database, or a newer engine's store (a hostile trial).
    if unknown := sorted(set(versions) - known_revisions()):
        raise unknown_revision(str(path), unknown)
