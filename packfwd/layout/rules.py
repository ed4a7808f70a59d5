"""The two rules of the THD layout, each defined once: how long a padded sequence is (alignment), and which CP
rank holds each of its tokens (the zigzag split).

Everything that must agree with the layout calls these functions: the host planner (``layout/thd.py``, numpy),
``ThdInfo.positions`` and the RoPE of packfwd's models (torch, on the device), context-parallel attention
(``parallel/context.py``), the picture helpers and the micro-batch planner.  They use integer operators only, so
one definition serves Python ints, numpy arrays and torch tensors alike.  The one copy that cannot call them, the
Triton planning kernel (``ops/plan.py``), is checked against them by Hypothesis (``tests/gpu/test_plan_kernel.py``, run on the CPU under Triton's interpreter).

Alignment: sequence ``i`` of ``n_i`` real tokens is padded to ``p_i = round_up(n_i, seq_align)``; then the last
sequence is extended by ``last_extra`` so the total divides by ``lcm(seq_align, tp * cp)`` (each CP rank's share
then divides by ``tp``: sequence parallelism splits it).  ``seq_align`` defaults to ``2 * cp`` (1 without CP),
the smallest Megatron-Core accepts.

verl's alignment (:func:`verl_alignment`, what ``packfwd.verl`` and the padding pictures use): ``2 * tp * cp``
per sequence (``tp`` without CP), ``lcm(16, ·)`` under FP8, and a padded total that divides by ``128 * align``
(FP8) and a length bucket; larger than the default, the same rules underneath.

Zigzag: under CP a padded sequence is cut into ``2 * cp`` chunks of ``c = p / (2 * cp)`` tokens; rank ``r``
keeps chunks ``r`` and ``2 * cp - 1 - r``, in that order, so every rank gets the same causal-attention work::

    p = 8, cp = 2, c = 2:   positions 0 1 | 2 3 | 4 5 | 6 7
                            chunk     0     1     2     3
                            rank 0 holds 0 1 6 7,  rank 1 holds 2 3 4 5
"""

from __future__ import annotations

import math
from typing import NamedTuple

from .._validate import check_positive_int

__all__ = [
    "chunk_size",
    "footprint",
    "verl_bshd_width",
    "local_positions",
    "default_seq_align",
    "check_padded_total",
    "check_seq_align",
    "last_extra",
    "padded_lengths",
    "round_up",
    "VerlAlignment",
    "verl_alignment",
    "zigzag_owner",
    "zigzag_position",
]


def default_seq_align(cp_size: int) -> int:
    """The smallest per-sequence alignment Megatron accepts: ``2*cp_size`` under CP, else 1.

    >>> default_seq_align(1), default_seq_align(4)
    (1, 8)
    """
    cp_size = check_positive_int("cp_size", cp_size)
    return 2 * cp_size if cp_size > 1 else 1


def check_seq_align(seq_align: int | None, cp_size: int, tp_size: int) -> int:
    """``seq_align`` validated (None: the default); raises ValueError when the CP split cannot use it."""
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


class VerlAlignment(NamedTuple):
    """verl's THD alignment: each sequence padded to a multiple of ``seq_align``, the padded total to a multiple of
    ``total_multiple`` (the last sequence takes the extra)."""

    seq_align: int
    total_multiple: int  # a multiple of seq_align (so of 2*cp under CP): plan_thd's tp_size=total_multiple // cp


def verl_alignment(tp_size: int, cp_size: int, *, fp8_padding: bool = False,
                   length_bucket: int | None = None) -> VerlAlignment:
    """verl 0.9.1's THD alignment (``verl/models/mcore/util.py``, ``preprocess_packed_seqs`` and
    ``preprocess_thd_engine``): per sequence ``2*tp*cp`` under CP (the zigzag's ``2*cp`` chunks, each split by
    sequence parallelism), else ``tp``; with ``fp8_padding`` (FP8 recipes ``"e4m3"`` / ``"hybrid"``) ``lcm(16,
    ·)`` per sequence and a total that divides by ``128`` times the plain alignment; with ``length_bucket``
    (verl's ``pad_to_length_bucket``) a total that divides by it too.  verl pads the total to ``lcm(bucket, cp)``
    there, which breaks the zigzag or sequence parallelism when the bucket is not a multiple of the alignment;
    packfwd keeps the alignment (the same when it is).

    >>> verl_alignment(2, 2), verl_alignment(4, 1)
    (VerlAlignment(seq_align=8, total_multiple=8), VerlAlignment(seq_align=4, total_multiple=4))
    >>> verl_alignment(2, 1, fp8_padding=True, length_bucket=12)
    VerlAlignment(seq_align=16, total_multiple=768)
    """
    tp_size = check_positive_int("tp_size", tp_size)
    cp_size = check_positive_int("cp_size", cp_size)
    align = 2 * tp_size * cp_size if cp_size > 1 else tp_size
    seq_align = math.lcm(16, align) if fp8_padding else align
    total = math.lcm(seq_align, 128 * align) if fp8_padding else seq_align
    if length_bucket is not None:
        total = math.lcm(total, check_positive_int("pad_to_length_bucket", length_bucket,
                                                   "pass a positive bucket size, or None for no bucket"))
    return VerlAlignment(seq_align, total)


def round_up(n, align: int):
    """``n`` rounded up to a multiple of ``align`` (int, numpy array or tensor).

    >>> round_up(5, 4), round_up(8, 4), round_up(0, 4)
    (8, 8, 0)
    """
    return (n + (align - 1)) // align * align


def last_extra(padded_total: int, *, seq_align: int, tp_size: int, cp_size: int) -> int:
    """Tokens added to the last sequence so the whole batch divides by ``lcm(seq_align, tp_size * cp_size)``.

    >>> last_extra(12, seq_align=4, tp_size=4, cp_size=2)     # 12 -> 16: each rank's 8 tokens divide by tp=4
    4
    """
    return -int(padded_total) % math.lcm(seq_align, tp_size * cp_size)


def footprint(padded_total: int, *, seq_align: int, tp_size: int, cp_size: int) -> int:
    """Tokens per CP rank of a THD batch whose sequences' padded lengths sum to ``padded_total``: the last
    sequence extended (:func:`last_extra`), split over ``cp_size``.

    >>> footprint(12, seq_align=4, tp_size=4, cp_size=2)      # 12 -> 16 tokens, 8 per CP rank
    8
    """
    return (int(padded_total) + last_extra(padded_total, seq_align=seq_align, tp_size=tp_size,
                                           cp_size=cp_size)) // cp_size


def verl_bshd_width(longest: int, batch_size: int, *, tp_size: int, cp_size: int, fp8_padding: bool = False,
                    forced: int | None = None) -> int:
    """The row width of verl 0.9.1's nested BSHD forward: ``forced`` (verl's ``forced_max_seqlen``, at least the
    ``longest`` row) rounded up to the alignment (:func:`verl_alignment`), then with ``fp8_padding`` to a multiple
    that makes ``batch_size * width`` divide by ``128 * tp * cp``.

    >>> verl_bshd_width(5, 3, tp_size=2, cp_size=1), verl_bshd_width(5, 3, tp_size=2, cp_size=1, fp8_padding=True)
    (6, 256)
    """
    align = verl_alignment(tp_size, cp_size).seq_align
    width = round_up(longest, align)
    if forced is not None:
        width = max(width, round_up(forced, align))
    if fp8_padding:
        total = 128 * tp_size * cp_size
        width = round_up(width, math.lcm(total // math.gcd(batch_size, total), align))
    return width


INT32_MAX = 2**31 - 1


def check_padded_total(total: int, seq_align: int) -> int:
    """The padded token count must fit Megatron's int32 ``cu_seqlens``; a larger one (usually an oversized
    ``seq_align``) would also mean tensors of terabytes.  Raises ValueError naming ``seq_align``.

    >>> check_padded_total(12, 4)
    12
    """
    if total > INT32_MAX:
        raise ValueError(
            f"the padded batch would hold {total} tokens (seq_align={seq_align}), more than int32 cu_seqlens can "
            f"index ({INT32_MAX}); use a smaller seq_align (None picks the smallest valid one) or split the batch"
        )
    return total


def padded_lengths(lengths, *, seq_align: int, tp_size: int, cp_size: int):
    """``[b]`` padded length of every sequence (numpy array or tensor in, the same kind out).

    >>> import numpy as np
    >>> padded_lengths(np.array([5, 3]), seq_align=4, tp_size=4, cp_size=2).tolist()
    [8, 8]
    """
    p = round_up(lengths, seq_align)
    if len(p):
        p = p.copy() if hasattr(p, "copy") and not hasattr(p, "clone") else p.clone()
        p[-1] += last_extra(p.sum(), seq_align=seq_align, tp_size=tp_size, cp_size=cp_size)
    return p


def chunk_size(padded_length, cp_size: int):
    """Tokens per zigzag chunk: ``p / (2 * cp)`` (``p`` is a multiple of ``2 * cp`` under CP).

    >>> chunk_size(8, 2)
    2
    """
    return padded_length // (2 * cp_size)


def zigzag_position(u, chunk, cp_size: int, cp_rank: int):
    """The position in its padded sequence of row ``u`` of rank ``cp_rank``'s share of that sequence
    (``0 <= u < 2 * chunk``): rows ``[0, chunk)`` are chunk ``cp_rank``, the rest chunk ``2*cp_size-1-cp_rank``.

    >>> [zigzag_position(u, 2, 2, 0) for u in range(4)], [zigzag_position(u, 2, 2, 1) for u in range(4)]
    ([0, 1, 6, 7], [2, 3, 4, 5])
    """
    if cp_size == 1:
        return u
    return u + cp_rank * chunk + (u >= chunk) * ((2 * cp_size - 2 - 2 * cp_rank) * chunk)


def zigzag_owner(q, chunk, cp_size: int):
    """``(rank, row)``: the CP rank that holds position ``q`` of a padded sequence, and its row in that rank's
    share of the sequence.  The inverse of :func:`zigzag_position`.  ``chunk`` must be >= 1 under CP.

    >>> [zigzag_owner(q, 2, 2) for q in (0, 3, 5, 7)]
    [(0, 0), (1, 1), (1, 3), (0, 3)]
    """
    if cp_size == 1:
        return q * 0, q
    k = q // chunk  # global chunk index in [0, 2 * cp)
    second = k >= cp_size
    return k + second * (2 * cp_size - 1 - 2 * k), q - k * chunk + second * chunk


def local_positions(cu_seqlens_padded, tokens: int, cp_size: int = 1, cp_rank: int = 0):
    """``[tokens]`` int64: the position of each row of CP rank ``cp_rank``'s THD tensor inside its own padded
    sequence, from ``cu_seqlens_padded [n+1]`` (whole padded sequences, before the CP split).  On the device,
    no host sync; what RoPE, context-parallel attention and ``ThdInfo.positions`` use.

    >>> import torch
    >>> cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    >>> local_positions(cu, 12).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    >>> local_positions(cu, 6, cp_size=2, cp_rank=1).tolist()     # chunks 1 and 2 of each sequence
    [2, 3, 4, 5, 1, 2]
    """
    import torch

    device = cu_seqlens_padded.device
    if tokens == 0 or cu_seqlens_padded.numel() < 2:
        return torch.zeros(tokens, dtype=torch.long, device=device)
    starts = cu_seqlens_padded.to(torch.long) // cp_size  # where each sequence starts in this rank's tensor
    row = torch.arange(tokens, device=device)
    seq = torch.searchsorted(starts[1:], row, right=True).clamp_(max=starts.numel() - 2)
    first = starts[seq]
    chunk = chunk_size(starts[seq + 1] - first, 1)  # this rank's share is 2 chunks: (p / cp) / 2
    return zigzag_position(row - first, chunk, cp_size, cp_rank)
