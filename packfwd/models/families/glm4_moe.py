"""GLM-4.5 (``glm4_moe``): softmax attention with a bias on q, k and v when ``attention_bias`` says so, QK-norm when
``use_qk_norm`` does, partial RoPE (``partial_rotary_factor``: the first ``int(head_dim * factor)`` channels
rotate); DeepSeek-V3's Mixture of Experts (:func:`packfwd.models.families.deepseek_v3.read_moe`)."""

from __future__ import annotations

from ..mixers.softmax import hf_attention_fields
from .deepseek_v3 import read_moe
from .entry import Family

__all__ = ["FAMILY", "read_attention"]


def read_attention(cfg) -> dict:
    """GLM-4.5's attention (module docstring)."""
    return hf_attention_fields(cfg, qkv_bias=getattr(cfg, "attention_bias", False),
                               qk_norm=getattr(cfg, "use_qk_norm", False), partial_rope=True)


FAMILY = Family("glm4_moe", ("glm4_moe",), read_attention=read_attention, read_moe=read_moe)
