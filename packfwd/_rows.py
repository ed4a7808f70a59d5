"""Row gathers shared by every layout, and the host <-> device transfers of planning.

Every packfwd layout moves whole rows (tokens) of a flattened ``[rows, *]`` tensor, and every move is one gather::

    out[i] = src[index[i]]   if index[i] >= 0,   else fill_value

with ``index`` fixed by the plan (``-1`` marks a padding row of the new layout).  The inverse move is the same
gather with the inverse index, so applying a plan reads each real row once and writes each output row once, and
the backward pass of a gather is again a gather (``inverse`` read the other way round).

Two implementations compute it bit for bit alike:

* on CUDA, for tensors of at least ``KERNEL_MIN_BYTES``, one Triton kernel behind the custom op
  ``packfwd::gather_rows`` (see ``_gather_op``): a single pass at memory bandwidth;
* everywhere else, plain torch: the sources and one fill row concatenated, then indexed (``-1`` picks the
  fill row).  That is three small ops, cheaper than the custom op for small tensors, and the reference.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from . import _gather_op

# Tensors smaller than this take the torch path on CUDA too: for them launch overhead, not bytes, is the cost.
KERNEL_MIN_BYTES = 1 << 22


def gather_rows(
    srcs: Sequence[Tensor], index: Tensor, inverse: Tensor, fill_value: float = 0, *, inverse_offset: int = 0
) -> Tensor:
    """``out[i] = cat(srcs)[index[i]]`` (``fill_value`` where ``index[i] == -1``).  srcs: k x [n, *] -> [len(index), *].

    ``inverse`` is the inverse map (``index[inverse[j] - inverse_offset] == j`` wherever that is in range, -1
    elsewhere); the custom op's backward pass gathers through it.  The torch path ignores it.
    """
    if use_op(srcs[0]):
        return _gather_op.gather_rows(srcs, index, inverse, fill_value, inverse_offset=inverse_offset)
    return gather_rows_torch(srcs, index, fill_value)


def use_op(src: Tensor) -> bool:
    """Whether a gather from ``src`` goes through the custom op (CUDA, Triton installed, large enough)."""
    return src.is_cuda and _gather_op.kernel_available() and src.numel() * src.element_size() >= KERNEL_MIN_BYTES


def gather_rows_torch(srcs: Sequence[Tensor], index: Tensor, fill_value: float = 0) -> Tensor:
    """The plain-torch gather: ``index == -1`` wraps to the appended fill row (autograd, vmap and compile native)."""
    src0 = srcs[0]
    fill = src0.new_full((1, *src0.shape[1:]), fill_value)
    return torch.cat([*srcs, fill])[index]


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
