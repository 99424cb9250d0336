"""Interrupt a step at every stage, rerun it, and show the same stored state.

For each stage: (a) the step stops right after the stage committed (its completion
marker is stored), a new process rebuilds everything and reruns the step; (b) the process
dies inside the stage's transaction, after the stage's work but before its commit. Both
must end with the checkpoint hashes, ``summary.md`` bytes, evidence records and charges of
an uninterrupted run.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import col, select

from investigation.config import ProvidersConfig
from investigation.constants import COMPLETED, STAGES
from investigation.llm.gateway import LLMGateway, build_providers
from investigation.loop.investigator import Investigator
from investigation.loop.outcome import StepKey
from investigation.loop.stages import Stages
from investigation.operations import summary_bytes
from investigation.store.models import (
    Checkpoint,
    Evidence,
    LedgerEntry,
    LLMAttempt,
    LLMOperation,
    Plan,
)
from tests.casekit import Case, make_case, unguarded


def fingerprint(case: Case) -> dict[str, Any]:
    """Everything that must be identical between an interrupted and a clean run."""
    with case.store.session() as s:
        hashes = [c.hash for c in s.exec(select(Checkpoint).where(
            Checkpoint.case_id == case.case_id).order_by(col(Checkpoint.seq)))]
        evidence = s.exec(select(Evidence).where(Evidence.case_id == case.case_id)).all()
        plans = s.exec(select(Plan).where(Plan.case_id == case.case_id)).all()
        ledger = s.exec(select(LedgerEntry).where(LedgerEntry.case_id == case.case_id)
                        .order_by(col(LedgerEntry.hypothesis_id), col(LedgerEntry.step_seq),
                                  col(LedgerEntry.kind))).all()
        ops = s.exec(select(LLMOperation).where(LLMOperation.case_id == case.case_id)).all()
        attempts = s.exec(select(LLMAttempt).where(
            col(LLMAttempt.operation_id).in_([o.id for o in ops]))).all()
    return {
        "hashes": hashes,
        "summary": summary_bytes(case.store, case.case_id),
        "evidence": sorted((e.evidence_id, e.step_seq, e.fingerprint) for e in evidence),
        "query_plans": sum(1 for p in plans if p.action == "query"),
        "ledger": [(r.hypothesis_id, r.step_seq, r.kind, r.amount_units) for r in ledger],
        "llm_operations": len(ops),
        "model_calls": len(attempts),  # one request per decision: never asked twice
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    case = make_case(tmp_path_factory.mktemp("reference"))
    outcome = case.investigator().run(case.case_id, max_steps=50)
    assert outcome.outcome == COMPLETED
    ref = fingerprint(case)
    assert ref["query_plans"] == len(ref["evidence"]) == 3
    assert sum(1 for r in ref["ledger"] if r[2] == "reserve") == 3
    return ref


def _complete(case: Case) -> None:
    outcome = Investigator(case.env()).run(case.case_id, max_steps=50)
    assert outcome.outcome == COMPLETED, outcome


@pytest.mark.parametrize("stage", STAGES)
def test_interrupt_after_stage(stage: str, tmp_path: Path, reference: dict[str, Any]) -> None:
    case = make_case(tmp_path / "case")
    upto = STAGES.index(stage)
    for _ in range(5):  # every step of the investigation is interrupted
        inv = Investigator(case.env())
        key = inv.next_step(case.case_id)
        if not isinstance(key, StepKey):
            break
        outputs = {}
        for name in STAGES[: upto + 1]:
            result = Stages(case.env()).run(name, key)
            assert result.halt is None or name == "publish"
            outputs[name] = result.output
        # A new process: the finished stage, run again, returns its recorded output and
        # changes nothing; the rest of the step then continues where it stopped.
        again = Stages(case.env()).run(stage, key)
        assert json.dumps(again.output, sort_keys=True) == \
            json.dumps(outputs[stage], sort_keys=True)
        if stage != "publish":
            Investigator(case.env()).step(case.case_id)
    _complete(case)
    assert fingerprint(case) == reference


class Crash(Exception):
    """Stands for a process that dies inside a stage's transaction."""


@pytest.mark.parametrize("stage", STAGES)
def test_crash_inside_stage_before_commit(stage: str, tmp_path: Path,
                                          reference: dict[str, Any],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case(tmp_path / "case")
    original = Stages._complete
    crashes = {"left": 3}

    def crashing(s: Any, key: StepKey, name: str, output: dict[str, Any]) -> Any:
        result = original(s, key, name, output)
        if name == stage and crashes["left"] > 0:
            crashes["left"] -= 1
            s.flush()  # the stage's writes reached the database ...
            raise Crash(f"killed inside {name} of step {key.step_seq}")  # ... uncommitted
        return result

    monkeypatch.setattr(Stages, "_complete", staticmethod(crashing))
    for _ in range(30):
        try:
            outcome = Investigator(case.env()).step(case.case_id)
        except Crash:
            continue
        if outcome.outcome == COMPLETED:
            break
    assert crashes["left"] == 0
    monkeypatch.setattr(Stages, "_complete", staticmethod(original))
    assert fingerprint(case) == reference


class Died(BaseException):
    """Stands for a process that dies while its model request is out."""


#: The step of the tiny case's third model call (hypothesis 1's).
STEP_OF_THIRD_CALL = 3


def test_a_process_dying_inside_a_model_request_costs_one_attempt_more(
        tmp_path: Path, reference: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The request was stored before it was sent (seed 000), so the next process finds it
    ``sent``, counts it as an attempt (``PROVIDER_INTERRUPTED``) and sends it again: the
    summary's usage table counts one attempt more for that hypothesis, and nothing else
    differs from an uninterrupted run (what a whole worker killed beside other cases
    leaves, ``test_recovery``'s Redis-loss test)."""
    from investigation.llm.scripted import ScriptedProvider

    case = make_case(tmp_path / "case")
    original = ScriptedProvider.send
    sent = {"n": 0}

    def dying(self: ScriptedProvider, request_bytes: bytes, req: Any) -> Any:
        sent["n"] += 1
        if sent["n"] == 3:
            raise Died("killed while the third request was out")
        return original(self, request_bytes, req)

    monkeypatch.setattr(ScriptedProvider, "send", dying)
    with pytest.raises(Died):
        Investigator(case.env()).run(case.case_id, max_steps=50)
    monkeypatch.setattr(ScriptedProvider, "send", original)
    # A new process, whose gateway declares a request it finds out interrupted at once
    # (the default waits twice the longest provider timeout plus 5 s: RETRY_PENDING then).
    env = case.env()
    providers = ProvidersConfig.load(case.providers_path)
    env.gateway_factory = lambda: LLMGateway(case.store, build_providers(providers),
                                             providers.gateway, in_flight_grace_s=0)
    outcome = Investigator(env).run(case.case_id, max_steps=50)
    assert outcome.outcome == COMPLETED, outcome
    got = fingerprint(case)
    assert got["model_calls"] == reference["model_calls"] + 1
    with case.store.session() as s:
        interrupted = s.exec(select(LLMAttempt).where(
            LLMAttempt.error_code == "PROVIDER_INTERRUPTED")).all()
    assert [a.status for a in interrupted] == ["failed"]
    # The interrupted attempt has no measured model time: its row was closed when the
    # gateway gave it up (after the in-flight grace, ten minutes for a real model's user).
    from investigation.report.history import attempt_ms, case_history

    assert attempt_ms(interrupted[0]) is None
    # As a real grace leaves it: ten minutes after sending (a closed attempt is guarded).
    with unguarded(case.store), case.store.session() as s:
        gone = s.get(LLMAttempt, interrupted[0].id)
        assert gone is not None and gone.finished_at is not None
        gone.started_at = gone.finished_at - timedelta(minutes=10)
        s.add(gone)
    with case.store.session() as s:
        answered = s.exec(select(LLMAttempt).where(
            LLMAttempt.operation_id == interrupted[0].operation_id,
            LLMAttempt.error_code == None)).all()  # noqa: E711
    row = next(st for st in case_history(case.store, case.case_id).steps
               if st.seq == STEP_OF_THIRD_CALL)
    assert (row.attempts, row.model_ms) == (2, sum(attempt_ms(a) or 0 for a in answered))
    # The third request was hypothesis 1's third call: its row says 3 calls, 4 attempts.
    assert b"| 1 | 3 | 3 |" in reference["summary"]
    # ... and its interruptions name the attempt the dead process left.
    interruption = (f"## Interruptions\n\n- Step {STEP_OF_THIRD_CALL} (hypothesis 1): the "
                    "model call was answered after 1 failed attempt (PROVIDER_INTERRUPTED)"
                    "\n\n## Model usage").encode()
    assert got.pop("summary") == reference["summary"].replace(
        b"| 1 | 3 | 3 |", b"| 1 | 3 | 4 |").replace(b"## Model usage", interruption)
    got.pop("model_calls")
    assert got == {k: v for k, v in reference.items() if k not in ("summary", "model_calls")}
