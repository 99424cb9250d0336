"""Budget properties over random decision sequences, driven through the real in-process
engine on fresh SQLite stores (seed 000, "Model/controller contract" and "Budget and
stopping").

Hypothesis draws a small policy (credit, iteration cap, low-information bound, refund cap,
costs) and a sequence of abstract *moves*: queries from a fixed pool (some return nothing,
some overlap, and ``repeat`` re-issues the hypothesis's last query so duplicates occur),
finish/reject, new questions and resolutions, and deliberately invalid replies (unknown
evidence or question ids, a missing or misbound assessment, a duplicate question, text
that is not JSON). The scripted provider replays reply line ``call_index``; the driver
builds each step's context first and then renders the move against that frozen context,
appending the concrete reply line before the model call. So valid moves are valid for
the state they meet, and invalid ones exercise the rejection path (three in a row block
the case; the operator resume is part of the drawn sequence). When the moves run out,
every remaining hypothesis is finished so most runs complete with a ``summary.md``.

After each run the store is checked for:

1. ledger identity: per account a running ledger (credit, then signed movements whose
   ``balance_after_units`` chain), never negative, ending at ``balance_units`` =
   credit - reservations + refunds; checkpoint states agree with the ledger;
2. refunds: strictly below the settled evidence's cost, zero for empty or duplicate
   findings, equal to the documented formula; repeats of a query are duplicates;
3. terminal accounts never act again: no step selects, plans for, charges or refunds a
   hypothesis after the checkpoint in which its account became terminal;
4. replay: the recorded reply lines on a fresh store give identical ledger rows,
   evidence, checkpoint hashes and a byte-identical ``summary.md``;
5. iteration cap: at most ``max_iterations_per_hypothesis`` research iterations, and
   after the cap at most one (closing) decision.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from sqlmodel import col, select

from investigation import operations
from investigation.budget import rules
from investigation.config import BudgetConfig, InvestigationConfig, LoopConfig
from investigation.constants import BLOCKED, COMPLETED, PROGRESSED
from investigation.errors import InvestigationError
from investigation.loop.outcome import Outcome
from investigation.store import Store
from investigation.store.models import (
    BudgetAccount,
    Checkpoint,
    Evidence,
    LedgerEntry,
    Plan,
)
from tests.casekit import Case, make_case

# -- the decision space ------------------------------------------------------------------

#: Queries over the tiny shop case. Some overlap (same source lines), two are empty.
QUERIES: list[tuple[str, dict[str, Any]]] = [
    ("source.search", {"pattern": "percent"}),
    ("db.tables", {}),
    ("source.search", {"pattern": "discount"}),
    ("source.read", {"path": "shop/pricing.py", "start_line": 1, "end_line": 3}),
    ("db.query", {"sql": "SELECT id, total, discount FROM orders ORDER BY id"}),
    ("db.query", {"sql": "SELECT id FROM orders WHERE id > 100"}),  # empty
    ("logs.search", {"pattern": "no such line"}),  # empty
    ("source.list", {"prefix": "shop/"}),
    ("symbol.occurrences", {"symbol": "apply_discount"}),
    ("logs.search", {"pattern": "discount"}),
]
CONFIDENCES = ["plausible", "weak", "supported", "strongly_supported", "weakened",
               "unassessed"]
SUPPORT = ("supported", "strongly_supported")
#: Move kinds, weighted towards research (sampled_from shrinks towards plain queries);
#: about a third are invalid, so three in a row (a block) stay occasional.
VALID_KINDS = ["query", "repeat", "finish", "reject"]
INVALID_KINDS = ["bad_evidence", "bad_question", "bad_assessment", "dup_question", "garbage"]
KINDS = ["query"] * 4 + ["repeat"] * 4 + ["finish", "reject"] + INVALID_KINDS
TERMINAL = set(rules.TERMINAL_STATUSES)


@dataclass(frozen=True)
class Move:
    """One abstract model decision; :func:`render` makes it concrete for a context."""

    kind: str
    query: int = 0
    score: int = 50
    confidence: str = "plausible"
    ask: bool = False
    resolve: bool = False
    obey: bool = True
    """Respect the turn's closing restriction and the visible balance (a careful model)."""


@dataclass(frozen=True)
class Policy:
    """The drawn budget/loop policy (frozen on the case at its first step)."""

    credit: int
    max_iterations: int
    max_no_novelty: int
    refund_percent: int
    pricey: bool
    """All costs one unit higher: the cheapest action then costs 2, so credit 1 is
    exhausted before the first turn."""

    def config(self) -> InvestigationConfig:
        costs = dict(BudgetConfig().costs)
        if self.pricey:
            costs = {op: c + 1 for op, c in costs.items()}
        return InvestigationConfig(
            loop=LoopConfig(max_iterations_per_hypothesis=self.max_iterations,
                            max_results_without_novelty=self.max_no_novelty),
            budget=BudgetConfig(credit_units=self.credit, costs=costs,
                                max_refund_percent=self.refund_percent))


moves = st.builds(
    Move,
    kind=st.sampled_from(KINDS),
    # Half of the draws come from the first three queries, so repeats are common.
    query=st.one_of(st.integers(0, 2), st.integers(0, len(QUERIES) - 1)),
    score=st.integers(0, 100),
    confidence=st.sampled_from(CONFIDENCES),
    ask=st.booleans(),
    resolve=st.booleans(),
    obey=st.sampled_from([True, True, True, False]),
)
policies = st.builds(
    Policy,
    credit=st.integers(1, 16),
    max_iterations=st.integers(1, 4),
    max_no_novelty=st.integers(1, 3),
    refund_percent=st.sampled_from([0, 50, 80, 99]),
    pricey=st.booleans(),
)
#: What closes every remaining hypothesis once the drawn moves are used up.
DRAIN = Move("finish", score=60)
MAX_STEPS = 40


# -- rendering a move against the frozen context -----------------------------------------


def _reply(assessment: dict[str, Any] | None, confidence: str, evidence: list[str],
           resolve: list[str], new_questions: list[str], note: str,
           nxt: dict[str, Any]) -> str:
    return json.dumps({
        "assessment": assessment,
        "update": {"confidence": confidence, "evidence_ids": evidence,
                   "resolve_questions": resolve, "new_questions": new_questions,
                   "note": note},
        "next": nxt,
    })


def render(move: Move, ctx: dict[str, Any], call_index: int,
           last_query: dict[int, int]) -> str:
    """The reply line for ``move`` given the step's stored context document.

    Valid kinds produce a reply that passes validation unless the drawn move ignores the
    turn's restriction (``obey`` false) or cannot afford its query after a poor
    settlement; invalid kinds break exactly one rule.
    """
    hid = int(ctx["hypothesis"]["id"])
    previous = ctx["previous_result"]
    pending = previous["evidence_id"] if previous else None
    evidence = ctx["evidence"]
    with_findings = [e["evidence_id"] for e in evidence if int(e["item_count"]) > 0]
    own_questions = [x for x in ctx["questions"] if int(x["hypothesis_id"]) == hid]
    assessment = None if pending is None else {
        "score": move.score, "reason": f"assessed at call {call_index}",
        "evidence_ids": [pending]}
    cited = [pending] if pending else []
    note = f"call {call_index}: {move.kind}"

    if move.kind == "garbage":
        return f"I think hypothesis {hid} is right (call {call_index})."
    if move.kind == "bad_evidence":
        return _reply(assessment, "plausible", [*cited, "E999"], [], [], note,
                      {"action": "finish", "reason": "done"})
    if move.kind == "bad_question":
        return _reply(assessment, "plausible", cited, ["Q999"], [], note,
                      {"action": "finish", "reason": "done"})
    if move.kind == "bad_assessment":
        # Missing when a result is pending; unexpected (and unbound) when none is.
        wrong = None if pending else {"score": move.score, "reason": "x",
                                      "evidence_ids": ["E1"]}
        return _reply(wrong, "plausible", [], [], [], note,
                      {"action": "finish", "reason": "done"})
    if move.kind == "dup_question":
        open_own = [x["text"] for x in own_questions if x["status"] == "open"]
        text = open_own[0].upper() if open_own else "Is it the divisor?"
        repeats = [text] if open_own else [text, f"  {text.lower()} "]
        return _reply(assessment, "plausible", cited, [], repeats, note,
                      {"action": "finish", "reason": "done"})

    # Valid kinds.
    action = move.kind
    index = move.query
    if action == "repeat":
        action, index = "query", last_query.get(hid, move.query)
    if action == "query" and move.obey:
        cost = int(ctx["budget"]["costs_units"][QUERIES[index][0]])
        if "query" not in ctx["allowed_actions"]:
            action = "finish"
        elif cost > int(ctx["hypothesis"]["balance_units"]):
            affordable = [i for i, (op, _) in enumerate(QUERIES)
                          if int(ctx["budget"]["costs_units"][op])
                          <= int(ctx["hypothesis"]["balance_units"])]
            if affordable:
                index = affordable[0]
            else:
                action = "finish"
    confidence = move.confidence
    if confidence in SUPPORT and action == "reject":
        confidence = "weakened"
    if confidence in SUPPORT:
        if with_findings:
            cited = sorted({*cited, with_findings[-1]})
        else:
            confidence = "plausible"
    resolve: list[str] = []
    if move.resolve and own_questions:
        if not cited and evidence:
            cited = [evidence[-1]["evidence_id"]]
        if cited or all(x["status"] == "resolved" for x in own_questions):
            resolve = [x["question_id"] for x in own_questions]
    asked = [f"What does call {call_index} show for hypothesis {hid}?"] if move.ask else []
    if action == "query":
        op, args = QUERIES[index]
        nxt: dict[str, Any] = {"action": "query", "operation": op, "arguments": args}
    else:
        nxt = {"action": action, "reason": f"{action} at call {call_index}"}
    return _reply(assessment, confidence, cited, resolve, asked, note, nxt)


# -- driving one run ---------------------------------------------------------------------


@dataclass
class Run:
    """What one driven run did: the exact reply lines and the operator actions."""

    case: Case
    ended: bool = False
    """The case completed, or stopped blocked without a resume, within ``MAX_STEPS``."""
    lines: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    outcomes: list[tuple[str, str | None, int | None]] = field(default_factory=list)


#: RAM-backed temporary files where available: the engine commits several times per step
#: and on a disk-backed /tmp the WAL syncs double the run time. Semantics are unchanged.
SHM = Path("/dev/shm")


@contextmanager
def fresh_dir() -> Iterator[Path]:
    """A temporary directory per example (function-scoped fixtures do not reset between
    Hypothesis examples)."""
    where = str(SHM) if SHM.is_dir() and os.access(SHM, os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="budget-props-", dir=where) as tmp:
        yield Path(tmp)


def _context(case: Case, path: str) -> dict[str, Any]:
    with case.store.session() as s:
        art = Store.get_artifact(s, case.case_id, path)
    assert art is not None
    return dict(json.loads(art.data))


def _record(run: Run, outcome: Outcome) -> None:
    run.actions.append("step")
    run.outcomes.append((outcome.outcome, outcome.reason, outcome.hypothesis_id))


def drive(root: Path, policy: Policy, plan: list[Move], resume: bool) -> Run:
    """Run ``plan`` through the real Investigator, rendering each move for its context."""
    case = make_case(root, replies=[])
    run = Run(case)
    inv = case.investigator(policy.config())
    pending_moves = list(plan)
    last_query: dict[int, int] = {}
    for _ in range(MAX_STEPS):
        key = inv.next_step(case.case_id)
        if isinstance(key, Outcome):
            if key.outcome == BLOCKED and resume:
                operations.resume(case.store, case.case_id)
                run.actions.append("resume")
                continue
            run.ended = True
            return run
        built = inv.stages.run("build_context", key).output
        move = None
        if not built["finalize"]:
            assert built["call_index"] == len(run.lines)
            move = pending_moves.pop(0) if pending_moves else DRAIN
            ctx = _context(case, built["context_path"])
            run.lines.append(render(move, ctx, len(run.lines), last_query))
            with case.replies_path.open("a") as fh:
                fh.write(run.lines[-1] + "\n")
        out = inv.step(case.case_id)
        _record(run, out)
        if out.outcome == PROGRESSED and move is not None and out.hypothesis_id is not None:
            nxt = json.loads(run.lines[-1])["next"]
            if nxt["action"] == "query":
                last_query[out.hypothesis_id] = QUERIES.index(
                    (nxt["operation"], nxt["arguments"]))
    return run  # not ended: the checks report what went wrong before this is asserted


def replay(root: Path, policy: Policy, first: Run) -> Run:
    """The same reply lines and operator actions on a fresh store."""
    case = make_case(root, replies=list(first.lines))
    run = Run(case, lines=list(first.lines))
    inv = case.investigator(policy.config())
    for action in first.actions:
        if action == "resume":
            operations.resume(case.store, case.case_id)
            run.actions.append("resume")
        else:
            _record(run, inv.step(case.case_id))
    return run


# -- reading the store -------------------------------------------------------------------


@dataclass
class Snapshot:
    """The rows the properties read, in a stable order."""

    accounts: list[BudgetAccount]
    ledger: list[LedgerEntry]
    evidence: list[Evidence]
    plans: list[Plan]
    checkpoints: list[Checkpoint]
    states: list[dict[str, Any]]
    summary: bytes | None


def snapshot(case: Case) -> Snapshot:
    cid = case.case_id
    with case.store.session() as s:
        accounts = list(s.exec(select(BudgetAccount).where(BudgetAccount.case_id == cid)
                               .order_by(col(BudgetAccount.hypothesis_id))).all())
        ledger = list(s.exec(select(LedgerEntry).where(LedgerEntry.case_id == cid)
                             .order_by(col(LedgerEntry.id))).all())
        evidence = list(s.exec(select(Evidence).where(Evidence.case_id == cid)
                               .order_by(col(Evidence.ordinal))).all())
        plans = list(s.exec(select(Plan).where(Plan.case_id == cid)
                            .order_by(col(Plan.step_seq))).all())
        cps = list(s.exec(select(Checkpoint).where(Checkpoint.case_id == cid)
                          .order_by(col(Checkpoint.seq))).all())
        states = []
        for cp in cps:
            art = Store.get_artifact(s, cid, cp.state_path)
            assert art is not None
            states.append(dict(json.loads(art.data)))
    try:
        summary: bytes | None = operations.summary_bytes(case.store, cid)
    except InvestigationError as exc:
        assert exc.code == "SUMMARY_NOT_READY"
        summary = None
    return Snapshot(accounts, ledger, evidence, plans, cps, states, summary)


# -- the properties ----------------------------------------------------------------------


def check_ledger_identity(snap: Snapshot, policy: Policy) -> None:
    """Property 1: balance = credit - reservations + refunds, never negative."""
    assert snap.accounts, "no accounts were created"
    for a in snap.accounts:
        rows = [r for r in snap.ledger if r.hypothesis_id == a.hypothesis_id]
        assert rows and rows[0].kind == "credit" and rows[0].step_seq == 0
        assert rows[0].amount_units == a.credit_units == policy.credit
        assert [r.kind for r in rows[1:]].count("credit") == 0
        running = 0
        for r in rows:
            assert r.kind in ("credit", "reserve", "refund"), r.kind
            assert (r.amount_units > 0) == (r.kind != "reserve"), (r.kind, r.amount_units)
            running += r.amount_units
            assert r.balance_after_units == running, \
                f"H{a.hypothesis_id} step {r.step_seq} {r.kind}: balance_after " \
                f"{r.balance_after_units}, running ledger sum {running}"
            assert r.balance_after_units >= 0, \
                f"H{a.hypothesis_id} negative balance at step {r.step_seq}: {r.balance_after_units}"
        reserved = -sum(r.amount_units for r in rows if r.kind == "reserve")
        refunded = sum(r.amount_units for r in rows if r.kind == "refund")
        assert a.balance_units == a.credit_units - reserved + refunded, \
            f"H{a.hypothesis_id}: balance {a.balance_units} != {a.credit_units} - " \
            f"{reserved} + {refunded}"
        assert a.balance_units >= 0
        # Every published state shows the ledger balance as of its step.
        for state in snap.states:
            shown = next(x for x in state["accounts"]
                         if x["hypothesis_id"] == a.hypothesis_id)
            as_of = sum(r.amount_units for r in rows if r.step_seq <= state["seq"])
            assert shown["balance_units"] == as_of >= 0, \
                f"H{a.hypothesis_id} state {state['seq']}: {shown['balance_units']} vs {as_of}"


def check_refunds(snap: Snapshot, policy: Policy) -> None:
    """Property 2: refunds below cost, zero for empty/duplicate findings, per formula;
    a repeated query of a hypothesis is a duplicate."""
    costs = policy.config().budget.costs
    refunds = {r.reference: r for r in snap.ledger if r.kind == "refund"}
    reserves = {(r.hypothesis_id, r.step_seq): r for r in snap.ledger if r.kind == "reserve"}
    seen_keys: dict[int, set[str]] = {}
    seen_results: dict[int, set[tuple[str, str, str]]] = {}
    for e in snap.evidence:
        h = e.hypothesis_id
        # Duplicates and novelty, recomputed from the stored findings.
        result = (e.operation, e.arguments_json, e.findings_json)
        repeat = result in seen_results.setdefault(h, set())
        seen_results[h].add(result)
        keys = set(json.loads(e.item_keys_json))
        assert e.duplicate == repeat, f"{e.evidence_id}: duplicate={e.duplicate}, repeat={repeat}"
        expected_new = 0 if repeat else len(keys - seen_keys.setdefault(h, set()))
        assert e.new_item_count == expected_new, e.evidence_id
        seen_keys[h] |= keys
        # The charge that paid for it.
        assert e.cost_units == costs[e.operation] > 0
        charge = reserves[(h, e.step_seq)]
        assert charge.amount_units == -e.cost_units
        # Its settlement.
        refund = e.refund_units or 0
        row = refunds.get(e.evidence_id)
        if not e.assessed:
            assert e.refund_units is None and row is None, e.evidence_id
            continue
        assert 0 <= refund < e.cost_units, \
            f"{e.evidence_id}: refund {refund} not strictly below cost {e.cost_units}"
        if e.item_count == 0 or e.duplicate:
            assert refund == 0, f"{e.evidence_id}: empty/duplicate finding refunded {refund}"
        novelty = 0 if (e.duplicate or e.item_count == 0) else \
            1000 * e.new_item_count // e.item_count
        assert e.assessment_score is not None
        formula = e.cost_units * policy.refund_percent * novelty * e.assessment_score \
            // (100 * 1000 * 100)
        assert refund == min(formula, e.cost_units - 1), e.evidence_id
        assert (row.amount_units if row else 0) == refund, e.evidence_id
        if row is not None:
            assert row.hypothesis_id == h and row.step_seq > e.step_seq
    assert set(refunds) <= {e.evidence_id for e in snap.evidence}


def terminal_steps(snap: Snapshot) -> dict[int, int]:
    """The checkpoint seq at which each hypothesis's account first became terminal."""
    found: dict[int, int] = {}
    for state in snap.states:
        for x in state["accounts"]:
            if x["status"] in TERMINAL:
                found.setdefault(int(x["hypothesis_id"]), int(state["seq"]))
    return found


def check_terminal_accounts_stay_put(snap: Snapshot) -> None:
    """Property 3: no step after the one that made an account terminal selects, plans for,
    charges or refunds that hypothesis, and its state no longer changes."""
    ended = terminal_steps(snap)
    for a in snap.accounts:
        if a.status in TERMINAL:
            assert a.hypothesis_id in ended
    for h, at in ended.items():
        late = [cp.seq for cp in snap.checkpoints if cp.seq > at and cp.hypothesis_id == h]
        assert not late, f"H{h} terminal at step {at} but selected again at steps {late}"
        acted = [p.step_seq for p in snap.plans if p.step_seq > at and p.hypothesis_id == h]
        assert not acted, f"H{h} terminal at step {at} but planned at steps {acted}"
        moved = [r.step_seq for r in snap.ledger if r.step_seq > at and r.hypothesis_id == h]
        assert not moved, f"H{h} terminal at step {at} but ledger moved at steps {moved}"
        frozen = None
        for state in snap.states:
            if state["seq"] < at:
                continue
            x = next(x for x in state["accounts"] if x["hypothesis_id"] == h)
            now = (x["status"], x["balance_units"], x["iterations"], x["turns"],
                   x["confidence"], x["pending_evidence_id"])
            assert x["status"] in TERMINAL, f"H{h} left {now[0]} at {state['seq']}"
            assert frozen is None or now == frozen, f"H{h} changed after step {at}"
            frozen = now
        closing = [p for p in snap.plans if p.step_seq == at and p.hypothesis_id == h]
        assert all(p.action in ("finish", "reject") for p in closing)


def check_iteration_cap(snap: Snapshot, policy: Policy) -> None:
    """Property 5: at most ``max_iterations_per_hypothesis`` research iterations; after
    the cap only one (closing) decision."""
    cap = policy.max_iterations
    for a in snap.accounts:
        h = a.hypothesis_id
        reserves = [r for r in snap.ledger if r.hypothesis_id == h and r.kind == "reserve"]
        queries = [p for p in snap.plans if p.hypothesis_id == h and p.action == "query"]
        own = [e for e in snap.evidence if e.hypothesis_id == h]
        assert len(reserves) <= cap, f"H{h}: {len(reserves)} reservations, cap {cap}"
        assert a.iterations == len(reserves) == len(queries) == len(own)
        if len(reserves) == cap:
            last = reserves[-1].step_seq
            after = [p for p in snap.plans if p.hypothesis_id == h and p.step_seq > last]
            assert len(after) <= 1 and all(p.action in ("finish", "reject") for p in after)


def comparable(snap: Snapshot) -> dict[str, Any]:
    """The meaningful columns (no autoincrement ids, no wall-clock times)."""
    return {
        "ledger": [(r.case_id, r.revision, r.hypothesis_id, r.step_seq, r.kind,
                    r.amount_units, r.balance_after_units, r.reference) for r in snap.ledger],
        "evidence": [(e.evidence_id, e.step_seq, e.hypothesis_id, e.fingerprint,
                      e.item_count, e.new_item_count, e.duplicate, e.cost_units,
                      e.assessment_score, e.refund_units, e.artifact_sha256)
                     for e in snap.evidence],
        "checkpoints": [(c.seq, c.parent_hash, c.hash, c.context_sha256, c.hypothesis_id,
                         c.outcome, c.reason) for c in snap.checkpoints],
        "accounts": [(a.hypothesis_id, a.status, a.disposition_reason, a.balance_units,
                      a.iterations, a.turns) for a in snap.accounts],
    }


def check_replay(first: Snapshot, second: Snapshot, completed: bool) -> None:
    """Property 4: the same decisions on a fresh store give the same rows and bytes."""
    a, b = comparable(first), comparable(second)
    for name in a:
        assert a[name] == b[name], f"replay differs in {name}"
    assert (first.summary is not None) == completed
    assert first.summary == second.summary, "summary.md differs between replays"


def check_all(root: Path, policy: Policy, plan: list[Move], resume: bool) -> None:
    first = drive(root / "first", policy, plan, resume)
    snap = snapshot(first.case)
    completed = bool(first.outcomes) and first.outcomes[-1][0] == COMPLETED
    for outcome, reason, _ in first.outcomes:
        event(f"outcome {outcome} {reason or ''}".strip())
    for a in snap.accounts:
        why = (a.disposition_reason or "").split(":")[0]
        event(f"account {a.status}" + (f" ({why})" if why in rules.CLOSING_REASONS else ""))
    if any(e.duplicate for e in snap.evidence):
        event("duplicate evidence")
    if any(e.item_count == 0 for e in snap.evidence):
        event("empty evidence")
    check_ledger_identity(snap, policy)
    check_refunds(snap, policy)
    check_terminal_accounts_stay_put(snap)
    check_iteration_cap(snap, policy)
    assert first.ended, f"no end within {MAX_STEPS} steps: {first.outcomes}"
    second = replay(root / "second", policy, first)
    assert second.outcomes == first.outcomes
    check_replay(snap, snapshot(second.case), completed)


# -- the test ----------------------------------------------------------------------------

PROPS = settings(max_examples=15, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@PROPS
@given(policy=policies, plan=st.lists(moves, min_size=2, max_size=7), resume=st.booleans())
# An empty query, a repeated (duplicate) one assessed as useful, a query refused on the
# closing turn of the iteration cap, closing with a resolution; a partly overlapping query
# on the other side.
@example(policy=Policy(12, 3, 3, 80, False),
         plan=[Move("query", 0, confidence="weak"), Move("query", 5), Move("query", 0),
               Move("repeat", score=90, ask=True),
               Move("query", 3, score=100, resolve=True, obey=False),
               Move("query", 6, score=100, resolve=True), Move("query", 2, score=100),
               Move("query", 1, score=100)],
         resume=True)
# Low information after an empty result, three invalid replies (blocked, resumed), and a
# finished hypothesis that outranks the active one (the scheduler must skip it).
@example(policy=Policy(10, 4, 1, 99, False),
         plan=[Move("query", 5, confidence="weak"), Move("query", 0),
               Move("query", 4, score=100, confidence="supported"),
               Move("bad_evidence"), Move("garbage"), Move("bad_question"),
               Move("finish", score=100, confidence="strongly_supported"),
               Move("query", 1, obey=False), Move("dup_question", ask=True)],
         resume=True)
# A poorly assessed result leaves too little for the next query: unaffordable replies are
# rejected (never charged into a negative balance).
@example(policy=Policy(4, 3, 3, 80, False),
         plan=[Move("query", 4), Move("query", 1),
               Move("query", 0, score=0, obey=False), Move("query", 2, score=0, obey=False)],
         resume=False)
# Credit below the cheapest action: exhausted before any turn.
@example(policy=Policy(1, 2, 2, 80, True), plan=[], resume=False)
def test_random_decision_sequences_keep_the_budget_rules(
        policy: Policy, plan: list[Move], resume: bool) -> None:
    with fresh_dir() as root:
        check_all(root, policy, plan, resume)
