"""Qwen2 (and Qwen2.5): Llama's layers with a bias on q, k and v (always, whatever the config says), full causal
attention only."""

from __future__ import annotations

from ..mixers.softmax import hf_attention_fields
from .entry import FULL_CAUSAL, Family

__all__ = ["FAMILY", "read_attention"]


def read_attention(cfg) -> dict:
    """Qwen2's attention: a bias on q, k and v always."""
    return hf_attention_fields(cfg, qkv_bias=True)


FAMILY = Family("qwen2", ("qwen2",), read_attention=read_attention, unsupported=(FULL_CAUSAL,))
