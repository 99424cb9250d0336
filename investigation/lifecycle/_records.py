"""Private helpers shared by the lifecycle records: strict reading of JSON objects,
timezone-aware timestamps, identifiers and JSON-compatible metadata.

Every failure is a ``LifecycleError`` with a code from ``codes``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, TypeAlias

from investigation.errors import LifecycleError
from investigation.lifecycle import codes

JSONValue: TypeAlias = "bool | int | float | str | list[JSONValue] | dict[str, JSONValue] | None"

#: Longest identifier accepted (session, objective and correlation ids).
MAX_ID_CHARS = 256
#: Deepest nesting of objective metadata (keeps copying and checking bounded).
MAX_METADATA_DEPTH = 32


def error(code: str, message: str, **details: Any) -> LifecycleError:
    """Build (not raise) a ``LifecycleError``."""
    return LifecycleError(code, message, **details)


def aware(value: object, field: str) -> datetime:
    """Return ``value`` converted to UTC; refuse naive or non-datetime values.

    Raises:
        LifecycleError: ``LIFECYCLE_INVALID_TIMESTAMP`` or ``LIFECYCLE_NAIVE_TIMESTAMP``.
    """
    if not isinstance(value, datetime):
        raise error(codes.INVALID_TIMESTAMP, f"{field} must be a datetime", field=field)
    if value.tzinfo is None or value.utcoffset() is None:
        raise error(codes.NAIVE_TIMESTAMP,
                    f"{field} has no timezone; pass an aware datetime such as "
                    "datetime.now(UTC)", field=field)
    return value.astimezone(UTC)


def now_or(value: datetime | None, field: str = "at") -> datetime:
    """``value`` in UTC, or the current UTC time when ``None``."""
    return datetime.now(UTC) if value is None else aware(value, field)


def dump_timestamp(value: datetime) -> str:
    """ISO 8601 text with offset (always ``+00:00``: records hold UTC)."""
    return value.isoformat()


def load_timestamp(value: object, field: str) -> datetime:
    """Parse an ISO 8601 string with an offset into a UTC datetime."""
    if not isinstance(value, str):
        raise error(codes.MALFORMED_RECORD, f"{field} must be an ISO 8601 string",
                    field=field)
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError as exc:
        raise error(codes.INVALID_TIMESTAMP, f"{field} is not ISO 8601: {value!r}",
                    field=field) from exc
    return aware(parsed, field)


def identifier(value: object, field: str) -> str:
    """A non-blank identifier of at most ``MAX_ID_CHARS`` characters."""
    if not isinstance(value, str):
        raise error(codes.MALFORMED_RECORD, f"{field} must be a string", field=field)
    if not value.strip() or len(value) > MAX_ID_CHARS:
        raise error(codes.INVALID_VALUE,
                    f"{field} must be a non-blank string of at most {MAX_ID_CHARS} "
                    "characters", field=field)
    return value


def text(value: object, field: str, *, allow_empty: bool = False) -> str:
    """A string; non-blank unless ``allow_empty``."""
    if not isinstance(value, str):
        raise error(codes.MALFORMED_RECORD, f"{field} must be a string", field=field)
    if not allow_empty and not value.strip():
        raise error(codes.INVALID_VALUE, f"{field} must not be blank", field=field)
    return value


def texts(value: object, field: str) -> tuple[str, ...]:
    """A list or tuple of non-blank strings, as a tuple."""
    if not isinstance(value, list | tuple):
        raise error(codes.MALFORMED_RECORD, f"{field} must be a list of strings",
                    field=field)
    return tuple(text(item, f"{field}[{i}]") for i, item in enumerate(value))


def count(value: object, field: str) -> int:
    """A non-negative integer (``bool`` is refused although it is an ``int``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(codes.MALFORMED_RECORD, f"{field} must be an integer", field=field)
    if value < 0:
        raise error(codes.INVALID_VALUE, f"{field} must be >= 0, got {value}", field=field)
    return value


def finite(value: object, field: str) -> float:
    """A finite real number (``bool`` refused), as ``float``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise error(codes.INVALID_VALUE, f"{field} must be a number", field=field)
    if not math.isfinite(value):
        raise error(codes.INVALID_VALUE, f"{field} must be finite", field=field)
    return float(value)


def json_copy(value: object, field: str, depth: int = 0) -> JSONValue:
    """A deep copy of a JSON-compatible value; refuse anything ``json`` would not
    round-trip exactly (tuples, non-string keys, NaN/inf, other types)."""
    if depth > MAX_METADATA_DEPTH:
        raise error(codes.INVALID_METADATA,
                    f"{field} is nested deeper than {MAX_METADATA_DEPTH} levels", field=field)
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise error(codes.INVALID_METADATA, f"{field} holds a non-finite number",
                        field=field)
        return value
    if isinstance(value, list):
        return [json_copy(item, f"{field}[{i}]", depth + 1) for i, item in enumerate(value)]
    if isinstance(value, dict):
        out: dict[str, JSONValue] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise error(codes.INVALID_METADATA, f"{field} has a non-string key",
                            field=field)
            out[key] = json_copy(item, f"{field}.{key}", depth + 1)
        return out
    raise error(codes.INVALID_METADATA,
                f"{field} holds a {type(value).__name__}; only JSON types (dict with string "
                "keys, list, str, int, finite float, bool, None) are allowed", field=field)


def fields(data: object, kind: str, keys: tuple[str, ...]) -> Mapping[str, object]:
    """Check that ``data`` is a JSON object with exactly ``keys``.

    Raises:
        LifecycleError: ``LIFECYCLE_MALFORMED_RECORD`` naming the missing or unknown keys.
    """
    if not isinstance(data, Mapping):
        raise error(codes.MALFORMED_RECORD, f"a {kind} record must be a JSON object",
                    kind=kind)
    missing = sorted(set(keys) - set(data))
    unknown = sorted(str(k) for k in set(data) - set(keys))
    if missing or unknown:
        raise error(codes.MALFORMED_RECORD,
                    f"{kind} record: missing keys {missing}, unknown keys {unknown}",
                    kind=kind, missing=missing, unknown=unknown)
    return data


def check_format(data: Mapping[str, object], expected: str) -> None:
    """Refuse a record whose ``format`` is not ``expected``."""
    if data["format"] != expected:
        raise error(codes.UNSUPPORTED_FORMAT,
                    f"record format {data['format']!r} is not {expected!r}",
                    expected=expected)
