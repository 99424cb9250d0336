"""The Python API for upstream systems: register a case, enqueue its dispatch.

Upstream code that has this package installed::

    from workers.upstream import register, send_dispatch

    case_id = register(Path("case.zip").read_bytes(),
                       {"summary": "What the bug report says"},
                       [{"id": 1, "statement": "..."}, {"id": 2, "statement": "..."}])
    send_dispatch(case_id)          # the message of docs/message-contract.md

Both read the ``INVESTIGATE_*`` settings (store, broker, queue) unless given. A system
without this package sends the same message with Celery alone
(``docs/message-contract.md``).
"""

from __future__ import annotations

from typing import Any

from investigation.cases.reader import PackageReader
from investigation.cases.registry import register_case
from investigation.config import InvestigationConfig
from investigation.constants import DISPATCH_CONTRACT_VERSION, DISPATCH_TASK
from investigation.store import Store
from workers.settings import Settings, load_settings


def register(package: bytes, interpretation: dict[str, Any], hypotheses: list[dict[str, Any]],
             *, settings: Settings | None = None,
             config: InvestigationConfig | None = None) -> str:
    """Validate and register a case in the store; returns its id (``case-<16 hex>``).

    Idempotent: the same inputs return the same id and write nothing.

    Args:
        package: the case package ZIP (``investigate case build`` or
            ``investigation.build_package`` makes one).
        interpretation: ``{"summary": str, ...}``, the accepted interpretation.
        hypotheses: ``[{"id": int, "statement": str, ...}, ...]``, ids unique, positive.
        settings: the store to use (default: the ``INVESTIGATE_*`` environment).
        config: package limits (default: the engine's defaults).

    Raises:
        PackageError: ``PKG_*``, the package fails validation (nothing is stored).
        InvestigationError: ``CASE_INTERPRETATION_INVALID``, ``CASE_HYPOTHESES_INVALID``,
            ``CASE_ID_CONFLICT``, ``STORE_NOT_MIGRATED``.
    """
    settings = settings or load_settings()
    store = Store(settings.effective_database_url)
    if settings.auto_migrate:
        store.create_schema()
    else:
        from investigation.store.migrate import require_head

        require_head(store.engine)
    try:
        return register_case(store, package, interpretation, hypotheses,
                             PackageReader((config or InvestigationConfig()).package))
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

    Raises:
        kombu.exceptions.OperationalError: the broker cannot be reached.
    """
    from workers.celery_app import app, configure

    settings = settings or load_settings()
    configure(settings)
    message = dispatch_message(case_id, max_steps)
    result = app.send_task(message["task"], args=message["args"], kwargs=message["kwargs"],
                           queue=settings.queue)
    return str(result.id)
