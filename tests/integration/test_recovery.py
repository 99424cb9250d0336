"""Celery under failure, with real Redis and real prefork worker processes.

* A whole worker (main process and pool children) is killed with SIGKILL at stage
  boundaries and inside stages, before and after the stage's external effect; after a
  restart the case completes with the checkpoint hashes, ``summary.md`` bytes, evidence
  and ledger of an uninterrupted in-process run.
* A visibility timeout shorter than a stage's work delivers the stage twice: effects once.
* Redis restarted empty mid-run (the test's broker database flushed while the worker is
  down: queued and unacknowledged messages and locks are lost): the periodic recovery
  sweep brings every case to completion.
* A stage that keeps killing its pool child is parked ``BLOCKED/STAGE_POISONED``, shown by
  ``status`` and resumable.

Kill points (documented in docs/operations.md): by default four trials per run, one per kind of
point: a stage start (``before``), a stage end after its marker committed but before the
ack (``after``), inside a stage before its external effect (``pre_effect``) and after it
(``post_effect``). Which step and stage each trial hits is drawn from
``TEST_CRASH_SEED`` (default below; the choice is printed), over steps 1-5 for the
boundaries and the query steps 1-3 with ``llm_call``/``execute_tool`` for the effects.
``TEST_CRASH_MATRIX=full`` runs all 20 points (every stage's start and end, both
effects before and after).

Worker settings: visibility timeout 4 s, restore scan every 1 s, so a killed worker's
stage comes back within about 5 s of its delivery once a worker runs again.

The broker is the database of ``TEST_REDIS_URL`` (flushed before and after each test);
every test uses its own queue name.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlmodel import col, select

from investigation.constants import (
    BLOCK_STAGE_POISONED,
    CASE_BLOCKED,
    CASE_BUILDING_DIAGNOSIS,
    COMPLETED,
    STAGES,
)
from investigation.llm.types import PROVIDER_INTERRUPTED
from investigation.loop.checkpoints import verify_chain
from investigation.operations import resume, status, summary_bytes
from investigation.store import Store
from investigation.store.models import (
    Checkpoint,
    Evidence,
    LedgerEntry,
    LLMAttempt,
    LLMOperation,
    Plan,
    StageDelivery,
    StageRun,
)
from tests.casekit import INTERPRETATION, Case, make_case
from tests.integration.test_celery_worker import Worker, point_app_at

pytestmark = [pytest.mark.redis, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("TEST_CRASH_SEED", "20261130"))
HAPPY_STEPS = 5
QUERY_STEPS = (1, 2, 3)
VISIBILITY_S = 4
RESTORE_S = 1
CASE_TIMEOUT_S = 60.0


def _kill_points(seed: int) -> dict[str, str]:
    """One kill point per kind, drawn from ``seed``."""
    rnd = random.Random(seed)
    return {
        "before": f"{rnd.randint(1, HAPPY_STEPS)}:{rnd.choice(STAGES)}:before",
        "after": f"{rnd.randint(1, HAPPY_STEPS)}:{rnd.choice(STAGES)}:after",
        "pre_effect": f"{rnd.choice(QUERY_STEPS)}:"
                      f"{rnd.choice(('llm_call', 'execute_tool'))}:pre_effect",
        "post_effect": f"{rnd.choice(QUERY_STEPS)}:"
                       f"{rnd.choice(('llm_call', 'execute_tool'))}:post_effect",
    }


def _full_matrix(seed: int) -> dict[str, str]:
    """Every stage boundary (before and after each of the eight stages) and the middle
    of both external effects (before and after), the step of each drawn from ``seed``."""
    rnd = random.Random(seed)
    points = {f"{stage}:{phase}": f"{rnd.randint(1, HAPPY_STEPS)}:{stage}:{phase}"
              for stage in STAGES for phase in ("before", "after")}
    for stage in ("llm_call", "execute_tool"):
        for phase in ("pre_effect", "post_effect"):
            points[f"{stage}:{phase}"] = f"{rnd.choice(QUERY_STEPS)}:{stage}:{phase}"
    return points


#: ``TEST_CRASH_MATRIX=full`` runs every kill point (20 trials, about 3 minutes); the
#: default draws one per kind to keep CI short. Vary ``TEST_CRASH_SEED`` for more trials.
KILL_POINTS = _full_matrix(SEED) if os.environ.get("TEST_CRASH_MATRIX") == "full" \
    else _kill_points(SEED)


# -- fingerprints of a run -------------------------------------------------------------------


@dataclass(frozen=True)
class Fingerprint:
    """What must be identical between an interrupted and an uninterrupted run."""

    checkpoint_hashes: tuple[str, ...]
    summary: bytes
    evidence: tuple[tuple[str, int, int], ...]
    ledger: tuple[tuple[int, int, str, int], ...]
    plans: tuple[tuple[int, int, str], ...]


def fingerprint(store: Store, case_id: str) -> Fingerprint:
    with store.session() as s:
        hashes = s.exec(select(Checkpoint.hash).where(Checkpoint.case_id == case_id)
                        .order_by(col(Checkpoint.seq))).all()
        evidence = s.exec(select(Evidence).where(Evidence.case_id == case_id)
                          .order_by(col(Evidence.step_seq))).all()
        ledger = s.exec(select(LedgerEntry).where(LedgerEntry.case_id == case_id)
                        .order_by(col(LedgerEntry.step_seq), col(LedgerEntry.hypothesis_id),
                                  col(LedgerEntry.kind))).all()
        plans = s.exec(select(Plan).where(Plan.case_id == case_id)
                       .order_by(col(Plan.step_seq))).all()
    return Fingerprint(
        tuple(hashes), summary_bytes(store, case_id),
        tuple((e.evidence_id, e.step_seq, e.hypothesis_id) for e in evidence),
        tuple((r.step_seq, r.hypothesis_id, r.kind, r.amount_units) for r in ledger),
        tuple((p.step_seq, p.hypothesis_id, p.action) for p in plans))


_REFERENCE: dict[str, Fingerprint] = {}
#: A row of the summary's model usage table: hypothesis, calls, attempts, the rest.
_USAGE_ROW = re.compile(rb"(?m)^\| (\d+|unrecorded) \| \d+ \| (\d+) \|")


def attempts_listed(summary: bytes) -> dict[str, int]:
    """The model requests the summary's usage table counts, by hypothesis."""
    return {m.group(1).decode(): int(m.group(2)) for m in _USAGE_ROW.finditer(summary)}


#: An Interruptions section that lists only calls answered after a request a killed worker
#: left unanswered (summary.md, decision 177).
_INTERRUPTED_ONLY = re.compile(
    rb"## Interruptions\n\n(?:- Step \d+ \(hypothesis \d+\): the model call was answered "
    rb"after \d+ failed attempts? \(PROVIDER_INTERRUPTED\)\n)+\n")


def without_attempts(summary: bytes) -> bytes:
    """The summary with its usage table's attempts column blanked, and without an
    Interruptions section that lists only calls answered after an interrupted request
    (a request out when the worker was killed: their number is checked apart, with
    :func:`interrupted_attempts`)."""
    summary = _INTERRUPTED_ONLY.sub(b"", summary)
    return _USAGE_ROW.sub(lambda m: m.group(0)[:m.start(2) - m.start(0)] + b"- |", summary)


def summary_diff(expected: bytes, got: bytes) -> str:
    """A unified diff of two summaries, for an assertion's message."""
    return "\n".join(difflib.unified_diff(
        expected.decode().splitlines(), got.decode().splitlines(), "reference", "this run",
        lineterm=""))


def interrupted_attempts(store: Store, case_id: str, before: datetime) -> dict[str, int]:
    """The case's model requests that a dead worker left unanswered, by hypothesis: the
    gateway marks such an attempt ``failed``/``PROVIDER_INTERRUPTED`` at its next call.
    Each must have started ``before`` (UTC; the kill): the scripted provider fails no
    request, and a live request is never declared interrupted."""
    with store.session() as s:
        failed = s.exec(select(LLMAttempt, LLMOperation.hypothesis_id).join(
            LLMOperation, col(LLMOperation.id) == col(LLMAttempt.operation_id)).where(
            LLMOperation.case_id == case_id, LLMAttempt.status != "succeeded")).all()
    out: dict[str, int] = {}
    for attempt, hid in failed:
        assert (attempt.status, attempt.error_code) == ("failed", PROVIDER_INTERRUPTED), \
            attempt
        started = attempt.started_at.replace(tzinfo=attempt.started_at.tzinfo or UTC)
        assert started < before, (attempt, before)
        key = "unrecorded" if hid is None else str(hid)
        out[key] = out.get(key, 0) + 1
    return out


def reference(tmp_root: Path, interpretation: dict[str, Any] | None = None) -> Fingerprint:
    """The uninterrupted in-process run of the same case (cached per interpretation)."""
    key = repr(sorted((interpretation or INTERPRETATION).items()))
    if key not in _REFERENCE:
        case = make_case(tmp_root / f"ref-{uuid.uuid4().hex[:8]}", interpretation=interpretation)
        inv = case.investigator()
        for _ in range(HAPPY_STEPS + 1):
            if inv.step(case.case_id).outcome == COMPLETED:
                break
        _REFERENCE[key] = fingerprint(case.store, case.case_id)
        case.store.dispose()
    return _REFERENCE[key]


def assert_effects_once(store: Store, case_id: str) -> None:
    """One evidence record per query plan, one reserve per query plan, one marker per
    stage, an intact checkpoint chain."""
    with store.session() as s:
        assert verify_chain(s, case_id) == HAPPY_STEPS
        plans = s.exec(select(Plan).where(Plan.case_id == case_id)).all()
        evidence = s.exec(select(Evidence).where(Evidence.case_id == case_id)).all()
        reserves = s.exec(select(LedgerEntry).where(LedgerEntry.case_id == case_id,
                                                    LedgerEntry.kind == "reserve")).all()
        markers = s.exec(select(StageRun.step_seq, StageRun.stage)
                         .where(StageRun.case_id == case_id)).all()
    queries = sorted((p.step_seq, p.hypothesis_id) for p in plans if p.action == "query")
    assert sorted((e.step_seq, e.hypothesis_id) for e in evidence) == queries
    assert sorted((r.step_seq, r.hypothesis_id) for r in reserves) == queries
    assert sorted(markers) == sorted((q, st) for q in range(1, HAPPY_STEPS + 1)
                                     for st in STAGES)


# -- harness --------------------------------------------------------------------------------


@dataclass
class Cluster:
    """A store with registered cases, a broker database, a queue and one worker."""

    tmp: Path
    store_url: str
    broker_url: str
    queue: str
    env: dict[str, str]
    redis: redis.Redis
    cases: list[Case] = field(default_factory=list)
    worker: Worker | None = None
    runs: int = 0

    def start_worker(self, extra: dict[str, str] | None = None, beat: bool = False) -> Worker:
        self.runs += 1
        cmd = [sys.executable, "-m", "celery", "-A", "tests.integration.crashworker",
               "worker", "--pool=prefork", "-c", "2", "-Q", self.queue, "--loglevel=INFO",
               "--without-mingle", "--without-gossip", "-n", f"{self.queue}-{self.runs}@%h"]
        if beat:
            cmd += ["-B", f"--schedule={self.tmp / 'beat-schedule'}"]
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("INVESTIGATE_", "TEST_CRASH_"))}
        env.update(self.env, PYTHONUNBUFFERED="1", **(extra or {}))
        self.worker = Worker(cmd, env, self.tmp / f"worker-{self.runs}.log")
        self.worker.start()
        self.worker.wait_ready()
        return self.worker

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace")
                       for p in sorted(self.tmp.glob("worker-*.log")))

    @contextlib.contextmanager
    def dump_on_failure(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            print("----- worker logs -----")
            print(self.logs()[-20000:])
            raise

    def wait_dead(self, timeout_s: float = 10.0) -> None:
        assert self.worker is not None and self.worker.proc is not None
        self.worker.proc.wait(timeout=timeout_s)

    def wait_for(self, case: Case, state: str, timeout_s: float = CASE_TIMEOUT_S
                 ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        info = status(case.store, case.case_id)
        while info["state"] != state:
            assert time.monotonic() < deadline, (
                f"{case.case_id} still {info['state']} (steps {info['steps']}, last "
                f"{info['last_outcome']} {info['last_reason']}) after {timeout_s}s")
            time.sleep(0.1)
            info = status(case.store, case.case_id)
        return info

    def wait_steps(self, case: Case, steps: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while status(case.store, case.case_id)["steps"] < steps:
            assert time.monotonic() < deadline, f"{case.case_id} below {steps} steps"
            time.sleep(0.05)

    def wait_unlocked(self, case: Case, timeout_s: float = 20.0) -> None:
        key = f"investigation:lock:{case.case_id}"
        deadline = time.monotonic() + timeout_s
        while self.redis.exists(key):
            assert time.monotonic() < deadline, "the case lock was never released"
            time.sleep(0.1)


@pytest.fixture
def cluster(tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
            ) -> Iterator[Cluster]:
    from workers import runtime
    from workers.settings import Settings

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    queue = f"test-recover-{uuid.uuid4().hex[:12]}"
    first = make_case(tmp_path / "case", database_url=store_url)
    env = {
        "INVESTIGATE_HOME": str(tmp_path / "home"),
        "INVESTIGATE_DATABASE_URL": store_url,
        "INVESTIGATE_PROVIDERS": str(first.providers_path),
        "INVESTIGATE_BROKER_URL": redis_url,
        "INVESTIGATE_QUEUE": queue,
        "INVESTIGATE_VISIBILITY_TIMEOUT_S": str(VISIBILITY_S),
        "INVESTIGATE_MAX_COUNTDOWN_S": str(VISIBILITY_S - 1),
        "INVESTIGATE_RESTORE_INTERVAL_S": str(RESTORE_S),
        "INVESTIGATE_SWEEP_INTERVAL_S": "2",
        "INVESTIGATE_MAX_STAGE_DELIVERIES": "2",
    }
    for name in list(os.environ):
        if name.startswith("INVESTIGATE_") and name not in env:
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    undo_app = point_app_at(Settings())
    runtime.configure(None)
    rt = runtime.current()
    c = Cluster(tmp_path, store_url, redis_url, queue, env, client, [first])
    try:
        yield c
    finally:
        if c.worker is not None:
            c.worker.stop()
        runtime.configure(None)
        rt.env.store.dispose()
        undo_app()
        for case in c.cases:
            case.store.dispose()
        client.flushdb()
        client.close()


# -- whole worker killed --------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KILL_POINTS))
def test_whole_worker_killed_then_restarted_completes_identically(
        cluster: Cluster, kind: str) -> None:
    from workers.tasks import start_dispatch

    point = KILL_POINTS[kind]
    print(f"TEST_CRASH_SEED={SEED}: {kind} -> {point}")
    case = cluster.cases[0]
    expected = reference(cluster.tmp)
    # A whole worker killed right after a step's ``advance`` returned may not have
    # acknowledged it: its redelivery starts a second chain of the next step, whose first
    # delivery counts beside the redelivered stage's (the lost delivery, the redelivery,
    # the duplicate: 3) when it comes before that stage's marker. Nothing here is
    # poisoned, so the limit admits the three (the poisoned-stage test keeps 2).
    limit = {"INVESTIGATE_MAX_STAGE_DELIVERIES": "3"}
    with cluster.dump_on_failure():
        worker = cluster.start_worker({"TEST_CRASH_POINT": point, "TEST_CRASH_MODE": "worker",
                                       "TEST_CRASH_ONCE": str(cluster.tmp / "fired"),
                                       **limit})
        start_dispatch(case.case_id)
        cluster.wait_dead(timeout_s=30)
        killed_at = time.monotonic()
        assert (cluster.tmp / "fired").exists(), "the kill point never fired"
        assert f"CRASHPOINT {point}" in worker.log()
        # No dispatch, no sweep: the stage the dead worker had not acknowledged comes back
        # by itself from the broker, within the visibility timeout plus one restore scan.
        cluster.start_worker({"TEST_CRASH_POINT": point, "TEST_CRASH_MODE": "worker",
                              "TEST_CRASH_ONCE": str(cluster.tmp / "fired"), **limit})
        cluster.wait_for(case, CASE_BUILDING_DIAGNOSIS)
        cluster.wait_unlocked(case)
        print(f"{kind}: completed {time.monotonic() - killed_at:.1f}s after the kill")
        assert_effects_once(case.store, case.case_id)
        assert fingerprint(case.store, case.case_id) == expected


# -- double delivery --------------------------------------------------------------------------


def test_visibility_timeout_shorter_than_a_stage_delivers_twice_effects_once(
        cluster: Cluster) -> None:
    from workers.tasks import start_dispatch

    case = cluster.cases[0]
    expected = reference(cluster.tmp)
    point = "2:execute_tool:pre_effect"
    with cluster.dump_on_failure():
        worker = cluster.start_worker({
            "TEST_CRASH_POINT": point, "TEST_CRASH_MODE": f"sleep:{VISIBILITY_S + 3}",
            "TEST_CRASH_ONCE": str(cluster.tmp / "slow")})
        start_dispatch(case.case_id)
        cluster.wait_for(case, CASE_BUILDING_DIAGNOSIS)
        cluster.wait_unlocked(case)
        # The slow delivery must have finished too (it then found the stage recorded).
        deadline = time.monotonic() + 20
        ids = re.findall(r"Task investigation\.execute_tool\[([0-9a-f-]+)\] succeeded",
                         worker.log())
        while len(ids) == len(set(ids)) and time.monotonic() < deadline:
            time.sleep(0.2)
            ids = re.findall(r"Task investigation\.execute_tool\[([0-9a-f-]+)\] succeeded",
                             worker.log())
        assert f"CRASHPOINT {point}" in worker.log()
        assert len(ids) > len(set(ids)), "the slow stage was not delivered twice"
        time.sleep(1.0)  # let the duplicate chain run out
        assert_effects_once(case.store, case.case_id)
        assert fingerprint(case.store, case.case_id) == expected
        with case.store.session() as s:
            row = s.exec(select(StageDelivery).where(
                StageDelivery.case_id == case.case_id, StageDelivery.step_seq == 2,
                StageDelivery.stage == "execute_tool")).one()
        assert row.deliveries >= 2


# -- Redis restarted empty ------------------------------------------------------------------


def test_redis_lost_mid_run_the_periodic_sweep_completes_every_case(cluster: Cluster) -> None:
    from workers.tasks import start_dispatch

    interpretations: list[dict[str, Any] | None] = [None]
    for i in (2, 3):
        interp = {"summary": f"{INTERPRETATION['summary']} (copy {i})"}
        interpretations.append(interp)
        cluster.cases.append(make_case(cluster.tmp / f"case{i}", database_url=cluster.store_url,
                                       interpretation=interp))
    assert len({c.case_id for c in cluster.cases}) == 3
    with cluster.dump_on_failure():
        cluster.start_worker({"TEST_CRASH_POINT": "2:persist_plan:after",
                              "TEST_CRASH_MODE": "worker",
                              "TEST_CRASH_ONCE": str(cluster.tmp / "fired")})
        for case in cluster.cases:
            start_dispatch(case.case_id)
        cluster.wait_dead(timeout_s=30)
        killed_at = datetime.now(UTC)
        # Redis restarted empty: queued and unacknowledged messages and locks are gone.
        cluster.redis.flushdb()
        before = {c.case_id: status(c.store, c.case_id) for c in cluster.cases}
        assert all(i["state"] == "INVESTIGATING" for i in before.values())
        lost_at = time.monotonic()
        cluster.start_worker(beat=True)
        for case in cluster.cases:
            cluster.wait_for(case, CASE_BUILDING_DIAGNOSIS)
        print(f"all cases completed {time.monotonic() - lost_at:.1f}s after the loss")
        for case, given in zip(cluster.cases, interpretations, strict=True):
            cluster.wait_unlocked(case)
            assert_effects_once(case.store, case.case_id)
            got, expected = fingerprint(case.store, case.case_id), reference(cluster.tmp, given)
            # The worker died while the other cases ran on beside the one it was killed in:
            # a model request of theirs that was out at that moment stays recorded as an
            # attempt (seed 000: every request is persisted before it is sent) and the
            # re-run sends it again, so the summary's usage table counts one attempt more
            # for that hypothesis (test_interrupts shows it deterministically).
            interrupted = interrupted_attempts(case.store, case.case_id, killed_at)
            print(f"{case.case_id}: model requests interrupted by the kill: {interrupted}")
            assert sum(interrupted.values()) <= 1, interrupted
            reference_attempts = attempts_listed(expected.summary)
            assert attempts_listed(got.summary) == {
                hid: n + interrupted.get(hid, 0) for hid, n in reference_attempts.items()
            }, summary_diff(expected.summary, got.summary)
            assert without_attempts(got.summary) == without_attempts(expected.summary), \
                summary_diff(expected.summary, got.summary)
            assert replace(got, summary=b"") == replace(expected, summary=b"")
        assert "investigation.recover" in cluster.logs()


def test_recover_cli_dispatches_pending_cases_only(cluster: Cluster) -> None:
    from datetime import UTC, datetime, timedelta

    from investigation.store.models import CaseRecord

    blocked = make_case(cluster.tmp / "blocked", database_url=cluster.store_url,
                        interpretation={"summary": "blocked copy"})
    waiting = make_case(cluster.tmp / "waiting", database_url=cluster.store_url,
                        interpretation={"summary": "backoff copy"})
    cluster.cases += [blocked, waiting]
    with blocked.store.session() as s:
        row = s.get(CaseRecord, blocked.case_id)
        assert row is not None
        row.state, row.blocked_reason = CASE_BLOCKED, "INVALID_LLM_RESPONSES"
        s.add(row)
        row = s.get(CaseRecord, waiting.case_id)
        assert row is not None
        row.retry_not_before = datetime.now(UTC) + timedelta(hours=2)
        s.add(row)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEST_CRASH_")}
    cmd = [sys.executable, "-c", "from workers.cli import main; main()", "recover"]
    first = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    pending = cluster.cases[0].case_id
    assert f"dispatched {pending}" in first.stdout
    assert blocked.case_id not in first.stdout and waiting.case_id not in first.stdout
    assert "1 waiting for a provider backoff" in first.stdout
    assert cluster.redis.llen(cluster.queue) == 1  # the first stage of the pending case
    second = subprocess.run([*cmd, "--json"], env=env, cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert second.returncode == 0, second.stderr
    assert f'"busy": [\n    "{pending}"' in second.stdout  # its dispatch holds the lock
    lease = json.loads(second.stdout)["busy_lease_s"][pending]  # what is left of it
    assert 0 < lease <= int(os.environ.get("INVESTIGATE_LOCK_TTL_S", "300"))
    assert cluster.redis.llen(cluster.queue) == 1  # nothing enqueued twice
    # Who holds it and since when (a fleet trial could not tell a live holder from a
    # dead one): the first `recover`, a process of this host, which no ping can ask.
    report = json.loads(second.stdout)
    assert report["busy_holder"][pending].startswith(socket.gethostname() + " pid ")
    assert 0 <= report["busy_renewed_s_ago"][pending] < 60
    assert report["busy_holder_silent"] == []
    # A worker node that does not answer ping is said to be silent.
    from investigation.constants import REDIS_LOCK_KEY
    from workers.locks import HOLDER_SUFFIX

    cluster.redis.set(REDIS_LOCK_KEY.format(case_id=pending) + HOLDER_SUFFIX,
                      "gone@nowhere pid 1", px=100_000)
    third = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                           timeout=60)
    assert third.returncode == 0, third.stderr
    line = next(x for x in third.stdout.splitlines() if x.startswith(f"busy {pending}"))
    assert "held by gone@nowhere pid 1, renewed" in line and \
        "its worker does not answer ping" in line, third.stdout
    # A holder key of another type (set by hand) names nobody and stops nothing (a
    # hostile trial's list stopped the sweep for every case with "cannot be reached").
    holder_key = REDIS_LOCK_KEY.format(case_id=pending) + HOLDER_SUFFIX
    cluster.redis.delete(holder_key)
    cluster.redis.rpush(holder_key, "x")
    fourth = subprocess.run([*cmd, "--json"], env=env, cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert fourth.returncode == 0, fourth.stderr
    report = json.loads(fourth.stdout)
    assert report["busy"] == [pending] and pending not in report["busy_holder"], report
    assert report["busy_orphaned"] == []  # its first stage waits in the queue
    cluster.redis.delete(holder_key)
    # The next message went with a worker that died (a fleet trial: the lease named the
    # live worker that renewed it last): no live worker has a task of the case and the
    # queue is empty.
    cluster.redis.delete(cluster.queue)
    fifth = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                           timeout=60)
    assert fifth.returncode == 0, fifth.stderr
    line = next(x for x in fifth.stdout.splitlines() if x.startswith(f"busy {pending}"))
    assert "no live worker has a task of it and the queue is empty" in line, fifth.stdout
    assert f"dispatch {pending} --take-over" in line


def test_recover_does_not_call_a_case_orphaned_while_a_live_worker_runs_its_stage(
        cluster: Cluster) -> None:
    """The other side of ``busy_orphaned``: a stage running in a live worker (a slow
    query) with the queue empty is busy and held, not orphaned, and nothing is dispatched
    or delivered twice, though the shell's visibility timeout is shorter than the
    worker's; the case then completes as an uninterrupted run does."""
    from workers.tasks import start_dispatch

    case = cluster.cases[0]
    expected = reference(cluster.tmp)
    point = "2:execute_tool:pre_effect"
    started = cluster.tmp / "slow-started"
    with cluster.dump_on_failure():
        worker = cluster.start_worker({
            # Long enough for `recover` (a new process, inspect and ping) to run inside
            # it with the suite's other process busy too: 8 s was not, once (it took
            # longer and the step was published when status was read).
            "TEST_CRASH_POINT": point, "TEST_CRASH_MODE": "sleep:20",
            "TEST_CRASH_ONCE": str(started),
            # The slow stage is delivered once: no restore while it sleeps.
            "INVESTIGATE_VISIBILITY_TIMEOUT_S": "30", "INVESTIGATE_MAX_COUNTDOWN_S": "29"})
        start_dispatch(case.case_id)
        deadline = time.monotonic() + 30
        while f"CRASHPOINT {point}" not in worker.log():
            assert time.monotonic() < deadline, "the slow stage never started"
            time.sleep(0.1)
        assert cluster.redis.llen(cluster.queue) == 0  # its next message is the worker's
        # This shell's visibility timeout (the cluster's 4 s) is shorter than the
        # worker's and than the sleeping stage: its `inspect` and `ping` drain replies,
        # and kombu restored the worker's message from such a client (decision 183):
        # the copy ran step 2 on the other pool process while the first slept.
        env = {k: v for k, v in os.environ.items() if not k.startswith("TEST_CRASH_")}
        assert env["INVESTIGATE_VISIBILITY_TIMEOUT_S"] == str(VISIBILITY_S)
        cmd = [sys.executable, "-c", "from workers.cli import main; main()", "recover"]
        got = subprocess.run([*cmd, "--json"], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=60)
        assert got.returncode == 0, got.stderr
        report = json.loads(got.stdout)
        assert report["busy"] == [case.case_id], report
        assert report["dispatched"] == [], report
        assert report["busy_orphaned"] == [], report  # a live worker has its task
        assert report["busy_holder_silent"] == [], report  # and answers ping
        holder = report["busy_holder"][case.case_id]
        assert holder.startswith(f"{cluster.queue}-1@"), holder  # the running worker
        assert status(case.store, case.case_id)["steps"] == 1  # still inside step 2
        cluster.wait_for(case, CASE_BUILDING_DIAGNOSIS)
        cluster.wait_unlocked(case)
        assert_effects_once(case.store, case.case_id)
        assert fingerprint(case.store, case.case_id) == expected
        # One delivery of the slow stage: nobody restored it while it ran.
        ids = re.findall(r"Task investigation\.execute_tool\[([0-9a-f-]+)\] received",
                         worker.log())
        assert len(ids) == len(set(ids)), worker.log()[-3000:]


# -- poisoned stage -------------------------------------------------------------------------


def test_a_stage_that_keeps_killing_its_worker_is_parked_and_resumable(
        cluster: Cluster) -> None:
    from workers.tasks import start_dispatch

    case = cluster.cases[0]
    expected = reference(cluster.tmp)
    enabled = cluster.tmp / "crash-enabled"
    enabled.touch()
    with cluster.dump_on_failure():
        # Each killed child's message must come back once, through the worker's
        # reject-on-worker-lost, for the count to be the crashes'. With the cluster's 4 s
        # visibility timeout a loaded machine (the child's stage slow to reach the crash
        # point, the loss noticed late) also had the broker restore it: two copies at
        # once, the second counting the first as a delivery that never returned, and the
        # case parked after one crash. 20 s is far beyond that.
        worker = cluster.start_worker({"TEST_CRASH_POINT": "2:execute_tool:pre_effect",
                                       "TEST_CRASH_MODE": "child",
                                       "TEST_CRASH_ENABLED": str(enabled),
                                       "INVESTIGATE_VISIBILITY_TIMEOUT_S": "20",
                                       "INVESTIGATE_MAX_COUNTDOWN_S": "19"})
        start_dispatch(case.case_id)
        info = cluster.wait_for(case, CASE_BLOCKED)
        assert info["blocked_reason"] == BLOCK_STAGE_POISONED
        assert "stage execute_tool of step 2" in info["blocked_detail"]
        assert worker.log().count("CRASHPOINT 2:execute_tool:pre_effect") == 2  # the limit
        cluster.wait_unlocked(case)
        with case.store.session() as s:
            evidence = s.exec(select(Evidence).where(Evidence.case_id == case.case_id)).all()
        assert [e.step_seq for e in evidence] == [1]  # step 2's query never ran
        enabled.unlink()  # the operator fixed the cause
        resume(case.store, case.case_id)
        # A killed child's delivery that the broker restores late, after its chain
        # released the lock, stops at its released lease's tombstone (decision 135): the
        # lock is free for this dispatch at once.
        start_dispatch(case.case_id)
        cluster.wait_for(case, CASE_BUILDING_DIAGNOSIS)
        cluster.wait_unlocked(case)
        assert_effects_once(case.store, case.case_id)
        assert fingerprint(case.store, case.case_id) == expected
