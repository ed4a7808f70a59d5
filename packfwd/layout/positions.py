"""``pack_positions`` / ``unpack_positions``: RoPE position ids through any layout plan, one coordinate or several.

Positions are per-token data like any other, with one twist: multimodal RoPE (Qwen2-VL's mrope, ``k = 3``
coordinates: temporal, height, width) keeps its coordinates in a LEADING dimension, ``[k, b, s]`` (the
transformers and Megatron-Core convention), where every other packfwd tensor has its feature dims trailing.
These two functions move ``[b, s]``, ``[k, b, s]`` and ``[b, s, k]`` positions with the plan of ``unpad``,
``to_thd`` (any CP rank, alignment, TP rounding, fixed bucket) or ``to_bshd``, so that every real token keeps all
its coordinates, and back:

==========  =========================  ===================  ======================
plan        ``[b, s]``                 ``[k, b, s]``        ``[b, s, k]``
==========  =========================  ===================  ======================
UnpadInfo   ``[t]``                    ``[k, t]``           ``[t, k]``
ThdInfo     ``[t_local]``              ``[k, t_local]``     ``[t_local, k]``
BshdInfo    ``[b, width]``             ``[k, b, width]``    ``[b, width, k]``
==========  =========================  ===================  ======================

Padding slots of the packed layout (THD alignment and CP padding, BSHD columns past a row's end) hold ``0`` in
every coordinate (as transformers gives pad tokens; no real token attends to them); ``unpack_positions`` puts
``fill_value`` at the caller's padding.  A plan made from a jagged nested batch takes nested ``[b, j]`` or
``[b, j, k]`` positions (ragged dim 1, so coordinates last) and gives nested ones back.  Applying is one gather,
so both directions work under ``torch.func.vmap`` / ``grad`` and ``torch.compile``, for any dtype.

Each plan applies itself (:class:`LayoutPlan`: ``pack_tokens``, ``unpack_tokens``, ``token_dims``); these two
functions only move the coordinates, so a new layout's plan works here by having those methods.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from torch import Tensor

from .._validate import check_tensor
from .source import TokenSource


class LayoutPlan(Protocol):
    """What a layout plan (``UnpadInfo``, ``ThdInfo``, ``BshdInfo``) does with per-token data: the plan owns its
    dispatch (no caller asks which layout it is)."""

    source: TokenSource
    token_dims: int  # dims of the packed tensor that index tokens: 1 for [t, *], 2 for [b, width, *]

    def pack_tokens(self, x: Tensor) -> Tensor:
        """Per-token data ``[b, s, *]`` (or nested ``[b, j, *]``) -> the packed tensor."""
        ...

    def unpack_tokens(self, y: Tensor | Sequence[Tensor], fill_value: float = 0) -> Tensor:
        """The packed tensor (a list of every CP rank's, for a plan split over CP ranks) -> ``[b, s, *]``."""
        ...


_METHODS = ("pack_tokens", "unpack_tokens", "token_dims", "source")


def pack_positions(positions: Tensor, plan: LayoutPlan, *, coord_dim: int | None = None) -> Tensor:
    """``positions`` (``[b, s]``, ``[k, b, s]`` or ``[b, s, k]``) in ``plan``'s layout (table in the module doc).

    ``coord_dim``: where the coordinates are: ``0`` (``[k, b, s]``, the default for 3-D input) or ``-1``
    (``[b, s, k]``, and always for nested input); None for ``[b, s]``.

    >>> import torch
    >>> from packfwd.layout import plan_thd
    >>> mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]]).bool()
    >>> pos = torch.stack([mask.cumsum(1) - 1, 10 * (mask.cumsum(1) - 1), mask.long()]) * mask  # [3, 2, 4]
    >>> info = plan_thd(mask, cp_size=2, cp_rank=1)
    >>> pack_positions(pos, info).tolist()                        # [3, t_local]: rank 1's tokens, 0 at padding
    [[1, 2, 1, 0], [10, 20, 10, 0], [1, 1, 1, 0]]
    >>> ranks = [pack_positions(pos, plan_thd(mask, cp_size=2, cp_rank=r)) for r in (0, 1)]
    >>> torch.equal(unpack_positions(ranks, info), pos)
    True
    """
    plan = _check_plan(plan)
    x, first = _tokens_last(check_tensor("positions", positions), plan, coord_dim, "positions")
    y = plan.pack_tokens(x)
    return y.movedim(-1, 0).contiguous() if first else y


def unpack_positions(
    packed: Tensor | Sequence[Tensor], plan: LayoutPlan, *, coord_dim: int | None = None, fill_value: int = 0
) -> Tensor:
    """The inverse of ``pack_positions``: back to the caller's ``[b, s]``, ``[k, b, s]`` or ``[b, s, k]``, with
    ``fill_value`` at padding.  For a THD plan with ``cp_size > 1`` pass every CP rank's packed positions, in rank
    order (as ``from_thd`` takes them).  ``coord_dim`` as in ``pack_positions``, naming the same dim of the
    packed tensor: ``0`` (the default when there is one more dim than tokens) for ``[k, t]``, ``-1`` for
    ``[t, k]``; a nested plan's coordinates are always last."""
    plan = _check_plan(plan)
    ys = list(packed) if isinstance(packed, (list, tuple)) else [packed]
    if not ys:
        raise ValueError("unpack_positions got an empty list; pass the packed positions (one tensor per CP rank)")
    for y in ys:
        check_tensor("packed", y)
    rank = ys[0].dim()
    first = _coords_first(coord_dim, rank, plan.token_dims, "packed", nested=plan.source.nested_offsets is not None)
    if first:
        ys = [y.movedim(0, -1) for y in ys]
    out = plan.unpack_tokens(ys, fill_value)
    return out.movedim(-1, 0) if first else out


def _check_plan(plan: object) -> LayoutPlan:
    missing = [name for name in _METHODS if not hasattr(plan, name)]
    if missing:
        raise TypeError(
            f"plan must be an UnpadInfo, ThdInfo or BshdInfo (from plan_unpad / plan_thd / plan_bshd), or a layout "
            f"plan with {' / '.join(_METHODS)} (packfwd.layout.positions.LayoutPlan); got {type(plan).__name__}, "
            f"which has no {missing[0]}"
        )
    return plan


def _coords_first(coord_dim: int | None, rank: int, base: int, name: str, *, nested: bool) -> bool:
    """Whether the coordinates lead (True), trail (False) or are absent (None -> False) in a ``rank``-dim tensor
    whose layout has ``base`` token dims."""
    if coord_dim not in (None, 0, -1, base):
        raise ValueError(f"coord_dim must be None, 0 or -1, got {coord_dim!r}")
    if rank == base:
        if coord_dim is not None:
            raise ValueError(f"{name} has {rank} dims (one position per token) but coord_dim={coord_dim}; drop coord_dim")
        return False
    if rank != base + 1:
        raise ValueError(
            f"{name} has {rank} dims; positions are one per token, or k coordinates per token in dim 0 or -1"
        )
    if nested:
        if coord_dim == 0:
            raise ValueError(f"{name} belongs to a nested (jagged) batch: its coordinates are last; pass coord_dim=-1")
        return False
    return coord_dim in (None, 0)


def _tokens_last(pos: Tensor, plan: LayoutPlan, coord_dim: int | None, name: str) -> tuple[Tensor, bool]:
    """``pos`` as ``[b, s, *]`` (or nested ``[b, j, *]``), and whether its coordinates led."""
    first = _coords_first(coord_dim, pos.dim(), 2, name, nested=pos.is_nested)
    if pos.is_nested:
        if plan.source.nested_offsets is None:
            raise ValueError(f"{name} is nested but the plan was made from a padded batch; pass [b, s] positions")
        if pos.values().shape[0] != plan.source.total:
            raise ValueError(f"{name} holds {pos.values().shape[0]} tokens but the plan has {plan.source.total}")
        return pos, False
    b, s = plan.source.batch_size, plan.source.seq_len
    if plan.source.nested_offsets is not None:
        raise ValueError(f"the plan was made from a nested batch; pass nested {name} with the same offsets")
    x = pos.movedim(0, -1) if first else pos
    if tuple(x.shape[:2]) != (b, s):
        hint = ""
        if pos.dim() == 3 and first and tuple(pos.shape[:2]) == (b, s):
            hint = " (it looks like [b, s, k]: pass coord_dim=-1)"
        elif pos.dim() == 3 and not first and tuple(pos.shape[1:]) == (b, s):
            hint = " (it looks like [k, b, s]: pass coord_dim=0)"
        want = {2: f"[{b}, {s}]", 3: f"[k, {b}, {s}]" if first else f"[{b}, {s}, k]"}.get(pos.dim())
        raise ValueError(f"{name} has shape {tuple(pos.shape)} but the plan's batch is b={b}, s={s}; pass {want}{hint}")
    return x, first
