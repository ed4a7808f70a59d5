"""Qwen3-Next: a hybrid of Gated DeltaNet layers (``layer_types[i] == "linear_attention"``; transformers derives them
from ``full_attention_interval``, 3 of every 4) and gated full-attention layers (Qwen3's QK-norm, an output gate
from ``q_proj``, partial RoPE: ``partial_rotary_factor``), every norm zero-centred (``rms_norm(x) * (1 +
weight)``); its linear attention's projections grouped per key head (``in_proj_qkvz``, ``in_proj_ba``).  MLPs:
Qwen2-MoE's (softmax top-k renormalised as ``norm_topk_prob`` says, one shared expert gated by a sigmoid), a layer
dense when in ``mlp_only_layers`` or when ``(i + 1) % decoder_sparse_step``."""

from __future__ import annotations

from ..mixers import GATED_ATTENTION, GATED_DELTANET, DeltaNet
from ..mixers.softmax import hf_attention_fields
from . import qwen2_moe
from .entry import QWEN3_ATTENTION_BIAS, Family

__all__ = ["FAMILY", "hybrid_attention_fields", "read_attention"]


def hybrid_attention_fields(cfg, *, grouped_projections: bool) -> dict:
    """The token mixers' ModelArgs fields of a Qwen3-Next / Qwen3.5 text config: the gated full attention's (QK-norm,
    partial RoPE, the output gate), the Gated DeltaNet layers (``grouped_projections``: Qwen3-Next's HF layout) and
    the zero-centred norms."""
    return dict(hf_attention_fields(cfg, qk_norm=True, partial_rope=True), attention_output_gate=True,
                linear_attention=DeltaNet.from_hf(cfg, grouped_projections=grouped_projections),
                norm_zero_centered=True)


def read_attention(cfg) -> dict:
    """Qwen3-Next's token mixers (module docstring)."""
    return hybrid_attention_fields(cfg, grouped_projections=True)


FAMILY = Family("qwen3_next", ("qwen3_next",), attention=GATED_ATTENTION, read_attention=read_attention,
                read_moe=qwen2_moe.read_moe, unsupported=(QWEN3_ATTENTION_BIAS,), rope_scalings=("default",),
                linear_attention=GATED_DELTANET)
