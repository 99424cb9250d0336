"""The store refuses to rewrite what the engine published (issue 13; DESIGN.md "Cost that does
not grow with history").

Triggers on SQLite and PostgreSQL, created by migration ``0007_compact_store`` (and, for
the tables it adds, ``0008_bounded_history``):

* :data:`IMMUTABLE_TABLES` are write-once: every UPDATE and DELETE (and, on PostgreSQL,
  TRUNCATE) is refused.
* :data:`GUARDED_TABLES` have a few columns the engine legitimately changes once, while the
  row is *open* (an evidence record until it is assessed, a question while it is open, a
  revision until its policy is frozen); any other change, a change of a closed row, and
  every DELETE are refused.
* :data:`ATTEMPT_GUARDS` (migration ``0013_attempt_guard``): a model attempt may change
  while it is ``sent``, once closed never; none is ever deleted.
* :data:`INSERT_GUARDS` (migration ``0009_closed_history``) refuse an INSERT into the past
  of a case: an evidence record must be newer than every record of its case, a
  novelty-index row must name the case's newest record, and an audit note must belong to
  a step not published yet. What a published checkpoint counted therefore stays counted,
  and a step's live check reads only the rows newer than its head (decision 121).

A refused statement fails with ``STORE_IMMUTABLE`` in its message (SQLite ``RAISE(ABORT)``,
PostgreSQL SQLSTATE ``55000``), the transaction is rolled back and nothing changes. The
checkpoint replay (``loop.checkpoints``) still re-reads every byte when a process first
meets a case, after a redelivery, at export and on ``investigate verify``, so a change
made by someone who can also drop triggers is found there.

Maintenance: SQLite names each guarded column in its trigger, and Alembic's batch mode
recreates a table it alters (its triggers go with it). A migration that adds a column to,
or batch-alters, a table listed here must call :func:`drop_guards` first and
:func:`create_guards` after; ``tests/integration/test_compact_store.py`` checks that every
guard exists after the migrations on both databases.
"""

from __future__ import annotations

from sqlalchemy import inspect
from sqlalchemy.engine import Connection

#: Tables whose rows never change once written.
IMMUTABLE_TABLES = ("package", "hypothesis_birth", "ledger_entry", "artifact", "blob",
                    "checkpoint", "stage_run", "plan", "evidence_key", "hypothesis_note")

#: Table -> (SQL condition on ``OLD`` under which the row is still open, the columns that
#: may change while it is).
GUARDED_TABLES: dict[str, tuple[str, tuple[str, ...]]] = {
    "evidence": ("NOT OLD.assessed", ("assessed", "assessment_score", "refund_units")),
    "question": ("OLD.status = 'open'", ("status", "resolved_step", "resolution_evidence_json")),
    "revision": ("OLD.policy_json IS NULL", ("policy_json", "policy_sha256")),
}

#: Guarded as :data:`GUARDED_TABLES` are, from migration ``0013_attempt_guard`` on (the
#: migrations before it create only theirs): a model attempt is open while ``sent`` and
#: the gateway closes it once, with its answer or failure; its counts, status and cost are
#: what ``status`` and the report sum (a hostile trial changed them, no guard dropped).
ATTEMPT_GUARDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "llm_attempt": ("OLD.status = 'sent'", (
        "status", "response_path", "response_sha256", "http_status", "error_code",
        "error_message", "prompt_tokens", "completion_tokens", "finish_reason",
        "cost_micros", "finished_at")),
}

#: Table -> the SQL condition on ``NEW`` (the same on SQLite and PostgreSQL) under which
#: an INSERT is refused: a row that would change what a published checkpoint counted.
INSERT_GUARDS: dict[str, str] = {
    "evidence": "NEW.ordinal <= (SELECT coalesce(max(e.ordinal), 0) FROM evidence e "
                "WHERE e.case_id = NEW.case_id)",
    "evidence_key": "NOT EXISTS (SELECT 1 FROM evidence e WHERE e.case_id = NEW.case_id "
                    "AND e.evidence_id = NEW.evidence_id AND e.ordinal = (SELECT "
                    "max(m.ordinal) FROM evidence m WHERE m.case_id = NEW.case_id))",
    "hypothesis_note": "NEW.step_seq <= (SELECT c.head_seq FROM \"case\" c "
                       "WHERE c.id = NEW.case_id)",
}

#: Prefix of every trigger (and PostgreSQL function) this module creates.
PREFIX = "guard_"
#: The marker in every refusal message.
CODE = "STORE_IMMUTABLE"


def _message(table: str) -> str:
    return (f"{CODE}: {table} rows are published facts and cannot be changed or deleted; "
            "a new fact is a new row")


def _insert_message(table: str) -> str:
    article = "an" if table[0] in "aeiou" else "a"
    return (f"{CODE}: {article} {table} row cannot be added to what a published checkpoint "
            "counted; new rows belong to the newest record or the step in progress")


def _present(conn: Connection, tables: tuple[str, ...]) -> tuple[str, ...]:
    """The tables of ``tables`` that exist (a migration creates its guards for the tables
    it has created so far: ``evidence_key`` and ``hypothesis_note`` come with 0008)."""
    existing = set(inspect(conn).get_table_names())
    return tuple(t for t in tables if t in existing)


def create_guards(conn: Connection, *, inserts: bool = True, attempts: bool = False) -> None:
    """Create every guard of the tables that exist (idempotent on SQLite: existing
    triggers are kept).

    Args:
        inserts: also the :data:`INSERT_GUARDS` (migrations before ``0009`` pass
            ``False``: they created the UPDATE and DELETE guards only).
        attempts: also the :data:`ATTEMPT_GUARDS` (``0013_attempt_guard`` and later; the
            migrations before it call this without them, so that each creates what it
            always did)."""
    if conn.dialect.name == "postgresql":
        _create_postgres(conn, GUARDED_TABLES)
        if inserts:
            _create_postgres_inserts(conn)
    else:
        _create_sqlite(conn, GUARDED_TABLES)
        if inserts:
            _create_sqlite_inserts(conn)
    if attempts:
        create_attempt_guards(conn)


def create_attempt_guards(conn: Connection) -> None:
    """Create the :data:`ATTEMPT_GUARDS` only (migration ``0013``)."""
    if conn.dialect.name == "postgresql":
        _create_postgres(conn, ATTEMPT_GUARDS, immutable=False)
    else:
        _create_sqlite(conn, ATTEMPT_GUARDS, immutable=False)


def drop_attempt_guards(conn: Connection) -> None:
    """Drop the :data:`ATTEMPT_GUARDS` only (downgrade of ``0013``)."""
    for table in _present(conn, tuple(ATTEMPT_GUARDS)):
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql(f'DROP TRIGGER IF EXISTS {PREFIX}{table} ON "{table}"')
            conn.exec_driver_sql(f'DROP TRIGGER IF EXISTS {PREFIX}{table}_truncate '
                                 f'ON "{table}"')
            conn.exec_driver_sql(f"DROP FUNCTION IF EXISTS {PREFIX}{table}_fn()")
        else:
            for op in ("update", "delete"):
                conn.exec_driver_sql(f'DROP TRIGGER IF EXISTS "{PREFIX}{table}_{op}"')


def drop_insert_guards(conn: Connection) -> None:
    """Drop the :data:`INSERT_GUARDS` only (downgrade of ``0009``)."""
    for table in _present(conn, tuple(INSERT_GUARDS)):
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql(f'DROP TRIGGER IF EXISTS {PREFIX}{table}_insert '
                                 f'ON "{table}"')
            conn.exec_driver_sql(f"DROP FUNCTION IF EXISTS {PREFIX}{table}_insert_fn()")
        else:
            conn.exec_driver_sql(f'DROP TRIGGER IF EXISTS "{PREFIX}{table}_insert"')


def drop_guards(conn: Connection) -> None:
    """Drop every guard. For migrations that recreate a guarded table, and for tests that
    show what the replay finds when someone with DDL rights rewrites the store."""
    if conn.dialect.name == "postgresql":
        for table in _present(conn, (*IMMUTABLE_TABLES, *GUARDED_TABLES, *ATTEMPT_GUARDS)):
            conn.exec_driver_sql(f'DROP TRIGGER IF EXISTS {PREFIX}{table} ON "{table}"')
            conn.exec_driver_sql(f'DROP TRIGGER IF EXISTS {PREFIX}{table}_truncate '
                                 f'ON "{table}"')
        for table in _present(conn, tuple(INSERT_GUARDS)):
            conn.exec_driver_sql(f'DROP TRIGGER IF EXISTS {PREFIX}{table}_insert '
                                 f'ON "{table}"')
        for table in (*GUARDED_TABLES, *ATTEMPT_GUARDS):
            conn.exec_driver_sql(f"DROP FUNCTION IF EXISTS {PREFIX}{table}_fn()")
        for table in INSERT_GUARDS:
            conn.exec_driver_sql(f"DROP FUNCTION IF EXISTS {PREFIX}{table}_insert_fn()")
        conn.exec_driver_sql(f"DROP FUNCTION IF EXISTS {PREFIX}refuse()")
        return
    for (name,) in conn.exec_driver_sql(
            "SELECT name FROM sqlite_master WHERE type = 'trigger' AND name LIKE ?",
            (f"{PREFIX}%",)).all():
        conn.exec_driver_sql(f'DROP TRIGGER IF EXISTS "{name}"')


def guard_names(conn: Connection) -> set[str]:
    """The names of the guard triggers present (for checks and tests)."""
    if conn.dialect.name == "postgresql":
        rows = conn.exec_driver_sql(
            "SELECT t.tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = current_schema() AND NOT t.tgisinternal").all()
    else:
        rows = conn.exec_driver_sql(
            "SELECT name FROM sqlite_master WHERE type = 'trigger'").all()
    return {r[0] for r in rows if str(r[0]).startswith(PREFIX)}


def expected_guard_names(dialect: str) -> set[str]:
    """The trigger names the migrations create on ``dialect`` (:func:`create_guards` with
    ``attempts``)."""
    tables = (*IMMUTABLE_TABLES, *GUARDED_TABLES, *ATTEMPT_GUARDS)
    inserts = {f"{PREFIX}{t}_insert" for t in INSERT_GUARDS}
    if dialect == "postgresql":
        return {f"{PREFIX}{t}" for t in tables} | {f"{PREFIX}{t}_truncate" for t in tables} \
            | inserts
    return {f"{PREFIX}{t}_update" for t in tables} | {f"{PREFIX}{t}_delete" for t in tables} \
        | inserts


def _create_sqlite(conn: Connection, guarded: dict[str, tuple[str, tuple[str, ...]]],
                   immutable: bool = True) -> None:
    """The triggers of the :data:`IMMUTABLE_TABLES` (unless ``immutable`` is false) and
    of the ``guarded`` tables."""
    if immutable:
        for table in _present(conn, IMMUTABLE_TABLES):
            for op in ("UPDATE", "DELETE"):
                conn.exec_driver_sql(
                    f'CREATE TRIGGER IF NOT EXISTS {PREFIX}{table}_{op.lower()} BEFORE {op} '
                    f'ON "{table}" BEGIN SELECT RAISE(ABORT, \'{_message(table)}\'); END')
    for table, (is_open, mutable) in guarded.items():
        columns = [r[1] for r in conn.exec_driver_sql(f'PRAGMA table_info("{table}")').all()]
        frozen = " OR ".join(f'NEW."{c}" IS NOT OLD."{c}"' for c in columns
                             if c not in mutable)
        conn.exec_driver_sql(
            f'CREATE TRIGGER IF NOT EXISTS {PREFIX}{table}_update BEFORE UPDATE ON "{table}" '
            f"WHEN NOT ({is_open}) OR {frozen} "
            f"BEGIN SELECT RAISE(ABORT, '{_message(table)}'); END")
        conn.exec_driver_sql(
            f'CREATE TRIGGER IF NOT EXISTS {PREFIX}{table}_delete BEFORE DELETE ON "{table}" '
            f"BEGIN SELECT RAISE(ABORT, '{_message(table)}'); END")


def _create_sqlite_inserts(conn: Connection) -> None:
    for table in _present(conn, tuple(INSERT_GUARDS)):
        conn.exec_driver_sql(
            f'CREATE TRIGGER IF NOT EXISTS {PREFIX}{table}_insert BEFORE INSERT ON "{table}" '
            f"WHEN {INSERT_GUARDS[table]} "
            f"BEGIN SELECT RAISE(ABORT, '{_insert_message(table)}'); END")


def _create_postgres(conn: Connection, guarded: dict[str, tuple[str, tuple[str, ...]]],
                     immutable: bool = True) -> None:
    """As :func:`_create_sqlite`, with PL/pgSQL functions."""
    conn.exec_driver_sql(
        f"CREATE OR REPLACE FUNCTION {PREFIX}refuse() RETURNS trigger LANGUAGE plpgsql AS $$ "
        f"BEGIN RAISE EXCEPTION '{CODE}: %% rows are published facts and cannot be changed "
        "or deleted; a new fact is a new row', TG_TABLE_NAME USING ERRCODE = '55000'; "
        "END $$")
    if immutable:
        for table in _present(conn, IMMUTABLE_TABLES):
            _pg_triggers(conn, table, f"{PREFIX}refuse()", "UPDATE OR DELETE")
    for table, (is_open, mutable) in guarded.items():
        keep = ", ".join(f"'{c}'" for c in mutable)
        conn.exec_driver_sql(
            f"CREATE OR REPLACE FUNCTION {PREFIX}{table}_fn() RETURNS trigger "
            f"LANGUAGE plpgsql AS $$ BEGIN "
            f"IF TG_OP = 'UPDATE' AND ({is_open}) AND "
            f"(to_jsonb(NEW) - ARRAY[{keep}]) = (to_jsonb(OLD) - ARRAY[{keep}]) "
            f"THEN RETURN NEW; END IF; "
            f"RAISE EXCEPTION '{_message(table)}' USING ERRCODE = '55000'; END $$")
        _pg_triggers(conn, table, f"{PREFIX}{table}_fn()", "UPDATE OR DELETE")


def _create_postgres_inserts(conn: Connection) -> None:
    for table in _present(conn, tuple(INSERT_GUARDS)):
        conn.exec_driver_sql(
            f"CREATE OR REPLACE FUNCTION {PREFIX}{table}_insert_fn() RETURNS trigger "
            f"LANGUAGE plpgsql AS $$ BEGIN IF {INSERT_GUARDS[table]} THEN "
            f"RAISE EXCEPTION '{_insert_message(table)}' USING ERRCODE = '55000'; END IF; "
            f"RETURN NEW; END $$")
        conn.exec_driver_sql(f'DROP TRIGGER IF EXISTS {PREFIX}{table}_insert ON "{table}"')
        conn.exec_driver_sql(
            f'CREATE TRIGGER {PREFIX}{table}_insert BEFORE INSERT ON "{table}" '
            f"FOR EACH ROW EXECUTE FUNCTION {PREFIX}{table}_insert_fn()")


def _pg_triggers(conn: Connection, table: str, function: str, ops: str) -> None:
    conn.exec_driver_sql(f'DROP TRIGGER IF EXISTS {PREFIX}{table} ON "{table}"')
    conn.exec_driver_sql(f'CREATE TRIGGER {PREFIX}{table} BEFORE {ops} ON "{table}" '
                         f"FOR EACH ROW EXECUTE FUNCTION {function}")
    conn.exec_driver_sql(f'DROP TRIGGER IF EXISTS {PREFIX}{table}_truncate ON "{table}"')
    conn.exec_driver_sql(f'CREATE TRIGGER {PREFIX}{table}_truncate BEFORE TRUNCATE '
                         f'ON "{table}" FOR EACH STATEMENT EXECUTE FUNCTION {PREFIX}refuse()')
