"""How the engine packs a batch, its positions and per-token inputs, and unpacks the outputs: one class per data
format (THD, BSHD), each a thin adapter over the layout's plan (``packfwd.layout``).

``packfwd.verl``'s forwards use the same adapters in verl's flavour (:mod:`packfwd.verl.layouts`: verl's alignment
and ``PackedSeqParams``; the nested forward's fixed-width BSHD with its per-row CP split).

Each adapter maps ``pack``: the batch -> ``(plan, ids)`` in the model's layout; ``tokens``: the model's output ->
``[t, *]`` (one row per packed token); ``output_rows``: its inverse; ``pack_arg``: a per-token (or per-sequence)
argument -> ``[t, *]``; ``unpack``: ``[t, *]`` -> the caller's layout (CP ranks gathered first).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..layout.bshd import from_bshd, to_bshd
from ..layout.rules import check_seq_align
from ..layout.thd import ThdInfo, from_thd, plan_thd, position_ids as thd_position_ids, to_thd
from ..layout.positions import pack_positions
from .checks import check_positions

__all__ = ["Bshd", "Thd"]


class Thd:
    """The THD adapter: plans with ``plan_thd`` (this rank's zigzag share under CP), packs to one ``[1, t]`` row
    with ``PackedSeqParams``, gathers every CP rank's outputs over ``cp_group`` before unpacking."""

    def __init__(self, tp_size, cp_size, cp_rank, cp_group, seq_align):
        self.kw = dict(tp_size=tp_size, cp_size=cp_size, cp_rank=cp_rank, seq_align=seq_align)
        self.cp_group = cp_group

    def plan(self, input_ids, attention_mask, seqlens=None):
        info = plan_thd(attention_mask, x=input_ids, seqlens=seqlens, **self.kw)
        if info.cp_size > 1 and info.max_seqlen * info.cp_size == info.total_tokens:
            # Megatron-Core's THD RoPE takes a table of max_seqlen * cp_size rows whose length equals the packed
            # total as "one row per packed token" and offsets each sequence's positions by its start; report
            # a larger max_seqlen (still valid: an upper bound, a multiple of 2*cp) so the table means "positions
            # 0, 1, ..." of each sequence.  Only the reported bound changes: no second planning pass.
            info = dataclasses.replace(info, max_seqlen=info.max_seqlen + 2 * info.cp_size)
        return info

    def plan_bucket(self, attention_mask, bucket, seqlens=None):
        from ..layout.bucket import plan_thd_bucket

        info = plan_thd_bucket(attention_mask, bucket, seqlens=seqlens, **self.kw)
        self._check_rope_bound(info, "bucket=Bucket(tokens, max_seqlen) with max_seqlen * cp_size != tokens")
        return info

    def pack(self, input_ids, attention_mask, seqlens=None):
        info = self.plan(input_ids, attention_mask, seqlens)
        ids, _ = to_thd(input_ids, info)
        return info, ids[None]  # [1, t]

    def pack_planned(self, info, input_ids, attention_mask, seqlens):
        """``pack`` with the caller's plan (``forward.plan``'s): checked against this layout and the batch."""
        fix = "make it with forward.plan(input_ids, attention_mask, seqlens=...)"
        if attention_mask is not None or seqlens is not None:
            raise ValueError("plan= is the batch's plan already: pass attention_mask and seqlens to forward.plan(...) "
                             "and call forward(model, input_ids, plan=plan) without them")
        if not isinstance(info, ThdInfo):
            raise TypeError(f"plan= takes a THD plan (ThdInfo), got {type(info).__name__}; {fix}")
        want = dict(self.kw, seq_align=check_seq_align(self.kw["seq_align"], self.kw["cp_size"], self.kw["tp_size"]))
        got = {k: getattr(info, k) for k in want}
        if got != want:
            differ = ", ".join(f"{k}={got[k]} (the forward's {want[k]})" for k in want if got[k] != want[k])
            raise ValueError(f"plan= was made for another layout: {differ}; {fix}")
        if isinstance(input_ids, Tensor) and not input_ids.is_nested and (
                tuple(input_ids.shape[:2]) != (info.batch_size, info.seq_len)):
            raise ValueError(f"plan= is for a [{info.batch_size}, {info.seq_len}] batch, input_ids is "
                             f"{list(input_ids.shape[:2])}; {fix}")
        self._check_rope_bound(info, fix)
        ids, _ = to_thd(input_ids, info)
        return ids[None]

    @staticmethod
    def _check_rope_bound(info, fix):  # see plan(): a bound equal to the packed total means something else
        if info.cp_size > 1 and info.max_seqlen * info.cp_size == info.total_tokens:
            raise ValueError(f"a CP plan whose max_seqlen * cp_size equals its packed total ({info.total_tokens}) "
                             f"is read by Megatron-Core's THD RoPE as one row per packed token; {fix}")

    def positions(self, info, ids, position_ids, input_ids, coords="any"):
        if position_ids is None:
            return thd_position_ids(info)[None]
        check_positions(position_ids, input_ids, coords)  # in the caller's shapes: the model sees packed ones
        return _coords_first(pack_positions(position_ids, info), position_ids)[..., None, :]  # [1, t] or [k, 1, t]

    def model_kwargs(self, info):
        return {"packed_seq_params": info.packed_seq_params()}

    def padding_mask(self, info):
        """``[1, t]`` bool, True at the layout's padding slots of this rank (what an MoE model's routers skip)."""
        return info.padding_mask()

    def empty_shape(self, info, post_process):  # the model's output for t = 0, before its last dim
        return (1, info.local_tokens) if post_process else (info.local_tokens, 1)

    def fingerprint(self, info):
        """Host ints every rank of a TP/CP group must agree on (no device sync)."""
        return (info.batch_size, info.seq_len, info.source.total, info.total_tokens, info.max_seqlen)

    def tokens(self, out, info):
        return out.reshape(info.local_tokens, *out.shape[2:])  # [1, t, v] -> [t, v]

    def output_rows(self, y, info):
        return y[None]  # [t, *] -> [1, t, *]

    def pack_arg(self, value, info, input_ids, name="a processor argument"):
        return _pack_arg(value, input_ids, lambda x: to_thd(x, info)[0], info.source, name)

    def unpack(self, y, info):
        if info.cp_size > 1 and info.local_tokens == 0:  # nothing to gather (every rank planned the same batch)
            return from_thd([y] * info.cp_size, info)
        if info.cp_size > 1:
            from ..parallel import all_gather_cp

            # every rank computes the same loss from the gathered outputs: the backward keeps this rank's slice
            return from_thd(list(all_gather_cp(y, self.cp_group, backward="local")), info)
        return from_thd(y, info)


class Bshd:
    """The BSHD adapter: each row's real tokens moved left into ``[b, s_c]`` (``to_bshd``), ``s_c`` rounded up to
    ``tp_size``; no plan made ahead, no CP."""

    def __init__(self, tp_size):
        self.tp_size = tp_size

    def pack(self, input_ids, attention_mask, seqlens=None):
        ids, info = to_bshd(input_ids, attention_mask, tp_size=self.tp_size, seqlens=seqlens)
        return info, ids  # [b, s_c]

    def pack_planned(self, info, input_ids, attention_mask, seqlens):
        raise TypeError("plan= takes a THD plan: build the forward with make_forward('thd'); a BSHD forward plans "
                        "each call (its plan is the padded batch itself)")

    def plan(self, input_ids, attention_mask, seqlens=None):
        raise TypeError("forward.plan makes THD plans: build the forward with make_forward('thd'); a BSHD forward "
                        "plans each call (its plan is the padded batch itself)")

    plan_bucket = plan

    def positions(self, info, ids, position_ids, input_ids, coords="any"):
        if position_ids is None:
            return torch.arange(info.width, device=ids.device).expand(ids.shape[0], info.width)
        check_positions(position_ids, input_ids, coords)
        return _coords_first(pack_positions(position_ids, info), position_ids)  # [b, s_c] or [k, b, s_c]

    def model_kwargs(self, info):
        return {}

    def padding_mask(self, info):
        """``[b, s_c]`` bool, True at the padding slots of the compacted rows."""
        return info.padding_mask()

    def empty_shape(self, info, post_process):
        b = info.source.batch_size
        return (b, info.width) if post_process else (info.width, b)

    def fingerprint(self, info):
        return (info.source.batch_size, info.source.seq_len, info.source.total, info.width)

    def tokens(self, out, info):
        return out.reshape(-1, *out.shape[2:])  # [b, s_c, v] -> [b*s_c, v]

    def output_rows(self, y, info):
        return y.reshape(info.source.batch_size, -1, *y.shape[1:])  # [b*s_c, *] -> [b, s_c, *]

    def rows(self, x, info):
        return to_bshd(x, info)[0]  # [b, s, *] (or jagged [b, j, *]) -> [b, s_c, *]

    def pack_arg(self, value, info, input_ids, name="a processor argument"):
        return _pack_arg(value, input_ids, lambda x: self.tokens(self.rows(x, info), info), info.source, name)

    def unpack(self, y, info):
        b = info.source.batch_size
        return from_bshd(y.reshape(b, info.width, *y.shape[1:]), info)


def _coords_first(packed, position_ids):
    """Nested ``[b, j, k]`` positions pack coordinates last; the model takes them first (``[k, ...]``)."""
    return packed.movedim(-1, 0) if position_ids.is_nested and position_ids.dim() == 3 else packed


PER_TOKEN_ONLY = ("labels",)  # processor arguments that have no per-sequence form: [b] is a mistake, not a broadcast


def _pack_arg(value, input_ids, pack, source, name="a processor argument"):
    """A processor argument (``name``) in the packed layout (rules in the module docstring)."""
    if not isinstance(value, Tensor) or value.dim() == 0:
        return value
    b = source.batch_size
    if name in PER_TOKEN_ONLY and value.dim() == 1 and not value.is_nested:
        raise ValueError(
            f"{name} has shape {tuple(value.shape)}: {name} are per token, never per sequence; pass [b, s] like "
            "input_ids (or jagged like it): the next token of each position and -100 where there is none, "
            "packfwd.next_token_labels(input_ids, attention_mask)"
        )
    if input_ids is not None and input_ids.is_nested:
        if value.is_nested:
            return pack(value)
        if value.dim() == 1 and value.shape[0] == b:  # per sequence -> per token, jagged like input_ids
            token = torch.arange(source.total, device=value.device)
            seq = torch.searchsorted(source.cu_seqlens[1:].to(value.device), token, right=True)
            return pack(torch.nested.nested_tensor_from_jagged(value[seq], source.nested_offsets.to(value.device)))
    else:
        s = input_ids.shape[1] if input_ids is not None else source.seq_len
        if value.dim() >= 2 and tuple(value.shape[:2]) == (b, s):
            return pack(value)
        if value.dim() == 1 and value.shape[0] == b:
            return pack(value[:, None].expand(b, s))
    if name in PER_TOKEN_ONLY:
        raise ValueError(f"{name} has shape {tuple(value.shape)}; pass [b, s] like input_ids (or jagged like it): "
                         "packfwd.next_token_labels(input_ids, attention_mask)")
    raise ValueError(
        f"{name} has shape {tuple(value.shape)}; give per-token values like input_ids ([b, s, ...], or "
        f"jagged), per-sequence values as [b={b}], or a scalar"
    )
