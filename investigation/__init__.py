"""The investigation engine's domain library (no Celery, kombu or Redis here).

The API the docs show::

    from investigation import (Investigator, StageEnv, InvestigationConfig, ProvidersConfig,
                               Store, PackageReader, LLMGateway, build_providers)

    store = Store("sqlite:///cases.db"); store.create_schema()
    providers = ProvidersConfig.load("providers.toml")
    env = StageEnv(store=store, config=InvestigationConfig(),
                   gateway_factory=lambda: LLMGateway(store, build_providers(providers),
                                                      providers.gateway),
                   reader=PackageReader(InvestigationConfig().package))
    outcome = Investigator(env).run(case_id)      # Outcome(outcome="COMPLETED", ...)

Names are imported on first use, so importing a submodule stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "InvestigationConfig": "investigation.config",
    "ProvidersConfig": "investigation.config",
    "InvestigationError": "investigation.errors",
    "LockBusy": "investigation.errors",
    "Investigator": "investigation.loop.investigator",
    "StageEnv": "investigation.loop.env",
    "Stages": "investigation.loop.stages",
    "Outcome": "investigation.loop.outcome",
    "StepKey": "investigation.loop.outcome",
    "Store": "investigation.store",
    "PackageReader": "investigation.cases.reader",
    "build_package": "investigation.cases.builder",
    "register_case": "investigation.cases.registry",
    "LLMGateway": "investigation.llm.gateway",
    "build_providers": "investigation.llm.gateway",
    "ToolRouter": "investigation.tools",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'investigation' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
