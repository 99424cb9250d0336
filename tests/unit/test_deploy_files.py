"""The deploy files run real ``investigate`` commands with valid options.

Docker and systemd do not run on these machines, so every command line of
``deploy/compose.yaml`` and ``deploy/systemd/*.service`` is parsed here by the CLI itself
(Click's own parser: unknown commands, unknown options and bad values fail), with the
variables and systemd specifiers they use replaced by sample values. The example alert
rules may only name metrics the engine exports.
"""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer._click.core import Command  # Typer vendors its own Click
from typer._click.exceptions import UsageError
from typer.core import TyperGroup

from workers.cli import app

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SAMPLE_ENV = {"WORKER_CONCURRENCY": "2", "WORKER_METRICS_PORT": "9809", "FLOWER_PORT": "5555",
              "METRICS_PORT": "9808"}
SPECIFIERS = {"%i": "cases", "%H": "host1", "%h": "host1", "%%": "%"}


def parse_cli(argv: list[str]) -> list[str]:
    """Parse ``investigate ARGV`` with the real command tree; returns the command path.

    Raises:
        UsageError: an unknown command or option, a missing argument, a bad value.
    """
    command: Command = typer.main.get_command(app)
    ctx: typer.Context | None = None
    path: list[str] = []
    args = list(argv)
    while isinstance(command, TyperGroup):
        ctx = typer.Context(command, info_name=path[-1] if path else "investigate",
                            parent=ctx)
        if not args:
            raise UsageError("no command given", ctx)
        name = args.pop(0)
        sub = command.get_command(ctx, name)
        if sub is None:
            raise UsageError(f"no such command {name!r}", ctx)
        command, path = sub, [*path, name]
    with command.make_context(path[-1], args, parent=ctx) as _:
        pass
    return path


def test_the_parser_itself_refuses_what_the_cli_refuses() -> None:
    assert parse_cli(["worker", "--name", "w@%h", "-c", "2"]) == ["worker"]
    assert parse_cli(["db", "upgrade"]) == ["db", "upgrade"]
    for bad in (["wrker"], ["worker", "--no-such-option"], ["worker", "-c", "zero"],
                ["worker", "-c", "0"], ["db"], ["db", "downgrade"], ["flower", "--port"]):
        with pytest.raises(UsageError):
            parse_cli(bad)


def _expand(text: str) -> str:
    text = re.sub(r"\$\{(\w+)\}", lambda m: SAMPLE_ENV[m.group(1)], text)
    for spec, value in SPECIFIERS.items():
        text = text.replace(spec, value)
    return text


def compose_commands() -> dict[str, list[str]]:
    doc: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    engine_image = doc["x-engine"]["image"]
    commands = {}
    for name, service in doc["services"].items():
        if service.get("image") == engine_image:
            commands[name] = service["command"]
            health = service.get("healthcheck", {}).get("test")
            if health:
                assert health[0] == "CMD", name
                commands[f"{name} healthcheck"] = health[1:]
    return commands


def test_every_engine_service_in_compose_runs_a_valid_investigate_command() -> None:
    commands = compose_commands()
    assert {"migrate", "worker", "beat", "flower", "metrics"} <= set(commands)
    seen = set()
    for name, argv in commands.items():
        assert argv[0] == "investigate", f"{name}: {argv}"
        seen.add(parse_cli(argv[1:])[0])
    assert {"db", "worker", "beat", "flower", "metrics", "health"} <= seen


def test_compose_has_the_services_of_a_fleet() -> None:
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = doc["services"]
    assert {"redis", "postgres", "migrate", "worker", "beat", "flower", "metrics"} <= set(
        services)
    worker = services["worker"]["command"]
    assert worker[worker.index("--name") + 1].endswith("@%h")  # unique per replica
    # Flower listens on every container address: Flower's own login is required.
    assert "FLOWER_BASIC_AUTH" in services["flower"]["environment"]


def unit_commands() -> dict[str, list[list[str]]]:
    found: dict[str, list[list[str]]] = {}
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        parser.optionxform = str  # type: ignore[assignment,method-assign]
        parser.read_string(unit.read_text())
        lines = [parser["Service"][key] for key in ("ExecStartPre", "ExecStart")
                 if key in parser["Service"]]
        found[unit.name] = [shlex.split(_expand(line)) for line in lines]
    return found


def test_every_systemd_unit_runs_a_valid_investigate_command() -> None:
    units = unit_commands()
    assert {"investigation-worker@.service", "investigation-beat.service",
            "investigation-flower.service", "investigation-migrate.service",
            "investigation-metrics.service"} <= set(units)
    for name, commands in units.items():
        assert commands, name
        for argv in commands:
            assert argv[0].endswith("/investigate"), f"{name}: {argv}"
            parse_cli(argv[1:])
    worker = units["investigation-worker@.service"][0]
    assert worker[worker.index("--name") + 1] == "cases@host1"  # %i@%H
    assert worker[worker.index("--queue") + 1] == "cases"


def test_the_units_run_the_install_the_readme_makes() -> None:
    """The README installed into /opt/investigate while every unit ran
    /opt/investigation/bin/investigate: units that could not start (a new user's trial)."""
    readme = (DEPLOY.parent / "README.md").read_text()
    venvs = set(re.findall(r"python3? -m venv (\S+)", readme))
    assert len(venvs) == 1, venvs
    (venv,) = venvs
    for name, commands in unit_commands().items():
        for argv in commands:
            assert argv[0] == f"{venv}/bin/investigate", (name, argv[0], venv)
    for path in (DEPLOY / "cluster.env.example", DEPLOY / "cluster.sh"):
        for install in re.findall(r"/opt/\w+", path.read_text()):
            assert install == venv, (path.name, install)


def test_every_variable_the_units_use_is_in_the_example_environment() -> None:
    example = (DEPLOY / "systemd" / "investigation.env.example").read_text()
    for unit in (DEPLOY / "systemd").glob("*.service"):
        for var in re.findall(r"\$\{(\w+)\}", unit.read_text()):
            assert re.search(rf"^#? ?{var}=", example, re.M), f"{unit.name}: {var}"


def test_the_alert_rules_name_only_metrics_the_engine_exports() -> None:
    from workers import metrics

    m = metrics.metrics()
    exported = {"investigation_steps_total", "investigation_model_calls_total",
                "investigation_model_tokens_total", "investigation_units_spent_total",
                "investigation_units_refunded_total", "investigation_stages_in_progress",
                "investigation_stage_duration_seconds_bucket",
                "investigation_model_call_duration_seconds_bucket",
                # store gauges (StoreCollector)
                "investigation_cases", "investigation_blocked_cases",
                "investigation_pending_retries",
                "investigation_oldest_pending_retry_overdue_seconds",
                "investigation_oldest_idle_case_seconds", "investigation_queue_messages",
                "investigation_store_up"}
    assert m.steps._name == "investigation_steps"
    rules = yaml.safe_load((DEPLOY / "prometheus" / "investigation-rules.yml").read_text())
    named = set()
    for group in rules["groups"]:
        for rule in group["rules"]:
            named |= set(re.findall(r"\binvestigation_[a-z_]+", rule["expr"]))
    assert named and named <= exported, named - exported
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    assert {"InvestigationCasesBlocked", "InvestigationDispatchStuck",
            "InvestigationProviderFailing"} <= alerts


def _stub_bin(tmp_path: Path) -> tuple[Path, Path]:
    """A directory of stand-ins for the package managers (each records its call) and
    for ``id`` (root), put first on PATH; returns it and the record file."""
    calls = tmp_path / "calls.txt"
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ("apt-get", "apt", "dpkg"):
        (stubs / name).write_text(f'#!/bin/sh\necho "{name} $*" >> "{calls}"\nexit 1\n')
        (stubs / name).chmod(0o755)
    (stubs / "id").write_text("#!/bin/sh\necho 0\n")
    (stubs / "id").chmod(0o755)
    return stubs, calls


def test_the_services_script_a_fleet_starts_with_installs_nothing(tmp_path: Path) -> None:
    """``deploy/cluster.sh start`` runs ``scripts/ensure-services.sh``: it may start Redis
    and PostgreSQL, never install a package (a new user's trial saw it run apt-get for
    the report test's Chromium). The browser is ``ensure-chromium.sh``'s, which does call
    the package manager when the browser is missing (so the stand-ins are seen)."""
    import os
    import subprocess

    stubs, calls = _stub_bin(tmp_path)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}",
           "CHROMIUM_PATH": str(tmp_path / "no-chromium")}
    scripts = DEPLOY.parent / "scripts"
    services = subprocess.run(["bash", str(scripts / "ensure-services.sh")], env=env,
                              capture_output=True, text=True, timeout=120, check=False)
    assert services.returncode == 0, services.stderr
    assert not calls.exists(), calls.read_text()
    assert "ensure-services.sh" in (DEPLOY / "cluster.sh").read_text()
    assert "ensure-chromium" not in (DEPLOY / "cluster.sh").read_text()

    browser = subprocess.run(["bash", str(scripts / "ensure-chromium.sh")], env=env,
                             capture_output=True, text=True, timeout=60, check=False)
    assert browser.returncode == 0
    assert calls.read_text().startswith("apt-get update"), calls.read_text()
    assert "chromium did not install" in browser.stderr
