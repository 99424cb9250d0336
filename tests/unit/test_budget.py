"""Budget rules (pure arithmetic) and the BudgetManager on a real store
(seed 000, "Budget and stopping")."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import update
from sqlmodel import col, select

from investigation.budget import BudgetManager, rules
from investigation.config import BudgetConfig, InvestigationConfig, LimitsConfig, LoopConfig
from investigation.errors import InvestigationError
from investigation.evidence import EvidenceStore
from investigation.store.models import BudgetAccount, Evidence, LedgerEntry, RevisionRecord
from tests.casekit import Case, make_case

PROPS = settings(max_examples=300, deadline=None, database=None)

costs = st.integers(1, 1000)
scores = st.integers(0, 100)
novelties = st.integers(0, 1000)
percents = st.integers(0, 99)


# -- novelty -----------------------------------------------------------------------------


def test_novelty_overlap_cap_is_the_share_of_new_items() -> None:
    assert rules.novelty_permille(10, 3, False) == 300
    assert rules.novelty_permille(3, 2, False) == 666
    assert rules.novelty_permille(4, 4, False) == 1000


@pytest.mark.parametrize(("items", "new", "duplicate"), [
    (0, 0, False), (5, 0, False), (5, 5, True), (5, 3, True), (0, 3, False)])
def test_empty_duplicate_or_fully_seen_findings_have_no_novelty(items: int, new: int,
                                                               duplicate: bool) -> None:
    assert rules.novelty_permille(items, new, duplicate) == 0


@PROPS
@given(st.integers(0, 500), st.integers(0, 600), st.booleans())
def test_novelty_is_bounded(items: int, new: int, duplicate: bool) -> None:
    n = rules.novelty_permille(items, new, duplicate)
    assert 0 <= n <= 1000
    if duplicate or items == 0 or new == 0:
        assert n == 0
    else:
        assert n == 1000 * min(new, items) // items


# -- refund ------------------------------------------------------------------------------


@pytest.mark.parametrize(("cost", "score", "novelty", "pct", "expected"), [
    (4, 100, 1000, 80, 3),        # 4*80*1000*100 // 10**7 = 3.2 -> 3
    (10, 50, 500, 80, 2),         # 20_000_000 // 10**7
    (1000, 90, 666, 80, 479),     # 4_795_200_000 // 10**7
    (3, 90, 1000, 80, 2),         # 2.16 -> 2
    (2, 95, 666, 80, 1),          # 1.01 -> 1
    (100, 100, 1000, 99, 99),
    (1, 100, 1000, 99, 0),        # cost 1 can never refund
    (1000, 100, 1000, 0, 0),      # refunds disabled
])
def test_refund_formula_examples(cost: int, score: int, novelty: int, pct: int,
                                 expected: int) -> None:
    assert rules.refund_units(cost, score, novelty, pct) == expected


def test_refund_is_capped_strictly_below_cost_even_with_a_100_percent_cap() -> None:
    # BudgetConfig forbids 100 %, but the arithmetic itself keeps the refund below cost.
    assert rules.refund_units(5, 100, 1000, 100) == 4
    assert rules.refund_units(1, 100, 1000, 100) == 0


def test_refund_clamps_out_of_range_inputs() -> None:
    assert rules.refund_units(10, 150, 1000, 80) == rules.refund_units(10, 100, 1000, 80)
    assert rules.refund_units(10, 100, 5000, 80) == rules.refund_units(10, 100, 1000, 80)
    assert rules.refund_units(10, -5, 1000, 80) == 0
    assert rules.refund_units(0, 100, 1000, 80) == 0


@PROPS
@given(costs, scores, novelties, percents)
def test_refund_is_below_cost_and_within_the_cap(cost: int, score: int, novelty: int,
                                                 pct: int) -> None:
    refund = rules.refund_units(cost, score, novelty, pct)
    assert 0 <= refund < cost
    assert refund * 100 <= cost * pct
    assert refund == min(cost * pct * novelty * score // (100 * 1000 * 100), cost - 1)


@PROPS
@given(costs, scores, percents)
def test_no_novelty_no_refund(cost: int, score: int, pct: int) -> None:
    assert rules.refund_units(cost, score, 0, pct) == 0
    for items, new, dup in ((0, 0, False), (7, 7, True), (7, 0, False)):
        assert rules.refund_units(cost, score, rules.novelty_permille(items, new, dup),
                                  pct) == 0


@PROPS
@given(costs, novelties, percents)
def test_no_utility_no_refund(cost: int, novelty: int, pct: int) -> None:
    assert rules.refund_units(cost, 0, novelty, pct) == 0


@PROPS
@given(costs, scores, scores, novelties, percents)
def test_refund_is_monotone_in_score(cost: int, s1: int, s2: int, novelty: int,
                                     pct: int) -> None:
    lo, hi = sorted((s1, s2))
    assert rules.refund_units(cost, lo, novelty, pct) <= rules.refund_units(cost, hi, novelty,
                                                                            pct)


@PROPS
@given(costs, scores, novelties, novelties, percents)
def test_refund_is_monotone_in_novelty(cost: int, score: int, n1: int, n2: int,
                                       pct: int) -> None:
    lo, hi = sorted((n1, n2))
    assert rules.refund_units(cost, score, lo, pct) <= rules.refund_units(cost, score, hi, pct)


def test_refund_grows_strictly_somewhere_in_score_and_novelty() -> None:
    # Monotone and not constant: both signals matter.
    assert rules.refund_units(100, 50, 1000, 80) < rules.refund_units(100, 100, 1000, 80)
    assert rules.refund_units(100, 100, 500, 80) < rules.refund_units(100, 100, 1000, 80)


# -- costs and projection ----------------------------------------------------------------


def test_action_costs() -> None:
    budget = BudgetConfig(test_costs={"automated": 7})
    assert rules.action_cost(budget, "finish") == 0
    assert rules.action_cost(budget, "reject") == 0
    assert rules.action_cost(budget, "query", operation="db.query") == 4
    assert rules.action_cost(budget, "query", operation="no.such") is None
    assert rules.action_cost(budget, "test", test_kind="automated") == 7
    assert rules.action_cost(budget, "test", test_kind="human") is None
    assert rules.cheapest_action_cost(budget) == 1
    assert rules.cheapest_action_cost(BudgetConfig(
        costs=dict.fromkeys(BudgetConfig().costs, 9), test_costs={"human": 5})) == 5


def test_budget_config_refuses_non_positive_costs_and_full_refunds() -> None:
    with pytest.raises(ValueError):
        BudgetConfig(costs={**BudgetConfig().costs, "db.query": 0})
    with pytest.raises(ValueError):
        BudgetConfig(test_costs={"human": 0})
    with pytest.raises(ValueError):
        BudgetConfig(max_refund_percent=100)


def test_budget_config_has_a_cost_for_every_operation_and_no_other() -> None:
    """A table naming some operations keeps the defaults of the others (it was refused
    with the others named, which hid a wrong value: a hostile-input trial)."""
    from investigation.config import DEFAULT_COSTS, OPERATIONS

    costs = BudgetConfig().costs
    assert set(costs) == set(OPERATIONS) == set(DEFAULT_COSTS)
    for op in costs:
        partial = BudgetConfig(costs={op: 7}).costs
        assert partial == {**DEFAULT_COSTS, op: 7}
    with pytest.raises(ValueError, match=r"costs must be positive integers: \['db.query'\]"):
        BudgetConfig(costs={"db.query": -4})
    with pytest.raises(ValueError, match="unknown operations"):
        BudgetConfig(costs={**costs, "db.drop": 1})


def test_project_settles_then_reserves() -> None:
    p = rules.project(BudgetConfig(), 10, (4, 1000), 100, "query", 4)
    assert (p.refund_units, p.reserve_units, p.balance_after_settlement, p.balance_after,
            p.status_after) == (3, 4, 13, 9, rules.ACTIVE)
    p = rules.project(BudgetConfig(), 2, None, None, "query", 4)
    assert (p.refund_units, p.balance_after) == (0, -2)
    p = rules.project(BudgetConfig(), 2, (4, 1000), 100, "reject", 0)
    assert (p.reserve_units, p.balance_after, p.status_after) == (0, 5, rules.REJECTED)
    assert rules.project(BudgetConfig(), 2, None, None, "finish", 0).status_after == \
        rules.FINISHED
    assert rules.project(BudgetConfig(), 9, None, None, "test", 5).balance_after == 4


@PROPS
@given(st.integers(0, 200), costs, novelties, scores, st.sampled_from(list(BudgetConfig().costs)))
def test_projection_matches_settle_and_reserve_arithmetic(balance: int, pending_cost: int,
                                                          novelty: int, score: int,
                                                          op: str) -> None:
    budget = BudgetConfig()
    cost = budget.costs[op]
    p = rules.project(budget, balance, (pending_cost, novelty), score, "query", cost)
    refund = rules.refund_units(pending_cost, score, novelty, budget.max_refund_percent)
    assert p.refund_units == refund
    assert p.balance_after_settlement == balance + refund
    assert p.balance_after == balance + refund - cost


# -- BudgetManager on a real store -------------------------------------------------------


@pytest.fixture
def case(tmp_path: Path) -> Case:
    return make_case(tmp_path / "case")


def manager(**budget: int) -> BudgetManager:
    return BudgetManager(BudgetConfig(**budget), LoopConfig())


def ledger(case: Case, revision: int, hid: int) -> list[LedgerEntry]:
    with case.store.session() as s:
        return list(s.exec(select(LedgerEntry).where(
            LedgerEntry.case_id == case.case_id, LedgerEntry.revision == revision,
            LedgerEntry.hypothesis_id == hid).order_by(col(LedgerEntry.id))).all())


def test_ensure_accounts_credits_once_and_never_refills(case: Case) -> None:
    rev = 1
    bm = manager(credit_units=40)
    with case.store.session() as s:
        accounts = bm.ensure_accounts(s, case.case_id, rev, [2, 1])
        assert [a.hypothesis_id for a in accounts] == [1, 2]
        assert [(a.credit_units, a.balance_units) for a in accounts] == [(40, 40), (40, 40)]
        bm.reserve(s, accounts[0], 10, 1, "step 1")
    with case.store.session() as s:
        again = manager(credit_units=999).ensure_accounts(s, case.case_id, rev, [1, 2])
        assert [(a.credit_units, a.balance_units) for a in again] == [(40, 30), (40, 40)]
    rows = ledger(case, rev, 1)
    assert [(r.kind, r.amount_units, r.balance_after_units) for r in rows] == \
        [("credit", 40, 40), ("reserve", -10, 30)]
    assert len([r for r in ledger(case, rev, 2) if r.kind == "credit"]) == 1


def test_verify_origins_accepts_engine_movements_and_detects_tampering(case: Case) -> None:
    rev = 1
    bm = manager()
    with case.store.session() as s:
        account = bm.ensure_accounts(s, case.case_id, rev, [1])[0]
        bm.reserve(s, account, 4, 1, "step 1")
        bm.verify_origins(s, account)  # balance 56 == 60 - 4
    with case.store.session() as s:
        s.execute(update(BudgetAccount).where(
            col(BudgetAccount.case_id) == case.case_id, col(BudgetAccount.revision) == rev)
            .values(balance_units=BudgetAccount.balance_units + 25))
    with case.store.session() as s:
        account = s.exec(select(BudgetAccount).where(BudgetAccount.case_id == case.case_id,
                                                     BudgetAccount.revision == rev)).one()
        assert account.balance_units == 81
        with pytest.raises(InvestigationError) as info:
            bm.verify_origins(s, account)
    assert info.value.code == "BUDGET_ORIGIN_MISMATCH"


def test_verify_origins_detects_a_changed_credit(case: Case) -> None:
    rev = 1
    bm = manager()
    with case.store.session() as s:
        account = bm.ensure_accounts(s, case.case_id, rev, [1])[0]
        account.credit_units = 500
        with pytest.raises(InvestigationError) as info:
            bm.verify_origins(s, account)
    assert info.value.code == "BUDGET_ORIGIN_MISMATCH"


def test_reserve_refuses_an_insufficient_balance_and_changes_nothing(case: Case) -> None:
    rev = 1
    bm = manager(credit_units=5)
    with case.store.session() as s:
        account = bm.ensure_accounts(s, case.case_id, rev, [1])[0]
        with pytest.raises(InvestigationError) as info:
            bm.reserve(s, account, 6, 1, "too much")
        assert info.value.code == "BUDGET_INSUFFICIENT"
        assert account.balance_units == 5
        with pytest.raises(InvestigationError) as info:
            bm.reserve(s, account, 0, 1, "free")
        assert info.value.code == "BUDGET_COST_INVALID"
        bm.reserve(s, account, 5, 1, "all of it")
        assert account.balance_units == 0
    assert [r.kind for r in ledger(case, rev, 1)] == ["credit", "reserve"]


def test_settle_refunds_by_the_rules_and_clears_the_pending_finding(case: Case) -> None:
    rev = 1
    bm = manager()
    with case.store.session() as s:
        account = bm.ensure_accounts(s, case.case_id, rev, [1])[0]
        bm.reserve(s, account, 4, 1, "step 1 db.query")
        items = [{"key": f"row:{i}", "text": str(i)} for i in range(3)]
        evidence = EvidenceStore.record(
            s, case_id=case.case_id, revision=rev, step_seq=1, hypothesis_id=1,
            result={"operation": "db.query", "arguments": {"sql": "x"}, "items": items},
            cost_units=4)
        account.pending_evidence_id = evidence.evidence_id
        refund = bm.settle(s, account, evidence, 90, 2)
        assert refund == rules.refund_units(4, 90, 1000, 80) == 2
        assert account.pending_evidence_id is None
        assert account.balance_units == 58
        assert (evidence.assessed, evidence.assessment_score, evidence.refund_units) == \
            (True, 90, 2)
        bm.verify_origins(s, account)
    assert [(r.kind, r.amount_units) for r in ledger(case, rev, 1)] == \
        [("credit", 60), ("reserve", -4), ("refund", 2)]


def test_settling_an_empty_finding_writes_no_refund(case: Case) -> None:
    rev = 1
    bm = manager()
    with case.store.session() as s:
        account = bm.ensure_accounts(s, case.case_id, rev, [1])[0]
        bm.reserve(s, account, 3, 1, "step 1")
        evidence = EvidenceStore.record(
            s, case_id=case.case_id, revision=rev, step_seq=1, hypothesis_id=1,
            result={"operation": "source.search", "arguments": {}, "items": []},
            cost_units=3)
        account.pending_evidence_id = evidence.evidence_id
        assert bm.settle(s, account, evidence, 100, 2) == 0
        assert evidence.assessed and evidence.refund_units == 0
        assert account.pending_evidence_id is None
    assert [r.kind for r in ledger(case, rev, 1)] == ["credit", "reserve"]


def test_complete_and_reject_refuse_a_pending_finding() -> None:
    account = BudgetAccount(case_id="c", revision=1, hypothesis_id=1, credit_units=60,
                            balance_units=42, pending_evidence_id="E3")
    for close in (BudgetManager.complete, BudgetManager.reject):
        with pytest.raises(InvestigationError) as info:
            close(account, "done")
        assert info.value.code == "BUDGET_PENDING_ACTION"
        assert account.status == rules.ACTIVE
    account.pending_evidence_id = None
    BudgetManager.complete(account, "enough evidence")
    assert (account.status, account.disposition_reason, account.balance_units) == \
        (rules.FINISHED, "enough evidence", 42)
    other = BudgetAccount(case_id="c", revision=1, hypothesis_id=2, credit_units=60,
                          balance_units=17)
    BudgetManager.reject(other, "contradicted")
    assert (other.status, other.balance_units) == (rules.REJECTED, 17)


def _policy_case(tmp_path: Path) -> Case:
    case = make_case(tmp_path / "policy")
    with case.store.session() as s:
        rev = s.exec(select(RevisionRecord).where(RevisionRecord.case_id == case.case_id)).one()
        assert rev.policy_json is None  # nothing frozen before the first step
    return case


def _freeze(case: Case, config: InvestigationConfig, explicit: bool) -> InvestigationConfig:
    with case.store.session() as s:
        rev = s.exec(select(RevisionRecord).where(RevisionRecord.case_id == case.case_id)).one()
        return BudgetManager.freeze_policy(s, rev, config, explicit)


def test_freeze_policy_adopts_the_stored_policy_unless_explicit(tmp_path: Path) -> None:
    case = _policy_case(tmp_path)
    first = InvestigationConfig(budget=BudgetConfig(credit_units=33),
                                loop=LoopConfig(max_iterations_per_hypothesis=4))
    assert _freeze(case, first, explicit=False) == first  # first use freezes it
    other = InvestigationConfig(budget=BudgetConfig(credit_units=99))
    adopted = _freeze(case, other, explicit=False)
    assert adopted.budget.credit_units == 33
    assert adopted.loop.max_iterations_per_hypothesis == 4
    assert _freeze(case, first, explicit=True).policy() == first.policy()
    with pytest.raises(InvestigationError) as info:
        _freeze(case, other, explicit=True)
    assert info.value.code == "POLICY_CHANGED"
    # The stored policy is unchanged by the refused attempt.
    assert _freeze(case, InvestigationConfig(), explicit=False).budget.credit_units == 33


def test_freeze_policy_ignores_limits_outside_the_policy(tmp_path: Path) -> None:
    case = _policy_case(tmp_path)
    _freeze(case, InvestigationConfig(), explicit=True)
    bigger = InvestigationConfig(limits=LimitsConfig(max_checkpoints=5))
    assert _freeze(case, bigger, explicit=True).limits.max_checkpoints == 5


def _account(**fields: object) -> BudgetAccount:
    base: dict[str, object] = {"case_id": "c", "revision": 1, "hypothesis_id": 1,
                               "credit_units": 60, "balance_units": 60}
    base.update(fields)
    return BudgetAccount(**base)


def _pending(cost: int, items: int = 3, new: int = 3, duplicate: bool = False) -> Evidence:
    return Evidence(case_id="c", revision=1, step_seq=1, ordinal=1, evidence_id="E1",
                    hypothesis_id=1, operation="db.query", arguments_json="{}",
                    findings_json="[]", item_keys_json="[]", warnings_json="[]",
                    fingerprint="f", item_count=items, new_item_count=new,
                    duplicate=duplicate, cost_units=cost, artifact_path="p",
                    artifact_sha256="s")


def test_closing_reasons() -> None:
    bm = BudgetManager(BudgetConfig(), LoopConfig(max_iterations_per_hypothesis=3,
                                                  max_results_without_novelty=2))
    assert bm.closing_reason(_account(iterations=2, no_novelty_streak=1)) is None
    assert bm.closing_reason(_account(iterations=3)) == "iteration_cap"
    assert bm.closing_reason(_account(no_novelty_streak=2)) == "low_information"
    assert bm.closing_reason(_account(balance_units=0)) == "budget_exhausted"
    # The iteration cap wins over the other reasons, then low information.
    assert bm.closing_reason(_account(iterations=3, no_novelty_streak=2,
                                      balance_units=0)) == "iteration_cap"
    assert bm.closing_reason(_account(no_novelty_streak=2, balance_units=0)) == \
        "low_information"


def test_budget_exhausted_counts_the_best_refund_of_the_pending_result() -> None:
    bm = manager()  # cheapest action 1, refund cap 80 %
    poor = _account(balance_units=0, pending_evidence_id="E1")
    # cost 4, full novelty, score 100: 3 units could come back -> may still act.
    assert bm.closing_reason(poor, _pending(4)) is None
    # No novelty (duplicate or nothing new) or a cost-1 action cannot refund anything.
    assert bm.closing_reason(poor, _pending(4, duplicate=True)) == "budget_exhausted"
    assert bm.closing_reason(poor, _pending(4, new=0)) == "budget_exhausted"
    assert bm.closing_reason(poor, _pending(1)) == "budget_exhausted"
    # With every action at 4, even the best refund (3) cannot pay for one.
    dear = BudgetManager(BudgetConfig(costs=dict.fromkeys(BudgetConfig().costs, 4)),
                         LoopConfig())
    assert dear.closing_reason(poor, _pending(4)) == "budget_exhausted"
    assert dear.closing_reason(_account(balance_units=1, pending_evidence_id="E1"),
                               _pending(4)) is None


def test_exhausted_only_below_the_cheapest_action() -> None:
    budget = BudgetConfig(costs=dict.fromkeys(BudgetConfig().costs, 3))
    bm = BudgetManager(budget, LoopConfig())
    assert bm.closing_reason(_account(balance_units=3)) is None
    assert bm.closing_reason(_account(balance_units=2)) == "budget_exhausted"


def test_automatic_disposition_exhausts_only_idle_poor_accounts() -> None:
    bm = manager()
    poor = _account(balance_units=0)
    bm.apply_automatic_disposition(poor)
    assert poor.status == rules.EXHAUSTED
    assert poor.balance_units == 0
    pending = _account(balance_units=0, pending_evidence_id="E1")
    bm.apply_automatic_disposition(pending)
    assert pending.status == rules.ACTIVE
    rich = _account(balance_units=1)
    bm.apply_automatic_disposition(rich)
    assert rich.status == rules.ACTIVE
    finished = _account(balance_units=0, status=rules.FINISHED)
    bm.apply_automatic_disposition(finished)
    assert finished.status == rules.FINISHED

