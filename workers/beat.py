"""Celery beat's scheduler with a heartbeat that ``investigate health`` can see.

Beat sends the recovery sweep (``investigation.recover``) every
``INVESTIGATE_SWEEP_INTERVAL_S``: without it no case added to the store starts by itself,
no case is taken up again after its worker died, and no backoff longer than the longest
countdown ends. A fleet trial killed beat and ``health`` stayed green. This scheduler
(``investigate beat`` runs it) writes ``REDIS_BEAT_KEY`` for its queue in the lock Redis
at start and at least every :data:`HEARTBEAT_EVERY_S` seconds, with a life of
:data:`HEARTBEAT_TTL_S`; ``workers.health.check_beat`` reads it (decision 160).
"""

from __future__ import annotations

import json
import logging
import os
import socket
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
        from workers.settings import load_settings

        settings = load_settings()
        self._key = REDIS_BEAT_KEY.format(queue=settings.queue)
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
        """Write this beat's heartbeat (host, pid, UTC time); a Redis that cannot be
        reached is logged once until it answers again, never fatal: the sweep goes out on
        the broker either way."""
        value = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                            "at": datetime.now(UTC).isoformat(timespec="seconds")})
        try:
            self._redis.set(self._key, value, ex=HEARTBEAT_TTL_S)
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
        """On a clean stop, take the heartbeat away at once (``health`` then says no beat
        runs instead of waiting for the key to expire)."""
        try:
            super().close()
        finally:
            try:
                self._redis.delete(self._key)
                self._redis.close()
            except redis.RedisError:
                pass
