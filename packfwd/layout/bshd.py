"""``to_bshd`` / ``from_bshd``: each row's real tokens moved to the left of a narrower padded batch.

For models that take a dense ``[b, s, *]`` batch (BSHD attention with a causal mask), this drops the columns
that are padding in every row and puts left-padded or holed rows in the right-padded form such models assume.
The width is the longest row rounded up to a multiple of ``tp_size`` (sequence parallelism splits it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import numpy as np
import torch
from torch import Tensor

from .._validate import check_positive_int
from .positions import pack_positions
from .rules import round_up
from .unpad import one_tensor
from ..ops import plan as plan_kernel
from ..ops.gather import gather_rows
from . import display
from .source import PlanOfSource, canvas_rows_of, checked_lengths, from_canvas, padded_source, plan, scatter_inverse, TokenSource


@dataclass(frozen=True)
class BshdInfo(PlanOfSource):
    """The plan of ``to_bshd``: ``width`` columns per row; ``attention_mask`` [b, width] bool of the result."""

    source: TokenSource
    width: int
    tp_size: int
    attention_mask: Tensor  # [b, width] bool, left-aligned
    index: Tensor  # [b*width] canvas row of each output slot (-1 at padding)
    inverse: Tensor  # [canvas_rows] output slot of each canvas row (-1 at padding)

    @property
    def cu_seqlens(self) -> Tensor:
        return self.source.cu_seqlens

    def __repr__(self) -> str:  # for people: counts, cu_seqlens and shapes, not the index tensors (one host read)
        return display.describe_plan(self)

    def _repr_html_(self) -> str:  # a notebook's table and picture
        return display.plan_html(self)

    token_dims: ClassVar[int] = 2  # the packed tensor is [b, width, *]

    def pack_tokens(self, x: Tensor) -> Tensor:
        """``to_bshd(x, self)[0]``: per-token data ``[b, s, *]`` (or nested) -> ``[b, width, *]``."""
        return to_bshd(x, self)[0]

    def unpack_tokens(self, y: Tensor | Sequence[Tensor], fill_value: float = 0) -> Tensor:
        """``from_bshd``: ``[b, width, *]`` (or a list of that one tensor) -> ``[b, s, *]``."""
        return from_bshd(one_tensor(y, "BSHD"), self, fill_value)

    # A model that embeds before packing (a vision model, ``make_forward(vision=True)``) is given this layout's
    # ids: every row stays whole (compacted), so every image does too.
    def inputs_to_embed(self, input_ids: Tensor, ids: Tensor, attention_mask, position_ids):
        """The ``(input_ids, attention_mask, position_ids)`` such a model is given: ``ids`` (``[b, width]``, packed
        from ``input_ids`` by this plan), the plan's mask (in ``attention_mask``'s dtype) and positions packed."""
        mask = self.attention_mask if attention_mask is None else self.attention_mask.to(attention_mask.dtype)
        return ids, mask, None if position_ids is None else pack_positions(position_ids, self)

    def decoder_input(self, x: Tensor) -> Tensor:
        """Its embeddings ``[b, width, h]`` -> Megatron-Core's ``decoder_input`` ``[width, b, h]``."""
        want = (self.batch_size, self.width)
        if not isinstance(x, Tensor) or x.dim() < 2 or tuple(x.shape[:2]) != want:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x has shape {got}; pass embeddings of the compacted batch the model was given: "
                             f"[{want[0]}, {want[1]}, ...]")
        return x.transpose(0, 1)

    def decoder_positions(self, positions: Tensor) -> Tensor:
        """Its positions, computed on the compacted ids it was given: ``[3, b, width]`` / ``[b, width]``, as is."""
        want = (self.batch_size, self.width)
        if positions.dim() not in (2, 3) or tuple(positions.shape[-2:]) != want:
            raise ValueError(f"positions has shape {tuple(positions.shape)}; a BSHD model computes them on the "
                             f"compacted ids it was given: [3, {want[0]}, {want[1]}] or {list(want)}")
        return positions

    def padding_mask(self) -> Tensor:
        """[b, width] bool, True at padding slots: Megatron-Core's MoE ``padding_mask`` (no sync)."""
        return ~self.attention_mask


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

    def host_layout(lengths):  # bshd's index function: row i's tokens start at slot i * width
        width = _width(lengths, tp_size)
        return [width], [np.arange(lengths.size) * width - 1]

    def build(source, ints, arrays):
        (width,), (row_offset,) = ints, arrays
        inverse = source.where_real(source.rank_in_row(row_offset), -1)
        col = torch.arange(width, device=source.lengths.device)
        return BshdInfo(
            source=source, width=width, tp_size=tp_size, attention_mask=col[None, :] < source.lengths[:, None],
            index=scatter_inverse(inverse, source.batch_size * width, source.canvas_rows), inverse=inverse,
        )

    def device_plan(src):  # CUDA: one kernel
        width = _width(src.host, tp_size)
        out = plan_kernel.plan_rows(
            plan_kernel.BSHD, src.mask, checked_lengths(src), total=src.mask.shape[0] * width, width=width
        )
        return BshdInfo(
            source=padded_source(src, out["cu_seqlens"]), width=width, tp_size=tp_size,
            attention_mask=out["attention_mask"], index=out["index"], inverse=out["inverse"],
        )

    return plan(x, attention_mask, seqlens, host_layout=host_layout, build=build, device_plan=device_plan)


def _width(lengths: np.ndarray, tp_size: int) -> int:
    """The longest row rounded up to a multiple of ``tp_size`` (sequence parallelism splits the width)."""
    return int(round_up(lengths.max(), tp_size)) if lengths.size else 0


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
        given = [f"tp_size={tp_size!r}"] * (tp_size != 1) + [f"seqlens={seqlens!r}"] * (seqlens is not None)
        if given:
            raise TypeError(f"to_bshd got a BshdInfo plan and planning arguments {given}; pass one or the other (the "
                            f"plan has tp_size={attention_mask.tp_size})")
        info = attention_mask
    else:
        info = plan_bshd(attention_mask, tp_size=tp_size, seqlens=seqlens, x=x)
    b = info.source.batch_size
    out = gather_rows([canvas_rows_of(x, info.source)], info.index, info.inverse)
    return out.reshape(b, info.width, *out.shape[1:]), info


def from_bshd(y: Tensor, info: BshdInfo, fill_value: float = 0) -> Tensor:
    """The inverse of ``to_bshd``: ``[b, width, *] -> [b, s, *]`` with ``fill_value`` at padded positions.

    >>> import torch
    >>> x = torch.tensor([[0, 0, 5, 6], [7, 0, 8, 0]])
    >>> y, info = to_bshd(x, x != 0)
    >>> from_bshd(y + 1, info, fill_value=-1).tolist()
    [[-1, -1, 6, 7], [8, -1, 9, -1]]
    """
    b = info.source.batch_size
    if y.dim() < 2 or tuple(y.shape[:2]) != (b, info.width):
        raise ValueError(
            f"y has shape {tuple(y.shape)} but the plan expects [{b}, {info.width}, ...]; pass the model output for "
            "exactly the batch to_bshd produced"
        )
    rows = y.reshape(b * info.width, *y.shape[2:])
    return from_canvas(gather_rows([rows], info.inverse, info.index, fill_value, expand=True), info.source)
