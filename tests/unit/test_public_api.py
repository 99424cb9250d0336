"""The documented public surface of ``investigation`` resolves and stays explicit."""

from __future__ import annotations

import ast
from pathlib import Path

import investigation

ROOT = Path(__file__).resolve().parents[2]


def test_every_exported_name_resolves() -> None:
    for name in investigation.__all__:
        assert getattr(investigation, name).__name__ == name


def test_all_is_exactly_the_documented_surface() -> None:
    assert investigation.__all__ == sorted([
        "InvestigationConfig", "InvestigationError", "Investigator", "LLMGateway",
        "LockBusy", "Outcome", "PackageReader", "ProvidersConfig", "StageEnv", "Stages",
        "StepKey", "Store", "ToolRouter", "build_package", "build_providers",
        "register_case",
    ])


def test_domain_library_never_imports_the_runtime() -> None:
    forbidden = {"celery", "kombu", "redis", "workers"}
    for path in (ROOT / "investigation").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in forbidden, f"{path}: imports {name}"
