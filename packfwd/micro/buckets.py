"""The fixed shapes micro-batches are padded to when the step runs as CUDA graphs (:mod:`packfwd.micro.graphs`).

A graph replays one set of tensor shapes, so every micro-batch of a rank is padded to a *bucket*: ``rows`` (the
canvas rows: the rank's largest micro-batch rounded up to a power of two, empty rows after the real ones) and
``tokens`` (padded tokens per CP rank: the micro-batch's own footprint rounded up to a multiple of ``unit``, about
``max_tokens / steps``, never above the budget).  So a rank has at most ``steps`` token sizes; each micro-batch is
padded by less than ``unit`` tokens (``max_tokens / 16`` by default: 1,024 of a 16k budget), held by spare
sequences that no real token attends to; and the sizes depend on the budget alone, so the next global batch of a
training run finds most of its buckets already captured.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..layout import rules

__all__ = ["BUCKET_STEPS", "bucket_shapes"]

BUCKET_STEPS = 16  # token sizes per budget: each micro-batch padded by < max_tokens / 16


def bucket_shapes(micro_batches: Sequence[Sequence[int]], tokens: Sequence[int], *, max_tokens: int, seq_align: int,
                  tp_size: int, cp_size: int, steps: int = BUCKET_STEPS) -> list[tuple[int, int]]:
    """``(rows, tokens)`` of each micro-batch's bucket (``(0, 0)`` for an empty one), from one rank's micro-batches
    and their padded tokens per CP rank (a :class:`~packfwd.micro.plan.MicroBatchPlan`'s ``tokens[dp_rank]``).

    >>> bucket_shapes([[0, 1, 2], [3], []], [900, 310, 0], max_tokens=1024, seq_align=1, tp_size=1, cp_size=1)
    [(4, 960), (4, 320), (0, 0)]
    """
    period = math.lcm(seq_align, tp_size * cp_size)
    cap = max_tokens * cp_size // period * period  # the planner's capacity (all CP ranks together)
    unit = rules.round_up(-(-cap // steps), period)
    most = max((len(mb) for mb in micro_batches), default=0)
    rows = 1 << max(most - 1, 0).bit_length()
    return [(rows, min(cap, rules.round_up(t * cp_size, unit)) // cp_size) if mb else (0, 0)
            for mb, t in zip(micro_batches, tokens)]
