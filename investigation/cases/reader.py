"""PackageReader: validate a case package ZIP once per hash and serve it as a Snapshot.

The reader never extracts and never trusts ``zipfile``'s view of names. It parses the
raw End Of Central Directory record and central directory (:mod:`.zipscan`), validates
every entry within :class:`~investigation.config.PackageLimits` *before* decompressing
anything, then checks ``manifest.json`` against the entries (sizes, then sha256 of every
file). Validation metadata (the entry table and the manifest, never the archive bytes)
is cached per ``(sha256 of the bytes, limits)`` in a bounded, thread-safe LRU; the hash
is recomputed on every :meth:`PackageReader.read`, no timestamp is ever trusted.

Refusals raise :class:`~investigation.errors.PackageError` with one of these codes:

============================  ===========================================================
``PKG_NOT_ZIP``               not a ZIP: no or inconsistent EOCD/central/local records
``PKG_UNSUPPORTED_ZIP``       ZIP64 or multi-disk archive
``PKG_HIDDEN_DATA``           archive comment, or bytes that belong to no entry
``PKG_TOO_MANY_ENTRIES``      more entries than ``max_entries``
``PKG_BAD_NAME``              name empty, not UTF-8, NUL/control character, an invisible
                              or bidirectional format character (U+202E, U+200B, ...),
                              backslash, empty or ``.`` segment
``PKG_NAME_TOO_LONG``         name over ``max_name_bytes``, or one segment over
                              ``max_segment_bytes``
``PKG_PATH_TOO_DEEP``         name with more segments than ``max_path_depth``
``PKG_ABSOLUTE_PATH``         name starts with ``/`` or a drive letter
``PKG_PATH_TRAVERSAL``        name has a ``..`` segment
``PKG_DUPLICATE_ENTRY``       two names equal after NFC + casefold, or file/dir conflict
``PKG_SYMLINK``               a symbolic-link entry (``external_attr >> 16`` is S_IFLNK)
``PKG_UNSUPPORTED_ENTRY_TYPE``  device/FIFO/socket entry, or a directory carrying data
``PKG_ENCRYPTED``             encrypted entry (or masked central directory)
``PKG_UNSUPPORTED_COMPRESSION``  a method other than stored (0) or deflate (8)
``PKG_ENTRY_TOO_LARGE``       an entry declares more than ``max_entry_bytes``
``PKG_TOO_LARGE``             declared sizes sum to more than ``max_total_bytes``
``PKG_COMPRESSION_RATIO``     an entry of at least 64 KiB expands more than
                              ``max_compression_ratio`` times
``PKG_OVERLAPPING_ENTRIES``   entries share bytes, or reach into the central directory
``PKG_LOCAL_HEADER_MISMATCH`` a local header or data descriptor disagrees with the
                              central record (name, method, flags, sizes, CRC)
``PKG_CORRUPT``               a deflate stream is broken or not of its declared size
``PKG_CRC_MISMATCH``          decoded bytes fail the CRC-32
``PKG_MANIFEST_MISSING``      no ``manifest.json`` entry
``PKG_MANIFEST_INVALID``      manifest not a JSON object of the expected shape, wrong
                              ``format``, more JSON values than its entries need (five
                              per entry), or an entry outside the package layout
``PKG_MANIFEST_MISMATCH``     a listed file is absent, an entry is unlisted, or a size or
                              sha256 differs
``PKG_DB_NOT_SQLITE``         a ``db/`` entry does not start with the SQLite header
``PKG_REPORT_INVALID``        the report is not UTF-8 text
============================  ===========================================================

``investigate case build`` and ``case add`` (registration) also refuse a database SQLite
cannot open with ``PKG_DB_CORRUPT`` (the reader does not: a case stored before that rule
still opens). ``investigate case build`` (:mod:`investigation.cases.builder`) also refuses with
``PKG_BUILD_INPUT`` (a missing or unreadable input), ``PKG_SYMLINK`` (a link leaving the
tree, to a directory, or a linked parent directory of a packed path) and
``PKG_SECRETS_FOUND`` (the secret scan found secrets, :mod:`investigation.secrets`;
``--allow-secrets`` packs them); ``investigate case add`` with ``PKG_UNREADABLE``.

Cost: validation is linear in the archive's size (names are checked for collisions by
one sort, never by building their prefixes), and its memory is the archive plus a small
multiple of the names' total bytes; ``bench/package_validation.py`` measures the worst
package the default limits allow.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from investigation import jsonio
from investigation.cases.layout import (
    DB_ROOT,
    DB_SUFFIX,
    LOGS_ROOT,
    MANIFEST_NAME,
    SOURCE_ROOT,
    SQLITE_HEADER,
    check_relative_path,
    strict_json_loads,
)
from investigation.cases.textindex import (
    DEFAULT_TEXT_INDEX_BYTES,
    MappedTextIndex,
    TextIndexStore,
)
from investigation.cases.zipscan import ZipEntry, read_entry, scan_zip
from investigation.config import PackageLimits, canonical_json
from investigation.constants import PACKAGE_FORMAT
from investigation.errors import PackageError

__all__ = ["PackageReader", "PackageSnapshot", "ValidatedPackage"]

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
#: A JSON string token, or an unterminated one running to the end: every match attempt
#: succeeds where it starts, so the scan is linear on any input (with a closing quote
#: required, a manifest of '"' and many '\\"' made every quote scan to the end again).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\[\s\S][^"\\]*)*(?:"|\Z)')
#: JSON values a manifest may hold per archive entry: a listed file is an object of three
#: values (path, sha256, size), a database adds one name; the rest is the fixed keys.
_MANIFEST_VALUES_PER_ENTRY = 5
_MANIFEST_VALUES_FIXED = 16
#: Default bound of decoded entry bytes a snapshot keeps in memory.
DEFAULT_ENTRY_CACHE_BYTES = 32 << 20
#: Default bound of decoded entries a snapshot keeps in memory.
DEFAULT_ENTRY_CACHE_ENTRIES = 256


@dataclass(frozen=True)
class ValidatedPackage:
    """Detached validation metadata of one package (holds no archive bytes).

    Attributes:
        package_id: sha256 hex of the archive bytes.
        size_bytes: archive size in bytes.
        entries: file entry name -> :class:`ZipEntry` (read-only mapping).
        manifest_json: canonical JSON bytes of the parsed manifest.
        report_name: entry name of the report.
        source_paths: sorted paths relative to ``source/``.
        db_names: sorted database names (file names under ``db/``).
        log_paths: sorted paths relative to ``logs/``.
    """

    package_id: str
    size_bytes: int
    entries: Mapping[str, ZipEntry]
    manifest_json: bytes
    report_name: str
    source_paths: tuple[str, ...]
    db_names: tuple[str, ...]
    log_paths: tuple[str, ...]


class PackageReader:
    """Validates case packages and opens them as :class:`PackageSnapshot`.

    One reader is meant to be shared (it is thread-safe): it caches the validation
    metadata of up to ``limits.cache_entries`` packages, least recently used first out.

    Args:
        limits: package bounds; checked before any entry is decompressed.
        entry_cache_bytes: bound of decoded bytes each snapshot caches. Default 32 MiB;
            0 disables the snapshot entry cache.
        text_index_dir: directory of the shared text indexes that searches map
            (:mod:`investigation.cases.textindex`); None (the default) gives snapshots
            without one, whose searches read and decode the package at every search.
        text_index_bytes: bound of that directory in bytes. Default 2 GiB.
    """

    def __init__(
        self, limits: PackageLimits | None = None,
        entry_cache_bytes: int = DEFAULT_ENTRY_CACHE_BYTES,
        text_index_dir: str | os.PathLike[str] | None = None,
        text_index_bytes: int = DEFAULT_TEXT_INDEX_BYTES,
    ) -> None:
        self.limits = limits if limits is not None else PackageLimits()
        self._limits_key = canonical_json(self.limits.model_dump())
        self._entry_cache_bytes = max(0, entry_cache_bytes)
        self.text_indexes = (TextIndexStore(text_index_dir, text_index_bytes)
                             if text_index_dir is not None else None)
        self._cache: OrderedDict[tuple[str, bytes], ValidatedPackage] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, data: bytes | bytearray | memoryview) -> PackageSnapshot:
        """Validate ``data`` (or reuse the cached validation of its hash) and open it.

        Args:
            data: the whole package ZIP. Mutable buffers are copied once; the snapshot
                keeps an immutable ``bytes`` object.

        Returns:
            A :class:`PackageSnapshot` over ``data``.

        Raises:
            PackageError: any code in the module docstring.
        """
        blob = bytes(data) if not isinstance(data, bytes) else data
        return PackageSnapshot(blob, self.validate(blob), self._entry_cache_bytes,
                               text_indexes=self.text_indexes)

    def validate(self, data: bytes) -> ValidatedPackage:
        """Validate ``data`` and return its detached metadata (cached by sha256 + limits).

        Raises:
            PackageError: any code in the module docstring.
        """
        package_id = hashlib.sha256(data).hexdigest()
        key = (package_id, self._limits_key)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        validated = _validate(data, package_id, self.limits)
        if self.limits.cache_entries > 0:
            with self._lock:
                self._cache[key] = validated
                self._cache.move_to_end(key)
                while len(self._cache) > self.limits.cache_entries:
                    self._cache.popitem(last=False)
        return validated

    def cached_ids(self) -> list[str]:
        """Package ids whose validation is cached, least recently used first."""
        with self._lock:
            return [package_id for package_id, _ in self._cache]


class PackageSnapshot:
    """An immutable, lazily decoded view of a validated package (a :class:`Snapshot`).

    Entries are decoded on first use from the immutable archive bytes (CRC-checked each
    time they are decoded) and kept in a bounded per-snapshot LRU.

    Args:
        data: the archive bytes ``validated`` was computed from.
        validated: validation metadata from :meth:`PackageReader.validate`.
        entry_cache_bytes: bound of decoded bytes kept in memory (0 disables the cache).
        text_indexes: where :meth:`text_index` finds or builds the package's shared text
            index; None: the snapshot has none.
    """

    def __init__(self, data: bytes, validated: ValidatedPackage,
                 entry_cache_bytes: int = DEFAULT_ENTRY_CACHE_BYTES,
                 text_indexes: TextIndexStore | None = None) -> None:
        self._data = data
        self._meta = validated
        self._manifest: Mapping[str, Any] = MappingProxyType(jsonio.loads(validated.manifest_json))
        self._source = frozenset(validated.source_paths)
        self._dbs = frozenset(validated.db_names)
        self._logs = frozenset(validated.log_paths)
        self._cache_bytes = entry_cache_bytes
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._text_indexes = text_indexes
        self._text_index: MappedTextIndex | None = None
        self._text_index_tried = False
        self._text_index_lock = threading.Lock()

    @property
    def package_id(self) -> str:
        """sha256 (hex) of the package ZIP bytes."""
        return self._meta.package_id

    @property
    def size_bytes(self) -> int:
        """Size of the package ZIP in bytes."""
        return self._meta.size_bytes

    @property
    def manifest(self) -> Mapping[str, Any]:
        """The parsed ``manifest.json`` (a read-only copy for this snapshot)."""
        return self._manifest

    def report_bytes(self) -> bytes:
        """The report entry's exact bytes."""
        return self._entry(self._meta.report_name)

    def report_text(self) -> str:
        """The bug report (validated UTF-8)."""
        return self.report_bytes().decode("utf-8")

    def source_paths(self) -> list[str]:
        """Every source file path, sorted, relative to ``source/``."""
        return list(self._meta.source_paths)

    def read_source(self, path: str) -> bytes:
        """Bytes of a source file. Raises ``KeyError`` for an unknown path."""
        if path not in self._source:
            raise KeyError(path)
        return self._entry(SOURCE_ROOT + path)

    def db_names(self) -> list[str]:
        """Names of packed SQLite databases (file names under ``db/``), sorted."""
        return list(self._meta.db_names)

    def db_bytes(self, name: str) -> bytes:
        """Bytes of one packed SQLite database. Raises ``KeyError`` for an unknown name."""
        if name not in self._dbs:
            raise KeyError(name)
        return self._entry(DB_ROOT + name)

    def log_paths(self) -> list[str]:
        """Every log file path, sorted, relative to ``logs/``."""
        return list(self._meta.log_paths)

    def read_log(self, path: str) -> bytes:
        """Bytes of a log file. Raises ``KeyError`` for an unknown path."""
        if path not in self._logs:
            raise KeyError(path)
        return self._entry(LOGS_ROOT + path)

    def text_index(self) -> MappedTextIndex | None:
        """The package's shared text index (opened, or built, on first call), or None.

        None when the reader has no index directory or the index is unavailable (see
        :meth:`~investigation.cases.textindex.TextIndexStore.open`); searches then read
        the package itself. The outcome is kept for the snapshot's lifetime (a snapshot
        opened later tries again).
        """
        if self._text_indexes is None:
            return None
        with self._text_index_lock:
            if not self._text_index_tried:
                self._text_index = self._text_indexes.open(self)
                self._text_index_tried = True
            return self._text_index

    def entry_names(self) -> list[str]:
        """Every file entry name of the archive (including ``manifest.json``), sorted."""
        return sorted(self._meta.entries)

    def _entry(self, name: str) -> bytes:
        with self._lock:
            hit = self._cache.get(name)
            if hit is not None:
                self._cache.move_to_end(name)
                return hit
        out = read_entry(self._data, self._meta.entries[name])
        if 0 < len(out) <= self._cache_bytes:
            with self._lock:
                if name not in self._cache:
                    self._cache[name] = out
                    self._cached_bytes += len(out)
                while (self._cached_bytes > self._cache_bytes
                       or len(self._cache) > DEFAULT_ENTRY_CACHE_ENTRIES):
                    _, dropped = self._cache.popitem(last=False)
                    self._cached_bytes -= len(dropped)
        return out


# -- validation ------------------------------------------------------------------------------


def check_database_opens(name: str, data: bytes, where: str) -> None:
    """Refuse a packed database SQLite cannot open as the tools will (not a database, a
    malformed image or schema): every query of it would fail, and the failures would be
    charged to the model as invalid replies. Checked by ``case build`` and when a case is
    registered, not by :class:`PackageReader` (a case stored before the rule still opens;
    its queries fail with ``TOOL_SQL_ERROR`` as before).

    Args:
        where: the database as the operator knows it (a file path, or its package name).

    Raises:
        PackageError: ``PKG_DB_CORRUPT`` with SQLite's reason and the command that says
            more.
    """
    from investigation.errors import ToolError
    from investigation.tools.sqlite import check_opens

    try:
        check_opens(name, data)
    except ToolError as exc:
        raise PackageError("PKG_DB_CORRUPT",
                           f"{exc.message}; pack a database SQLite can open (`sqlite3 "
                           f"{where} 'PRAGMA integrity_check'` tells what is wrong)",
                           name=name) from exc


def _invalid(message: str) -> PackageError:
    return PackageError("PKG_MANIFEST_INVALID", f"manifest.json: {message}")


def _mismatch(message: str, **details: Any) -> PackageError:
    return PackageError("PKG_MANIFEST_MISMATCH", f"manifest.json: {message}", **details)


def _validate(data: bytes, package_id: str, limits: PackageLimits) -> ValidatedPackage:
    entries = {e.name: e for e in scan_zip(data, limits)}
    if MANIFEST_NAME not in entries:
        raise PackageError(
            "PKG_MANIFEST_MISSING",
            "the package has no manifest.json; build it with `investigate case build`",
        )
    manifest = _parse_manifest(read_entry(data, entries[MANIFEST_NAME]), len(entries))
    files = _check_manifest_shape(manifest)
    report_name, source, dbs, logs = _check_layout(manifest, files, entries)
    for path, (_digest, size) in files.items():
        if entries[path].size != size:
            raise _mismatch(
                f"{path!r} is listed with {size} bytes but the entry has {entries[path].size}",
                name=path,
            )
    for path, (digest, _size) in sorted(files.items()):
        content = read_entry(data, entries[path])
        if hashlib.sha256(content).hexdigest() != digest:
            raise _mismatch(f"the sha256 of {path!r} differs from the listed one", name=path)
        if path.startswith(DB_ROOT) and not content.startswith(SQLITE_HEADER):
            raise PackageError(
                "PKG_DB_NOT_SQLITE", f"{path!r} is not an SQLite 3 database", name=path
            )
        if path == report_name:
            try:
                content.decode("utf-8", "strict")
            except UnicodeDecodeError as exc:
                raise PackageError(
                    "PKG_REPORT_INVALID", f"the report {path!r} is not UTF-8 text", name=path
                ) from exc
    return ValidatedPackage(
        package_id=package_id,
        size_bytes=len(data),
        entries=MappingProxyType(entries),
        manifest_json=canonical_json(manifest),
        report_name=report_name,
        source_paths=tuple(sorted(source)),
        db_names=tuple(sorted(dbs)),
        log_paths=tuple(sorted(logs)),
    )


def _parse_manifest(raw: bytes, entries: int) -> dict[str, Any]:
    # Bounded before parsing: parsed JSON takes tens of bytes per value, so a 25 MB
    # manifest of six million empty lists took 1 GB in every process that opened the
    # package (a hostile-input trial). Every value but a container's first follows a
    # comma, so commas and openings outside strings bound the count.
    skeleton = _JSON_STRING.sub(b"", raw)
    values = 1 + skeleton.count(b",") + skeleton.count(b"[") + skeleton.count(b"{")
    most = _MANIFEST_VALUES_FIXED + _MANIFEST_VALUES_PER_ENTRY * entries
    if values > most:
        raise _invalid(f"holds about {values} JSON values, more than the {most} that "
                       f"{entries} archive entries need")
    try:
        value = strict_json_loads(raw.decode("utf-8", "strict"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _invalid(f"not valid UTF-8 JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise _invalid("must be a JSON object")
    try:  # JSON can spell a lone UTF-16 surrogate ("\ud800"); UTF-8 cannot hold it
        canonical_json(value)
    except UnicodeEncodeError as exc:
        raise _invalid("a string is not text: it holds a lone UTF-16 surrogate, which "
                       "UTF-8 cannot encode") from exc
    if value.get("format") != PACKAGE_FORMAT:
        raise _invalid(
            f"format is {value.get('format')!r}, this engine reads {PACKAGE_FORMAT!r}; "
            "rebuild the package with this version of `investigate case build`"
        )
    return value


def _check_manifest_shape(manifest: dict[str, Any]) -> dict[str, tuple[str, int]]:
    if not isinstance(manifest.get("report"), str):
        raise _invalid("'report' must be a string")
    if manifest.get("source_root") != SOURCE_ROOT:
        raise _invalid(f"'source_root' must be {SOURCE_ROOT!r}")
    if manifest.get("logs_root") not in (LOGS_ROOT, None):
        raise _invalid(f"'logs_root' must be {LOGS_ROOT!r} or null")
    databases = manifest.get("databases")
    if not isinstance(databases, list) or not all(isinstance(d, str) for d in databases):
        raise _invalid("'databases' must be a list of strings")
    if len(set(databases)) != len(databases):
        raise _invalid("'databases' lists a name twice")
    for name in databases:
        if "/" in name or not name.endswith(DB_SUFFIX):
            raise _invalid(f"database name {name!r} must be a plain '*{DB_SUFFIX}' file name")
    listed = manifest.get("files")
    if not isinstance(listed, list):
        raise _invalid("'files' must be a list")
    files: dict[str, tuple[str, int]] = {}
    for item in listed:
        if not isinstance(item, dict):
            raise _invalid("every 'files' item must be an object")
        path, digest, size = item.get("path"), item.get("sha256"), item.get("size")
        if not isinstance(path, str) or not path or path.endswith("/"):
            raise _invalid(f"file path {path!r} must be a non-empty file name")
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise _invalid(f"the sha256 of {path!r} must be 64 lower-case hex digits")
        if type(size) is not int or size < 0:
            raise _invalid(f"the size of {path!r} must be a non-negative integer")
        if path in files:
            raise _invalid(f"{path!r} is listed twice")
        if path == MANIFEST_NAME:
            raise _invalid("the manifest must not list itself")
        files[path] = (digest, size)
    return files


def _check_layout(
    manifest: dict[str, Any], files: Mapping[str, tuple[str, int]],
    entries: Mapping[str, ZipEntry],
) -> tuple[str, list[str], list[str], list[str]]:
    present = set(entries) - {MANIFEST_NAME}
    missing = sorted(set(files) - present)
    if missing:
        raise _mismatch(f"{len(missing)} listed file(s) are absent, e.g. {missing[0]!r}",
                        name=missing[0])
    unlisted = sorted(present - set(files))
    if unlisted:
        raise _mismatch(f"{len(unlisted)} entr(y/ies) are not listed, e.g. {unlisted[0]!r}",
                        name=unlisted[0])
    report = manifest["report"]
    roots = (SOURCE_ROOT, DB_ROOT, LOGS_ROOT)
    try:
        check_relative_path(report)
    except PackageError as exc:
        raise _invalid(f"'report' {report[:200]!r} is not a valid path") from exc
    if report not in files or report.startswith(roots):
        raise _invalid(f"'report' {report!r} must name a listed file outside {roots}")
    databases: list[str] = manifest["databases"]
    logs_root = manifest.get("logs_root")  # absent: null, as the shape check allows
    source: list[str] = []
    dbs: list[str] = []
    logs: list[str] = []
    for path in files:
        if path == report:
            continue
        if path.startswith(SOURCE_ROOT):
            source.append(path[len(SOURCE_ROOT):])
        elif path.startswith(DB_ROOT) and path[len(DB_ROOT):] in databases:
            dbs.append(path[len(DB_ROOT):])
        elif path.startswith(LOGS_ROOT) and logs_root == LOGS_ROOT:
            logs.append(path[len(LOGS_ROOT):])
        else:
            raise _invalid(
                f"entry {path!r} is outside the package layout (report, source/, the "
                "listed db/ files, logs/ when logs_root is set)"
            )
    absent = sorted(set(databases) - set(dbs))
    if absent:
        raise _mismatch(f"database {absent[0]!r} is listed but has no db/ entry",
                        name=absent[0])
    return report, source, dbs, logs
