"""``investigate providers check``: one probe turn per provider of a providers file.

Registered on the main app by ``workers.cli``. Exit codes: 0 every probed provider gave a
valid reply, 1 at least one did not (the table says which check failed), 2 a controlled
error (an unreadable or invalid providers file).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from investigation.errors import InvestigationError
from workers.cli import _controlled, _settings, _term, example, out
from workers.views import Fitted

if TYPE_CHECKING:
    from investigation.loop.probe import ProbeResult

providers_app: typer.Typer = typer.Typer(
    help="Check model providers before a case needs them.", no_args_is_help=True,
    epilog=example("investigate providers check --providers providers.toml"))

#: What each verdict says about the checks, in the order they happen.
CHECKS = ("reachable", "dialect accepted", "reply valid")
_PASSED = {"ok": 3, "window_mismatch": 3, "invalid_reply": 2, "refused": 1, "unreachable": 0}


def _window_mark(result: ProbeResult) -> str:
    """The ``window`` column: ``NO`` the claimed window is larger than the server's,
    ``yes`` the server's holds it, ``?`` the server does not say, ``-`` nothing claimed
    or the probe stopped before asking."""
    if result.verdict == "window_mismatch":
        return "NO"
    if result.verdict != "ok" or result.context_window_tokens is None:
        return "-"
    return "?" if result.served_window_tokens is None else "yes"


def _marks(result: ProbeResult) -> list[str]:
    if result.verdict in ("skipped", "not_sent", "unreadable"):  # nothing asked of a server
        return ["-", "-", "-"]
    if result.verdict == "refused" and result.code != "PROVIDER_SCHEMA_REFUSED":
        return ["yes", "?", "-"]  # an error answer that does not say the dialect is wrong
    if result.verdict == "timed_out":
        return ["yes", "?", "NO"]  # connected; no reply within timeout_s
    passed = _PASSED[result.verdict]
    return ["yes" if i < passed else ("NO" if i == passed else "-")
            for i in range(len(CHECKS))]


#: Refusals that only a chat-completions endpoint gives.
_ANSWERED_BY_AN_ENDPOINT = frozenset({
    "PROVIDER_SCHEMA_REFUSED", "PROVIDER_REQUEST_TOO_LARGE", "PROVIDER_REQUEST_REJECTED",
    "PROVIDER_CREDENTIALS", "PROVIDER_RATE_LIMITED"})


def _address_hint(result: ProbeResult) -> str:
    """Where the probe went, when the address is the likely cause (a cut reply's detail
    says itself what cut it: ``probe.truncation_advice``)."""
    if result.base_url is None:
        return ""
    if result.verdict == "unreachable":
        return "" if result.base_url in (result.detail or "") else \
            f" (base_url {result.base_url})"
    # The address is a likely cause only of an answer no chat endpoint gives: a schema
    # refused, a window too small or credentials refused came from the right place (a
    # real model's user read "is it an OpenAI-compatible /v1 address?" after a window).
    if result.verdict == "refused" and result.code not in _ANSWERED_BY_AN_ENDPOINT:
        return (f" (base_url {result.base_url}: is it an OpenAI-compatible /v1 address "
                "that serves chat completions?)")
    return ""


@providers_app.command("check", epilog=example(
    "investigate providers check --providers providers.toml",
    "investigate providers check --providers providers.toml --json"))
@_controlled
def check(
    providers: Annotated[Path | None, typer.Option(
        "--providers", help="the providers TOML to check (default: INVESTIGATE_PROVIDERS)",
        show_default=False)] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", help="an investigation policy TOML (costs and caps of the probe turn)")]
        = None,
    as_json: Annotated[bool, typer.Option("--json", help="a JSON array, one object per provider")]
        = False,
) -> None:
    """Send every provider one probe turn, as a case's first turn, and judge the reply:
    reachable, dialect accepted, reply valid, whether the server's context window holds
    context_window_tokens (where the server says its window: vLLM, llama.cpp), seconds
    and tokens per second. Exit 1 when a provider fails a check.

    A probe is a real chat request: a server that replays scripted replies (the demo's)
    answers it with its next line. Scripted providers are not probed (skipped:
    `investigate replies check` checks their file)."""
    from investigation.config import InvestigationConfig, ProvidersConfig
    from investigation.loop.probe import probe_provider

    path = providers if providers is not None else _settings().providers
    if path is None:
        raise InvestigationError(
            "PROVIDERS_NOT_GIVEN", "no providers file: give --providers FILE or set "
            "INVESTIGATE_PROVIDERS (providers.example.toml in config/ is an example)")
    loaded = ProvidersConfig.load(path)
    policy = InvestigationConfig.load(config) if config else InvestigationConfig()
    results = [probe_provider(entry, policy=policy, base_dir=loaded.base_dir)
               for entry in loaded.providers]
    failed = any(r.verdict not in ("ok", "skipped") for r in results)
    if as_json:
        # The file's own spelling beside the canonical dialect (json_schema -> openai).
        sys.stdout.write(json.dumps(
            [{**r.to_dict(), "structured_output": entry.structured_output}
             for r, entry in zip(results, loaded.providers, strict=True)], indent=2) + "\n")
    else:
        table = Table("provider", "dialect", *CHECKS, "window", "seconds", "tokens/s",
                      "reply")
        for r, entry in zip(results, loaded.providers, strict=True):
            # The file's spelling beside the dialect it names (json_schema showed as
            # "openai" with no word on why: a fleet trial).
            dialect = r.dialect or r.kind
            if r.dialect and entry.structured_output != r.dialect and \
                    "structured_output" in entry.model_fields_set:
                dialect += f" ({entry.structured_output})"
            # Names and dialects as Text: a provider named "[red]n[/red]" showed as "n".
            table.add_row(Text(_term(r.provider)), Text(dialect), *_marks(r), _window_mark(r),
                          "" if r.seconds is None else f"{r.seconds:.1f}",
                          "" if r.tokens_per_s is None else f"{r.tokens_per_s:g}",
                          r.action or "")
        out.print(Fitted(table))
        for r in results:
            if r.verdict == "skipped":
                out.print(_term(f"{r.provider}: skipped ({r.detail}; `investigate replies "
                                "check FILE CASE` checks a reply file)"),
                          highlight=False, markup=False)
            elif r.verdict == "not_sent":
                out.print(_term(f"{r.provider}: not sent, {r.code}: {r.detail}; nothing "
                                "was asked of the server"), highlight=False, markup=False)
            elif r.verdict != "ok":
                out.print(_term(f"{r.provider}: {r.verdict} {r.code}: {r.detail}"
                                + _address_hint(r)), highlight=False, markup=False)
                if r.reply_excerpt is not None:  # what the model wrote (--json: more)
                    shown = r.reply_excerpt[:200] + ("..." if len(r.reply_excerpt) > 200
                                                     else "")
                    out.print(_term(f"{r.provider}: the model wrote: {shown}"),
                              highlight=False, markup=False)
            elif r.detail:  # passed, with a note (a tokenizer that failed, a window)
                out.print(_term(f"{r.provider}: note: {r.detail}"), highlight=False,
                          markup=False)
    if failed:
        raise typer.Exit(1)
