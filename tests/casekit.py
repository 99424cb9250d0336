"""Build small, real cases for tests: a source tree, a SQLite database, logs, a package,
a registered case and a scripted providers file."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from investigation.cases.builder import build_package
from investigation.cases.reader import PackageReader
from investigation.cases.registry import register_case
from investigation.config import InvestigationConfig, ProvidersConfig
from investigation.llm.gateway import LLMGateway, build_providers
from investigation.loop.env import StageEnv
from investigation.loop.investigator import Investigator
from investigation.store import Store

SOURCE = {
    "shop/pricing.py": (
        "def apply_discount(total, percent):\n"
        "    # percent is 0..100\n"
        "    return total - total * percent / 10\n"
        "\n"
        "def tax(total):\n"
        "    return round(total * 0.2, 2)\n"
    ),
    "shop/orders.py": (
        "from shop.pricing import apply_discount\n"
        "\n"
        "def order_total(order):\n"
        "    return apply_discount(order['total'], order['discount'])\n"
    ),
    "README.md": "tiny shop\n",
}

REPORT = "Orders with a discount are charged far too little: a 10% discount gives 100% off.\n"
INTERPRETATION = {"summary": "Discounted order totals are wrong by a factor of ten."}
HYPOTHESES = [
    {"id": 1, "statement": "apply_discount divides the percent by 10 instead of 100."},
    {"id": 2, "statement": "The orders table stores discounts as fractions, not percents."},
]


def q(op: str, args: dict[str, Any], confidence: str = "plausible",
      assessment: tuple[int, list[str]] | None = None, evidence: list[str] | None = None,
      new_questions: list[str] | None = None, resolve: list[str] | None = None,
      note: str = "") -> dict[str, Any]:
    """A query reply."""
    return _reply({"action": "query", "operation": op, "arguments": args}, confidence,
                  assessment, evidence, new_questions, resolve, note)


def finish(confidence: str, assessment: tuple[int, list[str]] | None, evidence: list[str],
           reason: str = "done", action: str = "finish",
           resolve: list[str] | None = None) -> dict[str, Any]:
    """A finish (or reject) reply."""
    return _reply({"action": action, "reason": reason}, confidence, assessment, evidence,
                  None, resolve, "")


def _reply(nxt: dict[str, Any], confidence: str, assessment: tuple[int, list[str]] | None,
           evidence: list[str] | None, new_questions: list[str] | None,
           resolve: list[str] | None, note: str) -> dict[str, Any]:
    return {
        "assessment": None if assessment is None else
        {"score": assessment[0], "reason": "assessed", "evidence_ids": assessment[1]},
        "update": {"confidence": confidence, "evidence_ids": evidence or [],
                   "resolve_questions": resolve or [], "new_questions": new_questions or [],
                   "note": note},
        "next": nxt,
    }


#: A complete investigation of the tiny case: 6 decisions, 3 evidence records.
HAPPY_REPLIES = [
    q("source.search", {"pattern": "percent / 10"}, new_questions=["Where is the divisor?"]),
    q("db.query", {"sql": "SELECT id, total, discount FROM orders ORDER BY id"},
      confidence="weak"),
    q("source.read", {"path": "shop/pricing.py", "start_line": 1, "end_line": 3},
      confidence="supported", assessment=(90, ["E1"]), evidence=["E1"]),
    finish("strongly_supported", (95, ["E3"]), ["E1", "E3"], resolve=["Q1"]),
    finish("weakened", (80, ["E2"]), ["E2"], reason="discounts are stored as percents",
           action="reject"),
]


def make_db(path: Path) -> Path:
    """A small orders database (percent discounts)."""
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, total REAL, discount INTEGER)")
    conn.executemany("INSERT INTO orders VALUES (?, ?, ?)",
                     [(1, 100.0, 10), (2, 50.0, 0), (3, 80.0, 25)])
    conn.commit()
    conn.close()
    return path


#: The feedback key of test environments. Runtimes built from settings always have a key
#: (the variable or the key file), and the context says whether tests can be handed out,
#: so in-process reference runs need one too to produce the same checkpoints.
TEST_FEEDBACK_KEY = b"test-feedback-key-" + b"0" * 32


@dataclass
class Case:
    """A registered test case."""

    store: Store
    case_id: str
    package: Path
    replies_path: Path
    providers_path: Path
    root: Path

    def env(self, config: InvestigationConfig | None = None,
            explicit: bool = False,
            feedback_key: bytes | None = TEST_FEEDBACK_KEY) -> StageEnv:
        """A fresh stage environment (as a new process would build it); with a
        ``feedback_key`` (default: :data:`TEST_FEEDBACK_KEY`, as every CLI or worker runtime
        has a key) external tests can be handed out; ``None`` refuses them."""
        cfg = config or InvestigationConfig()
        providers = ProvidersConfig.load(self.providers_path)
        return StageEnv(
            store=self.store, config=cfg,
            gateway_factory=lambda: LLMGateway(self.store, build_providers(providers),
                                               providers.gateway),
            reader=PackageReader(cfg.package), explicit_config=explicit,
            feedback_key=feedback_key)

    def investigator(self, config: InvestigationConfig | None = None,
                     feedback_key: bytes | None = TEST_FEEDBACK_KEY) -> Investigator:
        return Investigator(self.env(config, feedback_key=feedback_key))


def build_tiny_package(root: Path, source: dict[str, str] | None = None) -> Path:
    """Write the tiny source tree (or ``source``), report, db and logs under ``root``;
    return the ZIP."""
    src = root / "src"
    for rel, text in (SOURCE if source is None else source).items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    (root / "report.md").write_text(REPORT)
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    (logs / "app.log").write_text("INFO order 1 total=0.0 discount=10\nINFO order 2 ok\n")
    db = make_db(root / "shop.sqlite")
    return build_package(src, root / "report.md", root / "case.zip", db=db, logs=logs).path


def make_case(root: Path, replies: list[dict[str, Any]] | list[str] | None = None,
              database_url: str | None = None, gateway_toml: str = "",
              hypotheses: list[dict[str, Any]] | None = None,
              interpretation: dict[str, Any] | None = None,
              source: dict[str, str] | None = None) -> Case:
    """Build, register and script a tiny case under ``root`` (default: the two
    :data:`HYPOTHESES`; another ``interpretation`` gives another case id, so several
    cases can share one store; ``source`` replaces the tiny source tree)."""
    root.mkdir(parents=True, exist_ok=True)
    package = build_tiny_package(root, source)
    store = Store(database_url or f"sqlite:///{root / 'store.db'}")
    store.create_schema()
    case_id = register_case(store, package.read_bytes(), interpretation or INTERPRETATION,
                            HYPOTHESES if hypotheses is None else hypotheses,
                            PackageReader(InvestigationConfig().package))
    lines = [r if isinstance(r, str) else json.dumps(r)
             for r in (HAPPY_REPLIES if replies is None else replies)]
    replies_path = root / "replies.jsonl"
    replies_path.write_text("\n".join(lines) + "\n")
    providers_path = root / "providers.toml"
    providers_path.write_text(
        (gateway_toml or "[gateway]\nattempts = 3\ndelay_s = 0\n")
        + '\n[[providers]]\nname = "replay"\nkind = "scripted"\npath = "replies.jsonl"\n')
    return Case(store, case_id, package, replies_path, providers_path, root)


@contextmanager
def unguarded(store: Store) -> Iterator[None]:
    """Drop the store's guard triggers for the block and restore them after: what someone
    with DDL rights on the database can do (tests show what the replay then finds)."""
    from investigation.store.guards import create_guards, drop_guards

    with store.engine.begin() as conn:
        drop_guards(conn)
    try:
        yield
    finally:
        with store.engine.begin() as conn:
            create_guards(conn, attempts=True)


def refused_by_store(store: Store, statement: Any) -> None:
    """Run ``statement`` and check that the store's guards refuse it (nothing changes)."""
    import pytest
    from sqlalchemy.exc import DBAPIError

    with pytest.raises(DBAPIError, match="STORE_IMMUTABLE"), store.session() as s:
        s.execute(statement)
