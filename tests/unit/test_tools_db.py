"""db.tables, db.schema and db.query: happy paths and the read-only construction."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import pytest

from investigation.cases.snapshot import DictSnapshot
from investigation.config import ToolLimits
from investigation.errors import ToolError
from investigation.tools import ToolRouter


def build_db(*statements: str) -> bytes:
    conn = sqlite3.connect(":memory:")
    try:
        for statement in statements:
            conn.execute(statement)
        conn.commit()
        return conn.serialize()
    finally:
        conn.close()


APP_DB = build_db(
    "CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT NOT NULL DEFAULT 'anon', "
    "email TEXT UNIQUE, avatar BLOB)",
    "CREATE INDEX users_name ON users(name)",
    "CREATE TRIGGER users_ai AFTER INSERT ON users BEGIN SELECT 1; END",
    "CREATE VIEW named AS SELECT id, name FROM users WHERE name <> 'anon'",
    "INSERT INTO users VALUES (1, 'ada', 'ada@example.org', x'00ff')",
    "INSERT INTO users VALUES (2, 'bob', NULL, NULL)",
    "INSERT INTO users VALUES (3, 'bob', NULL, NULL)",
)
AUDIT_DB = build_db("CREATE TABLE events (id INTEGER, kind TEXT)",
                    "CREATE TABLE users (uid INTEGER)")


def make_router(dbs: dict[str, bytes] | None = None, **limits: object) -> ToolRouter:
    snapshot = DictSnapshot({"a.py": b"x\n"}, dbs={"app.sqlite": APP_DB} if dbs is None else dbs)
    return ToolRouter(snapshot, ToolLimits(**limits))


def refusal(router: ToolRouter, operation: str, arguments: dict[str, object]) -> ToolError:
    with pytest.raises(ToolError) as info:
        router.validate(operation, arguments)
    with pytest.raises(ToolError) as again:
        router.execute(operation, arguments)
    assert again.value.code == info.value.code
    return info.value


def row_key(values: list[object]) -> str:
    canonical = json.dumps(values, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "row:" + hashlib.sha256(canonical.encode()).hexdigest()[:16]


# -- db.tables / db.schema -----------------------------------------------------------


def test_db_tables_every_database_sorted() -> None:
    router = make_router({"app.sqlite": APP_DB, "audit.sqlite": AUDIT_DB})
    result = router.execute("db.tables", {})
    assert result.items == [
        {"key": "app.sqlite:named", "database": "app.sqlite", "table": "named", "type": "view"},
        {"key": "app.sqlite:users", "database": "app.sqlite", "table": "users", "type": "table"},
        {"key": "audit.sqlite:events", "database": "audit.sqlite", "table": "events",
         "type": "table"},
        {"key": "audit.sqlite:users", "database": "audit.sqlite", "table": "users",
         "type": "table"},
    ]
    assert result.warnings == []


def test_db_schema_columns_ddl_indexes_triggers() -> None:
    result = make_router().execute("db.schema", {"table": "users"})
    assert result.items == [
        {"key": "app.sqlite:users.id", "column": "id", "type": "INTEGER", "notnull": False,
         "default": None, "pk": 1},
        {"key": "app.sqlite:users.name", "column": "name", "type": "TEXT", "notnull": True,
         "default": "'anon'", "pk": 0},
        {"key": "app.sqlite:users.email", "column": "email", "type": "TEXT", "notnull": False,
         "default": None, "pk": 0},
        {"key": "app.sqlite:users.avatar", "column": "avatar", "type": "BLOB",
         "notnull": False, "default": None, "pk": 0},
        {"key": "app.sqlite:users#ddl",
         "ddl": "CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT NOT NULL DEFAULT "
                "'anon', email TEXT UNIQUE, avatar BLOB)"},
        {"key": "app.sqlite:users#index:sqlite_autoindex_users_1",
         "index": "sqlite_autoindex_users_1", "unique": True, "origin": "u",
         "columns": ["email"], "ddl": None},
        {"key": "app.sqlite:users#index:users_name", "index": "users_name", "unique": False,
         "origin": "c", "columns": ["name"], "ddl": "CREATE INDEX users_name ON users(name)"},
        {"key": "app.sqlite:users#trigger:users_ai", "trigger": "users_ai",
         "ddl": "CREATE TRIGGER users_ai AFTER INSERT ON users BEGIN SELECT 1; END"},
    ]
    assert result.stats == {"database": "app.sqlite", "table": "users", "type": "table",
                            "items": 8}


def test_db_schema_view_and_case_insensitive_name() -> None:
    result = make_router().execute("db.schema", {"table": "NAMED"})
    assert [i["key"] for i in result.items] == ["app.sqlite:named.id", "app.sqlite:named.name",
                                                "app.sqlite:named#ddl"]
    assert result.stats["type"] == "view"


def test_db_schema_several_databases() -> None:
    router = make_router({"app.sqlite": APP_DB, "audit.sqlite": AUDIT_DB})
    result = router.execute("db.schema", {"table": "events"})
    assert [i["key"] for i in result.items] == ["audit.sqlite:events.id",
                                                "audit.sqlite:events.kind",
                                                "audit.sqlite:events#ddl"]
    result = router.execute("db.schema", {"table": "audit.sqlite.users"})
    assert [i["key"] for i in result.items] == ["audit.sqlite:users.uid",
                                                "audit.sqlite:users#ddl"]
    assert refusal(router, "db.schema", {"table": "users"}).code == "TOOL_INVALID_ARGUMENTS"


def test_db_schema_unknown_table() -> None:
    assert refusal(make_router(), "db.schema", {"table": "nope"}).code == "TOOL_NOT_FOUND"


@pytest.mark.parametrize(("operation", "arguments"), [
    ("db.tables", {}), ("db.schema", {"table": "t"}), ("db.query", {"sql": "SELECT 1"})])
def test_no_database(operation: str, arguments: dict[str, object]) -> None:
    assert refusal(make_router({}), operation, arguments).code == "TOOL_NO_DATABASE"


# -- db.query ------------------------------------------------------------------------


def test_db_query_rows_keys_and_columns() -> None:
    result = make_router().execute(
        "db.query", {"sql": "SELECT id, name, avatar FROM users ORDER BY id"})
    assert result.items == [
        {"key": row_key([1, "ada", {"$hex": "00ff"}]),
         "row": {"id": 1, "name": "ada", "avatar": {"$hex": "00ff"}}},
        {"key": row_key([2, "bob", None]), "row": {"id": 2, "name": "bob", "avatar": None}},
        {"key": row_key([3, "bob", None]), "row": {"id": 3, "name": "bob", "avatar": None}},
    ]
    assert result.stats == {"database": "app.sqlite", "columns": ["id", "name", "avatar"],
                            "rows": 3, "items": 3}
    assert result.warnings == []
    assert result.arguments == {"sql": "SELECT id, name, avatar FROM users ORDER BY id",
                                "params": [], "max_rows": 200}


def test_db_query_duplicate_rows_get_distinct_keys_and_names() -> None:
    result = make_router().execute(
        "db.query", {"sql": "SELECT name, name FROM users WHERE name = ? ORDER BY id",
                     "params": ["bob"]})
    base = row_key(["bob", "bob"])
    assert result.items == [{"key": base, "row": {"name": "bob", "name:2": "bob"}},
                            {"key": base + ":2", "row": {"name": "bob", "name:2": "bob"}}]
    assert result.stats["columns"] == ["name", "name"]


def test_db_query_truncated_and_empty() -> None:
    router = make_router()
    result = router.execute("db.query", {"sql": "SELECT id FROM users ORDER BY id",
                                         "max_rows": 2})
    assert [i["row"]["id"] for i in result.items] == [1, 2]
    assert result.warnings == ["TRUNCATED"]
    result = router.execute("db.query", {"sql": "SELECT id FROM users WHERE id > 99"})
    assert result.items == []
    assert result.warnings == ["EMPTY_RESULT"]
    assert result.stats["columns"] == ["id"]


def test_db_query_line_cut_and_special_values() -> None:
    result = make_router(max_line_bytes=40).execute(
        "db.query", {"sql": "SELECT substr(replace(hex(zeroblob(60)), '0', 'x'), 1, 60) AS s, "
                            "1e999 AS inf, "
                            "CAST(x'ff' AS TEXT) AS bad"})
    assert result.items[0]["row"] == {"s": "x" * 40, "inf": {"$float": "Infinity"},
                                      "bad": {"$hex": "ff"}}
    assert result.items[0]["key"] == row_key(["x" * 60, {"$float": "Infinity"}, {"$hex": "ff"}])
    assert result.warnings == ["LINE_CUT"]


def test_printf_cannot_outrun_the_deadline() -> None:
    """A huge printf width runs inside one SQLite instruction, out of the progress
    handler's reach, so printf and format are not callable at all."""
    router = make_router()
    for sql in ["SELECT printf('%.*c', 1000000000, 'x')", "SELECT format('%d', 1)"]:
        with pytest.raises(ToolError) as info:
            router.validate("db.query", {"sql": sql})
        assert info.value.code == "TOOL_SQL_NOT_READ_ONLY"


def test_out_of_range_parameters_are_refused() -> None:
    router = make_router()
    for params in ([2**70], [float("inf")], [float("nan")]):
        with pytest.raises(ToolError) as info:
            router.validate("db.query", {"sql": "SELECT ?", "params": params})
        assert info.value.code == "TOOL_INVALID_ARGUMENTS"


def test_db_query_dates_are_deterministic_only() -> None:
    router = make_router()
    result = router.execute("db.query", {"sql": "SELECT date('2024-02-28', '+1 day') AS d"})
    assert result.items[0]["row"] == {"d": "2024-02-29"}
    # ... also as SQLite reads them: a blob's bytes, text up to its first NUL (a hostile
    # trial put the wall clock into evidence with these)
    for sql in ["SELECT date('now')", "SELECT datetime()", "SELECT time(0, 'localtime')",
                "SELECT date(x'6e6f77')", "SELECT datetime(CAST('now' AS BLOB))",
                "SELECT datetime('now' || char(0))", "SELECT julianday('now' || char(0))",
                "SELECT date('2024-02-28', 'localtime' || char(0) || 'x')",
                "SELECT unixepoch(CAST('utc' AS BLOB))"]:
        with pytest.raises(ToolError) as info:
            router.execute("db.query", {"sql": sql})
        assert info.value.code == "TOOL_SQL_ERROR", sql
        assert "'now'" in info.value.message
    blob_date = router.execute("db.query", {"sql": "SELECT date(x'323032342d30322d3238') AS d"})
    assert blob_date.items[0]["row"] == {"d": "2024-02-28"}


WRITES_AND_ESCAPES = [
    "INSERT INTO users (name) VALUES ('eve')",
    "UPDATE users SET name = 'eve'",
    "DELETE FROM users",
    "CREATE TABLE t (x)",
    "CREATE TEMP TABLE t (x)",
    "DROP TABLE users",
    "DROP VIEW named",
    "ALTER TABLE users ADD COLUMN x",
    "ATTACH DATABASE ':memory:' AS x",
    "DETACH DATABASE main",
    "PRAGMA table_info(users)",
    "PRAGMA writable_schema=1",
    "PRAGMA query_only=0",
    "SELECT load_extension('x')",
    "WITH x AS (SELECT 1) DELETE FROM users",
    "WITH x AS (SELECT 1) INSERT INTO users (name) SELECT * FROM x",
    "REPLACE INTO users (id, name) VALUES (1, 'eve')",
    "BEGIN",
    "SAVEPOINT s",
    "ANALYZE",
    "REINDEX",
    "VACUUM",
    "SELECT random()",
    "SELECT * FROM pragma_table_info('users')",
    "SELECT CURRENT_TIMESTAMP",
]


@pytest.mark.parametrize("sql", WRITES_AND_ESCAPES)
def test_db_query_refuses_anything_but_reads(sql: str) -> None:
    snapshot_bytes = bytes(APP_DB)
    dbs = {"app.sqlite": snapshot_bytes}
    router = make_router(dbs)
    error = refusal(router, "db.query", {"sql": sql})
    assert error.code == "TOOL_SQL_NOT_READ_ONLY", error
    assert dbs["app.sqlite"] == APP_DB
    after = router.execute("db.query", {"sql": "SELECT count(*) AS n FROM users"})
    assert after.items[0]["row"] == {"n": 3}
    assert [i["table"] for i in router.execute("db.tables", {}).items] == ["named", "users"]


@pytest.mark.parametrize("sql", ["SELECT 1; SELECT 2", "SELECT 1; DELETE FROM users",
                                 "SELECT id FROM users;\nDROP TABLE users;"])
def test_db_query_one_statement_only(sql: str) -> None:
    router = make_router()
    assert refusal(router, "db.query", {"sql": sql}).code == "TOOL_SQL_MULTIPLE_STATEMENTS"
    assert router.execute("db.query", {"sql": "SELECT count(*) AS n FROM users"}).items[0][
        "row"] == {"n": 3}


def test_db_query_trailing_semicolon_and_comment_are_one_statement() -> None:
    result = make_router().execute("db.query", {"sql": "SELECT 1 AS one; -- done"})
    assert result.items[0]["row"] == {"one": 1}


@pytest.mark.parametrize(("sql", "params", "code"), [
    ("SELEC 1", [], "TOOL_SQL_ERROR"),
    ("SELECT * FROM missing", [], "TOOL_SQL_ERROR"),
    ("SELECT * FROM users WHERE id = ?", [], "TOOL_SQL_ERROR"),
    ("-- only a comment", [], "TOOL_INVALID_ARGUMENTS"),
    ("", [], "TOOL_INVALID_ARGUMENTS"),
])
def test_db_query_errors(sql: str, params: list[object], code: str) -> None:
    assert refusal(make_router(), "db.query", {"sql": sql, "params": params}).code == code


def test_db_query_params_must_be_scalars() -> None:
    error = refusal(make_router(), "db.query", {"sql": "SELECT ?", "params": [[1]]})
    assert error.code == "TOOL_INVALID_ARGUMENTS"


def test_runaway_query_without_rows_times_out() -> None:
    router = make_router(sql_timeout_s=0.2)
    sql = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) "
           "SELECT count(*) FROM c")
    router.validate("db.query", {"sql": sql})  # preflight does not run it
    with pytest.raises(ToolError) as info:
        router.execute("db.query", {"sql": sql})
    assert info.value.code == "TOOL_SQL_TIMEOUT"


def test_runaway_query_with_rows_is_partial() -> None:
    router = make_router(sql_timeout_s=0.2)
    sql = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) "
           "SELECT x FROM c WHERE x <= 2 OR x = 0")
    result = router.execute("db.query", {"sql": sql})
    assert result.items == [{"key": row_key([1]), "row": {"x": 1}}]
    assert result.warnings == ["PARTIAL"]
    # The connection stays usable after an interrupt.
    assert router.execute("db.query", {"sql": "SELECT 2 AS y"}).items[0]["row"] == {"y": 2}


def test_wal_mode_database_is_readable(tmp_path: Path) -> None:
    path = tmp_path / "wal.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (x)")
    conn.execute("INSERT INTO t VALUES (7)")
    conn.commit()
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    data = path.read_bytes()
    assert data[18:20] == b"\x02\x02"
    result = make_router({"wal.sqlite": data}).execute("db.query", {"sql": "SELECT x FROM t"})
    assert result.items[0]["row"] == {"x": 7}


def test_corrupt_database_is_a_sql_error() -> None:
    error = refusal(make_router({"bad.sqlite": b"not a database" * 100}), "db.tables", {})
    assert error.code == "TOOL_SQL_ERROR"


@pytest.mark.parametrize("sql", [
    "SELECT DISTINCT name FROM users ORDER BY name",
    "SELECT name, count(*) AS n FROM users GROUP BY name HAVING n > 0",
    "SELECT id FROM users UNION SELECT id + 10 FROM users",
    "SELECT * FROM named",
    "SELECT u.id FROM users u JOIN (SELECT id FROM users WHERE id > 1) s ON s.id = u.id",
    "WITH t(x) AS (SELECT id FROM users) SELECT max(x) FROM t",
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 5) "
    "SELECT sum(x) FROM c",
    "SELECT id, row_number() OVER (ORDER BY id DESC) AS r FROM users",
    "SELECT json_extract('{\"a\": 2}', '$.a') AS a, '{\"b\":1}' ->> '$.b' AS b",
    "SELECT name FROM users WHERE name LIKE 'b%' AND email IS NULL",
    "SELECT type, name FROM sqlite_master",
    "SELECT hex(avatar), upper(name), substr(name, 1, 1) FROM users",
    "EXPLAIN QUERY PLAN SELECT * FROM users WHERE name = 'bob'",
])
def test_db_query_accepts_reads(sql: str) -> None:
    result = make_router().execute("db.query", {"sql": sql})
    assert result.items
    assert "EMPTY_RESULT" not in result.warnings


#: Every authorizer action code of Python's sqlite3 module (SQLite's "Authorizer Action
#: Codes"), by name. The result codes (SQLITE_TOOBIG, SQLITE_INTERRUPT, ...) share their
#: numbers and must never name a denied action.
AUTHORIZER_ACTION_NAMES = (
    "SQLITE_CREATE_INDEX", "SQLITE_CREATE_TABLE", "SQLITE_CREATE_TEMP_INDEX",
    "SQLITE_CREATE_TEMP_TABLE", "SQLITE_CREATE_TEMP_TRIGGER", "SQLITE_CREATE_TEMP_VIEW",
    "SQLITE_CREATE_TRIGGER", "SQLITE_CREATE_VIEW", "SQLITE_DELETE", "SQLITE_DROP_INDEX",
    "SQLITE_DROP_TABLE", "SQLITE_DROP_TEMP_INDEX", "SQLITE_DROP_TEMP_TABLE",
    "SQLITE_DROP_TEMP_TRIGGER", "SQLITE_DROP_TEMP_VIEW", "SQLITE_DROP_TRIGGER",
    "SQLITE_DROP_VIEW", "SQLITE_INSERT", "SQLITE_PRAGMA", "SQLITE_READ", "SQLITE_SELECT",
    "SQLITE_TRANSACTION", "SQLITE_UPDATE", "SQLITE_ATTACH", "SQLITE_DETACH",
    "SQLITE_ALTER_TABLE", "SQLITE_REINDEX", "SQLITE_ANALYZE", "SQLITE_CREATE_VTABLE",
    "SQLITE_DROP_VTABLE", "SQLITE_FUNCTION", "SQLITE_SAVEPOINT", "SQLITE_RECURSIVE",
)


@pytest.mark.parametrize("name", AUTHORIZER_ACTION_NAMES)
def test_every_authorizer_action_code_has_its_own_name(name: str) -> None:
    from investigation.tools.sqlite import action_name

    assert action_name(getattr(sqlite3, name)) == name
    assert action_name(9999) == "action 9999"


@pytest.mark.parametrize(("sql", "denied"), [
    ("INSERT INTO users (name) VALUES ('eve')", "SQLITE_INSERT(users)"),
    ("DELETE FROM users", "SQLITE_DELETE(users)"),
    ("UPDATE users SET name = 'eve'", "SQLITE_UPDATE(users)"),
    ("ATTACH DATABASE ':memory:' AS x", "SQLITE_ATTACH(:memory:)"),
    ("DETACH DATABASE main", "SQLITE_DETACH(main)"),
    ("PRAGMA table_info(users)", "SQLITE_PRAGMA(table_info)"),
    ("BEGIN", "SQLITE_TRANSACTION(BEGIN)"),
    ("SAVEPOINT s", "SQLITE_SAVEPOINT(BEGIN)"),
    ("ANALYZE", "SQLITE_ANALYZE(users), SQLITE_INSERT(sqlite_master)"),
    ("REINDEX", "SQLITE_REINDEX(sqlite_autoindex_users_1), SQLITE_REINDEX(users_name)"),
    ("ALTER TABLE users ADD COLUMN x", "SQLITE_ALTER_TABLE(main)"),
    ("CREATE TABLE t (x)", "SQLITE_INSERT(sqlite_master)"),
    ("CREATE TEMP TRIGGER t3 AFTER DELETE ON users BEGIN SELECT 1; END",
     "SQLITE_CREATE_TEMP_TRIGGER(t3)"),
    ("CREATE TRIGGER t2 AFTER DELETE ON users BEGIN SELECT 1; END",
     "SQLITE_CREATE_TRIGGER(t2)"),
    ("DROP TABLE users", "SQLITE_DELETE(sqlite_master)"),
    ("DROP TRIGGER users_ai", "SQLITE_DROP_TRIGGER(users_ai)"),
    ("SELECT random()", "SQLITE_FUNCTION(random)"),
])
def test_refusal_names_the_denied_action_exactly(sql: str, denied: str) -> None:
    """The refusal text reaches the model as ``last_rejection``: it names SQLite's
    authorizer action, never a result code that shares its number."""
    error = refusal(make_router(), "db.query", {"sql": sql})
    assert error.code == "TOOL_SQL_NOT_READ_ONLY"
    assert error.message == ("not a read-only query (allowed: one SELECT using pure builtin "
                             f"functions); denied: {denied}")


def test_a_table_name_that_is_not_utf8_is_listed_the_same_every_time() -> None:
    conn = sqlite3.connect(":memory:")
    try:
        conn.execute("CREATE TABLE plain (a INTEGER)")
        conn.execute("CREATE TABLE tabl_ (a INTEGER)")
        conn.execute("PRAGMA writable_schema = ON")
        bad = "CAST(X'7461626cff' AS TEXT)"  # b"tabl\xff"
        conn.execute(f"UPDATE sqlite_master SET name = {bad}, tbl_name = {bad}, "
                     f"sql = 'CREATE TABLE \"' || {bad} || '\" (a INTEGER)' "
                     "WHERE name = 'tabl_'")
        conn.commit()
        data = conn.serialize()
        conn.execute(f"UPDATE sqlite_master SET tbl_name = 'x' || {bad} WHERE name = 'plain'")
        conn.commit()
        malformed = conn.serialize()
    finally:
        conn.close()
    error = refusal(make_router({"m.sqlite": malformed}), "db.tables", {})
    assert error.code == "TOOL_SQL_ERROR" and "cannot be opened" in str(error)
    listed = [make_router({"h.sqlite": data}).execute("db.tables", {}).items
              for _ in range(2)]
    assert listed[0] == listed[1]
    texts = json.dumps(listed[0])
    assert "object at 0x" not in texts and "InvalidText" not in texts
    assert "tabl\\\\xff" in texts and "plain" in texts


@pytest.mark.parametrize(("sql", "named"), [
    ("SELECT value FROM json_each('[1, 2]')", "json_each"),
    ("SELECT u.id, j.key FROM users u, json_tree('{\"a\": 1}') j", "json_tree"),
    ("SELECT name FROM pragma_table_info('users')", "pragma_table_info"),
    ("SELECT * FROM dbstat", "dbstat"),
])
def test_a_table_valued_function_is_refused_by_its_name(sql: str, named: str) -> None:
    """json_each, pragma_* and dbstat are refused as what they are: SQLite registers them
    with a schema change, and "denied: SQLITE_UPDATE(sqlite_master)" sent the model
    looking for a write it never made."""
    error = refusal(make_router(), "db.query", {"sql": sql})
    assert error.code == "TOOL_SQL_NOT_READ_ONLY"
    assert f"table-valued functions are not allowed ({named})" in str(error)
    assert error.details["table_valued"] == [named]
    assert "sqlite_master" not in str(error)


def test_a_schema_write_is_not_called_a_table_valued_function() -> None:
    """A statement that writes gets the write refusal, even when it names json_each."""
    error = refusal(make_router(), "db.query",
                    {"sql": "DELETE FROM users WHERE id IN (SELECT value FROM json_each('[1]'))"})
    assert error.code == "TOOL_SQL_NOT_READ_ONLY"
    assert "table-valued" not in str(error) and "SQLITE_DELETE(users)" in str(error)


SEARCH_DB = build_db(
    "CREATE TABLE articles (id INTEGER PRIMARY KEY, title TEXT)",
    "INSERT INTO articles VALUES (1, 'refund the order'), (2, 'ship the parcel')",
    "CREATE VIRTUAL TABLE articles_fts USING fts5(title, content='articles', "
    "content_rowid='id')",
    "INSERT INTO articles_fts(articles_fts) VALUES ('rebuild')",
    "CREATE VIRTUAL TABLE notes USING fts4(body)",
    "INSERT INTO notes VALUES ('refund requested twice')",
    "CREATE VIRTUAL TABLE boxes USING rtree(id, x0, x1)",
    "INSERT INTO boxes VALUES (7, 0, 5)",
)


@pytest.mark.parametrize(("sql", "row"), [
    ("SELECT rowid AS id, title FROM articles_fts WHERE articles_fts MATCH 'refund'",
     {"id": 1, "title": "refund the order"}),
    ("SELECT highlight(articles_fts, 0, '[', ']') AS h FROM articles_fts "
     "WHERE articles_fts MATCH 'parcel' ORDER BY rank", {"h": "ship the [parcel]"}),
    ("SELECT count(*) AS n FROM articles_fts", {"n": 2}),
    ("SELECT snippet(notes) AS s FROM notes WHERE notes MATCH 'twice'",
     {"s": "refund requested <b>twice</b>"}),
    ("SELECT id FROM boxes WHERE x0 < 3", {"id": 7}),
])
def test_the_snapshots_virtual_tables_can_be_read(sql: str, row: dict[str, object]) -> None:
    """FTS3/4/5 and R*Tree tables of the snapshot are read like any table (the demo's own
    articles_fts was refused as SQLITE_UPDATE(sqlite_master): SQLite connects a virtual
    table by changing the schema); in process and in the isolated server alike."""
    for isolate in (True, False):
        router = make_router({"search.sqlite": SEARCH_DB}, isolate_sql=isolate)
        result = router.execute("db.query", {"sql": sql})
        assert result.items[0]["row"] == row, isolate


@pytest.mark.parametrize("sql", [
    "INSERT INTO articles_fts(articles_fts) VALUES ('rebuild')",
    "INSERT INTO notes VALUES ('x')",
    "DELETE FROM boxes",
    "UPDATE articles_fts SET title = 'x'",
])
def test_the_snapshots_virtual_tables_stay_read_only(sql: str) -> None:
    router = make_router({"search.sqlite": SEARCH_DB})
    error = refusal(router, "db.query", {"sql": sql})
    assert error.code == "TOOL_SQL_NOT_READ_ONLY", error
    after = router.execute("db.query", {"sql": "SELECT count(*) AS n FROM boxes"})
    assert after.items[0]["row"] == {"n": 1}


@pytest.mark.parametrize("sql", [
    "EXPLAIN SELECT * FROM articles_fts WHERE articles_fts MATCH 'refund'",
    "EXPLAIN SELECT id FROM boxes WHERE x0 < 3",
    "/* a plan */ explain SELECT * FROM articles",
])
def test_explain_listings_are_refused_for_the_addresses_they_hold(sql: str) -> None:
    """A plain EXPLAIN lists the program, whose operands hold the process's heap addresses
    (a virtual table's ``vtab:55FDCE3658B8``): the evidence of the same query differed
    between two runs and leaked the memory layout (a hostile-input trial). The query
    plan stays available."""
    for isolate in (True, False):
        router = make_router({"search.sqlite": SEARCH_DB}, isolate_sql=isolate)
        error = refusal(router, "db.query", {"sql": sql})
        assert error.code == "TOOL_INVALID_ARGUMENTS" and "EXPLAIN QUERY PLAN" in str(error)
        plan = router.execute("db.query", {"sql": "EXPLAIN QUERY PLAN " + sql.split(
            "EXPLAIN ", 1)[-1].split("explain ", 1)[-1]})
        assert plan.items and "vtab:" not in json.dumps([i["row"] for i in plan.items])
