"""A worker survives malformed messages on its queue.

Anyone who can write to the broker can push any bytes onto the case queue
(``docs/message-contract.md``: upstream systems speak Celery's message protocol 2 over
Redis). Celery and kombu already log and drop most malformed messages (an unknown task,
a body their serializer cannot decode, a content type the worker does not accept); three
kinds escaped them and stopped the worker with "Unrecoverable error", one of them for
every restart:

* a queue item that is not a JSON envelope, or whose envelope is not kombu's (kombu's
  Redis channel decodes it inside its ``BRPOP`` reader);
* an envelope whose body is not the base64 it declares (decoded when kombu builds the
  message, before it is handed to Celery);
* a protocol-2 message whose body is JSON but not ``[args, kwargs, embed]`` (Celery's
  strategy unpacks it after the message was reserved: the worker died holding it, and
  the broker restored it to the queue for the next worker, which died in turn).

:class:`Transport` (the worker's ``broker_transport`` for ``redis://`` brokers, set by
``workers.celery_app.configure``) drops the first two with one error line; the item was
already taken off the queue, and nothing was reserved. :class:`Consumer` (the worker's
``worker_consumer``) rejects the third without requeueing it, with one error line. Both
log ``broker message refused: MESSAGE_INVALID: ...`` with the reason (escaped, bounded)
and never the message's bytes beyond a short, escaped excerpt. Errors of the connection
itself still propagate, so the worker reconnects as before.
"""

from __future__ import annotations

import binascii
import functools
import logging
from datetime import UTC, datetime
from typing import Any

from celery.worker.consumer.consumer import Consumer as CeleryConsumer
from kombu.transport import redis as kombu_redis
from vine import promise

from investigation.text_safety import escape_text

log = logging.getLogger(__name__)

#: What decoding a malformed queue item raises (JSON and base64 errors, text that is not
#: UTF-8, an envelope of the wrong shape).
MALFORMED = (ValueError, TypeError, KeyError, AttributeError, binascii.Error)
#: Characters of a refusal's reason shown in the log line.
REASON_CHARS = 200


def _refused(where: str, exc: BaseException) -> None:
    log.error("broker message refused: MESSAGE_INVALID: %s (%s: %s); it was dropped and "
              "nothing ran", where, type(exc).__name__, escape_text(str(exc))[:REASON_CHARS])


class Channel(kombu_redis.Channel):
    """kombu's Redis channel whose ``BRPOP`` reader drops an item it cannot decode."""

    def _brpop_read(self, **options: Any) -> Any:
        try:
            return super()._brpop_read(**options)  # type: ignore[no-untyped-call]
        except self.connection_errors:
            raise
        except MALFORMED as exc:
            _refused("a queue item that is not a kombu message envelope", exc)
            return True


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with :class:`Channel` (``redis://`` URLs)."""

    Channel = Channel


#: Clock skew between the host that sent a message and the worker, allowed beyond the
#: longest countdown (seconds).
ETA_SKEW_S = 60.0


def _eta_beyond_countdown(headers: dict[str, Any]) -> str | None:
    """The ``eta`` of a protocol-2 message when it lies further ahead than any task of
    the engine schedules (``INVESTIGATE_MAX_COUNTDOWN_S`` plus :data:`ETA_SKEW_S`), or
    when it is not a time at all; ``None`` for a message to run now or soon.

    A worker keeps a message with an ``eta`` in memory, unacknowledged, until then; past
    the visibility timeout the broker delivers it again, so a few far-future dispatches
    pile up without bound (a fleet trial: 40 messages with a countdown of 10^8 s)."""
    eta = headers.get("eta")
    if eta is None:
        return None
    try:
        when = datetime.fromisoformat(str(eta))
    except ValueError:
        return str(eta)
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    ahead = (when - datetime.now(UTC)).total_seconds()
    return str(eta) if ahead > max_countdown_s() + ETA_SKEW_S else None


@functools.lru_cache(maxsize=1)
def max_countdown_s() -> float:
    """``INVESTIGATE_MAX_COUNTDOWN_S`` of this worker (read once)."""
    from workers.settings import load_settings

    return float(load_settings().max_countdown_s)


class Consumer(CeleryConsumer):  # type: ignore[misc]
    """Celery's consumer whose task handler rejects, without requeueing, a message that
    its strategy cannot turn into a request (a protocol-2 body that is not ``[args,
    kwargs, embed]``)."""

    def create_task_handler(self, promise: Any = promise) -> Any:
        handle = super().create_task_handler(promise)
        passed = tuple(self.connection_errors or ()) + tuple(self.channel_errors or ())

        def on_task_received(message: Any) -> Any:
            headers = getattr(message, "headers", None)
            headers = headers if isinstance(headers, dict) else {}
            task = headers.get("task")
            too_late = _eta_beyond_countdown(headers)
            if too_late is not None:
                log.error("broker message refused: MESSAGE_INVALID: task message %s is to "
                          "run at %s, beyond INVESTIGATE_MAX_COUNTDOWN_S from now; it was "
                          "dropped and nothing ran (a worker would hold it in memory, and "
                          "the broker deliver it again, every visibility timeout)",
                          escape_text(repr(task))[:80], escape_text(str(too_late))[:40])
                if not message.acknowledged:
                    message.reject_log_error(log, self.connection_errors, requeue=False)
                return None
            try:
                return handle(message)
            except passed:
                raise
            except Exception as exc:
                _refused(f"task message {escape_text(repr(task))[:80]} whose body is not "
                         "[args, kwargs, embed]", exc)
                if not message.acknowledged:
                    message.reject_log_error(log, self.connection_errors, requeue=False)
                return None

        return on_task_received
