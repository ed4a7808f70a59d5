"""How packfwd's plans print: a few lines of counts, shapes and dtypes (``__repr__``) and, in a notebook, a small
table with a picture (``_repr_html_``), as equinox's tree printing shows a structure rather than its numbers.  A
``ThdInfo`` of 256 sequences prints 9 lines, not its ``index`` / ``inverse`` tensors.

For people only: the plans' ``__repr__`` / ``_repr_html_`` call these, and nothing on a traced, compiled or vmapped
path does.  Printing reads the small per-sequence tensors (``cu_seqlens``, the real lengths) back to the host in one
transfer; inside ``torch.compile``'s tracing, or for a tensor that cannot be read (a fake tensor), it shows shapes
only.  Used by the layout plans here and by ``MicroBatchPlan`` and ``RoutingStats``; the rest of the HTML helpers
(``html_table``, ``svg_rows``, ``svg_bars``) are generic.
"""

from __future__ import annotations

import html
import statistics
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from . import rules

__all__ = [
    "host_lists", "short_ints", "spread", "tensor_text", "percent", "block", "html_table", "svg_rows", "svg_bars",
    "PALETTE", "PAD", "source_text", "thd_rank_shares", "describe_plan", "plan_html",
]

# tab10 (matplotlib's default cycle): sequences by index, ranks by rank; PAD: padding
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf"]
PAD = "#e4e4e4"


def host_lists(*tensors: Tensor | None, dtype: torch.dtype = torch.long) -> list[list] | None:
    """Each tensor's values as a flat host list, read back in one transfer (None entries give None); None when the
    values cannot be read without tracing: under ``torch.compile``, or for fake and meta tensors.

    >>> host_lists(torch.tensor([0, 3]), None, torch.tensor([[1, 2]]))
    [[0, 3], None, [1, 2]]
    """
    if torch.compiler.is_compiling():
        return None
    tensors = [t if t is None or isinstance(t, Tensor) else torch.as_tensor(t) for t in tensors]
    present = [t for t in tensors if t is not None]
    try:
        devices = {t.device for t in present}
        if any(d.type == "meta" for d in devices):
            return None
        if len(devices) > 1:
            present = [t.cpu() for t in present]
        flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in present]).tolist() if present else []
    except (RuntimeError, NotImplementedError, TypeError):  # a fake tensor, a functorch wrapper
        return None
    out, start, it = [], 0, iter(present)
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        n = next(it).numel()
        out.append(flat[start : start + n])
        start += n
    return out


def short_ints(values: Sequence, edge: int = 3) -> str:
    """``values`` in full when short, else the first and last ``edge`` with ``...`` between.

    >>> short_ints([0, 5, 22, 25]), short_ints(range(0, 100, 10))
    ('[0, 5, 22, 25]', '[0, 10, 20, ..., 70, 80, 90]')
    """
    values = list(values)
    if len(values) <= 2 * edge + 1:
        return "[" + ", ".join(_num(v) for v in values) + "]"
    head, tail = (", ".join(_num(v) for v in part) for part in (values[:edge], values[-edge:]))
    return f"[{head}, ..., {tail}]"


def _num(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) and not float(v).is_integer() else str(int(v))


def spread(values: Sequence) -> str:
    """``min / median / max`` of numbers (``-`` for none).

    >>> spread([5, 17, 3, 9])
    'min 3 / median 7 / max 17'
    """
    values = list(values)
    if not values:
        return "-"
    return f"min {_num(min(values))} / median {_num(float(statistics.median(values)))} / max {_num(max(values))}"


def tensor_text(t) -> str:
    """A tensor as dtype, shape and (off the CPU) device: ``int32[257]``, ``bool[4, 17] cuda:0``.

    >>> tensor_text(torch.zeros(4, 17, dtype=torch.bool)), tensor_text(None)
    ('bool[4, 17]', 'None')
    """
    if not isinstance(t, Tensor):
        return repr(t)
    text = f"{str(t.dtype).removeprefix('torch.')}[{', '.join(map(str, t.shape))}]"
    if t.is_nested:
        text = "nested " + text.replace("None", "j")
    if t.device.type != "cpu":
        text += f" {t.device}"
    return text + (" (grad)" if t.requires_grad else "")


def percent(part: float, whole: float) -> str:
    """``part`` as a percentage of ``whole`` (one decimal).

    >>> percent(1, 8), percent(0, 0)
    ('12.5%', '0.0%')
    """
    return f"{100 * part / whole:.1f}%" if whole else "0.0%"


def block(name: str, lines: Sequence[str]) -> str:
    """``name(`` then one indented line per entry, each ending with a comma, then ``)``."""
    return "\n".join([f"{name}(", *(f"  {line}," for line in lines), ")"])


# ------------------------------------------------------------------------------------------------------ HTML


def html_table(title: str, rows: Sequence[tuple[str, str]], picture: str = "", note: str = "") -> str:
    """A small HTML block: a bold title, a two-column table of ``(name, value)`` and a picture (SVG) beside it."""
    esc = html.escape
    cells = "".join(
        f"<tr><td style='text-align:left;padding:1px 8px 1px 0'><code>{esc(k)}</code></td>"
        f"<td style='text-align:left;padding:1px 0'>{esc(v)}</td></tr>" for k, v in rows
    )
    foot = f"<div style='color:#666;font-size:85%'>{esc(note)}</div>" if note else ""
    return (f"<div style='display:flex;gap:16px;align-items:flex-start'><div><b>{esc(title)}</b>"
            f"<table style='font-size:90%;border-collapse:collapse'>{cells}</table>{foot}</div>"
            f"<div>{picture}</div></div>")


def svg_rows(rows: Sequence[Sequence[tuple[float, str]]], labels: Sequence[str], *, width: int = 320,
             height: int = 14, bold: int | None = None) -> str:
    """Horizontal bars, one per row: ``rows[i]`` is a list of ``(length, colour)`` segments laid end to end, all
    rows on one scale.  Segments are merged per pixel (at most ``width`` rectangles a row), so any batch stays small.
    ``bold``: the row whose label is bold (this plan's rank)."""
    longest = max((sum(w for w, _ in row) for row in rows), default=0) or 1
    scale, left = width / longest, 9 + 7 * max((len(s) for s in labels), default=0)
    parts = []
    for i, (row, label) in enumerate(zip(rows, labels)):
        y = i * (height + 3)
        weight = "bold" if i == bold else "normal"
        parts.append(f"<text x='{left - 6}' y='{y + height - 3}' font-size='11' text-anchor='end' "
                     f"font-weight='{weight}' font-family='monospace'>{html.escape(label)}</text>")
        start, runs = 0.0, []
        for length, colour in row:
            x0, x1 = round(start * scale), round((start + length) * scale)
            start += length
            if x1 <= x0:
                continue
            if runs and runs[-1][2] == colour and runs[-1][1] == x0:
                runs[-1][1] = x1
            else:
                runs.append([x0, x1, colour])
        parts += [f"<rect x='{left + a}' y='{y}' width='{b - a}' height='{height}' fill='{c}'/>" for a, b, c in runs]
    total_h = len(rows) * (height + 3)
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{left + width + 4}' height='{total_h}'>"
            + "".join(parts) + "</svg>")


def svg_bars(values: Sequence[float], *, width: int = 320, height: int = 60, colour: str = PALETTE[0]) -> str:
    """Vertical bars of ``values`` (a histogram-like strip, e.g. tokens per expert), with a dashed line at the mean."""
    values = [max(float(v), 0.0) for v in values]
    top = max(values, default=0.0) or 1.0
    step = width / max(len(values), 1)
    bars = "".join(
        f"<rect x='{i * step:.1f}' y='{height - v / top * height:.1f}' width='{max(step - 1, 0.5):.1f}' "
        f"height='{v / top * height:.1f}' fill='{colour}'/>" for i, v in enumerate(values)
    )
    mean = height - (sum(values) / len(values) / top * height if values else 0)
    line = f"<line x1='0' x2='{width}' y1='{mean:.1f}' y2='{mean:.1f}' stroke='black' stroke-dasharray='3,2'/>"
    return f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}'>{bars}{line}</svg>"


# ------------------------------------------------------------------------------------------ the layout plans


def source_text(source) -> str:
    """Where a plan's tokens come from: the caller's mask (dtype, shape) or a nested tensor's offsets."""
    if source.mask is not None:
        return f"padded batch, mask {tensor_text(source.mask)}"
    return f"nested batch of {source.batch_size} rows, offsets {tensor_text(source.nested_offsets)}"


def thd_rank_shares(lengths: np.ndarray, cu_padded: np.ndarray, cp_size: int, cp_rank: int):
    """``(real [n, 2], chunk [n])``: the real tokens in each of the two zigzag chunks rank ``cp_rank`` holds of every
    sequence (one chunk, the whole sequence, without CP: then the second column is 0), and the chunk size."""
    share = np.diff(cu_padded // cp_size)  # this rank's tokens of each sequence
    if cp_size == 1:
        return np.stack([np.minimum(lengths, share), np.zeros_like(share)], 1), share
    chunk = rules.chunk_size(share, 1)  # two chunks per rank: (p / cp) / 2
    starts = [rules.zigzag_position(u, chunk, cp_size, cp_rank) for u in (0 * chunk, chunk)]
    real = np.stack([np.clip(lengths - s, 0, chunk) for s in starts], 1)
    return real, chunk


def _facts(plan) -> dict | None:
    """The plan's per-sequence facts on the host (one transfer), or None when they cannot be read."""
    cu_padded = getattr(plan, "cu_seqlens_padded", None)
    read = host_lists(plan.cu_seqlens, cu_padded)
    if read is None:
        return None
    cu = np.asarray(read[0], dtype=np.int64)
    facts = {"cu": cu, "lengths": np.diff(cu)}
    if cu_padded is not None:
        facts["cu_padded"] = np.asarray(read[1], dtype=np.int64)
    return facts


def _plan_rows(plan, facts) -> list[tuple[str, str]]:
    """``(field, text)`` lines of a plan's summary; an empty field: a line of derived facts."""
    name, src = type(plan).__name__, plan.source
    if facts is None:
        rows = [("", f"{src.batch_size} rows (values not read while tracing)"),
                ("cu_seqlens", tensor_text(plan.cu_seqlens))]
    else:
        rows = [("", f"{len(facts['lengths'])} sequences, {int(facts['cu'][-1])} real tokens, lengths "
                     f"{spread(facts['lengths'].tolist())}"),
                ("cu_seqlens", f"{tensor_text(plan.cu_seqlens)} {short_ints(facts['cu'].tolist())}")]
    if name == "UnpadInfo":
        slots = src.batch_size * src.seq_len if src.mask is not None else src.total
        rows += [("max_seqlen", f"{plan.max_seqlen}, t={plan.total} of {slots} slots of [b={src.batch_size}, "
                                f"s={src.seq_len}] ({percent(slots - plan.total, slots)} padding removed)"),
                 ("index", f"{tensor_text(plan.index)}, inverse={tensor_text(plan.inverse)}")]
    elif name == "ThdInfo":
        rows += _thd_rows(plan, facts)
    else:  # BshdInfo
        slots = src.batch_size * plan.width
        rows += [("width", f"{plan.width}, tp_size={plan.tp_size}: [b={src.batch_size}, s={src.seq_len}] -> "
                           f"[{src.batch_size}, {plan.width}], {src.total} real of {slots} slots "
                           f"({percent(slots - src.total, slots)} padding)"),
                 ("attention_mask", f"{tensor_text(plan.attention_mask)}, index={tensor_text(plan.index)}, "
                                    f"inverse={tensor_text(plan.inverse)}")]
    return rows + [("source", source_text(src))]


def _thd_rows(p, facts) -> list[tuple[str, str]]:
    padded = f" {short_ints(facts['cu_padded'].tolist())}" if facts is not None else ""
    rows = [("cu_seqlens_padded", tensor_text(p.cu_seqlens_padded) + padded),
            ("tp_size", f"{p.tp_size}, cp_size={p.cp_size}, cp_rank={p.cp_rank}, seq_align={p.seq_align}")]
    if facts is None:
        return rows + [("max_seqlen", f"{p.max_seqlen}, total_tokens={p.total_tokens}, "
                                      f"local_tokens={p.local_tokens}")]
    real = int(facts["cu"][-1])
    shares, _ = thd_rank_shares(facts["lengths"], facts["cu_padded"], p.cp_size, p.cp_rank)
    mine = int(shares.sum())
    return rows + [
        ("max_seqlen", f"{p.max_seqlen}, total_tokens={p.total_tokens} ({p.total_tokens - real} pad, "
                       f"{percent(p.total_tokens - real, p.total_tokens)})"),
        ("local_tokens", f"{p.local_tokens} per CP rank (this rank: {mine} real, {p.local_tokens - mine} pad)"),
        ("index", f"{tensor_text(p.index)}, inverse={tensor_text(p.inverse)}, "
                  f"local_positions={tensor_text(p.local_positions)}"),
    ]


def describe_plan(plan) -> str:
    """The ``repr`` of ``UnpadInfo``, ``ThdInfo`` and ``BshdInfo``: counts, ``cu_seqlens`` and shapes, under ten
    lines whatever the batch size."""
    rows = _plan_rows(plan, _facts(plan))
    return block(type(plan).__name__, [f"{k}={v}" if k else v for k, v in rows])


def plan_html(plan) -> str:
    """The ``_repr_html_`` of the layout plans: the repr's lines as a table, and a picture of the packed tokens
    coloured by sequence, padding grey; for THD one bar per CP rank (this plan's rank in bold)."""
    name, facts = type(plan).__name__, _facts(plan)
    rows = _plan_rows(plan, facts)
    if facts is None:
        return html_table(name, rows)
    lengths = facts["lengths"]
    colour = [PALETTE[i % len(PALETTE)] for i in range(len(lengths))]
    if name == "ThdInfo":
        bars = []
        for r in range(plan.cp_size):
            real, chunk = thd_rank_shares(lengths, facts["cu_padded"], plan.cp_size, r)
            halves = [0] if plan.cp_size == 1 else [0, 1]
            bars.append([seg for i in range(len(lengths)) for h in halves
                         for seg in ((real[i, h], colour[i]), (chunk[i] - real[i, h], PAD))])
        picture = svg_rows(bars, [f"rank {r}" for r in range(plan.cp_size)], bold=plan.cp_rank)
        note = "each CP rank's tokens, coloured by sequence; grey: padding"
    elif name == "BshdInfo":
        shown = min(len(lengths), 16)
        picture = svg_rows([[(n, colour[i]), (plan.width - n, PAD)] for i, n in enumerate(lengths[:shown])],
                           [f"row {i}" for i in range(shown)], height=8)
        note = f"rows 0-{shown - 1} of {len(lengths)}" if shown < len(lengths) else "each row: real tokens, padding"
    else:
        picture = svg_rows([[(n, colour[i]) for i, n in enumerate(lengths)]], ["t"])
        note = "the packed tokens, coloured by sequence"
    return html_table(name, rows, picture, note)
