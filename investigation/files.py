"""Files an operator names, read boundedly.

A path given on the command line or in a settings file (a policy, a providers file, a
scripted reply file, the feedback key, an interpretation) may name anything: ``/dev/zero``
(read whole, it fills memory until the kernel kills the process), a FIFO (reading it
waits for a writer forever), a directory. :func:`read_bounded` opens without blocking,
takes only a regular file, and reads at most ``limit`` bytes: anything else is an
:class:`OSError` whose ``strerror`` says what is wrong, so each caller's existing
``except OSError`` gives its own stable code (``CONFIG_UNREADABLE``,
``SCRIPT_UNREADABLE``, ``PROVIDER_SCRIPT_UNREADABLE``, ...).
"""

from __future__ import annotations

import errno
import os
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
