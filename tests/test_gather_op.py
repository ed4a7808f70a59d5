"""The custom op ``packfwd::gather_rows`` (the CUDA transforms' row gather) on the CPU, against a plain loop:
its value, its backward pass (gradcheck in float64, through the inverse map), its vmap rule and torch.compile,
and every transform routed through it.  On the CPU the op runs its torch implementation; the Triton kernel
behind it is tested in tests/gpu/test_gather_kernel.py (on the GPU, and on the CPU in Triton's interpreter)."""

import pytest
import torch
from torch.autograd import gradcheck
from torch.func import grad, jvp, vjp, vmap

from packfwd import from_bshd, from_thd, pad, plan_bshd, plan_thd, plan_unpad, to_bshd, to_thd, unpad
from packfwd.ops import gather as _gather
from packfwd.ops.gather import _op_gather_rows as gather_rows, gather_rows_op


def gather(srcs, index, offset, inverse, inverse_offset, fill):
    return gather_rows(srcs, index, inverse, fill, index_offset=offset, inverse_offset=inverse_offset)


def loop_gather(srcs, index, offset, fill):
    src = torch.cat(srcs)
    rows = []
    for k in index.tolist():
        k -= offset
        rows.append(src[k] if 0 <= k < src.shape[0] else torch.full_like(src[0], fill))
    return torch.stack(rows) if rows else src[:0]


def partial_bijection(n_out, n_src, seed):
    """index [n_out] (-1 where nothing is read) and its inverse [n_src] (-1 where nothing reads the row)."""
    g = torch.Generator().manual_seed(seed)
    k = min(n_out, n_src) * 2 // 3
    outs = torch.randperm(n_out, generator=g)[:k]
    ins = torch.randperm(n_src, generator=g)[:k]
    index = torch.full((n_out,), -1, dtype=torch.long)
    inverse = torch.full((n_src,), -1, dtype=torch.long)
    index[outs], inverse[ins] = ins, outs
    return index, inverse


@pytest.mark.parametrize("nsrc, offset", [(1, 0), (2, 0), (3, 4)])
def test_value_matches_loop(nsrc, offset):
    srcs = [torch.randn(6, 2, 3) + 1 for _ in range(nsrc)]
    index = torch.randint(-2, 6 * nsrc + offset + 2, (11,))
    out = gather_rows_op(srcs, index, offset, index, 0, -5.0)
    assert torch.equal(out, loop_gather(srcs, index, offset, -5.0))


def test_backward_gathers_through_the_inverse():
    index, inverse = partial_bijection(9, 2 * 7, 0)
    a, b = (torch.randn(7, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert gradcheck(lambda a, b: gather([a, b], index, 0, inverse, 0, 2.0), (a, b))
    assert gradcheck(lambda a, b: gather_rows_op([a, b], index, 0, inverse, 0, 2.0), (a, b))  # the op alone
    # with offsets: the output reads rows 5.. of the sources' numbering, the inverse numbers outputs from 3
    shifted_index = torch.where(index >= 0, index + 5, -1)
    shifted_inverse = torch.where(inverse >= 0, inverse + 3, -1)
    assert gradcheck(lambda a, b: gather([a, b], shifted_index, 5, shifted_inverse, 3, 0.0), (a, b))
    # and the backward of the backward
    assert torch.autograd.gradgradcheck(lambda a, b: gather([a, b], index, 0, inverse, 0, 0.0), (a, b))


def test_grad_is_the_transposed_gather():
    index, inverse = partial_bijection(8, 10, 1)
    w = torch.randn(8, 2)
    g = grad(lambda x: (gather([x], index, 0, inverse, 0, 0.0) * w).sum())(torch.randn(10, 2))
    expected = torch.zeros(10, 2)
    for i, k in enumerate(index.tolist()):
        if k >= 0:
            expected[k] = w[i]
    assert torch.equal(g, expected)
    # forward mode: the tangent is gathered like the primal, with 0 where the fill is
    t = torch.randn(10, 2)
    _, jt = jvp(lambda x: gather([x], index, 0, inverse, 0, 3.0), (torch.randn(10, 2),), (t,))
    assert torch.equal(jt, loop_gather([t], index, 0, 0.0))


@pytest.mark.parametrize("in_dims", [(0, 0), (2, None), (None, 1)])
def test_vmap_over_the_sources(in_dims):
    index, inverse = partial_bijection(7, 2 * 5, 2)
    a = torch.randn(4, 5, 3) if in_dims[0] == 0 else torch.randn(5, 3, 4) if in_dims[0] == 2 else torch.randn(5, 3)
    b = torch.randn(4, 5, 3) if in_dims[1] == 0 else torch.randn(5, 4, 3) if in_dims[1] == 1 else torch.randn(5, 3)
    got = vmap(lambda a, b: gather([a, b], index, 0, inverse, 0, 1.5), in_dims=in_dims)(a, b)
    assert torch.equal(got, vmap(lambda a, b: gather_rows_op([a, b], index, 0, inverse, 0, 1.5), in_dims=in_dims)(a, b))
    pick = lambda t, d, i: t if d is None else t.select(d, i)  # noqa: E731
    expected = torch.stack([loop_gather([pick(a, in_dims[0], i), pick(b, in_dims[1], i)], index, 0, 1.5) for i in range(4)])
    assert torch.equal(got, expected)


def test_vmap_over_plans():
    (i0, v0), (i1, v1) = partial_bijection(6, 6, 3), partial_bijection(6, 6, 4)
    x = torch.randn(6, 2)
    got = vmap(lambda i, v: gather([x], i, 0, v, 0, 0.0))(torch.stack([i0, i1]), torch.stack([v0, v1]))
    assert torch.equal(got, torch.stack([loop_gather([x], i0, 0, 0.0), loop_gather([x], i1, 0, 0.0)]))


def test_compiles_fullgraph():
    torch._dynamo.reset()
    index, inverse = partial_bijection(7, 9, 5)
    f = lambda x: gather([x * 2], index, 0, inverse, 0, 1.0) + 1  # noqa: E731
    x = torch.randn(9, 4, requires_grad=True)
    got, expected = torch.compile(f, fullgraph=True)(x), f(x)
    assert torch.equal(got, expected)
    w = torch.randn(7, 4)
    assert torch.equal(torch.autograd.grad((got * w).sum(), x)[0], torch.autograd.grad((expected * w).sum(), x)[0])


def check_transforms_through_the_op(monkeypatch, device="cpu", *, slow_checks=True):
    """Every transform routed through the custom op (as on CUDA) against the plain-torch path: values, vmap,
    torch.func.grad, vjp, jvp, and (``slow_checks``) gradcheck, gradgradcheck and torch.compile.  Shared with the
    kernel tests (tests/gpu/test_gather_kernel.py), which run it with the op on the Triton kernel."""
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [1, 0, 1, 1, 0, 1]], device=device)
    mask = mask.bool()
    thd = [plan_thd(mask, tp_size=2, cp_size=2, cp_rank=r) for r in range(2)]
    unp, bsh, thd1 = plan_unpad(mask), plan_bshd(mask, tp_size=2), plan_thd(mask, tp_size=4)

    def everything(x):
        outs = [to_thd(x, i)[0] * 2 for i in thd]
        packed = unpad(x, unp)[0]
        y = to_bshd(x, bsh)[0]
        return (from_thd(outs, thd[0], fill_value=-1), pad(packed + 1, unp, 3), from_bshd(y, bsh),
                from_thd(to_thd(x, thd1)[0], thd1), *outs, packed, y)

    x = torch.randn(4, 6, 5, dtype=torch.float64, device=device, requires_grad=True)
    expected = everything(x)
    rank0_grad = torch.autograd.grad(expected[4].sum(), x, retain_graph=True)[0]
    monkeypatch.setattr(_gather, "use_op", lambda src: True)
    got = everything(x)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    w = [torch.randn_like(t) for t in got]
    ga = torch.autograd.grad(sum((a * v).sum() for a, v in zip(got, w)), x)[0]
    gb = torch.autograd.grad(sum((b * v).sum() for b, v in zip(expected, w)), x)[0]
    assert torch.allclose(ga, gb, rtol=0, atol=1e-12)
    xs = torch.randn(3, 4, 6, 2, dtype=torch.float64, device=device)
    batched = vmap(lambda x: everything(x)[0])(xs)
    assert torch.equal(batched, torch.stack([everything(v)[0] for v in xs]))
    g = grad(lambda x: everything(x)[1].sum())(x.detach())
    assert torch.equal(g, mask[..., None].double().expand(4, 6, 5))
    out, pullback = vjp(lambda x: everything(x)[4], x.detach())
    assert torch.equal(pullback(torch.ones_like(out))[0], rank0_grad)
    t = torch.randn(4, 6, 5, dtype=torch.float64, device=device)
    tangent = jvp(lambda x: everything(x)[0], (x.detach(),), (t,))[1]
    assert torch.equal(tangent, torch.where(mask[..., None], 2 * t, 0))
    if not slow_checks:
        return
    assert gradcheck(lambda x: everything(x)[:4], (x[:, :, :2].detach().requires_grad_(),))
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: everything(x)[:4], fullgraph=True)(x.detach())
    for a, b in zip(compiled, expected):
        assert torch.equal(a, b.detach())


def test_transforms_through_the_op_equal_the_torch_path(monkeypatch):
    check_transforms_through_the_op(monkeypatch)
