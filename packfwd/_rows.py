"""Row gathers shared by every layout, and the host <-> device transfers of planning.

Every packfwd layout moves whole rows (tokens) of a flattened ``[rows, *]`` tensor, and every move is one gather::

    out[i] = src[index[i]]   if index[i] >= 0,   else fill_value

with ``index`` fixed by the plan (``-1`` marks a padding row of the new layout).  The inverse move is the same
gather with the inverse index, so applying a plan reads each real row once and writes each output row once, and
the backward pass of a gather is again a gather (``inverse`` read the other way round).

Two implementations compute it bit for bit alike:

* on CUDA, for sources of at least ``KERNEL_MIN_BYTES``, one Triton kernel behind the custom op
  ``packfwd::gather_rows`` (see ``_gather_op``): a single pass at memory bandwidth;
* everywhere else, plain torch in one to three small ops (see ``gather_rows_torch``): cheaper than a kernel
  launch for small tensors, and the reference.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from . import _gather_op

# Sources smaller than this take the torch path on CUDA too: for them launch overhead, not bytes, is the cost
# (measured on an H200: the kernel wins from about 64 MiB; benchmarks/RESULTS.md).
KERNEL_MIN_BYTES = 64 << 20


def gather_rows(
    srcs: Sequence[Tensor], index: Tensor, inverse: Tensor, fill_value: float = 0, *, inverse_offset: int = 0,
    dense: bool = False, expand: bool = False,
) -> Tensor:
    """``out[i] = cat(srcs)[index[i]]`` (``fill_value`` where ``index[i] == -1``).  srcs: k x [n, *] -> [len(index), *].

    ``inverse`` is the inverse map (``index[inverse[j] - inverse_offset] == j`` wherever that is in range, -1
    elsewhere): the custom op's backward pass gathers through it, and the torch path scatters through it when
    that is cheaper.  ``dense``: ``index`` has no -1 (nothing to fill).  ``expand``: the move back to a larger
    layout (pad, from_thd, from_bshd), whose ``inverse`` sends every source row to a row of this output or -1.
    """
    if use_op(srcs[0]):
        return _gather_op.gather_rows(srcs, index, inverse, fill_value, inverse_offset=inverse_offset)
    return gather_rows_torch(srcs, index, inverse, fill_value, dense=dense, expand=expand)


def use_op(src: Tensor) -> bool:
    """Whether a gather from ``src`` goes through the custom op (CUDA, Triton installed, large enough)."""
    return src.is_cuda and _gather_op.kernel_available() and src.numel() * src.element_size() >= KERNEL_MIN_BYTES


def gather_rows_torch(
    srcs: Sequence[Tensor], index: Tensor, inverse: Tensor, fill_value: float = 0, *, dense: bool = False,
    expand: bool = False,
) -> Tensor:
    """The same gather in one to three plain torch ops (autograd, vmap and compile native).

    Dense: one index.  Expand (pad, from_thd, from_bshd): the sources scattered into a filled canvas through
    ``inverse``, -1 landing in a spare row that is cut off.  Otherwise: the sources with one fill row appended,
    indexed (-1 picks the fill row).
    """
    src = srcs[0] if len(srcs) == 1 else torch.cat(list(srcs))
    if dense:
        return src[index]
    n = index.shape[0]
    if expand:
        canvas = src.new_full((n + 1, *src.shape[1:]), fill_value)
        canvas.index_put_((inverse,), src)  # index_put_ (unlike index_copy_) has a vmap batching rule
        return canvas[:n]
    fill = src.new_full((1, *src.shape[1:]), fill_value)
    return torch.cat([src, fill])[index]


def to_host(values: Tensor) -> np.ndarray:
    """A 1-D device tensor as a host int64 array: the planning step's single sync (free for CPU tensors)."""
    return values.cpu().numpy().astype(np.int64, copy=False)


def to_device(host: np.ndarray, device: torch.device) -> Tensor:
    """Upload a small host int64 array without a sync: through pinned memory, asynchronously."""
    t = torch.from_numpy(host)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def cumsum0(lengths: np.ndarray) -> np.ndarray:
    """``[0, l0, l0+l1, ...]`` (host int64)."""
    out = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out
