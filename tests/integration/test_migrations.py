"""The migrated schema is exactly the models' schema, on SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlmodel import SQLModel

from investigation.store import Store


def _diff(store: Store) -> list[object]:
    with store.engine.connect() as conn:
        return list(compare_metadata(MigrationContext.configure(conn), SQLModel.metadata))


def test_sqlite_migrations_match_models(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    store.create_schema()
    store.create_schema()  # idempotent
    assert _diff(store) == []


@pytest.mark.postgres
def test_postgres_migrations_match_models(postgres_url: str) -> None:
    store = Store(postgres_url)
    store.create_schema()
    store.create_schema()
    assert _diff(store) == []


def test_the_head_revision_constant_is_the_newest_migration() -> None:
    """The read commands check a store against ``schema_version.HEAD_REVISION`` without
    reading the migration scripts: a new migration must move it."""
    from investigation.store.migrate import head_revision
    from investigation.store.schema_version import HEAD_REVISION

    assert head_revision() == HEAD_REVISION


def _foreign_sqlite(path: Path) -> None:
    import sqlite3

    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, email TEXT)")
        conn.execute("INSERT INTO users VALUES (1, 'a@example.org')")
    conn.close()


def test_an_applications_database_is_not_turned_into_a_store(tmp_path: Path) -> None:
    """A database URL pointing at another application's database (a typo, the wrong
    variable): the engine's tables were created beside the application's, silently
    (a hostile-input trial). Now STORE_FOREIGN, nothing created; `db upgrade
    --allow-other-tables` does it on purpose."""
    import sqlite3

    from typer.testing import CliRunner

    from investigation.errors import StoreError
    from workers.cli import app

    path = tmp_path / "app.db"
    _foreign_sqlite(path)
    store = Store(f"sqlite:///{path}")
    with pytest.raises(StoreError) as err:
        store.create_schema()
    assert err.value.code == "STORE_FOREIGN" and "users" in err.value.message
    store.dispose()
    with sqlite3.connect(path) as conn:
        assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master")] == ["users"]
    conn.close()
    env = {"INVESTIGATE_DATABASE_URL": f"sqlite:///{path}",
           "INVESTIGATE_HOME": str(tmp_path / "home")}
    refused = CliRunner().invoke(app, ["db", "upgrade"], env=env)
    assert refused.exit_code == 2 and "STORE_FOREIGN" in refused.output, refused.output
    done = CliRunner().invoke(app, ["db", "upgrade", "--allow-other-tables"], env=env)
    assert done.exit_code == 0, done.output
    again = Store(f"sqlite:///{path}")
    again.create_schema()  # the engine's tables are there now: an ordinary store
    assert [d[0] for d in _diff(again)] == ["remove_table"]  # only the application's
    again.dispose()


@pytest.mark.postgres
def test_postgres_application_tables_are_not_a_store(postgres_url: str) -> None:
    import sqlalchemy

    from investigation.errors import StoreError

    engine = sqlalchemy.create_engine(postgres_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE customers (id int primary key)")
    engine.dispose()
    store = Store(postgres_url)
    with pytest.raises(StoreError) as err:
        store.create_schema()
    assert err.value.code == "STORE_FOREIGN" and "customers" in err.value.message
    store.dispose()


def _back_and_forth(url: str, home: Path) -> None:
    """`db upgrade --revision OLDER` said "nothing to do" and exited 0, and no command
    took a store back although the docs describe each migration's downgrade (a fleet
    trial): upgrade refuses to go back (STORE_REVISION_BEHIND), downgrade goes back."""
    from typer.testing import CliRunner

    from investigation.store.migrate import current_revisions, head_revision
    from workers.cli import app

    env = {"INVESTIGATE_DATABASE_URL": url, "INVESTIGATE_HOME": str(home)}
    runner = CliRunner()
    assert runner.invoke(app, ["db", "upgrade"], env=env).exit_code == 0
    store = Store(url)
    head = head_revision()
    assert current_revisions(store.engine) == [head]
    behind = runner.invoke(app, ["db", "upgrade", "--revision", "0010_entry_function"],
                           env=env)
    assert behind.exit_code == 2 and "STORE_REVISION_BEHIND" in behind.output, behind.output
    assert "db downgrade --revision 0010_entry_function" in " ".join(behind.output.split())
    # Past what `db downgrade` takes back, a backup, not a downgrade it refuses (a hostile
    # trial was advised `db downgrade --revision 0001_initial`).
    early = runner.invoke(app, ["db", "upgrade", "--revision", "0001_initial"], env=env)
    flat = " ".join(early.output.split())
    assert early.exit_code == 2 and "STORE_REVISION_BEHIND" in flat, flat
    assert "db downgrade --revision" not in flat and "restore a backup" in flat, flat
    assert current_revisions(store.engine) == [head]  # nothing changed
    back = runner.invoke(app, ["db", "downgrade", "--revision", "0009_closed_history",
                               "--json"], env=env)
    assert back.exit_code == 0, back.output
    assert back.output.strip() == ('{"before": ["' + head + '"], "after": '
                                   '["0009_closed_history"]}')
    assert current_revisions(store.engine) == ["0009_closed_history"]
    unknown = runner.invoke(app, ["db", "downgrade", "--revision", "nope"], env=env)
    assert unknown.exit_code == 2 and "STORE_REVISION_UNKNOWN" in unknown.output
    # It lists the revisions there are (it said "Can't locate revision identified by 'it'",
    # and a new user guessed a name: a trial).
    flat = " ".join(unknown.output.split())
    assert "the revisions are base, 0001_initial," in flat and f"{head} (" in flat, flat
    assert "identified by" not in flat
    # A hostile trial's tracebacks and half-done downgrades, each now a code and no change:
    for args, code in ((["db", "downgrade", "--revision", "head"], "STORE_REVISION_AHEAD"),
                       (["db", "downgrade", "--revision", "0009_closed_history"],
                        "STORE_REVISION_AHEAD"),
                       (["db", "downgrade", "--revision", "base"], "STORE_DOWNGRADE_REFUSED"),
                       (["db", "downgrade", "--revision", "0007_compact_store"],
                        "STORE_DOWNGRADE_REFUSED"),
                       (["db", "upgrade", "--revision", "base"], "STORE_REVISION_BEHIND"),
                       (["db", "downgrade", "--revision", ""], "STORE_REVISION_UNKNOWN"),
                       # A store behind the head is this engine's, not "not a store".
                       (["status", "case-0000000000000000"], "STORE_NOT_MIGRATED")):
        res = runner.invoke(app, args, env=env)
        assert res.exit_code == 2 and code in res.output, (args, res.output)
        assert "Traceback" not in res.output
        assert current_revisions(store.engine) == ["0009_closed_history"], args
    assert runner.invoke(app, ["db", "upgrade"], env=env).exit_code == 0
    assert current_revisions(store.engine) == [head]
    assert _diff(store) == []
    store.dispose()


def test_sqlite_upgrade_never_goes_back_and_downgrade_does(tmp_path: Path) -> None:
    _back_and_forth(f"sqlite:///{tmp_path / 's.db'}", tmp_path / "home")


@pytest.mark.postgres
def test_postgres_upgrade_never_goes_back_and_downgrade_does(postgres_url: str,
                                                             tmp_path: Path) -> None:
    _back_and_forth(postgres_url, tmp_path / "home")


def test_downgrade_refuses_while_workers_consume_the_queue(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet trial downgraded the store under two live workers: the command said
    nothing, and the workers failed the next stage of each case with a database error."""
    from typer.testing import CliRunner

    from investigation.store.migrate import current_revisions, head_revision
    from workers import health
    from workers.cli import app

    url = f"sqlite:///{tmp_path / 'store.db'}"
    env = {"INVESTIGATE_DATABASE_URL": url, "INVESTIGATE_HOME": str(tmp_path / "home"),
           "INVESTIGATE_BROKER_URL": "redis://127.0.0.1:6379/0", "INVESTIGATE_QUEUE": "cases"}
    runner = CliRunner()
    assert runner.invoke(app, ["db", "upgrade"], env=env).exit_code == 0
    asked: list[str] = []

    def two_workers(settings: Any, timeout_s: float, min_workers: int = 1) -> health.Check:
        asked.append(settings.queue)
        return health.Check("workers", True, "2 answered ping", ["w1@a", "w2@b"])

    monkeypatch.setattr(health, "check_workers", two_workers)
    refused = runner.invoke(app, ["db", "downgrade", "--revision", "0010_entry_function"],
                            env=env)
    assert refused.exit_code == 2 and "WORKERS_RUNNING" in refused.output, refused.output
    assert "w1@a, w2@b" in refused.output and asked == ["cases"]
    assert current_revisions(Store(url).engine) == [head_revision()]  # nothing changed
    # A revision that cannot be gone back to is said first, before asking the operator to
    # stop the fleet (a new user's mistyped revision).
    for wrong, code in (("nonsense", "STORE_REVISION_UNKNOWN"),
                        ("", "STORE_REVISION_UNKNOWN"),
                        ("x" * 100_000, "STORE_REVISION_UNKNOWN"),
                        ("base", "STORE_DOWNGRADE_REFUSED"),
                        ("head", "STORE_REVISION_AHEAD")):
        said = runner.invoke(app, ["db", "downgrade", "--revision", wrong], env=env)
        assert said.exit_code == 2 and code in said.output, said.output
        assert "WORKERS_RUNNING" not in said.output and len(said.output) < 1000
        assert "AssertionError" not in said.output
    assert asked == ["cases"]  # no workers asked for them
    forced = runner.invoke(app, ["db", "downgrade", "--revision", "0010_entry_function",
                                 "--force"], env=env)
    assert forced.exit_code == 0, forced.output
    assert current_revisions(Store(url).engine) == ["0010_entry_function"]


def test_another_alembic_applications_database_is_refused_by_every_db_command(
        tmp_path: Path) -> None:
    """A database of another Alembic-managed application (its own alembic_version): `db
    upgrade` and `db downgrade` ended in INTERNAL_ERROR with a traceback (a hostile
    trial). Now a code, and the file unchanged (no WAL switch either)."""
    import hashlib
    import sqlite3

    from typer.testing import CliRunner

    from workers.cli import app

    path = tmp_path / "app.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY)")
        conn.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        conn.execute("INSERT INTO alembic_version VALUES ('deadbeef')")
    conn.close()
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    env = {"INVESTIGATE_DATABASE_URL": f"sqlite:///{path}",
           "INVESTIGATE_HOME": str(tmp_path / "home")}
    runner = CliRunner()
    for args in (["db", "upgrade"], ["db", "downgrade", "--revision", "0009_closed_history"],
                 ["db", "current"]):
        res = runner.invoke(app, args, env=env)
        assert res.exit_code == 2 and "STORE_REVISION_UNKNOWN" in res.output, \
            (args, res.output)
        assert "deadbeef" in " ".join(res.output.split()), res.output
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    # With other tables allowed, the unknown version still stops it.
    res = runner.invoke(app, ["db", "upgrade", "--allow-other-tables"], env=env)
    assert res.exit_code == 2 and "STORE_REVISION_UNKNOWN" in res.output, res.output
    assert "Traceback" not in res.output
    # A missing SQLite store is not created by a downgrade.
    missing = {**env, "INVESTIGATE_DATABASE_URL": f"sqlite:///{tmp_path / 'none.db'}"}
    res = runner.invoke(app, ["db", "downgrade", "--revision", "0009_closed_history"],
                        env=missing)
    assert res.exit_code == 2 and "STORE_NOT_FOUND" in res.output
    assert not (tmp_path / "none.db").exists()
