"""Composition root: builds the store, gateway, reader and lock for a process.

Two runtimes run the same Celery tasks:

* ``embedded``: the CLI process runs each step's chain locally with
  ``chain.apply()`` (no broker, no server), SQLite by default, a file lock per case.
* ``distributed``: ``investigate worker`` consumes the case queue from Redis; per-case
  Redis lease locks; any SQL URL (PostgreSQL across hosts).
"""

from __future__ import annotations

import gc
import importlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from investigation.cases.reader import PackageReader
from investigation.config import InvestigationConfig, ProvidersConfig
from investigation.errors import ConfigError
from investigation.llm.gateway import LLMGateway, build_providers
from investigation.loop.env import StageEnv
from investigation.loop.stages import Stages
from investigation.store import Store
from investigation.text_safety import url_location
from workers.locks import CaseLock, FileCaseLock, FleetCaseLock, RedisCaseLock
from workers.settings import Settings, load_settings

log = logging.getLogger(__name__)

#: The cyclic collector's first-generation threshold in a process that runs stages (a
#: worker and its pool children, the embedded CLI); CPython's default is 700 (decision
#: 131).
GC_GEN0_THRESHOLD = 10_000


@dataclass
class Runtime:
    """Everything a task needs in one process."""

    mode: str
    settings: Settings
    env: StageEnv
    lock: CaseLock

    def __post_init__(self) -> None:
        #: One stage runner per process: recorded outputs, policies and the cases whose
        #: deliveries this process counted are kept across tasks.
        self.stages = Stages(self.env)


def load_files(config_file: str | Path | None, providers_file: str | Path | None
               ) -> tuple[InvestigationConfig, ProvidersConfig | None]:
    """The policy (defaults for ``None``) and the providers file (``None`` for none), as a
    runtime needs them: each scripted reply file present and every provider buildable.
    ``health`` runs the same checks on a file edited under running workers.

    Raises:
        ConfigError: a broken config or providers file (``CONFIG_*``).
        ProviderConfigurationError: a provider that cannot be built (``PROVIDER_BAD_CONFIG``).
    """
    config = InvestigationConfig.load(config_file)
    providers_config = ProvidersConfig.load(providers_file) if providers_file else None
    if providers_config is not None:
        for p in providers_config.providers:
            script = Path(providers_config.base_dir) / (p.path or "")
            if p.kind == "scripted" and not script.is_file():
                what = "is not a regular file" if script.exists() else "does not exist"
                raise ConfigError(
                    "CONFIG_INVALID",
                    f"provider {p.name!r}: scripted reply file {p.path!r} {what} "
                    f"(paths are relative to the providers file, {providers_config.base_dir})")
        build_providers(providers_config)  # constructors validate URLs, models, dialects
    return config, providers_config


def build_env(settings: Settings, config_path: Path | None = None,
              providers_path: Path | None = None, *,
              adopt_frozen: bool = False) -> StageEnv:
    """Build the stage environment from files and settings.

    Both files are checked here, before any step: a broken providers file fails at once
    instead of blocking a case at its first model call.

    Args:
        adopt_frozen: a revision whose policy is frozen keeps it, whatever the policy file
            says (the file applies to revisions not yet frozen): the workers' way, so that
            rolling a new policy file out to a fleet does not stop every case under way
            (decision 153). Otherwise a given policy file that differs from a frozen one
            is ``POLICY_CHANGED`` (``run --config``: the operator asked for that policy).

    Raises:
        ConfigError: a broken config or providers file (``CONFIG_*``).
        ProviderConfigurationError: a provider that cannot be built (``PROVIDER_BAD_CONFIG``).
    """
    config_file = config_path or settings.config
    config, providers_config = load_files(config_file, providers_path or settings.providers)
    store = Store(settings.effective_database_url)
    if settings.auto_migrate:
        store.create_schema()
    else:
        from investigation.store.migrate import require_head

        require_head(store.engine)
    factory: Callable[[], LLMGateway] | None = None
    if providers_config is not None:
        pc = providers_config

        def factory() -> LLMGateway:
            return LLMGateway(store, build_providers(pc), pc.gateway)
    return StageEnv(store=store, config=config, gateway_factory=factory,
                    reader=PackageReader(config.package,
                                         text_index_dir=settings.home.resolve() / "text-index"),
                    explicit_config=config_file is not None and not adopt_frozen,
                    feedback_key=settings.feedback_key_bytes(),
                    async_commit=settings.pg_async_commit)


_current: Runtime | None = None
_mutex = threading.Lock()


def configure(runtime: Runtime | None) -> None:
    """Install the runtime tasks use in this process (``None`` resets it)."""
    global _current
    with _mutex:
        _current = runtime


def released_lease_s(settings: Settings) -> int:
    """How long a released case lock's tombstone lives (seconds, decision 135): the latest
    a message of the released chain can still be delivered (the visibility timeout and
    one restore scan after its delivery) plus one lease."""
    return settings.visibility_timeout_s + settings.restore_interval_s + settings.lock_ttl_s


def distributed(settings: Settings) -> Runtime:
    """Build the distributed runtime for ``settings`` (Redis locks, the settings' store),
    and point the Celery app at the settings' broker and queue."""
    from workers.celery_app import configure as configure_app

    configure_app(settings)
    runtime = Runtime("distributed", settings, build_env(settings, adopt_frozen=True),
                      RedisCaseLock.from_url(settings.effective_redis_url, settings.lock_ttl_s,
                                             released_lease_s(settings)))
    log.info("distributed runtime ready (store %s)",
             url_location(settings.effective_database_url))
    return runtime


def current() -> Runtime:
    """The process runtime; a worker builds the distributed one from its environment."""
    global _current
    with _mutex:
        if _current is None:
            _current = distributed(load_settings())
        return _current


def embedded(settings: Settings, config_path: Path | None = None,
             providers_path: Path | None = None, *, fleet_lock: bool = False) -> Runtime:
    """Build and install the embedded runtime (chains run with ``Signature.apply()``,
    Celery's local execution, so no broker is touched).

    Its case lock is a file lock under ``settings.home``; with ``fleet_lock`` (``run`` in
    a shell that names a broker or lock Redis) also the fleet's Redis lease
    (:class:`workers.locks.FleetCaseLock`, decision 158), so no worker dispatches the case
    while it runs. Building touches neither Redis nor the broker.
    """
    files = FileCaseLock(settings.home / "locks")
    lock: CaseLock = files if not fleet_lock else FleetCaseLock(
        files, RedisCaseLock.from_url(settings.effective_redis_url, settings.lock_ttl_s,
                                      released_lease_s(settings)))
    runtime = Runtime("embedded", settings, build_env(settings, config_path, providers_path),
                      lock)
    configure(runtime)
    tune_collector()
    return runtime


def tune_collector() -> None:
    """Raise the cyclic collector's first-generation threshold to
    :data:`GC_GEN0_THRESHOLD` (never lower it); the older generations keep theirs.

    With CPython's 700, a step that holds a full context's parsed JSON (a few thousand
    containers at once) runs several young collections; the objects alive at those
    moments are promoted and later paid for by full collections of the whole heap. A
    step of a case past its first hundred steps spent about 0.8 ms per step in the
    collector against almost nothing for a new case's step (decision 131). The price is
    cyclic garbage kept a little longer: at most that many container objects.
    """
    gen0, gen1, gen2 = gc.get_threshold()
    if gen0 and gen0 < GC_GEN0_THRESHOLD:  # 0: the collector is disabled; leave it so
        gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def preload() -> None:
    """In a worker's main process, before its pool forks: import and build what every
    child would otherwise import or build at its first task (the migration machinery that
    checks the schema, the secret masker's compiled rules), then move every object to
    the collector's permanent generation (``gc.freeze``).

    A child then starts its first stage without that second of imports, shares those
    pages with its parent, and its full collections no longer walk the imported world
    (about 80 ms each). The collector's first-generation threshold is raised
    (:func:`tune_collector`), for the children too. Nothing built here holds a
    connection, a thread or a file: each child still builds its own runtime
    (``worker_process_init``).
    """
    from investigation.secrets import default_masker

    for module in ("investigation.store.migrate", "investigation.store.guards"):
        importlib.import_module(module)  # alembic, mako; the schema check's triggers

    default_masker()  # detect-secrets' plugins compiled to RE2, immutable
    gc.collect()
    gc.freeze()
    tune_collector()  # inherited by every child the pool forks
