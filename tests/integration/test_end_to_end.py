"""A whole investigation on the embedded runtime, as a user runs it: `case build`,
`case add`, `run --providers FILE`, `status`, `summary`, `export` through the CLI."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from investigation.config import InvestigationConfig
from investigation.constants import COMPLETED
from investigation.loop.checkpoints import verify_chain
from investigation.loop.investigator import Investigator
from investigation.operations import summary_bytes
from tests import casekit
from tests.casekit import make_case
from workers.cli import app


@pytest.fixture
def cli_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("INVESTIGATE_HOME", str(home))
    monkeypatch.delenv("INVESTIGATE_DATABASE_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    return home


def test_user_flow_through_the_cli(tmp_path: Path, cli_env: Path) -> None:
    runner = CliRunner()
    root = tmp_path / "work"
    root.mkdir()
    casekit.build_tiny_package(root)  # writes src/, report.md, shop.sqlite, logs/
    built = runner.invoke(app, ["case", "build", "--source", str(root / "src"), "--report",
                                str(root / "report.md"), "--db", str(root / "shop.sqlite"),
                                "--logs", str(root / "logs"), "-o", str(tmp_path / "p.zip")])
    assert built.exit_code == 0, built.output
    (tmp_path / "i.json").write_text(json.dumps(casekit.INTERPRETATION))
    (tmp_path / "h.json").write_text(json.dumps(casekit.HYPOTHESES))
    added = runner.invoke(app, ["case", "add", str(tmp_path / "p.zip"), "--interpretation",
                                str(tmp_path / "i.json"), "--hypotheses", str(tmp_path / "h.json")])
    assert added.exit_code == 0, added.output
    case_id = added.stdout.strip()
    assert case_id.startswith("case-")
    (tmp_path / "replies.jsonl").write_text(
        "\n".join(json.dumps(r) for r in casekit.HAPPY_REPLIES) + "\n")
    (tmp_path / "providers.toml").write_text(
        '[[providers]]\nname = "replay"\nkind = "scripted"\npath = "replies.jsonl"\n')
    ran = runner.invoke(app, ["run", case_id, "--providers", str(tmp_path / "providers.toml")])
    assert ran.exit_code == 0, ran.output
    assert "COMPLETED" in ran.output
    package_id = built.output.split()[1]
    # the step's source.search built the package's shared text index under the home
    assert [p.name for p in (cli_env / "text-index").glob("*.idx")] == \
        [f"{package_id}.v1.idx"]
    summary_line = next(line for line in ran.output.splitlines() if line.startswith("summary:"))
    summary_path = Path(summary_line.split(":", 1)[1].strip())
    text = summary_path.read_text()
    assert "return total - total * percent / 10" in text  # the snapshot's real line
    # run writes the summary, not the whole artifact tree (46 MB for a 415-step case)
    assert summary_path == (cli_env / "summaries" / case_id / "summary.md").resolve()
    assert not (cli_env / "exports").exists()
    st = runner.invoke(app, ["status", case_id, "--json"])
    info = json.loads(st.output)
    assert info["state"] == "BUILDING_DIAGNOSIS"
    assert info["evidence_count"] == 3
    # What the records amount to, in status and in run's last lines (a real model's run
    # of duplicate listings, each scored 0, ended COMPLETED and read as a success).
    figures = info["evidence"]
    assert (figures["records"], figures["duplicate"]) == (3, 0)
    assert figures["assessed"] >= 1 and figures["score_lowest"] is not None
    line = next(x for x in ran.output.splitlines() if x.startswith("evidence records "))
    assert line == (f"evidence records 3: {3 - figures['no_new_item']} found new items, "
                    f"{figures['no_new_item']} found nothing new; assessment scores "
                    f"{figures['assessed']} assessed: lowest "
                    f"{figures['score_lowest']}, median {figures['score_median']}, highest "
                    f"{figures['score_highest']}")
    shown = runner.invoke(app, ["status", case_id], terminal_width=250)
    assert line in shown.output
    assert [a["status"] for a in info["accounts"]] == ["investigation_finished", "rejected"]
    printed = runner.invoke(app, ["summary", case_id])
    assert printed.output == text
    exported = runner.invoke(app, ["export", case_id, str(tmp_path / "export")])
    assert exported.exit_code == 0
    manifest = json.loads((tmp_path / "export" / "manifest.json").read_text())
    assert manifest["artifacts"]["investigation_summary"]["path"] == \
        "analysis/investigation/summary.md"
    again = runner.invoke(app, ["run", case_id, "--providers", str(tmp_path / "providers.toml")])
    assert again.exit_code == 0 and "COMPLETED" in again.output


def test_bad_inputs_change_nothing(tmp_path: Path, cli_env: Path) -> None:
    runner = CliRunner()
    (tmp_path / "bad.zip").write_bytes(b"PK\x03\x04 not really a zip")
    (tmp_path / "i.json").write_text("{}")
    (tmp_path / "h.json").write_text("[]")
    res = runner.invoke(app, ["case", "add", str(tmp_path / "bad.zip"), "--interpretation",
                              str(tmp_path / "i.json"), "--hypotheses", str(tmp_path / "h.json")])
    assert res.exit_code == 2
    assert "CASE_INTERPRETATION_INVALID" in res.output
    res = runner.invoke(app, ["status", "case-nope"])
    assert res.exit_code == 2 and "CASE_NOT_FOUND" in res.output
    (tmp_path / "broken.toml").write_text("[[providers]]\nname = 1\n")
    res = runner.invoke(app, ["run", "case-nope", "--providers", str(tmp_path / "broken.toml")])
    assert res.exit_code == 2 and "CONFIG_INVALID" in res.output


def test_replay_is_deterministic_and_chain_verifies(tmp_path: Path) -> None:
    first = make_case(tmp_path / "a")
    second = make_case(tmp_path / "b")
    for case in (first, second):
        assert case.investigator().run(case.case_id, max_steps=50).outcome == COMPLETED
        with case.store.session() as s:
            assert verify_chain(s, case.case_id) == 5
    assert summary_bytes(first.store, first.case_id) == summary_bytes(second.store,
                                                                      second.case_id)


def test_policy_is_frozen_per_revision(tmp_path: Path) -> None:
    case = make_case(tmp_path / "c")
    case.investigator().step(case.case_id)
    changed = InvestigationConfig.model_validate({"budget": {"credit_units": 99}})
    from investigation.errors import InvestigationError
    from investigation.loop.investigator import Investigator

    with pytest.raises(InvestigationError) as err:
        Investigator(case.env(changed, explicit=True)).step(case.case_id)
    assert err.value.code == "POLICY_CHANGED"
    # Without an explicit config the stored policy is adopted and the run completes.
    out = Investigator(case.env(changed, explicit=False)).run(case.case_id, max_steps=50)
    assert out.outcome == COMPLETED


def _policy_reads(case: casekit.Case, stages: object, key: object,
                  names: tuple[str, ...]) -> dict[str, int]:
    """Run ``names`` of step ``key`` on ``stages``; statements reading the policy, by stage."""
    from sqlalchemy import event

    reads = dict.fromkeys(names, 0)
    current = {"stage": ""}

    def statement(_conn: object, _cursor: object, text: str, *_: object) -> None:
        if "policy_json" in text and "FROM revision" in text:
            reads[current["stage"]] += 1

    event.listen(case.store.engine, "before_cursor_execute", statement)
    try:
        for name in names:
            current["stage"] = name
            stages.run(name, key)  # type: ignore[attr-defined]
    finally:
        event.remove(case.store.engine, "before_cursor_execute", statement)
    return reads


def test_stages_after_build_context_take_the_frozen_policy_from_their_process(
        tmp_path: Path) -> None:
    """Decision 127: after its process ran build_context, a stage reads no policy; a process
    that meets the step later reads and checks it once."""
    from investigation.loop.stages import Stages

    case = make_case(tmp_path / "p")
    case.investigator().step(case.case_id)  # step 1 froze the policy
    key = Investigator(case.env()).next_step(case.case_id)
    stages = Stages(case.env())
    reads = _policy_reads(case, stages, key, ("build_context", "llm_call", "validate",
                                              "persist_plan", "settle_reserve"))
    assert reads["build_context"] >= 1  # the replay checks the stored policy's hash
    assert reads["validate"] == reads["settle_reserve"] == 0, reads
    later = _policy_reads(case, Stages(case.env()), key, ("execute_tool", "record_evidence",
                                                          "publish"))
    assert later["publish"] >= 1, later  # a new process: read and checked


def test_provider_blocking_and_resume_with_retry_id(tmp_path: Path) -> None:
    from investigation.constants import BLOCKED
    from investigation.operations import resume

    case = make_case(tmp_path / "d", replies=casekit.HAPPY_REPLIES[:2])
    outcome = case.investigator().run(case.case_id, max_steps=50)
    assert outcome.outcome == BLOCKED and outcome.reason == "PROVIDER_CONFIGURATION"
    # The operator supplies the missing replies, then resumes with a new retry id.
    case.replies_path.write_text(
        "\n".join(json.dumps(r) for r in casekit.HAPPY_REPLIES) + "\n")
    with pytest.raises(Exception) as err:
        resume(case.store, case.case_id)
    assert getattr(err.value, "code", None) == "RETRY_ID_REQUIRED"
    resume(case.store, case.case_id, retry_id="fix-1")
    assert case.investigator().run(case.case_id, max_steps=50).outcome == COMPLETED
    assert os.path.exists(case.replies_path)


def test_exhausted_account_gets_a_closing_turn(tmp_path: Path) -> None:
    """With credit for one action only, the next turn may only close the account: even a
    full refund of the pending result (below its cost) cannot pay for another action."""
    from investigation.constants import ARTIFACT_CONTEXT, OPERATIONS
    from investigation.store import Store

    config = InvestigationConfig.model_validate(
        {"budget": {"credit_units": 4, "costs": dict.fromkeys(OPERATIONS, 4)}})
    replies = [
        casekit.q("db.query", {"sql": "SELECT id FROM orders"}),
        casekit.q("db.query", {"sql": "SELECT id FROM orders"}),
        casekit.finish("weak", (10, ["E1"]), ["E1"]),
        casekit.finish("weak", (10, ["E2"]), ["E2"]),
    ]
    case = make_case(tmp_path / "e", replies=replies)
    from investigation.loop.investigator import Investigator

    inv = Investigator(case.env(config, explicit=True))
    assert inv.run(case.case_id, max_steps=10).outcome == COMPLETED
    with case.store.session() as s:
        ctx = json.loads(Store.get_artifact(s, case.case_id,
                                            ARTIFACT_CONTEXT.format(seq=3)).data)
    assert ctx["closing_reason"] == "budget_exhausted"
    assert ctx["allowed_actions"] == ["finish", "reject"]


def test_closing_turn_reason_is_kept_in_the_disposition(tmp_path: Path) -> None:
    from investigation.config import LoopConfig
    from investigation.operations import status

    config = InvestigationConfig(loop=LoopConfig(max_iterations_per_hypothesis=1))
    replies = [
        casekit.q("db.query", {"sql": "SELECT id FROM orders"}),
        casekit.q("db.tables", {}),
        casekit.finish("weak", (50, ["E1"]), ["E1"], reason="cap reached"),
        casekit.finish("weak", (50, ["E2"]), ["E2"], reason="cap reached", action="reject"),
    ]
    case = make_case(tmp_path / "cap", replies=replies)
    from investigation.loop.investigator import Investigator

    assert Investigator(case.env(config, explicit=True)).run(case.case_id).outcome == COMPLETED
    summary = summary_bytes(case.store, case.case_id).decode()
    assert "investigation_finished (iteration_cap: cap reached)" in summary
    assert "rejected (iteration_cap: cap reached)" in summary
    assert [a["status"] for a in status(case.store, case.case_id)["accounts"]] == \
        ["investigation_finished", "rejected"]


def test_operator_errors_are_codes_not_tracebacks(tmp_path: Path, cli_env: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    case = make_case(tmp_path / "ops")
    monkeypatch.setenv("INVESTIGATE_DATABASE_URL", case.store.url)
    res = runner.invoke(app, ["run", "../../../escape"])
    assert res.exit_code == 2 and "CASE_NOT_FOUND" in res.output
    assert not list(tmp_path.rglob("escape.lock"))
    (tmp_path / "a-file").write_text("x")
    res = runner.invoke(app, ["export", case.case_id, str(tmp_path / "a-file" / "sub")])
    assert res.exit_code == 2 and "IO_ERROR" in res.output
    monkeypatch.setenv("INVESTIGATE_BROKER_URL", "redis://127.0.0.1:1/0")
    res = runner.invoke(app, ["dispatch", case.case_id])
    assert res.exit_code == 2 and "REDIS_UNAVAILABLE" in res.output
    # recover with no case pending said "recovered 0 case(s)", exit 0 (a fleet trial).
    with case.store.session() as s:  # nothing pending: the case is cancelled
        from investigation.store.models import CaseRecord

        row = s.get(CaseRecord, case.case_id)
        assert row is not None
        row.state = "CANCELLED"
        s.add(row)
        s.commit()
    res = runner.invoke(app, ["recover"])
    assert res.exit_code == 2 and "REDIS_UNAVAILABLE" in res.output, res.output
    # The library's message ends before the advice: "Connection refused.; check" read odd.
    assert ".;" not in res.output and "Connection refused; check" in res.output, res.output
    monkeypatch.setenv("INVESTIGATE_REDIS_URL", "redis://127.0.0.1:6379/0")
    res = runner.invoke(app, ["recover"])
    assert res.exit_code == 2 and "BROKER_UNAVAILABLE" in res.output, res.output
    monkeypatch.delenv("INVESTIGATE_REDIS_URL")
    monkeypatch.setenv("INVESTIGATE_DATABASE_URL", "postgresql+psycopg://x@127.0.0.1:1/x")
    res = runner.invoke(app, ["status", case.case_id])
    assert res.exit_code == 2 and "STORE_UNAVAILABLE" in res.output


@pytest.mark.redis
def test_a_broker_that_never_answers_is_unavailable_not_a_hang(
        tmp_path: Path, cli_env: Path, redis_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A broker that takes the TCP connection and never answers held `health` and
    `dispatch` forever, `dispatch` with the case's lock (a hostile trial): each read is
    bounded now, then BROKER_UNAVAILABLE (health: FAIL), and the lock is let go."""
    import socket
    import threading

    import redis

    from workers import celery_app

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    taken: list[socket.socket] = []

    def take_and_stay_silent() -> None:
        while True:
            try:
                taken.append(silent.accept()[0])
            except OSError:  # the listener was shut down at the test's end
                return

    accepter = threading.Thread(target=take_and_stay_silent, daemon=True)
    accepter.start()
    case = make_case(tmp_path / "silent")
    monkeypatch.setattr(celery_app, "SHELL_BROKER_TIMEOUT_S", 1.0)
    monkeypatch.setenv("INVESTIGATE_DATABASE_URL", case.store.url)
    monkeypatch.setenv("INVESTIGATE_BROKER_URL",
                       f"redis://127.0.0.1:{silent.getsockname()[1]}/0")
    monkeypatch.setenv("INVESTIGATE_REDIS_URL", redis_url)
    runner = CliRunner()
    try:
        health = runner.invoke(app, ["health", "--check", "broker"])
        assert health.exit_code == 1 and "FAIL broker" in health.output, health.output
        sent = runner.invoke(app, ["dispatch", case.case_id])
        assert sent.exit_code == 2 and "BROKER_UNAVAILABLE" in sent.output, sent.output
        assert redis.Redis.from_url(redis_url).exists(
            f"investigation:lock:{case.case_id}") == 0
    finally:
        from workers import runtime

        runtime.configure(None)
        silent.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        accepter.join(timeout=5)
        silent.close()
        for conn in taken:
            conn.close()
        assert not accepter.is_alive()


def test_a_retry_id_is_never_reused(tmp_path: Path) -> None:
    from investigation.errors import InvestigationError
    from investigation.operations import resume

    case = make_case(tmp_path / "r", replies=[])
    assert case.investigator().step(case.case_id).reason == "PROVIDER_CONFIGURATION"
    resume(case.store, case.case_id, retry_id="one")
    assert case.investigator().step(case.case_id).reason == "PROVIDER_CONFIGURATION"
    resume(case.store, case.case_id, retry_id="two")
    assert case.investigator().step(case.case_id).reason == "PROVIDER_CONFIGURATION"
    with pytest.raises(InvestigationError) as err:
        resume(case.store, case.case_id, retry_id="one")
    assert err.value.code == "RETRY_ID_REUSED"


def test_rejections_are_reported_in_the_summary_and_status(tmp_path: Path) -> None:
    from investigation.operations import status

    bad = dict(casekit.HAPPY_REPLIES[0])
    bad["next"] = {"action": "query", "operation": "source.serach", "arguments": {}}
    case = make_case(tmp_path / "rj", replies=[bad, *casekit.HAPPY_REPLIES])
    first = case.investigator().step(case.case_id)
    assert first.details["rejection"] == "UNKNOWN_OPERATION"
    assert "source.search" in first.details["message"]  # the valid names are listed
    assert status(case.store, case.case_id)["accounts"][0]["last_rejection"]["code"] == \
        "UNKNOWN_OPERATION"
    assert case.investigator().run(case.case_id, max_steps=20).outcome == COMPLETED
    summary = summary_bytes(case.store, case.case_id).decode()
    assert "- Rejected replies: 1 (step 1 UNKNOWN_OPERATION)" in summary  # the step finds it


def test_dispatch_of_a_finished_case_enqueues_nothing(tmp_path: Path, cli_env: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case(tmp_path / "done")
    assert case.investigator().run(case.case_id, max_steps=20).outcome == COMPLETED
    monkeypatch.setenv("INVESTIGATE_DATABASE_URL", case.store.url)
    from tests.conftest import SUITE_REDIS_URL, need_service, redis_db, with_db

    # Database 12 (TEST_DISPATCH_BROKER_DB; under xdist, its worker's own) is this test's
    # alone (test-dist uses 13, the suite 0, the benches 6): it is emptied first so keys
    # another run left cannot pass for (or hide) an enqueued message.
    broker = with_db(SUITE_REDIS_URL,
                     redis_db(int(os.environ.get("TEST_DISPATCH_BROKER_DB", "12"))))
    monkeypatch.setenv("INVESTIGATE_BROKER_URL", broker)

    need_service("redis", "127.0.0.1", 6379)
    import redis

    client = redis.Redis.from_url(broker)
    client.flushdb()
    res = CliRunner().invoke(app, ["dispatch", case.case_id])
    assert res.exit_code == 0 and "nothing to dispatch" in res.output
    assert client.dbsize() == 0, sorted(client.keys())
    # Held cases are named by their state, not "BLOCKED (CANCELLED)" (a fleet trial read
    # the exit 1 as a block to fix): cancelled is over (0), paused waits for resume (1).
    for command, state, code in (("pause", "PAUSED", 1), ("cancel", "CANCELLED", 0)):
        held = make_case(tmp_path / state, database_url=case.store.url,
                         interpretation={"summary": f"held {state}"})
        assert CliRunner().invoke(app, [command, held.case_id]).exit_code == 0
        res = CliRunner().invoke(app, ["dispatch", held.case_id])
        assert res.exit_code == code, res.output
        assert f"case {held.case_id}: {state}; nothing to dispatch" in res.output, res.output
        assert "BLOCKED" not in res.output, res.output
        held.store.dispose()
    assert client.dbsize() == 0, sorted(client.keys())


def test_read_only_commands_leave_foreign_databases_alone(tmp_path: Path, cli_env: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    import sqlite3

    for name, statements in (
        ("plain.db", ["CREATE TABLE mine (x)"]),
        ("alembic.db", ["CREATE TABLE alembic_version (version_num VARCHAR(32))",
                        "INSERT INTO alembic_version VALUES ('f00dface1234')"]),
        ("empty_alembic.db", ["CREATE TABLE alembic_version (version_num VARCHAR(32))"]),
    ):
        foreign = tmp_path / name
        conn = sqlite3.connect(foreign)
        for sql in statements:
            conn.execute(sql)
        conn.commit()
        conn.close()
        before = foreign.read_bytes()
        monkeypatch.setenv("INVESTIGATE_DATABASE_URL", f"sqlite:///{foreign}")
        for args in (["status", "case-x"], ["summary", "case-x"], ["resume", "case-x"],
                     ["export", "case-x", str(tmp_path / "out")], ["run", "case-x"]):
            res = CliRunner().invoke(app, args)
            assert res.exit_code == 2 and "STORE_NOT_FOUND" in res.output, (name, args)
        assert foreign.read_bytes() == before, name
    # A store cut short, or a file that is no SQLite database, is damaged, not "a store no
    # case was ever added to" (a hostile trial's truncated store read as never used).
    whole = make_case(tmp_path / "whole")
    whole.store.dispose()
    stored = Path(whole.store.engine.url.database or "")
    for name, data in (("cut.db", stored.read_bytes()[:8192]), ("garbage.db", b"garbage")):
        broken = tmp_path / name
        broken.write_bytes(data)
        monkeypatch.setenv("INVESTIGATE_DATABASE_URL", f"sqlite:///{broken}")
        for args in (["status", whole.case_id], ["cases"], ["verify", whole.case_id]):
            res = CliRunner().invoke(app, args)
            flat = " ".join(res.output.split())
            assert res.exit_code == 2 and "STORE_UNAVAILABLE" in flat, (name, args, flat)
            assert "a damaged or foreign file, not an empty store" in flat, flat
        assert broken.read_bytes() == data, name


def test_a_case_or_store_not_found_says_where_it_looked_and_where_the_demo_is(
        tmp_path: Path, cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The help examples name the demo's case; after `investigate demo` a new user ran one
    against the default store and got STORE_NOT_FOUND naming only that store, and a case
    id unknown to a store got 'no case X' alone (a new user's trial)."""
    from investigation.store.engine import Store

    demo_store = cli_env / "demo" / "investigation.db"
    demo_store.parent.mkdir(parents=True)
    store = Store(f"sqlite:///{demo_store}")
    store.create_schema()
    store.dispose()
    res = CliRunner().invoke(app, ["status", "case-30bce92d9fa25a72"])
    flat = " ".join(res.output.split())
    assert res.exit_code == 2 and "STORE_NOT_FOUND" in flat, flat
    assert "prefix the command with INVESTIGATE_HOME=home/demo" in flat
    monkeypatch.setenv("INVESTIGATE_HOME", str(cli_env / "demo"))
    res = CliRunner().invoke(app, ["summary", "case-nope"])
    flat = " ".join(res.output.split())
    assert res.exit_code == 2 and "CASE_NOT_FOUND: no case case-nope in sqlite:///" in flat
    assert "`investigate cases` lists the cases there" in flat and "demo" in flat
    assert "prefix the command" not in flat  # this is the demo's store


def test_json_commands_print_their_errors_as_json_on_stdout(
        tmp_path: Path, cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that parses `--json` output got nothing on stdout and the code only in a
    text line on stderr; the text line stays for people."""
    import json

    from investigation.store.engine import Store

    store = Store(f"sqlite:///{cli_env / 'investigation.db'}")
    store.create_schema()
    store.dispose()
    for args in (["status", "case-nope", "--json"], ["cases", "--json", "--state", "nope"],
                 ["run", "case-nope", "--json"], ["tests", "list", "case-nope", "--json"]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        body = json.loads(res.stdout)["error"]
        assert body["exit_code"] == 2 and body["code"] in res.stderr, (args, res.stderr)
        assert body["message"] and body["code"].isupper(), body
    assert json.loads(CliRunner().invoke(app, ["status", "case-nope", "--json"]).stdout)[
        "error"]["code"] == "CASE_NOT_FOUND"
    plain = CliRunner().invoke(app, ["status", "case-nope"])
    assert plain.exit_code == 2 and plain.stdout == "" and "CASE_NOT_FOUND" in plain.stderr


def test_a_usage_error_of_a_json_command_is_json_on_stdout_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """An unknown option or a missing value printed only Click's usage box on stderr, so
    a caller parsing `--json` output got nothing (a trial's finding). The entry point's
    wrapper (``workers.cli._invoke``) is run in process, then the installed command once."""
    import subprocess
    import sys

    import typer

    from workers.cli import _invoke

    for key in [k for k in os.environ if k.startswith("INVESTIGATE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("INVESTIGATE_HOME", str(tmp_path / "home"))
    command = typer.main.get_command(app)

    def run(*args: str) -> tuple[int, str, str]:
        code = _invoke(command, list(args))
        out, err = capfd.readouterr()
        return code, out, err

    for args, message in ((["status", "case-nope", "--json", "--nope"],
                           "No such option: --nope"),
                          (["cases", "--json", "--state"],
                           "Option '--state' requires an argument."),
                          (["status", "--json"], "Missing argument 'CASE'."),
                          (["status", "case-nope", "--json=yes"],
                           "Option '--json' does not take a value.")):
        code, out, err = run(*args)
        assert code == 2, (args, err)
        assert json.loads(out) == {"error": {
            "code": "USAGE_INVALID", "exit_code": 2, "message": message}}, out
        assert message in err, err  # Typer's box, as without --json
    code, out, err = run("status", "case-nope", "--nope")  # no --json: the box alone
    assert (code, out) == (2, "") and "No such option: --nope" in err, err
    code, out, _ = run("status", "case-nope", "--", "--json")  # an argument, not the flag
    assert (code, out) == (2, ""), out
    # What is not a usage error keeps its code: help, --version and a controlled error.
    assert run("--help")[0] == 0 and run("--version")[0] == 0
    assert run()[0] == 2  # no command: the help, as before
    code, out, _ = run("status", "case-nope", "--json")
    assert code == 2 and json.loads(out)["error"]["code"] == "STORE_NOT_FOUND", out

    # An unexpected exception is a bug: exit 5 and INTERNAL_ERROR after the traceback,
    # never exit 1, which says "blocked" (a manifest's KeyError did, a hostile trial).
    import workers.cli

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("logs_root")

    monkeypatch.setattr(workers.cli, "_store", broken)
    code, out, err = run("status", "case-nope", "--json")
    assert code == 5 and json.loads(out)["error"] == {
        "code": "INTERNAL_ERROR", "exit_code": 5,
        "message": "unexpected KeyError: 'logs_root'; this is a bug of the engine (the "
                   "traceback above says where)"}, out
    assert "Traceback" in err and "INTERNAL_ERROR: unexpected KeyError" in err, err
    # A ValueError the engine's own code raised is a bug too, not CONFIG_INVALID "check the
    # INVESTIGATE_* settings" (a hostile trial's manifest number escaped so); a library's
    # stays a settings error.
    from investigation.cases import layout

    monkeypatch.setattr(workers.cli, "_store",
                        lambda *a, **k: layout.strict_json_loads("[NaN]"))
    code, out, err = run("status", "case-nope", "--json")
    assert code == 5 and json.loads(out)["error"]["code"] == "INTERNAL_ERROR", out

    def library(*args: object, **kwargs: object) -> None:
        from urllib.parse import urlsplit

        urlsplit("redis://[::1:6379/0")  # ValueError: Invalid IPv6 URL

    monkeypatch.setattr(workers.cli, "_store", library)
    code, out, err = run("status", "case-nope", "--json")
    assert code == 2 and json.loads(out)["error"]["code"] == "CONFIG_INVALID", out
    monkeypatch.undo()

    ran = subprocess.run([str(Path(sys.executable).with_name("investigate")), "cases",
                          "--json", "--state"], capture_output=True, text=True,
                         env=dict(os.environ), timeout=60)
    assert ran.returncode == 2 and json.loads(ran.stdout)["error"]["code"] == \
        "USAGE_INVALID", (ran.stdout, ran.stderr)


def test_export_refuses_a_non_empty_target(tmp_path: Path) -> None:
    from investigation.errors import InvestigationError
    from investigation.operations import export

    case = make_case(tmp_path / "x")
    case.investigator().run(case.case_id, max_steps=20)
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(InvestigationError) as err:
        export(case.store, case.case_id, target)
    assert err.value.code == "EXPORT_TARGET_NOT_EMPTY"
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    for name, said in (("link", "is a symbolic link"), ("file", "is not an empty directory")):
        with pytest.raises(InvestigationError) as err:
            export(case.store, case.case_id, tmp_path / name)
        assert err.value.code == "EXPORT_TARGET_NOT_EMPTY" and said in err.value.message
    assert list((tmp_path / "empty").iterdir()) == []
    assert len(export(case.store, case.case_id, tmp_path / "fresh")) > 10


@pytest.mark.parametrize(("name", "value", "shown"), [
    ("INVESTIGATE_FEEDBACK_KEY", "supersecretvalue-31-chars-abcde",
     "FEEDBACK_KEY: Value should have at least 32 characters"),
    ("INVESTIGATE_REDIS_URL", "redis://127.0.0.1:6379/abc", "must be a number"),
    # (An empty INVESTIGATE_QUEUE is unset now, the default queue: tests/unit/test_settings.)
    ("INVESTIGATE_LOCK_TTL_S", "1", "LOCK_TTL_S"),
])
def test_broken_settings_are_one_line_and_never_echo_values(
        cli_env: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str,
        shown: str) -> None:
    monkeypatch.setenv(name, value)
    res = CliRunner().invoke(app, ["status", "case-x"])
    assert res.exit_code == 2
    assert "CONFIG_INVALID" in res.output and shown in res.output
    assert "supersecret" not in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("command", [["worker"], ["flower"], ["dispatch", "case-x"],
                                     ["recover"]])
def test_worker_and_flower_report_broken_settings_without_the_value(
        cli_env: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]) -> None:
    monkeypatch.setenv("INVESTIGATE_FEEDBACK_KEY", "SECRETSECRETSECRETSECRETSECRET1")
    res = CliRunner().invoke(app, command)
    assert res.exit_code == 2, res.output
    assert "CONFIG_INVALID" in res.output and "SECRET" not in res.output


def test_a_worker_that_could_not_run_a_stage_is_refused_before_it_joins_the_queue(
        tmp_path: Path, cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker with a broken policy file, or a store at no schema with auto-migration off,
    started, answered ping and failed the first stage of every case it took (a fleet
    trial): `investigate worker` now builds what its children will and refuses first."""
    from unittest import mock

    monkeypatch.setenv("INVESTIGATE_BROKER_URL", "redis://127.0.0.1:6379/13")
    monkeypatch.setenv("INVESTIGATE_QUEUE", "refused-worker-test")
    broken = tmp_path / "broken.toml"
    broken.write_text("[budget.costs]\n\"db.query\" = 0\n")
    with mock.patch("workers.celery_app.app.worker_main") as worker_main:
        monkeypatch.setenv("INVESTIGATE_CONFIG", str(broken))
        res = CliRunner().invoke(app, ["worker"])
        assert res.exit_code == 2 and "CONFIG_INVALID" in res.output, res.output
        monkeypatch.delenv("INVESTIGATE_CONFIG")
        monkeypatch.setenv("INVESTIGATE_AUTO_MIGRATE", "false")
        res = CliRunner().invoke(app, ["worker"])
        assert res.exit_code == 2 and "STORE_NOT_MIGRATED" in res.output, res.output
        assert not worker_main.called
        assert not (cli_env / "investigation.db").exists()  # nothing left behind
        monkeypatch.delenv("INVESTIGATE_AUTO_MIGRATE")
        # A lock Redis nothing answers at: refused (it failed every stage it took while
        # the cases stayed held for their lease, a fleet trial).
        monkeypatch.setenv("INVESTIGATE_REDIS_URL", "redis://127.0.0.1:1/13")
        res = CliRunner().invoke(app, ["worker"])
        assert res.exit_code == 2 and "REDIS_UNAVAILABLE" in res.output, res.output
        assert not worker_main.called
        # A worker logging JSON says so in a JSON line: the one plain line of its output
        # was the error that stopped it (a hostile trial).
        monkeypatch.setenv("INVESTIGATE_LOG_FORMAT", "json")
        exe = str(Path(sys.executable).with_name("investigate"))
        ran = subprocess.run([exe, "worker"], capture_output=True, text=True, timeout=120)
        lines = [json.loads(line) for line in ran.stderr.splitlines()]  # every one JSON
        assert ran.returncode == 2 and lines[-1]["code"] == "REDIS_UNAVAILABLE", ran.stderr
        assert lines[-1]["level"] == "ERROR" and lines[-1]["exit_code"] == 2
        monkeypatch.delenv("INVESTIGATE_LOG_FORMAT")
        monkeypatch.delenv("INVESTIGATE_REDIS_URL")
        # A broker that is not Redis, and no lock Redis named: said so, by its name.
        monkeypatch.setenv("INVESTIGATE_BROKER_URL", "amqp://127.0.0.1:5672//")
        res = CliRunner().invoke(app, ["worker"])
        assert res.exit_code == 2 and "the case locks need a Redis URL" in res.output, \
            res.output
        assert "set INVESTIGATE_REDIS_URL" in " ".join(res.output.split())
        assert not worker_main.called
        monkeypatch.setenv("INVESTIGATE_BROKER_URL", "redis://127.0.0.1:6379/13")
        # A provider's API key variable unset in the worker's environment: every case
        # blocked at its first model call while health said ok (a fleet trial).
        keyed = tmp_path / "keyed.toml"
        keyed.write_text('[[providers]]\nname = "web"\nkind = "openai"\n'
                         'base_url = "http://127.0.0.1:9/v1"\nmodel = "m"\n'
                         'api_key_env = "TEST_WORKER_KEY"\n')
        monkeypatch.setenv("INVESTIGATE_PROVIDERS", str(keyed))
        monkeypatch.delenv("TEST_WORKER_KEY", raising=False)
        res = CliRunner().invoke(app, ["worker"])
        shown = " ".join(res.output.split())
        assert res.exit_code == 2 and "PROVIDER_CREDENTIALS_MISSING" in shown, res.output
        assert "environment variable TEST_WORKER_KEY is not set" in shown, shown
        assert not worker_main.called
        monkeypatch.setenv("TEST_WORKER_KEY", "k-1")
        res = CliRunner().invoke(app, ["worker"])
        assert res.exit_code == 0 and worker_main.called, res.output
        worker_main.reset_mock()
        monkeypatch.delenv("INVESTIGATE_PROVIDERS")
        res = CliRunner().invoke(app, ["worker"])
        assert res.exit_code == 0 and worker_main.called, res.output
        shown = " ".join(res.output.split())
        assert f"store sqlite:///{cli_env.resolve()}" in shown
        assert "case locks redis://127.0.0.1:6379/13" in shown  # the broker's, by default
        # A log line like the others: a time and a level (it was a bare line).
        assert re.search(r"\d\d:\d\d:\d\d\.\d{3}\+00:00 INFO workers\.worker store ", shown)
        # With JSON logs it is a JSON line: a log pipeline reads every line as one.
        monkeypatch.setenv("INVESTIGATE_LOG_FORMAT", "json")
        res = CliRunner().invoke(app, ["worker"])
        assert res.exit_code == 0, res.output
        (record,) = [json.loads(text) for text in res.output.splitlines()
                     if "case locks" in text]
        assert (record["level"], record["locks"]) == ("INFO", "redis://127.0.0.1:6379/13")
        assert record["store"] == f"sqlite:///{cli_env.resolve()}/investigation.db"


def test_workers_keep_a_cases_frozen_policy_when_their_policy_file_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A fleet whose INVESTIGATE_CONFIG is rolled out anew: a case whose revision froze the
    old policy goes on under it (the file is for revisions not yet frozen). A worker
    refused it as POLICY_CHANGED at every dispatch, after its model call, and the case
    stayed INVESTIGATING with nothing to show why (a fleet trial). `run --config` still
    refuses a different policy: there the operator asked for it."""
    from investigation.loop.investigator import Investigator
    from workers import runtime
    from workers.settings import Settings

    case = make_case(tmp_path / "c")
    case.investigator().step(case.case_id)  # freezes the default policy
    policy = tmp_path / "policy.toml"
    policy.write_text("[budget]\ncredit_units = 7\n")
    settings = Settings(home=tmp_path / "home", database_url=case.store.url, config=policy,
                        broker_url="redis://127.0.0.1:6379/13")
    worker_env = runtime.build_env(settings, providers_path=case.providers_path,
                                   adopt_frozen=True)
    assert worker_env.explicit_config is False
    caplog.set_level(logging.INFO, logger="investigation.budget.manager")
    assert Investigator(worker_env).run(case.case_id, max_steps=50).outcome == COMPLETED
    # Said in the log, once per process and frozen policy: a fleet whose workers read
    # different policy files shows it (a fleet trial found the frozen policy was down to
    # chance); INFO, which a worker logs and an embedded run does not print.
    kept = [r for r in caplog.records if "differs from the policy this process was given"
            in r.getMessage()]
    assert len(kept) == 1 and kept[0].levelname == "INFO", kept
    assert f"first met in case {case.case_id} revision 1" in kept[0].getMessage()
    from investigation.operations import status as case_status

    info = case_status(case.store, case.case_id)
    assert all(a["credit_units"] == 60 for a in info["accounts"])  # the frozen credit
    cli_env = runtime.build_env(settings, policy, case.providers_path)
    assert cli_env.explicit_config is True
    monkeypatch.setenv("INVESTIGATE_CONFIG", str(policy))
    from unittest import mock

    with mock.patch("workers.runtime.RedisCaseLock.from_url"), \
            mock.patch("workers.celery_app.configure"):
        assert runtime.distributed(settings).env.explicit_config is False


@pytest.mark.parametrize("command", ["worker", "beat"])
def test_a_log_level_celery_does_not_know_is_a_usage_error(cli_env: Path,
                                                           command: str) -> None:
    """`investigate worker --loglevel NOPE` was an INTERNAL_ERROR with Celery's traceback
    (its own check raised inside the command; a hostile trial)."""
    res = CliRunner().invoke(app, [command, "--loglevel", "NOPE"])
    assert res.exit_code == 2 and "'NOPE': use DEBUG, INFO, WARNING" in res.output, \
        res.output
    assert "Traceback" not in res.output and "INTERNAL_ERROR" not in res.output
