"""Case packages: the deterministic builder, the validating PackageReader, the Snapshot
protocol, the shared text index searches read, and case registration.

Names are imported lazily, so ``import investigation.cases.snapshot`` stays cheap and never
pulls in the store (which keeps import cycles with ``investigation.store`` impossible).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DictSnapshot": "investigation.cases.snapshot",
    "Snapshot": "investigation.cases.snapshot",
    "PackageInfo": "investigation.cases.builder",
    "build_package": "investigation.cases.builder",
    "PackageReader": "investigation.cases.reader",
    "PackageSnapshot": "investigation.cases.reader",
    "ValidatedPackage": "investigation.cases.reader",
    "load_hypotheses": "investigation.cases.registry",
    "load_interpretation": "investigation.cases.registry",
    "load_snapshot": "investigation.cases.registry",
    "register_case": "investigation.cases.registry",
    "TextIndexStore": "investigation.cases.textindex",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'investigation.cases' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
