"""Pictures of multimodal (3-D) RoPE positions: a text+image+video batch's ``(t, h, w)`` per token
(:func:`packfwd.vision.mrope_position_ids`), and the same coordinates after a THD plan splits the tokens over
context-parallel ranks (:func:`packfwd.pack_positions`).

Each token is a column of three unit cells (t, h, w), labelled with the coordinate.  Image and video tokens are
coloured per item (the k-th image or video of the batch, numbered together in order of appearance), text light
grey, padding hatched.  Like :mod:`packfwd.viz.plot`, every function draws on the axes it is given, returns them
and imports matplotlib only when it runs.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from packfwd import pack_positions, plan_thd, to_thd

from .style import LABEL_LIMIT as _LABEL_LIMIT
from .style import cell as _cell
from .style import grid_axes as _grid_axes

__all__ = ["vision_items", "draw_mrope_positions", "draw_mrope_cp_split"]

TEXT = (0.82, 0.82, 0.82, 1.0)
_PALETTE = [0, 1, 2, 3, 4, 5, 6, 8, 9]  # tab10 without its grey (text is grey)


def _item_colour(item: int):
    import matplotlib

    return TEXT if item < 0 else matplotlib.colormaps["tab10"](_PALETTE[item % len(_PALETTE)])


def vision_items(input_ids: Tensor, attention_mask: Tensor | None = None, *, image_token_id: int,
                 video_token_id: int) -> tuple[Tensor, list[str]]:
    """``[b, s]`` long: the item of each real image/video token (a new item at each run of image or video tokens,
    numbered over the batch in order), -1 at text and padding; and each item's name (``"image 0"``, ``"video 0"``).

    >>> import torch
    >>> ids = torch.tensor([[1, 5, 5, 2, 6, 6, 6], [1, 5, 2, 0, 0, 0, 0]])
    >>> items, names = vision_items(ids, ids != 0, image_token_id=5, video_token_id=6)
    >>> items.tolist(), names
    ([[-1, 0, 0, -1, 1, 1, 1], [-1, 2, -1, -1, -1, -1, -1]], ['image 0', 'video 0', 'image 1'])
    """
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    kind = torch.where(input_ids == image_token_id, 1, torch.where(input_ids == video_token_id, 2, 0)) * real
    prev = torch.nn.functional.pad(kind[:, :-1], (1, 0))
    start = (kind > 0) & (kind != prev)
    items = torch.where(kind > 0, start.reshape(-1).cumsum(0).reshape(kind.shape) - 1, -1)
    kinds = kind[start].tolist()
    names = [f"{'image' if k == 1 else 'video'} {kinds[:i].count(k)}" for i, k in enumerate(kinds)]
    return items, names


def _legend(ax, names: Sequence[str]) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=TEXT, label="text")] + [Patch(color=_item_colour(i), label=n) for i, n in enumerate(names)]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def _draw_block(ax, y: int, coords: list[list[int]], items: list[int], label: bool, fontsize: float) -> None:
    """Three rows (t, h, w) from ``y``: one column per token; ``items[k]`` -2 marks padding."""
    for c in range(3):
        for k, (value, item) in enumerate(zip(coords[c], items)):
            pad = item == -2
            _cell(ax, k, y + c, _item_colour(max(item, -1)), pad=pad)
            if label and not pad:  # dark on grey text cells, white on coloured items
                ax.text(k + 0.5, y + c + 0.5, str(value), ha="center", va="center", fontsize=fontsize,
                        color="black" if item < 0 else "white")


def draw_mrope_positions(ax, positions: Tensor, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                         image_token_id: int, video_token_id: int, rows: Sequence[int] | None = None):
    """Draw ``positions [3, b, s]`` of the batch rows ``rows`` (all by default): rows ``t``, ``h``, ``w`` per
    batch row, one column per position ``s``, ``3 * len(rows) * s`` cells.  Returns ``ax``.

    >>> import torch
    >>> from matplotlib.figure import Figure
    >>> from packfwd.vision import mrope_position_ids
    >>> ids = torch.tensor([[7, 3, 5, 5, 5, 5, 8]])
    >>> pos, _ = mrope_position_ids(ids, image_grid_thw=torch.tensor([[1, 4, 4]]), image_token_id=5,
    ...                             video_token_id=6, vision_start_token_id=3)
    >>> ax = draw_mrope_positions(Figure().subplots(), pos, ids, image_token_id=5, video_token_id=6)
    >>> [t.get_text() for t in ax.texts][7:14]     # the h row
    ['0', '1', '2', '2', '3', '3', '4']
    """
    items, names = vision_items(input_ids, attention_mask, image_token_id=image_token_id, video_token_id=video_token_id)
    real = torch.ones_like(items, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    items = torch.where(real, items, -2)
    rows = list(range(items.shape[0])) if rows is None else list(rows)
    s = items.shape[1]
    for j, i in enumerate(rows):
        _draw_block(ax, 4 * j, positions[:, i].tolist(), items[i].tolist(), s <= _LABEL_LIMIT, 6.5)
    ylabels = [f"row {i}  {c}" if c == "t" else c for i in rows for c in ("t", "h", "w", "")][:-1]
    _grid_axes(ax, s, max(4 * len(rows) - 1, 1), ylabels)
    ax.set_xlabel("position s")
    ax.set_title(f"mrope positions [3, b={items.shape[0]}, s={s}]: (t, h, w) per token", fontsize=9)
    _legend(ax, names)
    return ax


def draw_mrope_cp_split(ax, positions: Tensor, input_ids: Tensor, attention_mask: Tensor, *, image_token_id: int,
                        video_token_id: int, cp_size: int, tp_size: int = 1, seq_align: int | None = None):
    """Draw each CP rank's THD tokens (``plan_thd(attention_mask, tp_size, cp_size, cp_rank=r, seq_align)``) with
    their three coordinates as packed by :func:`packfwd.pack_positions`: a block of rows t, h, w per rank, a
    column per local token, black lines between sequences.  Returns ``ax``.

    >>> import torch
    >>> from matplotlib.figure import Figure
    >>> ids = torch.tensor([[7, 3, 5, 5, 5, 5, 8]])
    >>> pos = torch.arange(7).expand(3, 1, 7)
    >>> ax = draw_mrope_cp_split(Figure().subplots(), pos, ids, ids > 0, image_token_id=5, video_token_id=6,
    ...                          cp_size=2)
    >>> [t.get_text() for t in ax.texts][:4], len(ax.patches)   # rank 0: chunks 0 and 3 of 8 padded tokens
    (['0', '1', '6', '0'], 24)
    """
    items, names = vision_items(input_ids, attention_mask, image_token_id=image_token_id, video_token_id=video_token_id)
    width = 0
    for rank in range(cp_size):
        info = plan_thd(attention_mask, tp_size=tp_size, cp_size=cp_size, cp_rank=rank, seq_align=seq_align)
        local = pack_positions(positions, info).tolist()  # [3, t_local]
        owned = (to_thd(items + 2, info)[0] - 2).tolist()  # -2 at the layout's padding
        width = info.local_tokens
        _draw_block(ax, 4 * rank, local, owned, width <= _LABEL_LIMIT, 6.5)
        for edge in info.local_cu_seqlens_padded.tolist():
            ax.plot([edge, edge], [4 * rank, 4 * rank + 3], color="black", linewidth=1.5)
    ylabels = [f"cp rank {r}  {c}" if c == "t" else c for r in range(cp_size) for c in ("t", "h", "w", "")][:-1]
    _grid_axes(ax, width, 4 * cp_size - 1, ylabels)
    ax.set_xlabel("local token")
    ax.set_title(f"THD over cp={cp_size} (tp={tp_size}): each rank's tokens keep their (t, h, w)", fontsize=9)
    _legend(ax, names)
    return ax
