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
    settings = settings or Settings()
    app = Celery("investigation", broker=settings.broker_url, include=["workers.tasks"])
    app.conf.update(
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
    )
    return app


app = make_app()
