#!/usr/bin/env python
"""The cost of bounded SQLite work: a fork per call against the persistent isolated
server (decision 94, ``investigation/tools/isolation.py``).

What it does, on this machine:

1. grows the process to a realistic size: imports the engine and runs ``--cases`` cases
   of the tests' tiny shop case to completion with ``Investigator.step`` (five steps
   each, one of them a ``db.query``; ``bench/step_overhead.py``'s ``prepare_cases``) on a
   SQLite store, as the CLI or a prefork worker child does before its next step;
2. on that case's opened database, times ``--rounds`` calls of each kind, in alternating
   blocks of :data:`BLOCK` (after a fork the parent's next writes take copy-on-write
   faults that a server call does not otherwise pay):

   * **fork per call**: ``run_isolated`` with the database's ``_query`` of ``SELECT 1``
     and its probe, under the database lock (what ``ReadOnlyDatabase._bounded`` did
     before decision 94);
   * **server**: ``ReadOnlyDatabase.query("SELECT 1")`` through its running server;
   * **after a kill**: the same query right after the server was stopped (the request
     forks a fresh server, waits for its handshake, then asks), and the caller's cost
     of the stop itself (a kill; the reaping happens later, without waiting);

3. runs ``--step-cases`` fresh cases through ``Investigator.step`` twice each way,
   alternating, with ``ReadOnlyDatabase._bounded`` on the fork-per-call path and on the
   server, and compares the wall time of the ``db.query`` steps (the other steps, which
   run no SQL on the snapshot, for reference). Cases of one package share their router,
   so a ``db.query`` step here makes one bounded call (its preflight verdict is cached
   after the first case);
4. reads the memory a live server costs (``/proc/<pid>/smaps_rollup``: its ``Pss`` and
   ``Private_Dirty``) when fresh and after the parent's next full collection: a server
   keeps the old copy of every page its parent rewrites after the fork (a collection
   writes the header of every object it walks);
5. prints the medians (p10, p90), the ratio fork / server, the process size and the load
   average before and after. The machine is shared: run it a few times and compare
   medians.

Prints figures; asserts nothing. Usage (from the repository root)::

    .venv/bin/python bench/isolation.py [--cases 3] [--rounds 300] [--step-cases 20]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.step_overhead import (  # noqa: E402
    STEPS_PER_CASE,
    bench_direct,
    describe,
    prepare_cases,
)

#: Calls per block of one kind (see ``bounded_calls``).
BLOCK = 25
#: The ``db.query`` step of the tiny case (``tests.casekit.HAPPY_REPLIES``), 0-based.
QUERY_STEP = 1


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def vm_mib() -> str:
    fields = {}
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            fields[key] = value.split()[0] if value.split() else "0"
    return (f"VmSize {int(fields['VmSize']) >> 10} MiB, "
            f"VmRSS {int(fields['VmRSS']) >> 10} MiB")


def server_memory(pid: int) -> str:
    """``Pss`` and ``Private_Dirty`` of process ``pid`` in MiB."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("Pss", "Private_Dirty"):
                fields[key] = int(value.split()[0]) >> 10
    return f"Pss {fields['Pss']} MiB, Private_Dirty {fields['Private_Dirty']} MiB"


def grown_database(root: Path, cases: int) -> Any:
    """A realistic process: the engine imported and ``cases`` cases run through
    ``Investigator.step``; returns the cases' opened database."""
    from investigation.loop.investigator import Investigator
    from workers.runtime import build_env
    from workers.settings import Settings

    prepared = prepare_cases(root, cases)
    env = build_env(Settings(home=root / "home", database_url=prepared.url), None,
                    prepared.providers_path)
    investigator = Investigator(env)
    for case_id in prepared.case_ids:
        for _ in range(STEPS_PER_CASE):
            investigator.step(case_id)
    return env.router(prepared.case_ids[0])._first_db()


@contextmanager
def fork_per_call() -> Iterator[None]:
    """``ReadOnlyDatabase._bounded`` as it was before decision 94: one fork per call."""
    from investigation.tools.isolation import run_isolated
    from investigation.tools.sqlite import ReadOnlyDatabase

    def bounded(self: Any, method: Callable[..., Any], args: tuple[Any, ...],
                timeout_s: float, memory_bytes: int, isolate: bool) -> Any:
        with self._lock:
            if not isolate:
                return method(*args)
            return run_isolated(lambda: method(*args), timeout_s=timeout_s,
                                memory_bytes=memory_bytes, what="the statement",
                                probe=self._probe)

    server_bounded = ReadOnlyDatabase._bounded
    ReadOnlyDatabase._bounded = bounded  # type: ignore[method-assign]
    try:
        yield
    finally:
        ReadOnlyDatabase._bounded = server_bounded  # type: ignore[method-assign]


def bounded_calls(db: Any, rounds: int) -> dict[str, list[float]]:
    from investigation.tools.isolation import run_isolated

    def forked() -> None:
        with db._lock:
            run_isolated(lambda: db._query("SELECT 1", [], 1, 2.0), timeout_s=3.0,
                         memory_bytes=256 << 20, what="the statement", probe=db._probe)

    def served() -> None:
        db.query("SELECT 1", [], 1, 2.0)

    samples: dict[str, list[float]] = {"fork": [], "server": [], "after_kill": [],
                                       "stop": []}

    def timed(name: str, fn: Callable[[], None]) -> None:
        started = time.perf_counter()
        fn()
        samples[name].append(time.perf_counter() - started)

    served()  # the first server
    for _ in range(max(1, rounds // BLOCK)):
        for name, fn in (("fork", forked), ("server", served)):
            fn()  # not counted: the first call after the other kind
            for _ in range(BLOCK):
                timed(name, fn)
        for _ in range(BLOCK // 5):
            timed("stop", db._server.stop)
            timed("after_kill", served)
    return samples


def step_times(root: Path, cases: int) -> dict[str, list[float]]:
    """Wall time of the ``db.query`` steps and of the others, each way."""
    times: dict[str, list[float]] = {f"{way} {kind}": [] for way in ("fork", "server")
                                     for kind in ("query", "other")}
    for repeat in range(2):
        for way in ("fork", "server"):
            home = root / f"{way}-{repeat}"
            prepared = prepare_cases(home, cases)
            if way == "fork":
                with fork_per_call():
                    result = bench_direct(prepared, 1, home / "home")
            else:
                result = bench_direct(prepared, 1, home / "home")
            prepared.store.dispose()
            for i, seconds in enumerate(result.per_step):
                kind = "query" if i % STEPS_PER_CASE == QUERY_STEP else "other"
                times[f"{way} {kind}"].append(seconds)
    return times


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--step-cases", type=int, default=20)
    args = parser.parse_args(argv)

    print(f"load average before: {load_average()}")
    with tempfile.TemporaryDirectory(prefix="bench-isolation-") as tmp:
        db = grown_database(Path(tmp) / "grow", args.cases)
        size = vm_mib()
        samples = bounded_calls(db, args.rounds)
        db._server.stop()
        db.query("SELECT 1", [], 1, 2.0)
        fresh = server_memory(db._server.pid)
        gc.collect()
        collected = server_memory(db._server.pid)
        db.close()
        steps = step_times(Path(tmp), args.step_cases) if args.step_cases else {}
    print(f"load average after:  {load_average()}")

    fork, server = statistics.median(samples["fork"]), statistics.median(samples["server"])
    print(f"one bounded SELECT 1 (db.query's path), wall per call, in a process of {size} "
          f"(after {args.cases} cases x {STEPS_PER_CASE} steps):")
    print(f"  fork per call (run_isolated)   {describe(samples['fork'])}")
    print(f"  persistent server              {describe(samples['server'])}")
    print(f"  first request after a kill     {describe(samples['after_kill'])}")
    print(f"  the kill itself (stop())       {describe(samples['stop'])}")
    print(f"  fork / server                  {fork / server:7.1f}x")
    print(f"  after a kill / fork per call   "
          f"{statistics.median(samples['after_kill']) / fork:7.2f}x")
    print(f"memory of one live server: fresh {fresh}; after a full collection in the "
          f"parent {collected}")
    if steps:
        print(f"Investigator.step, {args.step_cases} cases x 2 each way (first case not "
              "counted):")
        for name, values in steps.items():
            print(f"  {name + ' steps':22}         {describe(values)}")
        saved = (statistics.median(steps["fork query"])
                 - statistics.median(steps["server query"]))
        print(f"  db.query step, fork - server   {saved * 1000:7.2f} ms")


if __name__ == "__main__":
    main()
