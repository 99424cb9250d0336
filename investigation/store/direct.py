"""Core statements run on the driver's cursor, past SQLAlchemy's execution machinery
(decisions 132 and 134).

A stage's Core statements (stage markers, artifacts, blobs, checkpoints, evidence
lookups) are built once, at import, and run many times. On the 2-core machine,
SQLAlchemy's execution of such a cached statement costs about 60 us of Python (the
compiled-cache lookup, an execution context, parameter and result processing, event
dispatch), where sqlite3 itself takes 5-8 us and psycopg about 40 us with its round
trip; over the 76 statements of a step that was the larger part of a step's own work.
:class:`DirectConnection` keeps SQLAlchemy's compiler: a statement is compiled once per
dialect and set of parameter names, its SQL, parameters and the type processors
SQLAlchemy would apply are kept, and later executions bind the parameters through those
processors, run the SQL on the transaction's own DBAPI connection and return
:class:`Rows`.

What does not change: the transaction (the statement runs inside the one SQLAlchemy
opened: SQLite's ``BEGIN IMMEDIATE``; on PostgreSQL the ``BEGIN`` that goes out with the
transaction's first statement and the deferred writes that wait for the next one, through
the runner the store's engine registers with :func:`register_runner`, decisions 128 and
130), the values bound and read (the same processors), the errors (a driver error is
handled by the connection as SQLAlchemy handles it: raised as its ``DBAPIError``
subclass, ``IntegrityError`` and ``OperationalError`` among them, so lost races and
store outages are told apart as before, and a lost PostgreSQL connection is invalidated)
and the statements a ``before_cursor_execute`` listener sees (it is called, with
``context=None``, when the engine has one).

A statement goes through SQLAlchemy as before when: the store is neither SQLite nor
PostgreSQL through psycopg with its runner; it is run for the first time (a statement
built per call is never compiled twice); it is not a compiled Core SELECT, INSERT,
UPDATE or DELETE (ORM statements, text); it needs the execution context (Python-side
column defaults, expanding or literal-execute parameters, ``return_defaults``, escaped
parameter names, an INSERT whose primary key SQLAlchemy fetches: neither ``inline()``
nor with ``RETURNING``); a result column is a Float or Numeric (its processor depends
on the type the driver reports) or has a name a named tuple cannot carry (a leading
underscore, a keyword, a duplicate); it or its connection has execution options other
than ``deferred`` (``schema_translate_map``, say); or its parameters are a list
(``executemany``). A parameter without a value raises SQLAlchemy's ``StatementError``,
as SQLAlchemy does. A statement marked ``deferred`` runs directly: on SQLite at once,
on PostgreSQL it waits for the transaction's next statement as before.
"""

from __future__ import annotations

import keyword
import threading
import weakref
from collections import namedtuple
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple, cast

from sqlalchemy import inspect
from sqlalchemy.engine import Connection
from sqlalchemy.exc import InvalidRequestError, MultipleResultsFound, NoResultFound
from sqlalchemy.orm import Mapper, Session, configure_mappers, make_transient_to_detached
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.orm.util import AliasedInsp
from sqlalchemy.sql import sqltypes
from sqlalchemy.sql.dml import Insert, UpdateBase
from sqlalchemy.sql.selectable import Select

#: Execution option of a write whose result nobody reads (``store.engine.DEFERRED``,
#: ``store.engine.deferred``): on PostgreSQL it waits for the transaction's next
#: statement (decision 130); on SQLite it changes nothing.
DEFERRED = "investigation_deferred"
#: Execution options a statement may carry and still run directly.
DIRECT_OPTIONS = frozenset({DEFERRED})

#: ``runner(cursor, sql, parameters, connection, deferred) -> bool``: sends a statement
#: through a store's transaction pipeline (PostgreSQL: ``store.engine``'s
#: ``_pipelined_transactions``); ``False`` when the caller is to execute it alone.
Runner = Callable[[Any, str, Any, Connection, bool], bool]
#: The runner of each PostgreSQL engine (registered by the store that built it).
_runners: weakref.WeakKeyDictionary[Any, Runner] = weakref.WeakKeyDictionary()


def register_runner(engine: Any, runner: Runner) -> None:
    """Make ``engine``'s direct statements go through ``runner`` (PostgreSQL: its
    ``BEGIN`` and deferred writes, decisions 128 and 130); an engine without one runs
    every statement on SQLAlchemy, but SQLite's."""
    _runners[engine] = runner


class _Plan(NamedTuple):
    """A statement compiled for one set of parameter names, ready to run on the driver."""

    compiled: Any  # SQLCompiler
    sql: str
    binds: tuple[tuple[str, Callable[[Any], Any] | None], ...]
    named: bool  # parameters as a mapping (PostgreSQL's pyformat), else a sequence
    results: tuple[Callable[[Any], Any] | None, ...] | None  # None: no processing
    row: Any  # a namedtuple class, or None for a statement without result columns
    deferred: bool  # marked ``deferred``: a write whose result nobody reads


#: ``_plans[statement][(dialect, parameter names)]``: a plan, or ``None`` (SQLAlchemy
#: runs it), for at most :data:`PLANNED_STATEMENTS` statements. A plan holds its compiled
#: form, which holds the statement, so the map holds its statements strongly; the engine's
#: are module constants, and one built per call and run twice is dropped when the map is
#: full (the oldest quarter goes, in the order planned).
_plans: dict[Any, dict[tuple[str, tuple[str, ...]], _Plan | None]] = {}
PLANNED_STATEMENTS = 1024
_planning = threading.Lock()
#: Statements run once through SQLAlchemy (a plan is made at their second execution).
_seen: weakref.WeakSet[Any] = weakref.WeakSet()


class ScalarRows:
    """The first column of :class:`Rows` (``Result.scalars()``'s subset)."""

    __slots__ = ("_values",)

    def __init__(self, values: list[Any]) -> None:
        self._values = values

    def all(self) -> list[Any]:
        return self._values

    def first(self) -> Any:
        return self._values[0] if self._values else None

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)


class Rows:
    """What a direct statement returned: its rows (named tuples: by position, by column
    name, unpacked) and ``rowcount``. The subset of SQLAlchemy's ``CursorResult`` the
    engine uses, with the same errors (``NoResultFound``, ``MultipleResultsFound``)."""

    __slots__ = ("_rows", "rowcount")

    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    def all(self) -> list[Any]:
        return self._rows

    def fetchall(self) -> list[Any]:
        return self._rows

    def first(self) -> Any:
        return self._rows[0] if self._rows else None

    def one(self) -> Any:
        if len(self._rows) != 1:
            raise (NoResultFound("No row was found when one was required") if not self._rows
                   else MultipleResultsFound("Multiple rows were found when exactly one "
                                             "was required"))
        return self._rows[0]

    def one_or_none(self) -> Any:
        if len(self._rows) > 1:
            raise MultipleResultsFound("Multiple rows were found when one or none was "
                                       "required")
        return self._rows[0] if self._rows else None

    def scalar(self) -> Any:
        return self._rows[0][0] if self._rows else None

    def scalar_one(self) -> Any:
        return self.one()[0]

    def scalar_one_or_none(self) -> Any:
        row = self.one_or_none()
        return None if row is None else row[0]

    def scalars(self) -> ScalarRows:
        return ScalarRows([row[0] for row in self._rows])

    def __iter__(self) -> Iterator[Any]:
        return iter(self._rows)


def _columns_only(statement: Any) -> bool:
    """Whether an ORM-enabled statement is a SELECT of columns only: built from mapped
    attributes (``col(Model.field)``), no mapped class or alias among what it selects. Its
    SQL and rows are a Core SELECT's; one that loads ORM objects is SQLAlchemy's."""
    if not isinstance(statement, Select):
        return False
    for description in statement.column_descriptions:
        if isinstance(inspect(description["expr"], raiseerr=False), Mapper | AliasedInsp):
            return False
    return True


def _make_plan(conn: Connection, statement: Any, names: tuple[str, ...]) -> _Plan | None:
    """Compile ``statement`` for ``conn``'s dialect with ``names`` as its parameters, or
    ``None`` when it needs SQLAlchemy's execution context (see the module docstring)."""
    if not isinstance(statement, Select | UpdateBase) \
            or not DIRECT_OPTIONS.issuperset(statement.get_execution_options()) \
            or (statement._propagate_attrs.get("compile_state_plugin") == "orm"
                and not _columns_only(statement)):
        return None
    if isinstance(statement, UpdateBase) and statement._return_defaults:
        return None
    if isinstance(statement, Insert) and not statement._inline and not statement._returning:
        return None  # SQLAlchemy fetches its primary key (``inserted_primary_key``)
    compiled: Any = statement.compile(dialect=conn.dialect, column_keys=list(names))
    if compiled.insert_prefetch or compiled.update_prefetch \
            or compiled.literal_execute_params or compiled.post_compile_params \
            or compiled.escaped_bind_names or compiled.implicit_returning \
            or any(bind.expanding for bind in compiled.binds.values()):
        return None
    processors = compiled._bind_processors
    if compiled.positiontup is not None:
        order, named = compiled.positiontup, False
    elif conn.dialect.paramstyle == "pyformat":
        order, named = tuple(compiled.bind_names.values()), True
    else:
        return None
    binds = tuple((name, processors.get(name)) for name in order)
    columns = compiled._result_columns or []
    fields = [column.keyname for column in columns]
    if any(isinstance(column.type, (sqltypes.Numeric, sqltypes.Float)) for column in columns) \
            or len(set(fields)) != len(fields) \
            or any(not f.isidentifier() or f.startswith("_") or keyword.iskeyword(f)
                   for f in fields):
        # A Float or Numeric column's result processor depends on the type the driver
        # reports; a field a named tuple cannot carry under its own name would be
        # renamed (SQLAlchemy's Row keeps it).
        return None
    deferred = bool(statement.get_execution_options().get(DEFERRED))
    if deferred and columns:
        return None  # a deferred write has no result to read (``store.engine.deferred``)
    results = tuple(column.type._cached_result_processor(conn.dialect, None)
                    for column in columns)
    row = namedtuple("Row", fields) if columns else None
    return _Plan(compiled, compiled.string, binds, named,
                 results if any(f is not None for f in results) else None, row, deferred)


def _plan(conn: Connection, statement: Any, parameters: Mapping[str, Any]) -> _Plan | None:
    key = (conn.dialect.name, tuple(sorted(parameters)))
    try:
        by_names = _plans.get(statement)
        if by_names is None and statement not in _seen:
            _seen.add(statement)  # the first execution: SQLAlchemy's
            return None
    except TypeError:  # neither hashable nor weak-referenceable: SQLAlchemy runs it
        return None
    if by_names is not None and key in by_names:
        return by_names[key]
    plan = _make_plan(conn, statement, key[1])
    with _planning:
        if statement not in _plans and len(_plans) >= PLANNED_STATEMENTS:
            for old in list(_plans)[:PLANNED_STATEMENTS // 4]:
                del _plans[old]
        _plans.setdefault(statement, {})[key] = plan
    return plan


class DirectConnection:
    """``conn`` (a SQLite or PostgreSQL connection inside its transaction) whose
    :meth:`execute` runs a Core statement on the driver's cursor; every other attribute
    is ``conn``'s.

    Args:
        conn: the SQLAlchemy connection of a session's open transaction.
        runner: PostgreSQL: the engine's transaction pipeline (:func:`register_runner`);
            ``None`` on SQLite.
    """

    __slots__ = ("connection_", "runner")

    def __init__(self, conn: Connection, runner: Runner | None = None) -> None:
        self.connection_ = conn
        self.runner = runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.connection_, name)

    def execute(self, statement: Any, parameters: Mapping[str, Any] | None = None, *,
                execution_options: Mapping[str, Any] | None = None) -> Any:
        """Run ``statement`` with ``parameters``; the result is :class:`Rows` on the
        direct path, SQLAlchemy's ``CursorResult`` otherwise (the same subset of calls
        works on both). A deferred write that waits for the next statement (PostgreSQL)
        returns no rows and a ``rowcount`` of -1.

        Raises:
            sqlalchemy.exc.DBAPIError: the driver's error, as SQLAlchemy raises it
                (``IntegrityError``, ``OperationalError``, ...).
            investigation.errors.StoreError: ``STORE_TRANSACTION_NOT_OPEN`` (PostgreSQL:
                the server holds no transaction where SQLAlchemy believes one open).
        """
        conn = self.connection_
        params = parameters if parameters is not None else {}
        plan = None
        if execution_options is None and isinstance(params, Mapping) \
                and conn.in_transaction() and not conn.get_execution_options():
            plan = _plan(conn, statement, params)
        if plan is None:
            return conn.execute(statement, parameters, execution_options=execution_options)
        try:
            values = plan.compiled.construct_params(params)
        except InvalidRequestError as exc:  # a parameter without a value, as SQLAlchemy
            conn._handle_dbapi_exception(exc, plan.sql, params, None, None)
        args: Any
        if plan.named:
            args = {name: values[name] if process is None else process(values[name])
                    for name, process in plan.binds}
        else:
            args = [values[name] if process is None else process(values[name])
                    for name, process in plan.binds]
        raw = conn.connection.dbapi_connection
        assert raw is not None
        listeners = conn.engine.dispatch.before_cursor_execute
        cursor = raw.cursor()
        try:
            for listener in listeners:  # statement counters (tests, benchmarks)
                listener(conn, cursor, plan.sql, args, None, False)
            runner = self.runner
            if runner is None or not runner(cursor, plan.sql, args, conn, plan.deferred):
                cursor.execute(plan.sql, args)
            # The plan knows whether the statement returns rows (asking the cursor for its
            # description builds psycopg's column objects at every statement).
            rows: list[Any] = cast(list[Any], cursor.fetchall()) \
                if plan.row is not None else []
            count = cursor.rowcount
        except BaseException as exc:
            if not isinstance(exc, conn.dialect.loaded_dbapi.Error) \
                    and isinstance(exc, Exception):
                raise  # the engine's own (STORE_TRANSACTION_NOT_OPEN), as it is
            # As SQLAlchemy handles an error of its own execution: wrapped in its
            # DBAPIError subclass, a lost connection invalidated; an interrupt
            # (KeyboardInterrupt, a worker's SystemExit) invalidates the connection too.
            conn._handle_dbapi_exception(exc, plan.sql, args, cursor, None)
        finally:
            cursor.close()
        if plan.results is not None:
            rows = [tuple(value if f is None else f(value)
                          for f, value in zip(plan.results, row, strict=True))
                    for row in rows]
        if plan.row is not None and rows:
            make = plan.row._make
            rows = [make(row) for row in rows]
        return Rows(rows, count)


#: ``Session.info`` key of the session's :class:`DirectConnection`.
_DIRECT = "investigation_direct_connection"


def session_connection(session: Session) -> Connection:
    """The connection of ``session``'s transaction (begun if it was not); a
    :class:`DirectConnection` over it, typed as the connection it stands for, on SQLite
    and on PostgreSQL through psycopg with the engine's runner registered."""
    conn = session.connection()
    held = session.info.get(_DIRECT)
    if held is not None and held.connection_ is conn:
        return cast(Connection, held)
    dialect = conn.dialect
    if dialect.name == "sqlite":
        runner = None
    elif dialect.name == "postgresql" and dialect.driver == "psycopg":
        runner = _runners.get(conn.engine)
        if runner is None:
            return conn
    else:
        return conn
    held = session.info[_DIRECT] = DirectConnection(conn, runner)
    return cast(Connection, held)


class LoadedRows(NamedTuple):
    """How rows of one table, read on the driver's cursor, become ORM objects
    (:func:`loaded`): the statement selects ``columns`` first, in this order."""

    mapper: Mapper[Any]
    names: tuple[str, ...]  # the mapped attribute of each leading column
    key_positions: tuple[int, ...]  # where the primary key's columns are among them


def loaded_rows(model: Any) -> tuple[LoadedRows, tuple[Any, ...]]:
    """What :func:`loaded` needs for ``model``'s table, and the table's columns to select
    (first, in this order; a statement may select more after them)."""
    mapper = cast(Mapper[Any], inspect(model))
    columns = tuple(mapper.local_table.c)
    names = tuple(mapper.get_property_by_column(c).key for c in columns)
    keys = tuple(columns.index(c) for c in mapper.primary_key)
    return LoadedRows(mapper, names, keys), columns


def loaded(session: Session, shape: LoadedRows, rows: Iterable[Any], *,
           refresh: bool = False) -> list[Any]:
    """The ORM objects of ``rows`` (every column of a table, as :func:`loaded_rows`
    selects them, run on the driver's cursor), taken into ``session`` as an ORM query
    would have loaded them, without its cost (about 60 us of SQLAlchemy per query on
    SQLite, 300 us on PostgreSQL; decision 139).

    An object the session holds for the row already is returned with its changes kept
    and its expired attributes filled in from the row, or, with ``refresh``, with the
    row's values as its loaded ones (``populate_existing``); a new
    one is persistent with no history: loading writes nothing, and what the caller
    changes is flushed as an ``UPDATE`` of those columns, as for a queried object.
    Nothing is flushed before: a caller that relied on a query's autoflush flushes.
    """
    mapper, names, key_positions = shape
    if not mapper.configured:  # a new process whose first ORM use this is
        configure_mappers()
    identity_map = session.identity_map
    objects: list[Any] = []
    for row in rows:
        key = mapper.identity_key_from_primary_key(tuple(row[i] for i in key_positions))
        obj = identity_map.get(key)
        if obj is None:
            obj = mapper.class_manager.new_instance()
            obj.__dict__.update(zip(names, row, strict=False))
            make_transient_to_detached(obj)
            session.add(obj)
        else:
            # As a query: the row's values replace the loaded ones with ``refresh``, and
            # fill in what was expired (a commit's expiry, ``Session.expire``) in any case.
            if refresh:  # its changes dropped and its modified flag reset, as a load does
                session.expire(obj)
            unloaded = inspect(obj).unloaded
            if unloaded:
                for name, value in zip(names, row, strict=False):
                    if name in unloaded:
                        set_committed_value(obj, name, value)
        objects.append(obj)
    return objects
