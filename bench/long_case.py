#!/usr/bin/env python
"""One long case: does a step cost the same at step 500 as at step 5? (issue 13, target 1).

A synthetic case (40 generated source modules, a small database, a log) with three
hypotheses is investigated for ``--steps`` (default 500) steps through
``Investigator.step`` (the stage code without Celery) on a fresh store (SQLite by default,
``--database-url`` for PostgreSQL). The policy raises the limits that would otherwise end
the case early (iterations per hypothesis, results without novelty, credit). The model is
a stub provider that answers at once with a valid reply derived from the context it is
sent (an assessment of the previous result, a cheap ``source.read``/``source.search``/
``source.list`` query, now and then a new or resolved question); its own time is
subtracted, so the figures are the engine's. The process's cyclic collector is tuned as
the product's stage-running processes tune theirs (``workers.runtime.tune_collector``,
decision 131: a worker's main process before it forks its pool, the embedded CLI).

Prints, with the target beside each figure:

* wall time per step (median of the nine steps around steps 5, 50, 100, 200, 300, 500)
  and the ratio step 500 / step 5 (target <= 1.2), sequentially and side by side: after
  the last step, the case's next steps alternate with steps 1-9 of new cases of the same
  package in the same store, so that both are timed under the same load (on a shared
  machine the load drifts over the minutes between step 5 and step 500);
* the store's growth per step over steps 1-100 and 400-500 (the SQLite file after a WAL
  checkpoint; for PostgreSQL ``pg_total_relation_size`` of the engine's tables) and their
  ratio (target <= 1.5), and the whole store after the last step (target < 24.5 MB, what
  LangGraph's SqliteSaver leaves after 500 eight-node steps, measured in issue 13);
* SQL statements and sessions per step, the stored bytes by kind, and the load average.

Each case reads its own lines (an offset by the new case's number in the stub's choice of
module and line): new cases of the same package would otherwise ask byte-identical
queries at the same steps and share their stored results through content addressing, a
saving no real short case has.

Asserts nothing. Usage (repository root)::

    .venv/bin/python bench/long_case.py [--steps 500] [--database-url URL] [--profile-at N]
        [--side-by-side ROUNDS] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: Steps whose time is reported (median of a window of nine steps around each).
MARKS = (5, 50, 100, 200, 300, 500)
WINDOW = 4
#: New cases whose steps 1-9 alternate with the long case's steps after the last mark.
SIDE_BY_SIDE_ROUNDS = 20
#: What LangGraph's SqliteSaver leaves after 500 eight-node steps (issue 13).
LANGGRAPH_STORE_MB = 24.5
MODULES = 40
LINES_PER_MODULE = 200
#: Turns a hypothesis keeps a confidence before it steps down (rotates the schedule).
TURNS_PER_LEVEL = 42
LEVELS = ("plausible", "weak", "unassessed", "weakened")

HYPOTHESES = [
    {"id": 1, "statement": "The ledger module rounds each line item before summing, so "
                           "totals drift by a cent per line."},
    {"id": 2, "statement": "The cache module returns a stale price after an update because "
                           "its key omits the currency."},
    {"id": 3, "statement": "The importer parses dates in local time, shifting orders across "
                           "midnight into the wrong day."},
]
INTERPRETATION = {"summary": "Invoice totals differ from the sum of their lines by small "
                             "amounts on some days.", "bench": "long_case"}


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} cores)"


# -- the case ----------------------------------------------------------------------------------


def write_sources(root: Path) -> Path:
    """A deterministic source tree of ``MODULES`` modules of ``LINES_PER_MODULE`` lines."""
    src = root / "src"
    for m in range(MODULES):
        lines = [f'"""Module {m}: generated for the long-case benchmark."""', ""]
        for f in range((LINES_PER_MODULE - 2) // 4):
            lines += [f"def function_{m}_{f}(value, rate={f % 7 + 1}):",
                      f"    # step {f}: scale and round the value of module {m}",
                      f"    return round(value * rate / {f + 3}, {f % 4})", ""]
        path = src / "app" / f"module_{m:02d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines[:LINES_PER_MODULE]) + "\n")
    return src


def build_case(root: Path, database_url: str) -> tuple[Any, str, bytes]:
    """A fresh store at ``database_url`` holding the benchmark's case; returns the store,
    the case id and the package bytes (for :func:`young_case`)."""
    from investigation.cases.builder import build_package
    from investigation.cases.reader import PackageReader
    from investigation.cases.registry import register_case
    from investigation.config import InvestigationConfig
    from investigation.store import Store

    src = write_sources(root)
    report = root / "report.md"
    report.write_text("Invoice totals are off by a few cents on some days.\n" * 20)
    db = root / "shop.sqlite"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE invoice (id INTEGER PRIMARY KEY, total REAL, day TEXT)")
    conn.executemany("INSERT INTO invoice VALUES (?, ?, ?)",
                     [(i, i * 1.01, f"2026-01-{i % 28 + 1:02d}") for i in range(1, 200)])
    conn.commit()
    conn.close()
    logs = root / "logs"
    logs.mkdir()
    (logs / "app.log").write_text("".join(f"INFO invoice {i} total={i * 1.01:.2f}\n"
                                          for i in range(500)))
    package = build_package(src, report, root / "case.zip", db=db, logs=logs).path
    store = Store(database_url)
    store.create_schema()
    data = package.read_bytes()
    case_id = register_case(store, data, INTERPRETATION, HYPOTHESES,
                            PackageReader(InvestigationConfig().package))
    return store, case_id, data


def young_case(store: Any, package: bytes, number: int) -> str:
    """Another case of the same package in the same store, new (its interpretation names
    ``number``, so its id differs): the short case the long one is measured beside."""
    from investigation.cases.reader import PackageReader
    from investigation.cases.registry import register_case
    from investigation.config import InvestigationConfig

    return register_case(store, package, {**INTERPRETATION, "young": number}, HYPOTHESES,
                         PackageReader(InvestigationConfig().package))


def policy() -> Any:
    from investigation.config import InvestigationConfig

    return InvestigationConfig.model_validate({
        "loop": {"max_iterations_per_hypothesis": 10_000, "max_results_without_novelty": 10_000,
                 "max_questions_per_hypothesis": 30, "early_diagnosis": False},
        "budget": {"credit_units": 10_000_000},
    })


class StubModel:
    """A provider that answers at once with a valid reply derived from the context.

    Request and response bytes have the OpenAI chat-completions shape (the request built
    by :class:`~investigation.llm.openai.OpenAIProvider`), so what is stored per step is
    what a real deployment stores.
    """

    def __init__(self) -> None:
        from investigation.config import ProviderConfig
        from investigation.llm.openai import OpenAIProvider

        self._wire = OpenAIProvider(ProviderConfig(
            name="stub", kind="openai", base_url="http://127.0.0.1:9/v1", model="stub-model"))
        self.seconds = 0.0  # time spent here, subtracted from the step times

    @property
    def name(self) -> str:
        return "stub"

    @property
    def timeout_s(self) -> float:
        return 60.0

    def build_request_bytes(self, req: Any) -> bytes:
        return self._wire.build_request_bytes(req)

    def content_from_raw(self, raw: bytes) -> str:
        return self._wire.content_from_raw(raw)

    def send(self, request_bytes: bytes, req: Any) -> Any:
        from investigation.llm.types import ProviderReply

        started = time.perf_counter()
        text = req.messages[-1]["content"]
        # The user turn is a plain-language header, then "Context (<version>):" and the
        # context as JSON (``loop.prompt.build_messages``).
        ctx = json.loads(text[text.index("\n", text.index("\n\nContext (") + 2) + 1:])
        content = json.dumps(self.reply(ctx, req.call_index))
        raw = json.dumps({
            "id": f"stub-{req.call_index}", "object": "chat.completion", "model": "stub-model",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": len(text) // 4, "completion_tokens": len(content) // 4},
        }).encode()
        self.seconds += time.perf_counter() - started
        # The counts its `usage` reports, as the OpenAI provider passes them on.
        return ProviderReply(content=content, raw=raw, http_status=200,
                             prompt_tokens=len(text) // 4,
                             completion_tokens=len(content) // 4, finish_reason="stop")

    @staticmethod
    def reply(ctx: dict[str, Any], call: int) -> dict[str, Any]:
        hyp = ctx["hypothesis"]
        turn = int(hyp["turn"])
        previous = ctx.get("previous_result")
        assessment = None
        cited: list[str] = []
        if previous is not None:
            cited = [previous["evidence_id"]]
            assessment = {"score": 40 + call % 50, "reason": f"turn {turn}: the read shows "
                          "how the values are scaled", "evidence_ids": cited}
        own_open = [q["question_id"] for q in ctx["questions"]
                    if q["hypothesis_id"] == hyp["id"] and q["status"] == "open"]
        own_all = [q for q in ctx["questions"] if q["hypothesis_id"] == hyp["id"]]
        new_questions: list[str] = []
        resolve: list[str] = []
        if turn % 15 == 0 and len(own_all) < 25:
            new_questions = [f"Does module {turn % MODULES} round before or after summing "
                             f"(turn {turn} of hypothesis {hyp['id']})?"]
        elif turn % 15 == 7 and own_open and cited:
            resolve = own_open[:1]
        level = LEVELS[min(len(LEVELS) - 1, (turn - 1) // TURNS_PER_LEVEL)]
        # Each case reads its own lines: new cases of the same package would otherwise ask
        # byte-identical queries at the same steps, and their results, evidence and plans
        # would be stored once for all of them (content addressing), which no real short
        # case enjoys. The offset is 0 for the long case (``young_case`` names a number).
        offset = int(ctx["interpretation"].get("young", -1)) + 1
        module = (call * 7 + hyp["id"] + offset * 3) % MODULES
        kind = call % 10
        if kind < 7:
            start = (call * 13 + offset * 5) % (LINES_PER_MODULE - 20) + 1
            nxt = {"action": "query", "operation": "source.read",
                   "arguments": {"path": f"app/module_{module:02d}.py", "start_line": start,
                                 "end_line": start + 11}}
        elif kind < 9:
            nxt = {"action": "query", "operation": "source.search",
                   "arguments": {"pattern": f"function_{module}_{call % 49}(",
                                 "max_results": 5}}
        else:
            nxt = {"action": "query", "operation": "source.list",
                   "arguments": {"prefix": "app/module_0", "limit": 5}}
        return {
            "assessment": assessment,
            "update": {"confidence": level, "evidence_ids": cited,
                       "resolve_questions": resolve, "new_questions": new_questions,
                       "note": f"turn {turn}: read module {module}"},
            "next": nxt,
        }


# -- measuring ---------------------------------------------------------------------------------


class Counters:
    """SQL statements and sessions (transactions) on the store's engine."""

    def __init__(self, engine: Any) -> None:
        from sqlalchemy import event

        self.statements = 0
        self.transactions = 0

        @event.listens_for(engine, "before_cursor_execute")
        def _statement(*_: Any) -> None:
            self.statements += 1

        @event.listens_for(engine, "begin")
        def _begin(*_: Any) -> None:
            self.transactions += 1


def store_bytes(store: Any) -> int:
    """The store's size on disk: the SQLite file after a WAL checkpoint, or PostgreSQL's
    total relation size of the engine's tables."""
    from sqlalchemy import text

    if store.engine.dialect.name == "sqlite":
        path = Path(store.url.removeprefix("sqlite:///"))
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            conn.close()
        return sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())
    with store.engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE c.relkind = 'r' AND n.nspname = current_schema()")).scalar_one())


def stored_by_kind(store: Any, case_id: str) -> dict[str, int]:
    """Bytes of artifact content as read back, by kind of path (for the breakdown)."""
    from sqlmodel import select

    from investigation.store.models import Artifact

    out: dict[str, int] = {}
    with store.session() as s:
        for path in s.exec(select(Artifact.path).where(Artifact.case_id == case_id)).all():
            art = type(store).get_artifact(s, case_id, path)
            assert art is not None
            name = path.rsplit("/", 1)[-1]
            kind = name.split(".", 1)[1] if name.startswith("attempt-") else name
            out[kind] = out.get(kind, 0) + len(art.data)
    return out


def request_bytes(store: Any, case_id: str) -> dict[int, int]:
    """Bytes of each step's first model request (the context and prompt the model reads,
    so its prompt tokens), by step."""
    from sqlmodel import col, select

    from investigation.store.models import Artifact

    out: dict[int, int] = {}
    with store.session() as s:
        rows = s.exec(select(Artifact.path, Artifact.size_bytes).where(
            Artifact.case_id == case_id, col(Artifact.path).like("%.request.json"))).all()
    for path, size in sorted(rows):
        seq = int(path.split("/")[2])
        out.setdefault(seq, size)
    return out


def window(times: dict[int, float], step: int) -> float:
    last = max(times)
    lo, hi = max(1, step - WINDOW), min(last, step + WINDOW)
    if step + WINDOW > last:
        lo = max(1, last - 2 * WINDOW)
    return statistics.median(times[i] for i in range(lo, hi + 1) if i in times)


def resident_mb() -> float:
    """This process's resident set size in MB (Linux ``/proc/self/statm``; NaN elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except (OSError, ValueError, IndexError):
        return float("nan")


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--database-url", default=None,
                        help="store URL (default: a fresh SQLite file in a temp directory)")
    parser.add_argument("--profile-at", type=int, action="append", default=[],
                        help="print a pyinstrument profile of this step (repeatable)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--side-by-side", type=int, default=SIDE_BY_SIDE_ROUNDS,
                        help="rounds of new cases timed beside the long one (default "
                             f"{SIDE_BY_SIDE_ROUNDS})")
    args = parser.parse_args(argv)

    from investigation.cases.reader import PackageReader
    from investigation.config import GatewayConfig
    from investigation.llm.gateway import LLMGateway
    from investigation.loop.env import StageEnv
    from investigation.loop.investigator import Investigator
    from workers.runtime import tune_collector

    tune_collector()  # as a worker and the embedded CLI do (decision 131)
    work = Path(tempfile.mkdtemp(prefix="long-case-"))
    url = args.database_url or f"sqlite:///{work / 'store.db'}"
    try:
        store, case_id, package = build_case(work, url)
        cfg = policy()
        model = StubModel()
        env = StageEnv(store=store, config=cfg,
                       gateway_factory=lambda: LLMGateway(store, [model], GatewayConfig()),
                       reader=PackageReader(cfg.package), explicit_config=True,
                       feedback_key=b"k" * 32)
        investigator = Investigator(env)
        counters = Counters(store.engine)

        def timed(case: str) -> tuple[float, float]:
            """One step of ``case``: wall and CPU seconds, the model's time excluded."""
            model_s = model.seconds
            started, started_cpu = time.perf_counter(), time.process_time()
            outcome = investigator.step(case)
            spent = model.seconds - model_s
            wall = time.perf_counter() - started - spent
            used = time.process_time() - started_cpu - spent
            if outcome.outcome not in ("PROGRESSED", "REJECTED"):
                raise SystemExit(f"case {case}: {outcome}")
            if outcome.outcome == "REJECTED":
                print(f"case {case} rejected: {outcome.details}", flush=True)
            return wall, used

        sizes = {0: store_bytes(store)}
        rss: dict[int, float] = {}
        times: dict[int, float] = {}
        cpu: dict[int, float] = {}
        per_step_sql: dict[int, tuple[int, int]] = {}
        for step in range(1, args.steps + 1):
            profiler = None
            if step in args.profile_at:
                from pyinstrument import Profiler

                profiler = Profiler(interval=0.0005)
                profiler.start()
            stmts, txs = counters.statements, counters.transactions
            times[step], cpu[step] = timed(case_id)
            if profiler is not None:
                profiler.stop()
                print(profiler.output_text(unicode=False, color=False, show_all=False))
            per_step_sql[step] = (counters.statements - stmts, counters.transactions - txs)
            if step in (100, args.steps - 100, args.steps):
                sizes[step] = store_bytes(store)
            if step in (100, args.steps):
                rss[step] = resident_mb()
            if step % 50 == 0:
                print(f"  step {step}: {times[step] * 1000:.1f} ms  ({load_average()})",
                      flush=True)
        # Side by side: the long case's next steps alternate with steps 1-9 of new cases
        # in the same store and process, so both are timed under the same load (a shared
        # machine drifts between step 5 and step 500 of the sequential run).
        old_cpu: list[float] = []
        young_cpu: list[float] = []
        old_wall: list[float] = []
        young_wall: list[float] = []
        for rnd in range(args.side_by_side):
            young = young_case(store, package, rnd)
            for i in range(2 * WINDOW + 1):
                for which in ((young, case_id) if i % 2 == 0 else (case_id, young)):
                    wall, used = timed(which)
                    (young_wall if which == young else old_wall).append(wall)
                    (young_cpu if which == young else old_cpu).append(used)
        kinds = stored_by_kind(store, case_id)
        requests = request_bytes(store, case_id)
        store.dispose()
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept: {work} (store {url.split('@')[-1]}); read it with "
                  "INVESTIGATE_DATABASE_URL=" + (url if url.startswith("sqlite") else
                                                 "<the --database-url given>")
                  + f" investigate status {case_id}")

    n = args.steps
    figures: dict[str, float] = {}
    print()
    print(f"long case: {n} steps through Investigator.step, store "
          f"{url.split('@')[-1] if args.database_url else 'SQLite (temp file)'}; "
          f"{load_average()}")
    print("time per step (median of the steps around each mark, model time excluded): "
          "wall, and this process's CPU")
    for mark in MARKS:
        if mark <= n:
            print(f"    step {mark:4d}: {window(times, mark) * 1000:7.2f} ms wall  "
                  f"{window(cpu, mark) * 1000:7.2f} ms CPU")
    first, last = window(times, min(5, n)), window(times, n)
    figures["step_ratio"] = last / first
    figures["step_ratio_cpu"] = window(cpu, n) / window(cpu, min(5, n))
    print(f"    step {n} / step 5: {last / first:.2f}x wall, "
          f"{figures['step_ratio_cpu']:.2f}x CPU   (target <= 1.2)")
    if old_cpu:
        side = statistics.median(old_wall) / statistics.median(young_wall)
        side_cpu = statistics.median(old_cpu) / statistics.median(young_cpu)
        figures["side_by_side_ratio"] = side
        figures["side_by_side_ratio_cpu"] = side_cpu
        print(f"    side by side, {len(old_cpu)} steps each, alternating: steps {n + 1}-"
              f"{n + len(old_cpu)} of this case {statistics.median(old_wall) * 1000:.2f} ms "
              f"wall {statistics.median(old_cpu) * 1000:.2f} ms CPU; steps 1-{2 * WINDOW + 1} "
              f"of {args.side_by_side} new cases {statistics.median(young_wall) * 1000:.2f} ms "
              f"wall {statistics.median(young_cpu) * 1000:.2f} ms CPU")
        print(f"    step {n} / step 5, side by side: {side:.2f}x wall, {side_cpu:.2f}x CPU   "
              "(target <= 1.2)")
    if n >= 200:
        # The context's evidence windows (32 own, 16 other records) fill by about step 100:
        # after that, a flat cost shows as a ratio near 1 against step 100.
        print(f"    step {n} / step 100: {last / window(times, 100):.2f}x wall, "
              f"{window(cpu, n) / window(cpu, 100):.2f}x CPU   (windows full from about "
              "step 100)")
    early = (sizes[100] - sizes[0]) / 100 if 100 in sizes else float("nan")
    late = (sizes[n] - sizes[n - 100]) / 100 if n - 100 in sizes else float("nan")
    figures["storage_ratio"] = late / early
    figures["store_mb"] = sizes[n] / 1e6
    print("store growth per step")
    print(f"    steps 1-100: {early / 1000:8.1f} KB   steps {n - 99}-{n}: {late / 1000:8.1f} KB"
          f"   ratio {late / early:.2f}x   (target <= 1.5)")
    print(f"    whole store after {n} steps: {sizes[n] / 1e6:.1f} MB   "
          f"(target < {LANGGRAPH_STORE_MB} MB, LangGraph SqliteSaver after 500 eight-node "
          "steps)")
    if 100 in requests:
        # Medians of the steps around each mark: one step's request varies with the size
        # of the previous result it carries.
        sized = {k: float(v) for k, v in requests.items()}
        last_step = max(sized)
        early, hundred, at_end = (window(sized, 5), window(sized, 100),
                                  window(sized, last_step))
        figures["request_ratio"] = at_end / hundred
        print(f"model request per step (the context the model reads; medians around each "
              f"mark): step 5 {early / 1000:.1f} KB, step 100 {hundred / 1000:.1f} KB, step "
              f"{last_step} {at_end / 1000:.1f} KB; step {last_step} / step 100 "
              f"{figures['request_ratio']:.2f}x   (no target; the context's evidence part "
              "levels off once its windows are full; the questions listed grow by one "
              "every 15 turns of a hypothesis, at most 25 each)")
    print("artifact bytes as read back, by kind (MB):  " + "  ".join(
        f"{k} {v / 1e6:.1f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
    if rss:
        figures["rss_mb"] = rss[n]
        print("resident memory of this process (one case, its caches and the store's "
              "connections): " + "   ".join(f"after step {k}: {v:.0f} MB"
                                            for k, v in sorted(rss.items())))
    for mark in (5, n):
        st, tx = per_step_sql[mark]
        print(f"    step {mark}: {st} SQL statements, {tx} transactions")
    figures["statements_step_5"] = per_step_sql[min(5, n)][0]
    return figures


if __name__ == "__main__":
    main()
