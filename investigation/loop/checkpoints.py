"""Hash-chained state checkpoints (seed 000, "Persistence and recovery").

Checkpoint ``seq`` of a case binds ``parent_hash`` (the hash of ``seq - 1``, ``None`` for
the first) and the sha256 of its state document::

    hash = sha256(canonical_json({"case_id", "seq", "parent_hash", "state_sha256",
                                  "context_sha256", "hypothesis_id"}))

State documents hold no wall-clock time, so the same decisions give the same hashes.
"""

from __future__ import annotations

import json
from typing import Any

from sqlmodel import Session, col, select

from investigation.config import canonical_json
from investigation.constants import ARTIFACT_STATE
from investigation.errors import InvestigationError
from investigation.loop.outcome import StepKey
from investigation.store.engine import Store, sha256_hex
from investigation.store.models import BudgetAccount, CaseRecord, Checkpoint, Evidence, Question


def checkpoint_hash(case_id: str, seq: int, parent_hash: str | None, state_sha256: str,
                    context_sha256: str | None, hypothesis_id: int | None) -> str:
    """The checkpoint hash (see the module docstring)."""
    return sha256_hex(canonical_json({
        "case_id": case_id, "seq": seq, "parent_hash": parent_hash,
        "state_sha256": state_sha256, "context_sha256": context_sha256,
        "hypothesis_id": hypothesis_id,
    }))


def state_document(s: Session, key: StepKey, case: CaseRecord, accounts: list[BudgetAccount],
                   outcome: str, reason: str | None, hypothesis_id: int | None,
                   context_sha256: str | None) -> dict[str, Any]:
    """The investigation state after a step: accounts, evidence ids, questions, outcome."""
    evidence = s.exec(select(Evidence).where(
        Evidence.case_id == key.case_id, Evidence.revision == key.revision)
        .order_by(col(Evidence.ordinal))).all()
    questions = s.exec(select(Question).where(Question.case_id == key.case_id)
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


def verify_head(s: Session, case: CaseRecord) -> None:
    """Check the head checkpoint against the case: sequence, parent, hash and state bytes.

    Raises:
        InvestigationError: ``CHECKPOINT_INVALID`` when the chain does not verify (a
        deleted pointer or edited state cannot silently restart the investigation).
    """
    if case.head_seq == 0:
        if case.head_hash is not None:
            raise InvestigationError("CHECKPOINT_INVALID", "head hash set without checkpoints")
        return
    cp = s.exec(select(Checkpoint).where(Checkpoint.case_id == case.id,
                                         Checkpoint.seq == case.head_seq)).first()
    if cp is None or cp.hash != case.head_hash:
        raise InvestigationError("CHECKPOINT_INVALID",
                                 f"head checkpoint {case.head_seq} of {case.id} is missing "
                                 "or does not match the case head")
    art = Store.get_artifact(s, case.id, cp.state_path)
    if art is None:
        raise InvestigationError("CHECKPOINT_INVALID", f"state {cp.state_path} is missing")
    state = json.loads(art.data)
    expected = checkpoint_hash(case.id, cp.seq, cp.parent_hash, art.sha256, cp.context_sha256,
                               cp.hypothesis_id)
    if expected != cp.hash or sha256_hex(art.data) != art.sha256 or state.get("seq") != cp.seq:
        raise InvestigationError("CHECKPOINT_INVALID",
                                 f"checkpoint {cp.seq} of {case.id} fails its hash binding")
    if cp.seq > 1:
        parent = s.exec(select(Checkpoint).where(Checkpoint.case_id == case.id,
                                                 Checkpoint.seq == cp.seq - 1)).first()
        if parent is None or parent.hash != cp.parent_hash:
            raise InvestigationError("CHECKPOINT_INVALID",
                                     f"checkpoint {cp.seq} of {case.id} has a broken parent")


def verify_chain(s: Session, case_id: str) -> int:
    """Verify every checkpoint of a case from the first; returns how many were checked.

    Raises:
        InvestigationError: ``CHECKPOINT_INVALID`` at the first broken link.
    """
    parent: str | None = None
    rows = s.exec(select(Checkpoint).where(Checkpoint.case_id == case_id)
                  .order_by(col(Checkpoint.seq))).all()
    for i, cp in enumerate(rows, start=1):
        art = Store.get_artifact(s, case_id, cp.state_path)
        if cp.seq != i or cp.parent_hash != parent or art is None or \
                checkpoint_hash(case_id, cp.seq, parent, sha256_hex(art.data),
                                cp.context_sha256, cp.hypothesis_id) != cp.hash:
            raise InvestigationError("CHECKPOINT_INVALID",
                                     f"checkpoint {cp.seq} of {case_id} does not verify")
        parent = cp.hash
    return len(rows)
