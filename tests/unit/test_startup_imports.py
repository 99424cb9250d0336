"""What the CLI imports to start: every command and every shell completion pays it (two
trials measured 1.4-2.3 s for `investigate --version`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import investigation.llm as llm


def test_the_llm_package_names_resolve_lazily() -> None:
    assert set(llm.__all__) == set(llm._HOMES)
    for name in llm.__all__:
        module = f"investigation.llm.{llm._HOMES[name]}"
        assert getattr(llm, name) is getattr(__import__(module, fromlist=[name]), name)


def test_reading_a_case_does_not_import_the_http_client_or_the_gateway() -> None:
    """`status`, `summary`, `cases` and the guidance read the store; the model's HTTP
    client, the gateway and the replay server are imported by the commands that call a
    model (a fresh interpreter: this test process imported them already)."""
    code = ("import sys, investigation.operations, investigation.guidance, workers.views; "
            "print(sorted(m for m in ('httpx', 'investigation.llm.gateway', "
            "'investigation.llm.replay_server', 'investigation.llm.openai') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


#: What the command line must not import before a command's body runs: the store, the
#: settings, Redis, the broker, Celery, the HTTP client and the engine's readers (not pydantic:
#: Typer itself imports it to parse a command's parameters).
HEAVY = ("sqlalchemy", "sqlmodel", "pydantic_settings", "httpx", "redis",
         "kombu", "celery", "investigation.store", "investigation.guidance",
         "investigation.operations", "investigation.config", "investigation.loop.probe",
         "workers.settings", "workers.health")


def _imported_by(argv: list[str], env: dict[str, str] | None = None) -> list[str]:
    """The ``HEAVY`` modules imported by ``investigate *argv`` run through its entry point
    in a fresh interpreter (the last line it prints)."""
    import os

    code = ("import sys\n"
            "from workers.cli import main\n"
            f"sys.argv = ['investigate', *{argv!r}]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            f"print('\\n' + repr(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={**os.environ, **(env or {})})
    return eval(done.stdout.strip().splitlines()[-1])  # a list of names printed above


def test_help_version_and_completion_import_no_command_body() -> None:
    """`investigate --version`, `--help`, a command's `--help` and a shell completion (at
    every TAB) import Typer and Rich, not the command tree (1.4-2.3 s on a slow machine,
    0.1-0.3 s now)."""
    for argv in (["--version"], ["--help"], ["status", "--help"], ["case", "add", "--help"],
                 ["replies", "check", "--help"], ["db", "--help"]):
        assert _imported_by(argv) == [], argv
    completion = {"_INVESTIGATE_COMPLETE": "complete_bash", "COMP_WORDS": "investigate sta",
                  "COMP_CWORD": "1"}
    assert _imported_by([], completion) == []


def test_a_command_still_imports_what_it_needs() -> None:
    """The check above is not vacuous: a command that reads the store imports it."""
    assert "sqlalchemy" in _imported_by(["cases", "--json"],
                                        {"INVESTIGATE_HOME": "/nonexistent/home"})


def test_the_log_format_applies_from_the_first_line_a_command_logs(tmp_path) -> None:
    """The entry point leaves the logging set-up (INVESTIGATE_LOG_FORMAT) to the command it
    runs, so that help loads no settings: a command's own log lines still come formatted."""
    import json
    import os

    code = ("import logging, sys\n"
            "from workers.cli import main\n"
            "import workers.cli_ops as ops\n"
            "real = ops._settings\n"
            "def settings():\n"
            "    logging.getLogger('probe').warning('configured before the body')\n"
            "    return real()\n"
            "ops._settings = settings\n"
            "sys.argv = ['investigate', 'cases']\n"
            "main()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "INVESTIGATE_LOG_FORMAT": "json",
                               "INVESTIGATE_HOME": str(tmp_path / "home")})
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert any(line.get("message") == "configured before the body" for line in lines), \
        done.stderr


def test_replies_check_styles_every_verdict() -> None:
    """``workers.cli_report`` names the verdicts itself (so that it imports no checker to
    start): the names must be the checker's."""
    import workers.cli  # noqa: F401  (it registers cli_report: imported first)
    from investigation.loop import script_check
    from workers.cli_report import _STYLE

    assert set(_STYLE) == set(script_check.VERDICTS)


def test_status_imports_neither_alembic_nor_redis(tmp_path: Path) -> None:
    """`status` in a shell that names no broker checks the store's migration without
    Alembic and reads the run's file lock without redis-py (together about a third of its
    start); registration, which migrates, and a fleet's shell still import them."""
    from tests.casekit import make_case

    case = make_case(tmp_path / "case")
    probe = ("import atexit, sys\n"
             "atexit.register(lambda: print(sorted({m.split('.')[0] for m in sys.modules}\n"
             "    & {'alembic', 'redis'}), file=sys.stderr))\n"
             f"sys.argv = ['investigate', 'status', {case.case_id!r}]\n"
             "from workers.cli import main\n"
             "main()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INVESTIGATE_")}
    env.update(INVESTIGATE_DATABASE_URL=case.store.url, INVESTIGATE_HOME=str(tmp_path / "h"))
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2], env=env)
    assert done.returncode == 0, done.stderr
    assert "INVESTIGATING" in done.stdout, done.stdout
    assert done.stderr.strip().splitlines()[-1] == "[]", done.stderr
