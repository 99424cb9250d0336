"""ScriptedProvider: JSON Lines replay by call index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from investigation.config import ProviderConfig, ProvidersConfig
from investigation.errors import ConfigError, ProviderConfigurationError
from investigation.llm import ChatRequest, OpenAIProvider, ScriptedProvider, build_providers


def request(call_index: int) -> ChatRequest:
    return ChatRequest(
        messages=[{"role": "user", "content": "next?"}],
        response_schema={"type": "object"},
        schema_name="reply",
        call_index=call_index,
        case_id="c",
    )


def scripted(tmp_path: Path, data: bytes) -> ScriptedProvider:
    (tmp_path / "replies.jsonl").write_bytes(data)
    return ScriptedProvider(
        ProviderConfig(name="replay", kind="scripted", path="replies.jsonl"), tmp_path
    )


def test_serves_line_by_call_index_with_exact_bytes(tmp_path: Path) -> None:
    p = scripted(tmp_path, b'{"a": 1}\r\n\n   \n{"b":  2}\n{not json}')
    replies = [p.send(p.build_request_bytes(request(i)), request(i)) for i in range(3)]
    assert [r.raw for r in replies] == [b'{"a": 1}', b'{"b":  2}', b"{not json}"]
    assert [r.content for r in replies] == ['{"a": 1}', '{"b":  2}', "{not json}"]
    assert replies[0].http_status is None and replies[0].prompt_tokens is None
    # the same call index always gets the same line (retries, replays)
    assert p.send(b"", request(1)).raw == b'{"b":  2}'
    assert p.content_from_raw(b'{"b":  2}') == '{"b":  2}'


def test_request_bytes_are_canonical(tmp_path: Path) -> None:
    p = scripted(tmp_path, b"{}\n")
    data = p.build_request_bytes(request(4))
    assert json.loads(data) == {
        "call_index": 4, "messages": [{"role": "user", "content": "next?"}], "schema_name": "reply"
    }
    assert data == p.build_request_bytes(request(4))


def test_exhausted_script(tmp_path: Path) -> None:
    p = scripted(tmp_path, b'{"a": 1}\n')
    with pytest.raises(ProviderConfigurationError) as info:
        p.send(b"", request(1))
    assert info.value.code == "PROVIDER_SCRIPT_EXHAUSTED"


def test_unreadable_script(tmp_path: Path) -> None:
    p = ScriptedProvider(ProviderConfig(name="r", kind="scripted", path="missing.jsonl"), tmp_path)
    with pytest.raises(ProviderConfigurationError) as info:
        p.send(b"", request(0))
    assert info.value.code == "PROVIDER_SCRIPT_UNREADABLE"
    q = scripted(tmp_path, b"\xff\xfe\n")
    with pytest.raises(ProviderConfigurationError) as info:
        q.send(b"", request(0))
    assert info.value.code == "PROVIDER_SCRIPT_UNREADABLE"


def test_path_required(tmp_path: Path) -> None:
    """A scripted entry without ``path`` is refused when the providers file is read."""
    file = tmp_path / "providers.toml"
    file.write_text('[[providers]]\nname = "r"\nkind = "scripted"\n')
    with pytest.raises(ConfigError) as info:
        ProvidersConfig.load(file)
    assert info.value.code == "CONFIG_INVALID"
    assert "'r' of kind 'scripted' needs path" in info.value.message


def test_build_providers_in_order(tmp_path: Path) -> None:
    (tmp_path / "replies.jsonl").write_text('{"a": 1}\n')
    (tmp_path / "providers.toml").write_text(
        '[gateway]\nattempts = 3\n\n'
        '[[providers]]\nname = "primary"\nkind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\n'
        'model = "m"\napi_key_env = "NOPE_KEY"\n\n'
        '[[providers]]\nname = "replay"\nkind = "scripted"\npath = "replies.jsonl"\n'
    )
    config = ProvidersConfig.load(tmp_path / "providers.toml")
    providers = build_providers(config, env={})
    assert [p.name for p in providers] == ["primary", "replay"]
    assert isinstance(providers[0], OpenAIProvider)
    assert isinstance(providers[1], ScriptedProvider)
    assert providers[1].send(b"", request(0)).content == '{"a": 1}'


def test_build_providers_rejects_duplicate_names() -> None:
    from pydantic import ValidationError

    entries = [ProviderConfig(name="x", kind="scripted", path="a"),
               ProviderConfig(name="x", kind="scripted", path="b")]
    with pytest.raises(ValidationError):  # the providers file itself is refused
        ProvidersConfig(providers=entries)
    # A config built around the validation still never yields two providers of one name.
    config = ProvidersConfig.model_construct(providers=entries)
    with pytest.raises(ProviderConfigurationError):
        build_providers(config)
