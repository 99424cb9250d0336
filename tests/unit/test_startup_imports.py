"""What the CLI imports to start: every command and every shell completion pays it (two
trials measured 1.4-2.3 s for `investigate --version`)."""

from __future__ import annotations

import subprocess
import sys

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
