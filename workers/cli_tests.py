"""``investigate tests ...`` and ``investigate feedback ...``: external tests handed to a
person or a rig, and their authenticated two-step feedback (``docs/async-tests.md``).

Registered on the main app by ``workers.cli``; the same exit codes apply.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from investigation.errors import InvestigationError
from investigation.files import read_bounded
from workers.cli import (
    EXAMPLE_CASE,
    CaseArg,
    JsonListOpt,
    JsonOpt,
    _controlled,
    _settings,
    _store,
    _term,
    example,
    out,
)
from workers.views import Fitted

if TYPE_CHECKING:
    from investigation.external_tests import AsyncTestCoordinator

tests_app: typer.Typer = typer.Typer(
    help="External tests handed out by investigations.", no_args_is_help=True,
    epilog=example(f"investigate tests list {EXAMPLE_CASE}",
                   f"investigate tests show {EXAMPLE_CASE} T1 --secret"))
feedback_app: typer.Typer = typer.Typer(
    help="Submit and confirm external test feedback.", no_args_is_help=True,
    epilog=example(f"investigate feedback submit {EXAMPLE_CASE} T1 --secret S --outcome "
                   "as_expected --observation 'the total was 90'",
                   f"investigate feedback confirm {EXAMPLE_CASE} T1 --secret S --digest D"))

RequestArg = Annotated[str, typer.Argument(metavar="REQUEST", help="test request id, e.g. T1")]
SecretOpt = Annotated[str, typer.Option(
    "--secret", envvar="INVESTIGATE_FEEDBACK_SECRET",
    help="the request's feedback secret (or set INVESTIGATE_FEEDBACK_SECRET)")]


def _coordinator(need_key: bool = False) -> AsyncTestCoordinator:
    from investigation.external_tests import AsyncTestCoordinator

    settings = _settings()
    store = _store(settings, existing=True)
    key = settings.feedback_key_bytes(create=False)
    if need_key and key is None:
        raise InvestigationError(
            "FEEDBACK_KEY_MISSING",
            "no feedback key here: set INVESTIGATE_FEEDBACK_KEY (or the key file) to the "
            "key the workers use")
    return AsyncTestCoordinator(store, key)


def _print_json(data: Any) -> None:
    out.print_json(json.dumps(data))


@tests_app.command("list", epilog=example(f"investigate tests list {EXAMPLE_CASE}",
                                         f"investigate tests list {EXAMPLE_CASE} --json"))
@_controlled
def tests_list(case_id: CaseArg, as_json: JsonListOpt = False) -> None:
    """Every test request of a case with its status and deadline."""
    rows = _coordinator().list_requests(case_id)
    if as_json:
        _print_json(rows)
        return
    if not rows:
        out.print(f"case {case_id} has handed out no test", highlight=False)
        return
    table = Table("request", "hypothesis", "kind", "status", "deadline (UTC)", "title",
                  "evidence")
    for r in rows:
        table.add_row(r["request_id"], str(r["hypothesis_id"]), r["kind"], r["status"],
                      r["deadline_at"], Text(_term(r["request"]["test"]["title"])),
                      r["evidence_id"] or "")
    out.print(Fitted(table))


@tests_app.command("show", epilog=example(f"investigate tests show {EXAMPLE_CASE} T1",
                                         f"investigate tests show {EXAMPLE_CASE} T1 --secret"))
@_controlled
def tests_show(case_id: CaseArg, request_id: RequestArg,
               secret: Annotated[bool, typer.Option(
                   "--secret", help="also print the request's feedback secret (needs the "
                   "feedback key)")] = False,
               as_json: JsonOpt = False) -> None:
    """The exact request handed out (title, instructions, expected observation)."""
    coordinator = _coordinator(need_key=secret)
    info = coordinator.show(case_id, request_id)
    if secret:
        info["secret"] = coordinator.secret(case_id, request_id)
    if as_json:
        _print_json(info)
        return
    test = info["request"]["test"]
    lines = [
        f"{info['request_id']} of {case_id} (hypothesis {info['hypothesis_id']}, "
        f"{info['kind']} test, step {info['step_seq']}): {info['status']}",
        f"deadline: {info['deadline_at']}",
        f"title: {test['title']}",
        f"instructions: {test['instructions']}",
        f"expected observation: {test['expected_observation']}",
    ]
    if info["feedback"]:
        lines.append(f"feedback ({info['feedback_sha256']}): {info['feedback']['outcome']}: "
                     f"{info['feedback']['observation']}")
    if secret:
        lines.append(f"secret: {info['secret']}")
    for line in lines:
        out.print(_term(line), highlight=False, markup=False)


@tests_app.command("expire", epilog=example("investigate tests expire"))
@_controlled
def tests_expire(as_json: JsonOpt = False) -> None:
    """Record every test whose deadline passed as a result without feedback (the
    recovery sweep does this too)."""
    done = _coordinator().expire_due()
    if as_json:
        _print_json(done)
        return
    for d in done:
        out.print(f"{d['case_id']} {d['request_id']}: deadline passed, recorded as "
                  f"{d['evidence_id']}", highlight=False)
    out.print(f"{len(done)} test(s) expired", highlight=False)


#: Largest observation file read (the contract allows 8,000 characters: 4 bytes each).
MAX_OBSERVATION_FILE_BYTES = 8000 * 4


def _read_observation(path: Path) -> str:
    """The file's text, read boundedly (never a whole /dev/zero), as strict UTF-8."""
    try:  # a regular file: never a FIFO that waits for a writer, nor a whole /dev/zero
        data = read_bounded(path, MAX_OBSERVATION_FILE_BYTES)
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            raise InvestigationError("FEEDBACK_INVALID",
                                     f"{path} is larger than an observation may be "
                                     f"({MAX_OBSERVATION_FILE_BYTES} bytes)") from exc
        if exc.errno == errno.EINVAL:
            raise InvestigationError("FEEDBACK_INVALID",
                                     f"{path} is not a regular file") from exc
        raise
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvestigationError("FEEDBACK_INVALID", f"{path} is not UTF-8 text") from exc


@feedback_app.command("submit", epilog=example(
    f"investigate feedback submit {EXAMPLE_CASE} T1 --secret S --outcome as_expected "
    "--observation 'the total was 90'",
    f"investigate feedback submit {EXAMPLE_CASE} T1 --secret S --outcome inconclusive "
    "--observation-file seen.txt"))
@_controlled
def feedback_submit(
    case_id: CaseArg, request_id: RequestArg, secret: SecretOpt,
    outcome: Annotated[str, typer.Option(
        "--outcome", help="as_expected | not_as_expected | inconclusive")],
    observation: Annotated[str | None, typer.Option(
        "--observation", help="what was observed, as text (at most 8,000 characters)")
    ] = None,
    observation_file: Annotated[Path | None, typer.Option(
        "--observation-file", help="a UTF-8 file holding what was observed (instead of "
        "--observation)")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Step 1: submit feedback; prints the digest to confirm it with."""
    if (observation is None) == (observation_file is None):
        raise InvestigationError("FEEDBACK_INVALID",
                                 "give exactly one of --observation or --observation-file")
    text = observation if observation is not None else \
        _read_observation(observation_file)  # type: ignore[arg-type]
    res = _coordinator().submit(case_id, request_id, secret,
                                {"outcome": outcome, "observation": text})
    if as_json:
        _print_json(res)
        return
    out.print(f"{request_id}: submitted, digest {res['feedback_sha256']}", highlight=False)
    out.print(f"confirm with: investigate feedback confirm {case_id} {request_id} "
              f"--digest {res['feedback_sha256']} --secret ...", highlight=False)


@feedback_app.command("confirm", epilog=example(
    f"investigate feedback confirm {EXAMPLE_CASE} T1 --secret S --digest D"))
@_controlled
def feedback_confirm(
    case_id: CaseArg, request_id: RequestArg, secret: SecretOpt,
    digest: Annotated[str, typer.Option("--digest", help="the digest printed by submit")],
    as_json: JsonOpt = False,
) -> None:
    """Step 2: confirm the submitted feedback; it becomes evidence and the case resumes."""
    res = _coordinator().confirm(case_id, request_id, secret, digest)
    if as_json:
        _print_json(res)
        return
    out.print(f"{request_id}: confirmed as evidence {res['evidence_id']}; case {case_id} is "
              f"{res['case_state']}", highlight=False)
    out.print(f"continue with: investigate run {case_id} (embedded) or investigate dispatch "
              f"{case_id} (workers; the recovery sweep also picks it up)", highlight=False)
