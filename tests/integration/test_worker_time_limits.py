"""Issue 10.6 with a real worker started by ``investigate worker``: a Celery time limit
that stops a stage is recorded once, as what it is (``STAGE_TIME_LIMIT``), never as a
poison loop (``STAGE_POISONED`` after six runs).

The second decision of the happy path asks for a ``db.query`` that counts to two billion
(``tools.sql_timeout_s`` is raised to 30 s, so only the worker's limit can stop it). With
``--time-limit 3`` Celery kills the stage's process; with ``--soft-time-limit 2`` it raises
in it. Either way the query becomes a failed result with the code ``STAGE_TIME_LIMIT``,
the case goes on to its end, and the SQL child does not outlive the stage.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from sqlmodel import select

from investigation.constants import CASE_BUILDING_DIAGNOSIS
from investigation.store.models import Evidence, StageDelivery
from tests import casekit
from tests.integration.test_celery_worker import Harness, running_harness

pytestmark = [pytest.mark.redis, pytest.mark.slow]

SLOW_SQL = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c "
            "WHERE x < 2000000000) SELECT max(x) AS n FROM c")


def _replies() -> list[dict[str, object]]:
    replies = [dict(r) for r in casekit.HAPPY_REPLIES]
    replies[1] = casekit.q("db.query", {"sql": SLOW_SQL}, confidence="weak")
    return replies


def _use_investigate_worker(h: Harness, *limits: str) -> None:
    """Run the worker through ``investigate worker`` (the operator's command)."""
    h.worker.cmd = [str(Path(sys.executable).with_name("investigate")), "worker", "-c", "2",
                    "--loglevel", "INFO", *limits]


@pytest.mark.parametrize(("limits", "kind"), [(("--time-limit", "3"), "hard"),
                                              (("--soft-time-limit", "2",
                                                "--time-limit", "20"), "soft")])
def test_a_time_limit_in_a_query_is_recorded_once_and_the_case_goes_on(
        tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch,
        limits: tuple[str, ...], kind: str) -> None:
    from workers.tasks import start_dispatch

    config = tmp_path / "investigation.toml"
    config.write_text("[tools]\nsql_timeout_s = 30\n")
    with running_harness(tmp_path, redis_url, monkeypatch, replies=_replies(),
                         extra_env={"INVESTIGATE_CONFIG": str(config)}) as h, \
            h.dump_on_failure():
        _use_investigate_worker(h, *limits)
        h.worker.start()
        h.worker.wait_ready()
        started = time.monotonic()
        start_dispatch(h.case.case_id)
        info = h.wait_for_state(CASE_BUILDING_DIAGNOSIS, timeout_s=90)
        h.wait_unlocked()
        assert time.monotonic() - started < 40  # one limit, not six runs and lock TTLs
        assert info["last_outcome"] == "COMPLETED" and info["steps"] == 5
        with h.case.store.session() as s:
            evidence = {e.step_seq: e for e in s.exec(select(Evidence))}
            rows = s.exec(select(StageDelivery).where(StageDelivery.step_seq == 2,
                                                      StageDelivery.stage == "execute_tool")
                          ).all()
        stopped = evidence[2]
        assert json.loads(stopped.warnings_json) == ["TOOL_FAILED"]
        assert stopped.item_count == 0
        result = json.loads(_result(h, 2))
        assert result["stats"]["error_code"] == "STAGE_TIME_LIMIT"
        assert f"{kind} time limit" in result["stats"]["error"]
        assert [r.unfinished for r in rows] == [0]
        log = h.worker.log()
        assert len(re.findall(rf"step 2 execute_tool: stopped by the worker's {kind} time "
                              "limit", log)) == 1
        assert "STAGE_POISONED" not in log
        assert "Pool callback raised exception" not in log  # Celery's own handlers ran
        if kind == "hard":  # Celery's line about it names the step (a fleet trial)
            assert re.search(r"\[worker=\S+ case=case-\w+ step=2 stage=execute_tool\] "
                             r"Hard time limit", log), log


def _result(h: Harness, seq: int) -> bytes:
    from investigation.constants import ARTIFACT_RAW_RESULT
    from investigation.store.engine import Store

    with h.case.store.session() as s:
        art = Store.get_artifact(s, h.case.case_id, ARTIFACT_RAW_RESULT.format(seq=seq))
        assert art is not None
        return bytes(art.data)


def test_a_time_limit_in_another_stage_parks_the_case_with_its_own_code(
        tmp_path: Path) -> None:
    """Any stage but a query's ``execute_tool`` cannot become a failed result: the case is
    parked ``BLOCKED`` / ``STAGE_TIME_LIMIT`` once (not ``STAGE_POISONED``), ``status``
    says which stage, and ``resume`` continues it."""
    from investigation.loop import deliveries
    from investigation.loop.outcome import StepKey
    from investigation.loop.stages import Stages
    from investigation.operations import resume, status
    from workers.locks import FileCaseLock
    from workers.runtime import Runtime
    from workers.settings import Settings
    from workers.tasks import _time_limited

    case = casekit.make_case(tmp_path / "case")
    env = case.env()
    rt = Runtime("distributed", Settings(home=tmp_path / "home"), env,
                 FileCaseLock(tmp_path / "locks"))
    key = StepKey(case.case_id, 1, 1)
    Stages(env).run("build_context", key)
    assert deliveries.count_apart(case.store, key, "llm_call", 5).parked is None
    payload = {**key.to_dict(), "token": "t", "steps_left": 8, "mode": "distributed",
               "max_steps": None, "halt": None}
    out = _time_limited(rt, payload, "llm_call", "hard", 5.0)
    assert out["halt"]["outcome"] == "BLOCKED"
    assert out["halt"]["reason"] == "STAGE_TIME_LIMIT"
    info = status(case.store, case.case_id)
    assert (info["state"], info["blocked_reason"]) == ("BLOCKED", "STAGE_TIME_LIMIT")
    assert "stage llm_call of step 1 was stopped by the worker's time limit" in \
        info["blocked_detail"]
    # The advice says the stopped model call is waited out after the resume.
    from investigation import guidance

    assert guidance.facts_for(case.store, case.case_id).stopped_stage == "llm_call"
    advice = " ".join(guidance.for_case(case.store, case.case_id, "distributed").lines())
    assert "up to the gateway's in-flight grace" in advice, advice
    with case.store.session() as s:
        assert [r.unfinished for r in s.exec(select(StageDelivery))] == [0]
    # Recorded once: a second report of the same limit changes nothing.
    assert _time_limited(rt, dict(payload), "llm_call", "hard", 5.0)["halt"]["outcome"] \
        == "STALE"
    resume(case.store, case.case_id)
    assert case.investigator().run(case.case_id).outcome == "COMPLETED"
