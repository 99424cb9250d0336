"""Read-only access to a packed SQLite database ("defense against the dark arts").

Read-only by construction, in layers:

1. The snapshot bytes are copied into a private in-memory database
   (``sqlite3.connect(":memory:")`` + ``Connection.deserialize``): nothing can reach the
   snapshot, the file system or another database. A WAL-mode header is rewritten to
   rollback mode in the private copy (an in-memory database cannot read WAL mode).
2. ``PRAGMA query_only=1`` and ``PRAGMA trusted_schema=OFF``; extension loading is off
   (this Python's ``sqlite3`` has no ``enable_load_extension``, so it can never be turned
   on); limits are lowered (:data:`SQLITE_LIMITS`, ``SQLITE_LIMIT_ATTACHED=0``).
3. Every model-supplied statement is compiled under an **allow-list** authorizer:
   ``SQLITE_SELECT``, ``SQLITE_READ``, ``SQLITE_RECURSIVE`` and ``SQLITE_FUNCTION`` for
   the pure, deterministic builtins in :data:`ALLOWED_FUNCTIONS`. Everything else
   (INSERT, UPDATE, DELETE, CREATE_*, DROP_*, ATTACH, DETACH, PRAGMA, TRANSACTION,
   SAVEPOINT, ANALYZE, ALTER, REINDEX, load_extension, random, ...) is ``SQLITE_DENY``.
   An allow-list, not a deny-list: a function added by a future SQLite is refused until
   someone reviews it. Table-valued functions (``json_each``, ``pragma_*``) are refused
   too, since SQLite registers them with a schema change the authorizer denies.
4. A progress handler enforces the wall-clock deadline.

Determinism: ``random()``, ``changes()`` etc. are not on the allow-list, and the date and
time functions are replaced by wrappers that refuse ``'now'``, ``'localtime'``, ``'utc'``
and the zero-argument forms, so a statement's rows depend only on the snapshot bytes.
``EXPLAIN QUERY PLAN`` is allowed; a plain ``EXPLAIN`` is refused, since its program's
operands hold the process's heap addresses (a virtual table's ``vtab:55FDCE3658B8``).

Preflight ("prepare, do not step"): :meth:`ReadOnlyDatabase.preflight` compiles the
statement under the same authorizer with a progress handler that interrupts the virtual
machine at its first check, before any row, function call or loop runs, then lists its
compiled program with ``EXPLAIN`` and refuses any program that writes or returns no rows.
Python 3.11's ``sqlite3`` offers no bare ``sqlite3_prepare``; this is the closest
faithful equivalent.
"""

from __future__ import annotations

import contextlib
import math
import sqlite3
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

import re2

from investigation.errors import ToolError
from investigation.tools.isolation import IsolatedServer

T = TypeVar("T")

#: Lowered SQLite limits applied to every snapshot connection.
#: Bytes of row values fetched by one ``db.query`` before it stops with ``TRUNCATED``.
MAX_FETCH_BYTES = 8 << 20

SQLITE_LIMITS: dict[int, int] = {
    sqlite3.SQLITE_LIMIT_LENGTH: 250_000,
    sqlite3.SQLITE_LIMIT_SQL_LENGTH: 100_000,
    sqlite3.SQLITE_LIMIT_COLUMN: 200,
    sqlite3.SQLITE_LIMIT_EXPR_DEPTH: 100,
    sqlite3.SQLITE_LIMIT_COMPOUND_SELECT: 20,
    sqlite3.SQLITE_LIMIT_VDBE_OP: 50_000,
    sqlite3.SQLITE_LIMIT_FUNCTION_ARG: 32,
    sqlite3.SQLITE_LIMIT_ATTACHED: 0,
    sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH: 1_000,
    sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER: 100,
    sqlite3.SQLITE_LIMIT_TRIGGER_DEPTH: 1,
    sqlite3.SQLITE_LIMIT_WORKER_THREADS: 0,
}

#: Date/time functions served by deterministic wrappers (see module docstring).
DATE_FUNCTIONS = ("date", "time", "datetime", "julianday", "strftime", "unixepoch")

#: Pure builtins a query may call (lower case, as the authorizer reports them).
ALLOWED_FUNCTIONS = frozenset({
    # core scalar
    "abs", "char", "coalesce", "glob", "hex", "ifnull", "iif", "instr", "length",
    # (printf/format are left out: one call with a huge width or precision runs for
    # seconds inside a single SQLite instruction, where the progress handler cannot stop it)
    "like", "likelihood", "likely", "lower", "ltrim", "max", "min", "nullif",
    "quote", "replace", "round", "rtrim", "sign", "soundex", "substr", "substring", "trim",
    "typeof", "unicode", "unlikely", "upper", "zeroblob",
    # aggregate and window
    "avg", "count", "group_concat", "sum", "total", "row_number", "rank", "dense_rank",
    "percent_rank", "cume_dist", "ntile", "lag", "lead", "first_value", "last_value",
    "nth_value",
    # json (pure functions on JSON text, not writes)
    "json", "json_array", "json_array_length", "json_extract", "json_insert", "json_object",
    "json_patch", "json_remove", "json_replace", "json_set", "json_type", "json_valid",
    "json_quote", "json_group_array", "json_group_object", "->", "->>",
    # math
    "acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "ceil", "ceiling", "cos",
    "cosh", "degrees", "exp", "floor", "ln", "log", "log10", "log2", "mod", "pi", "pow",
    "power", "radians", "sin", "sinh", "sqrt", "tan", "tanh", "trunc",
    # full-text search over the snapshot's FTS3/4/5 tables (read-only, deterministic)
    "match", "bm25", "highlight", "snippet", "offsets", "matchinfo",
    *DATE_FUNCTIONS,
})
#: The one pragma a query may cause: FTS5 reads ``PRAGMA data_version`` (a counter that
#: never moves on this private, read-only copy) at every query of its tables.
ALLOWED_PRAGMAS = frozenset({"data_version"})

#: The one denial a table-valued function (``json_each``, ``pragma_*``, ``dbstat``)
#: causes: SQLite connects it with a schema change on first use (the snapshot's own
#: virtual tables are connected beforehand, :meth:`ReadOnlyDatabase._connect_virtual_tables`).
_SCHEMA_CHANGE = "SQLITE_UPDATE(sqlite_master)"
#: Table-valued functions SQLite may offer, as a query names them.
_TABLE_VALUED = re2.compile(
    r"(?i)\b(json_each|json_tree|jsonb_each|jsonb_tree|pragma_\w+|dbstat|sqlite_dbpage|"
    r"sqlite_stmt|generate_series|carray)\b")

_ALLOWED_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ,
                              sqlite3.SQLITE_RECURSIVE})
#: SQLite's authorizer action codes ("Authorizer Action Codes"), by name. Their numbers
#: overlap the result codes (18 is both SQLITE_INSERT and SQLITE_TOOBIG), so the names are
#: listed, never collected from every ``SQLITE_*`` integer of the module.
AUTHORIZER_ACTIONS = (
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
_ACTION_NAMES = {getattr(sqlite3, name): name for name in AUTHORIZER_ACTIONS}
assert len(_ACTION_NAMES) == len(AUTHORIZER_ACTIONS), "authorizer action codes collide"


def action_name(action: int) -> str:
    """The name of an authorizer action code (``SQLITE_INSERT`` for 18), as the refusal
    text shows it; an unknown code as ``"action <n>"``."""
    return _ACTION_NAMES.get(action, f"action {action}")


_NONDETERMINISTIC_ARGS = frozenset({"now", "localtime", "utc"})
_PROGRESS_OPS = 1_000
#: VDBE opcodes that write the database or change the schema: the ones that clear
#: ``sqlite3_stmt_readonly`` (Vacuum, JournalMode; write transactions are checked apart)
#: plus every opcode that only a write or schema change emits. ``Insert``/``IdxInsert``
#: are absent on purpose: a SELECT uses them on its private ephemeral tables.
_WRITE_OPCODES = frozenset({
    "OpenWrite", "Vacuum", "IncrVacuum", "JournalMode", "VUpdate", "VCreate", "VDestroy",
    "Destroy", "Clear", "CreateBtree", "ParseSchema", "SqlExec", "DropTable", "DropIndex",
    "DropTrigger", "Expire", "LoadAnalysis", "ResetCount",
})

#: The columns of an ``EXPLAIN QUERY PLAN`` listing (a plain ``EXPLAIN`` has eight).
_QUERY_PLAN_COLUMNS = ("id", "parent", "notused", "detail")


class InvalidText:
    """A TEXT value that is not valid UTF-8 (rendered like a blob, as ``{"$hex": ...}``)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _text_factory(data: bytes) -> str | InvalidText:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return InvalidText(data)


def name_text(value: Any) -> str:
    """A name read from the snapshot's catalogue as text: a name that is not valid UTF-8
    (a hostile snapshot) is spelled with ``\\xNN`` escapes, the same on every run."""
    if isinstance(value, InvalidText):
        return value.data.decode("utf-8", "backslashreplace")
    return str(value)


def _as_sqlite_text(value: Any) -> Any:
    """A date/time function's argument as SQLite's date code reads it: text and blobs as
    NUL-terminated text (a blob's bytes decoded as UTF-8), numbers and NULL unchanged."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str):
        return value.split("\x00", 1)[0]
    return value


def _date_function(fn: str, errors: list[str],
                   clock: sqlite3.Connection) -> Callable[..., Any]:
    """The deterministic wrapper of one date/time function. It holds the database's error
    list and clock connection, never the database: a connection does not show the garbage
    collector its functions, so a wrapper holding the database would keep it (and its
    isolated server) alive forever once dropped without ``close``."""
    min_args = 2 if fn == "strftime" else 1

    def wrapper(*raw: Any) -> Any:
        # SQLite reads a time value or modifier as C text: a blob as its bytes, text up
        # to its first NUL ('now' || char(0) and x'6e6f77' are 'now' to it). Judge, and
        # pass on, what SQLite would read.
        args = tuple(_as_sqlite_text(a) for a in raw)
        bad = [a for a in args if isinstance(a, str)
               and a.strip().lower() in _NONDETERMINISTIC_ARGS]
        if len(args) < min_args or bad:
            message = (f"{fn}() needs an explicit time value; 'now', 'localtime' and "
                       "'utc' are refused so that results are reproducible")
            errors.append(message)
            raise ValueError(message)
        placeholders = ",".join("?" * len(args))
        return clock.execute(f"SELECT {fn}({placeholders})", args).fetchone()[0]

    return wrapper


class _Interrupted(Exception):
    """The progress handler stopped the statement (deadline or preflight)."""


#: Statements whose preflight passed, kept per database (see ``ReadOnlyDatabase.preflight``).
PREFLIGHTS_KEPT = 256
#: The methods a database's isolated server runs (the untrusted work; see ``_bounded``).
BOUNDED_METHODS = ("_preflight", "_query", "_schema")
#: Isolated servers kept running per process, the most recently used databases' (decision
#: 94). A server keeps its own copy of every page its parent rewrites after the fork (up
#: to the parent's size then, tens of MiB in a worker), so a process that opened many
#: snapshots does not keep one server per database: starting a server beyond this stops
#: the least recently used one (its next request forks again).
SERVERS_PER_PROCESS = 2

_serving: OrderedDict[int, weakref.ref[ReadOnlyDatabase]] = OrderedDict()
_serving_lock = threading.Lock()


def _used(db: ReadOnlyDatabase) -> None:
    """Mark ``db``'s running server most recently used; stop the least recently used
    servers beyond :data:`SERVERS_PER_PROCESS` (one whose database is busy in another
    thread is left for a later call)."""
    with _serving_lock:
        _serving[id(db)] = weakref.ref(db)
        _serving.move_to_end(id(db))
        surplus = list(_serving.items())[:-SERVERS_PER_PROCESS]
    for key, ref in surplus:
        other = ref()
        if other is not None:
            if not other._lock.acquire(blocking=False):
                continue
            try:
                other._server.stop()
            finally:
                other._lock.release()
        with _serving_lock:  # stopped, or collected (its finaliser stopped it)
            if _serving.get(key) is ref:
                del _serving[key]


def check_opens(name: str, data: bytes) -> None:
    """Open ``data`` as :class:`ReadOnlyDatabase` does (its schema parsed) and close it.

    Raises:
        ToolError: ``TOOL_SQL_ERROR``, "database NAME cannot be opened: WHY" (not a
            database, a malformed image or schema).
    """
    ReadOnlyDatabase(name, data).close()


class ReadOnlyDatabase:
    """One packed database opened as a private, read-only, in-memory copy.

    Args:
        name: the database name (file name under ``db/``).
        data: the packed SQLite file bytes (never modified; SQLite works on a copy).

    Raises:
        ToolError: ``TOOL_SQL_ERROR`` if the bytes are not a readable SQLite database.

    Untrusted work runs in one isolated server per database and process, forked at the
    first bounded call (:class:`~investigation.tools.isolation.IsolatedServer`);
    :meth:`close`, or the database's collection, stops it.
    """

    def __init__(self, name: str, data: bytes) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._passed: dict[str, None] = {}  # preflights that passed (insertion order)
        self._passed_lock = threading.Lock()
        self._denials: list[str] = []
        self._function_errors: list[str] = []
        self._virtual_connected = False
        if len(data) >= 20 and data[18:20] == b"\x02\x02":
            data = data[:18] + b"\x01\x01" + data[20:]
        conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        try:
            conn.deserialize(data)
            conn.execute("PRAGMA query_only=1")
            conn.execute("PRAGMA trusted_schema=OFF")
            for limit, value in SQLITE_LIMITS.items():
                conn.setlimit(limit, value)
            conn.text_factory = _text_factory
            self._clock = sqlite3.connect(":memory:", isolation_level=None,
                                          check_same_thread=False)
            for fn in DATE_FUNCTIONS:
                conn.create_function(fn, -1, _date_function(fn, self._function_errors,
                                                            self._clock),
                                     deterministic=True)
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except (sqlite3.Error, UnicodeDecodeError) as exc:
            # SQLite's message can quote the snapshot's own bytes (a malformed schema):
            # Python fails to decode it; the database is as unreadable either way.
            conn.close()
            why = "its schema is malformed and not UTF-8" \
                if isinstance(exc, UnicodeDecodeError) else str(exc)
            raise ToolError("TOOL_SQL_ERROR", f"database {name!r} cannot be opened: {why}",
                            database=name) from exc
        self._conn = conn
        self._server = IsolatedServer(BOUNDED_METHODS, probe="_probe")
        weakref.finalize(self, self._server.stop)  # a database dropped without close()

    def close(self) -> None:
        """Stop the isolated server and close the private connections."""
        with self._lock:
            self._server.stop()
            self._conn.close()
            self._clock.close()

    # -- trusted metadata (our own fixed SQL; no authorizer needed, still query_only) --

    def objects(self) -> list[tuple[str, str]]:
        """``(name, type)`` of every table and view, sorted by name."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT name, type FROM sqlite_master WHERE type IN ('table', 'view') "
                "ORDER BY name").fetchall()
        return [(name_text(name), name_text(kind)) for name, kind in rows]

    def schema(self, table: str, timeout_s: float = 3.0, memory_bytes: int = 256 << 20,
               isolate: bool = True) -> dict[str, Any]:
        """Columns, DDL, indexes and triggers of one table or view (exact name).

        Returns:
            ``{"columns": [(cid, name, type, notnull, default, pk)], "ddl": str | None,
            "indexes": [(name, unique, origin, columns, ddl)], "triggers": [(name, ddl)]}``.
        """
        # A table's columns come from compiling it: a view of the snapshot can be as
        # costly to compile as any query, so this runs bounded too.
        return self._bounded(self._schema, (table,), timeout_s, memory_bytes, isolate)

    def _schema(self, table: str) -> dict[str, Any]:
        try:
            return self._schema_rows(table)
        except sqlite3.Error as exc:
            raise ToolError("TOOL_SQL_ERROR",
                            f"the schema of {table!r} cannot be read: {exc}",
                            database=self.name) from exc

    def _schema_rows(self, table: str) -> dict[str, Any]:
        # The caller holds self._lock (in process, or across the server's request).
        conn = self._conn
        columns = conn.execute(
            'SELECT cid, name, type, "notnull", dflt_value, pk '
            "FROM pragma_table_info(?) ORDER BY cid", (table,)).fetchall()
        ddl_row = conn.execute(
            "SELECT sql FROM sqlite_master WHERE name = ? AND type IN ('table', 'view')",
            (table,)).fetchone()
        indexes = []
        for name, unique, origin in conn.execute(
                'SELECT name, "unique", origin FROM pragma_index_list(?) ORDER BY name',
                (table,)).fetchall():
            cols = [row[0] for row in conn.execute(
                "SELECT name FROM pragma_index_info(?) ORDER BY seqno", (name,))]
            idx_ddl = conn.execute(
                "SELECT sql FROM sqlite_master WHERE type = 'index' AND name = ?",
                (name,)).fetchone()
            indexes.append((name, bool(unique), origin, cols,
                            idx_ddl[0] if idx_ddl else None))
        triggers = conn.execute(
            "SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = ? "
            "ORDER BY name", (table,)).fetchall()
        return {"columns": columns, "ddl": ddl_row[0] if ddl_row else None,
                "indexes": indexes, "triggers": triggers}

    # -- untrusted statements ------------------------------------------------------

    def _authorize(self, action: int, arg1: str | None, arg2: str | None,
                   _db: str | None, _trigger: str | None) -> int:
        if action in _ALLOWED_ACTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in ALLOWED_FUNCTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA and (arg1 or "").lower() in ALLOWED_PRAGMAS \
                and arg2 is None:
            return sqlite3.SQLITE_OK
        what = action_name(action)
        target = arg2 if action == sqlite3.SQLITE_FUNCTION else arg1
        self._denials.append(f"{what}({target})" if target else what)
        return sqlite3.SQLITE_DENY

    @contextlib.contextmanager
    def _guarded(self, progress: Callable[[], int], every_ops: int) -> Iterator[None]:
        # Runs in the isolated server (or in process with ``isolate=False``), with
        # ``self._lock`` held by the caller. A server answers many requests: this resets
        # the per-request state (denials, function errors) at each one's start, and the
        # authorizer and progress handler are removed at its end.
        self._denials.clear()
        self._function_errors.clear()
        self._connect_virtual_tables()
        self._conn.set_authorizer(self._authorize)
        self._conn.set_progress_handler(progress, every_ops)
        try:
            yield
        finally:
            self._conn.set_progress_handler(None, 0)
            self._conn.set_authorizer(None)

    def _connect_virtual_tables(self) -> None:
        """Connect the snapshot's virtual tables (FTS3/4/5, R*Tree, ...) once per process,
        before any authorizer is installed.

        SQLite connects a virtual table at its first use: it changes the schema and
        prepares the module's own statements (an R*Tree's writes to its shadow tables),
        which the allow-list authorizer denies (``SQLITE_UPDATE(sqlite_master)``), so a
        query of the snapshot's own full-text index was refused as a write. Connected here
        by our own fixed SQL, a query of such a table needs only reads, functions of
        :data:`ALLOWED_FUNCTIONS` and :data:`ALLOWED_PRAGMAS`; ``query_only`` still refuses
        any write. A table whose module this SQLite lacks, or whose data is corrupt, stays
        unconnected: its query fails with SQLite's own error. Table-valued functions
        (``json_each``, ``pragma_*``) are not tables of the snapshot and stay refused.
        Runs in the isolated server (the first bounded request) like any untrusted work.
        """
        if self._virtual_connected:
            return
        self._virtual_connected = True
        names = [name_text(name) for (name,) in self._conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND rootpage = 0 "
            "AND sql IS NOT NULL")]
        for name in names:
            quoted = '"' + name.replace('"', '""') + '"'
            with contextlib.suppress(sqlite3.Error, UnicodeDecodeError):
                self._conn.execute(f"SELECT 1 FROM {quoted} LIMIT 0").fetchall()

    def _probe(self) -> None:
        """A trivial statement: allocates, prepares and steps like any query."""
        self._conn.execute("SELECT count(*) FROM sqlite_master").fetchone()

    def _bounded(self, method: Callable[..., T], args: tuple[Any, ...], timeout_s: float,
                 memory_bytes: int, isolate: bool) -> T:
        """Run untrusted work on this database, ``method(*args)`` for one of
        :data:`BOUNDED_METHODS`: in this database's isolated server under hard CPU,
        memory and wall-clock limits (see :mod:`investigation.tools.isolation`), holding
        the database lock across the request. The server is sent the method's name and
        the arguments, never a callable."""
        with self._lock:
            if not isolate:
                return method(*args)
            try:
                return cast(T, self._server.call(self, method.__name__, args,
                                                 timeout_s=timeout_s,
                                                 memory_bytes=memory_bytes))
            finally:
                if self._server.pid is not None:
                    _used(self)

    def _translate(self, exc: sqlite3.Error, sql: str = "") -> ToolError:
        if self._denials:
            denied = ", ".join(sorted(set(self._denials)))
            table_valued = sorted({m.lower() for m in _TABLE_VALUED.findall(sql)})
            if set(self._denials) == {_SCHEMA_CHANGE} and table_valued:
                # SQLite connects an eponymous virtual table (json_each, pragma_*) on
                # first use by changing the schema: the only denial is that change.
                return ToolError(
                    "TOOL_SQL_NOT_READ_ONLY",
                    f"table-valued functions are not allowed ({', '.join(table_valued)}); "
                    f"use one SELECT over the snapshot's tables (json_extract and the "
                    f"other json_* scalar functions are allowed)", database=self.name,
                    denied=sorted(set(self._denials)), table_valued=table_valued)
            return ToolError("TOOL_SQL_NOT_READ_ONLY",
                             f"not a read-only query (allowed: one SELECT using pure builtin "
                             f"functions); denied: {denied}",
                             database=self.name, denied=sorted(set(self._denials)))
        message = str(exc)
        if isinstance(exc, sqlite3.ProgrammingError) and "one statement" in message:
            return ToolError("TOOL_SQL_MULTIPLE_STATEMENTS",
                             "exactly one SQL statement is allowed; remove the others",
                             database=self.name)
        if self._function_errors:
            message = self._function_errors[-1]
        return ToolError("TOOL_SQL_ERROR", f"SQLite refused the statement: {message}",
                         database=self.name)

    def preflight(self, sql: str, params: Sequence[Any], timeout_s: float = 3.0,
                  memory_bytes: int = 256 << 20, isolate: bool = True) -> None:
        """Compile ``sql`` under the authorizer and inspect its program; never run it.

        Two compilations, both under the authorizer:

        1. the statement itself, with its parameters bound, interrupted by the progress
           handler at the virtual machine's first check: denied actions, syntax errors,
           unknown names, parameter counts and extra statements surface here;
        2. ``EXPLAIN <sql>``, whose rows are the compiled program (listing it runs
           nothing). The program must return rows (``ResultRow``) and hold no opcode
           that writes or changes the schema (:data:`_WRITE_OPCODES`, a write
           transaction) -- the test ``sqlite3_stmt_readonly`` makes. This catches
           statements whose only authorizer check happens when they run (``VACUUM``).

        A statement that is itself an ``EXPLAIN`` is a listing: it is never interrupted
        in step 1 and needs no step 2.

        Compilation cannot be interrupted from inside the process, so both run in an
        isolated server bounded by ``timeout_s`` and ``memory_bytes``.

        Raises:
            ToolError: ``TOOL_SQL_NOT_READ_ONLY`` (a denied action, or a program that
                writes or returns no rows), ``TOOL_SQL_MULTIPLE_STATEMENTS``,
                ``TOOL_SQL_ERROR`` (syntax, unknown table, wrong parameter count),
                ``TOOL_INVALID_ARGUMENTS`` for text without a statement (only comments),
                ``TOOL_SQL_TIMEOUT`` / ``TOOL_RESOURCE_LIMIT`` past the hard bounds.
        """
        # Compiling a statement on this immutable copy gives the same verdict every time:
        # one that passed (validation, then again before it runs) is not compiled again.
        key = repr((sql, tuple(params), timeout_s, memory_bytes, isolate))
        if key in self._passed:
            return
        self._bounded(self._preflight, (sql, list(params)), timeout_s, memory_bytes,
                      isolate)
        with self._passed_lock:
            self._passed[key] = None
            while len(self._passed) > PREFLIGHTS_KEPT:
                del self._passed[next(iter(self._passed))]

    def _preflight(self, sql: str, params: Sequence[Any]) -> None:
        stopped = [False]

        def stop_at_once() -> int:
            stopped[0] = True
            return 1

        with self._guarded(stop_at_once, 1):
            cursor = self._conn.cursor()
            try:
                cursor.execute(sql, list(params))
                if cursor.description is None:
                    raise ToolError("TOOL_INVALID_ARGUMENTS", "sql holds no statement",
                                    argument="sql")
                # An EXPLAIN listing: it ran to its first row, nothing else. Only the
                # query plan's: the program's operands hold this process's heap
                # addresses (``vtab:55FDCE3658B8``), which would reach the evidence.
                if len(cursor.description) != len(_QUERY_PLAN_COLUMNS):
                    raise ToolError(
                        "TOOL_INVALID_ARGUMENTS", "EXPLAIN lists the compiled program, "
                        "whose operands hold this process's memory addresses; use EXPLAIN "
                        "QUERY PLAN", argument="sql")
                return
            except sqlite3.OperationalError as exc:
                if not stopped[0] or self._denials:
                    raise self._translate(exc, sql) from exc
            except sqlite3.Error as exc:
                raise self._translate(exc, sql) from exc
            finally:
                cursor.close()
            try:
                program = self._conn.execute("EXPLAIN " + sql, list(params)).fetchall()
            except sqlite3.Error as exc:
                raise self._translate(exc, sql) from exc
        opcodes = {str(row[1]) for row in program}
        writes = sorted(opcodes & _WRITE_OPCODES)
        if any(row[1] == "Transaction" and row[3] for row in program):
            writes.append("Transaction(write)")
        if writes or "ResultRow" not in opcodes:
            reason = f"its program writes ({', '.join(writes)})" if writes else \
                "it returns no rows"
            raise ToolError("TOOL_SQL_NOT_READ_ONLY",
                            f"not a read-only query: {reason}; use one SELECT",
                            database=self.name)

    def query(self, sql: str, params: Sequence[Any], max_rows: int, timeout_s: float,
              memory_bytes: int = 256 << 20,
              isolate: bool = True) -> tuple[list[str], list[tuple[Any, ...]], bool, bool]:
        """Run one statement under the authorizer and a wall-clock deadline.

        Args:
            sql: one read-only statement.
            params: values for its ``?`` placeholders.
            max_rows: rows to keep; one more is fetched to detect truncation.
            timeout_s: deadline in seconds (checked every 1,000 VM instructions).

        Returns:
            ``(columns, rows, truncated, deadline_hit)``; ``rows`` holds at most
            ``max_rows`` tuples in the statement's own order. On a deadline hit the rows
            are a prefix of the full result; Python's ``sqlite3`` discards the row fetched
            together with the interrupted step, so the prefix is one row shorter than
            what SQLite had produced.

        The statement runs in the isolated server (see :meth:`preflight`); it keeps
        the deadline itself, and the parent kills it one second past it.

        Raises:
            ToolError: the codes of :meth:`preflight`, and ``TOOL_SQL_TIMEOUT`` when the
                deadline passes before the first row.
        """
        return self._bounded(self._query, (sql, list(params), max_rows, timeout_s),
                             timeout_s + 1.0, memory_bytes, isolate)

    def _query(self, sql: str, params: Sequence[Any], max_rows: int,
               timeout_s: float) -> tuple[list[str], list[tuple[Any, ...]], bool, bool]:
        deadline = time.monotonic() + timeout_s
        hit = [False]

        def check_deadline() -> int:
            if time.monotonic() >= deadline:
                hit[0] = True
                return 1
            return 0

        columns: list[str] = []
        rows: list[tuple[Any, ...]] = []
        truncated = False
        with self._guarded(check_deadline, _PROGRESS_OPS):
            cursor = self._conn.cursor()
            try:
                cursor.execute(sql, list(params))
                if cursor.description is None:
                    raise ToolError("TOOL_INVALID_ARGUMENTS", "sql holds no statement",
                                    argument="sql")
                columns = [d[0] for d in cursor.description]
                fetched_bytes = 0
                while True:
                    row = cursor.fetchone()
                    if row is None:
                        break
                    fetched_bytes += sum(
                        len(v) if isinstance(v, str | bytes) else 8 for v in row)
                    if len(rows) >= max_rows or fetched_bytes > MAX_FETCH_BYTES:
                        truncated = True
                        break
                    if time.monotonic() >= deadline:
                        hit[0] = True
                        break
                    rows.append(tuple(row))
            except sqlite3.OperationalError as exc:
                if not hit[0] or self._denials:
                    raise self._translate(exc, sql) from exc
                if not rows:
                    raise ToolError(
                        "TOOL_SQL_TIMEOUT",
                        f"the statement produced no row within {timeout_s:g} s; "
                        "narrow it (WHERE, LIMIT, fewer joins)",
                        database=self.name, timeout_s=timeout_s) from exc
            except sqlite3.Error as exc:
                raise self._translate(exc, sql) from exc
            finally:
                cursor.close()
        return columns, rows, truncated, hit[0]


def render_value(value: Any) -> Any:
    """JSON form of one SQLite value: blobs and invalid text as ``{"$hex": ...}``,
    infinities as ``{"$float": "Infinity" | "-Infinity"}``; others unchanged."""
    if isinstance(value, bytes | bytearray | memoryview):
        return {"$hex": bytes(value).hex()}
    if isinstance(value, InvalidText):
        return {"$hex": value.data.hex()}
    if isinstance(value, float) and not math.isfinite(value):
        return {"$float": "Infinity" if value > 0 else "-Infinity"}
    return value
