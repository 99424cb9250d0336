"""The live rows against the head checkpoint, before a step builds on them.

Accounts (status, disposition, confidence, credit, balance, turns, iterations, invalid
streak, deferral, pending result, novelty streak), evidence records (ids, fingerprints,
assessment, refund) and question statuses must be what the head state recorded. The one
change allowed between steps is the import of an external test's result
(``test.feedback`` evidence of a closed request, which becomes its account's pending
result; ``docs/async-tests.md``).

Two depths, so that a step's cost does not grow with the case (issue 13):

* **full** (a process meeting the case first, after a redelivery, ``investigate
  verify``): every evidence record is compared with the values the checkpoint chain last
  recorded for it (a head state lists only the records open at the head and those its
  step closed; the full replay folds every state, ``checkpoints.fold_evidence``), its
  fingerprint is recomputed from its stored findings and its artifact bytes are read from
  the store and hashed again.
* **incremental** (every other step): the store refuses changes to a published evidence
  record's findings, fingerprint and artifact, to an assessed record and to a closed
  question, and refuses deleting them (``investigation.store.guards``); it refuses an
  evidence record older than the case's newest, a novelty-index row of any record but the
  newest, and an audit note of a published step (decision 121). What can still change
  between steps is therefore checked, and only that: the records newer than the head's
  newest (test results imported since), the index rows of those and of the head's newest
  record (as many as each found new items), the notes of steps after the head (none),
  every record that is not assessed (in the store or in the head state), every account
  and every question (both bounded by the policy, not by the number of steps). Nothing
  here reads a row per step of the case's history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy import and_, bindparam, case, func, literal, text
from sqlalchemy import select as sa_select
from sqlmodel import Session, col, select

from investigation import jsonio
from investigation.errors import InvestigationError, StoreError
from investigation.evidence.store import fingerprint, key_sha256
from investigation.loop.checkpoints import (
    KEY_COUNT,
    NOTE_COUNT,
    recorded_evidence_count,
    recorded_last_ordinal,
)
from investigation.store.blobs import ByteCache
from investigation.store.engine import Store, core
from investigation.store.models import (
    BudgetAccount,
    CaseRecord,
    Evidence,
    EvidenceKey,
    HypothesisNote,
    Question,
    TestRequest,
)

#: The predicate of the partial index ``ix_evidence_open``: records not assessed yet.
OPEN_EVIDENCE = text("NOT evidence.assessed")
# Statements built once (building a statement costs more than running it on SQLite).
_IMPORTED = select(TestRequest.evidence_id).where(
    col(TestRequest.case_id) == bindparam("case_id"),
    col(TestRequest.status).in_(("confirmed", "expired")),
    col(TestRequest.evidence_id).is_not(None))
_EVIDENCE_WHERE = (col(Evidence.case_id) == bindparam("case_id"),
                   col(Evidence.revision) == bindparam("revision"))
_EVIDENCE_ALL = select(Evidence).where(*_EVIDENCE_WHERE).order_by(col(Evidence.ordinal))
#: The columns the incremental check compares (the store lets nothing else change).
_EV = Evidence.__table__.c  # type: ignore[attr-defined]
_LIVE_COLUMNS = (_EV.evidence_id, _EV.hypothesis_id, _EV.fingerprint, _EV.assessed,
                 _EV.refund_units, _EV.ordinal)
_EVIDENCE_OPEN = sa_select(*_LIVE_COLUMNS).where(*_EVIDENCE_WHERE, OPEN_EVIDENCE)
#: On SQLite the partial index is named: without statistics its planner prefers the wider
#: evidence indexes and would read every record of the case.
_EVIDENCE_OPEN_SQLITE = text(
    "SELECT evidence_id, hypothesis_id, fingerprint, assessed, refund_units, ordinal "
    "FROM evidence INDEXED BY ix_evidence_open WHERE case_id = :case_id "
    "AND revision = :revision AND NOT assessed").columns(*_LIVE_COLUMNS)
_EVIDENCE_NAMED = sa_select(*_LIVE_COLUMNS).where(
    *_EVIDENCE_WHERE, col(Evidence.evidence_id).in_(bindparam("ids", expanding=True)))
#: A revision's evidence records, novelty-index rows and audit notes, counted in one query.
_COUNTS = sa_select(
    sa_select(func.count()).select_from(Evidence).where(*_EVIDENCE_WHERE).scalar_subquery(),
    KEY_COUNT.scalar_subquery(), NOTE_COUNT.scalar_subquery())
_KEYS_OF = sa_select(func.count()).select_from(EvidenceKey).where(
    col(EvidenceKey.case_id) == bindparam("case_id"),
    col(EvidenceKey.revision) == bindparam("revision"),
    col(EvidenceKey.evidence_id).in_(bindparam("ids", expanding=True)))
_KEY_ROWS = sa_select(col(EvidenceKey.hypothesis_id), col(EvidenceKey.key_sha256),
                      col(EvidenceKey.evidence_id)).where(
    col(EvidenceKey.case_id) == bindparam("case_id"),
    col(EvidenceKey.revision) == bindparam("revision"))
_K = EvidenceKey.__table__.c  # type: ignore[attr-defined]
_N = HypothesisNote.__table__.c  # type: ignore[attr-defined]
#: What can have changed since the head (decision 121; the store refuses the rest): the
#: revision's records newer than the head's newest (``last``), the records from that one
#: on whose index rows are not as many as the new items they found, and the notes of
#: steps after the head (``head_seq``). Each reads the rows after the head only.
_SINCE_HEAD = (
    sa_select(func.count()).select_from(Evidence).where(
        *_EVIDENCE_WHERE, _EV.ordinal > bindparam("last")).scalar_subquery(),
    sa_select(func.count()).select_from(Evidence).where(
        _EV.case_id == bindparam("case_id"), _EV.ordinal >= bindparam("last"),
        case((_EV.duplicate, 0), else_=_EV.new_item_count) != sa_select(func.count())
        .select_from(EvidenceKey).where(_K.case_id == _EV.case_id,
                                        _K.evidence_id == _EV.evidence_id)
        .scalar_subquery()).scalar_subquery(),
    sa_select(func.count()).select_from(HypothesisNote).where(
        _N.case_id == bindparam("case_id"), _N.revision == bindparam("revision"),
        _N.step_seq > bindparam("head_seq")).scalar_subquery())
_Q = Question.__table__.c  # type: ignore[attr-defined]
_ANCHOR = sa_select(literal(1).label("one")).subquery("anchor")


def _with_questions(*columns: Any) -> Any:
    """``columns`` and the revision's questions, in one query: one row per question (the
    columns on each), or one row of them and no question."""
    return sa_select(*columns, _Q.question_id, _Q.hypothesis_id, _Q.status, _Q.text) \
        .select_from(_ANCHOR.outerjoin(Question.__table__, and_(  # type: ignore[attr-defined]
            _Q.case_id == bindparam("case_id"), _Q.revision == bindparam("revision")))) \
        .order_by(_Q.ordinal)


#: Full depth: the counts of :data:`_COUNTS` and the questions.
_COUNTS_AND_QUESTIONS = _with_questions(*_COUNTS.selected_columns)
#: Incremental depth: :data:`_SINCE_HEAD` and the questions.
_SINCE_HEAD_AND_QUESTIONS = _with_questions(*_SINCE_HEAD)
_ACCOUNTS = select(BudgetAccount).where(col(BudgetAccount.case_id) == bindparam("case_id"),
                                        col(BudgetAccount.revision) == bindparam("revision"))
ACCOUNT_FIELDS = ("status", "disposition_reason", "confidence", "credit_units", "balance_units",
                  "turns", "iterations", "invalid_streak", "deferred_by", "deferred_step")


def _json(data: str) -> Any:
    try:
        return jsonio.loads(data)
    except ValueError:
        return None


class QuestionRow(NamedTuple):
    """A question as the live check reads it."""

    question_id: str
    hypothesis_id: int
    status: str
    text: str


@dataclass(frozen=True)
class LiveRows:
    """What :func:`verify_live_state` read and found as recorded: the revision's
    accounts (ORM objects of the caller's session), its questions in creation order
    (``question_id``, ``hypothesis_id``, ``status``, ``text``) and its number of evidence
    records."""

    accounts: list[BudgetAccount]
    questions: list[Any]
    evidence_count: int


def verify_live_state(s: Session, case: CaseRecord, head_state: dict[str, Any],
                      head_seq: int, head_revision: int, *, full: bool,
                      recorded: dict[str, dict[str, Any]] | None = None) -> LiveRows | None:
    """Check the live rows against ``head_state`` (the head checkpoint's state document).

    Args:
        head_seq: the head checkpoint's seq (0: nothing is checked).
        head_revision: its revision; rows of a newer revision start afresh.
        full: recompute every fingerprint and re-read every evidence artifact (see the
            module docstring); otherwise check only what the store lets change.
        recorded: with ``full``, every evidence record as the chain recorded it (a full
            replay's :attr:`~investigation.loop.checkpoints.Replay.evidence`); a head state
            holds only the records open at the head and those closed by its step.

    Returns:
        The accounts and questions checked (:class:`LiveRows`); ``None`` when nothing was
        checked (no checkpoint yet, or the head is of an older revision).

    Raises:
        InvestigationError: ``STATE_TAMPERED`` naming the first row that differs.
    """
    if head_seq == 0 or head_revision != case.current_revision:
        return None

    def tampered(what: str, many: bool = False) -> InvestigationError:
        # ``many``: a plural subject ("the questions differs" read as a slip, a hostile
        # trial).
        verb = "differ" if many else "differs"
        return InvestigationError("STATE_TAMPERED",
                                  f"case {case.id}: {what} {verb} from checkpoint "
                                  f"{head_seq}; the store was changed outside the engine",
                                  seq=head_seq)

    section = head_state.get("evidence")
    if full and recorded is not None:
        recorded_ev: dict[Any, dict[str, Any]] = dict(recorded)
    elif isinstance(section, dict):  # only what can still change is listed
        recorded_ev = {e.get("evidence_id"): e for e in section.get("open", [])
                       if isinstance(e, dict)}
    else:  # the first format: every record of the revision
        recorded_ev = {e.get("evidence_id"): e for e in
                       (section if isinstance(section, list) else []) if isinstance(e, dict)}
    recorded_count = recorded_evidence_count(head_state)
    imports: list[set[Any]] = []

    def imported() -> set[Any]:  # read only when a record is not listed (an import)
        if not imports:
            imports.append(set(s.connection().execute(
                _IMPORTED, {"case_id": case.id}).scalars().all()))
        return imports[0]

    rows = {"case_id": case.id, "revision": head_revision}
    conn = core(s)
    last_recorded = recorded_last_ordinal(head_state)
    # A head state of the first format names no newest record: counted in full.
    since_head = not full and last_recorded is not None and recorded_count is not None \
        and isinstance(section, dict) and isinstance(section.get("keys"), int) \
        and isinstance(head_state.get("notes"), int)
    if since_head:
        read = conn.execute(_SINCE_HEAD_AND_QUESTIONS, {
            **rows, "last": last_recorded, "head_seq": head_seq}).all()
    else:
        read = conn.execute(_COUNTS_AND_QUESTIONS, rows).all()
    first, second, third = read[0][:3]
    questions = [QuestionRow(r[3], r[4], r[5], r[6]) for r in read if r[3] is not None]
    live: list[Any]
    if full:
        every = list(s.exec(_EVIDENCE_ALL, params=rows).all())
        _check_evidence_bytes(s, case, every, tampered)
        live = list(every)
        count = len(live)
    else:
        count = int(recorded_count or 0) + int(first) if since_head else int(first)
        live = list(conn.execute(_EVIDENCE_OPEN_SQLITE if conn.dialect.name == "sqlite"
                                 else _EVIDENCE_OPEN, rows).all())
        seen = {e.evidence_id for e in live}
        closed = [eid for eid, e in recorded_ev.items()
                  if not e.get("assessed") and eid not in seen]
        if closed:  # recorded as open, assessed since: only a settlement may do that
            live += conn.execute(_EVIDENCE_NAMED, {**rows, "ids": closed}).all()
    # A record the head does not list can only be a test result imported since: newer
    # than every record the head counted (a bounded state lists only the open records,
    # so an old record reopened behind the engine's back is not excused as an import).
    last = section.get("last_ordinal") if isinstance(section, dict) else None
    newest = last if isinstance(last, int) else None
    pending_imports: set[str] = set()
    for e in live:
        rec = recorded_ev.get(e.evidence_id)
        if rec is None:
            if e.evidence_id not in imported() or e.assessed or \
                    (newest is not None and e.ordinal <= newest):
                raise tampered(f"evidence {e.evidence_id}")
            pending_imports.add(e.evidence_id)
            continue
        if (rec.get("hypothesis_id"), rec.get("fingerprint"), rec.get("assessed"),
                rec.get("refund_units")) != (e.hypothesis_id, e.fingerprint, e.assessed,
                                              e.refund_units):
            raise tampered(f"evidence {e.evidence_id}")
    if recorded_count != count - len(pending_imports) or \
            (full and recorded is not None and len(recorded_ev) != recorded_count):
        raise tampered("the evidence records", many=True)
    if since_head:
        # Index rows of a record other than the newest, and notes of a published step,
        # are refused by the store; so only these can differ from what the head counted.
        if int(second):
            raise tampered("the novelty index (evidence_key)")
        if int(third):
            raise tampered("the audit notes (hypothesis_note)", many=True)
    else:
        _check_written_rows(s, case, head_state, rows, live if full else None,
                            pending_imports, tampered, (int(second), int(third)))
    accounts = _check_accounts(s, case, head_state, head_revision, pending_imports, tampered)
    if [(q.question_id, q.hypothesis_id, q.status) for q in questions] != \
            [(q.get("question_id"), q.get("hypothesis_id"), q.get("status"))
             for q in head_state.get("questions", [])]:
        raise tampered("the questions", many=True)
    return LiveRows(accounts, questions, count)


def _check_written_rows(s: Session, case: CaseRecord, head_state: dict[str, Any],
                        rows: dict[str, Any], every_record: list[Evidence] | None,
                        pending_imports: set[str], tampered: Any,
                        counts: tuple[int, int]) -> None:
    """The novelty index and the audit notes against the head state's counts (states of
    the first format recorded neither: nothing to compare). With ``every_record`` (full
    depth) the index must be exactly what the records' item keys make: each key of a
    hypothesis once, naming the first record that found it.

    Args:
        counts: the revision's novelty-index rows and audit notes, counted."""
    live_keys, live_notes = counts
    section = head_state.get("evidence")
    keys = section.get("keys") if isinstance(section, dict) else None
    if isinstance(keys, int):
        imported_keys = int(s.connection().execute(_KEYS_OF, {
            **rows, "ids": sorted(pending_imports)}).scalar_one()) if pending_imports else 0
        if live_keys - imported_keys != keys:
            raise tampered("the novelty index (evidence_key)")
        if every_record is not None:
            expected: dict[tuple[int, str], str] = {}
            for e in sorted(every_record, key=lambda r: r.ordinal):
                for key in _json(e.item_keys_json) or []:
                    expected.setdefault((e.hypothesis_id, key_sha256(str(key))),
                                        e.evidence_id)
            stored = {(hid, sha): eid for hid, sha, eid in
                      s.connection().execute(_KEY_ROWS, rows).all()}
            if stored != expected:
                raise tampered("the novelty index (evidence_key)")
    notes = head_state.get("notes")
    if isinstance(notes, int) and live_notes != notes:
        raise tampered("the audit notes (hypothesis_note)", many=True)


def _check_evidence_bytes(s: Session, case: CaseRecord, live: list[Evidence],
                          tampered: Any) -> None:
    """Full depth: fingerprints recomputed from the findings, artifacts read again."""
    fresh = ByteCache()
    for e in live:
        items = _json(e.findings_json)
        arguments = _json(e.arguments_json)
        if not isinstance(items, list) or not isinstance(arguments, dict) or \
                e.fingerprint != fingerprint(e.operation, arguments, items):
            raise tampered(f"evidence {e.evidence_id}'s findings")
        try:
            art = Store.get_artifact(s, case.id, e.artifact_path, cache=fresh)
        except StoreError:
            art = None
        if art is None or art.sha256 != e.artifact_sha256:
            raise tampered(f"evidence {e.evidence_id}'s artifact")


def _check_accounts(s: Session, case: CaseRecord, head_state: dict[str, Any], revision: int,
                    pending_imports: set[str], tampered: Any) -> list[BudgetAccount]:
    accounts = list(s.exec(_ACCOUNTS, params={"case_id": case.id,
                                              "revision": revision}).all())
    recorded = {a.get("hypothesis_id"): a for a in head_state.get("accounts", [])
                if isinstance(a, dict)}
    for a in accounts:
        rec = recorded.get(a.hypothesis_id)
        if rec is None or any(rec.get(f) != getattr(a, f) for f in ACCOUNT_FIELDS):
            raise tampered(f"hypothesis {a.hypothesis_id}'s account")
        imported_now = a.pending_evidence_id in pending_imports
        if a.pending_evidence_id != rec.get("pending_evidence_id") and not imported_now:
            raise tampered(f"hypothesis {a.hypothesis_id}'s pending result")
        if a.no_novelty_streak != rec.get("no_novelty_streak") and not imported_now:
            raise tampered(f"hypothesis {a.hypothesis_id}'s novelty streak")
    if len(recorded) != len(accounts):
        raise tampered("the accounts", many=True)
    return accounts
