"""Issue 10.7: secrets in a snapshot never reach the model.

``case build`` refuses a tree holding secrets (``PKG_SECRETS_FOUND``, listing file, line
and type, never the secret) unless ``--allow-secrets``; then every tool result masks them
(``SECRET_MASKED``), so no request to the model, no context, evidence, export or
``summary.md`` holds one, and a search cannot be used to guess one.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from sqlmodel import select
from typer.testing import CliRunner

from investigation.cases.builder import build_package
from investigation.cases.reader import PackageReader
from investigation.cases.registry import register_case
from investigation.config import InvestigationConfig
from investigation.errors import PackageError
from investigation.operations import export
from investigation.store import Store
from investigation.store.engine import StoredArtifact
from investigation.store.models import Evidence
from tests import casekit
from workers.cli import app

OPENAI = "sk-live-4f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c"
AWS_ID = "AKIAIOSFODNN7EXAMPLE"
DB_PASSWORD = "Tr0ub4dor&3-horse"
GITHUB = "ghp_16C7e42F292c6912E7710c838347Ae178B4a"
PEM_BODY = "MIIEowIBAAKCAQEAq7BFUpkGp3+LQmlQKyBqCqNjTJxPZsPHXwQmb1kKzN0tGdNs"
SECRETS = [OPENAI, AWS_ID, DB_PASSWORD, GITHUB, PEM_BODY]


def _tree(root: Path) -> Path:
    src = root / "src"
    for rel, text in casekit.SOURCE.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    (src / ".env").write_text(f"DEBUG=1\nOPENAI_API_KEY={OPENAI}\n")
    (src / "shop" / "settings.py").write_text(
        f'AWS_ACCESS_KEY_ID = "{AWS_ID}"\nTIMEOUT = 30\n')
    (src / "deploy").mkdir()
    (src / "deploy" / "id_rsa").write_text(
        f"-----BEGIN RSA PRIVATE KEY-----\n{PEM_BODY}\n-----END RSA PRIVATE KEY-----\n")
    (root / "logs").mkdir()
    (root / "logs" / "app.log").write_text(f"INFO boot token={GITHUB}\nINFO order 1 ok\n")
    (root / "report.md").write_text(casekit.REPORT)
    db = root / "shop.sqlite"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT, password TEXT)")
    conn.execute("INSERT INTO users VALUES (1, 'ada', ?)", (DB_PASSWORD,))
    conn.commit()
    conn.close()
    return src


def _run_to_completion(tmp_path: Path, package: Path, replies: list[dict[str, object]]
                       ) -> tuple[Store, str, dict[str, Evidence], list[StoredArtifact]]:
    """Register ``package`` with one hypothesis, run it on ``replies`` (scripted) until it
    completes; return its store, id, evidence by id and every stored artifact."""
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    store.create_schema()
    case_id = register_case(store, package.read_bytes(), casekit.INTERPRETATION,
                            casekit.HYPOTHESES[:1], PackageReader(InvestigationConfig().package))
    root = tmp_path / "run"
    root.mkdir()
    (root / "replies.jsonl").write_text("\n".join(json.dumps(r) for r in replies) + "\n")
    (root / "providers.toml").write_text(
        '[[providers]]\nname = "replay"\nkind = "scripted"\npath = "replies.jsonl"\n')
    case = casekit.Case(store, case_id, package, root / "replies.jsonl",
                        root / "providers.toml", root)
    outcome = case.investigator().run(case_id)
    assert outcome.outcome == "COMPLETED", outcome
    with store.session() as s:
        evidence = {e.evidence_id: e for e in s.exec(
            select(Evidence).where(Evidence.case_id == case_id))}
        artifacts = list(Store.artifacts(s, case_id))  # exact bytes, decoded
    return store, case_id, evidence, artifacts


def _nowhere(secrets: list[str], store: Store, case_id: str, artifacts: list[StoredArtifact],
             target: Path) -> None:
    """No stored byte (requests, contexts, results, evidence, states, summary.md) and no
    exported file holds any of ``secrets``."""
    for art in artifacts:
        data = bytes(art.data)
        for secret in secrets:
            assert secret.encode() not in data, (art.path, secret)
    export(store, case_id, target)
    for path in target.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(secret.encode() in data for secret in secrets), path


def test_build_refuses_secrets_and_names_them_masked(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    with pytest.raises(PackageError) as err:
        build_package(src, tmp_path / "report.md", tmp_path / "p.zip",
                      logs=tmp_path / "logs")
    assert err.value.code == "PKG_SECRETS_FOUND"
    message = err.value.message
    for where in ("source/.env:2: Secret Keyword", "source/shop/settings.py:1: AWS Access Key",
                  "source/deploy/id_rsa:1: Private Key", "logs/app.log:1: GitHub Token"):
        assert where in message, message
    assert not any(secret in message for secret in SECRETS)
    assert not (tmp_path / "p.zip").exists()
    # A given log is named by its own path, and .gitignore is not offered for it (a new
    # user's `--logs logs2` read `logs/app.log` and added logs2/.gitignore in vain).
    (tmp_path / "logs").rename(tmp_path / "logs2")
    with pytest.raises(PackageError) as err:
        build_package(src, tmp_path / "report.md", tmp_path / "p.zip",
                      logs=tmp_path / "logs2")
    message = err.value.message
    assert f"(logs/app.log is {tmp_path / 'logs2' / 'app.log'})" in message, message
    assert "Remove the secrets from the source files, or leave those files out (in a git " \
        "checkout, with .gitignore); remove or redact them in the given log, report or " \
        "database files (.gitignore does not apply to those)" in message, message
    (tmp_path / "logs2").rename(tmp_path / "logs")

    runner = CliRunner()
    args = ["case", "build", "--source", str(src), "--report", str(tmp_path / "report.md"),
            "--logs", str(tmp_path / "logs"), "-o", str(tmp_path / "cli.zip")]
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2
    assert "PKG_SECRETS_FOUND" in refused.output and "--allow-secrets" in refused.output
    assert not any(secret in refused.output for secret in SECRETS)
    allowed = runner.invoke(app, [*args, "--allow-secrets"])
    assert allowed.exit_code == 0, allowed.output
    assert "warning: packed a secret (--allow-secrets): source/.env:2" in allowed.output
    assert not any(secret in allowed.output for secret in SECRETS)


def test_tool_results_mask_secrets_before_they_become_evidence(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    package = build_package(src, tmp_path / "report.md", tmp_path / "p.zip",
                            db=tmp_path / "shop.sqlite", logs=tmp_path / "logs",
                            allow_secrets=True)
    assert package.secrets
    q = casekit.q
    replies = [
        q("source.search", {"pattern": "OPENAI_API_KEY"}),
        q("source.search", {"pattern": OPENAI[:12]}, assessment=(50, ["E1"]), evidence=["E1"]),
        q("source.read", {"path": "deploy/id_rsa", "start_line": 1, "end_line": 3},
          assessment=(10, ["E2"]), evidence=["E1"]),
        q("db.query", {"sql": "SELECT name, password FROM users"}, assessment=(40, ["E3"]),
          evidence=["E1"]),
        q("logs.search", {"pattern": "token", "regex": True}, assessment=(40, ["E4"]),
          evidence=["E1"]),
        q("source.search", {"pattern": "AKIA[0-9A-Z]{4}", "regex": True},
          assessment=(40, ["E5"]), evidence=["E1"]),
        casekit.finish("supported", (60, ["E6"]), ["E1"]),
    ]
    store, case_id, evidence, artifacts = _run_to_completion(tmp_path, package.path, replies)
    found = json.loads(evidence["E1"].findings_json)
    assert [i["text"] for i in found] == [
        "OPENAI_API_KEY=[secret masked: Secret Keyword]"]
    assert json.loads(evidence["E1"].warnings_json) == ["SECRET_MASKED"]
    assert evidence["E2"].item_count == 0  # the search needed the secret's own text
    assert [i["text"] for i in json.loads(evidence["E3"].findings_json)] == \
        ["[secret masked: Private Key]"] * 3
    assert json.loads(evidence["E4"].findings_json)[0]["row"] == \
        {"name": "ada", "password": "[secret masked: Secret Keyword]"}
    assert json.loads(evidence["E5"].findings_json)[0]["text"] == \
        "INFO boot token=[secret masked: GitHub Token]"
    assert evidence["E6"].item_count == 0  # a regex for the key's own shape finds nothing
    _nowhere(SECRETS, store, case_id, artifacts, tmp_path / "export")


TABLE_TOKEN = "ghp_A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
COLUMN_KEY = "AKIAIOSFODNN7EXAMPL3"
SLACK = "xoxb-123456789012-123456789012-abcdefghijklmnopqrstuvwx"
NAMED = [TABLE_TOKEN, COLUMN_KEY, SLACK]


def _named_tree(root: Path) -> Path:
    """Secrets where names are: a table, a column and an index named by a key, a source
    file named by a key, and a value SQLite's error text quotes."""
    src = root / "src"
    for rel, text in casekit.SOURCE.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    (src / "keys").mkdir()
    (src / "keys" / f"{COLUMN_KEY}.txt").write_text("rotated\n")
    (root / "report.md").write_text(casekit.REPORT)
    conn = sqlite3.connect(root / "shop.sqlite")
    conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO users VALUES (1, 'ada')")
    conn.execute(f'CREATE TABLE "{TABLE_TOKEN}" (id INTEGER, "{COLUMN_KEY}" TEXT)')
    conn.execute(f'CREATE INDEX "idx_{COLUMN_KEY}" ON "{TABLE_TOKEN}" ("{COLUMN_KEY}")')
    conn.execute(f'INSERT INTO "{TABLE_TOKEN}" VALUES (1, ?)', (SLACK,))
    # Views a model can name without knowing a secret (it never sees one).
    conn.execute(f'CREATE VIEW w AS SELECT * FROM "{TABLE_TOKEN}"')
    conn.execute(f'CREATE VIEW v AS SELECT "{COLUMN_KEY}" AS val FROM "{TABLE_TOKEN}"')
    conn.commit()
    conn.close()
    return src


def test_secrets_in_database_and_file_names_are_refused_or_masked(tmp_path: Path) -> None:
    src = _named_tree(tmp_path)
    with pytest.raises(PackageError) as err:
        build_package(src, tmp_path / "report.md", tmp_path / "p.zip",
                      db=tmp_path / "shop.sqlite")
    message = err.value.message
    assert err.value.code == "PKG_SECRETS_FOUND"
    for where in ("db/shop.sqlite: GitHub Token in schema object 2 (table)",
                  "db/shop.sqlite: AWS Access Key in schema object 3 (index)",
                  "AWS Access Key in the file name"):
        assert where in message, message
    assert not any(secret in message for secret in NAMED)

    package = build_package(src, tmp_path / "report.md", tmp_path / "p.zip",
                            db=tmp_path / "shop.sqlite", allow_secrets=True)
    q = casekit.q
    replies = [
        q("db.tables", {}),
        q("db.query", {"sql": "SELECT * FROM w"}, assessment=(50, ["E1"]), evidence=["E1"]),
        q("db.query", {"sql": "SELECT json_extract('{}', val) FROM v"},
          assessment=(50, ["E2"]), evidence=["E1"]),
        q("source.list", {"prefix": "keys"}, assessment=(50, ["E3"]), evidence=["E1"]),
        q("source.search", {"pattern": "rotated"}, assessment=(50, ["E4"]), evidence=["E1"]),
        casekit.finish("supported", (60, ["E5"]), ["E1"]),
    ]
    store, case_id, evidence, artifacts = _run_to_completion(tmp_path, package.path, replies)
    tables = json.loads(evidence["E1"].findings_json)
    assert {i["table"] for i in tables} == {"users", "[secret masked: GitHub Token]", "v", "w"}
    (row,) = json.loads(evidence["E2"].findings_json)
    assert row["row"] == {"id": 1, "[secret masked: AWS Access Key]":
                          "[secret masked: Slack Token]"}
    assert json.loads(evidence["E3"].warnings_json) == ["TOOL_FAILED", "SECRET_MASKED"]
    assert [i["path"] for i in json.loads(evidence["E4"].findings_json)] == \
        ["keys/[secret masked: AWS Access Key].txt"]
    # The first context's table list and reply schema included.
    _nowhere(NAMED, store, case_id, artifacts, tmp_path / "export")

def test_masking_a_huge_line_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    """A 3 MB line of keyword assignments is masked only as far as a finding can quote it
    (``MAX_MASKED_CHARS``), for `source.read` and `source.search` alike."""
    from investigation.cases.snapshot import DictSnapshot
    from investigation.config import ToolLimits
    from investigation.secrets import MAX_MASKED_CHARS, SecretMasker
    from investigation.tools.router import ToolRouter

    seen: list[int] = []
    original = SecretMasker.mask

    def spy(self: SecretMasker, text: str) -> tuple[str, int]:
        seen.append(len(text))
        return original(self, text)

    monkeypatch.setattr(SecretMasker, "mask", spy)
    router = ToolRouter(DictSnapshot({"big.cfg": (" api_key=" * 350_000 + "\n").encode()}),
                        ToolLimits())
    read = router.execute("source.read", {"path": "big.cfg", "start_line": 1, "end_line": 1})
    found = router.execute("source.search", {"pattern": "api"})
    assert read.items and found.items
    assert "SECRET_MASKED" in read.warnings and "SECRET_MASKED" in found.warnings
    assert seen and max(seen) <= MAX_MASKED_CHARS


def test_upstream_text_is_masked_in_the_context(tmp_path: Path) -> None:
    """The interpretation and the hypothesis statements come from upstream systems: a key
    pasted into them is masked in the context."""
    from tests.integration.test_loop_rules import context_at

    case = casekit.make_case(
        tmp_path / "c", replies=casekit.HAPPY_REPLIES,
        interpretation={"summary": f"totals are wrong; the log shows {TABLE_TOKEN}",
                        "notes": [f"key {COLUMN_KEY}"]},
        hypotheses=[{"id": 1, "statement": f"the discount uses {COLUMN_KEY}"},
                    {"id": 2, "statement": "rounding"}])
    case.investigator().step(case.case_id)
    context = context_at(case, 1)
    text = json.dumps(context)
    assert TABLE_TOKEN not in text and COLUMN_KEY not in text
    assert context["interpretation"]["summary"] == \
        "totals are wrong; the log shows [secret masked: GitHub Token]"
    assert context["hypothesis"]["statement"] == \
        "the discount uses [secret masked: AWS Access Key]"
    from investigation.report import render_report

    page = render_report(case.store, case.case_id, env="")
    assert "the discount uses [secret masked: AWS Access Key]" in page
    assert TABLE_TOKEN not in page and COLUMN_KEY not in page
