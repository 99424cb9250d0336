"""Build a deterministic case package ZIP (``investigate case build``).

The same inputs always give byte-identical archives: entries are sorted by name, every
entry has the timestamp 1980-01-01 00:00:00, mode ``0644`` (Unix, regular file), no extra
fields and no comments, and is deflated at level 6 (an entry whose deflated form would
exceed ``PackageLimits.max_compression_ratio`` is stored instead, so the reader accepts
it). Byte identity across machines assumes the same zlib deflate implementation.

Layout (see :mod:`investigation.cases.layout`)::

    manifest.json    canonical JSON: {"format", "report", "source_root", "databases",
                     "logs_root", "files": [{"path", "sha256", "size"}, ...]}
    report.md        the report's bytes (any input file name; must be UTF-8)
    source/<rel>     every file of the source tree
    db/<stem>.sqlite the optional database (``app.db`` is packed as ``db/app.sqlite``), as
                     SQLite reads it: changes still in a ``-wal`` file are applied and a
                     hot ``-journal`` rolled back, in a private copy
    logs/<rel>       the optional logs directory (a single log file is packed as
                     ``logs/<file name>``)

Source selection:

* Version-control metadata is never packed: directories and files named ``.git``, ``.hg``,
  ``.svn``, ``.bzr``, ``_darcs`` or ``CVS`` are skipped at any depth.
* When ``source`` is a git checkout or a folder inside one (it or a parent holds
  ``.git``) and ``git`` is on ``PATH``, the file list is ``git ls-files --cached --others
  --exclude-standard`` run in ``source`` (tracked plus untracked-but-not-ignored files
  under it, so every ``.gitignore`` of the checkout is honoured, a parent's included;
  tracked files deleted from the work tree are left out). If git fails, or lists nothing
  in a folder the checkout ignores as a whole, a plain walk is used; a folder it does not
  ignore whose every file is ignored packs nothing.
* The output file is never packed, even when it lies inside the source tree.

Symbolic links: a link to a regular file inside the same tree (and outside VCS metadata)
is packed as the target's bytes under the link's own path. Every parent directory of a
packed path must be a real directory of the tree, never a link (git keeps listing
``sub/passwd`` after ``sub`` became a link to ``/etc``). Every other link - pointing
outside the tree, dangling, into VCS metadata, or to a directory - is refused with
``PKG_SYMLINK``: replace it with a copy or remove it. Device files, FIFOs and sockets
are refused with ``PKG_UNSUPPORTED_ENTRY_TYPE``.

Secrets: the report, source and log files are scanned with detect-secrets
(:func:`investigation.secrets.scan_files`); a finding refuses the build with
``PKG_SECRETS_FOUND`` listing ``path:line: type`` (never the secret), unless
``allow_secrets`` is given. A database's name and schema (table, column, index, view and
trigger names and their SQL) are scanned too (``scan_database_schema``); its values are
not (they are masked in every tool result instead, like everything else).

Errors (:class:`~investigation.errors.PackageError`): ``PKG_BUILD_INPUT`` (an input is
missing, of the wrong kind or unreadable, or the output cannot be written),
``PKG_SYMLINK``, ``PKG_UNSUPPORTED_ENTRY_TYPE``, ``PKG_DB_NOT_SQLITE``, ``PKG_DB_CORRUPT``,
``PKG_REPORT_INVALID``, ``PKG_SECRETS_FOUND``, the name codes of :func:`~investigation.cases.layout.check_relative_path`
(``PKG_BAD_NAME``, ...), ``PKG_DUPLICATE_ENTRY``, and the limit codes
(``PKG_ENTRY_TOO_LARGE``, ``PKG_TOO_LARGE``, ``PKG_TOO_MANY_ENTRIES``). The finished
archive is validated with :class:`~investigation.cases.reader.PackageReader` before it
is written, so a package the builder writes is one the reader accepts.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import sqlite3
import stat
import subprocess
import tempfile
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from investigation.cases.layout import (
    DB_ROOT,
    DB_SUFFIX,
    FIXED_DATE_TIME,
    LOGS_ROOT,
    MANIFEST_NAME,
    REPORT_NAME,
    SOURCE_ROOT,
    SQLITE_HEADER,
    VCS_NAMES,
    check_entry_name,
    check_no_conflicts,
)
from investigation.cases.reader import PackageReader, check_database_opens
from investigation.cases.zipscan import RATIO_MIN_BYTES
from investigation.config import PackageLimits, canonical_json
from investigation.constants import PACKAGE_FORMAT
from investigation.errors import PackageError
from investigation.files import write_atomic
from investigation.secrets import (
    SecretFinding,
    default_masker,
    format_findings,
    scan_database_schema,
    scan_files,
)
from investigation.text_safety import visible

__all__ = ["PackageInfo", "build_package", "package_bytes"]

#: Deflate level of every entry (zipfile's and zlib's default).
COMPRESS_LEVEL = 6
#: Entry mode written for every file (Unix regular file, rw-r--r--).
ENTRY_MODE = stat.S_IFREG | 0o644
#: Deadline of ``git ls-files`` in seconds.
GIT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class PackageInfo:
    """What :func:`build_package` wrote.

    Attributes:
        package_id: sha256 hex of the ZIP bytes (the package id).
        size_bytes: size of the ZIP in bytes.
        file_count: files in the package other than ``manifest.json`` (report, source,
            databases and logs), i.e. the length of the manifest's ``files`` list.
        path: where the ZIP was written.
        manifest: the manifest that was packed.
        secrets: what the secret scan found (``path:line: type``, never the secret);
            empty unless ``allow_secrets`` was given.
        source_files: files packed under ``source/`` (0: the source tree gave none, so
            every source query of the case finds nothing; ``case build`` warns).
    """

    package_id: str
    size_bytes: int
    file_count: int
    path: Path
    manifest: Mapping[str, Any]
    secrets: tuple[SecretFinding, ...] = ()
    source_files: int = 0


def build_package(
    source: Path,
    report: Path,
    output: Path,
    db: Path | None = None,
    logs: Path | None = None,
    *,
    limits: PackageLimits | None = None,
    allow_secrets: bool = False,
    inside_checkout: bool = True,
) -> PackageInfo:
    """Pack a source tree, a report and optional database and logs into a case package.

    Args:
        source: directory (or git checkout root) to pack under ``source/``.
        report: the bug report file (UTF-8 text), packed as ``report.md``.
        output: path of the ZIP to write; parent directories are created and an existing
            file is replaced atomically.
        db: optional SQLite database file, packed as ``db/<stem>.sqlite``.
        logs: optional logs directory (or a single log file), packed under ``logs/``.
        limits: bounds the result must satisfy (default :class:`PackageLimits`()).
        allow_secrets: pack files in which the secret scan found secrets (they are listed
            in :attr:`PackageInfo.secrets`); without it such a build is refused.
        inside_checkout: list a ``source`` that lies inside a git checkout with git, as
            its root is (module docstring); ``False`` lists it with git only when it is a
            checkout's root (the demo packs an unpacked release whatever folder holds it).

    Returns:
        :class:`PackageInfo` of the written archive.

    Raises:
        PackageError: see the module docstring for the codes.
    """
    limits = limits if limits is not None else PackageLimits()
    output = Path(output)
    _check_output(output, Path(report), db, logs)
    plan = _plan(Path(source), Path(report), db=db, logs=logs, limits=limits,
                 exclude=(output,), inside_checkout=inside_checkout)
    files = _read_plan(plan, Path(report), db)
    findings = scan_files({n: p for n, p in plan.items() if not n.startswith(DB_ROOT)}, files)
    for name in sorted(n for n in files if n.startswith(DB_ROOT)):
        findings += [SecretFinding(name, 0, kind)
                     for *_, kind in default_masker().spans(name)]
        findings += scan_database_schema(name, files[name])
    if findings and not allow_secrets:
        raise PackageError(
            "PKG_SECRETS_FOUND",
            f"{len(findings)} secret(s) found in what would be packed: "
            f"{format_findings(findings)}{_where_given(findings, plan)}. "
            f"{_secret_advice(findings)}, or pass --allow-secrets to pack them anyway (tool "
            "results still mask them before a model sees them)",
            findings=[str(f) for f in findings[:100]],
        )
    data, manifest = package_bytes(files, databases=[n[len(DB_ROOT):] for n in files
                                                     if n.startswith(DB_ROOT)],
                                   has_logs=logs is not None, limits=limits)
    PackageReader(limits, entry_cache_bytes=0).validate(data)
    _write_atomic(output, data)
    return PackageInfo(
        package_id=hashlib.sha256(data).hexdigest(),
        size_bytes=len(data),
        file_count=len(files),
        path=output,
        manifest=manifest,
        secrets=tuple(findings),
        source_files=sum(1 for name in files if name.startswith(SOURCE_ROOT)),
    )


def _where_given(findings: list[SecretFinding], plan: Mapping[str, Path]) -> str:
    """Where the logs, report and database named in ``findings`` are on disk (their entry
    names are the package's: a new user's `--logs logs2` was reported as `logs/app.log`).
    Only for secrets inside a file: a file's own name may be the secret."""
    given = sorted({f.path: str(plan[f.path]) for f in findings
                    if not f.path.startswith(SOURCE_ROOT) and f.line > 0
                    and f.path in plan}.items())
    if not given:
        return ""
    shown = ", ".join(f"{name} is {default_masker().mask(path)[0]}" for name, path in given[:5])
    return f" ({shown})"


def _secret_advice(findings: list[SecretFinding]) -> str:
    """What to do about ``findings``: a source file can be left out with .gitignore in a
    git checkout; a given log, report or database must be edited, or left out of
    ``--logs``."""
    in_source = any(f.path.startswith(SOURCE_ROOT) for f in findings)
    given = any(not f.path.startswith(SOURCE_ROOT) for f in findings)
    advice = []
    if in_source:
        advice.append("remove the secrets from the source files, or leave those files out "
                      "(in a git checkout, with .gitignore)")
    if given:
        advice.append("remove or redact them in the given log, report or database files "
                      "(.gitignore does not apply to those), or leave that log out of "
                      "--logs")
    text = "; ".join(advice)
    return text[:1].upper() + text[1:]


def collect_files(
    source: Path,
    report: Path,
    db: Path | None = None,
    logs: Path | None = None,
    *,
    limits: PackageLimits | None = None,
    exclude: tuple[Path, ...] = (),
) -> dict[str, bytes]:
    """Read every input into a mapping of package entry name -> bytes (no manifest).

    Args:
        source, report, db, logs: as in :func:`build_package`.
        limits: entry count and size bounds, checked before files are read.
        exclude: files never to pack (e.g. the output ZIP).

    Returns:
        Entry name -> exact bytes.

    Raises:
        PackageError: see the module docstring.
    """
    limits = limits if limits is not None else PackageLimits()
    return _read_plan(_plan(source, report, db=db, logs=logs, limits=limits, exclude=exclude),
                      report, db)


def _check_output(output: Path, report: Path, db: Path | None, logs: Path | None) -> None:
    """Refuse an output that is an input file: a hostile trial's ``-o`` named the report,
    which the ZIP replaced (its only copy). An output inside the source or logs tree is
    left out of what is packed, as before.

    Raises:
        PackageError: ``PKG_BUILD_INPUT``.
    """
    target = _resolve(output)
    for what, given in (("the report", report), ("the database", db), ("the logs", logs)):
        if given is not None and _resolve(Path(given)) == target:
            raise PackageError("PKG_BUILD_INPUT", f"the output {output} is {what} given: "
                               "writing it would replace that file; name another output",
                               path=str(output))


def _plan(source: Path, report: Path, db: Path | None, logs: Path | None,
          limits: PackageLimits, exclude: tuple[Path, ...],
          inside_checkout: bool = True) -> dict[str, Path]:
    """Entry name -> file to read, names and limits checked (nothing read yet)."""
    skip = {_resolve(p) for p in exclude}
    if not source.is_dir():
        raise PackageError("PKG_BUILD_INPUT", f"source {source} is not a directory",
                           path=str(source))
    plan: dict[str, Path] = {}
    if not report.is_file():
        raise PackageError("PKG_BUILD_INPUT", f"report {report} is not a file", path=str(report))
    plan[REPORT_NAME] = report
    for rel, path in _tree_files(source, skip, inside_checkout):
        plan[SOURCE_ROOT + rel] = path
    if db is not None:
        db = Path(db)
        if not db.is_file():
            raise PackageError("PKG_BUILD_INPUT", f"database {db} is not a file", path=str(db))
        plan[DB_ROOT + db.stem + DB_SUFFIX] = db
    if logs is not None:
        logs = Path(logs)
        if logs.is_dir():
            for rel, path in _tree_files(logs, skip):
                plan[LOGS_ROOT + rel] = path
        elif logs.is_file():
            plan[LOGS_ROOT + logs.name] = logs
        else:
            raise PackageError("PKG_BUILD_INPUT", f"logs {logs} is neither a file nor a "
                               "directory", path=str(logs))
    for name in plan:
        check_entry_name(name, limits)
    check_no_conflicts([*plan, MANIFEST_NAME])
    _check_limits(plan, limits)
    return plan


def _read_plan(plan: Mapping[str, Path], report: Path, db: Path | None) -> dict[str, bytes]:
    files = {name: _read(path) for name, path in plan.items()}
    try:
        text = files[REPORT_NAME].decode("utf-8", "strict")
    except UnicodeDecodeError as exc:
        raise PackageError("PKG_REPORT_INVALID", f"report {report} is not UTF-8 text",
                           path=str(report)) from exc
    if not visible(text):
        raise PackageError("PKG_REPORT_INVALID",
                           f"report {report} is empty; write the bug report to investigate",
                           path=str(report))
    for name, content in files.items():
        if not name.startswith(DB_ROOT):
            continue
        if not content.startswith(SQLITE_HEADER):
            raise PackageError(
                "PKG_DB_NOT_SQLITE",
                f"database {db} does not start with the SQLite 3 header; pass an SQLite "
                "database file",
                path=str(db),
            )
        files[name] = _database_bytes(plan[name], content)
        check_database_opens(name[len(DB_ROOT):], files[name], str(plan[name]))
    return files


#: Files beside a SQLite database that hold committed (``-wal``) or half-written
#: (``-journal``) changes its main file lacks.
_DB_SIDECARS = ("-wal", "-journal")


def _database_bytes(db: Path, content: bytes) -> bytes:
    """The database as SQLite reads it: ``content`` (the main file's bytes) unless a
    non-empty ``-wal`` or ``-journal`` file lies beside it.

    A database in WAL mode keeps committed transactions in its ``-wal`` file until a
    checkpoint; its main file alone lacks them (a snapshot of a running application's
    database packed stale, with no error). A hot ``-journal`` means an interrupted
    transaction SQLite rolls back on the next open. Either way the main file and its
    sidecars are copied to a private directory, SQLite opens the copy and switches it to
    ``journal_mode=DELETE`` (applying the log, or rolling the journal back), and the
    packed bytes are that standalone file; the user's files are never written.

    Raises:
        PackageError: ``PKG_BUILD_INPUT`` when SQLite cannot apply the sidecar (copy the
            database with ``sqlite3 DB '.backup copy.sqlite'`` and pack the copy).
    """
    sidecars = [(suffix, Path(f"{db}{suffix}")) for suffix in _DB_SIDECARS]
    present = [(suffix, path) for suffix, path in sidecars
               if path.is_file() and path.stat().st_size > 0]
    if not present:
        return content
    with tempfile.TemporaryDirectory(prefix="investigate-db-") as tmp:
        copy = Path(tmp) / "db.sqlite"
        copy.write_bytes(content)
        for suffix, path in present:
            Path(f"{copy}{suffix}").write_bytes(_read(path))
        conn = None
        try:
            conn = sqlite3.connect(copy, isolation_level=None)
            conn.execute("PRAGMA journal_mode=DELETE").fetchall()
            conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
        except sqlite3.Error as exc:
            names = " and ".join(f"{db}{suffix}" for suffix, _ in present)
            raise PackageError(
                "PKG_BUILD_INPUT",
                f"database {db} has changes in {names} that SQLite cannot apply ({exc}); "
                f"pack a copy taken with `sqlite3 {db} '.backup copy.sqlite'`",
                path=str(db)) from exc
        finally:
            if conn is not None:
                conn.close()
        return copy.read_bytes()


def package_bytes(
    files: Mapping[str, bytes],
    databases: list[str],
    has_logs: bool,
    limits: PackageLimits | None = None,
) -> tuple[bytes, dict[str, Any]]:
    """Write the deterministic ZIP for already collected files.

    Args:
        files: entry name -> bytes, without ``manifest.json``; must include ``report.md``.
        databases: database names (file names under ``db/``).
        has_logs: whether the manifest's ``logs_root`` is ``"logs/"`` (else null).
        limits: decides which entries are stored rather than deflated (ratio bound).

    Returns:
        ``(zip_bytes, manifest)``.
    """
    limits = limits if limits is not None else PackageLimits()
    manifest: dict[str, Any] = {
        "format": PACKAGE_FORMAT,
        "report": REPORT_NAME,
        "source_root": SOURCE_ROOT,
        "databases": sorted(databases),
        "logs_root": LOGS_ROOT if has_logs else None,
        "files": [
            {"path": name, "sha256": hashlib.sha256(content).hexdigest(), "size": len(content)}
            for name, content in sorted(files.items())
        ],
    }
    entries = dict(files)
    entries[MANIFEST_NAME] = canonical_json(manifest)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", allowZip64=False) as archive:
        for name in sorted(entries):
            content = entries[name]
            info = zipfile.ZipInfo(name, FIXED_DATE_TIME)
            info.create_system = 3  # Unix, so external_attr carries the mode
            info.external_attr = ENTRY_MODE << 16
            method = _method_for(content, limits)
            info.compress_type = method
            archive.writestr(info, content, compress_type=method, compresslevel=COMPRESS_LEVEL)
    return buffer.getvalue(), manifest


# -- internals -------------------------------------------------------------------------------


def _method_for(content: bytes, limits: PackageLimits) -> int:
    if len(content) < RATIO_MIN_BYTES:
        return zipfile.ZIP_DEFLATED
    packer = zlib.compressobj(COMPRESS_LEVEL, zlib.DEFLATED, -zlib.MAX_WBITS)
    compressed = len(packer.compress(content)) + len(packer.flush())
    if len(content) > limits.max_compression_ratio * max(compressed, 1):
        return zipfile.ZIP_STORED
    return zipfile.ZIP_DEFLATED


def _resolve(path: Path) -> Path:
    try:
        return Path(path).resolve()
    except OSError:  # pragma: no cover - resolve(strict=False) rarely fails
        return Path(os.path.abspath(path))


def _tree_files(root: Path, skip: set[Path],
                inside_checkout: bool = False) -> list[tuple[str, Path]]:
    """Files of a tree as ``(posix relpath, path to read)``, sorted, VCS metadata skipped;
    listed by git when ``root`` is a checkout's root or, with ``inside_checkout``, a
    folder inside one. Logs are listed so only at a checkout's root: a log folder inside
    a project is usually ignored by it (``*.log``) and is packed because it was given."""
    real_root = root.resolve()
    # A folder inside a checkout too: `--source ~/proj/src` packed the `*.pyc` files that
    # ~/proj/.gitignore ignores (a new user's trial; `--source ~/proj` left them out).
    in_checkout = any((d / ".git").exists() for d in (
        (real_root, *real_root.parents) if inside_checkout else (real_root,)))
    listed = _git_files(real_root) if in_checkout else None
    if listed == [] and not _ignored_whole(real_root):
        # Git lists nothing in a folder it does not ignore: every file in it is ignored
        # (a trial's conf/ held only secret.env and trace.log, both in .gitignore, and
        # the walk below packed them). Nothing is packed from it.
        return []
    found: dict[str, Path] = {}
    if not listed:
        _walk(real_root, real_root, "", skip, found)
    else:
        for rel in listed:
            if any(part in VCS_NAMES for part in rel.split("/")):
                continue
            path = real_root / rel
            _check_parents(real_root, rel)
            if not os.path.lexists(path):
                continue  # tracked but deleted from the work tree
            if path.is_dir() and not path.is_symlink():  # a submodule (gitlink)
                _walk(real_root, path, rel + "/", skip, found)
            else:
                _add_file(real_root, path, rel, skip, found)
    return sorted(found.items())


def _git_files(root: Path) -> list[str] | None:
    git = shutil.which("git")
    if git is None:
        return None
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    try:
        done = subprocess.run(
            [git, "-C", str(root), "ls-files", "-z", "--cached", "--others",
             "--exclude-standard"],
            capture_output=True, env=env, timeout=GIT_TIMEOUT_S, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    names = {os.fsdecode(raw) for raw in done.stdout.split(b"\0") if raw}
    return sorted(names)


def _ignored_whole(folder: Path) -> bool:
    """Whether the checkout holding ``folder`` ignores the folder itself (``git
    check-ignore``); ``False`` when git cannot tell, so that only a folder git names as
    ignored is walked in spite of its checkout (decision 169)."""
    git = shutil.which("git")
    if git is None:
        return False
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    try:
        done = subprocess.run([git, "-C", str(folder), "check-ignore", "-q", "."],
                              capture_output=True, env=env, timeout=GIT_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _walk(root: Path, top: Path, prefix: str, skip: set[Path], found: dict[str, Path]) -> None:
    def fail(exc: OSError) -> None:
        raise PackageError("PKG_BUILD_INPUT", f"cannot list {exc.filename}: {exc.strerror}",
                           path=str(exc.filename)) from exc

    for dirpath, dirnames, filenames in os.walk(top, onerror=fail, followlinks=False):
        here = Path(dirpath)
        rel_dir = here.relative_to(top).as_posix()
        base = prefix if rel_dir == "." else f"{prefix}{rel_dir}/"
        kept = []
        for name in sorted(dirnames):
            if name in VCS_NAMES:
                continue
            if (here / name).is_symlink():
                _add_file(root, here / name, base + name, skip, found)  # refuses it
            else:
                kept.append(name)
        dirnames[:] = kept
        for name in sorted(filenames):
            if name in VCS_NAMES:
                continue
            _add_file(root, here / name, base + name, skip, found)


def _add_file(root: Path, path: Path, rel: str, skip: set[Path], found: dict[str, Path]) -> None:
    try:
        info = path.lstat()
    except OSError as exc:
        raise PackageError("PKG_BUILD_INPUT", f"cannot stat {path}: {exc.strerror}",
                           path=str(path)) from exc
    if stat.S_ISLNK(info.st_mode):
        target = _link_target(root, path, rel)
        if target in skip:
            return
        found[rel] = target
        return
    if path in skip:
        return
    if not stat.S_ISREG(info.st_mode):
        raise PackageError(
            "PKG_UNSUPPORTED_ENTRY_TYPE",
            f"{path} is not a regular file (a device, FIFO or socket); remove it from the tree",
            path=str(path),
        )
    found[rel] = path


def _check_parents(root: Path, rel: str) -> None:
    """Refuse a listed path whose parent directories are not all real directories of the
    tree: git lists what it committed (``sub/passwd``) even after ``sub`` was replaced by
    a link, and opening the path would follow that link (to ``/etc`` or anywhere)."""
    parts = rel.split("/")[:-1]
    current = root
    for depth, part in enumerate(parts, start=1):
        current = current / part
        try:
            info = current.lstat()
        except FileNotFoundError:
            return  # tracked but deleted from the work tree: nothing is read
        except OSError as exc:
            raise PackageError("PKG_BUILD_INPUT", f"cannot stat {current}: {exc.strerror}",
                               path=str(current)) from exc
        if stat.S_ISLNK(info.st_mode):
            link = "/".join(parts[:depth])
            raise PackageError(
                "PKG_SYMLINK",
                f"{rel!r} lies under the symbolic link {link!r}, which the package would "
                "follow; every component of a packed path must be a directory of the tree. "
                f"Replace {link!r} with a real directory, or remove the tracked files under "
                "it (git rm --cached)",
                path=rel,
            )
        if not stat.S_ISDIR(info.st_mode):
            return  # a file where git expects a directory: the path does not exist


def _link_target(root: Path, path: Path, rel: str) -> Path:
    target = path.resolve()
    inside = target == root or root in target.parents
    rel_target = target.relative_to(root).parts if inside else ()
    if not inside:
        reason = "points outside the packed tree"
    elif any(part in VCS_NAMES for part in rel_target):
        reason = "points into version-control metadata"
    elif not target.exists():
        reason = "is dangling"
    elif not target.is_file():
        reason = "points to a directory or special file"
    else:
        return target
    raise PackageError(
        "PKG_SYMLINK",
        f"symbolic link {rel!r} {reason}; replace it with a copy of the file or remove it",
        path=rel,
    )


def _check_limits(plan: Mapping[str, Path], limits: PackageLimits) -> None:
    if len(plan) + 1 > limits.max_entries:
        raise PackageError(
            "PKG_TOO_MANY_ENTRIES",
            f"{len(plan) + 1} entries exceed package.max_entries={limits.max_entries}; "
            "pack fewer files (use .gitignore) or raise the limit",
        )
    total = 0
    for name, path in plan.items():
        size = path.stat().st_size
        if size > limits.max_entry_bytes:
            raise PackageError(
                "PKG_ENTRY_TOO_LARGE",
                f"{name} is {size} bytes, over package.max_entry_bytes="
                f"{limits.max_entry_bytes}; leave it out or raise the limit",
                name=name,
            )
        total += size
    if total > limits.max_total_bytes:
        raise PackageError(
            "PKG_TOO_LARGE",
            f"inputs total {total} bytes, over package.max_total_bytes="
            f"{limits.max_total_bytes}",
        )


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise PackageError("PKG_BUILD_INPUT", f"cannot read {path}: {exc.strerror}",
                           path=str(path)) from exc


def _write_atomic(output: Path, data: bytes) -> None:
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(output, data)
    except OSError as exc:
        raise PackageError("PKG_BUILD_INPUT", f"cannot write {output}: {exc.strerror}",
                           path=str(output)) from exc
