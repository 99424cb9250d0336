"""The ``investigate`` command (DESIGN.md "Fixed interfaces": command line).

Exit codes: 0 success; 1 the investigation ended blocked; 2 a controlled error
(``error CODE: message`` on stderr); 3 ``LockBusy``; 4 ``run --no-wait`` stopped at a
provider backoff (``RETRY_PENDING``: run again after the printed time); 5 an unexpected
exception, a bug (``INTERNAL_ERROR`` after its traceback).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import shlex
import sys
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar, cast

import typer
from rich.console import Console

from investigation.constants import CASE_BLOCKED, CASE_INVESTIGATING, CASE_PAUSED
from investigation.errors import InvestigationError, LockBusy
from investigation.text_safety import escape_text
from workers.views import (
    counted,
    outcome_exit,
    outcome_head,
    outcome_line,
    print_guidance,
    status_view,
    term,
)

if TYPE_CHECKING:
    from investigation import guidance
    from investigation.loop.outcome import Outcome
    from investigation.store import Store
    from workers.settings import Settings

# What a command needs is imported in its body: `investigate --help`, `--version` and every
# shell completion import only Typer, Rich and the modules above (the whole command tree
# took 1.4-2.3 s to import on a slow machine, at every TAB; tests/unit/test_startup_imports).

#: A case id as the examples show it.
EXAMPLE_CASE = "case-30bce92d9fa25a72"


def example(*commands: str) -> str:
    """The ``Example:`` epilog of a command (the help walker test requires one)."""
    return "Example:\n\n" + "\n\n".join(f"  $ {c}" for c in commands)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            number = version("investigation-engine")
        except PackageNotFoundError:  # a source tree that was not installed
            number = "unknown (not installed)"
        typer.echo(f"investigate {number}")
        raise typer.Exit()


app = typer.Typer(help="Investigate software bug cases with a language model.",
                  no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False,
                  epilog=example("investigate demo",
                                 f"investigate status {EXAMPLE_CASE}",
                                 "investigate --install-completion"))


@app.callback()
def _main(
    show_version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True,
        help="Print the installed version and exit.")] = False,
) -> None:
    """Investigate software bug cases with a language model.

    Start with `investigate demo`; `investigate COMMAND --help` shows each command's
    options and an example.
    """


case_app = typer.Typer(help="Build and register case packages.", no_args_is_help=True,
                       epilog=example("investigate case build --source ~/src/shop "
                                      "--report report.md -o case.zip",
                                      "investigate case add case.zip --interpretation "
                                      "interpretation.json --hypotheses hypotheses.json"))
app.add_typer(case_app, name="case")
#: Exit code when the reader of the output went away (``investigate steps CASE | head``):
#: 128 + SIGPIPE, as a tool the signal ends exits; never 1, which says "blocked" (Rich's
#: own exit, a hostile trial).
PIPE_CLOSED_EXIT = 141


def _pipe_closed() -> NoReturn:
    """End the command quietly with :data:`PIPE_CLOSED_EXIT`, stdout pointed at the null
    device so that nothing more is written to the closed pipe at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor (a test's captured stdout)
        pass
    raise SystemExit(PIPE_CLOSED_EXIT)


class _Console(Console):
    """Rich's console, but a closed pipe ends the command with :data:`PIPE_CLOSED_EXIT`."""

    def on_broken_pipe(self) -> None:
        _pipe_closed()


# No emoji codes: data printed with markup off still had ":skull:" and ":lock:" (in a
# Redis key name) turned into pictures (a hostile-input trial).
out = _Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160, emoji=False)
err = _Console(stderr=True, soft_wrap=True, emoji=False)

#: Help of every ``CASE`` argument and ``--json`` option.
CASE_HELP = "the case id that `investigate case add` printed, e.g. " + EXAMPLE_CASE
JSON_HELP = "print the result as one JSON object on stdout instead of text"
#: Longest text a ``CASE`` argument may be: every case id is ``case-`` and 16 hex digits.
CASE_ARG_MAX = 64


def _case_arg(value: str) -> str:
    """Refuse a ``CASE`` argument no case id can be, before any store is opened: a hostile
    trial's 100,000-character id came back whole in ``CASE_NOT_FOUND``."""
    if len(value) > CASE_ARG_MAX:
        raise typer.BadParameter(
            f"is {len(value)} characters long, no case id: ids are 'case-' and 16 hex "
            "digits (`investigate cases` lists them)")
    return value


def _complete_case(incomplete: str) -> list[str]:
    """A shell's completion of a ``CASE`` argument: the ids of the store the settings name
    that start with what was typed, newest first; none when the store cannot be read (a
    completion never prints an error)."""
    try:
        from investigation.overview import case_ids

        settings = _settings()
        store = _store(settings, existing=True)
        try:
            return case_ids(store, incomplete)
        finally:
            store.dispose()
    except Exception:  # whatever fails, the shell just offers nothing
        return []


CaseArg = Annotated[str, typer.Argument(metavar="CASE", help=CASE_HELP, callback=_case_arg,
                                        autocompletion=_complete_case)]
JsonOpt = Annotated[bool, typer.Option("--json", help=JSON_HELP)]
#: ``--json`` of a command that lists (``cases``, ``tests list``): said as what it prints
#: (a 500-step reader parsed ``cases --json`` as the one object the help promised).
JsonListOpt = Annotated[bool, typer.Option(
    "--json", help="print the result as one JSON array (one object per row) on stdout "
    "instead of text")]


def _print_json(data: Any, one_line: bool = False) -> None:
    """``data`` as JSON on stdout: indented, or ``one_line`` (a JSON Lines stream)."""
    sys.stdout.write(json.dumps(data, indent=None if one_line else 2, sort_keys=True) + "\n")
    sys.stdout.flush()


F = TypeVar("F", bound=Callable[..., Any])


#: Exit code of an unexpected exception (a bug of the engine), distinct from 1 (blocked)
#: and 2 (a controlled error).
INTERNAL_ERROR_EXIT = 5
#: Exit code of a command the user interrupted (Ctrl-C), as a shell reports SIGINT.
INTERRUPTED_EXIT = 130

#: Whether the running command was given ``--json``: its controlled errors are then also
#: one JSON object on stdout (:func:`_fail`).
_JSON_ERRORS: ContextVar[bool] = ContextVar("json_errors", default=False)
#: Whether the running command writes JSON Lines (``status --watch --json``): its error
#: object is one line too (a pretty-printed error broke the stream, a hostile-input trial).
_JSON_LINES: ContextVar[bool] = ContextVar("json_lines", default=False)


def _controlled(fn: F) -> F:
    """Turn controlled errors into one stderr line and a stable exit code; with ``--json``
    also ``{"error": {"code": ..., "message": ...}}`` on stdout (:func:`_fail`)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        reset = _JSON_ERRORS.set(bool(kwargs.get("as_json")))
        # ``status --watch --json`` writes JSON Lines: its errors are one line too.
        lines = _JSON_LINES.set(bool(kwargs.get("as_json") and kwargs.get("watch")))
        try:
            return _run_controlled(fn, args, kwargs)
        finally:
            _JSON_LINES.reset(lines)
            _JSON_ERRORS.reset(reset)

    return wrapper  # type: ignore[return-value]


#: The log format :func:`_setup_logging` set up (``text`` until it runs).
_log_format = "text"
#: Whether the command running is a long-running service (worker, beat, Flower, the
#: metrics exporter: :func:`_service`), whose error at start is a log line of its format.
_SERVICE: ContextVar[bool] = ContextVar("investigate_service", default=False)


def _service(fn: F) -> F:
    """Mark a command (wrapped by :func:`_controlled`, below this) as a long-running
    service: with INVESTIGATE_LOG_FORMAT=json the error that stops it at start is a JSON
    log line, as everything else it writes to stderr (a worker that could not reach its
    lock Redis wrote the one plain line of its output, a hostile trial)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        token = _SERVICE.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _SERVICE.reset(token)

    return wrapper  # type: ignore[return-value]


def _loaded(module: str, name: str) -> type[BaseException]:
    """The exception class ``module.name`` if that module was imported, else a class no
    exception is an instance of: an error of a library this process never imported cannot
    have been raised (the CLI imports the store, Redis and kombu only in the commands that
    use them)."""
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else _NeverRaised


class _NeverRaised(BaseException):
    """Stands for the exception class of a library that was not imported (:func:`_loaded`)."""


def _run_controlled(fn: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
    try:
        _setup_logging()
        return fn(*args, **kwargs)
    except LockBusy as exc:
        _fail(LockBusy.code, str(exc).removeprefix(f"{LockBusy.code}: "), exit_code=3,
              extra={"lease_s": exc.expires_in_s})
    except InvestigationError as exc:
        _fail(exc.code, exc.message + (_where_cases_are() if exc.code == "CASE_NOT_FOUND"
                                       else ""))
    except Exception as exc:
        _fail_on_library_error(exc)
        raise


def _fail_on_library_error(exc: Exception) -> None:
    """Turn an error of the store, Redis, the broker, a file or an input into a controlled
    error (:func:`_fail`); return for anything else (a bug: :func:`_invoke` reports it)."""
    if isinstance(exc, _loaded("sqlalchemy.exc", "SQLAlchemyError")):
        _fail("STORE_UNAVAILABLE", f"the store cannot be used: {_first_line(exc)}; if "
              "the database server is up, check INVESTIGATE_DATABASE_URL / "
              "INVESTIGATE_HOME")
    if isinstance(exc, _loaded("redis.exceptions", "ResponseError")):
        # Redis answered: a key of the wrong type, say.
        _fail("REDIS_KEY_INVALID", f"Redis refused an operation on a case lock key: "
              f"{_first_line(exc)}; a key under investigation:lock: holds another type "
              "(set by hand?): delete it with redis-cli DEL")
    if isinstance(exc, _loaded("redis.exceptions", "RedisError")):
        _fail("REDIS_UNAVAILABLE", f"Redis cannot be reached for the case lock: "
              f"{_first_line(exc)}; check INVESTIGATE_REDIS_URL / INVESTIGATE_BROKER_URL")
    if isinstance(exc, _loaded("kombu.exceptions", "OperationalError")):
        _fail("BROKER_UNAVAILABLE", f"the broker cannot be reached: {_first_line(exc)}; "
              "check INVESTIGATE_BROKER_URL")
    if isinstance(exc, BrokenPipeError):  # JSON written to a reader that went away
        _pipe_closed()
    if isinstance(exc, OSError):
        _fail("IO_ERROR", f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
    if isinstance(exc, UnicodeError):  # an argument or file that is not text
        _fail("INPUT_INVALID", f"an argument or input file is not valid text: "
              f"{_first_line(exc)}")
    if isinstance(exc, ImportError):  # an install without a module a dependency needs
        _fail("DEPENDENCY_MISSING", _missing_module(exc))
    if isinstance(exc, ValueError) and not _raised_by_the_engine(exc):
        # A library refusing a URL or setting nothing can use. The engine's own ValueError
        # is a bug, reported as one (a hostile trial's manifest number escaped as one and
        # was shown as a settings problem).
        _fail("CONFIG_INVALID", f"{type(exc).__name__}: {_first_line(exc)}; check the "
              "INVESTIGATE_* settings")


def _raised_by_the_engine(exc: BaseException) -> bool:
    """Whether ``exc`` was raised in the engine's own code (``investigation``, ``workers``),
    not in a library it called: the innermost frame of its traceback says where."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    where = Path(tb.tb_frame.f_code.co_filename).resolve()
    return any(where.is_relative_to(root) for root in _ENGINE_ROOTS)


#: The engine's package folders (:func:`_raised_by_the_engine`).
_ENGINE_ROOTS = (Path(sys.modules["investigation"].__file__ or "").resolve().parent,
                 Path(__file__).resolve().parent)


def _missing_module(exc: ImportError) -> str:
    """Name the missing module and who needed it; the fix is an install, not a setting."""
    needed_by = ""
    tb = exc.__traceback__
    while tb is not None:  # the innermost frame that is not importlib's own
        module = tb.tb_frame.f_globals.get("__name__", "")
        if module and not module.startswith(("importlib", "_frozen_importlib")):
            needed_by = module
        tb = tb.tb_next
    name = (exc.name or _first_line(exc)).split(".")[0]
    return (f"the Python module {name!r} is not installed"
            + (f" (imported by {needed_by})" if needed_by else "")
            + "; install the engine with its runtime dependencies (pip install "
            "investigation-engine, or pip install . in a checkout; the broker needs "
            "celery[redis])")


#: Other cases of the same package that ``case add`` names before it counts the rest.
OTHER_CASES_SHOWN = 5


def _first_line(exc: BaseException) -> str:
    """The error's first line, at most 300 characters, without a closing full stop (the
    messages go on after it: redis-py's "Connection refused." read "refused.; check")."""
    line = (str(exc).splitlines() or [type(exc).__name__])[0][:300].rstrip()
    return line[:-1] if line.endswith(".") and not line.endswith("..") else line


def _fail(code: str, message: str, exit_code: int = 2,
          extra: dict[str, Any] | None = None) -> NoReturn:
    """Print the error (:func:`_print_error`, as JSON too for a command given ``--json``)
    and exit with ``exit_code``."""
    _print_error(code, message, exit_code, _JSON_ERRORS.get(), extra)
    raise typer.Exit(exit_code)


def _print_error(code: str, message: str, exit_code: int, as_json: bool,
                 extra: dict[str, Any] | None = None) -> None:
    """Print ``error CODE: message`` on stderr; with ``as_json`` also
    ``{"error": {"code", "message", "exit_code", **extra}}`` on stdout, so a caller that
    parses stdout gets the code without reading stderr. A service logging JSON
    (:func:`_service`) writes it as a JSON log line with ``code`` and ``exit_code``."""
    if _SERVICE.get() and _log_format == "json":
        from workers import logs

        logs.write_line("json", logging.ERROR, f"{code}: {message}", code=code,
                        exit_code=exit_code)
    else:
        err.print("[bold red]error[/] ", end="", markup=True)
        err.print(_term(f"{code}: {message}"), markup=False, highlight=False)
    if as_json:
        error = {"error": {"code": code, "message": message, "exit_code": exit_code,
                           **(extra or {})}}
        _print_json(error, one_line=_JSON_LINES.get())


def _settings() -> Settings:
    from workers.settings import load_settings

    try:
        return load_settings()
    except (InvestigationError, ImportError):  # ImportError: DEPENDENCY_MISSING, not a setting
        raise
    except Exception as exc:
        raise InvestigationError("CONFIG_INVALID",
                                 f"bad INVESTIGATE_* setting: {_first_line(exc)}") from None


def _where_cases_are() -> str:
    """What a ``CASE_NOT_FOUND`` adds: the store looked in, and how to see or choose one (a
    new user's trial ran a help example's case id against the default store)."""
    from workers.settings import load_settings

    try:
        settings = load_settings()
    except Exception:  # the command reported its settings already, or needs none
        return ""
    from investigation.text_safety import url_location

    where = url_location(settings.effective_database_url)
    return (f" in {where}; `investigate cases` lists the cases there, and INVESTIGATE_HOME or "
            f"INVESTIGATE_DATABASE_URL chooses another store{_demo_store_hint(settings)}")


def _demo_store_hint(settings: Settings) -> str:
    """A hint to the demo's own store, when it exists and is not the store in use."""
    demo = settings.home / "demo"
    # A database URL set (in any letter case; empty is unset) takes precedence over a home.
    if not (demo / "investigation.db").is_file() or settings.database_url:
        return ""
    try:
        shown = str(demo.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        shown = str(demo.resolve())
    return (f" (`investigate demo` keeps its case in its own store: prefix the command with "
            f"INVESTIGATE_HOME={shlex.quote(shown)})")


def _currency(settings: Settings) -> str:
    """The label of model costs: ``limits.currency`` of the policy file
    (``INVESTIGATE_CONFIG``), else the default.

    Raises:
        InvestigationError: the policy file is unreadable or invalid.
    """
    from investigation.config import InvestigationConfig

    return (InvestigationConfig.load(settings.config) if settings.config
            else InvestigationConfig()).limits.currency


def _store(settings: Settings, existing: bool = False) -> Store:
    """Open the store (``workers.stores.open_store``), its ``STORE_NOT_FOUND`` naming the
    demo's own store where there is one."""
    from workers.stores import open_store

    return open_store(settings, existing, _demo_store_hint(settings))


def _term(text: object) -> str:
    """Data for the terminal: control, bidirectional and zero-width characters (ANSI/OSC
    escapes included) shown as visible escapes (``investigation.text_safety``). Print the
    result with ``markup=False`` (or as a Rich ``Text``), so that Rich markup in untrusted
    text stays text."""
    return term(text)


def _print_outcome(o: Outcome) -> None:
    for line in outcome_line(o):
        out.print(line, highlight=False, markup=False)


# -- case ----------------------------------------------------------------------------------


@case_app.command("build", epilog=example(
    "investigate case build --source ~/src/shop --report report.md --db shop.sqlite "
    "--logs logs/ -o case.zip"))
@_controlled
def case_build(
    source: Annotated[str, typer.Option(
        "--source", metavar="DIR", help="the source tree: a directory; in a git checkout "
        "(or a folder of one) the files git lists (tracked and untracked; ignored ones and "
        ".git left out); paths in queries are relative to it")],
    report: Annotated[Path, typer.Option("--report", help="the bug report (a text file)")],
    output: Annotated[Path, typer.Option("-o", "--output", help="the package ZIP to write")],
    db: Annotated[Path | None, typer.Option(
        "--db", help="a SQLite database snapshot to pack (queried read-only)")] = None,
    logs: Annotated[str | None, typer.Option(
        "--logs", metavar="PATH", help="a directory of log files to pack (or one log "
        "file)")] = None,
    allow_secrets: Annotated[bool, typer.Option(
        "--allow-secrets", help="pack files in which the secret scan found secrets "
        "(tool results still mask them)")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Make a case package (a ZIP with its manifest) from a source tree and a report.

    The report, source and logs are scanned for secrets (detect-secrets); a finding
    refuses the build (PKG_SECRETS_FOUND, listing file:line: type) unless --allow-secrets.
    """
    from investigation.cases.builder import build_package

    # Read as text: an empty value would be Path(""), the working directory, which a
    # hostile trial's `--source ""` packed.
    for hint, given in (("--source", source), ("--logs", logs)):
        if given is not None and not given.strip():
            raise typer.BadParameter("is empty: name a directory (`.` for this one)",
                                     param_hint=hint)
    info = build_package(Path(source), report, output, db=db,
                         logs=Path(logs) if logs is not None else None,
                         allow_secrets=allow_secrets)
    for finding in info.secrets:
        err.print(_term(f"warning: packed a secret (--allow-secrets): {finding}"),
                  markup=False, highlight=False)
    if not info.source_files:
        # An empty folder, or a checkout git lists nothing of, packed silently (a trial).
        err.print(_term(f"warning: the source tree {source} gave no file to pack (empty, "
                        "or nothing git lists there): every source query of this case will "
                        "find nothing"), markup=False, highlight=False)
    if as_json:
        _print_json({"package_id": info.package_id, "path": str(info.path),
                     "size_bytes": info.size_bytes, "file_count": info.file_count,
                     "source_files": info.source_files,
                     "secrets_allowed": [str(f) for f in info.secrets]})
        return
    out.print(f"package {info.package_id}")
    out.print(f"wrote {info.path} ({info.size_bytes} bytes, {info.file_count} files)")


@case_app.command("add", epilog=example(
    "investigate case add case.zip --interpretation interpretation.json "
    "--hypotheses hypotheses.json",
    "investigate case add big.zip --interpretation i.json --hypotheses h.json "
    "--package-limits limits.toml"))
@_controlled
def case_add(
    package: Annotated[Path, typer.Argument(
        metavar="PACKAGE", help="the package ZIP `case build` wrote")],
    interpretation: Annotated[Path, typer.Option(
        "--interpretation", help='the accepted interpretation: a JSON object with at least '
        '"summary"')],
    hypotheses: Annotated[Path, typer.Option(
        "--hypotheses", help='the hypotheses: a JSON array of {"id": int, "statement": str}')],
    package_limits: Annotated[Path | None, typer.Option(
        "--package-limits", help="a TOML file whose package table sets the package limits "
        "(entries, sizes, compression ratio, name length) the package is validated "
        "against; only that table is read. The loop and budget policy is not set here: "
        "`run --config` sets it")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", hidden=True, help="deprecated name of --package-limits")] = None,
    paused: Annotated[bool, typer.Option(
        "--paused", help="register it paused: on a fleet's store the recovery sweep "
        "(beat) dispatches every investigating case by itself; a paused one waits for "
        "`investigate resume CASE`")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Register a case (revision 1); prints its id.

    A registered case is investigating: on a fleet's store the recovery sweep dispatches
    it within INVESTIGATE_SWEEP_INTERVAL_S unless it was added with `--paused`.

    Adding the same package, interpretation and hypotheses again changes nothing and
    prints the same id; a note on stderr says so, and says when the package limits given
    now differ from those of the first registration.
    """
    from investigation.cases import registration
    from investigation.cases.reader import PackageReader
    from investigation.cases.registry import load_hypotheses, load_interpretation, register_case
    from investigation.config import InvestigationConfig
    from investigation.operations import pause, status

    if config is not None:
        err.print("note: `case add --config` is deprecated; it only ever set the package "
                  "limits: use --package-limits", highlight=False, markup=False)
        if package_limits is not None:
            raise InvestigationError("CONFIG_INVALID",
                                     "give --package-limits only (--config is its old name)")
        package_limits = config
    settings = _settings()
    limits = InvestigationConfig.load_package_limits(package_limits)
    try:
        size = package.stat().st_size
        if not package.is_file() or size > limits.max_total_bytes:
            raise InvestigationError(
                "PKG_TOO_LARGE" if package.is_file() else "PKG_UNREADABLE",
                f"{package} is not a regular file of at most {limits.max_total_bytes} "
                "bytes (package.max_total_bytes)")
        data = package.read_bytes()
    except OSError as exc:
        raise InvestigationError("PKG_UNREADABLE", f"cannot read {package}: {exc}") from exc
    store = _store(settings)
    interp, hyps = load_interpretation(interpretation), load_hypotheses(hypotheses)
    before = registration.look_up(store, data, interp, hyps)
    case_id = register_case(store, data, interp, hyps, PackageReader(limits))
    registration.record_limits(store, case_id, limits)
    notes: list[str] = []
    changes = before.limit_changes(limits)
    if before.existed:
        notes.append(f"case {case_id} was already registered with this package, "
                     "interpretation and hypotheses; nothing changed")
        if changes:
            notes.append("the package limits given now differ from those it was first added "
                         "with (" + "; ".join(changes) + "); they only validated the package "
                         "again. A run validates the package with the package table of "
                         "its own --config")
        elif before.recorded_limits is None:
            notes.append("the package limits of its first registration were not recorded")
    elif before.other_cases:
        # At most a few ids: a fleet trial's 14th case of one package listed 13.
        shown = before.other_cases[:OTHER_CASES_SHOWN]
        more = len(before.other_cases) - len(shown)
        notes.append(f"this package is also registered as {', '.join(shown)}"
                     + (f" and {more} more case(s) (`investigate cases` lists them)"
                        if more else "")
                     + " (other interpretation or hypotheses); this is a new case")
    state = status(store, case_id)["state"]
    if paused and state == CASE_INVESTIGATING:
        pause(store, case_id)
        state = CASE_PAUSED
    elif paused:
        notes.append(f"the case is {state}: --paused changed nothing")
    if as_json:
        _print_json({"case_id": case_id, "existed": before.existed, "state": state,
                     "other_cases": list(before.other_cases), "limit_changes": changes,
                     "notes": notes})
        return
    for note in notes:
        err.print(f"note: {note}", highlight=False, markup=False)
    out.print(case_id)
    # What to do next goes to stderr: stdout stays the bare id for `$(investigate case add ...)`.
    _case_add_next(settings, store, case_id, state)


def _broker_configured(settings: Settings) -> bool:
    """Whether INVESTIGATE_BROKER_URL was given (in the environment), rather than the
    default broker every unconfigured command would use."""
    return "broker_url" in settings.model_fields_set


def _fleet_shell(settings: Settings) -> bool:
    """Whether this shell names a broker or a lock Redis (INVESTIGATE_BROKER_URL or
    INVESTIGATE_REDIS_URL in the environment): a fleet's dispatches may then hold the
    cases of this store, and ``run`` takes their lock too (decision 158)."""
    return bool({"broker_url", "redis_url"} & settings.model_fields_set)


def _case_add_next(settings: Settings, store: Store, case_id: str, state: str) -> None:
    """``case add``'s next steps, on stderr.

    A case that can run: check its scripted reply file (when INVESTIGATE_PROVIDERS names a
    scripted provider), resume it if added paused, run it here with INVESTIGATE_PROVIDERS
    (a placeholder when unset); ``dispatch`` only when a broker is configured (without one
    it would go to the default broker, where no fleet's worker may listen). A case that
    cannot run (added again after it completed, blocked or stopped): what ``status`` says.
    """
    from investigation import guidance

    if state not in (CASE_INVESTIGATING, CASE_PAUSED):
        print_guidance(err, case_guidance(settings, store, case_id))
        return
    # The store's prefix, as every printed command carries it (a hostile trial's case add
    # printed bare commands for a case in INVESTIGATE_HOME=dir).
    env = guidance.shell_env()
    resume_first = f"  $ {env}investigate resume {case_id}\n" if state == CASE_PAUSED else ""
    providers = _providers_shown(settings)
    replies = guidance.scripted_file(settings.providers) if providers else "replies.jsonl"
    check = (f"  $ {env}investigate replies check {shlex.quote(replies)} {case_id}\n"
             if replies else "")
    fleet = _broker_configured(settings)
    # Without INVESTIGATE_PROVIDERS the replies may come from a model server (a user of a
    # real model read the reply-file check as a step of theirs).
    run = (f"  $ {env}investigate run {case_id} --providers "
           f"{shlex.quote(providers) if providers else 'providers.toml'}")
    # In a fleet's shell the workers come first (a fleet trial was offered `run` first).
    err.print("next: " + ("check a scripted reply file against it (if the replies come from "
                          "one), then " if check and not providers else
                          "check a scripted reply file against it, then " if check else "")
              + ("resume it and " if resume_first else "")
              + ("send it to the workers (beat's recovery sweep also starts it), or run it "
                 "here" if fleet else "run it here")
              + f"\n{check}{resume_first}"
              + (f"  $ {env}investigate dispatch {case_id}\n{run}" if fleet else
                 f"{run}\n(a fleet's workers take it from `investigate dispatch` with the "
                 "fleet's INVESTIGATE_BROKER_URL and INVESTIGATE_DATABASE_URL set; "
                 "docs/operations.md)"),
              highlight=False, markup=False)


# -- investigate ---------------------------------------------------------------------------


@app.command("dispatch", epilog=example(f"investigate dispatch {EXAMPLE_CASE}",
                                        f"investigate dispatch {EXAMPLE_CASE} --max-steps 4"))
@_controlled
def dispatch_cmd(
    case_id: CaseArg,
    max_steps: Annotated[int | None, typer.Option(
        "--max-steps", min=1, help="steps of this dispatch before it yields to other cases "
        "(default: the policy's max_steps_per_dispatch)")] = None,
    take_over: Annotated[bool, typer.Option(
        "--take-over", help="end the lease of the dispatch that holds the case first: for "
        "a worker you know died, whose lease would otherwise keep the case waiting until it "
        "runs out (if that dispatch still runs, it stops at its next stage with LOCK_LOST)")]
        = False,
    as_json: JsonOpt = False,
) -> None:
    """Enqueue a dispatch for the distributed workers (takes the case lock, never waits).

    Watch it with `investigate status CASE --watch`. A case whose worker was killed stays
    held until its lease runs out (LOCK_BUSY, exit 3), then the recovery sweep dispatches
    it; `--take-over` dispatches it now. Stages are fenced in SQL, so a holder that still
    runs records nothing twice.
    """
    from investigation import guidance
    from investigation.loop.outcome import Outcome
    from workers import runtime
    from workers.celery_app import bound_broker_reads
    from workers.tasks import start_dispatch

    settings = _settings()
    store = _store(settings, existing=True)
    runtime.configure(runtime.distributed(settings))
    bound_broker_reads()
    taken = _end_lease(case_id) if take_over else None
    token = start_dispatch(case_id, max_steps)
    if isinstance(token, Outcome):
        g = guidance.for_case(store, case_id, "distributed")
        if as_json:
            _print_json({"case_id": case_id, "dispatched": False,
                         "outcome": token.to_dict(), "next": g.to_dict()})
        else:
            out.print(f"case {case_id}: {outcome_head(token)}; nothing to dispatch",
                      highlight=False)
            print_guidance(out, g)
        if code := outcome_exit(token):
            raise typer.Exit(code)
        return
    if as_json:
        _print_json({"case_id": case_id, "dispatched": True, "lock_token": token[:8],
                     **({"took_over": taken[:8] if taken else None} if take_over else {})})
        return
    if taken:
        out.print(f"ended the lease of dispatch {taken[:8]}... (it stops at its next stage "
                  "if it still runs)", highlight=False)
    elif take_over:
        out.print("no dispatch held the case; nothing to take over", highlight=False)
    out.print(f"dispatched {case_id} (lock token {token[:8]}...)", highlight=False)
    out.print(f"watch it: investigate status {case_id} --watch", highlight=False)
    if not _broker_configured(settings):
        err.print(f"note: INVESTIGATE_BROKER_URL is not set, so this went to the default "
                  f"broker {settings.broker_url} (queue {settings.queue}); only a "
                  "worker started with the same broker, queue and store runs it "
                  "(`investigate health` lists the workers that answer)",
                  highlight=False, markup=False)


def _end_lease(case_id: str) -> str | None:
    """End the lease of the dispatch holding ``case_id`` (``dispatch --take-over``): its
    token is released with a tombstone, so its chain cannot take the lock again and stops
    at its next renewal (``LOCK_LOST``). Returns that token, or ``None`` when none held
    the case. Correctness never rests on the lock (stages are fenced on the checkpoint
    head in SQL, and a model call in flight is waited for, never sent twice)."""
    from workers import runtime

    lock = runtime.current().lock
    token = lock.holder(case_id)
    if token is not None and lock.release(case_id, token):
        return token
    return None


@app.command("recover", epilog=example("investigate recover", "investigate recover --json"))
@_controlled
def recover_cmd(as_json: JsonOpt = False) -> None:
    """Re-dispatch every case whose stored state shows pending work.

    Use it after Redis lost its data or a dispatch was lost; cases whose dispatch is
    alive are left alone.

    Exit 0 when every pending case was dispatched or is busy; 2 when a case could not be
    dispatched (its code is printed), and when the case locks' Redis or the broker does
    not answer (REDIS_UNAVAILABLE, BROKER_UNAVAILABLE), pending cases or not.
    """
    from kombu.exceptions import OperationalError as KombuOperationalError
    from redis.exceptions import RedisError

    from workers import runtime
    from workers.health import redis_ping
    from workers.recovery import sweep

    settings = _settings()
    _store(settings, existing=True)
    # Asked first: with no case pending, a Redis nobody answers at went unnoticed
    # ("recovered 0 case(s)", exit 0: a fleet trial).
    redis_ping(settings.effective_redis_url, 2.0)  # RedisError: REDIS_UNAVAILABLE
    if settings.broker_url != settings.effective_redis_url:
        try:
            redis_ping(settings.broker_url, 2.0)
        except RedisError as exc:
            raise KombuOperationalError(str(exc)) from exc  # BROKER_UNAVAILABLE
    runtime.configure(runtime.distributed(settings))
    from workers.celery_app import bound_broker_reads

    bound_broker_reads()
    report = sweep(runtime.current())
    # Whether each busy case's holder still answers (a fleet trial: a case orphaned by a
    # killed worker read "busy" like two live ones, only its lease shorter).
    silent = _silent_holders(settings, report.busy_holder.values())
    # Whether any live worker has a task of each busy case (a fleet trial: a worker took
    # the case's next message and was killed, while the lease named the live worker that
    # had renewed it last, so "its worker does not answer ping" never came).
    orphaned = _orphaned(settings, report.busy)
    if as_json:
        sys.stdout.write(json.dumps({**report.to_dict(), "busy_holder_silent": sorted(
            c for c, name in report.busy_holder.items() if name in silent),
            "busy_orphaned": sorted(orphaned)}, indent=2, sort_keys=True) + "\n")
    else:
        for name in report.expired_tests:
            out.print(f"expired test {name} (deadline passed; recorded without feedback)",
                      highlight=False)
        for case_id in report.dispatched:
            out.print(f"dispatched {case_id}", highlight=False)
        for case_id in report.busy:
            lease = report.busy_lease_s.get(case_id)
            holder = report.busy_holder.get(case_id)
            ago = report.busy_renewed_s_ago.get(case_id)
            out.print(f"busy {case_id} (a dispatch holds its lock"
                      + ("" if holder is None else f"; held by {term(holder)}"
                         + ("" if ago is None else f", renewed {ago:g} s ago")
                         + ("; its worker does not answer ping" if holder in silent
                            else ""))
                      + ("; no live worker has a task of it and the queue is empty: its "
                         "next message is with a worker that died" if case_id in orphaned
                         else "")
                      + ("; its lease never runs out (or Redis cannot say): `investigate "
                         f"dispatch {case_id} --take-over` ends it" if lease is None else
                         f"; its lease runs out in {lease} s unless renewed: if its worker "
                         "died, a sweep after that dispatches the case, or `investigate "
                         f"dispatch {case_id} --take-over` now") + ")",
                      highlight=False, markup=False)
        for case_id in report.idle:
            out.print(f"idle {case_id} (nothing to run)", highlight=False)
        for case_id, code in report.failed.items():
            out.print(f"failed {case_id}: {code}", highlight=False)
        out.print(f"recovered {len(report.dispatched)} case(s); {len(report.busy)} busy, "
                  f"{report.not_due} waiting for a provider backoff", highlight=False)
    if report.failed:
        raise typer.Exit(2)


def _orphaned(settings: Settings, busy: Iterable[str]) -> set[str]:
    """Of the ``busy`` cases, those no live worker has a task of (``inspect active``,
    ``reserved`` and ``scheduled``, one broadcast each, a second) while the case queue is
    empty: the next message of their chain is with a worker that died (restored to the
    queue only after the visibility timeout), whoever renewed the lease last. Nothing
    when the queue holds messages (one of them may be the case's) or the broker cannot be
    asked."""
    busy = list(busy)
    if not busy:
        return set()
    from workers.celery_app import app, configure
    from workers.health import queue_depth

    try:
        if queue_depth(settings.broker_url, settings.queue) != 0:
            return set()
        configure(settings)
        inspect = app.control.inspect(timeout=1.0)
        # A stage's store retry waits out its countdown in a worker's scheduled list.
        tasks = [task.get("request", task) if isinstance(task, dict) else {}
                 for replies in (inspect.active() or {}, inspect.reserved() or {},
                                 inspect.scheduled() or {})
                 for entries in replies.values() for task in entries or []]
    except Exception:  # the broker cannot tell: claim nothing
        return set()
    at_work = " ".join(json.dumps(t.get("args"), default=str) + str(t.get("argsrepr", ""))
                       for t in tasks)
    return {case_id for case_id in busy if case_id not in at_work}


def _silent_holders(settings: Settings, holders: Iterable[str]) -> set[str]:
    """Of the lease holders named ``node@host pid N``, those whose Celery node does not
    answer a ping within a second (one broadcast; nothing when no holder names a worker
    node, or the broker cannot be asked)."""
    from workers.locks import worker_node

    nodes = {h: node for h in holders if (node := worker_node(h)) is not None}
    if not nodes:
        return set()
    from workers.celery_app import app, configure

    try:
        configure(settings)
        replies = app.control.ping(timeout=1.0) or []
    except Exception:  # the broker cannot tell: claim nothing
        return set()
    alive = {name for reply in replies for name in reply}
    return {h for h, node in nodes.items() if node not in alive}


# -- operator ------------------------------------------------------------------------------


@app.command("status", epilog=example(f"investigate status {EXAMPLE_CASE}",
                                      f"investigate status {EXAMPLE_CASE} --watch",
                                      f"investigate status {EXAMPLE_CASE} --json"))
@_controlled
def status_cmd(
    case_id: CaseArg,
    as_json: JsonOpt = False,
    watch: Annotated[bool, typer.Option(
        "--watch", help="redraw every --interval seconds until the case completes, blocks "
        "or stops (for dispatched cases); with --json, one JSON object per line at each "
        "change, the last one settled; Ctrl-C leaves")] = False,
    interval: Annotated[float, typer.Option(
        "--interval", min=0.2, max=3600.0,
        help="seconds between redraws with --watch")] = 2.0,
) -> None:
    """State, outcome, blocked reason, balances, evidence count, and what to do next."""
    settings = _settings()
    store = _store(settings, existing=True)

    def read() -> tuple[dict[str, Any], guidance.Guidance]:
        return status_reading(settings, store, case_id)

    if watch and as_json:  # JSON Lines until the case stops moving
        from workers.progress import watch_json

        def write(line: str) -> None:
            sys.stdout.write(line)
            sys.stdout.flush()

        try:
            watch_json(write, store, case_id, interval, read=read)
        except KeyboardInterrupt:  # not "settled" (exit 0): a script tells them apart
            raise typer.Exit(INTERRUPTED_EXIT) from None
        return
    if watch:
        from workers.progress import watch as watch_case

        try:
            watch_case(out, store, case_id, interval, read=read,
                       currency=_currency(settings))
        except KeyboardInterrupt:
            raise typer.Exit(INTERRUPTED_EXIT) from None
        return
    info, g = read()
    if as_json:  # model costs are in micros of model_usage.currency
        _print_json({**info, "next": g.to_dict()})
        return
    out.print(status_view(info, g, _currency(settings)))


def status_reading(settings: Settings, store: Store,
                   case_id: str) -> tuple[dict[str, Any], guidance.Guidance]:
    """What ``status`` shows of the case in this shell, and what to do next: the store's
    status (``investigation.operations.status``) and, in a shell that names a fleet's
    broker or lock Redis, the dispatch lease of an investigating case
    and the queue's waiting messages (``workers.health.dispatch_fields``), and whether a
    ``run`` of this machine holds it (``run_holds``). Read again at each redraw of
    ``status --watch`` (with ``--json`` too), so a watch shows what ``status`` does.

    Raises:
        InvestigationError: ``CASE_NOT_FOUND``.
        sqlalchemy.exc.SQLAlchemyError: the store cannot be read.
    """
    from investigation import guidance
    from investigation.operations import status

    info = status(store, case_id)
    held = waiting = False
    if _fleet_shell(settings) and info["state"] == "INVESTIGATING":
        # Only here: workers.health imports redis (a tenth of a second), which a shell
        # that names no broker never needs.
        from workers.health import dispatch_fields, dispatch_held
        from workers.locks import held_by_a_shell

        info.update(dispatch_fields(settings, case_id))
        held = dispatch_held(info)
        waiting = held and held_by_a_shell(info) and bool(info.get("queue_waiting"))
    if info["state"] == "INVESTIGATING":
        # A `run` in another shell of this machine: "run it again" would be LOCK_BUSY (a
        # user of a real model, whose steps take half a minute each).
        info["run_holds"] = _run_holds(settings, case_id)
    # Each with the store's prefix, as every printed command (a real model's user pasted
    # `status --watch` from here into a shell of another home).
    if waiting:
        return info, guidance.in_shell(guidance.dispatch_waits(
            case_id, info["queue"], info["queue_waiting"]))
    if held:
        return info, guidance.in_shell(guidance.dispatch_holds(case_id,
                                                               info["dispatch_lease_s"]))
    if info.get("run_holds"):
        return info, guidance.in_shell(guidance.run_holds(case_id))
    return info, case_guidance(settings, store, case_id)


def _run_holds(settings: Settings, case_id: str) -> bool:
    """Whether a ``run`` of this machine holds the case's file lock now (tried without
    blocking and let go at once; never creates the lock file)."""
    import fcntl

    from workers.locks import lock_file

    path = lock_file(settings.home / "locks", case_id)
    if path is None or not path.is_file():
        return False
    with path.open("rb") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    return False


def case_guidance(settings: Settings, store: Store, case_id: str) -> guidance.Guidance:
    """What to do next for a case, as ``status``, ``resume``, ``cases`` and ``case add``
    advise it: the runtimes this shell can use (both where a broker is configured, else
    only the embedded one: without INVESTIGATE_BROKER_URL a ``dispatch`` goes to the
    default broker, where no fleet's worker may listen), with INVESTIGATE_PROVIDERS and
    its scripted reply file in the commands."""
    from investigation import guidance
    from workers.settings import remembered_providers

    used = settings.providers or remembered_providers(settings, case_id)
    shown = _providers_shown(settings) or (_relative(used) if used is not None else None)
    return guidance.for_case(store, case_id,
                             None if _broker_configured(settings) else "embedded",
                             providers=shown, replies=guidance.scripted_file(used))


def _providers_shown(settings: Settings) -> str | None:
    """The providers file guidance repeats in ``run`` commands: ``INVESTIGATE_PROVIDERS``
    when set (else the guidance shows a placeholder)."""
    return str(settings.providers) if settings.providers else None


def _relative(path: Path) -> str:
    """``path`` relative to the working directory when it is below it, else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


@app.command("resume", epilog=example(
    f"investigate resume {EXAMPLE_CASE}",
    f"investigate resume {EXAMPLE_CASE} --retry-id retry-7-1"))
@_controlled
def resume_cmd(
    case_id: CaseArg,
    retry_id: Annotated[str | None, typer.Option(
        "--retry-id", help="for a case blocked by its provider or its money cap "
        "(PROVIDER_EXHAUSTED, MODEL_COST_CAP, "
        "PROVIDER_CONFIGURATION, PROVIDER_CREDENTIALS): a new, never used id that opens a "
        "new provider operation for the blocked call, after you fixed the cause. `status` "
        "suggests one. It resets no iteration, credit or evidence")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Operator resume of a paused or blocked case (then `run` or `dispatch` it). Exit 1
    when the case is still blocked (it was paused while blocked)."""
    from investigation import guidance
    from investigation.operations import resume

    settings = _settings()
    store = _store(settings, existing=True)
    try:
        info = resume(store, case_id, retry_id)
    except InvestigationError as exc:
        if exc.code in ("RETRY_ID_REQUIRED", "RETRY_ID_REUSED", "RETRY_ID_INVALID"):
            # The suggestion goes with the error, after it (it was printed before it);
            # only where a retry id applies: a case blocked by its provider or money cap.
            try:
                facts = guidance.facts_for(store, case_id)
            except InvestigationError:  # no such case: the id's own error stands
                raise exc from None
            if facts.state != CASE_BLOCKED or facts.blocked_reason not in \
                    guidance.PROVIDER_BLOCKS:
                raise
            fresh = facts.retry_id
            raise InvestigationError(exc.code, f"{exc.message}; try: investigate resume "
                                     f"{case_id} --retry-id {fresh}") from None
        raise
    g = case_guidance(settings, store, case_id)
    if as_json:
        _print_json({**info, "next": g.to_dict()})
    else:
        out.print(f"resumed {case_id} (was {info['resumed_from']})"
                  + (f"; now {info['state']}" if info.get("state") else ""),
                  highlight=False)
        print_guidance(out, g)
    if info.get("state") == CASE_BLOCKED:  # a case paused while blocked is blocked again
        raise typer.Exit(1)


@app.command("pause", epilog=example(f"investigate pause {EXAMPLE_CASE}"))
@_controlled
def pause_cmd(case_id: CaseArg, as_json: JsonOpt = False) -> None:
    """Pause a case at its next stage boundary (`resume` continues exactly there)."""
    from investigation import guidance
    from investigation.operations import pause

    info = pause(_store(_settings(), existing=True), case_id)
    if as_json:
        _print_json(info)
        return
    out.print(f"paused {case_id} (was {info['paused_from']}); a running stage finishes, "
              "no new one starts", highlight=False)
    # The same prefix as every other printed command (a re-trial's home was lost here).
    out.print(f"continue later with: {guidance.shell_env()}investigate resume {case_id}",
              highlight=False)


@app.command("cancel", epilog=example(f"investigate cancel {EXAMPLE_CASE}"))
@_controlled
def cancel_cmd(case_id: CaseArg, as_json: JsonOpt = False) -> None:
    """Cancel a case for good at its next stage boundary (finished stages are kept)."""
    from investigation.operations import cancel

    info = cancel(_store(_settings(), existing=True), case_id)
    if as_json:
        _print_json(info)
        return
    out.print(f"cancelled {case_id} (was {info['cancelled_from']})", highlight=False)


@app.command("summary", epilog=example(f"investigate summary {EXAMPLE_CASE}",
                                       f"investigate summary {EXAMPLE_CASE} --json"))
@_controlled
def summary_cmd(case_id: CaseArg, as_json: JsonOpt = False) -> None:
    """Print summary.md (written when every hypothesis account is terminal). Any control,
    bidirectional or zero-width character a stored summary holds is shown as a visible
    escape; `export` writes the exact bytes."""
    from investigation.operations import summary_bytes

    data = summary_bytes(_store(_settings(), existing=True), case_id)
    if as_json:
        import hashlib

        _print_json({"case_id": case_id, "path": "analysis/investigation/summary.md",
                     "sha256": hashlib.sha256(data).hexdigest(),
                     "markdown": data.decode("utf-8")})
        return
    shown = escape_text(data.decode("utf-8", "replace"), newlines=True)
    sys.stdout.buffer.write(shown.encode("utf-8"))
    sys.stdout.flush()


@app.command("export", epilog=example(f"investigate export {EXAMPLE_CASE} ./export"))
@_controlled
def export_cmd(
    case_id: CaseArg,
    directory: Annotated[Path, typer.Argument(
        metavar="DIR", help="a new or empty directory to write the artifact tree into")],
    as_json: JsonOpt = False,
) -> None:
    """Write the case's artifact tree byte for byte (with manifest.json of sha256s)."""
    from investigation.operations import export

    paths = export(_store(_settings(), existing=True), case_id, directory)
    if as_json:
        _print_json({"case_id": case_id, "directory": str(directory), "artifacts": paths})
        return
    out.print(f"wrote {counted(len(paths), 'artifact')} under {directory}", highlight=False)


@app.command("verify", epilog=example(f"investigate verify {EXAMPLE_CASE}",
                                      f"investigate verify {EXAMPLE_CASE} --json"))
@_controlled
def verify_cmd(case_id: CaseArg, as_json: JsonOpt = False) -> None:
    """Check the whole case from the store's bytes: full checkpoint replay, live rows,
    every artifact against its sha256 and the records that name it, and the assessment
    scores, questions and token counts against the plans and responses they came from
    (exit 0 intact, 2 with the first difference)."""
    from investigation.operations import verify

    report = verify(_store(_settings(), existing=True), case_id)
    if as_json:
        out.print_json(json.dumps(report))
        return
    bindings, accounts = report["bindings"], report["budget_accounts"]
    one = report["artifacts"] == 1
    out.print(f"{case_id}: intact: {counted(report['checkpoints'], 'checkpoint')} replayed "
              f"from {'its' if report['checkpoints'] == 1 else 'their'} bytes, "
              f"{counted(report['artifacts'], 'artifact')} ({report['artifact_bytes']} bytes) "
              f"{'matches its' if one else 'match their'} sha256"
              + (f" and the {counted(bindings, 'record')} that name "
                 f"{'it' if one else 'them'}" if bindings else "")
              # Scores, questions and token counts: what no checkpoint state holds (a
              # 500-step reader changed them and verify said "intact").
              + (f", {counted(report['figures'], 'figure')} (assessment scores, questions, "
                 "token counts) match the plans and responses they came from"
                 if report["figures"] else "")
              + f", live rows {report['live_rows']}"
              # The ledgers are read with the live rows: not while a step is unfinished.
              + (f", the whole ledger of {counted(accounts, 'budget account')} read"
                 if report["live_rows"] == "checked" else ", ledgers not read"),
              highlight=False)


from workers import (  # noqa: E402  (they use the helpers above)
    cli_ops,
    cli_providers,
    cli_report,
    cli_run,
    cli_tests,
)

cli_run.register(app)
app.add_typer(cli_tests.tests_app, name="tests")
app.add_typer(cli_tests.feedback_app, name="feedback")
app.add_typer(cli_providers.providers_app, name="providers")
app.add_typer(cli_report.replies_app, name="replies")
cli_report.register(app)
cli_ops.register(app)


def reflowed(text: str | None) -> str | None:
    """A command's help with each prose paragraph on one line, for Rich to wrap at the
    terminal's width (Typer keeps a docstring's line breaks, so an 80-column terminal
    broke every line of them in two). A paragraph holding an indented line, a list item
    (``-``, ``*``), a command (``$``) or a table row (``|``) keeps its breaks."""
    if not text:
        return text
    paragraphs = []
    for paragraph in inspect.cleandoc(text).split("\n\n"):
        lines = paragraph.split("\n")
        if not any(line[:1].isspace() or line.lstrip().startswith(("-", "*", "$", "|", "\b"))
                   for line in lines):
            paragraph = " ".join(line.strip() for line in lines)
        paragraphs.append(paragraph)
    return "\n\n".join(paragraphs)


def _reflow_help(command: Any) -> None:
    """:func:`reflowed` on ``command`` and every subcommand (Typer's click commands), whose
    flags show no value type: Typer shows ``--json <bool>``, and ``--json true`` is then
    refused as an extra argument (a new user's trial)."""
    command.help = reflowed(command.help)
    for param in getattr(command, "params", []):
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    help_option = command.get_help_option

    def flag_help_option(ctx: Any) -> Any:
        option = help_option(ctx)
        if option is not None and option.metavar is None:
            option.metavar = ""
        return option

    command.get_help_option = flag_help_option
    for sub in getattr(command, "commands", {}).values():
        _reflow_help(sub)


#: Whether :func:`main` left the logging of this process to the command it runs
#: (:func:`_setup_logging`): ``--help``, ``--version`` and completions load no settings.
_logging_pending = False


def _setup_logging() -> None:
    """Configure this process's logging from INVESTIGATE_LOG_FORMAT (``workers.logs``),
    once, when :func:`main` asked for it, before a command's body runs."""
    global _logging_pending, _log_format
    if not _logging_pending:
        return
    _logging_pending = False
    from workers import logs
    from workers.settings import load_settings

    try:
        fmt = load_settings().log_format
    except Exception:  # reported as one line by the command that needs the settings
        # ... in the format asked for, if that setting alone can be read.
        from investigation.guidance import env_value

        asked = env_value("INVESTIGATE_LOG_FORMAT") or ""
        fmt = "json" if asked.strip().lower() == "json" else "text"
    logs.setup(fmt, logging.WARNING)
    _log_format = fmt


def main() -> None:
    """Console entry point."""
    global _logging_pending
    _logging_pending = True
    command = typer.main.get_command(app)
    _reflow_help(command)
    sys.exit(_invoke(command, sys.argv[1:]))


def _invoke(command: Any, args: list[str]) -> int:
    """Run the Click ``command`` Typer built on ``args`` and return its exit code.

    A usage error (an unknown option, a bad value, a missing argument: exit code 2) is
    printed in Typer's usage box on stderr; when ``args`` ask for ``--json`` it is also
    ``{"error": {"code": "USAGE_INVALID", "message", "exit_code"}}`` on stdout, as a
    controlled error is (:func:`_fail`), so a caller that parses stdout gets a code.
    """
    try:
        result = command.main(args=args, prog_name="investigate", standalone_mode=False)
    except typer.TyperException as exc:  # Click's errors: Typer vendors Click under it
        usage = cast(Any, exc)
        # Usage errors exit 2; another Click error (a file option it cannot open) is
        # still an error of the input, never exit 1, which says "blocked".
        code = max(2, int(usage.exit_code))
        if _asks_json(args):
            error = {"error": {"code": "USAGE_INVALID" if code == 2 else "INPUT_INVALID",
                               "message": usage.format_message(), "exit_code": code}}
            _print_json(error, one_line="--watch" in args)  # JSON Lines: one line
        _show_usage_error(usage)
        return code
    except typer.Abort:  # end of input at a prompt: not exit 1, which says "blocked"
        err.print("Aborted!", markup=False, highlight=False)
        return 2
    except SystemExit as exc:
        # Help printed into a closed pipe (`--help | head`): Typer's own Rich console
        # answers the BrokenPipeError with exit 1, which says "blocked" (a hostile trial);
        # every other command's closed pipe exits 141.
        if exc.code == 1 and isinstance(exc.__context__, BrokenPipeError):
            _pipe_closed()
        raise
    except Exception as exc:  # a bug: never exit 1, which says "the case is blocked"
        import traceback

        traceback.print_exc()
        _print_error("INTERNAL_ERROR", f"unexpected {type(exc).__name__}: "
                     f"{_first_line(exc)}; this is a bug of the engine (the traceback above "
                     "says where)", INTERNAL_ERROR_EXIT, _asks_json(args))
        return INTERNAL_ERROR_EXIT
    # Not standalone, Click returns the code of a ``typer.Exit`` (help, --version,
    # :func:`_fail`) and otherwise the command's return value (the commands return None).
    return result if type(result) is int else 0


def _asks_json(args: list[str]) -> bool:
    """Whether ``args`` hold the ``--json`` flag (not as an argument after ``--``)."""
    options = args[:args.index("--")] if "--" in args else args
    return any(a == "--json" or a.startswith("--json=") for a in options)


def _show_usage_error(exc: Any) -> None:
    """Print Click's ``exc`` in Typer's usage box, as a standalone Typer app does."""
    try:
        from typer import rich_utils
    except ImportError:  # a Typer without its Rich helpers: Click's own text
        exc.show()
    else:
        rich_utils.rich_format_error(exc)


if __name__ == "__main__":
    main()
