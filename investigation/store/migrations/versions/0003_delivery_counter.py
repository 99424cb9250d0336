"""delivery counter: durable per-stage delivery counts (poisoned stages are parked)

Revision ID: 0003_delivery_counter
Revises: 0002_early_diagnosis
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = '0003_delivery_counter'
down_revision = '0002_early_diagnosis'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'stage_delivery',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('case_id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column('revision', sa.Integer(), nullable=False),
        sa.Column('step_seq', sa.Integer(), nullable=False),
        sa.Column('stage', sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column('deliveries', sa.Integer(), nullable=False),
        sa.Column('unfinished', sa.Integer(), nullable=False),
        sa.Column('last_delivered_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('case_id', 'revision', 'step_seq', 'stage'),
    )
    with op.batch_alter_table('stage_delivery', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_stage_delivery_case_id'), ['case_id'],
                              unique=False)


def downgrade() -> None:
    with op.batch_alter_table('stage_delivery', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_stage_delivery_case_id'))
    op.drop_table('stage_delivery')
