"""The recovery sweep: re-dispatch every case whose durable state shows pending work.

DESIGN.md "One step, eight stages": the SQL store is the single source of truth and Redis
holds only queue messages and locks, so losing Redis (restarted empty, flushed, failed
over) loses no data; this sweep re-creates the lost dispatches. Seed 000 "Persistence and
recovery": an accepted plan resumes its idempotent steps after a crash.

Pending work means: state ``INVESTIGATING`` (so neither ``BLOCKED`` nor completed) and no
provider backoff still running (``retry_not_before`` unset or passed). Each such case goes
through the normal dispatch path (``workers.tasks.start_dispatch``): a case whose dispatch
is alive holds its lock and is skipped (``LockBusy``); a duplicate dispatch is harmless
anyway because stages are idempotent and fenced in SQL.

Run by ``investigate recover`` and by the ``investigation.recover`` beat task. Long
backoffs are never held as a long ETA: the sweep dispatches them once due. Each sweep
first expires external tests whose stored deadline passed (``docs/async-tests.md``), so
their cases are dispatched in the same sweep.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import redis
from sqlmodel import col, select

from investigation.constants import CASE_INVESTIGATING
from investigation.errors import InvestigationError, LockBusy
from investigation.external_tests import AsyncTestCoordinator
from investigation.loop.outcome import Outcome
from investigation.store.models import CaseRecord
from workers.runtime import Runtime

log = logging.getLogger(__name__)


@dataclass
class SweepReport:
    """What one sweep did, by case id."""

    dispatched: list[str] = field(default_factory=list)
    """Cases whose next step was enqueued."""
    busy: list[str] = field(default_factory=list)
    """Cases whose lock is held: a dispatch is alive (or its lease has not run out)."""
    busy_lease_s: dict[str, int] = field(default_factory=dict)
    """Busy cases -> seconds left of the holder's lease (a live holder renews it; the
    lease of a worker that died runs out, and a later sweep dispatches the case)."""
    busy_holder: dict[str, str] = field(default_factory=dict)
    """Busy cases -> the process holding the lease (``name@host pid N``), where it says."""
    busy_renewed_s_ago: dict[str, float] = field(default_factory=dict)
    """Busy cases -> seconds since the holder took or last renewed the lease."""
    idle: list[str] = field(default_factory=list)
    """Cases that turned out to have no step to run (finished or blocked meanwhile)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Cases whose dispatch failed with a controlled error: case id -> error code."""
    not_due: int = 0
    """Investigating cases still inside a provider backoff (left for a later sweep)."""
    expired_tests: list[str] = field(default_factory=list)
    """``CASE/REQUEST`` of external tests whose deadline passed in this sweep (recorded
    as results without feedback, which resumes their cases: ``docs/async-tests.md``)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the task's result, ``recover --json``)."""
        return asdict(self)


def pending_cases(rt: Runtime, now: datetime | None = None) -> tuple[list[str], int]:
    """Cases with pending work, oldest update first, and the count not yet due.

    Args:
        rt: the process runtime (its store is read).
        now: the sweep's instant (UTC, default now).

    Returns:
        ``(case_ids, not_due)``: investigating cases without a running backoff, and the
        number of investigating cases whose ``retry_not_before`` lies after ``now``.
    """
    now = now or datetime.now(UTC)
    with rt.env.store.session() as s:
        rows = s.exec(select(CaseRecord.id, CaseRecord.retry_not_before)
                      .where(CaseRecord.state == CASE_INVESTIGATING)
                      .order_by(col(CaseRecord.updated_at), col(CaseRecord.id))).all()
    due, not_due = [], 0
    for case_id, not_before in rows:
        if not_before is not None and _aware(not_before) > now:
            not_due += 1
        else:
            due.append(case_id)
    return due, not_due


def sweep(rt: Runtime, now: datetime | None = None) -> SweepReport:
    """Re-dispatch every case with pending work through ``start_dispatch``.

    Args:
        rt: a distributed runtime (Redis locks, the Celery app pointed at its broker).
        now: the sweep's instant (UTC, default now).

    Returns:
        A :class:`SweepReport`. A controlled error of one case (``CASE_*``,
        ``REVISION_NOT_ACCEPTED``) is reported, not raised, so one broken case never
        stops the others' recovery.

    Raises:
        redis.exceptions.RedisError, kombu.exceptions.OperationalError: the broker or the
        lock server is unreachable (nothing can be dispatched; run again later).
        sqlalchemy.exc.SQLAlchemyError: the store is unavailable.
    """
    from workers.tasks import start_dispatch

    report = SweepReport()
    coordinator = AsyncTestCoordinator(rt.env.store, rt.env.feedback_key)
    report.expired_tests = [f"{d['case_id']}/{d['request_id']}"
                            for d in coordinator.expire_due(now)]
    due, report.not_due = pending_cases(rt, now)
    for case_id in due:
        try:
            result = start_dispatch(case_id)
        except LockBusy as exc:
            report.busy.append(case_id)
            if exc.expires_in_s is not None:
                report.busy_lease_s[case_id] = max(1, round(exc.expires_in_s))
            if exc.holder is not None:
                report.busy_holder[case_id] = exc.holder
            if exc.renewed_s_ago is not None:
                report.busy_renewed_s_ago[case_id] = exc.renewed_s_ago
            continue
        except InvestigationError as exc:
            log.error("recovery sweep: case %s cannot be dispatched: %s", case_id, exc)
            report.failed[case_id] = exc.code
            continue
        except redis.exceptions.ResponseError as exc:
            # Redis answered for this case's keys (one of another type, set by hand): the
            # other cases go on (a hostile trial's list stopped the sweep for all).
            log.error("recovery sweep: case %s: Redis refused its lock keys: %s",
                      case_id, exc)
            report.failed[case_id] = "REDIS_KEY_INVALID"
            continue
        if isinstance(result, Outcome):
            report.idle.append(case_id)
        else:
            report.dispatched.append(case_id)
    if report.dispatched or report.failed:
        log.info("recovery sweep: dispatched %d (%s), busy %d, failed %d, not due %d",
                 len(report.dispatched), " ".join(report.dispatched), len(report.busy),
                 len(report.failed), report.not_due)
    return report


def _aware(value: datetime) -> datetime:
    """SQLite returns naive datetimes for UTC columns: make them aware."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
