"""Parallel building blocks that need a process group: context-parallel attention over the THD zigzag layout and
the CP all-gather under it, a point-to-point pipeline schedule over virtual stages, and agreeing on bad input
across ranks.

The public names are re-exported here: ``context_parallel_attention``, ``zigzag_to_global``, ``all_gather_cp``,
``pipeline_forward_backward``, ``check_across_ranks``; ``context`` also holds ``plan_zigzag_attention`` (the index
tensors of one rank's attention), ``ZigzagAttentionPlan`` and ``global_to_zigzag`` (``zigzag_to_global``'s inverse);
``heads`` the all-to-all that trades a CP rank's zigzag tokens for whole sequences of its share of the heads
(``zigzag_to_heads``, ``heads_to_zigzag``, ``all_to_all_cp``: context parallelism for Gated DeltaNet layers).
"""

from .agree import check_across_ranks as check_across_ranks
from .context import context_parallel_attention as context_parallel_attention
from .context import zigzag_to_global as zigzag_to_global
from .gather import all_gather_cp as all_gather_cp
from .pipeline import pipeline_forward_backward as pipeline_forward_backward

__all__ = ["all_gather_cp", "check_across_ranks", "context_parallel_attention", "pipeline_forward_backward",
           "zigzag_to_global"]
