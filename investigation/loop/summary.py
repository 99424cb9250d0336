"""The deterministic ``summary.md`` (seed 000, "Budget and stopping").

Built only from stored rows (no clock, no randomness, fixed ordering), so the same
store gives the same bytes. It reports balances, confidence, dispositions, evidence
(quoting the snapshot's text; a duplicate record names the earlier record it repeats
instead of quoting the same findings again, and a hypothesis some of whose records found
nothing new says how many) and outstanding questions, a countercheck marker per
hypothesis that records the actions taken on its alternatives (and which of them an
early-diagnosis review deferred), and every early-diagnosis review with its verdict. It does not diagnose,
select a root cause or say an alternative was disproved.
"""

from __future__ import annotations

import json
import re
from typing import Any

from sqlalchemy import bindparam, func
from sqlalchemy import select as sa_select
from sqlmodel import Session, col, select

from investigation import jsonio
from investigation.constants import ARTIFACT_SUMMARY, BLOCKED, POINTER_SUMMARY
from investigation.evidence.figures import evidence_figures, records_text
from investigation.llm import spend
from investigation.store.engine import Store, core, table_of
from investigation.store.models import (
    BudgetAccount,
    CaseRecord,
    Checkpoint,
    Evidence,
    HypothesisBirth,
    HypothesisNote,
    LedgerEntry,
    LLMAttempt,
    LLMOperation,
    Plan,
    Question,
    StageRun,
)
from investigation.text_safety import escape_text

# Statements built once (building a statement costs more than running it on SQLite). The
# summary reads published rows as plain rows (no ORM objects); the accounts stay ORM
# objects, whose changes in the publishing transaction are flushed before they are read.
_C: dict[str, Any] = {"case_id": bindparam("case_id"), "revision": bindparam("revision")}
_HB, _EV, _Q = table_of(HypothesisBirth).c, table_of(Evidence).c, table_of(Question).c
_LE, _CP, _RUN = table_of(LedgerEntry).c, table_of(Checkpoint).c, table_of(StageRun).c
_PL, _HN = table_of(Plan).c, table_of(HypothesisNote).c
_BIRTHS = sa_select(_HB.hypothesis_id, _HB.statement).where(
    _HB.case_id == _C["case_id"], _HB.revision == _C["revision"])
_ACCOUNTS = select(BudgetAccount).where(
    col(BudgetAccount.case_id) == bindparam("case_id"),
    col(BudgetAccount.revision) == bindparam("revision")).order_by(
    col(BudgetAccount.hypothesis_id))
_EVIDENCE = sa_select(
    _EV.evidence_id, _EV.hypothesis_id, _EV.step_seq, _EV.operation, _EV.arguments_json,
    _EV.findings_json, _EV.warnings_json, _EV.item_count, _EV.new_item_count, _EV.duplicate,
    _EV.cost_units, _EV.assessed, _EV.assessment_score, _EV.refund_units,
    _EV.fingerprint).where(
    _EV.case_id == _C["case_id"], _EV.revision == _C["revision"]).order_by(_EV.ordinal)
_QUESTIONS = sa_select(
    _Q.question_id, _Q.hypothesis_id, _Q.text, _Q.status, _Q.resolved_step,
    _Q.resolution_evidence_json).where(
    _Q.case_id == _C["case_id"], _Q.revision == _C["revision"]).order_by(_Q.ordinal)
_LEDGER = sa_select(_LE.hypothesis_id, _LE.kind, _LE.amount_units).where(
    _LE.case_id == _C["case_id"], _LE.revision == _C["revision"])
_STEPS = sa_select(func.count()).select_from(table_of(Checkpoint)).where(
    _CP.case_id == _C["case_id"])
_BLOCKS = sa_select(_CP.seq, _CP.hypothesis_id, _CP.reason).where(
    _CP.case_id == _C["case_id"], _CP.revision == _C["revision"],
    _CP.outcome == BLOCKED).order_by(_CP.seq)
_OP, _AT = table_of(LLMOperation).c, table_of(LLMAttempt).c
#: Model calls that failed for good (a block on the provider: the step ran again after
#: the operator's resume, under a new retry id).
_CALLS_FAILED = sa_select(_OP.step_seq, _OP.hypothesis_id, _OP.error_code,
                          _OP.attempts_made).where(
    _OP.case_id == _C["case_id"], _OP.revision == _C["revision"],
    _OP.status.in_(("failed", "exhausted"))).order_by(_OP.step_seq, _OP.id)
#: Failed attempts of model calls that were answered in the end: what a step got past.
_RETRIED = sa_select(_OP.step_seq, _OP.hypothesis_id, _AT.error_code).join_from(
    table_of(LLMAttempt), table_of(LLMOperation), _OP.id == _AT.operation_id).where(
    _OP.case_id == _C["case_id"], _OP.revision == _C["revision"],
    _OP.status == "succeeded", _AT.status == "failed").order_by(_OP.step_seq, _AT.attempt)
_VERDICTS = sa_select(_RUN.step_seq, _RUN.stage, _RUN.output_json).where(
    _RUN.case_id == _C["case_id"], _RUN.revision == _C["revision"],
    _RUN.stage.in_(("build_context", "validate"))).order_by(_RUN.step_seq)
_PLANS = sa_select(_PL.step_seq, _PL.hypothesis_id, _PL.decision_json).where(
    _PL.case_id == _C["case_id"], _PL.revision == _C["revision"]).order_by(_PL.step_seq)
_NOTES = sa_select(_HN.hypothesis_id, _HN.step_seq, _HN.note).where(
    _HN.case_id == _C["case_id"], _HN.revision == _C["revision"]).order_by(_HN.step_seq)

#: Findings quoted per evidence record.
MAX_QUOTED_ITEMS = 12
MAX_QUOTE_CHARS = 300


def code_span(text: str) -> str:
    """A Markdown code span that shows ``text`` exactly (CommonMark): the fence is one
    backtick longer than the longest run inside, padded when the text touches a backtick.
    Control, bidirectional and zero-width characters are shown as visible escapes
    (:func:`investigation.text_safety.escape_text`)."""
    text = escape_text(text)
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    if longest or (text.startswith(" ") and text.endswith(" ") and text.strip()):
        return f"{fence} {text} {fence}"
    return f"{fence}{text}{fence}"


#: What GitHub's Markdown (cmark-gfm) links by itself, defanged so it reads the same and
#: links nowhere: any ``http://``, ``https://`` or ``ftp://`` (``https[:]//``), a
#: ``www.`` at the start or after a space, ``*``, ``_``, ``~`` or ``(`` (``www[.]``), and
#: the ``@`` of an e-mail address (``[@]``, which also defuses ``mailto:``/``xmpp:``).
_AUTOLINK = re.compile(r"(?i)(https?|ftp)://|(?<![^\s*_~(])(www)\.|"
                       r"(?<=[A-Za-z0-9._+-])(@)(?=[A-Za-z0-9_-]+\.[A-Za-z0-9_-])")
#: An underscore that could open or close emphasis: not between two letters or digits
#: (CommonMark never reads ``transform_sql`` as emphasis).
_LOOSE_UNDERSCORE = re.compile(r"(?<![^\W_])_|_(?![^\W_])")
#: What would open a block where the text starts a line or follows a list marker or
#: ``> `` (CommonMark): a heading ``#``-``######``, a list marker ``-``, ``+``, ``1.`` or
#: ``1)``, each followed by a space or the end; a line of hyphens (a thematic break); a
#: code fence of backticks with no backtick after it. ``0.25 USD`` or ``-5`` open none.
_BLOCK_START = re.compile(r"(?:#{1,6}|[-+])(?= |$)|(\d{1,9})[.)](?= |$)|-[- ]*$|`{3,}(?!.*`)")


#: A code span of CommonMark: a backtick run, text, the same run (no longer one).
_CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)")


def plain(text: str | None) -> str:
    """Untrusted prose (model notes, reasons, questions, statements) as one inert line.

    Whitespace runs (line breaks included) collapse to one space, so the text can never
    start a line of its own, and a leading ``#``, ``-``, ``+``, ``1.`` or code fence is
    escaped (no heading, list or fence where the line, a list item or a quote starts
    with it); control, bidirectional and zero-width characters become visible escapes
    (:func:`investigation.text_safety.escape_text`). Outside code spans ``<``/``>``
    become entities (no HTML); ``[``, ``]``, ``|``, ``*``, ``~`` and every underscore
    not inside a word are escaped (no links, table cells, emphasis or strike-through);
    what GitHub's Markdown would link by itself is defanged (``https[:]//``,
    ``www[.]``, ``[@]``). A code span (the demo's interpretation names tables in
    backticks) already shows its text literally and is kept as written.
    """
    flat = escape_text(" ".join((text or "").split()))
    parts: list[str] = []
    last = 0
    for span in _CODE_SPAN.finditer(flat):
        parts += [_inert(flat[last:span.start()]), span[0]]
        last = span.end()
    line = "".join([*parts, _inert(flat[last:])])
    start = _BLOCK_START.match(line)
    if start is None:
        return line
    if start[1]:  # an ordered list's marker: escape its "." or ")"
        return f"{start[1]}\\{line[len(start[1]):]}"
    return "\\" + line


def _inert(text: str) -> str:
    """:func:`plain`'s escapes of text outside code spans."""
    text = text.replace("\\", "\\\\").replace("<", "&lt;").replace(">", "&gt;")
    text = _AUTOLINK.sub(lambda m: f"{m[1]}[:]//" if m[1] else f"{m[2]}[.]" if m[2]
                         else "[@]", text)
    for ch in "[]|*~":
        text = text.replace(ch, "\\" + ch)
    return _LOOSE_UNDERSCORE.sub(r"\\_", text)


def _quote(item: dict[str, Any]) -> str:
    if "text" in item:
        text = str(item["text"])
    elif "row" in item:
        text = json.dumps(item["row"], sort_keys=True, ensure_ascii=False)
    else:
        text = json.dumps({k: v for k, v in item.items() if k != "key"}, sort_keys=True,
                          ensure_ascii=False)
    text = " ".join(text.splitlines()) if "\n" in text or "\r" in text else text
    if not text:
        return f"    - {code_span(str(item['key']))}: (empty line)"
    if len(text) > MAX_QUOTE_CHARS:
        return f"    - {code_span(str(item['key']))}: {code_span(text[:MAX_QUOTE_CHARS])} ..."
    return f"    - {code_span(str(item['key']))}: {code_span(text)}"


def _rejections(s: Session, case_id: str, revision: int) -> dict[int, list[str]]:
    """Each hypothesis's refused replies, in step order: ``"step N CODE"`` (the step
    finds the reply in the report and the export)."""
    runs = core(s).execute(_VERDICTS, {"case_id": case_id, "revision": revision}).all()
    selected = {r.step_seq: jsonio.loads(r.output_json).get("hypothesis_id")
                for r in runs if r.stage == "build_context"}
    found: dict[int, list[str]] = {}
    for r in runs:
        verdict = jsonio.loads(r.output_json)
        if r.stage == "validate" and verdict.get("accepted") is False:
            found.setdefault(int(selected[r.step_seq]), []).append(
                f"step {r.step_seq} {verdict['code']}")
    return found


def _reviews(s: Session, case_id: str, revision: int) -> list[str]:
    """One line per early-diagnosis review (``docs/early-diagnosis.md``), in step order."""
    plans = core(s).execute(_PLANS, {"case_id": case_id, "revision": revision}).all()
    lines: list[str] = []
    for p in plans:
        review = jsonio.loads(p.decision_json).get("early_diagnosis")
        if not review:
            continue
        asked = ", ".join(f"H{h}" for h in review["requested"])
        if review["accepted"]:
            verdict = "accepted: deferred to assessment-only"
        else:
            verdict = "declined (" + "; ".join(
                f"{f['code']}: {plain(f['detail'])}" for f in review["findings"]) + ")"
        cited = ", ".join(review["qualifying_evidence"]) or "none"
        lines.append(f"- Step {p.step_seq}, hypothesis {p.hypothesis_id} asked to defer "
                     f"{asked}; {verdict}. Qualifying evidence: {cited}. "
                     f"Rationale: {plain(review['rationale'])}")
    return lines


def _interruptions(s: Session, case_id: str, revision: int) -> list[str]:
    """The section on what stopped or held up the case, or nothing when nothing did: each
    block (a published ``BLOCKED`` step, or a model call that failed for good; the case
    went on after a resume, since the summary is of a finished case) and each model call
    answered only after failed attempts, in step order (an engineer reading a 500-step
    case found three blocks and three retries in no summary line)."""
    of = {"case_id": case_id, "revision": revision}
    conn = core(s)

    def at(step: int, hid: int | None) -> str:
        return f"- Step {step}" + (f" (hypothesis {hid})" if hid is not None else "")

    lines = [(b.seq, f"{at(b.seq, b.hypothesis_id)}: blocked, "
              f"{b.reason or 'no reason recorded'}; resumed, the case went on at step "
              f"{b.seq + 1}") for b in conn.execute(_BLOCKS, of)]
    lines += [(step, f"{at(step, hid)}: blocked, the model call failed with "
               f"{code or 'no code recorded'} after {made} attempt{'s' if made != 1 else ''}; "
               "resumed, the step ran again")
              for step, hid, code, made in conn.execute(_CALLS_FAILED, of)]
    retried: dict[tuple[int, int | None], list[str]] = {}
    for step, hid, code in conn.execute(_RETRIED, of):
        retried.setdefault((step, hid), []).append(code or "unknown error")
    lines += [(step, f"{at(step, hid)}: the model call was answered after {len(codes)} "
               f"failed attempt{'s' if len(codes) != 1 else ''} ({', '.join(codes)})")
              for (step, hid), codes in retried.items()]
    if not lines:
        return []
    return ["## Interruptions", "", *(text for _, text in sorted(lines)), ""]


def _model_usage(s: Session, case_id: str, hypotheses: list[int], currency: str) -> list[str]:
    """The model usage table: calls, tokens and money per hypothesis (``llm.spend``), in
    the currency the case's attempts recorded (``currency`` for attempts priced before
    it was recorded)."""
    usage = spend.usage_by_hypothesis(s, case_id)
    currency = spend.cost_label(s, case_id, currency)
    out = ["## Model usage", "",
           "Model tokens and money, separate from investigation units.", "",
           "| hypothesis | calls | attempts | prompt tokens | completion tokens | cost |",
           "|---|---|---|---|---|---|"]
    keys: list[int | None] = [*hypotheses, *([None] if None in usage else [])]
    for hid in keys:
        u = usage.get(hid, {"calls": 0, "attempts": 0, "prompt_tokens": 0,
                            "completion_tokens": 0, "tokens_reported": 0,
                            "prompt_tokens_reported": 0, "completion_tokens_reported": 0,
                            "cost_micros": None})
        cost = plain(spend.cost_text(u["cost_micros"], currency))
        # Attempts whose servers reported no count (a scripted provider): not a 0; a sum
        # some answered calls have no count in is partial, and says so (as `status`).
        prompt, completion = spend.token_cells([u]) if u["attempts"] else ("0", "0")
        out.append(f"| {'unrecorded' if hid is None else hid} | {u['calls']} | "
                   f"{u['attempts']} | {prompt} | {completion} | {cost} |")
    return [*out, ""]


def render_summary(s: Session, case_id: str, revision: int, currency: str = "USD") -> bytes:
    """Render ``summary.md`` for a case from the store (UTF-8 bytes, LF line ends).

    Args:
        currency: the label of model costs (``limits.currency``).
    """
    case = s.get(CaseRecord, case_id)
    assert case is not None
    of = {"case_id": case_id, "revision": revision}
    accounts = s.exec(_ACCOUNTS, params=of).all()  # (flushes the session's changes first)
    conn = core(s)
    interpretation_json = Store.revision_columns(s, case_id, revision).interpretation_json
    births = {b.hypothesis_id: b for b in conn.execute(_BIRTHS, of)}
    evidence = conn.execute(_EVIDENCE, of).all()
    questions = conn.execute(_QUESTIONS, of).all()
    ledger = conn.execute(_LEDGER, of).all()
    steps = int(conn.execute(_STEPS, of).scalar_one())
    notes_of: dict[int, list[dict[str, Any]]] = {}
    for hid, step, note in conn.execute(_NOTES, of):
        notes_of.setdefault(int(hid), []).append({"step_seq": step, "note": note})
    interpretation = jsonio.loads(interpretation_json)
    actions = {a.hypothesis_id: a.iterations for a in accounts}
    rejections = _rejections(s, case_id, revision)

    out: list[str] = [
        f"# Investigation summary: {case_id}",
        "",
        f"- Package: `{case.package_id}`",
        f"- Revision: {revision}",
        "- State: BUILDING_DIAGNOSIS",
        f"- Steps published: {steps}",
        f"- Evidence records: {len(evidence)}",
        f"- Interpretation: {plain(str(interpretation.get('summary', '')))}",
        "",
        "This summary reports an investigation, not a diagnosis: it selects no root cause. "
        "Confidence labels are the model's qualitative assessments, grounded in the cited "
        "evidence; countercheck markers record actions taken on alternatives, not proof that "
        "an alternative was disproved.",
        "",
        "## Hypotheses",
        "",
        "| id | disposition | confidence | balance (units) | charged | refunded | iterations "
        "| evidence | countercheck |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for a in accounts:
        rows = [e for e in ledger if e.hypothesis_id == a.hypothesis_id]
        charged = -sum(e.amount_units for e in rows if e.kind == "reserve")
        refunded = sum(e.amount_units for e in rows if e.kind == "refund")
        own = [e for e in evidence if e.hypothesis_id == a.hypothesis_id]
        others = sum(n for h, n in actions.items() if h != a.hypothesis_id)
        marker = f"{others} action(s) on alternatives" if len(actions) > 1 else "no alternatives"
        if a.deferred_by is not None:
            marker += f"; deferred by H{a.deferred_by} at step {a.deferred_step}"
        out.append(f"| {a.hypothesis_id} | {a.status} | {a.confidence} | {a.balance_units} of "
                   f"{a.credit_units} | {charged} | {refunded} | {a.iterations} | {len(own)} "
                   f"| {marker} |")
    out.append("")
    for a in accounts:
        birth = births[a.hypothesis_id]
        out += [f"### Hypothesis {a.hypothesis_id}", "", f"> {plain(birth.statement)}", "",
                f"- Disposition: {a.status}"
                + (f" ({plain(a.disposition_reason)})" if a.disposition_reason else ""),
                f"- Confidence: {a.confidence}",
                f"- Balance: {a.balance_units} of {a.credit_units} units",
                f"- Turns: {a.turns}; research iterations: {a.iterations}"]
        own = [e for e in evidence if e.hypothesis_id == a.hypothesis_id]
        figures = evidence_figures(e._asdict() for e in own)
        if figures["no_new_item"]:
            # Where a record found nothing new: the tally an engineer otherwise counted
            # from the store (a trial: 100 identical queries of 102 records).
            out.append(f"- Evidence records: {records_text(figures)}")
        if a.deferred_by is not None:
            out.append(f"- Deferred to assessment-only by hypothesis {a.deferred_by} at step "
                       f"{a.deferred_step} (early diagnosis); research iterations before "
                       f"deferral: {a.iterations}")
        codes = rejections.get(a.hypothesis_id, [])
        if codes:
            out.append(f"- Rejected replies: {len(codes)} ({', '.join(codes)})")
        deferred = {x.hypothesis_id for x in accounts if x.deferred_by is not None}
        alt = [f"H{h}: {n}" + (" (deferred)" if h in deferred else "")
               for h, n in sorted(actions.items()) if h != a.hypothesis_id]
        out.append("- Countercheck (actions on alternatives): " + (", ".join(alt) or "none"))
        notes = notes_of.get(a.hypothesis_id, [])
        if notes:
            out.append("- Notes:")
            out += [f"    - step {n['step_seq']}: {plain(n['note'])}" for n in notes]
        out += ["", "#### Evidence", ""]
        if not own:
            out.append("- none")
        first_of: dict[str, str] = {}  # fingerprint -> the hypothesis's first such record
        for e in own:
            original = first_of.setdefault(e.fingerprint, e.evidence_id)
            args = json.dumps(jsonio.loads(e.arguments_json), sort_keys=True, ensure_ascii=False)
            assessed = (f"assessed {e.assessment_score}/100, refund {e.refund_units}"
                        if e.assessed else "not assessed")
            warn = jsonio.loads(e.warnings_json)
            out.append(f"- **{e.evidence_id}** (step {e.step_seq}) `{e.operation}` "
                       f"{code_span(args)}: "
                       f"{e.item_count} item(s), {e.new_item_count} new"
                       + (f", duplicate of {original}" if e.duplicate and original !=
                          e.evidence_id else ", duplicate" if e.duplicate else "")
                       + f"; cost {e.cost_units}; {assessed}"
                       + (f"; warnings: {', '.join(warn)}" if warn else ""))
            if e.duplicate and original != e.evidence_id:
                # The same operation, arguments and findings (the fingerprint): quoted once,
                # at the first record (a 500-step case quoted 100 copies of one listing).
                continue
            items = jsonio.loads(e.findings_json)
            out += [_quote(i) for i in items[:MAX_QUOTED_ITEMS]]
            if len(items) > MAX_QUOTED_ITEMS:
                out.append(f"    - ... {len(items) - MAX_QUOTED_ITEMS} more item(s)")
        qs = [q for q in questions if q.hypothesis_id == a.hypothesis_id]
        if qs:
            out += ["", "#### Questions", ""]
            for q in qs:
                if q.status == "resolved":
                    ev = ", ".join(jsonio.loads(q.resolution_evidence_json or "[]"))
                    out.append(f"- {q.question_id} (resolved at step {q.resolved_step} "
                               f"with {ev}): {plain(q.text)}")
                else:
                    out.append(f"- {q.question_id} (open): {plain(q.text)}")
        out.append("")
    out += _interruptions(s, case_id, revision)
    out += _model_usage(s, case_id, [a.hypothesis_id for a in accounts], currency)
    out += ["## Early diagnosis reviews", ""]
    out += _reviews(s, case_id, revision) or ["- none"]
    out.append("")
    open_qs = [q for q in questions if q.status == "open"]
    out += ["## Outstanding questions", ""]
    out += [f"- {q.question_id} (hypothesis {q.hypothesis_id}): {plain(q.text)}"
            for q in open_qs] \
        or ["- none"]
    out.append("")
    return "\n".join(out).encode("utf-8")


def write_summary(s: Session, case_id: str, revision: int, currency: str = "USD") -> str:
    """Render and store ``summary.md`` and point ``investigation_summary`` at it.

    Returns:
        The sha256 of the stored bytes. Re-rendering a finished case yields the same bytes.
    """
    data = render_summary(s, case_id, revision, currency)
    digest = Store.put_artifact(s, case_id, ARTIFACT_SUMMARY, data, media_type="text/markdown")
    Store.set_pointer(s, case_id, POINTER_SUMMARY, ARTIFACT_SUMMARY, digest)
    return digest
