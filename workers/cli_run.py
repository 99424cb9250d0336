"""``investigate run`` and ``investigate demo``: the embedded runtime from the command line,
with the live progress panel and what to do next.

Registered on the main app by ``workers.cli``; the same exit codes apply (0 done, 1
blocked, 2 a controlled error, 3 ``LockBusy``, 4 ``run --no-wait`` at a backoff).
"""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from investigation.constants import COMPLETED
from workers.cli import (
    EXAMPLE_CASE,
    INTERRUPTED_EXIT,
    CaseArg,
    JsonOpt,
    _controlled,
    _currency,
    _fail,
    _fleet_shell,
    _print_json,
    _settings,
    _store,
    err,
    example,
    out,
)
from workers.views import outcome_exit, outcome_head, print_guidance

if TYPE_CHECKING:
    from investigation.loop.outcome import Outcome
    from workers.settings import Settings


def _run_embedded(settings: Settings, case_id: str, config: Path | None,
                  providers: Path | None, max_steps: int | None, wait: bool,
                  quiet: bool = False, fleet_lock: bool = False
                  ) -> tuple[Outcome, list[Outcome]]:
    from workers import runtime
    from workers.embedded import run_case
    from workers.progress import RunProgress

    store = _store(settings, existing=True)
    rt = runtime.embedded(settings, config, providers, fleet_lock=fleet_lock)
    with RunProgress(out, store, case_id, quiet=quiet) as progress:
        outcome = run_case(rt, case_id, max_steps=max_steps, wait=wait, on_step=progress)
    return outcome, progress.outcomes


def _finish(settings: Settings, case_id: str, outcome: Outcome,
            providers: Path | None = None, steps: list[Outcome] | None = None,
            as_json: bool = False, env: str | None = None, report: Path | None = None,
            out_dir: Path | None = None) -> None:
    from investigation import guidance, operations
    from investigation.evidence.figures import evidence_text
    from investigation.files import write_atomic

    summary_path = None
    if outcome.outcome == COMPLETED:
        # The summary's exact bytes, where the command can point at them; the whole
        # artifact tree (tens of MB for a long case) only when asked (`export`).
        summary_path = (settings.home / "summaries" / case_id / "summary.md").resolve()
        summary_path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(summary_path, operations.summary_bytes(_store(settings), case_id))
    g = guidance.for_case(_store(settings, existing=True), case_id, "embedded",
                          str(providers) if providers else None, env,
                          _scripted_file(providers or settings.providers),
                          _shown(out_dir) if out_dir else None)
    # What the evidence amounts to, beside the outcome: a real model's run of duplicate
    # listings, each scored 0, ended COMPLETED and its user read it as a success.
    info = operations.status(_store(settings, existing=True), case_id)
    figures = info["evidence"]
    if as_json:
        _print_json({"case_id": case_id, "outcome": outcome.to_dict(),
                     "evidence": figures, "model_usage": info["model_usage"],
                     "steps": [o.to_dict() for o in steps or []],
                     "summary_path": str(summary_path) if summary_path else None,
                     "report_path": str(report.resolve()) if report else None,
                     "next": g.to_dict()})
    else:
        out.print(f"case {case_id}: {outcome_head(outcome)}", highlight=False)
        if figures["records"]:
            out.print(evidence_text(figures), highlight=False)
        if usage := _usage_line(info, _currency(settings)):
            out.print(usage, highlight=False)
        if summary_path is not None:
            out.print(f"summary: {summary_path}", highlight=False, soft_wrap=True)
        if report is not None:
            out.print(f"report: {report.resolve()} (open it in a browser)", highlight=False,
                      soft_wrap=True)
        print_guidance(out, g)
    if code := outcome_exit(outcome):
        raise typer.Exit(code)


def _usage_line(info: dict[str, Any], currency: str) -> str:
    """``model usage: 12 call(s), 13 attempt(s), tokens 36210 + 790, cost 0.009527 USD``:
    the case's whole model usage as ``status`` totals it, or ``""`` before any call (a
    real model's user found the cost only in ``status`` and the report)."""
    from investigation.llm.spend import cost_text, priced_total, token_cells

    usage = info["model_usage"].get("hypotheses") or []
    if not usage:
        return ""
    prompt, completion = token_cells(usage)
    tokens = prompt if prompt == completion == "not reported" else f"{prompt} + {completion}"
    return (f"model usage: {sum(u['calls'] for u in usage)} call(s), "
            f"{sum(u['attempts'] for u in usage)} attempt(s), tokens {tokens}, cost "
            + cost_text(priced_total(usage), info["model_usage"].get("currency") or currency))


def _scripted_file(providers: Path | None) -> str | None:
    """The reply file of the first scripted provider in ``providers``
    (:func:`investigation.guidance.scripted_file`)."""
    from investigation import guidance

    return guidance.scripted_file(providers)


def _grace_text(providers: Path | None) -> str:
    """How long the in-flight grace lasts for the model servers of ``providers``, as the
    gateway sets it (twice the longest ``timeout_s``, and 5 s), or ``""`` when the file
    names none or cannot be read: a real model's user was told of a grace, not of its ten
    minutes."""
    from investigation.config import ProvidersConfig
    from investigation.errors import InvestigationError
    from investigation.llm.gateway import default_in_flight_grace_s

    try:
        loaded = ProvidersConfig.load(providers) if providers is not None else None
    except (InvestigationError, OSError, ValueError):  # the run read it; said nothing more
        return ""
    timeouts = [p.timeout_s for p in (loaded.providers if loaded else []) if p.kind == "openai"]
    return f": {default_in_flight_grace_s(timeouts):g} s with these providers, twice the " \
        "longest timeout_s and 5 s" if timeouts else ""


@_controlled
def run(
    case_id: CaseArg,
    config: Annotated[Path | None, typer.Option(
        "--config", help="the investigation policy TOML (loop, budget, limits, tools); "
        "frozen by the case's first step. Default: INVESTIGATE_CONFIG or the built-in "
        "defaults (investigation.example.toml in config/ lists every key)")] = None,
    providers: Annotated[Path | None, typer.Option(
        "--providers", help="the providers TOML: model servers or scripted replies, tried "
        "in order (providers.example.toml in config/). Default: INVESTIGATE_PROVIDERS")] = None,
    max_steps: Annotated[int | None, typer.Option(
        "--max-steps", min=1, help="stop after this many steps (default: until the case is "
        "complete or blocked)")] = None,
    wait: Annotated[bool, typer.Option(
        help="wait out a provider backoff in this process; --no-wait exits with code 4 "
        "instead")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Investigate on the embedded runtime until a terminal or blocked outcome.

    On a terminal a live panel shows the step, whose turn it was, every account's
    balance, the model time and the tokens; piped output gets one line per step. A
    blocked case ends with exit code 1 and what to do next.
    """
    from workers.settings import remember_providers

    settings = _settings()
    # In a shell set up for a fleet, the fleet's case lock too: no worker dispatches the
    # case while this runs, nor this beside a dispatch (decision 158).
    try:
        outcome, steps = _run_embedded(settings, case_id, config, providers, max_steps,
                                       wait, quiet=as_json, fleet_lock=_fleet_shell(settings))
    except KeyboardInterrupt:
        # Typer ends an interrupted command with 130 and no word (a hostile trial's 120
        # interrupts); every stage is fenced and kept, so the run continues where it was.
        from investigation.guidance import shell_env

        again = f"{shell_env()}investigate run {shlex.quote(case_id)}" + (
            f" --providers {shlex.quote(str(providers))}" if providers else "")
        _fail("INTERRUPTED", f"interrupted (Ctrl-C): every stage it finished is kept; "
              f"`{again}` continues the case (a model call it interrupted is waited out "
              "first, up to the gateway's in-flight grace"
              f"{_grace_text(providers or settings.providers)})", exit_code=INTERRUPTED_EXIT)
    used = providers or settings.providers
    if used is not None:  # for the commands status and resume print later
        remember_providers(settings, case_id, used)
    _finish(settings, case_id, outcome, providers, steps, as_json)


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it is below it, else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path.resolve())


def _home_env(home: Path, shell_database: bool) -> str:
    """``INVESTIGATE_HOME=... `` for commands about a store the defaults do not open.

    When the shell sets ``INVESTIGATE_DATABASE_URL`` (``shell_database``: a fleet's
    database), the prefix clears it too: that URL would take precedence over the SQLite
    store in ``home``, and the printed command would read another store's case of the
    same id."""
    prefix = f"INVESTIGATE_HOME={shlex.quote(_shown(home))} "
    return prefix + ("INVESTIGATE_DATABASE_URL= " if shell_database else "")


@_controlled
def demo(as_json: JsonOpt = False) -> None:
    """The real demo case (sqlite-utils 3.35, a real bug), end to end, embedded runtime.

    Its store is $INVESTIGATE_HOME/demo/ (.investigate/demo/ by default; started afresh
    each time, with the export its printed command wrote there, so it is always
    migrated, whatever INVESTIGATE_AUTO_MIGRATE says);
    afterwards open its report with the `investigate report` command it prints.
    """
    from investigation.cases.reader import PackageReader
    from investigation.config import InvestigationConfig
    from workers import demo as demo_mod

    settings = _settings()
    work = settings.home / "demo"
    # Read as the settings read it (any letter case; empty is unset), before it is replaced.
    env = _home_env(work, shell_database=bool(settings.database_url))
    # The demo's store is its own, new each run: it is created at the current migration
    # even where a fleet's environment leaves migrations to `investigate db upgrade`.
    settings = settings.model_copy(update={
        "home": work, "database_url": f"sqlite:///{(work / 'investigation.db').resolve()}",
        "auto_migrate": True})
    work.mkdir(parents=True, exist_ok=True)
    for stale in ("investigation.db", "investigation.db-wal", "investigation.db-shm"):
        (work / stale).unlink(missing_ok=True)
    # The export its printed command wrote last time: that command must work again.
    shutil.rmtree(work / "export", ignore_errors=True)
    console = err if as_json else out

    def say(text: str) -> None:
        console.print(text, highlight=False)

    case = demo_mod.prepare_case(_store(settings), PackageReader(InvestigationConfig().package),
                                 work, announce=say)
    say(f"case {case.case_id} registered from {case.package_path}")
    with demo_mod.replay_server() as server:
        providers = work / "providers.toml"
        providers.write_text(demo_mod.providers_toml(server.base_url))
        say(f"model replies served by {server.base_url} (OpenAI-compatible, loopback)")
        outcome, steps = _run_embedded(settings, case.case_id, None, providers, None, True,
                                       quiet=as_json)
    report = None
    if outcome.outcome == COMPLETED:
        from investigation.report import write_report

        report = work / "report.html"
        write_report(_store(settings, existing=True), case.case_id, report, env)
    _finish(settings, case.case_id, outcome, providers, steps, as_json, env,
            report, out_dir=work)
    hint = _activate_hint()
    if hint and not as_json:
        say(hint)
    if outcome.outcome != COMPLETED:
        raise typer.Exit(1)


def _activate_hint() -> str | None:
    """How to reach ``investigate`` when this shell's PATH does not (``make demo`` runs
    it from the virtual environment, which the user's shell has not activated)."""
    command = Path(sys.executable).with_name("investigate")
    found = shutil.which("investigate")
    if not command.exists() or (found and Path(found).resolve() == command.resolve()):
        return None
    try:
        shown = command.relative_to(Path.cwd())
    except ValueError:
        shown = command
    return (f"The commands above need `investigate` on PATH: run `. {shown.parent}/activate` "
            f"first, or call it as {shown}.")


def register(app: typer.Typer) -> None:
    """Add ``run`` and ``demo`` to the main app."""
    app.command("run", epilog=example(
        f"investigate run {EXAMPLE_CASE} --providers providers.toml",
        f"investigate run {EXAMPLE_CASE} --providers providers.toml --config policy.toml "
        "--max-steps 5 --no-wait"))(run)
    app.command("demo", epilog=example("investigate demo"))(demo)
