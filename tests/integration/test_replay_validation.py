"""Checkpoint replay validation (seed 000, "Persistence and recovery"): every generation's
sequence, parent, hash, state bytes, context identity and selected hypothesis are checked
before a case continues; a deleted pointer or a changed policy stops the case instead of
silently restarting it; validated generations are cached only behind the archive digest.

Published rows (checkpoints, stage records, artifact bytes, a frozen policy) cannot be
changed at all while the store's guards stand (``investigation.store.guards``): every
such tamper here is first shown to be refused by the store (:func:`forge`), then made
with the guards dropped (someone with DDL rights), and the next process to meet the case
(a fresh environment: full replay) must stop it."""

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
from investigation.store import blobs
from investigation.store.models import (
    Artifact,
    CaseRecord,
    Checkpoint,
    ManifestPointer,
    RevisionRecord,
    StageRun,
)
from tests.casekit import Case, make_case, unguarded


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
    """Change rows the engine itself changes (pointers, accounts, the case head)."""
    with c.store.session() as s:
        fn(s)


def forge(c: Case, fn: Callable[[Session], Any]) -> None:
    """Change published rows: refused by the store's guards; done with them dropped."""
    from sqlalchemy.exc import DBAPIError

    with pytest.raises(DBAPIError, match="STORE_IMMUTABLE"), c.store.session() as s:
        fn(s)
    with unguarded(c.store), c.store.session() as s:
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
    forge(case, lambda s: s.execute(update(RevisionRecord).where(
        col(RevisionRecord.case_id) == case.case_id).values(policy_json=policy)))
    refused(case, "POLICY_CHANGED")


def test_a_policy_rehashed_after_the_fact_is_still_refused(case: Case) -> None:
    from investigation.store.engine import sha256_hex

    other = '{"budget":{"credit_units":999},"loop":{}}'
    forge(case, lambda s: s.execute(update(RevisionRecord).where(
        col(RevisionRecord.case_id) == case.case_id).values(
        policy_json=other, policy_sha256=sha256_hex(other.encode()))))
    refused(case, "POLICY_CHANGED")  # the head state recorded the original policy hash


def _edit_bytes(s: Session, c: Case, path: str, edit: Callable[[bytes], bytes],
                repoint: bool = False) -> None:
    """Rewrite the bytes stored for an artifact: in place (its blob then decodes to bytes
    its sha256 does not name), or, with ``repoint``, as a new blob the artifact row is
    pointed at (its sha256 then names the new bytes)."""
    from sqlalchemy import insert

    from investigation.store.models import Blob

    sha = s.exec(select(Artifact.sha256).where(Artifact.case_id == c.case_id,
                                               Artifact.path == path)).one()
    data = edit(blobs.load(s, sha, cache=blobs.ByteCache()))
    if repoint:
        new = blobs.sha256_hex(data)
        s.execute(insert(Blob).values(sha256=new, size_bytes=len(data), encoding="zstd",
                                      base_sha256=None, depth=0, data=blobs.compress(data)))
        s.execute(update(Artifact).where(col(Artifact.case_id) == c.case_id,
                                         col(Artifact.path) == path).values(sha256=new))
    else:
        s.execute(update(Blob).where(col(Blob.sha256) == sha).values(
            encoding="zstd", base_sha256=None, depth=0, data=blobs.compress(data)))


def _set_state_bytes(s: Session, c: Case, seq: int, repoint: bool = False) -> None:
    _edit_bytes(s, c, ARTIFACT_STATE.format(seq=seq),
                lambda b: b.replace(b'"outcome":"PROGRESSED"', b'"outcome":"COMPLETED"'),
                repoint)


@pytest.mark.parametrize("repoint", [False, True])
@pytest.mark.parametrize("seq", [1, 2, 3])
def test_an_edited_state_of_any_generation_is_found(case: Case, seq: int,
                                                    repoint: bool) -> None:
    forge(case, lambda s: _set_state_bytes(s, case, seq, repoint))
    err = refused(case, "CHECKPOINT_INVALID")
    assert err.details["seq"] == seq


def test_a_missing_generation_is_a_sequence_gap(case: Case) -> None:
    forge(case, lambda s: s.execute(delete(Checkpoint).where(
        col(Checkpoint.case_id) == case.case_id, col(Checkpoint.seq) == 2)))
    refused(case, "CHECKPOINT_INVALID")


def test_a_changed_selected_hypothesis_is_found(case: Case) -> None:
    forge(case, lambda s: s.execute(update(Checkpoint).where(
        col(Checkpoint.case_id) == case.case_id, col(Checkpoint.seq) == 1)
        .values(hypothesis_id=2)))
    refused(case, "CHECKPOINT_INVALID")


@pytest.mark.parametrize("repoint", [False, True])
def test_an_altered_context_is_found(case: Case, repoint: bool) -> None:
    forge(case, lambda s: _edit_bytes(s, case, ARTIFACT_CONTEXT.format(seq=2),
                                      lambda b: b + b" ", repoint))
    assert refused(case, "CHECKPOINT_INVALID").details["seq"] == 2


def test_a_rewritten_build_context_record_is_found(case: Case) -> None:
    forge(case, lambda s: _reselect_step_1(s, case))
    assert refused(case, "CHECKPOINT_INVALID").details["seq"] == 1


def test_validated_generations_are_cached_only_behind_the_archive_digest(
        case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[int] = []
    real = checkpoints._verify_generation

    def counting(s: Session, case_id: str, cp: Checkpoint, parent: str | None,
                 fresh: Any) -> Any:
        checked.append(cp.seq)
        return real(s, case_id, cp, parent, fresh)

    monkeypatch.setattr(checkpoints, "_verify_generation", counting)
    cache = checkpoints.ReplayCache()
    with case.store.session() as s:
        row = s.get(CaseRecord, case.case_id)
        assert row is not None
        first = checkpoints.replay(s, row, cache)
        assert (first.head_seq, first.full) == (3, True) and checked == [1, 2, 3]
        checked.clear()
        again = checkpoints.replay(s, row, cache)
        assert (again.head_seq, again.full) == (3, False) and checked == []  # nothing new
    inv = Investigator(case.env())
    inv.env.replay_cache = cache
    inv.env.limits_key = ""
    inv.step(case.case_id)  # validates the chain of 3 from the cache, publishes step 4
    assert checked == []
    inv.step(case.case_id)
    assert checked == [4]  # only the new generation, its digest chained onto the cache's
    checked.clear()
    # Other limits: the cache entry does not apply.
    with case.store.session() as s:
        row = s.get(CaseRecord, case.case_id)
        assert row is not None
        checkpoints.verify_replay(s, row, cache, limits_key="other")
    assert checked == [1, 2, 3, 4, 5]
    checked.clear()
    # A cached digest that the store no longer records (its checkpoint rewritten, the
    # guards dropped) is not trusted: full replay, which finds the change.
    forge(case, lambda s: s.execute(update(Checkpoint).where(
        col(Checkpoint.case_id) == case.case_id, col(Checkpoint.seq) == 4)
        .values(archive_digest="0" * 64)))  # the generation the cache entry ends at
    with pytest.raises(InvestigationError) as info, case.store.session() as s:
        row = s.get(CaseRecord, case.case_id)
        assert row is not None
        checkpoints.verify_replay(s, row, cache)
    assert info.value.code == "CHECKPOINT_INVALID" and checked == [1, 2, 3, 4]
    assert info.value.details["seq"] == 4


def test_old_bytes_changed_behind_a_warm_cache_are_found_by_the_next_full_replay(
        case: Case, tmp_path: Path) -> None:
    from investigation import operations

    inv = Investigator(case.env())
    inv.step(case.case_id)  # validates and caches generations 1..3, publishes 4
    forge(case, lambda s: _set_state_bytes(s, case, 1))
    # The warm process checks only what was published since (docs/decisions.md,
    # "Incremental replay"); whatever meets the case afresh replays it all.
    assert inv.step(case.case_id).outcome == "COMPLETED"
    with pytest.raises(InvestigationError) as info, case.store.session() as s:
        checkpoints.verify_chain(s, case.case_id)
    assert (info.value.code, info.value.details["seq"]) == ("CHECKPOINT_INVALID", 1)
    with pytest.raises(InvestigationError) as info:
        operations.verify(case.store, case.case_id)
    assert info.value.code == "CHECKPOINT_INVALID"
    with pytest.raises(InvestigationError) as info:
        operations.export(case.store, case.case_id, tmp_path / "out")
    assert info.value.code == "CHECKPOINT_INVALID"
    assert not (tmp_path / "out").exists()


def test_wiped_checkpoints_and_head_do_not_restart_or_loop(case: Case) -> None:
    forge(case, lambda s: _wipe_checkpoints_and_head(s, case))
    refused(case, "CHECKPOINT_INVALID")


@pytest.mark.parametrize("garbage", ["[]", "nope", '"text"'])
def test_a_garbled_stage_record_is_invalid_not_a_crash(case: Case, garbage: str) -> None:
    forge(case, lambda s: s.execute(update(StageRun).where(
        col(StageRun.case_id) == case.case_id, col(StageRun.step_seq) == 1,
        col(StageRun.stage) == "build_context").values(output_json=garbage)))
    assert refused(case, "CHECKPOINT_INVALID").details["seq"] == 1


def test_a_rewritten_stage_record_is_refused_or_found_afresh(case: Case) -> None:
    inv = Investigator(case.env())
    inv.step(case.case_id)  # validates and caches generations 1..3

    forge(case, lambda s: _reselect_step_1(s, case))
    inv.env.replay_cache.forget(case.case_id)  # a redelivery: full replay
    with pytest.raises(InvestigationError) as info:
        inv.step(case.case_id)  # the same process
    assert (info.value.code, info.value.details["seq"]) == ("CHECKPOINT_INVALID", 1)


def swap_policy(c: Case) -> None:
    """Replace the frozen policy of the case's revision (guards dropped), hash included."""
    from investigation.store.engine import sha256_hex

    def swap(s: Session) -> None:
        rev = s.exec(select(RevisionRecord).where(RevisionRecord.case_id == c.case_id)).one()
        policy = rev.policy_json.replace('"source.read":2', '"source.read":50')
        rev.policy_json, rev.policy_sha256 = policy, sha256_hex(policy.encode())
        s.add(rev)
    forge(c, swap)


def test_a_policy_swapped_between_the_stages_of_a_step_is_refused(case: Case) -> None:
    stages = Stages(case.env())
    key = StepKey(case.case_id, 1, 4)
    stages.run("build_context", key)
    swap_policy(case)
    with pytest.raises(InvestigationError) as info:
        Stages(case.env()).run("llm_call", key)
        Stages(case.env()).run("validate", key)
    assert info.value.code == "POLICY_CHANGED"


def test_a_policy_swapped_under_one_process_running_the_whole_step_is_not_published(
        case: Case) -> None:
    """Decision 127: the stages after build_context take the policy build_context named
    from their process; publish compares it with the store's and refuses a swap."""
    from investigation.constants import STAGES

    stages = Stages(case.env())
    key = StepKey(case.case_id, 1, 4)
    stages.run("build_context", key)
    swap_policy(case)
    with pytest.raises(InvestigationError) as info:
        for stage in STAGES[1:]:
            stages.run(stage, key)
    assert info.value.code == "POLICY_CHANGED"
    with case.store.session() as s:
        assert s.get(CaseRecord, case.case_id).head_seq == 3  # not published


@pytest.mark.parametrize(("sql", "guarded"), [
    ("UPDATE budget_account SET status='rejected' WHERE hypothesis_id=2", False),
    ("UPDATE evidence SET findings_json='[{\"key\":\"x\",\"text\":\"FORGED\"}]' "
     "WHERE evidence_id='E1'", True),
    ("UPDATE question SET status='resolved'", False),
    ("UPDATE budget_account SET credit_units=credit_units+1000, "
     "balance_units=balance_units+1000 WHERE hypothesis_id=1", False),
    ("UPDATE evidence SET assessed=TRUE, refund_units=3 WHERE evidence_id='E2'", False),
    ("UPDATE budget_account SET no_novelty_streak=5 WHERE hypothesis_id=1", False),
    ("DELETE FROM evidence WHERE evidence_id='E2'", True),
    ("UPDATE evidence SET refund_units=0 WHERE evidence_id='E1'", True),
])
@pytest.mark.parametrize("warm", [False, True])
def test_live_rows_that_differ_from_the_head_state_stop_the_case(
        case: Case, sql: str, guarded: bool, warm: bool) -> None:
    """Rows the engine still changes are checked at every step, by a warm process too;
    published ones (a record's findings, an assessed record, a deletion) are refused by
    the store and, with its guards dropped, found by the next process (full depth)."""
    from sqlalchemy import text

    inv = Investigator(case.env())
    if warm:  # the process has met the case: its next check is incremental
        with case.store.session() as s:
            row = s.get(CaseRecord, case.case_id)
            assert row is not None
            checkpoints.replay(s, row, inv.env.replay_cache, inv.env.limits_key)
    (forge if guarded else tamper)(case, lambda s: s.execute(text(sql)))
    if warm and not guarded:
        with pytest.raises(InvestigationError) as info:
            inv.step(case.case_id)
        assert info.value.code == "STATE_TAMPERED"
    refused(case, "STATE_TAMPERED")


def test_a_long_lived_runner_sees_a_rewritten_head(case: Case) -> None:
    inv = Investigator(case.env())
    inv.step(case.case_id)
    forge(case, lambda s: _wipe_checkpoints_and_head(s, case))
    with pytest.raises(InvestigationError) as info:
        inv.step(case.case_id)  # the same runner, its stage records cached
    assert info.value.code == "CHECKPOINT_INVALID"


@pytest.mark.parametrize("garbage", ["[]", "{}", "nope"])
def test_a_garbled_record_of_a_step_in_progress_is_invalid(case: Case, garbage: str) -> None:
    Stages(case.env()).run("build_context", StepKey(case.case_id, 1, 4))
    forge(case, lambda s: s.execute(update(StageRun).where(
        col(StageRun.case_id) == case.case_id, col(StageRun.step_seq) == 4,
        col(StageRun.stage) == "build_context").values(output_json=garbage)))
    refused(case, "CHECKPOINT_INVALID")


def test_a_pointer_deleted_during_a_step_stops_its_publication(case: Case) -> None:
    """The step's replay passed before the pointer was deleted: its publication folded an
    empty parent state into a new checkpoint, which then named itself as the head, and
    only `verify` saw the damage (a fleet trial). Publication now checks the pointer names
    the parent checkpoint's state, and publishes nothing otherwise."""
    from investigation.constants import STAGES

    stages = Stages(case.env())
    key = StepKey(case.case_id, 1, 4)
    for stage in STAGES[:-1]:
        stages.run(stage, key)
    tamper(case, lambda s: s.execute(delete(ManifestPointer).where(
        col(ManifestPointer.case_id) == case.case_id)))
    before = fingerprint(case)
    with pytest.raises(InvestigationError) as err:
        stages.run("publish", key)
    assert err.value.code == "CHECKPOINT_INVALID" and "pointer" in err.value.message
    assert fingerprint(case) == before and before[0] == 3
    with case.store.session() as s:
        assert s.exec(select(Checkpoint).where(Checkpoint.case_id == case.case_id,
                                               Checkpoint.seq == 4)).first() is None
