"""``to_bshd`` / ``from_bshd``: each row's real tokens moved to the left of a narrower padded batch.

For models that take a dense ``[b, s, *]`` batch (BSHD attention with a causal mask), this drops the columns
that are padding in every row and puts left-padded or holed rows in the right-padded form such models assume.
The width is the longest row rounded up to a multiple of ``tp_size`` (sequence parallelism splits it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ._checks import check_positive_int
from ._rows import gather_rows, scatter_rows, static_nonzero
from ._source import TokenSource, canvas_rows_of, from_canvas, plan_source


@dataclass(frozen=True)
class BshdInfo:
    """The plan of ``to_bshd``: ``width`` columns per row; ``attention_mask`` [b, width] bool of the result."""

    source: TokenSource
    width: int
    tp_size: int
    attention_mask: Tensor  # [b, width] bool, left-aligned
    gather_index: Tensor  # [b*width] canvas row of each output slot (0 at padding)
    zero_rows: Tensor  # output slots that are padding
    scatter_index: Tensor  # [b*width] canvas row of each slot (canvas_rows at padding)

    @property
    def cu_seqlens(self) -> Tensor:
        return self.source.cu_seqlens


def plan_bshd(
    attention_mask: Tensor | None, *, tp_size: int = 1, seqlens: Sequence[int] | None = None, x: Tensor | None = None
) -> BshdInfo:
    """Plan ``to_bshd``.  One host sync learns the widest row; none with host ``seqlens`` or a CPU mask.

    >>> import torch
    >>> info = plan_bshd(torch.tensor([[0, 0, 1, 1], [1, 0, 1, 0]]), tp_size=1)
    >>> info.width, info.attention_mask.int().tolist()
    (2, [[1, 1], [1, 1]])
    """
    tp_size = check_positive_int("tp_size", tp_size)

    def scalars(lengths: Tensor) -> list[Tensor]:
        longest = lengths.max() if lengths.numel() else lengths.sum()
        return [(longest + tp_size - 1) // tp_size * tp_size]

    source, (width,) = plan_source(x, attention_mask, seqlens, scalars)
    b = source.batch_size
    col = torch.arange(width, device=source.lengths.device)
    mask = col[None, :] < source.lengths[:, None]  # [b, width]
    k = (source.cu_seqlens[:-1].long()[:, None] + col[None, :]).clamp(max=max(source.total - 1, 0))
    index = source.index if source.total else torch.zeros(1, dtype=torch.long, device=col.device)
    rows = index[k].reshape(-1)
    flat = mask.reshape(-1)
    return BshdInfo(
        source=source,
        width=width,
        tp_size=tp_size,
        attention_mask=mask,
        gather_index=torch.where(flat, rows, 0),
        zero_rows=static_nonzero(~flat, b * width - source.total, 0),
        scatter_index=torch.where(flat, rows, source.canvas_rows),
    )


def to_bshd(
    x: Tensor, attention_mask: Tensor | BshdInfo | None = None, *, tp_size: int = 1, seqlens=None
) -> tuple[Tensor, BshdInfo]:
    """``x: [b, s, *] -> [b, width, *]`` with each row's real tokens first, in order, zeros after.

    >>> import torch
    >>> x = torch.tensor([[0, 0, 5, 6], [7, 0, 8, 0]])
    >>> y, info = to_bshd(x, x != 0)
    >>> y.tolist()
    [[5, 6], [7, 8]]
    >>> from_bshd(y, info).tolist()
    [[0, 0, 5, 6], [7, 0, 8, 0]]
    """
    if isinstance(attention_mask, BshdInfo):
        info = attention_mask
    else:
        info = plan_bshd(attention_mask, tp_size=tp_size, seqlens=seqlens, x=x)
    b = info.source.batch_size
    out = gather_rows(canvas_rows_of(x, info.source), info.gather_index, info.zero_rows)
    return out.reshape(b, info.width, *out.shape[1:]), info


def from_bshd(y: Tensor, info: BshdInfo, fill_value: float = 0) -> Tensor:
    """The inverse of ``to_bshd``: ``[b, width, *] -> [b, s, *]`` with ``fill_value`` at padded positions."""
    b = info.source.batch_size
    if y.dim() < 2 or tuple(y.shape[:2]) != (b, info.width):
        raise ValueError(
            f"y has shape {tuple(y.shape)} but the plan expects [{b}, {info.width}, ...]; pass the model output for "
            "exactly the batch to_bshd produced"
        )
    rows = y.reshape(b * info.width, *y.shape[2:])
    canvas = scatter_rows([rows], [info.scatter_index], info.source.canvas_rows, info.source.fill_rows, fill_value)
    return from_canvas(canvas, info.source)
