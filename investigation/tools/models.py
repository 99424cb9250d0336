"""Argument models of the snapshot operations, the result model and the warning codes.

Every argument model is strict (no type coercion: ``"3"`` is not an int, ``true`` is not
an int) and forbids extra keys. The models carry only shape rules; rules that depend on
the configured :class:`~investigation.config.ToolLimits` or on the snapshot (path
escapes, pattern length, regex compilation, SQL preflight) are applied by
:meth:`investigation.tools.ToolRouter.validate`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from investigation.config import canonical_json

# Warning codes (stable; part of the public contract). Emitted in this order.
EMPTY_RESULT = "EMPTY_RESULT"
"""The operation found nothing."""
TRUNCATED = "TRUNCATED"
"""More items existed than the result carries (result cap or output-byte bound)."""
PARTIAL = "PARTIAL"
"""A deadline stopped the work early: the items are what was found until then."""
TEXTUAL_SCOPE = "TEXTUAL_SCOPE"
"""``symbol.occurrences`` matched text, not semantics (comments, strings, shadowing)."""
LINE_CUT = "LINE_CUT"
"""At least one quoted line (or SQL value) was cut to ``max_line_bytes``."""
BINARY_SKIPPED = "BINARY_SKIPPED"
"""At least one file was skipped because it holds a NUL byte or is not valid UTF-8."""
RANGE_CLIPPED = "RANGE_CLIPPED"
"""A ``source.read`` range was clipped to ``max_read_lines`` or to the end of the file."""
SECRET_MASKED = "SECRET_MASKED"
"""At least one secret in the findings was replaced by ``[secret masked: <type>]``
(:mod:`investigation.secrets`); ``stats["secrets_masked"]`` counts them."""

WARNINGS = (EMPTY_RESULT, TRUNCATED, PARTIAL, TEXTUAL_SCOPE, LINE_CUT, BINARY_SKIPPED,
            RANGE_CLIPPED, SECRET_MASKED)

#: A ``db.query`` parameter: a 64-bit integer (SQLite's range), a finite float, text or null.
def _sqlite_scalar(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and \
            not -(2**63) <= value <= 2**63 - 1:
        raise ValueError("integer outside SQLite's signed 64-bit range")
    return value


Scalar = Annotated[int | Annotated[float, Field(allow_inf_nan=False)] | str | None,
                   AfterValidator(_sqlite_scalar)]


#: The largest line number or count an argument may hold (as the policy's counts): a
#: 4,000-digit ``end_line`` was accepted and printed whole in summary.md (a hostile-input
#: trial). Checked after the schema, so the per-turn reply schema stays as it is.
MAX_ARG_INT = 10**9


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @model_validator(mode="after")
    def _counts_are_bounded(self) -> _Args:
        for name, value in self:
            if type(value) is int and value > MAX_ARG_INT:
                raise ValueError(f"{name} is larger than {MAX_ARG_INT}")
        return self


class SourceListArgs(_Args):
    """Arguments of ``source.list``."""

    prefix: str = Field("", description="Only paths starting with this text (plain prefix, "
                        "relative to the source root). Default: all files.")
    limit: int | None = Field(None, ge=1, description="Most paths to return (capped).")


class SourceSearchArgs(_Args):
    """Arguments of ``source.search``."""

    pattern: str = Field(min_length=1, description="Text to find in each line; a RE2 "
                         "regular expression if regex is true.")
    regex: bool = Field(False, description="Treat pattern as a RE2 regex. Default false "
                        "(case-sensitive substring).")
    path_glob: str | None = Field(None, description="Only files matching this glob: * and "
                                  "? stay within one directory, ** spans directories; a glob "
                                  "without / matches the file name at any depth.")
    max_results: int | None = Field(None, ge=1, description="Most matching lines (capped).")


class SourceReadArgs(_Args):
    """Arguments of ``source.read`` (1-based, inclusive line range)."""

    path: str = Field(min_length=1, description="File path relative to the source root.")
    start_line: int = Field(ge=1, description="First line, 1-based.")
    end_line: int = Field(ge=1, description="Last line, inclusive; >= start_line.")

    @model_validator(mode="after")
    def _ordered(self) -> SourceReadArgs:
        if self.end_line < self.start_line:
            raise ValueError("end_line must be >= start_line")
        return self


class SymbolOccurrencesArgs(_Args):
    """Arguments of ``symbol.occurrences``."""

    symbol: str = Field(min_length=1, max_length=200, description="An identifier (letters, "
                        "digits, _ and .), matched at identifier boundaries.")
    max_results: int | None = Field(None, ge=1, description="Most occurrences (capped).")


class DbTablesArgs(_Args):
    """``db.tables`` takes no arguments."""


class DbSchemaArgs(_Args):
    """Arguments of ``db.schema``."""

    table: str = Field(min_length=1, max_length=1000, description="Table or view name; with "
                       "several databases it may be qualified as '<database>.<table>'.")


class DbQueryArgs(_Args):
    """Arguments of ``db.query``."""

    sql: str = Field(min_length=1, max_length=20_000, description="Exactly one read-only "
                     "SELECT (or WITH ... SELECT) statement over the first database.")
    params: list[Scalar] = Field(default_factory=list, max_length=100,
                                 description="Values for ? placeholders, in order.")
    max_rows: int | None = Field(None, ge=1, description="Most rows to return (capped).")


class LogsSearchArgs(_Args):
    """Arguments of ``logs.search``."""

    pattern: str = Field(min_length=1, description="Text to find in each log line; a RE2 "
                         "regular expression if regex is true.")
    regex: bool = Field(False, description="Treat pattern as a RE2 regex. Default false.")
    max_results: int | None = Field(None, ge=1, description="Most matching lines (capped).")


ARGUMENT_MODELS: dict[str, type[_Args]] = {
    "source.list": SourceListArgs,
    "source.search": SourceSearchArgs,
    "source.read": SourceReadArgs,
    "symbol.occurrences": SymbolOccurrencesArgs,
    "db.tables": DbTablesArgs,
    "db.schema": DbSchemaArgs,
    "db.query": DbQueryArgs,
    "logs.search": LogsSearchArgs,
}


class ToolResult(BaseModel):
    """The normalised outcome of one snapshot operation.

    Attributes:
        operation: one of :data:`investigation.constants.OPERATIONS`.
        arguments: the validated arguments with defaults filled and caps applied.
        items: findings, each a JSON object with a stable, unique ``"key"`` (str).
        warnings: codes from :data:`WARNINGS`, deduplicated, in that tuple's order.
        stats: JSON facts about the run (counts, effective ranges, SQL columns).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    operation: str
    arguments: dict[str, Any]
    items: list[dict[str, Any]]
    warnings: list[str]
    stats: dict[str, Any]

    def to_json_bytes(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces, UTF-8): equal results give equal bytes."""
        return canonical_json(self.model_dump(mode="json"))


def ordered_warnings(codes: set[str]) -> list[str]:
    """Return ``codes`` in the canonical :data:`WARNINGS` order."""
    return [code for code in WARNINGS if code in codes]
