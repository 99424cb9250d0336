"""The per-line search the engine shipped before whole-file search: the reference.

``ReferenceRouter`` is a :class:`~investigation.tools.ToolRouter` whose ``source.search``,
``logs.search`` and ``symbol.occurrences`` run the original implementation unchanged: every
file read and decoded from the snapshot at every search, one ``re2`` call (or substring
test) per line. The differential tests (``tests/unit/test_search_equivalence.py``) assert
that the engine's results equal these byte for byte; ``bench/search.py`` times it as the
"before" figure. Everything else (validation, output bound, warnings order) is the
router's own, so only the scan differs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from investigation.tools import text as tx
from investigation.tools.models import (
    BINARY_SKIPPED,
    LINE_CUT,
    PARTIAL,
    TEXTUAL_SCOPE,
    TRUNCATED,
    LogsSearchArgs,
    SourceSearchArgs,
    SymbolOccurrencesArgs,
)
from investigation.tools.router import MAX_SYMBOL_LINE_CHARS, ToolRouter

_Outcome = tuple[list[dict[str, Any]], set[str], dict[str, Any]]
_MAX_SKIPPED_LISTED = 20
_DEADLINE_EVERY_LINES = 2048


class ReferenceRouter(ToolRouter):
    """A ToolRouter with the original per-line scan (see the module docstring)."""

    def _source_search(self, args: SourceSearchArgs) -> _Outcome:
        paths = self._snapshot.source_paths()
        if args.path_glob is not None:
            glob = tx.PathGlob(args.path_glob)
            paths = [p for p in paths if glob.matches(p)]
        return self._reference_scan(paths, self._snapshot.read_source, _line_matcher(args),
                                    self._cap(args.max_results))

    def _logs_search(self, args: LogsSearchArgs) -> _Outcome:
        return self._reference_scan(self._snapshot.log_paths(), self._snapshot.read_log,
                                    _line_matcher(args), self._cap(args.max_results))

    def _symbol_occurrences(self, args: SymbolOccurrencesArgs) -> _Outcome:
        symbol = args.symbol
        long_lines = [0]

        def columns(line: str) -> list[int | None]:
            if symbol not in line:
                return []
            if len(line) > MAX_SYMBOL_LINE_CHARS:  # minified or generated: not scanned
                long_lines[0] += 1
                return []
            return [col + 1 for col in tx.find_symbol(line, symbol)]

        items, codes, stats = self._reference_scan(self._snapshot.source_paths(),
                                                   self._snapshot.read_source, columns,
                                                   self._cap(args.max_results))
        codes.add(TEXTUAL_SCOPE)
        if long_lines[0]:
            codes.add(PARTIAL)
            stats["long_lines_skipped"] = long_lines[0]
        return items, codes, stats

    def _reference_scan(self, paths: list[str], read: Callable[[str], bytes],
                        matcher: Callable[[str], list[int | None]], cap: int) -> _Outcome:
        """Match every line of ``paths`` in order; stop after ``cap`` items or the deadline.

        ``matcher(line)`` returns one entry per item: ``None`` for a line item, a 1-based
        column for an occurrence item.
        """
        deadline = time.monotonic() + self._limits.search_timeout_s
        max_line = self._limits.max_line_bytes
        items: list[dict[str, Any]] = []
        codes: set[str] = set()
        skipped: list[str] = []
        scanned = 0
        stop = False
        for path in paths:
            if time.monotonic() >= deadline:
                codes.add(PARTIAL)
                break
            text = tx.decode_text(read(path))
            if text is None:
                skipped.append(path)
                continue
            scanned += 1
            for number, line in enumerate(tx.split_lines(text), start=1):
                if number % _DEADLINE_EVERY_LINES == 0 and time.monotonic() >= deadline:
                    codes.add(PARTIAL)
                    stop = True
                    break
                hits = matcher(line)
                if not hits:
                    continue
                quoted, was_cut = tx.cut_text(line, max_line)
                for column in hits:
                    if len(items) >= cap:
                        codes.add(TRUNCATED)
                        stop = True
                        break
                    if was_cut:
                        codes.add(LINE_CUT)
                    if column is None:
                        items.append({"key": f"{path}:{number}", "path": path, "line": number,
                                      "text": quoted})
                    else:
                        items.append({"key": f"{path}:{number}:{column}", "path": path,
                                      "line": number, "column": column, "text": quoted})
                if stop:
                    break
            if stop:
                break
        if skipped:
            codes.add(BINARY_SKIPPED)
        stats = {"files_total": len(paths), "files_scanned": scanned,
                 "files_skipped": len(skipped), "skipped_paths": skipped[:_MAX_SKIPPED_LISTED]}
        return items, codes, stats


def _line_matcher(args: SourceSearchArgs | LogsSearchArgs) -> Callable[[str], list[int | None]]:
    hit: list[int | None] = [None]
    if args.regex:
        regex = tx.compile_regex(args.pattern)
        return lambda line: hit if regex.search(line) is not None else []
    pattern = args.pattern
    return lambda line: hit if pattern in line else []
