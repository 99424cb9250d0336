"""The committed demo assets stay what their docs say they are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from investigation.cases.registry import load_hypotheses, load_interpretation
from investigation.llm.scripted import read_script_lines
from investigation.loop.contract import parse_reply
from workers.demo import DEMO_DIR, DemoSource


def test_the_database_is_rebuilt_byte_for_byte(tmp_path: Path) -> None:
    out = tmp_path / "demo.sqlite"
    subprocess.run([sys.executable, str(DEMO_DIR / "make_db.py"), str(out)], check=True,
                   capture_output=True)
    assert out.read_bytes() == (DEMO_DIR / "demo.sqlite").read_bytes()


def test_every_scripted_reply_satisfies_the_contract() -> None:
    lines = read_script_lines(DEMO_DIR / "replies.jsonl")
    assert len(lines) >= 8
    replies = [parse_reply(line.decode("utf-8")) for line in lines]
    assert replies[0].assessment is None
    assert {r.next.action for r in replies} >= {"query", "finish", "reject"}


def test_case_inputs_and_pinned_source_are_valid() -> None:
    assert load_interpretation(DEMO_DIR / "interpretation.json")["summary"]
    assert len(load_hypotheses(DEMO_DIR / "hypotheses.json")) == 3
    src = DemoSource.load()
    assert (src.package, src.version) == ("sqlite-utils", "3.35")
    assert len(src.sha256) == 64
