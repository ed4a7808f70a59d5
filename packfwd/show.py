"""Plain-text pictures of layouts, for the demo, the command line and notebooks."""

from __future__ import annotations

import string
from typing import Sequence

import torch

from .thd import plan_thd, to_thd


def lengths_mask(lengths: Sequence[int], width: int | None = None) -> torch.Tensor:
    """A right-padded ``[b, s]`` bool mask with the given row lengths."""
    s = max(lengths, default=0) if width is None else width
    return torch.arange(s)[None, :] < torch.tensor(list(lengths), dtype=torch.long)[:, None]


def _token_names(lengths: Sequence[int]) -> torch.Tensor:
    """[b, s] codes: sequence i's k-th token is 1000*(i+1) + k."""
    s = max(lengths, default=0)
    return torch.tensor([[1000 * (i + 1) + k for k in range(s)] for i in range(len(lengths))], dtype=torch.long)


def _name(code: int) -> str:
    if code == 0:
        return "."
    seq, k = divmod(code, 1000)
    letters = string.ascii_lowercase
    return f"{letters[(seq - 1) % 26]}{k}"


def describe_thd(lengths: Sequence[int], *, tp_size: int = 1, cp_size: int = 1, seq_align: int | None = None) -> str:
    """Each CP rank's THD tensor for sequences of the given lengths: token ``a3`` is the 4th token of the first
    sequence, ``.`` is padding, ``|`` separates sequences.

    >>> print(describe_thd([5, 3], cp_size=2))
    cu_seqlens         [0, 5, 8]
    cu_seqlens_padded  [0, 8, 12]   (align 4, max_seqlen 8, 12 tokens for 8 real: 4 pad)
    cp rank 0 (6 tokens): a0 a1 . . | b0 .
    cp rank 1 (6 tokens): a2 a3 a4 . | b1 b2
    """
    mask = lengths_mask(lengths)
    ids = _token_names(lengths)
    lines = []
    for rank in range(cp_size):
        info = plan_thd(mask, tp_size=tp_size, cp_size=cp_size, cp_rank=rank, seq_align=seq_align)
        if rank == 0:
            real = sum(lengths)
            lines.append(f"cu_seqlens         {info.cu_seqlens.tolist()}")
            lines.append(
                f"cu_seqlens_padded  {info.cu_seqlens_padded.tolist()}   (align {info.seq_align}, max_seqlen "
                f"{info.max_seqlen}, {info.total_tokens} tokens for {real} real: {info.total_tokens - real} pad)"
            )

        tokens = to_thd(ids, info)[0].tolist()
        bounds = info.local_cu_seqlens_padded.tolist()
        parts = [" ".join(_name(c) for c in tokens[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]
        lines.append(f"cp rank {rank} ({info.local_tokens} tokens): " + " | ".join(parts))
    return "\n".join(lines)


def padding_overhead(lengths: Sequence[int], *, tp_size: int, cp_size: int) -> dict[str, int]:
    """Total THD tokens with packfwd's default alignment and with verl's (``2*tp*cp``, or ``tp`` without CP)."""
    mask = lengths_mask(lengths)
    verl_align = 2 * tp_size * cp_size if cp_size > 1 else tp_size
    ours = plan_thd(mask, tp_size=tp_size, cp_size=cp_size).total_tokens
    verl = plan_thd(mask, tp_size=tp_size, cp_size=cp_size, seq_align=verl_align).total_tokens
    return {"real": sum(lengths), "packfwd": ours, "verl": verl}
