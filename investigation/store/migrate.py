"""Schema migrations (Alembic), run programmatically by ``Store.create_schema``.

New tables or columns get a new revision under ``migrations/versions`` (generate one with
``python -m investigation.store.migrate revision "message"`` against a scratch SQLite
database, then review it), and ``schema_version.HEAD_REVISION`` names it (the read
commands check a store against it without importing Alembic). Tests check that the
migrated schema equals the models and that the constant is the newest revision.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import inspect
from sqlalchemy.engine import Engine

from investigation.errors import StoreError
from investigation.text_safety import escape_text, url_for_display

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


#: Tables every store of this engine has (from the first migration on).
ENGINE_TABLES = frozenset({"case", "checkpoint", "stage_run"})


def upgrade(engine: Engine, revision: str = "head", *, allow_other_tables: bool = False
            ) -> None:
    """Bring the database behind ``engine`` to ``revision`` (idempotent, serialised).

    Args:
        allow_other_tables: create the engine's tables in a database that holds other
            tables and none of the engine's (``investigate db upgrade
            --allow-other-tables``); refused otherwise, since a mistyped
            ``INVESTIGATE_DATABASE_URL`` would put them into an application's database.

    Raises:
        StoreError: ``STORE_UNVERSIONED`` when the database holds engine tables but no
        migration version (created outside the migrations); ``STORE_FOREIGN`` when it
        holds only other tables and ``allow_other_tables`` is false. Nothing is changed.
    """
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    url = url_for_display(engine.url.render_as_string(hide_password=True))
    with engine.connect() as conn:
        tables = set(inspect(conn).get_table_names())
        if "alembic_version" not in tables and tables & ENGINE_TABLES:
            raise StoreError(
                "STORE_UNVERSIONED",
                f"the store at {url} has engine "
                "tables but no migration version; it was not created by this engine's "
                "migrations. Use a new store, or stamp it after checking its schema "
                "(alembic stamp 0001_initial)")
        if is_foreign(tables) and not allow_other_tables:
            raise foreign_store(url, tables)
        _refuse_going_back(conn, url, revision)
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
        conn.commit()


#: The oldest revision ``db downgrade`` goes back to: the downgrades of 0009-0011 drop
#: only what they added (triggers, indexes, functions); below 0008 states published since
#: use a format older code cannot read, and the downgrades drop tables with their rows (a
#: hostile trial's `--revision base` dropped every case on PostgreSQL and failed half-way
#: on SQLite). Going further back is restoring a backup.
OLDEST_DOWNGRADE = "0008_bounded_history"


@functools.cache
def _scripts() -> ScriptDirectory:
    """This engine's migrations, read once per process (they are files of the package:
    the upgrade at every store opening read them three times, about 15 ms each)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return ScriptDirectory.from_config(cfg)


@functools.cache
def known_revisions() -> frozenset[str]:
    """Every revision id this engine's migrations have."""
    return frozenset(r.revision for r in _scripts().walk_revisions())


def _refuse_unknown_current(conn: Any, url: str) -> list[str]:
    """The store's current revisions, refusing one this engine does not have.

    Raises:
        StoreError: ``STORE_REVISION_UNKNOWN`` (another application's Alembic version, or
        a store of a newer engine: alembic's own error was an ``INTERNAL_ERROR``).
    """
    from alembic.runtime.migration import MigrationContext

    current = sorted(MigrationContext.configure(conn).get_current_heads())
    unknown = sorted(set(current) - known_revisions())
    if unknown:
        raise unknown_revision(url, unknown)
    return current


def unknown_revision(where: str, revisions: list[str]) -> StoreError:
    """``STORE_REVISION_UNKNOWN`` for a database at ``revisions`` no migration of this
    engine has."""
    return StoreError(
        "STORE_REVISION_UNKNOWN",
        f"the database at {where} is at migration {', '.join(revisions)}, which this "
        "engine does not have: another application's database (with its own Alembic "
        "version), or a store of a newer engine version; nothing was changed. Point "
        "INVESTIGATE_DATABASE_URL at this engine's store")


def _refuse_going_back(conn: Any, url: str, revision: str) -> None:
    """``STORE_REVISION_BEHIND`` when ``revision`` is older than the store's: an upgrade
    to it does nothing, which a fleet trial read as done ("nothing to do", exit 0)."""
    script = _scripts()
    current_heads = _refuse_unknown_current(conn, url)
    if revision.strip() == "base" and current_heads:
        raise StoreError(
            "STORE_REVISION_BEHIND",
            f"the store at {url} is at {', '.join(current_heads)}, past base: `db upgrade` "
            "only goes forward (`investigate db downgrade` goes back, to "
            f"{OLDEST_DOWNGRADE} at the oldest)")
    target = _resolve(script, revision)
    if target is None:
        return
    for current in current_heads:
        older = {r.revision for r in script.iterate_revisions(current, "base")}
        if target.revision != current and target.revision in older:
            # Only as far back as `db downgrade` goes (it advised a downgrade to
            # 0001_initial that `db downgrade` refuses: a hostile trial).
            reachable = target.revision in {
                r.revision for r in script.iterate_revisions("heads", OLDEST_DOWNGRADE)
            } | {OLDEST_DOWNGRADE}
            back = (f"To go back, stop the workers, take a backup and run `investigate db "
                    f"downgrade --revision {target.revision}` (docs/operations.md says what "
                    "each migration's downgrade drops)" if reachable else
                    f"`db downgrade` goes back to {OLDEST_DOWNGRADE} at the oldest: for a "
                    f"store at {target.revision}, restore a backup taken before the upgrade "
                    "(docs/operations.md, Migrations)")
            raise StoreError(
                "STORE_REVISION_BEHIND",
                f"the store at {url} is at {current}, past {target.revision}: `db upgrade` "
                f"only goes forward. {back}")


#: Characters of a revision as an error shows it.
REVISION_SHOWN = 80


def _resolve(script: ScriptDirectory, revision: str) -> Any:
    """The migration ``revision`` names (``None`` for ``base``).

    Raises:
        StoreError: ``STORE_REVISION_UNKNOWN``.
    """
    shown = escape_text(repr(revision))[:REVISION_SHOWN]
    if not revision.strip():
        raise StoreError("STORE_REVISION_UNKNOWN", "no migration revision given (`investigate "
                         "db current` shows where the store is)")
    try:
        return script.get_revision(revision)
    except Exception as exc:  # alembic's own message names what is wrong with it
        said = escape_text(str(exc).strip() or type(exc).__name__)
        # The revision is said once, bounded (a hostile revision of 100,000 characters);
        # "Can't locate revision identified by it" said nothing more (a new user's trial),
        # the list of revisions does.
        why = "" if "Can't locate" in said else \
            f" ({said.replace(revision, 'the one given')[:REVISION_SHOWN * 2]})"
        known = ", ".join(r.revision for r in reversed(list(script.walk_revisions())))
        raise StoreError("STORE_REVISION_UNKNOWN",
                         f"no migration revision {shown}{why}; the revisions are base, "
                         f"{known} (`investigate db current` shows the store's)") from exc


def downgrade_target(revision: str) -> str:
    """The migration revision ``db downgrade --revision REVISION`` goes back to, checked
    without a database (a new user's mistyped revision was told to stop the fleet first).

    Raises:
        StoreError: ``STORE_REVISION_UNKNOWN`` for a revision no migration has;
        ``STORE_DOWNGRADE_REFUSED`` below :data:`OLDEST_DOWNGRADE`.
    """
    script = _scripts()
    target = _resolve(script, revision)
    oldest = script.get_revision(OLDEST_DOWNGRADE)
    allowed = {r.revision for r in script.iterate_revisions("heads", OLDEST_DOWNGRADE)}
    allowed.add(oldest.revision)
    if target is None or target.revision not in allowed:
        raise StoreError(
            "STORE_DOWNGRADE_REFUSED",
            f"`db downgrade` goes back to {OLDEST_DOWNGRADE} at the oldest: the "
            "migrations before it change what the cases' stored states hold and drop "
            "tables with their rows; to go further back, restore a backup taken before "
            "the upgrade (docs/operations.md, Migrations); nothing was changed")
    return str(target.revision)


def _refuse_not_past(conn: Any, url: str, script: ScriptDirectory, target: str) -> None:
    """Refuse a downgrade to ``target`` of a store that is not past it.

    Raises:
        StoreError: ``STORE_REVISION_UNKNOWN`` for a store at a revision no migration
        has; ``STORE_NOT_MIGRATED``; ``STORE_REVISION_AHEAD``.
    """
    current = _refuse_unknown_current(conn, url)
    if not current:
        raise StoreError("STORE_NOT_MIGRATED", f"the store at {url} has no migration "
                         "version: nothing to take back")
    older = {r.revision for head in current
             for r in script.iterate_revisions(head, "base")} - set(current)
    if target not in older:
        raise StoreError(
            "STORE_REVISION_AHEAD",
            f"the store at {url} is at {', '.join(current)}, not past {target}: `db "
            f"downgrade` only goes back (`investigate db upgrade --revision {target}` goes "
            "forward); nothing was changed")


def check_downgrade(engine: Engine, revision: str) -> str:
    """What :func:`downgrade` would refuse, said without changing anything (``db
    downgrade`` asks it before asking to stop the workers: a hostile trial's ``--revision
    head`` of a store at head was told to stop the fleet first); the target revision.

    Raises:
        StoreError: as :func:`downgrade`.
    """
    target = downgrade_target(revision)
    url = url_for_display(engine.url.render_as_string(hide_password=True))
    with engine.connect() as conn:
        _refuse_not_past(conn, url, _scripts(), target)
    return target


def downgrade(engine: Engine, revision: str) -> None:
    """Take the database behind ``engine`` back to ``revision`` (Alembic's downgrade of
    each migration past it; docs/operations.md says what each drops). Run with the
    workers stopped.

    Raises:
        StoreError: ``STORE_REVISION_UNKNOWN`` for a revision no migration has, or a
        store at one; ``STORE_DOWNGRADE_REFUSED`` below :data:`OLDEST_DOWNGRADE`;
        ``STORE_REVISION_AHEAD`` for a revision the store is not past;
        ``STORE_NOT_MIGRATED`` for a store no migration ran on. Nothing is changed.
    """
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    script = _scripts()
    url = url_for_display(engine.url.render_as_string(hide_password=True))
    target = script.get_revision(downgrade_target(revision))
    with engine.connect() as conn:
        _refuse_not_past(conn, url, script, target.revision)
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, target.revision)
        conn.commit()


def is_foreign(tables: set[str]) -> bool:
    """Whether a database holding ``tables`` holds other tables and none of the engine's."""
    return bool(tables) and not tables & (ENGINE_TABLES | {"alembic_version"})


def foreign_store(where: str, tables: set[str]) -> StoreError:
    """``STORE_FOREIGN`` for the database at ``where`` holding ``tables`` (see
    :func:`is_foreign`); nothing was changed."""
    shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
    return StoreError(
        "STORE_FOREIGN",
        f"the database at {where} holds {len(tables)} table(s) that are not this "
        f"engine's ({shown}) and none of its own; nothing was changed. Point "
        "INVESTIGATE_DATABASE_URL at an empty database (or a PostgreSQL schema of "
        "its own), or create the engine's tables beside them on purpose with "
        "`investigate db upgrade --allow-other-tables`", tables=len(tables))


def current_revisions(engine: Engine) -> list[str]:
    """The migration revisions the database is at (``[]``: never migrated). Reads only."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return sorted(MigrationContext.configure(conn).get_current_heads())


def require_head(engine: Engine) -> None:
    """Raise unless the database is at this code's newest migration.

    Raises:
        StoreError: ``STORE_NOT_MIGRATED`` naming the current and the needed revision.
    """
    current, head = current_revisions(engine), head_revision()
    if current != [head]:
        raise StoreError(
            "STORE_NOT_MIGRATED",
            f"the store at {url_for_display(engine.url.render_as_string(hide_password=True))} is at migration "
            f"{', '.join(current) or 'none'}, this engine needs {head}; run "
            "`investigate db upgrade` (or set INVESTIGATE_AUTO_MIGRATE=true)")


def head_revision() -> str:
    """The newest migration revision this code knows."""
    head = _scripts().get_current_head()
    assert head is not None
    return head


def revision(engine: Engine, message: str) -> None:
    """Autogenerate a new revision from the difference between models and database."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.connect() as conn:
        cfg.attributes["connection"] = conn
        command.revision(cfg, message=message, autogenerate=True)


if __name__ == "__main__":  # pragma: no cover - developer tool
    from investigation.store.engine import make_engine

    if len(sys.argv) != 4 or sys.argv[1] != "revision":
        sys.exit("usage: python -m investigation.store.migrate revision URL MESSAGE")
    eng = make_engine(sys.argv[2])
    upgrade(eng)
    revision(eng, sys.argv[3])
