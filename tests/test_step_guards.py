"""``run_micro_batches`` refuses what would give silent wrong numbers, and defines what an MTP forward returns.

Strategy.  A recording toy model (one-hot logits, the packed token count of every call kept) shows what the model
is handed: a plan made for the forward's layout keeps every call within ``max_tokens``, and a plan made for another
layout (THD ``seq_align`` / ``tp_size`` / ``cp_size``, or BSHD rows wider than the budget) is refused before the
model runs, naming both values and the fix.  ``loss_fn`` with grad mode off is refused.  An MTP model
(``tests/mtp_support.py``) over three or more micro-batches, one and two DP ranks, THD and BSHD: the step's
``mtp_loss`` equals one forward's over the whole batch to float32 rounding.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import packfwd as pf
from packfwd.micro import plan_micro_batches, run_micro_batches

from .mtp_support import batch as mtp_batch
from .mtp_support import build as build_mtp

LENGTHS = [3, 9, 1, 6, 2, 5, 4, 7]
V = 11


class Recorder(torch.nn.Module):
    """One-hot logits of the ids times a weight; ``tokens``: the ids the model got per call (``b * s``)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.tokens: list[int] = []

    def forward(self, input_ids, position_ids, attention_mask, packed_seq_params=None):
        self.tokens.append(input_ids.numel())
        return torch.nn.functional.one_hot(input_ids, V).float() * self.weight


def toy_batch(lengths=LENGTHS):
    s = max(lengths)
    mask = torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.randint(1, V, mask.shape, generator=torch.Generator().manual_seed(0)).masked_fill(~mask, 0)
    return ids, mask


# ------------------------------------------------------------------------------------ the plan and the layout


@pytest.mark.parametrize("plan_kw, forward_kw, named", [
    ({}, dict(seq_align=16), ["seq_align=1", "seq_align=16"]),
    (dict(tp_size=2), {}, ["tp_size=2", "tp_size=1"]),
    (dict(cp_size=2), {}, ["cp_size=2", "cp_size=1"]),
    ({}, dict(tp_size=4), ["tp_size=1", "tp_size=4"]),
])
def test_a_plan_for_another_thd_layout_is_refused(plan_kw, forward_kw, named):
    ids, mask = toy_batch()
    plan = plan_micro_batches(LENGTHS, max_tokens=12, **plan_kw)
    forward, model = pf.make_forward("thd", **forward_kw), Recorder()
    with pytest.raises(ValueError) as err:
        run_micro_batches(forward, model, plan, ids, mask, dp_rank=0)
    for words in [*named, "max_tokens=12", "**forward.layout.plan_args"]:
        assert words in str(err.value)
    assert model.tokens == []  # refused before the model ran


def test_a_plan_from_the_forwards_layout_keeps_every_call_within_the_budget():
    ids, mask = toy_batch()
    forward, model = pf.make_forward("thd", seq_align=16), Recorder()
    plan = plan_micro_batches(LENGTHS, max_tokens=32, **forward.layout.plan_args)
    got = run_micro_batches(forward, model, plan, ids, mask, dp_rank=0)
    assert len(model.tokens) == plan.num_micro_batches >= 2 and max(model.tokens) <= 32
    assert model.tokens == [forward.layout.footprint([LENGTHS[i] for i in mb]) for mb in plan.micro_batches[0]]
    torch.testing.assert_close(got.outputs, forward(model, ids, mask).detach())


def test_bshd_micro_batches_wider_than_the_budget_are_refused_and_fitting_ones_run():
    ids, mask = toy_batch()
    plan = plan_micro_batches(LENGTHS, max_tokens=12)  # THD fits; BSHD pads rows to the longest
    forward, model = pf.make_forward("bshd"), Recorder()
    with pytest.raises(ValueError, match=r"takes \d+ tokens in BSHD .* max_tokens=12.*make_forward\('thd'"):
        run_micro_batches(forward, model, plan, ids, mask, dp_rank=0)
    with pytest.raises(ValueError, match="cp_size=2 but the BSHD forward packs with tp_size=1, cp_size=1"):
        run_micro_batches(forward, model, plan_micro_batches(LENGTHS, max_tokens=12, cp_size=2), ids, mask,
                          dp_rank=0)
    assert model.tokens == []
    even = [4] * 6
    ids, mask = toy_batch(even)
    plan = plan_micro_batches(even, max_tokens=12)
    got = run_micro_batches(forward, model, plan, ids, mask, dp_rank=0)
    assert max(model.tokens) <= 12 and len(model.tokens) == plan.num_micro_batches
    torch.testing.assert_close(got.outputs, forward(model, ids, mask).detach())


def test_a_wrapper_keeps_the_check_and_a_bare_callable_is_the_callers_word():
    ids, mask = toy_batch()
    plan = plan_micro_batches(LENGTHS, max_tokens=12)
    forward, model = pf.make_forward("thd", seq_align=16), Recorder()

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        return forward(*args, **kwargs)

    with pytest.raises(ValueError, match="seq_align=16"):
        run_micro_batches(wrapped, model, plan, ids, mask, dp_rank=0)
    bare = lambda *args, **kwargs: forward(*args, **kwargs)  # noqa: E731  (no .layout: the caller vouches)
    got = run_micro_batches(bare, model, plan, ids, mask, dp_rank=0)
    torch.testing.assert_close(got.outputs, forward(model, ids, mask).detach())


# ------------------------------------------------------------------------------------------ grad mode


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_loss_fn_with_grad_mode_off_is_refused(mode):
    ids, mask = toy_batch()
    plan = plan_micro_batches(LENGTHS, max_tokens=12)
    forward, model = pf.make_forward("thd"), Recorder()
    with mode(), pytest.raises(RuntimeError, match="grad mode off.*outside no_grad.*drop loss_fn"):
        run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, loss_fn=lambda out: out.sum(-1))
    assert model.tokens == [] and model.weight.grad is None
    with mode():  # forward only: fine
        got = run_micro_batches(forward, model, plan, ids, mask, dp_rank=0)
    assert got.outputs.shape == (len(LENGTHS), max(LENGTHS), V)


def test_a_ranks_or_micro_batchs_rows_of_an_argument_are_named_against_the_global_batch():
    """Hazard: a tensor argument cut to one rank's rows reached each micro-batch whole, and the forward's error
    asked for the micro-batch's shape ([b=2]), the wrong advice for the step."""
    ids, mask = toy_batch()
    plan = plan_micro_batches(LENGTHS, max_tokens=12, dp_size=2)
    forward, model = pf.make_forward("thd", logits_processor=pf.logits.log_probs), Recorder()
    labels = pf.next_token_labels(ids, mask)
    with pytest.raises(ValueError, match=r"temperature has shape \(4,\); .* b=8 like input_ids"):
        run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, labels=labels,
                          temperature=torch.ones(8)[plan.rows(0)])
    assert model.tokens == []

    def own(model, input_ids, attention_mask, position_ids=None, *, seqlens, vocab_bias):  # a forward of one's own
        return pf.make_forward("thd")(model, input_ids, attention_mask, seqlens=seqlens) + vocab_bias

    bias = torch.arange(V).float()
    got = run_micro_batches(own, model, plan, ids, mask, dp_rank=0, vocab_bias=bias)  # reaches the forward whole
    plain = run_micro_batches(pf.make_forward("thd"), model, plan, ids, mask, dp_rank=0)
    assert torch.equal(got.outputs - plain.outputs, bias.expand_as(got.outputs))


def test_a_bad_cost_is_named_by_its_rule():
    with pytest.raises(ValueError, match=r"cost returned -3.0 for sequence 0 \(padded length 3\); .* non-negative"):
        plan_micro_batches(LENGTHS, max_tokens=12, cost=lambda p: -p)
    with pytest.raises(ValueError, match=r"cost returned shape \(\); .* one per sequence"):
        plan_micro_batches(LENGTHS, max_tokens=12, cost=lambda p: p.sum())


# ------------------------------------------------------------------------------------------------ MTP


@functools.lru_cache(maxsize=None)
def mtp_model():
    return build_mtp()


def mtp_plan(data_format, seqlens, dp_size):
    """THD: planned (28 tokens in 10: three micro-batches or more).  BSHD: rows padded to the longest do not fit
    the planner's micro-batches, so by hand, lengths 10 | 7, 5 | 1, 2, 3 (BSHD footprints 10, 14, 9)."""
    if data_format == "thd":
        return plan_micro_batches(seqlens, max_tokens=10, dp_size=dp_size)
    plan = plan_micro_batches(seqlens, max_tokens=14, dp_size=dp_size)
    mbs = [[[4], [5, 3], [0, 1, 2]]] if dp_size == 1 else [[[4], [0]], [[5, 3], [1, 2]]]
    return dataclasses.replace(plan, micro_batches=mbs, num_micro_batches=len(mbs[0]))


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
@pytest.mark.parametrize("with_loss_mask", [True, False])
def test_mtp_loss_over_micro_batches_equals_the_whole_batch(data_format, with_loss_mask):
    model = mtp_model()
    ids, mask, loss_mask, _ = mtp_batch()
    seqlens = mask.sum(-1).tolist()
    extra = {"mtp_loss_mask": loss_mask} if with_loss_mask else {}
    forward = pf.make_forward(data_format, mtp=True)
    with torch.no_grad():
        whole = forward(model, ids, mask, **extra)
        plan = mtp_plan(data_format, seqlens, 1)
        assert plan.num_micro_batches >= 3
        one = run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, **extra)
        plan2 = mtp_plan(data_format, seqlens, 2)
        two = [run_micro_batches(forward, model, plan2, ids, mask, dp_rank=r, **extra) for r in range(2)]
    assert one.mtp_loss.shape == whole["mtp_loss"].shape == (2,) and "mtp_loss" not in one.outputs
    assert (whole["mtp_loss"] > 0).all()
    torch.testing.assert_close(one.mtp_loss, whole["mtp_loss"])  # float32 rounding
    torch.testing.assert_close(two[0].mtp_loss + two[1].mtp_loss, whole["mtp_loss"])  # shares of the global loss
    torch.testing.assert_close(one.outputs["mtp_log_probs"], whole["mtp_log_probs"], atol=2e-5, rtol=2e-5)


def test_mtp_loss_with_a_backward_pass_is_the_same_and_gradients_flow():
    model = build_mtp()
    ids, mask, loss_mask, _ = mtp_batch()
    forward = pf.make_forward("thd", mtp=True)
    with torch.no_grad():
        whole = forward(model, ids, mask, mtp_loss_mask=loss_mask)["mtp_loss"]
    plan = plan_micro_batches(mask.sum(-1).tolist(), max_tokens=10)
    got = run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, mtp_loss_mask=loss_mask,
                            loss_fn=lambda out: -out["mtp_log_probs"].sum(-1), normalize="sum")
    torch.testing.assert_close(got.mtp_loss, whole)
    assert not got.mtp_loss.requires_grad
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "mtp" in n)
