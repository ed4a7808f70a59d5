"""Scored tokens only (``make_forward``'s default, :mod:`packfwd.forward.scored`) and ``sum_pi_squared``.

Strategy.  The reference is the same forward scoring every token (``scored_only=False``, the full head, whose
numbers other tests check against transformers and float64 math).  On a ragged batch whose labels ignore each
row's first tokens (prompts) and a response ``loss_mask``, both run forward and backward of one loss over the
outputs; compared are the outputs (the scored forward's must be the full head's at the scored tokens and exactly
0 elsewhere, entropy included) and every parameter's gradient.  Both heads, THD and BSHD.  That the work is skipped
is checked where it shows: the processor is given fewer rows than tokens, and the logits head never calls the
model's output layer.  TP, TP with sequence parallelism and CP run the scored logits head against the fused head
and the single process in ``tests/test_fused_head.py`` (its batch has ignored labels and a ``token_mask``).
``sum_pi_squared`` is checked against ``softmax(x / T) ** 2`` summed, written here.
"""

from __future__ import annotations

import functools

import pytest
import torch

from packfwd import next_token_labels
from packfwd.forward import make_forward
from packfwd.logits import fused_log_probs_and_entropy, log_probs_and_entropy, select_rows
from packfwd.micro import plan_micro_batches, run_micro_batches
from packfwd.models import ModelArgs, build_model

from .test_hf_interop import ragged_batch

ARGS = ModelArgs(vocab_size=96, hidden_size=32, ffn_hidden_size=64, num_layers=2, num_attention_heads=4,
                 num_query_groups=2)
TOL = dict(atol=1e-5, rtol=1e-4)


@functools.lru_cache(maxsize=None)
def model():
    torch.manual_seed(0)
    return build_model(ARGS)


def batch():
    """ids, mask [4, 12], labels ignoring each row's first 4 real tokens, a response loss mask (real tokens after
    the 6th), the temperature per sequence."""
    ids, mask = ragged_batch("mixed")
    ids = ids % ARGS.vocab_size
    labels = next_token_labels(ids, mask)
    labels[mask.cumsum(1) <= 4] = -100
    loss_mask = mask & (mask.cumsum(1) > 6)
    return ids, mask, labels, loss_mask, torch.tensor([0.7, 1.3, 1.0, 2.0])


def run(scored_only, head="logits", data_format="thd", **kw):
    m = model()
    ids, mask, labels, loss_mask, temperature = batch()
    m.zero_grad(set_to_none=True)
    forward = make_forward(data_format, logits_processor=log_probs_and_entropy, head=head, scored_only=scored_only)
    call = dict(labels=labels, temperature=temperature, **kw)
    if scored_only:
        call["loss_mask"] = loss_mask
    out = forward(m, ids, mask, **call)
    g = torch.Generator().manual_seed(3)
    weights = [torch.rand(ids.shape, generator=g) for _ in out]
    kept = loss_mask & (labels >= 0)
    sum(((v * w) * kept).sum() for v, w in zip(out.values(), weights)).backward()
    return out, {n: p.grad.clone() for n, p in m.named_parameters()}, kept


@pytest.mark.parametrize("head", ["logits", "fused"])
@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_scored_tokens_equal_the_full_head_and_the_others_are_zero(head, data_format):
    full, full_grads, kept = run(False, head, data_format)
    got, grads, _ = run(True, head, data_format)
    assert set(got) == {"log_probs", "entropy"}
    for k in got:
        torch.testing.assert_close(got[k][kept], full[k][kept], **TOL)
        assert torch.equal(got[k][~kept], torch.zeros_like(got[k][~kept])), k  # exactly 0, entropy too
        assert full[k][~kept & batch()[1]].abs().sum() > 0  # the full head has numbers there: a real change
    for name in full_grads:
        torch.testing.assert_close(grads[name], full_grads[name], atol=5e-5, rtol=1e-4, msg=name)


def long_batch():
    """ids, mask [4, 80] (260 tokens), next-token labels, the response (tokens from 40 on) as the loss mask."""
    mask = torch.arange(80) < torch.tensor([80, 70, 60, 50])[:, None]
    ids = torch.randint(0, ARGS.vocab_size, mask.shape, generator=torch.Generator().manual_seed(0))
    labels = next_token_labels(ids, mask)
    return ids, mask, labels, mask & (torch.arange(80) >= 40)


def test_the_work_is_skipped_unless_no_host_sync_was_asked_without_a_count():
    """The processor sees the scored rows only (slots), the model's output layer is never called on the logits
    head; given seqlens and no count, every row (no host sync), the same numbers."""
    m = model()
    ids, mask, labels, loss_mask = long_batch()
    kept = loss_mask & (labels >= 0)
    seen = []

    def processor(logits, labels, token_mask=None):
        seen.append(logits.shape[0])
        return {"lp": log_probs_and_entropy(logits, labels)["log_probs"]}

    forward = make_forward("thd", logits_processor=processor)
    layer = m.output_layer.forward
    m.output_layer.forward = lambda *a, **k: pytest.fail("the output layer ran on every token")
    try:
        a = forward(m, ids, mask, labels=labels, loss_mask=loss_mask)
        c = forward(m, ids, mask, labels=labels, loss_mask=loss_mask, seqlens=mask.sum(-1).tolist(),
                    scored_tokens=int(kept.sum()))
    finally:
        m.output_layer.forward = layer
    b = forward(m, ids, mask, labels=labels, loss_mask=loss_mask, seqlens=mask.sum(-1).tolist())
    t = int(mask.sum())
    assert int(kept.sum()) == 96 and seen[0] == seen[1] == 128 < t and seen[2] == t  # 96 rounded up to a bucket
    for x in (b, c):
        assert torch.equal(x["lp"], a["lp"])
    assert not a["lp"][~kept].any() and (a["lp"][kept] < 0).all()


def test_too_few_slots_and_unused_arguments_are_refused():
    m = model()
    ids, mask, labels, loss_mask = long_batch()
    forward = make_forward("thd", logits_processor=log_probs_and_entropy)
    forward(m, ids, mask, labels=labels, loss_mask=loss_mask, scored_tokens=100)  # 128 slots hold the 96
    with pytest.raises(ValueError, match="96 tokens selected, 64 slots: more tokens are scored than the slots"):
        forward(m, ids, mask, labels=labels, loss_mask=loss_mask, scored_tokens=50)
    with pytest.raises(TypeError, match="scored_tokens must be a host int"):
        forward(m, ids, mask, labels=labels, scored_tokens=torch.tensor(40))
    with pytest.raises(TypeError, match="loss_mask= chooses the tokens.*scored_only=False"):
        make_forward("thd", logits_processor=log_probs_and_entropy, scored_only=False)(
            m, ids, mask, labels=labels, loss_mask=loss_mask)
    with pytest.raises(TypeError, match="scored_tokens= chooses the tokens.*no logits processor"):
        make_forward("thd")(m, ids, mask, scored_tokens=5)
    with pytest.raises(TypeError, match="scored_only must be a bool"):
        make_forward("thd", scored_only=1)


def test_what_scoring_leaves_alone():
    """Logits without a processor, a processor given no labels nor mask (entropy at every token), a value model."""
    m = model()
    ids, mask, labels, loss_mask, _ = batch()
    on, off = (make_forward("thd", logits_processor=log_probs_and_entropy, scored_only=s) for s in (True, False))
    assert torch.equal(make_forward("thd")(m, ids, mask), make_forward("thd", scored_only=False)(m, ids, mask))
    labels_all = torch.where(mask, torch.zeros_like(labels), -100)
    torch.testing.assert_close(on(m, ids, mask, labels=labels_all.clamp(min=0))["entropy"],
                               off(m, ids, mask, labels=labels_all.clamp(min=0))["entropy"], **TOL)
    value = build_model(ModelArgs(**{**ARGS.__dict__, "value_head": True}))
    assert torch.equal(make_forward("thd")(value, ids, mask), make_forward("thd", scored_only=False)(value, ids, mask))


def test_mtp_keeps_working_with_the_scored_head():
    """MTP's depths need the model's output layer: the logits head then computes every logit and runs the
    processor on the scored rows only; the main outputs are the full head's at the scored tokens, MTP's equal."""
    torch.manual_seed(1)
    mtp = build_model(ModelArgs(**{**ARGS.__dict__, "mtp_num_layers": 1}))
    ids, mask, labels, loss_mask, _ = batch()
    on, off = (make_forward("thd", logits_processor=log_probs_and_entropy, mtp=True, scored_only=s)
               for s in (True, False))
    a, b = on(mtp, ids, mask, labels=labels, loss_mask=loss_mask), off(mtp, ids, mask, labels=labels)
    kept = loss_mask & (labels >= 0)
    torch.testing.assert_close(a["log_probs"], b["log_probs"] * kept, **TOL)
    assert not a["entropy"][~kept].any()
    for k in ("mtp_log_probs", "mtp_loss"):
        assert torch.equal(a[k], b[k])


def test_run_micro_batches_scores_the_loss_mask():
    """The step hands each micro-batch's loss mask and its loss-token count to the forward: log-probs 0 outside
    it, the gradients those of the step scoring every token."""
    m = model()
    ids, mask, labels, loss_mask, _ = batch()
    loss_mask = loss_mask & (labels >= 0)  # the loss counts tokens with a label (entropy at the others is 0 here)
    plan = plan_micro_batches(mask.sum(-1).tolist(), max_tokens=16)
    assert plan.num_micro_batches > 1
    results = []
    for scored_only in (True, False):
        m.zero_grad(set_to_none=True)
        forward = make_forward("thd", logits_processor=log_probs_and_entropy, scored_only=scored_only)
        res = run_micro_batches(forward, m, plan, ids, mask, dp_rank=0, loss_mask=loss_mask, labels=labels,
                                loss_fn=lambda out: -out["log_probs"] + 0.1 * out["entropy"], graphs=False)
        results.append((res, {n: p.grad.clone() for n, p in m.named_parameters()}))
    (on, g_on), (off, g_off) = results
    kept = (loss_mask & (labels >= 0))[on.rows]
    assert not on.outputs["entropy"][~kept].any() and off.outputs["entropy"][~kept & mask[on.rows]].abs().sum() > 0
    torch.testing.assert_close(on.outputs["log_probs"], off.outputs["log_probs"] * kept, **TOL)
    for name in g_on:
        torch.testing.assert_close(g_on[name], g_off[name], atol=5e-5, rtol=1e-4, msg=name)


def test_select_rows_against_nonzero():
    g = torch.Generator().manual_seed(0)
    for t in (0, 1, 7, 50):
        mask = torch.rand(t, generator=g) < 0.4
        n = int(mask.sum())
        for slots in (n, n + 5, t + 3):
            sel = select_rows(mask, slots)
            assert torch.equal(sel.rows[sel.valid], mask.nonzero()[:, 0])
            x = torch.randn(t, 2, generator=g)
            assert torch.equal(sel.put(sel.take(x)), torch.where(mask[:, None], x, 0.0))
    with pytest.raises(ValueError, match="2 tokens selected, 1 slots"):
        select_rows(torch.tensor([True, False, True]), 1)


# ------------------------------------------------------------------------------------------------ sum_pi_squared


def naive_sum_pi_squared(logits, temperature):
    p = torch.softmax(logits.double() / temperature.double()[:, None], -1)
    return (p * p).sum(-1)


def test_sum_pi_squared_equals_the_naive_computation():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(9, 6, generator=g, dtype=torch.float64), torch.randn(37, 6, generator=g,
                                                                                      dtype=torch.float64)
    weight[:, 0] *= 4  # peaked distributions too
    labels, temperature = torch.randint(0, 37, (9,), generator=g), torch.rand(9, generator=g, dtype=torch.float64) + 0.3
    want = naive_sum_pi_squared(hidden @ weight.T, temperature)
    plain = log_probs_and_entropy(hidden @ weight.T, labels, temperature=temperature, sum_pi_squared=True,
                                  chunk_size=4)
    fused = fused_log_probs_and_entropy(hidden, weight, labels, temperature=temperature, sum_pi_squared=True,
                                        chunk_size=8)  # several vocab blocks, folded
    for got in (plain, fused):
        torch.testing.assert_close(got["sum_pi_squared"], want, atol=1e-12, rtol=1e-12)
    masked = torch.arange(9) % 2 == 0
    sel = fused_log_probs_and_entropy(hidden, weight, labels, temperature=temperature, sum_pi_squared=True,
                                      token_mask=masked, token_count=6)
    torch.testing.assert_close(sel["sum_pi_squared"], torch.where(masked, want, 0.0), atol=1e-12, rtol=1e-12)
    for head in ("logits", "fused"):  # through the forward, both heads: 0 where not scored
        m = model()
        ids, mask, labels, loss_mask, temperature = batch()
        processor = functools.partial(log_probs_and_entropy, sum_pi_squared=True)
        out = make_forward("thd", logits_processor=processor, head=head)(m, ids, mask, labels=labels,
                                                                          temperature=temperature)
        logits = make_forward("thd")(m, ids, mask)
        want = naive_sum_pi_squared(logits[mask], temperature[:, None].expand(mask.shape)[mask])
        kept = (labels >= 0)[mask]
        torch.testing.assert_close(out["sum_pi_squared"][mask][kept].double(), want[kept], atol=1e-6, rtol=1e-5)
        assert not out["sum_pi_squared"][mask][~kept].any()


def test_sum_pi_squared_carries_no_gradient():
    logits = torch.randn(4, 10, requires_grad=True)
    hidden = torch.randn(4, 3, requires_grad=True)
    for out in (log_probs_and_entropy(logits, torch.tensor([1, 2, 3, -100]), sum_pi_squared=True),
                fused_log_probs_and_entropy(hidden, torch.randn(10, 3), torch.tensor([1, 2, 3, -100]),
                                            sum_pi_squared=True)):
        with pytest.raises(RuntimeError, match="carries no gradient"):
            out["sum_pi_squared"].sum().backward(retain_graph=True)
        (out["log_probs"].sum() + out["sum_pi_squared"].detach().sum()).backward()  # detached: fine
    with pytest.raises(TypeError, match="sum_pi_squared must be a bool"):
        log_probs_and_entropy(logits, torch.tensor([1, 2, 3, 4]), sum_pi_squared=1)


def test_the_fused_head_without_a_count_computes_every_row_and_masks():
    """``seqlens`` and no ``scored_tokens`` on the fused head: no token_mask reaches the fused function (its count
    would be read back), every row computed, the outputs masked: the numbers of the selected rows."""
    m = model()
    ids, mask, labels, loss_mask = long_batch()
    kept = loss_mask & (labels >= 0)
    forward = make_forward("thd", logits_processor=log_probs_and_entropy, head="fused")
    lengths = mask.sum(-1).tolist()
    fused, given = log_probs_and_entropy.fused, []

    def recording(hidden, weight, labels, *, token_mask=None, token_count=None, real_tokens=None, **kw):
        given.append((token_mask is not None, token_count))
        return fused(hidden, weight, labels, token_mask=token_mask, token_count=token_count, real_tokens=real_tokens,
                     **kw)

    log_probs_and_entropy.fused = recording
    try:
        masked = forward(m, ids, mask, labels=labels, loss_mask=loss_mask, seqlens=lengths)
        picked = forward(m, ids, mask, labels=labels, loss_mask=loss_mask, seqlens=lengths, scored_tokens=96)
    finally:
        log_probs_and_entropy.fused = fused
    assert given == [(False, None), (True, 128)]
    for k in masked:
        torch.testing.assert_close(masked[k], picked[k], **TOL)
        assert not masked[k][~kept].any() and masked[k][kept].abs().sum() > 0
