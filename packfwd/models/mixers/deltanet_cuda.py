"""Gated DeltaNet's two sequence operators on CUDA: flash-linear-attention's (fla's) varlen Triton kernels for the
forward, and for the delta rule a backward of packfwd's own.

:mod:`~packfwd.models.mixers.deltanet_ops` calls this module when :func:`fla_takes` says so: CUDA tensors,
bfloat16 inputs (the dtype it has run in on a GPU), fla importable (an optional dependency, imported on first use), and the switch
``PACKFWD_DELTANET=torch`` not set (it forces the torch path; ``recompute`` keeps fla's forward with the torch path
recomputed as the delta rule's backward).  Anything else takes the torch path, which is exact.

The layout fla runs on.  fla's varlen kernels split each sequence into chunks and find them through a chunk index
it builds from ``cu_seqlens`` on the host (a host sync per call).  Here every sequence is instead gathered to a
chunk-aligned buffer of ``nt = t // chunk + n + 1`` whole chunks, a number known on the host::

    cu_seqlens = [0, 3, 4], chunk 2      a0 a1 a2 | b0          packed, t = 4
    aligned, nt = 4 chunks               a0 a1 | a2 .  | b0 .  | .  .     fla's cu_seqlens [0, 4, 6, 8]

(``.``: a zero row; the last boundary closes a tail sequence of zero rows that takes the unused chunks).  Sequence
``i`` starts at chunk ``sum(ceil(len_j / chunk), j < i)``, so its chunk index is built on the device and no call
syncs.  A sequence keeps its chunks as fla would cut them packed, so each sequence's bits are those of running it
alone; pad rows (``cu_seqlens_padded``) are never read, and come out zero as on the torch path.

The delta rule's backward.  fla's own backward refuses on Hopper with Triton < 3.7.1 (its ``chunk_bwd_dqkwg``
kernel is miscompiled there).  :class:`_KernelRule` runs fla 0.6's other backward kernels (the recomputed states,
the state gradients, the WY representation's backward) and, in place of the refused one, packfwd's
:func:`chunk_local_grads`: the same chunk-local gradients in torch, float32, every chunk at once (tested against
autograd of one chunk in float64, and on the GPU against the torch path: within bf16 rounding).  fla's internal
kernels are used only with fla 0.6.x; another version, or ``PACKFWD_DELTANET=recompute``, takes :class:`_DeltaRule`,
which keeps the inputs and runs the torch path again under autograd in the backward (its gradients are the torch
path's bits; without ``max_seqlen`` it makes the torch path's one host sync).  Cost on one H100 at a Qwen3.5 layer's
shapes (16 + 32 heads of 128, 16,384 tokens in sequences of 64 to 4,096; ``benchmarks/bench_deltanet.py``,
benchmarks/RESULTS.md history 20): forward 2.5 ms (fla's own 1.4, the rest the layout's gathers and host time),
forward + backward 14.8 ms against the torch path's 92 ms and the recompute's 95 ms.  The convolution's backward is
fla's (a Triton kernel that holds on Hopper; tested against the torch path): forward + backward 3.7 ms against the
torch path's 11.9.

fla is wrapped in ``torch.compiler.disable``: a compiled forward breaks its graph around it (``fullgraph=True``
needs the torch path).  fla's intra-card context parallelism (``FLA_INTRACARD_CP``, inference mode only) splits
long sequences on its own and must stay off for batch invariance.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch
from torch import Tensor

from ...ops.gather import gather_rows

__all__ = ["CONV_CHUNK", "ChunkLayout", "SWITCH", "chunk_layout", "chunk_local_grads", "conv1d_fla", "delta_rule_fla",
           "fla_takes"]

SWITCH = "PACKFWD_DELTANET"  # environment variable: "torch" forces the torch path; "recompute" the torch backward
# bfloat16 only: the dtype this path ran in on a GPU (float32 would round to tf32 in fla's dots; float16 has not run)
_DTYPES = (torch.bfloat16,)
_FLA_CHUNKS = (64,)  # fla takes 16 and 32 too; 64 (every layer's) is the one tested on the GPU
CONV_CHUNK = 64  # the chunk of the layout fla's convolution runs on (its rows per program)
_MAX_HEAD_DIM = 256  # fla's state kernels tile the key dimension in up to four blocks of 64


@functools.lru_cache(maxsize=None)
def _fla():
    """fla's ``(chunk_gated_delta_rule, causal_conv1d)``, or None when absent."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:  # not installed, or without Triton
        return None
    return chunk_gated_delta_rule, causal_conv1d


def fla_takes(*tensors: Tensor | None, op: str = "rule", chunk_size: int = 64) -> bool:
    """Whether the ``op`` (``"rule"`` or ``"conv"``) over ``tensors`` runs on fla: all on CUDA; the
    rule's q, k, v (the convolution's x, weight and bias) all bfloat16, the dtype this path has run in on a GPU
    (float32 and float16 take the torch path); the rule's head dims up to 256 and ``chunk_size`` 64; fla
    importable, and ``PACKFWD_DELTANET`` not ``torch``.

    >>> fla_takes(torch.zeros(2, 1, 4), op="conv")  # a CPU tensor: the torch path
    False
    """
    present = [x for x in tensors if x is not None]
    if os.environ.get(SWITCH, "").lower() == "torch" or not all(x.is_cuda and x.is_floating_point() for x in present):
        return False
    if op == "rule":  # the decay and beta may be wider (the layer computes the decay in float32)
        q, k, v = present[:3]
        if not (q.dtype == k.dtype == v.dtype and q.dtype in _DTYPES and chunk_size in _FLA_CHUNKS
                and k.shape[-1] <= _MAX_HEAD_DIM and v.shape[-1] <= _MAX_HEAD_DIM):
            return False
    elif len({x.dtype for x in present}) != 1 or present[0].dtype not in _DTYPES:
        return False
    return _fla() is not None


@dataclass(frozen=True)
class ChunkLayout:
    """Where the rows of a packed ``[t, *]`` buffer go in the chunk-aligned buffer of ``nt * chunk`` rows fla runs
    on (see the module docstring), all on the device.

    ``index: [nt * chunk]``: the packed row each aligned row reads, -1 for a zero row; ``inverse: [t]``: the
    aligned row of each packed row, -1 for a pad (which comes out zero); both int64, each the other's inverse (the
    gathers of :mod:`packfwd.ops.gather`).  ``cu_seqlens: [n + 2]`` int32 and ``chunk_indices: [nt, 2]``: fla's
    description of the aligned buffer."""

    index: Tensor
    inverse: Tensor
    cu_seqlens: Tensor
    chunk_indices: Tensor

    def gather(self, x: Tensor) -> Tensor:
        """``x: [t, *]`` -> ``[1, nt * chunk, *]``, zero rows where nothing is read."""
        return gather_rows([x], self.index, self.inverse).unsqueeze(0)

    def scatter(self, y: Tensor) -> Tensor:
        """``y: [1, nt * chunk, *]`` -> ``[t, *]``, pad rows zero."""
        return gather_rows([y[0]], self.inverse, self.index)


def chunk_layout(starts: Tensor, lengths: Tensor, pos: Tensor, seq: Tensor, real: Tensor, chunk: int) -> ChunkLayout:
    """The :class:`ChunkLayout` of ``n`` sequences (``starts, lengths: [n]`` int64, their first packed rows and real
    lengths) for a packed buffer whose rows have sequence ``seq``, position ``pos`` and realness ``real`` (``[t]``,
    from :func:`~packfwd.models.mixers.deltanet_ops.sequence_rows`).  Device ops only: no host sync."""
    t, n = pos.shape[0], starts.shape[0]
    nt = t // chunk + n + 1  # >= sum(ceil(len / chunk)) + 1: a tail of at least one chunk takes the rest
    chunks = (lengths + chunk - 1) // chunk
    first = torch.nn.functional.pad(chunks.cumsum(0), (1, 0))  # [n + 1]: each sequence's first chunk; the tail's
    row = torch.arange(nt * chunk, device=pos.device)
    owner = torch.searchsorted(first, row // chunk, right=True) - 1  # in [0, n]; n: the tail
    offset = row - first[owner] * chunk
    owner_seq = owner.clamp(max=max(n - 1, 0))
    filled = (owner < n) & (offset < lengths[owner_seq])
    index = torch.where(filled, starts[owner_seq] + offset, -1)
    inverse = torch.where(real, first[seq] * chunk + pos, -1)
    cu = torch.cat((first * chunk, first.new_full((1,), nt * chunk))).to(torch.int32)
    block = owner[::chunk]  # fla's chunk index: (sequence, chunk within it) of every chunk, the tail's included
    chunk_indices = torch.stack((block, torch.arange(nt, device=pos.device) - first[block]), 1).to(torch.int32)
    return ChunkLayout(index, inverse, cu, chunk_indices)


def conv1d_fla(x: Tensor, weight: Tensor, bias: Tensor | None, layout: ChunkLayout, activation: str | None) -> Tensor:
    """The causal convolution of packed ``x: [t, c]`` (``weight: [c, w]``) by fla's varlen kernel over ``layout``
    (chunk 64), forward and backward through fla: ``[t, c]``, pad rows zero."""
    causal_conv1d = _fla()[1]
    y, _ = causal_conv1d(layout.gather(x), weight, bias, activation=activation, cu_seqlens=layout.cu_seqlens,
                         chunk_indices=layout.chunk_indices)
    return layout.scatter(y)


def delta_rule_fla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, layout: ChunkLayout, chunk: int,
                   scale: float, l2norm: bool, reference: Callable[..., Tensor]) -> Tensor:
    """The gated delta rule of packed ``q, k: [t, hk, dk]``, ``v: [t, hv, dv]``, ``g, beta: [t, hv]`` by fla's
    varlen forward over ``layout``.  The backward: fla's kernels with packfwd's :func:`chunk_local_grads` in place
    of the one fla refuses on Hopper (fla 0.6, whose internal kernels it calls), else autograd of
    ``reference(q, k, v, g, beta)`` (the torch path, same arguments, same result within rounding) recomputed.
    ``[t, hv, dv]`` in ``v``'s dtype, pad rows zero."""
    kernels = _fla_kernels()
    if kernels is not None and os.environ.get(SWITCH, "").lower() != "recompute":
        return _KernelRule.apply(q, k, v, g, beta, layout, chunk, scale, l2norm)
    chunk_rule = _fla()[0]

    def run(q, k, v, g, beta):
        o, _ = chunk_rule(layout.gather(q), layout.gather(k), layout.gather(v), layout.gather(g),
                          layout.gather(beta), scale=scale, use_qk_l2norm_in_kernel=l2norm,
                          cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices, chunk_size=chunk)
        return layout.scatter(o).to(v.dtype)

    return _DeltaRule.apply(q, k, v, g, beta, run, reference)


class _DeltaRule(torch.autograd.Function):
    """``run(q, k, v, g, beta)`` forward (fla's kernels, or in the CPU tests the torch path itself); the backward
    recomputes ``reference`` (the torch path) under autograd from the saved inputs and returns its gradients."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, run, reference):
        ctx.save_for_backward(q, k, v, g, beta)
        ctx.reference = reference
        return run(q, k, v, g, beta)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        inputs = [x.detach().requires_grad_(need) for x, need in zip(ctx.saved_tensors, ctx.needs_input_grad)]
        wanted = [x for x in inputs if x.requires_grad]
        with torch.enable_grad():
            out = ctx.reference(*inputs)
            grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return (*(next(grads) if x.requires_grad else None for x in inputs), None, None)


@functools.lru_cache(maxsize=None)
def _fla_kernels():
    """fla 0.6's internal forward and backward steps of the gated delta rule, or None (another version: their
    names and layouts are fla's own business, so only the version tested here uses them)."""
    try:
        import fla
        from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_bwd_dv_local
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
        from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd, recompute_w_u_fwd
        from fla.ops.utils import chunk_local_cumsum
    except ImportError:
        return None
    if not fla.__version__.startswith("0.6."):
        return None
    return SimpleNamespace(l2norm_fwd=l2norm_fwd, l2norm_bwd=l2norm_bwd, fwd=chunk_gated_delta_rule_fwd,
                           fwd_h=chunk_gated_delta_rule_fwd_h, bwd_dhu=chunk_gated_delta_rule_bwd_dhu,
                           dv_local=chunk_bwd_dv_local, w_u=recompute_w_u_fwd, wy_bwd=prepare_wy_repr_bwd,
                           cumsum=chunk_local_cumsum)


class _KernelRule(torch.autograd.Function):
    """fla's forward steps on the aligned layout, saving what its backward steps read; the backward runs fla's
    steps with :func:`chunk_local_grads` for the chunk-local gradients of q, k, w and the decay."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, layout, chunk, scale, l2norm):
        fk = _fla_kernels()
        qa, ka, va, ga, ba = (layout.gather(x) for x in (q, k, v, g, beta))
        q_rstd = k_rstd = None
        if l2norm:
            (qa, q_rstd), (ka, k_rstd) = fk.l2norm_fwd(qa), fk.l2norm_fwd(ka)
        where = dict(cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices)
        g_cum, o, a, *_ = fk.fwd(q=qa, k=ka, v=va, g=ga, beta=ba, scale=scale, initial_state=None,
                                 output_final_state=False, chunk_size=chunk, **where)
        ctx.save_for_backward(qa, ka, va, g_cum, ba, a, q_rstd, k_rstd)
        ctx.layout, ctx.chunk, ctx.scale, ctx.dtypes = layout, chunk, scale, [x.dtype for x in (q, k, v, g, beta)]
        return layout.scatter(o).to(v.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        fk, layout, chunk, scale = _fla_kernels(), ctx.layout, ctx.chunk, ctx.scale
        qa, ka, va, g_cum, ba, a, q_rstd, k_rstd = ctx.saved_tensors
        do = layout.gather(grad.to(va.dtype))
        where = dict(cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices)
        w, u = fk.w_u(k=ka, v=va, beta=ba, A=a, g=g_cum, **where)
        h, v_new, _ = fk.fwd_h(k=ka, w=w, u=u, g=g_cum, initial_state=None, output_final_state=False,
                               chunk_size=chunk, **where)
        dv = fk.dv_local(q=qa, k=ka, g=g_cum, do=do, scale=scale, chunk_size=chunk, **where)
        dh, _, dv = fk.bwd_dhu(q=qa, k=ka, w=w, g=g_cum, h0=None, dht=None, do=do, dv=dv, scale=scale,
                               chunk_size=chunk, **where)
        dq, dk, dw, dg = chunk_local_grads(qa, ka, v_new, w, g_cum, h, dh, do, dv, scale, chunk)
        dk2, dv, db, dg2 = fk.wy_bwd(k=ka, v=va, beta=ba, A=a, dw=dw, du=dv, g=g_cum, **where)
        dg = fk.cumsum(dg + dg2, chunk_size=chunk, reverse=True, **where)
        dk = dk + dk2
        if q_rstd is not None:
            dq, dk = fk.l2norm_bwd(qa, q_rstd, dq), fk.l2norm_bwd(ka, k_rstd, dk)
        grads = (layout.scatter(x).to(dtype) for x, dtype in zip((dq, dk, dv, dg, db), ctx.dtypes))
        return (*grads, None, None, None, None)


def chunk_local_grads(q: Tensor, k: Tensor, v_new: Tensor, w: Tensor, g: Tensor, h: Tensor, dh: Tensor, do: Tensor,
                      dv: Tensor, scale: float, chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The chunk-local gradients of the chunked gated delta rule, every chunk at once, in float32 or wider (what fla's
    ``chunk_bwd_dqkwg`` kernel computes, which Triton < 3.7.1 miscompiles on Hopper).

    On ``[1, nt * chunk, heads, *]`` buffers of whole chunks: ``q, k`` (after the L2 norm) ``[.., hk, dk]``;
    ``v_new`` (the values less the state's prediction, ``u - w S``), ``do`` and ``dv`` (the gradient of
    ``v_new``) ``[.., hv, dv]``; ``w: [.., hv, dk]``; ``g: [1, nt * chunk, hv]``, the log2 decay from each chunk's
    start (fla's chunk-local cumsum scaled by 1 / ln 2); ``h, dh: [1, nt, hv, dk, dv]``: each chunk's state at its
    start and the gradient of its state at its end.  Per chunk, with ``c = g ln 2``, ``C = c[-1]`` and
    ``D[i, j] = exp(c_i - c_j)`` for ``i >= j`` (else 0), the chunk computes::

        o = scale (exp(c) * q) S + scale ((q k^T) * D) v_new,      S' = exp(C) S + (exp(C - c) * k)^T v_new

    and this returns ``dq, dk: [1, t, hk, dk]`` (summed over each key head's value heads), ``dw = -dv S^T`` and the
    gradient of ``c`` (before its reverse cumsum over the chunk), ``[1, t, hv]`` in float32 or wider."""
    _, t, hk, dk = q.shape
    hv, nt = v_new.shape[2], t // chunk
    r = hv // hk
    cdt = torch.promote_types(q.dtype, torch.float32)

    def blocks(x: Tensor) -> Tensor:  # [1, t, heads, d] -> [nt, heads, chunk, d], at least float32, in one pass
        x = x.reshape(nt, chunk, x.shape[2], x.shape[3]).transpose(1, 2)
        return torch.empty(x.shape, dtype=cdt, device=x.device).copy_(x)

    qb, kb = blocks(q)[:, :, None], blocks(k)[:, :, None]  # [nt, hk, 1, chunk, dk]: each key head's r value heads
    vb, dob, dvb = (blocks(x).view(nt, hk, r, chunk, -1) for x in (v_new, do, dv))
    gb = g.reshape(nt, chunk, hv).transpose(1, 2).to(cdt).view(nt, hk, r, chunk)
    hb, dhb = (x.reshape(nt, hk, r, dk, -1).to(cdt) for x in (h, dh))
    last = gb[..., -1:]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # ds[i, j] = scale D[i, j] do_i . v_new_j per value head, and p = ds * (q_i . k_j): the ds terms of dq = ds k and
    # dk = ds^T q summed over a key head's value heads, and their share of the decay's gradient (rows of p in dq . q,
    # columns in dk . k), without repeating q and k per value head
    ds = (dob @ vb.transpose(-1, -2)) * torch.where(causal, torch.exp2(gb[..., :, None] - gb[..., None, :]), 0)
    ds = ds * scale
    p = ds * (qb @ kb.transpose(-1, -2))
    dq_state = (dob @ hb.transpose(-1, -2)) * (torch.exp2(gb) * scale)[..., None]  # [nt, hk, r, chunk, dk]
    dk_state = (vb @ dhb.transpose(-1, -2)) * torch.exp2(last - gb)[..., None]
    dg = (dq_state * qb).sum(-1) + p.sum(-1) - (dk_state * kb).sum(-1) - p.sum(-2)  # [nt, hk, r, chunk]
    dg_last = (hb * dhb).sum((-1, -2)) * torch.exp2(last[..., 0]) + (dk_state * kb).sum((-1, -2))
    dg = torch.cat((dg[..., :-1], dg[..., -1:] + dg_last[..., None]), -1)
    ds_sum = ds.sum(2)  # [nt, hk, chunk, chunk]
    dq = dq_state.sum(2) + ds_sum @ kb[:, :, 0]
    dk_all = dk_state.sum(2) + ds_sum.transpose(-1, -2) @ qb[:, :, 0]
    dw = -(dvb @ hb.transpose(-1, -2))

    def rows(x: Tensor, heads: int) -> Tensor:  # [nt, heads, chunk, d] -> [1, t, heads, d]
        return x.reshape(nt, heads, chunk, -1).transpose(1, 2).reshape(1, t, heads, -1)

    return (rows(dq, hk).to(q.dtype), rows(dk_all, hk).to(k.dtype), rows(dw, hv).to(w.dtype),
            rows(dg, hv)[..., 0])
