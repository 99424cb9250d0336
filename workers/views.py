"""What the command line shows of a case: the status view, the guidance block and the
per-step line, shared by ``status``, ``status --watch``, ``run``, ``dispatch``, ``resume``.

Untrusted text (a provider's message, a rejection detail) goes through :func:`term`, which
shows control, bidirectional and zero-width characters as visible escapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from investigation.constants import BLOCKED, CASE_CANCELLED, CASE_HELD, RETRY_PENDING
from investigation.loop.outcome import tokens_text
from investigation.text_safety import escape_text

if TYPE_CHECKING:
    from investigation.guidance import Guidance
    from investigation.loop.outcome import Outcome

# The views of a case's figures import what reads them when they are drawn: the command line
# imports this module to start (workers.cli).


def counted(n: int, word: str) -> str:
    """``n`` and ``word``, plural unless ``n`` is 1 (``1 artifact``, ``83 artifacts``)."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def term(text: object) -> str:
    """Data for the terminal: control, bidirectional and zero-width characters (ANSI/OSC
    escapes included) as visible escapes (``investigation.text_safety.escape_text``)."""
    return escape_text(str(text))


class Fitted:
    """A table that never cuts a word of a cell: drawn as ``table`` when every column can
    be as wide as its longest word (cells and headers wrap only at spaces), else as one
    block per row, ``header: value`` lines, which fit any width. On an 80-column terminal
    the tables cut balances to "9999597…" and folded states into "BUIL DING" (a 500-step
    case's reader). The widths are set here, not left to Rich, whose collapse of a table
    too wide shrinks the widest column first, below its longest word when another column
    had room to give (a hostile trial's "ASSESSMENT_UNE│XPECTED"). Rows are read from the
    table (``Column.cells``): build it, then wrap it."""

    def __init__(self, table: Table) -> None:
        self.table = table
        for column in table.columns:
            column.overflow = "fold"  # only a word longer than the whole width is folded

    def __rich_console__(self, console: Console,
                         options: ConsoleOptions) -> Iterator[RenderableType]:
        widths = self.widths(options.max_width)
        if widths is None:
            yield Group(*self.records())
            return
        for column, width in zip(self.table.columns, widths, strict=True):
            column.width = width
        yield self.table

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self.table)

    def _extents(self) -> tuple[list[int], list[int], list[int], int]:
        """Per column its longest word and its longest line (content, without padding) and
        its padding, and the box's lines."""
        table = self.table
        _, right, _, left = table.padding
        words, lines, pads = [], [], []
        for i, column in enumerate(table.columns):
            texts = [_cell_text(cell).plain for cell in (column.header, *column.cells)]
            words.append(max((cell_len(w) for t in texts for w in t.split()), default=0))
            lines.append(max((cell_len(line) for t in texts for line in t.splitlines()),
                             default=0))
            pads.append((left if i or table.pad_edge else 0)
                        + (right if i < len(table.columns) - 1 or table.pad_edge else 0))
        box = (2 if table.box and table.show_edge else 0) + \
            (len(table.columns) - 1 if table.box else 0)
        return words, lines, pads, box

    def narrowest(self) -> int:
        """The fewest terminal columns the table takes with no word of a cell or a header
        broken: each column as wide as its longest word, its padding and the box's lines."""
        words, _, pads, box = self._extents()
        return sum(words) + sum(pads) + box

    def widths(self, max_width: int) -> list[int] | None:
        """Each column's content width for a table at most ``max_width`` wide, or ``None``
        when it cannot be drawn without breaking a word: every column gets its longest
        word, and what is left goes to the columns whose lines are longer, in proportion
        to what each still lacks, up to its longest line."""
        words, lines, pads, box = self._extents()
        spare = max_width - (sum(words) + sum(pads) + box)
        if spare < 0:
            return None
        lacking = [max(0, line - word) for word, line in zip(words, lines, strict=True)]
        wanted = sum(lacking)
        if wanted <= spare:
            return [word + lack for word, lack in zip(words, lacking, strict=True)]
        given = [lack * spare // wanted for lack in lacking]
        left = spare - sum(given)
        for i in sorted(range(len(given)), key=lambda i: lacking[i] - given[i],
                        reverse=True)[:left]:
            given[i] += 1
        return [word + more for word, more in zip(words, given, strict=True)]

    def records(self) -> Iterator[RenderableType]:
        """Each row as a block: its first cell after its header, in bold, then one
        indented ``header: value`` line for each other cell that is not empty."""
        columns = self.table.columns
        if self.table.title:
            yield Text(str(self.table.title), style="italic")
        for row in zip(*(list(c.cells) for c in columns), strict=True):
            yield Text.assemble(f"{columns[0].header} ", _cell_text(row[0]), style="bold")
            for column, cell in zip(columns[1:], row[1:], strict=True):
                text = _cell_text(cell)
                if text.plain and column.header:
                    yield Text.assemble(f"  {column.header}: ", text)


def _cell_text(cell: RenderableType) -> Text:
    """A table cell (text, or a ``Text``) as ``Text``."""
    return cell.copy() if isinstance(cell, Text) else Text(str(cell))


def facts_text(facts: dict[str, Any] | None) -> str:
    """``"; source.search, model 53.2 s, tokens 3120 + 140"``: what a step did
    (``report.history.step_facts``), or ``""`` when it did nothing to tell."""
    if not facts:
        return ""
    parts = []
    if facts.get("operation") or facts.get("action"):
        parts.append(str(facts.get("operation") or facts.get("action")))
    if facts.get("model_ms") is not None:
        parts.append(f"model {facts['model_ms'] / 1000:.1f} s")
    if tokens := tokens_text(facts.get("prompt_tokens"), facts.get("completion_tokens")):
        parts.append(f"tokens {tokens}")
    return "; " + ", ".join(parts) if parts else ""


def outcome_head(o: Outcome) -> str:
    """What a command that advances a case says it ended in: ``COMPLETED``,
    ``BLOCKED (REASON)``, or a held case's state alone (``PAUSED``, ``CANCELLED``). The
    engine's outcome for a held case is ``BLOCKED`` with the state as its reason; a fleet
    trial read ``BLOCKED (CANCELLED)`` as a block to fix."""
    if o.outcome == BLOCKED and o.reason in CASE_HELD:
        return o.reason or ""
    return o.outcome + (f" ({o.reason})" if o.reason else "")


def outcome_exit(o: Outcome) -> int:
    """The exit status of a command that advances a case (README, "Exit codes"): 1 when an
    operator must act (blocked, or paused: ``resume``), 4 at a provider backoff, 0 when
    the case completed or was cancelled (nothing more runs) or it progressed."""
    if o.outcome == BLOCKED:
        return 0 if o.reason == CASE_CANCELLED else 1
    return 4 if o.outcome == RETRY_PENDING else 0


def outcome_line(o: Outcome, facts: dict[str, Any] | None = None) -> list[str]:
    """The line ``run`` prints per step, with what it did (``facts``: see
    :func:`facts_text`), and the rejection detail under it."""
    extra = f" until {o.retry_not_before.isoformat()}" if o.retry_not_before else ""
    hyp = f" H{o.hypothesis_id}" if o.hypothesis_id is not None else ""
    lines = [f"step {o.step_seq:>3}{hyp}: {o.outcome}" + (f" ({o.reason})" if o.reason else "")
             + extra + term(facts_text(facts))]
    detail = o.details.get("rejection") or o.details.get("error_code")
    if detail:
        lines.append(term(f"         {detail}: {o.details.get('message', '')}".rstrip(": ")))
    if detail == "REPLY_TRUNCATED":  # the message is the model's; this is the operator's
        lines.append("         the provider's max_tokens cut the reply: raise it in the "
                     "providers file if this repeats (each cut reply is a whole call)")
    return lines


def guidance_text(g: Guidance) -> Text:
    """The guidance as styled terminal text: the headline, then numbered steps, each
    with its command on its own line (``$ ...``) ready to copy."""
    out = Text()
    out.append("next: ", style="bold")
    out.append(term(g.headline) + "\n")
    for i, step in enumerate(g.steps, start=1):
        out.append(f"  {i}. {term(step.text)}\n")
        if step.command:
            out.append("     $ ", style="dim")
            out.append(term(step.command) + "\n", style="bold cyan")
    out.rstrip()
    return out


def print_guidance(console: Console, g: Guidance) -> None:
    """Print :func:`guidance_text`."""
    console.print(guidance_text(g), highlight=False)


def model_usage_table(info: dict[str, Any], currency: str) -> Fitted | None:
    """Model calls, attempts, tokens and cost per hypothesis (``llm.spend``) and, with more
    than one row, their total; or None. Costs are labelled with the currency the case's
    attempts recorded (``model_usage.currency``), else ``currency``."""
    from investigation.llm.spend import cost_text, priced_total, token_cells

    currency = info.get("model_usage", {}).get("currency") or currency
    usage = info.get("model_usage", {}).get("hypotheses") or []
    if not usage:
        return None
    table = Table("hypothesis", "model calls", "attempts", "prompt tokens",
                  "completion tokens", "cost",
                  title="model usage (separate from investigation units)")
    for u in usage:
        # No server reported a count (a scripted provider, a server without `usage`): a
        # 0 there read as a free model (a reader's trial).
        # Some answered calls came without counts: the sums are partial (a reader's trial
        # added them up as the whole). A failed attempt has no reply to count.
        table.add_row("unrecorded" if u["hypothesis_id"] is None else str(u["hypothesis_id"]),
                      str(u["calls"]), _attempts_cell(u), *token_cells([u]),
                      cost_text(u["cost_micros"], currency))
    if len(usage) > 1:
        # The case's total (an engineer reading a long case added four rows by hand; only
        # status --json had it).
        # Partial sums say so here too (a 500-step reader's trial).
        table.add_section()
        table.add_row("total", str(sum(u["calls"] for u in usage)),
                      str(sum(u["attempts"] for u in usage)), *token_cells(usage),
                      cost_text(priced_total(usage), currency))
    return Fitted(table)


def _holder_text(info: dict[str, Any]) -> str:
    """`` (w1@host pid 7, renewed 12 s ago)``: who holds the lease, where it says."""
    name, ago = info.get("dispatch_holder"), info.get("dispatch_renewed_s_ago")
    if name is None:
        return ""
    return f" ({name}" + ("" if ago is None else f", renewed {ago:g} s ago") + ")"


def _attempts_cell(usage: dict[str, Any]) -> str:
    """``attempts``, and how many of them await their answer: a call in flight read as a
    retry (a real model's user, during a two-minute call)."""
    waiting = usage["awaiting_answer"]
    return str(usage["attempts"]) + (f" ({waiting} awaiting answer)" if waiting else "")


#: What a session's termination reason means for the case, where its name could be read
#: as a finding (a user of a real model read OBJECTIVE_MET as "bug found").
_TERMINATION_GLOSS = {"OBJECTIVE_MET": ": every hypothesis account is terminal; an "
                                       "investigation, not a diagnosis"}


def status_view(info: dict[str, Any], g: Guidance | None = None,
                currency: str = "USD") -> RenderableType:
    """The ``status`` screen: state line, last outcome, why, lifecycle, the accounts
    table, each last rejection, the model usage and (if given) what to do next."""
    from investigation.evidence.figures import evidence_text
    from investigation.loop.lifecycle import iterations_gloss
    from investigation.loop.outcome import last_outcome_text
    from investigation.operations import step_in_progress_text
    from workers.locks import held_by_a_shell

    parts: list[RenderableType] = []

    def line(text: str) -> None:
        parts.append(Text(term(text)))

    line(f"case {info['case_id']}  state {info['state']}"
         + (f" ({info['blocked_reason']})" if info["blocked_reason"] else "")
         + f"  published steps {info['steps']}  evidence {info['evidence_count']}"
         + f"  open questions {info['open_questions']}")
    if going := info.get("step_in_progress"):
        line(step_in_progress_text(going, info["state"]) + ": the evidence, questions "
             "and balances above include what it recorded so far")
    figures = info.get("evidence")
    if figures and figures["records"]:  # what the records amount to (a worthless run)
        line(evidence_text(figures))
    if info["last_outcome"]:
        line(f"last outcome {last_outcome_text(info['last_outcome'], info['last_reason'])}"
             + (f"  retry not before {info['retry_not_before']}"
                if info.get("retry_not_before") else ""))
    if info.get("blocked_since"):
        line(f"blocked since {info['blocked_since']}")
    if info["blocked_detail"]:
        line(f"why: {info['blocked_detail']}")
    if "dispatch_lease_s" in info:  # a shell with a broker (workers) asked Redis
        lease = info["dispatch_lease_s"]
        waits = info["last_outcome"] == "RETRY_PENDING" and info.get("retry_not_before")
        line("dispatch: " + (f"one holds the case{_holder_text(info)} with a lease that "
                             "never expires (not the engine's: it always sets one), so "
                             "neither a worker nor the sweep takes the case: `dispatch "
                             f"{info['case_id']} --take-over` ends it"
                             if info.get("dispatch_lease_expires") is False
                             else "Redis cannot tell whether one holds the case"
                             if lease is None
                             else f"none holds the case: it waits until "
                             f"{info['retry_not_before']}, then the workers take it up "
                             "again (a `dispatch` before then meets the same wait)"
                             if not lease and waits
                             else f"none holds the case, and {info['queue_waiting']} "
                             f"message(s) wait in queue {info['queue']!r} that "
                             "no worker has taken: is one running? (`investigate health`)"
                             if not lease and info.get("queue_waiting")
                             else "none holds the case (`dispatch` or the recovery sweep "
                             "starts one)" if not lease
                             else f"one holds the case{_holder_text(info)}, lease "
                             f"{lease:g} s left, sent from a shell, and "
                             f"{info['queue_waiting']} message(s) wait in queue "
                             f"{info['queue']!r} that no worker has taken: is one "
                             "running? (`investigate health`)"
                             if info.get("queue_waiting") and held_by_a_shell(info)
                             else f"one holds the case{_holder_text(info)}, lease "
                             f"{lease:g} s left (its worker "
                             "renews it at every stage; if the worker died, the sweep "
                             "dispatches the case once it runs out, `dispatch "
                             f"{info['case_id']} --take-over` now)"))
    if info.get("run_holds"):
        line("run: a `run` on this machine holds the case (its file lock)")
    life = info["lifecycle"]
    reason = life.get("termination_reason")
    line(f"lifecycle {life['state']}"
         + (f" (paused from {life['paused_from']})" if life.get("paused_from") else "")
         + (f" ({reason}{_TERMINATION_GLOSS.get(reason, '')})" if reason else "")
         # Beside the accounts' own iterations and the published steps, what it counts
         # (a 500-step reader met 497, 499 and 500 side by side, unexplained).
         + (f"  session iterations {life['iterations']} ({iterations_gloss(life)})"
            if life.get("started") else
            "  (the session starts with the first step)"))
    if not info["accounts"]:
        count = info["hypotheses"]
        line(f"{count} {'hypothesis' if count == 1 else 'hypotheses'}; no step has run yet")
    else:
        table = Table("hypothesis", "disposition", "confidence", "balance", "iterations",
                      "pending result", "last rejection")
        for a in info["accounts"]:
            rej = a["last_rejection"]
            label = a["status"]
            if a["deferred_by"] is not None and label == "active":
                label += f" (assessment-only, deferred by H{a['deferred_by']})"
            table.add_row(str(a["hypothesis_id"]), label, a["confidence"],
                          f"{a['balance_units']}/{a['credit_units']}", str(a["iterations"]),
                          a["pending_evidence_id"] or "",
                          Text(term(f"{rej['code']} (step {rej['step_seq']}, "
                                    f"{a['invalid_streak']} in a row)")) if rej else "")
        parts.append(Fitted(table))
        for a in info["accounts"]:
            if a["last_rejection"]:
                line(f"H{a['hypothesis_id']} last rejection: "
                     f"{a['last_rejection']['code']}: {a['last_rejection']['detail']}")
    usage = model_usage_table(info, currency)
    if usage is not None:
        parts.append(usage)
    if g is not None:
        parts.append(guidance_text(g))
    return Group(*parts)
