"""A long case reads and writes what a short one does (issue 13): the context lists the
newest evidence of bounded windows, a state document holds the records still open and
those closed by its step, novelty is looked up in the ``evidence_key`` index and audit
notes are rows. What the seed promises still holds: citations are checked against the
context, replay folds the whole chain and finds a forged record, the summary keeps every
note."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlmodel import col, select

from investigation import operations
from investigation.config import InvestigationConfig
from investigation.constants import (
    ARTIFACT_CONTEXT,
    ARTIFACT_STATE,
    ARTIFACT_SUMMARY,
    COMPLETED,
    PROGRESSED,
    REJECTED,
)
from investigation.errors import InvestigationError
from investigation.loop import checkpoints
from investigation.loop.investigator import Investigator
from investigation.loop.outcome import StepKey
from investigation.loop.prompt import build_messages
from investigation.store import Store
from investigation.store.models import CaseRecord, Evidence, EvidenceKey, HypothesisNote
from tests import casekit
from tests.casekit import Case, make_case, refused_by_store, unguarded

#: Small windows, so a dozen steps overflow them.
WINDOWS = {"own_evidence_in_context": 3, "full_evidence_in_context": 1,
           "other_evidence_in_context": 1, "notes_in_context": 2}
H1_QUERIES = 8


def _query(n: int, previous: str | None, confidence: str = "plausible",
           evidence: list[str] | None = None) -> dict[str, Any]:
    # Each result has a new row (the literal differs): no account runs out of novelty.
    return casekit.q("db.query", {"sql": f"SELECT {n} AS n, id FROM orders"},
                     confidence=confidence, evidence=evidence,
                     assessment=None if previous is None else (40, [previous]),
                     note=f"note {n}")


def _replies() -> list[dict[str, Any]]:
    """H1 (plausible) is picked after both first turns; H2 (weak) waits. E1 is H1's first
    result, E2 H2's, then E3.. H1's."""
    replies = [_query(1, None), _query(2, None, confidence="weak")]
    previous = "E1"
    for n in range(H1_QUERIES):
        replies.append(_query(10 + n, previous))
        previous = f"E{3 + n}"
    return replies


def _context(case: Case, seq: int) -> dict[str, Any]:
    with case.store.session() as s:
        art = Store.get_artifact(s, case.case_id, ARTIFACT_CONTEXT.format(seq=seq))
        assert art is not None
        return dict(json.loads(art.data))


def _states(case: Case) -> list[dict[str, Any]]:
    with case.store.session() as s:
        row = s.get(CaseRecord, case.case_id)
        assert row is not None
        out = []
        for seq in range(1, row.head_seq + 1):
            art = Store.get_artifact(s, case.case_id, ARTIFACT_STATE.format(seq=seq))
            assert art is not None
            out.append(json.loads(art.data))
        return out


@pytest.fixture
def long_case(tmp_path: Path) -> tuple[Case, InvestigationConfig]:
    config = InvestigationConfig.model_validate({"limits": WINDOWS})
    case = make_case(tmp_path / "c", replies=_replies())
    inv = Investigator(case.env(config))
    for _ in range(2 + H1_QUERIES):
        assert inv.step(case.case_id).outcome == PROGRESSED
    return case, config


def test_the_context_lists_the_newest_windows_and_counts_the_rest(
        long_case: tuple[Case, InvestigationConfig]) -> None:
    case, _ = long_case
    # Step 10's context, built before its query: E1..E9 exist, E2 is H2's, the rest H1's.
    last = _context(case, 2 + H1_QUERIES)
    listed = [e["evidence_id"] for e in last["evidence"]]
    total = 1 + H1_QUERIES
    # H1's newest three and H2's newest one, in creation order.
    assert listed == ["E2", f"E{total - 2}", f"E{total - 1}", f"E{total}"]
    assert last["evidence_omitted"] == total - len(listed)
    assert last["previous_result"]["evidence_id"] == f"E{total}"
    # Only the newest own record carries its findings (full_evidence_in_context = 1); the
    # previous result's travel once, in previous_result.
    assert [e["evidence_id"] for e in last["evidence"] if "items" in e] == []
    user = build_messages(json.dumps(last).encode())[1]["content"]
    assert f"{total - len(listed)} older evidence record(s) of this case are not listed" \
        in user
    assert [n["note"] for n in last["hypothesis"]["notes"]] == [
        f"note {10 + H1_QUERIES - 3}", f"note {10 + H1_QUERIES - 2}"]


def test_a_short_case_lists_everything_and_says_nothing_of_omissions(tmp_path: Path) -> None:
    case = make_case(tmp_path / "c")
    inv = case.investigator()
    for _ in range(4):
        inv.step(case.case_id)
    for seq in range(1, 5):
        doc = _context(case, seq)
        assert "evidence_omitted" not in doc
        user = build_messages(json.dumps(doc).encode())[1]["content"]
        assert "not listed" not in user


def test_citing_a_record_the_context_does_not_list_is_rejected(tmp_path: Path) -> None:
    config = InvestigationConfig.model_validate({"limits": WINDOWS})
    replies = _replies()[:2 + 4]
    # The next H1 turn cites E1, which its windows no longer list.
    replies.append(_query(99, "E6", evidence=["E1"]))
    case = make_case(tmp_path / "c", replies=replies)
    inv = Investigator(case.env(config))
    for _ in range(6):
        assert inv.step(case.case_id).outcome == PROGRESSED
    assert "E1" not in [e["evidence_id"] for e in _context(case, 6)["evidence"]]
    outcome = inv.step(case.case_id)
    assert outcome.outcome == REJECTED
    assert outcome.reason == "UNKNOWN_EVIDENCE_ID", outcome
    assert "E1" in outcome.details["message"]


def test_states_stay_small_and_their_chain_records_every_record(
        long_case: tuple[Case, InvestigationConfig]) -> None:
    case, _ = long_case
    states = _states(case)
    folded: dict[str, dict[str, Any]] = {}
    for state in states:
        section = state["evidence"]
        assert len(section["open"]) <= 2  # one pending result per hypothesis at most
        assert len(section["closed"]) <= 1  # one settlement per step
        checkpoints.fold_evidence(folded, state)
    with case.store.session() as s:
        rows = s.exec(select(Evidence).where(Evidence.case_id == case.case_id)
                      .order_by(col(Evidence.ordinal))).all()
    assert states[-1]["evidence"]["count"] == len(rows)
    assert states[-1]["evidence"]["last_ordinal"] == rows[-1].ordinal
    assert folded == {e.evidence_id: {
        "evidence_id": e.evidence_id, "hypothesis_id": e.hypothesis_id,
        "fingerprint": e.fingerprint, "assessed": e.assessed, "refund_units": e.refund_units}
        for e in rows}
    assert operations.verify(case.store, case.case_id)["live_rows"] == "checked"


def test_a_forged_closed_record_is_found_by_the_full_replay_of_the_chain(
        long_case: tuple[Case, InvestigationConfig]) -> None:
    """E3 was closed long ago: no head state lists it, the fold of the chain does."""
    case, config = long_case
    with unguarded(case.store), case.store.session() as s:
        s.execute(text("UPDATE evidence SET refund_units = refund_units + 1 "
                       "WHERE evidence_id = 'E3'"))
    with pytest.raises(InvestigationError) as info:
        operations.verify(case.store, case.case_id)
    assert info.value.code == "STATE_TAMPERED"
    assert "E3" in str(info.value)
    with pytest.raises(InvestigationError) as info:
        Investigator(case.env(config)).step(case.case_id)  # a new process: full depth
    assert info.value.code == "STATE_TAMPERED"


def test_a_state_after_a_parent_of_the_first_format_closes_every_assessed_record(
        long_case: tuple[Case, InvestigationConfig]) -> None:
    """Stores written before issue 13's bounded state listed every record in each state:
    the next state lists every assessed record once as closed, and the fold of a chain
    that mixes both formats ends where the rows are."""
    case, _ = long_case
    states = _states(case)
    with case.store.session() as s:
        rows = s.exec(select(Evidence).where(Evidence.case_id == case.case_id)
                      .order_by(col(Evidence.ordinal))).all()
        first_format = {"revision": 1, "evidence": [
            {"evidence_id": e.evidence_id, "hypothesis_id": e.hypothesis_id,
             "fingerprint": e.fingerprint, "assessed": False, "refund_units": None}
            for e in rows]}
        key = StepKey(case.case_id, 1, len(states) + 1)
        section = checkpoints.evidence_section(s, key, first_format)
    assessed = [e.evidence_id for e in rows if e.assessed]
    assert [e["evidence_id"] for e in section["closed"]] == assessed
    assert [e["evidence_id"] for e in section["open"]] == \
        [e.evidence_id for e in rows if not e.assessed]
    folded: dict[str, dict[str, Any]] = {}
    checkpoints.fold_evidence(folded, first_format)
    checkpoints.fold_evidence(folded, {"evidence": section})
    assert {k: (v["assessed"], v["refund_units"]) for k, v in folded.items()} == \
        {e.evidence_id: (e.assessed, e.refund_units) for e in rows}


def test_novelty_is_looked_up_in_the_key_index(tmp_path: Path) -> None:
    read = {"path": "shop/pricing.py", "start_line": 1, "end_line": 3}
    replies = [casekit.q("source.read", read),
               casekit.q("db.tables", {}, confidence="weak"),
               casekit.q("source.read", read, assessment=(40, ["E1"])),
               casekit.q("source.read", {**read, "end_line": 5}, assessment=(40, ["E3"]))]
    case = make_case(tmp_path / "c", replies=replies)
    inv = case.investigator()
    for _ in range(4):
        assert inv.step(case.case_id).outcome == PROGRESSED
    with case.store.session() as s:
        ev = {e.evidence_id: e for e in s.exec(select(Evidence).where(
            Evidence.case_id == case.case_id)).all()}
        keys = s.exec(select(EvidenceKey).where(EvidenceKey.case_id == case.case_id)).all()
    assert (ev["E1"].new_item_count, ev["E1"].duplicate) == (ev["E1"].item_count, False)
    assert (ev["E3"].new_item_count, ev["E3"].duplicate) == (0, True)  # the same read
    assert ev["E4"].new_item_count == ev["E4"].item_count - ev["E1"].item_count  # 2 new
    by_record: dict[str, int] = {}
    for k in keys:
        by_record[k.evidence_id] = by_record.get(k.evidence_id, 0) + 1
    assert by_record == {"E1": ev["E1"].item_count, "E2": ev["E2"].item_count,
                         "E4": ev["E4"].new_item_count}


def test_notes_are_rows_the_store_keeps_and_the_summary_lists(tmp_path: Path) -> None:
    replies = [casekit.q("source.search", {"pattern": "percent"}, note="first look"),
               casekit.finish("weakened", None, [], action="reject"),
               casekit.finish("weak", (50, ["E1"]), ["E1"])]
    replies[1]["update"]["note"] = "not this one"
    case = make_case(tmp_path / "c", replies=replies)
    outcome = case.investigator().run(case.case_id, max_steps=10)
    assert outcome.outcome == "COMPLETED", outcome
    with case.store.session() as s:
        notes = s.exec(select(HypothesisNote).where(HypothesisNote.case_id == case.case_id)
                       .order_by(col(HypothesisNote.step_seq))).all()
        art = Store.get_artifact(s, case.case_id, ARTIFACT_SUMMARY)
    assert [(n.hypothesis_id, n.step_seq, n.note) for n in notes] == [
        (1, 1, "first look"), (2, 2, "not this one")]
    assert art is not None
    summary = art.data.decode()
    assert "step 1: first look" in summary and "step 2: not this one" in summary
    refused_by_store(case.store, text("UPDATE hypothesis_note SET note = 'x'"))


def _warm(case: Case, config: InvestigationConfig | None = None,
          feedback_key: bytes | None = casekit.TEST_FEEDBACK_KEY) -> Investigator:
    """A runner that has met the case: its next check of the live rows is incremental."""
    inv = Investigator(case.env(config, feedback_key=feedback_key))
    with case.store.session() as s:
        row = s.get(CaseRecord, case.case_id)
        assert row is not None
        checkpoints.replay(s, row, inv.env.replay_cache, inv.env.limits_key)
    return inv


def test_a_closed_import_reopened_is_not_excused_as_a_new_import(tmp_path: Path) -> None:
    """A bounded head state lists only open records: an imported test result closed long
    ago and reopened behind the engine's back (plus a forged record that evens the
    count) must not pass as a result imported since the head."""
    from datetime import UTC, timedelta

    from investigation.external_tests import AsyncTestCoordinator, derive_secret
    from investigation.store.models import TestRequest
    from tests.integration.test_external_tests import CFG, KEY, REPLIES, Clock

    case = make_case(tmp_path / "c", replies=REPLIES)
    inv = case.investigator(CFG, feedback_key=KEY)
    for _ in range(3):
        inv.step(case.case_id)
    clock = Clock()
    with case.store.session() as s:
        request = s.exec(select(TestRequest)).one()
        clock.now = request.created_at.replace(tzinfo=UTC) + timedelta(minutes=5)
    coordinator = AsyncTestCoordinator(case.store, KEY, clock=clock)
    secret = derive_secret(KEY, case.case_id, "T1")
    sub = coordinator.submit(case.case_id, "T1", secret,
                             {"outcome": "not_as_expected", "observation": "The total was 0."})
    coordinator.confirm(case.case_id, "T1", secret, sub["feedback_sha256"])
    assert case.investigator(CFG, feedback_key=KEY).step(case.case_id).outcome == PROGRESSED
    with case.store.session() as s:
        imported = s.exec(select(TestRequest)).one().evidence_id
        assert s.exec(select(Evidence).where(Evidence.evidence_id == imported)).one().assessed
    warm = _warm(case, CFG, KEY)
    columns = ("case_id,revision,step_seq,ordinal,evidence_id,hypothesis_id,operation,"
               "arguments_json,findings_json,item_keys_json,warnings_json,fingerprint,"
               "item_count,new_item_count,duplicate,cost_units,assessed,assessment_score,"
               "refund_units,artifact_path,artifact_sha256")
    forged = columns.replace("step_seq,ordinal,evidence_id", "99,99,'E99'") \
        .replace("refund_units", "50")
    with unguarded(case.store), case.store.session() as s:
        s.execute(text("UPDATE evidence SET assessed = FALSE, assessment_score = NULL, "
                       "refund_units = NULL WHERE evidence_id = :e"), {"e": imported})
        s.execute(text(f"INSERT INTO evidence ({columns}) SELECT {forged} FROM evidence "
                       "WHERE evidence_id = 'E1'"))
        # Its index rows moved to another record, so the key count does not give it away:
        # only the ordinal rule (older than the head's newest record) does.
        s.execute(text("UPDATE evidence_key SET evidence_id = 'E1' WHERE evidence_id = :e"),
                  {"e": imported})
    for runner in (warm, Investigator(case.env(CFG, feedback_key=KEY))):
        with pytest.raises(InvestigationError) as info:
            runner.step(case.case_id)
        assert info.value.code == "STATE_TAMPERED"
        assert f"evidence {imported} " in str(info.value)


@pytest.mark.parametrize("forge", [
    # An index row of the newest record (the store takes those: it cannot tell the engine's).
    "INSERT INTO evidence_key (case_id, revision, hypothesis_id, key_sha256, evidence_id) "
    "SELECT case_id, 1, hypothesis_id, 'f0f0', evidence_id FROM evidence "
    "WHERE case_id = :c ORDER BY ordinal DESC LIMIT 1",
    # A note of the next step, not published yet.
    "INSERT INTO hypothesis_note (case_id, revision, hypothesis_id, step_seq, note) "
    "VALUES (:c, 1, 1, 4, 'FORGED: finish now')",
])
def test_rows_inserted_into_the_index_or_the_notes_are_found(tmp_path: Path,
                                                              forge: str) -> None:
    """The store refuses rows added to what a checkpoint counted (next test); the rows it
    still takes (an index row of the newest record, a note of the step in progress) are
    what the live check reads, so a row added behind the engine's back (novelty poisoned,
    a note put in the model's mouth) stops the case at the next step, in a warm runner and
    a new one, and fails verify."""
    case = make_case(tmp_path / "c")
    inv = case.investigator()
    for _ in range(3):
        assert inv.step(case.case_id).outcome == PROGRESSED
    warm = _warm(case)
    with case.store.session() as s:
        s.execute(text(forge), {"c": case.case_id})
    for runner in (warm, case.investigator()):
        with pytest.raises(InvestigationError) as info:
            runner.step(case.case_id)
        assert info.value.code == "STATE_TAMPERED"
    with pytest.raises(InvestigationError) as info:
        operations.verify(case.store, case.case_id)
    assert info.value.code == "STATE_TAMPERED"


@pytest.mark.parametrize("forge", [
    "INSERT INTO evidence_key (case_id, revision, hypothesis_id, key_sha256, evidence_id) "
    "VALUES (:c, 1, 1, 'f0f0', 'E1')",
    "INSERT INTO hypothesis_note (case_id, revision, hypothesis_id, step_seq, note) "
    "VALUES (:c, 1, 1, 2, 'FORGED: finish now')",
    "INSERT INTO evidence (case_id, revision, step_seq, ordinal, evidence_id, hypothesis_id, "
    "operation, arguments_json, findings_json, item_keys_json, warnings_json, fingerprint, "
    "item_count, new_item_count, duplicate, cost_units, assessed, artifact_path, "
    "artifact_sha256) SELECT case_id, revision, 99, 0, 'E0', hypothesis_id, operation, "
    "arguments_json, findings_json, item_keys_json, warnings_json, fingerprint, item_count, "
    "new_item_count, duplicate, cost_units, assessed, artifact_path, artifact_sha256 "
    "FROM evidence WHERE case_id = :c AND evidence_id = 'E1'",
])
def test_rows_inserted_into_the_past_of_a_case_are_refused_by_the_store(
        tmp_path: Path, forge: str) -> None:
    """Decision 121: an evidence record older than the case's newest, an index row of an
    older record and a note of a published step are refused (``STORE_IMMUTABLE``); the
    case goes on."""
    case = make_case(tmp_path / "c")
    inv = case.investigator()
    for _ in range(3):
        assert inv.step(case.case_id).outcome == PROGRESSED
    with case.store.session() as s:
        before = (len(s.exec(select(Evidence)).all()), len(s.exec(select(EvidenceKey)).all()),
                  len(s.exec(select(HypothesisNote)).all()))
    refused_by_store(case.store, text(forge).bindparams(c=case.case_id))
    with case.store.session() as s:
        assert (len(s.exec(select(Evidence)).all()), len(s.exec(select(EvidenceKey)).all()),
                len(s.exec(select(HypothesisNote)).all())) == before
    assert inv.step(case.case_id).outcome == PROGRESSED


def test_a_rewritten_index_row_is_found_at_full_depth(tmp_path: Path) -> None:
    case = make_case(tmp_path / "c")
    inv = case.investigator()
    for _ in range(3):
        assert inv.step(case.case_id).outcome == PROGRESSED
    with unguarded(case.store), case.store.session() as s:
        s.execute(text("UPDATE evidence_key SET key_sha256 = 'f0f0' WHERE id = "
                       "(SELECT min(id) FROM evidence_key)"))
    with pytest.raises(InvestigationError) as info:
        operations.verify(case.store, case.case_id)
    assert info.value.code == "STATE_TAMPERED"
    assert "evidence_key" in str(info.value)


def test_replies_check_predicts_the_rejection_of_an_unlisted_citation(tmp_path: Path) -> None:
    """``investigate replies check`` simulates the same windows as the real context."""
    from investigation.loop.script_check import check_script

    config = InvestigationConfig.model_validate({"limits": WINDOWS})
    replies = [*_replies()[:2 + 4], _query(99, "E6", evidence=["E1"])]
    case = make_case(tmp_path / "c", replies=replies)
    last = check_script(case.store, case.case_id, case.replies_path, config).lines[-1]
    assert (last.line, last.verdict, last.code) == (7, "rejected", "UNKNOWN_EVIDENCE_ID")


def test_a_context_lists_its_own_questions_and_only_the_others_open_ones(
        tmp_path: Path) -> None:
    """Every question of every hypothesis was listed, so the context (and a step's prompt
    tokens) grew with each resolved question until each hypothesis had its
    max_questions_per_hypothesis: 20 KB at step 50, 32 KB at step 415 in a reader's
    trial. Another hypothesis's resolved question is nothing a turn can act on (a reply
    resolves only its own): it is no longer listed."""
    from tests.longcase import long_config, make_long_case

    case = make_long_case(tmp_path / "long", hypotheses=3, research_per_hypothesis=24)
    assert case.investigator(long_config(24)).run(case.case_id, max_steps=1000).outcome \
        == COMPLETED
    with case.store.session() as s:
        row = s.get(CaseRecord, case.case_id)
        assert row is not None
        last = row.head_seq
    resolved: dict[str, int] = {}  # question -> its hypothesis, once seen resolved
    left_out = 0
    for seq in range(1, last + 1):
        with case.store.session() as s:
            art = Store.get_artifact(s, case.case_id, ARTIFACT_CONTEXT.format(seq=seq))
        if art is None:  # a step without a model call
            continue
        doc = json.loads(art.data)
        selected = doc["hypothesis"]["id"]
        listed = {q["question_id"] for q in doc["questions"]}
        others = [q for q in doc["questions"] if q["hypothesis_id"] != selected]
        assert all(q["status"] == "open" for q in others), (seq, others)
        left_out += sum(1 for qid, hid in resolved.items()
                        if hid != selected and qid not in listed)
        resolved.update({q["question_id"]: q["hypothesis_id"] for q in doc["questions"]
                         if q["status"] == "resolved"})
    assert left_out > 0  # other hypotheses' resolved questions existed and were left out
