"""The ``investigate`` command (DESIGN.md "Fixed interfaces": command line).

Exit codes: 0 success; 1 the investigation ended blocked; 2 a controlled error
(``error CODE: message`` on stderr); 3 ``LockBusy``; 4 ``run --no-wait`` stopped at a
provider backoff (``RETRY_PENDING``: run again after the printed time).
"""

from __future__ import annotations

import json
import logging
import shutil
import sqlite3
import sys
from collections.abc import Callable
from contextlib import closing
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from kombu.exceptions import OperationalError as KombuOperationalError
from redis.exceptions import RedisError
from rich.console import Console
from rich.table import Table
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from investigation.cases.builder import build_package
from investigation.cases.reader import PackageReader
from investigation.cases.registry import load_hypotheses, load_interpretation, register_case
from investigation.config import InvestigationConfig
from investigation.constants import BLOCKED, COMPLETED, RETRY_PENDING
from investigation.errors import InvestigationError, LockBusy
from investigation.loop.outcome import Outcome
from investigation.operations import (
    cancel,
    export,
    pause,
    resume,
    status,
    summary_bytes,
    verify,
)
from investigation.store import Store
from workers.settings import Settings, load_settings

app = typer.Typer(help="Investigate software bug cases with a language model.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
case_app = typer.Typer(help="Build and register case packages.", no_args_is_help=True)
app.add_typer(case_app, name="case")
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True)

F = TypeVar("F", bound=Callable[..., Any])


def _controlled(fn: F) -> F:
    """Turn controlled errors into one stderr line and a stable exit code."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except LockBusy as exc:
            err.print("[bold red]error[/] ", end="", markup=True)
            err.print(str(exc), markup=False, highlight=False)
            raise typer.Exit(3) from None
        except InvestigationError as exc:
            _fail(exc.code, exc.message)
        except SQLAlchemyError as exc:
            _fail("STORE_UNAVAILABLE", f"the store cannot be used: {_first_line(exc)}; check "
                  "INVESTIGATE_DATABASE_URL / INVESTIGATE_HOME")
        except RedisError as exc:
            _fail("REDIS_UNAVAILABLE", f"Redis cannot be reached for the case lock: "
                  f"{_first_line(exc)}; check INVESTIGATE_REDIS_URL / INVESTIGATE_BROKER_URL")
        except KombuOperationalError as exc:
            _fail("BROKER_UNAVAILABLE", f"the broker cannot be reached: {_first_line(exc)}; "
                  "check INVESTIGATE_BROKER_URL")
        except OSError as exc:
            _fail("IO_ERROR", f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
        except UnicodeError as exc:  # an argument or file that is not text
            _fail("INPUT_INVALID", f"an argument or input file is not valid text: "
                  f"{_first_line(exc)}")
        except (ImportError, ValueError) as exc:  # a URL or setting nothing can use
            _fail("CONFIG_INVALID", f"{type(exc).__name__}: {_first_line(exc)}; check the "
                  "INVESTIGATE_* settings")

    return wrapper  # type: ignore[return-value]


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:300]


def _fail(code: str, message: str) -> NoReturn:
    err.print("[bold red]error[/] ", end="", markup=True)
    err.print(f"{code}: {message}", markup=False, highlight=False)
    raise typer.Exit(2)


def _settings() -> Settings:
    try:
        return load_settings()
    except InvestigationError:
        raise
    except Exception as exc:
        raise InvestigationError("CONFIG_INVALID",
                                 f"bad INVESTIGATE_* setting: {_first_line(exc)}") from None


def _store(settings: Settings, existing: bool = False) -> Store:
    """Open the store. With ``existing`` (commands that read or act on registered cases)
    the database must already be an investigation store at this engine's migration head:
    nothing is created or migrated, and a foreign database is never written."""
    url = settings.effective_database_url
    not_a_store = InvestigationError(
        "STORE_NOT_FOUND",
        f"{url.split('@')[-1]} is not an investigation store (no case was ever added "
        "there); nothing was changed. Run where the case was added, or set "
        "INVESTIGATE_HOME or INVESTIGATE_DATABASE_URL")
    is_sqlite = make_url(url).get_backend_name() == "sqlite"
    if existing and is_sqlite:
        path = Path(make_url(url).database or "")
        if not path.is_file():
            raise not_a_store
        try:  # a plain read-only look (the store engine would switch the file to WAL); a
            # WAL database may get SQLite's -shm index beside it, its content is untouched
            with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as look:
                versions = [r[0] for r in look.execute("SELECT version_num FROM alembic_version")]
        except sqlite3.Error:
            raise not_a_store from None
    store = Store(url)
    if existing and not is_sqlite:
        from sqlalchemy import text
        from sqlalchemy.exc import ProgrammingError

        try:
            with store.engine.connect() as conn:
                versions = [r[0] for r in conn.execute(
                    text("SELECT version_num FROM alembic_version"))]
        except ProgrammingError:
            raise not_a_store from None
    if existing:
        from investigation.store.migrate import head_revision

        if versions != [head_revision()]:
            raise not_a_store
        return store
    store.create_schema()
    return store


def _term(text: object) -> str:
    """Data for the terminal: control characters (ANSI/OSC escapes included) shown as '?'."""
    return "".join("?" if (ord(ch) < 0x20 and ch != "\t") or 0x7F <= ord(ch) <= 0x9F
                   else ch for ch in str(text))


def _print_outcome(o: Outcome) -> None:
    extra = f" until {o.retry_not_before.isoformat()}" if o.retry_not_before else ""
    hyp = f" H{o.hypothesis_id}" if o.hypothesis_id is not None else ""
    out.print(f"step {o.step_seq:>3}{hyp}: {o.outcome}"
              + (f" ({o.reason})" if o.reason else "") + extra, highlight=False)
    detail = o.details.get("rejection") or o.details.get("error_code")
    if detail:
        out.print(_term(f"         {detail}: {o.details.get('message', '')}".rstrip(": ")),
                  highlight=False, markup=False)


# -- case ----------------------------------------------------------------------------------


@case_app.command("build")
@_controlled
def case_build(
    source: Annotated[Path, typer.Option("--source", help="directory or git checkout")],
    report: Annotated[Path, typer.Option("--report", help="bug report file")],
    output: Annotated[Path, typer.Option("-o", "--output", help="package ZIP to write")],
    db: Annotated[Path | None, typer.Option("--db", help="SQLite database")] = None,
    logs: Annotated[Path | None, typer.Option("--logs", help="logs directory")] = None,
) -> None:
    """Make a case package (ZIP with manifest) from a source tree and a report."""
    info = build_package(source, report, output, db=db, logs=logs)
    out.print(f"package {info.package_id}")
    out.print(f"wrote {info.path} ({info.size_bytes} bytes, {info.file_count} files)")


@case_app.command("add")
@_controlled
def case_add(
    package: Annotated[Path, typer.Argument(help="package ZIP")],
    interpretation: Annotated[Path, typer.Option("--interpretation")],
    hypotheses: Annotated[Path, typer.Option("--hypotheses")],
    config: Annotated[Path | None, typer.Option("--config")] = None,
) -> None:
    """Register a case (revision 1); prints its id."""
    settings = _settings()
    cfg = InvestigationConfig.load(config)
    try:
        size = package.stat().st_size
        if not package.is_file() or size > cfg.package.max_total_bytes:
            raise InvestigationError(
                "PKG_TOO_LARGE" if package.is_file() else "PKG_UNREADABLE",
                f"{package} is not a regular file of at most {cfg.package.max_total_bytes} "
                "bytes (package.max_total_bytes)")
        data = package.read_bytes()
    except OSError as exc:
        raise InvestigationError("PKG_UNREADABLE", f"cannot read {package}: {exc}") from exc
    case_id = register_case(_store(settings), data, load_interpretation(interpretation),
                            load_hypotheses(hypotheses), PackageReader(cfg.package))
    out.print(case_id)


# -- investigate ---------------------------------------------------------------------------


def _run_embedded(settings: Settings, case_id: str, config: Path | None,
                  providers: Path | None, max_steps: int | None, wait: bool) -> Outcome:
    from workers import runtime
    from workers.embedded import run_case

    _store(settings, existing=True)
    rt = runtime.embedded(settings, config, providers)
    return run_case(rt, case_id, max_steps=max_steps, wait=wait, on_step=_print_outcome)


def _finish(settings: Settings, case_id: str, outcome: Outcome) -> None:
    out.print(f"case {case_id}: {outcome.outcome}"
              + (f" ({outcome.reason})" if outcome.reason else ""), highlight=False)
    if outcome.outcome == COMPLETED:
        target = settings.home / "exports" / case_id
        shutil.rmtree(target, ignore_errors=True)
        export(_store(settings), case_id, target)
        path = (target / "analysis" / "investigation" / "summary.md").resolve()
        out.print(f"summary: {path}", highlight=False, soft_wrap=True)
    elif outcome.outcome == BLOCKED:
        raise typer.Exit(1)
    elif outcome.outcome == RETRY_PENDING:
        raise typer.Exit(4)


@app.command("run")
@_controlled
def run(
    case_id: Annotated[str, typer.Argument(metavar="CASE")],
    config: Annotated[Path | None, typer.Option("--config", help="policy TOML")] = None,
    providers: Annotated[Path | None, typer.Option("--providers", help="providers TOML")] = None,
    max_steps: Annotated[int | None, typer.Option("--max-steps", min=1)] = None,
    wait: Annotated[bool, typer.Option(help="wait out provider backoff in this process")] = True,
) -> None:
    """Investigate on the embedded runtime until a terminal or blocked outcome."""
    settings = _settings()
    outcome = _run_embedded(settings, case_id, config, providers, max_steps, wait)
    _finish(settings, case_id, outcome)


@app.command("dispatch")
@_controlled
def dispatch_cmd(
    case_id: Annotated[str, typer.Argument(metavar="CASE")],
    max_steps: Annotated[int | None, typer.Option("--max-steps", min=1)] = None,
) -> None:
    """Enqueue a dispatch for the distributed workers (takes the case lock, never waits)."""
    from workers import runtime
    from workers.tasks import start_dispatch

    settings = _settings()
    _store(settings, existing=True)
    runtime.configure(runtime.distributed(settings))
    token = start_dispatch(case_id, max_steps)
    if isinstance(token, Outcome):
        out.print(f"case {case_id}: {token.outcome}"
                  + (f" ({token.reason})" if token.reason else "")
                  + "; nothing to dispatch", highlight=False)
        if token.outcome == BLOCKED:
            raise typer.Exit(1)
        return
    out.print(f"dispatched {case_id} (lock token {token[:8]}...)", highlight=False)


@app.command("worker")
@_controlled
def worker(
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", min=1)] = 2,
    loglevel: Annotated[str, typer.Option("--loglevel")] = "INFO",
    pool: Annotated[str, typer.Option("--pool", help="prefork or solo")] = "prefork",
    beat: Annotated[bool, typer.Option(
        "--beat", help="also run the periodic recovery sweep (start exactly one such worker)")
    ] = False,
) -> None:
    """Start a Celery worker on the configured broker and case queue.

    Only process-based pools: the isolated SQL children are forked, which needs no other
    thread of the worker process to be inside SQLite (threads/gevent pools are refused).
    """
    if pool not in ("prefork", "solo"):
        raise typer.BadParameter("use --pool prefork or --pool solo", param_hint="--pool")
    settings = _settings()  # a broken environment fails here, as one line
    from workers.celery_app import app as celery_app

    argv = ["worker", f"--loglevel={loglevel}", f"--concurrency={concurrency}",
            f"--pool={pool}", "-Q", settings.queue, "-E"]
    if beat:
        settings.home.mkdir(parents=True, exist_ok=True)
        argv += ["-B", f"--schedule={settings.home / 'celerybeat-schedule'}"]
    celery_app.worker_main(argv)


@app.command("recover")
@_controlled
def recover_cmd(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Re-dispatch every case whose stored state shows pending work (after Redis lost
    its data, or a dispatch was lost); cases whose dispatch is alive are left alone.

    Exit 0 when every pending case was dispatched or is busy; 2 when a case could not be
    dispatched (its code is printed).
    """
    from workers import runtime
    from workers.recovery import sweep

    settings = _settings()
    _store(settings, existing=True)
    runtime.configure(runtime.distributed(settings))
    report = sweep(runtime.current())
    if as_json:
        sys.stdout.write(json.dumps(report.to_dict(), indent=2, sort_keys=True) + "\n")
    else:
        for name in report.expired_tests:
            out.print(f"expired test {name} (deadline passed; recorded without feedback)",
                      highlight=False)
        for case_id in report.dispatched:
            out.print(f"dispatched {case_id}", highlight=False)
        for case_id in report.busy:
            out.print(f"busy {case_id} (a dispatch holds its lock)", highlight=False)
        for case_id in report.idle:
            out.print(f"idle {case_id} (nothing to run)", highlight=False)
        for case_id, code in report.failed.items():
            out.print(f"failed {case_id}: {code}", highlight=False)
        out.print(f"recovered {len(report.dispatched)} case(s); {len(report.busy)} busy, "
                  f"{report.not_due} waiting for a provider backoff", highlight=False)
    if report.failed:
        raise typer.Exit(2)


@app.command("flower")
@_controlled
def flower(
    port: Annotated[int, typer.Option("--port")] = 5555,
    address: Annotated[str, typer.Option("--address")] = "127.0.0.1",
) -> None:
    """Start Flower (Celery's monitor) on the configured broker."""
    _settings()  # a broken environment fails here, as one line
    from workers.celery_app import app as celery_app

    celery_app.start(["flower", f"--port={port}", f"--address={address}"])


# -- operator ------------------------------------------------------------------------------


@app.command("status")
@_controlled
def status_cmd(
    case_id: Annotated[str, typer.Argument(metavar="CASE")],
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """State, outcome, blocked reason, balances, evidence count."""
    info = status(_store(_settings(), existing=True), case_id)
    if as_json:
        sys.stdout.write(json.dumps(info, indent=2, sort_keys=True) + "\n")
        return
    out.print(f"case {info['case_id']}  state {info['state']}"
              + (f" ({info['blocked_reason']})" if info["blocked_reason"] else "")
              + f"  published steps {info['steps']}  evidence {info['evidence_count']}"
              + f"  open questions {info['open_questions']}", highlight=False)
    if info["last_outcome"]:
        out.print(f"last outcome {info['last_outcome']}"
                  + (f" ({info['last_reason']})" if info["last_reason"] else "")
                  + (f"  retry not before {info['retry_not_before']}"
                     if info.get("retry_not_before") else ""), highlight=False)
    if info["blocked_detail"]:
        out.print(_term(f"why: {info['blocked_detail']}"), highlight=False, markup=False)
    life = info["lifecycle"]
    out.print(f"lifecycle {life['state']}"
              + (f" (paused from {life['paused_from']})" if life.get("paused_from") else "")
              + (f" ({life['termination_reason']})" if life.get("termination_reason") else "")
              + (f"  iterations {life['iterations']}" if life.get("started") else
                 "  (the session starts with the first step)"), highlight=False)
    if not info["accounts"]:
        out.print(f"{info['hypotheses']} hypotheses; no step has run yet", highlight=False)
        return
    table = Table("hypothesis", "status", "confidence", "balance", "iterations", "pending",
                  "last rejection")
    for a in info["accounts"]:
        rej = a["last_rejection"]
        label = a["status"]
        if a["deferred_by"] is not None and label == "active":
            label += f" (assessment-only, deferred by H{a['deferred_by']})"
        table.add_row(str(a["hypothesis_id"]), label, a["confidence"],
                      f"{a['balance_units']}/{a['credit_units']}", str(a["iterations"]),
                      a["pending_evidence_id"] or "",
                      f"{rej['code']} (step {rej['step_seq']}, {a['invalid_streak']} in a row)"
                      if rej else "")
    out.print(table)
    for a in info["accounts"]:
        if a["last_rejection"]:
            out.print(_term(f"H{a['hypothesis_id']} last rejection: "
                            f"{a['last_rejection']['code']}: {a['last_rejection']['detail']}"),
                      highlight=False, markup=False)


@app.command("resume")
@_controlled
def resume_cmd(
    case_id: Annotated[str, typer.Argument(metavar="CASE")],
    retry_id: Annotated[str | None, typer.Option("--retry-id")] = None,
) -> None:
    """Operator resume of a paused or blocked case (then `run` or `dispatch` it)."""
    info = resume(_store(_settings(), existing=True), case_id, retry_id)
    out.print(f"resumed {case_id} (was {info['resumed_from']})"
              + (f"; now {info['state']}" if info.get("state") else ""), highlight=False)


@app.command("pause")
@_controlled
def pause_cmd(case_id: Annotated[str, typer.Argument(metavar="CASE")]) -> None:
    """Pause a case at its next stage boundary (`resume` continues exactly there)."""
    info = pause(_store(_settings(), existing=True), case_id)
    out.print(f"paused {case_id} (was {info['paused_from']}); a running stage finishes, "
              "no new one starts", highlight=False)


@app.command("cancel")
@_controlled
def cancel_cmd(case_id: Annotated[str, typer.Argument(metavar="CASE")]) -> None:
    """Cancel a case for good at its next stage boundary (finished stages are kept)."""
    info = cancel(_store(_settings(), existing=True), case_id)
    out.print(f"cancelled {case_id} (was {info['cancelled_from']})", highlight=False)


@app.command("summary")
@_controlled
def summary_cmd(case_id: Annotated[str, typer.Argument(metavar="CASE")]) -> None:
    """Print summary.md."""
    sys.stdout.buffer.write(summary_bytes(_store(_settings(), existing=True), case_id))
    sys.stdout.flush()


@app.command("export")
@_controlled
def export_cmd(
    case_id: Annotated[str, typer.Argument(metavar="CASE")],
    directory: Annotated[Path, typer.Argument(metavar="DIR")],
) -> None:
    """Write the case's artifact tree byte for byte."""
    paths = export(_store(_settings(), existing=True), case_id, directory)
    out.print(f"wrote {len(paths)} artifacts under {directory}", highlight=False)


@app.command("verify")
@_controlled
def verify_cmd(
    case_id: Annotated[str, typer.Argument(metavar="CASE")],
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Check the whole case from the store's bytes: full checkpoint replay, live rows,
    every artifact against its sha256 (exit 0 intact, 2 with the first difference)."""
    report = verify(_store(_settings(), existing=True), case_id)
    if as_json:
        out.print_json(json.dumps(report))
        return
    out.print(f"{case_id}: intact: {report['checkpoints']} checkpoints replayed from their "
              f"bytes, {report['artifacts']} artifacts ({report['artifact_bytes']} bytes) "
              f"match their sha256, live rows {report['live_rows']}", highlight=False)


@app.command("demo")
@_controlled
def demo() -> None:
    """The real demo case (sqlite-utils 3.35, a real bug), end to end, embedded runtime."""
    from workers import demo as demo_mod

    settings = _settings()
    work = settings.home / "demo"
    settings = settings.model_copy(update={
        "home": work, "database_url": f"sqlite:///{(work / 'investigation.db').resolve()}"})
    work.mkdir(parents=True, exist_ok=True)
    for stale in ("investigation.db", "investigation.db-wal", "investigation.db-shm"):
        (work / stale).unlink(missing_ok=True)
    case = demo_mod.prepare_case(_store(settings), PackageReader(InvestigationConfig().package),
                                 work, announce=lambda text: out.print(text, highlight=False))
    out.print(f"case {case.case_id} registered from {case.package_path}", highlight=False)
    with demo_mod.replay_server() as server:
        providers = work / "providers.toml"
        providers.write_text(demo_mod.providers_toml(server.base_url))
        out.print(f"model replies served by {server.base_url} (OpenAI-compatible, loopback)",
                  highlight=False)
        outcome = _run_embedded(settings, case.case_id, None, providers, None, True)
    _finish(settings, case.case_id, outcome)
    if outcome.outcome != COMPLETED:
        raise typer.Exit(1)


from workers import cli_tests  # noqa: E402  (its commands use the helpers above)

app.add_typer(cli_tests.tests_app, name="tests")
app.add_typer(cli_tests.feedback_app, name="feedback")


def main() -> None:
    """Console entry point."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()
