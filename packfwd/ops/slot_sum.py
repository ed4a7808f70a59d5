"""The ordered sum an MoE layer's combine takes: each token's expert rows, gathered and summed in a fixed order.

::

    out[i] = sum over j = 0 .. k-1 with valid[i, j] of rows[picked[i, j]]      (j ascending)

``rows [n, h]`` (the experts' outputs, or the gradient of the permuted tokens), ``picked [t, k]`` (int64: token
``i``'s rows, its experts in ascending order), ``valid [t, k]`` (bool: False past the experts the token reached;
such a slot is never read, so whatever its ``picked`` points at, even an uninitialised row holding NaN, adds
nothing).  bf16 / fp16 rows are summed in float32 and rounded once; float32 and float64 in their own dtype.  The
sum starts at +0.0 and adds the slots one at a time, so a token's bits depend on its own rows only (no atomics,
the same bits in any batch and run to run).

Two implementations, the same bits (IEEE adds in the same order): the torch reference (:func:`reference`, one
gather and one add per slot) everywhere, and on CUDA one Triton kernel (a program per token and block of ``h``,
``k`` masked row loads, one store), which replaces the reference's ``k`` gathers, and the gather + fill + sum of
``[t, k, h]`` that packfwd's combine took before (27 ms of a 12-layer MoE step's kernels on an H200,
benchmarks/RESULTS.md section 17), with one read of the rows it needs and one write.  :func:`slot_sum` picks.

Tested (``tests/gpu/test_slot_sum_kernel.py``, on a GPU or in Triton's interpreter on the CPU) against a float64
loop and the reference: dtypes, ``k`` 1 to 8, invalid slots pointing at NaN rows, no tokens, no rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never launch these (importing this module must still work)
    triton = None

__all__ = ["reference", "slot_sum", "supported"]

# Columns of h per program; warps per program.
CONFIG = {"block_h": 1024, "num_warps": 4}
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def supported(rows: Tensor) -> bool:
    """Whether the kernel takes ``rows``: a CUDA tensor of :data:`DTYPES`, with Triton installed."""
    return triton is not None and rows.is_cuda and rows.dtype in DTYPES


def slot_sum(rows: Tensor, picked: Tensor, valid: Tensor) -> Tensor:
    """``[t, h]``: each token's valid rows of ``rows [n, h]`` summed in ascending slot order (module docstring);
    the kernel where :func:`supported`, else :func:`reference`.  Not differentiable itself: the combine's autograd
    function (``packfwd.models.mlp.dispatch``) gives its backward, a gather.

    >>> rows = torch.tensor([[1.0], [20.0], [300.0]])
    >>> slot_sum(rows, torch.tensor([[0, 2], [1, 1], [0, 0]]), torch.tensor([[True, True], [True, False], [False, False]]))
    tensor([[301.],
            [ 20.],
            [  0.]])
    """
    _check(rows, picked, valid)
    return launch(rows, picked, valid) if supported(rows) else reference(rows, picked, valid)


def reference(rows: Tensor, picked: Tensor, valid: Tensor) -> Tensor:
    """The torch path: one gather per slot, a ``where`` (an invalid slot's row is dropped, never multiplied), the
    sum from +0.0 in the accumulation dtype, one rounding."""
    t, k = picked.shape
    acc_dtype = _acc(rows.dtype)
    acc = torch.zeros(t, rows.shape[1], dtype=acc_dtype, device=rows.device)
    if rows.shape[0] == 0:
        return acc.to(rows.dtype)
    zero = acc.new_zeros(())
    for j in range(k):
        row = rows.index_select(0, picked[:, j]).to(acc_dtype)
        acc = acc + torch.where(valid[:, j, None], row, zero)
    return acc.to(rows.dtype)


def launch(rows: Tensor, picked: Tensor, valid: Tensor) -> Tensor:
    """The kernel's launcher (``rows`` on CUDA, or CPU tensors in Triton's interpreter)."""
    if triton is None:
        raise RuntimeError("packfwd.ops.slot_sum's kernel needs Triton; use slot_sum() or reference() without it")
    t, k = picked.shape
    h = rows.shape[1]
    out = torch.empty(t, h, dtype=rows.dtype, device=rows.device)
    if t == 0 or h == 0:
        return out
    if rows.shape[0] == 0:
        return out.zero_()
    src = rows if rows.stride(1) == 1 else rows.contiguous()
    block_h = min(CONFIG["block_h"], triton.next_power_of_2(h))
    grid = (t, triton.cdiv(h, block_h))
    _slot_sum_kernel[grid](
        src, src.stride(0), picked.contiguous(), valid.contiguous().view(torch.uint8), out, h,
        K=k, BLOCK_H=block_h, ACC64=rows.dtype == torch.float64, num_warps=CONFIG["num_warps"],
    )
    return out


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _check(rows: Tensor, picked: Tensor, valid: Tensor) -> None:
    for name, x in (("rows", rows), ("picked", picked), ("valid", valid)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if rows.dim() != 2 or not rows.is_floating_point():
        raise ValueError(f"rows must be a floating-point [n, h] tensor, got {rows.dtype} {tuple(rows.shape)}")
    if picked.dim() != 2 or picked.dtype != torch.int64:
        raise ValueError(f"picked must be an int64 [t, k] tensor, got {picked.dtype} {tuple(picked.shape)}")
    if valid.shape != picked.shape or valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool tensor of picked's shape {tuple(picked.shape)}, got {valid.dtype} "
                         f"{tuple(valid.shape)}")


if triton is not None:

    @triton.jit
    def _slot_sum_kernel(rows, row_stride, picked, valid, out, h, K: tl.constexpr, BLOCK_H: tl.constexpr,
                         ACC64: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        inside = cols < h
        if ACC64:
            acc = tl.zeros((BLOCK_H,), dtype=tl.float64)
        else:
            acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(picked + tok * K + j)
            use = (tl.zeros((BLOCK_H,), dtype=tl.int32) + tl.load(valid + tok * K + j).to(tl.int32)) != 0
            x = tl.load(rows + row * row_stride + cols, mask=inside & use, other=0.0)
            acc += x.to(acc.dtype)
        tl.store(out + tok * h + cols, acc.to(out.dtype.element_ty), mask=inside)
