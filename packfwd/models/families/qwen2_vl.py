"""The language model of Qwen2-VL / Qwen2.5-VL: a Qwen2 decoder with multimodal RoPE
(``rope_parameters["mrope_section"]``), its text config under ``text_config``.  Its weights are Qwen2's under
another prefix (:mod:`packfwd.models.convert.hf_vl` renames them); the vision tower stays transformers'."""

from __future__ import annotations

from .entry import FULL_CAUSAL, Family
from .qwen2 import read_attention

__all__ = ["FAMILY"]

FAMILY = Family("qwen2_vl", ("qwen2_vl", "qwen2_5_vl", "qwen2_vl_text", "qwen2_5_vl_text"),
                read_attention=read_attention, unsupported=(FULL_CAUSAL,), rope_scalings=("default", "mrope"),
                mrope=True)
