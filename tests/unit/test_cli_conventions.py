"""The command line's conventions, checked over the whole Typer app, so that a command
added later is held to them too:

* every command and group has help text and an ``Example:`` epilog whose examples are
  commands of that command (``$ investigate <its path> ...``) using only options it has;
* every option and argument has help text;
* every command that prints a result has ``--json`` (servers excepted);
* ``--version`` and Typer's shell completion are there.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from workers.cli import app

#: Commands that start a long-running server and print no result.
#: Commands that start a long-running server print no result (no --json).
SERVERS = {"worker", "flower", "beat", "metrics"}


def _is_group(cmd: Any) -> bool:
    """A group of commands (Typer ships its own copy of Click: no isinstance check)."""
    return hasattr(cmd, "list_commands")


def _commands() -> Iterator[tuple[str, Any]]:
    root = typer.main.get_command(app)

    def walk(cmd: Any, path: str) -> Iterator[tuple[str, Any]]:
        yield path, cmd
        if _is_group(cmd):
            ctx = cmd.context_class(cmd)
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                assert sub is not None
                yield from walk(sub, f"{path} {name}".strip())

    yield from walk(root, "")


def _examples(cmd: Any) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"\$ (investigate[^\n]*)", cmd.epilog or "")]


def test_every_command_has_help_and_an_example() -> None:
    missing = []
    for path, cmd in _commands():
        name = f"investigate {path}".strip()
        if not (cmd.help or "").strip():
            missing.append(f"{name}: no help")
        if "Example:" not in (cmd.epilog or "") or not _examples(cmd):
            missing.append(f"{name}: no example")
        for ex in _examples(cmd):
            if not ex.startswith(name):
                missing.append(f"{name}: example {ex!r} is not for this command")
    assert missing == []


def test_no_help_shows_docstring_markup() -> None:
    """A command's help is its docstring as the terminal shows it: reStructuredText's
    double backquotes came out as they are (``--basic-auth``: a new user's trial)."""
    marked = [f"investigate {path}".strip() for path, cmd in _commands()
              if "``" in (cmd.help or "") + (cmd.epilog or "")
              or any("``" in (getattr(p, "help", None) or "") for p in cmd.params)]
    assert marked == []


def test_every_option_and_argument_has_help() -> None:
    missing = []
    for path, cmd in _commands():
        for param in cmd.params:
            text = getattr(param, "help", None)
            if not (text or "").strip():
                missing.append(f"investigate {path}: {param.opts or param.name}")
    assert missing == []


def test_every_argument_is_named_in_capitals() -> None:
    """Usage lines name arguments as CASE, DIR, FILE (`case add` showed `{package}`: a new
    user's trial)."""
    lower = [f"investigate {path}: {param.name}" for path, cmd in _commands()
             for param in cmd.params if param.param_type_name == "argument"
             and not (param.metavar or "").isupper()]
    assert lower == []


def test_examples_use_existing_options() -> None:
    root = typer.main.get_command(app)
    bad = []
    for path, cmd in _commands():
        for ex in _examples(cmd):
            words = shlex.split(ex)[1:]
            target: Any = root
            while words and _is_group(target):
                sub = target.get_command(target.context_class(target), words[0])
                if sub is None:
                    break
                words.pop(0)
                target = sub
            known = {o for p in target.params for o in (*p.opts, *p.secondary_opts)}
            known |= {"--help"}
            for w in words:
                if w.startswith("-") and w.split("=", 1)[0] not in known:
                    bad.append(f"investigate {path}: {ex!r} uses unknown option {w}")
    assert bad == []


def test_every_command_that_prints_a_result_has_json() -> None:
    missing = []
    for path, cmd in _commands():
        if _is_group(cmd) or path in SERVERS:
            continue
        if not any("--json" in p.opts for p in cmd.params):
            missing.append(f"investigate {path}")
    assert missing == []


def test_version_and_completion(monkeypatch: pytest.MonkeyPatch) -> None:
    import typer.completion

    # Typer finds the shell in the process tree (shellingham), not in $SHELL: a run with
    # no shell above it (a detached CI job) would find none.
    monkeypatch.setattr(typer.completion, "_get_shell_name", lambda: "bash")
    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0 and re.fullmatch(r"investigate \S+\n", res.output)
    res = CliRunner().invoke(app, ["--help"])
    assert "--install-completion" in res.output and "--show-completion" in res.output
    res = CliRunner().invoke(app, ["--show-completion", "bash"], prog_name="investigate",
                             env={"SHELL": "/bin/bash"})
    assert res.exit_code == 0 and "_INVESTIGATE_COMPLETE" in res.output, res.output


def test_deprecated_case_add_config_is_hidden_but_works() -> None:
    res = CliRunner().invoke(app, ["case", "add", "--help"])
    assert "--package-limits" in res.output and "--config " not in res.output
    res = CliRunner().invoke(app, ["case", "add", "missing.zip", "--interpretation", "i.json",
                                   "--hypotheses", "h.json", "--config", "x.toml",
                                   "--package-limits", "y.toml"])
    assert res.exit_code == 2 and "deprecated" in res.output


def test_last_outcome_names_the_state_a_pause_or_cancel_left() -> None:
    from investigation.loop.outcome import last_outcome_text

    assert last_outcome_text("PAUSED", "INVESTIGATING") == "PAUSED (was INVESTIGATING)"
    assert last_outcome_text("CANCELLED", "PAUSED") == "CANCELLED (was PAUSED)"
    assert last_outcome_text("BLOCKED", "PROVIDER_EXHAUSTED") == "BLOCKED (PROVIDER_EXHAUSTED)"
    assert last_outcome_text("PROGRESSED", None) == "PROGRESSED"
    assert last_outcome_text(None, None) == "none (no step has run)"


def test_help_prose_is_reflowed_and_lists_keep_their_lines() -> None:
    """Typer keeps a docstring's line breaks, so an 80-column terminal broke every line of
    a help text in two ("a finding" / "refuses the build"); the entry point joins prose
    paragraphs and leaves lists, commands and indented lines alone."""
    import subprocess
    import sys
    from pathlib import Path

    from workers.cli import reflowed

    text = """Summary line.

    First prose line
    goes on here.

    - an item
    - another item

      $ investigate demo
    """
    assert reflowed(text) == ("Summary line.\n\nFirst prose line goes on here.\n\n"
                              "- an item\n- another item\n\n  $ investigate demo")
    exe = str(Path(sys.executable).with_name("investigate"))
    shown = subprocess.run([exe, "case", "build", "--help"], capture_output=True, text=True,
                           env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"}, check=True).stdout
    assert not [line for line in shown.splitlines() if line.strip() == "finding"], shown
    assert "a finding refuses the build" in " ".join(shown.split())


def test_flags_show_no_value_type_and_option_paths_are_not_cut() -> None:
    """Typer showed `--json <bool>`, and `--json true` was then refused as an extra
    argument; `run --help` cut `config/investigation.examp…` at 80 columns (a new user's
    trial)."""
    import subprocess
    import sys
    from pathlib import Path

    exe = str(Path(sys.executable).with_name("investigate"))
    shown = subprocess.run([exe, "run", "--help"], capture_output=True, text=True,
                           env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"}, check=True).stdout
    assert "<bool>" not in shown and "…" not in shown, shown
    assert "<path>" in shown and "--json" in shown and "--no-wait" in shown


@pytest.mark.parametrize("command", [["status"], ["summary"], ["steps"], ["dispatch"],
                                     ["tests", "list"]])
def test_a_case_argument_no_case_id_can_be_is_a_usage_error(
        command: list[str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 100,000-character id came back whole in CASE_NOT_FOUND (a hostile trial)."""
    monkeypatch.setenv("INVESTIGATE_HOME", str(tmp_path))
    res = CliRunner().invoke(app, [*command, "c" * 100_000, "--json"])
    assert res.exit_code == 2, res.output
    assert "is 100000 characters long, no case id" in res.output
    assert len(res.output) < 2000 and not (tmp_path / "investigation.db").exists()


def test_a_listing_commands_json_help_says_it_prints_an_array() -> None:
    """`cases --json` prints a JSON array while its help promised "one JSON object" (a
    500-step reader); the listings say what they print, every other command one object."""
    listings = {"cases", "tests list", "providers check"}
    for path, cmd in _commands():
        if _is_group(cmd) or path in SERVERS:
            continue
        (option,) = [p for p in cmd.params if "--json" in p.opts]
        said = " ".join((option.help or "").split())  # type: ignore[attr-defined]
        if path in listings:
            assert "JSON array" in said, (path, said)
        else:
            assert "JSON array" not in said, (path, said)
