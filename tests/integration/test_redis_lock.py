"""The per-case Redis lease lock (``workers.locks.RedisCaseLock``).

Every behaviour runs twice: against the real Redis server (marked ``redis``) and against
fakeredis (a fast unit variant; its Lua scripting needs ``lupa``, i.e. ``fakeredis[lua]``).
Each test uses its own random case id and deletes its key afterwards.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from investigation.constants import REDIS_LOCK_KEY
from investigation.errors import LockBusy
from workers.locks import HOLDER_SUFFIX, RELEASED_SUFFIX, RedisCaseLock, process_name

TTL_S = 30


@dataclass
class Backend:
    """A Redis client factory plus the case ids a test used (for cleanup)."""

    name: str
    make_client: Callable[[], redis.Redis]
    used: list[str]

    def client(self) -> redis.Redis:
        return self.make_client()

    def lock(self, ttl_s: int = TTL_S) -> RedisCaseLock:
        return RedisCaseLock(self.client(), ttl_s)

    def case_id(self) -> str:
        case_id = f"test-lock-{uuid.uuid4().hex}"
        self.used.append(case_id)
        return case_id


def key(case_id: str) -> str:
    return REDIS_LOCK_KEY.format(case_id=case_id)


@pytest.fixture(params=[pytest.param("real", marks=pytest.mark.redis), "fake"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "real":
        url = request.getfixturevalue("redis_url")

        def make() -> redis.Redis:
            return redis.Redis.from_url(url)
    else:
        fakeredis = pytest.importorskip("fakeredis")
        pytest.importorskip("lupa", reason="fakeredis runs Lua scripts only with lupa "
                                           "(install fakeredis[lua])")
        server = fakeredis.FakeServer()

        def make() -> redis.Redis:
            return fakeredis.FakeRedis(server=server)  # type: ignore[no-any-return]

    b = Backend(request.param, make, [])
    yield b
    if b.used:
        cleanup = b.client()
        cleanup.delete(*(key(c) for c in b.used), *(key(c) + HOLDER_SUFFIX for c in b.used))
        for c in b.used:  # the tombstones of released leases (decision 135)
            tombstones = list(cleanup.scan_iter(match=key(c) + RELEASED_SUFFIX + "*"))
            if tombstones:
                cleanup.delete(*tombstones)
        cleanup.close()


def expire_now(client: redis.Redis, case_id: str) -> None:
    """Let the lease run out (1 ms TTL), as if the holder had stalled past it."""
    assert client.pexpire(key(case_id), 1)
    deadline = time.monotonic() + 5
    while client.exists(key(case_id)):
        assert time.monotonic() < deadline, "the lease did not expire"
        time.sleep(0.005)


# -- acquire -------------------------------------------------------------------------------


def test_acquire_returns_token_and_sets_lease(backend: Backend) -> None:
    lock, case_id = backend.lock(), backend.case_id()
    token = lock.acquire(case_id)
    assert isinstance(token, str) and len(token) == 32
    assert lock.holder(case_id) == token
    ttl_ms = lock.client.pttl(key(case_id))
    assert 0 < ttl_ms <= TTL_S * 1000


def test_second_acquire_raises_lock_busy_without_blocking(backend: Backend) -> None:
    first, second = backend.lock(), backend.lock()
    case_id = backend.case_id()
    token = first.acquire(case_id)
    started = time.monotonic()
    with pytest.raises(LockBusy) as busy:
        second.acquire(case_id)
    with pytest.raises(LockBusy):
        first.acquire(case_id)  # not reentrant either
    assert time.monotonic() - started < 1.0  # never waits for the lease
    # The refusal says how long the holder's lease has left (a dead holder's runs out).
    assert busy.value.expires_in_s is not None and 0 < busy.value.expires_in_s <= TTL_S
    assert f"its lease runs out in {max(1, round(busy.value.expires_in_s))} s" \
        in str(busy.value)
    assert first.holder(case_id) == token


def test_the_lease_names_its_holder_and_when_it_renewed(
        backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a worker died, `recover` and `status` showed its orphaned case "busy" like
    two live ones, only its lease shorter (a fleet trial): the lease names the process
    that took or last renewed it, and since when; a release forgets it."""
    from workers import logs

    lock, case_id = backend.lock(), backend.case_id()
    assert lock.lease_holder(case_id) is None
    monkeypatch.setattr(logs, "_worker_name", "w1@host")
    token = lock.acquire(case_id)
    assert process_name().startswith("w1@host pid ")
    held = lock.lease_holder(case_id)
    assert held is not None and held.name == process_name()
    assert 0 < held.lease_s <= TTL_S and held.renewed_s_ago is not None
    assert 0 <= held.renewed_s_ago < 2
    # The lease was renewed 10 s ago (its holder key's TTL says so) and is busy for others.
    lock.client.pexpire(key(case_id) + HOLDER_SUFFIX, (TTL_S - 10) * 1000)
    with pytest.raises(LockBusy) as busy:
        backend.lock().acquire(case_id)
    assert busy.value.holder == process_name()
    assert busy.value.renewed_s_ago is not None and 9 <= busy.value.renewed_s_ago <= 11
    assert f"held by {process_name()}, renewed" in str(busy.value)
    # Another process (a sibling worker child) renews it: the name follows the renewal.
    monkeypatch.setattr(logs, "_worker_name", "w2@host")
    assert lock.hold(case_id, token)
    held = lock.lease_holder(case_id)
    assert held is not None and held.name is not None and held.name.startswith("w2@host")
    assert held.renewed_s_ago is not None and held.renewed_s_ago < 2
    assert lock.release(case_id, token)
    assert lock.lease_holder(case_id) is None
    assert not lock.client.exists(key(case_id) + HOLDER_SUFFIX)


def test_acquire_after_release_gets_a_new_token(backend: Backend) -> None:
    lock, case_id = backend.lock(), backend.case_id()
    token = lock.acquire(case_id)
    assert lock.release(case_id, token) is True
    assert lock.holder(case_id) is None
    again = lock.acquire(case_id)
    assert again != token
    assert lock.holder(case_id) == again


def test_different_cases_do_not_contend(backend: Backend) -> None:
    lock = backend.lock()
    a, b = backend.case_id(), backend.case_id()
    assert lock.acquire(a) != lock.acquire(b)


# -- release -------------------------------------------------------------------------------


def test_release_with_a_wrong_token_keeps_the_key(backend: Backend) -> None:
    lock, case_id = backend.lock(), backend.case_id()
    token = lock.acquire(case_id)
    assert lock.release(case_id, "not-the-token") is False
    assert lock.holder(case_id) == token
    assert lock.release(case_id, token) is True
    assert lock.release(case_id, token) is False  # already gone: a no-op


def test_release_never_deletes_another_holders_key(backend: Backend) -> None:
    old, new = backend.lock(), backend.lock()
    case_id = backend.case_id()
    stale = old.acquire(case_id)
    expire_now(old.client, case_id)
    fresh = new.acquire(case_id)
    assert fresh != stale
    assert old.release(case_id, stale) is False
    assert new.holder(case_id) == fresh
    assert new.client.pttl(key(case_id)) > 0
    with pytest.raises(LockBusy):
        old.acquire(case_id)
    assert new.release(case_id, fresh) is True


# -- hold ----------------------------------------------------------------------------------


def test_hold_renews_the_lease_for_the_owner(backend: Backend) -> None:
    lock, case_id = backend.lock(), backend.case_id()
    token = lock.acquire(case_id)
    lock.client.pexpire(key(case_id), 2000)
    assert lock.client.pttl(key(case_id)) <= 2000
    assert lock.hold(case_id, token) is True
    assert lock.client.pttl(key(case_id)) > 2000  # back to the full lease
    assert lock.holder(case_id) == token


def test_hold_retakes_an_expired_lock(backend: Backend) -> None:
    lock, case_id = backend.lock(), backend.case_id()
    token = lock.acquire(case_id)
    expire_now(lock.client, case_id)
    assert lock.holder(case_id) is None
    assert lock.hold(case_id, token) is True
    assert lock.holder(case_id) == token
    assert 0 < lock.client.pttl(key(case_id)) <= TTL_S * 1000
    assert lock.release(case_id, token) is True


def test_hold_refuses_when_another_token_holds_it(backend: Backend) -> None:
    old, new = backend.lock(), backend.lock()
    case_id = backend.case_id()
    stale = old.acquire(case_id)
    expire_now(old.client, case_id)
    fresh = new.acquire(case_id)
    new.client.pexpire(key(case_id), 5000)
    assert old.hold(case_id, stale) is False
    assert new.holder(case_id) == fresh
    assert new.client.pttl(key(case_id)) <= 5000  # the refused renewal did not touch it
    assert old.hold(case_id, "never-issued") is False


def test_a_released_token_never_retakes_the_lock(backend: Backend) -> None:
    """A released lease leaves a tombstone (decision 135): its token's ``hold`` fails on
    the free key and on a newer holder's, and a new dispatch acquires at once."""
    lock, case_id = backend.lock(), backend.case_id()
    token = lock.acquire(case_id)
    assert lock.release(case_id, token)
    assert lock.hold(case_id, token) is False  # free, but released: not re-taken
    assert lock.holder(case_id) is None
    other = lock.acquire(case_id)
    assert lock.hold(case_id, token) is False
    assert lock.holder(case_id) == other


def test_the_tombstone_lives_for_released_ttl_s_and_only_a_real_release_leaves_one(
        backend: Backend) -> None:
    client = backend.client()
    lock, case_id = RedisCaseLock(client, TTL_S, released_ttl_s=120), backend.case_id()
    token = lock.acquire(case_id)
    assert lock.release(case_id, "f" * 32) is False  # not the holder's token
    assert not client.exists(key(case_id) + RELEASED_SUFFIX + "f" * 32)
    assert lock.release(case_id, token)
    left_ms = client.pttl(key(case_id) + RELEASED_SUFFIX + token)
    assert 110_000 < left_ms <= 120_000
    assert lock.release(case_id, token) is False  # a second release changes nothing
    # Once the tombstone has lapsed (past every redelivery), the token is a stranger.
    client.delete(key(case_id) + RELEASED_SUFFIX + token)
    assert lock.hold(case_id, token) is True
    assert RedisCaseLock(client, TTL_S).released_ttl_ms == 3600 * 1000  # the default
    # A token that no message ever carried (a dispatch with nothing to run) leaves none.
    unsent = lock.acquire(backend.case_id())
    assert lock.release(backend.used[-1], unsent, tombstone=False)
    assert not client.exists(key(backend.used[-1]) + RELEASED_SUFFIX + unsent)
    assert lock.holder(backend.used[-1]) is None


# -- renew: hold, unless this process renewed the same lease recently ---------------------


class _Clock:
    """``time`` for ``workers.locks``: ``monotonic()`` runs ``ahead`` seconds ahead."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    import workers.locks

    fake = _Clock()
    monkeypatch.setattr(workers.locks, "time", fake)
    return fake


class _CountingScript:
    """Counts the renewal script's calls (each one a Redis round trip)."""

    def __init__(self, script: Callable[..., object]) -> None:
        self.script, self.calls = script, 0

    def __call__(self, *args: object, **kwargs: object) -> object:
        self.calls += 1
        return self.script(*args, **kwargs)


def _counted(lock: RedisCaseLock) -> _CountingScript:
    counting = _CountingScript(lock._renew)
    lock._renew = counting  # type: ignore[assignment]
    return counting


def test_renew_skips_redis_for_a_lease_this_process_renewed_moments_ago(
        backend: Backend, clock: _Clock) -> None:
    lock, case_id = backend.lock(), backend.case_id()
    token = lock.acquire(case_id)
    calls = _counted(lock)
    assert lock.renew(case_id, token) is True and calls.calls == 1  # never renewed here
    for _ in range(5):
        assert lock.renew(case_id, token) is True
    assert calls.calls == 1  # the lease has at least three quarters of its TTL left
    assert lock.renew_within_s == min(RedisCaseLock.RENEW_AFTER_S, TTL_S / 4)
    assert backend.lock(ttl_s=8).renew_within_s == 2.0  # a short lease: a quarter of it
    clock.ahead = lock.renew_within_s - 0.5
    assert lock.renew(case_id, token) is True and calls.calls == 1
    clock.ahead = lock.renew_within_s + 0.01
    lock.client.pexpire(key(case_id), 2000)
    assert lock.renew(case_id, token) is True and calls.calls == 2  # due: renewed in Redis
    assert lock.client.pttl(key(case_id)) > 2000


def test_a_holder_stalled_past_its_ttl_renews_and_finds_the_lock_taken(
        backend: Backend, clock: _Clock) -> None:
    old, new = backend.lock(), backend.lock()
    case_id = backend.case_id()
    stale = old.acquire(case_id)
    assert old.renew(case_id, stale) is True
    expire_now(old.client, case_id)
    clock.ahead = TTL_S + 1.0  # the holder slept past its lease
    fresh = new.acquire(case_id)
    assert old.renew(case_id, stale) is False
    assert new.holder(case_id) == fresh
    assert old.renew(case_id, stale) is False  # a refusal is not remembered as a renewal


def test_renew_after_release_goes_to_redis(backend: Backend, clock: _Clock) -> None:
    lock, case_id = backend.lock(), backend.case_id()
    token = lock.acquire(case_id)
    assert lock.renew(case_id, token) is True
    assert lock.release(case_id, token) is True
    other = backend.lock().acquire(case_id)
    assert lock.renew(case_id, token) is False  # released here: checked in Redis
    assert lock.holder(case_id) == other


def test_renewals_are_per_lease_and_per_process(backend: Backend, clock: _Clock) -> None:
    first, second = backend.lock(), backend.lock()
    case_id = backend.case_id()
    token = first.acquire(case_id)
    assert first.renew(case_id, token) is True
    calls = _counted(second)  # another process (its own lock object) renews in Redis
    assert second.renew(case_id, token) is True and calls.calls == 1
    assert second.renew(case_id, "another-token") is False and calls.calls == 2


# -- contention ----------------------------------------------------------------------------


CONTENDERS = 20


def test_concurrent_acquires_from_threads_yield_exactly_one_token(backend: Backend) -> None:
    case_id = backend.case_id()
    barrier = threading.Barrier(CONTENDERS)
    tokens: list[str] = []
    busy: list[LockBusy] = []
    errors: list[BaseException] = []
    mutex = threading.Lock()

    def contend() -> None:
        lock = backend.lock()  # one client (connection pool) per contender
        try:
            barrier.wait(timeout=10)
            token = lock.acquire(case_id)
        except LockBusy as exc:
            with mutex:
                busy.append(exc)
        except BaseException as exc:
            with mutex:
                errors.append(exc)
        else:
            with mutex:
                tokens.append(token)
        finally:
            lock.client.close()

    threads = [threading.Thread(target=contend) for _ in range(CONTENDERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert len(tokens) == 1
    assert len(busy) == CONTENDERS - 1
    assert backend.lock().holder(case_id) == tokens[0]


def _acquire_in_process(url: str, case_id: str, barrier: object, results: object) -> None:
    lock = RedisCaseLock(redis.Redis.from_url(url), TTL_S)
    barrier.wait(timeout=60)  # type: ignore[attr-defined]
    try:
        results.put(("token", lock.acquire(case_id)))  # type: ignore[attr-defined]
    except LockBusy:
        results.put(("busy", None))  # type: ignore[attr-defined]
    except BaseException as exc:
        results.put(("error", repr(exc)))  # type: ignore[attr-defined]


@pytest.mark.redis
def test_concurrent_acquires_from_processes_yield_exactly_one_token(redis_url: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    case_id = f"test-lock-{uuid.uuid4().hex}"
    barrier = ctx.Barrier(CONTENDERS)
    results = ctx.Queue()
    procs = [ctx.Process(target=_acquire_in_process, args=(redis_url, case_id, barrier, results))
             for _ in range(CONTENDERS)]
    client = redis.Redis.from_url(redis_url)
    try:
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        kinds = [kind for kind, _ in outcomes]
        assert kinds.count("error") == 0, outcomes
        assert kinds.count("token") == 1
        assert kinds.count("busy") == CONTENDERS - 1
        token = next(value for kind, value in outcomes if kind == "token")
        assert RedisCaseLock(client, TTL_S).holder(case_id) == token
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        client.delete(key(case_id))
        client.close()


def test_the_distributed_runtime_keeps_tombstones_past_every_redelivery(
        tmp_path: Path) -> None:
    """Decision 135: a worker's lock keeps a released token's tombstone for the
    visibility timeout, one restore scan and one lease (a late message comes no later)."""
    from workers import runtime
    from workers.settings import Settings

    settings = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'store.db'}",
                        visibility_timeout_s=2000, restore_interval_s=7, lock_ttl_s=60)
    rt = runtime.distributed(settings)
    try:
        assert isinstance(rt.lock, RedisCaseLock)
        assert rt.lock.released_ttl_ms == (2000 + 7 + 60) * 1000
    finally:
        rt.env.store.dispose()
        runtime.configure(None)


# -- the embedded runtime's fleet lock (decision 158) ------------------------------------------


def test_fleet_lock_holds_this_machine_and_the_fleet(backend: Backend, tmp_path: Path) -> None:
    """`run` in a fleet's shell takes the fleet's Redis lease besides its file lock: a
    fleet trial ran `run` beside a live dispatch of the same case, and both paid for model
    calls until one stopped with STALE_STATE."""
    from workers.locks import FileCaseLock, FleetCaseLock

    case_id = backend.case_id()
    run = FleetCaseLock(FileCaseLock(tmp_path), backend.lock())
    token = run.acquire(case_id)
    with pytest.raises(LockBusy) as busy:  # a worker's dispatch anywhere
        backend.lock().acquire(case_id)
    assert busy.value.expires_in_s is not None
    with pytest.raises(LockBusy):  # a second run on this machine, whatever its Redis
        FileCaseLock(tmp_path).acquire(case_id)
    assert run.holder(case_id) == token
    assert run.hold(case_id, token) and run.renew(case_id, token)
    assert not run.hold(case_id, "another token")
    assert run.release(case_id, token) is True
    assert run.holder(case_id) is None
    other = FileCaseLock(tmp_path)  # both are free again
    other.release(case_id, other.acquire(case_id))
    backend.lock().release(case_id, backend.lock().acquire(case_id))


def test_fleet_lock_refuses_beside_a_dispatch_and_gives_the_file_lock_back(
        backend: Backend, tmp_path: Path) -> None:
    from workers.locks import FileCaseLock, FleetCaseLock

    case_id = backend.case_id()
    dispatch = backend.lock()
    held = dispatch.acquire(case_id)
    run = FleetCaseLock(FileCaseLock(tmp_path), backend.lock())
    with pytest.raises(LockBusy) as busy:
        run.acquire(case_id)
    assert busy.value.expires_in_s is not None and 0 < busy.value.expires_in_s <= TTL_S
    assert dispatch.holder(case_id) == held  # the dispatch's lease is untouched
    files = FileCaseLock(tmp_path)  # the refused run left no file lock behind
    files.release(case_id, files.acquire(case_id))


def test_fleet_lock_sees_a_dispatch_that_took_the_lapsed_lease(
        backend: Backend, tmp_path: Path) -> None:
    """A run that waited out a backoff longer than its lease: the lease is re-taken if
    nobody took it, and the run stops if a dispatch did."""
    from workers.locks import FileCaseLock, FleetCaseLock

    case_id = backend.case_id()
    run = FleetCaseLock(FileCaseLock(tmp_path), backend.lock())
    token = run.acquire(case_id)
    expire_now(backend.client(), case_id)
    assert run.hold(case_id, token)  # lapsed, nobody took it: re-taken
    expire_now(backend.client(), case_id)
    backend.lock().acquire(case_id)  # a dispatch took it
    assert not run.hold(case_id, token)
    assert run.release(case_id, token) is False  # never deletes the dispatch's lease
    assert backend.lock().holder(case_id) not in (None, token)
