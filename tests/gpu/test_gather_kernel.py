"""The Triton row-gather kernel on the GPU against the plain-torch reference (bit for bit: it only moves bytes),
for every dtype and row width, several sources, offsets and fill values; and the transforms routed through it
against the torch path: values, gradients, vmap and torch.compile.

    PYTHONPATH=. python -m pytest -q tests/gpu
"""

import pytest
import torch
from torch.func import grad, vmap

from packfwd import _rows, from_bshd, from_thd, pad, plan_bshd, plan_thd, plan_unpad, to_bshd, to_thd, unpad
from packfwd._gather_op import _launch, _reference

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
triton = pytest.importorskip("triton")

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool]


def rand(shape, dtype, g):
    x = torch.randn(shape, generator=g, device="cuda") * 100 + 0.5
    return x.to(dtype)


CASES = [(d, t) for d in DTYPES for t in [(3,), (4096,)]] + [(torch.bfloat16, t) for t in [(), (1,), (7, 5), (1000, 3)]]


@pytest.mark.parametrize("dtype, trailing", CASES)
def test_kernel_equals_reference(dtype, trailing):
    i = CASES.index((dtype, trailing))
    g = torch.Generator(device="cuda").manual_seed(i)
    nsrc, offset, fill = [(1, 0, 0.0), (2, 0, 3.0), (3, 5, 7.0)][i % 3]
    srcs = [rand((37, *trailing), dtype, g) for _ in range(nsrc)]
    index = torch.randint(-2, 37 * nsrc + offset + 3, (301,), generator=g, device="cuda")
    out = _launch(srcs, index, offset, fill)
    assert out.dtype == dtype and out.shape == (301, *trailing)
    assert torch.equal(out, _reference(srcs, index, offset, fill))


def test_kernel_reads_non_contiguous_and_offset_sources():
    g = torch.Generator(device="cuda").manual_seed(0)
    big = rand((64, 2, 33), torch.float32, g)
    srcs = [big[:, 0], big[1:33, 1]]  # a strided view and a view at an odd offset
    srcs = [s[:32] for s in srcs]
    index = torch.randint(-1, 64, (50,), generator=g, device="cuda")
    assert torch.equal(_launch(srcs, index, 0, 2.0), _reference(srcs, index, 0, 2.0))


def test_kernel_handles_empty_inputs():
    x = torch.randn(0, 8, device="cuda")
    out = _launch([x], torch.tensor([-1, -1], device="cuda"), 0, 4.0)
    assert torch.equal(out, torch.full((2, 8), 4.0, device="cuda"))
    assert _launch([torch.randn(5, 8, device="cuda")], torch.empty(0, dtype=torch.long, device="cuda"), 0, 0.0).shape == (0, 8)


def test_transforms_through_the_kernel_equal_the_torch_path(monkeypatch):
    mask = torch.rand(6, 50, device="cuda") < 0.6
    mask[2] = False
    thd = [plan_thd(mask, tp_size=2, cp_size=2, cp_rank=r) for r in range(2)]
    pu, pb, thd1 = plan_unpad(mask), plan_bshd(mask, tp_size=2), plan_thd(mask, tp_size=4)

    def everything(x):
        outs = [to_thd(x, i)[0] * 2 for i in thd]
        packed = unpad(x, pu)[0]
        y = to_bshd(x, pb)[0]
        return (from_thd(outs, thd[0], fill_value=-1), pad(packed + 1, pu, 3), from_bshd(y, pb),
                from_thd(to_thd(x, thd1)[0], thd1))

    x = torch.randn(6, 50, 8, device="cuda", dtype=torch.float64, requires_grad=True)
    expected = everything(x)
    w = [torch.randn_like(t) for t in expected]
    g_expected = torch.autograd.grad(sum((a * v).sum() for a, v in zip(expected, w)), x)[0]
    monkeypatch.setattr(_rows, "use_op", lambda src: True)
    got = everything(x)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    g = torch.autograd.grad(sum((a * v).sum() for a, v in zip(got, w)), x)[0]
    assert torch.allclose(g, g_expected, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: everything(x)[0], (x[:, :, :2].detach().requires_grad_(),))
    xs = torch.randn(3, 6, 50, 8, device="cuda", dtype=torch.float64)
    assert torch.equal(vmap(lambda x: everything(x)[1])(xs), torch.stack([everything(v)[1] for v in xs]))
    gx = grad(lambda x: everything(x)[1].sum())(x.detach())
    assert torch.equal(gx, mask[..., None].double().expand_as(gx))
    torch._dynamo.reset()
    compiled = torch.compile(everything, fullgraph=True)(x.detach())
    for a, b in zip(compiled, expected):
        assert torch.equal(a, b.detach())


def test_large_tensors_take_the_kernel_path():
    x = torch.empty(_rows.KERNEL_MIN_BYTES // 4, device="cuda")
    assert _rows.use_op(x) and not _rows.use_op(x[:-1])
