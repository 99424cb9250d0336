"""One Celery task per stage, chained per step, plus dispatch and advance.

A step is the chain ``build_context | llm_call | validate | persist_plan |
settle_reserve | execute_tool | record_evidence | publish | advance``. Every task
takes and returns a small JSON payload of ids::

    {"case_id", "revision", "step_seq", "token", "steps_left", "max_steps", "mode", "halt"}

A stage task renews the case lock, runs ``Stages.run`` (idempotent and fenced in SQL)
and, when the step ends early (``RETRY_PENDING``, ``BLOCKED``), sets ``halt`` so the
remaining stages pass the payload through. ``advance`` decides what follows:
the next step (lock kept), a yield (lock released, the case re-enqueued behind
others), a countdown for ``RETRY_PENDING`` (never a sleeping worker), or the end.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from celery import chain
from celery.signals import worker_process_init
from sqlalchemy.exc import OperationalError

from investigation.constants import (
    BLOCKED,
    COMPLETED,
    CONTINUING,
    RETRY_PENDING,
    STAGES,
    TASK_PREFIX,
    YIELDED,
)
from investigation.errors import InvestigationError, LockBusy, StaleStateError
from investigation.loop.deliveries import Delivery
from investigation.loop.investigator import Investigator
from investigation.loop.outcome import Outcome, StepKey
from workers import runtime
from workers.celery_app import app

log = logging.getLogger(__name__)

#: Countdown for transient store failures inside a stage (seconds, doubled per retry).
STORE_RETRY_COUNTDOWN_S = 2
STORE_MAX_RETRIES = 8


@worker_process_init.connect
def _fresh_process(**_: Any) -> None:
    """A prefork child never shares the parent's connections: build its own runtime."""
    runtime.configure(None)


def _halt(payload: dict[str, Any], outcome: str, reason: str | None,
          **extra: Any) -> dict[str, Any]:
    payload["halt"] = {"outcome": outcome, "case_id": payload["case_id"],
                       "step_seq": payload["step_seq"], "reason": reason,
                       "retry_not_before": None, "hypothesis_id": None, "details": extra}
    return payload


def _run_stage(task: Any, payload: dict[str, Any], stage: str) -> dict[str, Any]:
    if payload.get("halt"):
        return payload
    rt = runtime.current()
    case_id, token = payload["case_id"], payload["token"]
    if not rt.lock.hold(case_id, token):
        log.warning("case %s: lock lost before %s of step %s; stopping this chain",
                    case_id, stage, payload["step_seq"])
        return _halt(payload, "LOCK_LOST", "LOCK_LOST")
    key = StepKey(case_id, payload["revision"], payload["step_seq"])
    # The delivery is counted by the stage (loop.deliveries): in its own transaction, or
    # apart before it when an earlier delivery may have died (the broker's redelivered
    # flag; a process meeting the case first).
    delivery = Delivery(rt.settings.max_stage_deliveries,
                        redelivered=bool((task.request.delivery_info or {}).get("redelivered")))
    try:
        result = rt.stages.run(stage, key, delivery)
    except StaleStateError as exc:
        log.info("case %s step %s %s: stale (%s)", case_id, key.step_seq, stage, exc.message)
        return _halt(payload, "STALE", "STALE_STATE")
    except InvestigationError as exc:
        # The embedded CLI reports the error itself; a worker's log is the operator's view.
        log.log(logging.DEBUG if payload.get("mode") == "embedded" else logging.ERROR,
                "case %s step %s %s failed: %s", case_id, key.step_seq, stage, exc)
        return _halt(payload, "ERROR", exc.code, message=exc.message)
    except OperationalError as exc:
        # The store is unreachable or busy: retry this stage later (countdown, no sleep).
        if task.request.retries >= STORE_MAX_RETRIES:
            # Give up through ``advance`` with the lock released: no orphan lock holds the
            # case until its lease runs out.
            _release_distributed(rt, payload)
            log.error("case %s step %s %s: store unavailable after %s retries: %s", case_id,
                      key.step_seq, stage, STORE_MAX_RETRIES, exc)
            return _halt(payload, "ERROR", "STORE_UNAVAILABLE",
                         message=f"the store failed {STORE_MAX_RETRIES + 1} times in {stage}")
        countdown = STORE_RETRY_COUNTDOWN_S * 2 ** task.request.retries
        raise task.retry(exc=exc, countdown=min(countdown, rt.settings.max_countdown_s),
                         max_retries=STORE_MAX_RETRIES) from exc
    except Exception:
        _release_distributed(rt, payload)  # a failed chain never keeps the case locked
        raise
    if result.halt is not None:
        payload["halt"] = result.halt.to_dict()
    return payload


def _release_distributed(rt: runtime.Runtime, payload: dict[str, Any]) -> None:
    """Release a distributed chain's lock (only if still its own) when the chain ends early.

    The embedded driver owns its file lock across steps and releases it itself.
    """
    if payload.get("mode") != "embedded":
        rt.lock.release(payload["case_id"], payload["token"])


def _stage_task(stage: str) -> Any:
    @app.task(name=f"{TASK_PREFIX}{stage}", bind=True)
    def task(self: Any, payload: dict[str, Any]) -> dict[str, Any]:
        return _run_stage(self, payload, stage)

    task.__doc__ = f"Stage ``{stage}`` of one investigation step (payload of ids in and out)."
    return task


STAGE_TASKS = {stage: _stage_task(stage) for stage in STAGES}


def step_chain(payload: dict[str, Any]) -> Any:
    """The Celery chain of one step: eight stages, then ``advance``."""
    first, *rest = STAGES
    return chain(STAGE_TASKS[first].s(payload), *(STAGE_TASKS[s].s() for s in rest),
                 advance.s())


def new_payload(case_id: str, token: str, steps_left: int, mode: str,
                max_steps: int | None = None) -> dict[str, Any] | None:
    """Payload for the case's next step, or ``None`` if it has no eligible step.

    ``max_steps`` is the dispatch's explicit step limit, kept so that the dispatch that
    follows a yield uses the same limit.
    """
    key = Investigator(runtime.current().env).next_step(case_id)
    if isinstance(key, Outcome):
        return None
    return {**key.to_dict(), "token": token, "steps_left": steps_left, "mode": mode,
            "max_steps": max_steps, "halt": None}


def start_dispatch(case_id: str, max_steps: int | None = None) -> str | Outcome:
    """Take the case lock (never blocking) and enqueue the first step of a dispatch.

    Returns:
        The lock token of this dispatch, or the case's outcome (``COMPLETED``,
        ``BLOCKED``) when it has no step to run; nothing is enqueued then.

    Raises:
        LockBusy: another dispatch of the case holds the lock.
        InvestigationError: ``CASE_NOT_FOUND`` and similar.
    """
    rt = runtime.current()
    token = rt.lock.acquire(case_id)
    try:
        steps = max_steps or rt.env.config.loop.max_steps_per_dispatch
        payload = new_payload(case_id, token, steps, "distributed", max_steps)
        if payload is None:
            rt.lock.release(case_id, token)
            outcome = Investigator(rt.env).next_step(case_id)
            assert isinstance(outcome, Outcome)
            return outcome
        step_chain(payload).apply_async()
    except BaseException:
        rt.lock.release(case_id, token)
        raise
    return token


@app.task(name=f"{TASK_PREFIX}dispatch", bind=True)
def dispatch(self: Any, case_id: str, max_steps: int | None = None) -> dict[str, Any]:
    """Worker-side dispatch (re-enqueued yields, due retries, upstream systems)."""
    try:
        start_dispatch(case_id, max_steps)
    except LockBusy:
        log.info("case %s: dispatch skipped, another dispatch holds the lock", case_id)
        return {"case_id": case_id, "outcome": "LOCK_BUSY"}
    return {"case_id": case_id, "outcome": "DISPATCHED"}


@app.task(name=f"{TASK_PREFIX}advance", bind=True)
def advance(self: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """After a step: continue, yield, schedule a retry countdown, or stop."""
    rt = runtime.current()
    halt = payload.get("halt") or {"outcome": "ERROR", "reason": "NO_OUTCOME"}
    outcome, case_id, token = halt["outcome"], payload["case_id"], payload["token"]
    log.info("case %s step %s: %s %s", case_id, payload["step_seq"], outcome,
             halt.get("reason") or "")
    if payload.get("mode") == "embedded" or outcome in ("LOCK_LOST",):
        return payload
    if outcome in CONTINUING:
        steps_left = int(payload["steps_left"]) - 1
        if steps_left > 0 and rt.lock.hold(case_id, token):
            nxt = new_payload(case_id, token, steps_left, "distributed",
                              payload.get("max_steps"))
            if nxt is not None:
                step_chain(nxt).apply_async()
                return payload
        rt.lock.release(case_id, token)
        dispatch.apply_async((case_id, payload.get("max_steps")))  # behind other cases
        payload["halt"]["outcome"] = YIELDED if steps_left <= 0 else outcome
        return payload
    rt.lock.release(case_id, token)
    if outcome == RETRY_PENDING and halt.get("retry_not_before"):
        due = datetime.fromisoformat(halt["retry_not_before"])
        wait_s = max(0.0, (due - datetime.now(UTC)).total_seconds())
        if wait_s <= rt.settings.max_countdown_s:
            dispatch.apply_async((case_id, payload.get("max_steps")), countdown=wait_s)
        else:
            # Never a long ETA (it would outlive the visibility timeout and be delivered
            # twice): retry_not_before is durable, the recovery sweep dispatches when due.
            log.info("case %s: backoff until %s is longer than INVESTIGATE_MAX_COUNTDOWN_S; "
                     "the recovery sweep will dispatch it", case_id, halt["retry_not_before"])
    elif outcome not in (BLOCKED, COMPLETED):
        log.warning("case %s: dispatch ended with %s", case_id, halt)
    return payload


def run_embedded_step(case_id: str, token: str) -> Outcome | None:
    """Run one step's chain in process (``chain.apply()``); ``None`` if no step is eligible."""
    payload = new_payload(case_id, token, 1, "embedded")
    if payload is None:
        return None
    result = step_chain(payload).apply().get()
    halt = result.get("halt")
    if halt is None:
        raise InvestigationError("STAGE_ORDER", "the step chain ended without an outcome")
    if halt["outcome"] in ("ERROR", "STALE", "LOCK_LOST"):
        raise InvestigationError(halt["reason"] or halt["outcome"],
                                 (halt.get("details") or {}).get("message")
                                 or f"step {payload['step_seq']} stopped: {halt['outcome']}")
    return Outcome.from_dict(halt)


@app.task(name=f"{TASK_PREFIX}recover", bind=True)
def recover(self: Any) -> dict[str, Any]:
    """The periodic recovery sweep (beat): re-dispatch every case with pending work.

    Returns ``{"dispatched": [...], "busy": [...], "not_due": n, "failed": [...]}``
    (case ids), see ``workers.recovery.sweep``.
    """
    from workers.recovery import sweep

    report = sweep(runtime.current())
    return report.to_dict()
