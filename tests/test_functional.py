"""Applying a plan is a pure function of the data: it composes with torch.func (vmap, grad, vjp), passes gradcheck
in float64 through every transform and its inverse, and compiles with fullgraph=True to the same result."""

import pytest
import torch
from torch.autograd import gradcheck
from torch.func import grad, vjp, vmap

from packfwd import from_bshd, from_thd, pad, plan_bshd, plan_thd, plan_unpad, sp_pad, sp_unpad, to_bshd, to_thd, unpad

from .oracles import ref_masked, ref_thd_rank

MASK = torch.tensor(
    [[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [1, 0, 1, 1, 0, 1]], dtype=torch.bool
)


def plans(tp=2, cp=2):
    return {
        "unpad": (plan_unpad(MASK), lambda x, i: unpad(x, i)[0], pad),
        "thd_cp1": (plan_thd(MASK, tp_size=tp), lambda x, i: to_thd(x, i)[0], from_thd),
        "bshd": (plan_bshd(MASK, tp_size=tp), lambda x, i: to_bshd(x, i)[0], from_bshd),
    }


@pytest.mark.parametrize("name", ["unpad", "thd_cp1", "bshd"])
def test_gradcheck_forward_and_inverse(name):
    info, fwd, inv = plans()[name]
    x = torch.randn(4, 6, 3, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda x: fwd(x, info), (x,))
    y = fwd(x, info).detach().requires_grad_()
    assert gradcheck(lambda y: inv(y, info), (y,))


def test_gradcheck_thd_context_parallel_all_ranks():
    infos = [plan_thd(MASK, tp_size=2, cp_size=2, cp_rank=r) for r in range(2)]
    x = torch.randn(4, 6, 2, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda x: torch.cat([to_thd(x, i)[0] for i in infos]), (x,))
    ys = [to_thd(x, i)[0].detach().requires_grad_() for i in infos]
    assert gradcheck(lambda a, b: from_thd([a, b], infos[0]), tuple(ys))


def test_gradcheck_sp_pad():
    x = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda x: sp_unpad(sp_pad(x, 4) * 2, 5), (x,))


def test_pad_gradients_are_zero_at_padding():
    info = plan_thd(MASK, tp_size=4)
    x = torch.randn(4, 6, 2, requires_grad=True)
    to_thd(x, info)[0].sum().backward()
    assert torch.equal(x.grad, MASK[..., None].float().expand_as(x))


@pytest.mark.parametrize("name", ["unpad", "thd_cp1", "bshd"])
def test_vmap_over_a_stack_of_batches(name):
    info, fwd, inv = plans()[name]
    xs = torch.randn(3, 4, 6, 5)
    got = vmap(lambda x: fwd(x, info))(xs)
    assert torch.equal(got, torch.stack([fwd(x, info) for x in xs]))
    back = vmap(lambda y: inv(y, info))(got)
    assert torch.equal(back, torch.stack([ref_masked(x, MASK) for x in xs]))


def test_vmap_over_trailing_dim_with_cp():
    infos = [plan_thd(MASK, cp_size=2, cp_rank=r) for r in range(2)]
    x = torch.randn(4, 6, 7)
    got = vmap(lambda col: to_thd(col, infos[1])[0], in_dims=2, out_dims=1)(x)
    assert torch.equal(got, ref_thd_rank(x, MASK, 1, 2, 1))


def test_grad_and_vjp():
    info = plan_thd(MASK, tp_size=2, cp_size=1)
    x = torch.randn(4, 6, 3)
    w = torch.randn(info.local_tokens, 3)
    g = grad(lambda x: (to_thd(x, info)[0] * w).sum())(x)
    expected = from_thd(w, info)  # d/dx of <to_thd(x), w> is w put back in place, zero at pads
    assert torch.equal(g, expected)
    y, pullback = vjp(lambda y: from_thd(y, info), to_thd(x, info)[0])
    (gy,) = pullback(torch.ones_like(y))
    assert torch.equal(gy, to_thd(MASK[..., None].float().expand(4, 6, 3), info)[0])


@pytest.mark.parametrize("cp", [1, 2])
def test_compiled_apply_equals_eager(cp):
    torch._dynamo.reset()
    infos = [plan_thd(MASK, tp_size=2, cp_size=cp, cp_rank=r) for r in range(cp)]
    uinfo = plan_unpad(MASK)

    def roundtrip(x):
        outs = [to_thd(x, i)[0] * 2 for i in infos]
        packed = unpad(x, uinfo)[0]
        return from_thd(outs if cp > 1 else outs[0], infos[0]), pad(packed + 1, uinfo, fill_value=-1)

    x = torch.randn(4, 6, 8)
    compiled = torch.compile(roundtrip, fullgraph=True, backend="inductor")
    for a, b in zip(compiled(x), roundtrip(x)):
        assert torch.equal(a, b)


def test_planning_inside_grad_reads_the_lengths_and_under_vmap_is_refused():
    """Planning inside torch.func.grad failed on the lengths' read ("Cannot access data pointer of Tensor that
    doesn't have storage"); the lengths are integers, read through grad's wrapper now, equal to a plan made outside.
    Under vmap a plan would be batched: refused, naming the fix."""
    x = torch.randn(2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    inside = grad(lambda x: (to_thd(x, mask, seq_align=4)[0] ** 2).sum())(x)
    outside = grad(lambda x: (to_thd(x, plan_thd(mask, seq_align=4))[0] ** 2).sum())(x)
    assert torch.equal(inside, outside) and torch.equal(inside, 2 * x * mask[..., None])
    with pytest.raises(ValueError, match="make the plan outside vmap"):
        vmap(lambda m: plan_thd(m).local_tokens)(torch.stack([mask, mask]))
