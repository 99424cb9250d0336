"""Run untrusted SQLite work in a forked child under hard limits.

SQLite checks its progress handler only between virtual-machine instructions, and never
while it compiles a statement; a short text can make compilation take exponential time and
memory (nested ``NOT MATERIALIZED`` CTEs or views). Such work cannot be interrupted from
inside the process, so it runs in a forked child. Two forms share the limits below:

* :class:`IsolatedServer` (decision 94), what ``ReadOnlyDatabase`` uses: one forked
  child per opened database and process, started at its first request and reused by
  later ones. A request names one of a fixed set of the object's methods and
  carries its arguments as plain data (never a pickled callable); the child refuses
  anything else (:class:`RequestRefused`).
* :func:`run_isolated`: one fork per call, for a callable (the form every statement used
  before decision 94; a fork of a 100 MB process costs about 10 ms, about a third of an
  engine step).

The guarantees, both forms:

* the child inherits the opened database copy (copy-on-write) and runs only SQLite work,
  pickling and ``os._exit``;
* the parent kills it at each request's ``timeout_s`` of wall time (``TOOL_SQL_TIMEOUT``);
  a server that was killed or died is never used again, the next request forks a new one;
* ``RLIMIT_CPU`` bounds each request's CPU time (a server's limit is cumulative over its
  life, so its soft limit is set before each request to the CPU it has used plus the
  request's budget) and ``RLIMIT_AS`` its address space (the child's size when it
  started plus ``memory_bytes``; a request with another ``memory_bytes`` gets a new
  server); running out of memory is ``TOOL_RESOURCE_LIMIT`` and retires the server;
* the result comes back pickled through a pipe, at most :data:`MAX_RESULT_BYTES`; a
  :class:`ToolError` keeps its code, message and details; a child that dies during a
  request is ``TOOL_RESOURCE_LIMIT`` with its signal;
* the child dies with its parent (Linux ``PR_SET_PDEATHSIG``), and a caller stopped from
  outside (a worker's soft time limit, an interrupt) kills it before returning.

The caller holds the database's own lock across each request (and so across the fork).
A lock another thread held at the fork (SQLite's global allocator mutex, for one) stays
locked in the child forever, so the child first runs ``probe`` (a trivial statement) and
reports ready; a child that is not ready within :data:`HANDSHAKE_S` is killed and the fork
retried, and after :data:`FORK_TRIES` such failures the work runs in process (still under
SQLite's own progress-handler deadline), so a result never depends on what other threads
were doing.

``PR_SET_PDEATHSIG`` fires when the *thread* that forked dies, not the process. The
engine's tools run on a process's long-lived thread (a prefork child's, the CLI's), but a
server forked by a thread that has since ended is replaced before the next request, and a
request it was serving when it died is run once more on a new server. A process forked
after a server started (a prefork child of a parent that opened a database) never talks to
it: a server belongs to the process id that forked it. A killed server is reaped without
waiting (``waitpid(WNOHANG)`` at the next request, start or stop), so no zombies
accumulate.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import math
import os
import pickle
import resource
import select
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any, NoReturn, TypeVar

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
#: Bytes of the length that precedes each message between a server and its parent.
_HEADER_BYTES = 8
#: ``prctl`` option that sends the child a signal when its parent dies (Linux).
_PR_SET_PDEATHSIG = 1

log = logging.getLogger(__name__)

#: Killed servers not yet reaped (this process's children), and the lock that also keeps
#: two threads from forking at once: a child forked while another thread held a fresh
#: pipe's write end open would keep it open, and its server's death would go unseen.
_children_lock = threading.RLock()
_unreaped: set[int] = set()


def _after_fork_in_child() -> None:
    global _children_lock
    _children_lock = threading.RLock()  # another thread may have held it at the fork
    _unreaped.clear()  # the parent's children, not this process's


os.register_at_fork(after_in_child=_after_fork_in_child)


class RequestRefused(RuntimeError):
    """An isolated server refused a request: the method is not one it serves, or the
    request was not plain data. A programming error of the caller, never the model's."""


class _NotReady(Exception):
    """The child never reported ready: it inherited a lock held at the fork."""


class _Lost(Exception):
    """The server vanished for a reason that is not the request's (the thread that forked
    it ended, or it was gone before the request was sent): worth one new server."""

    def __init__(self, error: ToolError) -> None:
        super().__init__(error.message)
        self.error = error


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


def _limit_memory(memory_bytes: int) -> None:
    size = _vm_size_bytes()
    if size is not None:
        limit = size + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _cpu_budget_s(timeout_s: float) -> int:
    return max(1, int(timeout_s) + 1)


def _outcome(fn: Callable[[], Any], memory_bytes: int) -> tuple[tuple[str, Any], bool]:
    """Run ``fn`` in a child: ``((kind, value), retire)``; ``retire`` when the process
    may be left in a bad state (out of memory, an unexpected exception)."""
    try:
        return ("ok", fn()), False
    except ToolError as exc:
        return ("tool_error", (exc.code, exc.message, exc.details)), False
    except MemoryError:
        return ("tool_error", ("TOOL_RESOURCE_LIMIT",
                               f"the statement needed more than {memory_bytes >> 20} "
                               "MiB of memory; narrow it", {})), True
    except BaseException as exc:
        return ("error", f"{type(exc).__name__}: {exc}"), True


def _decode(kind: str, value: Any, what: str) -> Any:
    if kind == "ok":
        return value
    if kind == "tool_error":
        code, message, details = value
        raise ToolError(code, message, **details)
    if kind == "refused":
        raise RequestRefused(value)
    raise ToolError("TOOL_SQL_ERROR", f"{what} failed: {value}")


def _timed_out(what: str, timeout_s: float) -> ToolError:
    return ToolError("TOOL_SQL_TIMEOUT",
                     f"{what} did not finish within {timeout_s:g} s and was stopped; "
                     "narrow it (fewer joins, CTEs or views, a LIMIT)",
                     timeout_s=timeout_s)


def _died(what: str, status: int) -> ToolError:
    signal_no = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return ToolError("TOOL_RESOURCE_LIMIT",
                     f"{what} exceeded its CPU or memory bound and was stopped"
                     + (f" (signal {signal_no})" if signal_no else ""))


def _too_large(what: str) -> ToolError:
    return ToolError("TOOL_RESOURCE_LIMIT", f"{what} produced too large a result")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _ready(fd: int, timeout_s: float, *, writing: bool = False) -> bool:
    """Whether ``fd`` can be read (or written) within ``timeout_s``; a closed peer counts
    as ready (the read or write then tells). ``poll``, not ``select``: a descriptor
    number past 1023 is fine."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT if writing else select.POLLIN)
    return bool(poller.poll(max(0, math.ceil(timeout_s * 1000))))


def _send(fd: int, data: bytes, deadline: float) -> bool:
    """Write ``data`` to the non-blocking ``fd`` by ``deadline``; ``False`` if it passed."""
    view = memoryview(data)
    while view:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if _ready(fd, left, writing=True):
            with contextlib.suppress(BlockingIOError):
                view = view[os.write(fd, view):]
    return True


def _reap() -> None:
    """Collect killed servers that have exited, without waiting for the others."""
    with _children_lock:
        for pid in list(_unreaped):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid  # reaped elsewhere
            if done:
                _unreaped.discard(pid)


# -- the persistent server ---------------------------------------------------------------


class _RequestUnpickler(pickle.Unpickler):
    """Requests are plain data (names, numbers, text, bytes, tuples, lists): a request
    that names any class or callable is refused before anything of it runs."""

    def find_class(self, module: str, name: str) -> NoReturn:
        raise pickle.UnpicklingError(f"a request may not name {module}.{name}")


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks: list[bytes] = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _answer(target: object, methods: frozenset[str], request: bytes, cpu_hard: int,
            memory_bytes: int) -> tuple[tuple[str, Any], bool]:
    try:
        method, args, cpu_s = _RequestUnpickler(io.BytesIO(request)).load()
    except Exception as exc:
        return ("refused", f"the request is not plain data: {exc}"), False
    if not isinstance(method, str) or method not in methods:
        return ("refused", f"{method!r} is not one of {sorted(methods)}"), False
    if not isinstance(args, tuple) or not isinstance(cpu_s, int):
        return ("refused", "a request is (method, arguments tuple, CPU seconds)"), False
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime) + int(cpu_s)
    if cpu_hard != resource.RLIM_INFINITY:
        soft = min(soft, cpu_hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, cpu_hard))
    return _outcome(lambda: getattr(target, method)(*args), memory_bytes)


def _serve(target: object, methods: frozenset[str], probe: str | None, requests: int,
           replies: int, memory_bytes: int, parent: int) -> NoReturn:  # pragma: no cover
    """The server's whole life (the child side): report ready, then answer requests."""
    try:
        _die_with_parent(parent)
        if probe is not None:
            # A failing probe still answers: the requests then meet the failure themselves.
            with contextlib.suppress(Exception):
                getattr(target, probe)()
        os.write(replies, _READY)
        _limit_memory(memory_bytes)
        _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
        while True:
            header = _read_exact(requests, _HEADER_BYTES)
            request = header and _read_exact(requests, int.from_bytes(header, "big"))
            if not request:
                break  # the parent closed its end
            (kind, value), retire = _answer(target, methods, request, cpu_hard,
                                            memory_bytes)
            try:
                data = pickle.dumps((kind, value, retire), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                retire = True
                data = pickle.dumps(("error", f"the result does not pickle: {exc}", retire))
            _write_all(replies, len(data).to_bytes(_HEADER_BYTES, "big") + data)
            if retire:
                break
    finally:
        os._exit(0)


class IsolatedServer:
    """A forked child that runs named methods of one object under hard limits.

    Args:
        methods: the method names a request may name; the child refuses any other.
        probe: a method the child runs before it reports ready (a trivial statement, so
            a lock inherited from another thread shows up at once).
        what: a short description for errors ("the statement").

    Not itself thread-safe: the caller serialises :meth:`call` and :meth:`stop` (a
    :class:`~investigation.tools.sqlite.ReadOnlyDatabase` holds its lock across each).
    The server holds no reference to the object it serves (the child inherits it at the
    fork), so the object can be collected and stop its server from a finaliser.
    """

    def __init__(self, methods: Iterable[str], *, probe: str | None = None,
                 what: str = "the statement") -> None:
        self._methods = frozenset(methods)
        self._probe = probe
        self._what = what
        self._pid: int | None = None
        self._owner = 0  # the process that forked the server
        self._forker: threading.Thread | None = None  # the thread that forked it
        self._memory_bytes = 0
        self._requests = -1  # write end, to the server
        self._replies = -1  # read end, from the server

    @property
    def pid(self) -> int | None:
        """The process id of this process's running server (``None``: none started yet,
        or the last one was stopped, killed or died)."""
        return self._pid if self._owner == os.getpid() else None

    def call(self, target: object, method: str, args: tuple[Any, ...], *,
             timeout_s: float, memory_bytes: int) -> Any:
        """Run ``target.method(*args)`` in the server and return its result.

        Args:
            target: the object whose methods the server runs; the same object at every
                call (a new server inherits it at the fork).
            method: one of the server's ``methods``.
            args: plain data (text, numbers, bytes, ``None``, tuples and lists of them).
            timeout_s: wall-clock bound in seconds from the request's sending (the CPU
                bound is this rounded up to a whole second, at least one).
            memory_bytes: address space the server may add to what it inherited.

        Raises:
            ToolError: the method's own ``ToolError``; ``TOOL_SQL_TIMEOUT`` when the server
                was killed at the deadline; ``TOOL_RESOURCE_LIMIT`` when it ran out of
                memory or CPU, died, or its result passed :data:`MAX_RESULT_BYTES`;
                ``TOOL_SQL_ERROR`` for any other exception of the method.
            RequestRefused: ``method`` is not one of the server's methods, or ``args``
                is not plain data.
        """
        if _unreaped:
            _reap()
        lost: ToolError | None = None
        for _ in range(2):  # a server lost through no fault of the request: once more
            if not self._usable(memory_bytes):
                self.stop()
                if not self._start(target, memory_bytes):
                    log.warning("%s: no forked child became ready (locks held by other "
                                "threads at fork); running it in process", self._what)
                    if method not in self._methods:
                        raise RequestRefused(f"{method!r} is not one of "
                                             f"{sorted(self._methods)}")
                    return getattr(target, method)(*args)
            try:
                return self._request(method, args, timeout_s)
            except _Lost as exc:
                lost = exc.error
        assert lost is not None
        raise lost

    def stop(self) -> None:
        """Kill this process's server, if any (reaped later, without waiting). A server
        inherited from a parent process is only forgotten: it is the parent's."""
        if self._pid is not None and self._owner != os.getpid():
            self._forget()
        self._drop()
        _reap()

    # -- parent side -------------------------------------------------------------------

    def _usable(self, memory_bytes: int) -> bool:
        if self._pid is None:
            return False
        if self._owner != os.getpid():
            self._forget()  # forked after the server started: the server is the parent's
            return False
        if (self._memory_bytes != memory_bytes or self._forker is None
                or not self._forker.is_alive()):  # pdeathsig fired or is about to
            return False
        try:
            exited, _ = os.waitpid(self._pid, os.WNOHANG)
        except ChildProcessError:
            exited = self._pid  # reaped elsewhere: never signal that pid again
        if exited:
            self._drop(reaped=True)
            return False
        return True

    def _forget(self) -> None:
        # The pipe ends are left open: in a forked process their numbers may already
        # have been closed and reused by whoever forked it; two descriptors are cheap.
        self._pid = None

    def _drop(self, *, reaped: bool = False) -> None:
        """Never use the current server again: kill it (unless already reaped) and close
        this side of its pipes."""
        pid, self._pid = self._pid, None
        if pid is None:
            return
        if not reaped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with _children_lock:
                _unreaped.add(pid)
        for fd in (self._requests, self._replies):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._requests = self._replies = -1

    def _start(self, target: object, memory_bytes: int) -> bool:
        _reap()
        for _ in range(FORK_TRIES):
            try:
                self._fork(target, memory_bytes)
                return True
            except _NotReady:
                continue
        return False

    def _fork(self, target: object, memory_bytes: int) -> None:
        with _children_lock:
            requests_r, requests_w = os.pipe()
            replies_r, replies_w = os.pipe()
            parent = os.getpid()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # fork, threaded process
                pid = os.fork()
            if pid == 0:  # pragma: no cover - runs in the child
                os.close(requests_w)
                os.close(replies_r)
                _serve(target, self._methods, self._probe, requests_r, replies_w,
                       memory_bytes, parent)
            os.close(requests_r)
            os.close(replies_w)
            os.set_blocking(requests_w, False)  # a request is sent within its deadline
        self._pid, self._owner, self._forker = pid, parent, threading.current_thread()
        self._memory_bytes, self._requests, self._replies = memory_bytes, requests_w, replies_r
        try:
            if _ready(replies_r, HANDSHAKE_S) and os.read(replies_r, 1) == _READY:
                return
        except BaseException:
            self._drop()
            raise
        self._drop()  # stuck on a lock inherited from another thread: a fresh child
        raise _NotReady

    def _request(self, method: str, args: tuple[Any, ...], timeout_s: float) -> Any:
        data = pickle.dumps((method, tuple(args), _cpu_budget_s(timeout_s)),
                            protocol=pickle.HIGHEST_PROTOCOL)
        deadline = time.monotonic() + timeout_s
        try:
            reply = self._exchange(len(data).to_bytes(_HEADER_BYTES, "big") + data, deadline)
        except (ToolError, _Lost):
            raise  # the server is already dropped
        except BaseException:
            # Stopped from outside (a worker's soft time limit, an interrupt): the server
            # may have half a request; it must not outlive this call.
            self._drop()
            raise
        if reply is None:
            self._drop()
            raise _timed_out(self._what, timeout_s)
        kind, value, retired = pickle.loads(reply)
        if retired:  # out of memory or an unexpected exception: the server has exited
            self._drop()
        return _decode(kind, value, self._what)

    def _exchange(self, message: bytes, deadline: float) -> bytes | None:
        """Send one request and read its reply; ``None`` at the deadline."""
        try:
            if not _send(self._requests, message, deadline):
                return None
        except BrokenPipeError:  # gone before it read a byte of this request
            raise self._vanished(lost=True) from None
        received = bytearray()
        size: int | None = None
        while size is None or len(received) < _HEADER_BYTES + size:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not _ready(self._replies, left):
                continue
            chunk = os.read(self._replies, 1 << 20)
            if not chunk:
                raise self._vanished(lost=False)
            received += chunk
            if size is None and len(received) >= _HEADER_BYTES:
                size = int.from_bytes(received[:_HEADER_BYTES], "big")
                if size > MAX_RESULT_BYTES:
                    self._drop()
                    raise _too_large(self._what)
        return bytes(received[_HEADER_BYTES:])

    def _vanished(self, *, lost: bool) -> Exception:
        """The server closed its pipe: it is exiting. Its status (the signal) is read at
        once; a server whose forking thread ended is :class:`_Lost`, not the request's
        fault."""
        pid = self._pid
        assert pid is not None
        forker_gone = self._forker is not None and not self._forker.is_alive()
        status = 0
        with contextlib.suppress(ChildProcessError):
            _, status = os.waitpid(pid, 0)  # its descriptors are closed: it is in exit
        self._drop(reaped=True)
        error = _died(self._what, status)
        return _Lost(error) if lost or forker_gone else error


# -- one fork per call -------------------------------------------------------------------


def _child(fn: Callable[[], Any], probe: Callable[[], Any] | None, write_fd: int,
           timeout_s: float, memory_bytes: int, parent: int) -> None:
    try:
        _die_with_parent(parent)
        try:
            if probe is not None:
                probe()
        finally:
            os.write(write_fd, _READY)  # a failing probe still answers
        cpu = _cpu_budget_s(timeout_s)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        _limit_memory(memory_bytes)
        payload, _ = _outcome(fn, memory_bytes)
        _write_all(write_fd, pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
    finally:
        os._exit(0)


def run_isolated(fn: Callable[[], T], *, timeout_s: float, memory_bytes: int,
                 what: str, probe: Callable[[], Any] | None = None) -> T:
    """Run ``fn`` in a child forked for this call alone and return its result.

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
        first = os.read(read_fd, 1) if _ready(read_fd, HANDSHAKE_S) else b""
        if not first:  # stuck on a lock inherited from another thread: a fresh child
            os.kill(pid, signal.SIGKILL)
            raise _NotReady
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                killed = True
                break
            if not _ready(read_fd, left):
                continue
            chunk = os.read(read_fd, 1 << 20)
            if not chunk:
                break
            size += len(chunk)
            if size > MAX_RESULT_BYTES:
                os.kill(pid, signal.SIGKILL)
                raise _too_large(what)
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
        raise _timed_out(what, timeout_s)
    if not chunks:
        raise _died(what, status)
    kind, value = pickle.loads(b"".join(chunks))
    return _decode(kind, value, what)  # type: ignore[no-any-return]
