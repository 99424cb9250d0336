"""The LLM layer: providers, the persisted gateway and a loopback replay server.

Public surface::

    ChatRequest, ProviderReply, Provider             request/reply shapes, provider protocol
    OpenAIProvider, ScriptedProvider                 the two provider kinds
    LLMGateway, build_providers                      persisted operations, failover, backoff
    Succeeded, RetryPending, Blocked, GatewayOutcome outcomes of ``LLMGateway.call``
    ReplayServer, Fault                              OpenAI-compatible loopback server
"""

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
