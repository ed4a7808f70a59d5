"""Best fit, the tight packer of :mod:`packfwd.micro.pack`, and bounds on the costliest bin of any packing.

When a budget is tight, LPT (which spreads the free room over every bin) can fail to place an item at a count
that still suffices; best fit (each item into the fullest bin it fits) fills bins one by one and usually does not.
``best_fit_rounds`` runs it in numpy rounds, ``best_fit`` is the exact Python walk behind it.
``costliest_bounds`` tells the planner when more bins cannot make the costliest one cheaper.
"""

from __future__ import annotations

import bisect

import numpy as np

__all__ = ["best_fit", "best_fit_rounds", "by_decreasing_size", "costliest_bounds"]


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
