"""Files an operator names, read boundedly and written atomically.

A path given on the command line or in a settings file (a policy, a providers file, a
scripted reply file, the feedback key, an interpretation) may name anything: ``/dev/zero``
(read whole, it fills memory until the kernel kills the process), a FIFO (reading it
waits for a writer forever), a directory. :func:`read_bounded` opens without blocking,
takes only a regular file, and reads at most ``limit`` bytes: anything else is an
:class:`OSError` whose ``strerror`` says what is wrong, so each caller's existing
``except OSError`` gives its own stable code (``CONFIG_UNREADABLE``,
``SCRIPT_UNREADABLE``, ``PROVIDER_SCRIPT_UNREADABLE``, ...).

An output path (``report -o``, ``case build -o``) may name as much: :func:`write_atomic`
replaces only a regular file (or a symlink, the link itself), through a temporary file of
its own that no one else can have planted.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

#: A TOML settings file (policy, providers, package limits): far above any real one.
MAX_SETTINGS_FILE_BYTES = 1 << 20
#: A scripted reply file (JSON Lines): a long scripted case holds thousands of replies.
MAX_SCRIPT_FILE_BYTES = 256 << 20


def read_bounded(path: str | Path, limit: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    Raises:
        OSError: the file cannot be opened or read (as ``open`` raises it);
            ``EINVAL`` "not a regular file" (a FIFO, a device, a directory, a socket);
            ``EFBIG`` "larger than LIMIT bytes".
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
        chunks: list[bytes] = []
        size = 0
        while size <= limit:  # a file that grows while it is read is still bounded
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: bytes) -> None:
    """Replace the regular file ``path`` with ``data``, atomically (a reader sees the old
    bytes or the new ones, never part of them).

    The bytes go to a fresh temporary file beside ``path`` (created exclusively, so a
    planted symlink is never followed), then ``os.replace`` puts it in place. An existing
    ``path`` must be a regular file or a symlink (the link itself is replaced): a device
    (``-o /dev/null``), a FIFO, a socket or a directory is refused before anything is
    written. The new file has the old file's permission bits (``rwx`` only, never
    set-id), or ``0o666`` less the umask. A failure leaves no temporary file behind.

    Raises:
        OSError: ``EINVAL`` "not a regular file", ``EISDIR`` for a directory, or what
            creating, writing or renaming raised; ``filename`` is ``path``.
    """
    target = Path(path)
    keep: int | None = None
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISDIR(st.st_mode):
            raise OSError(errno.EISDIR, "is a directory", str(target))
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            raise OSError(errno.EINVAL, "not a regular file", str(target))
        if stat.S_ISREG(st.st_mode):
            keep = stat.S_IMODE(st.st_mode) & 0o777
    tmp: str | None = None
    try:
        fd, tmp = _exclusive_beside(target)
        with os.fdopen(fd, "wb") as fh:
            if keep is not None:
                os.fchmod(fh.fileno(), keep)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename in (None, tmp):
            exc.filename, exc.filename2 = str(target), None
        raise


def _exclusive_beside(target: Path) -> tuple[int, str]:
    """A new file ``.NAME.RANDOM.tmp`` beside ``target``, opened for writing with ``O_EXCL``
    and ``O_NOFOLLOW`` and mode ``0o666`` (the kernel applies the umask)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        name = str(target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(name, flags, 0o666), name
        except FileExistsError:
            continue
        except OSError as exc:  # name the file the caller asked for, not this one
            exc.filename = str(target)
            raise
    raise OSError(errno.EEXIST, "no free temporary name", str(target))
