"""Shared fixtures. Tests marked ``redis``/``postgres`` use the real local services;
under CI (``CI=true``) a missing service fails the run instead of skipping."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.casekit import Case, make_case

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

#: Redis databases each pytest-xdist worker uses in place of the suite's own numbers
#: (``make test`` runs two workers, ``-n 2``): each worker flushes only its own. None is
#: database 0, the product's default broker, which one test enqueues on (deleting only its
#: own keys), nor 1 (the README's example fleet), 6 (``make bench``) or 13 (``make
#: test-dist``). Without xdist the numbers are the suite's own (0, 5 and 12).
XDIST_REDIS_DBS = {
    "gw0": {0: 2, 5: 5, 12: 12},
    "gw1": {0: 3, 5: 4, 12: 14},
}


def redis_db(db: int) -> int:
    """The Redis database this test process uses for the suite's database ``db``.

    Under pytest-xdist (``PYTEST_XDIST_WORKER`` set) each worker has its own (see
    ``XDIST_REDIS_DBS``); a worker or database the table lacks fails the run, so that two
    workers never share (and flush) one database."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return db
    try:
        return XDIST_REDIS_DBS[worker][db]
    except KeyError:
        raise RuntimeError(
            f"no Redis database for the suite's database {db} on xdist worker {worker}: "
            f"run at most {len(XDIST_REDIS_DBS)} workers (-n {len(XDIST_REDIS_DBS)}) and "
            f"the default TEST_* databases (tests/conftest.py, XDIST_REDIS_DBS)") from None


def with_db(url: str, db: int) -> str:
    """``url`` (``redis://host:port[/n]``) pointed at database ``db``."""
    base, _, tail = url.rpartition("/")
    return f"{base}/{db}" if tail.isdigit() else f"{url.rstrip('/')}/{db}"


def _db_of(url: str) -> int:
    tail = url.rpartition("/")[2]
    return int(tail) if tail.isdigit() else 0


#: The suite's Redis as given (``TEST_REDIS_URL``); ``REDIS_URL`` is it at this test
#: process's database (``redis_db``).
SUITE_REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
REDIS_URL = with_db(SUITE_REDIS_URL, redis_db(_db_of(SUITE_REDIS_URL)))
POSTGRES_URL = os.environ.get("TEST_POSTGRES_URL",
                              "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def need_service(name: str, host: str, port: int) -> None:
    """Skip locally (fail in CI) when a service is not reachable."""
    if _reachable(host, port):
        return
    message = f"{name} is not reachable on {host}:{port}"
    if IN_CI:
        pytest.fail(message + " (CI must start it: scripts/ensure-services.sh)")
    pytest.skip(message)


#: Debian's Chromium (``apt-get install chromium``; scripts/ensure-chromium.sh installs it).
CHROMIUM = os.environ.get("TEST_CHROMIUM", "/usr/bin/chromium")


def need_browser() -> str:
    """The Chromium executable and Playwright's client: skip locally, fail in CI when
    either is missing (CI must have them: scripts/ensure-chromium.sh, the test extras)."""
    problem = None
    if not Path(CHROMIUM).is_file():
        problem = f"Chromium is not installed at {CHROMIUM} (apt-get install chromium)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            problem = "the playwright package is missing (pip install -e '.[test]')"
    if problem is None:
        return CHROMIUM
    if IN_CI:
        pytest.fail(problem + " (CI must provide it: scripts/ensure-chromium.sh, run by make test)")
    pytest.skip(problem)


@pytest.fixture
def tiny_case(tmp_path: Path) -> Case:
    """The tiny shop case on a fresh SQLite store with the happy scripted replies."""
    return make_case(tmp_path / "case")


@pytest.fixture
def redis_url() -> str:
    need_service("redis", "127.0.0.1", 6379)
    return REDIS_URL


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A PostgreSQL URL bound to a fresh schema, dropped afterwards."""
    need_service("postgresql", "127.0.0.1", 5432)
    import sqlalchemy

    schema = "t_" + uuid.uuid4().hex[:12]
    admin = sqlalchemy.create_engine(POSTGRES_URL)
    with admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
    try:
        yield f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
        admin.dispose()
