"""ToolRouter surface: describe, argument validation, determinism, the result model."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pydantic
import pytest

import investigation.tools as tools
from investigation.cases.snapshot import DictSnapshot
from investigation.config import ToolLimits
from investigation.constants import OPERATIONS
from investigation.errors import ToolError
from investigation.tools import ToolResult, ToolRouter


def _db() -> bytes:
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
    conn.executemany("INSERT INTO t VALUES (?, ?)", [(1, "a"), (2, "b"), (3, "a")])
    conn.commit()
    data = conn.serialize()
    conn.close()
    return data


def make_snapshot() -> DictSnapshot:
    return DictSnapshot(
        {"src/b.py": b"def run():\n    return helper()\n", "src/a.py": b"def helper():\n    pass\n"},
        dbs={"main.sqlite": _db()},
        logs={"x.log": b"helper failed\nok\n"},
    )


CALLS: list[tuple[str, dict[str, Any]]] = [
    ("source.list", {"prefix": "src/"}),
    ("source.search", {"pattern": "helper", "path_glob": "*.py"}),
    ("source.read", {"path": "src/b.py", "start_line": 1, "end_line": 2}),
    ("symbol.occurrences", {"symbol": "helper"}),
    ("db.tables", {}),
    ("db.schema", {"table": "t"}),
    ("db.query", {"sql": "SELECT v, count(*) AS n FROM t GROUP BY v", "max_rows": 10}),
    ("logs.search", {"pattern": "fail", "regex": True}),
]


def test_describe_lists_every_operation_in_order() -> None:
    described = ToolRouter(make_snapshot(), ToolLimits()).describe()
    assert [d["operation"] for d in described] == list(OPERATIONS)
    for entry in described:
        assert set(entry) == {"operation", "description", "arguments_schema"}
        assert entry["description"] and len(entry["description"]) < 200
        schema = entry["arguments_schema"]
        assert schema["type"] == "object"
        assert schema["additionalProperties"] is False
    by_op = {d["operation"]: d["arguments_schema"] for d in described}
    assert by_op["source.read"]["required"] == ["path", "start_line", "end_line"]
    assert by_op["db.tables"].get("properties", {}) == {}
    assert set(by_op["db.query"]["properties"]) == {"sql", "params", "max_rows"}
    json.dumps(described)  # JSON-ready for the prompt


def test_describe_mentions_configured_caps() -> None:
    described = ToolRouter(make_snapshot(), ToolLimits(max_results=17)).describe()
    assert "17" in described[1]["description"]


def test_unknown_operation() -> None:
    router = ToolRouter(make_snapshot(), ToolLimits())
    for op in ["source.delete", "", "SOURCE.LIST"]:
        with pytest.raises(ToolError) as info:
            router.validate(op, {})
        assert info.value.code == "TOOL_UNKNOWN_OPERATION"
    with pytest.raises(ToolError) as info:
        router.execute("shell.run", {"cmd": "ls"})
    assert info.value.code == "TOOL_UNKNOWN_OPERATION"


@pytest.mark.parametrize(("operation", "arguments"), [
    ("db.tables", {"x": 1}),  # extra keys are forbidden
    ("source.list", {"prefix": "src/", "recursive": True}),
    ("source.read", {"path": "src/a.py", "start_line": "1", "end_line": 2}),  # strict
    ("source.read", {"path": "src/a.py", "start_line": True, "end_line": 2}),
    ("source.read", {"path": "src/a.py", "start_line": 1.0, "end_line": 2}),
    ("source.read", {"path": "src/a.py", "start_line": 1}),  # missing
    ("source.search", {"pattern": 5}),
    ("source.search", {"pattern": "x", "regex": "yes"}),
    ("source.search", {"pattern": "x", "max_results": 0}),
    ("source.list", {"limit": -1}),
    # counts and line numbers past 10^9: a 4,000-digit end_line reached summary.md whole
    ("source.read", {"path": "src/a.py", "start_line": 1, "end_line": 10**4000}),
    ("source.read", {"path": "src/a.py", "start_line": 10**9 + 1, "end_line": 10**9 + 1}),
    ("source.search", {"pattern": "x", "max_results": 10**12}),
    ("db.query", {"sql": "SELECT 1", "params": "1"}),
    ("db.query", {"sql": "SELECT ?", "params": [{"a": 1}]}),
    ("db.query", {"sql": "x" * 20_001}),
    ("db.schema", {}),
])
def test_invalid_arguments(operation: str, arguments: dict[str, Any]) -> None:
    router = ToolRouter(make_snapshot(), ToolLimits())
    with pytest.raises(ToolError) as info:
        router.validate(operation, arguments)
    assert info.value.code == "TOOL_INVALID_ARGUMENTS"


def test_arguments_must_be_an_object() -> None:
    router = ToolRouter(make_snapshot(), ToolLimits())
    with pytest.raises(ToolError) as info:
        router.validate("db.tables", ["x"])  # type: ignore[arg-type]
    assert info.value.code == "TOOL_INVALID_ARGUMENTS"


def test_validate_returns_normalised_model() -> None:
    router = ToolRouter(make_snapshot(), ToolLimits(max_results=5))
    model = router.validate("source.search", {"pattern": "x", "max_results": 999})
    assert isinstance(model, pydantic.BaseModel)
    assert model.model_dump() == {"pattern": "x", "regex": False, "path_glob": None,
                                  "max_results": 5}
    assert router.validate("db.query", {"sql": "SELECT 1"}).model_dump() == {
        "sql": "SELECT 1", "params": [], "max_rows": 5}


@pytest.mark.parametrize(("operation", "arguments"), CALLS)
def test_same_arguments_same_result(operation: str, arguments: dict[str, Any]) -> None:
    first = ToolRouter(make_snapshot(), ToolLimits()).execute(operation, arguments)
    router = ToolRouter(make_snapshot(), ToolLimits())
    second = router.execute(operation, dict(arguments))
    third = router.execute(operation, dict(arguments))
    assert first.to_json_bytes() == second.to_json_bytes() == third.to_json_bytes()
    assert first == second
    keys = [item["key"] for item in first.items]
    assert keys and len(keys) == len(set(keys))
    assert all(isinstance(k, str) for k in keys)
    assert first.operation == operation


def test_result_is_frozen_and_canonical() -> None:
    result = ToolRouter(make_snapshot(), ToolLimits()).execute("db.tables", {})
    with pytest.raises(pydantic.ValidationError):
        result.warnings = ["X"]  # type: ignore[misc]
    data = result.to_json_bytes()
    assert data == json.dumps(json.loads(data), sort_keys=True, separators=(",", ":"),
                              ensure_ascii=False).encode()
    assert ToolResult.model_validate_json(data) == result
    assert json.loads(data)["items"] == [
        {"key": "main.sqlite:t", "database": "main.sqlite", "table": "t", "type": "table"}]


def test_public_surface() -> None:
    assert "ToolRouter" in tools.__all__ and "ToolResult" in tools.__all__
    assert set(tools.WARNINGS) == {"EMPTY_RESULT", "TRUNCATED", "PARTIAL", "TEXTUAL_SCOPE",
                                   "LINE_CUT", "BINARY_SKIPPED", "RANGE_CLIPPED",
                                   "SECRET_MASKED"}


def test_tools_never_use_backtracking_re_or_workers() -> None:
    package = Path(tools.__file__).parent
    for module in package.glob("*.py"):
        text = module.read_text()
        for banned in ("import re\n", "from re import", "celery", "kombu", "redis",
                       "import workers", "from workers"):
            assert banned not in text, (module.name, banned)


def test_router_close_and_reopen() -> None:
    router = ToolRouter(make_snapshot(), ToolLimits())
    before = router.execute("db.query", {"sql": "SELECT count(*) AS n FROM t"})
    router.close()
    assert router.execute("db.query", {"sql": "SELECT count(*) AS n FROM t"}) == before
