"""Fused Triton RMSNorm, optionally with the residual add before it, forward and backward, over rows of width h.

Math, per row ``v`` of width ``h`` (float32 inside, whatever the dtype outside)::

    r = rsqrt(mean(v ** 2) + eps)                    # one float32 per row, saved for the backward
    y = v * r * weight                               # rounded once to x's dtype (as torch.nn.functional.rms_norm)
    dv = r * (g w - v r * mean(g w * v r))           # g = dL/dy, w = weight
    dweight = sum over rows of g * v * r

With a residual (:func:`rms_norm` ``residual=``, the fused add + norm of TransformerEngine / Megatron / vLLM),
``v = x + residual`` rounded to x's dtype (bit for bit torch's ``x + residual``), the kernel writes ``v`` beside
``y`` and returns both; the gradient of ``x`` and of ``residual`` is ``dv + dL/dv`` (the gradient reaching the
returned sum), rounded once.

Conventions: ``x [..., h]`` of bf16 / fp16 / fp32; ``weight [h]`` of any of those (its gradient in its dtype);
the output in x's dtype; leading dims flattened to rows.  Forward: one program per row, the whole row in one block
(``h <= MAX_H``), ``block_rows(h)`` rows to a program (a ``[rows, h]`` tile).  Backward:
``min(tiles, CONFIG["programs"])`` programs, each over a contiguous run of row tiles, each writing its float32
partial sum of ``dweight``; torch sums the ``[programs, h]`` partials.  No atomics, and the
split depends on the shape only, so the gradients are the same bits run after run (and on any GPU of the same
float math).

Entry points: :func:`rms_norm` (kernel for supported CUDA tensors, else :func:`reference`), the autograd.Function
:class:`RMSNormKernel` over the launchers :func:`forward_rows` / :func:`backward_rows` (kernels after them).
Importing without Triton works; launching does not.  ``packfwd.models.norm.RMSNorm(..., fused=True)`` takes it
(``FusedRMSNorm``: every norm of a model built with ``ModelArgs.fused``, the default).

Tested (``tests/gpu/test_rmsnorm_kernel.py``, on CUDA or in Triton's interpreter on the CPU) against float64 math
and ``torch.nn.functional.rms_norm``: values and the gradients of x, weight and residual, fp32 / bf16 / fp16,
widths that are not powers of 2, 1 to 37 rows, several rows per backward program, bitwise equal on a second run.
Performance is not measured yet (no GPU in the session that wrote it).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never launch these (importing this module must still work)
    triton = None

__all__ = ["rms_norm", "reference", "supported", "RMSNormKernel", "forward_rows", "backward_rows"]

# Backward programs (each sums dweight over its run of row tiles); a constant, so the bits depend on the shape only.
# 512: about four per SM on an H100 / H200 (132 SMs).  "tile": elements of a program's [rows, h] tile (rows =
# tile / next_power_of_2(h), at least 1, at most 64): narrow rows (QK-norm's head_dim) go many to a program.
CONFIG = {"programs": 512, "num_warps": 4, "tile": 8192}

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_H = 65536  # a row is one block in registers


def supported(x: Tensor, weight: Tensor) -> bool:
    """Whether the kernels can take ``x [..., h]`` and ``weight [h]``: CUDA, bf16 / fp16 / fp32, Triton installed."""
    return (triton is not None and x.is_cuda and weight.is_cuda and x.dtype in DTYPES and weight.dtype in DTYPES
            and 0 < x.shape[-1] <= MAX_H)


def reference(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    """The kernels' math in torch: ``y`` (float32 inside, x's dtype out), or ``(y, x + residual)``."""
    v = x if residual is None else x + residual
    v32 = v.float()
    y = (v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return y if residual is None else (y, v)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, residual: Tensor | None = None, *,
             kernel: bool | None = None):
    """RMSNorm of ``x [..., h]`` with ``weight [h]``: ``y``, or ``(y, x + residual)`` with ``residual``.

    kernel: None takes the Triton kernels where :func:`supported` (CUDA), else :func:`reference`; True always
    takes the kernels (CPU tensors only under ``TRITON_INTERPRET=1``); False always the reference.

    >>> import torch
    >>> x, w = torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, 2.0])
    >>> rms_norm(x, w, eps=0.0)  # rms = sqrt((9 + 16) / 2)
    tensor([[0.8485, 2.2627]])
    >>> torch.equal(rms_norm(x, w, 1e-6), torch.nn.functional.rms_norm(x, (2,), w, 1e-6))
    True
    >>> y, total = rms_norm(x, w, 1e-6, residual=torch.ones(1, 2))
    >>> total
    tensor([[4., 5.]])
    """
    _check(x, weight, eps, residual)
    if kernel is None:
        kernel = supported(x, weight)
    if not kernel:
        return reference(x, weight, eps, residual)
    y, total = RMSNormKernel.apply(x, weight, residual, float(eps))
    return y if residual is None else (y, total)


def _check(x, weight, eps, residual):
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor):
        raise TypeError(f"rms_norm: x and weight must be tensors, got {type(x).__name__} and {type(weight).__name__}")
    if weight.dim() != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: weight must be [h] with h = x.shape[-1]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"rms_norm: eps must be a float >= 0, got {eps!r}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual must have x's shape and dtype {tuple(x.shape)} {x.dtype}; got "
                         f"{tuple(residual.shape)} {residual.dtype}")


def block_rows(h: int) -> int:
    """Rows of a program's tile for width ``h``: ``CONFIG["tile"] / next_power_of_2(h)``, within [1, 64]."""
    width = 1 << max(0, (h - 1).bit_length())
    return max(1, min(64, CONFIG["tile"] // width))


def _rows(t: Tensor) -> Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


class RMSNormKernel(torch.autograd.Function):
    """``(y, x + residual or None)`` of ``x [..., h]`` through the kernels; saves ``v`` (x or the sum), weight and
    the ``[rows]`` float32 ``rsqrt``.  ``residual`` may be None; ``eps`` is a float."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps):
        shape = x.shape
        y, total, rstd = forward_rows(_rows(x), weight, None if residual is None else _rows(residual), eps)
        ctx.save_for_backward(_rows(x) if total is None else total, weight, rstd)
        ctx.shape, ctx.has_residual = shape, residual is not None
        ctx.set_materialize_grads(False)
        return y.view(shape), (None if total is None else total.view(shape))

    @staticmethod
    def backward(ctx, g_y, g_total):
        v, weight, rstd = ctx.saved_tensors
        g_y = torch.zeros_like(v) if g_y is None else _rows(g_y)
        g_total = _rows(g_total) if ctx.has_residual and g_total is not None else None
        dx, dweight = backward_rows(v, g_y, g_total, weight, rstd)
        dx = dx.view(ctx.shape)
        return dx, dweight, (dx if ctx.has_residual else None), None


def forward_rows(x: Tensor, weight: Tensor, residual: Tensor | None, eps: float):
    """``(y, x + residual or None, rstd)`` of ``x [t, h]`` (unit column stride; ``residual`` likewise):
    ``y`` and the sum ``[t, h]`` contiguous in x's dtype, ``rstd [t]`` float32."""
    t, h = x.shape
    y = torch.empty((t, h), dtype=x.dtype, device=x.device)
    total = None if residual is None else torch.empty_like(y)
    rstd = torch.empty(t, dtype=torch.float32, device=x.device)
    if t == 0:
        return y, total, rstd
    res = x if residual is None else residual
    rows = block_rows(h)
    _rmsnorm_fwd_kernel[(triton.cdiv(t, rows),)](
        x, x.stride(0), res, res.stride(0), weight.contiguous(), y, y if total is None else total, rstd, t, h, eps,
        HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(h), ROWS=rows, num_warps=CONFIG["num_warps"],
    )
    return y, total, rstd


def backward_rows(v: Tensor, g_y: Tensor, g_total: Tensor | None, weight: Tensor, rstd: Tensor):
    """``(dv [t, h] in v's dtype, dweight [h] in weight's dtype)``; ``v`` the normed rows, ``g_y`` dL/dy,
    ``g_total`` the gradient reaching the returned sum (None: none), all ``[t, h]`` with unit column stride."""
    t, h = v.shape
    dv = torch.empty((t, h), dtype=v.dtype, device=v.device)
    if t == 0:
        return dv, torch.zeros_like(weight)
    rows = block_rows(h)
    tiles = triton.cdiv(t, rows)
    programs = min(tiles, CONFIG["programs"])
    per = triton.cdiv(tiles, programs)  # tiles per program
    programs = triton.cdiv(tiles, per)
    partial = torch.empty((programs, h), dtype=torch.float32, device=v.device)
    gt = g_y if g_total is None else g_total
    _rmsnorm_bwd_kernel[(programs,)](
        v, v.stride(0), g_y, g_y.stride(0), gt, gt.stride(0), weight.contiguous(), rstd, dv, partial, t, h, per,
        HAS_GT=g_total is not None, BLOCK=triton.next_power_of_2(h), ROWS=rows, num_warps=CONFIG["num_warps"],
    )
    return dv, partial.sum(0).to(weight.dtype)


# ---------------------------------------------------------------------------------------------------- the kernels

if triton is not None:

    @triton.jit
    def _rmsnorm_fwd_kernel(
        x, x_stride, res, res_stride, w, y, total, rstd, T, H, eps,
        HAS_RES: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        ok = (rows < T)[:, None] & (cols < H)[None, :]
        v = tl.load(x + rows[:, None] * x_stride + cols[None, :], mask=ok, other=0.0)
        if HAS_RES:
            r = tl.load(res + rows[:, None] * res_stride + cols[None, :], mask=ok, other=0.0)
            v = (v.to(tl.float32) + r.to(tl.float32)).to(total.dtype.element_ty)  # torch's x + residual
            tl.store(total + rows[:, None] * H + cols[None, :], v, mask=ok)
        v = v.to(tl.float32)
        r_ = 1.0 / tl.sqrt(tl.sum(v * v, 1) / H + eps)  # [ROWS]
        wv = tl.load(w + cols, mask=cols < H, other=0.0).to(tl.float32)
        tl.store(y + rows[:, None] * H + cols[None, :], (v * r_[:, None] * wv[None, :]).to(y.dtype.element_ty),
                 mask=ok)
        tl.store(rstd + rows, r_, mask=rows < T)

    @triton.jit
    def _rmsnorm_bwd_kernel(
        v, v_stride, gy, gy_stride, gt, gt_stride, w, rstd, dv, partial, T, H, PER,
        HAS_GT: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        cok = cols < H
        wv = tl.load(w + cols, mask=cok, other=0.0).to(tl.float32)
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        first = pid.to(tl.int64) * PER  # int64 tiles: the loop counter takes first's type
        for tile in range(first, first + PER):
            rows = tile * ROWS + tl.arange(0, ROWS)
            rok = rows < T
            ok = rok[:, None] & cok[None, :]
            r_ = tl.load(rstd + rows, mask=rok, other=0.0)
            xh = tl.load(v + rows[:, None] * v_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32) * r_[:, None]
            g = tl.load(gy + rows[:, None] * gy_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            acc += g * xh
            gw = g * wv[None, :]
            d = (gw - xh * (tl.sum(gw * xh, 1) / H)[:, None]) * r_[:, None]
            if HAS_GT:
                d += tl.load(gt + rows[:, None] * gt_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            tl.store(dv + rows[:, None] * H + cols[None, :], d.to(dv.dtype.element_ty), mask=ok)
        tl.store(partial + pid.to(tl.int64) * H + cols, tl.sum(acc, 0), mask=cok)
