"""The decoded text of a package, shared by every search over it (a text index).

A search must not decompress and decode the whole package again at every step: the
snapshot's entry cache (32 MiB) is smaller than a real source tree, so nothing would be
reused. The text of every source and log file that is UTF-8 text (no NUL byte, strict
UTF-8: :func:`decode_text`) is therefore written once per package into one file on local
disk and memory-mapped by each search, in any worker process of the host.

Index file ``<package sha256>.v<INDEX_FORMAT>.idx`` (integers little-endian)::

    content   for each text file, in the snapshot's sorted order (source, then logs):
              its exact bytes followed by one "\\n" separator
    table     canonical JSON {"format", "package_id", "content_bytes",
              "roots": {"source": [[path, offset, length], ...], "logs": [...]}};
              offset -1 (length 0) marks a file that is not text
    footer    64 bytes: magic b"INVTXIDX", format u32, 0 u32, content bytes u64,
              table bytes u64, sha256 of content + table

Rules:

* The file is a cache derived from the immutable package: its name binds the package
  sha256 and the format version; nothing in it depends on the tool limits (caps, line
  bounds and deadlines apply at search time).
* A process checks the whole file when it opens it (footer, sha256 of content and table,
  package id, the exact path lists of the snapshot, offsets and separators); anything
  else is rebuilt. An index is never modified in place.
* Builders write a temporary file in the same directory, ``fsync`` it and rename it into
  place (atomic); an exclusive ``flock`` per package only avoids duplicate builds, so
  correctness never depends on it. A builder that dies leaves at most a ``.tmp`` file,
  which the next build in that directory removes when it is older than an hour.
* The directory is bounded by ``max_bytes`` (default 2 GiB): after a build, the least
  recently opened indexes are deleted until the rest fit. A package whose text alone
  exceeds the bound gets no index.
* Each search maps the file read-only and unmaps it when done, so a process's resident
  memory holds at most the index of the search in progress; the pages themselves are the
  kernel's page cache, shared by every process on the host.
* Without a usable directory (none configured, read-only, full disk) or a usable file,
  searches read the snapshot itself (:class:`LiveTextIndex`): same results, slower.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Protocol, runtime_checkable

from investigation import jsonio
from investigation.cases.snapshot import Snapshot

try:  # POSIX; elsewhere concurrent builders simply duplicate work
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "DEFAULT_TEXT_INDEX_BYTES",
    "INDEX_FORMAT",
    "ROOTS",
    "Buffer",
    "IndexedSnapshot",
    "LiveTextIndex",
    "MappedTextIndex",
    "TextIndex",
    "TextIndexStore",
    "TextView",
    "decode_text",
]

log = logging.getLogger(__name__)

#: Version of the index file layout (part of the file name).
INDEX_FORMAT = 1
#: Default bound of one index directory, in bytes (2 GiB).
DEFAULT_TEXT_INDEX_BYTES = 2 << 30
#: The file roots an index covers, in file order.
ROOTS = ("source", "logs")

_MAGIC = b"INVTXIDX"
_FOOTER = struct.Struct("<8sIIQQ32s")
#: Largest table accepted when opening an index (20,000 entries of 1 KiB names fit).
_MAX_TABLE_BYTES = 64 << 20
#: Age after which a leftover temporary file of a dead builder is removed.
_STALE_TMP_S = 3600.0

#: What a search reads: the bytes of one file, or the whole mapped index.
Buffer = bytes | mmap.mmap


def decode_text(data: bytes) -> str | None:
    """Strict UTF-8 text of a file, or None for a binary (NUL byte) or non-UTF-8 file."""
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


class TextView(Protocol):
    """The text files of one snapshot during one search."""

    def locate(self, root: str, path: str) -> tuple[Buffer, int, int] | None:
        """``(buffer, start, end)`` of a text file's exact bytes, or None if not text.

        ``buffer[start:end]`` is the file; the byte before ``start`` (if any) and the byte
        at ``end`` (if any) are ``\\n``. Raises ``KeyError`` for an unknown path.
        """
        ...


class TextIndex(Protocol):
    """Where searches get the text of a snapshot from."""

    def view(self) -> contextlib.AbstractContextManager[TextView]:
        """A view for one search; buffers it returned are invalid once it is closed."""
        ...


@runtime_checkable
class IndexedSnapshot(Protocol):
    """A snapshot that can offer a shared text index (``PackageSnapshot`` does)."""

    def text_index(self) -> TextIndex | None:
        """The snapshot's shared index, or None when it has none."""
        ...


# -- reading the snapshot itself ---------------------------------------------------------------


class _LiveView:
    def __init__(self, readers: Mapping[str, Callable[[str], bytes]]) -> None:
        self._readers = readers

    def locate(self, root: str, path: str) -> tuple[Buffer, int, int] | None:
        data = self._readers[root](path)
        if decode_text(data) is None:
            return None
        return data, 0, len(data)


class LiveTextIndex:
    """Reads (and decodes) every file from the snapshot at every search (no sharing).

    Args:
        snapshot: any :class:`~investigation.cases.snapshot.Snapshot`.
    """

    def __init__(self, snapshot: Snapshot) -> None:
        self._view = _LiveView({"source": snapshot.read_source, "logs": snapshot.read_log})

    @contextlib.contextmanager
    def view(self) -> Iterator[TextView]:
        yield self._view


# -- the mapped index file ---------------------------------------------------------------------


class _IndexInvalid(Exception):
    """The index file is not a complete, intact index of this snapshot."""


class _MappedView:
    def __init__(self, mapping: mmap.mmap, table: Mapping[str, Mapping[str, tuple[int, int]]]
                 ) -> None:
        self._map = mapping
        self._table = table

    def locate(self, root: str, path: str) -> tuple[Buffer, int, int] | None:
        start, length = self._table[root][path]
        if start < 0:
            return None
        return self._map, start, start + length


class MappedTextIndex:
    """An opened, verified index file (see the module docstring).

    Use :meth:`TextIndexStore.open` to get one. It keeps the file open (so it survives
    eviction by another process) and maps it for each :meth:`view`.
    """

    def __init__(self, path: Path, snapshot: Snapshot) -> None:
        self.path = path
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            self._table, self.size_bytes = _verify(fd, snapshot)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def view(self) -> Iterator[TextView]:
        """Map the index read-only for one search; unmapped on exit."""
        with self._lock:
            if self._fd is None:
                raise ValueError(f"text index {self.path} is closed")
            mapping = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
        try:
            yield _MappedView(mapping, self._table)
        finally:
            mapping.close()

    def close(self) -> None:
        """Close the file (views already open stay valid until they exit)."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _verify(fd: int, snapshot: Snapshot
            ) -> tuple[dict[str, dict[str, tuple[int, int]]], int]:
    """Check an index file against ``snapshot``; return its table and size in bytes."""
    size = os.fstat(fd).st_size
    if size < _FOOTER.size:
        raise _IndexInvalid("shorter than its footer")
    magic, fmt, _zero, content_bytes, table_bytes, digest = _FOOTER.unpack(
        os.pread(fd, _FOOTER.size, size - _FOOTER.size))
    if magic != _MAGIC or fmt != INDEX_FORMAT:
        raise _IndexInvalid("wrong magic or format")
    if table_bytes > _MAX_TABLE_BYTES or content_bytes + table_bytes + _FOOTER.size != size:
        raise _IndexInvalid("sizes disagree with the file size")
    hasher = hashlib.sha256()
    if content_bytes:
        with mmap.mmap(fd, content_bytes, access=mmap.ACCESS_READ) as mapping:
            hasher.update(mapping)
            table_raw = os.pread(fd, table_bytes, content_bytes)
            hasher.update(table_raw)
            if hasher.digest() != digest:
                raise _IndexInvalid("sha256 mismatch")
            table = _parse_table(table_raw, snapshot, content_bytes, mapping)
    else:
        table_raw = os.pread(fd, table_bytes, 0)
        hasher.update(table_raw)
        if hasher.digest() != digest:
            raise _IndexInvalid("sha256 mismatch")
        table = _parse_table(table_raw, snapshot, 0, b"")
    return table, size


def _parse_table(raw: bytes, snapshot: Snapshot, content_bytes: int, content: Buffer
                 ) -> dict[str, dict[str, tuple[int, int]]]:
    try:
        doc = jsonio.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _IndexInvalid("table is not JSON") from exc
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT \
            or doc.get("package_id") != snapshot.package_id \
            or doc.get("content_bytes") != content_bytes \
            or not isinstance(doc.get("roots"), dict):
        raise _IndexInvalid("table header does not match")
    expected = {"source": snapshot.source_paths(), "logs": snapshot.log_paths()}
    table: dict[str, dict[str, tuple[int, int]]] = {}
    offset = 0
    for root in ROOTS:
        rows = doc["roots"].get(root)
        if not isinstance(rows, list) or len(rows) != len(expected[root]):
            raise _IndexInvalid(f"{root} paths differ")
        entries: dict[str, tuple[int, int]] = {}
        for row, path in zip(rows, expected[root], strict=True):
            if not (isinstance(row, list) and len(row) == 3 and row[0] == path
                    and type(row[1]) is int and type(row[2]) is int):
                raise _IndexInvalid(f"{root} entry for {path!r} differs")
            start, length = row[1], row[2]
            if start == -1 and length == 0:
                entries[path] = (-1, 0)
                continue
            if start != offset or length < 0 or start + length >= content_bytes \
                    or content[start + length] != 0x0A:
                raise _IndexInvalid(f"{root} offsets of {path!r} are inconsistent")
            entries[path] = (start, length)
            offset = start + length + 1
        table[root] = entries
    if offset != content_bytes:
        raise _IndexInvalid("content has bytes no file owns")
    return table


# -- the index directory -----------------------------------------------------------------------


class TextIndexStore:
    """A directory of index files, bounded in bytes, shared by every process of a host.

    Args:
        directory: where index files live (created on first use). Local disk is best:
            on a network file system ``flock`` may not exclude, which only costs
            duplicate builds.
        max_bytes: bound of all index files together (default 2 GiB).
    """

    def __init__(self, directory: str | os.PathLike[str],
                 max_bytes: int = DEFAULT_TEXT_INDEX_BYTES) -> None:
        self.directory = Path(directory)
        self.max_bytes = max(0, max_bytes)

    def path_for(self, package_id: str) -> Path:
        """Where the index of ``package_id`` lives."""
        return self.directory / f"{package_id}.v{INDEX_FORMAT}.idx"

    def open(self, snapshot: Snapshot) -> MappedTextIndex | None:
        """The verified index of ``snapshot``, built first if needed.

        Never raises for index trouble: an unusable directory, a package whose text
        exceeds ``max_bytes`` or a failed build give None (searches then read the snapshot
        itself), logged as a warning.
        """
        target = self.path_for(snapshot.package_id)
        try:
            found = self._try_open(target, snapshot)
            if found is not None:
                return found
            self.directory.mkdir(parents=True, exist_ok=True)
            with self._build_lock(snapshot.package_id):
                found = self._try_open(target, snapshot)  # another process built it
                if found is not None:
                    return found
                if not self._build(snapshot, target):
                    return None
                self._evict(keep=target)
                return self._try_open(target, snapshot, fresh=True)
        except OSError as exc:
            log.warning("text index for package %s unavailable in %s (%s); searches read "
                        "the package itself", snapshot.package_id[:12], self.directory, exc)
            return None

    def _try_open(self, target: Path, snapshot: Snapshot, fresh: bool = False
                  ) -> MappedTextIndex | None:
        try:
            index = MappedTextIndex(target, snapshot)
        except FileNotFoundError:
            return None
        except _IndexInvalid as exc:
            log.warning("text index %s is not valid (%s); rebuilding it", target, exc)
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
            if fresh:
                raise OSError(f"a freshly built index failed its check: {exc}") from exc
            return None
        with contextlib.suppress(OSError):
            os.utime(target)  # recency for eviction
        return index

    @contextlib.contextmanager
    def _build_lock(self, package_id: str) -> Iterator[None]:
        if fcntl is None:  # pragma: no cover
            yield
            return
        lock_path = self.directory / f"{package_id}.lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _build(self, snapshot: Snapshot, target: Path) -> bool:
        """Write the index of ``snapshot`` to ``target`` atomically; False if too large."""
        self._remove_stale_tmp()
        started = time.monotonic()
        fd, tmp_name = tempfile.mkstemp(prefix=f".{snapshot.package_id}.", suffix=".tmp",
                                        dir=self.directory)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out:
                hasher = hashlib.sha256()
                table, content_bytes = _write_content(out, snapshot, self.max_bytes, hasher)
                if table is None:
                    log.warning("package %s has more text than the text index bound "
                                "(%d bytes); searches read the package itself",
                                snapshot.package_id[:12], self.max_bytes)
                    tmp.unlink()
                    return False
                raw = json.dumps({"format": INDEX_FORMAT, "package_id": snapshot.package_id,
                                  "content_bytes": content_bytes, "roots": table},
                                 sort_keys=True, separators=(",", ":"),
                                 ensure_ascii=False).encode("utf-8")
                hasher.update(raw)
                out.write(raw)
                out.write(_FOOTER.pack(_MAGIC, INDEX_FORMAT, 0, content_bytes, len(raw),
                                       hasher.digest()))
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _fsync_dir(self.directory)
        log.info("built text index of package %s (%d bytes) in %.2f s",
                 snapshot.package_id[:12], content_bytes, time.monotonic() - started)
        return True

    def _index_files(self) -> list[tuple[float, int, Path]]:
        found = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(".idx") and not entry.name.startswith("."):
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat()
                    found.append((st.st_mtime, st.st_size, Path(entry.path)))
        return sorted(found)

    def _evict(self, keep: Path) -> None:
        """Delete least recently opened indexes until all fit ``max_bytes``."""
        files = self._index_files()
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                total -= size
                log.info("evicted text index %s (%d bytes)", path.name, size)
                with contextlib.suppress(FileNotFoundError):
                    (self.directory / f"{path.name.split('.')[0]}.lock").unlink()

    def _remove_stale_tmp(self) -> None:
        cutoff = time.time() - _STALE_TMP_S
        for entry in os.scandir(self.directory):
            if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    if entry.stat().st_mtime < cutoff:
                        os.unlink(entry.path)


def _write_content(out: BinaryIO, snapshot: Snapshot, max_bytes: int, hasher: Any
                   ) -> tuple[dict[str, list[list[object]]] | None, int]:
    """Stream every text file into ``out`` (and ``hasher``); the table and content size.

    Returns ``(None, size so far)`` as soon as the index would exceed ``max_bytes``.
    """
    table: dict[str, list[list[object]]] = {}
    offset = 0
    readers: dict[str, tuple[Sequence[str], Callable[[str], bytes]]] = {
        "source": (snapshot.source_paths(), snapshot.read_source),
        "logs": (snapshot.log_paths(), snapshot.read_log),
    }
    for root in ROOTS:
        paths, read = readers[root]
        rows: list[list[object]] = []
        for path in paths:
            data = read(path)
            if decode_text(data) is None:
                rows.append([path, -1, 0])
                continue
            if offset + len(data) + 1 + _FOOTER.size > max_bytes:
                return None, offset
            rows.append([path, offset, len(data)])
            out.write(data)
            out.write(b"\n")
            hasher.update(data)
            hasher.update(b"\n")
            offset += len(data) + 1
        table[root] = rows
    return table, offset


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
