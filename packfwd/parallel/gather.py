"""The all-gather over the context-parallel group, with its backward rule chosen by the caller.

Two uses gather the same way and differ in the gradient (:func:`all_gather_cp`, ``backward=``): context-parallel
attention gathers K and V, and every rank's loss uses them (``"sum"``); ``make_forward`` gathers the outputs of
all CP ranks to unpack them, and every rank then computes the same loss (``"local"``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._validate import check_tensor

__all__ = ["all_gather_cp"]

_BACKWARDS = ("sum", "local")


def all_gather_cp(x_local: Tensor, cp_group: Any, *, backward: str) -> Tensor:
    """All-gather ``x_local: [t_local, *]`` over ``cp_group`` into ``[cp, t_local, *]`` (rank order).

    Every rank must pass the same ``t_local`` and trailing shape; ``cp_group=None`` means the default group.
    Differentiable; ``backward`` says what the gradient of ``x_local`` is, and must match how the ranks use the
    gathered tensor:

    * ``"sum"``: each rank computes its own loss from the gathered tensor (context-parallel attention: every rank
      attends over all the keys with its own queries).  The backward sums every rank's gradient for rank ``r``'s
      slot and returns it to rank ``r`` (a reduce-scatter), so ``x_local`` receives the gradient of every use of
      it, once.
    * ``"local"``: every rank computes the same loss from the gathered tensor (``make_forward`` unpacking the
      outputs of all CP ranks).  The backward keeps this rank's own gradient for its slot, with no
      communication; summing would count the one loss ``cp`` times.

    >>> from packfwd.testing import run_local
    >>> from packfwd.parallel.gather import _example_all_gather
    >>> # each rank holds [rank, rank] and backpropagates sum(gathered * (rank + 1))
    >>> run_local(_example_all_gather, 2, "sum", backend="gloo")     # grad: 1 + 2 from the two ranks' losses
    [([[0.0, 0.0], [1.0, 1.0]], [3.0, 3.0]), ([[0.0, 0.0], [1.0, 1.0]], [3.0, 3.0])]
    >>> run_local(_example_all_gather, 2, "local", backend="gloo")   # grad: this rank's own rank + 1
    [([[0.0, 0.0], [1.0, 1.0]], [1.0, 1.0]), ([[0.0, 0.0], [1.0, 1.0]], [2.0, 2.0])]
    """
    check_tensor("x_local", x_local)
    if x_local.dim() < 1:
        raise ValueError("x_local must have a leading token dimension [t_local, *]; got a 0-d tensor")
    if backward not in _BACKWARDS:
        raise ValueError(
            f"backward={backward!r}; pass 'sum' when each rank computes its own loss from the gathered tensor, "
            "'local' when every rank computes the same loss"
        )
    return _AllGatherCP.apply(x_local, cp_group, backward)


def _uses_nccl(group: Any, x: Tensor) -> bool:
    import torch.distributed as dist

    return x.is_cuda and "nccl" in str(dist.get_backend(group)).lower()


class _AllGatherCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Any, backward: str) -> Tensor:
        import torch.distributed as dist

        ctx.group, ctx.backward = group, backward
        world = dist.get_world_size(group)
        x = x.contiguous()
        if _uses_nccl(group, x):
            out = x.new_empty((world * x.shape[0], *x.shape[1:]))
            _all_gather_single(dist)(out, x, group=group)
            return out.view(world, *x.shape)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)  # the list form: every backend has it
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        import torch.distributed as dist

        group = ctx.group
        if ctx.backward == "local":
            return grad[dist.get_rank(group)], None, None
        grad = grad.contiguous()
        if _uses_nccl(group, grad):
            out = grad.new_empty(grad.shape[1:])
            _reduce_scatter_single(dist)(out, grad.flatten(0, 1), group=group)
            return out, None, None
        # Backends without a tensor reduce-scatter (gloo): sum everything, keep this rank's slot.
        total = grad.clone()
        dist.all_reduce(total, group=group)
        return total[dist.get_rank(group)], None, None


def _all_gather_single(dist):
    # torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there); older ones lack it.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_single(dist):
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _example_all_gather(rank: int, world_size: int, backward: str):
    """Doctest helper for :func:`all_gather_cp` (module level, so that ``run_local`` can spawn it)."""
    x = torch.full((2,), float(rank), requires_grad=True)
    gathered = all_gather_cp(x, None, backward=backward)
    (gathered * (rank + 1)).sum().backward()
    return gathered.tolist(), x.grad.tolist()
