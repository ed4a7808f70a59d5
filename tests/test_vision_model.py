"""packfwd's vision-language model and the ``make_forward(vision=True)`` hook, against transformers and verl 0.9.1.

Strategy.  References are transformers' own ``Qwen2VLForConditionalGeneration`` /
``Qwen2_5_VLForConditionalGeneration`` (tiny random configs, float32), run on each sequence alone (no padding;
transformers computes the multimodal RoPE positions itself from ``mm_token_type_ids``), and verl 0.9.1's own
vision branch of ``model_forward_gen`` and its ``preprocess_packed_seqs`` (loaded by ``tests/verl_forward_ref.py``).
The batch is ragged and padded both ways: text with one image, text with two images of different grids, text
alone, and a video (Qwen2.5-VL: frames spaced by ``tokens_per_second * second_per_grid_ts``).  packfwd runs it as
``packfwd.vision.from_hf(hf)``: transformers' vision tower -> merged embeddings -> the ``packing`` hook -> packfwd's
Megatron-Core language model (``position_embedding_type="mrope"``).

* logits on every real token equal transformers' per sequence: THD, BSHD, the verl drop-in's vision forward,
  and THD under CP=2 and under TP=2 with sequence parallelism (gloo); tolerance ``atol=rtol=1e-5`` (float32;
  the largest difference seen is ~2e-6, while text-only positions, a wrong ``mrope_section`` or Qwen2.5-VL
  without its temporal spacing move the logits by more than 0.05, so the test can fail);
* the parameter gradients of a weighted sum of the logits equal transformers' (vision tower and language model,
  HF gradients mapped to Megatron's names by ``hf_to_megatron``): ``rtol=1e-4`` and ``atol=1e-5`` times the
  tensor's largest gradient (float32 sums in another order; the largest difference seen is ~1e-6 of it);
* what the hook gives the model equals what verl's vision branch gives it (ids, mask, positions, images,
  ``PackedSeqParams``), and ``packing.embeddings`` of a ``[b, s, h]`` tensor equals verl's
  ``preprocess_packed_seqs`` of it on every CP rank: image tokens land where verl's layout puts them;
* the multimodal RoPE angles equal Megatron-Core's own ``MultimodalRotaryEmbedding`` bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import pytest
import torch
from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                          Qwen2VLForConditionalGeneration)

import packfwd as pf
import packfwd.verl as pv
from packfwd.engine import Thd
from packfwd.testing import run_local
from packfwd.vision import from_hf

from .verl_forward_ref import load_verl_forward
from .verl_ref import patched_mpu

IMAGE, VIDEO, START, END = 120, 121, 122, 123
TOL = dict(atol=1e-5, rtol=1e-5)
SEQUENCES = (  # (token layout, items): ("t", n) n text tokens, ("image" | "video", (T, H, W)) one item
    [("t", 3), ("image", (1, 4, 4)), ("t", 5)],
    [("t", 2), ("image", (1, 2, 4)), ("t", 2), ("image", (1, 4, 2)), ("t", 3)],
    [("t", 6)],
    [("video", (2, 4, 4)), ("t", 4)],
)


@pytest.fixture(autouse=True)
def one_process_world():
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel()


def hf_model(kind: str):
    """A tiny transformers Qwen2-VL / Qwen2.5-VL (float32, seeded): 2 layers, GQA, head dim 16, mrope (2, 3, 3)."""
    torch.manual_seed(0)
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, initializer_range=0.1,
                rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3], rope_theta=10000.0))
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    patches = dict(patch_size=2, temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
    if kind == "qwen2_vl":
        vision = dict(depth=1, embed_dim=16, hidden_size=64, num_heads=2, mlp_ratio=2, **patches)
        return Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision, **ids)).eval()
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, window_size=8,
                  fullatt_block_indexes=[1], tokens_per_second=2, **patches)
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)).eval()


def vl_batch(seed: int = 1):
    """The padded batch (rows 1 and 3 left-padded), its images for the whole batch, and each sequence alone."""
    g = torch.Generator().manual_seed(seed)
    rows, alone = [], []
    for layout in SEQUENCES:
        tokens, items = [], {"image": [], "video": []}
        for kind, arg in layout:
            if kind == "t":
                tokens += torch.randint(10, 100, (arg,), generator=g).tolist()
            else:
                t, h, w = arg
                tokens += [START] + [IMAGE if kind == "image" else VIDEO] * (t * h * w // 4) + [END]
                items[kind].append((arg, torch.randn(t * h * w, 24, generator=g)))
        rows.append(tokens)
        alone.append(_multimodal(items["image"], items["video"]))
    s = max(map(len, rows)) + 2
    ids = torch.zeros(len(rows), s, dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, row in enumerate(rows):
        start = s - len(row) if i % 2 else 0
        ids[i, start:start + len(row)], mask[i, start:start + len(row)] = torch.tensor(row), True
    images = [x for a in alone for x in zip(a.get("image_grid_thw", []), a.get("pixel_values", []).split(
        [int(t * h * w) for t, h, w in a.get("image_grid_thw", [])]) if "pixel_values" in a else [])]
    videos = [x for a in alone for x in zip(a.get("video_grid_thw", []), a.get("pixel_values_videos", []).split(
        [int(t * h * w) for t, h, w in a.get("video_grid_thw", [])]) if "pixel_values_videos" in a else [])]
    return ids, mask, _multimodal(images, videos), rows, alone


def _multimodal(images, videos) -> dict:
    out = {}
    if images:
        out.update(pixel_values=torch.cat([p for _, p in images]),
                   image_grid_thw=torch.tensor([list(map(int, g)) for g, _ in images]))
    if videos:
        out.update(pixel_values_videos=torch.cat([p for _, p in videos]),
                   video_grid_thw=torch.tensor([list(map(int, g)) for g, _ in videos]),
                   second_per_grid_ts=torch.full((len(videos),), 2.0))
    return out


def hf_logits(hf, rows, alone, kind: str) -> list[torch.Tensor]:
    """transformers on each sequence alone (on the model's device): ``[n_i, v]``."""
    device = next(hf.parameters()).device
    kinds = "mm_token_type_ids" in inspect.signature(type(hf.model).forward).parameters  # transformers >= 5.x
    out = []
    for row, mm in zip(rows, alone):
        ids = torch.tensor(row, device=device)[None]
        mm = {k: v.to(device) for k, v in mm.items() if kind == "qwen2_5_vl" or k != "second_per_grid_ts"}
        if kinds:
            mm["mm_token_type_ids"] = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
        out.append(hf(input_ids=ids, **mm).logits[0])
    return out


def assert_equal_on_real_tokens(out, mask, refs):
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[i][mask[i]], ref, **TOL)
    assert not out[~mask].any()


@functools.lru_cache(maxsize=None)
def setup(kind: str):
    hf = hf_model(kind)
    ids, mask, mm, rows, alone = vl_batch()
    if kind == "qwen2_vl":
        mm.pop("second_per_grid_ts", None)
    with torch.no_grad():
        refs = hf_logits(hf, rows, alone, kind)
    return hf, from_hf(hf), ids, mask, mm, refs


# ----------------------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_logits_equal_transformers_per_sequence(kind, data_format):
    hf, model, ids, mask, mm, refs = setup(kind)
    with torch.no_grad():
        out = pf.make_forward(data_format, vision=True)(model, ids, mask, multi_modal_inputs=mm)
    assert_equal_on_real_tokens(out, mask, refs)


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_verl_dropin_vision_forward_equals_transformers(data_format):
    """packfwd.verl's vision forward hands packfwd's model the hook with verl's plan (verl's layout)."""
    hf, model, ids, mask, mm, refs = setup("qwen2_vl")
    with torch.no_grad():
        out = pv.model_forward_gen(vision_model=True)(model, ids, mask, None, mm, data_format=data_format)
    assert_equal_on_real_tokens(out, mask, refs)


def test_gradients_equal_transformers():
    """A weighted sum of the logits: the vision tower's and the language model's gradients equal transformers'."""
    from packfwd.models.runtime.gpt import model_args
    from packfwd.models.convert.hf_vl import language_model_state_dict
    from packfwd.models.convert.hf_weights import hf_to_megatron

    hf, model, ids, mask, mm, _ = setup("qwen2_vl")
    _, _, _, rows, alone = vl_batch()
    weight = torch.randn(*ids.shape, 128, generator=torch.Generator().manual_seed(3))
    hf.zero_grad()
    sum(ref.mul(weight[i][mask[i]]).sum() for i, ref in enumerate(hf_logits(hf, rows, alone, "qwen2_vl"))).backward()
    want_visual = {n: p.grad.clone() for n, p in hf.model.visual.named_parameters()}
    want_lm = hf_to_megatron(language_model_state_dict({n: p.grad for n, p in hf.named_parameters()}),
                             model_args(model.language_model))
    hf.zero_grad()
    model.zero_grad()
    pf.make_forward("thd", vision=True)(model, ids, mask, multi_modal_inputs=mm).mul(weight).sum().backward()
    got = {**{f"visual.{n}": p.grad for n, p in model.visual.named_parameters()},
           **{n: p.grad for n, p in model.language_model.named_parameters()}}
    want = {**{f"visual.{n}": g for n, g in want_visual.items()}, **want_lm}
    assert got.keys() == want.keys()
    for name, grad in got.items():  # float32 sums over ~100 tokens in another order: relative to the largest entry
        torch.testing.assert_close(grad, want[name], atol=1e-5 * float(want[name].abs().max()), rtol=1e-4)


def test_text_batch_through_the_text_forward():
    """The multimodal-RoPE language model on a text batch: [b, s] (THD [1, t]) positions are three equal
    coordinates, as transformers gives text."""
    hf, model, *_ = setup("qwen2_vl")
    ids = torch.randint(10, 100, (3, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :2], mask[2, 5:] = False, False
    with torch.no_grad():
        refs = [hf(input_ids=ids[i][mask[i]][None]).logits[0] for i in range(3)]
        for data_format in ("thd", "bshd"):
            assert_equal_on_real_tokens(pf.make_forward(data_format)(model.language_model, ids, mask), mask, refs)
        assert_equal_on_real_tokens(model.language_model(ids, None, mask), mask, refs)  # BSHD padding mask


def _parallel_ranks(rank: int, world_size: int) -> dict:
    """One rank of a CP=2 world, then of a TP=2 world with sequence parallelism (the same two processes):
    make_forward's and the verl drop-in's vision forwards; the logits (CP: gathered over the ranks; TP: this rank's
    half of the vocabulary) and transformers' per sequence."""
    from megatron.core import parallel_state

    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel(cp_size=world_size)
    hf, model, ids, mask, mm, refs = setup("qwen2_vl")
    group = parallel_state.get_context_parallel_group()
    with torch.no_grad():
        cp = pf.make_forward("thd", vision=True, cp_size=world_size, cp_rank=rank, cp_group=group)(
            model, ids, mask, multi_modal_inputs=mm)
        cp_dropin = pv.model_forward_gen(vision_model=True)(model, ids, mask, None, mm)
    parallel_state.destroy_model_parallel()
    ensure_model_parallel(tp_size=world_size)
    model = from_hf(hf, sequence_parallel=True)
    with torch.no_grad():
        tp = pf.make_forward("thd", vision=True, tp_size=world_size)(model, ids, mask, multi_modal_inputs=mm)
        tp_dropin = pv.model_forward_gen(vision_model=True)(model, ids, mask, None, mm)
    v = tp.shape[-1]
    return dict(cp=cp, cp_dropin=cp_dropin, tp=tp, tp_dropin=tp_dropin, mask=mask, refs=refs,
                tp_refs=[r[:, rank * v:(rank + 1) * v] for r in refs])


def test_context_and_tensor_parallel_logits_equal_transformers():
    for result in run_local(_parallel_ranks, 2, backend="gloo", timeout=300):
        for key in ("cp", "cp_dropin", "tp", "tp_dropin"):
            assert_equal_on_real_tokens(result[key], result["mask"], result["tp_refs" if "tp" in key else "refs"])


# ------------------------------------------------------------------------------------------ against verl


vf = load_verl_forward()
needs_verl = pytest.mark.skipif(vf is None, reason="verl is not installed (make test installs it with --no-deps)")


class HookRecorder(torch.nn.Module):
    """Records its keyword arguments; returns zeros in the packed layout (through the hook when it gets one)."""

    def __init__(self):
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(sequence_parallel=False, fp8=None)
        self.pre_process = self.post_process = True
        self.calls = []

    def forward(self, input_ids, position_ids=None, attention_mask=None, packed_seq_params=None, packing=None, **mm):
        self.calls.append(dict(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                               packed_seq_params=packed_seq_params, packing=packing, **mm))
        if packing is not None:
            return packing.embeddings(torch.zeros(*input_ids.shape, 3)).transpose(0, 1)
        if packed_seq_params is not None:
            return torch.zeros(1, int(packed_seq_params.cu_seqlens_q_padded[-1]), 3)
        return torch.zeros(*input_ids.shape, 3)


@needs_verl
@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_hook_gives_the_model_what_verl_gives(data_format):
    """make_forward(vision=True) (verl's alignment) and packfwd.verl against verl's vision branch: the same
    ids, mask, positions, images and PackedSeqParams (make_forward's cu_seqlens_q holds the real lengths,
    verl's the padded ones: both valid, pads sit at each sequence's tail), plus the hook."""
    _, _, ids, mask, mm, _ = setup("qwen2_vl")
    ref, ours, dropin = HookRecorder(), HookRecorder(), HookRecorder()
    vf.model_forward_gen(True)(ref, ids, mask, None, mm, data_format=data_format)
    pf.make_forward(data_format, vision=True, **({"seq_align": 1} if data_format == "thd" else {}))(
        ours, ids, mask, multi_modal_inputs=mm)
    pv.model_forward_gen(True)(dropin, ids, mask, None, mm, data_format=data_format)
    (r,), (o,), (d,) = ref.calls, ours.calls, dropin.calls
    assert r.pop("packing") is None and o.pop("packing") is not None and d.pop("packing") is not None
    assert r.keys() == o.keys() == d.keys()
    for key in r:
        if key == "packed_seq_params" and r[key] is not None:
            for field in ("qkv_format", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv",
                          "cu_seqlens_q"):
                want = getattr(r[key], field)
                assert _same(getattr(d[key], field), want), field
                if field == "cu_seqlens_q":
                    want = torch.nn.functional.pad(mask.sum(1).cumsum(0), (1, 0)).int()  # real lengths
                assert _same(getattr(o[key], field), want), field
        else:
            assert _same(o[key], r[key]) and _same(d[key], r[key]), key


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@needs_verl
@pytest.mark.parametrize("cp", [1, 2])
def test_packed_embeddings_are_where_verls_layout_puts_them(cp):
    """packing.embeddings of merged [b, s, h] embeddings (make_forward's plan at verl's alignment, and the verl
    drop-in's) equals verl's preprocess_packed_seqs of them on every CP rank, and packing.positions of [3, b, s]
    positions equals it per coordinate."""
    from packfwd.forward.vision import VisionPacking
    from packfwd.verl.layouts import VerlThd

    util = vf.preprocess_packed_seqs.__globals__
    _, _, ids, mask, _, _ = setup("qwen2_vl")
    embeddings = torch.randn(*ids.shape, 8)
    positions = torch.randint(0, 50, (3, *ids.shape))
    for rank in range(cp):
        with patched_mpu(_module(util), 1, cp, rank):
            want = vf.preprocess_packed_seqs(embeddings, mask, pre_process=True)[0][0]  # [t_local, h]
            want_pos = torch.stack([vf.preprocess_packed_seqs(p, mask, pre_process=True)[0][0] for p in positions])
        plan, _ = Thd(1, cp, rank, None, 2 * cp if cp > 1 else 1).pack(ids, mask)
        for hook in (VisionPacking(plan), VisionPacking(VerlThd(1, cp, rank, None).plan(ids, mask))):
            assert torch.equal(hook.embeddings(embeddings)[:, 0], want)
            assert torch.equal(hook.positions(positions)[:, 0], want_pos)  # pads: 0 in both


def _module(globals_: dict):
    from types import SimpleNamespace

    return SimpleNamespace(mpu=globals_["mpu"])


# ------------------------------------------------------------------------------------ Megatron and errors


def test_mrope_angles_equal_megatron_multimodal_rotary_embedding():
    """Megatron-Core's MultimodalRotaryEmbedding.forward (its inv_freq set on the CPU: its constructor needs CUDA)
    and packfwd's rotary module give the same [s, b, 1, d] angles, bit for bit."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    ours = setup("qwen2_vl")[1].language_model.rotary_pos_emb
    theirs = MultimodalRotaryEmbedding.__new__(MultimodalRotaryEmbedding)
    torch.nn.Module.__init__(theirs)
    theirs.inv_freq, theirs.rotary_interleaved, theirs.seq_len_interpolation_factor = ours.inv_freq, False, None
    theirs.cp_group = None
    positions = torch.randint(0, 4000, (3, 2, 9))
    assert torch.equal(ours(positions, [2, 3, 3]), theirs(positions, [2, 3, 3]))


def test_bad_inputs_name_the_fix():
    from packfwd.models import ModelArgs

    hf, model, ids, mask, mm, _ = setup("qwen2_vl")
    with pytest.raises(ValueError, match="packing"):
        model(ids, None, mask, **mm)
    with pytest.raises(ValueError, match="image_grid_thw"):
        pf.make_forward("thd", vision=True)(model, ids, mask, multi_modal_inputs=dict(mm, image_grid_thw=mm[
            "image_grid_thw"][:2]))
    with pytest.raises(ValueError, match="no image pixels"):
        pf.make_forward("thd", vision=True)(model, ids, mask, multi_modal_inputs={
            k: v for k, v in mm.items() if k != "pixel_values"})
    with pytest.raises(ValueError, match="mrope_section"):
        ModelArgs(vocab_size=8, hidden_size=16, ffn_hidden_size=8, num_layers=1, num_attention_heads=2,
                  mrope_section=(1, 1, 1))
    with pytest.raises(ValueError, match=r"takes \[3, 2, 5\]"):
        model.language_model(ids[:2, :5], torch.zeros(2, 2, 5, dtype=torch.long), None)


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_positions_of_another_coordinate_count_are_refused_in_the_callers_shape(data_format):
    """Hazard: [4, b, s] positions (a text row and (t, h, w), as some trainers hand Qwen2-VL) went past the forward's
    check and the vision tower, and the language model refused them in its packed shape ((4, 1, 49): no dim the
    caller had).  The forward checks them against the model's three coordinates, in the caller's shape, first."""
    hf, model, ids, mask, mm, _ = setup("qwen2_vl")
    text = (mask.long().cumsum(1) - 1).clamp(min=0)
    four = torch.stack([text] * 4)
    called = []
    hook = model.visual.register_forward_hook(lambda *_: called.append(1))
    try:
        with pytest.raises(ValueError, match=rf"position_ids has shape \(4, {ids.shape[0]}, {ids.shape[1]}\).*"
                                             rf"takes \[3, {ids.shape[0]}, {ids.shape[1]}\]"):
            pf.make_forward(data_format, vision=True)(model, ids, mask, four, multi_modal_inputs=mm)
    finally:
        hook.remove()
    assert not called, "refused before the vision tower ran"


# ----------------------------------------------------------------------------------------------- micro-batches


def test_micro_batches_cut_the_multimodal_inputs_per_sequence():
    """``run_micro_batches`` with one multimodal dict per sequence: every micro-batch gets its rows' images and
    videos; logits equal transformers' per sequence, gradients the whole batch's."""
    from packfwd.micro import plan_micro_batches, run_micro_batches

    hf, model, ids, mask, mm, refs = setup("qwen2_vl")
    _, _, _, _, alone = vl_batch()
    alone = [{k: v for k, v in a.items() if k != "second_per_grid_ts"} or None for a in alone]  # Qwen2-VL: none
    seqlens = mask.sum(-1).tolist()
    plan = plan_micro_batches(seqlens, max_tokens=29)  # 14, 15, 6, 14 tokens: two micro-batches
    # Rows 0 and 1 (one image, two images) together, so the cut must keep their images in row order; 2 and 3
    # (text, a video) in the other.
    plan = dataclasses.replace(plan, micro_batches=[[[0, 1], [2, 3]]], tokens=[[29, 20]])
    forward = pf.make_forward("thd", vision=True)
    with torch.no_grad():
        got = run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, multi_modal_inputs=alone)
    assert got.rows == list(range(len(seqlens)))
    assert_equal_on_real_tokens(got.outputs, mask, refs)

    weight = torch.randn(*ids.shape, 128, generator=torch.Generator().manual_seed(5))
    model.zero_grad()
    forward(model, ids, mask, multi_modal_inputs=mm).mul(weight).mul(mask[..., None]).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, multi_modal_inputs=alone, normalize="sum",
                      loss_fn=lambda out, w: out.mul(w).sum(-1), loss_args={"w": weight})
    got_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got_grads.keys() == want.keys() and any(n.startswith("visual.") for n in want)
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want[name], atol=1e-5 * float(want[name].abs().max()), rtol=1e-4)

    with pytest.raises(TypeError, match="one dict per sequence"):
        run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, multi_modal_inputs=mm)
    with pytest.raises(ValueError, match="one per sequence"):
        run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, multi_modal_inputs=alone[:-1])


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_moe_aux_loss_composes_with_the_vision_hook(data_format):
    """``make_forward(vision=True, moe_aux_loss=True)`` on a vision model whose language model has MoE layers (two
    extensions of one engine): the loss is transformers' formula on the routers' own logits of every real token,
    image tokens included and pads left out."""
    import dataclasses

    from packfwd.models import build_model
    from packfwd.models.mlp.moe import Moe
    from packfwd.models.runtime.gpt import model_args
    from packfwd.vision import VisionLanguageModel

    hf, model, ids, mask, mm, _ = setup("qwen2_vl")
    args = dataclasses.replace(model_args(model.language_model), family="qwen3_moe",
                               moe=Moe(num_experts=4, top_k=2, ffn_hidden_size=32))
    torch.manual_seed(0)
    moe = VisionLanguageModel(model.visual, build_model(args), image_token_id=IMAGE, video_token_id=VIDEO,
                              vision_start_token_id=START, spatial_merge_size=model.spatial_merge_size)
    logits = []
    routers = [m for m in moe.modules() if type(m).__name__ == "PackedRouter"]
    hooks = [r.register_forward_hook(lambda m, a, o: logits.append(m.gating(a[0]).reshape(-1, 4)))
             for r in routers]
    try:
        with torch.no_grad():
            out = pf.make_forward(data_format, vision=True, moe_aux_loss=True)(moe, ids, mask, multi_modal_inputs=mm)
    finally:
        for h in hooks:
            h.remove()
    pads = torch.cat([p.reshape(-1) for p in [_router_pads(moe, ids, mask, data_format)] * len(routers)])
    scores = torch.softmax(torch.cat(logits).double(), -1)[~pads]  # [layers * real tokens, E]
    chosen = torch.nn.functional.one_hot(scores.topk(2, -1).indices, 4).double()
    want = (chosen.mean(0) * scores.mean(0)[None]).sum() * 4
    assert int((~pads).sum()) == len(routers) * int(mask.sum())  # every real token, images included
    torch.testing.assert_close(out["moe_aux_loss"].double(), want, atol=1e-6, rtol=1e-6)


def _router_pads(model, ids, mask, data_format):
    """The routers' rows that are layout pads, in the order they route them ([s, b] of the packed batch)."""
    from packfwd.engine import Bshd, Thd

    layout = Thd(1, 1, 0, None, None) if data_format == "thd" else Bshd(1)
    plan = layout.pack(ids, mask)[0]
    pads = layout.padding_mask(plan)  # [1, t] or [b, s_c]
    return pads.T.reshape(-1)
