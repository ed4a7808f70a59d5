"""The pictures and the printing, from the objects a user holds (issue 33).

Strategy:
* every public picture of ``packfwd.viz`` is drawn (Agg, rendered) from each kind of object it takes: a mask,
  lengths, a plan (``UnpadInfo``, ``ThdInfo``, ``BshdInfo``), the list of every CP rank's plans, a
  ``MicroBatchPlan``, a model's ``RoutingStats``; the same layout given as a mask, a plan or a list of plans gives
  the same picture (cells, hatching and names compared artist by artist);
* what the pictures show is checked against independent references: the tokens of each rank against ``to_thd`` of
  token codes (bucket and nested plans too), chunk ownership against the zigzag written out by hand, attention work
  against a per-rank sum over the plans' own positions, micro-batch boxes against the plan's token counts;
* bad input gets an error naming the argument and the fix, without the input's values;
* a 64 x 1024 mask draws (and renders) in under a second on the CPU, as one image with 64 distinct row colours;
* every plan object of a 256-sequence batch prints within a screen (25 lines of 120 characters), reads the device
  once, and prints shapes only while ``torch.compile`` traces.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

import packfwd
from packfwd.layout.bucket import Bucket, plan_thd_bucket
from packfwd.micro import plan_micro_batches
from packfwd.models.mlp.routing import RoutingStats
from packfwd.viz import (attention_work, describe_thd, draw_cp_layout, draw_expert_load, draw_layer_partition,
                         draw_mask, draw_micro_batches, draw_thd, draw_zigzag, lengths_mask, plot_attention_work,
                         plot_padding_sweep)
from packfwd.viz.inputs import thd_facts
from packfwd.viz.style import rank_colours, sequence_colours
from packfwd.viz.text import describe_padding, sequence_name, token_codes, token_names


def rendered(fig: Figure) -> Figure:
    FigureCanvasAgg(fig).draw()
    return fig


def artists(ax) -> tuple:
    """What a grid picture shows: its cells (position, width, hatched) and its texts, comparable across inputs."""
    cells = sorted((round(p.get_x(), 3), round(p.get_y(), 3), round(p.get_width(), 3), bool(p.get_hatch()))
                   for p in ax.patches)
    texts = sorted((round(t.get_position()[0], 3), round(t.get_position()[1], 3), t.get_text()) for t in ax.texts)
    images = [np.asarray(im.get_array()).tolist() for im in ax.images]
    return cells, texts, images, ax.get_title()


def rl_lengths(n: int, seed: int = 0, longest: int = 4096) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(n, generator=g) * 0.8 + 6.0).clamp(16, longest).long().tolist()


LENGTHS = [5, 17, 3, 9]


# ------------------------------------------------------------------------------------- the user's own objects


def layouts(tp: int, cp: int):
    """The same batch as each kind of object a THD picture takes, with the sizes to pass beside it."""
    mask = lengths_mask(LENGTHS)
    left = torch.flip(mask, [1])  # left padding: the same lengths
    plans = [packfwd.plan_thd(mask, tp_size=tp, cp_size=cp, cp_rank=r) for r in range(cp)]
    sizes = dict(tp_size=tp, cp_size=cp)
    return {
        "lengths": (LENGTHS, sizes),
        "mask": (mask, sizes),
        "int mask, left-padded": (left.long(), sizes),
        "ThdInfo of the last rank": (plans[-1], {}),
        "every rank's plans, any order": (plans[::-1], {}),
    }


@pytest.mark.parametrize("tp, cp", [(1, 1), (2, 2), (2, 4)])
@pytest.mark.parametrize("draw", [draw_thd, draw_zigzag, plot_attention_work])
def test_thd_pictures_take_lengths_masks_plans_and_lists_of_plans(draw, tp, cp):
    pictures = {}
    for name, (layout, sizes) in layouts(tp, cp).items():
        fig = Figure(figsize=(9, 3))
        out = draw(fig.subplots(), layout, **sizes)
        rendered(fig)
        ax = out[0] if isinstance(out, list) else out
        pictures[name] = artists(ax)
    first = next(iter(pictures.values()))
    assert first[0] or first[2]  # something was drawn
    for name, picture in pictures.items():
        assert picture == first, f"{draw.__name__} of {name} differs from the one of lengths"


def test_an_unpad_plan_is_thd_without_padding():
    mask = lengths_mask(LENGTHS)
    fig = Figure()
    (ax,) = draw_thd(fig.subplots(), packfwd.plan_unpad(mask))
    rendered(fig)
    assert len(ax.patches) == sum(LENGTHS) and not any(p.get_hatch() for p in ax.patches)
    assert describe_thd(packfwd.plan_unpad(mask)) == describe_thd(LENGTHS)


@pytest.mark.parametrize("what", ["mask", "lengths", "unpad", "thd", "thd list", "bshd"])
def test_draw_mask_takes_every_object(what):
    mask = torch.flip(lengths_mask(LENGTHS), [1])  # left-padded
    objects = {
        "mask": mask, "lengths": LENGTHS, "unpad": packfwd.plan_unpad(mask), "thd": packfwd.plan_thd(mask, cp_size=2, cp_rank=0),
        "thd list": [packfwd.plan_thd(mask, cp_size=2, cp_rank=r) for r in (0, 1)], "bshd": packfwd.plan_bshd(mask),
    }
    fig = Figure()
    ax = draw_mask(fig.subplots(), objects[what])
    rendered(fig)
    hatched = {(round(p.get_x()), round(p.get_y())) for p in ax.patches if p.get_hatch()}
    if what == "lengths":  # right-padded
        want = lengths_mask(LENGTHS)
    elif what == "bshd":  # the compacted batch: each row's tokens moved left, width the longest row
        want = lengths_mask(LENGTHS)
        assert "BshdInfo" in ax.get_title()
    else:  # the mask the plan was made from, left padding and all
        want = mask
    assert hatched == {(k, i) for i, k in (~want).nonzero().tolist()}


def test_describe_thd_takes_masks_and_plans():
    mask = lengths_mask(LENGTHS)
    want = describe_thd(LENGTHS, tp_size=2, cp_size=2)
    assert describe_thd(mask, tp_size=2, cp_size=2) == want
    assert describe_thd(packfwd.plan_thd(mask, tp_size=2, cp_size=2, cp_rank=1)) == want
    assert describe_thd([packfwd.plan_thd(mask, tp_size=2, cp_size=2, cp_rank=r) for r in (1, 0)]) == want


def test_describe_padding_of_a_plan_is_the_plans_layout():
    """describe_padding took a plan's lengths alone and counted them with tp=1, cp=1: a plan of 44 THD tokens (tp=2,
    cp=2, align 4) printed "packfwd (align 1) 34 tokens, 0 pad".  A plan brings its sizes, as in every picture."""
    mask = lengths_mask(LENGTHS)
    info = packfwd.plan_thd(mask, tp_size=2, cp_size=2, cp_rank=1)
    assert describe_padding(info) == describe_padding(LENGTHS, tp_size=2, cp_size=2)
    assert f"packfwd (align 4)    {info.total_tokens} tokens" in describe_padding(info)
    chosen = packfwd.plan_thd(mask, tp_size=2, cp_size=2, cp_rank=0, seq_align=8)
    assert f"chosen  (align 8)    {chosen.total_tokens} tokens" in describe_padding(chosen)
    with pytest.raises(ValueError, match="planned with cp_size=2 but cp_size=1 was passed"):
        describe_padding(info, cp_size=1)


def test_describe_thd_of_a_plan_prints_its_max_seqlen():
    """describe_thd printed the longest padded sequence as max_seqlen, not the plan's: 20 for a bucket plan whose
    max_seqlen (what Megatron-Core is given) is the bucket's 32, and for plan_thd(max_seqlen=64)."""
    mask = lengths_mask(LENGTHS)
    bucket = plan_thd_bucket(mask, Bucket(64, 32), tp_size=2, cp_size=2, cp_rank=0)
    fixed = packfwd.plan_thd(mask, tp_size=2, cp_size=2, cp_rank=0, max_seqlen=64)
    for plan in (bucket, fixed, [fixed, packfwd.plan_thd(mask, tp_size=2, cp_size=2, cp_rank=1, max_seqlen=64)]):
        want = (plan[0] if isinstance(plan, list) else plan).max_seqlen
        assert f"max_seqlen {want}," in describe_thd(plan)
    assert "max_seqlen 20," in describe_thd(mask, tp_size=2, cp_size=2)  # lengths: the longest padded


def test_describe_thd_of_a_large_batch_is_ranges_and_short():
    lengths = rl_lengths(64, longest=1024)
    text = describe_thd(lengths_mask(lengths), tp_size=2, cp_size=4)
    lines = text.splitlines()
    assert len(lines) == 2 + 4 and max(map(len, lines)) <= 200
    assert "60 more sequences" in lines[2] and lines[2].startswith("cp rank 0 (")
    facts = thd_facts(lengths, tp_size=2, cp_size=4)
    chunk = int(facts.chunk()[0])  # rank 0 holds chunks 0 and 7 of sequence a
    assert f"a[0:{chunk}]+[{7 * chunk}:{8 * chunk}]" in lines[2]


def test_other_pictures_take_the_users_objects():
    mask = lengths_mask(LENGTHS)
    plan = packfwd.plan_thd(mask, cp_size=2, cp_rank=0)
    fig = Figure(figsize=(8, 3))
    a, b = fig.subplots(1, 2)
    plot_padding_sweep(a, plan, [1, 2], [1, 2])  # a plan: its lengths
    want = Figure().subplots()
    plot_padding_sweep(want, LENGTHS, [1, 2], [1, 2])
    assert [p.get_height() for p in a.patches] == [p.get_height() for p in want.patches]
    draw_layer_partition(b, packfwd.layer_partition(8, 2, 2))  # a partition already made
    rendered(fig)
    assert sorted((int(p.get_x()), int(p.get_y())) for p in b.patches)[:4] == [(0, 0), (1, 0), (2, 1), (3, 1)]


@pytest.mark.parametrize("layout", [[], torch.zeros(0, 5, dtype=torch.bool)], ids=["no lengths", "b=0 mask"])
@pytest.mark.parametrize("cp", [1, 2])
def test_an_empty_batch_draws_like_the_other_pictures(layout, cp):
    """draw_zigzag (so draw_cp_layout) raised numpy's "zero-size array to reduction operation maximum" on a batch
    of no sequences (a DP rank left without any), where draw_thd, draw_mask and the plans' HTML draw it."""
    fig = Figure(figsize=(9, 3))
    ax = draw_zigzag(fig.subplots(), layout, cp_size=cp)
    assert not ax.patches and not ax.images
    axes = draw_cp_layout(Figure(figsize=(9, 4)), layout, cp_size=cp)
    rendered(axes["zigzag"].get_figure())
    rendered(fig)


# ----------------------------------------------------------------------- what the pictures show is right


def rank_names(facts, rank):
    seq, pos, real = facts.rank_tokens(rank)
    return [f"{sequence_name(int(i))}{q}" if r else "." for i, q, r in zip(seq, pos, real)]


@pytest.mark.parametrize("lengths, tp, cp, align", [
    ([5, 17, 3, 9], 2, 2, None), ([7, 1, 12], 1, 4, None), ([0, 5, 2], 2, 2, 8), ([9], 3, 2, None),
    ([4, 4], 1, 1, None),
])
def test_rank_tokens_are_to_thd_of_token_codes(lengths, tp, cp, align):
    codes, names = token_codes(lengths), token_names(lengths)
    mask = lengths_mask(lengths)
    for layout in (lengths, packfwd.plan_thd(mask, tp_size=tp, cp_size=cp, cp_rank=0, seq_align=align)):
        sizes = dict(tp_size=tp, cp_size=cp, seq_align=align) if isinstance(layout, list) else {}
        facts = thd_facts(layout, **sizes)
        for rank in range(cp):
            info = packfwd.plan_thd(mask, tp_size=tp, cp_size=cp, cp_rank=rank, seq_align=align)
            assert rank_names(facts, rank) == [names[c] for c in packfwd.to_thd(codes, info)[0].tolist()]


def test_rank_tokens_of_bucket_and_nested_plans():
    lengths = [5, 3, 6]
    mask = lengths_mask(lengths)
    codes, names = token_codes(lengths), token_names(lengths)
    bucket = [plan_thd_bucket(mask, Bucket(tokens=32, max_seqlen=8), cp_size=2, cp_rank=r) for r in (0, 1)]
    facts = thd_facts(bucket)
    assert facts.n == len(lengths) + Bucket(32, 8).spares and facts.total_tokens == 32
    for rank, info in enumerate(bucket):
        assert rank_names(facts, rank) == [names[c] for c in packfwd.to_thd(codes, info)[0].tolist()]
    nested = torch.nested.nested_tensor([torch.arange(n) for n in lengths], layout=torch.jagged)
    info = packfwd.plan_thd(None, x=nested, cp_size=2, cp_rank=1)
    assert describe_thd(info) == describe_thd(lengths, cp_size=2)
    fig = Figure()
    draw_mask(fig.subplots(), info)  # a nested batch: its rows right-aligned
    rendered(fig)


def test_the_cp_figure_shows_which_chunks_each_rank_owns():
    # tp=2, cp=4, 12 sequences: the case.  Each sequence is cut into 8 chunks; rank r owns r and 7 - r.
    lengths = [36, 13, 12, 52, 55, 55, 5, 30, 46, 24, 24, 6]
    owner = [0, 1, 2, 3, 3, 2, 1, 0]  # written out, not computed
    plans = [packfwd.plan_thd(lengths_mask(lengths), tp_size=2, cp_size=4, cp_rank=r) for r in range(4)]
    fig = Figure(figsize=(11, 6.5))
    axes = draw_cp_layout(fig, plans)
    rendered(fig)
    colours = [tuple(c) for c in rank_colours(4)]
    padded = [-(-n // 8) * 8 for n in lengths]
    seen = {}
    for p in axes["zigzag"].patches:  # real parts solid in the owner's colour
        if not p.get_hatch():
            i, k = round(p.get_y()), int(p.get_x() // (padded[round(p.get_y())] // 8))
            seen[(i, k)] = colours.index(tuple(p.get_facecolor()))
    assert seen == {(i, k): owner[k] for i, n in enumerate(lengths) for k in range(8) if n > k * padded[i] // 8}
    numbers = {(round(t.get_position()[1]), t.get_text()) for t in axes["zigzag"].texts}
    assert {(0, str(k)) for k in range(8)} <= numbers  # sequence a: every chunk numbered
    ranks = {}
    for t in axes["ranks"].texts:
        if t.get_gid() == "chunk":
            ranks.setdefault(int(t.get_position()[1]), set()).add(int(t.get_text()))
    assert ranks == {r: {r, 7 - r} for r in range(4)}
    labels = [t.get_text() for t in axes["ranks"].get_yticklabels()]
    assert labels == [f"cp rank {r}" for r in range(4)]


@pytest.mark.parametrize("tp, cp", [(1, 1), (2, 2), (1, 4)])
def test_attention_work_against_the_plans_positions(tp, cp):
    lengths = [300, 41, 17, 120, 5]
    mask = lengths_mask(lengths)
    zigzag = []
    for rank in range(cp):
        info = packfwd.plan_thd(mask, tp_size=tp, cp_size=cp, cp_rank=rank)
        real = info.gather_index >= 0
        zigzag.append(int(((packfwd.position_ids(info) + 1) * real).sum()))
    padded = thd_facts(lengths, tp_size=tp, cp_size=cp).padded.tolist()
    contiguous = [sum(q + 1 for n, p in zip(lengths, padded) for q in range(r * p // cp, (r + 1) * p // cp) if q < n)
                  for r in range(cp)]
    assert attention_work(mask, tp_size=tp, cp_size=cp) == {"zigzag": zigzag, "contiguous": contiguous}
    fig = Figure()
    ax = plot_attention_work(fig.subplots(), packfwd.plan_thd(mask, tp_size=tp, cp_size=cp, cp_rank=0))
    assert [p.get_height() for p in ax.patches] == contiguous + zigzag


def test_draw_micro_batches_boxes_hold_the_plans_tokens():
    plan = plan_micro_batches(rl_lengths(48, longest=2048), max_tokens=2048, dp_size=3, tp_size=2, cp_size=2)
    fig = Figure(figsize=(10, 3))
    ax = draw_micro_batches(fig.subplots(), plan)
    rendered(fig)
    boxes = [p for p in ax.patches if not p.get_fill()]
    assert len(boxes) == plan.dp_size * plan.num_micro_batches
    assert {round(b.get_width()) for b in boxes} == {plan.max_tokens}
    filled = [sum(float(p.get_extents().width) for p in c.get_paths()) for c in ax.collections]
    assert np.allclose(filled, [t for rank in plan.tokens for t in rank])
    assert [t.get_text() for t in ax.texts if not t.get_text().startswith(" cost")] == [
        str(t) for rank in plan.tokens for t in rank]


def test_draw_expert_load_from_routing_stats_with_and_without_padding():
    g = torch.Generator().manual_seed(0)
    stats = [RoutingStats(torch.randint(0, 9, (6,), generator=g).float(), torch.rand(6, generator=g),
                          torch.tensor(20.0)) for _ in range(3)]
    counts = torch.stack([s.tokens_per_expert for s in stats])
    padded = counts + torch.tensor([7.0, 0, 0, 0, 0, 0])  # padding routed to expert 0
    fig = Figure(figsize=(9, 3))
    axes = draw_expert_load(fig.subplots(1, 2), {"packfwd": stats, "padding routed": padded})
    rendered(fig)
    assert np.array_equal(axes[0].images[0].get_array(), counts.numpy())
    assert np.array_equal(axes[1].images[0].get_array(), padded.numpy())
    assert axes[0].images[0].get_clim() == axes[1].images[0].get_clim() == (0, float(padded.max()))
    assert axes[0].get_yticklabels()[0].get_text().startswith("MoE layer 0 (")
    (one,) = draw_expert_load(Figure().subplots(), stats[0])  # one layer's stats
    assert one.images[0].get_array().shape == (1, 6)


# ------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("call, error, words", [
    (lambda ax: draw_thd(ax, {"a": 1}), TypeError, ["layout is a dict", "attention mask"]),
    (lambda ax: draw_thd(ax, packfwd.plan_bshd(lengths_mask([3, 2]))), TypeError, ["BshdInfo", "draw_mask"]),
    (lambda ax: draw_thd(ax, packfwd.plan_thd(lengths_mask([3, 2]), cp_size=2, cp_rank=0), cp_size=4), ValueError,
     ["cp_size=2", "cp_size=4", "pass the plan alone"]),
    (lambda ax: draw_thd(ax, [packfwd.plan_thd(lengths_mask([3, 2]), cp_size=2, cp_rank=0)]), ValueError,
     ["CP ranks [0]", "cp_size=2"]),
    (lambda ax: draw_thd(ax, [packfwd.plan_thd(lengths_mask([3, 2]), cp_size=2, cp_rank=r) for r in (0, 1)][:1]
                         + [packfwd.plan_thd(lengths_mask([4, 2]), cp_size=2, cp_rank=1)]), ValueError,
     ["different batches"]),
    (lambda ax: draw_thd(ax, torch.zeros(2, 3, 4)), TypeError, ["shape (2, 3, 4)", "lengths"]),
    (lambda ax: draw_thd(ax, torch.tensor([[0.5, 1.0]])), TypeError, ["torch.float32", "bool"]),
    (lambda ax: draw_thd(ax, torch.tensor([[2, 1]])), ValueError, ["other than 0 and 1"]),
    (lambda ax: draw_thd(ax, [3, -1]), ValueError, ["layout[1] = -1"]),
    (lambda ax: draw_thd(ax, [3.0, 2]), TypeError, ["float"]),
    (lambda ax: draw_mask(ax, "abc"), TypeError, ["mask is a str"]),
    (lambda ax: draw_mask(ax, torch.ones(5, dtype=torch.bool)), ValueError, ["2-D"]),
    (lambda ax: draw_micro_batches(ax, [[1, 2]]), TypeError, ["plan is a list", "plan_micro_batches"]),
    (lambda ax: draw_expert_load(ax, "x"), TypeError, ["stats is a str", "routing_stats"]),
    (lambda ax: draw_expert_load([ax, ax], {"a": torch.ones(2, 3)}), ValueError, ["2 axes for 1"]),
    (lambda ax: draw_layer_partition(ax, 8), TypeError, ["needs pp"]),
])
def test_bad_input_names_the_argument_and_the_fix(call, error, words):
    with pytest.raises(error) as info:
        call(Figure().subplots())
    message = str(info.value)
    assert all(w in message for w in words), message
    assert "tensor(" not in message and len(message) < 400, message  # never the input's values


# ------------------------------------------------------------------------------------------ pictures scale


def test_a_64_by_1024_mask_draws_in_under_a_second():
    lengths = torch.randint(1, 1025, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    mask = lengths_mask(lengths, 1024)
    fig = Figure(figsize=(9, 5))
    ax = fig.subplots()
    FigureCanvasAgg(fig)
    start = time.perf_counter()
    draw_mask(ax, mask)
    fig.canvas.draw()
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"draw_mask of 64 x 1024 took {elapsed:.2f} s"
    assert not ax.patches and len(ax.images) == 1  # one image, no per-cell patches or borders
    rgba = np.asarray(ax.images[0].get_array())
    assert rgba.shape == (64, 1024, 4)
    grey = np.all(rgba == rgba[0, -1], axis=-1)  # row 0 ends in padding
    assert np.array_equal(grey, ~mask.numpy())
    row_colours = {tuple(rgba[i, 0]) for i in range(64)}
    assert len(row_colours) == 64  # past 10 sequences the colours do not repeat
    assert len(ax.get_yticklabels()) <= 24  # row labels thinned, not overlapping


def test_large_thd_and_zigzag_pictures_are_images_and_fast():
    lengths = rl_lengths(64, longest=1024)
    fig = Figure(figsize=(11, 9))
    start = time.perf_counter()
    axes = draw_cp_layout(fig, lengths_mask(lengths), tp_size=2, cp_size=4)
    rendered(fig)
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0, f"draw_cp_layout of 64 sequences took {elapsed:.2f} s"
    assert axes["ranks"].images and axes["zigzag"].images
    assert fig.get_size_inches().tolist() == [11, 9]  # no runaway width


def test_sequence_colours_stay_distinct():
    for n in (4, 10, 11, 64, 200):
        colours = sequence_colours(n)
        assert len(set(colours)) == n
        assert all(a[:3] != b[:3] for a, b in zip(colours, colours[1:]))


# ------------------------------------------------------------------------------------------------ printing


def all_plan_objects():
    """Every plan and statistics object of a 256-sequence batch, as a user meets them."""
    lengths = rl_lengths(256)
    mask = lengths_mask(lengths)
    g = torch.Generator().manual_seed(1)
    counts = torch.randint(1000, 9000, (64,), generator=g).float()
    return {
        "UnpadInfo": packfwd.plan_unpad(mask),
        "ThdInfo": packfwd.plan_thd(mask),
        "ThdInfo tp2 cp4": packfwd.plan_thd(mask, tp_size=2, cp_size=4, cp_rank=3),
        "ThdInfo bucket": plan_thd_bucket(mask, Bucket(tokens=262144, max_seqlen=4096), cp_size=2, cp_rank=0),
        "BshdInfo": packfwd.plan_bshd(mask, tp_size=2),
        "MicroBatchPlan": plan_micro_batches(lengths, max_tokens=8192, dp_size=4, tp_size=2, cp_size=2),
        "MicroBatchPlan dp16": plan_micro_batches(lengths, max_tokens=4096, dp_size=16),
        "RoutingStats": RoutingStats(counts, torch.rand(64, requires_grad=True), torch.tensor(float(sum(lengths)))),
        "PackedSeqParams": packfwd.plan_thd(mask, cp_size=2, cp_rank=0).packed_seq_params(),
    }


def test_every_plan_object_of_256_sequences_prints_within_a_screen():
    for name, obj in all_plan_objects().items():
        text = repr(obj)
        lines = text.splitlines()
        assert len(lines) <= 25 and max(map(len, lines)) <= 120, f"{name} prints {len(lines)} lines:\n{text}"
        assert "tensor(" not in text, name
        page = obj._repr_html_()
        assert page.startswith("<div") and len(page) < 100_000, (name, len(page))


def test_a_micro_batch_plans_html_says_which_ranks_it_draws():
    """The HTML of a plan of 32 DP ranks drew ranks 0-15 and said nothing of the other 16 (BshdInfo's says which
    rows it draws)."""
    plan = plan_micro_batches(rl_lengths(256), max_tokens=4096, dp_size=32)
    page = plan._repr_html_()
    assert "dp 15<" in page and "dp 16<" not in page and "dp ranks 0-15 of 32 drawn" in page
    assert "drawn" not in plan_micro_batches(rl_lengths(64), max_tokens=4096, dp_size=16)._repr_html_()


def test_printed_facts_are_right():
    lengths = [5, 17, 3, 9]
    mask = lengths_mask(lengths)
    info = packfwd.plan_thd(mask, tp_size=2, cp_size=2, cp_rank=1)
    text = repr(info)
    assert "cu_seqlens=int32[5] [0, 5, 22, 25, 34]" in text
    assert "cu_seqlens_padded=int32[5] [0, 8, 28, 32, 44]" in text
    real = int((info.gather_index >= 0).sum())  # this rank's real tokens, read from the plan's index
    assert f"local_tokens=22 per CP rank (this rank: {real} real, {22 - real} pad)" in text
    assert "total_tokens=44 (10 pad, 22.7%)" in text
    assert "index=int64[44]" in text and "source=padded batch, mask bool[4, 17]" in text
    for rank in range(2):
        plan = packfwd.plan_thd(lengths_mask(rl_lengths(256)), tp_size=2, cp_size=2, cp_rank=rank)
        real = int((plan.gather_index >= 0).sum())
        assert f"(this rank: {real} real, {plan.local_tokens - real} pad)" in repr(plan)
    plan = plan_micro_batches([7, 3, 9, 1, 6, 2], max_tokens=10, dp_size=2)
    assert "micro_batches=[[[1, 5], [2]], [[4], [0, 3]]]" in repr(plan)
    assert "dp rank 1: 3 sequences, tokens [6, 8]" in repr(plan)
    stats = RoutingStats(torch.tensor([2.0, 0.0, 4.0]), torch.ones(3), torch.tensor(3.0))
    want = "RoutingStats(tokens=3, tokens_per_expert=float32[3] 0..4 (mean 2), probs_per_expert=float32[3])"
    assert repr(stats) == want


def test_printing_reads_the_device_once_and_not_while_tracing(monkeypatch):
    info = packfwd.plan_thd(lengths_mask(rl_lengths(256)), tp_size=2, cp_size=2, cp_rank=0)
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.shape) or tolist(self))
    repr(info)
    assert len(reads) == 1  # cu_seqlens and cu_seqlens_padded together
    reads.clear()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    text = repr(info)
    assert not reads and "values not read while tracing" in text and "cu_seqlens_padded=int32[257]" in text


# ----------------------------------------------------------------------------------------------- notebooks


NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_committed_run_with_a_figure_and_no_noise(path):
    """Each notebook is committed with its outputs (pictures where the code is browsed), draws at least one figure,
    and shows no warnings (stderr) and no stray values such as main()'s 0.  ``make test`` runs them (nbmake)."""
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    outputs = [o for c in cells for o in c.get("outputs", [])]
    assert all(c.get("execution_count") for c in cells), f"{path.name}: run it and commit its outputs"
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} draws no figure"
    noise = [o for o in outputs if o.get("name") == "stderr" or o["output_type"] == "error"]
    assert not noise, f"{path.name} shows warnings or errors: {noise[0]}"
    values = ["".join(o["data"]["text/plain"]) for o in outputs if o["output_type"] == "execute_result"
              and set(o["data"]) == {"text/plain"}]
    assert not [v for v in values if v.strip().lstrip("-").isdigit()], f"{path.name} shows stray values {values}"


def test_routing_agreement_by_hand():
    # two tokens and a padding slot, 2 MoE layers, top-2
    first = torch.tensor([[[[0, 1], [4, 5]], [[2, 3], [6, 7]], [[-1, -1], [-1, -1]]]])
    second = torch.tensor([[[[1, 0], [4, 6]], [[2, 5], [7, 6]], [[3, 3], [0, 0]]]])  # padding: anything
    from packfwd.viz import draw_routing_agreement, routing_agreement

    # layer 0: token 0 the same set, token 1 one of two; layer 1: token 0 one of two, token 1 the same set
    assert routing_agreement(first, second) == {"same": [0.5, 0.5], "overlap": [0.75, 0.75]}
    assert routing_agreement(first, first) == {"same": [1.0, 1.0], "overlap": [1.0, 1.0]}
    fig = Figure()
    ax = draw_routing_agreement(fig.subplots(), first, second)
    rendered(fig)
    assert [p.get_height() for p in ax.patches] == [0.5, 0.5, 0.75, 0.75]
    with pytest.raises(ValueError, match="same batch"):
        routing_agreement(first, second[:, :2])
    with pytest.raises(TypeError, match="first is a torch.float32 tensor"):
        routing_agreement(first.float(), second)
