"""The fused linear's Triton block kernels (``packfwd.ops.linear_logprob``) inside
``packfwd.logits.fused_log_probs_and_entropy``, against float64 math and against the function's torch path:
log-probs, entropy and the gradients w.r.t. hidden, weight and a per-token temperature; bf16 / fp16 / fp32;
ignored labels; labels in every vocab block; a last block shorter than the others and inner steps that do not
divide a block (tiny ``CONFIG["block"]``, so every row spans many steps); a token mask; ``-inf``-free logits.

Runs on a CUDA GPU, or on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``; see ``_kernel_device``) at
small sizes.  ``packfwd.logits`` takes the kernels only for CUDA tensors, so on the CPU the ``kernel`` fixture
lets it take them for CPU tensors too, and counts the launches.

    PYTHONPATH=. python -m pytest -q tests/gpu/test_linear_logprob_kernel.py
"""

import pytest
import torch

from packfwd import logits as L
from packfwd.ops import linear_logprob as K

from ._kernel_device import DEVICE, gpu_only, needs_kernels

pytestmark = [needs_kernels, pytest.mark.filterwarnings("ignore::RuntimeWarning")]  # numpy's log(0) in the interpreter
triton = pytest.importorskip("triton")

ON_GPU = DEVICE == "cuda"


@pytest.fixture
def kernel(monkeypatch):
    """Counts the forward kernel's launches (one per vocab block); on the CPU lets the fused linear take the
    kernels; a tiny inner step off the GPU (many steps per block)."""
    calls = []

    def counted(raw, *args, run=K.accumulate_stats):
        calls.append(raw.shape)
        return run(raw, *args)

    monkeypatch.setattr(K, "accumulate_stats", counted)
    if not ON_GPU:
        monkeypatch.setattr(L, "_use_head_kernel", lambda hidden: hidden.dtype in K.DTYPES)
        monkeypatch.setitem(K.CONFIG, "block", 16)
    return calls


def make(t, v, h, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    hidden = torch.randn(t, h, generator=g, device=DEVICE).to(dtype)
    weight = (torch.randn(v, h, generator=g, device=DEVICE) * 3 / h**0.5).to(dtype)
    labels = torch.randint(0, v, (t,), generator=g, device=DEVICE)
    labels[::5] = -100
    temperature = torch.rand(t, generator=g, device=DEVICE) + 0.5
    w = torch.randn(2, t, generator=g, device=DEVICE)
    rows = torch.rand(t, generator=g, device=DEVICE) > 0.25
    return hidden, weight, labels, temperature, w, rows


def fused(hidden, weight, labels, temperature, w, rows, chunk):
    """Outputs and the gradients of (hidden, weight, temperature) of ``sum(w0 logp + w1 ent)``."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (hidden, weight, temperature)]
    out = L.fused_log_probs_and_entropy(leaves[0], leaves[1], labels, temperature=leaves[2], token_mask=rows,
                                        chunk_size=chunk)
    ((out["log_probs"] * w[0]).sum() + (out["entropy"] * w[1]).sum()).backward()
    return [out["log_probs"].detach(), out["entropy"].detach()] + [x.grad for x in leaves]


def float64(hidden, weight, labels, temperature, w, rows):
    """The same from float64 autograd on logits rounded to the inputs' dtype (as the head rounds them)."""
    leaves = [x.detach().double().requires_grad_(True) for x in (hidden, weight, temperature)]
    raw = (hidden @ weight.T).double()  # the head's logits, in the inputs' dtype
    raw = raw + (leaves[0] @ leaves[1].T - (leaves[0] @ leaves[1].T).detach())  # their gradient, in float64
    lsm = torch.log_softmax(raw / leaves[2][:, None], -1)
    lp = torch.where(labels >= 0, lsm.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0) * rows
    ent = -(lsm.exp() * lsm).sum(-1) * rows
    ((lp * w[0]).sum() + (ent * w[1]).sum()).backward()
    return [lp.detach(), ent.detach()] + [x.grad for x in leaves]


def tols(dtype):
    # outputs from the same rounded logits; gradients are rounded to the inputs' dtype on the way to matmuls
    return {torch.bfloat16: 3e-2, torch.float16: 5e-3}.get(dtype, 2e-5)


SIZES = [(9, 1, 8, 4), (13, 100, 16, 32), (9, 203, 8, 64)] if not ON_GPU else [(64, 5003, 64, 1024),
                                                                             (300, 131072 + 77, 128, None)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"t{s[0]}-v{s[1]}")
def test_kernels_against_float64(size, dtype, kernel):
    t, v, h, chunk = size
    inputs = make(t, v, h, dtype, seed=v)
    got = fused(*inputs, chunk)
    want = float64(*inputs)
    blocks = -(-v // (chunk or v))
    assert len(kernel) == blocks or chunk is None, (len(kernel), blocks)
    tol = tols(dtype)
    for name, a, b in zip(("log_probs", "entropy", "hidden", "weight", "temperature"), got, want):
        scale = float(b.abs().max()) or 1.0
        torch.testing.assert_close(a.double(), b, atol=tol * scale, rtol=tol, msg=name)


def test_kernels_match_the_torch_path(kernel, monkeypatch):
    """fp32, several blocks: the kernel path and the torch path of the same function agree closely."""
    inputs = make(12, 150, 16, torch.float32, seed=3)
    got = fused(*inputs, 40)
    assert len(kernel) == 4
    monkeypatch.setattr(L, "_use_head_kernel", lambda hidden: False)
    want = fused(*inputs, 40)
    assert len(kernel) == 4  # the torch path launched nothing
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


def test_sum_pi_squared_on_the_kernel_path(kernel):
    """``sum_pi_squared=True`` through the kernels' blocks (several, and only the selected rows in fixed slots):
    ``sum softmax(x / T) ** 2`` written here, 0 at the rows left out."""
    hidden, weight, labels, temperature, _, rows = make(12, 150, 16, torch.float32, seed=4)
    out = L.fused_log_probs_and_entropy(hidden, weight, labels, temperature=temperature, token_mask=rows,
                                        token_count=int(rows.sum()) + 1, chunk_size=40, sum_pi_squared=True)
    assert len(kernel) == 4
    p = torch.softmax((hidden @ weight.T).double() / temperature.double()[:, None], -1)
    want = torch.where(rows, (p * p).sum(-1), 0.0)
    torch.testing.assert_close(out["sum_pi_squared"].double(), want, atol=1e-6, rtol=1e-5)


def test_launchers_fold_blocks_in_place():
    """``accumulate_stats`` over two blocks of one row set equals one call over the whole vocab."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    raw = torch.randn(6, 50, generator=g, device=DEVICE) * 4
    inv = torch.rand(6, generator=g, device=DEVICE) + 0.5
    labels = torch.tensor([0, 20, 49, -100, 30, 5], device=DEVICE)
    whole, split = K.new_stats(6, DEVICE, True), K.new_stats(6, DEVICE, True)
    K.accumulate_stats(raw, inv, labels, 0, *whole)
    K.accumulate_stats(raw[:, :30], inv, labels, 0, *split)
    K.accumulate_stats(raw[:, 30:], inv, labels, 30, *split)
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    z = (raw - whole[0][:, None]) * inv[:, None]
    torch.testing.assert_close(whole[1], z.exp().sum(-1), atol=1e-5, rtol=1e-5)
    hit = labels >= 0
    torch.testing.assert_close(whole[3][hit], raw[hit].gather(1, labels[hit][:, None])[:, 0])


@gpu_only
def test_dispatch_on_cuda():
    """On CUDA the fused linear takes the kernels by itself, tensor temperature included."""
    inputs = make(32, 1000, 32, torch.bfloat16, seed=5)
    assert L._use_head_kernel(inputs[0])
    got = fused(*inputs, 256)
    assert all(torch.isfinite(x).all() for x in got)
