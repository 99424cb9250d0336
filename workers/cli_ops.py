"""Fleet commands: ``worker``, ``beat``, ``flower``, ``metrics``, ``cases``, ``health`` and
``db upgrade|current`` (``docs/operations.md``).

Registered on the main app by ``workers.cli`` (:func:`register`); the same exit codes
apply (0 fine, 1 see each command, 2 a controlled error ``error CODE: message``).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import logging
import os
import re
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from investigation.constants import STEP_ERROR
from investigation.errors import InvestigationError
from workers.cli import (
    JsonListOpt,
    JsonOpt,
    _controlled,
    _fleet_shell,
    _service,
    _settings,
    _store,
    _term,
    case_guidance,
    err,
    example,
    out,
)
from workers.views import Fitted

if TYPE_CHECKING:
    from investigation.overview import CaseRow
    from workers.settings import Settings

db_app = typer.Typer(help="The store's schema migrations (Alembic).", no_args_is_help=True,
                     epilog=example("investigate db current", "investigate db upgrade"))


#: The log levels Celery's ``--loglevel`` takes.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(value: str) -> str:
    """``--loglevel`` in any letter case, checked here: Celery's own check raised from
    inside the command, an INTERNAL_ERROR with a traceback (a hostile trial)."""
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise typer.BadParameter(f"{value!r}: use {', '.join(LOG_LEVELS)}")
    return level


LogLevelOpt = Annotated[str, typer.Option(
    "--loglevel", callback=_log_level, help="DEBUG, INFO, WARNING, ERROR or CRITICAL")]


def register(app: typer.Typer) -> None:
    """Add this module's commands to the ``investigate`` app."""
    app.command("worker", epilog=example(
        "investigate worker -n w1@%h --concurrency 2",
        "investigate worker -n w1@%h --beat --metrics-port 9100",
        "investigate worker -n w1@%h --soft-time-limit 600 --time-limit 660"))(worker)
    app.command("beat", epilog=example("investigate beat"))(beat)
    app.command("flower", epilog=example(
        "investigate flower --port 5555",
        "FLOWER_BASIC_AUTH=ops:secret investigate flower --address 0.0.0.0"))(flower)
    app.command("metrics", epilog=example("investigate metrics --port 9808"))(metrics_cmd)
    app.command("cases", epilog=example("investigate cases", "investigate cases --state blocked",
                                        "investigate cases --json"))(cases)
    app.command("health", epilog=example("investigate health",
                                         "investigate health --check store --check workers",
                                         "investigate health --json"))(health)
    app.add_typer(db_app, name="db")


# -- processes ----------------------------------------------------------------------------


def _url_host(address: str) -> str:
    """``address`` as a URL's host: an IPv6 address in brackets (``http://::1:9808`` is
    no URL: a hostile trial)."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def _node_name(name: str) -> str:
    from celery.utils.nodenames import default_nodename, host_format

    return str(default_nodename(host_format(name)))


def _refuse_taken_name(settings: Settings, nodename: str) -> None:
    """Celery only warns about a duplicate node name; two workers under one name look like
    one in Flower and split its replies, so a name that answers ping is refused."""
    import subprocess

    # Asked from a separate process: a ping from this one leaves kombu's reply consumer
    # behind, and the worker's warm shutdown would then never finish.
    probe = ("import json, sys\nfrom celery import Celery\n"
             "app = Celery(broker=sys.argv[1])\n"
             "print(json.dumps(app.control.ping(destination=[sys.argv[2]], timeout=1.0)))\n")
    try:
        done = subprocess.run([sys.executable, "-c", probe, settings.broker_url, nodename],
                              capture_output=True, text=True, timeout=30, check=True)
        replies = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return  # the broker is down: the worker reports that itself when it starts
    if any(nodename in reply for reply in replies):
        raise InvestigationError("WORKER_NAME_TAKEN",
                                 f"a worker named {nodename} already answers ping; start this "
                                 "one with another -n NAME@%h")


@_service
@_controlled
def worker(
    name: Annotated[str | None, typer.Option(
        "--name", "-n", help="Celery node name, NAME@%h (%h: this host's name); unique per "
        "worker. Default: QUEUE@%h")] = None,
    concurrency: Annotated[int, typer.Option(
        "--concurrency", "-c", min=1, help="worker processes (prefork children)")] = 2,
    queue: Annotated[str | None, typer.Option(
        "--queue", "-Q", help="the case queue (default INVESTIGATE_QUEUE, 'cases')")] = None,
    loglevel: LogLevelOpt = "INFO",
    pool: Annotated[str, typer.Option("--pool", help="prefork or solo")] = "prefork",
    beat: Annotated[bool, typer.Option(
        "--beat", help="also run the periodic recovery sweep (start exactly one such worker, "
        "or run `investigate beat` instead)")] = False,
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", min=0, max=65535,
        help="serve Prometheus metrics on this port (0: a free one)"
    )] = None,
    metrics_address: Annotated[str, typer.Option(
        "--metrics-address", help="the address the metrics endpoint binds")] = "127.0.0.1",
    soft_time_limit: Annotated[float | None, typer.Option(
        "--soft-time-limit", min=0.001, help="seconds a task may run before Celery raises "
        "SoftTimeLimitExceeded in it (default: none)")] = None,
    time_limit: Annotated[float | None, typer.Option(
        "--time-limit", min=0.001, help="seconds a task may run before Celery kills its "
        "process (default: none)")] = None,
) -> None:
    """Start a Celery worker on the configured broker and case queue.

    Only process-based pools: the isolated SQL children are forked, which needs no other
    thread of the worker process to be inside SQLite (threads/gevent pools are refused).
    SIGTERM is a warm shutdown (running tasks finish, nothing new starts); SIGQUIT a cold
    one (running tasks stop and are delivered again: late acks).

    Time limits are Celery's own (--soft-time-limit, --time-limit), per task, i.e. per
    stage. A stage stopped by one is recorded once as STAGE_TIME_LIMIT: a query becomes a
    failed result and the case goes on; any other stage parks the case BLOCKED
    (STAGE_TIME_LIMIT) until the limit is raised and the case resumed. Keep the limits
    above the stages' own bounds (provider timeout_s, tools.sql_timeout_s + 1,
    tools.search_timeout_s), and the soft limit below the hard one.
    """
    if pool not in ("prefork", "solo"):
        raise typer.BadParameter("use --pool prefork or --pool solo", param_hint="--pool")
    if soft_time_limit is not None and time_limit is not None \
            and soft_time_limit >= time_limit:
        raise typer.BadParameter("the soft time limit must be below --time-limit",
                                 param_hint="--soft-time-limit")
    if queue:
        os.environ["INVESTIGATE_QUEUE"] = queue  # the pool children read it too
    settings = _settings()  # a broken environment fails here, as one line
    for option, limit in (("--soft-time-limit", soft_time_limit), ("--time-limit", time_limit)):
        if limit is not None and limit >= settings.lock_ttl_s:
            # A stage outliving the case lock's lease loses the lock; its time limit could
            # then not be recorded by the chain that ran it.
            raise typer.BadParameter(
                f"keep it below INVESTIGATE_LOCK_TTL_S ({settings.lock_ttl_s:g} s), or raise "
                "that", param_hint=option)
    nodename = _node_name(name or f"{settings.queue}@%h")
    _refuse_taken_name(settings, nodename)
    _check_runtime(settings)
    if metrics_port is not None:
        from workers import metrics

        safe = re.sub(r"[^A-Za-z0-9_.@-]", "_", nodename)
        metrics.enable_multiprocess((settings.home / "metrics" / safe).resolve())
        port = metrics.serve_worker(metrics_port, metrics_address)
        from workers import logs

        url = f"http://{_url_host(metrics_address)}:{port}/metrics"
        logs.write_line(settings.log_format, logging.INFO, f"metrics on {url}",
                        logger="workers.worker", metrics=url)
    from workers.celery_app import app as celery_app
    from workers.celery_app import configure

    configure(settings)
    argv = ["worker", f"--loglevel={loglevel}", f"--concurrency={concurrency}",
            f"--pool={pool}", "-Q", settings.queue, "-E", "-n", nodename]
    if soft_time_limit is not None:
        argv.append(f"--soft-time-limit={soft_time_limit:g}")
    if time_limit is not None:
        argv.append(f"--time-limit={time_limit:g}")
    if beat:
        settings.home.mkdir(parents=True, exist_ok=True)
        argv += ["-B", f"--schedule={settings.home / 'celerybeat-schedule'}"]
    celery_app.worker_main(argv)


def _check_runtime(settings: Settings) -> None:
    """Build, once in the main process, what every pool child builds at its first task
    (``workers.runtime.build_env``): the policy and providers files (each provider's API
    key variable set, when it names one), the store reachable
    and at this engine's schema (created there when ``INVESTIGATE_AUTO_MIGRATE``), and the
    case locks' Redis answering. A
    worker that cannot is refused before it joins the queue, with the error's code (a
    fleet trial: such a worker started, answered ping, and failed the first stage of
    every case it took while the case's lock stayed held for its whole lease).

    Raises:
        InvestigationError: ``CONFIG_*``, ``PROVIDER_BAD_CONFIG``,
            ``PROVIDER_CREDENTIALS_MISSING`` (a provider's ``api_key_env`` variable is unset
            here), ``STORE_NOT_MIGRATED`` (reported by :func:`_controlled` as one line,
            exit 2);
        sqlalchemy.exc.SQLAlchemyError: the store cannot be reached (``STORE_UNAVAILABLE``).
        redis.RedisError: the case locks' Redis cannot be reached (``REDIS_UNAVAILABLE``).
    """
    from sqlalchemy.engine import make_url

    from workers.runtime import build_env

    url = settings.effective_database_url
    parsed = make_url(url)
    if not settings.auto_migrate and parsed.get_backend_name() == "sqlite" \
            and not Path(parsed.database or "").is_file():
        # Refused without opening it (SQLite would leave an empty file behind).
        raise InvestigationError(
            "STORE_NOT_MIGRATED", f"{url} does not exist and INVESTIGATE_AUTO_MIGRATE is "
            "off: create it with `investigate db upgrade` first")
    env = build_env(settings, adopt_frozen=True)
    env.store.dispose()  # each child opens its own connections
    if env.gateway_factory is not None:
        # A key variable unset in this environment blocks every case at its first model
        # call (a fleet trial: the workers started and `health` said ok).
        for provider in env.gateway_factory().providers:
            provider.check_credentials()
    # The case locks' Redis: a worker that cannot reach it failed every stage it took,
    # while the case stayed held for the lease (a fleet trial: six minutes of a stalled
    # fleet behind one worker with a wrong INVESTIGATE_REDIS_URL).
    from workers.health import redis_ping

    try:
        redis_ping(settings.effective_redis_url, 3.0)
    except ValueError as exc:  # a broker URL that is not Redis's (amqp://, sentinel://)
        raise InvestigationError(
            "CONFIG_INVALID", f"the case locks need a Redis URL ({exc}); set "
            "INVESTIGATE_REDIS_URL when the broker is not a redis:// one") from None
    # Where this worker's state and locks are: a worker pointed elsewhere than its fleet
    # shows it here (two fleet trials: another database, another lock Redis).
    from workers.settings import deployment_identity

    identity = deployment_identity(settings)
    # A log line like the worker's others: a time and a level in text logs, an object
    # with `store` and `locks` in JSON logs (a plain line, two trials).
    from workers import logs

    logs.write_line(settings.log_format, logging.INFO,
                    f"store {identity['store']}; case locks {identity['locks']}",
                    logger="workers.worker", store=identity["store"], locks=identity["locks"])


@_service
@_controlled
def beat(
    loglevel: LogLevelOpt = "INFO",
    schedule: Annotated[Path | None, typer.Option(
        "--schedule", help="beat's state file (default INVESTIGATE_HOME/celerybeat-schedule)"
    )] = None,
) -> None:
    """Run Celery beat alone: it sends the recovery sweep every INVESTIGATE_SWEEP_INTERVAL_S
    (run exactly one per deployment, and no worker with --beat beside it)."""
    settings = _settings()
    from workers.celery_app import app as celery_app
    from workers.celery_app import configure

    _refuse_a_second_beat(settings)
    configure(settings)
    path = schedule or settings.home / "celerybeat-schedule"
    path.parent.mkdir(parents=True, exist_ok=True)
    # Its scheduler (the app's beat_scheduler) leaves a heartbeat in the lock Redis for
    # `health` (decision 160).
    celery_app.start(["beat", f"--loglevel={loglevel}", f"--schedule={path}"])


def _refuse_a_second_beat(settings: Settings) -> None:
    """Refuse to start beside a live beat of the same queue (its heartbeat in the lock
    Redis, ``health.live_beats``): two beats send every sweep twice (a fleet trial started
    one beside the cluster's; only `health` said so). Workers refuse a taken name the same
    way (``WORKER_NAME_TAKEN``). A Redis that cannot be read is left to beat itself.

    Raises:
        InvestigationError: ``BEAT_RUNNING``.
    """
    from redis.exceptions import RedisError

    from workers.beat import HEARTBEAT_TTL_S
    from workers.health import live_beats

    try:
        beats = live_beats(settings, 5.0)
    except RedisError:
        return
    if beats:
        named = ", ".join(f"{b.get('host')} (pid {b.get('pid')}, last seen {b.get('at')})"
                          for b in beats)
        raise InvestigationError(
            "BEAT_RUNNING", f"a beat already sends the recovery sweeps of queue "
            f"{settings.queue!r}: {named}; run exactly one per deployment (a second sends every sweep "
            f"twice). Stop that one first; one that died on another host is forgotten "
            f"{HEARTBEAT_TTL_S} s after its last heartbeat")


def _loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _login_entry(entry: str) -> bool:
    """Whether ``entry`` is ``USER:PASSWORD`` with both parts non-blank."""
    user, colon, password = entry.partition(":")
    return bool(colon and user.strip() and password.strip())


@_service
@_controlled
def flower(
    port: Annotated[int, typer.Option("--port", min=1, max=65535,
                                      help="the TCP port Flower listens on")] = 5555,
    address: Annotated[str, typer.Option(
        "--address", help="listen address; anything but loopback needs a login")] = "127.0.0.1",
    basic_auth: Annotated[list[str] | None, typer.Option(
        "--basic-auth", help="USER:PASSWORD (repeatable; Flower's own option). Prefer "
        "FLOWER_BASIC_AUTH=user:pass[,user2:pass2] in the environment: arguments are "
        "visible to every local user")] = None,
    url_prefix: Annotated[str | None, typer.Option(
        "--url-prefix", help="serve under this path (behind a reverse proxy)")] = None,
    tasks_columns: Annotated[str, typer.Option(
        "--tasks-columns", help="columns of Flower's tasks page (Flower's tasks_columns)")
    ] = "name,args,state,result,received,runtime,worker",
) -> None:
    """Start Flower (Celery's monitor) on the configured broker.

    Flower's own authentication options apply (--basic-auth, or its FLOWER_*
    environment variables such as FLOWER_BASIC_AUTH, FLOWER_AUTH with
    FLOWER_AUTH_PROVIDER). Without any, it listens only on loopback.
    """
    _settings()  # a broken environment fails here, as one line
    for entry in basic_auth or []:
        if not _login_entry(entry):
            raise typer.BadParameter("give USER:PASSWORD", param_hint="--basic-auth")
    from_env = os.environ.get("FLOWER_BASIC_AUTH", "")
    if from_env.strip() and not all(_login_entry(e) for e in from_env.split(",")):
        raise InvestigationError(
            "FLOWER_AUTH_INVALID", "FLOWER_BASIC_AUTH must be user:password[,user2:pass2], "
            "each with a user and a password")
    has_login = bool(basic_auth) or bool(from_env.strip()) or any(
        os.environ.get(v, "").strip() for v in ("FLOWER_AUTH", "FLOWER_AUTH_PROVIDER"))
    if not _loopback(address) and not has_login:
        raise InvestigationError(
            "FLOWER_AUTH_REQUIRED",
            f"Flower would listen on {address or 'every address'} without a login; set "
            "FLOWER_BASIC_AUTH=user:password (or --basic-auth, or Flower's OAuth "
            "FLOWER_AUTH/FLOWER_AUTH_PROVIDER), or keep --address 127.0.0.1 behind a proxy "
            "that authenticates")
    from workers.celery_app import app as celery_app

    argv = ["flower", f"--port={port}", f"--address={address}",
            f"--tasks_columns={tasks_columns}"]
    if basic_auth:
        # Passed through the environment, so Flower's own argv does not repeat them.
        os.environ["FLOWER_BASIC_AUTH"] = ",".join(basic_auth)
    if url_prefix:
        argv.append(f"--url_prefix={url_prefix.strip('/')}")
    try:
        celery_app.start(argv)
    except OSError as exc:
        if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        # Which address, as the exporter and the workers' metrics say (a fleet trial got
        # "Address already in use" alone).
        raise OSError(exc.errno, f"cannot serve Flower on {address}:{port}: "
                                 f"{exc.strerror or exc}") from exc


@_service
@_controlled
def metrics_cmd(
    port: Annotated[int, typer.Option(
        "--port", min=0, max=65535,
        help="the TCP port of the metrics endpoint (0: a free port)")] = 9808,
    address: Annotated[str, typer.Option(
        "--address", help="the address the metrics endpoint binds")] = "127.0.0.1",
) -> None:
    """Serve the fleet's gauges from the store (cases by state, blocked cases by reason,
    pending retries, idle cases, queue depth) for Prometheus; one per deployment."""
    from workers import health as health_mod
    from workers.metrics import StoreCollector, serve_store

    settings = _settings()
    store = _store(settings, existing=True)
    collector = StoreCollector(
        store, lambda: health_mod.queue_depth(settings.broker_url, settings.queue),
        settings.queue)
    server = serve_store(collector, port, address)
    err.print(f"metrics on http://{_url_host(address)}:{server.server_port}/metrics",
              highlight=False)
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait()


# -- looking at the fleet -----------------------------------------------------------------


def _utc_seconds(iso: str) -> str:
    """``iso`` (an aware ISO time) to the second, in UTC and said so (``...Z``): `cases`
    showed ``2026-12-07T12:35:31`` with no zone (a reader's trial)."""
    try:
        when = datetime.fromisoformat(iso)
    except ValueError:
        return iso[:19]
    if when.tzinfo is not None:
        when = when.astimezone(UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def next_step_hint(store: Any, row: CaseRow, settings: Settings) -> str | None:
    """What to do next for a case (the ``next`` column and field): the first command of
    the guidance ``investigate status`` prints (``investigation.guidance``) with the same
    ``settings`` (runtime, providers file, scripted reply file), so both commands say the
    same thing; ``None`` for a case that needs nothing (a case investigating needs
    something only when a worker's stage stopped its next step: last outcome ``ERROR``)."""
    if row.state not in ("BLOCKED", "PAUSED") and row.last_outcome != STEP_ERROR:
        return None
    return case_guidance(settings, store, row.case_id).first_command


@_controlled
def cases(
    state: Annotated[str | None, typer.Option(
        "--state", help="only this state: investigating, blocked, paused, "
        "building_diagnosis, cancelled, stopped")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="newest N cases")] = 200,
    as_json: JsonListOpt = False,
) -> None:
    """List cases: state, blocked reason, retry time, last step, balances, and for a
    blocked or paused case, or one whose next step failed on a worker (last outcome
    ERROR), the command that continues it."""
    from investigation.loop.outcome import last_outcome_text
    from investigation.overview import list_cases

    settings = _settings()
    store = _store(settings, existing=True)
    rows = list_cases(store, state, limit)
    for row in rows:
        row.next = next_step_hint(store, row, settings)
    if as_json:
        sys.stdout.write(json.dumps([r.to_dict() for r in rows], indent=2) + "\n")
        return
    if not rows:
        out.print("no cases" + (f" in state {state}" if state else ""), highlight=False)
        return
    table = Table("case", "state", "reason", "retry not before", "steps", "last outcome",
                  "balance", "hypotheses", "updated")
    for r in rows:
        table.add_row(
            r.case_id, r.state, r.blocked_reason or "",
            _utc_seconds(r.retry_not_before) if r.retry_not_before else "",
            str(r.steps),
            last_outcome_text(r.last_outcome, r.last_reason, none=""),
            f"{r.balance_units}/{r.credit_units}" if r.credit_units else "- (no step yet)",
            f"{r.active_hypotheses}/{r.hypotheses} active"
            if r.state not in ("CANCELLED", "STOPPED") else f"{r.hypotheses} (none runs)",
            # UTC, said (a reader took a bare time for local time).
            _utc_seconds(r.updated_at))
    # Never a cut cell: a code, a time or a balance is whole, in a table or, on a narrow
    # terminal, one block per case (a fleet trial read "INVALID_LLM_RESP…", a 500-step
    # case's reader "BUIL DING _DIA GNOS IS").
    out.print(Fitted(table))
    out.print(f"{len(rows)} case(s)", highlight=False)
    for r in rows:  # the command that continues each held case, one per line
        if r.next:
            out.print(_term(f"next for {r.case_id}: {r.next}"), highlight=False, markup=False)


@_controlled
def health(
    check: Annotated[list[str] | None, typer.Option(
        "--check", help="run only these checks (repeatable): broker, locks, store, "
        "migrations, workers, queue, beat")] = None,
    timeout: Annotated[float, typer.Option("--timeout", min=0.1,
                                           help="seconds per check")] = 2.0,
    min_workers: Annotated[int, typer.Option(
        "--min-workers", min=0, help="workers that must answer ping")] = 1,
    max_queue: Annotated[int | None, typer.Option(
        "--max-queue", min=0, help="fail when more messages wait in the case queue")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Check broker, lock Redis, store, migrations, workers answering ping, queue depth and
    beat's heartbeat.

    Exit 0 when every check passed, 1 when one failed (for liveness/readiness probes),
    2 for a broken setting.
    """
    from workers.health import CHECKS, run_checks

    unknown = [c for c in check or [] if c not in CHECKS]
    if unknown:
        raise typer.BadParameter(f"unknown check {unknown[0]!r}; use {', '.join(CHECKS)}",
                                 param_hint="--check")
    results = run_checks(_settings(), check or None, timeout, min_workers, max_queue)
    healthy = all(c.ok for c in results)
    if as_json:
        sys.stdout.write(json.dumps({"healthy": healthy,
                                     "checks": [c.to_dict() for c in results]},
                                    indent=2) + "\n")
    else:
        for c in results:
            out.print(_term(f"{'ok  ' if c.ok else 'FAIL'} {c.name:<10} {c.detail}"),
                      highlight=False, markup=False)
        out.print("healthy" if healthy else "unhealthy", highlight=False)
    if not healthy:
        raise typer.Exit(1)


# -- migrations ---------------------------------------------------------------------------


def _schema_store(settings: Settings, *, foreign_ok: bool = False,
                  must_exist: bool = False) -> Any:
    """The store the ``db`` commands work on. A SQLite file is looked at read-only first:
    a foreign one is refused (``STORE_FOREIGN``, unless ``foreign_ok``) before the engine's
    connection switches it to WAL, and with ``must_exist`` a missing one is
    ``STORE_NOT_FOUND`` instead of a new empty file (a hostile trial: `db downgrade`
    created a store, and `db current` changed a foreign file).

    Raises:
        InvestigationError: ``STORE_FOREIGN``, ``STORE_NOT_FOUND``, ``STORE_UNAVAILABLE``.
    """
    from sqlalchemy.engine import make_url

    from investigation.store import Store
    from workers.stores import refuse_foreign_sqlite

    url = settings.effective_database_url
    if make_url(url).get_backend_name() == "sqlite":
        path = Path(make_url(url).database or "")
        if must_exist and not path.is_file():
            raise InvestigationError("STORE_NOT_FOUND", f"no store at {path}: nothing to "
                                     "take back; nothing was changed")
        if not foreign_ok:
            refuse_foreign_sqlite(path)
    return Store(url)


def _print_move(before: list[str], after: list[str], as_json: bool) -> None:
    """What a migration command did: ``store at X (was Y)``, or ``{"before", "after"}``."""
    if as_json:
        sys.stdout.write(json.dumps({"before": before, "after": after}) + "\n")
        return
    out.print(f"store at {', '.join(after) or 'none'}"
              + (f" (was {', '.join(before) or 'none'})" if before != after
                 else " (nothing to do)"), highlight=False)


@db_app.command("upgrade", epilog=example("investigate db upgrade",
                                          "investigate db upgrade --revision head --json"))
@_controlled
def db_upgrade(
    revision: Annotated[str, typer.Option("--revision", help="target revision")] = "head",
    allow_other_tables: Annotated[bool, typer.Option(
        "--allow-other-tables", help="create the engine's tables in a database that holds "
        "other tables and none of the engine's (refused otherwise: STORE_FOREIGN)")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Bring the store to the newest migration (or --revision); safe to run any time and
    from several hosts at once (serialised by the database)."""
    from investigation.store.migrate import current_revisions, upgrade

    store = _schema_store(_settings(), foreign_ok=allow_other_tables)
    before = current_revisions(store.engine)
    upgrade(store.engine, revision, allow_other_tables=allow_other_tables)
    _print_move(before, current_revisions(store.engine), as_json)


@db_app.command("downgrade", epilog=example(
    "investigate db downgrade --revision 0010_entry_function"))
@_controlled
def db_downgrade(
    revision: Annotated[str, typer.Option(
        "--revision", help="the revision to go back to (`db current` shows where the store "
        "is; docs/operations.md says what each migration's downgrade drops)")],
    force: Annotated[bool, typer.Option(
        "--force", help="go back even though workers answer ping on this shell's broker")]
        = False,
    as_json: JsonOpt = False,
) -> None:
    """Take the store back to an older migration. Stop the workers and take a backup
    first: workers of this version need the newest migration. In a shell that names a
    broker, workers that answer ping there and consume its queue refuse it
    (WORKERS_RUNNING) unless --force."""
    from investigation.store.migrate import check_downgrade, current_revisions, downgrade

    settings = _settings()
    store = _schema_store(settings, must_exist=True)
    # A revision that cannot be gone back to is said first, before the workers are asked
    # about (a mistyped revision, and a store already at it, read WORKERS_RUNNING).
    check_downgrade(store.engine, revision)
    if _fleet_shell(settings) and not force:
        _refuse_live_workers(settings)
    before = current_revisions(store.engine)
    downgrade(store.engine, revision)
    _print_move(before, current_revisions(store.engine), as_json)


def _refuse_live_workers(settings: Settings) -> None:
    """Refuse a downgrade while workers consume the shell's queue: they need the
    newest migration and failed the next stage of each case with a database error (a
    fleet trial downgraded under two live workers; the command said nothing).

    Raises:
        InvestigationError: ``WORKERS_RUNNING``.
    """
    from workers.health import check_workers

    consuming = check_workers(settings, 1.0, min_workers=0).value  # 0: ping failed
    if isinstance(consuming, list) and consuming:
        raise InvestigationError(
            "WORKERS_RUNNING", f"workers consume queue {settings.queue!r} on this broker "
            f"({', '.join(map(str, consuming))}): they need the newest migration; stop "
            "them first (docs/operations.md, Migrations), or pass --force")


@db_app.command("current", epilog=example("investigate db current",
                                          "investigate db current --check"))
@_controlled
def db_current(
    check: Annotated[bool, typer.Option("--check", help="exit 1 unless at head")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Print the store's migration revision and this engine's head (reads only)."""
    from sqlalchemy.engine import make_url

    from investigation.store.migrate import current_revisions, head_revision

    settings = _settings()
    url = settings.effective_database_url
    head = head_revision()
    if make_url(url).get_backend_name() == "sqlite" and not Path(
            make_url(url).database or "").is_file():
        current: list[str] = []
    else:
        current = current_revisions(_schema_store(settings).engine)
    at_head = current == [head]
    if as_json:
        sys.stdout.write(json.dumps({"current": current, "head": head, "at_head": at_head})
                         + "\n")
    else:
        out.print(f"current {', '.join(current) or 'none'}  head {head}"
                  + ("" if at_head else "  (run `investigate db upgrade`)"), highlight=False)
    if check and not at_head:
        raise typer.Exit(1)
