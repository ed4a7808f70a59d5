"""Plain-text pictures of layouts, for the demo, the command line and notebooks."""

from __future__ import annotations

import string
from typing import Sequence

import torch

from .thd import plan_thd, to_thd


def lengths_mask(lengths: Sequence[int], width: int | None = None) -> torch.Tensor:
    """A right-padded ``[b, s]`` bool mask with the given row lengths.

    >>> lengths_mask([2, 0, 3]).int().tolist()
    [[1, 1, 0], [0, 0, 0], [1, 1, 1]]
    """
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
    """Total THD tokens with packfwd's default alignment and with verl's (``2*tp*cp``, or ``tp`` without CP).

    >>> padding_overhead([5, 17, 3, 9], tp_size=2, cp_size=2)
    {'real': 34, 'packfwd': 44, 'verl': 56}
    """
    mask = lengths_mask(lengths)
    verl_align = 2 * tp_size * cp_size if cp_size > 1 else tp_size
    ours = plan_thd(mask, tp_size=tp_size, cp_size=cp_size).total_tokens
    verl = plan_thd(mask, tp_size=tp_size, cp_size=cp_size, seq_align=verl_align).total_tokens
    return {"real": sum(lengths), "packfwd": ours, "verl": verl}


def describe_padding(
    lengths: Sequence[int], *, tp_size: int = 1, cp_size: int = 1, seq_align: int | None = None
) -> str:
    """How many THD tokens the batch takes with ``seq_align`` (default: packfwd's smallest alignment) and
    with verl's (``2*tp*cp``, or ``tp`` without CP), and how many of those are padding.

    >>> print(describe_padding([5, 17, 3], tp_size=2, cp_size=2))
    real tokens          25
    packfwd (align 4)    32 tokens,  7 pad (28.0%)
    verl    (align 8)    40 tokens, 15 pad (60.0%)
    """
    mask = lengths_mask(lengths)
    verl_align = 2 * tp_size * cp_size if cp_size > 1 else tp_size
    ours = plan_thd(mask, tp_size=tp_size, cp_size=cp_size, seq_align=seq_align)
    verl = plan_thd(mask, tp_size=tp_size, cp_size=cp_size, seq_align=verl_align)
    real = sum(lengths)
    rows = [("packfwd" if seq_align is None else "chosen", ours), ("verl", verl)]
    width = len(str(max(ours.total_tokens, verl.total_tokens)))
    pad_width = len(str(max(ours.total_tokens, verl.total_tokens) - real))
    lines = [f"real tokens          {real:>{width}}"]
    for label, info in rows:
        pad = info.total_tokens - real
        share = f" ({100 * pad / real:.1f}%)" if real else ""
        head = f"{label:<7} (align {info.seq_align})"
        lines.append(f"{head:<20} {info.total_tokens:>{width}} tokens, {pad:>{pad_width}} pad{share}")
    return "\n".join(lines)


def _layer_ranges(chunk: range) -> str:
    return f"{chunk.start}-{chunk.stop - 1}" if len(chunk) > 1 else f"{chunk.start}"


def describe_layers(
    num_layers: int,
    pp: int,
    vpp: int = 1,
    *,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> str:
    """The stage-by-layer table of :func:`packfwd.layers.layer_partition`: the global layers (inclusive ranges)
    every pipeline rank builds in each virtual stage, then a grid with one column per layer where a digit is the
    virtual stage holding that layer and ``.`` means another rank holds it.

    >>> print(describe_layers(8, pp=2, vpp=2))
    8 layers, pp=2, vpp=2
    pp rank  vpp 0  vpp 1  layers
    0        0-1    4-5    4
    1        2-3    6-7    4
    layer      01234567
    pp rank 0  00..11..
    pp rank 1  ..00..11
    """
    from .layers import layer_partition

    partition = layer_partition(
        num_layers, pp, vpp, first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers
    )
    cells = [[_layer_ranges(chunk) for chunk in chunks] for chunks in partition]
    width = max(len(f"vpp {vpp - 1}"), *(len(c) for row in cells for c in row)) + 2
    uneven = "".join(
        f", {name}={value}"
        for name, value in (("first_stage_layers", first_stage_layers), ("last_stage_layers", last_stage_layers))
        if value is not None
    )
    lines = [f"{num_layers} layers, pp={pp}, vpp={vpp}{uneven}"]
    lines.append("pp rank  " + "".join(f"{f'vpp {v}':<{width}}" for v in range(vpp)) + "layers")
    for rank, row in enumerate(cells):
        count = sum(len(chunk) for chunk in partition[rank])
        lines.append(f"{rank:<9}" + "".join(f"{c:<{width}}" for c in row) + f"{count}")
    owner = {layer: (rank, v) for rank, chunks in enumerate(partition) for v, c in enumerate(chunks) for layer in c}
    digit = string.digits + string.ascii_letters
    if num_layers > 10:
        tens = "".join(str(i // 10 % 10) if i % 10 == 0 else " " for i in range(num_layers))
        lines.append(("           " + tens).rstrip())
    lines.append("layer      " + "".join(str(i % 10) for i in range(num_layers)))
    for rank in range(pp):
        row = "".join(digit[owner[i][1] % len(digit)] if owner[i][0] == rank else "." for i in range(num_layers))
        lines.append(f"pp rank {rank:<3}" + row)
    return "\n".join(lines)


def padding_sweep(lengths: Sequence[int], tps: Sequence[int], cps: Sequence[int]) -> list[dict[str, int]]:
    """:func:`padding_overhead` for every ``(tp, cp)`` in ``tps x cps`` (tp-major), without building a plan:
    the padded lengths follow from the lengths alone, so a sweep over a large batch stays instant.

    Each row: ``{"tp", "cp", "real", "packfwd", "verl"}`` (total THD tokens, all CP ranks together).

    >>> for row in padding_sweep([5, 17, 3], tps=[1, 2], cps=[2]):
    ...     print(row)
    {'tp': 1, 'cp': 2, 'real': 25, 'packfwd': 32, 'verl': 32}
    {'tp': 2, 'cp': 2, 'real': 25, 'packfwd': 32, 'verl': 40}
    """
    from ._checks import check_positive_int
    from .thd import default_seq_align, padded_lengths

    lens = torch.tensor(list(lengths), dtype=torch.long)
    if (lens < 0).any():
        raise ValueError(f"lengths must be >= 0, got {list(lengths)}")
    rows = []
    for tp in tps:
        for cp in cps:
            check_positive_int("tp_size", tp)
            check_positive_int("cp_size", cp)
            row = {"tp": tp, "cp": cp, "real": int(lens.sum())}
            for name, align in (("packfwd", default_seq_align(cp)), ("verl", 2 * tp * cp if cp > 1 else tp)):
                row[name] = int(padded_lengths(lens, seq_align=align, tp_size=tp, cp_size=cp).sum())
            rows.append(row)
    return rows
