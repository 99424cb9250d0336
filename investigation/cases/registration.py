"""What ``case add`` tells about a registration: new or repeated, and with which settings.

Registration itself (``investigation.cases.registry.register_case``) is idempotent: the
case id is derived from the package, the interpretation and the hypotheses, so adding
the same inputs again changes nothing. The package limits (``case add --package-limits``)
are not part of the case: they only decide whether the package is accepted. This module
records, once per case, the package limits it was first accepted under (the artifact
:data:`ARTIFACT_PACKAGE_LIMITS`, exact JSON bytes like every artifact), so a repeated
``case add`` with other limits can say so, and lists the other cases of the same package.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from sqlmodel import col, select

from investigation import jsonio
from investigation.cases.registry import case_id_for
from investigation.config import PackageLimits, canonical_json
from investigation.store.engine import Store
from investigation.store.models import CaseRecord

#: Where the package limits of a case's first registration are kept.
ARTIFACT_PACKAGE_LIMITS = "registration/package-limits.json"


@dataclass(frozen=True)
class Registration:
    """What a ``case add`` found before registering.

    Attributes:
        case_id: the id the inputs give.
        existed: the case was registered before (nothing changes).
        other_cases: other cases of the same package (other interpretation or hypotheses).
        recorded_limits: the package limits of the first registration, if recorded.
    """

    case_id: str
    existed: bool
    other_cases: tuple[str, ...] = field(default_factory=tuple)
    recorded_limits: dict[str, Any] | None = None

    def limit_changes(self, limits: PackageLimits) -> list[str]:
        """``"name: first -> now"`` for each package limit that differs from the recorded
        one (empty when none differs or none was recorded)."""
        if self.recorded_limits is None:
            return []
        now = limits.model_dump(mode="json")
        return [f"{k}: {self.recorded_limits.get(k)} -> {now[k]}" for k in sorted(now)
                if self.recorded_limits.get(k) != now[k]]


def look_up(store: Store, package: bytes, interpretation: dict[str, Any],
            hypotheses: list[dict[str, Any]]) -> Registration:
    """What registering these inputs would find (read only)."""
    package_id = hashlib.sha256(package).hexdigest()
    case_id = case_id_for(package_id, interpretation, hypotheses)
    with store.session() as s:
        existed = s.get(CaseRecord, case_id) is not None
        others = s.exec(select(CaseRecord.id).where(
            CaseRecord.package_id == package_id, CaseRecord.id != case_id)
            .order_by(col(CaseRecord.created_at))).all()
        art = Store.get_artifact(s, case_id, ARTIFACT_PACKAGE_LIMITS) if existed else None
    recorded = jsonio.loads(bytes(art.data)) if art is not None else None
    return Registration(case_id, existed, tuple(others), recorded)


def record_limits(store: Store, case_id: str, limits: PackageLimits) -> None:
    """Keep the package limits of the case's first registration (write-once: a later
    call for the same case leaves the first record)."""
    with store.session() as s:
        if Store.get_artifact(s, case_id, ARTIFACT_PACKAGE_LIMITS) is None:
            Store.put_artifact(s, case_id, ARTIFACT_PACKAGE_LIMITS,
                               canonical_json(limits.model_dump(mode="json")))
