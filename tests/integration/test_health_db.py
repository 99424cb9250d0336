"""``investigate db upgrade|current`` and ``investigate health`` on real services."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.casekit import build_tiny_package

pytestmark = [pytest.mark.postgres]

BIN = Path(sys.executable).parent / "investigate"
REPO = Path(__file__).resolve().parents[2]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once the socket is closed


def run(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN), *argv], env=env, capture_output=True, text=True,
                          timeout=120, check=False, cwd=REPO)


@pytest.fixture
def env(tmp_path: Path, postgres_url: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("INVESTIGATE_")}
    base.update({"INVESTIGATE_HOME": str(tmp_path / "home"),
                 "INVESTIGATE_DATABASE_URL": postgres_url,
                 "INVESTIGATE_BROKER_URL": f"redis://127.0.0.1:{closed_port()}/0"})
    return base


def test_db_current_and_upgrade_run_the_migrations_explicitly(
    env: dict[str, str], tmp_path: Path
) -> None:
    from investigation.store.migrate import head_revision

    head = head_revision()
    current = run(env, "db", "current", "--check")
    assert current.returncode == 1 and "current none" in current.stdout, current
    # With automatic migration off, nothing else may create the schema.
    off = {**env, "INVESTIGATE_AUTO_MIGRATE": "false"}
    package = build_tiny_package(tmp_path / "pkg")
    (tmp_path / "i.json").write_text('{"summary": "s"}')
    (tmp_path / "h.json").write_text('[{"id": 1, "statement": "s"}]')
    refused = run(off, "case", "add", str(package), "--interpretation",
                  str(tmp_path / "i.json"), "--hypotheses", str(tmp_path / "h.json"))
    assert refused.returncode == 2 and "STORE_NOT_MIGRATED" in refused.stderr, refused
    assert "investigate db upgrade" in refused.stderr
    assert "current none" in run(env, "db", "current").stdout
    upgraded = run(off, "db", "upgrade")
    assert upgraded.returncode == 0 and f"store at {head} (was none)" in upgraded.stdout
    again = run(off, "db", "upgrade")
    assert again.returncode == 0 and "nothing to do" in again.stdout
    status = json.loads(run(env, "db", "current", "--json", "--check").stdout)
    assert status == {"current": [head], "head": head, "at_head": True}
    added = run(off, "case", "add", str(package), "--interpretation", str(tmp_path / "i.json"),
                "--hypotheses", str(tmp_path / "h.json"))
    assert added.returncode == 0, added.stderr


def test_health_fails_with_exit_1_and_says_which_check(env: dict[str, str]) -> None:
    result = run(env, "health", "--json", "--timeout", "0.5")
    assert result.returncode == 1, result
    report = json.loads(result.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["healthy"] is False
    assert list(checks) == ["broker", "locks", "store", "migrations", "workers", "queue",
                            "beat"]
    assert not checks["broker"]["ok"] and not checks["locks"]["ok"]
    assert checks["store"]["ok"]  # PostgreSQL answers
    assert not checks["migrations"]["ok"] and "investigate db upgrade" in \
        checks["migrations"]["detail"]
    assert checks["workers"]["detail"].startswith("skipped")
    assert checks["beat"]["detail"].startswith("skipped")  # beat's key is in the lock Redis
    # Only the store's checks: after the upgrade they pass (exit 0), as a probe would use.
    assert run(env, "db", "upgrade").returncode == 0
    ok = run(env, "health", "--check", "store", "--check", "migrations")
    assert ok.returncode == 0 and ok.stdout.strip().endswith("healthy"), ok
    bad = run(env, "health", "--check", "nonsense")
    assert bad.returncode == 2
