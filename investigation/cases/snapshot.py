"""The read-only view of one case package that snapshot tools work on.

``PackageReader`` produces a :class:`Snapshot` from a validated ZIP; tests may use
:class:`DictSnapshot`. Paths are POSIX, relative to their root (``source/``, ``logs/``,
``db/``), never absolute and never containing ``..``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Snapshot(Protocol):
    """An immutable case snapshot. All bytes are exactly as packed."""

    @property
    def package_id(self) -> str:
        """sha256 (hex) of the package ZIP bytes."""
        ...

    @property
    def manifest(self) -> Mapping[str, Any]:
        """The package's ``manifest.json`` as parsed JSON."""
        ...

    def report_text(self) -> str:
        """The bug report (UTF-8 text)."""
        ...

    def source_paths(self) -> list[str]:
        """Every source file path, sorted, relative to the source root."""
        ...

    def read_source(self, path: str) -> bytes:
        """Bytes of a source file. Raises ``KeyError`` for an unknown path."""
        ...

    def db_names(self) -> list[str]:
        """Names of packed SQLite databases (file names under ``db/``), sorted."""
        ...

    def db_bytes(self, name: str) -> bytes:
        """Bytes of one packed SQLite database. Raises ``KeyError`` for an unknown name."""
        ...

    def log_paths(self) -> list[str]:
        """Every log file path, sorted, relative to the logs root."""
        ...

    def read_log(self, path: str) -> bytes:
        """Bytes of a log file. Raises ``KeyError`` for an unknown path."""
        ...


class DictSnapshot:
    """A snapshot held in dictionaries (for tests and tools that build one in memory).

    Args:
        source: source path -> bytes.
        report: report text.
        dbs: database name -> SQLite file bytes.
        logs: log path -> bytes.
        package_id: identifier to report (default ``"0" * 64``).
    """

    def __init__(
        self,
        source: Mapping[str, bytes],
        report: str = "",
        dbs: Mapping[str, bytes] | None = None,
        logs: Mapping[str, bytes] | None = None,
        package_id: str = "0" * 64,
        manifest: Mapping[str, Any] | None = None,
    ) -> None:
        self._source = dict(source)
        self._report = report
        self._dbs = dict(dbs or {})
        self._logs = dict(logs or {})
        self._package_id = package_id
        self._manifest = dict(manifest or {})

    @property
    def package_id(self) -> str:
        return self._package_id

    @property
    def manifest(self) -> Mapping[str, Any]:
        return self._manifest

    def report_text(self) -> str:
        return self._report

    def source_paths(self) -> list[str]:
        return sorted(self._source)

    def read_source(self, path: str) -> bytes:
        return self._source[path]

    def db_names(self) -> list[str]:
        return sorted(self._dbs)

    def db_bytes(self, name: str) -> bytes:
        return self._dbs[name]

    def log_paths(self) -> list[str]:
        return sorted(self._logs)

    def read_log(self, path: str) -> bytes:
        return self._logs[path]
