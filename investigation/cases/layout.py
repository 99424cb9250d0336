"""Case package layout and entry-name rules, shared by the builder and the reader.

A package is a ZIP with this layout (DESIGN.md "Case packages")::

    manifest.json          canonical JSON, see :func:`investigation.cases.builder.build_package`
    report.md              the bug report, UTF-8
    source/<relpath>       the source snapshot (the directory given to ``case build --source``)
    db/<name>.sqlite       optional SQLite snapshots (must start with the SQLite header)
    logs/<relpath>         optional logs

Entry names are POSIX paths. A name is accepted only when its raw bytes are valid UTF-8
and it is relative, has no backslash, no NUL or control character, no bidirectional,
zero-width or other invisible format character (:mod:`investigation.text_safety`), no
empty, ``.`` or ``..`` segment, fits ``PackageLimits.max_name_bytes``, has at most
``PackageLimits.max_path_depth`` segments and no segment over
``PackageLimits.max_segment_bytes``. Two names conflict when they
are equal after Unicode NFC normalisation and case folding (they would collide on a
case-insensitive or normalising file system), or when one is a file and the other
treats it as a directory.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from itertools import pairwise
from typing import Any

from investigation.config import PackageLimits
from investigation.errors import PackageError
from investigation.jsonio import parse_json_int
from investigation.text_safety import escape_text, first_unsafe

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


def decode_entry_name(raw: bytes, max_name_bytes: int, *, max_depth: int | None = None,
                      max_segment_bytes: int | None = None) -> str:
    """Decode and validate one raw ZIP entry name.

    A trailing ``/`` (a directory entry) is allowed and kept.

    Args:
        raw: the name bytes exactly as stored in the central directory.
        max_name_bytes: upper bound of ``len(raw)`` in bytes.
        max_depth: upper bound of the name's ``/``-separated segments (None: no bound).
        max_segment_bytes: upper bound of one segment's UTF-8 bytes (None: no bound).

    Returns:
        The decoded name (``str``), unchanged.

    Raises:
        PackageError: ``PKG_NAME_TOO_LONG`` (over ``max_name_bytes``, or a segment over
            ``max_segment_bytes``), ``PKG_PATH_TOO_DEEP`` (more segments than
            ``max_depth``), ``PKG_BAD_NAME`` (empty, not UTF-8, NUL/control, bidirectional
            or invisible format character, backslash, empty or ``.`` segment),
            ``PKG_ABSOLUTE_PATH`` (leading ``/`` or a drive letter),
            ``PKG_PATH_TRAVERSAL`` (a ``..`` segment).
    """
    shown = escape_text(raw[:200].decode("utf-8", "backslashreplace"))
    if not raw:
        raise PackageError("PKG_BAD_NAME", "a ZIP entry has an empty name; rebuild the package")
    if len(raw) > max_name_bytes:
        raise PackageError(
            "PKG_NAME_TOO_LONG",
            f"entry name '{shown}' is {len(raw)} bytes, over the limit of {max_name_bytes}; "
            "shorten the path or raise package.max_name_bytes",
            name=shown,
        )
    try:
        name = raw.decode("utf-8", "strict")
    except UnicodeDecodeError as exc:
        raise PackageError(
            "PKG_BAD_NAME", f"entry name '{shown}' is not valid UTF-8", name=shown
        ) from exc
    return check_relative_path(name, max_depth=max_depth, max_segment_bytes=max_segment_bytes)


def check_relative_path(name: str, *, max_depth: int | None = None,
                        max_segment_bytes: int | None = None) -> str:
    """Validate a decoded package path (see the module docstring for the rules).

    Args:
        name: a POSIX path; one trailing ``/`` marks a directory.
        max_depth: most ``/``-separated segments (``source/app/main.py`` has 3); None: no
            bound.
        max_segment_bytes: most UTF-8 bytes of one segment; None: no bound.

    Returns:
        ``name`` unchanged.

    Raises:
        PackageError: ``PKG_BAD_NAME``, ``PKG_ABSOLUTE_PATH``, ``PKG_PATH_TRAVERSAL``,
            ``PKG_PATH_TOO_DEEP`` or ``PKG_NAME_TOO_LONG``.
    """
    if not name:
        raise PackageError("PKG_BAD_NAME", "an entry has an empty name; rebuild the package")
    try:
        name.encode("utf-8", "strict")
    except UnicodeEncodeError as exc:
        raise PackageError(
            "PKG_BAD_NAME", f"path '{_shown(name)}' is not valid UTF-8; rename the file",
            name=_shown(name),
        ) from exc
    unsafe = first_unsafe(name)
    if unsafe is not None:
        kind = "a NUL or control character" if ord(unsafe) < 0xA0 else \
            "an invisible or bidirectional formatting character"
        raise PackageError(
            "PKG_BAD_NAME",
            f"path '{_shown(name)}' contains {kind} (U+{ord(unsafe):04X}); rename the file",
            name=_shown(name),
        )
    if name.startswith("/") or _DRIVE.match(name):
        raise PackageError(
            "PKG_ABSOLUTE_PATH",
            f"path '{_shown(name)}' is absolute; package paths are relative", name=_shown(name),
        )
    if "\\" in name:
        raise PackageError(
            "PKG_BAD_NAME",
            f"path '{_shown(name)}' contains a backslash; package paths use '/' only",
            name=_shown(name),
        )
    body = name[:-1] if name.endswith("/") else name
    segments = body.split("/")
    if max_depth is not None and len(segments) > max_depth:
        raise PackageError(
            "PKG_PATH_TOO_DEEP",
            f"path '{_shown(name)}' has {len(segments)} segments, over "
            f"package.max_path_depth={max_depth}; pack a shallower tree or raise the limit",
            name=_shown(name),
        )
    if ".." in segments:
        raise PackageError(
            "PKG_PATH_TRAVERSAL", f"path '{_shown(name)}' has a '..' segment", name=_shown(name)
        )
    if "" in segments or "." in segments:
        raise PackageError(
            "PKG_BAD_NAME", f"path '{_shown(name)}' has an empty or '.' segment",
            name=_shown(name),
        )
    # A segment of n characters has at most 4n UTF-8 bytes: encode only the long ones.
    if max_segment_bytes is not None and 4 * max(map(len, segments)) > max_segment_bytes:
        for segment in segments:
            size = len(segment.encode("utf-8"))
            if size > max_segment_bytes:
                raise PackageError(
                    "PKG_NAME_TOO_LONG",
                    f"path '{_shown(name)}' has a segment of {size} bytes, over "
                    f"package.max_segment_bytes={max_segment_bytes}; rename it or raise "
                    "the limit",
                    name=_shown(name),
                )
    return name


def _shown(name: str) -> str:
    """The start of a refused name as an error message shows it (escaped)."""
    return escape_text(name[:200])


def check_entry_name(name: str, limits: PackageLimits) -> str:
    """Validate a package entry name the builder is about to write, with the reader's
    rules and limits (:func:`decode_entry_name` on its UTF-8 bytes).

    Raises:
        PackageError: the codes of :func:`decode_entry_name`.
    """
    try:
        raw = name.encode("utf-8", "strict")
    except UnicodeEncodeError:
        return check_relative_path(name)  # raises PKG_BAD_NAME (not UTF-8)
    return decode_entry_name(raw, limits.max_name_bytes, max_depth=limits.max_path_depth,
                             max_segment_bytes=limits.max_segment_bytes)


def name_key(name: str) -> str:
    """The collision key of a path: NFC-normalised and case-folded, without a trailing ``/``."""
    return unicodedata.normalize("NFC", name.rstrip("/")).casefold()


def check_no_conflicts(files: list[str], directories: list[str] | None = None) -> None:
    """Refuse colliding paths, in time ``O(n log n)`` and memory linear in the names' size.

    Args:
        files: file paths (no trailing ``/``).
        directories: explicit directory paths (trailing ``/`` optional).

    Raises:
        PackageError: ``PKG_DUPLICATE_ENTRY`` when two names share a :func:`name_key`, or a
            file's key equals a directory (explicit or implied parent) of another path.

    How: no prefix of any name is ever built. The keys are sorted with ``/`` mapped to
    NUL, which sorts below every character a valid name holds, so every path lying under
    a file ``K`` sorts directly after ``K``: comparing each file with its successor finds
    every file that another path uses as a directory.
    """
    seen: dict[str, str] = {}
    for name in files:
        key = name_key(name)
        if key in seen:
            raise PackageError(
                "PKG_DUPLICATE_ENTRY",
                f"entries {seen[key][:200]!r} and {name[:200]!r} collide (equal after "
                "Unicode NFC normalisation and case folding); rename one of them",
                name=name[:200],
            )
        seen[key] = name
    dirs: dict[str, str] = {}
    for name in directories or []:
        dirs.setdefault(name_key(name), name)
    for key, name in seen.items():
        if key in dirs:
            raise _used_as_directory(name, dirs[key])
    ordered = sorted([(key.replace("/", "\0"), name, True) for key, name in seen.items()]
                     + [(key.replace("/", "\0"), name, False) for key, name in dirs.items()])
    for (key, name, is_file), (after, other, _) in pairwise(ordered):
        if is_file and after.startswith(key + "\0"):
            raise _used_as_directory(name, other)


def _used_as_directory(name: str, other: str) -> PackageError:
    return PackageError(
        "PKG_DUPLICATE_ENTRY",
        f"entry {name[:200]!r} is a file but {other[:200]!r} uses it as a directory",
        name=name[:200],
    )


def strict_json_loads(text: str) -> Any:
    """``json.loads`` that refuses duplicate object keys and NaN/Infinity, so every
    accepted document has exactly one canonical form.

    Raises:
        ValueError: duplicate keys, non-finite numbers or invalid JSON.
        RecursionError: nesting too deep for the parser.
    """
    return json.loads(text, object_pairs_hook=_unique_object, parse_constant=_reject_constant,
                      parse_int=parse_json_int, parse_float=_finite_float)


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _reject_constant(token: str) -> Any:
    raise ValueError(f"non-finite number {token}")


def _finite_float(token: str) -> float:
    """A JSON number with a fraction or exponent, refused where no float holds it
    (``1e999`` parsed as infinity, which canonical JSON cannot write: a hostile trial's
    manifest got CONFIG_INVALID)."""
    value = float(token)
    if not math.isfinite(value):
        raise ValueError(f"number {token[:40]} is out of range")
    return value
