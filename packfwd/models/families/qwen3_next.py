"""Qwen3-Next: a hybrid of Gated DeltaNet layers (``layer_types[i] == "linear_attention"``; transformers derives them
from ``full_attention_interval``, 3 of every 4) and gated full-attention layers (Qwen3's QK-norm, an output gate
from ``q_proj``, partial RoPE: ``partial_rotary_factor``), every norm zero-centred (``rms_norm(x) * (1 +
weight)``); its linear attention's projections grouped per key head (``in_proj_qkvz``, ``in_proj_ba``).  MLPs:
Qwen2-MoE's (softmax top-k renormalised as ``norm_topk_prob`` says, one shared expert gated by a sigmoid), a layer
dense when in ``mlp_only_layers`` or when ``(i + 1) % decoder_sparse_step``.

Its MTP layer (``mtp.*`` in the checkpoint, dropped by transformers: ``from_hf(hf, mtp_state_dict=)``) is
Megatron-Core's MTP layer: ``MTP_WEIGHTS`` (the norms of the embedding and of the hidden state, ``fc`` over
``[embedding, hidden]``, the final norm) around a full-attention decoder layer ``mtp.layers.0`` (its MLP the
Mixture of Experts), whose weights are named as the decoder's; Qwen3.5 has the same.  The released configs do not
name its depths (no ``mtp_num_hidden_layers``; vLLM reads ``num_nextn_predict_layers``, default 1) while the
checkpoints hold one ``mtp.layers.0``: a config without ``mtp_num_hidden_layers`` has one (``mtp_depths_unnamed``)."""

from __future__ import annotations

from ..mapping import Weight
from ..mixers import GATED_ATTENTION, GATED_DELTANET, DeltaNet
from ..mixers.softmax import hf_attention_fields
from . import qwen2_moe
from .entry import QWEN3_ATTENTION_BIAS, Family

__all__ = ["FAMILY", "MTP_WEIGHTS", "hybrid_attention_fields", "read_attention"]

# Megatron-Core's MTP layer (under mtp.layers.0.) <- the checkpoint's (under mtp.); eh_proj is column-parallel
MTP_WEIGHTS = (
    Weight("enorm.weight", "pre_fc_norm_embedding.weight"),
    Weight("hnorm.weight", "pre_fc_norm_hidden.weight"),
    Weight("eh_proj.weight", "fc.weight", "rows"),
    Weight("final_layernorm.weight", "norm.weight"),
)


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
                linear_attention=GATED_DELTANET, mtp_weights=MTP_WEIGHTS, mtp_depths_unnamed=1)
