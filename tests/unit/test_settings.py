"""Settings read from the environment: what an operator's spelling of a URL becomes."""

from __future__ import annotations

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


def test_cases_shows_times_in_utc_to_the_second() -> None:
    """`cases` showed `updated` without a zone and `retry not before` with microseconds
    and +00:00, wrapped over two lines (two trials)."""
    import workers.cli  # noqa: F401  (it registers cli_ops's commands, importing it)
    from workers.cli_ops import _utc_seconds

    assert _utc_seconds("2026-12-07T13:23:29.092589+00:00") == "2026-12-07T13:23:29Z"
    assert _utc_seconds("2026-12-07T14:23:29+01:00") == "2026-12-07T13:23:29Z"
    assert _utc_seconds("not a time") == "not a time"
