"""Mixtral: Llama's attention (full causal only: no ``sliding_window``); every layer softmax top-k of
``num_local_experts`` experts as wide as ``intermediate_size``, always renormalised (one expert per token: weight
1, as transformers computes it), without router jitter."""

from __future__ import annotations

from ..mlp.moe import Moe
from .entry import Family

__all__ = ["FAMILY", "HF_NAMES", "read_moe"]

# The config flag each Moe field is read from (what a refusal names).
HF_NAMES = dict(num_experts="num_local_experts", top_k="num_experts_per_tok", ffn_hidden_size="intermediate_size")


def read_moe(cfg) -> Moe:
    """Mixtral's MLPs (module docstring)."""
    return Moe.read(HF_NAMES, num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
                    ffn_hidden_size=cfg.intermediate_size)


FAMILY = Family("mixtral", ("mixtral",), read_moe=read_moe, unsupported=(
    ("sliding_window", "packfwd's attention is full causal; set sliding_window=None"),
    ("router_jitter_noise", "packfwd's router adds no jitter (Megatron-Core's would also jitter in eval); "
                            "set router_jitter_noise=0.0")))
