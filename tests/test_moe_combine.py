"""packfwd's MoE combine (``packfwd.models.mlp.dispatch.ordered_unpermute``, every packfwd MoE layer's dispatcher):
each token's output is the sum of its own experts' outputs in ascending expert order, so its bits do not depend
on the other tokens of the batch, their number or their order.

Oracles: Megatron-Core's own ``unpermute`` (float64: equal to rounding), a plain per-token loop written here
(bitwise in float32: the same order of the same adds), and the token's bits alone against within other batches.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import permute, unpermute

from packfwd.models.mlp.dispatch import OrderedCombineDispatcher, PaddedAllGatherDispatcher, ordered_unpermute


def routing(t: int, e: int, k: int, seed: int, empty_rows=()) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(t, e, generator=g)
    rmap = torch.zeros(t, e, dtype=torch.bool).scatter_(1, scores.topk(k, dim=1).indices, True)
    rmap[list(empty_rows)] = False  # layout pads: routed nowhere
    return rmap


def expert_outputs(x: torch.Tensor, rmap: torch.Tensor) -> torch.Tensor:
    """Megatron's permuted rows (expert-major, tokens ascending), each made a function of (token row, expert)."""
    permuted, _, sorted_indices = permute(x, rmap, num_out_tokens=int(rmap.sum()))[:3]
    experts = rmap.T.nonzero()[:, 0]  # the expert of each permuted row, in permute's order
    return permuted * (1.0 + experts[:, None].to(x.dtype)) + experts[:, None].to(x.dtype), sorted_indices


def combine_inputs(x, rmap, k):
    out, sorted_indices = expert_outputs(x, rmap)
    return out, rmap, k, sorted_indices


@pytest.mark.parametrize("t,e,k,empty", [(9, 6, 2, ()), (16, 8, 4, (0, 5, 15)), (5, 3, 3, (2,)), (7, 4, 1, ())])
def test_equals_megatron_unpermute_and_a_per_token_loop(t, e, k, empty):
    rmap = routing(t, e, k, seed=t * 10 + e, empty_rows=empty)
    x = torch.randn(t, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out, sorted_indices = expert_outputs(x, rmap)
    got = ordered_unpermute(out, rmap, top_k=k, token_of_row=sorted_indices)
    theirs = unpermute(out, sorted_indices, restore_shape=x.shape, routing_map=rmap)
    torch.testing.assert_close(got, theirs, rtol=1e-13, atol=1e-13)
    # a plain loop: token by token, its experts ascending, float32 sums in that order
    out32 = out.float()
    row_of = {}
    for r, (ex, tok) in enumerate(rmap.T.nonzero().tolist()):
        row_of[tok, ex] = r
    want = torch.zeros(t, 5)
    for tok in range(t):
        acc = torch.zeros(5)
        for ex in range(e):
            if (tok, ex) in row_of:
                acc = acc + out32[row_of[tok, ex]]
        want[tok] = acc
    assert torch.equal(ordered_unpermute(out32, rmap, top_k=k, token_of_row=sorted_indices), want)
    assert torch.equal(got[list(empty)], torch.zeros(len(empty), 5, dtype=torch.float64))


def test_fewer_local_experts_than_top_k_and_no_rows():
    """Under expert parallelism a rank sees its local experts' columns only: a token may reach fewer than top_k of
    them (or none); with no routed row at all the output is zeros."""
    rmap = routing(10, 8, 4, seed=3)[:, :2]  # 2 local experts of 8, top-4 routing
    x = torch.randn(10, 3, dtype=torch.float64)
    out, sorted_indices = expert_outputs(x, rmap)
    torch.testing.assert_close(ordered_unpermute(out, rmap, top_k=4, token_of_row=sorted_indices),
                               unpermute(out, sorted_indices, restore_shape=x.shape, routing_map=rmap))
    none = torch.zeros(4, 2, dtype=torch.bool)
    assert torch.equal(ordered_unpermute(torch.zeros(0, 3), none, top_k=2, token_of_row=torch.zeros(0, dtype=torch.long)),
                       torch.zeros(4, 3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_tokens_bits_do_not_depend_on_its_batch(dtype):
    """The same 6 tokens (same routing, same expert outputs) alone, after 40 others, and shuffled among them: their
    combined rows are bit for bit the same (Megatron's scatter_add in bf16 rounds after each add, in the order
    of the permuted rows, so a token's bits there follow its neighbours' routing)."""
    g = torch.Generator().manual_seed(5)
    e, k, h = 8, 3, 16
    mine = routing(6, e, k, seed=11)
    mine_x = torch.randn(6, h, generator=g).to(dtype)
    alone = ordered_unpermute(*combine_inputs(mine_x, mine, k))
    others = routing(40, e, k, seed=12, empty_rows=(3, 17))
    others_x = torch.randn(40, h, generator=g).to(dtype)
    for order in ("after", "shuffled"):
        rmap, x = torch.cat([others, mine]), torch.cat([others_x, mine_x])
        where = torch.arange(40, 46)
        if order == "shuffled":
            perm = torch.randperm(46, generator=g)
            rmap, x = rmap[perm], x[perm]
            where = torch.argsort(perm)[40:]
        got = ordered_unpermute(*combine_inputs(x, rmap, k))[where]
        assert torch.equal(got, alone), order


def test_gradient_is_the_gather_of_the_output_gradient():
    rmap = routing(12, 5, 2, seed=7, empty_rows=(4,))
    n = int(rmap.sum())
    tokens = rmap.T.nonzero()[:, 1]  # the token of each permuted row
    out = torch.randn(n, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda o: ordered_unpermute(o, rmap, 2, tokens), (out,))
    upstream = torch.randn(12, 3, dtype=torch.float64)
    ordered_unpermute(out, rmap, 2, tokens).backward(upstream)
    assert torch.equal(out.grad, upstream[tokens])


def test_every_moe_layer_gets_the_ordered_combine():
    from packfwd.models import ModelArgs, build_model
    from packfwd.models.mlp import Moe

    model = build_model(ModelArgs(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=2,
                                  num_attention_heads=4, num_query_groups=2, family="qwen3_moe", qk_norm=True,
                                  moe=Moe(num_experts=4, top_k=2, ffn_hidden_size=16)))
    dispatchers = [m.token_dispatcher for m in model.modules() if hasattr(m, "token_dispatcher")]
    assert len(dispatchers) == 2
    assert all(type(d) is OrderedCombineDispatcher for d in dispatchers)
    assert issubclass(PaddedAllGatherDispatcher, OrderedCombineDispatcher)  # expert parallelism keeps it


@pytest.mark.parametrize("t,e,k,empty", [(9, 6, 2, ()), (16, 8, 4, (0, 5, 15)), (7, 4, 1, ())])
def test_ordered_permute_equals_megatron_permute_and_its_gradient(t, e, k, empty):
    """Forward: Megatron-Core's permute, rows and ``sorted_indices`` bit for bit; backward: its gradient (a token's
    rows summed), to float64 rounding, and a per-token loop in ascending expert order bit for bit in float32."""
    from packfwd.models.mlp.dispatch import ordered_permute

    rmap = routing(t, e, k, seed=t + e, empty_rows=empty)
    x = torch.randn(t, 4, dtype=torch.float64, requires_grad=True)
    x_theirs = x.detach().clone().requires_grad_(True)
    mine, rows, _ = ordered_permute(x, rmap, top_k=k)
    theirs, _, sorted_indices = permute(x_theirs, rmap, num_out_tokens=int(rmap.sum()))[:3]
    assert torch.equal(mine, theirs) and torch.equal(rows, sorted_indices)
    upstream = torch.randn_like(mine)
    mine.backward(upstream)
    theirs.backward(upstream)
    torch.testing.assert_close(x.grad, x_theirs.grad, rtol=1e-13, atol=1e-13)
    x32 = x.detach().float().requires_grad_(True)
    up32 = upstream.float()
    ordered_permute(x32, rmap, top_k=k)[0].backward(up32)
    want = torch.zeros(t, 4)
    for tok in range(t):
        acc = torch.zeros(4)
        for r in range(len(rows)):  # rows are expert-major: a token's rows come in ascending expert order
            if rows[r] == tok:
                acc = acc + up32[r]
        want[tok] = acc
    assert torch.equal(x32.grad, want)


def test_a_token_with_more_experts_than_top_k_fails_instead_of_losing_some():
    """The combine has min(top_k, E) slots per token: a routing map with more would drop outputs; it raises."""
    rmap = routing(6, 5, 3, seed=2)
    x = torch.randn(6, 2)
    out, sorted_indices = expert_outputs(x, rmap)
    with pytest.raises(RuntimeError, match="more than top_k=2 experts"):
        ordered_unpermute(out, rmap, top_k=2, token_of_row=sorted_indices)


def test_a_rank_whose_experts_got_no_token_permutes_and_combines_nothing():
    """Under expert parallelism a rank's local experts may receive no token: zero rows out, zeros back, and the
    permutation's backward gives every token a zero gradient."""
    from packfwd.models.mlp.dispatch import ordered_permute

    rmap = torch.zeros(5, 2, dtype=torch.bool)
    x = torch.randn(5, 3, requires_grad=True)
    permuted, rows, slots = ordered_permute(x, rmap, top_k=2)
    assert permuted.shape == (0, 3) and rows.shape == (0,)
    out = ordered_unpermute(permuted, rmap, 2, rows, slots)
    assert torch.equal(out, torch.zeros(5, 3))
    (permuted.sum() + out.sum()).backward()
    assert torch.equal(x.grad, torch.zeros(5, 3))


@pytest.mark.parametrize("t,e,k,empty", [(9, 6, 2, ()), (16, 8, 4, (0, 5, 15)), (5, 3, 3, (2,)), (7, 4, 1, ())])
def test_fixed_rows_are_ordered_permutes_rows_then_sinks(t, e, k, empty):
    """The grouped experts' sync-free layout: ``t * k`` rows, the first ``n`` exactly :func:`ordered_permute`'s
    (rows, tokens, probabilities: Megatron-Core's order), then the sinks; every valid slot names its own row, a
    sink's probability is 0, and NaN in every sink row (what the grouped GEMMs leave there) reaches neither the
    combine nor the permutation's gradient: both equal the exact path's bit for bit."""
    from packfwd.models.mlp.dispatch import fixed_permute, fixed_rows, ordered_permute

    rmap = routing(t, e, k, seed=3 * t + e, empty_rows=empty)
    n = int(rmap.sum())
    probs = torch.rand(t, e, dtype=torch.float64) * rmap
    rows = fixed_rows(rmap, top_k=k)
    x = torch.randn(t, 4, dtype=torch.float64, requires_grad=True)
    exact, token_of_row, slots = ordered_permute(x, rmap, top_k=k)
    assert rows.token_of_row.shape == (t * k,) and torch.equal(rows.token_of_row[:n], token_of_row)
    assert torch.equal(rows.counts, rmap.sum(0)) and int(rows.valid.sum()) == n
    assert torch.equal(rows.valid, slots[1])
    assert torch.equal(rows.token_of_row[rows.picked[rows.valid]], torch.arange(t)[:, None].expand(t, k)[rows.valid])
    assert torch.equal(rows.picked[rows.valid], slots[0][rows.valid])  # the same rows, slot for slot
    p = rows.probs(probs)
    assert torch.equal(p[:n], probs.T.contiguous().masked_select(rmap.T.contiguous())) and not p[n:].any()

    x_fixed = x.detach().clone().requires_grad_(True)
    permuted = fixed_permute(x_fixed, rows)
    assert torch.equal(permuted[:n], exact)
    upstream = torch.randn(t * k, 4, dtype=torch.float64)
    poisoned = upstream.clone()
    poisoned[n:] = float("nan")
    exact.backward(upstream[:n])
    permuted.backward(poisoned)
    assert torch.equal(x_fixed.grad, x.grad)

    outs = torch.randn(t * k, 4, dtype=torch.float64)
    outs[n:] = float("nan")
    got = ordered_unpermute(outs, rmap, k, rows.token_of_row, (rows.picked, rows.valid))
    assert torch.equal(got, ordered_unpermute(outs[:n], rmap, k, token_of_row, slots))


def test_fixed_rows_with_no_routed_token_and_more_than_top_k_fails():
    """A rank whose experts got no token: every row a sink, counts zero; a token with more experts than top_k
    fails (device-side assert) instead of losing some."""
    from packfwd.models.mlp.dispatch import fixed_rows

    rows = fixed_rows(torch.zeros(5, 2, dtype=torch.bool), top_k=2)
    assert rows.token_of_row.shape == (10,) and not rows.valid.any() and not rows.counts.any()
    with pytest.raises(RuntimeError, match="more than top_k=2 experts"):
        fixed_rows(routing(6, 5, 3, seed=2), top_k=2)


def test_grouped_moe_layers_ignore_whatever_the_gemms_leave_in_the_sink_rows(monkeypatch):
    """A whole MoE model on the grouped path (the dispatcher's ``t * k`` rows, counts on the device side), with
    ``torch._grouped_mm`` made to write NaN into every row no group covers (the GPU kernel leaves them
    uninitialised): logits and every gradient finite and equal to the sequential path's (exact pairs, Megatron's
    loop), with layout pads (``seq_align=8``) routed nowhere."""
    from packfwd.forward import make_forward
    from packfwd.models import from_hf
    from packfwd.models.mlp.experts import set_grouped_experts
    from tests.test_moe import hf_model, ragged_batch

    original, sinks = torch._grouped_mm, []

    def unwritten(a, b, offs=None, **kw):
        out = original(a, b, offs=offs, **kw)
        if a.dim() == 2 and b.dim() == 3 and offs is not None and int(offs[-1]) < out.shape[0]:
            sinks.append(out.shape[0] - int(offs[-1]))
            out[int(offs[-1]):] = float("nan")
        return out

    monkeypatch.setattr(torch, "_grouped_mm", unwritten)
    model = from_hf(hf_model("qwen3_moe-norm").float())
    ids, mask = ragged_batch()
    results = {}
    for grouped in (True, False):
        set_grouped_experts(model, grouped)
        model.zero_grad(set_to_none=True)
        logits = make_forward("thd", seq_align=8)(model, ids, mask)
        (logits * logits.detach()).sum().backward()
        results[grouped] = logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    assert sinks and all(s > 0 for s in sinks)  # the grouped path ran with sink rows
    (got, got_grads), (want, want_grads) = results[True], results[False]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert sorted(got_grads) == sorted(want_grads)
    for name, grad in want_grads.items():
        assert torch.isfinite(got_grads[name]).all(), name
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)
