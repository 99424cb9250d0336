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
import stat
import tempfile
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
    written. The new file has the old file's permission bits, or ``0o666`` less the
    umask. A failure leaves no temporary file behind.

    Raises:
        OSError: ``EINVAL`` "not a regular file", ``EISDIR`` for a directory, or what
            creating, writing or renaming raised; ``filename`` is ``path``.
    """
    target = Path(path)
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    else:
        if stat.S_ISDIR(st.st_mode):
            raise OSError(errno.EISDIR, "is a directory", str(target))
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            raise OSError(errno.EINVAL, "not a regular file", str(target))
        mode = stat.S_IMODE(st.st_mode) if stat.S_ISREG(st.st_mode) else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                               dir=target.parent if str(target.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename in (None, tmp):
            exc.filename, exc.filename2 = str(target), None
        raise


def _umask() -> int:
    """This process's umask (read by setting it and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
