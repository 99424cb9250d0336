"""Showing untrusted text: one escaping function for terminals, Markdown and HTML reports.

Everything a case package supplies (source and log lines, file names, database values,
table names) and everything a model writes (notes, reasons, questions, test titles) is
untrusted. Printed raw, an ``ESC [ 2 J`` clears the operator's terminal, an OSC 0
sequence retitles the window, an OSC 8 sequence plants a hyperlink, a carriage return
overwrites a line, and bidirectional or zero-width characters make text read differently
from what it is (CVE-2021-42574, "Trojan Source"; U+E0020..E007F "tag" characters carry
invisible text to language models).

:func:`escape_text` shows each such character as a visible escape instead, the way
Python writes it: ``\\x1b`` (ESC), ``\\x9b`` (C1 CSI), ``\\u202e`` (RIGHT-TO-LEFT
OVERRIDE), ``\\u200b`` (ZERO WIDTH SPACE), ``\\U000e0041`` (TAG LATIN CAPITAL LETTER A).
Everything else, including every printable non-ASCII letter, is kept as it is, and a
backslash is not doubled: the escape is for the eye, the exact bytes stay in the stored
artifacts (``investigate export``). The result depends only on the input (a fixed table,
not the running Python's Unicode database), so reports built with it stay
deterministic.

The escaped characters (:data:`UNSAFE_RANGES`) are Unicode's general categories Cc
(C0 and C1 controls, DEL), Cf (format: bidirectional controls, zero-width characters,
soft hyphen, BOM, tags, ...), Zl and Zp (line and paragraph separators) and Cs
(surrogates), as of Unicode 15.1. TAB is kept; LF is kept only where a caller shows a
multi-line document (``newlines=True``).

Use it on every value before it reaches a terminal or a report; a format's own escaping
(Markdown code spans, HTML entities) comes after it, by the caller. Package names holding
any of these characters are refused outright (``PKG_BAD_NAME``,
:func:`investigation.cases.layout.check_relative_path`).
"""

from __future__ import annotations

import logging
import re
from urllib.parse import urlsplit

__all__ = ["UNSAFE_RANGES", "EscapingLogFilter", "escape_text", "first_unsafe", "hidden_text",
           "is_unsafe", "unsafe_characters"]

#: Inclusive code point ranges that are never shown as themselves (see the module
#: docstring): Unicode general categories Cc, Cf, Zl, Zp and Cs as of Unicode 15.1.
UNSAFE_RANGES: tuple[tuple[int, int], ...] = (
    (0x0000, 0x001F), (0x007F, 0x009F), (0x00AD, 0x00AD), (0x0600, 0x0605),
    (0x061C, 0x061C), (0x06DD, 0x06DD), (0x070F, 0x070F), (0x0890, 0x0891),
    (0x08E2, 0x08E2), (0x180E, 0x180E), (0x200B, 0x200F), (0x2028, 0x202E),
    (0x2060, 0x2064), (0x2066, 0x206F), (0xD800, 0xDFFF), (0xFEFF, 0xFEFF),
    (0xFFF9, 0xFFFB), (0x110BD, 0x110BD), (0x110CD, 0x110CD), (0x13430, 0x1343F),
    (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0001, 0xE0001), (0xE0020, 0xE007F),
)


#: Invisible characters that carry text no reader sees: the Tags block (U+E0000-U+E007F;
#: "ASCII smuggling" of instructions to a language model) and the interlinear annotation
#: controls (U+FFF9-U+FFFB). See :func:`hidden_text`.
_HIDDEN = re.compile("[\U000e0000-\U000e007f\ufff9-\ufffb]")
#: The emoji tag sequences Unicode recommends for general interchange (the flags of
#: England, Scotland and Wales: U+1F3F4, the tags of ``gbeng``/``gbsct``/``gbwls``, CANCEL
#: TAG), where tag characters are what they are for. Any other sequence of tags spells
#: text: a hostile re-trial wrapped "IGNORE ALL RULES" in U+1F3F4 ... U+E007F.
_FLAG_SEQUENCE = re.compile("\U0001f3f4(?:" + "|".join(
    "".join(chr(0xE0000 + ord(c)) for c in code) for code in ("gbeng", "gbsct", "gbwls"))
    + ")\U000e007f")


def hidden_text(text: str) -> str | None:
    """The first tag or interlinear annotation character of ``text`` outside the flags of
    England, Scotland and Wales, or ``None``. Text a model reads (an interpretation, a
    statement, an observation, a model's own notes) may not hold them: each is invisible
    on every screen and spells a letter to the model."""
    if text.isprintable() or _HIDDEN.search(text) is None:
        return None
    match = _HIDDEN.search(_FLAG_SEQUENCE.sub("", text))
    return None if match is None else match.group()


def _char_class(keep: str) -> re.Pattern[str]:
    """One character class of :data:`UNSAFE_RANGES` without the characters in ``keep``."""
    kept = sorted(ord(ch) for ch in keep)
    parts = []
    for low, high in UNSAFE_RANGES:
        start = low
        for cp in kept:
            if low <= cp <= high:
                if start < cp:
                    parts.append((start, cp - 1))
                start = cp + 1
        if start <= high:
            parts.append((start, high))
    return re.compile("[" + "".join(
        re.escape(chr(low)) + ("" if low == high else "-" + re.escape(chr(high)))
        for low, high in parts) + "]")


def unsafe_characters(keep: str = "") -> re.Pattern[str]:
    """A compiled character class of :data:`UNSAFE_RANGES` without the characters in
    ``keep`` (for formats that show the characters their own way, e.g. the HTML report)."""
    return _char_class(keep)


_UNSAFE_LINE = _char_class("\t")
_UNSAFE_DOCUMENT = _char_class("\t\n")
_UNSAFE_ANY = _char_class("")


def _escape_one(match: re.Match[str]) -> str:
    cp = ord(match.group())
    if cp <= 0xFF:
        return f"\\x{cp:02x}"
    if cp <= 0xFFFF:
        return f"\\u{cp:04x}"
    return f"\\U{cp:08x}"


def escape_text(text: str, *, newlines: bool = False) -> str:
    """``text`` with every unsafe character replaced by a visible escape.

    Args:
        text: untrusted text (any length; the work is linear in it, and printable text
            is returned after one ``str.isprintable`` pass).
        newlines: keep LF (a multi-line document such as ``summary.md``); otherwise LF is
            shown as ``\\x0a`` like any other control character. CR is always escaped.

    Returns:
        The escaped text; ``text`` itself when it holds nothing unsafe.
    """
    # Fast path: every character of the table is non-printable for ``str.isprintable``
    # (a test checks it), so printable text (TAB and LF set aside) holds none of them.
    probe = text.replace("\t", "")
    if newlines:
        probe = probe.replace("\n", "")
    if probe.isprintable():
        return text
    pattern = _UNSAFE_DOCUMENT if newlines else _UNSAFE_LINE
    return pattern.sub(_escape_one, text)


def is_unsafe(ch: str) -> bool:
    """Whether the single character ``ch`` is one :func:`escape_text` escapes (TAB and LF
    count as unsafe here: a name never holds them)."""
    cp = ord(ch)
    return any(low <= cp <= high for low, high in UNSAFE_RANGES)


def first_unsafe(text: str) -> str | None:
    """The first character of ``text`` that is a control, format (bidirectional,
    zero-width, ...), separator or surrogate character, or ``None``."""
    if text.isprintable():
        return None
    match = _UNSAFE_ANY.search(text)
    return None if match is None else match.group()


def visible(text: str) -> bool:
    """Whether ``text`` shows anything: a character that is neither whitespace nor
    invisible (a control, format, separator or surrogate character: U+200B passed
    ``str.strip`` as a report, a statement and a summary; a hostile-input trial)."""
    return any(ch.isprintable() and not ch.isspace() for ch in text)


class EscapingLogFilter(logging.Filter):
    """A logging filter (attach it to a handler) that shows every record's message and
    traceback through :func:`escape_text`: a log line can neither carry terminal escapes
    nor forge a line of its own (LF in a message is escaped; a traceback keeps its own
    line breaks). The line breaks of a message template that has arguments, a library's
    multi-line message such as Celery's ``Cannot connect to %s: %s.\\n%s\\n``, become
    spaces (they showed as ``\\x0a``); its arguments are escaped as ever."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args and isinstance(record.msg, str) and "\n" in record.msg:
            record.msg = " ".join(line.strip() for line in record.msg.splitlines()
                                  if line.strip())
        message = record.getMessage()
        escaped = escape_text(message)
        if escaped != message:
            record.msg, record.args = escaped, None
        if record.exc_info and not record.exc_text:
            record.exc_text = escape_text(
                logging.Formatter().formatException(record.exc_info), newlines=True)
        return True


def url_for_display(url: str) -> str:
    """A URL without its password, for output: the user information is read as the
    clients read it (``urlsplit``: the part of the authority before its last ``@``), so a
    password holding ``@`` is masked whole; a URL with an ``@`` past its authority (a
    password holding ``/``, say) is shown as its scheme alone."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(a URL that cannot be parsed)"
    prefix = f"{parts.scheme}://{parts.netloc}"
    if not url.startswith(prefix) or "@" in url[len(prefix):]:
        return f"{parts.scheme}://***" if "@" in url else _masked_query(url)
    rest = _masked_query(url[len(prefix):])
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at:
        return prefix + rest
    user, colon, _password = userinfo.partition(":")
    shown = f"{user}:***@{host}" if colon else f"{user}@{host}"
    return f"{parts.scheme}://{shown}{rest}"


def url_location(url: str) -> str:
    """Where a URL points, for a message: :func:`url_for_display` after its user
    (``127.0.0.1:5432/cases?password=***``; a URL without one, whole)."""
    return url_for_display(url).split("@")[-1]


#: Query parameters of a URL whose values are secrets (libpq takes ``?password=``).
_SECRET_PARAMETER = re.compile(r"pass|secret|token|credential|api_?key", re.IGNORECASE)


def _masked_query(tail: str) -> str:
    """The path, query and fragment of a URL with the value of every query parameter named
    like a secret shown as ``***`` (a hostile trial's ``?password=`` was echoed by
    `status`, `health` and `db`)."""
    path, mark, query = tail.partition("?")
    if not mark:
        return tail
    query, hash_mark, fragment = query.partition("#")
    pairs = []
    for pair in query.split("&"):
        name, eq, _value = pair.partition("=")
        pairs.append(f"{name}=***" if eq and _SECRET_PARAMETER.search(name) else pair)
    return f"{path}?{'&'.join(pairs)}{hash_mark}{fragment}"
