"""Matplotlib pictures of packfwd layouts, for notebooks: masks, THD tensors per CP rank, pipeline layer grids
and padding sweeps.

Every function draws on axes you pass in (``fig, ax = plt.subplots()`` or ``matplotlib.figure.Figure``) and
returns them; none calls ``plt.show`` or touches global state. They take the user's objects: a mask, sequence
lengths or a plan (:mod:`packfwd.viz.inputs`). One token or layer is one unit square: a cell coloured by its
sequence (or virtual stage), padding hatched, tokens named as in :mod:`packfwd.viz.text`; a large grid is one image
instead (:mod:`packfwd.viz.style`). matplotlib is imported only inside the functions, so ``import packfwd.viz.plot``
works without it.
"""

from __future__ import annotations

from itertools import product
from typing import Sequence

import numpy as np

from packfwd import layer_partition
from packfwd.layout.display import percent, short_ints

from .inputs import mask_of, thd_facts
from .style import CELL_LIMIT, LABEL_LIMIT, PAD_RGBA, cell, grid_axes, grid_image, max_columns, sequence_colours
from .style import wrapped_title
from .text import padding_sweep, sequence_name

__all__ = ["draw_layer_partition", "draw_mask", "draw_thd", "plot_padding_sweep"]


def _colour(i: int):
    return sequence_colours(10)[i % 10]


def draw_mask(ax, mask):
    """Draw a ``[b, s]`` attention mask: row ``i``'s real tokens in sequence ``i``'s colour, padding hatched (light
    grey in a large batch).  ``mask``: the mask, sequence lengths (right-padded), or a plan (the mask it was
    planned from; a ``BshdInfo``: its compacted ``[b, width]`` batch).

    Up to ``style.CELL_LIMIT`` cells one patch per cell, ``(~mask).sum()`` of them hatched; beyond, one image (a
    64 x 1024 batch draws in well under a second).  Returns ``ax``.

    >>> from matplotlib.figure import Figure
    >>> from packfwd.viz import lengths_mask
    >>> ax = draw_mask(Figure().subplots(), lengths_mask([3, 1]))
    >>> sum(bool(p.get_hatch()) for p in ax.patches)
    2
    """
    mask, what = mask_of(mask, "mask")
    b, s = mask.shape
    colours = sequence_colours(b)
    if b * s <= CELL_LIMIT and _cell_px(ax, s) >= 5:
        for i, row in enumerate(mask.tolist()):
            for k, valid in enumerate(row):
                cell(ax, k, i, colours[i], pad=not valid)
    else:
        cols, _ = max_columns(s)
        real = mask[:, cols].numpy()[..., None]
        grid_image(ax, np.where(real, np.asarray(colours)[:, None, :], np.asarray(PAD_RGBA)), width=s)
    grid_axes(ax, s, b, [f"row {i}" for i in range(b)])
    ax.set_xlabel("position s")
    real = int(mask.sum())
    wrapped_title(ax, f"{what} [b={b}, s={s}]: {real} real, {b * s - real} pad ({percent(b * s - real, b * s)})")
    return ax


def _cell_px(ax, columns: int) -> float:
    """How many pixels wide a cell of a grid of ``columns`` columns is drawn on ``ax`` (at the figure's dpi)."""
    return ax.get_window_extent().width / max(columns, 1)


def _rank_axes(ax_or_axes, cp: int) -> tuple[list, list[int]]:
    """Each CP rank's Axes and row in it: one Axes (a row per rank) or a sequence of ``cp`` Axes (one rank each)."""
    if hasattr(ax_or_axes, "add_patch"):
        return [ax_or_axes] * cp, list(range(cp))
    axes = list(ax_or_axes)
    if len(axes) != cp:
        raise ValueError(f"got {len(axes)} axes for cp_size={cp}; pass one Axes or exactly cp_size Axes")
    return axes, [0] * cp


def draw_thd(ax_or_axes, layout, tp_size: int | None = None, cp_size: int | None = None,
             seq_align: int | None = None):
    """Draw each CP rank's THD tensor (the layout of :func:`packfwd.to_thd`), a row per rank.

    ``layout``: sequence lengths, a ``[b, s]`` mask (with ``tp_size``, ``cp_size``, ``seq_align``; defaults 1, 1
    and packfwd's smallest alignment), or a plan that brings its own sizes: a ``ThdInfo`` of any rank, the list of
    every rank's ``ThdInfo``, an ``UnpadInfo``.

    One cell per local token, coloured by its sequence and named like ``a3`` (4th token of sequence ``a``) when a
    rank holds at most 48; padding hatched.  Black lines separate sequences; under CP a dotted line separates the
    two zigzag chunks a rank holds of each sequence, and where there is room the chunks are numbered (chunk ``k``
    of ``2 cp``; :func:`packfwd.viz.draw_zigzag` shows them all).  The x label gives the offsets in a rank's tensor
    (``local_cu_seqlens_padded``, the same on every rank).  With ``tp_size > 1`` dashed lines mark each TP rank's
    equal slice (sequence parallelism).  Past ``style.CELL_LIMIT`` cells, or cells under 7 pixels wide, the tokens
    are one image (padding light grey, no names).

    ``ax_or_axes``: one Axes (a row per CP rank) or a sequence of ``cp_size`` Axes (one rank each).
    Returns the list of Axes drawn on. The hatched cells, over all ranks, are the padding tokens:

    >>> from matplotlib.figure import Figure
    >>> axes = draw_thd(Figure().subplots(), [5, 3], cp_size=2)
    >>> sum(bool(p.get_hatch()) for p in axes[0].patches)   # 12 tokens for 8 real
    4
    """
    facts = thd_facts(layout, tp_size=tp_size, cp_size=cp_size, seq_align=seq_align)
    cp, local, n = facts.cp_size, facts.local_tokens, facts.n
    axes, rows = _rank_axes(ax_or_axes, cp)
    unique = list(dict.fromkeys(axes))
    colours = sequence_colours(n)
    small = local * len(axes) // len(unique) <= CELL_LIMIT and _cell_px(unique[0], local) >= 7
    label = small and local <= LABEL_LIMIT
    fontsize = 7 if local <= 24 else 5.5
    starts = np.concatenate([[0], np.cumsum(facts.padded // cp)])
    images: dict = {}
    for rank, (ax, row) in enumerate(zip(axes, rows)):
        seq, pos, real = facts.rank_tokens(rank)
        if small:
            for k in range(local):
                name = f"{sequence_name(int(seq[k]))}{pos[k]}" if label and real[k] else None
                cell(ax, k, row, colours[seq[k]], pad=not real[k], label=name, fontsize=fontsize)
        else:
            cols, _ = max_columns(local)
            rgba = np.where(real[cols, None], np.asarray(colours)[seq[cols]], np.asarray(PAD_RGBA))
            images.setdefault(id(ax), (ax, {}))[1][row] = rgba
        _rank_lines(ax, row, facts, starts, rank, chunk_numbers=not label)
    for ax, by_row in images.values():
        grid_image(ax, np.stack([by_row[r] for r in sorted(by_row)]), width=local)
    centres = (starts[:-1] + starts[1:]) / 2
    width = _cell_px(unique[0], local) * np.diff(starts)  # each sequence's pixels in a row
    named = width >= np.array([6 * len(sequence_name(i)) + 4 for i in range(n)])  # room for its name on top
    for ax in unique:
        ranks = [r for r, a in enumerate(axes) if a is ax]
        grid_axes(ax, local, len(ranks) if len(unique) == 1 else 1, [f"cp rank {r}" for r in ranks])
        ax.set_xticks([])
        if not label and ax is unique[0] and named.any():  # without token names: the sequences' names above
            ax.set_xticks(centres[named], [sequence_name(i) for i in np.flatnonzero(named)], fontsize=6)
            ax.tick_params(axis="x", top=True, labeltop=True, bottom=False, labelbottom=False, pad=1)
    # every rank's tensor has the same offsets: cu_seqlens_padded // cp
    unique[-1].set_xlabel(f"local token; local_cu_seqlens_padded (every rank) {short_ints(starts.tolist())}",
                          fontsize=7)
    title = (f"cu_seqlens {short_ints(facts.cu_seqlens)}   cu_seqlens_padded {short_ints(facts.cu_seqlens_padded)}\n"
             f"tp={facts.tp_size} cp={cp} align={facts.seq_align}: {facts.total_tokens} tokens for "
             f"{facts.real_tokens} real ({n} sequences, {local} per CP rank; light: padding)")
    wrapped_title(unique[0], title, fontsize=8)
    return unique


def _rank_lines(ax, row: int, facts, starts: np.ndarray, rank: int, *, chunk_numbers: bool) -> None:
    """Sequence edges (black), the boundary between a rank's two chunks of each sequence (dotted), TP slices
    (dashed) and, where a chunk is at least 14 pixels wide, its number."""
    import matplotlib.patheffects as effects

    cp, n = facts.cp_size, facts.n
    if n <= 512:
        ax.vlines(starts, row, row + 1, colors="black", linewidth=1.2)
    if cp > 1 and n <= 256:
        half = facts.chunk()
        ax.vlines(starts[:-1] + half, row + 0.15, row + 0.85, colors="black", linewidth=0.6, linestyles=":")
        if chunk_numbers:
            px = ax.get_window_extent().width / max(facts.local_tokens, 1)
            owned = [k for k in range(2 * cp) if facts.chunk_owner(k) == rank]  # [rank, 2 cp - 1 - rank]
            outline = [effects.withStroke(linewidth=2, foreground="white")]
            for i in np.flatnonzero(half * px >= 14):
                for h, k in enumerate(owned):
                    ax.text(starts[i] + (h + 0.5) * half[i], row + 0.5, str(k), ha="center", va="center",
                            fontsize=6.5, gid="chunk", path_effects=outline)
    if facts.tp_size > 1:
        step = facts.local_tokens // facts.tp_size
        ax.vlines([t * step for t in range(1, facts.tp_size)], row - 0.1, row + 1.1, colors="black",
                  linestyles="--", linewidth=1)


def draw_layer_partition(
    ax,
    num_layers,
    pp: int | None = None,
    vpp: int = 1,
    *,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
):
    """Draw :func:`packfwd.layer_partition` as a grid: a row per pipeline rank, a column per global layer.
    ``num_layers``: the layer count (with ``pp``, ``vpp`` and the uneven split), or a partition
    ``layer_partition(...)`` already made.

    Layer ``l`` is a cell in the row of the rank that builds it, coloured by its virtual stage (and numbered
    when there are few layers). ``num_layers`` patches in all. Returns ``ax``.

    >>> from matplotlib.figure import Figure
    >>> ax = draw_layer_partition(Figure().subplots(), 8, pp=2, vpp=2)
    >>> sorted((int(p.get_x()), int(p.get_y())) for p in ax.patches)[:4]   # (layer, pp rank)
    [(0, 0), (1, 0), (2, 1), (3, 1)]
    """
    from matplotlib.patches import Patch

    if isinstance(num_layers, (list, tuple)):  # a partition: [pp_rank][vpp_rank] -> range of global layers
        partition = num_layers
        if not partition or not all(isinstance(c, range) for chunks in partition for c in chunks):
            raise TypeError("num_layers is a list but not a partition; pass layer_partition(num_layers, pp, vpp) "
                            "(a list per pipeline rank of a range per virtual stage) or the layer count with pp")
        sizes = (("pp", pp, None), ("vpp", vpp, 1), ("first_stage_layers", first_stage_layers, None),
                 ("last_stage_layers", last_stage_layers, None))
        given = [f"{name}={value}" for name, value, default in sizes if value != default]
        if given:
            raise TypeError(f"num_layers is a partition, which has its own sizes, but {', '.join(given)} was passed "
                            "beside it; pass the partition alone, or the layer count with them: "
                            "draw_layer_partition(ax, 32, pp=4, vpp=2)")
        pp, vpp, num_layers = len(partition), len(partition[0]), sum(len(c) for chunks in partition for c in chunks)
    elif pp is None:
        raise TypeError("draw_layer_partition needs pp with a layer count: draw_layer_partition(ax, 32, pp=4), "
                        "or pass a partition: draw_layer_partition(ax, layer_partition(32, 4))")
    else:
        partition = layer_partition(
            num_layers, pp, vpp, first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers
        )
    label = num_layers <= LABEL_LIMIT
    for rank, chunks in enumerate(partition):
        for v, chunk in enumerate(chunks):
            for layer in chunk:
                cell(ax, layer, rank, _colour(v), pad=False, label=str(layer) if label else None, fontsize=6)
    grid_axes(ax, num_layers, pp, [f"pp rank {r}" for r in range(pp)])
    ax.set_xlabel("global layer")
    uneven = "".join(f", {n}={v}" for n, v in (("first", first_stage_layers), ("last", last_stage_layers)) if v)
    ax.set_title(f"{num_layers} layers, pp={pp}, vpp={vpp}{uneven}", fontsize=9)
    if vpp > 1:
        handles = [Patch(color=_colour(v), label=f"vpp stage {v}") for v in range(vpp)]
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return ax


def plot_padding_sweep(ax, lengths, tps: Sequence[int], cps: Sequence[int]):
    """Bar chart of the pad tokens THD adds to a batch, for every ``(tp, cp)`` in ``tps x cps``: packfwd's
    default alignment against verl's (:func:`packfwd.viz.text.verl_seq_align`). ``lengths``: sequence lengths, a
    ``[b, s]`` mask or a plan (its lengths). Bars ``2*i`` and ``2*i + 1`` of ``ax.patches`` are configuration
    ``i``'s packfwd and verl bars. Returns ``ax``.

    >>> from matplotlib.figure import Figure
    >>> ax = plot_padding_sweep(Figure().subplots(), [5, 17, 3], tps=[2], cps=[2])
    >>> [int(p.get_height()) for p in ax.patches]   # 32 - 25 and 40 - 25 pad tokens
    [7, 15]
    """
    configs = list(product(tps, cps))
    if not configs:
        raise ValueError("tps and cps must each hold at least one size, e.g. tps=[1, 2, 4], cps=[1, 2]")
    lengths = thd_facts(lengths, arg="lengths").lengths.tolist()
    rows = padding_sweep(lengths, tps, cps)
    real = sum(lengths)
    for i, row in enumerate(rows):
        ax.bar(i - 0.2, row["packfwd"] - real, width=0.4, color=_colour(0), label="packfwd default" if i == 0 else None)
        ax.bar(i + 0.2, row["verl"] - real, width=0.4, color=_colour(1), label="verl (2*tp*cp)" if i == 0 else None)
    ax.set_xticks(range(len(configs)), [f"tp{tp}\ncp{cp}" for tp, cp in configs], fontsize=7)
    ax.set_ylabel("pad tokens")
    wrapped_title(ax, f"THD padding for {len(lengths)} sequences, {real} real tokens")
    ax.legend(fontsize=7, frameon=False)
    return ax
