"""Mixture-of-Experts layers for packfwd's models: Megatron-Core's ``MoELayer`` with a router that never routes a
layout pad, and the load-balancing loss of the real tokens.

The layer is Megatron-Core's own (``MoELayer``: router, token dispatcher, experts), dropless (no capacity factor:
a token's output depends on its own routing only, never on its batch), with Megatron's local modules, no
TransformerEngine::

    mlp                    MoELayer
      router               PackedRouter (Megatron's TopKRouter; weight [E, hidden])
      experts              GroupedExperts (Megatron's SequentialMLP, one grouped GEMM per linear on the GPU:
                           packfwd.models.mlp.experts): local_experts.{e}: MLP, linear_fc1 = [gate; up], linear_fc2
      shared_experts       SharedExpertMLP (Moe.shared_ffn_hidden_size > 0; every token, pads too: harmless;
                           Moe.shared_expert_gate: its output times sigmoid(gate_weight . x), Qwen2-MoE)

Routing (:func:`moe_config_fields`): softmax top-k (Qwen3-MoE, Mixtral), or DeepSeek-V3's sigmoid scores with a
routing-only expert bias (``router.expert_bias``, float32, a buffer in the state dict), group-limited top-k and a
routed scaling factor, all Megatron-Core's own arithmetic.

What :class:`~packfwd.models.mlp.router.PackedRouter` changes in Megatron-Core's ``TopKRouter``:

* the gate is a plain linear on the input's device, in ``config.moe_router_dtype`` (else the input's dtype):
  Megatron's moves its weight to CUDA on every call and takes TransformerEngine's GEMM;
* with ``config.moe_router_dtype`` (``Moe.router_dtype``: ``"fp32"`` for DeepSeek-V3-style routing, GLM-4.5) the
  gate weight stays float32 (at least) in a bf16 / fp16 model, as transformers keeps it
  (``_keep_in_fp32_modules_strict``): Megatron-Core casts it to ``params_dtype``, so a bf16 checkpoint's float32
  gate would lose bits;
* ``padding_mask`` (Megatron-Core's convention: ``[b, s]``, True at a padding slot; ``GPTModel.forward`` passes it
  down, ``make_forward`` gives it from the batch's plan): Megatron masks those tokens out of its auxiliary losses
  only; here they are routed to no expert at all (their routing-map row is empty, their probabilities 0), so they
  count nowhere: not in the experts' load, not in any statistic, not in the load-balancing loss
  (:func:`packfwd.models.mlp.routing.load_balancing_loss`);
* inside :func:`routing_stats`, every routing appends its layer's
  :class:`~packfwd.models.mlp.routing.RoutingStats` (real tokens only);
* the expert bias and its token counts are made beside the weight (Megatron-Core makes them on CUDA); the counts
  Megatron-Core's ``finalize_model_grads`` updates the bias from are of real tokens only, and eager (Megatron
  compiles that helper).

Megatron-Core's own auxiliary losses stay off (``moe_router_load_balancing_type="none"``): a packfwd model adds no
hidden gradient.  Ask the forward for the loss (``make_forward(..., moe_aux_loss=True)``) and add it, scaled, to
yours; sigmoid routing has none (:func:`packfwd.models.mlp.aux_loss.check_aux_loss_model`).  The MLP kind of
:class:`packfwd.models.families.family.Moe` is :class:`MoeKind` (``family.mlp_kind`` finds it).
Megatron-Core is imported inside the functions (and by :mod:`packfwd.models.mlp.router`, which they import).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from .routing import RoutingStats

__all__ = ["MoeKind", "moe_config_fields", "moe_spec", "routing_stats"]


def moe_config_fields(moe, num_layers: int) -> dict:
    """Megatron-Core ``TransformerConfig`` fields of the MoE MLP ``moe`` (a :class:`packfwd.models.families.family.Moe`) in
    a model of ``num_layers`` layers: top-k, dropless, Megatron's auxiliary losses off.

    Softmax scores (Qwen3-MoE, Mixtral): ``moe.normalize_top_k`` renormalises the k kept probabilities (Megatron:
    softmax over the top-k logits, ``moe_router_pre_softmax=False``), or not (softmax over all experts, then top-k:
    ``pre_softmax``).  Sigmoid scores (DeepSeek-V3): Megatron-Core renormalises the k kept sigmoids exactly when
    ``top_k > 1``, so ``normalize_top_k`` must say the same; ``moe.expert_bias`` is added to the scores for the
    choice of experts only (``moe_router_enable_expert_bias``).  ``moe.router_dtype`` is ``moe_router_dtype``.
    Group-limited routing, the routed scaling factor and shared experts are Megatron-Core's fields of the same
    meaning.  ``moe_layer_freq``: per layer 1 (MoE) or 0
    (dense, ``moe.dense_layers``).  The token dispatcher is ``"allgather"``, which runs on the CPU and on CUDA
    (Megatron's ``"alltoall"`` needs CUDA streams).

    >>> from packfwd.models.families.family import Moe
    >>> fields = moe_config_fields(Moe(num_experts=4, top_k=2, ffn_hidden_size=16, dense_layers=[0]), 2)
    >>> fields["moe_layer_freq"], fields["moe_router_pre_softmax"], fields["moe_ffn_hidden_size"]
    ([0, 1], False, 16)
    >>> moe_config_fields(Moe(num_experts=4, top_k=2, ffn_hidden_size=16, score_function="sigmoid",
    ...                       normalize_top_k=False), 1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: Moe(score_function='sigmoid', top_k=2, normalize_top_k=False): Megatron-Core renormalises ...
    """
    _check_buildable(moe)
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_score_function=moe.score_function,
        moe_router_pre_softmax=moe.score_function == "softmax" and not moe.normalize_top_k,
        moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_top_k,
        moe_router_topk_scaling_factor=moe.scaling_factor,
        moe_router_dtype=moe.router_dtype,
        moe_shared_expert_intermediate_size=moe.shared_ffn_hidden_size or None,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_router_load_balancing_type="none",  # packfwd returns the loss instead (module docstring)
        moe_aux_loss_coeff=0.0,
        moe_layer_freq=[int(i not in moe.dense_layers) for i in range(num_layers)],
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
    )


def _check_buildable(moe) -> None:
    """ValueError / NotImplementedError for a :class:`~packfwd.models.families.family.Moe` Megatron-Core cannot build as
    described (no silent other routing)."""
    if moe.score_function == "sigmoid" and moe.normalize_top_k != (moe.top_k > 1):
        raise ValueError(f"Moe(score_function='sigmoid', top_k={moe.top_k}, normalize_top_k={moe.normalize_top_k}): "
                         "Megatron-Core renormalises the k chosen sigmoid scores exactly when top_k > 1; pass "
                         f"normalize_top_k={moe.top_k > 1}")
    if moe.expert_bias and moe.score_function != "sigmoid":
        raise ValueError("Moe.expert_bias=True with softmax scores: Megatron-Core adds the routing-only expert bias "
                         "to sigmoid scores only; pass score_function='sigmoid' or expert_bias=False")
    if moe.num_groups is not None and moe.top_k < moe.group_top_k:
        raise ValueError(f"Moe.top_k={moe.top_k} < group_top_k={moe.group_top_k}: a group's score sums its best "
                         "top_k // group_top_k experts (Megatron-Core), none here; pass group_top_k <= top_k")


class MoeKind:
    """The MLP kind of :class:`packfwd.models.families.family.Moe` (:class:`packfwd.models.families.family.MlpKind`): config
    fields, layer spec and HF weights of an MoE layer (this module and :mod:`packfwd.models.mlp.moe_weights`)."""

    def config_fields(self, args) -> dict:
        return moe_config_fields(args.moe, args.num_layers)

    def layer_spec(self, args, layer: int):
        return moe_spec()

    def hf_to_megatron(self, args, hf_state_dict, hf_layer: str, mg_layer: str, *, tp_size: int, tp_rank: int):
        from .moe_weights import moe_from_hf

        return moe_from_hf(hf_state_dict, hf_layer + "mlp.", mg_layer + "mlp.", range(args.moe.num_experts),
                           tp_size=tp_size, tp_rank=tp_rank, **_parts(args.moe))

    def megatron_to_hf(self, args, shards, mg_layer: str, hf_layer: str):
        from .moe_weights import moe_to_hf

        return moe_to_hf(shards, hf_layer + "mlp.", mg_layer + "mlp.", args.moe.num_experts, **_parts(args.moe))


def _parts(moe) -> dict:
    """The optional parts of an MoE layer's weights (:mod:`packfwd.models.mlp.moe_weights`)."""
    return dict(shared=moe.shared_ffn_hidden_size > 0, expert_bias=moe.expert_bias, shared_gate=moe.shared_expert_gate)


def moe_spec(grouped: bool | None = None):
    """The ``ModuleSpec`` of an MoE MLP: Megatron-Core's ``MoELayer`` with
    :class:`~packfwd.models.mlp.router.PackedRouter` and :class:`~packfwd.models.mlp.experts.GroupedExperts` (Megatron's
    ``SequentialMLP`` of tensor-parallel linears, grouped GEMMs on the GPU; ``grouped`` is its param) as experts
    (Megatron's local spec; no TransformerEngine).

    >>> spec = moe_spec()
    >>> spec.module.__name__, spec.submodules.router.__name__, spec.submodules.experts.module.__name__
    ('MoELayer', 'PackedRouter', 'GroupedExperts')
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .experts import GroupedExperts
    from .router import PackedRouter

    from packfwd.ops.swiglu import SwiGLU  # built only in a fused model (packfwd.models.runtime.spec's docstring)

    linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear, activation_func=SwiGLU)
    return ModuleSpec(
        module=MoELayer,
        submodules=MoESubmodules(
            experts=ModuleSpec(module=GroupedExperts, submodules=linears, params={"grouped": grouped}),
            shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=linears),  # built only when configured
            router=PackedRouter,
        ),
        metainfo={"fuse_pre_mlp_layernorm": False},
    )


def routers(model: torch.nn.Module) -> list:
    """The :class:`~packfwd.models.mlp.router.PackedRouter` s of ``model`` (any wrapper), in layer order.

    >>> routers(torch.nn.Linear(2, 2))
    []
    """
    from .router import PackedRouter

    return [m for m in model.modules() if isinstance(m, PackedRouter)]


@contextlib.contextmanager
def routing_stats(model: torch.nn.Module) -> Iterator[list[RoutingStats]]:
    """While open, every MoE layer of ``model`` appends its :class:`RoutingStats` to the yielded list, once per
    routing (once per forward and layer: packfwd's models do not recompute activations).

    >>> with routing_stats(torch.nn.Linear(2, 2)) as stats:   # a model without MoE layers records nothing
    ...     pass
    >>> stats
    []
    """
    found = routers(model)
    if any(r.record is not None for r in found):
        raise RuntimeError("routing_stats is already open on this model; open it once per forward")
    stats: list[RoutingStats] = []
    for r in found:
        r.record = stats
    try:
        yield stats
    finally:
        for r in found:
            r.record = None
