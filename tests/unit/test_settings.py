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
    assert normalise_url("postgresql://h/db") == "postgresql://h/db"
