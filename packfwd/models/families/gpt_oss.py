"""GPT-OSS (transformers' ``GptOssForCausalLM``): softmax attention with a bias on q, k, v and o, learned sinks
(one logit per head in every softmax denominator), sliding-window layers (``layer_types``: ``"sliding_attention"``,
a query and the ``sliding_window - 1`` keys before it inside its own sequence) among full ones, YaRN RoPE; every MLP
a Mixture of Experts: a router with a bias choosing the top ``num_experts_per_tok`` logits and taking a softmax over
them, experts with biases and the clamped SwiGLU ``(clamp(up, -l, l) + 1) * g * sigmoid(1.702 g)``,
``g = clamp(gate, max=l)`` (``l = swiglu_limit``).

The pieces are the components' (:mod:`packfwd.models.mixers.softmax`: ``attention_windows``, ``attention_sinks``,
``rope_yarn``; :mod:`packfwd.models.mlp.moe`: ``activation="quick_gelu"``, ``activation_clamp``,
``glu_linear_offset=1``; Megatron-Core's ``add_bias_linear`` biases every linear, the router's too); this module
reads them from a config and maps the MoE weights, whose HF layout is GPT-OSS's own::

    HF (under model.layers.{i}.mlp.)         packfwd (under decoder.layers.{j}.mlp.)
    router.weight [E, h], router.bias [E]    router.weight, router.bias
    experts.gate_up_proj [E, h, 2f]          experts.local_experts.{e}.linear_fc1.weight [2f, h]  [gate; up]
      (transposed, gate and up interleaved)
    experts.gate_up_proj_bias [E, 2f]        experts.local_experts.{e}.linear_fc1.bias [2f]       [gate; up]
    experts.down_proj [E, f, h]              experts.local_experts.{e}.linear_fc2.weight [h, f]
    experts.down_proj_bias [E, h]            experts.local_experts.{e}.linear_fc2.bias [h]

Megatron-Core builds biased experts whole only (``expert_tensor_parallel_size=1``): under TP > 1 they need expert
parallelism (``expert_tp_size=1``, ``ep_size > 1``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..mapping import Weight
from ..mixers.softmax import hf_attention_fields
from ..mlp.moe import MixtureOfExperts, Moe
from .deepseek_v3 import read_yarn
from .entry import Family

__all__ = ["FAMILY", "GPT_OSS_MOE", "GptOssFamily", "GptOssMoe", "HF_NAMES", "read_attention", "read_moe"]

# The config flag each Moe field is read from (what a refusal names).
HF_NAMES = dict(num_experts="num_local_experts", top_k="num_experts_per_tok", ffn_hidden_size="intermediate_size",
                activation="swiglu_alpha", activation_clamp="swiglu_limit")

_ALPHA = 1.702  # Megatron-Core's quick_gelu: g * sigmoid(1.702 g)


def read_moe(cfg) -> Moe:
    """GPT-OSS's MLPs (module docstring): top-k of the router's logits, a softmax over the k, the clamped SwiGLU.
    ``swiglu_alpha`` other than 1.702 is refused (Megatron-Core's ``quick_gelu`` has that gain); transformers
    releases without the fields use 1.702 and 7.0.

    >>> from transformers import GptOssConfig
    >>> moe = read_moe(GptOssConfig(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16))
    >>> moe.activation, moe.activation_clamp, moe.glu_linear_offset, moe.normalize_top_k
    ('quick_gelu', 7.0, 1.0, True)
    """
    alpha = float(getattr(cfg, "swiglu_alpha", _ALPHA))
    if alpha != _ALPHA:
        raise ValueError(f"swiglu_alpha={alpha}: packfwd builds GPT-OSS's gate as Megatron-Core's quick_gelu, "
                         f"g * sigmoid({_ALPHA} g); use swiglu_alpha={_ALPHA}")
    return Moe.read(HF_NAMES, num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
                    ffn_hidden_size=cfg.intermediate_size, normalize_top_k=True, activation="quick_gelu",
                    activation_clamp=float(getattr(cfg, "swiglu_limit", 7.0)), glu_linear_offset=1.0)


def read_attention(cfg) -> dict:
    """GPT-OSS's attention fields: grouped queries, sinks, the sliding window of each ``"sliding_attention"``
    layer (``sliding_window`` tokens; ``"full_attention"``: none), YaRN when ``rope_type="yarn"``.  Its biases are
    ``linear_bias`` (``attention_bias``; False is refused: the experts and the router have biases always, and
    Megatron-Core biases all linears or none).

    >>> from transformers import GptOssConfig
    >>> fields = read_attention(GptOssConfig(num_hidden_layers=3, sliding_window=4))
    >>> fields["attention_windows"], fields["attention_sinks"], fields["rope_yarn"].factor
    ((4, None, 4), True, 32.0)
    """
    if not getattr(cfg, "attention_bias", True):
        raise ValueError("attention_bias=False: GPT-OSS's router and experts have biases, and Megatron-Core puts a "
                         "bias on every linear or on none (add_bias_linear); packfwd builds GPT-OSS with "
                         "attention_bias=True")
    kinds = {"sliding_attention": cfg.sliding_window, "full_attention": None}
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
    unknown = sorted(set(types) - set(kinds))
    if unknown or len(types) != cfg.num_hidden_layers:
        raise ValueError(f"layer_types={types}: pass one of {sorted(kinds)} per layer ({cfg.num_hidden_layers})")
    window = cfg.sliding_window
    if "sliding_attention" in types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window={window!r} while layer_types names sliding_attention layers: set "
                         "sliding_window to their window in tokens (>= 1), or make those layers full_attention")
    windows = tuple(kinds[t] for t in types)
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    yarn = read_yarn(params) if params.get("rope_type", params.get("type")) == "yarn" else None
    return dict(hf_attention_fields(cfg), attention_windows=windows if any(windows) else None, attention_sinks=True,
                rope_yarn=yarn)


# One GPT-OSS MoE layer's router: Megatron-Core <- HF, under the layer prefixes (the experts: functions).
WEIGHTS = (Weight("mlp.router.weight", "mlp.router.weight"), Weight("mlp.router.bias", "mlp.router.bias"))


class GptOssMoe(MixtureOfExperts):
    """The Mixture-of-Experts component with GPT-OSS's HF weight layout (module docstring); the model it builds is
    the plain one's (:class:`~packfwd.models.mlp.moe.MixtureOfExperts`)."""

    name = "GPT-OSS Mixture of Experts"

    def weights(self, args) -> tuple[Weight, ...]:
        return WEIGHTS

    def expert_layout(self):
        from ..mlp.moe_weights import interleaved_experts_from_hf, interleaved_experts_to_hf

        return interleaved_experts_from_hf, interleaved_experts_to_hf


GPT_OSS_MOE = GptOssMoe()


@dataclass(frozen=True)
class GptOssFamily(Family):
    """:class:`~packfwd.models.families.entry.Family` whose MoE layers convert with GPT-OSS's weight layout."""

    def components(self, args, layer: int):
        """The entry's components, the MoE one converting with GPT-OSS's layout."""
        mixes, part = super().components(args, layer)
        return mixes, GPT_OSS_MOE if isinstance(part, MixtureOfExperts) else part


FAMILY = GptOssFamily("gpt_oss", ("gpt_oss",), read_attention=read_attention, read_moe=read_moe,
                      linear_bias_flags=("attention_bias",), rope_scalings=("default", "yarn"))
