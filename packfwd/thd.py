"""``to_thd`` / ``from_thd``: the packed THD layout Megatron-Core takes with ``PackedSeqParams``.

Layout (the one Megatron-Core and verl use): sequence after sequence, each sequence's real tokens in order,
zero-padded at its tail to ``p_i``, a multiple of the alignment.  With context parallelism each padded sequence
is cut into ``2*cp`` equal chunks and CP rank ``r`` keeps chunks ``r`` and ``2*cp-1-r`` (the "zigzag" that gives
every rank the same share of causal-attention work)::

    lengths 5, 3   cp=2 (align 4)    padded: [a a a a a . . .][b b b .]
    chunks (c = 2, 1):  seq a -> a0 a1 | a2 a3 | a4 . | . .   seq b -> b0 | b1 | b2 | .
    rank 0 keeps chunks 0 and 3:  a0 a1 . .  b0 .      (6 tokens)
    rank 1 keeps chunks 1 and 2:  a2 a3 a4 . b1 b2     (6 tokens)

The alignment rule with ``seq_align=None`` (the default) is the smallest Megatron accepts: each sequence is
padded to a multiple of ``2*cp`` (no per-sequence padding at all when ``cp == 1``), and then the last sequence's
padding is extended so each rank's token count divides by ``tp_size`` (sequence parallelism splits it).  Padding
each sequence to ``2*cp*tp`` instead (``seq_align=2*cp*tp``, or ``tp`` when ``cp == 1``) reproduces verl's
layout exactly but spends up to ``2*cp*tp - 1`` pad tokens per sequence instead of ``2*cp - 1``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from ._checks import check_positive_int, check_rank
from ._rows import cumsum0, gather_rows
from . import _plan_kernel
from ._source import (
    Lengths,
    TokenSource,
    canvas_rows_of,
    checked_lengths,
    from_canvas,
    is_nested,
    padded_source,
    plan_padded,
    plan_source,
    read_lengths,
    scatter_inverse,
)


@dataclass(frozen=True)
class ThdInfo:
    """The plan of ``to_thd`` for one CP rank; also everything ``from_thd`` needs to put all ranks back.

    Megatron-Core's names: ``cu_seqlens`` [n+1] int32 (real lengths), ``cu_seqlens_padded`` [n+1] int32 (whole
    padded sequences, before the CP split), ``max_seqlen`` (longest padded sequence, a Python int).  ``n`` is the
    batch size ``b`` (plus the spare sequences of a fixed bucket, see ``packfwd.bucket``).
    """

    source: TokenSource
    cu_seqlens: Tensor  # [n+1] int32
    cu_seqlens_padded: Tensor  # [n+1] int32
    max_seqlen: int
    total_tokens: int  # cu_seqlens_padded[-1], all CP ranks together
    local_tokens: int  # this rank's share, total_tokens // cp_size
    tp_size: int
    cp_size: int
    cp_rank: int
    seq_align: int
    index: Tensor  # [cp_size * local_tokens] canvas row of every rank's token, rank after rank (-1 at padding)
    inverse: Tensor  # [canvas_rows] rank * local_tokens + local row of each canvas row (-1 at padding)
    segments: Tensor | None  # [2, k] this rank's runs of positions: run lengths, position minus local row (None:
    # the positions were computed at planning)

    @property
    def gather_index(self) -> Tensor:
        """[local_tokens] int64: the canvas row of each of this rank's tokens (-1 at padding)."""
        return self.index[self.cp_rank * self.local_tokens : (self.cp_rank + 1) * self.local_tokens]

    @property
    def scatter_index(self) -> Tensor:
        """[cp_size, local_tokens] int64: the canvas row of each token of every rank (-1 at padding)."""
        return self.index.view(self.cp_size, self.local_tokens)

    @property
    def zero_rows(self) -> Tensor:
        """This rank's padding rows (for inspection: this syncs with the device)."""
        return (self.gather_index < 0).nonzero().view(-1)

    @functools.cached_property
    def local_positions(self) -> Tensor:
        """[local_tokens] int64, position of each local token in its padded sequence (computed on first use)."""
        lengths, shift = self.segments
        run = torch.repeat_interleave(lengths, output_size=self.local_tokens)
        return torch.arange(self.local_tokens, device=lengths.device) + shift[run]

    @property
    def local_cu_seqlens_padded(self) -> Tensor:
        """[n+1] int32: where each sequence starts in this rank's tensor (``cu_seqlens_padded // cp_size``)."""
        return self.cu_seqlens_padded // self.cp_size

    @property
    def batch_size(self) -> int:
        return self.source.batch_size

    @property
    def seq_len(self) -> int:
        return self.source.seq_len

    def packed_seq_params(self):
        """Megatron-Core's ``PackedSeqParams`` (``qkv_format="thd"``) for this batch."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded,
            cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )


def default_seq_align(cp_size: int) -> int:
    """The smallest per-sequence alignment Megatron accepts: ``2*cp_size`` under CP, else 1.

    >>> default_seq_align(1), default_seq_align(4)
    (1, 8)
    """
    return 2 * cp_size if cp_size > 1 else 1


def padded_lengths(lengths: Tensor, *, seq_align: int, tp_size: int, cp_size: int) -> Tensor:
    """[b] padded length of every sequence: rounded up to ``seq_align``, the last one extended so the total
    divides by ``tp_size * cp_size`` (each CP rank's share then divides by ``tp_size``)."""
    p = (lengths + seq_align - 1) // seq_align * seq_align
    unit = math.lcm(seq_align, tp_size * cp_size)
    if p.numel() and unit > seq_align:
        p = p.clone()
        p[-1] += (-p.sum()) % unit
    return p


def plan_thd(
    attention_mask: Tensor | None,
    *,
    tp_size: int = 1,
    cp_size: int = 1,
    cp_rank: int = 0,
    seq_align: int | None = None,
    max_seqlen: int | None = None,
    seqlens: Sequence[int] | None = None,
    x: Tensor | None = None,
) -> ThdInfo:
    """Plan the THD layout of a batch for CP rank ``cp_rank`` (see the module docstring for the layout).

    ``attention_mask``: [b, s] bool or integer 0/1 (or None with a jagged nested ``x``).  ``max_seqlen``: a fixed
    value to report instead of the longest padded sequence (an upper bound, e.g. a bucket size; must be at least
    the longest).  ``seqlens``: the real lengths as host ints, to plan with no device sync at all.

    >>> import torch
    >>> mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    >>> info = plan_thd(mask, cp_size=2, cp_rank=1)
    >>> info.cu_seqlens.tolist(), info.cu_seqlens_padded.tolist(), info.max_seqlen, info.local_tokens
    ([0, 5, 8], [0, 8, 12], 8, 6)
    >>> info.local_positions.tolist()
    [2, 3, 4, 5, 1, 2]
    """
    return plan_thd_layout(
        attention_mask, tp_size=tp_size, cp_size=cp_size, cp_rank=cp_rank, seq_align=seq_align,
        max_seqlen=max_seqlen, seqlens=seqlens, x=x,
    )


def plan_thd_layout(
    attention_mask, *, tp_size, cp_size, cp_rank, seq_align, max_seqlen, seqlens, x, bucket_tokens=None, spares=0
) -> ThdInfo:
    """``plan_thd``, optionally with a fixed token count: ``bucket_tokens`` padded tokens in all, the slack held
    by ``spares`` extra sequences of no real tokens, each at most ``max_seqlen`` long (see ``packfwd.bucket``)."""
    tp_size = check_positive_int("tp_size", tp_size)
    cp_size = check_positive_int("cp_size", cp_size)
    cp_rank = check_rank("cp_rank", cp_rank, cp_size, "cp_size")
    align = _check_seq_align(seq_align, cp_size, tp_size)
    if max_seqlen is not None:
        check_positive_int("max_seqlen", max_seqlen)

    def layout(lengths):
        return _host_layout(lengths, align, tp_size, cp_size, cp_rank, bucket_tokens, spares, max_seqlen)

    if (x is None or not is_nested(x)) and bucket_tokens is None:
        src = read_lengths(x, attention_mask, seqlens)
        if _plan_kernel.available(src.mask):
            return _plan_on_device(src, align, tp_size, cp_size, cp_rank, max_seqlen)
        source, (total, longest, local), arrays = plan_padded(src, layout)
    else:
        source, (total, longest, local), arrays = plan_source(x, attention_mask, seqlens, layout)
    _check_max_seqlen(max_seqlen, longest)
    cu_pair, segments, *table = arrays
    if cp_size == 1:
        dest = source.rank_in_row(table[0])
    else:
        size_m1, size, start = table  # chunk size - 1, chunk size (>= 1), first destination of each chunk, minus 1
        counts = source.rank_in_row()
        chunk = (counts + source.per_row(size_m1)).div_(source.per_row(size), rounding_mode="floor")
        dest = counts + source.per_row_col(start, chunk)
    inverse = source.where_real(dest, -1)
    cu32 = cu_pair.to(torch.int32)
    return ThdInfo(
        source=source,
        cu_seqlens=source.cu_seqlens if bucket_tokens is None else cu32[0],
        cu_seqlens_padded=cu32[-1],
        max_seqlen=longest if max_seqlen is None else max_seqlen,
        total_tokens=total,
        local_tokens=local,
        tp_size=tp_size,
        cp_size=cp_size,
        cp_rank=cp_rank,
        seq_align=align,
        index=scatter_inverse(inverse, total, source.canvas_rows),
        inverse=inverse,
        segments=segments,
    )


def _check_max_seqlen(max_seqlen: int | None, longest: int) -> None:
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"max_seqlen={max_seqlen} is below the longest padded sequence ({longest}); raise it or pass None")


def _plan_on_device(src: Lengths, align: int, tp: int, cp: int, rank: int, max_seqlen: int | None) -> ThdInfo:
    """The CUDA planning path: the host computes three ints, one Triton kernel every per-token map."""
    p = (src.host + (align - 1)) // align * align
    b = p.shape[0]
    extra = -int(p.sum()) % math.lcm(align, tp * cp) if b else 0
    total = int(p.sum()) + extra
    longest = max(int(p.max()), int(p[-1]) + extra) if b else 0
    _check_max_seqlen(max_seqlen, longest)
    out = _plan_kernel.plan_rows(
        _plan_kernel.THD, src.mask, checked_lengths(src), total=total, align=align, cp=cp, rank=rank, last_extra=extra
    )
    info = ThdInfo(
        source=padded_source(src, out["cu_seqlens"]),
        cu_seqlens=out["cu_seqlens"],
        cu_seqlens_padded=out["cu_seqlens_padded"],
        max_seqlen=longest if max_seqlen is None else max_seqlen,
        total_tokens=total,
        local_tokens=total // cp,
        tp_size=tp,
        cp_size=cp,
        cp_rank=rank,
        seq_align=align,
        index=out["index"],
        inverse=out["inverse"],
        segments=None,
    )
    info.__dict__["local_positions"] = out["positions"]  # computed by the kernel: fills the cached property
    return info


def _host_layout(lengths: np.ndarray, align, tp, cp, rank, bucket_tokens, spares, max_seqlen):
    """Every per-sequence number of the layout, on the host (int64 numpy arrays; ``lengths`` is [b])."""
    b = lengths.shape[0]
    p = (lengths + (align - 1)) // align * align
    if bucket_tokens is None:
        if b:
            p[-1] += -int(p.sum()) % math.lcm(align, tp * cp)
        cu_pair = cumsum0(p)[None]
    else:
        slack = bucket_tokens - int(p.sum())
        if slack < 0:
            raise ValueError(
                f"the batch needs {bucket_tokens - slack} padded tokens but the bucket holds {bucket_tokens}; "
                "plan it with a larger bucket (or split the batch)"
            )
        spare = np.clip(slack - max_seqlen * np.arange(spares), 0, max_seqlen)  # [M, M, rest, 0, ...]
        p = np.concatenate([p, spare])
        cu_pair = np.stack([np.concatenate([cumsum0(lengths), np.full(spares, lengths.sum())]), cumsum0(p)])
    n = p.shape[0]
    total = int(cu_pair[-1, -1])
    longest = int(p.max()) if n else 0
    local = total // cp
    start = cu_pair[-1, :-1] // cp  # where each sequence starts on every rank
    if cp == 1:
        segments = np.stack([p, -start])
        return [total, longest, local], [cu_pair, segments, start[:b] - 1]
    c = p // (2 * cp)  # chunk size
    # This rank's runs of consecutive positions, two per sequence (its chunks rank and 2cp-1-rank): the run
    # lengths, and position minus local row (the chunk's first position minus its first local row).
    segments = np.empty((2, n, 2), dtype=np.int64)
    segments[0] = c[:, None]
    np.subtract(rank * c, start, out=segments[1, :, 0])
    np.subtract((2 * cp - 2 - rank) * c, start, out=segments[1, :, 1])
    # Real token at position q of sequence i, in chunk k = q // c, goes to owner(k)'s tensor at row
    # start + (k >= cp) * c + q - k * c.  Column k + 1 holds that row minus q + 1 (column 0: padding).
    ch = np.arange(2 * cp)
    owner_base = np.where(ch < cp, ch, 2 * cp - 1 - ch) * local - 1
    table = np.zeros((b, 2 * cp + 1), dtype=np.int64)
    table[:, 1:] = np.multiply.outer(c[:b], (ch >= cp) - ch) + owner_base
    table[:, 1:] += start[:b, None]
    size = np.maximum(c[:b], 1)
    return [total, longest, local], [cu_pair, segments.reshape(2, -1), size - 1, size, table]


def _check_seq_align(seq_align: int | None, cp_size: int, tp_size: int) -> int:
    if seq_align is None:
        return default_seq_align(cp_size)
    check_positive_int("seq_align", seq_align)
    if cp_size > 1 and seq_align % (2 * cp_size):
        raise ValueError(
            f"seq_align={seq_align} breaks context parallelism: every padded sequence is cut into 2*cp_size="
            f"{2 * cp_size} equal chunks, so seq_align must be a multiple of {2 * cp_size} "
            f"(e.g. {2 * cp_size * tp_size}), or None for the smallest valid alignment"
        )
    return seq_align


def to_thd(
    x: Tensor, attention_mask: Tensor | ThdInfo | None = None, **plan_kwargs
) -> tuple[Tensor, ThdInfo]:
    """Pack ``x: [b, s, *]`` (any dtype, any trailing dims) into this CP rank's THD tensor ``[t_local, *]``.

    ``attention_mask`` may be a ``ThdInfo`` from ``plan_thd`` (then no planning happens), or None when ``x`` is a
    jagged nested tensor.  Keyword arguments are those of ``plan_thd``.

    >>> import torch
    >>> ids = torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 0, 0]])
    >>> mask = ids != 0
    >>> [to_thd(ids, mask, cp_size=2, cp_rank=r)[0].tolist() for r in (0, 1)]
    [[11, 12, 0, 0, 21, 0], [13, 14, 15, 0, 22, 23]]
    >>> outs, info = zip(*(to_thd(ids, mask, cp_size=2, cp_rank=r) for r in (0, 1)))
    >>> from_thd(list(outs), info[0]).tolist()
    [[11, 12, 13, 14, 15], [21, 22, 23, 0, 0]]
    """
    if isinstance(attention_mask, ThdInfo):
        if plan_kwargs:
            raise TypeError(f"to_thd got a ThdInfo plan and planning arguments {sorted(plan_kwargs)}; pass one or the other")
        info = attention_mask
    else:
        info = plan_thd(attention_mask, x=x, **plan_kwargs)
    rows = canvas_rows_of(x, info.source)
    offset = info.cp_rank * info.local_tokens
    return gather_rows([rows], info.gather_index, info.inverse, inverse_offset=offset), info


def from_thd(y: Tensor | Sequence[Tensor], info: ThdInfo, fill_value: float = 0) -> Tensor:
    """The inverse of ``to_thd``: ``[b, s, *]`` (or a jagged nested tensor, for nested input) with
    ``fill_value`` at padded positions.

    ``y``: this rank's ``[t_local, *]`` output when ``cp_size == 1``; the list of every CP rank's output, in rank
    order, when ``cp_size > 1`` (gathering them is the caller's collective).

    >>> import torch
    >>> ids = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]])
    >>> y, info = to_thd(ids, ids != 0, tp_size=2)
    >>> y.tolist(), from_thd(y * 10, info, fill_value=-1).tolist()
    ([1, 2, 3, 4, 5, 0], [[10, 20, 30, -1], [40, 50, -1, -1]])
    """
    ys = _check_outputs(y, info)
    canvas = gather_rows(ys, info.inverse, info.index, fill_value, expand=True)
    return from_canvas(canvas, info.source)


def _check_outputs(y: Tensor | Sequence[Tensor], info: ThdInfo) -> list[Tensor]:
    if isinstance(y, Tensor):
        if info.cp_size > 1:
            raise TypeError(
                f"from_thd got one tensor but the plan has cp_size={info.cp_size}; pass the list of all "
                f"{info.cp_size} CP ranks' outputs in rank order (gather them over the CP group first)"
            )
        ys = [y]
    elif isinstance(y, (list, tuple)) and all(isinstance(t, Tensor) for t in y):
        ys = list(y)
    else:
        raise TypeError("from_thd takes a tensor (cp_size == 1) or a list of tensors, one per CP rank")
    if len(ys) != info.cp_size:
        raise ValueError(f"from_thd got {len(ys)} rank outputs but the plan has cp_size={info.cp_size}; pass one per CP rank")
    for k, t in enumerate(ys):
        if t.dim() < 1 or t.shape[0] != info.local_tokens:
            raise ValueError(
                f"rank {k}'s output has {t.shape[0] if t.dim() else 0} tokens but the plan has {info.local_tokens} "
                "per rank; pass the model output for exactly the tokens to_thd produced"
            )
        if t.shape[1:] != ys[0].shape[1:] or t.dtype != ys[0].dtype or t.device != ys[0].device:
            raise ValueError("every rank's output must have the same trailing shape, dtype and device")
    return ys


def position_ids(info: ThdInfo) -> Tensor:
    """[t_local] int64: each local token's position inside its own padded sequence (right under CP).

    >>> import torch
    >>> position_ids(plan_thd(torch.ones(1, 8, dtype=torch.bool), cp_size=2, cp_rank=0)).tolist()
    [0, 1, 6, 7]
    """
    return info.local_positions
