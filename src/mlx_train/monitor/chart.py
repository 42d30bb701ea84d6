"""Line charts drawn with Braille characters (2 x 4 dots per cell), as rich ``Text``.

Example::

    from rich import print
    from mlx_train.monitor.chart import Series, line_chart

    print(line_chart([Series("train", [0, 10, 20], [2.3, 0.9, 0.4], "cyan"),
                      Series("val", [10, 20], [1.0, 0.5], "magenta")], width=60, height=12))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rich.text import Text

# Bit of each dot in a Braille cell, indexed [row][column] (rows top to bottom).
_DOTS = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))
_BRAILLE = 0x2800


@dataclass
class Series:
    """One line of a chart: its legend label, x and y values and a rich style (colour)."""

    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    style: str = "cyan"


def format_number(value: float) -> str:
    """Short axis label: ``0.0123``, ``1.23``, ``123``, ``1.2e+04``."""
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1e4 or magnitude < 1e-3:
        return f"{value:.1e}"
    if magnitude >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


def _points(series: Series, log_y: bool) -> list[tuple[float, float]]:
    points = []
    for x, y in zip(series.xs, series.ys, strict=False):
        if not (math.isfinite(x) and math.isfinite(y)) or (log_y and y <= 0):
            continue
        points.append((float(x), math.log10(y) if log_y else float(y)))
    return points


def _thin(points: list[tuple[float, float]], limit: int) -> list[tuple[float, float]]:
    """At most about ``limit`` points, evenly spaced, always keeping the last."""
    if len(points) <= limit:
        return points
    stride = len(points) / limit
    kept = [points[int(i * stride)] for i in range(limit)]
    return kept + [points[-1]]


def _segment(x0: int, y0: int, x1: int, y1: int) -> list[tuple[int, int]]:
    """The pixels of a straight line (Bresenham)."""
    pixels = []
    dx, dy = abs(x1 - x0), -abs(y1 - y0)
    sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
    error = dx + dy
    while True:
        pixels.append((x0, y0))
        if x0 == x1 and y0 == y1:
            return pixels
        twice = 2 * error
        if twice >= dy:
            error += dy
            x0 += sx
        if twice <= dx:
            error += dx
            y0 += sy


def line_chart(series: Sequence[Series], width: int, height: int, log_y: bool = False,
               x_label: str = "step") -> Text:
    """A chart ``width`` x ``height`` cells: y labels, the plot, an x axis with labels, a legend.

    Series without finite points are left out; with none at all the chart says "no data yet".
    """
    drawn = [(s, _points(s, log_y)) for s in series]
    drawn = [(s, p) for s, p in drawn if p]
    if not drawn:
        return Text("no data yet", style="dim")
    rows, label_width = max(height - 3, 2), 9
    cols = max(width - label_width - 1, 8)
    xs = [x for _, p in drawn for x, _ in p]
    ys = [y for _, p in drawn for _, y in p]
    x_min, x_max, y_min, y_max = min(xs), max(xs), min(ys), max(ys)
    if y_max == y_min:
        y_min, y_max = y_min - 0.5 * (abs(y_min) or 1.0), y_max + 0.5 * (abs(y_max) or 1.0)
    x_span = (x_max - x_min) or 1.0
    px_w, px_h = cols * 2, rows * 4

    cells: dict[tuple[int, int], int] = {}
    styles: dict[tuple[int, int], str] = {}
    for s, points in drawn:
        pixels = [(round((x - x_min) / x_span * (px_w - 1)), round((y_max - y) / (y_max - y_min) * (px_h - 1)))
                  for x, y in _thin(points, px_w * 2)]
        path = pixels[:1]
        for a, b in zip(pixels, pixels[1:], strict=False):
            path.extend(_segment(*a, *b)[1:])
        for px, py in path:
            cell = (py // 4, px // 2)
            cells[cell] = cells.get(cell, 0) | _DOTS[py % 4][px % 2]
            styles[cell] = s.style

    def y_value(row: int) -> float:
        value = y_max - (row * 4 + 1.5) / (px_h - 1) * (y_max - y_min)
        return 10 ** value if log_y else value

    text = Text()
    labelled = {0: y_value(0), rows - 1: y_value(rows - 1), rows // 2: y_value(rows // 2)}
    for row in range(rows):
        label = format_number(labelled[row]) if row in labelled else ""
        text.append(f"{label:>{label_width - 1}} ", style="dim")
        text.append("┤" if row in labelled else "│", style="dim")
        for col in range(cols):
            bits = cells.get((row, col))
            if bits:
                text.append(chr(_BRAILLE + bits), style=styles[(row, col)])
            else:
                text.append(" ")
        text.append("\n")
    text.append(" " * label_width + "└" + "─" * cols + "\n", style="dim")
    left, right = format_number(x_min), format_number(x_max)
    middle = f"{x_label}"
    gap = max(cols - len(left) - len(right) - len(middle), 2)
    text.append(" " * (label_width + 1) + left + " " * (gap // 2) + middle + " " * (gap - gap // 2) + right + "\n",
                style="dim")
    text.append(" " * (label_width + 1))
    for i, (s, points) in enumerate(drawn):
        if i:
            text.append("   ")
        text.append("━━ ", style=s.style)
        text.append(f"{s.label} {format_number(10 ** points[-1][1] if log_y else points[-1][1])}")
    return text
