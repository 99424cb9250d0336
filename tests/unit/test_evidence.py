"""EvidenceStore: controller-assigned ids, duplicates and item-key novelty per hypothesis,
idempotence per step (seed 000, "Budget and stopping"; DESIGN.md "Fixed interfaces")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from investigation.budget import rules
from investigation.config import canonical_json
from investigation.constants import ARTIFACT_EVIDENCE
from investigation.evidence import EvidenceStore, fingerprint
from investigation.store import Store, sha256_hex
from investigation.store.models import Evidence
from tests.casekit import Case, make_case


@pytest.fixture
def case(tmp_path: Path) -> Case:
    return make_case(tmp_path / "case")


def result(keys: list[str], operation: str = "source.search",
           arguments: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"operation": operation, "arguments": arguments or {"pattern": "percent"},
            "items": [{"key": k, "text": f"text of {k}"} for k in keys],
            "warnings": [], "stats": {"scanned": 3}}


def record(case: Case, step: int, hid: int, res: dict[str, Any], cost: int = 3,
           revision: int = 1) -> Evidence:
    with case.store.session() as s:
        return EvidenceStore.record(s, case_id=case.case_id, revision=revision, step_seq=step,
                                    hypothesis_id=hid, result=res, cost_units=cost)


def test_ids_follow_creation_order_across_hypotheses(case: Case) -> None:
    ids = [record(case, 1, 1, result(["a"])).evidence_id,
           record(case, 2, 2, result(["b"])).evidence_id,
           record(case, 3, 1, result(["c"])).evidence_id,
           record(case, 4, 2, result([])).evidence_id]
    assert ids == ["E1", "E2", "E3", "E4"]
    with case.store.session() as s:
        listed = EvidenceStore.for_case(s, case.case_id, 1)
    assert [(e.evidence_id, e.step_seq, e.hypothesis_id) for e in listed] == \
        [("E1", 1, 1), ("E2", 2, 2), ("E3", 3, 1), ("E4", 4, 2)]


def test_ids_continue_per_case_across_revisions(case: Case) -> None:
    record(case, 1, 1, result(["a"]))
    assert record(case, 2, 1, result(["a"]), revision=2).evidence_id == "E2"
    with case.store.session() as s:
        assert [e.evidence_id for e in EvidenceStore.for_case(s, case.case_id, 2)] == ["E2"]


def test_novelty_and_duplicates_count_only_the_current_revision(case: Case) -> None:
    record(case, 1, 1, result(["a", "b"]))
    again = record(case, 2, 1, result(["a", "b"]), revision=2)
    assert (again.duplicate, again.item_count, again.new_item_count) == (False, 2, 2)


def test_ids_are_per_case(tmp_path: Path) -> None:
    one = make_case(tmp_path / "one")
    two = make_case(tmp_path / "two")
    assert record(one, 1, 1, result(["a"])).evidence_id == "E1"
    assert record(two, 1, 1, result(["a"])).evidence_id == "E1"


def test_first_finding_is_entirely_new(case: Case) -> None:
    ev = record(case, 1, 1, result(["a", "b", "c"]), cost=4)
    assert (ev.item_count, ev.new_item_count, ev.duplicate, ev.cost_units) == (3, 3, False, 4)
    assert rules.novelty_permille(ev.item_count, ev.new_item_count, ev.duplicate) == 1000


def test_repeated_identical_result_is_a_duplicate_without_new_items(case: Case) -> None:
    first = record(case, 1, 1, result(["a", "b"]))
    again = record(case, 2, 1, result(["a", "b"]))
    assert again.fingerprint == first.fingerprint
    assert (again.item_count, again.new_item_count, again.duplicate) == (2, 0, True)
    assert rules.novelty_permille(again.item_count, again.new_item_count, again.duplicate) == 0


def test_overlapping_result_counts_only_new_keys(case: Case) -> None:
    record(case, 1, 1, result(["a", "b", "c"]))
    ev = record(case, 2, 1, result(["b", "c", "d", "e"], arguments={"pattern": "other"}))
    assert (ev.item_count, ev.new_item_count, ev.duplicate) == (4, 2, False)
    assert rules.novelty_permille(ev.item_count, ev.new_item_count, ev.duplicate) == 500
    # Seen keys accumulate over every earlier record of the hypothesis.
    later = record(case, 3, 1, result(["a", "e", "f"], arguments={"pattern": "third"}))
    assert later.new_item_count == 1


def test_novelty_follows_the_item_key_not_the_item_text(case: Case) -> None:
    record(case, 1, 1, result(["a"]))
    res = result(["a", "b"], arguments={"pattern": "other"})
    res["items"][0]["text"] = "the same item, quoted differently"
    ev = record(case, 2, 1, res)
    assert (ev.duplicate, ev.item_count, ev.new_item_count) == (False, 2, 1)
    assert json.loads(ev.item_keys_json) == ["a", "b"]


def test_same_items_under_other_arguments_are_not_a_duplicate_but_not_new(case: Case) -> None:
    record(case, 1, 1, result(["a"]))
    ev = record(case, 2, 1, result(["a"], arguments={"pattern": "percent", "regex": True}))
    assert (ev.duplicate, ev.new_item_count) == (False, 0)
    assert rules.novelty_permille(ev.item_count, ev.new_item_count, ev.duplicate) == 0


def test_novelty_is_counted_per_hypothesis(case: Case) -> None:
    record(case, 1, 1, result(["a", "b"]))
    other = record(case, 2, 2, result(["a", "b"]))
    assert (other.duplicate, other.new_item_count) == (False, 2)


def test_empty_result_has_no_new_items(case: Case) -> None:
    ev = record(case, 1, 1, result([]))
    assert (ev.item_count, ev.new_item_count, ev.duplicate) == (0, 0, False)


def test_repeated_keys_within_one_result_count_once(case: Case) -> None:
    ev = record(case, 1, 1, result(["a", "a", "b"]))
    assert (ev.item_count, ev.new_item_count) == (3, 2)


def test_record_is_idempotent_per_step(case: Case) -> None:
    first = record(case, 1, 1, result(["a", "b"]))
    again = record(case, 1, 1, result(["a", "b"]))
    different = record(case, 1, 2, result(["x"]))  # a re-run stage never records twice
    assert again.evidence_id == different.evidence_id == first.evidence_id == "E1"
    assert again.new_item_count == 2 and not again.duplicate
    with case.store.session() as s:
        assert len(EvidenceStore.for_case(s, case.case_id, 1)) == 1
    assert record(case, 2, 1, result(["c"])).evidence_id == "E2"


def test_evidence_artifact_holds_the_canonical_record(case: Case) -> None:
    res = result(["a", "b"])
    ev = record(case, 7, 1, res, cost=3)
    with case.store.session() as s:
        art = Store.get_artifact(s, case.case_id, ARTIFACT_EVIDENCE.format(seq=7))
    assert art is not None
    assert ev.artifact_path == art.path == "analysis/investigation/0007/evidence.json"
    assert ev.artifact_sha256 == art.sha256 == sha256_hex(art.data)
    doc = json.loads(art.data)
    assert canonical_json(doc) == bytes(art.data)
    assert doc["evidence_id"] == "E1"
    assert doc["items"] == res["items"]
    assert (doc["item_count"], doc["new_item_count"], doc["duplicate"], doc["cost_units"]) == \
        (2, 2, False, 3)
    assert doc["fingerprint"] == fingerprint(res["operation"], res["arguments"], res["items"])


def test_fingerprint_covers_operation_arguments_and_items() -> None:
    base = fingerprint("source.search", {"pattern": "x"}, [{"key": "a"}])
    assert base == fingerprint("source.search", {"pattern": "x"}, [{"key": "a"}])
    assert base != fingerprint("logs.search", {"pattern": "x"}, [{"key": "a"}])
    assert base != fingerprint("source.search", {"pattern": "y"}, [{"key": "a"}])
    assert base != fingerprint("source.search", {"pattern": "x"}, [{"key": "b"}])
    assert base != fingerprint("source.search", {"pattern": "x"}, [{"key": "a", "text": "t"}])
