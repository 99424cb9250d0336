"""model usage: finish reason, money reserved and spent per attempt, hypothesis per call

Revision ID: 0006_model_usage
Revises: 0005_case_session
"""

from __future__ import annotations

import json

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
    _backfill_hypotheses()


def _backfill_hypotheses() -> None:
    """Each existing operation's hypothesis, from its step's ``build_context`` record (the
    step's selected hypothesis), so usage per hypothesis covers calls made before."""
    conn = op.get_bind()
    rows = conn.execute(sa.text(
        "SELECT o.id, r.output_json FROM llm_operation o JOIN stage_run r "
        "ON r.case_id = o.case_id AND r.revision = o.revision AND r.step_seq = o.step_seq "
        "AND r.stage = 'build_context'")).all()
    for op_id, output in rows:
        try:
            hid = json.loads(output).get("hypothesis_id")
        except (ValueError, AttributeError):
            continue
        if isinstance(hid, int):
            conn.execute(sa.text("UPDATE llm_operation SET hypothesis_id = :h WHERE id = :i"),
                         {"h": hid, "i": op_id})


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite 3.35+): a batch copy of llm_operation would have to drop
    # the table llm_attempt's foreign key points at.
    op.drop_column('llm_operation', 'hypothesis_id')
    for column in ('cost_micros', 'reserved_micros', 'finish_reason'):
        op.drop_column('llm_attempt', column)
