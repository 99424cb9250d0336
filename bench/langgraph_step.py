#!/usr/bin/env python
"""Reference for bench/step_overhead.py and bench/long_case.py: LangGraph with its SQLite
checkpointer (issue 13).

Runs in the benchmarks' own environment (``make bench-env`` builds ``.venv-bench`` with
``langgraph`` and ``langgraph-checkpoint-sqlite``; they are never dependencies of the
engine). A graph of eight nodes in a line, shaped like one engine step (each node reads
the state and adds what a stage adds: a few ids, a record of a few hundred bytes), is
compiled with ``SqliteSaver`` on a file and invoked with ``durability="sync"`` (every
node's checkpoint is written before the next node runs).

Modes (``--mode``):

* ``step``: ``--cases`` threads of ``--steps`` invocations each (like the tiny case's five
  steps); prints the median wall time of one invocation (one eight-node step).
* ``long``: one thread of ``--steps`` invocations; prints the database size afterwards.

Output: one JSON object on stdout (``{"mode", "median_ms" | "store_bytes", ...}``).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import operator
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph

#: ``workers.runtime.GC_GEN0_THRESHOLD`` (this environment does not install the engine).
GC_GEN0_THRESHOLD = 10_000

STAGES = ("build_context", "llm_call", "validate", "persist_plan", "settle_reserve",
          "execute_tool", "record_evidence", "publish")


class StepState(TypedDict):
    step: int
    stage_outputs: dict[str, Any]
    evidence: Annotated[list[dict[str, Any]], operator.add]


def _node(stage: str) -> Any:
    def run(state: StepState) -> dict[str, Any]:
        outputs = dict(state.get("stage_outputs") or {})
        outputs[stage] = {"stage": stage, "step": state["step"], "ok": True}
        update: dict[str, Any] = {"stage_outputs": outputs}
        if stage == "record_evidence":
            n = len(state.get("evidence") or [])
            update["evidence"] = [{
                "evidence_id": f"E{n + 1}", "operation": "source.read",
                "arguments": {"path": f"app/module_{n % 40:02d}.py", "start_line": n % 180,
                              "end_line": n % 180 + 11},
                "items": [{"key": f"app/module_{n % 40:02d}.py:{n % 180 + i}",
                           "text": f"    return round(value * rate / {i + 3}, {i % 4})"}
                          for i in range(4)],
            }]
        return update

    return run


def build(saver: SqliteSaver) -> Any:
    graph = StateGraph(StepState)
    for stage in STAGES:
        graph.add_node(stage, _node(stage))
    graph.add_edge(START, STAGES[0])
    for a, b in itertools.pairwise(STAGES):
        graph.add_edge(a, b)
    graph.add_edge(STAGES[-1], END)
    return graph.compile(checkpointer=saver)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("step", "long"), default="step")
    parser.add_argument("--cases", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup-cases", type=int, default=2)
    args = parser.parse_args(argv)
    # The engine's processes raise the collector's first-generation threshold
    # (workers.runtime.tune_collector, decision 131); the reference runs with the same.
    gen0, gen1, gen2 = gc.get_threshold()
    if gen0 and gen0 < GC_GEN0_THRESHOLD:
        gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)
    work = Path(tempfile.mkdtemp(prefix="langgraph-step-"))
    path = work / "checkpoints.db"
    conn = sqlite3.connect(path, check_same_thread=False)
    saver = SqliteSaver(conn)
    graph = build(saver)
    times: list[float] = []
    cases = 1 if args.mode == "long" else args.warmup_cases + args.cases
    for case in range(cases):
        config = {"configurable": {"thread_id": f"case-{case}"}}
        for step in range(1, args.steps + 1):
            started = time.perf_counter()
            graph.invoke({"step": step, "stage_outputs": {}, "evidence": []}, config,
                         durability="sync")
            if case >= (0 if args.mode == "long" else args.warmup_cases):
                times.append(time.perf_counter() - started)
    conn.close()
    out: dict[str, Any] = {"mode": args.mode, "steps": len(times),
                           "median_ms": statistics.median(times) * 1000,
                           "nodes_per_step": len(STAGES)}
    if args.mode == "long":
        out["store_bytes"] = sum(p.stat().st_size for p in work.iterdir())
    for p in work.iterdir():
        p.unlink()
    os.rmdir(work)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
