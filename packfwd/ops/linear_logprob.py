"""Triton kernels of ``packfwd.logits.fused_log_probs_and_entropy`` on a GPU: one vocab block of the logits
``raw = hidden @ weight[block].T`` at a time (the matmuls stay cuBLAS's), read once forward and once backward.

The fused head walks the vocab in blocks of ``k`` rows of the weight.  Per block, the torch path of
``packfwd.logits`` runs about a dozen elementwise passes over float32 ``[t, k]`` work buffers; these kernels do
the same math in one pass over the block's logits, in their own dtype, and keep the per-row state in ``[t]``
float32 vectors:

* :func:`accumulate_stats` (forward, one program per row): folds the block into the running max ``m``, sum
  ``s = sum exp(z)`` and ``e = sum exp(z) z`` (``z = (raw - m) * inv_t``, rescaled when the max grows, as the
  row kernels of :mod:`packfwd.ops.logprob` do over a whole row) and records the label's raw logit when the
  label lies in the block.  In place, so a block never leaves more than ``[t]`` statistics behind.
* :func:`block_grad` (backward, one program per row): with the final (vocab-wide, all ranks) ``m``, ``s`` and
  ``mean_z``, writes ``dL/draw = inv_t * (g_logp (onehot - p) - g_ent p (z - mean_z))`` of the block in the
  logits' dtype (the label entry from ``expm1(log p)``, no cancellation as ``p -> 1``) and adds the block's
  share of ``dL/dinv_t = sum dL/dx * z / inv_t`` to a ``[t]`` accumulator: the temperature gradient, which the
  row kernels do not give.

Labels are global vocab ids; ``col0`` is the block's first global column, so a label in another block (or on
another tensor-parallel rank) is simply not hit; the caller zeroes ``g_logp`` of ignored labels.  Importing this
module without Triton works, launching does not.  Tested in Triton's interpreter on the CPU and compiled on the
GPU against the torch path (``tests/gpu/test_linear_logprob_kernel.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .logprob import _rows_contiguous

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never launch these
    triton = None

# Vocab entries per inner step, and warps per program (one program per row of the block).
CONFIG = {"block": 2048, "num_warps": 8}

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supported(hidden: Tensor) -> bool:
    """Whether the kernels can take blocks of ``hidden @ weight.T``: CUDA, bf16 / fp16 / fp32, Triton installed."""
    return triton is not None and hidden.is_cuda and hidden.dtype in DTYPES


def new_stats(t: int, device, want_entropy: bool):
    """Fresh running statistics ``(m, s, e or None, label_raw)``, each ``[t]`` float32."""
    f32 = dict(dtype=torch.float32, device=device)
    m = torch.full((t,), -float("inf"), **f32)
    return m, torch.zeros(t, **f32), (torch.zeros(t, **f32) if want_entropy else None), torch.zeros(t, **f32)


def accumulate_stats(raw: Tensor, inv_t: Tensor, labels: Tensor, col0: int, m, s, e, label_raw) -> None:
    """Fold the block ``raw [t, k]`` (global vocab columns ``col0 .. col0 + k``) into ``m, s, e, label_raw``
    (from :func:`new_stats`, updated in place).  ``inv_t``: ``[t]`` float32; labels: ``[t]`` int64."""
    raw = _rows_contiguous(raw)
    t, k = raw.shape
    if t == 0 or k == 0:
        return
    want_e = e is not None
    _stats_kernel[(t,)](
        raw, raw.stride(0), inv_t.contiguous(), labels.contiguous(), m, s, e if want_e else s, label_raw, col0, k,
        WANT_ENT=want_e, BLOCK=_block(k), num_warps=CONFIG["num_warps"],
    )


def block_grad(raw, inv_t, labels, col0, m, s, mean_z, g_logp, g_ent, out, dinv) -> None:
    """Write ``dL/draw [t, k]`` of the block into ``out`` (the logits' dtype); add ``dL/dinv_t`` of the block to
    ``dinv`` ([t] float32) when given.  ``g_logp`` / ``g_ent``: ``[t]`` float32 or None (``mean_z`` may be
    None without ``g_ent``); ``g_logp`` must be 0 at ignored labels."""
    raw = _rows_contiguous(raw)
    t, k = raw.shape
    if t == 0 or k == 0:
        return
    has_lp, has_ent = g_logp is not None, g_ent is not None
    _grad_kernel[(t,)](
        raw, raw.stride(0), out, out.stride(0), inv_t.contiguous(), labels.contiguous(), m, s, mean_z if has_ent else s,
        g_logp if has_lp else s, g_ent if has_ent else s, dinv if dinv is not None else s, col0, k,
        HAS_LOGP=has_lp, HAS_ENT=has_ent, WANT_DINV=dinv is not None, BLOCK=_block(k),
        num_warps=CONFIG["num_warps"],
    )


def _block(k: int) -> int:
    return min(CONFIG["block"], max(16, triton.next_power_of_2(k)))


# ---------------------------------------------------------------------------------------------------- the kernels

if triton is not None:
    from .logprob import label_grad, online_block

    @triton.jit
    def _stats_kernel(
        x, stride, inv_t, labels, m_io, s_io, e_io, lraw_io, col0, K,
        WANT_ENT: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = x + row * stride
        inv = tl.load(inv_t + row)
        m = tl.load(m_io + row)
        s = tl.load(s_io + row)
        e = tl.zeros([], dtype=tl.float32)
        if WANT_ENT:
            e = tl.load(e_io + row)
        cols = tl.arange(0, BLOCK)
        for start in range(0, K, BLOCK):
            c = start + cols
            raw = tl.load(base + c, mask=c < K, other=-float("inf")).to(tl.float32)
            m, s, e = online_block(m, s, e, raw, inv, WANT_ENT)
        tl.store(m_io + row, m)
        tl.store(s_io + row, s)
        if WANT_ENT:
            tl.store(e_io + row, e)
        lab = tl.load(labels + row) - col0
        hit = (lab >= 0) & (lab < K)
        raw_l = tl.load(base + tl.where(hit, lab, 0)).to(tl.float32)
        tl.store(lraw_io + row, tl.where(hit, raw_l, tl.load(lraw_io + row)))

    @triton.jit
    def _grad_kernel(
        x, stride, grad, g_stride, inv_t, labels, m_in, s_in, mz_in, g_logp, g_ent, dinv_io, col0, K,
        HAS_LOGP: tl.constexpr, HAS_ENT: tl.constexpr, WANT_DINV: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = x + row * stride
        out = grad + row * g_stride
        inv = tl.load(inv_t + row)
        m = tl.load(m_in + row)
        s = tl.load(s_in + row)
        log_s = tl.log(s)
        r_s = 1.0 / s
        lab = tl.load(labels + row) - col0
        hit = (lab >= 0) & (lab < K)
        glp = tl.zeros([], dtype=tl.float32)
        gent = tl.zeros([], dtype=tl.float32)
        mz = tl.zeros([], dtype=tl.float32)
        if HAS_LOGP:
            glp = tl.load(g_logp + row)
        if HAS_ENT:
            gent = tl.load(g_ent + row)
            mz = tl.load(mz_in + row)
        z_l = (tl.load(base + tl.where(hit, lab, 0)).to(tl.float32) - m) * inv
        label_dx = label_grad(z_l, log_s, glp, gent, mz, HAS_ENT)
        label_col = tl.where(hit, lab, -1)
        acc = tl.zeros([], dtype=tl.float32)
        cols = tl.arange(0, BLOCK)
        for start in range(0, K, BLOCK):
            c = start + cols
            ok = c < K
            raw = tl.load(base + c, mask=ok, other=-float("inf")).to(tl.float32)
            z = (raw - m) * inv
            big_e = tl.exp(z)
            if HAS_ENT:
                dx = tl.where(big_e > 0, -(big_e * r_s) * (glp + gent * (z - mz)), 0.0)
            else:
                dx = -(big_e * r_s) * glp
            dx = tl.where(c == label_col, label_dx, dx)
            if WANT_DINV:  # sum dL/dx * (raw - m): dL/dx sums to 0 over the vocab, so this is sum dL/dx * raw
                acc += tl.sum(tl.where(ok & (big_e > 0), dx * z, 0.0), 0)
            tl.store(out + c, (dx * inv).to(out.dtype.element_ty), mask=ok)
        if WANT_DINV:
            tl.store(dinv_io + row, tl.load(dinv_io + row) + acc / inv)
