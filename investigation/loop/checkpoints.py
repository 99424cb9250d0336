"""Hash-chained state checkpoints (seed 000, "Persistence and recovery").

Checkpoint ``seq`` of a case binds ``parent_hash`` (the hash of ``seq - 1``, ``None`` for
the first) and the sha256 of its state document::

    hash = sha256(canonical_json({"case_id", "seq", "parent_hash", "state_sha256",
                                  "context_sha256", "hypothesis_id"}))

State documents hold no wall-clock time, so the same decisions give the same hashes.

Every checkpoint also records its **archive digest**, a hash chained per generation: the
previous generation's digest, the checkpoint's rows and the sha256 of its state bytes,
context bytes and recorded ``build_context`` (:func:`archive_digest`). Generation ``n``'s
digest therefore stands for the bytes of generations ``1..n``.

Replay validation (:func:`replay`, run by ``build_context`` before every step) checks
sequence, parent references, hashes, state bytes, context identity, the selected
hypothesis, the state pointer and the frozen policy. A process validates the whole chain
from the stored bytes when it first meets a case (and after a redelivery, at export and on
``investigate verify``); after that it keeps ``(seq, archive digest)`` of the validated
prefix (:class:`ReplayCache`) and, at the next step, reads and checks only the generations
published since, chaining their newly computed digests onto the cached one and comparing
them with the recorded ones. The prefix cannot change behind the cache: the store refuses
UPDATE and DELETE of checkpoints, stage records and artifact bytes
(``investigation.store.guards``); what someone who can drop those guards changes is found
by the next full replay (docs/decisions.md, "Incremental replay").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, bindparam, func, insert, literal, literal_column, text, union_all
from sqlalchemy import select as sa_select
from sqlmodel import Session, col

from investigation import jsonio
from investigation.config import canonical_json
from investigation.constants import ARTIFACT_CONTEXT, ARTIFACT_STATE, POINTER_STATE
from investigation.errors import InvestigationError, StoreError
from investigation.loop.outcome import StepKey
from investigation.store import blobs
from investigation.store.blobs import ByteCache
from investigation.store.engine import (
    RevisionColumns,
    Store,
    core,
    deferred,
    sha256_hex,
    table_of,
)
from investigation.store.models import (
    Artifact,
    BudgetAccount,
    CaseRecord,
    Checkpoint,
    Evidence,
    EvidenceKey,
    HypothesisNote,
    ManifestPointer,
    Question,
    RevisionRecord,
    StageRun,
    utcnow,
)

# Statements built once (building a statement costs more than running it on SQLite).
# The chain's top seq and size, and the newest step with a recorded publish, in one query.
_CHAIN_SIZE = sa_select(
    func.max(col(Checkpoint.seq)), func.count(),
    sa_select(func.max(col(StageRun.step_seq))).where(
        col(StageRun.case_id) == bindparam("case_id"), col(StageRun.stage) == "publish")
    .scalar_subquery()).where(col(Checkpoint.case_id) == bindparam("case_id"))
_BUILT = sa_select(col(StageRun.output_json)).where(
    col(StageRun.case_id) == bindparam("case_id"), col(StageRun.revision) == bindparam("rev"),
    col(StageRun.step_seq) == bindparam("seq"), col(StageRun.stage) == "build_context")
_POINTER = sa_select(col(ManifestPointer.path), col(ManifestPointer.sha256)).where(
    col(ManifestPointer.case_id) == bindparam("case_id"),
    col(ManifestPointer.name) == POINTER_STATE)
_CP = table_of(Checkpoint).c
_ART = table_of(Artifact).c
_RUNS = table_of(StageRun).c
_POINTERS = table_of(ManifestPointer).c
_REVS = table_of(RevisionRecord).c
_CHAIN = table_of(Checkpoint).alias("chain")
_PUBLISHED = table_of(StageRun).alias("published")
#: The columns of a checkpoint a replay checks and chains.
_CHECKPOINT_COLUMNS = (_CP.seq, _CP.revision, _CP.parent_hash, _CP.hash, _CP.state_path,
                       _CP.context_sha256, _CP.hypothesis_id, _CP.outcome, _CP.reason,
                       _CP.archive_digest)
#: The checkpoints of a case from ``seq`` on, each with the sha256 its state artifact row
#: records and the text of its recorded ``build_context``, and on every row the chain's
#: top seq and size, the newest step with a recorded publish and the state pointer: what
#: a replay reads but the context artifacts, in one query (:data:`_CHAIN_SIZE` and
#: :data:`_POINTER` alone when there is no checkpoint from ``seq`` on).
_GENERATIONS = sa_select(
    *_CHECKPOINT_COLUMNS,
    sa_select(_ART.sha256).where(_ART.case_id == _CP.case_id, _ART.path == _CP.state_path)
    .scalar_subquery().label("state_artifact"),
    sa_select(_RUNS.output_json).where(
        _RUNS.case_id == _CP.case_id, _RUNS.revision == _CP.revision,
        _RUNS.step_seq == _CP.seq, _RUNS.stage == "build_context")
    .scalar_subquery().label("built"),
    sa_select(func.max(_CHAIN.c.seq)).where(_CHAIN.c.case_id == bindparam("case_id"))
    .scalar_subquery().label("top"),
    sa_select(func.count()).select_from(_CHAIN).where(
        _CHAIN.c.case_id == bindparam("case_id")).scalar_subquery().label("count"),
    sa_select(func.max(_PUBLISHED.c.step_seq)).where(
        _PUBLISHED.c.case_id == bindparam("case_id"), _PUBLISHED.c.stage == "publish")
    .scalar_subquery().label("published"),
    sa_select(_POINTERS.path).where(_POINTERS.case_id == bindparam("case_id"),
                                    _POINTERS.name == POINTER_STATE)
    .scalar_subquery().label("pointer_path"),
    sa_select(_POINTERS.sha256).where(_POINTERS.case_id == bindparam("case_id"),
                                      _POINTERS.name == POINTER_STATE)
    .scalar_subquery().label("pointer_sha256"),
    *(sa_select(column).where(_REVS.case_id == bindparam("case_id"),
                              _REVS.revision == bindparam("revision"))
      .scalar_subquery().label(column.name)
      for column in (_REVS.interpretation_json, _REVS.policy_sha256, _REVS.policy_json)),
).where(_CP.case_id == bindparam("case_id"), _CP.seq >= bindparam("seq")) \
    .order_by(_CP.seq)
#: The sha256 recorded for artifact paths of a case (the replayed generations' contexts).
_ARTIFACT_SHAS = sa_select(_ART.path, _ART.sha256).where(
    _ART.case_id == bindparam("case_id"), _ART.path.in_(bindparam("paths", expanding=True)))
#: Paths looked up in one statement (SQLite's bound-parameter limit is 32,766).
_PATHS_PER_LOOKUP = 500
_STATE_EVIDENCE_COLUMNS = (
    col(Evidence.evidence_id), col(Evidence.hypothesis_id), col(Evidence.fingerprint),
    col(Evidence.assessed), col(Evidence.refund_units))
_OF_REVISION = (col(Evidence.case_id) == bindparam("case_id"),
                col(Evidence.revision) == bindparam("revision"))
#: The records still open to assessment (the partial index ``ix_evidence_open``).
_STATE_OPEN = sa_select(*_STATE_EVIDENCE_COLUMNS).where(
    *_OF_REVISION, text("NOT evidence.assessed")).order_by(col(Evidence.ordinal))
#: The same on SQLite, whose planner (no statistics) prefers the wider evidence indexes
#: and would read every record of the case: the partial index is named.
_STATE_OPEN_SQLITE = text(
    "SELECT evidence_id, hypothesis_id, fingerprint, assessed, refund_units FROM evidence "
    "INDEXED BY ix_evidence_open WHERE case_id = :case_id AND revision = :revision "
    "AND NOT assessed ORDER BY ordinal")


def open_evidence_statement(s: Session) -> Any:
    """The statement reading the open records' state columns on ``s``'s database."""
    return _STATE_OPEN_SQLITE if s.get_bind().dialect.name == "sqlite" else _STATE_OPEN
#: The records created since the parent checkpoint (newer than its newest, ``last_ordinal``)
#: with their novelty-index rows, and the records open there that are assessed now: two
#: index ranges (``newer`` tells them apart). The store refuses an older record and index
#: rows of any record but the newest (decision 121), so the parent's counts plus these
#: are the revision's counts.
_KEYS_OF_RECORD = sa_select(func.count()).select_from(table_of(EvidenceKey)).where(
    table_of(EvidenceKey).c.case_id == col(Evidence.case_id),
    table_of(EvidenceKey).c.evidence_id == col(Evidence.evidence_id)).scalar_subquery()
_STATE_SINCE = union_all(
    sa_select(*_STATE_EVIDENCE_COLUMNS, col(Evidence.ordinal), literal(1).label("newer"),
              _KEYS_OF_RECORD.label("keys")).where(
        *_OF_REVISION, col(Evidence.ordinal) > bindparam("last_ordinal")),
    sa_select(*_STATE_EVIDENCE_COLUMNS, col(Evidence.ordinal), literal(0).label("newer"),
              literal(0).label("keys")).where(
        col(Evidence.case_id) == bindparam("case_id"),
        col(Evidence.evidence_id).in_(bindparam("open_ids", expanding=True)),
        # Unary plus: no index on ``revision`` or ``ordinal`` for this branch, so SQLite
        # (no statistics) looks the ids up in the (case_id, evidence_id) key rather than
        # scanning every record of the revision or every older ordinal; the rows are put
        # in order in Python (an ORDER BY on the union made it merge along
        # ``ix_evidence_ordinal``). 0.7 ms at step 500 against 0.03 at step 5 before.
        text("+evidence.revision = :revision AND evidence.assessed "
             "AND +evidence.ordinal <= :last_ordinal")))
#: The same with a third branch (``newer`` 2): the records still open now, the state's
#: ``open`` list, read in the same statement (decision 142). On SQLite the branch names the
#: partial index, as :data:`_STATE_OPEN_SQLITE` does.
_STATE_OPEN_BRANCH_COLUMNS = (literal(2).label("newer"), literal(0).label("keys"))
_STATE_SINCE_AND_OPEN: dict[str, Any] = {
    "postgresql": union_all(*_STATE_SINCE.selects, sa_select(
        *_STATE_EVIDENCE_COLUMNS, col(Evidence.ordinal), *_STATE_OPEN_BRANCH_COLUMNS).where(
        *_OF_REVISION, text("NOT evidence.assessed"))),
    "sqlite": union_all(*_STATE_SINCE.selects, sa_select(
        *(literal_column(f"evidence.{name}") for name in (
            "evidence_id", "hypothesis_id", "fingerprint", "assessed", "refund_units",
            "ordinal")), *_STATE_OPEN_BRANCH_COLUMNS).select_from(
        text("evidence INDEXED BY ix_evidence_open")).where(
        text("evidence.case_id = :case_id AND evidence.revision = :revision "
             "AND NOT evidence.assessed"))),
}
#: Every assessed record of a revision (after a parent state of the first format).
_STATE_ALL_CLOSED = sa_select(*_STATE_EVIDENCE_COLUMNS).where(
    *_OF_REVISION, text("evidence.assessed")).order_by(col(Evidence.ordinal))
_STATE_COUNTS = sa_select(func.count(), func.max(col(Evidence.ordinal))).where(*_OF_REVISION)
#: Rows of the novelty index and audit notes of a revision (write-once; the live check
#: compares these counts, so a row inserted behind the engine's back is found).
KEY_COUNT = sa_select(func.count()).select_from(EvidenceKey).where(
    col(EvidenceKey.case_id) == bindparam("case_id"),
    col(EvidenceKey.revision) == bindparam("revision"))
NOTE_COUNT = sa_select(func.count()).select_from(HypothesisNote).where(
    col(HypothesisNote.case_id) == bindparam("case_id"),
    col(HypothesisNote.revision) == bindparam("revision"))
_STATE_QUESTIONS = sa_select(
    col(Question.question_id), col(Question.hypothesis_id), col(Question.status)).where(
    col(Question.case_id) == bindparam("case_id"),
    col(Question.revision) == bindparam("revision")).order_by(col(Question.ordinal))
#: Nobody reads the insert's result: on PostgreSQL it goes out with publishing's next
#: statement (decision 130); a second publisher's unique violation is raised there.
_CHECKPOINT_INSERT = deferred(insert(table_of(Checkpoint)))
_PARENT_DIGEST = sa_select(col(Checkpoint.archive_digest)).where(
    col(Checkpoint.case_id) == bindparam("case_id"), col(Checkpoint.seq) == bindparam("seq"))
_EV = table_of(Evidence).c
_KEYS = table_of(EvidenceKey).c
_NOTES = table_of(HypothesisNote).c
_QS = table_of(Question).c
#: What publishing a step reads besides its rows, in one query (:class:`StepFacts`): the
#: facts on every row (the revision's policy columns too, for the state's
#: ``policy_sha256``), one row per question of the revision (or one without a question).
#: Nothing in it reads a row per earlier step: the notes are those of the steps after the
#: parent checkpoint (the store refuses a note of a published step, decision 121).
_STEP_FACTS = sa_select(
    sa_select(_POINTERS.path).where(_POINTERS.case_id == bindparam("case_id"),
                                    _POINTERS.name == POINTER_STATE).scalar_subquery(),
    sa_select(_POINTERS.sha256).where(_POINTERS.case_id == bindparam("case_id"),
                                      _POINTERS.name == POINTER_STATE).scalar_subquery(),
    sa_select(func.count()).select_from(table_of(HypothesisNote)).where(
        _NOTES.case_id == bindparam("case_id"), _NOTES.revision == bindparam("revision"),
        _NOTES.step_seq > bindparam("parent_seq")).scalar_subquery(),
    sa_select(_CP.archive_digest).where(_CP.case_id == bindparam("case_id"),
                                        _CP.seq == bindparam("parent_seq")).scalar_subquery(),
    sa_select(_ART.created_at).where(_ART.case_id == bindparam("case_id"),
                                     _ART.path == bindparam("context_path")).scalar_subquery(),
    *(sa_select(column).where(_REVS.case_id == bindparam("case_id"),
                              _REVS.revision == bindparam("revision")).scalar_subquery()
      for column in (_REVS.policy_sha256, _REVS.policy_json)),
    _QS.question_id, _QS.hypothesis_id, _QS.status,
).select_from(sa_select(literal(1).label("one")).subquery("anchor").outerjoin(
    table_of(Question), and_(_QS.case_id == bindparam("case_id"),
                             _QS.revision == bindparam("revision")))).order_by(_QS.ordinal)


@dataclass(frozen=True)
class StepFacts:
    """What publishing step ``key`` reads besides its rows (:func:`step_facts`, one
    query): the state pointer, the revision's audit notes of steps after the parent
    checkpoint (``notes_since``), the parent checkpoint's archive digest, when the step's
    context was stored, and the revision's questions in creation order (``question_id``,
    ``hypothesis_id``, ``status``)."""

    pointer_path: str | None
    pointer_sha256: str | None
    notes_since: int
    parent_digest: str | None
    context_created_at: Any
    questions: tuple[tuple[str, int, str], ...] = ()


def step_facts(s: Session, key: StepKey) -> StepFacts:
    """The :class:`StepFacts` of step ``key`` (read before it publishes).

    The revision's policy columns come with them and are kept for this transaction
    (``Store.policy_columns`` then reads nothing: one statement less a step)."""
    rows = core(s).execute(_STEP_FACTS, {
        "case_id": key.case_id, "revision": key.revision, "parent_seq": key.step_seq - 1,
        "context_path": ARTIFACT_CONTEXT.format(seq=key.step_seq)}).all()
    path, sha, notes, parent, created, policy_sha, policy_text = rows[0][:7]
    Store.remember_policy_columns(s, key.case_id, key.revision, policy_sha, policy_text)
    questions = tuple((r[7], r[8], r[9]) for r in rows if r[7] is not None)
    return StepFacts(path, sha, int(notes or 0), parent, created, questions)


#: State documents this process published or parsed, by the sha256 of their bytes
#: (content-addressed, so never stale; read-only). The incremental replay reads the head
#: state at every step; a bounded state (decision 74) is a few kilobytes of JSON. As many
#: as the replay cache keeps cases (``ReplayCache``, 256): a worker serving more cases at
#: once than it keeps states would parse every head again at every step.
_STATES: OrderedDict[str, dict[str, Any]] = OrderedDict()
_STATES_KEPT = 256


def _remember_state(sha: str, state: dict[str, Any]) -> None:
    _STATES[sha] = state
    _STATES.move_to_end(sha)
    while len(_STATES) > _STATES_KEPT:
        _STATES.popitem(last=False)


def checkpoint_hash(case_id: str, seq: int, parent_hash: str | None, state_sha256: str,
                    context_sha256: str | None, hypothesis_id: int | None) -> str:
    """The checkpoint hash (see the module docstring)."""
    return sha256_hex(canonical_json({
        "case_id": case_id, "seq": seq, "parent_hash": parent_hash,
        "state_sha256": state_sha256, "context_sha256": context_sha256,
        "hypothesis_id": hypothesis_id,
    }))


def _evidence_record(row: Any) -> dict[str, Any]:
    eid, hid, fp, assessed, refund = row
    return {"evidence_id": eid, "hypothesis_id": hid, "fingerprint": fp,
            "assessed": bool(assessed), "refund_units": refund}


def evidence_section(s: Session, key: StepKey, parent: dict[str, Any],
                     facts: StepFacts | None = None) -> dict[str, Any]:
    """The state's ``evidence``: ``{"count", "last_ordinal", "keys", "open", "closed"}``.

    ``count`` is the number of current-revision records, ``last_ordinal`` the newest
    one's ordinal (``E<ordinal>``) and ``keys`` the rows of the novelty index
    (``evidence_key``); ``open`` lists every record not assessed yet and
    ``closed`` every record assessed since the parent checkpoint (open there, or created
    after it), each as ``{evidence_id, hypothesis_id, fingerprint, assessed,
    refund_units}``. A record is written once open and once closed, so the chain of
    states records every record's values (a full replay folds them,
    :func:`fold_evidence`) while a state's size stays bounded by the records open at
    once (issue 13; docs/decisions.md, "A bounded state"). A parent of another revision
    has nothing open; a parent of the first format (``evidence`` as the list of every
    record) makes this state list every assessed record once.

    The counts are the parent's plus what was created since it: the store refuses a
    record older than the case's newest and index rows of any record but the newest
    (decision 121), so only the records newer than the parent's newest are read. After a
    parent of the first format they are counted in full.

    Args:
        parent: the parent checkpoint's state document (``{}`` for the first).
        facts: the step's :class:`StepFacts` when read already (unused here; kept for
            the callers' symmetry with :func:`state_document`).
    """
    del facts
    rows = {"case_id": key.case_id, "revision": key.revision}
    before = parent.get("evidence") if parent.get("revision") == key.revision else None
    previous = before if isinstance(before, dict) else {}
    raw = (previous.get("count"), previous.get("last_ordinal"), previous.get("keys")) \
        if previous else (0, 0, 0)
    base = [v for v in raw if isinstance(v, int)]
    if isinstance(before, list):
        # The first format (every record listed): every assessed record closes here, and
        # the counts are taken in full once.
        count, last = core(s).execute(_STATE_COUNTS, rows).one()
        closed = core(s).execute(_STATE_ALL_CLOSED, rows).all()
        still_open = core(s).execute(open_evidence_statement(s), rows).all()
        keys = int(core(s).execute(KEY_COUNT, rows).scalar_one())
        count, last = int(count), int(last or 0)
    elif len(base) != 3:
        # No counts to add to (the first step, another revision's parent): taken in full.
        count, last = core(s).execute(_STATE_COUNTS, rows).one()
        closed, _, _, _, still_open = _closed_since(s, rows, previous)
        keys = int(core(s).execute(KEY_COUNT, rows).scalar_one())
        count, last = int(count), int(last or 0)
    else:
        closed, newer, newest, new_keys, still_open = _closed_since(s, rows, previous)
        count = base[0] + newer
        last = max(base[1], newest)
        keys = base[2] + new_keys
    return {"count": count, "last_ordinal": last, "keys": keys,
            "open": [_evidence_record(r) for r in still_open],
            "closed": [_evidence_record(r) for r in closed]}


def _closed_since(s: Session, rows: dict[str, Any], previous: dict[str, Any],
                  ) -> tuple[list[Any], int, int, int, list[Any]]:
    """The records assessed since the parent's evidence section ``previous`` (its open
    records now assessed, and assessed records created since), the number of records
    created since, the newest one's ordinal (``0``: none), their index rows, and the
    records open now; one statement (:data:`_STATE_SINCE_AND_OPEN`), rows in ordinal
    order."""
    open_ids = [str(e.get("evidence_id")) for e in previous.get("open", [])
                if isinstance(e, dict)]
    last_before = previous.get("last_ordinal")
    dialect = "sqlite" if s.get_bind().dialect.name == "sqlite" else "postgresql"
    read = list(core(s).execute(_STATE_SINCE_AND_OPEN[dialect], {
        **rows, "open_ids": open_ids,
        "last_ordinal": last_before if isinstance(last_before, int) else 0}).all())
    read.sort(key=lambda r: int(r.ordinal))
    newer = [r for r in read if r.newer == 1]
    return ([r[:5] for r in read if r.newer != 2 and r.assessed], len(newer),
            max((int(r.ordinal) for r in newer), default=0),
            sum(int(r.keys) for r in newer), [r[:5] for r in read if r.newer == 2])


def fold_evidence(recorded: dict[str, dict[str, Any]], state: dict[str, Any]) -> None:
    """Fold one generation's evidence section into ``recorded`` (evidence id -> the
    values the chain last recorded for it): a list of every record (the first format)
    replaces what was folded, ``open`` and ``closed`` update it."""
    section = state.get("evidence")
    if isinstance(section, list):
        recorded.clear()
        entries: list[Any] = section
    elif isinstance(section, dict):
        entries = [*section.get("open", []), *section.get("closed", [])]
    else:
        entries = []
    for entry in entries:
        if isinstance(entry, dict):
            recorded[str(entry.get("evidence_id"))] = entry


def recorded_last_ordinal(state: dict[str, Any]) -> int | None:
    """The ordinal of the newest current-revision record a bounded state counted (``0``:
    none); ``None`` for a state of the first format or not a state."""
    section = state.get("evidence")
    if isinstance(section, dict) and isinstance(section.get("last_ordinal"), int):
        return int(section["last_ordinal"])
    return None


def recorded_evidence_count(state: dict[str, Any]) -> int | None:
    """How many current-revision records a state says exist (``None``: not a state)."""
    section = state.get("evidence")
    if isinstance(section, list):
        return len(section)
    if isinstance(section, dict) and isinstance(section.get("count"), int):
        return int(section["count"])
    return None


def state_document(s: Session, key: StepKey, case: CaseRecord, accounts: list[BudgetAccount],
                   outcome: str, reason: str | None, hypothesis_id: int | None,
                   context_sha256: str | None,
                   parent: dict[str, Any] | None = None,
                   facts: StepFacts | None = None) -> dict[str, Any]:
    """The investigation state after a step: accounts, evidence (:func:`evidence_section`),
    questions, outcome.

    Args:
        parent: the parent checkpoint's state document; read through the state pointer
            when not given (``{}`` for the first step).
        facts: the step's :class:`StepFacts` (pointer and counts) when read already.
    """
    rows = {"case_id": key.case_id, "revision": key.revision}
    if parent is None:
        if key.step_seq <= 1:
            parent = {}
        else:
            if facts is not None:
                path, sha = facts.pointer_path, facts.pointer_sha256
            else:
                pointer = core(s).execute(_POINTER, {"case_id": key.case_id}).first()
                path, sha = (pointer[0], pointer[1]) if pointer is not None else (None, None)
            if path != ARTIFACT_STATE.format(seq=key.step_seq - 1):
                # Never a state built on nothing: a pointer deleted (or moved) after this
                # step's replay made it fold an empty parent into a new checkpoint, which
                # then named itself as the head (a fleet trial; only `verify` saw it).
                raise _invalid(key.case_id, key.step_seq - 1,
                               f"the {POINTER_STATE} pointer is missing or does not name "
                               "the head state")
            parent = _state_named(s, key.case_id, path, sha)
    evidence = evidence_section(s, key, parent, facts)
    questions = facts.questions if facts is not None else \
        core(s).execute(_STATE_QUESTIONS, rows).all()
    return {
        "case_id": key.case_id,
        "revision": key.revision,
        "seq": key.step_seq,
        "hypothesis_id": hypothesis_id,
        "outcome": outcome,
        "reason": reason,
        "case_state": case.state,
        "blocked_reason": case.blocked_reason,
        "context_sha256": context_sha256,
        "policy_sha256": Store.policy_columns(s, key.case_id, key.revision)[0],
        "accounts": [
            {
                "hypothesis_id": a.hypothesis_id, "status": a.status,
                "disposition_reason": a.disposition_reason, "confidence": a.confidence,
                "credit_units": a.credit_units, "balance_units": a.balance_units,
                "turns": a.turns, "iterations": a.iterations,
                "pending_evidence_id": a.pending_evidence_id,
                "invalid_streak": a.invalid_streak, "no_novelty_streak": a.no_novelty_streak,
                "deferred_by": a.deferred_by, "deferred_step": a.deferred_step,
                "last_rejection": jsonio.loads(a.last_rejection_json)
                if a.last_rejection_json else None,
            }
            for a in accounts
        ],
        "evidence": evidence,
        "notes": _notes_count(s, key, parent, facts),
        "questions": [
            {"question_id": qid, "hypothesis_id": hid, "status": status}
            for qid, hid, status in questions
        ],
    }


def _notes_count(s: Session, key: StepKey, parent: dict[str, Any],
                 facts: StepFacts | None) -> int:
    """The revision's audit notes: the parent state's count plus the notes of the steps
    after it (the store refuses a note of a published step, decision 121), or counted in
    full (a parent of the first format, no facts read)."""
    same = parent.get("revision") == key.revision
    before = parent.get("notes") if same else 0
    if facts is not None and isinstance(before, int):
        return before + facts.notes_since
    return int(core(s).execute(NOTE_COUNT, {"case_id": key.case_id,
                                            "revision": key.revision}).scalar_one())


def _state_named(s: Session, case_id: str, path: str | None,
                 sha: str | None) -> dict[str, Any]:
    """The state document a pointer ``(path, sha)`` names (``{}`` without a pointer)."""
    if path is None:
        return {}
    state = _STATES.get(sha or "")
    if state is None:
        art = Store.get_artifact(s, case_id, path)
        state = _json_object(art.data) if art is not None else {}
        if art is not None:
            _remember_state(art.sha256, state)
    return state


def archive_digest(previous: str, case_id: str, cp: Checkpoint | _Stored,
                   state_sha256: str | None,
                   context_sha256: str | None, build_context_sha256: str | None) -> str:
    """The archive digest after generation ``cp``: it binds the previous generation's digest
    (``""`` before the first), the checkpoint's rows, and the sha256 of its state bytes,
    its context bytes and the text of its recorded ``build_context``."""
    return sha256_hex(canonical_json({
        "previous": previous, "case_id": case_id, "seq": cp.seq, "revision": cp.revision,
        "parent_hash": cp.parent_hash, "hash": cp.hash, "state_path": cp.state_path,
        "context_sha256": cp.context_sha256, "hypothesis_id": cp.hypothesis_id,
        "outcome": cp.outcome, "reason": cp.reason,
        "state_artifact": state_sha256, "context_artifact": context_sha256,
        "build_context": build_context_sha256,
    }))


def text_sha256(text: str) -> str:
    """The sha256 of a stored text column (a stage record), as the archive digest binds it."""
    return sha256_hex(text.encode("utf-8", "surrogatepass"))


def publish(s: Session, key: StepKey, case: CaseRecord, state: dict[str, Any],
            context_sha256: str | None, hypothesis_id: int | None, outcome: str,
            reason: str | None, build_context_text: str | None,
            facts: StepFacts | None = None) -> _Stored:
    """Store the state artifact and insert checkpoint ``key.step_seq`` with its archive
    digest (chained onto the parent checkpoint's).

    The unique ``(case_id, seq)`` makes a second publisher fail; the caller also
    compare-and-sets the case head in the same transaction.

    Args:
        build_context_text: the step's recorded ``build_context`` output as stored.
        facts: the step's :class:`StepFacts` (the parent's archive digest) when read.

    Returns:
        The checkpoint as written (its ``hash`` and ``state_path`` among its columns).
    """
    data = canonical_json(state)
    path = ARTIFACT_STATE.format(seq=key.step_seq)
    digest = Store.put_artifact(s, key.case_id, path, data)
    _remember_state(digest, dict(state))
    state["_state_sha256"] = digest
    parent = case.head_hash if key.step_seq > 1 else None
    previous = ""
    if key.step_seq > 1:
        previous = (facts.parent_digest if facts is not None else core(s).execute(
            _PARENT_DIGEST, {"case_id": key.case_id, "seq": key.step_seq - 1}).scalar()) or ""
    cp = _Stored(
        seq=key.step_seq, revision=key.revision, parent_hash=parent,
        hash=checkpoint_hash(key.case_id, key.step_seq, parent, digest, context_sha256,
                             hypothesis_id),
        state_path=path, context_sha256=context_sha256, hypothesis_id=hypothesis_id,
        outcome=outcome, reason=reason, archive_digest=None, state_artifact=digest,
        built=build_context_text, context_artifact=context_sha256)
    cp.archive_digest = archive_digest(
        previous, key.case_id, cp, digest, context_sha256,
        text_sha256(build_context_text) if build_context_text is not None else None)
    # Checkpoints are append-only rows the ORM never writes: one Core INSERT of every
    # column (a second publisher fails on the unique (case_id, seq), here on SQLite, at
    # the transaction's next statement on PostgreSQL, decision 130).
    core(s).execute(_CHECKPOINT_INSERT, {
        "case_id": key.case_id, "revision": cp.revision, "seq": cp.seq,
        "parent_hash": cp.parent_hash, "hash": cp.hash, "state_path": cp.state_path,
        "context_sha256": cp.context_sha256, "hypothesis_id": cp.hypothesis_id,
        "outcome": cp.outcome, "reason": cp.reason, "archive_digest": cp.archive_digest,
        "created_at": utcnow()})
    return cp


def verify_chain(s: Session, case_id: str) -> int:
    """Verify every checkpoint of a case from the first, re-reading every byte from the
    store (no cache); returns the count.

    Raises:
        InvestigationError: ``CHECKPOINT_INVALID``/``POLICY_CHANGED`` (see
        :func:`replay`); ``CASE_NOT_FOUND`` for an unknown case.
    """
    case = s.get(CaseRecord, case_id)
    if case is None:
        raise InvestigationError("CASE_NOT_FOUND", f"no case {case_id}")
    return replay(s, case).head_seq


def _invalid(case_id: str, seq: int, what: str) -> InvestigationError:
    return InvestigationError("CHECKPOINT_INVALID",
                              f"checkpoint {seq} of {case_id}: {what}", seq=seq)


class ReplayCache:
    """Generations already validated in this process, per case (a bounded LRU).

    An entry ``"<case_id>|<limits_key>" -> (seq, archive_digest)`` lets :func:`replay`
    skip generations ``1..seq`` under the same limits while the checkpoint ``seq`` still
    records that digest; only later generations are read and checked, and their digests
    are chained onto it.

    Args:
        max_cases: cases remembered. Default 256.
    """

    def __init__(self, max_cases: int = 256) -> None:
        self.max_cases = max_cases
        self._entries: OrderedDict[str, tuple[int, str]] = OrderedDict()

    def get(self, case_id: str) -> tuple[int, str] | None:
        entry = self._entries.get(case_id)
        if entry is not None:
            self._entries.move_to_end(case_id)
        return entry

    def put(self, case_id: str, seq: int, digest: str) -> None:
        self._entries[case_id] = (seq, digest)
        self._entries.move_to_end(case_id)
        while len(self._entries) > self.max_cases:
            self._entries.popitem(last=False)

    def forget(self, case_id: str) -> None:
        """Drop every entry of a case (any limits): its next replay is a full one."""
        for key in [k for k in self._entries if k.split("|", 1)[0] == case_id]:
            del self._entries[key]


def _json_object(data: str | bytes) -> dict[str, Any]:
    """A stored JSON object; anything else is a tampered record (``{}`` fails every check)."""
    try:
        value = jsonio.loads(data)
    except (ValueError, UnicodeError):
        return {}
    return value if isinstance(value, dict) else {}


@dataclass
class _Generation:
    state: dict[str, Any]
    state_sha256: str
    context_sha256: str | None
    build_context_sha256: str | None


@dataclass
class _Stored:
    """One checkpoint as a replay reads it: its row, the sha256 its state artifact row
    records (``None``: no such row), its recorded ``build_context`` text and the sha256
    recorded for its context artifact (``None``: no such row)."""

    seq: int
    revision: int
    parent_hash: str | None
    hash: str
    state_path: str
    context_sha256: str | None
    hypothesis_id: int | None
    outcome: str
    reason: str | None
    archive_digest: str | None
    state_artifact: str | None
    built: str | None
    context_artifact: str | None = None


def _load(s: Session, sha: str | None, fresh: ByteCache | None) -> bytes | None:
    """The bytes an artifact row names (``None`` when there is no row or they are
    missing or altered)."""
    if sha is None:
        return None
    try:
        return blobs.load(s, sha, cache=fresh)
    except StoreError:
        return None


def _verify_generation(s: Session, case_id: str, cp: _Stored, parent: str | None,
                       fresh: ByteCache | None) -> _Generation:
    """Fully check one checkpoint: its bytes, hash, parent, context and hypothesis."""
    if cp.parent_hash != parent:
        raise _invalid(case_id, cp.seq, "its parent reference is broken")
    data = _load(s, cp.state_artifact, fresh)
    if data is None or cp.state_artifact is None:
        raise _invalid(case_id, cp.seq, f"state {cp.state_path} is missing or altered")
    if checkpoint_hash(case_id, cp.seq, parent, cp.state_artifact, cp.context_sha256,
                       cp.hypothesis_id) != cp.hash:
        raise _invalid(case_id, cp.seq, "its hash does not bind its state")
    state = _STATES.get(cp.state_artifact) if fresh is None else None
    if state is None:
        state = _json_object(data)
        _remember_state(cp.state_artifact, state)
    if (state.get("seq"), state.get("case_id"), state.get("hypothesis_id"),
            state.get("context_sha256"), state.get("outcome"), state.get("reason")) != \
            (cp.seq, case_id, cp.hypothesis_id, cp.context_sha256, cp.outcome, cp.reason):
        raise _invalid(case_id, cp.seq, "its state names another step, hypothesis, context "
                                        "or outcome")
    built = cp.built
    built_sha = text_sha256(built) if built is not None else None
    if cp.context_sha256 is None:
        return _Generation(state, cp.state_artifact, None, built_sha)
    if cp.context_artifact is None or cp.context_artifact != cp.context_sha256 or \
            _load(s, cp.context_artifact, fresh) is None:
        raise _invalid(case_id, cp.seq, "its context is missing or altered")
    recorded = _json_object(built) if built is not None else {}
    if recorded.get("hypothesis_id") != cp.hypothesis_id or \
            recorded.get("context_sha256") != cp.context_sha256:
        raise _invalid(case_id, cp.seq, "its selected hypothesis or context differs from "
                                        "the recorded build_context")
    return _Generation(state, cp.state_artifact, cp.context_artifact, built_sha)


@dataclass
class Replay:
    """What :func:`replay` validated: the head seq, the head state document (``{}``
    before the first checkpoint) and whether the whole chain was read (``full``)."""

    head_seq: int
    head_state: dict[str, Any] = field(default_factory=dict)
    full: bool = True
    head_revision: int = 0
    #: After a full replay: every evidence record of the head revision as the chain last
    #: recorded it (:func:`fold_evidence`), for the live rows' full check; else ``None``.
    evidence: dict[str, dict[str, Any]] | None = None


def _generations(s: Session, case_id: str, seq: int,
                 revision: int) -> tuple[list[_Stored], Any]:
    """The checkpoints from ``seq`` on (:data:`_GENERATIONS`) and the chain's facts
    (``top``, ``count``, ``published``, ``pointer_path``, ``pointer_sha256``); the
    columns of ``revision`` it read on the way are kept for this transaction
    (:meth:`Store.revision_columns`)."""
    conn = core(s)
    rows = conn.execute(_GENERATIONS, {"case_id": case_id, "seq": seq,
                                       "revision": revision}).all()
    if not rows:  # nothing from seq on: the chain's facts alone
        top, count, published = conn.execute(_CHAIN_SIZE, {"case_id": case_id}).one()
        pointer = conn.execute(_POINTER, {"case_id": case_id}).first()
        return [], _ChainFacts(top, count, published, *(pointer or (None, None)))
    n = len(_CHECKPOINT_COLUMNS) + 2
    first = rows[0]
    if first[n + 5] is not None:  # the revision exists (its interpretation is required)
        Store.remember_revision_columns(s, case_id, revision,
                                        RevisionColumns(*first[n + 5:n + 8]))
    return [_Stored(*row[:n]) for row in rows], _ChainFacts(*first[n:n + 5])


@dataclass
class _ChainFacts:
    top: int | None
    count: int | None
    published: int | None
    pointer_path: str | None
    pointer_sha256: str | None


def _with_contexts(s: Session, case_id: str, rows: list[_Stored]) -> None:
    """Set each generation's :attr:`_Stored.context_artifact` (one query per 500)."""
    paths = {ARTIFACT_CONTEXT.format(seq=cp.seq): cp for cp in rows
             if cp.context_sha256 is not None}
    wanted = sorted(paths)
    for start in range(0, len(wanted), _PATHS_PER_LOOKUP):
        for path, sha in core(s).execute(_ARTIFACT_SHAS, {
                "case_id": case_id, "paths": wanted[start:start + _PATHS_PER_LOOKUP]}).all():
            paths[path].context_artifact = sha


def replay(s: Session, case: CaseRecord, cache: ReplayCache | None = None,
           limits_key: str = "") -> Replay:
    """Validate a case's checkpoint chain before it continues.

    Checks, for every generation not covered by ``cache``: consecutive sequence from 1,
    parent reference, hash binding of the state bytes, state/context identity, the
    selected hypothesis against the recorded ``build_context``, and the archive digest
    newly computed from those bytes against the one recorded at publication. For the head
    it also checks the case row, the ``investigation_state`` pointer and the revision's
    frozen policy (present, intact, and the one the head state was published under). A
    deleted pointer, checkpoint or policy, or an edited state, therefore stops the case
    instead of silently restarting it.

    Without a usable cache entry (a process meeting the case first, other limits, a
    forgotten case) every generation is read from the store's bytes, bypassing the
    process's byte cache.

    Args:
        cache: generations validated earlier in this process, or ``None`` (full replay).
        limits_key: identifies the operational limits in force (e.g. the sha256 of
            ``config.limits``); a cache entry is only used under the same limits.

    Raises:
        InvestigationError: ``CHECKPOINT_INVALID`` (with ``seq``) at the first broken
        generation; ``POLICY_CHANGED`` when the frozen policy was altered or removed.
    """
    cache_key = f"{case.id}|{limits_key}"
    cached = cache.get(cache_key) if cache is not None else None
    start, digest = 0, ""
    if cached is not None and 0 < cached[0] <= case.head_seq:
        start, digest = cached
    # This process validated the case before its first checkpoint (an empty chain): every
    # generation since is one it has not read, and is read and checked like any new one.
    empty_prefix = cached == (0, "")
    rows, chain = _generations(s, case.id, max(1, start), case.current_revision)
    top, count = int(chain.top or 0), int(chain.count or 0)
    if top != count or count != case.head_seq:
        raise _invalid(case.id, case.head_seq,
                       f"the case head is {case.head_seq} but {count} checkpoint(s) "
                       "are stored or their sequence has a gap")
    published = chain.published or 0
    if published != case.head_seq:
        raise _invalid(case.id, case.head_seq,
                       f"step {published} was published but the case head is "
                       f"{case.head_seq}: checkpoints or the head were changed")
    if count == 0:
        if case.head_hash is not None:
            raise _invalid(case.id, 0, "a head hash is set without checkpoints")
        if cache is not None:
            cache.put(cache_key, 0, "")
        return Replay(0)
    if start and (not rows or rows[0].seq != start or rows[0].archive_digest != digest):
        start, digest, empty_prefix = 0, "", False  # the digest moved: read everything again
        rows, chain = _generations(s, case.id, 1, case.current_revision)
    full = start == 0 and not empty_prefix
    fresh = ByteCache() if full else None  # a full replay decodes every byte again
    parent = rows[0].hash if start else None
    head_state: dict[str, Any] | None = None
    head_sha: str | None = None
    folded: dict[str, dict[str, Any]] | None = {} if full else None
    folded_revision = None
    new = rows[1:] if start else rows
    _with_contexts(s, case.id, new)
    for cp in new:
        gen = _verify_generation(s, case.id, cp, parent, fresh)
        if folded is not None:
            if cp.revision != folded_revision:  # a new revision's records start afresh
                folded, folded_revision = {}, cp.revision
            fold_evidence(folded, gen.state)
        digest = archive_digest(digest, case.id, cp, gen.state_sha256, gen.context_sha256,
                                gen.build_context_sha256)
        if cp.archive_digest is not None and cp.archive_digest != digest:
            raise _invalid(case.id, cp.seq, "its stored bytes or rows differ from those it "
                                            "was published with (archive digest)")
        parent, head_state, head_sha = cp.hash, gen.state, gen.state_sha256
    head = rows[-1]
    if head.hash != case.head_hash:
        raise _invalid(case.id, head.seq, "it does not match the case head")
    if head_sha is None:  # the head was validated in an earlier replay
        head_sha = head.state_artifact
    if head_state is None:  # nothing new since the cached generation: read the head state
        head_state = _STATES.get(head_sha or "")
        if head_state is None:  # (bytes that do not decode raise STORE_ARTIFACT_CORRUPT)
            head_state = _json_object(blobs.load(s, head_sha)) if head_sha is not None \
                else {}
    if chain.pointer_path != head.state_path or chain.pointer_sha256 != head_sha or \
            chain.pointer_path is None:
        raise _invalid(case.id, head.seq, f"the {POINTER_STATE} pointer is missing or does "
                                          "not name the head state")
    rev = Store.revision_columns(s, case.id, head.revision)
    recorded_policy = head_state.get("policy_sha256")
    if rev.policy_json is None or rev.policy_sha256 is None or \
            sha256_hex(rev.policy_json.encode("utf-8")) != rev.policy_sha256 or \
            (recorded_policy is not None and recorded_policy != rev.policy_sha256):
        raise InvestigationError(
            "POLICY_CHANGED",
            f"the frozen policy of revision {head.revision} of {case.id} was removed or "
            f"altered after checkpoint {head.seq}; restore it (the investigation does not "
            "restart under another policy)", seq=head.seq)
    if cache is not None:
        cache.put(cache_key, head.seq, digest)
    return Replay(head.seq, head_state, full, head.revision, folded)


def verify_replay(s: Session, case: CaseRecord, cache: ReplayCache | None = None,
                  limits_key: str = "") -> int:
    """:func:`replay`, returning the head seq."""
    return replay(s, case, cache, limits_key).head_seq
