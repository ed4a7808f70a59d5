"""Gated DeltaNet's two sequence operators over a THD-packed batch, exact in torch (the CPU path): the short causal
convolution and the chunked gated delta rule, each restarted at every sequence start.

A packed buffer ``[t, *]`` holds ``n`` sequences: sequence ``i`` has ``cu_seqlens[i+1] - cu_seqlens[i]`` real tokens
starting at row ``cu_seqlens_padded[i]`` (Megatron-Core's names; without padding both are the same tensor)::

    cu_seqlens        = [0, 3, 4]         two sequences of 3 and 1 real tokens
    cu_seqlens_padded = [0, 4, 8]         aligned to 4: rows 3, 5, 6, 7 are pads
    rows              =  a0 a1 a2 .  b0 .  .  .

A linear-attention layer carries a state along the sequence; packed, a state (or a convolution tap) that runs past
``a2`` into ``b0`` leaks one sequence into the next without any error.  Here every sequence starts from zero: the
convolution reads only taps at positions ``>= 0`` of the token's own sequence, and the delta rule runs on an
``[n, s, *]`` view built by one gather (each sequence from its own start, zero beyond its end; ``s`` is
``max_seqlen`` rounded up to the chunk size), batched over sequences as transformers' ``torch_chunk_gated_delta_rule``
runs over its batch, and is gathered back.  Pad rows are never read and come out zero.  No Python loop over
sequences and no host sync when ``max_seqlen`` is given (else one, to find it).

The arithmetic is transformers' torch fallback (``transformers.models.qwen3_next.modeling_qwen3_next``), computed in
the inputs' dtype promoted to at least float32 (transformers always uses float32; float64 stays float64 here, so
the CPU path is exact enough to test against).  On CUDA with flash-linear-attention installed both operators run
on its varlen kernels instead (:mod:`~packfwd.models.mixers.deltanet_cuda`: when, how, the backward and its cost;
``PACKFWD_DELTANET=torch`` keeps this path).  They take whole sequences only: under context parallelism the
module (:mod:`~packfwd.models.mixers.gdn`) first trades each CP rank's zigzag tokens for whole sequences of its
share of the heads.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._validate import check_positive_int, check_tensor
from ...layout.rules import round_up
from . import deltanet_cuda as _cuda

__all__ = ["causal_conv1d_packed", "chunk_gated_delta_rule_packed", "l2norm", "sequence_rows"]


def sequence_rows(cu_seqlens: Tensor, t: int, cu_seqlens_padded: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """For each row of a packed ``[t, *]`` buffer: its sequence ``[t]``, its position in that sequence ``[t]`` and
    whether it is a real token ``[t]`` (False at pads, and at rows past the last sequence).  On the device, no sync.

    >>> cu = torch.tensor([0, 3, 4]); cu_pad = torch.tensor([0, 4, 8])
    >>> [r.tolist() for r in sequence_rows(cu, 8, cu_pad)]
    [[0, 0, 0, 0, 1, 1, 1, 1], [0, 1, 2, 3, 0, 1, 2, 3], [True, True, True, False, True, False, False, False]]
    """
    starts, lengths = _starts_lengths(cu_seqlens, cu_seqlens_padded)
    row = torch.arange(t, device=cu_seqlens.device)
    bounds = (cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded).to(torch.long)
    seq = torch.searchsorted(bounds[1:], row, right=True).clamp_(max=max(starts.numel() - 1, 0))
    pos = row - starts[seq] if starts.numel() else row
    real = (pos < lengths[seq]) & (row < bounds[-1]) if starts.numel() else torch.zeros_like(row, dtype=torch.bool)
    return seq, pos, real


def causal_conv1d_packed(x: Tensor, weight: Tensor, bias: Tensor | None, cu_seqlens: Tensor, *,
                         cu_seqlens_padded: Tensor | None = None, activation: str | None = "silu") -> Tensor:
    """The short causal depthwise convolution of ``x: [t, c]`` (``weight: [c, w]``, ``bias: [c]`` or None), restarted
    at every sequence start: tap ``j`` of a token at position ``p`` reads position ``p - j`` of its own sequence, or
    zero when ``p - j < 0`` (what a per-sequence ``F.conv1d`` with ``w - 1`` zeros of left padding reads).  Then
    ``activation`` (``"silu"``, as transformers' ``hidden_act``, or None).  ``[t, c]`` in ``x``'s dtype; pads zero.

    >>> x = torch.ones(5, 1); w = torch.ones(1, 3)
    >>> causal_conv1d_packed(x, w, None, torch.tensor([0, 3, 5]), activation=None).view(-1).tolist()
    [1.0, 2.0, 3.0, 1.0, 2.0]
    """
    check_tensor("x", x), check_tensor("weight", weight)
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"x must be [t, c] and weight [c, w], got {tuple(x.shape)} and {tuple(weight.shape)}; "
                         "for an nn.Conv1d weight [c, 1, w] pass weight.squeeze(1)")
    if activation not in ("silu", "swish", None):
        raise ValueError(f"activation={activation!r} is not supported; pass 'silu' (transformers' hidden_act) or None")
    seq, pos, real = sequence_rows(cu_seqlens, x.shape[0], cu_seqlens_padded)
    if _cuda.fla_takes(x, weight, bias, op="conv") and x.shape[0] and cu_seqlens.numel() > 1:
        starts, lengths = _starts_lengths(cu_seqlens, cu_seqlens_padded)
        layout = _cuda.chunk_layout(starts, lengths, pos, seq, real, _cuda.CONV_CHUNK)
        return _cuda.conv1d_fla(x, weight, bias, layout, activation)
    dtype = torch.promote_types(x.dtype, weight.dtype)
    xs = x.to(dtype)
    w = weight.shape[1]
    out = xs * weight[:, w - 1].to(dtype)  # tap 0: the token itself
    for j in range(1, w):  # the kernel's width, not the sequences: a shift down by j rows, zero before the start
        shifted = F.pad(xs[: max(xs.shape[0] - j, 0)], (0, 0, min(j, xs.shape[0]), 0))
        out = out + torch.where((pos >= j)[:, None], shifted, 0) * weight[:, w - 1 - j].to(dtype)
    if bias is not None:
        out = out + bias.to(dtype)
    if activation is not None:
        out = F.silu(out)
    return torch.where(real[:, None], out, 0).to(x.dtype)


def l2norm(x: Tensor, dim: int = -1, eps: float = 1e-6) -> Tensor:
    """``x * rsqrt(sum(x^2) + eps)``: transformers' (and fla's) L2 normalisation of queries and keys.

    >>> l2norm(torch.tensor([3.0, 4.0]), eps=0.0).tolist()
    [0.6000000238418579, 0.800000011920929]
    """
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def chunk_gated_delta_rule_packed(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                                  chunk_size: int = 64, *, cu_seqlens_padded: Tensor | None = None,
                                  max_seqlen: int | None = None, scale: float | None = None,
                                  use_qk_l2norm_in_kernel: bool = False) -> Tensor:
    """The gated delta rule over packed sequences, each from a zero state: ``q, k: [t, hk, dk]``, ``v: [t, hv, dv]``,
    ``g`` (log decay, <= 0) and ``beta: [t, hv]``; ``hv`` a multiple of ``hk`` (each query/key head serves
    ``hv // hk`` consecutive value heads).  Per token, with ``S`` the ``[dk, dv]`` state of a head::

        S = exp(g) S;   S = S + beta k (v - k^T S)^T;   o = S^T (scale q)

    ``g`` may also be per key channel, ``[t, hv, dk]`` (Kimi Delta Attention): ``S = diag(exp(g)) S``, each row of
    the state decaying by its own channel's gate; the same chunked scan, its decay factors per channel (the CUDA
    path takes only the per-head ``g``; a per-channel one runs in torch).

    computed ``chunk_size`` tokens at a time.  ``scale`` defaults to ``dk ** -0.5``; ``use_qk_l2norm_in_kernel``
    L2-normalises q and k first (transformers' name; its layers pass True).  ``max_seqlen``: the longest sequence, a
    host int (an upper bound works; None costs one host sync).  Returns ``[t, hv, dv]`` in ``v``'s dtype, pads zero.

    >>> _ = torch.manual_seed(0); t, cu = 5, torch.tensor([0, 2, 5])
    >>> q, k, v, g, beta = torch.randn(t, 1, 4), torch.randn(t, 1, 4), torch.randn(t, 1, 2), -torch.rand(t, 1), torch.rand(t, 1)
    >>> o = chunk_gated_delta_rule_packed(q, k, v, g, beta, cu, chunk_size=2)
    >>> alone = chunk_gated_delta_rule_packed(q[2:], k[2:], v[2:], g[2:], beta[2:], torch.tensor([0, 3]), chunk_size=2)
    >>> o.shape, torch.allclose(o[2:], alone)  # the second sequence does not see the first
    (torch.Size([5, 1, 2]), True)
    """
    for name, x, dims in (("q", q, (3,)), ("k", k, (3,)), ("v", v, (3,)), ("g", g, (2, 3)), ("beta", beta, (2,))):
        if check_tensor(name, x).dim() not in dims or x.shape[0] != v.shape[0]:
            raise ValueError(f"{name} must be {' or '.join(map(str, dims))}-D with the tokens first ([t, ...]), "
                             f"got {tuple(x.shape)}")
    hk, hv = k.shape[1], v.shape[1]
    per_channel = g.dim() == 3
    g_shape = (*v.shape[:2], k.shape[2]) if per_channel else v.shape[:2]
    if q.shape != k.shape or hv % hk or g.shape != g_shape or beta.shape != v.shape[:2]:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)} [t, hk, dk]; v {tuple(v.shape)} "
                         f"[t, hv, dv] with hv a multiple of hk; g {tuple(g.shape)} [t, hv] (or [t, hv, dk]: per key "
                         f"channel) and beta {tuple(beta.shape)} [t, hv]")
    check_positive_int("chunk_size", chunk_size, "pass e.g. chunk_size=64")
    starts, lengths = _starts_lengths(cu_seqlens, cu_seqlens_padded)
    args = (cu_seqlens, cu_seqlens_padded, starts, lengths, chunk_size, max_seqlen, scale, use_qk_l2norm_in_kernel)
    if not per_channel and _cuda.fla_takes(q, k, v, g, beta, chunk_size=chunk_size) and v.shape[0] and lengths.numel():
        seq, pos, real = sequence_rows(cu_seqlens, v.shape[0], cu_seqlens_padded)
        layout = _cuda.chunk_layout(starts, lengths, pos, seq, real, chunk_size)
        return _cuda.delta_rule_fla(q, k, v, g, beta, layout, chunk_size,
                                    k.shape[-1] ** -0.5 if scale is None else scale, use_qk_l2norm_in_kernel,
                                    functools.partial(_delta_rule_torch, args=args))
    return _delta_rule_torch(q, k, v, g, beta, args=args)


def _delta_rule_torch(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, args: tuple) -> Tensor:
    """The torch path of :func:`chunk_gated_delta_rule_packed` (``args``: its validated arguments, in order)."""
    cu_seqlens, cu_seqlens_padded, starts, lengths, chunk_size, max_seqlen, scale, use_qk_l2norm_in_kernel = args
    hk, hv = k.shape[1], v.shape[1]
    if max_seqlen is None:
        max_seqlen = int(lengths.max()) if lengths.numel() else 0  # the one host sync; pass max_seqlen to avoid it
    s = max(round_up(max_seqlen, chunk_size), chunk_size)
    t = v.shape[0]
    if lengths.numel() == 0 or t == 0:
        return v.new_zeros(v.shape)
    cdt = torch.promote_types(v.dtype, torch.float32)
    offset = torch.arange(s, device=v.device)
    valid = offset < lengths[:, None]  # [n, s]
    index = (starts[:, None] + offset).clamp_(max=t - 1)  # [n, s]

    def padded(x: Tensor) -> Tensor:  # [t, *] -> [n, s, *], zero beyond each sequence's end
        x = x.to(cdt)[index]
        return torch.where(valid.view(*valid.shape, *([1] * (x.dim() - 2))), x, 0)

    qs, ks = padded(q), padded(k)
    if hv != hk:
        qs, ks = qs.repeat_interleave(hv // hk, dim=2), ks.repeat_interleave(hv // hk, dim=2)
    if use_qk_l2norm_in_kernel:
        qs, ks = l2norm(qs), l2norm(ks)
    qs = qs * (qs.shape[-1] ** -0.5 if scale is None else scale)
    gs = padded(g)  # [n, s, hv] or, per key channel, [n, s, hv, dk]
    o = _chunk_scan(qs, ks, padded(v), gs if gs.dim() == 4 else gs[..., None], padded(beta), chunk_size)
    seq, pos, real = sequence_rows(cu_seqlens, t, cu_seqlens_padded)
    out = o[seq, pos.clamp(max=s - 1)]  # gathered back: the backward is a scatter of rows that never collide
    return torch.where(real[:, None, None], out, 0).to(v.dtype)


def _chunk_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk: int) -> Tensor:
    """transformers' chunked scan, batched over sequences: ``q, k: [n, s, h, dk]``, ``v: [n, s, h, dv]``,
    ``g: [n, s, h, 1]`` (one decay per head: Gated DeltaNet) or ``[n, s, h, dk]`` (per key channel: Kimi Delta
    Attention), ``beta: [n, s, h]``, with ``s`` a multiple of ``chunk``; the state of every sequence starts at zero."""
    n, s, h, dk = k.shape
    dv = v.shape[-1]
    # [n, h, chunks, chunk, *]
    q, k, v, g = (x.transpose(1, 2).reshape(n, h, s // chunk, chunk, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.transpose(1, 2).reshape(n, h, s // chunk, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-2)  # log decay from the chunk's start to each position (per head, or per key channel)
    system = _decayed_scores(k_beta, k, cum)  # unit lower-triangular once the diagonal is added (UT transform)
    intra = _decayed_scores(q, k, cum)
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp(), upper=False, unitriangular=True)
    q = q * cum.exp()
    k = k * (cum[..., -1:, :] - cum).exp()
    chunk_decay = cum[..., -1, :].exp()[..., None]  # [n, h, chunks, 1 or dk, 1]: the state's rows
    state = q.new_zeros(n, h, dk, dv)
    outs = []
    # the chunks of the longest sequence, every sequence at once; unbound once, not indexed per step (the backward
    # of an index writes a whole zero tensor per step: quadratic in the chunks)
    for new_v_i, k_cum_i, q_i, intra_i, decay_i, k_i in zip(*(x.unbind(2) for x in (new_v, k_cum, q, intra,
                                                                                    chunk_decay, k))):
        v_new = new_v_i - k_cum_i @ state
        outs.append(q_i @ state + intra_i @ v_new)
        state = state * decay_i + k_i.transpose(-1, -2) @ v_new
    return torch.stack(outs, 2).reshape(n, h, s, dv).transpose(1, 2)


def _decayed_scores(a: Tensor, b: Tensor, cum: Tensor) -> Tensor:
    """``[.., i, j] = sum_d a[i, d] b[j, d] exp(cum[i, d] - cum[j, d])`` for ``j <= i``, zero above the diagonal:
    ``a, b: [.., c, dk]``, ``cum: [.., c, 1]`` (one decay per head: a scaled matrix product) or ``[.., c, dk]`` (per
    key channel: the decay of every channel, ``[.., c, c, dk]``, as transformers forms it; no ``exp(-cum)``, which
    would overflow).  The exponent is masked to ``-inf`` above the diagonal before ``exp``."""
    c = a.shape[-2]
    upper = torch.ones(c, c, dtype=torch.bool, device=a.device).triu(1)
    if cum.shape[-1] == 1:
        decay = (cum[..., :, None, 0] - cum[..., None, :, 0]).masked_fill(upper, float("-inf")).exp()  # [.., i, j]
        return (a @ b.transpose(-1, -2)) * decay
    decay = (cum[..., :, None, :] - cum[..., None, :, :]).masked_fill(upper[..., None], float("-inf")).exp()
    return (a[..., :, None, :] * b[..., None, :, :] * decay).sum(-1)


def _starts_lengths(cu_seqlens: Tensor, cu_seqlens_padded: Tensor | None) -> tuple[Tensor, Tensor]:
    """``[n]`` int64 first rows and real lengths of the sequences."""
    check_tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D [n+1] (0 first), got shape {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.to(torch.long)
    bounds = cu if cu_seqlens_padded is None else check_tensor("cu_seqlens_padded", cu_seqlens_padded).to(torch.long)
    if bounds.shape != cu.shape:
        raise ValueError(f"cu_seqlens_padded has shape {tuple(bounds.shape)} but cu_seqlens {tuple(cu.shape)}; "
                         "pass both for the same n sequences (ThdInfo.cu_seqlens and .cu_seqlens_padded)")
    return bounds[:-1], cu[1:] - cu[:-1]
