"""Matplotlib pictures of packfwd layouts, for notebooks: masks, THD tensors per CP rank, pipeline layer grids
and padding sweeps.

Every function draws on axes you pass in (``fig, ax = plt.subplots()`` or ``matplotlib.figure.Figure``) and
returns them; none calls ``plt.show`` or touches global state. One token or layer is one unit square: a cell
coloured by its sequence (or virtual stage), padding hatched; tokens are named as in :mod:`packfwd.viz.text`.
matplotlib is imported only inside the functions, so ``import packfwd.viz.plot`` works without it.
"""

from __future__ import annotations

from itertools import product
from typing import Sequence

import torch

from packfwd import layer_partition, to_thd

from .text import padding_sweep, thd_plans, token_codes, token_names

__all__ = ["draw_layer_partition", "draw_mask", "draw_thd", "plot_padding_sweep"]

PAD_HATCH = "///"
_LABEL_LIMIT = 48  # write token/layer names inside cells only up to this many columns


def _colour(i: int):
    import matplotlib

    return matplotlib.colormaps["tab10"](i % 10)


def _cell(ax, x: float, y: float, colour, *, pad: bool, label: str | None = None, fontsize: float = 7):
    """A unit square with its top-left corner at (x, y) (y grows downwards), hatched when it is padding."""
    from matplotlib.patches import Rectangle

    face = (*colour[:3], 0.25) if pad else colour
    ax.add_patch(Rectangle((x, y), 1, 1, facecolor=face, edgecolor="white", linewidth=0.8,
                           hatch=PAD_HATCH if pad else None))
    if label is not None:
        ax.text(x + 0.5, y + 0.5, label, ha="center", va="center", fontsize=fontsize,
                color="black" if pad else "white")


def _grid_axes(ax, width: int, height: int, ylabels: Sequence[str]) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(0, max(width, 1))
    ax.set_ylim(height, 0)  # row 0 on top
    ax.set_yticks([r + 0.5 for r in range(height)], list(ylabels))
    ax.tick_params(length=0)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)


def draw_mask(ax, mask: torch.Tensor):
    """Draw a ``[b, s]`` attention mask: row ``i``'s real tokens in sequence ``i``'s colour, padding hatched.

    One patch per cell, so ``b * s`` patches, ``(~mask).sum()`` of them hatched. Returns ``ax``.

    >>> from matplotlib.figure import Figure
    >>> from packfwd.viz import lengths_mask
    >>> ax = draw_mask(Figure().subplots(), lengths_mask([3, 1]))
    >>> sum(bool(p.get_hatch()) for p in ax.patches)
    2
    """
    mask = torch.as_tensor(mask).bool()
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D [b, s], got shape {tuple(mask.shape)}")
    b, s = mask.shape
    for i, row in enumerate(mask.tolist()):
        for k, valid in enumerate(row):
            _cell(ax, k, i, _colour(i), pad=not valid)
    _grid_axes(ax, s, b, [f"row {i}" for i in range(b)])
    ax.set_xlabel("position s")
    ax.set_title(f"attention_mask [b={b}, s={s}]: {int(mask.sum())} real, {int((~mask).sum())} pad", fontsize=9)
    return ax


def draw_thd(ax_or_axes, lengths: Sequence[int], tp_size: int = 1, cp_size: int = 1, seq_align: int | None = None):
    """Draw each CP rank's THD tensor for sequences of the given lengths (the layout of :func:`packfwd.to_thd`).

    One cell per local token, coloured by its sequence and named like ``a3`` (4th token of sequence ``a``);
    padding is hatched. Beside each row: that rank's offsets (``local_cu_seqlens_padded``); the title
    gives ``cu_seqlens`` and ``cu_seqlens_padded``. With ``tp_size > 1``, dashed lines mark the equal slices
    that sequence parallelism gives each TP rank.

    ``ax_or_axes``: one Axes (a row per CP rank) or a sequence of ``cp_size`` Axes (one rank each).
    Returns the list of Axes drawn on. The hatched cells, over all ranks, are the padding tokens:

    >>> from matplotlib.figure import Figure
    >>> axes = draw_thd(Figure().subplots(), [5, 3], cp_size=2)
    >>> sum(bool(p.get_hatch()) for p in axes[0].patches)   # 12 tokens for 8 real
    4
    """
    infos = thd_plans(lengths, tp_size=tp_size, cp_size=cp_size, seq_align=seq_align)
    if hasattr(ax_or_axes, "add_patch"):
        axes, rows = [ax_or_axes] * cp_size, list(range(cp_size))
    else:
        axes = list(ax_or_axes)
        if len(axes) != cp_size:
            raise ValueError(f"got {len(axes)} axes for cp_size={cp_size}; pass one Axes or exactly cp_size Axes")
        rows = [0] * cp_size
    codes, names = token_codes(lengths), token_names(lengths)
    label = infos[0].local_tokens <= _LABEL_LIMIT
    fontsize = 7 if infos[0].local_tokens <= 24 else 5.5
    for ax, row, info in zip(axes, rows, infos):
        tokens = to_thd(codes, info)[0].tolist()
        bounds = info.local_cu_seqlens_padded.tolist()
        for seq, (a, b) in enumerate(zip(bounds, bounds[1:])):
            for k in range(a, b):
                pad = tokens[k] == 0
                _cell(ax, k, row, _colour(seq), pad=pad, label=names[tokens[k]] if label and not pad else None,
                      fontsize=fontsize)
        for edge in bounds:
            ax.plot([edge, edge], [row, row + 1], color="black", linewidth=1.5)
        if tp_size > 1:
            step = info.local_tokens // tp_size
            for t in range(1, tp_size):
                ax.plot([t * step] * 2, [row - 0.1, row + 1.1], color="black", linestyle="--", linewidth=1)
        ax.text(info.local_tokens + 0.3, row + 0.5, f"local cu_seqlens_padded {bounds}", va="center", fontsize=7)
    first = infos[0]
    title = (f"cu_seqlens {first.cu_seqlens.tolist()}   cu_seqlens_padded {first.cu_seqlens_padded.tolist()}\n"
             f"tp={tp_size} cp={cp_size} align={first.seq_align}: {first.total_tokens} tokens for "
             f"{sum(lengths)} real")
    unique = list(dict.fromkeys(axes))
    for ax in unique:
        width = first.local_tokens + max(10, first.local_tokens // 3)  # room for the offsets text
        ranks = [r for r, a in enumerate(axes) if a is ax]
        _grid_axes(ax, width, len(ranks) if len(unique) == 1 else 1, [f"cp rank {r}" for r in ranks])
        ax.set_xticks([])
    unique[0].set_title(title, fontsize=8)
    return unique


def draw_layer_partition(
    ax,
    num_layers: int,
    pp: int,
    vpp: int = 1,
    *,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
):
    """Draw :func:`packfwd.layer_partition` as a grid: a row per pipeline rank, a column per global layer.

    Layer ``l`` is a cell in the row of the rank that builds it, coloured by its virtual stage (and numbered
    when there are few layers). ``num_layers`` patches in all. Returns ``ax``.

    >>> from matplotlib.figure import Figure
    >>> ax = draw_layer_partition(Figure().subplots(), 8, pp=2, vpp=2)
    >>> sorted((int(p.get_x()), int(p.get_y())) for p in ax.patches)[:4]   # (layer, pp rank)
    [(0, 0), (1, 0), (2, 1), (3, 1)]
    """
    from matplotlib.patches import Patch

    partition = layer_partition(
        num_layers, pp, vpp, first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers
    )
    label = num_layers <= _LABEL_LIMIT
    for rank, chunks in enumerate(partition):
        for v, chunk in enumerate(chunks):
            for layer in chunk:
                _cell(ax, layer, rank, _colour(v), pad=False, label=str(layer) if label else None, fontsize=6)
    _grid_axes(ax, num_layers, pp, [f"pp rank {r}" for r in range(pp)])
    ax.set_xlabel("global layer")
    uneven = "".join(f", {n}={v}" for n, v in (("first", first_stage_layers), ("last", last_stage_layers)) if v)
    ax.set_title(f"{num_layers} layers, pp={pp}, vpp={vpp}{uneven}", fontsize=9)
    if vpp > 1:
        handles = [Patch(color=_colour(v), label=f"vpp stage {v}") for v in range(vpp)]
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return ax


def plot_padding_sweep(ax, lengths: Sequence[int], tps: Sequence[int], cps: Sequence[int]):
    """Bar chart of the pad tokens THD adds to a batch, for every ``(tp, cp)`` in ``tps x cps``: packfwd's
    default alignment against verl's (:func:`packfwd.viz.text.verl_seq_align`). Bars ``2*i`` and ``2*i + 1`` of
    ``ax.patches`` are configuration ``i``'s packfwd and verl bars. Returns ``ax``.

    >>> from matplotlib.figure import Figure
    >>> ax = plot_padding_sweep(Figure().subplots(), [5, 17, 3], tps=[2], cps=[2])
    >>> [int(p.get_height()) for p in ax.patches]   # 32 - 25 and 40 - 25 pad tokens
    [7, 15]
    """
    configs = list(product(tps, cps))
    if not configs:
        raise ValueError("tps and cps must each hold at least one size, e.g. tps=[1, 2, 4], cps=[1, 2]")
    rows = padding_sweep(lengths, tps, cps)
    real = sum(lengths)
    for i, row in enumerate(rows):
        ax.bar(i - 0.2, row["packfwd"] - real, width=0.4, color=_colour(0), label="packfwd default" if i == 0 else None)
        ax.bar(i + 0.2, row["verl"] - real, width=0.4, color=_colour(1), label="verl (2*tp*cp)" if i == 0 else None)
    ax.set_xticks(range(len(configs)), [f"tp{tp}\ncp{cp}" for tp, cp in configs], fontsize=7)
    ax.set_ylabel("pad tokens")
    ax.set_title(f"THD padding for {len(lengths)} sequences, {real} real tokens", fontsize=9)
    ax.legend(fontsize=7, frameon=False)
    return ax
