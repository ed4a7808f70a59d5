"""Tests for packfwd.viz.plot (Agg backend, no display).

Strategy: draw on plain ``matplotlib.figure.Figure`` axes, render with the Agg canvas, then read the artists
back: one patch per token or layer, hatched patches exactly where the padding is, cell positions and names
where a slicing reference (``tests/oracles.py``) or ranges written out by hand put them, bar heights equal to
pad counts computed with plain integer arithmetic.
"""

from __future__ import annotations

import io
import math
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from packfwd import layer_partition
from packfwd.viz.plot import draw_layer_partition, draw_mask, draw_thd, plot_padding_sweep

from .oracles import ref_padded_lengths, ref_thd_rank


def render(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue().startswith(b"\x89PNG")
    return buf.getvalue()


def cells(ax):
    """``{(x, y): patch}`` for the unit-square cells of a grid drawing."""
    out = {}
    for p in ax.patches:
        key = (round(p.get_x()), round(p.get_y()))
        assert key not in out, f"two cells at {key}"
        out[key] = p
    return out


def hatched(ax) -> set:
    return {key for key, p in cells(ax).items() if p.get_hatch()}


def test_draw_mask_hatches_exactly_the_padding():
    lengths = [4, 1, 6, 0]
    fig = Figure()
    ax = draw_mask(fig.subplots(), torch.tensor([[k < n for k in range(6)] for n in lengths]))
    render(fig)
    assert set(cells(ax)) == {(k, i) for i in range(4) for k in range(6)}
    assert hatched(ax) == {(k, i) for i, n in enumerate(lengths) for k in range(n, 6)}
    colours = {i: {cells(ax)[(k, i)].get_facecolor() for k in range(n)} for i, n in enumerate(lengths) if n}
    assert all(len(c) == 1 for c in colours.values())  # one colour per sequence
    assert len(set().union(*colours.values())) == 3  # and a different one for each


def test_draw_mask_rejects_1d():
    with pytest.raises(ValueError, match="2-D"):
        draw_mask(Figure().subplots(), torch.ones(5, dtype=torch.bool))


@pytest.mark.parametrize(
    "lengths, tp, cp, align",
    [
        ([5, 17, 3], 2, 2, None),
        ([5, 17, 3], 2, 2, 8),
        ([7, 1, 12], 1, 4, None),
        ([3, 2], 4, 1, None),
        ([9], 3, 2, None),
    ],
)
def test_draw_thd_cells_against_slicing_reference(lengths, tp, cp, align):
    fig = Figure()
    (ax,) = draw_thd(fig.subplots(), lengths, tp, cp, seq_align=align)
    render(fig)
    padded = ref_padded_lengths(lengths, tp, cp, align)
    local = sum(padded) // cp
    assert set(cells(ax)) == {(k, r) for r in range(cp) for k in range(local)}
    assert len(hatched(ax)) == sum(padded) - sum(lengths)

    s = max(lengths)
    mask = torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]
    codes = torch.tensor([[1 + i * s + k for k in range(s)] for i in range(len(lengths))])  # 0 means padding
    names = ["."] + [f"{'abcdefgh'[i]}{k}" for i in range(len(lengths)) for k in range(s)]
    labels = {
        (round(t.get_position()[0] - 0.5), round(t.get_position()[1] - 0.5)): t.get_text()
        for t in ax.texts
        if not t.get_text().startswith("local")
    }
    for rank in range(cp):
        expected = [names[c] for c in ref_thd_rank(codes, mask, tp, cp, rank, align).tolist()]
        assert {k for k in range(local) if (k, rank) in hatched(ax)} == {k for k, n in enumerate(expected) if n == "."}
        assert {k: labels[(k, rank)] for k in range(local) if (k, rank) in labels} == {
            k: n for k, n in enumerate(expected) if n != "."
        }
    assert f"cu_seqlens_padded {[sum(padded[:i]) for i in range(len(padded) + 1)]}" in ax.get_title()


def test_draw_thd_one_axes_per_rank():
    fig = Figure()
    axes = draw_thd(fig.subplots(2, 1), [5, 3], cp_size=2)
    render(fig)
    # 5 -> 8 and 3 -> 4 with align 4; each rank holds 6 tokens: rank 0 a0 a1 . . b0 ., rank 1 a2 a3 a4 . b1 b2.
    assert [set(cells(ax)) for ax in axes] == [{(k, 0) for k in range(6)}] * 2
    assert [hatched(ax) for ax in axes] == [{(2, 0), (3, 0), (5, 0)}, {(3, 0)}]
    with pytest.raises(ValueError, match="cp_size=2"):
        draw_thd(Figure().subplots(3, 1), [5, 3], cp_size=2)


@pytest.mark.parametrize(
    "num_layers, pp, vpp, first, last, expected",
    [
        # rank r: virtual stage v holds layers 16v+4r .. 16v+4r+3
        (32, 4, 2, None, None, {(r, v): range(16 * v + 4 * r, 16 * v + 4 * r + 4) for r in range(4) for v in range(2)}),
        (30, 4, 1, 6, 6, {(0, 0): range(0, 6), (1, 0): range(6, 15), (2, 0): range(15, 24), (3, 0): range(24, 30)}),
        (5, 1, 1, None, None, {(0, 0): range(5)}),
    ],
)
def test_draw_layer_partition_by_hand(num_layers, pp, vpp, first, last, expected):
    fig = Figure()
    ax = draw_layer_partition(fig.subplots(), num_layers, pp, vpp, first_stage_layers=first, last_stage_layers=last)
    render(fig)
    grid = cells(ax)
    assert set(grid) == {(layer, r) for (r, _), layers in expected.items() for layer in layers}
    colour = {v: {grid[(layer, r)].get_facecolor() for (r, w), ls in expected.items() if w == v for layer in ls}
              for v in range(vpp)}
    assert all(len(c) == 1 for c in colour.values())
    assert len(set().union(*colour.values())) == vpp
    assert not hatched(ax)


def test_draw_layer_partition_passes_on_errors():
    with pytest.raises(ValueError, match="not divisible by pp=4"):
        draw_layer_partition(Figure().subplots(), 30, 4)


@pytest.mark.parametrize("sizes", [dict(pp=2), dict(vpp=2), dict(first_stage_layers=2), dict(last_stage_layers=6)])
def test_draw_layer_partition_refuses_sizes_beside_a_partition(sizes):
    """Sizes passed beside a partition were ignored silently: draw_layer_partition(ax, layer_partition(8, 4),
    pp=2) drew 4 ranks under a title of the partition's, not the pp=2 asked for."""
    with pytest.raises(TypeError, match=rf"partition.*{next(iter(sizes))}=.*pass the partition alone"):
        draw_layer_partition(Figure().subplots(), layer_partition(8, 4), **sizes)


def test_plot_padding_sweep_bar_heights():
    lengths = [5, 17, 3, 9, 120, 33]
    tps, cps = [1, 2, 8], [1, 2, 4]
    fig = Figure()
    ax = plot_padding_sweep(fig.subplots(), lengths, tps, cps)
    render(fig)
    heights = [round(p.get_height()) for p in ax.patches]
    expected = []
    for tp in tps:
        for cp in cps:
            a = 2 * cp if cp > 1 else 1
            ours = sum(math.ceil(n / a) * a for n in lengths)
            ours = math.ceil(ours / math.lcm(a, tp * cp)) * math.lcm(a, tp * cp)
            v = 2 * tp * cp if cp > 1 else tp
            verl = sum(math.ceil(n / v) * v for n in lengths)
            expected += [ours - sum(lengths), verl - sum(lengths)]
    assert heights == expected
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"tp{t}\ncp{c}" for t in tps for c in cps]
    with pytest.raises(ValueError, match="tps and cps"):
        plot_padding_sweep(Figure().subplots(), lengths, [], [1])


def test_import_does_not_import_matplotlib():
    code = "import sys, packfwd.viz; assert 'matplotlib' not in sys.modules, 'matplotlib imported eagerly'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_padding_sweep_matches_plan_thd_totals():
    from packfwd import plan_thd
    from packfwd.viz.text import lengths_mask, padding_overhead, padding_sweep, verl_seq_align

    lengths = [5, 17, 3, 9, 1, 64]
    mask = lengths_mask(lengths)
    rows = padding_sweep(lengths, [1, 2, 3], [1, 2, 4])
    assert [(r["tp"], r["cp"]) for r in rows] == [(t, c) for t in [1, 2, 3] for c in [1, 2, 4]]
    for row in rows:
        tp, cp = row["tp"], row["cp"]
        assert row["real"] == sum(lengths)
        assert row["packfwd"] == plan_thd(mask, tp_size=tp, cp_size=cp, cp_rank=0).total_tokens
        assert row["verl"] == plan_thd(mask, tp_size=tp, cp_size=cp, cp_rank=0, seq_align=verl_seq_align(tp, cp)).total_tokens
        assert padding_overhead(lengths, tp_size=tp, cp_size=cp) == {k: row[k] for k in ("real", "packfwd", "verl")}
    with pytest.raises(ValueError, match=r"tps holds \[0\]: every tp_size must be an int >= 1"):
        padding_sweep(lengths, [0], [1])
    with pytest.raises(ValueError, match=r"cps holds \[2.0\]"):
        padding_sweep(lengths, [1], [2.0])
    with pytest.raises(ValueError, match=r"lengths\[1\] = -1 is negative"):
        padding_sweep([5, -1], [1], [1])


def test_draw_thd_names_more_than_26_sequences_and_long_ones_apart():
    # Sequence 27 used to be named like sequence 1, and token 1000 of a sequence like token 0 of the next.
    fig = Figure()
    (ax,) = draw_thd(fig.subplots(), [1] * 27 + [2])
    cells = sorted(ax.texts, key=lambda t: t.get_position()[0])
    names = [t.get_text() for t in cells if not t.get_text().startswith("local")]
    assert names == [f"{c}0" for c in "abcdefghijklmnopqrstuvwxyz"] + ["aa0", "ab0", "ab1"]
    from packfwd.viz.text import token_codes, token_names

    names = token_names([1002, 2])
    assert [names[c] for c in token_codes([1002, 2])[0, 998:].tolist()] == ["a998", "a999", "a1000", "a1001"]


def test_draw_thd_rejects_cp_size_0():
    with pytest.raises(ValueError, match="cp_size must be >= 1"):
        draw_thd(Figure().subplots(), [5, 3], cp_size=0)
