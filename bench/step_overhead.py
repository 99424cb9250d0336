#!/usr/bin/env python
"""Per-step orchestration overhead of the engine, with a scripted model of zero latency.

Measures, on this machine:

(a) the embedded runtime: ``workers.runtime.embedded`` + ``workers.embedded.run_case``
    (each step's chain runs in process with ``chain.apply()``), and for reference the bare
    stage code through ``Investigator.step`` (no Celery at all);
(b) the Redis runtime: a real ``celery worker`` process (prefork, ``-c 2``) on the Redis
    broker, cases dispatched with ``workers.tasks.start_dispatch``;
(c) a bare chain of eight trivial Celery tasks plus an advance-like tail
    (``bench/bare_chain.py``) on the same broker with the same Celery settings and worker
    options.

(a) and (b) run fresh cases of the tests' tiny shop case (``tests/casekit.py``: five steps,
three snapshot queries) on SQLite stores; the first ``--warmup-cases`` cases of each
runtime are not counted (process start, snapshot validation, schema checks). Per-step
wall time: (a) between consecutive ``on_step`` outcomes; (b) between consecutive checkpoint
publications (``checkpoint.created_at``; the first step from the ``start_dispatch`` call).
(c) is the wall time from ``apply_async`` to the tail's report, per chain. (b) and (c) run
side by side: both workers are up at once and each counted engine case is followed by its
share of the bare chains, so a machine whose speed drifts during the run (a shared one
does, by a factor of two over minutes) slows both alike.

(d) for reference, LangGraph: eight nodes in a line with ``SqliteSaver`` and
``durability="sync"`` (``bench/langgraph_step.py``, run in the benchmarks' own environment
``.venv-bench``, built by ``make bench-env``; never a dependency of the engine).

Every process measured runs the engine's collector threshold (decision 131): the worker's
through ``preload``, this one from (a)'s ``workers.runtime.embedded`` on (so the bare
``Investigator.step`` too), LangGraph's process by its own setting.

(b) and (c) run in ``--rounds`` rounds (default 3), each of ``--cases`` engine cases beside
``--steps`` bare chains; the Redis ratio is the median of the rounds' ratios, printed with
each round's (a single round moved by 0.1-0.4 between runs on the 2-core machine).

Prints medians and ratios with their targets (issue 13: Redis step / bare chain <= 2.0;
``Investigator.step`` <= 2 x the LangGraph step), the SQL statements and transactions of
one ``Investigator.step``, and the load average beside each figure; asserts nothing. The
Redis database ``--broker-db`` (default 6) is flushed before and after. Usage (from the repository root)::

    .venv/bin/python bench/step_overhead.py [--cases 10] [--steps 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

STEPS_PER_CASE = 5  # tests.casekit.HAPPY_REPLIES
CASE_TIMEOUT_S = 60.0
#: How often the Redis benchmark looks whether a case's lock was released.
POLL_S = 0.05


# -- small helpers ---------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1000:7.2f} ms"


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def describe(values: Sequence[float]) -> str:
    if not values:
        return "no samples"
    return (f"median {ms(statistics.median(values))}  p10 {ms(pct(values, 0.1))}  "
            f"p90 {ms(pct(values, 0.9))}  n={len(values)}")


@dataclass
class Cases:
    """N registered cases (same package, distinct interpretations) in one SQLite store."""

    store: Any
    url: str
    case_ids: list[str]
    providers_path: Path


def prepare_cases(root: Path, n: int, url: str | None = None) -> Cases:
    """Register ``n`` distinct copies of the tiny case (case ids differ by interpretation)
    in the store at ``url`` (default: a SQLite file under ``root``)."""
    from investigation.cases.reader import PackageReader
    from investigation.cases.registry import register_case
    from investigation.config import InvestigationConfig
    from tests.casekit import HYPOTHESES, INTERPRETATION, make_case

    url = url or f"sqlite:///{root / 'store.db'}"
    first = make_case(root / "case", database_url=url)
    data = first.package.read_bytes()
    reader = PackageReader(InvestigationConfig().package)
    ids = [first.case_id] + [
        register_case(first.store, data, {**INTERPRETATION, "bench_case": i}, HYPOTHESES, reader)
        for i in range(1, n)]
    assert len(set(ids)) == n
    return Cases(first.store, url, ids, first.providers_path)


def check_completed(cases: Cases, case_id: str) -> list[datetime]:
    """The case's checkpoint times; exits if the case did not complete as scripted."""
    from sqlmodel import col, select

    from investigation.constants import CASE_BUILDING_DIAGNOSIS
    from investigation.store.models import CaseRecord, Checkpoint

    with cases.store.session() as s:
        case = s.get(CaseRecord, case_id)
        cps = s.exec(select(Checkpoint).where(Checkpoint.case_id == case_id)
                     .order_by(col(Checkpoint.seq))).all()
    if case is None or case.state != CASE_BUILDING_DIAGNOSIS or len(cps) != STEPS_PER_CASE:
        raise SystemExit(f"case {case_id} did not complete: state "
                         f"{case and case.state}, {len(cps)} checkpoints, last outcome "
                         f"{case and case.last_outcome} {case and case.last_reason}")
    return [cp.created_at if cp.created_at.tzinfo else cp.created_at.replace(tzinfo=UTC)
            for cp in cps]


# -- worker processes ------------------------------------------------------------------------


@dataclass
class Worker:
    """A ``celery worker`` subprocess (own process group) logging to a file."""

    app: str
    queue: str
    env: dict[str, str]
    log_path: Path
    concurrency: int
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        cmd = [sys.executable, "-m", "celery", "-A", self.app, "worker", "--pool=prefork",
               "-c", str(self.concurrency), "-Q", self.queue, "--loglevel=INFO",
               "--without-mingle", "--without-gossip", "-n", f"{self.queue}@%h"]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, cwd=REPO, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while " ready." not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"worker {self.app} did not start:\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # stray prefork children, if any

    def task_runtimes(self, prefix: str) -> dict[str, list[float]]:
        """``succeeded in Xs`` per task name (the time inside the task body)."""
        out: dict[str, list[float]] = defaultdict(list)
        pattern = re.compile(rf"Task {re.escape(prefix)}(\w+)\[[0-9a-f-]+\] succeeded in "
                             r"([0-9.e-]+)s")
        for name, secs in pattern.findall(self.log()):
            out[name].append(float(secs))
        return out


@contextlib.contextmanager
def running(worker: Worker) -> Iterator[Worker]:
    try:
        worker.start()
        yield worker
    finally:
        worker.stop()


# -- the measurements ------------------------------------------------------------------------


@dataclass
class Result:
    per_step: list[float] = field(default_factory=list)
    per_case_step: list[float] = field(default_factory=list)
    in_task: dict[str, list[float]] = field(default_factory=dict)
    statements: list[int] = field(default_factory=list)
    transactions: list[int] = field(default_factory=list)


def _redis_case(cases: Cases, case_id: str, worker: Worker) -> list[datetime]:
    """Dispatch one engine case and wait for its lock's release; returns the dispatch
    time and its checkpoint times."""
    from workers import runtime
    from workers.tasks import start_dispatch

    holder: Callable[[str], str | None] = runtime.current().lock.holder  # type: ignore[attr-defined]
    started_wall, started = datetime.now(UTC), time.perf_counter()
    start_dispatch(case_id)
    deadline = started + CASE_TIMEOUT_S
    # Every figure comes from the store's checkpoint times, so the wait for the lock's
    # release polls slowly: a 5 ms poll (200 Redis reads a second from this process) took
    # CPU from the worker it measures on a 2-core machine, which the bare chain's blocking
    # BLPOP does not.
    while holder(case_id) is not None:  # advance releases the lock at the end
        if time.perf_counter() > deadline:
            raise SystemExit(f"case {case_id} still running after {CASE_TIMEOUT_S}s:\n"
                             + worker.log()[-5000:])
        time.sleep(POLL_S)
    return [started_wall, *check_completed(cases, case_id)]


def _bare_chain(client: Any, i: int, worker: Worker) -> float:
    """Run one bare chain; returns its wall time from ``apply_async`` to the tail's report."""
    from bench.bare_chain import DONE_KEY, bare_chain

    token = uuid.uuid4().hex
    started = time.perf_counter()
    bare_chain({"id": token, "case_id": "bench", "step_seq": i}).apply_async()
    popped = client.blpop([DONE_KEY], timeout=30)
    elapsed = time.perf_counter() - started
    done = popped[1] if popped is not None else None
    if (done.decode() if isinstance(done, bytes) else done) != token:
        raise SystemExit(f"bare chain {i} did not finish:\n{worker.log()[-5000:]}")
    return elapsed


def bench_redis_and_bare(cases: Cases, warmup: int, engine_worker: Worker, chains: int,
                         warmup_chains: int, bare_worker: Worker, redis_url: str,
                         rounds: int = 1) -> tuple[Result, Result, list[tuple[float, float]]]:
    """(b) and (c) side by side: both workers run at once, and each counted engine case
    is followed by its share of the bare chains, so that a machine whose speed drifts
    over the minutes of a run (a shared one does) slows both alike.

    The counted cases are split into ``rounds`` equal rounds, each with ``chains`` bare
    chains; returns both results (every sample) and, per round, the medians ``(engine
    step, bare chain)`` in seconds."""
    import redis

    from bench.bare_chain import DONE_KEY
    from workers import runtime

    runtime.configure(None)
    rt = runtime.current()  # distributed, from INVESTIGATE_* set by main()
    client = redis.Redis.from_url(redis_url)
    engine, bare = Result(), Result()
    counted = cases.case_ids[warmup:]
    per_round = max(1, len(counted) // max(1, rounds))
    per_case = max(1, chains // per_round)
    medians: list[tuple[float, float]] = []
    with running(engine_worker), running(bare_worker):
        for case_id in cases.case_ids[:warmup]:
            _redis_case(cases, case_id, engine_worker)
        for i in range(warmup_chains):
            _bare_chain(client, i, bare_worker)
        n = warmup_chains
        for start in range(0, per_round * max(1, rounds), per_round):
            steps: list[float] = []
            chain_times: list[float] = []
            for case_id in counted[start:start + per_round]:
                stamps = _redis_case(cases, case_id, engine_worker)
                steps += [(b - a).total_seconds() for a, b in pairwise(stamps)]
                engine.per_case_step.append((stamps[-1] - stamps[0]).total_seconds()
                                            / STEPS_PER_CASE)
                for _ in range(per_case):
                    chain_times.append(_bare_chain(client, n, bare_worker))
                    n += 1
            engine.per_step += steps
            bare.per_step += chain_times
            medians.append((statistics.median(steps), statistics.median(chain_times)))
    engine.in_task = engine_worker.task_runtimes("investigation.")
    bare.in_task = bare_worker.task_runtimes("bench.")
    client.delete(DONE_KEY)
    client.close()
    rt.env.store.dispose()
    runtime.configure(None)
    return engine, bare, medians


def bench_embedded(cases: Cases, warmup: int, home: Path) -> Result:
    from workers import runtime
    from workers.embedded import run_case
    from workers.settings import Settings

    settings = Settings(home=home, database_url=cases.url)
    rt = runtime.embedded(settings, None, cases.providers_path)
    res = Result()
    for i, case_id in enumerate(cases.case_ids):
        stamps = [time.perf_counter()]

        def mark(_outcome: Any, stamps: list[float] = stamps) -> None:
            stamps.append(time.perf_counter())

        outcome = run_case(rt, case_id, on_step=mark)
        if outcome.outcome != "COMPLETED":
            raise SystemExit(f"embedded case {case_id}: {outcome}")
        check_completed(cases, case_id)
        if i >= warmup:
            res.per_step += [b - a for a, b in pairwise(stamps)]
            res.per_case_step.append((stamps[-1] - stamps[0]) / STEPS_PER_CASE)
    rt.env.store.dispose()
    runtime.configure(None)
    return res


def bench_direct(cases: Cases, warmup: int, home: Path) -> Result:
    from sqlalchemy import event

    from investigation.loop.investigator import Investigator
    from workers.runtime import build_env
    from workers.settings import Settings

    env = build_env(Settings(home=home, database_url=cases.url), None, cases.providers_path)
    investigator = Investigator(env)
    counts = {"statements": 0, "transactions": 0}

    @event.listens_for(env.store.engine, "before_cursor_execute")
    def _statement(*_: Any) -> None:
        counts["statements"] += 1

    @event.listens_for(env.store.engine, "begin")
    def _begin(*_: Any) -> None:
        counts["transactions"] += 1

    res = Result()
    for i, case_id in enumerate(cases.case_ids):
        stamps = [time.perf_counter()]
        for _ in range(STEPS_PER_CASE):
            before = dict(counts)
            investigator.step(case_id)
            stamps.append(time.perf_counter())
            if i >= warmup:
                res.statements.append(counts["statements"] - before["statements"])
                res.transactions.append(counts["transactions"] - before["transactions"])
        check_completed(cases, case_id)
        if i >= warmup:
            res.per_step += [b - a for a, b in pairwise(stamps)]
    env.store.dispose()
    return res


def langgraph_step_ms(python: str, cases: int, warmup: int) -> float | None:
    """Median ms of a LangGraph eight-node step (bench/langgraph_step.py), run in the
    benchmarks' own environment; ``None`` when that environment is missing."""
    import json

    if not Path(python).exists():
        return None
    done = subprocess.run([python, str(REPO / "bench" / "langgraph_step.py"), "--cases",
                           str(cases), "--steps", str(STEPS_PER_CASE), "--warmup-cases",
                           str(warmup)], capture_output=True, text=True, timeout=600,
                          check=True)
    return float(json.loads(done.stdout)["median_ms"])


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f}"


# -- main ------------------------------------------------------------------------------------


def in_task_line(in_task: dict[str, list[float]], names: Sequence[str]) -> tuple[float, str]:
    medians = {n: statistics.median(in_task[n]) for n in names if in_task.get(n)}
    detail = "  ".join(f"{n} {v * 1000:.1f}" for n, v in medians.items())
    return sum(medians.values()), detail


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=10,
                        help="measured cases per engine runtime (5 steps each; default 10)")
    parser.add_argument("--steps", type=int, default=100,
                        help="measured bare chains (one chain = one bare step; default 100)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of (b) beside (c), each of --cases cases and --steps "
                             "chains; the ratio is the median of the rounds' (default 3)")
    parser.add_argument("--warmup-cases", type=int, default=2)
    parser.add_argument("--warmup-chains", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=2, help="worker -c (default 2)")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379",
                        help="Redis server URL without a database number")
    parser.add_argument("--broker-db", type=int, default=6,
                        help="Redis database for broker and locks; FLUSHED (default 6)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--bench-python", default=str(REPO / ".venv-bench" / "bin" / "python"),
                        help="the benchmarks' own environment with LangGraph "
                             "(`make bench-env`); the LangGraph reference is skipped without "
                             "it")
    args = parser.parse_args(argv)
    if args.cases < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--cases, --steps and --rounds must be at least 1")

    work = Path(tempfile.mkdtemp(prefix="step-overhead-"))
    broker_url = f"{args.redis.rstrip('/')}/{args.broker_db}"
    tag = uuid.uuid4().hex[:8]
    engine_queue, bare_queue = f"bench-engine-{tag}", f"bench-bare-{tag}"
    n = args.warmup_cases + args.cases
    n_distributed = args.warmup_cases + args.rounds * args.cases
    print(f"preparing {2 * n + n_distributed} cases under {work} ...", flush=True)
    distributed = prepare_cases(work / "distributed", n_distributed)
    embedded = prepare_cases(work / "embedded", n)
    direct = prepare_cases(work / "direct", n)

    # Settings for this process and both workers; set before anything imports workers.*
    inv_env = {
        "INVESTIGATE_HOME": str(work / "home"),
        "INVESTIGATE_DATABASE_URL": distributed.url,
        "INVESTIGATE_PROVIDERS": str(distributed.providers_path),
        "INVESTIGATE_BROKER_URL": broker_url,
        "INVESTIGATE_QUEUE": engine_queue,
        "BENCH_BARE_QUEUE": bare_queue,
    }
    for name in [k for k in os.environ if k.startswith("INVESTIGATE_")]:
        del os.environ[name]
    os.environ.update(inv_env)
    worker_env = dict(os.environ, PYTHONUNBUFFERED="1")

    import redis

    admin = redis.Redis.from_url(broker_url)
    admin.flushdb()
    try:
        print("(b) Redis runtime and (c) bare chain, side by side ...", flush=True)
        engine_worker = Worker("workers.celery_app", engine_queue, worker_env,
                               work / "engine-worker.log", args.concurrency)
        bare_worker = Worker("bench.bare_chain:app", bare_queue, worker_env,
                             work / "bare-worker.log", args.concurrency)
        redis_res, bare_res, rounds = bench_redis_and_bare(
            distributed, args.warmup_cases, engine_worker, args.steps, args.warmup_chains,
            bare_worker, broker_url, args.rounds)
        load_redis = load_average()
        print("(a) embedded runtime ...", flush=True)
        emb_res = bench_embedded(embedded, args.warmup_cases, work / "embedded" / "home")
        load_embedded = load_average()
        direct_res = bench_direct(direct, args.warmup_cases, work / "direct" / "home")
        langgraph_ms = langgraph_step_ms(args.bench_python, args.cases, args.warmup_cases)
        load_direct = load_average()
    finally:
        admin.flushdb()
        admin.close()
        for cases in (distributed, embedded, direct):
            cases.store.dispose()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    from investigation.constants import STAGES

    eng_task, eng_detail = in_task_line(redis_res.in_task, [*STAGES, "advance"])
    bare_task, _ = in_task_line(bare_res.in_task, [*(f"stage{i}" for i in range(1, 9)),
                                                   "tail"])
    redis_step = statistics.median(redis_res.per_step)
    bare_step = statistics.median(bare_res.per_step)
    round_ratios = [engine / bare for engine, bare in rounds]
    ratio = statistics.median(round_ratios)
    emb_step = statistics.median(emb_res.per_step)
    direct_step = statistics.median(direct_res.per_step)

    print()
    print(f"step orchestration overhead; scripted model (zero latency); SQLite stores; "
          f"broker {broker_url}; worker --pool=prefork -c {args.concurrency}")
    print(f"engine: {args.cases} cases x {STEPS_PER_CASE} steps per runtime "
          f"(+{args.warmup_cases} warm-up cases), (b) in {args.rounds} rounds of that beside "
          f"(c) {args.steps} bare chains each (+{args.warmup_chains} warm-up)")
    print()
    print("(a) embedded runtime, wall per step (run_case, chain.apply in process)")
    print(f"      {describe(emb_res.per_step)}")
    print("    same stages without Celery (Investigator.step), wall per step")
    print(f"      {describe(direct_res.per_step)}")
    print("(b) Redis runtime, real worker, wall per published step")
    print(f"      {describe(redis_res.per_step)}")
    print(f"      per case (dispatch to the last checkpoint) / {STEPS_PER_CASE}: "
          f"{describe(redis_res.per_case_step)}")
    print(f"      in-task time, sum of per-task medians: {ms(eng_task)}  "
          f"(ms: {eng_detail})")
    print("(c) bare chain, 8 trivial tasks + tail, wall per chain")
    print(f"      {describe(bare_res.per_step)}")
    print(f"      in-task time, sum of per-task medians: {ms(bare_task)}")
    print("(b) / (c), round by round (medians)")
    for i, ((engine, bare), r) in enumerate(zip(rounds, round_ratios, strict=True), 1):
        print(f"      round {i}: engine step {ms(engine)}  bare chain {ms(bare)}  {r:.2f}x")
    print()
    print("(d) LangGraph, eight nodes in a line, SqliteSaver, durability=\"sync\" "
          "(bench/langgraph_step.py in .venv-bench), wall per step")
    print(f"      {ms(langgraph_ms / 1000) if langgraph_ms else 'not measured: make bench-env'}")
    print(f"    SQL per Investigator.step: median {statistics.median(direct_res.statements):.0f} "
          f"statements, {statistics.median(direct_res.transactions):.0f} transactions")
    print()
    print("ratios (medians), with their targets (issue 13)")
    spread = f"rounds {min(round_ratios):.2f}-{max(round_ratios):.2f}, " \
        if len(round_ratios) > 1 else ""
    print(f"    Redis engine step / bare chain      {ratio:6.2f}x  "
          f"(target <= 2.0, then 1.3; median of {len(round_ratios)} round(s), {spread}"
          f"engine adds {ms(redis_step - bare_step).strip()} per step)   [{load_redis}]")
    if langgraph_ms:
        print(f"    Investigator.step / LangGraph step  "
              f"{direct_step * 1000 / langgraph_ms:6.2f}x  (target <= 2.0)   [{load_direct}]")
    print(f"    Redis engine step / embedded step   {redis_step / emb_step:6.2f}x")
    print(f"    embedded step / Investigator.step   {emb_step / direct_step:6.2f}x   "
          f"[{load_embedded}]")


if __name__ == "__main__":
    main()
