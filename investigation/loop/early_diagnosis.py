"""Early diagnosis review and assessment-only deferral (seed 000, "Deterministic cycle"
step 1; the design is ``docs/early-diagnosis.md``).

A ``finish`` may carry ``early_diagnosis = {"defer_alternatives": [ids], "rationale"}``:
the model asks to stop researching the named alternatives because the finishing
hypothesis is already well grounded. The controller reviews the request against the
step's frozen context only, so the same context always gives the same review:

Structural rules (a breach rejects the whole reply with ``EARLY_DIAGNOSIS_INVALID``,
like any other contract violation): each named alternative is another hypothesis of the
case, named once, and still active and not already deferred; a hypothesis that is itself
assessment-only cannot defer others.

Review criteria (all must hold; each failed one is recorded with its code and the
request is *declined*, the ``finish`` itself still goes ahead):

``ED_DISABLED``               the frozen policy has ``loop.early_diagnosis = false``
``ED_CONFIDENCE``             the update's confidence is ``strongly_supported``
``ED_EVIDENCE``               ``update.evidence_ids`` cites at least
                              ``loop.early_diagnosis_min_evidence`` distinct evidence
                              records of the finishing hypothesis with new findings
                              (``new_item_count > 0``, not a duplicate)
``ED_OPEN_QUESTIONS``         the finishing hypothesis leaves no open question: every
                              open one is resolved in this update and none is added
``ED_ALTERNATIVE_UNEXAMINED`` every named alternative has had its initial turn
``ED_ALTERNATIVE_SUPPORTED``  no named alternative stands at ``supported`` or above

An accepted review marks every named alternative ``deferred_by`` the finishing
hypothesis. A deferred account keeps its balance, pending result and questions; its
next (and last) turn is a closing turn (``assessment_only``): it assesses its pending
result, if any, and may only ``finish`` or ``reject``. The step's outcome is
``DEFERRED``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from investigation.budget.rules import ACTIVE
from investigation.loop.contract import FinishAction, Reply, ReplyRejected

#: Confidence labels an early diagnosis needs (finishing) or forbids (alternatives).
REQUIRED_CONFIDENCE = "strongly_supported"
SUPPORTED = ("supported", "strongly_supported")

#: Review finding codes, in the order they are checked.
ED_DISABLED = "ED_DISABLED"
ED_CONFIDENCE = "ED_CONFIDENCE"
ED_EVIDENCE = "ED_EVIDENCE"
ED_OPEN_QUESTIONS = "ED_OPEN_QUESTIONS"
ED_ALTERNATIVE_UNEXAMINED = "ED_ALTERNATIVE_UNEXAMINED"
ED_ALTERNATIVE_SUPPORTED = "ED_ALTERNATIVE_SUPPORTED"
REVIEW_CODES = (ED_DISABLED, ED_CONFIDENCE, ED_EVIDENCE, ED_OPEN_QUESTIONS,
                ED_ALTERNATIVE_UNEXAMINED, ED_ALTERNATIVE_SUPPORTED)


@dataclass(frozen=True)
class Review:
    """The controller's review of one early-diagnosis request.

    Attributes:
        requested: the alternatives named, ascending.
        accepted: every criterion held.
        qualifying_evidence: cited own evidence ids with new findings, in citation order.
        findings: ``{"code", "detail"[, "hypothesis_id"]}`` per failed criterion, in
            :data:`REVIEW_CODES` order then by hypothesis id.
        rationale: the model's rationale (untrusted text, stored as given).
    """

    requested: tuple[int, ...]
    accepted: bool
    qualifying_evidence: tuple[str, ...]
    findings: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    rationale: str = ""

    @property
    def deferred(self) -> tuple[int, ...]:
        """The alternatives this review defers (none when declined)."""
        return self.requested if self.accepted else ()

    def to_dict(self) -> dict[str, Any]:
        """JSON form stored in the validate output and the plan."""
        return {
            "requested": list(self.requested), "accepted": self.accepted,
            "deferred": list(self.deferred),
            "qualifying_evidence": list(self.qualifying_evidence),
            "findings": list(self.findings), "rationale": self.rationale,
        }


def check_request(reply: Reply, context: dict[str, Any]) -> None:
    """Structural rules of an early-diagnosis request (see the module docstring).

    Raises:
        ReplyRejected: ``EARLY_DIAGNOSIS_INVALID`` for the first broken rule.
    """
    nxt = reply.next
    if not isinstance(nxt, FinishAction) or nxt.early_diagnosis is None:
        return
    hid = int(context["hypothesis"]["id"])
    if context["hypothesis"].get("deferred_by") is not None:
        raise ReplyRejected("EARLY_DIAGNOSIS_INVALID",
                            "an assessment-only hypothesis cannot defer others")
    others = {int(o["id"]): o for o in context["other_hypotheses"]}
    seen: set[int] = set()
    for alt in nxt.early_diagnosis.defer_alternatives:
        if alt == hid:
            raise ReplyRejected("EARLY_DIAGNOSIS_INVALID",
                                "a hypothesis cannot defer itself")
        if alt in seen:
            raise ReplyRejected("EARLY_DIAGNOSIS_INVALID",
                                f"alternative {alt} is named twice")
        seen.add(alt)
        other = others.get(alt)
        if other is None:
            raise ReplyRejected("EARLY_DIAGNOSIS_INVALID",
                                f"hypothesis {alt} is not an alternative of this case")
        if other["status"] != ACTIVE or other.get("deferred_by") is not None:
            raise ReplyRejected("EARLY_DIAGNOSIS_INVALID",
                                f"hypothesis {alt} is not active or is already deferred")


def review(reply: Reply, context: dict[str, Any]) -> Review | None:
    """Review the reply's early-diagnosis request, or return ``None`` when it has none.

    Call :func:`check_request` first. Reads only the frozen ``context``: the finishing
    hypothesis, its evidence and questions, the other hypotheses (status, turns,
    confidence) and ``context["early_diagnosis"]`` (the frozen policy).
    """
    nxt = reply.next
    if not isinstance(nxt, FinishAction) or nxt.early_diagnosis is None:
        return None
    request = nxt.early_diagnosis
    policy = context["early_diagnosis"]
    hid = int(context["hypothesis"]["id"])
    update = reply.update
    requested = tuple(sorted(request.defer_alternatives))
    findings: list[dict[str, Any]] = []

    if not policy["enabled"]:
        findings.append({"code": ED_DISABLED,
                         "detail": "early diagnosis is disabled by the frozen policy"})
    if update.confidence != REQUIRED_CONFIDENCE:
        findings.append({"code": ED_CONFIDENCE,
                         "detail": f"confidence is {update.confidence}, not "
                                   f"{REQUIRED_CONFIDENCE}"})
    evidence = {e["evidence_id"]: e for e in context["evidence"]}
    qualifying: list[str] = []
    for eid in update.evidence_ids:
        e = evidence.get(eid)
        if e is None or eid in qualifying or int(e["hypothesis_id"]) != hid:
            continue
        if int(e["new_item_count"]) > 0 and not e["duplicate"]:
            qualifying.append(eid)
    need = int(policy["min_evidence"])
    if len(qualifying) < need:
        findings.append({"code": ED_EVIDENCE,
                         "detail": f"{len(qualifying)} cited own evidence record(s) with new "
                                   f"findings; {need} needed"})
    still_open = sorted(
        q["question_id"] for q in context["questions"]
        if int(q["hypothesis_id"]) == hid and q["status"] == "open"
        and q["question_id"] not in update.resolve_questions)
    if still_open or update.new_questions:
        parts = [f"left open: {', '.join(still_open)}"] if still_open else []
        if update.new_questions:
            parts.append(f"{len(update.new_questions)} new question(s) asked")
        findings.append({"code": ED_OPEN_QUESTIONS, "detail": "; ".join(parts)})
    others = {int(o["id"]): o for o in context["other_hypotheses"]}
    for alt in requested:
        if int(others[alt]["turns"]) == 0:
            findings.append({"code": ED_ALTERNATIVE_UNEXAMINED, "hypothesis_id": alt,
                             "detail": f"hypothesis {alt} has not had its initial turn"})
    for alt in requested:
        if others[alt]["confidence"] in SUPPORTED:
            findings.append({"code": ED_ALTERNATIVE_SUPPORTED, "hypothesis_id": alt,
                             "detail": f"hypothesis {alt} stands at "
                                       f"{others[alt]['confidence']}"})
    return Review(requested=requested, accepted=not findings,
                  qualifying_evidence=tuple(qualifying), findings=tuple(findings),
                  rationale=request.rationale)
