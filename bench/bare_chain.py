"""Baseline for bench/step_overhead.py: a chain of eight trivial Celery tasks plus a tail.

The app takes the engine's Celery settings (late acks, reject on worker lost, prefetch 1,
JSON only, ignored results, events) from ``workers.celery_app.make_app`` for the same
``INVESTIGATE_BROKER_URL`` (queue ``BENCH_BARE_QUEUE``, else ``INVESTIGATE_QUEUE``), but
registers only these tasks. Each
stage passes its payload of ids through; the tail, like ``advance``, is the ninth task of
the chain and reports completion by pushing the payload's ``id`` onto a Redis list.

Worker: ``python -m celery -A bench.bare_chain:app worker -Q $BENCH_BARE_QUEUE ...``
(from the repository root).
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery, chain

from workers.celery_app import make_app
from workers.settings import Settings

#: The engine's Celery settings this baseline shares (everything ``make_app`` sets).
SHARED_KEYS = (
    "task_serializer", "result_serializer", "accept_content", "task_acks_late",
    "task_reject_on_worker_lost", "worker_prefetch_multiplier", "task_default_queue",
    "task_queues", "task_ignore_result", "task_store_errors_even_if_ignored",
    "broker_transport_options", "broker_connection_retry_on_startup",
    "worker_hijack_root_logger", "task_track_started", "worker_send_task_events",
    "task_send_sent_event",
)
DONE_KEY = "bench:bare:done"
N_STAGES = 8

_queue = os.environ.get("BENCH_BARE_QUEUE")
settings = Settings(queue=_queue) if _queue else Settings()
_engine = make_app(settings)
app = Celery("bench_bare", broker=settings.broker_url, set_as_current=False)
app.conf.update({k: _engine.conf[k] for k in SHARED_KEYS})
_engine.close()

_client: redis.Redis | None = None


def _redis() -> redis.Redis:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(settings.effective_redis_url)
    return _client


def _make_stage(i: int) -> Any:
    @app.task(name=f"bench.stage{i}")  # type: ignore[untyped-decorator]
    def stage(payload: dict[str, Any]) -> dict[str, Any]:
        return payload

    return stage


STAGE_TASKS = [_make_stage(i) for i in range(1, N_STAGES + 1)]


@app.task(name="bench.tail")  # type: ignore[untyped-decorator]
def tail(payload: dict[str, Any]) -> dict[str, Any]:
    """The advance-like ninth task: report that the chain is done."""
    _redis().rpush(DONE_KEY, payload["id"])
    return payload


def bare_chain(payload: dict[str, Any]) -> Any:
    """Eight pass-through stages and the tail, shaped like one engine step."""
    first, *rest = STAGE_TASKS
    return chain(first.s(payload), *(t.s() for t in rest), tail.s())
