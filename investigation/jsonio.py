"""Parsing and writing JSON fast, with exactly the standard library's results.

A step parses and writes its context, reply schema, request, stage outputs and records
several times (issue 13: what a long case's full context windows cost is mostly this).
This module does both with orjson (C, ten to twenty times faster than :mod:`json`) and
falls back to :mod:`json` wherever the two could differ, so every caller sees the value,
the bytes and every error the standard library gives.

Parsing (:func:`loads`):

* text orjson refuses (invalid JSON, ``NaN``/``Infinity``, a lone surrogate escape, a
  number out of a double's range, invalid UTF-8, a UTF-16 or BOM-prefixed encoding the
  standard library detects) is parsed again by :func:`json.loads`, which returns its
  value or raises its own ``JSONDecodeError`` with its own message;
* an integer out of 64 bits, which orjson would turn into a float, is ruled out before
  orjson runs: text with a run of 19 or more digits (inside a string or not) goes to
  :func:`json.loads` directly. The run is found by mapping every digit to ``0`` and every
  other byte to ``x`` (``bytes.translate``) and searching for nineteen ``0``: two passes
  at memory speed, where a regular expression tried each position (it cost more than
  the parse itself).

Writing (:func:`dumps`, :func:`dumps_text`) gives the bytes of ``json.dumps(value,
sort_keys=..., separators=(",", ":"), ensure_ascii=False, allow_nan=...)``: stored
artifacts and their hashes do not depend on which encoder ran (the demo's summary and
every checkpoint hash are unchanged). orjson's output is taken only where it is the
standard library's; otherwise :func:`json.dumps` runs (and raises what it raises):

* values orjson will not write (integers out of 64 bits, non-string keys, nesting over
  254 levels, lone surrogates) and values of types it would write in its own way
  (subclasses of ``str``/``int``/``dict``/``list``, dataclasses, dates: passed through
  to a ``default`` that refuses them);
* floats whose decimal exponent is -5 to -9: orjson writes ``1e-7`` and ``0.00001``
  where Python's ``repr`` writes ``1e-07`` and ``1e-05``. Its output is searched for
  ``0.0000`` and for ``e-`` followed by a single digit; any hit (in a number or inside a
  string) falls back. Every other finite float has the same shortest form in both
  (``tests/unit/test_jsonio.py`` samples all exponents);
* ``NaN`` and the infinities, which orjson writes as ``null``: when the output holds
  ``null``, the value is pickled (C, about twice as fast as parsing the output back) and
  the pickle searched for a float whose exponent bits are all ones (pickle writes every
  float as the opcode ``G`` and its eight big-endian bytes; a hit inside a string only
  costs the fallback).

Differences kept, none of which a document the engine stores or parses meets:

* orjson writes :class:`enum.Enum` and :class:`uuid.UUID` values (as their value and
  their string) where :func:`json.dumps` raises ``TypeError``;
* :func:`loads` parses text nested up to orjson's 1,024 levels, where :func:`json.loads`
  raises ``RecursionError`` somewhere near the interpreter's recursion limit (the depth
  depends on the caller's stack, so no fixed bound could mirror it); a reply that deep
  is refused by the contract's own limits (``REPLY_UNPROCESSABLE``);
* :func:`loads` takes a ``memoryview`` (as bytes), where :func:`json.loads` raises
  ``TypeError``.

Memory: orjson returns its bytes in the block of its working buffer, about ten times the
text (a 60 KB text holds a 520 KB block, a 100-byte one a 4 KB block) for as long as the
object lives. :func:`dumps` returns a copy the size of the text (0.2-0.4 us for a small
document; for a large one the copy is lost in the encoding's own time), so bytes kept in
a cache or as a cache key cost what they count (decision 140).
"""

from __future__ import annotations

import json
import pickle
import re
import threading
from collections import OrderedDict
from typing import Any

import orjson

#: Every digit to ``0``, every other byte to ``x``: a run of 19 digits becomes 19 ``0``.
_DIGITS_AS_ZERO = bytes(0x30 if 0x30 <= i <= 0x39 else 0x78 for i in range(256))
#: 19 digits: the shortest run that can spell an integer outside int64/uint64.
_LONG_DIGITS = b"0" * 19

#: orjson options: sorted or built key order; subclasses, dataclasses and dates go to
#: ``default`` (:func:`_refuse`), so the standard library writes or refuses them.
_PASSTHROUGH = (orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_PASSTHROUGH_DATACLASS
                | orjson.OPT_PASSTHROUGH_DATETIME)
_SORTED = _PASSTHROUGH | orjson.OPT_SORT_KEYS
#: A float orjson writes with a one-digit negative exponent (``1e-7``; Python: ``1e-07``).
_SHORT_NEGATIVE_EXPONENT = re.compile(rb"e-[0-9](?![0-9])")
#: A pickled float (``BINFLOAT``: ``G`` and 8 big-endian bytes) that is NaN or infinite:
#: sign and exponent bits ``x111 1111 1111``.
_NON_FINITE_PICKLED = re.compile(rb"G[\x7f\xff][\xf0-\xff]")


def _has_long_digit_run(data: bytes | bytearray) -> bool:
    return _LONG_DIGITS in data.translate(_DIGITS_AS_ZERO)


def loads(data: str | bytes | bytearray | memoryview) -> Any:
    """The value of the JSON text ``data``, exactly as :func:`json.loads` returns it.

    Raises:
        json.JSONDecodeError: (a ``ValueError``) raised by :func:`json.loads` itself
            when the text is not JSON, with its message.
        TypeError: ``data`` is not text or bytes (as :func:`json.loads`).
    """
    if isinstance(data, str):
        try:
            raw = data.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: the standard library's answer
            return json.loads(data)
        if _has_long_digit_run(raw):
            return json.loads(data)
    elif isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data) if isinstance(data, memoryview) else data
        if _has_long_digit_run(data):
            return json.loads(data)
    else:
        return json.loads(data)
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def _refuse(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is left to the standard library")


def _fast(value: Any, option: int) -> bytes | None:
    """orjson's bytes for ``value`` when they are the standard library's, else ``None``."""
    try:
        out = orjson.dumps(value, default=_refuse, option=option)
    except (orjson.JSONEncodeError, TypeError):
        return None
    if b"0.0000" in out or (b"e-" in out and _SHORT_NEGATIVE_EXPONENT.search(out)):
        return None
    if b"null" in out:  # maybe a NaN or an infinity written as null
        try:
            pickled = pickle.dumps(value, protocol=5)
        except Exception:  # an object pickle refuses: the standard library decides
            return None
        if _NON_FINITE_PICKLED.search(pickled):
            return None
    return out


def dumps(value: Any, *, sort_keys: bool = True, allow_nan: bool = False) -> bytes:
    """Compact UTF-8 JSON of ``value``: exactly ``json.dumps(value, sort_keys=sort_keys,
    separators=(",", ":"), ensure_ascii=False, allow_nan=allow_nan).encode("utf-8")``.

    Raises:
        TypeError: a value JSON cannot carry (from :func:`json.dumps`).
        ValueError: ``NaN`` or an infinity with ``allow_nan=False``, a circular reference
            (from :func:`json.dumps`).
        UnicodeEncodeError: a string with a lone surrogate.
    """
    out = _fast(value, _SORTED if sort_keys else _PASSTHROUGH)
    if out is not None:
        # A copy the size of the text: orjson's bytes object keeps the block of its working
        # buffer (4 KB for a 100-byte text, 520 KB for a 60 KB one), and what a cache or a
        # key keeps alive must not hold ten times its size (decision 140).
        return bytes(memoryview(out))
    return json.dumps(value, sort_keys=sort_keys, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=allow_nan).encode("utf-8")


def dumps_text(value: Any, *, sort_keys: bool = True, allow_nan: bool = True) -> str:
    """Exactly ``json.dumps(value, sort_keys=sort_keys, separators=(",", ":"),
    ensure_ascii=False, allow_nan=allow_nan)`` (text; a lone surrogate stays in it).

    Raises:
        TypeError, ValueError: as :func:`json.dumps`.
    """
    out = _fast(value, _SORTED if sort_keys else _PASSTHROUGH)
    if out is not None:
        return out.decode("utf-8")
    return json.dumps(value, sort_keys=sort_keys, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=allow_nan)


class _Shared:
    """Parsed documents by the sha256 of their bytes, the most recent :attr:`KEPT`."""

    KEPT = 16

    def __init__(self) -> None:
        self._items: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, sha256: str) -> Any:
        with self._lock:
            value = self._items.get(sha256, _MISSING)
            if value is not _MISSING:
                self._items.move_to_end(sha256)
            return value

    def put(self, sha256: str, value: Any) -> None:
        with self._lock:
            self._items[sha256] = value
            self._items.move_to_end(sha256)
            while len(self._items) > self.KEPT:
                self._items.popitem(last=False)


_MISSING = object()
_SHARED = _Shared()


def loads_shared(data: bytes, sha256: str) -> Any:
    """:func:`loads` of stored bytes whose sha256 the caller has checked, parsed once per
    process: a step's context and reply schema are read by three stages, which in one
    process (the embedded runtime, a worker child that runs several stages of a step)
    parse them once. The value is **shared**: callers read it and never change it (copy
    what they change).

    Raises:
        json.JSONDecodeError: as :func:`loads`.
    """
    value = _SHARED.get(sha256)
    if value is _MISSING:
        value = loads(data)
        _SHARED.put(sha256, value)
    return value


#: Most digits of a JSON integer: Python's own bound on converting text to ``int``.
MAX_INT_DIGITS = 4300


def parse_json_int(token: str) -> int:
    """``int(token)`` for a JSON number token, refusing one longer than
    :data:`MAX_INT_DIGITS` with a message that names the number (Python's own says to call
    ``sys.set_int_max_str_digits()``, advice for a programmer, not for a file's author).

    Raises:
        ValueError: the integer has more than :data:`MAX_INT_DIGITS` digits.
    """
    digits = len(token) - token.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {digits} digits (at most {MAX_INT_DIGITS})")
    return int(token)
