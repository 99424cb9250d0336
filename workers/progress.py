"""The live progress display of ``investigate run`` (Rich), and ``status --watch``.

On a terminal, ``run`` shows a live panel under the step lines: the last step, whose turn
it was and its outcome, each account's balance bar, confidence and status, the model time
and the tokens so far. When stdout is not a terminal (a pipe, a log file, CI) nothing
animates: only the plain step lines are printed.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text
from sqlalchemy.exc import SQLAlchemyError

from investigation.constants import BLOCKED, CASE_INVESTIGATING, COMPLETED, RETRY_PENDING, YIELDED
from investigation.guidance import Guidance, for_case
from investigation.loop.outcome import Outcome, last_outcome_text
from investigation.operations import status
from investigation.report.history import step_facts, usage_totals
from investigation.store import Store
from workers.views import outcome_line, status_view, term

#: Outcomes after which ``run`` takes no further step (the panel stops saying it works).
_ENDS_RUN = frozenset({COMPLETED, BLOCKED, YIELDED})


def _seconds(ms: int | None) -> str:
    return f"{(ms or 0) / 1000:.1f} s"


def progress_view(info: dict[str, Any], usage: dict[str, Any], last: Outcome | None,
                  started: float, finished: bool = False) -> RenderableType:
    """The live panel (see the module docstring); ``finished``: the run takes no further
    step (its last frame says nothing of a next one)."""
    head = Text()
    if last is None:
        head.append("starting ...")
    else:
        head.append(f"step {last.step_seq}", style="bold")
        if last.hypothesis_id is not None:
            head.append(f"  H{last.hypothesis_id}")
        head.append(f"  {last.outcome}" + (f" ({last.reason})" if last.reason else ""))
    tokens = "not reported"
    if usage["prompt_tokens"] is not None or usage["completion_tokens"] is not None:
        tokens = f"{usage['prompt_tokens'] or 0} + {usage['completion_tokens'] or 0}"
    # Answered calls, as `status` counts them (the panel counted operations: 17 where
    # status said 12, a real model's user); attempts besides when some failed.
    head.append(f"   model time {_seconds(usage['model_ms'])} over {usage['calls']} call(s)"
                + (f" and {usage['failed']} failed attempt(s)" if usage["failed"] else "")
                + f"   tokens {tokens}   wall {time.monotonic() - started:.0f} s")
    table = Table("hypothesis", "status", "confidence", "balance", "", "iterations",
                  box=None, pad_edge=False)
    for a in info["accounts"]:
        credit = max(1, int(a["credit_units"]))
        table.add_row(f"H{a['hypothesis_id']}", a["status"], a["confidence"],
                      f"{a['balance_units']}/{a['credit_units']}",
                      ProgressBar(total=credit, completed=max(0, a["balance_units"]), width=24),
                      str(a["iterations"]))
    parts: list[RenderableType] = [head, table]
    if not finished and info["state"] == CASE_INVESTIGATING and \
            (last is None or last.outcome not in _ENDS_RUN):
        parts.append(Spinner("dots", text=Text(" working on the next step", style="dim")))
    return Panel(Group(*parts), title=f"investigate run {info['case_id']}",
                 title_align="left")


class RunProgress:
    """``on_step`` callback of the embedded runner with the live panel on a terminal.

    Use as a context manager around ``run_case``; ``quiet`` prints nothing at all
    (``--json``).
    """

    def __init__(self, console: Console, store: Store, case_id: str,
                 quiet: bool = False) -> None:
        self.console = console
        self.store = store
        self.case_id = case_id
        self.quiet = quiet
        self.live_mode = console.is_terminal and not quiet
        self.outcomes: list[Outcome] = []
        self.started = time.monotonic()
        self._live: Live | None = None

    def _view(self, finished: bool = False) -> RenderableType:
        info = status(self.store, self.case_id)
        return progress_view(info, usage_totals(self.store, self.case_id),
                             self.outcomes[-1] if self.outcomes else None, self.started,
                             finished)

    def __enter__(self) -> RunProgress:
        if self.live_mode:
            self._live = Live(self._view(), console=self.console, refresh_per_second=8,
                              transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._live is not None:
            if exc_type is None:  # the last frame: no "working on the next step" after
                with contextlib.suppress(Exception):  # --max-steps (a real model's user)
                    self._live.update(self._view(finished=True), refresh=True)
            self._live.__exit__(exc_type, exc, tb)
            self._live = None

    def __call__(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        if self.quiet:
            return
        try:  # what the step did: its operation, model time and tokens
            facts = step_facts(self.store, self.case_id, outcome.step_seq)
        except SQLAlchemyError:  # a line without them rather than a failed run
            facts = None
        for line in outcome_line(outcome, facts):
            self.console.print(line, highlight=False, markup=False)
        if self._live is not None:
            self._live.update(self._view())


#: What a watch reads at each redraw: the status and what to do next.
Reading = Callable[[], tuple[dict[str, Any], Guidance]]


def store_reading(store: Store, case_id: str) -> Reading:
    """The status in the store and ``guidance.for_case``'s advice (both runtimes, a
    placeholder providers file): a watch's reading where no shell is known."""
    return lambda: (status(store, case_id), for_case(store, case_id))


def _changed(info: dict[str, Any]) -> tuple[Any, ...]:
    """What a new watch line is printed for: the published step, the state, the last
    outcome, and whether a dispatch holds the case (a fleet shell's reading: a holder
    that died shows when its lease lapses, with no step published)."""
    return (info["steps"], info["state"], info["last_outcome"], info["last_reason"],
            info.get("dispatch_holder") is not None)


def watch(console: Console, store: Store, case_id: str, interval_s: float,
          stop_after_s: float | None = None,
          sleep: Callable[[float], None] = time.sleep,
          read: Reading | None = None, currency: str = "USD") -> dict[str, Any]:
    """``status --watch``: redraw the status (and what to do next) every ``interval_s``
    until the case stops moving (complete, blocked, paused, cancelled, stopped) or
    ``stop_after_s`` passes. On a terminal the screen is redrawn in place; elsewhere a line
    is printed whenever the published step, the state or whether a dispatch holds the
    case changes. Returns the last status.

    ``read`` gives the status and advice as ``status`` would in this shell (its runtimes,
    INVESTIGATE_PROVIDERS, and on a fleet shell the dispatch lease:
    ``workers.cli.status_reading``); default :func:`store_reading`. ``currency`` labels
    model costs.
    """
    read = read or store_reading(store, case_id)
    started = time.monotonic()
    seen: tuple[Any, ...] | None = None
    live = Live(console=console, refresh_per_second=4) if console.is_terminal else None
    if live is not None:
        live.__enter__()
    try:
        while True:
            info, g = read()
            settled = info["state"] != CASE_INVESTIGATING
            if live is not None:
                live.update(status_view(info, g if settled else None, currency))
            else:
                key = _changed(info)
                if key != seen:
                    if seen is None and not settled:  # a new user's trial waited, unsure why
                        console.print("watching: one line per change, Ctrl-C leaves; only "
                                      "workers (`investigate dispatch`) or `investigate run` "
                                      "move the case", highlight=False, markup=False)
                    seen = key
                    console.print(term(
                        f"{time.strftime('%H:%M:%S')} case {case_id}: state {info['state']}"
                        + (f" ({info['blocked_reason']})" if info["blocked_reason"] else "")
                        + f", step {info['steps']}, last outcome "
                        + last_outcome_text(info["last_outcome"], info["last_reason"])
                        + _retry_text(info)
                        + f", evidence {info['evidence_count']}"
                        + _holder_text(info)), highlight=False, markup=False)
            if settled:
                if live is None:
                    console.print(status_view(info, g, currency))
                return info
            if stop_after_s is not None and time.monotonic() - started >= stop_after_s:
                return info
            sleep(interval_s)
    finally:
        if live is not None:
            live.__exit__(None, None, None)


def _retry_text(info: dict[str, Any]) -> str:
    """When a pending retry may run, in the watch line (a fleet trial's watch printed
    ``RETRY_PENDING`` and then nothing for 50 s; `status` gave the time)."""
    if info["last_outcome"] != RETRY_PENDING or not info.get("retry_not_before"):
        return ""
    return f" until {info['retry_not_before']}"


def _holder_text(info: dict[str, Any]) -> str:
    """A watch line's word on the dispatch lease, where the reading has one."""
    if "dispatch_lease_s" not in info:  # not a fleet shell, or not investigating
        return ""
    if info.get("dispatch_holder") is not None:
        return f", held by {info['dispatch_holder']}"
    return ", no dispatch holds it" if info["dispatch_lease_s"] == 0.0 else ""


#: Failed store reads in a row that ``status --watch --json`` waits out.
STORE_RETRIES = 5


def watch_json(write: Callable[[str], None], store: Store, case_id: str, interval_s: float,
               read: Reading | None = None, stop_after_s: float | None = None,
               sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """``status --watch --json``: JSON Lines, one object (``status --json``'s, with
    ``next``) at the start and whenever the published step, the state, the last outcome
    or whether a dispatch holds the case changes, until the case stops moving (the last
    line is its settled status) or ``stop_after_s`` passes. ``write`` takes each line with
    its newline. Returns the last status. What an upstream system follows a case with (it
    printed one object and exited while the case still ran, an integrator's trial). A
    store read that fails is tried again at the next interval, :data:`STORE_RETRIES`
    times in a row at most.
    ``read``: as :func:`watch`'s (on a fleet shell, the lines carry ``status --json``'s
    ``dispatch_lease_s``, ``dispatch_holder``, ``queue_waiting``, ...).

    Raises:
        InvestigationError: ``CASE_NOT_FOUND``.
        sqlalchemy.exc.SQLAlchemyError: the store failed more than ``STORE_RETRIES``
            times in a row.
    """
    read = read or store_reading(store, case_id)
    started = time.monotonic()
    seen: tuple[Any, ...] | None = None
    failures = 0
    while True:
        try:
            info, g = read()
        except SQLAlchemyError:
            # A dropped connection ended the watch at once (a hostile-input trial): the
            # store is read again at the next interval, up to STORE_RETRIES times in a
            # row; then the error is the command's (one JSON line).
            failures += 1
            if failures > STORE_RETRIES:
                raise
            sleep(interval_s)
            continue
        failures = 0
        settled = info["state"] != CASE_INVESTIGATING
        key = _changed(info)
        if key != seen or settled:
            seen = key
            write(json.dumps({**info, "next": g.to_dict()}, sort_keys=True) + "\n")
        if settled or (stop_after_s is not None
                       and time.monotonic() - started >= stop_after_s):
            return info
        sleep(interval_s)


__all__ = ["Reading", "RunProgress", "progress_view", "store_reading", "watch", "watch_json"]
