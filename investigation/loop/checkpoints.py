"""Hash-chained state checkpoints (seed 000, "Persistence and recovery").

Checkpoint ``seq`` of a case binds ``parent_hash`` (the hash of ``seq - 1``, ``None`` for
the first) and the sha256 of its state document::

    hash = sha256(canonical_json({"case_id", "seq", "parent_hash", "state_sha256",
                                  "context_sha256", "hypothesis_id"}))

State documents hold no wall-clock time, so the same decisions give the same hashes.

Replay validation (:func:`verify_replay`, run by ``build_context`` before every step)
checks the whole chain: sequence, parent references, hashes, state bytes, context
identity, the selected hypothesis, the state pointer and the frozen policy. Generations
already validated in this process are skipped only while the *archive digest* of the
chain up to them is unchanged (see :class:`ReplayCache`).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from sqlalchemy import func
from sqlmodel import Session, col, select

from investigation.config import canonical_json
from investigation.constants import ARTIFACT_CONTEXT, ARTIFACT_STATE, POINTER_STATE
from investigation.errors import InvestigationError
from investigation.evidence.store import fingerprint
from investigation.loop.outcome import StepKey
from investigation.store.engine import Store, sha256_hex
from investigation.store.models import (
    Artifact,
    BudgetAccount,
    CaseRecord,
    Checkpoint,
    Evidence,
    ManifestPointer,
    Question,
    RevisionRecord,
    StageRun,
    TestRequest,
)


def checkpoint_hash(case_id: str, seq: int, parent_hash: str | None, state_sha256: str,
                    context_sha256: str | None, hypothesis_id: int | None) -> str:
    """The checkpoint hash (see the module docstring)."""
    return sha256_hex(canonical_json({
        "case_id": case_id, "seq": seq, "parent_hash": parent_hash,
        "state_sha256": state_sha256, "context_sha256": context_sha256,
        "hypothesis_id": hypothesis_id,
    }))


def _revision(s: Session, case_id: str, revision: int) -> RevisionRecord:
    return s.exec(select(RevisionRecord).where(RevisionRecord.case_id == case_id,
                                               RevisionRecord.revision == revision)).one()


def state_document(s: Session, key: StepKey, case: CaseRecord, accounts: list[BudgetAccount],
                   outcome: str, reason: str | None, hypothesis_id: int | None,
                   context_sha256: str | None) -> dict[str, Any]:
    """The investigation state after a step: accounts, evidence ids, questions, outcome."""
    evidence = s.exec(select(Evidence).where(
        Evidence.case_id == key.case_id, Evidence.revision == key.revision)
        .order_by(col(Evidence.ordinal))).all()
    questions = s.exec(select(Question).where(Question.case_id == key.case_id,
                                              Question.revision == key.revision)
                       .order_by(col(Question.ordinal))).all()
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
        "policy_sha256": _revision(s, key.case_id, key.revision).policy_sha256,
        "accounts": [
            {
                "hypothesis_id": a.hypothesis_id, "status": a.status,
                "disposition_reason": a.disposition_reason, "confidence": a.confidence,
                "credit_units": a.credit_units, "balance_units": a.balance_units,
                "turns": a.turns, "iterations": a.iterations,
                "pending_evidence_id": a.pending_evidence_id,
                "invalid_streak": a.invalid_streak, "no_novelty_streak": a.no_novelty_streak,
                "deferred_by": a.deferred_by, "deferred_step": a.deferred_step,
                "last_rejection": json.loads(a.last_rejection_json)
                if a.last_rejection_json else None,
            }
            for a in accounts
        ],
        "evidence": [
            {"evidence_id": e.evidence_id, "hypothesis_id": e.hypothesis_id,
             "fingerprint": e.fingerprint, "assessed": e.assessed,
             "refund_units": e.refund_units}
            for e in evidence
        ],
        "questions": [
            {"question_id": q.question_id, "hypothesis_id": q.hypothesis_id, "status": q.status}
            for q in questions
        ],
    }


def publish(s: Session, key: StepKey, case: CaseRecord, state: dict[str, Any],
            context_sha256: str | None, hypothesis_id: int | None, outcome: str,
            reason: str | None) -> Checkpoint:
    """Store the state artifact and insert checkpoint ``key.step_seq``.

    The unique ``(case_id, seq)`` makes a second publisher fail; the caller also
    compare-and-sets the case head in the same transaction.
    """
    data = canonical_json(state)
    path = ARTIFACT_STATE.format(seq=key.step_seq)
    digest = Store.put_artifact(s, key.case_id, path, data)
    state["_state_sha256"] = digest
    parent = case.head_hash if key.step_seq > 1 else None
    cp = Checkpoint(
        case_id=key.case_id, revision=key.revision, seq=key.step_seq, parent_hash=parent,
        hash=checkpoint_hash(key.case_id, key.step_seq, parent, digest, context_sha256,
                             hypothesis_id),
        state_path=path, context_sha256=context_sha256, hypothesis_id=hypothesis_id,
        outcome=outcome, reason=reason)
    s.add(cp)
    s.flush()
    return cp


def verify_chain(s: Session, case_id: str) -> int:
    """Verify every checkpoint of a case from the first (no cache); returns the count.

    Raises:
        InvestigationError: ``CHECKPOINT_INVALID``/``POLICY_CHANGED`` (see
        :func:`verify_replay`); ``CASE_NOT_FOUND`` for an unknown case.
    """
    case = s.get(CaseRecord, case_id)
    if case is None:
        raise InvestigationError("CASE_NOT_FOUND", f"no case {case_id}")
    return verify_replay(s, case)


def _invalid(case_id: str, seq: int, what: str) -> InvestigationError:
    return InvestigationError("CHECKPOINT_INVALID",
                              f"checkpoint {seq} of {case_id}: {what}", seq=seq)


class ReplayCache:
    """Generations already validated in this process, per case (a bounded LRU).

    An entry ``"<case_id>|<limits_key>" -> (seq, archive_digest)`` lets
    :func:`verify_replay` skip the full check of checkpoints ``1..seq`` only under the
    same limits and while the archive digest of that prefix is unchanged. The archive
    digest chains, per checkpoint, every binding: seq, parent, hash, state path, context
    hash, hypothesis, revision, and the sha256 of the state and context artifact bytes,
    newly computed from the stored bytes on every call. Any change to those rows or bytes,
    or a deleted artifact, changes the digest and forces a full replay.

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


def _archive_digests(case_id: str, rows: list[Checkpoint], shas: dict[str, str],
                     built: dict[int, str]) -> list[str]:
    """The running archive digest after each checkpoint (see :class:`ReplayCache`)."""
    digest = ""
    out: list[str] = []
    for cp in rows:
        digest = sha256_hex(canonical_json({
            "previous": digest, "case_id": case_id, "seq": cp.seq, "revision": cp.revision,
            "parent_hash": cp.parent_hash, "hash": cp.hash, "state_path": cp.state_path,
            "context_sha256": cp.context_sha256, "hypothesis_id": cp.hypothesis_id,
            "outcome": cp.outcome, "reason": cp.reason,
            "state_artifact": shas.get(cp.state_path),
            "context_artifact": shas.get(ARTIFACT_CONTEXT.format(seq=cp.seq)),
            "build_context": built.get(cp.seq),
        }))
        out.append(digest)
    return out


def _json_object(data: str | bytes) -> dict[str, Any]:
    """A stored JSON object; anything else is a tampered record (``{}`` fails every check)."""
    try:
        value = json.loads(data)
    except (ValueError, UnicodeError):
        return {}
    return value if isinstance(value, dict) else {}


def _verify_generation(s: Session, case_id: str, cp: Checkpoint, parent: str | None) -> None:
    """Fully check one checkpoint: its bytes, hash, parent, context and hypothesis."""
    if cp.parent_hash != parent:
        raise _invalid(case_id, cp.seq, "its parent reference is broken")
    art = Store.get_artifact(s, case_id, cp.state_path)
    if art is None or sha256_hex(art.data) != art.sha256:
        raise _invalid(case_id, cp.seq, f"state {cp.state_path} is missing or altered")
    if checkpoint_hash(case_id, cp.seq, parent, art.sha256, cp.context_sha256,
                       cp.hypothesis_id) != cp.hash:
        raise _invalid(case_id, cp.seq, "its hash does not bind its state")
    state = _json_object(art.data)
    if (state.get("seq"), state.get("case_id"), state.get("hypothesis_id"),
            state.get("context_sha256"), state.get("outcome"), state.get("reason")) != \
            (cp.seq, case_id, cp.hypothesis_id, cp.context_sha256, cp.outcome, cp.reason):
        raise _invalid(case_id, cp.seq, "its state names another step, hypothesis, context "
                                        "or outcome")
    if cp.context_sha256 is None:
        return
    ctx = Store.get_artifact(s, case_id, ARTIFACT_CONTEXT.format(seq=cp.seq))
    if ctx is None or ctx.sha256 != cp.context_sha256 or sha256_hex(ctx.data) != ctx.sha256:
        raise _invalid(case_id, cp.seq, "its context is missing or altered")
    built = s.exec(select(StageRun).where(
        StageRun.case_id == case_id, StageRun.revision == cp.revision,
        StageRun.step_seq == cp.seq, StageRun.stage == "build_context")).first()
    recorded = _json_object(built.output_json) if built is not None else {}
    if recorded.get("hypothesis_id") != cp.hypothesis_id or \
            recorded.get("context_sha256") != cp.context_sha256:
        raise _invalid(case_id, cp.seq, "its selected hypothesis or context differs from "
                                        "the recorded build_context")


def verify_replay(s: Session, case: CaseRecord, cache: ReplayCache | None = None,
                  limits_key: str = "") -> int:
    """Validate a case's checkpoint chain before it continues; returns the head seq.

    Checks, for every generation not covered by ``cache``: consecutive sequence from 1,
    parent reference, hash binding of the state bytes, state/context identity and the
    selected hypothesis against the recorded ``build_context``. For the head it also
    checks the case row, the ``investigation_state`` pointer and the revision's frozen
    policy (present, intact, and the one the head state was published under). A deleted
    pointer, checkpoint or policy, or an edited state, therefore stops the case instead
    of silently restarting it.

    Args:
        cache: generations validated earlier in this process, or ``None``.
        limits_key: identifies the operational limits in force (e.g. the sha256 of
            ``config.limits``); a cache entry is only used under the same limits.

    Raises:
        InvestigationError: ``CHECKPOINT_INVALID`` (with ``seq``) at the first broken
        generation; ``POLICY_CHANGED`` when the frozen policy was altered or removed.
    """
    rows = list(s.exec(select(Checkpoint).where(Checkpoint.case_id == case.id)
                       .order_by(col(Checkpoint.seq))).all())
    if [cp.seq for cp in rows] != list(range(1, len(rows) + 1)) or len(rows) != case.head_seq:
        raise _invalid(case.id, case.head_seq,
                       f"the case head is {case.head_seq} but {len(rows)} checkpoint(s) "
                       "are stored or their sequence has a gap")
    published = s.exec(select(func.max(StageRun.step_seq)).where(
        StageRun.case_id == case.id, StageRun.stage == "publish")).one() or 0
    if published != case.head_seq:
        raise _invalid(case.id, case.head_seq,
                       f"step {published} was published but the case head is "
                       f"{case.head_seq}: checkpoints or the head were changed")
    if not rows:
        if case.head_hash is not None:
            raise _invalid(case.id, 0, "a head hash is set without checkpoints")
        return 0
    head = rows[-1]
    if head.hash != case.head_hash:
        raise _invalid(case.id, head.seq, "it does not match the case head")
    paths = {cp.state_path for cp in rows} | {ARTIFACT_CONTEXT.format(seq=cp.seq)
                                              for cp in rows}
    # The archive digest hashes the bytes themselves, newly, every time (seed 000:
    # validated generations are cached "only behind a newly computed full archive-byte
    # hash"), so no edit of a stored byte can hide behind the cache.
    shas = {path: sha256_hex(data) for path, data in s.exec(
        select(Artifact.path, Artifact.data).where(
            Artifact.case_id == case.id, col(Artifact.path).in_(paths))).all()}
    built = {seq: sha256_hex(out.encode("utf-8", "surrogatepass")) for seq, out in s.exec(
        select(StageRun.step_seq, StageRun.output_json).where(
            StageRun.case_id == case.id, StageRun.stage == "build_context",
            col(StageRun.step_seq) <= len(rows))).all()}
    digests = _archive_digests(case.id, rows, shas, built)
    start = 0
    cache_key = f"{case.id}|{limits_key}"
    cached = cache.get(cache_key) if cache is not None else None
    if cached is not None and 0 < cached[0] <= len(rows) and digests[cached[0] - 1] == cached[1]:
        start = cached[0]
    parent = rows[start - 1].hash if start else None
    for cp in rows[start:]:
        _verify_generation(s, case.id, cp, parent)
        parent = cp.hash
    pointer = s.exec(select(ManifestPointer).where(
        ManifestPointer.case_id == case.id, ManifestPointer.name == POINTER_STATE)).first()
    if pointer is None or pointer.path != head.state_path or \
            pointer.sha256 != shas.get(head.state_path):
        raise _invalid(case.id, head.seq, f"the {POINTER_STATE} pointer is missing or does "
                                          "not name the head state")
    rev = _revision(s, case.id, head.revision)
    head_state = Store.get_artifact(s, case.id, head.state_path)
    assert head_state is not None  # checked above (cached or not, the sha is present)
    recorded_policy = _json_object(head_state.data).get("policy_sha256")
    if rev.policy_json is None or rev.policy_sha256 is None or \
            sha256_hex(rev.policy_json.encode("utf-8")) != rev.policy_sha256 or \
            (recorded_policy is not None and recorded_policy != rev.policy_sha256):
        raise InvestigationError(
            "POLICY_CHANGED",
            f"the frozen policy of revision {head.revision} of {case.id} was removed or "
            f"altered after checkpoint {head.seq}; restore it (the investigation does not "
            "restart under another policy)", seq=head.seq)
    if cache is not None:
        cache.put(cache_key, head.seq, digests[-1])
    return head.seq


def verify_live_state(s: Session, case: CaseRecord) -> None:
    """Check the live rows against the head checkpoint's state before a step builds on them.

    Accounts (status, disposition, confidence, credit, balance, turns, iterations, invalid
    streak, deferral), evidence (ids, fingerprint recomputed from the stored findings,
    assessment, refund, artifact bytes), pending results and novelty streaks, and question
    statuses must be what the head state
    recorded. The one change allowed between steps is the import of an external test's
    result (``test.feedback`` evidence of a closed request, which becomes its account's
    pending result; ``docs/async-tests.md``).

    Raises:
        InvestigationError: ``STATE_TAMPERED`` naming the first row that differs.
    """
    if case.head_seq == 0:
        return
    head = s.exec(select(Checkpoint).where(Checkpoint.case_id == case.id,
                                           Checkpoint.seq == case.head_seq)).one()
    art = Store.get_artifact(s, case.id, head.state_path)
    state = _json_object(art.data) if art is not None else {}
    if head.revision != case.current_revision:
        return  # a new revision starts from fresh accounts

    def tampered(what: str) -> InvestigationError:
        return InvestigationError("STATE_TAMPERED",
                                  f"case {case.id}: {what} differs from checkpoint "
                                  f"{head.seq}; the store was changed outside the engine",
                                  seq=head.seq)

    imported = {r.evidence_id: r for r in s.exec(select(TestRequest).where(
        TestRequest.case_id == case.id, col(TestRequest.status).in_(("confirmed", "expired")),
        col(TestRequest.evidence_id).is_not(None))).all()}
    live_ev = s.exec(select(Evidence).where(Evidence.case_id == case.id,
                                            Evidence.revision == head.revision)
                     .order_by(col(Evidence.ordinal))).all()
    recorded_ev = {e["evidence_id"]: e for e in state.get("evidence", [])}
    pending_imports: set[str] = set()
    for e in live_ev:
        items = _json_list(e.findings_json)
        arguments = _json_object(e.arguments_json)
        if e.fingerprint != fingerprint(e.operation, arguments, items):
            raise tampered(f"evidence {e.evidence_id}'s findings")
        ev_art = Store.get_artifact(s, case.id, e.artifact_path)
        if ev_art is None or sha256_hex(ev_art.data) != e.artifact_sha256:
            raise tampered(f"evidence {e.evidence_id}'s artifact")
        rec = recorded_ev.get(e.evidence_id)
        if rec is None:
            if e.evidence_id not in imported or e.assessed:
                raise tampered(f"evidence {e.evidence_id}")
            pending_imports.add(e.evidence_id)
            continue
        if (rec.get("hypothesis_id"), rec.get("fingerprint"), rec.get("assessed"),
                rec.get("refund_units")) != (e.hypothesis_id, e.fingerprint, e.assessed,
                                              e.refund_units):
            raise tampered(f"evidence {e.evidence_id}")
    if len(recorded_ev) != len(live_ev) - len(pending_imports):
        raise tampered("the evidence records")
    accounts = s.exec(select(BudgetAccount).where(
        BudgetAccount.case_id == case.id, BudgetAccount.revision == head.revision)).all()
    recorded_acc = {a["hypothesis_id"]: a for a in state.get("accounts", [])}
    fields = ("status", "disposition_reason", "confidence", "credit_units", "balance_units",
              "turns", "iterations", "invalid_streak", "deferred_by", "deferred_step")
    for a in accounts:
        rec = recorded_acc.get(a.hypothesis_id)
        if rec is None:
            raise tampered(f"hypothesis {a.hypothesis_id}'s account")
        if any(rec.get(f) != getattr(a, f) for f in fields):
            raise tampered(f"hypothesis {a.hypothesis_id}'s account")
        imported_now = a.pending_evidence_id in pending_imports
        if a.pending_evidence_id != rec.get("pending_evidence_id") and not imported_now:
            raise tampered(f"hypothesis {a.hypothesis_id}'s pending result")
        if a.no_novelty_streak != rec.get("no_novelty_streak") and not imported_now:
            raise tampered(f"hypothesis {a.hypothesis_id}'s novelty streak")
    if len(recorded_acc) != len(accounts):
        raise tampered("the accounts")
    questions = s.exec(select(Question).where(Question.case_id == case.id,
                                              Question.revision == head.revision)
                       .order_by(col(Question.ordinal))).all()
    if [(q.question_id, q.hypothesis_id, q.status) for q in questions] != \
            [(q.get("question_id"), q.get("hypothesis_id"), q.get("status"))
             for q in state.get("questions", [])]:
        raise tampered("the questions")


def _json_list(data: str) -> list[Any]:
    try:
        value = json.loads(data)
    except ValueError:
        return []
    return value if isinstance(value, list) else []
