"""The fused head, ``make_forward(..., head="fused")``: log-probs and entropy from the last hidden states and the
output weight, never the ``[t, v]`` logits.

Strategy.  The reference is the unfused forward, ``make_forward(..., logits_processor=log_probs_and_entropy)`` on
the same model and batch (its numbers are checked against HF transformers per sequence and against float64 math
in test_hf_interop.py, test_forward.py and test_distributed.py).  Both run forward and backward of the same loss
``sum(w1 * log_prob + w2 * entropy)`` over the real tokens, with a per-sequence temperature that requires grad and
a response-only ``token_mask``; compared are the outputs, every parameter's gradient (which holds the gradient
w.r.t. the hidden states, through the decoder, and the output weight's: the output layer's, or the word
embedding's when tied) and the temperature's gradient.  Layouts: THD, BSHD, jagged nested; a pipeline's first
and last stage; TP=2, TP=2 with sequence parallelism (THD and BSHD) and CP=2 over gloo, rank by rank (plus each
rank's outputs against the single-process model).  The fused function itself is also checked on its own
against a float64 ``log_softmax`` written here (selected rows, several vocab blocks, temperature gradient).

Tolerances (float32): outputs ``atol=1e-5, rtol=1e-4``; gradients ``atol=5e-5, rtol=1e-4`` (the two heads reduce
the same products in another order; seen differences are at most a few 1e-7).
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from packfwd import next_token_labels
from packfwd.forward import make_forward
from packfwd.logits import entropy, fused_log_probs_and_entropy, log_probs_and_entropy
from packfwd.models import ModelArgs, build_model, from_hf

from .test_hf_interop import TINY, randomise, ragged_batch

OUT_TOL = dict(atol=1e-5, rtol=1e-4)
GRAD_TOL = dict(atol=5e-5, rtol=1e-4)
TEMPERATURE = torch.tensor([0.7, 1.3, 1.0, 2.0])


@functools.lru_cache(maxsize=None)
def hf(tied: bool):
    if tied:
        return randomise(LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=True)))
    return randomise(Qwen2ForCausalLM(Qwen2Config(**TINY, num_key_value_heads=2, rms_norm_eps=1e-5)), seed=1)


def batch():
    """ragged ids [4, 12] (right, left, holed padding), labels, the response mask (each row's real tokens after
    its first three) and loss weights."""
    ids, mask = ragged_batch("mixed")
    labels = next_token_labels(ids, mask)
    response = mask & (mask.cumsum(1) > 3)
    g = torch.Generator().manual_seed(7)
    return ids, mask, labels, response, torch.rand(2, *ids.shape, generator=g)


def jagged(x, mask):
    return torch.nested.nested_tensor([x[i][mask[i]] for i in range(x.shape[0])], layout=torch.jagged)


def run(model, head, data_format="thd", *, nested=False, token_mask=True, backward=True, **kw):
    """One forward (+ backward) of ``head``: outputs (padded, or the values of nested ones), gradients by
    parameter name, the temperature's gradient."""
    from packfwd.models.runtime.cpu import host_collectives

    ids, mask, labels, response, w = batch()
    temperature = TEMPERATURE.clone().requires_grad_(backward)
    args = dict(labels=labels, temperature=temperature)
    if token_mask:
        args["token_mask"] = response
    if nested:
        args = {k: jagged(v, mask) if v.shape == ids.shape else v for k, v in args.items()}
        ids_in, mask_in = jagged(ids, mask), None
    else:
        ids_in, mask_in = ids, mask
    model.zero_grad(set_to_none=True)
    out = make_forward(data_format, logits_processor=log_probs_and_entropy, head=head, **kw)(
        model, ids_in, mask_in, **args)
    if nested:
        out = {k: v.values() for k, v in out.items()}
        w = w[:, mask]
    if backward:
        with host_collectives():
            ((out["log_probs"] * w[0]).sum() + (out["entropy"] * w[1]).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {k: v.detach() for k, v in out.items()}, grads, temperature.grad


def assert_same(got, want, what=""):
    (out, grads, temp), (out_ref, grads_ref, temp_ref) = got, want
    for k in ("log_probs", "entropy"):
        torch.testing.assert_close(out[k], out_ref[k], **OUT_TOL, msg=f"{what} {k}")
    assert sorted(grads) == sorted(grads_ref), what
    for n, g in grads_ref.items():
        torch.testing.assert_close(grads[n], g, **GRAD_TOL, msg=f"{what} grad of {n}")
    if temp_ref is not None:
        torch.testing.assert_close(temp, temp_ref, **GRAD_TOL, msg=f"{what} grad of the temperature")


# ------------------------------------------------------------------------------------------ one process


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("layout", ["thd", "bshd", "nested-thd", "nested-bshd"])
def test_fused_head_equals_the_unfused_forward(layout, tied):
    model = from_hf(hf(tied))
    fmt, nested = layout.split("-")[-1], layout.startswith("nested")
    fused = run(model, "fused", fmt, nested=nested)
    want = run(model, "logits", fmt, nested=nested)
    assert_same(fused, want, layout)
    _, mask, _, response, _ = batch()
    out = fused[0]
    if not nested:  # zeros outside the response, and something inside it
        assert not out["log_probs"][~response].any() and not out["entropy"][~response].any()
    assert out["entropy"].abs().sum() > 1 and "embedding.word_embeddings.weight" in fused[1]
    assert ("output_layer.weight" in fused[1]) != tied


def test_fused_head_without_a_token_mask():
    model = from_hf(hf(False))
    assert_same(run(model, "fused", token_mask=False), run(model, "logits", token_mask=False), "no mask")


def test_call_time_chunk_size_sets_the_fused_blocks():
    """``chunk_size=`` given to the forward reaches the fused function (vocab rows per block: less memory, more and
    smaller matmuls); the numbers do not change, and a bad value is refused there."""
    model = from_hf(hf(False))
    ids, mask, labels, _, _ = batch()
    forward = make_forward("thd", logits_processor=log_probs_and_entropy, head="fused")
    with torch.no_grad():
        want = forward(model, ids, mask, labels=labels)
        got = forward(model, ids, mask, labels=labels, chunk_size=16)
    for k in ("log_probs", "entropy"):
        torch.testing.assert_close(got[k], want[k], **OUT_TOL)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        forward(model, ids, mask, labels=labels, chunk_size=0)


def test_function_against_float64():
    """``fused_log_probs_and_entropy`` alone: several vocab blocks (the last one short), selected rows, ignored
    labels, a per-token temperature; values and gradients of hidden, weight and temperature against float64
    autograd on the logits of the selected rows."""
    g = torch.Generator().manual_seed(0)
    t, v, h = 11, 37, 8
    hidden = torch.randn(t, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (t,), generator=g)
    labels[::4] = -100
    temperature = (torch.rand(t, generator=g) + 0.5).requires_grad_(True)
    rows = torch.rand(t, generator=g) > 0.3
    w1, w2 = torch.randn(2, t, generator=g)
    out = fused_log_probs_and_entropy(hidden, weight, labels, temperature=temperature, token_mask=rows, chunk_size=8)
    ((out["log_probs"] * w1).sum() + (out["entropy"] * w2).sum()).backward()

    h64, w64, t64 = (x.detach().double().requires_grad_(True) for x in (hidden, weight, temperature))
    lsm = torch.log_softmax(h64 @ w64.T / t64[:, None], -1)
    lp = torch.where(labels >= 0, lsm.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0) * rows
    ent = -(lsm.exp() * lsm).sum(-1) * rows
    ((lp * w1).sum() + (ent * w2).sum()).backward()
    torch.testing.assert_close(out["log_probs"].double(), lp.detach(), **OUT_TOL)
    torch.testing.assert_close(out["entropy"].double(), ent.detach(), **OUT_TOL)
    for ours, ref in ((hidden, h64), (weight, w64), (temperature, t64)):
        torch.testing.assert_close(ours.grad.double(), ref.grad, **GRAD_TOL)
    assert not hidden.grad[~rows].any() and not temperature.grad[~rows].any()


def test_pipeline_stages():
    """The first stage returns the same hidden states under either head; the last stage's fused numbers equal
    the unfused ones (its output weight is its copy of the tied embedding)."""
    first, last = (from_hf(hf(True), pp_rank=r, pp_size=2) for r in (0, 1))
    ids, mask, labels, response, _ = batch()
    outs = {}
    for head in ("logits", "fused"):
        forward = make_forward("thd", logits_processor=log_probs_and_entropy, head=head)
        with torch.no_grad():
            hidden = forward(first, ids, mask, labels=labels, token_mask=response)
            last.set_input_tensor(hidden)
            outs[head] = hidden, forward(last, ids, mask, labels=labels, token_mask=response)
    assert torch.equal(outs["logits"][0], outs["fused"][0]) and outs["fused"][0].shape == (int(mask.sum()), 1, 64)
    for k in ("log_probs", "entropy"):
        torch.testing.assert_close(outs["fused"][1][k], outs["logits"][1][k], **OUT_TOL)


def test_empty_batch_gives_zeros_and_zero_gradients():
    model = from_hf(hf(False))
    ids, mask = torch.randint(0, 128, (2, 5)), torch.zeros(2, 5, dtype=torch.bool)
    out = make_forward("thd", logits_processor=log_probs_and_entropy, head="fused")(model, ids, mask, labels=ids)
    assert out["log_probs"].shape == (2, 5) and not out["log_probs"].any()
    model.zero_grad(set_to_none=True)
    out["log_probs"].sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


# ------------------------------------------------------------------------------------------ refusals


class _NoHidden(torch.nn.Module):
    def forward(self, input_ids, position_ids, attention_mask, packed_seq_params=None):
        return torch.zeros(*input_ids.shape, 8)


def test_what_cannot_give_the_right_numbers_is_refused():
    ids, mask = torch.randint(1, 64, (2, 5)), torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="head='nope'"):
        make_forward("thd", head="nope")
    with pytest.raises(ValueError, match="pass logits_processor"):
        make_forward("thd", head="fused")
    with pytest.raises(ValueError, match="'entropy' reads the logits themselves"):
        make_forward("thd", logits_processor=entropy, head="fused")
    with pytest.raises(ValueError, match="leave chunk_size unbound"):
        make_forward("thd", logits_processor=functools.partial(log_probs_and_entropy, chunk_size=4), head="fused")
    with pytest.raises(ValueError, match="MTP"):
        make_forward("thd", logits_processor=log_probs_and_entropy, head="fused", mtp=True)
    forward = make_forward("thd", logits_processor=log_probs_and_entropy, head="fused")
    with pytest.raises(TypeError, match="return_hidden"):
        forward(_NoHidden(), ids, mask, labels=ids)
    value = build_model(ModelArgs(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=1,
                                  num_attention_heads=2, value_head=True))
    with pytest.raises(ValueError, match="value head"):
        forward(value, ids, mask, labels=ids)
    model = from_hf(hf(False))
    with pytest.raises(TypeError, match="token_mask must be a bool tensor"):
        forward(model, ids, mask, labels=ids, token_mask=mask.float())
    with pytest.raises(ValueError, match="without attention_mask"):
        model(ids, None, mask, return_hidden=True)


# ------------------------------------------------------------------------------------------ TP, SP, CP (gloo)

# name, tp, cp, sequence parallel, data format, tied embeddings
LAYOUTS = [("tp2", 2, 1, False, "thd", False), ("tp2_sp", 2, 1, True, "thd", True),
           ("tp2_sp_bshd", 2, 1, True, "bshd", False), ("cp2", 1, 2, False, "thd", True)]


def _ranks(rank, world_size, models):
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel

    results = {}
    for name, tp, cp, sp, fmt, tied in LAYOUTS:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ensure_model_parallel(tp_size=tp, cp_size=cp)
        model = from_hf(models[tied], tp_size=tp, tp_rank=ps.get_tensor_model_parallel_rank(), sequence_parallel=sp)
        kw = dict(tp_size=tp)
        if cp > 1:
            kw.update(cp_size=cp, cp_rank=ps.get_context_parallel_rank(), cp_group=ps.get_context_parallel_group())
        results[name] = {head: run(model, head, fmt, **kw) for head in ("logits", "fused")}
        ps.destroy_model_parallel()
    return results


def test_tensor_sequence_and_context_parallel():
    from packfwd.testing import run_local

    per_rank = run_local(_ranks, 2, {tied: hf(tied) for tied in (False, True)}, backend="gloo", timeout=300)
    single = {tied: run(from_hf(hf(tied)), "logits", backward=False)[0] for tied in (False, True)}
    for rank, results in enumerate(per_rank):
        for name, tp, cp, sp, fmt, tied in LAYOUTS:
            got = results[name]
            assert_same(got["fused"], got["logits"], f"{name} rank {rank}")
            for k in ("log_probs", "entropy"):  # and each rank's numbers are the whole model's
                torch.testing.assert_close(got["fused"][0][k], single[tied][k], **OUT_TOL, msg=f"{name} {k}")
