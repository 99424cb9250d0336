"""From a blocked case back to a finished one using only the command line's own words.

Each test blocks a real case on purpose, then runs exactly the commands the output
printed (``$ ...`` lines), changing only the placeholders a person fills in (the reply
file's name); the case must complete. Also: ``status --json``/``--watch``, the live
progress of ``run`` on a terminal and its quiet form elsewhere, and a repeated
``case add``.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from rich.console import Console
from typer.testing import CliRunner, Result

from investigation.store import Store
from tests import casekit
from tests.casekit import Case, make_case, q
from tests.conftest import REDIS_URL, SUITE_REDIS_URL
from workers.cli import app
from workers.settings import Settings

BAD = json.dumps(q("source.search", {"pattern": "x"}, evidence=["E9"]))
HAPPY = [json.dumps(r) for r in casekit.HAPPY_REPLIES]


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Case]:
    case = make_case(tmp_path / "case", replies=[BAD, BAD, BAD])
    monkeypatch.setenv("INVESTIGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("INVESTIGATE_DATABASE_URL", case.store.url)
    monkeypatch.delenv("INVESTIGATE_PROVIDERS", raising=False)
    monkeypatch.delenv("INVESTIGATE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    yield case


def invoke(*args: str) -> Result:
    return CliRunner().invoke(app, list(args))


def commands(output: str) -> list[list[str]]:
    """The ``$ investigate ...`` commands an output tells the user to run."""
    found = []
    for line in output.splitlines():
        text = line.strip()
        if text.startswith("$ investigate "):
            found.append(shlex.split(text[2:])[1:])
    return found


def follow(cmd: list[str], replies: Path) -> Result:
    args = [str(replies) if a == "replies.jsonl" else a for a in cmd]
    return invoke(*args)


def test_three_invalid_replies_then_fix_and_resume(cli: Case) -> None:
    providers = str(cli.providers_path)
    ran = invoke("run", cli.case_id, "--providers", providers)
    assert ran.exit_code == 1, ran.output
    assert f"case {cli.case_id}: BLOCKED (INVALID_LLM_RESPONSES)" in ran.output
    assert "UNKNOWN_EVIDENCE_ID" in ran.output and "next: Blocked" in ran.output
    todo = commands(ran.output)
    assert todo == [["replies", "check", "case/replies.jsonl", cli.case_id],
                    ["resume", cli.case_id],
                    ["run", cli.case_id, "--providers", providers]]
    assert "the next model call (call 4) reads its reply line 4" in " ".join(ran.output.split())
    # The user fixes the file: the three served lines stay, the next call reads line 4.
    cli.replies_path.write_text("\n".join([BAD, BAD, BAD, *HAPPY]) + "\n")
    checked = follow(todo[0], cli.replies_path)
    assert checked.exit_code == 0, checked.output
    assert "after `resume`, call 4 reads reply line 4" in checked.output
    resumed = follow(todo[1], cli.replies_path)
    assert resumed.exit_code == 0, resumed.output
    assert f"resumed {cli.case_id} (was INVALID_LLM_RESPONSES)" in resumed.output
    # The file the case ran with, not a placeholder (a new user's folder had another
    # case's providers.toml: copying the command would have fed it that case's replies).
    assert ["run", cli.case_id, "--providers", "case/providers.toml"] in \
        commands(resumed.output)
    done = follow(todo[2], cli.replies_path)
    assert done.exit_code == 0, done.output
    assert f"case {cli.case_id}: COMPLETED" in done.output
    assert ["summary", cli.case_id] in commands(done.output)
    assert follow(["summary", cli.case_id], cli.replies_path).exit_code == 0


def test_script_runs_out_then_resume_with_the_printed_retry_id(cli: Case) -> None:
    cli.replies_path.write_text("\n".join(HAPPY[:2]) + "\n")
    providers = str(cli.providers_path)
    ran = invoke("run", cli.case_id, "--providers", providers)
    assert ran.exit_code == 1, ran.output
    assert "BLOCKED (PROVIDER_CONFIGURATION)" in ran.output
    assert "PROVIDER_SCRIPT_EXHAUSTED" in ran.output and "reads its reply line 3" in " ".join(ran.output.split())
    assert ran.output.count("line 3") == 1, ran.output  # said once, not in two steps
    # A file that ran out is no refusal (a fleet trial read "refused ... as configured").
    assert "Blocked: the scripted reply file has no reply for this call" in \
        " ".join(ran.output.split()) and "refused" not in ran.output, ran.output
    assert ["replies", "check", "case/replies.jsonl", cli.case_id] in commands(ran.output)
    todo = commands(ran.output)
    resume = next(c for c in todo if c[0] == "resume")
    assert resume == ["resume", cli.case_id, "--retry-id", "retry-3-1"]
    st = invoke("status", cli.case_id, "--json")
    info = json.loads(st.stdout)
    assert info["next"]["steps"][2]["command"] == f"investigate resume {cli.case_id} " \
        "--retry-id retry-3-1"
    # `status` knows neither file from its own arguments: it names the providers file the
    # case's last `run` on this home used (and its reply file), relative to here ...
    plain = invoke("status", cli.case_id).output
    assert f"blocked since {info['blocked_since']}" in plain, plain  # a fleet trial
    shown = commands(plain)
    assert ["replies", "check", "case/replies.jsonl", cli.case_id] in shown, shown
    assert ["run", cli.case_id, "--providers", "case/providers.toml"] in shown, shown
    # ... else the reply file the failing provider read, and a placeholder.
    (Settings().home / "runs" / cli.case_id / "providers").unlink()
    shown = commands(invoke("status", cli.case_id).output)
    assert ["replies", "check", str(cli.replies_path.resolve()), cli.case_id] in shown, shown
    assert ["run", cli.case_id, "--providers", "providers.toml"] in shown
    with pytest.MonkeyPatch.context() as env:
        env.setenv("INVESTIGATE_PROVIDERS", providers)
        shown = commands(invoke("status", cli.case_id).output)
    assert ["run", cli.case_id, "--providers", providers] in shown, shown
    plain = invoke("resume", cli.case_id)
    assert plain.exit_code == 2 and "RETRY_ID_REQUIRED" in plain.output
    flat = " ".join(plain.output.split())
    assert f"try: investigate resume {cli.case_id} --retry-id retry-3-1" in flat
    assert flat.index("RETRY_ID_REQUIRED") < flat.index("try:")  # the error, then the fix
    cli.replies_path.write_text("\n".join(HAPPY) + "\n")
    assert follow(resume, cli.replies_path).exit_code == 0
    done = follow(next(c for c in todo if c[0] == "run"), cli.replies_path)
    assert done.exit_code == 0 and "COMPLETED" in done.output, done.output


def test_a_provider_block_is_said_once_on_runs_output(cli: Case, tmp_path: Path) -> None:
    """The gateway's own WARNING repeated the block on run's stderr, after the `next:`
    lines (a new user's and a hostile trial); a worker still logs it as a WARNING with
    the provider's message (``workers.tasks._advance``)."""
    import subprocess
    import sys

    cli.replies_path.write_text("\n".join(HAPPY[:2]) + "\n")
    exe = str(Path(sys.executable).with_name("investigate"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("INVESTIGATE_")}
    env.update(INVESTIGATE_HOME=str(tmp_path / "home"),
               INVESTIGATE_DATABASE_URL=cli.store.url)
    ran = subprocess.run([exe, "run", cli.case_id, "--providers", str(cli.providers_path)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert ran.returncode == 1, ran.stderr
    assert "BLOCKED (PROVIDER_CONFIGURATION)" in ran.stdout + ran.stderr
    assert "WARNING" not in ran.stderr and "llm operation" not in ran.stderr, ran.stderr


def test_output_whose_reader_went_away_is_never_exit_1(cli: Case, tmp_path: Path) -> None:
    """`investigate steps CASE | head -1` exited 1, which says "the case is blocked", with
    no message (Rich's own exit on a broken pipe; a hostile trial): it is 141, 128 +
    SIGPIPE, as a tool that signal ends, and quiet."""
    import subprocess
    import sys

    assert invoke("run", cli.case_id, "--providers", str(cli.providers_path)).exit_code == 1
    exe = str(Path(sys.executable).with_name("investigate"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("INVESTIGATE_")}
    env.update(INVESTIGATE_HOME=str(tmp_path / "home"),
               INVESTIGATE_DATABASE_URL=cli.store.url)
    # Help too: Typer's own console exited 1 (a hostile trial's `--help | head -1`).
    for command in (["steps", cli.case_id], ["cases"], ["--help"], ["case", "--help"]):
        # The reader goes away before the command writes (it imports for a second first).
        proc = subprocess.Popen([exe, *command], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        stderr = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 141 and stderr == "", (command, stderr)


def test_status_watch_without_a_terminal_prints_changes_and_stops(
        cli: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    assert invoke("run", cli.case_id, "--providers", str(cli.providers_path)).exit_code == 1
    res = invoke("status", cli.case_id, "--watch", "--interval", "0.2")
    assert res.exit_code == 0, res.output
    assert f"case {cli.case_id}: state BLOCKED (INVALID_LLM_RESPONSES), step 3" in res.output
    assert f"$ investigate resume {cli.case_id}" in res.output
    # The advice is the shell's, as `status` gives it: its providers file, not a
    # placeholder (a fleet trial), and only the runtime this shell can use.
    monkeypatch.setenv("INVESTIGATE_PROVIDERS", str(cli.providers_path))
    watched = invoke("status", cli.case_id, "--watch", "--interval", "0.2")
    assert commands(watched.output) == commands(invoke("status", cli.case_id).output)
    assert f"--providers {cli.providers_path}" in watched.output, watched.output
    assert "--providers providers.toml" not in watched.output


def test_status_watch_json_is_json_lines(cli: Case) -> None:
    """`--watch --json` was `--json` alone: one object, whatever the case did next."""
    assert invoke("run", cli.case_id, "--providers", str(cli.providers_path)).exit_code == 1
    res = invoke("status", cli.case_id, "--watch", "--json", "--interval", "0.2")
    assert res.exit_code == 0, res.output
    (line,) = res.stdout.splitlines()  # settled at once: one line
    doc = json.loads(line)
    assert (doc["state"], doc["blocked_reason"]) == ("BLOCKED", "INVALID_LLM_RESPONSES")
    assert doc["next"]["final"] is False and doc["next"]["steps"]


def test_run_json_and_quiet_output(cli: Case) -> None:
    cli.replies_path.write_text("\n".join(HAPPY) + "\n")
    res = invoke("run", cli.case_id, "--providers", str(cli.providers_path), "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["outcome"]["outcome"] == "COMPLETED" and len(info["steps"]) == 5
    assert info["next"]["final"] is True and Path(info["summary_path"]).is_file()


def test_live_progress_on_a_terminal_and_plain_lines_elsewhere(cli: Case) -> None:
    from workers import runtime
    from workers.embedded import run_case
    from workers.progress import RunProgress
    from workers.settings import load_settings

    cli.replies_path.write_text("\n".join(HAPPY) + "\n")
    settings = load_settings()
    tty = io.StringIO()
    console = Console(file=tty, force_terminal=True, width=120)
    rt = runtime.embedded(settings, None, cli.providers_path)
    with RunProgress(console, cli.store, cli.case_id) as progress:
        outcome = run_case(rt, cli.case_id, max_steps=2, on_step=progress)
    assert outcome.outcome == "YIELDED"
    screen = tty.getvalue()
    assert "investigate run " + cli.case_id in screen
    assert "model time" in screen and "H2" in screen and "57/60" in screen
    # Answered calls, as status counts them (it counted operations: 17 beside status's 12).
    assert "over 2 call(s)" in screen and "failed attempt" not in screen, screen
    from investigation.report.history import usage_totals

    totals = usage_totals(cli.store, cli.case_id)
    calls = sum(u["calls"] for u in json.loads(invoke("status", cli.case_id, "--json")
                                               .stdout)["model_usage"]["hypotheses"])
    assert totals["calls"] == calls == 2 and totals["failed"] == 0
    # A run that stops after a progressed step says nothing of a next one at its end.
    from investigation.loop.outcome import Outcome
    from workers.progress import progress_view

    info = json.loads(invoke("status", cli.case_id, "--json").stdout)
    progressed = Outcome("PROGRESSED", cli.case_id, 2, hypothesis_id=2)
    for finished, said in ((False, True), (True, False)):
        frame = Console(file=io.StringIO(), width=120, record=True)
        frame.print(progress_view(info, totals, progressed, 0.0, finished=finished))
        assert ("working on the next step" in frame.export_text()) is said
    assert "step   1 H1: PROGRESSED" in screen
    piped = io.StringIO()
    with RunProgress(Console(file=piped, width=120), cli.store, cli.case_id) as progress:
        run_case(rt, cli.case_id, on_step=progress)
    lines = piped.getvalue().splitlines()
    assert [line.split(";")[0] for line in lines] == [
        "step   3 H1: PROGRESSED", "step   4 H1: PROGRESSED", "step   5 H2: COMPLETED"]
    # Each says what the step did: a real model's user piping `run` saw only outcomes
    # for steps of one to two minutes.
    assert re.fullmatch(r"step   3 H1: PROGRESSED; [a-z]+\.[a-z]+, model \d+\.\d s",
                        lines[0]), lines


def _case_add_args(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``case add`` of the tiny package, interpretation and hypotheses (written under
    ``tmp_path``) into a store of its own."""
    monkeypatch.setenv("INVESTIGATE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("INVESTIGATE_DATABASE_URL", raising=False)
    package = casekit.build_tiny_package(tmp_path)
    (tmp_path / "i.json").write_text(json.dumps(casekit.INTERPRETATION))
    (tmp_path / "h.json").write_text(json.dumps(casekit.HYPOTHESES))
    return ["case", "add", str(package), "--interpretation", str(tmp_path / "i.json"),
            "--hypotheses", str(tmp_path / "h.json")]


def test_repeated_case_add_says_what_it_did(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    args = _case_add_args(tmp_path, monkeypatch)
    (tmp_path / "i2.json").write_text(json.dumps({"summary": "another reading"}))
    # Only the [package] table is read: a wrong budget beside it does not matter (a
    # hostile-input trial; the README says so).
    (tmp_path / "limits.toml").write_text("[package]\nmax_entries = 500\n\n"
                                          "[budget]\ncredit_units = -1\n")
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    case_id = first.stdout.strip()
    # stdout is the bare id (for `$(investigate case add ...)`); what to do next is on stderr.
    assert first.stdout == case_id + "\n"
    # No broker configured: no `dispatch` (it would go to the default broker), a pointer.
    # Each command opens the store the case was added to (a hostile trial's were bare).
    env = f"INVESTIGATE_HOME={tmp_path / 'home'} "
    assert first.stderr.splitlines()[1:3] == [
        f"  $ {env}investigate replies check replies.jsonl {case_id}",
        f"  $ {env}investigate run {case_id} --providers providers.toml"]
    assert not any(ln.startswith("  $ ") and "investigate dispatch" in ln
                   for ln in first.stderr.splitlines())
    assert "INVESTIGATE_BROKER_URL" in first.stderr.splitlines()[-1]
    again = invoke(*args, "--package-limits", str(tmp_path / "limits.toml"))
    assert again.exit_code == 0 and again.stdout.strip() == case_id
    assert "already registered" in again.stderr and "nothing changed" in again.stderr
    assert "max_entries: 20000 -> 500" in again.stderr
    old = invoke(*args, "--config", str(tmp_path / "limits.toml"), "--json")
    assert old.exit_code == 0 and "deprecated" in old.stderr
    assert json.loads(old.stdout)["limit_changes"] == ["max_entries: 20000 -> 500"]
    other = invoke(*args[:4], str(tmp_path / "i2.json"), *args[5:])
    assert other.exit_code == 0 and other.stdout.strip() != case_id
    assert f"also registered as {case_id} (other interpretation" in other.stderr
    # Five ids at most, then a count (a fleet trial's 14th case listed 13 ids).
    for n in range(3, 9):
        (tmp_path / f"i{n}.json").write_text(json.dumps({"summary": f"reading {n}"}))
        last = invoke(*args[:4], str(tmp_path / f"i{n}.json"), *args[5:])
        assert last.exit_code == 0, last.output
    note = " ".join(last.stderr.split())
    assert re.search(r"also registered as (case-\w+, ){4}case-\w+ and 2 more case\(s\) "
                     r"\(`investigate cases` lists them\) \(other interpretation", note), note


def test_case_add_names_the_providers_file_in_use(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With INVESTIGATE_PROVIDERS set, ``case add``'s next steps name that file, and its
    scripted reply file (no reply-file check when it has no scripted provider)."""
    args = _case_add_args(tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path)
    http = tmp_path / "http.toml"
    http.write_text('[[providers]]\nname = "web"\nkind = "openai"\n'
                    'base_url = "http://127.0.0.1:9/v1"\nmodel = "m"\n')
    scripted = tmp_path / "scripted.toml"
    scripted.write_text('[[providers]]\nname = "s"\nkind = "scripted"\npath = "r.jsonl"\n')
    monkeypatch.setenv("INVESTIGATE_PROVIDERS", str(http))
    monkeypatch.setenv("INVESTIGATE_BROKER_URL", REDIS_URL)  # a fleet's
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    case_id = first.stdout.strip()
    env = f"INVESTIGATE_HOME={tmp_path / 'home'} "
    assert first.stderr.splitlines()[-2:] == [  # a fleet's shell: the workers first
        f"  $ {env}investigate dispatch {case_id}",
        f"  $ {env}investigate run {case_id} --providers {http}"]
    assert "replies check" not in first.stderr and "scripted reply" not in first.stderr
    monkeypatch.setenv("INVESTIGATE_PROVIDERS", str(scripted))
    again = invoke(*args)
    assert again.exit_code == 0, again.output
    assert f"  $ {env}investigate replies check r.jsonl {case_id}" in again.stderr.splitlines()
    assert f"  $ {env}investigate run {case_id} --providers {scripted}" in again.stderr


def test_case_add_of_a_completed_case_says_it_is_complete(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Adding again a case that already ran to its end prints what ``status`` says (the
    summary and report), not how to run it (a new user's trial saw run and dispatch)."""
    args = _case_add_args(tmp_path, monkeypatch)
    monkeypatch.setenv("INVESTIGATE_BROKER_URL", REDIS_URL)
    first = invoke(*args)
    case_id = first.stdout.strip()
    store = Store(f"sqlite:///{tmp_path / 'home' / 'investigation.db'}")
    replies = tmp_path / "replies.jsonl"
    replies.write_text("\n".join(json.dumps(r) for r in casekit.HAPPY_REPLIES) + "\n")
    (tmp_path / "p.toml").write_text(f'[[providers]]\nname = "s"\nkind = "scripted"\n'
                                     f'path = "{replies}"\n')
    ran = invoke("run", case_id, "--providers", str(tmp_path / "p.toml"))
    assert ran.exit_code == 0, ran.output
    # It ends with the case's model usage (a real model's user found it only in status).
    assert "model usage: 5 call(s), 5 attempt(s), tokens not reported, cost not priced" \
        in ran.output, ran.output
    again = invoke(*args)
    assert again.exit_code == 0 and again.stdout.strip() == case_id
    assert "already registered" in again.stderr
    assert "next: The investigation is complete" in again.stderr, again.stderr
    assert f"investigate summary {case_id}" in again.stderr
    assert "investigate run" not in again.stderr and "dispatch" not in again.stderr
    store.dispose()


def test_dispatch_without_a_broker_setting_says_where_it_went(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    """``dispatch`` with INVESTIGATE_BROKER_URL unset enqueues on the default broker (as
    Celery would) and says so on stderr; with it set, no note."""
    args = _case_add_args(tmp_path, monkeypatch)
    monkeypatch.delenv("INVESTIGATE_BROKER_URL", raising=False)
    monkeypatch.delenv("INVESTIGATE_REDIS_URL", raising=False)
    queue = "note-" + uuid.uuid4().hex[:8]
    monkeypatch.setenv("INVESTIGATE_QUEUE", queue)
    case_id = invoke(*args).stdout.strip()
    default = Settings().broker_url
    # Under xdist no worker flushes the default broker's database 0 (conftest's
    # XDIST_REDIS_DBS); this test deletes only the keys it made there.
    if default != SUITE_REDIS_URL:  # the tests' Redis was pointed away on purpose
        pytest.skip(f"TEST_REDIS_URL is not the default broker {default}")
    client = redis.Redis.from_url(default)
    try:
        sent = invoke("dispatch", case_id)
        assert sent.exit_code == 0, sent.output
        assert f"dispatched {case_id}" in sent.stdout
        assert f"INVESTIGATE_BROKER_URL is not set, so this went to the default broker " \
               f"{default} (queue {queue})" in " ".join(sent.stderr.split())
        assert client.llen(queue) == 1
    finally:
        client.delete(queue, f"_kombu.binding.{queue}", f"investigation:lock:{case_id}")
        client.close()
    monkeypatch.setenv("INVESTIGATE_BROKER_URL", redis_url)
    other = redis.Redis.from_url(redis_url)
    try:
        sent = invoke("dispatch", case_id)
        assert sent.exit_code == 0, sent.output
        assert "not set" not in sent.stderr
    finally:
        other.delete(queue, f"_kombu.binding.{queue}", f"investigation:lock:{case_id}")
        other.close()


def test_watch_follows_a_case_that_moves_until_it_completes(tiny_case: Case) -> None:
    from workers.progress import watch

    investigator = tiny_case.investigator()
    buf = io.StringIO()
    info = watch(Console(file=buf, width=200), tiny_case.store, tiny_case.case_id, 0.0,
                 sleep=lambda _s: investigator.step(tiny_case.case_id))
    assert info["state"] == "BUILDING_DIAGNOSIS"
    lines = [ln for ln in buf.getvalue().splitlines() if f"case {tiny_case.case_id}:" in ln]
    assert [ln.split(", step ")[1].split(",")[0] for ln in lines] == ["0", "1", "2", "3", "4",
                                                                      "5"]
    assert "next: The investigation is complete" in buf.getvalue()
    # Said once, before the first line: what moves a case (a new user's trial waited on a
    # case nothing ran, unsure why).
    assert buf.getvalue().count("watching: one line per change") == 1
    assert buf.getvalue().index("watching:") < buf.getvalue().index(f"case {tiny_case.case_id}:")


def test_a_watch_line_says_until_when_a_pending_retry_waits(tiny_case: Case) -> None:
    """A fleet trial's watch printed RETRY_PENDING and then nothing for 50 s, while
    `status` gave the time the retry waits for."""
    from workers.progress import store_reading, watch

    plain = store_reading(tiny_case.store, tiny_case.case_id)

    def read() -> tuple[dict[str, Any], Any]:
        info, g = plain()
        return {**info, "last_outcome": "RETRY_PENDING",
                "last_reason": "PROVIDER_CALL_IN_FLIGHT",
                "retry_not_before": "2030-01-01T00:00:05+00:00"}, g

    buf = io.StringIO()
    watch(Console(file=buf, width=300), tiny_case.store, tiny_case.case_id, 0.0,
          stop_after_s=0.0, read=read)
    assert "last outcome RETRY_PENDING (PROVIDER_CALL_IN_FLIGHT) until " \
        "2030-01-01T00:00:05+00:00, evidence 0" in buf.getvalue(), buf.getvalue()
    buf = io.StringIO()
    watch(Console(file=buf, width=300), tiny_case.store, tiny_case.case_id, 0.0,
          stop_after_s=0.0)
    assert "last outcome none (no step has run), evidence 0" in buf.getvalue()
    assert "until" not in buf.getvalue()


def test_printed_commands_carry_the_home_given_inline(tmp_path: Path) -> None:
    """`INVESTIGATE_HOME=dir investigate status CASE` prints commands that open `dir` when
    pasted into the same shell (where INVESTIGATE_HOME is not exported), and the reply file
    of INVESTIGATE_PROVIDERS instead of a placeholder."""
    import os
    import subprocess
    import sys

    exe = str(Path(sys.executable).with_name("investigate"))
    case = make_case(tmp_path / "case", replies=[BAD, BAD, BAD],
                     database_url=f"sqlite:///{tmp_path / 'my home' / 'investigation.db'}")
    base = {k: v for k, v in os.environ.items() if not k.startswith("INVESTIGATE_")}
    inline = {**base, "INVESTIGATE_HOME": "my home",
              "INVESTIGATE_PROVIDERS": str(case.providers_path)}
    ran = subprocess.run([exe, "run", case.case_id], env=inline, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=False)
    assert ran.returncode == 1 and "INVALID_LLM_RESPONSES" in ran.stdout, ran.stdout + ran.stderr
    st = subprocess.run([exe, "status", case.case_id], env=inline, cwd=tmp_path,
                        capture_output=True, text=True, timeout=120, check=False)
    printed = [ln.strip()[2:] for ln in st.stdout.splitlines() if ln.strip().startswith("$ ")]
    assert printed and all(c.startswith("INVESTIGATE_HOME='my home' investigate ")
                           for c in printed), st.stdout
    check = next(c for c in printed if " replies check " in c)
    assert f" replies check case/replies.jsonl {case.case_id}" in check, check
    pasted = subprocess.run(["bash", "-c", check.replace("investigate ", f"{exe} ", 1)],
                            env=base, cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, check=False)
    assert pasted.returncode == 0 and case.case_id in pasted.stdout, pasted.stdout + pasted.stderr


def test_case_add_paused_waits_for_resume(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`case add --paused` registers a case the recovery sweep leaves alone (it dispatches
    investigating cases only) until `resume`; then it runs to the end."""
    from types import SimpleNamespace

    from workers.recovery import pending_cases

    monkeypatch.setenv("INVESTIGATE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("INVESTIGATE_DATABASE_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    package = casekit.build_tiny_package(tmp_path)
    (tmp_path / "i.json").write_text(json.dumps(casekit.INTERPRETATION))
    (tmp_path / "h.json").write_text(json.dumps(casekit.HYPOTHESES))
    added = invoke("case", "add", str(package), "--interpretation", str(tmp_path / "i.json"),
                   "--hypotheses", str(tmp_path / "h.json"), "--paused")
    assert added.exit_code == 0, added.output
    case_id = added.stdout.strip()
    assert f"  $ INVESTIGATE_HOME={tmp_path / 'home'} investigate resume {case_id}" in \
        added.stderr.splitlines()
    info = json.loads(invoke("status", case_id, "--json").stdout)
    assert info["state"] == "PAUSED"
    from investigation.store import Store

    rt: Any = SimpleNamespace(env=SimpleNamespace(
        store=Store(f"sqlite:///{tmp_path / 'home' / 'investigation.db'}")))
    assert case_id not in pending_cases(rt)[0]
    again = invoke("case", "add", str(package), "--interpretation", str(tmp_path / "i.json"),
                   "--hypotheses", str(tmp_path / "h.json"), "--paused", "--json")
    assert json.loads(again.stdout)["state"] == "PAUSED"
    assert invoke("resume", case_id).exit_code == 0
    assert case_id in pending_cases(rt)[0]
    (tmp_path / "replies.jsonl").write_text("\n".join(HAPPY) + "\n")
    (tmp_path / "providers.toml").write_text(
        '[[providers]]\nname = "replay"\nkind = "scripted"\npath = "replies.jsonl"\n')
    ran = invoke("run", case_id, "--providers", str(tmp_path / "providers.toml"))
    assert ran.exit_code == 0 and f"case {case_id}: COMPLETED" in ran.output, ran.output


def test_a_wait_for_another_workers_request_is_named_from_the_cases_reason(
        tiny_case: Case) -> None:
    """A step waiting because another runner's model request is still out: the case's
    last reason says so (the gateway stores no error for it), so the guidance neither
    calls it a failure nor quotes an older operation's rate limit."""
    from datetime import UTC, datetime, timedelta

    from investigation import guidance
    from investigation.llm.types import PROVIDER_RATE_LIMITED
    from investigation.store.models import CaseRecord, LLMOperation

    with tiny_case.store.session() as s:
        s.add(LLMOperation(case_id=tiny_case.case_id, revision=1, step_seq=1, retry_id="",
                           call_index=0, hypothesis_id=1, status="failed",
                           attempts_made=1, next_provider_index=0, round_index=0,
                           error_code=PROVIDER_RATE_LIMITED, error_message="429 earlier"))
        case = s.get(CaseRecord, tiny_case.case_id)
        assert case is not None
        case.last_outcome, case.last_reason = "RETRY_PENDING", "PROVIDER_CALL_IN_FLIGHT"
        case.retry_not_before = datetime.now(UTC) + timedelta(minutes=1)
        s.add(case)
        s.commit()
    headline = guidance.for_case(tiny_case.store, tiny_case.case_id).headline
    assert headline.startswith("A request for this model call is still out, or its reply "
                               "was never stored"), headline
    assert "(PROVIDER_CALL_IN_FLIGHT)" in headline
    # the older operation's error, by its message and code (a bare "429" can occur in the
    # retry time's microseconds)
    assert "pause" not in headline
    assert "429 earlier" not in headline and PROVIDER_RATE_LIMITED not in headline, headline


def test_status_and_cases_offer_what_this_shell_can_run(
        cli: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """A case that never ran is to be run, not run "again"; `status` offers `dispatch`
    only where a broker is configured (as `case add` does); `cases` names the scripted
    reply file `status` names, not a placeholder (a new user's trial)."""
    monkeypatch.delenv("INVESTIGATE_BROKER_URL", raising=False)
    local = invoke("status", cli.case_id)
    assert local.exit_code == 0, local.output
    assert "No step has run yet" in local.output and "run it (with" in local.output
    assert "again" not in local.output and "dispatch" not in local.output
    assert [c[0] for c in commands(local.output)] == ["run"]
    monkeypatch.setenv("INVESTIGATE_BROKER_URL", "redis://127.0.0.1:6379/12")
    fleet = invoke("status", cli.case_id)
    assert "embedded runtime: run it with your providers file" in fleet.output, fleet.output
    assert [c[0] for c in commands(fleet.output)] == ["dispatch", "run"]
    monkeypatch.delenv("INVESTIGATE_BROKER_URL")

    ran = invoke("run", cli.case_id, "--providers", str(cli.providers_path))
    assert "BLOCKED (INVALID_LLM_RESPONSES)" in ran.output, ran.output
    # The accounts' column is named as summary.md and the report name it (a 500-step
    # reader met "status" here and "disposition" there).
    accounts = invoke("status", cli.case_id).output
    assert re.search(r"hypothesis\s*┃\s*disposition\s*┃\s*confidence", accounts), accounts
    monkeypatch.setenv("INVESTIGATE_PROVIDERS", str(cli.providers_path))
    status = invoke("status", cli.case_id, "--json")
    first = next(step["command"] for step in json.loads(status.output)["next"]["steps"]
                 if step["command"])
    assert first == f"investigate replies check case/replies.jsonl {cli.case_id}"
    listed = invoke("cases", "--json")
    assert [row["next"] for row in json.loads(listed.output)] == [first]
    # Narrow output never cuts or folds a code, a balance or a time: too narrow for the
    # table, each case is a block of lines (a fleet trial read "INVALID_LLM_RESP…", a
    # 500-step case's reader "BUIL DING _DIA GNOS IS").
    from rich.console import Console

    import workers.cli_ops

    narrow = Console(file=io.StringIO(), width=80, record=True)
    monkeypatch.setattr(workers.cli_ops, "out", narrow)
    assert invoke("cases").exit_code == 0
    screen = narrow.export_text()
    assert "…" not in screen, screen
    lines = [line.rstrip() for line in screen.splitlines()]
    assert lines[:3] == [f"case {cli.case_id}", "  state: BLOCKED",
                         "  reason: INVALID_LLM_RESPONSES"], screen
    assert any(re.fullmatch(r"  balance: \d+/\d+", line) for line in lines), screen
    wide = Console(file=io.StringIO(), width=200, record=True)
    monkeypatch.setattr(workers.cli_ops, "out", wide)
    assert invoke("cases").exit_code == 0
    cells = [line.split("│") for line in wide.export_text().splitlines()
             if line.startswith("│")]
    assert [c[3].strip() for c in cells] == ["INVALID_LLM_RESPONSES"], cells


def test_status_on_a_fleet_shell_says_whether_a_dispatch_holds_the_case(
        cli: Case, monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    """After a worker died, status showed nothing of the lock that kept the case waiting
    for its lease, while `dispatch` answered LOCK_BUSY (a fleet trial)."""
    from investigation.constants import REDIS_LOCK_KEY

    url = redis_url
    monkeypatch.setenv("INVESTIGATE_BROKER_URL", url)
    client = redis.Redis.from_url(url)
    key = REDIS_LOCK_KEY.format(case_id=cli.case_id)
    from workers.locks import HOLDER_SUFFIX

    try:
        client.delete(key, key + HOLDER_SUFFIX)
        free = invoke("status", cli.case_id)
        assert "dispatch: none holds the case" in " ".join(free.output.split()), free.output
        client.set(key, "someone", px=200_000)
        held = invoke("status", cli.case_id)
        flat = " ".join(held.output.split())
        assert re.search(r"dispatch: one holds the case, lease (199|200)(\.\d)? s left", flat)
        assert 190 < json.loads(invoke("status", cli.case_id, "--json").output)[
            "dispatch_lease_s"] <= 200
        # The lease names its holder and when it renewed (a second fleet trial could not
        # tell a live holder from a dead one).
        ttl_s = Settings().lock_ttl_s
        client.set(key + HOLDER_SUFFIX, "w1@host pid 7", px=(ttl_s - 30) * 1000)
        named = " ".join(invoke("status", cli.case_id).output.split())
        assert re.search(r"dispatch: one holds the case \(w1@host pid 7, renewed "
                         r"(29|30|31)(\.\d)? s ago\), lease", named), named
        info = json.loads(invoke("status", cli.case_id, "--json").output)
        assert info["dispatch_holder"] == "w1@host pid 7"
        assert 29 <= info["dispatch_renewed_s_ago"] <= 31
        # A lock key without a TTL (never the engine's): held, and said to never expire
        # (status said "none holds the case" while dispatch answered LOCK_BUSY).
        client.set(key, "by-hand")
        forever = " ".join(invoke("status", cli.case_id).output.split())
        assert "with a lease that never expires" in forever and \
            f"dispatch {cli.case_id} --take-over" in forever, forever
        assert json.loads(invoke("status", cli.case_id, "--json").output)[
            "dispatch_lease_expires"] is False
        client.set(key, "someone", px=200_000)
        # The key is anyone's with access to Redis: shown escaped and cut short.
        client.set(key + HOLDER_SUFFIX, "\x1b[2J[red]x" * 500, px=100_000)
        hostile = invoke("status", cli.case_id).output
        assert "\x1b" not in hostile and "\\x1b[2J[red]x" in hostile, hostile
        shown = json.loads(invoke("status", cli.case_id, "--json").output)["dispatch_holder"]
        assert len(shown) == 200
        client.delete(key + HOLDER_SUFFIX)
        # While a dispatch holds it, neither `dispatch` nor `run` (both LOCK_BUSY,
        # decision 158) is advice; the take-over is, for a holder known dead (a fleet
        # trial killed it and waited out the lease: status never named it).
        assert "A dispatch holds the case" in flat
        assert commands(held.output) == [["status", cli.case_id, "--watch"],
                                         ["dispatch", cli.case_id, "--take-over"]], held.output
        assert "`investigate recover` says whether the holder answers ping" in flat, flat
        assert "once you know it died, end its lease and dispatch now" in flat, flat
        # A dispatch sent while no worker ran waits in the queue: said, not "dispatch
        # again" alone (an integrator's trial).
        client.delete(key)
        queue = "q-" + uuid.uuid4().hex[:8]
        monkeypatch.setenv("INVESTIGATE_QUEUE", queue)
        client.lpush(queue, b"{}")
        waiting = " ".join(invoke("status", cli.case_id).output.split())
        assert (f"dispatch: none holds the case, and 1 message(s) wait in queue {queue!r} "
                "that no worker has taken: is one running? (`investigate health`)"
                ) in waiting, waiting
        assert json.loads(invoke("status", cli.case_id, "--json").output)[
            "queue_waiting"] == 1
        client.delete(queue)
        monkeypatch.delenv("INVESTIGATE_QUEUE")
    finally:
        client.delete(key, key + HOLDER_SUFFIX)
        client.close()
    monkeypatch.setenv("INVESTIGATE_BROKER_URL", "redis://127.0.0.1:1/0")  # nothing there
    unknown = invoke("status", cli.case_id)
    assert unknown.exit_code == 0 and "Redis cannot tell" in unknown.output, unknown.output
    monkeypatch.delenv("INVESTIGATE_BROKER_URL")
    assert "dispatch:" not in invoke("status", cli.case_id).output  # embedded shell


@pytest.mark.redis
def test_status_says_a_dispatch_sent_from_a_shell_waits_for_a_worker(
        cli: Case, monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    """`investigate dispatch` takes the lease itself: sent while no worker ran, status
    said a worker moved the case and left out the waiting messages (a fleet trial)."""
    from investigation.constants import REDIS_LOCK_KEY
    from workers.locks import HOLDER_SUFFIX

    queue = "q-" + uuid.uuid4().hex[:8]
    monkeypatch.setenv("INVESTIGATE_BROKER_URL", redis_url)
    monkeypatch.setenv("INVESTIGATE_QUEUE", queue)
    client = redis.Redis.from_url(redis_url)
    key = REDIS_LOCK_KEY.format(case_id=cli.case_id)
    try:
        client.set(key, "token", px=290_000)
        client.set(key + HOLDER_SUFFIX, "vm pid 27816", px=290_000)  # a CLI's dispatch
        client.lpush(queue, b"{}", b"{}")
        output = invoke("status", cli.case_id).output
        shown = " ".join(output.split())
        assert ("sent from a shell, and 2 message(s) wait in queue "
                f"{queue!r} that no worker has taken") in shown, shown
        info = json.loads(invoke("status", cli.case_id, "--json").output)
        assert info["queue_waiting"] == 2 and info["dispatch_holder"] == "vm pid 27816"
        assert info["next"]["headline"].startswith("A dispatch of the case waits in queue")
        assert ["health"] in commands(output) and ["worker", "--name", "w1@%h"] in \
            commands(output), output
        # A worker's pool child renewed it: a worker moves the case, as before.
        client.set(key + HOLDER_SUFFIX, "w1@vm pid 7", px=290_000)
        moving = json.loads(invoke("status", cli.case_id, "--json").output)
        assert moving["next"]["headline"].startswith("A dispatch holds the case"), moving
    finally:
        client.delete(key, key + HOLDER_SUFFIX, queue)
        client.close()


@pytest.mark.redis
def test_status_watch_on_a_fleet_shell_shows_the_dispatch_lease(
        cli: Case, monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    """`status --watch --json` left out the dispatch fields plain `status --json` gives on
    a fleet shell; a watch now reads what `status` does, and writes a line when the
    holder's lease lapses (a worker died: no step is published)."""
    from investigation.constants import REDIS_LOCK_KEY
    from workers.cli import status_reading
    from workers.locks import HOLDER_SUFFIX
    from workers.progress import watch, watch_json

    monkeypatch.setenv("INVESTIGATE_BROKER_URL", redis_url)
    client = redis.Redis.from_url(redis_url)
    key = REDIS_LOCK_KEY.format(case_id=cli.case_id)
    settings = Settings()
    sleeps: list[float] = []

    def lease_lapses(seconds: float) -> None:  # the holder died: its lease runs out
        sleeps.append(seconds)
        if len(sleeps) == 1:
            client.delete(key, key + HOLDER_SUFFIX)
        else:  # after the line that says so: leave, as Ctrl-C does
            raise KeyboardInterrupt

    try:
        client.set(key, "token", px=100_000)
        client.set(key + HOLDER_SUFFIX, "w1@host pid 7", px=100_000)
        lines: list[str] = []
        with pytest.raises(KeyboardInterrupt):
            watch_json(lines.append, cli.store, cli.case_id, 0.0,
                       read=lambda: status_reading(settings, cli.store, cli.case_id),
                       sleep=lease_lapses)
        docs = [json.loads(line) for line in lines]
        assert [d.get("dispatch_holder")
                for d in docs] == ["w1@host pid 7", None], docs
        assert 0 < docs[0]["dispatch_lease_s"] <= 100 and docs[1]["dispatch_lease_s"] == 0.0
        assert "A dispatch holds the case" in json.dumps(docs[0]["next"]), docs[0]["next"]
        assert docs[1]["queue_waiting"] == 0
        # The text watch says it on each line; its screen is `status`'s.
        client.set(key, "token", px=100_000)
        client.set(key + HOLDER_SUFFIX, "w2@host pid 8", px=100_000)
        # workers.upstream.status, "what status --json prints", has them too.
        from workers import upstream

        polled = upstream.status(cli.case_id)
        assert polled["dispatch_holder"] == "w2@host pid 8", polled
        assert "A dispatch holds the case" in json.dumps(polled["next"])
        buf = io.StringIO()
        watch(Console(file=buf, width=200), cli.store, cli.case_id, 0.0, stop_after_s=0.0,
              read=lambda: status_reading(settings, cli.store, cli.case_id))
        assert ", held by w2@host pid 8" in buf.getvalue(), buf.getvalue()
    finally:
        client.delete(key, key + HOLDER_SUFFIX)
        client.close()


@pytest.mark.redis
def test_run_on_a_fleet_shell_takes_the_fleets_lock(
        cli: Case, monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    """Decision 158: a fleet trial ran `run` beside a live dispatch of the same case (the
    locks were per runtime). In a shell that names a broker, `run` now refuses while a
    dispatch holds the case, and holds the fleet's lease itself while it runs."""
    from investigation.constants import REDIS_LOCK_KEY

    url = redis_url
    key = REDIS_LOCK_KEY.format(case_id=cli.case_id)
    client = redis.Redis.from_url(url)
    cli.replies_path.write_text("\n".join(HAPPY) + "\n")
    seen: list[bytes | None] = []
    try:
        client.delete(key)
        client.set(key, "a-worker", px=200_000)
        monkeypatch.setenv("INVESTIGATE_BROKER_URL", url)
        busy = invoke("run", cli.case_id, "--providers", str(cli.providers_path))
        assert busy.exit_code == 3, busy.output
        assert "LOCK_BUSY" in busy.output and "lease runs out in" in busy.output
        assert "published steps 0" in invoke("status", cli.case_id).output
        assert client.get(key) == b"a-worker"
        client.delete(key)

        from workers import embedded

        real_step = embedded.run_embedded_step

        def step(case_id: str, token: str) -> Any:
            seen.append(client.get(key))  # who holds the fleet's lease during the step
            return real_step(case_id, token)

        monkeypatch.setattr(embedded, "run_embedded_step", step)
        ran = invoke("run", cli.case_id, "--providers", str(cli.providers_path))
        assert ran.exit_code == 0 and "COMPLETED" in ran.output, ran.output
        assert seen and len(set(seen)) == 1 and seen[0] is not None
        assert client.get(key) is None  # released at the end
        # Without a broker in the shell, `run` knows only its file lock (decision 158).
        monkeypatch.delenv("INVESTIGATE_BROKER_URL")
        client.set(key, "a-worker", px=200_000)
        assert invoke("run", cli.case_id, "--providers", str(cli.providers_path)
                      ).exit_code == 0
    finally:
        client.delete(key)
        for tomb in client.scan_iter(match=key + ":released:*"):
            client.delete(tomb)
        client.close()


def test_a_run_waiting_out_a_backoff_keeps_its_lease_and_stops_if_it_lost_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`run` sleeps through a provider backoff in its own process: with a fleet's lease
    it renews it every third of the lease, and stops with LOCK_LOST when a dispatch took
    the case meanwhile."""
    from datetime import UTC, datetime, timedelta
    from types import SimpleNamespace

    from investigation.errors import InvestigationError
    from workers import embedded

    class Lease:
        ttl_s = 30.0

        def __init__(self, held: bool) -> None:
            self.held, self.calls = held, 0

        def hold(self, case_id: str, token: str) -> bool:
            self.calls += 1
            return self.held

    slept: list[float] = []
    now = [datetime(2026, 1, 1, tzinfo=UTC)]

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += timedelta(seconds=seconds)

    class Clock(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> datetime:  # type: ignore[override]
            return now[0]

    monkeypatch.setattr(embedded.time, "sleep", sleep)
    monkeypatch.setattr(embedded, "datetime", Clock)
    lease = Lease(held=True)
    embedded._wait_out(SimpleNamespace(lock=lease), "case-1", "t",  # type: ignore[arg-type]
                       now[0] + timedelta(seconds=25))
    assert slept == [10.0, 10.0, 5.0] and lease.calls == 4  # at once, then every third
    lost = Lease(held=False)
    with pytest.raises(InvestigationError) as stopped:
        embedded._wait_out(SimpleNamespace(lock=lost), "case-1", "t",  # type: ignore[arg-type]
                           now[0] + timedelta(seconds=25))
    assert stopped.value.code == "LOCK_LOST" and lost.calls == 1 and len(slept) == 3
    assert "another dispatch took the case" in stopped.value.message

    # The error that stopped a run is the one shown, not a release that failed after it.
    import redis as redis_mod

    from investigation.loop import investigator

    class Broken:
        def acquire(self, case_id: str) -> str:
            return "t"

        def release(self, case_id: str, token: str) -> bool:
            raise redis_mod.ConnectionError("Redis is down too")

    def stop(*_: Any) -> None:
        raise InvestigationError("LOCK_LOST", "taken")

    monkeypatch.setattr(investigator, "Investigator",
                        lambda env: SimpleNamespace(next_step=lambda case_id: None))
    monkeypatch.setattr(embedded, "_run_steps", stop)
    with pytest.raises(InvestigationError) as shown:
        embedded.run_case(SimpleNamespace(env=None, lock=Broken()),  # type: ignore[arg-type]
                          "case-1")
    assert shown.value.code == "LOCK_LOST"


def test_status_while_a_run_of_this_machine_holds_the_case(cli: Case, tmp_path: Path) -> None:
    """A user of a real model asked `status` while `run` worked in another shell: it said
    "run it again", which then answered LOCK_BUSY."""
    from workers.locks import FileCaseLock

    lock = FileCaseLock(tmp_path / "home" / "locks")
    token = lock.acquire(cli.case_id)
    try:
        held = invoke("status", cli.case_id)
        flat = " ".join(held.output.split())
        assert "run: a `run` on this machine holds the case" in flat, flat
        assert commands(held.output) == [["status", cli.case_id, "--watch"]], held.output
        assert json.loads(invoke("status", cli.case_id, "--json").stdout)["run_holds"] is True
    finally:
        lock.release(cli.case_id, token)
    free = invoke("status", cli.case_id)
    assert "run: a `run`" not in free.output and commands(free.output)[0][0] == "run"
    assert json.loads(invoke("status", cli.case_id, "--json").stdout)["run_holds"] is False


def test_the_advice_while_a_run_holds_the_case_carries_the_stores_prefix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`status --watch` was printed without INVESTIGATE_HOME= while a run held the case,
    unlike every other printed command (a real model's user)."""
    from workers.locks import FileCaseLock

    home = tmp_path / "home"
    case = make_case(tmp_path / "case", database_url=f"sqlite:///{home / 'investigation.db'}")
    monkeypatch.setenv("INVESTIGATE_HOME", str(home))
    monkeypatch.delenv("INVESTIGATE_DATABASE_URL", raising=False)
    lock = FileCaseLock(home / "locks")
    token = lock.acquire(case.case_id)
    try:
        held = invoke("status", case.case_id)
        assert f"$ INVESTIGATE_HOME={home} investigate status {case.case_id} --watch" \
            in held.output, held.output
    finally:
        lock.release(case.case_id, token)
    case.store.dispose()


def test_report_while_a_run_of_this_machine_holds_the_case(cli: Case, tmp_path: Path) -> None:
    """A report written while `run` worked in another shell told the reader to "run it"
    (the store's own advice): its next steps are those `status` gives in this shell."""
    from html import unescape

    from workers.locks import FileCaseLock

    page = tmp_path / "report.html"
    lock = FileCaseLock(tmp_path / "home" / "locks")
    token = lock.acquire(cli.case_id)
    try:
        assert invoke("report", cli.case_id, "-o", str(page)).exit_code == 0
        held = unescape(page.read_text())
        assert "A `run` on this machine is at work on the case" in held
        assert f"investigate status {cli.case_id} --watch" in held
        assert f"investigate run {cli.case_id}" not in held
    finally:
        lock.release(cli.case_id, token)
    assert invoke("report", cli.case_id, "-o", str(page)).exit_code == 0
    free = unescape(page.read_text())
    assert "at work on the case" not in free and f"investigate run {cli.case_id}" in free


def test_the_live_panel_stops_saying_it_works_once_the_run_ends(cli: Case) -> None:
    """The panel drawn after a run's last step (COMPLETED) said "working on the next
    step" under it."""
    from workers import runtime
    from workers.embedded import run_case
    from workers.progress import RunProgress
    from workers.settings import load_settings

    def drawn(progress: RunProgress) -> str:
        screen = io.StringIO()
        Console(file=screen, force_terminal=True, width=120).print(progress._view())
        return screen.getvalue()

    cli.replies_path.write_text("\n".join(HAPPY) + "\n")
    rt = runtime.embedded(load_settings(), None, cli.providers_path)
    with RunProgress(Console(file=io.StringIO(), width=120), cli.store, cli.case_id) as run:
        assert "working on the next step" in drawn(run)  # before the first step
        assert run_case(rt, cli.case_id, max_steps=2, on_step=run).outcome == "YIELDED"
        assert "working on the next step" in drawn(run)  # a step that goes on
        assert run_case(rt, cli.case_id, on_step=run).outcome == "COMPLETED"
        last = drawn(run)
    assert "COMPLETED" in last and "working on the next step" not in last


def test_status_says_a_waiting_case_is_taken_up_after_its_wait(cli: Case) -> None:
    """After a pool child died in a model call, status said "none holds the case
    (`dispatch` ... starts one)" while the case waited for the call's grace: the operator
    dispatched, and the worker met the same wait (a fleet trial)."""
    from investigation.operations import status
    from workers.views import status_view

    info = {**status(cli.store, cli.case_id), "dispatch_lease_s": 0.0,
            "last_outcome": "RETRY_PENDING", "last_reason": "PROVIDER_CALL_IN_FLIGHT",
            "retry_not_before": "2026-12-07T01:30:00+00:00"}
    screen = Console(file=io.StringIO(), width=200, record=True)
    screen.print(status_view(info))
    flat = " ".join(screen.export_text().split())
    assert "dispatch: none holds the case: it waits until 2026-12-07T01:30:00+00:00, then " \
        "the workers take it up again (a `dispatch` before then meets the same wait)" in flat
    info["last_outcome"] = "PROGRESSED"
    screen.print(status_view(info))
    assert "dispatch: none holds the case (`dispatch` or the recovery sweep starts one)" in \
        " ".join(screen.export_text().split())


@pytest.mark.redis
def test_dispatch_take_over_ends_a_dead_workers_lease(
        cli: Case, monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    """A SIGKILLed worker's lease kept its case waiting about six minutes, and nothing an
    operator could run shortened it (a fleet trial): `dispatch --take-over` ends it, with
    a tombstone, so the old chain cannot take the lock again."""
    from investigation.constants import REDIS_LOCK_KEY
    from workers.locks import RELEASED_SUFFIX

    queue = "takeover-" + uuid.uuid4().hex[:8]
    monkeypatch.setenv("INVESTIGATE_BROKER_URL", redis_url)
    monkeypatch.setenv("INVESTIGATE_QUEUE", queue)
    key = REDIS_LOCK_KEY.format(case_id=cli.case_id)
    client = redis.Redis.from_url(redis_url)
    try:
        client.set(key, "dead-worker-token", px=300_000)
        busy = invoke("dispatch", cli.case_id)
        assert busy.exit_code == 3, busy.output
        assert f"`investigate dispatch {cli.case_id} --take-over` does now" in \
            " ".join(busy.output.split())
        held = " ".join(invoke("status", cli.case_id).output.split())
        assert f"`dispatch {cli.case_id} --take-over` now" in held, held
        assert client.llen(queue) == 0 and client.get(key) == b"dead-worker-token"
        taken = invoke("dispatch", cli.case_id, "--take-over")
        assert taken.exit_code == 0, taken.output
        assert "ended the lease of dispatch dead-wor... (it stops at its next stage" in \
            taken.output and f"dispatched {cli.case_id}" in taken.output
        assert client.llen(queue) == 1
        assert client.get(key) not in (None, b"dead-worker-token")
        assert client.exists(key + RELEASED_SUFFIX + "dead-worker-token")
        client.delete(key)
        free = json.loads(invoke("dispatch", cli.case_id, "--take-over", "--json").stdout)
        assert free["dispatched"] is True and free["took_over"] is None
    finally:
        client.delete(queue, f"_kombu.binding.{queue}", key,
                      key + RELEASED_SUFFIX + "dead-worker-token")
        client.close()


def test_pause_prints_resume_with_the_home_it_used(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`pause` printed `investigate resume CASE` without the INVESTIGATE_HOME= prefix every
    other printed command carries (a re-trial)."""
    home = tmp_path / "home"
    home.mkdir()
    case = make_case(tmp_path / "case", database_url=f"sqlite:///{home / 'investigation.db'}")
    monkeypatch.setenv("INVESTIGATE_HOME", str(home))
    monkeypatch.delenv("INVESTIGATE_DATABASE_URL", raising=False)
    paused = invoke("pause", case.case_id)
    assert paused.exit_code == 0, paused.output
    assert f"continue later with: INVESTIGATE_HOME={home} investigate resume {case.case_id}" \
        in " ".join(paused.output.split()), paused.output
    case.store.dispose()


def test_an_interrupted_run_says_so_and_how_to_continue(tmp_path: Path) -> None:
    """Ctrl-C on `run` exited 130 without a word (Typer's own handling; a hostile trial
    interrupted it 120 times): it now says what was kept and the command that continues,
    and the case continues from there."""
    import signal
    import subprocess
    import sys
    import time

    from investigation.llm.replay_server import Fault, ReplayServer

    server = ReplayServer(HAPPY, faults=[Fault.delay(30.0)]).start()
    try:
        case = make_case(tmp_path / "case")
        providers = tmp_path / "slow.toml"
        providers.write_text('[[providers]]\nname = "slow"\nkind = "openai"\n'
                             f'base_url = "{server.base_url}"\nmodel = "replay"\n'
                             "timeout_s = 60\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("INVESTIGATE_")}
        env.update(INVESTIGATE_HOME=str(tmp_path / "home"),
                   INVESTIGATE_DATABASE_URL=case.store.url)
        exe = str(Path(sys.executable).with_name("investigate"))
        proc = subprocess.Popen([exe, "run", case.case_id, "--providers", str(providers)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        deadline = time.monotonic() + 60
        while not server.requests:  # inside the model call
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, errs = proc.communicate(timeout=60)
        assert proc.returncode == 130, (out, errs)
        flat = " ".join(errs.split())
        assert "error INTERRUPTED: interrupted (Ctrl-C): every stage it finished is kept; " \
            f"`investigate run {case.case_id} --providers {providers}` continues the case" \
            " (a model call it interrupted is waited out first, up to the gateway's " \
            "in-flight grace: 125 s with these providers, twice the longest timeout_s and " \
            "5 s)" in flat, flat
        assert "Traceback" not in errs
        checked = subprocess.run([exe, "verify", case.case_id], env=env, capture_output=True,
                                 text=True, timeout=60, check=False)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    finally:
        server.stop()
