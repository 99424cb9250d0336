"""Decision 139: the case row and the budget accounts a stage changes are read on the
driver's cursor and taken into the session as ORM objects (``direct.loaded``), with what
an ORM query would have given: the same values, the session's own object where it holds
one, no write for loading, an ``UPDATE`` of what the caller changed, and ``refresh`` as
``populate_existing``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, inspect
from sqlalchemy.exc import NoResultFound
from sqlmodel import Session, select

from investigation.errors import InvestigationError
from investigation.loop.outcome import StepKey
from investigation.loop.stagebase import StageFramework
from investigation.store import Store
from investigation.store.models import BudgetAccount, CaseRecord, StageRun, utcnow
from tests.casekit import make_case

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    url = None if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    made = make_case(tmp_path / "case", database_url=url)
    with made.store.session() as s:
        for hid in (2, 1):  # stored out of order: read back by hypothesis id
            s.add(BudgetAccount(case_id=made.case_id, revision=1, hypothesis_id=hid,
                                credit_units=10, balance_units=10 - hid,
                                last_rejection_json=None, deferred_by=hid if hid == 2 else None))
        case = s.get(CaseRecord, made.case_id)
        assert case is not None
        case.retry_not_before = utcnow()  # a datetime that is set, beside unset ones
        s.add(case)
        s.commit()
    yield made
    made.store.dispose()


def _values(obj: Any) -> dict[str, Any]:
    return {a.key: getattr(obj, a.key) for a in inspect(type(obj)).column_attrs}


class _Writes:
    """The INSERT, UPDATE and DELETE statements the store runs, through SQLAlchemy or on
    the driver's cursor (both show them to ``before_cursor_execute``)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.statements: list[str] = []

    def __call__(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.split()[0] in ("INSERT", "UPDATE", "DELETE"):
            self.statements.append(" ".join(statement.split()))

    def __enter__(self) -> _Writes:
        event.listen(self.store.engine, "before_cursor_execute", self)
        return self

    def __exit__(self, *_: Any) -> None:
        event.remove(self.store.engine, "before_cursor_execute", self)


def test_loaded_objects_hold_what_an_orm_query_loads(case: Any) -> None:
    key = StepKey(case.case_id, 1, 1)
    with Session(case.store.engine) as s:
        reference_case = _values(s.get(CaseRecord, case.case_id))
        reference_accounts = [_values(a) for a in s.exec(
            select(BudgetAccount).order_by(BudgetAccount.hypothesis_id)).all()]
    for _ in range(2):  # the second run is on the driver's cursor
        with _Writes(case.store) as writes, Session(case.store.engine) as s:
            row = Store.lock_case_row(s, case.case_id)
            accounts = StageFramework._accounts(s, key)
            one = StageFramework._account(s, key, 2)
            assert row is not None and _values(row) == reference_case
            assert row.retry_not_before is not None and row.blocked_reason is None
            assert [_values(a) for a in accounts] == reference_accounts
            assert [a.hypothesis_id for a in accounts] == [1, 2]
            assert one is accounts[1]  # the session's own object, as a query returns it
            assert all(inspect(o).persistent for o in (row, *accounts))
            assert not s.dirty and not s.new
            s.commit()
        assert writes.statements == []  # loading writes nothing


def test_a_case_stage_entry_loads_the_row_and_the_steps_markers_in_one_statement(
        case: Any) -> None:
    """Decision 141: ``build_context`` and ``publish`` lock and load the whole case row
    with the step's markers by one statement (SQLite's joined query, PostgreSQL's
    function of migration 0011), with the values an ORM query loads; it and the other
    stages' entry (the checked columns) run on the driver's cursor from their second
    execution."""
    key = StepKey(case.case_id, 1, 1)
    with Session(case.store.engine) as s:
        reference = _values(s.get(CaseRecord, case.case_id))
    statements: list[str] = []
    on_driver: list[bool] = []

    def seen(_conn: Any, _cursor: Any, statement: str, _params: Any, context: Any,
             *_: Any) -> None:
        statements.append(statement)
        on_driver.append(context is None)  # run on the driver's cursor (decision 134)

    event.listen(case.store.engine, "before_cursor_execute", seen)
    try:
        for marked in ([], ["build_context"], ["build_context", "llm_call"]):
            with _Writes(case.store) as writes, Session(case.store.engine) as s:
                before = len(statements)
                row, markers = StageFramework._lock_case_row_and_markers(s, key)
                assert len(statements) - before == 1
                # From its second execution in the process on (an earlier test may have
                # run it already), on the driver's cursor.
                assert on_driver[-1] or not marked
                checked, same = StageFramework._lock_case_and_markers(s, key)
                assert same == markers and checked.head_seq == row.head_seq
                assert len(statements) - before == 2 and (on_driver[-1] or not marked)
                assert _values(row) == reference and inspect(row).persistent
                assert sorted(name for name, _ in markers) == marked
                assert all(text == '{"finalize": false}' for _, text in markers)
                assert not s.dirty and not s.new
                s.commit()
            assert writes.statements == []
            if len(marked) < 2:
                with case.store.session() as s:  # the next marker, for the next read
                    s.add(StageRun(case_id=case.case_id, revision=1, step_seq=1,
                                   stage=["build_context", "llm_call"][len(marked)],
                                   output_json='{"finalize": false}', completed_at=utcnow()))
                    s.commit()
    finally:
        event.remove(case.store.engine, "before_cursor_execute", seen)
    with Session(case.store.engine) as s:
        with pytest.raises(InvestigationError) as err:
            StageFramework._lock_case_row_and_markers(s, StepKey("case-missing", 1, 1))
        assert err.value.code == "CASE_NOT_FOUND"


def test_what_the_caller_changes_is_flushed_as_an_update_of_those_columns(case: Any) -> None:
    key = StepKey(case.case_id, 1, 1)
    with _Writes(case.store) as writes, Session(case.store.engine) as s:
        account = StageFramework._account(s, key, 1)
        account.balance_units -= 3
        account.turns += 1
        row = Store.lock_case(s, case.case_id)
        row.last_reason = "changed"
        s.add(account)
        s.commit()
    updates = sorted(writes.statements)
    assert len(updates) == 2, updates
    assert "SET last_reason=" in updates[0] and "updated_at" not in updates[0]
    assert "SET balance_units=" in updates[1] and "turns=" in updates[1]
    assert "credit_units" not in updates[1]
    with Session(case.store.engine) as s:
        stored = s.exec(select(BudgetAccount).where(BudgetAccount.hypothesis_id == 1)).one()
        assert (stored.balance_units, stored.turns, stored.credit_units) == (6, 1, 10)
        stored_case = s.get(CaseRecord, case.case_id)
        assert stored_case is not None and stored_case.last_reason == "changed"


def test_a_read_keeps_the_sessions_changes_and_flushes_them_first_as_a_query_did(
        case: Any) -> None:
    key = StepKey(case.case_id, 1, 1)
    with Session(case.store.engine) as s:
        account = StageFramework._account(s, key, 1)
        account.balance_units = 0
        # A second read returns the same object with the change (flushed, as a query's
        # autoflush flushed it: a Core read in the transaction now sees it too).
        again = StageFramework._accounts(s, key)[0]
        assert again is account and again.balance_units == 0
        assert not s.dirty
        s.rollback()
    with Session(case.store.engine) as s:
        assert StageFramework._account(s, key, 1).balance_units == 9  # rolled back


def test_the_case_row_is_read_again_over_the_sessions_object_as_populate_existing(
        case: Any) -> None:
    with Session(case.store.engine) as s:
        row = Store.lock_case(s, case.case_id)
        row.last_reason = "not written"
        again = Store.lock_case(s, case.case_id)
        assert again is row and row.last_reason is None
        assert not s.is_modified(row)  # the row's values are the loaded ones again
        assert row not in s.dirty  # as populate_existing leaves it
        row.last_outcome = "changed after"
        assert row in s.dirty and s.is_modified(row)  # a later change is tracked
    with _Writes(case.store) as writes, Session(case.store.engine) as s:
        Store.lock_case(s, case.case_id).last_reason = "not written"
        Store.lock_case(s, case.case_id)
        s.commit()
    assert writes.statements == []


def test_an_account_the_revision_does_not_have_is_no_result(case: Any) -> None:
    with Session(case.store.engine) as s, pytest.raises(NoResultFound):
        StageFramework._account(s, StepKey(case.case_id, 1, 1), 7)
    with Session(case.store.engine) as s:
        assert Store.lock_case_row(s, "case-unknown") is None
        assert StageFramework._accounts(s, StepKey(case.case_id, 2, 1)) == []


def test_the_case_row_is_loaded_in_a_process_whose_first_orm_use_it_is(case: Any) -> None:
    """A worker process may lock the case row before any ORM query has configured the
    mappers (a redelivery counted apart, decision 135, is such a first statement)."""
    url = case.store.engine.url.render_as_string(hide_password=False)
    script = (
        "import sys\n"
        "from sqlmodel import Session\n"
        "from investigation.store import Store\n"
        "store = Store(sys.argv[1])\n"
        "with Session(store.engine, expire_on_commit=False) as s:\n"
        "    row = Store.lock_case(s, sys.argv[2])\n"
        "    row.last_reason = 'from a new process'\n"
        "    s.commit()\n"
        "print(row.id, row.head_seq)\n")
    done = subprocess.run([sys.executable, "-c", script, url, case.case_id], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [case.case_id, "0"]
    with Session(case.store.engine) as s:
        stored = s.get(CaseRecord, case.case_id)
        assert stored is not None and stored.last_reason == "from a new process"


def test_an_expired_object_is_filled_in_from_the_row_without_another_query(case: Any) -> None:
    key = StepKey(case.case_id, 1, 1)
    with Session(case.store.engine) as s:  # expire_on_commit, SQLModel's default
        account = StageFramework._account(s, key, 2)
        s.commit()
        assert inspect(account).expired
        with case.store.engine.begin() as other:  # changed meanwhile, outside the session
            other.exec_driver_sql("UPDATE budget_account SET turns = 5 "
                                  "WHERE hypothesis_id = 2")
        selects: list[str] = []
        event.listen(case.store.engine, "before_cursor_execute",
                     lambda *a: selects.append(a[2]))
        again = StageFramework._account(s, key, 2)
        assert again is account and not inspect(account).expired
        count = len(selects)
        assert (account.turns, account.balance_units, account.deferred_by) == (5, 8, 2)
        assert len(selects) == count  # read from the row: no lazy load
