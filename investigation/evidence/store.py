"""EvidenceStore: normalised findings, fingerprints and deterministic novelty.

A finding is the ``items`` list of a tool result; every item carries a stable ``key``.
Novelty is counted per hypothesis over the current revision: an item is new when no
earlier evidence record of that hypothesis had its key. A record whose fingerprint
equals an earlier record's is a duplicate and earns no novelty.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from sqlalchemy import bindparam, func
from sqlmodel import Session, col, select

from investigation.config import canonical_json
from investigation.constants import ARTIFACT_EVIDENCE
from investigation.store.engine import Store, sha256_hex
from investigation.store.models import Evidence


def fingerprint(operation: str, arguments: dict[str, Any], items: list[dict[str, Any]]) -> str:
    """sha256 over the canonical operation, normalised arguments and findings."""
    return sha256_hex(canonical_json({"operation": operation, "arguments": arguments,
                                      "items": items}))


@functools.lru_cache(maxsize=8192)
def _keys(keys_json: str) -> tuple[str, ...]:
    """A stored record's item keys, parsed once per process (records are write-once)."""
    return tuple(json.loads(keys_json))


# Statements built once (building a statement costs more than running it on SQLite).
_OF_REVISION = (col(Evidence.case_id) == bindparam("case_id"),
                col(Evidence.revision) == bindparam("revision"))
_OF_STEP = select(Evidence).where(*_OF_REVISION, col(Evidence.step_seq) == bindparam("step_seq"))
_PRIOR_KEYS = select(Evidence.item_keys_json, Evidence.fingerprint).where(
    *_OF_REVISION, col(Evidence.hypothesis_id) == bindparam("hid"))
_LAST_ORDINAL = select(func.max(Evidence.ordinal)).where(
    col(Evidence.case_id) == bindparam("case_id"))


class EvidenceStore:
    """Records evidence and accounts its novelty (seed 000 cycle step 8)."""

    @staticmethod
    def record(session: Session, *, case_id: str, revision: int, step_seq: int,
               hypothesis_id: int, result: dict[str, Any], cost_units: int) -> Evidence:
        """Store one evidence record for a step; idempotent per (case, revision, step).

        Args:
            result: the tool result JSON (``operation``, ``arguments``, ``items``,
                ``warnings``, ``stats``).
            cost_units: what the action was charged.

        Returns:
            The new record (or the existing one for this step), with a controller-assigned
            id ``E<n>`` (n = 1, 2, ... per case in creation order).
        """
        existing = session.exec(_OF_STEP, params={"case_id": case_id, "revision": revision,
                                                  "step_seq": step_seq}).first()
        if existing is not None:
            return existing
        items: list[dict[str, Any]] = list(result.get("items", []))
        keys = [str(i["key"]) for i in items]
        operation = str(result["operation"])
        arguments = dict(result.get("arguments", {}))
        fp = fingerprint(operation, arguments, items)
        prior = session.exec(_PRIOR_KEYS, params={"case_id": case_id, "revision": revision,
                                                  "hid": hypothesis_id}).all()
        seen: set[str] = set()
        for keys_json, _ in prior:
            seen.update(_keys(keys_json))
        duplicate = any(row_fp == fp for _, row_fp in prior)
        new_count = 0 if duplicate else len(set(keys) - seen)
        ordinal = (session.exec(_LAST_ORDINAL, params={"case_id": case_id}).one() or 0) + 1
        evidence_id = f"E{ordinal}"
        record = {
            "evidence_id": evidence_id, "hypothesis_id": hypothesis_id, "revision": revision,
            "step_seq": step_seq, "operation": operation, "arguments": arguments,
            "items": items, "warnings": list(result.get("warnings", [])),
            "stats": result.get("stats", {}), "fingerprint": fp, "item_count": len(items),
            "new_item_count": new_count, "duplicate": duplicate, "cost_units": cost_units,
        }
        path = ARTIFACT_EVIDENCE.format(seq=step_seq)
        data = canonical_json(record)
        digest = Store.put_artifact(session, case_id, path, data)
        row = Evidence(
            case_id=case_id, revision=revision, step_seq=step_seq, ordinal=ordinal,
            evidence_id=evidence_id, hypothesis_id=hypothesis_id, operation=operation,
            arguments_json=canonical_json(arguments).decode(),
            findings_json=canonical_json(items).decode(),
            item_keys_json=canonical_json(keys).decode(),
            warnings_json=canonical_json(record["warnings"]).decode(),
            fingerprint=fp, item_count=len(items), new_item_count=new_count,
            duplicate=duplicate, cost_units=cost_units, artifact_path=path,
            artifact_sha256=digest,
        )
        session.add(row)
        session.flush()
        return row

    @staticmethod
    def for_case(session: Session, case_id: str, revision: int) -> list[Evidence]:
        """All current-revision evidence of a case, in creation order."""
        return list(session.exec(select(Evidence).where(
            Evidence.case_id == case_id, Evidence.revision == revision)
            .order_by(col(Evidence.ordinal))).all())
