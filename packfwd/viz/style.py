"""The look the matplotlib pictures share: colours (sequences, CP ranks, padding), unit cells for small grids and one
image for large ones, grid axes that thin their labels, titles wrapped to the axes.

Small grids (up to ``CELL_LIMIT`` cells) are drawn cell by cell: one patch per token with a white border, padding
hatched, names inside when there are few columns.  Larger ones are one ``imshow`` of the cell colours (padding
light grey, no borders, no per-cell text): a 64 x 1024 batch draws in a few tens of milliseconds instead of tens of
seconds, and its cells stay visible.  matplotlib is imported only inside the functions.
"""

from __future__ import annotations

import colorsys
import textwrap
from typing import Sequence

import numpy as np

__all__ = [
    "CELL_LIMIT", "LABEL_LIMIT", "PAD_HATCH", "PAD_RGBA", "sequence_colours", "rank_colours", "lighter", "cell",
    "grid_image", "grid_axes", "wrapped_title", "max_columns",
]

CELL_LIMIT = 1500  # grids with more cells are drawn as one image
LABEL_LIMIT = 48  # write token/layer names inside cells only up to this many columns
PAD_HATCH = "///"
PAD_RGBA = (0.88, 0.88, 0.88, 1.0)  # padding in image grids
MAX_COLUMNS = 4096  # an image grid wider than this is sampled down to it (nearest column)

_TAB10 = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf"]
_RANKS = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#444444"]  # Dark2


def _rgba(hex_colour: str) -> tuple[float, float, float, float]:
    h = hex_colour.lstrip("#")
    return tuple(int(h[i : i + 2], 16) / 255 for i in (0, 2, 4)) + (1.0,)


def _spread_hues(n: int, offset: float = 0.0) -> list[tuple[float, float, float, float]]:
    """``n`` colours of well-separated hues (golden-ratio steps), lightness alternating so neighbours differ."""
    out = []
    for i in range(n):
        hue = (offset + i * 0.618033988749895) % 1.0
        light, sat = (0.45, 0.75) if i % 2 == 0 else (0.62, 0.65)
        out.append((*colorsys.hls_to_rgb(hue, light, sat), 1.0))
    return out


def sequence_colours(n: int) -> list[tuple[float, float, float, float]]:
    """RGBA colours of ``n`` sequences: matplotlib's tab10 for up to 10, else ``n`` distinct hues (no repeats, and
    any two neighbours differ in hue and lightness).

    >>> len(set(sequence_colours(64))), sequence_colours(3)[0][:3] == sequence_colours(64)[0][:3]
    (64, False)
    """
    return [_rgba(c) for c in _TAB10[:n]] if n <= 10 else _spread_hues(n)


def rank_colours(n: int) -> list[tuple[float, float, float, float]]:
    """RGBA colours of ``n`` CP ranks: a palette apart from the sequences' (Dark2), distinct hues past 8."""
    return [_rgba(c) for c in _RANKS[:n]] if n <= len(_RANKS) else _spread_hues(n, offset=0.3)


def lighter(colour, amount: float = 0.7) -> tuple[float, float, float, float]:
    """``colour`` blended towards white (padding drawn in its sequence's or rank's colour)."""
    r, g, b = colour[:3]
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount, 1.0)


def cell(ax, x: float, y: float, colour, *, pad: bool, label: str | None = None, fontsize: float = 7,
         width: float = 1.0):
    """A cell ``width`` wide with its top-left corner at (x, y) (y grows downwards), hatched when it is padding."""
    from matplotlib.patches import Rectangle

    face = lighter(colour, 0.75) if pad else colour
    ax.add_patch(Rectangle((x, y), width, 1, facecolor=face, edgecolor="white", linewidth=0.8,
                           hatch=PAD_HATCH if pad else None))
    if label is not None:
        ax.text(x + width / 2, y + 0.5, label, ha="center", va="center", fontsize=fontsize,
                color="black" if pad else "white")


def max_columns(width: int) -> tuple[np.ndarray, int]:
    """The columns an image grid of ``width`` columns shows: all of them, or ``MAX_COLUMNS`` evenly spaced."""
    if width <= MAX_COLUMNS:
        return np.arange(width), 1
    step = -(-width // MAX_COLUMNS)
    return np.arange(0, width, step), step


def grid_image(ax, rgba: np.ndarray, *, top: float = 0.0, width: float | None = None):
    """``rgba [rows, cols, 4]`` drawn so that cell ``(row, col)`` covers the unit square at ``(col, top + row)``
    (the coordinates of :func:`cell`): one image, nearest-neighbour, no borders.  ``width``: the data width the
    columns span (when they were sampled down)."""
    rows, cols = rgba.shape[:2]
    span = cols if width is None else width
    return ax.imshow(rgba, extent=(0, span, top + rows, top), interpolation="nearest", aspect="auto",
                     resample=False, origin="upper")


def grid_axes(ax, width: float, height: int, ylabels: Sequence[str], *, max_labels: int = 24) -> None:
    """Axes for a grid of unit rows: row 0 on top, one label per row (every k-th past ``max_labels`` rows), integer
    x ticks, no frame."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(0, max(width, 1))
    ax.set_ylim(max(height, 1), 0)
    step = max(1, -(-height // max_labels))
    rows = range(0, height, step)
    ax.set_yticks([r + 0.5 for r in rows], [ylabels[r] for r in rows])
    ax.tick_params(length=0)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)


def wrapped_title(ax, text: str, fontsize: float = 9) -> None:
    """``text`` as the title, each line wrapped to the axes' width (about 0.55 em per character)."""
    fig = ax.get_figure()
    inches = ax.get_position().width * (fig.get_figwidth() if fig is not None else 6.4)
    chars = max(30, int(inches * 72 / (0.55 * fontsize)))
    lines = [textwrap.fill(line, chars) for line in text.split("\n")]
    ax.set_title("\n".join(lines), fontsize=fontsize)
