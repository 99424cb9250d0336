"""Escaping untrusted text for the HTML report.

Everything the snapshot or the model supplied (findings, notes, reasons, statements,
arguments, provider messages) goes through one of these two functions before it reaches
the page:

* :func:`html_text` for HTML element content and attribute values: ``html.escape`` with
  quotes, and every invisible or reordering character shown visibly as a marked
  ``U+XXXX`` (so a bidi override cannot reorder what the reader sees, an escape sequence
  cannot hide in a quote and a zero-width space cannot split a name unseen);
* :func:`svg_text` for text inside inline SVG, where an HTML element (the marker's
  ``<span>``) would end the SVG: the same marker as plain text.

Shown visibly: C0 controls except tab and line feed, DEL, C1 controls, the Arabic letter
mark, zero-width and directional marks (U+200B-U+200F), the line and paragraph
separators, bidirectional embeddings, overrides and isolates (U+202A-U+202E,
U+2066-U+2069), word joiner and invisible operators (U+2060-U+2064), the BOM, interlinear
annotation characters and lone surrogates.

Issue 10 adds one escaping function for the terminal and Markdown; this module is the
report's own until they are merged.
"""

from __future__ import annotations

import html
import re

_INVISIBLE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2064"
    "\u2066-\u2069\ufeff\ufff9-\ufffb\ud800-\udfff]")


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
    ``[U+XXXX]``."""
    return svg_text(value)


def svg_text(value: object) -> str:
    """``value`` as inert text inside inline SVG (``<text>``, ``<title>``)."""
    text = _INVISIBLE.sub(lambda m: f"[{_marker(m.group())}]", str(value))
    return html.escape(text, quote=True)
