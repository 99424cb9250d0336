#!/usr/bin/env python
"""Throughput of one worker under many cases at once (issue 13, target 4).

One ``celery worker`` (prefork, two processes) on the Redis broker; ``--cases`` (default
100) fresh copies of the tests' tiny case (``tests/casekit.py``: five steps, three
snapshot queries, a scripted model of zero latency) are dispatched at once with
``workers.tasks.start_dispatch``; an engine run's figure is published steps per second
from the first dispatch to the last case's completion. Beside it, the same number of bare
chains (eight trivial tasks and a tail, ``bench/bare_chain.py``) enqueued at once on a
worker with the same options and Celery settings: chains per second, each the median of
``--bare-batches`` (default 3) runs of that many chains (one run lasts a few seconds: a
hiccup of the machine moved a single one by half).

Side by side, in ``--rounds`` (default 3) rounds, the stores taking turns within each
round (SQLite 1, PostgreSQL 1, SQLite 2, ...): bare chains run before the first engine
run and after every engine run, so each engine run lies between two of them, and a
round's ratio is the mean of the bare chains right before and right after its engine
run over the engine's steps per second (a shared machine's speed drifts by up to a
factor of two over minutes, which moves both alike). The figure is the median of the
rounds' ratios; every round is
printed. Target: bare chains per second / engine steps per second <= 2.5, on a SQLite
store and on PostgreSQL (a fresh schema of ``--postgres`` per round, dropped afterwards;
``--no-postgres`` skips it).

Beside each run, where its CPU went (Linux, from ``/proc``): CPU milliseconds per engine
step or bare chain spent by the worker's pool children, by its main process, by the
PostgreSQL server (all its processes; engine runs on PostgreSQL only) and by Redis, and
what the machine's cores offered per step in that time (cores x wall time / steps): the
gap between the two is time every process spent waiting.

Prints figures and ratios with the load average; asserts nothing. The Redis database
``--broker-db`` is flushed before and after. Usage (repository root)::

    .venv/bin/python bench/throughput.py [--cases 100] [--rounds 3] [--broker-db 6]
        [--bare-batches 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.step_overhead import STEPS_PER_CASE, Worker, prepare_cases, running  # noqa: E402

TIMEOUT_S = 900.0
POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f}"


#: The groups :func:`cpu_seconds` reports, in the order printed.
CPU_GROUPS = ("worker children", "worker main", "PostgreSQL", "Redis")
#: The same without PostgreSQL (a run that does not use it).
CPU_GROUPS_NO_POSTGRES = tuple(g for g in CPU_GROUPS if g != "PostgreSQL")


def cpu_seconds(worker_pid: int) -> dict[str, float] | None:
    """CPU seconds (user + system) used so far by the processes of each of
    :data:`CPU_GROUPS` (the worker's main process ``worker_pid``, its children, every
    ``postgres`` and ``redis-server`` process); ``None`` without Linux's ``/proc``. A
    process that ends between two readings takes its time with it: read both while the
    worker runs."""
    proc = Path("/proc")
    if not (proc / str(worker_pid) / "stat").exists():
        return None
    tick = os.sysconf("SC_CLK_TCK")
    used = dict.fromkeys(CPU_GROUPS, 0.0)
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        name, _, rest = stat.partition("(")[2].rpartition(")")
        fields = rest.split()
        parent, seconds = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick
        if int(entry.name) == worker_pid:
            group = "worker main"
        elif parent == worker_pid:
            group = "worker children"
        elif name.startswith("postgres"):
            group = "PostgreSQL"
        elif name.startswith("redis-server"):
            group = "Redis"
        else:
            continue
        used[group] += seconds
    return used


def cpu_line(start: dict[str, float] | None, end: dict[str, float] | None, wall_s: float,
             units: int, unit: str, groups: Sequence[str] = CPU_GROUPS) -> str:
    """``CPU ms per <unit>: ...`` between two :func:`cpu_seconds` readings, and what the
    machine's cores offered per unit in ``wall_s`` seconds."""
    if start is None or end is None or units <= 0:
        return f"CPU ms per {unit}: not measured (no /proc)"
    spent = "  ".join(f"{g} {(end[g] - start[g]) * 1000 / units:.1f}" for g in groups)
    cores = os.cpu_count() or 1
    return (f"CPU ms per {unit}: {spent}; {cores} cores offered "
            f"{cores * wall_s * 1000 / units:.1f}")


def engine_rate(url: str, root: Path, n: int, broker_url: str, queue: str,
                concurrency: int) -> tuple[float, str, str]:
    """Engine steps per second for ``n`` cases dispatched at once on store ``url``, the
    load average, and where the CPU went (:func:`cpu_line`)."""
    from sqlmodel import col, func, select

    from investigation.constants import CASE_BUILDING_DIAGNOSIS
    from investigation.store.models import CaseRecord
    from workers import runtime
    from workers.tasks import start_dispatch

    cases = prepare_cases(root, n, url)
    env = {"INVESTIGATE_HOME": str(root / "home"), "INVESTIGATE_DATABASE_URL": cases.url,
           "INVESTIGATE_PROVIDERS": str(cases.providers_path),
           "INVESTIGATE_BROKER_URL": broker_url, "INVESTIGATE_QUEUE": queue}
    for name in [k for k in os.environ if k.startswith("INVESTIGATE_")]:
        del os.environ[name]
    os.environ.update(env)
    runtime.configure(None)
    rt = runtime.current()
    worker = Worker("workers.celery_app", queue, dict(os.environ, PYTHONUNBUFFERED="1"),
                    root / "engine-worker.log", concurrency)
    with running(worker):
        assert worker.proc is not None
        cpu_start = cpu_seconds(worker.proc.pid)
        started = time.perf_counter()
        for case_id in cases.case_ids:
            start_dispatch(case_id)
        deadline = started + TIMEOUT_S
        while True:
            with cases.store.session() as s:
                done = s.exec(select(func.count()).select_from(CaseRecord).where(
                    col(CaseRecord.state) == CASE_BUILDING_DIAGNOSIS)).one()
            if done == n:
                break
            if time.perf_counter() > deadline:
                raise SystemExit(f"{done}/{n} cases done after {TIMEOUT_S}s:\n"
                                 + worker.log()[-4000:])
            time.sleep(0.05)
        elapsed = time.perf_counter() - started
        cpu_end = cpu_seconds(worker.proc.pid)  # before the children exit
    rt.env.store.dispose()
    cases.store.dispose()
    runtime.configure(None)
    groups = CPU_GROUPS if url.startswith("postgresql") else CPU_GROUPS_NO_POSTGRES
    return n * STEPS_PER_CASE / elapsed, load_average(), cpu_line(
        cpu_start, cpu_end, elapsed, n * STEPS_PER_CASE, "step", groups)


def bare_rate(n: int, root: Path, broker_url: str, queue: str,
              concurrency: int, batches: int = 3) -> tuple[float, str, list[float], str]:
    """Bare chains per second for ``n`` chains enqueued at once: the median of ``batches``
    such runs on one worker (a single run of 100 chains lasts a few seconds, short
    enough for a shared machine's hiccup to move it by half), with each run's rate and
    where the CPU of all the runs went (:func:`cpu_line`)."""
    import redis

    os.environ["INVESTIGATE_BROKER_URL"] = broker_url
    os.environ["BENCH_BARE_QUEUE"] = queue
    from bench.bare_chain import DONE_KEY, bare_chain

    client = redis.Redis.from_url(broker_url)
    worker = Worker("bench.bare_chain:app", queue, dict(os.environ, PYTHONUNBUFFERED="1"),
                    root / "bare-worker.log", concurrency)
    rates: list[float] = []
    with running(worker):
        for i in range(10):  # warm-up
            bare_chain({"id": f"w{i}", "case_id": "bench", "step_seq": i}).apply_async()
        for _ in range(10):
            client.blpop([DONE_KEY], timeout=60)
        assert worker.proc is not None
        cpu_start, wall = cpu_seconds(worker.proc.pid), 0.0
        for _ in range(batches):
            started = time.perf_counter()
            for i in range(n):
                bare_chain({"id": uuid.uuid4().hex, "case_id": "bench",
                            "step_seq": i}).apply_async()
            for _ in range(n):
                if client.blpop([DONE_KEY], timeout=120) is None:
                    raise SystemExit("bare chains did not finish:\n" + worker.log()[-4000:])
            rates.append(n / (time.perf_counter() - started))
            wall += time.perf_counter() - started
        cpu_end = cpu_seconds(worker.proc.pid)
    client.close()
    return statistics.median(rates), load_average(), rates, cpu_line(
        cpu_start, cpu_end, wall, n * batches, "chain", CPU_GROUPS_NO_POSTGRES)


def postgres_schema(base: str) -> tuple[str, Any]:
    import sqlalchemy

    schema = "bench_" + uuid.uuid4().hex[:10]
    admin = sqlalchemy.create_engine(base)
    with admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {schema}")

    def drop() -> None:
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
        admin.dispose()

    return f"{base}?options=-csearch_path%3D{schema}", drop


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=positive, default=100)
    parser.add_argument("--concurrency", type=positive, default=2)
    parser.add_argument("--rounds", type=positive, default=3,
                        help="engine runs per store, each between two bare-chain runs; the "
                             "figure is the median of their ratios (default 3)")
    parser.add_argument("--bare-batches", type=positive, default=3,
                        help="runs of --cases bare chains before and after each engine run; "
                             "their median is the reference (default 3)")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379")
    parser.add_argument("--broker-db", type=int, default=6,
                        help="Redis database for broker and locks; FLUSHED (default 6)")
    parser.add_argument("--postgres", default=POSTGRES)
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args(argv)
    import redis

    broker_url = f"{args.redis.rstrip('/')}/{args.broker_db}"
    admin = redis.Redis.from_url(broker_url)
    admin.flushdb()
    work = Path(tempfile.mkdtemp(prefix="throughput-"))
    tag = uuid.uuid4().hex[:8]
    figures: dict[str, float] = {}
    lines: list[str] = []
    summary: list[str] = []
    try:
        names = ["SQLite"] if args.no_postgres else ["SQLite", "PostgreSQL"]

        def fresh_store(name: str, i: int) -> tuple[str, Any]:
            """Round ``i``'s empty store: its URL and what drops it (``None``: a file)."""
            if name == "SQLite":
                return f"sqlite:///{work / f'sqlite-{i}' / 'store.db'}", None
            return postgres_schema(args.postgres)

        bare_rates: list[tuple[float, str, list[float], str]] = []

        def bare() -> tuple[float, str, list[float], str]:
            print(f"bare chains: {args.cases} at once, {args.bare_batches} times ...",
                  flush=True)
            measured = bare_rate(args.cases, work, broker_url, f"bench-bare-{tag}",
                                 args.concurrency, args.bare_batches)
            bare_rates.append(measured)
            return measured

        # Bare chains before the first engine run and after every one: each engine run
        # is compared with the bare chains right before and right after it. The stores
        # take turns round by round (SQLite 1, PostgreSQL 1, SQLite 2, ...): a machine
        # whose speed drifts over the run (bare chains 30 to 44 per second from the first
        # run to the last, 2026-12-07) moves both stores' ratios alike, where all SQLite
        # rounds first and all PostgreSQL rounds last gave the drift to one store.
        before = bare()
        ratios: dict[str, list[float]] = {name: [] for name in names}
        rows: dict[str, list[str]] = {name: [] for name in names}
        for i in range(1, args.rounds + 1):
            for name in names:
                url, drop = fresh_store(name, i)
                print(f"engine on {name}, round {i}: {args.cases} cases at once ...",
                      flush=True)
                try:
                    rate, load, cpu = engine_rate(
                        url, work / f"{name.lower()}-{i}", args.cases, broker_url,
                        f"bench-engine-{name.lower()}-{tag}", args.concurrency)
                finally:
                    if drop is not None:
                        drop()
                admin.flushdb()
                after = bare()
                ratio = (before[0] + after[0]) / 2 / rate
                ratios[name].append(ratio)
                rows[name].append(
                    f"    engine steps/s on {name:10s} round {i}  {rate:7.1f}   bare "
                    f"chains/s before and after {before[0]:.1f} and {after[0]:.1f}; "
                    f"mean / engine steps/s {ratio:5.2f}x   [{load}]")
                rows[name].append(f"        {cpu}")
                before = after
        for name in names:
            lines.extend(rows[name])
            median = figures[f"ratio_{name.lower()}"] = statistics.median(ratios[name])
            summary.append(f"    bare chains/s / engine steps/s, {name:10s}  "
                           f"{median:5.2f}x   (median of "
                           f"{', '.join(f'{r:.2f}x' for r in ratios[name])})   "
                           f"(target <= 2.5)")
    finally:
        admin.flushdb()
        admin.close()
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(f"throughput: one worker --pool=prefork -c {args.concurrency}, {args.cases} tiny "
          f"cases ({STEPS_PER_CASE} steps each) or bare chains at once; broker {broker_url}")
    for rate, load, rates, cpu in bare_rates:
        print(f"    bare chains/s            {rate:7.1f}   (median of "
              f"{', '.join(f'{r:.1f}' for r in rates)})   [{load}]")
        print(f"        {cpu}")
    for line in lines:
        print(line)
    for line in summary:
        print(line)
    return figures


if __name__ == "__main__":
    main()
