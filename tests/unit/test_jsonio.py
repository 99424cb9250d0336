"""``jsonio.loads`` returns what ``json.loads`` returns, and raises what it raises."""

from __future__ import annotations

import gc
import json
import math
import tracemalloc
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


def _outcome(fn: Any, arg: Any) -> tuple[str, Any]:
    """``("value", fn(arg))``, or the type and message of the error ``fn`` raised."""
    try:
        return "value", fn(arg)
    except (ValueError, TypeError) as exc:  # UnicodeEncodeError is a ValueError
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


# -- writing: jsonio.dumps gives json.dumps's bytes, or its error -----------------------------

FLOATS_ANY_EXPONENT = st.builds(
    lambda mantissa, exponent, sign: sign * mantissa * 10.0 ** exponent,
    st.floats(min_value=1.0, max_value=10.0, exclude_max=True),
    st.integers(min_value=-320, max_value=300), st.sampled_from([1.0, -1.0]))
WRITABLE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | FLOATS_ANY_EXPONENT
    | st.text(),
    lambda children: st.lists(children, max_size=5)
    | st.lists(children, max_size=3).map(tuple)
    | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=30)


def _written(value: Any, sort_keys: bool, allow_nan: bool) -> tuple[str, Any]:
    return _outcome(lambda v: json.dumps(v, sort_keys=sort_keys, separators=(",", ":"),
                                         ensure_ascii=False, allow_nan=allow_nan
                                         ).encode("utf-8"), value)


def _jsonio_written(value: Any, sort_keys: bool, allow_nan: bool) -> tuple[str, Any]:
    return _outcome(lambda v: jsonio.dumps(v, sort_keys=sort_keys, allow_nan=allow_nan), value)


@settings(max_examples=500, deadline=None)
@given(WRITABLE, st.booleans(), st.booleans())
def test_any_value_is_written_as_the_standard_library_writes_it(
        value: Any, sort_keys: bool, allow_nan: bool) -> None:
    assert _jsonio_written(value, sort_keys, allow_nan) == _written(value, sort_keys, allow_nan)
    assert _outcome(lambda v: jsonio.dumps_text(v, sort_keys=sort_keys, allow_nan=allow_nan),
                    value) == _outcome(lambda v: json.dumps(
                        v, sort_keys=sort_keys, separators=(",", ":"), ensure_ascii=False,
                        allow_nan=allow_nan), value)


def test_every_float_exponent_is_written_as_pythons_repr() -> None:
    """orjson's shortest form differs from ``repr`` for exponents -5 to -9: each is caught."""
    for exponent in range(-325, 310):
        for mantissa in ("1", "2.5", "9.999999999999998", "123456789", "7.0000001"):
            value = float(f"{mantissa}e{exponent}")
            if math.isinf(value):
                continue
            for v in (value, -value, [value, "0.0000"], {"x": value, "e-5": 1}):
                assert jsonio.dumps(v) == _written(v, True, False)[1]


class _Text(str):
    pass


class _Number(int):
    def __repr__(self) -> str:
        return "7"


@pytest.mark.parametrize("value", [
    float("nan"), [float("inf")], {"a": -float("inf"), "b": None}, 2 ** 64, -2 ** 63 - 1,
    {1: "a"}, {"a": 1, 2: "b"}, "\ud800", ["x", "\udfff"], (1, 2), {"k": (None, 1e-7)},
    _Text("sub"), {_Text("k"): 1}, _Number(3), {"n": _Number(5)}, 1e-5, 0.00001234,
    {"a": "0.0000 and e-5 in a string"}, {"a": [[[[1.5e-300]]]], "b": 12.5},
    object(), {"a": {1, 2}}, b"bytes",
])
@pytest.mark.parametrize("sort_keys", [True, False])
@pytest.mark.parametrize("allow_nan", [True, False])
def test_where_orjson_and_the_standard_library_would_differ_the_standard_library_writes(
        value: Any, sort_keys: bool, allow_nan: bool) -> None:
    assert _jsonio_written(value, sort_keys, allow_nan) == _written(value, sort_keys, allow_nan)


def test_deep_nesting_beyond_orjsons_limit_is_written_by_the_standard_library() -> None:
    value: Any = 1
    for _ in range(300):
        value = [value]
    assert jsonio.dumps(value) == _written(value, True, False)[1]


def test_a_long_digit_run_anywhere_sends_the_text_to_the_standard_library() -> None:
    for text in ('{"a": "x1234567890123456789y", "b": 18446744073709551616}',
                 '[18446744073709551616]', '["1234567890123456789"]'):
        assert _same(jsonio.loads(text), json.loads(text))
        assert _same(jsonio.loads(text.encode()), json.loads(text))


def test_a_value_pickle_refuses_next_to_null_is_left_to_the_standard_library() -> None:
    import enum

    class Local(enum.Enum):  # a local class: pickle cannot name it
        A = 1

    value = {"a": None, "e": Local.A}  # orjson writes the member; pickle cannot
    assert _jsonio_written(value, True, False) == _written(value, True, False)
    assert _written(value, True, False)[0] == "TypeError"


def test_loads_shared_parses_a_document_once_and_keeps_the_newest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonio, "_SHARED", jsonio._Shared())  # a fresh, empty cache
    first = jsonio.loads_shared(b'{"a": [1, 2]}', "sha-a")
    assert first == {"a": [1, 2]}
    # The same sha256 answers from the cache (the bytes are not read again) ...
    assert jsonio.loads_shared(b"not json", "sha-a") is first
    # ... until more than KEPT newer documents pushed it out.
    for i in range(jsonio._Shared.KEPT):
        jsonio.loads_shared(f"[{i}]".encode(), f"sha-{i}")
    with pytest.raises(json.JSONDecodeError):
        jsonio.loads_shared(b"not json", "sha-a")  # parsed again, and refused
    assert jsonio.loads_shared(b"[0]", f"sha-{jsonio._Shared.KEPT - 1}") == \
        [jsonio._Shared.KEPT - 1]  # the newest is still kept


@pytest.mark.parametrize("entries", [3, 30, 1500])
def test_written_bytes_hold_a_block_the_size_of_their_text(entries: int) -> None:
    """orjson's bytes keep the block of its working buffer (4 KB for a 100-byte text,
    520 KB for a 60 KB one); what :func:`jsonio.dumps` returns is a copy the size of the
    text, so a cache of written documents holds what it counts (decision 140)."""
    value = {f"k{i}": ["x" * 20, i, None] for i in range(entries)}
    assert jsonio._fast(value, jsonio._SORTED) is not None  # orjson's path, not json's
    tracing = tracemalloc.is_tracing()  # a harness may trace already: leave it running
    gc.disable()  # no collection inside the measurement
    if not tracing:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        out = jsonio.dumps(value)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        if not tracing:
            tracemalloc.stop()
        gc.enable()
    assert out == json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    assert len(out) <= held <= len(out) + 256, (len(out), held)
