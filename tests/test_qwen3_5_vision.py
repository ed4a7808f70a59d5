"""Qwen3.5's vision-language model (``Qwen3_5ForConditionalGeneration``) packed by ``packfwd.vision.from_hf``.

Strategy.  transformers is the oracle: its ``Qwen3_5ForConditionalGeneration`` (and, once, the MoE one) on each
sequence alone (no padding; transformers computes the multimodal RoPE positions itself from ``mm_token_type_ids``).
packfwd runs the whole ragged batch, padded both ways: text with one image, text alone, text with two images of
different grids, and a video of two frames (each frame ``<timestamp> <vision_start> tokens <vision_end>``, as
Qwen3.5's processor writes it).  The model is tiny (text hidden 64, 4 layers: 3 Gated DeltaNet, 1 gated full
attention with head dim 32, partial RoPE 0.5, interleaved ``mrope_section`` ``[3, 3, 2]``; vision depth 2, hidden
32) and float64 throughout: the modeling module is ``tests.oracles.hf_float64_module``'s copy (transformers' float32
upcasts of the delta rule and its norms lifted; the RoPE angles keep float32, as packfwd's), O(1)-scale weights.

* logits on every real token equal transformers' per sequence, THD and BSHD, to ``1e-10``; interleaving the
  sections the other way (Qwen2-VL's contiguous layout) or text positions move them by more than ``1e-3``, so the
  test can fail;
* the vision tower's and the language model's gradients of a weighted sum of the logits equal transformers';
* the positions equal transformers' ``get_rope_index`` on the padded batch (each video frame an item of its own);
* the MoE model (``Qwen3_5MoeForConditionalGeneration``, same wiring) equals transformers' (THD, BSHD) to 2e-5
  (Megatron-Core's router softmax is float32);
* refusals name their field: a deepstack vision tower, non-interleaving sections that do not fit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types

import pytest
import torch

import packfwd as pf
from packfwd.models.args import ModelArgs
from packfwd.vision import from_hf, mrope_position_ids

from .oracles import hf_float64_module
from .test_hybrid_families import randomise

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForConditionalGeneration"):
    pytest.skip(f"transformers {transformers.__version__} lacks Qwen3.5", allow_module_level=True)

IMAGE, VIDEO, START, END = 120, 121, 122, 123
TOL = dict(atol=1e-10, rtol=0.0)
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, rms_norm_eps=1e-6,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                 mrope_section=[3, 3, 2], mrope_interleaved=True))
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
           experts_implementation="eager")
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2, temporal_patch_size=2,
              spatial_merge_size=2, in_channels=3, out_hidden_size=64, num_position_embeddings=16)
PATCH = 3 * 2 * 2 * 2  # in_channels * temporal_patch_size * patch_size**2
SEQUENCES = (  # ("t", n): n text tokens; ("image", (T, H, W)) one image; ("video", (T, H, W)) one video
    [("t", 3), ("image", (1, 4, 4)), ("t", 5)],
    [("t", 6)],
    [("t", 2), ("image", (1, 2, 4)), ("t", 2), ("image", (1, 4, 6)), ("t", 3)],
    [("t", 1), ("video", (2, 4, 4)), ("t", 4)],
)


@pytest.fixture(autouse=True)
def one_process_world():
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel()


def hf_model(moe: bool = False, seed: int = 0):
    """The tiny float64 Qwen3.5 (MoE) vision-language model (module docstring)."""
    name = "qwen3_5_moe" if moe else "qwen3_5"
    prefix = "Qwen3_5Moe" if moe else "Qwen3_5"
    lifted = hf_float64_module(f"transformers.models.{name}.modeling_{name}")
    config = getattr(transformers, f"{prefix}Config")(
        text_config=dict(TEXT, **MOE) if moe else TEXT, vision_config=VISION, image_token_id=IMAGE,
        video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
        **(dict(experts_implementation="eager") if moe else {}))
    torch.manual_seed(seed)
    hf = getattr(lifted, f"{prefix}ForConditionalGeneration")(config)
    # Qwen3_5Model builds its parts with AutoModel (transformers' own module): the lifted copy's instead
    hf.model.language_model = getattr(lifted, f"{prefix}TextModel")(config.text_config)
    hf.model.visual = getattr(lifted, f"{prefix}VisionModel")(config.vision_config)
    hf = hf.double()
    randomise(hf, torch.Generator().manual_seed(seed))
    return hf.eval()


def vl_batch(seed: int = 1):
    """The padded batch (rows 1 and 3 left-padded), its images and videos for the whole batch, each sequence alone
    (ids, its multimodal inputs)."""
    g = torch.Generator().manual_seed(seed)
    rows, alone = [], []
    images, videos = [], []
    for layout in SEQUENCES:
        tokens, mine = [], {"image": [], "video": []}
        for kind, arg in layout:
            if kind == "t":
                tokens += torch.randint(10, 100, (arg,), generator=g).tolist()
                continue
            t, h, w = arg
            if kind == "image":
                tokens += [START] + [IMAGE] * (t * h * w // 4) + [END]
            else:  # per frame: a timestamp, then the frame as an item of its own
                for _ in range(t):
                    stamp = int(torch.randint(10, 100, (1,), generator=g))
                    tokens += [stamp, START] + [VIDEO] * (h * w // 4) + [END]
            mine[kind].append((arg, torch.randn(t * h * w, PATCH, generator=g, dtype=torch.float64)))
        rows.append(tokens)
        alone.append(_multimodal(mine["image"], mine["video"]))
        images += mine["image"]
        videos += mine["video"]
    s = max(map(len, rows)) + 2
    ids = torch.zeros(len(rows), s, dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, row in enumerate(rows):
        start = s - len(row) if i % 2 else 0
        ids[i, start:start + len(row)], mask[i, start:start + len(row)] = torch.tensor(row), True
    return ids, mask, _multimodal(images, videos), rows, alone


def _multimodal(images, videos) -> dict:
    out = {}
    if images:
        out.update(pixel_values=torch.cat([p for _, p in images]), image_grid_thw=torch.tensor([g for g, _ in images]))
    if videos:
        out.update(pixel_values_videos=torch.cat([p for _, p in videos]),
                   video_grid_thw=torch.tensor([g for g, _ in videos]))
    return out


def mm_token_types(ids: torch.Tensor) -> torch.Tensor:
    return (ids == IMAGE).int() + 2 * (ids == VIDEO).int()


def hf_logits(hf, rows, alone) -> list[torch.Tensor]:
    """transformers on each sequence alone: ``[n_i, v]``, through its torch reference of the delta rule (where fla
    is installed, transformers releases before 5.25 call fla's Triton kernels even on CPU tensors)."""
    out = []
    with torch_delta_rule(hf):
        for row, mm in zip(rows, alone):
            ids = torch.tensor(row)[None]
            extra = dict(mm, mm_token_type_ids=mm_token_types(ids)) if mm else {}
            out.append(hf(input_ids=ids, **extra).logits[0])
    return out


@contextlib.contextmanager
def torch_delta_rule(hf):
    """While inside, the modeling module of ``hf``'s Gated DeltaNet layers calls transformers' own torch functions
    (the decorated kernels' ``__wrapped__``) for the delta rule."""
    import importlib
    import inspect

    modules = {importlib.import_module(type(m).__module__) for m in hf.modules() if "GatedDeltaNet" in type(m).__name__}
    saved = []
    for module in modules:
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            fn = getattr(module, name, None)
            if fn is not None and inspect.unwrap(fn) is not fn:
                saved.append((module, name, fn))
                setattr(module, name, inspect.unwrap(fn))
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def assert_equal_on_real_tokens(out, mask, refs, **tol):
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[i][mask[i]], ref, **(tol or TOL))
    assert not out[~mask].any()


@functools.lru_cache(maxsize=None)
def setup(moe: bool = False):
    hf = hf_model(moe)
    ids, mask, mm, rows, alone = vl_batch()
    with torch.no_grad():
        refs = hf_logits(hf, rows, alone)
    return hf, from_hf(hf), ids, mask, mm, refs


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_logits_equal_transformers_per_sequence(data_format):
    hf, model, ids, mask, mm, refs = setup()
    assert model.language_model.rotary_pos_emb.mrope_interleaved and model.split_video_frames
    with torch.no_grad():
        out = pf.make_forward(data_format, vision=True)(model, ids, mask, multi_modal_inputs=mm)
    assert_equal_on_real_tokens(out, mask, refs)


def test_the_test_can_fail():
    """Qwen2-VL's contiguous sections, or text positions, move the image rows' logits by more than 1e-3."""
    hf, model, ids, mask, mm, refs = setup()
    forward = pf.make_forward("thd", vision=True)
    rotary = model.language_model.rotary_pos_emb
    with torch.no_grad():
        try:
            rotary.mrope_interleaved = False
            contiguous = forward(model, ids, mask, multi_modal_inputs=mm)
        finally:
            rotary.mrope_interleaved = True
        text = forward(model, ids, mask, position_ids=(mask.cumsum(1) - 1) * mask, multi_modal_inputs=mm)
    for out in (contiguous, text):
        for i in (0, 2, 3):  # the rows with images or a video
            assert (out[i][mask[i]] - refs[i]).abs().max() > 1e-3


def test_gradients_equal_transformers():
    """A weighted sum of the logits: the vision tower's and the language model's gradients equal transformers'."""
    from packfwd.models.convert.hf_vl import language_model_state_dict
    from packfwd.models.convert.hf_weights import hf_to_megatron
    from packfwd.models.runtime.gpt import model_args

    hf, model, ids, mask, mm, _ = setup()
    _, _, _, rows, alone = vl_batch()
    weight = torch.randn(*ids.shape, 128, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    hf.zero_grad()
    sum(ref.mul(weight[i][mask[i]]).sum() for i, ref in enumerate(hf_logits(hf, rows, alone))).backward()
    want = {f"visual.{n}": p.grad.clone() for n, p in hf.model.visual.named_parameters()}
    want.update(hf_to_megatron(language_model_state_dict({n: p.grad for n, p in hf.named_parameters()}),
                               model_args(model.language_model)))
    hf.zero_grad()
    model.zero_grad()
    pf.make_forward("thd", vision=True)(model, ids, mask, multi_modal_inputs=mm).mul(weight).sum().backward()
    got = {**{f"visual.{n}": p.grad for n, p in model.visual.named_parameters()},
           **{n: p.grad for n, p in model.language_model.named_parameters()}}
    model.zero_grad()
    hf.zero_grad()
    assert got.keys() == want.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], atol=1e-9 * float(want[name].abs().max()), rtol=1e-9)


def test_positions_equal_transformers_get_rope_index():
    hf, model, ids, mask, mm, _ = setup()
    want, want_delta = hf.model.get_rope_index(ids, mm_token_types(ids), image_grid_thw=mm["image_grid_thw"],
                                               video_grid_thw=mm["video_grid_thw"], attention_mask=mask)
    got, delta = mrope_position_ids(ids, mask, image_grid_thw=mm["image_grid_thw"], video_grid_thw=mm["video_grid_thw"],
                                    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                                    split_video_frames=True)
    assert torch.equal(got, want) and torch.equal(delta, want_delta.reshape(-1))
    with pytest.raises(ValueError, match="video_grid_thw"):  # the video taken whole: Qwen2-VL's rule
        mrope_position_ids(ids, mask, image_grid_thw=mm["image_grid_thw"], video_grid_thw=mm["video_grid_thw"],
                           image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START)


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_moe_logits_equal_transformers(data_format):
    """Qwen3_5MoeForConditionalGeneration: the same wiring, the MoE language model (its router's softmax in
    float32 in Megatron-Core: tests/test_hybrid_families.py's tolerance).  BSHD: the merged embeddings reach the
    MoE dispatcher contiguous."""
    hf, model, ids, mask, mm, refs = setup(moe=True)
    assert model.language_model.config.num_moe_experts == 4
    with torch.no_grad():
        out = pf.make_forward(data_format, vision=True)(model, ids, mask, multi_modal_inputs=mm)
    assert_equal_on_real_tokens(out, mask, refs, atol=2e-5, rtol=1e-5)


def test_what_is_refused_names_the_field():
    hf, *_ = setup()
    vision = types.SimpleNamespace(**vars(hf.config.vision_config), deepstack_visual_indexes=[0, 1])
    fake = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=vision), model=hf.model)
    with pytest.raises(ValueError, match=r"deepstack_visual_indexes=\[0, 1\]"):
        from_hf(fake)
    base = dict(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=1, num_attention_heads=2, head_dim=32)
    with pytest.raises(ValueError, match="mrope_interleaved=True without mrope_section"):
        ModelArgs(**base, mrope_interleaved=True)
    with pytest.raises(ValueError, match="sum to the rotated channels // 2 = 8"):  # partial RoPE: 16 of 32 rotate
        ModelArgs(**base, rotary_percent=0.5, mrope_section=(6, 5, 5))
    with pytest.raises(ValueError, match="height takes frequencies 1, 4, ..., 10"):
        ModelArgs(**base, rotary_percent=0.5, mrope_section=(1, 4, 3), mrope_interleaved=True)
    args = ModelArgs(**base, rotary_percent=0.5, mrope_section=(3, 3, 2), mrope_interleaved=True)
    assert dataclasses.replace(args, mrope_interleaved=False).mrope_section == (3, 3, 2)
    with pytest.raises(ValueError, match="tokens_per_second"):
        mrope_position_ids(torch.tensor([[1, 2]]), image_token_id=IMAGE, video_token_id=VIDEO,
                           vision_start_token_id=START, tokens_per_second=2.0, split_video_frames=True)


def test_the_text_from_hf_sends_the_vision_language_model_to_its_builder():
    """``packfwd.models.from_hf`` on ``Qwen3_5ForConditionalGeneration`` (``model_type="qwen3_5"``, whose language
    model is the ``qwen3_5_text`` family) names ``packfwd.vision.from_hf``, as it does for Qwen2-VL; it said
    ``model_type='qwen3_5' is not supported`` while the README lists it."""
    from packfwd.models import from_hf as text_from_hf

    hf, *_ = setup()
    with pytest.raises(ValueError, match=r"Qwen3_5ForConditionalGeneration is a vision-language model: build it with "
                                         r"packfwd.vision.from_hf\(hf\)"):
        text_from_hf(hf)
