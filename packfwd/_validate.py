"""Argument checks shared by every package (the bottom floor: it imports no other packfwd module).  Each error
names the argument and the fix.  Also here, because every floor that takes a model needs it: :func:`unwrap`."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def check_positive_int(name: str, value: object, hint: str | None = None) -> int:
    """``value`` if it is an int >= 1; else an error naming ``name`` and the fix (``hint``, or: 1 turns that
    parallelism off)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__} {value!r}; pass {name}=int(...)")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}; {hint or f'use {name}=1 when that parallelism is off'}")
    return value


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a bool (not 0/1, a string or None: a flag that picks a path); else an error naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_rank(name: str, rank: object, size: int, size_name: str) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"{name} must be a Python int, got {type(rank).__name__}")
    if not 0 <= rank < size:
        raise ValueError(f"{name}={rank} is out of range for {size_name}={size}; pass a rank in [0, {size - 1}]")
    return rank


def cp_rank_for(cp_size: int, cp_rank: object) -> object:
    """``cp_rank``, or 0 where it was left out (None) and there is one CP rank; a plan of several CP ranks holds one
    rank's share of the tokens, so there it must be named."""
    if cp_rank is not None:
        return cp_rank
    if cp_size > 1:
        raise ValueError(f"cp_size={cp_size} needs cp_rank: a THD plan holds one context-parallel rank's share of the "
                         f"tokens; pass cp_rank= (this process's rank in the CP group, 0 to {cp_size - 1})")
    return 0


def check_tensor(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_mask(attention_mask: object, x: Tensor | None = None) -> Tensor:
    """Validate the mask's type, dtype, rank, shape and device; return it as bool ``[b, s]``.

    Values of integer masks are checked by the caller together with its one host sync (see ``mask_value_error``).
    """
    mask = check_tensor("attention_mask", attention_mask)
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(
            f"attention_mask has dtype {mask.dtype}; pass a bool mask, or an integer mask holding only 0 and 1 "
            "(for a float mask that holds 0/1, use attention_mask.bool())"
        )
    if mask.dtype != torch.bool and mask.dtype not in _INT_DTYPES:
        raise TypeError(f"attention_mask has dtype {mask.dtype}; pass a bool or integer 0/1 mask")
    if mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be 2-D [b, s], got shape {tuple(mask.shape)}; "
            "pass one row per sequence with one column per padded position"
        )
    if x is not None:
        if x.dim() < 2 or tuple(x.shape[:2]) != tuple(mask.shape):
            raise ValueError(
                f"x has shape {tuple(x.shape)} but attention_mask has shape {tuple(mask.shape)}; "
                "x must be [b, s, ...] with the same b and s as the mask"
            )
        if x.device != mask.device:
            raise ValueError(
                f"x is on {x.device} but attention_mask is on {mask.device}; move both to one device "
                "(e.g. attention_mask.to(x.device))"
            )
    return mask


def check_positions(position_ids: object, like: Tensor | None, *, coords: int | str | None = "any") -> Tensor:
    """``position_ids``: integer positions, one per token of ``like`` (the ``input_ids`` they go with): ``[*like]``,
    or ``[k, *like]`` with ``k`` position coordinates per token where ``coords`` allows it (``"any"``: any ``k``,
    for a forward that does not know its model; an int: that ``k``, a multimodal-RoPE model's 3; None: a model with
    1-D RoPE, no ``k``).  A jagged ``like`` takes jagged positions.  ``like=None`` (a pipeline stage that does not
    read the ids): the type, dtype and number of dims only.  The one positions check of ``make_forward`` and the
    models.

    >>> check_positions(torch.zeros(3, 2, 5, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long)).shape
    torch.Size([3, 2, 5])
    >>> check_positions(torch.zeros(3, 2, 5, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long), coords=None)
    Traceback (most recent call last):
    ...
    ValueError: position_ids has shape (3, 2, 5); this model uses 1-D RoPE and takes [b, s] (THD: [1, t]) positions. [k, b, s] multimodal positions need a multimodal-RoPE (vision-language) model
    """
    if not isinstance(position_ids, Tensor):
        raise TypeError(f"position_ids must be a tensor like input_ids, got {type(position_ids).__name__}")
    if position_ids.dtype == torch.bool or position_ids.dtype.is_floating_point or position_ids.dtype.is_complex:
        raise TypeError(f"position_ids has dtype {position_ids.dtype}; pass integer positions")
    if like is not None and like.is_nested:
        if not position_ids.is_nested:
            raise ValueError("input_ids is nested (jagged): pass position_ids as a nested tensor with the same offsets")
        return position_ids
    shape = tuple(position_ids.shape)
    want = tuple(like.shape) if like is not None else None
    plain = len(shape) == 2 and (want is None or shape == want)
    with_k = len(shape) == 3 and (want is None or shape[1:] == want) and coords in ("any", shape[0])
    if plain or with_k:
        return position_ids
    if coords == "any":
        raise ValueError(f"position_ids has shape {shape}; pass [b, s]{f' = {list(want)}' if want else ''} like "
                         "input_ids, or [k, b, s] for multimodal RoPE (k position components per token)")
    if coords is None and len(shape) != 2:
        raise ValueError(f"position_ids has shape {shape}; this model uses 1-D RoPE and takes [b, s] (THD: [1, t]) "
                         "positions. [k, b, s] multimodal positions need a multimodal-RoPE (vision-language) model")
    if coords is None:
        raise ValueError(f"position_ids has shape {shape} but input_ids {want}; pass one position per token")
    full = f"[{coords}, {', '.join(map(str, want))}]" if want is not None else f"[{coords}, b, s]"
    raise ValueError(f"position_ids has shape {shape}; this multimodal-RoPE model takes {full} (temporal, height, "
                     f"width per token; THD: [{coords}, 1, t]), or [b, s] for text")


MASK_VALUES_MESSAGE = (
    "attention_mask holds values other than 0 and 1; pass a bool mask or an integer mask of 0/1 "
    "(for example attention_mask.ne(0) if every nonzero entry means a real token)"
)


def check_host_seqlens(seqlens: object, batch: int) -> list[int]:
    """Validate caller-provided host lengths: a sequence (or CPU tensor) of ``batch`` non-negative ints."""
    if isinstance(seqlens, Tensor):
        if seqlens.device.type != "cpu":
            raise ValueError(
                "seqlens must live on the host (a list or a CPU tensor); it exists to avoid a device sync, "
                "so pass seqlens.tolist() computed where it is free, or leave seqlens=None"
            )
        seqlens = seqlens.tolist()
    if not isinstance(seqlens, Sequence) or not all(isinstance(v, int) and not isinstance(v, bool) for v in seqlens):
        raise TypeError("seqlens must be a list of Python ints (one real length per row)")
    if len(seqlens) != batch:
        raise ValueError(f"seqlens has {len(seqlens)} entries but the batch has {batch} rows; pass one length per row")
    if any(v < 0 for v in seqlens):
        raise ValueError("seqlens must be non-negative")
    return list(seqlens)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside wrappers that keep it as ``.module`` (DDP, Megatron's Float16Module, ...).

    >>> class Wrapper(torch.nn.Module):
    ...     def __init__(self, module):
    ...         super().__init__()
    ...         self.module = module
    >>> inner = torch.nn.Linear(2, 2)
    >>> unwrap(Wrapper(Wrapper(inner))) is inner
    True
    """
    seen = 0
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module) and seen < 8:
        model, seen = model.module, seen + 1
    return model
