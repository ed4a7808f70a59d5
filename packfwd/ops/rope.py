"""A fused Triton RoPE for packed (THD) query and key: ``q [t, hq, d]``, ``k [t, hk, d]`` rotated by per-token
``cos``/``sin [t, d_rot]`` rows, forward and backward, without the ``cat`` of halves.

The math is Megatron-Core's (``_apply_rotary_pos_emb_bshd``, what :func:`packfwd.models.mixers.rope.apply_rope` computes),
in the input's dtype, op for op: ``x * cos + rotate_half(x) * sin`` over the first ``d_rot`` channels of each head
(the rest pass through), with ``rotate_half`` the two halves ``[-x2, x1]`` (or, ``interleaved``, the pairs
``(-x[2i+1], x[2i])``).  Per pair of channels ``(a, b)`` (``(j, j + d_rot/2)``, or ``(2i, 2i+1)``)::

    y_a = R(R(x_a cos_a) + R(-x_b sin_a))          forward
    y_b = R(R(x_b cos_b) + R( x_a sin_b))
    dx_a = R(R(g_a cos_a) + R( g_b sin_b))         backward: the rotation by the negated angle, in the
    dx_b = R(R(g_b cos_b) + R(-g_a sin_a))         roundings autograd takes through Megatron's ops

``R`` rounds to the input's dtype (nothing in float32).  Each product and sum is formed in float32 and rounded
once, as torch forms a bf16 / fp16 op; a bf16 / fp16 product of two such values is exact in float32, so each
``R`` is the single rounding torch's op takes, and the results are **bitwise** those of ``apply_rope`` and of its
autograd backward, in every dtype (float32: the kernels are compiled without fused multiply-add,
``enable_fp_fusion=False``; bf16 is rounded to nearest even with integer arithmetic, so Triton's interpreter,
which truncates a float32 -> bf16 cast, gives the same bits as the GPU).  The only difference: a zero may come out
``+0.0`` where autograd's sum with a zero gradient gives ``-0.0`` or the reverse (``torch.equal`` holds).

``q`` and ``k`` may be any strided views (out of the fused QKV projection): strides are read, nothing is copied
in; outputs and gradients are new contiguous ``[t, h, d]`` tensors.  ``cos``/``sin`` carry no gradient (a
``cos`` that requires one takes the torch path).  One program per token and block of heads, no atomics:
deterministic, bit for bit run to run.

With ``paired=True`` the tables are ``[t, d_rot / 2]``, one entry per pair (``cos_a = cos_b``, as in every RoPE
table), which spares the caller the ``cat`` that lays a table out.

``rope(q, k, cos, sin, interleaved)`` is the entry point: the kernels (:class:`RopeKernel`, over the launcher
:func:`rotate`) where :func:`supported`, else :func:`reference` (the torch ops, differentiable).  Importing this
module without Triton works; launching does not.  ``packfwd.models.mixers.rope.PackedRope(fused=True)`` takes it.

Tested (``tests/gpu/test_rope_kernel.py``, on a GPU or in Triton's interpreter on the CPU) against float64 math,
against ``apply_rope`` and Megatron-Core's own rotation, bit for bit: fp32 / bf16 / fp16, GQA, partial rotary,
interleaved, non-contiguous inputs, gradients, the same bits twice.  Performance is not measured yet.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never launch these (importing this module must still work)
    triton = None

__all__ = ["RopeKernel", "full_table", "reference", "rope", "rotate", "supported"]

# Pairs of channels (heads x d_rot/2) per program at most; warps per program.
CONFIG = {"pairs": 2048, "num_warps": 4}

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def supported(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether the kernels can take these: CUDA tensors of one dtype (bf16 / fp16 / fp32), Triton installed,
    ``cos``/``sin`` not requiring gradients."""
    tensors = (q, k, cos, sin)
    return (triton is not None and all(t.is_cuda for t in tensors) and q.dtype in DTYPES
            and all(t.dtype == q.dtype for t in tensors) and not (cos.requires_grad or sin.requires_grad))


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False, *, paired: bool = False,
         kernel: bool | None = None) -> tuple[Tensor, Tensor]:
    """``(q, k)`` rotated: ``q [t, hq, d]``, ``k [t, hk, d]`` by ``cos``, ``sin [t, d_rot]`` (in q's dtype; each
    token's row), channels past ``d_rot`` passing through.

    paired: ``cos``/``sin`` are ``[t, d_rot / 2]``, one entry per pair of channels (the two channels of a pair
    share an angle in every RoPE table: Megatron-Core's ``get_emb`` repeats each frequency), so the caller skips
    the table's ``cat``; the same numbers as the full table of repeated entries.

    kernel: None takes the Triton kernels where :func:`supported` (CUDA), else :func:`reference`; True always
    the kernels (CPU tensors only under ``TRITON_INTERPRET=1``); False always the reference.

    >>> q = torch.tensor([[[1.0, 0.0]]])                 # one token, one head, d = 2
    >>> angle = torch.tensor([[torch.pi / 2] * 2])
    >>> q_rot, _ = rope(q, q, angle.cos(), angle.sin())
    >>> q_rot.round(decimals=6).abs().tolist()           # (1, 0) turned by 90 degrees
    [[[0.0, 1.0]]]
    """
    _check(q, k, cos, sin, paired)
    if kernel is None:
        kernel = supported(q, k, cos, sin)
    if not kernel:
        if paired:
            cos, sin = full_table(cos, interleaved), full_table(sin, interleaved)
        cos, sin = cos[:, None], sin[:, None]
        return reference(q, cos, sin, interleaved), reference(k, cos, sin, interleaved)
    return RopeKernel.apply(q, k, cos, sin, bool(interleaved), bool(paired))


def full_table(half: Tensor, interleaved: bool = False) -> Tensor:
    """A per-pair table ``[..., d_rot / 2]`` laid out as Megatron-Core lays its rows out: ``[half, half]``, or
    (interleaved) each entry twice in a row.

    >>> full_table(torch.tensor([1, 2])).tolist(), full_table(torch.tensor([1, 2]), interleaved=True).tolist()
    ([1, 2, 1, 2], [1, 1, 2, 2])
    """
    if interleaved:
        return torch.stack((half, half), dim=-1).flatten(-2)
    return torch.cat((half, half), dim=-1)


def reference(t: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """Megatron-Core's rotation in torch, op for op: ``t [..., d]`` by ``cos``/``sin [..., d_rot]`` (broadcast
    against ``t``, in its dtype); channels past ``d_rot`` pass through.

    >>> reference(torch.tensor([[1.0, 2.0, 5.0]]), torch.zeros(1, 2), torch.ones(1, 2)).tolist()  # 90 degrees
    [[-2.0, 1.0, 5.0]]
    """
    rot = cos.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    x = (x * cos) + (_rotate_half(x, interleaved) * sin)
    return torch.cat((x, rest), dim=-1)


def _rotate_half(x: Tensor, interleaved: bool) -> Tensor:
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class RopeKernel(torch.autograd.Function):
    """``(q, k)`` rotated through the kernels; saves ``cos`` and ``sin`` only.  Gradients flow to q and k."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, interleaved, paired=False):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved, ctx.paired = interleaved, paired
        ctx.set_materialize_grads(False)
        return rotate(q, cos, sin, interleaved, paired=paired), rotate(k, cos, sin, interleaved, paired=paired)

    @staticmethod
    def backward(ctx, g_q, g_k):
        cos, sin = ctx.saved_tensors
        kw = dict(interleaved=ctx.interleaved, inverse=True, paired=ctx.paired)
        d_q = rotate(g_q, cos, sin, **kw) if g_q is not None else None
        d_k = rotate(g_k, cos, sin, **kw) if g_k is not None else None
        return d_q, d_k, None, None, None, None


def rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False, inverse: bool = False,
           paired: bool = False) -> Tensor:
    """The launcher: ``x [t, h, d]`` (any strides) rotated by ``cos``/``sin [t, d_rot]`` (``paired``:
    ``[t, d_rot / 2]``) as a new contiguous tensor in x's dtype; ``inverse``: the backward's rotation (see the
    module docstring)."""
    if triton is None:
        raise RuntimeError("packfwd.ops.rope's kernels need Triton; use rope() or reference() without it")
    if x.dtype not in DTYPES or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise TypeError(f"rotate: x, cos and sin must share one dtype of bf16, fp16 or fp32; got {x.dtype}, "
                        f"{cos.dtype}, {sin.dtype}")
    t, h, d = x.shape
    half = cos.shape[-1] if paired else cos.shape[-1] // 2
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    cos, sin = cos.contiguous(), sin.contiguous()
    block_r = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(h), max(1, CONFIG["pairs"] // block_r))
    rest = d - 2 * half
    _rope_kernel[(t, triton.cdiv(h, block_h))](
        x, x.stride(0), x.stride(1), x.stride(2), cos, sin, out, h, half, d,
        BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_P=triton.next_power_of_2(max(rest, 1)), HAS_PASS=rest > 0,
        INTERLEAVED=bool(interleaved), INVERSE=bool(inverse), PAIRED=bool(paired), DTYPE=_CODE[x.dtype],
        num_warps=CONFIG["num_warps"], enable_fp_fusion=False,  # no fused multiply-add: torch's float32 bits
    )
    return out


def _check(q, k, cos, sin, paired: bool = False) -> None:
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, Tensor):
            raise TypeError(f"rope: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"rope: {name} must be a floating-point tensor, got {t.dtype}")
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"rope: q and k must be [t, hq, d] and [t, hk, d] (same t and d); got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    rot = (cos.shape[-1] * (2 if paired else 1)) if cos.dim() == 2 else -1
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != q.shape[0] or rot < 2 or rot % 2 or rot > q.shape[2]:
        width = "d_rot / 2" if paired else "d_rot"
        raise ValueError(f"rope: cos and sin must both be [t, {width}] with t = {q.shape[0]} and an even "
                         f"2 <= d_rot <= d = {q.shape[2]}; got {tuple(cos.shape)} and {tuple(sin.shape)}")


# ---------------------------------------------------------------------------------------------------- the kernels

if triton is not None:

    @triton.jit
    def _round(v, DTYPE: tl.constexpr):
        """float32 ``v`` rounded to the nearest value of the output dtype (0 float32, 1 bf16, 2 fp16), in float32.
        bf16 by integer arithmetic (round to nearest even; NaN kept): the interpreter's cast truncates."""
        if DTYPE == 1:
            bits = v.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            r = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
            return tl.where(v != v, v, r)
        elif DTYPE == 2:
            return v.to(tl.float16).to(tl.float32)
        else:
            return v

    @triton.jit
    def _rope_kernel(
        x, sx_t, sx_h, sx_d, cos, sin, out, H, HALF, D,
        BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, HAS_PASS: tl.constexpr,
        INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr, PAIRED: tl.constexpr, DTYPE: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
        j = tl.arange(0, BLOCK_R)
        if INTERLEAVED:
            ca, cb = 2 * j, 2 * j + 1
        else:
            ca, cb = j, j + HALF
        ok_h = h < H
        ok_j = j < HALF
        ok = ok_h[:, None] & ok_j[None, :]
        src = x + tok * sx_t + h[:, None] * sx_h
        dst = out + tok * H * D + h[:, None] * D
        xa = tl.load(src + ca[None, :] * sx_d, mask=ok, other=0.0).to(tl.float32)
        xb = tl.load(src + cb[None, :] * sx_d, mask=ok, other=0.0).to(tl.float32)
        if PAIRED:  # one entry per pair: [t, HALF]
            cos_a = tl.load(cos + tok * HALF + j, mask=ok_j, other=0.0).to(tl.float32)[None, :]
            sin_a = tl.load(sin + tok * HALF + j, mask=ok_j, other=0.0).to(tl.float32)[None, :]
            cos_b, sin_b = cos_a, sin_a
        else:  # each channel its own entry: [t, 2 HALF]
            row = tok * (2 * HALF)
            cos_a = tl.load(cos + row + ca, mask=ok_j, other=0.0).to(tl.float32)[None, :]
            cos_b = tl.load(cos + row + cb, mask=ok_j, other=0.0).to(tl.float32)[None, :]
            sin_a = tl.load(sin + row + ca, mask=ok_j, other=0.0).to(tl.float32)[None, :]
            sin_b = tl.load(sin + row + cb, mask=ok_j, other=0.0).to(tl.float32)[None, :]
        if INVERSE:  # autograd through Megatron's ops: dx_a = g_a cos_a + g_b sin_b, dx_b = g_b cos_b - g_a sin_a
            ya = _round(_round(xa * cos_a, DTYPE) + _round(xb * sin_b, DTYPE), DTYPE)
            yb = _round(_round(xb * cos_b, DTYPE) + _round(-xa * sin_a, DTYPE), DTYPE)
        else:  # x * cos + rotate_half(x) * sin
            ya = _round(_round(xa * cos_a, DTYPE) + _round(-xb * sin_a, DTYPE), DTYPE)
            yb = _round(_round(xb * cos_b, DTYPE) + _round(xa * sin_b, DTYPE), DTYPE)
        tl.store(dst + ca[None, :], ya.to(out.dtype.element_ty), mask=ok)
        tl.store(dst + cb[None, :], yb.to(out.dtype.element_ty), mask=ok)
        if HAS_PASS:  # channels past d_rot: copied
            p = 2 * HALF + tl.arange(0, BLOCK_P)
            ok_p = ok_h[:, None] & (p < D)[None, :]
            tl.store(dst + p[None, :], tl.load(src + p[None, :] * sx_d, mask=ok_p, other=0.0), mask=ok_p)
