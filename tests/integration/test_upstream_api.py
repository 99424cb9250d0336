"""``workers.upstream``: what an upstream system's Python code meets (an integrator's
trial): a bad dispatch is refused in the sender's process, a store that is not the
deployment's is not made silently, the case is followed without the CLI, and a dispatch
sent to Celery's default queue shows in ``health``."""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from investigation.errors import InvestigationError
from tests import casekit
from tests.casekit import make_case
from workers.settings import Settings


def _closed_broker() -> str:
    """A broker address nothing listens on: a message sent there raises at once, so a
    refusal before it proves nothing was sent."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}/0"


def _settings(tmp_path: Path, **kw: Any) -> Settings:
    return Settings(home=tmp_path / "home", broker_url=_closed_broker(), **kw)


def test_register_does_not_make_a_store_of_its_own(tmp_path: Path) -> None:
    """Without INVESTIGATE_DATABASE_URL an upstream process registered into a new
    ./.investigate store the fleet never read."""
    from workers.upstream import register

    package = casekit.build_tiny_package(tmp_path / "pkg").read_bytes()
    settings = _settings(tmp_path)
    with pytest.raises(InvestigationError) as err:
        register(package, casekit.INTERPRETATION, casekit.HYPOTHESES, settings=settings)
    assert err.value.code == "STORE_NOT_FOUND"
    assert "INVESTIGATE_DATABASE_URL" in err.value.message
    assert not (tmp_path / "home").exists()  # nothing was made
    case_id = register(package, casekit.INTERPRETATION, casekit.HYPOTHESES,
                       settings=settings, create_store=True)
    assert case_id == register(package, casekit.INTERPRETATION, casekit.HYPOTHESES,
                               settings=settings)  # the store exists now; idempotent
    other = [{"id": 1, "statement": "Another claim."}]
    paused = register(package, casekit.INTERPRETATION, other, settings=settings, paused=True)
    from workers.upstream import status

    assert status(paused, settings=settings)["state"] == "PAUSED"
    with pytest.raises(InvestigationError) as err:
        register(package.decode("latin-1"), casekit.INTERPRETATION,  # type: ignore[arg-type]
                 casekit.HYPOTHESES, settings=settings)
    assert err.value.code == "PKG_NOT_ZIP" and "Path(...).read_bytes()" in err.value.message


def test_send_dispatch_refuses_what_a_worker_would_refuse(tmp_path: Path) -> None:
    """A worker refused these only in its log, and no result backend carries its
    result: the sender's own call refuses them now, before anything is sent."""
    from workers.upstream import send_dispatch

    case = make_case(tmp_path / "case")
    settings = _settings(tmp_path, database_url=case.store.url)
    for case_id, max_steps in [("../x", None), (None, None), ("x" * 100, None),
                               (case.case_id, 0), (case.case_id, "5"), (case.case_id, True),
                               (case.case_id, 10**9)]:
        with pytest.raises(InvestigationError) as err:
            send_dispatch(case_id, max_steps, settings=settings)  # type: ignore[arg-type]
        assert err.value.code == "DISPATCH_INVALID", (case_id, max_steps)
    with pytest.raises(InvestigationError) as err:
        send_dispatch("case-0000000000000000", settings=settings)
    assert err.value.code == "CASE_NOT_FOUND" and "nothing was sent" in err.value.message
    from kombu.exceptions import OperationalError

    with pytest.raises(OperationalError):  # a good request reaches the (closed) broker
        send_dispatch(case.case_id, 2, settings=settings)


def test_status_follows_a_case_in_process(tmp_path: Path) -> None:
    from workers.upstream import status

    case = make_case(tmp_path / "case")
    settings = _settings(tmp_path, database_url=case.store.url)
    before = status(case.case_id, settings=settings)
    assert (before["state"], before["steps"], before["next"]["final"]) == (
        "INVESTIGATING", 0, False)
    assert case.investigator().run(case.case_id).outcome == "COMPLETED"
    after = status(case.case_id, settings=settings)
    assert after["state"] == "BUILDING_DIAGNOSIS" and after["next"]["final"] is True
    assert after["evidence"]["records"] == after["evidence_count"] > 0
    with pytest.raises(InvestigationError) as err:
        status("case-0000000000000000", settings=settings)
    assert err.value.code == "CASE_NOT_FOUND"


def test_status_watch_json_writes_a_line_per_change_until_settled(tmp_path: Path) -> None:
    """`status --watch --json` printed one object and exited while the case still ran."""
    from workers.progress import watch_json

    case = make_case(tmp_path / "case")
    investigator = case.investigator()
    lines: list[str] = []
    last = watch_json(lines.append, case.store, case.case_id, 0.0,
                      sleep=lambda _s: investigator.step(case.case_id))
    docs = [json.loads(line) for line in lines]
    assert all(line.endswith("\n") and line.count("\n") == 1 for line in lines)
    assert [d["steps"] for d in docs] == list(range(len(docs)))  # one per published step
    assert docs[0]["state"] == "INVESTIGATING" and docs[-1]["state"] == "BUILDING_DIAGNOSIS"
    assert docs[-1]["next"]["final"] is True and last["state"] == "BUILDING_DIAGNOSIS"


def test_health_names_dispatches_waiting_in_celerys_default_queue(redis_url: str) -> None:
    from workers.health import CELERY_DEFAULT_QUEUE, check_queue

    client = redis.Redis.from_url(redis_url)
    queue = "q-" + uuid.uuid4().hex[:8]
    settings = Settings(broker_url=redis_url, queue=queue)
    client.delete(CELERY_DEFAULT_QUEUE)
    try:
        assert "default queue" not in check_queue(settings, 2.0).detail
        client.lpush(CELERY_DEFAULT_QUEUE, b"{}")
        check = check_queue(settings, 2.0)
        assert check.ok and check.detail == (
            f"{queue}: 0 message(s) waiting; 1 message(s) wait in Celery's default queue "
            f"'celery', which these workers do not read (a dispatch sent without "
            f"queue={queue!r}?)")
    finally:
        client.delete(CELERY_DEFAULT_QUEUE)


@pytest.mark.postgres
def test_reading_calls_never_write_a_foreign_database(tmp_path: Path, postgres_url: str) -> None:
    """`status` and `send_dispatch` open the store as the CLI's reading commands do: a
    database that is no investigation store is refused, never given the schema."""
    import sqlalchemy

    from workers.upstream import send_dispatch, status

    settings = _settings(tmp_path, database_url=postgres_url)
    for call in (lambda: status("case-0000000000000000", settings=settings),
                 lambda: send_dispatch("case-0000000000000000", settings=settings)):
        with pytest.raises(InvestigationError) as err:
            call()
        assert err.value.code == "STORE_NOT_FOUND"
    engine = sqlalchemy.create_engine(postgres_url)
    try:
        assert sqlalchemy.inspect(engine).get_table_names() == []  # nothing was created
    finally:
        engine.dispose()


def test_status_watch_json_waits_out_a_dropped_store_connection(tmp_path: Path) -> None:
    """One dropped connection ended the watch with a pretty-printed error that broke the
    JSON Lines (a hostile-input trial): a failed read is tried again at the next interval,
    STORE_RETRIES times in a row at most."""
    from sqlalchemy.exc import OperationalError

    import workers.progress as progress

    case = make_case(tmp_path / "case")
    investigator = case.investigator()
    real = progress.status
    fails = iter([True, True, False] + [False] * 50)

    def flaky(store: Any, case_id: str) -> dict[str, Any]:
        if next(fails):
            raise OperationalError("SELECT", {}, Exception("server closed the connection"))
        return real(store, case_id)

    lines: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(progress, "status", flaky)
        last = progress.watch_json(lines.append, case.store, case.case_id, 0.0,
                                   sleep=lambda _s: investigator.step(case.case_id))
        assert last["state"] == "BUILDING_DIAGNOSIS"
        assert all(json.loads(line) for line in lines)
        mp.setattr(progress, "status", lambda *_a: (_ for _ in ()).throw(
            OperationalError("SELECT", {}, Exception("down"))))
        with pytest.raises(OperationalError):
            progress.watch_json(lines.append, case.store, case.case_id, 0.0,
                                sleep=lambda _s: None)


def test_status_watch_json_errors_are_one_line_and_ctrl_c_is_not_settled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib
    import io

    import typer.main
    from typer.testing import CliRunner

    from workers.cli import _invoke, app

    case = make_case(tmp_path / "case")
    monkeypatch.setenv("INVESTIGATE_DATABASE_URL", case.store.url)
    monkeypatch.setenv("INVESTIGATE_HOME", str(tmp_path / "home"))
    runner = CliRunner()
    missing = runner.invoke(app, ["status", "case-0000000000000000", "--watch", "--json"])
    assert missing.exit_code == 2
    (line,) = missing.stdout.splitlines()  # one JSON line, as the stream's others
    assert json.loads(line)["error"]["code"] == "CASE_NOT_FOUND"
    # The next command of the same process prints its --json error as before, indented.
    plain = runner.invoke(app, ["status", "case-0000000000000000", "--json"])
    assert plain.exit_code == 2 and len(plain.stdout.splitlines()) > 1
    assert json.loads(plain.stdout)["error"]["code"] == "CASE_NOT_FOUND"
    # A usage error, as the console entry point prints it: one line too.
    command = typer.main.get_command(app)
    for bad in ("1e10", "nan"):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = _invoke(command, ["status", case.case_id, "--watch", "--json",
                                     "--interval", bad])
        assert code == 2
        (line,) = buf.getvalue().splitlines()
        assert json.loads(line)["error"]["code"] == "USAGE_INVALID"
    monkeypatch.setenv("INVESTIGATE_DATABASE_URL", f"sqlite:///{tmp_path / 'none.db'}")
    nowhere = runner.invoke(app, ["status", case.case_id, "--watch", "--json"])
    assert nowhere.exit_code == 2
    (line,) = nowhere.stdout.splitlines()
    assert json.loads(line)["error"]["code"] == "STORE_NOT_FOUND"
    monkeypatch.setenv("INVESTIGATE_DATABASE_URL", case.store.url)
    import workers.progress as progress

    def interrupted(*_a: Any, **_k: Any) -> dict[str, Any]:
        raise KeyboardInterrupt

    monkeypatch.setattr(progress, "watch_json", interrupted)
    monkeypatch.setattr(progress, "watch", interrupted)
    for args in (["--watch", "--json"], ["--watch"]):
        stopped = runner.invoke(app, ["status", case.case_id, *args])
        assert stopped.exit_code == 130, stopped.output


def test_the_api_answers_bad_arguments_and_stores_with_codes(tmp_path: Path) -> None:
    """A hostile-input trial got SQLAlchemy's, psycopg's, kombu's and Python's own
    exceptions where the CLI gives a code."""
    from workers.upstream import register, send_dispatch, status

    package = casekit.build_tiny_package(tmp_path / "pkg").read_bytes()
    text_file = tmp_path / "notes.txt"
    text_file.write_text("not a database\n" * 100)
    cases: list[tuple[Any, str]] = [
        (lambda: status(["case-x"]), "CASE_ID_INVALID"),  # type: ignore[arg-type]
        (lambda: status("case\x00"), "CASE_ID_INVALID"),
        (lambda: status("a" * 10**6), "CASE_ID_INVALID"),
        (lambda: status("case-x", settings="x"), "ARGUMENT_INVALID"),  # type: ignore[arg-type]
        (lambda: register(package, casekit.INTERPRETATION, casekit.HYPOTHESES,
                          config="x"), "ARGUMENT_INVALID"),  # type: ignore[arg-type]
        (lambda: register(package, casekit.INTERPRETATION,
                          [{"id": 10**5000, "statement": "s"}],
                          settings=_settings(tmp_path), create_store=True),
         "CASE_HYPOTHESES_INVALID"),
        # A file SQLite cannot read is damaged or foreign, as register says (it was
        # STORE_NOT_FOUND, "no case was ever added there": a hostile trial).
        (lambda: status("case-x", settings=_settings(
            tmp_path, database_url=f"sqlite:///{text_file}")), "STORE_UNAVAILABLE"),
        (lambda: register(package, casekit.INTERPRETATION, casekit.HYPOTHESES,
                          settings=_settings(tmp_path, database_url=f"sqlite:///{text_file}")),
         "STORE_UNAVAILABLE"),
        (lambda: status("case-x", settings=_settings(tmp_path, database_url="not a url")),
         "STORE_URL_INVALID"),
        (lambda: register(package, casekit.INTERPRETATION, casekit.HYPOTHESES,
                          settings=_settings(tmp_path, database_url="mysql://u@h/db")),
         "STORE_URL_INVALID"),
        (lambda: status("case-x", settings=_settings(
            tmp_path, database_url="postgresql+psycopg://postgres@127.0.0.1:1/none")),
         "STORE_UNAVAILABLE"),
    ]
    for call, code in cases:
        with pytest.raises(InvestigationError) as err:
            call()
        assert err.value.code == code, (code, err.value)
        assert "\x00" not in err.value.message and len(err.value.message) < 2000
    assert text_file.read_text() == "not a database\n" * 100  # untouched
    case = make_case(tmp_path / "case")
    http = Settings(home=tmp_path / "h", database_url=case.store.url,
                    broker_url="http://127.0.0.1:1/")
    with pytest.raises(InvestigationError) as err:
        send_dispatch(case.case_id, settings=http)
    assert err.value.code == "BROKER_URL_INVALID"
    no_port = Settings(home=tmp_path / "h", database_url=case.store.url,
                       broker_url="redis://127.0.0.1:notaport/0")
    with pytest.raises(InvestigationError) as err:
        send_dispatch(case.case_id, settings=no_port)
    assert err.value.code == "BROKER_URL_INVALID"
    for flags in ({"create_store": "no"}, {"paused": 0}):
        with pytest.raises(InvestigationError) as err:
            register(package, casekit.INTERPRETATION, casekit.HYPOTHESES,
                     settings=_settings(tmp_path / "flags"), **flags)  # type: ignore[arg-type]
        assert err.value.code == "ARGUMENT_INVALID"
    assert not (tmp_path / "flags").exists()


def test_register_leaves_an_empty_or_foreign_file_as_it_was(tmp_path: Path) -> None:
    """A zero-byte file became a store without create_store, and a foreign SQLite file
    was switched to WAL before it was refused as "nothing was created" (a re-trial)."""
    import hashlib
    import sqlite3

    from workers.upstream import register

    package = casekit.build_tiny_package(tmp_path / "pkg").read_bytes()
    empty = tmp_path / "empty.db"
    empty.touch()
    with pytest.raises(InvestigationError) as err:
        register(package, casekit.INTERPRETATION, casekit.HYPOTHESES,
                 settings=_settings(tmp_path, database_url=f"sqlite:///{empty}"))
    assert err.value.code == "STORE_NOT_FOUND" and empty.stat().st_size == 0
    foreign = tmp_path / "app.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    conn.commit()
    conn.close()
    before = hashlib.sha256(foreign.read_bytes()).hexdigest()
    with pytest.raises(InvestigationError) as err:
        register(package, casekit.INTERPRETATION, casekit.HYPOTHESES,
                 settings=_settings(tmp_path, database_url=f"sqlite:///{foreign}"))
    assert err.value.code == "STORE_FOREIGN" and "nothing was changed" in err.value.message
    assert hashlib.sha256(foreign.read_bytes()).hexdigest() == before
    assert not (tmp_path / "app.db-wal").exists()
