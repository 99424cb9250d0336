"""Decisions 132 and 134: on SQLite and on PostgreSQL a stage's Core statements run on the
driver's cursor from their second execution, with the values, rows and errors SQLAlchemy
gives; what needs SQLAlchemy's execution context still goes through it. On PostgreSQL a
direct statement keeps the transaction's pipeline: ``BEGIN`` with the first statement,
deferred writes with the next one (decisions 128 and 130).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import bindparam, event, insert, select
from sqlalchemy.exc import IntegrityError, MultipleResultsFound, NoResultFound

from investigation.store import Store, direct
from investigation.store.engine import core, deferred, is_lost_race, table_of
from investigation.store.models import Artifact, StageRun

_RUN = table_of(StageRun)
_ART = table_of(Artifact)


class _Statements:
    """Statements built once per test, as the engine builds its own once per process (a
    statement's first execution, in any store, is SQLAlchemy's)."""

    def __init__(self) -> None:
        self.marker_insert = deferred(insert(_RUN))
        self.markers = select(_RUN.c.stage, _RUN.c.output_json, _RUN.c.completed_at).where(
            _RUN.c.case_id == bindparam("case_id"), _RUN.c.step_seq == bindparam("step_seq")
        ).order_by(_RUN.c.stage)
        self.art_insert = insert(_ART)
        self.art_row = select(_ART.c.sha256, _ART.c.size_bytes, _ART.c.created_at).where(
            _ART.c.case_id == bindparam("case_id"), _ART.c.path == bindparam("path"))


@pytest.fixture
def q() -> _Statements:
    return _Statements()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    url = f"sqlite:///{tmp_path / 'store.db'}" if request.param == "sqlite" \
        else request.getfixturevalue("postgres_url")
    st = Store(url)
    st.create_schema()
    yield st
    st.dispose()


class _Seen:
    """The statements the engine's ``before_cursor_execute`` listeners are shown, with
    whether SQLAlchemy ran them (an execution context) or the driver did (``None``)."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.calls: list[tuple[str, bool]] = []

    def __call__(self, _conn: Any, _cursor: Any, statement: str, _params: Any,
                 context: Any, _many: bool) -> None:
        self.calls.append((statement.split()[0], context is None))

    def __enter__(self) -> _Seen:
        event.listen(self.engine, "before_cursor_execute", self)
        return self

    def __exit__(self, *_: Any) -> None:
        event.remove(self.engine, "before_cursor_execute", self)


def _marker(stage: str, step_seq: int = 1) -> dict[str, Any]:
    return {"case_id": "c1", "revision": 1, "step_seq": step_seq, "stage": stage,
            "output_json": json.dumps({"stage": stage}),
            "completed_at": datetime(2026, 12, 4, 21, 0, 0, 5, tzinfo=UTC)}


def test_a_statement_runs_on_the_driver_from_its_second_execution_with_sqlalchemys_values(
        store: Store, q: _Statements) -> None:
    with _Seen(store.engine) as seen, store.session() as s:
        conn = core(s)
        assert isinstance(conn, direct.DirectConnection)
        for stage in ("build_context", "llm_call", "validate"):
            conn.execute(q.marker_insert, _marker(stage))
        first = conn.execute(q.markers, {"case_id": "c1", "step_seq": 1}).all()
        second = conn.execute(q.markers, {"case_id": "c1", "step_seq": 1}).all()
    # The marker insert: SQLAlchemy's the first time, then the driver's; so for the read.
    assert seen.calls == [("INSERT", False), ("INSERT", True), ("INSERT", True),
                          ("SELECT", False), ("SELECT", True)]
    with store.engine.connect() as plain:  # SQLAlchemy alone, as the reference
        reference = plain.execute(q.markers, {"case_id": "c1", "step_seq": 1}).all()
    assert [tuple(r) for r in second] == [tuple(r) for r in first] == \
        [tuple(r) for r in reference]
    assert second[0].stage == "build_context" and second[0][0] == "build_context"
    stage, text, completed = second[1]
    assert (stage, text) == ("llm_call", '{"stage": "llm_call"}')
    # The DateTime column is bound and read through SQLAlchemy's processors.
    assert completed == datetime(2026, 12, 4, 21, 0, 0, 5, tzinfo=UTC)


def test_result_methods_raise_what_sqlalchemys_raise(store: Store, q: _Statements) -> None:
    key = {"case_id": "c1", "step_seq": 1}
    with store.session() as s:
        conn = core(s)
        for _ in range(2):  # the second execution is the driver's
            none = conn.execute(q.markers, key)
        assert isinstance(none, direct.Rows)
        assert none.first() is None and none.scalar() is None and none.all() == []
        assert none.one_or_none() is None and none.scalar_one_or_none() is None
        with pytest.raises(NoResultFound):
            none.one()
        with pytest.raises(NoResultFound):
            none.scalar_one()
        conn.execute(q.marker_insert, _marker("a"))
        conn.execute(q.marker_insert, _marker("b"))
        two = conn.execute(q.markers, key)
        assert two.scalars().all() == ["a", "b"] and list(two.scalars()) == ["a", "b"]
        with pytest.raises(MultipleResultsFound):
            two.one()
        with pytest.raises(MultipleResultsFound):
            two.one_or_none()
        assert [row.stage for row in two] == ["a", "b"]
        metadata = sa.MetaData()
        counts = sa.Table("direct_counts", metadata, sa.Column("id", sa.Integer, primary_key=True),
                          sa.Column("n", sa.Integer, nullable=False))
        metadata.create_all(s.connection())
        conn.execute(insert(counts), [{"id": i, "n": 0} for i in range(1, 4)])
        bump = sa.update(counts).where(counts.c.id >= bindparam("low")).values(
            n=counts.c.n + 1)
        assert [conn.execute(bump, {"low": 2}).rowcount for _ in range(2)] == [2, 2]
        assert conn.execute(select(counts.c.n).order_by(counts.c.id)).scalars().all() == \
            [0, 2, 2]


def test_a_unique_violation_is_sqlalchemys_integrity_error_and_changes_nothing(
        store: Store, q: _Statements) -> None:
    with store.session() as s:
        core(s).execute(q.marker_insert, _marker("build_context"))
    with store.session() as s:  # the statement's second execution: the driver's
        core(s).execute(q.marker_insert, _marker("llm_call"))
    with pytest.raises(IntegrityError) as raised, store.session() as s:
        core(s).execute(q.marker_insert, _marker("validate"))
        core(s).execute(q.marker_insert, _marker("build_context"))  # taken: a lost race
    assert is_lost_race(raised.value)
    assert ("UNIQUE constraint failed" if store.engine.dialect.name == "sqlite"
            else "duplicate key value violates unique constraint") in str(raised.value.orig)
    with store.session() as s:
        stages = core(s).execute(q.markers, {"case_id": "c1", "step_seq": 1}).scalars().all()
    assert stages == ["build_context", "llm_call"]  # validate was rolled back with it


def test_statements_that_need_sqlalchemys_execution_context_go_through_it(
        store: Store, q: _Statements) -> None:
    metadata = sa.MetaData()
    made = sa.Table("direct_defaults", metadata,
                    sa.Column("id", sa.Integer, primary_key=True),
                    sa.Column("name", sa.String, nullable=False),
                    sa.Column("made_at", sa.DateTime, nullable=False,
                              default=lambda: datetime.now(UTC).replace(tzinfo=None)))
    metadata.create_all(store.engine)
    add = insert(made)
    named = select(made.c.name).where(made.c.name.in_(bindparam("names", expanding=True)))
    with _Seen(store.engine) as seen, store.session() as s:
        conn = core(s)
        for name in ("a", "b", "c"):
            conn.execute(add, {"name": name})  # made_at: a Python-side default
        for _ in range(2):
            rows = conn.execute(named, {"names": ["a", "c"]}).scalars().all()
        for _ in range(2):  # a statement built per call is compiled by SQLAlchemy's cache
            conn.execute(select(made.c.id).where(made.c.id == 1)).all()
    assert sorted(rows) == ["a", "c"]
    assert not any(on_driver for _, on_driver in seen.calls)
    with store.engine.connect() as plain:
        assert plain.execute(select(sa.func.count()).where(made.c.made_at.is_not(None))
                             ).scalar() == 3


def test_a_list_of_parameters_goes_through_sqlalchemy_and_later_reads_on_the_driver(
        store: Store, q: _Statements) -> None:
    rows = [{"case_id": "c1", "path": f"p{i}", "kind": "k", "sha256": "0" * 64,
             "size_bytes": i, "media_type": "application/json",
             "created_at": datetime(2026, 12, 4, tzinfo=UTC)} for i in range(3)]
    with _Seen(store.engine) as seen, store.session() as s:
        conn = core(s)
        conn.execute(q.art_insert, rows)  # executemany
        got = [conn.execute(q.art_row, {"case_id": "c1", "path": "p2"}).one() for _ in range(2)]
    assert [tuple(g) for g in got] == [("0" * 64, 2, datetime(2026, 12, 4, tzinfo=UTC))] * 2
    assert [on_driver for _, on_driver in seen.calls] == [False, False, True]




# -- what stays on SQLAlchemy, or behaves as SQLAlchemy does (a break-it probe's findings) --


@pytest.fixture
def odd(store: Store) -> sa.Table:
    """A table with a Float, a Numeric, and columns a named tuple cannot name."""
    metadata = sa.MetaData()
    table = sa.Table("direct_odd", metadata, sa.Column("id", sa.Integer, primary_key=True),
                     sa.Column("f", sa.Float), sa.Column("n", sa.Numeric(10, 3)),
                     sa.Column("_x", sa.Integer), sa.Column("class", sa.Integer))
    metadata.create_all(store.engine)
    with store.engine.begin() as conn:
        conn.execute(insert(table), {"f": 1.5, "n": "2.125", "_x": 7, "class": 8})  # id 1
    return table


def test_float_and_numeric_columns_and_unnamed_fields_read_as_sqlalchemy_reads_them(
        store: Store, odd: sa.Table) -> None:
    from decimal import Decimal

    numbers = [select(odd.c.f), select(odd.c.n), select(sa.literal(0.25)),
               select(sa.func.sum(odd.c.n))]
    names = select(odd.c._x, odd.c["class"]).where(odd.c.id == bindparam("id"))
    with store.session() as s:
        conn = core(s)
        read = [[conn.execute(each).scalar_one() for _ in range(3)] for each in numbers]
        rows = [conn.execute(names, {"id": 1}).one() for _ in range(3)]
    assert read == [[1.5] * 3, [Decimal("2.125")] * 3, [0.25] * 3, [Decimal("2.125")] * 3]
    assert [(r._x, getattr(r, "class")) for r in rows] == [(7, 8)] * 3


def test_a_parameter_without_a_value_is_sqlalchemys_statement_error(
        store: Store, odd: sa.Table) -> None:
    from sqlalchemy.exc import StatementError

    change = sa.update(odd).where(odd.c.id == bindparam("id_")).values(
        f=bindparam("f"))
    with store.session() as s:
        assert core(s).execute(change, {"id_": 1, "f": 2.5}).rowcount == 1
        assert core(s).execute(change, {"id_": 1, "f": 3.5}).rowcount == 1  # the driver's
        with pytest.raises(StatementError, match="A value is required for bind parameter"):
            core(s).execute(change, {"f": 4.5})  # no id_: never NULL, never "0 rows"
    with store.engine.connect() as plain:
        assert plain.execute(select(odd.c.f)).scalar() == 3.5


def test_an_insert_that_fetches_its_primary_key_stays_on_sqlalchemy(
        store: Store, odd: sa.Table) -> None:
    """``inserted_primary_key`` (SQLite's ``lastrowid``, PostgreSQL's implicit
    ``RETURNING``) needs SQLAlchemy's result; an ``inline()`` insert runs directly."""
    add, inline = insert(odd), insert(odd).inline()
    with _Seen(store.engine) as seen, store.session() as s:
        keys = [core(s).execute(add, {"f": 0.5}).inserted_primary_key[0] for _ in range(3)]
        for _ in range(2):
            core(s).execute(inline, {"f": 0.75})
    assert keys == [2, 3, 4]
    assert [on_driver for _, on_driver in seen.calls] == [False] * 4 + [True]
    with store.engine.connect() as plain:
        assert plain.execute(select(sa.func.count()).select_from(odd)).scalar() == 6


def test_a_connection_with_execution_options_runs_every_statement_on_sqlalchemy(
        store: Store, q: _Statements) -> None:
    with _Seen(store.engine) as seen, store.session() as s:
        s.connection(execution_options={"schema_translate_map": {None: None}})
        for _ in range(3):
            core(s).execute(q.markers, {"case_id": "c1", "step_seq": 1}).all()
    assert [on_driver for _, on_driver in seen.calls] == [False, False, False]


def test_statements_built_per_call_do_not_pile_up(
        store: Store, odd: sa.Table, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct, "PLANNED_STATEMENTS", 8)
    monkeypatch.setattr(direct, "_plans", {})
    with _Seen(store.engine) as seen, store.session() as s:
        for _ in range(50):
            built = select(odd.c.id).where(odd.c.id == bindparam("id"))
            assert [core(s).execute(built, {"id": 1}).scalar() for _run in range(2)] == [1, 1]
            assert len(direct._plans) <= 8
    assert sum(on_driver for _, on_driver in seen.calls) == 50  # each one's second run


@pytest.mark.postgres
def test_an_interrupt_inside_a_direct_statement_invalidates_its_connection(
        postgres_url: str) -> None:
    """A KeyboardInterrupt (or a worker's SystemExit) while PostgreSQL runs the statement:
    as on SQLAlchemy's path, the connection is invalidated, not handed back to the pool
    inside its transaction."""
    import signal

    st = Store(postgres_url)
    st.create_schema()
    slow = select(sa.func.pg_sleep(bindparam("t")))

    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with st.session() as s:
            core(s).execute(slow, {"t": 0})  # the first execution: SQLAlchemy's
        with pytest.raises(KeyboardInterrupt), st.session() as s:
            plain = s.connection()
            pid = plain.connection.dbapi_connection.info.backend_pid
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            core(s).execute(slow, {"t": 5})
        with st.session() as s:  # a new backend: the interrupted one was discarded
            raw = s.connection().connection.dbapi_connection
            assert raw.info.backend_pid != pid
            assert s.execute(select(sa.literal(1))).scalar() == 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        st.dispose()
