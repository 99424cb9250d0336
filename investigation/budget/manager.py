"""BudgetManager: accounts and ledger in the store (seed 000, "Budget and stopping").

Every balance change is a ledger row unique per (case, revision, hypothesis, step, kind),
so a re-run stage cannot charge or refund twice, and ``balance_units`` always equals
``credit - reservations + refunds`` over the ledger.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import bindparam
from sqlalchemy import insert as sa_insert
from sqlalchemy import select as sa_select
from sqlmodel import Session, col, select

from investigation import jsonio
from investigation.budget import rules
from investigation.config import BudgetConfig, InvestigationConfig, LoopConfig, canonical_json
from investigation.errors import InvestigationError
from investigation.store.engine import core, sha256_hex, table_of
from investigation.store.models import BudgetAccount, Evidence, LedgerEntry, RevisionRecord

log = logging.getLogger(__name__)

# Built once (building a statement costs more than running it on SQLite).
#: Ledger rows are append-only and never written through the ORM: one Core INSERT each
#: (no SQLModel object, nothing pending; decision 72's rule).
_LEDGER_INSERT = sa_insert(table_of(LedgerEntry)).inline()  # no primary key fetched


def _ledger(session: Session, **values: Any) -> None:
    core(session).execute(_LEDGER_INSERT, values)


_ACCOUNTS = select(BudgetAccount).where(col(BudgetAccount.case_id) == bindparam("case_id"),
                                        col(BudgetAccount.revision) == bindparam("revision"))
#: Every ledger entry of a case revision, in the order written (full depth).
_LEDGER_ENTRIES = sa_select(
    col(LedgerEntry.hypothesis_id), col(LedgerEntry.kind), col(LedgerEntry.amount_units),
    col(LedgerEntry.balance_after_units)).where(
    col(LedgerEntry.case_id) == bindparam("case_id"),
    col(LedgerEntry.revision) == bindparam("revision")).order_by(
    col(LedgerEntry.hypothesis_id), col(LedgerEntry.id))


_LE = table_of(LedgerEntry).c


def newest_balance_of(hypothesis_id: Any) -> Any:
    """A scalar subquery: the balance after the newest ledger entry of one hypothesis (of
    the ``case_id``/``revision`` parameters; ``hypothesis_id``: the column to correlate
    on), read through the index ``ix_ledger_entry_newest`` (one row, whatever the case's
    length)."""
    return sa_select(_LE.balance_after_units).where(
        _LE.case_id == bindparam("case_id"), _LE.revision == bindparam("revision"),
        _LE.hypothesis_id == hypothesis_id).order_by(_LE.id.desc()).limit(1) \
        .scalar_subquery()


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
        stored = jsonio.loads(revision.policy_json)
        if explicit and sha256_hex(canonical_json(wanted)) != revision.policy_sha256:
            raise InvestigationError(
                "POLICY_CHANGED",
                "the budget/loop policy of this revision is frozen and differs from the given "
                "config; run without --config to adopt the stored policy",
                stored_sha256=revision.policy_sha256,
            )
        if sha256_hex(canonical_json(wanted)) != revision.policy_sha256:
            # Adopted (decision 153). Said once per process and frozen policy (the caller
            # caches the result by its hash), at INFO: a worker's log shows it, so a fleet
            # whose workers read different policy files shows it; an embedded `run`
            # without --config, which adopts the frozen policy as asked, stays quiet.
            log.info("frozen policy %s (first met in case %s revision %s) differs from the "
                     "policy this process was given (its policy file, or the defaults) and "
                     "is kept; the process's own applies to revisions not yet frozen",
                     (revision.policy_sha256 or "")[:12], revision.case_id,
                     revision.revision)
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
        """Check the account against its whole ledger (:meth:`verify_all_origins` at full
        depth).

        Raises:
            InvestigationError: ``BUDGET_ORIGIN_MISMATCH`` when they differ.
        """
        self.verify_all_origins(session, [account])

    @staticmethod
    def verify_all_origins(session: Session, accounts: list[BudgetAccount],
                           newest: dict[int, int | None] | None = None) -> None:
        """Verify the budget origins of accounts of one case revision (seed 000, "The
        Investigator verifies the existing budget origins").

        At full depth (``newest`` is ``None``) every ledger entry is read, in the order
        written: the first is the one credit, of the account's credit; each entry's
        balance is the previous balance plus its amount; the last balance is the
        account's. The store refuses changing or deleting a ledger entry
        (``investigation.store.guards``), so between those checks the entries written
        since are the engine's own, each carrying the balance it left: at incremental
        depth only the newest entry's balance is compared (decision 121), one row per
        account whatever the case's length.

        Args:
            newest: per hypothesis, the balance after its newest ledger entry
                (:func:`newest_balance_of`; ``None``: it has none), read in this
                transaction with no ledger row written since; ``None``: full depth.

        Raises:
            InvestigationError: ``BUDGET_ORIGIN_MISMATCH`` naming the first account that
            differs.
        """
        if not accounts:
            return

        def mismatch(account: BudgetAccount, found: str) -> InvestigationError:
            return InvestigationError(
                "BUDGET_ORIGIN_MISMATCH",
                f"hypothesis {account.hypothesis_id}: balance {account.balance_units} does "
                f"not match its ledger ({found}); the store was changed outside the engine",
                hypothesis_id=account.hypothesis_id)

        if newest is not None:
            for account in accounts:
                last = newest.get(account.hypothesis_id)
                if last != account.balance_units:
                    raise mismatch(account, f"newest balance {last}")
            return
        first = accounts[0]
        entries: dict[int, list[Any]] = {}
        for row in core(session).execute(_LEDGER_ENTRIES, {
                "case_id": first.case_id, "revision": first.revision}).all():
            entries.setdefault(int(row.hypothesis_id), []).append(row)
        for account in accounts:
            rows = entries.get(account.hypothesis_id, [])
            total = 0
            for i, row in enumerate(rows):
                total += int(row.amount_units)
                is_credit = row.kind == "credit"
                if is_credit != (i == 0) or int(row.balance_after_units) != total or \
                        (is_credit and int(row.amount_units) != account.credit_units):
                    raise mismatch(account, f"entry {i + 1} of {len(rows)}")
            if not rows or total != account.balance_units:
                raise mismatch(account, str(total))

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
