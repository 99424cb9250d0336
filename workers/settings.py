"""Process settings from the environment (pydantic-settings), prefix ``INVESTIGATE_``.

| variable | default | meaning |
|---|---|---|
| ``INVESTIGATE_HOME`` | ``./.investigate`` | data directory of the embedded runtime |
| ``INVESTIGATE_DATABASE_URL`` | ``sqlite:///$HOME/investigation.db`` | the SQL store |
| ``INVESTIGATE_BROKER_URL`` | ``redis://127.0.0.1:6379/0`` | Celery broker |
| ``INVESTIGATE_REDIS_URL`` | the broker URL | per-case locks |
| ``INVESTIGATE_CONFIG`` | none | investigation policy TOML for workers |
| ``INVESTIGATE_PROVIDERS`` | none | providers TOML for workers |
| ``INVESTIGATE_LOCK_TTL_S`` | 300 | per-case lock lease, renewed by every stage (one without an external effect skips a renewal its process made less than 10 s ago) |
| ``INVESTIGATE_VISIBILITY_TIMEOUT_S`` | 3600 | broker visibility timeout |
| ``INVESTIGATE_MAX_COUNTDOWN_S`` | 1800 | longest countdown scheduled (< visibility timeout) |
| ``INVESTIGATE_RESTORE_INTERVAL_S`` | 10 | how often a worker scans for unacked messages past the visibility timeout |
| ``INVESTIGATE_SWEEP_INTERVAL_S`` | 60 | period of the recovery sweep task (beat); 0 disables it |
| ``INVESTIGATE_MAX_STAGE_DELIVERIES`` | 5 | deliveries of one stage without returning before the case is parked |
| ``INVESTIGATE_QUEUE`` | ``cases`` | the case queue |
| ``INVESTIGATE_WORKER_MAX_MEMORY_KIB`` | 1048576 | a prefork child above this is replaced |
| ``INVESTIGATE_FEEDBACK_KEY`` | none | key deriving external-test feedback secrets (>= 32 chars) |
| ``INVESTIGATE_FEEDBACK_KEY_FILE`` | ``$HOME/feedback.key`` | used without the variable; created (0600) on first use |
| ``INVESTIGATE_LOG_FORMAT`` | ``text`` | ``text`` or ``json`` (one JSON object per line) |
| ``INVESTIGATE_AUTO_MIGRATE`` | true | a process that opens the store migrates it; false: only ``investigate db upgrade`` does |
| ``INVESTIGATE_SOFT_SHUTDOWN_S`` | 0 | seconds a cold shutdown still lets running tasks finish (Celery's soft shutdown) |
| ``INVESTIGATE_PG_ASYNC_COMMIT`` | true | on PostgreSQL, stage transactions the engine can redo commit without waiting for the disk (decision 126); false: the engine never turns ``synchronous_commit`` off |
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import stat
import tempfile
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from investigation.config import MAX_BYTES, MAX_COUNT, MAX_SECONDS
from investigation.constants import SAFE_CASE_ID
from investigation.errors import ConfigError
from investigation.files import read_bounded, write_atomic

log = logging.getLogger(__name__)
#: Key files already warned about in this process (a world-readable key is said once).
_WARNED_KEY_FILES: set[str] = set()

#: A feedback key file holds a 64-hex-digit key; anything far larger is not one.
MAX_FEEDBACK_KEY_FILE_BYTES = 4096


class Settings(BaseSettings):
    """Runtime settings of one process (CLI or worker)."""

    # A variable set empty is unset (`INVESTIGATE_LOG_FORMAT= cmd` broke every command
    # while an empty INVESTIGATE_DATABASE_URL meant the default store: a new user's trial).
    model_config = SettingsConfigDict(env_prefix="INVESTIGATE_", extra="ignore",
                                      env_ignore_empty=True)

    home: Path = Path(".investigate")
    database_url: str | None = None
    broker_url: str = "redis://127.0.0.1:6379/0"
    redis_url: str | None = None
    config: Path | None = None
    providers: Path | None = None
    lock_ttl_s: int = Field(300, ge=5, le=MAX_SECONDS)
    visibility_timeout_s: int = Field(3600, ge=2, le=MAX_SECONDS)
    """Seconds an unacknowledged message may stay with a worker before the broker hands it
    to another one (kombu's Redis ``visibility_timeout``). Default 3600. It must exceed every
    countdown the engine schedules and, for stages to run once, the longest stage."""
    max_countdown_s: int = Field(1800, ge=1, le=MAX_SECONDS)
    """Longest countdown/ETA ever scheduled (seconds); longer waits are left to the
    recovery sweep. Default 1800; must be below ``visibility_timeout_s``."""
    restore_interval_s: int = Field(10, ge=1, le=MAX_SECONDS)
    """Seconds between a worker's scans for unacknowledged messages older than the
    visibility timeout (kombu ``unacked_restore_interval``, with the throttle set to 1).
    Default 10. A message of a killed worker is redelivered at most
    ``visibility_timeout_s + restore_interval_s`` after its delivery, while any worker runs."""
    sweep_interval_s: int = Field(60, ge=0, le=MAX_SECONDS)
    """Period of the ``investigation.recover`` beat task (seconds). Default 60; 0 leaves
    it out of the beat schedule (run ``investigate recover`` yourself)."""
    max_stage_deliveries: int = Field(5, ge=1, le=MAX_COUNT)
    """Deliveries of one stage that started and never returned (its worker died each
    time) after which the case is parked ``BLOCKED`` with ``STAGE_POISONED``. Default 5."""
    queue: str = Field("cases", min_length=1)
    worker_max_memory_kib: int = Field(1_048_576, ge=65_536, le=MAX_BYTES // 1024)
    """Resident memory after which a prefork child is replaced (KiB). Default 1 GiB."""

    log_format: Literal["text", "json"] = "text"
    """``text`` (default) or ``json``: one JSON object per log line (``workers/logs.py``)."""
    auto_migrate: bool = True
    """Default true: the first process that opens the store brings it to the newest
    migration. False: only ``investigate db upgrade`` migrates; a worker meeting an older
    schema stops with ``STORE_NOT_MIGRATED``."""
    soft_shutdown_s: float = Field(0.0, ge=0, le=MAX_SECONDS, allow_inf_nan=False)
    """Seconds a cold shutdown (SIGQUIT, a second SIGTERM) still gives running tasks
    before they are terminated (Celery's ``worker_soft_shutdown_timeout``). Default 0."""

    pg_async_commit: bool = True
    """Default true: on PostgreSQL a stage transaction that writes only what the engine can
    derive again from durable rows commits with ``synchronous_commit`` off (decision 126:
    a crash of the database server, not of a worker, may lose such commits of the last
    ``3 x wal_writer_delay``, 0.6 s by default, which the recovery sweep redoes). Model
    requests and answers, query results, tests handed out and operator input always wait
    for the disk. False: the engine never turns ``synchronous_commit`` off (the server's
    own setting applies)."""

    feedback_key: SecretStr | None = Field(None, min_length=32)
    """Key that derives each external test's feedback secret (``docs/async-tests.md``)."""
    feedback_key_file: Path | None = None
    """Key file read when ``feedback_key`` is unset (default ``home/feedback.key``)."""

    def feedback_key_bytes(self, create: bool = True) -> bytes | None:
        """The feedback key: the variable, else the key file (created with 32 random
        bytes, mode 0600, when ``create`` and missing); ``None`` if there is none.

        Raises:
            ConfigError: ``CONFIG_INVALID`` for a key file shorter than 32 bytes.
        """
        if self.feedback_key is not None:
            return self.feedback_key.get_secret_value().encode("utf-8")
        path = self.feedback_key_file or self.home / "feedback.key"
        if not path.exists():
            if not create:
                return None
            path.parent.mkdir(parents=True, exist_ok=True)
            # Written whole under a temporary name, then linked into place: a concurrent
            # reader never sees a half-written key, and the first creator wins.
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".feedback-key-")
            try:
                with os.fdopen(fd, "w") as fh:  # mkstemp creates it 0600
                    fh.write(secrets.token_hex(32) + "\n")
                with contextlib.suppress(FileExistsError):  # another process was first
                    os.link(tmp, path)
            finally:
                os.unlink(tmp)
        try:  # a regular file of a few bytes: never a FIFO or /dev/zero
            key = read_bounded(path, MAX_FEEDBACK_KEY_FILE_BYTES).strip()
        except OSError as exc:
            raise ConfigError("CONFIG_INVALID", f"feedback key file {path}: "
                              f"{exc.strerror or exc}") from exc
        if len(key) < 32:
            raise ConfigError("CONFIG_INVALID",
                              f"feedback key file {path} holds fewer than 32 bytes")
        _warn_if_others_read(path)
        return key

    @field_validator("log_format", mode="before")
    @classmethod
    def _log_format_any_case(cls, value: Any) -> Any:
        """``JSON`` or ``Text`` as ``json`` or ``text``; white space alone as unset, as an
        empty value is (a tab refused every command: a hostile trial)."""
        if not isinstance(value, str):
            return value
        return value.strip().lower() or "text"

    @field_validator("database_url")
    @classmethod
    def _database_scheme(cls, value: str | None) -> str | None:
        """``postgres://`` read as ``postgresql+psycopg://`` (``store.normalise_url``); a
        URL that cannot be used is refused where a store is opened (``STORE_URL_INVALID``,
        ``store.check_url``), as for the upstream API."""
        from investigation.store.engine import normalise_url

        return None if value is None else normalise_url(value)

    @field_validator("broker_url", "redis_url")
    @classmethod
    def _redis_database(cls, value: str | None) -> str | None:
        """A Redis URL's database must be a number: redis-py reads ``/abc`` as database 0,
        and processes with different URLs would then share locks unknowingly."""
        if value is None:
            return value
        parts = urlsplit(value)
        db = parts.path.strip("/")
        if parts.scheme.startswith("redis") and db and not db.isdigit():
            raise ValueError(f"the Redis database must be a number, not {db!r}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.max_countdown_s >= self.visibility_timeout_s:
            raise ValueError(
                f"INVESTIGATE_MAX_COUNTDOWN_S ({self.max_countdown_s}) must be below "
                f"INVESTIGATE_VISIBILITY_TIMEOUT_S ({self.visibility_timeout_s}): a countdown "
                "message held longer than the visibility timeout is delivered twice")
        return self

    @property
    def effective_database_url(self) -> str:
        """The store URL (SQLite under ``home`` unless set).

        Raises:
            StoreError: ``STORE_URL_INVALID`` for a set URL that cannot be used
            (``store.check_url``; never echoed: it may hold a password).
        """
        if not self.database_url:
            return f"sqlite:///{self.home.resolve() / 'investigation.db'}"
        from investigation.store.engine import check_url

        check_url(self.database_url)
        return self.database_url

    @property
    def effective_redis_url(self) -> str:
        """The Redis URL for locks (the broker's unless set)."""
        return self.redis_url or self.broker_url


def load_settings() -> Settings:
    """The settings of this process, from the environment.

    Raises:
        ConfigError: ``CONFIG_INVALID``, one line naming each broken variable and its rule;
        values are never echoed (a too-short feedback key must not reach a log).
    """
    try:
        return Settings()
    except ValidationError as exc:
        # A rule across several variables has no location: its message names them.
        problems = "; ".join(
            (f"INVESTIGATE_{'_'.join(str(p) for p in e['loc']).upper()}: " if e["loc"]
             else "") + _message(e) for e in exc.errors(include_input=False, include_url=False))
        raise ConfigError("CONFIG_INVALID", f"bad setting: {problems}") from None


def _message(error: Any) -> str:
    """Pydantic's message of one settings error; a secret's length is in characters
    (pydantic counts a ``SecretStr``'s "items")."""
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] in ("string_too_short", "string_too_long", "too_short", "too_long") \
            and error["loc"] == ("feedback_key",):
        message = message.replace(" items", " characters")
    return message


def _warn_if_others_read(path: Path) -> None:
    """Warn (once per process and file) when the feedback key file is readable or writable
    by other users: whoever reads it can derive every test's secret and forge feedback (a
    hostile-input trial's key file had mode 0644, accepted silently)."""
    with contextlib.suppress(OSError):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077 and str(path) not in _WARNED_KEY_FILES:
            _WARNED_KEY_FILES.add(str(path))
            log.warning("feedback key file %s has mode %04o: other users can read it and "
                        "forge test feedback; `chmod 600 %s`", path, mode, path)


def deployment_identity(settings: Settings) -> dict[str, str]:
    """Where a process's state and locks are and which files steer it, for comparing the
    workers of one queue (``health``): the store and the lock Redis without passwords,
    the sha256 of the policy and providers files (``"none"`` without one,
    ``"unreadable"`` when it cannot be read), which feedback key it uses
    (:func:`feedback_key_id`) and the paths of those three (shown, never compared).
    Two fleet trials ran a worker on another database, another lock Redis, another policy
    or providers file, unnoticed."""
    def digest(path: Path | None) -> str:
        if path is None:
            return "none"
        try:
            return hashlib.sha256(read_bounded(path, 1 << 20)).hexdigest()[:16]
        except OSError:
            return "unreadable"

    from investigation.text_safety import url_for_display  # passwords masked

    return {"store": url_for_display(settings.effective_database_url),
            "locks": url_for_display(settings.effective_redis_url),
            "policy": digest(settings.config), "providers": digest(settings.providers),
            "feedback": feedback_key_id(settings),
            "policy_path": str(settings.config or ""),
            "providers_path": str(settings.providers or ""),
            "feedback_path": ("INVESTIGATE_FEEDBACK_KEY" if settings.feedback_key is not None
                              else str(settings.feedback_key_file
                                       or settings.home / "feedback.key"))}


def feedback_key_id(settings: Settings) -> str:
    """Which feedback key ``settings`` find, without creating one or showing it: 16 hex
    digits of a sha256 over a fixed label and the key (the key cannot be read back from
    it), ``"none"`` without a key, ``"unreadable"`` for a key file that cannot be read or
    is too short. A worker started without the fleet's ``INVESTIGATE_HOME`` made its own
    key and refused every secret the operators' shell showed; ``health`` compares these
    (a fleet trial)."""
    try:
        key = settings.feedback_key_bytes(create=False)
    except ConfigError:
        return "unreadable"
    if key is None:
        return "none"
    return hashlib.sha256(b"investigation feedback key id\0" + key).hexdigest()[:16]


def _run_note(settings: Settings, case_id: str) -> Path | None:
    """Where ``run`` notes the providers file it used for ``case_id`` (``None`` for a
    string that is no case id: it never becomes a path)."""
    if not SAFE_CASE_ID.fullmatch(case_id):
        return None
    return settings.home / "runs" / case_id / "providers"


def remember_providers(settings: Settings, case_id: str, providers: Path) -> None:
    """Note the providers file an embedded ``run`` of ``case_id`` used (its absolute
    path, in ``INVESTIGATE_HOME/runs/CASE/providers``), so that the commands ``status``
    and ``resume`` print later name it: they showed the placeholder ``providers.toml``,
    which was another case's file in a new user's folder. Best effort: a home that
    cannot be written keeps the placeholder."""
    note = _run_note(settings, case_id)
    if note is None:
        return
    with contextlib.suppress(OSError):
        note.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(note, str(providers.resolve()).encode("utf-8", "surrogateescape"))


def remembered_providers(settings: Settings, case_id: str) -> Path | None:
    """The providers file the last embedded ``run`` of ``case_id`` on this home used, if
    noted and still a file (:func:`remember_providers`)."""
    note = _run_note(settings, case_id)
    try:
        path = Path(read_bounded(note, 4096).decode("utf-8", "surrogateescape")) \
            if note is not None else None
    except OSError:
        return None
    return path if path is not None and path.is_file() else None
