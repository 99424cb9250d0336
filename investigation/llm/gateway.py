"""LLMGateway: persisted provider operations, ordered failover and retry timing as data.

One model decision is one ``LLMOperation`` row, keyed by
``(case_id, revision, step_seq, retry_id)``. Each try is an ``LLMAttempt`` row plus two
artifacts: the request bytes (stored and committed *before* sending) and the response
bytes (stored byte for byte after). The gateway never sleeps: a backoff ends the call
with :class:`~investigation.llm.types.RetryPending` and a ``retry_not_before`` instant,
and the caller comes back later (Celery countdown, or the embedded runtime returning
``RETRY_PENDING``).

Operation life cycle::

    pending ──success──────────────────────────────> succeeded   (returned again, never re-sent)
       │  ──transient, another provider left──> next provider, same call
       │  ──transient, round over───────────────> retry_pending (retry_not_before, round + 1)
       │  ──attempts used up────────────────────> exhausted     Blocked(PROVIDER_EXHAUSTED)
       │  ──credentials─────────────────────────> failed        Blocked(PROVIDER_CREDENTIALS)
       └──configuration / unexpected / all providers rejected the request
                                                 ─> failed        Blocked(PROVIDER_CONFIGURATION)

Timing: a round tries every provider once, in list order, starting at provider 0.
After a failed round ``r`` (0-based) the next round waits
``min(max_delay_s, delay_s * backoff_factor ** r)`` seconds, raised to the largest
``Retry-After`` a provider gave in that round (capped at :data:`RETRY_AFTER_CAP_S`).
At most ``GatewayConfig.attempts`` attempts are made over all providers and rounds.

Decisions beyond the brief, kept here so callers can rely on them:

* Any succeeded operation of the step is returned whatever ``retry_id`` is passed:
  a stored success is never asked again.
* A ``retry_id`` opens a new operation only when the step's latest operation is
  ``exhausted`` or ``failed``. While it is ``pending``/``retry_pending`` that operation
  continues, so a ``retry_id`` can never override an ordinary backoff (seed 000).
* A provider that rejected the request (``ProviderRequestRejected``) is skipped for the
  rest of the operation (attempt status ``rejected``): the same bytes are never resent
  to it.
* An attempt left ``sent`` by a crash is marked ``failed``/``PROVIDER_INTERRUPTED`` on the
  next call, counts as an attempt, and the next attempt goes to the same provider at
  once (the crash was ours, not the provider's), but only once ``in_flight_grace_s`` has
  passed since the attempt started (default: twice the longest provider ``timeout_s``
  plus 5 s; until then the call returns ``RetryPending``), so a runner whose lock
  expired under a live request never sends it a second time.
* Finishing writes are compare-and-set: a worker whose attempt was meanwhile declared
  interrupted (or whose operation moved on) gets ``StaleStateError`` and its answer is
  discarded, never merged.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, or_, update
from sqlalchemy import exists as sa_exists
from sqlalchemy import select as sa_select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import DBAPIError
from sqlmodel import Session, col, select

from investigation.config import GatewayConfig, ProviderConfig, ProvidersConfig
from investigation.constants import (
    ARTIFACT_REQUEST,
    ARTIFACT_RESPONSE,
    BLOCK_MODEL_COST_CAP,
    BLOCK_PROVIDER_CONFIGURATION,
    BLOCK_PROVIDER_CREDENTIALS,
    BLOCK_PROVIDER_EXHAUSTED,
)
from investigation.errors import (
    ProviderConfigurationError,
    ProviderError,
    StaleStateError,
    TransientProviderError,
)
from investigation.llm import spend
from investigation.llm.failures import (
    EarlierAttempt,
    Failure,
    classify,
    reclassify,
    short,
)
from investigation.llm.openai import OpenAIProvider, parse_chat_completion
from investigation.llm.scripted import ScriptedProvider
from investigation.llm.tokens import PromptBudget, output_budget, prompt_budget
from investigation.llm.types import (
    PROVIDER_BAD_CONFIG,
    PROVIDER_CALL_IN_FLIGHT,
    PROVIDER_CREDENTIALS,
    PROVIDER_CREDENTIALS_MISSING,
    PROVIDER_INTERRUPTED,
    PROVIDER_MALFORMED_RESPONSE,
    PROVIDER_REQUEST_REJECTED,
    PROVIDER_REQUEST_TOO_LARGE,
    PROVIDER_UNEXPECTED,
    PROVIDER_UNREACHABLE,
    Blocked,
    ChatRequest,
    GatewayOutcome,
    Provider,
    ProviderReply,
    RetryPending,
    Succeeded,
)
from investigation.store.engine import Store, core, deferred, is_lost_race, table_of
from investigation.store.models import LLMAttempt, LLMOperation

__all__ = [
    "Blocked",
    "GatewayOutcome",
    "LLMGateway",
    "RetryPending",
    "Succeeded",
    "build_providers",
]

log = logging.getLogger(__name__)

#: New connections tried to store a received response after the database dropped the
#: one in use (``_finish_success``).
STORE_RETRIES_ON_DISCONNECT = 2

#: Exceptions a runtime raises inside a provider call to stop the stage (Celery's
#: ``SoftTimeLimitExceeded``): passed through, never taken for a provider's failure.
_interruptions: tuple[type[Exception], ...] = ()


def pass_through(*kinds: type[Exception]) -> None:
    """Let ``kinds`` raised during a provider call reach the caller instead of being
    classified as a provider failure (a worker's soft time limit is the runtime stopping
    the stage, recorded as ``STAGE_TIME_LIMIT``, not a bug in the provider adapter)."""
    global _interruptions
    _interruptions = tuple(dict.fromkeys((*_interruptions, *kinds)))

#: ``LLMOperation.status`` values.
OP_PENDING = "pending"
OP_RETRY_PENDING = "retry_pending"
OP_SUCCEEDED = "succeeded"
OP_EXHAUSTED = "exhausted"
OP_FAILED = "failed"
#: ``LLMAttempt.status`` values (``rejected``: the provider can never accept this request).
ATTEMPT_SENT = "sent"
ATTEMPT_SUCCEEDED = "succeeded"
ATTEMPT_FAILED = "failed"
ATTEMPT_REJECTED = "rejected"
#: Upper bound on a provider's ``Retry-After`` honoured, in seconds (1 day).
RETRY_AFTER_CAP_S = 86_400.0
#: Media type of stored response bytes (exact, whatever the server sent).
RESPONSE_MEDIA_TYPE = "application/octet-stream"


def default_in_flight_grace_s(timeouts: Iterable[float]) -> float:
    """Seconds a ``sent`` attempt found by another call is waited out before it counts as
    interrupted (:class:`LLMGateway`'s default): twice the longest provider ``timeout_s``
    (0 for a provider without one), and 5 s."""
    return 2 * max(timeouts, default=0.0) + 5.0


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _config_of(provider: Provider) -> ProviderConfig | None:
    config = getattr(provider, "config", None)
    return config if isinstance(config, ProviderConfig) else None


def _hypothesis_of(request: ChatRequest) -> int | None:
    value = request.metadata.get("hypothesis_id", "")
    return int(value) if value.isdigit() else None


def _aware(value: datetime) -> datetime:
    """SQLite returns naive datetimes; every stored time is UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


class _InFlight(Exception):
    """Another runner's attempt of this operation is being sent right now."""

    def __init__(self, until: datetime) -> None:
        super().__init__("attempt in flight")
        self.until = until


#: Failure codes of attempts whose request never reached a server.
_NOT_SENT_CODES = frozenset({
    PROVIDER_UNREACHABLE, PROVIDER_CREDENTIALS_MISSING, PROVIDER_BAD_CONFIG,
})


def _was_sent(failure: Failure) -> bool:
    """Whether a failed attempt's request left this process (money: an unsent request
    costs nothing). A too-large refusal without an HTTP status is this side's own."""
    if failure.code in _NOT_SENT_CODES:
        return False
    return not (failure.code == PROVIDER_REQUEST_TOO_LARGE and failure.http_status is None)


def _sent_max_tokens(request: ChatRequest, config: ProviderConfig) -> int | None:
    """The output cap a request carried: its own, else the provider's."""
    return request.max_tokens if request.max_tokens is not None else config.max_tokens


@dataclass
class _OpState:
    """The operation fields the attempt loop advances (mirrors the row)."""

    id: int
    attempts_made: int
    next_provider_index: int
    round_index: int
    rejected: set[str] = field(default_factory=set)


class LLMGateway:
    """Calls providers for one model decision with persisted attempts, failover and backoff.

    Args:
        store: the SQL store (operations, attempts, artifacts).
        providers: the ordered failover list; names must be unique.
        config: attempts and backoff timing.
        clock: timezone-aware UTC "now". Tests pass a fake clock; nothing ever sleeps.
        in_flight_grace_s: seconds after an attempt started during which a ``sent``
            attempt is presumed still running (the call returns ``RetryPending``)
            rather than interrupted. Default: twice the longest provider ``timeout_s``
            plus 5 s (a provider call cannot outlive that: the HTTP provider enforces a
            total deadline), so two runners racing on one case never call the model
            twice. 0 treats every ``sent`` attempt found by a call as interrupted.

    Raises:
        ValueError: no providers, or duplicate provider names.
    """

    def __init__(
        self,
        store: Store,
        providers: Sequence[Provider],
        config: GatewayConfig,
        clock: Callable[[], datetime] = _utcnow,
        *,
        in_flight_grace_s: float | None = None,
    ) -> None:
        if not providers:
            raise ValueError("LLMGateway needs at least one provider")
        names = [p.name for p in providers]
        if len(set(names)) != len(names):
            raise ValueError(f"provider names must be unique, got {names}")
        self.store = store
        self.providers = list(providers)
        self.config = config
        self._clock = clock
        if in_flight_grace_s is None:
            in_flight_grace_s = default_in_flight_grace_s(
                float(getattr(p, "timeout_s", 0.0)) for p in providers)
        self.in_flight_grace_s = in_flight_grace_s

    # -- public ------------------------------------------------------------------------------

    def prompt_budget(self) -> list[PromptBudget]:
        """The prompt budgets of the providers that state a context window (any order).

        The context of a step is fitted so its request fits every one of them
        (``loop.context.fit_for_model``); a provider without a window sets no bound.
        """
        budgets = []
        for provider in self.providers:
            config = _config_of(provider)
            if config is not None:
                budget = prompt_budget(config)
                if budget is not None:
                    budgets.append(budget)
        return budgets

    def call(
        self,
        case_id: str,
        revision: int,
        step_seq: int,
        request: ChatRequest,
        retry_id: str = "",
        opened: tuple[LLMOperation, bool] | None = None,
    ) -> GatewayOutcome:
        """Get the model's answer for one decision, or say when/why not.

        Returns at once in every case: a stored success or block is returned without
        contacting any provider, and a pending backoff returns ``RetryPending`` until
        ``clock() >= retry_not_before``. Otherwise providers are tried in order (each
        request committed to the store before it is sent) until one answers, a round
        fails (``RetryPending``), attempts run out or a failure blocks (``Blocked``).

        Args:
            case_id: the case.
            revision: the analysis revision.
            step_seq: the step sequence number (artifact directory ``NNNN``).
            request: the provider-independent request.
            retry_id: operator-supplied id that opens a new operation after an
                exhausted/failed one (see the module docstring); ``""`` by default.
            opened: what :meth:`open_operation` returned in a transaction the caller
                committed since (the ``llm_call`` stage opens it in its own); ``None``:
                the operation is looked up (and created) here.

        Returns:
            ``Succeeded``, ``RetryPending`` or ``Blocked``. Provider failures never raise.

        Raises:
            StaleStateError: another worker advanced this operation concurrently (its
                write won; rerun the stage to read the recorded result).
        """
        op, created = opened if opened is not None else \
            self._open_operation(case_id, revision, step_seq, request, retry_id)
        if created:
            # Created in this very transaction: no attempt of it can exist yet, so there is
            # nothing interrupted to recover and its state is the row's initial one.
            assert op.id is not None
            try:
                return self._attempt_loop(case_id, step_seq, request, op.id,
                                          (op, _OpState(op.id, 0, 0, 0)))
            except _InFlight as busy:  # pragma: no cover - nobody else knew the operation
                return RetryPending(op.id, busy.until, PROVIDER_CALL_IN_FLIGHT)
        if op.status == OP_SUCCEEDED:
            return self._stored_success(op)
        if op.status in (OP_EXHAUSTED, OP_FAILED):
            return self._stored_block(op)
        assert op.id is not None
        now = self._now()
        if op.status == OP_RETRY_PENDING and op.retry_not_before is not None:
            not_before = _aware(op.retry_not_before)
            if now < not_before:
                log.info("llm operation %s: retry pending until %s", op.id, not_before.isoformat())
                return RetryPending(op.id, not_before, op.error_code or "")
        in_flight = self._recover_interrupted(case_id, op.id, now)
        if in_flight is not None:
            return in_flight
        try:
            return self._attempt_loop(case_id, step_seq, request, op.id)
        except _InFlight as busy:
            log.info("llm operation %s: another runner's attempt is in flight until %s",
                     op.id, busy.until.isoformat())
            return RetryPending(op.id, busy.until, PROVIDER_CALL_IN_FLIGHT)

    # -- operation row -----------------------------------------------------------------------

    def open_operation(
        self, session: Session, case_id: str, revision: int, step_seq: int,
        request: ChatRequest, retry_id: str = "",
    ) -> tuple[LLMOperation, bool] | None:
        """The operation of this decision to continue, or a new one (``True``), in the
        caller's transaction (which must commit before :meth:`call` gets the result as
        ``opened``).

        Returns:
            ``None`` when a concurrent runner created the operation after this
            transaction's snapshot was taken: :meth:`call` without ``opened`` reads it in
            a transaction of its own. (Under ``REPEATABLE READ`` or ``SERIALIZABLE``
            PostgreSQL reports that as a serialization failure instead: the caller runs
            its transaction again.)
        """
        op = LLMOperation(
            case_id=case_id,
            revision=revision,
            step_seq=step_seq,
            retry_id=retry_id,
            call_index=request.call_index,
            hypothesis_id=_hypothesis_of(request),
            status=OP_PENDING,
            attempts_made=0,
            next_provider_index=0,
            round_index=0,
            created_at=self._now(),
        )
        conn = core(session)  # llm_operation rows are created here only
        dialect = "postgresql" if conn.dialect.name == "postgresql" else "sqlite"
        values = op.model_dump(exclude={"id"})
        # The usual case first: the step has no operation yet, and this one statement
        # creates it (nothing is inserted when the step has any).
        new_id = conn.execute(_OP_CREATE_FIRST[dialect], values).scalar()
        if new_id is None:
            existing = self._pick_operation(session, case_id, revision, step_seq, retry_id)
            if existing is not None:
                return existing, False
            new_id = conn.execute(_OP_CREATE[dialect], values).scalar()
        if new_id is None:  # the unique (case, revision, step, retry id) exists already
            return None
        op.id = int(new_id)
        return op, True

    def _open_operation(
        self, case_id: str, revision: int, step_seq: int, request: ChatRequest, retry_id: str
    ) -> tuple[LLMOperation, bool]:
        """:meth:`open_operation` in a transaction of its own; a concurrent creator's row is
        taken instead."""
        try:
            with self.store.session() as session:
                opened = self.open_operation(session, case_id, revision, step_seq,
                                             request, retry_id)
            if opened is not None:
                return opened
        except DBAPIError as exc:
            if not is_lost_race(exc):
                raise
        # Another worker created it between our read and insert: use theirs.
        with self.store.session() as session:
            existing = self._pick_operation(session, case_id, revision, step_seq, retry_id)
        if existing is None:  # pragma: no cover - the unique row must exist now
            raise StaleStateError(
                f"llm operation for case {case_id} step {step_seq} vanished after a conflict",
                case_id=case_id,
                step_seq=step_seq,
            )
        return existing, False

    @staticmethod
    def _pick_operation(
        session: Session, case_id: str, revision: int, step_seq: int, retry_id: str
    ) -> LLMOperation | None:
        ops = list(session.exec(_OPERATIONS, params={
            "case_id": case_id, "revision": revision, "step_seq": step_seq}))
        for op in ops:
            if op.status == OP_SUCCEEDED:
                return op
        for op in ops:
            if op.retry_id == retry_id:
                return op
        if ops and ops[-1].status in (OP_PENDING, OP_RETRY_PENDING):
            # A retry_id never overrides an ordinary backoff: continue the live operation.
            return ops[-1]
        return None

    def _stored_success(self, op: LLMOperation) -> Succeeded:
        assert op.id is not None
        with self.store.session() as session:
            attempt = session.exec(
                select(LLMAttempt).where(
                    LLMAttempt.operation_id == op.id, LLMAttempt.attempt == op.succeeded_attempt
                )
            ).one()
            assert attempt.response_path is not None
            artifact = Store.get_artifact(session, op.case_id, attempt.response_path)
        if artifact is None:
            raise StaleStateError(
                f"llm operation {op.id}: response artifact {attempt.response_path} is missing",
                operation_id=op.id,
            )
        return Succeeded(
            operation_id=op.id,
            attempt=attempt.attempt,
            provider=attempt.provider,
            content=self._content_from_raw(attempt.provider, artifact.data),
            response_sha256=artifact.sha256,
            request_sha256=attempt.request_sha256,
            finish_reason=attempt.finish_reason,
            completion_tokens=attempt.completion_tokens,
        )

    def _content_from_raw(self, provider_name: str, raw: bytes) -> str:
        """Re-derive content from stored bytes, even when the provider list changed."""
        for provider in self.providers:
            if provider.name == provider_name:
                try:
                    return provider.content_from_raw(raw)
                except ProviderError:
                    break  # the provider's kind changed since; fall through
        try:
            return parse_chat_completion(raw, 200, provider_name).content
        except TransientProviderError:
            return raw.decode("utf-8", "replace")

    @staticmethod
    def _stored_block(op: LLMOperation) -> Blocked:
        assert op.id is not None
        code = op.error_code or PROVIDER_UNEXPECTED
        if op.status == OP_EXHAUSTED:
            reason = BLOCK_PROVIDER_EXHAUSTED
        elif code.startswith(PROVIDER_CREDENTIALS):
            reason = BLOCK_PROVIDER_CREDENTIALS
        elif code == spend.MODEL_COST_CAP_REACHED:
            reason = BLOCK_MODEL_COST_CAP
        else:
            reason = BLOCK_PROVIDER_CONFIGURATION
        return Blocked(op.id, reason, code, op.error_message or "")

    # -- interrupted attempts ----------------------------------------------------------------

    def _recover_interrupted(self, case_id: str, op_id: int, now: datetime) -> RetryPending | None:
        with self.store.session() as session:
            sent = list(
                session.exec(
                    select(LLMAttempt).where(
                        LLMAttempt.operation_id == op_id, LLMAttempt.status == ATTEMPT_SENT
                    )
                )
            )
            for attempt in sent:
                started = _aware(attempt.started_at)
                if self.in_flight_grace_s > 0:
                    until = started + timedelta(seconds=self.in_flight_grace_s)
                    if now < until:
                        log.info(
                            "llm operation %s attempt %s may still be in flight until %s",
                            op_id, attempt.attempt, until.isoformat(),
                        )
                        return RetryPending(op_id, until, PROVIDER_CALL_IN_FLIGHT)
                message = (
                    f"attempt {attempt.attempt} to provider {attempt.provider!r} was stored as "
                    "sent but no response was recorded (the process that sent it stopped: a "
                    "worker, or an interrupted run); it counts as an attempt"
                )
                result = session.exec(
                    update(LLMAttempt)
                    .where(col(LLMAttempt.id) == attempt.id, col(LLMAttempt.status) == ATTEMPT_SENT)
                    .values(
                        status=ATTEMPT_FAILED,
                        error_code=PROVIDER_INTERRUPTED,
                        error_message=message,
                        finished_at=now,
                    )
                )
                if result.rowcount != 1:
                    raise StaleStateError(
                        f"llm operation {op_id}: attempt {attempt.attempt} changed concurrently",
                        operation_id=op_id,
                    )
                session.exec(
                    update(LLMOperation)
                    .where(col(LLMOperation.id) == op_id)
                    .values(error_code=PROVIDER_INTERRUPTED, error_message=message)
                )
                log.warning("llm operation %s (case %s): %s", op_id, case_id, message)
        return None

    # -- the attempt loop --------------------------------------------------------------------

    def _load_state(self, op_id: int) -> tuple[LLMOperation, _OpState]:
        with self.store.session() as session:
            op = session.exec(select(LLMOperation).where(LLMOperation.id == op_id)).one()
            rejected = set(
                session.exec(
                    select(LLMAttempt.provider).where(
                        LLMAttempt.operation_id == op_id, LLMAttempt.status == ATTEMPT_REJECTED
                    )
                )
            )
        state = _OpState(op_id, op.attempts_made, op.next_provider_index, op.round_index, rejected)
        return op, state

    def _next_index(self, start: int, rejected: set[str]) -> int | None:
        for index in range(start, len(self.providers)):
            if self.providers[index].name not in rejected:
                return index
        return None

    def _unpriced(self, request: ChatRequest) -> set[str]:
        """Providers that cannot be used for ``request``: none without a money cap; with
        one, every provider that states no prices (``llm.spend``)."""
        if request.money_cap_micros is None:
            return set()
        return {p.name for p in self.providers
                if not (isinstance(config := _config_of(p), ProviderConfig)
                        and spend.priced(config))}

    def _attempt_loop(
        self, case_id: str, step_seq: int, request: ChatRequest, op_id: int,
        loaded: tuple[LLMOperation, _OpState] | None = None,
    ) -> GatewayOutcome:
        op, state = loaded if loaded is not None else self._load_state(op_id)
        round_retry_after: float | None = None
        unpriced = self._unpriced(request)
        while True:
            if state.attempts_made >= self.config.attempts:
                # Reached when an interrupted attempt used up the last one (or the
                # configured attempts were lowered since).
                return self._finish_without_attempt(
                    op_id, state, OP_EXHAUSTED, op.error_code or PROVIDER_INTERRUPTED,
                    self._exhausted_message(op.error_message or "interrupted"),
                )
            skipped = state.rejected | unpriced
            index = self._next_index(state.next_provider_index, skipped)
            if index is None:
                index = self._next_index(0, skipped)
            if index is None and unpriced:
                return self._finish_without_attempt(
                    op_id, state, OP_FAILED, spend.PROVIDER_PRICE_UNKNOWN,
                    f"a money cap is set (limits.max_model_cost) and provider(s) "
                    f"{sorted(unpriced)} state no prices; set input_price_per_mtok and "
                    "output_price_per_mtok in the providers file, then resume with a new "
                    "retry id",
                )
            if index is None:
                return self._finish_without_attempt(
                    op_id, state, OP_FAILED, PROVIDER_REQUEST_REJECTED,
                    "every configured provider rejected this request as too large; serve a "
                    "model with a larger window (and set context_window_tokens to it, so the "
                    "context is fitted to it), then resume with a new retry id",
                )
            provider = self.providers[index]
            config = _config_of(provider)
            budget: spend.CallBudget | None = None
            if config is not None and spend.priced(config):
                spent, recorded = self._spent_micros(case_id)
                if recorded is not None and recorded != request.currency:
                    # One currency per case (decision 180): micros of two would add up
                    # to a meaningless total, and the cap would compare it.
                    return self._finish_without_attempt(
                        op_id, state, OP_FAILED, spend.MODEL_COST_CURRENCY_CHANGED,
                        f"the case's model costs are recorded in {recorded} and "
                        f"limits.currency is now {request.currency}; set limits.currency "
                        f"back to {recorded} (with the providers' prices in {recorded}), "
                        "then resume with a new retry id")
                remaining = None if request.money_cap_micros is None else \
                    request.money_cap_micros - spent
                # The estimate covers the whole body (a hosted API bills the schema too).
                provisional = dataclasses.replace(request, max_tokens=output_budget(config))
                try:
                    prompt = spend.prompt_estimate(
                        config, provider.build_request_bytes(provisional))
                except ProviderError:
                    prompt = 0  # the build fails again below and is reported there
                budget = spend.plan_call(config, prompt, remaining)
                if budget is None:
                    return self._finish_without_attempt(
                        op_id, state, OP_FAILED, spend.MODEL_COST_CAP_REACHED,
                        f"the case's model calls reached limits.max_model_cost: "
                        f"{spend.format_money(max(0, remaining or 0), request.currency)} left "
                        f"cannot pay for a call to {provider.name!r} (prompt and "
                        f"{spend.MIN_OUTPUT_TOKENS} output tokens); raise the cap, then "
                        "resume with a new retry id", kind="cost")
                if request.money_cap_micros is not None:
                    request = dataclasses.replace(request, max_tokens=budget.max_tokens)
            try:
                request_bytes = provider.build_request_bytes(request)
            except Exception as exc:  # a provider that cannot even encode: configuration
                build_failure = classify(provider.name, exc)
                kind = "credentials" if build_failure.kind == "credentials" else "configuration"
                return self._finish_without_attempt(
                    op_id, state, OP_FAILED, build_failure.code, build_failure.message, kind=kind
                )
            attempt_no, request_sha = self._begin_attempt(
                case_id, step_seq, state, index, provider.name, request_bytes,
                budget.reserved_micros if budget is not None else None,
                request.currency if budget is not None else None,
            )
            reply: ProviderReply | None = None
            failure: Failure | None = None
            try:
                reply = provider.send(request_bytes, request)  # outside any transaction
                limit = request.max_response_bytes
                if limit is not None and len(reply.raw) > limit:
                    reply = None  # never stored: an artifact is bounded (seed 000)
                    raise TransientProviderError(
                        PROVIDER_MALFORMED_RESPONSE,
                        f"provider {provider.name!r}: the response is larger than "
                        f"limits.max_artifact_bytes ({limit} bytes)", provider=provider.name)
            except Exception as exc:
                if isinstance(exc, _interruptions):
                    raise  # the runtime stops this stage (a worker's soft time limit)
                failure = reclassify(
                    classify(provider.name, exc),
                    self._earlier_attempts(op_id, provider.name, request_sha, attempt_no),
                    provider.name,
                    ARTIFACT_REQUEST.format(seq=step_seq, operation=op_id, attempt=attempt_no))
            now = self._now()
            reserved = budget.reserved_micros if budget is not None else None
            if reply is not None:
                cost = None if config is None else spend.settled_micros(
                    config, reserved, spend.Attempted(
                        len(request_bytes), _sent_max_tokens(request, config), sent=True,
                        answered=True, succeeded=True, prompt_tokens=reply.prompt_tokens,
                        completion_tokens=reply.completion_tokens))
                return self._finish_success(
                    case_id, step_seq, state, attempt_no, provider.name, request_sha, reply, now,
                    cost,
                )
            assert failure is not None
            if config is not None:
                prompt_used, completion_used = spend.usage_of(failure.raw)
                failure = dataclasses.replace(failure, cost_micros=spend.settled_micros(
                    config, reserved, spend.Attempted(
                        len(request_bytes), _sent_max_tokens(request, config),
                        sent=_was_sent(failure), answered=failure.http_status is not None,
                        succeeded=False, prompt_tokens=prompt_used,
                        completion_tokens=completion_used)))
            state.attempts_made = attempt_no
            if failure.kind == "credentials":
                code = failure.code if failure.code.startswith(PROVIDER_CREDENTIALS) else (
                    PROVIDER_CREDENTIALS
                )
                self._finish_failure(case_id, step_seq, state, attempt_no, failure, now, {
                    "status": OP_FAILED, "error_code": code, "error_message": failure.message,
                })
                return self._blocked(op_id, BLOCK_PROVIDER_CREDENTIALS, code, failure.message)
            if failure.kind == "configuration":
                self._finish_failure(case_id, step_seq, state, attempt_no, failure, now, {
                    "status": OP_FAILED, "error_code": failure.code,
                    "error_message": failure.message,
                })
                return self._blocked(
                    op_id, BLOCK_PROVIDER_CONFIGURATION, failure.code, failure.message
                )
            # transient or rejected: fail over, back off, or give up.
            if failure.kind == "rejected":
                state.rejected.add(provider.name)
            elif failure.retry_after_s is not None:
                round_retry_after = max(round_retry_after or 0.0, failure.retry_after_s)
            if state.attempts_made >= self.config.attempts:
                message = self._exhausted_message(failure.message)
                self._finish_failure(case_id, step_seq, state, attempt_no, failure, now, {
                    "status": OP_EXHAUSTED, "error_code": failure.code, "error_message": message,
                })
                return self._blocked(op_id, BLOCK_PROVIDER_EXHAUSTED, failure.code, message)
            following = self._next_index(index + 1, state.rejected)
            if following is not None:
                state.next_provider_index = following
                self._finish_failure(case_id, step_seq, state, attempt_no, failure, now, {
                    "status": OP_PENDING, "next_provider_index": following,
                    "error_code": failure.code, "error_message": failure.message,
                })
                log.info(
                    "llm operation %s: provider %r failed (%s); failing over to %r",
                    op_id, provider.name, failure.code, self.providers[following].name,
                )
                continue
            first = self._next_index(0, state.rejected)
            if first is None:
                message = (
                    f"{failure.message} (every configured provider rejected this request)"
                )
                self._finish_failure(case_id, step_seq, state, attempt_no, failure, now, {
                    "status": OP_FAILED, "error_code": failure.code, "error_message": message,
                })
                return self._blocked(op_id, BLOCK_PROVIDER_CONFIGURATION, failure.code, message)
            delay_s = self._round_delay_s(state.round_index, round_retry_after)
            not_before = now + timedelta(seconds=delay_s)
            self._finish_failure(case_id, step_seq, state, attempt_no, failure, now, {
                "status": OP_RETRY_PENDING, "next_provider_index": first,
                "round_index": state.round_index + 1, "retry_not_before": not_before,
                "error_code": failure.code, "error_message": failure.message,
            })
            log.info(
                "llm operation %s: round %s failed (%s); retry not before %s",
                op_id, state.round_index, failure.code, not_before.isoformat(),
            )
            return RetryPending(op_id, not_before, failure.code)

    def _spent_micros(self, case_id: str) -> tuple[int, str | None]:
        """What the case's model calls cost or hold reserved (micros), and the currency
        they were recorded in (``spend.case_currency``)."""
        with self.store.session() as session:
            return (spend.case_spent_micros(session, case_id),
                    spend.case_currency(session, case_id))

    def _earlier_attempts(self, op_id: int, provider: str, request_sha: str,
                          attempt_no: int) -> list[EarlierAttempt]:
        """Earlier attempts of this operation to ``provider`` with the same request bytes."""
        with self.store.session() as session:
            rows = session.exec(select(LLMAttempt).where(
                LLMAttempt.operation_id == op_id, LLMAttempt.provider == provider,
                LLMAttempt.request_sha256 == request_sha, LLMAttempt.attempt < attempt_no)
                .order_by(col(LLMAttempt.attempt))).all()
        return [EarlierAttempt(r.attempt, r.error_code, r.http_status, r.response_sha256)
                for r in rows]

    def _round_delay_s(self, round_index: int, retry_after_s: float | None) -> float:
        cfg = self.config
        try:
            delay = min(cfg.max_delay_s, cfg.delay_s * cfg.backoff_factor**round_index)
        except OverflowError:
            delay = cfg.max_delay_s
        if retry_after_s is not None:
            delay = max(delay, min(retry_after_s, RETRY_AFTER_CAP_S))
        return delay

    def _exhausted_message(self, last: str) -> str:
        names = ", ".join(p.name for p in self.providers)
        return short(
            f"all {self.config.attempts} attempts over providers [{names}] failed; last: {last}. "
            "Fix the provider, then resume the case with a new retry id"
        )

    # -- transactions ------------------------------------------------------------------------

    def _begin_attempt(
        self,
        case_id: str,
        step_seq: int,
        state: _OpState,
        index: int,
        provider: str,
        request_bytes: bytes,
        reserved_micros: int | None = None,
        currency: str | None = None,
    ) -> tuple[int, str]:
        """Store the request bytes and a ``sent`` attempt (with the money it reserves and
        the currency it is in), and commit, before sending."""
        attempt_no = state.attempts_made + 1
        path = ARTIFACT_REQUEST.format(seq=step_seq, operation=state.id, attempt=attempt_no)
        try:
            with self.store.session() as session:
                moved = core(session).execute(_OP_BEGIN, {
                    "op_id_": state.id, "made_": state.attempts_made,
                    "attempts_made": attempt_no, "next_provider_index": index,
                    "status": OP_PENDING, "retry_not_before": None,
                })
                if moved.rowcount != 1:
                    raise self._stale(state.id, attempt_no)
                # The UPDATE above holds the operation row (PostgreSQL row lock, SQLite's
                # write lock): a concurrent runner's attempt that is still ``sent`` means
                # the model is being asked right now, so this runner must not ask again.
                # (Attempts are inserted only behind this compare-and-set, so an operation
                # that had made none has none in flight.)
                live = core(session).execute(_ATTEMPT_LIVE, {"op_id": state.id}).first() \
                    if state.attempts_made else None
                if live is not None:
                    raise _InFlight(_aware(live[0])
                                    + timedelta(seconds=max(self.in_flight_grace_s, 1.0)))
                digest = Store.put_artifact(session, case_id, path, request_bytes)
                # Every column of a new attempt (what ``LLMAttempt(...).model_dump()``
                # gives), without building the model.
                core(session).execute(_ATTEMPT_INSERT, {
                    **_ATTEMPT_UNSET, "operation_id": state.id, "attempt": attempt_no,
                    "provider": provider, "request_path": path, "request_sha256": digest,
                    "reserved_micros": reserved_micros, "currency": currency,
                    "status": ATTEMPT_SENT,
                    "started_at": self._now()})
        except DBAPIError as exc:
            if is_lost_race(exc):
                raise self._stale(state.id, attempt_no) from exc
            raise
        state.next_provider_index = index
        return attempt_no, digest

    def _store_response(
        self, session: Any, case_id: str, step_seq: int, op_id: int, attempt_no: int,
        raw: bytes | None,
    ) -> tuple[str | None, str | None]:
        if raw is None:
            return None, None
        path = ARTIFACT_RESPONSE.format(seq=step_seq, operation=op_id, attempt=attempt_no)
        digest = Store.put_artifact(session, case_id, path, raw, media_type=RESPONSE_MEDIA_TYPE)
        return path, digest

    def _close_attempt(
        self, session: Any, op_id: int, attempt_no: int, values: Mapping[str, Any]
    ) -> None:
        result = core(session).execute(
            _ATTEMPT_CLOSE, {"op_id_": op_id, "no_": attempt_no, **values})
        if result.rowcount != 1:
            raise self._stale(op_id, attempt_no)

    def _update_operation(
        self, session: Any, op_id: int, attempt_no: int, values: Mapping[str, Any]
    ) -> None:
        result = core(session).execute(
            _OP_UPDATE, {"op_id_": op_id, "made_": attempt_no, **values})
        if result.rowcount != 1:
            raise self._stale(op_id, attempt_no)

    def _finish_success(
        self,
        case_id: str,
        step_seq: int,
        state: _OpState,
        attempt_no: int,
        provider: str,
        request_sha: str,
        reply: ProviderReply,
        now: datetime,
        cost_micros: int | None = None,
    ) -> Succeeded:
        # A paid reply is stored on a new connection when the database dropped the one in
        # use (a restart, a killed backend): given up, the attempt would stay "sent" until
        # its grace ran out and the same request would be paid for again. A commit whose
        # answer was lost may have landed: the retry then finds the attempt closed
        # (``_stale``) and the stage's own retry reads the stored success.
        for retry in range(STORE_RETRIES_ON_DISCONNECT + 1):
            try:
                with self.store.session() as session:
                    path, digest = self._store_response(
                        session, case_id, step_seq, state.id, attempt_no, reply.raw
                    )
                    self._close_attempt(session, state.id, attempt_no, {
                        "status": ATTEMPT_SUCCEEDED, "response_path": path,
                        "response_sha256": digest, "http_status": reply.http_status,
                        "prompt_tokens": reply.prompt_tokens,
                        "completion_tokens": reply.completion_tokens,
                        "finish_reason": reply.finish_reason, "cost_micros": cost_micros,
                        "finished_at": now,
                    })
                    self._update_operation(session, state.id, attempt_no, {
                        "status": OP_SUCCEEDED, "succeeded_attempt": attempt_no,
                        "response_sha256": digest, "retry_not_before": None,
                        "error_code": None, "error_message": None,
                    })
                break
            except DBAPIError as exc:
                if not exc.connection_invalidated or retry == STORE_RETRIES_ON_DISCONNECT:
                    raise
                log.warning("llm operation %s attempt %s: the database connection was lost "
                            "while the response was stored; storing it on a new one",
                            state.id, attempt_no)
        assert digest is not None
        return Succeeded(state.id, attempt_no, provider, reply.content, digest, request_sha,
                         reply.finish_reason, reply.completion_tokens)

    def _finish_failure(
        self,
        case_id: str,
        step_seq: int,
        state: _OpState,
        attempt_no: int,
        failure: Failure,
        now: datetime,
        op_values: Mapping[str, Any],
    ) -> None:
        with self.store.session() as session:
            path, digest = self._store_response(
                session, case_id, step_seq, state.id, attempt_no, failure.raw
            )
            self._close_attempt(session, state.id, attempt_no, {
                "status": ATTEMPT_REJECTED if failure.kind == "rejected" else ATTEMPT_FAILED,
                "response_path": path, "response_sha256": digest,
                "http_status": failure.http_status, "error_code": failure.code,
                "error_message": failure.message, "cost_micros": failure.cost_micros,
                "finished_at": now,
            })
            self._update_operation(session, state.id, attempt_no, op_values)

    def _finish_without_attempt(
        self, op_id: int, state: _OpState, status: str, code: str, message: str,
        kind: str = "configuration",
    ) -> Blocked:
        message = short(message)
        if kind == "credentials" and not code.startswith(PROVIDER_CREDENTIALS):
            code = PROVIDER_CREDENTIALS  # the stored code alone must say "credentials"
        with self.store.session() as session:
            self._update_operation(session, op_id, state.attempts_made, {
                "status": status, "error_code": code, "error_message": message,
            })
        if status == OP_EXHAUSTED:
            reason = BLOCK_PROVIDER_EXHAUSTED
        elif kind == "credentials":
            reason = BLOCK_PROVIDER_CREDENTIALS
        elif kind == "cost":
            reason = BLOCK_MODEL_COST_CAP
        else:
            reason = BLOCK_PROVIDER_CONFIGURATION
        return self._blocked(op_id, reason, code, message)

    @staticmethod
    def _blocked(op_id: int, reason: str, code: str, message: str) -> Blocked:
        # INFO: the step's outcome reports the block (a worker logs it as a WARNING with
        # this message, `run` prints it); a WARNING here repeated it on run's stderr.
        log.info("llm operation %s blocked: %s (%s): %s", op_id, reason, code, message)
        return Blocked(op_id, reason, code, message)

    @staticmethod
    def _stale(op_id: int, attempt_no: int) -> StaleStateError:
        return StaleStateError(
            f"llm operation {op_id} moved on while attempt {attempt_no} was in progress "
            "(another worker handled it); rerun the stage to read the recorded result",
            operation_id=op_id,
            attempt=attempt_no,
        )

    def _now(self) -> datetime:
        now = self._clock()
        if now.tzinfo is None:
            raise ValueError("the gateway clock must return timezone-aware datetimes")
        return now.astimezone(UTC)


# Statements of every model call, built once on the Core tables (building a statement
# costs more than running it on SQLite). The sessions that run them hold no ORM object of
# these rows, so nothing in an identity map needs synchronising.
_OP = table_of(LLMOperation)
_ATTEMPT = table_of(LLMAttempt)
#: Move an operation to its next attempt (a compare-and-set on ``attempts_made``).
_OP_BEGIN = _OP.update().where(
    _OP.c.id == bindparam("op_id_"), _OP.c.attempts_made == bindparam("made_"),
    # Two comparisons, not IN: a literal IN list is expanded per execution, which keeps
    # the statement off the driver's cursor (``store.direct``).
    or_(_OP.c.status == OP_PENDING, _OP.c.status == OP_RETRY_PENDING))
#: Close an operation's state at attempt ``made_`` (SET from the parameters given).
_OP_UPDATE = _OP.update().where(_OP.c.id == bindparam("op_id_"),
                                _OP.c.attempts_made == bindparam("made_"))
#: Close a ``sent`` attempt (SET from the parameters given).
_ATTEMPT_CLOSE = _ATTEMPT.update().where(
    _ATTEMPT.c.operation_id == bindparam("op_id_"), _ATTEMPT.c.attempt == bindparam("no_"),
    _ATTEMPT.c.status == ATTEMPT_SENT)
_ATTEMPT_LIVE = sa_select(_ATTEMPT.c.started_at).where(
    _ATTEMPT.c.operation_id == bindparam("op_id"), _ATTEMPT.c.status == ATTEMPT_SENT)
# No primary key fetched (nobody reads it); on PostgreSQL it goes out with the COMMIT
# (decision 139): a unique violation (a lost race) is raised there, as a stale attempt.
_ATTEMPT_INSERT = deferred(_ATTEMPT.insert())
#: The columns a new attempt leaves at their defaults (all ``None``).
_ATTEMPT_UNSET = {name: None for name in (
    "response_path", "response_sha256", "http_status", "error_code", "error_message",
    "prompt_tokens", "completion_tokens", "finish_reason", "cost_micros", "finished_at")}
#: The operations of one decision, oldest first.
_OPERATIONS = select(LLMOperation).where(
    col(LLMOperation.case_id) == bindparam("case_id"),
    col(LLMOperation.revision) == bindparam("revision"),
    col(LLMOperation.step_seq) == bindparam("step_seq")).order_by(col(LLMOperation.id))
#: Create an operation unless its unique (case, revision, step, retry id) exists; its id.
_OP_CREATE = {
    name: ins(_OP).on_conflict_do_nothing(
        index_elements=["case_id", "revision", "step_seq", "retry_id"]).returning(_OP.c.id)
    for name, ins in (("postgresql", pg_insert), ("sqlite", sqlite_insert))}
_OP_COLUMNS = [c.name for c in _OP.c if c.name != "id"]
_EARLIER = _OP.alias("earlier")
#: Create the step's first operation: nothing is inserted when the step has any (the
#: caller then picks among them); its id.
_OP_CREATE_FIRST = {
    name: ins(_OP).from_select(_OP_COLUMNS, sa_select(
        *(bindparam(c, type_=_OP.c[c].type) for c in _OP_COLUMNS)).where(~sa_exists().where(
            _EARLIER.c.case_id == bindparam("case_id"),
            _EARLIER.c.revision == bindparam("revision"),
            _EARLIER.c.step_seq == bindparam("step_seq")))).on_conflict_do_nothing(
        index_elements=["case_id", "revision", "step_seq", "retry_id"]).returning(_OP.c.id)
    for name, ins in (("postgresql", pg_insert), ("sqlite", sqlite_insert))}


def build_providers(config: ProvidersConfig, env: Mapping[str, str] = os.environ) -> list[Provider]:
    """Instantiate the ordered failover list of a providers file.

    Args:
        config: the loaded providers file; ``base_dir`` resolves scripted paths.
        env: where API key variables are looked up (at send time).

    Returns:
        One provider per ``[[providers]]`` entry, in file order.

    Raises:
        ProviderConfigurationError: ``PROVIDER_BAD_CONFIG`` for duplicate names, an
            OpenAI entry without ``base_url``/``model`` or a scripted entry without ``path``.
    """
    names = [p.name for p in config.providers]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ProviderConfigurationError(
            PROVIDER_BAD_CONFIG,
            f"provider names must be unique in the providers file; repeated: {duplicates}",
            names=duplicates,
        )
    providers: list[Provider] = []
    for entry in config.providers:
        if entry.kind == "openai":
            providers.append(OpenAIProvider(entry, env))
        else:
            providers.append(ScriptedProvider(entry, config.base_dir))
    return providers
