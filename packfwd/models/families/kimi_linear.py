"""Kimi-Linear: a hybrid of Kimi Delta Attention layers (``layer_types[i] == "linear_attention"``;
:mod:`packfwd.models.mixers.kimi_delta`) and multi-head latent attention without any position encoding
(transformers' ``KimiLinearAttention``: DeepSeek's MLA whose ``qk_rope_head_dim`` channels are not rotated, the
shared key channels still shared; ``Mla(rope=False)``), every MLP DeepSeek-V3's Mixture of Experts (sigmoid scores
with a routing-only correction bias, group-limited top-k, a routed scaling factor, shared experts) but where
``mlp_layer_types[i] == "dense"``.  No bias on MLA's projections (``attention_bias`` refused); MLA's key and value
per head (``num_key_value_heads == num_attention_heads``).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from ..mixers import KIMI_DELTA_ATTENTION, MLA, Kda
from ..mlp.moe import Moe
from .deepseek_v3 import HF_NAMES as DEEPSEEK_NAMES
from .deepseek_v3 import deepseek_moe_fields, read_mla
from .entry import Family

__all__ = ["FAMILY", "HF_NAMES", "read_attention", "read_moe"]

# The config flag each Moe field is read from (what a refusal names).
HF_NAMES = dict(DEEPSEEK_NAMES, num_experts="num_local_experts", dense_layers="mlp_layer_types")


def dense_layers(cfg) -> tuple[int, ...]:
    """The 0-based layers whose MLP is dense: ``mlp_layer_types[i] == "dense"`` (the others ``"sparse"``)."""
    types = list(getattr(cfg, "mlp_layer_types", None) or [])
    if len(types) != cfg.num_hidden_layers or set(types) - {"dense", "sparse"}:
        raise ValueError(f"mlp_layer_types={types!r}: give one 'dense' or 'sparse' per layer "
                         f"(num_hidden_layers={cfg.num_hidden_layers})")
    return tuple(i for i, kind in enumerate(types) if kind == "dense")


def read_moe(cfg) -> Moe | None:
    """The :class:`Moe` of a ``KimiLinearConfig``: DeepSeek-V3's (:func:`~packfwd.models.families.deepseek_v3.
    deepseek_moe_fields`) with its experts ``num_local_experts`` and its dense layers ``mlp_layer_types``'; None:
    every MLP dense."""
    dense = dense_layers(cfg)
    if not cfg.num_local_experts or len(dense) == cfg.num_hidden_layers:
        return None
    names = ("num_hidden_layers", "num_experts_per_tok", "n_group", "topk_group", "moe_intermediate_size",
             "norm_topk_prob", "routed_scaling_factor", "n_shared_experts")
    deepseek = SimpleNamespace(**{n: getattr(cfg, n) for n in names}, n_routed_experts=cfg.num_local_experts,
                               first_k_dense_replace=0)
    return Moe.read(HF_NAMES, **dict(deepseek_moe_fields(deepseek), dense_layers=dense))


def read_attention(cfg) -> dict:
    """Kimi-Linear's token mixers: MLA without RoPE on its full-attention layers, KDA on the others."""
    mla = dataclasses.replace(read_mla(SimpleNamespace(**{n: getattr(cfg, n) for n in (
        "num_attention_heads", "num_key_value_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
        "v_head_dim", "q_lora_rank")})), rope=False, rope_interleave=False)
    return dict(mla=mla, num_query_groups=cfg.num_attention_heads, head_dim=mla.qk_head_dim,
                linear_attention=Kda.from_hf(cfg))


FAMILY = Family("kimi_linear", ("kimi_linear",), attention=MLA, read_attention=read_attention, read_moe=read_moe,
                linear_attention=KIMI_DELTA_ATTENTION, unsupported=(
                    ("attention_bias", "packfwd builds MLA's projections without biases (Megatron-Core's MLA has "
                                       "none on its down projections); set attention_bias=False"),))
