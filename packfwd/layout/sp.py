"""``sp_pad`` / ``sp_unpad``: the token dimension padded to a multiple of the tensor-parallel size.

Megatron's sequence parallelism splits the token dimension evenly over the TP ranks, so it must divide by
``tp_size``.  (``to_thd`` already plans its layout so; ``sp_pad`` is for packed tensors made any other way.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._validate import check_positive_int, check_tensor


def sp_padded_len(num_tokens: int, tp_size: int) -> int:
    """``num_tokens`` rounded up to a multiple of ``tp_size``."""
    return -(-num_tokens // tp_size) * tp_size


def sp_pad(packed: Tensor, tp_size: int, fill_value: float = 0) -> Tensor:
    """``[t, *] -> [t', *]`` with ``t'`` the next multiple of ``tp_size``; the new rows hold ``fill_value``.

    >>> import torch
    >>> sp_pad(torch.arange(5), 4).tolist()
    [0, 1, 2, 3, 4, 0, 0, 0]
    >>> sp_unpad(sp_pad(torch.arange(5), 4), 5).tolist()
    [0, 1, 2, 3, 4]
    """
    check_tensor("packed", packed)
    tp_size = check_positive_int("tp_size", tp_size)
    if packed.dim() < 1:
        raise ValueError("packed must have a token dimension first ([t, *]); got a 0-d tensor")
    t = packed.shape[0]
    extra = sp_padded_len(t, tp_size) - t
    if extra == 0:
        return packed.clone()
    tail = packed.new_full((extra, *packed.shape[1:]), fill_value)
    return torch.cat([packed, tail])


def sp_unpad(padded: Tensor, num_tokens: int) -> Tensor:
    """The inverse of ``sp_pad``: the first ``num_tokens`` rows (a new tensor).

    >>> import torch
    >>> sp_unpad(torch.tensor([7, 8, 9, 0]), 3).tolist()
    [7, 8, 9]
    """
    check_tensor("padded", padded)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise TypeError(f"num_tokens must be a non-negative Python int (the token count before sp_pad), got {num_tokens!r}")
    if num_tokens > padded.shape[0]:
        raise ValueError(
            f"num_tokens={num_tokens} exceeds the padded length {padded.shape[0]}; pass the count sp_pad was given"
        )
    return padded[:num_tokens].clone()
