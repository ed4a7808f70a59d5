"""Qwen3.5's language model (``Qwen3_5ForCausalLM``, config ``qwen3_5_text``): Qwen3-Next's hybrid layers (Gated
DeltaNet on ``layer_types``' ``"linear_attention"`` layers, gated full attention with QK-norm and partial RoPE,
zero-centred norms) with its linear attention's projections flat (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``) and dense SwiGLU MLPs.  Text positions: the config's multimodal RoPE sections
(``mrope_section``) rotate every channel by the one text position, which is plain RoPE; the vision model
(``Qwen3_5ForConditionalGeneration``) is not converted.

Its MTP layer (``mtp.*`` in the checkpoint, dropped by transformers: ``from_hf(hf, mtp_state_dict=)``) is
Qwen3-Next's (:mod:`packfwd.models.families.qwen3_next`, ``MTP_WEIGHTS``): the norms of the embedding and of the
hidden state, ``fc`` over ``[embedding, hidden]`` and the final norm around a full-attention decoder layer
``mtp.layers.0``, whose weights are named as the decoder's; its depths are the config's ``mtp_num_hidden_layers``."""

from __future__ import annotations

from ..mixers import GATED_ATTENTION, GATED_DELTANET
from .entry import QWEN3_ATTENTION_BIAS, Family
from .qwen3_next import MTP_WEIGHTS, hybrid_attention_fields

__all__ = ["FAMILY", "MTP_WEIGHTS", "read_attention"]


def read_attention(cfg) -> dict:
    """Qwen3.5's token mixers (module docstring)."""
    return hybrid_attention_fields(cfg, grouped_projections=False)


FAMILY = Family("qwen3_5", ("qwen3_5_text",), attention=GATED_ATTENTION, read_attention=read_attention,
                unsupported=(QWEN3_ATTENTION_BIAS,), rope_scalings=("default",), linear_attention=GATED_DELTANET,
                mtp_weights=MTP_WEIGHTS)
