"""Artifact bytes stored once, compressed, as deltas of their predecessors, exact on read.

Issue 13 (DESIGN.md "Cost that does not grow with history"): a step's context extends the
previous step's, its model request embeds it, and its state repeats the previous state
plus one record. Stored whole, those copies make storage grow with the square of the
number of steps. Here:

* Bytes are **content-addressed**: one ``blob`` row per sha256, whatever the number of
  artifact paths (and cases) that name those bytes.
* Each blob is one **zstandard** frame: a *keyframe* (``zstd``) or a *delta*
  (``zstd-delta``): the frame compressed with the bytes of a *base* blob as zstd's
  raw-content dictionary (what ``zstd --patch-from`` does), so it costs about what it
  adds to its base.
* The base of a new artifact is the newest artifact of the same case and **kind** (its
  path with every run of digits replaced by ``*``): the previous step's context for a
  context, the previous request for a request, the previous state for a state.
* The lineage head is remembered per process (:class:`_Heads`): a store that follows
  one of the previous step of the same case and kind deltas against it without asking the
  store which artifact is newest. The delta is inserted only if its base exists with a
  depth below the bound (the depth is the base's plus one, read by the insert itself), so
  a stale memory (another process wrote since, a transaction rolled back, a restored
  database) changes what a delta is taken against, never which bytes are stored.
* A delta chain is at most :data:`MAX_DELTA_DEPTH` deltas long; the next blob is a
  keyframe. A read therefore decodes at most that many frames, and storage per step grows
  by a keyframe's share only (its size over the chain length).
* Reads are **exact**: decoded bytes are hashed and compared with the sha256 before they
  are returned (``STORE_ARTIFACT_CORRUPT`` otherwise). Decoded bytes are kept in a bounded
  per-process cache keyed by their sha256; a content address cannot go stale, and a
  ``fresh`` read (the full replay, export, ``investigate verify``) bypasses the cache and
  decodes everything from the store again.
"""

from __future__ import annotations

import hashlib
import re
import threading
import weakref
from collections import OrderedDict
from typing import Any, NamedTuple

import zstandard
from sqlalchemy import bindparam, exists, literal, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlmodel import Session

from investigation.errors import StoreError
from investigation.store import direct
from investigation.store.models import Artifact, Blob

#: Deltas at most between a blob and its keyframe (bounds a read to this many frames).
MAX_DELTA_DEPTH = 32
#: zstandard compression level (3 is zstd's default: fast, and deltas stay small).
LEVEL = 3
#: Bytes of decoded blobs kept per process (least recently used are dropped).
CACHE_BYTES = 64 << 20
ENCODING_WHOLE = "zstd"
ENCODING_DELTA = "zstd-delta"

_DIGITS = re.compile(r"\d+")


def kind_of(path: str) -> str:
    """The lineage of an artifact path: every run of digits replaced by ``*``."""
    return _DIGITS.sub("*", path)


def sha256_hex(data: bytes) -> str:
    """Lower-case hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


class ByteCache:
    """Decoded blob bytes by sha256, bounded by total size (thread-safe LRU).

    The process keeps one (:data:`CACHE`); a read that must not trust it (a full replay,
    an export) passes a new, private one, so every blob it needs is read and checked once.

    Args:
        max_bytes: total bytes kept. Default 32 MiB.
    """

    def __init__(self, max_bytes: int = 32 << 20) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, sha: str) -> bytes | None:
        with self._lock:
            data = self._items.get(sha)
            if data is not None:
                self._items.move_to_end(sha)
            return data

    def put(self, sha: str, data: bytes) -> None:
        if len(data) > self.max_bytes // 4:
            return
        with self._lock:
            if sha in self._items:
                self._items.move_to_end(sha)
                return
            self._items[sha] = data
            self._size += len(data)
            while self._size > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._size -= len(dropped)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._size = 0


#: The process-wide cache (content addresses cannot go stale).
CACHE = ByteCache(CACHE_BYTES)


def _dictionary(base: bytes) -> zstandard.ZstdCompressionDict:
    return zstandard.ZstdCompressionDict(base, dict_type=zstandard.DICT_TYPE_RAWCONTENT)


def compress(data: bytes, base: bytes | None = None) -> bytes:
    """One zstd frame of ``data``; with ``base``, a delta against those bytes."""
    if base is None:
        return zstandard.ZstdCompressor(level=LEVEL).compress(data)
    return zstandard.ZstdCompressor(level=LEVEL, dict_data=_dictionary(base)).compress(data)


def decompress(frame: bytes, base: bytes | None = None, size: int | None = None) -> bytes:
    """The bytes of one frame written by :func:`compress` (same ``base``).

    Args:
        size: the blob's recorded size; a frame that declares more, or decodes to more,
            is damaged. zstandard allocates what a frame header declares before it
            decodes (``max_output_size`` bounds only frames without a declared size), so a
            forged header of a few bytes could ask for gigabytes: it is read first.

    Raises:
        zstandard.ZstdError: the frame is damaged, or larger than ``size``.
    """
    limit = 0
    if size is not None:
        declared = zstandard.frame_content_size(frame)
        if declared > size:
            raise zstandard.ZstdError(f"the frame declares {declared} bytes, the blob "
                                      f"records {size}")
        limit = max(size, 1)
    if base is None:
        return zstandard.ZstdDecompressor().decompress(frame, max_output_size=limit)
    return zstandard.ZstdDecompressor(dict_data=_dictionary(base)).decompress(
        frame, max_output_size=limit)


def _corrupt(sha: str, why: str) -> StoreError:
    return StoreError("STORE_ARTIFACT_CORRUPT",
                      f"the stored bytes of blob {sha} {why}; the store was damaged or changed "
                      "outside the engine: restore it from a backup", sha256=sha)


# Statements built once (building a statement costs more than running it on SQLite), on
# the Core tables: artifacts and blobs are append-only rows the ORM never writes, so they
# are read and written on the session's connection (no ORM result or bulk-insert work).
_B = Blob.__table__.c  # type: ignore[attr-defined]
_A = Artifact.__table__.c  # type: ignore[attr-defined]
_BLOB = select(_B.encoding, _B.base_sha256, _B.data, _B.size_bytes).where(
    _B.sha256 == bindparam("sha"))


def _lineage_head(case_id: str, kind: str) -> Any:
    """The newest blob of a case and kind, ``(sha256, depth)``, for the bind parameters
    named ``case_id`` and ``kind``."""
    return (select(_A.sha256, _B.depth)
            .join(Blob.__table__, _B.sha256 == _A.sha256)  # type: ignore[attr-defined]
            .where(_A.case_id == bindparam(case_id), _A.kind == bindparam(kind))
            .order_by(_A.id.desc()).limit(1))


_LINEAGE_HEAD = _lineage_head("case_id", "kind")
#: The same head as two scalar subqueries of ``head_case_id`` and ``head_kind`` (an
#: insert's own columns take the plain names): on PostgreSQL the artifact insert returns
#: them, so a blob stored next needs no statement of its own to find its base.
_HEAD_ROW = _lineage_head("head_case_id", "head_kind").subquery("head")
LINEAGE_HEAD_RETURNING = (select(_HEAD_ROW.c.sha256).scalar_subquery(),
                          select(_HEAD_ROW.c.depth).scalar_subquery())
#: A blob unless its bytes are stored already (a row when inserted: a rowcount is not
#: reported on every driver).
_INSERTS = {name: insert(Blob.__table__)  # type: ignore[attr-defined]
            .on_conflict_do_nothing(index_elements=["sha256"]).returning(_B.depth)
            for name, insert in (("postgresql", pg_insert), ("sqlite", sqlite_insert))}
_DEPTH = select(_B.depth).where(_B.sha256 == bindparam("sha"))
#: A delta of a remembered base: inserted only when the base exists with room below the
#: depth bound, at the base's depth plus one (a row of the new depth when inserted).
_BASE = Blob.__table__.alias("base")  # type: ignore[attr-defined]
_DELTA_FROM_BASE = select(
    bindparam("sha256", type_=_B.sha256.type), bindparam("size_bytes", type_=_B.size_bytes.type),
    literal(ENCODING_DELTA, _B.encoding.type), _BASE.c.sha256, _BASE.c.depth + 1,
    bindparam("data", type_=_B.data.type)).where(
    _BASE.c.sha256 == bindparam("base_sha256"), _BASE.c.depth < MAX_DELTA_DEPTH)
_DELTA_INSERTS = {
    name: insert(Blob.__table__).from_select(  # type: ignore[attr-defined]
        ["sha256", "size_bytes", "encoding", "base_sha256", "depth", "data"],
        _DELTA_FROM_BASE).on_conflict_do_nothing(index_elements=["sha256"])
    .returning(_B.depth)
    for name, insert in (("postgresql", pg_insert), ("sqlite", sqlite_insert))}
_STEP = re.compile(r"\d+")


def _with_artifact(blob_row: Any) -> Any:
    """PostgreSQL: a new artifact row and its blob in one statement (decision 138): the
    artifact is inserted unless its path exists, the blob ``blob_row`` selects only when
    the artifact was inserted and unless its bytes are stored. Returns one row
    ``(artifact_id, depth)``: the new artifact's id (``None``: the path existed) and the
    new blob's depth (``None``: not inserted). The artifact's bind parameters are
    ``put_artifact``'s, the blob's those of :attr:`Planned.values`."""
    new_artifact = pg_insert(Artifact.__table__).values(  # type: ignore[attr-defined]
        case_id=bindparam("case_id"), path=bindparam("path"), kind=bindparam("kind"),
        sha256=bindparam("sha256"), size_bytes=bindparam("size_bytes"),
        media_type=bindparam("media_type"), created_at=bindparam("created_at"),
    ).on_conflict_do_nothing(index_elements=["case_id", "path"]).returning(_A.id) \
        .cte("new_artifact")
    new_blob = pg_insert(Blob.__table__).from_select(  # type: ignore[attr-defined]
        ["sha256", "size_bytes", "encoding", "base_sha256", "depth", "data"],
        blob_row.where(exists(select(new_artifact.c.id)))
    ).on_conflict_do_nothing(index_elements=["sha256"]).returning(_B.depth).cte("new_blob")
    return select(select(new_artifact.c.id).scalar_subquery().label("artifact_id"),
                  select(new_blob.c.depth).scalar_subquery().label("depth"))


_KEYFRAME_ROW = select(
    bindparam("sha256", type_=_B.sha256.type), bindparam("size_bytes", type_=_B.size_bytes.type),
    bindparam("encoding", type_=_B.encoding.type),
    bindparam("base_sha256", type_=_B.base_sha256.type), bindparam("depth", type_=_B.depth.type),
    bindparam("data", type_=_B.data.type))
#: PostgreSQL: :func:`_with_artifact` with a planned keyframe, or a planned delta.
WITH_ARTIFACT = {True: _with_artifact(_KEYFRAME_ROW), False: _with_artifact(_DELTA_FROM_BASE)}


class _Heads:
    """The newest blob this process stored or found per (case, kind) and database, with
    the step its path names: ``(case_id, kind) -> (step, sha256, depth)``. Only a head of
    the step before (or of the same step) is used: in a linear case that is the newest of
    its kind unless another process wrote one since, which only makes the next delta one
    against an older base. Bounded: cleared when :data:`KEPT` entries are held."""

    KEPT = 4096

    def __init__(self) -> None:
        self._by_engine: weakref.WeakKeyDictionary[Any, dict[tuple[str, str],
                                                               tuple[int, str, int]]] = \
            weakref.WeakKeyDictionary()

    def of(self, engine: Any) -> dict[tuple[str, str], tuple[int, str, int]]:
        heads = self._by_engine.get(engine)
        if heads is None:
            heads = self._by_engine[engine] = {}
        return heads

    @classmethod
    def remember(cls, heads: dict[tuple[str, str], tuple[int, str, int]],
                 key: tuple[str, str], step: int | None, sha: str, depth: int) -> None:
        if step is None:
            return
        if len(heads) >= cls.KEPT and key not in heads:
            heads.clear()  # a bound, not an LRU: single dict operations only
        heads[key] = (step, sha, depth)


_HEADS = _Heads()


def _step_of(path: str) -> int | None:
    """The step an artifact path names (its first number), or None."""
    found = _STEP.search(path)
    return int(found.group()) if found else None


def load(session: Session, sha: str, *, cache: ByteCache | None = None) -> bytes:
    """The exact bytes whose sha256 is ``sha``.

    Args:
        cache: where decoded bytes are looked up and kept; default the process's
            :data:`CACHE`. A new, empty one makes the read decode every blob of the chain
            from the store again.

    Raises:
        StoreError: ``STORE_ARTIFACT_CORRUPT`` when the blob (or a base of its chain) is
        missing, does not decode, or decodes to other bytes.
    """
    cache = CACHE if cache is None else cache
    cached = cache.get(sha)
    if cached is not None:
        return cached
    chain: list[tuple[str, str, bytes, int]] = []  # (sha, encoding, frame, size), newest first
    known: bytes | None = None
    current: str | None = sha
    while current is not None:
        if chain:
            known = cache.get(current)
            if known is not None:
                break
        row = direct.session_connection(session).execute(_BLOB, {"sha": current}).first()
        if row is None:
            raise _corrupt(current, "are missing")
        encoding, base_sha, frame, size = row
        chain.append((current, str(encoding), bytes(frame), int(size)))
        if len(chain) > MAX_DELTA_DEPTH + 1 or encoding == ENCODING_WHOLE:
            current = None
        elif encoding == ENCODING_DELTA and base_sha:
            current = str(base_sha)
        else:
            raise _corrupt(current, f"have an unknown encoding {encoding!r}")
    data = known
    for blob_sha, encoding, frame, size in reversed(chain):
        if encoding == ENCODING_DELTA and data is None:
            raise _corrupt(blob_sha, "form a delta chain longer than the engine writes")
        try:
            data = decompress(frame, data if encoding == ENCODING_DELTA else None, size)
        except zstandard.ZstdError as exc:
            raise _corrupt(blob_sha, f"do not decode ({exc})") from exc
        if sha256_hex(data) != blob_sha:
            raise _corrupt(blob_sha, "decode to other bytes than their sha256 names")
        cache.put(blob_sha, data)
    assert data is not None
    return data


#: ``store``'s ``lineage_head`` when the caller did not read the lineage head.
UNREAD: Any = object()


class Planned(NamedTuple):
    """A blob insert worked out from this process's lineage head before any statement
    runs (:func:`plan`)."""

    keyframe: bool  # a keyframe (the head's chain is full), else a delta of the head
    values: dict[str, Any]  # the insert's bind parameters (``sha256`` ... ``data``)
    key: tuple[str, str]  # (case_id, kind)
    step: int  # the step the artifact path names


def _usable_head(heads: dict[tuple[str, str], tuple[int, str, int]], key: tuple[str, str],
                 step: int | None) -> tuple[int, str, int] | None:
    """The remembered head of ``key`` when it is of the step before or the same step."""
    if step is None:
        return None
    head = heads.get(key)
    return head if head is not None and head[0] in (step - 1, step) else None


def plan(conn: Any, case_id: str, kind: str, data: bytes, sha: str, path: str, *,
         unless_seen: bool = True) -> Planned | None:
    """The blob insert that stores ``data`` (sha256 ``sha``) against this process's
    remembered lineage head, computed before any statement runs, or ``None`` when none is
    sure to be the one to run: no head of the step before is remembered, (``unless_seen``)
    the head holds these very bytes or this process has seen them (they may be stored
    already: :func:`store` asks first), or a delta is due and the head's bytes are not
    cached (or are these very bytes).

    Args:
        conn: the transaction's connection (its engine keys the remembered heads).
    """
    key, step = (case_id, kind), _step_of(path)
    head = _usable_head(_HEADS.of(conn.engine), key, step)
    if step is None or head is None:
        return None
    _, head_sha, head_depth = head
    if unless_seen and (head_sha == sha or CACHE.get(sha) is not None):
        return None
    if head_depth >= MAX_DELTA_DEPTH:  # the chain is full: a keyframe
        return Planned(True, {"sha256": sha, "size_bytes": len(data),
                              "encoding": ENCODING_WHOLE, "base_sha256": None, "depth": 0,
                              "data": compress(data)}, key, step)
    base = CACHE.get(head_sha) if head_sha != sha else None
    if base is None:
        return None
    return Planned(False, {"sha256": sha, "size_bytes": len(data), "base_sha256": head_sha,
                           "data": compress(data, base)}, key, step)


def planned_stored(conn: Any, planned: Planned, data: bytes, depth: int | None) -> bool:
    """Take in what a :class:`Planned` insert did (``depth``: the new blob's, ``None`` when
    it inserted nothing). ``True`` when the bytes are stored: inserted, or a keyframe that
    met the same bytes stored already; ``False`` for a delta not inserted (the bytes are
    stored already, or the base is gone or full): :func:`store` them with ``fast=False``,
    which asks the store for the lineage head."""
    heads = _HEADS.of(conn.engine)
    sha = planned.values["sha256"]
    if depth is not None:
        _Heads.remember(heads, planned.key, planned.step, sha, int(depth))
    elif planned.keyframe:
        heads.pop(planned.key, None)
    else:
        return False
    CACHE.put(sha, data)
    return True


def store(session: Session, case_id: str, kind: str, data: bytes, sha: str,
          path: str | None = None,
          lineage_head: tuple[str, int] | None = UNREAD, *, fast: bool = True) -> None:
    """Store ``data`` (whose sha256 is ``sha``) as a blob unless it exists: a delta of the
    newest blob of the same case and kind, or a keyframe when there is none or its chain
    is full. Concurrent writers of the same bytes are harmless (the first row stays).

    Args:
        path: the artifact path the bytes are stored under; with it, the lineage head
            this process remembers from the previous step is used (see :class:`_Heads`).
        lineage_head: the newest blob of the case and kind, ``(sha256, depth)`` or ``None`` for
            none, read earlier in this transaction (the PostgreSQL artifact insert
            returns it); by default it is read here when needed.
        fast: ``False``: the remembered head was tried already (a :class:`Planned`
            delta that inserted nothing); go to the store's lineage head at once.
    """
    conn = direct.session_connection(session)
    dialect = "postgresql" if conn.dialect.name == "postgresql" else "sqlite"
    heads = _HEADS.of(conn.engine)
    key = (case_id, kind)
    step = _step_of(path) if path is not None else None
    head = _usable_head(heads, key, step) if fast else None
    if head is not None and path is not None:
        if head[1] == sha or CACHE.get(sha) is not None:
            # The same bytes as the head, or bytes this process has seen: they may be
            # stored already (by this case or another).
            depth = conn.execute(_DEPTH, {"sha": sha}).scalar()
            if depth is not None:
                _Heads.remember(heads, key, step, sha, int(depth))
                CACHE.put(sha, data)
                return
        planned = plan(conn, case_id, kind, data, sha, path, unless_seen=False)
        if planned is not None:
            row = conn.execute(_INSERTS[dialect] if planned.keyframe
                               else _DELTA_INSERTS[dialect], planned.values).first()
            if planned_stored(conn, planned, data, None if row is None else int(row[0])):
                return
    # Not inserted (the bytes exist, the base is gone or full): ask the store.
    base_row = conn.execute(_LINEAGE_HEAD, {"case_id": case_id, "kind": kind}).first() \
        if lineage_head is UNREAD else lineage_head
    if base_row is not None and base_row[0] == sha:
        _Heads.remember(heads, key, step, sha, int(base_row[1]))
        CACHE.put(sha, data)
        return  # the newest of its kind holds these very bytes: the blob exists
    base_sha: str | None = None
    depth = 0
    frame: bytes
    if base_row is not None and int(base_row[1]) < MAX_DELTA_DEPTH:
        base_sha, depth = str(base_row[0]), int(base_row[1]) + 1
        frame = compress(data, load(session, base_sha))
    else:
        frame = compress(data)
    values = {"sha256": sha, "size_bytes": len(data),
              "encoding": ENCODING_DELTA if base_sha else ENCODING_WHOLE,
              "base_sha256": base_sha, "depth": depth, "data": frame}
    if conn.execute(_INSERTS[dialect], values).first() is not None:
        _Heads.remember(heads, key, step, sha, depth)
    else:  # the bytes were stored already (another path or case): depth unknown here
        heads.pop(key, None)
    CACHE.put(sha, data)
