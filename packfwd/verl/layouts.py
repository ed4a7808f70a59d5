"""verl's flavour of ``make_forward``'s layout adapters (:mod:`packfwd.forward.layouts`): only what verl 0.9.1 lays
out differently is here; planning, packing, the CP gather and unpacking are the adapters'.

* :class:`VerlThd`: THD with verl's alignment (:func:`packfwd.layout.rules.verl_alignment`: ``2*tp*cp`` per
  sequence, ``tp`` without CP; FP8 padding; a length bucket), verl's ``PackedSeqParams`` (``cu_seqlens_q/kv`` hold
  the padded offsets, like ``*_padded``: pads sit at each sequence's tail, so attention over them changes no real
  token) and ``max_seqlen`` as planned.
* :class:`VerlBshd`: the nested forward's BSHD: every row padded to one width (``forced_max_seqlen`` or the
  longest, rounded up to the alignment; under FP8 so that ``b * width`` divides by ``128*tp*cp``); under CP each
  row is cut into ``2*cp`` chunks and this rank keeps its zigzag pair (:func:`packfwd.layout.rules.zigzag_position`,
  put back after the gather by :func:`~packfwd.layout.rules.zigzag_owner`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from packfwd.engine import Bshd, Thd
from packfwd.layout import from_bshd, plan_thd
from packfwd.layout.rules import verl_alignment, verl_bshd_width, zigzag_owner, zigzag_position

__all__ = ["VerlBshd", "VerlThd", "widen"]


class VerlThd(Thd):
    """``Thd`` with verl's alignment and ``PackedSeqParams`` (module docstring).

    >>> import torch
    >>> mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).bool()
    >>> info, ids = VerlThd(2, 1, 0, None).pack(torch.arange(8).reshape(2, 4), mask)
    >>> info.cu_seqlens_padded.tolist(), ids.tolist()          # each sequence padded to tp = 2
    ([0, 4, 6], [[0, 1, 2, 0, 4, 5]])
    """

    def __init__(self, tp_size: int, cp_size: int, cp_rank: int, cp_group, *, fp8_padding: bool = False,
                 length_bucket: int | None = None, local_cp_size: int | None = None):
        align = verl_alignment(tp_size, cp_size, fp8_padding=fp8_padding, length_bucket=length_bucket)
        # plan_thd pads the total to lcm(seq_align, tp_size * cp_size): a total of align.total_multiple
        super().__init__(align.total_multiple // cp_size, cp_size, cp_rank, cp_group, align.seq_align)
        self.local_cp_size = local_cp_size

    def plan(self, input_ids, attention_mask, seqlens=None):
        return plan_thd(attention_mask, x=input_ids, seqlens=seqlens, **self.kw)  # verl's max_seqlen, as planned

    def model_kwargs(self, info):
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = info.cu_seqlens_padded
        extra = {}
        if self.local_cp_size is not None:  # dynamic CP: the group rides along, as verl passes it
            extra.update(local_cp_size=self.local_cp_size, cp_group=self.cp_group)
        if "cp_partition_mode" in {f.name for f in dataclasses.fields(PackedSeqParams)}:
            extra["cp_partition_mode"] = "zigzag"  # newer Megatron-Cores name the CP split; verl names it too
        # verl's fields; the plan's pads go to an MoE model as padding_mask (the engine), as verl's caller would pass them
        params = dataclasses.replace(info.packed_seq_params(), cu_seqlens_q=cu, cu_seqlens_kv=cu, layout_pads=None,
                                     **extra)
        return {"packed_seq_params": params}


class VerlBshd(Bshd):
    """``Bshd`` of a jagged batch at verl's width, split per row over CP (module docstring).

    >>> import torch
    >>> ids = torch.nested.nested_tensor([torch.tensor([1, 2, 3]), torch.tensor([4])], layout=torch.jagged)
    >>> layout = VerlBshd(1, 2, 1, None)                       # CP rank 1 of 2: chunks 1 and 2 of 4
    >>> info, local = layout.pack(ids, None)
    >>> layout.width(info), local.tolist(), layout.attention_mask(info).int().tolist()
    (4, [[2, 3], [0, 0]], [[1, 1], [0, 0]])
    """

    def __init__(self, tp_size: int, cp_size: int, cp_rank: int, cp_group, *, fp8_padding: bool = False,
                 forced_width: int | None = None):
        if forced_width is not None and (isinstance(forced_width, bool) or not isinstance(forced_width, int)
                                         or forced_width < 1):
            raise ValueError(f"forced_max_seqlen must be a positive int, got {forced_width!r}")
        self.align = verl_alignment(tp_size, cp_size).seq_align
        super().__init__(self.align)  # the plan's width: the longest sequence rounded up to the alignment
        self.tp, self.cp, self.cp_rank, self.cp_group = tp_size, cp_size, cp_rank, cp_group
        self.fp8_padding, self.forced_width = fp8_padding, forced_width

    def row_width(self, info, fp8_padding: bool) -> int:
        """verl's width (:func:`packfwd.layout.rules.verl_bshd_width`)."""
        return verl_bshd_width(info.width, info.source.batch_size, tp_size=self.tp, cp_size=self.cp,
                               fp8_padding=fp8_padding, forced=self.forced_width)

    def width(self, info) -> int:
        return self.row_width(info, self.fp8_padding)

    def split(self, x: Tensor, info) -> Tensor:
        """``[b, w0, *] -> [b, width / cp, *]``: zeros (False) on the right up to :meth:`width`, then this CP rank's
        two zigzag chunks of every row."""
        width = self.width(info)
        x = widen(x, width)
        if self.cp == 1:
            return x
        rows = torch.arange(width // self.cp, device=x.device)
        return x.index_select(1, zigzag_position(rows, width // (2 * self.cp), self.cp, self.cp_rank))

    def pack(self, input_ids, attention_mask, seqlens=None):
        info, ids = super().pack(input_ids, attention_mask, seqlens)
        return info, self.split(ids, info)

    def rows(self, x, info):
        return self.split(super().rows(x, info), info)

    def attention_mask(self, info) -> Tensor:
        """``[b, width / cp]`` bool, True at real tokens: verl's BSHD padding mask of this rank."""
        return self.split(info.attention_mask, info)

    def padding_mask(self, info) -> Tensor:
        """``[b, width / cp]`` bool, True at this rank's padding slots (kept from an MoE model's routers)."""
        return ~self.attention_mask(info)

    def positions(self, info, ids, position_ids, input_ids, coords="any"):
        if position_ids is not None:
            raise ValueError("verl's nested BSHD forward computes its positions (0, 1, ... of every row); pass none")
        b, width = info.source.batch_size, self.width(info)
        return self.split(torch.arange(width, device=ids.device).expand(b, width), info)

    def unpack(self, y, info):
        rows = self.output_rows(y, info)  # [b, width / cp, *]
        if self.cp > 1:
            from packfwd.parallel import all_gather_cp

            # every rank computes the same loss from the gathered outputs: the backward keeps this rank's slice
            parts = all_gather_cp(rows, self.cp_group, backward="local")  # [cp, b, width / cp, *]
            width = self.width(info)
            rank, row = zigzag_owner(torch.arange(width, device=rows.device), width // (2 * self.cp), self.cp)
            rows = parts.transpose(1, 2)[rank, row].transpose(0, 1)  # [b, width, *] in natural order
        return from_bshd(rows[:, : info.width], info)


def widen(x: Tensor, width: int) -> Tensor:
    """``[b, w0, *] -> [b, width, *]``, zeros (False) on the right."""
    extra = width - x.shape[1]
    if extra == 0:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], extra, *x.shape[2:])], dim=1)
