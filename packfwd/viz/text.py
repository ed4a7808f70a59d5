"""Plain-text pictures of layouts, for the demo, the command line and notebooks.

Tokens are named by sequence and position: ``a3`` is the 4th token of the first sequence, ``aa0`` the first token
of the 27th; ``.`` is padding.  The naming is public (:func:`token_codes`, :func:`token_names`) so every picture,
text or matplotlib, names tokens the same way.
"""

from __future__ import annotations

import string
from typing import Sequence

import numpy as np
import torch

from packfwd import ThdInfo, layer_partition, plan_thd
from packfwd.layout import default_seq_align, padded_lengths
from packfwd.layout.display import short_ints
from packfwd.layout.rules import verl_alignment

from .inputs import ThdFacts, host_lengths, thd_facts

__all__ = [
    "attention_work",
    "describe_layers",
    "describe_padding",
    "describe_thd",
    "lengths_mask",
    "padding_overhead",
    "padding_sweep",
    "sequence_name",
    "thd_plans",
    "token_codes",
    "token_names",
    "verl_seq_align",
]


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    return host_lengths(lengths, "lengths").tolist()


def _lengths_of(layout) -> list[int]:
    """The real lengths of any layout the pictures take (lengths, a mask, a plan, every rank's plans)."""
    return thd_facts(layout, arg="lengths").lengths.tolist()


def lengths_mask(lengths: Sequence[int], width: int | None = None) -> torch.Tensor:
    """A right-padded ``[b, s]`` bool mask with the given row lengths (``s``: ``width``, default the longest).

    >>> lengths_mask([2, 0, 3]).int().tolist()
    [[1, 1, 0], [0, 0, 0], [1, 1, 1]]
    """
    lengths = _check_lengths(lengths)
    s = max(lengths, default=0) if width is None else width
    return torch.arange(s)[None, :] < torch.tensor(lengths, dtype=torch.long)[:, None]


def sequence_name(i: int) -> str:
    """The letters naming sequence ``i`` (0-based): ``a`` .. ``z``, then ``aa``, ``ab``, ... (never reused).

    >>> [sequence_name(i) for i in (0, 25, 26, 27, 701, 702)]
    ['a', 'z', 'aa', 'ab', 'zz', 'aaa']
    """
    letters = string.ascii_lowercase
    name = ""
    i += 1
    while i:
        i, rest = divmod(i - 1, 26)
        name = letters[rest] + name
    return name


def token_codes(lengths: Sequence[int]) -> torch.Tensor:
    """``[b, s]`` int64 codes of a right-padded batch: token ``k`` of sequence ``i`` is ``1 + i * s + k``, padding
    is 0.  Pack them like any tensor and look the codes up in :func:`token_names`.

    >>> token_codes([3, 1]).tolist()
    [[1, 2, 3], [4, 0, 0]]
    """
    mask = lengths_mask(lengths)
    b, s = mask.shape
    codes = torch.arange(1, b * s + 1, dtype=torch.long).reshape(b, s)
    return codes * mask


def token_names(lengths: Sequence[int]) -> list[str]:
    """``names[code]``: the name of every code of :func:`token_codes` (``names[0] == "."``, padding).

    >>> names = token_names([3, 1])
    >>> [names[c] for c in token_codes([3, 1]).flatten().tolist()]
    ['a0', 'a1', 'a2', 'b0', '.', '.']
    """
    lengths = _check_lengths(lengths)
    s = max(lengths, default=0)
    return ["."] + [f"{sequence_name(i)}{k}" for i in range(len(lengths)) for k in range(s)]


def verl_seq_align(tp_size: int, cp_size: int) -> int:
    """verl's per-sequence alignment, the baseline the padding pictures compare with: ``2*tp*cp``, or ``tp``
    without CP (:func:`packfwd.layout.rules.verl_alignment`; packfwd's default is
    :func:`packfwd.default_seq_align`, the smallest Megatron-Core accepts).

    >>> verl_seq_align(2, 2), verl_seq_align(4, 1), default_seq_align(2)
    (8, 4, 4)
    """
    return verl_alignment(tp_size, cp_size).seq_align


def thd_plans(
    layout, *, tp_size: int | None = None, cp_size: int | None = None, seq_align: int | None = None
) -> list[ThdInfo]:
    """:func:`packfwd.plan_thd` for every CP rank in order, of sequence lengths (right-padded) or a ``[b, s]`` mask.

    >>> [info.local_tokens for info in thd_plans([5, 3], cp_size=2)]
    [6, 6]
    """
    if isinstance(layout, torch.Tensor) and layout.dim() == 2:
        mask = layout
    else:
        mask = lengths_mask(host_lengths(layout, "layout").tolist())
    sizes = dict(tp_size=tp_size or 1, cp_size=cp_size or 1, seq_align=seq_align)
    first = plan_thd(mask, cp_rank=0, **sizes)  # checks the sizes first
    return [first, *(plan_thd(mask, cp_rank=r, **sizes) for r in range(1, sizes["cp_size"]))]


_TOKEN_LIMIT = 96  # describe_thd names every token of a rank up to this many; beyond, each sequence's ranges
_SEQUENCE_LIMIT = 4  # and then at most this many sequences per rank


def describe_thd(layout, *, tp_size: int | None = None, cp_size: int | None = None,
                 seq_align: int | None = None, token_limit: int | None = _TOKEN_LIMIT) -> str:
    """Each CP rank's THD tensor for ``layout``: sequence lengths, a ``[b, s]`` mask, or a plan (a ``ThdInfo``,
    every rank's ``ThdInfo``, an ``UnpadInfo``; it brings its own sizes).  Token ``a3`` is the 4th token of the
    first sequence, ``.`` is padding, ``|`` separates sequences.  A rank of more than ``token_limit`` tokens (None:
    no limit) is shown as each sequence's position ranges instead (``a[0:20]+[140:160]``: the two zigzag chunks the
    rank holds), 4 sequences at most.

    >>> print(describe_thd([5, 3], cp_size=2))
    cu_seqlens         [0, 5, 8]
    cu_seqlens_padded  [0, 8, 12]   (align 4, max_seqlen 8, 12 tokens for 8 real: 4 pad)
    cp rank 0 (6 tokens): a0 a1 . . | b0 .
    cp rank 1 (6 tokens): a2 a3 a4 . | b1 b2
    """
    facts = thd_facts(layout, tp_size=tp_size, cp_size=cp_size, seq_align=seq_align)
    real, total = facts.real_tokens, facts.total_tokens
    longest = facts.max_seqlen

    def offsets(values: list[int]) -> str:  # all of them unless long (and the token names are limited)
        return str(values) if token_limit is None or len(str(values)) <= 100 else short_ints(values, 4)

    lines = [
        f"cu_seqlens         {offsets(facts.cu_seqlens)}",
        f"cu_seqlens_padded  {offsets(facts.cu_seqlens_padded)}   (align {facts.seq_align}, max_seqlen "
        f"{longest}, {total} tokens for {real} real: {total - real} pad)",
    ]
    for rank in range(facts.cp_size):
        lines.append(_rank_line(facts, rank, token_limit))
    return "\n".join(lines)


def _rank_line(facts: ThdFacts, rank: int, token_limit: int | None) -> str:
    seq, pos, real = facts.rank_tokens(rank)
    starts = np.searchsorted(seq, np.arange(facts.n + 1))  # each sequence's slice of this rank's tokens
    spans = [(i, a, b) for i, (a, b) in enumerate(zip(starts, starts[1:])) if b > a]
    head = f"cp rank {rank} ({facts.local_tokens} tokens"
    if token_limit is None or facts.local_tokens <= token_limit:
        parts = [" ".join(f"{sequence_name(i)}{q}" if r else "." for q, r in zip(pos[a:b], real[a:b]))
                 for i, a, b in spans]
        return f"{head}): " + " | ".join(parts)
    parts = []
    for i, a, b in spans[:_SEQUENCE_LIMIT]:
        half = (b - a) // 2 if facts.cp_size > 1 else b - a
        ranges = [(int(pos[k]), int(pos[k]) + half) for k in range(a, b, max(half, 1))]
        pad = int((~real[a:b]).sum())
        parts.append(sequence_name(i) + "+".join(f"[{x}:{y}]" for x, y in ranges) + (f" ({pad} pad)" if pad else ""))
    more = f" | ... {len(spans) - _SEQUENCE_LIMIT} more sequences" if len(spans) > _SEQUENCE_LIMIT else ""
    return f"{head}, {int(real.sum())} real): " + " | ".join(parts) + more


def attention_work(layout, *, tp_size: int | None = None, cp_size: int | None = None,
                   seq_align: int | None = None) -> dict[str, list[int]]:
    """Causal attention work of every CP rank, zigzag (packfwd's split) against the same padded sequences cut into
    ``cp`` contiguous pieces: the sum over the rank's real tokens of ``position + 1`` (the keys each attends to).

    >>> attention_work([16], cp_size=2)   # chunks of 4: rank 0 holds positions 0-3 and 12-15
    {'zigzag': [68, 68], 'contiguous': [36, 100]}
    """
    facts = thd_facts(layout, tp_size=tp_size, cp_size=cp_size, seq_align=seq_align)
    n, p, cp = facts.lengths, facts.padded, facts.cp_size

    def keys(a, b):  # sum of q + 1 over real positions q in [a, b)
        lo, hi = np.minimum(a, n), np.minimum(b, n)
        return int((hi * (hi + 1) // 2 - lo * (lo + 1) // 2).sum())

    chunk = facts.chunk()
    zigzag = [0] * cp
    for k in range(2 * cp if cp > 1 else 1):
        zigzag[facts.chunk_owner(k)] += keys(k * chunk, (k + 1) * chunk)
    contiguous = [keys(r * p // cp, (r + 1) * p // cp) for r in range(cp)]
    return {"zigzag": zigzag, "contiguous": contiguous}


def padding_overhead(lengths, *, tp_size: int, cp_size: int) -> dict[str, int]:
    """Total THD tokens with packfwd's default alignment and with verl's (:func:`verl_seq_align`).  ``lengths``:
    sequence lengths, a ``[b, s]`` mask or a plan (its lengths).

    >>> padding_overhead([5, 17, 3, 9], tp_size=2, cp_size=2)
    {'real': 34, 'packfwd': 44, 'verl': 56}
    """
    row = padding_sweep(_lengths_of(lengths), [tp_size], [cp_size])[0]
    return {name: row[name] for name in ("real", "packfwd", "verl")}


def describe_padding(
    lengths, *, tp_size: int | None = None, cp_size: int | None = None, seq_align: int | None = None
) -> str:
    """How many THD tokens the batch takes with ``seq_align`` (default: packfwd's smallest alignment) and
    with verl's (:func:`verl_seq_align`), and how many of those are padding.  ``lengths``: sequence lengths or a
    ``[b, s]`` mask (with ``tp_size``, ``cp_size``, ``seq_align``; defaults 1, 1 and packfwd's alignment), or a plan,
    which brings its own sizes (:mod:`packfwd.viz.inputs`).

    >>> print(describe_padding([5, 17, 3], tp_size=2, cp_size=2))
    real tokens          25
    packfwd (align 4)    32 tokens,  7 pad (28.0%)
    verl    (align 8)    40 tokens, 15 pad (60.0%)
    """
    facts = thd_facts(lengths, tp_size=tp_size, cp_size=cp_size, seq_align=seq_align, arg="lengths")
    tp, cp, real = facts.tp_size, facts.cp_size, facts.real_tokens
    verl_align = verl_seq_align(tp, cp)
    verl = int(padded_lengths(facts.lengths, seq_align=verl_align, tp_size=tp, cp_size=cp).sum()) if facts.n else 0
    chosen = seq_align is not None or facts.seq_align != default_seq_align(cp)
    rows = [("chosen" if chosen else "packfwd", facts.seq_align, facts.total_tokens), ("verl", verl_align, verl)]
    width = len(str(max(facts.total_tokens, verl)))
    pad_width = len(str(max(facts.total_tokens, verl) - real))
    lines = [f"real tokens          {real:>{width}}"]
    for label, align, total in rows:
        pad = total - real
        share = f" ({100 * pad / real:.1f}%)" if real else ""
        head = f"{label:<7} (align {align})"
        lines.append(f"{head:<20} {total:>{width}} tokens, {pad:>{pad_width}} pad{share}")
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
    """The stage-by-layer table of :func:`packfwd.layer_partition`: the global layers (inclusive ranges)
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


def padding_sweep(lengths, tps: Sequence[int], cps: Sequence[int]) -> list[dict[str, int]]:
    """:func:`padding_overhead` for every ``(tp, cp)`` in ``tps x cps`` (tp-major), without building a plan:
    the padded lengths follow from the lengths alone, so a sweep over a large batch stays instant.  ``lengths``:
    sequence lengths, a ``[b, s]`` mask or a plan (its lengths).

    Each row: ``{"tp", "cp", "real", "packfwd", "verl"}`` (total THD tokens, all CP ranks together).

    >>> for row in padding_sweep([5, 17, 3], tps=[1, 2], cps=[2]):
    ...     print(row)
    {'tp': 1, 'cp': 2, 'real': 25, 'packfwd': 32, 'verl': 32}
    {'tp': 2, 'cp': 2, 'real': 25, 'packfwd': 32, 'verl': 40}
    """
    lens = torch.tensor(_lengths_of(lengths), dtype=torch.long)
    for name, sizes, example in (("tps", tps, "[1, 2, 4]"), ("cps", cps, "[1, 2]")):
        bad = [v for v in sizes if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise ValueError(f"{name} holds {bad}: every {name[:-1]}_size must be an int >= 1, e.g. {name}={example}")
    rows = []
    for tp in tps:
        for cp in cps:
            row = {"tp": tp, "cp": cp, "real": int(lens.sum())}
            for name, align in (("packfwd", default_seq_align(cp)), ("verl", verl_seq_align(tp, cp))):
                row[name] = int(padded_lengths(lens, seq_align=align, tp_size=tp, cp_size=cp).sum())
            rows.append(row)
    return rows
