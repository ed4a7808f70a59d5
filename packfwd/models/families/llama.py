"""Llama (1-3.x): grouped-query softmax attention, dense SwiGLU MLPs; ``attention_bias`` with ``mlp_bias`` put a
bias on every linear (both or neither: Megatron-Core's ``add_bias_linear`` is one switch); Llama-3 RoPE scaling."""

from __future__ import annotations

from .entry import Family

__all__ = ["FAMILY"]

FAMILY = Family("llama", ("llama",), linear_bias_flags=("attention_bias", "mlp_bias"))
