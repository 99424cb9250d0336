"""Fleet views over the store: the case list and the counts behind the metrics.

``investigate cases`` prints :func:`list_cases`; the metrics exporter turns
:func:`fleet_counts` into gauges at scrape time (``workers/metrics.py``). Both read only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import case, func
from sqlmodel import col, select

from investigation.constants import CASE_BLOCKED, CASE_INVESTIGATING
from investigation.errors import InvestigationError
from investigation.store.engine import Store
from investigation.store.models import BudgetAccount, CaseRecord, HypothesisBirth

#: Case states, in the order the case list and the metrics show them.
CASE_STATES = ("INVESTIGATING", "BLOCKED", "PAUSED", "BUILDING_DIAGNOSIS", "CANCELLED",
               "STOPPED")


@dataclass
class CaseRow:
    """One line of ``investigate cases`` (also its ``--json`` items)."""

    case_id: str
    state: str
    blocked_reason: str | None
    retry_not_before: str | None
    """ISO-8601 UTC; set while a provider backoff is pending."""
    revision: int
    steps: int
    """Published steps (the head checkpoint's seq)."""
    last_outcome: str | None
    last_reason: str | None
    updated_at: str
    """ISO-8601 UTC of the case row's last change (a published step, a block, a resume)."""
    hypotheses: int
    active_hypotheses: int
    balance_units: int
    """Sum of the current revision's account balances."""
    credit_units: int
    """Sum of the accounts' initial credits."""
    next: str | None = None
    """What an operator does next (filled by the guidance of ``investigate status``;
    ``None`` where there is nothing to say)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()


def normalise_state(state: str) -> str:
    """``blocked`` -> ``BLOCKED``; also ``building-diagnosis``.

    Raises:
        InvestigationError: ``STATE_UNKNOWN`` for a name that is no case state.
    """
    name = state.strip().upper().replace("-", "_")
    if name not in CASE_STATES:
        raise InvestigationError("STATE_UNKNOWN",
                                 f"{state!r} is not a case state; use one of "
                                 f"{', '.join(s.lower() for s in CASE_STATES)}")
    return name


def list_cases(store: Store, state: str | None = None, limit: int = 200) -> list[CaseRow]:
    """Cases, most recently changed first.

    Args:
        store: the SQL store (read only).
        state: only cases in this state (any spelling :func:`normalise_state` accepts).
        limit: at most this many rows (the newest).

    Raises:
        InvestigationError: ``STATE_UNKNOWN``.
    """
    wanted = normalise_state(state) if state else None
    with store.session() as s:
        query = select(CaseRecord)
        if wanted:
            query = query.where(CaseRecord.state == wanted)
        cases = s.exec(query.order_by(col(CaseRecord.updated_at).desc(), col(CaseRecord.id))
                       .limit(limit)).all()
        ids = [c.id for c in cases]
        sums: dict[str, tuple[int, int, int]] = {}
        births: dict[str, int] = {}
        if ids:
            active_count = func.sum(case((col(BudgetAccount.status) == "active", 1), else_=0))
            totals: Any = select(  # type: ignore[call-overload]
                BudgetAccount.case_id, BudgetAccount.revision,
                func.sum(BudgetAccount.balance_units), func.sum(BudgetAccount.credit_units),
                active_count)
            for case_id, revision, balance, credit, active in s.exec(
                    totals.where(col(BudgetAccount.case_id).in_(ids))
                    .group_by(col(BudgetAccount.case_id), col(BudgetAccount.revision))).all():
                sums[f"{case_id}/{revision}"] = (int(balance or 0), int(credit or 0),
                                                 int(active or 0))
            for case_id, revision, count in s.exec(
                    select(HypothesisBirth.case_id, HypothesisBirth.revision, func.count())
                    .where(col(HypothesisBirth.case_id).in_(ids))
                    .group_by(col(HypothesisBirth.case_id), col(HypothesisBirth.revision))
            ).all():
                births[f"{case_id}/{revision}"] = int(count)
    rows = []
    for c in cases:
        key = f"{c.id}/{c.current_revision}"
        hyps = births.get(key, 0)
        balance, credit, active = sums.get(key, (0, 0, hyps))
        rows.append(CaseRow(
            case_id=c.id, state=c.state, blocked_reason=c.blocked_reason,
            retry_not_before=_iso(c.retry_not_before), revision=c.current_revision,
            steps=c.head_seq, last_outcome=c.last_outcome, last_reason=c.last_reason,
            updated_at=_iso(c.updated_at) or "", hypotheses=hyps, active_hypotheses=active,
            balance_units=balance, credit_units=credit))
    return rows


def case_ids(store: Store, prefix: str = "", limit: int = 50) -> list[str]:
    """The ids of the store's cases that start with ``prefix``, most recently changed
    first, at most ``limit`` (for a shell's completion of a ``CASE`` argument)."""
    with store.reading() as conn:
        rows = conn.execute(select(CaseRecord.id)
                            .where(col(CaseRecord.id).startswith(prefix, autoescape=True))
                            .order_by(col(CaseRecord.updated_at).desc(), col(CaseRecord.id))
                            .limit(limit)).all()
    return [str(r[0]) for r in rows]


@dataclass
class FleetCounts:
    """What the store-derived gauges show (``workers/metrics.py``), at one instant."""

    cases_by_state: dict[str, int] = field(default_factory=dict)
    blocked_by_reason: dict[str, int] = field(default_factory=dict)
    pending_retries: int = 0
    """Investigating cases with a ``retry_not_before`` set (a provider backoff)."""
    oldest_retry_overdue_s: float = 0.0
    """Seconds since the oldest pending retry became due (0 when none is due yet): a
    backoff that passed long ago and did not run means no dispatch picked it up."""
    oldest_idle_s: float = 0.0
    """Seconds since the least recently changed investigating case without a running
    backoff last changed (0 when there is none): a stuck dispatch grows it."""


def fleet_counts(store: Store, now: datetime | None = None) -> FleetCounts:
    """Cases by state, blocked cases by reason and the age of the oldest pending work."""
    now = now or datetime.now(UTC)
    counts = FleetCounts(cases_by_state=dict.fromkeys(CASE_STATES, 0))
    with store.session() as s:
        for state, reason, n in s.exec(
                select(CaseRecord.state, CaseRecord.blocked_reason, func.count())
                .group_by(col(CaseRecord.state), col(CaseRecord.blocked_reason))).all():
            counts.cases_by_state[state] = counts.cases_by_state.get(state, 0) + int(n)
            if state == CASE_BLOCKED:
                key = reason or "UNKNOWN"
                counts.blocked_by_reason[key] = counts.blocked_by_reason.get(key, 0) + int(n)
        pending = s.exec(select(CaseRecord.retry_not_before, CaseRecord.updated_at)
                         .where(CaseRecord.state == CASE_INVESTIGATING)).all()
    for retry_not_before, updated_at in pending:
        if retry_not_before is not None:
            counts.pending_retries += 1
            due = _aware(retry_not_before)
            if due <= now:
                counts.oldest_retry_overdue_s = max(counts.oldest_retry_overdue_s,
                                                    (now - due).total_seconds())
                counts.oldest_idle_s = max(counts.oldest_idle_s, (now - due).total_seconds())
        else:
            counts.oldest_idle_s = max(counts.oldest_idle_s,
                                       (now - _aware(updated_at)).total_seconds())
    return counts


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
