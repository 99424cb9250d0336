"""``investigate demo`` as a user runs it: the executable of this environment, the
embedded default, a fresh home; the commands it prints work when pasted into a shell.

The summary's sha256 is pinned: the demo is deterministic and issue 13 requires that the
performance work leave it unchanged (README, "Performance"). A change that alters it on
purpose updates the pin and the README's table together (decision 152 did: contexts no
longer list other hypotheses' resolved questions, so the replay server counts fewer
prompt tokens for two of the demo's model calls; nothing else in the summary moved).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

INVESTIGATE = str(Path(sys.executable).with_name("investigate"))
DEMO_SUMMARY_SHA256 = "727247027c8d1c5c94bbf77d1bd70b5ce8b0a121e319d8cd4a744af20b184935"


def test_demo_runs_and_its_printed_commands_reach_its_store(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INVESTIGATE_")}
    # A fleet's database in the shell: the demo still runs on its own SQLite store, and
    # the commands it prints must not read that database instead.
    env["INVESTIGATE_DATABASE_URL"] = "postgresql+psycopg://nobody@127.0.0.1:1/absent"
    env["INVESTIGATE_HOME"] = str(tmp_path / "home")
    # ... and migrations left to `investigate db upgrade`, as the deploy files set it: the
    # demo's own store, new each run, is still created at the current migration.
    env["INVESTIGATE_AUTO_MIGRATE"] = "false"
    run = subprocess.run([INVESTIGATE, "demo"], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    (summary,) = (tmp_path / "home").rglob("summary.md")
    assert hashlib.sha256(summary.read_bytes()).hexdigest() == DEMO_SUMMARY_SHA256
    printed = [line.strip()[2:] for line in run.stdout.splitlines()
               if line.strip().startswith("$ ") and " summary " in line]
    assert printed, run.stdout
    command = printed[0]
    assert "INVESTIGATE_DATABASE_URL= " in command, command
    shown = subprocess.run(["bash", "-c", command.replace("investigate ", f"{INVESTIGATE} ",
                                                           1)],
                           env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=120, check=False)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    case_id = re.search(r"case-[0-9a-f]{16}", command)
    assert case_id and case_id.group(0) in shown.stdout
    assert shown.stdout.replace("\r", "") == summary.read_text().replace("\r", "")
    # The report and export it suggests go to the demo's own directory, not the checkout.
    for word in (" report ", " export "):
        (line,) = [ln.strip()[2:] for ln in run.stdout.splitlines()
                   if ln.strip().startswith("$ ") and word in ln]
        done = subprocess.run(["bash", "-c", line.replace("investigate ", f"{INVESTIGATE} ",
                                                           1)],
                              env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, check=False)
        assert done.returncode == 0, line + done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]
    assert list((tmp_path / "home").rglob("export/analysis/investigation/summary.md"))
    # Run again: a fresh store, and the same printed export command works again (it
    # refused the export directory the first run had filled).
    again = subprocess.run([INVESTIGATE, "demo"], env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=600, check=False)
    assert again.returncode == 0, again.stdout + again.stderr
    (line,) = [ln.strip()[2:] for ln in again.stdout.splitlines()
               if ln.strip().startswith("$ ") and " export " in ln]
    done = subprocess.run(["bash", "-c", line.replace("investigate ", f"{INVESTIGATE} ", 1)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, line + done.stdout + done.stderr
