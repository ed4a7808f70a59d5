"""Planning on CUDA in one Triton kernel: every per-token map of a layout, from the mask and the row lengths.

The torch planning path launches a dozen small kernels after its sync; planning is bound by those launches, not
by the GPU.  Here one program per row finds where its sequence starts from the lengths of the rows before it
(each program reads them all: O(b) loads, nothing next to the launches this saves), walks its mask row once to
place its real tokens (a running cumsum gives each token's position in its sequence), then writes the layout's
padding slots, and for THD this rank's positions.  Results are identical to the torch path (tested on the GPU).

Layouts (``MODE``):
  UNPAD  token q of row i -> packed row cu[i] + q
  BSHD   token q of row i -> slot i * width + q; slots q >= len_i are padding; also the [b, width] mask
  THD    token q of row i -> owner(k) * local + start_i + (k >= cp) * c_i + q - k * c_i with k = q // c_i (the
         CP zigzag; cp = 1: start_i + q); slots len_i <= q < p_i are padding; also this rank's positions
"""

from __future__ import annotations

import torch
from torch import Tensor

UNPAD, THD, BSHD = 0, 1, 2


def _kernel():
    from ._triton_kernels import plan_rows_kernel

    return plan_rows_kernel


def available(mask: Tensor) -> bool:
    """Whether this mask can be planned by the kernel (CUDA, Triton installed, non-empty)."""
    from ._gather_op import kernel_available

    return mask.is_cuda and mask.numel() > 0 and kernel_available()


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
    _kernel()[(b,)](
        mask, lengths, parts[0], parts[1], positions, row_mask, cu, cu[b + 1 :] if mode == THD else cu,
        s, total, local, rank, b - 1, last_extra, width, align,
        MODE=mode, CP=cp, BLOCK_B=256, BLOCK_S=1024, num_warps=4,
    )
    out = {"inverse": parts[0], "index": parts[1], "cu_seqlens": cu[: b + 1]}
    if mode == THD:
        out["cu_seqlens_padded"] = cu[b + 1 :]
        out["positions"] = parts[2]
    if mode == BSHD:
        out["attention_mask"] = row_mask.view(b, width)
    return out
