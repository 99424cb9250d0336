"""Parsing JSON text fast, with exactly the standard library's results.

A step parses its context, reply schema, stage outputs and records several times
(issue 13: what a long case's full context windows cost is mostly this). :func:`loads`
parses with orjson (a C parser, several times faster than :mod:`json`) and falls back to
:func:`json.loads` wherever the two could differ, so every caller sees the value, and
every error, the standard library gives:

* text orjson refuses (invalid JSON, ``NaN``/``Infinity``, a lone surrogate escape, a
  number out of a double's range, invalid UTF-8, a UTF-16 or BOM-prefixed encoding the
  standard library detects) is parsed again by :func:`json.loads`, which returns its
  value or raises its own ``JSONDecodeError`` with its own message;
* an integer out of 64 bits, which orjson would turn into a float, is ruled out before
  orjson runs: text with a run of 19 or more digits (inside a string or not) goes to
  :func:`json.loads` directly.

Serialising stays with :func:`investigation.config.canonical_json` (the standard
library): stored bytes and their hashes must not depend on another encoder's number
formatting.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

#: 19 digits: the shortest run that can spell an integer outside int64/uint64.
_LONG_DIGITS_BYTES = re.compile(rb"[0-9]{19}")
_LONG_DIGITS_TEXT = re.compile(r"[0-9]{19}")


def loads(data: str | bytes | bytearray | memoryview) -> Any:
    """The value of the JSON text ``data``, exactly as :func:`json.loads` returns it.

    Raises:
        json.JSONDecodeError: (a ``ValueError``) raised by :func:`json.loads` itself
            when the text is not JSON, with its message.
        TypeError: ``data`` is not text or bytes (as :func:`json.loads`).
    """
    if isinstance(data, str):
        if _LONG_DIGITS_TEXT.search(data) is not None:
            return json.loads(data)
    elif isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data) if isinstance(data, memoryview) else data
        if _LONG_DIGITS_BYTES.search(data) is not None:
            return json.loads(data)
    else:
        return json.loads(data)
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)
