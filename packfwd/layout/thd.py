"""``to_thd`` / ``from_thd``: the packed THD layout Megatron-Core takes with ``PackedSeqParams``.

Layout (the one Megatron-Core and verl use): sequence after sequence, each sequence's real tokens in order,
zero-padded at its tail to ``p_i``, a multiple of the alignment.  With context parallelism each padded sequence
is cut into ``2*cp`` equal chunks and CP rank ``r`` keeps chunks ``r`` and ``2*cp-1-r`` (the "zigzag" that gives
every rank the same share of causal-attention work)::

    lengths 5, 3   cp=2 (align 4)    padded: [a a a a a . . .][b b b .]
    chunks (c = 2, 1):  seq a -> a0 a1 | a2 a3 | a4 . | . .   seq b -> b0 | b1 | b2 | .
    rank 0 keeps chunks 0 and 3:  a0 a1 . .  b0 .      (6 tokens)
    rank 1 keeps chunks 1 and 2:  a2 a3 a4 . b1 b2     (6 tokens)

The alignment rule and the zigzag split are defined once, in :mod:`packfwd.layout.rules`; this module is the
THD index function built on them.  With ``seq_align=None`` (the default) each sequence is padded to a multiple of
``2*cp`` (not at all when ``cp == 1``) and the last one is extended so each rank's token count divides by
``tp_size``.  ``seq_align=2*cp*tp`` (``tp`` when ``cp == 1``) reproduces verl's layout exactly but spends up to
``2*cp*tp - 1`` pad tokens per sequence instead of ``2*cp - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import numpy as np
import torch
from torch import Tensor

from .._validate import check_positive_int, check_rank, cp_rank_for
from ..ops import plan as plan_kernel
from ..ops.gather import gather_rows
from . import rules
from .positions import pack_positions
from .unpad import one_tensor
from . import display
from .source import Lengths, PlanOfSource, TokenSource, canvas_rows_of, checked_lengths, cumsum0, from_canvas
from .source import padded_source, plan, scatter_inverse


@dataclass(frozen=True)
class ThdInfo(PlanOfSource):
    """The plan of ``to_thd`` for one CP rank; also everything ``from_thd`` needs to put all ranks back.

    Megatron-Core's names: ``cu_seqlens`` [n+1] int32 (real lengths), ``cu_seqlens_padded`` [n+1] int32 (whole
    padded sequences, before the CP split), ``max_seqlen`` (longest padded sequence, a Python int).  ``n`` is the
    batch size ``b`` (plus the spare sequences of a fixed bucket, see ``packfwd.layout.bucket``).
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
    local_positions: Tensor  # [local_tokens] int64, position of each local token in its padded sequence
    # the Bucket that fixes every shape of the plan (packfwd.layout.bucket.plan_thd_bucket), or None: its shapes
    # recur from batch to batch, so the model's attention may take a kernel that plans per shape (cuDNN's)
    bucket: Any = None

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

    @property
    def local_cu_seqlens_padded(self) -> Tensor:
        """[n+1] int32: where each sequence starts in this rank's tensor (``cu_seqlens_padded // cp_size``)."""
        return self.cu_seqlens_padded // self.cp_size

    def __repr__(self) -> str:  # for people: counts, cu_seqlens and shapes, not the index tensors (one host read)
        return display.describe_plan(self)

    def _repr_html_(self) -> str:  # a notebook's table and picture
        return display.plan_html(self)

    token_dims: ClassVar[int] = 1  # this rank's packed tensor is [t_local, *]

    def pack_tokens(self, x: Tensor) -> Tensor:
        """``to_thd(x, self)[0]``: per-token data ``[b, s, *]`` (or nested) -> this rank's ``[t_local, *]``."""
        return to_thd(x, self)[0]

    def unpack_tokens(self, y: Tensor | Sequence[Tensor], fill_value: float = 0) -> Tensor:
        """``from_thd``: every CP rank's ``[t_local, *]`` in rank order (one tensor when ``cp_size == 1``)."""
        return from_thd(y if self.cp_size > 1 else one_tensor(y, "THD with cp_size=1"), self, fill_value)

    # A model that embeds before packing (make_forward(vision=True)) is given the caller's padded batch: a CP
    # rank holds part of a sequence only, and a vision tower needs every image whole.
    def inputs_to_embed(self, input_ids: Tensor, ids: Tensor, attention_mask, position_ids):
        """Such a model's ``(input_ids, attention_mask, position_ids)``: the caller's (not the packed ``ids``)."""
        return input_ids, attention_mask, position_ids

    def decoder_input(self, x: Tensor) -> Tensor:
        """Its embeddings ``[b, s, h]`` -> Megatron-Core's ``decoder_input`` ``[t_local, 1, h]``."""
        if not isinstance(x, Tensor) or x.dim() < 2 or tuple(x.shape[:2]) != (self.batch_size, self.seq_len):
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x has shape {got}; pass embeddings of the padded batch the model was given: "
                             f"[{self.batch_size}, {self.seq_len}, ...]")
        return self.pack_tokens(x)[:, None]

    def decoder_positions(self, positions: Tensor) -> Tensor:
        """Its positions ``[3, b, s]`` / ``[b, s]`` -> ``[3, 1, t_local]`` / ``[1, t_local]``, 0 at padding."""
        return pack_positions(positions, self)[..., None, :]

    def packed_seq_params(self):
        """Megatron-Core's ``PackedSeqParams`` (``qkv_format="thd"``) for this batch, carrying this rank's CP place
        (``.cp``) to the model's attention (:func:`packfwd.layout.params.thd_params`)."""
        from .params import thd_params

        return thd_params(self)

    def padding_mask(self) -> Tensor:
        """[1, t_local] bool, True at this rank's padding slots: Megatron-Core's MoE ``padding_mask`` (no sync)."""
        return (self.gather_index < 0)[None]


def plan_thd(
    attention_mask: Tensor | None, *, tp_size: int = 1, cp_size: int = 1, cp_rank: int | None = None,
    seq_align: int | None = None, max_seqlen: int | None = None, seqlens: Sequence[int] | None = None,
    x: Tensor | None = None,
) -> ThdInfo:
    """Plan the THD layout of a batch for CP rank ``cp_rank`` (see the module docstring for the layout).
    ``cp_rank`` is required with ``cp_size > 1`` (the plan gathers that rank's share of the tokens).

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
    return plan_thd_layout(attention_mask, tp_size=tp_size, cp_size=cp_size, cp_rank=cp_rank, seq_align=seq_align,
                           max_seqlen=max_seqlen, seqlens=seqlens, x=x)


def plan_thd_layout(
    attention_mask, *, tp_size, cp_size, cp_rank, seq_align, max_seqlen, seqlens, x, padding=None
) -> ThdInfo:
    """``plan_thd`` with, optionally, another ``padding(lengths, align) -> (p, cu_pair)`` of the sequences (the
    padded lengths of ``n >= b`` sequences, and ``[2, n+1]`` real and padded offsets): ``packfwd.layout.bucket``
    passes one that holds a fixed token count."""
    tp = check_positive_int("tp_size", tp_size)
    cp = check_positive_int("cp_size", cp_size)
    rank = check_rank("cp_rank", cp_rank_for(cp, cp_rank), cp, "cp_size")
    align = rules.check_seq_align(seq_align, cp, tp)
    if max_seqlen is not None:
        check_positive_int("max_seqlen", max_seqlen)
    fixed = dict(tp_size=tp, cp_size=cp, cp_rank=rank, seq_align=align)

    def host_layout(lengths):
        if padding is not None:
            return _host_layout(lengths, cp, align, *padding(lengths, align))
        p = rules.padded_lengths(lengths, seq_align=align, tp_size=tp, cp_size=cp)
        return _host_layout(lengths, cp, align, p, cumsum0(p)[None])

    def build(source, ints, arrays):
        total, longest, local = ints
        _check_max_seqlen(max_seqlen, longest)
        cu_pair, (start, chunk) = arrays
        q = source.rank_in_row() - 1  # position of each real token in its sequence
        owner, row = rules.zigzag_owner(q, source.per_row(chunk), cp)
        dest = owner * local + source.per_row(start) + row
        inverse = source.where_real(dest, -1)
        cu32 = cu_pair.to(torch.int32)
        cu_padded = cu32[-1]
        return ThdInfo(
            source=source, cu_seqlens=source.cu_seqlens if padding is None else cu32[0],
            cu_seqlens_padded=cu_padded, max_seqlen=longest if max_seqlen is None else max_seqlen,
            total_tokens=total, local_tokens=local, index=scatter_inverse(inverse, total, source.canvas_rows),
            inverse=inverse, local_positions=rules.local_positions(cu_padded, local, cp, rank), **fixed,
        )

    def device_plan(src: Lengths) -> ThdInfo:  # CUDA: the host computes three ints, one kernel the maps
        p = rules.round_up(src.host, align)
        extra = rules.last_extra(p.sum(), seq_align=align, tp_size=tp, cp_size=cp) if len(p) else 0
        total = rules.check_padded_total(int(p.sum()) + extra, align)
        longest = max(int(p.max()), int(p[-1]) + extra) if len(p) else 0
        _check_max_seqlen(max_seqlen, longest)
        out = plan_kernel.plan_rows(
            plan_kernel.THD, src.mask, checked_lengths(src), total=total, align=align, cp=cp, rank=rank,
            last_extra=extra,
        )
        return ThdInfo(
            source=padded_source(src, out["cu_seqlens"]), cu_seqlens=out["cu_seqlens"],
            cu_seqlens_padded=out["cu_seqlens_padded"], max_seqlen=longest if max_seqlen is None else max_seqlen,
            total_tokens=total, local_tokens=total // cp, index=out["index"], inverse=out["inverse"],
            local_positions=out["positions"], **fixed,
        )

    return plan(x, attention_mask, seqlens, host_layout=host_layout, build=build,
                device_plan=device_plan if padding is None else None)


def _check_max_seqlen(max_seqlen: int | None, longest: int) -> None:
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"max_seqlen={max_seqlen} is below the longest padded sequence ({longest}); raise it or pass None")


def _host_layout(lengths: np.ndarray, cp: int, align: int, p: np.ndarray, cu_pair: np.ndarray):
    """THD's index function on the host, from the real lengths ``[b]``, the padded lengths ``p [n]`` and the
    offsets ``cu_pair`` (``[1, n+1]`` padded, or ``[2, n+1]`` real and padded).

    Returns the ints ``(total, longest, local)`` and two arrays: ``cu_pair`` and ``[2, b]``: where each sequence
    starts in every rank's tensor, and its zigzag chunk size (at least 1).  Token ``q`` of sequence ``i`` then lands
    at ``owner * local + start_i + row`` with ``(owner, row) = rules.zigzag_owner(q, chunk_i, cp)``.
    """
    b = lengths.shape[0]
    total = rules.check_padded_total(int(cu_pair[-1, -1]), align)
    local = total // cp
    start = cu_pair[-1, :b] // cp  # where each sequence starts in every rank's tensor
    chunk = np.maximum(rules.chunk_size(p[:b], cp), 1)
    return [total, int(p.max()) if len(p) else 0, local], [cu_pair, np.stack([start, chunk])]


def to_thd(x: Tensor, attention_mask: Tensor | ThdInfo | None = None, **plan_kwargs) -> tuple[Tensor, ThdInfo]:
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
            raise TypeError(f"from_thd got one tensor but the plan has cp_size={info.cp_size}; pass the list of all "
                            f"{info.cp_size} CP ranks' outputs in rank order (gather them over the CP group first)")
        ys = [y]
    elif isinstance(y, (list, tuple)) and all(isinstance(t, Tensor) for t in y):
        ys = list(y)
    else:
        raise TypeError("from_thd takes a tensor (cp_size == 1) or a list of tensors, one per CP rank")
    if len(ys) != info.cp_size:
        raise ValueError(f"from_thd got {len(ys)} rank outputs but the plan has cp_size={info.cp_size}; pass one per CP rank")
    for k, t in enumerate(ys):
        if t.dim() < 1 or t.shape[0] != info.local_tokens:
            raise ValueError(f"rank {k}'s output has {t.shape[0] if t.dim() else 0} tokens but the plan has "
                             f"{info.local_tokens} per rank; pass the model output for exactly to_thd's tokens")
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
