"""The report's escaping: markup inert, invisible and reordering characters visible."""

from __future__ import annotations

import re

import pytest

from investigation.report.escape import html_attr, html_text, svg_text


def test_markup_is_text() -> None:
    assert html_text('<script>"a" & \'b\'</script>') == \
        "&lt;script&gt;&quot;a&quot; &amp; &#x27;b&#x27;&lt;/script&gt;"
    assert svg_text("</svg><a>") == "&lt;/svg&gt;&lt;a&gt;"


@pytest.mark.parametrize("ch", ["\x00", "\x1b", "\r", "\x7f", "\x85", "\u061c", "\u200b",
                                "\u200e", "\u2028", "\u202a", "\u202e", "\u2066", "\u2069",
                                "\ufeff", "\ud800"])
def test_invisible_characters_are_shown(ch: str) -> None:
    marker = f"U+{ord(ch):04X}"
    out = html_text(f"a{ch}b")
    assert ch not in out and marker in out and out.startswith("a") and out.endswith("b")
    assert '<span class="ctl"' in out
    assert svg_text(f"a{ch}b") == f"a[{marker}]b" == html_attr(f"a{ch}b")


def test_tab_newline_and_ordinary_text_pass() -> None:
    text = "päth\tline\nnext — 数据 ✓"
    assert html_text(text) == text and svg_text(text) == text


def test_burn_down_axis_labels_fit_their_margin() -> None:
    """A credit of seven digits was drawn as ``)00000`` (a reader's trial)."""
    from investigation.report.svg import burndown, compact

    assert [compact(v) for v in (0, 60, 9999, 10_000, 12_500, 2_500_000, 10_000_000,
                                 7_500_000_000)] == \
        ["0", "60", "9999", "10k", "12k", "2.5M", "10M", "7.5G"]
    entries = [{"step_seq": 0, "kind": "credit", "amount_units": 10_000_000,
                "balance_after_units": 10_000_000},
               {"step_seq": 1, "kind": "reserve", "amount_units": -2,
                "balance_after_units": 9_999_998}]
    drawn = burndown(1, 0, entries, 1)
    labels = re.findall(r'text-anchor="end" fill="#555">([^<]*)</text>', drawn)
    assert labels and all(len(label) <= 5 for label in labels), labels
    assert "10M" in labels


def _ledger(credit: int, charged: int, refunded: int) -> list[dict[str, int | str]]:
    """An account's ledger: its credit, one charge at step 1, one refund at step 2."""
    return [{"step_seq": 0, "kind": "credit", "amount_units": credit,
             "balance_after_units": credit},
            {"step_seq": 1, "kind": "reserve", "amount_units": -charged,
             "balance_after_units": credit - charged},
            {"step_seq": 2, "kind": "refund", "amount_units": refunded,
             "balance_after_units": credit - charged + refunded}]


def test_a_small_spend_of_a_large_credit_is_drawn_below_the_credit() -> None:
    """278 units of a 10M credit drew a flat line at the top (a 500-step reader): the axis
    then spans the units spent below the credit, labelled as amounts below it."""
    import re

    from investigation.report.svg import burndown

    entries = _ledger(10_000_000, 200, 50)
    drawn = burndown(1, 0, entries, 2)
    labels = re.findall(r'text-anchor="end" fill="#555">([^<]*)</text>', drawn)
    assert labels == ["10M", "-100", "-200", "-300", "step"], labels  # then the x axis's
    charge = re.search(r'<line class="charge" x1="[^"]*" y1="([^"]*)" x2="[^"]*" '
                       r'y2="([^"]*)"', drawn)
    assert charge is not None
    assert float(charge.group(2)) - float(charge.group(1)) > 60  # most of the 110 px plot
    # A spend of more than half the credit keeps the axis from 0.
    half = [entries[0], {**entries[1], "amount_units": -6_000_000,
                         "balance_after_units": 4_000_000}]
    labels = re.findall(r'text-anchor="end" fill="#555">([^<]*)</text>',
                        burndown(1, 0, half, 1))
    assert labels[0] == "0" and labels[-2:] == ["10M", "step"], labels


def test_bar_titles_name_their_unit_once() -> None:
    """A real model's report said "step 1: 84651 ms ms"."""
    from investigation.report import svg
    from investigation.report.html import _ms

    chart = svg.bars([(1, 84651.0), (2, 420.0), (3, None)], 3, "model time per step", "",
                     "model-time", lambda v: _ms(round(v)))
    assert "<title>step 1: 84.65 s</title>" in chart
    assert "<title>step 2: 420 ms</title>" in chart and "ms ms" not in chart
    tokens = svg.bars([(1, 5000.0)], 1, "tokens", "tokens", "tokens", lambda v: f"{v:.0f}")
    assert "<title>step 1: 5000 tokens</title>" in tokens


def test_zoomed_ticks_are_balances_and_small_refunds_show() -> None:
    """A credit of 400 spent down to 233 was labelled 400, -50, -100, ... under a title
    of "balance 233", and 139 refunds of 1 unit were invisible (an engineer reading a
    500-step case): ticks are balances where they read apart, and a mark is at least
    MIN_MARK_PX long."""
    import re

    from investigation.report.svg import MIN_MARK_PX, burndown

    entries = _ledger(400, 170, 1)
    drawn = burndown(1, 0, entries, 2)
    labels = re.findall(r'text-anchor="end" fill="#555">([^<]*)</text>', drawn)
    assert labels[:-1] and all(not label.startswith("-") for label in labels), labels
    assert labels[0] == "400" and int(labels[-2]) < 231, labels
    refund = re.search(r'<line class="refund" x1="[^"]*" y1="([^"]*)" x2="[^"]*" '
                       r'y2="([^"]*)"', drawn)
    assert refund is not None
    assert float(refund.group(1)) - float(refund.group(2)) >= MIN_MARK_PX  # drawn upward


def test_the_timeline_marks_a_closing_step_once_it_is_published() -> None:
    """A finish whose step has not published yet was drawn as closing its hypothesis
    while status still listed it active (a hostile re-trial)."""
    from investigation.report import svg
    from investigation.report.history import StepRow

    steps = [StepRow(1, 1, True, "PROGRESSED", None, action="query"),
             StepRow(2, 1, True, "PROGRESSED", None, action="finish"),
             StepRow(3, 2, False, None, None, action="reject")]
    drawn = svg.timeline(steps, [1, 2])
    assert drawn.count('<rect class="close"') == 1
    assert 'data-seq="3"' in drawn  # the unpublished step is drawn, unmarked
