"""Zero the groups of a stacked tensor that a device mask names, without reading it back and without touching the
other groups: ``x[e] = 0`` where ``empty[e]`` (``x [E, ...]``, ``empty [E]`` bool, both on one device).

The grouped experts' weight gradient ``[E, out, in]`` needs it: an expert without rows is a grouped product over
``K = 0``, which CUTLASS leaves unwritten, and the experts' counts live on the device (no host sync), so the
empty ones are known only there.  ``masked_fill_`` with a broadcast mask reads and writes all of ``x`` (about
10 ms of a 12-layer MoE step on an H200, benchmarks/RESULTS.md section 17); the kernel reads ``E`` flags and
writes the empty groups only.  On the CPU, and without Triton, ``masked_fill_``.

Tested in ``tests/gpu/test_zero_groups_kernel.py`` (GPU, or Triton's interpreter on the CPU).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never launch it (importing this module must still work)
    triton = None

__all__ = ["zero_groups_"]

BLOCK = 4096  # elements per program


def zero_groups_(x: Tensor, empty: Tensor) -> Tensor:
    """``x`` (in place, contiguous) with ``x[e]`` zeroed wherever ``empty[e]``; returns ``x``.

    >>> zero_groups_(torch.ones(3, 2), torch.tensor([False, True, False])).tolist()
    [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    """
    if empty.shape != x.shape[:1] or empty.dtype != torch.bool:
        raise ValueError(f"empty must be a bool [E] tensor for x of shape {tuple(x.shape)}, got {empty.dtype} "
                         f"{tuple(empty.shape)}")
    if not (triton is not None and x.is_cuda and x.is_contiguous()):
        return x.masked_fill_(empty.view(-1, *(1,) * (x.dim() - 1)), 0)
    return launch(x, empty)


def launch(x: Tensor, empty: Tensor) -> Tensor:
    """The kernel's launcher (CUDA tensors, or CPU tensors in Triton's interpreter); ``x`` contiguous."""
    if triton is None:
        raise RuntimeError("packfwd.ops.zero_groups' kernel needs Triton; use zero_groups_() without it")
    groups = x.shape[0]
    size = x.numel() // groups if groups else 0
    if size == 0:
        return x
    _zero_groups_kernel[(groups, triton.cdiv(size, BLOCK))](x, empty.contiguous().view(torch.uint8), size,
                                                            BLOCK=BLOCK)
    return x


if triton is not None:

    @triton.jit
    def _zero_groups_kernel(x, empty, size, BLOCK: tl.constexpr):
        group = tl.program_id(0).to(tl.int64)
        if tl.load(empty + group) != 0:
            at = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            tl.store(x + group * size + at, tl.zeros((BLOCK,), dtype=x.dtype.element_ty), mask=at < size)
