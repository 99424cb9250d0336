"""BudgetManager: accounts and ledger in the store (seed 000, "Budget and stopping").

Every balance change is a ledger row unique per (case, revision, hypothesis, step, kind),
so a re-run stage cannot charge or refund twice, and ``balance_units`` always equals
``credit - reservations + refunds`` over the ledger.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import bindparam, case, func
from sqlalchemy import insert as sa_insert
from sqlalchemy import select as sa_select
from sqlmodel import Session, col, select

from investigation.budget import rules
from investigation.config import BudgetConfig, InvestigationConfig, LoopConfig, canonical_json
from investigation.errors import InvestigationError
from investigation.store.engine import core, sha256_hex, table_of
from investigation.store.models import BudgetAccount, Evidence, LedgerEntry, RevisionRecord

# Built once (building a statement costs more than running it on SQLite).
#: Ledger rows are append-only and never written through the ORM: one Core INSERT each
#: (no SQLModel object, nothing pending; decision 72's rule).
_LEDGER_INSERT = sa_insert(table_of(LedgerEntry))


def _ledger(session: Session, **values: Any) -> None:
    core(session).execute(_LEDGER_INSERT, values)


_ACCOUNTS = select(BudgetAccount).where(col(BudgetAccount.case_id) == bindparam("case_id"),
                                        col(BudgetAccount.revision) == bindparam("revision"))
#: Per hypothesis of a case revision: the ledger's sum, its number of credit entries and
#: the credited amount.
_LEDGER_SUMS = sa_select(
    col(LedgerEntry.hypothesis_id), func.sum(col(LedgerEntry.amount_units)),
    func.sum(case((col(LedgerEntry.kind) == "credit", 1), else_=0)),
    func.sum(case((col(LedgerEntry.kind) == "credit", col(LedgerEntry.amount_units)),
                  else_=0))).where(
    col(LedgerEntry.case_id) == bindparam("case_id"),
    col(LedgerEntry.revision) == bindparam("revision")).group_by(col(LedgerEntry.hypothesis_id))


_LE = table_of(LedgerEntry).c


def ledger_sums_of(hypothesis_id: Any) -> tuple[Any, Any, Any]:
    """Scalar subqueries of one hypothesis's ledger (of the ``case_id``/``revision``
    parameters): its sum, number of credit entries and credited amount, for a query that
    reads them together with other rows (``hypothesis_id``: the column to correlate on)."""
    where = (_LE.case_id == bindparam("case_id"), _LE.revision == bindparam("revision"),
             _LE.hypothesis_id == hypothesis_id)
    return (
        sa_select(func.coalesce(func.sum(_LE.amount_units), 0)).where(*where)
        .scalar_subquery(),
        sa_select(func.count()).select_from(table_of(LedgerEntry)).where(
            *where, _LE.kind == "credit").scalar_subquery(),
        sa_select(func.coalesce(func.sum(_LE.amount_units), 0)).where(
            *where, _LE.kind == "credit").scalar_subquery())


class BudgetManager:
    """Applies the frozen budget policy to hypothesis accounts.

    Args:
        budget: the frozen budget policy of the revision.
        loop: the frozen loop bounds of the revision.
    """

    def __init__(self, budget: BudgetConfig, loop: LoopConfig) -> None:
        self.budget = budget
        self.loop = loop

    # -- policy --------------------------------------------------------------------------

    @staticmethod
    def freeze_policy(session: Session, revision: RevisionRecord, config: InvestigationConfig,
                      explicit: bool) -> InvestigationConfig:
        """Freeze the policy of ``revision`` on first use and return the effective config.

        When no config was given explicitly, the stored policy is adopted. An explicit
        config whose policy differs from the stored one is refused.

        Raises:
            InvestigationError: ``POLICY_CHANGED`` for an explicit, different policy, or a
            stored policy that no longer matches its hash.
        """
        wanted = config.policy()
        if revision.policy_json is None:
            data = canonical_json(wanted)
            revision.policy_json = data.decode("utf-8")
            revision.policy_sha256 = sha256_hex(data)
            session.add(revision)
            session.flush()
            return config
        if sha256_hex(revision.policy_json.encode("utf-8")) != revision.policy_sha256:
            raise InvestigationError(
                "POLICY_CHANGED",
                "the frozen policy of this revision no longer matches its stored hash; "
                "the store was changed outside the engine", stored_sha256=revision.policy_sha256)
        stored = json.loads(revision.policy_json)
        if explicit and sha256_hex(canonical_json(wanted)) != revision.policy_sha256:
            raise InvestigationError(
                "POLICY_CHANGED",
                "the budget/loop policy of this revision is frozen and differs from the given "
                "config; run without --config to adopt the stored policy",
                stored_sha256=revision.policy_sha256,
            )
        effective = config.model_copy(update={
            "loop": LoopConfig.model_validate(stored["loop"]),
            "budget": BudgetConfig.model_validate(stored["budget"]),
        })
        loop, limits = effective.loop, effective.limits
        if loop.early_diagnosis and \
                loop.early_diagnosis_min_evidence > limits.own_evidence_in_context:
            # The frozen policy meets limits given now (model_copy skips validators).
            raise InvestigationError(
                "CONFIG_INVALID",
                f"the frozen policy's loop.early_diagnosis_min_evidence="
                f"{loop.early_diagnosis_min_evidence} exceeds limits.own_evidence_in_context="
                f"{limits.own_evidence_in_context}: raise the window to at least that")
        return effective

    # -- accounts ------------------------------------------------------------------------

    def ensure_accounts(self, session: Session, case_id: str, revision: int,
                        hypothesis_ids: list[int],
                        known: list[BudgetAccount] | None = None) -> list[BudgetAccount]:
        """Create missing accounts with the configured credit; existing ones are reused,
        never refilled. Returns all accounts of the revision ordered by hypothesis id.

        Args:
            known: every account of the revision, read in this transaction already (the
                live-state check's); ``None``: they are read here."""
        existing = {
            a.hypothesis_id: a
            for a in (known if known is not None else session.exec(
                _ACCOUNTS, params={"case_id": case_id, "revision": revision}))
        }
        added = False
        for hid in hypothesis_ids:
            if hid in existing:
                continue
            added = True
            credit = self.budget.credit_units
            account = BudgetAccount(case_id=case_id, revision=revision, hypothesis_id=hid,
                                    credit_units=credit, balance_units=credit)
            session.add(account)
            _ledger(session, case_id=case_id, revision=revision, hypothesis_id=hid,
                    step_seq=0, kind="credit", amount_units=credit,
                    balance_after_units=credit, reference="initial credit")
            existing[hid] = account
        if added:
            session.flush()
        return [existing[h] for h in sorted(existing)]

    def verify_origins(self, session: Session, account: BudgetAccount) -> None:
        """Check that the account balance equals its ledger sum.

        Raises:
            InvestigationError: ``BUDGET_ORIGIN_MISMATCH`` when they differ.
        """
        self.verify_all_origins(session, [account])

    @staticmethod
    def verify_all_origins(session: Session, accounts: list[BudgetAccount],
                           sums: dict[int, tuple[int, int, int]] | None = None) -> None:
        """:meth:`verify_origins` for accounts of one case revision, in one query (the
        ledger is summed by the database).

        Args:
            sums: per hypothesis, the ledger's sum, number of credit entries and credited
                amount, when summed in this transaction already (:func:`ledger_sums_of`)
                with no ledger row written since; ``None``: summed here.

        Raises:
            InvestigationError: ``BUDGET_ORIGIN_MISMATCH`` naming the first that differs.
        """
        if not accounts:
            return
        first = accounts[0]
        if sums is None:
            sums = {hid: (int(total or 0), int(credits or 0), int(credited or 0))
                    for hid, total, credits, credited in core(session).execute(_LEDGER_SUMS, {
                        "case_id": first.case_id, "revision": first.revision}).all()}
        for account in accounts:
            total, credits, credited = sums.get(account.hypothesis_id, (0, 0, 0))
            if total == account.balance_units and credits == 1 and \
                    credited == account.credit_units:
                continue
            raise InvestigationError(
                "BUDGET_ORIGIN_MISMATCH",
                f"hypothesis {account.hypothesis_id}: balance {account.balance_units} does not "
                f"match its ledger ({total}); the store was changed outside the engine",
                hypothesis_id=account.hypothesis_id,
            )

    # -- movements -----------------------------------------------------------------------

    def _entry(self, session: Session, account: BudgetAccount, step_seq: int, kind: str,
               amount: int, reference: str) -> None:
        account.balance_units += amount
        _ledger(session, case_id=account.case_id, revision=account.revision,
                hypothesis_id=account.hypothesis_id, step_seq=step_seq, kind=kind,
                amount_units=amount, balance_after_units=account.balance_units,
                reference=reference)
        session.add(account)

    def settle(self, session: Session, account: BudgetAccount, evidence: Evidence, score: int,
               step_seq: int) -> int:
        """Settle a pending finding with the model's semantic score; returns the refund.

        The refund follows :func:`rules.refund_units` and is strictly below the cost.
        """
        novelty = rules.novelty_permille(evidence.item_count, evidence.new_item_count,
                                         evidence.duplicate)
        refund = rules.refund_units(evidence.cost_units, score, novelty,
                                    self.budget.max_refund_percent)
        evidence.assessed = True
        evidence.assessment_score = score
        evidence.refund_units = refund
        session.add(evidence)
        if refund:
            self._entry(session, account, step_seq, "refund", refund, evidence.evidence_id)
        if account.pending_evidence_id == evidence.evidence_id:
            account.pending_evidence_id = None
        session.add(account)
        return refund

    def reserve(self, session: Session, account: BudgetAccount, cost_units: int, step_seq: int,
                reference: str) -> None:
        """Reserve (charge) ``cost_units`` before the action runs.

        Raises:
            InvestigationError: ``BUDGET_INSUFFICIENT`` if the balance cannot cover it
            (validation rejects such replies first, so this is a guard).
        """
        if cost_units <= 0:
            raise InvestigationError("BUDGET_COST_INVALID", f"cost must be positive: {cost_units}")
        if account.balance_units < cost_units:
            raise InvestigationError(
                "BUDGET_INSUFFICIENT",
                f"hypothesis {account.hypothesis_id} cannot afford {cost_units} units",
                balance_units=account.balance_units,
            )
        self._entry(session, account, step_seq, "reserve", -cost_units, reference)

    @staticmethod
    def complete(account: BudgetAccount, reason: str) -> None:
        """BudgetManager ``complete``: ``investigation_finished``, balance kept; never
        labels the hypothesis rejected.

        Raises:
            InvestigationError: ``BUDGET_PENDING_ACTION`` if a finding is still unassessed.
        """
        BudgetManager._close(account, rules.FINISHED, reason)

    @staticmethod
    def reject(account: BudgetAccount, reason: str) -> None:
        """Close the account as ``rejected`` (the model's ``reject`` action).

        Raises:
            InvestigationError: ``BUDGET_PENDING_ACTION`` if a finding is still unassessed.
        """
        BudgetManager._close(account, rules.REJECTED, reason)

    @staticmethod
    def _close(account: BudgetAccount, status: str, reason: str) -> None:
        if account.pending_evidence_id is not None:
            raise InvestigationError(
                "BUDGET_PENDING_ACTION",
                f"hypothesis {account.hypothesis_id} has unassessed evidence "
                f"{account.pending_evidence_id}; assess it before closing the account",
            )
        account.status = status
        account.disposition_reason = reason

    def closing_reason(self, account: BudgetAccount,
                       pending: Evidence | None = None) -> str | None:
        """Why the account's next turn may only close it, or ``None`` if it may act.

        In this order: ``assessment_only`` once an accepted early-diagnosis review
        deferred the account (``docs/early-diagnosis.md``); ``iteration_cap`` after
        ``max_iterations_per_hypothesis`` research iterations; ``low_information`` after
        ``max_results_without_novelty`` consecutive results without new items;
        ``budget_exhausted`` when the balance plus the largest refund the pending result
        could earn (score 100) is below the cheapest action.
        """
        if account.deferred_by is not None:
            return rules.ASSESSMENT_ONLY
        if account.iterations >= self.loop.max_iterations_per_hypothesis:
            return rules.ITERATION_CAP
        if account.no_novelty_streak >= self.loop.max_results_without_novelty:
            return rules.LOW_INFORMATION
        best_refund = 0
        if pending is not None:
            novelty = rules.novelty_permille(pending.item_count, pending.new_item_count,
                                             pending.duplicate)
            best_refund = rules.refund_units(pending.cost_units, 100, novelty,
                                             self.budget.max_refund_percent)
        if account.balance_units + best_refund < rules.cheapest_action_cost(self.budget):
            return rules.BUDGET_EXHAUSTED
        return None

    def apply_automatic_disposition(self, account: BudgetAccount) -> None:
        """Make an account terminal without a model turn when nothing is left to assess
        and it cannot act: ``exhausted`` (balance below the cheapest action)."""
        if account.status != rules.ACTIVE or account.pending_evidence_id is not None:
            return
        if account.balance_units < rules.cheapest_action_cost(self.budget):
            account.status = rules.EXHAUSTED
            account.disposition_reason = "balance below the cheapest configured action"

    def describe(self) -> dict[str, Any]:
        """Policy facts shown to the model: costs and refund cap (units)."""
        return {
            "costs_units": dict(sorted(self.budget.costs.items())),
            "test_costs_units": dict(sorted(self.budget.test_costs.items())),
            "max_refund_percent": self.budget.max_refund_percent,
        }
