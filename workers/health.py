"""Health checks of a deployment: broker, lock Redis, store, migrations, workers, queue,
beat.

``investigate health`` runs them (``docs/operations.md`` "Health"); each check is one
:class:`Check` with ``ok`` and a one-line ``detail``. Nothing is created or migrated.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis
from sqlalchemy import text
from sqlalchemy.engine import make_url

from investigation.text_safety import url_for_display
from workers.settings import Settings, deployment_identity

#: The queue Celery sends a task to when the sender names none.
CELERY_DEFAULT_QUEUE = "celery"
#: Checks in the order they run; ``investigate health --check NAME`` picks some.
CHECKS = ("broker", "locks", "store", "migrations", "workers", "queue", "beat")
#: kombu's Redis transport keeps priority messages in extra lists named
#: ``queue + "\\x06\\x16" + priority`` (``kombu.transport.redis``, ``priority_steps``).
_PRIORITY_SEP = "\x06\x16"
_PRIORITY_STEPS = (3, 6, 9)


@dataclass
class Check:
    """The result of one check."""

    name: str
    ok: bool
    detail: str
    value: Any = None
    """The figure behind it, where there is one (workers answering, queue depth)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:300]


def _first_line_of(exc: BaseException, url: str) -> str:
    """:func:`_first_line` with the URL (as :func:`url_for_display` shows it) and its password, if
    any, masked."""
    line = _first_line(exc).replace(url, url_for_display(url))
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    return line.replace(password, "***") if password else line


def queue_depth(broker_url: str, queue: str, timeout_s: float = 2.0) -> int:
    """Messages waiting in ``queue`` on a Redis broker (all priority lists).

    Raises:
        redis.exceptions.RedisError: the broker cannot be reached.
    """
    client = redis.Redis.from_url(broker_url, socket_timeout=timeout_s,
                                  socket_connect_timeout=timeout_s)
    try:
        names = [queue] + [f"{queue}{_PRIORITY_SEP}{p}" for p in _PRIORITY_STEPS]
        pipe = client.pipeline()
        for name in names:
            pipe.llen(name)
        return int(sum(pipe.execute()))
    finally:
        client.close()


def dispatch_lease(settings: Settings, case_id: str) -> dict[str, Any]:
    """The lease of the dispatch that holds the case's lock (workers renew it at every
    stage): ``dispatch_lease_s``, its seconds left (``0.0`` when none holds it, ``None``
    when Redis cannot tell: a fleet trial saw nothing of the lock that kept a case
    waiting after a worker died), and, while held, ``dispatch_holder`` (the process that
    took or last renewed it, ``name@host pid N``) and ``dispatch_renewed_s_ago`` (a
    second fleet trial could not tell a live holder from a dead one); a lock key without
    a TTL (never the engine's) is ``dispatch_lease_s`` null with
    ``dispatch_lease_expires`` false. Never raises for Redis."""
    from workers.locks import RedisCaseLock

    try:
        client = redis.Redis.from_url(settings.effective_redis_url, socket_timeout=2.0,
                                      socket_connect_timeout=2.0)
        with contextlib.closing(client):
            holder = RedisCaseLock(client, settings.lock_ttl_s).lease_holder(case_id)
    except redis.RedisError:
        return {"dispatch_lease_s": None}
    if holder is None:
        return {"dispatch_lease_s": 0.0}
    if holder.lease_s is None:  # a key without a TTL: held until someone ends it
        return {"dispatch_lease_s": None, "dispatch_lease_expires": False,
                "dispatch_holder": holder.name, "dispatch_renewed_s_ago": None}
    if holder.lease_s <= 0:
        return {"dispatch_lease_s": 0.0}
    return {"dispatch_lease_s": max(0.1, holder.lease_s), "dispatch_holder": holder.name,
            "dispatch_renewed_s_ago": holder.renewed_s_ago}


def dispatch_fields(settings: Settings, case_id: str) -> dict[str, Any]:
    """What ``status`` adds on a fleet shell for an investigating case:
    :func:`dispatch_lease`'s fields, ``queue`` and ``queue_waiting`` (messages no worker
    has taken, of any case: a dispatch sent while none ran waits there, and "dispatch
    again" would only queue another; ``None`` when the broker cannot tell). Asked whether
    or not a dispatch holds the case: ``investigate dispatch`` takes the lease itself, so
    a dispatch sent while no worker ran read as held by a worker (a fleet trial). Never
    raises for Redis."""
    info = dispatch_lease(settings, case_id)
    info["queue"] = settings.queue
    try:
        info["queue_waiting"] = queue_depth(settings.broker_url, settings.queue)
    except redis.RedisError:  # a status read never fails on the broker
        info["queue_waiting"] = None
    return info


def dispatch_held(info: dict[str, Any]) -> bool:
    """Whether :func:`dispatch_fields` (merged into a status) say a dispatch holds the
    case: a lease with time left, or a lock key that never expires."""
    return bool(info.get("dispatch_lease_s")) or info.get("dispatch_lease_expires") is False


def redis_ping(url: str, timeout_s: float) -> None:
    """PING the Redis at ``url`` within ``timeout_s`` seconds.

    Raises:
        redis.RedisError: it cannot be reached or did not answer.
    """
    client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                  socket_connect_timeout=timeout_s)
    try:
        client.ping()
    finally:
        client.close()


def check_broker(settings: Settings, timeout_s: float) -> Check:
    from kombu import Connection  # type: ignore[attr-defined]

    try:
        # Reads bounded too: a broker that takes the connection and never answers held
        # `health` forever (a hostile trial; kombu's socket_timeout).
        with Connection(settings.broker_url, connect_timeout=timeout_s,
                        transport_options={"socket_timeout": timeout_s}) as conn:
            conn.ensure_connection(max_retries=1, timeout=timeout_s)
    except ImportError:
        raise
    except Exception as exc:
        return Check("broker", False, f"{url_for_display(settings.broker_url)}: {_first_line_of(exc, settings.broker_url)}")
    return Check("broker", True, url_for_display(settings.broker_url))


def check_locks(settings: Settings, timeout_s: float) -> Check:
    url = settings.effective_redis_url
    try:
        redis_ping(url, timeout_s)
    except redis.exceptions.RedisError as exc:
        return Check("locks", False, f"{url_for_display(url)}: {_first_line_of(exc, url)}")
    return Check("locks", True, url_for_display(url))


def check_store(settings: Settings, timeout_s: float) -> Check:
    from investigation.store import Store

    url = settings.effective_database_url
    if make_url(url).get_backend_name() == "sqlite":
        path = make_url(url).database or ""
        from pathlib import Path

        if not Path(path).is_file():
            return Check("store", False, f"{url_for_display(url)}: no such file (no case was added)")
    try:
        store = Store(url)
        with store.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        store.dispose()
    except Exception as exc:
        return Check("store", False, f"{url_for_display(url)}: {_first_line_of(exc, url)}")
    return Check("store", True, url_for_display(url))


def check_migrations(settings: Settings, timeout_s: float) -> Check:
    from investigation.store import Store
    from investigation.store.migrate import current_revisions, head_revision

    url = settings.effective_database_url
    head = head_revision()
    try:
        store = Store(url)
        current = current_revisions(store.engine)
        store.dispose()
    except Exception as exc:
        return Check("migrations", False, f"cannot read the migration version: "
                                          f"{_first_line_of(exc, url)}")
    if current != [head]:
        return Check("migrations", False,
                     f"at {', '.join(current) or 'none'}, needs {head}: run "
                     "`investigate db upgrade`", current)
    return Check("migrations", True, f"at head {head}", current)


def check_workers(settings: Settings, timeout_s: float, min_workers: int = 1) -> Check:
    """Workers that answer a broadcast ``ping`` within ``timeout_s`` and consume
    ``settings.queue`` (``inspect active_queues``): at least ``min_workers`` of them.

    A worker that answers but reads other queues leaves this deployment's dispatches
    waiting, so it does not count. ``value`` is the names of the consuming workers."""
    from workers.celery_app import app, configure

    configure(settings)
    try:
        replies = app.control.ping(timeout=timeout_s) or []
        names = sorted(name for reply in replies for name in reply)
        queues: dict[str, list[str]] = {}
        if names:
            active = app.control.inspect(destination=names, timeout=timeout_s)
            for worker, entries in (active.active_queues() or {}).items():
                queues[worker] = sorted(str(q.get("name")) for q in entries or [])
    except Exception as exc:
        return Check("workers", False,
                     f"ping failed: {_first_line_of(exc, settings.broker_url)}", 0)
    consuming = [n for n in names if settings.queue in queues.get(n, [])]
    ok = len(consuming) >= min_workers
    disagree = _identities_disagree(app, settings, consuming, timeout_s)
    if disagree:
        ok = False
    detail = f"{len(names)} answered ping" + (f": {', '.join(names)}" if names else "")
    if names:
        detail += f"; {len(consuming)} consume queue {settings.queue!r}"
        others = sorted({q for n in names if n not in consuming for q in queues.get(n, [])})
        if not consuming:
            detail += (f" (they read {', '.join(others) or 'no queue'}: start a worker with "
                       f"INVESTIGATE_QUEUE={settings.queue} or dispatch to their queue)")
    if len(consuming) < min_workers:
        detail += f" (at least {min_workers} needed)"
    if disagree:
        detail += f"; {disagree}"
    return Check("workers", ok, detail, consuming)


def _identities_disagree(app: Any, settings: Settings, workers: list[str],
                         timeout_s: float) -> str:
    """What the consuming ``workers`` disagree on (``settings.deployment_identity``:
    store, lock Redis, policy and providers files as each read them at start, feedback
    key), among themselves or with this shell (for the policy and providers files, when
    this shell names one), and which workers' policy
    or providers file changed on disk since they started; ``""`` when all agree. A worker
    too old to answer is left out."""
    if not workers:
        return ""
    try:
        replies = app.control.broadcast("investigation_identity", destination=workers,
                                        reply=True, timeout=timeout_s,
                                        limit=len(workers)) or []  # no wait once all answer
    except Exception:  # ping answered: an old or busy worker is not a disagreement
        return ""
    seen: dict[str, dict[str, str]] = {}
    for reply in replies:
        for worker, ident in (reply or {}).items():
            if isinstance(ident, dict) and "store" in ident:
                seen[worker] = {k: str(v) for k, v in ident.items()}
    mine = deployment_identity(settings)
    problems = []
    for key in ("policy", "providers"):  # edited on disk since the worker read it
        changed = sorted(w for w, ident in seen.items()
                         if ident.get(f"{key}_now", ident.get(key)) != ident.get(key))
        if changed:
            first = seen[changed[0]]
            problems.append(f"the {key} file changed on disk since {', '.join(changed)} "
                            "started (" + _reload_advice(key, first.get(f"{key}_path"),
                                                         first.get(f"{key}_now")) + ")")
    for key in ("store", "locks", "policy", "providers", "feedback"):
        values: dict[str, list[str]] = {}
        for worker, ident in sorted(seen.items()):
            if key in ident or key != "feedback":  # a worker before the feedback id
                values.setdefault(ident.get(key, "?"), []).append(worker)
        if len(values) > 1:
            def who(worker: str, key: str = key) -> str:
                path = seen[worker].get(f"{key}_path")  # which file, for the operator
                return f"{worker} ({path})" if path else worker

            problems.append(f"workers disagree on their {_NAMES.get(key, key)}: " + "; ".join(
                f"{', '.join(who(w) for w in ws)}: {v}" for v, ws in sorted(values.items()))
                + (_FEEDBACK_ADVICE if key == "feedback" else ""))
        elif key == "feedback" and values and mine[key] != "none" \
                and mine[key] not in values:
            # A shell without a key (a monitoring host, say) shows no secret: no failure.
            theirs = next(iter(values))
            path = seen[values[theirs][0]].get("feedback_path")
            problems.append(f"the workers' feedback key is {theirs} ({path}), this shell's "
                            f"{mine[key]} ({mine['feedback_path']}){_FEEDBACK_ADVICE}")
        elif key in ("store", "locks") and values and mine[key] not in values:
            problems.append(f"the workers' {key} is {next(iter(values))}, this shell's "
                            f"{mine[key]}")
        elif key in ("policy", "providers") and values and mine[key] != "none" \
                and mine[key] not in values:
            # This shell names a file the workers did not start with (a fleet trial pointed
            # INVESTIGATE_PROVIDERS elsewhere; the workers ran the old file, health was ok).
            theirs = next(iter(values))
            path = seen[values[theirs][0]].get(f"{key}_path") or "none"
            problems.append(f"the workers' {key} file is {path} ({theirs}), this shell's "
                            f"{mine[f'{key}_path']} ({mine[key]}): restart the workers with "
                            "this shell's settings, or point this shell at theirs")
    return "; ".join(problems)


#: How a disagreement is named, where the identity's key is not the word.
_NAMES = {"feedback": "feedback key"}
#: Why a feedback key must be one and the same (docs/async-tests.md).
_FEEDBACK_ADVICE = (": a test's feedback secret that `investigate tests list` shows is "
                    "derived from the key, so the workers refuse one made with another; give "
                    "every worker and this shell the same INVESTIGATE_FEEDBACK_KEY_FILE (or "
                    "INVESTIGATE_HOME, or INVESTIGATE_FEEDBACK_KEY) and restart the odd one")


def _reload_advice(key: str, path: str | None, now: str | None) -> str:
    """What to do about a ``key`` file ("policy" or "providers") edited under running
    workers: restart them, unless the file no longer loads, where a restarted worker
    would refuse to start (a fleet trial followed "restart them" into a fleet that would
    not start). ``now`` is the worker's own reading of the file (``"unreadable"``); the
    file is loaded here, as a worker's runtime loads it, when this host has that path."""
    from investigation.errors import InvestigationError
    from workers.runtime import load_files

    fix = "; fix it first, a worker refuses a broken file at start, then restart them"
    if now == "unreadable":
        return f"and the worker cannot read it now{fix}"
    if path and Path(path).is_file():
        try:
            load_files(path, None) if key == "policy" else load_files(None, path)
        except InvestigationError as exc:
            return f"and it does not load now: {exc.code}: {exc.message}{fix}"
    return "restart them to load it"


def check_queue(settings: Settings, timeout_s: float, max_queue: int | None = None) -> Check:
    try:
        depth = queue_depth(settings.broker_url, settings.queue, timeout_s)
    except redis.exceptions.RedisError as exc:
        return Check("queue", False,
                     f"{settings.queue}: {_first_line_of(exc, settings.broker_url)}")
    ok = max_queue is None or depth <= max_queue
    detail = f"{settings.queue}: {depth} message(s) waiting" + \
        ("" if ok else f" (more than {max_queue})")
    if settings.queue != CELERY_DEFAULT_QUEUE:
        # A dispatch sent by name without queue= lands in Celery's default queue, which no
        # worker here reads: it waits there without a word (an integrator's trial).
        with contextlib.suppress(redis.exceptions.RedisError):
            stray = queue_depth(settings.broker_url, CELERY_DEFAULT_QUEUE, timeout_s)
            if stray:
                detail += (f"; {stray} message(s) wait in Celery's default queue "
                           f"{CELERY_DEFAULT_QUEUE!r}, which these workers do not read "
                           f"(a dispatch sent without queue={settings.queue!r}?)")
    return Check("queue", ok, detail, depth)


def check_beat(settings: Settings, timeout_s: float) -> Check:
    """Whether exactly one beat sends this queue's recovery sweeps to this shell's broker:
    the beats' heartbeats (``workers.beat``, at most a minute old; on this host only those
    whose process still runs) in the lock Redis. Without sweeps
    (``INVESTIGATE_SWEEP_INTERVAL_S=0``) there is nothing to check."""

    from workers.beat import HEARTBEAT_EVERY_S, HEARTBEAT_TTL_S

    if settings.sweep_interval_s <= 0:
        return Check("beat", True, "recovery sweeps are off (INVESTIGATE_SWEEP_INTERVAL_S=0)")
    url = settings.effective_redis_url
    try:
        beats = live_beats(settings, timeout_s)
    except redis.exceptions.RedisError as exc:
        return Check("beat", False, f"{url_for_display(url)}: {_first_line_of(exc, url)}")
    if not beats:
        return Check("beat", False, f"no beat has left its heartbeat for queue "
                     f"{settings.queue!r} in {url_for_display(url)} in the last {HEARTBEAT_TTL_S} s: "
                     "run `investigate beat` (one per deployment, with this shell's "
                     "INVESTIGATE_BROKER_URL and INVESTIGATE_REDIS_URL); without it no added "
                     "case starts by itself and none is taken up again after its worker "
                     f"died. If a beat runs, a Redis that lost its keys (restarted, "
                     f"flushed) holds no heartbeat until the beat's next one, at most "
                     f"{HEARTBEAT_EVERY_S:g} s later: check again then before starting "
                     "another (two beats send every sweep twice)")
    named = [f"{b.get('host')} (pid {b.get('pid')})" for b in beats]
    broker = url_for_display(settings.broker_url)
    problems = []
    if len(beats) > 1:
        problems.append(f"{len(beats)} beats run ({', '.join(named)}): run exactly one per "
                        f"deployment, or each sweep goes out {len(beats)} times")
    for name, beat in zip(named, beats, strict=True):
        if beat.get("broker") != broker:
            problems.append(f"the beat on {name} sends its sweeps to {beat.get('broker')}, "
                            f"not to this shell's broker {broker}")
        if not beat.get("sweep_interval_s"):
            problems.append(f"the beat on {name} runs with INVESTIGATE_SWEEP_INTERVAL_S=0: "
                            "it sends no sweep")
    if problems:
        return Check("beat", False, "; ".join(problems), named)
    beat = beats[0]
    return Check("beat", True, f"beat on {named[0]}, last seen {beat.get('at')}; sweep every "
                 f"{beat.get('sweep_interval_s')} s", named)


def live_beats(settings: Settings, timeout_s: float) -> list[dict[str, Any]]:
    """The beats of ``settings.queue`` whose heartbeat (a field of ``REDIS_BEAT_KEY`` in
    the lock Redis) is at most ``HEARTBEAT_TTL_S`` old, leaving out one of this host whose
    process no longer runs (killed here: no need to wait for its heartbeat to age out).

    Raises:
        redis.exceptions.RedisError: the lock Redis does not answer within ``timeout_s``.
    """
    import json
    import socket
    import time

    from investigation.constants import REDIS_BEAT_KEY
    from workers.beat import HEARTBEAT_TTL_S, heartbeat_age_s

    client = redis.Redis.from_url(settings.effective_redis_url, socket_timeout=timeout_s,
                                  socket_connect_timeout=timeout_s)
    try:
        heartbeats = client.hgetall(REDIS_BEAT_KEY.format(queue=settings.queue)).values()
    finally:
        client.close()
    now, here = time.time(), socket.gethostname()
    beats = []
    for raw in heartbeats:
        if heartbeat_age_s(raw, now) > HEARTBEAT_TTL_S:
            continue
        beat = json.loads(raw)
        if beat.get("host") == here and not _process_runs(beat.get("pid")):
            continue
        beats.append(beat)
    return beats


def _process_runs(pid: object) -> bool:
    """Whether a process of this host with ``pid`` runs (a zombie counts as gone)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True  # no /proc: kill(0) said it runs


def run_checks(settings: Settings, names: list[str] | None = None, timeout_s: float = 2.0,
               min_workers: int = 1, max_queue: int | None = None) -> list[Check]:
    """Run the named checks (all of :data:`CHECKS` by default), in that order."""
    runners: dict[str, Callable[[], Check]] = {
        "broker": lambda: check_broker(settings, timeout_s),
        "locks": lambda: check_locks(settings, timeout_s),
        "store": lambda: check_store(settings, timeout_s),
        "migrations": lambda: check_migrations(settings, timeout_s),
        "workers": lambda: check_workers(settings, timeout_s, min_workers),
        "queue": lambda: check_queue(settings, timeout_s, max_queue),
        "beat": lambda: check_beat(settings, timeout_s),
    }
    wanted = [n for n in CHECKS if names is None or n in names]
    results: list[Check] = []
    for name in wanted:
        if name == "migrations" and any(c.name == "store" and not c.ok for c in results):
            results.append(Check("migrations", False, "skipped: the store is unavailable"))
            continue
        if name in ("workers", "queue") and any(c.name == "broker" and not c.ok
                                                 for c in results):
            results.append(Check(name, False, "skipped: the broker is unavailable"))
            continue
        if name == "beat" and any(c.name == "locks" and not c.ok for c in results):
            results.append(Check(name, False, "skipped: the lock Redis is unavailable"))
            continue
        results.append(runners[name]())
    return results
