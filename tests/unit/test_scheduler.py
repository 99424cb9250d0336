"""``select_hypothesis``: initial turns in id order, then highest confidence with the
lowest id on ties; terminal accounts are skipped (seed 000, "Deterministic cycle")."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from investigation.budget import rules
from investigation.constants import CONFIDENCE_ORDER
from investigation.loop.scheduler import (
    FIRST_TURN,
    HIGHEST_CONFIDENCE,
    Selection,
    next_turn,
    select_hypothesis,
)


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


def test_selection_names_the_first_turn_rule_and_who_still_waits_for_a_turn() -> None:
    chosen = next_turn([Acc(4, "supported"), Acc(7, turns=0), Acc(3, turns=0),
                     Acc(1, turns=0, status=rules.FINISHED)])
    assert chosen == Selection(3, FIRST_TURN, (3, 7), active=3)
    assert chosen.to_dict() == {"rule": "first_turn", "tied": [3, 7], "active": 3}


def test_selection_names_the_confidence_and_the_accounts_tied_at_it() -> None:
    chosen = next_turn([Acc(5, "plausible"), Acc(2, "weak"), Acc(3, "plausible"),
                     Acc(1, "strongly_supported", status=rules.REJECTED)])
    assert chosen == Selection(3, HIGHEST_CONFIDENCE, (3, 5), active=3,
                               confidence="plausible")
    assert chosen.to_dict() == {"rule": "highest_confidence", "tied": [3, 5], "active": 3,
                                "confidence": "plausible"}
    alone = next_turn([Acc(5, "weak"), Acc(9, "supported")])
    assert alone is not None and alone.tied == (9,) and alone.confidence == "supported"
    assert next_turn([Acc(1, status=rules.FINISHED)]) is None
