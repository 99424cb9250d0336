"""``investigation.guidance``: every state and blocked reason gets its own advice with
commands that can be copied as they are."""

from __future__ import annotations

import shlex

import pytest

from investigation import constants
from investigation.guidance import BLOCK_REASONS, CaseFacts, advise
from investigation.lifecycle import TerminationReason

CASE = "case-0123456789abcdef"


def _facts(**kw: object) -> CaseFacts:
    base: dict[str, object] = {"case_id": CASE, "state": "BLOCKED", "steps": 4,
                               "retry_id": "retry-5-1", "next_call_index": 6}
    base.update(kw)
    return CaseFacts(**base)  # type: ignore[arg-type]


def test_every_block_reason_the_engine_sets_is_covered() -> None:
    declared = {v for k, v in vars(constants).items() if k.startswith("BLOCK_")}
    assert declared == set(BLOCK_REASONS)
    generic = advise(_facts(blocked_reason="SOMETHING_NEW")).headline
    headlines = set()
    for reason in BLOCK_REASONS:
        g = advise(_facts(blocked_reason=reason))
        assert g.headline != generic and not g.final
        assert any(s.command for s in g.steps)
        headlines.add(g.headline)
    assert len(headlines) == len(BLOCK_REASONS)


@pytest.mark.parametrize("reason", ["PROVIDER_EXHAUSTED", "PROVIDER_CONFIGURATION",
                                    "PROVIDER_CREDENTIALS"])
def test_provider_blocks_give_the_exact_resume_with_a_fresh_retry_id(reason: str) -> None:
    g = advise(_facts(blocked_reason=reason, error_code="PROVIDER_SERVER_ERROR",
                      error_message="HTTP 503"), "embedded", "conf/providers.toml")
    commands = [s.command for s in g.steps if s.command]
    assert f"investigate resume {CASE} --retry-id retry-5-1" in commands
    assert f"investigate run {CASE} --providers conf/providers.toml" in commands
    assert "PROVIDER_SERVER_ERROR: HTTP 503" in g.headline


@pytest.mark.parametrize(("reason", "code", "fixed"), [
    ("PROVIDER_CONFIGURATION", "PROVIDER_REQUEST_TOO_LARGE", True),
    ("PROVIDER_EXHAUSTED", "PROVIDER_SERVER_ERROR", True),
    ("INVALID_LLM_RESPONSES", "REPLY_SCHEMA_INVALID", True),
    ("PROVIDER_CONFIGURATION", "PROVIDER_SCRIPT_EXHAUSTED", False),
    ("PROVIDER_CREDENTIALS", "PROVIDER_CREDENTIALS_MISSING", False),
])
def test_a_block_the_providers_file_caused_says_to_run_with_it_fixed(
        reason: str, code: str, fixed: bool) -> None:
    """A real model's user, whose case blocked on providers-small.toml, was offered that
    file again with no word that it is the one to fix (or replace)."""
    g = advise(_facts(blocked_reason=reason, error_code=code), "embedded",
               "providers-small.toml")
    run = next(s for s in g.steps if s.command and s.command.startswith("investigate run"))
    assert run.command == f"investigate run {CASE} --providers providers-small.toml"
    said = "run it again once that providers file is fixed (or name another one)"
    assert (run.text == said) is fixed, run.text


def test_invalid_replies_point_at_the_next_script_line() -> None:
    g = advise(_facts(blocked_reason="INVALID_LLM_RESPONSES", error_code="REPLY_NOT_JSON"),
               "distributed")
    text = "\n".join(g.lines())
    assert f"$ investigate resume {CASE}\n" in text + "\n"
    assert "--retry-id" not in text  # a plain resume: the provider is not the problem
    assert "reads its reply line 7, blank lines not counted" in text
    assert f"investigate replies check replies.jsonl {CASE}" in text
    assert f"investigate dispatch {CASE}" in text and "investigate run" not in text


def test_invalid_replies_from_a_model_server_name_no_reply_file() -> None:
    """A providers file with only a model server: no scripted-file line to check (a new
    user's trial was told what line 6 of a reply file would hold)."""
    g = advise(_facts(blocked_reason="INVALID_LLM_RESPONSES"), "embedded", "http.toml")
    assert "replies check" not in "\n".join(g.lines())
    scripted = advise(_facts(blocked_reason="INVALID_LLM_RESPONSES"), "embedded",
                      "p.toml", "replies.jsonl")
    assert f"investigate replies check replies.jsonl {CASE}" in "\n".join(scripted.lines())
    # A real model that repeated its refused reply at temperature 0 and blocked again
    # after a resume: what may help, and that the resume keeps the count (a real model's
    # user); where the rules and their codes are.
    text = " ".join(" ".join(g.lines()).split())
    assert "higher `temperature`" in text and "blocks it again" in text
    assert "docs/investigation-loop.md" in text
    assert "temperature" not in " ".join(scripted.lines())  # a reply file has none


def test_states_and_outcomes() -> None:
    assert advise(_facts(state="BUILDING_DIAGNOSIS")).final
    assert advise(_facts(state="CANCELLED")).final
    stopped = advise(_facts(state="STOPPED", blocked_reason="SESSION_BUDGET_EXHAUSTED"))
    assert stopped.final and "SESSION_BUDGET_EXHAUSTED" in stopped.headline
    paused = advise(_facts(state="PAUSED", blocked_reason="PROVIDER_EXHAUSTED"))
    assert paused.steps[0].command == f"investigate resume {CASE}"
    assert "PROVIDER_EXHAUSTED" in paused.headline
    # Paused between steps: resume, then run with the providers file in use (a new user's
    # trial saw the placeholder though INVESTIGATE_PROVIDERS was set).
    plain = advise(_facts(state="PAUSED", blocked_reason=None), None, "my providers.toml")
    assert f"investigate run {CASE} --providers 'my providers.toml'" in \
        [s.command for s in plain.steps]
    pending = advise(_facts(state="INVESTIGATING", last_outcome="RETRY_PENDING",
                            retry_not_before="2030-01-01T00:00:00+00:00"))
    assert "2030-01-01T00:00:00+00:00" in pending.headline and not pending.final
    # Nothing continues an embedded case by itself (a new user's trial read "the case
    # continues by itself" above "run it again after that time").
    for mode, says in ((None, "workers take the case up by themselves, an embedded case "
                              "when it runs again"),
                       ("distributed", "the workers take the case up again by themselves"),
                       ("embedded", "when the case runs (`run` waits for it unless "
                                    "--no-wait)")):
        headline = advise(_facts(state="INVESTIGATING", last_outcome="RETRY_PENDING",
                                 retry_not_before="2030-01-01T00:00:00+00:00"), mode).headline
        assert says in headline and "continues by itself" not in headline, headline
    for code, says in (("PROVIDER_RATE_LIMITED", "The provider asked for a pause"),
                       ("PROVIDER_UNREACHABLE", "The model call failed for now and is "
                                                "retried (PROVIDER_UNREACHABLE"),
                       ("PROVIDER_CALL_IN_FLIGHT", "A request for this model call is "
                                                   "still out, or its reply was never stored")):
        waiting = advise(_facts(state="INVESTIGATING", last_outcome="RETRY_PENDING",
                                last_reason=code, error_code=code,
                                retry_not_before="2030-01-01T00:00:00Z"))
        assert waiting.headline.startswith(says), waiting.headline
        assert "pause" not in waiting.headline or code == "PROVIDER_RATE_LIMITED"
    # A timeout would repeat as it is: raising timeout_s comes first (a real model's user
    # with timeout_s = 1 was told only to run again).
    timed_out = advise(_facts(state="INVESTIGATING", last_outcome="RETRY_PENDING",
                              last_reason="PROVIDER_TIMEOUT", error_code="PROVIDER_TIMEOUT",
                              retry_not_before="2030-01-01T00:00:00Z"), "embedded", "p.toml")
    assert timed_out.steps[0].text.startswith("if calls of this model take longer than "
                                              "timeout_s, raise it in the providers file")
    assert timed_out.steps[0].command == "investigate providers check --providers p.toml"
    assert timed_out.steps[1].command == f"investigate run {CASE} --providers p.toml"
    unreachable = advise(_facts(state="INVESTIGATING", last_outcome="RETRY_PENDING",
                                last_reason="PROVIDER_UNREACHABLE",
                                retry_not_before="2030-01-01T00:00:00Z"), "embedded", "p.toml")
    assert "timeout_s" not in unreachable.steps[0].text
    resumed = advise(_facts(state="INVESTIGATING", last_outcome="RESUMED",
                            last_reason="INVALID_LLM_RESPONSES"), "embedded", "p.toml")
    assert "resumed (it was INVALID_LLM_RESPONSES)" in resumed.headline
    assert resumed.steps[0].command == f"investigate run {CASE} --providers p.toml"
    fresh = advise(_facts(state="INVESTIGATING", steps=0, last_outcome=None))
    assert fresh.headline == "No step has run yet."
    # A first step cut inside its model call is under way, not "not run yet" (a hostile
    # trial: `verify` said "step 1 in progress" beside it).
    cut = advise(_facts(state="INVESTIGATING", steps=0, last_outcome=None,
                        step_started=True), "embedded", "p.toml")
    assert cut.headline.startswith("Step 1 was started and has not finished")
    assert cut.steps[0].command == f"investigate run {CASE} --providers p.toml"
    yielded = advise(_facts(state="INVESTIGATING", last_outcome="YIELDED",
                            last_reason="MAX_STEPS"), "embedded", "p.toml")
    assert yielded.steps[0].command == f"investigate run {CASE} --providers p.toml"
    test = advise(_facts(blocked_reason="AWAITING_TEST_FEEDBACK", awaiting_tests=("T2",)))
    assert f"investigate tests show {CASE} T2 --secret" in [s.command for s in test.steps]
    # Every lifecycle stop reason reads as a stop, never as something to resume.
    for reason in TerminationReason:
        g = advise(_facts(state="STOPPED", blocked_reason=f"SESSION_{reason.value}"))
        assert g.final and not any("resume" in (s.command or "") for s in g.steps)


def test_commands_quote_what_they_carry() -> None:
    g = advise(_facts(blocked_reason="PROVIDER_EXHAUSTED"), "embedded",
               "my providers/it's.toml")
    run = next(s.command for s in g.steps if s.command and " run " in s.command)
    assert shlex.split(run)[-1] == "my providers/it's.toml"


@pytest.mark.parametrize(("mode", "watched"), [("embedded", False), ("distributed", True),
                                               (None, True)])
def test_a_yielded_case_is_watched_only_where_workers_run_it(mode: str | None,
                                                             watched: bool) -> None:
    g = advise(_facts(state="INVESTIGATING", blocked_reason=None, last_outcome="YIELDED"),
               mode, "p.toml")  # type: ignore[arg-type]
    text = "\n".join(g.lines())
    assert ("--watch" in text) is watched
    if mode == "embedded":
        assert f"investigate run {CASE} --providers p.toml" in text


def test_the_script_hint_names_the_file_once() -> None:
    g = advise(_facts(blocked_reason="INVALID_LLM_RESPONSES", error_code="REPLY_NOT_JSON"))
    text = "\n".join(g.lines())
    assert "file: the file" not in text and "JSON Lines file: the next model call" in text


@pytest.mark.parametrize(("code", "says", "command"), [
    ("CHECKPOINT_INVALID", "does not replay", f"investigate verify {CASE}"),
    ("CONTEXT_TOO_LARGE", "raise it in their INVESTIGATE_CONFIG file", None),
    ("SOMETHING_ELSE", None, None),
])
def test_a_workers_step_error_is_named_with_its_step_and_what_to_do(
        code: str, says: str | None, command: str | None) -> None:
    """A case whose next step a worker's stage stopped with a controlled error (last
    outcome ERROR): the headline names the step and the code, the worker log's line to
    look for, and how the case goes on; before, status said only 'investigating'."""
    g = advise(_facts(state="INVESTIGATING", last_outcome="ERROR", last_reason=code))
    assert g.headline.startswith(f"Step 5 failed on a worker with {code};")
    text = "\n".join(g.lines())
    assert f"`case {CASE} step 5 STAGE failed: {code}: ...`" in text
    commands = [s.command for s in g.steps if s.command]
    assert commands[-1] == f"investigate cancel {CASE}"  # the workers' dispatch first
    assert commands[-3:-1] == [f"investigate dispatch {CASE}",
                               f"investigate run {CASE} --providers providers.toml"]
    if says:
        assert says in text
    if command:
        assert command in commands
    assert ("investigate verify" in text) == (command is not None)
    assert not g.final


def test_replies_cut_at_max_tokens_say_to_raise_max_tokens() -> None:
    """A user of a real model with max_tokens = 40 was told to fix the model and its
    server; the replies had been cut at max_tokens."""
    cut = advise(_facts(blocked_reason="INVALID_LLM_RESPONSES", error_code="REPLY_TRUNCATED",
                        error_message="cut at max_tokens"))
    assert "raise max_tokens" in cut.steps[0].text
    other = advise(_facts(blocked_reason="INVALID_LLM_RESPONSES", error_code="REPLY_NOT_JSON"))
    assert not any("max_tokens" in s.text for s in other.steps)


@pytest.mark.parametrize("mode", ["embedded", "distributed", None])
def test_waits_and_credentials_speak_of_the_runtimes_the_shell_has(mode: str | None) -> None:
    """A shell without a broker was told that workers come back by themselves and to
    restart them after setting a key (a new user's trial, an embedded `run`)."""
    pending = "\n".join(advise(_facts(state="INVESTIGATING", last_outcome="RETRY_PENDING",
                                      retry_not_before="2030-01-01T00:00:00Z"),
                               mode, "p.toml").lines())  # type: ignore[arg-type]
    credentials = "\n".join(advise(_facts(blocked_reason="PROVIDER_CREDENTIALS"),
                                   mode, "p.toml").lines())  # type: ignore[arg-type]
    assert ("investigate run " in pending) is (mode != "distributed"), pending
    assert ("workers come back" in pending) is (mode != "embedded"), pending
    assert ("restart them" in credentials) is (mode != "embedded"), credentials
    assert ("investigate run`" in credentials) is (mode != "distributed"), credentials


def test_a_raised_money_cap_reaches_workers_only_after_a_restart() -> None:
    """A fleet operator raised max_model_cost, resumed and dispatched: the workers still
    had the old cap and the retry id was spent (a fleet trial)."""
    for mode, restart in (("distributed", True), (None, True), ("embedded", False)):
        text = "\n".join(advise(_facts(blocked_reason="MODEL_COST_CAP"), mode,  # type: ignore[arg-type]
                                "p.toml").lines())
        assert ("restart them after the edit" in text) is restart, text
        assert "max_model_cost" in text


def test_a_long_provider_message_is_cut_at_a_word_and_marked() -> None:
    """`next:` cut a message mid-word ("every configured provider rej)") and it read as
    the whole message (a real model's user)."""
    from investigation.guidance import _clip

    message = ("provider 'local' dropped the connection on this request (attempt 1, "
               "analysis/investigation/0004/llm/4/attempt-03.request.json) " * 4
               + "(every configured provider rejected this request)")
    cut = _clip(message, 300)
    assert len(cut) <= 300 and cut.endswith("...") and message.startswith(cut[:-3])
    assert message[len(cut) - 3] == " "  # the cut is at a word's end
    assert _clip("short", 300) == "short"


def test_runs_line_for_a_cut_reply_tells_the_operator_of_max_tokens() -> None:
    """`run` printed the repair message meant for the model ("write shorter text
    fields") and nothing about max_tokens until the third cut reply blocked the case,
    each a whole model call (a real model's user)."""
    from investigation.loop.outcome import Outcome
    from workers.views import outcome_line

    cut = Outcome("REJECTED", CASE, 5, reason="REPLY_TRUNCATED", hypothesis_id=1,
                  details={"rejection": "REPLY_TRUNCATED", "message": "write shorter text"})
    lines = outcome_line(cut)
    assert lines[0] == "step   5 H1: REJECTED (REPLY_TRUNCATED)"
    assert "max_tokens cut the reply: raise it in the providers file" in lines[-1]
    other = Outcome("REJECTED", CASE, 5, reason="REPLY_NOT_JSON",
                    details={"rejection": "REPLY_NOT_JSON", "message": "x"})
    assert not any("max_tokens" in line for line in outcome_line(other))


def test_dispatch_advice_says_what_lock_busy_means() -> None:
    """`dispatch` after `resume` often met the sweep's dispatch first and printed
    LOCK_BUSY with exit 3, which a fleet trial read as a failure."""
    for mode in ("distributed", None):
        text = "\n".join(advise(_facts(state="PAUSED", blocked_reason=None), mode,  # type: ignore[arg-type]
                                "p.toml").lines())
        assert "LOCK_BUSY (exit 3) means a worker already has it" in text, text
    embedded = "\n".join(advise(_facts(state="PAUSED", blocked_reason=None), "embedded",
                                "p.toml").lines())
    assert "LOCK_BUSY" not in embedded


def test_a_step_line_says_what_the_step_did() -> None:
    from investigation.loop.outcome import Outcome
    from workers.views import facts_text, outcome_line

    step = Outcome("PROGRESSED", "case-x", 4, hypothesis_id=1)
    facts = {"action": "query", "operation": "source.search", "model_ms": 53210,
             "prompt_tokens": 3120, "completion_tokens": 140}
    assert outcome_line(step, facts)[0] == (
        "step   4 H1: PROGRESSED; source.search, model 53.2 s, tokens 3120 + 140")
    assert facts_text({"action": "finish", "operation": None, "model_ms": 900,
                       "prompt_tokens": None, "completion_tokens": None}) == \
        "; finish, model 0.9 s"
    assert facts_text(None) == "" and outcome_line(step)[0] == "step   4 H1: PROGRESSED"
    # An operation name is data from the store: escaped for the terminal.
    assert "\x1b" not in outcome_line(step, {"operation": "x\x1b[2J"})[0]


@pytest.mark.parametrize(("code", "first"), [
    ("PROVIDER_MALFORMED_RESPONSE", "the server answered, but not with a chat completion"),
    ("PROVIDER_SERVER_ERROR", "the server answered with errors (HTTP 5xx)"),
    ("PROVIDER_TIMEOUT", "raise timeout_s"),
    ("PROVIDER_UNREACHABLE", "make the provider reachable (is the server up?"),
    (None, "make the provider reachable (is the server up?"),
])
def test_exhaustion_says_first_what_the_last_attempt_met(code: str | None,
                                                         first: str) -> None:
    """A server answering 200 with an HTML page was told to "make the provider reachable"
    (a fleet trial): the server was up."""
    g = advise(_facts(blocked_reason="PROVIDER_EXHAUSTED", error_code=code,
                      error_message="x"), "distributed", "p.toml")
    assert first in g.steps[0].text, g.steps[0].text


def test_credentials_advice_holds_without_api_key_env() -> None:
    """A provider without api_key_env was told to check "the variable named by
    api_key_env" (a fleet trial): the step says to add it."""
    g = advise(_facts(blocked_reason="PROVIDER_CREDENTIALS", error_code="PROVIDER_CREDENTIALS",
                      error_message="HTTP 401"), "distributed", "p.toml")
    assert "a provider without api_key_env sends no key: add it" in g.steps[0].text


def test_an_unset_key_variable_is_not_called_a_refusal() -> None:
    """A fleet trial's case blocked on an unset api_key_env variable: the headline said
    "the provider refused the credentials", though nothing was sent."""
    unset = advise(_facts(blocked_reason="PROVIDER_CREDENTIALS",
                          error_code="PROVIDER_CREDENTIALS_MISSING",
                          error_message="environment variable K is not set"), "distributed",
                   "p.toml").headline
    assert unset.startswith("Blocked: the provider's API key variable is not set (")
    assert "refused" not in unset and unset.endswith("Nothing was charged."), unset
    refused = advise(_facts(blocked_reason="PROVIDER_CREDENTIALS",
                            error_code="PROVIDER_CREDENTIALS", error_message="HTTP 401"),
                     "distributed", "p.toml").headline
    assert refused.startswith("Blocked: the provider refused the credentials ("), refused


def test_a_model_call_stopped_by_a_time_limit_is_said_to_be_waited_out() -> None:
    """A fleet trial's case resumed after a time limit stopped its model call sat in
    RETRY_PENDING (PROVIDER_CALL_IN_FLIGHT) for a minute, which the advice never said."""
    call = advise(_facts(blocked_reason="STAGE_TIME_LIMIT", stopped_stage="llm_call"),
                  "distributed", "p.toml")
    text = " ".join(s.text for s in call.steps)
    assert "the case waits for it first, up to the gateway's in-flight grace" in text, text
    query = advise(_facts(blocked_reason="STAGE_TIME_LIMIT", stopped_stage="build_context"),
                   "distributed", "p.toml")
    assert "in-flight grace" not in " ".join(s.text for s in query.steps)


@pytest.mark.parametrize(("environ", "prefix"), [
    ({}, ""),
    ({"INVESTIGATE_HOME": "h4/demo"}, "INVESTIGATE_HOME=h4/demo "),
    ({"INVESTIGATE_HOME": "my home"}, "INVESTIGATE_HOME='my home' "),
    # Run with a fleet shell's database cleared inline: the printed command clears it too
    # (without it, a pasted command read the fleet's case of the same id: a new user's trial).
    ({"INVESTIGATE_HOME": "h4/demo", "INVESTIGATE_DATABASE_URL": ""},
     "INVESTIGATE_HOME=h4/demo INVESTIGATE_DATABASE_URL= "),
    ({"INVESTIGATE_DATABASE_URL": ""}, "INVESTIGATE_DATABASE_URL= "),
    # A database URL names the store by itself, and is never repeated (a password).
    ({"INVESTIGATE_HOME": "h", "INVESTIGATE_DATABASE_URL": "postgresql://u:pw@db/x"}, ""),
    # A home set empty is the default home: a shell that exports another one must not
    # open it (a hostile trial).
    ({"INVESTIGATE_HOME": ""}, "INVESTIGATE_HOME= "),
    ({"INVESTIGATE_HOME": "", "INVESTIGATE_DATABASE_URL": ""},
     "INVESTIGATE_HOME= INVESTIGATE_DATABASE_URL= "),
    # Names in any letter case, as the settings read them.
    ({"investigate_home": "h4/demo"}, "INVESTIGATE_HOME=h4/demo "),
    ({"investigate_home": "h", "Investigate_Database_Url": "sqlite:////x.db"}, ""),
])
def test_printed_commands_open_the_store_this_command_opened(environ: dict[str, str],
                                                             prefix: str) -> None:
    from investigation.guidance import shell_env

    assert shell_env(environ) == prefix
