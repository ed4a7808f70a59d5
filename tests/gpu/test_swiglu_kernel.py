"""The fused Triton SwiGLU (``packfwd.ops.swiglu``) against float64 math and against Megatron-Core's own SwiGLU
(the unfused ``glu`` of ``MLP.forward`` that packfwd runs today, bit for bit in float32 on the GPU; and
``megatron.core.fusions.fused_bias_swiglu.bias_swiglu_impl``, what ``MLP`` calls with ``bias_activation_fusion``,
run eagerly), forward and backward: values and gradients, bf16 / fp16 / fp32, ``f`` not a power of 2 (also
under a tiny column block, so a row spans many programs), 1 to 37 rows (partial row blocks), 3-D input, a row
slice with a wide stride (read in place) and a transposed input (copied), no rows, refused shapes and dtypes, and
the same bits twice.

Runs on a CUDA GPU, or on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``; see ``_kernel_device``) at tiny
sizes.  What the interpreter cannot show: the GPU's own float math (numpy computes ``exp`` there, so comparisons
hold to tolerances, not bit for bit) and the speed (unmeasured).

    TRITON_INTERPRET=1 PYTHONPATH=. python -m pytest -q tests/gpu/test_swiglu_kernel.py
"""

import pytest
import torch

from packfwd.ops import swiglu as K

from ._kernel_device import DEVICE, needs_kernels

pytestmark = [needs_kernels]
triton = pytest.importorskip("triton")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (leading shape, f): non-powers of 2, partial row blocks (CONFIG rows = 8), one row, 37 rows, 3-D [s, b, 2f]
SHAPES = [((1,), 1), ((5,), 3), ((13,), 37), ((37,), 20), ((3, 4), 11)]


def tol(dtype):
    """rtol of one rounding to ``dtype`` (the kernel's single rounding, against exact math).  Triton 3.9's
    interpreter casts float32 to bf16 by truncation (``cast_impl`` drops the low bits), not to nearest as the GPU
    does: one ulp there, half of one on the GPU."""
    bf16 = 2**-8 if DEVICE == "cuda" else 2**-7
    return {torch.float32: 2e-6, torch.bfloat16: bf16, torch.float16: 2**-10}[dtype]


def make(lead, f, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(*lead, 2 * f, generator=g) * 3).to(dtype).to(DEVICE)
    go = torch.randn(*lead, f, generator=g).to(dtype).to(DEVICE)
    return y, go


def exact(y, go):
    """float64 output and d(sum go * out)/dy by plain autograd on the same rounded inputs."""
    x = y.detach().double().requires_grad_(True)
    gate, up = x.chunk(2, dim=-1)
    out = torch.nn.functional.silu(gate) * up
    (out * go.double()).sum().backward()
    return out.detach(), x.grad


def kernel(y, go):
    x = y.detach().clone().requires_grad_(True)
    out = K.SwiGLUKernel.apply(x)
    out.backward(go)
    return out.detach(), x.grad


def close(got, want, rtol, scale):
    """|got - want| <= rtol |want| + a floor of rtol * max|want| / 64 (values near 0)."""
    err = (got.double() - want.double()).abs()
    bound = rtol * want.double().abs() + rtol * scale / 64 + 1e-30
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}, worst ratio {(err / bound).max():.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead,f", SHAPES)
def test_against_float64(lead, f, dtype):
    y, go = make(lead, f, dtype)
    out, grad = kernel(y, go)
    want_out, want_grad = exact(y, go)
    assert out.shape == (*lead, f) and out.dtype == dtype and out.is_contiguous()
    assert grad.shape == y.shape and grad.dtype == dtype
    close(out, want_out, tol(dtype), want_out.abs().max().item())
    close(grad, want_grad, tol(dtype), want_grad.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_against_torch_reference(dtype):
    """The torch reference (what ``swiglu`` runs without the kernels) is the same math: one rounding apart."""
    y, go = make((13,), 37, dtype, seed=1)
    out, grad = kernel(y, go)
    close(out, K.reference(y), tol(dtype), 1.0)
    close(grad, K.reference_backward(go, y), tol(dtype), 1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_against_megatron(dtype):
    """Megatron-Core's SwiGLU (``bias_swiglu_impl``, eager) computes in the input's dtype, rounding ``silu(gate)``
    and each backward factor on the way: within a few of those roundings of the kernel's, scaled by the row."""
    fused = pytest.importorskip("megatron.core.fusions.fused_bias_swiglu")
    y, go = make((3, 4), 37, dtype, seed=2)
    x = y.clone().requires_grad_(True)
    with torch._dynamo.config.patch(disable=True):  # Megatron wraps these in torch.compile
        m_out = fused.bias_swiglu_impl(x, None)
        m_out.backward(go)
    out, grad = kernel(y, go)
    rtol = {torch.float32: 1e-5, torch.bfloat16: 4 * 2**-8, torch.float16: 4 * 2**-10}[dtype]
    close(out, m_out, rtol, m_out.abs().max().item() * 16)
    close(grad, x.grad, rtol, x.grad.abs().max().item() * 16)
    if dtype == torch.float32:  # float32 is float32 on both sides: rounding apart
        torch.testing.assert_close(out, m_out, rtol=1e-6, atol=1e-6)


def megatron_glu(x):
    """Megatron-Core 0.16.1's unfused gated activation, what packfwd runs today (``bias_activation_fusion=False``,
    no bias, no clamp): the ``glu`` closure of ``MLP.forward`` (megatron/core/transformer/mlp.py, lines 219-228)."""
    x_glu, x_linear = torch.chunk(x, 2, dim=-1)
    return torch.nn.functional.silu(x_glu) * (x_linear + 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_against_megatron_unfused(dtype):
    """Today's path: within its own roundings of ``silu(gate)`` and ``d_out * up`` to the input's dtype; in
    float32 on the GPU bit for bit (the kernels do torch's CUDA silu / silu_backward operations in order)."""
    y, go = make((13,), 37, dtype, seed=7)
    x = y.clone().requires_grad_(True)
    m_out = megatron_glu(x)
    m_out.backward(go)
    out, grad = kernel(y, go)
    rtol = {torch.float32: 1e-5, torch.bfloat16: 4 * 2**-8, torch.float16: 4 * 2**-10}[dtype]
    close(out, m_out, rtol, m_out.abs().max().item() * 16)
    close(grad, x.grad, rtol, x.grad.abs().max().item() * 16)
    if DEVICE == "cuda" and dtype == torch.float32:
        assert torch.equal(out, m_out.detach()) and torch.equal(grad, x.grad)


def test_many_column_blocks(monkeypatch):
    """A tiny column block: each row spans 5 programs, the last partly masked; same values as one block."""
    y, go = make((13,), 37, torch.float32, seed=3)
    whole = kernel(y, go)
    monkeypatch.setitem(K.CONFIG, "block_f", 8)
    monkeypatch.setitem(K.CONFIG, "rows", 2)
    parts = kernel(y, go)
    assert all(torch.equal(a, b) for a, b in zip(whole, parts))


def test_strided_inputs():
    """A row slice of a wider buffer (row stride 2 * 2f + 6: read in place) and a transposed tensor (last stride
    not 1: copied once) give the contiguous input's bits; the input is never written."""
    y, go = make((9,), 21, torch.bfloat16, seed=4)
    want = kernel(y, go)
    wide = torch.zeros(18, 2 * 42 + 6, dtype=y.dtype, device=DEVICE)
    wide[::2, 3:3 + 42] = y
    sliced = wide[::2, 3:3 + 42]
    assert not sliced.is_contiguous() and sliced.stride(-1) == 1
    before = wide.clone()
    got = kernel(sliced, go)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert torch.equal(wide, before)
    transposed = y.t().contiguous().t()
    assert transposed.stride(-1) != 1
    got = kernel(transposed, go.t().contiguous().t())
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_bitwise_twice():
    y, go = make((37,), 20, torch.bfloat16, seed=5)
    first, second = kernel(y, go), kernel(y, go)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_no_rows():
    y = torch.zeros(0, 3, 10, device=DEVICE)
    assert K.forward(y).shape == (0, 3, 5)
    assert K.backward(torch.zeros(0, 3, 5, device=DEVICE), y).shape == (0, 3, 10)


def test_refused():
    with pytest.raises(ValueError, match=r"\[\*, 2f\]"):
        K.forward(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[\*, 2f\]"):
        K.swiglu(torch.zeros(2, 0, device=DEVICE))
    with pytest.raises(TypeError, match="floating-point"):
        K.swiglu(torch.zeros(2, 4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        K.forward(torch.zeros(2, 4, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="grad_out has shape"):
        K.backward(torch.zeros(2, 3, device=DEVICE), torch.zeros(2, 4, device=DEVICE))


def test_dispatch():
    """``swiglu`` takes the kernels exactly for CUDA tensors (``supported``); elsewhere the torch reference."""
    y, go = make((5,), 3, torch.float32, seed=6)
    x = y.clone().requires_grad_(True)
    out = K.swiglu(x)
    out.backward(go)
    if DEVICE == "cuda":
        assert out.grad_fn.name() == "SwiGLUKernelBackward"
    else:
        assert not K.supported(y)
        assert torch.equal(out, K.reference(y))
    want_out, want_grad = exact(y, go)
    close(out, want_out, tol(torch.float32), 1.0)
    close(x.grad, want_grad, tol(torch.float32), 1.0)


def composed(y, p, go):
    """Today's expert activation, op for op: the SwiGLU kernel, torch's product with the row scale and its cast,
    autograd's backward (the broadcast product's row sum for the scale)."""
    x, q = y.detach().clone().requires_grad_(True), p.detach().clone().requires_grad_(True)
    a = K.SwiGLUKernel.apply(x)
    out = (a * q[:, None]).to(a.dtype)
    out.backward(go)
    return out.detach(), x.grad, q.grad


def scaled(y, p, go):
    x, q = y.detach().clone().requires_grad_(True), p.detach().clone().requires_grad_(True)
    out = K.SwiGLUScaledKernel.apply(x, q)
    out.backward(go)
    return out.detach(), x.grad, q.grad


# the same bits as the composition where both round alike: float32 everywhere; bf16 / fp16 on the GPU (the
# interpreter's kernel casts truncate, torch's round to nearest)
SCALED_BITWISE = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,f", [(1, 1), (5, 3), (13, 37), (37, 20)])
def test_scaled_swiglu_is_the_activation_times_the_row_scale(n, f, dtype, monkeypatch):
    """``swiglu_scaled``'s kernels (the MoE experts' activation with the routing probability) against the
    composition they replace: output and d/dy bit for bit, d/dscale to float32 rounding (another order of the
    row sum; in a half dtype torch rounds each product first); also with many column blocks (the row sum's parts added after)."""
    g = torch.Generator().manual_seed(n * 100 + f)
    y, go = make((n,), f, dtype, seed=n + f)
    p = torch.rand(n, generator=g).to(DEVICE, torch.float32 if dtype == torch.float32 else dtype)  # the router's
    for block in (None, 8):
        if block:
            monkeypatch.setitem(K.CONFIG, "block_f", block)
        got, want = scaled(y, p, go), composed(y, p, go)
        if dtype in SCALED_BITWISE:
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        else:  # the interpreter: two truncating roundings against torch's to nearest, up to two units apart
            close(got[0], want[0], 2 * tol(dtype), want[0].abs().max().item())
            close(got[1], want[1], 2 * tol(dtype), want[1].abs().max().item())
        assert got[2].dtype == p.dtype and got[2].shape == (n,)
        rtol = {torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float16: 2**-9}[dtype]  # half: rounded products
        torch.testing.assert_close(got[2].double(), want[2].double(), rtol=rtol,
                                   atol=rtol * want[2].double().abs().max().item() + 1e-6)


def test_scaled_swiglu_entry_point_is_the_composition_off_the_kernels():
    """``swiglu_scaled`` where the kernels do not run (the CPU, a float64 scale): the torch ops themselves."""
    y = torch.randn(4, 6, dtype=torch.float64)
    p = torch.rand(4, dtype=torch.float64)
    assert torch.equal(K.swiglu_scaled(y, p), (K.reference(y) * p[:, None]).to(y.dtype))


def test_scaled_swiglu_wants_one_scale_per_row():
    """A scale that would broadcast (one value for all rows) is refused, not applied to every row."""
    y = torch.randn(4, 6)
    with pytest.raises(ValueError, match="one value per row"):
        K.swiglu_scaled(y, torch.rand(1))
