"""early diagnosis: assessment-only deferral of budget accounts

Revision ID: 0002_early_diagnosis
Revises: 0001_initial
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002_early_diagnosis'
down_revision = '0001_initial'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('budget_account') as batch:
        batch.add_column(sa.Column('deferred_by', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('deferred_step', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('budget_account') as batch:
        batch.drop_column('deferred_step')
        batch.drop_column('deferred_by')
