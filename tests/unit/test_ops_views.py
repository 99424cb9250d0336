"""Log lines, the case list and the store gauges, in process."""

from __future__ import annotations

import io
import json
import logging
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from investigation.errors import InvestigationError
from investigation.overview import fleet_counts, list_cases
from investigation.store.models import CaseRecord
from tests.casekit import Case, make_case
from workers import logs
from workers.metrics import StoreCollector


@pytest.fixture
def stream() -> io.StringIO:
    out = io.StringIO()
    yield out
    logs.setup("text", logging.WARNING)  # back to stderr for the other tests
    logging.captureWarnings(False)


def test_a_python_warning_is_one_log_line_of_the_format(stream: io.StringIO) -> None:
    """Celery's SecurityWarning (a worker run as root) reached a JSON-logging worker's
    stderr as seven lines of bare text; in text logs, as one line of escaped breaks."""
    import warnings

    source = Path(__file__)
    line = next(i for i, text in enumerate(source.read_text().splitlines(), 1)
                if text.startswith("def test_a_python_warning_is_one_log_line"))
    logs.setup("json", "INFO", stream)
    with warnings.catch_warnings():  # the suite makes warnings errors
        warnings.simplefilter("always")
        warnings.warn_explicit("running as root:\nthis is\n\n  not recommended",
                               UserWarning, str(source), line)
    (shown,) = (json.loads(text) for text in stream.getvalue().splitlines())
    assert shown["level"] == "WARNING" and shown["logger"] == "py.warnings"
    assert shown["message"] == (f"{source}:{line}: UserWarning: running as root: this is "
                                "not recommended")  # no source line, white space collapsed


def test_text_lines_have_a_utc_timestamp_and_the_step_context(stream: io.StringIO) -> None:
    logs.setup("text", "INFO", stream)
    logs.set_worker_name("w1@host")
    try:
        with logs.step_context(case_id="case-1", step=3, stage="validate"):
            logging.getLogger("workers.tasks").info("hello %s", "there")
        logging.getLogger("x").warning("outside")
    finally:
        logs.set_worker_name(None)
    first, second = stream.getvalue().splitlines()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00 INFO workers\.tasks "
                        r"\[worker=w1@host case=case-1 step=3 stage=validate\] hello there",
                        first), first
    assert second.endswith("WARNING x [worker=w1@host] outside")


def test_json_lines_carry_the_context_and_celerys_task_lines_are_recognised(
    stream: io.StringIO
) -> None:
    logs.setup("json", "INFO", stream)
    with logs.step_context(case_id="case-2", step=1, stage="llm_call", task_id="t-1"):
        logging.getLogger("a").info("inside")
    # Celery's own line about one of our tasks (args: its argsrepr).
    logging.getLogger("celery.worker.strategy").info(
        "Task %(name)s[%(id)s] received",
        {"name": "investigation.publish", "id": "t-2",
         "args": "case=case-3 rev=1 step=7 stage=publish", "kwargs": "{'token': 'ab…'}"})
    inside, celery_line = (json.loads(line) for line in stream.getvalue().splitlines())
    assert inside["message"] == "inside" and inside["level"] == "INFO"
    assert (inside["case_id"], inside["step"], inside["stage"], inside["task_id"]) == (
        "case-2", 1, "llm_call", "t-1")
    assert datetime.fromisoformat(inside["timestamp"]).tzinfo is not None
    assert (celery_line["case_id"], celery_line["step"], celery_line["stage"],
            celery_line["task_id"]) == ("case-3", 7, "publish", "t-2")
    assert "worker" not in inside  # absent fields are left out, not null


def test_retry_pool_and_worker_lost_lines_carry_a_time_and_the_step(
        stream: io.StringIO) -> None:
    """A fleet trial grepped a case id and missed Celery's retry lines (``Task
    investigation.llm_call[id] retry: Retry in 4s``) and the lost-worker lines; billiard's
    lines about a killed pool child had no time at all."""
    import billiard.util
    from celery import Celery
    from celery._state import _task_stack

    logs.setup("text", "INFO", stream)
    billiard.util.get_logger().error("Process %r pid:%r exited with %r",
                                     "ForkPoolWorker-2", 19579, "signal 9 (SIGKILL)")
    app = Celery("t", set_as_current=False)

    @app.task(name="tests.stand_in")  # not a registered name: no clash with the engine's
    def llm_call() -> None:
        """A stand-in for a stage task."""

    llm_call.push_request(id="t-9", argsrepr="case=case-4 rev=1 step=8 stage=llm_call",
                          called_directly=False)
    _task_stack.push(llm_call)
    try:
        logging.getLogger("celery.app.trace").info(
            "Task %(name)s[%(id)s] retry: %(exc)s",
            {"name": "investigation.llm_call", "id": "t-9", "exc": "Retry in 4s"})
    finally:
        _task_stack.pop()
        llm_call.pop_request()
    from workers.tasks import StageRequest

    class Lost:  # the fields of a worker request that StageRequest reads for its context
        argsrepr = "case=case-5 rev=1 step=2 stage=execute_tool"
        id = "t-10"
        task = llm_call

    with StageRequest._log_context(Lost()):  # type: ignore[arg-type]
        logging.getLogger("celery.worker.request").error("Task handler raised error: %r",
                                                         "WorkerLostError()")
    pool, retry, lost = stream.getvalue().splitlines()
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00 "
    assert re.match(stamp + "ERROR multiprocessing ", pool), pool
    assert "[case=case-4 step=8 stage=llm_call] Task investigation.llm_call[t-9] retry" \
        in retry, retry
    assert "[case=case-5 step=2 stage=execute_tool] Task handler raised error" in lost, lost


def test_short_token() -> None:
    assert logs.short_token("0123456789abcdef0123456789abcdef") == "01234567…"
    assert logs.short_token(None) == "-"
    with pytest.raises(ValueError):
        logs.formatter("xml")


def _set(case: Case, **fields: object) -> None:
    with case.store.session() as s:
        row = s.get(CaseRecord, case.case_id)
        assert row is not None
        for name, value in fields.items():
            setattr(row, name, value)
        s.add(row)


def test_the_case_list_and_the_fleet_counts(tmp_path: Path) -> None:
    a = make_case(tmp_path / "a")
    url = str(a.store.url)
    b = make_case(tmp_path / "b", database_url=url, interpretation={"summary": "other"})
    c = make_case(tmp_path / "c", database_url=url, interpretation={"summary": "third"})
    assert a.investigator().step(a.case_id).outcome == "PROGRESSED"
    now = datetime.now(UTC)
    _set(b, state="BLOCKED", blocked_reason="PROVIDER_EXHAUSTED",
         updated_at=now - timedelta(minutes=1))
    _set(c, retry_not_before=now - timedelta(seconds=120), updated_at=now - timedelta(hours=1))
    _set(a, updated_at=now - timedelta(seconds=30))

    rows = list_cases(a.store)
    assert [r.case_id for r in rows] == [a.case_id, b.case_id, c.case_id]  # newest first
    first = rows[0]
    assert (first.state, first.steps, first.last_outcome, first.hypotheses) == (
        "INVESTIGATING", 1, "PROGRESSED", 2)
    assert first.balance_units < first.credit_units and first.next is None
    blocked = list_cases(a.store, "blocked")
    assert [(r.case_id, r.blocked_reason) for r in blocked] == [(b.case_id,
                                                                  "PROVIDER_EXHAUSTED")]
    assert list_cases(a.store, "Building-Diagnosis") == []
    with pytest.raises(InvestigationError) as err:
        list_cases(a.store, "stuck")
    assert err.value.code == "STATE_UNKNOWN"
    assert rows[2].retry_not_before is not None

    counts = fleet_counts(a.store, now)
    assert counts.cases_by_state["INVESTIGATING"] == 2
    assert counts.cases_by_state["BLOCKED"] == 1
    assert counts.blocked_by_reason == {"PROVIDER_EXHAUSTED": 1}
    assert counts.pending_retries == 1
    assert counts.oldest_retry_overdue_s == pytest.approx(120, abs=1)
    assert counts.oldest_idle_s == pytest.approx(120, abs=1)  # a idle 30 s, c due 120 s

    registry = CollectorRegistry()
    registry.register(StoreCollector(a.store, lambda: 4, "cases"))
    text = generate_latest(registry).decode()
    assert 'investigation_cases{state="BLOCKED"} 1.0' in text
    assert 'investigation_blocked_cases{reason="PROVIDER_EXHAUSTED"} 1.0' in text
    assert 'investigation_queue_messages{queue="cases"} 4.0' in text
    assert "investigation_store_up 1.0" in text
    assert "investigation_pending_retries 1.0" in text


def test_the_store_gauges_say_when_the_store_is_down(tmp_path: Path) -> None:
    case = make_case(tmp_path / "a")

    class Down:
        def session(self) -> object:
            raise OSError("the store is down")

    registry = CollectorRegistry()
    registry.register(StoreCollector(Down(), None))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert "investigation_store_up 0.0" in text and "investigation_cases" not in text
    assert case.case_id  # the fixture case is untouched


def test_a_taken_metrics_port_is_named(tiny_case: Case) -> None:
    """`investigate metrics --port P` on a taken port said only "Address already in use"
    (a new user's trial)."""
    import socket

    from workers.metrics import serve_store

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}: "):
            serve_store(StoreCollector(tiny_case.store), port)


def test_metrics_ports_past_65535_are_usage_errors_and_ipv6_urls_are_bracketed() -> None:
    """`metrics --port 65536` was an internal error (OverflowError in bind), and
    `--address ::1` printed `http://::1:9808/metrics` (a hostile trial)."""
    from typer.testing import CliRunner

    from workers.cli import app
    from workers.cli_ops import _url_host

    for args in (["metrics", "--port", "65536"], ["worker", "--metrics-port", "70000"],
                 ["flower", "--port", "0"]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2 and "Invalid value" in res.output, (args, res.output)
    assert (_url_host("::1"), _url_host("127.0.0.1"), _url_host("[::1]")) == (
        "[::1]", "127.0.0.1", "[::1]")


def test_a_token_count_no_server_reported_is_a_question_mark_not_0() -> None:
    """A server that reported the completion count alone showed `tokens 0 + 3` in `run`,
    `steps` and the report's step table (a hostile trial)."""
    from investigation.loop.outcome import tokens_text
    from workers.views import facts_text

    assert tokens_text(None, None) == "" and tokens_text(None, 3) == "? + 3"
    assert tokens_text(7, 3) == "7 + 3"
    assert facts_text({"prompt_tokens": 7, "completion_tokens": None}) == "; tokens 7 + ?"
    assert facts_text({"prompt_tokens": 0, "completion_tokens": 2}) == "; tokens 0 + 2"


def test_run_ends_with_the_cases_model_usage() -> None:
    """A real model's user found the cost only in `status` and the report: `run` ends with
    the case's calls, tokens and cost as status totals them."""
    from workers.cli_run import _usage_line

    def entry(calls: int, prompt: int, completion: int, cost: int | None) -> dict[str, Any]:
        return {"calls": calls, "attempts": calls + 1, "prompt_tokens": prompt,
                "completion_tokens": completion, "prompt_tokens_reported": calls,
                "completion_tokens_reported": calls, "tokens_reported": calls,
                "cost_micros": cost}

    info = {"model_usage": {"currency": "EUR", "hypotheses": [
        entry(7, 21000, 400, 5_000), entry(5, 15210, 390, None)]}}
    assert _usage_line(info, "USD") == ("model usage: 12 call(s), 14 attempt(s), tokens "
                                        "36210 + 790, cost 0.005000 EUR")
    assert _usage_line({"model_usage": {"hypotheses": []}}, "USD") == ""
    unreported = {**entry(3, 0, 0, None), "prompt_tokens_reported": 0,
                  "completion_tokens_reported": 0, "tokens_reported": 0}
    assert _usage_line({"model_usage": {"hypotheses": [unreported]}}, "USD") == (
        "model usage: 3 call(s), 4 attempt(s), tokens not reported, cost not priced")
