"""Issue 10.3: what the snapshot (and the model) supplies reaches no terminal raw.

A source line and a log line hold ``ESC [ 2 J`` (clear screen), an OSC 0 window title, an
OSC 8 hyperlink, a C1 CSI and a RIGHT-TO-LEFT OVERRIDE; the model's note holds a ZERO
WIDTH SPACE and Rich markup. After a whole investigation through the CLI, ``run``, ``status``,
``summary`` and the stored ``summary.md`` show each of them as a visible escape.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from investigation.cases.builder import build_package
from investigation.operations import summary_bytes
from investigation.text_safety import first_unsafe
from tests import casekit
from workers.cli import app

HOSTILE_LINE = ("    log('\x1b[2J\x1b]0;pwned\x07\x1b]8;;http://evil.example/\x1b\\click"
                "\x1b]8;;\x1b\\ \x9b31m \u202eelif skool\u202c percent')\n")
#: Bidirectional controls and invisible tag characters in a reply are refused by the
#: contract (``contract.printable``); a zero-width space is not, and Rich markup is plain
#: text to the model.
NOTE = "looks fine\u200b [link=http://evil.example/]x[/link]"


@pytest.fixture
def cli_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("INVESTIGATE_HOME", str(home))
    monkeypatch.delenv("INVESTIGATE_DATABASE_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    return home


def _raw(text: str) -> list[str]:
    """Unsafe characters present in ``text`` (TAB and LF are fine in CLI output)."""
    return sorted({ch for ch in text if ch not in "\t\n" and first_unsafe(ch)})


def test_snapshot_escapes_are_shown_escaped_everywhere(tmp_path: Path, cli_env: Path) -> None:
    root = tmp_path / "work"
    src = root / "src"
    for rel, text in casekit.SOURCE.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    (src / "shop" / "noisy.py").write_text("def noisy():\n" + HOSTILE_LINE)
    (root / "logs").mkdir()
    (root / "logs" / "app.log").write_text("INFO start\n" + HOSTILE_LINE)
    (root / "report.md").write_text(casekit.REPORT)
    package = build_package(src, root / "report.md", tmp_path / "p.zip",
                            logs=root / "logs").path
    (tmp_path / "i.json").write_text(json.dumps(casekit.INTERPRETATION))
    (tmp_path / "h.json").write_text(json.dumps(casekit.HYPOTHESES[:1]))
    runner = CliRunner()
    added = runner.invoke(app, ["case", "add", str(package), "--interpretation",
                                str(tmp_path / "i.json"), "--hypotheses",
                                str(tmp_path / "h.json")])
    assert added.exit_code == 0, added.output
    case_id = added.stdout.strip()
    replies = [
        casekit.q("source.search", {"pattern": "percent"}, note=NOTE),
        casekit.q("logs.search", {"pattern": "pwned"}, assessment=(60, ["E1"]),
                  evidence=["E1"], note=NOTE),
        casekit.finish("supported", (70, ["E2"]), ["E1", "E2"], reason=NOTE),
    ]
    (tmp_path / "replies.jsonl").write_text("\n".join(json.dumps(r) for r in replies) + "\n")
    (tmp_path / "providers.toml").write_text(
        '[[providers]]\nname = "replay"\nkind = "scripted"\npath = "replies.jsonl"\n')
    ran = runner.invoke(app, ["run", case_id, "--providers", str(tmp_path / "providers.toml")])
    assert ran.exit_code == 0, ran.output
    assert _raw(ran.output) == []

    summary = runner.invoke(app, ["summary", case_id])
    assert summary.exit_code == 0
    assert _raw(summary.output) == []
    assert "\\x1b[2J\\x1b]0;pwned\\x07\\x1b]8;;http://evil.example/" in summary.output
    assert "\\x9b31m" in summary.output
    assert "\\u202eelif skool\\u202c" in summary.output
    # plain() prose: the escape, then Markdown escaping (backslashes doubled, brackets escaped)
    assert "fine\\\\u200b \\[link=http\\[:\\]//evil.example/\\]x" in summary.output

    from investigation.store import Store

    stored = summary_bytes(Store(f"sqlite:///{cli_env / 'investigation.db'}"), case_id)
    assert _raw(stored.decode()) == []
    assert stored.decode() == summary.output

    status = runner.invoke(app, ["status", case_id])
    assert status.exit_code == 0
    assert _raw(status.output) == []
