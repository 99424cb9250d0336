"""The bounded context of one decision (seed 000, "Deterministic cycle", step 2).

The context is a JSON document built only from stored facts, so the same store gives
the same bytes. Its shape (keys in canonical order when serialised):

``contract``          prompt and schema versions
``case``              id, revision, package id, the report (at most ``max_report_bytes``)
                      and a snapshot overview (file counts, databases, tables)
``interpretation``    the accepted interpretation, as given
``hypothesis``        the selected hypothesis: statement, confidence, balance, credit,
                      iterations and their cap, turn number, ``deferred_by``, notes
``other_hypotheses``  id, statement, status, confidence, turns and ``deferred_by`` of
                      the others
``budget``            configured costs and the refund cap
``external_tests``    whether tests can be handed out here (a feedback key is
                      configured and a test cost is), the kinds, the frozen deadline
``early_diagnosis``   the frozen review policy: ``enabled``, ``min_evidence``
``allowed_actions``   the actions this turn may take; ``closing_reason`` says why it is
                      restricted (assessment-only deferral, iteration cap, low information,
                      exhausted budget)
``previous_result``   the selected hypothesis's pending evidence with full findings and
                      its novelty, or null (first turn / nothing pending)
``evidence``          the current-revision evidence records it lists, in creation order:
                      the selected hypothesis's newest ``own_evidence_in_context`` (its
                      latest ``full_evidence_in_context`` carry their findings) and the
                      other hypotheses' newest ``other_evidence_in_context``; the rest
                      are compact references (id, operation, arguments, counts, warnings)
``evidence_omitted``  present only when records are not listed: how many (older records
                      beyond the windows, and any that :func:`fit` drops)
``questions``         the selected hypothesis's questions with their status, and the
                      other hypotheses' open ones
``last_rejection``    the code, detail and step of this hypothesis's last rejected reply
                      and the rejected text (``reply``, bounded), or null
``operations``        the snapshot operations with their argument schemas
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, cast

from sqlalchemy import bindparam, func, union_all
from sqlalchemy import select as sa_select
from sqlmodel import Session, col, select

from investigation import jsonio
from investigation.budget import BudgetManager, novelty_permille
from investigation.cases.snapshot import Snapshot
from investigation.config import InvestigationConfig, canonical_json
from investigation.constants import PROMPT_VERSION, REPLY_SCHEMA_VERSION
from investigation.errors import InvestigationError
from investigation.llm.tokens import PromptBudget, estimate_tokens
from investigation.loop.outcome import StepKey
from investigation.loop.prompt import build_messages
from investigation.secrets import MAX_MASKED_CHARS, default_masker
from investigation.store.engine import Store, core
from investigation.store.models import (
    BudgetAccount,
    CaseRecord,
    Evidence,
    HypothesisNote,
    Question,
    StageRun,
)
from investigation.tools import ToolRouter

# The evidence columns a context shows, read as plain rows (findings only for the records
# that show them): a long case has hundreds of records.
_EVIDENCE_COLUMNS = (
    col(Evidence.evidence_id), col(Evidence.hypothesis_id), col(Evidence.operation),
    col(Evidence.arguments_json), col(Evidence.item_count), col(Evidence.new_item_count),
    col(Evidence.duplicate), col(Evidence.warnings_json), col(Evidence.assessed),
    col(Evidence.cost_units), col(Evidence.ordinal))


class _Listed(NamedTuple):
    """One listed evidence row (the columns of ``_EVIDENCE_COLUMNS``, in their order): a
    plain tuple, whose fields read in tens of nanoseconds where a SQLAlchemy ``Row``'s
    attributes take about 300 (a long case's context lists 48 records, each read ten
    times)."""

    evidence_id: str
    hypothesis_id: int
    operation: str
    arguments_json: str
    item_count: int
    new_item_count: int
    duplicate: bool
    warnings_json: str
    assessed: bool
    cost_units: int
    ordinal: int


_OF_REVISION = (col(Evidence.case_id) == bindparam("case_id"),
                col(Evidence.revision) == bindparam("revision"))
# The newest records of the selected hypothesis and of the others, newest first, each
# bounded by its window (``limits.own_evidence_in_context``/``other_evidence_in_context``),
# and the number of records of each side: a long case has hundreds.
_OWN_EVIDENCE = sa_select(*_EVIDENCE_COLUMNS).where(
    *_OF_REVISION, col(Evidence.hypothesis_id) == bindparam("hid")) \
    .order_by(col(Evidence.ordinal).desc()).limit(bindparam("limit"))
_OTHER_EVIDENCE = sa_select(*_EVIDENCE_COLUMNS).where(
    *_OF_REVISION, col(Evidence.hypothesis_id) != bindparam("hid")) \
    .order_by(col(Evidence.ordinal).desc()).limit(bindparam("limit"))
#: Both windows in one query (each bounded by its own limit; told apart by hypothesis).
_WINDOWS = union_all(sa_select(_OWN_EVIDENCE.subquery("own")),
                     sa_select(_OTHER_EVIDENCE.limit(bindparam("other_limit"))
                               .subquery("other")))
_PENDING_EVIDENCE = sa_select(*_EVIDENCE_COLUMNS).where(
    *_OF_REVISION, col(Evidence.evidence_id) == bindparam("evidence_id"))
_EVIDENCE_COUNT = sa_select(func.count()).select_from(Evidence).where(*_OF_REVISION)
_QUESTION_ROWS = sa_select(col(Question.question_id), col(Question.hypothesis_id),
                           col(Question.status), col(Question.text)).where(
    col(Question.case_id) == bindparam("case_id"),
    col(Question.revision) == bindparam("revision")).order_by(col(Question.ordinal))
_FINDINGS = sa_select(col(Evidence.evidence_id), col(Evidence.findings_json)).where(
    col(Evidence.case_id) == bindparam("case_id"),
    col(Evidence.evidence_id).in_(bindparam("ids", expanding=True)))


@functools.lru_cache(maxsize=8192)
def _parsed(text: str) -> Any:
    """A record's arguments or warnings, parsed once per process (records are write-once;
    the result is shared and never changed)."""
    return jsonio.loads(text)


def _evidence_entry(e: _Listed, findings_json: str | None) -> dict[str, Any]:
    (evidence_id, hypothesis_id, operation, arguments_json, item_count, new_item_count,
     duplicate, warnings_json, assessed, _, _) = e
    entry: dict[str, Any] = {
        "evidence_id": evidence_id, "hypothesis_id": hypothesis_id,
        "operation": operation, "arguments": _parsed(arguments_json),
        "item_count": item_count, "new_item_count": new_item_count,
        "duplicate": duplicate, "warnings": _parsed(warnings_json),
        "assessed": assessed,
    }
    if findings_json is not None:
        entry["items"] = jsonio.loads(findings_json)
    return entry


_NOTES = sa_select(col(HypothesisNote.step_seq), col(HypothesisNote.note)).where(
    col(HypothesisNote.case_id) == bindparam("case_id"),
    col(HypothesisNote.revision) == bindparam("revision"),
    col(HypothesisNote.hypothesis_id) == bindparam("hid")) \
    .order_by(col(HypothesisNote.step_seq).desc()).limit(bindparam("limit"))


def _notes(s: Session, key: StepKey, hid: int, limit: int) -> list[dict[str, Any]]:
    """The hypothesis's newest ``limit`` audit notes, oldest first."""
    if limit <= 0:
        return []
    rows = core(s).execute(_NOTES, {"case_id": key.case_id, "revision": key.revision, "hid": hid,
                              "limit": limit}).all()
    return [{"note": note, "step_seq": step} for step, note in reversed(rows)]


#: Characters of a rejected reply carried back to the model (the rest is cut, marked).
MAX_REJECTED_REPLY_CHARS = 6000


def _last_rejection(s: Session, key: StepKey, account: BudgetAccount) -> dict[str, Any] | None:
    """This hypothesis's last rejection with the rejected reply text (bounded), or None.

    The reply is the stored content of that step's ``llm_call``; the prompt gives it back
    to the model as its own turn, followed by the rejection (``loop.prompt``).
    """
    if not account.last_rejection_json:
        return None
    rejection: dict[str, Any] = jsonio.loads(account.last_rejection_json)
    row = s.exec(select(StageRun).where(
        StageRun.case_id == key.case_id, StageRun.revision == key.revision,
        StageRun.step_seq == int(rejection.get("step_seq", -1)),
        StageRun.stage == "llm_call")).first()
    content = jsonio.loads(row.output_json).get("content") if row is not None else None
    if isinstance(content, str):
        if len(content) > MAX_REJECTED_REPLY_CHARS:
            content = content[:MAX_REJECTED_REPLY_CHARS] + " [cut]"
        rejection["reply"] = content
    return rejection


#: The shrunk forms of the rejected reply (characters) and of the report (UTF-8 bytes).
SHRUNK_REJECTED_REPLY_CHARS = 1000
SHRUNK_REPORT_BYTES = 4096


def _cut_rejected_reply(doc: dict[str, Any]) -> bool:
    rejection = doc.get("last_rejection")
    if not isinstance(rejection, dict):
        return False
    reply = rejection.get("reply")
    if not isinstance(reply, str) or len(reply) <= SHRUNK_REJECTED_REPLY_CHARS:
        return False
    rejection["reply"] = reply[:SHRUNK_REJECTED_REPLY_CHARS] + " [cut]"
    return True


def _drop_tables(doc: dict[str, Any]) -> bool:
    snapshot = doc["case"]["snapshot"]
    if not snapshot.get("tables"):
        return False
    snapshot["tables_omitted"] = len(snapshot["tables"])
    snapshot["tables"] = []
    return True


def _cut_report(doc: dict[str, Any]) -> bool:
    report = doc["case"]["report"].encode("utf-8")
    if len(report) <= SHRUNK_REPORT_BYTES:
        return False
    doc["case"]["report"] = report[:SHRUNK_REPORT_BYTES].decode("utf-8", errors="ignore")
    doc["case"]["report_truncated"] = True
    return True


def fit(doc: dict[str, Any], limit: int) -> bytes:
    """Serialise ``doc`` within ``limit`` bytes, shrinking it deterministically if needed.

    In order, until it fits: evidence other than the previous result loses its findings
    (``items``, marked ``"items_omitted": true``); compact references get abbreviated
    arguments; the hypothesis keeps only its last note; compact references of other
    hypotheses are dropped (``"evidence_omitted"`` counts them); other hypotheses'
    questions are dropped (``"questions_omitted"``) and their statements abbreviated; the
    rejected reply carried back is cut to :data:`SHRUNK_REJECTED_REPLY_CHARS`; the table
    list is dropped (``"tables_omitted"``); the report is cut to
    :data:`SHRUNK_REPORT_BYTES` (``"report_truncated": true``); last, the previous result
    keeps only its first findings, halved until it fits (at least one; ``"items_shown"``
    says how many of ``item_count``). The selected hypothesis's questions and the
    contract are never cut: they are bounded by the contract (questions per hypothesis,
    text lengths).

    Raises:
        InvestigationError: ``CONTEXT_TOO_LARGE`` when even the smallest form is over.
    """
    data = canonical_json(doc)
    if len(data) <= limit:
        return data
    selected = doc["hypothesis"]["id"]
    previous = (doc.get("previous_result") or {}).get("evidence_id")
    for entry in doc["evidence"]:
        if "items" in entry and entry["evidence_id"] != previous:
            del entry["items"]
            entry["items_omitted"] = True
    data = canonical_json(doc)
    if len(data) <= limit:
        return data
    for entry in doc["evidence"]:
        text = canonical_json(entry["arguments"]).decode("utf-8")
        if len(text) > 200 and entry["evidence_id"] != previous:
            entry["arguments"] = {"abbreviated": text[:200] + "..."}
    doc["hypothesis"]["notes"] = doc["hypothesis"]["notes"][-1:]
    data = canonical_json(doc)
    if len(data) <= limit:
        return data
    kept = [e for e in doc["evidence"]
            if e["hypothesis_id"] == selected or e["evidence_id"] == previous]
    doc["evidence_omitted"] = doc.get("evidence_omitted", 0) + len(doc["evidence"]) - len(kept)
    doc["evidence"] = kept
    data = canonical_json(doc)
    if len(data) <= limit:
        return data
    own = [q for q in doc["questions"] if q["hypothesis_id"] == selected]
    doc["questions_omitted"] = len(doc["questions"]) - len(own)
    doc["questions"] = own
    for other in doc["other_hypotheses"]:
        if len(other["statement"]) > 200:
            other["statement"] = other["statement"][:200] + "..."
    data = canonical_json(doc)
    if len(data) <= limit:
        return data
    for shrink in (_cut_rejected_reply, _drop_tables, _cut_report):
        if shrink(doc):
            data = canonical_json(doc)
            if len(data) <= limit:
                return data
    result = doc.get("previous_result")
    items = result.get("items") if isinstance(result, dict) else None
    while isinstance(result, dict) and isinstance(items, list) and len(items) > 1:
        items = items[:len(items) // 2]
        result["items"], result["items_shown"] = items, len(items)
        data = canonical_json(doc)
        if len(data) <= limit:
            return data
    raise InvestigationError(
        "CONTEXT_TOO_LARGE",
        f"the context is {len(data)} bytes even in its smallest form, over "
        f"limits.max_context_bytes={limit}; raise it to at least {len(data)} in the policy "
        "file (limits.max_artifact_bytes must stay above it)", context_bytes=len(data))


#: Rounds of shrinking a context towards a provider's prompt budget.
_TOKEN_FIT_ROUNDS = 8


def fit_for_model(doc: dict[str, Any], limit: int, budgets: list[PromptBudget]) -> bytes:
    """:func:`fit` within ``limit`` bytes, then shrink in the same fixed order until the
    whole request (system prompt, header, context, a rejected reply and its rejection)
    fits every provider's prompt budget by the token estimate (``llm.tokens``).

    A context whose smallest form still does not fit is returned in that form: the
    provider then refuses the request before sending it (``PROVIDER_REQUEST_TOO_LARGE``)
    and the case blocks with the numbers, rather than the server answering
    ``context_length_exceeded``.

    Raises:
        InvestigationError: ``CONTEXT_TOO_LARGE`` when the byte bound cannot be met.
    """
    data = fit(doc, limit)
    if not budgets:  # no provider states a window: nothing to measure the request by
        return data
    for _ in range(_TOKEN_FIT_ROUNDS):
        messages = build_messages(data)
        over = [(b, estimate_tokens(messages, b.bytes_per_token)) for b in budgets
                if not b.fits(messages)]
        if not over:
            return data
        budget, tokens = max(over, key=lambda pair: pair[1] / max(1, pair[0].max_input_tokens))
        target = int(len(data) * budget.max_input_tokens / tokens * 0.97)
        if target >= len(data):
            target = len(data) - 1
        try:
            data = fit(doc, max(1, target))
        except InvestigationError:
            # ``fit`` left ``doc`` in its smallest form: send that; the provider refuses
            # it with the numbers if it is still too large.
            return canonical_json(doc)
    return data


def build(s: Session, *, key: StepKey, case: CaseRecord, config: InvestigationConfig,
          budget: BudgetManager, selected: int, accounts: list[BudgetAccount],
          births: list[Any], router: ToolRouter,
          snapshot: Snapshot, external_tests: bool = False,
          questions: list[Any] | None = None,
          evidence_count: int | None = None) -> dict[str, Any]:
    """Build the context document for ``selected`` (see the module docstring).

    Args:
        births: the revision's hypotheses (``hypothesis_id``, ``statement``).
        questions: the revision's questions in creation order (``question_id``,
            ``hypothesis_id``, ``text``, ``status``) when read in this transaction
            already; ``None``: they are read here.
        evidence_count: the revision's number of evidence records when known in this
            transaction already (the live check's); ``None``: counted here if needed.
    """
    rev = Store.revision_columns(s, key.case_id, key.revision)
    # The interpretation and the statements come from upstream (a bug tracker, an
    # operator): a key pasted into them is masked like snapshot text.
    statements = {b.hypothesis_id: default_masker().mask_prefix(b.statement)[0]
                  for b in births}
    account = next(a for a in accounts if a.hypothesis_id == selected)
    evidence, omitted = _listed_evidence(s, key, config, selected, account,
                                         evidence_count)
    own = [e for e in evidence if e.hypothesis_id == selected]
    full_ids = {e.evidence_id for e in own[-config.limits.full_evidence_in_context:]}
    pending = next((e for e in own if e.evidence_id == account.pending_evidence_id), None)
    if pending is not None:
        full_ids.add(pending.evidence_id)
    findings: dict[str, str] = dict(core(s).execute(_FINDINGS, {
        "case_id": key.case_id, "ids": sorted(full_ids)}).all()) if full_ids else {}
    previous = None
    if pending is not None:
        previous = _evidence_entry(pending, findings[pending.evidence_id])
        previous["cost_units"] = pending.cost_units
        previous["novelty_permille"] = novelty_permille(
            pending.item_count, pending.new_item_count, pending.duplicate)
    if questions is None:
        questions = list(core(s).execute(_QUESTION_ROWS, {"case_id": key.case_id,
                                                    "revision": key.revision}).all())
    # The row carries the columns closing_reason reads (counts, duplicate, cost).
    closing = budget.closing_reason(account, cast("Evidence | None", pending))
    tests_available = external_tests and bool(config.budget.test_costs)
    if closing:
        allowed = ["finish", "reject"]
    else:
        allowed = ["query", "test", "finish", "reject"] if tests_available \
            else ["query", "finish", "reject"]
    # Secrets in the report are masked like those in tool findings (investigation.secrets).
    # Only what the context can carry is masked: the report is cut first to its byte limit
    # plus one masking window (a marker may be shorter or longer than what it replaces),
    # so a 30 MB report costs what a short one does.
    limit = config.limits.max_report_bytes
    text = snapshot.report_text()
    precut = len(text) > limit + MAX_MASKED_CHARS
    if precut:
        text = text[:limit + MAX_MASKED_CHARS]
    report = "\n".join(default_masker().mask_lines(text.split("\n"))[0])
    report_bytes = report.encode("utf-8")
    truncated = precut or len(report_bytes) > limit
    if truncated:
        report = report_bytes[:limit].decode("utf-8", errors="ignore")
    doc: dict[str, Any] = {
        "contract": {"prompt_version": PROMPT_VERSION, "schema_version": REPLY_SCHEMA_VERSION},
        "case": {
            "case_id": key.case_id, "revision": key.revision, "step_seq": key.step_seq,
            "package_id": case.package_id, "report": report, "report_truncated": truncated,
            "snapshot": {"source_files": len(snapshot.source_paths()),
                         "databases": [default_masker().mask(n)[0]
                                       for n in snapshot.db_names()],
                         "tables": router.table_names(),
                         "log_files": len(snapshot.log_paths())},
        },
        "interpretation": default_masker().mask_names(jsonio.loads(rev.interpretation_json))[0],
        "hypothesis": {
            "id": selected, "statement": statements[selected],
            "confidence": account.confidence, "balance_units": account.balance_units,
            "credit_units": account.credit_units, "iterations": account.iterations,
            "max_iterations": config.loop.max_iterations_per_hypothesis,
            "turn": account.turns + 1, "deferred_by": account.deferred_by,
            "notes": _notes(s, key, selected, config.limits.notes_in_context),
        },
        "other_hypotheses": [
            {"id": a.hypothesis_id, "statement": statements[a.hypothesis_id],
             "status": a.status, "confidence": a.confidence, "turns": a.turns,
             "deferred_by": a.deferred_by}
            for a in accounts if a.hypothesis_id != selected
        ],
        "budget": budget.describe(),
        "external_tests": {"available": tests_available,
                           "kinds": sorted(config.budget.test_costs) if tests_available else [],
                           "deadline_seconds": config.loop.test_deadline_seconds},
        "early_diagnosis": {"enabled": config.loop.early_diagnosis,
                            "min_evidence": config.loop.early_diagnosis_min_evidence},
        "allowed_actions": allowed,
        "closing_reason": closing,
        "previous_result": previous,
        # The previous result's findings travel once, in previous_result.
        "evidence": [_evidence_entry(e, None if pending is not None and e is pending
                                     else findings.get(e.evidence_id)) for e in evidence],
        # The selected hypothesis's questions, and the others' still open ones: another
        # hypothesis's resolved question is nothing this turn can act on (a reply may
        # resolve only its own), and listing them grew every context until each
        # hypothesis had its max_questions_per_hypothesis.
        "questions": [
            {"question_id": q.question_id, "hypothesis_id": q.hypothesis_id, "text": q.text,
             "status": q.status}
            for q in questions if q.hypothesis_id == selected or q.status == "open"
        ],
        "last_rejection": _last_rejection(s, key, account),
        "operations": router.describe(),
    }
    if omitted:  # absent while every record is listed (a short case's bytes are unchanged)
        doc["evidence_omitted"] = omitted
    return doc


def _listed_evidence(s: Session, key: StepKey, config: InvestigationConfig, selected: int,
                     account: BudgetAccount,
                     evidence_count: int | None = None) -> tuple[list[_Listed], int]:
    """The evidence rows a context lists, in creation order, and how many it leaves out.

    The selected hypothesis's newest ``limits.own_evidence_in_context`` records (its
    pending result always among them) and the other hypotheses' newest
    ``limits.other_evidence_in_context``: two bounded reads, so a step reads the same
    number of rows at step 500 as at step 5 (issue 13; docs/decisions.md, "A bounded
    context").
    """
    limits = config.limits
    params = {"case_id": key.case_id, "revision": key.revision, "hid": selected}
    conn = core(s)
    if limits.other_evidence_in_context:
        both = [_Listed(*row) for row in conn.execute(_WINDOWS, {
            **params, "limit": limits.own_evidence_in_context,
            "other_limit": limits.other_evidence_in_context})]
        own = [e for e in both if e.hypothesis_id == selected]
        other = [e for e in both if e.hypothesis_id != selected]
    else:
        own, other = [_Listed(*row) for row in conn.execute(_OWN_EVIDENCE, {
            **params, "limit": limits.own_evidence_in_context})], []
    pending_id = account.pending_evidence_id
    if pending_id is not None and all(e.evidence_id != pending_id for e in own):
        own += [_Listed(*row) for row in conn.execute(_PENDING_EVIDENCE, {
            "case_id": key.case_id, "revision": key.revision, "evidence_id": pending_id})]
    rows = sorted(own + other, key=lambda e: e.ordinal)
    if len(own) < limits.own_evidence_in_context and \
            len(other) < limits.other_evidence_in_context:
        return rows, 0  # both windows hold every record: nothing left out, nothing to count
    total = evidence_count if evidence_count is not None else \
        int(conn.execute(_EVIDENCE_COUNT, params).scalar_one())
    return rows, total - len(rows)
