"""A step's chain as Celery sends it (``workers.tasks.step_chain``)."""

from __future__ import annotations

import functools
import json
import operator

from celery import chain

from workers import tasks

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
    assert all(t.options["link_error"][0]["task"] == tasks.on_chain_error.name
               for t in built.tasks)
    assert built.tasks[1].options["argsrepr"] == tasks.describe(PAYLOAD, tasks.STAGES[1])


def test_a_chain_from_a_stage_starts_there() -> None:
    built = tasks.step_chain(PAYLOAD, "token-1", start="execute_tool")
    names = [t["task"] for t in built.tasks]
    start = tasks.STAGES.index("execute_tool")
    assert names == [tasks.TASK_PREFIX + s for s in (*tasks.STAGES[start:], "advance")]
    assert built.tasks[0].args == (PAYLOAD,)
