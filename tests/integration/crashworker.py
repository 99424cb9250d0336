"""A Celery app for tests: the real ``workers.celery_app`` with crash points injected.

Start it as ``celery -A tests.integration.crashworker worker ...``. The environment says
where to crash (nothing is injected without it):

* ``TEST_CRASH_POINT``: ``STEP:STAGE:PHASE``, e.g. ``2:execute_tool:pre_effect``.
  ``before``/``after`` are the stage's boundaries (before it starts; after it returned,
  its marker committed, before the message is acknowledged). ``pre_effect``/``post_effect``
  are inside the stage, around its external effect: the model call (``llm_call``, through
  ``LLMGateway.call``) or the snapshot query (``execute_tool``, ``ToolRouter.execute``).
* ``TEST_CRASH_MODE``: ``worker`` (SIGKILL the whole worker: main process and pool
  children, i.e. its process group), ``child`` (SIGKILL only the pool child running the
  task) or ``sleep:SECONDS`` (a slow stage).
* ``TEST_CRASH_ONCE``: a file path; the point fires only for whoever creates it first
  (``O_EXCL``), so a redelivery runs normally. Without it the point fires every time
  while the file ``TEST_CRASH_ENABLED`` (if set) exists.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from investigation.llm.gateway import LLMGateway
from investigation.tools.router import ToolRouter
from workers import tasks
from workers.celery_app import app

__all__ = ["app"]

_POINT = os.environ.get("TEST_CRASH_POINT", "")
_MODE = os.environ.get("TEST_CRASH_MODE", "worker")
_ONCE = os.environ.get("TEST_CRASH_ONCE")
_ENABLED = os.environ.get("TEST_CRASH_ENABLED")
_current: dict[str, Any] = {}


def _fire(step: int, stage: str, phase: str) -> None:
    if not _POINT or f"{step}:{stage}:{phase}" != _POINT:
        return
    if _ENABLED and not os.path.exists(_ENABLED):
        return
    if _ONCE:
        try:
            os.close(os.open(_ONCE, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    print(f"CRASHPOINT {step}:{stage}:{phase} mode={_MODE}", flush=True)
    if _MODE.startswith("sleep:"):
        time.sleep(float(_MODE.split(":", 1)[1]))
    elif _MODE == "child":
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        os.killpg(os.getpgrp(), signal.SIGKILL)


if _POINT:
    _run_stage = tasks._run_stage

    def _run_stage_with_crashes(task: Any, payload: dict[str, Any], stage: str,
                                token: str | None = None) -> Any:
        if payload.get("halt"):
            return _run_stage(task, payload, stage, token)
        step = int(payload["step_seq"])
        _current.update(step=step, stage=stage)
        _fire(step, stage, "before")
        out = _run_stage(task, payload, stage, token)
        _fire(step, stage, "after")
        return out

    tasks._run_stage = _run_stage_with_crashes

    _call = LLMGateway.call
    _execute = ToolRouter.execute

    def _call_with_crashes(self: Any, *args: Any, **kwargs: Any) -> Any:
        _fire(_current.get("step", 0), _current.get("stage", ""), "pre_effect")
        out = _call(self, *args, **kwargs)
        _fire(_current.get("step", 0), _current.get("stage", ""), "post_effect")
        return out

    def _execute_with_crashes(self: Any, *args: Any, **kwargs: Any) -> Any:
        _fire(_current.get("step", 0), _current.get("stage", ""), "pre_effect")
        out = _execute(self, *args, **kwargs)
        _fire(_current.get("step", 0), _current.get("stage", ""), "post_effect")
        return out

    LLMGateway.call = _call_with_crashes  # type: ignore[method-assign]
    ToolRouter.execute = _execute_with_crashes  # type: ignore[method-assign]
