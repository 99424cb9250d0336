"""Configuration: the shipped examples stay true, broken files get stable codes."""

from __future__ import annotations

from pathlib import Path

import pytest

from investigation.config import InvestigationConfig, ProvidersConfig
from investigation.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_example_policy_is_the_default() -> None:
    assert InvestigationConfig.load(ROOT / "config/investigation.example.toml") == \
        InvestigationConfig()


def test_example_providers_load() -> None:
    cfg = ProvidersConfig.load(ROOT / "config/providers.example.toml")
    assert [p.name for p in cfg.providers] == ["primary", "local-llama", "replay"]
    assert [p.structured_output for p in cfg.providers[:2]] == ["openai", "llama_cpp"]
    assert cfg.gateway.attempts == 10
    assert "api_key" not in str(cfg.identity())


@pytest.mark.parametrize(("text", "code"), [
    ("[loop\n", "CONFIG_INVALID"),
    ("[loop]\nmax_invalid_responses = 0\n", "CONFIG_INVALID"),
    ("[budget.costs]\n\"db.query\" = 0\n", "CONFIG_INVALID"),
    ("[budget.costs]\n\"db.drop\" = 1\n", "CONFIG_INVALID"),
    ("[budget]\nmax_refund_percent = 100\n", "CONFIG_INVALID"),
    ("[surprise]\nx = 1\n", "CONFIG_INVALID"),
])
def test_broken_policy_files(tmp_path: Path, text: str, code: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        InvestigationConfig.load(path)
    assert err.value.code == code


def test_missing_file_is_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        InvestigationConfig.load(tmp_path / "nope.toml")
    assert err.value.code == "CONFIG_UNREADABLE"


def test_providers_need_at_least_one(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("[gateway]\nattempts = 3\n")
    with pytest.raises(ConfigError) as err:
        ProvidersConfig.load(path)
    assert err.value.code == "CONFIG_INVALID"


def test_policy_hash_changes_with_policy() -> None:
    base = InvestigationConfig()
    other = InvestigationConfig.model_validate({"budget": {"credit_units": 61}})
    assert base.policy_hash() != other.policy_hash()
    limits_only = InvestigationConfig.model_validate({"limits": {"max_checkpoints": 5}})
    assert base.policy_hash() == limits_only.policy_hash()  # limits are not frozen policy


@pytest.mark.parametrize("text", [
    "[tools]\nsql_timeout_s = inf\n",
    "[tools]\nsearch_timeout_s = nan\n",
    "[tools]\nsql_timeout_s = 1e12\n",
])
def test_non_finite_or_absurd_durations_are_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        InvestigationConfig.load(path)
    assert err.value.code == "CONFIG_INVALID"


@pytest.mark.parametrize("gateway", ["delay_s = inf", "delay_s = 1e12", "max_delay_s = nan"])
def test_gateway_timing_must_be_finite(tmp_path: Path, gateway: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text(f"[gateway]\n{gateway}\n\n[[providers]]\nname = \"r\"\nkind = \"scripted\"\n"
                    "path = \"r.jsonl\"\n")
    with pytest.raises(ConfigError) as err:
        ProvidersConfig.load(path)
    assert err.value.code == "CONFIG_INVALID"


def test_a_file_that_is_not_utf8_is_invalid(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_bytes(b"[loop]\nx = \"\xff\"\n")
    with pytest.raises(ConfigError) as err:
        InvestigationConfig.load(path)
    assert err.value.code == "CONFIG_INVALID"


@pytest.mark.parametrize(("entry", "expected"), [
    # `[providers]` instead of `[[providers]]`: the message names the TOML form to write.
    ('[providers]\nname = "m"\nkind = "openai"\n', "`[[providers]]`, not `[providers]`"),
    # A string where TOML has a number is refused, not coerced.
    ('[[providers]]\nname = "m"\nkind = "openai"\nbase_url = "http://127.0.0.1:8/v1"\n'
     'model = "x"\ntimeout_s = "30"\n', "timeout_s: Input should be a valid number"),
    ('[gateway]\nattempts = "3"\n[[providers]]\nname = "m"\nkind = "scripted"\npath = "r"\n',
     "gateway.attempts: Input should be a valid integer"),
    ('[[providers]]\nname = "m"\nkind = "openai"\nmodel = "x"\n', "'m' of kind 'openai' needs base_url"),
    ('[[providers]]\nname = "m"\nkind = "openai"\n', "needs base_url and model"),
])
def test_providers_file_mistakes_are_named(tmp_path: Path, entry: str, expected: str) -> None:
    file = tmp_path / "providers.toml"
    file.write_text(entry)
    with pytest.raises(ConfigError) as info:
        ProvidersConfig.load(file)
    assert info.value.code == "CONFIG_INVALID"
    assert expected in info.value.message
