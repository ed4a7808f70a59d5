"""Qwen3: Llama's layers with QK-norm (RMSNorm over ``head_dim`` on q and k before RoPE; the config's explicit
``head_dim``), no biases, full causal attention only."""

from __future__ import annotations

from ..mixers.softmax import hf_attention_fields
from .entry import FULL_CAUSAL, QWEN3_ATTENTION_BIAS, Family

__all__ = ["FAMILY", "read_attention"]


def read_attention(cfg) -> dict:
    """Qwen3's attention: QK-norm always."""
    return hf_attention_fields(cfg, qk_norm=True)


FAMILY = Family("qwen3", ("qwen3",), read_attention=read_attention, unsupported=(FULL_CAUSAL, QWEN3_ATTENTION_BIAS))
