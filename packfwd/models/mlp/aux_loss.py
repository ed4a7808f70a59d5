"""The load-balancing loss of an MoE model's forward, or of its pipeline stages' forwards together.

:func:`model_aux_loss` is :func:`packfwd.models.mlp.routing.load_balancing_loss` of one forward's routing statistics
(:func:`packfwd.models.mlp.moe.routing_stats`), all-reduced over CP (and TP under sequence parallelism).  The loss pools
every layer, so no pipeline stage's share is a loss of its own: a stage before the last hands on its
:func:`stage_routing_sums` (its layers pooled, plus those it was given) with its hidden states, and the last stage
pools them into the loss; the gradient goes back along the same chain.  No Megatron-Core import.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from packfwd.engine import is_moe
from .routing import RoutingStats, check_carried, load_balancing_loss, routing_sums

__all__ = ["check_aux_loss_model", "check_stage_routing", "model_aux_loss", "score_dtype", "stage_routing_sums"]


def model_aux_loss(model: torch.nn.Module, stats: Sequence[RoutingStats], device=None, carried=None) -> Tensor:
    """:func:`load_balancing_loss` of one forward of ``model`` (its last pipeline stage, or the whole model: every
    MoE layer), its token sums all-reduced over the model's context-parallel group, and tensor-parallel group under
    sequence parallelism.  ``carried``: the earlier pipeline stages' :func:`stage_routing_sums`, pooled in (the
    loss is then float64 arithmetic, cast to the routers' score dtype; so is an empty batch's 0)."""
    gpt = check_aux_loss_model(model)
    config, groups = gpt.config, gpt.pg_collection
    reduce = [groups.cp] if config.context_parallel_size > 1 else []
    if config.sequence_parallel and config.tensor_model_parallel_size > 1:
        reduce.append(groups.tp)
    loss = load_balancing_loss(stats, config.num_moe_experts, groups=reduce, carried=carried)
    if carried is not None or not stats:  # float64 sums, or an empty batch's 0 (float32): the routers' dtype
        loss = loss.to(score_dtype(config))
    return loss.to(device) if device is not None else loss


def stage_routing_sums(model: torch.nn.Module, stats: Sequence[RoutingStats], carried=None) -> Tensor:
    """A pipeline stage's :func:`~packfwd.models.mlp.routing.routing_sums` (its layers' routing pooled, plus the earlier
    stages' ``carried``): what it hands to the next stage for the last stage's :func:`model_aux_loss`.  Summed on
    this rank only: the last stage all-reduces the pooled sums over CP / SP once."""
    gpt = check_aux_loss_model(model)
    return routing_sums(stats, gpt.config.num_moe_experts, carried)


def check_stage_routing(model: torch.nn.Module, carried, aux_loss: bool = True) -> None:
    """For a ``moe_aux_loss=True`` forward (``aux_loss``): ``model`` can give the loss, and ``carried`` (the
    forward's ``moe_routing``) is given exactly when ``model`` is a later pipeline stage, ``[2 E + 1]`` float64;
    for any other forward, no ``carried``.  Else a ValueError / TypeError naming the fix."""
    if not aux_loss:
        if carried is not None:
            raise TypeError("moe_routing= (the routing sums an earlier pipeline stage hands on) is taken by a "
                            "make_forward(..., moe_aux_loss=True) forward only; build it so, or drop moe_routing")
        return
    gpt = check_aux_loss_model(model)
    if gpt.pre_process and carried is not None:
        raise ValueError("moe_routing= given to the first pipeline stage (or a whole model): no earlier stage routed "
                         "anything; drop moe_routing")
    if not gpt.pre_process and carried is None:
        raise ValueError("moe_aux_loss=True on a later pipeline stage needs the earlier stages' routing: pass "
                         "moe_routing= the previous stage's output[-1] (its forward returns (hidden, ..., routing sums)); "
                         "run_micro_batches(..., pp_group=...) hands it on")
    if carried is not None:
        check_carried(carried, gpt.config.num_moe_experts)


def score_dtype(config) -> torch.dtype:
    """The dtype of the routers' scores (``PackedRouter._stats``): the gate's, at least float32."""
    gate = {"fp32": torch.float32, "fp64": torch.float64}.get(config.moe_router_dtype, config.params_dtype)
    return torch.promote_types(gate, torch.float32)


def check_aux_loss_model(model: torch.nn.Module):
    """The model inside ``model``'s wrappers, if it can give :func:`model_aux_loss`: an MoE model with softmax
    routing (DeepSeek-V3's sigmoid routing balances with its expert bias, no loss), all of it in this stage; else a
    ValueError naming the fix.

    >>> check_aux_loss_model(torch.nn.Linear(2, 2))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: moe_aux_loss=True on a model without MoE layers (config.num_moe_experts is None); ...
    """
    from packfwd._validate import unwrap

    gpt = unwrap(model)
    if not is_moe(gpt):
        raise ValueError("moe_aux_loss=True on a model without MoE layers (config.num_moe_experts is None); "
                         "drop moe_aux_loss, or build an MoE model")
    if gpt.config.moe_router_score_function != "softmax":
        raise ValueError("moe_aux_loss=True on a model with sigmoid routing (DeepSeek-V3 style): it balances its "
                         "experts with the routing-only expert bias, without a load-balancing loss (transformers "
                         "defines none for it), and packfwd defines none either; drop moe_aux_loss (the experts' "
                         "load is in packfwd.models.mlp.moe.routing_stats)")
    return gpt
