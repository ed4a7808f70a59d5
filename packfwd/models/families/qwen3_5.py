"""Qwen3.5's language model (``Qwen3_5ForCausalLM``, config ``qwen3_5_text``): Qwen3-Next's hybrid layers (Gated
DeltaNet on ``layer_types``' ``"linear_attention"`` layers, gated full attention with QK-norm and partial RoPE,
zero-centred norms) with its linear attention's projections flat (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``) and dense SwiGLU MLPs.  Text positions: the config's multimodal RoPE sections
(``mrope_section``) rotate every channel by the one text position, which is plain RoPE; the vision model
(``Qwen3_5ForConditionalGeneration``) is not converted."""

from __future__ import annotations

from ..mixers import GATED_ATTENTION, GATED_DELTANET
from .entry import QWEN3_ATTENTION_BIAS, Family
from .qwen3_next import hybrid_attention_fields

__all__ = ["FAMILY", "read_attention"]


def read_attention(cfg) -> dict:
    """Qwen3.5's token mixers (module docstring)."""
    return hybrid_attention_fields(cfg, grouped_projections=False)


FAMILY = Family("qwen3_5", ("qwen3_5_text",), attention=GATED_ATTENTION, read_attention=read_attention,
                unsupported=(QWEN3_ATTENTION_BIAS,), rope_scalings=("default",), linear_attention=GATED_DELTANET)
