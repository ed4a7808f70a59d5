"""Pictures of the context-parallel zigzag: which chunks of every sequence each CP rank owns (``draw_zigzag``), the
attention work each rank gets (``plot_attention_work``), and both beside each rank's THD tensor
(``draw_cp_layout``).

Each sequence is padded to a multiple of ``2 * cp`` and cut into ``2 * cp`` equal chunks; rank ``r`` holds chunks
``r`` and ``2 cp - 1 - r`` (the rule is :mod:`packfwd.layout.rules`'; these pictures ask it, never re-derive it).
In the zigzag view a row is a sequence, its chunks numbered and coloured by the rank that owns them (CP ranks have
their own palette, apart from the sequences'), padding light.  Like :mod:`packfwd.viz.plot`, every function takes
lengths, a mask or a plan, draws on the axes it is given and imports matplotlib only when it runs.
"""

from __future__ import annotations

import numpy as np

from packfwd.layout import rules

from .inputs import ThdFacts, thd_facts
from .plot import draw_thd
from .style import PAD_HATCH, grid_axes, grid_image, lighter, max_columns, rank_colours, wrapped_title
from .text import attention_work, sequence_name

__all__ = ["draw_zigzag", "plot_attention_work", "draw_cp_layout"]

_CHUNK_LIMIT = 400  # up to this many chunks (sequences x 2 cp) one patch each, numbered; beyond, one image


def _rank_legend(ax, facts: ThdFacts, colours) -> None:
    from matplotlib.patches import Patch

    cp = facts.cp_size
    if cp == 1:
        return
    owned = [[k for k in range(2 * cp) if facts.chunk_owner(k) == r] for r in range(cp)]
    handles = [Patch(color=colours[r], label=f"rank {r}: chunks {', '.join(map(str, owned[r]))}") for r in range(cp)]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False,
              title="CP rank", title_fontsize=7)


def draw_zigzag(ax, layout, tp_size: int | None = None, cp_size: int | None = None, seq_align: int | None = None):
    """Draw the global zigzag: a row per sequence along its padded length, cut into ``2 * cp`` chunks, each chunk
    numbered and coloured by the CP rank that owns it; padding light and hatched.  ``layout``: sequence lengths or
    a ``[b, s]`` mask (with ``tp_size``, ``cp_size``, ``seq_align``), or a plan (a ``ThdInfo`` of any rank, the
    list of every rank's, an ``UnpadInfo``).  Up to 400 chunks one patch each; beyond, one image.  Returns ``ax``.

    >>> from matplotlib.figure import Figure
    >>> ax = draw_zigzag(Figure().subplots(), [8], cp_size=2)   # chunks of 2: ranks 0, 1, 1, 0
    >>> [(int(p.get_x()), p.get_facecolor() == ax.patches[0].get_facecolor()) for p in ax.patches]
    [(0, True), (2, False), (4, False), (6, True)]
    """
    facts = thd_facts(layout, tp_size=tp_size, cp_size=cp_size, seq_align=seq_align)
    n, cp = facts.n, facts.cp_size
    chunks = 2 * cp if cp > 1 else 1
    colours = rank_colours(cp)
    longest = int(facts.padded.max()) if n else 0
    if n and n * chunks <= _CHUNK_LIMIT:  # no sequences: nothing to draw, the axes and title still are
        _zigzag_patches(ax, facts, chunks, colours)
    elif n:
        _zigzag_image(ax, facts, colours, longest)
    grid_axes(ax, longest, n, [f"{sequence_name(i)} ({int(v)})" for i, v in enumerate(facts.lengths)])
    ax.set_xlabel("position in the padded sequence")
    ax.set_ylabel("sequence (real length)", fontsize=8)
    _rank_legend(ax, facts, colours)
    if cp > 1:
        text = (f"the zigzag, cp={cp}: each sequence padded to a multiple of {facts.seq_align} and cut into "
                f"{chunks} chunks; rank r owns chunks r and {chunks - 1}-r (light, hatched: padding)")
    else:
        text = f"cp=1: no split, one rank holds every sequence (align {facts.seq_align}; light: padding)"
    wrapped_title(ax, text)
    return ax


def _zigzag_patches(ax, facts: ThdFacts, chunks: int, colours) -> None:
    from matplotlib.patches import Rectangle

    size = facts.chunk()
    px = ax.get_window_extent().width / max(int(facts.padded.max()), 1)
    for i, (real, c) in enumerate(zip(facts.lengths.tolist(), size.tolist())):
        ax.vlines([k * c for k in range(1, chunks)], i, i + 1, colors="white", linewidth=1.2)  # chunk edges
        for k in range(chunks):
            colour, x0 = colours[facts.chunk_owner(k)], k * c
            filled = min(max(real - x0, 0), c)
            if filled:
                ax.add_patch(Rectangle((x0, i + 0.06), filled, 0.88, facecolor=colour, edgecolor="none"))
            if c - filled:
                ax.add_patch(Rectangle((x0 + filled, i + 0.06), c - filled, 0.88, facecolor=lighter(colour, 0.65),
                                       edgecolor="none", hatch=PAD_HATCH))
            if c * px >= 11:
                ax.text(x0 + c / 2, i + 0.5, str(k), ha="center", va="center", fontsize=7,
                        color="white" if filled * 2 >= c else "black")


def _zigzag_image(ax, facts: ThdFacts, colours, longest: int) -> None:
    cols, _ = max_columns(longest)
    q = cols[None, :]  # [1, w] positions shown
    chunk = np.maximum(facts.chunk(), 1)[:, None]
    owner, _ = rules.zigzag_owner(q, chunk, facts.cp_size) if facts.cp_size > 1 else (q * 0 + 0 * chunk, q)
    owner = np.clip(owner, 0, facts.cp_size - 1)
    solid = np.asarray(colours)[owner]
    light = np.asarray([lighter(c, 0.65) for c in colours])[owner]
    rgba = np.where((q < facts.lengths[:, None])[..., None], solid, light)
    rgba[q.repeat(facts.n, 0) >= facts.padded[:, None]] = (1.0, 1.0, 1.0, 0.0)
    grid_image(ax, rgba, width=longest)
    if ax.get_window_extent().height / facts.n >= 4:  # rows apart, while they are a few pixels high
        ax.hlines(np.arange(1, facts.n), 0, longest, colors="white", linewidth=0.8)


def plot_attention_work(ax, layout, tp_size: int | None = None, cp_size: int | None = None,
                        seq_align: int | None = None):
    """Bar chart of each CP rank's causal attention work (:func:`packfwd.viz.text.attention_work`): the zigzag
    split against the same sequences cut into ``cp`` contiguous pieces.  Bars ``0..cp-1`` of ``ax.patches`` are
    the contiguous split's, then the zigzag's.  Returns ``ax``.

    >>> from matplotlib.figure import Figure
    >>> ax = plot_attention_work(Figure().subplots(), [16], cp_size=2)
    >>> [int(p.get_height()) for p in ax.patches]
    [36, 100, 68, 68]
    """
    facts = thd_facts(layout, tp_size=tp_size, cp_size=cp_size, seq_align=seq_align)
    work = attention_work(facts)
    cp = facts.cp_size
    xs = np.arange(cp)
    ax.bar(xs - 0.2, work["contiguous"], width=0.4, color="#bbbbbb", label="contiguous split")
    ax.bar(xs + 0.2, work["zigzag"], width=0.4, color=rank_colours(cp), label="zigzag (packfwd)")
    ax.set_xticks(xs.tolist(), [f"rank {r}" for r in range(cp)], fontsize=7)
    ax.set_ylabel("keys attended, summed", fontsize=7)
    ax.tick_params(axis="y", labelsize=6)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.yaxis.get_offset_text().set_fontsize(6)
    ax.set_ylim(0, max(work["contiguous"] + work["zigzag"] + [1]) * 1.6)  # room for the legend

    def spread(values):
        return max(values) / min(values) if min(values) else float("inf")

    wrapped_title(ax, f"attention work per CP rank, max/min: zigzag {spread(work['zigzag']):.2f}, contiguous "
                      f"{spread(work['contiguous']):.2f}", fontsize=8)
    ax.legend(fontsize=6, frameon=False, loc="upper left", handlelength=1)
    return ax


def draw_cp_layout(fig, layout, tp_size: int | None = None, cp_size: int | None = None,
                   seq_align: int | None = None) -> dict:
    """The whole context-parallel picture on ``fig`` (a ``matplotlib.figure.Figure``, e.g. ``plt.figure(figsize=(11,
    6))``; its layout engine is set to "constrained"): the global zigzag on top (:func:`draw_zigzag`), each CP
    rank's THD tensor below (:func:`draw_thd`, chunks numbered alike, rank names in the ranks' colours) and each
    rank's attention work beside it (:func:`plot_attention_work`).  Returns the axes: ``{"zigzag", "ranks",
    "work"}``.

    >>> from matplotlib.figure import Figure
    >>> sorted(draw_cp_layout(Figure(figsize=(10, 5)), [5, 17, 3, 9], tp_size=2, cp_size=2))
    ['ranks', 'work', 'zigzag']
    """
    facts = thd_facts(layout, tp_size=tp_size, cp_size=cp_size, seq_align=seq_align)
    rows = min(max(facts.n, 1), 24)
    fig.set_layout_engine("constrained")  # titles, labels and the legend kept apart at any figure size
    grid = fig.add_gridspec(2, 2, height_ratios=[rows + 2, facts.cp_size + 2.5], width_ratios=[4, 1.1])
    axes = {"zigzag": fig.add_subplot(grid[0, :]), "ranks": fig.add_subplot(grid[1, 0]),
            "work": fig.add_subplot(grid[1, 1])}
    draw_zigzag(axes["zigzag"], facts)
    draw_thd(axes["ranks"], facts)
    for label, colour in zip(axes["ranks"].get_yticklabels(), rank_colours(facts.cp_size)):
        if facts.cp_size > 1:
            label.set_color(colour)
            label.set_fontweight("bold")
    plot_attention_work(axes["work"], facts)
    return axes
