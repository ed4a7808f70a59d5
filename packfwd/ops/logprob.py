"""Fused Triton kernels for ``packfwd.logits`` on one GPU: log-probs and entropy of ``[t, v]`` logits.

Imported only when a CUDA tensor takes the kernel path (``packfwd.logits`` asks ``supported``, then applies the
autograd.Function ``RowKernel``, over the launchers ``forward_stats`` and ``backward_grad``; the kernels follow
them).  Importing it without Triton works, launching does not.

Same math and conventions as the chunked torch path of ``packfwd.logits`` (see its module docstring), with
``z = (raw - m) * inv_t`` and ``m`` the row's raw max:

* forward, one program per row: a running max / sum of ``exp(z)`` / sum of ``exp(z) z`` over blocks of the
  vocab (float32, rescaled when the max grows), then the label's logit.  Writes ``m``, ``s``, ``mean_z = e / s``,
  ``log_prob = z[label] - log s`` (0 for a negative label) and ``entropy = log s - mean_z``, all ``[t]``.  One
  read of the logits.
* backward, one program per row: ``dL/draw = inv_t * (g_logp (onehot - p) - g_ent p (z - mean_z))``, written in
  the logits' dtype in one pass (one read, one write).  The label entry uses ``1 - p = -expm1(log p)``, as the
  torch path does.  ``-inf`` logits get 0.

No temperature gradient here: ``packfwd.logits`` keeps the torch path when a tensor temperature requires grad.
Tested against float64 math and the torch path on the GPU, and in Triton's interpreter on the CPU
(``tests/gpu/test_logprob_kernel.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never launch these (importing this module must still work)
    triton = None

# Vocab entries per block of a row, and warps per program (one program per row).
CONFIG = {"block": 4096, "num_warps": 8}

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supported(logits: Tensor) -> bool:
    """Whether the kernels can take these logits: a CUDA tensor of bf16 / fp16 / fp32, with Triton installed."""
    return triton is not None and logits.is_cuda and logits.dtype in DTYPES and logits.shape[0] > 0


def save_row_stats(ctx, logits, inv_t, labels, m, s, mean_z, logp, ent, want_entropy: bool):
    """What both log-prob autograd functions (this kernel's and ``packfwd.logits``' torch blocks) keep for their
    backward: the logits and the ``[t]`` statistics; without entropy, a zero entropy that takes no gradient."""
    ctx.save_for_backward(logits, inv_t, labels, m, s, mean_z if want_entropy else s)
    ctx.want_entropy = want_entropy
    ctx.set_materialize_grads(False)
    if not want_entropy:
        ent = torch.zeros_like(s)
        ctx.mark_non_differentiable(ent)
    return logp, ent


class RowKernel(torch.autograd.Function):
    """(log_probs, entropy) of ``logits [t, v]`` through the kernels; saves the logits and ``[t]`` vectors only.

    ``inv_t`` must not require grad (no temperature gradient here).  Without ``want_entropy`` the entropy output
    is zeros and not differentiable.
    """

    @staticmethod
    def forward(ctx, logits, inv_t, labels, want_entropy):
        m, s, mean_z, logp, ent = forward_stats(logits, inv_t, labels, want_entropy)
        return save_row_stats(ctx, logits, inv_t, labels, m, s, mean_z, logp, ent, want_entropy)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, inv_t, labels, m, s, mean_z = ctx.saved_tensors
        if not ctx.want_entropy:
            g_ent = None
        if (g_logp is None and g_ent is None) or not ctx.needs_input_grad[0]:
            return None, None, None, None
        grad = backward_grad(logits, inv_t, labels, m, s, mean_z if ctx.want_entropy else None, g_logp, g_ent)
        return grad, None, None, None


def forward_stats(logits: Tensor, inv_t: Tensor, labels: Tensor, want_entropy: bool):
    """``(m, s, mean_z or None, log_prob, entropy or None)``, each ``[t]`` float32, of ``logits [t, v]``.

    inv_t: ``[t]`` float32 ``1 / temperature``; labels: ``[t]`` int64, negative = ignored.
    """
    logits = _rows_contiguous(logits)
    t, v = logits.shape
    f32 = dict(dtype=torch.float32, device=logits.device)
    m, s, logp = torch.empty(t, **f32), torch.empty(t, **f32), torch.empty(t, **f32)
    mz = torch.empty(t, **f32) if want_entropy else s
    ent = torch.empty(t, **f32) if want_entropy else s
    block = min(CONFIG["block"], max(16, triton.next_power_of_2(v)))
    _logprob_fwd_kernel[(t,)](
        logits, logits.stride(0), inv_t.float().contiguous(), labels.contiguous(), m, s, mz, logp, ent, v,
        WANT_ENT=want_entropy, BLOCK=block, num_warps=CONFIG["num_warps"],
    )
    return m, s, (mz if want_entropy else None), logp, (ent if want_entropy else None)


def backward_grad(logits, inv_t, labels, m, s, mean_z, g_logp, g_ent) -> Tensor:
    """``dL/dlogits [t, v]`` in the logits' dtype; ``g_logp`` / ``g_ent``: ``[t]`` upstream gradients or None."""
    logits = _rows_contiguous(logits)
    t, v = logits.shape
    grad = torch.empty((t, v), dtype=logits.dtype, device=logits.device)
    has_lp, has_ent = g_logp is not None, g_ent is not None
    if not (has_lp or has_ent):
        return grad.zero_()
    glp = g_logp.float().contiguous() if has_lp else s
    gent = g_ent.float().contiguous() if has_ent else s
    block = min(CONFIG["block"], max(16, triton.next_power_of_2(v)))
    _logprob_bwd_kernel[(t,)](
        logits, logits.stride(0), grad, grad.stride(0), inv_t.float().contiguous(), labels.contiguous(), m, s,
        mean_z if mean_z is not None else s, glp, gent, v,
        HAS_LOGP=has_lp, HAS_ENT=has_ent, BLOCK=block, num_warps=CONFIG["num_warps"],
    )
    return grad


def _rows_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# ---------------------------------------------------------------------------------------------------- the kernels

if triton is not None:

    @triton.jit
    def online_block(m, s, e, raw, inv, WANT_ENT: tl.constexpr):
        """One block of a row's raw logits folded into its running max ``m``, sum ``s`` of exp((x - m) inv) and
        entropy term ``e`` (the sum of p z, rescaled with ``s``); shared by the row kernels here and the fused
        linear kernels (``linear_logprob.py``)."""
        m_new = tl.maximum(m, tl.max(raw, 0))
        same = m_new == m  # also both -inf: nothing finite so far
        d = tl.where(same, 0.0, (m - m_new) * inv)  # <= 0; -inf when m was -inf (then s = e = 0)
        w = tl.exp(d)
        m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
        z = (raw - m_use) * inv
        p = tl.exp(z)
        if WANT_ENT:
            pz = tl.where(p > 0, p * z, 0.0)
            e = tl.where(s > 0, w * (e + d * s), 0.0) + tl.sum(pz, 0)
        s = s * w + tl.sum(p, 0)
        return m_new, s, e

    @triton.jit
    def label_grad(z_l, log_s, glp, gent, mz, HAS_ENT: tl.constexpr):
        """dL/dz at the label's entry: g_logp (1 - p) - g_ent p (z - mean_z), with 1 - p = -expm1(log p)."""
        log_pl = z_l - log_s
        p_l = tl.exp(log_pl)
        # expm1 without cancellation: (u - 1) * y / log u is exact to rounding for u = exp(y) near 1
        em1 = tl.where(p_l == 1.0, log_pl, (p_l - 1.0) * log_pl / tl.log(p_l))
        em1 = tl.where(p_l == 0.0, -1.0, em1)
        label_dx = -glp * em1
        if HAS_ENT:
            label_dx -= tl.where(p_l > 0, gent * p_l * (z_l - mz), 0.0)
        return label_dx

    @triton.jit
    def _logprob_fwd_kernel(
        x, stride, inv_t, labels, m_out, s_out, mz_out, logp_out, ent_out, V,
        WANT_ENT: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = x + row * stride
        inv = tl.load(inv_t + row)
        cols = tl.arange(0, BLOCK)
        m = tl.zeros([], dtype=tl.float32) - float("inf")
        s = tl.zeros([], dtype=tl.float32)
        e = tl.zeros([], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            c = start + cols
            raw = tl.load(base + c, mask=c < V, other=-float("inf")).to(tl.float32)
            m, s, e = online_block(m, s, e, raw, inv, WANT_ENT)
        lab = tl.load(labels + row)
        valid = (lab >= 0) & (lab < V)
        raw_l = tl.load(base + tl.where(valid, lab, 0)).to(tl.float32)
        log_s = tl.log(s)
        logp = tl.where(valid, (raw_l - m) * inv - log_s, 0.0)
        tl.store(m_out + row, m)
        tl.store(s_out + row, s)
        tl.store(logp_out + row, logp)
        if WANT_ENT:
            mean_z = e / s
            tl.store(mz_out + row, mean_z)
            tl.store(ent_out + row, log_s - mean_z)

    @triton.jit
    def _logprob_bwd_kernel(
        x, stride, grad, g_stride, inv_t, labels, m_in, s_in, mz_in, g_logp, g_ent, V,
        HAS_LOGP: tl.constexpr, HAS_ENT: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = x + row * stride
        out = grad + row * g_stride
        inv = tl.load(inv_t + row)
        m = tl.load(m_in + row)
        s = tl.load(s_in + row)
        log_s = tl.log(s)
        r_s = 1.0 / s
        lab = tl.load(labels + row)
        valid = (lab >= 0) & (lab < V)
        glp = tl.zeros([], dtype=tl.float32)
        gent = tl.zeros([], dtype=tl.float32)
        mz = tl.zeros([], dtype=tl.float32)
        if HAS_LOGP:
            glp = tl.where(valid, tl.load(g_logp + row), 0.0)
        if HAS_ENT:
            gent = tl.load(g_ent + row)
            mz = tl.load(mz_in + row)
        z_l = (tl.load(base + tl.where(valid, lab, 0)).to(tl.float32) - m) * inv
        label_dx = label_grad(z_l, log_s, glp, gent, mz, HAS_ENT) * inv
        label_col = tl.where(valid, lab, -1)
        cols = tl.arange(0, BLOCK)
        for start in range(0, V, BLOCK):
            c = start + cols
            ok = c < V
            raw = tl.load(base + c, mask=ok, other=-float("inf")).to(tl.float32)
            z = (raw - m) * inv
            big_e = tl.exp(z)
            if HAS_ENT:
                coef = glp + gent * (z - mz)
                dx = tl.where(big_e > 0, -(big_e * r_s) * coef, 0.0)
            else:
                dx = -(big_e * r_s) * glp
            dx = tl.where(c == label_col, label_dx, dx * inv)
            tl.store(out + c, dx.to(out.dtype.element_ty), mask=ok)
