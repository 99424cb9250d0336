"""The LLM layer: providers, the persisted gateway and a loopback replay server.

Public surface::

    ChatRequest, ProviderReply, Provider             request/reply shapes, provider protocol
    OpenAIProvider, ScriptedProvider                 the two provider kinds
    LLMGateway, build_providers                      persisted operations, failover, backoff
    Succeeded, RetryPending, Blocked, GatewayOutcome outcomes of ``LLMGateway.call``
    ReplayServer, Fault                              OpenAI-compatible loopback server

Each name is imported from its module when first used (PEP 562): a command that reads
one constant of ``llm.spend`` or ``llm.types`` no longer imports httpx, the gateway and
the replay server with it (the CLI's start-up, which every command and every shell
completion pays).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from investigation.llm.gateway import LLMGateway, build_providers
    from investigation.llm.openai import OpenAIProvider
    from investigation.llm.replay_server import Fault, ReplayServer
    from investigation.llm.scripted import ScriptedProvider
    from investigation.llm.types import (
        Blocked,
        ChatRequest,
        GatewayOutcome,
        Provider,
        ProviderReply,
        RetryPending,
        Succeeded,
    )

#: Where each public name lives.
_HOMES = {
    "LLMGateway": "gateway", "build_providers": "gateway", "OpenAIProvider": "openai",
    "Fault": "replay_server", "ReplayServer": "replay_server",
    "ScriptedProvider": "scripted", "Blocked": "types", "ChatRequest": "types",
    "GatewayOutcome": "types", "Provider": "types", "ProviderReply": "types",
    "RetryPending": "types", "Succeeded": "types",
}

__all__ = [
    "Blocked",
    "ChatRequest",
    "Fault",
    "GatewayOutcome",
    "LLMGateway",
    "OpenAIProvider",
    "Provider",
    "ProviderReply",
    "ReplayServer",
    "RetryPending",
    "ScriptedProvider",
    "Succeeded",
    "build_providers",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
