"""DeepSeek-V3: multi-head latent attention (:mod:`packfwd.models.mixers.latent`; plain or YaRN RoPE) and
DeepSeek's Mixture of Experts (sigmoid scores with a routing-only correction bias, group-limited top-k, a routed
scaling factor, shared experts, the first ``first_k_dense_replace`` layers dense), which GLM-4.5 shares
(:mod:`packfwd.models.families.glm4_moe`).  No bias on MLA's projections (``attention_bias`` refused).
"""

from __future__ import annotations

from ..mixers import MLA, Mla, Yarn
from ..mlp.moe import Moe
from .entry import Family

__all__ = ["FAMILY", "HF_NAMES", "deepseek_moe_fields", "read_attention", "read_mla", "read_moe", "read_yarn"]

# The config flag each Moe field is read from (what a refusal names).
HF_NAMES = dict(num_experts="n_routed_experts", top_k="num_experts_per_tok", ffn_hidden_size="moe_intermediate_size",
                normalize_top_k="norm_topk_prob", num_groups="n_group", group_top_k="topk_group",
                scaling_factor="routed_scaling_factor", dense_layers="first_k_dense_replace",
                shared_ffn_hidden_size="n_shared_experts * moe_intermediate_size")


_YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
              "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate", "partial_rotary_factor"}


def read_mla(cfg) -> Mla:
    """The :class:`Mla` of a ``DeepseekV3Config``; ValueError (naming the field and the fix) for what packfwd
    does not build: ``num_key_value_heads`` other than ``num_attention_heads`` (every MLA head has its own key and
    value), partial RoPE, a RoPE type other than ``"default"`` and ``"yarn"``, a YaRN without ``factor``.

    >>> from transformers import DeepseekV3Config
    >>> mla = read_mla(DeepseekV3Config(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=40.0,
    ...     original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)))
    >>> mla.q_lora_rank, mla.kv_lora_rank, mla.qk_head_dim, mla.v_head_dim, mla.rope_interleave, mla.yarn.factor
    (1536, 512, 192, 128, True, 40.0)
    """
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if kv_heads != heads:
        raise ValueError(f"num_key_value_heads={kv_heads} with num_attention_heads={heads}: multi-head latent "
                         "attention gives every head its own key and value (kv_b_proj); set num_key_value_heads="
                         f"{heads}")
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']}: MLA rotates all of its "
                         "qk_rope_head_dim channels; set it to 1.0 (or leave it out)")
    yarn = None
    if kind == "yarn":
        yarn = read_yarn(params)
    elif kind != "default":
        raise ValueError(f"rope_type={kind!r}: packfwd builds DeepSeek-V3's RoPE as 'default' or 'yarn'; use one")
    return Mla(kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
               qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank,
               rope_interleave=bool(getattr(cfg, "rope_interleave", True)), yarn=yarn)


def read_yarn(params: dict) -> Yarn:
    """The :class:`Yarn` of a config's ``rope_parameters`` of ``rope_type="yarn"`` (DeepSeek-V3's, GPT-OSS's);
    ValueError for keys packfwd's YaRN does not read and for a missing ``factor``.

    >>> read_yarn(dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096, truncate=False)).truncate
    False
    """
    unknown = sorted(set(params) - _YARN_KEYS)
    if unknown:
        raise ValueError(f"rope_parameters keys {unknown} are not read by packfwd's YaRN; drop them")
    if params.get("factor") is None:
        raise ValueError("rope_parameters['factor'] is None: packfwd's YaRN needs the scaling factor given "
                         "(transformers' softmax correction reads it too); set it")
    return Yarn(factor=float(params["factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
                attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)))


def deepseek_moe_fields(cfg) -> dict | None:
    """The :class:`~packfwd.models.mlp.moe.Moe` fields of a transformers config with DeepSeek-V3's MoE fields
    (``DeepseekV3Config``; ``Glm4MoeConfig`` names them the same); None: every MLP dense.  Sigmoid scores plus the
    routing-only ``e_score_correction_bias``; top-k among the best ``topk_group`` of ``n_group`` groups; times
    ``routed_scaling_factor``; ``n_shared_experts`` shared experts of width ``moe_intermediate_size`` each; the
    first ``first_k_dense_replace`` layers dense; the router in float32 (transformers keeps ``gate.weight`` and the
    bias float32 and computes the logits in float32 in any model dtype; mbridge sets ``moe_router_dtype="fp32"``).
    The ``glm4_moe`` (GLM-4.5) and ``deepseek_v3`` families read it (:func:`read_moe`).

    >>> from transformers import DeepseekV3Config
    >>> fields = deepseek_moe_fields(DeepseekV3Config(num_hidden_layers=4, n_routed_experts=16, num_experts_per_tok=4,
    ...     n_group=4, topk_group=2, moe_intermediate_size=8, first_k_dense_replace=1))
    >>> [fields[k] for k in ("score_function", "expert_bias", "num_groups", "group_top_k", "shared_ffn_hidden_size")]
    ['sigmoid', True, 4, 2, 8]
    >>> fields["scaling_factor"], fields["dense_layers"], fields["router_dtype"]
    (2.5, (0,), 'fp32')
    """
    first_dense = cfg.first_k_dense_replace or 0
    if not cfg.n_routed_experts or first_dense >= cfg.num_hidden_layers:
        return None
    top_k, groups, chosen = cfg.num_experts_per_tok, cfg.n_group or 1, cfg.topk_group or 1
    limited = chosen < groups  # else every group is searched: plain top-k
    if limited and top_k // chosen != 2:
        raise ValueError(
            f"n_group={groups}, topk_group={chosen}, num_experts_per_tok={top_k}: transformers scores a group by its "
            f"best 2 experts, Megatron-Core by its best num_experts_per_tok // topk_group = {top_k // chosen}; packfwd "
            "builds group-limited routing where both agree (num_experts_per_tok // topk_group == 2)")
    scale = float(cfg.routed_scaling_factor)
    return dict(num_experts=cfg.n_routed_experts, top_k=top_k, ffn_hidden_size=cfg.moe_intermediate_size,
                score_function="sigmoid", normalize_top_k=bool(cfg.norm_topk_prob), expert_bias=True,
                shared_ffn_hidden_size=cfg.moe_intermediate_size * (cfg.n_shared_experts or 0),
                num_groups=groups if limited else None, group_top_k=chosen if limited else None,
                scaling_factor=None if scale == 1.0 else scale, dense_layers=tuple(range(first_dense)),
                router_dtype="fp32")


def read_moe(cfg) -> Moe | None:
    """The :class:`Moe` of a config with DeepSeek-V3's MoE fields (:func:`deepseek_moe_fields`); None: all dense."""
    fields = deepseek_moe_fields(cfg)
    return Moe.read(HF_NAMES, **fields) if fields is not None else None


def read_attention(cfg) -> dict:
    """DeepSeek-V3's attention fields: its :class:`Mla`, one key and value per head, the query-key head dim."""
    mla = read_mla(cfg)
    return dict(mla=mla, num_query_groups=cfg.num_attention_heads, head_dim=mla.qk_head_dim)


FAMILY = Family("deepseek_v3", ("deepseek_v3",), attention=MLA, read_attention=read_attention, read_moe=read_moe,
                rope_scalings=("default", "yarn"), unsupported=(
                    ("attention_bias", "packfwd builds MLA's projections without biases (Megatron-Core's MLA has "
                                       "none on its down projections); set attention_bias=False"),))
