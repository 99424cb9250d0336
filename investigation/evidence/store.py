"""EvidenceStore: normalised findings, fingerprints and deterministic novelty.

A finding is the ``items`` list of a tool result; every item carries a stable ``key``.
Novelty is counted per hypothesis over the current revision: an item is new when no
earlier evidence record of that hypothesis had its key. A record whose fingerprint
equals an earlier record's is a duplicate and earns no novelty. Both are looked up, not
scanned: the keys a hypothesis has found are rows of ``evidence_key`` (one per key, naming
the record that found it first) and fingerprints are indexed, so accounting a result
costs the same at step 500 as at step 5.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import bindparam, func, insert
from sqlalchemy import select as sa_select
from sqlalchemy.orm import make_transient_to_detached
from sqlmodel import Session, col, select

from investigation.config import canonical_json
from investigation.constants import ARTIFACT_EVIDENCE
from investigation.store.engine import Store, core, sha256_hex, table_of
from investigation.store.models import Evidence, EvidenceKey


def fingerprint(operation: str, arguments: dict[str, Any], items: list[dict[str, Any]]) -> str:
    """sha256 over the canonical operation, normalised arguments and findings."""
    return sha256_hex(canonical_json({"operation": operation, "arguments": arguments,
                                      "items": items}))


# Statements built once (building a statement costs more than running it on SQLite).
_KEYS_WHERE = (col(EvidenceKey.case_id) == bindparam("case_id"),
               col(EvidenceKey.revision) == bindparam("revision"),
               col(EvidenceKey.hypothesis_id) == bindparam("hid"))
#: Which of a result's item keys (by sha256) the hypothesis's evidence has found before.
_KNOWN_KEYS = sa_select(col(EvidenceKey.key_sha256)).where(
    *_KEYS_WHERE, col(EvidenceKey.key_sha256).in_(bindparam("keys", expanding=True)))
_KEY_INSERT = insert(table_of(EvidenceKey))
_EV = table_of(Evidence).c
#: What recording a result looks up, in one query: the step's record if it exists, an
#: earlier record of the hypothesis with the same fingerprint, the case's newest ordinal.
_LOOKUPS = sa_select(
    sa_select(_EV.id).where(_EV.case_id == bindparam("case_id"),
                            _EV.revision == bindparam("revision"),
                            _EV.step_seq == bindparam("step_seq")).limit(1).scalar_subquery(),
    sa_select(_EV.id).where(_EV.case_id == bindparam("case_id"),
                            _EV.revision == bindparam("revision"),
                            _EV.hypothesis_id == bindparam("hid"),
                            _EV.fingerprint == bindparam("fingerprint"))
    .limit(1).scalar_subquery(),
    sa_select(func.max(_EV.ordinal)).where(_EV.case_id == bindparam("case_id"))
    .scalar_subquery())
#: A new record: one Core INSERT of every column (no ORM object of it is pending in the
#: session; the settlement later changes it through the ORM in its own transaction).
_EVIDENCE_INSERT = insert(table_of(Evidence)).returning(_EV.id)
#: Keys looked up in one statement (SQLite's bound-parameter limit is 32,766).
_KEYS_PER_LOOKUP = 500


def key_sha256(key: str) -> str:
    """The novelty index's name of an item key (``evidence_key.key_sha256``)."""
    return sha256_hex(key.encode("utf-8", "surrogatepass"))


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
        items: list[dict[str, Any]] = list(result.get("items", []))
        keys = [str(i["key"]) for i in items]
        operation = str(result["operation"])
        arguments = dict(result.get("arguments", {}))
        fp = fingerprint(operation, arguments, items)
        ident = {"case_id": case_id, "revision": revision, "hid": hypothesis_id}
        conn = core(session)
        existing_id, same_id, last_ordinal = conn.execute(_LOOKUPS, {
            **ident, "step_seq": step_seq, "fingerprint": fp}).one()
        if existing_id is not None:
            existing = session.get(Evidence, existing_id)
            assert existing is not None
            return existing
        duplicate = same_id is not None
        hashed = {key_sha256(k): k for k in keys}
        unique = sorted(hashed)
        known: set[str] = set()
        for start in range(0, len(unique), _KEYS_PER_LOOKUP):
            known.update(conn.execute(_KNOWN_KEYS, {
                **ident, "keys": unique[start:start + _KEYS_PER_LOOKUP]}).scalars())
        fresh = [h for h in unique if h not in known]
        new_count = 0 if duplicate else len(fresh)
        ordinal = (last_ordinal or 0) + 1
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
        row.id = conn.execute(_EVIDENCE_INSERT, row.model_dump(exclude={"id"})).scalar_one()
        if fresh:  # the keys this record found first (write-once rows, after their record:
            # the store takes index rows of the case's newest record only, decision 121)
            conn.execute(_KEY_INSERT, [
                {"case_id": case_id, "revision": revision, "hypothesis_id": hypothesis_id,
                 "key_sha256": h, "evidence_id": evidence_id} for h in fresh])
        # The session takes the object as the row just written (no second INSERT, no read).
        make_transient_to_detached(row)
        session.add(row)
        return row

    @staticmethod
    def for_case(session: Session, case_id: str, revision: int) -> list[Evidence]:
        """All current-revision evidence of a case, in creation order."""
        return list(session.exec(select(Evidence).where(
            Evidence.case_id == case_id, Evidence.revision == revision)
            .order_by(col(Evidence.ordinal))).all())
