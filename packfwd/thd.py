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

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ._checks import check_positive_int, check_rank
from ._rows import gather_rows, scatter_rows, static_nonzero
from ._source import TokenSource, _cumsum0, canvas_rows_of, from_canvas, plan_source


@dataclass(frozen=True)
class ThdInfo:
    """The plan of ``to_thd`` for one CP rank; also everything ``from_thd`` needs to put all ranks back.

    Megatron-Core's names: ``cu_seqlens`` [b+1] int32 (real lengths), ``cu_seqlens_padded`` [b+1] int32 (whole
    padded sequences, before the CP split), ``max_seqlen`` (longest padded sequence, a Python int).
    """

    source: TokenSource
    cu_seqlens_padded: Tensor  # [b+1] int32
    max_seqlen: int
    total_tokens: int  # cu_seqlens_padded[-1], all CP ranks together
    local_tokens: int  # this rank's share, total_tokens // cp_size
    tp_size: int
    cp_size: int
    cp_rank: int
    seq_align: int
    gather_index: Tensor  # [local_tokens] canvas row of each local token (0 at padding)
    zero_rows: Tensor  # local rows that are padding
    scatter_index: Tensor  # [cp_size, local_tokens] canvas row of each rank's token (canvas_rows at padding)
    local_positions: Tensor  # [local_tokens] int64, position of each local token in its padded sequence

    @property
    def cu_seqlens(self) -> Tensor:
        return self.source.cu_seqlens

    @property
    def local_cu_seqlens_padded(self) -> Tensor:
        """[b+1] int32: where each sequence starts in this rank's tensor (``cu_seqlens_padded // cp_size``)."""
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
    """The smallest per-sequence alignment Megatron accepts: ``2*cp_size`` under CP, else 1."""
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
    tp_size = check_positive_int("tp_size", tp_size)
    cp_size = check_positive_int("cp_size", cp_size)
    cp_rank = check_rank("cp_rank", cp_rank, cp_size, "cp_size")
    align = _check_seq_align(seq_align, cp_size, tp_size)
    if max_seqlen is not None:
        check_positive_int("max_seqlen", max_seqlen)

    def scalars(lengths: Tensor) -> list[Tensor]:
        p = padded_lengths(lengths, seq_align=align, tp_size=tp_size, cp_size=cp_size)
        longest = p.max() if p.numel() else p.sum()
        return [p.sum(), longest, _valid_on_rank(lengths, p, cp_size, cp_rank)]

    source, (total, longest, valid_local) = plan_source(x, attention_mask, seqlens, scalars)
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"max_seqlen={max_seqlen} is below the longest padded sequence ({longest}); raise it or pass None")
    p = padded_lengths(source.lengths, seq_align=align, tp_size=tp_size, cp_size=cp_size)
    local = total // cp_size
    ranks = torch.arange(cp_size, device=p.device)
    positions, canvas_row, valid = _zigzag_rows(source, p, cp_size, ranks, local)
    mine = valid[cp_rank]
    return ThdInfo(
        source=source,
        cu_seqlens_padded=_cumsum0(p),
        max_seqlen=longest if max_seqlen is None else max_seqlen,
        total_tokens=total,
        local_tokens=local,
        tp_size=tp_size,
        cp_size=cp_size,
        cp_rank=cp_rank,
        seq_align=align,
        gather_index=torch.where(mine, canvas_row[cp_rank], 0),
        zero_rows=static_nonzero(~mine, local - valid_local, 0),
        scatter_index=torch.where(valid, canvas_row, source.canvas_rows),
        local_positions=positions[cp_rank],
    )


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


def _valid_on_rank(lengths: Tensor, p: Tensor, cp: int, rank: int) -> Tensor:
    """Real tokens that rank ``rank`` holds (a device scalar)."""
    if cp == 1:
        return lengths.sum()
    c = p // (2 * cp)
    held = [(lengths - k * c).clamp(min=0).minimum(c) for k in (rank, 2 * cp - 1 - rank)]
    return (held[0] + held[1]).sum()


def _zigzag_rows(source: TokenSource, p: Tensor, cp: int, ranks: Tensor, local: int):
    """For every rank in ``ranks`` and local row: position in its padded sequence, canvas row, is-real.

    Shapes: positions, canvas_row, valid are all [len(ranks), local].  Vectorised over sequences and ranks.
    """
    b = p.numel()
    seq = torch.repeat_interleave(torch.arange(b, device=p.device), p // cp, output_size=local)  # [local]
    u = torch.arange(local, device=p.device) - (_cumsum0(p // cp)[:-1].long())[seq]
    if cp == 1:
        q = u[None, :]
    else:
        c = (p // (2 * cp))[seq]
        r = ranks[:, None]
        q = torch.where(u < c, r * c + u, (2 * cp - 1 - r) * c + (u - c))
    valid = q < source.lengths[seq]
    k = (source.cu_seqlens.long()[seq] + q).clamp(max=max(source.total - 1, 0))
    index = source.index if source.total else torch.zeros(1, dtype=torch.long, device=p.device)
    return q, index[k], valid


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
    return gather_rows(canvas_rows_of(x, info.source), info.gather_index, info.zero_rows), info


def from_thd(y: Tensor | Sequence[Tensor], info: ThdInfo, fill_value: float = 0) -> Tensor:
    """The inverse of ``to_thd``: ``[b, s, *]`` (or a jagged nested tensor, for nested input) with
    ``fill_value`` at padded positions.

    ``y``: this rank's ``[t_local, *]`` output when ``cp_size == 1``; the list of every CP rank's output, in rank
    order, when ``cp_size > 1`` (gathering them is the caller's collective).
    """
    ys = _check_outputs(y, info)
    dsts = [info.scatter_index[k] for k in range(info.cp_size)]
    canvas = scatter_rows(ys, dsts, info.source.canvas_rows, info.source.fill_rows, fill_value)
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
