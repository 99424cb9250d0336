"""The persistent isolated server (decision 94): one forked child per opened database,
reused while it is healthy, replaced after a kill, with every limit of the one-shot fork.
Real processes throughout: nothing here mocks a fork."""

from __future__ import annotations

import logging
import math
import os
import resource
import signal
import threading
import time
from typing import Any

import pytest

from investigation.errors import ToolError
from investigation.tools import isolation
from investigation.tools.isolation import IsolatedServer, RequestRefused
from investigation.tools.sqlite import ReadOnlyDatabase
from tests.unit.test_tools_db import APP_DB
from tests.unit.test_tools_isolation import compile_bomb

COUNT_USERS = "SELECT count(*) AS n FROM users"


def open_db() -> ReadOnlyDatabase:
    return ReadOnlyDatabase("app.sqlite", APP_DB)


def count_users(db: ReadOnlyDatabase, **kwargs: Any) -> int:
    _, rows, _, _ = db.query(COUNT_USERS, [], max_rows=5, timeout_s=2.0, **kwargs)
    return int(rows[0][0])


def process_state(pid: int) -> str | None:
    """The kernel's state letter of ``pid`` (``Z`` for a zombie), ``None`` when gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


def is_dead(pid: int, within_s: float = 3.0) -> bool:
    """Whether ``pid`` stops running (exits, or waits as a zombie) within ``within_s``."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if process_state(pid) in (None, "Z", "X"):
            return True
        time.sleep(0.01)
    return False


class Target:
    """What a test server runs: small methods with known costs."""

    methods = ("pid", "spin", "sleep", "refuse", "blob", "length", "die", "cpu_limit")

    def pid(self) -> int:
        return os.getpid()

    def spin(self, cpu_s: float) -> int:
        start = time.process_time()
        while time.process_time() - start < cpu_s:
            pass
        return os.getpid()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def refuse(self) -> None:
        raise ToolError("TOOL_SQL_ERROR", "refused in the server", database="x")

    def blob(self, size: int) -> bytes:
        return b"x" * size

    def length(self, data: bytes) -> int:
        return len(data)

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def cpu_limit(self) -> tuple[int, float]:
        return resource.getrlimit(resource.RLIMIT_CPU)[0], time.process_time()

    def secret(self) -> str:  # a method the server does not serve
        return "ran"


def serve() -> tuple[IsolatedServer, Target]:
    return IsolatedServer(Target.methods), Target()


def call(server: IsolatedServer, target: Target, method: str, *args: Any,
         timeout_s: float = 5.0) -> Any:
    return server.call(target, method, args, timeout_s=timeout_s, memory_bytes=64 << 20)


def test_one_server_answers_every_kind_of_request() -> None:
    db = open_db()
    try:
        assert count_users(db) == 3
        pid = db._server.pid
        assert pid is not None and pid != os.getpid() and parent_of(pid) == os.getpid()
        db.preflight("SELECT name FROM users WHERE id = ?", [1])
        assert [c[1] for c in db.schema("users")["columns"]] == ["id", "name", "email",
                                                                  "avatar"]
        assert count_users(db) == 3
        assert db._server.pid == pid
    finally:
        db.close()


def test_a_timed_out_request_kills_the_server_and_the_next_gets_a_new_one() -> None:
    db = open_db()
    try:
        assert count_users(db, memory_bytes=1 << 30) == 3
        first = db._server.pid
        assert first is not None
        started = time.monotonic()
        with pytest.raises(ToolError) as err:
            db.preflight(compile_bomb(18), [], timeout_s=0.5, memory_bytes=1 << 30)
        assert time.monotonic() - started < 3
        assert err.value.code == "TOOL_SQL_TIMEOUT"
        assert err.value.message == ("the statement did not finish within 0.5 s and was "
                                     "stopped; narrow it (fewer joins, CTEs or views, a LIMIT)")
        assert err.value.details == {"timeout_s": 0.5}
        assert db._server.pid is None and is_dead(first)
        assert count_users(db, memory_bytes=1 << 30) == 3
        assert db._server.pid not in (None, first)
    finally:
        db.close()


def test_a_statement_that_exhausts_memory_is_a_resource_limit_and_the_next_works() -> None:
    db = open_db()
    try:
        with pytest.raises(ToolError) as err:
            db.preflight(compile_bomb(18), [], timeout_s=20, memory_bytes=64 << 20)
        assert err.value.code == "TOOL_RESOURCE_LIMIT"
        assert "64 MiB" in err.value.message
        assert count_users(db, memory_bytes=64 << 20) == 3
    finally:
        db.close()


def test_many_requests_may_use_more_cpu_than_one_request_may() -> None:
    """RLIMIT_CPU counts a process's whole life: the soft limit moves with each request."""
    server, target = serve()
    try:
        budget_s = isolation._cpu_budget_s(0.9)
        assert budget_s == 1
        # Short spins: each must finish within its 0.9 s of wall time on a loaded machine
        # (0.3 s spins timed out once beside other work on the 2 cores).
        pids = {call(server, target, "spin", 0.2, timeout_s=0.9) for _ in range(9)}
        assert len(pids) == 1  # 1.8 s of CPU in one server
        soft, used_s = call(server, target, "cpu_limit", timeout_s=0.9)
        assert soft != resource.RLIM_INFINITY  # yet each request is bounded
        assert used_s < soft <= math.ceil(used_s) + budget_s
    finally:
        server.stop()


def test_a_request_for_another_method_is_refused_by_the_server() -> None:
    server, target = serve()
    try:
        pid = call(server, target, "pid")
        with pytest.raises(RequestRefused, match="'secret' is not one of"):
            call(server, target, "secret")
        with pytest.raises(RequestRefused, match="not plain data"):
            call(server, target, "sleep", os.system)  # a callable cannot even be sent
        assert call(server, target, "pid") == pid  # refusals leave the server serving
    finally:
        server.stop()
    db = open_db()
    try:
        count_users(db)
        with pytest.raises(RequestRefused):
            db._server.call(db, "close", (), timeout_s=2, memory_bytes=256 << 20)
        assert count_users(db) == 3  # the child did not close its copy either
    finally:
        db.close()


def test_tool_errors_and_results_cross_unchanged() -> None:
    server, target = serve()
    try:
        with pytest.raises(ToolError) as err:
            call(server, target, "refuse")
        assert (err.value.code, err.value.message, err.value.details) == (
            "TOOL_SQL_ERROR", "refused in the server", {"database": "x"})
        assert call(server, target, "blob", 3 << 20) == b"x" * (3 << 20)
        assert call(server, target, "length", b"y" * (1 << 20)) == 1 << 20  # > a pipe
    finally:
        server.stop()


def test_a_server_that_stops_reading_cannot_hold_a_request_past_its_deadline() -> None:
    server, target = serve()
    try:
        pid = call(server, target, "pid")
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(ToolError) as err:
            call(server, target, "length", b"y" * (1 << 20), timeout_s=0.3)
        assert err.value.code == "TOOL_SQL_TIMEOUT" and time.monotonic() - started < 2
        assert is_dead(pid) and call(server, target, "pid") != pid
    finally:
        server.stop()


def test_a_result_past_the_cap_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isolation, "MAX_RESULT_BYTES", 1 << 20)
    server, target = serve()
    try:
        pid = call(server, target, "pid")
        with pytest.raises(ToolError) as err:
            call(server, target, "blob", 2 << 20)
        assert err.value.code == "TOOL_RESOURCE_LIMIT" and "too large" in err.value.message
        assert is_dead(pid) and call(server, target, "pid") != pid
    finally:
        server.stop()


def test_a_server_that_dies_mid_request_is_a_resource_limit_with_its_signal() -> None:
    server, target = serve()
    try:
        pid = call(server, target, "pid")
        with pytest.raises(ToolError) as err:
            call(server, target, "die")
        assert err.value.code == "TOOL_RESOURCE_LIMIT"
        assert err.value.message.endswith("(signal 9)")
        assert process_state(pid) is None  # reaped for its status
        assert call(server, target, "pid") != pid
    finally:
        server.stop()


def test_no_zombies_accumulate_after_timeouts() -> None:
    server, target = serve()
    killed = []
    try:
        for _ in range(8):
            killed.append(call(server, target, "pid"))
            with pytest.raises(ToolError) as err:
                call(server, target, "sleep", 30, timeout_s=0.1)
            assert err.value.code == "TOOL_SQL_TIMEOUT"
        call(server, target, "pid")
        time.sleep(0.2)
        call(server, target, "pid")
        assert [pid for pid in killed if process_state(pid) == "Z"] == []
    finally:
        server.stop()


def test_a_caller_stopped_from_outside_kills_the_server() -> None:
    class Stopped(Exception):
        pass

    def stop(*_: Any) -> None:
        raise Stopped  # like Celery's SoftTimeLimitExceeded, raised inside the call

    server, target = serve()
    previous = signal.signal(signal.SIGALRM, stop)
    try:
        pid = call(server, target, "pid")
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Stopped):
            call(server, target, "sleep", 30, timeout_s=10)
        assert server.pid is None and is_dead(pid)
        assert call(server, target, "pid") != pid
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        server.stop()


def test_the_server_dies_with_its_parent_process() -> None:
    """Even mid-request (an idle server would also see its request pipe close)."""
    read_fd, write_fd = os.pipe()
    middle = os.fork()
    if middle == 0:  # pragma: no cover - the middle process
        try:
            os.close(read_fd)
            server, target = serve()
            os.write(write_fd, str(call(server, target, "pid")).encode())
            call(server, target, "sleep", 60, timeout_s=120)
        finally:
            os._exit(0)
    os.close(write_fd)
    try:
        server_pid = int(os.read(read_fd, 32))
        assert process_state(server_pid) not in (None, "Z")
        assert parent_of(server_pid) == middle
        time.sleep(0.2)  # the request is under way
    finally:
        os.close(read_fd)
        os.kill(middle, signal.SIGKILL)
        os.waitpid(middle, 0)
    assert is_dead(server_pid)


def test_a_forked_process_gets_its_own_server() -> None:
    """A prefork worker child forked after its parent opened a database never talks to
    the parent's server, and never stops it."""
    db = open_db()
    try:
        assert count_users(db) == 3
        parents = db._server.pid
        read_fd, write_fd = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the forked process
            try:
                os.close(read_fd)
                n = count_users(db)
                own = db._server.pid
                assert own is not None
                os.write(write_fd, f"{n} {own} {parent_of(own)}".encode())
                db.close()
            finally:
                os._exit(0)
        os.close(write_fd)
        n, own, owner = map(int, os.read(read_fd, 64).split())
        os.close(read_fd)
        os.waitpid(child, 0)
        assert n == 3 and own != parents and owner == child
        assert count_users(db) == 3 and db._server.pid == parents  # untouched
    finally:
        db.close()


def test_a_server_forked_by_a_thread_that_ended_is_replaced() -> None:
    """PR_SET_PDEATHSIG fires when the forking *thread* ends."""
    db = open_db()
    seen: list[int | None] = []

    def first_use() -> None:
        count_users(db)
        seen.append(db._server.pid)

    try:
        thread = threading.Thread(target=first_use)
        thread.start()
        thread.join()
        (old,) = seen
        assert count_users(db) == 3  # at once: the server may not even be dead yet
        assert old is not None and db._server.pid not in (None, old) and is_dead(old)
    finally:
        db.close()


def test_a_request_whose_server_dies_with_its_forking_thread_runs_again() -> None:
    server, target = serve()
    ending = threading.Event()
    started: list[int] = []

    def start_then_end() -> None:
        started.append(call(server, target, "pid"))
        ending.wait()

    thread = threading.Thread(target=start_then_end)
    thread.start()
    try:
        while not started:
            time.sleep(0.01)
        threading.Timer(0.2, ending.set).start()  # the thread ends during the request
        ran_on = call(server, target, "spin", 0.5)
        thread.join()
        assert ran_on != started[0] and is_dead(started[0])
    finally:
        ending.set()
        server.stop()


def test_closing_or_dropping_a_database_stops_its_server() -> None:
    db = open_db()
    count_users(db)
    pid = db._server.pid
    assert pid is not None
    db.close()
    assert db._server.pid is None and is_dead(pid)

    dropped = open_db()
    count_users(dropped)
    pid = dropped._server.pid
    assert pid is not None
    del dropped
    import gc

    gc.collect()  # the database's connection holds its date wrappers: a cycle
    assert is_dead(pid)


def test_a_server_stuck_at_its_handshake_falls_back_in_process(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    held = threading.Lock()
    held.acquire()  # "another thread" holds it across every fork below

    class Stuck(Target):
        def probe(self) -> None:
            held.acquire()  # blocks forever in the child, like SQLite's allocator mutex

    monkeypatch.setattr(isolation, "FORK_TRIES", 3)
    server = IsolatedServer(Target.methods, probe="probe")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="investigation.tools.isolation"):
        assert call(server, Stuck(), "pid") == os.getpid()  # ran in process
    assert time.monotonic() - started < 3 * isolation.HANDSHAKE_S + 1
    assert "no forked child became ready" in caplog.text
    with pytest.raises(RequestRefused):
        call(server, Stuck(), "secret")  # in process too, only the server's methods
    held.release()
    server.stop()


def test_descriptors_past_select_s_range_work() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 1200:
        pytest.skip("needs 1,200 open files")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        server, target = serve()
        assert call(server, target, "pid") == server.pid
        assert server._replies > 1023  # select() refuses these
        server.stop()
    finally:
        for fd in held:
            os.close(fd)


def test_a_process_keeps_servers_for_its_most_recently_used_databases_only() -> None:
    """Starting a server beyond ``SERVERS_PER_PROCESS`` stops the least recently used
    one (each holds copies of the pages its parent rewrites); its next request forks a
    new server and answers as before."""
    from investigation.tools import sqlite as sqlite_tools

    dbs = [open_db() for _ in range(sqlite_tools.SERVERS_PER_PROCESS + 1)]
    try:
        pids = []
        for db in dbs:
            assert count_users(db) == 3
            pids.append(db._server.pid)
        assert dbs[0]._server.pid is None and is_dead(pids[0])
        assert [db._server.pid for db in dbs[1:]] == pids[1:]
        assert count_users(dbs[0]) == 3  # again: a new server, the oldest other stopped
        assert dbs[0]._server.pid not in (None, pids[0])
        assert dbs[1]._server.pid is None and is_dead(pids[1])
        assert dbs[2]._server.pid == pids[2]
    finally:
        for db in dbs:
            db.close()
