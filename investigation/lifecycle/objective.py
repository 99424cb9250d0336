"""``ResearchObjective``: what one investigation session is for (seed 001).

Provider-independent: it holds no model, worker, scheduler, retrieval or store reference,
only values, so any store can persist ``to_dict()`` and rebuild it with ``from_dict``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from investigation.lifecycle import _records as r
from investigation.lifecycle import codes
from investigation.lifecycle._records import JSONValue

#: ``format`` of a serialised objective.
OBJECTIVE_FORMAT = "research-objective/1"
_KEYS = ("format", "objective_id", "question", "scope", "constraints", "success_criteria",
         "created_at", "metadata")


@dataclass(frozen=True)
class ResearchObjective:
    """A research objective: an immutable value.

    Args:
        objective_id: stable identifier (a non-blank string of at most 256 characters).
        question: the question to answer (non-blank).
        created_at: timezone-aware creation time; stored converted to UTC. A naive
            datetime raises ``LIFECYCLE_NAIVE_TIMESTAMP``.
        scope: free text bounding what is investigated; may be empty.
        constraints: what the investigation must not do or assume (non-blank strings).
        success_criteria: what makes the objective met (non-blank strings).
        metadata: JSON-compatible object (string keys; lists, not tuples; finite floats).
            It is copied on construction and by ``to_dict``; treat it as read-only.

    Raises:
        LifecycleError: ``LIFECYCLE_INVALID_VALUE``, ``LIFECYCLE_MALFORMED_RECORD``,
            ``LIFECYCLE_NAIVE_TIMESTAMP``, ``LIFECYCLE_INVALID_TIMESTAMP`` or
            ``LIFECYCLE_INVALID_METADATA``.
    """

    objective_id: str
    question: str
    created_at: datetime
    scope: str = ""
    constraints: tuple[str, ...] = ()
    success_criteria: tuple[str, ...] = ()
    metadata: dict[str, JSONValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "objective_id", r.identifier(self.objective_id, "objective_id"))
        set_(self, "question", r.text(self.question, "question"))
        set_(self, "created_at", r.aware(self.created_at, "created_at"))
        set_(self, "scope", r.text(self.scope, "scope", allow_empty=True))
        set_(self, "constraints", r.texts(self.constraints, "constraints"))
        set_(self, "success_criteria", r.texts(self.success_criteria, "success_criteria"))
        if not isinstance(self.metadata, dict):
            raise r.error(codes.INVALID_METADATA, "metadata must be a JSON object",
                          field="metadata")
        set_(self, "metadata", r.json_copy(self.metadata, "metadata"))

    def __hash__(self) -> int:
        return hash((self.objective_id, self.question, self.created_at))

    @classmethod
    def create(cls, question: str, *, scope: str = "", constraints: Sequence[str] = (),
               success_criteria: Sequence[str] = (),
               metadata: Mapping[str, Any] | None = None, objective_id: str | None = None,
               created_at: datetime | None = None) -> ResearchObjective:
        """A new objective; ``objective_id`` defaults to ``"obj-" + uuid4 hex`` and
        ``created_at`` to now (UTC)."""
        return cls(
            objective_id=objective_id or f"obj-{uuid.uuid4().hex}",
            question=question,
            created_at=r.now_or(created_at, "created_at"),
            scope=scope,
            constraints=tuple(constraints),
            success_criteria=tuple(success_criteria),
            metadata=dict(metadata or {}),
        )

    def to_dict(self) -> dict[str, JSONValue]:
        """JSON-compatible record (see ``docs/lifecycle.md``, "Records")."""
        return {
            "format": OBJECTIVE_FORMAT,
            "objective_id": self.objective_id,
            "question": self.question,
            "scope": self.scope,
            "constraints": list(self.constraints),
            "success_criteria": list(self.success_criteria),
            "created_at": r.dump_timestamp(self.created_at),
            "metadata": r.json_copy(self.metadata, "metadata"),
        }

    @classmethod
    def from_dict(cls, data: object) -> ResearchObjective:
        """Rebuild from ``to_dict()`` output, validating every field.

        Raises:
            LifecycleError: ``LIFECYCLE_MALFORMED_RECORD`` (not an object, missing/unknown
                keys, wrong types), ``LIFECYCLE_UNSUPPORTED_FORMAT``,
                ``LIFECYCLE_NAIVE_TIMESTAMP`` and the constructor's codes.
        """
        d = r.fields(data, "objective", _KEYS)
        r.check_format(d, OBJECTIVE_FORMAT)
        if not isinstance(d["constraints"], list) or not isinstance(d["success_criteria"],
                                                                    list):
            raise r.error(codes.MALFORMED_RECORD,
                          "constraints and success_criteria must be lists")
        metadata = d["metadata"]
        if not isinstance(metadata, dict):
            raise r.error(codes.MALFORMED_RECORD, "metadata must be a JSON object",
                          field="metadata")
        return cls(
            objective_id=r.identifier(d["objective_id"], "objective_id"),
            question=r.text(d["question"], "question"),
            created_at=r.load_timestamp(d["created_at"], "created_at"),
            scope=r.text(d["scope"], "scope", allow_empty=True),
            constraints=r.texts(d["constraints"], "constraints"),
            success_criteria=r.texts(d["success_criteria"], "success_criteria"),
            metadata=metadata,
        )
