"""A strict, bounded parser of the raw ZIP structure (no extraction, no ``zipfile``).

Python's ``zipfile`` rewrites hostile names (``../x`` becomes ``x``) and does not detect
overlapping entries, so the reader parses the End Of Central Directory (EOCD) record and
the central directory with :mod:`struct` and checks every entry *before* any entry data
is decompressed. Only single-disk, non-ZIP64 archives without an archive comment are
accepted, and every byte of the archive must belong to exactly one local entry (header,
data and optional data descriptor), the central directory or the EOCD record: nothing can
hide in gaps, in front of the first entry or behind the EOCD.

Entry data is decoded by :func:`read_entry` with :mod:`zlib`, bounded by the declared size
and checked against the declared size and CRC-32.
"""

from __future__ import annotations

import stat
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from investigation.cases.layout import check_no_conflicts, decode_entry_name
from investigation.config import PackageLimits
from investigation.errors import PackageError

_EOCD = struct.Struct("<4sHHHHIIH")  # 22 bytes
_EOCD_SIG = b"PK\x05\x06"
_ZIP64_LOCATOR_SIG = b"PK\x06\x07"
_ZIP64_LOCATOR_SIZE = 20
_CENTRAL = struct.Struct("<4sBBHHHHHIIIHHHHHII")  # 46 bytes
_CENTRAL_SIG = b"PK\x01\x02"
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes
_LOCAL_SIG = b"PK\x03\x04"
#: Largest extra field accepted on an entry (standard timestamp/uid extras are ~30 bytes);
#: more could hide data outside every checked entry.
MAX_EXTRA_BYTES = 256
_DESCRIPTOR_SIG = b"PK\x07\x08"
_MAX_COMMENT = 0xFFFF

#: Compression methods that are accepted: 0 stored, 8 deflate.
METHOD_STORED = 0
METHOD_DEFLATE = 8
_FLAG_ENCRYPTED = 0x0001
_FLAG_DESCRIPTOR = 0x0008
_FLAG_STRONG_ENCRYPTION = 0x0040
_FLAG_MASKED_HEADERS = 0x2000

#: The compression-ratio limit applies to entries of at least this many uncompressed
#: bytes. Small, repetitive source files legitimately compress far better than 200:1
#: (a 20 KiB run of spaces deflates to ~40 bytes); the absolute size limits bound them.
RATIO_MIN_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class ZipEntry:
    """One validated file entry (directories are dropped after validation).

    Attributes:
        name: the decoded, validated entry name.
        method: ``METHOD_STORED`` or ``METHOD_DEFLATE``.
        crc32: declared CRC-32 of the uncompressed bytes.
        compressed_size: bytes of entry data in the archive.
        size: declared uncompressed size in bytes.
        data_offset: archive offset of the first data byte.
    """

    name: str
    method: int
    crc32: int
    compressed_size: int
    size: int
    data_offset: int


@dataclass(frozen=True, slots=True)
class _Central:
    name: str
    is_dir: bool
    flags: int
    method: int
    crc32: int
    compressed_size: int
    size: int
    local_offset: int
    raw_name: bytes


def scan_zip(data: bytes, limits: PackageLimits) -> tuple[ZipEntry, ...]:
    """Validate the raw structure of a ZIP archive and return its file entries.

    Nothing is decompressed. Checks, in order: EOCD (single disk, no ZIP64, no comment),
    entry count, central records (names, types, encryption, methods, declared sizes and
    ratios), name collisions, local headers (same name, method and sizes) and byte ranges
    (no overlap, no gap, the central directory directly after the last entry).

    Args:
        data: the whole archive.
        limits: package limits.

    Returns:
        File entries (no directories) in central-directory order.

    Raises:
        PackageError: see the codes in :mod:`investigation.cases.reader`.
    """
    cd_offset, cd_size, count, eocd_offset = _parse_eocd(data, limits)
    centrals = _parse_central_directory(data, cd_offset, cd_size, count, limits)
    check_no_conflicts(
        [c.name for c in centrals if not c.is_dir], [c.name for c in centrals if c.is_dir]
    )
    entries = _parse_local_entries(data, centrals, cd_offset)
    if cd_offset + cd_size != eocd_offset:  # pragma: no cover - guaranteed by _parse_eocd
        raise PackageError("PKG_HIDDEN_DATA", "bytes between central directory and EOCD")
    return tuple(entries)


def read_entry(data: bytes, entry: ZipEntry) -> bytes:
    """Decode one entry's bytes, bounded by its declared size.

    Args:
        data: the archive the entry was scanned from.
        entry: an entry returned by :func:`scan_zip` for ``data``.

    Returns:
        Exactly ``entry.size`` bytes.

    Raises:
        PackageError: ``PKG_CORRUPT`` (bad deflate stream or a size other than declared),
            ``PKG_CRC_MISMATCH``.
    """
    raw = data[entry.data_offset : entry.data_offset + entry.compressed_size]
    if entry.method == METHOD_STORED:
        out = bytes(raw)
    else:
        inflater = zlib.decompressobj(-zlib.MAX_WBITS)
        try:
            # At most size + 1 bytes: one byte more than declared proves a lie, and a
            # bomb never expands past the bound in memory.
            out = inflater.decompress(raw, entry.size + 1)
        except zlib.error as exc:
            raise PackageError(
                "PKG_CORRUPT", f"entry {entry.name!r} has a broken deflate stream: {exc}",
                name=entry.name,
            ) from exc
        if len(out) != entry.size or not inflater.eof or inflater.unused_data:
            raise PackageError(
                "PKG_CORRUPT",
                f"entry {entry.name!r} does not inflate to exactly its declared "
                f"{entry.size} bytes",
                name=entry.name,
            )
    if len(out) != entry.size:
        raise PackageError(
            "PKG_CORRUPT", f"entry {entry.name!r} is not {entry.size} bytes", name=entry.name
        )
    if zlib.crc32(out) != entry.crc32:
        raise PackageError(
            "PKG_CRC_MISMATCH", f"entry {entry.name!r} fails its CRC-32 check", name=entry.name
        )
    return out


# -- internals -------------------------------------------------------------------------------


def _not_zip(message: str) -> PackageError:
    return PackageError("PKG_NOT_ZIP", f"{message}; expected a case package ZIP")


def _parse_eocd(data: bytes, limits: PackageLimits) -> tuple[int, int, int, int]:
    size = len(data)
    if size < _EOCD.size:
        raise _not_zip(f"{size} bytes are too short for a ZIP archive")
    found = -1
    if data[size - _EOCD.size : size - _EOCD.size + 4] == _EOCD_SIG:
        found = size - _EOCD.size
    else:
        start = max(0, size - _EOCD.size - _MAX_COMMENT)
        found = data.rfind(_EOCD_SIG, start, size - _EOCD.size + 4)
    if found < 0:
        raise _not_zip("no End Of Central Directory record found")
    (_sig, disk, cd_disk, disk_entries, total_entries, cd_size, cd_offset,
     comment_len) = _EOCD.unpack_from(data, found)
    if found + _EOCD.size + comment_len != size:
        raise _not_zip("the End Of Central Directory record does not end the file")
    if comment_len:
        raise PackageError(
            "PKG_HIDDEN_DATA",
            f"the archive carries a {comment_len}-byte comment; packages have none "
            "(rebuild with `investigate case build`)",
        )
    if (
        0xFFFF in (disk, cd_disk, disk_entries, total_entries)
        or 0xFFFFFFFF in (cd_size, cd_offset)
        or (found >= _ZIP64_LOCATOR_SIZE
            and data[found - _ZIP64_LOCATOR_SIZE : found - _ZIP64_LOCATOR_SIZE + 4]
            == _ZIP64_LOCATOR_SIG)
    ):
        raise PackageError(
            "PKG_UNSUPPORTED_ZIP", "ZIP64 archives are not supported; packages stay below 4 GiB"
        )
    if disk != 0 or cd_disk != 0 or disk_entries != total_entries:
        raise PackageError("PKG_UNSUPPORTED_ZIP", "multi-disk (split) archives are not supported")
    if total_entries > limits.max_entries:
        raise PackageError(
            "PKG_TOO_MANY_ENTRIES",
            f"the archive declares {total_entries} entries, over the limit of "
            f"{limits.max_entries}; raise package.max_entries or pack fewer files",
            entries=total_entries,
        )
    if cd_offset + cd_size != found:
        if cd_offset + cd_size > found:
            raise _not_zip("the central directory overruns the End Of Central Directory record")
        raise PackageError(
            "PKG_HIDDEN_DATA", "bytes lie between the central directory and its end record"
        )
    return cd_offset, cd_size, total_entries, found


def _parse_central_directory(
    data: bytes, cd_offset: int, cd_size: int, count: int, limits: PackageLimits
) -> list[_Central]:
    out: list[_Central] = []
    pos = cd_offset
    end = cd_offset + cd_size
    total = 0
    for _ in range(count):
        if pos + _CENTRAL.size > end:
            raise _not_zip("the central directory is shorter than its declared entry count")
        (sig, _made_ver, made_sys, _need, flags, method, _time, _date, crc, csize, usize,
         nlen, elen, clen, disk_start, _iattr, eattr, local_offset) = _CENTRAL.unpack_from(
            data, pos)
        if sig != _CENTRAL_SIG:
            raise _not_zip(f"bad central directory record signature at offset {pos}")
        name_end = pos + _CENTRAL.size + nlen
        if name_end + elen + clen > end:
            raise _not_zip("a central directory record overruns the central directory")
        raw_name = data[pos + _CENTRAL.size : name_end]
        pos = name_end + elen + clen
        name = decode_entry_name(raw_name, limits.max_name_bytes,
                                 max_depth=limits.max_path_depth,
                                 max_segment_bytes=limits.max_segment_bytes)
        if elen > MAX_EXTRA_BYTES or clen:
            raise PackageError("PKG_HIDDEN_DATA",
                               f"entry {name!r} carries a {elen}-byte extra field or a "
                               f"{clen}-byte comment; packages carry neither beyond "
                               f"{MAX_EXTRA_BYTES} bytes of standard extras", name=name)
        if 0xFFFFFFFF in (csize, usize, local_offset) or disk_start == 0xFFFF:
            raise PackageError("PKG_UNSUPPORTED_ZIP", f"entry {name!r} uses ZIP64 fields",
                               name=name)
        if disk_start != 0:
            raise PackageError("PKG_UNSUPPORTED_ZIP", "multi-disk archives are not supported")
        mode = eattr >> 16
        kind = stat.S_IFMT(mode)
        if kind == stat.S_IFLNK:
            raise PackageError(
                "PKG_SYMLINK",
                f"entry {name!r} is a symbolic link; packages hold regular files only",
                name=name,
            )
        is_dir = name.endswith("/")
        wrong_kind = kind not in (0, stat.S_IFREG, stat.S_IFDIR)
        if wrong_kind or (kind != 0 and (kind == stat.S_IFDIR) != is_dir):
            raise PackageError(
                "PKG_UNSUPPORTED_ENTRY_TYPE",
                f"entry {name!r} is not a regular file or directory (mode {oct(mode)}, "
                f"system {made_sys})",
                name=name,
            )
        if flags & (_FLAG_ENCRYPTED | _FLAG_STRONG_ENCRYPTION | _FLAG_MASKED_HEADERS):
            raise PackageError(
                "PKG_ENCRYPTED", f"entry {name!r} is encrypted; packages are never encrypted",
                name=name,
            )
        if method not in (METHOD_STORED, METHOD_DEFLATE):
            raise PackageError(
                "PKG_UNSUPPORTED_COMPRESSION",
                f"entry {name!r} uses compression method {method}; only stored (0) and "
                "deflate (8) are accepted",
                name=name, method=method,
            )
        if is_dir and (usize or csize):
            raise PackageError(
                "PKG_UNSUPPORTED_ENTRY_TYPE", f"directory entry {name!r} carries data",
                name=name,
            )
        if method == METHOD_STORED and csize != usize:
            raise PackageError(
                "PKG_CORRUPT", f"stored entry {name!r} declares different sizes", name=name
            )
        if usize > limits.max_entry_bytes:
            raise PackageError(
                "PKG_ENTRY_TOO_LARGE",
                f"entry {name!r} declares {usize} bytes, over the limit of "
                f"{limits.max_entry_bytes}; raise package.max_entry_bytes",
                name=name, size_bytes=usize,
            )
        total += usize
        if total > limits.max_total_bytes:
            raise PackageError(
                "PKG_TOO_LARGE",
                f"entries declare more than {limits.max_total_bytes} uncompressed bytes in "
                "total; raise package.max_total_bytes",
            )
        if usize >= RATIO_MIN_BYTES and usize > limits.max_compression_ratio * max(csize, 1):
            raise PackageError(
                "PKG_COMPRESSION_RATIO",
                f"entry {name!r} expands {usize} bytes from {csize} (over "
                f"{limits.max_compression_ratio}:1); a possible zip bomb",
                name=name,
            )
        out.append(_Central(name, is_dir, flags, method, crc, csize, usize, local_offset,
                            raw_name))
    if pos != end:
        raise PackageError(
            "PKG_HIDDEN_DATA",
            "the central directory holds bytes beyond its declared entries",
        )
    return out


def _parse_local_entries(
    data: bytes, centrals: Sequence[_Central], cd_offset: int
) -> list[ZipEntry]:
    """Walk the local entries in offset order: they must tile ``[0, cd_offset)`` exactly."""
    by_offset = sorted(range(len(centrals)), key=lambda i: (centrals[i].local_offset, i))
    found: dict[int, ZipEntry] = {}
    position = 0
    previous = ""
    for index in by_offset:
        c = centrals[index]
        if c.local_offset < position:
            raise PackageError(
                "PKG_OVERLAPPING_ENTRIES",
                f"entries {previous!r} and {c.name!r} share archive bytes",
                name=c.name,
            )
        if c.local_offset > position:
            raise PackageError(
                "PKG_HIDDEN_DATA",
                f"{c.local_offset - position} bytes at offset {position} belong to no entry",
            )
        data_offset, position = _parse_local_header(data, c, cd_offset)
        previous = c.name
        if not c.is_dir:
            found[index] = ZipEntry(c.name, c.method, c.crc32, c.compressed_size, c.size,
                                    data_offset)
    if position != cd_offset:
        raise PackageError(
            "PKG_HIDDEN_DATA",
            f"{cd_offset - position} bytes before the central directory belong to no entry",
        )
    return [found[i] for i in sorted(found)]


def _parse_local_header(data: bytes, c: _Central, cd_offset: int) -> tuple[int, int]:
    """Check one local header against its central record; return (data start, entry end)."""
    off = c.local_offset
    if off + _LOCAL.size > cd_offset:
        raise PackageError(
            "PKG_OVERLAPPING_ENTRIES",
            f"entry {c.name!r} points into or beyond the central directory",
            name=c.name,
        )
    (sig, _need, flags, method, _time, _date, crc, csize, usize, nlen,
     elen) = _LOCAL.unpack_from(data, off)
    if sig != _LOCAL_SIG:
        raise _not_zip(f"entry {c.name!r} has no local header at offset {off}")
    name_end = off + _LOCAL.size + nlen
    if data[off + _LOCAL.size : name_end] != c.raw_name:
        raise PackageError(
            "PKG_LOCAL_HEADER_MISMATCH",
            f"the local header of entry {c.name!r} names another file",
            name=c.name,
        )
    if method != c.method or (flags & 0x0F) != (c.flags & 0x0F):
        raise PackageError(
            "PKG_LOCAL_HEADER_MISMATCH",
            f"the local header of entry {c.name!r} disagrees on method or flags",
            name=c.name,
        )
    if not flags & _FLAG_DESCRIPTOR and (crc, csize, usize) != (
        c.crc32, c.compressed_size, c.size
    ):
        raise PackageError(
            "PKG_LOCAL_HEADER_MISMATCH",
            f"the local header of entry {c.name!r} disagrees on sizes or CRC",
            name=c.name,
        )
    if elen > MAX_EXTRA_BYTES:
        raise PackageError("PKG_HIDDEN_DATA",
                           f"the local header of entry {c.name!r} carries a {elen}-byte "
                           "extra field", name=c.name)
    data_offset = name_end + elen
    end = data_offset + c.compressed_size
    if flags & _FLAG_DESCRIPTOR:
        has_sig = data[end : end + 4] == _DESCRIPTOR_SIG
        dpos = end + (4 if has_sig else 0)
        if dpos + 12 > cd_offset:
            raise PackageError(
                "PKG_OVERLAPPING_ENTRIES",
                f"the data descriptor of entry {c.name!r} reaches into the central directory",
                name=c.name,
            )
        if struct.unpack_from("<III", data, dpos) != (c.crc32, c.compressed_size, c.size):
            raise PackageError(
                "PKG_LOCAL_HEADER_MISMATCH",
                f"the data descriptor of entry {c.name!r} disagrees with the central "
                "directory",
                name=c.name,
            )
        end = dpos + 12
    if end > cd_offset:
        raise PackageError(
            "PKG_OVERLAPPING_ENTRIES",
            f"the data of entry {c.name!r} overlaps the central directory",
            name=c.name,
        )
    return data_offset, end
