"""The Mixture-of-Experts MLP as a layer component: its description (:class:`Moe`, ``ModelArgs.moe``), the
Megatron-Core config fields and layer spec it becomes, its weight table, and the checks that refuse what
Megatron-Core would build otherwise than described.

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
routing-only expert bias (``router.expert_bias``, at least float32, a buffer in the state dict), group-limited top-k and a
routed scaling factor, all Megatron-Core's own arithmetic.  What :class:`~packfwd.models.mlp.router.PackedRouter`
changes in Megatron-Core's ``TopKRouter`` (the gate's device and dtype, layout pads routed nowhere, routing
statistics) is said there.  Megatron-Core's own auxiliary losses stay off (``moe_router_load_balancing_type=
"none"``): a packfwd model adds no hidden gradient; the forward returns the loss on request
(:mod:`packfwd.models.mlp.aux_loss`).

Weights (HF under ``model.layers.{i}.mlp.``, Megatron-Core under ``decoder.layers.{j}.mlp.``): the router, its
expert bias and the shared experts are the table ``WEIGHTS``; the routed experts, stored fused ``[E, 2f, h]`` by
transformers 5 (per expert in older checkpoints) and split over expert-parallel ranks, are
:mod:`packfwd.models.mlp.moe_weights`' functions.

A family reading an HF config builds its description with :meth:`Moe.read`, so a refusal names the config's flags
(``norm_topk_prob``, ``num_experts_per_tok``) rather than :class:`Moe`'s fields.  Megatron-Core is imported inside
the functions (and by :mod:`packfwd.models.mlp.router`, which they import).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from ..component import Component
from ..mapping import Weight, rows_to_hf, rows_to_megatron
from .routing import RoutingStats

__all__ = ["MOE", "MixtureOfExperts", "Moe", "check_moe", "moe_config_fields", "moe_spec", "routing_stats"]


@dataclass(frozen=True)
class Moe:
    """A Mixture-of-Experts MLP: a router choosing ``top_k`` of ``num_experts`` SwiGLU experts per token, dropless
    (no capacity factor: a token's output never depends on its batch).  Refused at construction: what Megatron-Core
    cannot build as described (:func:`check_moe`).

    >>> Moe(num_experts=8, top_k=2, ffn_hidden_size=32, dense_layers=[0]).dense_layers
    (0,)
    """

    num_experts: int  # routed experts (HF num_experts / num_local_experts / n_routed_experts)
    top_k: int  # experts per token (num_experts_per_tok)
    ffn_hidden_size: int  # each routed expert's hidden width (moe_intermediate_size; Mixtral: intermediate_size)
    score_function: str = "softmax"  # "softmax" (Qwen3-MoE, Mixtral) or "sigmoid" (DeepSeek-V3)
    normalize_top_k: bool = True  # the k chosen probabilities rescaled to sum to 1 (norm_topk_prob)
    shared_ffn_hidden_size: int = 0  # hidden width of the shared expert(s) every token also goes through; 0: none
    shared_expert_gate: bool = False  # a sigmoid gate on the shared expert's output (Qwen2-MoE)
    dense_layers: tuple[int, ...] = ()  # 0-based layers whose MLP is dense SwiGLU (ModelArgs.ffn_hidden_size)
    expert_bias: bool = False  # a routing-only bias added to the scores (DeepSeek-V3's e_score_correction_bias)
    num_groups: int | None = None  # group-limited routing: experts in num_groups groups (n_group) ...
    group_top_k: int | None = None  # ... of which each token searches its best group_top_k (topk_group)
    scaling_factor: float | None = None  # the routed probabilities times this (routed_scaling_factor)
    router_dtype: str | None = None  # "fp32"/"fp64": the gate weight kept in float32 (at least) and its logits
    #  computed in that dtype (transformers' GLM-4.5 / DeepSeek-V3); None: the model's dtype (Qwen3-MoE, Mixtral)
    activation: str = "silu"  # the experts' gate activation: "silu" (SwiGLU) or "quick_gelu" (g * sigmoid(1.702 g):
    #  GPT-OSS's swiglu_alpha), Megatron-Core's activation_func
    activation_clamp: float | None = None  # gate clamped to at most this, up to [-this, this] (GPT-OSS: swiglu_limit)
    glu_linear_offset: float = 0.0  # the experts' act(gate) * (up + this) (GPT-OSS: 1)

    def __post_init__(self):
        object.__setattr__(self, "dense_layers", check_moe(vars(self)))

    @classmethod
    def read(cls, names: Mapping[str, str], **fields) -> Moe:
        """The :class:`Moe` of ``fields`` read from a transformers config; ``names`` maps a field to the config flag
        it was read from, so that a refusal names the flag.

        >>> Moe.read({"top_k": "num_experts_per_tok", "num_experts": "num_local_experts"}, num_experts=4, top_k=5,
        ...          ffn_hidden_size=8)
        Traceback (most recent call last):
        ValueError: num_experts_per_tok=5 exceeds num_local_experts=4: pick at most num_local_experts experts per token
        """
        check_moe({f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
                  | fields, names)
        return cls(**fields)


def check_moe(m: Mapping, names: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """The checks of a :class:`Moe`'s fields ``m`` (its ``dense_layers`` as a tuple when they pass): ValueError for
    values out of range and for routing Megatron-Core would compute otherwise than described.  The message names a
    field by ``names[field]`` (an HF config flag) when given, else ``Moe.field``.

    >>> check_moe(dict(num_experts=8, top_k=2, ffn_hidden_size=16, score_function="sigmoid", normalize_top_k=False,
    ...                shared_ffn_hidden_size=0, shared_expert_gate=False, dense_layers=(), expert_bias=False,
    ...                num_groups=None, group_top_k=None, router_dtype=None), {"normalize_top_k": "norm_topk_prob"})
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: norm_topk_prob=False with Moe.top_k=2 and sigmoid scores: ... set norm_topk_prob=True
    """
    def n(field: str) -> str:
        return (names or {}).get(field) or f"Moe.{field}"

    def count(field: str, low: int) -> None:
        value = m[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{n(field)}={value!r}: pass an int >= {low}")

    for field in ("num_experts", "top_k", "ffn_hidden_size"):
        count(field, 1)
    count("shared_ffn_hidden_size", 0)
    if m["shared_expert_gate"] and not m["shared_ffn_hidden_size"]:
        raise ValueError(f"{n('shared_expert_gate')}=True gates a shared expert: give it a width "
                         f"({n('shared_ffn_hidden_size')} > 0) or pass shared_expert_gate=False")
    if m["top_k"] > m["num_experts"]:
        raise ValueError(f"{n('top_k')}={m['top_k']} exceeds {n('num_experts')}={m['num_experts']}: pick at most "
                         f"{n('num_experts')} experts per token")
    if m["score_function"] not in ("softmax", "sigmoid"):
        raise ValueError(f"Moe.score_function={m['score_function']!r}: pass 'softmax' or 'sigmoid'")
    if m["router_dtype"] not in (None, "fp32", "fp64"):
        raise ValueError(f"Moe.router_dtype={m['router_dtype']!r}: pass 'fp32', 'fp64' or None (the model's dtype)")
    layers = tuple(m["dense_layers"])
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers) \
            or list(layers) != sorted(set(layers)):
        raise ValueError(f"{n('dense_layers')}={m['dense_layers']!r}: pass increasing layer indices (ints >= 0)")
    if (m["num_groups"] is None) != (m["group_top_k"] is None):
        raise ValueError(f"{n('num_groups')} and {n('group_top_k')} come together (group-limited routing) or not "
                         "at all")
    if m["num_groups"] is not None:
        count("num_groups", 1)
        count("group_top_k", 1)
        if m["num_experts"] % m["num_groups"] or m["group_top_k"] > m["num_groups"]:
            raise ValueError(f"{n('num_groups')}={m['num_groups']} must divide {n('num_experts')}={m['num_experts']} "
                             f"and be at least {n('group_top_k')}={m['group_top_k']}")
        if m["top_k"] < m["group_top_k"]:
            raise ValueError(f"{n('top_k')}={m['top_k']} < {n('group_top_k')}={m['group_top_k']}: a group's score sums "
                             f"its best top_k // group_top_k experts (Megatron-Core), none here; pick "
                             f"{n('group_top_k')} <= {n('top_k')}")
    if m["score_function"] == "sigmoid" and m["normalize_top_k"] != (m["top_k"] > 1):
        raise ValueError(f"{n('normalize_top_k')}={m['normalize_top_k']} with {n('top_k')}={m['top_k']} and sigmoid "
                         "scores: Megatron-Core renormalises the chosen sigmoid scores exactly when more than one "
                         f"expert is chosen; set {n('normalize_top_k')}={m['top_k'] > 1}")
    _check_activation(m, n)
    if m["expert_bias"] and m["score_function"] != "sigmoid":
        raise ValueError("Moe.expert_bias=True with softmax scores: Megatron-Core adds the routing-only expert bias "
                         "to sigmoid scores only; pass score_function='sigmoid' or expert_bias=False")
    return layers


def _check_activation(m: Mapping, n) -> None:
    """The experts' activation fields: Megatron-Core has one ``activation_func`` (and GLU clamp and offset) for
    every MLP of a model, so a non-SwiGLU expert leaves no dense layer and no shared expert beside it."""
    activation, clamp, offset = m.get("activation", "silu"), m.get("activation_clamp"), m.get("glu_linear_offset", 0.0)
    if activation not in ("silu", "quick_gelu"):
        raise ValueError(f"{n('activation')}={activation!r}: pass 'silu' (SwiGLU) or 'quick_gelu' "
                         "(g * sigmoid(1.702 g), Megatron-Core's quick_gelu)")
    if clamp is not None and (isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or clamp <= 0):
        raise ValueError(f"{n('activation_clamp')}={clamp!r}: pass a positive number or None (no clamp)")
    if isinstance(offset, bool) or not isinstance(offset, (int, float)):
        raise ValueError(f"{n('glu_linear_offset')}={offset!r}: pass a number")
    if (activation != "silu" or clamp is not None or offset) and (m["dense_layers"] or m["shared_ffn_hidden_size"]):
        raise ValueError(f"{n('activation')}={activation!r} (clamp {clamp}, offset {offset}) with dense layers "
                         "or shared experts: Megatron-Core gives every MLP of a model one activation, so packfwd "
                         "builds a clamped or offset GLU only where every MLP is a routed expert; drop "
                         f"{n('dense_layers')} and {n('shared_ffn_hidden_size')}")


def moe_config_fields(moe: Moe, num_layers: int) -> dict:
    """Megatron-Core ``TransformerConfig`` fields of the MoE MLP ``moe`` in a model of ``num_layers`` layers: top-k,
    dropless, Megatron's auxiliary losses off.

    Softmax scores (Qwen3-MoE, Mixtral): ``moe.normalize_top_k`` renormalises the k kept probabilities (Megatron:
    softmax over the top-k logits, ``moe_router_pre_softmax=False``), or not (softmax over all experts, then top-k:
    ``pre_softmax``).  With one expert per token and renormalisation every weight is 1, exactly as transformers
    computes it (``p / p``) and as Megatron-Core's softmax over the one kept logit gives it, but Megatron-Core's
    config refuses that pair (a router so built gets no gradient, in transformers too): the config is made with
    ``pre_softmax`` and set back by :meth:`MixtureOfExperts.finish_config`.  Sigmoid scores (DeepSeek-V3): Megatron-Core
    renormalises the k kept sigmoids exactly when ``top_k > 1`` (:func:`check_moe`); ``moe.expert_bias`` is added to
    the scores for the choice of experts only (``moe_router_enable_expert_bias``).  ``moe.router_dtype`` is
    ``moe_router_dtype``.  Group-limited routing, the routed scaling factor and shared experts are Megatron-Core's
    fields of the same meaning.  ``moe_layer_freq``: per layer 1 (MoE) or 0 (dense, ``moe.dense_layers``).  The
    token dispatcher is ``"allgather"``, which runs on the CPU and on CUDA (Megatron's ``"alltoall"`` needs CUDA
    streams).

    >>> fields = moe_config_fields(Moe(num_experts=4, top_k=2, ffn_hidden_size=16, dense_layers=[0]), 2)
    >>> fields["moe_layer_freq"], fields["moe_router_pre_softmax"], fields["moe_ffn_hidden_size"]
    ([0, 1], False, 16)
    """
    import torch.nn.functional as F
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return dict(
        activation_func={"silu": F.silu, "quick_gelu": quick_gelu}[moe.activation],
        activation_func_clamp_value=None if moe.activation_clamp is None else float(moe.activation_clamp),
        glu_linear_offset=float(moe.glu_linear_offset),
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_score_function=moe.score_function,
        moe_router_pre_softmax=moe.score_function == "softmax" and (not moe.normalize_top_k or moe.top_k == 1),
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


def _shared(args) -> bool:
    return args.moe.shared_ffn_hidden_size > 0 and not args.moe.shared_expert_gate


def _gated(args) -> bool:  # Qwen2-MoE's gated shared expert, which HF names in the singular
    return args.moe.shared_expert_gate


def _bias(args) -> bool:
    return args.moe.expert_bias


# One MoE layer's weights but the routed experts': Megatron-Core <- HF, under the layer prefixes.
WEIGHTS = (
    Weight("mlp.router.weight", "mlp.gate.weight"),
    Weight("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias", when=_bias),
    Weight("mlp.shared_experts.linear_fc1.weight",
           ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"), "gate_up", when=_shared),
    Weight("mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.down_proj.weight", "cols", when=_shared),
    Weight("mlp.shared_experts.linear_fc1.weight",
           ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"), "gate_up", when=_gated),
    Weight("mlp.shared_experts.linear_fc2.weight", "mlp.shared_expert.down_proj.weight", "cols", when=_gated),
    Weight("mlp.shared_experts.gate_weight", "mlp.shared_expert_gate.weight", when=_gated),
)


class MixtureOfExperts(Component):
    """The MLP component of :class:`Moe` (module docstring); ``mlp_kind`` finds it (:mod:`packfwd.models.mlp`).
    A layer in ``args.moe.dense_layers`` never reaches it."""

    name = "Mixture of Experts"
    fields = ("moe",)

    def check(self, args) -> None:
        if not isinstance(args.moe, Moe):
            raise TypeError(f"ModelArgs.moe must be a packfwd.models.mlp.moe.Moe or None, got {type(args.moe)}")
        if args.moe.dense_layers and args.moe.dense_layers[-1] >= args.num_layers:
            raise ValueError(f"Moe.dense_layers={args.moe.dense_layers} names a layer beyond num_layers="
                             f"{args.num_layers}")

    def config_fields(self, args) -> dict:
        fields = moe_config_fields(args.moe, args.num_layers)
        if args.linear_bias:  # Megatron-Core builds biased experts whole only (build_model refuses other ETPs)
            fields["expert_tensor_parallel_size"] = 1
        if args.moe.activation != "silu":  # Megatron-Core's own glu (its config refuses an activation module then;
            fields["use_te_activation_func"] = False  # packfwd's SwiGLU kernel is plain SwiGLU's only)
        return fields

    def finish_config(self, config, args) -> None:
        """One softmax-routed expert renormalised: the config was made with ``pre_softmax`` (Megatron-Core refuses the
        pair); the router then takes a softmax over the one kept logit, 1 (:func:`moe_config_fields`)."""
        if args.moe.score_function == "softmax" and args.moe.top_k == 1 and args.moe.normalize_top_k:
            config.moe_router_pre_softmax = False

    def layer_spec(self, args, layer: int, **params):
        return moe_spec()

    def weights(self, args) -> tuple[Weight, ...]:
        return WEIGHTS

    def expert_layout(self):
        """The pair of functions converting the routed experts' HF tensors (:mod:`.moe_weights`): transformers 5's
        fused ``[E, 2f, h]`` layout here (a family with another layout overrides this, GPT-OSS's)."""
        from .moe_weights import experts_from_hf, experts_to_hf

        return experts_from_hf, experts_to_hf

    def hf_to_megatron(self, args, sd, hf_layer: str, mg_layer: str, *, tp_size: int, tp_rank: int) -> dict:
        experts_from_hf, _ = self.expert_layout()
        out = rows_to_megatron(self.weights(args), args, sd, hf_layer, mg_layer, tp_size, tp_rank)
        out.update(experts_from_hf(sd, hf_layer + "mlp.", mg_layer + "mlp.", range(args.moe.num_experts),
                                   tp_size=tp_size, tp_rank=tp_rank))
        return out

    def megatron_to_hf(self, args, shards, mg_layer: str, hf_layer: str) -> dict:
        _, experts_to_hf = self.expert_layout()
        out = rows_to_hf(self.weights(args), args, shards, mg_layer, hf_layer)
        out.update(experts_to_hf(shards, hf_layer + "mlp.", mg_layer + "mlp.", args.moe.num_experts))
        return out


MOE = MixtureOfExperts()


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
