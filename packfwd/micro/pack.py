"""Balanced bin packing under a capacity: the algorithm behind :func:`packfwd.micro.plan_micro_batches`.

Items (sequences) carry a *cost* (what is balanced: tokens or FLOPs) and a *size* (their padded length, what the
budget limits); ``bins`` bins (micro-batches) of one capacity ``cap`` on the size.  Why these steps:

1. **LPT, capacity-aware** (longest processing time first): items by decreasing cost go one by one to the
   least-loaded bin (in cost) that still has room for them.  LPT is within 4/3 of the optimal makespan and its
   final spread is about its last (smallest) items', which on LLM length distributions -- many short sequences
   after a few long ones -- means micro-batches within a few tokens of each other; the capacity is part of every
   placement,
   so a count that LPT fills is a feasible plan at once (verl's Karmarkar-Karp knows no capacity: it is re-run
   with more and more parts until every part happens to fit, on raw lengths).  Exact LPT is a heap walk, ~0.5 us
   per item in Python, so: with many bins it runs in numpy *rounds* (of the bins with room for the round's
   largest item, those within one item of the lightest take the next items, largest to lightest, one each); with
   few bins the heap walks *units*, runs of sorted items each ~1/(4 bins) of the load still to place, single
   items again at the end, where LPT's balance is decided.
2. **Karmarkar-Karp** as a second opinion on small batches (at most ``KK_MAX_ITEMS`` items, ``kk.py``): with few
   items per bin it balances better than LPT; kept when within the capacity and lighter in its costliest bin.
   Then pairwise moves and swaps between the costliest bin and the others (``refine.py``; above
   ``REFINE_ALL_MAX_ITEMS`` items only with the ``POLISH_PARTNERS`` lightest bins, ``POLISH_ROUNDS`` times, to
   stay within a few milliseconds).
3. **Best fit** when LPT cannot place an item although the count might suffice (a tight budget: LPT spreads the
   free room over every bin, best fit fills bins one by one; ``bestfit.py``).  It runs in numpy *rounds*:
   the next items, largest first, each to the fullest bin it fits, at most one per bin and round; exact
   best-fit decreasing (a Python walk, ~1 us per item) only where the rounds cannot place everything.  Best fit
   knows no cost, so with a cost other than tokens LPT first gets up to 2% more micro-batches (none below 50),
   which usually lets it balance -- unless a bound shows that more micro-batches cannot lower the costliest one
   (``costliest_bounds``: the batch has more sequences of the largest cost per token than the bins can hold
   apart, e.g. many RL responses cut at a generation limit of half the budget), when the fewest are taken.
   On small batches (``EXACT_MAX_ITEMS`` items, ``EXACT_MAX_BINS`` bins) where best fit fails too, a bounded
   branch and bound (``fit_exact``) before one more micro-batch: near the lower bound the heuristics miss
   packings that exist (25 sequences of 50-90 tokens into 6 micro-batches of 300).
4. **Ranks** (``ranks.py``): the bins dealt to DP ranks, each rank the same number, then polished.
"""

from __future__ import annotations

import heapq

import numpy as np

from .bestfit import EXACT_MAX_BINS, EXACT_MAX_ITEMS, best_fit, best_fit_rounds, by_decreasing_size, fit_exact
from .bestfit import costliest_bounds
from .kk import KK_MAX_ITEMS, KK_MAX_WORK, karmarkar_karp
from .refine import REFINE_ALL_MAX_ITEMS, refine

__all__ = ["pack", "balanced", "lpt", "lpt_order"]

POLISH_PARTNERS, POLISH_ROUNDS = 16, 16  # exchanges after LPT on large batches: lightest bins tried, at most
ROUNDS_MIN_BINS = 64  # below this many bins the exact heap walk is faster than numpy rounds


def pack(cost: np.ndarray, size: np.ndarray, *, ranks: int, count: int, step: int, cap: int,
         cost_is_size: bool) -> tuple[np.ndarray, int]:
    """``([n] bin of each item, count)``: the items packed into ``ranks * count`` bins of total size ``<= cap``,
    ``count`` the first of ``count, count + step, ...`` that packs.  Every item must fit alone.  Deterministic.

    At each count: LPT (or KK); when it cannot place everything, best fit at the same count -- unless the cost is
    not the size: a size-tight best-fit packing can be far from balanced in cost, so LPT first gets up to 2% more
    micro-batches (none below 50), which usually lets it balance.  That detour is skipped when
    ``costliest_bounds`` shows that no packing with up to that many more bins has a cheaper costliest bin than
    every packing at this count.  On small batches a bounded exact search (``fit_exact``) has the last word
    before the count grows.
    """
    order = None  # LPT's item order, sorted once: later counts scale the cost shares by under 2%
    while True:
        if order is None:
            order = lpt_order(cost, size, ranks * count, cap)
        got = balanced(cost, size, ranks * count, cap, order)
        if got is not None:
            _polish(got, cost, size, ranks * count, cap)
            return got, count
        extra = 0 if cost_is_size else count // 50
        # Skip the detour when even its largest count has a lower bound on the costliest bin that every packing
        # at this count meets (the bound only falls as bins are added, the upper one does not depend on them).
        lower, upper = costliest_bounds(cost, size, ranks * (count + extra * step), cap) if extra else (0.0, 0.0)
        if lower < upper * (1 - 1e-12):
            for c in range(count + step, count + extra * step + 1, step):
                got = balanced(cost, size, ranks * c, cap, order)
                if got is not None:
                    _polish(got, cost, size, ranks * c, cap)
                    return got, c
        got = best_fit_rounds(cost, size, ranks * count, cap)
        if got is None:
            got = best_fit(cost, size, ranks * count, cap)
        if got is None and len(size) <= EXACT_MAX_ITEMS and ranks * count <= EXACT_MAX_BINS:
            got = fit_exact(cost, size, ranks * count, cap)  # small batches: a bounded exact search
        if got is not None:
            _polish(got, cost, size, ranks * count, cap)
            return got, count
        count += step  # terminates: with a bin per item LPT always packs


def _polish(bin_of: np.ndarray, cost: np.ndarray, size: np.ndarray, bins: int, cap: int) -> None:
    """Exchanges between the costliest bin and the others (small batches), or the few lightest (large ones)."""
    if len(cost) <= REFINE_ALL_MAX_ITEMS:
        refine(bin_of, np.arange(bins), cost, size, cap)
    else:
        refine(bin_of, np.arange(bins), cost, size, cap, partners=POLISH_PARTNERS, rounds=POLISH_ROUNDS)


def balanced(cost: np.ndarray, size: np.ndarray, bins: int, cap: int, order=None) -> np.ndarray | None:
    """LPT's packing, or Karmarkar-Karp's where that is cheap to run, within the capacity, leaves no bin empty
    that need not be, and has a lighter costliest bin."""
    got = lpt(cost, size, bins, cap, order)
    n = len(cost)
    if n == 0 or n * bins > KK_MAX_WORK or n > KK_MAX_ITEMS:
        return got
    parts = karmarkar_karp(cost, bins)
    if min(n, bins) > sum(1 for part in parts if part):
        return got
    alt = np.empty(n, dtype=np.int64)
    for b, part in enumerate(parts):
        alt[part] = b
    if np.bincount(alt, weights=size, minlength=bins).max() > cap:
        return got
    if got is None or _costliest(alt, cost, bins) < _costliest(got, cost, bins):
        return alt
    return got


def _costliest(bin_of: np.ndarray, cost: np.ndarray, bins: int) -> float:
    return float(np.bincount(bin_of, weights=cost, minlength=bins).max())


def lpt(cost: np.ndarray, size: np.ndarray, bins: int, cap: int, order=None) -> np.ndarray | None:
    """``[n]`` bin of each item by capacity-aware LPT, or None when some item finds no bin with room.  ``order``:
    the items by decreasing share (``lpt_order``), when the caller has it."""
    if len(cost) == 0:
        return np.zeros(0, dtype=np.int64)
    walk = _lpt_rounds if bins >= ROUNDS_MIN_BINS else _lpt_heap
    return walk(_share(cost, bins), size, lpt_order(cost, size, bins, cap) if order is None else order, bins, cap)


def lpt_order(cost: np.ndarray, size: np.ndarray, bins: int, cap: int) -> np.ndarray:
    """The items by decreasing share, LPT's order, ties in index order.  With the planner's costs (tokens,
    FLOPs) the share grows with the size, so this is the sizes' order: a radix sort of narrow ints, ~10x faster
    than sorting the float shares (which a cost function that does not grow with the size gets)."""
    share = _share(cost, bins)
    order = by_decreasing_size(size)
    if len(order) > 1 and (np.diff(share[order]) > 0).any():
        order = np.argsort(-share, kind="stable")
    return order


def _share(cost: np.ndarray, bins: int) -> np.ndarray:
    """Each item's share of the mean cost per bin: a bin's load is the sum of its items' (the capacity is not a
    load but a constraint, checked at every placement)."""
    return cost / (cost.sum() / bins or 1.0)


def _lpt_heap(w, size, order, bins, cap):
    """LPT with a heap, over *units*: runs of consecutive sorted items, each about ``1 / (UNITS_PER_BIN * bins)``
    of the load still to place.  The long tail of short items then costs a few thousand heap steps, not one per
    item, and the last units (the smallest items) are single items again, which is what sets LPT's final balance.
    A unit that fits no bin whole is placed item by item."""
    ws, ss = w[order], size[order]
    starts = np.union1d(np.arange(min(bins, len(order))), _unit_starts(ws, bins))  # a bin each first
    ends = np.append(starts[1:], len(order))
    unit_w, unit_s = (np.add.reduceat(a, starts) for a in (ws, ss))
    heap = _Heap(bins, cap)
    placed = np.empty(len(order), dtype=np.int64)  # bin of each item, in sorted order
    for u, (uw, us) in enumerate(zip(unit_w.tolist(), unit_s.tolist())):
        b = heap.place(uw, us, int(ends[u] - starts[u]))
        if b >= 0:
            placed[starts[u] : ends[u]] = b
            continue
        for j in range(int(starts[u]), int(ends[u])):
            placed[j] = heap.place(float(ws[j]), int(ss[j]))
            if placed[j] < 0:
                return None
    out = np.empty(len(order), dtype=np.int64)
    out[order] = placed
    return out


UNITS_PER_BIN = 4


def _unit_starts(share: np.ndarray, bins: int) -> np.ndarray:
    """Where each unit starts: items (sorted by decreasing share) whose remaining load ``R`` (this item's share
    and all after it) falls in the same interval of ``log R`` of width ``1 / (UNITS_PER_BIN * bins)``."""
    remaining = np.cumsum(share[::-1])[::-1]
    positive = remaining[remaining > 0]
    if len(positive) == 0:
        return np.zeros(1, dtype=np.int64)
    level = np.floor(UNITS_PER_BIN * bins * np.log(remaining[0] / np.maximum(remaining, positive.min() / 2)))
    return np.flatnonzero(np.r_[True, level[1:] != level[:-1]])


class _Heap:
    """Bins in a heap of (load, items, bin) (ties: the bin with fewer items, so that items of no cost spread
    too)."""

    def __init__(self, bins: int, cap: int):
        self.heap = [(0.0, 0, b) for b in range(bins)]
        self.fill = [0] * bins
        self.cap = cap

    def place(self, w: float, s: int, items: int = 1) -> int:
        """Put an item (or a unit of ``items``) in the least-loaded bin with room for it; its bin, or -1 when none
        has room."""
        heap, fill, cap = self.heap, self.fill, self.cap
        held = []
        while heap and fill[heap[0][2]] + s > cap:
            held.append(heapq.heappop(heap))
        b = heap[0][2] if heap else -1
        if b >= 0:
            fill[b] += s
            heapq.heapreplace(heap, (heap[0][0] + w, heap[0][1] + items, b))
        for entry in held:
            heapq.heappush(heap, entry)
        return b


def _lpt_rounds(w, size, order, bins, cap):
    """LPT in rounds (see the module docstring): each round, the bins that have room for its first item, by
    load; those within one item of the lightest take the next items, costliest to lightest, one each.  Every item
    of a round fits (a round ends before an item larger than its first), so a round fails only when no bin has
    room for its first item: then LPT cannot place it.  Ties between equally loaded bins go to the lower bin id,
    so zero-cost items spread too."""
    load = np.zeros(bins)
    fill = np.zeros(bins, dtype=np.int64)
    out = np.empty(len(w), dtype=np.int64)
    w_sorted, s_sorted = w[order], size[order]
    pos, n = 0, len(order)
    while pos < n:
        fits = np.flatnonzero(fill <= cap - s_sorted[pos])
        if len(fits) == 0:
            return None
        fit_load = load[fits]
        by_load = np.argsort(fit_load, kind="stable")
        ranked = fit_load[by_load]
        m = min(int(np.searchsorted(ranked, ranked[0] + w_sorted[pos], side="right")), n - pos)
        larger = np.flatnonzero(s_sorted[pos + 1 : pos + m] > s_sorted[pos])  # a cost that does not grow with size
        m = 1 + int(larger[0]) if len(larger) else m  # a round's items all fit where its first does
        near, end = fits[by_load[:m]], pos + m
        load[near] += w_sorted[pos:end]
        fill[near] += s_sorted[pos:end]
        out[order[pos:end]] = near
        pos = end
    return out
