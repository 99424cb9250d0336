"""ToolRouter: validate and run the eight read-only snapshot operations.

Outcome contract:

* a refusal raises :class:`~investigation.errors.ToolError` with a stable code
  (``TOOL_UNKNOWN_OPERATION``, ``TOOL_INVALID_ARGUMENTS``, ``TOOL_PATH_ESCAPE``,
  ``TOOL_PATTERN_TOO_LONG``, ``TOOL_REGEX_INVALID``, ``TOOL_NOT_FOUND``,
  ``TOOL_NO_DATABASE``, ``TOOL_SQL_NOT_READ_ONLY``, ``TOOL_SQL_MULTIPLE_STATEMENTS``,
  ``TOOL_SQL_ERROR``, ``TOOL_SQL_TIMEOUT``);
* anything else is a :class:`~investigation.tools.models.ToolResult` whose items have
  stable keys and whose warnings say when it is empty, truncated, partial or cut.

Determinism: files are visited in the snapshot's sorted order, lines in file order, SQL
rows in the statement's order, and no timing value is recorded. The only
timing-dependent outcome is a deadline (``PARTIAL`` / ``TOOL_SQL_TIMEOUT``); the loop
persists every raw result, so a recorded run replays byte for byte.

Several databases: ``db.tables`` lists all of them, ``db.schema`` accepts
``"<database>.<table>"`` (needed only when a name is ambiguous), and ``db.query`` runs
on the first database in sorted order (named in ``stats["database"]``); the fixed
interface has no database argument, and ATTACH is refused by design.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel, ValidationError

from investigation import jsonio
from investigation.cases.snapshot import Snapshot
from investigation.cases.textindex import IndexedSnapshot, LiveTextIndex, TextIndex
from investigation.config import ToolLimits, canonical_json
from investigation.constants import OPERATIONS
from investigation.errors import ToolError
from investigation.secrets import default_masker, mask_marker, private_key_lines
from investigation.tools import search
from investigation.tools import text as tx
from investigation.tools.models import (
    ARGUMENT_MODELS,
    BINARY_SKIPPED,
    EMPTY_RESULT,
    LINE_CUT,
    PARTIAL,
    RANGE_CLIPPED,
    SECRET_MASKED,
    TEXTUAL_SCOPE,
    TRUNCATED,
    DbQueryArgs,
    DbSchemaArgs,
    LogsSearchArgs,
    SourceListArgs,
    SourceReadArgs,
    SourceSearchArgs,
    SymbolOccurrencesArgs,
    ToolResult,
    ordered_warnings,
)
from investigation.tools.sqlite import ReadOnlyDatabase, render_value

_Outcome = tuple[list[dict[str, Any]], set[str], dict[str, Any]]

#: Lines longer than this (characters) are not scanned for symbol occurrences: every
#: candidate position is checked in Python, and a minified line can hold millions.
MAX_SYMBOL_LINE_CHARS = 100_000
#: Most tables :meth:`ToolRouter.table_names` lists (a context lists them all or none).
MAX_LISTED_TABLES = 200
#: Arguments capped at ``tools.max_results``; their schema states the cap as ``maximum``.
CAPPED_ARGUMENTS = ("limit", "max_results", "max_rows")


@functools.cache
def _schema_json(operation: str) -> str:
    # pydantic builds a JSON Schema afresh on every call; the models are static.
    return json.dumps(ARGUMENT_MODELS[operation].model_json_schema())


def _argument_schema(operation: str) -> dict[str, Any]:
    """The JSON Schema of an operation's argument model (a fresh copy each call)."""
    return dict(jsonio.loads(_schema_json(operation)))


class ToolRouter:
    """The read-only snapshot operations of one case package.

    Args:
        snapshot: the immutable case snapshot to read.
        limits: result caps, line and output bounds, deadlines.

    A router caches one private in-memory copy per packed database; it is safe to share
    between threads (database access is serialised). Call :meth:`close` to free them.
    """

    def __init__(self, snapshot: Snapshot, limits: ToolLimits) -> None:
        self._snapshot = snapshot
        self._limits = limits
        self._dbs: dict[str, ReadOnlyDatabase] = {}
        self._dbs_lock = threading.Lock()
        self._index: TextIndex | None = None
        self._index_lock = threading.Lock()
        #: ``describe()`` as JSON text and ``table_names()``, computed on first use.
        self._described: str | None = None
        self._tables: list[str] | None = None
        self._handlers: dict[str, Callable[[Any], _Outcome]] = {
            "source.list": self._source_list,
            "source.search": self._source_search,
            "source.read": self._source_read,
            "symbol.occurrences": self._symbol_occurrences,
            "db.tables": self._db_tables,
            "db.schema": self._db_schema,
            "db.query": self._db_query,
            "logs.search": self._logs_search,
        }

    # -- public API ---------------------------------------------------------------

    def describe(self) -> list[dict[str, Any]]:
        """The operations as shown to the model, in :data:`OPERATIONS` order (a fresh
        copy each call: a pure function of the limits, built once per router).

        Returns:
            ``[{"operation": str, "description": str, "arguments_schema": dict}]`` where
            the schema is the JSON Schema of the operation's pydantic argument model.
        """
        if self._described is None:
            self._described = json.dumps(self._describe())
        described: list[dict[str, Any]] = jsonio.loads(self._described)
        return described

    def _describe(self) -> list[dict[str, Any]]:
        lim = self._limits
        cap = lim.max_results
        descriptions = {
            "source.list": f"List source files (path, size_bytes) whose path starts with "
                           f"prefix, sorted; at most {cap}.",
            "source.search": f"Find source lines containing pattern (substring, or RE2 regex "
                             f"matched per line); at most {cap} lines, each quoted.",
            "source.read": f"Quote lines start_line..end_line (1-based, inclusive) of one "
                           f"source file; at most {lim.max_read_lines} lines.",
            "symbol.occurrences": f"Find an identifier at identifier boundaries in the "
                                  f"source (textual, not semantic); at most {cap}.",
            "db.tables": "List the tables and views of every packed SQLite database.",
            "db.schema": "Columns, DDL, indexes and triggers of one table or view.",
            "db.query": f"Run one read-only SELECT on the packed SQLite database; at most "
                        f"{cap} rows, {lim.sql_timeout_s:g} s deadline; no PRAGMA, ATTACH, "
                        f"writes, random() or 'now'.",
            "logs.search": f"Find log lines containing pattern (substring, or RE2 regex "
                           f"matched per line); at most {cap} lines, each quoted.",
        }
        result = []
        for op in OPERATIONS:
            schema = _argument_schema(op)
            schema.pop("description", None)  # the class docstring; the operation says it
            schema.pop("title", None)  # pydantic's class and field titles: noise to a model
            for prop in schema.get("properties", {}).values():
                prop.pop("title", None)
            for name in CAPPED_ARGUMENTS:
                prop = schema.get("properties", {}).get(name)
                for variant in (prop or {}).get("anyOf", []):
                    if variant.get("type") == "integer":
                        variant["maximum"] = cap
            result.append({"operation": op, "description": descriptions[op],
                           "arguments_schema": schema})
        return result

    def table_names(self) -> list[str]:
        """The tables and views of the packed databases, as ``db.schema`` accepts them.

        Returns:
            Plain names when one database is packed, ``<database>.<table>`` names when
            several are; sorted; empty when there is no database or one cannot be opened
            (the database operations then report it), or when there are more than
            :data:`MAX_LISTED_TABLES` (the context does not list them then). A name
            that holds a secret (``investigation.secrets``) is left out: the context and
            the reply schema never carry it, and a masked name would name no table.
        """
        if self._tables is not None:  # the snapshot is immutable: listed once
            return list(self._tables)
        names = self._snapshot.db_names()
        try:
            found = [(db, name) for db in names for name, _kind in self._db(db).objects()
                     if not default_masker().spans(f"{db}.{name}")]
        except ToolError:
            return []  # (not kept: the next call tries again)
        if len(found) > MAX_LISTED_TABLES:
            tables: list[str] = []
        elif len(names) == 1:
            tables = sorted(name for _db, name in found)
        else:
            tables = sorted(f"{db}.{name}" for db, name in found)
        self._tables = tables
        return list(tables)

    def validate(self, operation: str, arguments: dict[str, Any]) -> BaseModel:
        """Preflight one operation without running it.

        Applies the argument model, the path, pattern and regex rules, cheap snapshot
        lookups (file and table existence) and, for ``db.query``, compiles the statement
        under the read-only authorizer without running it.

        Args:
            operation: one of :data:`investigation.constants.OPERATIONS`.
            arguments: the model-supplied JSON object.

        Returns:
            The validated argument model with defaults filled and ``limit`` /
            ``max_results`` / ``max_rows`` set to their effective (capped) value.

        Raises:
            ToolError: a ``TOOL_*`` code listed in the module docstring (never
                ``TOOL_SQL_TIMEOUT``).
        """
        model_type = ARGUMENT_MODELS.get(operation) if isinstance(operation, str) else None
        if model_type is None:
            raise ToolError("TOOL_UNKNOWN_OPERATION",
                            f"unknown operation {operation!r}; use one of {list(OPERATIONS)}",
                            operation=str(operation))
        if not isinstance(arguments, dict):
            raise ToolError("TOOL_INVALID_ARGUMENTS", "arguments must be a JSON object",
                            operation=operation)
        try:
            json.dumps(arguments, ensure_ascii=False).encode("utf-8")
        except (TypeError, ValueError, UnicodeEncodeError) as exc:
            raise ToolError("TOOL_INVALID_ARGUMENTS",
                            f"{operation}: arguments must be JSON with Unicode strings",
                            operation=operation) from exc
        try:
            args = model_type.model_validate(arguments)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'arguments'}: {err['msg']}"
                for err in exc.errors(include_url=False, include_input=False))
            raise ToolError("TOOL_INVALID_ARGUMENTS", f"{operation}: {problems}",
                            operation=operation) from exc
        try:
            return self._check(args)
        except (OverflowError, ValueError, UnicodeError) as exc:  # never a crash on input
            raise ToolError("TOOL_INVALID_ARGUMENTS", f"{operation}: {exc}",
                            operation=operation) from exc

    def execute(self, operation: str, arguments: dict[str, Any]) -> ToolResult:
        """Validate, then run one operation.

        Returns:
            The :class:`ToolResult`; equal arguments on an equal snapshot give an equal
            result unless a deadline was hit (``PARTIAL``).

        Raises:
            ToolError: any code of :meth:`validate`, and ``TOOL_SQL_TIMEOUT`` /
                ``TOOL_SQL_ERROR`` from running a statement.
        """
        args = self.validate(operation, arguments)
        items, codes, stats = self._handlers[operation](args)
        # Names come from the snapshot too (file paths, table, column and index names,
        # SQLite's error text): masked like the text the handlers masked line by line.
        items, in_names = default_masker().mask_names(items)
        stats, in_stats = default_masker().mask_names(stats)
        if in_names + in_stats:
            stats["secrets_masked"] = stats.get("secrets_masked", 0) + in_names + in_stats
        if stats.get("secrets_masked"):
            codes.add(SECRET_MASKED)
        items, over = self._bound_output(items)
        if over:
            codes.add(TRUNCATED)
            stats["output_bytes_capped"] = True
        if not items:
            codes.add(EMPTY_RESULT)
        stats["items"] = len(items)
        return ToolResult(operation=operation, arguments=args.model_dump(mode="json"),
                          items=items, warnings=ordered_warnings(codes), stats=stats)

    def close(self) -> None:
        """Free the cached database copies and the text index handle (the router stays
        usable; they reopen)."""
        with self._dbs_lock:
            dbs, self._dbs = self._dbs, {}
        for db in dbs.values():
            db.close()
        with self._index_lock:
            self._index = None

    # -- validation ---------------------------------------------------------------

    def _cap(self, value: int | None) -> int:
        cap = self._limits.max_results
        return cap if value is None else min(value, cap)

    def _check(self, args: BaseModel) -> BaseModel:
        max_pattern = self._limits.max_pattern_bytes
        if isinstance(args, SourceListArgs):
            tx.check_relative_path(args.prefix, "prefix", allow_empty=True)
            tx.check_pattern_length(args.prefix, "prefix", max_pattern)
            return args.model_copy(update={"limit": self._cap(args.limit)})
        if isinstance(args, SourceSearchArgs | LogsSearchArgs):
            tx.check_pattern_length(args.pattern, "pattern", max_pattern)
            if args.regex:
                tx.compile_regex(args.pattern)
            if isinstance(args, SourceSearchArgs) and args.path_glob is not None:
                tx.check_relative_path(args.path_glob, "path_glob")
                tx.check_pattern_length(args.path_glob, "path_glob", max_pattern)
                tx.PathGlob(args.path_glob)
            return args.model_copy(update={"max_results": self._cap(args.max_results)})
        if isinstance(args, SourceReadArgs):
            tx.check_relative_path(args.path, "path")
            if args.path not in set(self._snapshot.source_paths()):
                raise ToolError("TOOL_NOT_FOUND",
                                f"no source file {args.path!r}; use source.list to find paths",
                                argument="path")
            return args
        if isinstance(args, SymbolOccurrencesArgs):
            tx.check_symbol(args.symbol)
            return args.model_copy(update={"max_results": self._cap(args.max_results)})
        if isinstance(args, DbSchemaArgs):
            self._resolve_table(args.table)
            return args
        if isinstance(args, DbQueryArgs):
            self._first_db().preflight(
                args.sql, args.params, timeout_s=self._limits.sql_timeout_s + 1.0,
                memory_bytes=self._limits.sql_memory_bytes,
                isolate=self._limits.isolate_sql)
            return args.model_copy(update={"max_rows": self._cap(args.max_rows)})
        for name in self._require_db():  # db.tables: every database must open
            self._db(name)
        return args

    # -- databases ----------------------------------------------------------------

    def _require_db(self) -> list[str]:
        names = self._snapshot.db_names()
        if not names:
            raise ToolError("TOOL_NO_DATABASE", "this case package has no database snapshot; "
                            "use the source and log operations")
        return names

    def _db(self, name: str) -> ReadOnlyDatabase:
        with self._dbs_lock:
            db = self._dbs.get(name)
            if db is None:
                db = ReadOnlyDatabase(name, self._snapshot.db_bytes(name))
                self._dbs[name] = db
            return db

    def _first_db(self) -> ReadOnlyDatabase:
        return self._db(self._require_db()[0])

    def _resolve_table(self, table: str) -> tuple[str, str, str]:
        """``(database, table, type)`` for a plain or ``database.table`` name."""
        candidates = [(db, name, kind) for db in self._require_db()
                      for name, kind in self._db(db).objects()]

        def pick(norm: Callable[[str], str]) -> list[tuple[str, str, str]]:
            wanted = norm(table)
            return [c for c in candidates
                    if norm(c[1]) == wanted or norm(f"{c[0]}.{c[1]}") == wanted]

        found = pick(lambda s: s) or pick(_ascii_lower)
        if not found:
            raise ToolError("TOOL_NOT_FOUND",
                            f"no table or view {table!r}; use db.tables to list them",
                            argument="table")
        if len(found) > 1:
            names = sorted(f"{db}.{name}" for db, name, _ in found)
            raise ToolError("TOOL_INVALID_ARGUMENTS",
                            f"table {table!r} is ambiguous; qualify it as one of {names}",
                            argument="table")
        return found[0]

    def _db_tables(self, _args: Any) -> _Outcome:
        items = [
            {"key": f"{db}:{name}", "database": db, "table": name, "type": kind}
            for db in self._require_db() for name, kind in self._db(db).objects()
        ]
        return items, set(), {"databases": self._require_db()}

    def _db_schema(self, args: DbSchemaArgs) -> _Outcome:
        db, table, kind = self._resolve_table(args.table)
        info = self._db(db).schema(table, timeout_s=self._limits.sql_timeout_s + 1.0,
                                   memory_bytes=self._limits.sql_memory_bytes,
                                   isolate=self._limits.isolate_sql)
        base = f"{db}:{table}"
        masked = [0]

        def ddl_text(value: Any) -> Any:
            shown = _text(value)
            if isinstance(shown, str):
                shown, n = default_masker().mask_prefix(shown)
                masked[0] += n
            return shown

        items: list[dict[str, Any]] = []
        for _cid, name, ctype, notnull, default, pk in info["columns"]:
            shown_default = render_value(default)
            if isinstance(shown_default, str):
                shown_default, n = default_masker().mask_prefix(shown_default)
                masked[0] += n
            items.append({"key": f"{base}.{_text(name)}", "column": _text(name),
                          "type": _text(ctype), "notnull": bool(notnull),
                          "default": shown_default, "pk": pk})
        items.append({"key": f"{base}#ddl", "ddl": ddl_text(info["ddl"])})
        for name, unique, origin, columns, ddl in info["indexes"]:
            items.append({"key": f"{base}#index:{_text(name)}", "index": _text(name),
                          "unique": unique, "origin": origin,
                          "columns": [_text(c) for c in columns], "ddl": ddl_text(ddl)})
        for name, ddl in info["triggers"]:
            items.append({"key": f"{base}#trigger:{_text(name)}", "trigger": _text(name),
                          "ddl": ddl_text(ddl)})
        stats: dict[str, Any] = {"database": db, "table": table, "type": kind}
        if masked[0]:
            stats["secrets_masked"] = masked[0]
        return items, set(), stats

    def _db_query(self, args: DbQueryArgs) -> _Outcome:
        db = self._first_db()
        max_rows = self._cap(args.max_rows)
        columns, rows, truncated, deadline_hit = db.query(
            args.sql, args.params, max_rows, self._limits.sql_timeout_s,
            memory_bytes=self._limits.sql_memory_bytes, isolate=self._limits.isolate_sql)
        names = _unique_names(columns)
        codes: set[str] = set()
        items = []
        seen: dict[str, int] = {}
        masked = 0
        for row in rows:
            full = [render_value(v) for v in row]
            for index, (column, value) in enumerate(zip(columns, full, strict=True)):
                if isinstance(value, str):
                    full[index], n = default_masker().mask_value(column, value)
                    masked += n
            # The key is computed from what is shown: nothing derived from a secret.
            digest = hashlib.sha256(canonical_json(full)).hexdigest()[:16]
            seen[digest] = seen.get(digest, 0) + 1
            key = f"row:{digest}" if seen[digest] == 1 else f"row:{digest}:{seen[digest]}"
            shown = {}
            for name, value in zip(names, full, strict=True):
                shown[name], was_cut = self._cut_value(value)
                if was_cut:
                    codes.add(LINE_CUT)
            items.append({"key": key, "row": shown})
        if truncated:
            codes.add(TRUNCATED)
        if deadline_hit:
            codes.add(PARTIAL)
        stats: dict[str, Any] = {"database": db.name, "columns": columns, "rows": len(rows)}
        if masked:
            stats["secrets_masked"] = masked
        return items, codes, stats

    def _cut_value(self, value: Any) -> tuple[Any, bool]:
        limit = self._limits.max_line_bytes
        if isinstance(value, str):
            return tx.cut_text(value, limit)
        if isinstance(value, dict) and "$hex" in value and len(value["$hex"]) > limit:
            return {"$hex": value["$hex"][:limit - limit % 2]}, True
        return value, False

    # -- files --------------------------------------------------------------------

    def _source_list(self, args: SourceListArgs) -> _Outcome:
        limit = self._cap(args.limit)
        matching = [p for p in self._snapshot.source_paths() if p.startswith(args.prefix)]
        items = [{"key": p, "path": p, "size_bytes": len(self._snapshot.read_source(p))}
                 for p in matching[:limit]]
        codes = {TRUNCATED} if len(matching) > limit else set()
        return items, codes, {"total_matches": len(matching)}

    def _source_read(self, args: SourceReadArgs) -> _Outcome:
        text = tx.decode_text(self._snapshot.read_source(args.path))
        if text is None:
            return [], {BINARY_SKIPPED}, {"total_lines": None, "start_line": None,
                                          "end_line": None}
        lines = tx.split_lines(text)
        pem = private_key_lines(lines) if "PRIVATE KEY" in text else set()
        masked = 0
        codes: set[str] = set()
        end = args.end_line
        if end - args.start_line + 1 > self._limits.max_read_lines:
            end = args.start_line + self._limits.max_read_lines - 1
            codes.add(RANGE_CLIPPED)
        if end > len(lines):
            end = len(lines)
            codes.add(RANGE_CLIPPED)
        items = []
        for number in range(args.start_line, end + 1):
            shown, n = _masked_line(lines[number - 1], number - 1 in pem)
            masked += n
            quoted, was_cut = tx.cut_text(shown, self._limits.max_line_bytes)
            if was_cut:
                codes.add(LINE_CUT)
            items.append({"key": f"{args.path}:{number}", "path": args.path, "line": number,
                          "text": quoted})
        shown_range = end >= args.start_line
        stats: dict[str, Any] = {"total_lines": len(lines),
                                 "start_line": args.start_line if shown_range else None,
                                 "end_line": end if shown_range else None}
        if masked:
            stats["secrets_masked"] = masked
        return items, codes, stats

    def _source_search(self, args: SourceSearchArgs) -> _Outcome:
        paths = self._snapshot.source_paths()
        if args.path_glob is not None:
            glob = tx.PathGlob(args.path_glob)
            paths = [p for p in paths if glob.matches(p)]
        return self._scan("source", paths, _line_query(args), self._cap(args.max_results))

    def _logs_search(self, args: LogsSearchArgs) -> _Outcome:
        return self._scan("logs", self._snapshot.log_paths(), _line_query(args),
                          self._cap(args.max_results))

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

        items, codes, stats = self._scan("source", self._snapshot.source_paths(),
                                         search.symbol_query(symbol, columns),
                                         self._cap(args.max_results))
        codes.add(TEXTUAL_SCOPE)
        if long_lines[0]:
            codes.add(PARTIAL)
            stats["long_lines_skipped"] = long_lines[0]
        return items, codes, stats

    def _scan(self, root: str, paths: list[str], query: search.LineQuery, cap: int
              ) -> _Outcome:
        """Search ``paths`` under ``root`` in order (:func:`investigation.tools.search.scan`).

        The snapshot's shared text index is opened once per router, outside the deadline
        (building it is one-time work per package and host).
        """
        index = self._text_index()
        deadline = time.monotonic() + self._limits.search_timeout_s
        items, codes, stats = search.scan(
            index, root, paths, query, cap=cap, max_line_bytes=self._limits.max_line_bytes,
            deadline=deadline, mask=_FileMask)
        return items, codes, stats

    def _text_index(self) -> TextIndex:
        with self._index_lock:
            if self._index is None:
                shared = (self._snapshot.text_index()
                          if isinstance(self._snapshot, IndexedSnapshot) else None)
                self._index = shared if shared is not None else LiveTextIndex(self._snapshot)
            return self._index

    def _bound_output(self, items: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
        """Keep the longest prefix of ``items`` whose canonical JSON array fits the bound."""
        budget = self._limits.max_output_bytes - 2  # the brackets
        used = 0
        for index, item in enumerate(items):
            used += len(canonical_json(item)) + (1 if index else 0)
            if used > budget:
                return items[:index], True
        return items, False


def _masked_line(line: str, in_private_key: bool) -> tuple[str, int]:
    """A line as the findings show it: secrets masked (a line of a PEM private key block
    whole); returns ``(text, secrets masked)``."""
    if in_private_key:
        return mask_marker("Private Key"), 1
    return default_masker().mask_prefix(line)



class _FileMask:
    """Masks the lines of one file as the findings show them (``investigation.secrets``);
    built by the search only for a file with a matching line."""

    def __init__(self, data: bytes) -> None:
        self._pem: set[int] = set()
        if b"PRIVATE KEY" in data:
            self._pem = private_key_lines(tx.split_lines(data.decode("utf-8")))

    def __call__(self, number: int, line: str) -> tuple[str, int]:
        """``(shown text, secrets masked)`` of 1-based line ``number``."""
        return _masked_line(line, number - 1 in self._pem)


def _line_query(args: SourceSearchArgs | LogsSearchArgs) -> search.LineQuery:
    if args.regex:
        return search.regex_query(args.pattern)
    return search.literal_query(args.pattern)


def _ascii_lower(value: str) -> str:
    """SQLite's case folding of identifiers (ASCII only)."""
    return "".join(ch.lower() if ch.isascii() else ch for ch in value)


def _unique_names(columns: Iterable[str]) -> list[str]:
    """Result column names made unique for the row objects: ``a``, ``a:2``, ``a:3``."""
    used: set[str] = set()
    names = []
    for column in columns:
        name, n = column, 1
        while name in used:
            n += 1
            name = f"{column}:{n}"
        used.add(name)
        names.append(name)
    return names


def _text(value: Any) -> Any:
    """A schema name or type as JSON: text that is not UTF-8 as ``{"$hex": ...}``."""
    return value if isinstance(value, str) or value is None else render_value(value)
