"""A full run on a real Celery worker where a test hand-off blocks the case, the worker is
killed and replaced while the case waits, feedback is confirmed through the CLI, and the
investigation completes (docs/async-tests.md)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from investigation.constants import CASE_BLOCKED, CASE_BUILDING_DIAGNOSIS
from investigation.external_tests import derive_secret
from investigation.operations import status, summary_bytes
from tests.integration.test_celery_worker import Harness, running_harness
from tests.integration.test_external_tests import REPLIES

pytestmark = [pytest.mark.redis, pytest.mark.slow]

KEY = "f" * 48


@pytest.fixture
def harness(tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    config = tmp_path / "investigation.toml"
    config.write_text("[budget.test_costs]\nhuman = 5\n")
    with running_harness(tmp_path, redis_url, monkeypatch, replies=REPLIES, extra_env={
            "INVESTIGATE_CONFIG": str(config), "INVESTIGATE_FEEDBACK_KEY": KEY}) as h:
        yield h


def test_hand_off_worker_restart_feedback_and_completion(harness: Harness) -> None:
    from workers.cli import app
    from workers.tasks import start_dispatch

    h = harness
    cid = h.case.case_id
    runner = CliRunner()
    with h.dump_on_failure():
        h.worker.start()
        start_dispatch(cid)
        info = h.wait_for_state(CASE_BLOCKED)
        assert info["blocked_reason"] == "AWAITING_TEST_FEEDBACK"
        h.wait_unlocked()  # no worker holds the case while it waits
        # The worker dies (kill -9 of the whole process group) and a new one starts.
        assert h.worker.proc is not None
        os.killpg(h.worker.proc.pid, 9)
        h.worker.proc.wait(timeout=10)
        h.worker.start()
        h.worker.wait_ready()
        assert status(h.case.store, cid)["state"] == CASE_BLOCKED
        listed = runner.invoke(app, ["tests", "list", cid])
        assert listed.exit_code == 0 and "T1" in listed.output and "awaiting" in listed.output
        shown = runner.invoke(app, ["tests", "show", cid, "T1", "--secret"])
        assert shown.exit_code == 0, shown.output
        secret = shown.output.rsplit("secret: ", 1)[1].split()[0]
        assert secret == derive_secret(KEY.encode(), cid, "T1")
        forged = runner.invoke(app, ["feedback", "submit", cid, "T1", "--secret", "0" * 64,
                                     "--outcome", "not_as_expected", "--observation", "x"])
        assert forged.exit_code == 2 and "FEEDBACK_FORGED" in forged.output
        sub = runner.invoke(app, ["feedback", "submit", cid, "T1", "--secret", secret,
                                  "--outcome", "not_as_expected",
                                  "--observation", "The total was 0.00"])
        assert sub.exit_code == 0, sub.output
        digest = sub.output.split("digest ", 1)[1].split()[0]
        conf = runner.invoke(app, ["feedback", "confirm", cid, "T1", "--secret", secret,
                                   "--digest", digest])
        assert conf.exit_code == 0, conf.output
        assert "confirmed as evidence E3" in conf.output
        start_dispatch(cid)
        info = h.wait_for_state(CASE_BUILDING_DIAGNOSIS)
    assert info["last_outcome"] == "COMPLETED"
    assert "The total was 0.00" in summary_bytes(h.case.store, cid).decode()
