"""The embedded runtime's driver: one process, each step's Celery chain run locally, no server."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from investigation.constants import CONTINUING, RETRY_PENDING, YIELDED
from investigation.errors import InvestigationError
from investigation.loop.outcome import Outcome
from workers.runtime import Runtime
from workers.tasks import run_embedded_step

log = logging.getLogger(__name__)


def run_case(rt: Runtime, case_id: str, max_steps: int | None = None, wait: bool = True,
             on_step: Callable[[Outcome], None] | None = None) -> Outcome:
    """Run the case until a terminal or blocked outcome (or ``max_steps`` steps).

    A ``RETRY_PENDING`` outcome is returned at once when ``wait`` is False; otherwise this
    CLI process (not a worker) waits until ``retry_not_before`` and continues.

    Raises:
        LockBusy: another dispatch of this case is running (a ``run`` on this machine; with
            a fleet lock also a worker's dispatch anywhere).
        InvestigationError: unsafe input, stale state, exceeded limits, changed policy;
            ``LOCK_LOST`` when another dispatch took the case's lease meanwhile.
        redis.RedisError: a fleet lock whose Redis cannot be reached.
    """
    from investigation.loop.investigator import Investigator

    Investigator(rt.env).next_step(case_id)  # CASE_NOT_FOUND before any lock is taken
    token = rt.lock.acquire(case_id)
    try:
        outcome = _run_steps(rt, case_id, token, max_steps, wait, on_step)
    except BaseException:
        # The error that stopped the run is what the user must see, not a failing release
        # (Redis down as well, say): the lease then runs out by itself.
        try:
            rt.lock.release(case_id, token)
        except Exception as exc:
            log.warning("case %s: the case lock could not be released (%s); its lease runs "
                        "out by itself", case_id, type(exc).__name__)
        raise
    rt.lock.release(case_id, token)
    return outcome


def _run_steps(rt: Runtime, case_id: str, token: str, max_steps: int | None, wait: bool,
               on_step: Callable[[Outcome], None] | None) -> Outcome:
    """:func:`run_case`'s loop, holding the case lock ``token``."""
    from investigation.loop.investigator import Investigator

    steps = 0
    last: Outcome | None = None
    while max_steps is None or steps < max_steps:
        outcome = run_embedded_step(case_id, token)
        if outcome is None:
            nxt = Investigator(rt.env).next_step(case_id)
            assert isinstance(nxt, Outcome)
            return nxt
        if on_step is not None:
            on_step(outcome)
        last = outcome
        if outcome.outcome in CONTINUING:
            steps += 1
            continue
        if outcome.outcome == RETRY_PENDING and wait and outcome.retry_not_before:
            delay = (outcome.retry_not_before - datetime.now(UTC)).total_seconds()
            log.info("case %s: provider backoff, retrying in %.1fs", case_id, delay)
            _wait_out(rt, case_id, token, outcome.retry_not_before)
            continue
        return outcome
    assert last is not None
    return Outcome(YIELDED, case_id, last.step_seq, "MAX_STEPS", hypothesis_id=last.hypothesis_id)


def _wait_out(rt: Runtime, case_id: str, token: str, until: datetime) -> None:
    """Sleep in this CLI process until ``until`` (UTC), keeping the case's lock: a lock
    with a lease (a fleet's, decision 158) is renewed at least every third of it.

    Raises:
        InvestigationError: ``LOCK_LOST`` when another dispatch took the case meanwhile.
    """
    ttl_s = getattr(rt.lock, "ttl_s", None)

    def keep() -> None:
        if not rt.lock.hold(case_id, token):
            raise InvestigationError(
                "LOCK_LOST", f"case {case_id}: another dispatch took the case while this run "
                f"waited out a provider backoff; `investigate status {case_id}` shows it")

    keep()  # the last renewal was at the model call, which may have taken a while
    while (left := (until - datetime.now(UTC)).total_seconds()) > 0:
        time.sleep(left if ttl_s is None else min(left, max(1.0, ttl_s / 3)))
        keep()
