"""Prompt size in tokens: the documented estimate and a provider's input budget.

The engine measures a request in the provider's tokens as well as in bytes, so a request
is fitted to the model's context window before it is sent instead of being refused by the
server (``context_length_exceeded``).

Estimate (deterministic, no tokenizer needed)::

    tokens(messages) = sum(ceil(utf8_bytes(content) / bytes_per_token)
                           + MESSAGE_OVERHEAD_TOKENS for each message)
                       + REPLY_PRIMER_TOKENS

``bytes_per_token`` is a provider setting (default 2.5). A provider whose server has a
tokenize endpoint (``tokenizer = "llama.cpp" | "llama-cpp-python" | "vllm"``) also counts
exactly before sending (:mod:`investigation.llm.openai`); the estimate still decides how
far the context is shrunk when it is built.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from investigation import jsonio
from investigation.config import DEFAULT_OUTPUT_RESERVE_TOKENS, ProviderConfig
from investigation.llm.body import BodyTooLarge, BodyUndecodable, read_body

if TYPE_CHECKING:  # annotations only: the CLI does not import httpx to start
    import httpx

#: Tokens a chat template adds around each message (role markers, separators).
MESSAGE_OVERHEAD_TOKENS = 8
#: Tokens a chat template adds to open the assistant's reply.
REPLY_PRIMER_TOKENS = 4


def estimate_tokens(messages: Iterable[dict[str, Any]], bytes_per_token: float) -> int:
    """The estimated prompt tokens of ``messages`` (see the module docstring)."""
    total = REPLY_PRIMER_TOKENS
    for message in messages:
        size = len(str(message.get("content", "")).encode("utf-8", "surrogatepass"))
        total += math.ceil(size / bytes_per_token) + MESSAGE_OVERHEAD_TOKENS
    return total


@dataclass(frozen=True)
class PromptBudget:
    """How many prompt tokens one provider can take.

    Attributes:
        provider: the provider's name.
        max_input_tokens: ``context_window_tokens`` minus the output budget
            (``max_tokens``, else :data:`DEFAULT_OUTPUT_RESERVE_TOKENS`).
        bytes_per_token: the provider's estimate ratio.
    """

    provider: str
    max_input_tokens: int
    bytes_per_token: float

    def fits(self, messages: list[dict[str, Any]]) -> bool:
        """Whether the estimate of ``messages`` is within :attr:`max_input_tokens`."""
        return estimate_tokens(messages, self.bytes_per_token) <= self.max_input_tokens


def output_budget(config: ProviderConfig) -> int:
    """Tokens kept for the reply: ``max_tokens`` or the default reserve."""
    return config.max_tokens or DEFAULT_OUTPUT_RESERVE_TOKENS


def prompt_budget(config: ProviderConfig) -> PromptBudget | None:
    """The prompt budget of a provider that states its context window, else ``None``."""
    if config.context_window_tokens is None:
        return None
    return PromptBudget(config.name,
                        max(0, config.context_window_tokens - output_budget(config)),
                        config.bytes_per_token)


# -- exact counts from the server's own tokenizer ------------------------------------------

#: Largest tokenize answer read (bytes, decoded).
MAX_TOKENIZE_RESPONSE_BYTES = 4 << 20
#: Most tokens a text can count per UTF-8 byte (a token covers at least one byte).
MAX_TOKENS_PER_BYTE = 1


def server_root(base_url: str) -> str:
    """``base_url`` without its ``/v1``: where a server's own endpoints are."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def server_count(config: ProviderConfig, messages: list[dict[str, Any]],
                 client: httpx.Client, headers: dict[str, str],
                 deadline: float | None = None) -> int:
    """The prompt tokens of ``messages`` by the server's tokenize endpoint.

    ``llama.cpp``: ``POST /tokenize {"content"}`` per message; ``llama-cpp-python``:
    ``POST /extras/tokenize/count {"input", "model"}`` per message (each plus
    :data:`MESSAGE_OVERHEAD_TOKENS`, plus :data:`REPLY_PRIMER_TOKENS`: the template's
    markers are estimated); ``vllm``: ``POST /tokenize {"model", "messages",
    "add_generation_prompt": true}``, which applies the chat template (exact).

    Every answer is read within ``deadline`` (``time.monotonic()``) and
    :data:`MAX_TOKENIZE_RESPONSE_BYTES` (decoded), and a count must be plausible: at least
    one token and at most :data:`MAX_TOKENS_PER_BYTE` per byte of the text counted.

    Raises:
        ValueError: the server's answer is not a plausible count, too large or too late
            (the caller falls back to the estimate), and any httpx error.
    """
    assert config.base_url is not None
    root = server_root(config.base_url)
    sent = {**headers, "Accept-Encoding": "identity"}

    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        with client.stream("POST", root + path, json=body, headers=sent) as response:
            if response.status_code != 200:
                raise ValueError(f"{path} answered HTTP {response.status_code}")

            def in_time() -> None:
                if deadline is not None and time.monotonic() > deadline:
                    raise ValueError(f"{path} did not answer in time")

            try:
                raw = read_body(response, MAX_TOKENIZE_RESPONSE_BYTES, in_time)
            except BodyTooLarge as exc:
                raise ValueError(f"{path} answered more than "
                                 f"{MAX_TOKENIZE_RESPONSE_BYTES} bytes") from exc
            except BodyUndecodable as exc:
                raise ValueError(f"{path}: {exc}") from exc
        doc = jsonio.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError(f"{path} did not answer a JSON object")
        return doc

    def plausible(count: Any, text_bytes: int) -> int:
        if type(count) is not int or not 1 <= count <= MAX_TOKENS_PER_BYTE * text_bytes + 64:
            raise ValueError(f"implausible token count {count!r}")
        return count

    def size(text: str) -> int:
        return len(text.encode("utf-8", "surrogatepass"))

    if config.tokenizer == "vllm":
        doc = post("/tokenize", {"model": config.model, "add_generation_prompt": True,
                                 "messages": [{"role": m["role"], "content": m["content"]}
                                              for m in messages]})
        return plausible(doc.get("count"), sum(size(m["content"]) for m in messages))
    total = REPLY_PRIMER_TOKENS
    for message in messages:
        content = message["content"]
        if config.tokenizer == "llama.cpp":
            tokens = post("/tokenize", {"content": content}).get("tokens")
            if not isinstance(tokens, list):
                raise ValueError("/tokenize gave no tokens")
            total += plausible(len(tokens), size(content)) if content else 0
        else:
            count = post("/extras/tokenize/count", {"input": content,
                                                    "model": config.model}).get("count")
            total += plausible(count, size(content)) if content else 0
        total += MESSAGE_OVERHEAD_TOKENS
    return total
