"""Qwen3.5-MoE's language model (``Qwen3_5MoeForCausalLM``, config ``qwen3_5_moe_text``): Qwen3.5's hybrid token
mixers (:mod:`packfwd.models.families.qwen3_5`) and in every layer a Mixture of Experts: ``num_experts`` routed
experts of width ``moe_intermediate_size``, softmax top-``num_experts_per_tok`` always renormalised, and one shared
expert of width ``shared_expert_intermediate_size`` gated by a sigmoid (``shared_expert_gate``, as Qwen2-MoE's).  Its MTP layer is Qwen3.5's, its inner layer's MLP
the same Mixture of Experts."""

from __future__ import annotations

from ..mixers import GATED_ATTENTION, GATED_DELTANET
from ..mlp.moe import Moe
from . import qwen3_moe
from .entry import QWEN3_ATTENTION_BIAS, Family
from .qwen3_5 import MTP_WEIGHTS, read_attention

__all__ = ["FAMILY", "read_moe"]


def read_moe(cfg) -> Moe:
    """Qwen3.5-MoE's MLPs (module docstring)."""
    if not cfg.shared_expert_intermediate_size:
        raise ValueError("shared_expert_intermediate_size=0: a Qwen3.5-MoE layer always has its gated shared expert; "
                         "give it a width")
    return Moe.read(qwen3_moe.HF_NAMES, num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                    ffn_hidden_size=cfg.moe_intermediate_size, normalize_top_k=True,
                    shared_ffn_hidden_size=cfg.shared_expert_intermediate_size, shared_expert_gate=True)


FAMILY = Family("qwen3_5_moe", ("qwen3_5_moe_text",), attention=GATED_ATTENTION, read_attention=read_attention,
                read_moe=read_moe, unsupported=(QWEN3_ATTENTION_BIAS,), rope_scalings=("default",),
                linear_attention=GATED_DELTANET, mtp_weights=MTP_WEIGHTS)
