"""Pairwise refinement of a packing: move or swap items between the costliest group (a micro-batch, or a DP
rank's micro-batches) and any other while that lowers the larger of the two, never making a micro-batch costlier
than ``ceiling``, breaking the capacity, or emptying a micro-batch.  LPT and Karmarkar-Karp leave their largest
errors in their last placements; a few exchanges with the best-matched partner remove most of them.  Runs where
a round weighs at most ``REFINE_MAX_WORK`` candidate exchanges, for at most ``REFINE_ROUNDS`` rounds and
``REFINE_BUDGET`` candidates in all: a bounded, deterministic amount of work.
"""

from __future__ import annotations

import numpy as np

__all__ = ["refine", "REFINE_MAX_WORK", "REFINE_ROUNDS", "REFINE_ALL_MAX_ITEMS"]

REFINE_MAX_WORK = 100_000  # candidate exchanges per round above which refinement is skipped (its cost)
REFINE_ROUNDS = 32  # exchanges at most
REFINE_BUDGET = 400_000  # candidate exchanges over all rounds (fewer rounds where each weighs more)
REFINE_ALL_MAX_ITEMS = 1024  # batches up to this size are refined against every bin, larger ones against a few


def refine(bin_of: np.ndarray, group_of_bin: np.ndarray, cost: np.ndarray, size: np.ndarray, cap: int,
           ceiling: float = np.inf, partners: int | None = None, rounds: int = REFINE_ROUNDS) -> None:
    """Lower the costliest group by at most ``rounds`` exchanges, in place (``bin_of`` changes; bins keep their
    group).  The partner is any other group, or one of the ``partners`` lightest."""
    bins, groups = len(group_of_bin), int(group_of_bin.max()) + 1
    if groups < 2:
        return
    per_group = len(cost) // groups
    reach = len(cost) + bins if partners is None else partners * (per_group + bins // groups)
    work = per_group * reach  # candidate exchanges per round
    if work > REFINE_MAX_WORK:
        return
    rounds = min(rounds, max(1, REFINE_BUDGET // max(work, 1)))
    load = np.bincount(bin_of, weights=cost, minlength=bins)
    fill = np.bincount(bin_of, weights=size, minlength=bins).astype(np.int64)
    count = np.bincount(bin_of, minlength=bins)
    item_group = group_of_bin[bin_of]  # kept up to date
    for _ in range(rounds):
        total = np.bincount(group_of_bin, weights=load, minlength=groups)
        heavy = int(np.argmax(total))
        partner = np.zeros(groups, dtype=bool)
        if partners is None or partners + 1 >= groups:
            partner[:] = True
        else:
            partner[np.argpartition(total, partners)[: partners + 1]] = True
        partner[heavy] = False
        a = np.flatnonzero(item_group == heavy)
        b = np.flatnonzero(partner[item_group])
        targets = np.flatnonzero(partner[group_of_bin])  # where a move can go
        if len(a) == 0:
            return
        pick = _best_exchange(a, b, targets, bin_of, group_of_bin, total, load, fill, count, cost, size, cap, ceiling)
        if pick is None:
            return
        i, j = pick
        src = int(bin_of[a[i]])
        dst = int(bin_of[b[j]]) if j < len(b) else int(targets[j - len(b)])
        moved = [(int(a[i]), src, dst)] + ([(int(b[j]), dst, src)] if j < len(b) else [])
        for item, frm, to in moved:
            bin_of[item] = to
            item_group[item] = group_of_bin[to]
            load[frm] -= cost[item]
            load[to] += cost[item]
            fill[frm] -= size[item]
            fill[to] += size[item]
            count[frm] -= 1
            count[to] += 1


def _best_exchange(a, b, targets, bin_of, group_of_bin, total, load, fill, count, cost, size, cap, ceiling):
    """``(i, j)``: item ``a[i]`` for item ``b[j]``, or (``j >= len(b)``) for nothing into bin
    ``targets[j - len(b)]``, that gives the lowest larger total of the two groups, below the heavy one's; None
    when no exchange lowers it within the capacity, the ceiling and the no-empty rule."""
    col_bin = np.concatenate([bin_of[b], targets])
    col_cost = np.concatenate([cost[b], np.zeros(len(targets))])
    col_size = np.concatenate([size[b], np.zeros(len(targets), dtype=size.dtype)])
    row_bin = bin_of[a]
    d = cost[a][:, None] - col_cost[None, :]  # cost the heavy group gives away
    grow = size[a][:, None] - col_size[None, :]  # size the other bin gains
    heavy = total[group_of_bin[row_bin[0]]]
    worse = np.maximum(heavy - d, total[group_of_bin[col_bin]][None, :] + d)
    ok = (worse < heavy) & (fill[col_bin][None, :] + grow <= cap) & (fill[row_bin][:, None] - grow <= cap)
    ok &= (load[col_bin][None, :] + d <= ceiling) & (load[row_bin][:, None] - d <= ceiling)
    ok[:, len(b):] &= (count[row_bin] > 1)[:, None]  # a move must not empty its micro-batch
    if not ok.any():
        return None
    i, j = np.unravel_index(int(np.argmin(np.where(ok, worse, np.inf))), ok.shape)
    return int(i), int(j)
