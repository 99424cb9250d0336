"""``select_hypothesis``: initial turns in id order, then highest confidence with the
lowest id on ties; terminal accounts are skipped (seed 000, "Deterministic cycle")."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from investigation.budget import rules
from investigation.constants import CONFIDENCE_ORDER
from investigation.loop.scheduler import select_hypothesis


@dataclass
class Acc:
    hypothesis_id: int
    confidence: str = "unassessed"
    turns: int = 1
    status: str = rules.ACTIVE


def test_initial_turns_go_in_numeric_id_order_regardless_of_confidence() -> None:
    accounts = [Acc(10, "strongly_supported", turns=3), Acc(9, turns=0), Acc(2, turns=0),
                Acc(1, "supported", turns=1)]
    assert select_hypothesis(accounts) == 2
    accounts[2].turns = 1
    assert select_hypothesis(accounts) == 9
    accounts[1].turns = 1
    assert select_hypothesis(accounts) == 10


def test_ids_are_compared_as_numbers() -> None:
    assert select_hypothesis([Acc(10, turns=0), Acc(9, turns=0)]) == 9
    assert select_hypothesis([Acc(10), Acc(9)]) == 9


def test_after_initial_turns_the_highest_confidence_goes_next() -> None:
    accounts = [Acc(1, "weak"), Acc(2, "supported"), Acc(3, "plausible"), Acc(4, "weakened")]
    assert select_hypothesis(accounts) == 2


@pytest.mark.parametrize(("lower", "higher"), list(itertools.pairwise(CONFIDENCE_ORDER)))
def test_confidence_order(lower: str, higher: str) -> None:
    # The lower id holds the lower label, so only the ranking can pick id 2.
    assert select_hypothesis([Acc(1, lower), Acc(2, higher)]) == 2


def test_weakened_ranks_below_unassessed() -> None:
    assert select_hypothesis([Acc(1, "weakened"), Acc(2, "unassessed")]) == 2


def test_ties_go_to_the_lowest_id() -> None:
    assert select_hypothesis([Acc(5, "plausible"), Acc(3, "plausible"),
                              Acc(4, "plausible")]) == 3


@pytest.mark.parametrize("terminal", rules.TERMINAL_STATUSES)
def test_terminal_accounts_are_skipped(terminal: str) -> None:
    accounts = [Acc(1, "strongly_supported", status=terminal), Acc(2, "weak"),
                Acc(3, turns=0, status=terminal)]
    assert select_hypothesis(accounts) == 2


def test_none_when_every_account_is_terminal() -> None:
    assert select_hypothesis([Acc(1, status=rules.FINISHED), Acc(2, status=rules.REJECTED),
                              Acc(3, turns=0, status=rules.EXHAUSTED)]) is None
    assert select_hypothesis([]) is None
