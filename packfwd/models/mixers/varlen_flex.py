"""The ``"flex"`` varlen backend: packed attention through PyTorch's ``flex_attention`` (compiled to Triton on CUDA),
the one CUDA path of packfwd's that honours a sliding window and sinks (GPT-OSS; :mod:`packfwd.models.mixers.varlen`).

The packed tokens are one batch row of ``t`` tokens; a block mask keeps each query to the keys of its own sequence,
causal and within the window, aligned bottom-right as flash-attn aligns unequal query and key lengths::

    doc(i), doc(j)     the sequence of query i and key j (cu_seqlens, searched on the device: no host sync)
    p(i) = i - cu_q[doc] + len_k[doc] - len_q[doc]      the query's own position among its sequence's keys
    p(j) = j - cu_k[doc]
    kept:  doc(i) == doc(j)  and  p(j) <= p(i)  (causal)  and  p(i) - p(j) <= window

The sinks come after the kernel, from its log-sum-exp ``lse`` (differentiable: ``flex_attention`` takes its
gradient): a sink ``s`` adds ``exp(s)`` to the denominator, so the output is the kernel's times
``exp(lse) / (exp(lse) + exp(s)) = sigmoid(lse - s)``; a query with no key in reach (``lse = -inf``) gets zeros.
The block mask is built per call (``create_block_mask`` over ``(t / 128)**2`` blocks, on the device).
``flex_attention`` is compiled once (``torch.compile``, dynamic shapes) where it runs on CUDA; elsewhere it runs
eagerly (torch's math path: for tests).  No Megatron-Core.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["flex_available", "flex_varlen_attention"]


@functools.lru_cache(maxsize=None)
def _flex():
    try:
        from torch.nn.attention import flex_attention as flex
    except ImportError:  # torch < 2.5
        return None
    if not hasattr(flex, "AuxRequest"):  # torch < 2.9: no differentiable log-sum-exp request
        return None
    return flex


@functools.lru_cache(maxsize=None)
def _compiled():
    return torch.compile(_flex().flex_attention, dynamic=True)


def flex_available() -> bool:
    """Whether this torch has ``flex_attention`` with a differentiable log-sum-exp (torch >= 2.9).

    >>> isinstance(flex_available(), bool)
    True
    """
    return _flex() is not None


def flex_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                          causal: bool = True, softmax_scale: float | None = None, *, window: int | None = None,
                          sinks: Tensor | None = None) -> Tensor:
    """:func:`packfwd.models.mixers.varlen.varlen_attention`'s semantics (``q [t_q, h, d]``, ``k, v [t_k, h_kv, d]``
    -> ``[t_q, h, d_v]``; the window and sinks of the module docstring) through ``flex_attention``; the caller
    checks the inputs.  Tokens past ``cu_seqlens_q[-1]`` get zeros.

    >>> q = torch.randn(5, 2, 16); cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    >>> out = flex_varlen_attention(q, q, q, cu, cu, window=1, sinks=torch.zeros(2))
    >>> out.shape
    torch.Size([5, 2, 16])
    """
    flex = _flex()
    t_q = q.shape[0]
    # whole 128-token blocks, at least one (below 128 queries inductor picks a decoding kernel that has no valid
    # configuration under dynamic shapes: seen on an H100, torch 2.11); the pad rows are in no sequence
    q, k, v = (_whole_blocks(x) for x in (q, k, v))
    t_pad, h, d = q.shape
    cu_q, cu_k = cu_seqlens_q.to(q.device, torch.long), cu_seqlens_k.to(q.device, torch.long)
    n = cu_q.numel() - 1
    doc_q = torch.searchsorted(cu_q[1:], torch.arange(t_pad, device=q.device), right=True)  # n past the end
    doc_k = torch.searchsorted(cu_k[1:], torch.arange(k.shape[0], device=q.device), right=True)
    shift = torch.cat([cu_k.diff() - cu_q.diff() - cu_q[:-1], cu_q.new_zeros(1)])  # [n + 1]: past the end, 0
    pos_q = torch.arange(t_pad, device=q.device) + shift[doc_q]  # own position among the sequence's keys
    pos_k = torch.arange(k.shape[0], device=q.device) - cu_k[torch.clamp(doc_k, max=n)]

    doc_q = torch.where(doc_q < n, doc_q, -1)  # past the end: no sequence (a tensor, not n: one compiled graph)
    doc_k = torch.where(doc_k < n, doc_k, -2)  # keys past the end: none, and never a query's -1
    reach = torch.full((1,), t_pad + k.shape[0] if window is None else window, device=q.device, dtype=torch.long)

    def keep(b, head, i, j):
        kept = doc_q[i] == doc_k[j]
        if causal:
            kept = kept & (pos_k[j] <= pos_q[i])
        return kept & (pos_q[i] - pos_k[j] <= reach[0])

    # compiled on CUDA: the mask is never laid out as [t_q, t_k] (only its (t / 128)**2 blocks)
    mask = flex.create_block_mask(keep, None, None, t_pad, k.shape[0], device=q.device, _compile=q.is_cuda)
    attend = _compiled() if q.is_cuda else flex.flex_attention
    out, aux = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=mask,
                      scale=d**-0.5 if softmax_scale is None else softmax_scale, enable_gqa=h != k.shape[1],
                      return_aux=flex.AuxRequest(lse=True))
    out, lse = out[0].transpose(0, 1)[:t_q], aux.lse[0].transpose(0, 1)[:t_q]  # [t_q, h, d_v], [t_q, h]
    if sinks is not None:  # one rounding: the product in at least float32
        work = torch.promote_types(out.dtype, torch.float32)
        out = (out.to(work) * torch.sigmoid(lse.to(work) - sinks.to(work))[..., None]).to(q.dtype)
    return torch.where(torch.isfinite(lse)[..., None], out, torch.zeros_like(out))  # no key: zeros


def _whole_blocks(x: Tensor) -> Tensor:
    """``x [t, ...]`` with zero rows after it up to a whole number of 128-token blocks, at least one (no copy when
    it has them)."""
    extra = max(128, -(-x.shape[0] // 128) * 128) - x.shape[0]
    return x if extra == 0 else torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, extra))

