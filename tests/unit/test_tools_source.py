"""Source, symbol and log operations of the ToolRouter over a DictSnapshot."""

from __future__ import annotations

import json

import pytest

from investigation.cases.snapshot import DictSnapshot
from investigation.config import ToolLimits
from investigation.errors import ToolError
from investigation.tools import ToolRouter

SOURCE = {
    "README.md": b"# demo\nfoo is documented here\n",
    "src/app.py": b"import os\n\ndef foo(x):\n    return foo_bar(x) + foo\n",
    "src/pkg/util.py": b"FOO = 1\nvalue = obj.foo  # foo again\n",
    "src/win.txt": b"line one\r\nline two\r\n",
    "src/image.png": b"\x89PNG\x00\x00foo",
    "src/latin1.txt": "caf\xe9 foo\n".encode("latin-1"),
}
LOGS = {
    "app.log": b"2024-01-01 INFO start\n2024-01-01 ERROR foo failed\n",
    "worker/w1.log": b"ERROR timeout\n",
}


def make_router(source: dict[str, bytes] | None = None, **limits: object) -> ToolRouter:
    snapshot = DictSnapshot(SOURCE if source is None else source, logs=LOGS)
    return ToolRouter(snapshot, ToolLimits(**limits))


def refusal(router: ToolRouter, operation: str, arguments: dict[str, object]) -> str:
    with pytest.raises(ToolError) as info:
        router.validate(operation, arguments)
    with pytest.raises(ToolError) as again:
        router.execute(operation, arguments)
    assert again.value.code == info.value.code
    return info.value.code


# -- source.list ---------------------------------------------------------------------


def test_source_list_all_sorted_with_sizes() -> None:
    result = make_router().execute("source.list", {})
    assert result.items == [
        {"key": path, "path": path, "size_bytes": len(SOURCE[path])} for path in sorted(SOURCE)
    ]
    assert result.warnings == []
    assert result.arguments == {"prefix": "", "limit": 200}
    assert result.stats == {"total_matches": 6, "items": 6}


def test_source_list_prefix_and_limit_truncates() -> None:
    result = make_router().execute("source.list", {"prefix": "src/", "limit": 2})
    assert [i["key"] for i in result.items] == ["src/app.py", "src/image.png"]
    assert result.warnings == ["TRUNCATED"]
    assert result.stats["total_matches"] == 5


def test_source_list_limit_capped_and_empty_result() -> None:
    router = make_router(max_results=3)
    assert router.validate("source.list", {"limit": 1000}).limit == 3  # type: ignore[attr-defined]
    result = router.execute("source.list", {"prefix": "nope/"})
    assert result.items == []
    assert result.warnings == ["EMPTY_RESULT"]


@pytest.mark.parametrize("prefix", ["../", "/etc", "src/../..", "a\\b", "C:/x", "a\x00"])
def test_source_list_prefix_escape(prefix: str) -> None:
    assert refusal(make_router(), "source.list", {"prefix": prefix}) == "TOOL_PATH_ESCAPE"


# -- source.read ---------------------------------------------------------------------


def test_source_read_exact_lines() -> None:
    result = make_router().execute(
        "source.read", {"path": "src/app.py", "start_line": 2, "end_line": 4})
    assert result.items == [
        {"key": "src/app.py:2", "path": "src/app.py", "line": 2, "text": ""},
        {"key": "src/app.py:3", "path": "src/app.py", "line": 3, "text": "def foo(x):"},
        {"key": "src/app.py:4", "path": "src/app.py", "line": 4,
         "text": "    return foo_bar(x) + foo"},
    ]
    assert result.warnings == []
    assert result.stats == {"total_lines": 4, "start_line": 2, "end_line": 4, "items": 3}


def test_source_read_keeps_carriage_return() -> None:
    result = make_router().execute(
        "source.read", {"path": "src/win.txt", "start_line": 1, "end_line": 1})
    assert result.items[0]["text"] == "line one\r"


def test_source_read_clips_to_max_read_lines() -> None:
    source = {"big.txt": "".join(f"l{n}\n" for n in range(1, 21)).encode()}
    result = make_router(source, max_read_lines=5).execute(
        "source.read", {"path": "big.txt", "start_line": 3, "end_line": 20})
    assert [i["line"] for i in result.items] == [3, 4, 5, 6, 7]
    assert result.warnings == ["RANGE_CLIPPED"]
    assert result.stats["end_line"] == 7


def test_source_read_beyond_eof() -> None:
    router = make_router()
    result = router.execute("source.read", {"path": "src/app.py", "start_line": 3,
                                            "end_line": 99})
    assert [i["line"] for i in result.items] == [3, 4]
    assert result.warnings == ["RANGE_CLIPPED"]
    result = router.execute("source.read", {"path": "src/app.py", "start_line": 50,
                                            "end_line": 60})
    assert result.items == []
    assert result.warnings == ["EMPTY_RESULT", "RANGE_CLIPPED"]
    assert result.stats == {"total_lines": 4, "start_line": None, "end_line": None,
                            "items": 0}


def test_source_read_binary_file_is_skipped() -> None:
    result = make_router().execute(
        "source.read", {"path": "src/image.png", "start_line": 1, "end_line": 2})
    assert result.items == []
    assert result.warnings == ["EMPTY_RESULT", "BINARY_SKIPPED"]


def test_source_read_line_cut() -> None:
    source = {"long.txt": ("é" * 100 + "\n").encode()}
    result = make_router(source, max_line_bytes=41).execute(
        "source.read", {"path": "long.txt", "start_line": 1, "end_line": 1})
    assert result.items[0]["text"] == "é" * 20  # cut on a character boundary
    assert result.warnings == ["LINE_CUT"]


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a/../../b", "src\\app.py",
                                  "C:/Windows/win.ini", "c:x", "src/app.py\x00"])
def test_source_read_path_escape(path: str) -> None:
    code = refusal(make_router(), "source.read", {"path": path, "start_line": 1, "end_line": 1})
    assert code == "TOOL_PATH_ESCAPE"


def test_source_read_unknown_and_bad_range() -> None:
    router = make_router()
    assert refusal(router, "source.read", {"path": "src/nope.py", "start_line": 1,
                                           "end_line": 1}) == "TOOL_NOT_FOUND"
    assert refusal(router, "source.read", {"path": "src/app.py", "start_line": 5,
                                           "end_line": 4}) == "TOOL_INVALID_ARGUMENTS"
    assert refusal(router, "source.read", {"path": "src/app.py", "start_line": 0,
                                           "end_line": 4}) == "TOOL_INVALID_ARGUMENTS"


# -- source.search -------------------------------------------------------------------


def test_source_search_literal_exact_items() -> None:
    result = make_router().execute("source.search", {"pattern": "foo"})
    assert result.items == [
        {"key": "README.md:2", "path": "README.md", "line": 2,
         "text": "foo is documented here"},
        {"key": "src/app.py:3", "path": "src/app.py", "line": 3, "text": "def foo(x):"},
        {"key": "src/app.py:4", "path": "src/app.py", "line": 4,
         "text": "    return foo_bar(x) + foo"},
        {"key": "src/pkg/util.py:2", "path": "src/pkg/util.py", "line": 2,
         "text": "value = obj.foo  # foo again"},
    ]
    assert result.warnings == ["BINARY_SKIPPED"]
    assert result.stats == {"files_total": 6, "files_scanned": 4, "files_skipped": 2,
                            "skipped_paths": ["src/image.png", "src/latin1.txt"], "items": 4}
    assert result.arguments == {"pattern": "foo", "regex": False, "path_glob": None,
                                "max_results": 200}


def test_source_search_regex_and_globs() -> None:
    router = make_router()
    result = router.execute("source.search", {"pattern": r"^def \w+\(", "regex": True})
    assert [i["key"] for i in result.items] == ["src/app.py:3"]
    result = router.execute("source.search", {"pattern": "foo", "path_glob": "*.py"})
    assert [i["key"] for i in result.items] == ["src/app.py:3", "src/app.py:4",
                                                "src/pkg/util.py:2"]
    result = router.execute("source.search", {"pattern": "foo", "path_glob": "src/*.py"})
    assert [i["key"] for i in result.items] == ["src/app.py:3", "src/app.py:4"]
    result = router.execute("source.search", {"pattern": "foo", "path_glob": "src/**/*.py"})
    assert [i["key"] for i in result.items] == ["src/app.py:3", "src/app.py:4",
                                                "src/pkg/util.py:2"]
    result = router.execute("source.search", {"pattern": "FOO", "path_glob": "src/p?g/[tu]*"})
    assert [i["key"] for i in result.items] == ["src/pkg/util.py:1"]
    assert result.warnings == []


def test_source_search_truncates_at_max_results() -> None:
    result = make_router().execute("source.search", {"pattern": "foo", "max_results": 2})
    assert [i["key"] for i in result.items] == ["README.md:2", "src/app.py:3"]
    assert "TRUNCATED" in result.warnings


def test_source_search_line_cut() -> None:
    source = {"a.txt": b"x" * 100 + b"needle" + b"y" * 100 + b"\n"}
    result = make_router(source, max_line_bytes=50).execute("source.search",
                                                            {"pattern": "needle"})
    assert result.items == [{"key": "a.txt:1", "path": "a.txt", "line": 1, "text": "x" * 50}]
    assert result.warnings == ["LINE_CUT"]


def test_source_search_empty_result() -> None:
    result = make_router().execute("source.search", {"pattern": "no such text"})
    assert result.items == []
    assert result.warnings == ["EMPTY_RESULT", "BINARY_SKIPPED"]


def test_hostile_regex_returns() -> None:
    source = {"evil.txt": b"a" * 50_000 + b"b\n"}
    result = make_router(source).execute("source.search", {"pattern": "(a+)+$", "regex": True})
    assert result.items == []
    assert result.warnings == ["EMPTY_RESULT"]


@pytest.mark.parametrize("pattern", ["(", "(a)\\1", "(?=x)y", "a{1001}{1001}"])
def test_regex_refused(pattern: str) -> None:
    assert refusal(make_router(), "source.search",
                   {"pattern": pattern, "regex": True}) == "TOOL_REGEX_INVALID"
    assert refusal(make_router(), "logs.search",
                   {"pattern": pattern, "regex": True}) == "TOOL_REGEX_INVALID"


def test_literal_pattern_is_not_a_regex() -> None:
    result = make_router({"a.txt": b"call(x\n"}).execute("source.search", {"pattern": "call("})
    assert [i["key"] for i in result.items] == ["a.txt:1"]


def test_pattern_too_long_and_empty() -> None:
    router = make_router(max_pattern_bytes=10)
    assert refusal(router, "source.search", {"pattern": "x" * 11}) == "TOOL_PATTERN_TOO_LONG"
    assert refusal(router, "source.search",
                   {"pattern": "x", "path_glob": "*" * 11}) == "TOOL_PATTERN_TOO_LONG"
    assert refusal(router, "logs.search", {"pattern": "é" * 6}) == "TOOL_PATTERN_TOO_LONG"
    assert refusal(router, "source.search", {"pattern": ""}) == "TOOL_INVALID_ARGUMENTS"


@pytest.mark.parametrize("glob", ["../*.py", "/src/*.py", "src/../../x", "src\\*.py", "C:*"])
def test_path_glob_escape(glob: str) -> None:
    assert refusal(make_router(), "source.search",
                   {"pattern": "foo", "path_glob": glob}) == "TOOL_PATH_ESCAPE"


def test_search_deadline_gives_partial() -> None:
    result = make_router(search_timeout_s=1e-9).execute("source.search", {"pattern": "foo"})
    assert result.items == []
    assert result.warnings == ["EMPTY_RESULT", "PARTIAL"]


def test_output_bound_drops_trailing_items() -> None:
    source = {"a.txt": b"".join(b"needle %03d " % n + b"z" * 200 + b"\n" for n in range(50))}
    result = make_router(source, max_output_bytes=2048).execute("source.search",
                                                               {"pattern": "needle"})
    assert 0 < len(result.items) < 50
    assert [i["line"] for i in result.items] == list(range(1, len(result.items) + 1))
    assert "TRUNCATED" in result.warnings
    encoded = json.dumps(result.items, sort_keys=True, separators=(",", ":"),
                         ensure_ascii=False).encode()
    assert len(encoded) <= 2048


# -- symbol.occurrences --------------------------------------------------------------


def test_symbol_occurrences_identifier_boundaries() -> None:
    result = make_router().execute("symbol.occurrences", {"symbol": "foo"})
    assert result.items == [
        {"key": "README.md:2:1", "path": "README.md", "line": 2, "column": 1,
         "text": "foo is documented here"},
        {"key": "src/app.py:3:5", "path": "src/app.py", "line": 3, "column": 5,
         "text": "def foo(x):"},
        {"key": "src/app.py:4:25", "path": "src/app.py", "line": 4, "column": 25,
         "text": "    return foo_bar(x) + foo"},
        {"key": "src/pkg/util.py:2:13", "path": "src/pkg/util.py", "line": 2, "column": 13,
         "text": "value = obj.foo  # foo again"},
        {"key": "src/pkg/util.py:2:20", "path": "src/pkg/util.py", "line": 2, "column": 20,
         "text": "value = obj.foo  # foo again"},
    ]
    assert result.warnings == ["TEXTUAL_SCOPE", "BINARY_SKIPPED"]


def test_symbol_occurrences_dotted_and_empty() -> None:
    router = make_router()
    result = router.execute("symbol.occurrences", {"symbol": "obj.foo"})
    assert [i["key"] for i in result.items] == ["src/pkg/util.py:2:9"]
    result = router.execute("symbol.occurrences", {"symbol": "fo"})
    assert result.items == []
    assert result.warnings == ["EMPTY_RESULT", "TEXTUAL_SCOPE", "BINARY_SKIPPED"]


def test_symbol_occurrences_truncated() -> None:
    result = make_router().execute("symbol.occurrences", {"symbol": "foo", "max_results": 1})
    assert [i["key"] for i in result.items] == ["README.md:2:1"]
    assert result.warnings == ["TRUNCATED", "TEXTUAL_SCOPE"]


@pytest.mark.parametrize("symbol", ["foo bar", "a(b", "", "...", "x" * 201, "foo-bar", "é"])
def test_symbol_must_be_identifier(symbol: str) -> None:
    assert refusal(make_router(), "symbol.occurrences",
                   {"symbol": symbol}) == "TOOL_INVALID_ARGUMENTS"


# -- logs.search ---------------------------------------------------------------------


def test_logs_search_exact_items() -> None:
    result = make_router().execute("logs.search", {"pattern": "ERROR"})
    assert result.items == [
        {"key": "app.log:2", "path": "app.log", "line": 2, "text": "2024-01-01 ERROR foo failed"},
        {"key": "worker/w1.log:1", "path": "worker/w1.log", "line": 1, "text": "ERROR timeout"},
    ]
    assert result.warnings == []
    result = make_router().execute("logs.search", {"pattern": r"ERROR\s+t", "regex": True})
    assert [i["key"] for i in result.items] == ["worker/w1.log:1"]
