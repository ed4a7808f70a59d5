"""Karmarkar-Karp largest differencing for ``k`` parts, the planner's second opinion where parts hold few items.

Every item starts as a partial partition of ``k`` parts (the item alone, the other parts empty; with
``equal_size``, ``k`` items of neighbouring cost, one per part).  The two partial partitions whose parts differ
the most are merged, the heaviest part of one with the lightest of the other, until one partition is left.  It
beats LPT when parts hold a handful of items each (LPT's last placements are then coarse), and costs
``O(n k log n)``; the planner runs it only when ``n * k`` is small and keeps whichever plan is better balanced.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

__all__ = ["karmarkar_karp", "KK_MAX_WORK", "KK_MAX_ITEMS"]

KK_MAX_ITEMS = 512  # KK costs ~10 us of Python per item; with many items LPT is as good (error: its smallest item)
KK_MAX_WORK = 30_000  # items * parts above which the planner does not run KK (its cost grows with both)


def karmarkar_karp(cost: np.ndarray, k: int, *, equal_size: bool = False) -> list[list[int]]:
    """``k`` lists of item indices whose cost sums are balanced by largest differencing.  ``equal_size``: every
    part gets ``len(cost) / k`` items (``len(cost)`` must divide by ``k``).  Deterministic.

    >>> karmarkar_karp(np.array([8.0, 7, 6, 5, 4]), 2)
    [[1, 3, 4], [0, 2]]
    """
    order = np.argsort(cost, kind="stable").tolist()
    costs = cost.tolist()
    tie = itertools.count()
    heap = []
    if equal_size:
        if len(order) % k:
            raise ValueError(f"equal_size needs a multiple of k={k} items, got {len(order)}")
        groups = [order[i : i + k][::-1] for i in range(0, len(order), k)]
        for group in groups:
            _push(heap, tie, [costs[i] for i in group], [[i] for i in group])
    else:
        for i in order:
            _push(heap, tie, [costs[i]] + [0.0] * (k - 1), [[i]] + [[] for _ in range(k - 1)])
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, sums_a, parts_a = heapq.heappop(heap)
        _, _, sums_b, parts_b = heapq.heappop(heap)
        sums = [x + y for x, y in zip(sums_a, reversed(sums_b))]
        for part, other in zip(parts_a, reversed(parts_b)):
            part.extend(other)
        ranked = sorted(range(k), key=sums.__getitem__, reverse=True)
        _push(heap, tie, [sums[j] for j in ranked], [parts_a[j] for j in ranked])
    return [sorted(part) for part in heap[0][3]]


def _push(heap, tie, sums: list[float], parts: list[list[int]]) -> None:
    """A partial partition, its parts by decreasing sum; the heap pops the largest spread first."""
    heapq.heappush(heap, (sums[-1] - sums[0], next(tie), sums, parts))
