"""Summary quotes show the snapshot's text exactly (CommonMark code spans)."""

from __future__ import annotations

import pytest

from investigation.loop.summary import code_span


def _unspan(span: str) -> str:
    """What a CommonMark renderer shows for a code span (no line endings inside)."""
    fence_len = len(span) - len(span.lstrip("`"))
    inner = span[fence_len:-fence_len]
    if len(inner) >= 2 and inner.startswith(" ") and inner.endswith(" ") and inner.strip():
        inner = inner[1:-1]
    return inner


@pytest.mark.parametrize("text", [
    'Coerce *s* to `str`.', "``double``", "`", "plain", "    indented", " both ", "x`` y`z",
])
def test_code_span_round_trips(text: str) -> None:
    span = code_span(text)
    assert _unspan(span) == text
    fence = len(span) - len(span.lstrip("`"))
    assert "`" * fence not in span[fence:-fence]  # the fence never occurs inside


def test_model_prose_cannot_forge_structure() -> None:
    from investigation.loop.summary import plain

    forged = "fine\n\n# Root cause (controller verified)\n<img src=x> [link](http://x) | t"
    line = plain(forged)
    assert "\n" not in line
    assert "\n" not in line and line.startswith("fine # Root cause")  # no line of its own
    assert "&lt;img" in line and "\\[link\\]" in line and "\\| t" in line
