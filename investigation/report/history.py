"""A case's whole investigation history as plain data, read from the store.

:func:`case_history` gathers, in one read transaction and one query per table, what the
HTML report (``investigation.report.html``) draws: every step (hypothesis, action,
operation, outcome, rejection code, model time, tokens), each hypothesis's confidence
over the steps, each account's ledger (credit, charges, refunds, balance after), the
evidence with its findings and artifact paths, the questions, the external tests, the
early-diagnosis reviews, the lifecycle and what to do next.

Only stored rows are read (no artifact bytes, no clock): the same store gives the same
history, except the model times, which are the attempts' recorded wall-clock durations.
Every string in it is untrusted text as stored (the snapshot's, the model's); escaping
is the renderer's job.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlmodel import col, select

from investigation import jsonio
from investigation.constants import ARTIFACT_RAW_RESULT
from investigation.external_tests.coordinator import FEEDBACK_OPERATION
from investigation.guidance import Guidance, for_case
from investigation.llm.gateway import ATTEMPT_FAILED, ATTEMPT_REJECTED, ATTEMPT_SUCCEEDED
from investigation.llm.types import PROVIDER_INTERRUPTED
from investigation.loop.scheduler import FIRST_TURN, HIGHEST_CONFIDENCE
from investigation.operations import status
from investigation.secrets import default_masker
from investigation.store.engine import Store
from investigation.store.models import (
    CaseRecord,
    Checkpoint,
    Evidence,
    HypothesisBirth,
    LedgerEntry,
    LLMAttempt,
    LLMOperation,
    Plan,
    Question,
    RevisionRecord,
    StageRun,
    TestRequest,
)

#: Ledger kinds in the order they happen within one step (settle before reserve).
_KIND_ORDER = {"credit": 0, "refund": 1, "reserve": 2}


@dataclass
class StepRow:
    """One step of the case (a published checkpoint, or the step in progress).

    ``model_ms`` sums the recorded duration of every finished attempt of the step's model
    calls (:func:`attempt_ms`: an interrupted call has none);
    ``prompt_tokens``/``completion_tokens`` are ``None`` when no provider reported them (a
    scripted provider reports none).
    """

    seq: int
    hypothesis_id: int | None
    published: bool
    outcome: str | None
    reason: str | None
    closing_step: bool = False
    action: str | None = None
    operation: str | None = None
    arguments: Any = None
    confidence: str | None = None
    score: int | None = None
    #: The evidence record the step's assessment scored (the previous result of the
    #: hypothesis, not this step's own) and the model's reason for the score.
    assessed_evidence: str | None = None
    score_reason: str = ""
    note: str = ""
    rejection_code: str | None = None
    rejection_detail: str | None = None
    evidence_id: str | None = None
    charged_units: int = 0
    refunded_units: int = 0
    balance_after: int | None = None
    model_ms: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    attempts: int = 0
    providers: list[str] = field(default_factory=list)
    provider_errors: list[str] = field(default_factory=list)
    #: Whether one of the step's model attempts succeeded: its provider errors were then
    #: retried past, not what stopped it.
    model_answered: bool = False
    new_questions: list[str] = field(default_factory=list)
    new_question_ids: list[str | None] = field(default_factory=list)  # None: not stored
    #: The hypothesis's first record with the same fingerprint, when the step's own
    #: record repeats it (its ``found`` line says ``duplicate of`` that record).
    duplicate_of: str | None = None
    resolved_questions: list[str] = field(default_factory=list)
    test_request: str | None = None
    #: The hypothesis's confidence before this step's decision (its previous decision's,
    #: or ``unassessed``); ``confidence`` is after it.
    confidence_before: str | None = None
    #: The evidence the decision cites for its confidence (``update.evidence_ids``).
    cited_evidence: list[str] = field(default_factory=list)
    #: What the step's own query found, for its evidence cell: ``"N items, K new"``, then
    #: ``"duplicate"`` and the result's warnings when there are any.
    found: list[str] = field(default_factory=list)
    #: Why the step went to its hypothesis: ``build_context``'s ``selection``
    #: (``scheduler.Selection.to_dict``); ``None`` for a step recorded before decision 166
    #: and for a closing step.
    selection: dict[str, Any] | None = None


def units_text(s: StepRow) -> str:
    """The units step ``s`` moved, as the report's step table and ``investigate steps``
    show them: ``-2 +2 (refund for E249) (97 left)``; ``""`` when it moved none. A
    refund is the earlier record's that the step assessed (seed 000, "Budget"), named so
    (a 500-step reader took the +2 beside a duplicate found at that step for its own)."""
    parts = []
    if s.charged_units:
        parts.append(f"-{s.charged_units}")
    if s.refunded_units:
        parts.append(f"+{s.refunded_units}"
                     + (f" (refund for {s.assessed_evidence})" if s.assessed_evidence else ""))
    if parts and s.balance_after is not None:
        parts.append(f"({s.balance_after} left)")
    return " ".join(parts)


def selection_text(s: StepRow) -> str:
    """Why the scheduler gave the step to its hypothesis (seed 000, "Deterministic cycle",
    step 1), from the rule it recorded: ``first turn; H2 has not had one yet (lowest id
    goes first)``, ``highest confidence of 3 active: weak``; ``""`` for a step recorded
    without one (plain text: the report and ``investigate steps`` escape it)."""
    sel = s.selection
    if not isinstance(sel, dict):
        return ""
    tied = [f"H{i}" for i in sel.get("tied", []) if i != s.hypothesis_id]
    others = ", ".join(tied)
    if sel.get("rule") == FIRST_TURN:
        waiting = "has" if len(tied) == 1 else "have"
        text = "first turn" + (f"; {others} {waiting} not had one yet (lowest id goes first)"
                               if tied else "")
    elif sel.get("rule") == HIGHEST_CONFIDENCE:
        if sel.get("active") == 1:
            text = "the only active hypothesis"
        else:
            text = f"highest confidence of {sel.get('active')} active: {sel.get('confidence')}"
            if others:
                text += f", tied with {others} (lowest id goes first)"
    else:
        return ""
    return text


@dataclass
class CaseHistory:
    """Everything the report shows (see the module docstring)."""

    status: dict[str, Any]
    interpretation: dict[str, Any]
    statements: dict[int, str]
    steps: list[StepRow]
    confidence: dict[int, list[tuple[int, str]]]
    ledger: dict[int, list[dict[str, Any]]]
    evidence: list[dict[str, Any]]
    questions: list[dict[str, Any]]
    tests: list[dict[str, Any]]
    reviews: list[dict[str, Any]]
    guidance: Guidance
    #: The label of model costs (``limits.currency``).
    currency: str = "USD"

    @property
    def case_id(self) -> str:
        return str(self.status["case_id"])


def attempt_ms(a: LLMAttempt) -> int | None:
    """How long attempt ``a`` waited for its server, in milliseconds, or ``None``. An
    attempt whose call was interrupted (``PROVIDER_INTERRUPTED``: its process stopped,
    or Ctrl-C) has no measured duration: its row is closed when the gateway gives it up,
    after the in-flight grace, and that wait was shown as ten minutes of model time (a
    real model's user)."""
    if a.error_code == PROVIDER_INTERRUPTED:
        return None
    return _ms(a.started_at, a.finished_at)


def _ms(start: datetime | None, end: datetime | None) -> int | None:
    if start is None or end is None:
        return None
    return max(0, round((end - start).total_seconds() * 1000))


def _items(findings_json: str) -> list[dict[str, str]]:
    """Each finding as ``{"key", "quote"}``: the snapshot's exact text (or the row as JSON)."""
    out = []
    for item in jsonio.loads(findings_json):
        if "text" in item:
            quote = str(item["text"])
        elif "row" in item:
            quote = json.dumps(item["row"], sort_keys=True, ensure_ascii=False)
        else:
            quote = json.dumps({k: v for k, v in item.items() if k != "key"},
                               sort_keys=True, ensure_ascii=False)
        out.append({"key": str(item.get("key", "")), "quote": quote})
    return out


def case_history(store: Store, case_id: str, env: str | None = None,
                 currency: str = "USD", guidance: Guidance | None = None) -> CaseHistory:
    """Read the whole history of ``case_id`` (see the module docstring); ``env`` prefixes
    the guidance's commands (``investigation.guidance.for_case``); ``currency`` labels
    model costs (``limits.currency``) where the case's attempts recorded none;
    ``guidance``, when given, replaces the store's own advice (the caller's shell knows
    more: a run or a dispatch that holds the case).

    Raises:
        InvestigationError: ``CASE_NOT_FOUND``.
    """
    info = status(store, case_id)
    if guidance is None:
        guidance = for_case(store, case_id, env=env)
    revision = int(info["revision"])
    with store.session() as s:
        rev = s.exec(select(RevisionRecord).where(RevisionRecord.case_id == case_id,
                                                  RevisionRecord.revision == revision)).one()
        births = s.exec(select(HypothesisBirth).where(
            HypothesisBirth.case_id == case_id, HypothesisBirth.revision == revision)
            .order_by(col(HypothesisBirth.hypothesis_id))).all()
        checkpoints = s.exec(select(Checkpoint).where(Checkpoint.case_id == case_id)
                             .order_by(col(Checkpoint.seq))).all()
        runs = s.exec(select(StageRun).where(
            StageRun.case_id == case_id, StageRun.revision == revision,
            col(StageRun.stage).in_(("build_context", "validate")))).all()
        plans = s.exec(select(Plan).where(Plan.case_id == case_id, Plan.revision == revision)
                       .order_by(col(Plan.step_seq))).all()
        ledger_rows = s.exec(select(LedgerEntry).where(
            LedgerEntry.case_id == case_id, LedgerEntry.revision == revision)).all()
        evidence_rows = s.exec(select(Evidence).where(
            Evidence.case_id == case_id, Evidence.revision == revision)
            .order_by(col(Evidence.ordinal))).all()
        question_rows = s.exec(select(Question).where(
            Question.case_id == case_id, Question.revision == revision)
            .order_by(col(Question.ordinal))).all()
        operations = s.exec(select(LLMOperation).where(
            LLMOperation.case_id == case_id, LLMOperation.revision == revision)).all()
        op_step = {o.id: o.step_seq for o in operations}
        attempts = s.exec(select(LLMAttempt).where(
            col(LLMAttempt.operation_id).in_(list(op_step) or [-1]))
            .order_by(col(LLMAttempt.id))).all()
        test_rows = s.exec(select(TestRequest).where(
            TestRequest.case_id == case_id, TestRequest.revision == revision)
            .order_by(col(TestRequest.id))).all()

    built: dict[int, dict[str, Any]] = {}
    verdicts: dict[int, dict[str, Any]] = {}
    for r in runs:
        (built if r.stage == "build_context" else verdicts)[r.step_seq] = jsonio.loads(
            r.output_json)
    published = {c.seq: c for c in checkpoints}
    seqs = sorted(set(published) | set(built))
    steps: dict[int, StepRow] = {}
    for seq in seqs:
        cp = published.get(seq)
        b = built.get(seq, {})
        hid = cp.hypothesis_id if cp is not None else b.get("hypothesis_id")
        row = StepRow(seq=seq, hypothesis_id=hid, published=cp is not None,
                      outcome=cp.outcome if cp else None, reason=cp.reason if cp else None,
                      closing_step=bool(b.get("finalize")), selection=b.get("selection"))
        v = verdicts.get(seq)
        if v is not None and v.get("accepted") is False:
            row.rejection_code, row.rejection_detail = v.get("code"), v.get("detail")
        steps[seq] = row
    if seqs and not steps[seqs[-1]].published:  # the step in progress (blocked, backoff)
        last = steps[seqs[-1]]
        last.outcome, last.reason = info["last_outcome"], info["last_reason"]

    for a in attempts:
        at = steps.get(op_step.get(a.operation_id, -1))
        if at is None:
            continue
        at.attempts += 1
        if a.provider not in at.providers:
            at.providers.append(a.provider)
        if a.error_code:
            at.provider_errors.append(a.error_code)
        if a.status == ATTEMPT_SUCCEEDED:
            at.model_answered = True
        ms = attempt_ms(a)
        if ms is not None:
            at.model_ms = (at.model_ms or 0) + ms
        if a.prompt_tokens is not None:
            at.prompt_tokens = (at.prompt_tokens or 0) + a.prompt_tokens
        if a.completion_tokens is not None:
            at.completion_tokens = (at.completion_tokens or 0) + a.completion_tokens

    confidence: dict[int, list[tuple[int, str]]] = {b.hypothesis_id: [(0, "unassessed")]
                                                    for b in births}
    reviews = []
    recorded = {e.evidence_id: e for e in evidence_rows}
    for p in plans:
        decision = jsonio.loads(p.decision_json)
        reply = decision["reply"]
        upd, nxt = reply["update"], reply["next"]
        series = confidence.setdefault(p.hypothesis_id, [(0, "unassessed")])
        before = series[-1][1]
        series.append((p.step_seq, upd["confidence"]))
        planned = steps.get(p.step_seq)
        if planned is not None:
            planned.confidence_before = before
            planned.action, planned.operation = nxt["action"], nxt.get("operation")
            planned.arguments = nxt.get("arguments") if "arguments" in nxt else (
                nxt.get("test") or {"reason": nxt.get("reason", "")})
            planned.confidence, planned.note = upd["confidence"], upd.get("note", "")
            planned.cited_evidence = [str(e) for e in upd.get("evidence_ids") or []]
            assessment = reply.get("assessment") or {}
            planned.score = assessment.get("score")
            planned.score_reason = str(assessment.get("reason") or "")
            # The record assessed is the hypothesis's pending result, which the cited ids
            # must include (validation), among others the model may cite first: the
            # hypothesis's own record cited that was recorded last before this step.
            cited = [recorded.get(str(eid)) for eid in assessment.get("evidence_ids") or []]
            mine = [e for e in cited if e is not None and e.hypothesis_id == p.hypothesis_id
                    and e.step_seq < p.step_seq]
            planned.assessed_evidence = max(mine, key=lambda e: e.ordinal).evidence_id \
                if mine else None
            planned.new_questions = list(upd.get("new_questions", []))
            planned.resolved_questions = list(upd.get("resolve_questions", []))
        review = decision.get("early_diagnosis")
        if review:
            reviews.append({"step_seq": p.step_seq, "hypothesis_id": p.hypothesis_id,
                            **review})

    ledger: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for entry in sorted(ledger_rows, key=lambda x: (x.hypothesis_id, x.step_seq,
                                                    _KIND_ORDER.get(x.kind, 9), x.id or 0)):
        ledger[entry.hypothesis_id].append({
            "step_seq": entry.step_seq, "kind": entry.kind,
            "amount_units": entry.amount_units,
            "balance_after_units": entry.balance_after_units, "reference": entry.reference})
        moved = steps.get(entry.step_seq)
        if moved is not None and entry.hypothesis_id == moved.hypothesis_id:
            if entry.kind == "reserve":
                moved.charged_units += -entry.amount_units
            elif entry.kind == "refund":
                moved.refunded_units += entry.amount_units
            moved.balance_after = entry.balance_after_units

    evidence = []
    # The hypothesis's first record of each fingerprint (operation, arguments, findings):
    # a duplicate names it, as summary.md does.
    first_of: dict[tuple[int, str], str] = {}
    for e in evidence_rows:
        original = first_of.setdefault((e.hypothesis_id, e.fingerprint), e.evidence_id)
        record = {
            "evidence_id": e.evidence_id, "step_seq": e.step_seq,
            "hypothesis_id": e.hypothesis_id, "operation": e.operation,
            "arguments": jsonio.loads(e.arguments_json), "item_count": e.item_count,
            "new_item_count": e.new_item_count, "duplicate": e.duplicate,
            "duplicate_of": original if e.duplicate and original != e.evidence_id else None,
            "cost_units": e.cost_units, "assessed": e.assessed,
            "assessment_score": e.assessment_score, "refund_units": e.refund_units,
            "warnings": jsonio.loads(e.warnings_json), "artifact_path": e.artifact_path,
            "artifact_sha256": e.artifact_sha256,
            "result_path": ARTIFACT_RAW_RESULT.format(seq=e.step_seq)
            if e.operation != FEEDBACK_OPERATION else None,
            "items": _items(e.findings_json)}
        evidence.append(record)
        own = steps.get(e.step_seq)
        if own is not None and own.evidence_id is None:  # the step's own result
            own.evidence_id = e.evidence_id
            own.found = [f"{e.item_count} item{'' if e.item_count == 1 else 's'}, "
                         f"{e.new_item_count} new"]
            if e.duplicate:
                own.duplicate_of = record["duplicate_of"]
                own.found.append("duplicate" if own.duplicate_of is None
                                 else f"duplicate of {own.duplicate_of}")
            if record["warnings"]:
                own.found.append("warnings: " + ", ".join(map(str, record["warnings"])))
    tests = []
    for t in test_rows:
        if t.step_seq in steps:
            steps[t.step_seq].test_request = t.request_id
        tests.append({"request_id": t.request_id, "step_seq": t.step_seq,
                      "hypothesis_id": t.hypothesis_id, "kind": t.kind, "status": t.status,
                      "deadline_at": t.deadline_at.isoformat(), "evidence_id": t.evidence_id,
                      "artifact_path": t.artifact_path})
    # Each question asked where it was asked: its id beside the step's text (a reader
    # met "resolves: Q1" with no Q1 anywhere in the table).
    asked: dict[tuple[int, str], str] = {(q.created_step, q.text): q.question_id
                                         for q in question_rows}
    for st in steps.values():
        st.new_question_ids = [asked.get((st.seq, text)) for text in st.new_questions]
    questions = [{"question_id": q.question_id, "hypothesis_id": q.hypothesis_id,
                  "text": q.text, "status": q.status, "created_step": q.created_step,
                  "resolved_step": q.resolved_step,
                  "resolution_evidence": jsonio.loads(q.resolution_evidence_json or "[]")}
                 for q in question_rows]
    return CaseHistory(
        # Upstream text is shown as the model saw it: secrets masked (loop.context).
        status=info,
        interpretation=default_masker().mask_names(jsonio.loads(rev.interpretation_json))[0],
        statements={b.hypothesis_id: default_masker().mask_prefix(b.statement)[0]
                    for b in births},
        steps=[steps[k] for k in seqs], confidence=confidence, ledger=dict(ledger),
        evidence=evidence, questions=questions, tests=tests, reviews=reviews,
        guidance=guidance, currency=info["model_usage"].get("currency") or currency)


def usage_totals(store: Store, case_id: str) -> dict[str, int | None]:
    """Model time and tokens of every model call of the case so far.

    Returns:
        ``{"calls", "attempts", "failed", "model_ms", "prompt_tokens",
        "completion_tokens"}``: ``calls`` the answered ones (as ``status`` counts model
        calls), ``attempts`` every request sent, ``failed`` those that got no usable
        answer (in flight ones are neither); a token total is ``None`` when no provider
        reported one.
    """
    with store.session() as s:
        op_ids = s.exec(select(LLMOperation.id).where(LLMOperation.case_id == case_id)).all()
        attempts = s.exec(select(LLMAttempt).where(
            col(LLMAttempt.operation_id).in_(list(op_ids) or [-1]))).all()
    answered = sum(a.status == ATTEMPT_SUCCEEDED for a in attempts)
    failed = sum(a.status in (ATTEMPT_FAILED, ATTEMPT_REJECTED) for a in attempts)
    totals = _attempt_totals(attempts)
    return {"calls": answered, "attempts": len(attempts), "failed": failed, **totals,
            "model_ms": totals["model_ms"] or 0}


def _attempt_totals(attempts: Sequence[LLMAttempt]) -> dict[str, int | None]:
    """``{"model_ms", "prompt_tokens", "completion_tokens"}`` of ``attempts``: their wall
    time in milliseconds (``None`` without attempts) and reported tokens (``None`` when
    none was reported)."""
    prompt = [a.prompt_tokens for a in attempts if a.prompt_tokens is not None]
    completion = [a.completion_tokens for a in attempts if a.completion_tokens is not None]
    return {"model_ms": sum(attempt_ms(a) or 0 for a in attempts) if attempts else None,
            "prompt_tokens": sum(prompt) if prompt else None,
            "completion_tokens": sum(completion) if completion else None}


def step_facts(store: Store, case_id: str, step_seq: int) -> dict[str, Any]:
    """What one step did, for ``run``'s line per step (a real model's user, piping
    ``run``, saw only "step 4 H1: PROGRESSED" for steps of one to two minutes).

    Returns:
        ``{"action", "operation", "model_ms", "prompt_tokens", "completion_tokens"}``:
        the accepted plan's action and operation (``None`` without an accepted plan), the
        wall time of the step's model attempts in milliseconds and their reported tokens
        (``None`` when none was reported), over the current revision.
    """
    with store.session() as s:
        revision = s.exec(select(CaseRecord.current_revision).where(
            CaseRecord.id == case_id)).one_or_none()
        plan = s.exec(select(Plan.action, Plan.operation).where(
            Plan.case_id == case_id, Plan.revision == revision,
            Plan.step_seq == step_seq)).first()
        attempts = s.exec(select(LLMAttempt).join(
            LLMOperation, col(LLMOperation.id) == col(LLMAttempt.operation_id)).where(
            LLMOperation.case_id == case_id, LLMOperation.revision == revision,
            LLMOperation.step_seq == step_seq)).all()
    return {"action": plan[0] if plan else None, "operation": plan[1] if plan else None,
            **_attempt_totals(attempts)}

