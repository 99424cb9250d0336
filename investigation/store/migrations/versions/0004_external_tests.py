"""external tests: test_request

Revision ID: 0004_external_tests
Revises: 0003_delivery_counter
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = '0004_external_tests'
down_revision = '0003_delivery_counter'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'test_request',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('case_id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column('revision', sa.Integer(), nullable=False),
        sa.Column('step_seq', sa.Integer(), nullable=False),
        sa.Column('hypothesis_id', sa.Integer(), nullable=False),
        sa.Column('request_id', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column('kind', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column('cost_units', sa.Integer(), nullable=False),
        sa.Column('artifact_path', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column('request_sha256', sqlmodel.sql.sqltypes.AutoString(length=64),
                  nullable=False),
        sa.Column('secret_sha256', sqlmodel.sql.sqltypes.AutoString(length=64),
                  nullable=False),
        sa.Column('deadline_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column('status', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column('feedback_json', sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column('feedback_sha256', sqlmodel.sql.sqltypes.AutoString(length=64),
                  nullable=True),
        sa.Column('evidence_id', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=True),
        sa.Column('created_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column('submitted_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.Column('closed_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.ForeignKeyConstraint(['case_id'], ['case.id']),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('case_id', 'request_id'),
        sa.UniqueConstraint('case_id', 'revision', 'step_seq'),
    )
    with op.batch_alter_table('test_request', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_test_request_case_id'), ['case_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('test_request', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_test_request_case_id'))
    op.drop_table('test_request')
