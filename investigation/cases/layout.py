"""Case package layout and entry-name rules, shared by the builder and the reader.

A package is a ZIP with this layout (DESIGN.md "Case packages")::

    manifest.json          canonical JSON, see :func:`investigation.cases.builder.build_package`
    report.md              the bug report, UTF-8
    source/<relpath>       the source snapshot (the directory given to ``case build --source``)
    db/<name>.sqlite       optional SQLite snapshots (must start with the SQLite header)
    logs/<relpath>         optional logs

Entry names are POSIX paths. A name is accepted only when its raw bytes are valid UTF-8
and it is relative, has no backslash, no NUL or control character, no empty, ``.`` or
``..`` segment, and fits ``PackageLimits.max_name_bytes``. Two names conflict when they
are equal after Unicode NFC normalisation and case folding (they would collide on a
case-insensitive or normalising file system), or when one is a file and the other
treats it as a directory.
"""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Any

from investigation.errors import PackageError

#: Name of the manifest entry.
MANIFEST_NAME = "manifest.json"
#: Name of the report entry written by the builder.
REPORT_NAME = "report.md"
#: Entry-name prefixes of the three trees.
SOURCE_ROOT = "source/"
DB_ROOT = "db/"
LOGS_ROOT = "logs/"
#: File suffix of packed databases.
DB_SUFFIX = ".sqlite"
#: The first 16 bytes of every SQLite 3 database file.
SQLITE_HEADER = b"SQLite format 3\x00"
#: The fixed ZIP timestamp of every entry the builder writes (the earliest DOS date).
FIXED_DATE_TIME = (1980, 1, 1, 0, 0, 0)
#: Version-control metadata that is never packed (directories or files of this name).
VCS_NAMES = frozenset({".git", ".hg", ".svn", ".bzr", "_darcs", "CVS"})

_DRIVE = re.compile(r"^[A-Za-z]:")


def decode_entry_name(raw: bytes, max_name_bytes: int) -> str:
    """Decode and validate one raw ZIP entry name.

    A trailing ``/`` (a directory entry) is allowed and kept.

    Args:
        raw: the name bytes exactly as stored in the central directory.
        max_name_bytes: upper bound of ``len(raw)`` in bytes.

    Returns:
        The decoded name (``str``), unchanged.

    Raises:
        PackageError: ``PKG_BAD_NAME`` (too long, empty, not UTF-8, NUL/control
            character, backslash, empty or ``.`` segment), ``PKG_ABSOLUTE_PATH``
            (leading ``/`` or a drive letter), ``PKG_PATH_TRAVERSAL`` (a ``..`` segment).
    """
    shown = raw[:200].decode("utf-8", "backslashreplace")
    if not raw:
        raise PackageError("PKG_BAD_NAME", "a ZIP entry has an empty name; rebuild the package")
    if len(raw) > max_name_bytes:
        raise PackageError(
            "PKG_BAD_NAME",
            f"entry name {shown!r} is {len(raw)} bytes, over the limit of {max_name_bytes}; "
            "shorten the path or raise package.max_name_bytes",
            name=shown,
        )
    try:
        name = raw.decode("utf-8", "strict")
    except UnicodeDecodeError as exc:
        raise PackageError(
            "PKG_BAD_NAME", f"entry name {shown!r} is not valid UTF-8", name=shown
        ) from exc
    return check_relative_path(name)


def check_relative_path(name: str) -> str:
    """Validate a decoded package path (see the module docstring for the rules).

    Args:
        name: a POSIX path; one trailing ``/`` marks a directory.

    Returns:
        ``name`` unchanged.

    Raises:
        PackageError: ``PKG_BAD_NAME``, ``PKG_ABSOLUTE_PATH`` or ``PKG_PATH_TRAVERSAL``.
    """
    shown = name[:200]
    if not name:
        raise PackageError("PKG_BAD_NAME", "an entry has an empty name; rebuild the package")
    try:
        name.encode("utf-8", "strict")
    except UnicodeEncodeError as exc:
        raise PackageError(
            "PKG_BAD_NAME", f"path {shown!r} is not valid UTF-8; rename the file", name=shown
        ) from exc
    if any(ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0 for ch in name):
        raise PackageError(
            "PKG_BAD_NAME",
            f"path {shown!r} contains a NUL or control character; rename the file",
            name=shown,
        )
    if name.startswith("/") or _DRIVE.match(name):
        raise PackageError(
            "PKG_ABSOLUTE_PATH", f"path {shown!r} is absolute; package paths are relative",
            name=shown,
        )
    if "\\" in name:
        raise PackageError(
            "PKG_BAD_NAME",
            f"path {shown!r} contains a backslash; package paths use '/' only",
            name=shown,
        )
    body = name[:-1] if name.endswith("/") else name
    for segment in body.split("/"):
        if segment == "..":
            raise PackageError(
                "PKG_PATH_TRAVERSAL", f"path {shown!r} has a '..' segment", name=shown
            )
        if segment in ("", "."):
            raise PackageError(
                "PKG_BAD_NAME", f"path {shown!r} has an empty or '.' segment", name=shown
            )
    return name


def name_key(name: str) -> str:
    """The collision key of a path: NFC-normalised and case-folded, without a trailing ``/``."""
    return unicodedata.normalize("NFC", name.rstrip("/")).casefold()


def check_no_conflicts(files: list[str], directories: list[str] | None = None) -> None:
    """Refuse colliding paths.

    Args:
        files: file paths (no trailing ``/``).
        directories: explicit directory paths (trailing ``/`` optional).

    Raises:
        PackageError: ``PKG_DUPLICATE_ENTRY`` when two names share a :func:`name_key`, or a
            file's key equals a directory (explicit or implied parent) of another path.
    """
    seen: dict[str, str] = {}
    for name in files:
        key = name_key(name)
        if key in seen:
            raise PackageError(
                "PKG_DUPLICATE_ENTRY",
                f"entries {seen[key]!r} and {name!r} collide (equal after Unicode NFC "
                "normalisation and case folding); rename one of them",
                name=name[:200],
            )
        seen[key] = name
    dirs: dict[str, str] = {}
    for name in list(files) + list(directories or []):
        parts = name_key(name).split("/")
        for depth in range(1, len(parts)):
            dirs.setdefault("/".join(parts[:depth]), name)
    for name in directories or []:
        dirs.setdefault(name_key(name), name)
    for key, name in seen.items():
        if key in dirs:
            raise PackageError(
                "PKG_DUPLICATE_ENTRY",
                f"entry {name!r} is a file but {dirs[key]!r} uses it as a directory",
                name=name[:200],
            )


def strict_json_loads(text: str) -> Any:
    """``json.loads`` that refuses duplicate object keys and NaN/Infinity, so every
    accepted document has exactly one canonical form.

    Raises:
        ValueError: duplicate keys, non-finite numbers or invalid JSON.
        RecursionError: nesting too deep for the parser.
    """
    return json.loads(text, object_pairs_hook=_unique_object, parse_constant=_reject_constant)


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _reject_constant(token: str) -> Any:
    raise ValueError(f"non-finite number {token}")
