"""The stage framework: one transaction per stage, fencing, recorded outputs, delivery count.

``Stages`` (``loop.stages``) holds the eight stage bodies; this base class runs them. Rules:

* Idempotent by ``(case_id, revision, step_seq, stage)``: a finished stage has a
  ``stage_run`` row holding its output, written in the same transaction as its effects.
  Running it again returns that output and changes nothing.
* One transaction per stage: :meth:`StageFramework.run` opens it, locks the case row,
  checks the head (fencing), the stage's marker and an operator hold, counts the delivery
  of a stage with an external effect (``loop.deliveries``), and hands the same transaction to the stage body, whose first
  ``with self._tx() as s:`` block joins it and commits it at its end. A stage with an
  external effect (the model call, the snapshot query) commits before the effect and
  opens a second, fenced transaction for its result.
* Fenced: every write transaction first checks that the case head is still
  ``step_seq - 1`` on the same revision; a stale worker gets ``StaleStateError``.
* Per process, recorded outputs (immutable once committed) and the frozen policy of a
  revision (keyed by its sha256, re-checked every stage) are cached.
* On PostgreSQL a transaction that writes only what the engine can derive again (every
  stage's first one, and later ones opened with ``_tx(derived=True)``) commits without
  waiting for the disk (decision 126); one that records what came from outside waits.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, cast

from sqlalchemy import Integer, String, bindparam, func, insert
from sqlalchemy import column as sa_column
from sqlalchemy import select as sa_select
from sqlalchemy.exc import DBAPIError
from sqlmodel import Session

from investigation import jsonio
from investigation.budget import BudgetManager
from investigation.config import InvestigationConfig, canonical_json
from investigation.constants import BLOCKED, CASE_HELD, CASE_INVESTIGATING, STAGES
from investigation.errors import InvestigationError, StaleStateError
from investigation.loop import checkpoints, deliveries
from investigation.loop.deliveries import Delivery
from investigation.loop.env import StageEnv
from investigation.loop.outcome import Outcome, StageResult, StepKey
from investigation.store import direct
from investigation.store.engine import (
    ASYNC_COMMIT,
    CASE_COLUMNS,
    CASE_LOADED,
    Store,
    core,
    deferred,
    is_lost_race,
    is_serialization_failure,
    sha256_hex,
    table_of,
)
from investigation.store.models import (
    BudgetAccount,
    CaseRecord,
    StageRun,
    utcnow,
)

log = logging.getLogger(__name__)

SKIPPED: dict[str, Any] = {"skipped": True}
# Statements built once (building a statement costs more than running it on SQLite), on
# the Core table: stage markers are append-only rows the ORM never writes, so they are
# read and written on the session's connection (``Store.core``).
_RUN = table_of(StageRun).c
_STEP = (_RUN.case_id == bindparam("case_id"), _RUN.revision == bindparam("revision"),
         _RUN.step_seq == bindparam("step_seq"))
_MARKERS = sa_select(_RUN.stage, _RUN.output_json).where(*_STEP)
_MARKER = sa_select(_RUN.output_json).where(*_STEP, _RUN.stage == bindparam("stage"))
#: The marker is a stage transaction's last write and nobody reads its result: on
#: PostgreSQL it goes out with the COMMIT (decision 130).
_MARKER_INSERT = deferred(insert(table_of(StageRun)))
_CASE = table_of(CaseRecord).c
# The columns a stage's entry checks, read without building an ORM object (most stage
# bodies never touch the case row; the ORM object is loaded when one asks, ``_fence``),
# and, in the same query, every recorded stage output of the step (one row per marker;
# one row of NULLs when there is none): what a stage's entry reads on SQLite
# (``StageFramework._lock_case_and_markers``).
_CASE_JOIN_MARKERS = table_of(CaseRecord).outerjoin(
    table_of(StageRun), (_RUN.case_id == _CASE.id)
    & (_RUN.revision == bindparam("revision")) & (_RUN.step_seq == bindparam("step_seq")))
_CASE_AND_MARKERS = sa_select(
    _CASE.head_seq, _CASE.current_revision, _CASE.state, _CASE.llm_retry_id, _RUN.stage,
    _RUN.output_json).select_from(_CASE_JOIN_MARKERS).where(_CASE.id == bindparam("case_id"))
# A stage whose body changes the case row (``CASE_STAGES``) locks it and reads the whole
# row with the step's markers in one round trip (decision 141): on SQLite the joined
# query (the case row's columns first, as ``direct.loaded`` takes them).
_CASE_ROW_AND_MARKERS = sa_select(*CASE_COLUMNS, _RUN.stage, _RUN.output_json).select_from(
    _CASE_JOIN_MARKERS).where(_CASE.id == bindparam("case_id"))


class _Entry(NamedTuple):
    """The statement of a stage's entry on each database: PostgreSQL's in a transaction
    that waits for the disk, in one that does not (decision 126: ``set_config`` in the
    same statement, after the function has taken the lock), and SQLite's."""

    postgres: Any
    postgres_async: Any
    sqlite: Any


def _entry_function(name: str, columns: Any, sqlite: Any) -> _Entry:
    """The entry that calls the PL/pgSQL function ``name`` on PostgreSQL (it locks the case
    row, then reads the step's markers in a statement of its own, so after the lock was
    granted) and returns ``columns`` (the same names and types as the SQLite statement's).
    A SELECT of a table-valued function, so that it runs on the driver's cursor from its
    second execution (decision 134) with the columns' result types."""
    called = getattr(func, name)(
        bindparam("case_id", type_=String()), bindparam("revision", type_=Integer()),
        bindparam("step_seq", type_=Integer())).table_valued(
        *(sa_column(c.name, c.type) for c in columns))
    selected = [called.c[c.name] for c in columns]
    return _Entry(sa_select(*selected), sa_select(*selected, ASYNC_COMMIT), sqlite)


#: The columns the entry checks and the markers: on PostgreSQL the function of migration
#: ``0010_entry_function`` (decision 125).
_CHECK_ENTRY = _entry_function("investigation_case_and_markers",
                               _CASE_AND_MARKERS.selected_columns, _CASE_AND_MARKERS)
#: The whole case row and the markers: on PostgreSQL the function of migration
#: ``0011_case_entry_function`` (decision 141).
_ROW_ENTRY = _entry_function("investigation_case_row_and_markers",
                             _CASE_ROW_AND_MARKERS.selected_columns, _CASE_ROW_AND_MARKERS)
#: ``Session.info`` key: this transaction commits asynchronously on PostgreSQL.
_ASYNC = "investigation_async_commit"
# A revision's budget accounts, read on the driver's cursor and taken into the session as
# ORM objects (``direct.loaded``, decision 139).
_ACCOUNT_LOADED, _ACCOUNT_COLUMNS = direct.loaded_rows(BudgetAccount)
_ACC = table_of(BudgetAccount).c
_ACCOUNTS = sa_select(*_ACCOUNT_COLUMNS).where(
    _ACC.case_id == bindparam("case_id"), _ACC.revision == bindparam("revision"))
_ACCOUNTS_ORDERED = _ACCOUNTS.order_by(_ACC.hypothesis_id)
_ACCOUNT = _ACCOUNTS.where(_ACC.hypothesis_id == bindparam("hid"))
#: Times a stage runs again after its transaction lost a PostgreSQL serialization race.
RACE_RETRIES = 5
#: Stage outputs kept per process (eight per step).
RECORDED_OUTPUTS = 8 * 256


def _loads(text: str | bytes) -> Any:
    return jsonio.loads(text)


class _Recorded(OrderedDict[tuple[StepKey, str], dict[str, Any]]):
    """Recorded stage outputs, the most recent :data:`RECORDED_OUTPUTS` (a long-lived
    worker process runs any number of steps)."""

    def __setitem__(self, key: tuple[StepKey, str], value: dict[str, Any]) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > RECORDED_OUTPUTS:
            self.popitem(last=False)


class _AlreadyRecorded(Exception):
    """Another runner finished this stage while we waited for the case lock."""

    def __init__(self, output: dict[str, Any]) -> None:
        super().__init__("stage already recorded")
        self.output = output


def _log_parked(key: StepKey, stage: str, parked: Outcome) -> None:
    log.error("case %s step %s %s: parked %s after %s deliveries that never returned; fix "
              "the cause, then `investigate resume %s`", key.case_id, key.step_seq, stage,
              parked.reason, parked.details["unfinished"] - 1, key.case_id)


@dataclass
class _Open:
    """The stage transaction ``run`` opened and fenced, until the body takes it over. The
    case row is locked; its ORM object is loaded when the body first asks for it."""

    session: Session
    key: StepKey
    check: _CaseCheck
    case: CaseRecord | None = None
    joined: bool = False


@dataclass(frozen=True)
class _CaseCheck:
    """What a stage's entry checks of the (locked) case row."""

    head_seq: int
    current_revision: int
    state: str
    llm_retry_id: str


@dataclass
class _Attempt:
    """What one attempt of a stage did with its delivery count."""

    counted: bool = False  # counted in the stage transaction
    committed: bool = False  # and that transaction committed
    early: bool = False  # the stage ended at the checks (recorded, held, parked)


class StageFramework:
    """Runs stage bodies (``_<stage>(key)`` methods of a subclass). ``run(stage, key)`` is
    the only entry point runtimes use.

    Args:
        env: what the stages need in this process (store, policy, gateway, routers).
    """

    #: Stages whose body opens the case's snapshot: it is opened (its own read of the
    #: store) before the stage transaction, which on SQLite holds the write lock.
    SNAPSHOT_STAGES: frozenset[str] = frozenset()
    #: Stages whose body changes the case row: its ORM object is loaded at the entry (the
    #: others check its columns with one Core query and load it only if a body asks).
    CASE_STAGES: frozenset[str] = frozenset()
    #: Stages whose first transaction commits before an external effect (the model call,
    #: the query): an ordinary delivery is counted in that transaction, so a worker that
    #: dies during the effect has its delivery counted. Any other stage writes all it
    #: writes in one transaction, where a count would commit with the stage's marker (and
    #: never be read again) or be lost with it; its deliveries are counted only apart
    #: (``_count_apart``: a redelivery, a process meeting the case first).
    EFFECT_STAGES: frozenset[str] = frozenset()

    def __init__(self, env: StageEnv) -> None:
        self.env = env
        self.store = env.store
        # Recorded stage outputs are immutable once committed, so they are cached.
        self._recorded = _Recorded()
        self._open: _Open | None = None
        self._attempt = _Attempt()
        #: Cases whose deliveries this process has counted (a first one is counted apart).
        self._met: set[str] = set()
        #: Frozen policies by (policy sha256, config identity).
        self._policies: dict[tuple[str, int, bool], tuple[InvestigationConfig,
                                                          BudgetManager]] = {}

    # -- running a stage ---------------------------------------------------------------

    def run(self, stage: str, key: StepKey, delivery: Delivery | None = None) -> StageResult:
        """Run ``stage`` of step ``key`` once; a finished stage returns its recorded output.

        Args:
            delivery: how the runtime delivered the stage; ``None`` (the in-process
                ``Investigator``) counts nothing.

        Raises:
            StaleStateError: the case head moved past this step (a newer worker won).
            InvestigationError: unsafe input, exceeded limits or a changed policy.
        """
        if stage not in STAGES:
            raise InvestigationError("STAGE_UNKNOWN", f"unknown stage {stage!r}")
        done = self._recorded.get((key, stage))
        if done is not None and stage != "build_context":
            # Recorded outputs are immutable; a step's first stage still goes to the store,
            # so a head rewritten under a long-lived runner is seen (below).
            return StageResult(done, self._recorded_halt(stage, key, done))
        count_here = delivery is not None
        apart = False  # counted (and committed) before the stage transaction
        if delivery is not None and (delivery.redelivered or key.case_id not in self._met):
            apart, parked = self._count_apart(stage, key, delivery)
            if parked is not None:
                return StageResult({}, parked)
            count_here = False
            done = self._recorded.get((key, stage))
            if done is not None and stage != "build_context":
                return StageResult(done, self._recorded_halt(stage, key, done))
        fn: Callable[[StepKey], StageResult] = getattr(self, "_" + stage)
        for attempt in range(RACE_RETRIES + 1):
            self._attempt = _Attempt(counted=apart, committed=apart)
            try:
                try:
                    result = self._run_once(fn, stage, key, delivery if count_here else None)
                except InvestigationError:
                    if self._attempt.counted:  # a controlled error: the delivery returned
                        deliveries.delivery_returned(self.store, key, stage,
                                                     counted=self._attempt.committed)
                    raise
                break
            except _AlreadyRecorded as done_by_other:
                self._recorded[(key, stage)] = done_by_other.output
                return StageResult(done_by_other.output,
                                   self._recorded_halt(stage, key, done_by_other.output))
            except DBAPIError as exc:
                if not is_lost_race(exc):
                    raise
                # A concurrent duplicate finished this stage first: return its output.
                with self.store.session() as s:
                    self._load_markers(s, key)
                done = self._recorded.get((key, stage))
                if done is not None:
                    return StageResult(done, self._recorded_halt(stage, key, done))
                if not is_serialization_failure(exc) or attempt == RACE_RETRIES:
                    raise
                # The transaction lost a race and wrote nothing: run the stage again.
                log.info("case %s step %s %s: serialization failure, running it again",
                         key.case_id, key.step_seq, stage)
        if result.halt is None or stage == "publish":  # committed with its marker
            if result.halt is None or not self._attempt.early:
                self._recorded[(key, stage)] = result.output
                result = replace(result, fresh=True)
        elif self._attempt.counted and (apart or not self._attempt.early):
            # The delivery returned without its marker (RETRY_PENDING, BLOCKED, a hold): it
            # did not kill its worker. (One parked in the stage transaction stays counted.)
            deliveries.delivery_returned(self.store, key, stage,
                                         counted=self._attempt.committed)
        return result

    def _run_once(self, fn: Callable[[StepKey], StageResult], stage: str, key: StepKey,
                  delivery: Delivery | None) -> StageResult:
        """One attempt: open the stage transaction, check and count, run the body."""
        if stage in self.SNAPSHOT_STAGES:
            self.env.router(key.case_id)
        s = Session(self.store.engine, expire_on_commit=False)
        attempt = self._attempt
        try:
            early = self._enter(s, stage, key, delivery)
            if isinstance(early, StageResult):
                s.commit()
                attempt.early = True
                attempt.committed = True
                return early
            opened = self._open = _Open(s, key, *early)
            result = fn(key)
            if not opened.joined:  # the body never used the transaction: end it
                s.commit()
                attempt.committed = True
            if attempt.counted and attempt.committed:
                self._met.add(key.case_id)
            return result
        except BaseException:
            s.rollback()
            raise
        finally:
            self._open = None
            s.close()

    def _enter(self, s: Session, stage: str, key: StepKey,
               delivery: Delivery | None) -> tuple[_CaseCheck, CaseRecord | None] | StageResult:
        """The checks at the start of a stage transaction; a result ends the stage early.
        Otherwise the columns checked, and the case row's ORM object when one was needed
        (counting a delivery may park the case)."""
        row: CaseRecord | None = None
        markers: list[tuple[str, str]]
        # Every stage's first transaction writes only what the engine can derive again
        # from what is durable (decision 126): it commits without waiting for the disk.
        if self.env.async_commit:
            s.info[_ASYNC] = True
        if stage in self.CASE_STAGES:  # the body changes the case row: load it at once
            row, markers = self._lock_case_row_and_markers(s, key)
            case = _CaseCheck(row.head_seq, row.current_revision, row.state, row.llm_retry_id)
        else:
            case, markers = self._lock_case_and_markers(s, key)
        self._reconcile(stage, key, markers)
        if stage == "build_context":
            self._remember_markers(key, markers)
        if (key, "publish") in self._recorded and case.head_seq < key.step_seq:
            # Publishing writes its marker and moves the head in one transaction.
            self._recorded.clear()
            raise InvestigationError(
                "CHECKPOINT_INVALID",
                f"step {key.step_seq} of {key.case_id} was published but the case head "
                f"is {case.head_seq}: checkpoints or the head were changed",
                seq=key.step_seq)
        done = self._recorded.get((key, stage))
        if done is None and stage != "build_context":
            # This stage's marker (another runner finished it) and the earlier stages'
            # outputs this process has not seen (another worker process ran them), read
            # with the case lock above.
            self._remember_markers(key, markers)
            done = self._recorded.get((key, stage))
        if done is not None:
            return StageResult(done, self._recorded_halt(stage, key, done))
        if case.head_seq >= key.step_seq or case.current_revision != key.revision:
            raise StaleStateError(
                f"step {key.step_seq} of {key.case_id} is already published",
                head_seq=case.head_seq)
        if case.head_seq != key.step_seq - 1:
            raise StaleStateError(
                f"case {key.case_id} head is {case.head_seq}, step {key.step_seq} is stale",
                head_seq=case.head_seq)
        if case.state in CASE_HELD:
            # An operator pause or cancel: stop at this stage boundary. Every finished
            # stage is kept; a resumed case continues with this very stage.
            return StageResult({}, Outcome(BLOCKED, key.case_id, key.step_seq, case.state))
        if case.state != CASE_INVESTIGATING:
            raise StaleStateError(f"case {key.case_id} is {case.state}", state=case.state)
        if delivery is not None and stage in self.EFFECT_STAGES:
            self._attempt.counted = True
            parked = deliveries.count(s, row, key, stage, delivery.max_unfinished)
            if parked is not None:
                _log_parked(key, stage, parked)
                return StageResult({}, parked)
        return case, row

    def _reconcile(self, stage: str, key: StepKey, markers: list[tuple[str, str]]) -> None:
        """Check this process's recorded outputs of the step against the markers the store
        holds (read under the case lock). A cached output whose marker is gone was lost
        by the store: an asynchronous commit that a crash of the PostgreSQL server did not
        keep (decision 126; worker processes outlive it). Every cached output may then
        predate the loss: they are all forgotten, with the case's replay cache. The first
        stage goes on from the store; a later one stops as stale (the recovery sweep
        dispatches the case again, and its step is redone from ``build_context``).

        Raises:
            StaleStateError: a stage before ``stage`` was lost.
        """
        stored = {name for name, _ in markers}
        lost = [name for name in STAGES if (key, name) in self._recorded and name not in stored]
        if not lost:
            return
        log.warning("case %s step %s %s: the store no longer holds %s that this process saw "
                    "committed (a database server crash?); recorded outputs are forgotten",
                    key.case_id, key.step_seq, stage, ", ".join(lost))
        self._recorded.clear()
        self.env.replay_cache.forget(key.case_id)
        self._met.discard(key.case_id)
        if stage != "build_context" and STAGES.index(lost[0]) < STAGES.index(stage):
            raise StaleStateError(
                f"step {key.step_seq} of {key.case_id}: the store lost the outputs of "
                f"{', '.join(lost)}; the step is redone from the store", lost=lost)

    def _count_apart(self, stage: str, key: StepKey, delivery: Delivery) -> deliveries.Apart:
        """Count a delivery that may follow a lost one in its own transaction, before the
        stage (:func:`deliveries.count_apart`); after a redelivery, replay the whole chain
        (no cache)."""
        apart = deliveries.count_apart(self.store, key, stage, delivery.max_unfinished,
                                       delivery.redelivered, async_commit=self.env.async_commit)
        parked = apart.parked
        if delivery.redelivered:
            # Full replay after a redelivery: now (the chain up to the head), and again with
            # the live rows at the next build_context (its cache entry is gone).
            self.env.replay_cache.forget(key.case_id)
            with self.store.session() as s:
                case = s.get(CaseRecord, key.case_id)
                if case is not None and stage != "build_context":
                    checkpoints.replay(s, case)
                self._load_markers(s, key)
        self._met.add(key.case_id)
        if parked is not None:
            _log_parked(key, stage, parked)
        return apart

    @contextmanager
    def _tx(self, *, derived: bool = False) -> Iterator[Session]:
        """A stage body's transaction: the first one joins (and ends) the transaction
        ``run`` opened and fenced; any later one is new (and must fence itself).

        Args:
            derived: a later transaction writes only what the engine can derive again
                from what is durable: on PostgreSQL its commit does not wait for the disk
                (decision 126; its fence sets it). A later transaction that records what
                came from outside (a query's result, a test handed out) leaves it False.
                The first transaction is always derived."""
        opened = self._open
        if opened is not None and not opened.joined:
            opened.joined = True
            try:
                yield opened.session
                opened.session.commit()
                self._attempt.committed = True
            except BaseException:
                opened.session.rollback()
                raise
            finally:
                self._open = None
            return
        with self.store.session() as s:
            if derived and self.env.async_commit:
                s.info[_ASYNC] = True
            yield s

    # -- inside a stage ----------------------------------------------------------------

    @staticmethod
    def _lock_case_and_markers(s: Session,
                               key: StepKey) -> tuple[_CaseCheck, list[tuple[str, str]]]:
        """Lock the case row and read the columns the entry checks (no ORM object) and
        the step's recorded stage outputs (as stored, not yet taken in), in one round trip:
        on SQLite one query, whose transaction holds the write lock before its first
        statement; on PostgreSQL the function
        ``investigation_case_and_markers`` (migration ``0010_entry_function``), which
        reads the markers in a second statement after the row lock is granted (a
        statement's snapshot is taken when it starts, so markers read by the locking
        statement itself could predate a runner that held the lock while it waited)."""
        rows = StageFramework._entry_rows(s, key, _CHECK_ENTRY)
        first = rows[0]
        return (_CaseCheck(int(first[0]), int(first[1]), str(first[2]), str(first[3])),
                [(str(r[4]), r[5]) for r in rows if r[4] is not None])

    @staticmethod
    def _entry_rows(s: Session, key: StepKey, entry: _Entry) -> list[Any]:
        """The rows of ``entry`` for the step, the statement chosen by database and by
        whether this transaction commits asynchronously.

        Raises:
            InvestigationError: ``CASE_NOT_FOUND`` (no row).
        """
        conn = core(s)
        statement = entry.sqlite if conn.dialect.name != "postgresql" else \
            entry.postgres_async if s.info.get(_ASYNC) else entry.postgres
        rows = list(conn.execute(statement, key.to_dict()).all())
        if not rows:
            raise InvestigationError("CASE_NOT_FOUND", f"no case {key.case_id}")
        return rows

    @staticmethod
    def _lock_case_row_and_markers(s: Session, key: StepKey
                                   ) -> tuple[CaseRecord, list[tuple[str, str]]]:
        """Lock the case row and read it whole, as its ORM object (refreshed, as
        ``Store.lock_case`` loads it), with the step's recorded stage outputs, in one round
        trip (decision 141): on SQLite one joined query; on PostgreSQL the function
        ``investigation_case_row_and_markers`` (migration ``0011_case_entry_function``),
        which reads both after the row lock is granted.

        Raises:
            InvestigationError: ``CASE_NOT_FOUND``.
        """
        rows = StageFramework._entry_rows(s, key, _ROW_ENTRY)
        stage_at = len(CASE_COLUMNS)
        case = cast(CaseRecord, direct.loaded(s, CASE_LOADED, rows[:1], refresh=True)[0])
        return case, [(str(r[stage_at]), r[stage_at + 1]) for r in rows
                      if r[stage_at] is not None]

    def _load_markers(self, s: Session, key: StepKey) -> None:
        """Read every recorded stage output of the step in one query."""
        self._remember_markers(key, core(s).execute(_MARKERS, key.to_dict()).all())

    def _remember_markers(self, key: StepKey, rows: Any) -> None:
        """Take in the step's recorded stage outputs ``(stage, output_json)``."""
        for stage, text in rows:
            if (key, stage) in self._recorded:
                continue  # recorded outputs never change
            try:
                out = _loads(text)
            except ValueError:
                out = None
            if not isinstance(out, dict) or (stage == "build_context"
                                             and "finalize" not in out):
                raise InvestigationError(
                    "CHECKPOINT_INVALID",
                    f"the recorded {stage} of step {key.step_seq} of {key.case_id} is "
                    "not a stage record: the store was changed outside the engine",
                    seq=key.step_seq)
            self._recorded[(key, stage)] = out

    def _output(self, s: Session, key: StepKey, stage: str) -> dict[str, Any]:
        out = self._recorded.get((key, stage))
        if out is None:
            self._load_markers(s, key)
            out = self._recorded.get((key, stage))
        if out is None:
            raise InvestigationError(
                "STAGE_ORDER", f"stage {stage} of step {key.step_seq} has not finished")
        return out

    @staticmethod
    def _complete(s: Session, key: StepKey, stage: str, output: dict[str, Any]) -> StageResult:
        core(s).execute(_MARKER_INSERT, {**key.to_dict(), "stage": stage,
                                   "output_json": canonical_json(output).decode(),
                                   "completed_at": utcnow()})
        return StageResult(output)

    def _fence(self, s: Session, key: StepKey, stage: str, *, active: bool = True) -> CaseRecord:
        """Lock the case row and check the head; then re-check the stage's marker. Returns
        the case row's ORM object (:meth:`_fenced` does the same checks without one).

        In the transaction ``run`` opened this was done already (the case row is returned).
        The marker check inside a later fenced transaction closes the race in which two
        runners both passed the first check: the second one finds the first one's marker
        here and returns its recorded output instead of redoing the stage.
        """
        opened = self._open
        if opened is not None and opened.session is s and opened.key == key:
            if opened.case is None:  # locked and checked at the entry; now the object
                opened.case = Store.lock_case(s, key.case_id)
            return opened.case
        case = Store.lock_case(s, key.case_id, async_commit=bool(s.info.get(_ASYNC)))
        self._check_fence(s, key, stage, case.head_seq, case.current_revision, case.state,
                          active)
        return case

    def _fenced(self, s: Session, key: StepKey, stage: str) -> _CaseCheck:
        """:meth:`_fence` for a body that does not change the case row: the same lock and
        checks, read with one Core query (no ORM object); returns the columns checked."""
        opened = self._open
        if opened is not None and opened.session is s and opened.key == key:
            return opened.check
        # The lock and the step's markers in one round trip (as at a stage's entry).
        case, markers = self._lock_case_and_markers(s, key)
        self._check_fence(s, key, stage, case.head_seq, case.current_revision, case.state,
                          True, markers)
        return case

    @staticmethod
    def _check_fence(s: Session, key: StepKey, stage: str, head_seq: int, revision: int,
                     state: str, active: bool,
                     markers: list[tuple[str, str]] | None = None) -> None:
        """Raise unless the step is still the head's next and ``stage`` unrecorded; the
        step's ``markers`` when read with the lock, else the stage's is read here."""
        if head_seq != key.step_seq - 1 or revision != key.revision:
            raise StaleStateError(
                f"case {key.case_id} head is {head_seq}, step {key.step_seq} is stale",
                head_seq=head_seq)
        if markers is None:
            row = core(s).execute(_MARKER, {**key.to_dict(), "stage": stage}).first()
            recorded = None if row is None else row[0]
        else:
            recorded = next((text for name, text in markers if name == stage), None)
        if recorded is not None:
            raise _AlreadyRecorded(dict(_loads(recorded)))
        if active and state not in (CASE_INVESTIGATING, *CASE_HELD):
            # A stage already running when the operator paused or cancelled finishes.
            raise StaleStateError(f"case {key.case_id} is {state}", state=state)

    @staticmethod
    def _recorded_halt(stage: str, key: StepKey, out: dict[str, Any]) -> Outcome | None:
        if stage == "publish":
            return Outcome(out["outcome"], key.case_id, key.step_seq, out.get("reason"),
                           hypothesis_id=out.get("hypothesis_id"))
        return None

    def _policy(self, s: Session, key: StepKey) -> tuple[InvestigationConfig, BudgetManager]:
        """The frozen policy of the step's revision and its budget manager.

        After ``build_context`` the store is not read again when this process has the
        policy already: the recorded ``build_context`` names the policy's sha256, and it
        committed with the policy frozen, which the store then refuses to change
        (``store.guards``: a revision's policy columns change only while unset). The
        checkpoint replay re-checks the stored policy against its hash (decision 127).

        Raises:
            InvestigationError: ``POLICY_CHANGED`` (see ``BudgetManager.freeze_policy``).
        """
        built = self._recorded.get((key, "build_context"))
        frozen = None if built is None else built.get("policy_sha256")
        if frozen:
            cached = self._policies.get((frozen, id(self.env.config), self.env.explicit_config))
            if cached is not None:
                return cached
        # The policy columns only (no ORM object) while the frozen policy is cached.
        policy_sha, policy_text = Store.policy_columns(s, key.case_id, key.revision)
        cache_key = (policy_sha or "", id(self.env.config), self.env.explicit_config)
        cached = self._policies.get(cache_key)
        if cached is None or policy_text is None or \
                sha256_hex(policy_text.encode("utf-8")) != policy_sha:
            rev = Store.revision(s, key.case_id, key.revision)
            cfg = BudgetManager.freeze_policy(s, rev, self.env.config,
                                              self.env.explicit_config)
            cached = (cfg, BudgetManager(cfg.budget, cfg.loop))
            policy_sha = rev.policy_sha256
            if rev.policy_sha256:
                self._policies[(rev.policy_sha256, id(self.env.config),
                                self.env.explicit_config)] = cached
        if built is not None and built.get("policy_sha256") not in (None, policy_sha):
            # The step was planned under another policy: a swap between its stages.
            raise InvestigationError(
                "POLICY_CHANGED",
                f"the policy of revision {key.revision} changed during step {key.step_seq}",
                step_seq=key.step_seq)
        return cached

    @staticmethod
    def _accounts(s: Session, key: StepKey) -> list[BudgetAccount]:
        """The step's revision's budget accounts, by hypothesis id; the session's own
        objects where it holds them (as an ORM query, whose autoflush this keeps)."""
        s.flush()
        return direct.loaded(s, _ACCOUNT_LOADED, core(s).execute(_ACCOUNTS_ORDERED, {
            "case_id": key.case_id, "revision": key.revision}))

    @staticmethod
    def _account(s: Session, key: StepKey, hid: int) -> BudgetAccount:
        """Hypothesis ``hid``'s budget account (:meth:`_accounts`).

        Raises:
            sqlalchemy.exc.NoResultFound: the revision has no such account."""
        s.flush()
        row = core(s).execute(_ACCOUNT, {"case_id": key.case_id, "revision": key.revision,
                                         "hid": hid}).one()
        return cast(BudgetAccount, direct.loaded(s, _ACCOUNT_LOADED, [row])[0])

    def _context_bytes(self, s: Session, key: StepKey) -> tuple[dict[str, Any], bytes]:
        """The step's recorded ``build_context`` and its stored context's exact bytes
        (canonical JSON, as ``context.fit`` wrote them)."""
        built = self._output(s, key, "build_context")
        art = Store.get_artifact(s, key.case_id, built["context_path"])
        if art is None or art.sha256 != built["context_sha256"]:
            raise InvestigationError(
                "CONTEXT_IDENTITY", f"the stored context of step {key.step_seq} was changed")
        return built, art.data

    def _context_doc(self, s: Session, key: StepKey) -> tuple[dict[str, Any], dict[str, Any]]:
        built, data = self._context_bytes(s, key)
        return built, dict(jsonio.loads_shared(data, built["context_sha256"]))
