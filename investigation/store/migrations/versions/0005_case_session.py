"""lifecycle: the case's research objective and investigation session

Revision ID: 0005_case_session
Revises: 0004_external_tests
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = '0005_case_session'
down_revision = '0004_external_tests'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('case') as batch:
        batch.add_column(sa.Column('objective_json', sqlmodel.sql.sqltypes.AutoString(),
                                   nullable=True))
        batch.add_column(sa.Column('session_json', sqlmodel.sql.sqltypes.AutoString(),
                                   nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('case') as batch:
        batch.drop_column('session_json')
        batch.drop_column('objective_json')
