"""One Celery task per stage, chained per step, plus dispatch and advance.

A step is the chain ``build_context | llm_call | validate | persist_plan |
settle_reserve | execute_tool | record_evidence | publish | advance``. Every task
takes and returns a small JSON payload of ids::

    {"case_id", "revision", "step_seq", "steps_left", "max_steps", "mode", "halt"}

and the dispatch's lock token as the keyword argument ``token``, bound to every
signature of the chain. The token never appears in a payload, a result or a log line:
Flower and the worker log show the tasks through ``argsrepr``/``kwargsrepr``
(``case=C rev=R step=N stage=S`` and the token's first 8 characters). A payload that
still carries ``token`` (enqueued by an older version) is accepted.

A stage task renews the case lock (``llm_call`` and ``execute_tool``, the stages with an
external effect, always in Redis; the others with ``CaseLock.renew``, no round trip when
this process renewed the same lease less than 10 s ago), runs ``Stages.run`` (idempotent
and fenced in SQL) and, when the step ends early (``RETRY_PENDING``, ``BLOCKED``), sets
``halt`` so the remaining stages pass the payload through. ``advance`` decides what follows:
the next step (lock kept), a yield (lock released, the case re-enqueued behind
others), a countdown for ``RETRY_PENDING`` (never a sleeping worker), or the end.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections import OrderedDict
from datetime import UTC, datetime
from typing import Any

from celery import Task, chain
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded
from celery.signals import worker_process_init
from celery.worker import state as worker_state
from celery.worker.request import Request
from sqlalchemy.exc import OperationalError

from investigation.constants import (
    BLOCK_STAGE_TIME_LIMIT,
    BLOCKED,
    CASE_ID_RULE,
    COMPLETED,
    CONTINUING,
    DISPATCH_CONTRACT_VERSION,
    DISPATCH_TASK,
    RETRY_PENDING,
    SAFE_CASE_ID,
    STAGES,
    STEP_ERROR,
    TASK_PREFIX,
    YIELDED,
)
from investigation.errors import InvestigationError, LockBusy, StaleStateError
from investigation.llm import gateway as llm_gateway
from investigation.llm.types import PROVIDER_CALL_IN_FLIGHT
from investigation.loop import deliveries
from investigation.loop.deliveries import Delivery
from investigation.loop.investigator import Investigator
from investigation.loop.outcome import Outcome, StepKey
from investigation.loop.stages import Stages
from investigation.text_safety import escape_text
from workers import logs, runtime
from workers import metrics as engine_metrics
from workers.celery_app import app
from workers.locks import RedisCaseLock
from workers.settings import load_settings

log = logging.getLogger(__name__)
# A soft time limit inside a model call stops the stage (STAGE_TIME_LIMIT); the gateway
# would otherwise take it for the provider adapter failing.
llm_gateway.pass_through(SoftTimeLimitExceeded)


#: Countdown for transient store failures inside a stage (seconds, doubled per retry).
STORE_RETRY_COUNTDOWN_S = 2
STORE_MAX_RETRIES = 8


#: The signature of each task class's ``run``, computed at its first message.
_RUN_SIGNATURES: dict[type, inspect.Signature] = {}


class CheckedTask(Task):  # type: ignore[misc]
    """A task whose message arguments are bound to its signature before it runs.

    Anyone with access to the broker can send a task by name with any ``args`` and
    ``kwargs``; a message with missing, surplus, repeated or unknown arguments is
    refused with :attr:`refusal_code` and one error line (no traceback, no retry),
    returning ``{"outcome": "REFUSED", "code": ...}``. The line names the keyword
    arguments, never their values (a stage task's ``token`` is a lock token).
    """

    refusal_code = "PAYLOAD_INVALID"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        refused = self.refuse(args, kwargs)
        if refused is not None:
            # A refused message's chain and callbacks do not go on: Celery would send the
            # next task with the refusal as its payload (a hostile re-trial's immutable
            # advance then failed with a traceback).
            self.request.chain = self.request.callbacks = None
            return refused
        return super().__call__(*args, **kwargs)

    def refuse(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The refusal of a message that does not bind to the task's signature, or ``None``."""
        signature = _RUN_SIGNATURES.get(type(self))
        if signature is None:  # one per task class (its ``run`` never changes)
            signature = _RUN_SIGNATURES[type(self)] = inspect.signature(self.run)
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            names = ", ".join(escape_text(str(k))[:40] for k in list(kwargs)[:8])
            log.error("%s refused: %s: message with %d positional argument(s) and keyword "
                      "argument(s) [%s] does not fit the task (%s); nothing was run",
                      self.name, self.refusal_code, len(args), names,
                      escape_text(str(exc))[:200])
            return {"case_id": None, "outcome": "REFUSED", "code": self.refusal_code}
        return None


class StageRequest(Request):  # type: ignore[misc]
    """The worker's request of a stage or ``advance`` task.

    Celery enforces a hard time limit (``--time-limit``) in the worker's main process: it
    kills the child that ran the task and calls :meth:`on_timeout` there. This request
    then hands the step on with a :func:`time_limit` message (see
    :func:`hand_over_hard_limit`). A soft limit is raised inside the task and handled
    there (:func:`_time_limited`). Neither needs an error callback on the chain's
    messages, which keeps each message of a step's chain near a bare chain's size
    (decision 133).
    """

    def _log_context(self) -> Any:
        """The step's log context for Celery's own lines about this request in the
        worker's main process (a child killed under it, a time limit): they named only
        the task id (a fleet trial grepped a case id and missed them). Not ``_context``:
        Celery's ``Request`` has a property of that name, which its handlers use."""
        return logs.step_context(**logs.context_of(self.argsrepr, self.task.name, self.id))

    def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                   return_ok: bool = False) -> None:
        with self._log_context():
            super().on_failure(exc_info, send_failed_event=send_failed_event,
                               return_ok=return_ok)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        with self._log_context():
            self._on_timeout(soft, timeout)

    def _on_timeout(self, soft: bool, timeout: float) -> None:
        super().on_timeout(soft, timeout)
        if not soft and not worker_state.should_terminate:  # as Celery: not at cold shutdown
            try:
                hand_over_hard_limit(self.id, self.task.name, self.args, self.kwargs,
                                     timeout)
            except Exception:  # the broker is unreachable: never break the worker's timer
                log.exception("%s[%s]: the hard time limit could not be handed on; the case "
                              "stays locked until its lease runs out, then the recovery "
                              "sweep dispatches it", self.task.name, self.id)


class StageTask(CheckedTask):
    """A stage of a step's chain, or ``advance``: a :class:`CheckedTask` whose worker
    request hands a hard time limit on (:class:`StageRequest`), and whose message must
    carry a payload of the step's ids and a lock token (:func:`payload_problem`), else it
    is refused with ``PAYLOAD_INVALID`` in one line."""

    Request = StageRequest

    def refuse(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        refused = super().refuse(args, kwargs)
        if refused is not None:
            return refused
        payload = args[0] if args else kwargs.get("payload")
        problem = payload_problem(payload, kwargs.get("token"))
        if problem is None and isinstance(payload, dict) \
                and self.name == f"{TASK_PREFIX}advance":
            problem = _advance_problem(payload)
            if problem is not None and not self.request.is_eager:
                # As a failing advance does: the lock its token holds (if it does) is
                # released at once, not kept until the lease runs out.
                _release_chain_lock(payload, _token(payload, kwargs.get("token")))
        if problem is None and isinstance(payload, dict):
            # A stage message with a token of the sender's took the case's free lock for a
            # whole lease, and LOCK_BUSY then named a worker that ran nothing (a hostile
            # upstream trial): sent alone, or chained to an advance that never ran.
            problem = _chain_problem(self, _token_given(payload, kwargs.get("token")))
        if problem is None:
            return None
        log.error("%s refused: %s: %s; nothing was run", self.name, self.refusal_code,
                  problem)
        return {"case_id": None, "outcome": "REFUSED", "code": self.refusal_code}


def _advance_problem(payload: dict[str, Any]) -> str | None:
    """What an ``advance`` payload lacks beyond :func:`payload_problem`'s, or ``None``:
    ``steps_left`` a count, ``halt`` (when set) an object with an ``outcome`` text,
    ``details`` an object if any and, if it has one, a ``retry_not_before`` time with its
    UTC offset. A forged payload without them ended in a KeyError, ValueError, TypeError
    or AttributeError with a traceback (two hostile upstream trials)."""
    steps_left = payload.get("steps_left")
    if type(steps_left) is not int or steps_left < 0:
        return f"payload steps_left is {escape_text(repr(steps_left))[:60]}, not a count"
    halt = payload.get("halt")
    if halt is None:
        return None
    if not isinstance(halt.get("outcome"), str):
        return "payload halt has no outcome"
    if halt.get("details") is not None and not isinstance(halt.get("details"), dict):
        return "payload halt details are not an object"
    due = halt.get("retry_not_before")
    if due is not None:
        try:
            aware = datetime.fromisoformat(due).tzinfo is not None
        except (TypeError, ValueError):
            aware = False
        if not aware:
            return (f"payload halt retry_not_before {escape_text(repr(due))[:60]} is no "
                    "time with its UTC offset")
    return None


#: The options of a signature in a step's chain, as ``step_chain`` sends them.
_CHAIN_OPTIONS = frozenset({"argsrepr", "kwargsrepr", "task_id", "reply_to"})


def _chain_problem(task: Any, token: Any) -> str | None:
    """What makes a stage message's chain no chain the engine sends, or ``None``: the rest
    of its step's stages in order, then ``advance`` (Celery keeps them last first), each a
    plain signature of no arguments but the same lock ``token`` (or none: an older chain
    carried it in the payload), with no options but its ``argsrepr``, ``kwargsrepr``,
    ``task_id`` and ``reply_to``: no queue, countdown, callback or immutability by which
    the ``advance`` that ends the dispatch and releases the lock would not run. ``None``
    for ``advance`` and for a task run in process (``chain.apply()`` hands no chain on).
    """
    request = task.request
    stage = task.name.removeprefix(TASK_PREFIX)
    if stage not in STAGES or request.is_eager:
        return None
    expected = [f"{TASK_PREFIX}{name}" for name in
                (*STAGES[STAGES.index(stage) + 1:], "advance")][::-1]
    chain = request.chain
    if not isinstance(chain, list) or [sig.get("task") if isinstance(sig, dict) else None
                                       for sig in chain] != expected:
        return ("a stage message whose chain is not the rest of its step ending in advance "
                "(the engine sends a step's stages as one chain)")
    for sig in chain:
        kwargs, options = sig.get("kwargs"), sig.get("options")
        if sig.get("immutable") or sig.get("subtask_type") or sig.get("args") \
                or not isinstance(kwargs, dict) or set(kwargs) - {"token"} \
                or kwargs.get("token", token) != token or not isinstance(options, dict) \
                or set(options) - _CHAIN_OPTIONS:
            return (f"a stage message whose chain's {escape_text(str(sig.get('task')))} "
                    "is no signature the engine sends (arguments, options or token)")
    return None


#: The ids every stage payload carries, and their JSON types (``bool`` is not an ``int``).
_PAYLOAD_IDS: tuple[tuple[str, type], ...] = (("case_id", str), ("revision", int),
                                              ("step_seq", int))


def payload_problem(payload: Any, token: Any) -> str | None:
    """What makes a stage task's message unusable, or ``None``: the payload must be an
    object with ``case_id`` (a case id), ``revision`` and ``step_seq`` (integers) and
    ``halt`` null or an object, and a lock token must come with it (the ``token``
    keyword, or an older payload's ``token``)."""
    if not isinstance(payload, dict):
        return f"the payload is {type(payload).__name__}, not an object of the step's ids"
    for name, kind in _PAYLOAD_IDS:
        value = payload.get(name)
        if type(value) is not kind:
            return f"payload {name} is {escape_text(repr(value))[:60]}, not a {kind.__name__}"
    if not SAFE_CASE_ID.fullmatch(payload["case_id"]):
        return f"payload case_id {escape_text(repr(payload['case_id']))[:80]} is not a case id"
    if payload.get("halt") is not None and not isinstance(payload.get("halt"), dict):
        return "payload halt is neither null nor an object"
    if not _token_given(payload, token):
        return "no lock token"
    return None


def _is_version_1(contract: Any) -> bool:
    """Whether ``contract`` is the integer 1 (JSON's ``true`` and ``1.0`` are not)."""
    return type(contract) is int and contract == DISPATCH_CONTRACT_VERSION


class DispatchTask(CheckedTask):
    """``investigation.dispatch`` (``docs/message-contract.md``): a message of another
    ``contract`` version is refused as such (``CONTRACT_UNSUPPORTED``) before its
    arguments are checked; a version-1 message must be ``args`` ``[case_id]`` or
    ``[case_id, max_steps]`` with no keyword but ``contract``, else it is
    ``DISPATCH_INVALID`` (Python's binding would take a third positional as the contract
    and ``max_steps`` or ``case_id`` as keywords, which the contract does not allow)."""

    refusal_code = "DISPATCH_INVALID"

    def refuse(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        contract = kwargs.get("contract", DISPATCH_CONTRACT_VERSION)
        if not _is_version_1(contract):
            case_id = args[0] if args else kwargs.get("case_id")
            return _contract_unsupported(case_id, contract)
        others = [str(k) for k in kwargs if k != "contract"]
        if not 1 <= len(args) <= 2 or others:
            names = ", ".join(escape_text(k)[:40] for k in others[:8])
            log.error("%s refused: %s: message with %d positional argument(s) and keyword "
                      "argument(s) [%s]; version 1 takes args [case_id] or [case_id, "
                      "max_steps] and no keyword but contract; nothing was run", self.name,
                      self.refusal_code, len(args), names)
            first = args[0] if args else None
            return {"case_id": first if isinstance(first, str) and
                    SAFE_CASE_ID.fullmatch(first) else None,
                    "outcome": "REFUSED", "code": self.refusal_code,
                    "message": f"a message with {len(args)} positional argument(s) and "
                               f"keyword argument(s) [{names}]; version 1 takes args "
                               "[case_id] or [case_id, max_steps] and no keyword but "
                               "contract"}
        return super().refuse(args, kwargs)


def _contract_unsupported(case_id: Any, contract: Any) -> dict[str, Any]:
    log.error("case %s: dispatch message of contract version %s refused; this worker "
              "speaks version %s (docs/message-contract.md)",
              escape_text(repr(case_id))[:100], escape_text(repr(contract))[:40],
              DISPATCH_CONTRACT_VERSION)
    return {"outcome": "CONTRACT_UNSUPPORTED",
            "case_id": case_id if isinstance(case_id, str) else None,
            "contract": contract if type(contract) in (int, str) else repr(contract)[:40]}


@worker_process_init.connect
def _fresh_process(**_: Any) -> None:
    """A prefork child never shares the parent's connections: build its own runtime."""
    runtime.configure(None)


def _halt(payload: dict[str, Any], outcome: str, reason: str | None,
          **extra: Any) -> dict[str, Any]:
    payload["halt"] = {"outcome": outcome, "reason": reason, "case_id": payload["case_id"],
                       "step_seq": payload["step_seq"], "retry_not_before": None,
                       "hypothesis_id": None, "details": extra}
    return payload


def _token_given(payload: dict[str, Any], token: Any) -> Any:
    """The chain's lock token as the message carries it: the keyword argument, or an older
    payload's ``token`` (an older chain passes it on in the payload); falsy if neither."""
    return token or payload.get("token")


def _token(payload: dict[str, Any], token: str | None) -> str:
    """The chain's lock token (:func:`_token_given`).

    Raises:
        InvestigationError: ``PAYLOAD_INVALID`` when the message carries none.
    """
    value = _token_given(payload, token)
    if not value:
        raise InvestigationError("PAYLOAD_INVALID", "a stage task came without a lock token")
    return str(value)


def describe(payload: dict[str, Any], stage: str | None = None) -> str:
    """What Flower and the worker log show as a task's arguments (``argsrepr``)."""
    return (f"case={payload['case_id']} rev={payload['revision']} step={payload['step_seq']}"
            + (f" stage={stage}" if stage else ""))


def _run_stage(task: Any, payload: dict[str, Any], stage: str,
               token: str | None = None) -> dict[str, Any]:
    token = _token(payload, token)
    if payload.get("halt"):
        return payload
    with logs.step_context(case_id=payload["case_id"], step=payload["step_seq"], stage=stage,
                           task_id=task.request.id,
                           worker=getattr(task.request, "hostname", None)):
        gauge = engine_metrics.stage_running(stage)
        gauge.inc()
        started, since = time.monotonic(), datetime.now(UTC)
        result = "error"
        try:
            payload, result = _timed_stage(task, payload, stage, token, since)
        finally:
            gauge.dec()
            engine_metrics.stage_timed(stage, result, time.monotonic() - started)
    return _halt_first(payload)


def _halt_first(payload: dict[str, Any]) -> dict[str, Any]:
    """The payload with ``halt`` first: a task's result in Flower's list starts with the
    step's outcome and reason (``{'halt': {'outcome': 'BLOCKED', 'reason': ...}, ...}``)."""
    return {"halt": payload.get("halt"), **payload}


def _timed_stage(task: Any, payload: dict[str, Any], stage: str, token: str,
                 since: datetime) -> tuple[dict[str, Any], str]:
    """Run the stage; returns the payload and the metrics' result label."""
    case_id = payload["case_id"]
    try:
        rt = runtime.current()
    except OperationalError as exc:
        # This process could not reach the store to build its runtime: the stage is
        # retried later, as when a running stage meets an unreachable store.
        return _store_unavailable(task, payload, stage, token, exc, None), "error"
    except Exception:
        # A process that cannot build its runtime (a broken policy file, a store at
        # another schema) never keeps the case locked until the lease runs out: the
        # recovery sweep dispatches the case again, to any worker.
        _release_without_runtime(payload, token)
        raise
    # A stage with an external effect (a model call, a query) always asks Redis; the others
    # may rely on this process's own renewal moments ago (decision 122).
    renew = rt.lock.hold if stage in Stages.EFFECT_STAGES else rt.lock.renew
    if not renew(case_id, token):
        log.warning("case %s: lock %s lost before %s of step %s; stopping this chain",
                    case_id, logs.short_token(token), stage, payload["step_seq"])
        return _halt(payload, "LOCK_LOST", "LOCK_LOST"), "halt"
    key = StepKey(case_id, payload["revision"], payload["step_seq"])
    # The delivery is counted by the stage (loop.deliveries): in its own transaction, or
    # apart before it when an earlier delivery may have died (the broker's redelivered
    # flag; a process meeting the case first).
    delivery = Delivery(rt.settings.max_stage_deliveries,
                        redelivered=bool((task.request.delivery_info or {}).get("redelivered")))
    try:
        result = rt.stages.run(stage, key, delivery)
    except SoftTimeLimitExceeded:
        payload = _time_limited(rt, payload, stage, "soft", None)
        if (payload.get("halt") or {}).get("outcome") == "RECORDED":
            payload["halt"] = None  # the stage had finished: the chain goes on
        return payload, "time_limit"
    except StaleStateError as exc:
        log.info("case %s step %s %s: stale (%s)", case_id, key.step_seq, stage, exc.message)
        return _halt(payload, "STALE", "STALE_STATE"), "halt"
    except InvestigationError as exc:
        # The embedded CLI reports the error itself; a worker's log is the operator's view.
        log.log(logging.DEBUG if payload.get("mode") == "embedded" else logging.ERROR,
                "case %s step %s %s failed: %s", case_id, key.step_seq, stage, exc)
        return _halt(payload, "ERROR", exc.code, message=exc.message, stage=stage), "error"
    except OperationalError as exc:
        return _store_unavailable(task, payload, stage, token, exc, rt), "error"
    except Exception:
        _release_distributed(rt, payload, token)  # a failed chain never keeps the case locked
        raise
    if stage == "llm_call":
        engine_metrics.record_model_calls(rt.env.store, case_id, key.revision, key.step_seq,
                                          since)
    elif stage == "settle_reserve" and result.fresh:
        engine_metrics.record_settlement(result.output)
    if result.halt is not None:
        payload["halt"] = _outcome_first(result.halt.to_dict())
        return payload, "halt"
    return payload, "ok"


def _store_unavailable(task: Any, payload: dict[str, Any], stage: str, token: str,
                       exc: OperationalError, rt: runtime.Runtime | None) -> dict[str, Any]:
    """The store is unreachable or busy: retry this stage later (countdown, no sleep);
    after ``STORE_MAX_RETRIES`` the step ends ``ERROR`` / ``STORE_UNAVAILABLE`` through
    ``advance`` with the lock released (no orphan lock holds the case until its lease
    runs out). ``rt`` is ``None`` when this process could not build its runtime.

    Raises:
        celery.exceptions.Retry: the retry (``task.retry``).
    """
    if task.request.retries >= STORE_MAX_RETRIES:
        _release_chain_lock(payload, token, rt)
        log.error("case %s step %s %s: store unavailable after %s retries: %s",
                  payload["case_id"], payload["step_seq"], stage, STORE_MAX_RETRIES, exc)
        return _halt(payload, "ERROR", "STORE_UNAVAILABLE",
                     message=f"the store failed {STORE_MAX_RETRIES + 1} times in {stage}")
    raise _retry_later(task, exc, rt) from exc


def _retry_later(task: Any, exc: BaseException, rt: runtime.Runtime | None) -> Exception:
    """``task.retry`` after a store failure: a countdown doubling from
    :data:`STORE_RETRY_COUNTDOWN_S` (never a sleeping worker), at most
    :data:`STORE_MAX_RETRIES` times. The retried message keeps the task's ``argsrepr``
    and ``kwargsrepr``: Celery's retry sends neither, so Flower showed a retried stage's
    whole lock token and its log lines lost their case, step and stage (a fleet trial).
    Returns the ``Retry`` to raise (``task.retry`` raises it itself; the caller's
    ``raise`` makes that plain)."""
    settings = rt.settings if rt is not None else load_settings()
    countdown = STORE_RETRY_COUNTDOWN_S * 2 ** task.request.retries
    shown = {name: value for name in ("argsrepr", "kwargsrepr")
             if isinstance(value := getattr(task.request, name, None), str)}
    return task.retry(exc=exc, countdown=min(countdown, settings.max_countdown_s),  # type: ignore[no-any-return]
                      max_retries=STORE_MAX_RETRIES, **shown)


def _release_chain_lock(payload: dict[str, Any], token: str,
                        rt: runtime.Runtime | None = None) -> None:
    """Release this chain's case lock through ``rt`` (default: the process runtime), or
    from the settings alone when this process cannot build its runtime."""
    if rt is None:
        try:
            rt = runtime.current()
        except Exception:
            _release_without_runtime(payload, token)
            return
    _release_distributed(rt, payload, token)


def _release_without_runtime(payload: dict[str, Any], token: str) -> None:
    """Release the case lock of this chain from the settings alone (Redis, no store):
    what ``_release_distributed`` does for a process whose runtime could not be built."""
    try:
        settings = load_settings()
        lock = RedisCaseLock.from_url(settings.effective_redis_url, settings.lock_ttl_s,
                                      runtime.released_lease_s(settings))
        lock.release(payload["case_id"], token)
    except Exception as exc:  # the lease still runs out; say why it was not released
        log.error("case %s: lock not released (%s); it frees itself when its lease runs "
                  "out", payload.get("case_id"), exc)
    else:
        log.error("case %s step %s: this worker process cannot build its runtime; the "
                  "case's lock was released for the recovery sweep to dispatch it again",
                  payload.get("case_id"), payload.get("step_seq"))


def _outcome_first(halt: dict[str, Any]) -> dict[str, Any]:
    """The halt with ``outcome`` and ``reason`` first, so a task's result in Flower and
    the log starts with them (a search for BLOCKED finds the step that blocked)."""
    return {"outcome": halt["outcome"], "reason": halt.get("reason"), **halt}


def _release_distributed(rt: runtime.Runtime, payload: dict[str, Any], token: str) -> None:
    """Release a distributed chain's lock (only if still its own) when the chain ends early.

    The embedded driver owns its file lock across steps and releases it itself.
    """
    if payload.get("mode") != "embedded":
        rt.lock.release(payload["case_id"], token)


def _time_limited(rt: runtime.Runtime, payload: dict[str, Any], stage: str, kind: str,
                  limit_s: float | None) -> dict[str, Any]:
    """A worker time limit stopped ``stage``: record it once, as what it is.

    It is no worker crash, so it never counts towards ``STAGE_POISONED``. A query's
    ``execute_tool`` is recorded as a failed result with the code ``STAGE_TIME_LIMIT``
    and the step goes on (the model sees the failure and can ask for less); any other
    stage parks the case ``BLOCKED`` / ``STAGE_TIME_LIMIT`` (running it again would hit
    the same limit): raise the limit, then ``investigate resume``.

    Returns:
        The payload, with ``halt`` set unless the chain goes on (``{"outcome":
        "RECORDED"}`` when the stage had finished after all: the caller re-dispatches).
    """
    key = StepKey(payload["case_id"], payload["revision"], payload["step_seq"])
    limit = f"{limit_s:g} s" if limit_s else "configured"
    log.error("case %s step %s %s: stopped by the worker's %s time limit (%s)", key.case_id,
              key.step_seq, stage, kind, limit)
    try:
        deliveries.delivery_returned(rt.env.store, key, stage)
        recorded = Stages(rt.env).record_tool_stopped(
            key, BLOCK_STAGE_TIME_LIMIT,
            f"the worker's {kind} time limit ({limit}) stopped this query before it "
            "finished; ask for less (a narrower query or pattern)",
        ) if stage == "execute_tool" else False
        if recorded is not False:
            payload["halt"] = None if recorded else {"outcome": "RECORDED"}
            return payload
        outcome = deliveries.block_for_time_limit(rt.env.store, key, stage)
    except StaleStateError:
        return _halt(payload, "STALE", "STALE_STATE")
    if outcome is None:
        return _halt(payload, "STALE", "STALE_STATE")
    log.error("case %s: parked %s at %s of step %s; raise the worker's time limit "
              "(--soft-time-limit/--time-limit), then `investigate resume %s`", key.case_id,
              BLOCK_STAGE_TIME_LIMIT, stage, key.step_seq, key.case_id)
    payload["halt"] = outcome.to_dict()
    return payload


def _stage_task(stage: str) -> Any:
    @app.task(name=f"{TASK_PREFIX}{stage}", bind=True, base=StageTask)
    def task(self: Any, payload: dict[str, Any], token: str | None = None) -> dict[str, Any]:
        return _run_stage(self, payload, stage, token)

    task.__doc__ = f"Stage ``{stage}`` of one investigation step (payload of ids in and out)."
    return task


STAGE_TASKS = {stage: _stage_task(stage) for stage in STAGES}


def step_chain(payload: dict[str, Any], token: str, start: str | None = None) -> Any:
    """The Celery chain of one step: eight stages (or those from ``start`` on), then
    ``advance``. Every signature carries the lock ``token`` and shows itself as
    ``describe(payload, stage)``; none has an error callback (a stage handles its own
    failures, and the worker's :class:`StageRequest` a hard time limit)."""
    shown = repr({"token": logs.short_token(token)})

    def sig(task: Any, stage: str | None, *args: Any) -> Any:
        return task.s(*args, token=token).set(argsrepr=describe(payload, stage),
                                              kwargsrepr=shown)

    stages = STAGES[STAGES.index(start):] if start else STAGES
    first, *rest = stages
    # With a keyword argument Celery builds the chain from the list as it is; without
    # one it folds the signatures with ``|`` one at a time, copying the chain so far at
    # each (about 0.2 ms per step's chain). The message is the same.
    return chain(sig(STAGE_TASKS[first], first, payload),
                 *(sig(STAGE_TASKS[s], s) for s in rest), sig(advance, "advance"), app=app)


def new_payload(case_id: str, steps_left: int, mode: str,
                max_steps: int | None = None) -> dict[str, Any] | None:
    """Payload for the case's next step, or ``None`` if it has no eligible step.

    ``max_steps`` is the dispatch's explicit step limit, kept so that the dispatch that
    follows a yield uses the same limit.
    """
    key = Investigator(runtime.current().env).next_step(case_id)
    if isinstance(key, Outcome):
        return None
    return {**key.to_dict(), "steps_left": steps_left, "mode": mode,
            "max_steps": max_steps, "halt": None}


def check_dispatch(case_id: Any, max_steps: Any, max_allowed: int) -> None:
    """Refuse a dispatch request that did not come from the typed API: a message on the
    broker carries whatever JSON (and kombu's datetime, Decimal, UUID) its sender put in.

    Raises:
        InvestigationError: ``DISPATCH_INVALID``: ``case_id`` is not a case id, or
            ``max_steps`` is neither null nor an integer from 1 to ``max_allowed``.
    """
    if not isinstance(case_id, str) or not SAFE_CASE_ID.fullmatch(case_id):
        raise InvestigationError(
            "DISPATCH_INVALID",
            f"dispatch case id {escape_text(repr(case_id))[:100]} is not a case id "
            f"({CASE_ID_RULE}); send the id `investigate case add` or "
            "`workers.upstream.register` gave")
    if max_steps is not None and (type(max_steps) is not int
                                  or not 1 <= max_steps <= max_allowed):
        raise InvestigationError(
            "DISPATCH_INVALID",
            f"dispatch of {case_id}: max_steps {escape_text(repr(max_steps))[:100]} must be "
            f"null or an integer from 1 to {max_allowed} (limits.max_checkpoints); nothing "
            "was dispatched")


def start_dispatch(case_id: str, max_steps: int | None = None) -> str | Outcome:
    """Take the case lock (never blocking) and enqueue the first step of a dispatch.

    Returns:
        The lock token of this dispatch, or the case's outcome (``COMPLETED``,
        ``BLOCKED``) when it has no step to run; nothing is enqueued then.

    Raises:
        LockBusy: another dispatch of the case holds the lock.
        InvestigationError: ``DISPATCH_INVALID`` (see :func:`check_dispatch`; checked
            before the lock is taken), ``CASE_NOT_FOUND`` and similar.
    """
    rt = runtime.current()
    check_dispatch(case_id, max_steps, rt.env.config.limits.max_checkpoints)
    token = rt.lock.acquire(case_id)
    sending = False
    try:
        steps = max_steps or rt.env.config.loop.max_steps_per_dispatch
        payload = new_payload(case_id, steps, "distributed", max_steps)
        if payload is None:
            rt.lock.release(case_id, token, tombstone=False)  # the token never left
            outcome = Investigator(rt.env).next_step(case_id)
            assert isinstance(outcome, Outcome)
            return outcome
        sending = True
        step_chain(payload, token).apply_async()
    except BaseException:
        # A tombstone only where a message with the token may have gone out (a failed
        # publish may still have reached the broker); an unknown case leaves none.
        rt.lock.release(case_id, token, tombstone=sending)
        raise
    return token


@app.task(name=DISPATCH_TASK, bind=True, base=DispatchTask)
def dispatch(self: Any, case_id: str, max_steps: int | None = None,
             contract: int = DISPATCH_CONTRACT_VERSION) -> dict[str, Any]:
    """Worker-side dispatch (re-enqueued yields, due retries, upstream systems).

    The upstream message contract (``docs/message-contract.md``): args ``[case_id]`` or
    ``[case_id, max_steps]``, optional kwarg ``contract`` (the version, 1). A request that
    is not a valid dispatch (``DISPATCH_INVALID``: other arguments, see
    :class:`DispatchTask`, or a malformed case id or ``max_steps``) is refused before the
    lock is taken and logged; it is not retried.
    """
    if not _is_version_1(contract):
        return _contract_unsupported(case_id, contract)
    try:
        started = start_dispatch(case_id, max_steps)
    except OperationalError as exc:
        # The store dropped the connection or is down: try again later, as a stage does
        # (it crashed with a traceback, and the case waited for the recovery sweep: a
        # fleet trial); start_dispatch released the lock it took.
        if self.request.retries >= STORE_MAX_RETRIES:
            raise
        raise _retry_later(self, exc, None) from exc
    except LockBusy:
        log.info("case %s: dispatch skipped, another dispatch holds the lock", case_id)
        return {"case_id": case_id, "outcome": "LOCK_BUSY"}
    except InvestigationError as exc:
        log.error("dispatch refused: %s: %s", exc.code, exc.message)
        return {"case_id": case_id if isinstance(case_id, str) else None,
                "outcome": "REFUSED", "code": exc.code, "message": exc.message[:500]}
    if isinstance(started, Outcome):  # nothing to run: say why, as `investigate dispatch`
        # does (a completed case's result read DISPATCHED, a fleet trial).
        return {"case_id": case_id, "outcome": "NOTHING_TO_RUN",
                "case_outcome": started.outcome, "reason": started.reason}
    return {"case_id": case_id, "outcome": "DISPATCHED"}


@app.task(name=f"{TASK_PREFIX}advance", bind=True, base=StageTask)
def advance(self: Any, payload: dict[str, Any], token: str | None = None) -> dict[str, Any]:
    """After a step: continue, yield, schedule a retry countdown, or stop.

    Whatever fails here releases the chain's lock (if it still holds it) before the
    error propagates, as the stage tasks do.
    """
    token = _token(payload, token)
    with logs.step_context(case_id=payload["case_id"], step=payload["step_seq"],
                           stage="advance", task_id=self.request.id,
                           worker=getattr(self.request, "hostname", None)):
        try:
            return _halt_first(_advance(payload, token))
        except OperationalError as exc:
            # The store dropped the connection or is down (reading the next step): try
            # again later with the lock kept, as a stage does (it crashed with a
            # traceback, and the case waited for the recovery sweep: a fleet trial).
            # Nothing was sent before the store is read; the last retry gives up as
            # below.
            if self.request.retries < STORE_MAX_RETRIES:
                raise _retry_later(self, exc, None) from exc
            _release_chain_lock(payload, token)
            raise
        except Exception:
            # As the stage tasks do: a failed advance never keeps the case locked until
            # the lease runs out.
            if isinstance(payload, dict) and isinstance(payload.get("case_id"), str):
                _release_chain_lock(payload, token)
            raise


def _advance(payload: dict[str, Any], token: str) -> dict[str, Any]:
    rt = runtime.current()
    halt = payload.get("halt") or {"outcome": "ERROR", "reason": "NO_OUTCOME"}
    outcome, case_id = halt["outcome"], payload["case_id"]
    details = halt.get("details") or {}
    said = [str(v) for v in (details.get("error_code") or details.get("stage"),
                             details.get("message")) if v]
    why = f": {' '.join(said)}" if outcome == BLOCKED and said else ""
    # A block is a worker's WARNING, with the provider's or the stage's message; an
    # embedded run prints the outcome itself.
    level = logging.WARNING if outcome == BLOCKED and payload.get("mode") != "embedded" \
        else logging.INFO
    log.log(level, "case %s step %s: %s %s%s", case_id, payload["step_seq"], outcome,
            halt.get("reason") or "", why)
    engine_metrics.step_ended(outcome, halt.get("reason"))
    if payload.get("mode") == "embedded" or outcome in ("LOCK_LOST",):
        return payload
    if outcome in CONTINUING:
        steps_left = int(payload["steps_left"]) - 1
        if steps_left > 0 and rt.lock.hold(case_id, token):
            nxt = new_payload(case_id, steps_left, "distributed", payload.get("max_steps"))
            if nxt is not None:
                step_chain(nxt, token).apply_async()
                return payload
        rt.lock.release(case_id, token)
        dispatch.apply_async((case_id, payload.get("max_steps")))  # behind other cases
        payload["halt"]["outcome"] = YIELDED if steps_left <= 0 else outcome
        return payload
    if outcome == STEP_ERROR and rt.lock.holder(case_id) == token:
        # Only while this chain holds the case (a chain that gave up on the store released
        # it; another may be at work since, and its outcome is the one to show).
        _note_step_error(rt, payload, halt)
    rt.lock.release(case_id, token, tombstone=not _another_chain_at_work(halt))
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


def _note_step_error(rt: runtime.Runtime, payload: dict[str, Any],
                     halt: dict[str, Any]) -> None:
    """Show a step's controlled error on the case row (``deliveries.note_step_error``);
    the caller holds the case's lock. A store that cannot take the write (the error may be
    its own) leaves the worker log's line as the only record."""
    try:
        deliveries.note_step_error(
            rt.env.store, StepKey(payload["case_id"], payload["revision"], payload["step_seq"]),
            str(halt.get("reason") or "NO_OUTCOME"))
    except Exception as exc:  # best effort: the log line says why
        log.warning("case %s: step %s's error %s not recorded on the case: %s",
                    payload["case_id"], payload["step_seq"], halt.get("reason"), exc)


def _another_chain_at_work(halt: dict[str, Any]) -> bool:
    """Whether the step stopped because another chain is at work on the case: its
    stage was fenced out (``STALE``) or the model call it would make is in flight
    (``RETRY_PENDING`` / ``PROVIDER_CALL_IN_FLIGHT``).

    That chain may be a twin of this one, with the same lock token: a whole worker killed
    before it acknowledged a step's ``advance`` gets it redelivered, and the redelivery
    starts a second chain of the next step beside the one already running. Its release
    then leaves no tombstone, so the twin re-takes the lease at its next renewal and
    goes on (decision 136); with a tombstone the twin stopped with ``LOCK_LOST`` and the
    case waited for the retry countdown (the in-flight grace, ``2 x timeout_s + 5``) or
    the recovery sweep.
    """
    return halt.get("outcome") == "STALE" or (
        halt.get("outcome") == RETRY_PENDING and halt.get("reason") == PROVIDER_CALL_IN_FLIGHT)


#: Task ids whose hard time limit this process has already handed on (bounded).
_TIME_LIMITED: OrderedDict[str, None] = OrderedDict()


@app.task(name=f"{TASK_PREFIX}on_chain_error", base=CheckedTask)
def on_chain_error(request: Any, exc: BaseException, traceback: Any) -> None:
    """Error callback that step chains enqueued before decision 133 carry on every
    signature; kept registered so that their messages still find it.

    Celery calls it where the failure is seen; for a hard time limit that is the
    worker's main process, where :class:`StageRequest` has already handed the step on
    (a task id is handed on once). Other failures were handled by the task itself (a
    stage releases the lock and re-raises), so they are ignored here.
    """
    if not isinstance(exc, TimeLimitExceeded):
        return
    name = str(getattr(request, "task", None) or getattr(request, "name", None) or "")
    limit = exc.args[0] if exc.args and isinstance(exc.args[0], int | float) else None
    hand_over_hard_limit(str(getattr(request, "id", "") or ""), name,
                         getattr(request, "args", None), getattr(request, "kwargs", None),
                         limit)


def hand_over_hard_limit(task_id: str, name: str, args: Any, kwargs: Any,
                         limit_s: float | None) -> None:
    """Publish the :func:`time_limit` message of a stage (or ``advance``) task that a hard
    time limit killed: ids, stage, limit and lock token, nothing more.

    Runs in the worker's main process. A task id is handed on once (Celery 5.4 reports
    one limit both to the request and to a chain's error callbacks); a request that is
    not a stage task's with a payload (a malformed message) is ignored.
    """
    if task_id in _TIME_LIMITED:
        return
    _TIME_LIMITED[task_id] = None
    while len(_TIME_LIMITED) > 1000:
        _TIME_LIMITED.popitem(last=False)
    args = args or ()
    payload = args[0] if args and isinstance(args[0], dict) else None
    stage = name.removeprefix(TASK_PREFIX)
    if payload is None or (stage not in STAGES and stage != "advance"):
        return
    limit = limit_s if isinstance(limit_s, int | float) else None
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    token = kwargs.get("token") or payload.get("token")  # older payloads carried it
    ids = {k: payload.get(k) for k in ("case_id", "revision", "step_seq", "steps_left",
                                       "max_steps", "mode")}
    time_limit.s(ids, stage, limit, token=token).set(
        argsrepr=describe(payload, stage) if isinstance(payload.get("case_id"), str) else "",
        kwargsrepr=repr({"token": logs.short_token(str(token))})).apply_async()


@app.task(name=f"{TASK_PREFIX}time_limit", bind=True, base=CheckedTask)
def time_limit(self: Any, payload: dict[str, Any], stage: str,
               limit_s: float | None, token: str | None = None) -> dict[str, Any]:
    """A hard time limit killed ``stage`` of this chain's step: record it once (see
    :func:`_time_limited`), then go on with the step's remaining stages or end the
    dispatch with the case parked, releasing the lock either way."""
    rt = runtime.current()
    case_id = payload.get("case_id")
    token = token or payload.get("token")
    if not (isinstance(case_id, str) and isinstance(token, str)
            and type(payload.get("revision")) is int and type(payload.get("step_seq")) is int
            and type(payload.get("steps_left")) is int):
        log.error("time_limit: malformed payload for %s; ignored", stage)
        return {"outcome": "REFUSED", "code": "PAYLOAD_INVALID"}
    payload = {**payload, "halt": None}
    # Only the chain that holds the case's lock right now may record its time limit: a
    # message with any other token (a forged one, or a chain whose lease ran out) changes
    # nothing (hold() alone would take a free lock for any token).
    if rt.lock.holder(case_id) != token or not rt.lock.hold(case_id, token):
        log.warning("case %s: time limit of %s not recorded: this message's chain does not "
                    "hold the case's lock", case_id, stage)
        return {"outcome": "REFUSED", "code": "LOCK_NOT_HELD", "case_id": case_id}
    try:
        if stage == "advance":
            # The step was published; only its hand-over was cut: dispatch afresh.
            rt.lock.release(case_id, token)
            dispatch.apply_async((case_id, payload.get("max_steps")))
            return payload
        payload = _time_limited(rt, payload, stage, "hard", limit_s)
        halt = payload.get("halt")
        if halt is None:
            nxt = STAGES[STAGES.index(stage) + 1]
            step_chain(payload, token, start=nxt).apply_async()
            return payload
        if halt.get("outcome") == "RECORDED":
            # The stage finished before its process was killed: a fresh dispatch goes
            # on from the step's first unfinished stage.
            rt.lock.release(case_id, token)
            dispatch.apply_async((case_id, payload.get("max_steps")))
            return payload
    except Exception:
        rt.lock.release(case_id, token)
        raise
    rt.lock.release(case_id, token,
                    tombstone=not _another_chain_at_work(payload.get("halt") or {}))
    return payload


def run_embedded_step(case_id: str, token: str) -> Outcome | None:
    """Run one step's chain in process (``chain.apply()``); ``None`` if no step is eligible."""
    payload = new_payload(case_id, 1, "embedded")
    if payload is None:
        return None
    result = step_chain(payload, token).apply().get()
    halt = result.get("halt")
    if halt is None:
        raise InvestigationError("STAGE_ORDER", "the step chain ended without an outcome")
    if halt["outcome"] == "LOCK_LOST":
        raise InvestigationError("LOCK_LOST", f"step {payload['step_seq']} stopped: the "
                                 f"case's lock was taken by another dispatch; `investigate "
                                 f"status {case_id}` shows who moves the case")
    if halt["outcome"] in ("ERROR", "STALE"):
        raise InvestigationError(halt["reason"] or halt["outcome"],
                                 (halt.get("details") or {}).get("message")
                                 or f"step {payload['step_seq']} stopped: {halt['outcome']}")
    return Outcome.from_dict(halt)


@app.task(name=f"{TASK_PREFIX}recover", bind=True, base=CheckedTask)
def recover(self: Any) -> dict[str, Any]:
    """The periodic recovery sweep (beat): re-dispatch every case with pending work.

    Returns ``{"dispatched": [...], "busy": [...], "not_due": n, "failed": [...]}``
    (case ids), see ``workers.recovery.sweep``.
    """
    from workers.recovery import sweep

    try:
        report = sweep(runtime.current())
    except OperationalError as exc:
        # One line per sweep while the store is down, not a traceback (a fleet trial);
        # the next sweep tries again.
        log.error("recovery sweep: the store cannot be reached (%s); the next sweep tries "
                  "again", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return {"outcome": "REFUSED", "code": "STORE_UNAVAILABLE"}
    return report.to_dict()
