"""entry function: a PostgreSQL stage entry locks the case row and reads the step's
stage markers in one round trip (issue 13, decision 125)

Schema (PostgreSQL only; SQLite reads both in one query already and gets nothing):

* function ``investigation_case_and_markers(case_id, revision, step_seq)``: locks the
  case row (``SELECT ... FOR UPDATE``), then reads the step's ``stage_run`` rows in a
  second statement, which, in a ``VOLATILE`` PL/pgSQL function under READ COMMITTED,
  takes its own snapshot after the lock was granted: what the two statements the client
  sent one after the other read, in one round trip. One row per marker (``stage`` and
  ``output_json``), each with the case's ``head_seq``, ``current_revision``, ``state``
  and ``llm_retry_id``; one row with NULL marker columns when the step has none; no row
  when the case does not exist.

Data: none.

Downgrade drops the function (the engine then reads the two statements again).

Revision ID: 0010_entry_function
Revises: 0009_closed_history
"""

from __future__ import annotations

from alembic import op

revision = '0010_entry_function'
down_revision = '0009_closed_history'
branch_labels = None
depends_on = None

#: The function's name, as ``investigation.loop.stagebase`` calls it.
FUNCTION = "investigation_case_and_markers"

CREATE = f'''
CREATE OR REPLACE FUNCTION {FUNCTION}(p_case_id varchar, p_revision integer,
                                      p_step_seq integer)
RETURNS TABLE (head_seq integer, current_revision integer, state varchar,
               llm_retry_id varchar, stage varchar, output_json varchar)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    c_head integer;
    c_revision integer;
    c_state varchar;
    c_retry varchar;
BEGIN
    SELECT c.head_seq, c.current_revision, c.state, c.llm_retry_id
      INTO c_head, c_revision, c_state, c_retry
      FROM "case" AS c WHERE c.id = p_case_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    -- A new statement: a new snapshot, taken after the row lock was granted.
    RETURN QUERY
        SELECT c_head, c_revision, c_state, c_retry, r.stage, r.output_json
          FROM (SELECT 1) AS one
          LEFT JOIN stage_run AS r
            ON r.case_id = p_case_id AND r.revision = p_revision
           AND r.step_seq = p_step_seq;
END
$$
'''


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CREATE)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION IF EXISTS {FUNCTION}(varchar, integer, integer)")
