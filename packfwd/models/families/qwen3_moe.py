"""Qwen3-MoE: Qwen3's attention; softmax-routed experts (``num_experts``, ``num_experts_per_tok``,
``moe_intermediate_size``, renormalised with ``norm_topk_prob``), a layer dense when in ``mlp_only_layers`` or
when ``(i + 1) % decoder_sparse_step``."""

from __future__ import annotations

from ..mlp.moe import Moe
from .entry import FULL_CAUSAL, QWEN3_ATTENTION_BIAS, Family
from .qwen3 import read_attention

__all__ = ["FAMILY", "HF_NAMES", "read_moe"]

# The config flag each Moe field is read from (what a refusal names).
HF_NAMES = dict(num_experts="num_experts", top_k="num_experts_per_tok", ffn_hidden_size="moe_intermediate_size",
                normalize_top_k="norm_topk_prob", dense_layers="mlp_only_layers",
                shared_ffn_hidden_size="shared_expert_intermediate_size")


def dense_layers(cfg) -> tuple[int, ...]:
    """Layer ``i`` is dense when in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``."""
    return tuple(i for i in range(cfg.num_hidden_layers)
                 if i in (cfg.mlp_only_layers or ()) or (i + 1) % cfg.decoder_sparse_step)


def read_moe(cfg, **extra) -> Moe | None:
    """Qwen3-MoE's MLPs (module docstring); None: every MLP dense.  ``extra``: more Moe fields (Qwen2-MoE's)."""
    dense = dense_layers(cfg)
    if not cfg.num_experts or len(dense) == cfg.num_hidden_layers:
        return None
    return Moe.read(HF_NAMES, num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                    ffn_hidden_size=cfg.moe_intermediate_size, normalize_top_k=bool(cfg.norm_topk_prob),
                    dense_layers=dense, **extra)


FAMILY = Family("qwen3_moe", ("qwen3_moe",), read_attention=read_attention, read_moe=read_moe,
                unsupported=(FULL_CAUSAL, QWEN3_ATTENTION_BIAS))
