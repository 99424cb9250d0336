"""Stopping a worker while a stage runs: warm, soft and cold shutdown lose nothing.

A real prefork worker runs a case whose first model request the loopback
OpenAI-compatible server answers only after a delay, so ``llm_call`` is running when the
signal arrives (``docs/operations.md`` "Stopping workers"):

* warm (SIGTERM): the running stage finishes, its successor waits in the queue, the
  worker exits 0; a new worker finishes the case with one model request per step;
* soft (SIGQUIT with ``INVESTIGATE_SOFT_SHUTDOWN_S``): the same, within the soft limit;
* cold (SIGQUIT): the stage is interrupted; its message was never acknowledged (late
  acks), so it is delivered again after the visibility timeout and the case finishes
  with the checkpoints of an undisturbed run.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from sqlmodel import select

from investigation.constants import CASE_BUILDING_DIAGNOSIS
from investigation.llm.replay_server import Fault, ReplayServer
from investigation.store.models import Checkpoint, StageRun
from tests.casekit import HAPPY_REPLIES
from tests.integration.test_celery_worker import HAPPY_STEPS, Harness, Worker, running_harness

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.fleet]

BIN = Path(sys.executable).parent / "investigate"
# The interrupted model request stays "in flight" for the gateway's grace (twice the
# provider timeout plus 5 s), longer than the countdowns allowed here: the recovery sweep
# (beat in the second worker, every second) dispatches the case when that has passed.
FAST_REDELIVERY = {"INVESTIGATE_VISIBILITY_TIMEOUT_S": "4", "INVESTIGATE_MAX_COUNTDOWN_S": "2",
                   "INVESTIGATE_RESTORE_INTERVAL_S": "1", "INVESTIGATE_SWEEP_INTERVAL_S": "1"}


def providers(base_url: str, timeout_s: int) -> str:
    return ("[gateway]\nattempts = 5\ndelay_s = 0.2\n\n[[providers]]\nname = \"replay\"\n"
            f"kind = \"openai\"\nbase_url = \"{base_url}\"\nmodel = \"replay\"\n"
            f"timeout_s = {timeout_s}\nstructured_output = \"json_schema\"\n")


def cli_worker(h: Harness, tmp_path: Path, name: str, *extra: str) -> Worker:
    return Worker([str(BIN), "worker", "-n", f"{h.queue}-{name}@%h", "-c", "2", *extra],
                  dict(h.worker.env),
                  tmp_path / f"{name}.log")


def wait_for(predicate: object, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def llm_call_recorded(h: Harness) -> bool:
    with h.case.store.session() as s:
        return s.exec(select(StageRun).where(StageRun.case_id == h.case.case_id,
                                             StageRun.step_seq == 1,
                                             StageRun.stage == "llm_call")).first() is not None


def finish_with_a_new_worker(h: Harness, tmp_path: Path, *extra: str) -> list[str]:
    h.worker.stop()  # the first one has exited; the harness stops the one in h.worker
    h.worker = cli_worker(h, tmp_path, "second", *extra)
    h.worker.start()
    info = h.wait_for_state(CASE_BUILDING_DIAGNOSIS)
    assert info["steps"] == HAPPY_STEPS
    with h.case.store.session() as s:
        return [c.hash for c in s.exec(select(Checkpoint).where(
            Checkpoint.case_id == h.case.case_id).order_by(Checkpoint.seq)).all()]


@pytest.mark.parametrize("how", ["warm", "soft"])
def test_a_warm_or_soft_shutdown_finishes_the_running_stage_and_loses_nothing(
    how: str, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers.tasks import start_dispatch

    lines = [json.dumps(r) for r in HAPPY_REPLIES]
    extra = {"INVESTIGATE_SOFT_SHUTDOWN_S": "20"} if how == "soft" else {}
    with ReplayServer(lines, faults=[Fault.delay(3)]) as server, \
            running_harness(tmp_path, redis_url, monkeypatch, extra_env=extra) as h, \
            h.dump_on_failure():
        h.case.providers_path.write_text(providers(server.base_url, timeout_s=30))
        first = cli_worker(h, tmp_path, "first")
        h.worker = first
        first.start()
        first.wait_ready()
        assert isinstance(start_dispatch(h.case.case_id), str)
        wait_for(lambda: len(server.requests) >= 1 or "llm_call" in first.log(),
                 "the first model request was never sent")
        wait_for(lambda: "Task investigation.llm_call" in first.log(), "llm_call not received")
        time.sleep(0.5)  # inside the delayed model request
        assert not llm_call_recorded(h)
        assert first.proc is not None
        first.proc.send_signal(signal.SIGTERM if how == "warm" else signal.SIGQUIT)
        assert first.proc.wait(timeout=60) == 0
        log = first.log()
        assert re.search(r"Task investigation\.llm_call\[[0-9a-f-]+\] succeeded", log), log
        assert llm_call_recorded(h)  # the running stage finished before the exit
        finish_with_a_new_worker(h, tmp_path)
        # one model request per step: the finished stage was not run again
        assert len({r.body for r in server.requests}) == HAPPY_STEPS


def test_a_cold_shutdown_interrupts_the_stage_and_it_is_delivered_again(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers.tasks import start_dispatch

    lines = [json.dumps(r) for r in HAPPY_REPLIES]
    with ReplayServer(lines, faults=[Fault.delay(2)]) as server, \
            running_harness(tmp_path, redis_url, monkeypatch,
                            extra_env=FAST_REDELIVERY) as h, h.dump_on_failure():
        h.case.providers_path.write_text(providers(server.base_url, timeout_s=3))
        first = cli_worker(h, tmp_path, "first")
        h.worker = first
        first.start()
        first.wait_ready()
        assert isinstance(start_dispatch(h.case.case_id), str)
        wait_for(lambda: "Task investigation.llm_call" in first.log(), "llm_call not received")
        time.sleep(0.5)
        assert first.proc is not None
        first.proc.send_signal(signal.SIGQUIT)
        first.proc.wait(timeout=30)
        assert not re.search(r"Task investigation\.llm_call\[[0-9a-f-]+\] succeeded",
                             first.log())
        hashes = finish_with_a_new_worker(h, tmp_path, "--beat")
        assert len(hashes) == HAPPY_STEPS
        assert "Task investigation.llm_call" in h.worker.log()  # delivered again



