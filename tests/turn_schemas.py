"""Representative per-turn reply schemas, built from real contexts of the tiny case.

:func:`representative_schemas` runs the tiny case (the happy scripted replies) under two
policies and keeps the schema of a few kinds of turn; it is computed once per process.
"""

from __future__ import annotations

import json
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

from sqlmodel import select

from investigation.config import BudgetConfig, InvestigationConfig, LoopConfig
from investigation.store import Store
from investigation.store.models import StageRun
from tests.casekit import make_case


def _schemas(root: Path, config: InvestigationConfig) -> list[tuple[dict[str, Any],
                                                                    dict[str, Any]]]:
    case = make_case(root)
    inv = case.investigator(config)
    for _ in range(12):
        if inv.step(case.case_id).outcome in ("COMPLETED", "BLOCKED"):
            break
    with case.store.session() as s:
        arts = {a.path: a.data for a in Store.artifacts(s, case.case_id)}
        built = [json.loads(r.output_json) for r in s.exec(
            select(StageRun).where(StageRun.stage == "build_context")
            .order_by(StageRun.step_seq))]  # type: ignore[arg-type]
    return [(json.loads(arts[b["context_path"]]), json.loads(arts[b["reply_schema_path"]]))
            for b in built if not b.get("finalize")]


@lru_cache(maxsize=1)
def representative_schemas() -> dict[str, dict[str, Any]]:
    """``{"first_turn", "pending_with_support", "closing", "with_tests"}`` -> schema."""
    with tempfile.TemporaryDirectory() as tmp:
        plain = _schemas(Path(tmp) / "a", InvestigationConfig())
        capped = _schemas(Path(tmp) / "b", InvestigationConfig(
            loop=LoopConfig(max_iterations_per_hypothesis=1),
            budget=BudgetConfig(test_costs={"human": 5, "automated": 6})))
    out: dict[str, dict[str, Any]] = {"first_turn": plain[0][1]}
    out["pending_with_support"] = next(s for c, s in plain if "anyOf" in s
                                       and c["previous_result"] is not None)
    out["closing"] = next(s for c, s in capped if c["closing_reason"])
    out["with_tests"] = next(s for c, s in capped if "test" in c["allowed_actions"])
    return out
