"""Escaping untrusted text for the HTML report.

Everything the snapshot or the model supplied (findings, notes, reasons, statements,
arguments, provider messages) goes through one of these two functions before it reaches
the page:

* :func:`html_text` for HTML element content and attribute values: ``html.escape`` with
  quotes, and every invisible or reordering character shown visibly as its marked code
  point, such as ``U+202E`` (so a bidi override cannot reorder what the reader sees, an
  escape sequence cannot hide in a quote and a zero-width space cannot split a name
  unseen);
* :func:`svg_text` for text inside inline SVG, where an HTML element (the marker's
  ``<span>``) would end the SVG: the same marker as plain text.

Shown visibly: every character the terminal and Markdown escaping shows as an escape
(``investigation.text_safety.UNSAFE_RANGES``: controls, format characters such as
bidirectional and zero-width ones, separators, tags, surrogates) except tab and line feed;
the report marks them with their code point (``U+001B``) instead of ``\\x1b``.
"""

from __future__ import annotations

import html

from investigation.text_safety import unsafe_characters

_INVISIBLE = unsafe_characters(keep="\t\n")


def _marker(ch: str) -> str:
    return f"U+{ord(ch):04X}"


def html_text(value: object) -> str:
    """``value`` as inert HTML text (element content or a quoted attribute value)."""
    text = str(value)
    if _INVISIBLE.search(text) is None:
        return html.escape(text, quote=True)
    parts: list[str] = []
    pos = 0
    for m in _INVISIBLE.finditer(text):
        parts.append(html.escape(text[pos:m.start()], quote=True))
        parts.append(f'<span class="ctl" title="invisible character">'
                     f'{_marker(m.group())}</span>')
        pos = m.end()
    parts.append(html.escape(text[pos:], quote=True))
    return "".join(parts)


def html_attr(value: object) -> str:
    """``value`` for a quoted attribute: no markup at all, invisible characters as
    their code point in brackets (``[U+200B]``)."""
    return svg_text(value)


def svg_text(value: object) -> str:
    """``value`` as inert text inside inline SVG (``<text>``, ``<title>``)."""
    text = _INVISIBLE.sub(lambda m: f"[{_marker(m.group())}]", str(value))
    return html.escape(text, quote=True)
