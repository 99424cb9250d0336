"""Alembic environment: runs on the connection the Store hands over (no alembic.ini)."""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

from investigation.store import models  # noqa: F401  (registers the tables)

#: Arbitrary constant for PostgreSQL's advisory lock: concurrent upgrades run one at a time.
MIGRATION_LOCK_KEY = 7_270_001

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=SQLModel.metadata,
                  render_as_batch=connection.dialect.name == "sqlite",
                  transaction_per_migration=False)
with context.begin_transaction():
    if connection.dialect.name == "postgresql":
        connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})")
    context.run_migrations()
