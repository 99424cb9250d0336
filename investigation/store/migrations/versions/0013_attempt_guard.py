"""attempt guard: the store refuses to change a model attempt once it is closed, and to
delete one (decision 195; a hostile trial changed an attempt's token counts, status and
cost, which `status` and the report sum, without dropping any guard)

Schema: triggers on ``llm_attempt`` (``investigation.store.guards.ATTEMPT_GUARDS``;
SQLite ``guard_llm_attempt_update`` and ``guard_llm_attempt_delete``, PostgreSQL
``guard_llm_attempt`` with its function and ``guard_llm_attempt_truncate``): while an
attempt is ``sent`` the gateway may close it once (its answer or failure: status,
response, counts, cost, finish time); any other change, a change of a closed attempt,
and every DELETE are refused with ``STORE_IMMUTABLE``.

Data: none. Every store the engine wrote already keeps this rule (the gateway's only
UPDATE of an attempt names ``status = 'sent'``).

Downgrade drops the triggers. A later migration that alters ``llm_attempt`` drops and
creates them again (``guards`` module docstring).

Revision ID: 0013_attempt_guard
Revises: 0012_attempt_currency
"""

from __future__ import annotations

from alembic import op

from investigation.store import guards

revision = '0013_attempt_guard'
down_revision = '0012_attempt_currency'
branch_labels = None
depends_on = None


def upgrade() -> None:
    guards.create_attempt_guards(op.get_bind())


def downgrade() -> None:
    guards.drop_attempt_guards(op.get_bind())
