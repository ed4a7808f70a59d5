"""Where a batch's real tokens live before packing: a padded ``[b, s, *]`` tensor with a mask, or a jagged
``torch.nested`` tensor.  Every layout plan starts here.

Planning learns the few integers that fix the output shapes (real token count, and whatever the layout derives
from the lengths) in ONE host transfer.  It makes none when the mask lives on the CPU or when the caller passes
``seqlens`` on the host; then the device-side lengths are checked against them asynchronously, without a sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from ._checks import MASK_VALUES_MESSAGE, check_host_seqlens, check_mask, check_tensor, mask_bad_values
from ._rows import host_ints, static_nonzero

# Given the per-row lengths [b] (int64, on any device), return scalar tensors that fix a layout's shapes.
ScalarsFn = Callable[[Tensor], Sequence[Tensor]]


@dataclass(frozen=True)
class TokenSource:
    """The real tokens of a batch, as flat rows of a "canvas" (``x`` viewed as ``[b*s, *]``, or nested values)."""

    lengths: Tensor  # [b] int64, real tokens per row
    cu_seqlens: Tensor  # [b+1] int32
    index: Tensor  # [t] int64, canvas row of each real token, sequence after sequence
    fill_rows: Tensor  # [canvas_rows - t] int64, canvas rows holding no real token
    batch_size: int
    seq_len: int  # s (for nested input: the longest row)
    canvas_rows: int
    total: int  # t
    nested_offsets: Tensor | None  # [b+1] for nested input, else None


def is_nested(x: object) -> bool:
    return isinstance(x, Tensor) and x.is_nested


def plan_source(
    x: Tensor | None, attention_mask: Tensor | None, seqlens: object, scalars: ScalarsFn
) -> tuple[TokenSource, list[int]]:
    """Validate the input, learn the shape-fixing integers once, and index the real tokens.

    Returns the source and the integers ``scalars(lengths)`` evaluated to Python ints.
    """
    if x is not None and is_nested(x):
        if attention_mask is not None:
            raise ValueError("x is a nested (jagged) tensor, which carries its own lengths; pass attention_mask=None")
        return _plan_nested(x, seqlens, scalars)
    if attention_mask is None:
        raise TypeError("attention_mask is required for a padded x; pass the [b, s] mask (or a jagged nested x)")
    if x is not None:
        check_tensor("x", x)
    mask = check_mask(attention_mask, x)
    batch, seq_len = mask.shape
    lengths = mask.sum(1, dtype=torch.long)
    bad = mask_bad_values(mask)
    if seqlens is not None:
        host = check_host_seqlens(seqlens, batch)
        host_lengths = torch.tensor(host, dtype=torch.long)
        if any(v > seq_len for v in host):
            raise ValueError(f"seqlens has an entry larger than the mask width s={seq_len}")
        values = host_ints([host_lengths.sum(), *scalars(host_lengths)])
        # No sync: verified on the device, raising later (asynchronously) if the caller's lengths were wrong.
        torch._assert_async(bad == 0, MASK_VALUES_MESSAGE)
        torch._assert_async(
            (lengths == host_lengths.to(lengths.device)).all(), "seqlens does not match attention_mask.sum(-1)"
        )
    else:
        values = host_ints([lengths.sum(), bad, *scalars(lengths)])
        if values.pop(1):
            raise ValueError(MASK_VALUES_MESSAGE)
    total = values[0]
    flat = mask.reshape(-1).bool()
    source = TokenSource(
        lengths=lengths,
        cu_seqlens=_cumsum0(lengths),
        index=static_nonzero(flat, total, 0),
        fill_rows=static_nonzero(~flat, batch * seq_len - total, 0),
        batch_size=batch,
        seq_len=seq_len,
        canvas_rows=batch * seq_len,
        total=total,
        nested_offsets=None,
    )
    return source, values[1:]


def _plan_nested(x: Tensor, seqlens: object, scalars: ScalarsFn) -> tuple[TokenSource, list[int]]:
    if x.layout != torch.jagged:
        raise TypeError("nested x must use layout=torch.jagged (torch.nested.nested_tensor(..., layout=torch.jagged))")
    if x._ragged_idx != 1:
        raise ValueError("nested x must be ragged in dim 1 ([b, j, *]); transpose it so dim 1 is the ragged one")
    offsets = x.offsets().to(torch.long)
    lengths = offsets.diff()
    total = x.values().shape[0]
    if seqlens is not None:
        host_lengths = torch.tensor(check_host_seqlens(seqlens, x.size(0)), dtype=torch.long)
        torch._assert_async((lengths == host_lengths.to(lengths.device)).all(), "seqlens does not match x.offsets()")
        lengths_for_scalars = host_lengths
    else:
        lengths_for_scalars = lengths
    longest = lengths_for_scalars.max() if lengths_for_scalars.numel() else lengths_for_scalars.sum()
    seq_len, *values = host_ints([longest, *scalars(lengths_for_scalars)])
    empty = torch.empty(0, dtype=torch.long, device=offsets.device)
    source = TokenSource(
        lengths=lengths,
        cu_seqlens=offsets.to(torch.int32),
        index=torch.arange(total, device=offsets.device),
        fill_rows=empty,
        batch_size=x.size(0),
        seq_len=seq_len,
        canvas_rows=total,
        total=total,
        nested_offsets=offsets,
    )
    return source, values


def canvas_rows_of(x: Tensor, source: TokenSource) -> Tensor:
    """``x`` as the flat canvas ``[canvas_rows, *]`` the source indexes into."""
    if source.nested_offsets is not None:
        if not is_nested(x):
            raise TypeError("this plan was made from a nested tensor; pass a nested x with the same offsets")
        return x.values()
    return x.reshape(source.canvas_rows, *x.shape[2:])


def from_canvas(canvas: Tensor, source: TokenSource) -> Tensor:
    """The inverse of ``canvas_rows_of``: ``[b, s, *]``, or a jagged nested tensor for nested sources."""
    if source.nested_offsets is not None:
        return torch.nested.nested_tensor_from_jagged(canvas, source.nested_offsets)
    return canvas.reshape(source.batch_size, source.seq_len, *canvas.shape[1:])


def _cumsum0(lengths: Tensor) -> Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    out[1:] = torch.cumsum(lengths, 0)
    return out
