"""``investigate report``: one self-contained HTML file for a case.

The page opens offline: no script, no external resource, and a Content-Security-Policy
(``default-src 'none'``) that forbids the browser to fetch anything even if some text
were not escaped. Charts are inline SVG (``investigation.report.svg``). Every string the
snapshot, the model or a provider supplied goes through ``investigation.report.escape``.

Sections: the case at a glance and what to do next; the hypotheses; charts (timeline,
confidence, budget burn-down per account, model time and tokens); the step timeline;
the evidence with exact quotes and artifact paths; questions; external tests;
early-diagnosis reviews; the lifecycle. A long case stays readable: the timeline table
scrolls inside its own box with a sticky header and sticky step and hypothesis
columns, and each evidence record's findings sit
in a closed ``<details>`` element (at most :data:`MAX_ITEMS_SHOWN` quotes each; the
artifact path holds all of them).
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from investigation.evidence.figures import evidence_figures, records_text, scores_text
from investigation.llm.spend import cost_text, priced_total, token_cells
from investigation.loop.lifecycle import iterations_gloss
from investigation.loop.outcome import last_outcome_text, tokens_text
from investigation.operations import step_in_progress_text
from investigation.report import svg
from investigation.report.escape import html_attr, html_text
from investigation.report.history import CaseHistory, StepRow, selection_text, units_text

#: Findings quoted per evidence record in the page; the rest are in its artifact.
MAX_ITEMS_SHOWN = 200
#: Longest quote shown (characters); tool findings are bounded well below this.
MAX_QUOTE_CHARS = 2000
#: Steps citing an evidence record linked on its summary line; the rest are counted.
MAX_CITING_STEPS = 12

_CSS = """
:root{--fg:#1d1d1f;--muted:#5f6368;--line:#e0e0e0;--bg:#fafafa;--accent:#1e5bb8}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:var(--fg);
background:var(--bg)}
header{background:#fff;border-bottom:1px solid var(--line);padding:18px 28px 10px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 10px}
h3{font-size:14px;margin:16px 0 6px}
main{padding:0 28px 40px;max-width:1800px}
nav{position:sticky;top:0;z-index:3;background:#fff;border-bottom:1px solid var(--line);
padding:6px 28px;font-size:13px}
nav a{margin-right:14px;color:var(--accent);text-decoration:none}
.sub{color:var(--muted);margin:0}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;
font-weight:600;color:#fff;vertical-align:2px}
.facts{display:grid;grid-template-columns:repeat(auto-fill,minmax(190px,1fr));gap:8px;
margin:14px 0}
.fact{background:#fff;border:1px solid var(--line);border-radius:6px;padding:6px 10px}
.fact b{display:block;font-size:11px;color:var(--muted);font-weight:500;
text-transform:uppercase;letter-spacing:.03em}
.next{background:#fff8e1;border:1px solid #f0c36d;border-radius:6px;padding:10px 14px}
.next.final{background:#eef5ff;border-color:#a8c5f0}
.next ol{margin:6px 0 0;padding-left:20px}
code,.mono{font:12.5px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
pre.cmd{background:#272822;color:#f8f8f2;padding:4px 8px;border-radius:4px;margin:3px 0 6px;
white-space:pre-wrap;overflow-wrap:anywhere}
table{border-collapse:collapse;background:#fff;width:100%}
th,td{border-bottom:1px solid var(--line);padding:4px 8px;text-align:left;vertical-align:top;
overflow-wrap:break-word}
td code{overflow-wrap:anywhere}
.nw{white-space:nowrap}
td.wide{min-width:220px}
td.note{min-width:320px}
.text{white-space:pre-wrap}
th{background:#f3f3f3;font-weight:600;font-size:12px}
.scroll{overflow:auto;border:1px solid var(--line);border-radius:6px;background:#fff}
.scroll.tall{max-height:70vh}
.scroll.tall thead th{position:sticky;top:0;z-index:1}
table.steps tr>:nth-child(-n+2){position:sticky;z-index:1;background:#fff;
box-sizing:border-box}
table.steps thead tr>:nth-child(-n+2){z-index:2;background:#f3f3f3}
table.steps tr>:first-child{left:0;min-width:60px;max-width:60px}
table.steps tr>:nth-child(2){left:60px;min-width:48px;max-width:48px;
box-shadow:inset -1px 0 var(--line)}
.chart{background:#fff;border:1px solid var(--line);border-radius:6px;padding:8px;
margin:8px 0;overflow-x:auto}
.multiples{display:grid;grid-template-columns:repeat(auto-fill,minmax(470px,1fr));gap:8px}
.multiples .chart{margin:0}
.ctl{border:1px solid #c62828;color:#c62828;border-radius:3px;padding:0 2px;font-size:10px;
font-family:ui-monospace,monospace}
details.ev{background:#fff;border:1px solid var(--line);border-radius:6px;margin:6px 0;
padding:4px 10px}
details.ev summary{cursor:pointer}
ol.quotes{margin:6px 0;padding-left:0;list-style:none}
ol.quotes li{border-top:1px solid #f0f0f0;padding:2px 0}
ol.quotes .key{color:var(--muted);margin-right:8px}
ol.quotes .q{white-space:pre-wrap;background:#f7f7f7}
.muted{color:var(--muted)}
.o-PROGRESSED{color:#2e7d32}.o-REJECTED{color:#b26a00}.o-BLOCKED{color:#c62828}
.o-COMPLETED{color:#1e5bb8}.o-DEFERRED{color:#6a3fa0}
.legend span{display:inline-block;margin-right:12px;font-size:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:-1px}
footer{color:var(--muted);font-size:12px;padding:20px 28px}
#timeline,#evidence,#questions,#tests,#lifecycle{content-visibility:auto;
contain-intrinsic-size:auto 900px}
html{scroll-padding-top:34px}
section[id],h2,details.ev,tr[id]{scroll-margin-top:6px}
.scroll.tall tr[id]{scroll-margin-top:64px}
tr[id]:target>td{background:#fff8e1}
details.ev:target{outline:2px solid var(--accent)}
details.ev:target::details-content{content-visibility:visible;display:block}
@media print{
@page{size:A4 landscape;margin:10mm}
body{background:#fff;font-size:11px}
nav{position:static}
main{max-width:none;padding:0}
#timeline,#evidence,#questions,#tests,#lifecycle{content-visibility:visible}
.scroll,.scroll.tall{max-height:none;overflow:visible;border:0}
.scroll.tall thead th{position:static}
table.steps tr>:nth-child(-n+2){position:static}
.nw{white-space:normal}
td.wide,td.note{min-width:0}
th,td{padding:2px 4px}
details.ev::details-content{content-visibility:visible;display:block}
details.ev{break-inside:avoid-page}
tr{break-inside:avoid}
}
"""

_STATE_COLOURS = {"BUILDING_DIAGNOSIS": "#1e5bb8", "INVESTIGATING": "#3a8d3f",
                  "BLOCKED": "#c62828", "PAUSED": "#9e7c00", "CANCELLED": "#616161",
                  "STOPPED": "#616161"}


def _e(value: object) -> str:
    return html_text(value)


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _ms(ms: int | None) -> str:
    if ms is None:
        return ""
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms} ms"


def _tokens(step: StepRow) -> str:
    return _e(tokens_text(step.prompt_tokens, step.completion_tokens))


def _found(step: StepRow, line: str) -> str:
    """A line of what ``step``'s query found, escaped; its ``duplicate of`` line links
    the record it repeats."""
    if step.duplicate_of and line == f"duplicate of {step.duplicate_of}":
        return "duplicate of " + _ev_link(step.duplicate_of)
    return _e(line)


def _ev_link(evidence_id: str) -> str:
    """A link to the evidence record ``evidence_id`` of the report."""
    return f'<a href="#ev-{html_attr(evidence_id)}">{_e(evidence_id)}</a>'


def _h_link(hypothesis_id: object) -> str:
    """``HN`` linking to the hypothesis's row in the overview (an integer id), or its
    text; nothing for ``None``."""
    if hypothesis_id is None:
        return ""
    if not isinstance(hypothesis_id, int) or isinstance(hypothesis_id, bool):
        return _e(f"H{hypothesis_id}")
    return f'<a href="#h-{hypothesis_id}">H{hypothesis_id}</a>'


def _step_link(seq: object, word: str = "step ") -> str:
    """``step N`` linking to the step's row in the timeline (a plain number: no link)."""
    if not isinstance(seq, int) or isinstance(seq, bool):
        return _e(seq)
    return f'<a href="#step-{seq}">{word}{seq}</a>'


def _outcome(outcome: str | None, reason: str | None, published: bool = True) -> str:
    if outcome is None:
        return '<span class="muted">in progress</span>'
    text = f'<span class="o-{html_attr(outcome)}">{_e(outcome)}</span>'
    if reason:
        text += f" <span class=\"muted\">({_e(reason)})</span>"
    if not published:
        text += ' <span class="muted">[not published]</span>'
    return text


def _header(h: CaseHistory) -> list[str]:
    st = h.status
    state = str(st["state"])
    badge = (f'<span class="badge" style="background:{_STATE_COLOURS.get(state, "#616161")}">'
             f"{_e(state)}</span>")
    blocked = f" <b>{_e(st['blocked_reason'])}</b>" if st.get("blocked_reason") else ""
    return [f"<header><h1>Investigation report: {_e(h.case_id)} {badge}{blocked}</h1>",
            f'<p class="sub text">{_e(h.interpretation.get("summary", ""))}</p></header>',
            '<nav><a href="#overview">Overview</a><a href="#next">Next steps</a>'
            '<a href="#charts">Charts</a><a href="#timeline">Steps</a>'
            '<a href="#evidence">Evidence</a><a href="#questions">Questions</a>'
            '<a href="#tests">Tests</a><a href="#lifecycle">Lifecycle</a></nav>']


def _cost(status: dict[str, Any], currency: str) -> str:
    """What the case's answered and failed model attempts cost, summed over the
    hypotheses (``llm.spend``), or ``"not priced"`` when no provider has a price."""
    return cost_text(priced_total(status.get("model_usage", {}).get("hypotheses", [])),
                     currency)


def _tokens_fact(status: dict[str, Any]) -> str:
    """``prompt + completion`` over the case's calls, each ``not reported`` or partial
    (`` (246 of 247 calls)``) as ``status`` and summary.md show it (a 500-step reader took
    the report's sum for the whole; ``llm.spend.token_cells``)."""
    usage = status.get("model_usage", {}).get("hypotheses", [])
    if not any(u["tokens_reported"] for u in usage):
        return "not reported"
    return " + ".join(token_cells(usage))


def _overview(h: CaseHistory) -> list[str]:
    st = h.status
    total_ms = sum(s.model_ms or 0 for s in h.steps)
    rejected = sum(1 for s in h.steps if s.rejection_code)
    figures = evidence_figures(h.evidence)
    facts = [
        ("state", st["state"] + (f" ({st['blocked_reason']})" if st.get("blocked_reason")
                                 else "")),
        ("last outcome", last_outcome_text(st.get("last_outcome"), st.get("last_reason"),
                                           none="none")),
        ("published steps", st["steps"] if not st.get("step_in_progress") else
         f"{st['steps']}; {step_in_progress_text(st['step_in_progress'], st['state'])}: "
         "the figures below include what it recorded so far"),
        ("rejected replies", rejected),
        # What the records amount to: a real model's run of nine duplicate listings,
        # each scored 0, read as a success (a trial).
        ("evidence records", records_text(figures)),
        ("assessment scores", scores_text(figures)),
        ("open questions", st["open_questions"]),
        ("model time", _ms(total_ms) or "0 ms"),
        ("tokens (prompt + completion)", _tokens_fact(st)),
        # The money the status table shows per hypothesis, in all (an engineer reading a
        # long case found no cost anywhere in the page).
        ("model cost", _cost(st, h.currency)),
        ("revision", st["revision"]),
        ("package", st["package_id"][:16] + "..."),
    ]
    if st.get("retry_not_before"):
        facts.append(("retry not before", st["retry_not_before"]))
    out = ['<section id="overview"><h2>Overview</h2><div class="facts">']
    out += [f'<div class="fact"><b>{_e(k)}</b>{_e(v)}</div>' for k, v in facts]
    out.append("</div>")
    if st.get("blocked_detail"):
        out.append(f"<p><b>Why:</b> <span class=\"mono\">{_e(st['blocked_detail'])}</span></p>")
    out.append('<div class="scroll"><table><thead><tr><th>id</th><th>statement</th>'
               "<th>disposition</th><th>confidence</th><th>balance / credit (units)</th>"
               "<th>iterations</th><th>evidence</th><th>last rejection</th></tr></thead><tbody>")
    evidence_count: dict[int, int] = {}
    for e in h.evidence:
        evidence_count[e["hypothesis_id"]] = evidence_count.get(e["hypothesis_id"], 0) + 1
    accounts = {a["hypothesis_id"]: a for a in st["accounts"]}
    decided, _ = _citations(h)
    for i, (hid, statement) in enumerate(sorted(h.statements.items())):
        a = accounts.get(hid)
        colour = svg.colour(i)
        if a is None:
            out.append(f'<tr id="h-{hid}"><td><b style="color:{colour}">H{hid}</b></td>'
                       f"<td class=text>{_e(statement)}</td><td colspan=6 class=muted>no step yet</td></tr>")
            continue
        disposition = _e(a["status"])
        if a.get("disposition_reason"):
            disposition += f' <span class="muted">({_e(a["disposition_reason"])})</span>'
        if a.get("deferred_by") is not None:
            disposition += f" <span class=\"muted\">deferred by H{_e(a['deferred_by'])}</span>"
        rej = a.get("last_rejection")
        # What the hypothesis's last decision cites for its confidence (an engineer
        # reading a 500-step case could not tell which evidence mattered).
        last = decided.get(hid)
        cites = _cites(last.cited_evidence) if last is not None \
            and last.confidence == a["confidence"] else ""
        out.append(
            f'<tr id="h-{hid}"><td class=nw><b style="color:{colour}">H{hid}</b></td>'
            f"<td class='wide text'>{_e(statement)}</td>"
            f"<td class=wide>{disposition}</td><td>{_e(a['confidence'])}{cites}</td>"
            f"<td class=nw>{_e(a['balance_units'])} / {_e(a['credit_units'])}</td>"
            f"<td class=nw>{_e(a['iterations'])}</td><td class=nw>{evidence_count.get(hid, 0)}</td>"
            f"<td>{_e(rej['code'] + ': ' + rej['detail']) if rej else ''}</td></tr>")
    out.append("</tbody></table></div></section>")
    return out


def _next(h: CaseHistory) -> list[str]:
    g = h.guidance
    out = [f'<section id="next"><h2>Next steps</h2><div class="next{" final" if g.final else ""}">',
           f"<b>{_e(g.headline)}</b><ol>"]
    for step in g.steps:
        if step.command and " report " in step.command:
            continue  # this page is that report
        out.append(f"<li>{_e(step.text)}")
        if step.command:
            out.append(f'<pre class="cmd">{_e(step.command)}</pre>')
        out.append("</li>")
    out.append("</ol></div></section>")
    return out


def _charts(h: CaseHistory) -> list[str]:
    ids = sorted(h.statements)
    max_seq = max((s.seq for s in h.steps), default=1)
    out = ['<section id="charts"><h2>Charts</h2>']
    if not h.steps:
        out.append('<p class="muted">No step has run yet.</p></section>')
        return out
    # The legend names the colours this timeline uses, no others.
    seen = {s.outcome for s in h.steps if s.published}
    legend = "".join(f'<span><i style="background:{c}"></i>{_e(o)}</span>'
                     for o, c in svg.OUTCOME_COLOURS.items() if o in seen)
    if any(not s.published or s.outcome not in svg.OUTCOME_COLOURS for s in h.steps):
        legend += (f'<span><i style="background:{svg.UNPUBLISHED_COLOUR}"></i>'
                   "not published</span>")
    if any(s.action in svg.CLOSING_ACTIONS and s.published for s in h.steps):
        legend += (f'<span><i style="background:{svg.CLOSE_COLOUR};height:3px"></i>'
                   "bar above: closes its hypothesis (finish, reject)</span>")
    out.append(f'<h3>Outcome of each step</h3><div class="chart"><div class="legend">'
               f"{legend}</div>{svg.timeline(h.steps, ids)}</div>")
    out.append('<h3>Confidence over the steps</h3><div class="chart">'
               f"{svg.confidence({k: h.confidence.get(k, [(0, 'unassessed')]) for k in ids}, max_seq)}"
               "</div>")
    out.append('<h3>Budget burn-down per account</h3><p class="muted">Grey: the balance '
               "after each ledger entry; red: a charge (reservation of an action); green: "
               "a refund (an assessed result's novelty and usefulness).</p>"
               '<div class="multiples">')
    for i, hid in enumerate(ids):
        out.append(f'<div class="chart">{svg.burndown(hid, i, h.ledger.get(hid, []), max_seq)}'
                   "</div>")
    out.append("</div>")
    times = [(s.seq, float(s.model_ms) if s.model_ms is not None else None) for s in h.steps]
    out.append('<h3>Model time and tokens per step</h3><div class="chart">'
               + svg.bars(times, max_seq, "model time per step", "", "model-time",
                          lambda v: _ms(round(v))))  # "420 ms", "84.65 s": its own unit
    tokens = [(s.seq, float((s.prompt_tokens or 0) + (s.completion_tokens or 0))
               if s.prompt_tokens is not None or s.completion_tokens is not None else None)
              for s in h.steps]
    if any(v is not None for _, v in tokens):
        out.append(svg.bars(tokens, max_seq, "tokens per step (prompt + completion)",
                            "tokens", "tokens", lambda v: f"{v:.0f}"))
    else:
        out.append('<p class="muted">No provider reported token counts (a scripted '
                   "provider reports none).</p>")
    out.append("</div></section>")
    return out


def _action_cell(s: StepRow) -> str:
    if s.closing_step:
        return '<span class="muted">closing step (every account terminal)</span>'
    if s.action is None:
        return ""
    text = f"<b>{_e(s.action)}</b>"
    if s.operation:
        text += f" <code>{_e(s.operation)}</code>"
    if s.arguments not in (None, {}):
        text += f' <code class="muted">{_e(_json(s.arguments))}</code>'
    return text


def _score_cell(s: StepRow) -> str:
    """The assessment score with the record it scored: the hypothesis's previous result,
    not the row's own evidence (a reader took "score 89 ... E250" for E250's score)."""
    if s.score is None:
        return ""
    if not s.assessed_evidence:
        return str(s.score)
    ref = html_attr(s.assessed_evidence)
    return f'{s.score} <a class=muted href="#ev-{ref}">{_e(s.assessed_evidence)}</a>'


def _confidence(s: StepRow) -> str:
    """The confidence after the step, what it was when the step changed it, and the
    evidence the decision cites for it."""
    if not s.confidence:
        return ""
    if s.confidence_before and s.confidence_before != s.confidence:
        text = (f"<b>{_e(s.confidence)}</b><br><span class=muted>was "
                f"{_e(s.confidence_before)}</span>")
    else:
        text = _e(s.confidence)
    return text + _cites(s.cited_evidence)


def _cites(evidence_ids: list[str]) -> str:
    """``cites E3, E7`` (links to the records), or nothing."""
    if not evidence_ids:
        return ""
    shown = dict.fromkeys(evidence_ids)  # a reply may cite a record twice
    return f"<br><span class=muted>cites {', '.join(map(_ev_link, shown))}</span>"


def _citations(h: CaseHistory) -> tuple[dict[int, StepRow], dict[str, list[int]]]:
    """Each hypothesis's last step with a decision (its confidence and what that cites),
    and the steps whose decision cites each evidence record, in step order."""
    last: dict[int, StepRow] = {}
    cited_at: dict[str, list[int]] = defaultdict(list)
    for s in h.steps:
        if s.confidence and s.hypothesis_id is not None:
            last[s.hypothesis_id] = s
        for evidence_id in dict.fromkeys(s.cited_evidence):
            cited_at[evidence_id].append(s.seq)
    return last, cited_at


def _selection(s: StepRow) -> str:
    """Why the scheduler gave the step to its hypothesis (:func:`selection_text`), labelled;
    empty for a step recorded without one."""
    text = selection_text(s)
    return f"<span class=muted>selected:</span> {_e(text)}" if text else ""


def _timeline(h: CaseHistory) -> list[str]:
    out = ['<section id="timeline"><h2>Step timeline</h2>']
    if not h.steps:
        return [*out, '<p class="muted">No step has run yet.</p></section>']
    # The step and hypothesis columns stay in place when the box scrolls sideways (an
    # engineer scrolled to the notes of a 500-step case and lost the step numbers).
    # What the step did, what came of it and why come first; the note was the twelfth
    # column, off the right edge of a 1300-pixel window (a 500-step reader).
    out.append('<div class="scroll tall"><table class="steps"><thead><tr><th>step</th>'
               '<th>hyp.</th>'
               "<th>action / operation</th><th>outcome</th><th>evidence</th><th>note</th>"
               "<th>rejection</th><th>confidence</th><th>score (of)</th><th>units</th>"
               "<th>model time</th><th>tokens</th></tr></thead><tbody>")
    for s in h.steps:
        rejection = ""
        if s.rejection_code:
            rejection = f"<b>{_e(s.rejection_code)}</b>: {_e(s.rejection_detail or '')}"
        if s.provider_errors:  # retried past, or what the step stopped at
            label = "retried after" if s.model_answered else "provider"
            rejection += (" " if rejection else "") + \
                f'<span class="muted">{label}: {_e(", ".join(s.provider_errors))}</span>'
        ev = f'<a href="#ev-{html_attr(s.evidence_id)}">{_e(s.evidence_id)}</a>' \
            if s.evidence_id else ""
        if s.found:  # what the query found, beside its record (a reader saw none of it)
            ev += "".join(f"<br><span class=muted>{_found(s, f)}</span>" for f in s.found)
        if s.test_request:
            ev += f" test {_e(s.test_request)}"
        note = _e(s.note)
        if selected := _selection(s):  # the model's own note labelled below it
            note = selected + ("<br><span class=muted>note:</span> " + note if note else "")
        if s.score_reason:  # why the model scored the previous result as it did
            note += (("<br>" if note else "") + "<span class=muted>assessed "
                     f"{_e(s.assessed_evidence or '')}:</span> {_e(s.score_reason)}")
        if s.new_questions:
            ids = s.new_question_ids or [None] * len(s.new_questions)
            note += "".join(
                "<br><span class=muted>asks:</span> "
                + (f'<a href="#q-{html_attr(qid)}">{_e(qid)}</a> ' if qid else "") + _e(q)
                for q, qid in zip(s.new_questions, ids, strict=True))
        if s.resolved_questions:  # each a link to its row of the questions table
            note += "<br><span class=muted>resolves:</span> " + ", ".join(
                f'<a href="#q-{html_attr(q)}">{_e(q)}</a>' for q in s.resolved_questions)
        out.append(
            f'<tr id="step-{s.seq}"><td class=nw>{s.seq}</td>'
            f"<td class=nw>{_h_link(s.hypothesis_id)}"
            f"</td><td class=wide>{_action_cell(s)}</td>"
            f"<td class=nw>{_outcome(s.outcome, s.reason, s.published)}</td>"
            f"<td class=nw>{ev}</td><td class='wide note'>{note}</td>"
            f"<td>{rejection}</td><td class=nw>{_confidence(s)}</td>"
            f"<td class=nw>{_score_cell(s)}</td>"
            f"<td class=nw>{_e(units_text(s))}</td>"
            f"<td class=nw>{_ms(s.model_ms)}"
            + (f" <span class=muted>({s.attempts} attempts)</span>" if s.attempts > 1 else "")
            + f"</td><td class=nw>{_tokens(s)}</td></tr>")
    out.append("</tbody></table></div></section>")
    return out


def _cited_line(steps: list[int]) -> str:
    """``; cited at step 12`` or ``; cited at 3 steps: 12, 40, 251`` for a record's
    summary line (the first :data:`MAX_CITING_STEPS` linked), or nothing."""
    if not steps:
        return ""
    if len(steps) == 1:
        return f"; cited at {_step_link(steps[0])}"
    shown = ", ".join(_step_link(seq, "") for seq in steps[:MAX_CITING_STEPS])
    more = f" and {len(steps) - MAX_CITING_STEPS} more" if len(steps) > MAX_CITING_STEPS \
        else ""
    return f"; cited at {len(steps)} steps: {shown}{more}"


def _evidence(h: CaseHistory) -> list[str]:
    out = ['<section id="evidence"><h2>Evidence</h2>']
    if not h.evidence:
        return [*out, '<p class="muted">No evidence yet.</p></section>']
    out.append('<p class="muted">Quotes are the snapshot\'s exact text (a database row as '
               "JSON). Invisible characters are shown as their code point, such as "
               '<span class="ctl">U+200B</span>. Open a record to read its findings.</p>')
    _, cited_at = _citations(h)
    for e in h.evidence:
        assessed = (f"assessed {e['assessment_score']}/100, refund {e['refund_units']}"
                    if e["assessed"] else "not assessed yet")
        original = e.get("duplicate_of")
        flags = (f", duplicate of {_ev_link(original)}" if original
                 else ", duplicate" if e["duplicate"] else "")
        warnings = f"; warnings: {_e(', '.join(e['warnings']))}" if e["warnings"] else ""
        out.append(
            f'<details class="ev" id="ev-{html_attr(e["evidence_id"])}"><summary>'
            f'<b class="evid">{_e(e["evidence_id"])}</b> {_step_link(e["step_seq"])}, '
            f"H{e['hypothesis_id']}: <code>{_e(e['operation'])}</code> "
            f'<code class="muted">{_e(_json(e["arguments"]))}</code> - {e["item_count"]} '
            f"item(s), {e['new_item_count']} new{flags}; cost {e['cost_units']}; "
            f"{assessed}{warnings}{_cited_line(cited_at.get(e['evidence_id'], []))}"
            "</summary>")
        out.append(f'<p class="mono muted">artifact: {_e(e["artifact_path"])} '
                   f"(sha256 {_e(e['artifact_sha256'])})"
                   + (f"<br>raw result: {_e(e['result_path'])}" if e.get("result_path") else "")
                   + "</p>")
        items = e["items"]
        if original:
            # The same operation, arguments and findings: quoted once, at the first
            # record (summary.md does the same; a 500-step report quoted 72 copies).
            out.append(f'<p class="muted">The same findings as {_ev_link(original)}.</p>')
        elif items:
            out.append('<ol class="quotes">')
            for item in items[:MAX_ITEMS_SHOWN]:
                quote = item["quote"]
                cut = len(quote) > MAX_QUOTE_CHARS
                out.append(f'<li><span class="key mono">{_e(item["key"])}</span>'
                           f'<span class="q mono">{_e(quote[:MAX_QUOTE_CHARS])}</span>'
                           + (' <span class="muted">[cut]</span>' if cut else "") + "</li>")
            out.append("</ol>")
            if len(items) > MAX_ITEMS_SHOWN:
                out.append(f'<p class="muted">... {len(items) - MAX_ITEMS_SHOWN} more item(s) '
                           f"in {_e(e['artifact_path'])}</p>")
        else:
            out.append('<p class="muted">No findings (an empty result).</p>')
        out.append("</details>")
    out.append("</section>")
    return out


def _questions(h: CaseHistory) -> list[str]:
    out = ['<section id="questions"><h2>Questions</h2>']
    if not h.questions:
        return [*out, '<p class="muted">No question was asked.</p></section>']
    out.append('<div class="scroll"><table><thead><tr><th>id</th><th>hyp.</th><th>question</th>'
               "<th>status</th><th>asked at step</th><th>resolution</th></tr></thead><tbody>")
    for q in h.questions:
        resolution = ""
        if q["status"] == "resolved":
            links = ", ".join(f'<a href="#ev-{html_attr(e)}">{_e(e)}</a>'
                              for e in q["resolution_evidence"])
            resolution = f"{_step_link(q['resolved_step'])} with {links or 'no new evidence'}"
        out.append(f'<tr id="q-{html_attr(q["question_id"])}"><td>{_e(q["question_id"])}</td>'
                   f"<td>{_h_link(q['hypothesis_id'])}</td>"
                   f"<td>{_e(q['text'])}</td><td>{_e(q['status'])}</td>"
                   f"<td>{_step_link(q['created_step'], '')}</td><td>{resolution}</td></tr>")
    out.append("</tbody></table></div></section>")
    return out


def _tests_and_reviews(h: CaseHistory) -> list[str]:
    out = ['<section id="tests"><h2>External tests</h2>']
    if not h.tests:
        out.append('<p class="muted">No test was handed out.</p>')
    else:
        out.append('<div class="scroll"><table><thead><tr><th>request</th><th>step</th>'
                   "<th>hyp.</th><th>kind</th><th>status</th><th>deadline (UTC)</th>"
                   "<th>evidence</th><th>artifact</th></tr></thead><tbody>")
        for t in h.tests:
            out.append(f"<tr><td>{_e(t['request_id'])}</td><td>{_step_link(t['step_seq'], '')}</td>"
                       f"<td>{_h_link(t['hypothesis_id'])}</td><td>{_e(t['kind'])}</td>"
                       f"<td>{_e(t['status'])}</td><td>{_e(t['deadline_at'])}</td>"
                       f"<td>{_e(t['evidence_id'] or '')}</td>"
                       f"<td class=mono>{_e(t['artifact_path'])}</td></tr>")
        out.append("</tbody></table></div>")
    out.append("<h3>Early-diagnosis reviews</h3>")
    if not h.reviews:
        out.append('<p class="muted">None.</p>')
    for r in h.reviews:
        verdict = "accepted: alternatives deferred to assessment-only" if r["accepted"] else \
            "declined: " + "; ".join(f"{f['code']}: {f['detail']}" for f in r["findings"])
        out.append(f"<p>Step {r['step_seq']}, H{r['hypothesis_id']} asked to defer "
                   f"{_e(', '.join('H' + str(x) for x in r['requested']))}; {_e(verdict)}. "
                   f"Rationale: {_e(r['rationale'])}</p>")
    out.append("</section>")
    return out


def _lifecycle(h: CaseHistory) -> list[str]:
    life = h.status["lifecycle"]
    out = ['<section id="lifecycle"><h2>Lifecycle</h2>',
           f"<p>Session state <b>{_e(life['state'])}</b>"
           + (f", paused from {_e(life['paused_from'])}" if life.get("paused_from") else "")
           + (f", ended with {_e(life['termination_reason'])}"
              if life.get("termination_reason") else "")
           + (f"; {life['iterations']} iteration(s) ({_e(iterations_gloss(life))})"
              if life.get("started") else
              "; the session starts with the first step") + ".</p>"]
    if life.get("started"):
        usage, budget = life["usage"], life["budget"]
        out.append('<div class="scroll"><table><thead><tr><th>bound</th><th>used</th>'
                   "<th>limit</th><th></th></tr></thead><tbody>")
        for key in usage:
            limit = budget.get("max_" + key, 0)
            used = usage[key]
            share = min(100.0, 100.0 * used / limit) if limit else 100.0
            out.append(f"<tr><td>{_e(key)}</td><td>{used}</td><td>{limit}</td>"
                       f'<td><svg class="usage" width="160" height="10" role="img" '
                       f'aria-label="{share:.0f}%"><rect width="160" height="10" fill="#eee"/>'
                       f'<rect width="{1.6 * share:.1f}" height="10" fill="#5b7db1"/></svg>'
                       "</td></tr>")
        out.append("</tbody></table></div>")
        out.append('<p class="muted">The session\'s bounds (seed 001, docs/lifecycle.md) '
                   "mirror the engine's own rules, so the hypotheses' accounts stop a case "
                   "first: <code>cost_units</code> adds up every charge, refunds not "
                   "subtracted, against the hypotheses' iterations times the largest action "
                   "cost; an account's balance (Overview) is its credit less its charges "
                   "plus its refunds.</p>")
    out.append("</section>")
    return out


def render(h: CaseHistory) -> str:
    """The report page for ``h`` (an HTML5 document as a string)."""
    parts = ['<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
             "style-src 'unsafe-inline'; img-src data:\">",
             f"<title>Investigation report: {_e(h.case_id)}</title>",
             f"<style>{_CSS}</style></head><body>"]
    parts += _header(h)
    parts.append("<main>")
    for section in (_overview, _next, _charts, _timeline, _evidence, _questions,
                    _tests_and_reviews, _lifecycle):
        parts += section(h)
    parts.append("</main><footer>Written by <code>investigate report</code> from the case's "
                 "store. This page loads nothing from the network. It reports an "
                 "investigation, not a diagnosis.</footer></body></html>\n")
    return "\n".join(parts)
