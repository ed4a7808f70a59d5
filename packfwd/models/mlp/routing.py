"""The routing of an MoE forward, over its real tokens, and the load-balancing loss of it: pure torch.

:class:`packfwd.models.mlp.router.PackedRouter` records one :class:`RoutingStats` per MoE layer and forward (inside
:func:`packfwd.models.mlp.moe.routing_stats`); :func:`load_balancing_loss` pools them the way transformers'
``load_balancing_loss_func`` pools its layers.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from ...layout import display

__all__ = ["RoutingStats", "check_carried", "load_balancing_loss", "routing_sums"]


class RoutingStats(NamedTuple):
    """One MoE layer's routing of one forward, over its real tokens (this rank's share of them).

    ``tokens_per_expert [E]``: top-k assignments to each expert; ``probs_per_expert [E]``: the sum of each
    expert's router score (softmax over all experts), differentiable; ``tokens``: the real tokens routed (0-d)."""

    tokens_per_expert: Tensor
    probs_per_expert: Tensor
    tokens: Tensor

    def __repr__(self) -> str:  # for people, one line: the load per expert at a glance (one host read)
        return "RoutingStats(" + ", ".join(f"{k}={v}" for k, v in _fields(self)) + ")"

    def _repr_html_(self) -> str:  # a notebook's table and bar chart of the tokens per expert
        read = display.host_lists(self.tokens_per_expert, dtype=torch.float64)
        picture = "" if read is None else display.svg_bars(read[0], width=min(12 * len(read[0]), 360))
        return display.html_table("RoutingStats", _fields(self), picture, "assignments per expert; dashed: the mean")


def _fields(stats: RoutingStats) -> list[tuple[str, str]]:
    """Its repr's fields: the tokens routed, the load per expert (dtype, shape, range, mean), the scores' dtype and
    shape."""
    counts, probs, tokens = stats
    read = display.host_lists(counts, tokens, dtype=torch.float64)
    load, routed = "", display.tensor_text(tokens)
    if read is not None:
        values, (total,) = read
        load, routed = f" {min(values):.0f}..{max(values):.0f} (mean {sum(values) / len(values):.4g})", f"{total:.0f}"
    scores = display.tensor_text(probs.detach() if isinstance(probs, Tensor) else probs)
    return [("tokens", routed), ("tokens_per_expert", display.tensor_text(counts) + load), ("probs_per_expert", scores)]


def load_balancing_loss(stats: Sequence[RoutingStats], num_experts: int, *, groups: Sequence = (),
                        carried: Tensor | None = None) -> Tensor:
    """The load-balancing loss of the routed real tokens, unscaled: transformers' ``load_balancing_loss_func``.

    Summed over layers the way transformers does it (it concatenates all layers' router logits): the counts and
    the score sums of every layer are pooled, then ``E * sum_e (count_e / N) * (score_e / N)`` with ``N`` the real
    tokens times the layers.  ``groups``: process groups whose ranks hold other tokens of the same batch (context
    parallelism, sequence parallelism); their sums are all-reduced first, and the backward keeps this rank's
    share (every rank computes the same loss).  ``carried``: the earlier pipeline stages' layers, pooled
    (:func:`routing_sums`); the sums are then float64 and the gradient reaches the carried scores.  No routed
    token: 0.

    >>> stats = [RoutingStats(torch.tensor([2.0, 0.0]), torch.tensor([1.5, 0.5]), torch.tensor(2.0))]
    >>> load_balancing_loss(stats, 2)   # 2 * (1 * 0.75 + 0 * 0.25)
    tensor(1.5000)
    >>> load_balancing_loss(stats[:0], 2, carried=routing_sums(stats, 2))   # the same layer, one stage earlier
    tensor(1.5000, dtype=torch.float64)
    """
    if carried is not None:
        sums = routing_sums(stats, num_experts, carried)
        counts, scores, tokens = sums[:num_experts].detach(), sums[num_experts:-1], sums[-1].detach()
    elif not stats:
        return torch.zeros(())
    else:
        counts, scores, tokens = _pooled(stats, num_experts)
    for group in groups:
        counts, tokens, scores = _all_reduce(counts, tokens, scores, group)
    n = tokens.clamp(min=1)  # no token: counts and scores are 0, and so is the loss
    return num_experts * ((counts / n) * (scores / n)).sum()


def routing_sums(stats: Sequence[RoutingStats], num_experts: int, carried: Tensor | None = None) -> Tensor:
    """``[2 E + 1]`` float64: the pooled ``tokens_per_expert``, ``probs_per_expert`` and ``tokens`` of ``stats``
    (one pipeline stage's MoE layers), plus ``carried`` (the earlier stages' sums).  What a pipeline stage hands
    on to the next for :func:`load_balancing_loss` (the loss pools every layer, so no stage's share is a loss
    of its own); differentiable in the scores.  Float64: the counts stay exact integers past 2**24.

    >>> routing_sums([RoutingStats(torch.tensor([2.0, 0.0]), torch.tensor([1.5, 0.5]), torch.tensor(2.0))], 2)
    tensor([2.0000, 0.0000, 1.5000, 0.5000, 2.0000], dtype=torch.float64)
    """
    if carried is not None:
        check_carried(carried, num_experts)
    if stats:
        counts, scores, tokens = _pooled(stats, num_experts)
        sums = torch.cat([counts.double(), scores.double(), tokens.double()[None]])
    else:
        device = carried.device if carried is not None else None
        sums = torch.zeros(2 * num_experts + 1, dtype=torch.float64, device=device)
    return sums if carried is None else carried.to(sums.device) + sums


def check_carried(carried, num_experts: int) -> None:
    """``carried`` is what :func:`routing_sums` makes for ``num_experts`` experts (``[2 E + 1]`` float64), else a
    ValueError naming it."""
    if not isinstance(carried, Tensor) or carried.dtype != torch.float64 or tuple(carried.shape) != (
            2 * num_experts + 1,):
        got = f"{carried.dtype} {tuple(carried.shape)}" if isinstance(carried, Tensor) else type(carried).__name__
        raise ValueError(f"the carried routing sums are {got}; pass the earlier stage's float64 "
                         f"[2 * num_experts + 1] = [{2 * num_experts + 1}] sums (routing_sums)")


def _pooled(stats: Sequence[RoutingStats], num_experts: int):
    counts = torch.stack([s.tokens_per_expert for s in stats]).sum(0)
    scores = torch.stack([s.probs_per_expert for s in stats]).sum(0)
    tokens = torch.stack([s.tokens for s in stats]).sum()
    if counts.shape != (num_experts,):
        raise ValueError(f"the routing statistics have {counts.shape[-1]} experts, num_experts={num_experts}")
    return counts, scores, tokens


def _all_reduce(counts: Tensor, tokens: Tensor, scores: Tensor, group):
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    if group is None or group.size() == 1:
        return counts, tokens, scores
    both = torch.cat([counts, tokens[None].to(counts.dtype)])
    torch.distributed.all_reduce(both, group=group)
    return both[:-1], both[-1], reduce_from_tensor_model_parallel_region(scores, group)
