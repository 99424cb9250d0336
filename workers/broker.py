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
already taken off the queue, and nothing was reserved. Its :class:`Message` also drops an
envelope without ``properties`` (kombu's ``KeyError`` for it counts among the Redis
transport's connection errors: the worker reconnected for each such item) and a
compressed one, before kombu inflates it without a bound (decision 159).
:class:`Consumer` (the worker's ``worker_consumer``) rejects the third without
requeueing it, with one error line, and so logs what Celery's own handlers logged with
tracebacks: an unknown task name, a content type the worker does not accept, invalid
headers (an ``expires`` that is no time), a body that cannot be decoded. All log
``broker message refused: MESSAGE_INVALID: ...`` with the reason (escaped, bounded) and
never the message's bytes beyond a short, escaped excerpt. Errors of the connection
itself still propagate, so the worker reconnects as before.
"""

from __future__ import annotations

import binascii
import functools
import logging
from datetime import UTC, datetime
from typing import Any

from celery import signals
from celery.worker.consumer.consumer import Consumer as CeleryConsumer
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual as kombu_virtual
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


class EnvelopeInvalid(ValueError):
    """A queue item that is JSON but not a message envelope the engine takes. A
    ``ValueError``, so the readers drop it (:data:`MALFORMED`); kombu's own ``KeyError``
    for a missing key counts among its Redis *connection* errors, and the worker
    reconnected for every such item (a hostile-input trial)."""


class Message(kombu_virtual.Message):
    """kombu's transport message, refusing what it cannot take before decoding anything:
    an envelope without ``properties`` or ``delivery_tag``, and a compressed body
    (``headers.compression``: the engine never compresses, and kombu would inflate it
    without a bound, 272 KB into 400 MB in the trial)."""

    def __init__(self, payload: Any, channel: Any = None, **kwargs: Any) -> None:
        if not isinstance(payload, dict):
            raise EnvelopeInvalid(f"a JSON {type(payload).__name__}, not an object")
        properties = payload.get("properties")
        if not isinstance(properties, dict) or "delivery_tag" not in properties:
            raise EnvelopeInvalid("no properties with a delivery_tag")
        headers = payload.get("headers")
        if headers is not None and not isinstance(headers, dict):
            raise EnvelopeInvalid("headers that are not an object")
        compression = (headers or {}).get("compression")
        if compression is not None:
            raise EnvelopeInvalid(f"a compressed body (compression {str(compression)[:40]!r});"
                                  " the engine takes plain JSON bodies only")
        super().__init__(payload, channel=channel, **kwargs)  # type: ignore[no-untyped-call]


#: Whether this process gives unacknowledged messages back to their queue: only a worker
#: (:func:`restore_unacked`, at its start). See :class:`QoS`.
_restores = False


def restore_unacked(enabled: bool = True) -> None:
    """Let this process's Redis channels restore messages whose delivery outlived the
    visibility timeout (a worker's main process, from ``celeryd_init``); every other
    process (a shell's ``recover`` or ``health``, ``investigate flower``) never does."""
    global _restores
    _restores = enabled


class QoS(kombu_redis.QoS):
    """kombu's Redis QoS that restores unacknowledged messages in workers only
    (decision 183).

    kombu restores, from any client that drains replies or events on the broker, every
    message of the broker's database delivered longer ago than *that client's*
    ``visibility_timeout``: a shell's ``recover`` (its ``inspect`` and ``ping``), a
    ``health`` check or Flower, run with a shorter timeout than the workers', put a stage
    that a live worker was still running back on the queue, and a second worker ran it
    (a test saw a slow query's step completed by the copy while the first delivery
    slept). Workers share one setting; a message of a worker that died still comes back
    through the live workers' scans."""

    def restore_visible(self, *args: Any, **kwargs: Any) -> Any:
        if not _restores:
            return None
        return super().restore_visible(*args, **kwargs)  # type: ignore[no-untyped-call]


class Channel(kombu_redis.Channel):
    """kombu's Redis channel whose ``BRPOP`` reader drops an item it cannot decode, and
    whose :class:`QoS` restores unacknowledged messages in workers only."""

    Message = Message
    QoS = QoS

    def _brpop_read(self, **options: Any) -> Any:
        try:
            return super()._brpop_read(**options)  # type: ignore[no-untyped-call]
        except self.connection_errors:
            raise
        except MALFORMED as exc:
            _refused("a queue item that is not a kombu message envelope", exc)
            return True

    def _deliver_fanout_message(self, message: Any, exchange: str) -> bool:
        """A broadcast (remote control, events) takes :class:`Message` as well: one that
        it refuses is dropped here, never the end of the worker (kombu only catches a
        body that is not JSON on this path; a code review made one PUBLISH stop every
        worker of a fleet)."""
        try:
            deliver: Any = super()._deliver_fanout_message  # kombu's, untyped
            return bool(deliver(message, exchange))
        except self.connection_errors:
            raise
        except MALFORMED as exc:
            _refused(f"a broadcast message on {escape_text(exchange)[:60]!r} that is not a "
                     "kombu message envelope", exc)
        # Nothing delivered; not kombu's Empty, which would leave the messages read with
        # this one waiting in the client's buffer until the next broadcast arrives.
        return False


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


def _is_time(value: str) -> bool:
    """Whether an ``eta`` header reads as an ISO 8601 time."""
    try:
        datetime.fromisoformat(value)
    except ValueError:
        return False
    return True


#: Most ``retries`` a message may say it went through (the engine's stage retries stop
#: long before; a larger count is no message of the engine).
MAX_RETRIES = 10_000
#: Keys of a protocol-2 body's ``embed`` the engine never sends (it chains its tasks with
#: ``chain`` alone): a sender's ``callbacks`` ran the task it named after the message's.
_FOREIGN_EMBED = ("callbacks", "errbacks", "chord")


def _header_problem(headers: dict[str, Any]) -> str | None:
    """What makes a protocol-2 message's headers no message of the engine, or ``None``:

    * a ``timelimit`` that is not ``[soft, hard]``, or that sets either: the engine's
      messages set none (the worker's ``--time-limit``/``--soft-time-limit`` apply); a
      sender's ``["a", "b"]`` stopped the worker at every restart ("Unrecoverable
      error", a hostile-input trial), and a sender's ``0.001`` killed the pool process
      that took the message;
    * a ``retries`` that is not a count from 0 to :data:`MAX_RETRIES` (a stage's retry
      countdown doubles with it).
    """
    limits = headers.get("timelimit")
    if limits is not None:
        if not isinstance(limits, list | tuple) or len(limits) != 2:
            return "a timelimit header that is not [soft, hard]"
        if any(limit is not None for limit in limits):
            return ("a timelimit header that sets a time limit (the engine's messages set "
                    "none: the worker's --time-limit and --soft-time-limit apply)")
    retries = headers.get("retries")
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int)
                                or not 0 <= retries <= MAX_RETRIES):
        return f"a retries header that is not a count from 0 to {MAX_RETRIES}"
    return None


def _body_problem(message: Any) -> str | None:
    """What makes a protocol-2 JSON body no ``[args, kwargs, embed]`` of the engine, or
    ``None`` (a body the serializer cannot decode is Celery's to refuse, as before):
    ``args`` a list, ``kwargs`` an object, ``embed`` an object or null without
    ``callbacks``, ``errbacks`` or ``chord`` and with ``chain`` a list of objects, if
    any. Celery read the kwargs and embed only after the task ran, or in the pool's
    callback, with a traceback each (and ran a sender's callback)."""
    if getattr(message, "content_type", None) != "application/json":
        return None
    try:
        body = message.payload  # decoded once; Celery's request reads the same cache
    except Exception:  # Celery's on_decode_error says it, as before
        return None
    if not isinstance(body, list | tuple) or len(body) != 3:
        return "a body that is not [args, kwargs, embed]"
    args, kwargs, embed = body
    if not isinstance(args, list | tuple):
        return "a body whose args are not a list"
    if not isinstance(kwargs, dict):
        return "a body whose kwargs are not an object"
    if embed is None:
        return None
    if not isinstance(embed, dict):
        return "a body whose embed is not an object"
    foreign = [key for key in _FOREIGN_EMBED if embed.get(key)]
    if foreign:
        return (f"a body whose embed carries {', '.join(foreign)} (the engine chains its "
                "tasks with chain alone)")
    chain = embed.get("chain")
    if chain is not None and (not isinstance(chain, list) or not all(
            isinstance(sig, dict) and isinstance(sig.get("task"), str) for sig in chain)):
        return "a body whose embed chain is not a list of signatures naming their task"
    return None


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
            problem = _header_problem(headers) or _body_problem(message)
            if problem is not None:
                log.error("broker message refused: MESSAGE_INVALID: task message %s has %s; "
                          "it was dropped and nothing ran", escape_text(repr(task))[:80],
                          problem)
                if not message.acknowledged:
                    message.reject_log_error(log, self.connection_errors, requeue=False)
                return None
            too_late = _eta_beyond_countdown(headers)
            if too_late is not None:
                when = escape_text(str(too_late))[:40]
                log.error("broker message refused: MESSAGE_INVALID: task message %s is to "
                          "run at %s; it was dropped and nothing ran (a worker would hold "
                          "it in memory, and the broker deliver it again, every visibility "
                          "timeout)", escape_text(repr(task))[:80],
                          f"{when}, beyond INVESTIGATE_MAX_COUNTDOWN_S from now"
                          if _is_time(too_late) else f"{when!r}, which is no time")
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

    # Celery's own handlers of the messages below log several lines with a traceback
    # each (a hostile-input trial); one line with the stable code says the same.

    def on_unknown_message(self, body: Any, message: Any) -> None:
        _refused("a message that is not a task message (no task header)",
                 EnvelopeInvalid("no task"))
        message.reject_log_error(log, self.connection_errors)
        signals.task_rejected.send(sender=self, message=message, exc=None)

    def on_unknown_task(self, body: Any, message: Any, exc: BaseException) -> None:
        task = _task_of(message)
        log.error("broker message refused: MESSAGE_INVALID: task message %s names no task "
                  "of this worker; it was dropped and nothing ran",
                  escape_text(repr(task))[:80])
        message.reject_log_error(log, self.connection_errors)
        task_id = (message.headers or {}).get("id") if isinstance(
            getattr(message, "headers", None), dict) else None
        signals.task_unknown.send(sender=self, message=message, exc=exc, name=task,
                                  id=task_id)  # as Celery's own handler
        if self.event_dispatcher and isinstance(task_id, str):  # Flower lists it failed
            self.event_dispatcher.send("task-failed", uuid=task_id[:64],
                                       exception=f"NotRegistered({escape_text(repr(task))[:80]})")

    def on_invalid_task(self, body: Any, message: Any, exc: BaseException) -> None:
        _refused(f"task message {escape_text(repr(_task_of(message)))[:80]} that is not "
                 "a valid task message (headers or content type)", exc)
        message.reject_log_error(log, self.connection_errors)
        signals.task_rejected.send(sender=self, message=message, exc=exc)

    def on_decode_error(self, message: Any, exc: BaseException) -> None:
        # Also the remote-control consumer's handler (celery.worker.pidbox).
        task = _task_of(message)
        _refused(("a message" if task is None else
                  f"task message {escape_text(repr(task))[:80]}")
                 + " whose body cannot be decoded", exc)
        message.ack()


def _task_of(message: Any) -> object:
    """The ``task`` header of a message, if it has one (for the log line)."""
    headers = getattr(message, "headers", None)
    return headers.get("task") if isinstance(headers, dict) else None
