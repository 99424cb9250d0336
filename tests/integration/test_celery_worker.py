"""A real Celery worker process (prefork, Redis broker) runs a tiny case to the end.

The test process is the producer: it registers the case in a SQLite store, points the
module-level Celery app and the process runtime at the same broker, queue and store as
the worker, calls ``workers.tasks.start_dispatch`` and polls the store.

The broker is a dedicated Redis database (``TEST_CELERY_BROKER_DB``, default 5) that is
flushed before and after each test; every test uses its own queue name.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlmodel import col, select

from investigation.constants import CASE_BUILDING_DIAGNOSIS, POINTER_SUMMARY, STAGES
from investigation.errors import LockBusy
from investigation.loop.checkpoints import verify_chain
from investigation.operations import status, summary_bytes
from investigation.store.models import Checkpoint, Evidence, LedgerEntry, Plan, StageRun
from tests.casekit import Case, make_case
from tests.conftest import redis_db, with_db

pytestmark = [pytest.mark.redis, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BROKER_DB = redis_db(int(os.environ.get("TEST_CELERY_BROKER_DB", "5")))
CASE_TIMEOUT_S = 60.0
HAPPY_STEPS = 5  # tests.casekit.HAPPY_REPLIES: 3 queries, a finish, a reject
HAPPY_QUERY_STEPS = [1, 2, 3]

#: The Celery settings a producer must share with the worker (all derived from Settings).
def point_app_at(settings: Any) -> Callable[[], None]:
    """Point the tasks' Celery app at ``settings``; returns the undo (back to the
    environment's settings). ``workers.celery_app.configure`` is the supported way for a
    producer whose process imported the app before its environment was set."""
    from workers.celery_app import configure
    from workers.settings import Settings

    configure(settings)
    return lambda: configure(Settings())


@dataclass
class Worker:
    """A ``celery worker`` subprocess and its log file."""

    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=REPO, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while " ready." not in self.log():
            assert self.proc is not None and self.proc.poll() is None, \
                f"worker exited with {self.proc and self.proc.returncode}"
            assert time.monotonic() < deadline, "worker not ready in time"
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM (warm shutdown), then SIGKILL the worker's process group."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        # Prefork children of a worker that died hard: they share its process group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


@dataclass
class Harness:
    """One registered case, its store, a broker database, a queue and a worker."""

    case: Case
    queue: str
    broker_url: str
    worker: Worker
    redis: redis.Redis
    lock_holder: Callable[[str], str | None]

    @contextlib.contextmanager
    def dump_on_failure(self) -> Iterator[None]:
        """On any failure print the worker log (pytest shows it with the failure)."""
        try:
            yield
        except BaseException:
            print(f"----- worker log ({self.worker.log_path}) -----")
            print(self.worker.log())
            raise

    def wait_for_state(self, state: str, timeout_s: float = CASE_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        info = status(self.case.store, self.case.case_id)
        while info["state"] != state:
            proc = self.worker.proc
            assert proc is None or proc.poll() is None, \
                f"worker exited with {proc.returncode} while the case was {info['state']}"
            assert time.monotonic() < deadline, (
                f"case still {info['state']} (steps {info['steps']}, last "
                f"{info['last_outcome']} {info['last_reason']}) after {timeout_s}s")
            time.sleep(0.1)
            info = status(self.case.store, self.case.case_id)
        return info

    def wait_unlocked(self, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.lock_holder(self.case.case_id) is not None:
            assert time.monotonic() < deadline, "the dispatch never released the case lock"
            time.sleep(0.05)

    def task_received(self, name: str) -> int:
        """How many ``investigation.<name>`` task messages the worker received."""
        return len(re.findall(rf"Task investigation\.{name}\[[0-9a-f-]+\] received",
                              self.worker.log()))


def _broker_url(redis_url: str) -> str:
    return with_db(redis_url, BROKER_DB)


@contextlib.contextmanager
def running_harness(tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch,
                    replies: list[dict[str, Any]] | None = None,
                    extra_env: dict[str, str] | None = None) -> Iterator[Harness]:
    """A registered case (``replies``, default the happy path), the producer pointed at a
    fresh broker database and queue, and a (not yet started) prefork worker sharing the
    ``INVESTIGATE_*`` environment plus ``extra_env``."""
    from workers import runtime
    from workers.settings import Settings

    broker_url = _broker_url(redis_url)
    client = redis.Redis.from_url(broker_url)
    client.flushdb()
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    case = make_case(tmp_path / "case", database_url=store_url, replies=replies)
    queue = f"test-cases-{uuid.uuid4().hex[:12]}"
    inv_env = {
        "INVESTIGATE_HOME": str(tmp_path / "home"),
        "INVESTIGATE_DATABASE_URL": store_url,
        "INVESTIGATE_PROVIDERS": str(case.providers_path),
        "INVESTIGATE_BROKER_URL": broker_url,
        "INVESTIGATE_QUEUE": queue,
        **(extra_env or {}),
    }
    for name in list(os.environ):
        if name.startswith("INVESTIGATE_") and name not in inv_env:
            monkeypatch.delenv(name)
    for name, value in inv_env.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.queue == queue and settings.broker_url == broker_url

    worker_env = {k: v for k, v in os.environ.items() if not k.startswith("INVESTIGATE_")}
    worker_env.update(inv_env, PYTHONUNBUFFERED="1")
    worker = Worker(
        [sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker",
         "--pool=prefork", "-c", "2", "-Q", queue, "--loglevel=INFO",
         "--without-mingle", "--without-gossip", "-n", f"{queue}@%h"],
        worker_env, tmp_path / "worker.log")

    undo_app = point_app_at(settings)
    runtime.configure(None)  # the producer's runtime: built from the environment above
    rt = runtime.current()
    assert rt.mode == "distributed"
    holder = rt.lock.holder  # type: ignore[attr-defined]  # RedisCaseLock in this runtime
    h = Harness(case, queue, broker_url, worker, client, holder)
    try:
        yield h
    finally:
        worker.stop()
        if h.worker is not worker:  # a test started its own worker in the harness's place
            h.worker.stop()
        runtime.configure(None)
        rt.env.store.dispose()
        undo_app()
        case.store.dispose()
        client.flushdb()
        client.close()


@pytest.fixture
def harness(tmp_path: Path, redis_url: str,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    with running_harness(tmp_path, redis_url, monkeypatch) as h:
        yield h


def _assert_completed_case(h: Harness, info: dict[str, Any]) -> None:
    case_id, store = h.case.case_id, h.case.store
    assert info["state"] == CASE_BUILDING_DIAGNOSIS
    assert info["last_outcome"] == "COMPLETED"
    assert info["steps"] == HAPPY_STEPS
    assert POINTER_SUMMARY in info["pointers"]
    summary = summary_bytes(store, case_id)
    assert summary.strip(), "summary.md is empty"
    with store.session() as s:
        assert verify_chain(s, case_id) == HAPPY_STEPS
        seqs = s.exec(select(Checkpoint.seq).where(Checkpoint.case_id == case_id)
                      .order_by(col(Checkpoint.seq))).all()
        plans = s.exec(select(Plan).where(Plan.case_id == case_id)
                       .order_by(col(Plan.step_seq))).all()
        evidence = s.exec(select(Evidence).where(Evidence.case_id == case_id)
                          .order_by(col(Evidence.step_seq))).all()
        reserves = s.exec(select(LedgerEntry).where(LedgerEntry.case_id == case_id,
                                                    LedgerEntry.kind == "reserve")
                          .order_by(col(LedgerEntry.step_seq))).all()
        stage_runs = s.exec(select(StageRun).where(StageRun.case_id == case_id)).all()
    assert list(seqs) == list(range(1, HAPPY_STEPS + 1))
    assert [p.step_seq for p in plans] == list(range(1, HAPPY_STEPS + 1))
    query_steps = [p.step_seq for p in plans if p.action == "query"]
    assert query_steps == HAPPY_QUERY_STEPS
    # One evidence record per query plan, bound to the same step and hypothesis.
    assert [(e.step_seq, e.hypothesis_id) for e in evidence] == \
        [(p.step_seq, p.hypothesis_id) for p in plans if p.action == "query"]
    assert [e.evidence_id for e in evidence] == [f"E{i}" for i in range(1, len(evidence) + 1)]
    assert info["evidence_count"] == len(query_steps)
    # One reserve ledger row per query plan, for the plan's hypothesis.
    assert [(r.step_seq, r.hypothesis_id) for r in reserves] == \
        [(p.step_seq, p.hypothesis_id) for p in plans if p.action == "query"]
    assert all(r.amount_units < 0 for r in reserves)
    # Every stage ran exactly once per step (idempotency markers).
    markers = sorted((r.step_seq, r.stage) for r in stage_runs)
    assert markers == sorted((seq, st) for seq in range(1, HAPPY_STEPS + 1) for st in STAGES)


def test_worker_runs_a_case_to_building_diagnosis(harness: Harness) -> None:
    from workers.tasks import start_dispatch

    h = harness
    with h.dump_on_failure():
        h.worker.start()
        token = start_dispatch(h.case.case_id)
        assert h.lock_holder(h.case.case_id) == token
        info = h.wait_for_state(CASE_BUILDING_DIAGNOSIS)
        h.wait_unlocked()
        _assert_completed_case(h, info)
        # 5 steps within one dispatch (default max_steps_per_dispatch is 8): no yield.
        assert h.task_received("dispatch") == 0
        assert h.task_received("advance") == HAPPY_STEPS


def test_duplicate_dispatch_while_locked_raises_lock_busy(harness: Harness) -> None:
    from workers.tasks import start_dispatch

    h = harness
    with h.dump_on_failure():
        # No worker yet: the first dispatch's chain waits on the queue, holding the lock.
        token = start_dispatch(h.case.case_id)
        assert h.lock_holder(h.case.case_id) == token
        started = time.monotonic()
        with pytest.raises(LockBusy):
            start_dispatch(h.case.case_id)
        assert time.monotonic() - started < 2.0  # refused at once, never blocking
        assert h.lock_holder(h.case.case_id) == token  # the loser did not touch the lock
        assert h.redis.llen(h.queue) == 1  # only the first dispatch enqueued a step

        h.worker.start()
        info = h.wait_for_state(CASE_BUILDING_DIAGNOSIS)
        h.wait_unlocked()
        _assert_completed_case(h, info)
        # A dispatch of a finished case takes and returns the lock, enqueueing nothing.
        start_dispatch(h.case.case_id)
        assert h.lock_holder(h.case.case_id) is None
        assert h.redis.llen(h.queue) == 0


def test_max_steps_dispatch_yields_reenqueues_and_completes(harness: Harness) -> None:
    from workers.tasks import start_dispatch

    h = harness
    with h.dump_on_failure():
        h.worker.start()
        h.worker.wait_ready()
        start_dispatch(h.case.case_id, max_steps=2)
        info = h.wait_for_state(CASE_BUILDING_DIAGNOSIS)
        h.wait_unlocked()
        _assert_completed_case(h, info)
        # Steps 2 and 4 used up their dispatch: advance released the lock and re-enqueued a
        # dispatch task with the same limit, behind other cases; step 5 then completed.
        assert h.task_received("dispatch") == 2
        assert h.task_received("advance") == HAPPY_STEPS
        log = h.worker.log()
        assert log.index("step 2: PROGRESSED") < log.index("Task investigation.dispatch[")
        assert log.index("Task investigation.dispatch[") < log.index("step 3: PROGRESSED")
        second = log.index("Task investigation.dispatch[", log.index("step 3: PROGRESSED"))
        assert log.index("step 4: PROGRESSED") < second < log.index("step 5: COMPLETED")


def test_a_step_a_worker_stops_with_a_controlled_error_is_shown_on_the_case(
        harness: Harness) -> None:
    """A worker's stage that stops a step with a controlled error (here the replay of a
    case whose state pointer was deleted: CHECKPOINT_INVALID) records it as the case's
    last outcome, so `status` names the step, the code and what to do; before, the case
    showed its previous outcome and only the worker log had the error, while the sweep
    dispatched it again and again. Once the cause is gone, the next dispatch goes on and
    the step's outcome replaces the error."""
    from sqlalchemy import delete
    from typer.testing import CliRunner

    from investigation.store.models import CaseRecord, ManifestPointer
    from workers.cli import app
    from workers.tasks import start_dispatch

    h = harness
    case_id, store = h.case.case_id, h.case.store
    for _ in range(2):
        h.case.investigator().step(case_id)
    with store.session() as s:
        pointers = [ManifestPointer(**p.model_dump(exclude={"id"})) for p in s.exec(
            select(ManifestPointer).where(ManifestPointer.case_id == case_id)).all()]
        s.execute(delete(ManifestPointer).where(col(ManifestPointer.case_id) == case_id))

    def row() -> CaseRecord:
        with store.session() as s:
            case = s.get(CaseRecord, case_id)
            assert case is not None
            s.expunge(case)
            return case

    with h.dump_on_failure():
        h.worker.start()
        start_dispatch(case_id)
        deadline = time.monotonic() + CASE_TIMEOUT_S
        while row().last_outcome != "ERROR":
            assert time.monotonic() < deadline, "the error never reached the case row"
            time.sleep(0.1)
        h.wait_unlocked()
        case = row()
        assert (case.state, case.head_seq, case.last_reason) == \
            ("INVESTIGATING", 2, "CHECKPOINT_INVALID")
        assert f"case {case_id} step 3 build_context failed: CHECKPOINT_INVALID" \
            in h.worker.log()
        res = CliRunner().invoke(app, ["status", case_id])
        assert res.exit_code == 0, res.output
        flat = " ".join(res.output.split())
        assert "last outcome ERROR (CHECKPOINT_INVALID)" in flat
        assert "Step 3 failed on a worker with CHECKPOINT_INVALID" in flat
        assert f"investigate verify {case_id}" in flat
        listed = CliRunner().invoke(app, ["cases"])
        assert listed.exit_code == 0, listed.output
        assert "ERROR (CHECKPOINT_INVALID)" in " ".join(listed.output.split())
        assert f"next for {case_id}: investigate verify {case_id}" in listed.output

        with store.session() as s:  # the cause removed
            s.add_all(pointers)
        start_dispatch(case_id)
        info = h.wait_for_state(CASE_BUILDING_DIAGNOSIS)
        h.wait_unlocked()
        _assert_completed_case(h, info)


def test_a_worker_logs_a_block_as_a_warning_with_the_providers_message(
        tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The block is the step's outcome: `advance` logs it as a WARNING with the code and
    message (the gateway's own line is INFO; on an embedded run it repeated the block)."""
    from tests.casekit import HAPPY_REPLIES
    from workers.tasks import start_dispatch

    with running_harness(tmp_path, redis_url, monkeypatch,
                         replies=HAPPY_REPLIES[:2]) as h, h.dump_on_failure():
        h.worker.start()
        start_dispatch(h.case.case_id)
        info = h.wait_for_state("BLOCKED")
        h.wait_unlocked()
        assert info["blocked_reason"] == "PROVIDER_CONFIGURATION"
        warning = re.search(rf"WARNING workers\.tasks .*case {h.case.case_id} step 3: "
                            r"BLOCKED PROVIDER_CONFIGURATION: PROVIDER_SCRIPT_EXHAUSTED \S",
                            h.worker.log())
        assert warning, h.worker.log()[-3000:]


def test_a_worker_that_cannot_build_its_runtime_releases_the_case_lock(
        tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker process whose policy file is broken (started around `investigate worker`,
    which refuses it) failed every stage it took before anything released the case's
    lock, so the case waited the whole lease (300 s) and then came back to it (a fleet
    trial). The lock is now released at once; a healthy worker then finishes the case."""
    from dataclasses import replace

    from workers.tasks import start_dispatch

    broken = tmp_path / "broken.toml"
    broken.write_text("[budget.costs]\n\"db.query\" = 0\n")
    with running_harness(tmp_path, redis_url, monkeypatch) as h, h.dump_on_failure():
        healthy = h.worker
        h.worker = replace(healthy, env={**healthy.env, "INVESTIGATE_CONFIG": str(broken)},
                           log_path=tmp_path / "broken-worker.log")
        h.worker.start()
        h.worker.wait_ready()
        start_dispatch(h.case.case_id)
        h.wait_unlocked(timeout_s=20)
        assert "cannot build its runtime; the case's lock was released" in h.worker.log()
        assert "CONFIG_INVALID" in h.worker.log()
        assert status(h.case.store, h.case.case_id)["steps"] == 0
        h.worker.stop()
        h.worker = healthy
        healthy.start()
        start_dispatch(h.case.case_id)
        info = h.wait_for_state(CASE_BUILDING_DIAGNOSIS)
        h.wait_unlocked()
        _assert_completed_case(h, info)
