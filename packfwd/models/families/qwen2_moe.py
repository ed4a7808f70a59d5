"""Qwen2-MoE: a bias on q, k and v when the config's ``qkv_bias`` says so (the default: True); Qwen3-MoE's layout of
dense and MoE layers, and in each MoE layer one shared expert of width ``shared_expert_intermediate_size`` gated by
a sigmoid (``shared_expert_gate``; transformers names it in the singular, ``mlp.shared_expert``)."""

from __future__ import annotations

from ..mixers.softmax import hf_attention_fields
from ..mlp.moe import Moe
from . import qwen3_moe
from .entry import FULL_CAUSAL, Family

__all__ = ["FAMILY", "read_attention", "read_moe"]


def read_attention(cfg) -> dict:
    """Qwen2-MoE's attention: a bias on q, k and v as ``qkv_bias`` says."""
    return hf_attention_fields(cfg, qkv_bias=getattr(cfg, "qkv_bias", True))


def read_moe(cfg) -> Moe | None:
    """Qwen2-MoE's MLPs (module docstring); None: every MLP dense."""
    dense = qwen3_moe.dense_layers(cfg)
    if not cfg.num_experts or len(dense) == cfg.num_hidden_layers:
        return None
    if not cfg.shared_expert_intermediate_size:
        raise ValueError("shared_expert_intermediate_size=0: a Qwen2-MoE layer always has its gated shared expert; "
                         "give it a width, or convert the model as qwen3_moe (no shared expert)")
    return qwen3_moe.read_moe(cfg, shared_ffn_hidden_size=cfg.shared_expert_intermediate_size,
                              shared_expert_gate=True)


FAMILY = Family("qwen2_moe", ("qwen2_moe",), read_attention=read_attention, read_moe=read_moe,
                unsupported=(FULL_CAUSAL,))
