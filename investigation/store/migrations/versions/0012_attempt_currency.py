"""attempt currency: each priced model attempt records the currency its micros are in
(decision 180)

Schema: ``llm_attempt.currency`` (text of at most 8 characters, nullable), the
``limits.currency`` in force when the attempt reserved its money; null for an attempt
without a price.

Data: none. Attempts priced before this migration keep a null currency: their case's
costs are labelled with the currency of the configuration read, as before.

Downgrade drops the column (the labels of later priced attempts are lost with it).

Revision ID: 0012_attempt_currency
Revises: 0011_case_entry_function
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = '0012_attempt_currency'
down_revision = '0011_case_entry_function'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('llm_attempt', schema=None) as batch_op:
        batch_op.add_column(sa.Column('currency', sqlmodel.sql.sqltypes.AutoString(length=8),
                                      nullable=True))


def downgrade() -> None:
    op.drop_column('llm_attempt', 'currency')
