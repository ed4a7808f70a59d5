"""Context-parallel causal attention over the THD zigzag layout.

Layout (``packfwd.layout.rules``, the one definition of the zigzag): a packed batch of ``n`` sequences, sequence
``i`` zero-padded at its tail to ``p_i`` tokens (a multiple of ``2*cp``) and cut into ``2*cp`` chunks of
``c_i = p_i / (2*cp)`` tokens.  CP rank ``r`` holds chunks ``r`` and ``2*cp-1-r`` of every sequence, concatenated
sequence after sequence, so sequence ``i`` starts at ``cu_seqlens_padded[i] // cp`` in the rank's tensor.

The attention gathers K and V over the CP group and lets each local query chunk attend to the key prefix that
ends with that chunk: global chunk ``j`` of sequence ``i`` sees keys ``[0, (j+1)*c_i)`` of its sequence.  With
flash-attn's bottom-right causal alignment (a query block of length ``c`` against ``L >= c`` keys is aligned to
the end of the keys) one varlen call with one "sequence" per local chunk computes exactly the causal attention
of the full padded sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from .._validate import check_positive_int, check_rank, check_tensor
from ..layout.rules import chunk_size, zigzag_owner, zigzag_position
from .gather import all_gather_cp

__all__ = [
    "ZigzagAttentionPlan",
    "context_parallel_attention",
    "global_to_zigzag",
    "plan_zigzag_attention",
    "zigzag_to_global",
]

# ----------------------------------------------------------------------------------------------- index maps


def _gathered_row(g: Tensor, cu: Tensor, cp: int, local_tokens: int) -> Tensor:
    """Row in the gathered ``[cp * t_local]`` tensor of each global padded position in ``g`` (int64)."""
    seq = torch.searchsorted(cu, g, right=True) - 1  # right=True skips empty sequences that start at g
    start = cu[seq]
    # only non-empty sequences own positions, so the chunk is never 0 here
    rank, row = zigzag_owner(g - start, chunk_size(cu[seq + 1] - start, cp), cp)
    return rank * local_tokens + start // cp + row


def _zigzag_global_index(cu_seqlens_padded: Tensor, cp_size: int, local_tokens: int) -> Tensor:
    """``[cp_size * local_tokens]`` int64: for each global padded THD position, its row in the gathered ranks'
    tensors flattened to ``[cp_size * local_tokens]`` (rank-major).  ``gathered.flatten(0, 1)[index]`` is the
    global order.  Pure index arithmetic on ``cu_seqlens_padded [n+1]``: no host sync.

    >>> _zigzag_global_index(torch.tensor([0, 8], dtype=torch.int32), 2, 4).tolist()
    [0, 1, 4, 5, 6, 7, 2, 3]
    """
    cp_size = check_positive_int("cp_size", cp_size)
    cu = _check_cu(cu_seqlens_padded)
    g = torch.arange(cp_size * local_tokens, device=cu.device)
    return _gathered_row(g, cu, cp_size, local_tokens)


def zigzag_to_global(gathered: Tensor, cu_seqlens_padded: Tensor) -> Tensor:
    """Reorder ``gathered: [cp, t_local, *]`` (every CP rank's zigzag shard, rank order) into the global padded
    THD order ``[cp * t_local, *]``: sequence after sequence, tokens in natural order.  An index gather (its
    backward is a scatter-add); no host sync.

    >>> shards = torch.tensor([[0, 1, 6, 7], [2, 3, 4, 5]])  # cp=2: rank r holds chunks r and 3-r
    >>> zigzag_to_global(shards, torch.tensor([0, 8], dtype=torch.int32)).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    check_tensor("gathered", gathered)
    if gathered.dim() < 2:
        raise ValueError(f"gathered must be [cp, t_local, *], got shape {tuple(gathered.shape)}")
    cp, local = gathered.shape[:2]
    index = _zigzag_global_index(cu_seqlens_padded, cp, local)
    return gathered.flatten(0, 1).index_select(0, index.to(gathered.device))


def global_to_zigzag(x: Tensor, cu_seqlens_padded: Tensor, cp_size: int) -> Tensor:
    """The inverse of :func:`zigzag_to_global`: ``x: [t, *]`` in the global padded THD order (``t =
    cu_seqlens_padded[-1]``, a multiple of ``cp_size``) -> ``[cp_size, t / cp_size, *]``, every CP rank's zigzag
    shard in rank order.  An index copy (its backward is a gather); no host sync.

    >>> shards = global_to_zigzag(torch.arange(8), torch.tensor([0, 8], dtype=torch.int32), 2)
    >>> shards.tolist(), zigzag_to_global(shards, torch.tensor([0, 8], dtype=torch.int32)).tolist()
    ([[0, 1, 6, 7], [2, 3, 4, 5]], [0, 1, 2, 3, 4, 5, 6, 7])
    """
    check_tensor("x", x)
    cp = check_positive_int("cp_size", cp_size)
    if x.dim() < 1 or x.shape[0] % cp:
        raise ValueError(f"x must be [t, *] with t a multiple of cp_size={cp} (the whole padded batch), got shape "
                         f"{tuple(x.shape)}")
    local = x.shape[0] // cp
    index = _zigzag_global_index(cu_seqlens_padded, cp, local).to(x.device)
    return x.new_zeros(x.shape).index_copy(0, index, x).view(cp, local, *x.shape[1:])


# ---------------------------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class ZigzagAttentionPlan:
    """The varlen problem one CP rank solves: one query "sequence" per local chunk (``2n`` of them).

    ``cu_seqlens_q [2n+1] int32``: local chunks in this rank's tensor; ``cu_seqlens_k [2n+1] int32``: their key
    prefixes, laid out one after another; ``key_rows [(2cp+1) * t_local / 2] int64``: for each prefix key, its
    row in the gathered K/V flattened to ``[cp * t_local]``; ``max_seqlen_q``, ``max_seqlen_k``: bounds.
    """

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    key_rows: Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def plan_zigzag_attention(
    cu_seqlens_padded: Tensor, max_seqlen: int, *, cp_size: int, cp_rank: int, local_tokens: int
) -> ZigzagAttentionPlan:
    """Index tensors for :func:`context_parallel_attention` on CP rank ``cp_rank`` (no host sync).

    Local chunk ``(i, j)`` (global chunk ``j`` of sequence ``i``, ``c_i`` tokens) attends to the key prefix of
    ``(j+1) * c_i`` tokens of sequence ``i``.  Example: one sequence of 8 tokens, cp=2, rank 0 holds chunks 0
    and 3 (2 tokens each), whose prefixes hold 2 and 8 keys:

    >>> plan = plan_zigzag_attention(torch.tensor([0, 8], dtype=torch.int32), 8, cp_size=2, cp_rank=0,
    ...                              local_tokens=4)
    >>> plan.cu_seqlens_q.tolist(), plan.cu_seqlens_k.tolist(), plan.max_seqlen_q, plan.max_seqlen_k
    ([0, 2, 4], [0, 2, 10], 2, 8)
    >>> plan.key_rows.tolist()  # rows of the gathered [rank0 | rank1] K: global order 0,1 then 0..7
    [0, 1, 0, 1, 4, 5, 6, 7, 2, 3]
    """
    cp = check_positive_int("cp_size", cp_size)
    rank = check_rank("cp_rank", cp_rank, cp, "cp_size")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0 or max_seqlen % (2 * cp):
        raise ValueError(
            f"max_seqlen must be an int multiple of 2*cp_size={2 * cp} (the longest padded sequence), "
            f"got {max_seqlen!r}; pass ThdInfo.max_seqlen"
        )
    if local_tokens % 2:
        raise ValueError(
            f"local_tokens={local_tokens} is odd, but each sequence gives every CP rank two equal chunks; "
            "pass the zigzag shard built with cu_seqlens_padded (e.g. packfwd.to_thd(..., cp_size=...))"
        )
    cu = _check_cu(cu_seqlens_padded)
    chunk = chunk_size(cu.diff(), cp)  # [n]
    held = [zigzag_position(u, 1, cp, rank) for u in (0, 1)]  # the two global chunks held here (chunk size 1)
    j = torch.tensor(held, device=cu.device)
    q_len = chunk.repeat_interleave(2)  # [2n]: (seq 0, first), (seq 0, second), (seq 1, first), ...
    k_len = ((j[None, :] + 1) * chunk[:, None]).reshape(-1)  # [2n]
    cu_q, cu_k = _cumsum0(q_len), _cumsum0(k_len)
    # Memory: the prefixes repeat keys (chunk r's prefix lies inside chunk 2cp-1-r's), (2cp+1)/2 * t_local rows
    # in all, next to the gathered cp * t_local: about twice the gathered K/V.  Simple and exact.
    kk = torch.arange((2 * cp + 1) * local_tokens // 2, device=cu.device)
    seg = torch.searchsorted(cu_k, kk, right=True) - 1
    global_pos = cu[seg // 2] + (kk - cu_k[seg])
    key_rows = _gathered_row(global_pos, cu, cp, local_tokens)
    max_q = chunk_size(max_seqlen, cp)
    return ZigzagAttentionPlan(cu_q.int(), cu_k.int(), key_rows, max_q, (max(held) + 1) * max_q)


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_padded: Tensor,
    max_seqlen: int,
    *,
    cp_size: int,
    cp_rank: int,
    cp_group: Any,
    attn_fn: Callable[..., Tensor],
    softmax_scale: float | None = None,
) -> Tensor:
    """Causal attention of this CP rank's queries over the whole of their sequences: ``[t_local, hq, d]``.

    ``q: [t_local, hq, d]``, ``k, v: [t_local, hkv, d]`` (``hq`` a multiple of ``hkv``; ``v``'s head dim may
    differ, as in multi-head latent attention: then the output's is ``v``'s) are this rank's zigzag shard;
    ``cu_seqlens_padded [n+1]`` int32 the global padded offsets (each length a multiple of
    ``2*cp_size``), ``max_seqlen`` the longest padded sequence.  K and V are all-gathered over ``cp_group`` (the
    backward returns their gradients to the owners) and each local chunk attends to its key prefix through one
    call ``attn_fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)``
    with flash-attn's varlen semantics (bottom-right causal).  ``softmax_scale=None`` means ``d ** -0.5``.
    With ``cp_size=1``, no communication happens and ``cp_group`` may be ``None``.

    >>> from packfwd.models.mixers.varlen import varlen_attention_reference
    >>> q = k = v = torch.eye(4).reshape(4, 1, 4)  # one sequence of 4 tokens, one head, d=4
    >>> cu = torch.tensor([0, 4], dtype=torch.int32)
    >>> out = context_parallel_attention(q, k, v, cu, 4, cp_size=1, cp_rank=0, cp_group=None,
    ...                                  attn_fn=varlen_attention_reference)
    >>> out.shape, out[0, 0].tolist()  # the first token only sees itself
    (torch.Size([4, 1, 4]), [1.0, 0.0, 0.0, 0.0])
    """
    _check_qkv(q, k, v)
    if not callable(attn_fn):
        raise TypeError("attn_fn must be a varlen attention callable (flash-attn's flash_attn_varlen_func signature)")
    cp = check_positive_int("cp_size", cp_size)
    rank = check_rank("cp_rank", cp_rank, cp, "cp_size")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    plan = plan_zigzag_attention(cu_seqlens_padded, max_seqlen, cp_size=cp, cp_rank=rank, local_tokens=q.shape[0])
    cu = _check_cu(cu_seqlens_padded)
    if cu.device != q.device:
        raise ValueError(f"cu_seqlens_padded is on {cu.device} but q is on {q.device}; move it to q's device")
    if cp == 1:  # the local shard is the whole padded batch
        cu32 = cu.int()
        return attn_fn(q, k, v, cu32, cu32, max_seqlen, max_seqlen, True, scale)
    _check_group(cp_group, cp, rank)
    # [cp, t_local, hkv, d + d_v]: one collective; each rank's loss differs, so the gradients are summed
    kv = all_gather_cp(torch.cat((k, v), dim=-1), cp_group, backward="sum")
    kv = kv.flatten(0, 1).index_select(0, plan.key_rows)  # [(2cp+1) t_local / 2, hkv, d + d_v]: the prefixes
    k_pre, v_pre = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
    return attn_fn(
        q, k_pre, v_pre, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k, True, scale
    )


# ------------------------------------------------------------------------------------------------ checks


def _cumsum0(x: Tensor) -> Tensor:
    return torch.cat([x.new_zeros(1), x.cumsum(0)])


def _check_cu(cu_seqlens_padded: Tensor) -> Tensor:
    cu = check_tensor("cu_seqlens_padded", cu_seqlens_padded)
    if cu.dim() != 1 or cu.numel() < 1 or cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens_padded must be a 1-D int32 tensor [n+1] of padded offsets starting at 0, got shape "
            f"{tuple(cu.shape)} dtype {cu.dtype}; pass ThdInfo.cu_seqlens_padded"
        )
    return cu.long()


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x)
        if x.dim() != 3:
            raise ValueError(f"{name} must be [t_local, heads, head_dim], got shape {tuple(x.shape)}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must share t_local and "
                         "heads (dims 0 and 1; v's head dim may differ, as in multi-head latent attention)")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must share t_local (dim 0) and head_dim (dim 2)"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"q has {q.shape[1]} heads and k has {k.shape[1]}; grouped-query attention needs hq to be a "
            "multiple of hkv"
        )


def _check_group(cp_group: Any, cp: int, rank: int) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"cp_size={cp} needs an initialised torch.distributed process group; pass cp_group")
    size, actual = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    if size != cp or actual != rank:
        raise ValueError(
            f"cp_group has size {size} and this process is its rank {actual}, but cp_size={cp}, cp_rank={rank}; "
            "pass the CP group's size and this process's rank in it"
        )
