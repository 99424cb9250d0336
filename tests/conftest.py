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
REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
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
