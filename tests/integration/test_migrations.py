"""The migrated schema is exactly the models' schema, on SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

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
