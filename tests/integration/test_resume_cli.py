"""Operator resume through the command line (seed 000, "Provider failures and external tests").

`investigate run` meets a provider failure over a loopback HTTP server, the operator reads
`status`, fixes the cause and runs `investigate resume CASE --retry-id ID`; the case then
completes. A retry id opens a new transport operation for an exhausted or configuration-
failed call, resets no iteration, credit, evidence or invalid-reply counter, and cannot
override an ordinary backoff. A saved successful call or plan completes without another
model call even after the providers file changed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import col, select
from typer.testing import CliRunner, Result

from investigation.llm import ReplayServer
from investigation.llm.replay_server import Fault
from investigation.loop.investigator import Investigator
from investigation.loop.outcome import StepKey
from investigation.loop.stages import Stages
from investigation.store.models import LLMAttempt, LLMOperation, StageRun
from tests import casekit
from tests.casekit import Case, make_case
from workers.cli import app

KEY = "sk-loopback-SECRET"
HAPPY = [json.dumps(r) for r in casekit.HAPPY_REPLIES]


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Case]:
    """A registered case whose store the CLI uses; LOOPBACK_KEY holds the API key."""
    case = make_case(tmp_path / "case")
    monkeypatch.setenv("INVESTIGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("INVESTIGATE_DATABASE_URL", case.store.url)
    monkeypatch.delenv("INVESTIGATE_PROVIDERS", raising=False)
    monkeypatch.delenv("INVESTIGATE_CONFIG", raising=False)
    monkeypatch.setenv("LOOPBACK_KEY", KEY)
    monkeypatch.chdir(tmp_path)
    yield case


@pytest.fixture
def servers() -> Iterator[list[ReplayServer]]:
    started: list[ReplayServer] = []
    yield started
    for server in started:
        server.stop()


def serve(servers: list[ReplayServer], replies: list[str]) -> ReplayServer:
    server = ReplayServer(replies).start()
    servers.append(server)
    return server


def providers_file(path: Path, base_url: str, attempts: int = 3, delay_s: float = 0.05,
                   api_key_env: str = "LOOPBACK_KEY", name: str = "local") -> Path:
    path.write_text(
        f"[gateway]\nattempts = {attempts}\ndelay_s = {delay_s}\n\n"
        f'[[providers]]\nname = "{name}"\nkind = "openai"\nbase_url = "{base_url}"\n'
        f'model = "replay"\napi_key_env = "{api_key_env}"\ntimeout_s = 30\n')
    return path


def invoke(*args: str) -> Result:
    return CliRunner().invoke(app, list(args))


def status_json(case: Case) -> dict[str, Any]:
    res = invoke("status", case.case_id, "--json")
    assert res.exit_code == 0, res.output
    return dict(json.loads(res.stdout))


def counters(info: dict[str, Any]) -> dict[str, Any]:
    """What a resume must not reset."""
    return {"steps": info["steps"], "head": info["head_hash"],
            "evidence_count": info["evidence_count"],
            "accounts": [{k: a[k] for k in ("hypothesis_id", "status", "balance_units",
                                            "credit_units", "iterations",
                                            "pending_evidence_id", "invalid_streak",
                                            "last_rejection")}
                         for a in info["accounts"]]}


def operations(case: Case, step_seq: int) -> list[LLMOperation]:
    with case.store.session() as s:
        return list(s.exec(select(LLMOperation).where(
            LLMOperation.case_id == case.case_id, LLMOperation.step_seq == step_seq)
            .order_by(col(LLMOperation.id))))


def test_exhausted_call_resumes_with_a_retry_id_and_keeps_every_counter(
    cli: Case, servers: list[ReplayServer], tmp_path: Path
) -> None:
    # step 1 valid (E1), step 2 an invalid reply for H2 (streak 1), step 3 asks H2 again.
    server = serve(servers, [HAPPY[0], "this is not a reply", *HAPPY[1:]])
    providers = providers_file(tmp_path / "p.toml", server.base_url)
    res = invoke("run", cli.case_id, "--providers", str(providers), "--max-steps", "2")
    assert res.exit_code == 0, res.output
    assert "REJECTED" in res.output
    server.add_faults(*[Fault.http(503)] * 3)
    res = invoke("run", cli.case_id, "--providers", str(providers))
    assert res.exit_code == 1, res.output
    assert f"case {cli.case_id}: BLOCKED (PROVIDER_EXHAUSTED)" in res.output
    assert len(server.requests) == 2 + 3  # the configured attempts, then blocked

    blocked = status_json(cli)
    assert (blocked["state"], blocked["blocked_reason"]) == ("BLOCKED", "PROVIDER_EXHAUSTED")
    assert blocked["blocked_detail"].startswith("PROVIDER_SERVER_ERROR: all 3 attempts")
    streaks = {a["hypothesis_id"]: a["invalid_streak"] for a in blocked["accounts"]}
    assert streaks == {1: 0, 2: 1}
    text = invoke("status", cli.case_id)
    assert "state BLOCKED (PROVIDER_EXHAUSTED)" in text.output
    assert "why: PROVIDER_SERVER_ERROR: all 3 attempts" in text.output

    # Running a blocked case again sends nothing.
    res = invoke("run", cli.case_id, "--providers", str(providers))
    assert res.exit_code == 1 and len(server.requests) == 5
    # A plain resume is refused for a provider block; the retry id is required.
    res = invoke("resume", cli.case_id)
    assert res.exit_code == 2 and "RETRY_ID_REQUIRED" in res.output
    # An id no index, log or command can carry is refused before anything is read: a
    # 40,000-character one broke PostgreSQL's index for good, `--json` was taken as an
    # id, control characters were stored raw (a hostile-input trial).
    for bad in ("x" * 40_000, "--json", "a\x1b]0;PWNED\x07", "", "retry id", "é"):
        res = invoke("resume", cli.case_id, "--retry-id", bad)
        assert res.exit_code == 2 and "RETRY_ID_INVALID" in res.output, (bad, res.output)
        assert "\x1b" not in res.output and "try: investigate resume" in res.output
        assert status_json(cli)["state"] == "BLOCKED"
    assert "(40000 characters)" in invoke("resume", cli.case_id, "--retry-id",
                                          "x" * 40_000).output
    # The id's own error stands for a case that does not exist (CASE_NOT_FOUND hid it).
    unknown = invoke("resume", "case-0000000000000000", "--retry-id", "--json")
    assert unknown.exit_code == 2 and "RETRY_ID_INVALID" in unknown.output
    assert "try:" not in unknown.output
    res = invoke("resume", cli.case_id, "--retry-id", "outage-over")
    assert res.exit_code == 0, res.output
    assert f"resumed {cli.case_id} (was PROVIDER_EXHAUSTED)" in res.output
    resumed = status_json(cli)
    assert resumed["state"] == "INVESTIGATING"
    assert counters(resumed) == counters(blocked)  # iterations, credit, evidence, streak
    res = invoke("resume", cli.case_id, "--retry-id", "outage-over")
    assert res.exit_code == 2 and "CASE_NOT_BLOCKED" in res.output
    # A running case is not resumed but run (a new user was not told so).
    flat = " ".join(res.output.split())
    assert f"`investigate status {cli.case_id}` says whether a `run` or a worker has it " \
        f"now, and if none does, `investigate run {cli.case_id}` (or `dispatch`) goes on " \
        "with it" in flat, flat

    res = invoke("run", cli.case_id, "--providers", str(providers))
    assert res.exit_code == 0, res.output
    assert f"case {cli.case_id}: COMPLETED" in res.output
    res = invoke("resume", cli.case_id)
    assert res.exit_code == 2 and f"it is complete; `investigate summary {cli.case_id}`" in \
        " ".join(res.output.split())
    ops = operations(cli, 3)
    assert [(o.retry_id, o.status, o.attempts_made) for o in ops] == [
        ("", "exhausted", 3), ("outage-over", "succeeded", 1)]  # a new transport operation
    with cli.store.session() as s:
        sent = s.exec(select(LLMAttempt.request_sha256).where(
            col(LLMAttempt.operation_id).in_([o.id for o in ops]))).all()
    assert len(set(sent)) == 1  # the same frozen context went out every time


def test_configuration_failure_resumes_after_the_providers_file_is_fixed(
    cli: Case, servers: list[ReplayServer], tmp_path: Path
) -> None:
    server = serve(servers, HAPPY)
    good = providers_file(tmp_path / "good.toml", server.base_url)
    assert invoke("run", cli.case_id, "--providers", str(good), "--max-steps", "1"
                  ).exit_code == 0
    before = counters(status_json(cli))
    wrong = providers_file(tmp_path / "wrong.toml", server.base_url.removesuffix("/v1") + "/v2")
    res = invoke("run", cli.case_id, "--providers", str(wrong))
    assert res.exit_code == 1, res.output
    assert "BLOCKED (PROVIDER_CONFIGURATION)" in res.output
    assert "PROVIDER_HTTP_CLIENT_ERROR" in res.output and "404" in res.output
    info = status_json(cli)
    assert info["blocked_reason"] == "PROVIDER_CONFIGURATION"
    assert counters(info) == before
    assert invoke("resume", cli.case_id, "--retry-id", "fixed-url").exit_code == 0
    res = invoke("run", cli.case_id, "--providers", str(good))
    assert res.exit_code == 0 and "COMPLETED" in res.output, res.output
    assert [(o.retry_id, o.status) for o in operations(cli, 2)] == [
        ("", "failed"), ("fixed-url", "succeeded")]


def test_missing_key_blocks_as_credentials_and_resumes_once_it_is_set(
    cli: Case, servers: list[ReplayServer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve(servers, HAPPY)
    providers = providers_file(tmp_path / "p.toml", server.base_url, api_key_env="LATER_KEY")
    monkeypatch.delenv("LATER_KEY", raising=False)
    res = invoke("run", cli.case_id, "--providers", str(providers))
    assert res.exit_code == 1 and "BLOCKED (PROVIDER_CREDENTIALS)" in res.output, res.output
    assert "LATER_KEY" in res.output  # the message names the variable to set
    assert server.requests == []  # nothing was sent without a key
    monkeypatch.setenv("LATER_KEY", KEY)
    assert invoke("resume", cli.case_id, "--retry-id", "key-set").exit_code == 0
    res = invoke("run", cli.case_id, "--providers", str(providers))
    assert res.exit_code == 0 and "COMPLETED" in res.output, res.output


def test_a_retry_id_cannot_override_an_ordinary_backoff(
    cli: Case, servers: list[ReplayServer], tmp_path: Path
) -> None:
    server = serve(servers, HAPPY)
    server.add_faults(Fault.http(429, retry_after="600"))
    providers = providers_file(tmp_path / "p.toml", server.base_url)
    res = invoke("run", cli.case_id, "--providers", str(providers), "--no-wait")
    assert res.exit_code == 4, res.output  # returned at once: nobody sleeps
    assert "RETRY_PENDING (PROVIDER_RATE_LIMITED) until" in res.output
    info = status_json(cli)
    assert info["state"] == "INVESTIGATING" and info["retry_not_before"] is not None
    res = invoke("resume", cli.case_id, "--retry-id", "impatient")
    assert res.exit_code == 2 and "CASE_NOT_BLOCKED" in res.output
    res = invoke("run", cli.case_id, "--providers", str(providers), "--no-wait")
    assert res.exit_code == 4 and len(server.requests) == 1  # still backing off, no request
    assert status_json(cli)["retry_not_before"] == info["retry_not_before"]
    assert [o.retry_id for o in operations(cli, 1)] == [""]


class Crash(Exception):
    """Stands for a worker that dies inside a stage's transaction."""


@pytest.mark.parametrize("saved", ["plan", "call"])
def test_a_saved_success_completes_without_another_model_call_after_a_config_change(
    cli: Case, servers: list[ReplayServer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    saved: str,
) -> None:
    """``plan``: the step stopped after ``persist_plan``. ``call``: the worker died inside
    ``llm_call`` after the gateway stored the success but before the stage's marker."""
    server = serve(servers, HAPPY)
    providers = providers_file(tmp_path / "p.toml", server.base_url)
    from workers.runtime import build_env
    from workers.settings import Settings

    env = build_env(Settings(), providers_path=providers)
    key = Investigator(env).next_step(cli.case_id)
    assert isinstance(key, StepKey)
    stages = Stages(env)
    stages.run("build_context", key)
    if saved == "plan":
        for stage in ("llm_call", "validate", "persist_plan"):
            # Each stage finishes (a loaded machine once made the model call time out,
            # and the test then failed later, in validate, as STAGE_ORDER).
            assert stages.run(stage, key).halt is None, stage
    else:
        original = Stages._complete

        def crashing(s: Any, k: StepKey, name: str, output: dict[str, Any]) -> Any:
            if name == "llm_call":
                raise Crash("killed inside llm_call")
            return original(s, k, name, output)

        monkeypatch.setattr(Stages, "_complete", staticmethod(crashing))
        with pytest.raises(Crash):
            stages.run("llm_call", key)
        monkeypatch.setattr(Stages, "_complete", staticmethod(original))
    assert len(server.requests) == 1
    # The operator now points the providers file at another, unreachable provider.
    moved = providers_file(tmp_path / "moved.toml", "http://127.0.0.1:9/v1", name="elsewhere")
    res = invoke("run", cli.case_id, "--providers", str(moved), "--max-steps", "1")
    assert res.exit_code == 0, res.output
    assert "step   1 H1: PROGRESSED" in res.output
    assert len(server.requests) == 1
    with cli.store.session() as s:
        attempts = s.exec(select(LLMAttempt)).all()
        stages_done = s.exec(select(StageRun.stage).where(StageRun.step_seq == 1)).all()
    assert [(a.provider, a.status) for a in attempts] == [("local", "succeeded")]
    assert "publish" in stages_done
    assert status_json(cli)["evidence_count"] == 1
