"""Operator actions over the store: status, pause, resume, cancel, summary, export and
verify."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import UTC
from pathlib import Path, PurePosixPath
from typing import Any

from sqlmodel import Session, col, func, select

from investigation import jsonio
from investigation.budget.manager import BudgetManager
from investigation.config import BudgetConfig, InvestigationConfig, LoopConfig, canonical_json
from investigation.constants import (
    ARTIFACT_CONTEXT,
    ARTIFACT_SUMMARY,
    BLOCK_AWAITING_TEST_FEEDBACK,
    BLOCK_MODEL_COST_CAP,
    BLOCK_PROVIDER_CONFIGURATION,
    BLOCK_PROVIDER_CREDENTIALS,
    BLOCK_PROVIDER_EXHAUSTED,
    BLOCK_STAGE_POISONED,
    BLOCK_STAGE_TIME_LIMIT,
    CASE_BLOCKED,
    CASE_BUILDING_DIAGNOSIS,
    CASE_CANCELLED,
    CASE_INVESTIGATING,
    CASE_PAUSED,
    CASE_STOPPED,
    STAGES,
)
from investigation.errors import InvestigationError
from investigation.evidence.figures import evidence_figures
from investigation.lifecycle import InvestigationSession, SessionState, TerminationReason
from investigation.llm import spend
from investigation.loop import checkpoints, deliveries, lifecycle, live
from investigation.store.engine import Store
from investigation.store.models import (
    Artifact,
    BudgetAccount,
    CaseRecord,
    Checkpoint,
    Evidence,
    HypothesisBirth,
    LLMAttempt,
    LLMOperation,
    ManifestPointer,
    Plan,
    Question,
    RevisionRecord,
    StageRun,
    utcnow,
)
from investigation.text_safety import escape_text

#: Blocks of a failed provider operation: resumed with a retry id (a new operation).
_PROVIDER_BLOCKS = (BLOCK_PROVIDER_EXHAUSTED, BLOCK_PROVIDER_CONFIGURATION,
                    BLOCK_PROVIDER_CREDENTIALS, BLOCK_MODEL_COST_CAP)


def _case(store: Store, case_id: str) -> CaseRecord:
    with store.session() as s:
        case = s.get(CaseRecord, case_id)
    if case is None:
        raise InvestigationError("CASE_NOT_FOUND", f"no case {case_id}")
    return case


def step_in_progress_text(going: dict[str, Any], state: str) -> str:
    """:func:`status`'s ``step_in_progress`` in words (``step 3 in progress (7 of 8
    stages recorded, not published)``; ``halted`` on a blocked or paused case, which
    goes on from there once resumed; ``left unfinished`` on a cancelled or stopped
    case), for ``status`` and the report alike."""
    word, tail = "in progress", ""
    if state in (CASE_CANCELLED, CASE_STOPPED):
        word = "left unfinished"
    elif state in (CASE_BLOCKED, CASE_PAUSED):
        # "in progress" on a blocked case read as a step still running (a fleet trial).
        word, tail = "halted", "; it goes on from there once resumed"
    return (f"step {going['step_seq']} {word} ({going['stages_recorded']} of "
            f"{going['stages']} stages recorded, not published{tail})")


def status(store: Store, case_id: str) -> dict[str, Any]:
    """State, last outcome, blocked reason and since when (``blocked_since``, ISO 8601 UTC,
    while the case is BLOCKED), ``step_in_progress`` (``{"step_seq", "stages_recorded",
    "stages"}`` of a step begun and not published, whose record, charges, questions and
    account changes every figure here includes; ``None``), balances, evidence count
    (every revision),
    the current revision's evidence figures (:func:`evidence_figures`) and model usage
    (calls, tokens and cost in micros per hypothesis, ``llm.spend``; ``currency``: what
    the micros are in, as the case's priced attempts recorded it, ``None`` before any)
    of a case."""
    case = _case(store, case_id)
    with store.session() as s:
        usage = spend.usage_by_hypothesis(s, case_id)
        spent = spend.case_spent_micros(s, case_id)
        currency = spend.case_currency(s, case_id)
        accounts = s.exec(select(BudgetAccount).where(
            BudgetAccount.case_id == case_id, BudgetAccount.revision == case.current_revision)
            .order_by(col(BudgetAccount.hypothesis_id))).all()
        evidence = s.exec(select(Evidence.id).where(Evidence.case_id == case_id)).all()
        # A step whose stages have begun and that is not published: its record, charges,
        # questions and account changes are in the figures below already (a new user's
        # `status --watch` showed 3 records after 2 steps, unexplained).
        begun = s.exec(select(func.count()).select_from(StageRun).where(
            StageRun.case_id == case_id, StageRun.revision == case.current_revision,
            StageRun.step_seq == case.head_seq + 1)).one()
        current = s.exec(select(Evidence.duplicate, Evidence.new_item_count,
                                Evidence.assessed, Evidence.assessment_score).where(
            Evidence.case_id == case_id, Evidence.revision == case.current_revision)).all()
        questions = s.exec(select(Question).where(
            Question.case_id == case_id, Question.revision == case.current_revision)).all()
        pointers = {p.name: p.path for p in s.exec(
            select(ManifestPointer).where(ManifestPointer.case_id == case_id))}
        births = s.exec(select(HypothesisBirth.id).where(
            HypothesisBirth.case_id == case_id,
            HypothesisBirth.revision == case.current_revision)).all()
        detail = None
        if case.blocked_reason in _PROVIDER_BLOCKS:
            op = s.exec(select(LLMOperation).where(LLMOperation.case_id == case_id)
                        .order_by(col(LLMOperation.id).desc())).first()
            if op is not None and op.error_code:
                detail = f"{op.error_code}: {op.error_message or ''}".rstrip(": ")
        elif case.blocked_reason == BLOCK_STAGE_POISONED:
            row = deliveries.poisoned_stage(s, case_id)
            if row is not None:
                detail = (f"stage {row.stage} of step {row.step_seq} was delivered "
                          f"{row.deliveries} times and {row.unfinished} deliveries never "
                          "returned (its worker died each time); see the worker logs")
        elif case.blocked_reason == BLOCK_STAGE_TIME_LIMIT:
            row = deliveries.last_delivered(s, case_id)
            if row is not None:
                detail = (f"stage {row.stage} of step {row.step_seq} was stopped by the "
                          "worker's time limit (--soft-time-limit/--time-limit); raise the "
                          "limit, then resume")
        elif case.blocked_reason is not None:
            rejected = [a for a in accounts if a.last_rejection_json]
            if rejected:
                last = jsonio.loads(rejected[0].last_rejection_json or "{}")
                detail = f"{last.get('code')}: {last.get('detail')}"
    return {
        "case_id": case.id, "package_id": case.package_id, "revision": case.current_revision,
        "state": case.state, "blocked_reason": case.blocked_reason,
        "blocked_detail": detail,
        # The case row's last change, which the block is while the case stays blocked (a
        # fleet operator could not tell since when a case was blocked).
        "blocked_since": (case.updated_at if case.updated_at.tzinfo else
                          case.updated_at.replace(tzinfo=UTC)).isoformat()
        if case.state == CASE_BLOCKED else None,
        "hypotheses": len(births),
        "last_outcome": case.last_outcome, "last_reason": case.last_reason,
        "retry_not_before": case.retry_not_before.isoformat() if case.retry_not_before
        else None,
        "steps": case.head_seq, "head_hash": case.head_hash,
        "step_in_progress": {"step_seq": case.head_seq + 1, "stages_recorded": int(begun),
                             "stages": len(STAGES)} if begun else None,
        "evidence_count": len(evidence),
        "evidence": evidence_figures(
            {"duplicate": d, "new_item_count": n, "assessed": a, "assessment_score": score}
            for d, n, a, score in current),
        "open_questions": sum(1 for q in questions if q.status == "open"),
        "accounts": [
            {"hypothesis_id": a.hypothesis_id, "status": a.status, "confidence": a.confidence,
             "balance_units": a.balance_units, "credit_units": a.credit_units,
             "iterations": a.iterations, "pending_evidence_id": a.pending_evidence_id,
             "disposition_reason": a.disposition_reason, "invalid_streak": a.invalid_streak,
             "deferred_by": a.deferred_by, "deferred_step": a.deferred_step,
             "last_rejection": jsonio.loads(a.last_rejection_json)
             if a.last_rejection_json else None}
            for a in accounts
        ],
        "pointers": pointers,
        "lifecycle": lifecycle.describe(case),
        "model_usage": {
            "spent_micros": spent,
            "currency": currency,
            "hypotheses": [{"hypothesis_id": hid, **u} for hid, u in sorted(
                usage.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))],
        },
    }


def _session_for(s: Session, case: CaseRecord) -> InvestigationSession:
    """The case's session, started (in PLANNING) if no step ran yet."""
    rev = s.exec(select(RevisionRecord).where(
        RevisionRecord.case_id == case.id,
        RevisionRecord.revision == case.current_revision)).one()
    hypotheses = len(s.exec(select(HypothesisBirth.id).where(
        HypothesisBirth.case_id == case.id,
        HypothesisBirth.revision == case.current_revision)).all())
    config = InvestigationConfig()
    if rev.policy_json is not None:  # the frozen policy, once a step ran
        stored = jsonio.loads(rev.policy_json)
        config = config.model_copy(update={
            "loop": LoopConfig.model_validate(stored["loop"]),
            "budget": BudgetConfig.model_validate(stored["budget"])})
    return lifecycle.ensure(case, config, hypotheses, str(
        jsonio.loads(rev.interpretation_json).get("summary", "")))


def pause(store: Store, case_id: str) -> dict[str, Any]:
    """Operator pause (seed 001: PAUSED remembers its exact prior state).

    The case stops at its next stage boundary: a stage already running finishes and is
    kept; no new stage starts. A blocked case can be paused too; ``resume`` restores
    exactly what it was (blocked with the same reason, or investigating).

    Raises:
        InvestigationError: ``CASE_NOT_FOUND``; ``CASE_NOT_ACTIVE`` for a paused,
        cancelled, stopped or completed case.
    """
    with store.session() as s:
        case = Store.lock_case(s, case_id)
        if case.state not in (CASE_INVESTIGATING, CASE_BLOCKED):
            raise InvestigationError("CASE_NOT_ACTIVE",
                                     f"case {case_id} is {case.state}; only an investigating "
                                     "or blocked case can be paused")
        session = _session_for(s, case)
        session.pause()
        lifecycle.save(case, session)
        previous = case.state
        case.state = CASE_PAUSED  # blocked_reason stays: what a resume restores
        case.last_outcome, case.last_reason = "PAUSED", previous
        case.updated_at = utcnow()
        s.add(case)
        return {"case_id": case_id, "paused_from": previous,
                "lifecycle_paused_from": session.paused_from.value
                if session.paused_from else None}


def _unpause(s: Session, case: CaseRecord) -> dict[str, Any]:
    session = _session_for(s, case)
    resumed_to = session.resume()
    lifecycle.save(case, session)
    case.state = CASE_BLOCKED if case.blocked_reason else CASE_INVESTIGATING
    case.last_outcome, case.last_reason = "RESUMED", CASE_PAUSED
    case.updated_at = utcnow()
    s.add(case)
    return {"case_id": case.id, "resumed_from": CASE_PAUSED, "retry_id": None,
            "state": case.state, "lifecycle_state": resumed_to.value}


def cancel(store: Store, case_id: str) -> dict[str, Any]:
    """Operator cancel: terminal (session CANCELLED with ``USER_CANCELLED``).

    Like a pause, the case stops at its next stage boundary and keeps every finished
    stage, evidence and charge; it never continues and takes no test feedback.

    Raises:
        InvestigationError: ``CASE_NOT_FOUND``; ``CASE_NOT_ACTIVE`` for a cancelled,
        stopped or completed case.
    """
    with store.session() as s:
        case = Store.lock_case(s, case_id)
        if case.state not in (CASE_INVESTIGATING, CASE_BLOCKED, CASE_PAUSED):
            raise InvestigationError("CASE_NOT_ACTIVE",
                                     f"case {case_id} is {case.state}; it cannot be cancelled")
        session = _session_for(s, case)
        if session.state == SessionState.PAUSED:
            session.resume()  # the diagram has no PAUSED -> CANCELLED edge
        session.terminate(TerminationReason.USER_CANCELLED)
        lifecycle.save(case, session)
        previous = case.state
        case.state = CASE_CANCELLED
        case.last_outcome, case.last_reason = "CANCELLED", previous
        case.retry_not_before = None
        case.updated_at = utcnow()
        s.add(case)
        return {"case_id": case_id, "cancelled_from": previous}


#: What a retry id may be (``resume --retry-id``): it names a provider operation in an
#: indexed column, in logs and in the commands guidance prints.
RETRY_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,99}")


#: What to do instead of resuming a case in each state ``resume`` refuses (a new user
#: resumed a running case and was not told that ``run`` goes on with it).
_NOT_BLOCKED_NEXT = {
    CASE_INVESTIGATING: ": it is not stopped; `investigate status {case}` says whether a "
                        "`run` or a worker has it now, and if none does, `investigate run "
                        "{case}` (or `dispatch`) goes on with it",
    CASE_BUILDING_DIAGNOSIS: ": it is complete; `investigate summary {case}` prints its "
                             "summary",
    CASE_CANCELLED: ": a cancelled case stays cancelled (everything done so far is kept)",
    CASE_STOPPED: ": a stopped case (a lifecycle bound) stays stopped; `investigate status "
                  "{case}` says which bound",
}


def resume(store: Store, case_id: str, retry_id: str | None = None) -> dict[str, Any]:
    """Operator resume of a paused or blocked case.

    A paused case continues exactly where it stopped (its next stage), in the state it
    was paused from.

    Any block reason resumes this way (seed 000: a blocked case resumes only by an
    explicit operator action). ``STAGE_POISONED`` resets the case's unfinished-delivery
    counters (``investigation/loop/deliveries.py``), so the stage gets its full allowance
    again; the delivery totals stay for audit.

    A ``retry_id`` opens a new provider operation for a call that was exhausted or
    failed on configuration/credentials; it resets no iteration, credit, evidence or
    invalid-reply counter. It is refused for other block reasons.

    Raises:
        InvestigationError: ``RETRY_ID_INVALID`` (not 1-100 characters of letters, digits
        and ``. _ : @ + -``, starting with a letter or digit; checked before anything is
        read), ``CASE_NOT_BLOCKED``, ``RETRY_ID_NOT_APPLICABLE``, ``RETRY_ID_REUSED``.
    """
    if retry_id is not None and not RETRY_ID.fullmatch(retry_id):
        # It is stored in an indexed column and printed in commands: a 40,000-character
        # id broke PostgreSQL's index for good and left the case unresumable, an option
        # such as `--json` was taken as the id (a hostile-input trial).
        shown = escape_text(retry_id[:40]) + ("..." if len(retry_id) > 40 else "")
        raise InvestigationError(
            "RETRY_ID_INVALID", f"retry id '{shown}' ({len(retry_id)} character"
            f"{'' if len(retry_id) == 1 else 's'}) is not 1-100 ASCII letters, digits and "
            ". _ : @ + -, starting with a letter or digit; e.g. the one `investigate "
            "status` suggests")
    with store.session() as s:
        case = Store.lock_case(s, case_id)
        if case.state == CASE_PAUSED:
            if retry_id is not None:
                raise InvestigationError("RETRY_ID_NOT_APPLICABLE",
                                         f"case {case_id} is paused, not blocked by a "
                                         "provider; resume it without --retry-id")
            return _unpause(s, case)
        if case.state != CASE_BLOCKED:
            instead = _NOT_BLOCKED_NEXT.get(case.state, "").format(case=case_id)
            raise InvestigationError("CASE_NOT_BLOCKED",
                                     f"case {case_id} is {case.state}; only a paused or blocked case "
                                     f"resumes{instead}")
        if case.blocked_reason == BLOCK_AWAITING_TEST_FEEDBACK:
            raise InvestigationError(
                "TEST_FEEDBACK_PENDING",
                f"case {case_id} waits for external test feedback; it continues when the "
                "feedback is confirmed (investigate feedback submit/confirm) or the test's "
                "deadline passes")
        if retry_id is not None:
            if case.blocked_reason not in _PROVIDER_BLOCKS:
                raise InvestigationError(
                    "RETRY_ID_NOT_APPLICABLE",
                    f"a retry id opens a new provider operation; this case is blocked for "
                    f"{case.blocked_reason}")
            used = s.exec(select(LLMOperation.id).where(
                LLMOperation.case_id == case_id, LLMOperation.retry_id == retry_id)).first()
            if retry_id == case.llm_retry_id or used is not None:
                raise InvestigationError("RETRY_ID_REUSED",
                                         f"retry id {retry_id!r} was used before; give a new, "
                                         "non-empty retry id for the new operation")
            case.llm_retry_id = retry_id
        elif case.blocked_reason in _PROVIDER_BLOCKS:
            raise InvestigationError(
                "RETRY_ID_REQUIRED",
                f"the provider call failed ({case.blocked_reason}); after fixing the cause, "
                "resume with --retry-id ID to open a new provider operation")
        previous = case.blocked_reason
        deliveries.reset_case(s, case_id)
        case.state, case.blocked_reason = CASE_INVESTIGATING, None
        case.last_outcome, case.last_reason = "RESUMED", previous
        case.updated_at = utcnow()
        s.add(case)
    return {"case_id": case_id, "resumed_from": previous, "retry_id": retry_id}


def summary_bytes(store: Store, case_id: str) -> bytes:
    """The stored ``summary.md``.

    Raises:
        InvestigationError: ``SUMMARY_NOT_READY`` before the case is complete.
    """
    case = _case(store, case_id)
    with store.session() as s:
        art = Store.get_artifact(s, case_id, ARTIFACT_SUMMARY)
    if art is None:
        if case.state in (CASE_CANCELLED, CASE_STOPPED):
            raise InvestigationError(
                "SUMMARY_NOT_READY",
                f"case {case_id} is {case.state} and has no summary: it is written when "
                "every hypothesis account is terminal, which this case never reached; "
                "`investigate report` and `investigate export` show what was done")
        raise InvestigationError("SUMMARY_NOT_READY",
                                 f"case {case_id} is {case.state} and has no summary yet "
                                 "(it is written when every hypothesis account is "
                                 f"terminal); `investigate status {case_id}` shows where "
                                 "it is and what to do next, `investigate report` what was "
                                 "done so far")
    return bytes(art.data)


def export(store: Store, case_id: str, directory: Path) -> list[str]:
    """Write every artifact of the case under ``directory`` byte for byte, plus
    ``manifest.json`` with the pointers and each artifact's sha256. Returns the paths.

    The checkpoint chain is replayed in full first (every byte read from the store again,
    no process cache) and every budget account checked against its whole ledger, and every artifact's bytes are decoded from the store and checked
    against its sha256 as it is written.

    Raises:
        InvestigationError: ``EXPORT_TARGET_NOT_EMPTY``, ``EXPORT_UNSAFE_PATH``; the
        replay's ``CHECKPOINT_INVALID``/``POLICY_CHANGED``, the ledger's
        ``BUDGET_ORIGIN_MISMATCH`` or a binding's or a figure's ``STATE_TAMPERED``
        (:func:`verify_bindings`, :func:`verify_figures`; nothing is written);
        ``STORE_ARTIFACT_CORRUPT`` for bytes that fail their sha256.
    """
    _case(store, case_id)
    if directory.is_symlink():  # the export would follow it to wherever it points
        raise InvestigationError(
            "EXPORT_TARGET_NOT_EMPTY",
            f"{directory} is a symbolic link; export into a new directory (not a link)")
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise InvestigationError(
            "EXPORT_TARGET_NOT_EMPTY",
            f"{directory} exists and is not an empty directory; export into a new one")
    with store.session() as s:
        _verify_rows(s, case_id, ledgers=True)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    files = []
    root = directory.resolve()
    with store.session() as s:
        pointers = s.exec(select(ManifestPointer).where(ManifestPointer.case_id == case_id)
                          .order_by(col(ManifestPointer.name))).all()
        for art in Store.artifacts(s, case_id):
            rel = PurePosixPath(art.path)
            if rel.is_absolute() or ".." in rel.parts:
                raise InvestigationError("EXPORT_UNSAFE_PATH",
                                         f"artifact path {art.path} is unsafe")
            target = root.joinpath(*rel.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.parent.resolve().is_relative_to(root) or target.is_symlink():
                raise InvestigationError("EXPORT_UNSAFE_PATH",
                                         f"{target} would leave {root} (a symlink); nothing "
                                         "more is written")
            target.write_bytes(art.data)
            written.append(art.path)
            files.append({"path": art.path, "sha256": art.sha256})
    manifest = {
        "case_id": case_id,
        "artifacts": {p.name: {"path": p.path, "sha256": p.sha256} for p in pointers},
        "files": files,
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return written


def verify_budget_origins(session: Session, case_id: str) -> int:
    """Check every budget account of the case, of every revision, against its whole
    ledger (:meth:`BudgetManager.verify_all_origins` at full depth; seed 000, "The
    Investigator verifies the existing budget origins"). A step reads only the newest
    ledger balance (decision 121); ``investigate verify`` and ``export`` read all of it,
    so a ledger row added outside the engine is found on a finished case too.

    Returns the number of accounts checked.

    Raises:
        InvestigationError: ``BUDGET_ORIGIN_MISMATCH`` naming the first account whose
        ledger differs.
    """
    accounts = session.exec(select(BudgetAccount).where(BudgetAccount.case_id == case_id)
                            .order_by(col(BudgetAccount.revision),
                                      col(BudgetAccount.hypothesis_id))).all()
    by_revision: dict[int, list[BudgetAccount]] = {}
    for account in accounts:
        by_revision.setdefault(account.revision, []).append(account)
    for group in by_revision.values():
        BudgetManager.verify_all_origins(session, group)
    return len(accounts)


def verify_bindings(session: Session, case_id: str) -> int:
    """Check what binds each artifact the chain does not hash to the rows that name it
    (seed 000, "Persistence and recovery": an accepted plan is bound to its successful
    model call, operation, saved request, context and exact output document).

    Every model attempt's request and response artifact holds the sha256 the attempt
    recorded; every plan names an attempt of its operation whose request and response
    are the plan's, the context its step's checkpoint binds, and its own artifact; every
    query result holds the sha256 its ``execute_tool`` recorded. The checkpoint chain
    hashes states and contexts; with these, a request, response, plan or result
    artifact swapped for other stored bytes (what someone who can drop the store's guards
    could do) is found although each artifact's bytes still match its own sha256.

    Returns the number of bindings checked.

    Raises:
        InvestigationError: ``STATE_TAMPERED`` naming the first binding that differs.
    """
    def tampered(what: str) -> InvestigationError:
        return InvestigationError("STATE_TAMPERED", f"case {case_id}: {what}; the store was "
                                  "changed outside the engine")

    stored = dict(session.exec(select(Artifact.path, Artifact.sha256)
                               .where(Artifact.case_id == case_id)).all())
    checked = 0

    def holds(path: str | None, sha: str | None, what: str) -> None:
        nonlocal checked
        if path is None or sha is None:
            return
        if stored.get(path) != sha:
            raise tampered(f"{what} {path} does not hold the bytes (sha256 {sha[:12]}...) "
                           "recorded for it")
        checked += 1

    attempts = {(a.operation_id, a.attempt): a for a in session.exec(
        select(LLMAttempt).join(LLMOperation, col(LLMOperation.id) == LLMAttempt.operation_id)
        .where(LLMOperation.case_id == case_id)).all()}
    for a in attempts.values():
        holds(a.request_path, a.request_sha256, "the model request")
        holds(a.response_path, a.response_sha256, "the model response")
    contexts = {(c.revision, c.seq): c.context_sha256 for c in session.exec(
        select(Checkpoint).where(Checkpoint.case_id == case_id)).all()}
    for plan in session.exec(select(Plan).where(Plan.case_id == case_id)
                             .order_by(col(Plan.revision), col(Plan.step_seq))).all():
        step = f"the plan of step {plan.step_seq} (revision {plan.revision})"
        attempt = attempts.get((plan.llm_operation_id, plan.llm_attempt))
        if attempt is None or attempt.request_sha256 != plan.request_sha256 \
                or attempt.response_sha256 != plan.output_sha256:
            raise tampered(f"{step} is not bound to the model call it names (operation "
                           f"{plan.llm_operation_id}, attempt {plan.llm_attempt})")
        context = contexts.get((plan.revision, plan.step_seq))
        if context is not None and context != plan.context_sha256:
            raise tampered(f"{step} names another context than checkpoint "
                           f"{plan.step_seq} binds")
        holds(plan.plan_path, plan.plan_sha256, "the plan")
    for run in session.exec(select(StageRun).where(StageRun.case_id == case_id,
                                                   StageRun.stage == "execute_tool")).all():
        output = jsonio.loads(run.output_json)
        if isinstance(output, dict) and output.get("result_path"):
            holds(output["result_path"], output.get("result_sha256"), "the query result")
    return checked


def verify_figures(session: Session, case_id: str) -> int:
    """Check the figures the read commands show that no checkpoint state holds against
    the stored bytes they came from (a 500-step case's reader changed each with the
    store's guards dropped, and ``verify`` said "intact"; decision 192):

    * every assessed evidence record has the score of the plan that assessed it (the
      plan's step's context names the record as its previous result), and every record a
      published step assessed is assessed so; a record no plan assessed is not assessed;
    * every question row is the question of that id a plan asked (ids ``Q<n>`` in the
      order of the plans), with its text, hypothesis and step, resolved at the step of the
      first plan that resolved it with the evidence that plan cited, and every question a
      published step asked exists;
    * a model operation stores its attempts 1 to its count, the last one succeeded
      exactly when the operation did; an attempt that did not succeed records no token
      counts, one that succeeded the counts its stored response reports (``usage``, read
      as the gateway reads a chat completion; none for a scripted reply line).

    Plans and contexts are read from their artifacts, which :func:`verify_bindings` binds
    to the chain and the model calls; the plans of a step not published yet count too
    (its records may be written already). Returns the number of figures checked.

    Raises:
        InvestigationError: ``STATE_TAMPERED`` naming the first figure that differs.
    """
    def tampered(what: str) -> InvestigationError:
        return InvestigationError("STATE_TAMPERED", f"case {case_id}: {what}; the store was "
                                  "changed outside the engine")

    def document(path: str, sha: str, what: str) -> Any:
        art = Store.get_artifact(session, case_id, path)
        if art is None or art.sha256 != sha:
            raise tampered(f"{what} {path} does not hold the bytes recorded for it")
        try:
            return jsonio.loads(art.data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise tampered(f"{what} {path} is not a JSON document") from None

    def figures(plan: Plan, step: str) -> tuple[int | None, list[str], list[str], list[str]]:
        """The assessment score, the new questions, the questions resolved and the
        evidence ids cited of ``plan``'s accepted decision."""
        try:
            reply = document(plan.plan_path, plan.plan_sha256,
                             f"the plan of {step}")["decision"]["reply"]
            assessment, update = reply["assessment"], reply["update"]
            asks, resolves, cites = (update["new_questions"], update["resolve_questions"],
                                     update["evidence_ids"])
            score = None if assessment is None else assessment["score"]
        except (KeyError, TypeError, IndexError):
            raise tampered(f"the plan of {step} is not an accepted decision") from None
        if (score is not None and (type(score) is not int or not 0 <= score <= 100)) \
                or not all(isinstance(v, list) and all(isinstance(x, str) for x in v)
                           for v in (asks, resolves, cites)):
            raise tampered(f"the plan of {step} is not an accepted decision")
        return score, asks, resolves, cites

    checked = 0
    published = {(c.revision, c.seq) for c in session.exec(
        select(Checkpoint).where(Checkpoint.case_id == case_id)).all()}
    evidence = {e.evidence_id: e for e in session.exec(
        select(Evidence).where(Evidence.case_id == case_id)).all()}
    #: evidence id -> (the score a plan gave it, that plan's step, whether published)
    scored: dict[str, tuple[int, str, bool]] = {}
    asked: dict[str, tuple[str, int, int, bool]] = {}
    #: question id -> (the step that resolved it, the evidence its plan cited, published)
    resolved: dict[str, tuple[int, str, bool]] = {}
    for plan in session.exec(select(Plan).where(Plan.case_id == case_id)
                             .order_by(col(Plan.revision), col(Plan.step_seq))).all():
        step = f"step {plan.step_seq} (revision {plan.revision})"
        shown = (plan.revision, plan.step_seq) in published
        score, asks, resolves, cites = figures(plan, step)
        for qid in resolves:  # the first plan that resolves a question resolves it
            resolved.setdefault(qid, (plan.step_seq, canonical_json(cites).decode(), shown))
        if score is not None:
            context = document(ARTIFACT_CONTEXT.format(seq=plan.step_seq),
                               plan.context_sha256, f"the context of {step}")
            previous = context.get("previous_result") if isinstance(context, dict) else None
            eid = previous.get("evidence_id") if isinstance(previous, dict) else None
            if not isinstance(eid, str) or eid not in evidence:
                raise tampered(f"the record the plan of {step} assessed is not stored")
            scored[eid] = (score, step, shown)
        for text in asks:
            asked[f"Q{len(asked) + 1}"] = (text, plan.hypothesis_id, plan.step_seq, shown)
    for eid, record in evidence.items():
        score, step, shown = scored.get(eid, (None, "", False))
        if record.assessed and score is None:
            raise tampered(f"evidence {eid} is assessed (score {record.assessment_score}), "
                           "but no plan assessed it")
        if score is not None and (record.assessed or shown) and \
                (not record.assessed or record.assessment_score != score):
            said = "not assessed" if not record.assessed else "missing" \
                if record.assessment_score is None else record.assessment_score
            raise tampered(f"evidence {eid}'s assessment score is {said}, not the {score} "
                           f"the plan of {step} gave it")
        checked += record.assessed
    rows = {q.question_id: q for q in session.exec(
        select(Question).where(Question.case_id == case_id)).all()}
    for qid, q in rows.items():
        plan_asked = asked.get(qid)
        if plan_asked is None or (q.text, q.hypothesis_id, q.created_step) != plan_asked[:3]:
            raise tampered(f"question {qid} (step {q.created_step}) is not the question a "
                           "plan asked")
        step_resolved, evidence_cited, shown = resolved.get(qid, (None, None, False))
        as_resolved = (q.resolved_step, q.resolution_evidence_json) == \
            (step_resolved, evidence_cited)
        if q.status not in ("open", "resolved") or (q.status == "resolved" and not as_resolved) \
                or (q.status == "open" and shown):
            raise tampered(f"question {qid} is {q.status}"
                           + (f" at step {q.resolved_step}" if q.status == "resolved" else "")
                           + ", not as the plans resolved it")
        checked += 1
    if missing := [qid for qid, (*_, shown) in asked.items() if shown and qid not in rows]:
        raise tampered(f"question {missing[0]}, which a published step asked, is not stored")
    return checked + _verify_attempts(session, case_id, tampered)


def _verify_attempts(session: Session, case_id: str,
                     tampered: Callable[[str], InvestigationError]) -> int:
    """:func:`verify_figures`' model attempts: each operation stores attempts 1 to its
    count, the last one succeeded exactly when the operation did (an attempt added,
    deleted or turned into a failure changed the counts `status` and `run` show, a
    hostile trial); an attempt that did not succeed records no token counts, one that
    succeeded the counts its stored response reports. Returns the succeeded attempts
    checked."""
    from investigation.llm.gateway import (
        ATTEMPT_FAILED,
        ATTEMPT_REJECTED,
        ATTEMPT_SENT,
        ATTEMPT_SUCCEEDED,
        OP_SUCCEEDED,
    )

    statuses = (ATTEMPT_SENT, ATTEMPT_SUCCEEDED, ATTEMPT_FAILED, ATTEMPT_REJECTED)
    operations = {o.id: o for o in session.exec(
        select(LLMOperation).where(LLMOperation.case_id == case_id)).all() if o.id is not None}
    attempts: dict[int, list[LLMAttempt]] = {op_id: [] for op_id in operations}
    for a in session.exec(
            select(LLMAttempt).join(LLMOperation,
                                    col(LLMOperation.id) == LLMAttempt.operation_id)
            .where(LLMOperation.case_id == case_id)
            .order_by(col(LLMAttempt.operation_id), col(LLMAttempt.attempt))).all():
        attempts[a.operation_id].append(a)
    checked = 0
    for op_id, made in attempts.items():
        op = operations[op_id]
        if [a.attempt for a in made] != list(range(1, op.attempts_made + 1)):
            raise tampered(f"model operation {op_id} records {op.attempts_made} attempt(s) "
                           f"but stores attempts {[a.attempt for a in made]}")
        won = [a.attempt for a in made if a.status == ATTEMPT_SUCCEEDED]
        if won != ([op.attempts_made] if op.status == OP_SUCCEEDED else []):
            raise tampered(f"model operation {op_id} is {op.status} with succeeded "
                           f"attempt(s) {won}")
        for a in made:
            which = f"attempt {a.attempt} of model operation {op_id}"
            if a.status not in statuses:
                raise tampered(f"{which} has the status {a.status!r}, which no attempt has")
            recorded = (a.prompt_tokens, a.completion_tokens)
            if a.status != ATTEMPT_SUCCEEDED:
                if recorded != (None, None):  # the gateway records no counts for a failure
                    raise tampered(f"{which} did not succeed ({a.status}) yet records token "
                                   "counts")
                continue
            art = None if a.response_path is None else \
                Store.get_artifact(session, case_id, a.response_path)
            if art is None or art.sha256 != a.response_sha256:
                raise tampered(f"{which} succeeded, but its response is not stored as "
                               "recorded")
            reported = _completion_usage(art.data)
            if recorded != reported:
                raise tampered(f"{which} records {recorded[0]} prompt and {recorded[1]} "
                               f"completion tokens; its response {a.response_path} reports "
                               f"{reported[0]} and {reported[1]}")
            checked += 1
    return checked


def _completion_usage(raw: bytes) -> tuple[int | None, int | None]:
    """The token counts the gateway read from a stored answer: a chat completion's (a
    JSON object with ``choices``) ``usage``; nothing of a scripted provider's reply line
    or any other body."""
    try:
        doc = jsonio.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, None
    if not isinstance(doc, dict) or not isinstance(doc.get("choices"), list):
        return None, None
    return spend.usage_in(doc)


def _verify_rows(s: Session, case_id: str, ledgers: bool = False
                 ) -> tuple[CaseRecord, int, bool, int, int, int]:
    """What ``verify`` and ``export`` check before they read the artifacts: the whole
    chain replayed, the live rows against the head state at full depth and the ledgers
    (unless a step is in progress; ``ledgers``: read them then too, as ``export`` always
    did), the bindings and the figures. ``export`` read no live row, so a question deleted
    or reopened was exported from a case ``verify`` refused (a hostile trial).

    Returns ``(case, head_seq, step_in_progress, accounts_read, bindings, figures)``.

    Raises:
        InvestigationError: as :func:`verify`.
    """
    case = s.get(CaseRecord, case_id)
    if case is None:
        raise InvestigationError("CASE_NOT_FOUND", f"no case {case_id}")
    head = checkpoints.replay(s, case)
    running = s.exec(select(StageRun.stage).where(
        StageRun.case_id == case_id, StageRun.revision == case.current_revision,
        StageRun.step_seq == case.head_seq + 1)).first() is not None
    if not running:
        live.verify_live_state(s, case, head.head_state, head.head_seq, head.head_revision,
                               full=True, recorded=head.evidence)
    accounts = verify_budget_origins(s, case_id) if ledgers or not running else 0
    return (case, head.head_seq, running, accounts, verify_bindings(s, case_id),
            verify_figures(s, case_id))


def verify(store: Store, case_id: str) -> dict[str, Any]:
    """Check a whole case from the store's bytes (``investigate verify``).

    The checkpoint chain is replayed in full (no process cache: every state and context
    read again, every archive digest recomputed), the live rows are checked against the
    head state at full depth (every evidence fingerprint recomputed, its artifact re-read)
    and every budget account against its whole ledger (:func:`verify_budget_origins`)
    unless a step is in progress, and every artifact of the case is decoded and checked
    against its sha256, and the records that name the artifacts the chain does not hash
    (:func:`verify_bindings`), and the figures no state holds against the stored bytes
    they came from (:func:`verify_figures`: assessment scores, questions, token counts).

    Returns:
        ``{"case_id", "checkpoints", "artifacts", "artifact_bytes", "live_rows",
        "budget_accounts", "bindings", "figures"}`` where ``live_rows`` is ``"checked"``,
        ``"step N in progress"`` or, for a cancelled or stopped case, ``"step N left
        unfinished when the case was CANCELLED"`` (or ``STOPPED``), and ``budget_accounts``
        the number of accounts whose ledger was read (0 while a step is in progress).

    Raises:
        InvestigationError: ``CASE_NOT_FOUND``; ``CHECKPOINT_INVALID``,
        ``POLICY_CHANGED``, ``STATE_TAMPERED``, ``BUDGET_ORIGIN_MISMATCH`` or
        ``STORE_ARTIFACT_CORRUPT`` at the first fact that differs.
    """
    with store.session() as s:
        case, head_seq, running, accounts, bindings, figures = _verify_rows(s, case_id)
        count = total = 0
        for art in Store.artifacts(s, case_id):
            count += 1
            total += len(art.data)
    if not running:
        rows = "checked"
    elif case.state in (CASE_CANCELLED, CASE_STOPPED):  # nothing will finish that step
        rows = f"step {case.head_seq + 1} left unfinished when the case was {case.state}"
    else:
        rows = f"step {case.head_seq + 1} in progress"
    return {"case_id": case_id, "checkpoints": head_seq, "artifacts": count,
            "artifact_bytes": total, "budget_accounts": accounts, "bindings": bindings,
            "figures": figures, "live_rows": rows}
