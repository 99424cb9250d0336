"""Checkpoint replay validation (seed 000, "Persistence and recovery"): every generation's
sequence, parent, hash, state bytes, context identity and selected hypothesis are checked
before a case continues; a deleted pointer or a changed policy stops the case instead of
silently restarting it; validated generations are cached only behind the archive digest."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import delete, update
from sqlmodel import Session, col, select

from investigation.constants import ARTIFACT_CONTEXT, ARTIFACT_STATE, PROGRESSED
from investigation.errors import InvestigationError
from investigation.loop import checkpoints
from investigation.loop.investigator import Investigator
from investigation.loop.outcome import StepKey
from investigation.loop.stages import Stages
from investigation.store.models import (
    Artifact,
    CaseRecord,
    Checkpoint,
    ManifestPointer,
    RevisionRecord,
    StageRun,
)
from tests.casekit import Case, make_case


@pytest.fixture
def case(tmp_path: Path) -> Case:
    """The tiny case after three published steps."""
    c = make_case(tmp_path / "c")
    inv = c.investigator()
    for _ in range(3):
        assert inv.step(c.case_id).outcome == PROGRESSED
    return c


def fingerprint(c: Case) -> tuple[int, int, int]:
    with c.store.session() as s:
        case = s.get(CaseRecord, c.case_id)
        assert case is not None
        runs = len(s.exec(select(StageRun).where(StageRun.case_id == c.case_id)).all())
        arts = len(s.exec(select(Artifact).where(Artifact.case_id == c.case_id)).all())
        return case.head_seq, runs, arts


def tamper(c: Case, fn: Callable[[Session], Any]) -> None:
    with c.store.session() as s:
        fn(s)


def refused(c: Case, code: str) -> InvestigationError:
    """The next step, in a fresh process environment, is refused with ``code`` and
    changes nothing."""
    before = fingerprint(c)
    with pytest.raises(InvestigationError) as info:
        Investigator(c.env()).step(c.case_id)
    assert info.value.code == code
    assert fingerprint(c) == before
    return info.value


def _reselect_step_1(s: Session, c: Case) -> None:
    """Rewrite step 1's recorded build_context as if it had selected hypothesis 2."""
    run = s.exec(select(StageRun).where(
        StageRun.case_id == c.case_id, StageRun.step_seq == 1,
        StageRun.stage == "build_context")).one()
    run.output_json = run.output_json.replace('"hypothesis_id":1', '"hypothesis_id":2')
    s.add(run)


def _wipe_checkpoints_and_head(s: Session, c: Case) -> None:
    """Delete every checkpoint and reset the case head, as if nothing had been published."""
    s.execute(delete(Checkpoint).where(col(Checkpoint.case_id) == c.case_id))
    s.execute(update(CaseRecord).where(col(CaseRecord.id) == c.case_id)
              .values(head_seq=0, head_hash=None))


def test_an_intact_chain_verifies_and_continues(case: Case) -> None:
    with case.store.session() as s:
        assert checkpoints.verify_chain(s, case.case_id) == 3
    assert Investigator(case.env()).step(case.case_id).outcome == PROGRESSED


def test_a_deleted_state_pointer_stops_the_case(case: Case) -> None:
    tamper(case, lambda s: s.execute(delete(ManifestPointer).where(
        col(ManifestPointer.case_id) == case.case_id)))
    assert "pointer" in refused(case, "CHECKPOINT_INVALID").message


def test_a_pointer_to_an_older_state_stops_the_case(case: Case) -> None:
    tamper(case, lambda s: s.execute(update(ManifestPointer).where(
        col(ManifestPointer.case_id) == case.case_id).values(
        path=ARTIFACT_STATE.format(seq=1))))
    refused(case, "CHECKPOINT_INVALID")


@pytest.mark.parametrize("policy", [None, '{"budget":{},"loop":{}}'])
def test_a_removed_or_changed_policy_does_not_silently_restart(case: Case,
                                                               policy: str | None) -> None:
    tamper(case, lambda s: s.execute(update(RevisionRecord).where(
        col(RevisionRecord.case_id) == case.case_id).values(policy_json=policy)))
    refused(case, "POLICY_CHANGED")


def test_a_policy_rehashed_after_the_fact_is_still_refused(case: Case) -> None:
    from investigation.store.engine import sha256_hex

    other = '{"budget":{"credit_units":999},"loop":{}}'
    tamper(case, lambda s: s.execute(update(RevisionRecord).where(
        col(RevisionRecord.case_id) == case.case_id).values(
        policy_json=other, policy_sha256=sha256_hex(other.encode()))))
    refused(case, "POLICY_CHANGED")  # the head state recorded the original policy hash


def _set_state_bytes(s: Session, c: Case, seq: int) -> None:
    art = s.exec(select(Artifact).where(Artifact.case_id == c.case_id,
                                        Artifact.path == ARTIFACT_STATE.format(seq=seq))).one()
    art.data = art.data.replace(b'"outcome":"PROGRESSED"', b'"outcome":"COMPLETED"')
    s.add(art)


@pytest.mark.parametrize("seq", [1, 2, 3])
def test_an_edited_state_of_any_generation_is_found(case: Case, seq: int) -> None:
    tamper(case, lambda s: _set_state_bytes(s, case, seq))
    err = refused(case, "CHECKPOINT_INVALID")
    assert err.details["seq"] == seq


def test_a_missing_generation_is_a_sequence_gap(case: Case) -> None:
    tamper(case, lambda s: s.execute(delete(Checkpoint).where(
        col(Checkpoint.case_id) == case.case_id, col(Checkpoint.seq) == 2)))
    refused(case, "CHECKPOINT_INVALID")


def test_a_changed_selected_hypothesis_is_found(case: Case) -> None:
    tamper(case, lambda s: s.execute(update(Checkpoint).where(
        col(Checkpoint.case_id) == case.case_id, col(Checkpoint.seq) == 1)
        .values(hypothesis_id=2)))
    refused(case, "CHECKPOINT_INVALID")


def test_an_altered_context_is_found(case: Case) -> None:
    def edit(s: Session) -> None:
        art = s.exec(select(Artifact).where(
            Artifact.case_id == case.case_id,
            Artifact.path == ARTIFACT_CONTEXT.format(seq=2))).one()
        art.data = art.data + b" "
        s.add(art)
    tamper(case, edit)
    assert refused(case, "CHECKPOINT_INVALID").details["seq"] == 2


def test_a_rewritten_build_context_record_is_found(case: Case) -> None:
    tamper(case, lambda s: _reselect_step_1(s, case))
    assert refused(case, "CHECKPOINT_INVALID").details["seq"] == 1


def test_validated_generations_are_cached_only_behind_the_archive_digest(
        case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[int] = []
    real = checkpoints._verify_generation

    def counting(s: Session, case_id: str, cp: Checkpoint, parent: str | None) -> None:
        checked.append(cp.seq)
        real(s, case_id, cp, parent)

    monkeypatch.setattr(checkpoints, "_verify_generation", counting)
    cache = checkpoints.ReplayCache()
    with case.store.session() as s:
        row = s.get(CaseRecord, case.case_id)
        assert row is not None
        assert checkpoints.verify_replay(s, row, cache) == 3
        assert checked == [1, 2, 3]
        checked.clear()
        assert checkpoints.verify_replay(s, row, cache) == 3
        assert checked == []  # nothing changed: nothing re-read
    inv = Investigator(case.env())
    inv.env.replay_cache = cache
    inv.env.limits_key = ""
    inv.step(case.case_id)  # validates the chain of 3 from the cache, publishes step 4
    assert checked == []
    inv.step(case.case_id)
    assert checked == [4]  # only the new generation
    checked.clear()
    # Other limits: the cache entry does not apply.
    with case.store.session() as s:
        row = s.get(CaseRecord, case.case_id)
        assert row is not None
        checkpoints.verify_replay(s, row, cache, limits_key="other")
    assert checked == [1, 2, 3, 4, 5]
    checked.clear()
    # Changed bytes of an old generation (even with its stored sha256 column left as it
    # was) change the newly computed archive digest: full replay, and it fails there.
    tamper(case, lambda s: _set_state_bytes(s, case, 1))
    with pytest.raises(InvestigationError) as info, case.store.session() as s:
        row = s.get(CaseRecord, case.case_id)
        assert row is not None
        checkpoints.verify_replay(s, row, cache)
    assert info.value.code == "CHECKPOINT_INVALID" and checked == [1]


def test_wiped_checkpoints_and_head_do_not_restart_or_loop(case: Case) -> None:
    tamper(case, lambda s: _wipe_checkpoints_and_head(s, case))
    refused(case, "CHECKPOINT_INVALID")


@pytest.mark.parametrize("garbage", ["[]", "nope", '"text"'])
def test_a_garbled_stage_record_is_invalid_not_a_crash(case: Case, garbage: str) -> None:
    tamper(case, lambda s: s.execute(update(StageRun).where(
        col(StageRun.case_id) == case.case_id, col(StageRun.step_seq) == 1,
        col(StageRun.stage) == "build_context").values(output_json=garbage)))
    assert refused(case, "CHECKPOINT_INVALID").details["seq"] == 1


def test_a_warm_cache_sees_a_rewritten_stage_record(case: Case) -> None:
    inv = Investigator(case.env())
    inv.step(case.case_id)  # validates and caches generations 1..3

    tamper(case, lambda s: _reselect_step_1(s, case))
    with pytest.raises(InvestigationError) as info:
        inv.step(case.case_id)  # the same process, its cache warm
    assert info.value.code == "CHECKPOINT_INVALID"


def test_a_policy_swapped_between_the_stages_of_a_step_is_refused(case: Case) -> None:
    from investigation.store.engine import sha256_hex

    stages = Stages(case.env())
    key = StepKey(case.case_id, 1, 4)
    stages.run("build_context", key)

    def swap(s: Session) -> None:
        rev = s.exec(select(RevisionRecord).where(
            RevisionRecord.case_id == case.case_id)).one()
        policy = rev.policy_json.replace('"source.read":2', '"source.read":50')
        rev.policy_json, rev.policy_sha256 = policy, sha256_hex(policy.encode())
        s.add(rev)
    tamper(case, swap)
    with pytest.raises(InvestigationError) as info:
        Stages(case.env()).run("llm_call", key)
        Stages(case.env()).run("validate", key)
    assert info.value.code == "POLICY_CHANGED"


@pytest.mark.parametrize("sql", [
    "UPDATE budget_account SET status='rejected' WHERE hypothesis_id=2",
    "UPDATE evidence SET findings_json='[{\"key\":\"x\",\"text\":\"FORGED\"}]' "
    "WHERE evidence_id='E1'",
    "UPDATE question SET status='resolved'",
    "UPDATE budget_account SET credit_units=credit_units+1000, "
    "balance_units=balance_units+1000 WHERE hypothesis_id=1",
    "UPDATE evidence SET assessed=TRUE, refund_units=3 WHERE evidence_id='E2'",
    "UPDATE budget_account SET no_novelty_streak=5 WHERE hypothesis_id=1",
])
def test_live_rows_that_differ_from_the_head_state_stop_the_case(case: Case, sql: str) -> None:
    from sqlalchemy import text

    tamper(case, lambda s: s.execute(text(sql)))
    refused(case, "STATE_TAMPERED")


def test_a_long_lived_runner_sees_a_rewritten_head(case: Case) -> None:
    inv = Investigator(case.env())
    inv.step(case.case_id)
    tamper(case, lambda s: _wipe_checkpoints_and_head(s, case))
    with pytest.raises(InvestigationError) as info:
        inv.step(case.case_id)  # the same runner, its stage records cached
    assert info.value.code == "CHECKPOINT_INVALID"


@pytest.mark.parametrize("garbage", ["[]", "{}", "nope"])
def test_a_garbled_record_of_a_step_in_progress_is_invalid(case: Case, garbage: str) -> None:
    Stages(case.env()).run("build_context", StepKey(case.case_id, 1, 4))
    tamper(case, lambda s: s.execute(update(StageRun).where(
        col(StageRun.case_id) == case.case_id, col(StageRun.step_seq) == 4,
        col(StageRun.stage) == "build_context").values(output_json=garbage)))
    refused(case, "CHECKPOINT_INVALID")
