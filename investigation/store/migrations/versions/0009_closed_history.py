"""closed history: the store refuses an INSERT into what a published checkpoint counted
(issue 13, decision 121: a step's live check reads only the rows newer than its head)

Schema:

* triggers ``guard_<table>_insert`` on ``evidence``, ``evidence_key`` and
  ``hypothesis_note`` (``investigation.store.guards.INSERT_GUARDS``): an evidence record
  must be newer than every record of its case, a novelty-index row must name the case's
  newest record, an audit note must belong to a step not published yet;
* indexes ``evidence_key (case_id, evidence_id)`` (a record's index rows),
  ``hypothesis_note (case_id, step_seq)`` (the notes of the steps after a checkpoint) and
  ``ledger_entry (case_id, revision, hypothesis_id, id)`` (an account's newest entry).

Data: none is rewritten. Every store the engine wrote already keeps these rules (ordinals
grow, index rows are written with their record, notes with their step).

Downgrade drops the triggers and the indexes.

Revision ID: 0009_closed_history
Revises: 0008_bounded_history
"""

from __future__ import annotations

from alembic import op

from investigation.store import guards

revision = '0009_closed_history'
down_revision = '0008_bounded_history'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index('ix_evidence_key_record', 'evidence_key', ['case_id', 'evidence_id'],
                    unique=False)
    op.create_index('ix_hypothesis_note_step', 'hypothesis_note', ['case_id', 'step_seq'],
                    unique=False)
    op.create_index('ix_ledger_entry_newest', 'ledger_entry',
                    ['case_id', 'revision', 'hypothesis_id', 'id'], unique=False)
    guards.create_guards(op.get_bind())


def downgrade() -> None:
    guards.drop_insert_guards(op.get_bind())
    op.drop_index('ix_ledger_entry_newest', table_name='ledger_entry')
    op.drop_index('ix_hypothesis_note_step', table_name='hypothesis_note')
    op.drop_index('ix_evidence_key_record', table_name='evidence_key')
