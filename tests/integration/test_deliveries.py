"""The durable delivery counter on the store (no broker): counting, parking, resetting."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlmodel import select

from investigation.constants import BLOCK_STAGE_POISONED, BLOCKED, CASE_BLOCKED, STAGES
from investigation.errors import InvestigationError
from investigation.loop.deliveries import Apart, count_apart, delivery_returned
from investigation.loop.outcome import StepKey
from investigation.operations import resume, status
from investigation.store.models import StageDelivery
from tests.casekit import Case, make_case


def _row(case: Case, key: StepKey, stage: str) -> StageDelivery:
    with case.store.session() as s:
        return s.exec(select(StageDelivery).where(
            StageDelivery.case_id == key.case_id, StageDelivery.step_seq == key.step_seq,
            StageDelivery.stage == stage)).one()


def test_unfinished_deliveries_park_the_case_and_resume_resets_them(tiny_case: Case) -> None:
    key = StepKey(tiny_case.case_id, 1, 1)
    assert count_apart(tiny_case.store, key, "build_context", 2) == Apart(True, None)
    assert count_apart(tiny_case.store, key, "build_context", 2) == Apart(True, None)
    parked = count_apart(tiny_case.store, key, "build_context", 2).parked
    assert parked is not None
    assert (parked.outcome, parked.reason) == (BLOCKED, BLOCK_STAGE_POISONED)
    assert parked.details == {"stage": "build_context", "deliveries": 3, "unfinished": 3}
    info = status(tiny_case.store, tiny_case.case_id)
    assert (info["state"], info["blocked_reason"]) == (CASE_BLOCKED, BLOCK_STAGE_POISONED)
    assert info["blocked_detail"].startswith(
        "stage build_context of step 1 was delivered 3 times and 3 deliveries never returned")
    # A parked case counts nothing more (its stages are fenced on the state).
    assert count_apart(tiny_case.store, key, "build_context", 2) == Apart(False, None)
    assert _row(tiny_case, key, "build_context").deliveries == 3
    resume(tiny_case.store, tiny_case.case_id)
    row = _row(tiny_case, key, "build_context")
    assert (row.deliveries, row.unfinished) == (3, 0)
    # After the resume the case runs to the end; finished stages are never counted.
    inv = tiny_case.investigator()
    while inv.step(tiny_case.case_id).outcome != "COMPLETED":
        pass
    for stage in STAGES:
        assert count_apart(tiny_case.store, key, stage, 1) == Apart(False, None)
    assert _row(tiny_case, key, "build_context").deliveries == 3


def test_a_delivery_that_returns_restarts_the_count(tiny_case: Case) -> None:
    key = StepKey(tiny_case.case_id, 1, 1)
    for _ in range(5):  # e.g. llm_call ending RETRY_PENDING again and again
        assert count_apart(tiny_case.store, key, "llm_call", 1).parked is None
        delivery_returned(tiny_case.store, key, "llm_call")
    row = _row(tiny_case, key, "llm_call")
    assert (row.deliveries, row.unfinished) == (5, 0)


def test_stale_steps_are_not_counted(tiny_case: Case) -> None:
    assert count_apart(tiny_case.store, StepKey(tiny_case.case_id, 1, 3), "publish", 1) \
        == Apart(False, None)
    assert count_apart(tiny_case.store, StepKey(tiny_case.case_id, 2, 1), "publish", 1) \
        == Apart(False, None)
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


class _Killed(BaseException):
    """Stands for SIGKILL inside a stage: nothing after it runs, its transaction is lost."""


def test_a_kill_inside_a_stage_transaction_is_still_counted(
        tiny_case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ordinary delivery is counted in the stage's own transaction (lost with it when the
    worker dies there); the redelivery counts itself apart and adds the lost one, so a
    stage that kills its worker is parked after as many deliveries as before."""
    from investigation.loop.deliveries import Delivery
    from investigation.loop.stages import Stages

    key = StepKey(tiny_case.case_id, 1, 1)
    runs = {"validate": 0}
    real = Stages._validate

    def killing(self: Stages, k: StepKey) -> object:
        runs["validate"] += 1
        with self._tx() as s:  # the stage transaction is open and has counted
            self._fence(s, k, "validate")
            raise _Killed()
        return real(self, k)  # pragma: no cover

    first = Stages(tiny_case.env())  # process A
    for stage in ("build_context", "llm_call"):
        assert first.run(stage, key, Delivery(2)).halt is None
    assert _row(tiny_case, key, "llm_call").unfinished == 1  # counted with the stage
    monkeypatch.setattr(Stages, "_validate", killing)
    with pytest.raises(_Killed):
        first.run("validate", key, Delivery(2))  # counted in the lost transaction
    with tiny_case.store.session() as s:
        assert s.exec(select(StageDelivery).where(
            StageDelivery.stage == "validate")).first() is None
    with pytest.raises(_Killed):  # process B gets the redelivery: counts it and the lost one
        Stages(tiny_case.env()).run("validate", key, Delivery(2, redelivered=True))
    assert (_row(tiny_case, key, "validate").deliveries,
            _row(tiny_case, key, "validate").unfinished) == (2, 2)
    parked = Stages(tiny_case.env()).run("validate", key, Delivery(2, redelivered=True)).halt
    assert parked is not None and (parked.outcome, parked.reason) == (BLOCKED,
                                                                     BLOCK_STAGE_POISONED)
    assert runs["validate"] == 2  # the limit, as when every delivery was counted apart
    assert _row(tiny_case, key, "validate").deliveries == 3
    monkeypatch.setattr(Stages, "_validate", real)
    resume(tiny_case.store, tiny_case.case_id)  # the operator fixed it; a new dispatch
    again = Stages(tiny_case.env())
    for stage in STAGES[2:]:
        assert again.run(stage, key, Delivery(2)).output is not None
    assert _row(tiny_case, key, "validate").deliveries == 4


def test_a_controlled_error_inside_the_stage_transaction_counts_a_returned_delivery(
        tiny_case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    from investigation.loop.deliveries import Delivery
    from investigation.loop.stages import Stages

    key = StepKey(tiny_case.case_id, 1, 1)
    stages = Stages(tiny_case.env())
    assert stages.run("build_context", key, Delivery(2)).halt is None

    def failing(self: Stages, k: StepKey) -> object:
        with self._tx() as s:
            self._fence(s, k, "llm_call")
            raise InvestigationError("CONTEXT_IDENTITY", "injected")

    monkeypatch.setattr(Stages, "_llm_call", failing)
    for _ in range(3):
        with pytest.raises(InvestigationError):
            stages.run("llm_call", key, Delivery(2))
    row = _row(tiny_case, key, "llm_call")
    assert (row.deliveries, row.unfinished) == (3, 0)  # returned every time: not poisoned


def test_a_delivery_counted_apart_that_returns_restarts_the_count(
        tiny_case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    from investigation.loop.deliveries import Delivery
    from investigation.loop.stages import Stages

    key = StepKey(tiny_case.case_id, 1, 1)
    assert Stages(tiny_case.env()).run("build_context", key, Delivery(1)).halt is None

    def failing(self: Stages, k: StepKey) -> object:
        raise InvestigationError("CONTEXT_IDENTITY", "injected")

    monkeypatch.setattr(Stages, "_llm_call", failing)
    for redelivered in (False, True, False):  # each a new process or a broker redelivery
        with pytest.raises(InvestigationError):
            Stages(tiny_case.env()).run("llm_call", key, Delivery(3, redelivered))
        assert _row(tiny_case, key, "llm_call").unfinished == 0  # it returned
    # The redelivery found nothing unfinished, so it also counted the delivery it followed.
    assert _row(tiny_case, key, "llm_call").deliveries == 4


def test_only_a_stage_with_an_external_effect_counts_an_ordinary_delivery(
        tiny_case: Case) -> None:
    """A process that met the case counts ``llm_call`` and ``execute_tool`` in their first
    transaction (it commits before the model call or the query) and nothing for a
    one-transaction stage: its count would commit with its marker or die with it."""
    from investigation.loop.deliveries import Delivery
    from investigation.loop.stages import Stages

    key = StepKey(tiny_case.case_id, 1, 1)
    stages = Stages(tiny_case.env())
    for stage in STAGES:
        result = stages.run(stage, key, Delivery(2))
        assert result.fresh, stage
    with tiny_case.store.session() as s:
        counted = {row.stage: (row.deliveries, row.unfinished)
                   for row in s.exec(select(StageDelivery)).all()}
    # build_context was the process's first delivery of the case: counted apart.
    assert counted == {"build_context": (1, 1), "llm_call": (1, 1), "execute_tool": (1, 1)}
    again = stages.run("validate", key, Delivery(2))  # recorded: returned, not counted
    assert not again.fresh and again.output == stages.run("validate", key).output


def test_an_effect_stage_over_the_limit_parks_the_case_without_loading_it(
        tiny_case: Case) -> None:
    """The count in the stage transaction parks the case with a Core UPDATE (the entry
    loaded no case object); the outcome and the stored state say STAGE_POISONED."""
    from investigation.loop.deliveries import Delivery
    from investigation.loop.stages import Stages

    key = StepKey(tiny_case.case_id, 1, 1)
    stages = Stages(tiny_case.env())
    assert stages.run("build_context", key, Delivery(2)).halt is None  # met: counted apart
    for _ in range(2):  # two deliveries of llm_call counted apart that never returned
        assert count_apart(tiny_case.store, key, "llm_call", 2).parked is None
    parked = stages.run("llm_call", key, Delivery(2)).halt  # an ordinary third delivery
    assert parked is not None and (parked.outcome, parked.reason) == (
        BLOCKED, BLOCK_STAGE_POISONED)
    assert parked.details == {"stage": "llm_call", "deliveries": 3, "unfinished": 3}
    info = status(tiny_case.store, tiny_case.case_id)
    assert (info["state"], info["blocked_reason"], info["last_reason"]) == (
        CASE_BLOCKED, BLOCK_STAGE_POISONED, BLOCK_STAGE_POISONED)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def either_store_case(request: pytest.FixtureRequest, tmp_path: Path) -> Case:
    """The tiny case on SQLite, or on a fresh PostgreSQL schema."""
    url = request.getfixturevalue("postgres_url") if request.param == "postgresql" else None
    return make_case(tmp_path / "case", database_url=url)


@pytest.mark.parametrize("paused", [False, True], ids=["blocked", "paused"])
def test_a_late_delivery_after_the_parking_keeps_the_poisoned_stages_count(
        either_store_case: Case, paused: bool) -> None:
    """A duplicate of the poisoned stage, restored by the broker after the case was
    parked (and perhaps paused since), returns at once: the case is not investigating,
    so the delivery is not counted, and its return must not reset the count that status
    reports as the reason (test_recovery's poisoned-stage test once named llm_call, whose
    own count of 1 was then the highest; decision 137)."""
    from investigation.errors import StaleStateError
    from investigation.loop.deliveries import Delivery
    from investigation.loop.stages import Stages
    from investigation.operations import pause

    case = either_store_case
    key = StepKey(case.case_id, 1, 1)
    assert count_apart(case.store, key, "llm_call", 2).parked is None
    assert count_apart(case.store, key, "execute_tool", 2).parked is None
    assert count_apart(case.store, key, "execute_tool", 2).parked is None
    assert count_apart(case.store, key, "execute_tool", 2).parked is not None  # parked
    if paused:
        pause(case.store, case.case_id)
    late = Stages(case.env())
    try:
        result = late.run("execute_tool", key, Delivery(2, redelivered=True))
    except StaleStateError:
        pass
    else:
        assert result.halt is not None  # it ran nothing
    row = _row(case, key, "execute_tool")
    assert (row.deliveries, row.unfinished) == (3, 3)
    if paused:
        resume(case.store, case.case_id)  # unpaused: parked again
    info = status(case.store, case.case_id)
    assert (info["state"], info["blocked_reason"]) == (CASE_BLOCKED, BLOCK_STAGE_POISONED)
    assert info["blocked_detail"].startswith("stage execute_tool of step 1 was delivered 3 "
                                             "times and 3 deliveries never returned")
    resume(case.store, case.case_id)  # the operator's resume still resets it
    assert _row(case, key, "execute_tool").unfinished == 0
