"""packfwd.forward.make_forward: layouts, processor arguments, jagged input, pipeline stages, vision kwargs.

Strategy: the padded-layout results are checked against HF transformers per sequence in test_hf_interop.py;
here every other way in (jagged input, per-sequence and scalar processor arguments, sequence-parallel
alignment, a pipeline's last stage) is checked against the plain padded call, and per-token processor
arguments against a float64 computation on the padded logits.
"""

from __future__ import annotations

import pytest
import torch

from packfwd import next_token_labels, to_thd
from packfwd.forward import make_forward
from packfwd.logits import log_probs_and_entropy
from packfwd.models import from_hf

from .test_hf_interop import hf_model, ragged_batch


@pytest.fixture(scope="module")
def model():
    return from_hf(hf_model("qwen2-gqa-bias"))


def jagged(x, mask):
    return torch.nested.nested_tensor([x[i][mask[i]] for i in range(x.shape[0])], layout=torch.jagged)


def float64_log_probs(logits, labels, temperature):
    logp = torch.log_softmax(logits.double() / temperature, -1)
    return torch.where(labels >= 0, logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0], 0.0)


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_processor_arguments_are_packed_like_the_logits(model, data_format):
    ids, mask = ragged_batch("mixed")
    labels = next_token_labels(ids, mask)
    with torch.no_grad():
        logits = make_forward(data_format)(model, ids, mask)
        forward = make_forward(data_format, logits_processor=log_probs_and_entropy)
        per_sequence = forward(model, ids, mask, labels=labels, temperature=torch.tensor([1.0, 0.5, 2.0, 1.0]))
        scalar = forward(model, ids, mask, labels=labels, temperature=0.5)
    temps = torch.tensor([1.0, 0.5, 2.0, 1.0], dtype=torch.float64)[:, None, None]
    want = float64_log_probs(logits, labels, temps) * mask
    torch.testing.assert_close(per_sequence["log_probs"].double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scalar["log_probs"].double(), float64_log_probs(logits, labels, 0.5) * mask,
                               atol=1e-5, rtol=1e-5)
    assert per_sequence["entropy"].shape == ids.shape and not per_sequence["entropy"][~mask].any()


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_jagged_in_jagged_out(model, data_format):
    ids, mask = ragged_batch("left")
    labels = next_token_labels(ids, mask)
    with torch.no_grad():
        padded = make_forward(data_format)(model, ids, mask)
        out = make_forward(data_format)(model, jagged(ids, mask), None)
        processed = make_forward(data_format, logits_processor=log_probs_and_entropy)(
            model, jagged(ids, mask), None, labels=jagged(labels, mask), temperature=torch.tensor([1.0, 2.0, 1.0, 3.0])
        )
        want = make_forward(data_format, logits_processor=log_probs_and_entropy)(
            model, ids, mask, labels=labels, temperature=torch.tensor([1.0, 2.0, 1.0, 3.0])
        )
    assert out.is_nested and processed["log_probs"].is_nested
    torch.testing.assert_close(out.values(), padded[mask])
    torch.testing.assert_close(processed["log_probs"].values(), want["log_probs"][mask])


def test_sequence_parallel_alignment_changes_nothing(model):
    ids, mask = ragged_batch("right")
    with torch.no_grad():
        want = make_forward("thd")(model, ids, mask)
        aligned = make_forward("thd", tp_size=4, seq_align=4)(model, ids, mask)
        bshd = make_forward("bshd", tp_size=8)(model, ids, mask)
    torch.testing.assert_close(aligned, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bshd, want, atol=1e-5, rtol=1e-5)


def test_caller_position_ids_are_packed():
    """HF-style positions of a left-padded batch (cumsum - 1) reach the model as 0..n-1 per sequence."""
    ids, mask = ragged_batch("left")
    hf_positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    lengths = mask.sum(-1).tolist()
    stub = VisionStub()
    make_forward("thd")(stub, ids, mask, position_ids=hf_positions)
    assert stub.seen["position_ids"].tolist() == [sum((list(range(n)) for n in lengths), [])]
    make_forward("bshd")(stub, ids, mask, position_ids=hf_positions)
    width = max(lengths)
    assert stub.seen["position_ids"].tolist() == [list(range(n)) + [0] * (width - n) for n in lengths]
    make_forward("bshd")(stub, ids, mask)  # default: 0..width-1 on every row
    assert stub.seen["position_ids"].tolist() == [list(range(width))] * len(lengths)


def test_last_pipeline_stage_applies_the_processor():
    hf = hf_model("llama-tied-mha")
    whole = from_hf(hf)
    first, last = (from_hf(hf, pp_rank=r, pp_size=2) for r in (0, 1))
    ids, mask = ragged_batch("mixed")
    labels = next_token_labels(ids, mask)
    forward = make_forward("thd", logits_processor=log_probs_and_entropy)
    with torch.no_grad():
        hidden = forward(first, ids, mask, labels=labels)  # a middle stage ignores the processor
        last.set_input_tensor(hidden)
        got = forward(last, ids, mask, labels=labels)
        want = forward(whole, ids, mask, labels=labels)
    assert hidden.shape == (int(mask.sum()), 1, 64)
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5)


class VisionStub(torch.nn.Module):
    """Records what a model receives; returns one-hot logits of its ids (a vision model packs them with the hook,
    as it would pack its merged embeddings: ``[s, b, v]`` decoder layout -> ``[b, s, v]``)."""

    def forward(self, input_ids, position_ids, attention_mask, packed_seq_params=None, packing=None, **multimodal):
        self.seen = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         params=packed_seq_params, packing=packing, **multimodal)
        onehot = torch.nn.functional.one_hot(input_ids, 128).float()
        return onehot if packing is None else packing.embeddings(onehot).transpose(0, 1)


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_vision_models_get_the_batch_and_the_packing_hook(data_format):
    """vision=True: the model gets the padded batch (THD; BSHD: compacted), the mask, the caller's positions, the
    images and a hook packing [b, s, ...] with the batch's plan (tests/test_vision_model.py checks it against verl)."""
    from packfwd import pack_positions, plan_bshd, to_bshd

    ids, mask = ragged_batch("mixed")
    mrope = torch.stack([mask.long().cumsum(-1) * k for k in (1, 2, 3)])  # [3, b, s]
    pixels, grid = torch.randn(6, 8), torch.tensor([[1, 2, 3]])
    stub = VisionStub()
    out = make_forward(data_format, vision=True)(stub, ids, mask, position_ids=mrope,
                                                 multi_modal_inputs={"pixel_values": pixels, "image_grid_thw": grid})
    seen = stub.seen
    assert seen["pixel_values"] is pixels and seen["image_grid_thw"] is grid
    if data_format == "thd":
        packed, info = to_thd(ids, mask)
        assert seen["input_ids"] is ids and seen["attention_mask"] is mask and seen["position_ids"] is mrope
        assert torch.equal(seen["params"].cu_seqlens_q_padded, info.cu_seqlens_padded)
        assert torch.equal(seen["packing"].positions(mrope), pack_positions(mrope, info)[:, None])  # [3, 1, t]
    else:
        info = plan_bshd(mask)
        assert torch.equal(seen["input_ids"], to_bshd(ids, info)[0]) and seen["params"] is None
        assert torch.equal(seen["attention_mask"], info.attention_mask)
        assert torch.equal(seen["position_ids"], pack_positions(mrope, info))  # [3, b, s_c]
    assert torch.equal(out.argmax(-1)[mask], ids[mask]) and not out[~mask].any()
    with pytest.raises(ValueError, match="vision=True"):
        make_forward(data_format)(stub, ids, mask, multi_modal_inputs={"pixel_values": pixels})


def test_vision_forward_refuses_a_model_without_the_hook(model):
    ids, mask = ragged_batch("mixed")
    with pytest.raises(TypeError, match="takes no `packing` parameter"):
        make_forward("thd", vision=True)(model, ids, mask)


def test_context_parallel_needs_the_cp_rank():
    """Hazard: cp_rank defaulted to 0, so make_forward(cp_size=2, cp_group=g) built on every rank packed rank 0's
    share everywhere; at the first call CP rank 1 raised (its model's attention runs as rank 1) while rank 0 went on
    into the attention's K/V all-gather and waited for it (over NCCL, until the timeout).  plan_thd requires
    cp_rank under CP; so does make_forward, at construction, on every rank alike."""
    with pytest.raises(ValueError, match=r"cp_size=2 needs cp_rank.*pass cp_rank="):
        make_forward("thd", cp_size=2, cp_group=object())
    assert make_forward("thd", cp_size=2, cp_rank=1, cp_group=object()).layout.cp_rank == 1
    assert make_forward("thd").layout.cp_rank == 0  # one CP rank: nothing to name


def test_bad_calls_are_refused(model):
    ids, mask = ragged_batch("right")
    with pytest.raises(ValueError, match="data_format"):
        make_forward("sbhd")
    with pytest.raises(ValueError, match="cp_group"):
        make_forward("thd", cp_size=2)
    with pytest.raises(ValueError, match="thd"):
        make_forward("bshd", cp_size=2, cp_group=object())
    with pytest.raises(TypeError, match="no logits_processor"):
        make_forward("thd")(model, ids, mask, labels=ids)
    with pytest.raises(ValueError, match="shape"):
        make_forward("thd", logits_processor=log_probs_and_entropy)(model, ids, mask, labels=ids[:, :3])
    with pytest.raises(TypeError, match="dict"):
        make_forward("thd", logits_processor=lambda logits: logits)(model, ids, mask)
    with pytest.raises(ValueError, match="cp_size=1"):
        make_forward("thd", cp_size=2, cp_rank=1, cp_group=object())(model, ids, mask)


def test_cp_plan_keeps_megatrons_rope_table_unambiguous():
    """Megatron-Core reads a THD RoPE table of max_seqlen * cp rows that equals the packed total as per-token
    offsets; two sequences of equal padded length under cp=2 would hit that, so the forward reports a larger
    max_seqlen."""
    from packfwd.engine import Thd as _Thd

    ids = torch.ones(2, 8, dtype=torch.long)
    mask = torch.ones(2, 8, dtype=torch.bool)
    for rank in (0, 1):
        info, packed = _Thd(1, 2, rank, None, None).pack(ids, mask)
        assert info.total_tokens == 16 and info.max_seqlen * 2 != info.total_tokens and info.max_seqlen % 4 == 0
        assert packed.shape == (1, 8)
    info, _ = _Thd(1, 2, 0, None, None).pack(ids, torch.tensor([[1] * 8, [1] * 4 + [0] * 4]).bool())
    assert info.max_seqlen == 8  # no collision (total 12): the plan is left as it is


def test_a_plan_made_ahead_gives_the_same_numbers_and_is_checked(model):
    """``forward.plan`` ahead of the call (what a CUDA graph or a prefetching trainer needs): ``plan=`` gives the
    bits of planning inside the call, a bucket plan the same real tokens; a plan of another layout or batch, or
    the mask and lengths passed again beside it, raise naming the fix."""
    from packfwd.layout.bucket import Bucket

    ids, mask = ragged_batch("mixed")
    labels = next_token_labels(ids, mask)
    seqlens = mask.sum(-1).tolist()
    forward = make_forward("thd", logits_processor=log_probs_and_entropy, seq_align=4)
    with torch.no_grad():
        want = forward(model, ids, mask, labels=labels)
        got = forward(model, ids, plan=forward.plan(ids, mask, seqlens=seqlens), labels=labels)
        bucket = forward(model, ids, plan=forward.plan(ids, mask, bucket=Bucket(tokens=256, max_seqlen=64)),
                         labels=labels)
    for name in want:
        assert torch.equal(got[name], want[name]), name
        torch.testing.assert_close(bucket[name][mask], want[name][mask], atol=1e-5, rtol=1e-5)
    plan = forward.plan(ids, mask)
    with pytest.raises(ValueError, match="pass attention_mask and seqlens to forward.plan"):
        forward(model, ids, mask, plan=plan, labels=labels)
    with pytest.raises(ValueError, match="another layout: seq_align=1 \\(the forward's 4\\)"):
        forward(model, ids, plan=make_forward("thd", seq_align=1).plan(ids, mask), labels=labels)
    with pytest.raises(ValueError, match="plan= is for a"):
        forward(model, ids[:, :-1], plan=plan, labels=labels[:, :-1])
    with pytest.raises(TypeError, match="plan= takes a THD plan"):
        forward(model, ids, plan=object(), labels=labels)
    bshd = make_forward("bshd")
    with pytest.raises(TypeError, match="plan= takes a THD plan"):
        bshd(model, ids, plan=plan)
    with pytest.raises(TypeError, match="make_forward\\('thd'\\)"):
        bshd.plan(ids, mask)


def test_plan_is_refused_where_it_is_not_built_and_cudnn_under_batch_invariance(model):
    """The vision forward (its model reads the padded mask) refuses ``plan=`` rather than ignore it;
    ``batch_invariant=True`` refuses a model whose attention is cuDNN's (its kernel follows the batch)."""
    from packfwd.forward.deterministic import check_attention
    from .test_hf_interop import hf_model as hf

    ids, mask = ragged_batch("mixed")
    plan = make_forward("thd").plan(ids, mask)
    with pytest.raises(TypeError, match="not built for make_forward\\(vision=True\\)"):
        make_forward("thd", vision=True).plan(ids, mask)
    with pytest.raises(TypeError, match="not built for make_forward\\(vision=True\\)"):
        make_forward("thd", vision=True)(model, ids, plan=plan)
    check_attention(model)  # the automatic backend: fine
    with pytest.raises(ValueError, match="attention_backend='cudnn'"):
        check_attention(from_hf(hf("qwen2-gqa-bias"), attention_backend="cudnn"))
