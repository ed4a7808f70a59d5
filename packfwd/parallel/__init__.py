"""Parallel building blocks that need a process group: context-parallel attention over the THD zigzag layout,
a point-to-point pipeline schedule over virtual stages, and agreeing on bad input across ranks."""

from .checks import check_across_ranks as check_across_ranks
from .context import ZigzagAttentionPlan as ZigzagAttentionPlan
from .context import all_gather_cp as all_gather_cp
from .context import context_parallel_attention as context_parallel_attention
from .context import plan_zigzag_attention as plan_zigzag_attention
from .context import zigzag_global_index as zigzag_global_index
from .context import zigzag_local_index as zigzag_local_index
from .context import zigzag_to_global as zigzag_to_global
from .pipeline import pipeline_forward_backward as pipeline_forward_backward

__all__ = [
    "ZigzagAttentionPlan",
    "all_gather_cp",
    "check_across_ranks",
    "context_parallel_attention",
    "pipeline_forward_backward",
    "plan_zigzag_attention",
    "zigzag_global_index",
    "zigzag_local_index",
    "zigzag_to_global",
]
