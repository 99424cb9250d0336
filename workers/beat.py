"""Celery beat's scheduler with a heartbeat that ``investigate health`` can see.

Beat sends the recovery sweep (``investigation.recover``) every
``INVESTIGATE_SWEEP_INTERVAL_S``: without it no case added to the store starts by itself,
no case is taken up again after its worker died, and no backoff longer than the longest
countdown ends. A fleet trial killed beat and ``health`` stayed green. This scheduler
(the app's ``beat_scheduler``: ``investigate beat`` and a worker's ``--beat``) writes its
field of ``REDIS_BEAT_KEY`` (a hash per queue in the lock Redis, one field per beat) at
start and at least every :data:`HEARTBEAT_EVERY_S` seconds, and fields live
:data:`HEARTBEAT_TTL_S`; ``workers.health.check_beat`` reads them: none, two, one on
another broker or one with sweeps off fail (decision 160).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from datetime import UTC, datetime
from typing import Any

import redis
from celery.beat import PersistentScheduler

from investigation.constants import REDIS_BEAT_KEY

log = logging.getLogger(__name__)

#: Longest sleep between two heartbeats (seconds): beat wakes at least this often.
HEARTBEAT_EVERY_S = 20.0
#: Life of a heartbeat key (seconds): three heartbeats missed and it is gone.
HEARTBEAT_TTL_S = 60


class Scheduler(PersistentScheduler):  # type: ignore[misc]
    """:class:`celery.beat.PersistentScheduler` that leaves a heartbeat at every tick."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from investigation.text_safety import url_for_display
        from workers.settings import load_settings

        settings = load_settings()
        self._key = REDIS_BEAT_KEY.format(queue=settings.queue)
        self._field = f"{socket.gethostname()}:{os.getpid()}"
        self._about = {"host": socket.gethostname(), "pid": os.getpid(),
                       "broker": url_for_display(settings.broker_url),
                       "sweep_interval_s": settings.sweep_interval_s}
        self._redis = redis.Redis.from_url(settings.effective_redis_url, socket_timeout=2.0,
                                           socket_connect_timeout=2.0)
        self._failing = False
        super().__init__(*args, **kwargs)

    def setup_schedule(self) -> None:
        super().setup_schedule()
        self.heartbeat()

    def tick(self, *args: Any, **kwargs: Any) -> float:
        self.heartbeat()
        return float(min(super().tick(*args, **kwargs), HEARTBEAT_EVERY_S))

    def heartbeat(self) -> None:
        """Write this beat's heartbeat: a field ``host:pid`` of the queue's hash holding
        host, pid, the broker it sends to (no password), its sweep interval and the UTC
        time; the hash lives :data:`HEARTBEAT_TTL_S` past the newest heartbeat and fields
        older than that are dropped. A Redis that cannot be reached is logged once until
        it answers again, never fatal: the sweep goes out on the broker either way."""
        now = time.time()
        value = json.dumps({**self._about, "ts": round(now, 3),
                            "at": datetime.now(UTC).isoformat(timespec="seconds")})
        try:
            stale = [field for field, raw in self._redis.hgetall(self._key).items()
                     if heartbeat_age_s(raw, now) > HEARTBEAT_TTL_S]
            pipe = self._redis.pipeline()
            if stale:
                pipe.hdel(self._key, *stale)
            pipe.hset(self._key, self._field, value)
            pipe.expire(self._key, HEARTBEAT_TTL_S)
            pipe.execute()
        except redis.RedisError as exc:
            if not self._failing:
                log.warning("beat heartbeat: the lock Redis cannot be reached (%s); "
                            "`investigate health` will report no beat until it can",
                            str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            self._failing = True
        else:
            if self._failing:
                log.info("beat heartbeat: the lock Redis answers again")
            self._failing = False

    def close(self) -> None:
        """On a clean stop, take this beat's heartbeat away at once (``health`` then sees
        it gone instead of waiting for it to age out); another beat's stays."""
        try:
            super().close()
        finally:
            try:
                self._redis.hdel(self._key, self._field)
                self._redis.close()
            except redis.RedisError:
                pass


def heartbeat_age_s(raw: bytes | str, now: float) -> float:
    """Seconds since a heartbeat field was written (``inf`` when it cannot be read)."""
    try:
        return now - float(json.loads(raw)["ts"])
    except (ValueError, TypeError, KeyError):
        return float("inf")
