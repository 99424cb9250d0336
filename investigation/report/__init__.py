"""The visual case report (``investigate report CASE -o report.html``).

:func:`render_report` returns the page; :func:`write_report` writes it. See
``investigation.report.html`` for what the page shows and ``docs/report.md``.
"""

from __future__ import annotations

from pathlib import Path

from investigation.files import write_atomic
from investigation.guidance import Guidance
from investigation.report.history import CaseHistory, StepRow, case_history
from investigation.report.html import render
from investigation.store.engine import Store

__all__ = ["CaseHistory", "StepRow", "case_history", "render_report", "write_report"]


def render_report(store: Store, case_id: str, env: str | None = None,
                  currency: str = "USD", guidance: Guidance | None = None) -> str:
    """The self-contained HTML report of ``case_id`` (``env`` prefixes the commands of its
    next steps, e.g. ``"INVESTIGATE_HOME=.investigate/demo "``; default
    ``investigation.guidance.shell_env()``; ``currency`` labels model costs,
    ``limits.currency``; ``guidance``, when given, is the next steps shown instead of
    the store's own: what ``status`` advises in the caller's shell, which also knows
    the runs and dispatches that hold the case).

    Raises:
        InvestigationError: ``CASE_NOT_FOUND``.
    """
    return render(case_history(store, case_id, env, currency, guidance))


def write_report(store: Store, case_id: str, path: Path, env: str | None = None,
                 currency: str = "USD", guidance: Guidance | None = None) -> int:
    """Write the report to ``path`` (UTF-8; replaced atomically, ``files.write_atomic``),
    creating its missing parent directories (as ``case build -o`` does) once the report is
    rendered (``env``, ``currency``, ``guidance``: as in :func:`render_report`). Returns
    its size in bytes.

    Raises:
        InvestigationError: ``CASE_NOT_FOUND``.
        OSError: the file cannot be written, or ``path`` names something other than a
            regular file (a device, a FIFO, a directory).
    """
    data = render_report(store, case_id, env, currency, guidance).encode(
        "utf-8", "backslashreplace")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
    return len(data)
