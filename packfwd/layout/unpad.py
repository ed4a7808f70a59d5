"""``unpad`` / ``pad``: a padded batch ``[b, s, *]`` with its mask to packed real tokens ``[t, *]`` and back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch
from torch import Tensor

from ..ops import plan as plan_kernel
from ..ops.gather import gather_rows
from . import display
from .source import PlanOfSource, TokenSource, canvas_rows_of, checked_lengths, cumsum0, from_canvas, padded_source, plan, scatter_inverse


@dataclass(frozen=True)
class UnpadInfo(PlanOfSource):
    """The plan of ``unpad``: where each packed token came from.

    ``cu_seqlens`` ([b+1] int32) are the offsets of each row's tokens in the packed tensor; ``max_seqlen`` is the
    longest row (a Python int); ``total`` is ``t``.
    """

    source: TokenSource
    max_seqlen: int
    index: Tensor  # [t] int64, canvas row of each packed token
    inverse: Tensor  # [canvas_rows] int64, packed row of each canvas row (-1 at padding)

    @property
    def cu_seqlens(self) -> Tensor:
        return self.source.cu_seqlens

    @property
    def indices(self) -> Tensor:
        """[t] int64: the flat position ``row * s + col`` of each packed token."""
        return self.index

    @property
    def total(self) -> int:
        return self.source.total

    def __repr__(self) -> str:  # for people: counts, cu_seqlens and shapes, not the index tensors (one host read)
        return display.describe_plan(self)

    def _repr_html_(self) -> str:  # a notebook's table and picture
        return display.plan_html(self)

    token_dims: ClassVar[int] = 1  # the packed tensor is [t, *]

    def pack_tokens(self, x: Tensor) -> Tensor:
        """``unpad(x, self)[0]``: per-token data ``[b, s, *]`` (or nested) -> ``[t, *]``."""
        return unpad(x, self)[0]

    def unpack_tokens(self, y: Tensor | Sequence[Tensor], fill_value: float = 0) -> Tensor:
        """``pad(y, self, fill_value)``: ``[t, *]`` (or a list of that one tensor) -> ``[b, s, *]``."""
        return pad(one_tensor(y, "unpad"), self, fill_value)


def plan_unpad(attention_mask: Tensor | None, *, seqlens=None, x: Tensor | None = None) -> UnpadInfo:
    """Plan ``unpad`` from a ``[b, s]`` mask (bool or integer 0/1), or from a jagged nested ``x``.

    One host sync learns the lengths; none when the mask is on the CPU or ``seqlens`` (host ints) is given.

    >>> import torch
    >>> info = plan_unpad(torch.tensor([[1, 1, 0], [0, 1, 1]]))
    >>> info.cu_seqlens.tolist(), info.max_seqlen, info.indices.tolist()
    ([0, 2, 4], 2, [0, 1, 4, 5])
    """

    def host_layout(lengths):  # unpad's index function: row i's tokens start at cu_seqlens[i]
        return [_longest(lengths)], [cumsum0(lengths)[:-1] - 1]

    def build(source, ints, arrays):
        (max_seqlen,), (row_offset,) = ints, arrays
        if source.nested_offsets is not None:  # the nested values are the packed tensor already
            index = torch.arange(source.total, device=source.lengths.device)
            return UnpadInfo(source=source, max_seqlen=max_seqlen, index=index, inverse=index)
        inverse = source.where_real(source.rank_in_row(row_offset), -1)
        if hasattr(torch, "nonzero_static"):
            index = torch.nonzero_static(source.mask.reshape(-1), size=source.total).reshape(-1)
        else:
            index = scatter_inverse(inverse, source.total, source.canvas_rows)
        return UnpadInfo(source=source, max_seqlen=max_seqlen, index=index, inverse=inverse)

    def device_plan(src):  # CUDA: one kernel
        out = plan_kernel.plan_rows(plan_kernel.UNPAD, src.mask, checked_lengths(src), total=int(src.host.sum()))
        return UnpadInfo(source=padded_source(src, out["cu_seqlens"]), max_seqlen=_longest(src.host),
                         index=out["index"], inverse=out["inverse"])

    return plan(x, attention_mask, seqlens, host_layout=host_layout, build=build, device_plan=device_plan)


def _longest(lengths) -> int:
    return int(lengths.max()) if lengths.size else 0


def unpad(x: Tensor, attention_mask: Tensor | UnpadInfo, *, seqlens=None) -> tuple[Tensor, UnpadInfo]:
    """Gather the real tokens of ``x: [b, s, *]`` into ``[t, *]``, row after row, in order.

    ``attention_mask`` may be a plan from ``plan_unpad`` to skip planning. Any mask pattern works: right or left
    padding, holes, empty rows.

    >>> import torch
    >>> x = torch.tensor([[1, 2, 0], [0, 3, 4]])
    >>> packed, info = unpad(x, x != 0)
    >>> packed.tolist()
    [1, 2, 3, 4]
    >>> pad(packed * 10, info).tolist()
    [[10, 20, 0], [0, 30, 40]]
    """
    if isinstance(attention_mask, UnpadInfo) and seqlens is not None:
        raise TypeError("unpad got an UnpadInfo plan and seqlens; pass one or the other (the plan has the lengths)")
    info = attention_mask if isinstance(attention_mask, UnpadInfo) else plan_unpad(attention_mask, seqlens=seqlens, x=x)
    return gather_rows([canvas_rows_of(x, info.source)], info.index, info.inverse, dense=True), info


def one_tensor(y: Tensor | Sequence[Tensor], what: str) -> Tensor:
    """``y``, or the one tensor of a list: the packed tensor of a ``what`` plan, which is not split over CP ranks."""
    if isinstance(y, (list, tuple)):
        if len(y) != 1:
            raise ValueError(f"got {len(y)} tensors but a {what} plan takes one (a list is for the CP ranks of a THD "
                             "plan with cp_size > 1); pass the one packed tensor")
        y = y[0]
    return y


def pad(packed: Tensor, info: UnpadInfo, fill_value: float = 0) -> Tensor:
    """The inverse of ``unpad``: ``[t, *]`` back to ``[b, s, *]`` with ``fill_value`` at padded positions.

    >>> import torch
    >>> mask = torch.tensor([[0, 1, 1], [1, 0, 1]])
    >>> packed, info = unpad(torch.tensor([[9, 1, 2], [3, 9, 4]]), mask)
    >>> pad(packed.float() / 2, info, fill_value=-1).tolist()
    [[-1.0, 0.5, 1.0], [1.5, -1.0, 2.0]]
    """
    src = info.source
    if packed.shape[0] != src.total:
        raise ValueError(f"packed has {packed.shape[0]} tokens but the plan has {src.total}; pass unpad's output")
    return from_canvas(gather_rows([packed], info.inverse, info.index, fill_value, expand=True), src)
