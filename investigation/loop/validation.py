"""Whole-reply validation before any effect (seed 000, "Model/controller contract").

``validate_reply`` checks a parsed reply against the frozen context of its step, in a
fixed order, and raises :class:`ReplyRejected` with the first broken rule's code. Nothing
is written here: question, confidence and budget effects happen later, in
``settle_reserve``, and only for an accepted decision. A valid assessment with an invalid
next action is rejected as a whole.

Rejection codes (stable), in checking order:

``REPLY_NOT_JSON``, ``REPLY_DUPLICATE_KEYS``, ``REPLY_SCHEMA_INVALID`` (parse_reply);
``UNKNOWN_QUESTION_ID``, ``QUESTION_OTHER_HYPOTHESIS`` (question ids, before anything else);
``ASSESSMENT_REQUIRED``, ``ASSESSMENT_UNEXPECTED``, ``ASSESSMENT_MISSING_PREVIOUS_RESULT``;
``UNKNOWN_EVIDENCE_ID``; ``SUPPORT_WITHOUT_FINDINGS``; ``INCONSISTENT_REJECT``;
``RESOLUTION_WITHOUT_EVIDENCE``; ``QUESTION_WITHOUT_WORDS``; ``DUPLICATE_QUESTION``;
``TOO_MANY_QUESTIONS``;
``ACTION_NOT_ALLOWED``; ``EARLY_DIAGNOSIS_INVALID`` (``loop.early_diagnosis``);
``UNKNOWN_OPERATION``; ``TOOL_*`` (argument preflight, e.g.
``TOOL_PATH_ESCAPE``, ``TOOL_SQL_NOT_READ_ONLY``); ``TEST_COST_NOT_CONFIGURED``;
``TEST_HANDOFF_UNAVAILABLE`` (no feedback key); ``BUDGET_UNAFFORDABLE``. The validate stage adds
``REPLY_UNPROCESSABLE`` for a reply whose values cannot be processed or stored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from investigation.budget import rules
from investigation.config import BudgetConfig
from investigation.constants import OPERATIONS
from investigation.errors import ToolError
from investigation.loop import early_diagnosis
from investigation.loop.contract import QueryAction, Reply, ReplyRejected, TestAction
from investigation.text_safety import escape_text

#: Confidence labels that need non-empty stored findings.
SUPPORT_LABELS = ("supported", "strongly_supported")


class ArgumentPreflight(Protocol):
    """What validation needs of the ToolRouter: argument checks without execution."""

    def validate(self, operation: str, arguments: dict[str, Any]) -> Any: ...


@dataclass(frozen=True)
class AcceptedDecision:
    """A reply that passed every rule, with its simulated budget projection."""

    reply: Reply
    cost_units: int
    projection: rules.Projection
    early_diagnosis: early_diagnosis.Review | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form stored as the validate stage's output and in the plan."""
        return {
            "reply": self.reply.model_dump(mode="json"),
            "cost_units": self.cost_units,
            "early_diagnosis": self.early_diagnosis.to_dict() if self.early_diagnosis
            else None,
            "projection": {
                "refund_units": self.projection.refund_units,
                "reserve_units": self.projection.reserve_units,
                "balance_after_settlement": self.projection.balance_after_settlement,
                "balance_after": self.projection.balance_after,
                "status_after": self.projection.status_after,
            },
        }


def _check_test_available(action: TestAction, context: dict[str, Any],
                          budget: BudgetConfig) -> None:
    """A test needs a configured cost of its kind and a feedback key; the specific code
    says which is missing (rather than a bare ``ACTION_NOT_ALLOWED``)."""
    if rules.action_cost(budget, "test", test_kind=action.test.kind) is None:
        raise ReplyRejected("TEST_COST_NOT_CONFIGURED",
                            f"no cost is configured for {action.test.kind} tests; choose a "
                            "query, finish or reject")
    if not context.get("external_tests", {}).get("available"):
        # No feedback key: nobody could authenticate feedback, so refuse rather than
        # charge for a test whose result could never come back.
        raise ReplyRejected("TEST_HANDOFF_UNAVAILABLE",
                            "external tests are not available here (no feedback key is "
                            "configured); choose a query, finish or reject")


#: Two letters in a row, of any script: the least a question in words holds.
_WORD = re.compile(r"[^\W\d_]{2}")
#: A question's id (``Q3``) where a new question's words belong.
_QUESTION_ID = re.compile(r"[Qq]\d+")


def _normalise_question(text: str) -> str:
    return " ".join(text.casefold().split())


def validate_reply(reply: Reply, context: dict[str, Any], budget: BudgetConfig,
                   router: ArgumentPreflight, max_questions: int) -> AcceptedDecision:
    """Validate ``reply`` against the step's frozen ``context``.

    Args:
        reply: the parsed reply.
        context: the stored context document of this step (see ``loop.context``).
        budget: the frozen budget policy.
        router: argument preflight of the snapshot tools (no execution).
        max_questions: ``max_questions_per_hypothesis``.

    Returns:
        The accepted decision with its projected settlement and reservation.

    Raises:
        ReplyRejected: the first rule the reply breaks.
    """
    hyp = context["hypothesis"]
    hid = int(hyp["id"])
    evidence = {e["evidence_id"]: e for e in context["evidence"]}
    questions = {q["question_id"]: q for q in context["questions"]}
    previous = context.get("previous_result")
    update = reply.update

    # Question ids first: an unknown id invalidates the whole decision before anything.
    for qid in update.resolve_questions:
        if qid not in questions:
            raise ReplyRejected("UNKNOWN_QUESTION_ID", f"question {qid} does not exist")
    for qid in update.resolve_questions:
        if int(questions[qid]["hypothesis_id"]) != hid:
            raise ReplyRejected("QUESTION_OTHER_HYPOTHESIS",
                                f"question {qid} belongs to another hypothesis")

    # Assessment binding.
    if previous is None and reply.assessment is not None:
        raise ReplyRejected("ASSESSMENT_UNEXPECTED",
                            "there is no previous result to assess; assessment must be null")
    if previous is not None:
        if reply.assessment is None:
            raise ReplyRejected("ASSESSMENT_REQUIRED",
                                f"assess the previous result {previous['evidence_id']}")
        if previous["evidence_id"] not in reply.assessment.evidence_ids:
            raise ReplyRejected("ASSESSMENT_MISSING_PREVIOUS_RESULT",
                                f"assessment.evidence_ids must include {previous['evidence_id']}")

    # Evidence references.
    cited = list(update.evidence_ids) + list(reply.assessment.evidence_ids if reply.assessment
                                             else [])
    for eid in cited:
        if eid not in evidence:
            raise ReplyRejected("UNKNOWN_EVIDENCE_ID", f"evidence {eid} is not in the context")

    # Confidence grounding and consistency.
    if update.confidence in SUPPORT_LABELS and not any(
            int(evidence[e]["item_count"]) > 0 for e in update.evidence_ids):
        raise ReplyRejected("SUPPORT_WITHOUT_FINDINGS",
                            f"confidence {update.confidence} needs cited evidence with findings")
    if update.confidence in SUPPORT_LABELS and reply.next.action == "reject":
        raise ReplyRejected("INCONSISTENT_REJECT",
                            f"a {update.confidence} hypothesis cannot be rejected")

    # Question updates.
    open_texts: dict[str, str] = {}
    own = [q for q in questions.values() if int(q["hypothesis_id"]) == hid]
    for q in own:
        if q["status"] == "open":
            open_texts.setdefault(_normalise_question(q["text"]), q["question_id"])
    newly_resolved = [q for q in update.resolve_questions if questions[q]["status"] == "open"]
    if newly_resolved and not update.evidence_ids:
        raise ReplyRejected("RESOLUTION_WITHOUT_EVIDENCE",
                            f"resolving {newly_resolved[0]} needs update.evidence_ids")
    seen_new: dict[str, int] = {}
    for number, text in enumerate(update.new_questions, start=1):
        if _QUESTION_ID.fullmatch(text.strip()):
            # A real model wrote "Q1" here three times over; the refusal said only that
            # it held no word (a real model's user).
            raise ReplyRejected("QUESTION_WITHOUT_WORDS",
                                f"new question {number} is {escape_text(text.strip())!r}, a "
                                "question's id: new_questions holds the words of a new "
                                "question; an open question is closed by its id in "
                                "resolve_questions, with evidence_ids")
        if not _WORD.search(text):
            # A small model's stray JSON (`\\]} } {`) was recorded as an open question the
            # case then carried to its end (a real model's user).
            raise ReplyRejected("QUESTION_WITHOUT_WORDS",
                                f"new question {number} holds no word (two letters in a "
                                "row, in any script); a question asks something in words")
        norm = _normalise_question(text)
        if norm in open_texts:
            raise ReplyRejected("DUPLICATE_QUESTION",
                                f"new question {number} repeats open question "
                                f"{open_texts[norm]}")
        if norm in seen_new:
            raise ReplyRejected("DUPLICATE_QUESTION",
                                f"new question {number} repeats new question "
                                f"{seen_new[norm]} of this reply")
        seen_new[norm] = number
    if len(own) + len(update.new_questions) > max_questions:
        raise ReplyRejected("TOO_MANY_QUESTIONS",
                            f"this hypothesis has {len(own)} questions; "
                            f"{len(update.new_questions)} new would pass the limit of "
                            f"{max_questions}")

    # Next action: scope, arguments, cost, affordability.
    action = reply.next.action
    if isinstance(reply.next, TestAction) and not context.get("closing_reason"):
        _check_test_available(reply.next, context, budget)
    if action not in context["allowed_actions"]:
        closing = context.get("closing_reason")
        raise ReplyRejected("ACTION_NOT_ALLOWED",
                            f"{action} is not allowed now"
                            + (f" (a closing turn: {closing})" if closing else "")
                            + f"; allowed: {', '.join(context['allowed_actions'])}")
    early_diagnosis.check_request(reply, context)
    cost: int | None = 0
    if isinstance(reply.next, QueryAction):
        if reply.next.operation not in OPERATIONS:
            raise ReplyRejected("UNKNOWN_OPERATION",
                                f"operation {reply.next.operation!r} does not exist; use one "
                                f"of {', '.join(OPERATIONS)}")
        try:
            router.validate(reply.next.operation, reply.next.arguments)
        except ToolError as exc:
            raise ReplyRejected(exc.code, exc.message) from exc
        cost = rules.action_cost(budget, "query", operation=reply.next.operation)
    elif isinstance(reply.next, TestAction):
        _check_test_available(reply.next, context, budget)
        cost = rules.action_cost(budget, "test", test_kind=reply.next.test.kind)
    assert cost is not None

    pending = None
    if previous is not None:
        pending = (int(previous["cost_units"]), int(previous["novelty_permille"]))
    projection = rules.project(
        budget, int(hyp["balance_units"]), pending,
        reply.assessment.score if reply.assessment else None, action, cost)
    if projection.balance_after < 0:
        raise ReplyRejected(
            "BUDGET_UNAFFORDABLE",
            f"{action} costs {cost} units but only {projection.balance_after_settlement} remain "
            "after settlement")
    return AcceptedDecision(reply=reply, cost_units=cost, projection=projection,
                            early_diagnosis=early_diagnosis.review(reply, context))
