"""Untrusted SQL runs in a forked child under hard limits: what SQLite cannot interrupt
(compilation) is still stopped, and the worker survives."""

from __future__ import annotations

import time

import pytest

from investigation.errors import ToolError
from investigation.tools.isolation import run_isolated
from tests.unit.test_tools_db import make_router


def compile_bomb(levels: int) -> str:
    """Nested NOT MATERIALIZED CTEs: each level doubles the compiled program."""
    ctes = ["v0 AS NOT MATERIALIZED (SELECT 1 AS a)"]
    ctes += [f"v{i} AS NOT MATERIALIZED (SELECT x.a FROM v{i - 1} x, v{i - 1} y)"
             for i in range(1, levels + 1)]
    return "WITH " + ", ".join(ctes) + f" SELECT count(*) FROM v{levels}"


def test_a_compile_bomb_is_stopped_at_the_hard_deadline() -> None:
    router = make_router(sql_timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(ToolError) as err:
        router.validate("db.query", {"sql": compile_bomb(18)})
    assert err.value.code in ("TOOL_SQL_TIMEOUT", "TOOL_RESOURCE_LIMIT")
    assert time.monotonic() - started < 10  # unbounded in process: about 70 s and 550 MB
    # The router and its database still work afterwards.
    ok = router.execute("db.query", {"sql": "SELECT 1 AS one"})
    assert ok.items[0]["row"] == {"one": 1}


def test_memory_is_bounded_in_the_child() -> None:
    with pytest.raises(ToolError) as err:
        run_isolated(lambda: len(bytearray(512 << 20)), timeout_s=5, memory_bytes=32 << 20,
                     what="t")
    assert err.value.code == "TOOL_RESOURCE_LIMIT"
    assert run_isolated(lambda: len(bytearray(8 << 20)), timeout_s=5,
                        memory_bytes=32 << 20, what="t") == 8 << 20


def test_tool_errors_keep_their_code_across_the_fork() -> None:
    def refuse() -> None:
        raise ToolError("TOOL_SQL_ERROR", "refused in the child", database="x")

    with pytest.raises(ToolError) as err:
        run_isolated(refuse, timeout_s=5, memory_bytes=64 << 20, what="t")
    assert (err.value.code, err.value.details) == ("TOOL_SQL_ERROR", {"database": "x"})
    assert run_isolated(lambda: [1, "two"], timeout_s=5, memory_bytes=64 << 20,
                        what="t") == [1, "two"]


def test_a_hung_child_is_killed() -> None:
    started = time.monotonic()
    with pytest.raises(ToolError) as err:
        run_isolated(lambda: time.sleep(30), timeout_s=0.5, memory_bytes=64 << 20, what="t")
    assert err.value.code == "TOOL_SQL_TIMEOUT"
    assert time.monotonic() - started < 5


def _db_with(*statements: str) -> bytes:
    import sqlite3

    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, total REAL)")
    for sql in statements:
        conn.execute(sql)
    data = conn.serialize()
    conn.close()
    return data


@pytest.mark.parametrize("view", [
    "CREATE VIEW recent AS SELECT id, date(id, 'unixepoch') AS day FROM orders",
    "CREATE VIEW recent AS SELECT id FROM orders_gone",
])
def test_schema_of_a_troublesome_view_is_an_error_code(view: str) -> None:
    import sqlite3

    conn = sqlite3.connect(":memory:")
    conn.execute("PRAGMA legacy_alter_table=ON")
    conn.execute("CREATE TABLE orders_gone (id)")
    conn.execute(view)
    conn.execute("DROP TABLE orders_gone")
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
    router = make_router({"app.sqlite": conn.serialize()})
    try:
        result = router.execute("db.schema", {"table": "recent"})
    except ToolError as err:
        assert err.code == "TOOL_SQL_ERROR"
    else:
        assert any(item["key"].endswith("#ddl") for item in result.items)


def test_schema_with_a_non_utf8_column_name_renders() -> None:
    data = _db_with('CREATE TABLE "odd" (x)')
    name = b'CREATE TABLE "odd" (x)'
    assert name in data
    patched = data.replace(b'"odd" (x)', b'"odd" (\xff)')
    result = make_router({"app.sqlite": patched}).execute("db.schema", {"table": "odd"})
    columns = [i["column"] for i in result.items if "column" in i]
    assert columns == [{"$hex": "ff"}]


def test_a_child_stuck_on_an_inherited_lock_is_replaced() -> None:
    """A lock held by another thread at fork time stays locked in the child: the child
    never reports ready, is killed, and the work is retried, then run in process."""
    import threading

    held = threading.Lock()
    held.acquire()  # "another thread" holds it across every fork below
    calls: list[str] = []

    def probe() -> None:
        held.acquire()  # blocks forever in the child, like SQLite's allocator mutex

    started = time.monotonic()
    result = run_isolated(lambda: calls.append("ran") or "done", timeout_s=5,
                          memory_bytes=64 << 20, what="t", probe=probe)
    assert result == "done" and calls == ["ran"]  # ran in process after the retries
    assert time.monotonic() - started < 10  # FORK_TRIES handshakes of 0.5 s at most
    held.release()


def test_queries_stay_correct_while_other_threads_use_sqlite() -> None:
    import sqlite3
    import threading

    stop = threading.Event()

    def busy() -> None:
        conn = sqlite3.connect(":memory:")
        while not stop.is_set():
            conn.execute("SELECT hex(randomblob(64)) FROM (SELECT 1 UNION SELECT 2)").fetchall()

    threads = [threading.Thread(target=busy) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        router = make_router()
        for _ in range(15):
            result = router.execute("db.query", {"sql": "SELECT 1 AS one"})
            assert result.items[0]["row"] == {"one": 1}
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_symbol_occurrences_skip_a_huge_line_with_a_warning() -> None:
    from investigation.cases.snapshot import DictSnapshot
    from investigation.config import ToolLimits
    from investigation.tools import ToolRouter

    source = {"min.js": b"a" * 2_000_000 + b"\nvar a = 1;\n"}
    router = ToolRouter(DictSnapshot(source), ToolLimits(search_timeout_s=5.0))
    started = time.monotonic()
    result = router.execute("symbol.occurrences", {"symbol": "a"})
    assert time.monotonic() - started < 3
    assert "PARTIAL" in result.warnings and result.stats["long_lines_skipped"] == 1
    assert [i["key"] for i in result.items] == ["min.js:2:5"]
