"""bounded history: a novelty index of item keys, audit notes as rows, evidence indexes
(issue 13: a step reads what it needs, not the whole case)

Schema:

* ``evidence_key`` (case, revision, hypothesis, sha256 of an item key, the record that
  found it first), unique per hypothesis and key: the novelty of a result is looked up
  by its own keys.
* ``hypothesis_note`` (case, revision, hypothesis, step, note), one per accepted reply
  that carried a note; ``budget_account.notes_json`` (the whole list, rewritten at every
  step) is dropped.
* indexes ``evidence (case_id, revision, hypothesis_id, ordinal)``, ``evidence (case_id,
  ordinal)`` and ``evidence (case_id, revision, hypothesis_id, fingerprint)``.
* the guards of ``investigation.store.guards`` for the two new write-once tables.

Data: every evidence record's item keys, in creation order (the first record to find a
key is named), and every account's notes, in their order.

Downgrade restores ``budget_account.notes_json`` from the notes and drops the rest. It
does not rewrite state checkpoints: a case that published steps under this revision has
states in the bounded format (``docs/decisions.md``, 74), which the code of 0007 reads as
listing no evidence and refuses (``STATE_TAMPERED``). Downgrade only a store whose cases
have not stepped since the upgrade, or restore the backup taken before it.

Revision ID: 0008_bounded_history
Revises: 0007_compact_store
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import sqlalchemy as sa
import sqlmodel
from alembic import op

from investigation.store import guards

revision = '0008_bounded_history'
down_revision = '0007_compact_store'
branch_labels = None
depends_on = None

BATCH = 500
log = logging.getLogger("alembic.runtime.migration")


def _key_sha(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def upgrade() -> None:
    bind = op.get_bind()
    op.create_table(
        'evidence_key',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('case_id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column('revision', sa.Integer(), nullable=False),
        sa.Column('hypothesis_id', sa.Integer(), nullable=False),
        sa.Column('key_sha256', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column('evidence_id', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('case_id', 'revision', 'hypothesis_id', 'key_sha256'),
    )
    op.create_table(
        'hypothesis_note',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('case_id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column('revision', sa.Integer(), nullable=False),
        sa.Column('hypothesis_id', sa.Integer(), nullable=False),
        sa.Column('step_seq', sa.Integer(), nullable=False),
        sa.Column('note', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('case_id', 'revision', 'hypothesis_id', 'step_seq'),
    )
    op.create_index('ix_evidence_hypothesis', 'evidence',
                    ['case_id', 'revision', 'hypothesis_id', 'ordinal'], unique=False)
    op.create_index('ix_evidence_ordinal', 'evidence', ['case_id', 'ordinal'], unique=False)
    op.create_index('ix_evidence_fingerprint', 'evidence',
                    ['case_id', 'revision', 'hypothesis_id', 'fingerprint'], unique=False)
    _fill_keys(bind)
    _move_notes(bind)
    with op.batch_alter_table('budget_account') as batch:
        batch.drop_column('notes_json')
    guards.create_guards(bind, inserts=False)  # the INSERT guards came with 0009


def _fill_keys(bind: Any) -> None:
    table = sa.table('evidence_key', sa.column('case_id'), sa.column('revision'),
                     sa.column('hypothesis_id'), sa.column('key_sha256'),
                     sa.column('evidence_id'))
    seen: set[tuple[str, int, int, str]] = set()
    rows: list[dict[str, Any]] = []
    result = bind.execute(sa.text(
        "SELECT case_id, revision, hypothesis_id, evidence_id, item_keys_json FROM evidence "
        "ORDER BY case_id, ordinal"))
    for case_id, rev, hid, evidence_id, keys_json in result:
        try:
            keys = json.loads(keys_json)
        except ValueError:
            keys = []
        for key in keys if isinstance(keys, list) else []:
            ident = (case_id, rev, hid, _key_sha(str(key)))
            if ident in seen:
                continue
            seen.add(ident)
            rows.append({"case_id": case_id, "revision": rev, "hypothesis_id": hid,
                         "key_sha256": ident[3], "evidence_id": evidence_id})
            if len(rows) >= BATCH:
                bind.execute(sa.insert(table), rows)
                rows = []
    if rows:
        bind.execute(sa.insert(table), rows)


def _move_notes(bind: Any) -> None:
    table = sa.table('hypothesis_note', sa.column('case_id'), sa.column('revision'),
                     sa.column('hypothesis_id'), sa.column('step_seq'), sa.column('note'))
    rows: list[dict[str, Any]] = []
    for case_id, rev, hid, notes_json in bind.execute(sa.text(
            "SELECT case_id, revision, hypothesis_id, notes_json FROM budget_account")).all():
        try:
            notes = json.loads(notes_json)
        except ValueError:
            notes = []
        taken: set[int] = set()
        for note in notes if isinstance(notes, list) else []:
            step = note.get("step_seq") if isinstance(note, dict) else None
            # The engine wrote one note per step, a string; anything else was written by
            # hand: a step that is no integer (true is not step 1) or a second note of a
            # step is dropped and said so, a note that is no string is kept as JSON text.
            if type(step) is not int or step in taken:
                log.warning("0008: case %s hypothesis %s: note %r dropped (no step number "
                            "or a second note of its step)", case_id, hid, note)
                continue
            taken.add(step)
            text = note.get("note", "")
            rows.append({"case_id": case_id, "revision": rev, "hypothesis_id": hid,
                         "step_seq": step, "note": text if isinstance(text, str) else
                         json.dumps(text, ensure_ascii=False, sort_keys=True)})
    for start in range(0, len(rows), BATCH):
        bind.execute(sa.insert(table), rows[start:start + BATCH])


def downgrade() -> None:
    bind = op.get_bind()
    with op.batch_alter_table('budget_account') as batch:
        batch.add_column(sa.Column('notes_json', sqlmodel.sql.sqltypes.AutoString(),
                                   nullable=False, server_default='[]'))
    notes: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for case_id, rev, hid, step, note in bind.execute(sa.text(
            "SELECT case_id, revision, hypothesis_id, step_seq, note FROM hypothesis_note "
            "ORDER BY step_seq")).all():
        notes.setdefault((case_id, rev, hid), []).append({"step_seq": step, "note": note})
    for (case_id, rev, hid), entries in notes.items():
        bind.execute(sa.text(
            "UPDATE budget_account SET notes_json = :n WHERE case_id = :c AND revision = :r "
            "AND hypothesis_id = :h"),
            {"n": json.dumps(entries, ensure_ascii=False, sort_keys=True,
                             separators=(",", ":")), "c": case_id, "r": rev, "h": hid})
    op.drop_index('ix_evidence_fingerprint', table_name='evidence')
    op.drop_index('ix_evidence_ordinal', table_name='evidence')
    op.drop_index('ix_evidence_hypothesis', table_name='evidence')
    op.drop_table('hypothesis_note')
    op.drop_table('evidence_key')
