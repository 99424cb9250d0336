"""The Celery application (DESIGN.md "Runtimes").

At-least-once settings: late acks, reject on worker lost, prefetch 1, JSON only, and a
broker visibility timeout longer than any countdown the engine schedules
(``INVESTIGATE_MAX_COUNTDOWN_S`` < ``INVESTIGATE_VISIBILITY_TIMEOUT_S``, checked at load).
Task arguments carry ids only: never prompts, snapshot contents or secrets.
"""

from __future__ import annotations

from celery import Celery
from kombu import Queue  # type: ignore[attr-defined]

from workers.settings import Settings


def make_app(settings: Settings | None = None) -> Celery:
    """Build the Celery app for ``settings`` (environment by default)."""
    app = Celery("investigation", include=["workers.tasks"])
    configure(settings or Settings(), app)
    return app


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
        broker_transport_options={"visibility_timeout": settings.visibility_timeout_s},
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        task_track_started=True,
        worker_send_task_events=True,
        task_send_sent_event=True,
        worker_max_memory_per_child=settings.worker_max_memory_kib,
    )
    # Drop cached producer state; kombu keeps pools in a process-wide registry, so the
    # old pool is left alone rather than closed.
    target._pool = None
    target.__dict__.pop("amqp", None)


app = make_app()
