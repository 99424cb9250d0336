"""Prometheus metrics (prometheus_client), correct under prefork workers.

Two endpoints (``docs/operations.md`` "Metrics"):

* every worker started with ``investigate worker --metrics-port P`` serves what its
  processes did: steps by outcome, stage durations, model calls (duration, outcome,
  tokens), investigation units spent and refunded. Prefork children each write their own
  files in ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode); the
  worker's main process serves them summed by ``MultiProcessCollector``. The directory is
  wiped when the worker starts, as prometheus_client requires.
* ``investigate metrics --port P`` (one per deployment) serves gauges computed from the
  SQL store at scrape time (:class:`StoreCollector`): cases by state, blocked cases by
  reason, pending retries and how overdue the oldest is, the oldest idle case, and the
  case queue's depth in the broker.

Counting rules: a stage replayed after a redelivery (its recorded output returned) counts
its duration but no model call, token or unit a second time; a step is counted once, by
the ``advance`` task that ends it (a redelivered ``advance`` can count it twice).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_wsgi_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import bindparam
from sqlalchemy import select as sa_select

from investigation.constants import OUTCOMES
from investigation.overview import fleet_counts
from investigation.store.engine import Store, table_of
from investigation.store.models import LLMAttempt, LLMOperation

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: Buckets of model-call durations (seconds): local servers answer in tenths, hosted
#: models in tens of seconds, a provider timeout is 60 s by default.
MODEL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass
class _Metrics:
    steps: Counter
    stage_seconds: Histogram
    stages_running: Gauge
    model_seconds: Histogram
    model_calls: Counter
    tokens: Counter
    units_spent: Counter
    units_refunded: Counter


_metrics: _Metrics | None = None
_lock = threading.Lock()
_server: Any = None


def metrics() -> _Metrics:
    """The engine's metric objects, created on first use in this process (after
    ``PROMETHEUS_MULTIPROC_DIR`` is set, so prefork children write their own files)."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = _Metrics(
                steps=Counter("investigation_steps", "Steps ended, by scheduling outcome "
                              "(PROGRESSED, BLOCKED, ...; ERROR for a controlled error) and "
                              "reason code", ["outcome", "reason"]),
                stage_seconds=Histogram(
                    "investigation_stage_duration_seconds",
                    "Wall time of one stage task, by stage and result (ok: the stage "
                    "finished; halt: it ended the step; error; retry: the store was "
                    "unavailable; replay: a recorded stage returned its output)",
                    ["stage", "result"], buckets=STAGE_BUCKETS),
                stages_running=Gauge("investigation_stages_in_progress",
                                     "Stage tasks running now", ["stage"],
                                     multiprocess_mode="livesum"),
                model_seconds=Histogram(
                    "investigation_model_call_duration_seconds",
                    "Duration of one model request (one attempt), by provider and status",
                    ["provider", "status"], buckets=MODEL_BUCKETS),
                model_calls=Counter(
                    "investigation_model_calls",
                    "Model requests by provider, status (succeeded/failed) and error code",
                    ["provider", "status", "code"]),
                tokens=Counter("investigation_model_tokens",
                               "Tokens the providers reported, by provider and kind "
                               "(prompt/completion)", ["provider", "kind"]),
                units_spent=Counter("investigation_units_spent",
                                    "Investigation units reserved for actions (charges)"),
                units_refunded=Counter("investigation_units_refunded",
                                       "Investigation units refunded on settlement"),
            )
        return _metrics


def enable_multiprocess(directory: Path) -> Path:
    """Use prometheus_client's multiprocess mode with ``directory`` (wiped, then created).

    Call before any metric is used in this process and before the pool forks.

    Raises:
        RuntimeError: metrics were already used in this process in single-process mode.
    """
    if _metrics is not None and os.environ.get(MULTIPROC_ENV) != str(directory):
        raise RuntimeError("metrics were used before multiprocess mode was enabled")
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True, exist_ok=True)
    os.environ[MULTIPROC_ENV] = str(directory)
    from prometheus_client import values

    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]  # in case prometheus_client was imported
    return directory


def serve_worker(port: int, address: str = "127.0.0.1") -> int:
    """Serve this worker's metrics on ``address:port`` (0: a free port); returns the port.

    In multiprocess mode the registry is a fresh one holding ``MultiProcessCollector``
    (the documented set-up); otherwise the process's default registry.

    Raises:
        OSError: the address and port cannot be served (named in the message).
    """
    global _server
    registry: CollectorRegistry = REGISTRY
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    try:
        _server, _thread = start_wsgi_server(port, address, registry)
    except OSError as exc:  # the port is taken, or the address is not this host's
        raise OSError(exc.errno, f"cannot serve metrics on {address}:{port}: "
                                 f"{exc.strerror or exc}") from exc
    return int(_server.server_port)


def close_inherited_server() -> None:
    """In a forked pool child: close the metrics socket inherited from the main process."""
    if _server is not None:
        _server.socket.close()


def process_exited(pid: int) -> None:
    """Drop a dead process's live gauges (prometheus_client ``mark_process_dead``)."""
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


# -- what the tasks record ---------------------------------------------------------------


#: What a step's outcome and reason labels may be: the engine's own codes (a message on
#: the broker could carry anything, and every new label value is a new series).
_OUTCOMES = frozenset({*OUTCOMES, "ERROR", "STALE", "LOCK_LOST"})
_CODE = re.compile(r"[A-Z][A-Z0-9_]{0,63}")


def step_ended(outcome: str, reason: str | None) -> None:
    """Count a step's end (labels bounded to the engine's codes; anything else ``OTHER``)."""
    shown = outcome if outcome in _OUTCOMES else "OTHER"
    why = reason if reason is None or (isinstance(reason, str) and _CODE.fullmatch(reason)) \
        else "OTHER"
    metrics().steps.labels(shown, why or "").inc()


def stage_timed(stage: str, result: str, seconds: float) -> None:
    metrics().stage_seconds.labels(stage, result).observe(seconds)


def stage_running(stage: str) -> Gauge:
    return metrics().stages_running.labels(stage)


_ATT = table_of(LLMAttempt).c
_OP = table_of(LLMOperation).c
# Read-backs built once, run on a read-only connection (``Store.reading``): no write lock
# on SQLite, no transaction round trips on PostgreSQL.
_ATTEMPTS_SINCE = sa_select(
    _ATT.provider, _ATT.status, _ATT.error_code, _ATT.started_at, _ATT.finished_at,
    _ATT.prompt_tokens, _ATT.completion_tokens,
).join_from(table_of(LLMAttempt), table_of(LLMOperation), _ATT.operation_id == _OP.id).where(
    _OP.case_id == bindparam("case_id"), _OP.revision == bindparam("revision"),
    _OP.step_seq == bindparam("step_seq"), _ATT.started_at >= bindparam("since"))


def record_model_calls(store: Store, case_id: str, revision: int, step_seq: int,
                       since: datetime) -> None:
    """Observe the model requests of one step that were sent at or after ``since``
    (by this ``llm_call`` delivery): durations, outcomes and tokens."""
    m = metrics()
    with store.reading() as conn:
        attempts = conn.execute(_ATTEMPTS_SINCE, {
            "case_id": case_id, "revision": revision, "step_seq": step_seq,
            "since": since}).all()
    for provider, status, error_code, started_at, finished_at, prompt, completion in attempts:
        status = status if status in ("succeeded", "failed") else "unfinished"
        m.model_calls.labels(provider, status, error_code or "").inc()
        if finished_at is not None:
            seconds = (_naive(finished_at) - _naive(started_at)).total_seconds()
            m.model_seconds.labels(provider, status).observe(max(0.0, seconds))
        if prompt:
            m.tokens.labels(provider, "prompt").inc(prompt)
        if completion:
            m.tokens.labels(provider, "completion").inc(completion)


def record_settlement(output: dict[str, Any]) -> None:
    """Count the units one ``settle_reserve`` charged and refunded; the caller passes
    only an output this delivery recorded (``StageResult.fresh``: a replayed stage counts
    nothing)."""
    spent = int(output.get("reserved_units") or 0)
    refunded = int(output.get("refund_units") or 0)
    m = metrics()
    if spent > 0:
        m.units_spent.inc(spent)
    if refunded > 0:
        m.units_refunded.inc(refunded)


def _naive(value: datetime) -> datetime:
    """UTC without tzinfo (SQLite returns naive UTC, PostgreSQL aware)."""
    return value if value.tzinfo is None else value.astimezone(UTC).replace(tzinfo=None)


# -- the store exporter ------------------------------------------------------------------


class StoreCollector(Collector):
    """Gauges computed from the SQL store (and the broker's queue) at each scrape.

    Args:
        store: the SQL store (read only).
        queue_depth: returns the number of messages waiting in the case queue, or ``None``
            when the broker cannot be asked (then the gauge is left out).
        queue: the case queue's name (a label).
    """

    def __init__(self, store: Store, queue_depth: Any = None, queue: str = "cases") -> None:
        self.store = store
        self.queue_depth = queue_depth
        self.queue = queue

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())  # computed at scrape time; no registration-time query

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily("investigation_store_up",
                               "1 when the store answered this scrape, 0 when it did not")
        try:
            counts = fleet_counts(self.store)
        except Exception:  # the store is down: say so instead of failing the scrape
            up.add_metric([], 0)
            yield up
            yield from self._queue()
            return
        up.add_metric([], 1)
        yield up
        by_state = GaugeMetricFamily("investigation_cases", "Cases by state",
                                     labels=["state"])
        for state, n in sorted(counts.cases_by_state.items()):
            by_state.add_metric([state], n)
        yield by_state
        blocked = GaugeMetricFamily("investigation_blocked_cases",
                                    "Blocked cases by blocked reason", labels=["reason"])
        for reason, n in sorted(counts.blocked_by_reason.items()):
            blocked.add_metric([reason], n)
        yield blocked
        yield GaugeMetricFamily("investigation_pending_retries",
                                "Investigating cases waiting for a provider backoff",
                                value=counts.pending_retries)
        yield GaugeMetricFamily(
            "investigation_oldest_pending_retry_overdue_seconds",
            "Seconds since the oldest pending retry became due without running (0: none)",
            value=counts.oldest_retry_overdue_s)
        yield GaugeMetricFamily(
            "investigation_oldest_idle_case_seconds",
            "Seconds since the least recently changed investigating case (not waiting for "
            "a backoff) last moved; a stuck dispatch makes it grow",
            value=counts.oldest_idle_s)
        yield from self._queue()

    def _queue(self) -> Iterator[GaugeMetricFamily]:
        if self.queue_depth is None:
            return
        try:
            depth = self.queue_depth()
        except Exception:
            return
        if depth is not None:
            family = GaugeMetricFamily("investigation_queue_messages",
                                       "Messages waiting in the case queue (broker)",
                                       labels=["queue"])
            family.add_metric([self.queue], depth)
            yield family


def serve_store(collector: StoreCollector, port: int, address: str = "127.0.0.1") -> Any:
    """Serve ``collector`` on ``address:port`` (0: a free port); returns the WSGI server.

    Raises:
        OSError: the address and port cannot be served (named in the message: `metrics`
            said only "Address already in use", a new user's trial).
    """
    registry = CollectorRegistry()
    registry.register(collector)
    try:
        server, _thread = start_wsgi_server(port, address, registry)
    except OSError as exc:  # the port is taken, or the address is not this host's
        raise OSError(exc.errno, f"cannot serve metrics on {address}:{port}: "
                                 f"{exc.strerror or exc}") from exc
    return server
