"""Durable delivery counter: a stage that keeps killing its worker parks its case.

Seed 000, "Persistence and recovery": after a crash an accepted plan resumes its steps.
At-least-once delivery (late acks, reject on worker lost) redelivers a stage whose worker
died; if the stage itself kills the worker (a crash in native code, memory exhaustion),
that would repeat forever. Every delivery of a stage that has no completion marker yet is
counted in the ``stage_delivery`` table. A delivery that returns without finishing (a
halt such as ``RETRY_PENDING``, a controlled error) resets the stage's ``unfinished``
count; a finished stage has its marker and is never counted again. When ``unfinished``
exceeds the configured limit the case becomes ``BLOCKED`` with ``STAGE_POISONED``;
``investigate resume`` (``investigation.operations.resume``) resets the counts.

Where the count is written (issue 13: one transaction per stage):

* An ordinary delivery of a stage with an external effect (``llm_call``, ``execute_tool``:
  ``StageFramework.EFFECT_STAGES``) is counted **inside the stage's first transaction**,
  which commits before the model call or the query; a worker killed during the effect
  has its delivery counted.
* An ordinary delivery of any other stage is not counted: the stage writes everything in
  one transaction, where the count would commit with the stage's marker (a finished
  stage is never counted again) or be lost with it when the worker dies there.
* A delivery that may follow such a loss is counted **in a transaction of its own, before
  the stage runs** (:func:`count_apart`), as every delivery was before: a redelivery
  (the broker marks it: kombu's Redis transport sets ``redelivered`` on every message it
  restores) and the first delivery a process counts for a case (a new worker process or
  CLI run after a crash). A redelivery that finds no unfinished delivery counted adds the
  one that was lost. So the number of kills before a case is parked is what it was.

This module knows nothing of Celery: the runtime says how a stage was delivered
(:class:`Delivery`) and ``Stages.run`` counts.

A worker time limit that stops a stage is not a crash: the runtime reports it once
(:func:`delivery_returned`, so it never counts towards ``STAGE_POISONED``), and a stage
that cannot be recorded as a failed query result parks the case ``BLOCKED`` with
``STAGE_TIME_LIMIT`` (:func:`block_for_time_limit`).

A stage that stops its step with a controlled error (an ``InvestigationError``: a
checkpoint that fails replay, a context over its bound) returns normally and is not
counted either; the runtime records the error's code as the case's last outcome
(:func:`note_step_error`), so ``status`` and ``cases`` show it where a worker ran it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy import bindparam, exists, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from investigation.constants import (
    BLOCK_STAGE_POISONED,
    BLOCK_STAGE_TIME_LIMIT,
    BLOCKED,
    CASE_BLOCKED,
    CASE_INVESTIGATING,
    STEP_ERROR,
)
from investigation.loop.outcome import Outcome, StepKey
from investigation.store.engine import Store, core, is_unique_violation, table_of
from investigation.store.models import CaseRecord, StageDelivery, StageRun, utcnow

_D = table_of(StageDelivery)
_C = table_of(CaseRecord)


def _counter(insert: Any) -> Any:
    """The counting upsert of :func:`count`, built once per dialect (Core, on the table:
    delivery rows are never written through the ORM)."""
    return insert(_D).values(
        case_id=bindparam("case_id"), revision=bindparam("revision"),
        step_seq=bindparam("step_seq"), stage=bindparam("stage"),
        deliveries=bindparam("n"), unfinished=bindparam("n"),
        last_delivered_at=bindparam("now"),
    ).on_conflict_do_update(
        index_elements=["case_id", "revision", "step_seq", "stage"],
        set_={"deliveries": _D.c.deliveries + bindparam("n"),
              "unfinished": _D.c.unfinished + bindparam("n"),
              "last_delivered_at": bindparam("now")},
    ).returning(_D.c.deliveries, _D.c.unfinished)


_COUNTERS = {"postgresql": _counter(pg_insert), "sqlite": _counter(sqlite_insert)}


@dataclass(frozen=True)
class Delivery:
    """How the runtime delivered a stage.

    Args:
        max_unfinished: deliveries that started and never returned that are tolerated; the
            next one parks the case (``INVESTIGATE_MAX_STAGE_DELIVERIES``, >= 1).
        redelivered: the broker restored this message after an earlier delivery of it
            (a killed worker, an expired visibility timeout).
    """

    max_unfinished: int
    redelivered: bool = False


def count(s: Session, case: CaseRecord | None, key: StepKey, stage: str,
          max_unfinished: int, lost: int = 0) -> Outcome | None:
    """Count one delivery (plus ``lost`` earlier ones) of ``stage`` in transaction ``s``;
    park the case (in the same transaction) when too many never returned.

    The caller has locked the case row and checked that the step is current and the
    stage unfinished. ``case`` is the row's ORM object if the caller loaded one (it is
    parked through it); otherwise the case is parked with one Core UPDATE.

    Returns:
        ``None`` to run the stage, or the ``BLOCKED``/``STAGE_POISONED`` outcome
        (``details``: ``stage``, ``deliveries``, ``unfinished``).
    """
    conn = core(s)
    upsert = _COUNTERS["postgresql" if conn.dialect.name == "postgresql" else "sqlite"]
    deliveries, unfinished = conn.execute(upsert, {
        **key.to_dict(), "stage": stage, "n": 1 + lost, "now": utcnow()}).one()
    if unfinished <= max_unfinished:
        return None
    parked = {"state": CASE_BLOCKED, "blocked_reason": BLOCK_STAGE_POISONED,
              "last_outcome": BLOCKED, "last_reason": BLOCK_STAGE_POISONED,
              "retry_not_before": None, "updated_at": utcnow()}
    if case is None:
        conn.execute(update(_C).where(_C.c.id == key.case_id).values(**parked))
    else:
        for name, value in parked.items():
            setattr(case, name, value)
        s.add(case)
    return Outcome(BLOCKED, key.case_id, key.step_seq, BLOCK_STAGE_POISONED,
                   details={"stage": stage, "deliveries": int(deliveries),
                            "unfinished": int(unfinished)})


class Apart(NamedTuple):
    """What :func:`count_apart` did: whether it counted the delivery, and the outcome of a
    case it parked."""

    counted: bool
    parked: Outcome | None


def count_apart(store: Store, key: StepKey, stage: str, max_unfinished: int,
                redelivered: bool = False, *, async_commit: bool = False) -> Apart:
    """Count one delivery of ``stage`` of step ``key`` in a transaction of its own, before
    the stage runs; park the case if it is poisoned.

    Nothing is counted when the stage already has its completion marker (a redelivery of
    finished work is harmless and returns at once) or when the step is stale or the case
    not investigating (the stage's own fence reports that); such a delivery must not be
    reported as returned either (:func:`delivery_returned` would reset the count of a
    stage that a parked or paused case is held on).

    Args:
        store: the SQL store.
        key: the step.
        stage: one of ``investigation.constants.STAGES``.
        max_unfinished: see :class:`Delivery`.
        redelivered: see :class:`Delivery`; a redelivery that finds no unfinished
            delivery counted also counts the one that was lost with its transaction.
        async_commit: on PostgreSQL the count commits without waiting for the disk
            (decision 126): it guards against workers that die, which do not undo a
            commit; only a crash of the database server may lose it.

    Returns:
        ``Apart(counted, parked)``: ``parked`` is ``None`` to run the stage, or a
        ``BLOCKED``/``STAGE_POISONED`` outcome (the case was parked in this call) that
        ends the step without running it.

    Raises:
        sqlalchemy.exc.OperationalError: the store is unavailable (the runtime retries).
    """
    for attempt in range(2):
        try:
            with store.session() as s:
                case = Store.lock_case_row(s, key.case_id, async_commit=async_commit)
                if (case is None or case.state != CASE_INVESTIGATING
                        or case.current_revision != key.revision
                        or case.head_seq != key.step_seq - 1):
                    return Apart(False, None)
                marker = s.exec(select(StageRun.id).where(
                    StageRun.case_id == key.case_id, StageRun.revision == key.revision,
                    StageRun.step_seq == key.step_seq, StageRun.stage == stage)).first()
                if marker is not None:
                    return Apart(False, None)
                lost = 0
                if redelivered:
                    unfinished = s.exec(select(StageDelivery.unfinished).where(
                        StageDelivery.case_id == key.case_id,
                        StageDelivery.revision == key.revision,
                        StageDelivery.step_seq == key.step_seq,
                        StageDelivery.stage == stage)).first()
                    lost = 1 if not unfinished else 0
                return Apart(True, count(s, case, key, stage, max_unfinished, lost))
        except IntegrityError as exc:  # pragma: no cover - the upsert does not conflict
            if attempt or not is_unique_violation(exc):
                raise
    raise AssertionError("unreachable")


def delivery_returned(store: Store, key: StepKey, stage: str, counted: bool = True) -> None:
    """A delivery of ``stage`` returned without its marker (a halt or a controlled
    error): it did not kill its worker, so the stage's ``unfinished`` count restarts.

    The counts of a case parked ``STAGE_POISONED`` (blocked, or paused since) are left as
    they are, and such a delivery is not added: they are what status reports as the
    reason, and ``investigate resume`` resets them. (A delivery that :func:`count_apart`
    did not count is never reported here; this guards whatever else returns while the
    case is parked.)

    Args:
        counted: whether the delivery's count was committed; if its transaction was
            rolled back (a controlled error inside it), the delivery is counted here as
            one that returned.
    """
    not_poisoned = ~exists().where(_C.c.id == key.case_id,
                                   _C.c.blocked_reason == BLOCK_STAGE_POISONED)
    with store.session() as s:
        if counted:
            s.execute(update(StageDelivery).where(
                col(StageDelivery.case_id) == key.case_id,
                col(StageDelivery.revision) == key.revision,
                col(StageDelivery.step_seq) == key.step_seq,
                col(StageDelivery.stage) == stage,
                col(StageDelivery.unfinished) > 0, not_poisoned).values(unfinished=0))
            return
        insert = pg_insert if s.get_bind().dialect.name == "postgresql" else sqlite_insert
        now = utcnow()
        s.execute(insert(StageDelivery).values(
            case_id=key.case_id, revision=key.revision, step_seq=key.step_seq, stage=stage,
            deliveries=1, unfinished=0, last_delivered_at=now).on_conflict_do_update(
            index_elements=["case_id", "revision", "step_seq", "stage"],
            set_={"deliveries": StageDelivery.deliveries + 1, "unfinished": 0,
                  "last_delivered_at": now}, where=not_poisoned))


def reset_case(s: Session, case_id: str) -> int:
    """Operator resume: forget every unfinished delivery of the case (the totals stay for
    audit). Returns how many stage counters were reset."""
    res = s.execute(update(StageDelivery).where(
        col(StageDelivery.case_id) == case_id,
        col(StageDelivery.unfinished) > 0).values(unfinished=0))
    return int(res.rowcount)  # type: ignore[attr-defined]


def poisoned_stage(s: Session, case_id: str) -> StageDelivery | None:
    """The stage counter with the most unfinished deliveries of the case (for status)."""
    return s.exec(select(StageDelivery).where(StageDelivery.case_id == case_id)
                  .order_by(col(StageDelivery.unfinished).desc(),
                            col(StageDelivery.step_seq).desc())).first()


def block_for_time_limit(store: Store, key: StepKey, stage: str) -> Outcome | None:
    """Park the case ``BLOCKED`` / ``STAGE_TIME_LIMIT``: a worker time limit stopped
    ``stage`` of step ``key`` and running it again would hit the same limit.

    Returns:
        The ``BLOCKED`` outcome (``details``: ``stage``), or ``None`` when the step is no
        longer the case's next one or the case is not investigating (nothing changed).
    """
    with store.session() as s:
        case = Store.lock_case(s, key.case_id)
        if (case.state != CASE_INVESTIGATING or case.current_revision != key.revision
                or case.head_seq != key.step_seq - 1):
            return None
        case.state, case.blocked_reason = CASE_BLOCKED, BLOCK_STAGE_TIME_LIMIT
        case.last_outcome, case.last_reason = BLOCKED, BLOCK_STAGE_TIME_LIMIT
        case.retry_not_before = None
        case.updated_at = utcnow()
        s.add(case)
    return Outcome(BLOCKED, key.case_id, key.step_seq, BLOCK_STAGE_TIME_LIMIT,
                   details={"stage": stage})


def note_step_error(store: Store, key: StepKey, code: str) -> bool:
    """Record that step ``key`` stopped with the controlled error ``code``: the case's last
    outcome becomes ``ERROR`` with ``code`` as its reason (``status``, ``cases``, the
    report's step in progress). The case stays ``INVESTIGATING``; the recovery sweep
    dispatches it again, and the step's next publication replaces the outcome.

    Returns:
        Whether the row changed: ``False`` when the step is no longer the case's next one,
        the case is not investigating, or the same error is already recorded.
    """
    with store.session() as s:
        case = Store.lock_case(s, key.case_id)
        if (case.state != CASE_INVESTIGATING or case.current_revision != key.revision
                or case.head_seq != key.step_seq - 1
                or (case.last_outcome, case.last_reason) == (STEP_ERROR, code[:64])):
            return False
        case.last_outcome, case.last_reason = STEP_ERROR, code[:64]
        case.updated_at = utcnow()
        s.add(case)
    return True


def last_delivered(s: Session, case_id: str) -> StageDelivery | None:
    """The stage counter of the case's most recent delivery (for status)."""
    return s.exec(select(StageDelivery).where(StageDelivery.case_id == case_id)
                  .order_by(col(StageDelivery.last_delivered_at).desc(),
                            col(StageDelivery.id).desc())).first()
