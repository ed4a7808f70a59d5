"""Multimodal RoPE positions: ``mrope_position_ids`` against transformers, and positions through every layout.

Strategy: transformers' own ``get_rope_index`` of ``Qwen2VLModel`` and ``Qwen2_5_VLModel`` is the reference,
called unbound on a stand-in holding only the config (as verl binds it to the processor).  Hypothesis draws rows
of text with images and videos between (random small grids, merge sizes 1 and 2, Qwen2.5-VL's temporal spacing),
rows without vision tokens, left, right and holed padding, and pad slots holding vision token ids; the positions
and deltas must be equal.  Packing: ``pack_positions`` must equal a per-sequence slicing loop (tests/oracles.py) for
unpad, THD (tp, cp, every rank, seq_align, fixed buckets, nested input) and BSHD, for ``[b, s]``, ``[k, b, s]``
and ``[b, s, k]``; ``unpack_positions`` must give the positions back bit for bit with ``fill_value`` at padding.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

import packfwd as pf
from packfwd.layout.bucket import Bucket, plan_thd_bucket
from packfwd.vision import mrope_position_ids

from .oracles import ref_masked, ref_thd_rank, ref_unpad
from .strategies import masks, random_tensor

START, END, IMAGE, VIDEO = 3, 4, 5, 6  # vision_start, vision_end, image pad, video pad
IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START)

# transformers 5.x is the reference; 4.x has other rules (packfwd/vision/rope_index.py says which), and 5.17
# truncates second_per_grid_ts to whole seconds (5.24 does not) and fails on a fractional tokens_per_second
# (a float temporal index in an integer meshgrid): draw whole seconds and whole tokens_per_second there.
HF5 = "mm_token_type_ids" in inspect.signature(Qwen2VLModel.get_rope_index).parameters
WHOLE_SECONDS = "int(next(second_per_grid_ts))" in inspect.getsource(Qwen2_5_VLModel.get_rope_index)
needs_hf5 = pytest.mark.skipif(not HF5, reason="transformers 4.x get_rope_index follows the 4.x rules")


# ------------------------------------------------------------------------------------------- the reference


def hf_rope_index(model_cls, ids, mask, *, merge, tps=None, images=None, videos=None, seconds=None):
    """transformers' get_rope_index (positions [3, b, s], deltas [b]) on a stand-in that holds only the config."""
    vision = types.SimpleNamespace(spatial_merge_size=merge, tokens_per_second=tps)
    self = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=vision))
    self.get_vision_position_ids = types.MethodType(model_cls.get_vision_position_ids, self)
    kinds = torch.zeros_like(ids, dtype=torch.int32)
    kinds[ids == IMAGE] = 1
    kinds[ids == VIDEO] = 2
    kw = dict(image_grid_thw=images, video_grid_thw=videos, attention_mask=mask)
    if "second_per_grid_ts" in inspect.signature(model_cls.get_rope_index).parameters:  # Qwen2.5-VL
        kw["second_per_grid_ts"] = seconds
    pos, delta = model_cls.get_rope_index(self, ids, kinds, **kw)
    return pos, delta.reshape(-1)


@st.composite
def vision_batches(draw, qwen25: bool):
    """A padded text+image+video batch in the processor's form (``<start> pads <end>`` per item), no empty row."""
    merge = draw(st.sampled_from([1, 2]))
    text = lambda lo, hi: draw(st.lists(st.integers(10, 60), min_size=lo, max_size=hi))  # noqa: E731
    rows, images, videos, seconds = [], [], [], []
    for _ in range(draw(st.integers(1, 4))):
        row = []
        for _ in range(draw(st.integers(0, 3))):
            row += text(0, 3)
            video = draw(st.booleans())
            t = draw(st.integers(1, 4 if video else 2))
            h, w = (merge * draw(st.integers(1, 3)) for _ in range(2))
            row += [START] + [VIDEO if video else IMAGE] * (t * h * w // merge**2) + [END]
            (videos if video else images).append([t, h, w])
            if video:
                seconds.append(float(draw(st.integers(1, 3))) if WHOLE_SECONDS else draw(st.floats(0.015625, 4.0, width=32)))
        row += text(0 if row else 1, 3)
        rows.append(row)
    padding = draw(st.sampled_from(["right", "left", "holes", "none"]))
    extra = 0 if padding == "none" else draw(st.integers(0, 3))
    s = max(map(len, rows)) + extra
    ids = torch.tensor(draw(st.lists(st.sampled_from([0, START, IMAGE, VIDEO, 7]), min_size=len(rows) * s,
                                     max_size=len(rows) * s))).reshape(len(rows), s)  # pad slots hold anything
    mask = torch.zeros(len(rows), s, dtype=torch.bool)
    for i, row in enumerate(rows):
        if padding == "holes":
            cols = sorted(draw(st.permutations(range(s)))[: len(row)])
        elif padding == "left":
            cols = list(range(s - len(row), s))
        else:
            cols = list(range(len(row)))
        ids[i, cols] = torch.tensor(row)
        mask[i, cols] = True
    grid = lambda g: torch.tensor(g) if g else None  # noqa: E731
    tps = draw(st.sampled_from([1, 2, 25] if WHOLE_SECONDS else [1, 2, 25, 2.5])) if qwen25 else None
    sec = torch.tensor(seconds) if seconds and qwen25 and draw(st.booleans()) else None
    return dict(ids=ids, mask=mask, merge=merge, images=grid(images), videos=grid(videos), tps=tps, seconds=sec)


def ours(b, **over):
    kw = dict(image_grid_thw=b["images"], video_grid_thw=b["videos"], second_per_grid_ts=b["seconds"],
              spatial_merge_size=b["merge"], tokens_per_second=b["tps"], **IDS)
    kw.update(over)
    return mrope_position_ids(b["ids"], b["mask"], **kw)


def theirs(model_cls, b):
    return hf_rope_index(model_cls, b["ids"], b["mask"], merge=b["merge"], tps=b["tps"], images=b["images"],
                         videos=b["videos"], seconds=b["seconds"])


# ----------------------------------------------------------------------------------- mrope_position_ids


@needs_hf5
@given(vision_batches(qwen25=False))
def test_qwen2_vl_positions_equal_transformers(b):
    pos, delta = ours(b)
    ref, ref_delta = theirs(Qwen2VLModel, b)
    assert pos.dtype == delta.dtype == torch.long and pos.shape == ref.shape
    assert torch.equal(pos, ref) and torch.equal(delta, ref_delta)


@needs_hf5
@given(vision_batches(qwen25=True))
def test_qwen2_5_vl_positions_with_temporal_spacing_equal_transformers(b):
    pos, delta = ours(b)
    ref, ref_delta = theirs(Qwen2_5_VLModel, b)
    assert torch.equal(pos, ref) and torch.equal(delta, ref_delta)


def example():
    """Row 0: text, a 2x2 image, text, a 3-frame 1x2 video, text (left-padded); row 1: text only; row 2: empty."""
    row0 = [11, START, *[IMAGE] * 4, END, 12, START, *[VIDEO] * 6, END, 13]
    ids = torch.zeros(3, 18, dtype=torch.long)
    mask = torch.zeros(3, 18, dtype=torch.bool)
    ids[0, 18 - len(row0):] = torch.tensor(row0)
    mask[0, 18 - len(row0):] = True
    ids[1, :5] = torch.arange(20, 25)
    mask[1, :5] = True
    return dict(ids=ids, mask=mask, merge=2, images=torch.tensor([[1, 4, 4]]), videos=torch.tensor([[3, 2, 4]]),
                tps=2, seconds=torch.tensor([1.5]))


def test_written_out_positions_empty_row_and_int_mask():
    b = example()
    pos, delta = ours(b)
    # row 0: text 0, <start> 1, image at 2 (2x2), text 4 5, <start> 6, video at 7 (frames 0, 3, 6: int(i * 2 * 1.5)),
    # text from 7 + max(1, 2) = 9; the empty row is all 0 with delta 0
    assert pos[:, 0, 1:].tolist() == [
        [0, 1, 2, 2, 2, 2, 4, 5, 6, 7, 7, 10, 10, 13, 13, 9, 10],
        [0, 1, 2, 2, 3, 3, 4, 5, 6, 7, 7, 7, 7, 7, 7, 9, 10],
        [0, 1, 2, 3, 2, 3, 4, 5, 6, 7, 8, 7, 8, 7, 8, 9, 10],
    ]
    assert not pos[:, 0, 0].any() and not pos[:, 2].any() and delta.tolist() == [13 + 1 - 17, 0, 0]
    int_mask = ours({**b, "mask": b["mask"].int()})
    assert torch.equal(int_mask[0], pos) and torch.equal(int_mask[1], delta)


@needs_hf5
def test_empty_rows_and_no_mask_equal_transformers():
    b = example()
    if WHOLE_SECONDS:
        b["seconds"] = b["seconds"].ceil()
    pos, delta = ours(b)
    ref, ref_delta = theirs(Qwen2_5_VLModel, {**b, "ids": b["ids"][:2], "mask": b["mask"][:2]})  # hf: no empty rows
    assert torch.equal(pos[:, :2], ref) and torch.equal(delta[:2], ref_delta)
    full = b["ids"][:1, 1:]
    got = mrope_position_ids(full, image_grid_thw=b["images"], video_grid_thw=b["videos"], **IDS)
    want = hf_rope_index(Qwen2VLModel, full, None, merge=2, images=b["images"], videos=b["videos"])
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_text_only_batch_is_plain_positions():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]]).bool()
    pos, delta = mrope_position_ids(torch.full((2, 5), 9), mask, **IDS)
    assert torch.equal(pos, ((mask.cumsum(1) - 1) * mask).expand(3, 2, 5)) and not delta.any()


ERRORS = {
    "too many grids": (dict(image_grid_thw=torch.tensor([[1, 4, 4], [1, 2, 2]])), "image_grid_thw has 2 grids"),
    "too few grids": (dict(image_grid_thw=None), "image_grid_thw is None"),
    "wrong size": (dict(video_grid_thw=torch.tensor([[2, 2, 4]])), "video_grid_thw has 1 grids holding 4"),
    "bad grid shape": (dict(image_grid_thw=torch.tensor([[4, 4]])), "image_grid_thw must be [n, 3]"),
    "float grid": (dict(image_grid_thw=torch.tensor([[1.0, 4, 4]])), "image_grid_thw has dtype"),
    "not mergeable": (dict(image_grid_thw=torch.tensor([[1, 2, 8]]), spatial_merge_size=4), "multiples of"),
    "zero grid": (dict(video_grid_thw=torch.tensor([[0, 2, 4]])), "video_grid_thw[0]"),
    "seconds without tps": (dict(tokens_per_second=None), "tokens_per_second is None"),
    "seconds length": (dict(second_per_grid_ts=torch.tensor([1.0, 2.0])), "second_per_grid_ts must be a real"),
    "bad tps": (dict(tokens_per_second=-1), "tokens_per_second must be a positive"),
    "same ids": (dict(video_token_id=IMAGE), "must differ"),
    "float id": (dict(image_token_id=5.0), "image_token_id must be a Python int"),
    "bad merge": (dict(spatial_merge_size=0), "spatial_merge_size must be >= 1"),
}


@pytest.mark.parametrize("case", ERRORS, ids=list(ERRORS))
def test_errors_name_the_argument(case):
    over, message = ERRORS[case]
    with pytest.raises((ValueError, TypeError), match=message.replace("[", r"\[").replace("]", r"\]")):
        ours(example(), **over)


def test_errors_on_tokens():
    b = example()
    with pytest.raises(ValueError, match="image 0 starts at row 0 column 3 without vision_start_token_id=3"):
        ours({**b, "ids": torch.where(b["ids"] == START, 7, b["ids"])})
    # same totals, but the image is 2 tokens short and the video run starts 2 early: grids do not fit the runs
    short = b["ids"].clone()
    short[0, 5:7] = torch.tensor([12, 12])
    with pytest.raises(ValueError, match="input_ids holds 2 real image tokens"):
        ours({**b, "ids": short})
    two = {**b, "images": torch.tensor([[1, 1, 2], [1, 1, 2]]), "merge": 1}  # 4 tokens split into two items
    with pytest.raises(ValueError, match="image 1 starts at row 0 column 5 without vision_start"):
        ours({**two, "videos": torch.tensor([[3, 1, 2]])})
    split = torch.tensor([[START, IMAGE, IMAGE], [IMAGE, IMAGE, 7]])  # one image's tokens over two rows
    with pytest.raises(ValueError, match=r"image 0 \(image_grid_thw\[0\] -> 4 tokens\) does not match"):
        mrope_position_ids(split, image_grid_thw=torch.tensor([[1, 2, 2]]), spatial_merge_size=1, **IDS)
    with pytest.raises(TypeError, match="input_ids has dtype"):
        mrope_position_ids(b["ids"].float(), **IDS)
    with pytest.raises(ValueError, match=r"input_ids must be \[b, s\]"):
        mrope_position_ids(b["ids"][None], **IDS)
    with pytest.raises(ValueError, match="attention_mask must be 2-D"):
        mrope_position_ids(b["ids"], b["mask"][0], **IDS)


# ------------------------------------------------------------------------------- positions through layouts


def ref_bshd(x, mask, tp):
    """Each row's real tokens moved left into ``[b, width, *]`` (width: longest row rounded up to tp)."""
    seqs = [x[i][mask[i]] for i in range(mask.shape[0])]
    width = -(-max((len(q) for q in seqs), default=0) // tp) * tp
    out = x.new_zeros(mask.shape[0], width, *x.shape[2:])
    for i, q in enumerate(seqs):
        out[i, : len(q)] = q
    return out


def arrange(pos_bsk, form):
    """[b, s, k] positions in the caller's form: "flat" [b, s], "first" [k, b, s] or "last" [b, s, k]."""
    return {"flat": pos_bsk[..., 0], "first": pos_bsk.movedim(-1, 0), "last": pos_bsk}[form]


def from_tokens_last(y, form):  # a layout's [tokens..., k] in the form pack_positions returns
    return {"flat": y[..., 0], "first": y.movedim(-1, 0), "last": y}[form]


forms = st.sampled_from(["flat", "first", "last"])
coord_dims = {"flat": None, "first": 0, "last": -1}


@given(masks(max_b=5, max_s=20), st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (1, 3), (3, 2)]),
       st.booleans(), forms, st.booleans(), st.integers(1, 4))
def test_thd_positions_per_rank_equal_a_loop_and_unpack_inverts(mask, par, verl_align, form, explicit, k):
    tp, cp = par
    align = (2 * tp * cp if cp > 1 else tp) if verl_align else None
    pos = random_tensor((*mask.shape, k), torch.int64, seed=k)
    x = arrange(pos, form)
    kw = dict(coord_dim=coord_dims[form]) if explicit or form == "last" else {}  # 3-D default: [k, b, s]
    packed = []
    for rank in range(cp):
        info = pf.plan_thd(mask, tp_size=tp, cp_size=cp, cp_rank=rank, seq_align=align)
        got = pf.pack_positions(x, info, **kw)
        assert torch.equal(got, from_tokens_last(ref_thd_rank(pos, mask, tp, cp, rank, align), form))
        packed.append(got)
    back = pf.unpack_positions(packed if cp > 1 else packed[0], info, fill_value=-7, **kw)
    assert torch.equal(back, arrange(ref_masked(pos, mask, -7), form))


@given(masks(max_b=5, max_s=20), st.integers(1, 3), forms)
def test_unpad_and_bshd_positions_equal_a_loop_and_invert(mask, tp, form):
    pos = random_tensor((*mask.shape, 3), torch.int64, seed=tp)
    x = arrange(pos, form)
    kw = dict(coord_dim=coord_dims[form])
    info = pf.plan_unpad(mask)
    got = pf.pack_positions(x, info, **kw)
    assert torch.equal(got, from_tokens_last(ref_unpad(pos, mask), form))
    assert torch.equal(pf.unpack_positions(got, info, **kw), arrange(ref_masked(pos, mask), form))
    info = pf.plan_bshd(mask, tp_size=tp)
    got = pf.pack_positions(x, info, **kw)
    assert torch.equal(got, from_tokens_last(ref_bshd(pos, mask, tp), form))
    assert torch.equal(pf.unpack_positions(got, info, fill_value=3, **kw), arrange(ref_masked(pos, mask, 3), form))


def test_mrope_positions_through_cp2_and_a_bucket():
    b = example()
    pos, _ = ours(b)  # [3, b, s]
    mask = b["mask"]
    ranks = []
    for rank in range(2):
        info = pf.plan_thd(mask, cp_size=2, cp_rank=rank)
        ranks.append(pf.pack_positions(pos, info))
        assert torch.equal(ranks[-1].T, ref_thd_rank(pos.movedim(0, -1), mask, 1, 2, rank))
    assert torch.equal(pf.unpack_positions(ranks, info), pos)  # pads of mrope are 0 already
    bucket = plan_thd_bucket(mask, Bucket(tokens=32, max_seqlen=24), cp_size=2, cp_rank=1)
    got = pf.pack_positions(pos, bucket)
    want = ref_thd_rank(pos.movedim(0, -1), mask, 1, 2, 1)  # the batch's own layout, then the spare sequences
    assert got.shape == (3, 16) and torch.equal(got[:, : len(want)].T, want) and not got[:, len(want):].any()


@pytest.mark.parametrize("k", [None, 3])
def test_nested_positions(k):
    lengths = [5, 0, 3, 8]
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 99, (n, *((k,) if k else ())), generator=g) for n in lengths]
    nested = torch.nested.nested_tensor(seqs, layout=torch.jagged)
    padded = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    bsk = padded if k else padded[..., None]
    outs = []
    for rank in range(2):
        info = pf.plan_thd(None, x=nested, cp_size=2, cp_rank=rank)
        outs.append(pf.pack_positions(nested, info))
        want = ref_thd_rank(bsk, mask, 1, 2, rank)
        assert torch.equal(outs[-1], want if k else want[..., 0])
    back = pf.unpack_positions(outs, info)
    assert back.is_nested and all(torch.equal(a, q) for a, q in zip(back.unbind(), seqs))
    bshd = pf.plan_bshd(None, x=nested)
    assert torch.equal(pf.pack_positions(nested, bshd), ref_bshd(padded, mask, 1))
    with pytest.raises(ValueError, match="coordinates are last" if k else "drop coord_dim"):
        pf.unpack_positions(outs, info, coord_dim=0)


def test_float_positions_under_vmap():
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).bool()
    stack = random_tensor((4, 2, 5, 3), torch.float32, seed=1)  # four batches of [b, s, 3] float positions
    infos = [pf.plan_thd(mask, cp_size=2, cp_rank=r) for r in range(2)]
    for coord_dim, x in ((-1, stack), (0, stack.movedim(-1, 1))):
        packed = [torch.func.vmap(lambda p, i=i: pf.pack_positions(p, i, coord_dim=coord_dim))(x) for i in infos]
        for j in range(4):
            for r in range(2):
                assert torch.equal(packed[r][j], pf.pack_positions(x[j], infos[r], coord_dim=coord_dim))
        back = torch.func.vmap(lambda a, b: pf.unpack_positions([a, b], infos[0], coord_dim=coord_dim))(*packed)
        assert torch.equal(back, torch.stack([ref_masked(p, mask) for p in stack]).movedim(-1, 1 if coord_dim == 0 else -1))


def test_packing_errors():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]]).bool()
    info = pf.plan_thd(mask)
    pos = torch.zeros(2, 3, 3, dtype=torch.long)  # [b, s, k] with b=2, s=3, k=3: read as [k, b, s] by default
    with pytest.raises(ValueError, match=r"looks like \[b, s, k\]: pass coord_dim=-1"):
        pf.pack_positions(pos, info)
    assert pf.pack_positions(pos, info, coord_dim=-1).shape == (5, 3)
    with pytest.raises(ValueError, match=r"looks like \[k, b, s\]: pass coord_dim=0"):
        pf.pack_positions(torch.zeros(4, 2, 3), info, coord_dim=-1)
    with pytest.raises(ValueError, match="coord_dim must be None, 0 or -1"):
        pf.pack_positions(pos, info, coord_dim=1)
    with pytest.raises(ValueError, match="drop coord_dim"):
        pf.pack_positions(torch.zeros(2, 3), info, coord_dim=0)
    with pytest.raises(TypeError, match="plan must be an UnpadInfo, ThdInfo or BshdInfo"):
        pf.pack_positions(torch.zeros(2, 3), mask)
    with pytest.raises(ValueError, match="got 2 tensors but a THD with cp_size=1 plan takes one"):
        pf.unpack_positions([torch.zeros(5), torch.zeros(5)], info)
    with pytest.raises(ValueError, match="plan was made from a padded batch"):
        pf.pack_positions(torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged), info)


# ------------------------------------------------------------------------------------------------ pictures


def test_pictures_show_every_token_coordinates_and_owner():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from packfwd.viz import draw_mrope_cp_split, draw_mrope_positions, vision_items

    b = example()
    pos, _ = ours(b)
    ids, mask = b["ids"], b["mask"]
    items, names = vision_items(ids, mask, image_token_id=IMAGE, video_token_id=VIDEO)
    assert names == ["image 0", "video 0"] and (items == 0).sum() == 4 and (items == 1).sum() == 6
    ax = draw_mrope_positions(Figure().subplots(), pos, ids, mask, image_token_id=IMAGE, video_token_id=VIDEO)
    assert len(ax.patches) == 3 * ids.numel() and sum(bool(p.get_hatch()) for p in ax.patches) == 3 * (~mask).sum()
    labels = [int(t.get_text()) for t in ax.texts]  # real tokens only, row after row, t then h then w
    colours = [tuple(p.get_facecolor()) for p in ax.patches[: ids.shape[1]]]  # row 0's t cells
    by_item = {k: {c for c, i, m in zip(colours, items[0].tolist(), mask[0].tolist()) if i == k and m}
               for k in (-1, 0, 1)}  # text, image 0, video 0: one colour each, all different
    assert all(len(c) == 1 for c in by_item.values()) and len(set.union(*by_item.values())) == 3
    assert labels == [v for i in range(3) for c in range(3) for v in pos[c, i][mask[i]].tolist()]
    ax = draw_mrope_cp_split(Figure().subplots(), pos, ids, mask, image_token_id=IMAGE, video_token_id=VIDEO, cp_size=2)
    want = []
    for r in range(2):
        info = pf.plan_thd(mask, cp_size=2, cp_rank=r)
        real = pf.to_thd(mask, info)[0]
        want += [v for c in range(3) for v in pf.pack_positions(pos, info)[c][real].tolist()]
    assert [int(t.get_text()) for t in ax.texts] == want
    assert len(ax.patches) == 3 * 2 * info.local_tokens
