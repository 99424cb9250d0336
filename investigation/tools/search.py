"""Line search over whole files: one RE2 search (or substring find) per matching line.

The result contract is line by line (``source.search``, ``logs.search``,
``symbol.occurrences``): a line is the ``\\n``-separated piece of a text file, without its
``\\n``; a regular expression matches a line if ``regex.search(line)`` finds a match in
that line alone, so ``^``, ``$``, ``\\A`` and ``\\z`` are the line's ends and no match
crosses a line. Calling RE2 once per line through the Python wrapper costs a call per line
(about a million over a standard library). This module finds the same lines with one
search per *matching* line over the file's bytes instead:

* A **probe** finds the first candidate at or after a line start. For a literal it is a
  substring find; for a regex it is the same pattern compiled with ``(?m)`` (``^``/``$``
  match at line ends) and RE2's ``never_nl`` option (no character class, dot or literal
  matches ``\\n``), searched in UTF-8 mode over the bytes.
* Why that finds every matching line: the bytes of a line are the same in the file, and
  every assertion a match can depend on agrees at the same position (``(?m)^``/``$`` are
  true exactly at line ends, ``\\b``/``\\B`` see ``\\n`` or the text's end - both non-word -
  beyond a line end), so a match of the pattern inside a line alone is a match of the
  probe at the same offset. RE2 returns the leftmost match, so no line between the search
  position and the probe's match has a match of its own.
* A probe match that lies inside one line proves that line matches (the converse of the
  argument above), so it becomes an item without a second search. A probe match that
  contains ``\\n`` (only ``\\C``, any byte, can) makes every line it touches a candidate,
  each checked with the original per-line search. ``symbol.occurrences`` checks every
  candidate line with its identifier-boundary rule.
* After a matching line the next probe starts at the following line start.
* Patterns for which the argument does not hold - they use ``\\A``, ``\\z`` (start and end
  of text, which are a line's ends only when the line is searched alone) or turn the
  multi-line flag off with ``(?-m)`` - are searched line by line as before: same results,
  slower.

Results are the per-line implementation's, byte for byte: same items in the same order,
same keys, warnings (``LINE_CUT``, ``BINARY_SKIPPED``, ``TRUNCATED``, ``PARTIAL``) and
stats; ``tests/unit/test_search_equivalence.py`` compares both over many patterns. The
deadline is checked before every file and every 2,048 lines searched line by line or
candidate lines checked; a single RE2 search over one file runs to its end (linear time).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import re2

from investigation.cases.textindex import Buffer, TextIndex
from investigation.tools import text as tx
from investigation.tools.models import BINARY_SKIPPED, LINE_CUT, PARTIAL, TRUNCATED

__all__ = ["LineQuery", "literal_query", "regex_query", "scan", "symbol_query"]

Outcome = tuple[list[dict[str, Any]], set[str], dict[str, Any]]
#: Per-line matcher: one entry per item, ``None`` for a line item, a 1-based column for an
#: occurrence item; empty when the line does not match.
Matcher = Callable[[str], list[int | None]]
#: Probe: ``(buffer, pos, end)`` -> span ``(start, stop)`` of the first candidate in
#: ``buffer[pos:end]`` (``pos`` is a line start), or None.
Probe = Callable[[Buffer, int, int], tuple[int, int] | None]

#: Skipped file paths listed in ``stats["skipped_paths"]`` (the count is always exact).
MAX_SKIPPED_LISTED = 20
#: Lines between two deadline checks inside one file.
DEADLINE_EVERY_LINES = 2048
_LINE_HIT: list[int | None] = [None]
_NL = 0x0A


@dataclass(frozen=True)
class LineQuery:
    """What to find in each line.

    Attributes:
        matcher: the per-line rule (the contract's semantics).
        probe: finds candidates in whole files; None searches line by line.
        exact: a probe span inside one line is a line item without calling ``matcher``.
    """

    matcher: Matcher
    probe: Probe | None
    exact: bool


def literal_query(pattern: str) -> LineQuery:
    """Lines containing ``pattern`` (a case-sensitive substring)."""
    needle = pattern.encode("utf-8")

    def matcher(line: str) -> list[int | None]:
        return _LINE_HIT if pattern in line else []

    def probe(buf: Buffer, pos: int, end: int) -> tuple[int, int] | None:
        found = buf.find(needle, pos, end)
        return None if found < 0 else (found, found + len(needle))

    def nothing(buf: Buffer, pos: int, end: int) -> None:
        return None

    return LineQuery(matcher, nothing if "\n" in pattern else probe, exact=True)


def regex_query(pattern: str) -> LineQuery:
    """Lines where the RE2 ``pattern`` finds a match (searched in the line alone).

    Raises:
        ToolError: ``TOOL_REGEX_INVALID`` when RE2 refuses ``pattern``.
    """
    regex = tx.compile_regex(pattern)

    def matcher(line: str) -> list[int | None]:
        return _LINE_HIT if regex.search(line) is not None else []

    if not line_local(pattern):
        return LineQuery(matcher, None, exact=False)
    options = tx.re2_options()
    options.never_nl = True
    options.never_capture = True
    try:
        whole = re2.compile("(?m)" + pattern, options)
    except (re2.error, TypeError, ValueError):  # cannot happen for a valid pattern; be safe
        return LineQuery(matcher, None, exact=False)

    def probe(buf: Buffer, pos: int, end: int) -> tuple[int, int] | None:
        found = whole.search(buf, pos, end)
        return None if found is None else found.span()

    return LineQuery(matcher, probe, exact=True)


def symbol_query(symbol: str, matcher: Matcher) -> LineQuery:
    """Candidate lines containing ``symbol`` (ASCII), each checked with ``matcher``."""
    needle = symbol.encode("ascii")

    def probe(buf: Buffer, pos: int, end: int) -> tuple[int, int] | None:
        found = buf.find(needle, pos, end)
        return None if found < 0 else (found, found + len(needle))

    return LineQuery(matcher, probe, exact=False)


def line_local(pattern: str) -> bool:
    """False if ``pattern`` may use start/end of *text* assertions (see the module docstring).

    Conservative and purely lexical: ``\\A``, ``\\z`` or a flag group that turns ``m``
    off anywhere in the text (even escaped or quoted) sends the pattern line by line.
    """
    if "\\A" in pattern or "\\z" in pattern:
        return False
    at = pattern.find("(?")
    while at >= 0:
        end = at + 2
        while end < len(pattern) and pattern[end] in "imsU-":
            end += 1
        flags = pattern[at + 2:end]
        if "-" in flags and "m" in flags[flags.index("-"):]:
            return False
        at = pattern.find("(?", at + 2)
    return True


#: Masks the lines of one file (built from the file's bytes): ``(number, line)`` ->
#: ``(shown text, secrets masked)``.
LineMask = Callable[[int, str], tuple[str, int]]


def scan(index: TextIndex, root: str, paths: list[str], query: LineQuery, *, cap: int,
         max_line_bytes: int, deadline: float,
         mask: Callable[[bytes], LineMask] | None = None) -> Outcome:
    """Find matching lines of ``paths`` in order; stop after ``cap`` items or the deadline.

    Args:
        index: the snapshot's text (shared index or the snapshot itself).
        root: ``"source"`` or ``"logs"``.
        paths: files to search, in result order.
        query: what to find.
        cap: most items; one more makes the result ``TRUNCATED``.
        max_line_bytes: quoted lines are cut to this many UTF-8 bytes (``LINE_CUT``).
        deadline: ``time.monotonic()`` value after which the search stops (``PARTIAL``).
        mask: builds a file's line mask (secrets, ``investigation.secrets``) when the file
            has a matching line; a line whose shown text differs must match again as
            shown, and is quoted as shown.

    Returns:
        ``(items, warning codes, stats)`` with stats ``files_total``, ``files_scanned``,
        ``files_skipped``, ``skipped_paths`` (at most 20 listed) and, when a quoted line
        was masked, ``secrets_masked`` (how many secrets).
    """
    run = _Run(query, cap, max_line_bytes, deadline, mask)
    skipped: list[str] = []
    scanned = 0
    with index.view() as view:
        for path in paths:
            if time.monotonic() >= deadline:
                run.codes.add(PARTIAL)
                break
            located = view.locate(root, path)
            if located is None:
                skipped.append(path)
                continue
            scanned += 1
            buf, start, end = located
            run.file_mask = None
            if query.probe is None:
                run.line_by_line(path, buf[start:end])
            else:
                run.whole_file(path, buf, start, end, query.probe)
            if run.stop:
                break
    if skipped:
        run.codes.add(BINARY_SKIPPED)
    stats: dict[str, Any] = {"files_total": len(paths), "files_scanned": scanned,
                             "files_skipped": len(skipped),
                             "skipped_paths": skipped[:MAX_SKIPPED_LISTED]}
    if run.masked:
        stats["secrets_masked"] = run.masked
    return run.items, run.codes, stats


class _Run:
    """The state of one scan: items, warning codes, and whether it must stop."""

    def __init__(self, query: LineQuery, cap: int, max_line_bytes: int, deadline: float,
                 mask: Callable[[bytes], LineMask] | None = None) -> None:
        self.query = query
        self.cap = cap
        self.max_line = max_line_bytes
        self.deadline = deadline
        self.mask = mask
        self.file_mask: LineMask | None = None
        self.masked = 0
        self.items: list[dict[str, Any]] = []
        self.codes: set[str] = set()
        self.stop = False
        self._checked = 0

    def shown(self, data: Buffer, number: int, line: str, hits: list[int | None]
              ) -> tuple[str, list[int | None], int]:
        """The line as findings show it, its hits there and the secrets masked: a masked
        line must match again as shown (a search cannot find a secret's characters)."""
        if self.mask is None:
            return line, hits, 0
        if self.file_mask is None:  # once per file, at its first matching line
            self.file_mask = self.mask(bytes(data))
        text, masked = self.file_mask(number, line)
        if not masked:
            return line, hits, 0
        return text, self.query.matcher(text), masked

    def _tick(self) -> None:
        """Count one line of work; check the deadline every ``DEADLINE_EVERY_LINES``."""
        self._checked += 1
        if self._checked % DEADLINE_EVERY_LINES == 0 and time.monotonic() >= self.deadline:
            self.codes.add(PARTIAL)
            self.stop = True

    def add(self, path: str, number: int, line: str, hits: list[int | None],
            data: Buffer = b"") -> None:
        """Append the items of one matching line (the per-line contract's exact items);
        ``data`` is the file's text (for its line mask)."""
        line, hits, masked = self.shown(data, number, line, hits)
        if not hits:
            return
        self.masked += masked
        quoted, was_cut = tx.cut_text(line, self.max_line)
        for column in hits:
            if len(self.items) >= self.cap:
                self.codes.add(TRUNCATED)
                self.stop = True
                return
            if was_cut:
                self.codes.add(LINE_CUT)
            if column is None:
                self.items.append({"key": f"{path}:{number}", "path": path, "line": number,
                                   "text": quoted})
            else:
                self.items.append({"key": f"{path}:{number}:{column}", "path": path,
                                   "line": number, "column": column, "text": quoted})

    def line_by_line(self, path: str, data: bytes) -> None:
        """The per-line search of one file (patterns that are not line-local)."""
        for number, line in enumerate(tx.split_lines(data.decode("utf-8")), start=1):
            if number % DEADLINE_EVERY_LINES == 0 and time.monotonic() >= self.deadline:
                self.codes.add(PARTIAL)
                self.stop = True
                return
            hits = self.query.matcher(line)
            if hits:
                self.add(path, number, line, hits, data)
                if self.stop:
                    return

    def whole_file(self, path: str, buf: Buffer, start: int, end: int, probe: Probe) -> None:
        """Probe the file's bytes; turn candidate spans into items."""
        found = probe(buf, start, end)
        if found is None:
            return  # most files: one probe, nothing copied
        text = buf if start == 0 and end == len(buf) and isinstance(buf, bytes) \
            else buf[start:end]
        size = len(text)
        span: tuple[int, int] | None = (found[0] - start, found[1] - start)
        pos, number = 0, 1  # pos: a line start; number: its 1-based line number
        while span is not None:
            first, stop = span
            line_start = max(pos, text.rfind(b"\n", pos, first) + 1)
            if line_start >= size:
                return  # an empty match after the final newline: not a line
            number += text.count(b"\n", pos, line_start)
            line_end = text.find(b"\n", line_start)
            line_end = size if line_end < 0 else line_end
            if stop <= line_end:  # the span lies inside one line
                line = text[line_start:line_end].decode("utf-8")
                hits = _LINE_HIT if self.query.exact else self.query.matcher(line)
                if hits:
                    self.add(path, number, line, hits, text)
                pos, number = line_end + 1, number + 1
                self._tick()
            else:  # the span holds a newline: check each line it touches
                pos, number = self._span_lines(path, text, line_start, number, stop - 1)
            if self.stop or pos >= size:
                return
            span = probe(text, pos, size)

    def _span_lines(self, path: str, text: bytes, line_start: int, number: int, last: int
                    ) -> tuple[int, int]:
        """Check every line from ``line_start`` through the one holding byte ``last``."""
        size = len(text)
        while line_start < size and line_start <= last:
            line_end = text.find(b"\n", line_start)
            line_end = size if line_end < 0 else line_end
            line = text[line_start:line_end].decode("utf-8")
            hits = self.query.matcher(line)
            if hits:
                self.add(path, number, line, hits, text)
            line_start, number = line_end + 1, number + 1
            self._tick()
            if self.stop:
                break
        return line_start, number
