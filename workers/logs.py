"""Log lines for operators: timestamps always, JSON lines on request, step context.

Every process (CLI, worker, beat, Flower, exporter) logs through :func:`setup`:

* ``text`` (default): ``2026-12-01T10:15:02.118+00:00 INFO workers.tasks
  [worker=w1@host case=case-0123 step=3 stage=validate] message``.
* ``json``: one JSON object per line (python-json-logger) with ``timestamp``, ``level``,
  ``logger``, ``message``, ``process`` and, where known, ``worker``, ``case_id``,
  ``step``, ``stage``, ``task_id``.

The step context comes from :func:`step_context` (set by every stage task around the
stage) or, for Celery's own lines about our tasks (``received``, ``succeeded``), from the
task's ``argsrepr`` (``case=... rev=... step=... stage=...``, see ``workers.tasks``).
Lock tokens are shown shortened (:func:`short_token`); provider keys and feedback keys
never reach a log line (they are not in task arguments, payloads or settings output).
"""

from __future__ import annotations

import logging
import re
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from pythonjsonlogger.json import JsonFormatter

from investigation.text_safety import EscapingLogFilter

#: The logger billiard's process pool writes to (``billiard.util.LOGGER_NAME``).
MULTIPROCESSING_LOGGER = "multiprocessing"
#: Fields a line about a step carries.
CONTEXT_FIELDS = ("worker", "case_id", "step", "stage", "task_id")
#: ``argsrepr`` of a stage task (``workers.tasks.describe``): ``case=C rev=R step=N stage=S``.
_ARGSREPR = re.compile(r"case=(?P<case_id>[\w.-]+) rev=\d+ step=(?P<step>\d+)"
                       r"(?: stage=(?P<stage>\w+))?")

_context: ContextVar[dict[str, Any] | None] = ContextVar("investigation_log_context",
                                                         default=None)
_worker_name: str | None = None


def short_token(token: str | None) -> str:
    """A lock token as logs and Flower show it: its first 8 characters and an ellipsis."""
    if not token:
        return "-"
    return token[:8] + "…"


def set_worker_name(name: str | None) -> None:
    """The Celery node name (``name@host``) this process logs as (inherited by children)."""
    global _worker_name
    _worker_name = name


def worker_name() -> str | None:
    """The Celery node name this process logs as (:func:`set_worker_name`), if any."""
    return _worker_name


@contextmanager
def step_context(**fields: Any) -> Iterator[None]:
    """Attach ``case_id``, ``step``, ``stage`` (and ``task_id``) to every line logged inside."""
    merged = {**(_context.get() or {}), **{k: v for k, v in fields.items() if v is not None}}
    reset = _context.set(merged)
    try:
        yield
    finally:
        _context.reset(reset)


def context_of(argsrepr: object, task_name: object = None, task_id: object = None
               ) -> dict[str, Any]:
    """``case_id``, ``step``, ``stage`` and ``task_id`` from a stage task's ``argsrepr``
    (``case=C rev=R step=N stage=S``); ``{}`` for any other task."""
    match = _ARGSREPR.search(str(argsrepr or ""))
    if not match:
        return {}
    ctx: dict[str, Any] = {k: v for k, v in match.groupdict().items() if v}
    ctx["step"] = int(ctx["step"])
    ctx.setdefault("stage", str(task_name or "").rpartition(".")[2] or None)
    if task_id:
        ctx["task_id"] = task_id
    return ctx


def _current_task_context() -> dict[str, Any]:
    """The context of the Celery task this process is running, if any (Celery's own lines
    inside a task, such as ``Retry in 4s``, carry only its id and name)."""
    from celery import current_task

    request = getattr(current_task, "request", None) if current_task else None
    if request is None or getattr(request, "called_directly", True):
        return {}
    return context_of(getattr(request, "argsrepr", None), getattr(current_task, "name", None),
                      getattr(request, "id", None))


class ContextFilter(logging.Filter):
    """Puts the step context on each record (attributes named as :data:`CONTEXT_FIELDS`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx: dict[str, Any] = dict(_context.get() or {})
        args = record.args
        if not ctx.get("case_id") and isinstance(args, Mapping):
            # Celery's own task lines: ``{"name", "id", "args": argsrepr, ...}``.
            found = context_of(args.get("args"), args.get("name"), args.get("id"))
            if not found and "id" in args:  # a retry line: the running task's request
                found = _current_task_context()
            ctx.update(found)
        if _worker_name and "worker" not in ctx:
            ctx["worker"] = _worker_name
        for name in CONTEXT_FIELDS:
            setattr(record, name, ctx.get(name))
        return True


class TextFormatter(logging.Formatter):
    """``ISO-8601 time LEVEL logger [context] message`` (UTC, milliseconds)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(context)s %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return f"{stamp}.{int(record.msecs):03d}+00:00"

    def format(self, record: logging.LogRecord) -> str:
        parts = [f"{'case' if name == 'case_id' else name}={getattr(record, name)}"
                 for name in ("worker", "case_id", "step", "stage")
                 if getattr(record, name, None) is not None]
        record.context = f" [{' '.join(parts)}]" if parts else ""
        return super().format(record)


class JsonLineFormatter(JsonFormatter):
    """One JSON object per line; empty context fields are left out."""

    def __init__(self) -> None:
        super().__init__(
            "%(asctime)s %(levelname)s %(name)s %(message)s %(process)d",
            rename_fields={"asctime": "timestamp", "levelname": "level", "name": "logger"},
            timestamp=False)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return f"{stamp}.{int(record.msecs):03d}+00:00"

    def add_fields(self, log_data: dict[str, Any], record: logging.LogRecord,
                   message_dict: dict[str, Any]) -> None:
        super().add_fields(log_data, record, message_dict)
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is None:
                log_data.pop(name, None)
            else:
                log_data[name] = value


def formatter(fmt: str) -> logging.Formatter:
    """The formatter for ``fmt`` (``text`` or ``json``).

    Raises:
        ValueError: another format name.
    """
    if fmt == "json":
        return JsonLineFormatter()
    if fmt == "text":
        return TextFormatter()
    raise ValueError(f"log format {fmt!r}: use text or json")


def one_line(fmt: str, level: int, message: str, logger: str = "workers.cli",
             **fields: Any) -> str:
    """``message`` as one log line of format ``fmt`` (``text`` or ``json``), with
    ``fields`` (JSON keys), written by a process before or without its logging: what a
    service prints at its start and the error that stops it (a log pipeline reads each
    line of a JSON-logging worker's stderr as an object; two trials found plain ones)."""
    record = logging.makeLogRecord({"name": logger, "levelno": level,
                                    "levelname": logging.getLevelName(level),
                                    "msg": message, **fields})
    EscapingLogFilter().filter(record)  # as every handler of setup() escapes
    return formatter(fmt).format(record)


def write_line(fmt: str, level: int, message: str, logger: str = "workers.cli",
               **fields: Any) -> None:
    """Write :func:`one_line` to stderr at once."""
    sys.stderr.write(one_line(fmt, level, message, logger, **fields) + "\n")
    sys.stderr.flush()


def setup(fmt: str = "text", level: str | int = "WARNING", stream: Any = None) -> None:
    """Configure the root logger of this process: one stream handler (stderr by default)
    with the context filter and the ``fmt`` formatter. Calling it again replaces it."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter(fmt))
    handler.addFilter(ContextFilter())
    # Log lines quote snapshot and model text: no terminal escapes, no forged lines.
    handler.addFilter(EscapingLogFilter())
    handler._investigation = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    # billiard's pool logs on "multiprocessing", which does not propagate: its lines (a
    # child killed by a signal) reached stderr bare, without a time (a fleet trial).
    for logger in (root, logging.getLogger(MULTIPROCESSING_LOGGER)):
        for old in list(logger.handlers):
            if getattr(old, "_investigation", False):
                logger.removeHandler(old)
        logger.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    # Python's warnings (Celery's SecurityWarning for a worker run as root, a library's
    # DeprecationWarning) as log lines of this format: they reached stderr as bare
    # multi-line text, the one thing in a JSON-logging worker's output that was no JSON.
    if warnings.showwarning is not getattr(logging, "_showwarning", None):
        logging.captureWarnings(False)  # its saved hook replaced since (a test's): anew
        logging.captureWarnings(True)
    warnings_logger = logging.getLogger(WARNINGS_LOGGER)
    if not any(isinstance(f, OneLineWarning) for f in warnings_logger.filters):
        warnings_logger.addFilter(OneLineWarning())


#: The logger ``logging.captureWarnings`` writes Python's warnings to.
WARNINGS_LOGGER = "py.warnings"


class OneLineWarning(logging.Filter):
    """A captured warning as one line: ``FILE:LINE: Category: text`` with its white space
    collapsed, without the source line ``warnings.formatwarning`` appends (escaped line
    breaks made Celery's SecurityWarning one line of ``\\x0a`` seven times over)."""

    def filter(self, record: logging.LogRecord) -> bool:
        lines = record.getMessage().rstrip("\n").split("\n")
        if len(lines) > 1 and lines[-1].startswith("  "):
            lines = lines[:-1]
        record.msg, record.args = " ".join(" ".join(lines).split()), None
        return True
