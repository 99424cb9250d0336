"""model usage: finish reason, money reserved and spent per attempt, hypothesis per call

Revision ID: 0006_model_usage
Revises: 0005_case_session
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = '0006_model_usage'
down_revision = '0005_case_session'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('llm_attempt', schema=None) as batch_op:
        batch_op.add_column(sa.Column('finish_reason',
                                      sqlmodel.sql.sqltypes.AutoString(length=64),
                                      nullable=True))
        batch_op.add_column(sa.Column('reserved_micros', sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column('cost_micros', sa.BigInteger(), nullable=True))
    with op.batch_alter_table('llm_operation', schema=None) as batch_op:
        batch_op.add_column(sa.Column('hypothesis_id', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('llm_operation', schema=None) as batch_op:
        batch_op.drop_column('hypothesis_id')
    with op.batch_alter_table('llm_attempt', schema=None) as batch_op:
        batch_op.drop_column('cost_micros')
        batch_op.drop_column('reserved_micros')
        batch_op.drop_column('finish_reason')
