"""The store under concurrency from several OS processes (seed 000, "Persistence and recovery").

* SQLite: several processes drive stages, status and registration on one database file at
  the same time; no operator ever sees "database is locked" (WAL, ``BEGIN IMMEDIATE``,
  busy timeout), and the case ends exactly as an undisturbed run.
* PostgreSQL: racing registrations of the same case return the existing row.
* Fork: a forked child (a prefork worker) never uses its parent's pooled connection.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from investigation.cases.reader import PackageReader
from investigation.cases.registry import register_case
from investigation.config import InvestigationConfig
from investigation.constants import COMPLETED
from investigation.errors import StaleStateError
from investigation.operations import status
from investigation.store import Store
from tests import casekit
from tests.casekit import Case, make_case
from tests.integration.test_interrupts import fingerprint

RUNNERS, POLLERS, REGISTRARS = 3, 2, 1


def _worker(role: str, root: str, url: str, case_id: str, results: Any) -> None:
    """One OS process (spawned): run steps, poll status or register the same case."""
    errors: list[str] = []
    stale = 0
    try:
        case = Case(Store(url), case_id, Path(root) / "case.zip", Path(root) / "replies.jsonl",
                    Path(root) / "providers.toml", Path(root))
        for _ in range(300):
            if role == "runner":
                try:
                    outcome = case.investigator().step(case_id)
                except StaleStateError:
                    stale += 1
                    continue
                if outcome.outcome == COMPLETED:
                    break
            elif role == "poller":
                if status(case.store, case_id)["state"] == "BUILDING_DIAGNOSIS":
                    break
            else:
                register_case(case.store, case.package.read_bytes(), casekit.INTERPRETATION,
                              casekit.HYPOTHESES, PackageReader(InvestigationConfig().package))
                if status(case.store, case_id)["state"] == "BUILDING_DIAGNOSIS":
                    break
    except BaseException:  # reported to the parent, which fails the test
        errors.append(traceback.format_exc())
    results.put((role, os.getpid(), stale, errors))


def test_processes_on_one_sqlite_file_never_see_database_is_locked(tmp_path: Path) -> None:
    reference = make_case(tmp_path / "reference")
    assert reference.investigator().run(reference.case_id, max_steps=50).outcome == COMPLETED
    case = make_case(tmp_path / "shared")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    roles = ["runner"] * RUNNERS + ["poller"] * POLLERS + ["registrar"] * REGISTRARS
    procs = [ctx.Process(target=_worker, args=(role, str(case.root), case.store.url,
                                               case.case_id, results)) for role in roles]
    for p in procs:
        p.start()
    reports = [results.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(30)
    problems = [e for *_, errors in reports for e in errors]
    assert not problems, "\n".join(problems)
    assert not any("database is locked" in e for e in problems)
    assert len({pid for _, pid, _, _ in reports}) == len(roles)  # really separate processes
    assert fingerprint(case) == fingerprint(reference)


@pytest.mark.postgres
def test_racing_registrations_on_postgres_return_the_existing_case(
    tmp_path: Path, postgres_url: str
) -> None:
    seed = make_case(tmp_path / "seed")  # builds the package bytes
    store = Store(postgres_url)
    store.create_schema()
    data = seed.package.read_bytes()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        ids = pool.starmap(_register, [(postgres_url, data)] * 8)
    assert len(set(ids)) == 1 and ids[0] == seed.case_id
    with store.session() as s:
        assert s.exec(text("SELECT count(*) FROM \"case\"")).one()[0] == 1  # type: ignore[call-overload]


def _register(url: str, data: bytes) -> str:
    return register_case(Store(url), data, casekit.INTERPRETATION, casekit.HYPOTHESES,
                         PackageReader(InvestigationConfig().package))


def _connection_identity(store: Store) -> Any:
    with store.engine.connect() as conn:
        if store.engine.dialect.name == "postgresql":
            return conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        return id(conn.connection.dbapi_connection)


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres",
                                                             marks=pytest.mark.postgres)])
def test_a_forked_child_never_shares_the_parents_connection(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = (request.getfixturevalue("postgres_url") if backend == "postgres"
           else f"sqlite:///{tmp_path / 'fork.db'}")
    store = Store(url)
    store.create_schema()
    parent = _connection_identity(store)
    assert store.engine.pool.checkedin() >= 1  # type: ignore[attr-defined]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: what a prefork worker process sees
        code = 1
        try:
            inherited = store.engine.pool.checkedin()  # type: ignore[attr-defined]
            child = _connection_identity(store)
            with store.session() as s:
                s.exec(text("SELECT 1"))  # type: ignore[call-overload]
            os.write(write, f"{inherited} {child}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    _, status_code = os.waitpid(pid, 0)
    answer = os.read(read, 200).decode().split()
    os.close(read)
    assert os.waitstatus_to_exitcode(status_code) == 0
    inherited, child = int(answer[0]), answer[1]
    assert inherited == 0  # the pool was dropped in the child
    if backend == "postgres":
        assert int(child) != parent  # another server session
    # The parent's pooled connection still works: the child did not close it.
    assert _connection_identity(store) == parent
