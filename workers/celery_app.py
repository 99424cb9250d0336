"""The Celery application (DESIGN.md "Runtimes").

At-least-once settings: late acks, reject on worker lost, prefetch 1, JSON only, and a
broker visibility timeout longer than any countdown the engine schedules
(``INVESTIGATE_MAX_COUNTDOWN_S`` < ``INVESTIGATE_VISIBILITY_TIMEOUT_S``, checked at load).
Task arguments carry ids only: never prompts, snapshot contents or secrets.

Redelivery after a whole worker dies (kill -9, host loss): its unacknowledged messages stay
in Redis (``unacked`` hash, ``unacked_index`` sorted by delivery time) until some worker's
``QoS.restore_visible`` finds them older than the visibility timeout. kombu runs that scan
every ``unacked_restore_interval`` seconds but only scans on every
``unacked_restore_throttle``-th call (defaults 10 and 10: about 100 s between real scans).
We set the interval from ``INVESTIGATE_RESTORE_INTERVAL_S`` and the throttle to 1, so a
killed worker's stage is redelivered within ``visibility_timeout_s + restore_interval_s``
while any worker of the queue runs (kombu/transport/redis.py, ``register_with_event_loop``
and ``QoS.restore_visible``).

The beat schedule holds one periodic task, ``investigation.recover`` (the recovery sweep,
``workers/recovery.py``), every ``INVESTIGATE_SWEEP_INTERVAL_S`` seconds.
"""

from __future__ import annotations

import os
from contextlib import suppress
from typing import Any

from celery import Celery
from celery.signals import (
    celeryd_init,
    setup_logging,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
)
from celery.worker.control import inspect_command
from kombu import Queue  # type: ignore[attr-defined]

from investigation.constants import TASK_PREFIX
from workers import logs
from workers.settings import Settings, load_settings


def make_app(settings: Settings | None = None) -> Celery:
    """Build the Celery app for ``settings`` (environment by default)."""
    app = Celery("investigation", include=["workers.tasks"])
    configure(settings or load_settings(), app)
    return app


def transport_options(settings: Settings) -> dict[str, Any]:
    """kombu Redis transport options: visibility timeout and a bounded restore scan.

    ``unacked_mutex_expire`` bounds how long a worker killed inside a restore scan can
    stop the others' scans (kombu's default is 300 s).
    """
    return {
        "visibility_timeout": settings.visibility_timeout_s,
        "unacked_restore_interval": settings.restore_interval_s,
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": max(10, min(300, settings.visibility_timeout_s)),
    }


#: Seconds a command of the shell (``dispatch``, ``recover``) waits for one answer of the
#: broker before it gives up with ``BROKER_UNAVAILABLE``.
SHELL_BROKER_TIMEOUT_S = 10.0


def bound_broker_reads(timeout_s: float | None = None, target: Celery | None = None) -> None:
    """Bound each read from the broker of ``target`` (default: ``app``) to ``timeout_s``
    seconds (default :data:`SHELL_BROKER_TIMEOUT_S`; kombu's ``socket_timeout``), for a
    shell's command after :func:`configure`: a broker that took the connection and never
    answered held ``dispatch`` forever with the case's lock (a hostile trial). Workers
    keep kombu's default; their consuming connection has its own checks
    (``health_check_interval``)."""
    target = target if target is not None else app
    target.conf.broker_transport_options = {
        **(target.conf.broker_transport_options or {}),
        "socket_timeout": SHELL_BROKER_TIMEOUT_S if timeout_s is None else timeout_s}


def _guarded_transport(broker_url: str) -> str | None:
    """``workers.broker:Transport`` for a ``redis://`` broker, else kombu's own (None)."""
    return "workers.broker:Transport" if broker_url.startswith("redis://") else None


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """The periodic recovery sweep (empty when ``sweep_interval_s`` is 0)."""
    if settings.sweep_interval_s <= 0:
        return {}
    return {"recovery-sweep": {
        "task": f"{TASK_PREFIX}recover",
        "schedule": float(settings.sweep_interval_s),
        # A sweep that waited longer than one period is superseded by the next one.
        "options": {"expires": float(settings.sweep_interval_s)},
    }}


def configure(settings: Settings, target: Celery | None = None) -> None:
    """Point ``target`` (default: the module's ``app``, to which the tasks are bound) at
    ``settings``: broker, queue, visibility timeout. A producer in a process that imported
    this module before its environment was set uses this instead of a second app.
    """
    target = target if target is not None else app
    target.conf.update(
        broker_url=settings.broker_url,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=settings.queue,
        task_queues=[Queue(settings.queue)],
        task_ignore_result=True,
        task_store_errors_even_if_ignored=False,
        broker_transport_options=transport_options(settings),
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        task_track_started=True,
        worker_send_task_events=True,
        task_send_sent_event=True,
        # Malformed messages on the queue are dropped with one error line instead of
        # stopping the worker (workers.broker); the guarded transport is kombu's Redis
        # transport, so only for redis:// brokers.
        broker_transport=_guarded_transport(settings.broker_url),
        worker_consumer="workers.broker:Consumer",
        worker_max_memory_per_child=settings.worker_max_memory_kib,
        worker_soft_shutdown_timeout=settings.soft_shutdown_s,
        beat_schedule=beat_schedule(settings),
        # `investigate beat` and a worker's --beat alike leave a heartbeat for `health`.
        beat_scheduler="workers.beat:Scheduler",
    )
    # Drop cached producer state; kombu keeps pools in a process-wide registry, so the
    # old pool is left alone rather than closed.
    target._pool = None
    target.__dict__.pop("amqp", None)


@setup_logging.connect
def _setup_logging(loglevel: Any = None, **_: Any) -> None:
    """Celery leaves logging to us (its documented ``setup_logging`` signal): timestamps,
    the step context and ``INVESTIGATE_LOG_FORMAT`` for worker and beat alike."""
    try:
        fmt = load_settings().log_format
    except Exception:  # broken settings are reported where they are used
        fmt = "text"
    logs.setup(fmt, loglevel or "INFO")


@celeryd_init.connect
def _worker_name(sender: Any = None, **_: Any) -> None:
    """Every line a worker (and its pool children) logs names the node (``name@host``);
    a worker, and no other process, restores unacknowledged messages (decision 183)."""
    from workers.broker import restore_unacked

    logs.set_worker_name(str(sender) if sender else None)
    restore_unacked(True)


#: ``settings.deployment_identity`` as this worker's main process read it at start. Its
#: pool children read the same paths when they build their runtime (at their first task;
#: a child replaced under ``worker_max_memory_per_child`` at its own), so a file edited
#: since this moment is reported as changed (``policy_now``/``providers_now``) until the
#: worker restarts.
_started_identity: dict[str, str] | None = None


@worker_init.connect
def _preload(**_: Any) -> None:
    """The worker's main process, before its pool forks (``workers.runtime.preload``);
    it also notes the digests of the files the worker starts with."""
    global _started_identity
    from workers.runtime import preload
    from workers.settings import deployment_identity

    with suppress(Exception):  # broken settings were refused by `investigate worker`
        _started_identity = deployment_identity(load_settings())
    preload()


@inspect_command()
def investigation_identity(state: Any) -> dict[str, str]:
    """Remote control (``inspect``): this worker's ``settings.deployment_identity`` as it
    read it at start (its store, lock Redis and policy/providers digests; no credentials),
    plus ``policy_now``/``providers_now``, the digests of those files on disk now, which
    ``health`` compares across the workers of a queue. A fleet trial edited the providers
    file and restarted one worker: every worker hashed the same file at the check, so
    ``health`` stayed green while two of them still used the old content."""
    from workers.settings import deployment_identity

    now = deployment_identity(load_settings())
    started = _started_identity or now
    return {**started, "policy_now": now["policy"], "providers_now": now["providers"]}


@worker_process_init.connect
def _child_metrics(**_: Any) -> None:
    from workers import metrics

    metrics.close_inherited_server()


@worker_process_shutdown.connect
def _child_exit(pid: int | None = None, **_: Any) -> None:
    from workers import metrics

    metrics.process_exited(pid or os.getpid())


app = make_app()
