"""The report's charts as inline SVG (no script, no library, no network).

Each function returns one ``<svg>`` element as a string. Sizes are in CSS pixels; a
chart wider than the page sits in a horizontally scrolling box. Every drawn mark has a
``<title>`` (the browser's tooltip) and a class the browser test looks for:

* :func:`timeline`: ``svg.chart-timeline``, one ``rect.step`` per step, one swimlane per
  hypothesis (plus one for closing steps), coloured by outcome;
* :func:`confidence`: ``svg.chart-confidence``, one ``path.series`` per hypothesis (a step
  line over the six confidence labels) and one ``circle.point`` per accepted decision;
* :func:`burndown`: ``svg.chart-budget``, one per account: ``path.balance`` (balance after
  every ledger entry), ``line.charge`` (down, red) and ``line.refund`` (up, green);
* :func:`bars`: ``svg.chart-bars``, one ``rect.bar`` per step with a value (model time,
  tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from investigation.constants import CONFIDENCE_ORDER
from investigation.report.escape import svg_text

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b",
           "#e377c2", "#7f7f7f", "#bcbd22")
OUTCOME_COLOURS = {
    "PROGRESSED": "#3a8d3f", "REJECTED": "#e08a00", "DEFERRED": "#7b52ab",
    "BLOCKED": "#c62828", "COMPLETED": "#1e5bb8", "RETRY_PENDING": "#9e9e2e",
    "YIELDED": "#8a8a8a",
}
UNPUBLISHED_COLOUR = "#bdbdbd"
CHARGE_COLOUR = "#c62828"
REFUND_COLOUR = "#2e7d32"
FONT = 'font-family="system-ui, sans-serif" font-size="11"'


def colour(index: int) -> str:
    """The colour of the ``index``-th hypothesis (ascending ids), cycling the palette."""
    return PALETTE[index % len(PALETTE)]


def nice_step(span: float, target: int = 10) -> int:
    """An integer tick spacing (1, 2, 5 x 10^k) giving about ``target`` ticks over ``span``."""
    if span <= target:
        return 1
    raw = span / target
    base = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * base >= raw:
            return int(m * base)
    return int(10 * base)


def compact(units: int) -> str:
    """An axis label that fits the burn-down's margin (five characters at most): below
    10,000 the number itself (``9999``), then ``12k``, ``2.5M``, ``10M`` (a credit of
    seven digits was cut to ``)00000``)."""
    if abs(units) < 10_000:
        return str(units)
    scale, suffix = next((scale, suffix) for scale, suffix in (
        (1_000_000_000, "G"), (1_000_000, "M"), (1_000, "k")) if abs(units) >= scale)
    value = units / scale
    return (f"{value:.1f}".rstrip("0").rstrip(".") if abs(value) < 10
            else f"{value:.0f}") + suffix


def _f(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


class _Scale:
    """Steps 0..max_seq onto ``left``..``left + width`` pixels."""

    def __init__(self, max_seq: int, left: float, width: float) -> None:
        self.max_seq = max(1, max_seq)
        self.left = left
        self.width = width

    def __call__(self, seq: float) -> float:
        return self.left + self.width * seq / self.max_seq


def _x_axis(x: _Scale, y: float, cells: bool = False, label: str = "step") -> list[str]:
    """The step axis; with ``cells`` step ``t`` is the cell between ``t - 1`` and ``t``."""
    out = [f'<line class="axis" x1="{_f(x(0))}" y1="{_f(y)}" x2="{_f(x(x.max_seq))}" '
           f'y2="{_f(y)}" stroke="#999"/>']
    tick = nice_step(x.max_seq)
    first = tick if cells and tick > 1 else (1 if cells else 0)
    for t in range(first, x.max_seq + 1, tick):
        px = x(t - 0.5) if cells else x(t)
        out.append(f'<line x1="{_f(px)}" y1="{_f(y)}" x2="{_f(px)}" y2="{_f(y + 4)}" '
                   f'stroke="#999"/><text x="{_f(px)}" y="{_f(y + 15)}" '
                   f'text-anchor="middle" fill="#555">{t}</text>')
    out.append(f'<text x="{_f(x(x.max_seq))}" y="{_f(y + 28)}" text-anchor="end" '
               f'fill="#555">{label}</text>')
    return out


def _svg(cls: str, width: float, height: float, label: str, body: list[str]) -> str:
    return (f'<svg class="{cls}" xmlns="http://www.w3.org/2000/svg" role="img" '
            f'width="{_f(width)}" height="{_f(height)}" viewBox="0 0 {_f(width)} {_f(height)}" '
            f'aria-label="{svg_text(label)}" {FONT}><title>{svg_text(label)}</title>'
            + "".join(body) + "</svg>")


#: The reply actions that close a hypothesis (marked above their cell in the timeline).
CLOSING_ACTIONS = ("finish", "reject")
#: The mark of such a step.
CLOSE_COLOUR = "#222"


def timeline(steps: Sequence[Any], hypothesis_ids: Sequence[int]) -> str:
    """Swimlanes of steps: one row per hypothesis, each step a cell coloured by outcome.

    Args:
        steps: :class:`~investigation.report.history.StepRow` objects, ascending ``seq``.
        hypothesis_ids: every hypothesis id, ascending.
    """
    rows: list[int | None] = list(hypothesis_ids)
    if any(s.hypothesis_id is None for s in steps):
        rows.append(None)
    max_seq = max((s.seq for s in steps), default=1)
    cell = min(48.0, max(2.0, 900.0 / max_seq))
    left, top, row_h = 78.0, 8.0, 20.0
    x = _Scale(max_seq, left, cell * max_seq)
    height = top + row_h * len(rows) + 34
    body: list[str] = []
    for i, hid in enumerate(rows):
        y = top + row_h * i
        name = f"H{hid}" if hid is not None else "closing"
        body.append(f'<rect x="0" y="{_f(y)}" width="{_f(x(max_seq) + 4)}" '
                    f'height="{_f(row_h)}" fill="{"#f6f6f6" if i % 2 else "#fff"}"/>'
                    f'<text class="lane" x="6" y="{_f(y + 14)}" fill="#333">{name}</text>')
    lane = {hid: i for i, hid in enumerate(rows)}
    gap = 1.0 if cell >= 4 else 0.0
    for s in steps:
        y = top + row_h * lane.get(s.hypothesis_id, len(rows) - 1) + 3
        fill = OUTCOME_COLOURS.get(s.outcome or "", UNPUBLISHED_COLOUR) if s.published \
            else UNPUBLISHED_COLOUR
        what = s.operation or s.action or ("closing step" if s.closing_step else "no decision")
        tip = (f"step {s.seq}" + (f" H{s.hypothesis_id}" if s.hypothesis_id is not None
                                  else "")
               + f": {what} -> {s.outcome or 'in progress'}"
               + (f" ({s.reason})" if s.reason else "")
               + ("" if s.published else " [not published]"))
        # A cell links to its row of the step table (a reader's trial: step 250 was only
        # reachable by scrolling 55 screens of table).
        body.append(f'<a href="#step-{s.seq}"><rect class="step" data-seq="{s.seq}" '
                    f'x="{_f(x(s.seq - 1))}" y="{_f(y)}" width="{_f(max(1.0, cell - gap))}" '
                    f'height="{_f(row_h - 6)}" fill="{fill}"><title>{svg_text(tip)}</title>'
                    "</rect></a>")
        if s.action in CLOSING_ACTIONS and s.published:  # closed once it is published
            # A finish or reject looked like any query's PROGRESSED cell (a 500-step
            # reader): a dark bar above the cell marks where a hypothesis was closed.
            body.append(f'<rect class="close" x="{_f(x(s.seq - 1))}" y="{_f(y - 3)}" '
                        f'width="{_f(max(2.0, cell - gap))}" height="3" '
                        f'fill="{CLOSE_COLOUR}"><title>{svg_text(tip)}</title></rect>')
    body += _x_axis(x, top + row_h * len(rows) + 2, cells=True)
    return _svg("chart-timeline", x(max_seq) + 14, height,
                f"Timeline of {len(steps)} steps by hypothesis, coloured by outcome", body)


def confidence(series: dict[int, list[tuple[int, str]]], max_seq: int) -> str:
    """Each hypothesis's confidence label over the steps (a step line per hypothesis).

    Args:
        series: ``{hypothesis_id: [(step_seq, label), ...]}``; the first point is step 0.
        max_seq: the last step (the right end of the x axis).
    """
    levels = list(CONFIDENCE_ORDER)
    left, top, band = 128.0, 10.0, 26.0
    width = 900.0
    x = _Scale(max_seq, left, width)
    bottom = top + band * (len(levels) - 1)

    def y(label: str) -> float:
        return bottom - band * levels.index(label)

    body: list[str] = []
    for label in levels:
        body.append(f'<line x1="{_f(left)}" y1="{_f(y(label))}" x2="{_f(x(max_seq))}" '
                    f'y2="{_f(y(label))}" stroke="#e3e3e3"/><text x="{_f(left - 6)}" '
                    f'y="{_f(y(label) + 4)}" text-anchor="end" fill="#444">{label}</text>')
    ids = sorted(series)
    r = 3.0 if sum(len(v) for v in series.values()) <= 600 else 2.0
    for i, hid in enumerate(ids):
        points = series[hid]
        off = (i - (len(ids) - 1) / 2) * 2.5
        d = [f"M{_f(x(points[0][0]))} {_f(y(points[0][1]) + off)}"]
        for seq, label in points[1:]:
            d.append(f"H{_f(x(seq))}V{_f(y(label) + off)}")
        d.append(f"H{_f(x(max_seq))}")
        c = colour(i)
        body.append(f'<path class="series" data-hypothesis="{hid}" d="{"".join(d)}" '
                    f'fill="none" stroke="{c}" stroke-width="2"><title>H{hid}</title></path>')
        for seq, label in points[1:]:
            body.append(f'<circle class="point" cx="{_f(x(seq))}" cy="{_f(y(label) + off)}" '
                        f'r="{_f(r)}" fill="{c}"><title>H{hid} step {seq}: {label}</title>'
                        "</circle>")
    body += _x_axis(x, bottom + 12)
    legend_y = bottom + 48
    for i, hid in enumerate(ids):
        lx = left + (i % 8) * 90
        ly = legend_y + (i // 8) * 16
        body.append(f'<rect x="{_f(lx)}" y="{_f(ly - 9)}" width="12" height="10" '
                    f'fill="{colour(i)}"/><text x="{_f(lx + 16)}" y="{_f(ly)}" '
                    f'fill="#333">H{hid}</text>')
    height = legend_y + 16 * ((len(ids) + 7) // 8) + 4
    return _svg("chart-confidence", x(max_seq) + 14, height,
                "Confidence of each hypothesis over the steps", body)


#: Shortest charge or refund mark of the burn-down (px).
MIN_MARK_PX = 3.0


def burndown(hypothesis_id: int, index: int, entries: list[dict[str, Any]],
             max_seq: int) -> str:
    """One account's balance over the steps with each charge and refund drawn.

    Args:
        hypothesis_id: the account's hypothesis.
        index: its position among the hypotheses (its colour).
        entries: its ledger rows in order (``step_seq``, ``kind``, ``amount_units``,
            ``balance_after_units``); the ``credit`` row starts the line.
        max_seq: the last step (the right end of the x axis).
    """
    left, top, plot_w, plot_h = 44.0, 22.0, 400.0, 110.0
    x = _Scale(max_seq, left, plot_w)
    top_value = max([1] + [abs(int(e["balance_after_units"])) for e in entries]
                    + [int(e["amount_units"]) for e in entries if e["kind"] == "credit"])
    # A spend small beside its credit (278 of 10M units) drew a flat line at the top (a
    # 500-step reader): the axis then shows only the units below the credit that were
    # spent, labelled as amounts below it.
    lowest = min([top_value] + [int(e["balance_after_units"]) for e in entries])
    spent = top_value - lowest
    zoomed = spent > 0 and lowest > top_value / 2
    tick = nice_step(spent * 1.1 if zoomed else top_value, 4)
    bottom = top_value - tick * math.ceil(spent * 1.1 / tick) if zoomed else 0

    def y(v: float) -> float:
        return top + plot_h - plot_h * (v - bottom) / (top_value - bottom)

    body: list[str] = [
        f'<text x="{_f(left)}" y="14" fill="{colour(index)}" font-weight="bold">'
        f'H{hypothesis_id}</text>']
    ticks = list(range(top_value, bottom - 1, -tick) if zoomed else
                 range(0, top_value + 1, tick))
    # Zoomed, the ticks are balances as the title states them (400, 350, 300, ...) where
    # they read apart; "-50", "-100" under a credit of 400 read as a negative balance (an
    # engineer's trial). Only where the compact form cannot tell them apart (10M, 10M,
    # ... for a spend of 278 of 10M units) are they amounts below the credit.
    relative = zoomed and len({compact(v) for v in ticks}) < len(ticks)
    for v in ticks:
        label = compact(v) if not relative or v == top_value else f"-{compact(top_value - v)}"
        body.append(f'<line x1="{_f(left)}" y1="{_f(y(v))}" x2="{_f(left + plot_w)}" '
                    f'y2="{_f(y(v))}" stroke="#eee"/><text x="{_f(left - 4)}" '
                    f'y="{_f(y(v) + 4)}" text-anchor="end" fill="#555">{label}</text>')
    charged = refunded = 0
    if entries:
        balance = entries[0]["balance_after_units"] if entries[0]["kind"] == "credit" else 0
        d = [f"M{_f(x(0))} {_f(y(balance))}"]
        marks: list[str] = []
        for e in entries:
            if e["kind"] == "credit":
                balance = e["balance_after_units"]
                continue
            after = e["balance_after_units"]
            px = x(e["step_seq"])
            d.append(f"H{_f(px)}V{_f(y(after))}")
            kind = "charge" if e["kind"] == "reserve" else "refund"
            if kind == "charge":
                charged += -e["amount_units"]
            else:
                refunded += e["amount_units"]
            amount = abs(e["amount_units"])
            tip = (f"step {e['step_seq']}: {kind} {amount} unit{'' if amount == 1 else 's'}, "
                   f"balance {after}" + (f" ({e['reference']})" if e.get("reference") else ""))
            # At least MIN_MARK_PX long: a refund of 1 unit of 400 was 0.5 px, and no
            # refund of a 500-step case could be seen (an engineer's trial).
            y1, y2 = y(balance), y(after)
            if abs(y2 - y1) < MIN_MARK_PX:
                y2 = y1 + (MIN_MARK_PX if kind == "charge" else -MIN_MARK_PX)
            marks.append(
                f'<line class="{kind}" x1="{_f(px)}" y1="{_f(y1)}" x2="{_f(px)}" '
                f'y2="{_f(y2)}" stroke="{CHARGE_COLOUR if kind == "charge" else REFUND_COLOUR}" '
                f'stroke-width="3"><title>{svg_text(tip)}</title></line>')
            balance = after
        d.append(f"H{_f(x(max_seq))}")
        body.append(f'<path class="balance" d="{"".join(d)}" fill="none" stroke="#666" '
                    'stroke-width="1.2"/>')
        body += marks
        body.append(f'<text x="{_f(left + plot_w)}" y="14" text-anchor="end" fill="#444">'
                    f"balance {balance}; charged {charged}, refunded {refunded}</text>")
    body += _x_axis(x, top + plot_h + 2)
    return _svg("chart-budget", left + plot_w + 16, top + plot_h + 34,
                f"Budget of hypothesis {hypothesis_id}: charges and refunds over the steps",
                body)


def bars(values: Sequence[tuple[int, float | None]], max_seq: int, label: str,
         unit: str, cls: str, fmt: Callable[[float], str] = lambda v: f"{v:g}") -> str:
    """A bar per step (``(step_seq, value)``; ``None`` draws nothing); each bar's title is
    ``fmt(value)`` then ``unit`` (empty where ``fmt`` writes its own unit)."""
    left, top, plot_h = 56.0, 16.0, 70.0
    cell = min(48.0, max(2.0, 900.0 / max(1, max_seq)))
    x = _Scale(max_seq, left, cell * max(1, max_seq))
    top_value = max([v for _, v in values if v is not None] + [0.0]) or 1.0
    body = [f'<text x="{_f(left)}" y="11" fill="#333">{svg_text(label)}</text>',
            f'<text x="{_f(left - 4)}" y="{_f(top + 8)}" text-anchor="end" fill="#555">'
            f"{svg_text(fmt(top_value))}</text>",
            f'<text x="{_f(left - 4)}" y="{_f(top + plot_h)}" text-anchor="end" '
            'fill="#555">0</text>']
    gap = 1.0 if cell >= 4 else 0.0
    for seq, v in values:
        if v is None:
            continue
        h = max(0.5, plot_h * v / top_value)
        body.append(f'<rect class="bar {cls}" x="{_f(x(seq - 1))}" y="{_f(top + plot_h - h)}" '
                    f'width="{_f(max(1.0, cell - gap))}" height="{_f(h)}" fill="#5b7db1">'
                    f"<title>step {seq}: {svg_text(f'{fmt(v)} {unit}'.rstrip())}</title></rect>")
    body += _x_axis(x, top + plot_h + 2, cells=True)
    return _svg(f"chart-bars {cls}", x(max_seq) + 14, top + plot_h + 34, label, body)

