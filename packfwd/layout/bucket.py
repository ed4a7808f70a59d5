"""Fixed-bucket THD plans: every tensor of the plan has a shape fixed by the bucket, not by the batch, so a packed
forward can be captured once as a CUDA graph and replayed for every new batch that fits the bucket.

A bucket fixes the padded token count (``tokens``, all CP ranks together) and ``max_seqlen``.  The canvas
``[b, s]`` is fixed by the caller (pad the batch with empty rows to a fixed ``b``).  The batch's own THD layout
comes first, exactly as ``plan_thd`` lays it out (without the tp rounding of the last sequence); the slack up to
``tokens`` is held by ``spares = ceil(tokens / max_seqlen)`` spare sequences of no real tokens, each at most
``max_seqlen`` long (the unused ones have length 0), so ``cu_seqlens`` and ``cu_seqlens_padded`` always have
``b + spares + 1`` entries and no sequence is longer than the ``max_seqlen`` reported to attention::

    lengths 5, 3, bucket tokens=16, max_seqlen=8:   [a a a a a][b b b][. . . . . . . .]  cu_seqlens_padded
                                                    seq 0      seq 1   spare (8), spare (0)   [0, 5, 8, 16, 16]

Spare tokens are padding: ``from_thd`` drops them and their gradients are zero.  Causal attention over
``cu_seqlens_padded`` never lets a real token see them.

To replay: plan each new batch with ``plan_thd_bucket`` (one sync, or none with ``seqlens``), copy it into the
plan the graph was captured with (``copy_plan_``) and copy the input into the captured input; ``capture`` wraps
the three steps.  ``copy_plan_`` writes into its target's tensors, so a bucket plan shares no memory with its mask:
where ``plan_thd`` (like ``plan_unpad`` and ``plan_bshd``) keeps a bool mask by reference (``source.mask``; no
transform reads it after planning, so changing the mask later leaves such a plan's results as they were), a bucket
plan keeps a copy, and refreshing a captured plan never changes a caller's mask.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from .._validate import check_positive_int
from .source import TokenSource, is_nested
from .rules import check_seq_align, round_up
from .source import cumsum0
from .thd import ThdInfo, plan_thd_layout


@dataclass(frozen=True)
class Bucket:
    """A fixed THD size: ``tokens`` padded tokens (all CP ranks together) and the ``max_seqlen`` attention sees.

    >>> import torch
    >>> bucket = Bucket(tokens=16, max_seqlen=8)
    >>> info = plan_thd_bucket(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]), bucket)
    >>> info.local_tokens, info.cu_seqlens_padded.tolist(), info.max_seqlen   # 2 spare sequences take the slack
    (16, [0, 3, 5, 13, 16], 8)
    """

    tokens: int
    max_seqlen: int

    def __post_init__(self):
        check_positive_int("tokens", self.tokens)
        check_positive_int("max_seqlen", self.max_seqlen)

    @property
    def spares(self) -> int:
        """Spare sequences that hold the slack: enough for a whole bucket of ``max_seqlen``-long pieces."""
        return -(-self.tokens // self.max_seqlen)


def plan_thd_bucket(
    attention_mask: Tensor,
    bucket: Bucket,
    *,
    tp_size: int = 1,
    cp_size: int = 1,
    cp_rank: int | None = None,
    seq_align: int | None = None,
    seqlens: Sequence[int] | None = None,
) -> ThdInfo:
    """``plan_thd`` with shapes fixed by ``bucket``: ``local_tokens = bucket.tokens // cp_size`` rows per rank,
    ``b + bucket.spares`` sequences, ``max_seqlen = bucket.max_seqlen``.

    ``bucket.tokens`` must divide by ``lcm(seq_align, tp_size * cp_size)`` and ``bucket.max_seqlen`` by the
    alignment; a batch whose padded layout needs more than ``bucket.tokens`` raises ValueError.

    >>> import torch
    >>> mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    >>> info = plan_thd_bucket(mask, Bucket(tokens=16, max_seqlen=8))
    >>> info.cu_seqlens.tolist(), info.cu_seqlens_padded.tolist(), info.local_tokens, info.max_seqlen
    ([0, 5, 8, 8, 8], [0, 5, 8, 16, 16], 16, 8)
    """
    if not isinstance(bucket, Bucket):
        raise TypeError(f"bucket must be a packfwd.layout.bucket.Bucket, got {type(bucket).__name__}; e.g. Bucket(8192, 4096)")
    if attention_mask is None or is_nested(attention_mask):
        raise TypeError("plan_thd_bucket needs a padded [b, s] attention_mask (a fixed canvas); nested input varies in shape")
    tp = check_positive_int("tp_size", tp_size)
    cp = check_positive_int("cp_size", cp_size)
    align = check_seq_align(seq_align, cp, tp)
    unit = math.lcm(align, tp * cp)
    if bucket.tokens % unit:
        raise ValueError(
            f"bucket.tokens={bucket.tokens} must be a multiple of {unit} (lcm of the alignment {align} and "
            f"tp_size*cp_size={tp * cp}); round it up to {-(-bucket.tokens // unit) * unit}"
        )
    if bucket.max_seqlen % align:
        raise ValueError(
            f"bucket.max_seqlen={bucket.max_seqlen} must be a multiple of the sequence alignment {align}; "
            f"round it up to {-(-bucket.max_seqlen // align) * align}"
        )
    info = plan_thd_layout(
        attention_mask, tp_size=tp, cp_size=cp, cp_rank=cp_rank, seq_align=seq_align, max_seqlen=bucket.max_seqlen,
        seqlens=seqlens, x=None, padding=functools.partial(_bucket_padding, bucket=bucket),
    )
    return _owning(dataclasses.replace(info, bucket=bucket), attention_mask)


def _owning(plan, given: Tensor):
    """``plan`` with its own copy of every tensor that shares memory with the caller's ``given`` tensor.

    ``copy_plan_`` writes into a bucket plan's tensors, and planning keeps a bool mask by reference
    (``TokenSource.mask``): without the copy, refreshing a captured plan would overwrite the caller's mask.
    One device copy of ``[b, s]`` bools, no sync; an integer mask is converted to a new bool one already."""
    changes = {}
    for f in dataclasses.fields(plan):
        v = getattr(plan, f.name)
        if isinstance(v, Tensor) and _same_memory(v, given):
            changes[f.name] = v.clone()
        elif isinstance(v, TokenSource):
            changes[f.name] = _owning(v, given)
    return dataclasses.replace(plan, **changes)


def _same_memory(a: Tensor, b: Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _bucket_padding(lengths: np.ndarray, align: int, *, bucket: Bucket) -> tuple[np.ndarray, np.ndarray]:
    """The bucket's sequences: the batch's, each rounded up to ``align`` (no tp extension: the bucket's total
    divides), then ``bucket.spares`` spare sequences holding the slack, each at most ``bucket.max_seqlen`` long.
    Returns their padded lengths ``[b + spares]`` and ``[2, b + spares + 1]`` real and padded offsets."""
    p = round_up(lengths, align)
    slack = bucket.tokens - int(p.sum())
    if slack < 0:
        raise ValueError(
            f"the batch needs {bucket.tokens - slack} padded tokens but the bucket holds {bucket.tokens}; "
            "plan it with a larger bucket (or split the batch)"
        )
    spare = np.clip(slack - bucket.max_seqlen * np.arange(bucket.spares), 0, bucket.max_seqlen)  # [M, M, rest, 0..]
    p = np.concatenate([p, spare])
    real = np.concatenate([cumsum0(lengths), np.full(bucket.spares, lengths.sum())])
    return p, np.stack([real, cumsum0(p)])


# Ints of a plan that may differ between two batches of one bucket (every other field fixes a shape).
_DATA_INTS = {"total"}


def copy_plan_(dst: ThdInfo, src: ThdInfo) -> ThdInfo:
    """Copy the tensors of ``src`` into those of ``dst`` in place (no sync) and return ``dst``.

    Both must be bucket plans of the same bucket, canvas and parallel layout.  After the copy, a CUDA graph
    captured with ``dst`` computes with ``src``'s batch.  (``dst``'s Python ints that describe the data, such as
    ``dst.source.total``, keep their old values: use ``src`` for those.)  Only ``dst``'s own tensors are written:
    a bucket plan shares no memory with the mask it was planned from, so the caller's mask is never changed.

    >>> import torch
    >>> from packfwd import to_thd
    >>> bucket = Bucket(16, 8)
    >>> captured = plan_thd_bucket(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]), bucket)
    >>> ids = torch.tensor([[7, 0, 0, 0], [1, 2, 3, 4]])
    >>> to_thd(ids, copy_plan_(captured, plan_thd_bucket(ids != 0, bucket)))[0][:6].tolist()
    [7, 1, 2, 3, 4, 0]
    """
    if not isinstance(dst, ThdInfo) or not isinstance(src, ThdInfo):
        raise TypeError("copy_plan_ copies one ThdInfo into another; pass two plans from plan_thd_bucket")
    if dst.cu_seqlens.shape[0] == dst.batch_size + 1:  # a bucket plan has at least one spare sequence
        raise TypeError(
            "copy_plan_ writes into dst's tensors, and a plan_thd plan holds the caller's mask (or a nested tensor's "
            "offsets) by reference; make dst with plan_thd_bucket, which owns every tensor it holds"
        )
    _copy_fields(dst, src, "plan")
    return dst


def _copy_fields(dst, src, where: str) -> None:
    for f in dataclasses.fields(dst):
        a, b = getattr(dst, f.name), getattr(src, f.name)
        if isinstance(a, Tensor):
            if not isinstance(b, Tensor) or a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
                raise ValueError(
                    f"{where}.{f.name} differs in shape, dtype or device between the plans; "
                    "copy_plan_ needs two plans of the same bucket, canvas [b, s], device and parallel layout"
                )
            a.copy_(b)
        elif isinstance(a, TokenSource):
            _copy_fields(a, b, f"{where}.{f.name}")
        elif f.name not in _DATA_INTS and a != b:
            raise ValueError(
                f"{where}.{f.name} is {a} in one plan and {b} in the other; copy_plan_ needs two plans of the same "
                "bucket, canvas [b, s] and parallel layout"
            )


def _clone(plan):
    """A copy of a plan with its own tensors (nested dataclasses included)."""
    changes = {}
    for f in dataclasses.fields(plan):
        v = getattr(plan, f.name)
        if isinstance(v, Tensor):
            changes[f.name] = v.clone()
        elif dataclasses.is_dataclass(v):
            changes[f.name] = _clone(v)
    return dataclasses.replace(plan, **changes)


def capture(fn: Callable[[Tensor, ThdInfo], Tensor], x: Tensor, info: ThdInfo, *, warmup: int = 2):
    """Capture ``fn(x, info)`` as a CUDA graph and return ``replay(x, info) -> output``.

    The graph runs on copies of ``x`` and ``info``.  ``replay`` copies the new batch's plan and input into them,
    replays the graph and returns the captured output tensor (overwritten by the next replay: clone it to keep
    it).  ``fn`` must make no host sync; ``info`` must come from ``plan_thd_bucket``.
    """
    static_x, static_info = x.clone(), _clone(info)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn(static_x, static_info)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn(static_x, static_info)

    def replay(new_x: Tensor, new_info: ThdInfo) -> Tensor:
        copy_plan_(static_info, new_info)
        static_x.copy_(new_x)
        graph.replay()
        return static_out

    replay.graph = graph
    return replay
