"""``plan_micro_batches``: cut a global batch of variable-length sequences into micro-batches for every DP rank,
each within a token budget on its *real* padded footprint, balanced in tokens or FLOPs.

The footprint is the THD layout's (:mod:`packfwd.layout.rules`): sequence ``i`` of ``n_i`` tokens takes
``p_i = round_up(n_i, seq_align)`` and the micro-batch's total ``P = sum p_i`` is extended (on its last sequence)
by ``last_extra(P)`` to divide by the rule's period ``lcm(seq_align, tp * cp)``; each CP rank holds
``(P + last_extra(P)) / cp`` tokens.  That is ``P`` rounded up to the period, so a micro-batch fits
``max_tokens`` exactly when ``P <= cap``, ``cap`` the largest multiple of the period not above
``max_tokens * cp``: the set-dependent extension becomes one capacity on a sum, exactly.  With ``group_size``
``g`` the items planned are the groups of ``g`` consecutive sequences (size: the members' ``p_i`` summed, which is
what they add to ``P``; cost: their costs summed), expanded into their sequences at the end.

The packing (:mod:`packfwd.micro.pack`, which says why): count = the smallest number of micro-batches per rank
the lower bounds allow (total over capacity; sequences above half the capacity need a micro-batch each), raised to
``min_micro_batches`` and to a multiple of ``micro_batches_multiple_of``; capacity-aware LPT (or Karmarkar-Karp
on small batches) into ``dp_size * count`` bins; when LPT cannot place everything, LPT with up to 2% more
micro-batches (which balances better than filling bins tightly), else best fit at the count, then on small
batches a bounded exact search, one more multiple when none can; bins dealt to ranks and refined.  Each rank's
micro-batches are ordered cheapest at both ends (pipeline warm-up and cool-down); within a micro-batch sequences
keep their global order.  Pure and deterministic: host numbers in, host numbers out, no collectives
(``agree_micro_batch_count`` is apart).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .._validate import check_positive_int
from ..layout import display, rules
from . import pack
from .buckets import BUCKET_STEPS, bucket_shapes
from .ranks import deal_to_ranks, pipeline_order, repartition_ranks
from .refine import REFINE_ALL_MAX_ITEMS, refine

__all__ = ["MicroBatchPlan", "plan_micro_batches", "FLOPS_PER_TOKEN", "FLOPS_PER_TOKEN_PAIR"]

# cost="flops": a * p + b * p^2 for a sequence of padded length p.  A dense decoder layer's forward spends about
# 24 h^2 FLOPs per token in its matmuls (QKV, output, a 4h MLP) and, causally, about 2 h p^2 per sequence in
# attention; divided by 2 h that is a = 12 h, b = 1.  The default takes h = 4096; pass ("flops", 12 * hidden, 1)
# for your model (grouped-query attention and other MLP widths change the 12).
FLOPS_PER_TOKEN = 12 * 4096
FLOPS_PER_TOKEN_PAIR = 1


@dataclass(frozen=True)
class MicroBatchPlan:
    """Which sequences each DP rank runs in each micro-batch.

    ``micro_batches[dp_rank][mb]``: global indices (ascending) of the sequences of micro-batch ``mb`` of rank
    ``dp_rank``; every rank has ``num_micro_batches`` of them, some empty only when there are fewer sequences
    (groups of ``group_size``) than micro-batches.  ``dp_rank_of[i]``: the rank that runs sequence ``i``.
    ``tokens[dp_rank][mb]``: the micro-batch's padded tokens per CP rank (``plan_thd(...).local_tokens``), all
    ``<= max_tokens``; ``costs[dp_rank][mb]``: its balance cost.  ``seqlens``: the real lengths planned (host
    ints, for the forward).
    """

    micro_batches: list  # [dp_size][num_micro_batches] -> list[int]
    dp_rank_of: tuple
    tokens: list  # [dp_size][num_micro_batches] -> int
    costs: list  # [dp_size][num_micro_batches] -> float
    seqlens: tuple
    num_micro_batches: int
    max_tokens: int
    dp_size: int
    tp_size: int
    cp_size: int
    seq_align: int
    group_size: int = 1  # sequences 0..g-1, g..2g-1, ... each in one micro-batch
    bucket_steps: int = BUCKET_STEPS  # token sizes a micro-batch is padded to under CUDA graphs (buckets())

    def __repr__(self) -> str:  # for people: the shape of the plan and its balance, not every index
        return display.block("MicroBatchPlan", _summary(self))

    def _repr_html_(self) -> str:  # a notebook's table and picture: ranks x micro-batches against max_tokens
        rows = [(line.split("=", 1)[0], line.split("=", 1)[1]) if "=" in line.split(" ")[0] else ("", line)
                for line in _summary(self)]
        shown = min(self.dp_size, 16)
        gap = (self.max_tokens / 25, "#ffffff")  # between micro-batches
        bars = [[seg for t in self.tokens[r] for seg in ((t, display.PALETTE[0]), (self.max_tokens - t, display.PAD),
                                                         gap)] for r in range(shown)]
        picture = display.svg_rows(bars, [f"dp {r}" for r in range(shown)])
        more = f"; dp ranks 0-{shown - 1} of {self.dp_size} drawn" if shown < self.dp_size else ""
        return display.html_table("MicroBatchPlan", rows, picture, "each rank's micro-batches: tokens per CP rank "
                                  f"(blue) of max_tokens; grey: room left{more}")

    def rows(self, dp_rank: int) -> list[int]:
        """The global indices rank ``dp_rank`` runs, ascending (the rows its outputs come back in)."""
        return sorted(i for mb in self.micro_batches[dp_rank] for i in mb)

    def buckets(self, dp_rank: int) -> list[tuple[int, int]]:
        """``(rows, tokens)`` per micro-batch of rank ``dp_rank``: the fixed shape the step pads it to when it runs
        as CUDA graphs (:mod:`packfwd.micro.buckets`: canvas rows, padded tokens per CP rank; ``(0, 0)`` for an
        empty one).  At most ``bucket_steps`` token sizes, each micro-batch padded by less than
        ``max_tokens / bucket_steps`` tokens.

        >>> plan = plan_micro_batches([700, 300, 900, 60], max_tokens=1024)
        >>> plan.tokens, plan.buckets(0)                  # padded to multiples of 1024 / 16 tokens
        ([[960, 1000]], [(2, 960), (2, 1024)])
        """
        return bucket_shapes(self.micro_batches[dp_rank], self.tokens[dp_rank], max_tokens=self.max_tokens,
                             seq_align=self.seq_align, tp_size=self.tp_size, cp_size=self.cp_size,
                             steps=self.bucket_steps)

    def restore(self, outputs: Sequence[Sequence[Sequence[Any]]]) -> list:
        """Per-sequence results back in global order.

        ``outputs[dp_rank][mb]``: one entry per sequence of ``micro_batches[dp_rank][mb]``, in that order (a list,
        or a tensor whose first dimension runs over those sequences).  Returns a list of ``len(seqlens)`` entries,
        entry ``i`` the result of sequence ``i`` (``torch.stack`` it when the entries share a shape).

        >>> plan = plan_micro_batches([5, 1, 4, 2, 3], max_tokens=6, dp_size=2)
        >>> plan.micro_batches
        [[[1, 3], [0]], [[4], [2]]]
        >>> plan.restore([[["b", "d"], ["a"]], [["e"], ["c"]]])
        ['a', 'b', 'c', 'd', 'e']
        """
        nesting = ("restore takes outputs[dp_rank][micro_batch][k], the result of sequence plan.micro_batches"
                   "[dp_rank][micro_batch][k]: a list per rank of a list (or tensor) per micro-batch")
        if _length(outputs) != self.dp_size:
            raise ValueError(f"outputs has {_describe(outputs)} for {self.dp_size} DP ranks; {nesting}")
        out: list = [None] * len(self.seqlens)
        for r, (ranks_mbs, ranks_out) in enumerate(zip(self.micro_batches, outputs)):
            if _length(ranks_out) != len(ranks_mbs):
                flat = " (a flat list of the rank's results?)" if _length(ranks_out) == len(self.rows(r)) else ""
                raise ValueError(f"outputs[{r}] has {_describe(ranks_out)}{flat}; the plan has {len(ranks_mbs)} "
                                 f"micro-batches per rank; {nesting}")
            for m, (indices, values) in enumerate(zip(ranks_mbs, ranks_out)):
                if _length(values) is None:
                    raise TypeError(f"outputs[{r}][{m}] is {_describe(values)}, not one entry per sequence of "
                                    f"micro-batch {m}; {nesting}")
                if len(values) != len(indices):
                    raise ValueError(f"outputs[{r}][{m}] has {len(values)} entries for the {len(indices)} sequences "
                                     f"of that micro-batch; give one entry per sequence, in their order ({nesting})")
                for i, v in zip(indices, values):
                    out[i] = v
        return out


def _summary(plan: MicroBatchPlan) -> list[str]:
    """The lines of the plan's repr: sizes, then a line per DP rank (at most 8: the first 5 and the last 2)."""
    real, flat = sum(plan.seqlens), [t for rank in plan.tokens for t in rank]
    costs = [sum(rank) for rank in plan.costs]
    mean = sum(costs) / len(costs) if costs else 0.0
    lines = [
        f"{len(plan.seqlens)} sequences, {real} real tokens, lengths {display.spread(plan.seqlens)}",
        f"dp_size={plan.dp_size} x num_micro_batches={plan.num_micro_batches}, max_tokens={plan.max_tokens} per CP "
        f"rank (tp_size={plan.tp_size}, cp_size={plan.cp_size}, seq_align={plan.seq_align}, "
        f"group_size={plan.group_size})",
        f"tokens per micro-batch {display.spread(flat)} ({display.percent(sum(flat), len(flat) * plan.max_tokens)} "
        f"of max_tokens); cost per rank max/mean {max(costs, default=0) / mean if mean else 1.0:.3f}",
    ]
    ranks = list(range(plan.dp_size))
    if len(ranks) > 8:
        ranks = ranks[:5] + [-1] + ranks[-2:]
    for r in ranks:
        if r < 0:
            lines.append(f"... {plan.dp_size - 7} more ranks")
            continue
        sequences = sum(len(mb) for mb in plan.micro_batches[r])
        lines.append(f"dp rank {r}: {sequences} sequences, tokens {display.short_ints(plan.tokens[r])}, "
                     f"cost {costs[r]:.6g}")
    if len(str(plan.micro_batches)) <= 100:  # a small plan: the sequences themselves
        lines.append(f"micro_batches={plan.micro_batches}")
    return lines


def _length(x) -> int | None:  # None for what has no length (a number, a 0-d tensor)
    try:
        return len(x)
    except TypeError:
        return None


def _describe(x) -> str:
    n = _length(x)
    return f"a {type(x).__name__}" if n is None else f"{n} entr{'y' if n == 1 else 'ies'}"


def plan_micro_batches(
    seqlens,
    *,
    max_tokens: int,
    dp_size: int = 1,
    tp_size: int = 1,
    cp_size: int = 1,
    seq_align: int | None = None,
    cost: str | tuple | Callable = "tokens",
    min_micro_batches: int = 1,
    micro_batches_multiple_of: int = 1,
    group_size: int = 1,
    bucket_steps: int = BUCKET_STEPS,
) -> MicroBatchPlan:
    """Plan the micro-batches of a global batch (see the module docstring for the footprint and the algorithm).

    ``seqlens``: real length of every sequence (host ints, numpy or a CPU tensor); sequence ``i`` is global index
    ``i``.  ``max_tokens``: the budget of padded tokens per CP rank of one micro-batch.  ``tp_size``, ``cp_size``,
    ``seq_align``: the THD layout the forward will use (``make_forward``'s).  ``cost``: what to balance:
    ``"tokens"`` (padded tokens), ``"flops"`` (``a*p + b*p**2``, defaults ``FLOPS_PER_TOKEN``,
    ``FLOPS_PER_TOKEN_PAIR``), ``("flops", a, b)``, or a callable ``f(p: int64 [n]) -> [n]`` of the padded lengths.
    Every rank gets the same number of micro-batches, at least ``min_micro_batches`` and a multiple of
    ``micro_batches_multiple_of`` (virtual pipelines need one).  ``group_size``: sequences ``0..g-1``,
    ``g..2g-1``, ... each stay together in one micro-batch (a reward model's chosen/rejected pairs: verl's
    ``force_group_size``); the budget holds for the group packed with the rest of its micro-batch.
    ``bucket_steps``: how finely :meth:`MicroBatchPlan.buckets` sizes the CUDA graphs' buckets (more: less padding,
    more graphs).

    >>> plan = plan_micro_batches([7, 3, 9, 1, 6, 2], max_tokens=10, dp_size=2)
    >>> plan.num_micro_batches, plan.micro_batches, plan.tokens
    (2, [[[1, 5], [2]], [[4], [0, 3]]], [[5, 9], [6, 8]])
    >>> plan = plan_micro_batches([7, 3, 9, 1, 6, 2], max_tokens=10, dp_size=2, tp_size=2, cp_size=2)
    >>> plan.micro_batches, plan.tokens          # padded to 4 each: 8+4+12+4+8+4 = 40 = 2 ranks x 2 CP x 10
    ([[[1, 2, 3]], [[0, 4, 5]]], [[10], [10]])
    >>> plan_micro_batches([7, 3, 9, 1, 6, 2], max_tokens=10).micro_batches
    [[[0, 5], [2, 3], [1, 4]]]
    >>> plan_micro_batches([7, 3, 9, 1, 6, 2], max_tokens=10, group_size=2).micro_batches   # pairs kept
    [[[4, 5], [2, 3], [0, 1]]]
    """
    lengths = _check_seqlens(seqlens)
    tp, cp = check_positive_int("tp_size", tp_size), check_positive_int("cp_size", cp_size)
    dp = check_positive_int("dp_size", dp_size)
    check_positive_int("max_tokens", max_tokens, "pass the padded tokens one micro-batch may hold per CP rank")
    least = check_positive_int("min_micro_batches", min_micro_batches, "pass 1 for no minimum")
    step = check_positive_int("micro_batches_multiple_of", micro_batches_multiple_of, "pass 1 for any count")
    align = rules.check_seq_align(seq_align, cp, tp)
    layout = dict(seq_align=align, tp_size=tp, cp_size=cp)
    padded = rules.round_up(lengths, align)
    cap = _capacity(max_tokens, **layout)
    group = _check_each_fits(lengths, padded, group_size, cap, max_tokens, layout)
    weights = _costs(cost, padded)
    if group > 1:  # the items: groups of sequences
        weights, padded = (a.reshape(-1, group).sum(axis=1) for a in (weights, padded))

    lower = max(-(-int(padded.sum()) // cap) if cap else 0, int(np.count_nonzero(2 * padded > cap)))
    count = rules.round_up(max(least, -(-lower // dp)), step)
    steps = check_positive_int("bucket_steps", bucket_steps, "pass e.g. 16 (token sizes of the graphs' buckets)")
    bin_of, count = pack.pack(weights, padded, ranks=dp, count=count, step=step, cap=cap,
                              cost_is_size=isinstance(cost, str) and cost == "tokens")
    plan = _assemble(bin_of, weights, padded, lengths, dp, count, max_tokens, layout, group)
    return plan if steps == BUCKET_STEPS else dataclasses.replace(plan, bucket_steps=steps)


def _assemble(bin_of, weights, padded, lengths, dp, count, max_tokens, layout, group) -> MicroBatchPlan:
    """The plan from each item's bin; ``bin_of``, ``weights``, ``padded`` per item (``group`` sequences)."""
    bins = dp * count
    dealt = deal_to_ranks(np.bincount(bin_of, weights=weights, minlength=bins), dp)  # [dp, count] bin ids
    rank_of_bin = np.empty(bins, dtype=np.int64)
    rank_of_bin[dealt] = np.arange(dp)[:, None]
    cap = _capacity(max_tokens, **layout)
    repartition_ranks(bin_of, dealt, weights, padded, cap)  # small batches: each rank's micro-batches by KK
    if len(bin_of) <= REFINE_ALL_MAX_ITEMS:  # and exchanges
        refine(bin_of, np.arange(bins), weights, padded, cap)
    ceiling = np.bincount(bin_of, weights=weights, minlength=bins).max(initial=0.0)
    refine(bin_of, rank_of_bin, weights, padded, cap, ceiling, partners=1, rounds=16)
    bin_cost = np.bincount(bin_of, weights=weights, minlength=bins)
    bin_size = np.bincount(bin_of, weights=padded, minlength=bins).astype(np.int64)
    bin_of = np.repeat(bin_of, group) if group > 1 else bin_of  # per sequence from here
    ends = np.cumsum(np.bincount(bin_of, minlength=bins)).tolist()
    small = bin_of.astype(np.int32 if bins >= 2**15 else np.int16)  # narrow ints sort by radix
    flat = np.argsort(small, kind="stable").tolist()  # bin after bin, global order inside each
    members = [flat[start:end] for start, end in zip([0, *ends[:-1]], ends)]
    ranks = pipeline_order(dealt, bin_cost)  # [dp, count] bin ids
    tokens = rules.round_up(bin_size, _period(**layout)) // layout["cp_size"]
    return MicroBatchPlan(
        micro_batches=[[members[b] for b in order] for order in ranks.tolist()],
        dp_rank_of=tuple(rank_of_bin[bin_of].tolist()),
        tokens=tokens[ranks].tolist(),
        costs=bin_cost[ranks].tolist(),
        seqlens=tuple(lengths.tolist()),
        num_micro_batches=count,
        max_tokens=max_tokens,
        dp_size=dp,
        tp_size=layout["tp_size"],
        cp_size=layout["cp_size"],
        seq_align=layout["seq_align"],
        group_size=group,
    )


def _period(*, seq_align: int, tp_size: int, cp_size: int) -> int:
    """What the layout rounds a micro-batch's padded total up to: ``last_extra`` pads a total of 1 to it."""
    return rules.last_extra(1, seq_align=seq_align, tp_size=tp_size, cp_size=cp_size) + 1


def _capacity(max_tokens: int, *, seq_align: int, tp_size: int, cp_size: int) -> int:
    """The largest sum of padded lengths whose footprint is ``<= max_tokens``: the footprint rounds the sum up to
    the rule's period, so the cap is the largest multiple of the period in ``max_tokens * cp``."""
    period = _period(seq_align=seq_align, tp_size=tp_size, cp_size=cp_size)
    return max_tokens * cp_size // period * period


def _check_each_fits(lengths, padded, group_size, cap, max_tokens, layout) -> int:
    """``group_size``, checked; each sequence, then each group, fits alone, or the largest that does not is named."""
    group = check_positive_int("group_size", group_size, "pass 1 for no groups")
    if len(lengths) % group:
        raise ValueError(f"group_size={group} does not divide the {len(lengths)} sequences; pass whole groups of "
                         f"{group} consecutive sequences (or the group_size the batch was built with)")
    checks = [(1, "sequence", "truncate the sequence")] + [(group, "group", "use a smaller group_size")] * (group > 1)
    for g, name, fix in checks:
        totals = padded.reshape(-1, g).sum(axis=1) if g > 1 else padded
        over = np.flatnonzero(totals > cap)
        if not len(over):
            continue
        k = int(over[np.argmax(totals[over])])
        need = rules.footprint(int(totals[k]), **layout)
        what = (f"sequence {k} (length {int(lengths[k])}) cannot fit in any micro-batch: alone it" if g == 1 else
                f"group {k} (sequences {k * g}..{k * g + g - 1}, lengths {lengths[k * g : k * g + g].tolist()}) "
                "cannot fit in any micro-batch: packed together it")
        more = "" if len(over) == 1 else f"; {len(over)} {name}s are too {'long' if g == 1 else 'big'}"
        raise ValueError(
            f"{what} takes {need} padded tokens per CP rank (tp_size={layout['tp_size']}, "
            f"cp_size={layout['cp_size']}, seq_align={layout['seq_align']}), more than max_tokens={max_tokens}; "
            f"raise max_tokens to at least {need} (or {fix}){more}"
        )
    return group


def _check_seqlens(seqlens) -> np.ndarray:
    if hasattr(seqlens, "device") and getattr(seqlens.device, "type", "cpu") != "cpu":
        raise TypeError(
            f"seqlens is on {seqlens.device}; planning is host work: pass host ints or a CPU tensor "
            "(seqlens.tolist() costs one sync)"
        )
    if hasattr(seqlens, "numpy"):
        seqlens = seqlens.numpy()
    arr = np.asarray(seqlens)
    if arr.ndim != 1:
        raise ValueError(f"seqlens must be 1-D (one length per sequence), got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"seqlens has dtype {arr.dtype}; pass integer lengths (e.g. mask.sum(-1).tolist())")
    if arr.size and arr.min() < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"seqlens[{i}] = {int(arr[i])} is negative; pass the real (non-negative) lengths")
    return arr.astype(np.int64)


def _costs(cost, padded: np.ndarray) -> np.ndarray:
    p = padded.astype(np.float64)
    if isinstance(cost, str) and cost == "tokens":
        return p
    if isinstance(cost, str) and cost == "flops":
        return FLOPS_PER_TOKEN * p + FLOPS_PER_TOKEN_PAIR * p * p
    if isinstance(cost, tuple) and len(cost) == 3 and cost[0] == "flops":
        a, b = cost[1], cost[2]
        if not all(isinstance(v, (int, float)) and v >= 0 for v in (a, b)):
            raise ValueError(f"cost={cost!r}: the coefficients must be non-negative numbers, e.g. ('flops', 49152, 1)")
        return a * p + b * p * p
    if callable(cost):
        values = np.asarray(cost(padded.copy()), dtype=np.float64)
        if values.shape != padded.shape:
            raise ValueError(f"cost returned shape {values.shape}; a cost function maps the padded lengths "
                             f"[n={len(padded)}] to [n] costs, one per sequence")
        if not np.all(np.isfinite(values)) or (values.size and values.min() < 0):
            i = int(np.flatnonzero(~np.isfinite(values) | (values < 0))[0])
            raise ValueError(f"cost returned {values[i]} for sequence {i} (padded length {int(padded[i])}); costs "
                             "must be finite and non-negative")
        return values
    raise ValueError(f"cost={cost!r}; pass 'tokens', 'flops', ('flops', a, b) or a callable of the padded lengths")
