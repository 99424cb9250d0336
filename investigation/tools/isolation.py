"""Run one untrusted statement in a forked child under hard limits.

SQLite checks its progress handler only between virtual-machine instructions, and never
while it compiles a statement; a short text can make compilation take exponential time and
memory (nested ``NOT MATERIALIZED`` CTEs or views). Such work cannot be interrupted from
inside the process. :func:`run_isolated` therefore runs it in a forked child:

* the child inherits the opened database copy (copy-on-write) and runs ``fn``;
* ``RLIMIT_CPU`` and an address-space budget (``RLIMIT_AS``, the child's current size plus
  ``memory_bytes``) bound it; the parent kills it at ``timeout_s`` of wall time;
* the result comes back pickled through a pipe; a :class:`ToolError` keeps its code;
* the child dies with its parent (Linux ``PR_SET_PDEATHSIG``), and a caller stopped from
  outside (a worker's soft time limit) kills it before returning.

The caller holds the database's own lock across the fork. A lock another thread held at
the fork (SQLite's global allocator mutex, for one) stays locked in the child forever, so
the child first runs ``probe`` (a trivial statement) and reports ready; a child that is not
ready within :data:`HANDSHAKE_S` is killed and the fork retried, and after
:data:`FORK_TRIES` such failures the work runs in process (still under SQLite's own
progress-handler deadline), so a result never depends on what other threads were doing.
The child runs only SQLite, pickling and ``os._exit``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import resource
import select
import signal
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from investigation.errors import ToolError

T = TypeVar("T")

#: Largest pickled result accepted from a child (bytes).
MAX_RESULT_BYTES = 64 << 20
#: Seconds a child has to report ready (its probe ran) before it is presumed stuck.
HANDSHAKE_S = 0.5
#: Forks tried before the work runs in process. Retries are only ever needed when other
#: threads of this process use SQLite at fork time; the supported runtimes (a prefork
#: worker child, the CLI) have none, so there the first child is always ready.
FORK_TRIES = 10
_READY = b"R"
#: ``prctl`` option that sends the child a signal when its parent dies (Linux).
_PR_SET_PDEATHSIG = 1

log = logging.getLogger(__name__)


class _NotReady(Exception):
    """The child never reported ready: it inherited a lock held at the fork."""


def _vm_size_bytes() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this child when its parent dies (a worker process killed
    at its hard time limit must not leave a query running); elsewhere nothing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def _child(fn: Callable[[], Any], probe: Callable[[], Any] | None, write_fd: int,
           timeout_s: float, memory_bytes: int, parent: int) -> None:
    try:
        _die_with_parent(parent)
        try:
            if probe is not None:
                probe()
        finally:
            os.write(write_fd, _READY)  # a failing probe still answers: its error follows
        cpu = max(1, int(timeout_s) + 1)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        size = _vm_size_bytes()
        if size is not None:
            limit = size + memory_bytes
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            payload: tuple[str, Any] = ("ok", fn())
        except ToolError as exc:
            payload = ("tool_error", (exc.code, exc.message, exc.details))
        except MemoryError:
            payload = ("tool_error", ("TOOL_RESOURCE_LIMIT",
                                      f"the statement needed more than {memory_bytes >> 20} "
                                      "MiB of memory; narrow it", {}))
        except BaseException as exc:
            payload = ("error", f"{type(exc).__name__}: {exc}")
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(data)
        while view:
            written = os.write(write_fd, view)
            view = view[written:]
    finally:
        os._exit(0)


def run_isolated(fn: Callable[[], T], *, timeout_s: float, memory_bytes: int,
                 what: str, probe: Callable[[], Any] | None = None) -> T:
    """Run ``fn`` in a forked child and return its result.

    Args:
        fn: the work; its result must pickle.
        timeout_s: wall-clock bound in seconds (also the CPU bound, rounded up).
        memory_bytes: address space the child may add to what it inherited.
        what: a short description for errors ("the statement").
        probe: run in the child before it reports ready (exercises the libraries ``fn``
            needs, so a lock inherited from another thread shows up at once).

    Raises:
        ToolError: the child's own ``ToolError``; ``TOOL_SQL_TIMEOUT`` when killed at the
            deadline; ``TOOL_RESOURCE_LIMIT`` when it ran out of memory or CPU or died.
    """
    for _ in range(FORK_TRIES):
        try:
            return _run_once(fn, probe, timeout_s, memory_bytes, what)
        except _NotReady:
            continue
    log.warning("%s: no forked child became ready (locks held by other threads at fork); "
                "running it in process", what)
    return fn()


def _run_once(fn: Callable[[], T], probe: Callable[[], Any] | None, timeout_s: float,
              memory_bytes: int, what: str) -> T:
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork in a threaded process
        pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(read_fd)
        _child(fn, probe, write_fd, timeout_s, memory_bytes, parent)
    os.close(write_fd)
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + timeout_s
    killed = False
    try:
        ready, _, _ = select.select([read_fd], [], [], HANDSHAKE_S)
        first = os.read(read_fd, 1) if ready else b""
        if not first:  # stuck on a lock inherited from another thread: a fresh child
            os.kill(pid, signal.SIGKILL)
            raise _NotReady
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                killed = True
                break
            ready, _, _ = select.select([read_fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(read_fd, 1 << 20)
            if not chunk:
                break
            size += len(chunk)
            if size > MAX_RESULT_BYTES:
                os.kill(pid, signal.SIGKILL)
                raise ToolError("TOOL_RESOURCE_LIMIT", f"{what} produced too large a result")
            chunks.append(chunk)
    except BaseException:
        # Stopped from outside (a worker's soft time limit, an interrupt) or a refusal: the
        # child must not outlive this call.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        raise
    finally:
        os.close(read_fd)
        status = 0
        with contextlib.suppress(ChildProcessError):
            _, status = os.waitpid(pid, 0)
    if killed:
        raise ToolError("TOOL_SQL_TIMEOUT",
                        f"{what} did not finish within {timeout_s:g} s and was stopped; "
                        "narrow it (fewer joins, CTEs or views, a LIMIT)",
                        timeout_s=timeout_s)
    if not chunks:
        signal_no = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        raise ToolError("TOOL_RESOURCE_LIMIT",
                        f"{what} exceeded its CPU or memory bound and was stopped"
                        + (f" (signal {signal_no})" if signal_no else ""))
    kind, value = pickle.loads(b"".join(chunks))
    if kind == "ok":
        return value  # type: ignore[no-any-return]
    if kind == "tool_error":
        code, message, details = value
        raise ToolError(code, message, **details)
    raise ToolError("TOOL_SQL_ERROR", f"{what} failed: {value}")
