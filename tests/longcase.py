"""A long, real case for the report: hundreds of steps on the scripted provider.

:func:`long_replies` writes a reply script that a real run accepts step after step: it
follows the real scheduler (``select_hypothesis``) to know whose turn each reply answers,
cites the evidence ids the engine will assign, asks and resolves questions, moves
confidence up and down, and now and then sends a reply that breaks the contract (so the
report has rejections to show). :func:`make_long_case` registers the case and writes the
script and a policy large enough for it; running it is the caller's business
(``Investigator.run`` or ``investigate run``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from investigation.config import InvestigationConfig
from investigation.loop.scheduler import select_hypothesis
from tests.casekit import Case, make_case

#: Lines per generated source file; each ``source.read`` quotes a fresh range of one.
FILE_LINES = 400
READ_SPAN = 6
CONFIDENCE_CYCLE = ("weak", "plausible", "plausible", "supported", "plausible", "weak")


#: A snapshot line a hostile package could hold: markup, a terminal escape, a bidi
#: override, a zero-width space. H1's first query quotes it (line 2 of module_07).
HOSTILE_LINE = ("# <script>alert(1)</script><img src=x onerror=alert(2)> \x1b[2J "
                "\u202eevil\u202c zero\u200bwidth &amp; </details></svg>")


def long_source(files: int = 30) -> dict[str, str]:
    """A source tree of ``files`` modules with :data:`FILE_LINES` distinct lines each
    (line 2 of ``module_07`` is :data:`HOSTILE_LINE`)."""
    tree = {}
    for f in range(files):
        lines = [f"def handler_{f}_{n}(order):  # rule {f}.{n}: discount path {n % 7}"
                 if n % 3 == 0 else f"    return order['total'] * {n} / {f + 1}  # step {n}"
                 for n in range(FILE_LINES)]
        if f == 7:
            lines[1] = HOSTILE_LINE
        tree[f"shop/module_{f:02d}.py"] = "\n".join(lines) + "\n"
    return tree


@dataclass
class _Account:
    hypothesis_id: int
    status: str = "active"
    confidence: str = "unassessed"
    turns: int = 0
    pending: str | None = None
    research: int = 0
    open_questions: list[str] | None = None


def long_replies(hypotheses: int, research_per_hypothesis: int, files: int = 30,
                 reject_every: int = 37) -> list[str]:
    """Reply lines for ``hypotheses`` hypotheses that each make
    ``research_per_hypothesis`` queries, then finish (the odd ones reject).

    Every ``reject_every``-th reply is an invalid one (it cites an unknown evidence id);
    the next line answers the same turn validly, so no hypothesis blocks.
    """
    accounts = [_Account(h, open_questions=[]) for h in range(1, hypotheses + 1)]
    lines: list[str] = []
    evidence = 0
    questions = 0
    cursor = 0
    while True:
        hid = select_hypothesis(accounts)  # type: ignore[arg-type]
        if hid is None:
            return lines
        a = accounts[hid - 1]
        if reject_every and len(lines) % reject_every == reject_every - 1:
            lines.append(json.dumps({
                "assessment": None if a.pending is None else
                {"score": 50, "reason": "assessed", "evidence_ids": [a.pending]},
                "update": {"confidence": "weak", "evidence_ids": ["E99999"],
                           "resolve_questions": [], "new_questions": [],
                           "note": "cites an evidence id that does not exist"},
                "next": {"action": "finish", "reason": "invalid on purpose"}}))
        assessment = None if a.pending is None else {
            "score": 40 + (a.turns * 13) % 60, "reason": "the quoted lines bear on it",
            "evidence_ids": [a.pending]}
        cited = [a.pending] if a.pending else []
        confidence = CONFIDENCE_CYCLE[a.turns % len(CONFIDENCE_CYCLE)]
        if confidence == "supported" and not cited:
            confidence = "plausible"
        resolve: list[str] = []
        new: list[str] = []
        assert a.open_questions is not None
        if a.open_questions and a.turns % 4 == 3 and cited:
            resolve = [a.open_questions.pop(0)]
        if a.turns % 5 == 1 and a.research < research_per_hypothesis:
            questions += 1
            new = [f"Does rule {hid}.{a.turns} apply to discounted orders (question {questions})?"]
            a.open_questions.append(f"Q{questions}")
        update = {"confidence": confidence, "evidence_ids": cited, "resolve_questions": resolve,
                  "new_questions": new, "note": f"H{hid} turn {a.turns + 1}: reading more."}
        nxt: dict[str, Any]
        if a.research < research_per_hypothesis:
            f = (hid * 7 + a.research) % files
            start = 1 + (cursor * READ_SPAN) % (FILE_LINES - READ_SPAN)
            cursor += 1
            nxt = {"action": "query", "operation": "source.read",
                   "arguments": {"path": f"shop/module_{f:02d}.py", "start_line": start,
                                 "end_line": start + READ_SPAN - 1}}
            evidence += 1
            a.pending = f"E{evidence}"
            a.research += 1
        else:
            if confidence in ("supported", "strongly_supported") and hid % 2 == 0:
                confidence = update["confidence"] = "plausible"
            update["resolve_questions"] = resolve + list(a.open_questions)
            if update["resolve_questions"] and not cited:
                update["resolve_questions"] = []
            a.open_questions.clear()
            nxt = {"action": "reject" if hid % 2 == 0 else "finish",
                   "reason": f"H{hid}: enough read after {a.research} queries"}
            a.pending = None
            a.status = "closed"
        update["new_questions"] = new
        lines.append(json.dumps({"assessment": assessment, "update": update, "next": nxt}))
        a.confidence = confidence
        a.turns += 1


def long_config(research_per_hypothesis: int) -> InvestigationConfig:
    """A policy with room for the long script: credit, iterations and questions."""
    cfg = InvestigationConfig()
    return cfg.model_copy(update={
        "loop": cfg.loop.model_copy(update={
            "max_iterations_per_hypothesis": research_per_hypothesis + 1,
            "max_questions_per_hypothesis": research_per_hypothesis,
            "max_results_without_novelty": 1000}),
        "budget": cfg.budget.model_copy(update={"credit_units": 4 * research_per_hypothesis
                                                + 10})})


def config_toml(research_per_hypothesis: int) -> str:
    """:func:`long_config` as a policy file for ``investigate run --config``."""
    cfg = long_config(research_per_hypothesis)
    return (f"[loop]\nmax_iterations_per_hypothesis = {cfg.loop.max_iterations_per_hypothesis}\n"
            f"max_questions_per_hypothesis = {cfg.loop.max_questions_per_hypothesis}\n"
            f"max_results_without_novelty = {cfg.loop.max_results_without_novelty}\n\n"
            f"[budget]\ncredit_units = {cfg.budget.credit_units}\n")


def make_long_case(root: Path, hypotheses: int = 4, research_per_hypothesis: int = 100,
                   files: int = 30, database_url: str | None = None,
                   reject_every: int = 37) -> Case:
    """Register the long case under ``root`` with its reply script (not run yet)."""
    case = make_case(
        root, replies=long_replies(hypotheses, research_per_hypothesis, files, reject_every),
        database_url=database_url, source=long_source(files),
        hypotheses=[{"id": h, "statement": f"Rule family {h} computes the discount "
                     "from the wrong base."} for h in range(1, hypotheses + 1)],
        interpretation={"summary": f"Long case: {hypotheses} hypotheses, "
                        f"{research_per_hypothesis} queries each."})
    (root / "policy.toml").write_text(config_toml(research_per_hypothesis))
    return case
