"""Configuration: the shipped examples stay true, broken files get stable codes."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from investigation.config import (
    MAX_SQL_INT,
    GatewayConfig,
    InvestigationConfig,
    ProviderConfig,
    ProvidersConfig,
)
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


@pytest.mark.parametrize(("text", "named"), [
    ("[loop]\nmax_invalid_responses = \"3\"\n", "loop.max_invalid_responses"),
    ("[loop]\nearly_diagnosis = \"yes\"\n", "loop.early_diagnosis"),
    ("[loop]\nearly_diagnosis = 1\n", "loop.early_diagnosis"),
    ("[budget]\ncredit_units = true\n", "budget.credit_units"),
    ("[budget]\ncredit_units = 1.5\n", "budget.credit_units"),
    ("[budget]\ncredit_units = 60.0\n", "budget.credit_units"),
    ("[budget.test_costs]\nhuman = \"5\"\n", "budget.test_costs.human"),
    ("[tools]\nisolate_sql = 0\n", "tools.isolate_sql"),
    ("[tools]\nsql_timeout_s = \"2\"\n", "tools.sql_timeout_s"),
    ("[package]\nmax_entries = \"20\"\n", "package.max_entries"),
    ("[package]\nmax_compression_ratio = true\n", "package.max_compression_ratio"),
])
def test_a_setting_of_the_wrong_type_is_refused_not_converted(tmp_path: Path, text: str,
                                                              named: str) -> None:
    """A policy is frozen into a case at its first step: a string, a boolean or a float
    where the key takes an integer (or the other way round) is refused with the key's
    name, never read as some number (``true`` as a credit of 1 unit)."""
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        InvestigationConfig.load(path)
    assert err.value.code == "CONFIG_INVALID" and named in err.value.message


def test_a_float_setting_takes_an_integer(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[tools]\nsql_timeout_s = 3\n[limits]\nmax_model_cost = 2\n")
    cfg = InvestigationConfig.load(path)
    assert (cfg.tools.sql_timeout_s, cfg.limits.max_model_cost) == (3.0, 2.0)


def test_missing_file_is_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        InvestigationConfig.load(tmp_path / "nope.toml")
    assert err.value.code == "CONFIG_UNREADABLE"


def test_a_missing_providers_file_says_how_to_write_one(tmp_path: Path) -> None:
    """`case add` prints `run CASE --providers providers.toml`; pasted before the file
    existed it said only "No such file or directory" (a new user's trial)."""
    import tomllib

    with pytest.raises(ConfigError) as err:
        ProvidersConfig.load(tmp_path / "providers.toml")
    assert err.value.code == "CONFIG_UNREADABLE"
    assert "config/providers.example.toml" in err.value.message
    shown = err.value.message.split("entry with the lines ", 1)[1].rstrip(")")
    lines = shown.replace(" and ", ", ").split(", ")
    written = tmp_path / "providers.toml"  # the lines it shows make a working file
    written.write_text("[[providers]]\n" + "\n".join(lines) + "\n")
    assert tomllib.loads(written.read_text())["providers"][0]["kind"] == "scripted"
    (tmp_path / "replies.jsonl").write_text("")
    assert ProvidersConfig.load(written).providers[0].name == "replay"


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
    # A name is shown in tables, logs and metric labels: no terminal escapes, no twins
    # (a hostile-input trial saw ESC printed raw by `providers check`).
    ('[[providers]]\nname = "a\\u001b[31mred"\nkind = "scripted"\npath = "r"\n',
     "provider name holds the character U+001B"),
    ('[[providers]]\nname = "a\\u202eb"\nkind = "scripted"\npath = "r"\n', "U+202E"),
    ('[[providers]]\nname = "' + "n" * 101 + '"\nkind = "scripted"\npath = "r"\n',
     "longer than 100 characters"),
    ('[[providers]]\nname = "s"\nkind = "scripted"\npath = "r"\n'
     '[[providers]]\nname = "s"\nkind = "scripted"\npath = "q"\n',
     "two providers are named 's'"),
])
def test_providers_file_mistakes_are_named(tmp_path: Path, entry: str, expected: str) -> None:
    file = tmp_path / "providers.toml"
    file.write_text(entry)
    with pytest.raises(ConfigError) as info:
        ProvidersConfig.load(file)
    assert info.value.code == "CONFIG_INVALID"
    assert expected in info.value.message


HUGE = 10**21  # over a signed 64-bit SQLite INTEGER


def _int_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, field info)`` of every integer setting of ``model`` and its sections
    (``int``, ``int | None``, ``dict[..., int]``)."""
    found: list[tuple[str, Any]] = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found += _int_fields(annotation, key + ".")
            continue
        args = typing.get_args(annotation)
        if typing.get_origin(annotation) is dict:
            found.append((key + ".*", args[1]))
        elif annotation is int or int in args:
            found.append((key, info))
    return found


def _upper_bound(field: Any) -> int | None:
    metadata = getattr(field, "metadata", None)
    if metadata is None:  # Annotated[int, Field(le=...)] as a dict's value type
        metadata = [m for a in typing.get_args(field)[1:] for m in getattr(a, "metadata", [a])]
    bounds = [m.le for m in metadata if getattr(m, "le", None) is not None]
    return min(bounds) if bounds else None


@pytest.mark.parametrize("model", [InvestigationConfig, ProviderConfig, GatewayConfig])
def test_every_integer_setting_has_an_upper_bound_that_fits_sqlite(
        model: type[BaseModel]) -> None:
    fields = _int_fields(model)
    assert fields
    for key, field in fields:
        bound = _upper_bound(field)
        assert bound is not None, f"{key} has no upper bound"
        assert bound <= MAX_SQL_INT, key


POLICY_INTS = [key for key, _ in _int_fields(InvestigationConfig)]


@pytest.mark.parametrize("key", POLICY_INTS)
def test_a_huge_integer_in_the_policy_is_refused_naming_the_key(tmp_path: Path,
                                                                key: str) -> None:
    section, name = key.split(".", 1)
    if name == "costs.*":
        text, named = f'[budget.costs]\n"db.query" = {HUGE}\n', "budget.costs.db.query"
    elif name == "test_costs.*":
        text, named = f"[budget.test_costs]\nhuman = {HUGE}\n", "budget.test_costs.human"
    else:
        text, named = f"[{section}]\n{name} = {HUGE}\n", key
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        InvestigationConfig.load(path)
    assert err.value.code == "CONFIG_INVALID"
    assert f"{named}: Input should be less than or equal to" in err.value.message


@pytest.mark.parametrize("text, named", [
    (f"[budget]\ncredit_units = {10**12 + 1}\n", "budget.credit_units"),
    (f"[limits]\nmax_model_cost = {HUGE}.0\n", "limits.max_model_cost"),
    (f"[limits]\nmax_model_cost = {10**308}.0\n", "limits.max_model_cost"),
])
def test_units_and_money_are_at_most_10_to_the_12(tmp_path: Path, text: str,
                                                  named: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        InvestigationConfig.load(path)
    assert err.value.code == "CONFIG_INVALID" and f"{named}: " in err.value.message
    assert InvestigationConfig.model_validate(
        {"budget": {"credit_units": 10**12}}).budget.credit_units == 10**12


@pytest.mark.parametrize("entry, named", [
    ("max_tokens", "providers.0.max_tokens"),
    ("context_window_tokens", "providers.0.context_window_tokens"),
    ("schema_max_string_chars", "providers.0.schema_max_string_chars"),
])
def test_a_huge_integer_in_the_providers_file_is_refused(tmp_path: Path, entry: str,
                                                         named: str) -> None:
    file = tmp_path / "providers.toml"
    file.write_text(f'[gateway]\nattempts = {HUGE}\n[[providers]]\nname = "m"\n'
                    f'kind = "scripted"\npath = "r"\n{entry} = {HUGE}\n')
    with pytest.raises(ConfigError) as info:
        ProvidersConfig.load(file)
    assert info.value.code == "CONFIG_INVALID"
    assert "gateway.attempts: Input should be less than or equal to" in info.value.message
    assert f"{named}: Input should be less than or equal to" in info.value.message


@pytest.mark.parametrize("variable", [
    "INVESTIGATE_LOCK_TTL_S", "INVESTIGATE_VISIBILITY_TIMEOUT_S", "INVESTIGATE_MAX_COUNTDOWN_S",
    "INVESTIGATE_SWEEP_INTERVAL_S", "INVESTIGATE_MAX_STAGE_DELIVERIES",
    "INVESTIGATE_WORKER_MAX_MEMORY_KIB", "INVESTIGATE_SOFT_SHUTDOWN_S"])
def test_huge_environment_settings_are_refused(variable: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.settings import load_settings

    monkeypatch.setenv(variable, "1" + "0" * 30)
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert info.value.code == "CONFIG_INVALID"
    assert variable in info.value.message


@pytest.mark.parametrize("text", [
    "[loop]\nx = " + "[" * 3000 + "]" * 3000 + "\n",
    "[loop]\nx = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n",
])
def test_a_file_nested_too_deeply_is_invalid_not_a_crash(tmp_path: Path, text: str) -> None:
    """tomllib parses nesting recursively: 500 nested arrays raised RecursionError, a
    traceback and exit code 1 (which `run` documents as a blocked case)."""
    path = tmp_path / "deep.toml"
    path.write_text(text)
    for load in (InvestigationConfig.load, ProvidersConfig.load):
        with pytest.raises(ConfigError) as err:
            load(path)
        assert err.value.code == "CONFIG_INVALID"
        assert "nests arrays or tables too deeply" in err.value.message


def test_the_cli_refuses_a_deeply_nested_file_with_its_code(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from workers.cli import app

    path = tmp_path / "deep.toml"
    path.write_text("[[providers]]\nname = " + "[" * 3000 + "]" * 3000 + "\n")
    result = CliRunner().invoke(app, ["providers", "check", "--providers", str(path)])
    assert result.exit_code == 2, result.output
    assert "CONFIG_INVALID" in result.output and "Traceback" not in result.output


def test_a_rule_across_settings_is_reported_without_an_empty_variable_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule over several variables has no location: it read "INVESTIGATE_: Value
    error, ..."."""
    from workers.settings import load_settings

    monkeypatch.setenv("INVESTIGATE_VISIBILITY_TIMEOUT_S", "3600")
    monkeypatch.setenv("INVESTIGATE_MAX_COUNTDOWN_S", "99999")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert info.value.message.startswith(
        "bad setting: INVESTIGATE_MAX_COUNTDOWN_S (99999) must be below "
        "INVESTIGATE_VISIBILITY_TIMEOUT_S (3600)"), info.value.message


@pytest.mark.parametrize("currency", ["<b>", "U\u202eSD", "a|b", "US\nD", "€", "1USD", "$"])
def test_a_currency_label_with_markup_or_controls_is_refused(tmp_path: Path,
                                                             currency: str) -> None:
    """limits.currency is printed in summary.md, the report and messages: '<b>\\u202e|\\n#'
    put raw HTML, a right-to-left override, a table cell and a heading into summary.md (a
    hostile-input trial)."""
    path = tmp_path / "c.toml"
    path.write_text(f"[limits]\ncurrency = {json.dumps(currency)}\n")
    with pytest.raises(ConfigError) as err:
        InvestigationConfig.load(path)
    assert err.value.code == "CONFIG_INVALID" and "limits.currency" in err.value.message
    for fine in ("USD", "EUR", "credits", "x.y-z_1"):
        path.write_text(f'[limits]\ncurrency = "{fine}"\n')
        assert InvestigationConfig.load(path).limits.currency == fine
