"""Best fit, the tight packer of :mod:`packfwd.micro.pack`, and bounds on the costliest bin of any packing.

When a budget is tight, LPT (which spreads the free room over every bin) can fail to place an item at a count
that still suffices; best fit (each item into the fullest bin it fits) fills bins one by one and usually does not.
``best_fit_rounds`` runs it in numpy rounds, ``best_fit`` is the exact Python walk behind it.
``fit_exact`` is a bounded branch and bound for small batches, where the heuristics can miss a count that fits.
``costliest_bounds`` tells the planner when more bins cannot make the costliest one cheaper.
"""

from __future__ import annotations

import bisect

import numpy as np

__all__ = ["best_fit", "best_fit_rounds", "by_decreasing_size", "costliest_bounds", "fit_exact"]

EXACT_MAX_ITEMS, EXACT_MAX_BINS = 64, 16  # fit_exact runs on batches up to this size (items, bins)
EXACT_NODES = 10_000  # its work budget: steps of the search before it gives up (~10 ms of Python)


def costliest_bounds(cost: np.ndarray, size: np.ndarray, bins: int, cap: int) -> tuple[float, float]:
    """``(lower, upper)``: bounds on the costliest bin of *any* packing of the items into ``bins`` bins of
    capacity ``cap`` (the upper one for packings within the capacity).

    Lower: the costliest item; the mean; and, as in LPT's analysis, for every ``j >= 1`` with more than ``j * bins``
    items, some bin holds ``j + 1`` of the ``j * bins + 1`` costliest, so at least the ``j + 1`` cheapest of them.
    Upper: a bin's cost is at most its size times the largest cost per unit of size, so ``cap`` times that (or
    ``inf`` when an item of size 0 has a cost); it does not depend on ``bins``, and the lower bound only falls as
    bins are added.  So when the lower bound at ``bins + k`` reaches the upper one, no packing into ``bins + k``
    bins or fewer has a cheaper costliest bin than any packing into ``bins``: the fewest bins are the right choice.
    """
    n = len(cost)
    if n == 0:
        return 0.0, 0.0
    desc = cost[by_decreasing_size(size)]
    if (np.diff(desc) > 0).any():  # a cost that does not grow with the size
        desc = np.sort(cost)[::-1]
    lower = max(float(desc[0]), float(desc.sum()) / bins)
    if n > bins:
        j = np.arange(1, (n - 1) // bins + 1)  # j * bins + 1 <= n
        run = np.concatenate([[0.0], np.cumsum(desc)])
        lower = max(lower, float((run[j * bins + 1] - run[j * bins - j]).max()))
    zero = size == 0
    if (cost[zero] > 0).any():
        return lower, float("inf")
    ratio = cost[~zero] / size[~zero]
    return lower, float(ratio.max(initial=0.0)) * cap


def by_decreasing_size(size: np.ndarray) -> np.ndarray:
    """``argsort(-size)``, stable, as a radix sort where the sizes fit in 16 bits."""
    top = int(size.max(initial=0))
    return np.argsort(-size.astype(np.int16 if top < 2**15 else np.int64), kind="stable")


def best_fit_rounds(cost: np.ndarray, size: np.ndarray, bins: int, cap: int) -> np.ndarray | None:
    """``[n]`` bin of each item by best fit in rounds, or None when an item finds no bin with room.

    Items by decreasing size; each round takes the next ``bins`` of them and gives each the fullest bin it fits
    (the first fitting room in ascending order), at most one item per bin: items whose first fitting bin was
    already claimed in the round by a larger item of another size wait for the next round, when the rooms are
    sorted again.  Each round places at least its largest item, so a packing needs at most one round per item;
    on LLM length distributions a few dozen.  Then no bin is left empty while another holds two items.
    """
    n = len(size)
    order = by_decreasing_size(size)
    s_sorted = size[order]
    fill = np.zeros(bins, dtype=np.int16 if cap < 2**15 else np.int64)  # narrow: the rooms sort by radix
    out = np.empty(n, dtype=np.int64)
    pending = np.arange(n)  # positions in the sorted order still to place, largest first
    idx = np.arange(min(n, bins))
    while len(pending):
        room = cap - fill
        by_room = np.argsort(room, kind="stable")
        take = pending[:bins]
        s = s_sorted[take]
        first = np.searchsorted(room[by_room], s, side="left")  # non-increasing: s is
        if first[0] >= bins:
            return None
        # Items of equal `first` (a run) claim consecutive bins from it, up to where the previous run starts.
        k = len(first)
        new_run = np.empty(k, dtype=bool)
        new_run[0], new_run[1:] = True, first[1:] != first[:-1]
        run_start = np.maximum.accumulate(np.where(new_run, idx[:k], 0))
        before = np.empty(k, dtype=np.int64)
        before[0], before[1:] = bins, first[:-1]
        target = first + idx[:k] - run_start
        won = target < before[run_start]
        b = by_room[target[won]]
        fill[b] += s[won]
        out[order[take[won]]] = b
        pending = np.concatenate([take[~won], pending[bins:]])
    return _fill_empty(out, cost, bins)


def best_fit(cost: np.ndarray, size: np.ndarray, bins: int, cap: int) -> np.ndarray | None:
    """``[n]`` bin of each item by best-fit decreasing on the size (each item into the fullest bin it fits), or
    None; then empty bins take the costliest item of the heaviest bins, so no bin is empty while another holds
    two items."""
    order = np.argsort(-size, kind="stable").tolist()
    sizes = size.tolist()
    keys = list(range(bins))  # fill * bins + bin, sorted: the fullest bin that fits is one bisect away
    out = [0] * len(sizes)
    for i in order:
        k = bisect.bisect_right(keys, (cap - sizes[i]) * bins + bins - 1) - 1
        if k < 0:
            return None
        key = keys.pop(k)
        bisect.insort(keys, key + sizes[i] * bins)
        out[i] = key % bins
    return _fill_empty(np.asarray(out, dtype=np.int64), cost, bins)


def _fill_empty(out: np.ndarray, cost: np.ndarray, bins: int) -> np.ndarray:
    counts = np.bincount(out, minlength=bins)
    loads = np.bincount(out, weights=cost, minlength=bins)
    for empty in np.flatnonzero(counts == 0).tolist():
        donors = np.flatnonzero(counts >= 2)
        if len(donors) == 0:
            break
        donor = int(donors[np.argmax(loads[donors])])
        members = np.flatnonzero(out == donor)
        moved = int(members[np.argmax(cost[members])])
        out[moved] = empty
        counts[donor] -= 1
        counts[empty] += 1
        loads[donor] -= cost[moved]
        loads[empty] += cost[moved]
    return out


class _OutOfBudget(Exception):
    pass


def fit_exact(cost: np.ndarray, size: np.ndarray, bins: int, cap: int, nodes: int = EXACT_NODES) -> np.ndarray | None:
    """``[n]`` bin of each item in a packing within the capacity found by branch and bound, or None when there is
    none or the search used up ``nodes`` steps.

    Bin completion (Korf): bin after bin, the largest item left and a set of others that fills it (as many of
    the largest as fit first).  Pruned: the room left unused over all bins (``bins * cap`` minus the sizes) is
    fixed, so a bin may leave at most what is still allowed; only undominated sets are tried -- none that leaves
    room for an item left over, or for a larger one left over in place of one taken (any packing can move or swap
    that item here and stay valid); items of one size are interchangeable; a state (items left, bins left) that
    failed is not explored again.  Then no bin is left empty while another holds two items.
    """
    values, counts = np.unique(size, return_counts=True)
    sizes, counts = values[::-1].tolist(), counts[::-1].tolist()  # distinct sizes, decreasing, and how many
    spare = bins * cap - int(size.sum())  # room left unused over all bins, whatever the packing
    if spare < 0:
        return None
    failed: set = set()
    filled: list = []  # per bin: the sizes it holds
    left = [nodes]

    def solve(bins_left: int, spare: int) -> bool:
        if not any(counts):
            return True
        key = (tuple(counts), bins_left)
        if bins_left == 0 or key in failed or sum(c for v, c in zip(sizes, counts) if 2 * v > cap) > bins_left:
            return False
        first = next(j for j, c in enumerate(counts) if c)
        counts[first] -= 1
        for take in _completions(sizes, counts, first, cap - sizes[first], spare, left):
            for j, k in take:
                counts[j] -= k
            filled.append([sizes[first]] + [sizes[j] for j, k in take for _ in range(k)])
            room = cap - sum(filled[-1])
            if solve(bins_left - 1, spare - room):
                return True
            filled.pop()
            for j, k in take:
                counts[j] += k
        counts[first] += 1
        failed.add(key)
        return False

    try:
        if not solve(bins, spare):
            return None
    except _OutOfBudget:
        return None
    of_size: dict = {}
    for i in np.argsort(-size, kind="stable").tolist():
        of_size.setdefault(int(size[i]), []).append(i)
    out = np.empty(len(size), dtype=np.int64)
    for b, held in enumerate(filled):
        for v in held:
            out[of_size[v].pop()] = b
    return _fill_empty(out, cost, bins)


def _completions(sizes: list, counts: list, start: int, room: int, spare: int, left: list):
    """The maximal sets of items left (``[(size index, how many)]``) that fit in ``room`` and leave at most
    ``spare`` of it, as many of the largest as fit first (lazily: the caller restores ``counts`` between sets)."""
    rest = [0] * (len(sizes) + 1)  # rest[j]: the sizes of every item left from size index j on
    for j in range(len(sizes) - 1, start - 1, -1):
        rest[j] = rest[j + 1] + sizes[j] * counts[j]
    take: list = []

    def walk(j: int, room: int, smallest_left: float, limit: float):
        # limit: what the set must leave less than: the smallest item left over (else it is not maximal) and,
        # for each item taken, how much larger the next larger item left over is (else swap the two)
        left[0] -= 1
        if left[0] < 0:
            raise _OutOfBudget
        if room - rest[j] > spare or room - rest[j] >= limit:
            return
        if j == len(sizes):
            yield list(take)
            return
        v = sizes[j]
        most = min(counts[j], room // v) if v else counts[j]
        for k in range(most, -1, -1):
            if k:
                take.append((j, k))
            small, lim = (v, min(limit, v)) if k < counts[j] else (smallest_left, limit)
            yield from walk(j + 1, room - k * v, small, min(lim, smallest_left - v) if k else lim)
            if k:
                take.pop()

    yield from walk(start, room, float("inf"), float("inf"))
