"""NeMo-RL's sequence-packing planner (its default, "modified_first_fit_decreasing"), re-implemented from a reading
of its source, for comparison with packfwd's ``plan_micro_batches``: the ``nemo-rl`` package on PyPI is an empty
placeholder, so NeMo-RL cannot be installed and called here.

Read at NVIDIA-NeMo/RL commit ``7ea279abfbeb698b092856d0dab61e7cf39bc909`` (2026-08-22):

* ``nemo_rl/models/policy/lm_policy.py`` (``Policy.__init__``, ``_shard_for_train``, ``_shard_for_logprob``): with
  ``policy.sequence_packing.enabled`` the policy shards the global batch with
  ``BatchedDataDict.shard_by_batch_size(dp_size, sequence_packing_args=...)``, where ``algorithm`` is
  ``sequence_packing.algorithm`` (``"modified_first_fit_decreasing"`` in all 16 example configs that set it),
  ``max_tokens_per_microbatch`` is ``train_mb_tokens`` (``logprob_mb_tokens`` for log-probs) and
  ``sequence_length_pad_multiple`` is ``policy.make_sequence_length_divisible_by``.  (Before NeMo-RL #2182,
  commit 56d8a0fcc of 2026-04-01, the policy used ``2*cp*tp if cp > 1 else tp`` there while the Megatron worker
  padded to ``make_sequence_length_divisible_by``; the teacher group, ``teacher_worker_group.py``, and the value
  model, ``models/value/lm_value.py``, still use ``2*cp*tp if cp > 1 else tp`` at this commit.)
* ``nemo_rl/distributed/batched_data_dict.py`` (``shard_by_batch_size``): each sequence's length is rounded up to
  ``sequence_length_pad_multiple``; the rounded lengths of a chunk (the whole batch for log-probs, one global
  batch for training) go to ``get_packer(algorithm, bin_capacity=max_tokens_per_microbatch, min_bin_count=dp,
  bin_count_multiple=dp).pack(...)``; DP rank ``r`` takes bins ``r, r + dp, r + 2 dp, ...`` of the packer's
  output (round robin), run in that order, or, with ``microbatch_order: largest_first`` (commit 414b9bb6b), by
  decreasing padded tokens.  So every rank gets the same number of micro-batches and nothing balances cost
  across ranks beyond the round robin.
* ``nemo_rl/data/packing/algorithms.py`` (last changed at 2311de495, 2026-01-17),
  ``ModifiedFirstFitDecreasingPacker._pack_implementation`` on capacity ``C``: validates ``0 < L <= C``; classes
  large ``L > C/2``, medium ``C/3 < L <= C/2``, small ``C/6 < L <= C/3``, tiny ``L <= C/6`` (large and medium
  sorted by decreasing length, small and tiny increasing, ties in index order).  Phase 1: one bin per large
  item.  Phase 2: in bin order, each large bin takes the largest medium item that fits.  Phase 3: bins in reverse
  order; a bin with no medium item, while two small items remain and the two smallest fit, takes the smallest
  small item and then the largest small item that still fits.  Phase 4: in bin order, each bin repeatedly takes
  the largest remaining (medium, small or tiny) item that fits.  Phase 5, "FFD on leftovers": since 2311de495 it
  keeps the new bins in a list sorted by fill (``bisect``) and tries only the *least-filled* one, so it is
  worst-fit decreasing, not first-fit (the same bin count is not guaranteed); its bins come out by increasing
  fill, ties in the order they were last filled.  Output: the phase-1 bins, then the phase-5 bins.
  ``SequencePacker._adjust_bin_count`` then raises the count to ``max(count, dp)`` rounded up to a multiple of
  ``dp`` (ValueError when there are fewer sequences than that) by appending empty bins and moving one sequence
  into each: the last sequence of the source bin with the most sequences (ties: the later bin), popping from the
  same source until one sequence is left in it, then the next source.
* What the budget means (``nemo_rl/models/megatron/data.py``, ``get_microbatch_iterator`` and
  ``_get_pack_sequence_parameters_for_megatron``): ``max_tokens_per_microbatch`` bounds the sum of padded lengths
  of a micro-batch *before* the CP split (each CP rank holds ``1/cp`` of it).  The Megatron worker pads each
  sequence to ``make_sequence_length_divisible_by`` (asserted a multiple of ``2*cp`` under CP times ``tp`` with
  sequence parallelism) and the packed sequence to nothing more, except with FP8 or the HybridEP dispatcher (a
  multiple of 16/32/128 times ``2*cp`` and ``tp``) and, with pipeline parallelism, to the rank's largest bin.
  The DTensor worker (``nemo_rl/models/automodel/data.py``) packs raw lengths and pads each packed micro-batch
  up to ``train_mb_tokens``.

Where this version differs: one chunk (the whole ``seqlens``; call it once per global batch to model
``batch_size`` chunking); only the default algorithm; phase 5 uses a heap keyed by (fill, time of last fill)
instead of a bisected list (the same choices and the same bin order); the class thresholds are integer tests
(``2L > C``, ``3L > C``, ``6L > C``), equal to NeMo-RL's float ones for lengths below 2**53; error texts are
packfwd's.  ``nemo_rl_plan`` returns indices only (NeMo-RL builds sliced data dicts from them).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left

__all__ = ["adjust_bin_count", "mffd_bins", "nemo_rl_plan"]


def _classify(sizes: list[int], capacity: int) -> tuple[list, list, list, list]:
    large, medium, small, tiny = [], [], [], []
    for i, size in enumerate(sizes):
        if 2 * size > capacity:
            large.append(i)
        elif 3 * size > capacity:
            medium.append(i)
        elif 6 * size > capacity:
            small.append(i)
        else:
            tiny.append(i)
    large.sort(key=lambda i: -sizes[i])  # stable: ties stay in index order
    medium.sort(key=lambda i: -sizes[i])
    small.sort(key=lambda i: sizes[i])
    return large, medium, small, tiny


def _worst_fit_decreasing(items: list[int], sizes: list[int], capacity: int) -> list[list[int]]:
    """Phase 5: each item (decreasing size) into the least-filled bin when it fits there, else a new bin; bins
    returned by increasing fill, ties by the time they were last filled."""
    heap, clock = [], 0  # entries (fill, time of last fill, indices)
    for i in items:
        if heap and heap[0][0] + sizes[i] <= capacity:
            fill, _, members = heap[0]
            members.append(i)
            heapq.heapreplace(heap, (fill + sizes[i], clock, members))
        else:
            heapq.heappush(heap, (sizes[i], clock, [i]))
        clock += 1
    return [members for _, _, members in sorted(heap, key=lambda e: e[:2])]


def mffd_bins(sizes: list[int], capacity: int) -> list[list[int]]:
    """NeMo-RL's modified first-fit decreasing on ``sizes`` (see the module docstring): bins of indices."""
    if capacity <= 0:
        raise ValueError(f"capacity={capacity} must be positive")
    for i, size in enumerate(sizes):
        if size <= 0 or size > capacity:
            raise ValueError(f"sequence {i} has padded length {size}, outside [1, capacity={capacity}]")
    large, medium, small, tiny = _classify(sizes, capacity)
    bins = [[i] for i in large]
    fill = [sizes[i] for i in large]
    for b in range(len(bins)):  # phase 2: the largest medium item that fits
        pick = next((k for k, i in enumerate(medium) if sizes[i] <= capacity - fill[b]), None)
        if pick is not None:
            bins[b].append(medium.pop(pick))
            fill[b] += sizes[bins[b][-1]]
    for b in reversed(range(len(bins))):  # phase 3: the smallest small item plus the largest that still fits
        if len(bins[b]) > 1 or len(small) < 2 or sizes[small[0]] + sizes[small[1]] > capacity - fill[b]:
            continue  # after phase 2 a large bin holds more than its large item only if it took a medium one
        first = small.pop(0)
        room = capacity - fill[b] - sizes[first]
        second = max(k for k, i in enumerate(small) if sizes[i] <= room)  # small[0] fits, so one exists
        bins[b] += [first, small.pop(second)]
        fill[b] += sizes[first] + sizes[bins[b][-1]]
    rest = sorted(medium + small + tiny, key=lambda i: -sizes[i])  # stable: ties in index order
    keys = [-sizes[i] for i in rest]  # ascending
    for b in range(len(bins)):  # phase 4: the largest remaining item that fits, until none does
        while rest:
            k = bisect_left(keys, -(capacity - fill[b]))  # first item with size <= room
            if k == len(rest):
                break
            keys.pop(k)
            bins[b].append(rest.pop(k))
            fill[b] += sizes[bins[b][-1]]
    return bins + _worst_fit_decreasing(rest, sizes, capacity)


def adjust_bin_count(bins: list[list[int]], min_count: int, multiple: int) -> list[list[int]]:
    """``SequencePacker._adjust_bin_count``: at least ``min_count`` bins, a multiple of ``multiple``, each new bin
    one sequence taken from the end of the bin with the most sequences (ties: the later bin) until it has one."""
    target = max(len(bins), min_count)
    target += -target % multiple
    if target == len(bins):
        return bins
    total = sum(len(b) for b in bins)
    if total < target:
        raise ValueError(f"cannot make {target} non-empty micro-batches from {total} sequences")
    out = [list(b) for b in bins]
    sources = sorted(range(len(bins)), key=lambda b: (len(bins[b]), b), reverse=True)
    s = 0
    for _ in range(target - len(bins)):
        while len(out[sources[s]]) < 2:
            s += 1
        out.append([out[sources[s]].pop()])
    return out


def nemo_rl_plan(seqlens, *, max_tokens: int, dp_size: int, pad_multiple: int,
                 microbatch_order: str = "packer") -> list[list[list[int]]]:
    """``plan[dp_rank][mb]`` -> global indices, as NeMo-RL's ``shard_by_batch_size`` with sequence packing plans
    one chunk.  ``max_tokens``: its ``max_tokens_per_microbatch`` (padded tokens of a micro-batch before the CP
    split); ``pad_multiple``: its ``sequence_length_pad_multiple``; ``microbatch_order``: "packer" or
    "largest_first".

    >>> nemo_rl_plan([5, 5, 3], max_tokens=16, dp_size=1, pad_multiple=4)  # padded 8, 8, 4
    [[[2], [0, 1]]]
    """
    if microbatch_order not in ("packer", "largest_first"):
        raise ValueError(f"microbatch_order={microbatch_order!r}; pass 'packer' or 'largest_first'")
    padded = [-(-int(n) // pad_multiple) * pad_multiple for n in seqlens]
    bins = adjust_bin_count(mffd_bins(padded, max_tokens), dp_size, dp_size)
    plan = [bins[r::dp_size] for r in range(dp_size)]
    if microbatch_order == "largest_first":
        plan = [sorted(mbs, key=lambda mb: sum(padded[i] for i in mb), reverse=True) for mbs in plan]
    return plan
