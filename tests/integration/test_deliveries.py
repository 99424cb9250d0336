"""The durable delivery counter on the store (no broker): counting, parking, resetting."""

from __future__ import annotations

import pytest
from sqlmodel import select

from investigation.constants import BLOCK_STAGE_POISONED, BLOCKED, CASE_BLOCKED, STAGES
from investigation.errors import InvestigationError
from investigation.loop.deliveries import delivery_returned, record_delivery
from investigation.loop.outcome import StepKey
from investigation.operations import resume, status
from investigation.store.models import StageDelivery
from tests.casekit import Case


def _row(case: Case, key: StepKey, stage: str) -> StageDelivery:
    with case.store.session() as s:
        return s.exec(select(StageDelivery).where(
            StageDelivery.case_id == key.case_id, StageDelivery.step_seq == key.step_seq,
            StageDelivery.stage == stage)).one()


def test_unfinished_deliveries_park_the_case_and_resume_resets_them(tiny_case: Case) -> None:
    key = StepKey(tiny_case.case_id, 1, 1)
    assert record_delivery(tiny_case.store, key, "build_context", 2) is None
    assert record_delivery(tiny_case.store, key, "build_context", 2) is None
    parked = record_delivery(tiny_case.store, key, "build_context", 2)
    assert parked is not None
    assert (parked.outcome, parked.reason) == (BLOCKED, BLOCK_STAGE_POISONED)
    assert parked.details == {"stage": "build_context", "deliveries": 3, "unfinished": 3}
    info = status(tiny_case.store, tiny_case.case_id)
    assert (info["state"], info["blocked_reason"]) == (CASE_BLOCKED, BLOCK_STAGE_POISONED)
    assert info["blocked_detail"].startswith(
        "stage build_context of step 1 was delivered 3 times and 3 deliveries never returned")
    # A parked case counts nothing more (its stages are fenced on the state).
    assert record_delivery(tiny_case.store, key, "build_context", 2) is None
    assert _row(tiny_case, key, "build_context").deliveries == 3
    resume(tiny_case.store, tiny_case.case_id)
    row = _row(tiny_case, key, "build_context")
    assert (row.deliveries, row.unfinished) == (3, 0)
    # After the resume the case runs to the end; finished stages are never counted.
    inv = tiny_case.investigator()
    while inv.step(tiny_case.case_id).outcome != "COMPLETED":
        pass
    for stage in STAGES:
        assert record_delivery(tiny_case.store, key, stage, 1) is None
    assert _row(tiny_case, key, "build_context").deliveries == 3


def test_a_delivery_that_returns_restarts_the_count(tiny_case: Case) -> None:
    key = StepKey(tiny_case.case_id, 1, 1)
    for _ in range(5):  # e.g. llm_call ending RETRY_PENDING again and again
        assert record_delivery(tiny_case.store, key, "llm_call", 1) is None
        delivery_returned(tiny_case.store, key, "llm_call")
    row = _row(tiny_case, key, "llm_call")
    assert (row.deliveries, row.unfinished) == (5, 0)


def test_stale_steps_are_not_counted(tiny_case: Case) -> None:
    assert record_delivery(tiny_case.store, StepKey(tiny_case.case_id, 1, 3), "publish", 1) \
        is None
    assert record_delivery(tiny_case.store, StepKey(tiny_case.case_id, 2, 1), "publish", 1) \
        is None
    with tiny_case.store.session() as s:
        assert s.exec(select(StageDelivery)).all() == []


def test_settings_refuse_a_countdown_not_below_the_visibility_timeout() -> None:
    from pydantic import ValidationError

    from workers.settings import Settings

    with pytest.raises(ValidationError, match="below INVESTIGATE_VISIBILITY_TIMEOUT_S"):
        Settings(visibility_timeout_s=60, max_countdown_s=60)
    ok = Settings(visibility_timeout_s=60, max_countdown_s=59, restore_interval_s=3)
    from workers.celery_app import transport_options

    opts = transport_options(ok)
    assert opts["visibility_timeout"] == 60
    assert (opts["unacked_restore_interval"], opts["unacked_restore_throttle"]) == (3, 1)


def test_resume_of_a_running_case_is_refused(tiny_case: Case) -> None:
    with pytest.raises(InvestigationError, match="only a paused or blocked case"):
        resume(tiny_case.store, tiny_case.case_id)
