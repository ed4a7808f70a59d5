"""Row gathers and scatters shared by every layout.

Each packfwd layout is the same two moves over the token ("row") dimension of a flattened tensor:

* gather: ``out[j] = src[index[j]]`` and then zero the rows that are padding in the new layout;
* scatter: ``canvas[dst[j]] = y[j]`` onto a canvas filled at the positions nothing writes.

Both are written as one index kernel plus one small fill, on freshly allocated tensors, so applying a plan
reads each real row once and writes each output row once. Fresh tensors come from ``new_empty`` so that under
``torch.func.vmap`` they carry the batch dimension and the in-place writes stay legal.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def static_nonzero(flags: Tensor, size: int, fill: int) -> Tensor:
    """Positions of the true entries of 1-D ``flags``, padded with ``fill`` to exactly ``size`` entries.

    ``torch.nonzero`` must learn its output size from the device (a host sync); here the caller already knows it,
    so this is a cumsum and a scatter with a static shape.
    """
    flags = flags.reshape(-1)
    if size == 0:
        return torch.empty(0, dtype=torch.long, device=flags.device)
    slot = torch.cumsum(flags, 0, dtype=torch.long) - 1
    # Entries that are not selected (or beyond `size`) all land in one spare slot that is cut off below.
    slot = torch.where(flags & (slot < size), slot, size)
    out = torch.full((size + 1,), fill, dtype=torch.long, device=flags.device)
    out.scatter_(0, slot, torch.arange(flags.numel(), device=flags.device))
    return out[:size]


def gather_rows(src: Tensor, index: Tensor, zero_rows: Tensor) -> Tensor:
    """``src[index]`` along dim 0, then rows ``zero_rows`` set to zero.  src: [n, *] -> [len(index), *]."""
    out = src.index_select(0, index)
    if zero_rows.numel():
        out.index_fill_(0, zero_rows, 0)
    return out


def scatter_rows(
    ys: Sequence[Tensor], dsts: Sequence[Tensor], canvas_rows: int, fill_rows: Tensor, fill_value: float
) -> Tensor:
    """Write each ``ys[k]`` at rows ``dsts[k]`` of a new ``[canvas_rows, *]`` tensor; ``fill_rows`` get ``fill_value``.

    A destination equal to ``canvas_rows`` means "drop this row" (a padding row of the source layout): such rows go
    to one spare row past the end, which is cut off, so they never reach the result nor receive gradient.
    """
    y0 = ys[0]
    canvas = y0.new_empty((canvas_rows + 1, *y0.shape[1:]))
    if fill_rows.numel():
        canvas.index_fill_(0, fill_rows, fill_value)
    for y, dst in zip(ys, dsts):
        canvas.index_put_((dst,), y)  # index_put_ (unlike index_copy_) has a vmap batching rule
    return canvas[:canvas_rows]


def host_ints(values: Sequence[Tensor]) -> list[int]:
    """Bring a few device scalars to the host in one transfer: the planning step's single sync."""
    if not values:
        return []
    flat = torch.cat([v.reshape(-1).to(torch.long) for v in values])
    return flat.tolist()
