"""case entry function: a PostgreSQL stage entry that changes the case row locks it and
reads the whole row and the step's stage markers in one round trip (issue 13, decision 141)

Schema (PostgreSQL only; SQLite reads both in one joined query and gets nothing):

* function ``investigation_case_row_and_markers(case_id, revision, step_seq)``: locks the
  case row (``SELECT ... FOR UPDATE``), then reads every column of the row with the
  step's ``stage_run`` rows in a second statement which, in a ``VOLATILE`` PL/pgSQL
  function under READ COMMITTED, takes its own snapshot after the lock was granted (as
  ``investigation_case_and_markers`` of migration ``0010_entry_function`` does for the
  entry columns). One row per marker (``stage`` and ``output_json``), each with the case
  row's columns; one row with NULL marker columns when the step has none; no row when
  the case does not exist. A migration that changes the ``case`` table's columns
  replaces this function too (``tests/integration/test_postgres_store.py`` compares
  its columns with the table's and the model's).

Data: none.

Downgrade drops the function: workers of the previous version never call it; workers
of this version need it (at ``0010_entry_function`` they stop with ``STORE_NOT_MIGRATED``,
or fail a case stage's entry when the migration check is bypassed).

Revision ID: 0011_case_entry_function
Revises: 0010_entry_function
"""

from __future__ import annotations

from alembic import op

revision = '0011_case_entry_function'
down_revision = '0010_entry_function'
branch_labels = None
depends_on = None

#: The function's name, as ``investigation.loop.stagebase`` calls it.
FUNCTION = "investigation_case_row_and_markers"

CREATE = f'''
CREATE OR REPLACE FUNCTION {FUNCTION}(p_case_id varchar, p_revision integer,
                                      p_step_seq integer)
RETURNS TABLE (id varchar, package_id varchar, current_revision integer, state varchar,
               blocked_reason varchar, head_seq integer, head_hash varchar,
               last_outcome varchar, last_reason varchar,
               retry_not_before timestamp with time zone, llm_retry_id varchar,
               objective_json varchar, session_json varchar,
               created_at timestamp with time zone, updated_at timestamp with time zone,
               stage varchar, output_json varchar)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM 1 FROM "case" AS c WHERE c.id = p_case_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    -- A new statement: a new snapshot, taken after the row lock was granted.
    RETURN QUERY
        SELECT c.id, c.package_id, c.current_revision, c.state, c.blocked_reason,
               c.head_seq, c.head_hash, c.last_outcome, c.last_reason,
               c.retry_not_before, c.llm_retry_id, c.objective_json, c.session_json,
               c.created_at, c.updated_at, r.stage, r.output_json
          FROM "case" AS c
          LEFT JOIN stage_run AS r
            ON r.case_id = p_case_id AND r.revision = p_revision
           AND r.step_seq = p_step_seq
         WHERE c.id = p_case_id;
END
$$
'''


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CREATE)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION IF EXISTS {FUNCTION}(varchar, integer, integer)")
