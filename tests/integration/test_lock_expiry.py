"""Stage tasks under a real Redis lease lock whose holder stalls past its TTL.

The lock only prevents wasted work; correctness rests on the SQL fencing. A holder whose
lease ran out, between stages or inside one, while a newer holder took the lock and
published the step, must never publish over the newer head, charge again or delete the
newer holder's key. A stage that gives up after store retries, or fails unexpectedly,
leaves no orphan lock behind.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy.exc import OperationalError
from sqlmodel import col, select

import workers.locks
from investigation.constants import PROGRESSED, REDIS_LOCK_KEY, STAGES
from investigation.loop.checkpoints import verify_chain
from investigation.loop.stages import Stages
from investigation.store.models import Artifact, Checkpoint, Evidence, LedgerEntry, LLMAttempt
from investigation.tools import ToolRouter
from tests.casekit import Case, make_case
from workers import runtime, tasks
from workers.locks import RedisCaseLock
from workers.runtime import Runtime
from workers.settings import Settings

pytestmark = pytest.mark.redis


@pytest.fixture
def setup(tmp_path: Path, redis_url: str,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Case, RedisCaseLock]]:
    """A case, a real Redis lock on it and the distributed runtime; follow-up dispatches
    (``investigation.dispatch``) are recorded, not sent to a broker."""
    case = make_case(tmp_path / "case")
    client = redis.Redis.from_url(redis_url)
    lock = RedisCaseLock(client, ttl_s=30)
    key = REDIS_LOCK_KEY.format(case_id=case.case_id)
    client.delete(key)
    runtime.configure(Runtime("distributed", Settings(), case.env(), lock))
    enqueued: list[Any] = []
    monkeypatch.setattr(tasks.dispatch, "apply_async", lambda *a, **k: enqueued.append(a))
    monkeypatch.setattr(CLOCK, "ahead", 0.0)
    monkeypatch.setattr(workers.locks, "time", CLOCK)
    yield case, lock
    runtime.configure(None)
    client.delete(key)
    client.close()


class _Clock:
    """``time`` for ``workers.locks``: ``monotonic()`` runs ``ahead`` seconds ahead."""

    ahead = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead


CLOCK = _Clock()


def expire(lock: RedisCaseLock, case_id: str) -> None:
    """The lease runs out (1 ms TTL), as for a holder stalled past it: this process's
    clock moves on by the TTL, so its next stage renews in Redis (``RedisCaseLock.renew``
    skips a lease it renewed moments ago)."""
    CLOCK.ahead += lock.ttl_ms / 1000 + 1
    key = REDIS_LOCK_KEY.format(case_id=case_id)
    assert lock.client.pexpire(key, 1)
    deadline = time.monotonic() + 5
    while lock.client.exists(key):
        assert time.monotonic() < deadline
        time.sleep(0.005)


def run(stage: str, payload: dict[str, Any]) -> dict[str, Any]:
    """One stage task, executed like a worker would (Celery's local execution)."""
    result: dict[str, Any] = tasks.STAGE_TASKS[stage].apply(args=(dict(payload),)).get()
    return result


def payload_for(case: Case, token: str) -> dict[str, Any]:
    """A payload in the format of older chains, which carried the token in the payload
    (still accepted, so a rolling upgrade finishes the chains in flight)."""
    payload = tasks.new_payload(case.case_id, 1, "distributed")
    assert payload is not None
    return payload | {"token": token}


def effects(case: Case) -> dict[str, Any]:
    with case.store.session() as s:
        ledger = s.exec(select(LedgerEntry).where(LedgerEntry.case_id == case.case_id)
                        .order_by(col(LedgerEntry.id))).all()
        checkpoints = s.exec(select(Checkpoint.seq).where(
            Checkpoint.case_id == case.case_id)).all()
        evidence = s.exec(select(Evidence.evidence_id).where(
            Evidence.case_id == case.case_id)).all()
        calls = s.exec(select(LLMAttempt)).all()
        results = s.exec(select(Artifact.path).where(
            col(Artifact.path).like("%/result.json"))).all()
        head_ok = verify_chain(s, case.case_id)
    return {"ledger": [(r.hypothesis_id, r.step_seq, r.kind, r.amount_units) for r in ledger],
            "checkpoints": sorted(checkpoints), "evidence": sorted(evidence),
            "model_calls": len(calls), "results": sorted(results), "chain": head_ok}


def one_clean_step(tmp_path: Path) -> dict[str, Any]:
    reference = make_case(tmp_path / "reference")
    assert reference.investigator().step(reference.case_id).outcome == PROGRESSED
    return effects(reference)


def test_a_holder_stalled_between_stages_cannot_publish_or_charge(
    setup: tuple[Case, RedisCaseLock], tmp_path: Path
) -> None:
    case, lock = setup
    token_a = lock.acquire(case.case_id)
    a = payload_for(case, token_a)
    for stage in STAGES[:4]:  # build_context .. persist_plan, then A stalls
        a = run(stage, a)
        assert a["halt"] is None
    expire(lock, case.case_id)
    token_b = lock.acquire(case.case_id)  # a newer dispatch takes the free lock
    b = payload_for(case, token_b)
    assert b["step_seq"] == a["step_seq"]
    for stage in STAGES:
        b = run(stage, b)
    assert b["halt"]["outcome"] == PROGRESSED
    # A wakes up while B still holds the lock: its chain stops at the next stage.
    stopped = run("settle_reserve", a)
    assert stopped["halt"]["outcome"] == "LOCK_LOST"
    assert lock.holder(case.case_id) == token_b
    tasks.advance.apply(args=(stopped,)).get()
    assert lock.holder(case.case_id) == token_b  # A's advance never deletes B's key
    # B has released; A re-takes the free key, but every stage it reaches is finished:
    # it reads B's recorded outputs and writes nothing (no second charge or checkpoint).
    assert lock.release(case.case_id, token_b)
    for stage in STAGES[4:]:
        a = run(stage, a)
    assert a["halt"]["outcome"] == PROGRESSED and a["halt"]["step_seq"] == b["step_seq"]
    tasks.advance.apply(args=(a,)).get()
    assert lock.holder(case.case_id) is None  # A's re-taken lease is released, no orphan
    assert effects(case) == one_clean_step(tmp_path)


def test_a_holder_paused_inside_a_stage_past_its_ttl_cannot_overwrite_the_newer_head(
    setup: tuple[Case, RedisCaseLock], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case, lock = setup
    token_a = lock.acquire(case.case_id)
    a = payload_for(case, token_a)
    for stage in STAGES[:5]:  # .. settle_reserve: A reserved the credit
        a = run(stage, a)
    inside, go_on = threading.Event(), threading.Event()
    original = ToolRouter.execute
    paused_thread: list[threading.Thread] = []

    def execute(self: ToolRouter, operation: str, arguments: dict[str, Any]) -> Any:
        if threading.current_thread() in paused_thread:
            inside.set()
            assert go_on.wait(30)  # A is paused inside execute_tool, past its lease
        return original(self, operation, arguments)

    monkeypatch.setattr(ToolRouter, "execute", execute)
    out: dict[str, Any] = {}
    worker_a = threading.Thread(target=lambda: out.update(run("execute_tool", a)))
    paused_thread.append(worker_a)
    worker_a.start()
    assert inside.wait(30)
    expire(lock, case.case_id)
    token_b = lock.acquire(case.case_id)
    b = payload_for(case, token_b)
    for stage in STAGES:
        b = run(stage, b)
    assert b["halt"]["outcome"] == PROGRESSED
    go_on.set()
    worker_a.join(30)
    assert out["halt"]["outcome"] == "STALE"  # its write met the newer head
    rest = out
    for stage in STAGES[6:]:
        rest = run(stage, rest)
    tasks.advance.apply(args=(rest,)).get()
    assert lock.holder(case.case_id) == token_b  # never another holder's key
    assert effects(case) == one_clean_step(tmp_path)


def test_store_retries_inside_a_locked_stage_leave_no_orphan_lock(
    setup: tuple[Case, RedisCaseLock], monkeypatch: pytest.MonkeyPatch
) -> None:
    case, lock = setup
    original = Stages.run
    failures = {"left": 2}

    def flaky(self: Stages, stage: str, key: Any, delivery: Any = None) -> Any:
        if stage == "validate" and failures["left"] > 0:
            failures["left"] -= 1
            raise OperationalError("UPDATE", {}, Exception("database is locked"))
        return original(self, stage, key, delivery)

    monkeypatch.setattr(Stages, "run", flaky)
    enqueued: list[Any] = []
    monkeypatch.setattr(tasks.dispatch, "apply_async", lambda *a, **k: enqueued.append(a))
    # Two failures, then the stage succeeds on its retry: the step completes, the lock is
    # handed on to the follow-up dispatch (released, re-enqueued).
    token = lock.acquire(case.case_id)
    result = tasks.step_chain(payload_for(case, token), token).apply().get()
    assert result["halt"]["outcome"] == "YIELDED"  # the dispatch's one step is done
    assert failures["left"] == 0
    assert lock.holder(case.case_id) is None and len(enqueued) == 1
    # The store stays down: the stage gives up after its retries and releases the lock.
    monkeypatch.setattr(tasks, "STORE_MAX_RETRIES", 2)
    failures["left"] = 10
    token = lock.acquire(case.case_id)
    result = tasks.step_chain(payload_for(case, token), token).apply().get()
    assert (result["halt"]["outcome"], result["halt"]["reason"]) == ("ERROR",
                                                                     "STORE_UNAVAILABLE")
    assert failures["left"] == 10 - 3
    assert lock.holder(case.case_id) is None  # no orphan lock until the lease runs out


def test_advance_and_dispatch_retry_a_dropped_store_connection(
    setup: tuple[Case, RedisCaseLock], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet trial terminated the workers' PostgreSQL connections: the stages retried,
    but `advance` and `dispatch` crashed with a traceback and the case waited for the
    recovery sweep. Both now retry later (a countdown), `advance` keeping the lock."""
    case, lock = setup
    original = tasks.new_payload
    failures = {"left": 2}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if failures["left"] > 0:
            failures["left"] -= 1
            raise OperationalError("SELECT", {}, Exception("terminating connection due to "
                                                           "administrator command"))
        return original(*args, **kwargs)

    monkeypatch.setattr(tasks, "new_payload", flaky)
    # dispatch: two failures, then the first step's chain goes out.
    from celery.canvas import _chain

    sent: list[Any] = []
    monkeypatch.setattr(_chain, "apply_async", lambda self, *a, **k: sent.append(self))
    result = tasks.dispatch.apply((case.case_id,)).get()
    assert result["outcome"] == "DISPATCHED" and failures["left"] == 0 and len(sent) == 1
    token = lock.holder(case.case_id)
    assert token is not None
    # advance after a step that went on: reading the next step fails twice, the lock is
    # kept, and the next step's chain goes out.
    payload = original(case.case_id, 5, "distributed")
    failures["left"] = 2
    assert payload is not None
    payload = payload | {"halt": {"outcome": "PROGRESSED", "reason": None}}
    tasks.advance.apply((payload,), {"token": token}).get()
    assert failures["left"] == 0 and len(sent) == 2
    assert lock.holder(case.case_id) == token
    lock.release(case.case_id, token)


def test_a_retried_stage_keeps_its_argsrepr_and_kwargsrepr() -> None:
    """Celery's retry sends neither: Flower showed a retried stage's whole lock token,
    and its log lines lost their case, step and stage (a fleet trial)."""
    from types import SimpleNamespace

    kept: dict[str, Any] = {}

    def retry(**options: Any) -> Exception:
        kept.update(options)
        return RuntimeError("retry")

    task = SimpleNamespace(
        request=SimpleNamespace(retries=1, argsrepr="case=c rev=1 step=2 stage=validate",
                                kwargsrepr="{'token': 'abcd1234'}"), retry=retry)
    tasks._retry_later(task, OperationalError("SELECT", {}, Exception("down")), None)
    assert kept["argsrepr"] == "case=c rev=1 step=2 stage=validate"
    assert kept["kwargsrepr"] == "{'token': 'abcd1234'}"
    assert kept["countdown"] == tasks.STORE_RETRY_COUNTDOWN_S * 2


def test_an_unexpected_stage_failure_releases_the_lock(
    setup: tuple[Case, RedisCaseLock], monkeypatch: pytest.MonkeyPatch
) -> None:
    case, lock = setup
    original = Stages.run

    def broken(self: Stages, stage: str, key: Any, delivery: Any = None) -> Any:
        if stage == "persist_plan":
            raise RuntimeError("a bug")
        return original(self, stage, key, delivery)

    monkeypatch.setattr(Stages, "run", broken)
    token = lock.acquire(case.case_id)
    with pytest.raises(RuntimeError):
        tasks.step_chain(payload_for(case, token), token).apply().get()
    assert lock.holder(case.case_id) is None
    # A stale chain meeting a newer holder stops before the stage and keeps its key.
    other = lock.acquire(case.case_id)
    stopped = run("persist_plan", payload_for(case, other) | {"token": token})
    assert stopped["halt"]["outcome"] == "LOCK_LOST"
    assert lock.holder(case.case_id) == other


def test_a_lease_released_by_a_sibling_process_stops_the_stale_chain_at_its_next_effect(
    setup: tuple[Case, RedisCaseLock], tmp_path: Path
) -> None:
    """The lease of chain A ends in another worker child (its ``advance`` released it) and
    a new dispatch B takes the case while a duplicate of A's chain goes on in this child,
    which renewed A's lease moments ago: the stage without an external effect may run
    (fenced), but ``execute_tool`` asks Redis and stops with ``LOCK_LOST`` (decision 122)."""
    case, lock = setup  # this worker child's lock
    sibling = RedisCaseLock(lock.client, ttl_s=30)  # another worker child
    token_a = lock.acquire(case.case_id)
    a = payload_for(case, token_a)
    for stage in STAGES[:4]:  # build_context .. persist_plan
        a = run(stage, a)
        assert a["halt"] is None
    assert sibling.release(case.case_id, token_a)
    token_b = sibling.acquire(case.case_id)
    a = run("settle_reserve", a)  # renewed here moments ago: runs, fenced in SQL
    assert a["halt"] is None
    stopped = run("execute_tool", a)
    assert stopped["halt"]["outcome"] == "LOCK_LOST"
    assert lock.holder(case.case_id) == token_b
    with case.store.session() as s:
        assert not s.exec(select(Artifact.path).where(
            col(Artifact.path).like("%/result.json"))).all()  # no query ran for A
    b = tasks.new_payload(case.case_id, 1, "distributed")
    assert b is not None
    for stage in STAGES:  # B finishes the step: A's settlement is B's, never a second one
        b = run(stage, b | {"token": token_b})
    assert b["halt"]["outcome"] == PROGRESSED
    assert effects(case) == one_clean_step(tmp_path)


def test_a_late_duplicate_of_a_finished_chains_first_stage_stops_and_leaves_the_lock_free(
    setup: tuple[Case, RedisCaseLock], tmp_path: Path
) -> None:
    """A killed worker child's delivery that the broker restores after its chain went on
    and released the lock (decision 135): its stage finds the released lease's tombstone,
    stops with ``LOCK_LOST`` and leaves the lock free, so the next dispatch of the case
    takes it at once (it used to re-take the free lock for its own short run)."""
    case, lock = setup
    token = lock.acquire(case.case_id)
    first = payload_for(case, token)
    p = first
    for stage in STAGES:
        p = run(stage, p)
    assert p["halt"]["outcome"] == PROGRESSED
    tasks.advance.apply(args=(p,)).get()  # one step asked: the dispatch ends, released
    assert lock.holder(case.case_id) is None
    late = run("build_context", first)
    assert late["halt"]["outcome"] == "LOCK_LOST"
    assert lock.holder(case.case_id) is None
    tasks.advance.apply(args=(late,)).get()  # its advance touches no lock
    assert lock.holder(case.case_id) is None
    assert lock.acquire(case.case_id)  # the next dispatch is not LOCK_BUSY
    assert effects(case) == one_clean_step(tmp_path)


def test_a_twin_chain_whose_model_call_is_in_flight_goes_on_after_the_other_twin_stops(
    setup: tuple[Case, RedisCaseLock], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two chains of one step with the same token (a whole worker killed before it
    acknowledged ``advance``: its redelivery starts a second chain beside the redelivered
    stage's). Twin A meets B's model call in flight, stops with ``RETRY_PENDING`` /
    ``PROVIDER_CALL_IN_FLIGHT`` and its ``advance`` releases the lock; B must re-take the
    lease at its next renewal and finish the step (decision 136). With a tombstone, B
    stopped with ``LOCK_LOST`` and the case waited for the retry or the recovery sweep
    (CI, 2026-12-05: test_recovery's whole-worker kill before step 2's build_context)."""
    from investigation.constants import RETRY_PENDING
    from investigation.llm.scripted import ScriptedProvider
    from workers.locks import RELEASED_SUFFIX

    case, lock = setup
    token = lock.acquire(case.case_id)
    first = payload_for(case, token)
    inside, go_on = threading.Event(), threading.Event()
    original = ScriptedProvider.send
    paused_thread: list[threading.Thread] = []

    def send(self: ScriptedProvider, request_bytes: bytes, req: Any) -> Any:
        if threading.current_thread() in paused_thread:
            inside.set()
            assert go_on.wait(30)  # B's model call is in flight
        return original(self, request_bytes, req)

    monkeypatch.setattr(ScriptedProvider, "send", send)
    b = run("build_context", first)
    out: dict[str, Any] = {}
    twin_b = threading.Thread(target=lambda: out.update(run("llm_call", b)))
    paused_thread.append(twin_b)
    twin_b.start()
    try:
        assert inside.wait(30)
        a = first
        for stage in STAGES:
            a = run(stage, a)
        assert (a["halt"]["outcome"], a["halt"]["reason"]) == (
            RETRY_PENDING, "PROVIDER_CALL_IN_FLIGHT")
        tasks.advance.apply(args=(a,)).get()
        assert lock.holder(case.case_id) is None
        tombstone = REDIS_LOCK_KEY.format(case_id=case.case_id) + RELEASED_SUFFIX + token
        assert not lock.client.exists(tombstone)  # B may re-take the lease
    finally:
        go_on.set()
        twin_b.join(30)
    b = out
    assert b["halt"] is None
    for stage in STAGES[2:]:
        b = run(stage, b)
    assert b["halt"]["outcome"] == PROGRESSED
    assert lock.holder(case.case_id) == token  # re-taken at B's next renewal
    tasks.advance.apply(args=(b,)).get()  # one step asked: the dispatch ends
    assert lock.holder(case.case_id) is None
    assert lock.client.exists(tombstone)  # a real end leaves its tombstone
    assert effects(case) == one_clean_step(tmp_path)
