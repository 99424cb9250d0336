"""Configuration models: one pydantic model per component, validated at load.

``InvestigationConfig.load(path)`` reads a TOML file (all sections optional) and fails
with ``ConfigError`` (code ``CONFIG_INVALID`` or ``CONFIG_UNREADABLE``) on anything it
cannot use. Units are in field names (``_s`` seconds, ``_bytes`` bytes, ``_units``
investigation budget units).
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from investigation import jsonio
from investigation.constants import OPERATIONS
from investigation.errors import ConfigError
from investigation.files import MAX_SETTINGS_FILE_BYTES, read_bounded
from investigation.text_safety import first_unsafe, url_for_display

#: Upper bound of any duration setting (one day): larger values are configuration mistakes.
MAX_DURATION_S = 86_400.0
#: Largest value a signed 64-bit SQLite INTEGER holds: no integer setting may exceed it.
MAX_SQL_INT = 2**63 - 1
#: Upper bound of investigation units (credit, costs) and of money amounts.
MAX_UNITS = 10**12
#: Upper bound of counts (iterations, steps, entries, results, tokens, ...).
MAX_COUNT = 10**9
#: Upper bound of byte sizes (1 TiB).
MAX_BYTES = 1 << 40
#: Upper bound of integer durations in seconds (ten years).
MAX_SECONDS = 10 * 365 * 86_400
#: A cost in investigation units: a positive integer up to :data:`MAX_UNITS`.
Units = Annotated[int, Field(le=MAX_UNITS)]
#: A currency label (``limits.currency``).
_CURRENCY = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,7}")
#: Output tokens kept free in a provider's context window when it sets no ``max_tokens``.
DEFAULT_OUTPUT_RESERVE_TOKENS = 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


class LoopConfig(_Strict):
    """Loop bounds (seed 000, "Budget and stopping"). Frozen per analysis revision."""

    max_iterations_per_hypothesis: int = Field(50, ge=1, le=MAX_COUNT)
    """Research-producing model iterations per hypothesis; one final assessment follows. Default 50."""
    max_invalid_responses: int = Field(3, ge=1, le=MAX_COUNT)
    """Consecutive rejected replies before BLOCKED/INVALID_LLM_RESPONSES. Default 3."""
    max_questions_per_hypothesis: int = Field(30, ge=0, le=MAX_COUNT)
    """Bound on accumulated question records per hypothesis. Default 30."""
    test_deadline_seconds: int = Field(21600, ge=1, le=MAX_SECONDS)
    """Controller-owned external test deadline in seconds. Default 21600 (6 h)."""
    max_steps_per_dispatch: int = Field(8, ge=1, le=MAX_COUNT)
    """Steps per dispatch before it yields to other cases. Default 8."""
    max_results_without_novelty: int = Field(3, ge=1, le=MAX_COUNT)
    """Consecutive evidence records without new items that make an account low-information
    (terminal). Default 3."""
    early_diagnosis: bool = True
    """Whether a ``finish`` may carry an early-diagnosis request that defers alternatives
    to assessment-only after a deterministic review (``docs/early-diagnosis.md``)."""
    early_diagnosis_min_evidence: int = Field(2, ge=1, le=MAX_COUNT)
    """Distinct own evidence records with new findings that an early-diagnosis request
    must cite. Default 2."""


#: Default unit cost of each snapshot operation (``[budget.costs]``).
DEFAULT_COSTS: dict[str, int] = {
    "source.list": 2,
    "source.search": 3,
    "source.read": 2,
    "symbol.occurrences": 3,
    "db.tables": 1,
    "db.schema": 1,
    "db.query": 4,
    "logs.search": 3,
}


class BudgetConfig(_Strict):
    """Per-hypothesis credit and per-action costs, in investigation units."""

    credit_units: int = Field(60, ge=1, le=MAX_UNITS)
    """Initial credit of each hypothesis account. Default 60."""
    costs: dict[str, Units] = Field(default_factory=lambda: dict(DEFAULT_COSTS))
    """Cost per snapshot operation, each positive; a table that names only some
    operations keeps the defaults of the others (:data:`DEFAULT_COSTS`)."""
    test_costs: dict[Literal["human", "automated"], Units] = Field(default_factory=dict)
    """Cost per external test kind. Empty by default: a test action then is rejected
    (seed: test descriptors require explicitly configured costs)."""
    max_refund_percent: int = Field(80, ge=0, le=99)
    """Upper bound of a refund as a percentage of the action's cost (always < 100). Default 80."""

    @field_validator("costs", mode="before")
    @classmethod
    def _costs_over_defaults(cls, value: Any) -> Any:
        """``[budget.costs]`` with only ``"db.query" = 6`` meant that cost, not "every
        other operation has none" (it was refused with the missing ones named, hiding a
        wrong value: a hostile-input trial; the example says every key is optional)."""
        return {**DEFAULT_COSTS, **value} if isinstance(value, dict) else value

    @field_validator("costs")
    @classmethod
    def _costs_positive(cls, value: dict[str, int]) -> dict[str, int]:
        unknown = sorted(set(value) - set(OPERATIONS))
        if unknown:
            raise ValueError(f"unknown operations in budget.costs: {unknown}")
        bad = sorted(k for k, v in value.items() if v <= 0)
        if bad:
            raise ValueError(f"costs must be positive integers: {bad}")
        return value

    @field_validator("test_costs")
    @classmethod
    def _test_costs_positive(cls, value: dict[str, int]) -> dict[str, int]:
        bad = sorted(k for k, v in value.items() if v <= 0)
        if bad:
            raise ValueError(f"test costs must be positive integers: {bad}")
        return value


class LimitsConfig(_Strict):
    """InvestigationLimits (seed 000, "Persistence and recovery"): adjustable safety bounds."""

    max_context_bytes: int = Field(1 << 20, ge=4096, le=MAX_BYTES)
    """Bound of one serialized context. Default 1 MiB."""
    max_artifact_bytes: int = Field(4 << 20, ge=4096, le=MAX_BYTES)
    """Bound of one JSON artifact. Default 4 MiB. A model reply over it is a failed attempt
    (``PROVIDER_MALFORMED_RESPONSE``) and is not stored; the other artifacts are bounded
    below it by ``max_context_bytes`` and the tools' output bounds."""
    max_checkpoints: int = Field(10_000, ge=1, le=MAX_COUNT)
    """Bound of state checkpoints per case. Default 10,000."""
    max_execution_seconds: int = Field(7 * 24 * 3600, ge=1, le=MAX_SECONDS)
    """The lifecycle session's execution-time bound: summed step durations per case
    (waiting, blocked or paused time does not count). Default 7 days."""
    max_report_bytes: int = Field(64 << 10, ge=1024, le=MAX_BYTES)
    """Bytes of the bug report placed into each context. Default 64 KiB."""
    notes_in_context: int = Field(10, ge=0, le=MAX_COUNT)
    """How many of the selected hypothesis's latest audit notes the context carries (all
    stay in the store and the summary). Default 10."""
    full_evidence_in_context: int = Field(6, ge=1, le=MAX_COUNT)
    """How many of the selected hypothesis's latest evidence records carry full findings in
    the context; older ones appear as compact references. Default 6."""
    own_evidence_in_context: int = Field(32, ge=1, le=MAX_COUNT)
    """How many of the selected hypothesis's newest evidence records the context lists
    (its pending result always among them); older ones are not listed and are counted
    in the context's ``evidence_omitted``, so a context does not grow with the case.
    Default 32 (at least ``full_evidence_in_context``)."""
    other_evidence_in_context: int = Field(16, ge=0, le=MAX_COUNT)
    """How many of the other hypotheses' newest evidence records (together) the context
    lists as compact references; older ones are counted in ``evidence_omitted``.
    Default 16."""

    @model_validator(mode="after")
    def _own_window_holds_full(self) -> LimitsConfig:
        if self.own_evidence_in_context < self.full_evidence_in_context:
            raise ValueError("limits.own_evidence_in_context must be at least "
                             "limits.full_evidence_in_context")
        return self
    max_model_cost: float | None = Field(None, ge=0, le=MAX_UNITS, allow_inf_nan=False)
    """Cap on what the case's model calls may cost, in ``currency`` (providers state
    ``input_price_per_mtok``/``output_price_per_mtok``). Each call reserves its worst case
    first (``llm.spend``); a provider without prices is not used while a cap is set.
    Reached: the case blocks ``MODEL_COST_CAP``; raise it and resume. Default: no cap."""
    currency: str = Field("USD", min_length=1, max_length=8)
    """Label of the currency prices and the cap are in: 1 to 8 ASCII letters, digits,
    ``_``, ``.`` or ``-``, starting with a letter (``USD``, ``EUR``, ``credits``). Default
    ``USD``. Each priced attempt records it, and a case keeps the currency its costs were
    first recorded in: a priced call under another blocks the case with
    ``MODEL_COST_CURRENCY_CHANGED`` (decision 180)."""

    @field_validator("currency")
    @classmethod
    def _currency_is_a_label(cls, value: str) -> str:
        # It is printed in summary.md, the report and messages: no markup, no controls.
        if not _CURRENCY.fullmatch(value):
            raise ValueError("limits.currency must be 1 to 8 ASCII letters, digits, '_', "
                             "'.' or '-', starting with a letter (such as USD)")
        return value


class PackageLimits(_Strict):
    """PackageReader bounds, checked before any entry is read."""

    max_entries: int = Field(20_000, ge=1, le=MAX_COUNT)
    """Most entries (files and directories, the manifest included). Default 20,000."""
    max_entry_bytes: int = Field(32 << 20, ge=1, le=MAX_BYTES)
    """Largest uncompressed entry. Default 32 MiB."""
    max_total_bytes: int = Field(512 << 20, ge=1, le=MAX_BYTES)
    """Sum of uncompressed sizes. Default 512 MiB."""
    max_compression_ratio: int = Field(200, ge=1, le=MAX_COUNT)
    """Largest uncompressed/compressed ratio of one entry. Default 200."""
    max_name_bytes: int = Field(1024, ge=1, le=MAX_BYTES)
    """Longest entry name (the whole path, e.g. ``source/app/main.py``) in UTF-8 bytes;
    longer: ``PKG_NAME_TOO_LONG``. Default 1024."""
    max_segment_bytes: int = Field(255, ge=1, le=MAX_BYTES)
    """Longest segment of an entry name (one file or directory name) in UTF-8 bytes, the
    usual file-system bound; longer: ``PKG_NAME_TOO_LONG``. Default 255."""
    max_path_depth: int = Field(64, ge=2, le=MAX_COUNT)
    """Most ``/``-separated segments of an entry name (``source/app/main.py`` has 3);
    deeper: ``PKG_PATH_TOO_DEEP``. Default 64."""
    cache_entries: int = Field(8, ge=0, le=MAX_COUNT)
    """Validated packages kept in the in-process cache (by sha256). Default 8."""


class ToolLimits(_Strict):
    """Bounds of the snapshot operations."""

    max_results: int = Field(200, ge=1, le=MAX_COUNT)
    """Hard cap on items of one result (a caller may ask for fewer). Default 200."""
    max_output_bytes: int = Field(64 << 10, ge=1024, le=MAX_BYTES)
    """Hard cap on the serialized findings of one result. Default 64 KiB."""
    max_line_bytes: int = Field(500, ge=40, le=8192)
    """Quoted lines longer than this are cut (with a warning). Default 500, at most 8,192
    (secrets are masked within the first ``investigation.secrets.MAX_MASKED_CHARS``)."""
    max_read_lines: int = Field(400, ge=1, le=MAX_COUNT)
    """Largest ``source.read`` range. Default 400 lines."""
    sql_timeout_s: float = Field(2.0, gt=0, le=MAX_DURATION_S)
    """Wall-clock deadline of one ``db.query`` (progress handler); the isolated child that
    runs it is killed one second later. Default 2 s."""
    sql_memory_bytes: int = Field(256 << 20, ge=16 << 20, le=MAX_BYTES)
    """Address space one untrusted statement may add (``RLIMIT_AS`` of its child).
    Default 256 MiB."""
    isolate_sql: bool = True
    """Compile and run model-supplied SQL in a forked child under hard limits (Linux).
    Default true; false runs it in process (no bound on compilation)."""
    search_timeout_s: float = Field(5.0, gt=0, le=MAX_DURATION_S)
    """Deadline of one search over the snapshot. Default 5 s."""
    max_pattern_bytes: int = Field(1000, ge=1, le=MAX_BYTES)


#: Longest provider name (characters): it is a column, a log field and a metric label.
MAX_PROVIDER_NAME_CHARS = 100


class ProviderConfig(_Strict):
    """One entry of the ordered failover list (``[[providers]]``).

    Values are taken as TOML types them (``timeout_s = "30"`` is refused, not coerced);
    an ``openai`` entry needs ``base_url`` and ``model``, a ``scripted`` entry ``path``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    name: str
    kind: Literal["openai", "scripted"]
    base_url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    """Name of the environment variable holding the key; the key never reaches the store."""
    timeout_s: float = Field(60.0, gt=0, le=MAX_DURATION_S)
    structured_output: Literal["openai", "llama_cpp", "vllm", "sglang", "ollama",
                               "json_object", "none", "json_schema",
                               "json_object_schema"] = "json_schema"
    """How the per-turn reply schema reaches the server (``llm.dialects``): ``openai``
    (OpenAI strict ``json_schema``; alias ``json_schema``, the default), ``llama_cpp``
    (llama.cpp server ``json_object`` + schema; alias ``json_object_schema``), ``vllm`` /
    ``sglang`` (``json_schema`` compiled by xgrammar, outlines or llguidance),
    ``ollama`` (``json_schema``, compiled by Ollama into its ``format``), ``json_object``
    (JSON mode without a schema) or ``none``."""
    schema_max_string_chars: int | None = Field(None, ge=16, le=MAX_COUNT)
    """Cap on every ``maxLength`` of the schema sent (characters). Default: the dialect's
    own (``llama_cpp`` and ``ollama`` 1000, which their grammar converters accept; the
    others none). The validator's limits are unchanged."""
    path: str | None = None
    """JSON Lines reply file of a scripted provider (relative to the providers file)."""
    temperature: float | None = Field(None, ge=0, le=2)
    max_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    """Output token budget sent as ``max_tokens``. Default: not sent (the server's)."""
    context_window_tokens: int | None = Field(None, ge=256, le=MAX_COUNT)
    """The model's context window in tokens (llama.cpp ``--n_ctx``, vLLM
    ``--max-model-len``). Set, the engine fits each request within it before sending
    (prompt estimate plus ``max_tokens``, or :data:`DEFAULT_OUTPUT_RESERVE_TOKENS`)."""
    bytes_per_token: float = Field(2.5, ge=1.0, le=8.0)
    """The prompt-size estimate: UTF-8 bytes per token. Default 2.5: SmolLM2's tokenizer
    took 2.7 to 3.7 bytes per token on the demo's contexts (a file listing is the
    densest); lower it for tokenizers that split text finer (CJK, base64)."""
    tokenizer: Literal["estimate", "llama.cpp", "llama-cpp-python", "vllm"] = "estimate"
    """Where exact prompt token counts come from before a request is sent: the estimate
    only, or the server's own tokenize endpoint of that server kind."""
    input_price_per_mtok: float | None = Field(None, ge=0, le=1_000_000, allow_inf_nan=False)
    """Price of one million input (prompt) tokens, in ``limits.currency``."""
    output_price_per_mtok: float | None = Field(None, ge=0, le=1_000_000, allow_inf_nan=False)
    """Price of one million output (completion) tokens, in ``limits.currency``."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("provider name must not be empty")
        bad = first_unsafe(value)
        if bad is not None:  # the name is shown in tables, logs and metric labels
            raise ValueError(f"provider name holds the character U+{ord(bad):04X} (a control, "
                             "format or separator character)")
        if len(value) > MAX_PROVIDER_NAME_CHARS:
            raise ValueError(f"provider name is longer than {MAX_PROVIDER_NAME_CHARS} "
                             "characters")
        return value

    @model_validator(mode="after")
    def _required_by_kind(self) -> ProviderConfig:
        required = ("base_url", "model") if self.kind == "openai" else ("path",)
        missing = [k for k in required if not getattr(self, k)]
        if missing:
            raise ValueError(f"provider {self.name!r} of kind {self.kind!r} needs "
                             + " and ".join(missing))
        if self.base_url:
            try:
                parts = urlsplit(self.base_url)
                parts.port  # noqa: B018  (raises on a port outside 0..65535)
            except ValueError as exc:
                raise ValueError(f"provider {self.name!r}: base_url "
                                 f"{url_for_display(self.base_url)!r} is not a URL "
                                 f"({str(exc).replace(self.base_url, '...')})") from None
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"provider {self.name!r}: base_url must be an http:// or "
                                 f"https:// URL with a host (e.g. http://127.0.0.1:8000/v1), "
                                 f"got {url_for_display(self.base_url)!r}")
        return self


class GatewayConfig(_Strict):
    """Retry timing of the LLM gateway; failover order is the providers list."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    attempts: int = Field(10, ge=1, le=MAX_COUNT)
    """Attempts per provider operation over all providers. Default 10 (seed)."""
    delay_s: float = Field(2.0, ge=0, le=MAX_DURATION_S)
    """First backoff after a full failover round failed. Default 2 s."""
    backoff_factor: float = Field(2.0, ge=1, le=100)
    max_delay_s: float = Field(300.0, ge=0, le=MAX_DURATION_S)


class ProvidersConfig(_Strict):
    """The providers file (TOML): ``[gateway]`` and ``[[providers]]``."""

    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    providers: list[ProviderConfig] = Field(min_length=1)
    base_dir: str = "."
    """Directory that relative ``path`` values resolve against (set by ``load``)."""

    @classmethod
    def load(cls, path: str | Path) -> ProvidersConfig:
        """Load and validate a providers file.

        Raises:
            ConfigError: ``CONFIG_UNREADABLE`` or ``CONFIG_INVALID``.
        """
        if not Path(path).exists():  # a hint pasted before the file was written
            raise ConfigError(
                "CONFIG_UNREADABLE", f"no providers file {path}: write one (every kind is "
                "in config/providers.example.toml; a reply file alone needs one "
                '[[providers]] entry with the lines name = "replay", kind = "scripted" '
                'and path = "replies.jsonl")',
                path=str(path))
        data = _read_toml(path)
        if isinstance(data.get("providers"), dict):
            raise ConfigError("CONFIG_INVALID", f"{path}: providers: write each provider as "
                              "an array-of-tables entry `[[providers]]`, not `[providers]`",
                              path=str(path))
        data.setdefault("base_dir", str(Path(path).resolve().parent))
        return _validate(cls, data, path)

    @model_validator(mode="after")
    def _unique_names(self) -> ProvidersConfig:
        """A provider's name identifies it in the stored attempts, the logs and the
        metrics: two entries may not share one."""
        seen: set[str] = set()
        for p in self.providers:
            if p.name in seen:
                raise ValueError(f"two providers are named {p.name!r}; give each its own name")
            seen.add(p.name)
        return self

    def identity(self) -> dict[str, Any]:
        """A secret-free description of the providers (for records and logs)."""
        return {
            "gateway": self.gateway.model_dump(),
            "providers": [
                {"name": p.name, "kind": p.kind, "model": p.model,
                 "base_url": None if p.base_url is None else url_for_display(p.base_url)}
                for p in self.providers
            ],
        }


class InvestigationConfig(_Strict):
    """The investigation policy file (``--config``): loop, budget, limits, tools, package."""

    loop: LoopConfig = Field(default_factory=LoopConfig)
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    tools: ToolLimits = Field(default_factory=ToolLimits)
    package: PackageLimits = Field(default_factory=PackageLimits)

    @model_validator(mode="after")
    def _early_diagnosis_evidence_listed(self) -> InvestigationConfig:
        # An early diagnosis cites own evidence from the context: the window must hold it.
        if self.loop.early_diagnosis and \
                self.loop.early_diagnosis_min_evidence > self.limits.own_evidence_in_context:
            raise ValueError("loop.early_diagnosis_min_evidence must be at most "
                             "limits.own_evidence_in_context (the own evidence records a "
                             "context lists)")
        return self

    @classmethod
    def load(cls, path: str | Path | None) -> InvestigationConfig:
        """Load a TOML policy file; ``None`` gives the defaults.

        Raises:
            ConfigError: ``CONFIG_UNREADABLE`` or ``CONFIG_INVALID``.
        """
        if path is None:
            return cls()
        return _validate(cls, _read_toml(path), path)

    @classmethod
    def load_package_limits(cls, path: str | Path | None) -> PackageLimits:
        """Only the ``[package]`` table of the policy file ``path`` (``case add
        --package-limits``): a file whose other tables are wrong still sets the package
        limits, as the README says (a hostile-input trial had `[budget] credit_units = -1`
        refuse `case add`); ``None`` gives the defaults.

        Raises:
            ConfigError: ``CONFIG_UNREADABLE`` or ``CONFIG_INVALID`` (the table itself).
        """
        if path is None:
            return PackageLimits()
        table = _read_toml(path).get("package", {})
        return _validate(cls, {"package": table}, path).package

    def policy(self) -> dict[str, Any]:
        """The part frozen per analysis revision: loop bounds and budget rules."""
        return {"loop": self.loop.model_dump(), "budget": self.budget.model_dump()}

    def policy_hash(self) -> str:
        """sha256 of the canonical JSON of :meth:`policy`."""
        return hashlib.sha256(canonical_json(self.policy())).hexdigest()


def canonical_json(value: Any) -> bytes:
    """Canonical JSON bytes: sorted keys, no spaces, UTF-8, no NaN."""
    return jsonio.dumps(value, sort_keys=True)


def ordered_json(value: Any) -> bytes:
    """Compact JSON bytes that keep the key order as built (no spaces, UTF-8, no NaN).

    For documents whose key order carries meaning and is itself deterministic: a JSON
    Schema's ``properties`` order is the order a grammar-constrained decoder writes the
    keys in (reply schemas, provider request bodies).
    """
    return jsonio.dumps(value, sort_keys=False)


def _read_toml(path: str | Path) -> dict[str, Any]:
    try:  # a regular file of at most 1 MiB: never a FIFO or /dev/zero (investigation.files)
        return tomllib.loads(read_bounded(path, MAX_SETTINGS_FILE_BYTES).decode("utf-8"))
    except OSError as exc:
        raise ConfigError("CONFIG_UNREADABLE", f"cannot read {path}: {exc}", path=str(path)) from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError("CONFIG_INVALID", f"{path} is not valid TOML: {exc}", path=str(path)) from exc
    except RecursionError as exc:  # tomllib parses nested arrays and tables recursively
        raise ConfigError("CONFIG_INVALID", f"{path} nests arrays or tables too deeply",
                          path=str(path)) from exc


_M = TypeVar("_M", bound=BaseModel)


def _validate(model: type[_M], data: dict[str, Any], path: str | Path) -> _M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError("CONFIG_INVALID", f"{path}: {errors}", path=str(path)) from exc
