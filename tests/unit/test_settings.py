"""Settings read from the environment: what an operator's spelling of a URL becomes."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.settings import Settings


def test_a_postgres_scheme_url_is_read_as_psycopg() -> None:
    """`postgres://` (libpq's and Heroku's spelling) gave "Can't load plugin:
    sqlalchemy.dialects:postgres" (a new user's trial)."""
    from investigation.store.engine import normalise_url

    url = "postgres://postgres@127.0.0.1:5432/test"
    assert Settings(database_url=url).database_url == \
        "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    assert normalise_url("sqlite:///x.db") == "sqlite:///x.db"
    assert normalise_url("postgresql://h/db") == "postgresql+psycopg://h/db"


def test_database_urls_in_any_spelling_and_refusals_that_echo_no_password() -> None:
    """A hostile trial: `POSTGRES://` failed with "Can't load plugin"; a password holding
    a raw @ printed its tail in the parser's error ("SECRETTAIL@127.0.0.1"); `postgres://`
    alone reached the local socket's database of the user running the command."""
    import pytest

    from investigation.errors import StoreError
    from investigation.store.engine import check_url, normalise_url

    assert normalise_url("POSTGRES://u@h/db") == "postgresql+psycopg://u@h/db"
    assert normalise_url("Postgres+psycopg://u@h/db") == "postgresql+psycopg://u@h/db"
    assert normalise_url("postgresql+psycopg://u@h/db") == "postgresql+psycopg://u@h/db"
    assert normalise_url("sqlite:///X.db") == "sqlite:///X.db"
    assert Settings(database_url="").database_url == ""  # unset, as before
    for url in ("postgres://postgres:hunter2@x:SECRETTAIL@127.0.0.1/db",
                "postgres://postgres:pa@ss@127.0.0.1:5432/db", "not a url"):
        with pytest.raises(StoreError) as refused:
            check_url(normalise_url(url))
        said = str(refused.value)
        assert refused.value.code == "STORE_URL_INVALID"
        assert "SECRETTAIL" not in said and "hunter2" not in said and "ss@" not in said
        assert "%40" in said
    with pytest.raises(StoreError, match="names no database"):
        check_url(normalise_url("postgres://"))
    check_url(normalise_url("postgres:///db?host=h&user=u"))
    check_url("postgresql+psycopg://u:p%40ss@h/db")
    check_url("sqlite:///x.db")
    check_url("sqlite+pysqlite:///x.db")


def test_a_database_the_engine_does_not_use_is_an_invalid_store_url() -> None:
    """`mysql://` (and a PostgreSQL driver but psycopg) failed with DEPENDENCY_MISSING,
    which advised installing the engine again (a trial's leftover item)."""
    import pytest

    from investigation.errors import StoreError
    from investigation.store.engine import check_url, normalise_url

    for url, named in (("mysql://root:hunter2@127.0.0.1/test", "(mysql)"),
                       ("postgresql+psycopg2://u:hunter2@h/db", "(postgresql+psycopg2)"),
                       ("mssql+pyodbc://u@dsn", "(mssql+pyodbc)"),
                       ("postgresql+://u:hunter2@h/db", "(postgresql+)"),
                       ("sqlite+:///x.db", "(sqlite+)")):
        with pytest.raises(StoreError) as refused:
            check_url(normalise_url(url))
        assert refused.value.code == "STORE_URL_INVALID"
        assert named in refused.value.message and "hunter2" not in refused.value.message
        assert "postgresql+psycopg://" in refused.value.message


def test_cases_shows_times_in_utc_to_the_second() -> None:
    """`cases` showed `updated` without a zone and `retry not before` with microseconds
    and +00:00, wrapped over two lines (two trials)."""
    import workers.cli  # noqa: F401  (it registers cli_ops's commands, importing it)
    from workers.cli_ops import _utc_seconds

    assert _utc_seconds("2026-12-07T13:23:29.092589+00:00") == "2026-12-07T13:23:29Z"
    assert _utc_seconds("2026-12-07T14:23:29+01:00") == "2026-12-07T13:23:29Z"
    assert _utc_seconds("not a time") == "not a time"


def test_a_variable_set_empty_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """`INVESTIGATE_LOG_FORMAT= investigate status` refused every command (CONFIG_INVALID)
    while an empty INVESTIGATE_DATABASE_URL meant the default store (a new user's trial):
    every INVESTIGATE_* variable set empty now means its default."""
    from workers.settings import load_settings

    for name in ("LOG_FORMAT", "HOME", "DATABASE_URL", "REDIS_URL", "PROVIDERS", "CONFIG",
                 "LOCK_TTL_S", "QUEUE"):
        monkeypatch.setenv(f"INVESTIGATE_{name}", "")
    settings = load_settings()
    assert (settings.log_format, settings.home, settings.database_url, settings.redis_url,
            settings.providers, settings.config, settings.lock_ttl_s, settings.queue) == (
        "text", Path(".investigate"), None, None, None, None, 300, "cases")


@pytest.mark.parametrize(("given", "read"), [("JSON", "json"), (" json ", "json"),
                                             ("Text", "text"), (" ", "text"), ("\t\n", "text")])
def test_the_log_format_in_any_case(monkeypatch: pytest.MonkeyPatch, given: str,
                                    read: str) -> None:
    from workers.settings import load_settings

    monkeypatch.setenv("INVESTIGATE_LOG_FORMAT", given)
    assert load_settings().log_format == read


def test_an_unknown_log_format_is_still_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from investigation.errors import InvestigationError
    from workers.settings import load_settings

    monkeypatch.setenv("INVESTIGATE_LOG_FORMAT", "xml")
    with pytest.raises(InvestigationError, match="INVESTIGATE_LOG_FORMAT"):
        load_settings()
