"""A step's chain as Celery sends it (``workers.tasks.step_chain``)."""

from __future__ import annotations

import functools
import json
import operator

import pytest
from celery import chain

from workers import tasks

TOKEN = "9f1c2e7a5b3d4c8e"  # a lock token: only its first 8 characters are ever shown
PAYLOAD = {"case_id": "case-0123456789abcdef", "revision": 1, "step_seq": 3,
           "steps_left": 10, "mode": "distributed", "max_steps": None, "halt": None}


def test_the_chain_is_the_fold_of_its_signatures() -> None:
    built = tasks.step_chain(PAYLOAD, "token-1")
    # What `a | b | c` (chain() without keyword arguments) makes of the same signatures.
    folded = functools.reduce(operator.or_, [t.clone() for t in built.tasks])
    assert isinstance(built, chain)
    assert json.dumps(built, sort_keys=True) == json.dumps(folded, sort_keys=True)
    names = [t["task"] for t in built.tasks]
    assert names == [tasks.TASK_PREFIX + s for s in (*tasks.STAGES, "advance")]
    first = built.tasks[0]
    assert first.args == (PAYLOAD,) and first.kwargs == {"token": "token-1"}
    assert all(t.args == () for t in built.tasks[1:])
    # No error callback rides on the messages: a hard time limit is handed on by the
    # worker's request of each stage task (decision 133).
    assert not any("link_error" in t.options for t in built.tasks)
    assert all(type(tasks.app.tasks[n]).Request is tasks.StageRequest for n in names)
    assert built.tasks[1].options["argsrepr"] == tasks.describe(PAYLOAD, tasks.STAGES[1])


def test_a_chain_from_a_stage_starts_there() -> None:
    built = tasks.step_chain(PAYLOAD, "token-1", start="execute_tool")
    names = [t["task"] for t in built.tasks]
    start = tasks.STAGES.index("execute_tool")
    assert names == [tasks.TASK_PREFIX + s for s in (*tasks.STAGES[start:], "advance")]
    assert built.tasks[0].args == (PAYLOAD,)


def test_a_hard_time_limit_is_handed_on_once_by_the_stage_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from celery.canvas import Signature
    from celery.contrib.testing.mocks import TaskMessage

    sent: list[Signature] = []
    monkeypatch.setattr(Signature, "apply_async", lambda self, *a, **k: sent.append(self))
    name = tasks.TASK_PREFIX + "execute_tool"
    message = TaskMessage(name, id="task-7", args=(PAYLOAD,), kwargs={"token": TOKEN})
    request = tasks.StageRequest(message, app=tasks.app, task=tasks.app.tasks[name])
    request.on_timeout(True, 2.0)  # a soft limit is raised in the task, not handed on
    assert sent == []
    request.on_timeout(False, 3.0)
    assert len(sent) == 1
    # A chain enqueued before decision 133 also calls its error callback: not a second time.
    tasks.on_chain_error(request._context, tasks.TimeLimitExceeded(3.0), None)
    assert len(sent) == 1
    (handed,) = sent
    assert handed["task"] == tasks.time_limit.name
    ids = {k: PAYLOAD[k] for k in ("case_id", "revision", "step_seq", "steps_left",
                                   "max_steps", "mode")}
    assert handed.args == (ids, "execute_tool", 3.0)
    assert handed.kwargs == {"token": TOKEN}
    assert TOKEN not in handed.options["kwargsrepr"]


def test_a_hard_time_limit_of_a_message_without_a_payload_is_not_handed_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from celery.canvas import Signature

    sent: list[Signature] = []
    monkeypatch.setattr(Signature, "apply_async", lambda self, *a, **k: sent.append(self))
    tasks.hand_over_hard_limit("task-8", tasks.TASK_PREFIX + "validate", ("x",), {}, 3.0)
    tasks.hand_over_hard_limit("task-9", tasks.TASK_PREFIX + "dispatch", (PAYLOAD,), {}, 3.0)
    assert sent == []


def test_a_hand_over_that_cannot_be_published_is_logged_not_raised(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from celery.canvas import Signature
    from celery.contrib.testing.mocks import TaskMessage

    def unreachable(self: Signature, *args: object, **kwargs: object) -> None:
        raise ConnectionError("broker unreachable")

    monkeypatch.setattr(Signature, "apply_async", unreachable)
    name = tasks.TASK_PREFIX + "publish"
    message = TaskMessage(name, id="task-10", args=(PAYLOAD,), kwargs={"token": TOKEN})
    request = tasks.StageRequest(message, app=tasks.app, task=tasks.app.tasks[name])
    request.on_timeout(False, 3.0)  # does not raise into the worker's timer
    assert any("could not be handed on" in r.getMessage() for r in caplog.records)


def test_the_sweep_says_one_line_while_the_store_is_down(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The beat's sweep logged a whole traceback every interval while PostgreSQL refused
    connections (a fleet trial); it now logs one line and returns, for the next sweep."""
    from unittest import mock

    from sqlalchemy.exc import OperationalError

    down = OperationalError("SELECT 1", {}, Exception('database "x" is not currently '
                                                      "accepting connections\nDETAIL"))
    with mock.patch("workers.recovery.sweep", side_effect=down), \
            mock.patch("workers.runtime.current"):
        result = tasks.recover.apply().get()
    assert result == {"outcome": "REFUSED", "code": "STORE_UNAVAILABLE"}
    lines = [r.getMessage() for r in caplog.records if "recovery sweep" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "next sweep tries again" in lines[0]
