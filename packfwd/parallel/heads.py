"""Context parallelism for a layer whose heads are independent but each needs its sequences whole (Gated DeltaNet:
a causal convolution and a recurrent state along every sequence): an all-to-all over the CP group trades tokens for
heads, so each CP rank runs the whole of every sequence for ``1 / cp`` of the heads, and the inverse trades them
back.  Exact: no state is split, so nothing has to be handed from rank to rank.

A CP rank holds its zigzag shard (``packfwd.layout.rules``: chunks ``r`` and ``2*cp-1-r`` of every padded
sequence, ``t_local`` rows) with every head's channels.  :func:`zigzag_to_heads` cuts each channel section (``[q |
k | v | ...]``, heads contiguous in each) into ``cp`` pieces, sends piece ``j`` of its rows to rank ``j``, and puts
the ``cp * t_local`` rows it receives into the global padded THD order (:func:`~packfwd.parallel.context.
zigzag_to_global`), so sequence ``i`` starts at ``cu_seqlens_padded[i]`` as without CP.  :func:`heads_to_zigzag` is
its inverse.  Index gathers of fixed shapes; no host sync.  Per layer the two all-to-alls move the layer's input
and output channels once each (``(cp - 1) / cp`` of them leave the rank).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from .._validate import check_positive_int, check_tensor
from .context import _check_group, global_to_zigzag, zigzag_to_global

__all__ = ["all_to_all_cp", "heads_to_zigzag", "zigzag_to_heads"]


def all_to_all_cp(x: Tensor, cp_group: Any) -> Tensor:
    """All-to-all over ``cp_group``: ``x: [cp, *]``, slot ``j`` sent to rank ``j`` -> ``[cp, *]``, slot ``i``
    received from rank ``i``.  Differentiable: its backward is the same exchange of the gradient (each slot
    returns to the rank that sent it).  ``cp_group=None`` means the default group."""
    import torch.distributed as dist

    check_tensor("x", x)
    world = dist.get_world_size(cp_group)
    if x.dim() < 1 or x.shape[0] != world:
        raise ValueError(f"x must be [cp, *] with one slot per rank of cp_group (size {world}), got shape "
                         f"{tuple(x.shape)}")
    return _AllToAllCP.apply(x, cp_group)


class _AllToAllCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: Tensor, group: Any) -> Tensor:
    import torch.distributed as dist

    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)  # equal splits along dim 0; gloo (CPU) and NCCL both have it
    return out


def zigzag_to_heads(x_local: Tensor, sections: Sequence[int], cu_seqlens_padded: Tensor, *, cp_size: int,
                    cp_rank: int, cp_group: Any) -> Tensor:
    """This rank's zigzag rows of every head -> every row of this rank's heads: ``x_local: [t_local, c]``, its
    channels the ``sections`` (widths summing to ``c``, each a multiple of ``cp_size``, heads contiguous in each)
    -> ``[cp_size * t_local, c / cp_size]`` in the global padded THD order, its channels piece ``cp_rank`` of each
    section, in order.  ``cu_seqlens_padded [n+1]``: the whole padded sequences (``cp_size * t_local`` rows in all).
    With ``cp_size=1`` nothing moves and ``cp_group`` may be None.

    >>> cu = torch.tensor([0, 4], dtype=torch.int32)
    >>> zigzag_to_heads(torch.arange(8.).view(4, 2), [1, 1], cu, cp_size=1, cp_rank=0, cp_group=None).shape
    torch.Size([4, 2])
    """
    check_tensor("x_local", x_local)
    cp, widths = _check_sections(x_local, sections, cp_size)
    if cp == 1:
        return x_local
    _check_group(cp_group, cp, cp_rank)
    t = x_local.shape[0]
    slots = torch.cat([p.reshape(t, cp, -1) for p in x_local.split(widths, -1)], -1).transpose(0, 1)  # [cp, t, c/cp]
    return zigzag_to_global(all_to_all_cp(slots, cp_group), cu_seqlens_padded)


def heads_to_zigzag(y: Tensor, sections: Sequence[int], cu_seqlens_padded: Tensor, *, cp_size: int, cp_rank: int,
                    cp_group: Any) -> Tensor:
    """The inverse of :func:`zigzag_to_heads`: ``y: [cp_size * t_local, c / cp_size]`` (every row of this rank's
    pieces of the ``sections``, global padded THD order) -> ``[t_local, c]``, this rank's zigzag rows of every head,
    each section whole again.

    >>> cu = torch.tensor([0, 4], dtype=torch.int32)
    >>> heads_to_zigzag(torch.ones(4, 3), [3], cu, cp_size=1, cp_rank=0, cp_group=None).shape
    torch.Size([4, 3])
    """
    check_tensor("y", y)
    cp = check_positive_int("cp_size", cp_size)
    widths = [check_positive_int("sections", w) for w in sections]
    if any(w % cp for w in widths) or y.dim() != 2 or y.shape[1] * cp != sum(widths):
        raise ValueError(f"y must be [t, c / cp_size] for sections {list(widths)} each divisible by cp_size={cp}, "
                         f"got shape {tuple(y.shape)}")
    if cp == 1:
        return y
    _check_group(cp_group, cp, cp_rank)
    got = all_to_all_cp(global_to_zigzag(y, cu_seqlens_padded, cp), cp_group)  # [cp, t_local, c/cp]: slot j heads j
    t = got.shape[1]
    return torch.cat([p.transpose(0, 1).reshape(t, -1) for p in got.split([w // cp for w in widths], -1)], -1)


def _check_sections(x: Tensor, sections: Sequence[int], cp_size: int) -> tuple[int, list[int]]:
    cp = check_positive_int("cp_size", cp_size)
    widths = [check_positive_int("sections", w) for w in sections]
    if x.dim() != 2 or x.shape[1] != sum(widths):
        raise ValueError(f"x_local must be [t_local, {sum(widths)}] (the sections {widths}), got shape "
                         f"{tuple(x.shape)}")
    if any(w % cp for w in widths):
        raise ValueError(f"sections {widths} must each divide by cp_size={cp}: every CP rank takes 1/cp of each "
                         "section's heads; pick a cp_size that divides the head counts")
    return cp, widths
