"""Read-only snapshot operations: :class:`ToolRouter` and its :class:`ToolResult`.

See :mod:`investigation.tools.router` for the outcome contract,
:mod:`investigation.tools.search` for the whole-file line search,
:mod:`investigation.tools.sqlite` for the read-only SQL construction and
:mod:`investigation.tools.text` for path, glob and RE2 rules.
"""

from investigation.tools.models import (
    ARGUMENT_MODELS,
    BINARY_SKIPPED,
    EMPTY_RESULT,
    LINE_CUT,
    PARTIAL,
    RANGE_CLIPPED,
    TEXTUAL_SCOPE,
    TRUNCATED,
    WARNINGS,
    ToolResult,
)
from investigation.tools.router import ToolRouter

__all__ = [
    "ARGUMENT_MODELS",
    "BINARY_SKIPPED",
    "EMPTY_RESULT",
    "LINE_CUT",
    "PARTIAL",
    "RANGE_CLIPPED",
    "TEXTUAL_SCOPE",
    "TRUNCATED",
    "WARNINGS",
    "ToolResult",
    "ToolRouter",
]
