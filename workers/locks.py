"""Per-case dispatch locks: Redis for the distributed runtime, a file lock for the embedded one.

A lock is a lease with a random token. ``acquire`` never blocks (a held lock raises
``LockBusy``); ``hold`` renews the lease only for its owner and re-takes an expired one,
never one released with a tombstone (below); ``release`` deletes the key only if it
still holds the caller's token.

A released lease leaves a tombstone behind (``<lock key>:released:<token>``, kept for
``released_ttl_s``: the broker's visibility timeout plus its restore interval plus the
lease, see ``workers.runtime``), so a late duplicate of a finished chain's message (a
killed worker child's delivery that the broker restores after the chain went on and
ended) stops with ``LOCK_LOST`` at its first stage instead of re-taking the free lock for
its own short run, during which a new dispatch of the case would meet ``LockBusy``
(decision 135). A lease that expired without a release (a holder stalled past its TTL)
can still be re-taken by its holder, as before, and so can a lease released with
``tombstone=False``: by a dispatch whose token never left the process, and by a chain
that stops because another chain is at work on the case (``STALE``, a model call in
flight), which may be a twin of itself with the same token (a killed worker's
unacknowledged ``advance``, redelivered, starts a second chain of the next step); that
twin re-takes the lease at its next renewal in Redis (at most 10 s later, and at the
latest at its next ``llm_call``, ``execute_tool`` or ``advance``) and goes on (decision
136). Correctness never
rests on the lock: stages are fenced on the checkpoint head in SQL. The lock only keeps
two dispatches from doing the same work twice.

``renew`` is what a stage task without an external effect calls: ``hold``, unless this
process renewed the same lease (case and token) less than ``RedisCaseLock.renew_within_s``
ago (``time.monotonic``; 10 s, at most a quarter of the TTL). Such a lease has at least
three quarters of its TTL left, so nobody else can have taken it by expiry; the stage
then starts without a Redis round trip (issue 13: nine renewals per step were 7% of a
worker child's time). A holder stalled past its TTL renews at its next stage and stops
there (``LOCK_LOST``), as before. A lease that ended otherwise (released by another
process, say a sibling worker child whose ``advance`` ended the dispatch before a
duplicate message of it arrived here; deleted by hand; lost in a Redis restart, an
eviction or a clock step on the Redis host) is seen at this process's next renewal in
Redis: at most 10 s later, and at the latest at the step's next ``llm_call`` or
``execute_tool`` and at its ``advance``, which always ``hold``. Until then the SQL
fencing, on which correctness rests, keeps two chains from recording anything twice
(docs/decisions.md, 122).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from investigation.constants import CASE_ID_RULE, REDIS_LOCK_KEY, SAFE_CASE_ID
from investigation.errors import InvestigationError, LockBusy

if TYPE_CHECKING:  # redis-py is imported where a Redis lock is made: a `status` in a
    # shell without a broker reads only the file lock (a tenth of a second under load)
    import redis

#: KEYS: the lock, its holder's name; ARGV: the token, the lease (ms), the holder's name.
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
  return 1
end
return 0
"""

#: KEYS: the lock, the token's tombstone, the holder's name; ARGV: the token, the lease
#: (ms), the holder's name.
_RENEW = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[2])
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
elseif not v and redis.call('EXISTS', KEYS[2]) == 0 then
  if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[2])
    return 1
  end
end
return 0
"""

#: KEYS: the lock, the token's tombstone, the holder's name; ARGV: the token, the
#: tombstone's life (ms; 0: none).
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if tonumber(ARGV[2]) > 0 then redis.call('SET', KEYS[2], '1', 'PX', ARGV[2]) end
  redis.call('DEL', KEYS[3])
  return redis.call('DEL', KEYS[1])
end
return 0
"""

#: Suffix of a released lease's tombstone key (after the lock key, before the token).
RELEASED_SUFFIX = ":released:"
#: Suffix of the key naming the lease's holder (after the lock key): the process that
#: took or last renewed it, with the lease's TTL from that moment.
HOLDER_SUFFIX = ":holder"
#: Characters of a holder's name shown (``status``, ``recover``, ``LOCK_BUSY``).
MAX_HOLDER_CHARS = 200


def _keys(case_id: str, token: str) -> list[str]:
    """KEYS of the renew and release scripts: the case's lock, ``token``'s tombstone, the
    holder's name."""
    key = REDIS_LOCK_KEY.format(case_id=case_id)
    return [key, key + RELEASED_SUFFIX + token, key + HOLDER_SUFFIX]


def worker_node(holder: str) -> str | None:
    """The Celery node of a lease holder's name (``w1@host`` of ``w1@host pid 7``, as
    :func:`process_name` writes a worker's pool child), or ``None`` for a process that is
    no worker node (``host pid 7``: an ``investigate dispatch``, the beat)."""
    node = holder.split(" pid ", 1)[0]
    return node if "@" in node else None


def held_by_a_shell(info: dict[str, Any]) -> bool:
    """Whether the dispatch lease in ``info`` (``workers.health.dispatch_fields``) was
    taken by a process that is no worker node (``host pid N``: an ``investigate
    dispatch``, the beat) and no worker renewed it since: its chain's first message has
    not been taken. A worker's pool child is named ``node@host pid N``."""
    name = info.get("dispatch_holder")
    return isinstance(name, str) and worker_node(name) is None


def process_name() -> str:
    """What a lease names as its holder: the Celery node (``name@host``) of a worker and
    its pool child's pid, else this host and pid (a CLI ``dispatch``, the beat's sweep)."""
    from workers import logs

    return f"{logs.worker_name() or socket.gethostname()} pid {os.getpid()}"


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds a case's Redis lease, as ``status`` and ``recover`` show it.

    Attributes:
        name: the holding process (:func:`process_name`), ``None`` for a lease taken by
            a version that did not name it.
        lease_s: seconds left of the lease; ``None``: it never expires (a key set by
            hand: the engine always sets a TTL), so only ``dispatch --take-over`` ends it.
        renewed_s_ago: seconds since the holder took or last renewed it (``None``:
            unknown); a live chain renews it as its stages start, so a large value while
            no stage runs long points at a holder that died.
    """

    name: str | None
    lease_s: float | None
    renewed_s_ago: float | None


class CaseLock(Protocol):
    """The lock protocol both runtimes use."""

    def acquire(self, case_id: str) -> str:
        """Take the lock; returns the token. Raises ``LockBusy`` at once if held."""
        ...

    def hold(self, case_id: str, token: str) -> bool:
        """Renew the lease for ``token``; True while the caller owns the lock."""
        ...

    def release(self, case_id: str, token: str, *, tombstone: bool = True) -> bool:
        """Release if ``token`` still owns it; never deletes another holder's key.
        ``tombstone=False``: ``token`` may re-take the free lock later (a Redis lock
        leaves no tombstone): no message carrying it was ever sent, or another chain of
        the same token may still be at work (see the module docstring)."""
        ...

    def holder(self, case_id: str) -> str | None:
        """The token that holds the lock now, if any (never takes or renews it)."""
        ...

    def renew(self, case_id: str, token: str) -> bool:
        """:meth:`hold`, unless this process renewed this very lease recently enough
        that it cannot have expired (see the module docstring)."""
        ...


class _Renewals:
    """When this process last renewed each lease: ``(case_id, token) -> monotonic
    seconds``, the most recent :attr:`KEPT` (a long-lived worker meets any number)."""

    KEPT = 4096

    def __init__(self) -> None:
        self._at: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._mutex = threading.Lock()

    def recent(self, key: tuple[str, str], within_s: float) -> bool:
        with self._mutex:
            at = self._at.get(key)
        return at is not None and 0.0 <= time.monotonic() - at < within_s

    def renewed(self, key: tuple[str, str], at: float) -> None:
        with self._mutex:
            self._at[key] = at
            self._at.move_to_end(key)
            while len(self._at) > self.KEPT:
                self._at.popitem(last=False)

    def forget(self, key: tuple[str, str]) -> None:
        with self._mutex:
            self._at.pop(key, None)


class RedisCaseLock:
    """Redis lease lock: ``SET key token NX PX ttl``; renew and release by Lua compare.

    Args:
        client: a redis-py client.
        ttl_s: lease length in seconds; stages renew it (:meth:`renew`).
        released_ttl_s: how long a released lease's tombstone keeps its token from
            re-taking the free lock (seconds; default: an hour or ``ttl_s``, whichever is
            longer). It must outlast the latest redelivery of a message of the chain.
    """

    #: A lease this process renewed less than this many seconds ago (and less than a
    #: quarter of its TTL ago) is not renewed again by :meth:`renew`.
    RENEW_AFTER_S = 10.0

    def __init__(self, client: redis.Redis, ttl_s: int,
                 released_ttl_s: int | None = None) -> None:
        self.client = client
        self.ttl_ms = ttl_s * 1000
        self.released_ttl_ms = max(ttl_s, released_ttl_s or 3600) * 1000
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._renewals = _Renewals()
        #: Seconds after this process's last renewal of a lease before :meth:`renew`
        #: renews it in Redis again.
        self.renew_within_s = min(self.RENEW_AFTER_S, ttl_s / 4)

    @classmethod
    def from_url(cls, url: str, ttl_s: int, released_ttl_s: int | None = None
                 ) -> RedisCaseLock:
        import redis

        return cls(redis.Redis.from_url(url), ttl_s, released_ttl_s)

    def acquire(self, case_id: str) -> str:
        token = secrets.token_hex(16)
        key = REDIS_LOCK_KEY.format(case_id=case_id)
        if not self._acquire(keys=[key, key + HOLDER_SUFFIX],
                             args=[token, self.ttl_ms, process_name()]):
            holder = self.lease_holder(case_id)  # the busy path only: one more round trip
            raise LockBusy(case_id, holder.lease_s if holder else None,
                           holder.name if holder else None,
                           holder.renewed_s_ago if holder else None)
        return token

    def lease_holder(self, case_id: str) -> LeaseHolder | None:
        """Who holds the case's lease now (``None``: nobody); never takes or renews it."""
        key = REDIS_LOCK_KEY.format(case_id=case_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.pttl(key)
        pipe.get(key + HOLDER_SUFFIX)
        pipe.pttl(key + HOLDER_SUFFIX)
        # A holder key of another type (a list, set by hand) answers WRONGTYPE: no name,
        # never an error that stops `recover` for every case (a hostile-input trial).
        left_ms, name, named_ms = pipe.execute(raise_on_error=False)
        if isinstance(left_ms, Exception):
            raise left_ms
        if not isinstance(left_ms, int) or left_ms == -2:  # no lease
            return None
        if isinstance(name, bytes):
            name = name.decode("utf-8", "replace")
        if not isinstance(name, str) or not name:
            name = None
        renewed = (max(0.0, round((self.ttl_ms - named_ms) / 1000, 1))
                   if name is not None and isinstance(named_ms, int) and named_ms >= 0
                   else None)
        # At most MAX_HOLDER_CHARS of it: the key is anyone's with access to Redis.
        return LeaseHolder(None if name is None else name[:MAX_HOLDER_CHARS],
                           None if left_ms < 0 else round(left_ms / 1000, 1), renewed)

    def hold(self, case_id: str, token: str) -> bool:
        started = time.monotonic()  # the lease runs from before the request at the latest
        held = bool(self._renew(keys=_keys(case_id, token),
                                args=[token, self.ttl_ms, process_name()]))
        if held:
            self._renewals.renewed((case_id, token), started)
        else:
            self._renewals.forget((case_id, token))
        return held

    def renew(self, case_id: str, token: str) -> bool:
        if self._renewals.recent((case_id, token), self.renew_within_s):
            return True
        return self.hold(case_id, token)

    def release(self, case_id: str, token: str, *, tombstone: bool = True) -> bool:
        """Delete the lock if ``token`` holds it, leaving the token's tombstone unless
        ``tombstone`` is false."""
        self._renewals.forget((case_id, token))
        return bool(self._release(keys=_keys(case_id, token),
                                  args=[token, self.released_ttl_ms if tombstone else 0]))

    def holder(self, case_id: str) -> str | None:
        """The current token, if any (for status and tests)."""
        value = self.client.get(REDIS_LOCK_KEY.format(case_id=case_id))
        return value.decode() if isinstance(value, bytes) else value


def lock_file(directory: Path, case_id: str) -> Path | None:
    """The file :class:`FileCaseLock` locks for ``case_id`` (``None`` for a string that is
    no case id and so has no lock file)."""
    return directory / f"{case_id}.lock" if SAFE_CASE_ID.fullmatch(case_id) else None


class FileCaseLock:
    """``flock`` on ``<dir>/<case>.lock``: one embedded dispatch per case per machine.

    The OS drops the lock when the holding process dies, so there is no lease to expire.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._held: dict[str, tuple[str, IO[bytes]]] = {}
        self._mutex = threading.Lock()

    def acquire(self, case_id: str) -> str:
        path = lock_file(self.directory, case_id)
        if path is None:
            raise InvestigationError("CASE_ID_INVALID",
                                     f"{case_id!r} is not a case id ({CASE_ID_RULE})")
        self.directory.mkdir(parents=True, exist_ok=True)
        with self._mutex:
            if case_id in self._held:
                raise LockBusy(case_id)
            fh = open(path, "ab")  # noqa: SIM115
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.close()
                raise LockBusy(case_id) from None
            token = secrets.token_hex(16)
            self._held[case_id] = (token, fh)
            return token

    def hold(self, case_id: str, token: str) -> bool:
        with self._mutex:
            held = self._held.get(case_id)
            return held is not None and held[0] == token

    def renew(self, case_id: str, token: str) -> bool:
        """:meth:`hold` (a file lock has no lease; the check is in memory)."""
        return self.hold(case_id, token)

    def holder(self, case_id: str) -> str | None:
        """This process's token for the case, if it holds the lock."""
        with self._mutex:
            held = self._held.get(case_id)
            return None if held is None else held[0]

    def release(self, case_id: str, token: str, *, tombstone: bool = True) -> bool:
        with self._mutex:
            held = self._held.get(case_id)
            if held is None or held[0] != token:
                return False
            del self._held[case_id]
            fcntl.flock(held[1].fileno(), fcntl.LOCK_UN)
            held[1].close()
            return True


class FleetCaseLock:
    """The embedded runtime's lock in a shell set up for a fleet: this machine's
    :class:`FileCaseLock` and the fleet's :class:`RedisCaseLock` at once, so that ``run``
    and a worker's dispatch never work on one case side by side (decision 158; before,
    the locks were per runtime, decision 21, and both paid for model calls until one
    stopped with ``STALE_STATE``).

    The token is the Redis lease's; the file lock's own token stays inside. ``acquire``
    takes the file lock first (no Redis round trip for a second ``run`` on this machine)
    and gives it back when the fleet's lease is held (``LockBusy`` with the lease left) or
    Redis cannot be reached (``redis.RedisError``). A ``run`` renews the lease at its
    stages, like a worker, and while it waits out a provider backoff
    (``workers.embedded``); a lease that ran out while nobody took it is re-taken at the
    next renewal, one a dispatch took in the meantime stops the run (``LOCK_LOST``).
    """

    def __init__(self, files: FileCaseLock, fleet: RedisCaseLock) -> None:
        self.files = files
        self.fleet = fleet
        #: case id -> (fleet token, file token)
        self._tokens: dict[str, tuple[str, str]] = {}
        self._mutex = threading.Lock()

    @property
    def ttl_s(self) -> float:
        """The fleet lease's length (seconds)."""
        return self.fleet.ttl_ms / 1000

    def acquire(self, case_id: str) -> str:
        file_token = self.files.acquire(case_id)
        try:
            token = self.fleet.acquire(case_id)
        except BaseException:
            self.files.release(case_id, file_token)
            raise
        with self._mutex:
            self._tokens[case_id] = (token, file_token)
        return token

    def _file_token(self, case_id: str, token: str) -> str | None:
        with self._mutex:
            pair = self._tokens.get(case_id)
        return pair[1] if pair is not None and pair[0] == token else None

    def hold(self, case_id: str, token: str) -> bool:
        file_token = self._file_token(case_id, token)
        return (file_token is not None and self.files.hold(case_id, file_token)
                and self.fleet.hold(case_id, token))

    def renew(self, case_id: str, token: str) -> bool:
        file_token = self._file_token(case_id, token)
        return (file_token is not None and self.files.hold(case_id, file_token)
                and self.fleet.renew(case_id, token))

    def holder(self, case_id: str) -> str | None:
        """The fleet lease's token (whoever holds it: this run or a dispatch)."""
        return self.fleet.holder(case_id)

    def release(self, case_id: str, token: str, *, tombstone: bool = True) -> bool:
        """Release the fleet's lease if ``token`` holds it, then this machine's file lock;
        True if the lease was still ``token``'s."""
        file_token = self._file_token(case_id, token)
        try:
            return self.fleet.release(case_id, token, tombstone=tombstone)
        finally:
            if file_token is not None:
                with self._mutex:
                    self._tokens.pop(case_id, None)
                self.files.release(case_id, file_token)
