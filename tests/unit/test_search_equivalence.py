"""Differential tests: whole-file search gives the per-line reference's results, byte for byte.

The reference (``tests/search_reference.py``) is the engine's original per-line scan. Every
case runs ``source.search`` / ``logs.search`` / ``symbol.occurrences`` on both and compares
the canonical JSON of the whole :class:`ToolResult` (items, keys, order, warnings, stats),
over three ways the engine gets its text: a DictSnapshot (read at every search), a real
package with a shared text index on disk (memory-mapped, files separated by newlines in
one buffer), and the same package without an index directory.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from typing import Any

import pytest
import re2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from investigation.cases.builder import package_bytes
from investigation.cases.reader import PackageReader
from investigation.cases.snapshot import DictSnapshot, Snapshot
from investigation.cases.textindex import MappedTextIndex, TextIndexStore
from investigation.config import ToolLimits
from investigation.tools import ToolRouter
from investigation.tools.search import line_local
from tests.search_reference import ReferenceRouter

LONG = "x" * 120 + "needle" + "é" * 60
SOURCE: dict[str, bytes] = {
    "a/plain.py": b"import os\n\ndef foo(x):\n    return foo_bar(x) + foo\n",
    "a/no_final_newline.py": b"first foo\nlast foo",
    "a/empty.txt": b"",
    "a/only_newline.txt": b"\n",
    "a/blank_lines.txt": b"\n\n\nfoo\n\n",
    "a/crlf.txt": b"line one\r\nfoo two\r\n\r\nend\r",
    "a/cr_only.txt": b"a\rb\rfoo\r",
    "a/unicode.txt": "caf\xe9 foo\n\u65e5\u672c\u8a9e foo_bar\n\u00c9COLE \u00e9cole\n"
                     "\u0391\u03b2\u03b3 \u03b4\n\U0001f600 emoji foo\n".encode(),
    "a/long_line.txt": (LONG + "\n" + "foo " * 40 + "\n").encode(),
    "a/tabs.txt": b"\tfoo\t\n  \t  \nx\ty\n",
    "a/binary.bin": b"\x89PNG\x00\x00foo\nfoo\n",
    "a/latin1.txt": "caf\xe9 foo\n".encode("latin-1"),
    "a/nul_late.txt": b"foo\n" * 10 + b"\x00",
    "b/multi.py": b"def a():\n    pass\n\ndef b():\n    return 'a\\nb'\n\nclass C:\n    x = 1\n",
    "b/words.txt": b"foo bar\nbar foo\nfoobar\nbarfoo\n_foo_\nfoo.bar\nobj.foo()\n",
    "b/repeats.txt": b"".join(b"foo %d\n" % n for n in range(30)),
    "b/ends.txt": b"x\nxx\nx x\n x\nx \n",
    "c/huge_symbol_line.js": b"var foo=1;" + b"a" * 100_001 + b" foo\nfoo();\n",
    "c/dollar.txt": b"price $5\n^caret\nback\\slash\n(paren)\n[bracket]\n",
}
LOGS: dict[str, bytes] = {
    "app.log": b"2024-01-01 INFO start\n2024-01-01 ERROR foo failed\r\n\n"
               b"2024-01-02 WARN disk\n",
    "worker/w1.log": b"ERROR timeout\nERROR foo\n",
    "worker/bin.log": b"ERROR\x00\n",
}

LITERALS = [
    "foo", "o", "x", " ", "\t", "\r", "\r\n", "\n", "foo\nbar", "caf\xe9", "\u65e5\u672c",
    "\U0001f600", "needle", "$5", "^", "\\", "(paren)", "[", "ERROR", "foo ", "\xe9" * 3,
    "no such text", "def ", "  ",
]
REGEXES = [
    r"foo", r"^foo", r"foo$", r"^$", r"^\s*$", r"^", r"$", r"\bfoo\b", r"\Bfoo", r"foo\B",
    r"x*", r"a|^b|c$", r"(a)(b)?", r"^\w+\(", r"def \w+\(", r"\w+_\w+", r"\d+$",
    r"\r$", r"\r", r".\r$", r"[^x]+", r"[^a-z]*$", r"(?s).+", r"(?s)foo.*bar", r"foo\s+bar",
    r"foo\nbar", r"\n", r"[\n]", r"\x{0a}", r"\x0a|foo", r"[^\n]*foo", r"a\s*\n\s*b",
    r"\C", r"o\Cb", r"\C{3}$", r"(?i)FOO", r"(?i)\xc9cole", r"(?i:E)COLE", r"\pL+\s\pL+",
    r"\p{Greek}+", r"[[:space:]]", r"[[:^alpha:]]+", r"(?U)o+", r"o+?", r"(a+)+$", r"\.",
    r"\$\d", r"\^caret", r"\\", r"\(paren\)", r"(?m)^x", r"(?m:^x$)", r"(?-m)^x",
    r"(?i-m)^X", r"\Ax", r"x\z", r"\A\z", r"^x$|\Ax ", r"\Qfoo\E", r"\Q(?-m)\E", r"\Q^\E",
    r"(?P<n>foo)", r"(?:foo|bar){2}", "\u65e5", "\u65e5\\pL", r"\x{1F600}", r".", r"..?$",
    r"^.{3}$", r"emoji|needle", r"ERROR\s+\w+", r"INFO|WARN",
]
SYMBOLS = ["foo", "foo_bar", "obj.foo", "x", "a", "bar", "needle", "ERROR", "C", "_foo_",
           "nothing_here"]
LIMITS = [
    ToolLimits(search_timeout_s=600.0),
    ToolLimits(search_timeout_s=600.0, max_results=3),
    ToolLimits(search_timeout_s=600.0, max_results=1, max_line_bytes=40),
    ToolLimits(search_timeout_s=600.0, max_line_bytes=40, max_output_bytes=1024),
]


class IndexedDictSnapshot(DictSnapshot):
    """A DictSnapshot with a shared text index in ``directory`` (package id = content hash)."""

    def __init__(self, source: dict[str, bytes], logs: dict[str, bytes], directory: Path
                 ) -> None:
        digest = hashlib.sha256(repr((sorted(source.items()), sorted(logs.items())))
                                .encode()).hexdigest()
        super().__init__(source, logs=logs, package_id=digest)
        self._store = TextIndexStore(directory)
        self._index: MappedTextIndex | None = None

    def text_index(self) -> MappedTextIndex | None:
        if self._index is None:
            self._index = self._store.open(self)
        return self._index


def _package_snapshot(tmp: Path, *, indexed: bool) -> Snapshot:
    files = {"report.md": b"report\n"}
    files.update({"source/" + p: d for p, d in SOURCE.items()})
    files.update({"logs/" + p: d for p, d in LOGS.items()})
    data, _ = package_bytes(files, [], has_logs=True)
    reader = PackageReader(text_index_dir=tmp / "index" if indexed else None)
    return reader.read(data)


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Snapshot]:
    tmp = tmp_path_factory.mktemp("search-eq")
    mapped = _package_snapshot(tmp, indexed=True)
    assert mapped.text_index() is not None  # type: ignore[attr-defined]
    return {
        "dict": DictSnapshot(SOURCE, logs=LOGS),
        "package-indexed": mapped,
        "package-live": _package_snapshot(tmp, indexed=False),
    }


def _same(snapshot: Snapshot, limits: ToolLimits, operation: str,
          arguments: dict[str, Any]) -> None:
    expected = ReferenceRouter(DictSnapshot(SOURCE, logs=LOGS), limits).execute(
        operation, arguments)
    got = ToolRouter(snapshot, limits).execute(operation, arguments)
    assert got.to_json_bytes() == expected.to_json_bytes(), (operation, arguments)


@pytest.mark.parametrize("mode", ["dict", "package-indexed", "package-live"])
@pytest.mark.parametrize("limits", LIMITS, ids=["default", "cap3", "cap1-cut40", "out1k"])
def test_literals_equal_reference(snapshots: dict[str, Snapshot], mode: str,
                                  limits: ToolLimits) -> None:
    for pattern, op in itertools.product(LITERALS, ["source.search", "logs.search"]):
        _same(snapshots[mode], limits, op, {"pattern": pattern})
    _same(snapshots[mode], limits, "source.search", {"pattern": "foo", "path_glob": "b/*"})


@pytest.mark.parametrize("mode", ["dict", "package-indexed", "package-live"])
@pytest.mark.parametrize("limits", LIMITS, ids=["default", "cap3", "cap1-cut40", "out1k"])
def test_regexes_equal_reference(snapshots: dict[str, Snapshot], mode: str,
                                 limits: ToolLimits) -> None:
    for pattern, op in itertools.product(REGEXES, ["source.search", "logs.search"]):
        _same(snapshots[mode], limits, op, {"pattern": pattern, "regex": True})
    _same(snapshots[mode], limits, "source.search",
          {"pattern": r"^\w", "regex": True, "path_glob": "**/*.txt"})


@pytest.mark.parametrize("mode", ["dict", "package-indexed", "package-live"])
@pytest.mark.parametrize("limits", LIMITS, ids=["default", "cap3", "cap1-cut40", "out1k"])
def test_symbols_equal_reference(snapshots: dict[str, Snapshot], mode: str,
                                 limits: ToolLimits) -> None:
    for symbol in SYMBOLS:
        _same(snapshots[mode], limits, "symbol.occurrences", {"symbol": symbol})


def test_reference_results_are_not_trivial() -> None:
    """The corpus exercises every warning the scan can produce, so equality means something."""
    router = ReferenceRouter(DictSnapshot(SOURCE, logs=LOGS), LIMITS[2])
    seen = set()
    for pattern in REGEXES:
        seen.update(router.execute("source.search", {"pattern": pattern, "regex": True}).warnings)
    seen.update(router.execute("symbol.occurrences", {"symbol": "foo"}).warnings)
    assert {"TRUNCATED", "LINE_CUT", "BINARY_SKIPPED", "EMPTY_RESULT", "TEXTUAL_SCOPE"} <= seen
    huge = ReferenceRouter(DictSnapshot(SOURCE, logs=LOGS), LIMITS[0]).execute(
        "symbol.occurrences", {"symbol": "foo"})
    assert huge.stats["long_lines_skipped"] == 1 and "PARTIAL" in huge.warnings


@pytest.mark.parametrize(("pattern", "local"), [
    (r"^foo$", True), (r"(?m)^x", True), (r"(?i)x", True), (r"(?s-i:.)", True),
    (r"\Ax", False), (r"x\z", False), (r"(?-m)^x", False), (r"(?i-m)x", False),
    (r"(?s-im:x)", False), (r"\\A", False),
])
def test_line_local_classification(pattern: str, local: bool) -> None:
    assert line_local(pattern) is local


# -- randomised: files and patterns drawn from the characters that matter ---------------------

_CHARS = ["a", "b", "x", " ", "_", "\n", "\n", "\n", "\r", "\t", "\xe9", "\u65e5", "A", "1",
          "\U0001f600"]
_ATOMS = ["a", "b", "x", " ", "\xe9", "\u65e5", "A", r"\s", r"\S", r"\w", r"\W", r"\d", ".",
          "[^a]", r"[a\n]", r"\n", r"\r", "^", "$", r"\b", r"\B", r"\C", "(?i)a", r"\pL",
          "[[:space:]]", r"\x{0a}", r"\A", r"\z", "(?-m)^", "(?s).", "(?m)$", r"\t"]
_QUANTIFIERS = ["", "", "*", "+", "?", "{2}", "*?", "+?"]

_files = st.dictionaries(
    st.sampled_from(["f1.txt", "f2.txt", "d/f3.txt", "d/e/f4.txt", "z.bin"]),
    st.lists(st.sampled_from(_CHARS), max_size=60).map("".join).map(str.encode)
    | st.binary(max_size=20),
    max_size=5,
)
_regex = st.lists(st.tuples(st.sampled_from(_ATOMS), st.sampled_from(_QUANTIFIERS)),
                  min_size=1, max_size=4).map(lambda parts: "".join(a + q for a, q in parts))
_regexes = st.lists(_regex, min_size=1, max_size=2).map("|".join)
_literal = st.lists(st.sampled_from(_CHARS), min_size=1, max_size=4).map("".join)


def _valid(pattern: str) -> bool:
    try:
        re2.compile(pattern)
    except re2.error:
        return False
    return True


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(files=_files, logs=_files, regex=_regexes, literal=_literal,
       cap=st.sampled_from([1, 2, 200]))
def test_random_files_and_patterns_equal_reference(
        tmp_path: Path, files: dict[str, bytes], logs: dict[str, bytes], regex: str,
        literal: str, cap: int) -> None:
    limits = ToolLimits(search_timeout_s=600.0, max_results=cap, max_line_bytes=40)
    reference = ReferenceRouter(DictSnapshot(files, logs=logs), limits)
    engines = [ToolRouter(DictSnapshot(files, logs=logs), limits),
               ToolRouter(IndexedDictSnapshot(files, logs, tmp_path), limits)]
    calls: list[tuple[str, dict[str, Any]]] = [
        ("source.search", {"pattern": literal}), ("logs.search", {"pattern": literal}),
        ("symbol.occurrences", {"symbol": "a"}), ("symbol.occurrences", {"symbol": "x_a"}),
    ]
    if _valid(regex):
        calls += [("source.search", {"pattern": regex, "regex": True}),
                  ("logs.search", {"pattern": regex, "regex": True})]
    for operation, arguments in calls:
        expected = reference.execute(operation, arguments).to_json_bytes()
        for engine in engines:
            assert engine.execute(operation, arguments).to_json_bytes() == expected, \
                (operation, arguments)


# -- the deadline inside one file ---------------------------------------------------------------


@pytest.mark.parametrize("operation,arguments", [
    ("symbol.occurrences", {"symbol": "ab"}),  # every line a candidate, none an occurrence
    ("source.search", {"pattern": r"\Aab", "regex": True}),  # line by line
])
def test_deadline_inside_a_file_gives_partial(monkeypatch: pytest.MonkeyPatch, operation: str,
                                              arguments: dict[str, Any]) -> None:
    clock = itertools.count()
    monkeypatch.setattr("time.monotonic", lambda: float(next(clock)))
    source = {"a.txt": b"xab\n" * 5000, "b.txt": b"ab\n"}
    # each clock reading advances one second: the router reads it once (deadline 3), the
    # check before a.txt once (1), then only the in-file checks (every 2,048 lines) read it
    # (2, then 3: past the deadline at line 4,096 of 5,000)
    result = ToolRouter(DictSnapshot(source), ToolLimits(search_timeout_s=3.0)).execute(
        operation, arguments)
    assert "PARTIAL" in result.warnings
    assert result.items == []
    assert result.stats["files_scanned"] == 1
