"""``jsonio.loads`` returns what ``json.loads`` returns, and raises what it raises."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from investigation import jsonio

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=30)


def _same(a: Any, b: Any) -> bool:
    """Equal, with types and float signs (``1 == 1.0`` and ``0.0 == -0.0`` do not count)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) ==
                                                      math.copysign(1, b))
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _outcome(parse: Any, text: Any) -> tuple[str, Any]:
    try:
        return "value", parse(text)
    except (ValueError, TypeError) as exc:
        return type(exc).__name__, str(exc)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES, st.booleans(), st.booleans())
def test_any_json_value_parses_as_the_standard_library_parses_it(
        value: Any, as_bytes: bool, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    data: str | bytes = text.encode("utf-8") if as_bytes else text
    assert _same(jsonio.loads(data), json.loads(data))


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('{}[]":,0123456789.eE-+ \\ntrufalsNI\u00e9')),
               max_size=40))
def test_any_text_gives_the_standard_librarys_value_or_error(text: str) -> None:
    got, want = _outcome(jsonio.loads, text), _outcome(json.loads, text)
    assert got[0] == want[0]
    if got[0] == "value":
        assert _same(got[1], want[1])
    else:
        assert got[1] == want[1]  # the same message: rejections quote it


@pytest.mark.parametrize("text", [
    "[123456789012345678901234567890]",  # orjson would return a float
    "[-9223372036854775809]", "[18446744073709551616]",
    '{"a": 1, "a": 2}', "[NaN, Infinity, -Infinity]", "[1e400]", '"\\ud800"',
    b"\xef\xbb\xbf[1]", "[1]".encode("utf-16"), b"[\"\xff\"]", "", "[1] x", 7,
])
def test_where_orjson_and_the_standard_library_differ_the_standard_library_wins(
        text: Any) -> None:
    got, want = _outcome(jsonio.loads, text), _outcome(json.loads, text)
    assert got[0] == want[0]
    if got[0] == "value":
        assert _same(got[1], want[1])
    else:
        assert got[1] == want[1]
