"""Planning on CUDA in one Triton kernel: every per-token map of a layout, from the mask and the row lengths.

The torch planning path launches a dozen small kernels after its sync; planning is bound by those launches, not
by the GPU.  Here one program per row finds where its sequence starts from the lengths of the rows before it
(each program reads them all: O(b) loads, nothing next to the launches this saves), walks its mask row once to
place its real tokens (a running cumsum gives each token's position in its sequence), then writes the layout's
padding slots, and for THD this rank's positions.

Layouts (``MODE``):
  UNPAD  token q of row i -> packed row cu[i] + q
  BSHD   token q of row i -> slot i * width + q; slots q >= len_i are padding; also the [b, width] mask
  THD    token q of row i -> owner(k) * local + start_i + (k >= cp) * c_i + q - k * c_i with k = q // c_i (the
         CP zigzag; cp = 1: start_i + q); slots len_i <= q < p_i are padding; also this rank's positions

The THD rules (``p_i``, the zigzag owner and position) are defined once in ``packfwd.layout.rules``; a Triton
kernel cannot call them, so this is the one copy that restates them.  The tests check it against those
functions and against the torch path, by Hypothesis, on the GPU and in Triton's interpreter on the CPU
(``tests/gpu/test_plan_kernel.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never launch these (importing this module must still work)
    triton = None

UNPAD, THD, BSHD = 0, 1, 2  # the kernel's MODE

# Rows whose lengths one program sums per step, mask columns it walks per step (powers of two), warps per program.
CONFIG = {"block_b": 256, "block_s": 1024, "num_warps": 4}


def available(mask: Tensor) -> bool:
    """Whether this mask can be planned by the kernel (CUDA, Triton installed, non-empty)."""
    return mask.is_cuda and mask.numel() > 0 and triton is not None


def plan_rows(
    mode: int, mask: Tensor, lengths: Tensor, *, total: int, align: int = 1, cp: int = 1, rank: int = 0,
    last_extra: int = 0, width: int = 0,
) -> dict[str, Tensor]:
    """Run the kernel.  ``lengths``: [b] on the mask's device (any integer dtype); ``total``: fwd entries
    (t for UNPAD, cp * local for THD, b * width for BSHD).  Returns the maps as int64 (cu_seqlens int32)."""
    b, s = mask.shape
    dev = mask.device
    local = total // cp
    sizes = [b * s, total] + ([local] if mode == THD else [])
    block = torch.empty(sum(sizes), dtype=torch.long, device=dev)
    parts = block.split(sizes)
    cu = torch.empty(2 * (b + 1) if mode == THD else b + 1, dtype=torch.int32, device=dev)
    row_mask = torch.empty(total, dtype=torch.bool, device=dev) if mode == BSHD else cu
    positions = parts[2] if mode == THD else cu
    plan_rows_kernel[(b,)](
        mask, lengths, parts[0], parts[1], positions, row_mask, cu, cu[b + 1 :] if mode == THD else cu,
        s, total, local, rank, b - 1, last_extra, width, align,
        MODE=mode, CP=cp, BLOCK_B=CONFIG["block_b"], BLOCK_S=CONFIG["block_s"], num_warps=CONFIG["num_warps"],
    )
    out = {"inverse": parts[0], "index": parts[1], "cu_seqlens": cu[: b + 1]}
    if mode == THD:
        out["cu_seqlens_padded"] = cu[b + 1 :]
        out["positions"] = parts[2]
    if mode == BSHD:
        out["attention_mask"] = row_mask.view(b, width)
    return out


if triton is not None:
    # MODE: 0 unpad, 1 THD, 2 BSHD (literals: Triton kernels read no Python globals)
    @triton.jit
    def _dest(q, start, c, local, MODE: tl.constexpr, CP: tl.constexpr):
        if MODE == 1 and CP > 1:
            k = q // tl.maximum(c, 1)
            owner = tl.where(k < CP, k, 2 * CP - 1 - k)
            return owner * local + start + tl.where(k >= CP, c, 0) + q - k * c
        return start + q

    @triton.jit
    def plan_rows_kernel(
        mask, lengths, inverse, fwd, positions, row_mask, cu, cu_padded,
        s, n_fwd, local, rank, last_row, last_extra, width, align,
        MODE: tl.constexpr, CP: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        i = tl.program_id(0)
        # Real and padded tokens of the rows before this one.
        acc_n = tl.zeros((BLOCK_B,), dtype=tl.int64)
        acc_p = tl.zeros((BLOCK_B,), dtype=tl.int64)
        for j0 in range(0, i, BLOCK_B):
            js = j0 + tl.arange(0, BLOCK_B)
            lj = tl.load(lengths + js, mask=js < i, other=0).to(tl.int64)
            acc_n += lj
            acc_p += (lj + align - 1) // align * align
        before_n = tl.sum(acc_n, 0)
        before_p = tl.sum(acc_p, 0)
        n = tl.load(lengths + i).to(tl.int64)
        if MODE == 1:
            p = (n + align - 1) // align * align + tl.where(i == last_row, last_extra, 0)
            start = before_p // CP
            c = p // (2 * CP)
        elif MODE == 2:
            p = n * 0 + width
            start = i.to(tl.int64) * width
            c = p
        else:
            p = n
            start = before_n
            c = p
        tl.store(cu + i + 1, (before_n + n).to(tl.int32))
        if MODE == 1:
            tl.store(cu_padded + i + 1, (before_p + p).to(tl.int32))
        if i == 0:
            tl.store(cu, 0)
            if MODE == 1:
                tl.store(cu_padded, 0)

        # Real tokens, in the order of the mask row.
        row = i.to(tl.int64) * s
        seen = tl.sum(tl.zeros((BLOCK_S,), dtype=tl.int64), 0)
        for c0 in range(0, s, BLOCK_S):
            cols = c0 + tl.arange(0, BLOCK_S)
            inside = cols < s
            real = tl.load(mask + row + cols, mask=inside, other=0) != 0
            ones = real.to(tl.int64)
            q = seen + tl.cumsum(ones, 0) - 1
            seen += tl.sum(ones, 0)
            dest = _dest(q, start, c, local, MODE, CP)
            real = real & (q < p) & (dest < n_fwd)  # in bounds even if the lengths were wrong
            tl.store(inverse + row + cols, tl.where(real, dest, -1), mask=inside)
            tl.store(fwd + dest, row + cols, mask=inside & real)
            if MODE == 2:
                tl.store(row_mask + dest, real, mask=inside & real)

        # The layout's padding slots, then (THD) this rank's positions.
        if MODE != 0:
            for q0 in range(0, (p - n).to(tl.int32), BLOCK_S):
                q = n + q0 + tl.arange(0, BLOCK_S)
                dest = _dest(q, start, c, local, MODE, CP)
                ok = (q < p) & (dest < n_fwd)
                tl.store(fwd + dest, -1, mask=ok)
                if MODE == 2:
                    tl.store(row_mask + dest, q < 0, mask=ok)
        if MODE == 1:
            mine = p // CP
            for u0 in range(0, mine.to(tl.int32), BLOCK_S):
                u = u0 + tl.arange(0, BLOCK_S)
                if CP == 1:
                    pos = u.to(tl.int64)
                else:
                    pos = tl.where(u < c, rank * c + u, (2 * CP - 1 - rank) * c + u - c)
                tl.store(positions + start + u, pos, mask=(u < mine) & (start + u < local))
