"""``unpad`` / ``pad``: a padded batch ``[b, s, *]`` with its mask to packed real tokens ``[t, *]`` and back."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ._rows import gather_rows, scatter_rows
from ._source import TokenSource, canvas_rows_of, from_canvas, plan_source


@dataclass(frozen=True)
class UnpadInfo:
    """The plan of ``unpad``: where each packed token came from.

    ``cu_seqlens`` ([b+1] int32) are the offsets of each row's tokens in the packed tensor; ``max_seqlen`` is the
    longest row (a Python int); ``total`` is ``t``.
    """

    source: TokenSource
    max_seqlen: int

    @property
    def cu_seqlens(self) -> Tensor:
        return self.source.cu_seqlens

    @property
    def indices(self) -> Tensor:
        """[t] int64: the flat position ``row * s + col`` of each packed token."""
        return self.source.index

    @property
    def batch_size(self) -> int:
        return self.source.batch_size

    @property
    def seq_len(self) -> int:
        return self.source.seq_len

    @property
    def total(self) -> int:
        return self.source.total


def plan_unpad(attention_mask: Tensor | None, *, seqlens=None, x: Tensor | None = None) -> UnpadInfo:
    """Plan ``unpad`` from a ``[b, s]`` mask (bool or integer 0/1), or from a jagged nested ``x``.

    One host sync learns the token count; none when the mask is on the CPU or ``seqlens`` (host ints) is given.

    >>> import torch
    >>> info = plan_unpad(torch.tensor([[1, 1, 0], [0, 1, 1]]))
    >>> info.cu_seqlens.tolist(), info.max_seqlen, info.indices.tolist()
    ([0, 2, 4], 2, [0, 1, 4, 5])
    """

    def longest(lengths: Tensor) -> list[Tensor]:
        return [lengths.max() if lengths.numel() else lengths.sum()]

    source, (max_seqlen,) = plan_source(x, attention_mask, seqlens, longest)
    return UnpadInfo(source=source, max_seqlen=max_seqlen)


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
    info = attention_mask if isinstance(attention_mask, UnpadInfo) else plan_unpad(attention_mask, seqlens=seqlens, x=x)
    empty = info.source.fill_rows[:0]
    return gather_rows(canvas_rows_of(x, info.source), info.source.index, empty), info


def pad(packed: Tensor, info: UnpadInfo, fill_value: float = 0) -> Tensor:
    """The inverse of ``unpad``: ``[t, *]`` back to ``[b, s, *]`` with ``fill_value`` at padded positions."""
    src = info.source
    if packed.shape[0] != src.total:
        raise ValueError(f"packed has {packed.shape[0]} tokens but the plan has {src.total}; pass unpad's output")
    canvas = scatter_rows([packed], [src.index], src.canvas_rows, src.fill_rows, fill_value)
    return from_canvas(canvas, src)
