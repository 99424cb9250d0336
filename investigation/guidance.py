"""What to do next, with the exact command, for every state a case can be left in.

One place maps each scheduling outcome, blocked reason and case state to advice an
operator can follow from the command line (``docs/operations.md``, "Blocked cases"). Every
command that shows an outcome (``run``, ``dispatch``, ``status``, ``resume``, the HTML
report, ...) prints :func:`advise`'s steps, so the words stay the same everywhere.

Two layers:

* :func:`advise` is pure: it turns :class:`CaseFacts` into a :class:`Guidance`.
* :func:`facts_for` reads those facts from the store (one short read transaction).

Covered situations (a test checks every code below has its own advice):

==============================  ====================================================
state / reason                  advice
==============================  ====================================================
``BUILDING_DIAGNOSIS``          read the summary and the report
``INVESTIGATING`` (no step)     start it: ``run`` / ``dispatch``
``INVESTIGATING`` ``YIELDED``   continue: ``run`` / ``dispatch``
``RETRY_PENDING``               nothing: it comes back at ``retry_not_before``
``INVALID_LLM_RESPONSES``       fix the model or the reply file, ``resume``, ``run``
``PROVIDER_EXHAUSTED``          make the provider reachable, ``resume --retry-id``
``PROVIDER_CONFIGURATION``      fix the providers file (or the script), ``--retry-id``
``PROVIDER_CREDENTIALS``        set the key variable, ``resume --retry-id``
``AWAITING_TEST_FEEDBACK``      ``tests show``, ``feedback submit`` / ``confirm``
``STAGE_POISONED``              read the worker logs, ``resume``, ``dispatch``
``STAGE_TIME_LIMIT``            raise the worker's time limit, ``resume``, ``dispatch``
``INVESTIGATING`` ``ERROR``     a worker's stage failed: its log, ``verify``, ``dispatch``
``MODEL_COST_CAP``              raise ``limits.max_model_cost``, ``resume --retry-id``
``PAUSED``                      ``resume`` (or ``cancel``)
``CANCELLED``                   final: keep the record (``report``, ``export``)
``STOPPED`` ``SESSION_*``       final: a lifecycle bound ended it
==============================  ====================================================

``PROVIDER_CONFIGURATION`` with the error code ``MODEL_COST_CURRENCY_CHANGED`` is the
policy's, not the providers file's: set ``limits.currency`` back, ``resume --retry-id``.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from sqlmodel import col, select

from investigation import jsonio
from investigation.config import ProvidersConfig
from investigation.constants import (
    BLOCK_AWAITING_TEST_FEEDBACK,
    BLOCK_INVALID_LLM_RESPONSES,
    BLOCK_MODEL_COST_CAP,
    BLOCK_PROVIDER_CONFIGURATION,
    BLOCK_PROVIDER_CREDENTIALS,
    BLOCK_PROVIDER_EXHAUSTED,
    BLOCK_STAGE_POISONED,
    BLOCK_STAGE_TIME_LIMIT,
    CASE_BLOCKED,
    CASE_BUILDING_DIAGNOSIS,
    CASE_CANCELLED,
    CASE_INVESTIGATING,
    CASE_PAUSED,
    CASE_STOPPED,
    RETRY_PENDING,
    STEP_ERROR,
)
from investigation.errors import InvestigationError
from investigation.llm.scripted import script_path_of
from investigation.llm.spend import MODEL_COST_CURRENCY_CHANGED
from investigation.llm.types import (
    PROVIDER_CALL_IN_FLIGHT,
    PROVIDER_RATE_LIMITED,
    PROVIDER_TIMEOUT,
)
from investigation.loop import deliveries
from investigation.store.engine import Store
from investigation.store.models import (
    BudgetAccount,
    CaseRecord,
    LLMOperation,
    StageRun,
    TestRequest,
)

#: Where the advice is shown: ``embedded`` (``run``), ``distributed`` (``dispatch``,
#: workers) or ``None`` when the caller cannot tell (``status``): both ways are given.
Mode = Literal["embedded", "distributed"] | None

#: Every blocked reason the engine sets (``constants.BLOCK_*``); each has its own advice.
BLOCK_REASONS = (BLOCK_INVALID_LLM_RESPONSES, BLOCK_PROVIDER_EXHAUSTED,
                 BLOCK_PROVIDER_CONFIGURATION, BLOCK_PROVIDER_CREDENTIALS,
                 BLOCK_MODEL_COST_CAP, BLOCK_AWAITING_TEST_FEEDBACK, BLOCK_STAGE_POISONED,
                 BLOCK_STAGE_TIME_LIMIT)
#: The block reasons a ``resume --retry-id`` applies to.
PROVIDER_BLOCKS = (BLOCK_PROVIDER_EXHAUSTED, BLOCK_PROVIDER_CONFIGURATION,
                   BLOCK_PROVIDER_CREDENTIALS, BLOCK_MODEL_COST_CAP)


@dataclass(frozen=True)
class Step:
    """One thing to do: what and why (``text``), and the command that does it, if any."""

    text: str
    command: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "command": self.command}


@dataclass(frozen=True)
class Guidance:
    """Advice for one case: a one-line ``headline`` and the ``steps`` in order.

    ``final`` is True when nothing can continue the case (completed, cancelled, stopped).
    """

    headline: str
    steps: tuple[Step, ...]
    final: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``status --json`` ``next``)."""
        return {"headline": self.headline, "final": self.final,
                "steps": [s.to_dict() for s in self.steps]}

    @property
    def first_command(self) -> str | None:
        """The first command to run, or ``None`` (for a one-line view such as a case list)."""
        return next((s.command for s in self.steps if s.command), None)

    def lines(self) -> list[str]:
        """Plain text lines: the headline, then ``  - text`` / ``      $ command``."""
        out = [self.headline]
        for step in self.steps:
            out.append(f"  - {step.text}")
            if step.command:
                out.append(f"      $ {step.command}")
        return out


@dataclass(frozen=True)
class CaseFacts:
    """What the advice depends on (all read from the store by :func:`facts_for`).

    Attributes:
        case_id: the case.
        state: the case state (``INVESTIGATING``, ``BLOCKED``, ``PAUSED``, ...).
        blocked_reason: the block reason (kept while paused), or ``None``.
        last_outcome, last_reason: the last scheduling outcome and its reason code.
        steps: published steps (the case head).
        retry_not_before: ISO 8601 time of a pending provider backoff, or ``None``.
        error_code, error_message: the last provider failure or rejected reply, if any.
        next_call_index: the 0-based index of the next model call (a scripted provider
            serves line ``next_call_index + 1`` of its file for it).
        retry_id: a retry id this case has never used (for ``resume --retry-id``).
        awaiting_tests: request ids of external tests that wait for feedback.
        step_started: the next step's model call was opened (the step is under way, or a
            run or worker stopped inside it).
        stopped_stage: for ``STAGE_TIME_LIMIT``, the stage a worker's time limit stopped.
    """

    case_id: str
    state: str
    blocked_reason: str | None = None
    last_outcome: str | None = None
    last_reason: str | None = None
    steps: int = 0
    retry_not_before: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    next_call_index: int = 0
    retry_id: str = "retry-1"
    awaiting_tests: tuple[str, ...] = field(default_factory=tuple)
    step_started: bool = False
    stopped_stage: str | None = None


def _q(value: str) -> str:
    return shlex.quote(value)


def _continue(f: CaseFacts, mode: Mode, providers: str | None,
              first: bool = False, fixed: bool = False) -> list[Step]:
    """How to make the case run (``first``: no step ran yet) or run again on the runtime in
    use; ``fixed``: after a block its providers file caused, the file named is the one
    that ran, to be fixed first (a real model's user, whose case blocked on
    providers-small.toml, was offered that file again, unexplained)."""
    case = _q(f.case_id)
    run = f"investigate run {case} --providers " + (_q(providers) if providers
                                                      else "providers.toml")
    dispatch = f"investigate dispatch {case}"
    again = "run it" if first else "run it again"
    if mode == "embedded":
        if not providers:
            again += " (with the providers file you use)"
        elif fixed:
            again += " once that providers file is fixed (or name another one)"
        return [Step(again, run)]
    # A sweep may take the case first: `dispatch` then says LOCK_BUSY (exit 3), which a
    # fleet trial read as a failure.
    busy = "; LOCK_BUSY (exit 3) means a worker already has it"
    if mode == "distributed":
        return [Step("dispatch it to the workers (or let the recovery sweep do it)" + busy,
                     dispatch)]
    # Both runtimes: a shell that names a broker (a fleet's), so the workers come first.
    return [Step("distributed runtime: dispatch it to the workers" + busy, dispatch),
            Step(f"embedded runtime: {again}" + ("" if providers else
                                                 " with your providers file"), run)]


def _watch(f: CaseFacts, mode: Mode) -> list[Step]:
    """Following the case live: only where workers run it (an embedded ``run`` shows its
    own progress, and nothing moves between two runs)."""
    if mode == "embedded":
        return []
    return [Step("distributed runtime: watch it" if mode is None else "watch it",
                 f"investigate status {_q(f.case_id)} --watch")]


#: The first step of PROVIDER_EXHAUSTED by the last attempt's error: a server that
#: answered with garbage was told to "make the provider reachable" (a fleet trial).
_ANSWERED = {
    "PROVIDER_MALFORMED_RESPONSE": "the server answered, but not with a chat completion: "
    "check that base_url is its OpenAI-compatible address (ending in /v1) and read the "
    "server's log",
    "PROVIDER_SERVER_ERROR": "the server answered with errors (HTTP 5xx): read its log "
    "and fix or restart it",
    "PROVIDER_RATE_LIMITED": "the server kept refusing for its rate limit: wait, or raise "
    "the limit or attempts in the providers file",
    "PROVIDER_TIMEOUT": "the model answered too slowly: raise timeout_s in the providers "
    "file above the seconds a call takes (`investigate providers check` measures one)",
}


def _reach_step(error_code: str | None) -> Step:
    """What to fix first after every attempt failed, by the last attempt's error."""
    return Step(_ANSWERED.get(error_code or "", "make the provider reachable (is the server "
                              "up? the base_url and timeout_s in the providers file right?)"))


def _script_hint(f: CaseFacts, replies: str | None) -> Step:
    where = "the scripted reply file" if replies else \
        "if the replies come from a scripted JSON Lines file"
    return Step(f"{where}: the next model call (call {f.next_call_index + 1}) reads its "
                f"reply line {f.next_call_index + 1}, blank lines not counted (lines already "
                "served stay in place); check the "
                "file against the case before running it",
                f"investigate replies check {_q(replies) if replies else 'replies.jsonl'} "
                f"{_q(f.case_id)}")


#: The provider failure that is the server asking the client to wait (HTTP 429).
_PAUSE_REQUESTS = frozenset({PROVIDER_RATE_LIMITED})


T = TypeVar("T")


def _by_mode(mode: Mode, embedded: T, distributed: T, both: T) -> T:
    """What to say in a shell of the runtime ``mode`` (``None``: both runtimes)."""
    return embedded if mode == "embedded" else distributed if mode == "distributed" \
        else both


def _clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a space, marked with "...": a cut
    in a word or a path ("analysis/investigation/0004/", "every configured provider rej")
    read as the whole message (a real model's user)."""
    if len(text) <= limit:
        return text
    cut = text[:limit - 3]
    head = cut.rsplit(" ", 1)[0] if " " in cut[limit // 3:] else cut
    return head.rstrip(" ,;:(") + "..."


def _why(f: CaseFacts) -> str:
    if f.error_code:
        return f" ({f.error_code}: {f.error_message})" if f.error_message else \
            f" ({f.error_code})"
    return ""


def advise(f: CaseFacts, mode: Mode = None, providers: str | None = None,
           replies: str | None = None, out_dir: str | None = None) -> Guidance:
    """The advice for a case in the situation ``f`` describes.

    Args:
        f: the case's facts (:func:`facts_for`).
        mode: the runtime the caller uses (``embedded``/``distributed``), or ``None``.
        providers: the providers file the caller ran with, to repeat it in commands.
        replies: the scripted reply file that providers file names, if any.
        out_dir: where the suggested report and export should go (the demo passes its own
            store directory, so nothing lands in the checkout); default the working
            directory (``report.html``, ``EXPORT_DIR``).

    Returns:
        The :class:`Guidance`; never raises for an unknown reason (a generic advice).
    """
    case = _q(f.case_id)
    reason = f.blocked_reason
    if replies is None and f.error_code in ("PROVIDER_SCRIPT_EXHAUSTED",
                                            "PROVIDER_SCRIPT_UNREADABLE"):
        replies = script_path_of(f.error_message)  # the file the failing provider read
    prefix = out_dir.rstrip("/") + "/" if out_dir else ""
    report = Step("see the whole investigation in a browser",
                  f"investigate report {case} -o {_q(prefix + 'report.html')}")
    export_dir = _q(prefix + "export") if out_dir else "EXPORT_DIR"
    if f.state == CASE_BUILDING_DIAGNOSIS:
        return Guidance("The investigation is complete: every hypothesis account is "
                        "terminal (state BUILDING_DIAGNOSIS).",
                        (Step("read the summary", f"investigate summary {case}"), report,
                         Step("write every artifact to a directory",
                              f"investigate export {case} {export_dir}")), final=True)
    if f.state == CASE_CANCELLED:
        return Guidance("The case was cancelled; nothing more runs. Everything done so far "
                        "is kept.",
                        (report, Step("write every artifact to a directory",
                                      f"investigate export {case} {export_dir}")), final=True)
    if f.state == CASE_STOPPED:
        return Guidance(f"The case stopped for good: its lifecycle session ended "
                        f"({reason}), for example when limits.max_execution_seconds ran "
                        "out. Everything done so far is kept.",
                        (report, Step("to investigate further, register the case again "
                                      "with a new interpretation (a new case) and a policy "
                                      "with a larger bound")), final=True)
    if f.state == CASE_PAUSED:
        held = f" (it was blocked for {reason}; a resume restores that block)" if reason \
            else ""
        return Guidance(f"The case is paused by an operator{held}.",
                        (Step("resume it where it stopped", f"investigate resume {case}"),
                         *(_continue(f, mode, providers) if not reason else []),
                         Step("or stop it for good", f"investigate cancel {case}")))
    if f.state == CASE_BLOCKED:
        return _blocked(f, mode, providers, report, replies)
    if f.state == CASE_INVESTIGATING:
        if f.last_outcome == RETRY_PENDING:
            # The case's last reason is the code of this wait. Only a rate limit is the
            # provider asking for a pause; a refused connection or a timeout is a failure
            # the engine backs off from; an attempt still out is another runner's.
            if f.last_reason == PROVIDER_CALL_IN_FLIGHT:
                headline = ("A request for this model call is still out, or its reply was "
                            "never stored (a worker stopped, or the store dropped it) "
                            f"({PROVIDER_CALL_IN_FLIGHT}); it counts as an attempt once its "
                            "grace has passed")
            elif f.last_reason in _PAUSE_REQUESTS:
                headline = f"The provider asked for a pause{_why(f)}"
            else:
                headline = f"The model call failed for now and is retried{_why(f)}"
            when = _by_mode(
                mode, f": the model call is tried again after {f.retry_not_before}, when the "
                "case runs (`run` waits for it unless --no-wait).",
                f": the workers take the case up again by themselves after "
                f"{f.retry_not_before} (no worker waits meanwhile).",
                f": the model call is tried again after {f.retry_not_before} (no worker waits "
                "meanwhile): workers take the case up by themselves, an embedded case when it "
                "runs again.")
            embedded = Step("embedded: `run` waits in the command (or exits 4 with "
                            "--no-wait); run it again after that time",
                            f"investigate run {case} --providers "
                            + (_q(providers) if providers else "providers.toml"))
            distributed = Step("distributed: the workers come back by themselves; watch it",
                               f"investigate status {case} --watch")
            # A timeout repeats as it is: run again, it times out again (a real model's
            # user with timeout_s = 1, whose server went on computing each abandoned call).
            first = (Step("if calls of this model take longer than timeout_s, raise it in "
                          "the providers file first (`providers check` measures a call); a "
                          "server with one slot goes on computing a request the engine "
                          "gave up on, and the retry waits behind it",
                          "investigate providers check --providers "
                          + (_q(providers) if providers else "providers.toml")),) \
                if f.last_reason == PROVIDER_TIMEOUT else ()
            # A shell without a broker is told of `run` only (a new user's trial).
            return Guidance(headline + when, first + _by_mode(
                mode, (embedded,), (distributed,), (embedded, distributed)))
        if f.last_outcome == STEP_ERROR:
            return _step_error(f, mode, providers)
        if f.steps == 0 and f.last_outcome is None and not f.step_started:
            return Guidance("No step has run yet.",
                            tuple(_continue(f, mode, providers, first=True)))
        if f.steps == 0 and f.last_outcome is None:
            return Guidance("Step 1 was started and has not finished (a worker is at it, "
                            "or a run or worker stopped inside it); it goes on from where "
                            "it stopped when the case runs.",
                            (*_continue(f, mode, providers), *_watch(f, mode)))
        if f.last_outcome == "RESUMED":
            return Guidance(f"The case was resumed (it was {f.last_reason}); it goes on when "
                            "it runs again.",
                            (*_continue(f, mode, providers), *_watch(f, mode)))
        return Guidance(f"The case is investigating (last outcome {f.last_outcome}"
                        + (f", {f.last_reason}" if f.last_reason else "") + ").",
                        (*_continue(f, mode, providers), *_watch(f, mode)))
    return Guidance(f"The case is {f.state}" + (f" ({reason})" if reason else "") + ".",
                    (Step("see its state", f"investigate status {case}"), report))


#: Controlled errors that mean the stored record does not replay (seed 000, "Persistence
#: and recovery"): ``verify`` names the generation and what differs.
_RECORD_ERRORS = frozenset({"CHECKPOINT_INVALID", "CONTEXT_IDENTITY", "RESULT_IDENTITY",
                            "STATE_TAMPERED", "SETTLEMENT_MISMATCH", "POLICY_CHANGED"})
#: Controlled errors that are a limit of the process's policy the step would cross (limits
#: are read from the workers' file, not frozen with the revision).
_LIMIT_ERRORS = frozenset({"CONTEXT_TOO_LARGE", "CHECKPOINT_LIMIT"})


def _step_error(f: CaseFacts, mode: Mode, providers: str | None) -> Guidance:
    """A worker's stage stopped the case's next step with a controlled error (the case row's
    last outcome ``ERROR``, reason its code): nothing of the step was published, and the
    recovery sweep tries it again."""
    case, step = _q(f.case_id), f.steps + 1
    cause: list[Step] = [Step(f"read the worker log about step {step} of {f.case_id}: its "
                              f"line `case {f.case_id} step {step} STAGE failed: "
                              f"{f.last_reason}: ...` names the stage and the cause")]
    if f.last_reason in _RECORD_ERRORS:
        cause.append(Step("the stored record does not replay: check which generation and "
                          "what differs", f"investigate verify {case}"))
    elif f.last_reason in _LIMIT_ERRORS:
        cause.append(Step("the step would cross a limit of the policy the workers read "
                          "([limits] max_checkpoints, max_context_bytes; limits are not "
                          "frozen with the case): raise it in their INVESTIGATE_CONFIG file "
                          "and restart them"))
    return Guidance(
        f"Step {step} failed on a worker with {f.last_reason}; nothing of it was published, "
        "and the recovery sweep dispatches the case again (every INVESTIGATE_SWEEP_INTERVAL_S), "
        "so the error repeats until its cause is fixed.",
        (*cause, *[Step(f"after fixing the cause, {s.text}", s.command)
                   for s in _continue(f, mode, providers)],
         Step("or stop it for good", f"investigate cancel {case}")))


def dispatch_holds(case_id: str, lease_s: float | None) -> Guidance:
    """The advice while a dispatch holds an investigating case's lock (``lease_s`` seconds
    of its lease left): its worker moves it, so neither ``dispatch`` nor ``run`` (both
    ``LOCK_BUSY`` in a fleet's shell, decision 158) is advice. ``lease_s`` ``None``: a
    lock key that never expires (not the engine's), which only a take-over ends."""
    if lease_s is None:
        return Guidance("A lock key without a lease holds the case: not the engine's (it "
                        "always sets one), so no worker and no sweep takes the case.",
                        (Step("end it and dispatch the case",
                              f"investigate dispatch {_q(case_id)} --take-over"),))
    return Guidance(f"A dispatch holds the case (lease {lease_s:g} s left): a worker, or a "
                    "`run` in a fleet's shell, moves it.",
                    (Step("watch it", f"investigate status {_q(case_id)} --watch"),
                     Step("if its worker died, the recovery sweep dispatches the case once "
                          "the lease runs out; `investigate recover` says whether the "
                          "holder answers ping"),
                     # A fleet trial killed the holder and waited out the lease: status
                     # never named the take-over that recover and LOCK_BUSY name.
                     Step("or, once you know it died, end its lease and dispatch now",
                          f"investigate dispatch {_q(case_id)} --take-over")))


def _policy_file(mode: Mode) -> str:
    """Where the policy a runtime reads comes from, for advice that edits it."""
    return _by_mode(mode, "`run --config FILE`",
                    "the workers' INVESTIGATE_CONFIG; they read it when they start, so "
                    "restart them after the edit",
                    "`run --config FILE`, or the workers' INVESTIGATE_CONFIG (they read it "
                    "when they start: restart them after the edit)")


def dispatch_waits(case_id: str, queue: str, waiting: int) -> Guidance:
    """The advice while a dispatch sent from a shell holds the case's lease and messages
    wait in the case queue that no worker has taken: no worker may read the queue (a
    fleet trial's status said a worker moved the case while none ran)."""
    return Guidance(f"A dispatch of the case waits in queue {queue!r} ({waiting} message(s) "
                    "no worker has taken): the case moves once a worker reads the queue.",
                    (Step("check that a worker reads this queue", "investigate health"),
                     Step("if none runs, start one (on every worker host)",
                          "investigate worker --name w1@%h"),
                     Step("watch it", f"investigate status {_q(case_id)} --watch")))


def run_holds(case_id: str) -> Guidance:
    """The advice while a ``run`` of this machine holds an investigating case: that run
    moves it, so another ``run`` is ``LOCK_BUSY``."""
    return Guidance("A `run` on this machine is at work on the case: it moves it (another "
                    "`run` would be refused, LOCK_BUSY).",
                    (Step("watch it", f"investigate status {_q(case_id)} --watch"),
                     Step("to stop it: Ctrl-C in its terminal; a later `run` takes the case "
                          "up from the store")))


def _blocked(f: CaseFacts, mode: Mode, providers: str | None, report: Step,
             replies: str | None) -> Guidance:
    case = _q(f.case_id)
    reason = f.blocked_reason
    resume_retry = Step("then open a new provider operation for the blocked call (a new "
                        "retry id each time; it keeps every iteration, credit and evidence)",
                        f"investigate resume {case} --retry-id {_q(f.retry_id)}")
    if reason == BLOCK_INVALID_LLM_RESPONSES:
        # Cut replies are the provider's max_tokens, not the model's manners (a user of a
        # real model was told to fix the model and its server).
        truncated = [Step("raise max_tokens of the provider in the providers file: the "
                          "replies were cut there before their JSON ended")] \
            if f.error_code == "REPLY_TRUNCATED" else []
        return Guidance(
            f"Blocked: the model's replies broke the reply contract several times in a "
            f"row{_why(f)}. Budgets, evidence and the pending work are kept.",
            (*truncated,
             Step("fix what produced them: the model, its server's structured-output "
                  "setting, or the reply file (docs/reply-contract.md; the rules and their "
                  "codes: docs/investigation-loop.md; `investigate status` shows the last "
                  "rejection of each hypothesis)"),
             # A known providers file without a scripted provider: no reply file to check.
             *([_script_hint(f, replies)] if replies or not providers else []),
             # A real model at temperature 0 sent the same refused reply three times, and
             # once more after a resume (a real model's user): nothing said what helps.
             *([Step("a model that repeats its refused reply (at temperature 0 it answers "
                     "the same context the same way) may pass with a higher `temperature` "
                     "of its provider in the providers file, or a larger model")]
               if providers and not replies else []),
             Step("then resume the case (it keeps its count of refused replies in a row: "
                  "the next refused reply blocks it again; decision 34)",
                  f"investigate resume {case}"),
             *_continue(f, mode, providers, fixed=not replies)))
    if reason == BLOCK_PROVIDER_EXHAUSTED:
        return Guidance(
            f"Blocked: every attempt to reach the model failed{_why(f)}. Nothing was "
            "charged.",
            (_reach_step(f.error_code), resume_retry,
             *_continue(f, mode, providers, fixed=True)))
    if reason == BLOCK_PROVIDER_CONFIGURATION and f.error_code == MODEL_COST_CURRENCY_CHANGED:
        return Guidance(  # decision 180: a policy's label, not the providers file
            f"Blocked: limits.currency differs from the currency of the case's model "
            f"costs{_why(f)}. Nothing was sent or charged.",
            (Step("set [limits] currency back in the policy file the runtime reads (and the "
                  "providers' prices in that currency): " + _policy_file(mode)),
             resume_retry, *_continue(f, mode, providers)))
    if reason == BLOCK_PROVIDER_CONFIGURATION:
        script = f.error_code in ("PROVIDER_SCRIPT_EXHAUSTED", "PROVIDER_SCRIPT_UNREADABLE")
        # Which line the blocked call reads is said once, by the reply-file step below.
        fix = Step("add replies to the scripted file (or fix it)") if script else \
            Step("fix the providers file: the model name, base_url, structured_output "
                 "dialect, or add a provider with a larger context (workers read it when "
                 "they start: restart them after)")
        # A reply file that ran out is no refusal (a fleet trial read it as one).
        what = {"PROVIDER_SCRIPT_EXHAUSTED": "the scripted reply file has no reply for "
                                             "this call",
                "PROVIDER_SCRIPT_UNREADABLE": "the scripted reply file cannot be read"}.get(
            f.error_code or "", "the provider refused the request as configured")
        return Guidance(
            f"Blocked: {what}{_why(f)}. Nothing was charged.",
            (fix, *([_script_hint(f, replies)] if script else []), resume_retry,
             *_continue(f, mode, providers, fixed=not script)))
    if reason == BLOCK_PROVIDER_CREDENTIALS:
        # A key variable that is not set sends nothing: no refusal (a fleet trial).
        missing = f.error_code == "PROVIDER_CREDENTIALS_MISSING"
        what = "the provider's API key variable is not set" if missing else \
            "the provider refused the credentials"
        return Guidance(
            f"Blocked: {what}{_why(f)}. Nothing was charged.",
            (Step("set the key in the environment variable the provider's api_key_env "
                  "names (a provider without api_key_env sends no key: add it, naming the "
                  "variable; the key itself never goes into a file or the store)" + _by_mode(
                      mode, " in the shell that runs `investigate run`",
                      "; workers read it when they start, so restart them after setting it",
                      ": in the shell of `investigate run`; workers read it when they "
                      "start, so restart them after setting it")),
             resume_retry, *_continue(f, mode, providers)))
    if reason == BLOCK_AWAITING_TEST_FEEDBACK:
        first = f.awaiting_tests[0] if f.awaiting_tests else "T1"
        return Guidance(
            "Waiting for external test feedback: a person or a rig runs the test the model "
            "handed out and reports what they saw; no worker waits meanwhile.",
            (Step("read the test (--secret also prints the feedback secret)",
                  f"investigate tests show {case} {first} --secret"),
             Step("report the observation (step 1 of 2; it prints a digest)",
                  f"investigate feedback submit {case} {first} --secret SECRET "
                  "--outcome as_expected --observation 'what was seen'"),
             Step("confirm it (step 2 of 2); the case then continues",
                  f"investigate feedback confirm {case} {first} --secret SECRET "
                  "--digest DIGEST"),
             *_continue(f, mode, providers)))
    if reason == BLOCK_STAGE_POISONED:
        return Guidance(
            f"Blocked: one stage kept killing its worker{_why(f)}.",
            (Step("find the cause in the worker logs (memory limit, a native crash on this "
                  "case's data) and fix it"),
             Step("then resume (this resets the delivery counters)",
                  f"investigate resume {case}"),
             *_continue(f, "distributed" if mode is None else mode, providers)))
    if reason == BLOCK_MODEL_COST_CAP:
        return Guidance(
            f"Blocked: the case's model calls reached their money cap{_why(f)}. Nothing "
            "more was sent.",
            (Step("raise [limits] max_model_cost in the policy file the runtime reads, "
                  "if the case is worth it: " + _policy_file(mode)),
             resume_retry, *_continue(f, mode, providers)))
    if reason == BLOCK_STAGE_TIME_LIMIT:
        return Guidance(
            f"Blocked: a worker time limit stopped a stage{_why(f)}.",
            (Step("raise the worker's --soft-time-limit/--time-limit above the stage's "
                  "longest run (a model call's timeout_s, at least), or find why it was "
                  "slow"),
             Step("then resume the case", f"investigate resume {case}"),
             *_continue(f, "distributed" if mode is None else mode, providers),
             # A fleet trial's resumed case sat in RETRY_PENDING for a minute, unexplained.
             *([Step("the model call the limit stopped may still be answered: the case "
                     "waits for it first, up to the gateway's in-flight grace (twice the "
                     "provider's timeout_s plus 5 s), showing RETRY_PENDING "
                     "(PROVIDER_CALL_IN_FLIGHT)")] if f.stopped_stage == "llm_call" else [])))
    if reason in ("PAUSED", CASE_PAUSED):
        return Guidance("The case is paused.", (Step("resume it",
                                                     f"investigate resume {case}"),))
    return Guidance(f"Blocked ({reason}){_why(f)}.",
                    (Step("see the details", f"investigate status {case}"),
                     Step("resume it after fixing the cause", f"investigate resume {case}"),
                     report))


def facts_for(store: Store, case_id: str) -> CaseFacts:
    """Read the :class:`CaseFacts` of a case.

    Raises:
        InvestigationError: ``CASE_NOT_FOUND``.
    """
    with store.session() as s:
        case = s.get(CaseRecord, case_id)
        if case is None:
            raise InvestigationError("CASE_NOT_FOUND", f"no case {case_id}")
        ops = s.exec(select(LLMOperation).where(LLMOperation.case_id == case_id)
                     .order_by(col(LLMOperation.id))).all()
        calls = len(s.exec(select(StageRun.id).where(
            StageRun.case_id == case_id, StageRun.stage == "llm_call")).all())
        tests = s.exec(select(TestRequest.request_id).where(
            TestRequest.case_id == case_id, TestRequest.status == "awaiting")
            .order_by(col(TestRequest.id))).all()
        error_code = error_message = None
        reason = case.blocked_reason
        if reason in PROVIDER_BLOCKS or case.last_outcome == RETRY_PENDING:
            failed = [o for o in ops if o.error_code]
            if failed:
                error_code, error_message = failed[-1].error_code, failed[-1].error_message
        elif reason == BLOCK_INVALID_LLM_RESPONSES:
            rows = s.exec(select(BudgetAccount).where(
                BudgetAccount.case_id == case_id,
                BudgetAccount.revision == case.current_revision,
                col(BudgetAccount.last_rejection_json).is_not(None))).all()
            latest = max((jsonio.loads(r.last_rejection_json or "{}") for r in rows),
                         key=lambda r: int(r.get("step_seq", 0)), default=None)
            if latest:
                error_code, error_message = latest.get("code"), latest.get("detail")
        stopped_stage = None
        if reason == BLOCK_STAGE_TIME_LIMIT:
            row = deliveries.last_delivered(s, case_id)
            stopped_stage = row.stage if row is not None else None
        used = {o.retry_id for o in ops} | {case.llm_retry_id}
        n = 1
        while f"retry-{case.head_seq + 1}-{n}" in used:
            n += 1
        return CaseFacts(
            case_id=case.id, state=case.state, blocked_reason=reason,
            last_outcome=case.last_outcome, last_reason=case.last_reason,
            steps=case.head_seq,
            retry_not_before=case.retry_not_before.isoformat()
            if case.retry_not_before else None,
            error_code=error_code,
            error_message=_clip(error_message or "", 300) or None,
            next_call_index=calls, retry_id=f"retry-{case.head_seq + 1}-{n}",
            awaiting_tests=tuple(tests),
            step_started=any(o.step_seq == case.head_seq + 1
                             and o.revision == case.current_revision for o in ops),
            stopped_stage=stopped_stage)


def scripted_file(providers: str | Path | None) -> str | None:
    """The reply file of the first scripted provider in ``providers``, if any (relative to
    the working directory when it is below it); ``None`` when there is none or the file
    cannot be read (the guidance then shows a placeholder)."""
    if providers is None:
        return None
    try:
        config = ProvidersConfig.load(providers)
    except InvestigationError:
        return None
    for p in config.providers:
        if p.kind == "scripted" and p.path:
            path = (Path(config.base_dir) / p.path).resolve()
            try:
                return str(path.relative_to(Path.cwd().resolve()))
            except ValueError:
                return str(path)
    return None


def env_value(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The environment variable ``name`` as the settings read it: in any letter case
    (pydantic-settings matches names case-insensitively; ``investigate_home=dir`` opens
    ``dir``), the exact spelling first; ``None`` when unset."""
    environ = os.environ if environ is None else environ
    if name in environ:
        return environ[name]
    return next((v for k, v in environ.items() if k.upper() == name), None)


def shell_env(environ: Mapping[str, str] | None = None) -> str:
    """The prefix that makes a printed command open the store this process opened, in a
    shell whose own settings may name another (a fleet's exported database, another
    home).

    * ``INVESTIGATE_HOME=<value> `` when ``INVESTIGATE_HOME`` is set (exported or given
      inline on the command line, which a process cannot tell apart), or ``INVESTIGATE_HOME=
      `` when it was set empty (the default home: a hostile trial's pasted command opened
      the home its shell exported);
    * then ``INVESTIGATE_DATABASE_URL= `` when that variable is set empty (as the demo's
      printed commands clear a fleet shell's database: a command pasted without it read
      the fleet's case of the same id, a new user's trial);
    * nothing when ``INVESTIGATE_DATABASE_URL`` names a store: the store is the URL's,
      and a database URL is never repeated (it may hold a password).

    Names are read in any letter case, as the settings read them (:func:`env_value`).
    """
    home = env_value("INVESTIGATE_HOME", environ)
    url = env_value("INVESTIGATE_DATABASE_URL", environ)
    if url and url.strip():
        return ""
    return ("" if home is None else f"INVESTIGATE_HOME={_q(home) if home else ''} ") \
        + ("" if url is None else "INVESTIGATE_DATABASE_URL= ")


def for_case(store: Store, case_id: str, mode: Mode = None, providers: str | None = None,
             env: str | None = None, replies: str | None = None,
             out_dir: str | None = None) -> Guidance:
    """:func:`advise` for the case as stored now.

    Args:
        env: prefixed to every command, e.g. ``"INVESTIGATE_HOME=.investigate/demo "`` when
            the case lives in a store the default settings do not point at; default
            :func:`shell_env`, so a command pasted into the same shell finds the same store.
        out_dir: as in :func:`advise`.
    """
    return in_shell(advise(facts_for(store, case_id), mode, providers, replies, out_dir),
                    env)


def in_shell(g: Guidance, env: str | None = None) -> Guidance:
    """``g`` with ``env`` (default :func:`shell_env`) before every command, so that a
    command pasted into the same shell opens the same store."""
    if env is None:
        env = shell_env()
    if not env:
        return g
    return Guidance(g.headline, tuple(Step(s.text, env + s.command if s.command else None)
                                      for s in g.steps), g.final)
