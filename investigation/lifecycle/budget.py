"""The session budget: five independent bounds and the explicit usage record (seed 001,
"Budgets and stopping").

A dimension is *exhausted* when its usage has reached its bound (``used >= max``); a
bound of 0 therefore starts exhausted. Usage may overrun a bound (a cost is recorded as it
was incurred, never refused after the fact); the session refuses to start new execution
(PLANNING -> EXECUTING) while any dimension is exhausted. Token accounting stays in the
agent harness: this layer records only aggregate cost and counts. All quantities are
integers, so accumulation and round-trips are exact.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from investigation.lifecycle import _records as r
from investigation.lifecycle._records import JSONValue


class BudgetDimension(StrEnum):
    """The five bounded dimensions, in the order the policy reports them."""

    ITERATIONS = "iterations"
    INVESTIGATIONS = "investigations"
    AGENT_RUNS = "agent_runs"
    COST_UNITS = "cost_units"
    EXECUTION_MS = "execution_ms"


_DIMS = tuple(BudgetDimension)
_BUDGET_KEYS = tuple(f"max_{d.value}" for d in _DIMS)
_USAGE_KEYS = tuple(d.value for d in _DIMS)


@dataclass(frozen=True)
class SessionBudget:
    """Five independent upper bounds; every field is a required non-negative integer
    (0 means that dimension is exhausted from the start; there is no "unbounded").

    Args:
        max_iterations: completed iterations (UPDATING -> PLANNING transitions).
        max_investigations: investigations planned and started, as recorded by the caller.
        max_agent_runs: AgentRuns started, as recorded by the caller.
        max_cost_units: aggregate cost, in the caller's integer cost units.
        max_execution_ms: execution time in milliseconds, as recorded by the caller.

    Raises:
        LifecycleError: ``LIFECYCLE_MALFORMED_RECORD`` (not an int) or
            ``LIFECYCLE_INVALID_VALUE`` (negative).
    """

    max_iterations: int
    max_investigations: int
    max_agent_runs: int
    max_cost_units: int
    max_execution_ms: int

    def __post_init__(self) -> None:
        for key in _BUDGET_KEYS:
            r.count(getattr(self, key), key)

    def limit(self, dimension: BudgetDimension) -> int:
        """The bound of one dimension."""
        value: int = getattr(self, f"max_{dimension.value}")
        return value

    def is_exhausted(self, usage: BudgetUsage, dimension: BudgetDimension) -> bool:
        """Whether ``usage`` has reached this dimension's bound."""
        return usage.used(dimension) >= self.limit(dimension)

    def exhausted(self, usage: BudgetUsage) -> tuple[BudgetDimension, ...]:
        """Every exhausted dimension, in ``BudgetDimension`` order (empty: none)."""
        return tuple(d for d in _DIMS if self.is_exhausted(usage, d))

    def remaining(self, usage: BudgetUsage) -> dict[BudgetDimension, int]:
        """What is left of each dimension (0 when reached or overrun)."""
        return {d: max(0, self.limit(d) - usage.used(d)) for d in _DIMS}

    def to_dict(self) -> dict[str, JSONValue]:
        """``{"max_iterations": int, "max_investigations": int, "max_agent_runs": int,
        "max_cost_units": int, "max_execution_ms": int}``."""
        return {key: getattr(self, key) for key in _BUDGET_KEYS}

    @classmethod
    def from_dict(cls, data: object) -> SessionBudget:
        """Rebuild from ``to_dict()`` output (exact keys, integers >= 0)."""
        d = r.fields(data, "budget", _BUDGET_KEYS)
        return cls(**{key: r.count(d[key], key) for key in _BUDGET_KEYS})


@dataclass(frozen=True)
class BudgetUsage:
    """What a session has used so far, per dimension (all integers >= 0, default 0).

    ``iterations`` is advanced only by the session's UPDATING -> PLANNING transition; the
    other four are recorded explicitly with ``InvestigationSession.record_usage``.
    """

    iterations: int = 0
    investigations: int = 0
    agent_runs: int = 0
    cost_units: int = 0
    execution_ms: int = 0

    def __post_init__(self) -> None:
        for key in _USAGE_KEYS:
            r.count(getattr(self, key), key)

    def used(self, dimension: BudgetDimension) -> int:
        """Usage of one dimension."""
        value: int = getattr(self, dimension.value)
        return value

    def plus(self, *, iterations: int = 0, investigations: int = 0, agent_runs: int = 0,
             cost_units: int = 0, execution_ms: int = 0) -> BudgetUsage:
        """A new record with the given non-negative increments added.

        Raises:
            LifecycleError: ``LIFECYCLE_INVALID_VALUE`` for a negative increment,
                ``LIFECYCLE_MALFORMED_RECORD`` for a non-integer.
        """
        steps = {"iterations": iterations, "investigations": investigations,
                 "agent_runs": agent_runs, "cost_units": cost_units,
                 "execution_ms": execution_ms}
        for key, step in steps.items():
            r.count(step, key)
        return replace(self, **{k: getattr(self, k) + v for k, v in steps.items()})

    def to_dict(self) -> dict[str, JSONValue]:
        """``{"iterations": int, "investigations": int, "agent_runs": int,
        "cost_units": int, "execution_ms": int}``."""
        return {key: getattr(self, key) for key in _USAGE_KEYS}

    @classmethod
    def from_dict(cls, data: object) -> BudgetUsage:
        """Rebuild from ``to_dict()`` output (exact keys, integers >= 0)."""
        d = r.fields(data, "usage", _USAGE_KEYS)
        return cls(**{key: r.count(d[key], key) for key in _USAGE_KEYS})
