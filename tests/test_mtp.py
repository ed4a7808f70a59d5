"""Multi-token prediction: the per-depth labels, the model's MTP layers and ``make_forward(..., mtp=True)``.

Strategy.  The label functions are checked by Hypothesis against a plain per-row loop over every mask pattern
(holes, left padding, empty rows) and against jagged input.  The forward's per-depth log-probs, loss and
gradients are checked against a plain per-sequence reference (``tests/mtp_support.py``: each sequence alone,
unpacked, through the model's own submodules, no roll) on a ragged batch with sequences shorter than the depth,
of length 1, and (under CP=2) sequences whose padded tail crosses into a chunk of the other rank; in THD, BSHD,
jagged, CP=2 over gloo and PP=2 (MTP on the last stage, tied embeddings read from its copy).  The reference
itself is checked against Megatron-Core's own MTP loss where Megatron-Core's roll is right (full rows, no
packing): the MTP layers' gradients agree.

Tolerances (float32): ``atol=rtol=2e-5``; gradients ``atol=rtol=1e-4`` (sums over the batch).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import packfwd as pf
from packfwd.layout.labels import mtp_labels, mtp_loss_mask, shift_in_sequence

from .mtp_support import ARGS, TIED, TOL, batch, build, cp_rank, grads, reference, test_loss
from .strategies import batches, masks

GRAD_TOL = dict(atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------- the label function


def _loop_shift(x, mask, shift, fill):
    """Per row: the real tokens in order, each replaced by the one ``shift`` places later (or ``fill``)."""
    out = torch.full_like(x, fill)
    for i in range(mask.shape[0]):
        cols = mask[i].bool().nonzero()[:, 0].tolist()
        for r, c in enumerate(cols):
            if r + shift < len(cols):
                out[i, c] = x[i, cols[r + shift]]
    return out


@given(batches(max_b=5, max_s=12, dtypes=[torch.int64, torch.float32, torch.bool]), st.integers(0, 4))
def test_shift_in_sequence_matches_a_loop(data, shift):
    x, mask = data
    fill = False if x.dtype == torch.bool else -7
    torch.testing.assert_close(shift_in_sequence(x, mask, shift, fill), _loop_shift(x, mask, shift, fill))


@given(masks(max_b=5, max_s=12), st.integers(1, 3), st.integers(0, 2**16))
def test_mtp_labels_and_masks_match_a_loop(mask, depths, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, mask.shape, generator=g).masked_fill(~mask, 0)
    loss = (torch.rand(mask.shape, generator=g) < 0.6) & mask
    labels, masks_ = mtp_labels(ids, mask, depths), mtp_loss_mask(loss, mask, depths)
    assert labels.shape == masks_.shape == (*mask.shape, depths)
    exists_next = _loop_shift(mask, mask, 1, False)
    for k in range(1, depths + 1):
        want = _loop_shift(ids, mask, k + 1, -100)
        torch.testing.assert_close(labels[..., k - 1], want)
        has_label = want != -100
        assert torch.equal(masks_[..., k - 1], _loop_shift(loss, mask, k, False) & has_label)
        default = mtp_loss_mask(None, mask, depths)[..., k - 1]  # every token that has a next token
        assert torch.equal(default, _loop_shift(exists_next, mask, k, False) & has_label)
    # packing never mixes sequences: each packed label is a token of its own sequence (or ignored)
    packed, info = pf.to_thd(labels, mask, cp_size=2, cp_rank=1)
    owner = pf.to_thd(torch.arange(mask.shape[0])[:, None].expand(mask.shape), info)[0]
    real = pf.to_thd(mask, info)[0]  # packing pads with 0: look at the real tokens' labels only
    for k in range(depths):
        for t in range(packed.shape[0]):
            if real[t] and packed[t, k] != -100:
                assert packed[t, k] in ids[owner[t]][mask[owner[t]]]


@given(masks(max_b=4, max_s=10, min_b=1), st.integers(1, 3))
def test_jagged_labels_equal_padded(mask, depths):
    ids = torch.arange(1, mask.numel() + 1).reshape(mask.shape).masked_fill(~mask, 0)
    nested = torch.nested.nested_tensor([ids[i][mask[i]] for i in range(mask.shape[0])], layout=torch.jagged)
    padded = mtp_labels(ids, mask, depths)[mask]
    assert torch.equal(mtp_labels(nested, None, depths).values(), padded)
    assert torch.equal(shift_in_sequence(nested, None, 1).values(), shift_in_sequence(ids, mask, 1)[mask])


def test_label_functions_reject_bad_arguments():
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="num_depths"):
        mtp_labels(ids, ids > 0, 0)
    with pytest.raises(ValueError, match="shift"):
        shift_in_sequence(ids, ids > 0, -1)
    with pytest.raises(ValueError, match="loss_mask"):
        mtp_loss_mask(None, None, 1)


# ---------------------------------------------------------------------------------- the model and its reference


def test_model_builds_megatrons_mtp_block():
    model = build()
    assert [layer.layer_number for layer in model.mtp.layers] == [1, 2]
    inner = [getattr(layer, "mtp_model_layer", None) or layer.transformer_layer for layer in model.mtp.layers]
    assert [layer.layer_number for layer in inner] in ([3, 4], [1, 2])  # Megatron-Core 0.16 / 0.19 numbering
    assert type(inner[0].self_attention.core_attention).__name__ == "CoreAttention"  # packfwd's attention + RoPE
    from packfwd.models.runtime.gpt import model_args

    assert model_args(model).mtp_num_layers == 2 and model_args(build(TIED)).tie_embeddings
    stages = [build(pp_rank=r, pp_size=2) for r in range(2)]
    assert not hasattr(stages[0], "mtp") and hasattr(stages[1], "mtp") and hasattr(stages[1], "embedding")
    with pytest.raises(ValueError, match="value model"):
        type(ARGS)(**{**ARGS.__dict__, "value_head": True})


def test_reference_equals_megatrons_own_mtp_loss_where_its_roll_is_right():
    """Full rows, BSHD, no packing: Megatron-Core's MTP (``labels=``, its roll) and the reference's loss give the
    MTP layers the same gradients (the MTP loss is the only thing that reaches them)."""
    model = build().eval()  # eval: Megatron-Core logs the MTP loss through CUDA buffers in training mode
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, ARGS.vocab_size, (3, 8), generator=g)
    labels = torch.roll(ids, -1, 1)
    loss_mask = torch.ones_like(ids, dtype=torch.float)
    loss_mask[:, -1] = 0  # the last token has no next token
    positions = torch.arange(8).expand(3, 8)  # Megatron-Core rolls them too (0.16 needs them)
    model(ids, positions, None, labels=labels, loss_mask=loss_mask).sum().backward()
    megatron = {n: g for n, g in grads(model).items() if n.startswith("mtp.")}
    model.zero_grad(set_to_none=True)
    mask = torch.ones_like(ids, dtype=torch.bool)
    _, lp, loss = reference(model, ids, mask, loss_mask.bool())
    scale = ARGS.mtp_loss_scaling_factor / ARGS.mtp_num_layers
    (scale * loss.sum()).backward()
    ours = {n: g for n, g in grads(model).items() if n.startswith("mtp.")}
    assert megatron.keys() == ours.keys() and megatron
    for name in megatron:
        torch.testing.assert_close(ours[name], megatron[name], **GRAD_TOL)


@pytest.mark.parametrize("args", [ARGS, TIED], ids=["untied", "tied"])
@pytest.mark.parametrize("data_format", ["thd", "thd_aligned", "bshd", "nested"])
def test_forward_matches_the_per_sequence_reference(data_format, args):
    model = build(args)
    ids, mask, loss_mask, weights = batch()
    want_logits, want_lp, want_loss = reference(model, ids, mask, loss_mask)
    test_loss({"logits": want_logits, "mtp_log_probs": want_lp, "mtp_loss": want_loss}, weights).backward()
    want_grads = grads(model)
    model.zero_grad(set_to_none=True)
    if data_format == "nested":
        def jag(x):
            return torch.nested.nested_tensor([x[i][mask[i]] for i in range(x.shape[0])], layout=torch.jagged)

        out = pf.make_forward("thd", mtp=True)(model, jag(ids), mtp_loss_mask=jag(loss_mask))
        assert torch.equal(out["mtp_log_probs"].offsets(), jag(ids).offsets())
        every = pf.make_forward("thd", mtp=True)(model, jag(ids))["mtp_loss"]  # default mask: every token
        torch.testing.assert_close(every, reference(model, ids, mask, mask)[2], **TOL)
        out = {k: pf.pad(v.values(), pf.plan_unpad(mask)) if v.is_nested else v for k, v in out.items()}
    elif data_format == "thd_aligned":  # every sequence padded to a multiple of 4: Megatron-Core's own roll
        # (which cuts at the real offsets) is wrong here; see the module docstring of packfwd.models.runtime.mtp
        out = pf.make_forward("thd", mtp=True, seq_align=4)(model, ids, mask, mtp_loss_mask=loss_mask)
    else:
        out = pf.make_forward(data_format, mtp=True)(model, ids, mask, mtp_loss_mask=loss_mask)
    torch.testing.assert_close(out["mtp_log_probs"], want_lp, **TOL)
    torch.testing.assert_close(out["mtp_loss"], want_loss, **TOL)
    torch.testing.assert_close(out["logits"], want_logits, **TOL)
    test_loss(out, weights).backward()
    got = grads(model)
    assert got.keys() == want_grads.keys()
    for name in got:
        torch.testing.assert_close(got[name], want_grads[name], **GRAD_TOL)


def test_forward_with_a_processor_and_without_mtp():
    from packfwd.logits import log_probs_and_entropy

    model = build()
    ids, mask, loss_mask, _ = batch()
    labels = pf.next_token_labels(ids, mask)
    out = pf.make_forward("thd", mtp=True, logits_processor=log_probs_and_entropy)(model, ids, mask, labels=labels)
    assert set(out) == {"log_probs", "entropy", "mtp_log_probs", "mtp_loss"}
    plain = pf.make_forward("thd", logits_processor=log_probs_and_entropy)(model, ids, mask, labels=labels)
    torch.testing.assert_close(out["log_probs"], plain["log_probs"], **TOL)  # MTP changes nothing of the main head
    with pytest.raises(ValueError, match="MTP layers"):
        pf.make_forward("thd", mtp=True)(build(type(ARGS)(**{**ARGS.__dict__, "mtp_num_layers": 0})), ids, mask)
    with pytest.raises(ValueError, match="mtp_input_ids has shape"):
        model(ids, None, mask, mtp_input_ids=ids[None])
    with pytest.raises(TypeError, match="packing"):  # MTP composes with vision; this text model has no hook
        pf.make_forward("thd", mtp=True, vision=True)(model, ids, mask)


def test_mtp_forward_takes_a_plan_made_ahead():
    """The engine plans every forward alike: ``plan=`` (made by ``forward.plan``) gives the MTP forward the same
    numbers as planning in the call, for the main head and every depth."""
    model = build()
    ids, mask, loss_mask, _ = batch()
    forward = pf.make_forward("thd", mtp=True, seq_align=4)
    want = forward(model, ids, mask, mtp_loss_mask=loss_mask)
    got = forward(model, ids, plan=forward.plan(ids, mask), mtp_loss_mask=loss_mask)
    assert set(got) == set(want) == {"logits", "mtp_log_probs", "mtp_loss"}
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_pipeline_stages_with_mtp_on_the_last():
    """PP=2 in one process: the stages hold the whole model's weights (the last stage its embedding copy, for
    the MTP layers and the tied output); stage 0's hidden states into stage 1 give the reference's numbers."""
    from packfwd.models.convert.hf import load_weights

    whole = build(TIED)
    weights = {n: p.detach() for n, p in whole.named_parameters()}
    stages = []
    for r in range(2):
        stage = build(TIED, pp_rank=r, pp_size=2, init=False)
        own = {}
        for name, _ in stage.named_parameters():
            source = name
            if name.startswith("decoder.layers."):
                local, rest = name[len("decoder.layers."):].split(".", 1)
                source = f"decoder.layers.{int(local) + r}.{rest}"
            elif name == "output_layer.weight":
                source = "embedding.word_embeddings.weight"
            own[name] = weights[source]
        stages.append(load_weights(stage, own))
    ids, mask, loss_mask, _ = batch()
    forward = pf.make_forward("thd", mtp=True)
    with torch.no_grad():
        hidden = forward(stages[0], ids, mask, mtp_loss_mask=loss_mask)
        stages[1].set_input_tensor(hidden)
        out = forward(stages[1], ids, mask, mtp_loss_mask=loss_mask)
        _, want_lp, want_loss = reference(whole, ids, mask, loss_mask)
    assert hidden.shape == (int(mask.sum()), 1, ARGS.hidden_size)
    torch.testing.assert_close(out["mtp_log_probs"], want_lp, **TOL)
    torch.testing.assert_close(out["mtp_loss"], want_loss, **TOL)


def test_context_parallel_matches_the_reference():
    """CP=2 over gloo (chunks of a quarter of each padded sequence; rank 0 holds chunks 0 and 3, rank 1 chunks
    1 and 2): length 5 pads to 8, its last token and first pad in chunk 2, the rest of its padding in chunk 3;
    lengths 1, 2, 3 pad to 4, one token per chunk, so their labels sit on the other rank.  Every rank holds the
    reference's outputs, and the ranks' gradient shares add up to the reference's gradients."""
    from packfwd.testing import run_local

    model = build()
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    results = run_local(cp_rank, 2, state, ARGS, backend="gloo", timeout=300)
    ids, mask, loss_mask, weights = batch()
    want_logits, want_lp, want_loss = reference(model, ids, mask, loss_mask)
    test_loss({"logits": want_logits, "mtp_log_probs": want_lp, "mtp_loss": want_loss}, weights).backward()
    want_grads = grads(model)
    for r in results:
        torch.testing.assert_close(r["mtp_log_probs"], want_lp.detach(), **TOL)
        torch.testing.assert_close(r["mtp_loss"], want_loss.detach(), **TOL)
    for name, want in want_grads.items():
        torch.testing.assert_close(sum(r["grads"][name] for r in results), want, **GRAD_TOL)
