"""The fused Triton RMSNorm (+ residual add) kernels (``packfwd.ops.rmsnorm``) against float64 math and against
``torch.nn.functional.rms_norm``: values and the gradients of x, weight and residual, fp32 / bf16 / fp16, widths
that are not powers of 2, 1 to 37 rows, several rows per backward program, an expanded (stride-0) upstream
gradient, bitwise equal on a second run; and ``packfwd.models.norm.RMSNorm(fused=True)``.

Runs on a CUDA GPU, or on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``; see ``_kernel_device``) at the
same tiny sizes (under 20 s).  The interpreter rounds float32 to bf16 by truncation (its ``_convert_float``; the
GPU rounds to nearest even), so there bf16 outputs hold to one bf16 step of torch's, not bit for bit; the bitwise
comparisons with torch (the residual sum, fp32 outputs) are GPU-only where they depend on that rounding.

    TRITON_INTERPRET=1 PYTHONPATH=. python -m pytest -q tests/gpu/test_rmsnorm_kernel.py
"""

import pytest
import torch
import torch.nn.functional as F

from packfwd.ops import rmsnorm as K

from ._kernel_device import DEVICE, gpu_only, needs_kernels

pytestmark = [needs_kernels]
triton = pytest.importorskip("triton")

ON_GPU = DEVICE == "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# one float32 rounding step of the output dtype, relative (bf16: 8 bits of mantissa, fp16: 11)
STEP = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


def make(rows, h, dtype, seed, residual=True):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = (torch.randn(rows, h, generator=g, device=DEVICE) * 2).to(dtype)
    w = (1 + 0.5 * torch.randn(h, generator=g, device=DEVICE)).to(dtype)
    r = (torch.randn(rows, h, generator=g, device=DEVICE)).to(dtype) if residual else None
    gy = torch.randn(rows, h, generator=g, device=DEVICE).to(dtype)
    gs = torch.randn(rows, h, generator=g, device=DEVICE).to(dtype)
    return x, w, r, gy, gs


def run(x, w, r, gy, gs, eps, kernel):
    """Outputs and gradients (x, weight, residual) of ``sum(y gy) + sum(total gs)``, kernel or float64 math."""
    if kernel:
        xs = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, w, r)]
    else:  # float64 math from the same rounded inputs; the sum x + residual rounded to x's dtype as torch does
        xs = [t.detach().double().requires_grad_(True) if t is not None else None for t in (x, w, r)]
    out = K.rms_norm(xs[0], xs[1], eps, residual=xs[2], kernel=kernel)
    y, total = out if r is not None else (out, None)
    loss = (y * gy.to(y.dtype)).sum() + ((total * gs.to(total.dtype)).sum() if total is not None else 0)
    grads = torch.autograd.grad(loss, [t for t in xs if t is not None])
    return y, total, grads


def close(got, want, dtype, what):
    """Each entry within a few rounding steps of dtype, relative to the largest entry of the row-scale."""
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert err <= 4 * STEP[dtype] * scale + 1e-6, (what, dtype, err, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,h", [(1, 8), (5, 100), (37, 67), (13, 256)])
@pytest.mark.parametrize("residual", [False, True])
def test_against_float64(dtype, rows, h, residual):
    x, w, r, gy, gs = make(rows, h, dtype, seed=rows * 1000 + h, residual=residual)
    y, total, grads = run(x, w, r, gy, gs, 1e-6, kernel=True)
    assert y.dtype == dtype and y.shape == x.shape and all(g.dtype == dtype for g in grads)
    # the float64 reference: the residual sum rounded to dtype first (what the kernel norms), then exact math
    v = x if r is None else (x + r)
    y64, _, g64 = run(v, w, None, gy, gs, 1e-6, kernel=False)
    close(y, y64, dtype, "y")
    if r is not None:
        assert torch.equal(total, x + r) or (not ON_GPU and dtype == torch.bfloat16)
        close(total, x.double() + r.double(), dtype, "x + residual")
        # d/dx = d/dresidual = d(norm)/dv + gs (the gradient reaching the returned sum)
        close(grads[0], g64[0] + gs.double(), dtype, "dx")
        assert torch.equal(grads[0], grads[2])
        close(grads[1], g64[1], dtype, "dweight")
    else:
        close(grads[0], g64[0], dtype, "dx")
        close(grads[1], g64[1], dtype, "dweight")


@pytest.mark.parametrize("dtype", DTYPES)
def test_against_torch_rms_norm(dtype):
    """Same math as torch.nn.functional.rms_norm (float32 inside, one rounding to x's dtype), gradients too."""
    x, w, _, gy, _ = make(19, 96, dtype, seed=7, residual=False)
    xk, wk = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    xt, wt = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    yk = K.rms_norm(xk, wk, 1e-5, kernel=True)
    yt = F.rms_norm(xt, (96,), wt, 1e-5)
    (yk * gy).sum().backward()
    (yt * gy).sum().backward()
    for got, want, what in ((yk, yt, "y"), (xk.grad, xt.grad, "dx"), (wk.grad, wt.grad, "dweight")):
        close(got, want, dtype, what)


def test_bitwise_run_to_run_and_many_rows_per_program(monkeypatch):
    """Two runs give the same bits (no atomics); with 4-row tiles (10 tiles over 37 rows, the last one 1 row),
    3 backward programs (4, 4 and 2 tiles) agree with one program per tile, and one row per tile, to float32
    rounding, dx and y bit for bit."""
    x, w, r, gy, gs = make(37, 67, torch.bfloat16, seed=3)
    first = run(x, w, r, gy, gs, 1e-6, kernel=True)
    second = run(x, w, r, gy, gs, 1e-6, kernel=True)
    for a, b in zip([first[0], first[1], *first[2]], [second[0], second[1], *second[2]]):
        assert torch.equal(a, b)
    f32 = (x.float(), w.float(), r.float(), gy.float(), gs.float())
    runs = {}
    for tile, programs in ((4 * 128, 3), (4 * 128, 64), (128, 64)):  # rows per tile: tile / 128 (h 67 -> 128)
        monkeypatch.setattr(K, "CONFIG", {**K.CONFIG, "programs": programs, "tile": tile})
        assert K.block_rows(67) == tile // 128
        runs[tile, programs] = run(*f32, 1e-6, kernel=True)
    base = runs[128, 64]
    for key, got in runs.items():
        assert torch.equal(got[0], base[0]) and torch.equal(got[2][0], base[2][0]), key  # y, dx: not the split
        torch.testing.assert_close(got[2][1], base[2][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_narrow_rows_of_qk_norm_many_to_a_tile(dtype):
    """QK-norm's rows: [tokens, heads, head_dim 16] -> 64 rows to a tile and many tiles per backward program
    (1500 rows, 24 tiles: the last one partial), against torch's rms_norm."""
    g = torch.Generator(device=DEVICE).manual_seed(7)
    x = torch.randn(300, 5, 16, generator=g, device=DEVICE).to(dtype)
    w = (1 + 0.5 * torch.randn(16, generator=g, device=DEVICE)).to(dtype)
    gy = torch.randn(300, 5, 16, generator=g, device=DEVICE).to(dtype)
    assert K.block_rows(16) == 64
    xk, wk = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    xt, wt = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    yk = K.rms_norm(xk, wk, 1e-6, kernel=True)
    yt = F.rms_norm(xt.float(), (16,), wt.float(), 1e-6)
    (yk.float() * gy.float()).sum().backward()
    (yt * gy.float()).sum().backward()
    for got, want, what in ((yk, yt, "y"), (xk.grad, xt.grad, "dx"), (wk.grad, wt.grad, "dweight")):
        close(got, want.to(got.dtype), dtype, what)


def test_leading_dims_expanded_grad_and_no_rows():
    """[s, b, heads, d] input as QK-norm sees it; ``y.sum()`` sends an expanded (stride-0) gradient; 0 rows."""
    x = torch.randn(3, 2, 4, 24, device=DEVICE)
    w = torch.rand(24, device=DEVICE) + 0.5
    xk, wk = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    xt, wt = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    K.rms_norm(xk, wk, 1e-6, kernel=True).sum().backward()
    F.rms_norm(xt, (24,), wt, 1e-6).sum().backward()
    torch.testing.assert_close(xk.grad, xt.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wk.grad, wt.grad, rtol=1e-5, atol=1e-5)
    empty = torch.zeros(0, 24, device=DEVICE, requires_grad=True)
    wk.grad = None
    K.rms_norm(empty, wk, 1e-6, kernel=True).sum().backward()
    assert empty.grad.shape == (0, 24) and torch.equal(wk.grad, torch.zeros_like(wk))


def test_bad_arguments():
    x, w = torch.ones(2, 4), torch.ones(4)
    with pytest.raises(ValueError, match="weight must be"):
        K.rms_norm(x, torch.ones(3), 1e-6)
    with pytest.raises(ValueError, match="residual must"):
        K.rms_norm(x, w, 1e-6, residual=torch.ones(2, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="eps"):
        K.rms_norm(x, w, -1.0)


def test_spec_rmsnorm_fused_switch(monkeypatch):
    """norm.RMSNorm(fused=True) takes the kernel where supported (on the CPU: made supported here), and equals the
    unfused module; off by default."""
    from types import SimpleNamespace

    from packfwd.models import norm

    config = SimpleNamespace(params_dtype=torch.float32, sequence_parallel=False)
    plain, fused = norm.RMSNorm(config, hidden_size=40, eps=1e-6), norm.RMSNorm(config, 40, 1e-6, fused=True)
    assert not plain.fused and fused.fused
    with torch.no_grad():
        plain.weight.copy_(torch.rand(40) + 0.5)
        fused.weight.copy_(plain.weight)
    plain, fused = plain.to(DEVICE), fused.to(DEVICE)
    calls = []
    monkeypatch.setattr(K, "supported", lambda x, w: calls.append(x.shape) or True)
    x = torch.randn(6, 40, device=DEVICE)
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-5, atol=1e-6)
    assert len(calls) == 1
    plain(x)
    assert len(calls) == 1  # the default module never asks


@gpu_only
def test_supported_on_gpu():
    x, w = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16), torch.ones(64, device="cuda")
    assert K.supported(x, w)
    assert not K.supported(x.cpu(), w.cpu())
    assert not K.supported(x.double(), w)
    assert not K.supported(torch.randn(2, K.MAX_H + 1, device="cuda"), torch.ones(K.MAX_H + 1, device="cuda"))
