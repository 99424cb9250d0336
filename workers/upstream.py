"""The Python API for upstream systems: register a case, enqueue its dispatch.

Upstream code that has this package installed::

    from workers.upstream import register, send_dispatch

    case_id = register(Path("case.zip").read_bytes(),
                       {"summary": "What the bug report says"},
                       [{"id": 1, "statement": "..."}, {"id": 2, "statement": "..."}])
    send_dispatch(case_id)          # the message of docs/message-contract.md
    status(case_id)["state"]        # what `investigate status CASE --json` prints

Both read the ``INVESTIGATE_*`` settings (store, broker, queue) unless given. A system
without this package sends the same message with Celery alone
(``docs/message-contract.md``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from investigation.cases.reader import PackageReader
from investigation.cases.registry import register_case
from investigation.config import InvestigationConfig
from investigation.constants import (
    CASE_ID_RULE,
    CASE_INVESTIGATING,
    DISPATCH_CONTRACT_VERSION,
    DISPATCH_TASK,
    SAFE_CASE_ID,
)
from investigation.errors import InvestigationError, PackageError
from investigation.operations import pause
from investigation.operations import status as case_status
from investigation.store import Store
from investigation.store.models import CaseRecord
from investigation.text_safety import escape_text
from workers.settings import Settings, load_settings
from workers.stores import open_store


@contextmanager
def _api_errors() -> Iterator[None]:
    """Errors of the libraries underneath as this API's codes (a hostile-input trial got
    SQLAlchemy's, psycopg's and kombu's own exceptions where the CLI gives a code)."""
    try:
        yield
    except ArgumentError as exc:
        raise InvestigationError("STORE_URL_INVALID", f"the store URL cannot be used: "
                                 f"{_first_line(exc)}") from exc
    except SQLAlchemyError as exc:
        raise InvestigationError("STORE_UNAVAILABLE", f"the store cannot be used: "
                                 f"{_first_line(exc)}; check INVESTIGATE_DATABASE_URL / "
                                 "INVESTIGATE_HOME") from exc
    except ModuleNotFoundError as exc:  # a URL of a database this engine has no driver for
        raise InvestigationError("STORE_URL_INVALID", f"the store URL names a database this "
                                 f"engine does not use ({exc.name}); the store is SQLite "
                                 "(sqlite:///PATH) or PostgreSQL (postgresql+psycopg://...)"
                                 ) from exc


def _first_line(exc: BaseException) -> str:
    return escape_text((str(exc).splitlines() or [type(exc).__name__])[0])[:300]


def _settings(settings: Any) -> Settings:
    """``settings``, or this process's when ``None``.

    Raises:
        InvestigationError: ``ARGUMENT_INVALID`` (not a :class:`Settings`).
    """
    if settings is None:
        return load_settings()
    if not isinstance(settings, Settings):
        raise InvestigationError("ARGUMENT_INVALID", f"settings must be a "
                                 f"workers.settings.Settings or None, not "
                                 f"{type(settings).__name__}")
    return settings


def _case_id(case_id: Any) -> str:
    if not isinstance(case_id, str) or not SAFE_CASE_ID.fullmatch(case_id):
        raise InvestigationError("CASE_ID_INVALID", f"{escape_text(repr(case_id))[:100]} is "
                                 f"not a case id ({CASE_ID_RULE})")
    return case_id


def _store(settings: Settings, create: bool) -> Store:
    """The deployment's store, to register into. Unless ``create``, an embedded SQLite
    store must exist already: an upstream process started without
    ``INVESTIGATE_DATABASE_URL`` (or another working directory than the workers') made a
    store of its own in ``./.investigate``, and the fleet never saw its cases (an
    integrator's trial)."""
    parsed = make_url(settings.effective_database_url)
    path = Path(parsed.database or "")
    if not create and parsed.get_backend_name() == "sqlite" and \
            (not path.is_file() or path.stat().st_size == 0):  # an empty file is no store
        raise InvestigationError(
            "STORE_NOT_FOUND",
            f"no investigation store at {parsed.database}; nothing was changed. Set "
            "INVESTIGATE_DATABASE_URL (or INVESTIGATE_HOME) to the store the workers use, "
            "or pass create_store=True to make a new one there")
    return open_store(settings)


def register(package: bytes, interpretation: dict[str, Any], hypotheses: list[dict[str, Any]],
             *, settings: Settings | None = None,
             config: InvestigationConfig | None = None, create_store: bool = False,
             paused: bool = False) -> str:
    """Validate and register a case in the store; returns its id (``case-<16 hex>``).

    Idempotent: the same inputs return the same id and write nothing.

    Args:
        package: the case package ZIP's bytes (``investigate case build`` or
            ``investigation.build_package`` makes one).
        interpretation: ``{"summary": str, ...}``, the accepted interpretation.
        hypotheses: ``[{"id": int, "statement": str, ...}, ...]``, ids unique, positive,
            statements distinct.
        settings: the store to use (default: the ``INVESTIGATE_*`` environment).
        config: package limits (default: the engine's defaults).
        create_store: make the embedded SQLite store when it does not exist yet (default:
            refuse, see ``STORE_NOT_FOUND``); a PostgreSQL database must exist either way.
        paused: register it paused, as ``investigate case add --paused``: on a fleet's
            store the recovery sweep (beat) dispatches every investigating case by
            itself; a paused one waits for ``investigate resume``. A case that was
            registered before and is no longer investigating is left as it is.

    Raises:
        PackageError: ``PKG_*``, the package fails validation, or is not bytes
            (``PKG_NOT_ZIP``); nothing is stored.
        InvestigationError: ``CASE_INTERPRETATION_INVALID``, ``CASE_HYPOTHESES_INVALID``,
            ``CASE_ID_CONFLICT``, ``STORE_NOT_MIGRATED``, ``STORE_NOT_FOUND`` (the settings
            name an embedded store that does not exist, and ``create_store`` is false),
            ``STORE_UNAVAILABLE`` and ``STORE_URL_INVALID`` (the store cannot be used),
            ``ARGUMENT_INVALID`` (``settings`` or ``config`` of another type).
    """
    if not isinstance(package, bytes | bytearray | memoryview):
        raise PackageError("PKG_NOT_ZIP", f"the package is a {type(package).__name__}, not "
                                          "bytes; pass the ZIP file's bytes "
                                          "(Path(...).read_bytes())")
    settings = _settings(settings)
    for name, flag in (("create_store", create_store), ("paused", paused)):
        if not isinstance(flag, bool):  # "no" is a true value: it made a store
            raise InvestigationError("ARGUMENT_INVALID", f"{name} must be True or False, "
                                     f"not {escape_text(repr(flag))[:40]}")
    if config is not None and not isinstance(config, InvestigationConfig):
        raise InvestigationError("ARGUMENT_INVALID", f"config must be an "
                                 "investigation.config.InvestigationConfig or None, not "
                                 f"{type(config).__name__}")
    with _api_errors():
        store = _store(settings, create_store)
        try:
            case_id = register_case(store, bytes(package), interpretation, hypotheses,
                                    PackageReader((config or InvestigationConfig()).package))
            if paused and case_status(store, case_id)["state"] == CASE_INVESTIGATING:
                pause(store, case_id)
            return case_id
        finally:
            store.dispose()


def status(case_id: str, *, settings: Settings | None = None) -> dict[str, Any]:
    """What ``investigate status CASE --json`` prints, read in this process (a CLI call
    costs seconds of start-up; an upstream system polls): ``state`` (``INVESTIGATING``,
    ``BLOCKED``, ``PAUSED``, ``BUILDING_DIAGNOSIS`` once every hypothesis account is
    terminal, ``CANCELLED``, ``STOPPED``), ``blocked_reason`` and ``blocked_detail``,
    ``last_outcome``, ``steps``, ``evidence`` (what the records amount to), the accounts,
    ``model_usage``, and ``next``: what an operator does next, ``final`` true when
    nothing more will happen without one; for an investigating case, the dispatch
    fields ``status --json`` gives on a fleet shell (``dispatch_lease_s``,
    ``dispatch_holder``, ``dispatch_renewed_s_ago``; ``queue_waiting`` when none holds
    it).

    Raises:
        InvestigationError: ``CASE_ID_INVALID``, ``CASE_NOT_FOUND``; ``STORE_NOT_FOUND``
            (no investigation store where the settings point), ``STORE_UNAVAILABLE``,
            ``STORE_URL_INVALID``; ``ARGUMENT_INVALID``.
    """
    from investigation import guidance
    from workers.health import dispatch_fields, dispatch_held

    case_id = _case_id(case_id)
    settings = _settings(settings)
    with _api_errors():
        store = open_store(settings, existing=True)
        try:
            info = case_status(store, case_id)
            if info["state"] == CASE_INVESTIGATING:  # as on a fleet shell
                info.update(dispatch_fields(settings, case_id))
                if dispatch_held(info):
                    return {**info, "next": guidance.dispatch_holds(
                        case_id, info["dispatch_lease_s"]).to_dict()}
            return {**info,
                    "next": guidance.for_case(store, case_id, "distributed").to_dict()}
        finally:
            store.dispose()


def dispatch_message(case_id: str, max_steps: int | None = None) -> dict[str, Any]:
    """The dispatch message of contract version 1: ``{"task", "args", "kwargs"}``."""
    args: list[Any] = [case_id] if max_steps is None else [case_id, max_steps]
    return {"task": DISPATCH_TASK, "args": args,
            "kwargs": {"contract": DISPATCH_CONTRACT_VERSION}}


def send_dispatch(case_id: str, max_steps: int | None = None, *,
                  settings: Settings | None = None) -> str:
    """Enqueue ``investigation.dispatch`` for ``case_id`` on the case queue; returns the
    Celery task id. A worker takes the case lock and runs its steps; a case whose
    dispatch is already running is skipped by the worker (``LOCK_BUSY`` in the result).

    The request is checked here first, as ``investigate dispatch`` checks it: a worker
    refuses a bad one only in its log, and the message's result is not stored (no result
    backend), so a sender would never learn of the refusal (an integrator's trial).
    The task id names the message in Flower and the worker log; follow the case with
    :func:`status`.

    Raises:
        InvestigationError: ``DISPATCH_INVALID`` (``case_id`` is not a case id, or
            ``max_steps`` is not null or an integer from 1 to ``limits.max_checkpoints``
            of the policy this process reads, ``INVESTIGATE_CONFIG``); ``CASE_NOT_FOUND``
            (no such case in the store); ``STORE_NOT_FOUND``, ``STORE_UNAVAILABLE``,
            ``STORE_URL_INVALID``; ``BROKER_URL_INVALID`` (not a ``redis://`` or
            ``rediss://`` URL); ``ARGUMENT_INVALID``. Nothing was sent.
        kombu.exceptions.OperationalError: the broker cannot be reached.
    """
    from workers.celery_app import app, configure
    from workers.tasks import check_dispatch

    settings = _settings(settings)
    policy = InvestigationConfig.load(settings.config) if settings.config \
        else InvestigationConfig()
    check_dispatch(case_id, max_steps, policy.limits.max_checkpoints)
    try:
        broker = urlsplit(settings.broker_url)
        broker.port  # noqa: B018 - a port that is no number raises here, not in kombu
        valid = broker.scheme in ("redis", "rediss")
    except ValueError:
        valid = False
    if not valid:
        raise InvestigationError("BROKER_URL_INVALID", "the broker is Redis: "
                                 "INVESTIGATE_BROKER_URL must be redis://HOST:PORT/DB or "
                                 "rediss://...; nothing was sent")
    with _api_errors():
        store = open_store(settings, existing=True)
        try:
            with store.session() as s:
                if s.get(CaseRecord, case_id) is None:
                    raise InvestigationError(
                        "CASE_NOT_FOUND", f"no case {case_id} in "
                        f"{make_url(store.url).database}; register it first "
                        "(workers.upstream.register); nothing was sent")
        finally:
            store.dispose()
    configure(settings)
    message = dispatch_message(case_id, max_steps)
    result = app.send_task(message["task"], args=message["args"], kwargs=message["kwargs"],
                           queue=settings.queue)
    return str(result.id)
