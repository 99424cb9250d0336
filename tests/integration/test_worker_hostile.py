"""Issue 10.5 with a real prefork worker on Redis: a dispatch message whose ``max_steps``
is not an integer (kombu carries datetime, Decimal and UUID across intact) is refused at
the entry point with ``DISPATCH_INVALID`` before anything is locked or run, and a task of
the chain that fails (``advance`` included) releases the case lock."""

from __future__ import annotations

import re
import time
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import select

from investigation.constants import CASE_BUILDING_DIAGNOSIS
from investigation.errors import InvestigationError
from investigation.store.models import StageRun
from tests.integration.test_celery_worker import Harness, _assert_completed_case, running_harness

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def _wait_log(h: Harness, pattern: str, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(re.findall(pattern, h.worker.log())) < count:
        assert time.monotonic() < deadline, f"{pattern!r} not seen {count} time(s)"
        time.sleep(0.05)


BAD_MAX_STEPS: list[Any] = [datetime(2026, 1, 1, tzinfo=UTC), Decimal("2"), uuid.uuid4(),
                            "3", 2.5, True, 0, -1, 10**9, [2], {"n": 2}]


def test_a_malformed_dispatch_is_refused_and_locks_nothing(tmp_path: Path, redis_url: str,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           ) -> None:
    from workers.tasks import dispatch, start_dispatch

    with running_harness(tmp_path, redis_url, monkeypatch) as h, h.dump_on_failure():
        case_id = h.case.case_id
        for value in ["3", 2.5, True, 0]:  # the typed API refuses them before locking
            with pytest.raises(InvestigationError) as err:
                start_dispatch(case_id, value)
            assert err.value.code == "DISPATCH_INVALID"
            assert h.lock_holder(case_id) is None
        h.worker.start()
        h.worker.wait_ready()
        for done, value in enumerate(BAD_MAX_STEPS, start=1):
            dispatch.apply_async((case_id, value))
            _wait_log(h, r"Task investigation\.dispatch\[[0-9a-f-]+\] succeeded", done)
            time.sleep(0.3)  # a chain it enqueued (the defect) would hold the lock now
            h.wait_unlocked(timeout_s=2.0)
        for forged in [None, 42, "../../etc", "x" * 100]:
            dispatch.apply_async((forged, None))
        _wait_log(h, r"dispatch refused: DISPATCH_INVALID", len(BAD_MAX_STEPS) + 4)
        with h.case.store.session() as s:
            assert s.exec(select(StageRun)).all() == []  # nothing ran
        assert h.task_received("build_context") == 0
        # The case itself is untouched and runs normally.
        start_dispatch(case_id)
        info = h.wait_for_state(CASE_BUILDING_DIAGNOSIS)
        h.wait_unlocked()
        _assert_completed_case(h, info)


def test_a_lone_stage_message_with_a_forged_token_takes_no_lock(
        tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hostile upstream trial: a stage message sent alone with a token of the sender's
    took the case's free lock for a whole lease (the stage itself refused to run), and
    `dispatch` then answered LOCK_BUSY naming a worker that ran nothing. A re-trial
    chained it to an advance that never ran (sent to another queue, immutable without
    its payload, with a countdown, behind a task no worker has). A stage message whose
    chain is not the rest of its step as the engine sends it is refused before the lock
    is touched."""
    from workers.celery_app import app
    from workers.tasks import STAGE_TASKS, advance, start_dispatch

    with running_harness(tmp_path, redis_url, monkeypatch) as h, h.dump_on_failure():
        case_id = h.case.case_id
        h.worker.start()
        h.worker.wait_ready()
        payload = {"case_id": case_id, "revision": 1, "step_seq": 1, "steps_left": 5,
                   "mode": "distributed", "max_steps": None, "halt": None}
        token = "forgedtoken0000"
        STAGE_TASKS["build_context"].apply_async((payload,), {"token": token})

        def tail(**changes: Any) -> dict[str, Any]:
            """The advance that ends a step's chain, as the engine sends it, changed."""
            sig = {"task": "investigation.advance", "args": [], "kwargs": {"token": token},
                   "options": {"argsrepr": "x", "kwargsrepr": "y"}, "subtask_type": None,
                   "immutable": False}
            return {**sig, **changes}

        other = {"task": "investigation.nosuch", "args": [], "kwargs": {}, "options": {},
                 "subtask_type": None, "immutable": False}
        forged_chains = [
            [tail(options={"queue": "nowhere"})], [tail(immutable=True)],
            [tail(), other], [tail(options={"countdown": 86400})],
            [tail(kwargs={"token": "another"})], [tail(args=[payload])]]
        for chain in forged_chains:
            app.send_task("investigation.publish", args=[payload], kwargs={"token": token},
                          queue=h.queue, chain=chain)
        _wait_log(h, r"refused: PAYLOAD_INVALID: a stage message whose chain",
                  1 + len(forged_chains))
        assert "a stage message whose chain is not the rest of its step" in h.worker.log()
        assert "chain's investigation.advance is no signature the engine sends" in \
            h.worker.log()
        assert h.lock_holder(case_id) is None
        # Forged advance payloads ended in KeyError, ValueError, TypeError or
        # AttributeError with tracebacks (two trials).
        no_steps_left = {k: v for k, v in payload.items() if k != "steps_left"}
        for forged in [{**payload, "halt": {"reason": "x"}}, no_steps_left,
                       {**payload, "halt": {"outcome": "RETRY_PENDING",
                                            "retry_not_before": "garbage"}},
                       {**payload, "halt": {"outcome": "RETRY_PENDING",
                                            "retry_not_before": "2020-01-01T00:00:00"}},
                       {**payload, "halt": {"outcome": "BLOCKED", "details": "x"}}]:
            advance.apply_async((forged,), {"token": token})
        _wait_log(h, r"investigation\.advance refused: PAYLOAD_INVALID", 5)
        for said in ("halt has no outcome", "steps_left is None, not a count",
                     "retry_not_before 'garbage' is no time",
                     "retry_not_before '2020-01-01T00:00:00' is no time with its UTC offset",
                     "halt details are not an object"):
            assert said in h.worker.log(), said
        assert "Traceback" not in h.worker.log()
        assert h.lock_holder(case_id) is None
        with h.case.store.session() as s:
            assert s.exec(select(StageRun)).all() == []  # nothing ran
        # The case itself runs normally, its own chains taking and releasing the lock.
        start_dispatch(case_id)
        info = h.wait_for_state(CASE_BUILDING_DIAGNOSIS)
        h.wait_unlocked()
        _assert_completed_case(h, info)


def test_a_failing_advance_releases_the_lock(tmp_path: Path, redis_url: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A forged ``advance`` whose payload cannot be processed is refused
    (``PAYLOAD_INVALID``, one line), and the lock its token held is released at once
    instead of staying until its lease runs out."""
    from workers import runtime
    from workers.tasks import advance

    with running_harness(tmp_path, redis_url, monkeypatch) as h, h.dump_on_failure():
        case_id = h.case.case_id
        token = runtime.current().lock.acquire(case_id)
        h.worker.start()
        h.worker.wait_ready()
        advance.apply_async(({"case_id": case_id, "revision": 1, "step_seq": 1,
                              "token": token, "steps_left": "many", "mode": "distributed",
                              "max_steps": None,
                              "halt": {"outcome": "PROGRESSED", "reason": None}},))
        _wait_log(h, r"investigation\.advance refused: PAYLOAD_INVALID: payload steps_left "
                     r"is 'many'", 1)
        h.wait_unlocked(timeout_s=5.0)


def test_a_dispatch_message_with_wrong_arguments_is_refused_without_traceback(
        tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages sent by name (``send_task``) whose arguments do not fit the contract
    (surplus positionals, no case id, unknown keywords) are refused with
    ``DISPATCH_INVALID`` in one log line: no TypeError traceback, no lock, nothing run."""
    from workers.celery_app import app

    with running_harness(tmp_path, redis_url, monkeypatch) as h, h.dump_on_failure():
        case_id = h.case.case_id
        bad: list[tuple[list[Any], dict[str, Any]]] = [
            ([case_id, 1, 2, 3], {}),  # contract twice (positional and default)
            ([case_id, 1, 2, 3], {"contract": 1}),
            ([case_id, None, 1], {"contract": 1}),  # contract positional and keyword
            ([], {}),  # no case id
            ([], {"contract": 1}),
            ([case_id], {"contract": 1, "evil": 2}),
            ([case_id], {"contract": 1, "lock_token": "x"}),
            ([case_id, 2], {"max_steps": 3}),
            # What Python's binding alone let through (a hostile-input trial): keywords
            # for the positionals, and a third positional taken as the contract.
            ([case_id], {"max_steps": 3}),
            ([], {"case_id": case_id}),
            ([case_id, 1, 1], {}),
        ]
        h.worker.start()
        h.worker.wait_ready()
        for args, kwargs in bad:
            app.send_task("investigation.dispatch", args=args, kwargs=kwargs, queue=h.queue)
        # An internal task sent by name with wrong arguments is refused the same way.
        app.send_task("investigation.advance", args=[], kwargs={"evil": 1}, queue=h.queue)
        # ... and one whose payload is not the step's ids, or that comes without a token
        # (these logged a KeyError or AttributeError traceback, a hostile-input trial).
        ids = {"case_id": case_id, "revision": 1, "step_seq": 1, "halt": None}
        forged: list[tuple[str, list[Any], dict[str, Any]]] = [
            ("advance", [{}], {"token": "t"}),
            ("build_context", ["str"], {"token": "t"}),
            ("publish", [{**ids, "revision": True}], {"token": "t"}),
            ("validate", [{**ids, "case_id": "../x"}], {"token": "t"}),
            ("llm_call", [{**ids, "halt": "no"}], {"token": "t"}),
            ("execute_tool", [ids], {}),
        ]
        for stage, f_args, f_kwargs in forged:
            app.send_task(f"investigation.{stage}", args=f_args, kwargs=f_kwargs,
                          queue=h.queue)
        # Another contract version is refused as such, whatever its arguments.
        app.send_task("investigation.dispatch", args=[case_id, 1, 2, 3],
                      kwargs={"contract": 2, "priority": 1}, queue=h.queue)
        # JSON's true and 1.0 are not the version 1.
        for contract in (True, 1.0):
            app.send_task("investigation.dispatch", args=[case_id],
                          kwargs={"contract": contract}, queue=h.queue)
        _wait_log(h, r"investigation\.dispatch refused: DISPATCH_INVALID", len(bad))
        _wait_log(h, r"investigation\.advance refused: PAYLOAD_INVALID", 2)
        _wait_log(h, r"investigation\.\w+ refused: PAYLOAD_INVALID", 1 + len(forged))
        _wait_log(h, r"dispatch message of contract version 2 refused", 1)
        _wait_log(h, r"dispatch message of contract version (True|1\.0) refused", 2)
        _wait_log(h, r"Task investigation\.\w+\[[0-9a-f-]+\] succeeded",
                  len(bad) + 4 + len(forged))
        worker_log = h.worker.log()
        assert "Traceback" not in worker_log and "TypeError" not in worker_log
        assert "raised unexpected" not in worker_log
        assert "keyword argument(s) [evil]" in worker_log  # the reason, named
        assert "DISPATCHED" not in worker_log
        assert h.lock_holder(case_id) is None
        assert h.task_received("build_context") == 1  # the forged one, refused
        with h.case.store.session() as s:
            assert s.exec(select(StageRun)).all() == []


def test_malformed_queue_items_are_dropped_and_the_worker_goes_on(
        tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw items pushed onto the case queue by someone with broker access: one that is not
    JSON, an envelope whose body is not its declared base64, and a protocol-2 message
    whose JSON body is not ``[args, kwargs, embed]``. Each stopped the worker ("Unrecoverable
    error"; the last one was restored to the queue and stopped every restart). Now each is
    refused in one line and dropped, and the worker runs the case sent after them. So is a
    message whose eta lies beyond INVESTIGATE_MAX_COUNTDOWN_S."""
    import base64
    import json
    import zlib

    from workers.celery_app import app
    from workers.tasks import start_dispatch

    with running_harness(tmp_path, redis_url, monkeypatch) as h, h.dump_on_failure():
        case_id = h.case.case_id
        # A real envelope to take apart (no worker is running yet).
        app.send_task("investigation.dispatch", args=[case_id], kwargs={"contract": 1},
                      queue=h.queue)
        raw = h.redis.rpop(h.queue)
        assert raw is not None
        envelope = json.loads(raw)
        bad_base64 = {**envelope, "body": "!!! not base64 %%%"}
        not_a_triple = {**envelope, "body": base64.b64encode(b'{"a": 1}').decode()}
        # A hostile-input trial: kombu inflated a compressed body without a bound (272 KB
        # to 400 MB); an envelope without properties made the worker reconnect (kombu's
        # KeyError counts as a connection error); the rest were logged with tracebacks.
        bomb = {**envelope, "headers": {**envelope["headers"], "compression":
                                        "application/x-gzip"},
                "body": base64.b64encode(zlib.compress(b"[" + b" " * (8 << 20) + b"]", 9)
                                         ).decode()}
        pickled = {**envelope, "content-type": "application/x-python-serialize"}
        bad_expiry = {**envelope, "headers": {**envelope["headers"], "expires": "zzz"}}
        nested = {**envelope, "body": base64.b64encode(b"[" * 100_000).decode()}
        no_time = {**envelope, "headers": {**envelope["headers"], "eta": "not-a-date"}}
        unknown = {**envelope, "headers": {**envelope["headers"],
                                           "task": "investigation.evil\x1b[2J"}}
        # A hostile upstream trial: a timelimit of strings stopped the worker at every
        # restart; a sender's time limit killed the pool process; a retries of "lots",
        # kwargs or embed of the wrong type, and an embed's callbacks ran (or failed with
        # tracebacks) after the task.

        def with_headers(**headers: Any) -> dict[str, Any]:
            return {**envelope, "headers": {**envelope["headers"], **headers}}

        def with_body(body: Any) -> dict[str, Any]:
            return {**envelope, "body": base64.b64encode(json.dumps(body).encode()).decode()}

        args = [case_id]
        senders = [with_headers(timelimit=["a", "b"]), with_headers(timelimit=[None, 0.001]),
                   with_headers(timelimit="x"), with_headers(retries="lots"),
                   with_headers(retries=-1), with_body([args, [1], {}]),
                   with_body([args, {}, "x"]), with_body([args, {}, {"chain": "x"}]),
                   with_body([args, {}, {"chain": [{}]}]),
                   with_body([args, {"contract": 1}, {"callbacks": [
                       {"task": "investigation.recover", "args": [], "kwargs": {},
                        "options": {}, "subtask_type": None, "immutable": False}]}])]
        items = [json.dumps(item).encode() for item in senders] + [
                 b"not json at all {", b"\xff\xfe not utf-8", json.dumps([1, 2]).encode(),
                 json.dumps(bad_base64).encode(), json.dumps(not_a_triple).encode(),
                 json.dumps({"headers": {}}).encode(), json.dumps(bomb).encode(),
                 json.dumps(pickled).encode(), json.dumps(bad_expiry).encode(),
                 json.dumps(nested).encode(), json.dumps(unknown).encode(),
                 json.dumps(no_time).encode()]
        for item in items:
            h.redis.lpush(h.queue, item)
        # A contract-valid dispatch to run in three years: the worker held it in memory,
        # unacknowledged, and the broker handed it out again every visibility timeout.
        app.send_task("investigation.dispatch", args=[case_id], kwargs={"contract": 1},
                      queue=h.queue, countdown=10**8)
        h.worker.start()
        h.worker.wait_ready()
        # The same kinds on the remote-control broadcast, which every worker reads: one
        # PUBLISH made the whole fleet exit (a code review).
        from tests.integration.test_celery_worker import BROKER_DB

        pidbox = f"/{BROKER_DB}.celery.pidbox"
        broadcasts = [{"headers": {}}, {**envelope, "headers": {"compression": "x"}},
                      {**envelope, "body": "!!! not base64 %%%"}]
        for item in broadcasts:  # "ready" comes before the remote-control subscription
            deadline = time.monotonic() + 20
            while h.redis.publish(pidbox, json.dumps(item)) < 1:  # no one heard it: again
                assert time.monotonic() < deadline, "the worker never listened to pidbox"
                time.sleep(0.1)
        _wait_log(h, r"broker message refused: MESSAGE_INVALID",
                  len(items) + 1 + len(broadcasts))
        assert "a broadcast message on 'celery.pidbox'" in h.worker.log()
        assert app.control.ping(timeout=2.0), "the worker no longer answers remote control"
        assert "beyond INVESTIGATE_MAX_COUNTDOWN_S" in h.worker.log()
        assert "a compressed body" in h.worker.log()  # refused before it was inflated
        assert "'not-a-date', which is no time" in h.worker.log()
        for what in ("a timelimit header that is not [soft, hard]",
                     "a timelimit header that sets a time limit",
                     "a retries header that is not a count", "kwargs are not an object",
                     "embed is not an object", "embed chain is not a list",
                     "embed carries callbacks"):
            assert what in h.worker.log(), what
        assert "investigation.recover" not in re.sub(r"task message 'investigation\.\w+'",
                                                     "", h.worker.log().split("ready.")[1])
        start_dispatch(case_id)
        info = h.wait_for_state(CASE_BUILDING_DIAGNOSIS)
        h.wait_unlocked()
        _assert_completed_case(h, info)
        worker_log = h.worker.log()
        assert "Unrecoverable error" not in worker_log
        assert "Traceback" not in worker_log and "Connection to broker lost" not in worker_log
        assert "\x1b" not in worker_log  # the hostile task name is escaped
        assert h.worker.proc is not None and h.worker.proc.poll() is None
        h.worker.stop()
        # Nothing was left reserved for the broker to restore to the next worker.
        assert h.redis.llen(h.queue) == 0
        assert not h.redis.hlen("unacked")


def test_a_dispatch_of_an_unknown_case_leaves_no_lock_key(tmp_path: Path, redis_url: str,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The lock taken for a case that is not in the store is released without a tombstone:
    no message carried its token (a hostile-input trial found ``released`` keys, kept for
    about an hour, of refused dispatches)."""
    from workers.tasks import start_dispatch

    with running_harness(tmp_path, redis_url, monkeypatch) as h:
        unknown = "case-00000000000000ff"
        with pytest.raises(InvestigationError) as err:
            start_dispatch(unknown)
        assert err.value.code == "CASE_NOT_FOUND"
        assert h.redis.keys(f"*{unknown}*") == []
