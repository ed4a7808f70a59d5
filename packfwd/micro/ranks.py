"""Micro-batches to DP ranks: every rank the same number, rank totals balanced.

The micro-batches, by decreasing cost, are dealt in rounds of ``dp_size``, each round's heaviest to the lightest
rank so far (with many rounds, the micro-batches being balanced already, back and forth: a vectorised snake); on
small batches Karmarkar-Karp into parts of equal size where that leaves the costliest rank lighter, and each
rank's sequences re-split by Karmarkar-Karp where that lowers its costliest micro-batch.  The planner then
exchanges sequences between the costliest rank and the lightest (``refine.py``) without raising the costliest
micro-batch, and orders each rank's micro-batches for a pipeline schedule.
"""

from __future__ import annotations

import numpy as np

from .kk import KK_MAX_ITEMS, KK_MAX_WORK, karmarkar_karp

__all__ = ["deal_to_ranks", "repartition_ranks", "pipeline_order"]

SNAKE_MIN_ROUNDS = 64  # micro-batches per rank above which ranks are dealt by the vectorised snake


def deal_to_ranks(bin_cost: np.ndarray, ranks: int) -> np.ndarray:
    """``[ranks, bins // ranks]`` bin ids with balanced rank totals: bins by decreasing cost dealt in rounds of
    ``ranks``, the heaviest bin of a round to the lightest rank so far (with many rounds, the bins being already
    balanced: back and forth, a vectorised snake); or, where cheap, Karmarkar-Karp into parts of equal size, when
    that leaves the costliest rank lighter."""
    per_rank = len(bin_cost) // ranks
    order = np.argsort(-bin_cost, kind="stable")
    if per_rank > SNAKE_MIN_ROUNDS:
        snake = order.reshape(per_rank, ranks).copy()
        snake[1::2] = snake[1::2, ::-1]
        return np.ascontiguousarray(snake.T)
    costs, order = bin_cost.tolist(), order.tolist()
    total = [0.0] * ranks
    dealt = [[0] * per_rank for _ in range(ranks)]
    for r in range(per_rank):
        lightest = sorted(range(ranks), key=total.__getitem__)
        for rank, b in zip(lightest, order[r * ranks : (r + 1) * ranks]):
            dealt[rank][r] = b
            total[rank] += costs[b]
    out = np.asarray(dealt, dtype=np.int64).reshape(ranks, per_rank)
    if ranks > 1 and len(bin_cost) <= KK_MAX_ITEMS and len(bin_cost) * ranks <= KK_MAX_WORK:
        alt = np.asarray(karmarkar_karp(bin_cost, ranks, equal_size=True), dtype=np.int64).reshape(ranks, per_rank)
        if bin_cost[alt].sum(axis=1).max() < bin_cost[out].sum(axis=1).max():
            return alt
    return out


def pipeline_order(dealt: np.ndarray, bin_cost: np.ndarray) -> np.ndarray:
    """Each rank's bins (``[ranks, count]``) with the cheapest at both ends and the costliest in the middle: a
    pipeline schedule's warm-up and cool-down expose the first and last micro-batches, so these should be short."""
    ascending = np.take_along_axis(dealt, np.argsort(bin_cost[dealt], axis=1, kind="stable"), axis=1)
    return np.concatenate([ascending[:, 0::2], ascending[:, 1::2][:, ::-1]], axis=1)


def repartition_ranks(bin_of: np.ndarray, dealt: np.ndarray, cost: np.ndarray, size: np.ndarray, cap: int) -> None:
    """Each rank's items packed again into its ``count`` bins by Karmarkar-Karp (the rank's items only, so the
    rank totals stay), kept where that lowers the rank's costliest bin within the capacity; in place."""
    ranks, count = dealt.shape
    if len(cost) > KK_MAX_ITEMS or len(cost) * count > KK_MAX_WORK:
        return
    rank_of = np.empty(ranks * count, dtype=np.int64)
    rank_of[dealt] = np.arange(ranks)[:, None]
    for r in range(ranks):
        items = np.flatnonzero(rank_of[bin_of] == r)
        if not len(items):
            continue
        parts = karmarkar_karp(cost[items], count)
        if min(len(items), count) > sum(1 for part in parts if part):
            continue
        new = np.empty(len(items), dtype=np.int64)
        for k, part in enumerate(parts):
            new[part] = dealt[r, k]
        old_cost = np.bincount(bin_of[items], weights=cost[items], minlength=len(rank_of))[dealt[r]].max()
        new_cost = np.bincount(new, weights=cost[items], minlength=len(rank_of))
        if new_cost.max() < old_cost and np.bincount(new, weights=size[items], minlength=len(rank_of)).max() <= cap:
            bin_of[items] = new
