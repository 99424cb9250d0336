"""``investigate report`` (the HTML case report), ``investigate steps`` (its step table
in the terminal) and ``investigate replies check`` (a scripted reply file judged against
a case without running anything).

Registered on the main app by ``workers.cli``; the same exit codes apply.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from workers.cli import (
    EXAMPLE_CASE,
    CaseArg,
    JsonOpt,
    _controlled,
    _currency,
    _print_json,
    _settings,
    _store,
    example,
    out,
    status_reading,
)
from workers.views import Fitted, term

if TYPE_CHECKING:
    from investigation.loop.script_check import LineVerdict
    from investigation.report.history import StepRow

replies_app: typer.Typer = typer.Typer(
    help="Scripted reply files (JSON Lines, one model reply per line).", no_args_is_help=True,
    epilog=example(f"investigate replies check replies.jsonl {EXAMPLE_CASE}"))

#: How ``replies check`` shows each verdict (``investigation.loop.script_check``).
_STYLE = {"accepted": "green", "rejected": "bold red", "depends": "yellow",
          "served": "dim", "unused": "dim", "unreadable": "bold red"}


@_controlled
def report_cmd(
    case_id: CaseArg,
    output: Annotated[Path | None, typer.Option(
        "-o", "--output", help="the HTML file to write (default: CASE.html here); it is "
        "replaced if it exists")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Write the case report: one self-contained HTML file to open in a browser.

    It shows the state and what to do next, the hypotheses, a timeline of every step,
    each hypothesis's confidence over the steps, each account's budget burn-down with
    its charges and refunds, model time and tokens, the evidence with its exact quotes
    and artifact paths, the questions and the lifecycle. It loads nothing from the
    network (no script, no external file).
    """
    from investigation.report import write_report

    target = output or Path(f"{case_id}.html")
    settings = _settings()
    store = _store(settings, existing=True)
    # The next steps `status` gives in this shell: it also knows a `run` or a dispatch
    # that holds the case (the store's own advice said "run it again" during a run).
    _, advice = status_reading(settings, store, case_id)
    size = write_report(store, case_id, target, currency=_currency(settings),
                        guidance=advice)
    if as_json:
        _print_json({"case_id": case_id, "path": str(target.resolve()), "bytes": size})
        return
    out.print(f"wrote {target} ({size} bytes); open it in a browser: "
              f"{target.resolve().as_uri()}", highlight=False, soft_wrap=True)


@_controlled
def steps_cmd(
    case_id: CaseArg,
    first: Annotated[int | None, typer.Option(
        "--from", min=1, max=10**9, help="the first step to show")] = None,
    last: Annotated[int | None, typer.Option(
        "--to", min=1, max=10**9, help="the last step to show")] = None,
    hypothesis: Annotated[int | None, typer.Option(
        "--hypothesis", "-H", min=1, max=10**9,
        help="only the steps of this hypothesis (its id, as in H3: 3)")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Each step of a case in the terminal, as the report's step table shows it: the
    hypothesis and why it was selected, the action and query, the outcome, what the query
    found, the confidence and the evidence it cites, the assessment, the model's note and
    questions, a rejection, units, model time and tokens.

    For a reader without a browser (over SSH, say); `report` draws the same in one HTML
    page, with charts and the evidence's quotes.
    """
    from dataclasses import asdict

    from investigation.report.history import case_history

    if first is not None and last is not None and first > last:
        raise typer.BadParameter(f"--from {first} is after --to {last}", param_hint="--from")
    settings = _settings()
    history = case_history(_store(settings, existing=True), case_id,
                           currency=_currency(settings))
    if hypothesis is not None and hypothesis not in history.statements:
        from investigation.errors import InvestigationError

        raise InvestigationError(
            "HYPOTHESIS_NOT_FOUND", f"{case_id} has no hypothesis H{hypothesis}; its "
            f"hypotheses: {', '.join(f'H{i}' for i in sorted(history.statements))}")
    rows = [s for s in history.steps
            if (first is None or s.seq >= first) and (last is None or s.seq <= last)
            and (hypothesis is None or s.hypothesis_id == hypothesis)]
    if as_json:
        _print_json({"case_id": case_id, "steps": [asdict(s) for s in rows]})
        return
    if not rows:
        which = [f"H{hypothesis}" if hypothesis else "",
                 f"from step {first}" if first else "", f"to step {last}" if last else ""]
        shown = " ".join(w for w in which if w)
        out.print(f"{case_id}: no step{' ' + shown if shown else ''} "
                  f"({len(history.steps)} step(s) in all)", highlight=False, markup=False)
        return
    for s in rows:
        head, *details = step_lines(s)
        out.print(Text(term(head), style="bold"), soft_wrap=True)
        for line in details:
            out.print(Text("    " + term(line)), soft_wrap=True)
    # The count last, where a long listing ends (a 500-step reader's 3,560 lines ended on
    # the last step's figures, with no word of how many were shown).
    out.print(f"{len(rows)} of {len(history.steps)} step(s) shown", highlight=False,
              markup=False)


def step_lines(s: StepRow) -> list[str]:
    """What ``investigate steps`` prints of step ``s`` (plain text, not yet escaped): a
    head line, then one line for each thing the step has to tell."""
    from investigation.loop.outcome import tokens_text
    from investigation.report.history import selection_text, units_text

    arguments = json.dumps(s.arguments, sort_keys=True, ensure_ascii=False) \
        if s.arguments not in (None, {}) else ""
    if s.closing_step:
        what = "closing step (every account terminal)"
    else:
        # A query's arguments on the head line; a finish's or reject's reason (up to 4000
        # characters) or a test request on their own line, below it (the outcome was at
        # the end of a very long line, a hostile trial).
        inline = arguments if s.action == "query" else ""
        what = " ".join(part for part in (s.action or "", s.operation or "", inline)
                        if part)
    outcome = (s.outcome or "") + (f" ({s.reason})" if s.reason else "")
    if not s.published:
        outcome = "not published" + (f": {outcome}" if outcome else "")
    hyp = f"H{s.hypothesis_id}" if s.hypothesis_id is not None else "-"
    lines = ["  ".join(part for part in (f"step {s.seq}", hyp, what, outcome) if part)]
    if arguments and s.action != "query" and not s.closing_step:
        reason = s.arguments.get("reason") if isinstance(s.arguments, dict) \
            and set(s.arguments) == {"reason"} else None
        lines.append(f"reason: {reason}" if isinstance(reason, str)
                     else f"arguments: {arguments}")
    if selected := selection_text(s):
        lines.append(f"selected: {selected}")
    if s.evidence_id:
        lines.append(f"found: {s.evidence_id}" + "".join(f", {f}" for f in s.found))
    if s.test_request:
        lines.append(f"test: {s.test_request}")
    if s.confidence:
        moved = f" (was {s.confidence_before})" if s.confidence_before \
            and s.confidence_before != s.confidence else ""
        cites = f"; cites {', '.join(dict.fromkeys(s.cited_evidence))}" \
            if s.cited_evidence else ""
        lines.append(f"confidence: {s.confidence}{moved}{cites}")
    if s.score is not None:
        scored = f" {s.assessed_evidence}" if s.assessed_evidence else ""
        why = f": {s.score_reason}" if s.score_reason else ""
        lines.append(f"assessed{scored}: {s.score}/100{why}")
    if s.note:
        lines.append(f"note: {s.note}")
    ids = s.new_question_ids or [None] * len(s.new_questions)
    lines += [f"asks: {qid + ': ' if qid else ''}{q}"
              for q, qid in zip(s.new_questions, ids, strict=True)]
    if s.resolved_questions:
        lines.append(f"resolves: {', '.join(s.resolved_questions)}")
    if s.rejection_code:
        lines.append(f"rejection: {s.rejection_code}: {s.rejection_detail or ''}")
    if s.provider_errors:
        label = "retried after" if s.model_answered else "provider"
        lines.append(f"{label}: {', '.join(s.provider_errors)}")
    figures = []
    if moved := units_text(s):
        figures.append(f"units {moved}")
    if s.model_ms is not None:
        took = f"{s.model_ms / 1000:.2f} s" if s.model_ms >= 1000 else f"{s.model_ms} ms"
        figures.append(f"model {took}"
                       + (f" ({s.attempts} attempts)" if s.attempts > 1 else ""))
    if tokens := tokens_text(s.prompt_tokens, s.completion_tokens):
        figures.append(f"tokens {tokens}")
    if figures:
        lines.append("; ".join(figures))
    return lines


def register(app: typer.Typer) -> None:
    """Add ``report`` and ``steps`` to the main app."""
    app.command("report", epilog=example(
        f"investigate report {EXAMPLE_CASE} -o report.html",
        f"investigate report {EXAMPLE_CASE} -o report.html --json"))(report_cmd)
    app.command("steps", epilog=example(
        f"investigate steps {EXAMPLE_CASE} --from 240 --to 260",
        f"investigate steps {EXAMPLE_CASE} -H 2 --json"))(steps_cmd)


def _runs(lines: list[LineVerdict]) -> Iterator[tuple[LineVerdict, LineVerdict | None]]:
    """The verdicts in order, each run of two or more consecutive ``served`` or
    ``unused`` lines without notes as ``(first, last)`` (a 15,000-line reply file
    against a finished case printed a 20,000-line table of the same sentence), any other
    as ``(v, None)``. ``--json`` keeps every line."""
    from investigation.loop.script_check import SERVED, UNUSED

    i = 0
    while i < len(lines):
        j = i
        if lines[i].verdict in (SERVED, UNUSED) and not lines[i].notes:
            # A line with a note (a served line edited since its call read it) stands
            # alone: a run swallowed it, and a shifted file looked clean (a trial).
            while j + 1 < len(lines) and lines[j + 1].verdict == lines[i].verdict \
                    and not lines[j + 1].notes:
                j += 1
        yield (lines[i], lines[j] if j > i else None)
        i = j + 1


@replies_app.command("check", epilog=example(
    f"investigate replies check replies.jsonl {EXAMPLE_CASE}",
    f"investigate replies check replies.jsonl {EXAMPLE_CASE} --config policy.toml --json"))
@_controlled
def replies_check(
    file: Annotated[Path, typer.Argument(
        metavar="FILE", help="the JSON Lines reply file a scripted provider would serve")],
    case_id: CaseArg,
    config: Annotated[Path | None, typer.Option(
        "--config", help="the policy TOML you will run with, for a case whose policy is "
        "not frozen yet (its first step freezes it); default: INVESTIGATE_CONFIG or the "
        "built-in defaults")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Judge each line of a reply file against the case, without running anything.

    The N-th reply line answers the case's model call N (blank lines do not count; the
    table shows each line's number in the file, and `--json` its 0-based `call_index`,
    as the store numbers calls). Each line gets a verdict from the engine's
    own parser and validator, on a simulation of the case from its stored state:
    accepted, rejected (with the code and the rule), depends (the verdict turns on what
    earlier queries will find: both outcomes are given), served (that call was already
    made), unused (the case completes before it), or unreadable. Nothing is written, no
    model is called and no query runs. Exit 0 when no line the case will read is rejected,
    1 otherwise. docs/reply-contract.md says what can and cannot be checked this way.
    """
    from investigation.cases.reader import PackageReader
    from investigation.config import InvestigationConfig
    from investigation.loop.script_check import SERVED, check_script

    settings = _settings()
    config_path = config or settings.config
    cfg = InvestigationConfig.load(config_path) if config_path else None
    result = check_script(_store(settings, existing=True), case_id, file, cfg,
                          PackageReader((cfg or InvestigationConfig()).package))
    if as_json:
        _print_json(result.to_dict())
    else:
        out.print(term(f"{file} against {case_id} ({result.policy}): {result.start}"),
                  highlight=False, markup=False)
        table = Table("line", "call", "step", "hyp.", "verdict", "what / why")
        for v, last in _runs(result.lines):
            if last is not None:  # a run of served or unused lines: one row
                calls = ("" if v.call_index is None or last.call_index is None
                         else f"{v.call_index + 1}-{last.call_index + 1}")
                why = (f"calls {calls} were already made; the case will not read these "
                       "lines again" if v.verdict == SERVED else v.detail)
                table.add_row(f"{v.line}-{last.line}", calls, "", "",
                              Text(v.verdict, style=_STYLE[v.verdict]), Text(term(why)))
                continue
            why = v.detail if v.code is None else f"{v.code}: {v.detail}"
            if v.outcome in ("BLOCKED", "COMPLETED", "DEFERRED"):
                why += f" ({v.outcome})"
            text = "\n".join(term(part) for part in [why, *(f"- {n}" for n in v.notes)])
            table.add_row(str(v.line), "" if v.call_index is None else str(v.call_index + 1),
                          "" if v.step_seq is None else str(v.step_seq),
                          "" if v.hypothesis_id is None else f"H{v.hypothesis_id}",
                          Text(v.verdict, style=_STYLE[v.verdict]), Text(text))
        out.print(Fitted(table))
        counts = ", ".join(f"{n} {k}" for k, n in result.counts.items() if n)
        out.print(term(f"{counts or 'no reply lines'}; after the last line: {result.end}"),
                  highlight=False, markup=False)
        spread = next((v.line for v in result.lines
                       if any("one JSON document" in n for n in v.notes)), None)
        if spread is not None:  # said again last: the table may be long (a re-trial)
            out.print(term(f"note: a reply is written over several lines from line {spread} "
                           "on: a reply file holds one reply per line"),
                      highlight=False, markup=False)
    if not result.ok:
        raise typer.Exit(1)
