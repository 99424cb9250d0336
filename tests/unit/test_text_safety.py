"""investigation.text_safety: untrusted text shown with visible escapes."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from investigation.text_safety import UNSAFE_RANGES, escape_text, first_unsafe, is_unsafe

HOSTILE = [
    ("\x1b[2J", "\\x1b[2J"),                                   # clear screen
    ("\x1b]0;owned\x07", "\\x1b]0;owned\\x07"),                 # OSC 0 window title
    ("\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\",                # OSC 8 hyperlink
     "\\x1b]8;;http://x\\x1b\\link\\x1b]8;;\\x1b\\"),
    ("a\rb", "a\\x0db"),                                       # carriage return
    ("\x9b2J", "\\x9b2J"),                                     # C1 CSI
    ("\x7f", "\\x7f"),
    ("abc\u202edef", "abc\\u202edef"),                         # RIGHT-TO-LEFT OVERRIDE
    ("a\u2066b\u2069", "a\\u2066b\\u2069"),                     # isolates
    ("zero\u200bwidth", "zero\\u200bwidth"),
    ("\ufeffbom", "\\ufeffbom"),
    ("line\u2028sep", "line\\u2028sep"),
    ("tag\U000e0041\U000e007f", "tag\\U000e0041\\U000e007f"),  # invisible tag text
    ("soft\u00adhyphen", "soft\\xadhyphen"),
]


@pytest.mark.parametrize(("raw", "shown"), HOSTILE)
def test_hostile_characters_are_shown_as_escapes(raw: str, shown: str) -> None:
    assert escape_text(raw) == shown
    assert first_unsafe(raw) is not None


def test_printable_text_is_returned_unchanged() -> None:
    for text in ["def main():", "caf\u00e9 \u4e2d\u6587 \U0001f600", "\tindented", "a\\x1b",
                 "\u00a0nbsp", ""]:
        assert escape_text(text) is text or escape_text(text) == text
        assert escape_text(text) == text
    assert first_unsafe("plain") is None


def test_newlines_are_kept_only_for_documents() -> None:
    assert escape_text("a\nb") == "a\\x0ab"
    assert escape_text("a\nb\r\n\x1b", newlines=True) == "a\nb\\x0d\n\\x1b"
    assert escape_text("a\tb") == "a\tb"


def test_the_table_is_what_the_docstring_says() -> None:
    """Cc, Cf, Zl, Zp and Cs of this Python's Unicode database are all escaped, and every
    escaped character is non-printable here (the fast path relies on it)."""
    wanted = {"Cc", "Cf", "Zl", "Zp", "Cs"}
    for cp in range(0x110000):
        ch = chr(cp)
        if unicodedata.category(ch) in wanted:
            assert is_unsafe(ch), hex(cp)
    for low, high in UNSAFE_RANGES:
        for cp in range(low, high + 1):
            assert not chr(cp).isprintable(), hex(cp)


@given(st.text())
def test_escaped_text_holds_no_unsafe_character(text: str) -> None:
    shown = escape_text(text)
    assert first_unsafe(shown.replace("\t", "")) is None
    assert escape_text(shown) == shown  # idempotent
    assert escape_text(text) == shown  # deterministic


def test_log_records_are_escaped() -> None:
    import io
    import logging

    from investigation.text_safety import EscapingLogFilter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(EscapingLogFilter())
    logger = logging.getLogger("tests.text_safety")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("case %s: %s", "c1", "line\x1b[2J\nFORGED line \u202e")
        # A library's multi-line template (Celery's consumer): its own breaks are spaces.
        logger.error("consumer: Cannot connect to %s: %s.\n%s\n", "redis://h:1/0",
                     "refused", "Trying again in 2.00 seconds... (1/100)")
        logger.error("templated\n  %s", "argument\nFORGED")
        try:
            raise ValueError("boom \x1b]0;title\x07")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert "\x1b" not in text and "\u202e" not in text and "\x07" not in text
    assert "case c1: line\\x1b[2J\\x0aFORGED line \\u202e\n" in text
    assert ("consumer: Cannot connect to redis://h:1/0: refused. Trying again in 2.00 "
            "seconds... (1/100)\n") in text
    assert "templated argument\\x0aFORGED\n" in text
    assert "ValueError: boom \\x1b]0;title\\x07" in text
